"""Reaching the Ray cluster, and what a kernel keeps of its connection to it.

A claim ``--on ray`` needs Ray, a cluster, and a few things made once per
connection that would otherwise cost every cell: the remote functions, the
task shaped for each claim's options, the kernel's mailbox actor, the
cluster's nodes as last read. Ray connects a process, not an object, so all
of it lives in one :class:`RayConnection` per kernel process,
:data:`ray_connection`.

What this module decides:

- **Ray is an optional extra.** Without it, ``--on ray`` says how to install
  it (:data:`INSTALL_HINT`).
- **Which cluster.** ``--on ray`` is the cluster this kernel is connected to,
  or ``RAY_ADDRESS``, or the cluster ``ray start`` on this machine named, or
  a new Ray of the kernel's own; ``--on ray://head:10001`` names one. A
  process talks to one cluster at a time, so a second address is refused
  while the first is connected.
- **Never another user's cluster by default.** ``ray start`` names its
  cluster in a file in ``/tmp/ray``, a directory any user can write to: a
  cluster named there is joined only if the process listening on its
  address is this user's (the OS says whose each listening socket is). Any
  other is left alone with a warning, and a Ray of the kernel's own is
  started: joining it would run the cell, and unpickle what comes back, as
  whoever runs it (:func:`address_to_join`).
- **Whether the cluster is the kernel's own machine.** When every live node
  is the machine the kernel runs on — a local Ray, the usual first step past
  one notebook — the object store is a detour, and values travel through the
  kernel's shared memory instead (:mod:`.claim`). Two processes are on one
  machine, as far as shared memory goes, when they read the same boot id,
  process table and user (:func:`this_machine`); a task that finds it is not
  raises :class:`ElsewhereThanTheKernel` before anything runs, and its job's
  cells go by the object store from then on.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

from fluksio_nb.errors import BadClaim, RayMissing
from fluksio_nb.stop_button import open_whole

INSTALL_HINT = (
    "--on ray needs Ray, which is not installed where this kernel runs: "
    "pip install 'fluksio_nb[ray]' (or pip install ray), then restart the kernel."
)

_RAY_ADDRESS = re.compile(r"^(ray://)?[A-Za-z0-9_.\-\[\]:]+:\d+$")

#: How long the nodes last read are trusted to say that a claim fits: a claim
#: refused by them is checked again at once, so only a node that went away
#: can make a claim wait in Ray's queue, as it can after any check.
_NODES_FRESH_S = 10.0

#: A process as :func:`this_machine` describes it: boot id, pid, start time, user.
Machine = tuple[str, int, float, int]


class ElsewhereThanTheKernel(Exception):
    """A task sent its values through the kernel's shared memory ran on another machine."""


