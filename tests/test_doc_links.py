"""Every link between the README and the pages in docs/ lands somewhere, and the README stays short.

The failure guarded against is documentation that points nowhere: a page
moved or renamed, a heading reworded so that a ``#anchor`` to it now opens the
top of the page, and a README that grows back into the reference it links to.
Anchors are checked as GitHub makes them from a heading: lowercase, spaces to
``-``, every other character but letters, digits, ``-`` and ``_`` dropped, and
``-1``, ``-2`` after a heading met before.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MOST_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`+[^`\n]*`+")
# [text](target) and ![alt](target), with an optional "title"; the text may hold
# one level of brackets. Code spans are blanked out first, so a link's text in
# backticks still counts and a `[x](y)` shown as code does not.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading, before any ``-1`` for a repeat."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(without_code_blocks(page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("code", without_code_blocks(page.read_text()))
    return [target for target in LINK.findall(text) if not SCHEME.match(target)]


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file, or whose heading, is not there, and why."""
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        landing = (page.parent / path).resolve() if path else page
        if not landing.exists():
            broken.append(f"{page.name}: {target} (no file {landing})")
        elif anchor and landing.suffix == ".md" and anchor not in anchors(landing):
            broken.append(f"{page.name}: {target} (no heading #{anchor} in {landing.name})")
    return broken


def test_every_relative_link_and_anchor_in_the_readme_and_docs_lands():
    broken = [problem for page in PAGES for problem in broken_links(page)]
    assert broken == [], "\n".join(broken)


def test_the_docs_pages_are_all_reached_from_the_readme():
    """Guards against a page in docs/ that nobody can find: each is linked from the README."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    unreached = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert unreached == []


def test_the_readme_is_at_most_250_lines():
    """Guards against the README growing back into the reference: what it is, the two
    commands, a first claim, a shared machine, and links; the rest is in docs/."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MOST_LINES, f"README.md is {lines} lines; move the detail to docs/"


def test_anchors_are_made_as_github_makes_them(tmp_path):
    """Guards against the checker's slugs drifting from GitHub's, so that a link it
    passes opens the top of the page there."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n\n## `%%claim`\n\n## `claim()`, `accountant()`, `monitor()`\n\n"
        "## Usage records and `fluksio-nb usage`\n\n## What no_design can promise?\n\n"
        "## Top\n\n```bash\n# not a heading\n```\n"
    )
    assert anchors(page) == {
        "top",
        "claim",
        "claim-accountant-monitor",
        "usage-records-and-fluksio-nb-usage",
        "what-no_design-can-promise",
        "top-1",
    }


def test_a_missing_page_and_a_missing_heading_are_both_reported(tmp_path):
    """Guards against a checker that passes everything: a link to a page that is not
    there and an anchor to a heading that is not there are each named, and the links
    that do land, to a file, a folder, a heading, or shown as code, are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## The reserve core\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Page\n\n## Here\n\n"
        "[fine](docs/other.md#the-reserve-core), [folder](docs/), [here](#here),\n"
        "[web](https://example.org/#nowhere), `[code](nowhere.md)`,\n"
        "[gone](docs/gone.md), [`no heading`](docs/other.md#the-reserved-core),\n"
        "[not here](#there)\n\n```text\n[in a block](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        f"README.md: docs/gone.md (no file {tmp_path / 'docs' / 'gone.md'})",
        "README.md: docs/other.md#the-reserved-core (no heading #the-reserved-core in other.md)",
        "README.md: #there (no heading #there in README.md)",
    ]
