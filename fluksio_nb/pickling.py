"""How a value is pickled for the trip to another process: cloudpickle, with two things mended.

cloudpickle sends the notebook's own functions and classes by value, which
is what lets a claimed cell call them. Two things were lost on the way.

**A function's lines.** cloudpickle renames every code object it sends
``<dynamic-code>``, so that a function's pickle is the same wherever it was
defined. An error raised inside such a function in a claimed cell then said
``File <dynamic-code>:3`` and "Could not get source", where the same error in
the kernel says ``Cell In[2], line 3`` and shows the line; a function defined
in a claimed cell lost its lines in the kernel the same way. So:

- A code object keeps its file name, and every code object nested in it (a
  method, a lambda, a comprehension) keeps its own.
- A code object from a cell carries the cell's lines and its number
  (``In[n]``). A cell is a file name IPython made up, whose lines live only in
  ``linecache``. On arrival they go where IPython's traceback looks for them:
  ``linecache``, and the shell's map from a cell's file name to its number.
  A code object from a file on disk carries only the name: the other side
  reads the file, if it has it.
- A cell's lines go once a pickle, however many of its functions the value
  holds: they are one object, which pickle sends once.

**A class's slots.** cloudpickle rebuilds a class with ``__slots__``
(``@dataclass(slots=True)`` among them) as a class without them, whose
instances have a ``__dict__``. An instance made in the worker then came back
as a dict of attributes the kernel's real class has no room for, and failed
to arrive. A class's own ``__slots__`` now go into the class as it is made,
so it is the same class on both sides.

**A big bytes object's copy.** Protocol 5 hands a buffer out of band only
if the object reduces to a ``PickleBuffer``, as numpy arrays do. ``bytes``
does not: the C pickler writes it into the stream without ever asking
``reducer_override``. A cell that kept a 320 MB list of bytes then built a
320 MB stream beside it, and was halted at ``ram=500M`` for a copy it never
made. The pickler hands a payload of 64 KiB or more to its file by itself,
the original object, right after its header: so the file the stream is
written to (:class:`_Stream`) offers such a bytes object to
``buffer_callback`` as a buffer, and, where it goes out of band, writes in
place of the header and payload a call rebuilding it from the next buffer.
It arrives as ``bytes``, equal, with one copy on the receiving side, which
``bytes`` owning its memory makes the least there is.

Two others keep their copy in the stream. A ``str`` has no buffer to hand
out, and encoding it is the same copy. A ``bytearray`` could go the same way,
but arrives as a copy off its file, so a cell's input that it only read
would look changed (:func:`fluksio_nb.transfer.unchanged` compares the
stream, or the pages of the file it arrived on) and go back, replacing the
kernel's own object and cutting it from its views.

A pickle stays the same on both sides, as :func:`fluksio_nb.transfer.unchanged`
needs: a cell's lines arrive as they left, under the same number, and a
class is rebuilt as it was.
"""

from __future__ import annotations

import enum
import io
import linecache
import pickle
import sys
import types
from collections import ChainMap
from typing import Any, ClassVar

import cloudpickle

#: cloudpickle's own reduction of a code object, which names the file ``<dynamic-code>``.
_code_without_its_file = cloudpickle.Pickler.dispatch_table[types.CodeType]

#: What a cell's code objects carry: its number (None outside IPython) and its lines.
Cell = tuple[int | None, tuple[str, ...]]

#: One tuple per cell and number, so that every code object of a cell refers
#: to the same object and pickle sends its lines once.
_cells: dict[tuple[str, int | None], Cell] = {}


def dumps(value: object, protocol: int, buffer_callback: Any = None) -> bytes:
    """``value``'s pickle as cloudpickle makes it, code keeping its cell and classes their slots.

    With a ``buffer_callback``, big ``bytes`` are offered to it as buffers
    too, as numpy arrays are.
    """
    file = io.BytesIO() if buffer_callback is None else _Stream(buffer_callback)
    with file:
        _Pickler(file, protocol=protocol, buffer_callback=buffer_callback).dump(value)
        return file.getvalue()


#: ``bytes(<the next out-of-band buffer>)`` in pickle's opcodes: what a big
#: bytes object's header and payload become when it travels out of band. No
#: opcode here memoizes, so the memo's numbering is as the pickler counts it,
#: and its own MEMOIZE after the payload remembers the rebuilt object.
_BYTES_FROM_NEXT_BUFFER = (
    pickle.SHORT_BINUNICODE
    + b"\x08builtins"
    + pickle.SHORT_BINUNICODE
    + b"\x05bytes"
    + pickle.STACK_GLOBAL
    + pickle.NEXT_BUFFER
    + pickle.TUPLE1
    + pickle.REDUCE
)

#: The C pickler's own threshold (``FRAME_SIZE_TARGET``): a payload this big
#: goes to the file in a ``write()`` of its own, straight after its header,
#: which is written outside any frame.
_WRITTEN_ON_ITS_OWN = 64 * 1024


