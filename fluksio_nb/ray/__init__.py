"""Claims that run on a Ray cluster: ``%%claim cpus=2 gpus=1 ram=8G --on ray``.

When one workstation is not enough, the same claim should go to a cluster
without a new vocabulary and without a scheduler of our own. Ray's resource
model (``num_cpus``, ``num_gpus``, ``memory``) is the shape of a claim, and Ray
already queues tasks, places them on nodes and hands out cards. So a claim
``--on ray`` is one Ray task with the matching resources, and Ray's queue is
the queue: nothing here waits in the kernel's own books. A ``with
claim(..., on="ray")`` block holds its share for the block, as a local one
does, in a Ray placement group of one bundle.

The modules, in the order a claimed cell passes through them:

- :mod:`.connection`: reaching the cluster, and the one connection a kernel
  process keeps to it; whether the cluster is the kernel's own machine.
- :mod:`.task`: the task's shape: its resources, its ``runtime_env``, and
  whether any node can hold it.
- :mod:`.values`: the cell's variables on their way through the object store.
- :mod:`.mailbox`: the cell's output on its way from the task to the kernel.
- :mod:`.task_side`: what runs inside the Ray task: the cell, in a worker.
- :mod:`.claim`: the kernel's side of one claim, :class:`~.claim.RayClaim`, a
  :class:`~fluksio_nb.lifecycle.ClaimLifecycle` like a local claim: sending
  the task, following it, stopping it.
- :mod:`.monitor`: the cluster and this kernel's claims on it, for ``%claims``.

Ray is an optional extra, and a kernel imports :mod:`fluksio_nb` without it:
nothing here imports Ray until a claim asks for it, and this package itself
imports nothing at all. Import from the modules.
"""
