"""Each measured number once: BENCHMARKS.md holds them, and the code points there by a section's heading or a table
row's name, never by a section number (numbers move when BENCHMARKS is reorganised; a heading that moves is still
found). Every such pointer in the project's Python files must name a heading or a row that BENCHMARKS.md has. And
docs/testing.md, the index of the tests, names every test file."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("ground", "backbone", "engine", "memories", "plugins", "eval", "offsite", "studio", "ui", "benchmarks",
             "scripts", "tests")
SECTION_NUMBER = re.compile(r"BENCHMARKS(\.md)?,?\s*§")
POINTER = re.compile(r'BENCHMARKS\.md,?\s*"([^"]+)"(?:[^"]{0,40}?\brow\s*"([^"]+)")?')
ROW_BEFORE = re.compile(r'BENCHMARKS\.md,?\s*row\s*"([^"]+)"')


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
    """(headings, table cells) of BENCHMARKS.md, lower-cased, without Markdown's code and emphasis marks."""
    benchmarks = re.sub(r"[`*]", "", benchmarks)
    headings = [line.lstrip("#").strip().lower() for line in benchmarks.splitlines() if line.startswith("#")]
    cells = [c.strip().lower() for line in benchmarks.splitlines() if line.startswith("|") for c in line.split("|")]
    return headings, [c for c in cells if c]


def found(name: str, headings: list[str], cells: list[str]) -> bool:
    name = name.strip().lower()
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
