"""A real JupyterLab (or Notebook 7) in a real headless Chromium, for tests that look at
what a user sees.

Everything here is meant to be reused by any browser test of fluksio_nb (the
in-notebook widgets now; the status bar and side panel later):

- :class:`JupyterLab` starts this venv's ``jupyter-lab`` executable itself, so
  the PID it holds is the server's, on a free port with a random token, and
  stops it by that PID. The server and its kernels see only directories made
  for the test (config, data, runtime, settings, workspaces, IPython), plus
  what the venv itself installed (lab extensions, server extensions), and a
  declared inventory (``FLUKSIO_CPUS``/``GPUS``/``RAM``/``RESERVE_CPUS``) and
  books of their own, so neither the developer's ``~/.jupyter`` nor other
  kernels on the machine change what a test sees.
- :class:`Notebook` drives one notebook tab the way a person does: open it,
  wait until its kernel is idle, Run > Run All Cells, save.

The same two classes drive Notebook 7 (``JupyterLab(home, app="jupyter-notebook")``).
Notebook 7 is built from JupyterLab's own components: the notebook panel, its
cells, outputs, execution indicator, the main menu and its command ids are
the same. What differs is where a notebook is opened (``notebooks/<path>``, one
document per page, against JupyterLab's ``lab/.../tree/<path>``), and which
application class reads the settings options; :meth:`JupyterLab.notebook_url`
and :meth:`JupyterLab.start` hold those differences, and nothing else does.
- :func:`launch_chromium` starts Debian's Chromium through Playwright with the
  flags that work on this kind of machine. ``playwright install`` is never
  needed (nor possible here: it downloads its own browser).

Waiting for the kernel to be idle before running anything matters: cells run
with Shift+Enter too early were seen to flake, and Run All Cells, once the
kernel is idle, did not.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


#: A small machine, declared, so tests do not depend on the one they run on.
DEFAULT_INVENTORY = {
    "FLUKSIO_CPUS": "2",
    "FLUKSIO_GPUS": "2",
    "FLUKSIO_RAM": "4G",
    "FLUKSIO_RESERVE_CPUS": "0",
}

REPO = Path(__file__).resolve().parents[2]
#: Screenshots and anything else a person may want to look at after a run.
OUTPUT = REPO / "test-output" / "browser"


def missing_for_browser_tests() -> str | None:
    """What is missing for a real browser test, in words that say how to get it; None if nothing."""
    if not CHROMIUM.exists():
        return (
            f"Debian's Chromium is not installed at {CHROMIUM}: "
            "apt-get update && apt-get install -y chromium chromium-driver"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed: pip install playwright"
    return None


def launch_chromium(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


def launch_chromium_profile(playwright: Any, folder: Path) -> Any:
    """Chromium with a profile kept in ``folder``: a browser context whose pages share a
    disk cache, at the size the tests' screenshots are taken at.

    Its pages ask for reduced motion, as a user may: a running claim's dot
    then does not pulse, which kept Chromium drawing 60 frames a second for as
    long as a test's claim ran (a JupyterLab page with a running claim: 0.32 of
    a core, against 0.07 without the pulse, measured). The test of the pulse's
    contrast asks for motion on its own page (``page.emulate_media``).
    """
    return playwright.chromium.launch_persistent_context(
        str(folder),
        executable_path=str(CHROMIUM),
        args=CHROMIUM_ARGS,
        viewport={"width": 1280, "height": 1000},
        reduced_motion="reduce",
    )


#: How often :func:`wait_in_page` checks its condition, in ms.
POLL_MS = 100


def wait_in_page(page: Any, expression: str, *, timeout_ms: float, arg: Any = None) -> Any:
    """``page.wait_for_function``, checking every :data:`POLL_MS`.

    Playwright's default checks on every animation frame, and so has the page
    drawn 60 frames a second for as long as the wait lasts: 0.15 of a core in
    headless Chromium (measured), against none at this pace.
    """
    return page.wait_for_function(expression, arg=arg, timeout=timeout_ms, polling=POLL_MS)


class JupyterLab:
    """One JupyterLab server, private to a test session, with this venv's kernel."""

    def __init__(
        self,
        home: Path,
        inventory: dict[str, str | None] | None = None,
        app: str = "jupyter-lab",
        **env: str,
    ) -> None:
        """``app`` is the venv's server executable: ``jupyter-lab``, or ``jupyter-notebook``
        for Notebook 7, which takes the same options and serves notebooks at ``notebooks/``."""
        if app not in ("jupyter-lab", "jupyter-notebook"):
            raise ValueError(f"app is jupyter-lab or jupyter-notebook, not {app!r}")
        self.home = home
        self.app = app
        self.root = home / "notebooks"
        #: The port the server listens on, once :meth:`start` has read it.
        self.port: int | None = None
        self.token = secrets.token_hex(16)
        self.log_path = home / f"{app}.log"
        self.env = self._environment({**DEFAULT_INVENTORY, **(inventory or {}), **env})
        self.process: subprocess.Popen | None = None
        #: Counts the changes :meth:`use_theme` made: a page loaded before one
        #: shows the old settings, and is no page to open the next notebook in.
        self.settings_version = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}?token={self.token}"

    def notebook_url(self, name: str) -> str:
        """Where this app opens the notebook ``name`` on its own."""
        if self.app == "jupyter-notebook":
            # One document per page: there are no other tabs to restore.
            return self.url(f"notebooks/{name}")
        # A workspace of its own, so tabs another test left open are not restored here.
        return self.url(f"lab/workspaces/{Path(name).stem}/tree/{name}")

    def _environment(self, extra: dict[str, str | None]) -> dict[str, str]:
        dirs = {
            name: self.home / name
            for name in ("config", "data", "settings", "workspaces", "ipython", "ledger")
        }
        # The kernels' sockets are files named after their connection files
        # (see the transport in :meth:`start`), and a socket's path holds 107
        # bytes: a test's home is too deep for them, so the runtime directory,
        # where both go, is a short one of its own, removed by :meth:`stop`.
        dirs["runtime"] = Path(tempfile.mkdtemp(prefix="fluksio-lab-"))
        for path in [self.root, *dirs.values()]:
            path.mkdir(parents=True, exist_ok=True)
        # This venv's python as the one kernel, whatever else is installed for the user.
        spec = dirs["data"] / "kernels" / "python3"
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "Python 3 (ipykernel)",
                    "language": "python",
                }
            )
        )
        # A news prompt would sit over the notebook; a test has no use for it.
        news = dirs["settings"] / "@jupyterlab" / "apputils-extension"
        news.mkdir(parents=True, exist_ok=True)
        (news / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False})
        )
        # Every page load asks the server whether JupyterLab needs a rebuild,
        # and to answer it runs `yarn config` and a node version check: about
        # 0.4 CPU-s a page, for a question no test asks (the extension is
        # prebuilt). Page config from the config directory turns the check off.
        labconfig = dirs["config"] / "labconfig"
        labconfig.mkdir(parents=True, exist_ok=True)
        (labconfig / "page_config.json").write_text(
            json.dumps({"buildCheck": False, "buildAvailable": False})
        )
        # Without this, a notebook opened before the kernel specs have loaded
        # asks which kernel to start, in a dialog over the page.
        tracker = dirs["settings"] / "@jupyterlab" / "notebook-extension"
        tracker.mkdir(parents=True, exist_ok=True)
        (tracker / "tracker.jupyterlab-settings").write_text(
            json.dumps({"autoStartDefaultKernel": True})
        )
        self.settings_dir, self.workspaces_dir = dirs["settings"], dirs["workspaces"]
        environ = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("JUPYTER", "FLUKSIO_", "IPYTHON"))
        }
        every = {
            **environ,
            "JUPYTER_CONFIG_DIR": str(dirs["config"]),
            "JUPYTER_DATA_DIR": str(dirs["data"]),
            "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
            "IPYTHONDIR": str(dirs["ipython"]),
            "FLUKSIO_CONFIG": str(self.home / "fluksio_nb.json"),
            "FLUKSIO_LEDGER": str(dirs["ledger"]),
            "PYTHONUNBUFFERED": "1",
            # Every page load asks the server for nbconvert's formats (the
            # File > Save and Export As menu), and to answer, nbconvert reads
            # its config and makes one of each exporter to see whether it is
            # enabled: 0.2 CPU-s of the server's 1.0 a page (measured), for a
            # menu no test opens. With this set it lists them as installed.
            "NBCONVERT_DISABLE_CONFIG_EXPORTERS": "1",
            **extra,
        }
        # A None in ``extra`` takes a variable away: a server that must detect
        # its cards is started without the FLUKSIO_GPUS that declares them.
        return {key: value for key, value in every.items() if value is not None}

    def start(self, timeout: float = 60) -> JupyterLab:
        argv = [
            str(Path(sys.executable).parent / self.app),
            "--no-browser",
            f"--ServerApp.token={self.token}",
            "--ServerApp.ip=127.0.0.1",
            # The server binds a port the OS picks and keeps it: one picked
            # here and let go could be taken by another process before the
            # server bound it, and port_retries=0 would end the server.
            "--ServerApp.port=0",
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={self.root}",
            # Kernels over Unix sockets, as tests.kernels starts its own: over
            # TCP jupyter_client picks each port by binding it and letting it
            # go, and with other suites' kernels, servers and Ray taking ports
            # too, a kernel now and then died "Address already in use" before
            # it ever answered, and the page waited for it in vain.
            "--KernelManager.transport=ipc",
        ]
        # Either server loads both apps as extensions, and both answer at the
        # same settings URL, so which one reads the settings depends on load
        # order: both are pointed at the test's own directories. Both pages
        # show their app as window.jupyterapp: through it a page that has
        # JupyterLab loaded opens the next notebook
        # (:meth:`Notebook.open_in_the_loaded_page`), and either asks the
        # server which kernels still run (the stale monitor's test).
        for app_class in ("LabApp", "JupyterNotebookApp"):
            argv += [
                f"--{app_class}.user_settings_dir={self.settings_dir}",
                f"--{app_class}.workspaces_dir={self.workspaces_dir}",
                f"--{app_class}.expose_app_in_browser=True",
            ]
        if os.geteuid() == 0:
            argv.append("--allow-root")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.port = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.app} exited with {self.process.returncode}; its log:\n{self.log()}"
                )
            self.port = self.port or self._listening_on()
            with contextlib.suppress(OSError, urllib.error.URLError):
                if self.port is not None:
                    self.api("GET", "api/status")
                    return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.app} did not answer within {timeout} s; its log:\n{self.log()}")

    def _listening_on(self) -> int | None:
        """The port the server wrote in its info file, once it has (after it bound it)."""
        assert self.process is not None
        info = Path(self.env["JUPYTER_RUNTIME_DIR"]) / f"jpserver-{self.process.pid}.json"
        with contextlib.suppress(OSError, ValueError):
            return int(json.loads(info.read_text())["port"])
        return None

    def stop(self) -> None:
        """End the server by its PID, and its kernels with it."""
        try:
            self._stop()
        finally:
            shutil.rmtree(self.env["JUPYTER_RUNTIME_DIR"], ignore_errors=True)

    def _stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(OSError, urllib.error.URLError):
            self.shutdown_kernels()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def api(self, method: str, path: str, body: Any = None) -> Any:
        request = urllib.request.Request(
            f"{self.base_url}/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
        return json.loads(text) if text else None

    def shutdown_kernels(self) -> None:
        """End every kernel, so one test's claims never hold the next test's share."""
        for kernel in self.api("GET", "api/kernels"):
            self.api("DELETE", f"api/kernels/{kernel['id']}")

    def write_notebook(self, name: str, cells: list[str]) -> str:
        """A notebook of code cells, for this venv's kernel; returns its path for :meth:`url`."""
        notebook = {
            "cells": [
                {
                    "cell_type": "code",
                    "execution_count": None,
                    "id": f"cell-{index}",
                    "metadata": {},
                    "outputs": [],
                    "source": source,
                }
                for index, source in enumerate(cells)
            ],
            "metadata": {
                "kernelspec": {
                    "display_name": "Python 3 (ipykernel)",
                    "language": "python",
                    "name": "python3",
                }
            },
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        (self.root / name).write_text(json.dumps(notebook, indent=1))
        return name

    def use_theme(self, theme: str) -> None:
        """Make ``theme`` ("JupyterLab Dark", "JupyterLab Light") the one pages load with."""
        self.api(
            "PUT",
            "lab/api/settings/@jupyterlab/apputils-extension:themes",
            {"raw": json.dumps({"theme": theme})},
        )
        self.settings_version += 1

    def read_notebook(self, name: str, timeout: float = 10) -> dict[str, Any]:
        """The notebook as saved, once whole: a save still being written reads as nothing."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return json.loads((self.root / name).read_text())
            except json.JSONDecodeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def until_exists(path: Path) -> str:
    """A cell body that runs until ``path`` exists: a claim held as long as a test needs it."""
    return f"import os, time\nwhile not os.path.exists({str(path)!r}):\n    time.sleep(0.1)\n"


def in_background(client: Any, line: str, body: str, name: str) -> None:
    """Run ``%%claim LINE --background`` with ``body`` in ``client``, its job bound to ``name``."""
    from tests.kernels import run_in

    run_in(client, f"%%claim {line} --background\n{body}")
    run_in(client, f"{name} = _")


def notebook_kernel(lab: JupyterLab, path: str) -> Any:
    """A client on the kernel of a notebook session started through the server, with
    fluksio_nb loaded: another tab, or another user, as the page under test sees it."""
    from jupyter_client import BlockingKernelClient

    from tests.kernels import run_in

    (lab.root / Path(path).parent).mkdir(parents=True, exist_ok=True)
    lab.write_notebook(path, [])
    session = lab.api(
        "POST",
        "api/sessions",
        {"path": path, "name": Path(path).name, "type": "notebook", "kernel": {"name": "python3"}},
    )
    runtime = Path(lab.env["JUPYTER_RUNTIME_DIR"])
    client = BlockingKernelClient(
        connection_file=str(runtime / f"kernel-{session['kernel']['id']}.json")
    )
    client.load_connection_file()
    # No heartbeat: on a loaded machine a kernel still starting misses its first beats
    # (1 s each), and the client takes it for dead. A dead kernel still fails the wait.
    client.start_channels(hb=False)
    client.wait_for_ready(timeout=60)
    run_in(client, "%load_ext fluksio_nb")
    return client


#: Every document in JupyterLab's main area closed, unsaved.
CLOSE_EVERY_DOCUMENT_JS = """() => {
  for (const widget of Array.from(window.jupyterapp.shell.widgets('main'))) {
    if (widget.context) widget.context.model.dirty = false;
    widget.dispose();
  }
}"""


def close_every_document(page: Any) -> None:
    """Close what the page's JupyterLab has open, unsaved, as nobody would be asked to."""
    page.evaluate(CLOSE_EVERY_DOCUMENT_JS)


class Notebook:
    """One notebook open in a JupyterLab tab or a Notebook 7 page, driven through its menus."""

    def __init__(self, lab: JupyterLab, page: Any, name: str) -> None:
        self.lab, self.page, self.name = lab, page, name

    def open(self, timeout_ms: float = 60_000) -> Notebook:
        """Load the page with this notebook open alone in it."""
        self.page.goto(self.lab.notebook_url(self.name))
        self.panel.locator(".jp-Cell").first.wait_for(timeout=timeout_ms)
        self.wait_until_idle(timeout_ms)
        return self

    def open_in_the_loaded_page(self, timeout_ms: float = 60_000) -> Notebook:
        """Open it alone in the JupyterLab the page has loaded, as :meth:`open` shows it.

        Loading JupyterLab again costs about 2 CPU-s more, in Chromium and the
        server. The documents the page had open are closed first, unsaved, so
        that the page shows this notebook alone.
        """
        close_every_document(self.page)
        self.page.evaluate(
            "path => window.jupyterapp.commands.execute('docmanager:open', {path})"
            ".then(() => undefined)",
            self.name,
        )
        self.panel.locator(".jp-Cell").first.wait_for(timeout=timeout_ms)
        self.wait_until_idle(timeout_ms)
        return self

    def wait_until_idle(self, timeout_ms: float = 60_000) -> None:
        """Until the notebook's kernel has started, and both it and the page say it is idle."""
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if self.kernel_state() == "idle" and self.page.evaluate(
                """() => {
                    if (document.querySelector('.jp-Dialog')) return false;
                    const ind = document.querySelector(
                        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator');
                    return !!ind && ind.getAttribute('data-status') === 'idle';
                }"""
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}'s kernel was not idle within {timeout_ms / 1000:g} s "
                    f"(the server says {self.kernel_state()!r}); the server's log:\n"
                    f"{self.lab.log()[-3000:]}"
                )
            time.sleep(0.2)

    def kernel_state(self) -> str | None:
        """What the server says this notebook's kernel is doing; None before it has one."""
        for session in self.lab.api("GET", "api/sessions"):
            if session.get("path") == self.name and session.get("kernel"):
                return session["kernel"].get("execution_state")
        return None

    def menu(self, menu: str, command: str) -> None:
        """Click a top menu, then the item that runs ``command`` (a JupyterLab command id)."""
        # The menu bar's own id: the panel holding it is #jp-menu-panel in
        # JupyterLab and #menu-panel in Notebook 7.
        self.page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=menu).first.click()
        self.page.locator(f'.lm-Menu-item[data-command="{command}"]').first.click()

    def run_all(self) -> None:
        self.menu("Run", "runmenu:run-all")

    def run_cell(self, index: int, timeout_ms: float = 30_000) -> None:
        """Run the ``index``-th cell alone, from the Run menu; returns once it has started.

        The cell is selected by its prompt and run only once the page says it
        is the active one: a key pressed into an editor that a busy page has
        not focused yet runs nothing, or another cell.
        """
        cell = self.panel.locator(".jp-Cell").nth(index)
        cell.locator(".jp-InputPrompt").click()
        wait_in_page(
            self.page,
            "cell => cell.classList.contains('jp-mod-active')",
            arg=cell.element_handle(),
            timeout_ms=timeout_ms,
        )
        self.menu("Run", "notebook:run-cell")
        # Started: "[*]", or already a number, where "[ ]" was.
        wait_in_page(
            self.page,
            "p => /[*\\d]/.test(p.textContent)",
            arg=cell.locator(".jp-InputPrompt").element_handle(),
            timeout_ms=timeout_ms,
        )

    def wait_until_ran(self, index: int, timeout_ms: float = 60_000) -> None:
        """Until the ``index``-th cell has run to its end: its prompt shows its number.

        The kernel's idle, as the server and the page report it, may still be
        the one from before the cell began, on a loaded machine. A cell run
        then reached the kernel while this one was ending in an error, and the
        kernel dropped it, as it drops whatever was queued behind an error.
        """
        prompt = self.panel.locator(".jp-Cell").nth(index).locator(".jp-InputPrompt")
        wait_in_page(
            self.page,
            "p => /\\[\\d+\\]/.test(p.textContent)",
            arg=prompt.element_handle(),
            timeout_ms=timeout_ms,
        )

    def save(self, timeout_ms: float = 30_000) -> None:
        """Save, and wait until the server holds the saved file and the page no unsaved mark."""
        before = self.lab.api("GET", f"api/contents/{self.name}?content=0")["last_modified"]
        self.menu("File", "docmanager:save")
        deadline = time.monotonic() + timeout_ms / 1000
        while self.lab.api("GET", f"api/contents/{self.name}?content=0")["last_modified"] == before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} was not saved within {timeout_ms / 1000:g} s")
            time.sleep(0.1)
        wait_in_page(
            self.page, "() => !document.querySelector('.jp-mod-dirty')", timeout_ms=timeout_ms
        )

    @property
    def panel(self) -> Any:
        """The notebook on show: other notebooks' panels stay in the page, hidden."""
        return self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")

    def output_of(self, index: int) -> Any:
        """The output area of the ``index``-th cell."""
        return self.panel.locator(".jp-Cell").nth(index).locator(".jp-OutputArea")

    def wait_for(self, index: int, selector: str, timeout_ms: float = 60_000) -> Any:
        """The element matching ``selector`` in cell ``index``'s output, once there.

        A cell that fails instead says so at once, with its output, rather than
        leaving the test to time out.
        """
        output = self.output_of(index)
        error = output.locator('[data-mime-type="application/vnd.jupyter.stderr"]')
        found = output.locator(selector)
        found.or_(error).first.wait_for(timeout=timeout_ms)
        if not found.count() and error.count():
            raise AssertionError(f"cell {index} failed:\n{output.inner_text()}")
        return found

    def screenshot(self, name: str) -> Path:
        OUTPUT.mkdir(parents=True, exist_ok=True)
        path = OUTPUT / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


