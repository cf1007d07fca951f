"""Setting a machine up for books every user shares: ``fluksio-nb machine init|status|remove``.

An admin runs ``init`` once, as root. It writes the machine's config, makes
the directory usage records go to, and starts the books service: as a
systemd unit where systemd runs, or as a detached process otherwise (a
container, a test). From then on every kernel of every user finds the
service's socket in the run directory and uses it, with no per-user
configuration; without it, each user keeps books of their own.

Where things go, under a prefix that is ``/`` on a real machine (tests use
a temporary one):

- ``run/fluksio_nb/books.sock``: the service's socket. ``/run`` is a tmpfs,
  so a reboot clears the live state with the claims it described.
- ``etc/fluksio_nb/machine.json``: the admin's config, root's to write:
  who may use the books, who may cancel anyone's claim, each user's cap,
  and the inventory where detection is not wanted.
- ``var/lib/fluksio_nb/usage``: sticky and writable by the users of the
  books, so each writes records that only they own (:mod:`fluksio_nb.usage`).
- ``var/lib/fluksio_nb/state``: root's alone (0700): the ticket numbers the
  service gave out, which must outlive a reboot (:mod:`.state`). Whose each
  running claim is goes in ``run/fluksio_nb/claims.json``, root's alone
  (0600): a reboot ends those claims with their kernels.

Root writes, renames and changes modes here, so nothing on the way is
trusted that another user could have made or could change, and ``remove``
removes only what ``init`` wrote down that it made (:mod:`.prefix`).
The service is started from ``/``, isolated from the environment (``python -I``).
``status`` says which books a user's kernels use, and the admin's rules in
force on the machine's: time limits, idle cards, where the metrics are.

It is long because ``machine.json`` is validated here, every field with an
error that says what to write, beside the commands that read it.
"""

from __future__ import annotations

import contextlib
import grp
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator

from fluksio_nb.machine.books import MachineBooks
from fluksio_nb.machine.caps import Cap
from fluksio_nb.machine.prefix import (
    MachineSetupError,
    identity,
    read_made,
    root_dir,
    trusted_prefix,
    write_made,
)
from fluksio_nb.machine.run_dir import DEFAULT_RUN_DIR, MARKER_NAME, SOCKET_NAME
from fluksio_nb.resources import explain

if TYPE_CHECKING:
    from fluksio_nb.machine.service import DeathsReader

UNIT_NAME = "fluksio-nb.service"
#: Beside machine.json: what ``init`` made, for ``remove`` to remove and nothing else.
MADE_NAME = "made.json"


class UserCap(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: int | None = Field(default=None, ge=0)
    gpus: int | None = Field(default=None, ge=0)
    ram: ByteSize | None = None
    #: The longest one claim may run, from its grant (:mod:`.time_limits`).
    max_hours: float | None = None

    @field_validator("max_hours", mode="before")
    @classmethod
    def _positive_hours(cls, value: Any) -> Any:
        # A number in JSON; true is not one hour, nor is "8" a number.
        if value is None:
            return value
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < math.inf
        ):
            raise ValueError(
                f"must be a positive number of hours, as 8 or 0.5, not {value!r}; "
                "leave max_hours out for no time limit"
            )
        return value

    def as_cap(self) -> Cap:
        return Cap(
            self.cpus, self.gpus, None if self.ram is None else int(self.ram), self.max_hours
        )


