"""Cards held on cgroup v2: a device program attached to the claim's cgroup.

cgroup v2 has no devices controller to write rules into. What decides there
whether a process may open a device node is a BPF program of type
``BPF_PROG_TYPE_CGROUP_DEVICE`` attached to its cgroup or any above it: the
kernel runs each one on every ``open`` and ``mknod`` of a node, and a ``0``
from any of them is ``EPERM``. So on a v2 machine a claim's cards are held by
such a program, loaded here with the ``bpf`` system call through ``ctypes``
(no compiler, no ``libbpf``: the program is a dozen raw instructions).

What it decides:

- **The same rule as cgroup v1's** (:mod:`fluksio_nb.card_devices`): a
  character node of major 195 with a minor below 254 that is not a granted
  card's is denied; everything else, the control nodes ``nvidiactl`` (255)
  and ``nvidia-modeset`` (254) and ``nvidia-uvm``'s own major among them, is
  let through. A program only ever narrows: what one above it denies stays
  denied (``BPF_F_ALLOW_MULTI``, so that the programs above still run).
- **No descriptor is kept, nothing is pinned.** A program attached with
  ``BPF_PROG_ATTACH`` is held by the cgroup it is attached to, not by the
  descriptor that loaded it: it stays in force after the descriptor closes,
  and goes when the cgroup is removed. (A ``BPF_LINK_CREATE`` link would end
  with its descriptor; this module makes none.) The tests hold a card in a
  cgroup, close every descriptor, and only then start the process that
  opens the nodes.
- **Where the claims' cgroups go** (:func:`find_v2_place`): beside this
  process's own v2 cgroup, in ``fluksio_nb/`` under its parent, where this
  user may make cgroups and move processes and no other user may change the
  way there, as the memory caps' (:mod:`fluksio_nb.memory_cap`); a kernel
  held away from every card has its claims' cgroups beside its own, since a
  program on a cgroup holds every cgroup below it. A program needs no
  controller handed down: any v2 cgroup can have one. Where the claim
  already has a v2 cgroup (its memory cap, its cpuset), the program goes on
  that one, a process being in one v2 cgroup only.
- **Where it can be loaded**: :func:`bpf_refusal` loads one program, once
  per process, and keeps the kernel's reason when it refuses (``EPERM``
  without ``CAP_BPF``/``CAP_SYS_ADMIN``, ``EINVAL`` on a kernel built without
  ``CONFIG_CGROUP_BPF``), so the status says why the variable alone holds
  cards there.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import threading
from collections.abc import Iterable
from pathlib import Path

from fluksio_nb.budget import CGROUP_V2
from fluksio_nb.claim_cgroups import CLAIM_NAME, v2_mount
from fluksio_nb.inventory import CGROUP_ROOT
from fluksio_nb.memory_cap import PARENT_NAME, CapPlace, v2_not_ours

#: ``bpf``'s system call number, per machine (``uname -m``).
SYS_BPF = {
    "x86_64": 321,
    "aarch64": 280,
    "riscv64": 280,
    "ppc64le": 361,
    "ppc64": 361,
    "s390x": 351,
    "i686": 357,
    "i386": 357,
    "armv7l": 386,
}

BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2
#: ``access_type``'s low 16 bits for a character device.
BPF_DEVCG_DEV_CHAR = 2

#: The same numbers as cgroup v1's rules (:mod:`fluksio_nb.card_devices`).
CARD_MAJOR = 195
#: The first minor that is not a card's: ``nvidia-modeset``.
FIRST_CONTROL_MINOR = 254

#: ``union bpf_attr`` is passed whole; the kernel reads what it knows, the rest must be zero.
_ATTR_SIZE = 128
_LICENSE = b"BSD-3-Clause\0"
_LOG_SIZE = 1 << 16

# Opcodes (linux/bpf_common.h, linux/bpf.h).
_LDX_MEM_W = 0x61  # BPF_LDX | BPF_MEM | BPF_W
_ALU64_AND_K = 0x57  # BPF_ALU64 | BPF_AND | BPF_K
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JNE_K = 0x55
_JGE_K = 0x35
_MOV64_K = 0xB7  # BPF_ALU64 | BPF_MOV | BPF_K
_EXIT = 0x95  # BPF_JMP | BPF_EXIT


class DeviceProgramRefused(OSError):
    """The kernel would not load or attach the device program; what it said is kept."""


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One ``struct bpf_insn``: u8 code; u8 dst:4, src:4 (little-endian); s16 off; s32 imm."""
    return struct.pack("=BBhi", code, (src << 4) | dst, off, imm)


