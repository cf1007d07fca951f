"""Every way a claim can fail, in one place.

A user who writes ``except fluksio_nb.ClaimTimeout`` should not need to know
which floor of the package raised it, and a new place to run a claim should
raise the errors the magic already knows how to show. So the errors are
defined here, on the bottom floor, and raised from wherever the failure is
found. This module imports nothing of the package, not even for annotations,
so that any module may raise any of them.

What each one decides is how the user reads it. Subclasses of
:class:`BadClaim` are input the user can fix: refused before anything waits
or starts, shown as one line with what to change. :class:`ClaimHalted`,
:class:`WorkerDied`, :class:`ClaimTimeout`, :class:`ClaimCancelled` and
:class:`NotBroughtBack` are whole stories in their message, shown as one
paragraph. :class:`RemoteError`
is the cell's own exception, shown with the worker's traceback.
:class:`ClampedWarning` is told at the user's own line, by
:func:`warn_at_users_line`, whichever floor found the claim too big, and
quotes the line as typed (:func:`typed_as`), ``%%claim`` and all.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

#: The packages between a user's line and the floor that warns: a ``%%claim``
#: cell reaches fluksio_nb through IPython's ``run_cell_magic``, a ``with``
#: block may go through ``contextlib``.
_MACHINERY = frozenset({"fluksio_nb", "IPython", "contextlib"})


#: The line the user typed, where the source line of their frame is not it: a
#: ``%%claim`` cell's line 1 is IPython's ``get_ipython().run_cell_magic(...)``.
_TYPED: ContextVar[str | None] = ContextVar("fluksio_nb_typed_line", default=None)


@contextlib.contextmanager
def typed_as(line: str) -> Iterator[None]:
    """Quote ``line`` under a warning told at the user's line while the block runs."""
    token = _TYPED.set(line)
    try:
        yield
    finally:
        _TYPED.reset(token)


class BadClaim(ValueError):
    """A claim that cannot be understood, with what was wrong and how to fix it."""


class UnknownFlavor(BadClaim):
    """A claim names a size that is defined nowhere."""


class BadSettings(BadClaim):
    """A setting that cannot be used, with where it came from."""


class ClaimTooLarge(BadClaim):
    """A strict claim asks for more than the machine has."""


class ServiceUnavailable(BadClaim):
    """The machine's books are set up but their service does not answer."""


class BooksDisagree(ServiceUnavailable):
    """A kernel declares another machine than the books its user's other kernels keep."""


class RayMissing(BadClaim):
    """``--on ray`` was asked for where Ray is not installed."""


class ClaimTooBigForCluster(BadClaim):
    """No node of the cluster could ever hold the claim, so Ray would wait forever."""


class UnsendableInput(ValueError):
    """An input the cell asked for cannot be pickled, so the cell was not run."""

    def __init__(self, message: str, name: str = "", reason: str = "") -> None:
        super().__init__(message)
        #: The input that cannot go, and why, for whoever words it for the user.
        self.name, self.reason = name, reason


def unsendable(name: str, reason: str, to: str) -> UnsendableInput:
    """The refusal of a cell's input ``name`` that cannot go ``to`` the worker or the cluster."""
    return UnsendableInput(
        f"input '{name}' cannot be sent to {to} ({reason}) — "
        f"leave '{name}' out of the cell's inputs and create it inside the cell",
        name,
        reason,
    )


class ClampedWarning(UserWarning):
    """A claim asked for more than the machine has and was given what there is."""


def warn_at_users_line(message: str, category: type[Warning]) -> None:
    """Warn at the line of the user's that led here: the cell's, never fluksio_nb's own file.

    A ``stacklevel`` counts frames, and how many lie between the user and the
    floor that found the claim too big depends on the books in force and on
    whether a magic or a ``with`` asked; so the frame is found by whose it is.
    Shown every time, not once per line as Python's default would: the same
    cell run again is shrunk again, and the second claim of a session is not
    shrunk any less than the first. A filter the user set still applies.
    """
    frame = sys._getframe(1)
    outermost = frame
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.partition(".")[0] not in _MACHINERY:
            break
        outermost, frame = frame, frame.f_back
    # Machinery all the way out, which no claim made in a cell or a script is: the outermost.
    at = frame or outermost
    filename, lineno = at.f_code.co_filename, at.f_lineno
    where = (message, category, _as_ipython_names(filename), lineno)
    module = str(at.f_globals.get("__name__", ""))
    typed = _TYPED.get()
    if typed is None:
        # Read here, by the file's real name: the name it is shown by is not a file.
        typed = _line(filename, lineno, at.f_globals)
    _warn_quoting(typed, where, module)