class MachineConfig(BaseModel):
    """``machine.json``: what the admin decides for everyone."""

    model_config = ConfigDict(extra="forbid")

    #: Only members of this group may use the books; ``None`` is every user.
    group: str | None = None
    #: Members may cancel anyone's claim.
    admin_group: str | None = None
    #: Per user name, or ``"*"`` for everyone not named: the most they may hold at once.
    caps: dict[str, UserCap] = Field(default_factory=dict)
    cpus: int | None = Field(default=None, ge=1)
    gpus: int | None = Field(default=None, ge=0)
    ram: ByteSize | None = None
    reserve_cpus: int = Field(default=1, ge=0)
    #: The most memory one kernel the Jupyter server starts may hold outside
    #: its claims (:mod:`fluksio_nb.kernel_ram`); no limit when absent.
    kernel_ram: ByteSize | None = None

    @field_validator("kernel_ram")
    @classmethod
    def _some_memory(cls, size: ByteSize | None) -> ByteSize | None:
        # Below what a Python kernel needs to start, every kernel dies at launch.
        if size is not None and size < 64 * 1024 * 1024:
            raise ValueError(
                f'kernel_ram is the most one kernel may hold, as "8G"; {size} bytes is '
                "below the 64M a kernel needs to start. Leave it out for no limit"
            )
        return size

    #: The service's account of each user's claims (:mod:`.accounts`): a file is
    #: closed past this size, and this many closed ones kept, per user.
    records_rotate_bytes: ByteSize | None = None
    records_kept: int | None = Field(default=None, ge=1)
    #: A claim whose cards sat idle this long while another claim waits for a
    #: card is warned, then ended (:mod:`.idle_cards`); never when absent.
    idle_card_minutes: float | None = None
    #: How long that warning lasts before the claim is ended.
    idle_card_grace_minutes: float = 5.0

    @field_validator("idle_card_minutes", "idle_card_grace_minutes", mode="before")
    @classmethod
    def _minutes(cls, minutes: Any, info: Any) -> Any:
        number = isinstance(minutes, int | float) and not isinstance(minutes, bool)
        if minutes is not None and not (number and 0 < minutes < float("inf")):
            raise ValueError(
                f"{info.field_name} is a number of minutes above 0, not {minutes!r}: "
                + (
                    "30 gives back a card idle for half an hour while someone waits; "
                    "leave it out to never give idle cards back"
                    if info.field_name == "idle_card_minutes"
                    else "how long a claim is warned before its idle cards are given back "
                    "(5 when left out)"
                )
            )
        return minutes

    #: ``false``: cards are used through claims only, and a kernel Jupyter
    #: starts may open none (:mod:`fluksio_nb.unclaimed_cards`); its claims' workers open their own.
    unclaimed_cards: bool = True

    @field_validator("unclaimed_cards", mode="before")
    @classmethod
    def _true_or_false(cls, said: Any) -> Any:
        if not isinstance(said, bool):
            raise ValueError(
                f"unclaimed_cards is true or false, not {said!r}: false keeps every card to "
                "claims, so that kernels Jupyter starts open none; leave it out to let them"
            )
        return said

    #: ``HOST:PORT`` where the service serves its metrics for Prometheus (:mod:`.metrics_http`).
    metrics: str | None = None

    @field_validator("metrics")
    @classmethod
    def _an_address(cls, said: str | None) -> str | None:
        from fluksio_nb.machine.metrics_http import parse_address

        if said is not None:
            parse_address(said)
        return said


class Layout:
    """Where a machine's books live, under ``prefix``."""

    def __init__(self, prefix: Path | str = "/") -> None:
        self.prefix = Path(prefix)
        self.run_dir = self.prefix / DEFAULT_RUN_DIR.relative_to("/")
        self.config = self.prefix / "etc" / "fluksio_nb" / "machine.json"
        self.records = self.prefix / "var" / "lib" / "fluksio_nb" / "usage"
        self.state = self.prefix / "var" / "lib" / "fluksio_nb" / "state"
        self.claims = self.run_dir / "claims.json"
        self.tickets = self.state / "tickets.json"
        self.socket = self.run_dir / SOCKET_NAME
        self.marker = self.run_dir / MARKER_NAME
        self.pidfile = self.run_dir / "service.pid"
        self.log = self.run_dir / "service.log"
        self.made = self.config.parent / MADE_NAME

    @property
    def systemd_unit(self) -> Path | None:
        """The unit file, where the prefix is the real root and systemd runs."""
        if self.prefix != Path("/") or not Path("/run/systemd/system").is_dir():
            return None
        return Path("/etc/systemd/system") / UNIT_NAME


def records_beside(socket: Path) -> Path | None:
    """The records directory ``init`` made for the books served at ``socket``, if it made it."""
    run_dir = socket.parent
    depth = len(DEFAULT_RUN_DIR.relative_to("/").parts)
    if run_dir.parts[-depth:] != DEFAULT_RUN_DIR.relative_to("/").parts:
        return None
    records = Layout(Path(*run_dir.parts[:-depth])).records
    return records if records.is_dir() else None


