"""Memory the kernel enforces: a claim's ``ram=`` as a real cgroup limit.

The failures guarded against: an allocation faster than the sampler's half
second taking a claim far past its budget; a claim the out-of-memory killer
stopped reported as a crash, or taking the kernel down with it; a claim's
cgroup left behind after any ending, piling up for as long as the machine
runs; a sweep that removes a live kernel's cgroup; and a detection that
offers a cap where none can be made, or refuses one where it can.

Detection is tried on trees of real files laid out as the kernel lays them
out, as the inventory tests do. Everything else uses the machine's own memory
cgroups, real kernels and real workers, and skips, saying what is missing,
where this process may not make a child memory cgroup.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from fluksio_nb.budget import CGROUP_V1, CGROUP_V2, SAMPLER
from fluksio_nb.claim_cgroups import CLAIM_NAME, remove_cgroup
from fluksio_nb.errors import BadSettings
from fluksio_nb.memory_cap import (
    WATCHED,
    CapPlace,
    ClaimCgroup,
    find_cap_place,
    memory_enforcement,
    process_start,
    sweep_stale,
)
from fluksio_nb.settings import Settings, load_settings
from tests.kernels import Kernel
from tests.machines import wait_until
from tests.stops import said_by
from tests.unix_users import (
    REPO_ROOT,
    USER_A,
    USER_B,
    as_user,
    ready_user,
    shared_tmp_dir,
    user_environ,
)
from tests.waiting import gone

pytestmark = pytest.mark.timeout(240)

GB = 10**9


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -----------------------------------------------------------------------------
# Detection, on trees of real files
# -----------------------------------------------------------------------------


def v1_tree(base):
    """A cgroup v1 process in /pod/kernel, with v2 mounted beside it without controllers."""
    root = base / "cgroup"
    proc = write(base / "proc-cgroup", "4:memory:/pod/kernel\n1:cpu,cpuacct:/\n0::/\n")
    write(root / "memory" / "pod" / "kernel" / "memory.limit_in_bytes", "9223372036854771712")
    write(root / "memory" / "pod" / "kernel" / "cgroup.procs", "")
    write(root / "unified" / "cgroup.controllers", "hugetlb\n")
    write(root / "unified" / "cgroup.subtree_control", "")
    return root, proc


def v2_tree(base, handed_down="cpu memory pids"):
    """A systemd user's kernel scope: app.slice hands controllers down to it."""
    root = base / "cgroup"
    app = root / "user.slice" / "user-1000.slice" / "user@1000.service" / "app.slice"
    proc = write(
        base / "proc-cgroup", "0::/user.slice/user-1000.slice/user@1000.service/app.slice/k.scope\n"
    )
    write(root / "cgroup.controllers", "cpu io memory pids\n")
    write(root / "cgroup.subtree_control", "cpu io memory pids\n")
    write(app / "cgroup.subtree_control", handed_down + "\n")
    write(app / "cgroup.procs", "")
    write(app / "k.scope" / "cgroup.controllers", handed_down + "\n")
    write(app / "k.scope" / "cgroup.procs", "4242\n")
    return root, proc, app


def test_a_v1_memory_cgroup_holds_the_claims_under_the_process_own(tmp_path):
    root, proc = v1_tree(tmp_path)
    own = root / "memory" / "pod" / "kernel"
    assert find_cap_place(root, proc) == CapPlace(CGROUP_V1, own / "fluksio_nb", own)


def test_a_delegated_v2_subtree_holds_the_claims_beside_the_kernel(tmp_path):
    """v2 forbids processes in a cgroup that hands controllers down: not under the kernel's own."""
    root, proc, app = v2_tree(tmp_path)
    assert find_cap_place(root, proc) == CapPlace(CGROUP_V2, app / "fluksio_nb", app / "k.scope")


def test_v2_without_memory_handed_down_is_no_cap_and_says_why(tmp_path):
    root, proc, app = v2_tree(tmp_path, handed_down="cpu pids")
    place = find_cap_place(root, proc)
    assert not place.available
    assert "does not hand the memory controller down" in place.why_not
    assert str(app) in place.why_not


