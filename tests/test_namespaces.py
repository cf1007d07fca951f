"""Notebook functions and classes that arrive by value, bound to the namespace they arrive in.

Each value makes the real trip: defined by ``exec`` in a namespace that is a
notebook's ``__main__``, pickled by cloudpickle as the kernel pickles it, and
rebuilt here.
"""

import textwrap

import cloudpickle

from fluksio_nb.namespaces import at_home, globals_assigned, globals_carried


def notebook(source: str) -> dict:
    """A namespace that is a notebook's: what ``source`` defined in ``__main__``."""
    namespace = {"__name__": "__main__"}
    exec(textwrap.dedent(source), namespace)
    return namespace


def sent(value):
    """``value`` as the other side rebuilds it."""
    return cloudpickle.loads(cloudpickle.dumps(value))


def test_a_function_sent_by_value_reads_the_namespace_it_arrives_in():
    kernel = notebook(
        """
        K = 1
        def scaled(x):
            return x * K
        """
    )
    arrived = sent(kernel["scaled"])
    worker = {"__name__": "__main__"}
    assert globals_carried(arrived, worker) == {"K": 1}
    settled = at_home(arrived, worker)
    worker["K"] = 5
    assert settled(2) == 10
    assert settled.__globals__ is worker
    assert arrived(2) == 2, "the function as cloudpickle rebuilt it keeps the globals it was sent"


def test_a_decorated_function_reads_the_namespace_down_to_the_function_it_wraps():
    kernel = notebook(
        """
        import functools
        offset = 1
        def logged(f):
            @functools.wraps(f)
            def inner(*args):
                return f(*args)
            return inner
        @logged
        def shifted(x):
            return x + offset
        def countdown(n):
            return n if n <= 0 else countdown(n - offset)
        def walker():
            def walk(n):
                return n if n <= 0 else walk(n - offset)
            return walk
        walk = walker()
        """
    )
    home = {"__name__": "__main__", "offset": 100}
    assert at_home(sent(kernel["shifted"]), home)(0) == 100
    # Bound under its own name, as the kernel binds what comes back, it calls itself there.
    home["countdown"] = at_home(sent(kernel["countdown"]), home)
    assert home["countdown"](250) == -50
    # An inner function that calls itself holds itself in its closure.
    assert at_home(sent(kernel["walk"]), home)(250) == -50


def test_a_class_keeps_its_identity_and_its_methods_read_the_namespace():
    kernel = notebook(
        """
        BASE = 1
        class Meter:
            def read(self):
                return BASE + 1
            @staticmethod
            def unit():
                return BASE
            @classmethod
            def make(cls):
                return cls()
            @property
            def level(self):
                return BASE * 2
        """
    )
    arrived = sent(kernel["Meter"])
    home = {"__name__": "__main__", "BASE": 10}
    assert at_home(arrived, home) is arrived
    meter = arrived.make()
    assert (meter.read(), arrived.unit(), meter.level) == (11, 10, 20)


def test_what_a_module_defined_or_the_namespace_owns_is_left_alone():
    home = notebook("def mine(x):\n    return x")
    assert at_home(home["mine"], home) is home["mine"]
    assert at_home(textwrap.dedent, home) is textwrap.dedent
    assert globals_carried(textwrap.dedent, home) == {}
    assert at_home([1, 2], home) == [1, 2]


def test_the_globals_a_function_assigns_are_found_through_what_it_calls():
    home = notebook(
        """
        import textwrap
        def note(x):
            global calls
            calls = [x]
        def bump():
            global counter
            counter = 1
            note(counter)
            textwrap.dedent("")
            return [total := n for n in range(3)]
        def reads_only():
            return counter
        """
    )
    assert globals_assigned([home["bump"]], home) == {"counter", "calls"}
    assert globals_assigned([home["reads_only"], 3, textwrap.dedent], home) == set()
