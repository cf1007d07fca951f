"""A real IPython kernel, driven through jupyter_client as a notebook drives it.

The tests that use it run cells exactly as a front end would: an
``execute_request`` on the shell channel, every reply and output read back
from IOPub with the time it arrived. Nothing of fluksio_nb runs in the test
process; it runs in the kernel, where users run it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager

from tests.unix_users import UnixUser, as_user, user_environ


@dataclass
class Ran:
    """What one cell produced, in the order it arrived."""

    status: str
    msg_id: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    finished_at: float = 0.0
    #: The input requests the cell made, when it was run answering them.
    prompts: list[dict[str, Any]] = field(default_factory=list)

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["msg_type"] in kinds]

    @property
    def stdout(self) -> str:
        return "".join(
            m["content"]["text"] for m in self.of("stream") if m["content"]["name"] == "stdout"
        )

    @property
    def stderr(self) -> str:
        return "".join(
            m["content"]["text"] for m in self.of("stream") if m["content"]["name"] == "stderr"
        )

    @property
    def error(self) -> dict[str, Any] | None:
        errors = self.of("error")
        return errors[-1]["content"] if errors else None

    @property
    def texts(self) -> list[str]:
        """Every text/plain shown, displays and results, in order, updates included."""
        return [
            m["content"]["data"].get("text/plain", "")
            for m in self.of("display_data", "execute_result", "update_display_data")
        ]

    def json(self) -> Any:
        """The last line of stdout, read as JSON: how cells report facts to tests."""
        return json.loads(self.stdout.strip().splitlines()[-1])

    def so_far(self) -> str:
        """What the cell has shown, for a test that gave up waiting on it."""
        shown = f"stdout {self.stdout!r}, stderr {self.stderr!r}"
        if self.error is not None:
            shown += f", {self.error['ename']}: {self.error['evalue']}"
        return shown


@dataclass(frozen=True)
class Until:
    """What a test waits for a started cell to do, and how to say that it did not."""

    #: What the cell did not do, as in "the cell did not {does} in 30 s".
    does: str
    met: Callable[[Ran], bool]


#: The cell went idle: everything it sent has arrived.
FINISHED = Until("finish", lambda ran: ran.finished_at > 0)


def printed(text: str) -> Until:
    """The cell's stdout has shown ``text``: it says where it has got to."""
    return Until(f"print {text!r}", lambda ran: text in ran.stdout)


def sent(msg_type: str) -> Until:
    """The cell has sent a message of ``msg_type``, a ``stream`` on either channel say."""
    return Until(f"send a {msg_type}", lambda ran: bool(ran.of(msg_type)))


