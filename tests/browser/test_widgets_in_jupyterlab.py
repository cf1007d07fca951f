"""The live widgets in a real JupyterLab, in headless Chromium, as a user sees them.

The failures guarded against are the ones only a browser shows: a front-end
module that does not load (no widget at all, or "Error displaying widget"), a
status that never leaves "running", readings that never arrive, a monitor
that does not show the queue, and a label that is run as HTML instead of
shown as text.
"""

from __future__ import annotations

import time

import pytest

from tests.browser.lab import HOSTILE, memory_hog, peak_rss_of, phases_until_the_record, stray_text
from tests.local_ray import START_TIMEOUT_S, ray_env, starting_ray

pytestmark = [pytest.mark.timeout(180), pytest.mark.keeps_its_page]


def test_a_claimed_cell_shows_its_memory_live_and_how_it_ended(notebook, page):
    """The status must follow the claim to its end, with a peak RSS that matches the cell."""
    nb = notebook(
        "memory.ipynb",
        [
            "%load_ext fluksio_nb",
            memory_hog("memory hog"),
        ],
    )
    nb.run_all()
    claim = nb.wait_for(1, ".fluksio-claim")
    running = claim.locator("[data-field=rss]")
    running.wait_for(timeout=30_000)
    nb.screenshot("claim-running")
    # The row's parts are laid out as flex items: their text comes a line each.
    held = " ".join(claim.locator("[data-field=enforcement]").inner_text().split())
    assert held.startswith("held by cores: ") and " · memory: " in held, held

    assert "memory hog" in claim.locator(".fluksio-label").inner_text()

    seen, record = phases_until_the_record(nb.output_of(1))
    assert seen[0] in ("waiting", "running"), seen
    said = record.inner_text()
    assert said.startswith("memory hog: ok · waited "), said
    peak = peak_rss_of(said)
    assert 300 * 2**20 <= peak < 1500 * 2**20, f"peak RSS {peak} is not what a 300 MiB cell uses"
    assert "Error displaying widget" not in nb.output_of(1).inner_text()
    nb.screenshot("claim-done")
    assert page.errors == [], page.errors


def test_the_monitor_shows_a_waiting_claim_and_labels_stay_text(notebook, page):
    """%claims must show the queue, and a label that is HTML must be shown, never run."""
    nb = notebook(
        "queue.ipynb",
        [
            "%load_ext fluksio_nb",
            "%%claim cpus=2 --background --label holder\nimport time\ntime.sleep(20)",
            f'%%claim cpus=2 --background --label "{HOSTILE}"\nprint("ran")',
            "%claims",
        ],
    )
    nb.run_all()
    monitor = nb.wait_for(3, ".fluksio-monitor")
    waiting = monitor.locator("[data-list=waiting] .fluksio-item")
    waiting.first.wait_for(timeout=60_000)
    running = monitor.locator("[data-list=running] .fluksio-item")
    running.first.wait_for(timeout=30_000)

    assert waiting.count() == 1
    assert waiting.first.locator(".fluksio-label").inner_text() == HOSTILE
    # A place, not a ticket number; and how long it may wait, or why nobody can tell.
    assert waiting.first.locator("[data-field=position]").inner_text() == "1st in the queue"
    expected = waiting.first.locator("[data-field=expected]").inner_text()
    assert expected.startswith(("nobody can tell when it starts: ", "expected to start ")), expected
    assert "#" not in monitor.inner_text(), "a ticket number where a person reads"
    assert "holder" in running.first.locator(".fluksio-label").inner_text()
    assert monitor.locator("[data-field=cpus]").inner_text() == "2/2 used"
    assert stray_text(monitor) == [], "the monitor drew text that is no section of it"
    # The waiting claim's own status says the same, as text.
    own = nb.output_of(2).locator(".fluksio-claim")
    assert own.get_attribute("data-phase") == "waiting"
    assert own.locator(".fluksio-label").inner_text() == HOSTILE

    time.sleep(1)  # an onerror handler would have fired by now
    assert page.page.locator(".fluksio img").count() == 0
    assert page.dialogs == [], f"a label was run as HTML: {page.dialogs}"
    nb.screenshot("monitor-with-queue")
    assert page.errors == [], page.errors


@pytest.mark.timeout(180 + START_TIMEOUT_S)
def test_the_monitor_shows_the_ray_cluster_and_this_kernels_claim_on_it(lab, notebook, page):
    """While connected, %claims draws the cluster and this kernel's claim on it, label as text."""
    pytest.importorskip("ray", reason="ray is not installed: pip install 'fluksio_nb[ray]'")
    import shutil
    import tempfile

    import psutil

    # Short, because Ray puts Unix sockets under it; nothing goes to ~/.ray.
    state = tempfile.mkdtemp(prefix="fluksio-ray-")
    try:
        nb = notebook(
            "ray_monitor.ipynb",
            [
                "%load_ext fluksio_nb",
                f"import os\nos.environ.update({ray_env(state)!r})\n" + starting_ray(state),
                "import threading, time\nfrom fluksio_nb import claim\nfrom fluksio_nb.ray.monitor "
                "import ray_snapshot\n"
                "def _hold():\n"
                f"    with claim(cpus=1, gpus=1, ram='100M', label={HOSTILE!r}, on='ray') as c:\n"
                "        c.run(time.sleep, 30)\n"
                "threading.Thread(target=_hold, daemon=True).start()\n"
                "while not [c for c in ray_snapshot()['claims'] if c['rss_bytes']]:\n"
                "    time.sleep(0.2)",
                "%claims",
            ],
        )
        nb.run_all()
        monitor = nb.wait_for(3, ".fluksio-monitor", timeout_ms=(60 + START_TIMEOUT_S) * 1000)
        section = monitor.locator("[data-section=ray]")
        section.wait_for(timeout=30_000)
        claim = section.locator("[data-list=ray] .fluksio-item")
        claim.first.wait_for(timeout=30_000)

        assert section.locator("[data-field=ray-cpus]").inner_text() == "1/2 used"
        assert section.locator("[data-field=ray-gpus]").inner_text() == "1/2 used"
        assert claim.count() == 1
        assert claim.first.get_attribute("data-phase") == "running"
        assert claim.first.locator(".fluksio-label").inner_text() == HOSTILE
        assert "asks cpus=1 gpus=1 ram=100.0MB" in claim.first.inner_text()
        assert int(claim.first.locator("[data-field=rss]").get_attribute("data-value")) > 0

        time.sleep(1)  # an onerror handler would have fired by now
        assert page.page.locator(".fluksio img").count() == 0
        assert page.dialogs == [], f"a label was run as HTML: {page.dialogs}"
        nb.screenshot("monitor-with-ray")
        assert page.errors == [], page.errors
    finally:
        lab.shutdown_kernels()  # and with the kernel, the Ray it started
        deadline = time.monotonic() + 20
        while True:
            left = [
                p
                for p in psutil.process_iter(["cmdline"])
                if any(state in part for part in p.info["cmdline"] or ())
            ]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for straggler in left:
            straggler.kill()
        shutil.rmtree(state, ignore_errors=True)
