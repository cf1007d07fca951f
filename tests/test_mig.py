"""MIG instances are cards: listed as the driver lists them, read, and granted by UUID.

No card is needed: the stand-in ``nvidia-smi`` and ``pynvml``
(:mod:`tests.gpu_standins`) describe an A100 with MIG on as the real ones
do, and detection and the reader run in a Python of their own that finds
them as it would find the real ones. The failures guarded against: an A100
cut into instances handed out as one card (every claim on it fighting over
the same instance, or none at all, since CUDA cannot use a MIG card whole),
and a claim granted an instance whose worker is told an index CUDA reads as
another device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fluksio_nb.mig import smi_cards
from tests.gpu_standins import StandInNvml, StandInSmi, card, mig_instance
from tests.kernels import started_kernel

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

#: Card 0 with MIG on, cut in two (slot 1 left empty between them); card 1 whole.
MIG_0 = [mig_instance(0, 0, "3g.20gb"), None, mig_instance(0, 2, "1g.5gb")]
CARDS = [card(0, mig=MIG_0), card(1)]
#: What each source must list, as (id, uuid, parent): card 1 keeps its id,
#: the instances are numbered after it.
LISTED = [
    [1, CARDS[1]["uuid"], None],
    [2, MIG_0[0]["uuid"], 0],
    [3, MIG_0[2]["uuid"], 0],
]

_DETECT = """
import json
from fluksio_nb.gpus import detect_gpus
cards, source = detect_gpus()
print(json.dumps([source, [[c.index, c.uuid, c.parent, c.name, c.memory_bytes] for c in cards]]))
"""


def detected(env: dict[str, str]) -> tuple[str, list]:
    run = subprocess.run(
        [sys.executable, "-c", _DETECT],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(run.stdout)


def test_mig_instances_are_listed_as_cards_by_nvml_and_nvidia_smi_alike(tmp_path):
    """An A100 with MIG on was one card to claim; CUDA cannot use it whole."""
    nvml = StandInNvml(tmp_path / "nvml", CARDS)
    source, cards = detected(
        {**nvml.env(base_pythonpath=str(REPO_ROOT)), "PATH": str(tmp_path / "empty")}
    )
    assert source == "nvml"
    assert [c[:3] for c in cards] == LISTED
    assert [c[3] for c in cards] == [
        "NVIDIA A100-SXM4-40GB",
        "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
    ]
    assert [c[4] for c in cards] == [40960 * MIB, (20 * 1024 - 256) * MIB, (5 * 1024 - 256) * MIB]

    smi = StandInSmi(tmp_path / "smi", CARDS)
    # Where nvidia-ml-py cannot be imported, nvidia-smi -L is read.
    blocked = tmp_path / "no-pynvml"
    blocked.mkdir()
    (blocked / "pynvml.py").write_text("raise ImportError('not installed here')\n")
    source, cards = detected(
        {"PYTHONPATH": f"{blocked}{os.pathsep}{REPO_ROOT}", **smi.env(_SYSTEM_PATH)}
    )
    assert source == "nvidia-smi"
    assert [c[:3] for c in cards] == LISTED


_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def test_nvidia_smi_listings_of_either_driver_era_give_the_same_instances():
    """R450's instance UUIDs name their card and slots; later ones are plain: both are cards."""
    listing = (
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)\n"
        "  MIG 3g.40gb     Device  0: (UUID: MIG-GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77/1/0)\n"
        "  MIG 1g.10gb     Device  1: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)\n"
        "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-cba663e8-9bed-5b25-b243-5985ef7c9beb)\n"
    )
    assert [(c.id, c.uuid, c.parent, c.name) for c in smi_cards(listing)] == [
        (
            2,
            "MIG-GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77/1/0",
            0,
            "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
        ),
        (3, "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f", 0, "NVIDIA A100-SXM4-80GB MIG 1g.10gb"),
        (1, "GPU-cba663e8-9bed-5b25-b243-5985ef7c9beb", None, "NVIDIA A100-SXM4-80GB"),
    ]