def test_the_v2_root_cgroup_holds_the_claims_under_itself(tmp_path):
    root = tmp_path / "cgroup"
    proc = write(tmp_path / "proc-cgroup", "0::/\n")
    write(root / "cgroup.controllers", "cpu memory\n")
    write(root / "cgroup.subtree_control", "memory\n")
    write(root / "cgroup.procs", "1\n")
    assert find_cap_place(root, proc) == CapPlace(CGROUP_V2, root / "fluksio_nb", root)


def test_no_memory_controller_anywhere_is_no_cap_and_says_why(tmp_path):
    """This machine's v2 mount: no controllers, and no v1 memory line."""
    root = tmp_path / "cgroup"
    proc = write(tmp_path / "proc-cgroup", "1:cpu:/\n0::/\n")
    write(root / "unified" / "cgroup.controllers", "hugetlb\n")
    write(root / "unified" / "cgroup.subtree_control", "")
    place = find_cap_place(root, proc)
    assert not place.available
    assert "does not hand the memory controller down" in place.why_not


def test_a_process_cgroup_the_mount_does_not_have_is_no_cap(tmp_path):
    """A container whose /proc/self/cgroup names its host's path, not its own mount's."""
    root, _ = v1_tree(tmp_path)
    proc = write(tmp_path / "elsewhere", "4:memory:/docker/abc\n")
    place = find_cap_place(root, proc)
    assert not place.available
    assert "/docker/abc is not under" in place.why_not


DETECT = (
    "import json, sys\nfrom pathlib import Path\nfrom fluksio_nb.memory_cap import find_cap_place\n"
    "p = find_cap_place(Path(sys.argv[1]), Path(sys.argv[2]))\n"
    "print(json.dumps([p.version, str(p.parent), p.why_not]))"
)


def detect_as(user, root, proc):
    """What detection finds when ``user`` runs it: a real process, with that user's rights."""
    done = subprocess.run(
        [*as_user(user), sys.executable, "-c", DETECT, str(root), str(proc)],
        capture_output=True,
        text=True,
        env=user_environ(user, {"PYTHONPATH": str(REPO_ROOT)}),
        cwd=user.home,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_only_a_subtree_delegated_to_the_user_is_offered_to_them():
    """Root owns the tree: another user may not make cgroups in it, until it is handed to them."""
    user = ready_user(USER_A)
    with shared_tmp_dir() as base:
        root, proc, app = v2_tree(base)
        for path in base.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        version, _, why = detect_as(user, root, proc)
        assert version is None
        assert "not delegated to this user" in why
        for path in (app, app / "cgroup.procs"):
            os.chown(path, user.uid, user.gid)
        version, parent, _ = detect_as(user, root, proc)
        assert (version, parent) == (CGROUP_V2, str(app / "fluksio_nb"))

        root, proc = v1_tree(base / "v1")
        for path in (base / "v1").rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        version, _, why = detect_as(user, root, proc)
        assert version is None and "may not make cgroups" in why


def test_which_one_holds_memory_is_a_value_with_its_reason(tmp_path):
    root, proc = v1_tree(tmp_path)
    capped = memory_enforcement(Settings(), find_cap_place(root, proc))
    assert (str(capped), capped.by, capped.capped) == ("enforced (cgroup v1)", CGROUP_V1, True)
    off = memory_enforcement(Settings(memory_cap=False), find_cap_place(root, proc))
    assert (str(off), off.by) == (WATCHED, SAMPLER) == ("watched every 0.5 s", "sampler")
    assert "memory_cap" in off.why
    nowhere = memory_enforcement(Settings(), find_cap_place(root, tmp_path / "no-such-file"))
    assert str(nowhere) == WATCHED and "cannot be read" in nowhere.why


# -----------------------------------------------------------------------------
# Settings
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"memory_warn_at": 0.9, "memory_halt_at": 0.8}, "memory_warn_at=0.9 must be above 0"),
        ({"memory_warn_at": 0}, "memory_warn_at=0 must be above 0"),
        ({"memory_halt_at": 1.5}, "memory_halt_at=1.5 must be above 0 and at most 1"),
    ],
)
def test_memory_stages_out_of_order_are_refused_naming_the_file(
    tmp_path, monkeypatch, values, words
):
    config = write(tmp_path / "fluksio_nb.json", json.dumps(values))
    monkeypatch.setenv("FLUKSIO_CONFIG", str(config))
    with pytest.raises(BadSettings) as caught:
        load_settings()
    assert str(config) in str(caught.value) and words in str(caught.value)


