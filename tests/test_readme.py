"""The README's reference is the code's own help, word for word.

The failure guarded against is documentation that drifts: an option added to
the parser but not to the README, or a README example the code no longer
accepts.
"""

import inspect
import re
from pathlib import Path

from fluksio_nb.claim_line import claim_parser
from fluksio_nb.context import claim

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def quoted(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\n```text\n(.*?)```\n<!-- /{marker} -->", README, re.S)
    assert match, f"the README has no {marker} block"
    return match[1]


def test_the_readme_quotes_claim_help_exactly():
    assert quoted("claim-help") == claim_parser().format_help()


def test_the_readme_quotes_the_context_managers_signature_and_doc():
    expected = f"claim{inspect.signature(claim)}\n\n{inspect.getdoc(claim)}\n"
    assert quoted("claim-doc") == expected


def test_the_readme_opens_with_the_two_commands():
    commands = re.search(r"```bash\n(.*?)```", README, re.S)[1].splitlines()
    assert [line.split()[0:2] for line in commands] == [["make", "lab"], ["make", "test"]]
