"""What every view says about the cards: a claim's card memory, each card, and the squatters.

The failures guarded against: a claim on a card that shows nothing of its
card memory, or that shows ``GPU 0B`` where nothing read the cards (unknown
is not zero); a claim without cards that shows GPU figures; card memory held
by a process with no claim on that card going unnamed, or a claim's own
worker being named a squatter; and views that disagree, because each worked
the cards out its own way (the text of ``%claims``, the monitor, the
server's API and ``fluksio-nb`` all read :func:`fluksio_nb.overview.with_cards`).

The cards are a stand-in ``nvidia-smi`` (:mod:`tests.gpu_standins`) on the
``PATH`` of whatever reads them: this test process, a real kernel, a real
Jupyter server, the real command line. The processes on the cards are real.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.budget import Budget
from fluksio_nb.gpu_usage import CardReader
from fluksio_nb.overview import describe_snapshot, with_cards
from fluksio_nb.queue import ClaimQueue
from fluksio_nb.resources import ask
from fluksio_nb.sampler import CardShare, Sample
from fluksio_nb.status import ClaimStatus, describe
from fluksio_nb.widget.facts import claim_facts, machine_facts
from tests.gpu_standins import StandInSmi, card
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    """A process with no claim at all: someone's forgotten training run."""
    process = subprocess.Popen(["sleep", "120"])
    yield process
    process.kill()
    process.wait()


@pytest.fixture
def owner_with_a_child() -> Iterator[tuple[int, int]]:
    """A kernel-like process and its worker: ``(owner pid, worker pid)``."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess\n"
            "worker = subprocess.Popen(['sleep', '120'])\n"
            "print(worker.pid, flush=True)\n"
            "worker.wait()",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = int(owner.stdout.readline())
    yield owner.pid, worker
    os.kill(worker, 9)
    owner.kill()
    owner.wait()


def smi_cards(tmp_path: Path, apps: list[dict[str, Any]], monkeypatch) -> StandInSmi:
    """Two cards behind a stand-in nvidia-smi on this process's PATH, and no NVML."""
    cards = [card(0, utilisation=37, used_mib=2048), card(1, utilisation=5, used_mib=3072)]
    smi = StandInSmi(
        tmp_path / "smi", cards, [{"uuid": cards[a["card"]]["uuid"], **a} for a in apps]
    )
    monkeypatch.setenv("PATH", smi.path_env())
    monkeypatch.setitem(sys.modules, "pynvml", None)
    return smi


def a_claim_on_card_0(owner: int) -> dict[str, Any]:
    """The books with one running claim, holding card 0, whose kernel is ``owner``."""
    queue = ClaimQueue(ResourceAccountant(cpus=4, gpus=2, ram_bytes=8_000_000_000))
    ticket = queue.enqueue(ask(cpus=1, gpus=1, label="train"))
    queue.wait(ticket, 1)
    snapshot = queue.snapshot()
    (running,) = snapshot["running"]
    assert running["allocation"]["gpus"] == [0]
    running["pid"] = owner
    return snapshot


# -----------------------------------------------------------------------------
# The one place the cards are worked out
# -----------------------------------------------------------------------------


