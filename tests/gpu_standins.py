"""NVIDIA cards for tests on machines that have none: a stand-in ``nvidia-smi`` and ``pynvml``.

Both answer from files the test writes and may rewrite at any time, so a
reader that is already running (a kernel started with :meth:`StandInSmi.env`
or :meth:`StandInNvml.env` in its environment) sees the change on its next
pass. Both are found as the real ones are: ``nvidia-smi`` on ``PATH``,
``pynvml`` on ``PYTHONPATH``. Cards and processes are described alike::

    cards = [card(0, utilisation=37, used_mib=1024), card(1)]
    apps = [{"uuid": cards[0]["uuid"], "pid": worker.pid, "used_mib": 512}]

A card with MIG on carries its instances (:func:`mig_instance`), which
``nvidia-smi -L`` and ``pynvml`` list as the real ones do::

    card(0, mig=[mig_instance(0, 0, "3g.20gb"), mig_instance(0, 1, "1g.5gb")])

A ``None`` is a figure the card cannot give (``[N/A]``; NVML's
``NVMLError_NotSupported``), never a zero.

Also here, for the pids a driver names from inside a container:
:func:`nested_process` runs a real process in a pid namespace below this one,
with an inner pid that is no process here.

A kernel run as another Unix user must be able to reach these files: make
their directory reachable (``tests.unix_users.make_reachable``).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import gone, wait_until

_TESTS = Path(__file__).resolve().parent
#: The directory to put first on ``PYTHONPATH`` for ``import pynvml`` to find the stand-in.
PYNVML_SITE = _TESTS / "gpu_standin_site"
_SMI_SOURCE = _TESTS / "standin_nvidia_smi.py"
#: The environment variables the stand-in ``pynvml`` reads (see its module docstring).
PYNVML_STATE_VAR = "STANDIN_PYNVML_STATE"
PYNVML_CALLS_VAR = "STANDIN_PYNVML_CALLS"

#: What the real nvidia-smi prints, on stdout, and its exit code, when the driver is gone.
DRIVER_GONE = (
    9,
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.",
)

_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: The lock (:func:`tests.suite_locks.held_across_suites`) a test holds alone
#: while it runs a stand-in MPS control daemon, and one that must find none
#: holds shared: every process on the machine finds the stand-in, another
#: suite's claims too.
MPS_DAEMON = "mps-daemon"


def card(index: int, **fields: Any) -> dict[str, Any]:
    """An idle 40 GB A100 at ``index``, with ``fields`` changed.

    ``utilisation`` (percent), ``used_mib`` and ``total_mib`` may be ``None``
    (the card cannot say) or, for ``nvidia-smi``, a string it prints as is.
    """
    return {
        "index": index,
        "uuid": f"GPU-5f0c7a3e-1b2d-4c6e-8a9f-{index:012x}",
        "name": "NVIDIA A100-SXM4-40GB",
        "utilisation": 0,
        "used_mib": 0,
        "total_mib": 40960,
        **fields,
    }


def mig_instance(parent: int, slot: int, profile: str = "1g.5gb", **fields: Any) -> dict[str, Any]:
    """MIG instance ``slot`` of card ``parent``, idle, ``profile`` sized: for a card's ``mig``.

    ``card(0, mig=[mig_instance(0, 0), mig_instance(0, 1)])`` is card 0 with
    MIG on and two instances; its ``used_mib`` and ``total_mib`` may be given.
    """
    memory_gb = int(profile.split("g.")[1].removesuffix("gb"))
    return {
        "uuid": f"MIG-7c1e2d3f-4a5b-5c6d-8e9f-{parent:06x}{slot:06x}",
        "profile": profile,
        "used_mib": 0,
        "total_mib": memory_gb * 1024 - 256,
        **fields,
    }


def _write_json(path: Path, data: object) -> None:
    """Written whole or not at all: a stand-in reading it mid-write sees the old or the new."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_text(json.dumps(data))
    os.replace(part, path)


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


class _Cards:
    """The cards and processes a stand-in answers with, kept in a JSON file."""

    state_file: Path

    def __init__(self, cards: Iterable[Mapping[str, Any]], apps: Iterable[Mapping[str, Any]]):
        self.cards = [dict(c) for c in cards]
        self.apps = [dict(a) for a in apps]
        self._extra: dict[str, Any] = {}

    def _state(self) -> dict[str, Any]:
        return {"cards": self.cards, "apps": self.apps, **self._extra}

    def _save(self) -> None:
        _write_json(self.state_file, self._state())

    def set_cards(self, cards: Iterable[Mapping[str, Any]]) -> None:
        self.cards = [dict(c) for c in cards]
        self._save()

    def set_apps(self, apps: Iterable[Mapping[str, Any]]) -> None:
        """The processes holding card memory: ``{"uuid", "pid", "used_mib"}`` each.

        ``used_mib`` may be ``None`` (the driver cannot say); ``"type"`` is
        ``"C"`` (the default), ``"G"`` or ``"C+G"``.
        """
        self.apps = [dict(a) for a in apps]
        self._save()


