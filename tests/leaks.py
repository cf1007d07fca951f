"""A run of the suite writes only in places of its own, and fails if it wrote elsewhere.

**Where the run writes.** :func:`redirect` points the run's processes at a
directory made for the run, before any of them starts: Jupyter's data and
runtime directories (so fluksio_nb's usage records, its default books directory and
every kernel's connection file), IPython's directory (each kernel's history
and profile) and the temporary directory (``TMPDIR``, so ``tempfile`` in the
suite, its kernels, nbval's kernels, the browser tests' servers and Ray). Every
kernel, whoever starts it, inherits that from the suite's own environment;
the directory is removed when the run ends.

**What the check counts.** :func:`snapshot` lists, as the run starts, the
user's own Jupyter data directory (all of it: ``fluksio/usage`` is where a
kernel's records would go) and the entries of ``/tmp``, ``/tmp/ray``,
``/dev/shm`` and the user's own ``TMPDIR``; :func:`leaks` lists them again at
the end, after every kernel of the run was shut down, and names what is new
and counts; the run then fails. Nothing found is removed: it is the user's. The machine may be
shared, with another run of this suite, someone's JupyterLab, or anything
else writing to the same places meanwhile, and a file does not say who made
it. So a new entry counts only when it can be pinned on this run:

- **its name carries the pid of one of the run's processes**: fluksio_nb's
  usage records (``<uid>-<pid>-<hex>.jsonl``), Jupyter servers' files
  (``jpserver-<pid>.json``), ipykernel's ``ipykernel_<pid>`` and Ray's
  sessions. The run's processes are the suite's own and every process seen
  descending from it, which :func:`watch` records from ``/proc`` as the run
  goes on, in a process of its own, beside the suite rather than in a thread
  of it that every ``fork`` of a test would copy. It looks every
  :data:`LOOK_EVERY` seconds, so a process that came and went between two
  looks is missed: its leaks go uncounted, nobody else's are counted.
- **or no one else could have made it**: when, all along the run, no process
  outside it looked like a suite, a notebook server or a kernel (its command
  line names pytest, jupyter, ipykernel or fluksio), every new entry of the
  data directory counts, and of the temporary places those named ``fluksio*``
  or owned by the suite's second users (:mod:`tests.unix_users`). A machine
  running one suite, as CI does, then has every leak of the run counted
  however it is named; a machine running two counts only those whose names
  say whose they are, and neither run fails for the other's.

What escapes it, knowingly: a process that reparented itself away from the
run before it was seen (a daemon's double fork); a pid numbered inside a pid
namespace, which is not the one ``/proc`` shows here; a pid of the run's that ended and was
given to another process before that one left a file; and, beside another
suite, whatever names no pid. Entries inside ``pytest-of-<user>`` are not
looked at: that is pytest's own place for ``tmp_path``, which it keeps for a
few runs on purpose.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from tests.unix_users import USER_A, USER_B

REPO = Path(__file__).resolve().parents[1]

#: Shared temporary places whose entries are compared; not their insides.
SHARED = (Path("/tmp"), Path("/tmp/ray"), Path("/dev/shm"))

#: How often :func:`watch` looks for new processes.
LOOK_EVERY = 0.2

#: Names that carry the pid of the process that made them.
PID_NAMES = (
    re.compile(r"^\d+-(\d+)-[0-9a-f]+\.jsonl$"),
    re.compile(r"^jpserver-(\d+)(?:-open\.html|\.json)$"),
    re.compile(r"^ipykernel_(\d+)$"),
    re.compile(r"^session_[\d_-]+_(\d+)$"),
)

#: A process outside the run that might write where the run's would.
SUITE_LIKE = re.compile(rb"pytest|jupyter|ipykernel|fluksio")


def user_data_dir() -> Path:
    """The Jupyter data directory of the user running the suite, as they set it."""
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir())


def snapshot(data_dir: Path, shared: list[Path]) -> set[Path]:
    """Every entry of ``data_dir``, and the entries directly in each of ``shared``."""
    found: set[Path] = set()
    for top, dirs, files in os.walk(data_dir):
        found.update(Path(top) / name for name in [*dirs, *files])
    for place in shared:
        with contextlib.suppress(OSError):
            found.update(place / name for name in os.listdir(place))
    return found


@dataclass
class Run:
    """One run's own directory, its watcher, and what the places held as it began."""

    own: Path
    data_dir: Path
    shared: list[Path]
    before: set[Path]
    watcher: subprocess.Popen[bytes]
    seen: Path


