"""Second Unix users on this machine, for tests that run real processes as them.

fluksio_nb keeps its books, and moves its values, on a machine that several
people share. What it promises them — one user's claims count against
another's, one user's arrays cannot be read by another — only shows with
processes that really belong to different users. So these tests make real
users (``useradd``) and run real processes as them (``setpriv``), which takes
root: CI has it; elsewhere the tests skip and say what is missing.

The users are made once and left in place: two runs of the suite may share
the machine, and one must not delete a user the other's kernel runs as.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

#: Two users are enough to tell "mine" from "someone else's".
USER_A = "fluksio-test-a"
USER_B = "fluksio-test-b"

#: The checkout, whose ``fluksio_nb`` the venv imports (an editable install).
REPO_ROOT = Path(__file__).resolve().parents[1]

#: Where root's tools live, when its PATH left them out (``sudo`` often does).
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ReachabilityWarning(UserWarning):
    """Directories on the way to the venv or the checkout were opened to other users."""


@dataclass(frozen=True)
class UnixUser:
    name: str
    uid: int
    gid: int
    home: str


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=_SYSTEM_PATH)


def missing_for_unix_users() -> str | None:
    """Why this process cannot make users and run processes as them; ``None`` if it can."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux to run processes as other Unix users (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"needs root to create Unix users (running as uid {os.geteuid()})"
    for tool, package in (("useradd", "passwd"), ("setpriv", "util-linux")):
        if _tool(tool) is None:
            return f"needs `{tool}` (from {package}) to run processes as other Unix users"
    return None


def require_unix_users() -> None:
    """Skip the calling test, saying exactly what is missing, unless users can be made here."""
    reason = missing_for_unix_users()
    if reason is not None:
        pytest.skip(reason)


def _lookup(name: str) -> UnixUser:
    entry = pwd.getpwnam(name)
    return UnixUser(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def unix_user(name: str) -> UnixUser:
    """The user ``name``, made with a home of its own and no login shell if absent.

    Another run of the suite may be making the same user at the same moment,
    so a failed ``useradd`` is only a failure if the user is still absent.
    """
    try:
        return _lookup(name)
    except KeyError:
        pass
    useradd = _tool("useradd")
    if useradd is None:
        raise RuntimeError(f"cannot create the Unix user {name}: no `useradd` on this machine")
    made = subprocess.run(
        [useradd, "--create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
    )
    try:
        return _lookup(name)
    except KeyError:
        raise RuntimeError(
            f"`useradd {name}` failed (exit {made.returncode}): {made.stderr.strip()}"
        ) from None


def as_user(user: UnixUser) -> list[str]:
    """The command prefix that runs what follows as ``user``, with that user's groups."""
    setpriv = _tool("setpriv") or "setpriv"
    return [
        setpriv,
        "--reuid",
        str(user.uid),
        "--regid",
        str(user.gid),
        "--init-groups",
        "--",
    ]


def user_environ(user: UnixUser, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A clean environment for ``user``: PATH, HOME, LANG, who they are, then ``env``.

    Nothing else of the test's own environment goes through: root's settings,
    and the ``FLUKSIO_*`` that the suite's fixtures point at root's own
    temporary directories, are not the other user's.
    """
    return {
        "PATH": os.environ.get("PATH") or _SYSTEM_PATH,
        "HOME": user.home,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "USER": user.name,
        "LOGNAME": user.name,
        **(env or {}),
    }


def run_as(
    user: UnixUser, code: str, env: Mapping[str, str] | None = None, **kw
) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet as ``user`` with the venv's python, its output as text.

    Runs in the user's home, with :func:`user_environ`; ``kw`` goes to
    :func:`subprocess.run` and may override any of that.
    """
    options = {"capture_output": True, "text": True, "cwd": user.home, "timeout": 120, **kw}
    return subprocess.run(
        [*as_user(user), sys.executable, "-c", code],
        env=user_environ(user, env),
        **options,
    )


def make_reachable(path: str | os.PathLike[str]) -> list[Path]:
    """Let other users search every directory down to ``path``; the directories changed.

    Only the others-execute bit is added: another user can then reach files
    by name below these directories, but not list them. A checkout made with
    ``mktemp -d`` (mode 0700), or a Python under ``/root``, is otherwise out of
    reach of every user but root. Each change is reported, as a
    :class:`ReachabilityWarning`, since it outlives the test run.
    """
    target = Path(path).resolve()
    chain = [target] if target.is_dir() else []
    chain += list(target.parents)
    changed = []
    for directory in reversed(chain):
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            directory.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
            changed.append(directory)
    if changed:
        warnings.warn(
            "made searchable by other users (o+x), so tests can run Python as them: "
            + ", ".join(map(str, changed)),
            ReachabilityWarning,
            stacklevel=2,
        )
    return changed


def make_python_reachable(user: UnixUser) -> None:
    """Make sure ``user`` can run the venv's python and import this checkout's fluksio_nb.

    Fails the test, with what the user's python said, if it still cannot.
    """
    for path in {
        sys.prefix,
        sys.base_prefix,
        os.path.realpath(sys.executable),
        REPO_ROOT,
    }:
        make_reachable(path)
    _check_imports(user)


@functools.cache
def _check_imports(user: UnixUser) -> None:
    tried = run_as(user, "import fluksio_nb, ipykernel")
    if tried.returncode != 0:
        pytest.fail(
            f"{user.name} (uid {user.uid}) cannot import fluksio_nb with {sys.executable} "
            f"even with the directories on the way searchable; a file there may be "
            f"unreadable to other users:\n{tried.stderr.strip()}",
            pytrace=False,
        )


def ready_user(name: str) -> UnixUser:
    """The user ``name``, able to run this venv's python.

    Skips the calling test, saying why, where users cannot be made.
    """
    require_unix_users()
    user = unix_user(name)
    make_python_reachable(user)
    return user


@contextmanager
def shared_tmp_dir(prefix: str = "fluksio-shared-") -> Iterator[Path]:
    """A fresh directory under /tmp that every user can read, removed afterwards.

    pytest's ``tmp_path`` lies under a directory only its own user can enter.
    Root removes whatever other users left inside.
    """
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        directory.chmod(0o755)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def owned_tmp_dir(user: UnixUser, prefix: str = "fluksio-owned-") -> Iterator[Path]:
    """A fresh directory under /tmp that belongs to ``user`` alone, removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        os.chown(directory, user.uid, user.gid)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