def read_config(layout: Layout) -> MachineConfig:
    try:
        text = layout.config.read_text()
    except FileNotFoundError:
        return MachineConfig()
    try:
        return MachineConfig.model_validate_json(text or "{}")
    except ValidationError as error:
        raise MachineSetupError(f"{layout.config}: {explain(error)}") from None


def _must_be_root(what: str) -> None:
    if os.geteuid() != 0:
        raise MachineSetupError(
            f"`fluksio-nb machine {what}` changes books every user of the machine shares, "
            f"so it runs as root: sudo fluksio-nb machine {what}"
        )


def _mark(layout: Layout) -> None:
    root_dir(layout.run_dir, 0o755, prefix=layout.prefix)
    staged = layout.run_dir / f".{MARKER_NAME}.new"
    staged.write_text(f"{layout.prefix}\n")
    os.chmod(staged, 0o644)
    os.replace(staged, layout.marker)


def init(
    layout: Layout,
    *,
    group: str | None = None,
    admin_group: str | None = None,
    inventory: dict[str, Any] | None = None,
    start: bool = True,
    metrics: str | None = None,
) -> str:
    """Set the machine up; returns what was done, for the admin to read."""
    _must_be_root("init")
    # A flag left out keeps what machine.json says: init is run again to
    # restart the service, and that must not open the books to every user.
    given = {
        "group": group,
        "admin_group": admin_group,
        "metrics": metrics,
        **(inventory or {}),
    }
    try:
        config = MachineConfig.model_validate(
            {
                **read_config(layout).model_dump(),
                **{key: value for key, value in given.items() if value is not None},
            }
        )
    except ValidationError as error:
        raise MachineSetupError(_refused(error)) from None
    gids = {}
    for name in (config.group, config.admin_group):
        if name is not None:
            try:
                gids[name] = grp.getgrnam(name).gr_gid
            except KeyError:
                raise MachineSetupError(
                    f"there is no group {name!r} on this machine; create it (groupadd {name}) "
                    "or name another"
                ) from None
    gid = gids[config.group] if config.group else 0
    root_dir(layout.config.parent, 0o755, prefix=layout.prefix)
    staged = layout.config.with_suffix(".json.new")
    staged.write_text(config.model_dump_json(indent=2, exclude_defaults=True) + "\n")
    os.chmod(staged, 0o644)
    os.replace(staged, layout.config)
    # Sticky: every user creates their own records, and nobody may remove or
    # rename anyone else's.
    root_dir(layout.records, 0o1770 if config.group else 0o1777, gid, prefix=layout.prefix)
    root_dir(layout.state, 0o700, prefix=layout.prefix)
    _mark(layout)
    write_made(layout, service=read_made(layout).get("service"))
    said = [f"config: {layout.config}", f"usage records: {layout.records}"]
    if start:
        said.append(start_service(layout))
    return "\n".join(said)


def _refused(error: ValidationError) -> str:
    """What was wrong with init's flags, each as the admin typed it, and that nothing changed."""
    said = []
    for item in error.errors(include_url=False):
        where, message = item.get("loc", ()), str(item.get("msg", "")).rstrip(".")
        if where == ("metrics",):
            said.append(f"--metrics {item.get('input')}: {message.removeprefix('Value error, ')}")
        elif len(where) == 1 and where[0] in ("cpus", "gpus", "ram"):
            hint = " (a size such as 64G or 512GiB)" if where[0] == "ram" else ""
            said.append(
                f"--{where[0]} {item.get('input')}: {message[:1].lower()}{message[1:]}{hint}"
            )
        else:
            said.append(explain(error).rstrip("."))
            break
    return "; ".join(said) + ". Nothing was changed."