def test_card_memory_no_claim_on_that_card_sits_above_is_named_a_squatter(
    tmp_path, monkeypatch, sleeper, owner_with_a_child
):
    """The question people who share cards ask most: who holds card 1, with no claim on it?"""
    owner, worker = owner_with_a_child
    smi_cards(
        tmp_path,
        [
            # The claim's own worker, on its own card: the claim's memory.
            {"card": 0, "pid": worker, "used_mib": 1200},
            # Somebody's process with no claim at all.
            {"card": 1, "pid": sleeper.pid, "used_mib": 3000},
            # The same worker on a card its claim does not hold: a squatter too.
            {"card": 1, "pid": worker, "used_mib": 100},
        ],
        monkeypatch,
    )
    reading = CardReader().read()
    assert reading is not None and reading.source == "nvidia-smi"
    snapshot = with_cards(a_claim_on_card_0(owner), reading)

    me = snapshot["squatters"][0]["user"]
    assert [s["text"] for s in snapshot["squatters"]] == [
        f"card 1: 3.1GB held by pid {sleeper.pid} ({me}), no claim",
        f"card 1: 104.9MB held by pid {worker} ({me}), no claim",
    ]
    assert snapshot["squatters"][0] == {
        "card": 1,
        "pid": sleeper.pid,
        "driver_pid": sleeper.pid,
        "user": me,
        "used_bytes": 3000 * MIB,
        "text": f"card 1: 3.1GB held by pid {sleeper.pid} ({me}), no claim",
    }
    (claim,) = snapshot["running"]
    assert claim["gpu"]["cards"] == [
        {
            "index": 0,
            "held_bytes": 1200 * MIB,
            "utilisation_percent": 37.0,
            "used_bytes": 2048 * MIB,
            "total_bytes": 40960 * MIB,
        }
    ]
    assert claim["gpu"]["text"] == "GPU 1.3GB on card 0 (37% busy)"
    assert snapshot["cards_source"] == "nvidia-smi"
    assert [(c["text"], c["tickets"]) for c in snapshot["cards"]] == [
        ("card 0: 37% busy, 2.1GB/42.9GB used", [claim["ticket"]]),
        ("card 1: 5% busy, 3.2GB/42.9GB used", []),
    ]

    text = describe_snapshot(snapshot)
    assert "  card 0: 37% busy, 2.1GB/42.9GB used\n" in text
    assert f"(pid {owner}); GPU 1.3GB on card 0 (37% busy)\n" in text
    assert text.endswith(
        f"squatter card 1: 3.1GB held by pid {sleeper.pid} ({me}), no claim\n"
        f"squatter card 1: 104.9MB held by pid {worker} ({me}), no claim"
    )


def test_where_nothing_reads_the_cards_no_view_says_anything_about_card_memory():
    """No reading is not an idle card: no view may say ``GPU 0B`` or name squatters."""
    snapshot = with_cards(a_claim_on_card_0(os.getpid()), None)
    assert snapshot["cards"] == [] and snapshot["cards_source"] is None
    assert snapshot["squatters"] is None, "squatters said where nobody could tell"
    assert snapshot["running"][0]["gpu"] is None
    text = describe_snapshot(snapshot)
    # Which card the claim holds is a share, not a reading: "gpus=1 (card 0)".
    read = text.replace("gpus=1 (card 0)", "gpus=1")
    assert "GPU" not in read and "squatter" not in read and "card" not in read, text

    facts = machine_facts(snapshot, {}, (16_000_000_000, 8_000_000_000))
    assert facts["squatters"] is None and facts["cards_source"] is None
    assert [g["card"] for g in facts["gpus"]] == [None, None]
    assert facts["running"][0]["gpu"] == ""


def test_a_kernels_own_books_name_no_squatters(tmp_path, monkeypatch, sleeper):
    """A kernel keeping its own books cannot see other kernels' claims: it must not accuse them."""
    smi_cards(tmp_path, [{"card": 1, "pid": sleeper.pid, "used_mib": 3000}], monkeypatch)
    snapshot = with_cards(
        a_claim_on_card_0(os.getpid()), CardReader().read(), every_claim_known=False
    )
    assert snapshot["squatters"] is None
    assert len(snapshot["cards"]) == 2, "the cards themselves are still shown"
    assert "squatter" not in describe_snapshot(snapshot)


def test_the_monitor_shows_each_cards_figures_and_the_squatters(
    tmp_path, monkeypatch, sleeper, owner_with_a_child
):
    """The widget of ``%claims`` draws what the text says: the same reading, the same words."""
    owner, worker = owner_with_a_child
    smi_cards(
        tmp_path,
        [
            {"card": 0, "pid": worker, "used_mib": 1200},
            {"card": 1, "pid": sleeper.pid, "used_mib": 3000},
        ],
        monkeypatch,
    )
    snapshot = with_cards(a_claim_on_card_0(owner), CardReader().read())
    facts = machine_facts(snapshot, {}, (16_000_000_000, 8_000_000_000))
    assert facts["gpus"][1]["card"] == {
        "used_bytes": 3_221_000_000,  # to the megabyte: drift is no news
        "total_bytes": 40960 * MIB,
        "utilisation_percent": 5.0,
    }
    assert facts["squatters"] == [s["text"] for s in snapshot["squatters"]]
    assert facts["running"][0]["gpu"] == "GPU 1.3GB on card 0 (37% busy)"


