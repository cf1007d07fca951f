"""The kernel's accountant: one queue over this machine's books, made once.

Every claim a kernel makes goes through the same instance, whichever thread,
cell or background job makes it; that is what serialises a notebook's
workloads. By default its books are the machine's ledger, shared with every
other kernel of the user (:mod:`fluksio_nb.ledger`); ``FLUKSIO_LEDGER=kernel``
keeps them in this kernel alone. It is made on first use rather than at import, so that loading
the extension costs nothing and the settings in force are those of the moment
the first claim is made.
"""

from __future__ import annotations

import threading

from fluksio_nb.books import ResourceAccountant
from fluksio_nb.inventory import Inventory, take_inventory
from fluksio_nb.ledger import MachineQueue, ledger_location
from fluksio_nb.queue import ClaimQueue
from fluksio_nb.settings import Settings, load_settings

_lock = threading.Lock()
_instance: ClaimQueue | MachineQueue | None = None
_inventory: Inventory | None = None
_settings: Settings | None = None


def accountant() -> ClaimQueue | MachineQueue:
    """The kernel's accountant. ``.snapshot()`` shows totals, free, waiting and running."""
    global _instance, _inventory, _settings
    with _lock:
        if _instance is None:
            _settings = load_settings()
            _inventory = take_inventory(_settings)
            where = ledger_location(_settings.ledger)
            if where is None:
                books = ResourceAccountant(
                    cpus=_inventory.cpus,
                    gpus=_inventory.gpu_ids,
                    ram_bytes=_inventory.ram_bytes,
                )
                _instance = ClaimQueue(books)
            else:
                directory, shared = where
                _instance = MachineQueue(directory, _inventory, shared=shared)
        return _instance


def inventory() -> Inventory:
    """What the kernel's accountant was made from."""
    accountant()
    assert _inventory is not None
    return _inventory


def settings() -> Settings:
    """The settings the kernel's accountant was made with."""
    accountant()
    assert _settings is not None
    return _settings


def forget_accountant() -> None:
    """Drop the instance so the next claim reads the settings again.

    For tests, and for a user who changed ``FLUKSIO_*`` in a running kernel
    and means it. Claims still running keep the share they hold in the old
    books; nothing new is granted from those.
    """
    global _instance, _inventory, _settings
    with _lock:
        _instance = _inventory = _settings = None
