"""A claim's processes open only its own cards; where the admin says so, kernels open none.

The machine has no card and no driver, so each test makes the cards' device
nodes itself (``mknod``, character major 195, minor N for card N) in a
directory of its own, and declares two cards (``FLUKSIO_GPUS=2``, or the
machine's ``--gpus 2``). A device cgroup acts on the node's numbers, not its
path: opening a denied card's node fails with ``EPERM``, and a card the
process may open, with no driver behind it, with ``ENXIO`` or ``ENODEV``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fluksio_nb.budget import CGROUP_V1
from fluksio_nb.card_devices import CARD_MAJOR, card_node, find_devices_place
from fluksio_nb.inventory import KERNEL_NAME
from fluksio_nb.machine.setup import MachineConfig, MachineSetupError, read_config
from fluksio_nb.memory_cap import CapPlace, find_cap_place, process_start
from tests.kernels import started_kernel
from tests.machines import fluksio_nb, machine, machine_env
from tests.stops import said_by
from tests.unix_users import USER_A, ready_user
from tests.waiting import gone, wait_until

pytestmark = pytest.mark.timeout(180)

PROVISIONER = "fluksio-fair-share"


def devices_place_here() -> CapPlace:
    found = find_devices_place()
    if not found.available:
        pytest.skip(f"needs a devices cgroup, which cannot be made here: {found.why_not}")
    return found


@pytest.fixture
def cards() -> Iterator[Path]:
    """A directory holding nodes ``nvidia0`` and ``nvidia1`` with the driver's numbers."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mknod of a character device")
    with tempfile.TemporaryDirectory(prefix="fluksio-cards-", dir="/tmp") as where:
        os.chmod(where, 0o755)  # for a kernel of another user, too
        for card in (0, 1):
            _, major, minor = card_node(card)
            os.mknod(f"{where}/nvidia{card}", 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(f"{where}/nvidia{card}", 0o666)  # as the driver makes them, past the umask
        yield Path(where)


def opens(cards: Path) -> str:
    """Lines of a cell that print, as JSON, what opening each card's node gives, card by card."""
    return (
        "import errno, json, os\n"
        "def _open(n):\n"
        "    try:\n"
        f"        os.close(os.open({str(cards)!r} + f'/nvidia{{n}}', os.O_RDWR))\n"
        "        return 'opened'\n"
        "    except OSError as e:\n"
        "        return errno.errorcode[e.errno]\n"
        "print(json.dumps([_open(0), _open(1)]), flush=True)\n"
    )


NO_DRIVER = {errno.errorcode[errno.ENXIO], errno.errorcode[errno.ENODEV]}


def made_by(parent: Path, pid: int) -> list[str]:
    if not parent.is_dir():
        return []
    return [p.name for p in parent.iterdir() if p.name.startswith(f"fluksio_nb-{pid}-")]


def test_a_claim_granted_card_1_of_2_cannot_open_card_0(cards, tmp_path):
    """Guards against a claim's process using another claim's card by opening its node.

    ``CUDA_VISIBLE_DEVICES`` holds only CUDA; a process that opens the node
    itself, or a child that unsets the variable, reached any card. The claim's
    children are held too, every view says a devices cgroup holds its cards,
    and the cgroup goes with the claim.
    """
    place = devices_place_here()
    assert place.parent is not None
    with started_kernel(tmp_path, FLUKSIO_GPUS="2", FLUKSIO_RESERVE_CPUS="0") as kernel:
        kernel.run(
            "from fluksio_nb import claim\nfirst = claim(gpus=1, label='card 0').__enter__()\n"
            "assert first.allocation.gpus == (0,), first.allocation",
            check=True,
        )
        # The card-0 claim started no worker, and holds its cgroup until it is given back.
        before = made_by(place.parent, kernel.pid)
        cell = (
            "%%claim gpus=1\n"
            + opens(cards)
            + "import subprocess, sys\n"
            + "print(subprocess.run([sys.executable, '-c', "
            + repr(opens(cards))
            + "], capture_output=True, text=True, check=True).stdout, flush=True)\n"
            + "print(os.environ['CUDA_VISIBLE_DEVICES'])\n"
        )
        ran = kernel.run(cell, check=True)
        lines = [line for line in ran.stdout.splitlines() if line]
        worker, child, visible = json.loads(lines[0]), json.loads(lines[1]), lines[2]
        assert visible == "1"
        assert worker[0] == "EPERM", f"the claim opened card 0, another claim's: {worker}"
        assert worker[1] in NO_DRIVER, f"the claim could not open its own card 1: {worker}"
        assert child[0] == "EPERM" and child[1] in NO_DRIVER, child
        assert any("gpus=1 (card 1, devices cgroup v1)" in text for text in ran.texts), ran.texts
        held = kernel.books()["enforcement"]["cards"]
        assert (held["label"], held["by"]) == ("devices cgroup v1", "devices cgroup v1")
        assert made_by(place.parent, kernel.pid) == before, "the claim's devices cgroup outlived it"
        kernel.run("first.__exit__(None, None, None)", check=True)
        assert made_by(place.parent, kernel.pid) == []


#: A cell that prints, one a line, how each view says a claim's cards are held: the
#: claim's share, its widget's "held by" row, and the "held by" line of the books'
#: snapshot (the panel's, the widget's and ``%claims``'s) and of the terminal's text.
EVERY_VIEWS_WORDS = """
import fluksio_nb
from fluksio_nb import claim
from fluksio_nb.overview import describe_snapshot, read_books
from fluksio_nb.status import describe
from fluksio_nb.widget.facts import enforcement_facts
with claim(gpus=1, label='held') as c:
    c.run(int)
    print(describe(c.status))
    print(enforcement_facts(c.status)['cards']['label'])
    snapshot = read_books()
    print(snapshot['enforcement']['cards']['label'])
    print([line for line in describe_snapshot(snapshot).splitlines() if 'held by' in line][0])
"""


def test_every_view_names_how_a_claims_cards_are_held_in_the_same_words(tmp_path):
    """Guards against views that disagree on what holds a claim to its cards.

    The claim's share said "devices cgroup v1", the "held by" line "own
    cards (devices cgroup v1)", and the claim's own widget nothing at all:
    a reader comparing them could not tell that one cgroup held them all.
    """
    place = devices_place_here()
    with started_kernel(tmp_path, FLUKSIO_GPUS="2", FLUKSIO_RESERVE_CPUS="0") as kernel:
        share, widget, books, terminal = kernel.run(EVERY_VIEWS_WORDS, check=True).stdout.split(
            "\n"
        )[:4]
    words = f"devices {place.version}"
    assert f"gpus=1 (card 0, {words})" in share, share
    assert widget == words
    assert books == words
    assert f"cards: {words}" in terminal, terminal


def test_a_killed_kernels_worker_removes_its_claims_devices_cgroup(tmp_path):
    """Guards against a claim's devices cgroup left for good by a kernel killed as it ran."""
    place = devices_place_here()
    assert place.parent is not None
    with started_kernel(tmp_path, FLUKSIO_GPUS="2", FLUKSIO_RESERVE_CPUS="0") as kernel:
        msg_id = kernel.client.execute(
            "%%claim gpus=1\nimport os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)"
        )
        kernel.wait_for_output(msg_id, "\n")
        (made,) = made_by(place.parent, kernel.pid)
        worker = int((place.parent / made / "cgroup.procs").read_text().split()[0])
        os.kill(kernel.pid, signal.SIGKILL)
        assert gone(worker, within=30)
        assert wait_until(lambda: not (place.parent / made).exists()), f"{made} outlived its claim"


def test_a_claim_without_cards_opens_none_on_a_machine_with_cards(cards, tmp_path):
    """Guards against a cell that claimed no card using any card it likes."""
    devices_place_here()
    with started_kernel(tmp_path, FLUKSIO_GPUS="2", FLUKSIO_RESERVE_CPUS="0") as kernel:
        got = json.loads(kernel.run("%%claim cpus=1\n" + opens(cards), check=True).stdout)
        assert got == ["EPERM", "EPERM"]


def test_a_kernel_under_unclaimed_cards_false_opens_no_card_and_its_claim_opens_its_own(
    cards, tmp_path
):
    """Guards against a squatter among Jupyter kernels where the admin keeps cards to claims.

    The kernel is launched by fluksio_nb's provisioner, as a Jupyter server
    launches it. Its claim's worker is the kernel's child, and must leave the
    kernel's cgroup, which opens no card, for its claim's own. The kernel's
    cgroup is named after it, and goes with it.
    """
    place = devices_place_here()
    assert place.parent is not None
    with machine(cpus=2, gpus=2, config={"unclaimed_cards": False}) as layout:
        said = fluksio_nb(
            "machine", "status", "--prefix", str(layout.prefix), env=machine_env(layout)
        ).stdout
        assert "cards are used through claims only: kernels Jupyter starts open none" in said
        with started_kernel(
            tmp_path, provisioner=PROVISIONER, **machine_env(layout, FLUKSIO_GPUS="2")
        ) as kernel:
            unclaimed = json.loads(kernel.run(opens(cards), check=True).stdout)
            assert unclaimed == ["EPERM", "EPERM"], (
                f"an unclaimed kernel opened a card: {unclaimed}"
            )
            claimed = json.loads(kernel.run("%%claim gpus=1\n" + opens(cards), check=True).stdout)
            assert claimed[0] in NO_DRIVER, f"the claim could not open its own card 0: {claimed}"
            assert claimed[1] == "EPERM", claimed
            # What the kernel starts unclaimed is held as the kernel is.
            child = kernel.run(
                "import subprocess, sys\n"
                f"print(subprocess.run([sys.executable, '-c', {opens(cards)!r}], "
                "capture_output=True, text=True).stdout)",
                check=True,
            )
            assert json.loads(child.stdout) == ["EPERM", "EPERM"]
            # Named after the kernel, so that it is swept only once the kernel is gone.
            assert made_by(place.parent, kernel.pid) == [
                f"fluksio_nb-{kernel.pid}-{process_start(kernel.pid)}-0"
            ], "the kernel's cgroup is not its own, or its claim's outlived the claim"
        assert wait_until(lambda: not made_by(place.parent, kernel.pid)), (
            "the kernel's devices cgroup outlived it"
        )


def test_a_kernel_under_kernel_ram_and_unclaimed_cards_false_is_held_by_both(cards, tmp_path):
    """Guards against one of the admin's two rules undoing the other as the kernel starts.

    Both put the kernel in a cgroup before it runs a line, each by the
    launch's ``preexec_fn``: the one set last replaced the other, and the
    kernel ran with no memory cap, or able to open every card.
    """
    place = devices_place_here()
    assert place.parent is not None
    if not find_cap_place().available:
        pytest.skip(f"needs a memory cgroup: {find_cap_place().why_not}")
    config = {"unclaimed_cards": False, "kernel_ram": "400M"}
    with machine(cpus=2, gpus=2, config=config) as layout:
        with started_kernel(
            tmp_path, provisioner=PROVISIONER, **machine_env(layout, FLUKSIO_GPUS="2")
        ) as kernel:
            memory = kernel.facts(
                "[line.rsplit('/', 1)[-1] for line in open('/proc/self/cgroup').read().split()"
                " if line.split(':')[1] == 'memory'][0]"
            )
            assert KERNEL_NAME.match(memory), (
                f"the kernel is outside its kernel_ram cgroup: {memory}"
            )
            unclaimed = json.loads(kernel.run(opens(cards), check=True).stdout)
            assert unclaimed == ["EPERM", "EPERM"], (
                f"an unclaimed kernel opened a card: {unclaimed}"
            )
            claimed = json.loads(kernel.run("%%claim gpus=1\n" + opens(cards), check=True).stdout)
            assert claimed[0] in NO_DRIVER and claimed[1] == "EPERM", claimed
        assert wait_until(lambda: not made_by(place.parent, kernel.pid)), (
            "the kernel's devices cgroup outlived it"
        )


def test_where_no_devices_cgroup_can_be_made_every_view_says_the_variable_alone_holds_cards(
    cards,
):
    """Guards against a claim said to be held to its cards where only the variable holds it.

    A kernel of a user who may make no cgroup (cgroup v1's hierarchy is
    root's) cannot hold its claims to their cards: its claim's status and the
    books' "held by" line say ``CUDA_VISIBLE_DEVICES`` alone does, and why.
    """
    with started_kernel(user=ready_user(USER_A), FLUKSIO_GPUS="2") as kernel:
        held = kernel.books()["enforcement"]["cards"]
        assert held["label"] == "CUDA_VISIBLE_DEVICES only", held
        assert "may not make cgroups" in held["why"], held
        ran = kernel.run("%%claim gpus=1\n" + opens(cards), check=True)
        assert set(json.loads(ran.stdout)) <= NO_DRIVER, "nothing here could hold the card"
        assert any("gpus=1 (card 0, CUDA_VISIBLE_DEVICES only)" in t for t in ran.texts), ran.texts


def test_unclaimed_cards_is_true_or_false_and_says_how_to_fix_it(tmp_path):
    """Guards against ``"unclaimed_cards": "no"`` read as true, or refused without a word why."""
    assert MachineConfig.model_validate({"unclaimed_cards": False}).unclaimed_cards is False
    assert MachineConfig().unclaimed_cards is True
    from fluksio_nb.machine.setup import Layout

    layout = Layout(tmp_path)
    layout.config.parent.mkdir(parents=True)
    layout.config.write_text(json.dumps({"unclaimed_cards": "no"}))
    with pytest.raises(MachineSetupError, match="unclaimed_cards is true or false, not 'no'"):
        read_config(layout)


def test_a_kernel_held_off_cards_has_its_claims_cgroups_made_beside_it(tmp_path):
    """Guards against a claim's cgroup made below a kernel that may open no card.

    A v1 child cgroup opens no more than its parent: the claim could then
    never open its own card.
    """
    root = tmp_path / "cgroup"
    kernel = root / "devices" / "fluksio_nb" / "fluksio_nb-10-20-1"
    kernel.mkdir(parents=True)
    for directory in (root / "devices", kernel):
        (directory / "devices.deny").write_text("")
        (directory / "cgroup.procs").write_text("")
    proc = tmp_path / "cgroup-of-the-kernel"
    proc.write_text("5:devices:/fluksio_nb/fluksio_nb-10-20-1\n0::/\n")
    found = find_devices_place(root, proc)
    if not found.available and "may be changed by other users" in found.why_not:
        pytest.skip(f"the test's own directories are shared: {found.why_not}")
    assert found == CapPlace(CGROUP_V1, root / "devices" / "fluksio_nb", kernel)
    assert card_node(3) == (Path("/dev/nvidia3"), CARD_MAJOR, 3)


#: ``c.run`` in a block, on a machine declared to have two cards, stopped at every
#: moment of fluksio_nb's code, one moment a round: as the claim's devices cgroup is
#: made and denied every card (a claim with none opens none), as a worker starts (the one a stop
#: killed) or a warm one is handed over and moved in, as it runs the call and goes
#: back to its pool, and as the claim ends. After each, no devices cgroup of this
#: process's may be left, nor a share, nor a worker out of the pool. The books
#: are the kernel's own (see :mod:`tests.stops`).
STOP_AT_EVERY_MOMENT_OF_A_CARD_CLAIM = """
import glob, os
os.environ["FLUKSIO_LEDGER"] = "kernel"
os.environ["FLUKSIO_GPUS"] = "2"
os.environ["FLUKSIO_RESERVE_CPUS"] = "0"
import fluksio_nb
import fluksio_nb.lifecycle
from fluksio_nb import claim

with claim(cpus=1, label="warm") as c:
    c.run(int)
assert not devices_cgroups_left(), "a claim that ended as it should left its cgroup"

def attempt(made):
    # No card: a gpus=1 claim starts a worker of its own every time (its
    # CUDA_VISIBLE_DEVICES is in its env), a second a round; its cgroup is made,
    # entered and removed as this one's is.
    with claim(cpus=1, label="stopped") as c:
        c.run(int)

def check():
    return what_a_claim_left(False)

here = os.path.dirname(fluksio_nb.__file__)
watched = glob.glob(os.path.join(here, "**", "*.py"), recursive=True)
beyond_reach = [(fluksio_nb.lifecycle.__file__, "__exit__")]
each_moment(watched, attempt, lambda made: None, check, beyond_reach, forgotten=True)
"""


@pytest.mark.timeout(900)
def test_a_stop_at_any_moment_of_a_card_claim_leaves_no_devices_cgroup():
    """Guards against the stop button landing as a claim's devices cgroup was made or its
    worker started, handed over or moved in: the cgroup left for good, one more each
    time, until every new claim's sweep of the directory walked a thousand of them."""
    place = devices_place_here()
    assert place.parent is not None
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_CARD_CLAIM, timeout=900)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 500, said