def phases_until_the_record(output: Any, timeout_s: float = 60) -> tuple[list[str], Any]:
    """Every phase the claim widget in ``output`` showed, and the record that took its place.

    ``output`` is a cell's output area (a locator). A claim's live widget is
    replaced by its record, a ``.fluksio-status``, when the claim ends; the
    record is returned as a locator, once there and the widget gone.
    """
    seen: list[str] = []
    claim, record = output.locator(".fluksio-claim"), output.locator(".fluksio-status")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # Read without waiting: the widget may be gone between two looks.
        for phase in claim.evaluate_all("all => all.map(e => e.dataset.phase)"):
            if phase and (not seen or seen[-1] != phase):
                seen.append(phase)
        if record.count() and not claim.count():
            return seen, record
        time.sleep(0.1)
    raise AssertionError(f"no record took the claim's place; it showed {seen}")


#: "300.0MB" as the record says it: decimal units, as pydantic's ByteSize writes them.
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def peak_rss_of(record_text: str) -> int:
    """The bytes a record's ``peak RSS 314.6MB`` says."""
    import re

    found = re.search(r"peak RSS (\d+(?:\.\d+)?)([KMGT]?B)\b", record_text)
    if found is None:
        raise AssertionError(f"the record says no peak RSS: {record_text!r}")
    return int(float(found[1]) * _UNITS[found[2]])


