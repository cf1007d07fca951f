"""A user's own books: the books service, run as the user, shared by every kernel of theirs.

The failure this exists for is two notebooks of one user each granting
"GPU 0". So every test here uses real processes (each with the kernel's own
accountant, as a kernel has) and a real service they start themselves: it is
started once however many start together, shared, gone a while after the
last leaves and started again; a killed holder's share reaches a waiter in
another process; claims are granted in ticket order across processes; a
kernel that declares another machine is refused, naming the setting; and
the directory it lives in is this user's alone, or nothing is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from fluksio_nb.errors import (
    BadClaim,
    BadSettings,
    BooksDisagree,
    ClaimCancelled,
    ServiceUnavailable,
)
from fluksio_nb.kernel import accountant, books_in_force, forget_accountant
from fluksio_nb.machine.connection import read_snapshot
from fluksio_nb.machine.run_dir import SOCKET_NAME
from fluksio_nb.machine.user_dir import UnsafeBooksDir
from fluksio_nb.machine.user_service import LOG_NAME
from fluksio_nb.records import KERNEL_DIED
from fluksio_nb.resources import Resources
from tests.kernels import Kernel
from tests.machines import fluksio_nb
from tests.stops import STOP_AT, STOP_AT_EVERY_MOMENT_OF_A_CLAIM
from tests.unix_users import USER_B, as_user, owned_tmp_dir, ready_user, run_as, user_environ
from tests.user_books import heard, other_process, users_books
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def books_dir() -> Path:
    """This test's books directory: the suite gives each test its own."""
    return Path(os.environ["FLUKSIO_LEDGER"])


def services_in(directory: Path) -> list[psutil.Process]:
    """The books services running for ``directory``, found by their command lines."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = process.info["cmdline"] or []
        if "serve" in line and "--books" in line and str(directory) in line:
            found.append(process)
    return found


def declare(monkeypatch, **settings: str) -> None:
    for name, value in settings.items():
        monkeypatch.setenv(f"FLUKSIO_{name.upper()}", value)


# -- its life ---------------------------------------------------------------------


def test_the_service_is_started_by_the_first_kernel_shared_by_a_second_and_gone_after_the_last(
    monkeypatch,
):
    monkeypatch.setenv("FLUKSIO_BOOKS_LINGER", "1")
    directory = books_dir()
    assert services_in(directory) == []
    first, second = Kernel(), Kernel()
    try:
        first.run("%load_ext fluksio_nb", check=True)
        first.run("%%claim cpus=1\nx = 1", check=True)
        (service,) = services_in(directory)
        second.run("%load_ext fluksio_nb", check=True)
        second.run("%%claim cpus=1\ny = 2", check=True)
        assert services_in(directory) == [service], "the second kernel started another"
        first.shutdown()
        second.run("%%claim cpus=1\nz = 3", check=True)
        # The same service: the first kernel's leaving did not end it.
        assert services_in(directory) == [service]
    finally:
        for kernel in (first, second):
            with contextlib.suppress(Exception):
                kernel.shutdown()
    assert wait_until(lambda: not service.is_running(), timeout=30), "it outlived its kernels"
    assert not (directory / SOCKET_NAME).exists()
    again = Kernel()
    try:
        again.run("%load_ext fluksio_nb", check=True)
        again.run("%%claim cpus=1\nw = 4", check=True)
        (restarted,) = services_in(directory)
        assert restarted.pid != service.pid
    finally:
        again.shutdown()


def test_kernels_starting_at_the_same_moment_start_one_service():
    directory = books_dir()
    go = directory.parent / "go"
    processes = [
        other_process(
            directory,
            f"import os\nwhile not os.path.exists({str(go)!r}): time.sleep(0.001)\n"
            "q = accountant()\n"
            "from fluksio_nb.machine.protocol import peer_credentials\n"
            "say(service=peer_credentials(q._sock)[0])\n"
            "sys.stdin.readline()\n",
            made_first=False,
        )
        for _ in range(4)
    ]
    go.touch()
    pids = {heard(process)["service"] for process in processes}
    assert len(pids) == 1, f"{len(pids)} services answered: {pids}"
    assert [p.pid for p in services_in(directory)] == list(pids)
    for process in processes:
        process.communicate("\n", timeout=30)


def test_a_service_killed_under_running_claims_is_started_again_and_they_are_put_back(
    monkeypatch,
):
    """Guards against a crash of the user's service ending every claim their kernels run."""
    declare(monkeypatch, cpus="2", reserve_cpus="0")
    holder = other_process(
        books_dir(),
        "t = q.enqueue(Resources(cpus=1), 'kept'); say(n=t.number)\n"
        "sys.stdin.readline()\nsay(state=t.state, cancelled=t.cancelled); q.release(t)\n",
        cpus="2",
        reserve_cpus="0",
    )
    number = heard(holder)["n"]
    (service,) = services_in(books_dir())
    # Past the moment the service writes down what runs.
    written = books_dir() / "claims.json"
    assert wait_until(lambda: written.exists() and str(number) in written.read_text(), 10)
    service.kill()
    service.wait(10)
    mine = accountant()
    ticket = mine.enqueue(Resources(cpus=1), "after")
    mine.wait(ticket, timeout=30)
    (restarted,) = services_in(books_dir())
    assert restarted.pid != service.pid
    running = {claim["ticket"]: claim["label"] for claim in mine.snapshot()["running"]}
    assert running == {number: "kept", ticket.number: "after"}
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert heard(holder) == {"state": "running", "cancelled": None}
    assert holder.wait(timeout=30) == 0
    mine.release(ticket)


