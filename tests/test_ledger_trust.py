"""The ledger against another user on the same machine, and against its own file.

A ledger is one user's books, and it is only as good as the guarantee that
nobody else can write them. These tests use real directories, files, links
and processes: a directory somebody else can write is refused and left as it
was, a link planted where the ledger keeps a file is never followed, an
entry that does not hold up is left out without stopping anyone, who a
kernel is comes from the OS rather than from its environment, and only the
user's own kernels can wake a waiting claim.
"""

import json
import os
import pwd
import select
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

import fluksio_nb.ledger.queue
from fluksio_nb.errors import BadClaim, BadSettings
from fluksio_nb.ledger import (
    LEDGER_FILE,
    LOCK_FILE,
    LedgerBroken,
    LedgerEntry,
    LedgerFile,
    MachineQueue,
    UnsafeLedgerDir,
    identity,
    machine_snapshot,
    process_started,
    read_snapshot,
)
from fluksio_nb.ledger.wake import wake
from fluksio_nb.resources import Resources
from tests.test_ledger import heard, inventory, other_process
from tests.unix_users import USER_B, ready_user, run_as, shared_tmp_dir
from tests.waiting import gone

pytestmark = pytest.mark.timeout(120)

SECRET = "the other user's secret, which no ledger may touch\n"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def directory(path: Path, mode: int) -> Path:
    """A directory of this user's with exactly ``mode``, whatever the umask."""
    path.mkdir()
    os.chmod(path, mode)
    return path


def secret_file(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)
    return secret


def untouched(secret: Path) -> bool:
    return secret.read_text() == SECRET and mode_of(secret) == 0o600


def caught_broken(action):
    """What ``action()`` returned, and the LedgerBroken warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = action()
    return result, [str(w.message) for w in caught if issubclass(w.category, LedgerBroken)]


# -- the directory ------------------------------------------------------------


def test_an_existing_directory_of_ours_is_used_and_its_mode_left_alone(tmp_path):
    """Guards against the ledger chmod-ing a directory somebody chose (it made them 2770)."""
    mine = directory(tmp_path / "mine", 0o755)

    queue = MachineQueue(mine, inventory())
    queue.release(queue.enqueue(Resources()))

    assert mode_of(mine) == 0o755
    assert mode_of(mine / LEDGER_FILE) == 0o600
    assert mode_of(mine / LOCK_FILE) == 0o600


def test_a_sticky_world_writable_directory_is_refused_and_keeps_its_sticky_bit(tmp_path):
    """Guards against a /tmp-like FLUKSIO_LEDGER being used, or losing its sticky bit."""
    scratch = directory(tmp_path / "scratch", 0o1777)

    with pytest.raises(UnsafeLedgerDir) as refused:
        MachineQueue(scratch, inventory())

    assert mode_of(scratch) == 0o1777
    assert os.listdir(scratch) == []
    message = str(refused.value)
    assert str(scratch) in message and "1777" in message
    # Telling someone to chmod their /tmp would break it: they are sent elsewhere.
    assert "chmod" not in message and "FLUKSIO_LEDGER" in message


def test_a_group_writable_directory_is_refused_with_how_to_fix_it(tmp_path):
    """Guards against a team-mode (2770) directory, where a group member can forge the books."""
    team = directory(tmp_path / "team", 0o2770)

    with pytest.raises(UnsafeLedgerDir) as refused:
        LedgerFile(team)

    message = str(refused.value)
    assert f"chmod go-w {team}" in message
    assert "2770" in message and "fluksio-nb machine init" in message
    assert mode_of(team) == 0o2770
    # The magics and the command line print a BadClaim as one paragraph.
    assert isinstance(refused.value, BadSettings) and isinstance(refused.value, BadClaim)


@pytest.fixture
def someone_elses(tmp_path):
    """A directory of another user's, writable only by them."""
    if os.geteuid() != 0:
        return Path("/")  # root's, and this user is not root
    theirs = directory(tmp_path / "theirs", 0o755)
    os.chown(theirs, 65534, 65534)
    return theirs


