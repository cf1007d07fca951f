"""The server extension, over real HTTP, in a real Jupyter server.

Each test talks to a JupyterLab server started as a subprocess with this
venv's extensions enabled, the way JupyterLab's panel talks to it. The server
gets a declared inventory, its own books, and config and runtime directories
of its own. Claims are made by separate processes, as kernels make them.
On a machine set up for every user (``fluksio-nb machine init``), some of
those processes run as a real second Unix user, since the server must show
every user's claims and refuse to cancel another user's.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient

from tests.browser.lab import JupyterLab
from tests.kernels import run_in
from tests.machines import machine, machine_env
from tests.unix_users import USER_A, UnixUser, as_user, ready_user, require_unix_users, user_environ

pytestmark = pytest.mark.timeout(180)

INVENTORY = {
    "FLUKSIO_CPUS": "4",
    "FLUKSIO_GPUS": "2",
    "FLUKSIO_RAM": "8G",
    "FLUKSIO_RESERVE_CPUS": "0",
}

#: A process that makes one claim in the server's books and holds it until
#: its stdin closes. With "wait", it waits for the claim and says how that
#: ended, so a test can see what the claim's owner was told.
HOLDER = """
import json, sys
from fluksio_nb import Resources, accountant
queue = accountant()
ticket = queue.enqueue(Resources(**json.loads(sys.argv[1])), label=sys.argv[2])
print(json.dumps({"ticket": ticket.number, "state": ticket.state}), flush=True)
if sys.argv[3] == "wait":
    try:
        queue.wait(ticket, timeout=60)
        print("granted", flush=True)
    except Exception as error:
        print(f"{type(error).__name__}: {error}", flush=True)
sys.stdin.read()
"""


class Holder:
    def __init__(self, process: subprocess.Popen, ticket: int, state: str) -> None:
        self.process, self.ticket, self.state = process, ticket, state

    def told(self) -> str:
        """The next line the claim's owner printed: how its wait ended (it waits 60 s at most)."""
        return self.process.stdout.readline().strip()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    lab = JupyterLab(tmp_path_factory.mktemp("server"), INVENTORY).start()
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def machine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    """A server on books every user of the machine shares, and a second user to share them."""
    require_unix_users()
    with machine(cpus=4, gpus=2) as layout:
        home = tmp_path_factory.mktemp("machine-server")
        lab = JupyterLab(home, INVENTORY, FLUKSIO_LEDGER=str(layout.run_dir)).start()
        lab.second_user = ready_user(USER_A)
        yield lab
        lab.stop()


def holding(server: JupyterLab) -> Iterator[Callable[..., Holder]]:
    """``claims(label, gpus=1, user=a_unix_user, wait=True)``: a claim held by its own process."""
    started: list[subprocess.Popen] = []

    def make(label: str, user: UnixUser | None = None, wait: bool = False, **asked: Any) -> Holder:
        argv = [sys.executable, "-c", HOLDER, json.dumps(asked), label, "wait" if wait else "hold"]
        env = dict(server.env)
        if user is not None:
            argv = [*as_user(user), *argv]
            env = user_environ(user, machine_env_of(server))
        process = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/"
        )
        started.append(process)
        first = process.stdout.readline()
        assert first, f"the claim {label!r} could not be made (exit {process.wait()})"
        made = json.loads(first)
        return Holder(process, made["ticket"], made["state"])

    yield make
    for process in started:
        process.kill()
        process.wait()


def machine_env_of(server: JupyterLab) -> dict[str, str]:
    from fluksio_nb.machine.setup import Layout

    run_dir = Path(server.env["FLUKSIO_LEDGER"])
    return machine_env(Layout(run_dir.parent.parent))


@pytest.fixture
def claims(server: JupyterLab) -> Iterator[Callable[..., Holder]]:
    yield from holding(server)


@pytest.fixture
def machine_claims(machine_server: JupyterLab) -> Iterator[Callable[..., Holder]]:
    yield from holding(machine_server)


