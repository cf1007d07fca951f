"""Kernels run as real second Unix users: the fixture the multi-user tests stand on.

Each test here pins one thing the tests of books and transfers across users
take for granted: a kernel started as another user really is that user, in
the kernel and in its workers, whatever its environment claims, and it can be
interrupted and shut down by the test that started it, as root. They need
root and ``useradd``/``setpriv``, and skip saying which is missing.
"""

import os
from pathlib import Path

import psutil
import pytest

from tests.kernels import started_kernel
from tests.unix_users import USER_A, ready_user
from tests.waiting import gone

pytestmark = pytest.mark.timeout(180)

INVENTORY = {"FLUKSIO_CPUS": "2", "FLUKSIO_RESERVE_CPUS": "0", "FLUKSIO_LEDGER": "kernel"}


@pytest.fixture(scope="module")
def user_a():
    return ready_user(USER_A)


@pytest.fixture(scope="module")
def kernel(user_a):
    with started_kernel(user=user_a, **INVENTORY) as k:
        yield k


def test_a_kernel_started_as_another_user_runs_as_that_user(kernel, user_a):
    """Guards against the kernel of a multi-user test quietly running as root.

    The kernel was started with ``%load_ext fluksio_nb``, so the extension
    loaded as that user too.
    """
    ids = kernel.facts("[__import__('os').getuid(), __import__('os').geteuid()]")
    assert ids == [user_a.uid, user_a.uid]
    assert psutil.Process(kernel.pid).uids().effective == user_a.uid
    assert kernel.facts("'fluksio_nb' in get_ipython().extension_manager.loaded")


def test_a_claimed_cell_of_another_users_kernel_runs_as_that_user(kernel, user_a):
    """Guards against a worker being started as anyone but its kernel's user."""
    ran = kernel.run("%%claim cpus=1\nimport json, os\nprint(json.dumps(os.geteuid()))", check=True)
    assert ran.json() == user_a.uid


def test_user_root_in_the_environment_does_not_make_the_kernel_root(user_a):
    """Guards against a test of "who am I" passing because the fixture read $USER.

    Who a process is comes from its uid; ``USER=root`` is only a string an
    attacker can set.
    """
    with started_kernel(user=user_a, USER="root", **INVENTORY) as k:
        seen = k.facts(
            "[__import__('os').environ['USER'], "
            "__import__('pwd').getpwuid(__import__('os').geteuid()).pw_name]"
        )
    assert seen == ["root", user_a.name]


def test_another_users_kernel_stops_on_interrupt_and_still_answers(kernel):
    """Guards against the stop button not reaching a kernel that is not root's."""
    msg_id = kernel.client.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(120)")
    kernel.wait_for_output(msg_id, "sleeping")
    kernel.interrupt()
    assert kernel.error_when_idle(msg_id) == "KeyboardInterrupt"
    assert kernel.facts("6 * 7") == 42


def test_shutting_down_another_users_kernel_ends_its_processes_and_removes_its_files(user_a):
    """Guards against a multi-user test leaving the user's kernel, worker or files behind."""
    with started_kernel(user=user_a, **INVENTORY) as k:
        own_dir = k.own_dir
        k.run("%%claim cpus=1\nx = 1", check=True)
        processes = [k.pid, *(p.pid for p in psutil.Process(k.pid).children(recursive=True))]
        assert len(processes) >= 2, "no worker to watch: the claimed cell left none warm"
    assert all(gone(pid, within=30) for pid in processes)
    assert own_dir is not None and not Path(own_dir).exists()
    assert not os.path.exists(k.manager.connection_file)
