"""A slice asked for by memory (``gpu_ram=20G`` alone), in the terms Ray grants: a fraction.

Ray shares a card by fraction (``num_gpus=0.5``) and knows nothing of its
memory, so a claim that asks for twenty gigabytes of one card has to be
turned into the share of a card that holds them. That needs the size of the
cluster's cards, and only the nodes know it: the kernel's own machine may
have no card at all, or other ones. So the size comes from the cluster.

What this module decides:

- **Each node with cards is asked once, by a tiny task pinned to it** that
  reads its cards as a local claim's do (NVML, else ``nvidia-smi``;
  :func:`fluksio_nb.gpu_usage.kernel_cards`). The task takes no core and no
  card, so a busy cluster answers at once; the answer is kept for the
  kernel's life, since a node's cards do not change under it. A node that
  could not read its cards is asked again at the next such claim: it may have
  been fixed.
- **The fraction is of the smallest card** of the nodes that have cards: Ray
  may put the task on any of them, and a share of a bigger card is more
  memory, never less. Rounded up to Ray's precision of 1/10000 of a card.
- **What cannot be sized is refused before anything is sent**, saying why
  and what to do: no node has a card, no node with cards reads them, or the
  slice is more than the smallest card holds.

The budget itself is held on the node as for ``gpus=1 gpu_ram=``: the task
is told the bytes, and the frameworks there their share of the card it got
(:mod:`.task_side`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from fluksio_nb.budget import human
from fluksio_nb.errors import BadClaim
from fluksio_nb.ray.connection import _alive_nodes, ray_connection
from fluksio_nb.resources import Resources

#: Ray counts a share of a resource in ten-thousandths.
RAY_PRECISION = 10_000

#: How long a kernel waits for its probes of the nodes' cards, in all.
PROBE_TIMEOUT_S = 60.0

#: Each node's cards' sizes in bytes, by Ray's node id, once read there.
_known: dict[str, tuple[int, ...]] = {}
_lock = threading.Lock()


def cards_of_this_node() -> tuple[int, ...] | None:
    """The size of each card this node reads, or ``None`` where it reads none: the probe."""
    from fluksio_nb.gpu_usage import kernel_cards

    reading = kernel_cards().read()
    if reading is None:
        return None
    return tuple(card.total_bytes for card in reading.cards if card.total_bytes)


def sized_for_ray(ray: Any, job: str, wanted: Resources) -> Resources:
    """``wanted`` as Ray grants it: a ``gpu_ram=`` slice as the fraction of a card it is.

    Any other claim is returned as it is. Raises :class:`BadClaim` where the
    cluster's cards cannot say how big the slice is.
    """
    if not (wanted.is_slice and not isinstance(wanted.gpus, float)):
        return wanted
    nodes = ray_connection.recent_nodes(job) or ray_connection.read_nodes(ray, job)
    sizes = node_card_sizes(ray, nodes)
    return wanted.model_copy(update={"gpus": fraction_of(wanted, nodes, sizes), "gpu_ram": None})


def node_card_sizes(ray: Any, nodes: Sequence[Mapping[str, Any]]) -> dict[str, tuple[int, ...]]:
    """The cards' sizes of each live node with cards, read there; a node that read none is left
    out."""
    with_cards = [
        node["NodeID"]
        for node in _alive_nodes(nodes)
        if node.get("Resources", {}).get("GPU", 0) > 0 and node.get("NodeID")
    ]
    with _lock:
        unread = [node for node in with_cards if node not in _known]
    if unread:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = ray_connection.remote(ray, cards_of_this_node)
        asked = {
            node: probe.options(
                num_cpus=0,
                num_gpus=0,
                max_retries=0,
                name="fluksio: read this node's cards",
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote()
            for node in unread
        }
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=PROBE_TIMEOUT_S)
        done = set(ready)
        for node, ref in asked.items():
            if ref not in done:
                continue
            try:
                sizes = ray.get(ref)
            except Exception:  # a node gone between the listing and the probe
                continue
            if sizes:
                with _lock:
                    _known[node] = tuple(int(size) for size in sizes)
    with _lock:
        return {node: _known[node] for node in with_cards if node in _known}


def fraction_of(
    wanted: Resources, nodes: Sequence[Mapping[str, Any]], sizes: Mapping[str, tuple[int, ...]]
) -> float | int:
    """The share of the smallest card that holds ``wanted``'s ``gpu_ram=``; whole if all of it."""
    asked = wanted.gpu_ram_bytes
    assert asked is not None
    said = f"gpu_ram={human(asked)} without gpus="
    if not any(node.get("Resources", {}).get("GPU", 0) > 0 for node in _alive_nodes(nodes)):
        raise BadClaim(
            f"{said} is a slice of one card, and no live node of this Ray cluster has a card. "
            "Start a node with cards (ray start --num-gpus=N), or drop gpu_ram=."
        )
    cards = [size for node_sizes in sizes.values() for size in node_sizes]
    if not cards:
        raise BadClaim(
            f"{said} cannot be turned into Ray's share of a card: no node of this cluster "
            "with cards could read their memory (NVML's library could not be loaded and "
            "nvidia-smi is not on the PATH of its Ray workers). Install the NVIDIA driver's "
            "tools on the nodes, or ask for the share itself: gpus=0.25 is a quarter of a card."
        )
    smallest = min(cards)
    if asked > smallest:
        raise BadClaim(
            f"{said} is a slice of one card, and the smallest card of this Ray cluster holds "
            f"{human(smallest)}. Ask for at most that, or for whole cards with a budget: "
            f"gpus=1 gpu_ram={human(asked)}."
        )
    share = math.ceil(asked / smallest * RAY_PRECISION) / RAY_PRECISION
    return 1 if share >= 1 else share
