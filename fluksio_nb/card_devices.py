"""Cards the kernel holds: a claim's processes may open only its own cards' device nodes.

``CUDA_VISIBLE_DEVICES`` is read by CUDA, and by nothing else: a process that
unsets it, a library that opens ``/dev/nvidia0`` itself, or a kernel that never
claimed, uses any card, another claim's included. A device cgroup is the
kernel's: inside one, ``open`` of a node it denies fails with ``EPERM``
whatever the process asks. So where this process may make one, every claim on
a machine with cards runs in a cgroup that denies each card's node but its
own, and its status says so; elsewhere it says the variable alone holds it.

What it decides:

- **Which nodes a card is**: card ``N`` is ``/dev/nvidiaN``, character major
  195, minor ``N`` (:func:`card_node`), the driver's numbering. The control
  nodes every CUDA process needs (``nvidiactl``, minor 255; ``nvidia-modeset``,
  254; ``nvidia-uvm`` and ``nvidia-uvm-tools``, a major of their own) are never
  denied: they reach no card by themselves.
- **Every card's minor but the granted ones is denied** (0 to 253), not only
  the cards the books hand out: a card left out of the inventory, by
  ``CUDA_VISIBLE_DEVICES`` on the server say, is still nobody's to open. A
  claim with no cards opens none. A machine with no cards gets no cgroup.
- **Where**: cgroup v1's devices hierarchy, under the process's own devices
  cgroup, where root's and this user's alone (as the memory caps are:
  :mod:`fluksio_nb.memory_cap`). A v1 child cgroup can never open more than
  its parent, so a kernel the provisioner holds away from every card
  (:func:`hold_away_from_cards`) has its claims' cgroups made beside it, not
  below it: the worker leaves the kernel's cgroup for its claim's own. The
  kernel's is named after the kernel once it runs (:func:`name_after`), so
  that only the kernel's end lets it be swept.
- **cgroup v2 is held by a device program** where this process may load
  one and v1's devices controller is not there
  (:mod:`fluksio_nb.card_devices_v2`): the same rule, attached to the
  claim's v2 cgroup. Where it may not, the status says cards are held by
  the variable only, and why.

Making one costs 254 writes to ``devices.deny`` on one descriptor; measured
0.6 ms with its ``mkdir`` and ``rmdir`` (cgroup v1, two cores, median of 30).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from fluksio_nb.budget import CGROUP_V1, CGROUP_V2
from fluksio_nb.card_devices_v2 import find_v2_place, hold_cards_in
from fluksio_nb.claim_cgroups import CLAIM_NAME
from fluksio_nb.enforcement import Enforcement, cards_held
from fluksio_nb.inventory import CGROUP_ROOT, PROC_SELF_CGROUP, cgroup_paths
from fluksio_nb.memory_cap import (
    PARENT_NAME,
    CapNotMade,
    CapPlace,
    ClaimCgroup,
    _changed_by_others,
    _may_write,
    process_start,
)
from fluksio_nb.stop_button import open_whole, stop_held_back

#: The character major of the NVIDIA driver's card and control nodes.
CARD_MAJOR = 195
#: The minors a card can have: ``nvidia-modeset`` is 254, ``nvidiactl`` 255.
CARD_MINORS = range(254)
#: Where the driver makes the nodes.
DEVICE_DIR = Path("/dev")

#: What the claim cgroups of this module hold, as :class:`ClaimCgroup` names it.
CONTROLLER = "devices"


def card_node(card: int) -> tuple[Path, int, int]:
    """Card ``card``'s device node: its path, major and minor."""
    if card not in CARD_MINORS:
        raise ValueError(f"card {card} has no device node: cards are 0 to {CARD_MINORS[-1]}")
    return DEVICE_DIR / f"nvidia{card}", CARD_MAJOR, card