def test_a_directory_of_another_user_is_refused(someone_elses):
    """Guards against keeping the books where their owner can rewrite them."""
    owner = os.stat(someone_elses).st_uid

    with pytest.raises(UnsafeLedgerDir) as refused:
        LedgerFile(someone_elses)

    message = str(refused.value)
    assert f"uid {owner}" in message and pwd.getpwuid(owner).pw_name in message
    assert LEDGER_FILE not in os.listdir(someone_elses)


def test_a_directory_that_is_a_symlink_is_refused(tmp_path):
    """Guards against a link that whoever can change it points at their own directory."""
    real = directory(tmp_path / "real", 0o700)
    link = tmp_path / "link"
    link.symlink_to(real)

    with pytest.raises(UnsafeLedgerDir, match="symbolic link") as refused:
        MachineQueue(link, inventory())
    with pytest.raises(UnsafeLedgerDir, match="symbolic link"):
        read_snapshot(link)

    assert os.listdir(real) == []
    # One way out each: the directory itself, another of one's own, or the machine's books.
    assert str(refused.value).count("FLUKSIO_LEDGER") == 1, refused.value


def test_a_dangling_symlink_is_not_followed_to_make_a_directory(tmp_path):
    """Guards against a planted link making the ledger create a directory where it points."""
    target = tmp_path / "where-the-link-points"
    link = tmp_path / "ledger"
    link.symlink_to(target)

    with pytest.raises(UnsafeLedgerDir, match="symbolic link"):
        MachineQueue(link, inventory())

    assert not target.exists()


def test_a_missing_directory_is_made_private_with_its_parents(tmp_path):
    """Guards against a new ledger directory that others can read or write."""
    where = tmp_path / "a" / "b" / "ledger"

    queue = MachineQueue(where, inventory())
    queue.release(queue.enqueue(Resources()))

    assert mode_of(where) == 0o700
    assert mode_of(where / LEDGER_FILE) == 0o600


# -- the files in it ----------------------------------------------------------


def plant_link(place: Path, secret: Path) -> None:
    place.symlink_to(secret)


def plant_hard_link(place: Path, secret: Path) -> None:
    os.link(secret, place)


@pytest.mark.parametrize("name", [LEDGER_FILE, LOCK_FILE])
@pytest.mark.parametrize("plant", [plant_link, plant_hard_link])
def test_a_file_planted_as_a_link_is_never_written_through(tmp_path, name, plant):
    """Guards against the ledger writing its JSON over whatever a planted link names."""
    secret = secret_file(tmp_path)
    ledger = directory(tmp_path / "ledger", 0o700)
    plant(ledger / name, secret)

    with pytest.raises(UnsafeLedgerDir) as refused:
        MachineQueue(ledger, inventory()).enqueue(Resources())
    assert str(ledger / name) in str(refused.value)
    assert "rm " in str(refused.value)
    # A reader either refuses in the same words or never opens the file.
    try:
        read_snapshot(ledger)
    except UnsafeLedgerDir as error:
        assert str(ledger / name) in str(error)

    assert untouched(secret)


def test_a_ledger_file_others_can_write_is_refused(tmp_path):
    """Guards against a file left group-writable by the old team mode being trusted."""
    ledger = directory(tmp_path / "ledger", 0o700)
    (ledger / LEDGER_FILE).write_text("")
    os.chmod(ledger / LEDGER_FILE, 0o660)

    with pytest.raises(UnsafeLedgerDir, match="chmod go-w"):
        MachineQueue(ledger, inventory()).enqueue(Resources())
    assert mode_of(ledger / LEDGER_FILE) == 0o660


