"""Idle cards given back: ``idle_card_minutes`` in ``machine.json``.

The rule first, as plain arithmetic over readings (:mod:`fluksio_nb.machine.idle_cards`):
which claim is idle, for how long, and when it is warned, ended or let be.
Then the whole of it as people meet it: a machine's books service set up by
``fluksio-nb machine init`` as root, reading cards through a stand-in
``nvidia-smi`` on its ``PATH`` (:mod:`tests.gpu_standins`), and real kernels
of two real Unix users, one holding cards, one waiting for one. Minutes are
test-sized: 0.02 min is 1.2 s.

The failures guarded against: a card left idle while someone waits for it,
never given back; a claim ended without warning, or without saying why and
who set the limit; a busy card, or an idle one nobody waits behind, taken
away; a record that says a claim was cancelled when the machine's rule
ended it; and a limit mistyped in ``machine.json`` that silently does nothing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fluksio_nb.gpu_usage import CardReading, CardsReading
from fluksio_nb.machine.idle_cards import IdleCardRule, IdlePolicy, RunningClaim
from fluksio_nb.machine.setup import Layout
from fluksio_nb.records import IDLE_CARDS
from tests.gpu_standins import StandInSmi, card
from tests.kernels import Kernel, until_it_exists
from tests.machines import fluksio_nb, kernels_on_books, machine, wait_until
from tests.unix_users import USER_A, USER_B, ready_user, require_unix_users, shared_tmp_dir

GIB = 1 << 30

# -- the rule ---------------------------------------------------------------------


def reading(at: float, *cards: tuple[int, float | None, int | None]) -> CardsReading:
    """A pass of the cards at ``at``: ``(index, utilisation, memory used)`` each."""
    return CardsReading(
        cards=tuple(
            CardReading(
                index=index,
                uuid=f"GPU-{index}",
                utilisation_percent=busy,
                used_bytes=used,
                total_bytes=40 * GIB,
                processes=(),
            )
            for index, busy, used in cards
        ),
        source="nvidia-smi",
        at=at,
    )


MINUTE = IdlePolicy(idle_s=60, grace_s=30)


def run(
    rule: IdleCardRule,
    claims: list[RunningClaim],
    passes: list[CardsReading | None],
    waiters: int = 1,
) -> list[tuple[float, int, str]]:
    """Each pass fed to the rule, decided on at the pass's time: ``(when, claim, action)``."""
    said = []
    now = 0.0
    for one in passes:
        now = one.at if one is not None else now + 10
        rule.saw(one)
        said += [(now, d.number, d.action) for d in rule.decide(claims, lambda: waiters, now)]
    return said


def test_a_claim_idle_for_the_window_while_one_waits_is_warned_then_ended_after_the_grace():
    """Guards against an idle card never given back, and against one ended with no warning."""
    rule = IdleCardRule(MINUTE)
    claim = RunningClaim(7, (1,), granted_at=0.0)
    passes = [reading(t, (1, 0, GIB)) for t in (0, 30, 61, 80, 91)]
    assert run(rule, [claim], passes) == [(61, 7, "warn"), (91, 7, "end")]


def test_the_words_say_why_who_set_the_limit_and_when():
    """Guards against a warning or an ending that a user cannot act on or argue with."""
    rule = IdleCardRule(IdlePolicy(idle_s=30 * 60, grace_s=5 * 60))
    claim = RunningClaim(7, (1,), granted_at=0.0)
    rule.saw(reading(0, (1, 0, GIB)))
    rule.saw(reading(30 * 60, (1, 0, GIB)))
    (warning,) = rule.decide([claim], lambda: 2, now=30 * 60)
    assert warning.message.startswith(
        "claim 7's card 1 has been idle (0 % use, memory unchanged) for 30 min while "
        "2 claims wait for a card; this machine's admin gives idle cards back after 30 min "
        "(idle_card_minutes in machine.json): it will be ended at "
    )
    assert warning.message.endswith("unless the card is used")
    rule.saw(reading(35 * 60, (1, 0, GIB)))
    (ending,) = rule.decide([claim], lambda: 2, now=35 * 60)
    assert ending.action == "end"
    assert ending.message.startswith(
        "claim 7's card 1 had been idle (0 % use, memory unchanged) for 35 min while "
        "2 claims waited for a card; this machine's admin gives idle cards back after 30 min "
        "(idle_card_minutes in machine.json), 5 min after a warning (idle_card_grace_minutes): "
        "it was ended at "
    )


