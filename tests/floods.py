"""Floods of the machine's books service, as a hostile second user would send them.

A raw client on the service's socket can do what no kernel does: pipeline
thousands of requests in one write, open hundreds of connections, send half
a line and sit on it, or be refused again and again. :data:`ATTACKER` does
each of these (its first argument says which), as whoever runs it, and says
``{"flooding": ...}`` once the flood is under way; it goes on until its
stdin closes, then says what it sent and how it was answered. :data:`PROBE`
is the other user meanwhile: a kernel's real client claiming one core and
giving it back, and asking for the machine on a new connection, again and
again, each timed. The flood tests and ``bench/books.py`` share both.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil

ATTACKER = r"""
import errno, json, os, select, socket, sys, threading, time

path, mode, *args = sys.argv[1:]
args = [int(a) for a in args]
said = {"mode": mode, "refused": 0, "dropped": 0, "answers": 0, "messages": []}
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()

def line(message):
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"

HELLO = line({"op": "hello"})

def connect(hello=True):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    if hello:
        sock.sendall(HELLO)
    return sock

def note(message):
    if len(said["messages"]) < 5 and message not in said["messages"]:
        said["messages"].append(message)

def flooding(**facts):
    print(json.dumps({"flooding": facts}), flush=True)

def read_answers(sock, counts, until=None):
    # Every answer read and counted, by op; returns at the end of the connection.
    buffer = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except OSError:
            return
        if not chunk:
            return
        buffer += chunk
        *whole, buffer = buffer.split(b"\n")
        for raw in whole:
            # Every answer starts with its op: read no further, answers may be long.
            op = raw[7 : raw.index(b'"', 7)].decode()
            counts[op] = counts.get(op, 0) + 1
            if op == "refused":
                note(json.loads(raw)["message"][:300])

def pushing(socks, payload, reconnect):
    # Non-blocking writes of ``payload`` to every socket, never reading.
    left = {s: memoryview(payload) for s in socks}
    for s in socks:
        s.setblocking(False)
    while not stop.is_set():
        writable = [s for s, rest in left.items() if len(rest)]
        if not writable:
            stop.wait(0.05)
            continue
        _, ready, _ = select.select([], writable, [], 0.05)
        for s in ready:
            try:
                sent = s.send(left[s][: 1 << 16])
                left[s] = left[s][sent:]
            except BlockingIOError:
                pass
            except OSError:
                said["dropped"] += 1
                s.close()
                del left[s]
                if reconnect:
                    fresh = connect()
                    fresh.setblocking(False)
                    left[fresh] = memoryview(payload)
    return list(left)

if mode == "snapshots":
    # Many waiting claims with the longest labels, then snapshots pipelined in one
    # write, again and again: each snapshot listed every one of the asker's claims,
    # and one too long to send was answered with a short error after all that work.
    claims, batch = args
    sock = connect()
    counts = {}
    reader = threading.Thread(target=read_answers, args=(sock, counts), daemon=True)
    reader.start()
    need = {"cpus": 1, "gpus": 1, "ram_bytes": 0}
    sock.sendall(b"".join(line({"op": "claim", "id": n, "need": need, "label": "x" * 512})
                          for n in range(1, claims + 1)))
    while counts.get("ticket", 0) + counts.get("error", 0) < claims:
        time.sleep(0.01)
    said["claims"] = dict(counts)
    requests = b"".join(line({"op": "snapshot", "id": n}) for n in range(batch))
    flooding(waiting=counts.get("ticket", 0), bytes_per_write=len(requests))
    sent = 0
    while not stop.is_set():
        before = counts.get("snapshot", 0) + counts.get("error", 0)
        sock.sendall(requests)
        sent += batch
        while counts.get("snapshot", 0) + counts.get("error", 0) < before + batch:
            if stop.is_set() or not reader.is_alive():
                break
            time.sleep(0.001)
        if not reader.is_alive():
            break
    said["answers"] = counts.get("snapshot", 0) + counts.get("error", 0)
    said["sent"] = sent
