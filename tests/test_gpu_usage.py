"""What the cards are doing, and whose processes hold their memory.

No card is needed: ``tests/gpu_standins.py`` puts a real executable
``nvidia-smi`` first on ``PATH``, or a ``pynvml`` first on ``PYTHONPATH`` for a
real Python to import, both answering from files the test writes. The
processes holding card memory are real processes the tests start, so that
matching the driver's pids to processes here, their owners and their
parents are all the real thing; so are the pid namespaces a container's
processes live in. The NVML tests run the reader in a Python of its own,
where ``import pynvml`` finds the stand-in as it would find nvidia-ml-py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import pwd
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from fluksio_nb.gpu_usage import CardProcess, CardReader, Squatter, held_by, squatters
from fluksio_nb.gpus import Gpu, detect_gpus
from tests.gpu_standins import (
    DRIVER_GONE,
    PYNVML_SITE,
    StandInNvml,
    StandInSmi,
    card,
    nested_process,
    ns_pids,
)
from tests.unix_users import USER_B, as_user, missing_for_unix_users, unix_user
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CARD_0, CARD_1 = card(0), card(1)
#: Exactly what gpu_usage asks nvidia-smi, one pass.
SMI_PASS = [
    [
        "--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total,mig.mode.current",
        "--format=csv,noheader,nounits",
    ],
    ["--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"],
]
#: Linux's largest pid (PID_MAX_LIMIT on 64-bit): no driver names one above it.
PID_MAX_LIMIT = 4 * 1024 * 1024


class Clock:
    """The reader's clock, moved by the test instead of waited for."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def spawn():
    """Starts real processes, and ends whichever are still running after the test."""
    started: list[subprocess.Popen] = []

    def start(argv, **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(argv, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
        if process.poll() is None:
            process.kill()
        process.wait(10)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi first on this process's PATH, with no pynvml to ask before it."""
    stand_in = StandInSmi(tmp_path / "smi", [CARD_0, CARD_1])
    monkeypatch.setenv("PATH", stand_in.path_env())
    # Unimportable, as where nvidia-ml-py is not installed: nvidia-smi is what is asked.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    return stand_in


def user_of(pid: int) -> tuple[int, str]:
    """The owner of ``pid`` as the OS says (its status file), and its name."""
    uid = psutil.Process(pid).uids().effective
    return uid, pwd.getpwuid(uid).pw_name


def holding(pid: int, used_mib: int | None) -> CardProcess:
    """What a reading should say of ``pid``, a process here holding ``used_mib``."""
    uid, user = user_of(pid)
    return CardProcess(
        driver_pid=pid,
        pid=pid,
        used_bytes=None if used_mib is None else used_mib * MIB,
        uid=uid,
        user=user,
    )


def sleeper(spawn) -> int:
    return spawn(["sleep", "600"]).pid


# -- nvidia-smi ---------------------------------------------------------------------


def test_nvidia_smi_gives_each_cards_utilisation_memory_and_the_processes_on_it(smi, spawn, clock):
    trainer, evaluator, other = sleeper(spawn), sleeper(spawn), sleeper(spawn)
    smi.set_cards(
        [card(0, utilisation=37, used_mib=6144, total_mib=40960), card(1, utilisation=100)]
    )
    smi.set_apps(
        [
            {"uuid": CARD_0["uuid"], "pid": trainer, "used_mib": 4096},
            {"uuid": CARD_0["uuid"], "pid": evaluator, "used_mib": 2048},
            {"uuid": CARD_1["uuid"], "pid": other, "used_mib": 1},
        ]
    )
    reader = CardReader(clock=clock)

    reading = reader.read()

    assert reader.source == reading.source == "nvidia-smi"
    assert smi.calls() == SMI_PASS, "one pass is these two runs, with exactly these fields"
    first = reading.card(0)
    assert (first.uuid, first.utilisation_percent, first.used_bytes, first.total_bytes) == (
        CARD_0["uuid"],
        37.0,
        6144 * MIB,
        40960 * MIB,
    )
    assert first.processes == (holding(trainer, 4096), holding(evaluator, 2048))
    assert reading.card(1).processes == (holding(other, 1),)
    assert held_by(first, [trainer, other]) == 4096 * MIB
    assert reading.card(2) is None


def test_what_nvidia_smi_cannot_say_is_read_as_unknown_not_zero(smi, spawn, clock):
    holder = sleeper(spawn)
    smi.set_cards([CARD_0, card(1, utilisation=None, used_mib=None, total_mib="[Not Supported]")])
    smi.set_apps([{"uuid": CARD_1["uuid"], "pid": holder, "used_mib": None}])

    reading = CardReader(clock=clock).read()

    unknown = reading.card(1)
    assert (unknown.utilisation_percent, unknown.used_bytes, unknown.total_bytes) == (
        None,
        None,
        None,
    )
    assert unknown.processes == (holding(holder, None),)
    idle = reading.card(0)
    assert (idle.utilisation_percent, idle.used_bytes) == (0.0, 0), "a real zero stays zero"
    user = user_of(holder)[1]
    assert (
        Squatter(card=1, process=unknown.processes[0]).describe()
        == f"card 1: memory held by pid {holder} ({user}), no claim"
    )


def test_the_cards_are_read_at_most_once_an_interval_whoever_asks(smi, clock):
    smi.set_cards([card(0, utilisation=10), CARD_1])
    reader = CardReader(interval_s=2.0, clock=clock)
    first = reader.read()
    assert len(smi.calls()) == 2

    smi.set_cards([card(0, utilisation=80), CARD_1])
    clock.now += 1.9
    answers = []
    askers = [threading.Thread(target=lambda: answers.append(reader.read())) for _ in range(4)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert len(answers) == 4 and all(answer is first for answer in answers)
    assert len(smi.calls()) == 2, "nvidia-smi was not run again within the interval"

    clock.now += 0.1
    again = reader.read()
    assert again.card(0).utilisation_percent == 80.0
    assert len(smi.calls()) == 4

    assert reader.read(max_age_s=0) is not again, "an asker that needs it now reads anew"
    assert len(smi.calls()) == 6


def test_a_failing_nvidia_smi_gives_no_reading_and_the_next_pass_reads_again(smi, clock):
    reader = CardReader(interval_s=2.0, clock=clock)
    smi.fail(*DRIVER_GONE)

    assert reader.read() is None, "the driver's word or nothing: never cards reported idle"
    assert reader.source == "nvidia-smi"
    runs = len(smi.calls())
    clock.now += 1.0
    assert reader.read() is None
    assert len(smi.calls()) == runs, "a failed pass counts as the interval's pass"

    smi.recover()
    smi.set_cards([card(0, utilisation=55), CARD_1])
    clock.now += 1.0
    reading = reader.read()
    assert reading is not None and reading.card(0).utilisation_percent == 55.0


def test_a_hung_nvidia_smi_holds_up_nobody_who_asks_for_the_latest_and_runs_once_at_a_time(
    smi, clock, tmp_path
):
    """Guards the watch: it halts claims, and must never wait on a driver that stopped answering."""
    released = tmp_path / "driver-answers"
    reader = CardReader(interval_s=2.0, clock=clock)
    assert reader.read() is not None
    smi.set_cards([card(0, utilisation=70), CARD_1])
    smi.hang_until(released)
    clock.now += 2.0
    runs = len(smi.calls())
    assert reader.latest(wait_for_first=False).card(0).utilisation_percent == 0.0
    assert wait_until(lambda: len(smi.calls()) == runs + 1), "the next pass did not start"
    clock.now += 4.0
    for _ in range(3):
        assert reader.latest().card(0).utilisation_percent == 0.0, "the last pass, at once"
    assert len(smi.calls()) == runs + 1, "a second pass started while one hangs"

    released.touch()
    assert wait_until(lambda: reader.latest().card(0).utilisation_percent == 70.0)


# -- NVML ---------------------------------------------------------------------------

_READER = """
import dataclasses, json, sys
from fluksio_nb.gpu_usage import CardReader

reader = CardReader()
print(json.dumps(reader.source), flush=True)
for _ in sys.stdin:
    reading = reader.read(max_age_s=0)
    print(json.dumps(None if reading is None else dataclasses.asdict(reading)), flush=True)
"""


class ReaderProcess:
    """A Python of its own, holding one ``CardReader``: a pass each time it is asked."""

    def __init__(self, spawn, env: dict[str, str], *, without_pynvml: bool = False) -> None:
        setup = "import sys; sys.modules['pynvml'] = None\n" if without_pynvml else ""
        self.process = spawn(
            [sys.executable, "-c", setup + _READER],
            env={**os.environ, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.source = self._answer()

    def _answer(self):
        line = self.process.stdout.readline()
        assert line, f"the reader's Python ended (exit {self.process.wait(10)})"
        return json.loads(line)

    def read(self) -> dict | None:
        self.process.stdin.write("read\n")
        self.process.stdin.flush()
        return self._answer()


def nvml_env(nvml: StandInNvml, path: str) -> dict[str, str]:
    """The stand-in pynvml, then this checkout's fluksio_nb; ``path`` as ``PATH``."""
    return {**nvml.env(base_pythonpath=str(REPO_ROOT)), "PATH": path}


def card_in(reading: dict, index: int) -> dict:
    return next(c for c in reading["cards"] if c["index"] == index)


@pytest.mark.parametrize("strings_as_bytes", [False, True], ids=["str", "bytes-before-11.x"])
def test_nvml_gives_each_cards_utilisation_memory_and_processes(tmp_path, spawn, strings_as_bytes):
    trainer, viewer, both = sleeper(spawn), sleeper(spawn), sleeper(spawn)
    nvml = StandInNvml(
        tmp_path / "nvml",
        [
            card(0, utilisation=37, used_mib=6144),
            # Utilisation raises NVMLError_NotSupported on this one.
            card(1, utilisation=None, used_mib=300),
        ],
        [
            {"uuid": CARD_0["uuid"], "pid": trainer, "used_mib": 4096},
            {"uuid": CARD_1["uuid"], "pid": viewer, "used_mib": None, "type": "G"},
            {"uuid": CARD_1["uuid"], "pid": both, "used_mib": 200, "type": "C+G"},
        ],
        strings_as_bytes=strings_as_bytes,
    )
    # An nvidia-smi that disagrees is on PATH too: NVML is asked first, and alone.
    smi = StandInSmi(tmp_path / "smi", [card(0, utilisation=99), card(1, utilisation=99)])
    reader = ReaderProcess(spawn, nvml_env(nvml, smi.path_env()))

    reading = reader.read()

    assert reader.source == reading["source"] == "nvml"
    assert smi.calls() == []
    first, second = card_in(reading, 0), card_in(reading, 1)
    assert (first["uuid"], first["utilisation_percent"], first["used_bytes"]) == (
        CARD_0["uuid"],
        37.0,
        6144 * MIB,
    )
    assert first["total_bytes"] == 40960 * MIB
    assert first["processes"] == [dataclasses.asdict(holding(trainer, 4096))]
    assert (second["uuid"], second["utilisation_percent"]) == (CARD_1["uuid"], None)
    assert second["used_bytes"] == 300 * MIB
    # Graphics processes hold card memory too; one that is both is listed once.
    assert sorted(second["processes"], key=lambda p: p["pid"] != viewer) == [
        dataclasses.asdict(holding(viewer, None)),
        dataclasses.asdict(holding(both, 200)),
    ]


def test_nvml_stays_initialised_and_reads_what_changed_on_the_next_pass(tmp_path, spawn):
    trainer, late = sleeper(spawn), sleeper(spawn)
    nvml = StandInNvml(
        tmp_path / "nvml",
        [
            card(
                0,
                utilisation=5,
                nvml_errors={"nvmlDeviceGetGraphicsRunningProcesses": "NotSupported"},
            )
        ],
        [{"uuid": CARD_0["uuid"], "pid": trainer, "used_mib": 100}],
    )
    reader = ReaderProcess(spawn, nvml_env(nvml, str(tmp_path / "empty-bin")))
    before = card_in(reader.read(), 0)
    assert before["processes"] == [dataclasses.asdict(holding(trainer, 100))], (
        "a card that cannot list graphics processes still lists compute ones"
    )

    nvml.set_cards([card(0, utilisation=90, used_mib=5000)])
    nvml.set_apps(
        [
            {"uuid": CARD_0["uuid"], "pid": trainer, "used_mib": 3000},
            {"uuid": CARD_0["uuid"], "pid": late, "used_mib": 2000},
        ]
    )
    after = card_in(reader.read(), 0)

    assert (after["utilisation_percent"], after["used_bytes"]) == (90.0, 5000 * MIB)
    assert after["processes"] == [
        dataclasses.asdict(holding(trainer, 3000)),
        dataclasses.asdict(holding(late, 2000)),
    ]
    calls = nvml.calls()
    assert (calls.count("nvmlInit"), calls.count("nvmlShutdown")) == (1, 0)


def test_a_card_that_cannot_say_its_memory_still_shows_who_holds_it(tmp_path, spawn, clock):
    """Unified-memory cards (the GB10) answer Not Supported for memory, in NVML and nvidia-smi.

    The other figures, and the processes on the card, are read all the same,
    from either source: only the memory is unknown.
    """
    holder = sleeper(spawn)
    spark = [card(0, name="NVIDIA GB10", utilisation=12, used_mib=None, total_mib=None)]
    apps = [{"uuid": CARD_0["uuid"], "pid": holder, "used_mib": 700}]
    expected = {
        "utilisation_percent": 12.0,
        "used_bytes": None,
        "total_bytes": None,
        "processes": [dataclasses.asdict(holding(holder, 700))],
    }

    nvml = StandInNvml(tmp_path / "nvml", spark, apps)
    reading = ReaderProcess(spawn, nvml_env(nvml, str(tmp_path / "empty-bin"))).read()
    assert reading is not None, "NVML's Not Supported for memory lost every card's reading"
    assert {key: card_in(reading, 0)[key] for key in expected} == expected

    smi = StandInSmi(tmp_path / "smi", spark, apps)
    env = {"PATH": smi.path_env(), "PYTHONPATH": str(REPO_ROOT)}
    reading = ReaderProcess(spawn, env, without_pynvml=True).read()
    assert reading["source"] == "nvidia-smi"
    assert {key: card_in(reading, 0)[key] for key in expected} == expected


def test_a_card_nvml_cannot_describe_is_left_out_and_every_other_card_is_read(tmp_path, spawn):
    """A lost card (GpuIsLost), or one a cgroup walls off (NoPermission), is one card:
    the readings and the books keep every other, and a card that cannot say its
    size (unified memory) is still a card to hand out."""
    holder = sleeper(spawn)
    lost = card(0, nvml_errors={"nvmlDeviceGetHandleByIndex": "GpuIsLost"})
    spark = card(1, name="NVIDIA GB10", utilisation=12, used_mib=None, total_mib=None)
    apps = [{"uuid": spark["uuid"], "pid": holder, "used_mib": 700}]
    nvml = StandInNvml(tmp_path / "nvml", [lost, spark], apps)
    env = nvml_env(nvml, str(tmp_path / "empty-bin"))

    reading = ReaderProcess(spawn, env).read()
    assert [c["index"] for c in reading["cards"]] == [1]
    assert card_in(reading, 1)["processes"] == [dataclasses.asdict(holding(holder, 700))]

    detected = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json\n"
            "from fluksio_nb.gpus import detect_gpus\n"
            "cards, source = detect_gpus()\n"
            "print(json.dumps([source, [[c.index, c.memory_bytes] for c in cards]]))",
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(detected.stdout) == ["nvml", [[1, None]]]


@pytest.mark.parametrize(
    "pynvml",
    ["not installed", "installed, no driver library", "installed, driver not loaded"],
)
def test_with_neither_nvml_nor_nvidia_smi_there_is_no_reading(tmp_path, spawn, pynvml):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env = {"PATH": str(empty), "PYTHONPATH": str(REPO_ROOT)}
    if pynvml == "installed, no driver library":
        env["PYTHONPATH"] = f"{PYNVML_SITE}{os.pathsep}{REPO_ROOT}"  # and no state: no library
    elif pynvml == "installed, driver not loaded":
        env.update(
            nvml_env(StandInNvml(tmp_path / "nvml", [CARD_0], init_error="DriverNotLoaded"), "")
        )
        env["PATH"] = str(empty)
    reader = ReaderProcess(spawn, env, without_pynvml=pynvml == "not installed")

    assert reader.source is None
    assert reader.read() is None


# -- whose processes -------------------------------------------------------------------


def test_a_process_in_a_nested_pid_namespace_is_found_by_its_pid_in_there(smi, clock):
    """A driver asked from inside a container names the container's pid for a process."""
    with nested_process() as worker:
        assert not os.path.exists(f"/proc/{worker.inner_pid}"), "the inner pid is no pid here"
        assert ns_pids(worker.pid) == [worker.pid, worker.inner_pid]
        smi.set_apps([{"uuid": CARD_0["uuid"], "pid": worker.inner_pid, "used_mib": 1024}])

        reading = CardReader(clock=clock).read()

        uid, user = user_of(worker.pid)
        assert reading.card(0).processes == (
            CardProcess(
                driver_pid=worker.inner_pid,
                pid=worker.pid,
                used_bytes=1024 * MIB,
                uid=uid,
                user=user,
            ),
        )
        # The kernel that started the container holds the card: its worker is no squatter.
        assert squatters(reading, {0: [worker.unshare_pid]}) == []
        assert [s.process.pid for s in squatters(reading, {1: [worker.unshare_pid]})] == [
            worker.pid
        ]


def test_a_pid_that_processes_in_two_namespaces_both_have_is_neither_of_theirs(smi, clock):
    """Each container has its own pid 1, 2, ...: such a pid alone cannot say whose it is."""
    with nested_process() as one, nested_process(inner_pid=one.inner_pid) as other:
        assert one.pid != other.pid
        smi.set_apps([{"uuid": CARD_0["uuid"], "pid": one.inner_pid, "used_mib": 64}])

        [process] = CardReader(clock=clock).read().card(0).processes

        assert (process.driver_pid, process.pid, process.used_bytes) == (
            one.inner_pid,
            None,
            64 * MIB,
        )


def test_a_threads_id_here_is_not_taken_for_the_process_the_driver_names(smi, spawn, clock):
    """``/proc/<tid>`` is there for every thread, though no process has that pid.

    A container's pid that happens to be the id of one of this machine's
    threads is still the container's process, found by its NSpid.
    """
    threaded = spawn(
        [
            sys.executable,
            "-c",
            "import sys, threading\n"
            "threading.Thread(target=sys.stdin.read, daemon=True).start()\n"
            "print(max(t.native_id for t in threading.enumerate()), flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    tid = int(threaded.stdout.readline())
    assert tid != threaded.pid and os.path.exists(f"/proc/{tid}")
    assert str(tid) not in os.listdir("/proc"), "a thread, not a process"

    with nested_process(inner_pid=tid) as worker:
        smi.set_apps([{"uuid": CARD_0["uuid"], "pid": tid, "used_mib": 64}])

        process = CardReader(clock=clock).read().card(0).processes[0]

        assert (process.driver_pid, process.pid) == (tid, worker.pid)


def pid_nowhere_here() -> int:
    """A pid that is no process or thread here, nor any process's pid in a namespace below."""
    aliases = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            aliases.update(ns_pids(int(entry)))
    for pid in range(PID_MAX_LIMIT - 1, 1, -1):
        if pid not in aliases and not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("every pid is taken")


def test_a_pid_that_is_nothing_here_is_kept_and_shown_as_outside_this_machines_view(smi, clock):
    elsewhere = pid_nowhere_here()
    smi.set_apps([{"uuid": CARD_1["uuid"], "pid": elsewhere, "used_mib": 3052}])

    reading = CardReader(clock=clock).read()

    assert reading.card(1).processes == (
        CardProcess(driver_pid=elsewhere, pid=None, used_bytes=3052 * MIB),
    )
    [squatter] = squatters(reading, {1: [os.getpid()]})
    assert squatter.describe() == (
        f"card 1: 3.2GB held by pid {elsewhere}, "
        "outside this machine's view (another container?), no claim"
    )


def test_card_memory_below_no_kernel_with_a_claim_on_that_card_is_squatted(smi, spawn, clock):
    """A kernel's worker is its claim's on the card the claim holds, and a squatter elsewhere."""
    kernel = spawn(
        [
            sys.executable,
            "-c",
            "import subprocess, sys\n"
            "worker = subprocess.Popen(['sleep', '600'])\n"
            "print(worker.pid, flush=True)\n"
            "sys.stdin.read()\n"
            "worker.kill()\n"
            "worker.wait()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = int(kernel.stdout.readline())
    if missing_for_unix_users() is None:
        someone = unix_user(USER_B)
        stranger = spawn([*as_user(someone), "sleep", "600"]).pid
        # setpriv has changed user and become sleep: the process is theirs now.
        assert wait_until(lambda: user_of(stranger) == (someone.uid, someone.name))
    else:
        stranger = sleeper(spawn)  # as this user: no other to run it as here
    smi.set_apps(
        [
            {"uuid": CARD_0["uuid"], "pid": kernel.pid, "used_mib": 256},
            {"uuid": CARD_0["uuid"], "pid": worker, "used_mib": 1024},
            {"uuid": CARD_1["uuid"], "pid": worker, "used_mib": 512},
            {"uuid": CARD_1["uuid"], "pid": stranger, "used_mib": 3052},
        ]
    )

    reading = CardReader(clock=clock).read()
    found = squatters(reading, {0: [kernel.pid]})

    assert [(s.card, s.process.pid) for s in found] == [(1, worker), (1, stranger)]
    uid, user = user_of(stranger)
    assert (found[1].process.uid, found[1].process.user) == (uid, user)
    assert found[1].describe() == f"card 1: 3.2GB held by pid {stranger} ({user}), no claim"
    assert held_by(reading.card(0), [kernel.pid, worker]) == 1280 * MIB
    assert squatters(reading, {0: [kernel.pid], 1: [kernel.pid]})[0].process.pid == stranger


# -- the stand-ins themselves --------------------------------------------------------


def test_the_stand_in_nvidia_smi_lists_cards_and_refuses_fields_it_does_not_know(smi):
    cards, source = detect_gpus()
    assert source == "nvidia-smi"
    assert cards == [Gpu(0, CARD_0["name"], CARD_0["uuid"]), Gpu(1, CARD_1["name"], CARD_1["uuid"])]

    with_units = subprocess.run(
        [smi.path, "--query-gpu=index,utilization.gpu,memory.free", "--format=csv"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert with_units.stdout.splitlines() == [
        "index, utilization.gpu [%], memory.free [MiB]",
        "0, 0 %, 40960 MiB",
        "1, 0 %, 40960 MiB",
    ]
    unknown = subprocess.run(
        [smi.path, "--query-gpu=index,gpu_temperature", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    assert unknown.returncode == 2
    assert 'Field "gpu_temperature" is not a valid field to query.' in unknown.stdout


def test_the_stand_in_pynvml_is_what_detect_gpus_finds_and_it_shuts_nvml_down(tmp_path):
    nvml = StandInNvml(tmp_path / "nvml", [CARD_0, card(1, name="NVIDIA H100 80GB HBM3")])
    env = {**os.environ, **nvml_env(nvml, str(tmp_path / "empty-bin"))}
    detected = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json\n"
            "from fluksio_nb.gpus import detect_gpus\n"
            "cards, source = detect_gpus()\n"
            "listed = [[c.index, c.name, c.uuid, c.memory_bytes] for c in cards]\n"
            "print(json.dumps([source, listed]))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(detected.stdout) == [
        "nvml",
        [
            [0, CARD_0["name"], CARD_0["uuid"], 40960 * MIB],
            [1, "NVIDIA H100 80GB HBM3", CARD_1["uuid"], 40960 * MIB],
        ],
    ]
    calls = nvml.calls()
    assert (calls[0], calls[-1]) == ("nvmlInit", "nvmlShutdown")


def test_the_stand_in_pynvml_has_the_signatures_and_errors_of_nvidia_ml_py():
    """Where nvidia-ml-py is installed, the stand-in is checked against it."""
    try:
        real = importlib.import_module("pynvml")
    except ImportError:
        pytest.skip("nvidia-ml-py is not installed here: nothing to compare the stand-in with")
    assert Path(real.__file__).parent != PYNVML_SITE, "this is the stand-in, not nvidia-ml-py"
    stand_in_spec = importlib.util.spec_from_file_location(
        "standin_pynvml_compared", PYNVML_SITE / "pynvml.py"
    )
    stand_in = importlib.util.module_from_spec(stand_in_spec)
    sys.modules[stand_in_spec.name] = stand_in
    try:
        stand_in_spec.loader.exec_module(stand_in)
    finally:
        del sys.modules[stand_in_spec.name]

    calls = [name for name in vars(stand_in) if name.startswith("nvml") and name[4].isupper()]
    assert calls
    for name in calls:
        assert inspect.signature(getattr(stand_in, name)) == inspect.signature(
            getattr(real, name)
        ), name
    errors = [name for name in vars(stand_in) if name.startswith("NVMLError_")]
    for name in errors:
        real_error, error = getattr(real, name), getattr(stand_in, name)
        assert issubclass(real_error, real.NVMLError)
        assert error().value == real_error().value, name
        assert str(error()) == str(real_error()), name
