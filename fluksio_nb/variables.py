"""Which of the kernel's names a claimed cell needs, and which it hands back.

A claimed cell runs in another process, so the kernel's namespace does not
follow it: every name the cell reads has to be shipped in and every name it
binds shipped back, or a cell behaves differently the moment it is claimed.
Shipping is not free — one name can hold gigabytes — so the question is
answered from the cell's source before it runs, rather than by copying the
whole namespace.

The answer leans towards shipping. An extra name costs a copy; a missing one
is a ``NameError`` in the worker that the same cell would not raise unclaimed.
So a name counts as already there only when the cell's own top-level code
certainly bound it before the read: a binding inside one branch of an ``if``,
a loop body or a ``try`` is not trusted, and a function defined in the cell is
taken to read every global it mentions at the moment it is defined, because
when it will be called is not known. What the compiler itself makes local — a
function's parameters and assignments, a comprehension's loop variable — is
never shipped.

Names stored into (``table[k] = v``, ``model.weights = w``) come back as well
as names bound: either way the kernel's name means something else after the
cell. An input a call may have changed in place — one a method is called on
(``rows.append(r)``, ``last = rows.pop()``, ``x = rng.random()``) or that is
passed to a function (``random.shuffle(deck)``, ``model.fit(X, y)``) — is
what a normal cell would leave changed in the kernel: it comes back if it did
change (:func:`choose_if_changed`). What cannot be seen in the source is not
guessed at — names bound by ``from m import *`` or ``exec``, an input changed
through another name (``alias = rows; alias.append(r)``) — and travels only
when the user names it with ``--in``/``--out``.

The source is what the user typed, IPython syntax included, so it goes through
IPython's own translation first (:mod:`fluksio_nb.cell_syntax`). A magic that
runs code (``%time x = f()``) is read as that code; ``{expr}`` and ``$name``
in a shell line or a magic are reads, since IPython expands them from the
namespace.

It is long because it is one walk over one syntax tree: which names a cell
reads, binds, deletes and may change in place are answered together, by one
visitor that knows Python's scoping rules, and split apart they would each
need those rules again.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

from fluksio_nb.cell_syntax import code_after_options, ipython_call, parse_cell, parse_quietly

#: What IPython keeps in every user namespace for its own bookkeeping. Never
#: shipped: the history is large, partly unpicklable, and the worker has its own.
IPYTHON_NAMES = frozenset(
    {"In", "Out", "_", "__", "___", "_oh", "_ih", "_dh", "exit", "quit", "get_ipython"}
)

#: IPython's input history: ``_i``, ``_ii``, ``_iii`` and ``_i<n>``.
_INPUT_HISTORY = re.compile(r"_i{1,3}|_i\d+")

#: Magics whose argument is Python that reads the user namespace (``%timeit``
#: too, though what it assigns stays in a function of its own).
_MAGICS_RUNNING_CODE = frozenset({"time", "timeit", "prun"})

#: IPython expands these in shell lines and most magics before running them.
_DOLLAR_NAME = re.compile(r"(?<!\$)\$([A-Za-z_]\w*)")
_BRACED_EXPRESSION = re.compile(r"(?<!\{)\{([^{}]+)\}(?!\})")

#: Builtins that never change what they are handed: an input passed only to
#: these is not worth pickling again to find out. ``next`` is not one.
_READ_ONLY_BUILTINS = frozenset(
    {
        *("abs", "all", "any", "ascii", "bool", "callable", "dict", "dir", "divmod"),
        *("enumerate", "filter", "float", "format", "frozenset", "hasattr", "hash", "id"),
        *("int", "isinstance", "issubclass", "len", "list", "map", "max", "min", "print"),
        *("repr", "reversed", "round", "set", "sorted", "str", "sum", "tuple", "type", "zip"),
    }
)

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_SCOPES = (*_FUNCTIONS, ast.ClassDef, *_COMPREHENSIONS)


# The four walks below are cached beside the parse: a cell is walked by each
# of them once per claim, and a cell run again is the same text (a 500-line
# cell's walks took 40 ms, measured). Frozen, so that no caller can change
# what the next one is given.


@functools.lru_cache(maxsize=32)
def names_read(source: str) -> frozenset[str]:
    """Names the cell may read from the namespace it runs in."""
    flow = _TopLevelFlow()
    flow.block(parse_cell(source).body, set())
    return frozenset(flow.reads)


@functools.lru_cache(maxsize=32)
def names_written(source: str) -> frozenset[str]:
    """Names the cell may bind or store into in the namespace it runs in.

    ``except E as e`` is left out: Python deletes ``e`` when the handler ends.
    """
    return frozenset(_module_writes(parse_cell(source).body))


@functools.lru_cache(maxsize=32)
def names_deleted(source: str) -> frozenset[str]:
    """Names a ``del`` at the cell's top level may remove from its namespace.

    A name the cell deleted and did not bind again is gone from the kernel
    too when the cell ends, as it would be after a normal cell.
    """
    return frozenset(
        target.id
        for node in _scope_nodes(parse_cell(source).body)
        if isinstance(node, ast.Delete)
        for target in node.targets
        if isinstance(target, ast.Name)
    )


def choose_inputs(
    source: str,
    namespace: Mapping[str, object],
    explicit: Iterable[str] | str | None = None,
) -> list[str]:
    """The kernel's names to ship into the worker before the cell runs.

    ``explicit`` is the user's ``--in`` (a list, or ``"a,b"``) and replaces the
    automatic choice entirely; each name in it has to exist in ``namespace``.
    """
    if explicit is not None:
        chosen = _explicit_names(explicit, "--in")
        missing = [name for name in chosen if name not in namespace]
        if missing:
            # A bad argument to the magic rather than a failing cell, and
            # reported as the other bad ``--in`` values are.
            raise ValueError(_not_defined_message(missing))
        return chosen
    return sorted(
        name for name in names_read(source) if name in namespace and not _is_bookkeeping(name)
    )


#: Among a cell's outputs: and every other name the cell bound, as the worker
#: finds them once it ran (:func:`fluksio_nb.worker.main.names_bound_by_cell`).
EVERY_NAME_BOUND = "*"


def choose_outputs(source: str, explicit: Iterable[str] | str | None = None) -> list[str]:
    """The worker's names to ship back to the kernel when the cell ends.

    Names starting with ``_`` stay behind, as they would from a module's
    ``import *``: they are the cell's scratch. ``explicit`` is the user's
    ``--out`` and replaces the automatic choice entirely. A cell that binds
    names its source does not show (``from m import *``, ``exec``,
    ``globals()``) asks for :data:`EVERY_NAME_BOUND` as well.
    """
    if explicit is not None:
        return _explicit_names(explicit, "--out")
    chosen = sorted(name for name in names_written(source) if not name.startswith("_"))
    return [*chosen, EVERY_NAME_BOUND] if binds_unseen_names(source) else chosen


@functools.lru_cache(maxsize=32)
def binds_unseen_names(source: str) -> bool:
    """Whether the cell may bind names its source does not show, at its top level."""
    for node in _scope_nodes(parse_cell(source).body):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("exec", "globals")
        ):
            return True
    return False


def choose_if_changed(source: str, inputs: Iterable[str], outputs: Iterable[str]) -> list[str]:
    """The inputs to bring back only if the cell changed them in place.

    Those a call may have changed: ``rows.append(r)`` or
    ``random.shuffle(deck)`` binds nothing, yet a normal cell leaves the
    list changed. Whether it did change is the worker's to tell, after the
    cell, by pickling it again; one that did not stays the kernel's own
    object. Erring wide costs that pickle, or for an array nothing (it comes
    back by reference); erring narrow loses the user's change without a word.
    """
    return sorted((names_changed_by_calls(source) & set(inputs)) - set(outputs))


@functools.lru_cache(maxsize=32)
def names_changed_by_calls(source: str) -> frozenset[str]:
    """Names whose object a call may change, in any scope of the cell that sees them."""
    body = parse_cell(source).body
    changed: set[str] = set()
    for node in _scope_nodes(body):
        changed |= _handed_to_call(node)
        if isinstance(node, _SCOPES):
            changed |= _scope_effects(node, frozenset()).handed_to_calls
    return frozenset(changed)


@functools.lru_cache(maxsize=32)
def names_never_rebound(source: str) -> frozenset[str]:
    """Names the cell writes to only through their object: ``data *= 2``, ``data[0] = 1``.

    Such a name still holds the object it held before the cell, changed in
    place when the object allows it, as an array does: in a normal cell its
    views and every other name for it see the change.
    """
    body = parse_cell(source).body
    augmented = [
        node.target
        for node in _scope_nodes(body)
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)
    ]
    stored = {name for node in _scope_nodes(body) if (name := _stored_into(node)) is not None}
    rebound = _module_writes(
        body, leaving_out={id(target) for target in augmented}, through_objects=False
    )
    return frozenset({target.id for target in augmented} | stored) - rebound - names_deleted(source)


def _is_bookkeeping(name: str) -> bool:
    return (
        name in IPYTHON_NAMES
        or _INPUT_HISTORY.fullmatch(name) is not None
        or (name.startswith("__") and name.endswith("__"))
    )


def _explicit_names(explicit: Iterable[str] | str, option: str) -> list[str]:
    if isinstance(explicit, str):
        explicit = explicit.split(",")
    chosen: list[str] = []
    for raw in explicit:
        name = raw.strip()
        if not name:
            continue
        if not name.isidentifier():
            raise ValueError(
                f"{option} names {name!r}, which is not a Python name; "
                f"give names separated by commas, as in {option} a,b."
            )
        if name not in chosen:
            chosen.append(name)
    return chosen


def _not_defined_message(missing: list[str]) -> str:
    quoted = " and ".join(repr(name) for name in missing)
    if len(missing) == 1:
        return (
            f"--in names {quoted}, which is not defined in this kernel; "
            "define it first or drop it from --in."
        )
    return (
        f"--in names {quoted}, which are not defined in this kernel; "
        "define them first or drop them from --in."
    )


# -- what IPython reads --------------------------------------------------------------


def _ipython_reads(node: ast.Call) -> set[str]:
    """Names IPython itself looks up to run one translated magic or shell line."""
    magic = ipython_call(node)
    if magic is None:
        return set()
    method, texts = magic
    if method in ("run_line_magic", "run_cell_magic"):
        name, texts = (texts[0] if texts else ""), texts[1:]
    else:
        name = ""
    reads: set[str] = set()
    for text in texts:
        reads |= _interpolated_names(text)
    if name in _MAGICS_RUNNING_CODE and texts:
        code = code_after_options(texts[0]) if len(texts) == 1 else parse_quietly(texts[-1])
        if code is not None:
            reads |= _free_reads(code.body)
    return reads


def _interpolated_names(text: str) -> set[str]:
    names = set(_DOLLAR_NAME.findall(text))
    for expression in _BRACED_EXPRESSION.findall(text):
        parsed = parse_quietly(expression, mode="eval")
        if parsed is not None:
            names |= _free_reads([parsed.body])
    return names


# -- scopes --------------------------------------------------------------------------


def _scope_nodes(roots: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node evaluated in the scope `roots` belong to.

    A nested scope is yielded itself, and the parts of it its enclosing scope
    evaluates — decorators, defaults, base classes, a comprehension's first
    iterable — are walked as this scope's.
    """
    stack = list(roots)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _SCOPES):
            stack.extend(_evaluated_outside(node))
        else:
            stack.extend(ast.iter_child_nodes(node))


