"""fluksio_nb: claim a share of a shared machine from a notebook cell.

``%load_ext fluksio_nb`` registers ``%%claim`` and ``%claims``. A claimed cell
waits its turn for its cores, cards and memory, then runs in a worker process
whose environment was derived from its share. See ``README.md``.
"""

from fluksio_nb.accountant import accountant
from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.env import THREAD_VARS, derive_env, fair_share_env
from fluksio_nb.queue import ClaimCancelled, ClaimTimeout, ClaimTooLarge, ClampedWarning
from fluksio_nb.resources import BadClaim, Resources

__version__ = "0.1.0"

__all__ = [
    "THREAD_VARS",
    "Allocation",
    "BadClaim",
    "ClaimCancelled",
    "ClaimTimeout",
    "ClaimTooLarge",
    "ClampedWarning",
    "ResourceAccountant",
    "Resources",
    "accountant",
    "derive_env",
    "fair_share_env",
]
