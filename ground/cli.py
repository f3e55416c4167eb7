"""Shared command-line pieces: common flags, a tqdm progress bar, user-error handling."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Callable, Iterator

from ground.errors import UserError


def add_common(p: argparse.ArgumentParser, backbone: bool = True) -> None:
    p.add_argument("--data-dir", default=None, help="data directory (default $PEMA_DATA_DIR or ~/.cache/pema-studio)")
    if backbone:
        p.add_argument("--backbone", default=None,
                       help="embedded short name (gemma-3-270m [default], smollm2-135m-instruct), hub id or path")
        p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present)")
        p.add_argument("--dtype", default=os.environ.get("PEMA_DTYPE") or None,
                       choices=["float32", "bfloat16", "int8", "float16", "auto"],
                       help="backbone weight precision: float32 (exact reference), bfloat16, int8 (CPU; int8 "
                            "weight-only linear layers + LM head), float16 (CPU: float16 weight-only decoder linears; "
                            "GPU: the whole model); default $PEMA_DTYPE, else docs/precision.md")


@contextlib.contextmanager
def progress_bar(desc: str) -> Iterator[Callable[[float, str], None]]:
    """A progress callback ``(fraction, message)`` drawn as a tqdm bar on stderr."""
    from tqdm import tqdm

    bar = tqdm(total=1000, desc=desc, file=sys.stderr, bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}",
               dynamic_ncols=True)

    def update(frac: float, msg: str) -> None:
        bar.n = int(1000 * max(0.0, min(1.0, frac)))
        bar.set_postfix_str(msg[:90], refresh=False)
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


def run_main(main: Callable[[list[str] | None], int], argv=None) -> None:
    """Run a CLI entry point; a UserError prints its message and exits with status 2 (no traceback)."""
    try:
        sys.exit(main(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def print_table(rows: list[dict], cols: list[str]) -> None:
    if not rows:
        print("(none)")
        return
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def dump_json(obj) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False, default=str))
