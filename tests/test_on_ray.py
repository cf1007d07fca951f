"""Claims on a Ray cluster: the same cell, the same share, run as a Ray task.

The cluster is a local Ray that the kernel itself starts in its first cell
(2 CPUs, 2 declared GPUs, a 256 MB object store), its state in a temporary
directory and its token in the environment, so that nothing lands in the home
directory. Everything else runs in a real kernel, driven as a notebook drives it.

The failures guarded against are the ones a user would meet moving a notebook
to a cluster: a share that never reached the task's libraries, two tasks on
one card, variables that do not come back, output that only appears at the
end, a claim that waits forever for a node that does not exist, a memory
overrun nobody stops, a stop button that leaves the task running, and Ray's
files left behind in the home directory.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from fluksio_nb.claim_line import parse_claim_line
from fluksio_nb.env import THREAD_VARS
from fluksio_nb.errors import BadClaim, ClaimTooBigForCluster
from fluksio_nb.ray.card_memory import fraction_of
from fluksio_nb.ray.connection import parse_target
from fluksio_nb.ray.task import check_fits, task_options
from fluksio_nb.resources import ask
from tests.kernels import Kernel, printed, sent, started_kernel
from tests.local_ray import START_TIMEOUT_S, ray_env, starting_ray
from tests.waiting import gone, processes_using

# The first test also waits for Ray to start, which may wait for another suite's.
pytestmark = pytest.mark.timeout(240 + START_TIMEOUT_S)


def _listing(path: Path) -> dict[str, float] | None:
    if not path.exists():
        return None
    return {str(p): p.stat().st_mtime for p in path.rglob("*")}


@pytest.fixture(scope="module")
def ray_state():
    """Ray's temporary directory, and what the home directory held before Ray started."""
    pytest.importorskip("ray", reason="ray is not installed: pip install 'fluksio_nb[ray]'")
    # Short, because Ray puts Unix sockets under it and a socket's path is
    # limited to about a hundred bytes.
    state = tempfile.mkdtemp(prefix="fluksio-ray-")
    before = {
        "home": _listing(Path.home() / ".ray"),
        "tmp": _listing(Path(tempfile.gettempdir()) / "ray"),
    }
    yield state, before
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def kernel(ray_state, tmp_path_factory):
    state, _ = ray_state
    with started_kernel(tmp_path_factory.mktemp("kernel"), **ray_env(state)) as k:
        k.run(starting_ray(state), timeout=START_TIMEOUT_S, check=True)
        yield k
        k.run("ray.shutdown()", timeout=60)
    deadline = time.monotonic() + 15
    while processes_using(state) and time.monotonic() < deadline:
        time.sleep(0.2)
    for straggler in processes_using(state):
        straggler.kill()


def ray_resources(kernel) -> dict[str, float]:
    return kernel.facts(
        "{k: v for k, v in ray.available_resources().items() if k in ('CPU', 'GPU')}"
    )


def assert_cluster_idle(kernel, within: float = 10.0) -> None:
    """Every CPU and card handed back to Ray: no task of ours still holds a share."""
    deadline = time.monotonic() + within
    while (free := ray_resources(kernel)) != {"CPU": 2.0, "GPU": 2.0}:
        assert time.monotonic() < deadline, f"Ray still has a share out: {free}"
        time.sleep(0.2)


# -----------------------------------------------------------------------------
# What is asked of Ray (no cluster needed)
# -----------------------------------------------------------------------------


def test_the_claim_line_says_where_the_cell_runs():
    assert parse_claim_line("cpus=2 --on ray").on == "ray"
    assert parse_claim_line("--on ray://head:10001").on == "ray://head:10001"
    assert parse_claim_line("cpus=2").on is None


def test_a_target_that_is_not_ray_is_refused_with_what_to_write():
    assert parse_target("ray") is None
    assert parse_target("ray://10.0.0.5:10001") == "ray://10.0.0.5:10001"
    with pytest.raises(BadClaim, match="--on ray for the cluster"):
        parse_target("slurm")


