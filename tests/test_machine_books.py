"""The machine's books between people: fair turns, caps, and what each reader sees.

These are the rules the books service applies in its one thread, checked as
plain data: the same order and the same grants whatever socket a claim
came from. The service around them is tested with real users in
``test_machine_service.py``.
"""

from fluksio_nb.machine.books import Entry, MachineBooks
from fluksio_nb.machine.caps import Cap

ALICE, BOB = 1001, 1002


def books(cpus=4, gpus=1, ram=0) -> MachineBooks:
    return MachineBooks(cpus, range(gpus), ram)


def ask(books: MachineBooks, uid: int, cpus=1, gpus=0, ram=0, label="") -> Entry:
    entry = Entry(
        number=books.next_number(),
        uid=uid,
        user={ALICE: "alice", BOB: "bob"}[uid],
        pid=uid,
        need=(cpus, gpus, ram),
        label=label or f"{uid}",
    )
    books.add(entry)
    books.dispatch()
    return entry


def end(books: MachineBooks, entry: Entry) -> list[Entry]:
    books.remove(entry.number)
    return books.dispatch()


def test_one_users_long_queue_does_not_starve_anothers_single_claim():
    """Guards against FIFO between claims letting 20 queued jobs of one user go
    before another user's one claim that arrived after them."""
    machine = books(cpus=4)
    alices = [ask(machine, ALICE, cpus=4) for _ in range(20)]
    bobs = ask(machine, BOB, cpus=1)
    assert alices[0].state == "running" and bobs.state == "waiting"
    granted = end(machine, alices[0])
    assert granted == [bobs]


def test_turns_alternate_between_users_who_both_wait():
    """Guards against one user's backlog running back to back while the other waits."""
    machine = books(cpus=1)
    first = ask(machine, ALICE)
    for _ in range(3):
        ask(machine, ALICE)
    for _ in range(3):
        ask(machine, BOB)
    order = []
    running = first
    for _ in range(6):
        (running,) = end(machine, running)
        order.append(running.uid)
    assert order == [BOB, ALICE, BOB, ALICE, BOB, ALICE]


def test_a_card_is_never_granted_twice():
    """Guards against two users both being granted card 0: the deadlock this exists for."""
    machine = books(cpus=8, gpus=2)
    holders = [ask(machine, uid, gpus=1) for uid in (ALICE, BOB, ALICE, BOB)]
    running = [e for e in holders if e.state == "running"]
    assert sorted(g for e in running for g in e.gpus) == [0, 1]
    end(machine, running[0])
    running = [e for e in holders if e.state == "running" and e.number in machine.entries]
    cards = [g for e in running for g in e.gpus]
    assert len(cards) == len(set(cards)) == 2


def test_a_users_cap_holds_only_that_user_back():
    """Guards against a capped user's waiting claim setting aside cores nobody may then use."""
    machine = books(cpus=4)
    machine.caps[ALICE] = Cap(cpus=2)
    held = ask(machine, ALICE, cpus=2)
    over_her_cap = ask(machine, ALICE, cpus=1)
    bobs = ask(machine, BOB, cpus=2)
    assert held.state == "running"
    assert over_her_cap.state == "waiting"
    assert bobs.state == "running"
    assert end(machine, held) == [over_her_cap]


def test_the_head_of_the_queue_keeps_what_it_waits_for():
    """Guards against a stream of small claims starving a large one, across users."""
    machine = books(cpus=4)
    small = ask(machine, ALICE, cpus=2)
    large = ask(machine, BOB, cpus=4)
    later_small = ask(machine, ALICE, cpus=2)
    assert small.state == "running"
    assert large.state == "waiting" and later_small.state == "waiting"
    assert end(machine, small) == [large]


def test_another_users_label_and_notebook_are_hidden_unless_shared():
    """Guards against the monitor telling every user what another user's notebook is called."""
    machine = books()
    secret = ask(machine, ALICE, label="thesis-final")
    secret.notebook, secret.kernel_id = "private/thesis.ipynb", "k1"
    shared = ask(machine, BOB, label="open-demo")
    shared.share_labels = True
    seen_by_bob = {c["ticket"]: c for c in machine.snapshot(BOB)["running"]}
    assert seen_by_bob[secret.number]["label"] is None
    assert seen_by_bob[secret.number]["notebook"] is None
    assert seen_by_bob[secret.number]["user"] == "alice"
    assert seen_by_bob[secret.number]["mine"] is False
    assert seen_by_bob[shared.number]["label"] == "open-demo"
    seen_by_alice = {c["ticket"]: c for c in machine.snapshot(ALICE)["running"]}
    assert seen_by_alice[secret.number]["label"] == "thesis-final"
    assert seen_by_alice[secret.number]["notebook"] == "private/thesis.ipynb"
    assert seen_by_alice[secret.number]["mine"] is True


