"""Claimed cells in a real kernel: the share reaches the library, and every ending is clean.

Each test drives an ipykernel through jupyter_client, as a notebook does.
The failures guarded against are the ones a user would meet: a share that
never reached numpy, two cells on one card, output that only appears at the
end, variables that do not come back, and any ending (an exception, the stop
button, a dead worker, a timeout, a memory overrun) that leaves a share
taken, a process running, or a kernel that no longer answers.
"""

import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests import small_shm
from tests.kernels import (
    LEAVES_THREE_RUNNING,
    Until,
    printed,
    started_kernel,
    until_it_exists,
)
from tests.small_shm import require_small_shm
from tests.stops import said_by
from tests.user_books import users_books
from tests.waiting import gone

pytestmark = pytest.mark.timeout(180)

INVENTORY = {
    "FLUKSIO_CPUS": "2",
    "FLUKSIO_GPUS": "2",
    "FLUKSIO_RAM": "8G",
    "FLUKSIO_RESERVE_CPUS": "0",
}


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with started_kernel(tmp_path_factory.mktemp("kernel"), **INVENTORY) as k:
        yield k


def assert_books_balanced(kernel):
    books = kernel.books()
    assert books["cpus"]["total"] == books["cpus"]["free"] == 2
    assert len(books["cpus"]["free_ids"]) == 2
    assert books["gpus"]["free"] == 2
    assert books["running"] == [] and books["waiting"] == []


# -----------------------------------------------------------------------------
# The share reaches the libraries
# -----------------------------------------------------------------------------


def test_a_one_core_claim_gives_openblas_one_thread(kernel):
    """The whole point: the env must be there when numpy loads OpenBLAS."""
    ran = kernel.run(
        "%%claim cpus=1\n"
        "import json, threadpoolctl, numpy\n"
        "print(json.dumps([(p['internal_api'], p['num_threads']) "
        "for p in threadpoolctl.threadpool_info()]))",
        check=True,
    )
    pools = dict(ran.json())
    assert pools.get("openblas") == 1, pools


def test_claimed_work_runs_off_the_reserved_core(tmp_path):
    """The reserve keeps the kernel answering only if workers cannot run on it."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one to keep back and one to claim")
    with started_kernel(tmp_path, FLUKSIO_RESERVE_CPUS="1") as reserved:
        in_worker = reserved.run(
            "%%claim cpus=1\nimport json, os\nprint(json.dumps(sorted(os.sched_getaffinity(0))))",
            check=True,
        ).json()
        in_popen = reserved.run(
            "import json, subprocess, sys\nfrom fluksio_nb import claim\n"
            "SHOW = 'import os; print(sorted(os.sched_getaffinity(0)))'\n"
            "with claim(cpus=1) as c:\n"
            "    p = c.popen([sys.executable, '-c', SHOW], stdout=subprocess.PIPE, text=True)\n"
            "    print(json.dumps(eval(p.communicate()[0])))",
            check=True,
        ).json()
        in_kernel = reserved.facts("sorted(__import__('os').sched_getaffinity(0))")
    assert in_worker == in_popen == cores[1:]
    assert in_kernel == cores, "the kernel itself is not confined"


def test_a_claims_process_sharing_the_kernels_group_ends_alone(kernel):
    """Guards against `c.popen(..., start_new_session=False)`, whose process shares the
    kernel's process group, ending the kernel with it when the claim ended."""
    ran = kernel.run(
        "import os\n"
        "from fluksio_nb import claim\n"
        "with claim(cpus=1) as c:\n"
        "    p = c.popen(['sleep', '300'], start_new_session=False)\n"
        "    shares = os.getpgid(p.pid) == os.getpgid(0)\n"
        "print(shares, p.poll() is not None)",
        timeout=60,
        check=True,
    )
    assert ran.stdout.split() == ["True", "True"]
    assert_books_balanced(kernel)


def test_a_plain_cell_still_runs_in_the_kernel(kernel):
    """Declaring nothing changes nothing."""
    assert kernel.facts("__import__('os').getpid()") == kernel.pid


def test_two_gpu_claims_at_once_get_different_cards(kernel, tmp_path):
    go = tmp_path / "go"
    cell = (
        "%%claim gpus=1 --background --out card\n"
        f"{until_it_exists(go)}card = os.environ['CUDA_VISIBLE_DEVICES']"
    )
    kernel.start_job(cell, "first")
    kernel.start_job(cell, "second")
    go.touch()
    cards = kernel.facts("[first.result(30)['card'], second.result(30)['card']]")
    assert sorted(cards) == ["0", "1"]
    assert_books_balanced(kernel)


# -----------------------------------------------------------------------------
# It behaves like a cell
# -----------------------------------------------------------------------------


def test_variables_travel_in_and_out_including_a_large_array(kernel):
    kernel.run(
        "import numpy as np\nbig = np.ones(25_000_000)\nscale = 3\n"
        "def double(x):\n    return 2 * x",
        check=True,
    )
    kernel.run(
        "%%claim\ntotal = float((big * scale).sum())\nbig[0] = 7\nbigger = double(big)", check=True
    )
    facts = kernel.facts(
        "[total, float(bigger[0]), float(bigger[1]), bigger.nbytes, float(big[0])]"
    )
    assert facts == [75_000_000.0, 14.0, 2.0, 200_000_000, 7.0]


def test_an_input_a_method_changed_in_place_comes_back_changed(kernel):
    """Guards against `rows.append(r)` or `model.fit(X)` in a claimed cell changing nothing."""
    kernel.run(
        "import numpy as np\nrows, counts, field = [1, 2], {'a': 1}, np.zeros(1_000_000)\n"
        "class Model:\n    fitted = False\n    def fit(self, data):\n"
        "        self.fitted, self.size = True, len(data)\nmodel = Model()",
        check=True,
    )
    ran = kernel.run(
        "%%claim\nrows.append(3)\ncounts.update(b=2)\nfield.fill(7)\nmodel.fit(rows)",
        check=True,
    )
    assert ran.stderr == ""
    facts = kernel.facts("[rows, counts, float(field[-1]), model.fitted, model.size]")
    assert facts == [[1, 2, 3], {"a": 1, "b": 2}, 7.0, True, 3]


def test_an_input_changed_through_a_call_result_or_argument_comes_back_changed(kernel):
    """Guards against `last = stack.pop()`, `random.shuffle(deck)` or a drawn `rng` changing
    only the worker's copy: the kernel must be left as the same cell run unclaimed leaves it."""
    unclaimed, claimed = kernel.unclaimed_and_claimed(
        setup="import random, numpy as np\n"
        "deck, stack, rng = list(range(20)), [1, 2, 3], np.random.default_rng(0)",
        body="random.seed(1)\nrandom.shuffle(deck)\nlast = stack.pop()\ndraw = rng.random()",
        after="[deck, stack, last, draw, rng.random()]",
    )
    assert claimed == unclaimed
    assert claimed[0] != list(range(20)) and claimed[1] == [1, 2]


def test_an_input_a_method_only_read_stays_the_kernels_own_object(kernel):
    """Guards against a read-only method call replacing the kernel's object with a copy."""
    kernel.run("rows = [1, 2]\nsame_rows = rows", check=True)
    ran = kernel.run("%%claim\nn = rows.count(1)\nrows.index(2)\nprint(len(rows))", check=True)
    assert ran.stderr == ""
    assert kernel.facts("rows is same_rows") is True


def test_a_function_made_in_a_claimed_cell_reads_the_kernels_globals_after_it(kernel):
    """Guards against a helper defined in a claimed cell keeping the globals the cell saw:
    `offset = 100` in a later cell must reach it, as it reaches one defined in a normal cell."""
    kernel.run("offset, BASE, UNIT = 1, 1, 'cm'", check=True)
    ran = kernel.run(
        "%%claim\n"
        "def shifted(x):\n    return x + offset\n"
        "class Meter:\n"
        "    def read(self):\n        return BASE + 1\n"
        "    @staticmethod\n    def unit():\n        return UNIT\n"
        "    @property\n    def level(self):\n        return BASE * 2\n"
        "meter = Meter()",
        check=True,
    )
    assert ran.stderr == ""
    kernel.run("offset, BASE, UNIT = 100, 10, 'm'\nlater = 5", check=True)
    facts = kernel.facts(
        "[shifted(0), meter.read(), Meter.unit(), meter.level, isinstance(meter, Meter)]"
    )
    assert facts == [100, 11, "m", 20, True]


def test_a_notebook_function_sent_in_reads_what_the_cell_assigns(kernel):
    """Guards against a function sent by value reading the globals it was sent with, when
    the claimed cell rebinds one before calling it, and against a function it calls in turn
    doing the same."""
    kernel.run(
        "K = 1\ndef scaled(x):\n    return x * K\ndef twice(x):\n    return scaled(x) * 2",
        check=True,
    )
    kernel.run("%%claim\nK = 5\ny = twice(1)", check=True)
    assert kernel.facts("[y, K, twice(1)]") == [10, 5, 10]


def test_a_global_a_notebook_function_assigns_comes_back(kernel):
    """Guards against `bump()` changing `counter` only in the worker, when `bump`, or a
    function it calls, says `global counter`, as a normal cell would leave it changed."""
    unclaimed, claimed = kernel.unclaimed_and_claimed(
        setup="counter, calls = 0, []\n"
        "def note(x):\n    global calls\n    calls = calls + [x]\n"
        "def bump():\n    global counter\n    counter += 1\n    note(counter)",
        body="bump()\nbump()",
        after="[counter, calls]",
    )
    assert claimed == unclaimed == [2, [1, 2]]