def test_the_task_asks_ray_for_the_claim_and_never_runs_twice():
    """A cell is not idempotent: Ray's default of retrying a dead task would run it again."""
    options = task_options(ask(cpus=2, gpus=1, ram="8G", env={"FOO": "1"}), "fit")
    assert (options["num_cpus"], options["num_gpus"], options["memory"]) == (2, 1, 8 * 10**9)
    assert options["max_retries"] == 0
    env = options["runtime_env"]["env_vars"]
    assert {var: env[var] for var in THREAD_VARS} == dict.fromkeys(THREAD_VARS, "2")
    assert env["FOO"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env, "the cards are Ray's to name"


def test_a_claim_no_node_can_hold_is_refused_with_the_largest_node():
    nodes = [
        {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 0.0, "memory": 32e9}},
        {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 2.0, "memory": 16e9}},
        {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0, "memory": 512e9}},
    ]
    check_fits(ask(cpus=4, gpus=2, ram="16G"), nodes)
    with pytest.raises(ClaimTooBigForCluster) as refused:
        # Each resource exists somewhere, but no one node has all three.
        check_fits(ask(cpus=8, gpus=1), nodes)
    assert "largest node of 2 has cpus=8 gpus=0 memory=32.0GB" in str(refused.value)


def test_gpu_ram_alone_is_the_fraction_of_the_smallest_card_and_refused_where_none_holds_it():
    """Guards against a gpu_ram= slice asked of Ray as a share of the biggest card (less
    memory than asked where Ray puts it on a smaller one), or as a share above one card."""
    nodes = [
        {"Alive": True, "NodeID": "a", "Resources": {"CPU": 8.0, "GPU": 2.0}},
        {"Alive": True, "NodeID": "b", "Resources": {"CPU": 8.0, "GPU": 1.0}},
        {"Alive": True, "NodeID": "c", "Resources": {"CPU": 8.0}},
    ]
    sizes = {"a": (80 * 10**9, 80 * 10**9), "b": (40 * 10**9,)}
    assert fraction_of(ask(gpu_ram="10G"), nodes, sizes) == 0.25
    # Rounded up to Ray's ten-thousandths: never less memory than asked.
    assert fraction_of(ask(gpu_ram="3G"), nodes, {"b": (7 * 10**9,)}) == 0.4286
    assert fraction_of(ask(gpu_ram="40G"), nodes, sizes) == 1
    with pytest.raises(BadClaim, match=r"the smallest card of this Ray cluster holds 40.0GB"):
        fraction_of(ask(gpu_ram="50G"), nodes, sizes)
    with pytest.raises(BadClaim, match="no live node of this Ray cluster has a card"):
        fraction_of(ask(gpu_ram="10G"), nodes[2:], {})


# -----------------------------------------------------------------------------
# Without Ray
# -----------------------------------------------------------------------------


def test_without_ray_on_ray_says_how_to_install_it(tmp_path):
    """No Ray in the kernel's environment: one line that says what to pip install."""
    k = Kernel(FLUKSIO_CONFIG=str(tmp_path / "fluksio_nb.json"), FLUKSIO_LEDGER=str(tmp_path))
    try:
        # What `import ray` does where Ray is not installed: ImportError.
        k.run("import sys\nsys.modules['ray'] = None", check=True)
        ran = k.run("%%claim cpus=1 --on ray\n1")
        shown = ran.stderr + "".join((ran.error or {}).get("traceback", []))
        assert ran.status == "error"
        assert "pip install 'fluksio_nb[ray]'" in shown
        assert shown.strip().count("\n") == 0, shown
        assert k.facts("'ray' in sys.modules and sys.modules['ray'] is None")
    finally:
        k.shutdown()


# -----------------------------------------------------------------------------
# The share reaches the task's libraries
# -----------------------------------------------------------------------------


