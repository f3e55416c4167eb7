"""The transfer check: are the inputs a user brings (a test file to rank or evaluate on, sentences typed in Compare)
as near the memory as the held-out samples its leaderboard was scored on?

Held-out samples come from the same file as the training samples; a user's inputs often do not. On a domain-shift
check (BENCHMARKS.md, "A domain-shift split from the PostgreSQL catalogs") the held-out sources' median word
1–3-gram Jaccard to their nearest training source was far above the test's, and methods that memorize gained
there what they lost on the test. So wherever scores are read on inputs of the user's, the same measure
(``memories.nearness``) is taken for them and for the held-out samples, and the two are shown together.

``side_by_side`` prints a rank's held-out and test leaderboards in one table (``python -m eval rank --test``).
"""
from __future__ import annotations

import functools
from pathlib import Path

from memories.nearness import NgramIndex, transfer_check


@functools.lru_cache(maxsize=8)
def _index(path: str, mtime_ns: int, sources: tuple[str, ...]) -> NgramIndex:
    return NgramIndex(list(sources))


def train_index(memory) -> NgramIndex:
    """The memory's training sources as an n-gram index (built once per memory folder and version)."""
    srcs = tuple(s.get("src") or "" for s in memory.split_samples("train"))
    try:
        mtime = (Path(memory.path) / "samples.jsonl").stat().st_mtime_ns
    except OSError:
        mtime = 0
    return _index(str(memory.path), mtime, srcs)


def memory_transfer(memory, inputs: list[str], heldout_sources: list[str] | None = None,
                    input_label: str = "your test inputs") -> dict:
    """``memories.nearness.transfer_check`` of ``inputs`` against ``memory``'s training sources, beside its held-out
    samples (``heldout_sources``: the part a leaderboard was scored on; default all held-out samples)."""
    held = heldout_sources if heldout_sources is not None else \
        [s.get("src") or "" for s in memory.split_samples("heldout")]
    out = transfer_check([], held, [x for x in inputs if x and x.strip()], index=train_index(memory),
                         input_label=input_label)
    out["memory_id"] = memory.id
    return out


def side_by_side(heldout: dict, test: dict) -> str:
    """A text table of each method's chrF and sacreBLEU difference to the base model (one-sided p) on the held-out
    report part and on the test file, the held-out leaderboard's order."""
    def cell(r: dict | None, k: str) -> str:
        if r is None or r.get(f"{k}_delta") is None:
            return "" if r is None else f"{r.get(k, 0.0):.2f}"
        return f"{r.get(k, 0.0):.2f} ({r[f'{k}_delta']:+.2f}, p {r[f'p_{k}']:.3f})"

    by_test = {r["method"]: r for r in test["methods"]}
    head = ["method", "held-out chrF (Δ, p)", "test chrF (Δ, p)", "held-out BLEU (Δ, p)", "test BLEU (Δ, p)"]
    lines = [[r["method"], cell(r, "chrf"), cell(by_test.get(r["method"]), "chrf"), cell(r, "sacrebleu"),
              cell(by_test.get(r["method"]), "sacrebleu")] for r in heldout["methods"]]
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    fmt = lambda x: " | ".join(c.ljust(w) for c, w in zip(x, widths))  # noqa: E731
    return "\n".join([fmt(head), "-+-".join("-" * w for w in widths), *map(fmt, lines)])
