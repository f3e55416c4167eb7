"""Parse uploaded samples: JSONL ({"src","tgt"}, {"en","de"}, {"source","target"}, {"text"}), CSV/TSV with one or
two columns, or plain text with one sample a line. Every problem names its line.

``parse_samples`` returns the samples and the per-line problems (the app previews both);
``parse_samples_strict`` raises one :class:`UserError` listing the first problems (the CLI and the builder use it).

Hostile input gets a message, never a traceback: text given as ``str`` (the API) gets the same size limit, NUL and
validity checks as uploaded bytes; lines are split on ``\n`` only (a U+2028 inside a JSON string stays inside its
line, and line numbers are the file's); a line longer than ``MAX_LINE_CHARS`` is refused before it is parsed; JSON
that is nested too deeply (RecursionError) or holds an integer of more than 4,300 digits (ValueError) is a problem of
its line; a CSV field over the csv module's limit or an unbalanced quote too; a side with a line break, a control
character or a lone surrogate (``"\ud800"`` passes JSON but is not text) is refused. UTF-16/32 files are named as
such.
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
MAX_LINE_CHARS = 100_000  # a line this long is not a sample (and is not handed to the JSON / CSV parsers)
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines() would split on
_BOMS = ((b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe\x00\x00", "UTF-32"), (b"\xfe\xff", "UTF-16"),
         (b"\xff\xfe", "UTF-16"))
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


def _too_big(n: int) -> UserError:
    return UserError(f"The file is {n / 1e6:.0f} MB; the limit is {MAX_BYTES / 1e6:.0f} MB.")


def _decode(data: bytes | str) -> str:
    """Text of an upload (bytes) or of text sent through the API (str), with the same checks for both: size,
    encoding (UTF-8; a BOM is dropped), NUL bytes, lone surrogates."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        if len(data) > MAX_BYTES:
            raise _too_big(len(data))
        for bom, name in _BOMS:
            if data.startswith(bom):
                raise UserError(f"The file is {name} text; save it as UTF-8 and upload it again.")
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise UserError(f"line {line}: the file is not UTF-8 text (byte {data[e.start]:#x} at offset "
                            f"{e.start}). Save it as UTF-8 and upload it again.") from None
    elif isinstance(data, str):
        if len(data) > MAX_BYTES or (len(data) * 4 > MAX_BYTES
                                     and len(data.encode("utf-8", "surrogatepass")) > MAX_BYTES):
            raise _too_big(len(data.encode("utf-8", "surrogatepass")) if len(data) <= MAX_BYTES else len(data))
        text = data[1:] if data.startswith("\ufeff") else data
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            line = text.count("\n", 0, e.start) + 1
            raise UserError(f"line {line}: the text contains a lone surrogate (U+{ord(text[e.start]):04X}), "
                            f"which is not valid Unicode text.") from None
    else:
        raise UserError(f"Expected text or bytes, not {type(data).__name__}.")
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise UserError(f"line {line}: the file contains NUL bytes: it looks binary, not text.")
    return text


def split_lines(text: str) -> list[str]:
    """Lines split on ``\n`` only (a ``\r`` before it is dropped): U+2028, U+0085, form feeds … stay inside their
    line, as JSON allows them inside strings, so line numbers are the file's."""
    lines = text.split("\n")
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


def detect_format(filename: str | None, text: str) -> str:
    ext = Path(filename or "").suffix.lower()
    if ext in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if ext == ".csv":
        return "csv"
    if ext == ".tsv":
        return "tsv"
    head = text.lstrip()
    first = head[: head.find("\n")] if "\n" in head else head
    if first.lstrip().startswith("{"):
        return "jsonl"
    if ext != ".txt" and "\t" in first:
        return "tsv"
    return "text"


def _bad_char(val: str) -> str:
    """What is wrong with a character of a sample's side, or "" (tabs and any printable text are fine)."""
    for ch in val:
        o = ord(ch)
        if ch in LINE_BREAKS:
            return f"contains a line break (U+{o:04X})"
        if (o < 0x20 and ch != "\t") or 0x7F <= o <= 0x9F:
            return f"contains a control character (U+{o:04X})"
        if 0xD800 <= o <= 0xDFFF:
            return f"contains a lone surrogate (U+{o:04X}), which is not valid Unicode text"
    return ""


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
        bad = _bad_char(val.strip())
        if bad:
            problems.append(Problem(sample.line, f"the {side} {bad}"))
            return None
    return Sample(sample.src.strip() if sample.src is not None else None, sample.tgt.strip(), sample.line)


def _json_line(ln: str):
    """``json.loads`` of one line; a ValueError whose message says what is wrong (also for the cases ``json``
    raises no JSONDecodeError for: too deep, an integer of more than 4,300 digits)."""
    try:
        return json.loads(ln)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise ValueError(f"not valid JSON ({str(e).split(':')[0]})") from None


MAX_PROBLEMS = 10_000  # parsing stops there: a file this wrong needs fixing first, not a longer list