def test_the_task_sees_the_whole_derived_env(kernel):
    ran = kernel.run(
        "%%claim cpus=1 gpus=1 ram=1G FOO=bar --on ray\n"
        "import json, os, threadpoolctl, numpy\n"
        "pools = {p['internal_api']: p['num_threads'] for p in threadpoolctl.threadpool_info()}\n"
        f"names = {[*THREAD_VARS, 'CUDA_DEVICE_ORDER', 'CUDA_VISIBLE_DEVICES', 'FOO']!r}\n"
        "print(json.dumps([{n: os.environ.get(n) for n in names}, pools]))",
        check=True,
    )
    env, pools = ran.json()
    assert {var: env[var] for var in THREAD_VARS} == dict.fromkeys(THREAD_VARS, "1")
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["CUDA_VISIBLE_DEVICES"] in ("0", "1"), "Ray's card should be the one the cell sees"
    assert env["FOO"] == "bar"
    assert pools.get("openblas") == 1, "numpy in the task should have one thread, not every core"


def test_a_task_without_cards_sees_none(kernel):
    """A CPU claim importing torch must not open a context on a card another task holds."""
    ran = kernel.run(
        "%%claim --on ray\nimport os\nprint(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))",
        check=True,
    )
    assert ran.stdout.strip() == "''"


def test_two_gpu_claims_at_once_get_different_cards(kernel):
    # Each task waits until the other has started, rather than sleeping for a
    # guess at how long a cold Ray worker takes to come up on a busy machine.
    ran = kernel.run(
        "import json, shutil, tempfile, threading\n"
        "from fluksio_nb import claim\n"
        "meeting = tempfile.mkdtemp()\n"
        "def card(me, other):\n"
        "    import os, time\n"
        "    start = time.time()\n"
        "    open(os.path.join(meeting, me), 'w').close()\n"
        "    deadline = time.time() + 60\n"
        "    while not os.path.exists(os.path.join(meeting, other)) and time.time() < deadline:\n"
        "        time.sleep(0.02)\n"
        "    return os.environ['CUDA_VISIBLE_DEVICES'], start, time.time()\n"
        "seen = []\n"
        "def one(me, other):\n"
        "    with claim(gpus=1, on='ray') as c:\n"
        "        seen.append(c.run(card, me, other))\n"
        "threads = [threading.Thread(target=one, args=pair) for pair in (('a', 'b'), ('b', 'a'))]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "shutil.rmtree(meeting)\n"
        "print(json.dumps(seen))",
        check=True,
    )
    (card_a, start_a, end_a), (card_b, start_b, end_b) = ran.json()
    assert start_a < end_b and start_b < end_a, "the two claims should have run at once"
    assert {card_a, card_b} == {"0", "1"}
    assert_cluster_idle(kernel)


# -----------------------------------------------------------------------------
# It behaves like a cell
# -----------------------------------------------------------------------------


def test_variables_travel_in_and_out(kernel):
    kernel.run(
        "import numpy as np\nbig = np.ones(2_000_000)\nscale = 3\ndef double(x):\n    return 2 * x",
        check=True,
    )
    kernel.run(
        "%%claim --on ray\ntotal = float((big * scale).sum())\nbig[0] = 7\nbigger = double(big)",
        check=True,
    )
    facts = kernel.facts(
        "[total, float(bigger[0]), float(bigger[1]), bigger.nbytes, float(big[0]), "
        "bigger.flags.writeable, big.flags.writeable]"
    )
    assert facts == [6_000_000.0, 14.0, 2.0, 16_000_000, 7.0, True, True]


#: What keeps an array's memory alive, from the array down to its owner: an
#: ``mmap`` is shared memory mapped where the other side wrote it, a
#: ``bytearray`` a copy out of the object store.
OWNERS = """
def owners(array):
    chain, holder = [], array
    while holder is not None:
        chain.append(type(holder).__name__)
        holder = holder.obj if isinstance(holder, memoryview) else getattr(holder, "base", None)
    return chain
"""


def _segments_in_shared_memory() -> set[str]:
    return {path.name for path in Path("/dev/shm").glob("fluksio-*")}


def test_on_the_kernels_machine_arrays_skip_the_object_store_and_leave_nothing_behind(kernel):
    """Guards against a one-machine cluster copying every array twice more than it must,
    and against the worker's files for the kernel staying in /dev/shm."""
    before = _segments_in_shared_memory()
    kernel.run(OWNERS + "import numpy as np\nsent = np.ones(2_000_000)", check=True)
    kernel.run("%%claim --on ray\ndoubled = sent * 2\nsent[0] = 5", check=True)
    facts = kernel.facts(
        "[owners(doubled)[-1], doubled.flags.writeable, float(doubled.sum()), float(sent[0])]"
    )
    assert facts == ["mmap", True, 4_000_000.0, 5.0]
    assert _segments_in_shared_memory() == before


