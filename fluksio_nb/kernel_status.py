"""The kernel says busy in JupyterLab and Notebook 7 for the whole of a cell with a widget.

A claimed cell shows a widget, and JupyterLab (4.4 on) sends the comm
messages of each widget model to a kernel subshell of their own (JEP 91),
which it asks the kernel for as the first model arrives: a
``create_subshell_request`` on the control channel. ipykernel answers every
control message between a ``busy`` and an ``idle`` on IOPub, and JupyterLab
takes every status there as the kernel's, save those answering a message
type in the server's ``untracked_message_types``. That list leaves out the
subshell requests, though it is meant to hold every message sent on a
channel other than shell; so about a second into a ten-second claimed cell
the status bar said "Idle", and so did ``GET api/sessions``, whose state the
server keeps by the same list.

What it decides: the server's list gains the subshell requests and replies,
in the kernel manager (which the server's own state and every page loaded
from now on read) and in the page config already made from it, whichever
extension loaded first. A status in answer to them then changes nothing: the
kernel is busy for as long as it runs a cell. Nothing else is taken out.
"""

from __future__ import annotations

from typing import Any

#: JEP 91's control messages, none of which is the kernel running anything.
SUBSHELL_MESSAGES = (
    "create_subshell_request",
    "create_subshell_reply",
    "delete_subshell_request",
    "delete_subshell_reply",
    "list_subshell_request",
    "list_subshell_reply",
)


def keep_subshell_requests_out_of_the_status(serverapp: Any) -> None:
    """Add :data:`SUBSHELL_MESSAGES` to the server's untracked message types, where it has them."""
    manager = getattr(serverapp, "kernel_manager", None)
    untracked = getattr(manager, "untracked_message_types", None)
    if not isinstance(untracked, list):
        return
    manager.untracked_message_types = _with_subshell_messages(untracked)
    # JupyterLab's server extension copies the list into the page config as it
    # loads; if it loaded before this one, its copy is the one pages get.
    page_config = serverapp.web_app.settings.get("page_config_data", {})
    copied = page_config.get("untracked_message_types")
    if isinstance(copied, list):
        page_config["untracked_message_types"] = _with_subshell_messages(copied)


def _with_subshell_messages(kinds: list[str]) -> list[str]:
    """``kinds``, then each of :data:`SUBSHELL_MESSAGES` it does not hold yet."""
    return [*kinds, *(kind for kind in SUBSHELL_MESSAGES if kind not in kinds)]
