"""Each claim runs on cores of its own, which the OS holds it to.

The failures guarded against: two running claims handed the same core by
any of the books (the kernel's own, or a books service: the user's own
or the machine's); a claim whose worker, or a thread or process the worker starts,
runs off its cores; a cell that re-pins itself onto another claim's core
where a cpuset could have held it; a claim's cpuset left behind; a warm
worker that keeps an earlier claim's cores or cpuset; and a claim spread over
two NUMA nodes when one had room.
"""

import contextlib
import errno
import json
import os
import secrets
import signal
import textwrap
from pathlib import Path

import psutil
import pytest

from fluksio_nb.books import Allocation, ResourceAccountant, pick_cores
from fluksio_nb.budget import CGROUP_V1, CGROUP_V2
from fluksio_nb.inventory import claimable_core_ids, numa_nodes, parse_cpu_list
from fluksio_nb.kernel import accountant
from fluksio_nb.machine.books import Entry, MachineBooks
from fluksio_nb.resources import Resources
from tests.kernels import Kernel
from tests.machines import wait_until
from tests.user_books import heard, other_process
from tests.waiting import gone

pytestmark = pytest.mark.timeout(180)

#: Every core this test process may run on: the real machine's, for the kernels.
HERE = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(
    len(HERE) < 2, reason=f"needs two cores to pin two claims apart; this process has {HERE}"
)


def held_there(core: int) -> str:
    """A one-core claim's share as its status says it here: with ", cpuset" where one holds it."""
    from fluksio_nb.cpuset import cores_held_here

    return f"cpus=1 (cores {core}{', cpuset' if cores_held_here().by == 'cpuset' else ''})"


# -----------------------------------------------------------------------------
# Which cores
# -----------------------------------------------------------------------------


def write_nodes(root, nodes: dict[int, str]):
    for number, cpulist in nodes.items():
        (root / f"node{number}").mkdir(parents=True)
        (root / f"node{number}" / "cpulist").write_text(cpulist + "\n")
    (root / "online").write_text("0-1\n")
    return root


def test_the_numa_nodes_are_read_from_sysfs(tmp_path):
    root = write_nodes(tmp_path / "node", {0: "0-3,8-11", 1: "4-7,12-15"})
    node_of = numa_nodes(root)
    assert sorted(c for c, n in node_of.items() if n == 0) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert sorted(c for c, n in node_of.items() if n == 1) == [4, 5, 6, 7, 12, 13, 14, 15]


def test_one_node_or_none_is_no_numa_at_all(tmp_path):
    assert numa_nodes(write_nodes(tmp_path / "one", {0: "0-7"})) == {}
    assert numa_nodes(tmp_path / "missing") == {}


def test_a_claim_stays_on_one_node_where_one_has_room():
    node_of = {c: (0 if c < 4 else 1) for c in range(8)}
    # Node 0 has three free, node 1 all four: two cores go on the fuller node 0,
    # leaving node 1 whole for a four-core claim.
    assert pick_cores([1, 2, 3, 4, 5, 6, 7], 2, node_of) == (1, 2)
    assert pick_cores([1, 2, 3, 4, 5, 6, 7], 4, node_of) == (4, 5, 6, 7)
    # No node has five: the emptiest nodes give the most.
    assert pick_cores([1, 2, 3, 4, 5, 6, 7], 5, node_of) == (1, 4, 5, 6, 7)
    assert pick_cores([1, 2], 3, node_of) == ()