def test_a_task_that_lands_off_the_kernels_machine_gets_its_values_by_the_object_store(kernel):
    """Guards against a node that joined a one-machine cluster failing the cells sent to it.

    One machine cannot hold a second node, so the kernel is told its machine
    is another, which is what a task on such a node finds.
    """
    kernel.run(OWNERS + "import numpy as np\nsent = np.ones(2_000_000)", check=True)
    kernel.run(
        "from fluksio_nb.ray import connection\n_machine = connection.this_machine\n"
        "connection.this_machine = lambda: ('another boot', *_machine()[1:])",
        check=True,
    )
    try:
        ran = kernel.run("%%claim --on ray\ndoubled = sent * 2\nprint('ran')", check=True)
        assert ran.stdout == "ran\n", "the cell ran more than once, or not at all"
        facts = kernel.facts(
            "[owners(doubled)[-1], doubled.flags.writeable, float(doubled.sum()), "
            "len(connection.ray_connection.elsewhere)]"
        )
        assert facts == ["bytearray", True, 4_000_000.0, 1]
    finally:
        kernel.run(
            "connection.this_machine = _machine\nconnection.ray_connection.elsewhere.clear()",
            check=True,
        )


def test_an_input_a_method_changed_in_place_comes_back_from_the_task(kernel):
    """Guards against `rows.append(r)` on Ray changing only the task's copy."""
    kernel.run("rows, same = [1, 2], [5]\nkept = same", check=True)
    ran = kernel.run("%%claim --on ray\nrows.append(3)\nsame.count(5)", check=True)
    assert ran.stderr == ""
    assert kernel.facts("[rows, same is kept]") == [[1, 2, 3], True]


def test_a_task_draws_from_the_kernels_seeded_random_streams_and_hands_them_back(kernel):
    """Guards against a seeded notebook drawing different numbers once a cell runs on Ray."""
    unclaimed, claimed = kernel.unclaimed_and_claimed(
        setup="import random, numpy as np\nrandom.seed(4); np.random.seed(4)",
        body="a = random.random()\nb = np.random.rand(2).tolist()",
        after="[a, b, random.random(), np.random.rand()]",
        claim="%%claim --on ray",
    )
    assert claimed == unclaimed


def test_what_a_task_bound_before_it_raised_is_kept(kernel):
    """Guards against a cell on Ray losing what it had bound when it raised, as a normal
    cell would keep it."""
    ran = kernel.run(
        "%%claim --on ray\nlosses = []\nfor epoch in range(5):\n    losses.append(epoch)\n"
        "    if epoch == 3:\n        raise ValueError('diverged')"
    )
    assert ran.error["ename"] == "ValueError"
    assert kernel.facts("losses") == [0, 1, 2, 3]


def test_input_in_a_task_is_refused_with_the_reason(kernel):
    """Guards against `input()` in a Ray task hanging, or failing with a bare EOFError."""
    kernel.run(
        "%%claim --on ray\ntry:\n    input('who? ')\nexcept Exception as error:\n"
        "    why = f'{type(error).__name__}: {error}'",
        check=True,
    )
    why = kernel.facts("why")
    assert why.startswith("StdinNotImplementedError") and "Ray task" in why


def test_stdout_arrives_while_the_task_is_still_running(kernel, tmp_path):
    ran = kernel.prints_while_running("%%claim --on ray", go=tmp_path / "go")
    assert ran.error is None, ran.error
    assert ran.stdout.split() == ["early", "late"]


def test_the_last_expression_and_displays_are_shown(kernel):
    ran = kernel.run(
        "%%claim --on ray\nfrom IPython.display import display, HTML\n"
        "display(HTML('<b>hi</b>'))\n40 + 2",
        check=True,
    )
    assert "42" in ran.texts
    assert any(
        "<b>hi</b>" in m["content"]["data"].get("text/html", "") for m in ran.of("display_data")
    )