class StandInSmi(_Cards):
    """A real executable ``nvidia-smi`` in ``directory/bin``, answering for ``cards``."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        cards: Iterable[Mapping[str, Any]],
        apps: Iterable[Mapping[str, Any]] = (),
    ) -> None:
        super().__init__(cards, apps)
        self.directory = Path(directory)
        self.bin = self.directory / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        self.path = self.bin / "nvidia-smi"
        self.state_file = self.directory / "nvidia-smi.json"
        self.calls_file = self.directory / "nvidia-smi.calls"
        # -I: the test's PYTHONPATH, or a kernel's, is nothing to it; -S: it starts faster.
        self.path.write_text(f"#!{sys.executable} -IS\n" + _SMI_SOURCE.read_text())
        self.path.chmod(0o755)
        self._save()

    def fail(self, exit_code: int = DRIVER_GONE[0], message: str = DRIVER_GONE[1]) -> None:
        """From now on every run prints ``message`` and exits ``exit_code``."""
        self._extra["fail"] = {"exit": exit_code, "message": message}
        self._save()

    def recover(self) -> None:
        self._extra.pop("fail", None)
        self._save()

    def hang_until(self, released: os.PathLike[str] | str) -> None:
        """From now on every run waits, as with a driver that stopped answering, until
        ``released`` exists."""
        self._extra["hang_until"] = str(released)
        self._save()

    def calls(self) -> list[list[str]]:
        """The arguments of every run so far, in order."""
        return [json.loads(line) for line in _read_lines(self.calls_file)]

    def path_env(self, base: str | None = None) -> str:
        """``PATH`` with this ``nvidia-smi`` first: ``base``, or this process's, after it."""
        rest = os.environ.get("PATH", _SYSTEM_PATH) if base is None else base
        return f"{self.bin}{os.pathsep}{rest}" if rest else str(self.bin)

    def env(self, base: str | None = None) -> dict[str, str]:
        """What to add to a process's environment for it to find this ``nvidia-smi``."""
        return {"PATH": self.path_env(base)}


class StandInNvml(_Cards):
    """The state the stand-in ``pynvml`` reads, in ``directory``, for ``cards``.

    ``init_error`` names the error ``nvmlInit`` raises (``"DriverNotLoaded"``,
    ``"LibraryNotFound"``, ...); ``strings_as_bytes`` makes names and UUIDs
    ``bytes``, as nvidia-ml-py before 11.x returned them. A card's
    ``"nvml_errors"`` maps a call's name to the error it raises for that card.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        cards: Iterable[Mapping[str, Any]],
        apps: Iterable[Mapping[str, Any]] = (),
        *,
        init_error: str | None = None,
        strings_as_bytes: bool = False,
    ) -> None:
        super().__init__(cards, apps)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.state_file = self.directory / "pynvml.json"
        self.calls_file = self.directory / "pynvml.calls"
        self._extra = {"init_error": init_error, "strings_as_bytes": strings_as_bytes}
        self._save()

    def set_init_error(self, error: str | None) -> None:
        self._extra["init_error"] = error
        self._save()

    def calls(self) -> list[str]:
        """The name of every call made so far, by every process using this state."""
        return _read_lines(self.calls_file)

    def pythonpath(self, base: str | None = None) -> str:
        """``PYTHONPATH`` with the stand-in first: ``base``, or this process's, after it."""
        rest = os.environ.get("PYTHONPATH", "") if base is None else base
        return f"{PYNVML_SITE}{os.pathsep}{rest}" if rest else str(PYNVML_SITE)

    def env(self, base_pythonpath: str | None = None) -> dict[str, str]:
        """What to add to a process's environment for its ``import pynvml`` to find this."""
        return {
            "PYTHONPATH": self.pythonpath(base_pythonpath),
            PYNVML_STATE_VAR: str(self.state_file),
            PYNVML_CALLS_VAR: str(self.calls_file),
        }


# -- a process in a nested pid namespace ----------------------------------------


