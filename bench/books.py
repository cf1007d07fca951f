"""The books: what a claim and its give-back cost, and how fast a waiter hears.

Every claimed cell pays for one claim and one give-back, on the kernel's own
books, or on a books service: the user's own, or the machine's. So their
latency under contention is what the accounting adds to a cell. The other
number is how long freed capacity takes to reach a waiter in another kernel:
the sleep-and-wake path; and how long the share of a holder killed outright
takes, which nobody gives back: the service frees it as the holder's
connection closes (issue #43 asks for 10 ms at most, median). On the
machine's books the contenders and the waiter are real second Unix users
when the benchmark runs as root; otherwise the rows say they are one user.

Slices of a card (issue #46): claim plus give-back of ``gpus=0.5`` on 4
cards, on the kernel's books and the machine's (target: a median ≤ 1 ms, as
for whole cards); and how much card memory 200 random slice and whole-card
claims, asked at once, are granted at once, as a share of what an offline
best-fit packing of the same claims grants (target ≥ 90 %): what the queue's
rule, that nobody is starved, costs in packing.

Then the machine's books service under floods a hostile second user sends
(issue #45; :mod:`tests.floods`): what another user's claim and give-back
cost while each runs, beside the same with no flood, and the service's
memory during the flood and 10 s after it ended. The targets: p99 ≤ 50 ms
and worst ≤ 250 ms during any flood, the median ≤ 1 ms with none, and
≤ 200 MB of memory during, within 50 MB of idle 10 s after.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable

from bench.harness import percentile, scratch, table
from fluksio_nb.books import ResourceAccountant
from fluksio_nb.card_slices import CardAsk, Cards, Slice
from fluksio_nb.machine.books import Entry, MachineBooks
from fluksio_nb.queue import ClaimQueue
from fluksio_nb.resources import Resources

#: A process's claim-and-give-back cycles, each timed, once told to start.
CYCLES = """
samples = []
sys.stdin.readline()
for _ in range(int(sys.argv[2])):
    started = time.perf_counter()
    q.release(q.enqueue(wanted))
    samples.append(time.perf_counter() - started)
print(json.dumps(samples), flush=True)
"""

#: Asks for the whole machine each time it is told, and says when it was granted.
WAITER = """
for _ in range(int(sys.argv[2])):
    sys.stdin.readline()
    t = q.enqueue(Resources(cpus=q.books.cpus))
    print(json.dumps({"state": t.state}), flush=True)
    q.wait(t)
    print(json.dumps({"granted": time.time()}), flush=True)
    q.release(t)
"""

#: Holds the whole machine until it is killed, which gives nothing back.
HOLDER = """
q.wait(q.enqueue(Resources(cpus=q.books.cpus)))
print("held", flush=True)
time.sleep(3600)
"""


def kernel_books(threads: int, cycles: int, gpus: float = 0) -> list[float]:
    cards = dict.fromkeys(range(4), 80 * 10**9)
    queue = ClaimQueue(ResourceAccountant(cpus=64, gpus=4, card_bytes=cards))
    wanted = Resources(cpus=1, gpus=gpus)
    samples: list[float] = []
    lock = threading.Lock()

    def work() -> None:
        mine = []
        for _ in range(cycles):
            started = time.perf_counter()
            queue.release(queue.enqueue(wanted))
            mine.append(time.perf_counter() - started)
        with lock:
            samples.extend(mine)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return samples


def contend(started: list[subprocess.Popen]) -> list[float]:
    """Start every process's cycles at once, imports done; all their samples."""
    for process in started:
        process.stdin.write("\n")
        process.stdin.flush()
    samples: list[float] = []
    for process in started:
        samples += json.loads(process.stdout.readline())
        process.wait()
    return samples


