"""Parse uploaded samples: JSONL ({"src","tgt"}, {"en","de"}, {"source","target"}, {"text"}), CSV/TSV with one or
two columns, or plain text with one sample a line. Every problem names its line.

``parse_samples`` returns the samples and the per-line problems (the app previews both);
``parse_samples_strict`` raises one :class:`UserError` listing the first problems (the CLI and the builder use it).
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from ground.errors import UserError

MAX_CHARS = 2000  # per side: longer "sentences" are almost always a wrong file or a missing line break
MAX_BYTES = 200 * 1024 * 1024
PAIR_KEYS = [("src", "tgt"), ("en", "de"), ("source", "target"), ("input", "output"), ("informal", "formal")]
TEXT_KEYS = ("text", "tgt", "target", "de")


@dataclass
class Sample:
    src: str | None  # None for monolingual samples (a synthetic source is made when the memory is built)
    tgt: str
    line: int = 0

    def to_dict(self) -> dict:
        return {"src": self.src, "tgt": self.tgt, "line": self.line}


@dataclass
class Problem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


def _decode(data: bytes | str) -> str:
    if isinstance(data, str):
        return data
    if len(data) > MAX_BYTES:
        raise UserError(f"The file is {len(data) / 1e6:.0f} MB; the limit is {MAX_BYTES // 1e6:.0f} MB.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(f"line {line}: the file is not UTF-8 text (byte {data[e.start]:#x} at offset {e.start}). "
                        f"Save it as UTF-8 and upload it again.") from None
    if "\x00" in text:
        raise UserError("The file contains NUL bytes: it looks binary, not text.")
    return text


def detect_format(filename: str | None, text: str) -> str:
    ext = Path(filename or "").suffix.lower()
    if ext in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if ext == ".csv":
        return "csv"
    if ext == ".tsv":
        return "tsv"
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if first.lstrip().startswith("{"):
        return "jsonl"
    if ext != ".txt" and "\t" in first:
        return "tsv"
    return "text"


def _check(sample: Sample, problems: list[Problem]) -> Sample | None:
    for side, val in (("source", sample.src), ("target", sample.tgt)):
        if val is None:
            continue
        if not val.strip():
            problems.append(Problem(sample.line, f"the {side} is empty"))
            return None
        if len(val) > MAX_CHARS:
            problems.append(Problem(sample.line, f"the {side} has {len(val)} characters (limit {MAX_CHARS}); "
                                                 f"is a line break missing?"))
            return None
        if "\n" in val.strip():
            problems.append(Problem(sample.line, f"the {side} contains a line break"))
            return None
    return Sample(sample.src.strip() if sample.src is not None else None, sample.tgt.strip(), sample.line)


def parse_samples(data: bytes | str, filename: str | None = None, fmt: str = "auto"
                  ) -> tuple[list[Sample], list[Problem]]:
    text = _decode(data)
    if not text.strip():
        return [], [Problem(0, "The file is empty.")]
    fmt = detect_format(filename, text) if fmt == "auto" else fmt
    if fmt not in ("jsonl", "csv", "tsv", "text"):
        raise UserError(f"Unknown format {fmt!r}; use jsonl, csv, tsv or text.")
    lines = text.splitlines()
    while lines and not lines[-1].strip():  # trailing blank lines are harmless
        lines.pop()
    samples: list[Sample] = []
    problems: list[Problem] = []

    if fmt == "jsonl":
        for no, ln in enumerate(lines, 1):
            if not ln.strip():
                problems.append(Problem(no, "empty line"))
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                problems.append(Problem(no, f"not valid JSON ({e.msg})"))
                continue
            if not isinstance(obj, dict):
                problems.append(Problem(no, "expected a JSON object like {\"src\": ..., \"tgt\": ...}"))
                continue
            pair = next(((a, b) for a, b in PAIR_KEYS if a in obj and b in obj), None)
            if pair:
                s, t = obj[pair[0]], obj[pair[1]]
                if not isinstance(s, str) or not isinstance(t, str):
                    problems.append(Problem(no, f"\"{pair[0]}\" and \"{pair[1]}\" must be strings"))
                    continue
                smp = Sample(s, t, no)
            else:
                key = next((k for k in TEXT_KEYS if k in obj), None)
                if key is None or not isinstance(obj[key], str):
                    problems.append(Problem(no, f"missing fields: expected \"src\"/\"tgt\" (or \"en\"/\"de\"), "
                                                f"or \"text\" for monolingual samples; found {sorted(obj)[:5]}"))
                    continue
                smp = Sample(None, obj[key], no)
            if (ok := _check(smp, problems)) is not None:
                samples.append(ok)
    elif fmt in ("csv", "tsv"):
        reader = csv.reader(io.StringIO("\n".join(lines)), delimiter="," if fmt == "csv" else "\t")
        rows = list(reader)
        start = 0
        if rows and [c.strip().lower() for c in rows[0][:2]] in ([a, b] for a, b in PAIR_KEYS) \
                or rows and len(rows[0]) == 1 and rows[0][0].strip().lower() in TEXT_KEYS:
            start = 1  # a header row
        width = len(rows[start]) if len(rows) > start else 0
        if width not in (1, 2):
            return [], [Problem(start + 1, f"expected 1 column (monolingual text) or 2 columns (source, target), "
                                           f"found {width}")]
        for i, row in enumerate(rows[start:], start + 1):
            if not row or all(not c.strip() for c in row):
                problems.append(Problem(i, "empty line"))
                continue
            if len(row) != width:
                problems.append(Problem(i, f"expected {width} column(s), found {len(row)}"))
                continue
            smp = Sample(row[0], row[1], i) if width == 2 else Sample(None, row[0], i)
            if (ok := _check(smp, problems)) is not None:
                samples.append(ok)
    else:
        for no, ln in enumerate(lines, 1):
            if not ln.strip():
                problems.append(Problem(no, "empty line"))
                continue
            if (ok := _check(Sample(None, ln, no), problems)) is not None:
                samples.append(ok)
    if not samples and not problems:
        problems.append(Problem(0, "No samples found."))
    return samples, problems


def parse_samples_strict(data: bytes | str, filename: str | None = None, fmt: str = "auto",
                         skip_invalid: bool = False) -> list[Sample]:
    samples, problems = parse_samples(data, filename, fmt)
    if problems and (not skip_invalid or not samples):
        shown = "; ".join(str(p) for p in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"{Path(filename).name + ': ' if filename else ''}{shown}{more}")
    return samples


def samples_from_dicts(rows: list[dict]) -> list[Sample]:
    return [Sample(r.get("src"), r["tgt"], i + 1) for i, r in enumerate(rows)]
