"""A stand-in for nvidia-ml-py's ``pynvml``, on machines with no NVIDIA card.

This directory goes first on ``sys.path`` (``PYTHONPATH``), so that
``import pynvml`` in fluksio_nb finds this module through the ordinary import
machinery. It implements only the calls fluksio_nb makes (``gpus.py``, ``mig.py`` and
``gpu_usage.py``), with nvidia-ml-py's signatures, return shapes and
exceptions:

- strings come back as ``str`` (nvidia-ml-py decodes them since 11.x), or as
  ``bytes`` like older releases when the state says ``"strings_as_bytes"``;
- memory is an object with ``.total``, ``.free`` and ``.used`` in bytes,
  utilisation one with ``.gpu`` and ``.memory`` in percent;
- a process is an object with ``.pid`` and ``.usedGpuMemory`` (bytes, or
  ``None`` where the driver cannot say), ``.gpuInstanceId`` and
  ``.computeInstanceId``;
- every failure is an ``NVMLError``, built as nvidia-ml-py builds it: a
  subclass per error code (``NVMLError_NotSupported``,
  ``NVMLError_LibraryNotFound``, ...), each carrying ``.value``;
- ``nvmlInit`` and ``nvmlShutdown`` count, as NVML does: every other call
  fails with ``NVMLError_Uninitialized`` unless the count is above zero.

What the cards are is read, on every call, from the JSON file that
``$STANDIN_PYNVML_STATE`` names (``tests/gpu_standins.py`` writes it), so a
test may change it between two passes of a reader that stays initialised::

    {"cards": [{"index": 0, "uuid": "GPU-...", "name": "NVIDIA A100-SXM4-40GB",
                "utilisation": 37, "used_mib": 1024, "total_mib": 40960,
                "nvml_errors": {"nvmlDeviceGetGraphicsRunningProcesses": "NotSupported"}}],
     "apps": [{"uuid": "GPU-...", "pid": 4242, "used_mib": 512, "type": "C"}],
     "init_error": null, "strings_as_bytes": false}

A card with ``"mig"`` has MIG on, and that list is its instances, in slot
order (``{"uuid": "MIG-...", "profile": "1g.5gb", "used_mib", "total_mib"}``
each; ``null`` for an empty slot). An instance answers the calls a card
does, with its own memory and processes (apps name it by its UUID), and no
utilisation (``NotSupported``), as on real MIG devices.
``nvmlDeviceGetMaxMigDeviceCount`` is 7, an A100's, on every card.

A card's ``utilisation`` of ``null`` raises ``NVMLError_NotSupported`` from
``nvmlDeviceGetUtilizationRates``, and a ``used_mib`` or ``total_mib`` of
``null`` does so from ``nvmlDeviceGetMemoryInfo``, as on cards that cannot
say (unified-memory ones such as the GB10). An app's ``type`` is ``"C"``
(compute), ``"G"`` (graphics) or ``"C+G"``, as ``nvidia-smi`` shows it.

Without ``$STANDIN_PYNVML_STATE``, ``nvmlInit`` fails as it does where the
driver is not installed: ``NVMLError_LibraryNotFound``. When
``$STANDIN_PYNVML_CALLS`` names a file, each call appends its name to it.
"""

from __future__ import annotations

import json
import os
import string
import sys
import threading

STATE_VAR = "STANDIN_PYNVML_STATE"
CALLS_VAR = "STANDIN_PYNVML_CALLS"

# nvidia-ml-py's return codes, with its values.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_MIG_DISABLE = 0x0
NVML_DEVICE_MIG_ENABLE = 0x1
_MAX_MIG_DEVICES = 7

#: What ``.gpuInstanceId`` and ``.computeInstanceId`` are on a card without MIG.
_NO_INSTANCE = 0xFFFFFFFF
_MIB = 1 << 20


class NVMLError(Exception):
    """As nvidia-ml-py's: ``NVMLError(code)`` is an instance of that code's subclass."""

    _valClassMapping: dict[int, type] = {}  # noqa: RUF012 - nvidia-ml-py's own name and shape
    _errcode_to_string = {  # noqa: RUF012
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_MEMORY: "Insufficient Memory",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(typ, value):
        if typ == NVMLError:
            typ = NVMLError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self):
        return NVMLError._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other):
        return self.value == other.value

    __hash__ = None  # as nvidia-ml-py's, which defines __eq__ alone