_READ = """
import json
from fluksio_nb.gpu_usage import CardReader
reading = CardReader(interval_s=0).read()
print(json.dumps([[c.index, c.uuid, c.used_bytes, c.total_bytes, c.utilisation_percent,
                   [p.driver_pid for p in c.processes]] for c in reading.cards]))
"""


def test_a_mig_instances_memory_and_processes_are_read_as_its_own_card(tmp_path):
    """An instance's memory read as its card's, or not at all, misnames who holds what."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        busy = [mig_instance(0, 0, "3g.20gb", used_mib=3000), None, mig_instance(0, 2, "1g.5gb")]
        nvml = StandInNvml(
            tmp_path / "nvml",
            [card(0, mig=busy, used_mib=3000), card(1)],
            [{"uuid": busy[0]["uuid"], "pid": worker.pid, "used_mib": 3000}],
        )
        read = subprocess.run(
            [sys.executable, "-c", _READ],
            env={
                **os.environ,
                **nvml.env(base_pythonpath=str(REPO_ROOT)),
                "PATH": str(tmp_path / "empty"),
            },
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        worker.kill()
        worker.wait()
    by_id = {c[0]: c[1:] for c in json.loads(read.stdout)}
    assert sorted(by_id) == [1, 2, 3]
    # No utilisation on a MIG instance: unknown, never idle.
    assert by_id[2] == [busy[0]["uuid"], 3000 * MIB, (20 * 1024 - 256) * MIB, None, [worker.pid]]
    assert by_id[3][1:] == [0, (5 * 1024 - 256) * MIB, None, []]


HOLD_THREE = """
import json, subprocess, sys
from fluksio_nb import claim
held = [claim(gpus=1, label=f"mig {n}") for n in range(3)]
for c in held:
    c.__enter__()
told = [
    c.popen(
        [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
        stdout=subprocess.PIPE, text=True,
    ).communicate()[0].strip()
    for c in held
]
print(json.dumps([[c.allocation.gpus[0], seen] for c, seen in zip(held, told)]))
for c in held:
    c.__exit__(None, None, None)
"""


@pytest.mark.timeout(180)
def test_a_claim_granted_a_mig_instance_is_told_its_uuid(tmp_path):
    """A worker told "2" for an instance sees another device, or none, through CUDA."""
    smi = StandInSmi(tmp_path / "smi", CARDS)
    with started_kernel(
        tmp_path, FLUKSIO_CPUS="3", FLUKSIO_RESERVE_CPUS="0", **smi.env()
    ) as kernel:
        granted = dict(kernel.run(HOLD_THREE, check=True).json())
        assert granted == {1: "1", 2: MIG_0[0]["uuid"], 3: MIG_0[2]["uuid"]}
        assert kernel.books()["gpus"]["total"] == 3


def test_through_nvidia_smi_a_card_with_mig_on_is_not_read_as_a_card(tmp_path):
    """nvidia-smi lists a MIG card's processes under the whole card, which no claim
    holds: read as a card, every claimed instance's work showed as a squatter."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        smi = StandInSmi(
            tmp_path / "smi",
            [card(0, mig=MIG_0, used_mib=3000), card(1, used_mib=500)],
            [{"uuid": CARDS[0]["uuid"], "pid": worker.pid, "used_mib": 3000}],
        )
        blocked = tmp_path / "no-pynvml"
        blocked.mkdir()
        (blocked / "pynvml.py").write_text("raise ImportError('not installed here')\n")
        read = subprocess.run(
            [sys.executable, "-c", _READ],
            env={
                **os.environ,
                "PYTHONPATH": f"{blocked}{os.pathsep}{REPO_ROOT}",
                **smi.env(_SYSTEM_PATH),
            },
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        worker.kill()
        worker.wait()
    assert json.loads(read.stdout) == [[1, CARDS[1]["uuid"], 500 * MIB, 40960 * MIB, 0.0, []]]