def ns_pids(pid: int) -> list[int]:
    """``pid``'s pids from this namespace down to its own (``NSpid``), or ``[]`` if gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(field) for field in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def _unshare_attempts(unshare: str) -> list[list[str]]:
    common = ["--pid", "--fork", "--mount-proc", "--kill-child"]
    attempts = [[unshare, "--user", "--map-root-user", *common]]
    if os.geteuid() == 0:
        attempts.insert(0, [unshare, *common])
    return attempts


#: Sets the namespace's next pid, then starts the command in it (a fork, so it gets that pid).
_CHOSEN_PID = (
    "max=$(cat /proc/sys/kernel/pid_max) || exit 97\n"
    'target="${STANDIN_INNER_PID:-$((max - 10 - ${STANDIN_SPREAD:-0} % (max / 4)))}"\n'
    'echo "$((target - 1))" > /proc/sys/kernel/ns_last_pid || exit 98\n'
    '"$@" >&2 &\n'
    'echo "$!"\n'
    "wait\n"
)


@functools.cache
def _pid_namespace_prefix() -> tuple[tuple[str, ...] | None, str]:
    unshare = shutil.which("unshare") or shutil.which("unshare", path=_SYSTEM_PATH)
    if unshare is None:
        return None, "needs `unshare` (util-linux) to start a process in a nested pid namespace"
    failures = []
    for prefix in _unshare_attempts(unshare):
        try:
            probe = subprocess.run(
                [*prefix, "sh", "-c", _CHOSEN_PID, "sh", "true"],
                env={**os.environ, "STANDIN_INNER_PID": "5000"},
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError) as error:
            failures.append(f"`{' '.join(prefix)}`: {error}")
            continue
        if probe.returncode == 0 and probe.stdout.strip() == "5000":
            return tuple(prefix), ""
        said = (probe.stderr.strip() or probe.stdout.strip() or "nothing").splitlines()[-1]
        failures.append(f"`{' '.join(prefix)}` exited {probe.returncode}: {said}")
    return None, (
        "cannot start a process with a chosen pid in a nested pid namespace "
        "(needs root, or unprivileged user namespaces): " + "; ".join(failures)
    )


def missing_for_nested_pid_namespaces() -> str | None:
    """Why this process cannot run :func:`nested_process`; ``None`` if it can."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux pid namespaces (this is {sys.platform})"
    return _pid_namespace_prefix()[1] or None


@dataclass(frozen=True)
class NestedProcess:
    """A process in a pid namespace below this one."""

    #: Its pid here.
    pid: int
    #: Its pid in its own namespace: what a driver asked from in there names it by.
    inner_pid: int
    #: The ``unshare`` it runs below (here), which a kernel holding it would be above.
    unshare_pid: int


@contextmanager
def nested_process(
    command: Sequence[str] = ("sleep", "600"), inner_pid: int | None = None
) -> Iterator[NestedProcess]:
    """``command`` running in a new pid namespace, as its pid ``inner_pid``.

    Without ``inner_pid`` it is near the namespace's ``pid_max``: a pid that,
    on any machine that has not raised its own ``pid_max`` that far, is no
    process here. How near is this process's own pid (within a quarter of
    ``pid_max``): at a fixed distance, two test processes that each made one
    at once, on two pytest workers or in two suites, had the same inner pid,
    and a driver's pid found in two namespaces is nobody's. Skips the test,
    saying what is missing, where pid namespaces cannot be made. Everything
    in the namespace ends on leaving.
    """
    reason = missing_for_nested_pid_namespaces()
    if reason is not None:
        pytest.skip(reason)
    prefix = _pid_namespace_prefix()[0]
    assert prefix is not None
    env = dict(os.environ)
    env.pop("STANDIN_INNER_PID", None)
    env["STANDIN_SPREAD"] = str(os.getpid())
    if inner_pid is not None:
        env["STANDIN_INNER_PID"] = str(inner_pid)
    outer = subprocess.Popen(
        [*prefix, "sh", "-c", _CHOSEN_PID, "sh", *command],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    found: list[int] = []
    try:
        assert outer.stdout is not None
        line = outer.stdout.readline().strip()
        assert line.isdigit(), f"the namespace's shell said {line!r}, exit {outer.poll()}"
        inner = int(line)
        if inner_pid is not None:
            assert inner == inner_pid, f"asked for inner pid {inner_pid}, got {inner}"

        def started() -> bool:
            found[:] = [
                pid
                for pid in _descendants(outer.pid)
                if len(ns_pids(pid)) > 1 and ns_pids(pid)[-1] == inner
            ]
            return bool(found)

        assert wait_until(started, 10), f"no process below {outer.pid} has inner pid {inner}"
        yield NestedProcess(pid=found[0], inner_pid=inner, unshare_pid=outer.pid)
    finally:
        # unshare ignores SIGTERM while it waits; killed, --kill-child ends the
        # namespace's first process, and with it everything in the namespace.
        outer.kill()
        outer.wait(10)
        if outer.stdout is not None:
            outer.stdout.close()
        if found:
            gone(found[0], 10)  # its namespace's first process was killed: it goes too


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    data = stat.read()
                parent = int(data[data.rfind(b")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
