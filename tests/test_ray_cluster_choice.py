"""Plain ``--on ray`` joins a cluster ``ray start`` named only if it is the user's own.

``ray start`` writes its cluster's address to ``ray_current_cluster`` in Ray's
directory under ``/tmp``, which any user may write to, and ``ray.init()``
with no address joins whatever that file names. A cell run on another
user's cluster runs as them, and what comes back is unpickled in the
kernel: their code, run as the notebook's user. The failures guarded
against: joining a cluster another user listens for, hanging or following
a link on a file planted there, and refusing the user's own cluster.

Ray's directory is pointed at the test's own (``RAY_TMPDIR``); the owner
of a listening socket is what the OS says, for a real second user.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from fluksio_nb.ray.connection import OthersRayCluster, address_to_join
from tests.stops import said_by
from tests.unix_users import USER_B, as_user, ready_user, require_unix_users, user_environ

LISTEN = (
    "import socket, sys\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.1', 0))\n"
    "s.listen()\n"
    "print(s.getsockname()[1], flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def ray_dir(tmp_path, monkeypatch):
    """Ray's directory for this test, where ``ray start`` names its cluster."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray"


def test_a_cluster_another_user_listens_for_is_not_joined_and_the_warning_says_whose(ray_dir):
    require_unix_users()
    bob = ready_user(USER_B)
    listener = subprocess.Popen(
        [*as_user(bob), sys.executable, "-c", LISTEN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=user_environ(bob),
        cwd="/",
    )
    try:
        port = int(listener.stdout.readline())
        (ray_dir / "ray_current_cluster").write_text(f"127.0.0.1:{port}\n")
        with pytest.warns(OthersRayCluster) as told:
            assert address_to_join() == "local"
        # Warned once; whatever else a loaded machine warned of meanwhile is not ours.
        (warning,) = [each for each in told if each.category is OthersRayCluster]
        assert f"127.0.0.1:{port}, run by uid {bob.uid}, not by you" in str(warning.message)
        assert "--on ray://host:port" in str(warning.message)
    finally:
        listener.stdin.close()
        listener.wait(30)


def test_a_cluster_of_my_own_that_ray_start_named_is_joined(ray_dir):
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen()
        address = f"127.0.0.1:{mine.getsockname()[1]}"
        (ray_dir / "ray_current_cluster").write_text(address + "\n")
        assert address_to_join() == address


def test_a_cluster_nobody_listens_for_any_more_is_not_joined(ray_dir):
    """Guards against a dead cluster's port, free for anyone to take, being trusted."""
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]
    (ray_dir / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    with pytest.warns(OthersRayCluster, match="run by nobody"):
        assert address_to_join() == "local"


def test_a_pipe_or_a_link_planted_as_rays_address_file_is_not_read(ray_dir, tmp_path):
    """Guards against a kernel hung for good on a pipe nobody writes, or led by a link."""
    named = ray_dir / "ray_current_cluster"
    os.mkfifo(named)
    assert address_to_join() == "local"
    named.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("127.0.0.1:1")
    named.symlink_to(elsewhere)
    assert address_to_join() == "local"


def test_ray_address_in_the_users_environment_is_left_to_ray(ray_dir, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    (ray_dir / "ray_current_cluster").write_text("127.0.0.1:1")
    assert address_to_join() is None


#: Plain ``--on ray`` looking for a cluster ``ray start`` named, stopped at
#: every moment of it, one a round; the address file names a port nobody
#: listens on, so that the whole look runs, the file opened and read.
STOP_AT_EVERY_MOMENT_OF_THE_LOOK = """
import warnings
import fluksio_nb.ray.connection
from fluksio_nb.ray.connection import address_to_join

warnings.simplefilter("ignore")
address_to_join()  # Ray's own module, imported once outside the rounds

def attempt(made):
    made["address"] = address_to_join()

def check():
    if descriptors_left_open(descriptors):
        return "a_descriptor_left_open"

descriptors = len(os.listdir("/proc/self/fd"))
watched = [fluksio_nb.ray.connection.__file__]
each_moment(watched, attempt, lambda made: made.clear(), check, forgotten=True, generators=False)
"""


def test_a_stop_at_any_moment_of_looking_for_rays_cluster_leaves_no_descriptor_open(ray_dir):
    """Guards against a stop landing as Ray's address file was opened: the descriptor
    stayed open for the kernel's life with nothing holding its number."""
    (ray_dir / "ray_current_cluster").write_text("127.0.0.1:1\n")
    said = said_by(STOP_AT_EVERY_MOMENT_OF_THE_LOOK, timeout=100)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 5, said
