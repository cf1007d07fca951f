"""Text and numbers other users wrote, made safe to put in front of a reader.

Every view shows words another user chose (a shared label, a notebook
path, the names and endings in their usage records) and figures their
kernels reported. A terminal obeys escape codes, and a newline in a label
starts a line that can look like one of the reader's own claims; a figure
of ``1e300`` or ``NaN`` makes ``time.localtime`` raise, and is not JSON. So
what reaches a reader from anyone else goes through here first:

- **Text**: control characters (C0, C1, DEL), format characters such as
  the bidirectional overrides, and line and paragraph separators are
  written as Python escapes (``\\x1b``, ``\\n``, ``\\u202e``): still
  readable, never obeyed.
- **Numbers**: one that is not finite is no figure at all, ``None``, which
  every view already shows as unknown (:func:`finite`, :func:`json_safe`).
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any

#: Unicode categories a terminal or a line-based reader may act on.
_UNSAFE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def shown(text: Any) -> str:
    """``text`` as a reader may see it: every character that could act, escaped."""
    text = text if isinstance(text, str) else str(text)
    if text.isprintable():
        # The common case, in C: nothing to escape.
        return text
    out = []
    for ch in text:
        if ch == " " or unicodedata.category(ch) not in _UNSAFE:
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    return "".join(out)


def finite(value: Any) -> float | int | None:
    """A number that is finite, or ``None``; anything that is not a number is ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite made ``None``: what strict JSON can say."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value