def test_the_reserve_is_the_lowest_cores_and_a_declaration_larger_than_the_machine_pins_nothing():
    assert claimable_core_ids({0, 1, 2, 3}, reserve=1, cpus=3) == (1, 2, 3)
    assert claimable_core_ids({0, 1, 2, 3}, reserve=0, cpus=2) == (0, 1)
    assert claimable_core_ids({0, 1}, reserve=0, cpus=64) == ()
    assert parse_cpu_list("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}


def test_the_kernels_books_hand_out_disjoint_cores_and_take_them_back():
    books = ResourceAccountant(cpus=4, cores=[2, 3, 4, 5])
    one, two = books.try_take(2), books.try_take(1)
    assert one is not None and two is not None
    assert len(one.cores) == 2 and len(two.cores) == 1
    assert not set(one.cores) & set(two.cores)
    assert set(one.cores) | set(two.cores) <= {2, 3, 4, 5}
    books.give_back(one)
    with pytest.raises(ValueError):
        books.give_back(Allocation(cpus=1, cores=(*two.cores, 9)))
    books.give_back(two)
    assert books.snapshot()["cpus"]["free_ids"] == [2, 3, 4, 5]


def test_the_users_books_hand_two_kernels_disjoint_cores(tmp_path, monkeypatch):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this machine gives the suite one core: no two claims can have their own")
    for name, value in {"FLUKSIO_CPUS": "2", "FLUKSIO_RESERVE_CPUS": "0"}.items():
        monkeypatch.setenv(name, value)
    directory = Path(os.environ["FLUKSIO_LEDGER"])
    other = other_process(
        directory,
        "t = q.enqueue(Resources(cpus=1)); say(cores=list(t.allocation.cores))\n"
        "sys.stdin.readline()\n"
        "w = q.enqueue(Resources(cpus=1)); say(waiting=w.allocation is None)\n"
        "q.wait(w, timeout=30); say(cores=list(w.allocation.cores))\n"
        "q.release(t); q.release(w)\n",
        cpus="2",
        reserve_cpus="0",
    )
    theirs = heard(other)["cores"]
    mine = accountant()
    a = mine.enqueue(Resources(cpus=1))
    assert a.allocation is not None
    assert sorted(theirs + list(a.allocation.cores)) == sorted(mine.books.core_ids)
    other.stdin.write("\n")
    other.stdin.flush()
    assert heard(other) == {"waiting": True}, "two cores were handed out already"
    shown = {claim["ticket"]: claim["allocation"]["cores"] for claim in mine.snapshot()["running"]}
    assert sorted(shown.values()) == sorted([theirs, list(a.allocation.cores)])
    mine.release(a)
    # The waiter in the other process is given the core this one gave back.
    assert heard(other) == {"cores": list(a.allocation.cores)}
    assert other.wait(timeout=30) == 0


def test_the_machine_service_books_hand_out_disjoint_cores():
    books = MachineBooks(4, [], 0, core_ids=[0, 1, 2, 3])
    entries = [
        Entry(number=n, uid=1000 + n % 2, user=f"u{n % 2}", pid=n, need=(2, 0, 0), label="x")
        for n in (1, 2, 3)
    ]
    for entry in entries:
        books.add(entry)
    granted = books.dispatch()
    assert len(granted) == 2
    assert sorted(granted[0].cores + granted[1].cores) == [0, 1, 2, 3]
    assert books.fits_free(1, [], 0, cores=[0]) is False
    books.remove(granted[0].number)
    assert [e.number for e in books.dispatch()] == [3]
    assert entries[2].cores == granted[0].cores


# -----------------------------------------------------------------------------
# The OS holds a claim to its cores: real kernels
# -----------------------------------------------------------------------------


def cores_kernel(tmp_path, **env):
    return Kernel(
        FLUKSIO_RESERVE_CPUS="0",
        FLUKSIO_CONFIG=str(tmp_path / "fluksio_nb.json"),
        FLUKSIO_LEDGER=str(tmp_path / "ledger"),
        **env,
    )


HOLD_A_CORE = """
from fluksio_nb import claim
import json, os
c = claim(cpus=1, label="{label}").__enter__()
print(json.dumps({{"cores": list(c.allocation.cores),
                   "pid": c.run(os.getpid),
                   "affinity": sorted(c.run(os.sched_getaffinity, 0))}}))
"""


@needs_two_cores
def test_two_one_core_claims_have_disjoint_cores_in_one_kernel_and_across_two(tmp_path):
    one, two = cores_kernel(tmp_path), cores_kernel(tmp_path)
    try:
        a = one.run(HOLD_A_CORE.format(label="a"), check=True).json()
        b = one.run(HOLD_A_CORE.format(label="b"), check=True).json()
        assert len(a["cores"]) == len(b["cores"]) == 1
        assert a["cores"] != b["cores"]
        assert a["affinity"] == a["cores"] and b["affinity"] == b["cores"]
        one.run("c.__exit__(None, None, None)", check=True)  # b's claim ends; a's holds
        c = two.run(HOLD_A_CORE.format(label="c"), check=True).json()
        assert c["cores"] == b["cores"] and c["affinity"] == c["cores"]
        snapshot = two.books()
        held = sorted(
            core for claim in snapshot["running"] for core in claim["allocation"]["cores"]
        )
        assert held == sorted(a["cores"] + c["cores"])
        from fluksio_nb.cpuset import cores_held_here
        from fluksio_nb.overview import describe_snapshot

        said = describe_snapshot(snapshot)
        by = cores_held_here().by  # a cpuset where one can be made here, else affinity
        assert snapshot["enforcement"]["cores"]["by"] == by
        assert f"held by  cores: own cores ({by}) · memory: " in said
        # As a claim's record says its share.
        assert f"cpus=1 (cores {a['cores'][0]}) " in said
        assert f"cpus=1 (cores {c['cores'][0]}) " in said
    finally:
        one.shutdown()
        two.shutdown()


@needs_two_cores
def test_with_pinning_turned_off_a_claim_runs_on_every_claimable_core(tmp_path):
    kernel = cores_kernel(tmp_path, FLUKSIO_PIN_CORES="false")
    try:
        held = kernel.run(HOLD_A_CORE.format(label="loose"), check=True).json()
        assert held["cores"] == [] and held["affinity"] == HERE
        shown = kernel.books()["enforcement"]["cores"]
        assert shown["label"] == "thread variables" and "pin_cores" in shown["why"]
    finally:
        kernel.shutdown()


GREEDY = """
%%claim cpus=1
import json, multiprocessing, os, time, psutil, threadpoolctl, numpy

def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass

# Everything a cell can do to take more than its share, ignoring every variable.
threadpoolctl.threadpool_limits(8)
pool = multiprocessing.get_context("fork").Pool(4)
waiting = pool.map_async(spin, [4.0] * 4)
a = numpy.random.rand(600, 600)
me = psutil.Process()
before = {p.pid: p.cpu_times() for p in [me, *me.children(recursive=True)]}
started = time.monotonic()
while time.monotonic() - started < 3.0:
    a @ a
elapsed = time.monotonic() - started
tree = [me, *me.children(recursive=True)]
used = 0.0
for p in tree:
    now, then = p.cpu_times(), before.get(p.pid)
    used += (now.user + now.system) - ((then.user + then.system) if then else 0.0)
print(json.dumps({"cores_used": used / elapsed,
                  "affinities": sorted({tuple(sorted(p.cpu_affinity())) for p in tree}),
                  "threads": sum(p.num_threads() for p in tree),
                  "processes": len(tree)}))
pool.terminate()
# Processes and a pool cannot travel back to the kernel: not names to bring back.
del pool, waiting, me, tree, p
"""


@needs_two_cores
def test_a_greedy_one_core_cell_uses_one_core_whatever_it_starts(tmp_path):
    """Four busy processes and eight BLAS threads under cpus=1 still get one core."""
    kernel = cores_kernel(tmp_path)
    try:
        ran = kernel.run(GREEDY, check=True)
        got = ran.json()
        assert got["processes"] >= 5 and got["threads"] >= 8, got
        assert len(got["affinities"]) == 1 and len(got["affinities"][0]) == 1, got
        assert got["cores_used"] <= 1.1, got
        (core,) = got["affinities"][0]
        assert any(f" · {held_there(core)} " in text for text in ran.texts), ran.texts
        assert kernel.books()["running"] == []
    finally:
        kernel.shutdown()


@needs_two_cores
def test_a_warm_worker_moves_every_thread_to_its_next_claims_core(tmp_path):
    """A worker's BLAS threads, started under one claim, follow it to the next claim's core."""
    kernel = cores_kernel(tmp_path)
    report = textwrap.dedent("""
        %%claim cpus=1
        import json, os, numpy, psutil
        numpy.ones((300, 300)) @ numpy.ones((300, 300))
        print(json.dumps({"pid": os.getpid(), "threads": sorted(
            {tuple(sorted(os.sched_getaffinity(t.id))) for t in psutil.Process().threads()})}))
        """).strip()
    try:
        first = kernel.run(report, check=True).json()
        held = kernel.run(
            "from fluksio_nb import claim\n"
            "b = claim(cpus=1, label='blocker').__enter__()\n"
            "print(list(b.allocation.cores))",
            check=True,
        ).json()
        assert [held] == first["threads"], "the blocker should be given the core just freed"
        second = kernel.run(report, check=True).json()
        assert first["pid"] == second["pid"], "the second claim should reuse the warm worker"
        assert len(second["threads"]) == 1 and second["threads"] != first["threads"]
        assert psutil.Process(first["pid"]).num_threads() > 1
    finally:
        kernel.shutdown()


# -----------------------------------------------------------------------------
# A cell cannot re-pin itself off its cores: a cpuset, where one can be made
# -----------------------------------------------------------------------------


def test_a_cpuset_place_is_found_in_v1s_cpuset_hierarchy_and_in_delegated_v2(tmp_path):
    """Guards against cpusets offered where none can be made, or refused where one can."""
    from fluksio_nb.budget import CGROUP_V1, CGROUP_V2
    from fluksio_nb.cpuset import cores_held_here
    from fluksio_nb.memory_cap import CapPlace, find_cap_place

    root, proc = tmp_path / "v1", tmp_path / "v1-cgroup"
    proc.write_text("4:memory:/pod\n3:cpuset:/\n")
    for name in ("cpuset.cpus", "cgroup.procs"):
        (root / "cpuset").mkdir(parents=True, exist_ok=True)
        (root / "cpuset" / name).write_text("")
    own = root / "cpuset"
    assert find_cap_place(root, proc, "cpuset") == CapPlace(CGROUP_V1, own / "fluksio_nb", own)

    root, proc = tmp_path / "v2", tmp_path / "v2-cgroup"
    proc.write_text("0::/app.slice/k.scope\n")
    app = root / "app.slice"
    (app / "k.scope").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu cpuset memory\n")
    (app / "cgroup.subtree_control").write_text("cpu memory\n")
    (app / "cgroup.procs").write_text("")
    place = find_cap_place(root, proc, "cpuset")
    assert not place.available and "does not hand the cpuset controller down" in place.why_not
    # Where none can be made, the claim says affinity holds its cores, and why not a cpuset.
    held = cores_held_here(place)
    assert (held.label, held.by) == ("own cores (affinity)", "affinity")
    assert "a cell may move itself onto other cores" in held.why and place.why_not in held.why
    (app / "cgroup.subtree_control").write_text("cpu cpuset memory\n")
    assert find_cap_place(root, proc, "cpuset") == CapPlace(
        CGROUP_V2, app / "fluksio_nb", app / "k.scope"
    )


def child_cgroup_place(controller: str, what: str):
    """Where claim cgroups of ``controller`` go here; the test skips, saying why, where none can."""
    from fluksio_nb.memory_cap import find_cap_place

    found = find_cap_place(controller=controller)
    if not found.available:
        pytest.skip(f"needs {what}, which cannot be made here: {found.why_not}")
    return found


def cpuset_place_here():
    return child_cgroup_place("cpuset", "a cpuset cgroup")


def made_by(parent, pid):
    """The claim cgroups process ``pid`` has under ``parent``, by their names."""
    if not parent.is_dir():
        return []
    return [p.name for p in parent.iterdir() if p.name.startswith(f"fluksio_nb-{pid}-")]


# The cell, and a process it starts, each ask for every core; what each was
# left with, and the cpuset cgroup the cell ran in, by name.
RE_PIN = """
%%claim cpus=1
import json, os, subprocess, sys
os.sched_setaffinity(0, range(os.cpu_count()))
child = subprocess.run([sys.executable, "-c", "import os; "
                        "os.sched_setaffinity(0, range(os.cpu_count())); "
                        "print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True, check=True).stdout
status = dict(line.split(":", 1) for line in open(f"/proc/{os.getpid()}/status"))
groups = [line.split(":", 2) for line in open("/proc/self/cgroup").read().splitlines()]
cpuset = ([path for _, names, path in groups if "cpuset" in names.split(",")]
          or [path for _, names, path in groups if names == ""])[0]
print(json.dumps({"pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0)),
                  "allowed": status["Cpus_allowed_list"].strip(),
                  "child": json.loads(child), "cpuset": os.path.basename(cpuset)}))
"""


@needs_two_cores
def test_a_cell_that_re_pins_itself_onto_every_core_stays_on_its_claims_core(tmp_path):
    """Guards against a claimed cell moving itself onto another claim's core.

    Affinity is the process's own to change; a cpuset is the kernel's. The
    claim's status and the books say the cpuset holds it, and the cpuset goes
    with the claim.
    """
    place = cpuset_place_here()
    kernel = cores_kernel(tmp_path)
    try:
        ran = kernel.run(RE_PIN, check=True)
        got = ran.json()
        assert len(got["affinity"]) == 1, f"the cell re-pinned itself onto other cores: {got}"
        (core,) = got["affinity"]
        assert got["allowed"] == str(core) and got["child"] == [core], got
        assert any(f" · cpus=1 (cores {core}, cpuset) " in text for text in ran.texts), ran.texts
        assert got["cpuset"].startswith(f"fluksio_nb-{kernel.pid}-"), got
        assert not (place.parent / got["cpuset"]).exists(), "the claim's cpuset outlived it"
        held = kernel.books()["enforcement"]["cores"]
        assert (held["label"], held["by"]) == ("own cores (cpuset)", "cpuset"), held
    finally:
        kernel.shutdown()
    assert not made_by(place.parent, kernel.pid)


@needs_two_cores
def test_a_warm_worker_given_another_claims_core_moves_into_that_claims_cpuset(tmp_path):
    """Guards against a warm worker held by an earlier claim's cpuset, or by none, in the next."""
    place = cpuset_place_here()
    kernel = cores_kernel(tmp_path)
    try:
        first = kernel.run(RE_PIN, check=True).json()
        held = kernel.run(
            "from fluksio_nb import claim\n"
            "b = claim(cpus=1, label='blocker').__enter__()\n"
            "print(list(b.allocation.cores))",
            check=True,
        ).json()
        assert held == first["affinity"], "the blocker should be given the core just freed"
        second = kernel.run(RE_PIN, check=True).json()
        assert first["pid"] == second["pid"], "the second claim should reuse the warm worker"
        assert len(second["affinity"]) == 1 and second["affinity"] != held, second
        assert second["allowed"] == str(second["affinity"][0]), second
        assert second["cpuset"] != first["cpuset"], "the worker stayed in the first claim's cpuset"
        assert second["cpuset"].startswith(f"fluksio_nb-{kernel.pid}-"), second
        kernel.run("b.__exit__(None, None, None)", check=True)
        assert not made_by(place.parent, kernel.pid), "a claim's cpuset outlived it"
    finally:
        kernel.shutdown()


@needs_two_cores
def test_a_killed_kernels_worker_removes_its_claims_cpuset(tmp_path):
    """Guards against a cpuset left for good by a kernel killed while its claim ran."""
    place = cpuset_place_here()
    kernel = cores_kernel(tmp_path)
    try:
        msg_id = kernel.client.execute(
            "%%claim cpus=1\nimport os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)"
        )
        kernel.wait_for_output(msg_id, "\n")
        (made,) = made_by(place.parent, kernel.pid)
        worker = int((place.parent / made / "cgroup.procs").read_text().split()[0])
        os.kill(kernel.pid, signal.SIGKILL)
        assert gone(worker, within=30)
        wait_until(lambda: not (place.parent / made).exists(), what=f"{made} removed by its worker")
    finally:
        kernel.shutdown()


def test_a_cpuset_that_cannot_be_given_its_cores_is_not_left_behind():
    """Guards against a half-made cpuset left in the hierarchy when a step of making it fails."""
    from fluksio_nb.cpuset import hold_cores
    from fluksio_nb.memory_cap import CapNotMade

    place = cpuset_place_here()
    missing = frozenset({max(HERE) + 64})  # a core this machine does not have
    with pytest.raises(CapNotMade, match="could not be held to its cores"):
        hold_cores(place, missing, None)
    assert not made_by(place.parent, os.getpid())


# -----------------------------------------------------------------------------
# Where a claim cannot have cores of its own: a CPU quota
# -----------------------------------------------------------------------------


def test_a_cpu_quota_place_is_found_in_v1s_cpu_hierarchy_and_in_delegated_v2(tmp_path):
    from fluksio_nb.budget import CGROUP_V1, CGROUP_V2
    from fluksio_nb.memory_cap import CapPlace, find_cap_place

    root = tmp_path / "v1"
    proc = tmp_path / "v1-cgroup"
    proc.write_text("4:memory:/pod\n2:cpu,cpuacct:/pod\n")
    (root / "cpu" / "pod").mkdir(parents=True)
    for name in ("cpu.cfs_quota_us", "cgroup.procs"):
        (root / "cpu" / "pod" / name).write_text("")
    own = root / "cpu" / "pod"
    assert find_cap_place(root, proc, "cpu") == CapPlace(CGROUP_V1, own / "fluksio_nb", own)
    assert not find_cap_place(root, proc, "memory").available

    root = tmp_path / "v2"
    proc = tmp_path / "v2-cgroup"
    proc.write_text("0::/app.slice/k.scope\n")
    (root / "app.slice" / "k.scope").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "app.slice" / "cgroup.subtree_control").write_text("memory\n")
    (root / "app.slice" / "cgroup.procs").write_text("")
    place = find_cap_place(root, proc, "cpu")
    assert not place.available and "does not hand the cpu controller down" in place.why_not
    (root / "app.slice" / "cgroup.subtree_control").write_text("cpu memory\n")
    app = root / "app.slice"
    assert find_cap_place(root, proc, "cpu") == CapPlace(
        CGROUP_V2, app / "fluksio_nb", app / "k.scope"
    )