def start_service(layout: Layout) -> str:
    unit = layout.systemd_unit
    if unit is not None:
        unit.write_text(
            "[Unit]\nDescription=fluksio_nb: the machine's books for every user's notebooks\n\n"
            f"[Service]\nExecStart={sys.executable} -I -m fluksio_nb machine serve\n"
            "Restart=always\nRuntimeDirectory=fluksio_nb\nRuntimeDirectoryPreserve=yes\n\n"
            "[Install]\nWantedBy=multi-user.target\n"
        )
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        subprocess.run(["systemctl", "enable", UNIT_NAME], check=True)
        # Restarted rather than started: init run again means the config changed.
        subprocess.run(["systemctl", "restart", UNIT_NAME], check=True)
        how = f"service: systemd unit {UNIT_NAME}"
    else:
        if answering(layout):
            # Kernels reconnect and put their claims back (machine.client).
            stop_service(layout)
        # Root's alone: it names users and quotes what their kernels sent.
        descriptor = os.open(
            layout.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
        with open(descriptor, "ab") as log:
            # From /, isolated: `-m` puts the directory it starts in first on
            # the path, and a fluksio_nb/ another user left there would run as root.
            started = subprocess.Popen(
                [sys.executable, "-I", "-m", "fluksio_nb", *_serve_args(layout)],
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
        from fluksio_nb.identity import process_started

        # By pid and start time: a pid alone may be anyone's by the time of `remove`.
        write_made(layout, service={"pid": started.pid, "started": process_started(started.pid)})
        how = f"service: started in the background (no systemd here), log in {layout.log}"
    deadline = time.monotonic() + 15
    while not answering(layout):
        if time.monotonic() > deadline:
            raise MachineSetupError(
                f"the books service did not start answering at {layout.socket}; see {layout.log}"
            )
        time.sleep(0.05)
    return f"{how}, answering at {layout.socket}{_metrics_said(layout)}"


def _metrics_said(layout: Layout) -> str:
    """Where the service serves its metrics, if machine.json asks it to, as the service says."""
    from fluksio_nb.machine.metrics_http import ADDRESS_NAME

    asked = read_config(layout).metrics
    if asked is None:
        return ""
    where = layout.run_dir / ADDRESS_NAME
    deadline = time.monotonic() + 5
    while not where.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        return f"; metrics at http://{where.read_text().strip()}/metrics"
    except OSError:
        return f"; but its metrics are not served at {asked}: see {layout.log}"


def rules_said(layout: Layout) -> list[str]:
    """What the admin set beyond caps, a line each, for ``machine status``: who set each limit."""
    from fluksio_nb.machine.metrics_http import ADDRESS_NAME
    from fluksio_nb.machine.time_limits import hours_words

    try:
        config = read_config(layout)
    except MachineSetupError as error:
        return [f"the admin's rules cannot be read: {error}"]
    said = []
    limits = {name: cap.max_hours for name, cap in config.caps.items() if cap.max_hours}
    if limits:
        each = ", ".join(
            f"{'everyone else' if name == '*' else name} {hours_words(hours)}"
            for name, hours in sorted(limits.items(), key=lambda item: item[0] == "*")
        )
        said.append(f"one claim runs at most (max_hours in {layout.config}): {each}")
    if config.kernel_ram is not None:
        said.append(
            f"each kernel the Jupyter server starts holds at most "
            f"{config.kernel_ram.human_readable(decimal=True)} outside its claims, or is "
            f"stopped (kernel_ram in {layout.config})"
        )
    if config.idle_card_minutes is not None:
        said.append(
            f"cards idle {config.idle_card_minutes:g} min while another claim waits are given "
            f"back, {config.idle_card_grace_minutes:g} min after a warning "
            f"(idle_card_minutes in {layout.config})"
        )
    if not config.unclaimed_cards:
        said.append(
            f"cards are used through claims only: kernels Jupyter starts open none "
            f"(unclaimed_cards in {layout.config})"
        )
    if config.metrics is not None:
        try:
            where = (layout.run_dir / ADDRESS_NAME).read_text().strip()
            said.append(f"metrics for Prometheus at http://{where}/metrics")
        except OSError:
            said.append(f"metrics asked for at {config.metrics}, but not served: see {layout.log}")
    return said


def answering(layout: Layout) -> bool:
    from fluksio_nb.machine.run_dir import socket_in

    path = socket_in(layout.run_dir)
    return path is not None and why_silent(path) is None


def why_silent(path: Path) -> str | None:
    """Why the books service at ``path`` does not answer; ``None`` when it does."""
    import socket

    from fluksio_nb.errors import ServiceUnavailable
    from fluksio_nb.machine.connection import ask_once

    # Connected here first for the OS's own reason (refused, no such file),
    # where a request would give advice that sends the reader to `machine status`.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(str(path))
        except OSError as error:
            return error.strerror or str(error)
    try:
        ask_once(path, {"op": "snapshot"}, within=0)
    except (ServiceUnavailable, OSError) as error:
        return str(error)
    return None


def stop_service(layout: Layout) -> None:
    unit = layout.systemd_unit
    if unit is not None and unit.exists():
        subprocess.run(["systemctl", "disable", "--now", UNIT_NAME], check=False)
        unit.unlink()
        subprocess.run(["systemctl", "daemon-reload"], check=False)
        return
    pid = _service_pid(layout)
    if pid is None:
        return
    from fluksio_nb.identity import process_started

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # A zombie has ended: who reaps a detached service is init's business.
        if process_started(pid) is None:
            return
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _service_pid(layout: Layout) -> int | None:
    """This prefix's service: the one ``init`` started, as it wrote down.

    Where ``init`` wrote none down (an earlier version's), the process answering
    at its socket, else the pidfile's.

    The socket comes first, and its pid from the kernel (``SO_PEERCRED``): a
    pidfile can be stale, left by a service killed outright, while the service
    started after it answers. Either is ended only if it is this prefix's
    service by its command line; a pidfile's pid may by now be anyone's.
    """
    from fluksio_nb.errors import ServiceUnavailable
    from fluksio_nb.machine.connection import connect
    from fluksio_nb.machine.protocol import peer_credentials
    from fluksio_nb.machine.run_dir import socket_in

    recorded = read_made(layout).get("service")
    if isinstance(recorded, dict) and isinstance(recorded.get("pid"), int):
        from fluksio_nb.identity import process_started

        pid = recorded["pid"]
        # The same process as started, not one that has its pid since.
        same = process_started(pid) == recorded.get("started")
        return pid if same and _is_the_service(pid, layout) else None
    candidates = []
    if (path := socket_in(layout.run_dir)) is not None:
        with contextlib.suppress(ServiceUnavailable, OSError), connect(path, within=0) as sock:
            candidates.append(peer_credentials(sock)[0])
    with contextlib.suppress(OSError, ValueError):
        candidates.append(int(layout.pidfile.read_text()))
    return next((pid for pid in candidates if _is_the_service(pid, layout)), None)


def _serve_args(layout: Layout) -> list[str]:
    return ["machine", "serve", "--prefix", str(layout.prefix)]


def _is_the_service(pid: int, layout: Layout) -> bool:
    """Whether ``pid`` is root's books service for this prefix, as its command line says."""
    import psutil

    try:
        process = psutil.Process(pid)
        said = process.cmdline()
        return process.uids().real == 0 and said[-len(_serve_args(layout)) :] == _serve_args(layout)
    except (psutil.Error, OSError):
        return False


def remove(layout: Layout) -> str:
    """Undo :func:`init`. Usage records stay: they are the accounting, the admin's to keep.

    Only what ``init`` wrote down it made is removed, and only the service it
    started is stopped; every directory on the way is checked as ``init``
    checks it first, so a link another user points elsewhere leads nowhere.
    """
    _must_be_root("remove")
    for level in (layout.run_dir, layout.config.parent):
        # The directory itself too: its parents, and the file it would hold.
        trusted_prefix(level / MADE_NAME, missing_ok=True)
    made = read_made(layout)
    if made.get("prefix") != str(layout.prefix):
        raise MachineSetupError(
            f"{layout.made} does not say that `fluksio-nb machine init --prefix {layout.prefix}` "
            "made these books, so nothing was removed. Run that init first (it writes down "
            "what it makes), then remove"
        )
    mismatched = [
        str(path)
        for path, key in ((layout.run_dir, "run_dir"), (layout.config.parent, "config_dir"))
        if path.exists() and identity(path) != made.get(key)
    ]
    if mismatched:
        raise MachineSetupError(
            f"{', '.join(mismatched)} is not the directory init made there, so nothing was "
            "removed; look at what it is, and remove it by hand if it is yours to remove"
        )
    stop_service(layout)
    shutil.rmtree(layout.run_dir, ignore_errors=True)
    for made_file in (layout.config, layout.made):
        with contextlib.suppress(FileNotFoundError):
            made_file.unlink()
    with contextlib.suppress(OSError):
        layout.config.parent.rmdir()
    return (
        f"removed: the books service, {layout.run_dir} and {layout.config}. Every user's "
        f"kernels started from now on keep books of their own; a kernel running now says so "
        f"at its next claim, and keeps its own once restarted. Usage records stay in "
        f"{layout.records}."
    )


#: The service's niceness: ahead of the kernels that ask it.
SERVICE_NICENESS = -10


def serve(layout: Layout, read_deaths: DeathsReader | None = None) -> None:
    """Run the books service in the foreground: what the systemd unit runs.

    ``read_deaths`` reads the service's records for a user who asks for
    their own killed kernels' (:class:`~fluksio_nb.machine.service.DeathsReader`).
    """
    _must_be_root("serve")
    import asyncio
    import logging

    from fluksio_nb.gpu_usage import CardReader
    from fluksio_nb.inventory import take_inventory
    from fluksio_nb.machine.accounts import BooksAccounts
    from fluksio_nb.machine.idle_cards import IdlePolicy
    from fluksio_nb.machine.service import BooksService
    from fluksio_nb.machine.service import serve as serve_on
    from fluksio_nb.machine.state import ServiceState
    from fluksio_nb.settings import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = read_config(layout)
    found = take_inventory(
        Settings(
            cpus=config.cpus, gpus=config.gpus, ram=config.ram, reserve_cpus=config.reserve_cpus
        )
    )
    # After a reboot /run is empty again: the service marks it as it starts. And
    # the state directory is made here too, for books an earlier init set up.
    _mark(layout)
    root_dir(layout.state, 0o700, prefix=layout.prefix)
    state = ServiceState(layout.claims, layout.tickets)
    # Read by NVML or nvidia-smi on the service's PATH, as the kernels read them;
    # opened here, before the loop: NVML's first call takes its time.
    cards: CardReader | None = CardReader() if found.gpu_ids else None
    if cards is not None and cards.source is None:
        cards = None
    service = BooksService(
        MachineBooks(
            found.cpus,
            found.gpu_ids,
            found.ram_bytes,
            core_ids=found.core_ids,
            core_nodes=found.core_nodes,
            numbers=state.ticket_numbers(),
        ),
        state=state,
        caps={name: cap.as_cap() for name, cap in config.caps.items()},
        admin_group=config.admin_group,
        records=str(layout.records),
        read_deaths=read_deaths,
        accounts=BooksAccounts(
            layout.records,
            **(
                {}
                if config.records_rotate_bytes is None
                else {"rotate_bytes": int(config.records_rotate_bytes)}
            ),
            **({} if config.records_kept is None else {"kept": config.records_kept}),
        ),
        cards=cards,
        idle_cards=None
        if config.idle_card_minutes is None
        else IdlePolicy(config.idle_card_minutes * 60, config.idle_card_grace_minutes * 60),
    )
    gid = grp.getgrnam(config.group).gr_gid if config.group else 0

    def ready(_: Any) -> None:
        # Anyone (or the group) may connect; who they are is SO_PEERCRED's word.
        os.chown(layout.socket, 0, gid)
        os.chmod(layout.socket, 0o660 if config.group else 0o666)
        layout.pidfile.write_text(str(os.getpid()))

    # Claims matter most when every core is busy, and then a service at the
    # kernels' own priority waits for a time slice before it answers each of
    # them: measured, that doubled the median claim with 16 kernels contending
    # on two cores. Its work per request is small and bounded, so the
    # priority buys latency, not CPU.
    os.setpriority(os.PRIO_PROCESS, 0, SERVICE_NICENESS)
    # Every kernel holds a connection, and each user may hold up to
    # MAX_CONNECTIONS_PER_USER: at the usual soft limit of 1024 descriptors,
    # two users could leave none for anyone else.
    _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    try:
        from fluksio_nb.machine.metrics_http import parse_address

        metrics = None if config.metrics is None else parse_address(config.metrics)
        asyncio.run(serve_on(layout.socket, service, ready, metrics))
    finally:
        with contextlib.suppress(FileNotFoundError):
            layout.pidfile.unlink()
