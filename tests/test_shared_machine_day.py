"""A day on a machine a team shares: the admin's commands and users' kernels as things go wrong.

The service restarts under idle kernels, dies, is taken down; the admin runs
``init`` again, or with a typo. Each test runs the real ``fluksio-nb machine``
commands as root and real kernels as real users (``useradd``, ``setpriv``),
and reads what a person there would read: the cell's error, the terminal's
lines. CI runs as root; elsewhere the tests skip and say what is missing.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess

import pytest

from fluksio_nb.identity import process_started
from fluksio_nb.machine.setup import Layout
from tests.kernels import Kernel
from tests.machines import fluksio_nb, kernels_on_books, machine, machine_env, wait_until
from tests.unix_users import USER_A, USER_B, ready_user, run_as, shared_tmp_dir

pytestmark = pytest.mark.timeout(240)

#: The admins' group, as tests/test_machine_users.py makes it.
ADMINS = "fluksio-test-admins"


@pytest.fixture
def alice():
    return ready_user(USER_A)


@pytest.fixture
def kernels():
    with kernels_on_books() as start:
        yield start


def claim_once(kernel: Kernel):
    return kernel.run("%%claim cpus=1 --timeout 30\nx = 41 + 1")


def restart(layout: Layout) -> None:
    """``init`` run again, as an admin restarts the service, and the new one answering."""
    first = int(layout.pidfile.read_text())
    fluksio_nb("machine", "init", "--prefix", str(layout.prefix))
    assert int(layout.pidfile.read_text()) != first


def kill_the_service(layout: Layout) -> None:
    pid = int(layout.pidfile.read_text())
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: process_started(pid) is None, what="the service's end")


def test_a_kernel_idle_through_restarts_claims_again_afterwards(alice, kernels):
    """Guards against a kernel that held nothing while the admin restarted the
    service (twice, as one does after two edits to machine.json) failing every later
    claim with a BrokenPipeError until the kernel itself was restarted: nobody
    watched its connection, and a send on the dead one never replaced it."""
    with machine(cpus=2, gpus=0) as layout:
        a = kernels(alice, layout)
        assert claim_once(a).status == "ok"
        restart(layout)
        restart(layout)
        for _ in range(2):
            ran = claim_once(a)
            assert ran.status == "ok", ran.so_far()
        assert a.facts("x") == 42


def test_a_claim_while_the_service_is_down_says_what_to_do_and_the_next_runs_once_it_is_back(
    alice, kernels
):
    """Guards against a claim on a machine whose service died failing with a bare
    "went away" (or a broken pipe), which says neither what is wrong nor who can mend
    it, and against the kernel staying broken once the admin has restarted it."""
    with machine(cpus=2, gpus=0) as layout:
        a = kernels(alice, layout)
        assert claim_once(a).status == "ok"
        kill_the_service(layout)
        down = claim_once(a)
        assert down.error is not None, down.so_far()
        assert down.error["ename"] == "ServiceUnavailable"
        said = down.error["evalue"]
        assert "does not answer" in said and "fluksio-nb machine init" in said, said
        fluksio_nb("machine", "init", "--prefix", str(layout.prefix))
        back = claim_once(a)
        assert back.status == "ok", back.so_far()


def test_usage_while_the_service_is_down_reads_the_machines_records_and_says_why(alice, kernels):
    """Guards against `fluksio-nb usage` printing "No claims recorded." on a machine
    whose service died, the records there on disk all the while, under a Python
    warning's file-and-line prefix: the records directory was only asked of the service."""
    with machine(cpus=2, gpus=0) as layout:
        a = kernels(alice, layout)
        assert claim_once(a).status == "ok"
        a.shutdown()
        kill_the_service(layout)
        usage = "import sys; from fluksio_nb.__main__ import main; sys.exit(main(['usage']))"
        ran = run_as(alice, usage, env=machine_env(layout))
        assert ran.returncode == 0, ran.stderr
        assert "No claims recorded" not in ran.stdout, ran.stdout
        assert "1 ok" in ran.stdout, ran.stdout
        assert ran.stderr.startswith("fluksio-nb usage: the machine's books service does not")
        assert f"were read from {layout.records}" in ran.stderr, ran.stderr
        assert "Warning" not in ran.stderr, ran.stderr


