"""Kernels Jupyter starts here get the fair share of the cores no claim holds.

The thread variables are read when a library is imported, so the only place
to put them for a kernel's own cells is the kernel's environment, at launch,
and only whoever launches the kernel can put them there. jupyter_client asks
a *kernel provisioner* to launch each kernel. This one is jupyter_client's own
:class:`LocalProvisioner` with the fair share (:mod:`fluksio_nb.fair_share`)
added, so starting, interrupting, restarting and stopping a kernel are
unchanged.

The server extension (:mod:`fluksio_nb.server`, enabled by the config file the
package installs into ``etc/jupyter/jupyter_server_config.d``) makes it the
provisioner of every kernelspec that names none (:func:`make_it_the_default`).
That file cannot name the provisioner itself: jupyter_server reads only
``jpserver_extensions`` from the ``.d`` directories. A kernelspec that names
its own provisioner keeps it, and so does a user who chose a default
(``KernelProvisionerFactory.default_provisioner_name`` in their config, or
``JUPYTER_DEFAULT_PROVISIONER_NAME``).

What it decides:

- **Cards through claims only, where the admin says so**
  (``"unclaimed_cards": false``): the kernel starts in a cgroup that opens
  no card (:mod:`fluksio_nb.unclaimed_cards`), removed as it is cleaned up.
  Under ``"kernel_ram"`` too, it enters both before it runs a line: one
  ``preexec_fn`` doing each in turn (:func:`in_turn`).
- **A kernel always starts.** Settings that cannot be used, or books that
  cannot be read, start it as Jupyter would without fluksio_nb, with a
  warning in the server's log. The kernel says what is wrong with its
  settings when it makes its first claim.
- **Settings are read at every launch**, from the environment the kernel is
  about to get, as the kernel itself will read them. ``fair_share: false`` in
  the config file (or ``FLUKSIO_FAIR_SHARE=0``) takes effect for the next
  kernel without restarting the server.
- **What the user set wins.** A thread variable already in the kernel's
  environment (the server's own, or the kernelspec's ``env``) is kept.
- **The kernel's threads, not its children.** Every thread of the kernel
  process is kept off the claimed cores; its child processes are not
  touched, because a claim's workers are the kernel's children and run on
  their own claim's cores. Children an unclaimed cell starts inherit the
  kernel's cores as they were when started.
- **One keeper for every kernel.** A thread of the server reads each set of
  books once a second and moves a kernel's threads only when the cores no
  claim holds have changed. It runs off the event loop, because reading the
  books blocks. A kernel that moved its own threads keeps them where it put
  them until the claims change.
- **The admin's ``kernel_ram``** holds each kernel in a memory cgroup it
  enters before it runs a line; when the cap is what ended it, the server's
  log and the panel say so (:mod:`fluksio_nb.kernel_ram`).
- **A kernel is the process it launched, not its number.** A kernel that
  died is reaped by the server's restarter seconds before its cleanup lets
  the keeper forget it, or never, once restarts have run out; its pid may
  meanwhile be any user's process, a claim's worker among them. A server
  run as root may move anyone's threads, so the keeper checks that the pid
  still names the process it launched (its start time) before each move.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import psutil
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import KernelProvisionerFactory, LocalProvisioner

from fluksio_nb.card_devices import name_after
from fluksio_nb.env import fair_share_env
from fluksio_nb.fair_share import FairShare, unclaimed
from fluksio_nb.inventory import confine_threads
from fluksio_nb.kernel import Books, books_in_force
from fluksio_nb.kernel_ram import KernelCap, kernel_ram_in_force
from fluksio_nb.memory_cap import ClaimCgroup
from fluksio_nb.overview import read_books
from fluksio_nb.settings import load_settings
from fluksio_nb.unclaimed_cards import hold_kernel_away

#: The name the package registers under ``jupyter_client.kernel_provisioners``.
PROVISIONER_NAME = "fluksio-fair-share"

#: How often the keeper reads the books. A claim's cores are shared with an
#: unclaimed kernel for at most this long after it is granted; a read costs
#: well under a millisecond of a core.
KEEP_EVERY_S = 1.0

log = logging.getLogger(__name__)


@dataclass
class _Kept:
    books: Books
    machine: frozenset[int]
    #: The cores its threads were last confined to.
    cores: frozenset[int]
    #: The kernel as launched, its pid with its start time (:meth:`_Keeper.keep` sets it).
    process: psutil.Process | None = None


class _Keeper:
    """Keeps every fair-share kernel of this process off the cores claims hold."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kernels: dict[int, _Kept] = {}
        self._thread: threading.Thread | None = None
        self._unreadable: set[Books] = set()

    def kernels(self) -> int:
        with self._lock:
            return len(self._kernels)

    def keep(self, pid: int, kept: _Kept) -> None:
        """Keep kernel ``pid``, just launched: not reaped yet, so the pid is still its own."""
        try:
            kept.process = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return
        with self._lock:
            self._kernels[pid] = kept
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fluksio-fair-share", daemon=True
                )
                self._thread.start()

    def release(self, pid: int, kept: _Kept | None = None) -> None:
        """Forget kernel ``pid``; only if it is still ``kept``, when that is given.

        A kernel's cleanup can come after its pid went to a kernel launched
        since, which must stay kept.
        """
        with self._lock:
            if kept is None or self._kernels.get(pid) is kept:
                self._kernels.pop(pid, None)

    def _run(self) -> None:
        while True:
            time.sleep(KEEP_EVERY_S)
            with self._lock:
                if not self._kernels:
                    self._thread = None
                    return
                kept = dict(self._kernels)
            snapshots: dict[Books, dict[str, Any] | None] = {}
            for pid, kernel in kept.items():
                if kernel.books.mode == "kernel":
                    # No claim another kernel can see is in them, and reading
                    # them means taking the inventory (NVML) every second.
                    continue
                if kernel.books not in snapshots:
                    snapshots[kernel.books] = self._read(kernel.books)
                snapshot = snapshots[kernel.books]
                if snapshot is None:
                    continue
                share = unclaimed(snapshot, kernel.machine)
                if share.cores == kernel.cores:
                    continue
                if kernel.process is None or not kernel.process.is_running():
                    # Gone, and its pid perhaps somebody else's by now.
                    self.release(pid)
                    continue
                kernel.cores = share.cores
                try:
                    if confine_threads(pid, share.cores) == 0:
                        self.release(pid)
                except OSError as error:
                    # A core taken offline, or a kernel this server may not
                    # move: it stays where it is, and the other kernels are
                    # still kept.
                    log.warning("fluksio_nb: kernel process %s cannot be moved: %s", pid, error)

    def _read(self, books: Books) -> dict[str, Any] | None:
        try:
            snapshot = read_books(books)
        except Exception as error:
            if books not in self._unreadable:
                log.warning(
                    "fluksio_nb: the books (%s) cannot be read, so kernels on them stay "
                    "on the cores they have: %s",
                    books.describe(),
                    error,
                )
                self._unreadable.add(books)
            return None
        self._unreadable.discard(books)
        return snapshot


