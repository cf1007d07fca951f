"""On cgroup v2 a claim's processes open only its own cards, held by a BPF device program.

This machine runs cgroup v1, with the v2 hierarchy present but mounted
nowhere (``/proc/self/cgroup`` has ``0::/``). So each test mounts cgroup2 on
a directory of its own, finds the place for cards' cgroups through the same
function the package uses (:func:`fluksio_nb.card_devices.find_devices_place`,
told where the hierarchy is mounted and given a ``/proc/self/cgroup`` with
no v1 devices line, as a v2-only machine has), and makes the cards' device
nodes itself (``mknod``, character major 195). A device program acts on the
node's numbers, not its path: a denied card's node gives ``EPERM``, one the
process may open, with no driver behind it, ``ENXIO`` or ``ENODEV``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fluksio_nb.budget import CGROUP_V2
from fluksio_nb.card_devices import (
    cards_held_here,
    find_devices_place,
    hold_away_from_cards,
    hold_cards,
)
from fluksio_nb.card_devices_v2 import bpf_refusal, load
from fluksio_nb.memory_cap import CapPlace
from tests.unix_users import USER_A, ready_user, run_as

pytestmark = pytest.mark.timeout(120)

EPERM = errno.errorcode[errno.EPERM]
NO_DRIVER = {errno.errorcode[errno.ENXIO], errno.errorcode[errno.ENODEV]}

#: The minors a test makes nodes for: cards 0 and 1, nvidia-modeset, nvidiactl.
MINORS = (0, 1, 254, 255)


def _needs_root_and_bpf() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: mount of cgroup2, mknod, and loading a BPF device program")
    if (refused := bpf_refusal()) is not None:
        pytest.skip(f"needs bpf() for a cgroup device program, which is refused here: {refused}")


@pytest.fixture
def cgroup2() -> Iterator[Path]:
    """cgroup2 mounted on a directory of the test's own, unmounted at the end."""
    _needs_root_and_bpf()
    where = Path(tempfile.mkdtemp(prefix="fluksio-cgroup2-", dir="/tmp"))
    mounted = subprocess.run(
        ["mount", "-t", "cgroup2", "none", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"needs cgroup2 mounted, which failed here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
        where.rmdir()


@pytest.fixture
def nodes() -> Iterator[Path]:
    """A directory of character nodes ``195:N`` named ``nvidiaN``, for N in :data:`MINORS`."""
    with tempfile.TemporaryDirectory(prefix="fluksio-cards-", dir="/tmp") as where:
        for minor in MINORS:
            path = f"{where}/nvidia{minor}"
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
        yield Path(where)


def v2_place(cgroup2: Path, tmp_path: Path) -> CapPlace:
    """The place the package finds on a v2-only machine, with the hierarchy at ``cgroup2``."""
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text("0::/\n")  # this process's own: the v2 root, as here
    return find_devices_place(root=cgroup2, proc_cgroup=proc_cgroup)


OPENS = (
    "import errno, json, os, sys\n"
    "def _open(path):\n"
    "    try:\n"
    "        os.close(os.open(path, os.O_RDWR))\n"
    "        return 'opened'\n"
    "    except OSError as e:\n"
    "        return errno.errorcode[e.errno]\n"
    "print(json.dumps({m: _open(f'{sys.argv[1]}/nvidia{m}') for m in (0, 1, 254, 255)}))\n"
)


def opened_inside(cgroup: Path, nodes: Path) -> dict[str, str]:
    """What opening each node gives a real child process started inside ``cgroup``."""

    def enter() -> None:
        fd = os.open(cgroup / "cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    ran = subprocess.run(
        [sys.executable, "-c", OPENS, str(nodes)],
        preexec_fn=enter,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(ran.stdout)


def test_a_cgroup_v2_claim_granted_card_1_of_2_cannot_open_card_0(cgroup2, nodes, tmp_path):
    """Guards against a claim on a cgroup v2 machine opening another claim's card's node.

    Before, v2 loaded no program: the place said the variable only, and a
    process that opened ``/dev/nvidia0`` itself reached any card. The program
    is in force after its descriptor closed (nothing is pinned), holds only
    card nodes (the control nodes stay open), says so in the status's words,
    and goes with the claim's cgroup.
    """
    place = v2_place(cgroup2, tmp_path)
    assert place.version == CGROUP_V2, place.why_not
    assert str(cards_held_here(place)) == "device program (cgroup v2)"
    held = hold_cards(place, [1])
    try:
        assert held.path.parent == cgroup2 / "fluksio_nb"
        opened = opened_inside(held.path, nodes)
        assert opened["0"] == EPERM, opened
        assert opened["1"] in NO_DRIVER, opened
        assert opened["254"] != EPERM and opened["255"] != EPERM, opened
        # Outside the claim's cgroup nothing is held.
        outside = opened_inside(cgroup2, nodes)
        assert outside["0"] in NO_DRIVER, outside
    finally:
        held.remove()
    assert not held.path.exists()


def test_a_card_program_on_a_claims_v2_cgroup_narrows_what_is_there_never_widens(
    cgroup2, nodes, tmp_path
):
    """Guards against a claim's program on a shared v2 cgroup replacing the one already there.

    On v2 a process is in one cgroup, so the cards' program goes on the
    claim's cgroup that holds its memory or cores; attached without
    ``BPF_F_ALLOW_MULTI`` it would fail, or replace, the one above. Here a
    cgroup already holding card 0 alone is also given card 1 alone: neither
    card opens.
    """
    place = v2_place(cgroup2, tmp_path)
    assert place.version == CGROUP_V2, place.why_not
    first = hold_cards(place, [0])
    try:
        assert hold_cards(place, [1], share=first) is first
        opened = opened_inside(first.path, nodes)
        assert (opened["0"], opened["1"]) == (EPERM, EPERM), opened
        assert opened["255"] != EPERM, opened
    finally:
        first.remove()


def test_a_v2_kernel_held_away_from_cards_opens_none_and_its_claim_opens_its_own(
    cgroup2, nodes, tmp_path
):
    """Guards against a kernel kept off cards on v2 reaching one, or taking its claims' away.

    A program holds every cgroup below the one it is on: were a claim's
    cgroup made below its kernel's, the kernel's deny-all would deny the
    claim's own card too. The claim's goes beside it.
    """
    place = v2_place(cgroup2, tmp_path)
    kernel = hold_away_from_cards(place)
    try:
        in_kernel = opened_inside(kernel.path, nodes)
        assert (in_kernel["0"], in_kernel["1"]) == (EPERM, EPERM), in_kernel
        assert in_kernel["255"] != EPERM, in_kernel
        kernels_cgroup = tmp_path / "kernel-cgroup"
        kernels_cgroup.write_text(f"0::/{kernel.path.relative_to(cgroup2)}\n")
        from_kernel = find_devices_place(root=cgroup2, proc_cgroup=kernels_cgroup)
        assert from_kernel.parent == kernel.path.parent, from_kernel
        claim = hold_cards(from_kernel, [1])
        try:
            in_claim = opened_inside(claim.path, nodes)
            assert in_claim["0"] == EPERM and in_claim["1"] in NO_DRIVER, in_claim
        finally:
            claim.remove()
    finally:
        kernel.remove()


def test_a_v2_kernel_under_kernel_ram_is_held_away_from_cards_in_that_one_cgroup(
    cgroup2, nodes, tmp_path
):
    """Guards against a kernel under both kernel_ram and unclaimed_cards: false on v2 being
    moved out of its memory cgroup into a second one for its cards: a process is in one v2
    cgroup, so the program goes on the kernel_ram cgroup, which is the one returned."""
    place = v2_place(cgroup2, tmp_path)
    kernel_ram = hold_cards(place, [0, 1])  # stands in for the kernel's memory cgroup
    try:
        assert opened_inside(kernel_ram.path, nodes)["0"] in NO_DRIVER
        assert hold_away_from_cards(place, share=kernel_ram) is kernel_ram
        in_kernel = opened_inside(kernel_ram.path, nodes)
        assert (in_kernel["0"], in_kernel["1"]) == (EPERM, EPERM), in_kernel
        # This process's own: the hierarchy is the machine's, and a suite
        # running beside this one makes its tests' cgroups in the same place.
        ours = re.compile(rf"fluksio_nb-(kernel-)?{os.getpid()}-")
        made = [p.name for p in (cgroup2 / "fluksio_nb").iterdir() if ours.match(p.name)]
        assert made == [kernel_ram.path.name], "no second cgroup for the cards"
    finally:
        kernel_ram.remove()


@pytest.mark.parametrize("granted", [(), (1,), tuple(range(8))])
def test_the_device_program_passes_the_kernels_verifier(granted):
    """Guards against an instruction encoded wrong: the kernel's verifier refuses the program.

    0, 1 and 8 granted cards: the jumps' offsets change with each.
    """
    _needs_root_and_bpf()
    fd = load(granted)
    try:
        assert fd >= 0
    finally:
        os.close(fd)


def test_where_bpf_is_refused_cards_are_held_by_the_variable_only_and_why(cgroup2):
    """Guards against a user who may not load a program being told a program holds their cards.

    A Unix user of no privilege, given a delegated v2 subtree (theirs to make
    cgroups in), gets ``EPERM`` from ``bpf()``: the place the package finds
    says so, and the status says ``CUDA_VISIBLE_DEVICES only`` with that reason.
    """
    user = ready_user(USER_A)
    delegated = cgroup2 / f"fluksio-test-delegated-{os.getpid()}"
    own = delegated / "kernel"
    own.mkdir(parents=True)
    try:
        for path in (delegated, delegated / "cgroup.procs", own, own / "cgroup.procs"):
            os.chown(path, user.uid, user.gid)
        with tempfile.NamedTemporaryFile("w", prefix="fluksio-cgroup-", dir="/tmp") as proc:
            proc.write(f"0::/{own.relative_to(cgroup2)}\n")
            proc.flush()
            os.chmod(proc.name, 0o644)
            ran = run_as(
                user,
                "import json\n"
                "from pathlib import Path\n"
                "from fluksio_nb.card_devices import cards_held_here, find_devices_place\n"
                f"place = find_devices_place(Path({str(cgroup2)!r}), Path({proc.name!r}))\n"
                "print(json.dumps(cards_held_here(place).as_dict()))\n",
            )
        assert ran.returncode == 0, ran.stderr
        held = json.loads(ran.stdout)
        assert held["label"] == "CUDA_VISIBLE_DEVICES only", held
        assert "refused to load a cgroup v2 device program" in held["why"], held
        assert os.strerror(errno.EPERM) in held["why"], held
    finally:
        own.rmdir()
        delegated.rmdir()