def test_the_memory_settings_come_from_the_file_and_the_environment(tmp_path, monkeypatch):
    config = write(tmp_path / "fluksio_nb.json", json.dumps({"memory_warn_at": 0.7}))
    monkeypatch.setenv("FLUKSIO_CONFIG", str(config))
    monkeypatch.setenv("FLUKSIO_MEMORY_CAP", "false")
    loaded = load_settings()
    assert (loaded.memory_cap, loaded.memory_warn_at, loaded.memory_halt_at) == (False, 0.7, 1.0)


# -----------------------------------------------------------------------------
# The machine's own cgroups
# -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def place():
    found = find_cap_place()
    if not found.available:
        pytest.skip(f"needs a child memory cgroup, which cannot be made here: {found.why_not}")
    return found


def claim_cgroups_of(place, pid):
    """The claim cgroups a kernel owns: only its own, as another run may share the parent."""
    if not place.parent.exists():
        return []
    return sorted(p.name for p in place.parent.iterdir() if p.name.startswith(f"fluksio_nb-{pid}-"))


@pytest.fixture
def kernels(place, tmp_path):
    """Start kernels with it; at the end, shut down and remove what any of them left."""
    started = []

    def start(config=None, **env):
        path = tmp_path / f"config-{len(started)}.json"
        if config is not None:
            path.write_text(json.dumps(config))
        kernel = Kernel(
            FLUKSIO_CPUS="2",
            FLUKSIO_RAM="8G",
            FLUKSIO_RESERVE_CPUS="0",
            FLUKSIO_CONFIG=str(path),
            FLUKSIO_LEDGER="kernel",
            **env,
        )
        started.append(kernel)
        return kernel

    yield start
    for kernel in started:
        try:
            kernel.shutdown()
        finally:
            for name in claim_cgroups_of(place, kernel.pid):
                remove_cgroup(place.parent / name)


def test_a_fast_allocation_is_stopped_at_its_budget_by_the_kernel(kernels, place):
    """numpy.ones fills 2 GB in well under the sampler's half second: only the cap holds it."""
    kernel = kernels()
    facts = kernel.run(
        "import json, numpy\nfrom fluksio_nb import claim\n"
        "from fluksio_nb.errors import ClaimHalted\n"
        "try:\n"
        "    with claim(ram='300M') as c:\n"
        "        c.run(numpy.ones, 2 * 2**30 // 8)\n"
        "except ClaimHalted as halted:\n"
        "    print(json.dumps({'by': halted.decision.enforced_by, 'message': str(halted),\n"
        "        'peak': c.status.readings.peak_rss_bytes, 'ending': c.status.ending,\n"
        "        'enforcement': str(c.status.memory_enforcement)}))",
        check=True,
    ).json()
    assert facts["by"] == place.version
    assert facts["enforcement"] == f"enforced ({place.version})"
    assert facts["ending"] == "halted"
    assert 0 < facts["peak"] <= 315 * 10**6, facts
    assert f"stopped by the kernel's memory cap ({place.version})" in facts["message"]

    ran = kernel.run("%%claim ram=300M\nimport numpy\nblock = numpy.ones(2 * 2**30 // 8)")
    assert ran.error["ename"] == "ClaimHalted"
    message = "".join(ran.error["traceback"])
    assert "its memory budget of 300.0MB" in message
    assert f"kernel's memory cap ({place.version})" in message
    assert kernel.run("6 * 7", check=True).texts == ["42"], "the kernel must answer after the cap"
    assert claim_cgroups_of(place, kernel.pid) == []