# -----------------------------------------------------------------------------
# A claim's own status
# -----------------------------------------------------------------------------


def reading(cards: tuple[CardShare, ...] = ()) -> Sample:
    return Sample(
        rss_bytes=300_000_000,
        cpu_percent=25.0,
        cpu_cores=1.0,
        processes=2,
        host_total_bytes=16_000_000_000,
        host_available_bytes=8_000_000_000,
        at=time.monotonic(),
        cards=cards,
    )


def running_status(gpus: tuple[int, ...], budget: Budget | None = None) -> ClaimStatus:
    status = ClaimStatus(label="train", asked=ask(cpus=1, gpus=len(gpus)), ticket=1)
    status.phase, status.started_at = "running", time.monotonic()
    status.allocation = Allocation(cpus=1, gpus=gpus, ram_bytes=0)
    status.budget = budget
    return status


def test_a_claims_status_says_its_card_memory_and_the_cards_load_then_its_peak():
    """A claim on cards must say how much of them it holds while it runs, and its peak after."""
    status = running_status((0, 1), Budget(None, None, None, None, 4_000_000_000))
    status.readings.add(
        reading(
            (
                CardShare(0, 1_200_000_000, 2_000_000_000, 16_000_000_000, 37.0),
                CardShare(1, 0, 500_000_000, 16_000_000_000, None),
            )
        )
    )
    status.readings.add(reading((CardShare(0, 900_000_000, 2_000_000_000, 16_000_000_000, 12.0),)))
    line = describe(status)
    assert line.endswith(", CPU 25% of the machine, GPU 900.0MB of 4.0GB on card 0 (12% busy)"), (
        line
    )
    assert claim_facts(status)["gpu"] == "GPU 900.0MB of 4.0GB on card 0 (12% busy)"
    assert claim_facts(status)["peak_gpu_bytes"] == 1_200_000_000

    status.phase, status.ending, status.ended_at = "done", "ok", time.monotonic()
    assert describe(status).endswith(", peak GPU 1.2GB")


def test_a_claim_whose_cards_are_not_read_says_nothing_of_card_memory():
    """Unknown is not zero: no ``GPU 0B`` for a claim whose cards nothing reads, nor one without."""
    for gpus in ((0,), ()):
        status = running_status(gpus)
        status.readings.add(reading())
        assert "GPU" not in describe(status)
        assert claim_facts(status)["gpu"] == "" and claim_facts(status)["peak_gpu_bytes"] is None
        status.phase, status.ending, status.ended_at = "done", "ok", time.monotonic()
        assert "GPU" not in describe(status)


# -----------------------------------------------------------------------------
# In a real kernel: the status line, and %claims
# -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cards_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cards")


@pytest.fixture(scope="module")
def standin(cards_dir) -> StandInSmi:
    return StandInSmi(
        cards_dir / "smi", [card(0, utilisation=37, used_mib=2048), card(1, utilisation=5)]
    )


@pytest.fixture(scope="module")
def kernel(tmp_path_factory, standin):
    from tests.kernels import started_kernel

    # No FLUKSIO_GPUS: the kernel finds the stand-in's two cards as it would real ones.
    with started_kernel(
        tmp_path_factory.mktemp("kernel"),
        FLUKSIO_CPUS="2",
        FLUKSIO_RAM="4G",
        FLUKSIO_RESERVE_CPUS="0",
        **standin.env(),
    ) as k:
        yield k


