"""Cards used through claims only: kernels Jupyter starts open no card, where the admin says so.

A card taken by a kernel that never claimed it is a card the books hand to
somebody else, whose claim then fails or crawls. Naming such a squatter
(:mod:`fluksio_nb.gpu_usage`) comes after the harm. So an admin who writes
``"unclaimed_cards": false`` in ``machine.json`` has every kernel the
provisioner launches on those books started in a devices cgroup that denies
every card's node (:func:`fluksio_nb.card_devices.hold_away_from_cards`); a
claim's worker leaves it for its claim's own, which opens that claim's cards.

What it decides:

- **The machine's rule, read at every launch**, from the ``machine.json``
  beside the books the kernel is about to use: a kernel on a user's own
  books, or kernel-only books, is not the admin's to hold.
- **A kernel always starts.** Where no devices cgroup can be made, or the
  rule cannot be read, it starts as before, and the server's log says why;
  every view's "held by" line says how cards are held.
- **The kernel enters before it runs a line** (between fork and exec). Its
  cgroup is named after it once it runs
  (:func:`~fluksio_nb.card_devices.name_after`), and goes when the
  provisioner cleans the kernel up, or, were the server killed, once the
  kernel is gone. Whatever the kernel left running in it is ended then, as a
  claim's leftovers are.

Processes started outside Jupyter (a terminal, a cron job) are not held
here, and a card they use is still named as a squatter.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fluksio_nb.card_devices import devices_place, hold_away_from_cards
from fluksio_nb.kernel import books_in_force
from fluksio_nb.memory_cap import CapNotMade, ClaimCgroup
from fluksio_nb.settings import load_settings


class CardsNotHeld(Exception):
    """The admin keeps cards to claims, and this kernel could not be held away from them."""


def kernels_may_use_cards(environ: Mapping[str, str]) -> bool:
    """Whether the admin lets kernels on the books ``environ`` names open cards unclaimed.

    Raises :class:`~fluksio_nb.machine.setup.MachineSetupError` for a
    ``machine.json`` that does not say.
    """
    from fluksio_nb.machine.run_dir import DEFAULT_RUN_DIR
    from fluksio_nb.machine.setup import Layout, read_config

    books = books_in_force(settings=load_settings(environ))
    if books.mode != "machine" or books.where is None:
        return True
    depth = len(DEFAULT_RUN_DIR.relative_to("/").parts)
    run_dir = books.where
    if run_dir.parts[-depth:] != DEFAULT_RUN_DIR.relative_to("/").parts:
        # Books served from a directory init did not lay out: no machine.json of theirs.
        return True
    return read_config(Layout(Path(*run_dir.parts[:-depth]))).unclaimed_cards


def hold_kernel_away(
    environ: Mapping[str, str], share: ClaimCgroup | None = None
) -> ClaimCgroup | None:
    """The cgroup a kernel about to start enters, where the admin keeps cards to claims.

    ``None`` where kernels may use cards; :class:`CardsNotHeld`, saying why,
    where they may not and no cgroup can hold them. On cgroup v2 the kernel's
    ``kernel_ram`` cgroup (``share``) is the one held, and returned.
    """
    if kernels_may_use_cards(environ):
        return None
    place = devices_place()
    if not place.available:
        raise CardsNotHeld(place.why_not)
    try:
        return hold_away_from_cards(place, share)
    except CapNotMade as error:
        raise CardsNotHeld(str(error)) from None
