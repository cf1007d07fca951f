"""A real Prometheus server for tests: Debian's binary, on a port of its own, scraping every second.

Prometheus is what admins point at the metrics, and it is strict where a
hand-written parser would not be: a metric it cannot parse fails the whole
scrape, a token it does not send is a 401 it records. So the tests start
the real one, with a temporary storage directory and a config naming the
targets, and ask it what it scraped over its HTTP API, as Grafana does.

Its port is picked by the OS and, since Prometheus binds it a moment later
and another process could take it in between, tried again with another one
if Prometheus says it is in use.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

PROMETHEUS = "/usr/bin/prometheus"


def require_prometheus() -> str:
    """The Prometheus binary, or skip saying how to install it."""
    found = shutil.which("prometheus") or (PROMETHEUS if Path(PROMETHEUS).exists() else None)
    if found is None:
        pytest.skip("needs a Prometheus server: apt-get install prometheus (Debian's package)")
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Prometheus:
    def __init__(self, port: int, process: subprocess.Popen, log: Path) -> None:
        self.port, self.process, self.log = port, process, log

    def api(self, path: str, **query: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            said = json.loads(answer.read())
        assert said["status"] == "success", said
        return said["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's samples: each ``{"metric": {labels}, "value": [at, "figure"]}``."""
        return self.api("query", query=promql)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets")["activeTargets"]


@contextmanager
def prometheus(directory: Path, jobs: list[dict[str, Any]]) -> Iterator[Prometheus]:
    """Prometheus scraping ``jobs`` (its ``scrape_configs``) every second, stopped afterwards."""
    binary = require_prometheus()
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "prometheus.yml"
    # JSON is YAML: no YAML writer needed.
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                "scrape_configs": jobs,
            }
        )
    )
    log = directory / "prometheus.log"
    for _ in range(5):
        port = _free_port()
        with log.open("wb") as written:
            process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=written,
                stderr=subprocess.STDOUT,
                cwd=directory,
            )
        started = Prometheus(port, process, log)
        if _ready(started):
            break
        process.kill()
        process.wait()
        if "address already in use" not in log.read_text():
            raise AssertionError(f"Prometheus did not start: {log.read_text()[-3000:]}")
    else:
        raise AssertionError("Prometheus found no free port in five tries")
    try:
        yield started
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ready(started: Prometheus, within: float = 60.0) -> bool:
    """Whether Prometheus answers ``/-/ready``; ``False`` once it has exited."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if started.process.poll() is not None:
            return False
        try:
            url = f"http://127.0.0.1:{started.port}/-/ready"
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(
        f"Prometheus was not ready in {within} s: {started.log.read_text()[-3000:]}"
    )
