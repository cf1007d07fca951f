"""Values crossing between the kernel and a worker: what arrives, and what is left behind."""

import gc
import hashlib
import json
import mmap
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import suppress
from pathlib import Path

import numpy as np
import pytest

from fluksio_nb import shelf, transfer
from fluksio_nb.segments import SEGMENT_DIR, SEGMENT_PREFIX, sweep_orphans
from fluksio_nb.transfer import pack, unchanged, unpack

#: Big enough to go through shared memory, small enough to keep the suite fast.
BIG = 16 * 2**20 // 8

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and /dev/shm"
)


@pytest.fixture(autouse=True)
def no_leftovers_carried_over():
    """One test's leftover segments must not fail the next test's count."""
    yield
    shelf.clear_shelf()
    for path in segments_of(os.getpid()):
        path.unlink(missing_ok=True)


def kept_here() -> set[int]:
    """The files this process has open to keep for reuse, by inode.

    They are memfds, so never in the shared directory; a mapping of one holds
    a descriptor of its own, so descriptors are not files.
    """
    gc.collect()
    kept = set()
    for fd in os.listdir("/proc/self/fd"):
        with suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{SEGMENT_PREFIX}"):
                kept.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    return kept


def segments_of(pid: int) -> list[Path]:
    return sorted(Path(SEGMENT_DIR).glob(f"{SEGMENT_PREFIX}{pid}-*"))


def mapped_segment(start: int, nbytes: int, maps: str) -> str | None:
    """The shared-memory file whose mapping holds these bytes, per /proc/<pid>/maps."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and SEGMENT_PREFIX in fields[5]:
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            if low <= start and start + nbytes <= high:
                return fields[5]
    return None


def segment_under(array: np.ndarray) -> str | None:
    """The shared-memory file this process has mapped under `array`, if any."""
    start = array.__array_interface__["data"][0]
    return mapped_segment(start, array.nbytes, Path("/proc/self/maps").read_text())


def owners(array: np.ndarray) -> list[str]:
    """What keeps `array`'s memory alive, from the array down to whatever owns it."""
    chain, holder = [], array
    while holder is not None:
        chain.append(type(holder).__name__)
        holder = holder.obj if isinstance(holder, memoryview) else getattr(holder, "base", None)
    return chain


def python(script: str, *args: str, parcel: transfer.Parcel | None = None) -> bytes:
    """Run `script` in a fresh interpreter, feeding it a pickled parcel; return its stdout."""
    stdin = pickle.dumps(parcel) if parcel is not None else b""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


RECEIVER = """
    import hashlib, json, pickle, sys
    from fluksio_nb.transfer import unpack
    values, failures = unpack(pickle.load(sys.stdin.buffer))
    array = values["array"]
    digest = hashlib.sha256(array).hexdigest()
    array[0] = -1.0
    chain, holder = [], array
    while holder is not None:
        chain.append(type(holder).__name__)
        holder = holder.obj if isinstance(holder, memoryview) else getattr(holder, "base", None)
    with open("/proc/self/maps") as maps:
        mapped = maps.read()
    json.dump(
        {
            "failures": failures,
            "digest": digest,
            "first": float(array[0]),
            "address": array.__array_interface__["data"][0],
            "nbytes": array.nbytes,
            "owners": chain,
            "maps": mapped,
        },
        sys.stdout,
    )
"""

SENDER = """
    import pickle, sys
    import numpy as np
    from fluksio_nb.transfer import pack
    array = np.arange(int(sys.argv[1]), dtype=np.float64)
    sys.stdout.buffer.write(pickle.dumps(pack({"array": array, "label": "sent"})))
"""


# -- what arrives ----------------------------------------------------------------------


def test_a_value_that_cannot_be_pickled_is_reported_by_name_and_the_rest_arrive():
    """Guards against one lock in the namespace failing the whole cell."""
    parcel = pack({"lock": threading.Lock(), "rows": [1, 2, 3]})
    values, failures = unpack(parcel)
    assert values == {"rows": [1, 2, 3]}
    assert failures == {"lock": "cannot pickle '_thread.lock' object"}