def import_ray() -> Any:
    """The ``ray`` module, or :class:`RayMissing` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayMissing(INSTALL_HINT) from None
    return ray


class OthersRayCluster(UserWarning):
    """The Ray cluster this machine's ``ray start`` named is another user's: not joined."""


def address_to_join() -> str | None:
    """What plain ``--on ray`` passes to ``ray.init`` when the kernel is not connected.

    ``None`` where ``RAY_ADDRESS`` says (the user's own environment); the
    address ``ray start`` left on this machine, if this user's process
    listens there; otherwise ``"local"``, a new Ray of the kernel's own.
    """
    if os.environ.get("RAY_ADDRESS"):
        return None
    named = _named_by_ray_start()
    if named is None:
        return "local"
    path, address = named
    port = address.rpartition(":")[2]
    listeners = _listening_uids(int(port)) if port.isdigit() else set()
    if listeners == {os.geteuid()}:
        return address
    whose = ", ".join(f"uid {uid}" for uid in sorted(listeners)) or "nobody"
    warnings.warn(
        f"--on ray: {path} names a Ray cluster at {address}, run by {whose}, not by you; "
        "a cell run there would run as them. Started a Ray of your own instead. To use "
        "a cluster you trust, name it: --on ray://host:port, or ray.init(address=...) first.",
        OthersRayCluster,
        stacklevel=2,
    )
    return "local"


def _named_by_ray_start() -> tuple[str, str] | None:
    """The file ``ray start`` names its cluster in, and the address it holds, if any."""
    try:
        from ray._common.utils import get_ray_address_file

        path = get_ray_address_file(None)
    except (ImportError, AttributeError):
        import tempfile

        path = os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")
    try:
        # Anyone may have put anything there: a link, a pipe that never ends.
        fd = open_whole(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, 512).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return (path, text) if _RAY_ADDRESS.match(text) and "://" not in text else None


def _listening_uids(port: int) -> set[int]:
    """The users whose processes listen on TCP ``port`` here, as the OS tells them."""
    uids = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    # local address "HEXIP:HEXPORT", state 0A is LISTEN, then the uid.
                    listening = len(fields) > 7 and fields[3] == "0A"
                    if listening and int(fields[1].rpartition(":")[2], 16) == port:
                        uids.add(int(fields[7]))
        except OSError:
            continue
    return uids


def parse_target(target: str) -> str | None:
    """The address ``--on`` names; ``None`` for plain ``ray``."""
    target = target.strip()
    if target == "ray":
        return None
    if _RAY_ADDRESS.match(target):
        return target
    raise BadClaim(
        f"--on {target!r} is not a Ray cluster: write --on ray for the cluster this kernel "
        "is connected to, or an address such as --on ray://head:10001."
    )


def _through_client(ray: Any) -> bool:
    """Whether this kernel reaches the cluster through Ray Client (``ray://``)."""
    try:
        return bool(ray.util.client.ray.is_connected())
    except AttributeError:
        return False


def _job_of(ray: Any) -> str:
    """The job this kernel is in on its cluster: a new one after each ``ray.init``."""
    return str(ray.get_runtime_context().get_job_id())


def _gcs_address(ray: Any) -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:
        return None


def _alive_nodes(nodes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The nodes Ray says are alive (``Alive`` from ``ray.nodes()``, ``alive`` elsewhere)."""
    return [node for node in nodes if node.get("Alive", node.get("alive"))]


# -----------------------------------------------------------------------------
# The kernel's machine
# -----------------------------------------------------------------------------


@functools.cache
def this_machine() -> Machine | None:
    """This machine and this process, as any process on it sees them (:func:`_machine_of`)."""
    return _machine_of(os.getpid())


def _machine_of(pid: int) -> Machine | None:
    """The machine and one process on it, as seen from here: boot id, pid, start time, user.

    Two processes read the same for a pid only if they run under one kernel
    and see one process table, which is what it takes for one to map the
    other's shared-memory files (by ``/proc/<pid>/fd``, for a kept one).
    ``None`` where that cannot be read: then nothing is shared.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
        process = psutil.Process(pid)
        return boot, pid, process.create_time(), process.uids().effective
    except (OSError, psutil.Error):
        return None


# -----------------------------------------------------------------------------
# The connection
# -----------------------------------------------------------------------------


class RayConnection:
    """This kernel's connection to a Ray cluster, and what is kept for it between claims.

    Process-wide, because Ray's connection is: ``ray.init`` connects the
    whole process, to one cluster at a time, and every claim of the kernel
    runs its tasks through it. So there is one of these per kernel process,
    :data:`ray_connection`, and what it keeps (remote functions, shaped
    tasks, the mailbox actor, the nodes last read) is made once for all the
    kernel's claims rather than once per cell.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Held while connecting, which can take seconds: apart from _lock, so that
        #: the monitor's snapshot never waits for it.
        self._connecting = threading.Lock()
        #: The address this module connected to, when it made the connection itself.
        self.connected_to: str | None = None
        #: ``ray.remote`` of each function and actor class, made once per process.
        self._remote: dict[Any, Any] = {}
        #: The task with each claim's options.
        self._shaped: dict[Any, Any] = {}
        #: The mailbox actor of this kernel's current Ray connection: its job, name and handle.
        self._mailboxes: tuple[str, str, Any] | None = None
        #: The cluster's nodes as last read, with the job and the time they were read in.
        self._nodes_seen: tuple[str, float, list[Any]] | None = None
        #: The jobs whose tasks were found running off the kernel's machine although
        #: every node said it was this one: they send their values by the object store.
        self.elsewhere: set[str] = set()
        #: This kernel's claims on Ray that have not ended, for the monitor.
        self._live: dict[int, Any] = {}

    def connect(self, target: str) -> Any:
        """The ``ray`` module, connected to the cluster ``--on`` names."""
        address = parse_target(target)
        ray = import_ray()
        with self._connecting:
            if ray.is_initialized():
                if address is None or address == self.connected_to:
                    return ray
                current = self.connected_to or _gcs_address(ray) or "another address"
                if address == current:
                    return ray
                raise BadClaim(
                    f"--on {address}: this kernel is already connected to the Ray cluster at "
                    f"{current}, and a process talks to one cluster at a time. Use --on ray "
                    "for that one, or run ray.shutdown() first."
                )
            ray.init(address=address or address_to_join())
            self.connected_to = address
        return ray

    def remote(self, ray: Any, made: Callable[..., Any]) -> Any:
        """``ray.remote(made)``, for a task's function or an actor's class, made once."""
        with self._lock:
            remote = self._remote.get(made)
            if remote is None:
                remote = self._remote[made] = ray.remote(made)
            return remote

    def shaped(self, ray: Any, task: Callable[..., Any], options: Mapping[str, Any]) -> Any:
        """The task with a claim's options, once per shape: making it costs more than the call."""
        key = (task, repr(sorted(options.items())))
        remote = self.remote(ray, task)
        with self._lock:
            shaped = self._shaped.get(key)
            if shaped is None:
                if len(self._shaped) >= 64:
                    self._shaped.clear()
                shaped = self._shaped[key] = remote.options(**options)
            return shaped

    def mailboxes(self, ray: Any, job: str, actor: type) -> tuple[str, Any]:
        """This kernel's mailbox actor, by name and handle, made on first use for each job.

        Tasks are given its name, not its handle: a handle passed to a task costs
        the call about half a millisecond, and the task's process keeps the handle
        it looked up for the next claim (:mod:`.task_side`).
        """
        actor_class = self.remote(ray, actor)
        with self._lock:
            if self._mailboxes is None or self._mailboxes[0] != job:
                name = f"fluksio-mailboxes-{uuid.uuid4().hex}"
                # No CPU: it only holds text, and must never wait behind the claims it serves.
                handle = actor_class.options(num_cpus=0, name=name).remote()
                self._mailboxes = (job, name, handle)
            return self._mailboxes[1], self._mailboxes[2]

    def forget_mailboxes(self) -> None:
        """Let the next claim make a new mailbox actor: this one's process has died."""
        with self._lock:
            self._mailboxes = None

    def recent_nodes(self, job: str) -> list[Any] | None:
        """The cluster's nodes as last read in this job, if that was a few seconds ago at most."""
        seen = self._nodes_seen
        if seen is not None and seen[0] == job and time.monotonic() - seen[1] < _NODES_FRESH_S:
            return seen[2]
        return None

    def read_nodes(self, ray: Any, job: str) -> list[Any]:
        """The cluster's nodes as they are now, kept as the nodes last read."""
        now = time.monotonic()
        nodes = ray.nodes()
        self._nodes_seen = (job, now, nodes)
        return nodes

    def cluster_machine(self, ray: Any, job: str) -> Machine | None:
        """The kernel's machine, if every live node of the cluster is it; otherwise ``None``.

        A driver always talks to the node on its own machine, so a cluster whose
        only live node is the driver's runs every task here. The nodes are those
        a claim's fit was last checked against, a few seconds old at most; a node
        that joined since is caught by the task itself (:class:`ElsewhereThanTheKernel`).
        """
        seen = self._nodes_seen
        if job in self.elsewhere or seen is None or seen[0] != job:
            return None
        mine = ray.get_runtime_context().get_node_id()
        alive = [node.get("NodeID") for node in _alive_nodes(seen[2])]
        if not alive or any(node != mine for node in alive):
            return None
        return this_machine()

    def add_claim(self, claimed: Any) -> None:
        """Count a claim among this kernel's live ones until :meth:`drop_claim`."""
        with self._lock:
            self._live[id(claimed)] = claimed

    def drop_claim(self, claimed: Any) -> None:
        with self._lock:
            self._live.pop(id(claimed), None)

    def claims(self) -> list[Any]:
        """This kernel's claims on Ray that have not ended."""
        with self._lock:
            return list(self._live.values())


#: The one connection of this kernel process (see :class:`RayConnection`).
ray_connection = RayConnection()