def _line(filename: str, lineno: int, module_globals: dict[str, Any]) -> str | None:
    try:
        # The module's globals let a module's line be read through its loader.
        line = linecache.getline(filename, lineno, module_globals)
    except (ImportError, ValueError, AttributeError):
        # Globals no loader can give the source for: `python -c`'s __main__,
        # whose loader is the built-in importer, and a kernel's namespace,
        # whose __spec__ is None. A cell's lines are in the cache already.
        line = linecache.getline(filename, lineno)
    return line.strip() or None


def _as_ipython_names(filename: str) -> str:
    """A cell's file as IPython names it in tracebacks, ``Cell In[3]``; other files as they are.

    ipykernel compiles each cell under a temporary file's path, which says
    nothing to the person who typed the cell.
    """
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    names = getattr(getattr(shell, "compile", None), "_filename_map", None)
    count = names.get(filename) if isinstance(names, dict) else None
    return f"Cell In[{count}]" if isinstance(count, int) else filename


def _warn_quoting(typed: str | None, where: tuple[Any, ...], module: str) -> None:
    """Warn at ``where`` under the ``typed`` line, the user's filters deciding as ever.

    ``warn_explicit`` takes no source line: the one it shows comes from
    linecache, which holds the cell as IPython transformed it. So the filters
    decide into a list, and what they let through is shown with the typed line.
    """
    with warnings.catch_warnings(record=True) as told:
        warnings.warn_explicit(*where, module=module, registry=None)
    for said in told:
        # catch_warnings is process-wide: another thread's warning caught in
        # the meantime is shown too, as it would have been, with its own line.
        ours = said.category is where[1] and str(said.message) == where[0]
        warnings.showwarning(
            said.message,
            said.category,
            said.filename,
            said.lineno,
            said.file,
            typed if ours else said.line,
        )


class ClaimTimeout(TimeoutError):
    """A claim waited longer than its timeout allowed."""


class ClaimCancelled(RuntimeError):
    """Somebody cancelled a claim before or while it ran."""


class NotYours(PermissionError):
    """A claim may only be cancelled by the user who made it."""


class ClaimHalted(RuntimeError):
    """A claim stopped for memory: over its budget (sampler or cgroup), or the host short."""

    def __init__(self, decision: Any) -> None:
        super().__init__(decision.message)
        #: The :class:`~fluksio_nb.budget.HaltDecision` behind it: the numbers.
        self.decision = decision


class WorkerDied(RuntimeError):
    """The worker process ended in the middle of the work."""


class NotBroughtBack(RuntimeError):
    """The cell ran, but names it bound could not come back to the kernel.

    Raised after the rest are bound, so that "Run All" stops here rather
    than at a later cell that reads a name that is not there.
    """


class RemoteError(Exception):
    """The claimed code raised; its traceback is the worker's, not the kernel's."""

    def __init__(self, ename: str, evalue: str, traceback: list[str], outcome: Any = None) -> None:
        super().__init__(f"{ename}: {evalue}")
        self.ename, self.evalue, self.traceback = ename, evalue, traceback
        #: What the cell had bound before it raised, as a normal cell keeps it:
        #: the worker's :class:`~fluksio_nb.worker.client.Outcome`.
        self.outcome = outcome


class Interrupted(KeyboardInterrupt):
    """The stop button ended the cell; ``outcome`` is what it had bound by then, if it said.

    A cell stopped by SIGINT ends like any other: the worker sends back the
    names it had bound, which a normal cell stopped halfway would also keep.
    """

    def __init__(self, outcome: Any = None) -> None:
        super().__init__()
        #: The worker's :class:`~fluksio_nb.worker.client.Outcome`, when it said.
        self.outcome = outcome
