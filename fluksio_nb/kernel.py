"""The kernel's accountant: one queue over this machine's books, made once.

Every claim a kernel makes goes through the same instance, whichever thread,
cell or background job makes it; that is what serialises a notebook's
workloads. It is made on first use rather than at import, so that importing
the package (as every worker does) costs nothing. ``%load_ext`` makes it in
the background (:mod:`fluksio_nb.warm_start`), so the settings in force are
those of the moment the extension was loaded; :func:`forget_accountant`
reads them again.

Which books it keeps (:func:`books_in_force`) is decided here, once:

- **the machine's**, when an admin ran ``fluksio-nb machine init``: every
  user's kernels share them through a service run by root
  (:mod:`fluksio_nb.machine`);
- **the user's own**, otherwise: the same service, run as the user and
  shared by every kernel of theirs; the first kernel that needs it starts it
  (:mod:`fluksio_nb.machine.user_service`);
- **the kernel's alone**, with ``FLUKSIO_LEDGER=kernel``.

``FLUKSIO_LEDGER`` naming a directory wins over what the machine has.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fluksio_nb.books import ResourceAccountant
from fluksio_nb.card_devices import cards_held_here
from fluksio_nb.cpuset import cores_held_here
from fluksio_nb.enforcement import Enforcement, cores_enforcement
from fluksio_nb.inventory import Inventory, take_inventory
from fluksio_nb.memory_cap import cap_place, memory_enforcement
from fluksio_nb.queue import ClaimQueue
from fluksio_nb.settings import Settings, load_settings

if TYPE_CHECKING:
    from fluksio_nb.machine.client import ServiceQueue

_lock = threading.RLock()
_instance: ClaimQueue | ServiceQueue | None = None
_inventory: Inventory | None = None
_settings: Settings | None = None


@dataclass(frozen=True)
class Books:
    """Which books claims go to, and why: what ``fluksio-nb machine status`` says."""

    mode: Literal["machine", "user", "kernel"]
    where: Path | None
    why: str
    #: The service's socket, for the machine's books and the user's own.
    socket: Path | None = None

    @property
    def owner(self) -> int:
        """Whose the service must be: root's for the machine's, this user's for their own."""
        return 0 if self.mode == "machine" else os.geteuid()

    def describe(self) -> str:
        said = {
            "machine": f"books shared by every user of this machine, served at {self.where}",
            "user": f"books of this user's own kernels, served by a service of theirs in "
            f"{self.where}",
            "kernel": "books each kernel keeps to itself",
        }[self.mode]
        return f"{said}: {self.why}"


def books_in_force(layout: Any = None, settings: Settings | None = None) -> Books:
    """The books this process's claims use. ``layout`` is the machine's (tests name another)."""
    from fluksio_nb.machine.run_dir import DEFAULT_RUN_DIR, SOCKET_NAME, socket_in
    from fluksio_nb.machine.user_dir import default_books_dir

    settings = settings or load_settings()
    if settings.ledger == "kernel":
        return Books("kernel", None, "FLUKSIO_LEDGER (or the config's 'ledger') is 'kernel'")
    if settings.ledger:
        named = Path(settings.ledger).expanduser()
        found = socket_in(named)
        if found is not None:
            return Books("machine", named, "FLUKSIO_LEDGER names the machine's books", found)
        return Books(
            "user",
            named,
            "FLUKSIO_LEDGER (or the config's 'ledger') names it",
            named / SOCKET_NAME,
        )
    run_dir = DEFAULT_RUN_DIR if layout is None else layout.run_dir
    found = socket_in(run_dir)
    if found is not None:
        return Books(
            "machine",
            run_dir,
            "an admin set this machine up with `fluksio-nb machine init`",
            found,
        )
    where = default_books_dir()
    return Books(
        "user",
        where,
        "nobody set up books for every user here; `fluksio-nb machine init`, run as root, does",
        where / SOCKET_NAME,
    )