def _extract_errors_as_classes() -> dict[str, int]:
    """``NVML_ERROR_NOT_SUPPORTED`` becomes ``NVMLError_NotSupported``, as in nvidia-ml-py."""
    this_module = sys.modules[__name__]
    codes = {}
    for err_name in [name for name in dir(this_module) if name.startswith("NVML_ERROR_")]:
        suffix = string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = getattr(this_module, err_name)

        def gen_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)

            return new

        new_error_class = type(f"NVMLError_{suffix}", (NVMLError,), {"__new__": gen_new(err_val)})
        new_error_class.__module__ = __name__
        setattr(this_module, new_error_class.__name__, new_error_class)
        NVMLError._valClassMapping[err_val] = new_error_class
        codes[suffix] = err_val
    return codes


#: ``"NotSupported"`` to ``NVML_ERROR_NOT_SUPPORTED``, for the state's error names.
_CODES = _extract_errors_as_classes()


# The classes below keep nvidia-ml-py's names, which are not PEP 8's.


class nvmlFriendlyObject:
    """What nvidia-ml-py returns for a process: its struct's fields as attributes."""

    def __init__(self, dictionary):
        for key in dictionary:
            setattr(self, key, dictionary[key])

    def __str__(self):
        return self.__dict__.__str__()


class _Struct:
    _fields_: tuple[str, ...] = ()

    def __init__(self, **values):
        for key in self._fields_:
            setattr(self, key, values.get(key, 0))

    def __repr__(self):
        fields = ", ".join(f"{key}: {getattr(self, key)}" for key in self._fields_)
        return f"{type(self).__name__}({fields})"


class c_nvmlMemory_t(_Struct):
    _fields_ = ("total", "free", "used")


class c_nvmlMemory_v2_t(_Struct):
    _fields_ = ("version", "total", "reserved", "free", "used")


class c_nvmlUtilization_t(_Struct):
    _fields_ = ("gpu", "memory")


class c_nvmlDevice_t:
    """A device handle: the card it was taken for, by UUID, whatever its index becomes."""

    __slots__ = ("_uuid",)

    def __init__(self, uuid: str) -> None:
        self._uuid = uuid


_lock = threading.Lock()
_refcount = 0


def _log(call: str) -> None:
    calls = os.environ.get(CALLS_VAR)
    if calls:
        with open(calls, "a") as log:
            log.write(call + "\n")


def _state() -> dict | None:
    path = os.environ.get(STATE_VAR)
    if not path:
        return None
    try:
        with open(path) as state:
            return json.load(state)
    except FileNotFoundError:
        return None


def _error(error: str | int) -> NVMLError:
    """The error a state names (``"NotSupported"``), or a code's."""
    return NVMLError(_CODES[error] if isinstance(error, str) else error)


def _initialised_state() -> dict:
    if _refcount <= 0:
        raise _error(NVML_ERROR_UNINITIALIZED)
    state = _state()
    if state is None:
        raise _error(NVML_ERROR_DRIVER_NOT_LOADED)  # the driver went away since nvmlInit
    return state


def _card(handle: c_nvmlDevice_t, call: str) -> tuple[dict, dict]:
    _log(call)
    state = _initialised_state()
    if not isinstance(handle, c_nvmlDevice_t):
        raise _error(NVML_ERROR_INVALID_ARGUMENT)
    for card in _cards_and_instances(state):
        if card["uuid"] == handle._uuid:
            error = card.get("nvml_errors", {}).get(call)
            if error is not None:
                raise _error(error)
            return card, state
    raise _error(NVML_ERROR_GPU_IS_LOST)


def _cards_and_instances(state: dict) -> list[dict]:
    """Every card, and every MIG instance as a card: its parent's name, its own memory."""
    found = []
    for card in state.get("cards", []):
        found.append(card)
        for instance in card.get("mig") or []:
            if instance is not None:
                name = f"{card.get('name', 'NVIDIA A100-SXM4-40GB')} MIG {instance['profile']}"
                found.append({"name": name, "utilisation": None, **instance})
    return found


def _text(value: str, state: dict) -> str | bytes:
    return value.encode() if state.get("strings_as_bytes") else value