def test_the_shared_memory_results_go_back_in_is_not_charged_to_the_claim(kernels, place):
    """Guards against the cap counting the copy the kernel receives: pages written in /dev/shm
    are charged to the cgroup of whoever writes them, so a cell keeping a 320 MB array under
    ram=500M was killed writing a second 320 MB that is the kernel's from then on."""
    kernel = kernels()
    ran = kernel.run("%%claim ram=500M\nimport numpy\nblock = numpy.ones(40_000_000)")
    assert ran.status == "ok", ran.so_far()
    assert any(f"(capped, {place.version})" in text for text in ran.texts), ran.texts
    assert kernel.facts("[float(block.sum()), block.nbytes]") == [40_000_000.0, 320_000_000]


def test_a_copy_back_that_crosses_the_cap_says_so_naming_what_was_copied(kernels, place):
    """Guards against blaming the cell's code for the copy back: text has no buffer to travel
    in, so pickling 300 MB of it copies it inside the claim, past ram=500M. The stop must say
    the copy back did it, name what was copied and how big, and say how to send less."""
    kernel = kernels()
    ran = kernel.run("%%claim ram=500M\ntext = 'x' * 300_000_000\nsmall = 1")
    assert ran.error["ename"] == "ClaimHalted", ran.so_far()
    message = "".join(ran.error["traceback"])
    assert (
        "stopped while its results were copied back to the kernel, after the cell's code had run"
        in message
    )
    assert "copying text (about 300.0MB) and small (about 28B) took the worker to" in message
    assert f"stopped by the kernel's memory cap ({place.version})" in message
    assert "(--out NAMES)" in message
    assert kernel.facts("'text' in dir()") is False


def test_a_budget_below_what_the_worker_already_holds_is_halted_before_the_cell_runs(
    kernels, place
):
    """Guards against a claim the cap cannot hold running unbounded: what a worker holds
    as it comes in stays charged elsewhere, so ram=10M capped only what came after."""
    kernel = kernels()
    ran = kernel.run("%%claim ram=10M --label tiny\nprint('ran')")
    assert ran.error["ename"] == "ClaimHalted"
    message = "".join(ran.error["traceback"])
    assert "stopped before it ran: its worker alone holds" in message
    assert "over the claim's memory budget of 10.0MB. Ask for more with ram=." in message
    assert "ran" not in ran.stdout
    assert kernel.books()["running"] == []
    assert kernel.run("%%claim ram=1G\nprint('ran')", check=True).stdout == "ran\n"
    assert claim_cgroups_of(place, kernel.pid) == []


def test_a_warm_worker_that_grew_into_the_budget_is_passed_over_for_a_fresh_one(kernels, place):
    """Guards against what earlier cells left in a warm worker counting against a later
    claim's ram=: halted for 300 MB it never allocated, cell after cell."""
    kernel = kernels()
    kernel.run(
        "%%claim\nimport os, sys\n"
        # A cache an earlier cell filled: it stays with the worker's modules.
        "sys.modules['_filled_cache'] = b'x' * (300 << 20)\nfirst = os.getpid()",
        check=True,
    )
    ran = kernel.run(
        "%%claim ram=400M\nimport os\nsecond = os.getpid()\nroom = len(b'y' * (200 << 20))",
        check=True,
    )
    assert "started a worker" in ran.texts[-1], ran.texts
    assert kernel.facts("[first != second, room]") == [True, 200 << 20]
    # A claim with no budget still takes the warm worker, cache and all.
    kernel.run("%%claim\nimport os\nthird = os.getpid()", check=True)
    assert kernel.facts("third in (first, second)") is True
    assert claim_cgroups_of(place, kernel.pid) == []


