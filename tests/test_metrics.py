"""Metrics for Prometheus, from the machine's books service and from the Jupyter server.

The service's metrics are served at the address ``machine init --metrics``
names, by a real root-run service under a temporary prefix; the Jupyter
server's at ``/fluksio/metrics``, by a real JupyterLab on those books.
Claims are made and ended by real processes, one of them as a second Unix
user, and a real Prometheus (Debian's binary) scrapes both places, as an
admin's would: a metric it cannot parse, or a token it is refused with,
shows in what it stored.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fluksio_nb.machine.metrics_http import ADDRESS_NAME
from fluksio_nb.machine.setup import Layout
from tests.browser.lab import JupyterLab
from tests.gpu_standins import MPS_DAEMON
from tests.machines import fluksio_nb, heard, machine, machine_env, process
from tests.prometheus import prometheus, require_prometheus
from tests.suite_locks import held_across_suites
from tests.unix_users import USER_A, ready_user, require_unix_users
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"

#: Words only the claims' owners may see: never in any metric.
MY_SECRET_LABEL = "my-secret-label-7f3a"
THEIR_SECRET_LABEL = "their-secret-label-c21e"
THEIR_SECRET_NOTEBOOK = "their-secret-notebook-9b04.ipynb"
SECRETS = (MY_SECRET_LABEL, THEIR_SECRET_LABEL, THEIR_SECRET_NOTEBOOK)

#: Holds a claim of ``cpus`` cores, labelled, until its stdin closes.
HOLD = """
t = q.enqueue(Resources(cpus={cpus}), label={label!r})
q.wait(t, timeout=60)
say(ticket=t.number)
sys.stdin.read()
"""


def metrics_address(layout: Layout) -> str:
    """Where the service serves its metrics, as it wrote down (it bound port 0)."""
    return (layout.run_dir / ADDRESS_NAME).read_text().strip()


def scrape(url: str, token: str | None = None) -> tuple[int, str]:
    headers = {} if token is None else {"Authorization": f"token {token}"}
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and labels, as Prometheus's own parser reads it."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def test_prometheus_finds_a_users_cores_at_both_places_and_nobodys_label(tmp_path):
    """Guards against metrics Prometheus cannot scrape or parse (either place), a claim's
    cores missing from its user's series, and a claim's label or another user's notebook
    leaking into series anyone reading Prometheus can see."""
    require_prometheus()
    require_unix_users()
    them = ready_user(USER_A)
    with machine(cpus=5, gpus=1, config={"metrics": "127.0.0.1:0"}) as layout:
        lab = JupyterLab(tmp_path / "lab", FLUKSIO_LEDGER=str(layout.run_dir)).start()
        holders = []
        try:
            theirs = process(
                layout,
                HOLD.format(cpus=1, label=THEIR_SECRET_LABEL),
                user=them,
                JPY_SESSION_NAME=THEIR_SECRET_NOTEBOOK,
            )
            holders.append(theirs)
            heard(theirs)
            mine = process(layout, HOLD.format(cpus=2, label=MY_SECRET_LABEL))
            holders.append(mine)
            heard(mine)
            jobs = [
                {"job_name": "service", "static_configs": [{"targets": [metrics_address(layout)]}]},
                {
                    "job_name": "jupyter",
                    "metrics_path": "/fluksio/metrics",
                    "authorization": {"type": "Bearer", "credentials": lab.token},
                    "static_configs": [{"targets": [f"127.0.0.1:{lab.port}"]}],
                },
            ]
            with prometheus(tmp_path / "prometheus", jobs) as server:
                cores = 'fluksio_user_cores{user="root"}'

                def both_scraped() -> list[dict[str, Any]]:
                    found = server.query(cores)
                    return (
                        found
                        if {s["metric"]["job"] for s in found}
                        == {
                            "service",
                            "jupyter",
                        }
                        else []
                    )

                assert wait_until(both_scraped, 60), (server.targets(), server.log.read_text())
                assert [s["value"][1] for s in both_scraped()] == ["2", "2"]
                assert {
                    s["metric"]["job"]: s["value"][1]
                    for s in server.query(f'fluksio_user_cores{{user="{them.name}"}}')
                } == {"service": "1", "jupyter": "1"}
                every = server.api("series", **{"match[]": '{__name__=~"fluksio_.+"}'})
                names = {name for series in every for name in series}
                assert names <= {"__name__", "job", "instance", "user", "ending", "card", "le"}
                stored = json.dumps(every)
                for secret in SECRETS:
                    assert secret not in stored
                for url, token in (
                    (f"http://{metrics_address(layout)}/metrics", None),
                    (f"{lab.base_url}/fluksio/metrics", lab.token),
                ):
                    status, text = scrape(url, token)
                    assert status == 200, text
                    for secret in SECRETS:
                        assert secret not in text
        finally:
            for holder in holders:
                holder.kill()
                holder.wait()
            lab.stop()


#: Ends one claim each way the counters tell apart, then says so.
ENDINGS = """
from fluksio_nb import claim
from fluksio_nb.errors import ClaimHalted, ClaimTimeout

