"""A usage record: the one line a claim leaves behind when it ends.

The writer and the reader of the records may be different versions of
fluksio_nb, run by different users, and a record outlives the kernel that
wrote it. So a record says only what happened, in plain figures: what was
granted (not what was asked), and the wall-clock times of asking, being
granted and ending. How long a claim waited or ran, and its core- and
card-hours, are worked out from those when the record is read, never
stored, so they cannot disagree with them.

What it decides:

- **One JSON object per line, in a file named ``*.jsonl``.** A line cut
  short by a crash spoils only itself.
- **Fields a record does not know are ignored**, so records written by a
  later version still count.
- **No duration is below zero**, though the wall clock may be stepped back
  between two readings.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, NonNegativeInt

#: How a records file's name ends: one record per line, each a JSON object.
SUFFIX = ".jsonl"


class UsageRecord(BaseModel):
    """One claim, as it ended: what it held, and when it asked, got and gave back its share."""

    model_config = ConfigDict(extra="ignore")

    label: str
    notebook: str | None = None
    #: The claim's number in the books it queued in; ``None`` in records written
    #: before it was kept. Numbers restart with new books: an id, not a key.
    ticket: NonNegativeInt | None = None
    #: Granted, not asked: 0 for a claim that never got its share.
    cpus: NonNegativeInt = 0
    #: The card ids granted.
    gpus: list[NonNegativeInt] = Field(default_factory=list)
    ram_bytes: NonNegativeInt = 0
    #: ``time.time()`` when the claim joined the queue.
    asked_at: FiniteFloat
    granted_at: FiniteFloat | None = None
    ended_at: FiniteFloat
    ending: str
    peak_rss_bytes: NonNegativeInt = 0
    #: The most card memory its processes held, on all its cards; ``None`` where
    #: the cards were not read (or it had none), which is not zero.
    peak_gpu_bytes: NonNegativeInt | None = None

    # Never below zero: the wall clock may be stepped back between two readings.
    @property
    def waited_s(self) -> float:
        """From joining the queue to the share, or to the end for a claim never granted."""
        until = self.granted_at if self.granted_at is not None else self.ended_at
        return max(0.0, until - self.asked_at)

    @property
    def ran_s(self) -> float:
        """How long the share was held."""
        if self.granted_at is None:
            return 0.0
        return max(0.0, self.ended_at - self.granted_at)

    @property
    def core_hours(self) -> float:
        return self.cpus * self.ran_s / 3600

    @property
    def card_hours(self) -> float:
        return len(self.gpus) * self.ran_s / 3600