def test_a_background_claim_is_stopped_by_its_user_while_the_service_is_down(alice, kernels):
    """Guards against `job.cancel()` raising ServiceUnavailable while the job ran on,
    on cores nobody counts any more, once the books service died or was taken down:
    the user could not end their own work short of restarting the kernel."""
    with machine(cpus=2, gpus=0) as layout:
        a = kernels(alice, layout)
        a.start_job("%%claim cpus=1 --background\nimport time\ntime.sleep(600)", "job")
        wait_until(lambda: a.facts("job.status") == "running", what="the job running")
        kill_the_service(layout)
        assert a.facts("job.cancel()") is True
        wait_until(lambda: a.facts("job.done()"), what="the job's end")
        assert a.facts("job.status") == "cancelled"


def test_a_kernel_running_through_remove_is_told_to_restart_for_books_of_its_own(alice, kernels):
    """Guards against a kernel whose machine books were removed being told to ask the
    admin to restart a service that no longer exists, when what it needs is a restart
    of its own to keep books of its own."""
    with machine(cpus=2, gpus=0) as layout:
        a = kernels(alice, layout)
        assert claim_once(a).status == "ok"
        removed = fluksio_nb("machine", "remove", "--prefix", str(layout.prefix))
        assert "from their next claim" not in removed.stdout
        after = claim_once(a)
        assert after.error is not None, after.so_far()
        said = after.error["evalue"]
        assert "machine remove" in said and "restart this kernel" in said, said
        assert "fluksio-nb machine init" not in said


def test_machine_status_says_when_the_service_does_not_answer(alice):
    """Guards against `fluksio-nb machine status`, where a user is sent when a claim
    fails, saying the books are served while nothing answers, and exiting 0."""
    with machine(cpus=2, gpus=0) as layout:
        status = (
            "import sys; from fluksio_nb.__main__ import main; "
            "sys.exit(main(['machine', 'status']))"
        )
        up = run_as(alice, status, env=machine_env(layout))
        assert up.returncode == 0, up.stderr
        assert "does not answer" not in up.stdout
        kill_the_service(layout)
        down = run_as(alice, status, env=machine_env(layout))
        assert down.returncode == 1, down.stdout + down.stderr
        assert "does not answer" in down.stdout and "fluksio-nb machine init" in down.stdout


def test_init_run_again_without_its_flags_keeps_who_may_use_the_books():
    """Guards against an admin's restart (init run again, flags not repeated) dropping
    --group and --admin-group from machine.json: the books opened to every user, and
    the admins no longer able to cancel anyone's claim."""
    bob = ready_user(USER_B)
    subprocess.run(["groupadd", "-f", ADMINS], check=True)
    with shared_tmp_dir("fluksio-machine-") as prefix:
        layout = Layout(prefix)
        try:
            fluksio_nb(
                "machine", "init", "--prefix", str(prefix), "--group", USER_A,
                "--admin-group", ADMINS,
            )  # fmt: skip
            fluksio_nb("machine", "init", "--prefix", str(prefix))
            config = json.loads(layout.config.read_text())
            assert (config.get("group"), config.get("admin_group")) == (USER_A, ADMINS)
            assert stat.S_IMODE(layout.records.stat().st_mode) == 0o1770
            outsider = run_as(
                bob,
                "from fluksio_nb.machine.connection import read_snapshot; "
                f"read_snapshot(__import__('pathlib').Path({str(layout.socket)!r}))",
            )
            assert outsider.returncode != 0, "a user outside --group reached the books"
        finally:
            fluksio_nb("machine", "remove", "--prefix", str(prefix), check=False)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--ram", "lots"], "--ram lots"),
        (["--cpus", "0"], "--cpus 0"),
        (["--gpus", "-1"], "--gpus -1"),
    ],
)
def test_init_with_a_bad_flag_names_it_in_one_line_and_changes_nothing(flags, said):
    """Guards against a typo in init's flags ending in a pydantic traceback, with
    nothing to say which flag was wrong or whether anything was changed."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root: `fluksio-nb machine init` runs as root (uid {os.geteuid()})")
    with shared_tmp_dir("fluksio-machine-") as prefix:
        ran = fluksio_nb("machine", "init", "--prefix", str(prefix), *flags, check=False)
        assert ran.returncode == 2
        assert "Traceback" not in ran.stderr
        assert ran.stderr.startswith(f"fluksio-nb machine init: {said}: "), ran.stderr
        assert "Nothing was changed" in ran.stderr
        assert list(prefix.iterdir()) == []