@pytest.mark.parametrize(
    "second",
    [
        pytest.param((1, 3, GIB), id="used"),
        pytest.param((1, 0, 2 * GIB), id="memory changed"),
        pytest.param((1, None, GIB), id="utilisation unknown"),
        pytest.param((1, 0, None), id="memory unknown"),
        pytest.param((0, 0, GIB), id="card missing"),
    ],
)
def test_a_card_used_changed_or_unknown_starts_its_window_again(second):
    """Guards against a card that worked, or that the driver could not read, counted idle."""
    rule = IdleCardRule(MINUTE)
    claim = RunningClaim(7, (1,), granted_at=0.0)
    passes = [
        reading(0, (1, 0, GIB)),
        reading(30, second),
        reading(61, (1, 0, 3 * GIB)),
        reading(100, (1, 0, 3 * GIB)),
        reading(125, (1, 0, 3 * GIB)),
    ]
    # Idle again from 61 at the latest, so due a warning only at 121.
    assert run(rule, [claim], passes) == [(125, 7, "warn")]


def test_no_reading_at_all_is_never_idle():
    """Guards against a driver that stopped answering read as cards doing nothing."""
    rule = IdleCardRule(MINUTE)
    claim = RunningClaim(7, (1,), granted_at=0.0)
    passes = [reading(0, (1, 0, GIB)), None, reading(61, (1, 0, GIB)), reading(90, (1, 0, GIB))]
    assert run(rule, [claim], passes) == []


def test_a_claim_is_idle_only_when_every_card_of_it_is_and_only_since_its_grant():
    """Guards against a claim using one of its two cards losing both, and against a claim
    granted a card that sat idle before it being warned at once."""
    rule = IdleCardRule(MINUTE)
    both = RunningClaim(7, (0, 1), granted_at=0.0)
    late = RunningClaim(8, (2,), granted_at=50.0)
    passes = [reading(t, (0, 0, GIB), (1, 40, GIB), (2, 0, 0)) for t in (0, 61, 100)]
    passes.append(reading(111, (0, 0, GIB), (1, 0, GIB), (2, 0, 0)))
    assert run(rule, [both, late], passes) == [(111, 8, "warn")]


def test_nobody_waiting_means_no_warning_and_waiters_are_counted_only_for_an_idle_claim():
    """Guards against a card taken from a claim that holds nobody up, and against the
    service walking its queue on every round for nothing."""
    rule = IdleCardRule(MINUTE)
    claim = RunningClaim(7, (1,), granted_at=0.0)
    counted = []

    def waiters() -> int:
        counted.append(1)
        return 0

    for t, busy in ((0, 50), (30, 50), (61, 0), (130, 0), (200, 0)):
        rule.saw(reading(t, (1, busy, GIB)))
        assert rule.decide([claim], waiters, now=t) == []
    assert len(counted) == 2  # at 130 and 200: idle since 61 for the window


@pytest.mark.parametrize("then", ["used", "nobody waits"])
def test_a_warning_is_withdrawn_when_the_card_is_used_or_nobody_waits(then):
    """Guards against a claim ended after its owner used the card again, or after the
    claim that waited for it left, and against a warning that stays on show."""
    rule = IdleCardRule(MINUTE)
    claim = RunningClaim(7, (1,), granted_at=0.0)
    rule.saw(reading(0, (1, 0, GIB)))
    rule.saw(reading(61, (1, 0, GIB)))
    assert [d.action for d in rule.decide([claim], lambda: 1, now=61)] == ["warn"]
    rule.saw(reading(80, (1, 20 if then == "used" else 0, GIB)))
    (cleared,) = rule.decide([claim], lambda: 0 if then == "nobody waits" else 1, now=80)
    assert cleared.action == "clear"
    assert "will not be ended" in cleared.message
    # Past the old deadline, nothing: a new warning would need the window, and a waiter, again.
    rule.saw(reading(95, (1, 0, 2 * GIB)))
    assert rule.decide([claim], lambda: 0, now=95) == []