class _Stream(io.BytesIO):
    """A pickle stream that offers the big bytes objects written to it to a buffer callback.

    Only a payload whose header, just written, says ``bytes`` and its
    length is taken out: a ``str``'s encoded copy comes with a header of its
    own, and anything this does not recognise is written as it comes, which
    is the stream the pickler meant.
    """

    def __init__(self, buffer_callback: Any) -> None:
        super().__init__()
        self._buffer_callback = buffer_callback
        self._tail = b""

    def write(self, data: Any) -> int:
        size = len(data)
        if type(data) is bytes and size >= _WRITTEN_ON_ITS_OWN:
            header = _bytes_header(size)
            if self._tail.endswith(header) and not self._buffer_callback(pickle.PickleBuffer(data)):
                self.seek(self.tell() - len(header))
                self.truncate()
                super().write(_BYTES_FROM_NEXT_BUFFER)
                self._tail = b""
                return size
        self._tail = bytes(data[-9:])
        return super().write(data)


def _bytes_header(size: int) -> bytes:
    """The opcode and length protocol 4 and later write before a bytes payload of ``size``."""
    if size <= 0xFFFFFFFF:
        return pickle.BINBYTES + size.to_bytes(4, "little")
    return pickle.BINBYTES8 + size.to_bytes(8, "little")


def why_it_cannot_travel(value: object) -> str | None:
    """Why ``value`` does not pickle, or None if it does: for naming what is to blame."""
    try:
        dumps(value, pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        return str(error) or type(error).__name__
    return None


def global_to_blame(function: object) -> tuple[str, str] | None:
    """A global that a function which does not pickle reads, and which does not pickle either.

    Such a function goes by value with the globals it reads, and its own
    pickling error names only the type it met (a lock, a connection): the
    user needs the name they gave it.
    """
    code = getattr(function, "__code__", None)
    globals_ = getattr(function, "__globals__", None)
    if not isinstance(code, types.CodeType) or not isinstance(globals_, dict):
        return None
    for name in _names_read(code):
        value = globals_.get(name)
        if (
            name in globals_
            and not isinstance(value, types.ModuleType)
            and (why := why_it_cannot_travel(value)) is not None
        ):
            return name, why
    return None


def _names_read(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names += _names_read(constant)
    return list(dict.fromkeys(names))


def _reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    rebuild, args = _code_without_its_file(code)
    return _code_in_its_file, (rebuild, args, code.co_filename, _cell_of(code.co_filename))


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: object) -> Any:
        reduced = super().reducer_override(obj)
        if (
            isinstance(obj, type)
            and "__slots__" in vars(obj)
            and reduced is not NotImplemented
            and not issubclass(obj, enum.Enum)
        ):
            return _with_its_slots(reduced, vars(obj)["__slots__"])
        return reduced

    # Read once, as the pickler is made: a class attribute, not an instance's.
    dispatch_table: ClassVar[ChainMap[Any, Any]] = ChainMap(
        {types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table
    )


def _with_its_slots(reduced: tuple[Any, ...], slots: Any) -> tuple[Any, ...]:
    """cloudpickle's reduction of a class sent by value, made with its slots.

    Its arguments are ``(metaclass, name, bases, type_kwargs, tracker, extra)``;
    ``type_kwargs`` is what the class's namespace holds as it is made, where
    slots must be to be slots at all.
    """
    make, args, *rest = reduced
    kwargs = args[3]
    if not isinstance(kwargs, dict):
        return reduced
    return (make, (*args[:3], {**kwargs, "__slots__": slots}, *args[4:]), *rest)


def _code_in_its_file(
    rebuild: Any, args: tuple[Any, ...], filename: str, cell: Cell | None
) -> types.CodeType:
    """Rebuild a code object under its own file name, making its cell's lines known here."""
    if cell is not None:
        _make_known(filename, cell)
    return rebuild(*args).replace(co_filename=filename)


def _cell_of(filename: str) -> Cell | None:
    entry = linecache.cache.get(filename)
    # A file on disk has its modification time here, and a file not read yet a
    # loader of one element: the other side reads either from the file.
    if entry is None or len(entry) != 4 or entry[1] is not None:
        return None
    number = _numbers().get(filename)
    cell = _cells.get((filename, number))
    if cell is None or list(cell[1]) != entry[2]:
        cell = _cells[filename, number] = (number, tuple(entry[2]))
    return cell


def _make_known(filename: str, cell: Cell) -> None:
    number, lines = cell
    linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
    _cells[filename, number] = cell
    numbers = _numbers()
    if number is not None and numbers is not _NO_SHELL:
        numbers[filename] = number


#: What :func:`_numbers` gives outside IPython: nothing to look up, nowhere to write.
_NO_SHELL: dict[str, int] = {}


def _numbers() -> dict[str, int]:
    """IPython's map from a cell's file name to its number, printed ``In[n]`` in tracebacks."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    return numbers if isinstance(numbers, dict) else _NO_SHELL
