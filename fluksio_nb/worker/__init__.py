"""Where a claimed cell runs: a subprocess started with the environment its share implies.

The kernel cannot give itself a share of the machine after the fact — the
knobs that matter are read when a library is imported — so a claimed cell runs
in a worker that was started with them. :mod:`~fluksio_nb.worker.client` is the
kernel's side, :mod:`~fluksio_nb.worker.main` the worker's,
:mod:`~fluksio_nb.worker.messages` what passes between them, and
:mod:`~fluksio_nb.worker.protocol` how.
"""

from fluksio_nb.errors import UnsendableInput
from fluksio_nb.worker.client import Worker
from fluksio_nb.worker.messages import Sink
from fluksio_nb.worker.outcome import CellError, Outcome
from fluksio_nb.worker.protocol import ChannelClosed

__all__ = ["CellError", "ChannelClosed", "Outcome", "Sink", "UnsendableInput", "Worker"]