# -- on a machine, with real kernels --------------------------------------------------

#: Kernels of two users, and a machine: minutes, not seconds, on a loaded machine.
slow = pytest.mark.timeout(240)

#: 1.2 s idle, then 1.2 s warned: test-sized minutes.
IDLE = {"idle_card_minutes": 0.02, "idle_card_grace_minutes": 0.02}
#: A file that never comes: a claim told to hold until it exists holds until it is ended.
NEVER = Path("/nonexistent")


@pytest.fixture
def people():
    require_unix_users()
    with kernels_on_books() as start:
        yield ready_user(USER_A), ready_user(USER_B), start


def hold(label: str) -> str:
    """A ``gpus=1`` background claim that holds its card until it is ended."""
    return f"%%claim gpus=1 --background --label {label}\n{until_it_exists(NEVER)}"


def mine_running(kernel: Kernel) -> dict[str, dict]:
    """The kernel's user's running claims, by label: ticket, cards and warning."""
    return {c["label"]: c for c in kernel.books()["running"] if c["mine"]}


def service_reads(smi: StandInSmi) -> int:
    """How many passes of the cards the service has read through the stand-in."""
    return sum(1 for call in smi.calls() if call and call[0].startswith("--query-gpu"))


def read_again(smi: StandInSmi, passes: int) -> None:
    """Wait until the service has read the cards ``passes`` more times: some seconds of them."""
    before = service_reads(smi)
    wait_until(lambda: service_reads(smi) >= before + passes, what=f"{passes} more passes")


@contextmanager
def memory_changing(smi: StandInSmi, cards: list[dict], index: int) -> Iterator[None]:
    """Card ``index`` at 0 % use, its memory changing all along, as a loader's would."""
    done = threading.Event()

    def change() -> None:
        used = 1024
        while not done.wait(0.2):
            used += 64
            cards[index] = card(index, used_mib=used)
            smi.set_cards(cards)

    changer = threading.Thread(target=change, daemon=True)
    changer.start()
    try:
        yield
    finally:
        done.set()
        changer.join()


def service_records(layout: Layout, uid: int) -> list[dict]:
    """The service's account of ``uid``'s claims, as root keeps it."""
    return [
        json.loads(line)
        for path in layout.records.iterdir()
        if path.stat().st_uid == 0 and path.name.startswith(f"0-books-{uid}-")
        for line in path.read_text().splitlines()
    ]