def find_devices_place(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> CapPlace:
    """Where this process may make cgroups that hold processes to some cards, or why not."""
    paths = cgroup_paths(proc_cgroup)
    if CONTROLLER not in paths:
        if "" in paths:
            return find_v2_place(paths[""], root)
        return CapPlace(None, why_not=f"{proc_cgroup} names no devices cgroup")
    mount = root / CONTROLLER
    own = mount / paths[CONTROLLER].lstrip("/")
    if not (own / "devices.deny").exists():
        return CapPlace(
            None, why_not=f"this process's devices cgroup {paths[CONTROLLER]} is not under {mount}"
        )
    base = own
    if CLAIM_NAME.match(own.name) and own.parent.name == PARENT_NAME:
        # A kernel held away from every card: a child could open no more.
        base = own.parent.parent
    if not (_may_write(base) and _may_write(base / "cgroup.procs")):
        return CapPlace(
            None, why_not=f"this user may not make cgroups under the devices cgroup {base}"
        )
    if (shared := _changed_by_others(mount, base)) is not None:
        return CapPlace(None, why_not=shared)
    return CapPlace(CGROUP_V1, parent=base / PARENT_NAME, home=own)


_places: dict[tuple[Path, Path], CapPlace] = {}
_places_lock = threading.Lock()


def devices_place(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> CapPlace:
    """:func:`find_devices_place`, found once per process: it cannot change under it."""
    with _places_lock:
        if (root, proc_cgroup) not in _places:
            _places[root, proc_cgroup] = find_devices_place(root, proc_cgroup)
        return _places[root, proc_cgroup]


def cards_held_here(place: CapPlace | None = None) -> Enforcement:
    """What holds a claim to its cards here: a devices cgroup, or the variable and why."""
    place = devices_place() if place is None else place
    return cards_held(place.version, place.why_not)


def hold_cards(
    place: CapPlace, granted: Iterable[int], share: ClaimCgroup | None = None
) -> ClaimCgroup:
    """A fresh cgroup whose processes may open only the ``granted`` cards' nodes.

    On cgroup v2, ``share`` is the claim's v2 cgroup if it has one already (its
    memory cap, its cpuset): the program goes there, and it is returned.
    Raises :class:`~fluksio_nb.memory_cap.CapNotMade`, having left nothing behind.
    """
    cards = set(granted)

    def hold(path: Path) -> None:
        if place.version == CGROUP_V2:
            hold_cards_in(path, cards)
        else:
            _deny_cards(path, cards)

    def not_held(path: Path, error: OSError) -> CapNotMade:
        return CapNotMade(f"{path} could not be held to its cards: {error.strerror or error}")

    if place.version == CGROUP_V2 and share is not None and share.version == CGROUP_V2:
        try:
            hold(share.path)
        except OSError as error:
            raise not_held(share.path, error) from None
        return share
    # Made, held and known as one step, as a memory cgroup is: a stop
    # landing between them would leave it there, and nothing to remove it.
    with stop_held_back():
        made = ClaimCgroup._new(place, 0, CONTROLLER)
        try:
            hold(made.path)
        except OSError as error:
            made.remove()
            raise not_held(made.path, error) from None
    return made


def hold_away_from_cards(place: CapPlace, share: ClaimCgroup | None = None) -> ClaimCgroup:
    """A cgroup for a kernel that may open no card: its claims' workers leave it for their own.

    On cgroup v2, ``share`` is the kernel's ``kernel_ram`` cgroup if it has one:
    a process is in one v2 cgroup, so the program goes on that one, and a
    second cgroup would take the kernel out of its memory cap.
    """
    return hold_cards(place, (), share)


def name_after(cgroup: ClaimCgroup, pid: int) -> None:
    """Name a kernel's cgroup after the kernel, once it runs: whose it is, for the sweep.

    Made before the kernel existed, it was named after the server that made
    it; a server killed before it removed it would have it swept, and the
    live kernel in it killed. Named after the kernel, it is swept only once
    the kernel is gone (:func:`~fluksio_nb.memory_cap.sweep_stale`). Left
    as it is where it cannot be renamed.
    """
    start = process_start(pid)
    if start is None:
        return
    kernels = cgroup.path.with_name(f"fluksio_nb-{pid}-{start}-0")
    with contextlib.suppress(OSError):
        os.rename(cgroup.path, kernels)
        cgroup.path = kernels


def _deny_cards(path: Path, granted: set[int]) -> None:
    fd = open_whole(path / "devices.deny", os.O_WRONLY)
    try:
        # One rule per write: the kernel parses each write as one.
        for minor in CARD_MINORS:
            if minor not in granted:
                os.write(fd, f"c {CARD_MAJOR}:{minor} rwm".encode())
    finally:
        os.close(fd)
