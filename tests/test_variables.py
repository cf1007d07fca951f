"""Which names a claimed cell ships into its worker, and which come back."""

import textwrap

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fluksio_nb.cell_syntax import CellSyntaxError
from fluksio_nb.variables import (
    EVERY_NAME_BOUND,
    choose_if_changed,
    choose_inputs,
    choose_outputs,
    names_never_rebound,
    names_read,
    names_written,
)


def cell(source: str) -> str:
    return textwrap.dedent(source).strip("\n") + "\n"


# -- names read ----------------------------------------------------------------------


def test_a_name_read_before_the_cell_binds_it_is_shipped_in():
    """Guards against a re-bound name being mistaken for one the cell made itself."""
    assert "total" in names_read(cell("print(total)\ntotal = 0"))


def test_a_name_bound_before_it_is_read_is_not_shipped_in():
    """Guards against shipping the kernel's stale copy of a name the cell overwrites."""
    assert "total" not in names_read(cell("total = 0\nprint(total)"))


def test_a_global_read_by_a_function_defined_in_the_cell_is_shipped_in():
    """Guards against a NameError in the worker when the cell calls its own function."""
    source = cell(
        """
        def scale(x):
            return x * factor + offset
        offset = 1
        scale(2)
        """
    )
    assert {"factor", "offset"} <= names_read(source)


def test_a_functions_own_parameters_and_locals_are_not_shipped_in():
    """Guards against shipping a kernel variable that only shares a name with a local."""
    source = cell(
        """
        def clean(frame):
            data = frame.dropna()
            del frame
            for row in data:
                pass
            return data
        """
    )
    assert names_read(source).isdisjoint({"frame", "data", "row"})


def test_a_nested_functions_free_name_resolves_to_the_function_around_it():
    """Guards against shipping a closure variable that never reaches the kernel."""
    source = cell(
        """
        def outer():
            step = 1
            def inner():
                return step + limit
            return inner
        """
    )
    assert names_read(source) == {"limit"}


def test_comprehension_and_lambda_variables_are_not_shipped_in():
    """Guards against shipping `i` or `row` because a comprehension loops over them."""
    source = cell(
        """
        squares = [i * i for i in range(n) if i > low]
        pick = lambda row, col=default: row[col] + bias
        """
    )
    assert names_read(source) == {"range", "n", "low", "default", "bias"}


def test_augmented_assignment_and_del_read_the_name():
    """Guards against `x += 1` or `del x` failing in the worker for want of x."""
    assert {"count", "scratch"} <= names_read(cell("count += 1\ndel scratch"))


def test_a_name_bound_on_only_one_path_is_still_shipped_in():
    """Guards against trusting a binding that the branch not taken never made."""
    source = cell(
        """
        if fresh:
            model = build()
        try:
            value = parse(text)
        except ValueError:
            pass
        model.fit(value)
        """
    )
    assert {"model", "value"} <= names_read(source)


def test_a_name_bound_on_every_path_is_not_shipped_in():
    """Guards against shipping a name that an if/else or a try/except always binds first."""
    source = cell(
        """
        if fast:
            solver = "lbfgs"
        else:
            solver = "newton"
        try:
            import ujson as json
        except ImportError:
            import json
        print(solver, json)
        """
    )
    assert names_read(source).isdisjoint({"solver", "json"})


def test_a_name_bound_in_a_loop_body_is_not_trusted_after_the_loop():
    """Guards against a NameError when the loop runs no times and the kernel's value was needed."""
    source = cell(
        """
        for batch in batches:
            last = batch
        print(last, batch)
        """
    )
    assert {"last", "batch"} <= names_read(source)


def test_a_name_declared_global_in_a_function_is_shipped_both_ways():
    """Guards against losing a counter that a function in the cell updates."""
    source = cell(
        """
        def tick():
            global calls
            calls = calls + 1
        """
    )
    assert "calls" in names_read(source)
    assert "calls" in names_written(source)


def test_a_class_body_reads_what_it_mentions():
    """Guards against a class defined in the cell missing a global its body uses."""
    source = cell(
        """
        class Config(Base):
            size = default_size
            def area(self):
                return self.size * scale
        """
    )
    assert {"Base", "default_size", "scale"} <= names_read(source)


def test_time_magic_is_read_as_the_code_it_runs():
    """Guards against `%time x = f()` shipping nothing in and bringing nothing back."""
    source = cell("%time result = fit(data)\nprint(result)")
    assert {"fit", "data"} <= names_read(source)
    assert "result" not in names_read(source)
    assert "result" in names_written(source)


