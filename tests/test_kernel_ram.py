"""An unclaimed kernel held to the admin's ``kernel_ram``, its claims not.

A real books service set up by ``fluksio-nb machine init`` under a temporary
prefix, with ``"kernel_ram"`` in its ``machine.json``; a real JupyterLab on
those books starts a notebook's kernel through the package's provisioner,
as a user's server does. What is checked is read where it happens: the
kernel's own ``/proc/self/cgroup``, the snapshot the panel polls, the cgroup
directories left on the machine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient

from fluksio_nb.machine.prefix import MachineSetupError
from fluksio_nb.machine.setup import Layout, read_config
from fluksio_nb.memory_cap import find_cap_place
from tests.browser.lab import JupyterLab
from tests.kernels import run_in
from tests.machines import fluksio_nb, machine, machine_env, wait_until

pytestmark = pytest.mark.timeout(240)

#: What a kernel's kernel_ram cgroup is called: made by the server (its pid first).
KERNEL_NAME = re.compile(r"^fluksio_nb-kernel-(\d+)-\d+-\d+$")

#: Small enough to pass in a test, big enough for a kernel with numpy and fluksio_nb.
KERNEL_RAM = "300M"

#: Touches every page: a zero-filled bytearray may be mapped and never charged.
#: No name is left to send back: the kernel holds the claim's results, and 700 MB of them
#: would be over its own cap.
PAST_THE_CAP = "print('held', len(b'x' * (700 * 10**6)))\n"


@pytest.fixture(scope="module")
def place():
    found = find_cap_place()
    if not found.available:
        pytest.skip(f"needs a child memory cgroup, which cannot be made here: {found.why_not}")
    return found


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, place) -> Iterator[JupyterLab]:
    with machine(cpus=2, gpus=0, config={"kernel_ram": KERNEL_RAM}) as layout:
        server = JupyterLab(
            tmp_path_factory.mktemp("kernel-ram"), FLUKSIO_LEDGER=str(layout.run_dir)
        )
        server.start()
        server.layout = layout
        try:
            yield server
        finally:
            server.stop()


def kernel_cgroups(place, server: JupyterLab) -> list[str]:
    """The kernel_ram cgroups this test's server made: only its own, as other runs share the
    parent."""
    assert server.process is not None
    if not place.parent.exists():
        return []
    return [
        entry.name
        for entry in place.parent.iterdir()
        if (match := KERNEL_NAME.match(entry.name)) and int(match[1]) == server.process.pid
    ]


def open_notebook(lab: JupyterLab, path: str) -> tuple[dict[str, Any], BlockingKernelClient]:
    """A session for the notebook ``path``, as JupyterLab opens one, and a client of its kernel."""
    session = lab.api(
        "POST", "api/sessions", {"path": path, "type": "notebook", "kernel": {"name": "python3"}}
    )
    client = connect(lab, session["kernel"]["id"])
    assert client is not None, "the kernel did not answer"
    return session, client


def connect(lab: JupyterLab, kernel_id: str, within: float = 60) -> BlockingKernelClient | None:
    """A client of the server's kernel ``kernel_id``, once it answers; None if not ``within``."""
    runtime = Path(lab.env["JUPYTER_RUNTIME_DIR"])
    client = BlockingKernelClient(connection_file=str(runtime / f"kernel-{kernel_id}.json"))
    client.load_connection_file()
    client.start_channels(hb=False)
    try:
        client.wait_for_ready(timeout=within)
    except RuntimeError:
        client.stop_channels()
        return None
    return client


def memory_cgroup_of_the_kernel(client: BlockingKernelClient) -> str:
    out = run_in(client, "print(open('/proc/self/cgroup').read())")
    lines = [line for line in out.splitlines() if line.split(":")[1:2] in (["memory"], [""])]
    return lines[0].rsplit("/", 1)[-1]


