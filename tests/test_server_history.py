"""The server's history handed to its kernels through a file: what a kernel takes from it.

Real files in a temporary directory, and the ring the kernel keeps
(:class:`~fluksio_nb.machine_history.MachineHistory`); the server's side is
tested over HTTP in ``tests/test_server_glance.py``.
"""

from __future__ import annotations

import json
import os

from fluksio_nb.machine_history import MachineHistory
from fluksio_nb.server_history import ENV, MOST_BYTES, _CatchUp, publish, read_points

MEMORY = (16_000_000_000, 10_000_000_000)


def point(at: float, cpu: float = 10.0) -> dict:
    return {
        "at": at,
        "cpu_percent": cpu,
        "cpu_outside_claims_percent": None,
        "memory_used_bytes": 6_000_000_000,
        "memory_total_bytes": 16_000_000_000,
        "cards": [],
    }


def servers_ring(ats: list[float]) -> MachineHistory:
    ring = MachineHistory(span_s=1e12)
    ring.merge([point(at) for at in ats])
    return ring


def test_a_kernel_takes_the_servers_points_around_its_own_and_keeps_its_own(tmp_path):
    """Guards against a kernel whose own points are replaced or doubled by the server's."""
    path = tmp_path / "history.json"
    publish(servers_ring([100.0, 102.0, 104.0, 106.0, 108.0, 110.0]), path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600", "another user must not read it"
    kernel = MachineHistory(span_s=1e12)
    kernel.merge([point(105.0, cpu=55.0)])  # a point the kernel took itself
    taken = _CatchUp()(kernel, {ENV: str(path)})
    ats = [p["at"] for p in kernel.points(now=111.0)]
    # 104 and 106 are within half an interval of the kernel's own 105: not taken, or the
    # chart would crowd there.
    assert ats == [100.0, 102.0, 105.0, 108.0, 110.0], ats
    assert taken == 4
    assert next(p for p in kernel.points(now=111.0) if p["at"] == 105.0)["cpu_percent"] == 55.0
    # Read again only when the file changed: nothing new, nothing taken.
    assert _CatchUp()(kernel, {ENV: str(path)}) == 0


def test_a_file_that_is_not_the_servers_points_is_ignored_not_an_error(tmp_path):
    """Guards against a monitor that fails to open on a broken, hostile or huge file."""
    cases = {
        "garbage.json": "{not json",
        "wrong.json": json.dumps([{"at": "soon", "cpu_percent": "lots"}]),
        "huge.json": json.dumps([point(1.0)]) + " " * MOST_BYTES,
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        assert read_points(path) == [], name
        kernel = MachineHistory()
        assert _CatchUp()(kernel, {ENV: str(path)}) == 0, name
        assert kernel.points() == []
    assert _CatchUp()(MachineHistory(), {ENV: str(tmp_path / "missing.json")}) == 0
    assert _CatchUp()(MachineHistory(), {}) == 0
