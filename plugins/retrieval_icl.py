"""Retrieval in-context examples (Agrawal et al., "In-context Examples Selection for Machine Translation",
Findings of ACL 2023): the frozen base model prompted, for each input, with the memory's training samples whose
sources are nearest to it — the zero-training baseline every trained method has to beat.

Retrieval, as the paper's R-BM25: BM25 over the source side of the memory's *training* samples (never its held-out
ones) gives the top ``candidates`` (the paper: 100); these are re-ranked greedily for coverage of the input's word
n-grams (n = 1..4): each round takes the candidate with the highest recall of the input's n-grams that no chosen
example covers yet (the recall of each order over its count in the input, averaged over the four orders; a tie goes
to the better BM25 rank), then those n-grams count as covered; selection stops at ``k`` examples or when no
candidate covers anything new. The examples fill the task template of the comparison's prompt (the memory's), in
reverse order of choice, so the most relevant one stands next to the input.

Departures, each a setting or said here: ``k`` defaults to 4 (the paper tries up to 16 with XGLM 7.5B; 4 news-length
examples keep a prefill of a few hundred tokens on a CPU and inside a 270M model's useful context); ``fill`` (on by
default) tops a selection that stopped early up to ``k`` with the next BM25 candidates and then the prompt's own
examples (the paper leaves it short; a small model given one example, or none, copies or rambles); ``rerank`` off is
plain BM25 top-k. The paper also concatenates a tuned task-level example; here the memory's prompt examples only
fill. Tokens: lower-cased Unicode word characters (``\\w+``); BM25 with k1 1.2, b 0.75 and Lucene's idf
log(1 + (N − df + 0.5)/(df + 0.5)), each distinct query word counted once.

Nothing is learned: ``fit`` takes the training samples that have a source (synthetic ones too) and one line on
each side as the pool (a repeated pair once), tokenizes the sources and builds BM25's postings — in well under a
second for thousands of samples. The pool is saved beside the config as ``retrieval_index.json`` (JSON, listed with
its sha256 in ``plugin_config.json``, never pickle); a loaded plug-in rebuilds the postings from it on first use (as
fast). At decode time each row gets its own prompt through ``row_prompt`` (level "prompt", ``PromptMethod``), so
it decodes in the same batch as every other method (``engine.batch``: a prefill row of its own; such a batch is
left-padded, without the prompt-prefix cache and without a kept decode for slider moves).
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from backbone.prompts import Prompt
from ground.errors import UserError
from ground.settings import Setting, SettingsRecord
from plugins.base import FitResult, Plugin, PluginConfig
from plugins.card import MethodCard, TimeEstimate
from plugins.registry import register
from plugins.settings import Preset, setting

INDEX_FILE = "retrieval_index.json"
INDEX_FORMAT = 1
MAX_NGRAM = 4  # the paper's n-gram orders 1..4
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The retrieval's tokens: lower-cased runs of Unicode word characters."""
    return _WORD.findall(text.lower())


def ngrams(tokens: list[str], n_max: int = MAX_NGRAM) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for n in range(1, n_max + 1) for i in range(len(tokens) - n + 1)}