def redirect(environ: MutableMapping[str, str]) -> Run:
    """The run's own directory made, the places listed, and ``environ`` pointed there.

    Called before any process of the run starts, and before ``environ`` is
    changed, so that the listing is of the user's own places.
    """
    data_dir = user_data_dir()
    # The user's own temporary directory too, when TMPDIR names another.
    shared = sorted({*SHARED, Path(tempfile.gettempdir())})
    before = snapshot(data_dir, shared)
    # Short: Ray puts its sockets below TMPDIR (…/ray/session_…/sockets/…),
    # and a socket's path may be 107 bytes at most.
    own = Path(tempfile.mkdtemp(prefix="fs-"))
    seen = own / "processes"
    watcher = subprocess.Popen(
        [sys.executable, "-m", "tests.leaks", str(os.getpid()), str(seen)],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        # Out of the terminal's reach: a ^C stops the suite, which then stops this.
        start_new_session=True,
    )
    places = {
        "JUPYTER_DATA_DIR": own / "jupyter-data",
        "JUPYTER_RUNTIME_DIR": own / "jupyter-runtime",
        "IPYTHONDIR": own / "ipython",
    }
    for place in places.values():
        place.mkdir(mode=0o700)
    # The directory itself, not one below it: every byte counts for Ray (above).
    places["TMPDIR"] = own
    # pytest's tmp_path stays where pytest keeps it, for a few runs, to be looked at.
    environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    environ.update({name: str(place) for name, place in places.items()})
    # The books services the run's kernels start (the notebooks', each test's)
    # end two seconds after their last kernel, not a minute: none outlives the run.
    environ["FLUKSIO_BOOKS_LINGER"] = "2"
    # The suite's own process reads TMPDIR again, for what it makes itself.
    tempfile.tempdir = None
    return Run(own, data_dir, shared, before, watcher, seen)


def leaks(run: Run) -> list[Path]:
    """What the run left in the user's places; the watcher stopped, the run's directory removed."""
    run.watcher.send_signal(signal.SIGTERM)
    run.watcher.wait()
    ours, others, looked = _read_seen(run.seen)
    shutil.rmtree(run.own, ignore_errors=True)
    # A watcher stopped before it looked once saw nobody, which says nothing.
    alone = looked and not others
    ours.add(os.getpid())
    second_users = _uids(USER_A, USER_B)

    def ours_for_sure(path: Path) -> bool:
        return _pid_in_name(path.name) in ours

    def nobody_elses(path: Path) -> bool:
        return alone and (
            path.is_relative_to(run.data_dir)
            or path.name.startswith("fluksio")
            or _owner(path) in second_users
        )

    new = snapshot(run.data_dir, run.shared) - run.before
    return sorted(path for path in new if ours_for_sure(path) or nobody_elses(path))


def _pid_in_name(name: str) -> int | None:
    for pattern in PID_NAMES:
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    return None


def _uids(*names: str) -> set[int]:
    uids = set()
    for name in names:
        with contextlib.suppress(KeyError):
            uids.add(pwd.getpwnam(name).pw_uid)
    return uids


def _owner(path: Path) -> int | None:
    try:
        return path.lstat().st_uid
    except OSError:
        return None


def _read_seen(seen: Path) -> tuple[set[int], list[str], bool]:
    ours: set[int] = set()
    others: list[str] = []
    try:
        lines = seen.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ours, others, False
    for line in lines:
        kind, _, what = line.partition(" ")
        if kind == "ours":
            ours.add(int(what))
        elif kind == "other":
            others.append(what)
    return ours, others, "looked" in lines


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name, in parentheses, may itself hold spaces and parentheses.
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
    except OSError:
        return b""


def watch(root: int, seen: Path) -> None:
    """Write down ``root``'s descendants, and suite-like processes not among them, until it ends.

    One line each, as each is first seen: ``ours <pid>``, ``other <pid> <command>``;
    and ``looked`` once every process there was at the start has been.
    """
    ours = {root}
    # What started the suite (make, a shell, `timeout pytest …`) is not another suite.
    above, pid = set(), _parent(root)
    while pid:
        above.add(pid)
        pid = _parent(pid)
    known: set[int] = set(above)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with seen.open("a", buffering=1) as out:
        while not stop and os.path.exists(f"/proc/{root}"):
            alive = {int(name) for name in os.listdir("/proc") if name.isdigit()}
            new = {pid: _parent(pid) for pid in alive - known}
            # A child may be listed before its parent, both new since the last look.
            grew = True
            while grew:
                grew = False
                for pid, parent in new.items():
                    if pid not in ours and parent in ours:
                        ours.add(pid)
                        out.write(f"ours {pid}\n")
                        grew = True
            for pid in new:
                if pid not in ours and SUITE_LIKE.search(_command(pid)):
                    out.write(f"other {pid} {_command(pid).decode(errors='replace')}\n")
            # A pid that is gone may come back as another process's.
            ours &= alive | {root}
            if not known - above:
                out.write("looked\n")
            known = alive | above
            time.sleep(LOOK_EVERY)


if __name__ == "__main__":
    watch(int(sys.argv[1]), Path(sys.argv[2]))
