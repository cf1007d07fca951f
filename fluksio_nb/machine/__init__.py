"""Books every user of a machine shares, and the trust model that keeps them honest.

A lab's GPU workstation or a JupyterHub node is shared by people, and each
person's kernels keeping books of their own is how two of them are both
granted card 0. Once an admin runs ``fluksio-nb machine init``, every kernel
of every user takes its claims from one service (:mod:`.service`), run by
root, over a Unix socket (:mod:`.protocol`, :mod:`.connection`, :mod:`.client`).

Why a service, and not files every user writes: a daemonless design needs
an order of claims nobody can forge and a grant nobody can stall. Files
each user owns in a sticky directory give integrity, but an order between
users would have to come from a shared counter (a lock another user can
hold, or a file they can write) or from file timestamps, and deciding grants
from timestamps is correct only if no process is stopped between writing
and reading, which is exactly what an attacker's ``SIGSTOP`` breaks. A
dead user's files also cannot be removed by anyone else, so every reader
would have to judge every entry's liveness on every look. One process that
holds the books in memory, learns who is asking from the kernel
(``SO_PEERCRED``) and frees a claim when its connection closes needs no
timing assumption at all.

The trust model:

1. **Identity comes from the OS**: the uid and pid ``SO_PEERCRED`` gives the
   service, and a kernel's own ``geteuid``; never ``$USER``.
2. **Integrity**: a claim exists in the service's memory only, tied to the
   connection that made it. Only its owner, or a member of the admin group
   the root-owned config names, may cancel it; only its owner's connection
   releases it. Nobody writes a file another user reads as books, so there
   is no file to plant a symlink at; the run directory and config are root's.
   A kernel killed with its claims held has them recorded by the service,
   in a file of root's: the only file whose records may say whose they are.
3. **Availability**: there is no lock. The service never waits for a
   client, drops one that stops reading, and bounds each user's
   connections and waiting claims. A kernel waits on its own socket, so
   ``--timeout`` and the stop button work whatever others do.
4. **Validation**: every line the service reads is parsed by pydantic or
   ends that connection; the books never grant more than the inventory.
5. **Confidentiality**: everyone sees who holds what, since when. Labels,
   notebook paths and kernel ids only their owner sees, unless their config
   says ``share_labels``. Usage records and shared-memory transfers are
   readable by their owner only.

Fairness is between people first (:mod:`.books`), and an admin can cap (:mod:`.caps`) what
any user holds at once. Where nobody ran ``machine init``, each user keeps
books of their own (:mod:`fluksio_nb.ledger`), which no other user can write.
"""