def call(
    server: JupyterLab, method: str, path: str, token: str | None = "", body: Any = None
) -> tuple[int, Any, Any]:
    """One request as a client makes it: status, headers, JSON body. ``token=None`` sends none."""
    headers = {} if token is None else {"Authorization": f"token {token or server.token}"}
    request = urllib.request.Request(
        f"{server.base_url}/{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers=headers,
    )
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            status, answer, text = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, answer, text = error.code, error.headers, error.read()
    return status, answer, json.loads(text) if text else None


def snapshot(server: JupyterLab) -> dict[str, Any]:
    status, _, body = call(server, "GET", "fluksio/api/snapshot")
    assert status == 200, body
    return body


def labels(claims: list[dict[str, Any]]) -> list[str]:
    return [claim["label"] for claim in claims]


def test_the_snapshot_shows_every_claim_on_the_machine_and_whose_it_is(server, claims):
    """Guards against a panel that shows one kernel's claims, or none, or the wrong machine."""
    claims("holds-both-cards", gpus=2)
    claims("wants-a-card", gpus=1)
    claims("also-mine", cpus=1)

    machine = snapshot(server)

    assert machine["ledger"] == server.env["FLUKSIO_LEDGER"]
    assert machine["books"] == "user"
    assert machine["cpus"] == {"total": 4, "free": 2, "free_ids": [], "kept_back": 0}
    assert machine["gpus"]["total"] == 2 and machine["gpus"]["free"] == 0
    assert machine["ram_bytes"]["total"] == 8_000_000_000
    assert labels(machine["running"]) == ["holds-both-cards", "also-mine"]
    assert labels(machine["waiting"]) == ["wants-a-card"]
    assert machine["waiting"][0]["position"] == 1
    assert machine["waiting"][0]["asked"]["gpus"] == 1
    both, _ = machine["running"]
    assert both["allocation"]["gpus"] == [0, 1]
    assert both["mine"] is True and both["user"] == machine["user"]


def test_on_the_machines_books_the_snapshot_shows_every_users_claims(
    machine_server, machine_claims
):
    """Guards against a panel that shows only its own user's claims on a shared machine,
    or that tells one user the name of another user's notebook work."""
    machine_claims("holds-both-cards", gpus=2)
    machine_claims("wants-a-card", gpus=1)
    machine_claims("their-secret-label", user=machine_server.second_user, cpus=1)

    machine = snapshot(machine_server)

    assert machine["books"] == "machine"
    assert machine["gpus"]["total"] == 2 and machine["gpus"]["free"] == 0
    assert labels(machine["waiting"]) == ["wants-a-card"]
    mine, theirs = machine["running"]
    assert mine["label"] == "holds-both-cards" and mine["allocation"]["gpus"] == [0, 1]
    assert mine["mine"] is True and mine["user"] == machine["user"]
    assert theirs["mine"] is False and theirs["user"] == USER_A
    assert theirs["label"] is None and theirs["allocation"]["cpus"] == 1


def test_without_the_token_the_api_answers_401_and_does_nothing(server, claims):
    """Guards against an open API, and against the 403 that a client reads as 'not allowed'."""
    claims("holder", gpus=2)
    waiting = claims("stays-waiting", gpus=1)

    for token in (None, "not-the-token"):
        status, headers, body = call(server, "GET", "fluksio/api/snapshot", token=token)
        assert status == 401, body
        assert "token" in body["message"]
        assert headers.get("WWW-Authenticate") == "token"
        status, _, body = call(
            server, "POST", f"fluksio/api/claims/{waiting.ticket}/cancel", token=token
        )
        assert status == 401, body

    assert waiting.ticket in [c["ticket"] for c in snapshot(server)["waiting"]]