def on_its_card(standin: StandInSmi, index: int, pid: int, mib: int, others=()) -> None:
    standin.set_apps([{"uuid": standin.cards[index]["uuid"], "pid": pid, "used_mib": mib}, *others])


def test_a_claimed_cell_on_a_card_shows_its_card_memory_live_and_its_peak_when_done(
    kernel, standin, cards_dir
):
    """In the cell itself: while it runs, what it holds of its card; when done, its peak."""
    from tests.kernels import Until, until_it_exists

    go = cards_dir / "go"
    msg_id = kernel.client.execute(
        "%%claim cpus=1 gpus=1 --label on-a-card\n"
        "import os\n"
        "print('worker', os.getpid(), os.environ['CUDA_VISIBLE_DEVICES'], flush=True)\n"
        f"{until_it_exists(go)}"
    )
    started = kernel.messages_of(msg_id, until=Until("say its pid", lambda r: "worker" in r.stdout))
    pid, index = map(int, started.stdout.split("worker", 1)[1].split()[:2])
    on_its_card(standin, index, pid, 1200)
    said = f"GPU 1.3GB on card {index} ({standin.cards[index]['utilisation']}% busy)"

    def widget_says(_ran) -> bool:
        # The live status is the claim's widget: its state, pushed as comm messages.
        return any(
            m["msg_type"] == "comm_msg" and m["content"]["data"].get("state", {}).get("gpu") == said
            for m in kernel.seen
        )

    kernel.messages_of(msg_id, until=Until(f"show {said!r} live", widget_says))
    go.touch()
    ran = kernel.messages_of(msg_id, timeout=60)
    assert kernel.reply_to(msg_id)["content"]["status"] == "ok"
    (summary,) = [t for t in ran.texts if t.startswith("on-a-card: ok · ")]
    assert summary.endswith(", peak GPU 1.3GB"), summary
    standin.set_apps([])


def test_claims_shows_each_card_each_claims_card_memory_and_the_squatters(
    kernel, standin, cards_dir, sleeper
):
    """``%claims``, in a kernel on the user's own books: the cards, the claims on them, the rest."""
    pid_file = cards_dir / "background-worker"
    kernel.start_job(
        "%%claim cpus=1 gpus=1 --background --label in-the-background\n"
        "import os, pathlib, time\n"
        f"pathlib.Path({str(pid_file)!r}).write_text("
        "f\"{os.getpid()} {os.environ['CUDA_VISIBLE_DEVICES']}\")\n"
        "time.sleep(120)\n",
        "job",
    )
    assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), 30)
    pid, index = map(int, pid_file.read_text().split())
    other = 1 - index
    on_its_card(
        standin,
        index,
        pid,
        700,
        [{"uuid": standin.cards[other]["uuid"], "pid": sleeper.pid, "used_mib": 3000}],
    )
    busy = standin.cards[index]["utilisation"]
    squatter = f"squatter card {other}: 3.1GB held by pid {sleeper.pid} ("
    try:
        shown: list[str] = []

        def claims_says_it() -> bool:
            texts = kernel.run("%claims", check=True).texts
            shown[:] = texts[:1]
            return bool(texts) and squatter in texts[0] and "on card" in texts[0]

        assert wait_until(claims_says_it, 20), f"%claims never showed it all: {shown}"
        text = shown[0]
        lines = text.splitlines()
        (running,) = [line for line in lines if line.startswith("running")]
        assert "in-the-background" in running
        # Its peak is the claim's own word, in the books once its kernel reported it.
        assert re.search(
            rf"; GPU 734.0MB on card {index} \({busy}% busy\)(, peak 734.0MB)?$", running
        ), running
        assert f"  card {index}: {busy}% busy," in text
        (named,) = [line for line in lines if line.startswith("squatter")]
        assert named.startswith(squatter) and named.endswith("), no claim")

        # The monitor's widget draws from the same reading, in the same words.
        drawn: list[Any] = []

        def the_monitor_says_it() -> bool:
            drawn[:] = [
                kernel.facts(
                    "(lambda f: {'squatters': f['squatters'], 'gpu': f['running'][0]['gpu']})"
                    "(__import__('fluksio_nb.widget.ticker', fromlist=['x']).MachineReader()())"
                )
            ]
            return drawn[0] == {
                "squatters": [named.removeprefix("squatter ")],
                "gpu": f"GPU 734.0MB on card {index} ({busy}% busy)",
            }

        assert wait_until(the_monitor_says_it, 10), drawn
    finally:
        kernel.run("job.cancel()")
        standin.set_apps([])


