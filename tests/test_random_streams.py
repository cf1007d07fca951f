"""The kernel's global random streams, carried to a worker and back.

The import case runs in fresh interpreters: it is about a process that has
not imported NumPy yet, which this test process has.
"""

import json
import pickle
import random
import subprocess
import sys

import numpy as np
import pytest

from fluksio_nb import random_streams


@pytest.fixture(autouse=True)
def this_processes_streams_left_as_found():
    saved = random.getstate(), np.random.get_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])


def test_restoring_a_capture_draws_the_same_numbers_again():
    random.seed(9)
    np.random.seed(9)
    captured = random_streams.capture()
    first = [random.random(), np.random.rand()]
    random_streams.restore(captured)
    assert [random.random(), np.random.rand()] == first


def test_a_capture_keeps_only_the_generators_asked_for():
    assert set(random_streams.capture()) == {"random", "numpy"}
    assert set(random_streams.capture({"random": None})) == {"random"}


def test_spawned_streams_are_fixed_by_the_seed_and_differ_from_draw_to_draw():
    random.seed(5)
    np.random.seed(5)
    one, two = random_streams.spawn(), random_streams.spawn()
    random.seed(5)
    np.random.seed(5)
    assert pickle.dumps(random_streams.spawn()) == pickle.dumps(one)
    assert one["random"] != two["random"]
    assert not np.array_equal(one["numpy"][1], two["numpy"][1])


SENDER = """
import json, pickle, sys
import numpy as np
np.random.seed(3)
from fluksio_nb import random_streams
sys.stdout.write(pickle.dumps(random_streams.capture()).hex() + "\\n")
sys.stdout.write(json.dumps(np.random.rand(3).tolist()))
"""

RECEIVER = """
import json, pickle, sys
from fluksio_nb import random_streams
random_streams.restore(pickle.loads(bytes.fromhex(sys.stdin.read())))
assert "numpy" not in sys.modules, "restoring imported numpy"
if sys.argv[1] == "cell over":
    random_streams.forget_pending()
import numpy as np
print(json.dumps(np.random.rand(3).tolist()))
"""


def test_numpy_is_not_imported_for_its_state_but_the_state_is_set_when_it_is():
    sent = subprocess.run(
        [sys.executable, "-c", SENDER], capture_output=True, text=True, check=True
    ).stdout
    state, drawn = sent.split("\n")

    def received(when: str) -> list[float]:
        run = [sys.executable, "-c", RECEIVER, when]
        out = subprocess.run(run, input=state, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    assert received("in the cell") == json.loads(drawn)
    # A cell that never imported numpy leaves nothing waiting for the next one's import.
    assert received("cell over") != json.loads(drawn)