def test_cancelling_a_waiting_claim_takes_it_out_of_the_queue_and_tells_its_owner(server, claims):
    """Guards against a cancel button that leaves the claim queued, or its cell waiting forever."""
    claims("holder", gpus=2)
    waiting = claims("to-cancel", gpus=1, wait=True)
    assert waiting.state == "waiting"

    status, _, body = call(server, "POST", f"fluksio/api/claims/{waiting.ticket}/cancel")

    assert status == 200, body
    assert body == {"ticket": waiting.ticket, "cancelled": True}
    assert snapshot(server)["waiting"] == []
    told = waiting.told()
    assert told.startswith("ClaimCancelled"), told
    assert "from JupyterLab" in told


def test_another_users_claim_cannot_be_cancelled(machine_server, machine_claims):
    """Guards against one user on a shared machine stopping another user's work."""
    machine_claims("holder", gpus=2)
    theirs = machine_claims("their-turn", user=machine_server.second_user, gpus=1, wait=True)

    status, _, body = call(machine_server, "POST", f"fluksio/api/claims/{theirs.ticket}/cancel")

    assert status == 403, body
    assert USER_A in body["message"]
    waiting = snapshot(machine_server)["waiting"]
    assert [(c["ticket"], c["user"], c["mine"]) for c in waiting] == [
        (theirs.ticket, USER_A, False)
    ]


def test_an_unknown_claim_is_404_with_a_way_forward(server):
    """Guards against a cancel of a claim that already ended looking like it worked."""
    status, _, body = call(server, "POST", "fluksio/api/claims/987654/cancel")

    assert status == 404, body
    assert "987654" in body["message"] and "snapshot" in body["message"]


def test_a_claim_number_of_thousands_of_digits_is_404_not_a_crash(server):
    """Guards against a number Python refuses to parse answering 500."""
    status, _, body = call(server, "POST", f"fluksio/api/claims/{'9' * 5000}/cancel")

    assert status == 404, body


def past_runs(server: JupyterLab, label: str, ran_s: list[float], **fields: Any) -> None:
    """Usage records of claims that ended, written where the server's user's records go."""
    from fluksio_nb.usage import UsageLog, UsageRecord

    log = UsageLog(Path(server.env["JUPYTER_DATA_DIR"]) / "fluksio" / "usage")
    now = time.time()
    for back, ran in enumerate(ran_s):
        ended = now - 3600 + back
        record = {
            "label": label,
            "asked_at": ended - ran - 5,
            "granted_at": ended - ran,
            "ended_at": ended,
            "ending": "ok",
            "cpus": 1,
            "peak_rss_bytes": 1000,
            **fields,
        }
        log.write(UsageRecord(**record))
    log.close()


def test_the_history_holds_the_machines_cpu_and_memory_used_and_total(server):
    """Guards against a history that never fills, or says free where the panel says used."""

    def two_points() -> list[dict[str, Any]] | None:
        status, _, body = call(server, "GET", "fluksio/api/history")
        assert status == 200, body
        points = body["points"]
        # While a claim another test held is still taken for alive, and has no
        # reading, what the claims use is unknown; once it has gone, it is known.
        known = points and points[-1]["cpu_outside_claims_percent"] is not None
        return points if len(points) >= 2 and known else None

    points = wait_for(two_points, "two points of the machine's history, the last one whole", 60)
    _, _, body = call(server, "GET", "fluksio/api/history")
    assert body["span_s"] == 600 and body["interval_s"] > 0
    first, second = points[:2]
    assert first["at"] < second["at"], "oldest first"
    for point in points:
        assert 0 <= point["cpu_percent"] <= 100
        total = point["memory_total_bytes"]
        assert 0 < point["memory_used_bytes"] <= total
        outside = point["cpu_outside_claims_percent"]
        assert outside is None or outside <= point["cpu_percent"]
        # No card is read here (no driver): a card nobody read is left out.
        assert point["cards"] == []
    status, _, _ = call(server, "GET", "fluksio/api/history", token=None)
    assert status == 401