def run_in(client: BlockingKernelClient, code: str) -> str:
    """Run ``code`` through a client of a kernel somebody else started; its output."""
    out: list[str] = []

    def keep(message: dict[str, Any]) -> None:
        if message["msg_type"] == "stream":
            out.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            out.append("\n".join(message["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=60, output_hook=keep)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


#: How the test talks to its kernels: over Unix sockets in a directory of the
#: kernel's own, not TCP. jupyter_client picks a TCP port by binding it and
#: letting it go, and the kernel binds it again a moment later; on a machine
#: where the suite's other workers, their kernels and Ray take ports all the
#: time, one of them now and then gets there first, and the kernel dies
#: "Address already in use" before it ever answers. Nobody else makes sockets
#: in the kernel's own directory.
_TRANSPORT = "ipc"


class _ReadableConnectionFile(KernelManager):
    """A manager whose connection file the kernel's own user can read.

    jupyter_client writes the file mode 0600 as whoever runs the test, and
    writes it again whenever it picks the kernel's ports, just before the
    launch; so it is handed to ``owner`` after every write rather than once.
    """

    owner: UnixUser | None = None

    def write_connection_file(self, **kwargs: Any) -> None:
        super().write_connection_file(**kwargs)
        if self.owner is not None:
            os.chown(self.connection_file, self.owner.uid, self.owner.gid)


class Kernel:
    """One ipykernel process with fluksio_nb loaded and a declared inventory.

    With ``user``, the kernel runs as that Unix user (the test must be root:
    see :mod:`tests.unix_users`), in a clean environment of that user's:
    HOME, and IPython's and Jupyter's directories in a temporary directory the
    user owns, no ``FLUKSIO_*`` from the test's own environment, the books
    kept by the kernel alone (``FLUKSIO_LEDGER=kernel``) and no config file,
    unless ``env`` says otherwise. ``env`` always goes on top, ``USER`` too.
    Without ``user``, the kernel has the test's own environment: its usage
    records, runtime files and temporary files go where the test's are, in
    places of the run's own (``conftest.py`` at the top of the checkout).

    ``provisioner`` names the kernel provisioner that launches it, as a
    kernelspec's ``metadata.kernel_provisioner`` does (the test's own user
    only): ``"fluksio-fair-share"`` is the one a Jupyter server with
    fluksio_nb uses.

    ``launched_by`` is a command the kernel's own is handed to, as its
    arguments, and which must end by running it (``exec "$@"``) so that the
    kernel is the process jupyter_client started: a kernel in a namespace of
    its own, say (:mod:`tests.small_shm`).
    """

    def __init__(
        self,
        *,
        user: UnixUser | None = None,
        launched_by: Sequence[str] = (),
        provisioner: str | None = None,
        **env: str,
    ) -> None:
        #: What this kernel was started with beyond the test's own environment.
        self.env = env
        #: Whom the kernel runs as; ``None`` for the test's own user.
        self.user = user
        #: The kernel's own directory, removed at shutdown: its sockets, its
        #: stacks, and for a kernel of another user its home and runtime files.
        self.own_dir: Path
        #: Where the kernel writes its threads' stacks when a cell is late (:meth:`stacks`).
        self._stacks: Path | None = None
        if user is None:
            # In the run's TMPDIR (the root conftest.py), gone with it even if
            # a test shuts the kernel down through its manager rather than here.
            self.own_dir = Path(tempfile.mkdtemp(prefix="fluksio-kernel-"))
            self.manager = KernelManager(
                kernel_name="python3", transport=_TRANSPORT, ip=str(self.own_dir / "ipc")
            )
            spec = self.manager.kernel_spec
            # The venv's own python, whatever kernelspec happens to be installed.
            spec.argv = [*launched_by, sys.executable, *spec.argv[1:]]
            if provisioner is not None:
                spec.metadata = {
                    **spec.metadata,
                    "kernel_provisioner": {"provisioner_name": provisioner},
                }
            try:
                self.manager.start_kernel(env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
            except BaseException:
                shutil.rmtree(self.own_dir, ignore_errors=True)
                raise
        else:
            self._start_as(user, env, launched_by)
        self.client = self.manager.client()
        self.client.start_channels()
        #: Every IOPub message read so far, whichever cell it belongs to.
        self.seen: list[dict[str, Any]] = []
        #: When each of ``seen`` arrived.
        self.seen_at: list[float] = []
        # A kernel that never got ready is nobody's to shut down but ours:
        # left, it would run on after the suite, its directory with it.
        try:
            self.client.wait_for_ready(timeout=60)
            self.pid = self.manager.provisioner.process.pid
            self._stacks = self.own_dir / "stacks"
            # One cell, so that the notebook's cell numbers are as a user's would be.
            self.run(
                "%load_ext fluksio_nb\n"
                "__import__('faulthandler').register(__import__('signal').SIGUSR2, "
                f"file=open({str(self._stacks)!r}, 'w'), all_threads=True)",
                check=True,
            )
        except BaseException:
            self.shutdown()
            raise

    def _start_as(self, user: UnixUser, env: dict[str, str], launched_by: Sequence[str]) -> None:
        own = Path(tempfile.mkdtemp(prefix=f"fluksio-kernel-{user.name}-", dir="/tmp"))
        self.own_dir = own
        places = {
            "IPYTHONDIR": own / "ipython",
            "JUPYTER_RUNTIME_DIR": own / "jupyter" / "runtime",
            "JUPYTER_DATA_DIR": own / "jupyter" / "data",
            "JUPYTER_CONFIG_DIR": own / "jupyter" / "config",
        }
        for place in [own, own / "jupyter", *places.values()]:
            place.mkdir(mode=0o700, exist_ok=True)
            os.chown(place, user.uid, user.gid)
        environ = user_environ(
            user,
            {
                **{name: str(place) for name, place in places.items()},
                "PYTHONUNBUFFERED": "1",
                # Named but never written: no config file of anyone's is read.
                "FLUKSIO_CONFIG": str(own / "fluksio_nb.json"),
                "FLUKSIO_LEDGER": "kernel",
                **env,
            },
        )
        runtime = places["JUPYTER_RUNTIME_DIR"]
        self.manager = _ReadableConnectionFile(
            kernel_name="python3",
            transport=_TRANSPORT,
            ip=str(runtime / "kernel-ipc"),
            connection_file=str(runtime / "kernel.json"),
        )
        self.manager.owner = user
        spec = self.manager.kernel_spec
        spec.argv = [*launched_by, *as_user(user), sys.executable, *spec.argv[1:]]
        try:
            self.manager.start_kernel(env=environ, cwd=str(own))
        except BaseException:
            shutil.rmtree(own, ignore_errors=True)
            raise

    def run(
        self, code: str, timeout: float = 120, check: bool = False, answers: list[str] | None = None
    ) -> Ran:
        """Run one cell; with ``answers``, as a front end that answers its input requests.

        Each prompt the cell shows is answered with the next of ``answers``,
        and recorded in the result's ``prompts``.
        """
        msg_id = self.client.execute(code, allow_stdin=answers is not None)
        between = None if answers is None else (lambda ran: self._answer(ran, answers))
        try:
            ran = self.messages_of(msg_id, timeout=timeout, between=between)
        except TimeoutError as late:
            raise TimeoutError(f"{late}\n{code}") from None
        ran.status = self.reply_to(msg_id)["content"]["status"]
        if check and ran.status != "ok":
            raise AssertionError(f"cell failed: {ran.error}\n{ran.stderr}\n{code}")
        return ran

    def messages_of(
        self,
        msg_id: str,
        *,
        until: Until = FINISHED,
        timeout: float = 30,
        past_idle: bool = False,
        between: Callable[[Ran], None] | None = None,
    ) -> Ran:
        """The IOPub messages of the cell ``msg_id``, read until ``until`` is met.

        The cell's messages already read while waiting on another cell (in
        ``seen``) count, in the order they arrived, then the channel is read on;
        everything read is kept in ``seen``, whichever cell it belongs to. The
        result holds the cell's messages but its status ones, and ``finished_at``
        once the cell went idle; its ``status`` is the shell reply's, not read here.

        Fails as soon as the cell goes idle without ``until`` met, unless
        ``past_idle``: a background job's output arrives after its cell ended.
        Fails too if ``timeout`` seconds pass first, saying what the cell showed.
        ``between`` is called with the result so far while the channel is quiet,
        every 50 ms at most: a front end answering input requests.
        """
        ran = Ran(status="unknown", msg_id=msg_id)
        for msg, at in zip(self.seen, self.seen_at, strict=True):
            self._keep(ran, msg, at)
        deadline = time.monotonic() + timeout
        while not until.met(ran):
            if ran.finished_at and not past_idle:
                raise AssertionError(f"the cell ended and did not {until.does}: {ran.so_far()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"the cell did not {until.does} in {timeout} s: {ran.so_far()}{self.stacks()}"
                )
            if between is not None:
                between(ran)
                left = min(left, 0.05)
            try:
                msg = self.client.get_iopub_msg(timeout=left)
            except queue.Empty:
                continue
            at = time.monotonic()
            self.seen.append(msg)
            self.seen_at.append(at)
            self._keep(ran, msg, at)
        return ran

    @staticmethod
    def _keep(ran: Ran, msg: dict[str, Any], at: float) -> None:
        if msg["parent_header"].get("msg_id") != ran.msg_id:
            return
        if msg["msg_type"] != "status":
            ran.messages.append(msg)
            ran.arrived.append(at)
        elif msg["content"]["execution_state"] == "idle":
            ran.finished_at = at

    def reply_to(self, msg_id: str, timeout: float = 10) -> dict[str, Any]:
        """The shell reply to the request ``msg_id``, skipping replies to earlier ones."""
        while True:
            reply = self.client.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def _answer(self, ran: Ran, answers: list[str]) -> None:
        while self.client.stdin_channel.msg_ready():
            request = self.client.stdin_channel.get_msg(timeout=1)
            if request["msg_type"] == "input_request":
                ran.prompts.append(request["content"])
                self.client.input(answers.pop(0))

    def facts(self, expression: str) -> Any:
        """Evaluate ``expression`` in the kernel and bring its JSON back."""
        return self.run(f"import json as _j\nprint(_j.dumps({expression}))", check=True).json()

    def start_job(self, cell: str, name: str) -> Ran:
        """Run a ``--background`` claimed cell and bind its job handle to ``name``."""
        started = self.run(cell, check=True)
        self.run(f"{name} = _", check=True)
        return started

    def unclaimed_and_claimed(
        self, setup: str, body: str, after: str, claim: str = "%%claim"
    ) -> tuple[Any, Any]:
        """What ``after`` says once ``body`` ran as a normal cell, and once as a claimed one.

        ``setup`` runs before each, so both start from the same state: a claimed
        cell should leave the kernel as the same cell unclaimed does, and warn
        of nothing on the way.
        """
        results = []
        for cell in (body, f"{claim}\n{body}"):
            self.run(setup, check=True)
            ran = self.run(cell, check=True)
            assert ran.stderr == "", ran.stderr
            results.append(self.facts(after))
        return results[0], results[1]

    def books(self) -> dict[str, Any]:
        return self.facts("__import__('fluksio_nb').accountant().snapshot()")

    def interrupt(self) -> None:
        self.manager.interrupt_kernel()

    def error_when_idle(self, msg_id: str, timeout: float = 30) -> str | None:
        """Read a started cell's messages until it is idle; the name of its error, if any."""
        error = self.messages_of(msg_id, timeout=timeout).error
        return error["ename"] if error else None

    def wait_for_output(self, msg_id: str, text: str, timeout: float = 30) -> None:
        """Read a started cell's IOPub messages until its stdout has shown ``text``.

        For a test that must act while the cell runs: what it printed says
        where it has got to. Fails if the cell ends first.
        """
        self.messages_of(msg_id, until=printed(text), timeout=timeout)

    def prints_while_running(self, magic: str, go: Path) -> Ran:
        """Run a cell under ``magic`` that prints, then waits for the file ``go``, then prints.

        The file is made only once the first line has been seen here, so a
        line held back until the cell ended would never be: the test fails
        at the wait, rather than on how long anything took.
        """
        msg_id = self.client.execute(
            f"{magic}\nprint('early', flush=True)\n{until_it_exists(go)}print('late')"
        )
        try:
            self.wait_for_output(msg_id, "early")
        finally:
            go.touch()
        return self.messages_of(msg_id)

    def stacks(self) -> str:
        """Where each of the kernel's threads is now, for a test to say why a cell was late."""
        if self._stacks is None:
            return ""
        try:
            os.kill(self.pid, signal.SIGUSR2)
        except OSError as error:
            return f"\n(no stacks: {error})"
        # Written from the signal's handler, all at once: a test that failed
        # already reads it once it is there and has stopped growing.
        said, deadline = "", time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.1)
            before, said = said, self._stacks.read_text(errors="replace")
            if said and said == before:
                break
        self._stacks.write_text("")
        return f"\nthe kernel's threads, as the wait ended:\n{said}"

    def shutdown(self) -> None:
        self.client.stop_channels()
        try:
            self.manager.shutdown_kernel(now=True)
        finally:
            shutil.rmtree(self.own_dir, ignore_errors=True)


@contextmanager
def started_kernel(
    place: Path | None = None,
    *,
    user: UnixUser | None = None,
    launched_by: Sequence[str] = (),
    provisioner: str | None = None,
    **env: str,
) -> Iterator[Kernel]:
    """A :class:`Kernel` for the length of a ``with`` block, shut down however it ends.

    With ``place``, a directory of the test's, the kernel's config file
    (``fluksio_nb.json``, named but never written), its books service's directory (``ledger/``)
    and its usage records (under ``jupyter-data/``) are there, unless ``env``
    names others: nothing of the developer's is read or added to, and no
    book of the machine's is touched. ``user``,
    ``launched_by`` and ``env`` are the kernel's own, as for :class:`Kernel`.
    A module's kernel is::

        @pytest.fixture(scope="module")
        def kernel(tmp_path_factory):
            with started_kernel(tmp_path_factory.mktemp("kernel"), FLUKSIO_CPUS="2") as k:
                yield k
    """
    if place is not None:
        env = {
            "FLUKSIO_CONFIG": str(place / "fluksio_nb.json"),
            "FLUKSIO_LEDGER": str(place / "ledger"),
            # A module's kernel starts before the test's own settings are in
            # place; without this its records went with every other module's,
            # and its expected waits were read from theirs.
            "JUPYTER_DATA_DIR": str(place / "jupyter-data"),
            **env,
        }
    kernel = Kernel(user=user, launched_by=launched_by, provisioner=provisioner, **env)
    try:
        yield kernel
    finally:
        kernel.shutdown()


#: Lines of a cell that start three processes and leave them running, then print
#: their pids on one line: its own child, one in a session of its own, and one a
#: shell put in the background and left an orphan.
LEAVES_THREE_RUNNING = """import os, subprocess
pids = [
    subprocess.Popen(["sleep", "600"]).pid,
    subprocess.Popen(["sleep", "600"], start_new_session=True).pid,
    int(os.popen("sleep 600 > /dev/null 2>&1 & echo $!").read()),
]
print(*pids, flush=True)
"""


def until_it_exists(path: Path) -> str:
    """Lines of a cell that wait for the file ``path``, which the test makes when it may go on."""
    return f"import os, time\nwhile not os.path.exists({str(path)!r}):\n    time.sleep(0.01)\n"


@contextmanager
def shut_down_at_the_end(start: Callable[..., Kernel]) -> Iterator[Callable[..., Kernel]]:
    """``start``, whose every kernel is shut down when the block ends, in any case.

    Killed ones too: a kernel that a test killed has left its connection file
    (and, run as another user, its directory) for its manager to remove.
    """
    with ExitStack() as stack:

        def started(*args: Any, **kwargs: Any) -> Kernel:
            kernel = start(*args, **kwargs)
            stack.callback(kernel.shutdown)
            return kernel

        yield started