def test_timeit_reads_its_code_but_binds_nothing():
    """Guards against `%timeit -n 3 y = f(a)` missing `f` and `a`, or claiming to bind `y`."""
    source = cell("%timeit -n 3 -r 2 y = f(a)")
    assert {"f", "a"} <= names_read(source)
    assert names_written(source) == set()


def test_names_interpolated_into_shell_lines_and_magics_are_read():
    """Guards against `!ls {path}` listing the wrong directory because `path` stayed behind."""
    assert {"path", "pattern", "workdir"} <= names_read(
        cell("!ls {path} $pattern $$HOME\n%cd {workdir}")
    )
    assert "HOME" not in names_read(cell("!echo $$HOME"))


def test_captured_shell_output_comes_back():
    """Guards against `files = !ls` leaving `files` in the worker."""
    assert names_written(cell("files = !ls $where")) == {"files"}


def test_top_level_await_is_understood():
    """Guards against a cell using `await` being refused as a syntax error."""
    assert names_read(cell("reply = await client.get(url)")) == {"client", "url"}


def test_a_syntax_error_names_the_line_of_the_cell():
    """Guards against a typo surfacing as a crash deep inside the claim machinery."""
    with pytest.raises(CellSyntaxError) as raised:
        names_read(cell("x = 1\ny = = 2\nz = 3"))
    assert raised.value.lineno == 2
    assert "line 2 of the cell" in str(raised.value)
    assert "y = = 2" in str(raised.value)


# -- names written -------------------------------------------------------------------


def test_a_name_bound_in_a_for_loop_comes_back():
    """Guards against losing the loop variable and what the body bound."""
    source = cell(
        """
        for step, batch in enumerate(batches):
            loss = train(batch)
        """
    )
    assert names_written(source) == {"step", "batch", "loss"}


def test_every_name_an_unpacking_binds_comes_back():
    """Guards against `(a, *rest), b = ...` returning only some of its names."""
    source = cell(
        """
        (first, *rest), last = rows
        if (match := find(rows)) is not None:
            found: bool = True
        """
    )
    assert names_written(source) == {"first", "rest", "last", "match", "found"}


def test_imports_bind_the_names_python_binds():
    """Guards against `import a.b` being recorded as `a.b`, which cannot be shipped."""
    source = cell(
        """
        import os.path
        import numpy as np
        from collections import OrderedDict as Ordered
        from math import *
        """
    )
    assert names_written(source) == {"os", "np", "Ordered"}


def test_definitions_and_with_targets_come_back():
    """Guards against a function, class or opened handle defined in the cell going missing."""
    source = cell(
        """
        def model(x):
            hidden = x
            return hidden
        class Net:
            width = 3
        with open(path) as handle, lock:
            text = handle.read()
        """
    )
    assert names_written(source) == {"model", "Net", "handle", "text"}


def test_an_exception_name_does_not_come_back():
    """Guards against asking the worker for `error`, which Python deleted after the handler."""
    source = cell(
        """
        try:
            run()
        except ValueError as error:
            message = str(error)
        """
    )
    assert names_written(source) == {"message"}


def test_an_annotation_without_a_value_binds_nothing():
    """Guards against asking the worker for a name that `x: int` never bound."""
    assert names_written(cell("x: int")) == set()


def test_a_name_stored_into_comes_back():
    """Guards against `table[k] = v` changing the worker's table and not the kernel's."""
    source = cell(
        """
        table["key"] = 1
        model.weights.data = new
        def remember(k, v):
            cache[k] = v
        """
    )
    assert {"table", "model", "cache"} <= names_written(source)


def test_an_input_a_call_may_change_is_a_candidate_to_come_back():
    """Guards against `rows.append(r)` or `random.shuffle(deck)` changing only the worker's copy."""
    source = cell(
        """
        rows.append(1)
        model.fit(X, y=y)
        estimator.fit(X, y).score(X, y)
        for key in keys:
            tables[key].clear()
        def log(line):
            logs.append(line)
        def local(rows_too):
            rows_too.append(1)
        last = stack.pop()
        draw = rng.random()
        random.shuffle(deck)
        heapq.heappush(heap[0], 3)
        step(*states)
        print(plain, len(sized), sorted(ordered))
        fresh = []
        fresh.append(1)
        """
    )
    inputs = [
        *("rows", "model", "estimator", "X", "y", "keys", "tables", "logs", "stack", "rng"),
        *("random", "deck", "heapq", "heap", "step", "states", "plain", "sized", "ordered"),
    ]
    outputs = choose_outputs(source)
    changed = choose_if_changed(source, inputs, outputs)
    # `random` and `heapq` are modules here, which the worker never sends back.
    assert changed == [
        *("X", "deck", "estimator", "heap", "heapq", "logs", "model", "random"),
        *("rng", "rows", "stack", "states", "tables", "y"),
    ]