def parse_samples(data: bytes | str, filename: str | None = None, fmt: str = "auto",
                  max_samples: int | None = None) -> tuple[list[Sample], list[Problem]]:
    """Samples and per-line problems. ``max_samples``: refuse (UserError) as soon as one more sample is found, so
    that an oversized file costs no more than the bound."""
    text = _decode(data)
    if not text.strip():
        return [], [Problem(0, "The file is empty.")]
    fmt = detect_format(filename, text) if fmt == "auto" else fmt
    if fmt not in ("jsonl", "csv", "tsv", "text"):
        raise UserError(f"Unknown format {fmt!r}; use jsonl, csv, tsv or text.")
    lines = split_lines(text)
    while lines and not lines[-1].strip():  # trailing blank lines are harmless
        lines.pop()
    samples: list[Sample] = []
    problems: _Problems = _Problems()

    def add(sample: Sample) -> None:
        if max_samples and len(samples) >= max_samples:
            raise UserError(over_bound(max_samples))
        samples.append(sample)

    def too_long(no: int, ln: str) -> bool:
        if len(ln) > MAX_LINE_CHARS:
            problems.append(Problem(no, f"the line has {len(ln):,} characters (limit {MAX_LINE_CHARS:,}); is the "
                                        f"file one sample a line?"))
            return True
        return False

    if fmt == "jsonl":
        for no, ln in enumerate(lines, 1):
            if not ln.strip():
                problems.append(Problem(no, "empty line"))
                continue
            if too_long(no, ln):
                continue
            try:
                obj = _json_line(ln)
            except ValueError as e:
                problems.append(Problem(no, str(e)))
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
                add(ok)
    elif fmt in ("csv", "tsv"):
        long_lines = [no for no, ln in enumerate(lines, 1) if too_long(no, ln)]
        if long_lines:
            return [], problems
        reader = csv.reader(io.StringIO("\n".join(lines)), delimiter="," if fmt == "csv" else "\t")
        rows: list[tuple[int, list[str]]] = []  # (the line the row starts on, its cells)
        last = 0
        try:
            filled = 0
            for row in reader:
                rows.append((last + 1, row))
                last = reader.line_num
                filled += bool(row and any(c.strip() for c in row))
                if max_samples and filled > max_samples + 1:  # (+ a header row)
                    raise UserError(over_bound(max_samples))
        except csv.Error as e:
            problems.append(Problem(last + 1, f"CSV error ({e}); is a quote (\") unbalanced?"))
        start = 0
        first = rows[0][1] if rows else []
        if rows and [c.strip().lower() for c in first[:2]] in ([a, b] for a, b in PAIR_KEYS) \
                or rows and len(first) == 1 and first[0].strip().lower() in TEXT_KEYS:
            start = 1  # a header row
        body = [(no, row) for no, row in rows[start:]]
        width = next((len(row) for _, row in body if row and any(c.strip() for c in row)), 0)
        if width == 0 and problems:  # the CSV error is the whole story
            return [], problems
        if width not in (1, 2):
            no = next((n for n, row in body if row and any(c.strip() for c in row)), start + 1)
            return [], problems + [Problem(no, f"expected 1 column (monolingual text) or 2 columns (source, "
                                               f"target), found {width}")]
        for i, row in body:
            if not row or all(not c.strip() for c in row):
                problems.append(Problem(i, "empty line"))
                continue
            if len(row) != width:
                problems.append(Problem(i, f"expected {width} column(s), found {len(row)}"))
                continue
            smp = Sample(row[0], row[1], i) if width == 2 else Sample(None, row[0], i)
            if (ok := _check(smp, problems)) is not None:
                add(ok)
    else:
        for no, ln in enumerate(lines, 1):
            if not ln.strip():
                problems.append(Problem(no, "empty line"))
                continue
            if too_long(no, ln):
                continue
            if (ok := _check(Sample(None, ln, no), problems)) is not None:
                add(ok)
    if not samples and not problems:
        problems.append(Problem(0, "No samples found."))
    return samples, list(problems)


def over_bound(max_samples: int) -> str:
    return (f"The file has more than {max_samples:,} samples; the limit is {max_samples:,} (the studio's operator "
            f"sets it with --limit samples=… or $PEMA_LIMIT_SAMPLES).")


class _Problems(list):
    """The problems found so far; the next one past :data:`MAX_PROBLEMS` ends parsing with a UserError."""

    def append(self, problem) -> None:
        if len(self) >= MAX_PROBLEMS:
            raise UserError(f"More than {MAX_PROBLEMS:,} lines have problems (the first: {self[0]}); is this the "
                            f"right file, in one of the formats the studio reads?")
        super().append(problem)


def parse_samples_strict(data: bytes | str, filename: str | None = None, fmt: str = "auto",
                         skip_invalid: bool = False, max_samples: int | None = None) -> list[Sample]:
    samples, problems = parse_samples(data, filename, fmt, max_samples=max_samples)
    if problems and (not skip_invalid or not samples):
        shown = "; ".join(str(p) for p in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"{Path(filename).name + ': ' if filename else ''}{shown}{more}")
    return samples


def samples_from_dicts(rows: list[dict]) -> list[Sample]:
    return [Sample(r.get("src"), r["tgt"], i + 1) for i, r in enumerate(rows)]