def test_the_finished_claims_are_the_last_20_newest_first_with_their_peaks(server):
    """Guards against a panel that forgets a claim the moment it ends."""
    past_runs(server, "finished-batch", [float(n) for n in range(25)], peak_gpu_bytes=None)
    # Ended now: the newest, whatever records the module's earlier tests left
    # (a claim process they killed is recorded by whoever reaps it).
    never = time.time()
    from fluksio_nb.usage import UsageLog, UsageRecord

    log = UsageLog(Path(server.env["JUPYTER_DATA_DIR"]) / "fluksio" / "usage")
    log.write(
        UsageRecord(
            label="gave-up-waiting",
            ticket=41,
            notebook="work/queue.ipynb",
            asked_at=never - 30,
            ended_at=never,
            ending="cancelled",
        )
    )
    log.close()

    status, _, body = call(server, "GET", "fluksio/api/finished")

    assert status == 200, body
    claims = body["claims"]
    assert len(claims) == 20
    ended = [claim["ended_at"] for claim in claims]
    assert ended == sorted(ended, reverse=True), "newest first"
    cancelled = claims[0]
    assert cancelled["label"] == "gave-up-waiting" and cancelled["ticket"] == 41
    assert cancelled["ending"] == "cancelled" and cancelled["notebook"] == "work/queue.ipynb"
    assert cancelled["started_at"] is None and cancelled["ran_s"] is None
    assert cancelled["peak_rss_bytes"] is None, "a claim that never ran has no peak, not 0"
    assert cancelled["waited_s"] == pytest.approx(30, abs=0.01)
    ran = next(claim for claim in claims if claim["label"] == "finished-batch")
    assert ran["ending"] == "ok"
    assert ran["ran_s"] == pytest.approx(24) and ran["peak_rss_bytes"] == 1000
    assert ran["ticket"] is None, "a record from before tickets were kept still reads"
    assert ran["user"] == snapshot(server)["user"]
    assert call(server, "GET", "fluksio/api/finished", token=None)[0] == 401


def test_a_waiting_claim_has_its_place_an_expected_wait_and_its_notebook(server, claims):
    """Guards against a queue that says nothing of how long, or guesses where it cannot."""
    past_runs(server, "fit-run", [500.0, 600.0, 700.0])
    before = time.time()
    claims("fit-run", gpus=2)
    next_fit = claims("fit-run", gpus=1)
    claims("never-seen-before", gpus=1)

    machine = snapshot(server)
    # The running claim's age as the server read it, at most: a loaded machine
    # takes seconds over the claims above.
    age = time.time() - before + 1

    first, second = machine["waiting"]
    assert (first["ticket"], first["position"]) == (next_fit.ticket, 1)
    assert second["position"] == 2
    guess = first["expected_wait"]
    # The running fit-run typically holds its share 600 s, and has only just started.
    assert 600 - age <= guess["seconds"] <= 600, (guess, age)
    assert guess["why"] == "from 3 past runs of 'fit-run' and the running claims' ages"
    # Never seen before, it still learns when it starts: after the next fit-run's 600 s.
    guess = second["expected_wait"]
    assert 1200 - age <= guess["seconds"] <= 1200, (guess, age)
    assert guess["why"] == "from 3 past runs of 'fit-run' and the running claims' ages"
    for claim in machine["waiting"] + machine["running"]:
        assert claim["notebook"] is None, "a claim made outside Jupyter names no notebook"


@contextlib.contextmanager
def kernel_of(server: JupyterLab, path: str) -> Iterator[tuple[str, BlockingKernelClient]]:
    """A kernel the server started for the notebook at ``path``, and a client of it."""
    server.write_notebook(path, [])
    status, _, session = call(
        server,
        "POST",
        "api/sessions",
        body={
            "path": path,
            "name": Path(path).name,
            "type": "notebook",
            "kernel": {"name": "python3"},
        },
    )
    assert status == 201, session
    kernel_id = session["kernel"]["id"]
    client = BlockingKernelClient(
        connection_file=str(Path(server.env["JUPYTER_RUNTIME_DIR"]) / f"kernel-{kernel_id}.json")
    )
    client.load_connection_file()
    # No heartbeat: on a loaded machine a kernel still starting misses its first beats
    # (1 s each), and the client takes it for dead. A dead kernel still fails the wait.
    client.start_channels(hb=False)
    try:
        client.wait_for_ready(timeout=60)
        yield kernel_id, client
    finally:
        client.stop_channels()
        call(server, "DELETE", f"api/sessions/{session['id']}")


