"""On a real card: what the stand-ins cannot say, said by the driver.

Everything else about the cards is tested against stand-ins of NVML and
``nvidia-smi``, which say what the tests tell them to. Only a driver says
what a real process on a real card holds, and in which units, and under
which pid; only the kernel says whether a device node opens. So here a
process of its own takes a known amount of card memory through the driver's
own library (:mod:`tests.cuda_memory`, no torch or cupy), and:

- fluksio_nb's reading of that process is what ``nvidia-smi
  --query-compute-apps`` prints, within 5%: read with each source
  fluksio_nb can use here (NVML, nvidia-smi), and through a claim granted a
  card, which also checks that the card CUDA puts the memory on is the card
  the books granted;
- two ``gpus=0.5`` slices hold memory on one card at once, and a
  ``gpu_ram=`` slice past its budget is halted;
- a claim granted one card cannot open another's ``/dev/nvidiaN`` (``EPERM``)
  and can open its own.

Skipped, saying what is missing, where there is no card, no NVIDIA driver
(``libcuda.so.1``) or, for the NVML reading, no NVML. ``make gpu-check`` runs
them with ``bench/gpu_check.py`` on a machine that reaches no registry.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from typing import NoReturn

import pytest

from fluksio_nb import claim
from fluksio_nb.errors import ClaimHalted
from fluksio_nb.gpu_usage import CardsReading, kernel_cards
from fluksio_nb.sampler import Sampler
from tests.real_cards import (
    ALLOCATE_MIB,
    MIB,
    CannotAllocate,
    SmiQuery,
    cards_here,
    device_node_of,
    first_card,
    holding,
    missing,
    nvml_missing,
    readers,
    smi_query,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)

#: How far fluksio_nb's figure may be from nvidia-smi's.
WITHIN = 0.05


@pytest.fixture(scope="module")
def card() -> int:
    why = missing()
    if why is not None:
        pytest.skip(why)
    found = first_card()
    assert isinstance(found, int)
    return found


@pytest.fixture(scope="module")
def held(card):
    """A process holding ALLOCATE_MIB on ``card``."""
    try:
        with holding(card=card) as process:
            yield process
    except CannotAllocate as error:
        pytest.fail(f"the driver could not put {ALLOCATE_MIB} MiB on card {card}: {error}")


def driver_pid(reading: CardsReading | None, pid: int) -> tuple[int, int] | None:
    """(card index, the driver's pid) of the process ``pid`` here, as fluksio_nb matched it."""
    for card in () if reading is None else reading.cards:
        for process in card.processes:
            if process.pid == pid:
                return card.index, process.driver_pid
    return None


def smi_mib(smi: SmiQuery, uuid: str, pid: int) -> float | None:
    """What nvidia-smi says ``pid`` (the driver's) holds on the card ``uuid``, in MiB."""
    used = [app.used_mib for app in smi.apps_on(uuid) if app.pid == pid]
    return sum(u for u in used if u is not None) if used else None


def near(ours: float, theirs: float) -> bool:
    return abs(ours - theirs) <= WITHIN * theirs


def not_matched(reading: CardsReading | None, smi: SmiQuery, pid: int) -> NoReturn:
    """Why fluksio_nb found no process ``pid`` on any card: a failure, or a skip."""
    if smi.app(pid):
        pytest.fail(
            f"nvidia-smi lists pid {pid} on a card and fluksio_nb's reading does not: "
            f"{reading}\n{smi.printed}"
        )
    pytest.skip(
        f"neither fluksio_nb nor nvidia-smi names pid {pid}: the driver names processes by "
        "pids of a namespace this one cannot see (a container without the host's pids?), "
        f"and fluksio_nb shows their memory as outside this machine's view.\n{smi.printed}"
    )


@pytest.mark.parametrize("source", ["nvml", "nvidia-smi"])
def test_a_process_card_memory_is_what_nvidia_smi_says(request, source):
    # Every absence this check needs is said, NVML's too, not the first found.
    why = [missing(), nvml_missing() if source == "nvml" else None]
    if any(why):
        pytest.skip("; ".join(filter(None, why)))
    card, process = request.getfixturevalue("card"), request.getfixturevalue("held")
    make = readers().get(source)
    if make is None:
        pytest.skip(f"fluksio_nb has no {source} reader here")
    reader = make()

    def read() -> tuple[CardsReading | None, int] | None:
        reading = reader.read()
        found = driver_pid(reading, process.pid)
        if found is None or reading is None:
            return None
        on = reading.card(found[0])
        mine = next(p for p in on.processes if p.pid == process.pid)
        return (reading, found[1]) if (mine.used_bytes or 0) >= ALLOCATE_MIB * MIB else None

    got = wait_for(read)
    smi = smi_query()
    if not got:
        not_matched(reader.read(), smi, process.pid)
    reading, driver = got
    index, _ = driver_pid(reading, process.pid)
    assert index == card, (
        f"CUDA put the memory on card {card} (PCI bus order), fluksio_nb read it on card {index}"
    )
    on_card = smi.card(card)
    assert on_card is not None and reading.card(card).uuid == on_card.uuid
    theirs = smi_mib(smi, on_card.uuid, driver)
    assert theirs is not None, f"nvidia-smi lists no pid {driver} on card {card}:\n{smi.printed}"
    ours = Sampler(process.pid, gpus=(card,)).sample(cards=reading).gpu_bytes
    assert ours is not None and ours >= ALLOCATE_MIB * MIB
    assert near(ours / MIB, theirs), (
        f"libcuda holds {ALLOCATE_MIB} MiB on card {card}: fluksio_nb ({source}) reads "
        f"{ours / MIB:.0f} MiB for the process, nvidia-smi {theirs:.0f} MiB\n{smi.printed}"
    )
    total = reading.card(card).total_bytes
    assert total is not None and on_card.total_mib is not None
    assert near(total / MIB, on_card.total_mib), (total / MIB, on_card.total_mib)


def test_a_claims_card_memory_is_what_nvidia_smi_says(held):
    with claim(gpus=1, label="real card") as c:
        (granted,) = c.allocation.gpus
        with holding(popen=c.popen) as process:
            latest = wait_for(
                lambda: (
                    (sample := c.readings.latest) is not None
                    and (sample.gpu_bytes or 0) >= ALLOCATE_MIB * MIB
                    and sample
                ),
                timeout_s=20,
            )
            smi = smi_query()
            found = driver_pid(kernel_cards().read(max_age_s=0), process.pid)
            if found is None:
                not_matched(kernel_cards().read(max_age_s=0), smi, process.pid)
            index, driver = found
            assert index == granted, (
                f"the claim was granted card {granted}, and its process's memory is on card "
                f"{index}: CUDA and the books number the cards differently"
            )
            assert latest, (
                f"the claim's readings never showed the {ALLOCATE_MIB} MiB its process holds "
                f"on card {granted}: {c.readings.latest}\n{smi.printed}"
            )
            on_card = smi.card(granted)
            assert on_card is not None
            theirs = smi_mib(smi, on_card.uuid, driver)
            assert theirs is not None, f"nvidia-smi lists no pid {driver}:\n{smi.printed}"
            assert near(latest.gpu_bytes / MIB, theirs), (
                f"the claim reads {latest.gpu_bytes / MIB:.0f} MiB on card {granted}, "
                f"nvidia-smi {theirs:.0f} MiB\n{smi.printed}"
            )


# -- slices of a card, and the device hold ----------------------------------------

#: What a slice's process takes, and the budget of a gpu_ram= slice it overruns.
SLICE_MIB = 256
BUDGET = "512M"
OVER_BUDGET_MIB = 1024


def test_two_half_card_slices_hold_memory_on_one_card_at_once(card):
    """Guards against slices that the books grant and the card does not hold: both
    granted the same card, each with its memory on it, at once."""
    with claim(gpus=0.5, label="half a") as a, claim(gpus=0.5, label="half b", timeout=30) as b:
        assert a.allocation.gpus == b.allocation.gpus, (a.allocation, b.allocation)
        (granted,) = a.allocation.gpus
        with holding(popen=a.popen, mib=SLICE_MIB), holding(popen=b.popen, mib=SLICE_MIB):
            both = wait_for(
                lambda: all(
                    (s := c.readings.latest) is not None and (s.gpu_bytes or 0) >= SLICE_MIB * MIB
                    for c in (a, b)
                ),
                timeout_s=20,
            )
            assert both, (
                f"two slices of card {granted} each hold {SLICE_MIB} MiB; their readings: "
                f"{a.readings.latest}, {b.readings.latest}\n{smi_query().printed}"
            )


def test_a_gpu_ram_slice_past_its_budget_is_halted(card):
    """Guards against a slice's memory budget that holds on stand-ins only."""
    with pytest.raises(ClaimHalted), claim(gpu_ram=BUDGET, label="over its slice") as c:
        with holding(popen=c.popen, mib=OVER_BUDGET_MIB) as process:
            ended = wait_for(lambda: process.poll() is not None, timeout_s=30)
            assert ended, f"{OVER_BUDGET_MIB} MiB held under gpu_ram={BUDGET}, and still running"
        c.run(int)


_OPEN = """
import errno, os, sys
for path in sys.argv[1:]:
    try:
        os.close(os.open(path, os.O_RDWR))
        print("opened")
    except OSError as error:
        print(errno.errorcode.get(error.errno, error.errno))
"""


def test_a_claim_opens_its_own_cards_node_and_not_anothers(card):
    """Guards against a card held by CUDA_VISIBLE_DEVICES alone, which any process ignores."""
    cards = cards_here()
    if isinstance(cards, str) or len(cards) < 2:
        pytest.skip("needs two cards, one to be granted and one to be kept from")
    if os.geteuid() != 0:
        pytest.skip("the device hold needs root here (a devices cgroup, or a device program)")
    with claim(gpus=1, label="one card of two") as c:
        (granted,) = c.allocation.gpus
        paths = [device_node_of(granted)]
        others = {device_node_of(index) for index in cards} - set(paths)
        if not others:
            pytest.skip("every card here is a MIG instance of one card: no other card's node")
        paths.append(sorted(others)[0])
        opened = (
            c.popen([sys.executable, "-c", _OPEN, *paths], stdout=subprocess.PIPE, text=True)
            .communicate(timeout=30)[0]
            .split()
        )
    assert opened == ["opened", errno.errorcode[errno.EPERM]], dict(
        zip(paths, opened, strict=False)
    )