def test_a_value_that_cannot_be_rebuilt_is_reported_by_name_and_the_rest_arrive(
    tmp_path, monkeypatch
):
    """Guards against a class the receiver cannot import failing every other value."""
    (tmp_path / "fluksio_vanishing.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fluksio_vanishing

    parcel = pack({"thing": fluksio_vanishing.Thing(), "size": 3})
    monkeypatch.delitem(sys.modules, "fluksio_vanishing")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])

    values, failures = unpack(parcel)
    assert values == {"size": 3}
    assert failures == {"thing": "No module named 'fluksio_vanishing'"}


def test_modules_travel_by_reference():
    """Guards against a module being pickled by value, or not at all."""
    parcel = pack({"np": np, "json": json})
    assert all(len(packed.pickle) < 100 for packed in parcel.values.values())
    values, failures = unpack(parcel)
    assert failures == {}
    assert values["np"] is np and values["json"] is json


def test_functions_and_classes_defined_in_the_notebook_arrive_in_another_process():
    """Guards against a function defined in a cell failing to import in the worker."""
    notebook = {"__name__": "__main__"}
    exec(
        textwrap.dedent(
            """
            RATE = 3
            def cost(hours):
                return hours * RATE
            class Box:
                def __init__(self, side):
                    self.side = side
                def volume(self):
                    return self.side ** 3
            """
        ),
        notebook,
    )
    parcel = pack({"cost": notebook["cost"], "box": notebook["Box"](2)})
    out = python(
        """
        import pickle, sys
        from fluksio_nb.transfer import unpack
        values, failures = unpack(pickle.load(sys.stdin.buffer))
        print(values["cost"](5), values["box"].volume(), failures)
        """,
        parcel=parcel,
    )
    assert out.decode().split() == ["15", "8", "{}"]


def test_a_small_array_travels_inline_and_arrives_writable():
    """Guards against a file and a mapping per tiny array, or a read-only array."""
    parcel = pack({"small": np.arange(1000.0)})
    assert parcel.values["small"].segments == ()
    values, _ = unpack(parcel)
    values["small"][0] = 7.0
    assert values["small"][1:].tolist() == list(range(1, 1000))


def test_strided_and_fortran_ordered_arrays_arrive_intact():
    """Guards against an array whose memory is not C-ordered arriving scrambled."""
    grid = np.arange(BIG, dtype=np.float64).reshape(1024, -1)
    fortran, every_other = np.asfortranarray(grid), grid[:, ::2]
    values, failures = unpack(pack({"fortran": fortran, "every_other": every_other}))
    assert failures == {}
    assert values["fortran"].flags.f_contiguous
    np.testing.assert_array_equal(values["fortran"], grid)
    np.testing.assert_array_equal(values["every_other"], every_other)


# -- without copies --------------------------------------------------------------------


def test_a_big_array_arrives_writable_on_a_mapping_of_its_segment():
    """Guards against the receiving side copying a big array instead of mapping it."""
    original = np.arange(BIG, dtype=np.float64)
    parcel = pack({"array": original})
    assert len(parcel.values["array"].segments) == 1

    array = unpack(parcel)[0]["array"]
    assert owners(array)[-1] == "mmap"
    assert segment_under(array) is not None
    array[0] = -1.0
    np.testing.assert_array_equal(array[1:], original[1:])


def test_a_big_array_crosses_into_another_process_without_a_copy():
    """Guards against the worker's copy of an input being anything but the shared mapping."""
    array = np.arange(BIG, dtype=np.float64)
    arrived = json.loads(python(RECEIVER, parcel=pack({"array": array})))
    assert arrived["failures"] == {}
    assert arrived["digest"] == hashlib.sha256(array).hexdigest()
    assert arrived["first"] == -1.0, "the array arrived read-only"
    assert arrived["owners"][-1] == "mmap"
    segment = mapped_segment(arrived["address"], arrived["nbytes"], arrived["maps"])
    # Unlinked as soon as it was mapped: nothing is left to sweep.
    assert segment is not None and segment.endswith("(deleted)")