_keeper = _Keeper()


def _reckon(environ: Mapping[str, str]) -> tuple[Books, frozenset[int], FairShare] | None:
    """The books, the machine's cores and the share left over; None when opted out.

    Blocking: the books are a file or a socket away.
    """
    settings = load_settings(environ)
    if not settings.fair_share:
        return None
    books = books_in_force(settings=settings)
    machine = frozenset(os.sched_getaffinity(0))
    return books, machine, unclaimed(read_books(books), machine)


class FairShareProvisioner(LocalProvisioner):
    """:class:`LocalProvisioner`, launching kernels with the fair share of the unclaimed cores."""

    _fair: tuple[Books, frozenset[int], FairShare] | None = None
    #: What the keeper keeps for the kernel this launched, to forget only that.
    _kept: _Kept | None = None
    #: Where the admin keeps cards to claims: the cgroup the kernel opens none in.
    _away: ClaimCgroup | None = None
    #: Whether that is the ``kernel_ram`` cgroup itself, as on cgroup v2.
    _away_is_ram: bool = False
    #: The kernel's ``kernel_ram`` cgroup, where the admin set one (:mod:`fluksio_nb.kernel_ram`).
    _ram: KernelCap | None = None
    #: How the kernel last ended, kept past jupyter_client's ``wait``, which forgets it.
    _returncode: int | None = None

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        kwargs = await super().pre_launch(**kwargs)
        env = kwargs["env"]
        self._returncode = None
        try:
            self._ram = await asyncio.to_thread(_kernel_cap, env)
        except Exception as error:
            self.log.warning(
                "fluksio_nb: kernel %s starts without the admin's kernel_ram cap: %s",
                self.kernel_id,
                error,
            )
        if self._ram is not None:
            kwargs["preexec_fn"] = self._ram.enter
        self._fair = None
        try:
            kernel_ram = None if self._ram is None else self._ram.cgroup
            self._away = await asyncio.to_thread(hold_kernel_away, env, kernel_ram)
            # On cgroup v2 the two are one cgroup: entered, named and removed as kernel_ram's.
            self._away_is_ram = self._away is not None and self._away is kernel_ram
        except Exception as error:
            self.log.warning(
                "fluksio_nb: kernel %s starts able to open every card, though the admin "
                "keeps cards to claims (unclaimed_cards): %s",
                self.kernel_id,
                error,
            )
        if not hasattr(os, "sched_setaffinity"):
            return kwargs
        try:
            self._fair = await asyncio.to_thread(_reckon, env)
        except Exception as error:
            self.log.warning(
                "fluksio_nb: kernel %s starts without its fair share of the cores: %s",
                self.kernel_id,
                error,
            )
            return kwargs
        if self._fair is not None:
            _, _, share = self._fair
            # This kernel is among those the cores are shared by.
            env.update(fair_share_env(share.cpus, _keeper.kernels() + 1, env))
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        if self._away is not None and not self._away_is_ram:
            # Under kernel_ram too: the kernel enters both before it runs a line.
            kwargs["preexec_fn"] = in_turn(kwargs.get("preexec_fn"), self._away.enter_from_child)
        try:
            connection_info = await super().launch_kernel(cmd, **kwargs)
        except BaseException:
            self._let_go_of_cards()
            raise
        if self._away is not None and not self._away_is_ram and self.pid is not None:
            name_after(self._away, self.pid)
        if self._fair is not None and self.pid is not None:
            books, machine, share = self._fair
            try:
                confine_threads(self.pid, share.cores)
            except OSError as error:
                self.log.warning(
                    "fluksio_nb: kernel %s runs on every core: %s", self.kernel_id, error
                )
            self._kept = _Kept(books, machine, share.cores)
            _keeper.keep(self.pid, self._kept)
        return connection_info

    async def poll(self) -> int | None:
        ended = await super().poll()
        if ended is not None and self.process is not None:
            self._returncode = ended
        return ended

    async def wait(self) -> int | None:
        # Without a process (already waited for) jupyter_client answers 0.
        waited = self.process is not None
        ended = await super().wait()
        if waited:
            self._returncode = ended
        return ended

    async def cleanup(self, restart: bool = False) -> None:
        if self.pid is not None and self._kept is not None:
            _keeper.release(self.pid, self._kept)
            self._kept = None
        ram, self._ram = self._ram, None
        if ram is not None:
            stop = await asyncio.to_thread(ram.ended, self.kernel_id, self._returncode)
            if stop is not None:
                self.log.warning("fluksio_nb: kernel %s: %s", self.kernel_id, stop.words())
        await super().cleanup(restart=restart)
        # Off the event loop: what the kernel left in it gets seconds to go.
        await asyncio.to_thread(self._let_go_of_cards)

    def _let_go_of_cards(self) -> None:
        away, self._away = self._away, None
        if away is not None and not self._away_is_ram:
            away.remove()


