"""Where a user's own books service lives, and the checks that it is theirs alone.

A user's own service (:mod:`.user_service`) answers on a socket in this
directory, and keeps its state and its log there. Whoever can write the
directory could plant a socket that collects this user's claims, or rewrite
the state a restarted service puts claims back from. So the directory is
checked here before anything in it is used.

What it trusts, and what it refuses:

- **Only a directory its owner alone can write.** The directory is opened
  once, without following a symlink, and checked on the open descriptor: it
  must belong to this process's user and be writable by nobody else. A
  directory that fails is refused with :class:`UnsafeBooksDir`, saying how
  to fix it, and never chmod-ed into shape: the directory somebody chose
  (``FLUKSIO_LEDGER``) may be theirs to share, like ``/tmp``, and quietly
  taking its sticky bit away is worse than refusing. Only a directory it
  creates itself does it make (0700).
- **Only files it reached through that directory.** Every file is opened
  relative to the checked descriptor, never following a symlink, and used
  only if it is a regular file of this user's that nobody else can write and
  that has no other name (:func:`untrusted_file` says what is wrong with one).
  Swapping the directory or planting a link after the check therefore
  changes nothing the service touches. Its files are 0600.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from fluksio_nb.errors import BadSettings
from fluksio_nb.identity import user_name
from fluksio_nb.stop_button import open_whole

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: How to fix a books directory that is not this user's alone.
_WAY_OUT = (
    "point FLUKSIO_LEDGER at a directory of your own; books shared by several users "
    "are set up with `fluksio-nb machine init`"
)


class UnsafeBooksDir(BadSettings):
    """The books' directory, or a file in it, is not this user's alone.

    Raised rather than repaired: the books are only as good as the guarantee
    that nobody else can write them, and the directory may be someone's to share.
    """


def default_books_dir() -> Path:
    """Where a user's books service lives when ``FLUKSIO_LEDGER`` says nothing."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "fluksio"


def _who(uid: int) -> str:
    return f"uid {uid} ({user_name(uid)})"


def open_directory(directory: Path) -> int:
    """The books' directory, opened and checked: made (0700) if missing, never changed."""
    try:
        fd = open_whole(directory, _OPEN_DIR)
    except FileNotFoundError:
        try:
            os.makedirs(directory.parent, exist_ok=True)
            # Made by someone else in the meantime: checked below like any other.
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
            fd = open_whole(directory, _OPEN_DIR)
        except OSError as error:
            raise _unusable_directory(directory, error) from None
    except OSError as error:
        raise _unusable_directory(directory, error) from None
    try:
        found = os.fstat(fd)
        if found.st_uid != os.geteuid():
            raise UnsafeBooksDir(
                f"fluksio_nb's books directory {directory} belongs to {_who(found.st_uid)}, "
                f"not to this user ({_who(os.geteuid())}): whoever owns it can rewrite the "
                f"books of every kernel kept there. To fix it, {_WAY_OUT}."
            )
        if found.st_mode & 0o022:
            raise UnsafeBooksDir(_writable_by_others(directory, found.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _writable_by_others(directory: Path, mode: int) -> str:
    said = (
        f"fluksio_nb's books directory {directory} can be written by other users "
        f"(mode {stat.S_IMODE(mode):o}): any of them could rewrite these books, or leave "
        "links in it for this user's kernels to follow."
    )
    if mode & stat.S_ISVTX:
        # A sticky, world-writable directory is somebody's shared scratch
        # space, such as /tmp: telling them to chmod it would break it.
        own = directory / f"fluksio-{user_name(os.geteuid())}"
        return (
            f"{said} It is a shared scratch directory, such as /tmp: keep the books in a "
            f"directory of your own instead, such as {own}, by pointing FLUKSIO_LEDGER "
            "there; books shared by several users are set up with `fluksio-nb machine init`."
        )
    return f"{said} Fix it with `chmod go-w {directory}`, or {_WAY_OUT}."


def _unusable_directory(directory: Path, error: OSError) -> BadSettings:
    if error.errno in (errno.ELOOP, errno.ENOTDIR) and directory.is_symlink():
        # O_NOFOLLOW on a symlink fails with ELOOP, or ENOTDIR with O_DIRECTORY.
        return UnsafeBooksDir(
            f"fluksio_nb's books directory {directory} is a symbolic link, which is "
            "not followed: whoever can change the link decides where the books go. "
            "Point FLUKSIO_LEDGER at the directory itself, or at another of your own; "
            "books shared by several users are set up with `fluksio-nb machine init`."
        )
    return BadSettings(
        f"fluksio_nb's books directory {directory} cannot be used: "
        f"{error.strerror or error}. To fix it, {_WAY_OUT}."
    )


def untrusted_file(path: Path, found: os.stat_result) -> str | None:
    """What is wrong with a file in the books' directory, and its fix; None if nothing."""
    remove = f"remove it (`rm {path}`)"
    if not stat.S_ISREG(found.st_mode):
        return f"is not a regular file. Fix it: {remove}"
    if found.st_uid != os.geteuid():
        return f"belongs to {_who(found.st_uid)}. Fix it: {remove}"
    if found.st_mode & 0o022:
        mode = stat.S_IMODE(found.st_mode)
        return f"can be written by other users (mode {mode:o}). Fix it: `chmod go-w {path}`"
    if found.st_nlink != 1:
        # Its other name may be somewhere the books must never write.
        return f"has {found.st_nlink} names (hard links). Fix it: {remove}"
    return None