def test_a_planted_broken_copy_is_not_followed(tmp_path):
    """Guards against the copy of a broken document being written through a planted link."""
    secret = secret_file(tmp_path)
    ledger = directory(tmp_path / "ledger", 0o700)
    (ledger / LEDGER_FILE).write_text("{ not a ledger")
    # Every name the copy can take in the next two minutes.
    now = int(time.time())
    for second in range(now - 1, now + 120):
        (ledger / f"{LEDGER_FILE}.broken-{second}").symlink_to(secret)

    queue = MachineQueue(ledger, inventory())
    ticket, said = caught_broken(lambda: queue.enqueue(Resources()))

    assert ticket.state == "running"
    assert any("no copy was kept" in message for message in said), said
    assert untouched(secret)
    queue.release(ticket)


def test_a_broken_document_is_kept_aside_for_its_owner_only(tmp_path):
    """Guards against the copy of a broken document being readable by others, or lost."""
    ledger = directory(tmp_path / "ledger", 0o700)
    (ledger / LEDGER_FILE).write_text("{ not a ledger")

    queue = MachineQueue(ledger, inventory())
    ticket, said = caught_broken(lambda: queue.enqueue(Resources()))

    [copy] = ledger.glob(f"{LEDGER_FILE}.broken-*")
    assert copy.read_text() == "{ not a ledger"
    assert mode_of(copy) == 0o600
    assert any(copy.name in message for message in said), said
    queue.release(ticket)


def test_readers_do_not_keep_descriptors(tmp_path):
    """Guards against a server that polls the ledger running out of file descriptors."""
    queue = MachineQueue(tmp_path, inventory())
    queue.release(queue.enqueue(Resources()))
    before = len(os.listdir("/proc/self/fd"))

    for _ in range(50):
        read_snapshot(tmp_path)
        LedgerFile(tmp_path).read()  # dropped without close(), as the server's cancel does

    assert len(os.listdir("/proc/self/fd")) <= before + 1


# -- what the document says ---------------------------------------------------


def an_entry(number, owner, state="running", cpus=1, gpus=(), **more):
    entry = {
        "number": number,
        "state": state,
        "label": f"claim {number}",
        "asked": {"cpus": cpus, "gpus": len(gpus), "ram_bytes": 0},
        "allocation": None,
        "owner": owner,
        "since": time.time(),
        "granted_at": None,
        "wake": None,
        "cancel": None,
        "readings": None,
    }
    if state == "running":
        entry["allocation"] = {"cpus": cpus, "gpus": list(gpus), "ram_bytes": 0}
        entry["granted_at"] = time.time()
    return {**entry, **more}


def owner_of(pid):
    started = process_started(pid)
    assert started is not None, f"process {pid} is not running"
    return {"pid": pid, "started": started, "kernel_id": None, "notebook": None, "user": "x"}


