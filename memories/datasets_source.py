"""Samples from a 🤗 ``datasets`` source: a Hub dataset id (where the network allows) or a local Parquet, Arrow,
CSV/TSV or JSON/JSONL file (or a folder of them, or a folder written by ``Dataset.save_to_disk``), offline.

Rows are streamed, never loaded whole: Hub ids and local files through ``load_dataset(..., streaming=True)``, a
``save_to_disk`` folder through its memory-mapped Arrow table. Reading stops once ``limit`` valid samples are
read. Each row's fields go through the same checks as an uploaded file's lines (empty side, too long, line breaks,
control characters), and each problem names its row (1-based, in the split's order).

Fields: ``src_field`` / ``tgt_field`` name columns; a dotted name reads inside a nested column
(``translation.en``), and a plain name missing from the row is also looked up in a ``translation`` column (the
WMT / OPUS layout ``{"translation": {"en": …, "de": …}}``), so ``--src-field en --tgt-field de`` works on those. With
only ``tgt_field`` (or ``text_field``) the samples are monolingual. With no fields at all the first row's columns
are matched against the same pairs as JSONL uploads (src/tgt, en/de, source/target, ...).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ground.errors import UserError
from ground.store import write_json_atomic
from memories.parse import PAIR_KEYS, TEXT_KEYS, Problem, Sample, _check

Progress = Callable[[float, str], None]
BUILDERS = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".csv": "csv", ".tsv": "csv",
            ".json": "json", ".jsonl": "json", ".ndjson": "json"}
MAX_PROBLEMS_SHOWN = 5


def _noop(*a) -> None:
    pass


def _datasets():
    try:
        import datasets  # optional, heavy: only `memories build --dataset` needs it
    except ImportError:
        raise UserError("Reading datasets needs `pip install datasets` (see requirements.txt).") from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()  # our own bar counts the rows; theirs would interleave with it
    return datasets


def _local_rows_total(path: Path) -> int | None:
    """The number of rows of a local file when it is cheap to know (Parquet metadata, lines of JSONL/CSV)."""
    try:
        ext = path.suffix.lower()
        if ext in (".parquet", ".pq"):
            import pyarrow.parquet as pq  # optional: comes with datasets

            return int(pq.ParquetFile(path).metadata.num_rows)
        if ext in (".jsonl", ".ndjson", ".csv", ".tsv") and path.stat().st_size < 2_000_000_000:
            with open(path, "rb") as f:
                n = sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
            return max(0, n - (1 if ext in (".csv", ".tsv") else 0))
    except Exception:  # noqa: BLE001 — a total is only for the progress bar
        return None
    return None


def open_rows(name_or_path: str, split: str = "train", config: str | None = None) -> tuple[Iterable[dict], dict]:
    """An iterable over the split's rows (streamed) and what it is: ``{"dataset", "hub", "split", "config",
    "format", "total"}`` (``total``: the number of rows when known, for the progress bar)."""
    ds = _datasets()
    path = Path(name_or_path).expanduser()
    info = {"dataset": name_or_path, "hub": False, "split": split, "config": config, "format": None, "total": None}
    if path.exists():
        info["dataset"] = path.name  # the card and the memory's meta name the file, never the local path
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()
                              or (path / "dataset_dict.json").exists()):
            try:
                d = ds.load_from_disk(str(path))
            except Exception as e:  # noqa: BLE001 — a damaged folder: its message, one line
                raise UserError(f"Could not open the saved dataset {path.name}: {_line(e)}") from None
            if isinstance(d, ds.DatasetDict):
                if split not in d:
                    raise UserError(f"The dataset {path.name} has no split {split!r}; it has {', '.join(d)}.")
                d = d[split]
            info.update(format="arrow (save_to_disk)", total=len(d))
            return d, info
        if path.is_dir():
            try:
                rows = ds.load_dataset(str(path), config, split=split, streaming=True)
            except Exception as e:  # noqa: BLE001
                raise UserError(f"Could not read the folder {path.name} as a dataset (split {split!r}): "
                                f"{_line(e)}") from None
            info["format"] = "folder"
            return rows, info
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise UserError(f"{path.name}: unknown dataset file type; use Parquet (.parquet), Arrow (.arrow), CSV "
                            f"(.csv/.tsv) or JSON (.json/.jsonl) — or a plain text/JSONL/CSV upload without "
                            f"--dataset.")
        kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        try:
            rows = ds.load_dataset(builder, data_files={split: str(path)}, split=split, streaming=True, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"Could not read {path.name} as {builder}: {_line(e)}") from None
        info.update(format=builder, total=_local_rows_total(path))
        return rows, info
    # a Hub id: check that the Hub answers first (load_dataset would retry for half a minute offline)
    info["hub"] = True
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if not offline:
        _check_hub(name_or_path)
    try:
        rows = ds.load_dataset(name_or_path, config, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 — missing config/split, gated, offline: one line naming the dataset
        raise UserError(f"Could not load the dataset {name_or_path!r} (split {split!r}"
                        f"{', config ' + repr(config) if config else ''}) from the Hugging Face Hub: {_line(e)}") \
            from None
    try:
        splits = rows.info.splits or {}
        if split in splits and splits[split].num_examples:
            info["total"] = int(splits[split].num_examples)
    except Exception:  # noqa: BLE001 — a total is only for the progress bar
        pass
    info["format"] = "hub (streamed)"
    return rows, info


def _line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _check_hub(name: str) -> None:
    try:
        from huggingface_hub import HfApi  # optional: comes with datasets
        from huggingface_hub.errors import RepositoryNotFoundError
    except ImportError:
        return
    try:
        HfApi().dataset_info(name)
    except RepositoryNotFoundError:
        raise UserError(f"No file or folder {name!r} here, and no dataset {name!r} on the Hugging Face Hub (or it is "
                        f"private: log in with `hf auth login`).") from None
    except Exception as e:  # noqa: BLE001
        if _is_network_error(e):
            raise UserError(f"No file or folder {name!r} here, and the Hugging Face Hub cannot be reached "
                            f"({_line(e)}): Hub datasets need network access; a local Parquet, Arrow, CSV or JSON "
                            f"file works offline.") from None
        # anything else (gated, rate-limited, ...): let load_dataset try with the user's token and say what failed


def _is_network_error(e: BaseException) -> bool:
    seen = 0
    while e is not None and seen < 8:
        names = {c.__name__ for c in type(e).__mro__}
        if names & {"ConnectError", "ConnectionError", "ConnectTimeout", "Timeout", "TimeoutException",
                    "NetworkError", "OfflineModeIsEnabled", "LocalEntryNotFoundError"}:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _field(row: dict, name: str):
    """A row's field: ``a.b`` reads inside a nested column; a missing name is looked up in ``translation``."""
    if name in row:
        return row[name]
    if "." in name:
        cur = row
        for part in name.split("."):
            if not isinstance(cur, dict) or part not in cur:
                return KeyError
            cur = cur[part]
        return cur
    tr = row.get("translation")
    if isinstance(tr, dict) and name in tr:
        return tr[name]
    return KeyError


