"""What the cards are doing: utilisation, memory, and which processes hold it.

People who share cards ask "who holds card 1, and how much of it?" more than
anything else, and the driver knows: it lists every process with memory on
a card. This module reads that list, with each card's utilisation and
memory, once for all the kernel's claims, and says whose each process is.

What it decides:

- **NVML first, then ``nvidia-smi``, then nothing.** NVML (``nvidia-ml-py``,
  a dependency) answers in microseconds and stays initialised for the
  kernel's life. ``nvidia-smi`` is two runs of a program, tens of milliseconds of CPU
  each: the fallback where the driver's library cannot be loaded. Its
  ``--query-gpu`` lists whole cards only, so MIG instances are read through
  NVML alone; through ``nvidia-smi`` they have no reading, never an idle one,
  and a card with MIG on is left out, its processes with it, rather than
  shown as a card whose memory nobody's claim holds.
  With neither there is no reading at all, never a card reported idle.
- **Cards are read at most every** :data:`GPU_INTERVAL_S`, not at the
  sampler's half second: the two ``nvidia-smi`` runs every half second
  would be a few percent of a core for a figure that moves slowly. Card
  memory past ``gpu_ram=`` is halted up to that much later; the frameworks'
  own caps, set from the same budget, act at once.
- **Nobody waits on the driver.** A pass runs in a thread of its own, one
  at a time, and whoever asks is answered with the last one: a driver that
  stopped answering must not stop the watch from halting claims.
- **A process is matched by any of its pids.** The driver names a process
  by one pid, which inside a container may be another namespace's. Each
  local process's ``NSpid`` (``/proc/<pid>/status``) lists its pid in every
  namespace this one can see, and a match on any of them is that process.
  A pid that matches no process here (or a process in each of two
  namespaces side by side) is kept and shown as outside this machine's
  view, never dropped: that memory is held all the same.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from pydantic import ByteSize

from fluksio_nb.mig import nvml_cards

#: How often the cards are read, at most, however many claims ask.
GPU_INTERVAL_S = 2.0

_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class CardProcess:
    """One process with memory on a card."""

    #: The pid the driver gave.
    driver_pid: int
    #: The same process's pid here, or ``None`` if it is not visible here.
    pid: int | None
    #: Memory it holds on the card; ``None`` where the driver does not say
    #: (some cards, and processes of other containers, under Windows' WDDM).
    used_bytes: int | None
    uid: int | None = None
    user: str | None = None


@dataclass(frozen=True, slots=True)
class CardReading:
    """One card as read in one pass."""

    index: int
    uuid: str
    #: Percent of the last sample period the card was busy; ``None`` if unsupported.
    utilisation_percent: float | None
    used_bytes: int | None
    total_bytes: int | None
    processes: tuple[CardProcess, ...]


@dataclass(frozen=True, slots=True)
class CardsReading:
    """Every card, read in one pass, and which source said so."""

    cards: tuple[CardReading, ...]
    source: str
    at: float

    def card(self, index: int) -> CardReading | None:
        return next((card for card in self.cards if card.index == index), None)


# -- reading -------------------------------------------------------------------


class _Nvml:
    """NVML, initialised once and kept so: each pass is then a few calls per card."""

    source = "nvml"

    def __init__(self, pynvml) -> None:
        self.nvml = pynvml
        pynvml.nvmlInit()

    def read(self) -> list[tuple[int, str, float | None, int | None, int | None, list]]:
        nvml = self.nvml
        cards = []
        # A card lost, or walled off from this process (NoPermission), is
        # left out, and every other card read as usual. A MIG instance is a
        # card: its memory and its processes are its own.
        for listed, handle in nvml_cards(nvml):
            try:
                busy = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except nvml.NVMLError:
                busy = None  # not supported on this card: unknown, not idle
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                card_used, card_total = int(memory.used), int(memory.total)
            except nvml.NVMLError:
                card_used = card_total = None  # unified memory (GB10): unknown, not empty
            held: dict[int, int | None] = {}
            for lister in (
                nvml.nvmlDeviceGetComputeRunningProcesses,
                nvml.nvmlDeviceGetGraphicsRunningProcesses,
            ):
                with contextlib.suppress(nvml.NVMLError):
                    for process in lister(handle):
                        used = getattr(process, "usedGpuMemory", None)
                        held[int(process.pid)] = None if used is None else int(used)
            cards.append(
                (
                    listed.id,
                    listed.uuid,
                    busy,
                    card_used,
                    card_total,
                    list(held.items()),
                )
            )
        return cards


class _NvidiaSmi:
    """``nvidia-smi``'s CSV: one run for the cards, one for the processes on them."""

    source = "nvidia-smi"

    def __init__(self, path: str) -> None:
        self.path = path

    def _csv(self, query: str) -> list[list[str]]:
        listing = subprocess.run(
            [self.path, query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            # A driver that answers takes milliseconds; one that does not is
            # given up on, and the next pass tries again.
            timeout=5,
            check=True,
        ).stdout
        return [
            [field.strip() for field in line.split(",")]
            for line in listing.splitlines()
            if line.strip()
        ]

    def read(self) -> list[tuple[int, str, float | None, int | None, int | None, list]]:
        cards = self._csv(
            "--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total,mig.mode.current"
        )
        apps = self._csv("--query-compute-apps=gpu_uuid,pid,used_memory")
        by_uuid: dict[str, list[tuple[int, int | None]]] = {}
        for row in apps:
            if len(row) >= 3 and _number(row[1]) is not None:
                used = _number(row[2])
                by_uuid.setdefault(row[0], []).append(
                    (int(row[1]), None if used is None else int(used * _MIB))
                )
        read = []
        for row in cards:
            if len(row) < 6 or _number(row[0]) is None:
                continue
            if row[5] == "Enabled":
                # Its instances are the cards, and this listing has none of them;
                # what it says of the whole card belongs to no claim's card.
                continue
            used, total = _number(row[3]), _number(row[4])
            read.append(
                (
                    int(row[0]),
                    row[1],
                    _number(row[2]),
                    None if used is None else int(used * _MIB),
                    None if total is None else int(total * _MIB),
                    by_uuid.get(row[1], []),
                )
            )
        return read


def _number(text: str) -> float | None:
    """A CSV field as a number; ``[N/A]`` and ``[Not Supported]`` are ``None``."""
    try:
        return float(text)
    except ValueError:
        return None


def _open_source() -> _Nvml | _NvidiaSmi | None:
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            return _Nvml(pynvml)
        except pynvml.NVMLError:
            pass  # installed, but no driver answers: nvidia-smi will not either, mostly
    smi = shutil.which("nvidia-smi")
    return None if smi is None else _NvidiaSmi(smi)


class CardReader:
    """The cards, read at most once every ``interval_s``, whoever asks.

    A pass runs in a thread of its own, one at a time: ``nvidia-smi`` takes
    milliseconds when the driver is well and seconds when it is not, and
    the watch, which halts claims, must never wait on it. :meth:`latest`
    answers at once with the last pass; :meth:`read` waits for a fresh one.

    A reading is ``None`` when nothing can read the cards, or when the last
    pass failed (the driver went away, ``nvidia-smi`` hung): a reading is
    either the driver's word or absent.
    """

    def __init__(
        self,
        interval_s: float = GPU_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        opener: Callable[[], _Nvml | _NvidiaSmi | None] = _open_source,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._opener = opener
        self._source: _Nvml | _NvidiaSmi | None = None
        self._opened = False
        self._last: CardsReading | None = None
        #: When the last pass started (``clock()``), and how many have come back.
        self._last_at: float | None = None
        self._passes = 0
        self._pass: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def source(self) -> str | None:
        """``"nvml"``, ``"nvidia-smi"``, or ``None`` when there is nothing to read with."""
        with self._lock:
            self._open()
            return None if self._source is None else self._source.source

    def before_the_first_pass(self) -> bool:
        """Whether cards are read here and no pass has come back yet: their sizes unknown."""
        with self._lock:
            self._open()
            return self._source is not None and self._passes == 0

    def read(self, max_age_s: float | None = None) -> CardsReading | None:
        """The cards as read within ``max_age_s`` (the interval): waits for a pass if due."""
        return self._get(max_age_s, wait="due")

    def latest(self, *, wait_for_first: bool = True) -> CardsReading | None:
        """The last pass, at once, starting the next in the background if it is due.

        Until a first pass has come back there is nothing to answer with: a
        view shown once waits for it (``wait_for_first``), the watch does not.
        """
        return self._get(None, wait="first" if wait_for_first else "never")

    def _get(self, max_age_s: float | None, wait: str) -> CardsReading | None:
        age = self.interval_s if max_age_s is None else max_age_s
        with self._lock:
            self._open()
            if self._source is None:
                return None
            now = self._clock()
            due = self._last_at is None or now - self._last_at >= age
            underway = self._pass is not None and self._pass.is_alive()
            if due and not underway:
                self._last_at = now
                self._pass = threading.Thread(
                    target=self._one_pass, name="fluksio-cards", daemon=True
                )
                self._pass.start()
            running = self._pass
            first = self._passes == 0
        if running is not None and ((wait == "due" and due) or (wait != "never" and first)):
            running.join()
        with self._lock:
            return self._last

    def _one_pass(self) -> None:
        reading = self._read_now()
        with self._lock:
            self._last = reading
            self._passes += 1

    def _open(self) -> None:
        if not self._opened:
            self._opened = True
            try:
                self._source = self._opener()
            except Exception:
                # A driver library that is there but broken reads as nothing
                # to read with: the cell goes on, and no card is made up.
                self._source = None

    def _read_now(self) -> CardsReading | None:
        source = self._source
        assert source is not None
        try:
            raw = source.read()
        except Exception:
            return None  # the driver's word or nothing; the next pass tries again
        here = _PidsHere()
        cards = tuple(
            CardReading(
                index=index,
                uuid=uuid,
                utilisation_percent=busy,
                used_bytes=used,
                total_bytes=total,
                processes=tuple(_process(pid, held, here(pid)) for pid, held in processes),
            )
            for index, uuid, busy, used, total, processes in raw
        )
        return CardsReading(cards=cards, source=source.source, at=time.time())


def _process(driver_pid: int, used: int | None, pid: int | None) -> CardProcess:
    uid = user = None
    if pid is not None:
        with contextlib.suppress(OSError):
            uid = os.stat(f"/proc/{pid}").st_uid
        if uid is not None:
            try:
                user = pwd.getpwuid(uid).pw_name
            except KeyError:
                user = str(uid)
    return CardProcess(driver_pid=driver_pid, pid=pid, used_bytes=used, uid=uid, user=user)


class _PidsHere:
    """The pid here of a process the driver named, for one pass.

    A pid that is a process here is that process: on a host, the driver's
    pids are this machine's, and that case must be exact. (A thread's id is
    no process: ``/proc/<tid>`` is there all the same, so the check is the
    thread group's id.) Only a pid that is no process here is looked for
    among the pids processes have in the namespaces below this one
    (``NSpid``), read once a pass, and only then.
    """

    def __init__(self) -> None:
        self._nested: dict[int, int] | None = None

    def __call__(self, driver_pid: int) -> int | None:
        if _is_process(driver_pid):
            return driver_pid
        if self._nested is None:
            self._nested = _nested_pids()
        return self._nested.get(driver_pid)


def _is_process(pid: int) -> bool:
    """Whether ``pid`` is a process here, not only some process's thread."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1]) == pid
    except (OSError, ValueError, IndexError):
        pass
    return False


def _nested_pids() -> dict[int, int]:
    """Each pid a process here has in a namespace below this one, to its pid here.

    A pid that processes in two namespaces both have (each container has its
    own pid 1) names neither for sure, and is left out.
    """
    found: dict[int, int] = {}
    ambiguous: set[int] = set()
    try:
        entries = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return found
    for pid in entries:
        try:
            with open(f"/proc/{pid}/status", "rb") as status:
                for line in status:
                    if line.startswith(b"NSpid:"):
                        for alias in line.split()[2:]:
                            if found.setdefault(int(alias), pid) != pid:
                                ambiguous.add(int(alias))
                        break
        except (OSError, ValueError):
            continue  # gone since the listing
    for alias in ambiguous:
        del found[alias]
    return found


# -- whose memory it is ----------------------------------------------------------


def held_by(card: CardReading, pids: Iterable[int]) -> int:
    """The card memory the processes ``pids`` hold on ``card``, in bytes."""
    mine = set(pids)
    return sum(p.used_bytes or 0 for p in card.processes if p.pid is not None and p.pid in mine)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
    except OSError:
        return None
    try:
        return int(data[data.rfind(b")") + 2 :].split()[1])
    except (IndexError, ValueError):
        return None


def descends_from(pid: int, ancestors: set[int]) -> bool:
    """Whether ``pid`` is one of ``ancestors`` or below one of them."""
    seen = 0
    while pid and pid not in ancestors and seen < 64:
        parent = _parent(pid)
        if parent is None or parent == pid:
            return False
        pid, seen = parent, seen + 1
    return pid in ancestors


def held_below(card: CardReading, ancestors: set[int]) -> int:
    """The card memory held on ``card`` by ``ancestors`` and every process below them."""
    return sum(
        p.used_bytes or 0
        for p in card.processes
        if p.pid is not None and descends_from(p.pid, ancestors)
    )


@dataclass(frozen=True, slots=True)
class Squatter:
    """Card memory held by a process that belongs to no running claim."""

    card: int
    process: CardProcess

    def describe(self) -> str:
        held = (
            "memory"
            if self.process.used_bytes is None
            else ByteSize(self.process.used_bytes).human_readable(decimal=True)
        )
        if self.process.pid is None:
            who = f"pid {self.process.driver_pid}, outside this machine's view (another container?)"
        else:
            who = f"pid {self.process.pid} ({self.process.user or 'unknown user'})"
        return f"card {self.card}: {held} held by {who}, no claim"


def squatters(reading: CardsReading, holders: Mapping[int, Iterable[int]]) -> list[Squatter]:
    """Processes holding memory on a card with no claim on that card above them.

    ``holders`` maps each card to the pids of the processes holding claims
    on it (kernels): a claim's workers and their children are all below its
    kernel. A kernel's process on a card its claims do not hold is a squatter
    like any other.
    """
    found = []
    for card in reading.cards:
        claimed = set(holders.get(card.index, ()))
        for process in card.processes:
            if process.pid is None or not descends_from(process.pid, claimed):
                found.append(Squatter(card=card.index, process=process))
    return found


_reader = CardReader()


def kernel_cards() -> CardReader:
    """This process's one reader of the cards."""
    return _reader
