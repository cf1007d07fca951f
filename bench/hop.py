"""What this machine charges for handing a cell to another process that sat idle.

A warm ``%%claim`` cell is a plain cell plus a hop: the kernel wakes its
worker, the worker runs the cell, the kernel wakes again to read the answer.
Between two claimed cells the worker sleeps, for as long as the user takes, or
for as long as the other subjects of ``bench.cells`` take. How much the hop
costs after such a sleep is a property of the machine, not of fluksio_nb: on
a virtual machine an idle virtual CPU is given back to the host, and whatever
runs on it next starts with cold caches.

So the hop is measured here apart, after 0, 20 and 100 ms of idleness, three
ways side by side:

- ``x = 1`` compiled and run in this process: the work itself;
- a byte sent to an idle process and back over a socket pair: waking a
  process and being woken, with no work in between;
- ``Worker.run("x = 1")`` on a warm fluksio_nb worker: what a claimed cell pays
  for the hop, its IPython shell included.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from bench.harness import interleaved, median, table
from fluksio_nb.worker.client import Worker

#: How long each subject's process sits idle before it is timed.
GAPS_S = (0.0, 0.02, 0.1)


#: The idle process: answers each byte on its socket with the same byte.
ECHO = """
import socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
while data := sock.recv(64):
    sock.send(data)
"""


def main(rounds: int = 60, gaps: tuple[float, ...] = GAPS_S) -> str:
    ours, theirs = socket.socketpair()
    echo = subprocess.Popen(
        [sys.executable, "-c", ECHO, str(theirs.fileno())], pass_fds=[theirs.fileno()]
    )
    theirs.close()
    worker = Worker(dict(os.environ))
    try:
        worker.run("x = 1")  # started and warm

        def in_process() -> None:
            exec(compile("x = 1", "<cell>", "exec"), {})

        def ping() -> None:
            ours.send(b"x")
            ours.recv(64)

        def hop() -> None:
            worker.run("x = 1")

        subjects = {"x = 1 here": in_process, "socket round trip": ping, "worker runs x = 1": hop}
        rows = []
        for gap in gaps:
            samples = interleaved(subjects, rounds, idle_s=gap)
            rows.append(
                [f"{gap * 1000:.0f} ms", *(f"{median(samples[n]) * 1000:.2f} ms" for n in subjects)]
            )
    finally:
        worker.close()
        ours.close()  # the echo's end-of-file
        echo.wait(timeout=10)
    return f"### A hop to a process that sat idle\n\n{table(['idle before', *subjects], rows)}\n"


if __name__ == "__main__":
    print(main())