elif mode == "connections":
    # Many connections, each writing a block of snapshot requests and reading nothing.
    n, size = args
    one = line({"op": "snapshot", "id": 1})
    payload = one * (size // len(one))
    socks = [connect() for _ in range(n)]
    flooding(connections=n, bytes_each=len(payload))
    pushing(socks, payload, reconnect=True)
elif mode == "unfinished":
    # Many connections, each with a line of ``size`` bytes that never ends.
    n, size = args
    socks = []
    for _ in range(n):
        try:
            socks.append(connect())
        except OSError:
            said["refused"] += 1
    flooding(connections=len(socks))
    start = b'{"op":"snapshot","id":'
    pushing(socks, start + b"1" * (size - len(start)), reconnect=False)
elif mode == "drips":
    # Many connections, each sending its requests a byte at a time.
    n, = args
    socks = [connect() for _ in range(n)]
    for s in socks:
        s.setblocking(False)
    request = line({"op": "snapshot", "id": 1})
    flooding(connections=n)
    at = 0
    while not stop.is_set() and socks:
        byte = request[at % len(request): at % len(request) + 1]
        for s in list(socks):
            try:
                s.send(byte)
                s.recv(1 << 16)
            except BlockingIOError:
                pass
            except OSError:
                said["dropped"] += 1
                socks.remove(s)
        at += 1
        stop.wait(0.001)
elif mode == "claims":
    # Claims pipelined on one connection, as fast as it is read.
    total, = args
    sock = connect()
    counts = {}
    reader = threading.Thread(target=read_answers, args=(sock, counts), daemon=True)
    reader.start()
    need = {"cpus": 1, "gpus": 1, "ram_bytes": 0}
    flooding(claims=total)
    sent, block = 0, 1000
    while sent < total and not stop.is_set():
        sock.sendall(b"".join(line({"op": "claim", "id": sent + k, "need": need, "label": "x"})
                              for k in range(block)))
        sent += block
    said["sent"] = sent
    stop.wait()
    said["answers"] = dict(counts)
elif mode == "bad-lines":
    # Connection after connection, each refused for a line that does not parse,
    # ``most`` times; then it says so and ends.
    most, = args
    flooding()
    while not stop.is_set() and said["refused"] < most:
        try:
            sock = connect()
            sock.sendall(b'{"op":"claim","id":1,"need":{"cpus":"all"}}\n')
            counts = {}
            read_answers(sock, counts)
            said["refused"] += counts.get("refused", 0)
            sock.close()
        except OSError:
            said["dropped"] += 1
    stop.set()
elif mode == "none":
    # No flood: the same figures, for a baseline.
    flooding()
else:
    raise SystemExit(f"no such flood: {mode}")
stop.wait()
print(json.dumps({"done": said}), flush=True)
"""

#: The other user's kernel: claims one core and gives it back, and asks for the
#: machine on a connection of its own, over and over, until its stdin closes.
PROBE = r"""
import json, sys, threading, time
from fluksio_nb.kernel import accountant
from fluksio_nb.machine.connection import read_snapshot
from fluksio_nb.resources import Resources

q = accountant()
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    started = time.perf_counter()
    ticket = q.enqueue(Resources(cpus=1), "probe")
    q.wait(ticket, 60)
    q.release(ticket)
    claim, started = time.perf_counter() - started, time.perf_counter()
    read_snapshot(q.path)
    seen = time.perf_counter() - started
    print(json.dumps({"claim": claim, "snapshot": seen}), flush=True)
    stop.wait(0.02)
"""


class Flood:
    """An attacker's flood under way, and the other user's probes beside it."""

    def __init__(self, attacker: subprocess.Popen, service_pid: int | None = None) -> None:
        self.attacker, self.probe = attacker, None
        self.said: dict[str, Any] = {}
        #: What the attacker said once its flood was under way.
        self.facts: dict[str, Any] = {}
        #: The most memory the service held while the flood ran, sampled.
        self.peak_rss = 0
        self._watching = threading.Event()
        if service_pid is not None:
            threading.Thread(target=self._watch, args=(service_pid,), daemon=True).start()

    def _watch(self, pid: int) -> None:
        while not self._watching.is_set():
            with contextlib.suppress(psutil.Error):
                self.peak_rss = max(self.peak_rss, rss(pid))
            self._watching.wait(0.02)

    def started(self) -> dict[str, Any]:
        """What the attacker said once its flood was under way."""
        said = self.attacker.stdout.readline()
        if not said:
            raise AssertionError(f"the attacker ended: {self.attacker.stderr.read()[-2000:]}")
        return json.loads(said)["flooding"]

    def probes(self, count: int, within: float = 120.0) -> list[dict[str, float]]:
        """The other user's next ``count`` claims and snapshots, each timed."""
        assert self.probe is not None
        deadline = time.monotonic() + within
        samples = []
        while len(samples) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(samples)} of {count} probes in {within} s")
            said = self.probe.stdout.readline()
            if not said:
                raise AssertionError(f"the probe ended: {self.probe.stderr.read()[-2000:]}")
            samples.append(json.loads(said))
        return samples

    def stop(self) -> dict[str, Any]:
        """End the flood; what the attacker says it sent and was answered."""
        self._watching.set()
        for process in (self.attacker, self.probe):
            if process is not None and process.stdin is not None:
                process.stdin.close()
                process.stdin = None
        out, err = self.attacker.communicate(timeout=60)
        last = out.strip().splitlines()[-1:] if out else []
        self.said = json.loads(last[0])["done"] if last else {"stderr": err[-2000:]}
        return self.said


@contextmanager
def flooding(
    prefix: list[str],
    env: dict[str, str],
    socket_path: str,
    mode: str,
    *args: int,
    probe: tuple[list[str], dict[str, str]] | None = None,
    service_pid: int | None = None,
) -> Iterator[Flood]:
    """An attacker (run with ``prefix``, e.g. as another user) flooding the service at
    ``socket_path`` in ``mode``, and, if ``probe`` gives a prefix and environment, the
    other user's probe; both ended afterwards, whatever happened. The memory of the
    service at ``service_pid`` is watched meanwhile."""

    def start(command: list[str], environ: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
            cwd="/",
        )

    attacker = start(
        [*prefix, sys.executable, "-c", ATTACKER, socket_path, mode, *map(str, args)], env
    )
    flood = Flood(attacker, service_pid)
    try:
        flood.facts = flood.started()
        if probe is not None:
            flood.probe = start([*probe[0], sys.executable, "-c", PROBE], probe[1])
        yield flood
    finally:
        flood._watching.set()
        for process in (attacker, flood.probe):
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait(30)


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "worst": ordered[-1],
    }
