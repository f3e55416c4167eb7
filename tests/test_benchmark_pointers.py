"""Each measured number once: BENCHMARKS.md holds them, and the code points there by a section's heading or a table
row's name, never by a section number (numbers move when BENCHMARKS is reorganised; a heading that moves is still
found). Every such pointer in the project's Python files must name a heading or a row that BENCHMARKS.md has. The
docs explain topics and link to a number's heading (`../BENCHMARKS.md#3-decode-time-per-token`, or the work log's,
docs/benchmarks-history.md), never by "BENCHMARKS §3" or "the twelfth session"; every such link names a heading the
file has. And docs/testing.md, the index of the tests, names every test file."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("ground", "backbone", "engine", "memories", "plugins", "eval", "offsite", "studio", "ui", "benchmarks",
             "scripts", "tests")
SECTION_NUMBER = re.compile(r"BENCHMARKS(\.md)?,?\s*§")
POINTER = re.compile(r'BENCHMARKS\.md,?\s*"([^"]+)"(?:[^"]{0,40}?\brow\s*"([^"]+)")?')
ROW_BEFORE = re.compile(r'BENCHMARKS\.md,?\s*row\s*"([^"]+)"')
# In the docs: a link to a heading of BENCHMARKS.md or of its work log; a section number; a work session by number.
BENCHMARK_LINK = re.compile(r"\]\(([^)#\s]*(?:BENCHMARKS|benchmarks-history)\.md)#([^)\s]+)\)")
DOC_SECTION_NUMBER = re.compile(r"§\s*\d+[a-z]?")
NTH_SESSION = re.compile(r"\b(?:[a-z]+-)?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
                         r"twelfth|[a-z]+teenth|[a-z]+tieth|\d+(?:st|nd|rd|th))\s+sessions?\b", re.IGNORECASE)


def code_files() -> list[Path]:
    files = [ROOT / "app.py"]
    for d in CODE_DIRS:
        files += sorted((ROOT / d).rglob("*.py"))
    return [f for f in files if f.is_file()]


def flat(text: str) -> str:
    """The text with line breaks, comment marks, indents and escaped quotes gone: a pointer may wrap."""
    lines = (re.sub(r"^\s*#?\s*", "", line) for line in text.splitlines())
    return re.sub(r"\s+", " ", " ".join(lines)).replace('\\"', '"').replace('" "', "")


def pointers(text: str) -> list[str]:
    """The headings and row names the text points to in BENCHMARKS.md."""
    text = flat(text)
    out = []
    for m in POINTER.finditer(text):
        out += [name for name in m.groups() if name]
    out += ROW_BEFORE.findall(text)
    return out


def targets(benchmarks: str) -> tuple[list[str], list[str]]:
    """(headings, table cells) of BENCHMARKS.md, lower-cased, without Markdown's code and emphasis marks; a paragraph's
    bold lead ("**Quality guard of each precision** — …") counts as a heading."""
    bold_leads = [m.group(1) for line in benchmarks.splitlines() if (m := re.match(r"\*\*([^*]+)\*\*", line))]
    benchmarks = re.sub(r"[`*]", "", benchmarks)
    headings = [line.lstrip("#").strip().lower() for line in benchmarks.splitlines() if line.startswith("#")]
    headings += [re.sub(r"`", "", b).strip().lower() for b in bold_leads]
    cells = [c.strip().lower() for line in benchmarks.splitlines() if line.startswith("|") for c in line.split("|")]
    return headings, [c for c in cells if c]


def found(name: str, headings: list[str], cells: list[str]) -> bool:
    name = re.sub(r"[`*]", "", name).strip().lower()
    return any(name in h for h in headings) or any(c.startswith(name) for c in cells)


def test_code_points_to_benchmarks_by_heading_not_by_section_number():
    bad = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in code_files()
           for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if SECTION_NUMBER.search(line)]
    bad = [b for b in bad if not b.startswith("tests/test_benchmark_pointers.py")]
    assert not bad, ("point to BENCHMARKS.md by a section's heading or a row's name, not its number "
                     "(BENCHMARKS.md, \"Decode time per token\"):\n" + "\n".join(bad))


def test_every_pointer_names_a_heading_or_row_benchmarks_has():
    headings, cells = targets((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))
    bad = [f"{f.relative_to(ROOT)}: {name!r}" for f in code_files() if f.name != Path(__file__).name
           for name in pointers(f.read_text(encoding="utf-8")) if not found(name, headings, cells)]
    assert not bad, ("pointers to BENCHMARKS.md that name no heading and no row there (renamed or moved? point to "
                     "where the number is now):\n" + "\n".join(bad))


def test_the_pointer_checks_see_a_number_a_wrapped_pointer_and_a_missing_one():
    text = ('x = 1  # kNN (BENCHMARKS §3)\n'
            '    """see BENCHMARKS.md, "Decode time\n    per token", row "exact kNN over\n    100k entries alone"."""\n'
            '# BENCHMARKS.md, "No such heading"\n')
    assert SECTION_NUMBER.search(text.splitlines()[0])
    names = pointers(text)
    assert names == ["Decode time per token", "exact kNN over 100k entries alone", "No such heading"]
    headings, cells = targets("## 3. Decode time per token\n\n| what | now |\n| --- | --- |\n"
                              "| exact kNN over 100k entries alone | 1.09× |\n")
    assert [found(n, headings, cells) for n in names] == [True, True, False]


def doc_files() -> list[Path]:
    """The pages that explain topics: docs/*.md but the work log itself, README.md and ARCHITECTURE.md."""
    docs = [f for f in sorted((ROOT / "docs").glob("*.md")) if f.name != "benchmarks-history.md"]
    return docs + [f for f in (ROOT / "README.md", ROOT / "ARCHITECTURE.md") if f.is_file()]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to '-', '-1', '-2', … on
    repeats; '#' lines inside fenced code are not headings."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def broken_benchmark_links(doc: Path, text: str) -> list[str]:
    """The text's links to BENCHMARKS.md or its work log whose anchor names no heading of the file (relative to doc)."""
    bad = []
    for m in BENCHMARK_LINK.finditer(text):
        target = (doc.parent / m.group(1)).resolve()
        if not target.is_file() or m.group(2) not in github_anchors(target.read_text(encoding="utf-8")):
            bad.append(f"{m.group(1)}#{m.group(2)}")
    return bad


def stale_pointers(text: str) -> list[str]:
    """'BENCHMARKS §3', a bare '§3b' or 'the twelfth session' in the text's prose (link targets left out)."""
    prose = re.sub(r"\]\([^)\s]*\)", "]", text)
    patterns = (SECTION_NUMBER, DOC_SECTION_NUMBER, NTH_SESSION)
    return [m.group(0) for pattern in patterns for m in pattern.finditer(prose)]


def test_docs_link_to_benchmark_headings_that_exist():
    pages = doc_files() + [ROOT / "BENCHMARKS.md", ROOT / "docs" / "benchmarks-history.md"]  # its "how" links too
    bad = [f"{f.relative_to(ROOT)}: {link}" for f in pages
           for link in broken_benchmark_links(f, f.read_text(encoding="utf-8"))]
    assert not bad, "links to a heading BENCHMARKS.md or docs/benchmarks-history.md does not have:\n" + "\n".join(bad)


def test_docs_point_by_link_not_by_section_number_or_session():
    bad = [f"{f.relative_to(ROOT)}: {p!r}" for f in doc_files() for p in stale_pointers(f.read_text(encoding="utf-8"))]
    assert not bad, ("docs point to a measured number by a link to its heading, e.g. "
                     "[decode time per token](../BENCHMARKS.md#3-decode-time-per-token), not by a section number or a "
                     "work session:\n" + "\n".join(bad))


def test_docs_quoted_rows_and_headings_exist():
    headings, cells = targets((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"))
    bad = [f"{f.relative_to(ROOT)}: {name!r}" for f in doc_files()
           for name in pointers(f.read_text(encoding="utf-8")) if not found(name, headings, cells)]
    assert not bad, "docs quote a BENCHMARKS.md heading or row it does not have:\n" + "\n".join(bad)


def test_the_doc_checks_see_old_pointers_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "BENCHMARKS.md").write_text("# B\n```\n# 3. not a heading\n```\n## 3. Decode time per token\n")
    (tmp_path / "docs" / "benchmarks-history.md").write_text(
        "### Twelfth session: certified kNN on centred keys (issue #18)\n## Notes\n## Notes\n")
    doc = tmp_path / "docs" / "methods.md"
    text = ("entries 1.07–1.19× a base step, BENCHMARKS §3, twelfth session).\n"
            "a 7-row step spent 2.7 ms; BENCHMARKS §3, fourteenth\n  session), and\n"
            "| slider move (§3b) | the same, BENCHMARKS.md (§3d, \"Batch-invariant rows\") | sixteenth and eighteenth "
            "sessions | twenty-first session |\n"
            "[now](../BENCHMARKS.md#3-decode-time-per-token) [how](benchmarks-history.md#twelfth-session-certified-knn-"
            "on-centred-keys-issue-18) [twice](benchmarks-history.md#notes-1) [gone](../BENCHMARKS.md#3-not-a-heading) "
            "[renamed](benchmarks-history.md#thirteenth-session)\n")
    assert broken_benchmark_links(doc, text) == ["../BENCHMARKS.md#3-not-a-heading",
                                                 "benchmarks-history.md#thirteenth-session"]
    assert stale_pointers(text) == ["BENCHMARKS §", "BENCHMARKS §", "§3", "§3", "§3b", "§3d", "twelfth session",
                                    "fourteenth\n  session", "eighteenth sessions", "twenty-first session"]
    assert stale_pointers("[how](benchmarks-history.md#twelfth-session-certified-knn) in this session") == []
    headings, cells = targets("**Quality guard of each precision** — the base …\n")
    assert found('Quality guard of each `precision`', headings, cells)


def unlisted_test_files(tests_dir: Path, testing_md: str) -> list[str]:
    """The test files docs/testing.md does not name (by file name, in backticks)."""
    return sorted(p.name for p in tests_dir.glob("test_*.py") if f"`{p.name}`" not in testing_md)


def test_docs_testing_lists_every_test_file():
    listed = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    missing = unlisted_test_files(ROOT / "tests", listed)
    assert not missing, f"docs/testing.md does not list {missing}: add each to its component's row"


def test_the_listing_check_sees_an_unlisted_file(tmp_path):
    (tmp_path / "test_a.py").write_text("")
    (tmp_path / "test_b.py").write_text("")
    assert unlisted_test_files(tmp_path, "| x | `test_a.py` |") == ["test_b.py"]
