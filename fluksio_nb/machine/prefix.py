"""Where an admin's prefix may be, and what ``init`` made there.

Root writes, renames and changes modes under the prefix, so every directory
on the way must be one nobody else can change: from ``/`` to the prefix,
each is root's and writable by nobody else unless sticky, and from the
prefix down each is root's alone, made one level at a time
(:func:`root_dir`). Each is looked at as it is (``lstat``), never through a
link: a link on the way is refused, since whoever owns it (a user's
``/tmp/L``) may point it elsewhere once root has checked where it leads. A
prefix another user made first is refused, not adopted: whoever owns a
directory on the way can swap what root writes for a link to ``/etc/shadow``.

``init`` writes down what it made (the directories, by device and inode, and
the service it started, by pid and start time), and ``remove`` removes only
what that says, and stops only that service (:func:`read_made`,
:func:`write_made`).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluksio_nb.errors import BadClaim

if TYPE_CHECKING:
    from fluksio_nb.machine.setup import Layout


class MachineSetupError(BadClaim):
    """The machine's books cannot be set up, or removed, as asked."""


def nobody_else_can_change(path: Path, info: os.stat_result, sticky_ok: bool) -> None:
    """Refuse a directory on root's way that another user owns or may write in."""
    if not stat.S_ISDIR(info.st_mode):
        raise MachineSetupError(
            f"{path} is not a directory (a link, or a file); move it away and run init again"
        )
    if info.st_uid != 0:
        raise MachineSetupError(
            f"{path} belongs to uid {info.st_uid}, not root: whoever owns a directory on the "
            "way can swap what root writes there for a link to any file. Move it away (or "
            "choose another --prefix) and run init again"
        )
    writable = stat.S_IMODE(info.st_mode) & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not (sticky_ok and info.st_mode & stat.S_ISVTX):
        raise MachineSetupError(
            f"{path} may be written by others (mode {stat.S_IMODE(info.st_mode):o}), who could "
            "swap what root writes there; chmod go-w it, or choose another --prefix"
        )


def trusted_prefix(prefix: Path, *, missing_ok: bool = False) -> None:
    """The prefix's own directories, from ``/`` down, are root's, written by nobody else.

    Each as it is, links not followed: a link is refused, whoever made it,
    since what it leads to is its owner's to change after the check. One
    writable by others must be sticky (``/tmp``), so that nobody may rename
    what root made in it. With ``missing_ok``, the check ends at the first
    directory that is not there: nothing below it is either.
    """
    if not prefix.is_absolute() or ".." in prefix.parts:
        raise MachineSetupError(
            f"--prefix {prefix}: give an absolute path without '..', so that every "
            "directory on the way is the one checked"
        )
    for ancestor in reversed(prefix.parents):
        try:
            info = os.lstat(ancestor)
        except FileNotFoundError:
            if missing_ok:
                return
            raise MachineSetupError(
                f"{ancestor} does not exist; make it (root's, mode 755) or choose another --prefix"
            ) from None
        if stat.S_ISLNK(info.st_mode):
            raise MachineSetupError(
                f"{ancestor} is a symbolic link (to {os.readlink(ancestor)}): whoever owns it may "
                "point it elsewhere once root has checked it. Give the --prefix without links "
                "(the directory it leads to, if that is root's)"
            )
        nobody_else_can_change(ancestor, info, sticky_ok=True)


def root_dir(path: Path, mode: int, group: int = 0, *, prefix: Path) -> None:
    """A directory root owns with exactly ``mode``, every one from ``prefix`` down root's alone.

    Made one level at a time and each checked, never ``mkdir -p``: a level
    another user made first is refused, not adopted.
    """
    trusted_prefix(prefix)
    level = prefix
    for part in (Path(), *path.relative_to(prefix).parts):
        level = level / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(level, 0o755)
        # The records directory is itself sticky and everyone's: root writes
        # nothing in it, only sets its owner and mode, through its parent.
        nobody_else_can_change(level, os.lstat(level), sticky_ok=level == path)
    os.chown(path, 0, group, follow_symlinks=False)
    os.chmod(path, mode)


def identity(path: Path) -> list[int]:
    info = os.lstat(path)
    return [info.st_dev, info.st_ino]


def read_made(layout: Layout) -> dict[str, Any]:
    """What ``init`` wrote down that it made, if root wrote it; ``{}`` otherwise."""
    try:
        fd = os.open(layout.made, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    with open(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            return {}
        try:
            made = json.loads(file.read(1 << 16))
        except ValueError:
            return {}
    return made if isinstance(made, dict) else {}


def write_made(layout: Layout, *, service: dict[str, Any] | None) -> None:
    """Write down the directories ``init`` made, and the service it started, for ``remove``."""
    made = {
        "prefix": str(layout.prefix),
        "run_dir": identity(layout.run_dir),
        "config_dir": identity(layout.config.parent),
        "service": service,
    }
    staged = layout.made.with_suffix(".json.new")
    staged.write_text(json.dumps(made) + "\n")
    os.chmod(staged, 0o644)
    os.replace(staged, layout.made)
