"""Putting a worker's output into the cell that asked for it.

A worker's stdout, display data and traceback have to appear in the cell that
started the claim, as they happen, and stay there. For a cell that waits for
its worker this is the cell that is executing anyway. For a ``--background``
claim it is not: by the time the worker prints, the user is running other
cells, and ipykernel sends output to whichever cell is executing now.

So the relay remembers the message that started the cell (its parent header)
when it is made, and sends every output as a reply to that message, on the
kernel's IOPub channel, from whichever thread the output arrives on. Outside
ipykernel (a terminal IPython, a test shell) there is no such channel, and
output goes to this process's own streams and display hook instead.

A cell's ``input()`` goes the other way, and only from the cell the kernel is
executing: ipykernel answers input requests for that cell alone.

A worker is told the number the notebook gives the cell
(:func:`kernels_cell_number`), so that a traceback from it says
``Cell In[n]`` as the kernel's own would.
"""

from __future__ import annotations

import itertools
import sys
import uuid
from typing import Any

#: Why a claimed cell's ``input()`` found nobody to ask.
BACKGROUND_CANNOT_ASK = (
    "input() in a claimed cell asks the notebook only from a cell the kernel is waiting on, "
    "not from a --background cell or a Ray task. Ask in a normal cell, and use the answer here."
)


#: What sets this process's display ids apart from every other kernel's.
_THIS_PROCESS = uuid.uuid4().hex[:16]
_displays = itertools.count()


def new_display_id() -> str:
    """An id no other display in any notebook has, for a display to be redrawn by.

    Random once per process and counted after: a random id per display asked
    the OS for randomness twice in every claimed cell, and let the main
    thread's hold on the interpreter go each time.
    """
    return f"fluksio-{_THIS_PROCESS}-{next(_displays)}"


def kernels_cell_number() -> int | None:
    """The ``In[n]`` of the cell the kernel runs now, or ``None`` outside a kernel.

    Read from the cells IPython has entered, of which the running one is the
    last: IPython 9 counts ``execution_count`` up as a cell starts, and 8 as
    it ends, so that count is the cell's own number in one and the next's in
    the other.
    """
    # IPython's own module, not the package's deferred name, which imports anew each time.
    getipython = sys.modules.get("IPython.core.getipython")
    shell = getipython and getipython.get_ipython()
    entered = getattr(getattr(shell, "history_manager", None), "input_hist_parsed", None)
    if isinstance(entered, list) and len(entered) > 1:
        return len(entered) - 1
    count = getattr(shell, "execution_count", None)
    return count if isinstance(count, int) else None


def kernels_colors() -> str | None:
    """The kernel's IPython colour scheme (``neutral`` in a notebook), or ``None`` outside one.

    A claimed cell's traceback is formatted in the worker: in a scheme of its
    own it came in a dark terminal's palette, near white on JupyterLab's light
    error background. ``neutral`` is what ipykernel uses, in colours the
    front ends map to their theme's.
    """
    getipython = sys.modules.get("IPython.core.getipython")
    shell = getipython and getipython.get_ipython()
    colors = getattr(shell, "colors", None)
    return colors if isinstance(colors, str) else None


class NoOneToAsk(Exception):
    """A claimed cell asked for input where no one can answer it."""