def enforcement_in_force(
    settings: Settings, core_ids: Sequence[int], cpus: int, gpus: int = 0
) -> dict[str, dict[str, str]]:
    """What holds claims made here to their cores, memory and (with ``gpus``) cards."""
    cores = cores_enforcement(core_ids, settings.pin_cores, cpus)
    if cores.capped:
        cores = cores_held_here()
    elif settings.pin_cores:
        place = cap_place(controller="cpu")
        if place.available:
            assert place.version is not None
            cores = Enforcement(f"a quota per claim ({place.version})", place.version, cores.why)
    held = {
        "cores": cores.as_dict(),
        "memory": memory_enforcement(settings).as_dict(),
    }
    if gpus:
        held["cards"] = cards_held_here().as_dict()
    return held


def cancel_in_books(number: int, reason: str, books: Books | None = None) -> bool:
    """Cancel claim ``number`` as this process's user may; False if there is no such claim.

    Raises ``NotYours`` (a ``PermissionError``) for a claim this user may not cancel.
    """
    books = books or books_in_force()
    if books.socket is None:
        return False
    from fluksio_nb.errors import ServiceUnavailable
    from fluksio_nb.machine.connection import cancel_claim

    try:
        return cancel_claim(books.socket, number, reason, owner=books.owner)
    except ServiceUnavailable:
        if books.mode == "machine":
            raise
        # No service of the user's runs: none of their kernels holds a claim.
        return False


def accountant() -> ClaimQueue | ServiceQueue:
    """The kernel's accountant. ``.snapshot()`` shows totals, free, waiting and running."""
    global _instance
    with _lock:
        if _instance is None:
            settings, found = _read()
            books = books_in_force(settings=settings)
            if books.mode == "kernel":
                _instance = ClaimQueue(ResourceAccountant.from_inventory(found))
            elif books.mode == "machine":
                from fluksio_nb.machine.client import ServiceQueue

                assert books.socket is not None
                _instance = ServiceQueue(books.socket, share_labels=settings.share_labels)
            else:
                from fluksio_nb.machine.client import ServiceQueue
                from fluksio_nb.machine.user_service import UserServiceAt, described

                assert books.socket is not None
                at = UserServiceAt(
                    books.socket,
                    books.owner,
                    machine=described(found, settings),
                    linger=settings.books_linger,
                )
                _instance = ServiceQueue(at)
            _instance.enforcement = enforcement_in_force(
                settings,
                _instance.books.core_ids,
                _instance.books.cpus,
                # The service's cards, where it declares some this kernel cannot see.
                max(len(found.gpus), len(_instance.books.gpu_ids)),
            )
        return _instance


def _read() -> tuple[Settings, Inventory]:
    """The settings and the inventory, read once and kept. Lock held."""
    global _inventory, _settings
    if _settings is None or _inventory is None:
        settings = load_settings()
        _settings, _inventory = settings, take_inventory(settings)
    return _settings, _inventory


def inventory() -> Inventory:
    """What the kernel's accountant is made from.

    Read without the books: a claim's task on a Ray node sizes its worker
    pool by it, and must not join the books of the machine it runs on.
    """
    with _lock:
        return _read()[1]


def settings() -> Settings:
    """The settings the kernel's accountant is made with; read without the books."""
    with _lock:
        return _read()[0]


def forget_accountant() -> None:
    """Drop the instance so the next claim reads the settings again.

    For tests, and for a user who changed ``FLUKSIO_*`` in a running kernel
    and means it. Claims still running keep the share they hold in the old
    books; nothing new is granted from those. A connection to a books
    service that holds nothing is closed: a user's own service ends once no
    kernel is connected.
    """
    global _instance, _inventory, _settings
    with _lock:
        left, _instance = _instance, None
        _inventory = _settings = None
    if left is not None and not isinstance(left, ClaimQueue) and left.holds_nothing():
        left.close()
