"""Slices of a card, placed by the one module that decides (``fluksio_nb.card_slices``).

Property tests over random streams of whole-card claims and slices walked in
order, as both sets of books walk them: the rules that keep a shared card
safe hold after every grant and give-back, and every claim is granted in the end.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from fluksio_nb.card_slices import CardAsk, Cards, Slice, card_words

GB = 10**9
SIZES = {0: 80 * GB, 1: 80 * GB, 2: 40 * GB}

asks = st.one_of(
    st.integers(min_value=1, max_value=3).map(lambda n: CardAsk(whole=n)),
    st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9]).map(lambda f: CardAsk(piece=Slice(fraction=f))),
    st.integers(min_value=1, max_value=40).map(lambda g: CardAsk(piece=Slice(nbytes=g * GB))),
)


def walk(cards_held, waiting):
    """One pass of the books over the waiting claims, in order: grant or set aside."""
    cards = Cards(SIZES, [placed for placed, _ in cards_held])
    granted = []
    for ask in waiting:
        placed = cards.place(ask)
        if placed is None:
            cards.set_aside(ask)
        else:
            cards.take(*placed)
            granted.append((ask, placed))
    return granted


def check(running):
    """The rules of a shared card over what is held now."""
    whole, sliced, count = set(), dict.fromkeys(SIZES, 0), dict.fromkeys(SIZES, 0)
    for (cards, nbytes), _ in running:
        for card in cards:
            count[card] += 1
            if nbytes:
                sliced[card] += nbytes
            else:
                assert card not in whole, f"card {card} granted whole twice"
                whole.add(card)
    for card in SIZES:
        assert sliced[card] <= SIZES[card], f"card {card}: more than its memory granted"
        assert not (card in whole and count[card] > 1), f"card {card}: a slice beside a whole claim"


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(asks, min_size=1, max_size=40),
    ends=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=200),
)
def test_slices_never_overfill_a_card_or_share_one_held_whole_and_all_are_granted(arrivals, ends):
    """Guards against a card granted past its memory, a slice beside a whole-card claim, and a
    claim (a whole card behind a stream of slices, above all) that is never granted."""
    cards = Cards(SIZES)
    waiting = [a for a in arrivals if cards.fits_ever(a)]
    running = []  # ((cards, nbytes), ask)
    ends_iter = iter(ends)
    for _ in range(10 * len(waiting) + 10):
        for ask, placed in walk(running, waiting):
            waiting.remove(ask)
            running.append((placed, ask))
        check(running)
        if not running:
            break
        # An end chosen by the test, else the oldest: every claim ends some time.
        pick = next(ends_iter, 0) % len(running)
        running.pop(pick)
    assert not waiting, f"never granted: {waiting}"


def test_a_whole_card_claim_is_not_starved_by_a_stream_of_slices():
    """Guards against slices landing, one after another, on the card a whole-card claim
    waits for, so that it never comes idle."""
    sizes = {0: 80 * GB}
    half = CardAsk(piece=Slice(fraction=0.5))
    held = [((0,), 40 * GB)]
    cards = Cards(sizes, held)
    whole = CardAsk(whole=1)
    assert cards.place(whole) is None
    cards.set_aside(whole)
    assert cards.place(half) is None, "a slice took the card a whole-card claim waits for"


def test_two_halves_share_a_card_and_a_third_waits():
    """Guards against a card shared by more slices than its memory holds."""
    cards = Cards({0: 80 * GB})
    half = CardAsk(piece=Slice(fraction=0.5))
    first, second = cards.place(half), None
    cards.take(*first)
    second = cards.place(half)
    cards.take(*second)
    assert first == second == ((0,), 40 * GB)
    assert cards.place(half) is None
    assert card_words(cards.rows()[0]) == "card 0: 2 claims, 80/80 GB"


def test_slices_go_best_fit():
    """Guards against a slice spread onto an idle card while a shared one has room."""
    cards = Cards({0: 80 * GB, 1: 80 * GB}, [((1,), 60 * GB)])
    assert cards.place(CardAsk(piece=Slice(nbytes=20 * GB))) == ((1,), 20 * GB)
    assert cards.place(CardAsk(piece=Slice(nbytes=30 * GB))) == ((0,), 30 * GB)


def test_a_card_a_squatter_fills_is_not_granted():
    """Guards against granting a slice of memory a process outside every claim holds."""
    cards = Cards({0: 80 * GB, 1: 80 * GB}, unclaimed={0: 70 * GB, 1: 50 * GB})
    assert cards.place(CardAsk(piece=Slice(nbytes=20 * GB))) == ((1,), 20 * GB)
    assert cards.place(CardAsk(piece=Slice(nbytes=40 * GB))) is None
    assert cards.place(CardAsk(whole=1)) is None


def test_the_kernels_own_books_share_a_card_by_slices_and_starve_no_whole_card_claim():
    """Guards against the kernel's own books (FLUKSIO_LEDGER=kernel) handing out cards only
    whole, and against a slice overtaking a whole-card claim that waits for its card."""
    from fluksio_nb.books import ResourceAccountant
    from fluksio_nb.queue import ClaimQueue
    from fluksio_nb.resources import Resources

    queue = ClaimQueue(ResourceAccountant(cpus=8, gpus=1, card_bytes={0: 80 * GB}))
    first, second, third = (queue.enqueue(Resources(gpus=0.5)) for _ in range(3))
    assert [t.state for t in (first, second, third)] == ["running", "running", "waiting"]
    assert first.allocation.gpus == second.allocation.gpus == (0,)
    assert first.allocation.gpu_bytes == 40 * GB
    assert card_words(queue.books.snapshot()["gpus"]["cards"][0]) == "card 0: 2 claims, 80/80 GB"
    whole = queue.enqueue(Resources(gpus=1))
    queue.release(first)
    assert third.state == "running" and whole.state == "waiting"
    sliver = queue.enqueue(Resources(gpu_ram="10G"))
    queue.release(second)
    # Room for the sliver beside the third, but the whole card is ahead of it.
    assert sliver.state == "waiting"
    queue.release(third)
    assert whole.state == "running" and whole.allocation.gpu_bytes == 0
    queue.release(whole)
    assert sliver.state == "running"