@pytest.fixture
def live_process():
    """A process that lives until the test ends it: a holder who is not this test."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    yield process
    process.kill()
    process.wait()


def test_malformed_entries_are_left_out_and_nobody_is_stopped(tmp_path, live_process):
    """Guards against one bad entry crashing every kernel, or making free capacity negative."""
    alive = owner_of(live_process.pid)
    keeper = an_entry(1, alive, gpus=[0], note="a field some later version added")
    no_owner = an_entry(3, alive, state="waiting")
    del no_owner["owner"]
    document = {
        "version": 1,
        "next": 20,
        "inventory": {"cpus": 4, "gpu_ids": [0], "ram_bytes": 0},
        "tickets": [
            keeper,
            an_entry(2, alive, state="waiting", asked={"cpus": "2", "gpus": 0, "ram_bytes": 0}),
            no_owner,
            an_entry(4, owner_of(1), cpus=1_000_000_000),
            an_entry(5, alive, gpus=[7]),
            an_entry(6, alive, gpus=[0]),
            "not an entry",
            an_entry(8, alive, asked={"cpus": 1e9, "gpus": 0, "ram_bytes": 0}),
        ],
    }
    (tmp_path / LEDGER_FILE).write_text(json.dumps(document))

    seen, said = caught_broken(lambda: read_snapshot(tmp_path))
    assert [claim["ticket"] for claim in seen["running"]] == [1]
    assert seen["cpus"]["free"] == 3 and seen["gpus"]["free"] == 0
    assert said
    problems = " ".join(said)
    for wrong in ("entry 2", "entry 3", "claim 4", "claim 5", "claim 6", "entry 7", "entry 8"):
        assert wrong in problems, wrong

    queue = MachineQueue(tmp_path, inventory(cpus=4, gpus=1))
    seen, said = caught_broken(queue.snapshot)
    assert said and [claim["ticket"] for claim in seen["running"]] == [1]
    assert seen["cpus"]["free"] >= 0 and seen["gpus"]["free"] == 0

    # What pid 1 "holds" stops nobody; the card waits for its real holder.
    cpus, _ = caught_broken(lambda: queue.enqueue(Resources(cpus=3)))
    card, _ = caught_broken(lambda: queue.enqueue(Resources(gpus=1)))
    assert cpus.state == "running" and card.state == "waiting"
    assert queue.snapshot()["cpus"]["free"] == 0
    live_process.kill()
    assert gone(live_process.pid)
    assert queue.wait(card, timeout=10).gpus == (0,)
    queue.release(card)
    queue.release(cpus)

    after = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert after["tickets"] == []
    assert after["next"] >= 20
    assert queue.snapshot()["cpus"] == {"total": 4, "free": 4, "free_ids": []}
    assert queue.snapshot()["gpus"]["free"] == 1


def test_a_valid_entry_of_a_live_process_keeps_every_field(tmp_path, live_process):
    """Guards against validation dropping fields a later version writes, or this one does."""
    kept = an_entry(1, owner_of(live_process.pid), cpus=2, priority=3)
    kept["owner"]["host"] = "added later"
    document = {
        "version": 1,
        "next": 2,
        "inventory": {"cpus": 4, "gpu_ids": [], "ram_bytes": 0},
        "tickets": [kept],
        "note": "added later",
    }
    (tmp_path / LEDGER_FILE).write_text(json.dumps(document))

    queue = MachineQueue(tmp_path, inventory(cpus=4, gpus=0))
    mine = queue.enqueue(Resources(cpus=1), "mine")
    queue.wait(mine, timeout=5)
    written = json.loads((tmp_path / LEDGER_FILE).read_text())

    assert written["note"] == "added later"
    assert written["tickets"][0] == kept
    # What this module writes is all known to the model, or kept by it.
    for entry in written["tickets"]:
        assert LedgerEntry.model_validate(entry).model_dump(exclude_unset=True) == entry
    queue.release(mine)


def test_a_broken_top_level_is_rebuilt(tmp_path):
    """Guards against a document whose inventory or numbering is nonsense being used."""
    document = {
        "version": 1,
        "next": "7",
        "inventory": {"cpus": -4, "gpu_ids": "0", "ram_bytes": 0},
        "tickets": [],
    }
    (tmp_path / LEDGER_FILE).write_text(json.dumps(document))

    queue = MachineQueue(tmp_path, inventory(cpus=2, gpus=0))
    ticket, said = caught_broken(lambda: queue.enqueue(Resources()))

    assert ticket.state == "running"
    assert any("could not be read" in message for message in said), said
    assert queue.snapshot()["cpus"] == {"total": 2, "free": 1, "free_ids": []}
    queue.release(ticket)


def test_a_snapshot_never_shows_less_than_nothing_free():
    """Guards against a panel showing -3 free cores from claims the inventory cannot hold."""
    me = {"pid": os.getpid(), "started": process_started(os.getpid())}
    state = {"tickets": [an_entry(1, me, cpus=2), an_entry(2, me, cpus=3)]}

    shown, said = caught_broken(
        lambda: machine_snapshot(state, {"cpus": 4, "gpu_ids": [], "ram_bytes": 0})
    )

    assert shown["cpus"] == {"total": 4, "free": 2, "free_ids": []}
    assert [claim["ticket"] for claim in shown["running"]] == [1]
    assert said and "claim 2" in said[0]


# -- who a kernel is ----------------------------------------------------------


def test_identity_comes_from_the_os_not_the_environment(monkeypatch):
    """Guards against a kernel passing itself off as another user by setting $USER."""
    monkeypatch.setenv("USER", "someone-else")
    monkeypatch.setenv("LOGNAME", "someone-else")

    me = identity()

    assert me["uid"] == os.geteuid()
    assert me["user"] == pwd.getpwuid(os.geteuid()).pw_name != "someone-else"


def test_a_claim_made_under_a_false_user_name_is_recorded_under_the_real_one(tmp_path):
    """Guards against the ledger recording whatever name a process's environment gives."""
    script = textwrap.dedent(
        f"""
        from fluksio_nb.ledger import MachineQueue
        from fluksio_nb.resources import Resources
        from tests.test_ledger import inventory
        queue = MachineQueue({str(tmp_path)!r}, inventory())
        queue.release(queue.enqueue(Resources()))
        queue.enqueue(Resources(), "left running")
        """
    )
    env = {**os.environ, "USER": "someone-else", "LOGNAME": "someone-else"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=Path.cwd())

    [entry] = json.loads((tmp_path / LEDGER_FILE).read_text())["tickets"]
    assert entry["owner"]["user"] == pwd.getpwuid(os.geteuid()).pw_name
    assert entry["owner"]["uid"] == os.geteuid()


