"""The words every view of a claim says a time, a clock reading or an ending in.

One finished claim is shown in many places: its cell's record, the
``%claims`` monitor, ``fluksio-nb`` in a terminal, JupyterLab's panel and its
notices. Each used to say it its own way: "ran 8.7 s" in the cell and "9.2 s"
in the panel, "03:19:17" here and "3:19:17 AM" there, "no share", "never
started" and "never got its share" for one claim that never ran. A person
then reads two things for one fact. So the Python side's words are decided
here, once, and ``labextension/src/format.ts`` (and the widget's ``widget.js``)
say them the same way from the same fields.

What it decides:

- **A span** reads to a tenth of a second under ten seconds, to the second
  under a minute, then in minutes and hours: ``0.4 s``, ``12 s``,
  ``2 min 5 s``, ``1 h 3 min`` (:func:`seconds`).
- **A clock** reads on the 24-hour clock, to the second: ``15:19:17``
  (:func:`clock`), in every view, whatever the browser's locale.
- **The times of a claim** are figured once, by the kernel that ran it, from
  its own status, and written in its usage record (``waited_for_s``,
  ``ran_for_s``): every view says those figures, never its own difference of
  timestamps (:func:`times_words`).
- **A claim that never got its share** is said so, in those words, everywhere
  (:data:`NEVER_RAN`).
- **How a claim failed** travels with it as one line (:func:`error_line`), at
  most :data:`ERROR_LINE_MOST` characters: the line a cell's error ends with
  (``ValueError: the model diverged``). It is written only in its user's own
  records, which only they read, so it reaches nobody else.
- **One mark per ending** (:data:`MARKS`): good, bad or stopped, each one
  colour wherever an ending is shown. The sentence a notice says
  (``‘long-fail’ failed after running 31 s: ValueError: the model
  diverged.``) is format.ts's, from the fields the server sends.
"""

from __future__ import annotations

import math
import time
from typing import Any

#: What is said of a claim that ended before it got its share, in every view.
NEVER_RAN = "never got its share"

#: What :func:`clock` says of a time no clock can show.
UNKNOWN_CLOCK = "--:--:--"

#: The longest error line a finished claim carries; longer ones are cut with "…".
ERROR_LINE_MOST = 200

#: The one mark, and so the one colour, each ending gets in every view: ``good``
#: (green), ``bad`` (red: it failed) or ``stopped`` (amber: a person or a rule
#: stopped it). Never colour alone: the ending's word is always beside it.
MARKS = {
    "ok": "good",
    "error": "bad",
    "died": "bad",
    "kernel died": "bad",
    "timed out": "bad",
    "halted": "bad",
    "interrupted": "stopped",
    "cancelled": "stopped",
    "time limit": "stopped",
    "idle cards": "stopped",
}


def mark_of(ending: str | None) -> str:
    """The mark of ``ending`` (:data:`MARKS`); an ending this version does not know is ``bad``."""
    return MARKS.get(ending or "", "bad")


def seconds(span: float) -> str:
    """A measured span: ``0.4 s``, ``12 s``, ``2 min 5 s``, ``1 h 3 min``."""
    if not math.isfinite(span):
        return "-"
    span = max(0.0, span)
    # Half up, as format.ts and widget.js round: every view says the same tenth.
    tenths = math.floor(span * 10 + 0.5) / 10
    if tenths < 10:
        return f"{tenths:.1f} s"
    whole = math.floor(span + 0.5)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def clock(at: Any) -> str:
    """``15:19:17``, or ``--:--:--`` for a time no clock can show (a forged record's)."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(at))
    except (OverflowError, ValueError, OSError, TypeError):
        return UNKNOWN_CLOCK


def times_words(waited_s: float, ran_s: float | None) -> list[str]:
    """``["waited 0.1 s", "ran 8.7 s"]``; ``ran_s`` ``None`` for a claim that never ran."""
    return [f"waited {seconds(waited_s)}", NEVER_RAN if ran_s is None else f"ran {seconds(ran_s)}"]


def error_line(message: str | None) -> str | None:
    """The line that says why a claim failed, cut to :data:`ERROR_LINE_MOST`; ``None`` if none.

    A cell's error is ``ename: evalue``, and its value can run to pages: the
    first line that says anything is what a list or a notice has room for.
    """
    if not message:
        return None
    line = next((part.strip() for part in str(message).splitlines() if part.strip()), "")
    if not line:
        return None
    return line if len(line) <= ERROR_LINE_MOST else line[: ERROR_LINE_MOST - 1] + "…"