def test_a_view_never_starts_the_service_and_shows_the_machine_as_found(monkeypatch):
    declare(monkeypatch, cpus="3", reserve_cpus="0")
    ran = fluksio_nb()
    assert "3" in ran.stdout
    status = fluksio_nb("machine", "status")
    assert "no books service of yours runs now" in status.stdout, status.stdout
    assert services_in(books_dir()) == []


def test_machine_status_says_which_service_a_kernel_uses_and_why():
    holder = other_process(books_dir(), "say(ready=True)\nsys.stdin.readline()\n")
    assert heard(holder) == {"ready": True}
    (service,) = services_in(books_dir())
    said = fluksio_nb("machine", "status").stdout
    assert f"served by a service of theirs in {books_dir()}" in said
    assert "FLUKSIO_LEDGER" in said
    assert f"your books service (pid {service.pid}) answers" in said
    holder.communicate("\n", timeout=30)


# -- one set of books -------------------------------------------------------------


def test_a_killed_kernels_share_reaches_a_waiter_in_another_kernel_and_is_recorded(
    monkeypatch,
):
    declare(monkeypatch, cpus="1", reserve_cpus="0")
    holder = other_process(
        books_dir(),
        "t = q.enqueue(Resources(cpus=1), 'doomed'); say(n=t.number)\nsys.stdin.readline()\n",
        cpus="1",
        reserve_cpus="0",
    )
    number = heard(holder)["n"]
    mine = accountant()
    ticket = mine.enqueue(Resources(cpus=1), "waiter")
    assert ticket.state == "waiting"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    mine.wait(ticket, timeout=30)
    assert ticket.state == "running"
    mine.release(ticket)

    def recorded() -> list:
        usage = Path(os.environ["JUPYTER_DATA_DIR"]) / "fluksio" / "usage"
        lines = [line for f in usage.glob("*.jsonl") for line in f.read_text().splitlines()]
        return [line for line in lines if f'"ticket":{number},' in line]

    assert wait_until(recorded, timeout=10), "the killed kernel's claim was not recorded"
    (record,) = recorded()
    assert KERNEL_DIED in record and '"label":"doomed"' in record


def test_claims_are_granted_in_ticket_order_across_kernels(monkeypatch):
    declare(monkeypatch, cpus="1", reserve_cpus="0")
    mine = accountant()
    held = mine.enqueue(Resources(), "first")
    others = []
    for name in "abc":
        process = other_process(
            books_dir(),
            f"t = q.enqueue(Resources(), {name!r}); say(n=t.number)\n"
            "q.wait(t); say(at=time.time()); time.sleep(0.05); q.release(t)\n",
            cpus="1",
            reserve_cpus="0",
        )
        heard(process)
        others.append(process)
    mine.release(held)
    times = [heard(process)["at"] for process in others]
    assert times == sorted(times)
    for process in others:
        assert process.wait(timeout=30) == 0