def test_an_entry_written_before_notebooks_were_kept_still_reads(tmp_path, live_process):
    """Guards against a ledger of an older version losing its claims, or the views their shape."""
    older = {"pid": live_process.pid, "started": process_started(live_process.pid), "user": "x"}
    named = {**owner_of(live_process.pid), "notebook": "work/train.ipynb"}
    document = {
        "version": 1,
        "next": 3,
        "inventory": {"cpus": 4, "gpu_ids": [], "ram_bytes": 0},
        "tickets": [an_entry(1, older), an_entry(2, named)],
    }
    (tmp_path / LEDGER_FILE).write_text(json.dumps(document))

    seen, said = caught_broken(lambda: read_snapshot(tmp_path))

    assert said == []
    assert [(c["ticket"], c["notebook"]) for c in seen["running"]] == [
        (1, None),
        (2, "work/train.ipynb"),
    ]


def test_an_entry_planted_after_this_kernel_wrote_the_ledger_is_still_validated(
    tmp_path, live_process
):
    """Guards the read that skips validating what this kernel wrote: a changed one is checked."""
    queue = MachineQueue(tmp_path, inventory(cpus=4, gpus=1))
    mine = queue.enqueue(Resources(cpus=1))
    document = json.loads((tmp_path / LEDGER_FILE).read_text())
    planted = an_entry(
        document["next"],
        owner_of(live_process.pid),
        state="waiting",
        asked={"cpus": "4", "gpus": 0, "ram_bytes": 0},
    )
    document["tickets"].append(planted)
    (tmp_path / LEDGER_FILE).write_text(json.dumps(document))

    seen, said = caught_broken(queue.snapshot)
    assert said and f"entry {len(document['tickets'])}" in " ".join(said)
    assert [claim["ticket"] for claim in seen["running"]] == [mine.number]
    assert seen["waiting"] == []
    # The planted entry is still there, and still left out as the claim goes.
    caught_broken(lambda: queue.release(mine))


# -- waking -------------------------------------------------------------------

