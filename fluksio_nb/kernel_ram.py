"""An unclaimed kernel held to the admin's ``kernel_ram``, and told why when it is stopped.

Outside claims a kernel's memory has no limit: one ``pd.read_csv`` of a big
file pushes the machine into the OOM killer, which may pick someone's
claimed worker. ``"kernel_ram": "8G"`` in ``machine.json`` gives every kernel
the Jupyter server starts a memory cgroup of its own with that limit, made
by the provisioner (:mod:`fluksio_nb.provisioner`) before the kernel runs a
line: the OS, not a reading every half second, stops a kernel past it.

What it decides:

- **Whose word it is.** The admin's, in the ``machine.json`` of the books in
  force (:func:`~fluksio_nb.kernel.books_in_force`): the prefix of the
  machine's books a kernel uses, else the machine's own ``/etc``. A user's
  settings do not set it; a kernel with no such line runs as before.
- **Claims are not the kernel's.** A claim's worker leaves the kernel's
  cgroup: for its claim's own where it has a ``ram=``, for one with no
  limit beside the kernel's otherwise (:mod:`fluksio_nb.confinement`,
  :mod:`fluksio_nb.memory_cap`). So ``%%claim ram=…`` is how a cell gets
  more than the kernel's share, and what the stop says to do.
- **The cap is what stopped it only if the OS says so**: the kernel died of
  ``SIGKILL`` and its cgroup counted an out-of-memory kill
  (``memory.events`` on v2, ``memory.oom_control`` on v1). Any other death
  is Jupyter's "kernel died", as before.
- **Said where the person looks**: in the server's log, and in the snapshot
  the panel polls (``kernel_stops``), whose notices show it over the
  notebook. Kept in the server's memory, the last few: a restarted server
  has no stopped kernels to tell of.
- **Nothing is left behind.** The cgroup is removed when the kernel ends,
  with whatever the kernel left in it (a warm worker that no claim holds);
  a server that was killed leaves its kernels' cgroups to the next sweep
  (:func:`~fluksio_nb.memory_cap.sweep_stale`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fluksio_nb.kernel import books_in_force
from fluksio_nb.memory_cap import CapNotMade, ClaimCgroup, cap_place
from fluksio_nb.settings import load_settings

#: How many stopped kernels the server remembers to tell of.
KEPT_STOPS = 20


@dataclass(frozen=True)
class KernelRam:
    """The admin's cap on one kernel's memory, and the file that says it."""

    cap_bytes: int
    config: Path


def kernel_ram_in_force(environ: Mapping[str, str]) -> KernelRam | None:
    """The ``kernel_ram`` for a kernel about to get ``environ``; None where the admin set none.

    Blocking: it reads the machine's config. Raises
    :class:`~fluksio_nb.machine.prefix.MachineSetupError` for a config that
    cannot be used.
    """
    from fluksio_nb.machine.run_dir import DEFAULT_RUN_DIR
    from fluksio_nb.machine.setup import Layout, read_config

    books = books_in_force(settings=load_settings(environ))
    layout = Layout("/")
    depth = len(DEFAULT_RUN_DIR.relative_to("/").parts)
    if books.mode == "machine" and books.where is not None:
        # The prefix `machine init` set these books up under.
        layout = Layout(Path(*books.where.parts[:-depth]) if depth else books.where)
    config = read_config(layout)
    if config.kernel_ram is None:
        return None
    return KernelRam(int(config.kernel_ram), layout.config)


def size_words(size: int) -> str:
    """A size as an admin writes it: ``8G``, ``512M``; decimal, as pydantic reads ``8G``."""
    for unit, factor in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


@dataclass(frozen=True)
class KernelStop:
    """A kernel the OS stopped at its ``kernel_ram``."""

    kernel_id: str
    at: float
    ram: KernelRam
    #: The most its cgroup held, where the cgroup counted it.
    peak_bytes: int | None

    def words(self) -> str:
        cap = size_words(self.ram.cap_bytes)
        return (
            f"This kernel was stopped by the OS: it went past the {cap} the admin allows a "
            f"kernel outside claims (kernel_ram={cap} in {self.ram.config}), and its "
            f"variables are lost. Run what needs more under a claim of its own, as "
            f"%%claim ram=SIZE (after %load_ext fluksio_nb): a claim's memory is not "
            f"counted under the kernel's."
        )

    def as_json(self) -> dict[str, object]:
        return {
            "kernel_id": self.kernel_id,
            "at": self.at,
            "kernel_ram": self.ram.cap_bytes,
            "peak_bytes": self.peak_bytes,
            "why": self.words(),
        }


_stops: collections.deque[KernelStop] = collections.deque(maxlen=KEPT_STOPS)
_stops_lock = threading.Lock()


def kernel_stops() -> list[KernelStop]:
    """The kernels this server's provisioners saw stopped at their cap, newest first."""
    with _stops_lock:
        return list(reversed(_stops))


class KernelCap:
    """One kernel's ``kernel_ram`` cgroup, from before its launch to its end."""

    def __init__(self, cgroup: ClaimCgroup, ram: KernelRam) -> None:
        self.cgroup = cgroup
        self.ram = ram

    @classmethod
    def make(cls, ram: KernelRam) -> KernelCap:
        """The cgroup, limited; raises :class:`~fluksio_nb.memory_cap.CapNotMade` with why not."""
        place = cap_place()
        if not place.available:
            raise CapNotMade(place.why_not)
        made = cls(ClaimCgroup.make(place, ram.cap_bytes, kernel=True), ram)
        # Nothing the kernel holds is charged elsewhere: it enters before it runs.
        made.cgroup.settle(0)
        return made

    def enter(self) -> None:
        """For ``preexec_fn``: the kernel's process goes in between fork and exec."""
        self.cgroup.enter_from_child()

    def ended(self, kernel_id: str, returncode: int | None) -> KernelStop | None:
        """The kernel ended: the stop, if the cap is what ended it; then the cgroup is removed."""
        stop = None
        # -9: SIGKILL, the OOM killer's signal; a kernel that exited or was
        # shut down was not stopped by its cap, whatever a child of it met.
        if returncode == -9 and self.cgroup.oom_kills():
            stop = KernelStop(kernel_id, time.time(), self.ram, self.cgroup.peak_bytes())
            with _stops_lock:
                _stops.append(stop)
        self.cgroup.remove()
        return stop