def test_an_input_function_passed_to_a_call_stays_the_kernels_own(kernel):
    """Guards against `apply(f, x)` sending back a copy of `f` that replaces the kernel's."""
    kernel.run(
        "def f(x):\n    return x + 1\ndef apply(g, v):\n    return g(v)\nclass Model:\n"
        "    pass\nsame_f, same_model = f, Model\nmodel = Model()",
        check=True,
    )
    kernel.run("%%claim\ny = apply(f, 2)\nm = apply(type, model)", check=True)
    assert kernel.facts("[y, f is same_f, Model is same_model, isinstance(model, Model)]") == [
        3,
        True,
        True,
        True,
    ]


def test_a_claimed_cell_draws_from_the_kernels_seeded_random_streams(kernel):
    """Guards against a notebook seeded at its top drawing different numbers once a cell is
    claimed: the cell continues the kernel's streams, and the next cell continues the cell's."""
    seeded = {
        "setup": "import random, numpy as np\nrandom.seed(1); np.random.seed(1)",
        "body": "a = random.random()\nb = np.random.rand(2).tolist()",
        "after": "[a, b, random.random(), np.random.rand()]",
    }
    unclaimed, claimed = kernel.unclaimed_and_claimed(**seeded)
    assert claimed == unclaimed
    # The warm worker's own streams, advanced by the cell above, must not leak into the next.
    assert kernel.unclaimed_and_claimed(**seeded) == (unclaimed, unclaimed)


def test_input_and_getpass_in_a_claimed_cell_ask_the_notebook(kernel):
    """Guards against `input()` in a claimed cell failing at once on the worker's empty stdin,
    where the same cell unclaimed would ask in the notebook."""
    ran = kernel.run(
        "%%claim\nimport getpass\nprint('before')\nname = input('who? ')\n"
        "secret = getpass.getpass('key: ')",
        check=True,
        answers=["ada", "s3cret"],
    )
    assert [(p["prompt"], p["password"]) for p in ran.prompts] == [
        ("who? ", False),
        ("key: ", True),
    ]
    assert ran.stdout.strip() == "before"
    assert kernel.facts("[name, secret]") == ["ada", "s3cret"]


def test_input_where_nobody_can_answer_says_so_and_leaves_the_worker_usable(kernel):
    """Guards against a front end without input, or a background cell, hanging on `input()`."""
    ran = kernel.run("%%claim\nname = input('who? ')")
    assert ran.error["ename"] == "StdinNotImplementedError"
    assert "does not support input requests" in ran.error["evalue"]
    kernel.run(
        "%%claim --background\ntry:\n    input()\nexcept Exception as e:\n    why = str(e)",
        check=True,
    )
    assert "not from a --background cell" in kernel.facts("_.result(30)['why']")
    assert kernel.run("%%claim\nx = 2", check=True).status == "ok"


def test_a_warm_worker_sees_the_kernels_environment_as_it_is_now(kernel):
    """Guards against `os.environ["HF_TOKEN"] = ...` or `%env` in the kernel not reaching a
    worker started before it, and against one claimed cell's variables leaking into the next."""
    show = "%%claim cpus=1\nimport os, json\nprint(json.dumps([os.environ.get(n) for n in NAMES]))"
    kernel.run("NAMES = ['MY_TOKEN', 'LEFT_BEHIND', 'OMP_NUM_THREADS', 'MPLBACKEND']", check=True)
    before = kernel.run(show, check=True).json()
    assert before[:3] == [None, None, "1"]
    kernel.run("%%claim cpus=1\nimport os\nos.environ['LEFT_BEHIND'] = '1'", check=True)
    assert kernel.run(show, check=True).json() == before
    kernel.run("%env MY_TOKEN=abc", check=True)
    kernel.run("%%claim cpus=1\nimport os\nos.environ['LEFT_BEHIND'] = '1'", check=True)
    assert kernel.run(show, check=True).json() == ["abc", None, "1", before[3]]
    kernel.run("import os\ndel os.environ['MY_TOKEN']", check=True)
    assert kernel.run(show, check=True).json() == before


def test_in_and_out_override_the_automatic_choice(kernel):
    kernel.run("a, b = 1, 2", check=True)
    ran = kernel.run("%%claim --in a --out c\nprint('b' in dir())\nc = a + 10\nd = 5", check=True)
    assert ran.stdout.strip() == "False"
    assert kernel.facts("[c, 'd' in dir()]") == [11, False]


def test_a_name_the_cell_deletes_is_gone_from_the_kernel_too(kernel):
    """Guards against `del` in a claimed cell warning, or leaving the name behind."""
    kernel.run("scratch, keep = 5, 1", check=True)
    ran = kernel.run("%%claim\ntwice = scratch * 2\ndel scratch", check=True)
    assert ran.stderr == ""
    assert kernel.facts("[twice, 'scratch' in dir(), keep]") == [10, False, 1]


def test_a_name_bound_only_on_a_branch_not_taken_is_no_warning(kernel):
    ran = kernel.run("%%claim\nif False:\n    never = 1\nlater = 2", check=True)
    assert ran.stderr == ""
    assert kernel.facts("[later, 'never' in dir()]") == [2, False]


def test_an_out_name_the_cell_never_defined_fails_the_cell_after_the_rest_are_bound(kernel):
    """--out is the user's word: a name it promises and the cell lacks stops "Run All"."""
    ran = kernel.run("%%claim --out promised,given\ngiven = 1")
    assert ran.status == "error" and ran.error["ename"] == "NotBroughtBack", ran.error
    assert "promised (the cell did not define it)" in ran.error["evalue"]
    assert kernel.facts("given") == 1


def test_a_name_that_cannot_come_back_fails_the_cell_in_one_paragraph_naming_it(kernel):
    """Guards against a silent half-success: the cell said ok, and the next cell of a
    "Run All" failed on a name that was never there."""
    ran = kernel.run("%%claim\nimport threading\nlock = threading.Lock()\nsteps = 3")
    assert ran.status == "error" and ran.error["ename"] == "NotBroughtBack", ran.error
    shown = "".join(ran.error["traceback"])
    assert "this name did not come back to the kernel: lock (" in shown
    assert "_thread.lock" in shown and "Everything else it bound is in the kernel" in shown
    assert shown.strip().count("\n") == 0, "one paragraph, no traceback through fluksio_nb"
    assert kernel.facts("[steps, 'lock' in dir()]") == [3, False]
    assert_books_balanced(kernel)


def test_a_name_too_big_for_dev_shm_fails_the_cell_naming_it_and_the_rest_come_back(tmp_path):
    """Guards against a full /dev/shm as a bus error, a hang, an ok cell missing a name, or
    a half-written file left taking the room: the one name fails, in words, and nothing stays."""
    require_small_shm()
    with started_kernel(tmp_path, launched_by=small_shm.launcher("4m"), **INVENTORY) as small:
        ran = small.run(
            "%%claim\nimport numpy as np\n"
            # 800 KB: through /dev/shm too, and it has room for that.
            "fits = np.arange(100_000)\n"
            "big = np.ones(2**21)\n"  # 16 MiB, four times the room there is
            "small = 7"
        )
        assert ran.status == "error" and ran.error["ename"] == "NotBroughtBack", ran.error
        shown = "".join(ran.error["traceback"])
        assert "this name did not come back to the kernel: big (" in shown, shown
        assert "/dev/shm has no room for 16 MiB (4.0 MiB in all)" in shown, shown
        assert "Errno" not in shown, "in words, not as an errno"
        assert shown.strip().count("\n") == 0, "one paragraph, no traceback through fluksio_nb"
        assert small.facts("[small, int(fits.sum()), 'big' in dir()]") == [7, 4999950000, False]
        # Its /dev/shm, as the kernel and its worker see it: nothing half-written left there.
        assert small.facts("sorted(__import__('os').listdir('/dev/shm'))") == []
        assert small.books()["running"] == []
        # Room enough again once the cell leaves the big one behind.
        ran = small.run(
            "%%claim\nimport numpy as np\nbig = np.ones(2**21)\nhead = big[:3].tolist()\ndel big"
        )
        assert ran.status == "ok", ran.so_far()
        assert small.facts("head") == [1.0, 1.0, 1.0]


def test_every_claimed_cell_starts_from_a_fresh_namespace(kernel):
    kernel.run("%%claim --out y\nsecret = 1\ny = 2", check=True)
    ran = kernel.run("%%claim\nprint('secret' in dir())", check=True)
    assert ran.stdout.strip() == "False"


def test_stdout_arrives_while_the_cell_is_still_running(kernel, tmp_path):
    ran = kernel.prints_while_running("%%claim", go=tmp_path / "go")
    assert ran.error is None, ran.error
    assert ran.stdout.split() == ["early", "late"]


def test_the_last_expression_and_displays_are_shown(kernel):
    ran = kernel.run(
        "%%claim\nfrom IPython.display import display, HTML\ndisplay(HTML('<b>hi</b>'))\n40 + 2",
        check=True,
    )
    assert "42" in ran.texts
    assert any(
        "text/html" in m["content"]["data"] and "<b>hi</b>" in m["content"]["data"]["text/html"]
        for m in ran.of("display_data")
    )