def nvmlInit():
    global _refcount
    _log("nvmlInit")
    state = _state()
    if state is None:
        raise _error(NVML_ERROR_LIBRARY_NOT_FOUND)
    if state.get("init_error"):
        raise _error(state["init_error"])
    with _lock:
        _refcount += 1


def nvmlShutdown():
    global _refcount
    _log("nvmlShutdown")
    with _lock:
        if _refcount <= 0:
            raise _error(NVML_ERROR_UNINITIALIZED)
        _refcount -= 1


def nvmlDeviceGetCount():
    _log("nvmlDeviceGetCount")
    return len(_initialised_state().get("cards", []))


def nvmlDeviceGetHandleByIndex(index):
    _log("nvmlDeviceGetHandleByIndex")
    cards = _initialised_state().get("cards", [])
    if not 0 <= index < len(cards):
        raise _error(NVML_ERROR_INVALID_ARGUMENT)
    card = cards[index]
    error = card.get("nvml_errors", {}).get("nvmlDeviceGetHandleByIndex")
    if error is not None:
        raise _error(error)
    return c_nvmlDevice_t(card["uuid"])


def nvmlDeviceGetName(handle):
    card, state = _card(handle, "nvmlDeviceGetName")
    return _text(card.get("name", "NVIDIA A100-SXM4-40GB"), state)


def nvmlDeviceGetUUID(handle):
    card, state = _card(handle, "nvmlDeviceGetUUID")
    return _text(card["uuid"], state)


def nvmlDeviceGetMemoryInfo(handle, version=None):
    card, _ = _card(handle, "nvmlDeviceGetMemoryInfo")
    used, total = card.get("used_mib"), card.get("total_mib")
    if used is None or total is None:
        raise _error(NVML_ERROR_NOT_SUPPORTED)
    used, total = int(used * _MIB), int(total * _MIB)
    if not version:
        return c_nvmlMemory_t(total=total, free=total - used, used=used)
    return c_nvmlMemory_v2_t(version=version, total=total, reserved=0, free=total - used, used=used)


def nvmlDeviceGetUtilizationRates(handle):
    card, _ = _card(handle, "nvmlDeviceGetUtilizationRates")
    if card.get("utilisation") is None:
        raise _error(NVML_ERROR_NOT_SUPPORTED)
    return c_nvmlUtilization_t(gpu=int(card["utilisation"]), memory=card.get("memory_percent", 0))


def _processes(handle, call: str, kinds: set[str]) -> list[nvmlFriendlyObject]:
    card, state = _card(handle, call)
    return [
        nvmlFriendlyObject(
            {
                "pid": int(app["pid"]),
                "usedGpuMemory": (
                    None if app.get("used_mib") is None else int(app["used_mib"] * _MIB)
                ),
                "gpuInstanceId": _NO_INSTANCE,
                "computeInstanceId": _NO_INSTANCE,
            }
        )
        for app in state.get("apps", [])
        if app["uuid"] == card["uuid"] and app.get("type", "C") in kinds
    ]


def nvmlDeviceGetComputeRunningProcesses(handle):
    return _processes(handle, "nvmlDeviceGetComputeRunningProcesses", {"C", "C+G"})


def nvmlDeviceGetGraphicsRunningProcesses(handle):
    return _processes(handle, "nvmlDeviceGetGraphicsRunningProcesses", {"G", "C+G"})


def nvmlDeviceGetMigMode(device):
    card, _ = _card(device, "nvmlDeviceGetMigMode")
    mode = NVML_DEVICE_MIG_ENABLE if "mig" in card else NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceGetMaxMigDeviceCount(device):
    _card(device, "nvmlDeviceGetMaxMigDeviceCount")
    return _MAX_MIG_DEVICES


def nvmlDeviceGetMigDeviceHandleByIndex(device, index):
    card, _ = _card(device, "nvmlDeviceGetMigDeviceHandleByIndex")
    if "mig" not in card:
        raise _error(NVML_ERROR_INVALID_ARGUMENT)  # MIG is off on this card
    if not 0 <= index < _MAX_MIG_DEVICES:
        raise _error(NVML_ERROR_INVALID_ARGUMENT)
    instances = card["mig"]
    if index >= len(instances) or instances[index] is None:
        raise _error(NVML_ERROR_NOT_FOUND)  # a slot with no instance in it
    return c_nvmlDevice_t(instances[index]["uuid"])
