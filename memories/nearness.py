"""How near two sources are: word 1–3-gram Jaccard similarity, near-duplicate groups and nearest-neighbour profiles.

Why this measure: the methods a memory feeds (kNN, PEMA, the adapters) profit from an input whose words and phrases
the memory has seen; a sentence that shares most of its words *and* word pairs and triples with a training source is
one a memorizing method can nearly copy. The Jaccard similarity of two sources' sets of word 1-, 2- and 3-grams
(lower-cased ``\\w+`` words) counts exactly that, is symmetric, needs no model and is cheap enough for tens of
thousands of samples. At 0.5, two sources share half of their n-grams: "Could not open file" and "Could not open
directory" (6 of 12), a message and its variant with one word changed; two unrelated sentences of one domain sit
near 0.1–0.2.

* :func:`near_duplicate_groups` — every pair of samples at Jaccard ≥ ``threshold`` joined into one group (union-find),
  exactly: all-pairs similarity search with prefix filtering (Bayardo, Ma & Srikant, "Scaling up all pairs
  similarity search", WWW 2007): with the n-grams of every source ordered rarest first, two sets with Jaccard ≥ t
  share one of the first |x| − ⌈t·|x|⌉ + 1 n-grams of each, so only those are indexed; every candidate is then
  checked exactly. ``memories.build`` puts each group wholly on one side of the held-out split.
* :class:`NgramIndex` — the training sources' n-grams as an inverted index (NumPy postings): the nearest training
  source of any text (its Jaccard), exactly, by counting shared n-grams over the postings.
* :func:`nearness_profile` — a set of sources' nearest-training Jaccards summarised (median, quartiles, share at or
  above 0.5, share identical): the split's distance profile, and the transfer check's for a user's inputs.
* :func:`transfer_check` — a user's inputs (a test file, sentences typed in Compare) against the held-out samples:
  are they as near the memory as the samples the leaderboard was scored on?
"""
from __future__ import annotations

import math
import re

import numpy as np

NGRAM_MAX = 3  # word 1-, 2- and 3-grams
NEAR_DUPLICATE = 0.5  # Jaccard at or above which two sources are near-duplicates (the module docstring says why)
# The transfer check calls inputs farther from the memory than its held-out samples when their median nearest
# Jaccard is this much lower (a difference the split's own profile cannot explain: its quartiles are ~0.1 apart).
FARTHER_MARGIN = 0.05
MEASURE = "word 1–3-gram Jaccard of the sources"
_WORD = re.compile(r"\w+")


