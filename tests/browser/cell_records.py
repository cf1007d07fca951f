"""What a claimed cell leaves behind, checked the same way in JupyterLab and in Notebook 7.

Each ending must be said once: the claim's record, one line of facts, then
the cell's error, one paragraph or the user's own traceback, with no frame of
fluksio_nb's in it. And a notebook saved and opened again without the kernel
that ran it must read the same, with no widget left to fail on. The tests
for each app call these with that app's fixtures.
"""

from __future__ import annotations

import re
import time
from typing import Any

from tests.browser.lab import JupyterLab, contrast_failures, phases_until_the_record

#: One cell for each way a claimed cell ends, with what must be said once in
#: its output, and the start of its record.
ENDINGS = {
    "ok": (
        "%%claim cpus=1 --label slow\nimport time\ntime.sleep(2)\ndone = True",
        None,
        "slow: ok · waited ",
    ),
    "error": (
        "%%claim cpus=1 --label boom\nbefore = 1\n1/0",
        "division by zero",
        "boom: error · waited ",
    ),
    "halted": (
        "%%claim cpus=1 ram=100M --label greedy\nimport numpy as np\nb = np.ones(400_000_000 // 8)",
        "Ask for more with ram=",
        "greedy: halted · waited ",
    ),
    "timed out": (
        "%%claim cpus=1 --timeout 2 --label slowpoke\nimport time\ntime.sleep(60)",
        "Raise --timeout",
        "slowpoke: timed out · waited ",
    ),
    "not back": (
        "%%claim cpus=1 --label lock\nimport threading\nlk = threading.Lock()\nfine = 3",
        "did not come back to the kernel",
        "lock: ok, but not every name came back · waited ",
    ),
    "interrupted": (
        "%%claim cpus=1 --label stopme\nimport time\nprint('go', flush=True)\ntime.sleep(60)",
        # Said twice by any traceback of it, as by a normal cell's: head and tail.
        None,
        "stopme: interrupted · waited ",
    ),
}

#: What only a traceback through fluksio_nb's own code would show.
OUR_FRAMES = re.compile(r"fluksio_nb/|magics\.py|contextlib|lifecycle\.py")


def each_ending_said_once(notebook: Any, page: Any, server: JupyterLab) -> None:
    """Run a cell for each ending: the record, then the why, once each, in light and dark.

    ``notebook`` and ``page`` are the tests' fixtures of those names, and
    ``server`` the app they drive. The user's traceback must be at the
    user's line with the notebook's own In[n], and no text may read below
    4.5:1 in either theme. Screenshots of both land in ``test-output/``.
    """
    cells = ["%load_ext fluksio_nb", *(cell for cell, _, _ in ENDINGS.values())]
    nb = notebook("endings.ipynb", cells)
    nb.run_cell(0)
    nb.wait_until_ran(0)
    nb.wait_until_idle()
    for index, (ending, (_, why, record_starts)) in enumerate(ENDINGS.items(), start=1):
        nb.run_cell(index)
        if ending == "interrupted":
            nb.output_of(index).get_by_text("go").wait_for(timeout=60_000)
            nb.menu("Kernel", "kernelmenu:interrupt")
        nb.wait_until_ran(index)
        nb.wait_until_idle()
        output = nb.output_of(index)
        # Waits for the record to be drawn, and any live widget gone.
        _, records = phases_until_the_record(output)
        assert records.count() == 1, f"{ending}: {records.count()} records\n{output.inner_text()}"
        said = output.inner_text()
        assert records.first.inner_text().startswith(record_starts), said
        if why is not None:
            assert said.count(why) == 1, f"{ending}: {why!r} said {said.count(why)} times\n{said}"
        assert not OUR_FRAMES.search(said), f"{ending} shows fluksio_nb's own code:\n{said}"
        if ending in ("error", "interrupted"):
            # The user's own traceback, numbered as the notebook numbers the cell.
            number = cell_number(nb, index)
            assert f"Cell In[{number}], line " in said, said
    nb.screenshot(f"endings-light-{server.app}")
    low = contrast_failures(nb.panel.locator(".fluksio-status"))
    assert low == [], f"records below 4.5:1 on the light theme: {low}"

    # Saved, so that the page opened again in the dark theme shows the same.
    nb.save()
    server.use_theme("JupyterLab Dark")
    try:
        nb.open()
        page.locator('body[data-jp-theme-light="false"]').wait_for(state="attached", timeout=60_000)
        nb.panel.locator(".fluksio-status").nth(len(ENDINGS) - 1).wait_for(timeout=60_000)
        nb.screenshot(f"endings-dark-{server.app}")
        low = contrast_failures(nb.panel.locator(".fluksio-status"))
        assert low == [], f"records below 4.5:1 on the dark theme: {low}"
    finally:
        server.use_theme("JupyterLab Light")


def records_survive_saving(notebook: Any, server: JupyterLab) -> None:
    """Run claimed cells, save, end the kernel, open again: each record reads as it did.

    ``notebook`` is the tests' fixture of that name. A long claim (a live
    widget, then its record), a short one (only the record) and a
    background one are each checked in the saved file, which must hold no
    widget view, and on the page opened again with a new kernel, which knows
    no widget of the old one's.
    """
    nb = notebook(
        "saved.ipynb",
        [
            "%load_ext fluksio_nb",
            "%%claim cpus=1 --label long\nimport time\ntime.sleep(2)",
            "%%claim cpus=1 --label quick\nx = 1",
            "%%claim cpus=1 --label later --background\nimport time\ntime.sleep(2)",
        ],
    )
    claims = ((1, "long"), (2, "quick"), (3, "later"))
    nb.run_all()
    nb.wait_until_idle()
    for index, label in claims:
        _, record = phases_until_the_record(nb.output_of(index))
        assert record.inner_text().startswith(f"{label}: ok · waited "), record.inner_text()
    nb.save()
    saved = server.read_notebook("saved.ipynb")
    kinds = {
        kind
        for cell in saved["cells"]
        for o in cell.get("outputs", [])
        for kind in o.get("data", {})
    }
    assert "application/vnd.jupyter.widget-view+json" not in kinds, kinds
    server.shutdown_kernels()

    nb.open()
    for index, label in claims:
        said = nb.output_of(index).inner_text()
        assert said.startswith(f"{label}: ok · waited "), said
        assert "model not found" not in said and "Error displaying widget" not in said, said
    nb.screenshot(f"saved-and-opened-again-{server.app}")


def cell_number(nb: Any, index: int, timeout_s: float = 30) -> str:
    """The ``n`` of the In[n] the page shows for cell ``index``, once it shows one.

    Notebook 7 draws the number a moment after the kernel is idle again.
    """
    prompt = nb.panel.locator(".jp-Cell").nth(index).locator(".jp-InputPrompt")
    deadline = time.monotonic() + timeout_s
    while (found := re.search(r"\d+", prompt.inner_text())) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"cell {index} shows no In[n]: {prompt.inner_text()!r}")
        time.sleep(0.1)
    return found[0]