#: Run as another user: find a waiter's socket as anyone can, in
#: /proc/net/unix, and send it datagrams every way there is to name it.
FLOOD = textwrap.dedent(
    """
    import json, os, socket
    token, ledger = os.environ["TOKEN"], os.environ["LEDGER_DIR"]
    listed, targets = [], set()
    with open("/proc/net/unix") as table:
        for line in list(table)[1:]:
            fields = line.split()
            if len(fields) >= 8 and token in fields[7]:
                listed.append(fields[7])
    for path in listed:
        if path.startswith("@"):
            targets.add("\\0" + path[1:])
        else:
            targets.update([path, os.path.join(ledger, os.path.basename(path))])
    delivered, refused = 0, set()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.settimeout(2)
        for target in sorted(targets):
            for _ in range(int(os.environ["SENDS"])):
                try:
                    sender.sendto(b"!", target)
                    delivered += 1
                except OSError as error:
                    refused.add(error.strerror)
    print(json.dumps({"listed": listed, "delivered": delivered, "refused": sorted(refused)}))
    """
)


@pytest.fixture(scope="module")
def other_user():
    return ready_user(USER_B)


def flood_as(user, address: str, ledger_dir: Path, sends: int = 200) -> dict:
    """What ``user`` found of the waiter at ``address`` and how many datagrams got there."""
    ran = run_as(
        user,
        FLOOD,
        env={"TOKEN": address.lstrip("\0"), "LEDGER_DIR": str(ledger_dir), "SENDS": str(sends)},
    )
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)


def counting_looks(queue: MachineQueue, monkeypatch) -> list[int]:
    """Every look at the ledger ``queue`` takes from now on, one element each."""
    looks: list[int] = []
    look = queue.look

    def counted() -> None:
        looks.append(1)
        look()

    monkeypatch.setattr(queue, "look", counted)
    return looks


def waiting_in_a_thread(directory: Path, monkeypatch):
    """A claim held here and another waiting for it in a thread, which only a wake-up frees."""
    # It would not look again by itself for a minute.
    monkeypatch.setattr(fluksio_nb.ledger.queue, "LOOK_EVERY_S", 60)
    holder = MachineQueue(directory, inventory(cpus=1, gpus=0))
    held = holder.enqueue(Resources(), "holding")
    waiter = MachineQueue(directory, inventory(cpus=1, gpus=0))
    ticket = waiter.enqueue(Resources(), "waiting")
    assert ticket.state == "waiting"
    [entry] = [t for t in waiter.ledger.read()["tickets"] if t["number"] == ticket.number]
    looks = counting_looks(waiter, monkeypatch)
    thread = threading.Thread(target=waiter.wait, args=(ticket, 30), daemon=True)
    thread.start()

    def free() -> None:
        holder.release(held)
        thread.join(timeout=40)
        assert ticket.state == "running", "the waiter was not woken when its share freed"

    return SimpleNamespace(
        queue=waiter, ticket=ticket, address=entry["wake"], looks=looks, free=free
    )


def test_another_user_can_neither_reach_a_waiters_socket_nor_make_it_look(other_user, monkeypatch):
    """Guards against another user flooding a waiting kernel's wake socket.

    It was an abstract socket, listed in /proc/net/unix for anyone to send to,
    and each datagram cost the waiter a look at the ledger under its lock. The
    ledger's directory is the default's, 0700, below one others can search.
    """
    with shared_tmp_dir() as shared:
        waiting = waiting_in_a_thread(shared / "ledger", monkeypatch)
        flood = flood_as(other_user, waiting.address, shared / "ledger")
        waiting.free()
        waiting.queue.release(waiting.ticket)

    assert flood["listed"], "the other user did not even find the socket to try"
    assert flood["delivered"] == 0, flood
    # Only the share freeing made it look.
    assert waiting.looks == [1]