def test_with_the_cap_turned_off_the_sampler_halts_and_says_so(kernels, place):
    kernel = kernels({"memory_cap": False})
    ran = kernel.run("%%claim ram=300M\nimport numpy\nblock = numpy.ones(2 * 2**30 // 8)")
    assert ran.error["ename"] == "ClaimHalted"
    message = "".join(ran.error["traceback"])
    assert "over its memory budget of 300.0MB" in message
    assert "halted by the sampler, which reads memory every 0.5 s" in message
    assert "memory cap" not in message
    assert kernel.run("6 * 7", check=True).texts == ["42"]
    assert claim_cgroups_of(place, kernel.pid) == []


def test_the_warning_stage_is_told_once_and_turns_the_status_amber(kernels, place, tmp_path):
    """At 80% of 400 MB the cell hears of it once, however many readings stay above."""
    kernel = kernels()
    release = tmp_path / "release"
    hold = (
        "import pathlib, time\nblock = bytearray(330 * 10**6)\n"
        "for i in range(0, len(block), 4096): block[i] = 1\n"
        "print('holding', flush=True)\n"
        f"while not pathlib.Path({str(release)!r}).exists(): time.sleep(0.01)\n"
    )
    ran = kernel.run(
        "import json, subprocess, sys, time, pathlib\nfrom fluksio_nb import claim\n"
        "def until(condition):\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not condition() and time.monotonic() < deadline: time.sleep(0.02)\n"
        "with claim(ram='400M') as c:\n"
        f"    p = c.popen([sys.executable, '-c', {hold!r}], stdout=subprocess.PIPE, text=True)\n"
        "    p.stdout.readline()\n"
        "    in_cap = open(f'/proc/{p.pid}/cgroup').read()\n"
        "    until(lambda: c.status.memory_warning)\n"
        "    seen = c.readings.count\n"
        "    until(lambda: c.readings.count >= seen + 3)\n"
        f"    pathlib.Path({str(release)!r}).touch()\n"
        "    p.wait()\n"
        "print(json.dumps({'amber': c.status.memory_warning, 'in_cap': in_cap,\n"
        "    'ending': c.status.ending}))",
        check=True,
    )
    facts = ran.json()
    assert facts["amber"] is True
    assert facts["ending"] == "ok"
    assert f"fluksio_nb-{kernel.pid}-" in facts["in_cap"], "c.popen must start inside the cap"
    warnings = [line for line in ran.stderr.splitlines() if "of its memory budget of" in line]
    assert len(warnings) == 1, ran.stderr
    assert "400.0MB; at 100% it is stopped by the kernel's memory cap" in warnings[0]
    assert claim_cgroups_of(place, kernel.pid) == []