def test_a_kernel_past_its_kernel_ram_is_stopped_by_the_os_and_told_why(lab, place):
    """Guards against an unclaimed kernel whose ``read_csv`` of a big file has no limit but the
    machine's (the OOM killer then may pick anyone's claim), and against a stop that says
    only "kernel died", leaving the person to guess why and what to do."""
    session, client = open_notebook(lab, "big.ipynb")
    kernel_id = session["kernel"]["id"]
    try:
        assert KERNEL_NAME.match(memory_cgroup_of_the_kernel(client)), (
            "the kernel runs outside a kernel_ram cgroup"
        )
        client.execute(PAST_THE_CAP)

        def stopped() -> dict[str, Any] | None:
            stops = lab.api("GET", "fluksio/api/snapshot")["kernel_stops"]
            return next((s for s in stops if s["kernel_id"] == kernel_id), None)

        stop = wait_until(stopped, timeout=60, what="the kernel's stop in the snapshot")
        assert stop["path"] == "big.ipynb"
        assert stop["kernel_ram"] == 300 * 10**6
        assert "stopped by the OS" in stop["why"]
        assert f"kernel_ram={KERNEL_RAM}" in stop["why"]
        assert "%%claim ram=" in stop["why"]
        assert f"kernel_ram={KERNEL_RAM}" in lab.log(), "the server's log does not say why"
        # Restarted by the server, as a dead kernel is, on new ports (a shutdown
        # while it restarts is refused by jupyter_server), and held again.
        client.stop_channels()
        client = wait_until(
            lambda: connect(lab, kernel_id, within=5),
            timeout=90,
            what="the stopped kernel restarted, answering",
        )
        assert KERNEL_NAME.match(memory_cgroup_of_the_kernel(client))
    finally:
        client.stop_channels()
        lab.api("DELETE", f"api/sessions/{session['id']}")
    # The stopped kernel's cgroup, and its restarted successor's, are gone with it.
    wait_until(
        lambda: kernel_cgroups(place, lab) == [],
        what="no kernel_ram cgroup left once the kernel ended",
    )


def test_a_claimed_worker_may_use_more_than_its_kernels_kernel_ram(lab, place):
    """Guards against a claim counted under the kernel's cap: a cell claimed with ``ram=`` (or
    with none) past the kernel's share would be stopped, and take the kernel with it."""
    session, client = open_notebook(lab, "claims.ipynb")
    kernel_id = session["kernel"]["id"]
    try:
        assert KERNEL_NAME.match(memory_cgroup_of_the_kernel(client))
        run_in(client, "%load_ext fluksio_nb")
        for line in ("%%claim ram=2G --timeout 60", "%%claim cpus=1 --timeout 60"):
            out = run_in(client, f"{line}\n{PAST_THE_CAP}")
            assert f"held {700 * 10**6}" in out, (line, out)
        assert run_in(client, "print(6 * 7)").strip() == "42", "the kernel died"
        stops = lab.api("GET", "fluksio/api/snapshot")["kernel_stops"]
        assert all(stop["kernel_id"] != kernel_id for stop in stops), stops
    finally:
        client.stop_channels()
        lab.api("DELETE", f"api/sessions/{session['id']}")
    wait_until(
        lambda: kernel_cgroups(place, lab) == [],
        what="no kernel_ram cgroup left once the kernel ended",
    )


def test_machine_status_says_the_kernels_cap_and_where_it_is_set(lab):
    """Guards against a cap the admin cannot see in force, nor find again to change it."""
    said = fluksio_nb(
        "machine", "status", "--prefix", str(lab.layout.prefix), env=machine_env(lab.layout)
    ).stdout
    assert "at most 300.0MB outside its claims" in said, said
    assert f"kernel_ram in {lab.layout.config}" in said, said


@pytest.mark.parametrize("said", ["1K", "-5G", "lots"])
def test_a_kernel_ram_a_kernel_cannot_start_in_is_refused_saying_what_to_write(tmp_path, said):
    """Guards against a typo in machine.json that stops every kernel of every user at launch."""
    layout = Layout(tmp_path)
    layout.config.parent.mkdir(parents=True)
    layout.config.write_text(json.dumps({"kernel_ram": said}))
    with pytest.raises(MachineSetupError, match="kernel_ram"):
        read_config(layout)
    layout.config.write_text(json.dumps({"kernel_ram": "8G"}))
    assert read_config(layout).kernel_ram == 8 * 10**9