def _evaluated_outside(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, _COMPREHENSIONS):
        return [node.generators[0].iter]
    if isinstance(node, ast.ClassDef):
        return [*node.decorator_list, *node.bases, *node.keywords]
    arguments = node.args
    outside: list[ast.AST] = [*arguments.defaults, *filter(None, arguments.kw_defaults)]
    if isinstance(node, ast.Lambda):
        return outside
    annotations = [argument.annotation for argument in _every_argument(arguments)]
    return [*node.decorator_list, *outside, *filter(None, [*annotations, node.returns])]


def _evaluated_inside(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, _COMPREHENSIONS):
        parts: list[ast.AST] = (
            [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        )
        for index, generator in enumerate(node.generators):
            parts += [generator.target, *generator.ifs]
            if index:
                parts.append(generator.iter)
        return parts
    if isinstance(node, ast.Lambda):
        return [node.body]
    return list(node.body)


def _parameters(node: ast.AST) -> set[str]:
    if isinstance(node, _COMPREHENSIONS):
        return {name for g in node.generators for name in _target_names(g.target)}
    if isinstance(node, ast.ClassDef):
        return set()
    return {argument.arg for argument in _every_argument(node.args)}


def _every_argument(arguments: ast.arguments) -> list[ast.arg]:
    return [
        *arguments.posonlyargs,
        *arguments.args,
        *filter(None, [arguments.vararg, arguments.kwarg]),
        *arguments.kwonlyargs,
    ]


def _target_names(target: ast.AST) -> set[str]:
    return {
        node.id
        for node in ast.walk(target)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }


def _bound_by(node: ast.AST) -> set[str]:
    """Names one node binds in the scope it is evaluated in."""
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return {node.id}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        # ``import a.b`` binds ``a``; ``from m import *`` binds what cannot be known here.
        return {
            alias.asname or alias.name.partition(".")[0]
            for alias in node.names
            if alias.name != "*"
        }
    if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
        return {node.name}
    if isinstance(node, ast.MatchMapping) and node.rest:
        return {node.rest}
    if isinstance(node, _COMPREHENSIONS):
        return _walrus_targets(node)
    type_alias = getattr(ast, "TypeAlias", None)
    if type_alias is not None and isinstance(node, type_alias):
        return _target_names(node.name)
    return set()


def _walrus_targets(comprehension: ast.AST) -> set[str]:
    # A walrus inside a comprehension binds in the scope around it (PEP 572).
    targets: set[str] = set()
    stack = _evaluated_inside(comprehension)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.NamedExpr):
            targets.add(node.target.id)
        if not isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return targets


