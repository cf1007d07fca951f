"""The machine's books over HTTP, for JupyterLab's status bar and panel.

A kernel knows only its own claims, and the books know every claim but not
which notebook a kernel serves. The Jupyter server knows that, because it
started the kernels. This extension puts the two together, so the panel can
say that ``train.ipynb`` holds GPU 1 and a second notebook waits for it.

What it decides:

- **It reads and never claims.** The snapshot is the machine's books read as
  ``fluksio-nb`` reads them (:func:`~fluksio_nb.overview.read_books`). The
  server makes no claim of its own, however often a browser polls.
- **Nothing slow runs on the event loop.** Asking the books service, and
  taking the inventory when no service runs yet (NVML, or ``nvidia-smi`` if NVML is
  missing), run in a worker thread. One slow disk must not freeze every
  notebook served here. The session manager is asked on the loop, because
  it is made for the loop.
- **The server's OS user can cancel their own claims and no others** (or,
  for a member of the machine's admin group, anyone's). It is the same user
  as the kernels it starts, and on books shared by every user the service
  knows it from the socket, not from anything the server says. Other users'
  claims are shown, and cancelling one answers 403 and names its owner.
- **It behaves like the rest of Jupyter's API.** Requests need the server's
  token or login cookie, and the server's authorizer decides on the resource
  ``fluksio``, so a JupyterHub deployment's scopes apply to it as well. A
  request that is not logged in gets 401. jupyter_server's own handlers
  answer 403 there, and then a client cannot tell "log in again" from
  "you may not".
- **Settings are read on every request**, as ``fluksio-nb`` reads them, so a
  corrected config file takes effect without restarting the server.
- **It keeps the machine's last ten minutes** (:mod:`fluksio_nb.machine_history`),
  a point every couple of seconds from a periodic callback that only hands
  the reading to a worker thread, and skips a beat while the last one is
  still out: the loop never waits on it. Its kernels read it from a file
  (:mod:`fluksio_nb.server_history`), so ``%claims`` opens on ten minutes
  too. The snapshot carries the host's CPU and memory, each kernel's
  memory and the cores kept back (:mod:`fluksio_nb.glance`). The finished claims come from the
  usage records, read again only when they change
  (:mod:`fluksio_nb.usage.recent`).
- **Metrics for Prometheus** at ``fluksio/metrics``, behind the same token
  or login (:mod:`fluksio_nb.metrics`): every user's shares as the snapshot
  shows them, and the counters of this server's user's own claims.
- **A kernel stopped at the admin's ``kernel_ram``** is in the snapshot's
  ``kernel_stops``, with its notebook and why (:mod:`fluksio_nb.kernel_ram`).
- **Kernels it starts get the fair share** of the cores no claim holds: it
  makes :mod:`fluksio_nb.provisioner` the server's default kernel provisioner.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import ioloop, web

from fluksio_nb.errors import BadClaim

#: What the server's authorizer is asked about: ``read`` for the snapshot,
#: ``write`` for a cancel.
AUTH_RESOURCE = "fluksio"

NOT_LOGGED_IN = (
    "not logged in: send the server's token (an 'Authorization: token <token>' header) "
    "or log in first"
)


async def _off_the_loop(function: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(function, *args)
    )


class _LedgerHandler(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def os_user(self) -> str:
        return self.settings["fluksio_os_user"]

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        # jupyter_server answers 403 when nobody is logged in: the redirect
        # that @web.authenticated would make on a GET, tornado's own refusal
        # of a POST, or a POST without an XSRF cookie. A client has to tell
        # that apart from a real refusal, so it becomes 401 here, where every
        # one of those ends. A logged-in user who is refused keeps the 403.
        logged_in = getattr(self, "_jupyter_current_user", None)
        if status_code == 403 and not logged_in and self.check_host():
            status_code = 401
            refusal = web.HTTPError(401, NOT_LOGGED_IN)
            kwargs["exc_info"] = (web.HTTPError, refusal, None)
        super().send_error(status_code, **kwargs)

    def finish_json(self, value: Any) -> None:
        """Answer ``value`` as strict JSON, whatever another user's kernel reported in it.

        Tornado writes ``NaN`` and ``Infinity`` for floats that are not finite,
        which ``JSON.parse`` in the panel refuses: one user's reading would
        blank every other user's panel. Such a figure is said as ``null``.
        """
        from fluksio_nb.shown import json_safe

        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.finish(json.dumps(json_safe(value), allow_nan=False))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        if status_code == 401:
            self.set_header("WWW-Authenticate", "token")
        super().write_error(status_code, **kwargs)


class SnapshotHandler(_LedgerHandler):
    """``GET fluksio/api/snapshot``: the machine, every claim, whose notebook holds it."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        pids = self._kernel_pids()
        try:
            snapshot = await _off_the_loop(_snapshot_at_a_glance, pids)
        except BadClaim as error:
            raise web.HTTPError(
                500,
                f"fluksio_nb's settings cannot be used: {_sentence(error)} Fix them and reload.",
            ) from None
        sessions = await self.session_manager.list_sessions()
        paths = {s["kernel"]["id"]: s["path"] for s in sessions if s.get("kernel")}
        for claim in snapshot["running"] + snapshot["waiting"]:
            # Only a notebook this server serves has a path the browser can
            # open; a kernel started elsewhere still shows its own notebook name.
            claim["path"] = paths.get(claim["kernel_id"]) if claim["mine"] else None
            claim["can_cancel"] = claim["mine"] or snapshot.get("can_cancel_any", False)
        snapshot["kernel_stops"] = _kernel_stops(paths)
        self.finish_json(snapshot)

    def _kernel_pids(self) -> dict[str, int]:
        """This server's kernels' process ids, where they run here as local processes."""
        pids = {}
        manager = self.kernel_manager
        for kernel_id in manager.list_kernel_ids():
            provisioner = getattr(manager.get_kernel(kernel_id), "provisioner", None)
            pid = getattr(provisioner, "pid", None)
            if isinstance(pid, int):
                pids[kernel_id] = pid
        return pids