def test_two_kernels_never_hold_the_same_card(monkeypatch):
    declare(monkeypatch, gpus="1")
    holder = other_process(
        books_dir(),
        "t = q.enqueue(Resources(gpus=1)); say(gpus=list(t.allocation.gpus))\n"
        "sys.stdin.readline(); q.release(t)\n",
        gpus="1",
    )
    assert heard(holder) == {"gpus": [0]}
    mine = accountant()
    ticket = mine.enqueue(Resources(gpus=1))
    assert ticket.state == "waiting", "card 0 was granted twice"
    holder.communicate("\n", timeout=30)
    assert mine.wait(ticket, timeout=30).gpus == (0,)
    mine.release(ticket)


def test_a_claim_can_be_cancelled_from_another_kernel_of_the_user(monkeypatch):
    declare(monkeypatch, cpus="1", reserve_cpus="0")
    mine = accountant()
    running = mine.enqueue(Resources(), "runner")
    stopped = []
    running.on_cancel = stopped.append
    waiting = mine.enqueue(Resources(), "to cancel")
    canceller = other_process(
        books_dir(),
        f"say(waiting=q.cancel({waiting.number}, 'not now'), "
        f"running=q.cancel({running.number}, 'stop'))\n",
        cpus="1",
        reserve_cpus="0",
    )
    assert heard(canceller) == {"waiting": True, "running": True}
    with pytest.raises(ClaimCancelled, match="not now"):
        mine.wait(waiting, timeout=5)
    assert wait_until(lambda: stopped == ["stop"], timeout=10)
    mine.release(waiting)
    mine.release(running)
    assert mine.snapshot()["cpus"]["free"] == 1


def test_a_kernel_declaring_another_machine_is_refused_with_the_setting_named(monkeypatch):
    """Guards against two notebooks declaring different machines each ending the other's claims."""
    holder = other_process(
        books_dir(),
        "t = q.enqueue(Resources(gpus=2), 'demo'); say(gpus=list(t.allocation.gpus))\n"
        "sys.stdin.readline()\nsay(state=t.state, cancelled=t.cancelled); q.release(t)\n",
        gpus="2",
    )
    assert heard(holder) == {"gpus": [0, 1]}
    declare(monkeypatch, gpus="0")
    with pytest.raises(BooksDisagree) as refused:
        accountant()
    said = str(refused.value)
    assert "cards [0, 1] there, none here (FLUKSIO_GPUS is 2 there, 0 here)" in said, said
    assert "FLUKSIO_LEDGER=kernel" in said
    # The refused kernel ended nobody's claim.
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert heard(holder) == {"state": "running", "cancelled": None}
    assert holder.wait(timeout=30) == 0


def test_a_kernel_restarted_with_a_new_setting_describes_the_machine_from_then_on(monkeypatch):
    declare(monkeypatch, cpus="2", gpus="1", reserve_cpus="0")
    before = accountant()
    before.release(before.enqueue(Resources(gpus=1)))
    forget_accountant()
    # The service outlives the kernel that described it, for the next to find.
    (service,) = services_in(books_dir())
    declare(monkeypatch, cpus="8", gpus="2")
    after = accountant()
    held = after.enqueue(Resources(cpus=8, gpus=2))
    assert held.state == "running"
    assert after.snapshot()["cpus"]["total"] == 8
    assert services_in(books_dir()) == [service]
    after.release(held)