def test_the_record_says_a_peak_the_tasks_readings_missed(kernel):
    """Guards against a task's record giving the memory it held before and after a brief
    200 MB, which came and went between two readings."""
    ran = kernel.run("%%claim --on ray\nbrief = len(b'x' * (200 << 20))", check=True)
    peak = float(re.search(r"peak RSS ([\d.]+)MB", ran.texts[-1]).group(1))
    assert peak >= 200, ran.texts


def test_an_exception_shows_the_tasks_traceback(kernel):
    ran = kernel.run("%%claim --on ray\ndef inner():\n    raise ValueError('boom')\ninner()")
    assert ran.status == "error"
    assert ran.error["ename"] == "ValueError"
    assert "boom" in ran.error["evalue"]
    assert any("inner" in line for line in ran.error["traceback"])
    assert kernel.facts("1 + 1") == 2


def test_a_cell_that_kills_its_process_says_how_it_died(kernel):
    ran = kernel.run("%%claim --on ray\nimport os\nos._exit(3)")
    assert ran.error["ename"] == "WorkerDied"
    assert "exited with code 3" in "".join(ran.error["traceback"])
    assert kernel.facts("1 + 1") == 2


# -----------------------------------------------------------------------------
# Claims that cannot, or must not, go on
# -----------------------------------------------------------------------------


def test_a_claim_no_node_can_hold_fails_at_once_with_the_clusters_capacity(kernel):
    """Ray itself would keep such a task pending forever: a cell that ends at all was refused."""
    ran = kernel.run("%%claim cpus=64 --on ray\nprint('never')", timeout=60)
    assert ran.status == "error"
    shown = ran.stderr + "".join((ran.error or {}).get("traceback", []))
    assert "cpus=64 cannot run on this Ray cluster: its largest node has cpus=2 gpus=2" in shown
    assert "never" not in ran.stdout
    assert_cluster_idle(kernel)


def test_gpu_ram_alone_where_no_node_reads_its_cards_is_refused_saying_how_to_fix_it(kernel):
    """Guards against a gpu_ram= slice sent to Ray as a guess at the card's size (a share
    of a card that may not hold it), or refused without saying what would work: this
    cluster declares cards its nodes cannot read, as a node without the driver's tools."""
    ran = kernel.run("%%claim gpu_ram=10G --on ray\nprint('never')", timeout=120)
    assert ran.status == "error"
    shown = ran.stderr + "".join((ran.error or {}).get("traceback", []))
    assert "gpu_ram=10.0GB without gpus= cannot be turned into Ray's share of a card" in shown
    assert "no node of this cluster with cards could read their memory" in shown
    assert "gpus=0.25 is a quarter of a card" in shown
    assert "never" not in ran.stdout
    assert_cluster_idle(kernel)


def test_a_task_over_its_memory_budget_is_halted_with_the_numbers(kernel):
    ran = kernel.run(
        "%%claim ram=300M --on ray\nimport time\nblock = bytearray(600 * 2**20)\n"
        "for i in range(0, len(block), 4096): block[i] = 1\ntime.sleep(60)",
        timeout=60,
    )
    assert ran.error["ename"] == "ClaimHalted"
    assert "over its memory budget of 300.0MB" in "".join(ran.error["traceback"])
    assert_cluster_idle(kernel)


def test_a_task_past_its_timeout_is_stopped(kernel):
    # Not stopped, the cell would end a minute later without an error.
    ran = kernel.run("%%claim --on ray --timeout 2\nimport time\ntime.sleep(60)")
    assert ran.error["ename"] == "ClaimTimeout"
    assert_cluster_idle(kernel)


