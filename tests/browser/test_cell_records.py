"""What a claimed cell leaves behind, read in a real JupyterLab as a person reads it.

Each ending must be said once: the claim's record, one line of facts, and
then the cell's error, one paragraph or the user's own traceback, with no
frame of fluksio_nb's in it. And a notebook saved and opened again without
the kernel that ran it must read the same, with no widget left to fail on.
Screenshots of every ending, in the light and the dark theme, are left in
``test-output/`` for a person to look at.
"""

from __future__ import annotations

import re

import pytest

from tests.browser.lab import contrast_failures, phases_until_the_record, records_survive_saving

pytestmark = pytest.mark.timeout(300)

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


def test_each_ending_is_said_once_with_none_of_fluksio_nbs_frames(notebook, page, server):
    """The record, then the why, once each; the user's traceback at the user's line."""
    cells = ["%load_ext fluksio_nb", *(cell for cell, _, _ in ENDINGS.values())]
    nb = notebook("endings.ipynb", cells)
    nb.run_cell(0)
    nb.wait_until_idle()
    for index, (ending, (_, why, record_starts)) in enumerate(ENDINGS.items(), start=1):
        nb.run_cell(index)
        if ending == "interrupted":
            nb.output_of(index).get_by_text("go").wait_for(timeout=60_000)
            nb.menu("Kernel", "kernelmenu:interrupt")
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
            count = nb.panel.locator(".jp-Cell").nth(index).locator(".jp-InputPrompt").inner_text()
            number = re.search(r"\d+", count)[0]
            assert f"Cell In[{number}], line " in said, said
    nb.screenshot("endings-light")
    low = contrast_failures(nb.panel.locator(".fluksio-status"))
    assert low == [], f"records below 4.5:1 on the light theme: {low}"
    assert page.errors == [], page.errors

    # Saved, so that the page opened again in the dark theme shows the same.
    nb.save()
    server.use_theme("JupyterLab Dark")
    try:
        nb.open()
        page.page.locator('body[data-jp-theme-light="false"]').wait_for(
            state="attached", timeout=60_000
        )
        nb.panel.locator(".fluksio-status").nth(len(ENDINGS) - 1).wait_for(timeout=60_000)
        nb.screenshot("endings-dark")
        low = contrast_failures(nb.panel.locator(".fluksio-status"))
        assert low == [], f"records below 4.5:1 on the dark theme: {low}"
    finally:
        server.use_theme("JupyterLab Light")


def test_a_saved_notebook_opened_again_without_its_kernel_shows_each_record(notebook, page, server):
    """No "model not found": the widget's display became the record, and that is what was saved."""
    records_survive_saving(notebook, server)
    assert page.errors == [], page.errors