def kept_outputs(ran) -> list[str]:
    """The plain text of each output a notebook keeps once the cell is over, as
    JupyterLab keeps them: cleared, redrawn by display id, or added."""
    kept: list[dict] = []
    clear_at_next = False
    for message in ran.messages:
        kind, content = message["msg_type"], message["content"]
        if kind == "clear_output":
            if content["wait"]:
                clear_at_next = True
            else:
                kept = []
            continue
        if kind == "update_display_data":
            shown_as = content["transient"]["display_id"]
            for output in kept:
                if output.get("display_id") == shown_as:
                    output["text"] = content["data"]["text/plain"]
            continue
        if kind not in ("stream", "display_data"):
            continue
        if clear_at_next:
            kept, clear_at_next = [], False
        if kind == "stream":
            kept.append({"text": content["text"]})
        else:
            shown_as = content.get("transient", {}).get("display_id")
            kept.append({"text": content["data"]["text/plain"], "display_id": shown_as})
    return [output["text"] for output in kept]


def test_clear_output_and_redrawn_displays_in_a_claimed_cell_reach_the_notebook(kernel):
    """Guards against a live-updating loop piling up its output in a claimed cell."""
    ran = kernel.run(
        "%%claim --label redrawn\nfrom IPython.display import display, clear_output\n"
        "shown = display('first', display_id=True)\nshown.update('second')\n"
        "for i in range(3):\n    clear_output(wait=True)\n    print('tick', i)\n"
        "del shown",
        check=True,
    )
    [first] = [m for m in ran.of("display_data") if m["content"]["data"]["text/plain"] == "'first'"]
    [redrawn] = ran.of("update_display_data")
    assert redrawn["content"]["data"]["text/plain"] == "'second'"
    assert redrawn["content"]["transient"] == first["content"]["transient"]
    assert [m["content"]["wait"] for m in ran.of("clear_output")] == [True, True, True]
    assert kept_outputs(ran)[0] == "tick 2\n"


def test_a_cell_that_clears_its_output_after_the_live_view_still_ends_with_its_record(
    kernel, tmp_path
):
    """Guards against the record being drawn into a view the cell's clear_output removed."""
    go = tmp_path / "go"
    msg_id = kernel.client.execute(
        "%%claim --label clearing\nfrom IPython.display import clear_output\n"
        f"{until_it_exists(go)}clear_output()\nprint('after')"
    )
    try:
        kernel.messages_of(
            msg_id, until=Until("draw its live view", lambda r: r.of("display_data"))
        )
    finally:
        go.touch()
    kept = kept_outputs(kernel.messages_of(msg_id))
    assert kept[0] == "after\n"
    assert len(kept) == 2 and kept[1].startswith("clearing: ok"), kept


def test_a_foreground_cells_status_and_record_stay_above_all_its_output(kernel, tmp_path):
    """Guards against a claimed cell's output split around its status: the first print
    above the live view, drawn a moment into the claim, and the rest below it; and
    against the record going below the output, where a background cell's stays above.
    The status holds its place from the claim's start, and the record takes it."""
    go = tmp_path / "go"
    msg_id = kernel.client.execute(
        f"%%claim --label steps\nprint('step 0', flush=True)\n{until_it_exists(go)}"
        "print('step 1')\nprint('step 2')"
    )
    try:
        kernel.messages_of(
            msg_id,
            until=Until(
                "draw its live view after its first print",
                lambda r: (
                    "step 0" in r.stdout
                    and any(
                        "application/vnd.jupyter.widget-view+json" in m["content"]["data"]
                        for m in r.of("display_data", "update_display_data")
                    )
                ),
            ),
        )
    finally:
        go.touch()
    kept = [text for text in kept_outputs(kernel.messages_of(msg_id)) if text]
    assert kept[0].startswith("steps: ok"), kept
    assert "".join(kept[1:]) == "step 0\nstep 1\nstep 2\n", kept


def test_a_background_cells_record_stays_above_its_output_where_its_status_was(kernel):
    """Guards against a background cell's record moving below its prints, where a
    notebook saved by nbconvert or papermill never has it (they read no output sent
    after the cell ended). Its status is drawn before the job runs, above all it prints,
    so there is no timing for the record's place to depend on."""

    def record_drawn(ran):
        return any(text.startswith("steps: ok") for text in kept_outputs(ran))

    msg_id = kernel.client.execute(
        "%%claim --background --label steps\nprint('step 0', flush=True)\nprint('step 1')"
    )
    ran = kernel.messages_of(
        msg_id, until=Until("end with its record", record_drawn), past_idle=True
    )
    kept = kept_outputs(ran)
    assert kept[0].startswith("steps: ok"), kept
    assert "".join(kept[1:]) == "step 0\nstep 1\n", kept


def test_a_matplotlib_figure_comes_back_as_an_image(kernel):
    ran = kernel.run(
        "%%claim\n%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])",
        check=True,
    )
    assert any("image/png" in m["content"]["data"] for m in ran.of("display_data"))


# -----------------------------------------------------------------------------
# Every ending gives the share back and leaves the kernel answering
# -----------------------------------------------------------------------------


def test_an_exception_shows_the_workers_traceback(kernel):
    ran = kernel.run("%%claim gpus=1\ndef inner():\n    raise ValueError('boom')\ninner()")
    # Its traceback says its In[n] as the notebook numbers it: as the kernel said it began.
    (began,) = ran.of("execute_input")
    number = began["content"]["execution_count"]
    assert ran.status == "error"
    assert ran.error["ename"] == "ValueError"
    assert "boom" in ran.error["evalue"]
    assert any("inner" in line for line in ran.error["traceback"])
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(ran.error["traceback"]))
    assert f"Cell In[{number}], line 3" in shown, repr(shown)
    assert_books_balanced(kernel)
    assert kernel.facts("1 + 1") == 2


def _traceback_text(ran) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(ran.error["traceback"]))


def _cell_number(ran) -> int:
    (began,) = ran.of("execute_input")
    return began["content"]["execution_count"]


def test_a_traceback_through_a_notebook_function_shows_the_cell_it_was_defined_in(kernel):
    """Both ways: a kernel function failing in a claimed cell, a claimed cell's in the kernel."""
    defined = kernel.run(
        "class Scaler:\n"
        "    def scale(self, x):\n"
        "        return [1 / v for v in x]\n"
        "\n"
        "def halve(x):\n"
        "    y = x - x\n"
        "    return Scaler().scale([y])\n",
        check=True,
    )
    there = kernel.run("%%claim\nhalve(3)")
    shown = _traceback_text(there)
    # The function, and the method and comprehension inside it, each at its own line.
    number = _cell_number(defined)
    assert f"Cell In[{number}], line 7, in halve" in shown, shown
    assert f"Cell In[{number}], line 3, in Scaler.scale" in shown, shown
    assert "----> 7     return Scaler().scale([y])" in shown, shown
    assert "dynamic-code" not in shown and "Could not get source" not in shown, shown

    claimed = kernel.run(
        "%%claim\ndef parse(text):\n    fields = text.split(',')\n    return int(fields[3])\n",
        check=True,
    )
    here = kernel.run("parse('1,2')")
    shown = _traceback_text(here)
    # Lines counted from under the %%claim line, as for the claimed cell's own traceback.
    assert f"Cell In[{_cell_number(claimed)}], line 3, in parse" in shown, shown
    assert "----> 3     return int(fields[3])" in shown, shown
    # What `parse??` shows.
    source = kernel.facts("__import__('inspect').getsource(parse)")
    assert source.startswith("def parse(text):\n"), source
    again = kernel.run("%%claim\nparse('1')")
    assert f"Cell In[{_cell_number(claimed)}], line 3, in parse" in _traceback_text(again)
    assert_books_balanced(kernel)


def test_the_stop_button_interrupts_a_running_claim(kernel):
    msg_id = kernel.client.execute(
        "%%claim\nimport os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)"
    )
    # Its worker's pid: the cell is running.
    kernel.messages_of(msg_id, until=printed("\n"))
    kernel.interrupt()
    # Waited for 30 s at most, half the cell's sleep: only the stop can end it.
    error = kernel.messages_of(msg_id, timeout=30).error
    assert error["ename"] == "KeyboardInterrupt"
    # Where the user's cell was, as the worker says it: in the sleep, or at the
    # print whose line was still on its way out when the stop came (it is held
    # back until the line is out); none of fluksio_nb's frames either way.
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error["traceback"]))
    assert "----> 3 time.sleep(60)" in shown or "----> 2 print(" in shown, shown
    assert "fluksio_nb" not in shown, shown
    assert_books_balanced(kernel)
    assert kernel.facts("'still here'") == "still here"


def test_a_worker_stopped_by_a_signal_says_so_and_the_stop_button_still_ends_it(kernel):
    """``kill -STOP`` or a debugger must not leave a cell hanging with no word."""
    msg_id = kernel.client.execute(
        "%%claim --label frozen\nimport os, signal\nos.kill(os.getpid(), signal.SIGSTOP)"
    )

    def says_stopped(ran) -> bool:
        # The live status is the claim's widget: its state, pushed as comm messages.
        return any(
            "stopped by a signal since" in m["content"]["data"].get("state", {}).get("doing", "")
            for m in kernel.seen
            if m["msg_type"] == "comm_msg"
        )

    kernel.messages_of(msg_id, until=Until("say it was stopped by a signal", says_stopped))
    kernel.interrupt()
    assert kernel.error_when_idle(msg_id) == "KeyboardInterrupt"
    assert_books_balanced(kernel)
    assert kernel.facts("'still here'") == "still here"