# -----------------------------------------------------------------------------
# The server's API, and fluksio-nb
# -----------------------------------------------------------------------------

HOLDER = """
import os, subprocess, sys
from fluksio_nb import Resources, accountant
queue = accountant()
ticket = queue.enqueue(Resources(cpus=1, gpus=1), label="held-from-a-script")
queue.wait(ticket, 30)
worker = subprocess.Popen(["sleep", "120"])
print(ticket.allocation.gpus[0], worker.pid, flush=True)
sys.stdin.read()
worker.kill()
"""


@pytest.fixture
def lab(tmp_path, standin) -> Iterator[Any]:
    from tests.browser.lab import JupyterLab

    server = JupyterLab(tmp_path / "lab", {"FLUKSIO_CPUS": "4", "FLUKSIO_RAM": "8G"})
    # Detection, not a declared count, finds the stand-in's cards.
    del server.env["FLUKSIO_GPUS"]
    server.env.update(standin.env(server.env.get("PATH")))
    server.start()
    yield server
    server.stop()


def test_the_snapshot_api_and_the_command_line_show_cards_claims_and_squatters(
    lab, standin, sleeper
):
    """JupyterLab's panel and status bar and ``fluksio-nb`` read the same cards, said the same."""
    from tests.test_server import snapshot, wait_for

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        env=lab.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        index, worker = map(int, holder.stdout.readline().split())
        other = 1 - index
        on_its_card(
            standin,
            index,
            worker,
            1200,
            [{"uuid": standin.cards[other]["uuid"], "pid": sleeper.pid, "used_mib": 3000}],
        )

        def read() -> dict[str, Any] | None:
            shown = snapshot(lab)
            return shown if shown.get("squatters") else None

        shown = wait_for(read, "the snapshot naming the squatter")
        assert shown["cards_source"] == "nvidia-smi"
        assert [c["index"] for c in shown["cards"]] == [0, 1]
        (claim,) = shown["running"]
        assert claim["gpu"]["cards"][0]["held_bytes"] == 1200 * MIB
        assert claim["gpu"]["text"].startswith(f"GPU 1.3GB on card {index} (")
        (squatter,) = shown["squatters"]
        assert squatter["card"] == other and squatter["pid"] == sleeper.pid
        assert squatter["used_bytes"] == 3000 * MIB
        assert squatter["text"].startswith(f"card {other}: 3.1GB held by pid {sleeper.pid} (")

        said = subprocess.run(
            [sys.executable, "-m", "fluksio_nb"],
            env=lab.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert said.returncode == 0, said.stderr
        assert f"squatter {squatter['text']}" in said.stdout.splitlines()
        assert f"; {claim['gpu']['text']}" in said.stdout
        for shown_card in shown["cards"]:
            assert f"  card {shown_card['index']}: " in said.stdout
    finally:
        holder.stdin.close()
        holder.wait(30)
        standin.set_apps([])


def test_a_snapshot_without_a_card_reading_has_no_gpu_figures(tmp_path):
    """A server on a machine no driver answers on: cards unknown, not idle, and no squatters."""
    snapshot = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import json; from fluksio_nb.overview import read_books; "
                "print(json.dumps(read_books()))",
            ],
            env={
                **os.environ,
                "PATH": "/usr/bin:/bin",
                "FLUKSIO_LEDGER": str(tmp_path / "ledger"),
                "FLUKSIO_GPUS": "2",
            },
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )
    assert snapshot["cards"] == [] and snapshot["cards_source"] is None
    assert snapshot["squatters"] is None
