"""What the server adds for the status bar and for ``%claims``, over real HTTP.

A real JupyterLab server (a subprocess, with this venv's extension) and a
real kernel it starts through a session, as a notebook's would be.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.lab import JupyterLab
from tests.kernels import run_in
from tests.test_server import call, kernel_of, snapshot, wait_for

pytestmark = pytest.mark.timeout(180)

#: Four cores, one of them kept back for the kernels: the books hand out three.
INVENTORY = {
    "FLUKSIO_CPUS": "4",
    "FLUKSIO_GPUS": "0",
    "FLUKSIO_RAM": "8G",
    "FLUKSIO_RESERVE_CPUS": "1",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    lab = JupyterLab(tmp_path_factory.mktemp("glance"), INVENTORY).start()
    yield lab
    lab.stop()


def history_points(server: JupyterLab) -> list[dict[str, Any]]:
    status, _, body = call(server, "GET", "fluksio/api/history")
    assert status == 200, body
    return body["points"]


def test_a_monitor_in_a_new_kernel_opens_with_the_servers_history(server):
    """Guards against ``%claims`` opening on an empty chart while the server has minutes of it.

    The server has kept points since it started; a kernel it starts after
    them must draw them in its first monitor, before that kernel could have
    taken a single point of its own.
    """
    wait_for(lambda: len(history_points(server)) >= 3, "three points of the server's history", 60)
    # Read here, before the kernel is asked for: its process's own start time
    # (psutil's, from boot time in whole seconds) was seen a second early.
    started = time.time()
    with kernel_of(server, "glance.ipynb") as (_, client):
        said = run_in(
            client,
            "import json\n"
            "%load_ext fluksio_nb\n"
            "from fluksio_nb.widget import MonitorWidget\n"
            "monitor = MonitorWidget()\n"
            "print(json.dumps([p['at'] for p in monitor.history]))",
        )
    ats = json.loads(said.strip().splitlines()[-1])
    before_the_kernel = [at for at in ats if at < started]
    assert len(before_the_kernel) >= 3, {"started": started, "ats": ats}
    assert ats == sorted(ats), "oldest first"


def with_the_kernel(server: JupyterLab, kernel_id: str) -> Any:
    def found() -> dict[str, Any] | None:
        found = snapshot(server)
        held = (found.get("kernel_memory") or {}).get(kernel_id)
        return found if found.get("host") and held and held > 80_000_000 else None

    return found


def test_the_snapshot_says_the_hosts_use_each_kernels_memory_and_the_cores_kept_back(server):
    """Guards against a status bar that can say only what is claimed: no memory, no CPU use,
    and a 4-core machine with one core kept back said as 3 cores with nothing about the fourth."""
    with kernel_of(server, "glance.ipynb") as (kernel_id, client):
        run_in(client, "block = bytearray(80_000_000)")
        found = wait_for(
            with_the_kernel(server, kernel_id), "the kernel's 80 MB in the snapshot", 60
        )

    assert found["cpus"]["total"] == 3
    assert found["cpus"]["kept_back"] == 1
    host = found["host"]
    assert 0 <= host["cpu_percent"] <= 100
    assert 0 < host["memory_used_bytes"] < host["memory_total_bytes"]
    assert abs(host["at"] - time.time()) < 60
    # Only this server's kernels, by id: nothing of anyone else's processes.
    assert set(found["kernel_memory"]) == {kernel_id}
