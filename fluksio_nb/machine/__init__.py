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
   The service writes down every claim it saw end (who, what it granted,
   when), in files of root's, one per user and rotated by size and age
   (:mod:`.accounts`): the only files whose records may say whose they
   are, and what root's usage report counts claims from. A user's own
   records add a label and peaks, never claims or core-hours.
   Across a restart, the service keeps in root's private state (0600,
   written whole, never through a link, validated when read back) whose
   each running claim is and what it holds, with the digest of a secret
   only its owner's kernel was given with the grant; a share is put back
   only by the kernel that shows that secret, as the same uid, for exactly
   that share and under its number (:mod:`.state`). Ticket numbers are
   never given out twice, across restarts and reboots, so a number read
   before a restart names the same claim, or none, after it.
3. **Availability**: there is no lock. The service never waits for a
   client, and drops one that stops reading. Its time is shared between
   people (:mod:`.turns`): it answers in turns, a few lines of one user's
   connection at a time, so nobody's pipelined flood of requests holds
   up anyone else's claim, and no request costs time in proportion to
   what one user queued (a snapshot is made once per change of the books,
   and lists a bounded part of the queue). Memory is bounded too: each
   user's connections (and all connections, below the service's
   descriptor limit), their waiting claims, and the lines they have not
   finished; what a connection held goes with it. What it refuses, it
   says to the client in a line, and in its log in one line every few
   seconds, never line by line. A kernel waits on its own socket, so
   ``--timeout`` and the stop button work whatever others do. A cancel
   does not wait on the owner's kernel: a running claim still held two
   seconds after it was cancelled is freed by the service, which kills
   the processes its kernel reported for it, each checked to be the
   owner's and below the owner's connected process, and never the kernel
   itself (:mod:`.revoke`).
4. **Validation**: every line the service reads is parsed by pydantic or
   ends that connection, and every figure a kernel reports is finite, in
   range and of its type (:class:`.protocol.Readings`), since every other
   user's views read it; the books never grant more than the inventory.
   Every view escapes the words other users chose (labels, notebook names,
   user names, endings) so none can print a line of its own, and shows no
   figure it cannot print; the server answers strict JSON.
5. **Confidentiality**: everyone sees who holds what, since when. Labels,
   notebook paths and kernel ids only their owner sees, unless their config
   says ``share_labels``. Nor does anyone else see the pid of a user's
   kernel: ``/proc/<pid>/cmdline`` names its kernel id, which any user may
   read. Only an admin, who may cancel the claim anyway, and root see it;
   others' card memory is then told from squatters by its user. Usage
   records and shared-memory transfers are readable by their owner only.
6. **Setup**: ``init`` and ``remove`` follow no link and trust no directory
   another user owns or may write in, from ``/`` down (:mod:`.setup`);
   ``remove`` removes only what ``init`` wrote down it made, and stops only
   the service it started.

Fairness is between people first (:mod:`.books`), and an admin can cap (:mod:`.caps`) what
any user holds at once, and for how long one claim runs (:mod:`.time_limits`).
Where nobody ran ``machine init``, each user's kernels share books of their
own, kept by the same service run as the user in a directory of theirs alone
(:mod:`.user_service`, :mod:`.user_dir`): no other user can reach it, and the
books have one set of rules, whoever's.
"""