def test_a_snapshot_lists_the_readers_own_waiting_claims_and_the_head_of_everyone_elses():
    """Guards against one user's thousands of waiting claims making every reader's
    snapshot longer than the protocol's longest line, which broke the reader's
    connection, and with it the claims it held."""
    from fluksio_nb.machine.books import OTHERS_WAITING_LISTED

    machine = books(cpus=1, gpus=1)
    ask(machine, ALICE, gpus=1)
    for _ in range(OTHERS_WAITING_LISTED + 50):
        ask(machine, BOB, gpus=1)
    alices = [ask(machine, ALICE, gpus=1) for _ in range(OTHERS_WAITING_LISTED)]
    place = {e.number: n for n, e in enumerate(machine.fair_order(), start=1)}

    seen = machine.snapshot(ALICE)
    listed = {c["ticket"]: c["position"] for c in seen["waiting"]}
    head = {ticket for ticket, n in place.items() if n <= OTHERS_WAITING_LISTED}
    assert set(listed) == head | {e.number for e in alices}
    assert max(place[e.number] for e in alices) > OTHERS_WAITING_LISTED, "none past the head"
    # Places are the queue's, not the list's.
    assert all(listed[ticket] == place[ticket] for ticket in listed)
    assert seen["waiting_unlisted"] == len(place) - len(listed) > 0


def test_another_users_shared_words_are_cut_short_and_my_own_are_whole():
    """Guards against another user's 512-character labels and 4096-character notebook
    paths, shared with everyone, being what makes a snapshot too long to read."""
    from fluksio_nb.machine.books import OTHERS_LABEL_CHARS, OTHERS_NOTEBOOK_CHARS

    machine = books()
    theirs = ask(machine, BOB, label="b" * 512)
    theirs.share_labels = True
    theirs.notebook, theirs.kernel_id = "n" * 4096, "k" * 256
    mine = ask(machine, ALICE, label="a" * 512)
    mine.notebook = "m" * 4096

    seen = {c["ticket"]: c for c in machine.snapshot(ALICE)["running"]}
    bobs = seen[theirs.number]
    assert len(bobs["label"]) == len(bobs["kernel_id"]) == OTHERS_LABEL_CHARS
    assert len(bobs["notebook"]) == OTHERS_NOTEBOOK_CHARS
    assert bobs["label"].startswith("b" * 100) and bobs["label"].endswith("…")
    assert (seen[mine.number]["label"], seen[mine.number]["notebook"]) == ("a" * 512, "m" * 4096)


def test_slices_go_around_a_waiting_whole_card_claim_only_so_many_times():
    """Guards against the machine's books placing cards by another rule than the kernel's:
    a whole-card claim that keeps the room beside a slice empty for itself, or that
    slices of other users overtake without end."""
    from fluksio_nb.card_slices import PASSES, Slice

    machine = MachineBooks(16, range(1), 0, card_bytes={0: 80 * 10**9})

    def sliced(uid: int, nbytes: int) -> Entry:
        entry = Entry(
            number=machine.next_number(),
            uid=uid,
            user={ALICE: "alice", BOB: "bob"}[uid],
            pid=uid,
            need=(1, 0, 0),
            label="",
            piece=Slice(nbytes=nbytes),
        )
        machine.add(entry)
        machine.dispatch()
        return entry

    half = sliced(ALICE, 40 * 10**9)
    whole = ask(machine, BOB, gpus=1)
    assert half.state == "running" and whole.state == "waiting"
    slivers = [sliced(ALICE, 4 * 10**9) for _ in range(PASSES + 1)]
    assert [s.state for s in slivers] == ["running"] * PASSES + ["waiting"]
    for held in [half, *slivers[:PASSES]]:
        assert whole.state == "waiting"
        end(machine, held)
    assert whole.state == "running" and whole.gpus == (0,) and whole.gpu_bytes == 0
    assert end(machine, whole) == [slivers[-1]]
