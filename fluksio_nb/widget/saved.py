"""How a live widget's display reads when it is opened again without the kernel that drew it.

A ``%claims`` monitor, and a ``%%claim --background`` cell saved while its
claim still ran, are saved as a widget view (ipywidgets'
``application/vnd.jupyter.widget-view+json``) with a text and an HTML
fallback beside it. Opened again with a new kernel, or none, JupyterLab and
Notebook 7 pick the widget view, which then has no model to draw: "Error
displaying widget: model not found", or "Loading widget..." for good. Other
front ends (nbconvert, VS Code, an untrusted copy) pick the fallbacks.

What is decided here:

- **The display also says which of ours it is** (:data:`SAVED_VIEW`): the
  widget's model id and its kind, ``monitor`` or ``claim``. JupyterLab's
  extension (``labextension/src/saved.ts``) draws that mime type before the
  widget view: the live widget while its kernel still holds it, else the
  saved HTML, marked stale. A front end without the extension does not know
  the type and picks what it picked before.
- **The fallbacks say when they were true.** They are figured once, when the
  widget is first drawn, and read only after it is gone: the monitor's say
  the clock time they were drawn at, the claim's that it was running when
  saved and where its ending is (:mod:`fluksio_nb.widget`).
"""

from __future__ import annotations

from typing import Any, Literal

#: The display of one of our live widgets: ``{"model_id": ..., "kind": ...}``.
SAVED_VIEW = "application/vnd.fluksio-nb.live-view+json"


def add_saved_view(data: dict[str, Any], kind: Literal["monitor", "claim"]) -> None:
    """Put :data:`SAVED_VIEW` in ``data``, a widget's bundle, beside its widget view."""
    view = data.get("application/vnd.jupyter.widget-view+json") or {}
    model_id = view.get("model_id")
    if model_id:
        data[SAVED_VIEW] = {"model_id": model_id, "kind": kind}