def test_a_datagram_of_another_user_that_reaches_the_socket_is_dropped_without_a_look(
    other_user, monkeypatch
):
    """Guards the second lock: a socket another user can get to still wakes nobody for them.

    A directory chosen with FLUKSIO_LEDGER may be searchable by others, and
    the socket is not 0600 in the instant after it is bound: the sender's uid,
    as the OS gives it, decides.
    """
    with shared_tmp_dir() as shared:  # root's, 0755: others may search it
        waiting = waiting_in_a_thread(shared, monkeypatch)
        waker = waiting.queue._wakers[waiting.ticket.number]
        socket_file = shared / (waiting.address[1:] + ".wake")
        assert mode_of(socket_file) == 0o600
        os.chmod(socket_file, 0o666)
        flood = flood_as(other_user, waiting.address, shared, sends=50)
        looks_before_freed = list(waiting.looks)
        waiting.free()
        waiting.queue.release(waiting.ticket)

    assert flood["delivered"] > 0, flood
    assert looks_before_freed == []
    assert (waker.refused, waker.accepted) == (flood["delivered"], 1)
    assert waiting.looks == [1]


def test_a_waiters_socket_is_a_private_file_of_the_ledger_removed_once_given_back(
    tmp_path, monkeypatch
):
    """Guards against sockets piling up in the ledger's directory, or others reaching one."""
    waiting = waiting_in_a_thread(tmp_path, monkeypatch)
    socket_file = tmp_path / (waiting.address[1:] + ".wake")
    found = os.lstat(socket_file)
    assert stat.S_ISSOCK(found.st_mode) and mode_of(socket_file) == 0o600
    assert found.st_uid == os.geteuid()
    waiting.free()
    waiting.queue.release(waiting.ticket)
    assert not socket_file.exists()


def test_the_socket_of_a_waiter_killed_while_waiting_is_removed_by_the_next_waiter(tmp_path):
    """Guards against SIGKILL leaving a socket file in the ledger's directory for good."""
    holder = MachineQueue(tmp_path, inventory(cpus=1, gpus=0))
    held = holder.enqueue(Resources(), "holding")
    killed = other_process(
        tmp_path,
        "t = q.enqueue(Resources(), 'killed'); say(state=t.state); time.sleep(600)\n",
        cpus=1,
        gpus=0,
    )
    assert heard(killed) == {"state": "waiting"}
    [left] = [t["wake"] for t in holder.ledger.read()["tickets"] if t["state"] == "waiting"]
    left_file = tmp_path / (left[1:] + ".wake")
    assert stat.S_ISSOCK(os.lstat(left_file).st_mode)
    killed.kill()
    killed.wait()

    ticket = holder.enqueue(Resources(), "next")
    assert ticket.state == "waiting"
    assert not left_file.exists()
    holder.release(ticket)
    holder.release(held)


def test_a_burst_of_wakes_is_taken_at_once_and_costs_one_look(tmp_path, monkeypatch):
    """Guards against a flood of wakes, even of this user's, costing a look each."""
    monkeypatch.setattr(fluksio_nb.ledger.queue, "LOOK_EVERY_S", 60)
    holder = MachineQueue(tmp_path, inventory(cpus=1, gpus=0))
    held = holder.enqueue(Resources(), "holding")
    ticket = holder.enqueue(Resources(), "waiting")
    waker = holder._wakers[ticket.number]
    wake(holder.ledger, [waker.address] * 5)

    waker.sleep(60)  # would sleep the full minute if the wakes were lost
    assert waker.accepted == 5
    assert select.select([waker.socket], [], [], 0)[0] == [], "wakes left for a second look"
    holder.release(ticket)
    holder.release(held)


def test_a_ledger_too_deep_for_a_socket_address_still_wakes_its_waiters(tmp_path, monkeypatch):
    """Guards against a long ledger path (sun_path holds 108 bytes) losing the wake-up."""
    deep = tmp_path / ("d" * 120) / ("e" * 120)
    waiting = waiting_in_a_thread(deep, monkeypatch)
    waker = waiting.queue._wakers[waiting.ticket.number]
    waiting.free()
    assert (waker.accepted, waiting.looks) == (1, [1])
    waiting.queue.release(waiting.ticket)