def _snapshot_at_a_glance(pids: dict[str, int]) -> dict[str, Any]:
    from fluksio_nb.glance import with_glance
    from fluksio_nb.overview import read_books

    return with_glance(read_books(), pids)


def _kernel_stops(paths: dict[str, str]) -> list[dict[str, Any]]:
    """This server's kernels its provisioner saw stopped at the admin's ``kernel_ram``."""
    from fluksio_nb.kernel_ram import kernel_stops

    return [{**stop.as_json(), "path": paths.get(stop.kernel_id)} for stop in kernel_stops()]


class HistoryHandler(_LedgerHandler):
    """``GET fluksio/api/history``: the machine's CPU, memory and cards, the last ten minutes."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        from fluksio_nb.machine_history import process_history

        self.finish_json(process_history().as_json())


class FinishedHandler(_LedgerHandler):
    """``GET fluksio/api/finished``: the last claims that ended, newest first, with their peaks."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        from fluksio_nb.usage.recent import process_recent_usage

        self.finish_json(await _off_the_loop(process_recent_usage().finished))


class MetricsHandler(_LedgerHandler):
    """``GET fluksio/metrics``: the machine's claims, and this user's that ended, for Prometheus.

    The gauges from the snapshot ``fluksio/api/snapshot`` serves; the
    counters from the user's own usage records (:mod:`fluksio_nb.metrics`).
    """

    @web.authenticated
    @authorized
    async def get(self) -> None:
        from fluksio_nb.metrics import CONTENT_TYPE

        try:
            text = await _off_the_loop(_metrics_text)
        except BadClaim as error:
            raise web.HTTPError(
                500,
                f"fluksio_nb's settings cannot be used: {_sentence(error)} Fix them and reload.",
            ) from None
        # Said to finish: APIHandler's would make it JSON otherwise.
        self.finish(text, set_content_type=CONTENT_TYPE)


def _metrics_text() -> bytes:
    from fluksio_nb.metrics import exposition
    from fluksio_nb.overview import read_books
    from fluksio_nb.usage.recent import process_recent_usage

    return exposition(read_books(), process_recent_usage().tally())


