"""Functions and classes a notebook made, arriving in another namespace.

A function defined in a notebook reads its globals from the notebook's
namespace, at the moment it is called: ``SCALE = 2`` in a later cell reaches
it. cloudpickle sends such a function by value, with a dict of the globals it
reads as they were, and rebuilds it around a copy of that dict. Left so, a
helper defined in a claimed cell would read, for the rest of the session, the
values its globals had when the cell ended, and raise ``NameError`` for a
global defined after; and a function sent into a worker would not see a global
the cell itself assigns before calling it.

So a function or class that arrives by value is rebuilt around the namespace
it arrives in (:func:`at_home`), as ipyparallel's uncanning rebuilds a
function around its engine's namespace. What it decides:

- **Only what a notebook defined.** A function whose ``__module__`` is the
  namespace's own (``__main__``) and whose globals are not that namespace
  already; anything imported from a module travelled by reference and is the
  module's own.
- **A class keeps its identity.** Its methods are rebuilt in place, so
  instances made on the other side are still instances of it.
- **A worker's namespace holds only the cell's inputs**, not the globals the
  functions it was sent read. Those the function carried are put in it
  (:func:`globals_carried`), unless the cell's inputs already bound them.
- **A ``global`` statement is a binding.** ``bump()`` binds nothing in the
  cell's source, yet a ``bump`` that says ``global counter`` changes the
  kernel's ``counter`` in a normal cell. The names the notebook's functions a
  cell can reach assign that way come back too (:func:`globals_assigned`).
"""

from __future__ import annotations

import dis
import functools
from collections.abc import Iterable, Iterator, Mapping
from types import CodeType, FunctionType
from typing import Any


def at_home(value: object, namespace: Mapping[str, Any]) -> object:
    """``value``, with a function or a class's methods bound to ``namespace``'s globals."""
    if isinstance(value, FunctionType):
        return _rebuilt(value, namespace) if _from_elsewhere(value, namespace) else value
    if isinstance(value, type) and value.__module__ == _module_of(namespace):
        for name, member in list(vars(value).items()):
            moved = _member_at_home(member, namespace)
            if moved is not member:
                setattr(value, name, moved)
    return value


def each_at_home(values: Mapping[str, object], namespace: Mapping[str, Any]) -> dict[str, object]:
    """Each of ``values`` through :func:`at_home`."""
    return {name: at_home(value, namespace) for name, value in values.items()}


def globals_carried(value: object, namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The globals a function, or a class's methods, brought with it from elsewhere."""
    carried: dict[str, Any] = {}
    for function in _functions_of(value):
        if _from_elsewhere(function, namespace):
            for name, global_value in function.__globals__.items():
                if not (name.startswith("__") and name.endswith("__")):
                    carried.setdefault(name, global_value)
    return carried


def globals_assigned(values: Iterable[object], namespace: Mapping[str, Any]) -> set[str]:
    """The names the notebook's functions among ``values`` assign with ``global``.

    Followed through the notebook functions they call by name, since a cell
    calling ``train()`` reaches whatever ``train`` calls.
    """
    assigned: set[str] = set()
    seen: set[int] = set()
    pending = [f for value in values for f in _functions_of(value) if _made_in(f, namespace)]
    while pending:
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        stores, loads = _globals_used(function.__code__)
        assigned |= stores
        for name in loads:
            called = namespace.get(name)
            if isinstance(called, (FunctionType, type)):
                pending.extend(f for f in _functions_of(called) if _made_in(f, namespace))
    return assigned


@functools.lru_cache(maxsize=4096)
def _globals_used(code: CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """The globals ``code`` assigns, and those it reads, nested code included.

    Remembered per code object: reading bytecode costs tens of microseconds a
    function, and a notebook's helpers are looked at again by every claimed
    cell that reaches them.
    """
    stores: set[str] = set()
    loads: set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        for instruction in dis.get_instructions(current):
            if instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                stores.add(instruction.argval)
            elif instruction.opname == "LOAD_GLOBAL":
                loads.add(instruction.argval)
        stack.extend(const for const in current.co_consts if isinstance(const, CodeType))
    return frozenset(stores), frozenset(loads)


def _made_in(function: FunctionType, namespace: Mapping[str, Any]) -> bool:
    return function.__module__ == _module_of(namespace)


def _module_of(namespace: Mapping[str, Any]) -> str:
    return namespace.get("__name__", "__main__")


def _from_elsewhere(function: FunctionType, namespace: Mapping[str, Any]) -> bool:
    return _made_in(function, namespace) and function.__globals__ is not namespace


def _rebuilt(
    function: FunctionType,
    namespace: Mapping[str, Any],
    done: dict[int, FunctionType] | None = None,
) -> FunctionType:
    done = {} if done is None else done
    if id(function) in done:  # a closure that holds itself: a recursive inner function
        return done[id(function)]
    rebuilt = FunctionType(
        function.__code__,
        namespace,  # type: ignore[arg-type]
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    rebuilt.__kwdefaults__ = function.__kwdefaults__
    rebuilt.__qualname__ = function.__qualname__
    rebuilt.__module__ = function.__module__
    rebuilt.__doc__ = function.__doc__
    rebuilt.__annotations__ = function.__annotations__
    rebuilt.__dict__.update(function.__dict__)
    done[id(function)] = rebuilt
    # A decorator's wrapper holds the function it wraps in a closure cell,
    # and that one arrived by value too. The cells came with this copy, so
    # they are this copy's to change.
    for cell in function.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        if isinstance(held, FunctionType) and _from_elsewhere(held, namespace):
            cell.cell_contents = _rebuilt(held, namespace, done)
    return rebuilt


def _member_at_home(member: Any, namespace: Mapping[str, Any]) -> Any:
    parts = _parts(member)
    moved = [None if part is None else at_home(part, namespace) for part in parts]
    if all(new is old for new, old in zip(moved, parts, strict=True)):
        return member
    if isinstance(member, property):
        return property(*moved, member.__doc__)
    if isinstance(member, (staticmethod, classmethod)):
        return type(member)(moved[0])
    return moved[0]


def _parts(member: Any) -> list[Any]:
    """The functions a class member is made of: itself, a wrapped method, a property's three."""
    if isinstance(member, FunctionType):
        return [member]
    if isinstance(member, (staticmethod, classmethod)):
        return [member.__func__]
    if isinstance(member, property):
        return [member.fget, member.fset, member.fdel]
    return []


def _functions_of(value: object) -> Iterator[FunctionType]:
    if isinstance(value, FunctionType):
        yield value
    elif isinstance(value, type):
        for member in vars(value).values():
            for part in _parts(member):
                if isinstance(part, FunctionType):
                    yield part
