"""A cell's text as Python, the way IPython would run it.

A cell holds what the user typed: magics, ``!cmd`` and all. Which names it
reads and binds (:mod:`fluksio_nb.variables`) is answered from a Python
syntax tree, so the text goes through IPython's own translation first, the
one the kernel would run it through. What is decided here:

- **A magic that runs code in the namespace, standing as a statement, is
  read as that code**: ``%time x = f()`` binds ``x`` as ``x = f()`` would.
  ``%timeit`` is not: it runs its statement inside a function, so what it
  assigns stays there.
- **A cell that is not Python is refused before it waits for its share**
  (:class:`CellSyntaxError`), on the user's own line, not the translation's;
  so is what only the compiler refuses, a ``return`` at the top level.
- **Code inside a magic that does not parse is read as none**
  (:func:`parse_quietly`): the magic says what is wrong when it runs.
"""

from __future__ import annotations

import ast
import functools

from IPython.core.inputtransformer2 import TransformerManager

#: Magics whose argument is Python run in the user namespace, and bound there.
#: ``%timeit`` runs its statement inside a function, so what it assigns stays there.
_MAGICS_BINDING_NAMES = frozenset({"time", "prun"})


class CellSyntaxError(SyntaxError):
    """The cell is not Python, even once IPython's own syntax is translated."""

    def __str__(self) -> str:
        # The message already names the line; SyntaxError would repeat it.
        return str(self.msg)


@functools.lru_cache(maxsize=32)
def parse_cell(source: str) -> ast.Module:
    """The cell's syntax tree as IPython would run it; :class:`CellSyntaxError` if there is none."""
    # Both choices parse the same cell one after the other; the tree is only read.
    try:
        python = TransformerManager().transform_cell(source)
        tree = compile(
            python,
            "<cell>",
            "exec",
            flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
            dont_inherit=True,
        )
        # Parsing alone lets through what only the compiler refuses — a
        # ``return`` or ``break`` at top level — which would otherwise surface
        # in the worker, after the cell waited for its share.
        compile(tree, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as error:
        raise _cell_syntax_error(error, source) from None
    return _InlineCodeMagics().visit(tree)


def _cell_syntax_error(error: SyntaxError, source: str) -> CellSyntaxError:
    lineno = error.lineno or 1
    lines = source.splitlines()
    # IPython's translation keeps line numbers for line magics and shell
    # escapes, so the user's own line is the one to show.
    text = lines[lineno - 1] if 0 < lineno <= len(lines) else (error.text or "")
    message = (
        f"line {lineno} of the cell is not valid Python ({error.msg}): "
        f"{text.strip()!r} — fix it and run the cell again"
    )
    return CellSyntaxError(message, ("<cell>", lineno, error.offset, text, None, None))


class _InlineCodeMagics(ast.NodeTransformer):
    """Reads ``%time x = f()`` as ``x = f()``, wherever it stands as a statement."""

    def visit_Expr(self, node: ast.Expr) -> ast.AST | list[ast.stmt]:
        magic = ipython_call(node.value)
        if magic is None:
            return node
        method, texts = magic
        if method == "run_line_magic" and len(texts) >= 2:
            name, code = texts[0], code_after_options(texts[1])
        elif method == "run_cell_magic" and len(texts) >= 3:
            name, code = texts[0], parse_quietly(texts[2])
        else:
            return node
        if name not in _MAGICS_BINDING_NAMES or code is None:
            return node
        return [self.visit(statement) for statement in code.body] or node


def ipython_call(node: ast.AST) -> tuple[str, list[str]] | None:
    """``get_ipython().method('text', ...)``, as translated IPython syntax reads."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "get_ipython"
    ):
        return None
    texts = [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
    if not all(isinstance(text, str) for text in texts):
        return None
    return node.func.attr, texts


def code_after_options(text: str) -> ast.Module | None:
    """The code a line magic runs, after its options; ``None`` if none of it parses."""
    # ``%timeit -n 10 -r 3 f(x)``: the options come first and are not Python,
    # so the code is the first tail of the line that parses.
    if not text.lstrip().startswith("-"):
        return parse_quietly(text.strip())
    words = text.split()
    for skipped in range(1, min(len(words), 6)):
        code = parse_quietly(" ".join(words[skipped:]))
        if code is not None:
            return code
    return None


def parse_quietly(text: str, mode: str = "exec") -> ast.AST | None:
    """``text``'s syntax tree, or ``None`` where it is not Python."""
    try:
        return ast.parse(text, mode=mode)
    except (SyntaxError, ValueError):
        return None
