"""``fluksio-nb``'s help names every command it has, with a line each.

The failure guarded against is a command a person can only find by reading
a sentence, or by being told it does not exist: ``fluksio-nb --help`` once
listed two of four, and ``fluksio-nb foo`` offered only those two.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from fluksio_nb.__main__ import COMMANDS


def fluksio_nb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluksio_nb", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "100"},
    )


def test_the_help_lists_every_command_with_a_line_each():
    shown = fluksio_nb("--help")
    assert shown.returncode == 0, shown.stderr
    listed = dict(re.findall(r"^    (\w+) +(.+)$", shown.stdout, re.MULTILINE))
    assert set(listed) == {"snapshot", "flavors", "usage", "machine"}
    for name, line in listed.items():
        assert COMMANDS[name].startswith(line), name


def test_an_unknown_command_is_refused_naming_every_command():
    refused = fluksio_nb("foo")
    assert refused.returncode == 2
    assert "invalid choice: 'foo'" in refused.stderr
    for name in ("snapshot", "flavors", "usage", "machine"):
        assert f"'{name}'" in refused.stderr


@pytest.mark.parametrize("name", ["snapshot", "flavors", "usage", "machine"])
def test_every_listed_command_has_help_of_its_own(name):
    """Guards against a command the help lists that the program does not run."""
    shown = fluksio_nb(name, "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"usage: fluksio-nb {name}")
