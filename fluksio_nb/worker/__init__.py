"""Where a claimed cell runs: a subprocess started with the environment its share implies.

The kernel cannot give itself a share of the machine after the fact — the
knobs that matter are read when a library is imported — so a claimed cell runs
in a worker that was started with them. :mod:`~fluksio_nb.worker.client` is the
kernel's side, :mod:`~fluksio_nb.worker.main` the worker's,
:mod:`~fluksio_nb.worker.messages` what passes between them, and
:mod:`~fluksio_nb.worker.protocol` how.

Nothing is imported here: ``python -m fluksio_nb.worker`` imports this
package first, and the worker's process has no use for the kernel's side
(the books, the settings, pydantic under them), which was half of its start.
"""