def test_results_on_their_way_back_are_said_apart_from_the_running(kernel, tmp_path):
    """A cell whose loop is over must not say "running" while its results travel."""
    go = tmp_path / "go"
    msg_id = kernel.client.execute(
        "%%claim --label sender\n"
        "class SlowToSend:\n"
        "    def __reduce__(self):\n"
        "        import os, time\n"
        f"        while not os.path.exists({str(go)!r}):\n"
        "            time.sleep(0.05)\n"
        "        return (int, (7,))\n"
        "result = SlowToSend()"
    )

    def says_sending(ran) -> bool:
        return any(
            m["content"]["data"]
            .get("state", {})
            .get("doing", "")
            .startswith("sending results back")
            for m in kernel.seen
            if m["msg_type"] == "comm_msg"
        )

    kernel.messages_of(msg_id, until=Until("say its results are on their way back", says_sending))
    go.touch()
    ran = kernel.messages_of(msg_id, timeout=60)
    assert kernel.reply_to(msg_id)["content"]["status"] == "ok"
    assert kernel.facts("result") == 7
    (record,) = [t for t in ran.texts if t.startswith("sender: ok · ")]
    assert re.match(r"sender: ok · waited [\d.]+ s(, started a worker in [\d.]+ s)?, ran ", record)


def says_doing(pattern: str):
    """An ``until`` for the claim's widget saying ``pattern`` (a regex) of what it does.

    Only this cell's widget counts: an earlier cell's said the same of itself.
    """

    def said(ran) -> bool:
        return any(
            re.fullmatch(pattern, m["content"]["data"].get("state", {}).get("doing", ""))
            for m in ran.of("comm_msg")
        )

    return Until(f"say it is {pattern!r}", said)


#: Bound by a cell, it arrives in the kernel only once ``GO`` exists: rebuilding
#: it there waits, after everything sorted before it has arrived.
SLOW_TO_ARRIVE = (
    "import os, time\n"
    "def _arrive_when_told():\n"
    "    while not os.path.exists(GO):\n"
    "        time.sleep(0.05)\n"
    "    return 7\n"
    "class SlowToArrive:\n"
    "    def __reduce__(self):\n"
    "        return (_arrive_when_told, ())\n"
    "late = SlowToArrive()\n"
)


def dev_shm_files_of(*pids: int) -> list[str]:
    return sorted(
        name
        for name in os.listdir("/dev/shm")
        if any(name.startswith(f"fluksio-{pid}-") for pid in pids)
    )


def test_while_big_results_travel_the_claim_says_how_big_they_are(kernel, tmp_path):
    """Guards against "sending results back" for seconds with no word of how much:
    the size is known before the first byte is written, and said."""
    go = tmp_path / "go"
    msg_id = kernel.client.execute(
        f"%%claim --label sizes\nimport numpy as np\nGO = {str(go)!r}\n"
        "a = np.ones(2**23)\n" + SLOW_TO_ARRIVE  # 64 MiB: 67.1 MB as the widget says sizes
    )
    kernel.messages_of(msg_id, until=says_doing(r"sending 67\.1MB back, \d+% after \d+\.\d s"))
    go.touch()
    kernel.messages_of(msg_id, timeout=60)
    assert kernel.reply_to(msg_id)["content"]["status"] == "ok"
    assert kernel.facts("[late, float(a.sum())]") == [7, 2.0**23]


def test_big_outputs_arrive_writable_and_equal_and_leave_no_file_in_dev_shm(kernel):
    """Guards against outputs that come back read-only, wrong, or leave memory named
    in /dev/shm: an array, a list of them and a dict of them."""
    kernel.run(
        "%%claim --label outputs\nimport os, numpy as np\n"
        "worker = os.getpid()\n"
        "one = np.arange(2**23, dtype=np.float64)\n"
        "parts = [np.full(2**20, float(i)) for i in range(4)]\n"
        "table = {'x': np.ones(2**20), 'y': np.zeros(2**20)}",
        check=True,
    )
    arrived = kernel.facts(
        "[bool((one == __import__('numpy').arange(2**23)).all()), "
        "[float(p.mean()) for p in parts], float(table['x'].sum()), float(table['y'].sum())]"
    )
    assert arrived == [True, [0.0, 1.0, 2.0, 3.0], 2.0**20, 0.0]
    kernel.run("one[0] = -1.0\nparts[3][:] = 9.0\ntable['y'] += 1", check=True)
    assert kernel.facts("[one[0], parts[3][-1], float(table['y'].sum())]") == [-1.0, 9.0, 2.0**20]
    assert dev_shm_files_of(kernel.pid, kernel.facts("worker")) == []


def test_a_cell_run_again_writes_its_big_output_into_the_memory_the_last_run_let_go(kernel):
    """Guards against every run of a cell paying for fresh shared memory: the run
    before's value is held while the new one arrives, then let go, and the run
    after that writes into its memory."""
    kernel.run(
        "def backing(array):\n"
        "    start = array.__array_interface__['data'][0]\n"
        "    for line in open('/proc/self/maps'):\n"
        "        fields = line.split(maxsplit=5)\n"
        "        low, high = (int(bound, 16) for bound in fields[0].split('-'))\n"
        "        if low <= start < high:\n"
        "            return [int(fields[4]), fields[5].strip()]",
        check=True,
    )
    files = []
    for run in range(3):
        kernel.run(
            f"%%claim --label again\nimport numpy as np\nbig = np.full(2**22, {run}.0)",
            check=True,
        )
        assert kernel.facts("float(big.mean())") == float(run)
        inode, path = kernel.facts("backing(big)")
        assert path.startswith("/dev/shm/fluksio-") and path.endswith("(deleted)"), path
        files.append(inode)
    assert files[1] != files[0], "the first run's value was still held as the second's arrived"
    assert files[2] == files[0]


def test_a_name_that_cannot_travel_leaves_no_file_behind_and_the_big_ones_arrive(kernel):
    """Guards against a failed name stranding what was written for the names beside it."""
    ran = kernel.run(
        "%%claim --label half\nimport os, threading, numpy as np\n"
        "worker = os.getpid()\n"
        "big = np.ones(2**22)\n"
        "lock = threading.Lock()\n"
        "more = [np.ones(2**20), threading.Lock()]"
    )
    assert ran.status == "error" and ran.error["ename"] == "NotBroughtBack", ran.error
    shown = "".join(ran.error["traceback"])
    assert "lock (" in shown and "more (" in shown, shown
    assert kernel.facts("[float(big.sum()), 'more' in dir()]") == [2.0**22, False]
    assert dev_shm_files_of(kernel.pid, kernel.facts("worker")) == []


def test_a_worker_killed_while_sending_back_leaves_no_file_in_dev_shm(kernel, tmp_path):
    """Guards against the values a dead worker had started to send staying in /dev/shm."""
    go, said_pid = tmp_path / "go", tmp_path / "worker-pid"
    msg_id = kernel.client.execute(
        "%%claim --label killed\nimport os, time, numpy as np\n"
        f"open({str(said_pid)!r}, 'w').write(str(os.getpid()))\n"
        "a_big = np.ones(2**23)\n"
        "class SlowToSend:\n"
        "    def __reduce__(self):\n"
        f"        while not os.path.exists({str(go)!r}):\n"
        "            time.sleep(0.05)\n"
        "        return (int, (7,))\n"
        "z_late = SlowToSend()"
    )
    try:
        kernel.messages_of(msg_id, until=says_doing(r"sending results back, .*"))
        # This cell's worker, by its own word: a warm one started beside it is another.
        worker = psutil.Process(int(said_pid.read_text()))
        worker.kill()
        kernel.messages_of(msg_id, timeout=60)
    finally:
        # Should the test fail before the kill, the cell still ends, and the
        # kernel is free for the module's next test.
        go.touch()
    assert kernel.reply_to(msg_id)["content"]["status"] == "error"
    assert gone(worker.pid)
    assert dev_shm_files_of(kernel.pid, worker.pid) == []
    assert_books_balanced(kernel)


def test_a_waiting_cell_says_when_it_may_start_from_the_past_runs_of_what_it_waits_for(
    kernel, tmp_path
):
    """A queued cell must say more than "waiting": a guess, and what it rests on."""
    kernel.run("%%claim cpus=2 --label holder\nx = 1", check=True)  # a past run to go by
    go = tmp_path / "go"
    kernel.start_job(
        f"%%claim cpus=2 --background --label holder\n{until_it_exists(go)}",
        "holder",
    )
    msg_id = kernel.client.execute("%%claim cpus=1 --label next\ny = 2")

    def guessed(ran) -> bool:
        return any(
            m["content"]["data"].get("state", {}).get("doing", "").startswith("expected to start")
            for m in kernel.seen
            if m["msg_type"] == "comm_msg"
        )

    try:
        kernel.messages_of(msg_id, until=Until("say when it may start", guessed), timeout=60)
    finally:
        go.touch()
    assert kernel.error_when_idle(msg_id) is None
    # The guess, and what it rests on: the queue's past runs here.
    said = [
        m["content"]["data"]["state"]["doing"]
        for m in kernel.seen
        if m["msg_type"] == "comm_msg"
        and m["content"]["data"].get("state", {}).get("doing", "").startswith("expected")
    ][-1]
    assert " past run" in said and "the running claims' ages" in said, said
    assert kernel.facts("holder.result(30) is not None")
    assert_books_balanced(kernel)