def test_no_claim_cgroup_outlives_any_ending(kernels, place):
    kernel = kernels()
    for cell, ename in [
        ("%%claim ram=300M\n1", None),
        ("%%claim ram=300M\nraise ValueError('no')", "ValueError"),
        ("%%claim ram=300M\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "WorkerDied"),
        ("%%claim ram=300M\nimport os\nos._exit(3)", "WorkerDied"),
    ]:
        ran = kernel.run(cell)
        assert (ran.error or {}).get("ename") == ename, ran.error
        assert claim_cgroups_of(place, kernel.pid) == [], cell

    msg_id = kernel.client.execute(
        "%%claim ram=300M\nimport time\nprint('started', flush=True)\ntime.sleep(60)"
    )
    kernel.wait_for_output(msg_id, "started")
    assert len(claim_cgroups_of(place, kernel.pid)) == 1, "a running claim has its cgroup"
    kernel.interrupt()
    assert kernel.error_when_idle(msg_id) == "KeyboardInterrupt"
    assert claim_cgroups_of(place, kernel.pid) == []

    # A process that left the claim's process group is still the claim's.
    kernel.run(
        "import subprocess\nfrom fluksio_nb import claim\n"
        "with claim(ram='300M') as c:\n"
        "    p = c.popen(['setsid', 'sleep', '600'])\n"
        "    strays = c._confinement.cap.pids()",
        check=True,
    )
    strays = kernel.facts("strays")
    assert strays and all(gone(pid) for pid in strays)
    assert claim_cgroups_of(place, kernel.pid) == []


def test_a_killed_kernels_worker_removes_its_claim_cgroup(kernels, place):
    kernel = kernels()
    msg_id = kernel.client.execute(
        "%%claim ram=300M\nimport os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)"
    )
    kernel.wait_for_output(msg_id, "\n")
    (made,) = claim_cgroups_of(place, kernel.pid)
    worker = int((place.parent / made / "cgroup.procs").read_text().split()[0])
    os.kill(kernel.pid, signal.SIGKILL)
    assert gone(worker, within=30)
    wait_until(lambda: not (place.parent / made).exists(), what=f"{made} removed by its worker")


def test_a_dead_kernels_leftover_is_swept_and_a_live_ones_is_not(place):
    """Judged by pid and start time: a live process's cgroup is never taken."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = place.parent / f"fluksio_nb-{dead.pid}-{process_start(os.getpid())}-1"
    live = place.parent / f"fluksio_nb-{os.getpid()}-{process_start(os.getpid())}-99999"
    survivor = None
    try:
        place.parent.mkdir(exist_ok=True)
        stale.mkdir()
        live.mkdir()
        # A process left in the stale one, as a worker that could not clean up leaves it.
        survivor = subprocess.Popen(["sleep", "600"])
        (stale / "cgroup.procs").write_text(str(survivor.pid))
        assert CLAIM_NAME.match(stale.name)
        made = ClaimCgroup.make(place, 300 * 10**6)
        try:
            assert not stale.exists(), "the dead kernel's cgroup should have been swept"
            assert live.exists(), "a live kernel's cgroup must be left alone"
            assert survivor.wait(timeout=10) == -signal.SIGKILL
            assert sweep_stale(place.parent) == []
        finally:
            made.remove()
        assert not made.path.exists()
    finally:
        if survivor is not None and survivor.poll() is None:
            survivor.kill()
        for path in (stale, live):
            remove_cgroup(path)


#: A kernel's cap made as its user: where it would go, then, once told, its own process
#: moved in, and the cgroup it is then in, with that cgroup's owner and limit.
CAP_AS_A_USER = """
import json, os, sys
from pathlib import Path
from fluksio_nb.claim_cgroups import own_memory_cgroup
from fluksio_nb.memory_cap import ClaimCgroup, find_cap_place
place = find_cap_place()
if not place.available:
    print(json.dumps({"refused": place.why_not}), flush=True)
    raise SystemExit
cap = ClaimCgroup.make(place, int(sys.argv[1]))
print(json.dumps({"made": str(cap.path)}), flush=True)
sys.stdin.readline()
cap.admit(os.getpid())
here = own_memory_cgroup(controller="memory")
limit = int((here / "memory.limit_in_bytes").read_text())
print(json.dumps({"in": str(here), "owner": here.stat().st_uid, "limit": limit}), flush=True)
"""

#: Run by the other user: their own cgroup, limited to nothing, where the claim's was.
SWAP = """
import os, sys
path = sys.argv[1]
os.rmdir(path)
os.mkdir(path)
for name in ("cgroup.procs", "tasks", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
    if os.path.exists(os.path.join(path, name)):
        os.chmod(os.path.join(path, name), 0o666)
"""


def test_a_cgroup_other_users_may_write_is_no_place_for_a_cap(place):
    """Guards against a claim that runs uncapped while it says it is capped: in a memory
    cgroup handed to several users (mode 0777), another user made the ``fluksio_nb``
    directory first, removed the claim's cgroup before its worker came in, and made one
    of their own in its place, with no limit, which the worker then entered."""
    if place.version != CGROUP_V1:
        pytest.skip("a cgroup shared by users is made here in cgroup v1's memory hierarchy")
    owner, other = ready_user(USER_A), ready_user(USER_B)
    budget = 100 * 10**6
    shared = place.home / f"fluksio-shared-{os.getpid()}"
    shared.mkdir()
    kernel = None
    try:
        shared.chmod(0o777)
        for name in ("cgroup.procs", "tasks"):
            (shared / name).chmod(0o666)
        made_first = subprocess.run(
            [*as_user(other), "mkdir", "-m", "0777", str(shared / "fluksio_nb")],
            capture_output=True,
            text=True,
        )
        assert made_first.returncode == 0, made_first.stderr

        def enter_shared() -> None:
            # As an admin's rule puts every user's kernel there, before it runs.
            with open(shared / "cgroup.procs", "w") as procs:
                procs.write("0")

        kernel = subprocess.Popen(
            [*as_user(owner), sys.executable, "-c", CAP_AS_A_USER, str(budget)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=user_environ(owner, {"PYTHONPATH": str(REPO_ROOT)}),
            cwd=owner.home,
            preexec_fn=enter_shared,
        )
        found = json.loads(kernel.stdout.readline() or f'{{"error": {kernel.stderr.read()!r}}}')
        ran_in = None
        if "made" in found:
            swapped = subprocess.run(
                [*as_user(other), sys.executable, "-c", SWAP, found["made"]],
                capture_output=True,
                text=True,
            )
            assert swapped.returncode == 0, swapped.stderr
            kernel.stdin.write("go\n")
            kernel.stdin.flush()
            ran_in = json.loads(kernel.stdout.readline())
        assert "refused" in found, (
            f"{owner.name} took {found} for its cap, and ran in {ran_in}: a cgroup "
            f"{other.name} (uid {other.uid}) made, against a budget of {budget} bytes"
        )
        assert "may be changed by other users" in found["refused"]
        assert str(shared) in found["refused"]
    finally:
        if kernel is not None:
            kernel.kill()
            kernel.wait()
        for below in sorted(shared.rglob("fluksio_nb*"), reverse=True):
            remove_cgroup(below)
        remove_cgroup(shared)


#: A ``ram=`` claimed cell in an IPython shell of its own, stopped at every
#: moment of fluksio_nb's code, one moment a round: as its memory cgroup is
#: made and limited, as the warm worker is moved into it and back out, and as
#: the cgroup is removed. After each, no cgroup of the shell's may be left, no
#: share held, and no descriptor left open. The books are the kernel's own
#: (see :mod:`tests.stops`).
STOP_AT_EVERY_MOMENT_OF_A_CAPPED_CELL = """
import glob, os
os.environ["FLUKSIO_LEDGER"] = "kernel"
from IPython.core.interactiveshell import InteractiveShell
import fluksio_nb
from fluksio_nb import accountant
from fluksio_nb.memory_cap import cap_place

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "fluksio_nb")
assert shell.run_cell("%%claim ram=1G\\nwarm = 1").success
parent = cap_place().parent
mine = f"fluksio_nb-{os.getpid()}-"

def attempt(made):
    shell.run_cell("%%claim ram=1G\\nx = 1")

def check():
    if [p for p in os.listdir(parent) if p.startswith(mine)]:
        return "a_cgroup_left_behind"
    if not books_clear():
        return "a_share_left_held"
    if descriptors_left_open(descriptors):
        return "a_descriptor_left_open"

descriptors = len(os.listdir("/proc/self/fd"))
here = os.path.dirname(fluksio_nb.__file__)
watched = glob.glob(os.path.join(here, "**", "*.py"), recursive=True)
each_moment(watched, attempt, lambda made: None, check, forgotten=True)
"""


@pytest.mark.timeout(900)
def test_a_stop_at_any_moment_of_a_capped_cell_leaves_no_cgroup_or_descriptor(place):
    """Guards against the stop button landing as a claim's memory cgroup was made, limited,
    entered or removed: a cgroup left behind for good, or a descriptor left open."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_CAPPED_CELL, timeout=900)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 800, said
