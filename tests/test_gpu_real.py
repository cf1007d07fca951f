"""On a real card: fluksio_nb's figure for a process's card memory is nvidia-smi's.

Everything else about the cards is tested against stand-ins of NVML and
``nvidia-smi``, which say what the tests tell them to. Only a driver says
what a real process on a real card holds, and in which units, and under
which pid; so here a process of its own allocates a known amount with torch
or cupy, and fluksio_nb's reading of that process is checked against what
``nvidia-smi --query-compute-apps`` prints, within 5%: read with each source
fluksio_nb can use here (NVML, nvidia-smi), and through a claim granted a
card, which also checks that the card CUDA puts the memory on is the card
the books granted.

Skipped, saying what is missing, where there is no NVIDIA driver (no
``nvidia-smi``, or one that lists no card) or neither torch nor cupy.
"""

from __future__ import annotations

from typing import NoReturn

import pytest

from fluksio_nb import claim
from fluksio_nb.gpu_usage import CardsReading, kernel_cards
from fluksio_nb.sampler import Sampler
from tests.real_cards import (
    ALLOCATE_MIB,
    MIB,
    CannotAllocate,
    SmiQuery,
    first_card,
    frameworks,
    holding,
    missing,
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
    """A process holding ALLOCATE_MIB on ``card``, and the framework that allocated it."""
    cannot = []
    for framework in frameworks():
        try:
            with holding(framework, card=card) as process:
                yield process, framework
                return
        except CannotAllocate as error:
            cannot.append(str(error))
    pytest.skip(f"nothing installed could allocate on card {card}: {'; '.join(cannot)}")


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
def test_a_process_card_memory_is_what_nvidia_smi_says(card, held, source):
    process, framework = held
    make = readers().get(source)
    if make is None:
        pytest.skip(
            "nvidia-ml-py is not installed (the [gpu] extra), or NVML does not answer: "
            "fluksio_nb reads the cards with nvidia-smi here"
        )
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
        f"{framework} holds {ALLOCATE_MIB} MiB on card {card}: fluksio_nb ({source}) reads "
        f"{ours / MIB:.0f} MiB for the process, nvidia-smi {theirs:.0f} MiB\n{smi.printed}"
    )
    total = reading.card(card).total_bytes
    assert total is not None and on_card.total_mib is not None
    assert near(total / MIB, on_card.total_mib), (total / MIB, on_card.total_mib)


def test_a_claims_card_memory_is_what_nvidia_smi_says(held):
    _, framework = held
    with claim(gpus=1, label="real card") as c:
        (granted,) = c.allocation.gpus
        with holding(framework, popen=c.popen) as process:
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
