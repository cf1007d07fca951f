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
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import KernelManager


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


class Kernel:
    """One ipykernel process with fluksio_nb loaded and a declared inventory."""

    def __init__(self, **env: str) -> None:
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        #: What this kernel was started with beyond the test's own environment.
        self.env = env
        self.manager = KernelManager(kernel_name="python3")
        # The venv's own python, whatever kernelspec happens to be installed.
        self.manager.kernel_spec.argv[0] = sys.executable
        self.manager.start_kernel(env=environ)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self.pid = self.manager.provisioner.process.pid
        #: Every IOPub message read so far, whichever cell it belongs to.
        self.seen: list[dict[str, Any]] = []
        self.run("%load_ext fluksio_nb", check=True)

    def run(
        self, code: str, timeout: float = 120, check: bool = False, answers: list[str] | None = None
    ) -> Ran:
        """Run one cell; with ``answers``, as a front end that answers its input requests.

        Each prompt the cell shows is answered with the next of ``answers``,
        and recorded in the result's ``prompts``.
        """
        msg_id = self.client.execute(code, allow_stdin=answers is not None)
        ran = Ran(status="unknown", msg_id=msg_id)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the cell did not finish in {timeout} s:\n{code}")
            if answers is not None:
                self._answer(ran, answers)
                try:
                    msg = self.client.get_iopub_msg(timeout=min(left, 0.05))
                except queue.Empty:
                    continue
            else:
                msg = self.client.get_iopub_msg(timeout=left)
            self.seen.append(msg)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status":
                if msg["content"]["execution_state"] == "idle":
                    break
                continue
            ran.messages.append(msg)
            ran.arrived.append(time.monotonic())
        ran.finished_at = time.monotonic()
        while True:
            reply = self.client.get_shell_msg(timeout=10)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        ran.status = reply["content"]["status"]
        if check and ran.status != "ok":
            raise AssertionError(f"cell failed: {ran.error}\n{ran.stderr}\n{code}")
        return ran

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
        ename = None
        while True:
            msg = self.client.get_iopub_msg(timeout=timeout)
            self.seen.append(msg)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "error":
                ename = msg["content"]["ename"]
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return ename

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)