def killed_holder_latency(
    rounds: int, start_holder: Callable[[], subprocess.Popen], waiter: subprocess.Popen
) -> list[float]:
    """A holder killed with SIGKILL, as the OOM killer would: how soon its share reaches a waiter.

    Nobody gives the share back: the service frees it as the holder's
    connection closes.
    """
    latencies = []
    for _ in range(rounds):
        holder = start_holder()
        assert holder.stdout.readline().strip() == "held"
        waiter.stdin.write("\n")  # now queue behind it
        waiter.stdin.flush()
        assert json.loads(waiter.stdout.readline())["state"] == "waiting"
        killed = time.time()
        holder.kill()
        latencies.append(json.loads(waiter.stdout.readline())["granted"] - killed)
        holder.wait()
    waiter.wait()
    return latencies


SERVICE_SETUP = """
import json, sys, time
from fluksio_nb.kernel import accountant
from fluksio_nb.resources import Resources
q = accountant()
wanted = Resources(cpus=1)
"""


def _as(user: object) -> list[str]:
    if user is None:
        return []
    from tests.unix_users import as_user

    return as_user(user)  # type: ignore[arg-type]


def _service_env(run_dir: str, user: object) -> dict[str, str]:
    import os

    env = {
        "FLUKSIO_LEDGER": run_dir,
        "FLUKSIO_CONFIG": "/nonexistent/fluksio_nb.json",
        "FLUKSIO_RESERVE_CPUS": "0",
        # A user's own service keeps books over what its kernels declare: many
        # cores, so that contenders measure the books, not a queue for two.
        # The machine's keeps what its admin declared, and reads none of this.
        "FLUKSIO_CPUS": "64",
    }
    if user is None:
        return {**os.environ, **env}
    from tests.unix_users import user_environ

    return user_environ(user, env)  # type: ignore[arg-type]