@slow
def test_an_idle_card_is_warned_then_given_to_the_waiter_and_busy_ones_are_not(people, tmp_path):
    """Guards against an idle card kept from someone who waits, against a claim ended
    with no warning or no reason, against a card in use (working, or its memory
    changing) taken too, and against records that call the end a cancel."""
    alice, bob, kernels = people
    cards = [card(0), card(1), card(2)]
    smi = StandInSmi(tmp_path / "smi", cards)
    with machine(gpus=3, config=IDLE, env=smi.env()) as layout:
        a, b = kernels(alice, layout), kernels(bob, layout)
        for label in ("idle", "busy", "loading"):
            a.start_job(hold(label), label)
        held = wait_until(lambda: len(mine_running(a)) == 3 and mine_running(a), what="3 claims")
        on = {label: claim["allocation"]["gpus"][0] for label, claim in held.items()}
        cards[on["idle"]] = card(on["idle"], used_mib=1024)
        cards[on["busy"]] = card(on["busy"], utilisation=40, used_mib=2048)
        smi.set_cards(cards)
        with memory_changing(smi, cards, on["loading"]):
            # A whole pass read after the change: no claim is judged on the cards as they were.
            read_again(smi, 2)
            b.start_job(
                "%%claim gpus=1 --background --label next\n"
                "import os\ncards = os.environ['CUDA_VISIBLE_DEVICES']",
                "job",
            )
            warned = wait_until(
                lambda: [c for c in b.books()["running"] if c.get("warning")],
                what="a warning in bob's view of the machine",
            )
            (claim,) = warned
            idle = held["idle"]
            assert claim["ticket"] == idle["ticket"]
            assert claim["warning"].startswith(
                f"claim {idle['ticket']}'s card {on['idle']} has been idle (0 % use, memory "
                "unchanged) for "
            )
            assert "while another claim waits for a card" in claim["warning"]
            assert "(idle_card_minutes in machine.json): it will be ended at" in claim["warning"]
            # The owner's kernel heard it, on the claim's own ticket.
            wait_until(
                lambda: a.facts("idle._claim._ticket.warning") == claim["warning"],
                what="the warning in alice's kernel",
            )

            ended = a.run("idle.result(60)")
            assert ended.error["ename"] == "ClaimCancelled"
            assert ended.error["evalue"].startswith(
                f"idle was stopped: claim {idle['ticket']}'s card {on['idle']} had been idle"
            )
            assert "idle_card_grace_minutes" in ended.error["evalue"]
            assert a.facts("idle.status") == IDLE_CARDS

            # The waiter gets the card.
            b.run("job.result(60)", check=True)
            assert b.facts("job.result()['cards']") != ""
            # The busy one and the loading one were as idle as long, and kept.
            left = mine_running(a)
            assert sorted(left) == ["busy", "loading"]
            assert [c.get("warning") for c in left.values()] == [None, None]

        def idle_records() -> list[dict]:
            return [r for r in service_records(layout, alice.uid) if r["ending"] == IDLE_CARDS]

        (record,) = wait_until(idle_records, what="the service's record of the idle claim")
        assert (record["ticket"], record["gpus"]) == (idle["ticket"], [on["idle"]])
        report = json.loads(fluksio_nb("usage", "--dir", str(layout.records), "--json").stdout)
        (row,) = [r for r in report["rows"] if r["user"] == USER_A]
        # The kernel's own record of it says the same: root's report takes its ending.
        assert row["endings"].get(IDLE_CARDS) == 1


@slow
def test_an_idle_card_nobody_waits_behind_is_kept_and_its_warning_withdrawn(people, tmp_path):
    """Guards against a card taken from a claim that holds nobody up, and against a
    claim warned while someone waited being ended after they stopped waiting."""
    alice, bob, kernels = people
    smi = StandInSmi(tmp_path / "smi", [card(0, used_mib=1024)])
    with machine(gpus=1, config=IDLE, env=smi.env()) as layout:
        a, b = kernels(alice, layout), kernels(bob, layout)
        a.start_job(hold("idle"), "idle")
        wait_until(lambda: mine_running(a), what="alice's claim")
        # Some 8 s of readings: the window and the grace three times over.
        read_again(smi, 4)
        (claim,) = mine_running(a).values()
        assert claim.get("warning") is None

        b.start_job("%%claim gpus=1 --background --label next\nx = 1", "job")
        wait_until(lambda: mine_running(a)["idle"].get("warning"), what="a warning once bob waits")
        assert b.run("job.cancel()").status == "ok"
        wait_until(
            lambda: mine_running(a)["idle"].get("warning") is None, what="the warning withdrawn"
        )
        wait_until(
            lambda: a.facts("idle._claim._ticket.warning") is None,
            what="the warning withdrawn in alice's kernel",
        )
        read_again(smi, 3)
        assert a.facts("idle.status") == "running"


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"idle_card_minutes": 0}, "idle_card_minutes is a number of minutes above 0, not 0"),
        ({"idle_card_minutes": "soon"}, "idle_card_minutes is a number of minutes above 0"),
        (
            {"idle_card_minutes": 30, "idle_card_grace_minutes": -1},
            "idle_card_grace_minutes is a number of minutes above 0, not -1",
        ),
    ],
)
def test_a_bad_idle_card_minutes_is_refused_saying_what_to_write(config, said):
    """Guards against a mistyped limit that silently gives no card back, or every one."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root: `fluksio-nb machine init` runs as root")
    with shared_tmp_dir("fluksio-machine-") as prefix:
        layout = Layout(prefix)
        layout.config.parent.mkdir(parents=True)
        layout.config.write_text(json.dumps(config))
        ran = fluksio_nb("machine", "init", "--prefix", str(prefix), check=False)
        assert ran.returncode != 0
        assert str(layout.config) in ran.stderr
        assert said in ran.stderr
        assert not layout.socket.exists()