def in_turn(*steps: Callable[[], None] | None) -> Callable[[], None]:
    """One ``preexec_fn`` running each of ``steps`` in turn: a kernel may enter several cgroups."""
    chosen = [step for step in steps if step is not None]

    def enter() -> None:
        for step in chosen:
            step()

    return enter


def _kernel_cap(environ: Mapping[str, str]) -> KernelCap | None:
    """The cgroup holding a kernel about to get ``environ`` to the admin's ``kernel_ram``."""
    ram = kernel_ram_in_force(environ)
    return None if ram is None else KernelCap.make(ram)


def make_it_the_default(serverapp: Any) -> str | None:
    """Make kernels that name no provisioner start with the fair share; why not, if not.

    Run when the server extension loads, before the server takes a request,
    so before it starts any kernel.
    """
    factory = KernelProvisionerFactory.instance(parent=serverapp)
    chosen = serverapp.config.get("KernelProvisionerFactory", {})
    if "default_provisioner_name" in chosen or os.environ.get(factory.default_provisioner_name_env):
        return f"this server's config chose {factory.default_provisioner_name!r}"
    if not entry_points(group=factory.GROUP_NAME, name=PROVISIONER_NAME):
        # Naming a provisioner that is not registered stops every kernel from
        # starting: fluksio_nb importable, but not installed (its metadata
        # is another checkout's).
        return (
            f"the provisioner {PROVISIONER_NAME!r} is not registered in this environment; "
            "`pip install fluksio_nb` registers it"
        )
    factory.default_provisioner_name = PROVISIONER_NAME
    return None
