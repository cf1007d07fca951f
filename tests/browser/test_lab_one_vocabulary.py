"""A failed claim in JupyterLab's panel and notices, in the words every other view uses.

The Python views of one finished claim are held to one vocabulary in
tests/test_one_vocabulary.py; the panel and the notices say it with
format.ts. The failures guarded against here: the panel's times figured
from timestamps of its own ("waited 0.0 s · ran 9.2 s" beside the record's
"waited 0.1 s … ran 8.7 s"), a 12-hour clock ("3:19:17 AM") where every other
view says 15:19:17, "never started" where the rest say "never got its
share", the error line left out of the panel and the notice ("'long-fail'
ended error after running 31 s"), and a short background claim's end never
told while its notebook is not the one in front.
"""

from __future__ import annotations

import pytest

from fluksio_nb.vocabulary import clock, seconds
from tests.browser.lab import (
    in_background,
    notebook_kernel,
    phases_until_the_record,
)
from tests.browser.test_lab_notices import hold_the_machine, recording_toasts, wait_for_toast
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

FAILS = "import time\ntime.sleep(1.2)\nraise ValueError('the model diverged')"


def test_a_failed_background_claim_is_told_and_listed_in_every_views_words(lab, page):
    """A short background claim that failed in a notebook not in front: its end is told with
    its error line, and the panel lists it with the record's figures, share and ending."""
    ui = page.page
    ui.goto(lab.url("lab/workspaces/one-vocabulary"))
    ui.locator(".fluksio-lab-status").click(timeout=30_000)
    panel = ui.locator("#fluksio-nb-panel")
    panel.wait_for(state="visible", timeout=10_000)
    recording_toasts(ui)

    client = notebook_kernel(lab, "work/fail.ipynb")
    try:
        in_background(client, "cpus=1 --label long-fail", FAILS, "job")
        # Under the 30 s that a claim in front must run for: told because it is not in front.
        told = wait_for_toast(lab, ui, "error", "fail.ipynb failed after running")
    finally:
        client.stop_channels()

    finished = lab.api("GET", "fluksio/api/finished")["claims"]
    (entry,) = [claim for claim in finished if claim["label"] == "long-fail"]
    assert entry["error"] == "ValueError: the model diverged", entry
    # Seen running, it is named by its path; ended between two polls, by its name.
    said = (
        f"fail.ipynb failed after running {seconds(entry['ran_s'])}: "
        "ValueError: the model diverged."
    )
    assert told.startswith("‘long-fail’ in ") and said in told, told
    assert told.count("failed") == 1, told

    row = panel.locator(".fluksio-lab-list-finished .fluksio-lab-claim", has_text="long-fail")
    assert wait_until(lambda: row.count() == 1, timeout=30)
    assert row.locator(".fluksio-lab-ending").inner_text() == "error"
    assert row.get_attribute("data-mark") == "bad"
    # The same figures the cell's record said, in the same words, and the 24-hour clock.
    # "ended" and its clock are held together by a no-break space: read as one space.
    assert row.locator(".fluksio-lab-claim-share").inner_text().replace("\xa0", " ") == (
        f"waited {seconds(entry['waited_s'])} · ran {seconds(entry['ran_s'])} · "
        f"ended {clock(entry['ended_at'])}"
    )
    assert row.locator(".fluksio-lab-claim-held").inner_text() == "cpus=1"
    assert row.locator(".fluksio-lab-claim-error").inner_text() == (
        "ValueError: the model diverged"
    )
    # The ending's word in its mark's colour, as %claims colours it, not the text's black.
    colours = row.evaluate(
        """row => ['.fluksio-lab-ending', '.fluksio-lab-claim-label']
              .map(part => getComputedStyle(row.querySelector(part)).color)"""
    )
    assert colours[0] != colours[1], colours
    assert page.errors == [], page.errors


def test_the_live_status_and_the_record_that_replaces_it_share_one_type_and_one_waiting(
    lab, notebook, page
):
    """Guards against the line growing from 12 px to 14 px as the claim ends, and against a
    queued cell's header saying "waiting" twice ("waiting … waiting 00:03")."""
    released = lab.home / "release-one-type-holder"
    client = hold_the_machine(lab, released)
    try:
        nb = notebook("one-type.ipynb", ["%load_ext fluksio_nb", "%%claim cpus=1 --label next\n1"])
        nb.run_cell(0)
        nb.wait_until_ran(0)
        nb.run_cell(1)
        output = nb.output_of(1)
        head = output.locator(".fluksio-claim[data-phase='waiting'] .fluksio-head")
        head.wait_for(timeout=60_000)
        assert wait_until(lambda: head.inner_text().count("waiting") == 1, timeout=10), (
            head.inner_text()
        )
        live = output.locator(".fluksio-claim").evaluate("e => getComputedStyle(e).fontSize")
        released.touch()
        _, record = phases_until_the_record(output)
        said = record.evaluate("e => getComputedStyle(e).fontSize")
        assert said == live, (live, said)
    finally:
        released.touch()
        client.stop_channels()
    assert page.errors == [], page.errors