def _columns(row: dict) -> list[str]:
    cols = list(row)
    tr = row.get("translation")
    if isinstance(tr, dict):
        cols += [f"translation.{k}" for k in tr]
    return cols


def _guess_fields(row: dict) -> tuple[str | None, str]:
    for a, b in PAIR_KEYS:
        if _field(row, a) is not KeyError and _field(row, b) is not KeyError:
            return a, b
    for k in TEXT_KEYS:
        if _field(row, k) is not KeyError:
            return None, k
    raise UserError(f"Which columns are the source and the target? Give --src-field and --tgt-field (or "
                    f"--text-field for monolingual text); the dataset has {', '.join(_columns(row)[:12])}.")


def read_samples(rows: Iterable[dict], *, src_field: str | None = None, tgt_field: str | None = None,
                 limit: int | None = None, total: int | None = None, skip_invalid: bool = False,
                 progress: Progress = _noop) -> tuple[list[Sample], dict]:
    """Samples from streamed rows (at most ``limit`` valid ones), checked like an upload's lines. Returns them and
    ``{"rows_read", "skipped", "src_field", "tgt_field"}``; problems raise one UserError unless ``skip_invalid``."""
    samples: list[Sample] = []
    problems: list[Problem] = []
    want = limit if limit and limit > 0 else None
    goal = want or total
    n = 0
    last = 0.0
    it: Iterator[dict] = iter(rows)
    for n, row in enumerate(it, 1):
        if not isinstance(row, dict):
            raise UserError(f"row {n}: expected a record of named fields, got {type(row).__name__}.")
        if n == 1 and tgt_field is None:
            src_field, tgt_field = _guess_fields(row) if src_field is None else (src_field, None)
            if tgt_field is None:
                raise UserError("Give --tgt-field (the target column) with --src-field.")
        if n == 1:
            for f in (src_field, tgt_field):
                if f is not None and _field(row, f) is KeyError:
                    raise UserError(f"The dataset has no field {f!r}; it has {', '.join(_columns(row)[:12])}.")
        src = _field(row, src_field) if src_field else None
        tgt = _field(row, tgt_field)
        bad = next((f for f, v in ((src_field, src), (tgt_field, tgt)) if f and not isinstance(v, str)), None)
        if bad is not None:
            v = src if bad == src_field else tgt
            problems.append(Problem(n, f"the field {bad!r} is "
                                       f"{'missing' if v is KeyError or v is None else type(v).__name__}, not text"))
        elif (ok := _check(Sample(src, tgt, n), problems)) is not None:
            samples.append(ok)
        if problems and not skip_invalid and len(problems) >= MAX_PROBLEMS_SHOWN:
            break
        now = time.monotonic()
        if now - last > 0.2:
            last = now
            frac = min(len(samples) / want, 1.0) if want else (n / goal if goal else 0.0)
            progress(frac, f"read {n:,} rows, {len(samples):,} samples")
        if want and len(samples) >= want:
            break
    progress(1.0, f"read {n:,} rows, {len(samples):,} samples")
    if problems and (not skip_invalid or not samples):
        shown = "; ".join(f"row {p.line}: {p.message}" for p in problems[:MAX_PROBLEMS_SHOWN])
        raise UserError(f"{shown}{' (and more)' if len(problems) > MAX_PROBLEMS_SHOWN else ''} — fix the rows, "
                        f"choose other fields, or pass --skip-invalid.")
    if not samples:
        raise UserError("The dataset's split has no rows.")
    return samples, {"rows_read": n, "skipped": len(problems), "src_field": src_field, "tgt_field": tgt_field}