def program(granted: Iterable[int]) -> bytes:
    """The instructions: allow unless a card's node (char, 195, minor < 254) not granted.

    ``r1`` is ``struct bpf_cgroup_dev_ctx {u32 access_type; u32 major; u32 minor}``.
    """
    cards = sorted({int(card) for card in granted if 0 <= int(card) < FIRST_CONTROL_MINOR})
    body = [
        (_LDX_MEM_W, 2, 1, 0, 0),  # r2 = ctx->access_type
        (_ALU64_AND_K, 2, 0, 0, 0xFFFF),  # its type, the low 16 bits
        (_JNE_K, 2, 0, "allow", BPF_DEVCG_DEV_CHAR),
        (_LDX_MEM_W, 3, 1, 4, 0),  # r3 = ctx->major
        (_JNE_K, 3, 0, "allow", CARD_MAJOR),
        (_LDX_MEM_W, 4, 1, 8, 0),  # r4 = ctx->minor
        (_JGE_K, 4, 0, "allow", FIRST_CONTROL_MINOR),
        *((_JEQ_K, 4, 0, "allow", card) for card in cards),
        (_MOV64_K, 0, 0, 0, 0),  # deny
        (_EXIT, 0, 0, 0, 0),
    ]
    allow = len(body)
    body += [(_MOV64_K, 0, 0, 0, 1), (_EXIT, 0, 0, 0, 0)]
    out = []
    for pc, (code, dst, src, off, imm) in enumerate(body):
        # A jump's offset counts from the instruction after it.
        jump = allow - (pc + 1) if off == "allow" else off
        out.append(_insn(code, dst, src, int(jump), imm))
    return b"".join(out)


def _bpf(command: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    number = SYS_BPF.get(platform.machine())
    if number is None:
        raise DeviceProgramRefused(
            errno.ENOSYS, f"bpf()'s number on {platform.machine()} is not known to fluksio_nb"
        )
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(
        ctypes.c_long(number), ctypes.c_int(command), attr, ctypes.c_uint(_ATTR_SIZE)
    )
    if result < 0:
        code = ctypes.get_errno()
        raise DeviceProgramRefused(code, os.strerror(code))
    return int(result)


def load(granted: Iterable[int]) -> int:
    """Load the program for ``granted``; its descriptor. Raises :class:`DeviceProgramRefused`."""
    code = program(granted)
    insns = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(_LICENSE, len(_LICENSE))
    log = ctypes.create_string_buffer(_LOG_SIZE)
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    struct.pack_into(
        "=IIQQIIQ",
        attr,
        0,
        BPF_PROG_TYPE_CGROUP_DEVICE,
        len(code) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(license_),
        1,  # log_level: the verifier says why it refused
        _LOG_SIZE,
        ctypes.addressof(log),
    )
    try:
        return _bpf(BPF_PROG_LOAD, attr)
    except DeviceProgramRefused as error:
        said = log.value.decode(errors="replace").strip().splitlines()
        if said:
            raise DeviceProgramRefused(
                error.errno, f"{error.strerror}; the verifier said: {said[-1]}"
            ) from None
        raise


def attach(program_fd: int, cgroup: Path) -> None:
    """Attach a loaded program to the v2 cgroup directory ``cgroup``, beside those above it."""
    target = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        attr = ctypes.create_string_buffer(_ATTR_SIZE)
        struct.pack_into("=IIII", attr, 0, target, program_fd, BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI)
        _bpf(BPF_PROG_ATTACH, attr)
    finally:
        os.close(target)


def hold_cards_in(cgroup: Path, granted: Iterable[int]) -> None:
    """Let the processes of the v2 cgroup ``cgroup`` open only the ``granted`` cards' nodes.

    Raises :class:`DeviceProgramRefused`; nothing is left attached then.
    The program stays attached until the cgroup is removed (see the module's docstring).
    """
    fd = load(granted)
    try:
        attach(fd, cgroup)
    finally:
        os.close(fd)


_refusal: list[str | None] = []
_refusal_lock = threading.Lock()


def bpf_refusal() -> str | None:
    """Why this process may not load a device program, or None where it may; asked once."""
    with _refusal_lock:
        if not _refusal:
            try:
                os.close(load(()))
                _refusal.append(None)
            except DeviceProgramRefused as error:
                _refusal.append(
                    f"the kernel refused to load a cgroup v2 device program: {error.strerror}"
                    + (
                        " (needs CAP_BPF or root, and a kernel with CONFIG_CGROUP_BPF)"
                        if error.errno in (errno.EPERM, errno.EINVAL, errno.ENOSYS)
                        else ""
                    )
                )
        return _refusal[0]


def find_v2_place(v2_path: str, root: Path = CGROUP_ROOT) -> CapPlace:
    """Where the v2 cgroups holding claims to cards go, for a process in ``v2_path``; or why not."""
    mount = v2_mount(root)
    if mount is None:
        return CapPlace(None, why_not=f"no cgroup v2 hierarchy is mounted at {root}")
    own = mount / v2_path.lstrip("/")
    if not own.is_dir():
        return CapPlace(None, why_not=f"this process's cgroup v2 {v2_path} is not under {mount}")
    base = own if own == mount else own.parent
    if CLAIM_NAME.match(own.name) and own.parent.name == PARENT_NAME:
        # A kernel held away from every card: a child could open no more.
        base = own.parent.parent
    if (not_ours := v2_not_ours(mount, base)) is not None:
        return CapPlace(None, why_not=not_ours)
    if (refused := bpf_refusal()) is not None:
        return CapPlace(None, why_not=refused)
    return CapPlace(CGROUP_V2, parent=base / PARENT_NAME, home=own)