def test_a_big_array_from_a_process_that_has_exited_lands_on_a_mapping_here():
    """Guards against an output needing its sender alive, or being copied on arrival."""
    parcel = pickle.loads(python(SENDER, str(BIG)))
    values, failures = unpack(parcel)
    assert failures == {} and values["label"] == "sent"
    array = values["array"]
    assert array.flags.writeable
    assert segment_under(array) is not None
    assert array[-1] == BIG - 1 and array.sum() == BIG * (BIG - 1) / 2


def test_the_mapping_goes_away_with_the_last_array_on_it():
    """Guards against a received array's memory outliving it, or vanishing under a view."""
    array = unpack(pack({"array": np.ones(BIG)}))[0]["array"]
    segment = segment_under(array)
    view = array[BIG // 2 :]
    del array
    gc.collect()
    assert segment in Path("/proc/self/maps").read_text()
    assert view.sum() == BIG // 2
    del view
    gc.collect()
    assert segment not in Path("/proc/self/maps").read_text()


# -- warm files, and values sent back on what they came in on ------------------------


def kept_path(parcel: transfer.Parcel, name: str) -> str:
    (segment,) = parcel.values[name].segments
    assert segment.kept
    return segment.path


def test_a_kept_file_is_written_again_once_nothing_is_mapped_on_it():
    """Guards against every parcel paying for fresh pages when a warm file is free."""
    first = pack({"a": np.ones(BIG)}, reuse=True)
    path = kept_path(first, "a")
    unpack(first)[0]["a"].sum()  # mapped, read, and gone again
    first.discard()
    second = pack({"a": np.full(BIG, 2.0)}, reuse=True)
    assert kept_path(second, "a") == path
    assert unpack(second)[0]["a"][-1] == 2.0
    second.discard()
    assert len(kept_here()) == 1, "one warm file, not one per parcel"
    assert segments_of(os.getpid()) == [], "kept files have no name to leave behind"


def test_a_kept_file_is_never_written_under_a_live_array():
    """Guards against reusing memory an array in another process still stands on."""
    first = pack({"a": np.ones(BIG)}, reuse=True)
    held = unpack(first)[0]["a"]
    first.discard()
    second = pack({"a": np.full(BIG, 2.0)}, reuse=True)
    assert kept_path(second, "a") != kept_path(first, "a")
    assert held.min() == held.max() == 1.0
    second.discard()


def test_a_receiver_that_died_frees_the_file_it_had_mapped():
    """Guards against a killed worker's lock keeping a warm file from ever being reused."""
    first = pack({"array": np.arange(BIG, dtype=np.float64)}, reuse=True)
    arrived = json.loads(python(RECEIVER, parcel=first))  # maps it, then exits
    assert arrived["digest"] == hashlib.sha256(np.arange(BIG, dtype=np.float64)).hexdigest()
    segment = mapped_segment(arrived["address"], arrived["nbytes"], arrived["maps"])
    # The receiver mapped the sender's own memfd, whose name says whose it is.
    assert segment is not None and f"memfd:{SEGMENT_PREFIX}{os.getpid()}-kept" in segment
    first.discard()
    again = pack({"array": np.zeros(BIG)}, reuse=True)
    assert kept_path(again, "array") == kept_path(first, "array")
    again.discard()


def test_a_value_bound_to_its_input_goes_back_as_a_reference_to_the_senders_file():
    """Guards against `b = a` in a claimed cell copying the array back."""
    sent = pack({"a": np.arange(BIG, dtype=np.float64)}, reuse=True)
    a = unpack(sent, remember=True)[0]["a"]
    a *= 2  # in place: what goes back is the changed array
    back = pack({"b": a, "tail": a[BIG // 4 :]}, refer_back=True)
    (reference,) = back.values["b"].segments
    assert (reference.path, reference.offset, reference.kept) == (kept_path(sent, "a"), 0, True)
    (tail,) = back.values["tail"].segments
    assert (tail.path, tail.offset) == (reference.path, BIG // 4 * 8)
    del a
    values, failures = unpack(back)
    assert failures == {}
    assert values["b"][3] == 6.0 and values["tail"][0] == BIG // 4 * 2
    assert f"memfd:{SEGMENT_PREFIX}{os.getpid()}-kept" in segment_under(values["b"])
    sent.discard()


def test_a_claimed_cells_unchanged_input_comes_back_on_the_kernels_own_file():
    """Guards against a real worker copying back what it was sent, when it could refer to it."""
    from fluksio_nb.env import worker_environ
    from fluksio_nb.worker.client import Worker

    with Worker(worker_environ({})) as worker:
        original = np.arange(BIG, dtype=np.float64)
        outcome = worker.run("a *= 2\nb = a", inputs={"a": original}, outputs=["b"])
        assert outcome.ok, outcome
        b = outcome.outputs["b"]
        assert b[5] == 10.0 and original[5] == 5.0, "the kernel's own array stays as it was"
        segment = segment_under(b)
        assert segment is not None
        assert f"{SEGMENT_PREFIX}{os.getpid()}-kept" in segment, "b is the kernel's own memory"


def test_a_value_that_pickles_as_it_was_sent_is_unchanged_and_any_change_shows():
    rows, model = [1, 2], {"weights": [0.5]}
    sent = pack({"rows": rows, "model": model})
    assert unchanged(rows, sent.values["rows"]) and unchanged(model, sent.values["model"])
    rows.append(3)
    model["weights"][0] = 0.25
    assert not unchanged(rows, sent.values["rows"])
    assert not unchanged(model, sent.values["model"])
    assert not unchanged(threading.Lock(), sent.values["rows"]), "unpicklable now: changed"


def test_a_big_input_only_read_is_unchanged_and_one_written_element_shows():
    """Guards against a read input sent back, and against a change in place taken for none."""
    sent = pack({"big": np.arange(BIG, dtype=np.float64)}, reuse=True)
    big = unpack(sent, remember=True)[0]["big"]
    assert float(big.sum()) == BIG * (BIG - 1) / 2  # every page read
    assert unchanged(big, sent.values["big"])
    assert not unchanged(big.copy(), sent.values["big"]), "equal, but not what was sent"
    assert not unchanged(big[1:], sent.values["big"])
    big[BIG // 2] = big[BIG // 2]  # written, with the same value: still a write
    assert not unchanged(big, sent.values["big"])
    del big
    sent.discard()


def test_a_big_value_not_unpacked_to_be_remembered_is_never_taken_for_unchanged():
    """Nothing tells what was written on a shared mapping: such a value always goes back."""
    big = np.zeros(BIG)
    sent = pack({"big": big})
    assert not unchanged(big, sent.values["big"])
    sent.discard()


def test_a_changed_input_goes_back_by_writing_only_the_pages_the_cell_changed():
    """Guards against one element changed in a big input copying all of it back."""
    original = np.arange(BIG, dtype=np.float64)
    sent = pack({"a": original}, reuse=True)
    a = unpack(sent, remember=True)[0]["a"]
    a[10] = -1
    back = pack({"a": a}, refer_back=True)
    (reference,) = back.values["a"].segments
    assert reference.path == kept_path(sent, "a")
    assert reference.written == mmap.PAGESIZE and back.moved_bytes < 2 * mmap.PAGESIZE
    assert unchanged(a, sent.values["a"]), "its pages are the file's again, which has the change"
    del a
    values, failures = unpack(back)
    assert failures == {}
    assert (values["a"][10], values["a"][11]) == (-1.0, 11.0)
    assert original[10] == 10.0, "the sender's own array is its own"
    sent.discard()


def test_a_small_slice_of_an_input_is_copied_back_rather_than_pinning_the_file():
    """Guards against a few rows sent back keeping a whole big input in memory."""
    sent = pack({"a": np.ones(BIG)}, reuse=True)
    a = unpack(sent, remember=True)[0]["a"]
    back = pack({"part": a[: BIG // 3]}, refer_back=True)
    (copied,) = back.values["part"].segments
    assert not copied.kept and copied.path != kept_path(sent, "a")
    back.discard()
    sent.discard()


def test_an_idle_kept_file_is_removed(monkeypatch):
    """Guards against a notebook that stopped sending holding shared memory forever."""
    monkeypatch.setattr(shelf, "SHELF_IDLE_S", 0.2)
    parcel = pack({"a": np.ones(BIG)}, reuse=True)
    # Looked for before the discard: after it, the idle clock runs, and a slow
    # garbage collection here could outlast it before the first look.
    assert kept_here() != set()
    parcel.discard()
    deadline = time.monotonic() + 10
    while kept_here() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kept_here() == set()


def test_the_parcel_stays_small_whatever_it_carries():
    """Guards against the big buffers travelling inside the frame that carries the parcel."""
    parcel = pack({"array": np.zeros(BIG), "other": np.ones(BIG)})
    try:
        assert len(pickle.dumps(parcel)) < 2048
        assert parcel.nbytes > 2 * BIG * 8
    finally:
        parcel.discard()


def test_big_bytes_travel_beside_their_pickle_and_arrive_as_the_same_bytes():
    """Guards against a list of big bytes being copied whole into its pickle: only arrays
    went out of band, so a cell keeping a 320 MB list of bytes built a 320 MB stream beside
    it to send it back. They must arrive as bytes, equal, shared as they were."""
    blob = os.urandom(transfer.INLINE_LIMIT)
    buffer = bytearray(os.urandom(transfer.INLINE_LIMIT))
    value = [blob, blob, "text", buffer, (blob, {"again": buffer}), b"small"]
    parcel = pack({"value": value, "alone": blob})
    try:
        sent = parcel.values
        assert [len(sent["value"].segments), len(sent["alone"].segments)] == [1, 1]
        # The bytearray stays in the stream: see fluksio_nb.pickling on why.
        assert len(sent["value"].pickle) < len(buffer) + 1024 and len(sent["alone"].pickle) < 1024
    finally:
        arrived, failed = unpack(parcel)
    assert failed == {}
    got = arrived["value"]
    assert got == value and arrived["alone"] == blob
    assert [type(got[0]), type(got[3]), type(arrived["alone"])] == [bytes, bytearray, bytes]
    assert got[0] is got[1] is got[4][0] and got[3] is got[4][1]["again"]


def test_big_bytes_pickled_without_a_buffer_callback_are_the_standard_pickle():
    """Guards the pickle a value is compared by, or loaded from anywhere: with nowhere to put
    big bytes out of band, or where the callback keeps them in, the stream is the usual one."""
    value = [os.urandom(transfer.INLINE_LIMIT), bytearray(transfer.INLINE_LIMIT)]
    assert transfer.dumps(value) == pickle.dumps(value, protocol=5)
    assert transfer.dumps(value, lambda buffer: True) == pickle.dumps(value, protocol=5)


# -- nothing left behind ---------------------------------------------------------------


def test_unpack_leaves_no_shared_memory_behind():
    """Guards against every claimed cell leaking its inputs' size in /dev/shm."""
    parcel = pack({"array": np.zeros(BIG)})
    assert len(segments_of(os.getpid())) == 1
    values, _ = unpack(parcel)
    assert segments_of(os.getpid()) == []
    assert values["array"].sum() == 0


def test_a_segment_is_unlinked_as_soon_as_it_is_mapped(monkeypatch):
    """Guards against a receiver that dies while unpickling leaving the file behind."""
    parcel = pack({"array": np.zeros(BIG)})
    unpickle = pickle.loads
    left_while_unpickling = []

    def watching(*args, **kwargs):
        left_while_unpickling.extend(segments_of(os.getpid()))
        return unpickle(*args, **kwargs)

    monkeypatch.setattr(transfer.pickle, "loads", watching)
    unpack(parcel)
    assert left_while_unpickling == []


def test_unpack_removes_the_memory_of_a_value_that_failed_to_arrive():
    """Guards against the rest of a value's buffers staying in /dev/shm when one is missing."""
    parcel = pack({"pair": (np.zeros(BIG), np.ones(BIG))})
    first, second = parcel.values["pair"].segments
    os.unlink(first.path)
    values, failures = unpack(parcel)
    assert values == {} and "is gone" in failures["pair"]
    assert not os.path.exists(second.path)


def test_a_value_that_fails_halfway_through_packing_leaves_nothing_behind():
    """Guards against the big array packed before the lock next to it failed staying in /dev/shm."""
    parcel = pack({"pair": (np.zeros(BIG), threading.Lock())})
    assert "pair" in parcel.failures
    assert segments_of(os.getpid()) == []


def test_discard_leaves_no_shared_memory_behind():
    """Guards against a parcel whose receiver died keeping its memory forever."""
    pack({"array": np.zeros(BIG)}).discard()
    assert segments_of(os.getpid()) == []


def test_a_parcel_unpacked_twice_names_what_is_gone():
    """Guards against a second unpack crashing instead of saying what went missing."""
    parcel = pack({"array": np.zeros(BIG), "size": 3})
    unpack(parcel)
    values, failures = unpack(parcel)
    assert values == {"size": 3}
    assert "is gone" in failures["array"]


def test_sweep_removes_what_a_dead_sender_left_behind():
    """Guards against /dev/shm filling up with parcels of senders that died in flight."""
    parcel = pickle.loads(python(SENDER, str(BIG)))
    sender = int(Path(parcel.values["array"].segments[0].path).name.split("-")[1])
    assert len(segments_of(sender)) == 1

    removed = sweep_orphans()
    assert segments_of(sender) == []
    assert any(Path(path).name.startswith(f"{SEGMENT_PREFIX}{sender}-") for path in removed)
    values, failures = unpack(parcel)
    assert values == {"label": "sent"} and "swept" in failures["array"]


def test_sweep_leaves_a_live_senders_memory_alone():
    """Guards against sweeping a parcel its sender is still sending."""
    parcel = pack({"array": np.zeros(BIG)})
    try:
        sweep_orphans()
        assert len(segments_of(os.getpid())) == 1
    finally:
        parcel.discard()


def test_a_segment_older_than_the_process_with_its_pid_is_swept():
    """Guards against a recycled pid keeping a dead sender's memory forever."""
    stale = Path(SEGMENT_DIR) / f"{SEGMENT_PREFIX}{os.getpid()}-0123456789abcdef"
    stale.write_bytes(b"left by an earlier process with this pid")
    a_day_ago = time.time() - 86400
    os.utime(stale, (a_day_ago, a_day_ago))
    assert str(stale) in sweep_orphans()
    assert not stale.exists()


@pytest.mark.parametrize(
    "where",
    [
        {},
        {"reuse": True},
        {"reuse": True, "unmapped": True, "room_in_segment_dir": True},
    ],
    ids=["new files", "kept files", "kept files in the segment directory"],
)
def test_packing_says_the_size_to_write_before_writing_and_how_far_it_got_after(where):
    """Guards against a progress that cannot say "1.6 GB" until it is over, or ends short of it."""
    told: list[tuple[int, int]] = []
    values = {"a": np.ones(BIG), "many": [np.ones(BIG // 2), np.full(BIG // 2, 2.0)], "n": 7}
    parcel = pack(values, progress=lambda written, total: told.append((written, total)), **where)
    total = 2 * BIG * 8
    assert told[0] == (0, total), told
    assert told[-1] == (total, total), told
    written = [done for done, _ in told]
    assert written == sorted(written) and {whole for _, whole in told} == {total}
    arrived, failures = unpack(parcel)
    assert failures == {} and arrived["many"][1][-1] == 2.0 and arrived["n"] == 7
    parcel.discard()


def test_a_kept_file_in_the_segment_directory_has_no_name_there_yet_arrives_writable_elsewhere():
    """Guards against a worker's kept outputs either leaving names in /dev/shm or
    escaping its size: they take its room, nameless from before the first byte."""
    sent = np.arange(BIG, dtype=np.float64)
    parcel = pack({"array": sent}, reuse=True, unmapped=True, room_in_segment_dir=True)
    assert segments_of(os.getpid()) == []
    arrived = json.loads(python(RECEIVER, parcel=parcel))
    assert arrived["failures"] == {}
    assert arrived["digest"] == hashlib.sha256(sent).hexdigest()
    assert arrived["first"] == -1.0, "writable"
    segment = mapped_segment(arrived["address"], arrived["nbytes"], arrived["maps"])
    assert segment is not None
    assert segment.startswith(f"{SEGMENT_DIR}/{SEGMENT_PREFIX}{os.getpid()}-"), segment
    assert segment.endswith("(deleted)"), segment
    parcel.discard()
    assert segments_of(os.getpid()) == []


def test_a_value_sent_again_reuses_the_file_let_go_though_two_were_held_past_the_idle_limit(
    monkeypatch,
):
    """Guards against a cell run again paying for fresh pages: the receiver holds the
    last run's value while the new one arrives, so two files are in use at once,
    and neither is memory kept for nothing."""
    monkeypatch.setattr(shelf, "SHELF_BYTES", BIG * 8)
    one = pack({"a": np.ones(BIG)}, reuse=True)
    # By inode: a descriptor's number, and so the path, is used again once closed.
    first_file = os.stat(kept_path(one, "a")).st_ino
    held_one = unpack(one)[0]["a"]
    one.discard()
    two = pack({"a": np.full(BIG, 2.0)}, reuse=True)
    held_two = unpack(two)[0]["a"]
    two.discard()
    del held_one  # the first run's value, replaced by the second's
    gc.collect()
    three = pack({"a": np.full(BIG, 3.0)}, reuse=True)
    assert os.stat(kept_path(three, "a")).st_ino == first_file
    assert held_two.min() == held_two.max() == 2.0
    assert unpack(three)[0]["a"][0] == 3.0
    three.discard()


def test_kept_files_a_receiver_holds_never_run_the_sender_out_of_descriptors(monkeypatch):
    """Guards against a receiver holding thousands of small arrays taking as many of
    the sender's descriptors; the arrays stay whole when the sender lets go of them."""
    monkeypatch.setattr(shelf, "SHELF_FILES", 3)
    values = {f"a{index}": np.full(2**16, float(index)) for index in range(6)}
    parcel = pack(values, reuse=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        holder.stdin.write(pickle.dumps(parcel))
        holder.stdin.close()
        assert holder.stdout.readline() == b"held\n"
        parcel.discard()
        assert len(kept_here()) <= 3
        os.kill(holder.pid, signal.SIGUSR1)
        assert json.loads(holder.stdout.read()) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        holder.kill()
        holder.wait()


#: Unpacks a parcel, says so, and reads its arrays once told to (SIGUSR1).
HOLDER = """
    import json, pickle, signal, sys
    from fluksio_nb.transfer import unpack
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    values, failures = unpack(pickle.load(sys.stdin.buffer))
    assert failures == {}, failures
    print("held", flush=True)
    signal.sigwait([signal.SIGUSR1])
    print(json.dumps([float(values[name].mean()) for name in sorted(values)]))
"""