def test_a_cell_without_a_label_is_named_as_the_notebook_numbers_it(kernel):
    """Not "claim 17", a ticket number nobody can find, but In[n], which is on the page."""
    ran = kernel.run("%%claim\nunnamed = 1", check=True)
    (began,) = ran.of("execute_input")
    number = began["content"]["execution_count"]
    (record,) = [t for t in ran.texts if ": ok · " in t]
    assert record.startswith(f"In[{number}]: ok · waited "), record


def test_the_stop_button_while_a_claimed_cell_waits_for_input_ends_it(kernel):
    """Guards against a cell stopped at its prompt leaving the worker waiting for an answer."""
    msg_id = kernel.client.execute("%%claim\nname = input('who? ')", allow_stdin=True)
    request = kernel.client.stdin_channel.get_msg(timeout=30)
    assert request["content"]["prompt"] == "who? "
    kernel.interrupt()
    assert kernel.error_when_idle(msg_id) == "KeyboardInterrupt"
    assert_books_balanced(kernel)
    assert kernel.run("%%claim\nx = 3", check=True).status == "ok"
    assert kernel.facts("x") == 3


def test_what_a_cell_bound_before_it_raised_or_was_stopped_is_kept(kernel):
    """Guards against losing an hour of training to an exception at its end, or to the stop
    button: a normal cell keeps what it bound before either, and so must a claimed one."""
    ran = kernel.run(
        "%%claim\nlosses = []\nfor epoch in range(5):\n    losses.append(epoch)\n"
        "    if epoch == 3:\n        raise ValueError('diverged')"
    )
    assert (ran.error["ename"], ran.error["evalue"]) == ("ValueError", "diverged")
    assert kernel.facts("losses") == [0, 1, 2, 3]
    # It says so only once a step is done, so the stop always lands after one.
    msg_id = kernel.client.execute(
        "%%claim\nimport time\nsteps = 0\nwhile True:\n    steps += 1\n"
        "    if steps == 1:\n        print('training', flush=True)\n    time.sleep(0.01)"
    )
    kernel.messages_of(msg_id, until=printed("training"))
    kernel.interrupt()
    assert kernel.error_when_idle(msg_id) == "KeyboardInterrupt"
    assert kernel.facts("steps") > 0
    assert_books_balanced(kernel)


#: A claimed cell run in an IPython shell of its own, stopped at every moment of
#: fluksio_nb's code, one moment a round: as its input is packed, as it takes its
#: share, as its worker runs it, as the worker goes back to its pool, as the share
#: is given back and its names are bound. After each, no share may be held and no
#: shared memory lent, and a cell that ran to its end (it leaves a file as its last
#: act) must have its name bound.
STOP_AT_EVERY_MOMENT_OF_A_CELL = """
import glob, os, tempfile
from pathlib import Path
import numpy
from IPython.core.interactiveshell import InteractiveShell
import fluksio_nb
from fluksio_nb import shelf

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "fluksio_nb")
# Big enough to travel through shared memory, in a file its parcel must give back.
shell.user_ns["blob"] = numpy.zeros(40_000)
assert shell.run_cell("%%claim\\nwarm = len(blob)").success
shelf.clear_shelf()
ran = Path(tempfile.mkdtemp()) / "ran"
last = {"n": 0}

def attempt(made):
    last["n"] += 1
    shell.run_cell(f"%%claim\\nx = {last['n']} + len(blob) * 0\\nopen({str(ran)!r}, 'w').close()")

def undo(made):
    last["ran"] = ran.exists()
    ran.unlink(missing_ok=True)
    last["lent"] = any(kept.lent for kept in shelf._shelf._files.values())
    # Every round from an empty shelf, so that each takes the same path and
    # every moment of it is pressed, not a warm shelf's shorter one.
    shelf.clear_shelf()

def check():
    left = what_a_claim_left(last["lent"])
    if left:
        return left
    if last["ran"] and shell.user_ns.get("x") != last["n"]:
        return f"it_ran_and_x_is_{shell.user_ns.get('x')}_not_{last['n']}"

here = os.path.dirname(fluksio_nb.__file__)
watched = glob.glob(os.path.join(here, "**", "*.py"), recursive=True)
each_moment(watched, attempt, undo, check)
"""


@pytest.mark.timeout(900)
def test_a_stop_at_any_moment_of_a_claimed_cell_keeps_what_it_ran_and_gives_its_share_back():
    """Guards against the stop button landing at an unlucky moment of a claimed cell:
    after the worker sent the cell's names back and before the kernel bound them, which
    lost everything the cell made; as a read of the worker's message returned, or before
    the message was acted on, which lost the cell's end and left the kernel waiting for
    it for ever; and as a started claim noted itself held, which kept its share for good."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_CELL, timeout=900)
    assert "stopped_at" in said, said
    # A claimed cell is well over a thousand such moments: every one was tried.
    assert said["stopped_at"] > 1000, said


#: A background cell started in an IPython shell of its own, stopped at every
#: moment of fluksio_nb's code in the kernel's main thread, one moment a round:
#: as its input is packed, as it takes its place in the queue, as its thread
#: starts, as its handle returns, as its result is waited for. After each, and
#: after every job has ended: no job may wait for ever, no share be held, no
#: shared memory be lent and no descriptor be open that was not before, and a
#: handle that came back must hold what its cell bound.
STOP_AT_EVERY_MOMENT_OF_A_BACKGROUND_CELL = """
import glob, os, threading
import numpy
from IPython.core.interactiveshell import InteractiveShell
import fluksio_nb
from fluksio_nb import accountant, jobs, shelf

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "fluksio_nb")
# Big enough to travel through shared memory, in a file its parcel must give back.
shell.user_ns["blob"] = numpy.zeros(40_000)
assert shell.run_cell("%%claim --background\\nwarm = len(blob)").result.result(30)
shelf.clear_shelf()
last = {"n": 0}

def attempt(made):
    last["n"] += 1
    started = shell.run_cell(f"%%claim --background\\nx = {last['n']} + len(blob) * 0")
    if isinstance(started.result, jobs.Job):
        made["job"] = started.result
        made["job"].result(30)

def undo(made):
    threads = [t for t in threading.enumerate() if t.name.startswith("fluksio-job-")]
    for thread in threads:
        thread.join(30)
    last["job_left"] = any(thread.is_alive() for thread in threads)
    job = made.get("job")
    try:
        last["x"] = "no handle" if job is None else job.result(0).get("x")
    except Exception as error:
        last["x"] = repr(error)
    last["lent"] = any(kept.lent for kept in shelf._shelf._files.values())
    # Every round from an empty shelf, so that each takes the same path and
    # every moment of it is pressed, not a warm shelf's shorter one.
    shelf.clear_shelf()
    last["descriptors_left"] = descriptors_left_open(descriptors)

def check():
    if last["job_left"]:
        return "a_job_never_ended"
    if not books_clear():
        return "a_share_left_held"
    if last["lent"]:
        return "shared_memory_left_lent"
    if last["descriptors_left"]:
        return "a_descriptor_left_open"
    # Stopped only once its handle is back, as its result is waited for: it runs on.
    if last["x"] not in ("no handle", last["n"]):
        return f"its_handle_has_x_{last['x']}_not_{last['n']}"

descriptors = len(os.listdir("/proc/self/fd"))
here = os.path.dirname(fluksio_nb.__file__)
watched = glob.glob(os.path.join(here, "**", "*.py"), recursive=True)
each_moment(watched, attempt, undo, check)
"""


@pytest.mark.timeout(900)
def test_a_stop_at_any_moment_of_starting_a_background_cell_leaves_nothing_behind():
    """Guards against the stop button landing as a background cell starts: after it took
    its place in the queue and before its thread had it, which kept its share for good;
    as its input was written into shared memory, or before the job had the parcel, which
    left the memory lent to nobody; and as that memory was made, which left it open."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_BACKGROUND_CELL, timeout=900)
    assert "stopped_at" in said, said
    # Starting one is several hundred such moments: every one was tried.
    assert said["stopped_at"] > 500, said


def test_a_cell_that_ignores_the_interrupt_is_killed_with_its_children(kernel):
    msg_id = kernel.client.execute(
        "%%claim\nimport os, signal, subprocess, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "print(os.getpid(), child.pid, flush=True)\ntime.sleep(60)"
    )
    pids = [int(p) for p in kernel.messages_of(msg_id, until=printed("\n")).stdout.split()]
    kernel.interrupt()
    kernel.messages_of(msg_id)
    assert all(gone(pid) for pid in pids), "the worker's process group outlived the cell"
    assert_books_balanced(kernel)


