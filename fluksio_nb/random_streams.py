"""The global random streams a claimed cell draws from: the kernel's, continued.

A notebook seeded at its top (``random.seed(0)``, ``np.random.seed(0)``) draws
the same numbers on every run. A claimed cell runs in a worker whose global
generators are its own, seeded from the operating system when it started and
advanced by whichever claimed cells it ran before, so the same notebook
would draw different numbers on every run the moment a cell is claimed. The
states of the kernel's global generators therefore travel with the cell.

What it decides:

- **Which generators.** Python's ``random`` and NumPy's legacy global one
  (``np.random.seed``, ``np.random.rand``), each only when the kernel has
  imported it. A ``np.random.default_rng()`` generator is a variable like any
  other, and travels as one. Not torch's: it is not installed here to test
  against, and its CUDA generators cannot be read without the kernel opening
  a context on a card.
- **A cell the kernel waits for continues the kernel's streams exactly**, and
  its streams come back with the names it binds, also when it raised or was
  stopped: the next cell draws what it would have drawn had nothing been
  claimed.
- **A background cell runs beside others**, so it cannot continue the one
  stream: each is seeded from a draw of the kernel's streams when it is
  started. Background cells started in the same order draw the same numbers
  on every run, no two draw the same ones, and nothing comes back into the
  kernel later.
- **A worker that has not imported NumPy does not import it** for the state:
  the state is set as the cell imports ``numpy.random``, before anything can
  draw from it.
- **Only what changed travels.** A stream the worker already holds as the
  kernel has it is sent as :data:`SAME`, and only streams the cell drew from
  come back (:func:`arrive`, :func:`drawn_since`): a cell that draws nothing
  costs a comparison, not two 4 KB states each way. A stream sent as
  :data:`SAME` is not read again as the cell starts either: it is as the
  worker's last cell left it, which was read as that cell ended.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import random
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: Sent for a stream the worker holds as the kernel has it already.
SAME = "same"

#: A generator's name, and the module whose global generator it is.
_MODULES = {"random": "random", "numpy": "numpy.random"}

States = dict[str, Any]


def capture(names: object = None) -> States:
    """The states of the global generators loaded here; only those in ``names``, if given."""
    states: States = {}
    for name, module_name in _MODULES.items():
        module = sys.modules.get(module_name)
        if module is not None and (names is None or name in names):
            states[name] = module.getstate() if name == "random" else _plain(module.get_state())
    return states


def spawn() -> States:
    """Fresh states for a background cell, seeded from draws of the generators loaded here."""
    states: States = {}
    if "random" in sys.modules:
        states["random"] = random.Random(random.getrandbits(64)).getstate()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        seed = int(numpy_random.randint(0, 2**32, dtype="uint64"))
        states["numpy"] = _plain(numpy_random.RandomState(seed).get_state())
    return states


def restore(states: States | None) -> None:
    """Put ``states`` in place; NumPy's when it is imported, if it is not yet."""
    for name, state in (states or {}).items():
        module_name = _MODULES.get(name)
        if module_name is None:
            continue
        module = sys.modules.get(module_name)
        if module is not None:
            _set(name, module, state)
        else:
            _SetOnImport.arrange(module_name, lambda module, n=name, s=state: _set(n, module, s))


#: The worker's streams as its last cell left them, read as that cell ended;
#: empty once a cell ran that was not told of the streams.
_as_left: States = {}


def arrive(states: States) -> States:
    """The worker's side, before a cell: put what was sent in place; each stream as it is now."""
    restore({name: state for name, state in states.items() if state != SAME})
    # Reading Python's stream builds 625 ints: 50 µs of a warm cell after a pause.
    known = {name: _as_left[name] for name in states if states[name] == SAME and name in _as_left}
    return {**capture([name for name in states if name not in known]), **known}


def drawn_since(before: States, names: object) -> tuple[States, list[str]]:
    """The worker's side, after a cell: the streams it drew from, and every stream it holds.

    No ``names``: the cell was not told of the streams, and may have drawn from any.
    """
    global _as_left
    if not names:
        _as_left = {}
        return {}, []
    after = _as_left = capture(names)
    return {name: state for name, state in after.items() if before.get(name) != state}, list(after)


def forget_pending() -> None:
    """Drop the states still waiting for an import: the cell they were for is over."""
    if any(isinstance(finder, _SetOnImport) for finder in sys.meta_path):
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _SetOnImport)]


def _plain(numpy_state: tuple) -> tuple:
    """NumPy's state with its key as bytes: unpickling an array would import NumPy."""
    kind, key, *rest = numpy_state
    return (kind, key.tobytes(), *rest)


def _set(name: str, module: ModuleType, state: Any) -> None:
    if name == "random":
        module.setstate(state)
    else:
        import numpy

        kind, key, *rest = state
        module.set_state((kind, numpy.frombuffer(key, dtype=numpy.uint32), *rest))


class _SetOnImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after ``module_name`` is first imported, once."""

    def __init__(self, module_name: str, then: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.then = then

    @classmethod
    def arrange(cls, module_name: str, then: Callable[[ModuleType], None]) -> None:
        sys.meta_path.insert(0, cls(module_name, then))

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Then(spec.loader, self.then)
        return spec


class _Then(importlib.abc.Loader):
    """A module's own loader, and one thing more to do once the module has run."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