class CellOutput:
    """Sends a worker's output to one cell, from any thread, at any time."""

    def __init__(self) -> None:
        self._kernel = _kernel()
        self._parent = None if self._kernel is None else _executing(self._kernel)

    def stdout(self, text: str) -> None:
        self._stream("stdout", text)

    def stderr(self, text: str) -> None:
        self._stream("stderr", text)

    def display(
        self,
        data: dict[str, Any],
        metadata: dict[str, Any] | None = None,
        display_id: str | None = None,
    ) -> None:
        """Show a bundle; with a ``display_id``, one that :meth:`update_display` redraws."""
        transient = {"display_id": display_id} if display_id else {}
        if self._kernel is None:
            from IPython.display import publish_display_data

            publish_display_data(data, metadata or {}, transient=transient)
            return
        self._send(
            "display_data", {"data": data, "metadata": metadata or {}, "transient": transient}
        )

    def update_display(
        self, data: dict[str, Any], display_id: str, metadata: dict[str, Any] | None = None
    ) -> None:
        """Redraw what :meth:`display` showed under ``display_id``, wherever it is."""
        if self._kernel is None:
            from IPython.display import publish_display_data

            publish_display_data(
                data, metadata or {}, transient={"display_id": display_id}, update=True
            )
            return
        self._send("update_display_data", _redrawn(data, display_id, metadata))

    def leave_display(self, data: dict[str, Any], display_id: str) -> None:
        """Redraw a display for the last time: what the saved notebook keeps.

        Sent under the cell executing now as well, when that is another cell:
        nbclient (``nbconvert --execute``, papermill) reads only the messages of
        the cell it is running, though it applies a display update to any
        cell. JupyterLab routes an update by its display id alone, so there
        the second one redraws the same thing again.
        """
        self.update_display(data, display_id)
        if self._kernel is None:
            return
        now = _executing(self._kernel)
        if _msg_id(now) not in (None, _msg_id(self._parent)):
            self._send("update_display_data", _redrawn(data, display_id), parent=now)

    def clear_output(self, wait: bool = False) -> None:
        """Clear the cell's output, now or, with ``wait``, when the next output comes."""
        if self._kernel is None:
            from IPython.display import clear_output

            clear_output(wait)
            return
        # What the kernel has buffered for this cell goes first, as before a stream.
        sys.stdout.flush()
        sys.stderr.flush()
        self._send("clear_output", {"wait": wait})

    def result(self, data: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
        # Shown as display data, not execute_result: the execution count belongs
        # to the kernel's cell, which has already (or will) report its own.
        self.display(data, metadata)

    def error(self, ename: str, evalue: str, traceback: list[str]) -> None:
        if self._kernel is None:
            sys.stderr.write("\n".join(traceback) + "\n")
            return
        self._send("error", {"ename": ename, "evalue": evalue, "traceback": traceback})

    def input(self, prompt: str, password: bool) -> str:
        """Ask the notebook, as ``input()`` or ``getpass()`` in the cell itself would.

        Only the thread running the cell can: ipykernel answers input requests
        for the cell it is executing, in its main thread, and a background
        cell's thread asks long after that cell is over.
        """
        import threading

        if threading.current_thread() is not threading.main_thread():
            raise NoOneToAsk(BACKGROUND_CANNOT_ASK)
        import builtins
        import getpass

        return getpass.getpass(prompt) if password else builtins.input(prompt)

    def _stream(self, name: str, text: str) -> None:
        if not text:
            return
        if self._kernel is None:
            stream = sys.stdout if name == "stdout" else sys.stderr
            stream.write(text)
            stream.flush()
            return
        # Whatever the kernel has buffered for this cell goes first, so the
        # kernel's own prints and the worker's come out in the order they ran.
        getattr(sys, name).flush()
        self._send("stream", {"name": name, "text": text})

    def _send(
        self, msg_type: str, content: dict[str, Any], parent: dict[str, Any] | None = None
    ) -> None:
        kernel = self._kernel
        kernel.session.send(
            kernel.iopub_socket,
            msg_type,
            content,
            parent=parent or self._parent,
            ident=f"kernel.{kernel.ident}.{msg_type}".encode(),
        )


class ForegroundOutput(CellOutput):
    """Output of code the kernel is waiting on: a cell, or a ``c.run`` call. Its error is
    raised, not sent.

    Raising is what marks the cell as failed, so that "Run All" stops there as
    it would for a normal cell, and what lets a ``try`` catch it; sending the
    traceback as well would show it twice, or show a caught one.
    """

    def error(self, ename: str, evalue: str, traceback: list[str]) -> None:
        pass


def _executing(kernel: Any) -> dict[str, Any]:
    """The request of the cell the kernel is executing now, or executed last."""
    # ipykernel 6 keeps one parent per channel; older keeps just one.
    get_parent = getattr(kernel, "get_parent", None)
    return get_parent("shell") if get_parent else kernel._parent_header


def _redrawn(
    data: dict[str, Any], display_id: str, metadata: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An ``update_display_data`` message's content."""
    return {"data": data, "metadata": metadata or {}, "transient": {"display_id": display_id}}


def _msg_id(parent: dict[str, Any] | None) -> str | None:
    return ((parent or {}).get("header") or {}).get("msg_id")


def _kernel():
    """The running ipykernel, or ``None`` outside one."""
    try:
        from IPython.core.getipython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None or not hasattr(kernel, "iopub_socket"):
        return None
    return kernel