def test_a_name_changed_only_through_its_object_is_told_from_one_bound_anew():
    """Guards against `data *= 2` replacing the kernel's array, and `data = data * 2` not."""
    source = cell(
        """
        data *= 2
        table["key"] = 1
        grid[mask] += 1
        model.weights = new
        scaled = scaled * 2
        counts += 1
        counts = counts[:3]
        for row in rows:
            row += 1
        dropped[0] = 1
        del dropped
        def reset():
            global weights
            weights = None
        weights[0] = 0
        """
    )
    assert names_never_rebound(source) == {"data", "table", "grid", "model"}


@pytest.mark.parametrize(
    ("source", "unseen"),
    [
        ("from math import *", True),
        ("exec('x = 1')", True),
        ("globals()['x'] = 1", True),
        ("for k in keys:\n    globals()[k] = 0", True),
        ("from math import sqrt\nx = eval('1')", False),
        ("def f():\n    exec('y = 1')", False),
    ],
)
def test_a_cell_binding_names_out_of_sight_asks_for_every_name_it_bound(source, unseen):
    """Guards against `from m import *` or `exec` in a claimed cell bringing nothing back."""
    outputs = choose_outputs(cell(source))
    assert (EVERY_NAME_BOUND in outputs) is unseen, outputs


def test_a_walrus_in_a_comprehension_binds_in_the_cell():
    """Guards against losing `last`, which PEP 572 binds outside the comprehension."""
    assert names_written(cell("[last := row for row in rows]")) == {"last"}


def test_names_captured_by_a_match_come_back():
    """Guards against a structural-pattern capture being left in the worker."""
    source = cell(
        """
        match event:
            case {"kind": kind, **details}:
                pass
            case Point(x=0, y=height):
                pass
        """
    )
    assert names_written(source) == {"kind", "details", "height"}


# -- what travels --------------------------------------------------------------------


def test_inputs_are_the_names_read_that_the_kernel_has():
    """Guards against asking the kernel to ship builtins or names nobody defined."""
    namespace = {"data": [1, 2], "unrelated": 3}
    assert choose_inputs(cell("print(len(data), missing)"), namespace) == ["data"]


def test_ipython_bookkeeping_never_travels():
    """Guards against shipping the kernel's history, which is big and partly unpicklable."""
    namespace = {name: 0 for name in ("In", "Out", "_", "_i3", "_ii", "__name__", "_oh")}
    namespace |= {"get_ipython": print, "_10": 1, "_idx": 2}
    source = cell("print(In, Out, _, _i3, _ii, __name__, _oh, _10, _idx)\n!ls")
    assert choose_inputs(source, namespace) == ["_10", "_idx"]


def test_explicit_inputs_replace_the_automatic_choice():
    """Guards against `--in a` still shipping everything else the cell mentions."""
    namespace = {"a": 1, "b": 2, "big": 3}
    assert choose_inputs(cell("print(a, big)"), namespace, explicit="a, b") == ["a", "b"]
    assert choose_inputs(cell("print(a, big)"), namespace, explicit=[]) == []


def test_an_explicit_input_the_kernel_lacks_is_a_clear_error():
    """Guards against a typo in `--in` turning into a NameError inside the worker."""
    with pytest.raises(ValueError) as raised:
        choose_inputs(cell("print(a)"), {"a": 1}, explicit=["a", "foo"])
    assert str(raised.value).startswith("--in names 'foo', which is not defined in this kernel")


def test_an_explicit_name_that_is_not_a_name_is_refused():
    """Guards against `--out a.b` being accepted and then never coming back."""
    with pytest.raises(ValueError, match=r"'a\.b', which is not a Python name"):
        choose_outputs(cell("a = 1"), explicit="a.b")


def test_private_names_do_not_come_back():
    """Guards against the cell's `_scratch` overwriting the kernel's."""
    assert choose_outputs(cell("_scratch = 1\nresult = 2\n__dunder__ = 3")) == ["result"]


def test_explicit_outputs_replace_the_automatic_choice():
    """Guards against `--out c` still shipping back every other name the cell bound."""
    assert choose_outputs(cell("a = 1\nc = 2"), explicit=["c", "c"]) == ["c"]
    assert choose_outputs(cell("a = 1\nc = 2"), explicit=[]) == []


# -- against Python itself -----------------------------------------------------------