def history_plot_moves(notebook: Any, page: Any) -> None:
    """``%claims``'s history plot gains points while shown, against 0-100% and 0-total memory.

    ``notebook`` and ``page`` are the tests' fixtures of those names, in
    whichever app the test drives.
    """
    nb = notebook("history.ipynb", ["%load_ext fluksio_nb", "%claims"])
    nb.run_all()
    monitor = nb.wait_for(1, ".fluksio-monitor")
    cpu = monitor.locator("[data-field=history-cpu]")
    cpu.wait_for(timeout=60_000)
    first = int(cpu.get_attribute("data-points"))
    # A point every two seconds while the monitor is shown: wait for two more.
    wait_in_page(
        page.page,
        """(first) => {
          const svg = document.querySelector('.fluksio-monitor [data-field=history-cpu]');
          return svg && Number(svg.dataset.points) >= first + 2;
        }""",
        arg=first,
        timeout_ms=60_000,
    )
    axis = [t.strip() for t in cpu.locator("text").all_text_contents()]
    assert axis[:3] == ["100%", "50%", "0%"], axis
    assert axis[3:6] == ["10 min ago", "5 min ago", "now"], axis
    memory = monitor.locator("[data-field=history-memory]")
    top, half, bottom = [t.strip() for t in memory.locator("text").all_text_contents()][:3]
    assert top.endswith("GB") and half.endswith("B") and bottom == "0", (top, half, bottom)
    said = monitor.locator("[data-field=host-memory]").inner_text()
    assert said.endswith(" used") and "/" in said, said
    assert " outside claims" in monitor.locator("[data-field=host-cpu]").inner_text()
    assert monitor.locator("[data-field=kernel-rss]").inner_text().startswith("RSS ")
    nb.screenshot(f"monitor-history-{nb.lab.app}")