@pytest.mark.parametrize(
    ("death", "words"),
    [
        ("import os\nos._exit(3)", "exited with code 3"),
        ("import ctypes\nctypes.string_at(0)", "SIGSEGV"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ],
)
def test_a_dead_worker_says_how_it_died(kernel, death, words):
    ran = kernel.run(f"%%claim\n{death}")
    assert ran.status == "error"
    assert ran.error["ename"] == "WorkerDied"
    assert words in "".join(ran.error["traceback"])
    assert_books_balanced(kernel)


def test_exit_in_a_claimed_cell_ends_its_worker_not_the_kernel(kernel):
    """Guards against `exit()` failing with an AttributeError, or ending the kernel."""
    first = int(kernel.run("%%claim\nimport os\nprint(os.getpid())", check=True).stdout)
    ran = kernel.run("%%claim\nprint('bye')\nexit()", check=True)
    assert ran.stdout.strip() == "bye"
    assert gone(first)
    again = int(kernel.run("%%claim\nimport os\nprint(os.getpid())", check=True).stdout)
    assert again != first
    assert_books_balanced(kernel)


def test_a_cell_past_its_timeout_is_stopped(kernel):
    # Waited for a minute at most, against the cell's hour: only the timeout can end it.
    ran = kernel.run("%%claim --timeout 1\nimport time\ntime.sleep(3600)", timeout=60)
    assert ran.error["ename"] == "ClaimTimeout"
    assert "reached its 1 s timeout and was stopped" in "".join(ran.error["traceback"])
    assert_books_balanced(kernel)


def test_a_timeout_over_before_the_cell_starts_ends_it_as_timed_out_without_running_it(kernel):
    """Guards against `--timeout 1e-9` running the cell and recording "ok": a claim granted on
    the spot never looked at its deadline, and the running cell only from its first reading."""
    ran = kernel.run("%%claim --timeout 1e-9\ntoo_late = 1")
    assert ran.error["ename"] == "ClaimTimeout", ran.so_far()
    assert "reached its 1e-09 s timeout before its cell started, so the cell did not run" in (
        "".join(ran.error["traceback"])
    )
    assert any(": timed out · " in text for text in ran.texts), ran.texts
    assert kernel.facts("'too_late' in dir()") is False
    assert_books_balanced(kernel)


def test_a_cell_over_its_memory_budget_is_halted_with_the_numbers(kernel):
    ran = kernel.run(
        "%%claim ram=300M\nimport time\nblock = bytearray(600 * 2**20)\n"
        "for i in range(0, len(block), 4096): block[i] = 1\ntime.sleep(30)"
    )
    assert ran.error["ename"] == "ClaimHalted"
    message = "".join(ran.error["traceback"])
    # Held by the kernel's cap or by the sampler: see test_memory_cap for which says what.
    assert "its memory budget of 300.0MB" in message
    assert any("halted" in text for text in ran.texts), "the status should say it was halted"
    assert_books_balanced(kernel)


def test_a_cell_that_keeps_to_its_budget_keeps_what_it_made_however_big_the_copy_back(kernel):
    """Guards against the copy back halting a cell whose code kept under its ram=: a 320 MB
    list of bytes was pickled into a 320 MB stream beside it, and the shared memory it went
    back in was charged to the claim's cap, so `ram=500M` ended in ClaimHalted blaming the
    cell, and `chunks` was lost."""
    ran = kernel.run(
        "%%claim cpus=1 ram=500M\nchunks = []\nfor i in range(16):\n"
        "    chunks.append(b'x' * 20_000_000)\n    print(i)\ntotal = len(chunks)"
    )
    assert ran.status == "ok", ran.so_far()
    assert any(": ok · " in text for text in ran.texts), ran.texts
    assert kernel.facts(
        "[total, len(chunks), all(type(c) is bytes and c == b'x' * 20_000_000 for c in chunks)]"
    ) == [16, 16, True]
    kernel.run("del chunks", check=True)
    assert_books_balanced(kernel)


def test_a_big_array_a_cell_reads_or_changes_through_a_call_stays_the_kernels_own(kernel):
    """Guards against `data.sum()` replacing the kernel's array and cutting it from its views:
    past 256 KiB an array travels in shared memory, and always came back."""
    kernel.run(
        "import numpy as np\ndata = np.zeros(100_000)\nview = data[:3]\nfirst = id(data)",
        check=True,
    )
    kernel.run("%%claim\ntotal = data.sum()", check=True)
    assert kernel.facts("[id(data) == first, float(total)]") == [True, 0.0]
    kernel.run("%%claim\nnp.add(data, 1, out=data)", check=True)
    assert kernel.facts("[id(data) == first, float(view[0]), float(data.sum())]") == [
        True,
        1.0,
        100_000.0,
    ]


def test_a_big_bytes_input_a_cell_calls_a_method_of_stays_the_kernels_own(kernel):
    """Guards against an input going back unchanged because it travelled out of band: big
    bytes arrive in the worker as a copy off their shared memory, which looked like a change,
    so `data.hex()` sent a megabyte back and replaced the kernel's object with an equal one."""
    kernel.run("data = b'x' * 1_000_000\nfirst = id(data)", check=True)
    ran = kernel.run("%%claim\nn = len(data.hex())", check=True)
    assert not any("back in" in text for text in ran.texts), ran.texts
    assert kernel.facts("[id(data) == first, n]") == [True, 2_000_000]


def test_an_array_a_cell_changes_through_itself_stays_the_kernels_own(kernel):
    """Guards against `data *= 2` or `data[0] = 1` cutting the kernel's array from its views,
    small or big, while a name the cell binds to a new array still takes the new one."""
    kernel.run(
        "import numpy as np\n"
        "small, big = np.ones(4), np.ones(100_000)\n"
        "views, ids = [small[:2], big[:2]], [id(small), id(big)]",
        check=True,
    )
    kernel.run("%%claim\nsmall *= 2\nbig[0] = 5\nbig[1:] += 1", check=True)
    assert kernel.facts(
        "[[id(small), id(big)] == ids, views[0].tolist(), views[1].tolist(), float(big.sum())]"
    ) == [True, [2.0, 2.0], [5.0, 2.0], 5.0 + 2 * 99_999]
    kernel.run("%%claim\nbig *= 2\nbig = big[:10]", check=True)
    assert kernel.facts("[id(big) == ids[1], big.shape[0], views[1].tolist()]") == [
        False,
        10,
        [5.0, 2.0],
    ]


def test_instances_of_a_notebook_class_with_slots_travel_both_ways(kernel):
    """Guards against cloudpickle rebuilding a class with slots as one without: an instance
    made in the worker then failed to arrive in the kernel."""
    kernel.run(
        "from dataclasses import dataclass\n"
        "@dataclass(slots=True)\n"
        "class Point:\n"
        "    x: int\n"
        "class Pair:\n"
        "    __slots__ = ('a', 'b')\n"
        "    def __init__(self, a, b):\n"
        "        self.a, self.b = a, b\n"
        "p, pair = Point(1), Pair(1, 2)",
        check=True,
    )
    kernel.run(
        "%%claim\nq = Point(p.x + 1)\npair.a += 10\nroomy = hasattr(q, '__dict__')", check=True
    )
    assert kernel.facts("[q.x, type(q) is Point, type(pair) is Pair, pair.a, pair.b, roomy]") == [
        *(2, True, True, 11, 2, False)
    ]


def test_names_a_cell_binds_out_of_sight_come_back(kernel):
    """Guards against `from math import *`, `exec` or `globals()[...]` binding names in
    the worker that a later cell in the kernel then did not find."""
    kernel.run(
        "%%claim\nfrom math import *\nexec('made = 5')\nglobals()['put'] = 7\nr = sqrt(4)",
        check=True,
    )
    assert kernel.facts("[r, round(pi, 2), made, put, sqrt(9)]") == [2.0, 3.14, 5, 7, 3.0]


def test_the_record_says_a_peak_that_came_and_went_between_two_readings(kernel):
    """Guards against "peak RSS 43MB" for a cell that held 200 MB for a tenth of a second,
    between the sampler's readings, and against one cell's peak in the next one's record."""

    def peak_mb(ran) -> float:
        return float(re.search(r"peak RSS ([\d.]+)MB", ran.texts[-1]).group(1))

    kernel.run("%%claim\nx = 1", check=True)
    brief = kernel.run("%%claim\nbrief = len(b'x' * (200 << 20))", check=True)
    after = kernel.run("%%claim\nx = 2", check=True)
    assert peak_mb(brief) >= 200, brief.texts
    assert peak_mb(after) < 150, after.texts


def test_a_name_read_out_of_sight_fails_saying_it_was_not_sent_and_how_to_send_it(kernel):
    """Guards against a bare NameError for a name the kernel has, read by `eval`."""
    kernel.run("hidden = 41", check=True)
    ran = kernel.run("%%claim\nfound = eval('hidden') + 1")
    assert ran.error["ename"] == "NameError"
    shown = "\n".join(ran.error["traceback"])
    assert "fluksio_nb: 'hidden' is in the kernel, but was not sent" in shown, shown
    sent = kernel.run("%%claim --in hidden\nfound = eval('hidden') + 1", check=True)
    assert sent.of("error") == [] and kernel.facts("found") == 42
    # A name the kernel does not have either is the cell's own mistake: no hint.
    plain = kernel.run("%%claim\nnowhere_at_all + 1")
    assert "was not sent" not in "\n".join(plain.error["traceback"])


def test_a_file_read_in_a_with_block_does_not_fail_the_cell(kernel, tmp_path):
    """Guards against the commonest way to read a file failing the cell: a closed file
    cannot travel, and there is nothing in it to bring back."""
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    kernel.run(
        f"%%claim\nwith open({str(notes)!r}) as handle:\n    text = handle.read()", check=True
    )
    assert kernel.facts("[text, 'handle' in globals()]") == ["hello", False]


def test_an_error_of_c_run_is_shown_once_and_not_at_all_when_caught(kernel):
    """Guards against a caught error still showing in red, and an uncaught one twice."""
    caught = kernel.run(
        "from fluksio_nb import claim\n"
        "def fails():\n    raise ValueError('inside')\n"
        "with claim(cpus=1) as c:\n"
        "    try:\n        c.run(fails)\n"
        "    except Exception as error:\n        print('caught', type(error).__name__)",
        check=True,
    )
    assert caught.of("error") == []
    assert caught.stdout == "caught RemoteError\n"
    uncaught = kernel.run("with claim(cpus=1) as c:\n    c.run(fails)")
    assert [m["content"]["evalue"] for m in uncaught.of("error")] == ["inside"]
    assert_books_balanced(kernel)


def test_a_thread_a_claimed_cell_leaves_running_ends_with_its_worker_and_says_so(kernel):
    """Guards against a cell's thread losing its names to the next cell and printing into it."""
    ran = kernel.run(
        "%%claim\nimport os, threading, time\n"
        "def chatter():\n    while True:\n        time.sleep(0.05)\n        print('chatter')\n"
        "threading.Thread(target=chatter, name='chatter').start()\n"
        "worker = os.getpid()",
        check=True,
    )
    assert "the cell ended with threads still running its code (chatter)" in ran.stderr
    assert gone(kernel.facts("worker"), within=10)
    later = kernel.run("%%claim\nimport time\ntime.sleep(0.3)\nprint('mine')", check=True)
    assert (later.stdout, later.stderr) == ("mine\n", "")
    assert_books_balanced(kernel)


def test_what_a_claimed_cell_leaves_running_ends_with_it(kernel):
    """Guards against a cell's processes running on, on cores the books call free."""
    ran = kernel.run("%%claim --label sleepers\n" + LEAVES_THREE_RUNNING, check=True)
    left = [int(pid) for pid in ran.stdout.split()]
    assert len(left) == 3
    assert [pid for pid in left if not gone(pid, within=10)] == []
    assert_books_balanced(kernel)
    assert kernel.run("%%claim\nprint('next')", check=True).stdout == "next\n"


def test_a_killed_kernel_takes_what_its_claimed_cell_started_with_it(tmp_path):
    """Guards against a cell's processes outliving a kernel killed while the cell ran."""
    with started_kernel(tmp_path / "kernel", **INVENTORY) as doomed:
        msg_id = doomed.client.execute(
            "%%claim\n" + LEAVES_THREE_RUNNING + until_it_exists(tmp_path / "never")
        )
        running = doomed.messages_of(msg_id, until=printed("\n"), timeout=60)
        left = [int(pid) for pid in running.stdout.split()]
        doomed.manager.signal_kernel(signal.SIGKILL)
        assert [pid for pid in left if not gone(pid, within=10)] == []


# -----------------------------------------------------------------------------
# Bad input is refused before anything starts
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "cell", "words"),
    [
        ("", "%%claim cpu=2\n1", "did you mean 'cpus'"),
        ("", "%%claim ram=lots\n1", "ram='lots' is not a size"),
        ("", "%%claim flavor=enormous\n1", "flavor 'enormous' does not exist"),
        (
            "",
            "%%claim gpus=1 CUDA_VISIBLE_DEVICES=7\n1",
            "CUDA_VISIBLE_DEVICES=7 would replace the card this claim is granted",
        ),
        (
            "import threading\nlock = threading.Lock()",
            "%%claim\nwith lock:\n    pass",
            "cannot send 'lock' (cannot pickle '_thread.lock' object) to the worker",
        ),
        (
            "import threading\nlock = threading.Lock()\ndef guarded():\n    return lock.locked()",
            "%%claim\nfree = guarded()",
            "cannot send 'guarded' (it reads the global 'lock', which cannot travel: "
            "cannot pickle '_thread.lock' object) to the worker",
        ),
        (
            "",
            "%%claim --timeout -1\n1",
            "%%claim: --timeout must be a number of seconds above 0, such as 30 (got -1); "
            "leave it out to wait and run for as long as it takes.",
        ),
        ("", "%%claim --label x --label y\n1", "%%claim: --label is given twice; keep one."),
        ("", "%%claim --strict --strict\n1", "%%claim: --strict is given twice; keep one."),
        ("", "%%claim --label ''\n1", "%%claim: --label is empty;"),
        ("", "%%claim --out ''\n1", "%%claim: --out names nothing;"),
        ("", "%%claim --on nowhere\n1", "%%claim: --on 'nowhere' is not a Ray cluster"),
        (
            "",
            "%%claim --in nothere\n1",
            "%%claim: --in names 'nothere', which is not defined in this kernel; define it "
            "first or drop it from --in.",
        ),
    ],
)
def test_bad_input_is_one_clear_paragraph_and_nothing_starts(kernel, setup, cell, words):
    kernel.run(setup, check=True)
    before = {p.pid for p in psutil.Process(kernel.pid).children(recursive=True)}
    ran = kernel.run(cell)
    assert ran.status == "error"
    shown = ran.stderr + "".join((ran.error or {}).get("traceback", []))
    assert words in shown
    assert shown.strip().count("\n") == 0, shown
    if shown.startswith("UsageError"):
        assert shown.startswith("UsageError: %%claim: "), "a refusal of the line says whose"
    after = {p.pid for p in psutil.Process(kernel.pid).children(recursive=True)}
    assert after <= before, "a worker was started for a claim that was refused"
    assert_books_balanced(kernel)