def wait_for(
    find: Callable[[], Any],
    what: str,
    timeout: float = 20,
    until: Callable[[Any], bool] = bool,
) -> Any:
    """``find()`` once ``until`` holds of it; if it never does, says ``what`` and the last look."""
    deadline = time.monotonic() + timeout
    found = None
    while time.monotonic() < deadline:
        found = find()
        if until(found):
            return found
        time.sleep(0.25)
    raise AssertionError(f"{what} did not happen within {timeout} s; the last look found {found!r}")


def test_a_notebooks_claim_shows_its_notebook_path_readings_and_can_be_stopped(server):
    """Guards against a panel that cannot say which notebook holds a card, or cannot stop it."""
    (server.root / "work").mkdir(exist_ok=True)
    with kernel_of(server, "work/train.ipynb") as (kernel_id, client):
        run_in(client, "%load_ext fluksio_nb")
        run_in(
            client,
            "%%claim cpus=1 gpus=1 --background --label in-a-notebook\n"
            "import time\nblock = bytearray(50_000_000)\ntime.sleep(60)",
        )

        def the_claim() -> dict[str, Any] | None:
            running = snapshot(server)["running"]
            return next((c for c in running if c["label"] == "in-a-notebook"), None)

        def holding_the_block() -> dict[str, Any] | None:
            # The first reading may come before the cell has allocated its block.
            claim = the_claim()
            readings = claim and claim["readings"]
            return claim if readings and readings["rss_bytes"] > 50_000_000 else None

        claim = wait_for(holding_the_block, "readings of the worker holding its 50 MB")
        assert claim["path"] == "work/train.ipynb"
        assert claim["kernel_id"] == kernel_id
        assert claim["notebook"].endswith("work/train.ipynb")
        assert claim["allocation"]["gpus"] in ([0], [1])

        status, _, body = call(server, "POST", f"fluksio/api/claims/{claim['ticket']}/cancel")
        assert status == 200, body
        wait_for(lambda: the_claim() is None, "the stopped claim leaving the books")
        ended = run_in(
            client,
            "job = _\ntry:\n    job.result(30)\nexcept Exception as error:\n"
            "    print(job.status, type(error).__name__, error)",
        )
        assert "from JupyterLab" in ended, ended


AUTHORIZER = """
from jupyter_server.auth import Authorizer

class ReadOnlyFluksio(Authorizer):
    def is_authorized(self, handler, user, action, resource):
        return not (resource == "fluksio" and action == "write")
"""


def test_the_servers_authorizer_decides_who_may_cancel(tmp_path):
    """Guards against handlers that skip the authorizer a JupyterHub deployment configures."""
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "read_only_fluksio.py").write_text(AUTHORIZER)
    lab = JupyterLab(tmp_path / "lab", INVENTORY, PYTHONPATH=str(tmp_path / "modules"))
    (Path(lab.env["JUPYTER_CONFIG_DIR"]) / "jupyter_server_config.json").write_text(
        json.dumps({"ServerApp": {"authorizer_class": "read_only_fluksio.ReadOnlyFluksio"}})
    )
    lab.start()
    try:
        assert call(lab, "GET", "fluksio/api/snapshot")[0] == 200
        status, _, body = call(lab, "POST", "fluksio/api/claims/1/cancel")
        assert status == 403, body
        assert "write on resource: fluksio" in body["message"]
    finally:
        lab.stop()