def test_a_stop_at_any_moment_of_a_claim_leaves_the_users_books_free_and_its_waiters_woken(
    monkeypatch,
):
    """Guards against a stop landing at an unlucky moment of a claim on the user's own
    service, after which a claim stayed held and the user's other kernels waited for
    ever, or this kernel no longer heard that its turn had come."""
    declare(monkeypatch, cpus="2", reserve_cpus="0")
    stopped = other_process(
        books_dir(), STOP_AT + STOP_AT_EVERY_MOMENT_OF_A_CLAIM, cpus="2", reserve_cpus="0"
    )
    said = heard(stopped)
    assert stopped.wait(timeout=60) == 0
    assert "stopped_at" in said, said
    # A claim's way through the client is dozens of such moments: every one was tried.
    assert said["stopped_at"] > 20, said


def test_a_thousand_claims_of_four_kernels_keep_the_books(monkeypatch):
    declare(monkeypatch, cpus="2", gpus="1", reserve_cpus="0")
    body = (
        "held = []\n"
        "for i in range(250):\n"
        "    t = q.enqueue(Resources(cpus=1, gpus=i % 2)); q.wait(t, timeout=60)\n"
        "    held.append(t.allocation.gpus); q.release(t)\n"
        "say(done=len(held))\n"
    )
    processes = [
        other_process(books_dir(), body, cpus="2", gpus="1", reserve_cpus="0") for _ in range(4)
    ]
    assert [heard(process) for process in processes] == [{"done": 250}] * 4
    books = users_books(books_dir())
    assert books["running"] == [] and books["waiting"] == []
    assert books["cpus"]["free"] == 2 and books["gpus"]["free"] == 1


# -- where it lives ---------------------------------------------------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def directory(path: Path, mode: int) -> Path:
    """A directory of this user's with exactly ``mode``, whatever the umask."""
    path.mkdir()
    os.chmod(path, mode)
    return path


def test_a_missing_directory_is_made_private_and_so_is_everything_in_it(tmp_path, monkeypatch):
    where = tmp_path / "a" / "b" / "books"
    monkeypatch.setenv("FLUKSIO_LEDGER", str(where))
    queue = accountant()
    queue.release(queue.enqueue(Resources()))
    assert mode_of(where) == 0o700
    assert {name: mode_of(where / name) & 0o077 for name in os.listdir(where)} == {
        name: 0 for name in os.listdir(where)
    }
    assert (where / LOG_NAME).exists()


def test_an_existing_directory_of_ours_is_used_and_its_mode_left_alone(tmp_path, monkeypatch):
    """Guards against the books chmod-ing a directory somebody chose."""
    mine = directory(tmp_path / "mine", 0o755)
    monkeypatch.setenv("FLUKSIO_LEDGER", str(mine))
    queue = accountant()
    queue.release(queue.enqueue(Resources()))
    assert mode_of(mine) == 0o755


def test_a_sticky_world_writable_directory_is_refused_and_keeps_its_sticky_bit(
    tmp_path, monkeypatch
):
    """Guards against a /tmp-like FLUKSIO_LEDGER being used, or losing its sticky bit."""
    scratch = directory(tmp_path / "scratch", 0o1777)
    monkeypatch.setenv("FLUKSIO_LEDGER", str(scratch))
    with pytest.raises(UnsafeBooksDir) as refused:
        accountant()
    assert mode_of(scratch) == 0o1777
    assert os.listdir(scratch) == []
    message = str(refused.value)
    assert str(scratch) in message and "1777" in message
    # Telling someone to chmod their /tmp would break it: they are sent elsewhere.
    assert "chmod" not in message and "FLUKSIO_LEDGER" in message


def test_a_group_writable_directory_is_refused_with_how_to_fix_it(tmp_path, monkeypatch):
    """Guards against a team-mode (2770) directory, where a group member can forge the books."""
    team = directory(tmp_path / "team", 0o2770)
    monkeypatch.setenv("FLUKSIO_LEDGER", str(team))
    with pytest.raises(UnsafeBooksDir) as refused:
        accountant()
    message = str(refused.value)
    assert f"chmod go-w {team}" in message
    assert "2770" in message and "fluksio-nb machine init" in message
    assert os.listdir(team) == []
    # The magics and the command line print a BadClaim as one paragraph.
    assert isinstance(refused.value, BadSettings) and isinstance(refused.value, BadClaim)