def test_a_claim_shrunk_to_the_machine_is_told_at_the_users_own_line_every_time(kernel):
    """Guards against the warning pointing into fluksio_nb (`context.py:133`), where the user
    can change nothing, or at the temporary file ipykernel compiles a cell under
    (`/tmp/ipykernel_<pid>/<number>.py:1`), which says nothing to them; against the next
    claim shrunk the same way going unsaid, as Python's once-per-line default had it;
    against quoting a `%%claim` cell's line as IPython rewrote it,
    `get_ipython().run_cell_magic('claim', ...)`, not as it was typed; and against naming
    what was not too much (`cpus=64 ram=1.0GB is more than…` when only cpus was)."""

    def where_told(ran):
        told = re.findall(r"^(.+):(\d+): ClampedWarning: cpus=64 is more than", ran.stderr, re.M)
        assert len(told) == 1, ran.stderr
        assert "fluksio_nb" not in ran.stderr and "ipykernel_" not in ran.stderr, ran.stderr
        (count,) = [m["content"]["execution_count"] for m in ran.of("execute_input")]
        assert told[0][0] == f"Cell In[{count}]", "named as IPython's tracebacks name a cell"
        return int(told[0][1])

    magic = kernel.run(
        "%%claim  cpus=64 ram=1G --label big\nn = __import__('os').environ['OMP_NUM_THREADS']"
    )
    assert magic.status == "ok" and kernel.facts("n") == "2"
    assert where_told(magic) == 1
    assert "ClampedWarning: cpus=64 is more than this machine has to hand out (cpus=" in (
        magic.stderr
    ), "only what was too much, beside what the machine has of it"
    assert "ram=1.0GB is more" not in magic.stderr and "running with cpus=" in magic.stderr
    assert "instead.\n  %%claim  cpus=64 ram=1G --label big\n" in magic.stderr, "as typed"
    assert "run_cell_magic" not in magic.stderr, magic.stderr
    block = kernel.run(
        "from fluksio_nb import claim\n\nwith claim(cpus=64) as c:\n    n = c.allocation.cpus",
        check=True,
    )
    assert where_told(block) == 3
    assert "\n  with claim(cpus=64) as c:\n" in block.stderr, "the user's line, shown under it"
    assert kernel.facts("n") == 2
    again = kernel.run("%%claim cpus=64\nx = 1", check=True)
    assert where_told(again) == 1
    assert_books_balanced(kernel)


# -----------------------------------------------------------------------------
# Workers: warm per environment, GPU workers never reused
# -----------------------------------------------------------------------------


def test_the_same_claim_shape_reuses_a_warm_worker_and_another_environment_does_not(kernel):
    """A variable on the claim's line may be read at any import: only a new worker has it.

    A new thread count alone may reuse the worker (``test_warm_start.py``).
    """
    first = kernel.run("%%claim cpus=1\nimport os\nprint(os.getpid())", check=True).stdout
    again = kernel.run("%%claim cpus=1\nimport os\nprint(os.getpid())", check=True).stdout
    other = kernel.run(
        "%%claim cpus=1 SOME_SETTING=1\nimport os\nprint(os.getpid())", check=True
    ).stdout
    assert first == again
    assert other != first


def test_a_gpu_worker_ends_when_its_claim_gives_back(kernel):
    """A CUDA context must not stay on a card that may be granted to someone else."""
    pid = int(kernel.run("%%claim gpus=1\nimport os\nprint(os.getpid())", check=True).stdout)
    assert gone(pid)


# -----------------------------------------------------------------------------
# Background claims
# -----------------------------------------------------------------------------


def test_background_claims_run_in_order_and_never_over_the_inventory(kernel):
    kernel.run("jobs = []", check=True)
    for index in range(6):
        kernel.run(
            f"%%claim gpus=1 --background --label job{index}\n"
            "import time\nstart = time.time()\ntime.sleep(0.3)\nend = time.time()",
            check=True,
        )
        kernel.run("jobs.append(_)", check=True)
    spans = kernel.facts("[(j.result(60)['start'], j.result(60)['end']) for j in jobs]")
    granted = kernel.facts("[j.granted_at for j in jobs]")
    assert granted == sorted(granted), "background claims must be granted in the order made"
    for start, _ in spans:
        overlapping = sum(1 for s, e in spans if s <= start < e)
        assert overlapping <= 2, "more gpus=1 claims ran at once than there are cards"
    assert_books_balanced(kernel)