def load_dataset_samples(name_or_path: str, split: str = "train", *, config: str | None = None,
                         src_field: str | None = None, tgt_field: str | None = None, limit: int | None = None,
                         skip_invalid: bool = False, progress: Progress = _noop) -> tuple[list[Sample], dict]:
    """Samples of a Hub dataset or local file (see the module docstring) and the source's description for the
    memory's ``meta.json`` (``record_source``)."""
    progress(0.0, f"opening {name_or_path}")
    rows, info = open_rows(name_or_path, split, config)
    try:
        samples, read = read_samples(rows, src_field=src_field, tgt_field=tgt_field, limit=limit,
                                     total=info.get("total"), skip_invalid=skip_invalid, progress=progress)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 — a damaged file or a dropped connection half-way: one line
        raise UserError(f"Reading {info['dataset']} failed: {_line(e)}") from None
    fields = {"src": read["src_field"], "tgt": read["tgt_field"]}
    return samples, {"kind": "datasets", "dataset": info["dataset"], "hub": info["hub"], "config": config,
                     "split": split, "format": info["format"], "fields": fields, "rows_read": read["rows_read"],
                     "skipped": read["skipped"], "samples": len(samples), "limit": limit}


def record_source(memory_path: str | Path, source: dict) -> None:
    """Write where the samples came from into the memory's ``meta.json`` (``"source"``; the model card of a plug-in
    trained on it names a Hub dataset in its metadata)."""
    import json

    f = Path(memory_path) / "meta.json"
    meta = json.loads(f.read_text(encoding="utf-8"))
    meta["source"] = source
    write_json_atomic(f, meta)