def cpu_quota_place():
    return child_cgroup_place("cpu", "a child cpu cgroup")


#: The most CPU weight a cgroup may have: v1's ``cpu.shares``, v2's ``cpu.weight``.
MOST_WEIGHT = {CGROUP_V1: ("cpu.shares", "262144"), CGROUP_V2: ("cpu.weight", "10000")}


@pytest.fixture
def heavy():
    """A launcher for a kernel, which starts it in a cpu cgroup that outweighs the machine.

    A quota holds a claim back only once it uses more than its share, which
    a cell that wants every core does only if it gets more than one. Beside
    the rest of the suite, or another run of it, busy processes elsewhere take
    their turns and the cell may never get there. A cgroup of this test's,
    weighted above every other, gives it whatever it asks, so the quota is
    what stops it: the claim's own cgroup goes in the kernel's, as everywhere.
    The cgroup is made beside the test's own, and removed after the test.
    """
    place = cpu_quota_place()
    version = place.version
    base = place.home if version == CGROUP_V1 else place.parent.parent
    heavy = base / f"fluksio-test-heavy-{os.getpid()}-{secrets.token_hex(4)}"
    heavy.mkdir()
    try:
        weight, most = MOST_WEIGHT[version]
        (heavy / weight).write_text(most)
        if version == CGROUP_V2:
            # Handed down, for the claim cgroups made beside the kernel's own.
            (heavy / "cgroup.subtree_control").write_text("+cpu")
        kernels = heavy / "kernel"
        kernels.mkdir()
        yield ["sh", "-c", f'echo $$ > {kernels}/cgroup.procs && exec "$@"', "sh"]
    finally:
        below = sorted((p for p in heavy.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for cgroup in [*below, heavy]:
            removed_once_empty(cgroup, base)


def removed_once_empty(cgroup: Path, base: Path, within_s: float = 60.0) -> None:
    """Remove ``cgroup``, its processes moved back to ``base`` first.

    A process still exiting (a kernel just shut down, under load) stays in its
    cgroup and cannot be moved, and the cgroup is busy until it is gone: so
    until ``within_s``, moved and tried again.
    """

    def removed() -> bool:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (base / "cgroup.procs").write_text(pid)
        try:
            cgroup.rmdir()
        except OSError as error:
            if error.errno != errno.EBUSY:
                raise
            return False
        return True

    wait_until(removed, timeout=within_s, what=f"{cgroup} emptied and removed")


# Appended to GREEDY, still inside the claim: what the kernel's scheduler says
# of the cgroup the cell runs in, before the cgroup goes with the claim.
OWN_CPU_CGROUP = """
def own_cpu_cgroup(parent):
    for line in open("/proc/self/cgroup").read().splitlines():
        _, names, path = line.split(":", 2)
        if "cpu" in names.split(",") or (names == "" and "fluksio_nb-" in path):
            return os.path.join(parent, os.path.basename(path))
own = own_cpu_cgroup(PARENT)
quota = open(os.path.join(own, "cpu.cfs_quota_us" if os.path.exists(
    os.path.join(own, "cpu.cfs_quota_us")) else "cpu.max")).read().split()[0]
stat = dict(line.split() for line in open(os.path.join(own, "cpu.stat")))
print(json.dumps({"cgroup": os.path.basename(own), "quota_us": int(quota),
                  "nr_periods": int(stat["nr_periods"]),
                  "nr_throttled": int(stat["nr_throttled"])}))
"""


def test_a_claim_that_cannot_have_cores_of_its_own_is_held_to_a_quota(tmp_path, heavy):
    """More cpus declared than there are cores: nothing to pin, so a cgroup quota holds it."""
    from fluksio_nb.memory_cap import CPU_PERIOD_US, find_cap_place

    kernel = cores_kernel(tmp_path, launched_by=heavy, FLUKSIO_CPUS=str(4 * len(HERE)))
    try:
        # Where the kernel's claims go: in its own cgroup, as they would anywhere.
        place = find_cap_place(proc_cgroup=Path(f"/proc/{kernel.pid}/cgroup"), controller="cpu")
        cell = GREEDY + OWN_CPU_CGROUP.replace("PARENT", repr(str(place.parent)))
        ran = kernel.run(cell, check=True)
        *_, greedy, scheduler = ran.stdout.strip().splitlines()
        got, held_to = json.loads(greedy), json.loads(scheduler)
        # The scheduler's own word: the cell ran in the claim's cgroup, with one
        # core's time per period, and was held back at it.
        assert held_to["cgroup"].startswith(f"fluksio_nb-{kernel.pid}-"), held_to
        assert held_to["quota_us"] == CPU_PERIOD_US, held_to
        assert held_to["nr_throttled"] > 0, held_to
        # Measured from outside the scheduler, the quota overshoots a little at
        # the window's edges (each CPU draws time in slices), but nowhere near
        # the two cores the cell would take unheld.
        assert got["processes"] >= 5 and got["cores_used"] <= 1.25, got
        assert any(f" · cpus=1 (quota of 1 core ({place.version})) " in t for t in ran.texts)
        held = kernel.books()["enforcement"]["cores"]
        assert held["label"] == f"a quota per claim ({place.version})", held
        assert "more than the cores there are to pin" in held["why"]
        assert not [
            p for p in place.parent.iterdir() if p.name.startswith(f"fluksio_nb-{kernel.pid}-")
        ], "the claim's cpu cgroup outlived it"
    finally:
        kernel.shutdown()