def test_a_background_claims_output_stays_in_its_own_cell(kernel):
    """The job prints while another cell runs; the print belongs to the job's cell."""
    started = kernel.start_job(
        "%%claim --background\nimport time\ntime.sleep(1)\nprint('from the job')", "job"
    )
    # Running until the job has ended, so its print comes while this cell runs,
    # and is read before this cell is idle.
    later = kernel.run("job.result(60)\nprint('later cell')", check=True)
    assert later.stdout == "later cell\n"
    assert any(
        m["msg_type"] == "stream"
        and "from the job" in m["content"]["text"]
        and m["parent_header"].get("msg_id") == started.msg_id
        for m in kernel.seen
    )


def test_a_background_claims_error_is_shown_once_in_its_own_cell(kernel):
    """Guards against the job's error shown as it came and then again as the job ended."""
    started = kernel.start_job("%%claim --background\nraise ValueError('in the job')", "job")
    # Running until the job has ended: all it shows comes before this cell is idle.
    later = kernel.run(
        "try:\n    job.result(60)\nexcept Exception as error:\n    print(type(error).__name__)",
        check=True,
    )
    assert later.stdout == "RemoteError\n"
    errors = [
        m["content"]
        for m in kernel.seen
        if m["msg_type"] == "error" and m["parent_header"].get("msg_id") == started.msg_id
    ]
    assert [(e["ename"], e["evalue"]) for e in errors] == [("ValueError", "in the job")]


def test_a_background_cell_shows_no_stale_out_and_its_handle_says_how_it_is_now(kernel):
    """Guards against an Out[n] that said "waiting, 0 s so far" for good beside a job that
    had long ended: the cell's own status display is what follows the job."""
    started = kernel.run("%%claim --background --label nightly\nx = 1", check=True)
    assert started.of("execute_result") == [], started.of("execute_result")
    kernel.run("job = _\njob.result(30)", check=True)
    shown = kernel.run("job", check=True).of("execute_result", "display_data")
    assert len(shown) == 1, shown
    text = shown[0]["content"]["data"]["text/plain"]
    assert text.startswith("<Job 'nightly': nightly: ok · "), text


def test_a_background_claims_change_in_place_is_on_its_handle_not_in_the_namespace(kernel):
    """A job's values arrive through its handle, changed inputs included, never by surprise."""
    kernel.run("tally = [1]\nkept_tally = tally", check=True)
    kernel.start_job("%%claim --background\ntally.append(2)", "job")
    assert kernel.facts("[job.result(30)['tally'], tally is kept_tally, tally]") == [
        [1, 2],
        True,
        [1],
    ]


def test_a_function_a_background_claim_makes_reads_the_kernels_globals(kernel):
    """Guards against a function taken from a job's handle keeping the globals it was made with."""
    kernel.run("step = 1", check=True)
    kernel.run("%%claim --background\ndef advance(x):\n    return x + step", check=True)
    kernel.run("job = _\nadvance = job.result(30)['advance']\nstep = 7", check=True)
    assert kernel.facts("advance(0)") == 7


def test_a_function_run_in_the_same_worker_does_not_leave_the_next_cell_on_its_stream(kernel):
    """Guards against a `c.run(...)` that drew from the worker's streams between two claimed
    cells making the second continue the worker's stream instead of the kernel's."""
    kernel.run(
        "import random\nfrom fluksio_nb import claim\nrandom.seed(3)\n"
        "def draw():\n    import random\n    return random.random()",
        check=True,
    )
    kernel.run("%%claim cpus=1\nx = 1", check=True)
    kernel.run("with claim(cpus=1) as c:\n    c.run(draw)", check=True)
    kernel.run("%%claim cpus=1\na = random.random()", check=True)
    assert kernel.facts("a == random.Random(3).random()") is True


def test_background_claims_draw_reproducible_and_distinct_random_numbers(kernel):
    """Guards against every background job of a random search drawing the same numbers,
    and against a seeded notebook's jobs drawing different ones on every run."""

    def draws() -> list[float]:
        kernel.run("random.seed(2)\njobs = []", check=True)
        for _ in range(2):
            kernel.run("%%claim --background\nx = random.random()", check=True)
            kernel.run("jobs.append(_)", check=True)
        return kernel.facts("[job.result(30)['x'] for job in jobs]")

    kernel.run("import random", check=True)
    first = draws()
    assert first[0] != first[1]
    assert draws() == first


def test_a_waiting_background_claim_can_be_cancelled(kernel, tmp_path):
    go = tmp_path / "go"
    kernel.start_job(f"%%claim cpus=2 --background\n{until_it_exists(go)}", "holder")
    try:
        kernel.start_job("%%claim cpus=2 --background\nprint('never')", "waiter")
        assert kernel.facts("[waiter.status, waiter.cancel()]") == ["waiting", True]
    finally:
        go.touch()
    assert kernel.facts("[sorted(holder.result(30)), holder.status, waiter.done()]") == [
        ["os", "time"],
        "ok",
        True,
    ]
    assert kernel.facts("waiter.status") == "cancelled"
    assert_books_balanced(kernel)


@pytest.mark.parametrize(
    "impatient",
    [
        "%%claim cpus=2 --label impatient\nprint('ran')",
        "from fluksio_nb import claim\nwith claim(cpus=2, label='impatient'):\n    print('ran')",
    ],
    ids=["cell", "block"],
)
def test_the_stop_button_while_waiting_leaves_the_queue(kernel, tmp_path, impatient):
    go = tmp_path / "go"
    kernel.start_job(f"%%claim cpus=2 --background --label holder\n{until_it_exists(go)}", "holder")
    try:
        msg_id = kernel.client.execute(impatient)
        ledger = Path(kernel.env["FLUKSIO_LEDGER"])
        deadline = time.monotonic() + 20
        while not any(w["label"] == "impatient" for w in users_books(ledger)["waiting"]):
            assert time.monotonic() < deadline, "the claim never joined the queue"
            time.sleep(0.05)
        kernel.interrupt()
        error = kernel.messages_of(msg_id).error
        assert error["ename"] == "KeyboardInterrupt"
        # Stopped before anything of the user's ran: one line, no frames at all.
        assert len(error["traceback"]) == 1 and "the cell was stopped" in error["traceback"][0]
        books = kernel.books()
        assert [w["label"] for w in books["waiting"]] == []
    finally:
        go.touch()
    kernel.facts("holder.result(30) and 1")
    assert_books_balanced(kernel)


#: ``%claims`` in an IPython shell of its own, stopped at every moment of
#: fluksio_nb's code, one moment a round. Before each, the usage records are
#: touched, so that every round reads them again, as a kernel does after
#: another kernel's claim ended; every round asks the books service anew.
#: After each, no descriptor may be left open.
STOP_AT_EVERY_MOMENT_OF_CLAIMS = """
import glob, os, tempfile
# Books and records of its own, which a suite running beside it never reads.
os.environ["FLUKSIO_LEDGER"] = os.path.join(tempfile.mkdtemp(), "ledger")
os.environ["JUPYTER_DATA_DIR"] = tempfile.mkdtemp()
from IPython.core.interactiveshell import InteractiveShell
import fluksio_nb
from fluksio_nb import accountant
from fluksio_nb.usage.log import kernel_usage_log

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "fluksio_nb")
# One claim's usage record, for %claims to read.
assert shell.run_cell("%%claim\\nwarm = 1").success
assert shell.run_cell("%claims").success
records = list(kernel_usage_log().directory.iterdir())
assert records, "the claim wrote no usage record"
touched = {"ns": 10**18}

def attempt(made):
    shell.run_line_magic("claims", "")

def undo(made):
    touched["ns"] += 1
    for record in records:
        os.utime(record, ns=(touched["ns"], touched["ns"]))

def check():
    accountant().snapshot()
    if descriptors_left_open(descriptors):
        return "a_descriptor_left_open"

accountant().snapshot()
descriptors = len(os.listdir("/proc/self/fd"))
here = os.path.dirname(fluksio_nb.__file__)
watched = glob.glob(os.path.join(here, "**", "*.py"), recursive=True)
each_moment(watched, attempt, undo, check, forgotten=True)
"""


@pytest.mark.timeout(600)
def test_a_stop_at_any_moment_of_claims_leaves_no_descriptor_open():
    """Guards against the stop button landing as ``%claims`` opened a file or a socket:
    its descriptor was left open, with nothing holding its number, for the kernel's life."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_CLAIMS, timeout=600)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 100, said


def test_claims_with_arguments_says_it_takes_none(kernel):
    """Guards against `%claims gpus` silently showing everything, as if it had filtered."""
    ran = kernel.run("%claims gpus  # only the cards")
    assert ran.status == "error"
    assert "UsageError: %claims takes no arguments, and was given 'gpus'" in ran.stderr
    assert kernel.run("%claims  # the machine", check=True).status == "ok"


def test_claim_help_is_the_parser_that_reads_the_line(kernel):
    """`%%claim?` must be real help: every option the line accepts."""
    reply = kernel.reply_to(kernel.client.execute("%%claim?"), timeout=20)
    pages = [p["data"]["text/plain"] for p in reply["content"]["payload"] if p.get("data")]
    help_text = "".join(pages)
    for option in ("--in", "--out", "--timeout", "--background", "--label", "--strict", "cpus=N"):
        assert option in help_text