NAMES = ("a", "b", "c", "d", "e", "f", "g", "h")
SHORT = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

names = st.sampled_from(NAMES)


def expressions(extra=()):
    # Mostly one name or none: a program that reads everything in its first
    # line leaves nothing for the order of its bindings to decide.
    read = st.lists(st.sampled_from(NAMES + extra), max_size=1)
    return st.tuples(read, st.integers(0, 6)).map(
        lambda p: f"({' + '.join([*p[0], str(p[1])])}) % 7"
    )


def statement(template, **parts):
    """One statement, from a template whose fields are drawn from `parts`."""
    return st.fixed_dictionaries(parts).map(lambda drawn: template.format(**drawn).split("\n"))


simple_statements = st.one_of(
    statement("{n} = {e}", n=names, e=expressions()),
    statement("{n} = {m} = {e}", n=names, m=names, e=expressions()),
    statement("{n} += {e}", n=names, e=expressions()),
    statement("del {n}", n=names),
    statement("{n} = 1 // ({e} % 2)", n=names, e=expressions()),
    statement("{n} = sum([{e} for i in range(2)])", n=names, e=expressions(extra=("i",))),
    statement("{n} = (lambda {p}: {e})({f})", n=names, p=names, e=expressions(), f=expressions()),
    statement(
        "def helper({p}):\n    {n} = {p} + 1\n    return {e}\n{n} = helper({f})",
        n=names,
        p=names,
        e=expressions(),
        f=expressions(),
    ),
    statement("def setter():\n    global {n}\n    {n} = {e}\nsetter()", n=names, e=expressions()),
    statement("def getter():\n    return {e}\n{n} = getter()", n=names, e=expressions()),
)


def indented(block):
    return ["    " + line for line in block]


def compound_statements(inner):
    return st.one_of(
        st.tuples(st.integers(0, 6), inner, inner).map(
            lambda p: [f"if {p[0]} > 2:", *indented(p[1]), "else:", *indented(p[2])]
        ),
        st.tuples(names, st.integers(0, 2), inner).map(
            lambda p: [f"for {p[0]} in range({p[1]}):", *indented(p[2])]
        ),
        st.tuples(inner, st.integers(0, 1), inner).map(
            lambda p: [
                "try:",
                f"    1 // {p[1]}",
                *indented(p[0]),
                "except ZeroDivisionError:",
                *indented(p[2]),
            ]
        ),
        st.tuples(expressions(), names, inner).map(
            lambda p: [f"with nullcontext({p[0]}) as {p[1]}:", *indented(p[2])]
        ),
    )


def blocks_of(statements):
    return st.lists(statements, min_size=1, max_size=4).map(
        lambda parts: [line for part in parts for line in part]
    )


programs = st.recursive(
    blocks_of(simple_statements),
    lambda inner: blocks_of(st.one_of(simple_statements, compound_statements(inner))),
    max_leaves=20,
).map(
    # The last line reads every name, so a name wrongly taken as bound by then
    # is a NameError rather than a difference nobody looks at.
    lambda lines: "\n".join(
        ["from contextlib import nullcontext", *lines, f"seen = ({', '.join(NAMES)})", ""]
    )
)


def run(source, namespace):
    """The ints a program leaves behind, and the exception it stopped at, if any."""
    namespace = dict(namespace)
    try:
        exec(source, namespace)
    except Exception as error:
        stopped = type(error)
    else:
        stopped = None
    namespace.pop("__builtins__")
    return namespace, stopped


@SHORT
@given(programs)
def test_shipping_only_the_names_read_runs_a_program_the_same_way(source):
    """Guards against any read the analysis misses, checked by running the program."""
    everything = {name: index + 1 for index, name in enumerate(NAMES)}
    expected, stopped = run(source, everything)
    assume(stopped is None or not issubclass(stopped, NameError))
    shipped = {name: everything[name] for name in names_read(source) if name in everything}
    got, stopped_shipped = run(source, shipped)
    assert stopped_shipped is stopped
    assert {k: v for k, v in got.items() if isinstance(v, int)} == {
        k: v for k, v in expected.items() if isinstance(v, int) and k in got
    }


@SHORT
@given(programs)
def test_every_name_a_program_changes_is_among_the_names_written(source):
    """Guards against any binding the analysis misses, checked by running the program."""
    # Large ints are distinct objects, so any rebinding shows as a new identity.
    before = {name: index + 1000 for index, name in enumerate(NAMES)}
    after, _ = run(source, before)
    changed = {name for name, value in after.items() if before.get(name, after) is not value}
    assert changed <= names_written(source)