def _stored_into(node: ast.AST) -> str | None:
    """The name whose object ``name[k] = v`` or ``name.attr = v`` changes."""
    if not (
        isinstance(node, (ast.Subscript, ast.Attribute))
        and isinstance(node.ctx, (ast.Store, ast.Del))
    ):
        return None
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _handed_to_call(node: ast.AST) -> set[str]:
    """The names whose object a call node could change.

    The object a method is called on (``tables[k].clear()`` clears part of
    ``tables``), and every argument's, unless the function is a builtin that
    only reads (:data:`_READ_ONLY_BUILTINS`). A call's result is a new
    object: in ``model.fit(X, y).score(X, y)`` it is the inner call, a node of
    its own, that changes ``model``.
    """
    if not isinstance(node, ast.Call):
        return set()
    handed: list[ast.AST] = []
    if isinstance(node.func, ast.Attribute):
        handed.append(node.func.value)
    if not (isinstance(node.func, ast.Name) and node.func.id in _READ_ONLY_BUILTINS):
        handed += [*node.args, *(keyword.value for keyword in node.keywords)]
    names = set()
    for expression in handed:
        while isinstance(expression, (ast.Subscript, ast.Attribute, ast.Starred)):
            expression = expression.value
        if isinstance(expression, ast.Name):
            names.add(expression.id)
    return names


