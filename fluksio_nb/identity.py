"""Who a process is, as the operating system says.

A user's name goes into the books, the monitor and the usage records, and on
a machine several people share it decides whose claim is whose. ``$USER`` and
``$LOGNAME`` are anybody's to set, so the name always comes from a uid: the
process's own, a file's owner, or a socket's peer.
"""

from __future__ import annotations

import os
import pwd


def user_name(uid: int) -> str:
    """The name of user ``uid``, or the uid itself where it has no entry (a container's)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def my_user() -> str:
    """The name of the user this process runs as."""
    return user_name(os.geteuid())
