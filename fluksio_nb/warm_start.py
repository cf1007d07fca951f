"""Nothing cold for a notebook's first claimed cell.

A notebook's first claimed cell was its slowest by far: 226 ms where the next
took 7.6, 2.3 times a cold ``%%script python3``, because it paid for being
first. A Python had to start for its worker and import IPython; the kernel
read its settings, took the machine's inventory and opened its books; the live
widget's modules were imported. ``%load_ext fluksio_nb`` now does all of that
in a thread of its own (:func:`begin`), while the user reads and types, so the
first claim finds it done.

What is decided here:

- **The worker started is the default claim's**: ``%%claim`` with nothing on
  the line, one core and no card. Its thread count matters little: a worker
  that has loaded no thread pool takes a claim's other count when the claim
  comes (:mod:`fluksio_nb.worker.pool`). What it does not take is a card, or
  a variable set on the claim's line; a claim asking for either starts a
  worker of its own, as before. Remembering each notebook's last shapes
  would add only those, and the usage records do not keep a claim's
  variables, so it was left out.
- **It costs nothing while idle but its memory** (about 40 MB, an interpreter
  with IPython): no claim is in the books for it, so it holds no share and
  nobody waits for it; it sleeps on two descriptors with no timeout; and it
  does not age out of the pool until it has run a claim.
- **It ends with the kernel**: closed with the pool when the kernel exits,
  and otherwise gone on its own as soon as the kernel is, killed or not
  (:func:`fluksio_nb.worker.lifetime.leave_with_the_kernel`).
- **The settings are read when the extension is loaded**, not at the first
  claim: the worker's cores and the books come from them.
  :func:`fluksio_nb.kernel.forget_accountant` still reads them again.
- **Nothing fails for it.** Settings that cannot be read or a worker that
  cannot start are met again by the first claim, which says what is wrong;
  here they only mean that the first claim starts cold.
- ``warm_start: false`` (``FLUKSIO_WARM_START=0``) turns it off, for a
  machine where many kernels load the extension and few of them claim.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from fluksio_nb.books import Allocation
from fluksio_nb.env import derive_env
from fluksio_nb.flavors import resolve_flavor
from fluksio_nb.kernel import accountant, settings
from fluksio_nb.resources import Resources
from fluksio_nb.worker.client import Worker
from fluksio_nb.worker.pool import kernel_pool

_warming: threading.Thread | None = None
_started: list[Worker] = []


def begin(*also: Callable[[], object]) -> None:
    """Warm up in a thread of its own: the books, a worker, then each of ``also``.

    ``also`` is what the caller's own first claim will need, such as the
    widget's modules, which this module cannot import.
    """
    global _warming
    _warming = threading.Thread(target=warm_up, args=also, name="fluksio-warm-start", daemon=True)
    _warming.start()


def warm_up(*also: Callable[[], object]) -> None:
    """Everything a first claim would do before its cell, short of taking a share."""
    with contextlib.suppress(Exception):
        if not settings().warm_start:
            return
        worker = kernel_pool().prestart(likeliest_shape())
        if worker is not None:
            _started.append(worker)
        # The books, while the worker starts: a user's own service is started
        # now, if none runs, rather than at the first claim.
        accountant()
        for step in also:
            step()


def likeliest_shape() -> dict[str, str]:
    """The derived environment of a claim that says nothing: the default claim's."""
    wanted = resolve_flavor(Resources(), settings())
    return derive_env(wanted, Allocation(cpus=wanted.cpus))


def wait(timeout: float = 30.0) -> bool:
    """Whether the warm-up is over, with its worker ready, within ``timeout`` seconds.

    For benchmarks and tests that time a first claim as a user meets it,
    a moment after loading the extension.
    """
    deadline = time.monotonic() + timeout
    if _warming is not None:
        _warming.join(timeout)
        if _warming.is_alive():
            return False
    for worker in _started:
        if not worker.wait_until_ready(max(0.0, deadline - time.monotonic())):
            return False
    return True