def _name_read(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Load, ast.Del)):
        return node.id
    if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def _declared(body: list[ast.AST], kind: type) -> set[str]:
    return {name for node in _scope_nodes(body) if isinstance(node, kind) for name in node.names}


class _Effects(NamedTuple):
    reads: set[str]
    writes: set[str]
    #: Names whose object a call may change.
    handed_to_calls: set[str]


def _scope_effects(scope: ast.AST, enclosing: frozenset[str]) -> _Effects:
    """What a function, class or comprehension does with the cell's namespace.

    ``enclosing`` holds the names local to the functions around it, which its
    own free names resolve to before they reach the cell's namespace.
    """
    inside = _evaluated_inside(scope)
    declared_global = _declared(inside, ast.Global)
    bindings = _parameters(scope)
    # A comprehension binds only its loop variables; a walrus in it binds
    # in the scope around it.
    if not isinstance(scope, _COMPREHENSIONS):
        for node in _scope_nodes(inside):
            bindings |= _bound_by(node)
            # ``del x`` makes x local, as an assignment would.
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Del):
                bindings.add(node.id)
        bindings -= _declared(inside, ast.Nonlocal)
    # A class body falls back to the cell's namespace for a name it has not
    # bound yet, and whether it has depends on order: every name it reads is
    # taken as a read. Nor do its names enclose the methods defined in it.
    local = frozenset() if isinstance(scope, ast.ClassDef) else frozenset(bindings)
    visible = (enclosing | local) - declared_global
    # A function declaring ``global x`` may read x too, and shipping x in means
    # it still comes back unchanged if the function is never called.
    effects = _Effects(
        reads=set(declared_global), writes=bindings & declared_global, handed_to_calls=set()
    )
    for node in _scope_nodes(inside):
        for found, name in (
            (effects.reads, _name_read(node)),
            (effects.writes, _stored_into(node)),
        ):
            if name is not None and name not in visible:
                found.add(name)
        effects.handed_to_calls.update(_handed_to_call(node) - visible)
        if isinstance(node, ast.Call):
            effects.reads.update(_ipython_reads(node) - visible)
        if isinstance(node, _SCOPES):
            nested = _scope_effects(node, enclosing if isinstance(scope, ast.ClassDef) else visible)
            for mine, theirs in zip(effects, nested, strict=True):
                mine |= theirs
    return effects


def _free_reads(roots: Iterable[ast.AST]) -> set[str]:
    """Names top-level code reads from the cell's namespace, bound or not."""
    reads: set[str] = set()
    for node in _scope_nodes(roots):
        name = _name_read(node)
        if name is not None:
            reads.add(name)
        if isinstance(node, ast.Call):
            reads |= _ipython_reads(node)
        if isinstance(node, _SCOPES):
            reads |= _scope_effects(node, frozenset()).reads
    return reads


