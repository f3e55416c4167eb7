"""A memory's profile: what it holds at a glance, computed from the stored memory alone (no backbone).

* counts: entries, samples (training and held out), entries per sample, distinct value tokens, key size and RMS;
* the held-out split: how it was chosen and how near its sources are to the training ones (``Memory.split``);
* the value-token frequencies (the top ``top_n`` tokens with their counts and shares);
* a 2-D projection of a seeded sample of at most ``PROJECTION_SAMPLE`` keys: PCA by SVD of the sample's keys
  divided by the memory's key RMS — the space kNN searches (``normalize_keys``) and PEMA's adapter reads
  (``normalize_input``) — centred on the sample's mean; each point is an entry, coloured by its value token;
* each top token's spread: the RMS distance of its sampled keys from their own centroid (full key space), beside the
  sample's overall spread, so a token whose contexts agree (small spread) stands out from one used everywhere.

The projection (mean and two components) is kept in the profile so that other vectors — a decode's query f(c),
PEMA's h_pd, the neighbours' keys — land on the same map (:func:`project`). :func:`entry_context` finds an entry's
place in its sample's target, to show the value token inside its sentence.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

PROJECTION_SAMPLE = 2000
PROJECTION_SEED = 0
TOP_TOKENS = 30
PROJECTION_METHOD = ("PCA of a seeded sample of at most {n:,} keys, each divided by the memory's key RMS "
                     "(the space kNN searches and PEMA's adapter reads)")


def _sample_rows(n: int, size: int, seed: int) -> np.ndarray:
    """A sorted seeded sample of ``size`` of ``n`` entry indices (all of them when there are no more)."""
    if n <= size:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def scaled_keys(memory, rows: np.ndarray) -> np.ndarray:
    """The keys of entries ``rows`` divided by the memory's key RMS, float32 (reads only those rows)."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return np.zeros((0, memory.keys.shape[1]), dtype=np.float32)
    order = np.argsort(rows, kind="stable")  # a memory-mapped file reads fastest in order
    out = np.empty((len(rows), memory.keys.shape[1]), dtype=np.float32)
    out[order] = np.asarray(memory.keys[rows[order]], dtype=np.float32)
    return out / np.float32(memory.key_scale)


def _components(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """Mean, the top-2 principal directions (2×d, signs fixed: each one's largest coordinate positive) and the
    shares of variance they explain. Fewer than 2 directions (one entry, identical keys) are padded with zeros."""
    d = x.shape[1]
    mean = x.mean(0) if len(x) else np.zeros(d, dtype=np.float32)
    centred = x - mean
    comps = np.zeros((2, d), dtype=np.float32)
    explained = [0.0, 0.0]
    if len(x) >= 2:
        c64 = centred.astype(np.float64)
        s, vt = _top_directions(c64)
        total = float((c64 ** 2).sum())
        for i in range(min(2, len(s))):
            v = vt[i]
            if v[np.argmax(np.abs(v))] < 0:
                v = -v
            comps[i] = v
            explained[i] = round(float(s[i] ** 2) / total, 4) if total > 0 else 0.0
    return mean.astype(np.float32), comps, explained


def _top_directions(c: np.ndarray, k: int = 8, iterations: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Singular values and right singular vectors of ``c`` (m×d), the largest first — the top ``k`` found by
    subspace iteration (a block power method, ``iterations`` rounds, then the SVD of the m×k projection). A full
    SVD of a sample of thousands of keys solves the full d×d problem, slow on a busy CPU; this costs a few products
    of the sample, and on Gemma keys matches the full SVD's first two directions (a test checks it on the tiny
    backbone's)."""
    m, d = c.shape
    k = min(k, m, d)
    if k >= min(m, d):  # small: the exact SVD is as cheap
        _, s, vt = np.linalg.svd(c, full_matrices=False)
        return s, vt
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, k)))
    for _ in range(iterations):
        q, _ = np.linalg.qr(c.T @ (c @ q))
    _, s, vt = np.linalg.svd(c @ q, full_matrices=False)
    return s, vt @ q.T


def project(profile: dict, vectors) -> np.ndarray:
    """``vectors`` (n×d, already divided by the key RMS) on the profile's 2-D map: (n, 2)."""
    proj = profile["projection"]
    v = np.atleast_2d(np.asarray(vectors, dtype=np.float32))
    return (v - np.asarray(proj["mean"], dtype=np.float32)) @ np.asarray(proj["components"], dtype=np.float32).T