class HistoryFeeder:
    """Takes a point of the machine's history on a timer, in a worker thread, one at a time."""

    def __init__(self, log: logging.Logger, path: Path | None = None) -> None:
        self.log = log
        #: Where the points go for the kernels to read (:mod:`fluksio_nb.server_history`).
        self.path = path
        self._out = False
        self._said: str | None = None

    def tick(self) -> None:
        if self._out:
            return  # the last reading is still out: a slow disk costs points, not the loop
        self._out = True
        future = asyncio.get_running_loop().run_in_executor(None, self._read)
        future.add_done_callback(self._done)

    def _done(self, _future: Any) -> None:
        self._out = False

    def _read(self) -> None:
        from fluksio_nb.machine_history import process_history, take_point
        from fluksio_nb.overview import read_books

        try:
            if take_point(process_history(), read_books()) is not None and self.path is not None:
                from fluksio_nb.server_history import publish

                publish(process_history(), self.path)
        except Exception as error:
            # Said once, not every two seconds: broken settings stay broken until fixed.
            if str(error) != self._said:
                self._said = str(error)
                self.log.warning("fluksio_nb: points of the machine's history are lost: %s", error)
        else:
            self._said = None


class CancelHandler(_LedgerHandler):
    """``POST fluksio/api/claims/<ticket>/cancel``: a waiting claim leaves the queue,
    a running one is stopped by its kernel."""

    @web.authenticated
    @authorized
    async def post(self, number: str) -> None:
        from fluksio_nb.kernel import cancel_in_books

        if len(number) > 18:
            # No claim's number is that long, and int() of thousands of digits refuses.
            raise web.HTTPError(404, f"there is no claim {number[:20]}... in this machine's books")
        reason = f"cancelled by {self.os_user} from JupyterLab"
        try:
            found = await _off_the_loop(cancel_in_books, int(number), reason)
        except PermissionError as error:
            raise web.HTTPError(
                403,
                f"{error}. This Jupyter server runs as {self.os_user!r} and cancels "
                "only that user's claims; ask their owner to cancel it.",
            ) from None
        except BadClaim as error:
            raise web.HTTPError(
                500, f"fluksio_nb's settings cannot be used: {_sentence(error)} Fix them and retry."
            ) from None
        if not found:
            raise web.HTTPError(
                404,
                f"there is no claim {number} in this machine's books: it has ended, "
                "or it was never made. GET fluksio/api/snapshot lists the claims there are.",
            )
        self.finish({"ticket": int(number), "cancelled": True})


def _load_jupyter_server_extension(serverapp: Any) -> None:
    web_app = serverapp.web_app
    base_url = web_app.settings["base_url"]
    from fluksio_nb.identity import my_user

    # Its uid's name: $USER is anybody's to set.
    web_app.settings["fluksio_os_user"] = my_user()
    from fluksio_nb.kernel_status import keep_subshell_requests_out_of_the_status

    keep_subshell_requests_out_of_the_status(serverapp)
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base_url, "fluksio/api/snapshot"), SnapshotHandler),
            (url_path_join(base_url, "fluksio/api/history"), HistoryHandler),
            (url_path_join(base_url, "fluksio/api/finished"), FinishedHandler),
            (url_path_join(base_url, "fluksio/metrics"), MetricsHandler),
            (url_path_join(base_url, r"fluksio/api/claims/(\d+)/cancel"), CancelHandler),
        ],
    )
    from fluksio_nb.machine_history import INTERVAL_S
    from fluksio_nb.server_history import ENV, forget, history_path

    # Its kernels inherit the server's environment: this is how they find the history.
    path = history_path()
    os.environ[ENV] = str(path)
    atexit.register(forget, path)
    feeder = HistoryFeeder(serverapp.log, path)
    periodic = ioloop.PeriodicCallback(feeder.tick, INTERVAL_S * 1000)
    web_app.settings["fluksio_history_feeder"] = periodic
    serverapp.io_loop.add_callback(periodic.start)
    serverapp.log.info(
        "fluksio_nb: the machine's books are served at %s",
        url_path_join(base_url, "fluksio/api/snapshot"),
    )
    from fluksio_nb.provisioner import PROVISIONER_NAME, make_it_the_default

    why_not = make_it_the_default(serverapp)
    if why_not is None:
        serverapp.log.info(
            "fluksio_nb: kernels start with the fair share of the unclaimed cores (%s); "
            "'fair_share: false' in fluksio_nb's config turns it off",
            PROVISIONER_NAME,
        )
    else:
        serverapp.log.info("fluksio_nb: kernels start without a fair share: %s", why_not)


def _sentence(error: BaseException) -> str:
    """An error's message ending with one full stop, whether it brought its own or not."""
    return str(error).rstrip().rstrip(".") + "."