try:
    with claim(cpus=1, timeout=1, label="sleeps-too-long") as c:
        c.run(time.sleep, 60)
except ClaimTimeout:
    say(ended="timed out")

def hog():
    block = bytearray(600 * 2**20)
    for at in range(0, len(block), 4096):
        block[at] = 1
    time.sleep(30)

try:
    with claim(cpus=1, ram="200M", label="too-big") as c:
        c.run(hog)
except ClaimHalted:
    say(ended="halted")

everything = q.enqueue(Resources(cpus=4), label="holds-every-core")
q.wait(everything, timeout=60)
waiting = q.enqueue(Resources(cpus=1), label="to-cancel")
q.cancel(waiting.number, "cancelled by the test")
q.release(everything)
say(ended="cancelled")
"""


def test_the_services_counters_tell_halts_timeouts_cancels_and_kernel_deaths_apart(tmp_path):
    """Guards against a service that counts every claim as merely 'released': a halt or a
    timeout is only the kernel's to know, and must reach the service's counters; and against
    a killed kernel's claims not being counted at all."""
    with machine(cpus=5, gpus=1, config={"metrics": "127.0.0.1:0"}) as layout:
        url = f"http://{metrics_address(layout)}/metrics"
        ends = process(layout, ENDINGS)
        told = [heard(ends)["ended"] for _ in range(3)]
        ends.stdin.close()
        assert ends.wait(timeout=60) == 0, ends.stderr.read()
        assert told == ["timed out", "halted", "cancelled"]
        killed = process(layout, HOLD.format(cpus=1, label="its-kernel-dies"))
        heard(killed)
        killed.send_signal(signal.SIGKILL)
        killed.wait()

        def counted() -> dict[str, float]:
            text = scrape(url)[1]
            return {
                ending: value(text, "fluksio_claims_ended_total", user="root", ending=ending)
                for ending in ("timed_out", "halted", "cancelled", "kernel_died")
            }

        assert wait_until(lambda: all(counted().values()), 30), counted()
        assert counted() == {"timed_out": 1, "halted": 1, "cancelled": 1, "kernel_died": 1}
        text = scrape(url)[1]
        # The ticket that held every core, given back by the queue's own release, which
        # knows nothing of how it ended.
        assert value(text, "fluksio_claims_ended_total", user="root", ending="released") == 1
        assert value(text, "fluksio_claim_wait_seconds_count", user="root") == 4
        # Four claims held a core for a while each: the one killed, the timeout, the halt.
        assert value(text, "fluksio_core_seconds_total", user="root") > 1


def test_a_bad_metrics_address_is_refused_at_init_saying_what_to_name(tmp_path):
    """Guards against a typo in --metrics leaving a service that silently serves none."""
    for bad, said in (
        ("localhost:9464", "not an IP address"),
        ("127.0.0.1", "not HOST:PORT"),
        ("127.0.0.1:99999", "not a port"),
    ):
        ran = fluksio_nb(
            "machine", "init", "--prefix", str(tmp_path), "--metrics", bad, check=False
        )
        assert ran.returncode == 2, ran.stderr
        assert f"--metrics {bad}" in ran.stderr and said in ran.stderr, ran.stderr
        assert "Nothing was changed" in ran.stderr
        assert not Layout(tmp_path).config.exists()


def test_machine_status_says_the_admins_rules_and_where_the_metrics_are():
    """Guards against an admin's limits that only machine.json says: a user told "time
    limit" with no way to read the limit, an admin hunting for the metrics' port."""
    rules = {
        "metrics": "127.0.0.1:0",
        "caps": {"*": {"max_hours": 8}, "alice": {"max_hours": 1.5}},
        "idle_card_minutes": 30,
    }
    # Its last line says whether an MPS control daemon runs: none of another test's.
    with (
        held_across_suites(MPS_DAEMON, shared=True),
        machine(cpus=5, gpus=1, config=rules) as layout,
    ):
        where = metrics_address(layout)
        said = fluksio_nb(
            "machine", "status", "--prefix", str(layout.prefix), env=machine_env(layout)
        ).stdout.splitlines()
    assert said[0].startswith("books shared by every user of this machine")
    assert said[1:] == [
        f"one claim runs at most (max_hours in {layout.config}): alice 90 min, everyone else 8 h",
        "cards idle 30 min while another claim waits are given back, 5 min after a warning "
        f"(idle_card_minutes in {layout.config})",
        f"metrics for Prometheus at http://{where}/metrics",
        "card slices: compute shared by time (no MPS control daemon (nvidia-cuda-mps-control) "
        "runs here: the slices of a card take turns on all its cores)",
    ]