def ngrams(text: str, n_max: int = NGRAM_MAX) -> frozenset[str]:
    """The set of lower-cased word 1…``n_max``-grams of ``text`` (words: ``\\w+`` runs)."""
    w = _WORD.findall((text or "").lower())
    return frozenset(" ".join(w[i:i + n]) for n in range(1, n_max + 1) for i in range(len(w) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a ∩ b| / |a ∪ b| (1.0 for two empty sets: two sources without words are alike)."""
    if not a and not b:
        return 1.0
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def near_duplicate_groups(texts: list[str], threshold: float = NEAR_DUPLICATE) -> list[int]:
    """A group number per text: texts at Jaccard ≥ ``threshold`` (directly or through a chain of such pairs) share
    one. Group numbers are each group's smallest text index. Exact (prefix filtering, see the module docstring)."""
    if not 0 < threshold <= 1:
        raise ValueError("threshold must be in (0, 1]")
    sets = [ngrams(t) for t in texts]
    uf = _UnionFind(len(texts))
    # identical n-gram sets first: one representative each (a corpus repeating a message 100 times would otherwise
    # make 100² candidate pairs)
    first: dict[frozenset, int] = {}
    reps = []
    for i, s in enumerate(sets):
        j = first.setdefault(s, i)
        if j != i:
            uf.union(i, j)
        else:
            reps.append(i)
    df: dict[str, int] = {}
    for i in reps:
        for g in sets[i]:
            df[g] = df.get(g, 0) + 1
    index: dict[str, list[int]] = {}
    # shorter sets first: a longer set's partners of at least threshold·|x| n-grams are then already indexed or
    # come later and find it
    for i in sorted(reps, key=lambda i: (len(sets[i]), i)):
        x = sets[i]
        if not x:
            continue
        order = sorted(x, key=lambda g: (df[g], g))
        prefix = order[:len(x) - math.ceil(threshold * len(x)) + 1]
        seen: set[int] = set()
        for g in prefix:
            for j in index.get(g, ()):
                if j in seen:
                    continue
                seen.add(j)
                y = sets[j]
                if len(y) < threshold * len(x):  # size filter: too small to reach the threshold
                    continue
                if jaccard(x, y) >= threshold:
                    uf.union(i, j)
        for g in prefix:
            index.setdefault(g, []).append(i)
    return [uf.find(i) for i in range(len(texts))]


class NgramIndex:
    """An inverted index of ``texts``' word n-grams: :meth:`nearest` gives each query's nearest indexed text and
    their Jaccard, exactly (shared n-grams counted over the query's postings with ``np.bincount``)."""

    def __init__(self, texts: list[str]):
        self.size = len(texts)
        vocab: dict[str, int] = {}
        rows, cols = [], []
        self.lengths = np.zeros(len(texts), dtype=np.int64)
        for i, t in enumerate(texts):
            s = ngrams(t)
            self.lengths[i] = len(s)
            for g in s:
                rows.append(vocab.setdefault(g, len(vocab)))
                cols.append(i)
        self.vocab = vocab
        r = np.asarray(rows, dtype=np.int64)
        c = np.asarray(cols, dtype=np.int64)
        order = np.argsort(r, kind="stable")
        self.docs = c[order]
        self.starts = np.searchsorted(r[order], np.arange(len(vocab) + 1))

    def nearest(self, queries: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(jaccard, index)`` per query: the largest Jaccard with any indexed text and that text's index (the
        smallest on a tie; -1 and 0.0 when nothing is indexed or nothing is shared)."""
        sims = np.zeros(len(queries), dtype=np.float64)
        best = np.full(len(queries), -1, dtype=np.int64)
        for q, text in enumerate(queries):
            s = ngrams(text)
            ids = [self.vocab[g] for g in s if g in self.vocab]
            if not ids or not self.size:
                if not s and self.size and (self.lengths == 0).any():
                    sims[q], best[q] = 1.0, int(np.argmax(self.lengths == 0))
                continue
            hits = np.concatenate([self.docs[self.starts[k]:self.starts[k + 1]] for k in ids])
            inter = np.bincount(hits, minlength=self.size)
            jac = inter / (len(s) + self.lengths - inter)
            best[q] = int(np.argmax(jac))
            sims[q] = float(jac[best[q]])
        return sims, best


def nearness_profile(sims) -> dict:
    """A set of nearest-training Jaccards summarised: n, median, quartiles, mean, the share at or above
    ``NEAR_DUPLICATE`` and the share identical (1.0)."""
    x = np.asarray(sims, dtype=np.float64)
    if not x.size:
        return {"n": 0}
    q1, med, q3 = (float(v) for v in np.quantile(x, [0.25, 0.5, 0.75]))
    return {"n": int(x.size), "median": round(med, 3), "q1": round(q1, 3), "q3": round(q3, 3),
            "mean": round(float(x.mean()), 3),
            "share_near_duplicate": round(float((x >= NEAR_DUPLICATE).mean()), 3),
            "share_identical": round(float((x >= 1.0 - 1e-12).mean()), 3)}


def profile_text(p: dict, what: str) -> str:
    """One line: ``what``'s nearest-training Jaccard profile."""
    if not p.get("n"):
        return f"{what}: none"
    return (f"{what} ({p['n']}): median nearest-training Jaccard {p['median']:.2f} "
            f"(quartiles {p['q1']:.2f}–{p['q3']:.2f}); {100 * p['share_near_duplicate']:.0f} % at or above "
            f"{NEAR_DUPLICATE:g}")


def transfer_check(train_sources: list[str], heldout_sources: list[str], inputs: list[str],
                   index: NgramIndex | None = None, input_label: str = "your test inputs") -> dict:
    """How near ``inputs`` are to the training sources, beside how near the held-out samples are:
    ``{"measure", "inputs", "heldout", "farther", "text"}`` (the two profiles, whether the inputs are farther —
    their median lower by more than ``FARTHER_MARGIN`` — and one line to show where the numbers are read)."""
    index = index or NgramIndex(train_sources)
    inp = nearness_profile(index.nearest(inputs)[0])
    held = nearness_profile(index.nearest(heldout_sources)[0]) if heldout_sources else {"n": 0}
    farther = bool(inp.get("n") and held.get("n") and inp["median"] < held["median"] - FARTHER_MARGIN)
    if not inp.get("n"):
        text = ""
    elif not held.get("n"):
        text = profile_text(inp, input_label.capitalize()) + "; the memory has no held-out samples to compare with."
    else:
        who, be = input_label.capitalize(), "is" if inp["n"] == 1 else "are"
        head = (f"{who} {be} farther from the memory than its held-out samples: expect smaller gains than the "
                f"held-out scores show; methods that memorize may not transfer. " if farther else
                f"{who} {be} about as near the memory as its held-out samples. ")
        near = "Nearest-training" if inp["n"] == 1 else "Median nearest-training"
        text = (head + f"{near} Jaccard ({MEASURE}): {inp['median']:.2f} vs {held['median']:.2f} (median of "
                f"{held['n']} held-out); at or above {NEAR_DUPLICATE:g}: {100 * inp['share_near_duplicate']:.0f} % vs "
                f"{100 * held['share_near_duplicate']:.0f} %.")
    return {"measure": MEASURE, "inputs": inp, "heldout": held, "farther": farther, "text": text}