def scroll_to(found: Any) -> None:
    """Scroll ``found`` (a locator) into view, for a screenshot of it.

    The panel and the monitor draw their lists again as the books change:
    playwright's ``scroll_into_view_if_needed`` finds the element, then waits
    for it to be still, and failed "Element is not attached to the DOM" when
    a redraw replaced it in between. Found and scrolled in one call into the
    page (``evaluate_all`` looks the locator up there), there is no between.
    """
    found.evaluate_all("all => all.forEach(e => e.scrollIntoView({block: 'center'}))")


def stray_text(element: Any) -> list[str]:
    """The bare text nodes directly inside ``element``, a locator on a widget's root.

    The widgets build their sections as elements, so text there is something
    drawn by mistake: the monitor once showed an absent section as "null".
    """
    return element.evaluate(
        "e => [...e.childNodes].filter(n => n.nodeType === Node.TEXT_NODE).map(n => n.textContent)"
    )


def not_notebook7s_own(errors: list[str]) -> list[str]:
    """The page's errors, less the one Notebook 7 itself throws on every page load.

    Notebook 7.6's keyboard-shortcuts settings code throws this TypeError as
    the page loads, and still does with every installed extension but
    Notebook's own disabled: it is not ours to fix. Hiding every error would
    hide ours too, so only that message, thrown from Notebook 7's own bundle,
    is left out.
    """
    own = "TypeError: Cannot read properties of undefined (reading 'schema')"

    def is_own(error: str) -> bool:
        lines = error.splitlines()
        return len(lines) > 1 and lines[0] == own and "/static/notebook/notebook_core." in lines[1]

    return [error for error in errors if not is_own(error)]