def _as_user_with_books(user: object, run_dir: str, script: str, *args: str) -> subprocess.Popen:
    """A Python process of ``user`` (or of this one) on the books service at ``run_dir``.

    A machine's run directory, or a directory of the user's own, whose
    service the first process starts.
    """
    return subprocess.Popen(
        [*_as(user), sys.executable, "-c", script, "", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_service_env(run_dir, user),
        cwd="/",
    )


def _two_users() -> tuple[list[object], str]:
    """Two real users when root can make them; else this one, said so."""
    from tests.unix_users import USER_A, USER_B, missing_for_unix_users, ready_user

    missing = missing_for_unix_users()
    if missing is not None:
        return [None, None], f"one user: {missing}"
    return [ready_user(USER_A), ready_user(USER_B)], "2 users"


def service_books(
    processes_per_user: int,
    cycles: int,
    run_dir: str,
    users: list[object],
    wanted: str = "Resources(cpus=1)",
) -> list[float]:
    script = SERVICE_SETUP + f"wanted = {wanted}\n" + CYCLES
    started = [
        _as_user_with_books(user, run_dir, script, str(cycles))
        for user in users
        for _ in range(processes_per_user)
    ]
    return contend(started)


def _service_waiter(user: object, run_dir: str, rounds: int) -> subprocess.Popen:
    """A process of ``user`` that asks for the whole machine ``rounds`` times, when told."""
    return _as_user_with_books(
        user,
        run_dir,
        SERVICE_SETUP + WAITER,
        str(rounds),
    )


def service_wake_latency(rounds: int, run_dir: str, users: list[object]) -> list[float]:
    """A claim of one user frees the machine; a waiter of the other hears it."""
    holder, waiter_user = users
    waiter = _service_waiter(waiter_user, run_dir, rounds)
    holding = f"""
for _ in range({rounds}):
    held = q.enqueue(Resources(cpus=q.books.cpus))
    q.wait(held)
    print("held", flush=True)
    sys.stdin.readline()
    freed = time.time()
    q.release(held)
    print(json.dumps(freed), flush=True)
"""
    mine = _as_user_with_books(holder, run_dir, SERVICE_SETUP + holding)
    latencies = []
    for _ in range(rounds):
        assert mine.stdout.readline().strip() == "held"
        waiter.stdin.write("\n")
        waiter.stdin.flush()
        assert json.loads(waiter.stdout.readline())["state"] == "waiting"
        time.sleep(0.05)
        mine.stdin.write("\n")
        mine.stdin.flush()
        freed = json.loads(mine.stdout.readline())
        latencies.append(json.loads(waiter.stdout.readline())["granted"] - freed)
    waiter.wait()
    mine.wait()
    return latencies


def service_killed_holder_latency(rounds: int, run_dir: str, users: list[object]) -> list[float]:
    """A claim of one user is killed with its process; a waiter of the other gets the machine."""
    holder, waiter_user = users
    waiter = _service_waiter(waiter_user, run_dir, rounds)
    holding = SERVICE_SETUP + HOLDER
    return killed_holder_latency(
        rounds, lambda: _as_user_with_books(holder, run_dir, holding), waiter
    )


#: Each flood, at full size (``tests.floods.ATTACKER``'s modes and arguments).
FLOODS = [
    ("no flood", "none", ()),
    ("10⁵ claims pipelined on one connection", "claims", (100_000,)),
    ("4,096 waiting claims + 300 pipelined snapshots, again and again", "snapshots", (4097, 300)),
    ("100 connections × 256 KiB of snapshot requests", "connections", (100, 256 << 10)),
    ("500 unfinished 1 MiB lines", "unfinished", (500, 1 << 20)),
    ("1-byte drips on 500 connections", "drips", (500,)),
]


def main(cycles: int = 500, rounds: int = 30, most: int = 8, floods: int = len(FLOODS)) -> str:
    """The section: ``most`` processes contend at most, through the first ``floods`` floods."""
    rows = []
    results: dict[str, float] = {}

    def row(name: str, samples: list[float]) -> None:
        med, p99 = statistics.median(samples), percentile(samples, 0.99)
        results[name] = med
        rows.append([name, f"{med * 1e3:.3f} ms", f"{p99 * 1e3:.3f} ms"])

    row("kernel books, 1 thread", kernel_books(1, cycles))
    row(f"kernel books, {most} threads", kernel_books(most, cycles // most or 1))
    with scratch() as directory:
        users = [None, None]
        row("user's books service, 1 process", service_books(1, cycles, directory, [None]))
        row(
            f"user's books service, {most} processes",
            service_books(most, cycles // most or 1, directory, [None]),
        )
        row(
            "freed share reaches a waiter in another process",
            service_wake_latency(rounds, directory, users),
        )
        row(
            "a killed holder's share reaches a waiter in another process",
            service_killed_holder_latency(rounds, directory, users),
        )
    row("kernel books, 1 thread, gpus=0.5 on 4 cards", kernel_books(1, cycles, gpus=0.5))
    machine_rows(row, cycles, rounds, most)
    text = table(["claim plus give-back", "median", "p99"], rows)
    packed = table(
        ["200 random claims on 4 cards of 80 GB, granted at once", "median", "worst"],
        packing_rows(seeds=max(3, cycles // 25)),
    )
    floods = table(
        [
            "another user's claim plus give-back, during",
            "p50",
            "p99",
            "worst",
            "service memory, most during",
            "10 s after",
        ],
        flood_rows(min(1.0, cycles / 500), FLOODS[:floods]),
    )
    return textwrap.dedent(f"### The books\n\n{text}\n\n{packed}\n\n{floods}\n")


def machine_rows(
    row: Callable[[str, list[float]], None], cycles: int, rounds: int, most: int = 8
) -> None:
    """The machine's books service, set up as an admin would, beside the user's own rows."""
    import os

    if os.geteuid() != 0:
        row("machine service: not measured, `machine init` needs root", [0.0])
        return
    users, who = _two_users()
    prefix = tempfile.mkdtemp(prefix="fluksio-bench-machine-", dir="/tmp")
    os.chmod(prefix, 0o755)
    init = [sys.executable, "-m", "fluksio_nb", "machine"]
    subprocess.run(
        [*init, "init", "--prefix", prefix, "--cpus", "64", "--gpus", "4"],
        check=True,
        capture_output=True,
    )
    try:
        run_dir = f"{prefix}/run/fluksio_nb"
        row("machine service, 1 process", service_books(1, cycles, run_dir, users[:1]))
        row(
            "machine service, 1 process, gpus=0.5 on 4 cards",
            service_books(1, cycles, run_dir, users[:1], "Resources(cpus=1, gpus=0.5)"),
        )
        for each in sorted({max(1, most // 2), most}):
            row(
                f"machine service, {who} × {each} processes",
                service_books(each, cycles // (2 * each) or 1, run_dir, users),
            )
        row(
            f"machine service: freed share reaches a waiter ({who})",
            service_wake_latency(rounds, run_dir, users),
        )
        row(
            f"machine service: a killed holder's share reaches a waiter ({who})",
            service_killed_holder_latency(rounds, run_dir, users),
        )
    finally:
        subprocess.run([*init, "remove", "--prefix", prefix], check=False, capture_output=True)
        import shutil

        shutil.rmtree(prefix, ignore_errors=True)


def random_claims(rng: random.Random, n: int = 200) -> list[CardAsk]:
    """Claims as a class's notebooks make them: some whole cards, most slices of one."""
    claims = []
    for _ in range(n):
        draw = rng.random()
        if draw < 0.15:
            claims.append(CardAsk(whole=1))
        elif draw < 0.55:
            claims.append(CardAsk(piece=Slice(fraction=rng.choice([0.1, 0.25, 0.5]))))
        else:
            claims.append(CardAsk(piece=Slice(nbytes=rng.randint(2, 40) * 10**9)))
    return claims


def _bytes(claim: CardAsk, card: int) -> int:
    return card * claim.whole if claim.whole else claim.piece.on(card)  # type: ignore[union-attr]


def granted_at_once(claims: list[CardAsk], card: int, cards: int, on: str = "kernel") -> int:
    """Card memory the books grant of ``claims`` all asked at once, one after another
    with nothing ending: the kernel's books (:class:`ClaimQueue`) or the machine's
    (:class:`MachineBooks`, one user, so their fair order is arrival), cores to spare."""
    sizes = dict.fromkeys(range(cards), card)
    if on == "kernel":
        queue = ClaimQueue(ResourceAccountant(cpus=len(claims), gpus=cards, card_bytes=sizes))
        tickets = [queue.enqueue(_as_resources(claim)) for claim in claims]
        return sum(
            _bytes(c, card) for c, t in zip(claims, tickets, strict=True) if t.state == "running"
        )
    machine = MachineBooks(len(claims), range(cards), 0, card_bytes=sizes)
    entries = []
    for claim in claims:
        entry = Entry(
            number=machine.next_number(),
            uid=1000,
            user="bench",
            pid=1,
            need=(1, claim.whole, 0),
            label="",
            piece=claim.piece,
        )
        machine.add(entry)
        machine.dispatch()
        entries.append(entry)
    return sum(
        _bytes(c, card) for c, e in zip(claims, entries, strict=True) if e.state == "running"
    )


def _as_resources(claim: CardAsk) -> Resources:
    if claim.whole:
        return Resources(cpus=1, gpus=claim.whole)
    piece = claim.piece
    assert piece is not None
    if piece.fraction is not None:
        return Resources(cpus=1, gpus=piece.fraction)
    return Resources(cpus=1, gpu_ram=piece.nbytes)


def best_fit_offline(claims: list[CardAsk], card: int, cards: int, decreasing: bool) -> int:
    """Card memory a packer that knows every claim grants: best-fit, largest first if
    ``decreasing``, else in order, skipping what does not fit, owing nobody a turn."""
    books, granted = Cards(dict.fromkeys(range(cards), card)), 0
    ordered = sorted(claims, key=lambda c: _bytes(c, card), reverse=True) if decreasing else claims
    for claim in ordered:
        placed = books.place(claim)
        if placed is not None:
            books.take(*placed)
            granted += _bytes(claim, card)
    return granted


def packing_rows(seeds: int = 50) -> list[list[str]]:
    """What the queue's fairness costs in card memory, over ``seeds`` random runs,
    on the kernel's books and on the machine's."""
    card, cards = 80 * 10**9, 4
    runs = [random_claims(random.Random(seed)) for seed in range(seeds)]
    granted = {on: [granted_at_once(c, card, cards, on) for c in runs] for on in BOOKS}
    rows = []
    for on, books in BOOKS.items():
        for packer, decreasing in (("largest first", True), ("in arrival order", False)):
            shares = [
                100 * got / best_fit_offline(claims, card, cards, decreasing)
                for claims, got in zip(runs, granted[on], strict=True)
            ]
            rows.append(
                [
                    f"{books}: % of an offline best-fit packing, {packer}",
                    f"{statistics.median(shares):.1f} %",
                    f"{min(shares):.1f} %",
                ]
            )
    return rows


#: The books :func:`granted_at_once` walks, as the table names them.
BOOKS = {"kernel": "kernel's books", "machine": "machine's books"}


def flood_rows(
    scale: float = 1.0, floods: list[tuple[str, str, tuple[int, ...]]] = FLOODS
) -> list[list[str]]:
    """Each flood's row: another user's claims during it, and the service's memory.

    ``scale`` shrinks every flood, the probes and the wait after (for ``--smoke``).
    """
    import os

    from tests.floods import flooding, rss, summary

    if os.geteuid() != 0:
        return [["floods: not measured, `machine init` needs root", "", "", "", "", ""]]
    users, who = _two_users()
    if users[0] is None:
        return [[f"floods: not measured, they need two users ({who})", "", "", "", "", ""]]
    from tests.unix_users import as_user, user_environ

    alice, bob = users
    prefix = tempfile.mkdtemp(prefix="fluksio-bench-floods-", dir="/tmp")
    os.chmod(prefix, 0o755)
    init = [sys.executable, "-m", "fluksio_nb", "machine"]
    subprocess.run(
        [*init, "init", "--prefix", prefix, "--cpus", "4", "--gpus", "1"],
        check=True,
        capture_output=True,
    )
    run_dir = f"{prefix}/run/fluksio_nb"
    env = {
        "FLUKSIO_LEDGER": run_dir,
        "FLUKSIO_CONFIG": "/nonexistent/fluksio_nb.json",
        "FLUKSIO_RESERVE_CPUS": "0",
        # A user's own service keeps books over what its kernels declare: many
        # cores, so that contenders measure the books, not a queue for two.
        # The machine's keeps what its admin declared, and reads none of this.
        "FLUKSIO_CPUS": "64",
    }
    probes, after_s = max(3, int(200 * scale)), 10.0 * scale
    rows = []
    try:
        with open(f"{run_dir}/service.pid") as pidfile:
            pid = int(pidfile.read())
        idle = rss(pid)
        for name, mode, args in floods:
            sized = [max(1, int(a * scale)) if a > 300 else a for a in args]
            with flooding(
                as_user(bob),  # type: ignore[arg-type]
                user_environ(bob),  # type: ignore[arg-type]
                f"{run_dir}/books.sock",
                mode,
                *sized,
                probe=(as_user(alice), user_environ(alice, env)),  # type: ignore[arg-type]
                service_pid=pid,
            ) as flood:
                samples = flood.probes(probes, within=600)
                flood.stop()
            time.sleep(after_s)  # what is measured: memory this long after the flood
            took = summary([sample["claim"] for sample in samples])
            rows.append(
                [
                    name + ("" if scale == 1.0 else f" (× {scale:g})"),
                    *(f"{took[k] * 1e3:.2f} ms" for k in ("p50", "p99", "worst")),
                    f"{flood.peak_rss / 2**20:.0f} MB",
                    f"{rss(pid) / 2**20:.0f} MB (idle {idle / 2**20:.0f} MB)",
                ]
            )
    finally:
        subprocess.run([*init, "remove", "--prefix", prefix], check=False, capture_output=True)
        import shutil

        shutil.rmtree(prefix, ignore_errors=True)
    return rows


if __name__ == "__main__":
    print(main())