def test_the_stop_button_cancels_the_task(kernel):
    msg_id = kernel.client.execute(
        "%%claim cpus=2 --on ray\nimport os, subprocess, time\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "print(os.getpid(), child.pid, flush=True)\ntime.sleep(60)"
    )
    printing = kernel.messages_of(msg_id, until=printed("\n"), timeout=60)
    pids = [int(pid) for pid in printing.stdout.split()]
    kernel.interrupt()
    # Waited for 30 s at most, half the cell's sleep: only the stop can end it.
    ename = kernel.error_when_idle(msg_id, timeout=30)
    assert ename == "KeyboardInterrupt"
    # The stop ends the cell as a local claim's does: what the cell started
    # goes, and its worker stays, warm for the next cell.
    child = pids[1]
    assert gone(child, within=10), "the cell's child outlived the task"
    assert_cluster_idle(kernel)
    assert kernel.facts("'still here'") == "still here"


def assert_stopped_keeping_steps(kernel: Kernel, cell: str, said: str) -> None:
    """Stop ``cell`` once it has printed ``said``: it ends stopped, with ``steps`` bound."""
    msg_id = kernel.client.execute(cell)
    kernel.messages_of(msg_id, until=printed(said), timeout=60)
    kernel.interrupt()
    assert kernel.error_when_idle(msg_id, timeout=30) == "KeyboardInterrupt"
    assert kernel.facts("steps") > 0
    assert_cluster_idle(kernel)


def test_a_cell_on_ray_stopped_as_it_runs_keeps_what_it_bound(kernel):
    """Guards against the stop button losing what a cell on Ray had bound by then: a local
    claimed cell keeps it, as a normal cell does, and the task failed with it."""
    # It says so only once a step is done, so the stop always lands after one.
    assert_stopped_keeping_steps(
        kernel,
        "%%claim --on ray\nimport time\nsteps = 0\nwhile True:\n    steps += 1\n"
        "    if steps == 1:\n        print('training', flush=True)\n    time.sleep(0.01)",
        said="training",
    )


def test_a_cell_on_ray_stopped_as_it_prints_keeps_what_it_bound(kernel):
    """Guards against the stop Ray raises in the task landing as the task read the cell's
    output: held back there, it was sent again as a signal, which a Ray task's process
    blocks in every thread. It never landed, and Ray's forced cancel lost the cell's names."""
    assert_stopped_keeping_steps(
        kernel,
        "%%claim --on ray\nsteps = 0\nwhile True:\n    steps += 1\n    print(steps, flush=True)",
        said="1",
    )


def test_a_claim_block_on_ray_holds_its_share_from_entry_to_exit(kernel):
    """Guards against another user taking the card between two runs of one block."""
    kernel.run(
        "import os, time\nfrom fluksio_nb import claim\n"
        "def _free():\n"
        "    return {k: ray.available_resources().get(k, 0.0) for k in ('CPU', 'GPU')}\n"
        "with claim(cpus=1, gpus=1, on='ray') as c:\n"
        "    _until = time.monotonic() + 10\n"
        "    while _free() != {'CPU': 1.0, 'GPU': 1.0} and time.monotonic() < _until:\n"
        "        time.sleep(0.1)\n"
        "    held = _free()\n"
        "    cards = [c.run(lambda: os.environ['CUDA_VISIBLE_DEVICES']) for _ in range(2)]\n",
        check=True,
    )
    held, cards = kernel.facts("[held, cards]")
    assert held == {"CPU": 1.0, "GPU": 1.0}, "the block did not hold its share before a run"
    assert cards[0] == cards[1] and cards[0] in ("0", "1"), cards
    assert_cluster_idle(kernel)


def test_a_claim_block_on_ray_waits_for_its_share_and_gives_up_at_its_timeout(kernel):
    kernel.run(
        "import threading, time\nfrom fluksio_nb import claim\n"
        "_hogging = threading.Event()\n"
        "def _hog():\n    with claim(cpus=2, on='ray'):\n        _hogging.wait(60)\n"
        "hog = threading.Thread(target=_hog)\nhog.start()\n"
        "_until = time.monotonic() + 10\n"
        "while ray.available_resources().get('CPU', 0.0) and time.monotonic() < _until:\n"
        "    time.sleep(0.1)",
        check=True,
    )
    kernel.run(
        "from fluksio_nb import ClaimTimeout\n_started = time.monotonic()\n"
        "try:\n    with claim(cpus=1, on='ray', timeout=1):\n        entered = True\n"
        "except ClaimTimeout as error:\n"
        "    refused, waited = str(error), time.monotonic() - _started\n"
        # Held until now: a timeout that did not work would have waited on.
        "_hogging.set()\nhog.join()",
        check=True,
    )
    refused, waited, entered = kernel.facts("[refused, waited, 'entered' in dir()]")
    assert "waited 1 s for its share on the Ray cluster" in refused
    assert waited >= 1 and not entered
    assert_cluster_idle(kernel)