def test_the_jupyter_servers_metrics_need_its_token_and_count_its_users_endings(tmp_path):
    """Guards against metrics open to anyone who reaches the server, and against a server
    whose counters miss how its user's claims ended."""
    lab = JupyterLab(tmp_path / "lab").start()
    try:
        url = f"{lab.base_url}/fluksio/metrics"
        for token in (None, "not-the-token"):
            status, body = scrape(url, token)
            assert status == 401, body
            assert "fluksio_" not in body
        ran = subprocess.run(
            [
                sys.executable,
                "-c",
                "from fluksio_nb import claim\n"
                "from fluksio_nb.errors import ClaimTimeout\n"
                "import time\n"
                "try:\n"
                "    with claim(cpus=1, timeout=1, label='sleeps') as c:\n"
                "        c.run(time.sleep, 60)\n"
                "except ClaimTimeout:\n"
                "    print('timed out')\n",
            ],
            env=lab.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.stdout.strip() == "timed out", ran.stderr

        def timed_out() -> float | None:
            status, text = scrape(url, lab.token)
            assert status == 200, text
            user = re.search(r'fluksio_core_seconds_total\{user="([^"]+)"', text)
            if user is None:
                return None
            return value(text, "fluksio_claims_ended_total", user=user[1], ending="timed_out")

        assert wait_until(timed_out, 30)
        assert timed_out() == 1
        request = urllib.request.Request(url, headers={"Authorization": f"token {lab.token}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    finally:
        lab.stop()


def dashboard_queries() -> list[str]:
    """Every PromQL expression in the Grafana dashboard, its variables given values."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for inner in node.values():
                walk(inner)
        elif isinstance(node, list):
            for inner in node:
                walk(inner)

    walk(json.loads(DASHBOARD.read_text()))
    return [
        query.replace("$__rate_interval", "1m").replace("$__range", "1h").replace("$job", ".+")
        for query in found
    ]


def test_the_dashboard_asks_only_for_metrics_a_real_scrape_has(tmp_path, monkeypatch):
    """Guards against a dashboard whose panels stay empty because a metric it names was
    renamed or never served, or whose queries Prometheus refuses; and against card figures
    (utilisation, squatters' memory) the service never serves."""
    from tests.gpu_standins import StandInSmi, card

    smi = StandInSmi(tmp_path / "smi", [card(0, utilisation=37, used_mib=1024)])
    # Held by this test's process, which no claim sits above: a squatter's.
    smi.set_apps([{"uuid": smi.cards[0]["uuid"], "pid": os.getpid(), "used_mib": 512}])
    # The service started by init inherits this PATH, and finds the stand-in there.
    monkeypatch.setenv("PATH", smi.path_env())
    with machine(cpus=5, gpus=1, config={"metrics": "127.0.0.1:0"}) as layout:
        url = f"http://{metrics_address(layout)}/metrics"
        # One claim ended, for the counters, and one running, for the gauges.
        ended = "t0 = q.enqueue(Resources(cpus=1), label='ended')\nq.wait(t0)\nq.release(t0)\n"
        holder = process(layout, ended + HOLD.format(cpus=1, label="a-claim"))
        try:
            heard(holder)

            def with_cards() -> str | None:
                text = scrape(url)[1]
                return text if "fluksio_card_utilisation_ratio{" in text else None

            text = wait_until(with_cards, 30) and with_cards()
            assert text, scrape(url)[1]
            assert value(text, "fluksio_card_utilisation_ratio", card="0") == 0.37
            assert value(text, "fluksio_card_squatter_memory_bytes", card="0") == 512 * 2**20
            served = {name for name, _ in samples(text)}
            queries = dashboard_queries()
            assert len(queries) >= 10
            named = {name for query in queries for name in re.findall(r"fluksio_\w+", query)}
            assert named <= served, named - served
            jobs = [{"job_name": "service", "static_configs": [{"targets": [url[7:-8]]}]}]
            with prometheus(tmp_path / "prometheus", jobs) as server:
                assert wait_until(lambda: server.query("fluksio_machine_cores"), 60)
                for query in queries:
                    server.query(query)  # refused: an error, not a success
        finally:
            holder.kill()
            holder.wait()


def test_scrapers_that_never_finish_stall_no_claim_and_are_cut_off(tmp_path):
    """Guards against a metrics server that reads or writes on the loop that answers
    claims until a scraper is done: anyone who reaches the address could stop every
    user's claims by opening connections and sending nothing."""
    from fluksio_nb.machine.metrics_http import MOST_CONNECTIONS, MOST_REQUEST_BYTES

    with machine(cpus=5, gpus=1, config={"metrics": "127.0.0.1:0"}) as layout:
        host, _, port = metrics_address(layout).rpartition(":")
        silent = []
        try:
            for _ in range(MOST_CONNECTIONS):
                connection = socket.create_connection((host, int(port)), timeout=30)
                connection.sendall(b"GET /metr")
                silent.append(connection)
            # One past the most: closed at once, not queued behind the silent ones.
            one_more = socket.create_connection((host, int(port)), timeout=30)
            one_more.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            assert _closed_without_answer(one_more)
            # A claim is granted while every place is held by a scraper saying nothing.
            holder = process(layout, HOLD.format(cpus=1, label="granted-meanwhile"))
            try:
                assert heard(holder)["ticket"] >= 1
            finally:
                holder.kill()
                holder.wait()
        finally:
            for connection in silent:
                connection.close()
        # The places free again, a scrape is answered; and one that sends more than a
        # request is cut off, as is anything but GET /metrics answered no metrics.
        assert wait_until(lambda: scrape(f"http://{host}:{port}/metrics")[0] == 200, 30)
        flood = socket.create_connection((host, int(port)), timeout=30)
        with contextlib.suppress(ConnectionError):
            flood.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (2 * MOST_REQUEST_BYTES))
        assert _closed_without_answer(flood)
        assert scrape(f"http://{host}:{port}/claims")[0] == 404
        request = urllib.request.Request(f"http://{host}:{port}/metrics", method="POST", data=b"")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 405


def _closed_without_answer(connection: socket.socket) -> bool:
    """Whether the service closed ``connection`` having sent nothing."""
    with connection:
        try:
            return connection.recv(1024) == b""
        except ConnectionResetError:
            return True


def test_a_kernel_serves_and_counts_no_metrics(tmp_path):
    """Guards against metrics costing every kernel: the books service and the Jupyter server
    serve them, and a kernel making claims and reading its past runs (for expected waits)
    must not import Prometheus's client, nor add its records up for a tally."""
    from tests.kernels import Kernel

    kernel = Kernel(
        FLUKSIO_LEDGER=str(tmp_path / "ledger"),
        FLUKSIO_CPUS="2",
        FLUKSIO_GPUS="0",
        FLUKSIO_RESERVE_CPUS="0",
        FLUKSIO_CONFIG=str(tmp_path / "none.json"),
        JUPYTER_DATA_DIR=str(tmp_path / "data"),
    )
    try:
        ran = kernel.run(
            "from fluksio_nb import claim\n"
            "for _ in range(2):\n"
            "    with claim(cpus=1, label='twice') as c:\n"
            "        c.run(sum, [1, 2])\n"
            "from fluksio_nb.usage.recent import process_recent_usage\n"
            "runs = process_recent_usage().durations()\n"
            "import sys\n"
            "print(len(runs['twice']), sorted(m for m in sys.modules if 'prometheus' in m "
            "or m == 'fluksio_nb.metrics'))",
            check=True,
        )
    finally:
        kernel.shutdown()
    assert ran.stdout.strip() == "2 []", ran.stdout


def test_an_ending_outside_the_kernels_words_ends_the_connection_and_counts_nothing():
    """Guards against a release whose ending is anything a client likes: one user could make
    every admin's Prometheus store a series per word they send, or put a label's text into
    the metrics under the ending's name."""
    from fluksio_nb.machine import protocol

    with machine(cpus=5, gpus=1, config={"metrics": "127.0.0.1:0"}) as layout:
        url = f"http://{metrics_address(layout)}/metrics"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(layout.socket))
            sock.settimeout(30)
            read = sock.makefile("rb")
            sock.sendall(protocol.line({"op": "hello"}))
            assert json.loads(read.readline())["hears_endings"] is True
            need = {"cpus": 1, "gpus": 0, "ram_bytes": 0}
            sock.sendall(protocol.line({"op": "claim", "id": 1, "need": need, "label": "x"}))
            ticket = json.loads(read.readline())["ticket"]
            sock.sendall(
                protocol.line({"op": "release", "ticket": ticket, "ending": "pwned-by-a-client"})
            )
            # Refused, in a line that says why, and closed.
            assert b"bad request" in read.readline()
            assert read.readline() == b""
        text = scrape(url)[1]
        assert "pwned" not in text
        assert "fluksio_claims_ended_total{" not in text
        # Its share was freed with its connection, uncounted: it told no ending worth one.
        assert value(text, "fluksio_machine_cores_free") == value(text, "fluksio_machine_cores")