class BM25Index:
    """Okapi BM25 over tokenized documents (the pool's sources): postings built once, scores per query."""

    def __init__(self, docs: list[list[str]], k1: float = 1.2, b: float = 0.75):
        self.docs, self.k1, self.b = docs, float(k1), float(b)
        self.lengths = [len(d) for d in docs]
        self.avgdl = (sum(self.lengths) / len(docs)) if docs and sum(self.lengths) else 1.0
        self.postings: dict[str, list[tuple[int, int]]] = {}
        for i, d in enumerate(docs):
            for t, tf in Counter(d).items():
                self.postings.setdefault(t, []).append((i, tf))
        n = len(docs)
        self.idf = {t: math.log(1.0 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def top(self, query: list[str], n: int) -> list[int]:
        """The ``n`` best documents for ``query`` (those sharing at least one word), best first; ties by index."""
        scores: dict[int, float] = {}
        for t in dict.fromkeys(query):
            for i, tf in self.postings.get(t, ()):
                norm = tf + self.k1 * (1.0 - self.b + self.b * self.lengths[i] / self.avgdl)
                scores[i] = scores.get(i, 0.0) + self.idf[t] * tf * (self.k1 + 1.0) / norm
        return sorted(scores, key=lambda i: (-scores[i], i))[:n]


def rerank_by_coverage(query: list[str], docs: list[list[str]], candidates: list[int], k: int) -> list[int]:
    """The paper's re-ranking: greedily the candidate covering most of the input's still uncovered n-grams (mean
    recall over orders 1..4), until ``k`` are chosen or none covers anything new. Returns them in order of choice."""
    todo = {n: {g for g in ngrams(query) if len(g) == n} for n in range(1, MAX_NGRAM + 1)}
    total = {n: len(g) for n, g in todo.items() if g}
    grams = {c: ngrams(docs[c]) for c in candidates}
    chosen: list[int] = []
    left = list(candidates)
    while left and len(chosen) < k and any(todo[n] for n in total):
        def recall(c):
            return sum(len(todo[n] & grams[c]) / total[n] for n in total) / len(total)
        best = max(left, key=lambda c: (recall(c), -left.index(c)))
        if recall(best) <= 0.0:
            break
        chosen.append(best)
        left.remove(best)
        for n in total:
            todo[n] -= grams[best]
    return chosen


@dataclass
class RetrievalICLConfig(PluginConfig):
    bm25_k1: float = setting(1.2, "BM25's term-frequency saturation k1", low=0.0, high=10.0)
    bm25_b: float = setting(0.75, "BM25's document-length normalization b", low=0.0, high=1.0)

    # Nothing is trained: every preset is the shipped retrieval; the paper's choices that differ (k up to 16) are
    # decode settings, set per row in Compare / Evaluate.
    PRESETS = {
        "paper": Preset({}, "standard BM25 (k1 1.2, b 0.75) over the sources, then n-gram coverage re-ranking; "
                            "the paper's k (up to 16) is the decode setting k"),
        "quick": Preset({}, "the shipped retrieval (building the index takes well under a second)"),
    }


def icl_training_time(cls, config, rec: dict, samples: int, entries: int) -> dict:
    return {"setup_s": rec.get("setup_s", 0.0), "loops": [],
            "text": f"Nothing to train: an index of {samples:,} sources (seconds)."}


def icl_throughput_record(plugin, info: dict, history: list[dict], wall_s: float, memory) -> dict:
    return {"setup_s": round(wall_s, 3)}


CARD = MethodCard(
    paper=("Agrawal et al., In-context Examples Selection for Machine Translation (Findings of ACL 2023): the base "
           "model prompted with the memory samples nearest to the input (BM25 + n-gram coverage re-ranking)"),
    estimate=TimeEstimate(measure_settings={}, training_time=icl_training_time,
                          throughput_record=icl_throughput_record))


@register(CARD)
class RetrievalICL(Plugin):
    method = "retrieval_icl"
    title = "Retrieved in-context examples"
    Config = RetrievalICLConfig
    level = "prompt"
    decode_settings = (
        Setting("k", 4, "in-context examples per input (the paper: up to 16)", low=1, high=16, step=1,
                label="examples k"),
        Setting("candidates", 100, "BM25 candidates re-ranked for n-gram coverage (the paper: 100)", low=1,
                high=1000, step=1),
        Setting("rerank", True, "re-rank BM25's candidates for coverage of the input's n-grams (off: BM25's top k)"),
        Setting("fill", True, "a selection that stopped early is topped up to k (next BM25 candidates, then the "
                              "prompt's own examples); off: as the paper, fewer examples"),
    )

    def __init__(self, config: RetrievalICLConfig, backbone, memory_meta: dict | None = None):
        super().__init__(config, backbone, memory_meta)
        self.pool: list[dict] | None = None  # {"src", "tgt", "sample"} per training sample with a source
        self.index: BM25Index | None = None

    # --- the index ------------------------------------------------------------------------------------------------
    def fit(self, memory, progress=lambda *a: None, should_stop=lambda: False) -> FitResult:
        pool, seen = [], set()
        for i, s in enumerate(memory.samples):  # a repeated pair would only repeat an example
            src = s.get("src")
            # a line break inside an example would end it early in the prompt's line format
            if s["split"] == "train" and isinstance(src, str) and src.strip() and "\n" not in src + s["tgt"] \
                    and (src, s["tgt"]) not in seen:
                seen.add((s["src"], s["tgt"]))
                pool.append({"src": s["src"], "tgt": s["tgt"], "sample": i})
        if not pool:
            raise UserError("This memory has no training samples with a source to retrieve examples from.")
        self._set_pool(pool)
        progress(1.0, f"Indexed the sources of {len(pool)} training samples (BM25)")
        self.train_info = {"pool": len(pool), "vocabulary": len(self.index.postings)}
        return FitResult(metrics=dict(self.train_info))

    def _set_pool(self, pool: list[dict]) -> None:
        self.pool = pool
        self.index = BM25Index([words(p["src"]) for p in pool], self.config.bm25_k1, self.config.bm25_b)

    def save_extra_files(self, folder: Path) -> list[str]:
        self.prepare_decode()  # a loaded plug-in saved again (an export) reads its pool first
        data = {"format": INDEX_FORMAT, "tokens": "lower-cased \\w+ words", "pool": self.pool}
        (Path(folder) / INDEX_FILE).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        return [INDEX_FILE]

    def prepare_decode(self) -> None:
        """A loaded plug-in reads its index (checked against its sha256 when it was loaded) on first use."""
        if self.index is None:
            path = self.plugin_path
            if path is None:
                raise UserError("This retrieval plug-in has no index: train it on a memory first.")
            self._set_pool(read_pool(Path(path)))

    def examples(self, source: str, settings: SettingsRecord) -> list[dict]:
        """The pool samples chosen for ``source``, in order of choice (most relevant first)."""
        self.prepare_decode()
        q, k = words(source), settings.k
        cand = self.index.top(q, max(k, settings.candidates))
        chosen = rerank_by_coverage(q, self.index.docs, cand, k) if settings.rerank else cand[:k]
        if settings.fill:
            chosen += [c for c in cand if c not in chosen][:k - len(chosen)]
        return [self.pool[c] for c in chosen]

    def row_prompt(self, source: str, prompt: Prompt, settings: SettingsRecord) -> Prompt:
        chosen = [(p["src"], p["tgt"]) for p in self.examples(source, settings)][::-1]  # the best one last
        short = settings.k - len(chosen) if settings.fill else 0
        filler = list(prompt.examples[:max(0, short)])
        return Prompt(template=prompt.template, examples=filler + chosen, separator=prompt.separator,
                      chat=prompt.chat)


def read_pool(folder: Path) -> list[dict]:
    """The saved pool of a retrieval plug-in, its shape checked (a damaged file is a UserError)."""
    f = folder / INDEX_FILE
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"The plug-in at {folder} is damaged: {INDEX_FILE} is unreadable ({type(e).__name__}). "
                        f"Train it again.") from None
    pool = data.get("pool") if isinstance(data, dict) else None
    if not isinstance(pool, list) or data.get("format") != INDEX_FORMAT or not pool or not all(
            isinstance(p, dict) and isinstance(p.get("src"), str) and isinstance(p.get("tgt"), str)
            and isinstance(p.get("sample"), int) for p in pool):
        raise UserError(f"The plug-in at {folder} is damaged: {INDEX_FILE} has no valid pool. Train it again.")
    return [{"src": p["src"], "tgt": p["tgt"], "sample": p["sample"]} for p in pool]