def test_a_directory_that_is_a_symlink_is_refused_and_nothing_is_made_where_it_points(
    tmp_path, monkeypatch
):
    """Guards against a link that whoever can change it points at their own directory."""
    target = tmp_path / "where-the-link-points"
    link = tmp_path / "books"
    link.symlink_to(target)
    monkeypatch.setenv("FLUKSIO_LEDGER", str(link))
    with pytest.raises(UnsafeBooksDir, match="symbolic link") as refused:
        accountant()
    assert not target.exists()
    # One way out each: the directory itself, another of one's own, or the machine's books.
    assert str(refused.value).count("FLUKSIO_LEDGER") == 1, refused.value


def test_a_directory_too_deep_for_a_socket_address_still_serves(tmp_path, monkeypatch):
    """A socket's address holds 107 bytes: a deep runtime directory must not matter."""
    deep = tmp_path.joinpath(*(["a-directory-name-of-some-length"] * 6))
    assert len(str(deep / SOCKET_NAME)) > 108
    monkeypatch.setenv("FLUKSIO_LEDGER", str(deep))
    queue = accountant()
    ticket = queue.enqueue(Resources())
    assert [c["ticket"] for c in users_books(deep)["running"]] == [ticket.number]
    queue.release(ticket)


def test_the_service_of_another_user_is_never_taken_for_ones_own(monkeypatch):
    """Guards against a socket another user answers collecting this user's claims."""
    other = ready_user(USER_B)
    with owned_tmp_dir(other) as theirs:
        books = theirs / "books"
        holder = subprocess.Popen(
            [*as_user(other), sys.executable, "-c", HOLD_ONE_CLAIM],
            env=user_environ(other, {"FLUKSIO_LEDGER": str(books)}),
            cwd=other.home,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout.readline() == "held\n"
            # Root may enter their directory; what answers there is still theirs.
            with pytest.raises(ServiceUnavailable, match=f"runs as uid {other.uid}, not "):
                read_snapshot(books / SOCKET_NAME, os.geteuid(), within=0)
            # A claim with their directory named is refused before anything is sent.
            monkeypatch.setenv("FLUKSIO_LEDGER", str(books))
            with pytest.raises(UnsafeBooksDir, match=f"uid {other.uid}"):
                accountant()
            assert users_theirs(books)["running"][0]["uid"] == other.uid
        finally:
            holder.communicate("\n", timeout=30)


#: Holds one claim in the books ``FLUKSIO_LEDGER`` names until its stdin ends.
HOLD_ONE_CLAIM = """
import sys
from fluksio_nb.kernel import accountant
from fluksio_nb.resources import Resources
accountant().enqueue(Resources())
print("held", flush=True)
sys.stdin.readline()
"""


def users_theirs(books: Path) -> dict:
    """The books of another user's service, as that user reads them."""
    other = ready_user(USER_B)
    read = run_as(
        other,
        "import json\nfrom fluksio_nb.machine.connection import read_snapshot\n"
        f"print(json.dumps(read_snapshot(__import__('pathlib').Path({str(books / SOCKET_NAME)!r}), "
        f"{other.uid})))",
    )
    assert read.returncode == 0, read.stderr
    return json.loads(read.stdout)


def test_books_in_force_names_the_users_service_and_why():
    books = books_in_force()
    assert books.mode == "user" and books.socket == books_dir() / SOCKET_NAME
    assert "FLUKSIO_LEDGER" in books.describe()


def test_a_process_that_is_no_kernel_says_so_without_loading_a_kernels_machinery():
    """Guards the command line and every script that claims: each hello to the books
    imported ipykernel and jupyter_client (0.2 CPU-s, most of `fluksio-nb machine
    status`) only to learn the process was no kernel. A kernel naming itself is
    guarded in ``test_server.py``."""
    ran = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys\n"
            "from fluksio_nb.identity import this_kernel\n"
            "said = this_kernel()\n"
            "loaded = [name for name in ('ipykernel', 'jupyter_client') if name in sys.modules]\n"
            "print(json.dumps([said['kernel_id'], loaded]))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(ran.stdout) == [None, []]