def stream_of(kernel, msg_id: str, within: float = 60) -> str:
    """The first output a cell started by ``msg_id`` printed, whenever it printed it."""
    ran = kernel.messages_of(msg_id, until=sent("stream"), timeout=within, past_idle=True)
    return ran.of("stream")[0]["content"]["text"]


def test_a_background_claim_on_ray_returns_at_once_with_its_names_on_the_handle(kernel):
    started = kernel.start_job(
        "%%claim --on ray --background --label bg\nimport time\ntime.sleep(3)\n"
        "print('from the task')\nanswer = 42",
        "bg",
    )
    assert kernel.facts("bg.done()") is False, "the magic waited for the task"
    later = kernel.run("import time\ntime.sleep(5)\nprint('later cell')", check=True)
    assert "from the task" not in later.stdout
    facts = kernel.facts("[bg.result(60)['answer'], 'answer' in dir(), bg.status]")
    assert facts == [42, False, "ok"]
    assert stream_of(kernel, started.msg_id) == "from the task\n"
    assert_cluster_idle(kernel)


def test_a_background_claim_on_ray_can_be_cancelled_and_its_task_ends(kernel):
    started = kernel.start_job(
        "%%claim --on ray --background --label doomed\nimport subprocess, time\n"
        "child = subprocess.Popen(['sleep', '60'])\nprint(child.pid, flush=True)\ntime.sleep(60)",
        "doomed",
    )
    child = int(stream_of(kernel, started.msg_id))
    assert kernel.facts("doomed.cancel()") is True
    kernel.run(
        "try:\n    doomed.result(30)\nexcept Exception as error:\n"
        "    ended = (type(error).__name__, str(error))",
        check=True,
    )
    name, message = kernel.facts("ended")
    assert name == "ClaimCancelled" and "cancelled from its job handle" in message
    assert kernel.facts("[doomed.status, doomed.cancel()]") == ["cancelled", False]
    # Stopped as the stop button stops it: what the cell started goes with it.
    assert gone(child, within=10), "the cell's child outlived the cancelled task"
    assert_cluster_idle(kernel)


def test_a_background_claim_on_ray_with_an_unsendable_input_starts_nothing(kernel):
    kernel.run("import threading\nlock = threading.Lock()", check=True)
    ran = kernel.run("%%claim --on ray --background\nwith lock:\n    pass")
    assert ran.status == "error"
    shown = ran.stderr + "".join((ran.error or {}).get("traceback", []))
    assert "cannot send 'lock'" in shown and shown.strip().count("\n") == 0, shown
    assert kernel.facts("'still here'") == "still here"


# -----------------------------------------------------------------------------
# The monitor, and what is left behind
# -----------------------------------------------------------------------------


def hold_a_ray_claim(kernel, label: str, seconds: float) -> None:
    """Start, in a thread of the kernel's, a Ray claim that sleeps ``seconds``; ``holder``."""
    kernel.run(
        "import threading\nfrom fluksio_nb import claim\n"
        "def _hold():\n"
        f"    with claim(cpus=1, gpus=1, ram='100M', label={label!r}, on='ray') as c:\n"
        f"        c.run(__import__('time').sleep, {seconds})\n"
        "holder = threading.Thread(target=_hold)\nholder.start()",
        check=True,
    )