def _rms_spread(x: np.ndarray) -> float | None:
    """RMS distance of the rows of ``x`` from their centroid (None for fewer than 2 rows)."""
    if len(x) < 2:
        return None
    return round(float(np.sqrt(((x - x.mean(0)) ** 2).sum(1).mean())), 4)


def memory_profile(memory, token_text: Callable[[int], str] = str, top_n: int = TOP_TOKENS,
                   sample: int = PROJECTION_SAMPLE, seed: int = PROJECTION_SEED) -> dict:
    """The profile of a stored memory (JSON-able; see the module docstring). ``token_text(id)`` names a token
    (the backbone's tokenizer; the default shows ids)."""
    if top_n < 1 or sample < 1:
        raise ValueError("top_n and sample must be at least 1")
    meta = memory.meta
    st = meta["stats"]
    n = len(memory)
    values = np.asarray(memory.values, dtype=np.int64)
    ids, counts = np.unique(values, return_counts=True) if n else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    order = np.lexsort((ids, -counts))[:top_n]  # most frequent first, ties by id
    rows = _sample_rows(n, sample, seed)
    x = scaled_keys(memory, rows)
    mean, comps, explained = _components(x)
    points = (x - mean) @ comps.T if len(x) else np.zeros((0, 2), dtype=np.float32)
    sample_tokens = values[rows]
    top = []
    for i in order:
        tid, c = int(ids[i]), int(counts[i])
        mine = sample_tokens == tid
        top.append({"token_id": tid, "text": token_text(tid), "count": c, "share": round(c / n, 4),
                    "in_sample": int(mine.sum()), "spread": _rms_spread(x[mine]),
                    "centroid": [round(float(v), 4) for v in points[mine].mean(0)] if mine.any() else None})
    samples = int(st["samples"])
    return {
        "memory_id": memory.id, "name": meta.get("name", ""), "task": memory.task, "mode": meta.get("mode"),
        "entries": n, "samples": samples, "heldout_samples": int(st["heldout_samples"]),
        "heldout_entries": int(st["heldout_entries"]),
        "entries_per_sample": round(n / samples, 2) if samples else 0.0,
        "distinct_tokens": int(len(ids)), "hidden_size": int(memory.keys.shape[1]) if n else meta.get("hidden_size"),
        "key_rms": round(float(memory.key_scale), 4),
        "split": memory.split,
        "top_tokens": top, "overall_spread": _rms_spread(x),
        "projection": {"method": PROJECTION_METHOD.format(n=sample), "seed": seed, "sample_size": int(len(rows)),
                       "explained": explained, "mean": [float(v) for v in mean],
                       "components": [[float(v) for v in c] for c in comps],
                       "entries": [int(r) for r in rows], "tokens": [int(t) for t in sample_tokens],
                       "points": [[round(float(a), 4), round(float(b), 4)] for a, b in points]},
    }


def entry_context(memory, entry: int) -> dict:
    """Where entry ``entry`` sits: its sample (index into ``memory.samples``), its position in that sample's
    target tokens, and those tokens (the stored values, so they match the memory exactly: the prompt's target
    prefix and the closing line end included). Entries of one sample are stored together, in target order."""
    values, owners = memory.values, memory.entry_sample
    if not 0 <= entry < len(values):
        raise IndexError(f"entry {entry} is outside the memory (0…{len(values) - 1})")
    s = int(owners[entry])
    # entries are stored sample by sample in ascending sample order (memories.build), so a sample's entries are
    # one run around ``entry``: walk to its ends in bounded steps (a target has at most a few hundred tokens)
    lo = entry
    while lo > 0 and int(owners[lo - 1]) == s:
        lo -= 1
    hi = entry + 1
    while hi < len(values) and int(owners[hi]) == s:
        hi += 1
    return {"sample": s, "position": entry - lo, "first": lo,
            "tokens": [int(t) for t in np.asarray(values[lo:hi])]}


def highlighted_target(memory, entry: int, decode: Callable[[list[int]], str],
                       token_text: Callable[[int], str]) -> dict:
    """The target sentence of entry ``entry``'s sample in three parts, the entry's value token in the middle:
    ``{"before", "match", "after", "sample", "position"}`` (texts decoded from the stored value tokens)."""
    c = entry_context(memory, entry)
    toks, p = c["tokens"], c["position"]
    return {"before": decode(toks[:p]), "match": token_text(toks[p]), "after": decode(toks[p + 1:]).rstrip("\n"),
            "sample": c["sample"], "position": p}
