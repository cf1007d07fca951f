"""How nbval runs these notebooks: what it compares, and how their Ray starts.

**Each display as it stood when its cell ended.** A claimed cell that runs
past half a second draws its live view, and when the claim ends it replaces
that view in place with the claim's record (an ``update_display_data`` for the
same display). The stored notebooks hold the record, as JupyterLab saves it.
nbval 0.11 compares the first version of each display and drops every
update, so a cell that ran a little long on a loaded machine was compared by
its live view and failed. Here every update the kernel sent while the cell
ran is applied first, as JupyterLab and nbclient apply them; what is then
compared is what a person sees when the cell is done. A display that ends
showing nothing is not compared at all: a live view drawn above output that
came after it is emptied, and the record drawn below that output, so whether
a cell's outputs hold an empty display depends on the machine's load too.

**One Ray start at a time.** ``ray_cluster.ipynb`` starts a local Ray, and
Ray gives itself a fixed 30 s to start. Its ``ray.init`` cell waits for any
other Ray start of this user's on the machine, and is run again when Ray gave
up on that clock, as the tests' own starts are (:mod:`tests.local_ray`).

**Books of the run's own.** The notebooks' kernels keep their claims in a
ledger made for this run and removed after it, not in the user's own. Two
runs on one machine would otherwise queue behind each other's cells, and
``gpus.ipynb`` declares a machine with two cards that no other kernel on
the same books has: while one of them holds a claim, the books refuse the
other's.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from nbformat import NotebookNode, from_dict
from nbval.plugin import IPyNbCell, IPyNbFile

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from tests.local_ray import START_TIMEOUT_S, started_again_when_ray_gave_up  # noqa: E402

DISPLAYS = ("display_data", "execute_result")


def as_shown_at_the_end(
    outputs: list[NotebookNode], messages: list[dict[str, Any]]
) -> list[NotebookNode]:
    """``outputs``, which nbval gathered from ``messages``, with each display updated.

    nbval keeps a cell's displays in the order the kernel sent them, so the
    n-th display among the outputs is the n-th display message of the cell.
    """
    cell = next(
        (m["parent_header"].get("msg_id") for m in messages if m["msg_type"] == "execute_input"),
        None,
    )
    made = [
        m
        for m in messages
        if m["msg_type"] in DISPLAYS and m["parent_header"].get("msg_id") == cell
    ]
    if len(made) != sum(output.output_type in DISPLAYS for output in outputs):
        return outputs  # not the messages these outputs came from: compare them as nbval would
    latest = {
        m["content"]["transient"]["display_id"]: m["content"]
        for m in messages
        if m["msg_type"] == "update_display_data"
    }
    shown, displays = [], iter(made)
    for output in outputs:
        if output.output_type in DISPLAYS:
            display_id = next(displays)["content"].get("transient", {}).get("display_id")
            if display_id in latest:
                output = from_dict({**output, **_shown_part(latest[display_id])})
        shown.append(output)
    return shown


def _shown_part(content: dict[str, Any]) -> dict[str, Any]:
    return {"data": content["data"], "metadata": content.get("metadata", {})}


def shows_something(output: NotebookNode) -> bool:
    """Whether a person sees anything of ``output``: a display with only empty data does not."""
    if output.output_type not in DISPLAYS:
        return True
    return any(value not in ("", [], {}) for value in output.get("data", {}).values())


_read_message = IPyNbFile.get_kernel_message
_compare_outputs = IPyNbCell.compare_outputs


def _reading_every_message(self: IPyNbFile, timeout: float | None = None, stream: str = "iopub"):
    message = _read_message(self, timeout=timeout, stream=stream)
    if stream == "iopub":
        self.__dict__.setdefault("messages_of_this_cell", []).append(message)
    return message


def _comparing_as_shown(self: IPyNbCell, test, ref, skip_compare=None):
    shown = as_shown_at_the_end(test, self.parent.messages_of_this_cell)
    return _compare_outputs(
        self, list(filter(shows_something, shown)), list(filter(shows_something, ref)), skip_compare
    )


IPyNbFile.get_kernel_message = _reading_every_message
IPyNbCell.compare_outputs = _comparing_as_shown


def starts_ray(item: pytest.Item) -> bool:
    return isinstance(item, IPyNbCell) and "ray.init(" in item.cell.source


# Before pytest-xdist's own hook, which reads the groups into each test's id.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, IPyNbCell):
            # A notebook's cells run in order, in the one kernel nbval started
            # for it: on one worker, when the run has several (`pytest -n`).
            item.add_marker(pytest.mark.xdist_group(item.parent.nodeid))
        if starts_ray(item):
            item.add_marker(pytest.mark.timeout(START_TIMEOUT_S))


_books: list[str] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    if isinstance(item, IPyNbCell):
        item.parent.messages_of_this_cell = []
        # Before the notebook's kernel starts, which happens in this setup.
        if not _books:
            _books.append(tempfile.mkdtemp(prefix="fluksio-notebook-books-"))
        os.environ["FLUKSIO_LEDGER"] = _books[0]


def pytest_unconfigure(config: pytest.Config) -> None:
    for books in _books:
        shutil.rmtree(books, ignore_errors=True)


_run_cell = IPyNbCell.runtest


def _starting_ray_as_the_tests_do(self: IPyNbCell) -> None:
    """The cell; a cell that starts Ray, as :mod:`tests.local_ray` starts the tests' own.

    One start at a time, and again when Ray gave up on its own 30 s clock,
    with what the failed start left shut down first: that is Ray starting
    slowly on a loaded machine, which the notebook is not about.
    """
    if not starts_ray(self):
        return _run_cell(self)
    source = self.cell.source

    def shut_down_first() -> None:
        self.cell.source = f"import ray\nray.shutdown()\n{source}"

    try:
        return started_again_when_ray_gave_up(lambda: _run_cell(self), shut_down_first)
    finally:
        self.cell.source = source


IPyNbCell.runtest = _starting_ray_as_the_tests_do