def test_the_monitor_sees_the_cluster_and_this_kernels_claims_on_it(kernel):
    hold_a_ray_claim(kernel, "held", 4)
    deadline = time.monotonic() + 30
    while True:
        snapshot = kernel.facts("__import__('fluksio_nb.ray.monitor').ray.monitor.ray_snapshot()")
        held = [c for c in snapshot["claims"] if c["label"] == "held"]
        # Its cards are Ray's to name once its task runs; the block holds its share before.
        if held and held[0]["phase"] == "running" and held[0]["gpus"]:
            break
        assert time.monotonic() < deadline, snapshot
        time.sleep(0.2)
    assert snapshot["nodes"] == 1
    assert snapshot["total"]["cpus"] == 2 and snapshot["total"]["gpus"] == 2
    assert snapshot["available"]["cpus"] == 1 and snapshot["available"]["gpus"] == 1
    assert held[0]["asked"] == {"cpus": 1, "gpus": 1, "ram_bytes": 100_000_000}
    assert held[0]["gpus"] in ([0], [1])
    kernel.run("holder.join()", check=True)
    after = kernel.facts(
        "__import__('fluksio_nb.ray.monitor').ray.monitor.ray_snapshot()['claims']"
    )
    assert after == [], "a claim that ended should leave the monitor"


def test_claims_shows_the_cluster_and_a_running_claim_of_this_kernel(kernel):
    """%claims, widget and text alike, must show the cluster and this kernel's claim on it."""
    hostile = "<img src=x onerror=alert(1)>"
    hold_a_ray_claim(kernel, hostile, 6)
    deadline = time.monotonic() + 30
    while True:
        # Running, with a reading: what the monitor should then show of it.
        claims = kernel.facts(
            "__import__('fluksio_nb.ray.monitor').ray.monitor.ray_snapshot()['claims']"
        )
        if claims and claims[0]["phase"] == "running" and claims[0]["rss_bytes"]:
            break
        assert time.monotonic() < deadline, claims
        time.sleep(0.2)

    ran = kernel.run("%claims", check=True)
    (result,) = ran.of("execute_result")
    data = result["content"]["data"]
    model_id = data["application/vnd.jupyter.widget-view+json"]["model_id"]
    (opened,) = [m for m in ran.of("comm_open") if m["content"]["comm_id"] == model_id]
    ray = opened["content"]["data"]["state"]["machine"]["ray"]
    assert ray["nodes"] == 1
    assert (ray["total"]["cpus"], ray["total"]["gpus"]) == (2, 2)
    assert (ray["available"]["cpus"], ray["available"]["gpus"]) == (1, 1)
    assert 0 < ray["available"]["memory_bytes"] < ray["total"]["memory_bytes"]
    (held,) = ray["claims"]
    assert (held["label"], held["phase"], held["asked"]) == (
        hostile,
        "running",
        "cpus=1 gpus=1 ram=100.0MB",
    )
    assert held["gpus"] in ([0], [1])
    assert held["rss_bytes"] > 0 and held["budget_bytes"] <= 100_000_000
    assert abs(held["started"] - time.time()) < 60

    text = data["text/plain"].splitlines()
    assert "ray cpus    1/2 used" in text and "ray gpus    1/2 used" in text
    (line,) = [line for line in text if line.startswith("ray running")]
    card = held["gpus"][0]
    assert line.startswith(f"ray running  {hostile}: cpus=1 gpus=1 ram=100.0MB, cards {card}, RSS ")
    assert hostile not in data["text/html"], "a label reached the HTML fallback unescaped"

    kernel.run("holder.join()", check=True)
    assert_cluster_idle(kernel)  # Ray's own books catch up a moment after the task ends
    after = kernel.run("%claims", check=True).of("execute_result")[0]["content"]["data"]
    assert "ray running" not in after["text/plain"]
    assert "ray cpus    0/2 used" in after["text/plain"]


def test_ray_keeps_its_state_out_of_the_home_directory(kernel, ray_state):
    state, before = ray_state
    assert any(name.startswith("session_") for name in os.listdir(state)), (
        "Ray's session should be in the test's temporary directory"
    )
    assert _listing(Path.home() / ".ray") == before["home"], "Ray wrote to ~/.ray"
    assert _listing(Path(tempfile.gettempdir()) / "ray") == before["tmp"], "Ray wrote to /tmp/ray"


def test_the_snapshot_is_none_where_ray_is_not_connected():
    """The monitor may ask every second; asking must never start or join a cluster."""
    import sys

    from fluksio_nb.ray.monitor import ray_snapshot

    assert ray_snapshot() is None
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()
