"""A claimed cell's traceback comes in the kernel's own colour scheme, whichever it is.

The failure guarded against: the worker formatted every traceback in
IPython's Linux scheme, a dark terminal's palette, so a claimed cell's error
was near white on JupyterLab's light error background while the same error in
a plain cell read, and ``%colors`` changed plain cells' tracebacks only.
"""

import re

import pytest

from tests.kernels import started_kernel

pytestmark = pytest.mark.timeout(120)

FAILING = "x = 1\ndef divide(a):\n    return a / 0\ndivide(x)"
#: An ANSI colour (the codes in ``\x1b[...m``) and the text it colours.
_COLOURED = re.compile(r"\x1b\[([0-9;]*)m([^\x1b]*)")


def colours(traceback: list[str]) -> set[str]:
    """The colours that text is shown in: a colour given to spaces alone is seen nowhere."""
    return {
        code
        for line in traceback
        for code, text in _COLOURED.findall(line)
        if text.strip() and code not in ("39", "49", "39;49", "0", "")
    }


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with started_kernel(
        tmp_path_factory.mktemp("kernel"), FLUKSIO_CPUS="2", FLUKSIO_RESERVE_CPUS="0"
    ) as k:
        k.run("%load_ext fluksio_nb")
        yield k


def test_a_claimed_traceback_uses_only_the_kernels_colours(kernel):
    """Every colour in a claimed cell's traceback is one IPython's Neutral scheme uses.

    Against the same error raised in the kernel itself; the failing expression,
    marked on yellow where IPython finds the source, is the one addition.
    """
    plain = kernel.run(FAILING).error
    claimed = kernel.run("%%claim cpus=1\n" + FAILING).error
    assert plain is not None and claimed is not None
    foreign = colours(claimed["traceback"]) - colours(plain["traceback"]) - {"30;43"}
    assert foreign == set(), f"colours the kernel's own traceback never uses: {foreign}"


def test_a_claimed_traceback_follows_colors_changed_in_the_kernel(kernel):
    """After ``%colors nocolor`` a claimed traceback has no colour at all, as the kernel's."""
    kernel.run("%colors nocolor")
    try:
        claimed = kernel.run("%%claim cpus=1\n" + FAILING).error
        assert claimed is not None and "ZeroDivisionError" in claimed["traceback"][-1]
        assert colours(claimed["traceback"]) == set(), claimed["traceback"]
    finally:
        kernel.run("%colors neutral")
