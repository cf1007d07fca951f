"""The books service's metrics over HTTP, for Prometheus to scrape: ``GET /metrics``.

The metrics come from the books, which live on the service's one asyncio
loop; so they are served from that loop too, by this small HTTP server,
rather than from a thread that would have to lock the books against the
loop that answers claims. Whoever reaches the address the admin named
(``machine init --metrics HOST:PORT``) may connect, so each scraper is
treated as the service treats a kernel it does not trust:

- **Only** ``GET /metrics`` (a query string is ignored); anything else is
  answered 404 or 405 and closed.
- **A request is read to a bound and within a time**:
  :data:`MOST_REQUEST_BYTES` of request line and headers, within
  :data:`READ_WITHIN_S`; a scraper that sends more, or sends it slowly, is
  cut off. No body is read.
- **At most** :data:`MOST_CONNECTIONS` **at once**; one more is closed as it
  comes. A scraper that never reads its answer is cut off after
  :data:`WRITE_WITHIN_S`, and its answer waits in the transport's buffer
  meanwhile, never in the loop: claims are answered all the while.
- **The text is made on the loop, and only when something changed**
  (:func:`metrics_text`): with a
  hundred claims running it costs well under the loop's time for one claim
  (``python -m bench metrics``).
- **One answer per connection** (``Connection: close``): Prometheus scrapes
  every few seconds, and a kept-alive connection would hold one of the few
  places for nothing in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluksio_nb.metrics import CONTENT_TYPE, snapshot_families, with_cards_read

if TYPE_CHECKING:
    from fluksio_nb.machine.service import BooksService

log = logging.getLogger("fluksio_nb.machine")

#: The most bytes of request line and headers read: Prometheus sends a few hundred.
MOST_REQUEST_BYTES = 8 << 10
#: How long a scraper has to send its request, and to read its answer.
READ_WITHIN_S = 5.0
WRITE_WITHIN_S = 10.0
#: How many scrapers may be connected at once: a Prometheus or two, and a person with curl.
MOST_CONNECTIONS = 8
#: In the service's run directory while it serves metrics: where, as ``HOST:PORT``.
ADDRESS_NAME = "metrics.address"


def metrics_text(service: BooksService) -> bytes:
    """The service's metrics, each part made again only when what it comes from changed.

    Runs on the loop that answers claims: at most a snapshot of the books per
    change, and the cards' last reading, never waited for.
    """
    books, tally = service.books, service.tally
    reading = None if service.cards is None else service.cards.latest(wait_for_first=False)

    def gauges() -> Any:
        snapshot = books.snapshot(0, admin=True, sees_pids=True)
        return snapshot_families(with_cards_read(snapshot, reading), books.waiting_by_user())

    at = None if reading is None else reading.at
    kept = service.metrics_kept
    return kept.part("books", (books.version, at), gauges) + kept.part(
        "tally", tally.version, tally.families
    )


def parse_address(said: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9464`` for IPv6) as a host and a port; ``ValueError`` says why not.

    The host is an IP address: the service binds it as root, and a name
    would be resolved by whatever resolver the machine has at boot. Port 0
    is any free port, which the service writes down where it serves
    (``metrics.address`` in its run directory).
    """
    host, colon, port = said.rpartition(":")
    if not colon or not host or not port:
        raise ValueError(
            f"{said!r} is not HOST:PORT: name an address and a port, e.g. 127.0.0.1:9464"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"{host!r} in {said!r} is not an IP address: name one of the machine's addresses, "
            "e.g. 127.0.0.1:9464 (this machine only) or 0.0.0.0:9464 (every network)"
        ) from None
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"{port!r} in {said!r} is not a port: a number from 1 to 65535 (0 for any free one)"
        )
    return host, int(port)


def said_address(host: str, port: int) -> str:
    """``host`` and ``port`` as ``HOST:PORT``, bracketed for IPv6."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _answer(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class MetricsServer:
    """``GET /metrics`` on one address, answered with ``text()``, on the running loop."""

    def __init__(self, text: Callable[[], bytes], run_dir: Path | None = None) -> None:
        self._text = text
        #: Where the address it listens at is written down, while it listens.
        self._written = None if run_dir is None else run_dir / ADDRESS_NAME
        self._open = 0
        self.server: asyncio.Server | None = None
        #: Where it listens, once it does: the port the OS gave, for port 0.
        self.bound: tuple[str, int] | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen at ``host:port``; returns where, with the port the OS gave for port 0."""
        self.server = await asyncio.start_server(
            self._serve, host, port, limit=MOST_REQUEST_BYTES, reuse_address=True
        )
        bound = self.server.sockets[0].getsockname()
        self.bound = bound[0], bound[1]
        if self._written is not None:
            staged = self._written.with_name(f".{ADDRESS_NAME}.new")
            staged.write_text(said_address(*self.bound) + "\n")
            os.chmod(staged, 0o644)
            os.replace(staged, self._written)
        return self.bound

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._written is not None:
            with contextlib.suppress(FileNotFoundError):
                self._written.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MOST_CONNECTIONS:
            writer.transport.abort()
            return
        self._open += 1
        try:
            answer = await self._read(reader)
            if answer is None:
                writer.transport.abort()
                return
            writer.write(answer)
            try:
                await asyncio.wait_for(writer.drain(), WRITE_WITHIN_S)
            except (TimeoutError, ConnectionError):
                writer.transport.abort()
                return
            writer.close()
        except Exception as error:
            # A scrape never takes the service down with it.
            log.warning("a metrics request failed: %s", error)
            writer.transport.abort()
        finally:
            self._open -= 1

    async def _read(self, reader: asyncio.StreamReader) -> bytes | None:
        """The answer to the request on ``reader``; ``None`` to cut the scraper off."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_WITHIN_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return None
        except ConnectionError:
            return None
        method, _, rest = head.partition(b"\r\n")[0].partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if path != b"/metrics":
            return _answer("404 Not Found", b"only /metrics is served here\n")
        if method != b"GET":
            return _answer("405 Method Not Allowed", b"only GET /metrics is served here\n")
        return _answer("200 OK", self._text(), CONTENT_TYPE)


async def start_metrics(
    text: Callable[[], bytes], host: str, port: int, run_dir: Path | None = None
) -> MetricsServer | None:
    """A :class:`MetricsServer` listening at ``host:port``, or ``None`` (said in the log) if
    the address cannot be bound: the books go on without metrics rather than stop.

    Where it listens is written in ``run_dir`` (:data:`ADDRESS_NAME`), for the admin and
    for ``machine init`` to say."""
    server = MetricsServer(text, run_dir)
    try:
        bound = await server.start(host, port)
    except OSError as error:
        log.error(
            "metrics are not served: %s cannot be bound (%s); name another address with "
            "`fluksio-nb machine init --metrics HOST:PORT`",
            said_address(host, port),
            error.strerror or error,
        )
        return None
    log.info("metrics are served at http://%s/metrics", said_address(*bound))
    return server