#: A label no front end may render as HTML: it would open a dialog.
HOSTILE = "<img src=x onerror=alert(1)>"


def memory_hog(label: str) -> str:
    """A claimed cell that holds 300 MiB for 4 s, long enough to be seen live."""
    # The block is local to a function: a name the cell binds is sent back to
    # the kernel, which would itself take memory in the worker.
    return (
        f"%%claim cpus=1 ram=2G --label '{label}'\n"
        "import time\n"
        "def hog():\n"
        "    block = bytearray(300 * 2**20)\n"
        "    for i in range(0, len(block), 4096):\n"
        "        block[i] = 1\n"
        "    time.sleep(4)\n"
        "hog()"
    )


#: Every visible piece of text under ``root``, with the contrast of its colour on what is
#: behind it. Translucent colours and backgrounds are laid over what is under them, as
#: the browser paints them; a colour the browser gives in a form not parsed here is
#: reported with a ratio of 0, so it fails loudly rather than passing unseen.
CONTRAST_JS = """
(root) => {
  const parse = value => {
    const m = /^rgba?\\(([^)]+)\\)$/.exec(value.trim());
    if (!m) return null;
    const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (top, under) => under.map((v, i) => top[i] * top[3] + v * (1 - top[3]));
  const behind = element => {
    const layers = [];
    for (let e = element; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) {
        layers.push(c);
        if (c[3] >= 1) break;
      }
    }
    let colour = [255, 255, 255];
    for (const layer of layers.reverse()) colour = over(layer, colour);
    return colour;
  };
  const luminance = rgb => {
    const [r, g, b] = rgb.map(v => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const found = [];
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const text = node.textContent.trim();
    const element = node.parentElement;
    if (!text || !element.getClientRects().length) continue;
    const style = getComputedStyle(element);
    const raw = element instanceof SVGElement ? style.fill : style.color;
    const colour = parse(raw);
    const back = behind(element);
    let ratio = 0;
    if (colour) {
      const [a, b] = [luminance(over(colour, back)), luminance(back)];
      ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    }
    const cls = element.getAttribute('class') || element.tagName;
    found.push({ text: text.slice(0, 50), cls, colour: raw, ratio });
  }
  return found;
}
"""


def evaluate_each(found: Any, function: str) -> list[Any]:
    """``function`` (JavaScript, of one element) of every element ``found`` matches, in one go.

    One call in the page, so that every element is read as it is at one moment.
    The widgets redraw by replacing their elements: read one at a time
    (``locator.all()``, then each one's ``evaluate``, two calls into the page
    apart), an element could be replaced between being found and being read,
    and a detached element's computed style is empty, its contrast 0. Beside
    another whole suite a check of the bars' contrast once waited 30 s in vain
    for every bar to read above 0: this is the way found that it could, each
    look at ten bars being twenty calls into a page slowed by the load.
    """
    return found.evaluate_all(f"elements => elements.map(element => ({function})(element))")


def contrast_failures(found: Any) -> list[dict[str, Any]]:
    """The texts under ``found`` (a locator) that read below 4.5:1; fails if it has no text."""
    texts = [text for texts in evaluate_each(found, CONTRAST_JS) for text in texts]
    assert texts, f"no text found under {found}"
    return [text for text in texts if text["ratio"] < 4.5]
