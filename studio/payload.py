"""Small pure helpers for payloads: word diffs, readable sizes, JSON-safe copies, what a share may contain."""
from __future__ import annotations

import difflib
import json
from typing import Any

# What a shared comparison may contain in each output token's trace (never memory samples or file paths).
SHARED_TRACE_KEYS = ("token", "text", "logprob", "lambda", "top_lm", "top_plugin", "top_final",
                     "memory_attention")


def word_diff(base: str, text: str) -> list[list]:
    """Word-level differences of ``text`` against ``base``: ``[[segment, "same"|"added"|"removed"], ...]``."""
    a, b = base.split(), text.split()
    out: list[list] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op == "equal":
            out.append([" ".join(b[j1:j2]), "same"])
            continue
        if op in ("replace", "delete"):
            out.append([" ".join(a[i1:i2]), "removed"])
        if op in ("replace", "insert"):
            out.append([" ".join(b[j1:j2]), "added"])
    return out


def human_bytes(n: int | float | None) -> str:
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def json_safe(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def shared_trace(entry: dict) -> dict:
    out = {k: entry[k] for k in SHARED_TRACE_KEYS if k in entry}
    if "neighbours" in entry:  # distances and tokens only: the entries' samples stay with the owner
        out["neighbours"] = [{"token": n.get("token"), "distance": n.get("distance")}
                             for n in entry.get("neighbours") or []]
    return out