def _module_writes(
    body: list[ast.stmt], leaving_out: Iterable[int] = (), through_objects: bool = True
) -> set[str]:
    """The names the cell's top level writes, less the nodes whose ids are in ``leaving_out``.

    ``through_objects`` counts ``name[k] = v`` and ``name.attr = v`` as writes of ``name``.
    """
    writes: set[str] = set()
    nodes = list(_scope_nodes(body))
    # ``x: int`` makes x local in a function, but binds nothing.
    skipped = {
        id(node.target) for node in nodes if isinstance(node, ast.AnnAssign) and node.value is None
    }
    skipped.update(leaving_out)
    for node in nodes:
        if id(node) in skipped:
            continue
        writes |= _bound_by(node)
        name = _stored_into(node) if through_objects else None
        if name is not None:
            writes.add(name)
        if isinstance(node, _SCOPES):
            writes |= _scope_effects(node, frozenset()).writes
    return writes


# -- order at top level ----------------------------------------------------------------


class _TopLevelFlow:
    """Follows the cell's top level in order, to drop reads of names it bound first.

    ``bound`` is what is certainly bound at a point on every path to it; each
    method takes it on entry and returns it on exit.
    """

    def __init__(self) -> None:
        self.reads: set[str] = set()

    def block(self, body: list[ast.stmt], bound: set[str]) -> set[str]:
        for statement in body:
            bound = self.statement(statement, bound)
        return bound

    def read(self, nodes: Iterable[ast.AST | None], bound: set[str]) -> None:
        self.reads |= _free_reads(node for node in nodes if node is not None) - bound

    def statement(self, node: ast.stmt, bound: set[str]) -> set[str]:
        handler = getattr(self, f"_{type(node).__name__}", None)
        if handler is not None:
            return handler(node, bound)
        self.read([node], bound)
        # Only what every run of the statement binds; a walrus inside an
        # ``and`` or a comprehension may not run, so it is left out entirely.
        if isinstance(node, ast.Assign):
            return bound | {name for target in node.targets for name in _target_names(target)}
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            return bound | _target_names(node.target)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return bound | {node.name}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return bound | _bound_by(node)
        return bound

    def _If(self, node: ast.If, bound: set[str]) -> set[str]:
        self.read([node.test], bound)
        return self.block(node.body, set(bound)) & self.block(node.orelse, set(bound))

    def _For(self, node: ast.For, bound: set[str]) -> set[str]:
        # The body may run no times, so nothing it binds is certain after the
        # loop. Within one pass, order holds on every pass.
        self.read([node.iter], bound)
        self.read([node.target], bound)
        self.block(node.body, bound | _target_names(node.target))
        self.block(node.orelse, set(bound))
        return bound

    _AsyncFor = _For

    def _While(self, node: ast.While, bound: set[str]) -> set[str]:
        self.read([node.test], bound)
        self.block(node.body, set(bound))
        self.block(node.orelse, set(bound))
        return bound

    def _With(self, node: ast.With, bound: set[str]) -> set[str]:
        # The body is taken to run to its end. Only a context manager that
        # swallows exceptions gets past it otherwise, and doubting every
        # ``with open(...)`` would ship back in whatever it read on a re-run.
        bound = set(bound)
        for item in node.items:
            self.read([item.context_expr, item.optional_vars], bound)
            if item.optional_vars is not None:
                bound |= _target_names(item.optional_vars)
        return self.block(node.body, bound)

    _AsyncWith = _With

    def _Try(self, node: ast.Try, bound: set[str]) -> set[str]:
        # A handler may start from any point in the body, so it can count
        # only on what was bound before the ``try``.
        completed = self.block(node.orelse, self.block(node.body, set(bound)))
        outcomes = [completed]
        for handler in node.handlers:
            self.read([handler.type], bound)
            caught = bound | ({handler.name} if handler.name else set())
            outcomes.append(self.block(handler.body, caught) - {handler.name})
        after = set.intersection(*outcomes)
        return after | self.block(node.finalbody, set(bound))

    _TryStar = _Try

    def _Match(self, node: ast.AST, bound: set[str]) -> set[str]:
        self.read([node.subject], bound)
        for case in node.cases:
            self.read([case.pattern], bound)
            captured = bound | {name for part in ast.walk(case.pattern) for name in _bound_by(part)}
            self.read([case.guard], captured)
            self.block(case.body, captured)
        return bound
