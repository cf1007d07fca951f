"""One user's books, shared by every kernel of theirs on this machine.

A queue inside one kernel stops one notebook from oversubscribing the
machine. The real damage comes from several notebooks of one user on a
workstation or JupyterHub node, each sure it owns the machine: two kernels
that each grant "GPU 0" to a cell of their own are the deadlock this project
exists to prevent. So by default every kernel of a user keeps its books in
one file, and every grant is a transaction on that file. Books shared by
several Unix users are not kept here: a file that two users can write is a
file either of them can forge, so those are kept by a service of their own
(:mod:`fluksio_nb.machine`).

The modules, from the bottom up; each imports only those before it:

- :mod:`.directory`: where the books live, and what is trusted there: only
  a directory its owner alone can write, and only files reached through it
  that are this user's alone (:class:`~.directory.UnsafeLedgerDir` otherwise,
  never a quiet repair).
- :mod:`.owner`: who a claim belongs to, as the OS says and not ``$USER``,
  and whether its kernel still lives: the dead give their share back.
- :mod:`.document`: what the JSON document may say, and which entries can be
  believed; the rest is left out with a :class:`~.document.LedgerBroken`
  warning, and the books never show less than nothing free.
- :mod:`.file`: the document and its lock, :class:`~.file.LedgerFile`: a
  transaction is a rewrite under an exclusive ``flock``, a read takes it
  shared, and a broken file is copied aside and rebuilt, never fatal.
- :mod:`.wake`: waking a claim that waits in another kernel the moment its
  share is free, rather than leaving it to notice on its next look.
- :mod:`.rules`: the queue's rules applied to the document: what is free is
  worked out afresh on every transaction, grants go FIFO by ticket
  machine-wide, and any kernel of the user may cancel any of their claims.
- :mod:`.snapshot`: the books as the server and the command line show them.
- :mod:`.queue`: the kernel's accountant over all of it,
  :class:`~.queue.MachineQueue`, which answers what the kernel's own queue
  answers.

What is imported from here is what the rest of fluksio_nb and its tests have
always imported from ``fluksio_nb.ledger``. A setting read at run time is
changed in the module that reads it: :data:`~.queue.LOOK_EVERY_S` is
``fluksio_nb.ledger.queue``'s, and setting it here would change nothing.
"""

from fluksio_nb.ledger.directory import UnsafeLedgerDir, default_ledger_dir
from fluksio_nb.ledger.document import LedgerBroken, LedgerEntry
from fluksio_nb.ledger.file import LEDGER_FILE, LOCK_FILE, LedgerFile
from fluksio_nb.ledger.owner import identity, process_started
from fluksio_nb.ledger.queue import LOOK_EVERY_S, MachineQueue
from fluksio_nb.ledger.rules import cancel_claim
from fluksio_nb.ledger.snapshot import machine_as_found, machine_snapshot, read_snapshot

__all__ = [
    "LEDGER_FILE",
    "LOCK_FILE",
    "LOOK_EVERY_S",
    "LedgerBroken",
    "LedgerEntry",
    "LedgerFile",
    "MachineQueue",
    "UnsafeLedgerDir",
    "cancel_claim",
    "default_ledger_dir",
    "identity",
    "machine_as_found",
    "machine_snapshot",
    "process_started",
    "read_snapshot",
]
