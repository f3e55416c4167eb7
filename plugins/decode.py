"""One batched decode for a comparison: every method is a row (or, with beam search, a block of rows) of one batch
that shares the backbone's forward pass.

Per step: the backbone runs once for the whole batch with the in-network plug-ins' hooks active on their own rows;
f(c) of every row and the output-level plug-ins' extra states (PEMA's h_pd) go through the frozen norm + LM head
in **one** matrix product; each output-level plug-in mixes its rows; tokens are picked per row; rows stop
independently at the end of the sentence line. The prompt is encoded once per distinct in-network state (rows
without in-network plug-ins share one prefill); the forward pass then runs one row per distinct live batch row
(``BatchDecode``'s compact layout: rows that agree share, finished rows leave).

Greedy by default; ``num_beams > 1`` runs beam search per row (no length penalty; a row stops when its best
finished hypothesis scores at least as well as its best live one, which is exact since scores only decrease).

``decode_batch`` is a loop over pieces that can be used (and tested) alone: ``plan_batch`` (the request and the
batch layout, ``Batch``), ``prefill`` (prompts, prefix KV cache, repeat over rows and beams), ``decode_step`` (LM
head, mixing, trace of one step), ``Beams.select`` (greedy / beam token selection) and ``forward_step`` (the next
forward pass).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import torch

from backbone.model import Backbone, grow_kv_cache, relayout_kv_rows, small_work_threads, vocab_wide_threads
from backbone.prompts import Prompt, common_prefix_len, postprocess
from ground.errors import UserError
from plugins.base import MixInput, MixOutput, Plugin, mix_logprobs
from plugins.network import row_span, set_own_from
from plugins.seqtrain import shared_prompt_len
from plugins.settings import comparison_settings, split_comparison

TOP = 5


@dataclass
class Row:
    """One method in a comparison: a label, a plug-in (None for the base model) and its decode-time settings."""

    label: str
    plugin: Plugin | None = None
    settings: dict = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.plugin.method if self.plugin is not None else "base"


@dataclass
class RowResult:
    label: str
    method: str
    text: str          # post-processed (first line, stripped), as the paper's Table 10
    raw_text: str
    tokens: list[int]
    token_texts: list[str]
    trace: list[dict]  # per output token: λ_t, top-5 of P_LM / plug-in / final, extras (kNN neighbours, ...)
    settings: dict
    score: float


@dataclass
class Comparison:
    source: str
    context_ids: list[int]
    src_len: int
    rows: list[RowResult]
    seconds: float
    steps: int
    num_beams: int
    backbone: str

    def to_dict(self) -> dict:
        return asdict(self)

    def row(self, label: str) -> RowResult:
        return next(r for r in self.rows if r.label == label)


def _stable_top(y: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of ``y`` (R, n), largest first, ties broken by the lower index: ``torch.topk``
    for the k-th value, then of the entries equal to it the lowest-indexed ones (``topk`` leaves ties unspecified)."""
    R = y.shape[0]
    vk = y.topk(k, dim=-1).values[:, -1:]
    gt = y > vk
    eq = y == vk
    take = gt | (eq & (eq.cumsum(-1) <= k - gt.sum(-1, keepdim=True)))
    if int(take.sum()) != R * k:  # NaN: no order to keep; a full stable sort decides
        v, i = torch.sort(y, dim=-1, descending=True, stable=True)
        return v[:, :k], i[:, :k]
    pos = take.nonzero()[:, 1].view(R, k)  # ascending positions per row
    v, o = torch.sort(y.gather(1, pos), dim=-1, descending=True, stable=True)
    return v, pos.gather(1, o)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values along the last dimension of ``x`` (1-D or 2-D) and their indices, largest first,
    ties broken by the lower index (as a stable descending sort). For a vocabulary-sized row (Gemma: 262,144) in two
    stages — each chunk's maximum, the k chunks with the largest maxima, then the top k among their entries —,
    exact: a chunk whose maximum is not among the top k maxima holds none of the top k values. ``torch.topk`` on
    such a row first copies all of it into a scratch vector of (value, index) pairs (0.6-2.3 ms per row and decode
    step here, one-off probe); this reads the row once."""
    one = x.dim() == 1
    x2 = x.unsqueeze(0) if one else x
    R, V = x2.shape
    k = min(k, V)
    C = 1024 if k <= 8 else 128  # chunk width: the candidates (k·C) stay a small share of the row
    if V < 8 * k * C:
        v, i = _stable_top(x2, k)
    else:
        pad = (-V) % C
        xp = torch.nn.functional.pad(x2, (0, pad), value=float("-inf")) if pad else x2
        chunks = xp.reshape(R, -1, C)
        order = _stable_top(chunks.amax(-1), k)[1].sort(-1).values       # the chunks, in index order
        cand = chunks.gather(1, order.unsqueeze(-1).expand(-1, -1, C)).reshape(R, -1)
        v, j = _stable_top(cand, k)                                       # candidates are in index order too
        i = order.gather(1, j // C) * C + j % C
    return (v[0], i[0]) if one else (v, i)


def _top(lp: torch.Tensor, backbone: Backbone, k: int = TOP) -> list[list]:
    v, i = top_k(lp, k)
    return [[int(t), backbone.token_str(int(t)), round(float(p), 4)] for t, p in zip(i.tolist(), v.exp().tolist())]


def _key(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True, default=str)


class PrefixKV:
    """A small LRU of prompt-prefix KV caches for single-source decodes.

    Every comparison with the same prompt starts with the same instruction and few-shot examples (hundreds of
    tokens with the built-in prompts), and the app re-decodes the same rows each time a slider moves. The prefix's
    KV cache is kept per (backbone, prefill groups, prefix tokens); a group of in-network rows is keyed by its
    plug-in (held weakly, with its weights' version counters, so that a retrained or freed plug-in never matches)
    and settings. Multi-source batches are left-padded and do not use it.
    """

    MIN_TOKENS = 16  # shorter shared prefixes are not worth a cache entry

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def shared_len(backbone: Backbone, prompt: Prompt, source: str, ctx: list[int]) -> int:
        """Tokens of ``ctx`` that the prompt renders the same for any source (at least one token is left over)."""
        # Tokens at the slot's edge may merge with the source's first characters, so the prefix is what the
        # prompt renders the same for two unrelated sources and for this one.
        others = [backbone.encode_context(prompt.render(s)) for s in ("0", "Xy")]
        n = min(common_prefix_len([ctx, *others]), len(ctx) - 1)
        return n if n >= PrefixKV.MIN_TOKENS else 0

    @staticmethod
    def _version(plugin) -> int:
        return sum(t._version for t in itertools.chain(plugin.parameters(), plugin.buffers()))

    def _key(self, backbone, groups: list) -> tuple:
        return (id(backbone.model),
                tuple((id(p), k, self._version(p)) if p is not None else None for p, k in groups))

    def get(self, backbone, groups: list, ctx: list[int]):
        """``(P, cache)``: a copy of the longest stored prefix cache for these groups whose tokens start ``ctx``
        (at least one token of ``ctx`` left over), or ``(0, None)``."""
        key = self._key(backbone, groups)
        owners = [backbone.model] + [p for p, _ in groups]
        with self._lock:
            best = None
            for (k, prefix), (refs, cache) in list(self._entries.items()):
                if k != key:
                    continue
                if any(r() is not o for r, o in zip(refs, owners)):
                    del self._entries[(k, prefix)]  # an id was reused by another object
                    continue
                n = len(prefix)
                if n < len(ctx) and tuple(ctx[:n]) == prefix and (best is None or n > len(best[0])):
                    best = (prefix, cache)
            if best is None:
                return 0, None
            self._entries.move_to_end((key, best[0]))
        return len(best[0]), copy.deepcopy(best[1])

    def put(self, backbone, groups: list, prefix: list[int], cache) -> None:
        refs = [weakref.ref(backbone.model)] + [weakref.ref(p) if p is not None else (lambda: None)
                                                for p, _ in groups]
        entry_key = (self._key(backbone, groups), tuple(prefix))
        with self._lock:
            self._entries[entry_key] = (refs, copy.deepcopy(cache))
            self._entries.move_to_end(entry_key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


PREFIX_KV = PrefixKV()


def compare(backbone: Backbone, source: str, rows: list[Row], prompt: Prompt | None = None,
            max_new_tokens: int = 64, num_beams: int = 1, trace: bool = True,
            context_ids: list[int] | None = None, use_prefix_cache: bool = True,
            no_repeat_ngram: int | None = None) -> Comparison:
    """Decode ``source`` with every row at once and return each row's text, tokens and per-token trace."""
    return decode_batch(backbone, [source], rows, prompt, max_new_tokens, num_beams, trace,
                        [context_ids] if context_ids else None, use_prefix_cache, no_repeat_ngram)[0]


def decode_batch(backbone: Backbone, sources: list[str], rows: list[Row], prompt: Prompt | None = None,
                 max_new_tokens: int = 64, num_beams: int = 1, trace: bool = True,
                 contexts: list[list[int]] | None = None, use_prefix_cache: bool = True,
                 no_repeat_ngram: int | None = None, ref_lens: list[int] | None = None) -> list[Comparison]:
    """Decode several sources × every row in one batch (left-padded prompts); one Comparison per source.

    A single source reuses the KV cache of the prompt's shared prefix (instruction and few-shot examples) from an
    earlier decode with the same prefill groups (``PREFIX_KV``), so only the source's own tokens are prefilled.

    Batch layout: index ``(s * R + r) * B + j`` for source s, row r, beam j (``Batch``). Left padding is masked
    out; rotary position offsets cancel in attention scores, so a padded row computes what it would alone (up to
    float rounding).

    Repetition guard (``no_repeat_ngram``, a comparison setting: ``plugins.settings.COMPARISON_SETTINGS``; given
    here or in any row's settings): no row may repeat an n-gram of its own output tokens — every row alike, the
    base model's included. Off (0) by default.

    ``ref_lens``: per source, the token length of its reference — evaluation only, for plug-ins whose schedule
    the public code ties to the reference (PEMA's GU ``gu_variant="code"``, ``MixInput.ref_len``); a decode
    without references leaves it None.

    The loop itself is ``BatchDecode`` (one step at a time: streaming and cancelling between steps).
    """
    t0 = time.time()
    batch = plan_batch(backbone, sources, rows, prompt, num_beams, contexts,
                       {} if no_repeat_ngram is None else {"no_repeat_ngram": no_repeat_ngram}, ref_lens)
    return BatchDecode(backbone, batch, max_new_tokens, trace, use_prefix_cache, t0=t0).run()


COMPACT_ROWS = {"on": True}  # BatchDecode's compact layout; benchmarks and tests switch it off to compare
KEEP_TOP = 64  # per step and row of a kept decode: the top tokens of P_LM and of P_plug-in (LiveComparison)


@dataclass
class StepRecords:
    """What a kept decode (``BatchDecode(keep=True)``) holds per step of one row whose plug-in interpolates: f(c)
    (the plug-in's input: kNN's query, PEMA's adapter input; exact), and of the two distributions only their top
    ``KEEP_TOP`` tokens — P_LM at ``lm_idx`` and P_plug-in at ``plug_idx`` — each side's log-probability at both
    sets (``lm_at_plug`` is NaN where P_LM is not known: after the plug-in's distribution was recomputed without
    the LM head), and so the bound every other token stays under (each side's K-th value). Full distributions
    (262,144 floats per step on Gemma) are not kept: they are what the bound stands in for."""

    fc: list = field(default_factory=list)          # (d,) per step, on the backbone's device
    lm_idx: list = field(default_factory=list)      # (K,) long, CPU
    lm_val: list = field(default_factory=list)      # (K,) float32, descending
    plug_at_lm: list = field(default_factory=list)  # (K,)
    plug_idx: list = field(default_factory=list)    # (K,)
    plug_val: list = field(default_factory=list)    # (K,) descending
    lm_at_plug: list = field(default_factory=list)  # (K,) NaN: unknown (≤ the LM's K-th value)

    def add(self, fc, lm: torch.Tensor, plug: torch.Tensor, k: int) -> None:
        """Record one step from the full distributions (V,) of the LM and of the plug-in."""
        lv, li = top_k(lm, k)
        pv, pi = top_k(plug, k)
        self.fc.append(fc.detach().clone())
        for name, t in (("lm_idx", li), ("lm_val", lv), ("plug_at_lm", plug[li]), ("plug_idx", pi),
                        ("plug_val", pv), ("lm_at_plug", lm[pi])):
            getattr(self, name).append(t.detach().float().cpu() if name not in ("lm_idx", "plug_idx")
                                       else t.detach().cpu())

    def sliced(self, stop: int) -> "StepRecords":
        return StepRecords(*(getattr(self, f.name)[:stop] for f in dataclasses.fields(self)))

    def extended(self, other: "StepRecords") -> "StepRecords":
        return StepRecords(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def set_step(self, t: int, other: "StepRecords", j: int = 0) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name)[t] = getattr(other, f.name)[j]


class BatchDecode:
    """``decode_batch`` one step at a time. ``step()`` runs the next step (the prefill first) and says whether the
    decode goes on; ``partial()`` is every row's output so far (streaming), ``result()`` the comparisons, ``run()``
    all steps. To cancel, stop calling ``step()``: no hook stays attached between two steps (in-network plug-ins
    attach for each forward pass only, a step putting back the hooks the previous one took off: the same functions,
    rows, settings and products derived from the plug-in's weights, which a decode reads as they were at its first
    step), so the backbone is free for others between steps.

    Compact layout (``COMPACT_ROWS``): the forward pass, the KV cache and the LM head's P_LM hold one row per
    *distinct live* batch row, not one per batch row. Rows of one prefill group (the base row, PEMA and kNN: no
    in-network plug-in) compute the very same hidden states while their tokens agree, so they share a row until
    their tokens part; a finished row leaves the forward pass (rows finish at different steps, and the decode runs
    until the last one does). ``phys[b]`` is batch row ``b``'s row; the cache is re-laid out (one row selection)
    only at a step where a row parts or finishes. A row computes what it computes in a batch of any other size —
    bit for bit where the linears pad their products for steady bits (packed bfloat16, float16 weight-only), else to
    the rounding of a product over another row count (float32's BLAS): the same tokens (tested on the tiny model and
    measured on Gemma, ``eval.bench rows``' ``whole_comparisons``).

    ``keep=True`` (one source, greedy): also record, per row and step, what a slider move needs
    (``StepRecords``), and keep each row's KV cache (``row_cache``) — ``live()`` is then the comparison's
    ``LiveComparison``. ``resume()`` starts from a kept state (a slider move's re-decode of the rows that
    change)."""

    def __init__(self, backbone: Backbone, batch: Batch, max_new_tokens: int = 64, trace: bool = True,
                 use_prefix_cache: bool = True, keep: bool = False, t0: float | None = None):
        self.t0 = time.time() if t0 is None else t0
        self.backbone, self.batch = backbone, batch
        self.max_new_tokens, self.trace, self.use_prefix_cache = int(max_new_tokens), trace, use_prefix_cache
        self.guard = int(batch.comparison.get("no_repeat_ngram", 0))
        self.keep = keep and batch.S == 1 and batch.B == 1
        self.compact = COMPACT_ROWS["on"]
        self.beams = Beams(batch.S * batch.R, batch.B, backbone.stop_ids, backbone.tokenizer.pad_token_id or 0)
        self.step_no = 0  # the next step's index
        self.fc_last = self.cache = self.mask = None  # per row of the cache (compact: ``phys``), else per batch row
        self.phys: torch.Tensor | None = None  # compact layout: batch row → its row of the cache and of fc_last
        self.phys_list: list[int] = []  # the same as a list (no device round trip per use)
        self.finished_caches: dict[int, tuple] = {}  # keep: batch row → (cache, row) as it was when it finished
        self.prefill_handles: list[list] = [[] for _ in batch.net]
        self.net_handles: list[list] = [[] for _ in batch.net]  # per in-network group: its latest forward's
        # per in-network group: (the rows its step hooks act on, the position there of each of its batch rows)
        self.net_rows: list[tuple] = [(None, None) for _ in batch.net]
        self.forwards = 0  # backbone forward passes run (the prefill counts as one)
        self.finished = False
        self.seconds = 0.0
        self.records: dict[int, StepRecords] = {}

    def resume(self, step: int, fc_last: torch.Tensor, cache, tokens: list[list[int]], traces: list[list[dict]],
               scores: list[float]) -> "BatchDecode":
        """Start at ``step`` (one source, greedy): every row's f(c) at that step, its KV cache up to the step, its
        tokens, trace entries and float32 score so far."""
        self.step_no, self.fc_last, self.cache = step, fc_last, cache
        dev = self.backbone.device
        self.mask = torch.ones((len(tokens), len(self.batch.contexts[0]) + step), dtype=torch.long, device=dev)
        if self.compact:
            self._set_layout(list(range(len(tokens))))
        self.beams.tokens = [list(t) for t in tokens]
        self.beams.traces = [list(t) for t in traces]
        self.beams.scores = torch.tensor(scores, dtype=torch.float32).reshape(len(tokens), 1)
        return self

    def row_fc(self, b: int) -> torch.Tensor:
        """Batch row ``b``'s f(c) at the current step."""
        return self.fc_last[b if self.phys is None else self.phys_list[b]]

    def row_cache(self, b: int) -> tuple:
        """(the KV cache holding batch row ``b``, its row in it): a finished row's as it was when it finished."""
        if b in self.finished_caches:
            return self.finished_caches[b]
        return self.cache, b if self.phys is None else self.phys_list[b]

    def step(self) -> bool:
        if self.finished:
            return False
        bb, batch = self.backbone, self.batch
        if self.cache is None:
            self.fc_last, self.cache, self.mask, self.prefill_handles = prefill(
                bb, batch, self.use_prefix_cache, self.trace, expand=not self.compact)
            if self.compact:
                self._set_layout([batch.prefill_row(b) for b in range(batch.N)])
            self.forwards += 1
        step = self.step_no
        attached = [(grp, self.net_handles[g], self.prefill_handles[g], self.net_rows[g][1])
                    for g, grp in enumerate(batch.net)] if self.trace else None
        out = decode_step(bb, batch, self.fc_last, step, attached, keep_plugin=self.keep, phys=self.phys)
        with torch.no_grad(), small_work_threads():
            if self.guard:
                ban_repeated_ngrams(out.final, self.beams.tokens, self.guard)
            if self.keep:
                for r, plug in out.plugin.items():
                    if not self.beams.done[r]:
                        rec = self.records.setdefault(r, StepRecords())
                        rec.add(self.row_fc(r), out.lm(r), plug, min(KEEP_TOP, plug.shape[-1]))
            next_tok, src = self.beams.select(out.final, trace_item(bb, out) if self.trace else None)
        self.step_no = step + 1
        if self.beams.all_done or self.step_no >= self.max_new_tokens:
            self.finished, self.seconds = True, time.time() - self.t0
            return False
        if self.phys is not None:
            with torch.no_grad(), small_work_threads():  # row copies: parallel regions that would wake a thread
                next_tok = self._relayout(next_tok, src)
            src = None
        handles: list = []
        try:
            for g, grp in enumerate(batch.net):  # hooks on for this forward pass only: the last step's put back
                rows, where = self._group_rows(g, grp)
                if rows is None:
                    continue
                kept, key = self.net_handles[g], rows.tolist()
                if not (kept and self.net_rows[g][0] == key
                        and all(hasattr(h, "resume") and h.resume() for h in kept)):
                    for h in kept:
                        h.remove()
                    self.net_handles[g] = grp.plugin.attach(rows, grp.settings, trace=self.trace)
                self.net_rows[g] = (key, where)
                handles += self.net_handles[g]
            self.fc_last, self.cache, self.mask = forward_step(bb, self.cache, self.mask, next_tok,
                                                               src if batch.B > 1 else None, padded=batch.S > 1)
        finally:
            for h in handles:
                if not (hasattr(h, "suspend") and h.suspend()):
                    h.remove()
        self.forwards += 1
        return True

    def _relayout(self, next_tok: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """The compact layout of the next forward pass: one row per distinct (row it continues, next token) among
        the live batch rows; the cache (and mask) re-laid out when that is not the current one. A row keeps its
        place while one of its continuations lives (the first in batch-row order) and the others are appended, so
        that rows parting copy only the parted rows' caches (``relayout_kv_rows``). Returns the next token per row
        of the new layout."""
        B, dev = self.batch.B, self.backbone.device
        old = self.phys_list
        live = {b: (old[s], tok) for b, (s, tok) in enumerate(zip(src.tolist(), next_tok.tolist()))
                if not self.beams.done[b // B]}
        distinct = list(dict.fromkeys(live.values()))  # (old row, token), in batch-row order
        stays = {}
        for key in distinct:
            stays.setdefault(key[0], key)
        order = [stays[r] for r in sorted(stays)] + [key for key in distinct if stays[key[0]] != key]
        at = {key: i for i, key in enumerate(order)}
        phys = [at[live[b]] if b in live else 0 for b in range(len(old))]  # a finished row's entry is never read
        if self.keep:  # a row that finished leaves the layout: keep its cache as it is (the tensors are not copied)
            gone = [b for b in range(len(old)) if self.beams.done[b // B] and b not in self.finished_caches]
            if gone:
                snapshot = _cache_view(self.cache)
                self.finished_caches.update({b: (snapshot, old[b]) for b in gone})
        gather = [r for r, _ in order]
        if gather != list(range(self.mask.shape[0])):
            relayout_kv_rows(self.cache, gather, row_capacity=len(live))
            self.mask = self.mask[torch.tensor(gather, device=dev)]
        self._set_layout(phys)
        return torch.tensor([tok for _, tok in order], dtype=torch.long)

    def _set_layout(self, phys: list[int]) -> None:
        self.phys_list = phys
        self.phys = torch.tensor(phys, device=self.backbone.device)

    def _group_rows(self, g: int, grp: NetGroup) -> tuple:
        """(the rows in-network group ``g``'s hooks act on in the next forward pass — None: none live —, for a
        compact layout the position there of each of the group's batch rows)."""
        if self.phys is None:
            return grp.rows, None
        B = self.batch.B
        members = grp.rows.tolist()
        live = [b for b in members if not self.beams.done[b // B]]
        if not live:
            return None, None
        rows = sorted({self.phys_list[b] for b in live})
        at = {p: j for j, p in enumerate(rows)}
        return (torch.tensor(rows, device=self.backbone.device),
                [at[self.phys_list[b]] if not self.beams.done[b // B] else None for b in members])

    def run(self) -> list[Comparison]:
        while self.step():
            pass
        return self.result()

    def partial(self) -> list[Comparison]:
        return _comparisons(self.backbone, self.batch, self.beams, self.step_no, time.time() - self.t0)

    def result(self) -> list[Comparison]:
        return _comparisons(self.backbone, self.batch, self.beams, self.step_no,
                            self.seconds if self.finished else time.time() - self.t0)

    def live(self) -> "LiveComparison | None":
        """The finished kept decode as a ``LiveComparison`` (None without ``keep``)."""
        return LiveComparison(self) if self.keep and self.finished else None


def ban_repeated_ngrams(logprobs: torch.Tensor, tokens: list[list[int]], n: int) -> int:
    """The repetition guard: for every batch row, set to −inf the log-probability of each token that would
    complete an n-gram already in that row's output ``tokens[b]`` (HF's ``no_repeat_ngram_size``, over the output
    only — the prompt and the source may be copied). In place; returns how many (row, token) pairs it banned."""
    if n <= 0:
        return 0
    banned = 0
    for b, toks in enumerate(tokens):
        bad = repeated_ngram_ends(toks, n)
        if bad:
            logprobs[b, list(bad)] = float("-inf")
            banned += len(bad)
    return banned


def repeated_ngram_ends(toks: list[int], n: int) -> set[int]:
    """The tokens that would complete an n-gram already in ``toks`` (what the repetition guard bans next)."""
    if n <= 0 or len(toks) < n:
        return set()
    prefix = tuple(toks[len(toks) - n + 1:]) if n > 1 else ()
    return {toks[i + n - 1] for i in range(len(toks) - n + 1) if tuple(toks[i:i + n - 1]) == prefix}


# --- the batch: request and layout ---------------------------------------------------------------------------------
@dataclass
class NetGroup:
    """Rows with the same in-network plug-in and settings: one prefill row per source, one attachment of hooks."""

    plugin: Plugin
    key: str                  # the settings as JSON (with the plug-in, what the prefix cache is keyed by)
    settings: dict
    members: list[int]        # row indices
    prefill: int = 0          # its prefill group
    rows: torch.Tensor | None = None  # its batch rows during the steps


@dataclass
class OutGroup:
    """Rows whose plug-in mixes the output distribution (output-level, or in-network with ``mixes_output``)."""

    plugin: Plugin
    rows: torch.Tensor        # batch rows
    settings: list[dict]      # per batch row
    src_lens: list[int]       # per batch row
    ref_lens: list[int | None] | None = None  # per batch row, when the request gave reference lengths

    @property
    def row_index(self) -> slice | torch.Tensor:
        """``rows`` as a slice where they are consecutive (the usual layout): a step then reads the rows' P_LM as a
        view and writes their mixture with one copy, instead of an indexed copy of vocabulary-wide rows each way."""
        span = row_span(self.rows)
        return self.rows if span is None else span


@dataclass
class Batch:
    """One batched decode: S sources × R rows × B beams at batch row ``(s·R + r)·B + j``, the rows' settings and
    groups. Prefill group 0 holds the rows without an in-network plug-in (when there are any: ``shared``), then one
    group per in-network group; prefill row ``s·G + g``."""

    sources: list[str]
    rows: list[Row]
    prompt: Prompt
    contexts: list[list[int]]
    src_lens: list[int]
    settings: list[dict]      # per row, complete (the method's own settings)
    num_beams: int
    net: list[NetGroup]
    out: list[OutGroup]
    shared: int
    group_of_row: list[int]   # prefill group per row
    comparison: dict = field(default_factory=dict)  # settings of every row alike that are on (repetition guard)
    ref_lens: list[int] | None = None  # per source: the reference's token length (evaluation only; else None)

    @property
    def S(self) -> int:
        return len(self.sources)

    @property
    def R(self) -> int:
        return len(self.rows)

    @property
    def B(self) -> int:
        return self.num_beams

    @property
    def N(self) -> int:
        return self.S * self.R * self.B

    @property
    def G(self) -> int:
        return self.shared + len(self.net)

    def batch_rows(self, members: list[int]) -> list[int]:
        """The batch rows of rows ``members``: every source, every beam."""
        return [(s * self.R + i) * self.B + j for s in range(self.S) for i in members for j in range(self.B)]

    def source_of(self, b: int) -> int:
        return b // (self.R * self.B)

    def row_of(self, b: int) -> int:
        return (b // self.B) % self.R

    def prefill_row(self, b: int) -> int:
        """The prefill row whose KV cache batch row ``b`` starts from."""
        return self.source_of(b) * self.G + self.group_of_row[self.row_of(b)]


def _comparison_of(rows: list[Row], given: dict | None) -> tuple[dict, list[dict]]:
    """The batch's comparison settings (``given``, else those in the rows' settings, which must agree: they apply
    to every row alike) and each row's own settings without them."""
    found: dict = dict(given or {})
    own = []
    for r in rows:
        comp, rest = split_comparison(r.settings)
        for k, v in comparison_settings(comp).items() if comp else ():
            if k in found and found[k] != v and not (given and k in given):
                raise UserError(f"The setting {k!r} applies to every row of a comparison alike; rows ask for "
                                f"{found[k]!r} and {v!r}.")
            found.setdefault(k, v)
        own.append(rest)
    return comparison_settings(found), own


def plan_batch(backbone: Backbone, sources: list[str], rows: list[Row], prompt: Prompt | None = None,
               num_beams: int = 1, contexts: list[list[int]] | None = None,
               comparison: dict | None = None, ref_lens: list[int] | None = None) -> Batch:
    """Check a request and lay out its batch: every row's complete settings, in-network groups by (plug-in,
    settings), output-level groups by plug-in; the comparison settings (``comparison``, or found in the rows'
    settings) that every row decodes with."""
    if not rows:
        raise UserError("Choose at least one method to compare.")
    if not sources or any(not s or not s.strip() for s in sources):
        raise UserError("Type a sentence to translate or rewrite.")
    if num_beams < 1:
        raise UserError("The number of beams must be ≥ 1.")
    if ref_lens is not None and (len(ref_lens) != len(sources) or any(int(n) < 0 for n in ref_lens)):
        raise UserError("Reference lengths: one non-negative token count per source.")
    for r in rows:
        if r.plugin is not None and r.plugin.fingerprint != backbone.fingerprint:
            backbone.check_fingerprint(r.plugin.fingerprint, f"The plug-in of row {r.label!r}")
    prompt = prompt or Prompt(chat=backbone.chat)
    ctxs = contexts or [backbone.encode_context(prompt.render(s)) for s in sources]
    src_lens = [len(backbone.encode_target(s.strip())) for s in sources]
    comp, own = _comparison_of(rows, comparison)
    settings = [r.plugin.settings(o) if r.plugin is not None else {} for r, o in zip(rows, own)]
    for r in rows:
        if r.plugin is not None:
            r.plugin.prepare_decode()
    net: dict[tuple, NetGroup] = {}
    out: dict[int, tuple[Plugin, list[int]]] = {}
    for i, r in enumerate(rows):
        if r.plugin is None:
            continue
        if r.plugin.level == "network":
            k = _key(settings[i])
            if (id(r.plugin), k) not in net:
                net[(id(r.plugin), k)] = NetGroup(r.plugin, k, settings[i], [])
            net[(id(r.plugin), k)].members.append(i)
        if r.plugin.level == "output" or r.plugin.mixes_output:
            out.setdefault(id(r.plugin), (r.plugin, []))[1].append(i)
    shared = int(any(r.plugin is None or r.plugin.level != "network" for r in rows))
    batch = Batch(list(sources), list(rows), prompt, ctxs, src_lens, settings, num_beams, list(net.values()), [],
                  shared, [0] * len(rows), comp, None if ref_lens is None else [int(n) for n in ref_lens])
    dev = backbone.device
    for g, grp in enumerate(batch.net, start=shared):
        grp.prefill = g
        grp.rows = torch.tensor(batch.batch_rows(grp.members), device=dev)
        for i in grp.members:
            batch.group_of_row[i] = g
    for plugin, members in out.values():
        rr = batch.batch_rows(members)
        batch.out.append(OutGroup(plugin, torch.tensor(rr, device=dev), [settings[batch.row_of(b)] for b in rr],
                                  [src_lens[batch.source_of(b)] for b in rr],
                                  None if batch.ref_lens is None else [batch.ref_lens[batch.source_of(b)] for b in rr]))
    return batch


# --- prefill -------------------------------------------------------------------------------------------------------
def prefill(backbone: Backbone, batch: Batch, use_prefix_cache: bool = True, trace: bool = True,
            expand: bool = True):
    """Encode the prompts and start every batch row's KV cache.

    One prefill row per (source, prefill group), each in-network group's hooks attached to its prefill rows; a
    single source reuses the cached KV of the prompt's shared prefix (``PREFIX_KV``). Each prefill row's cache is
    then repeated over its rows and beams (``expand``; else it stays one row per prefill row, batch row ``b``
    starting from row ``batch.prefill_row(b)``: ``BatchDecode``'s compact layout). Returns (f(c) at the last
    position per batch row — or per prefill row —, the KV cache, the attention mask per batch row — or prefill
    row —, and per in-network group the handles of its prefill attachment — removed; their trace stands for the
    first step's).
    """
    S, G, dev = batch.S, batch.G, backbone.device
    ids, mask = _left_padded(batch.contexts, G, backbone.tokenizer.pad_token_id or 0)
    ids, mask = ids.to(dev), mask.to(dev)
    attached: list[list] = []
    frozen: list[list] = []  # the attachments of plug-ins that leave the prompt's shared prefix to the frozen backbone
    own = None
    try:
        for grp in batch.net:
            attached.append(grp.plugin.attach(torch.tensor([s * G + grp.prefill for s in range(S)], device=dev),
                                              grp.settings, trace=trace))
            if getattr(grp.plugin, "frozen_prefix", False):
                frozen.append(attached[-1])
        if frozen:  # per prefill row, the first position of the source's own tokens (after left padding)
            width = ids.shape[1]
            own = torch.tensor([width - len(c) + shared_prompt_len(backbone, batch.prompt, c)
                                for c in batch.contexts for _ in range(G)], device=dev)
            for handles in frozen:
                set_own_from(handles, own)
        with torch.no_grad():
            P, past = _cached_prefix(backbone, batch, ids) if S == 1 and use_prefix_cache else (0, None)
            for handles in frozen:  # positions counted from the first token of the forward pass below
                set_own_from(handles, (own - P).clamp_min(0))
            fc, out = backbone.forward_fc(ids[:, P:], attention_mask=mask if S > 1 else None, past_key_values=past,
                                          use_cache=True)
    finally:
        for handles in attached:
            for h in handles:
                h.remove()
    cache = out.past_key_values
    if not expand:
        grow_kv_cache(cache, backbone.model)
        return fc[:, -1], cache, mask, attached
    src_rows = torch.tensor([batch.prefill_row(b) for b in range(batch.N)], device=dev)
    cache.batch_select_indices(src_rows)
    grow_kv_cache(cache, backbone.model)
    return fc[src_rows, -1], cache, mask[src_rows], attached


def _left_padded(contexts: list[list[int]], G: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``G`` left-padded copies of every context (row ``s·G + g``) and their attention mask."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts) * G, width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts) * G, width), dtype=torch.long)
    for s, c in enumerate(contexts):
        for g in range(G):
            ids[s * G + g, width - len(c):] = torch.tensor(c)
            mask[s * G + g, width - len(c):] = 1
    return ids, mask


def _cached_prefix(backbone: Backbone, batch: Batch, ids: torch.Tensor):
    """``(P, KV cache of ids[:, :P])`` for a single source: from ``PREFIX_KV``, or computed (with the hooks that
    are attached) and stored; ``(0, None)`` when the prompt's shared prefix is too short."""
    groups = [(None, None)] * batch.shared + [(grp.plugin, grp.key) for grp in batch.net]
    ctx = batch.contexts[0]
    P, past = PREFIX_KV.get(backbone, groups, ctx)
    if past is None:
        P = PREFIX_KV.shared_len(backbone, batch.prompt, batch.sources[0], ctx)
        if P:
            past = backbone.forward_fc(ids[:, :P], use_cache=True)[1].past_key_values
            PREFIX_KV.put(backbone, groups, ctx[:P], past)
    return P, past


# --- one step: LM head, mixing, trace ------------------------------------------------------------------------------
@dataclass
class StepOutput:
    lm_logprobs: torch.Tensor  # (N, V) log P_LM, on the backbone's device; with ``phys``: (P, V), one per f(c) row
    final: torch.Tensor        # (N, V) the final log-probabilities after every plug-in's mix, on the CPU
    info: list[dict]           # per batch row: trace items (λ_t, the plug-in's top tokens, extras, memory attention)
    plugin: dict = field(default_factory=dict)  # with ``keep_plugin``: batch row → log P_plug-in (V,) of its mix
    phys: torch.Tensor | None = None  # batch row → row of ``lm_logprobs`` (a compact step: ``decode_step``)

    def lm(self, b: int) -> torch.Tensor:
        """Batch row ``b``'s log P_LM (V,)."""
        return self.lm_logprobs[b if self.phys is None else int(self.phys[b])]


def decode_step(backbone: Backbone, batch: Batch, fc_last: torch.Tensor, step: int,
                attached: list | None = None, keep_plugin: bool = False,
                phys: torch.Tensor | None = None) -> StepOutput:
    """One step's distributions from the last position's f(c) of every batch row: f(c) and the output-level
    plug-ins' extra states go through the frozen norm + LM head in one matrix product, then each output-level
    plug-in mixes its rows. With ``attached`` (per in-network group: (group, step handles, prefill handles[,
    position of each of the group's rows in the step attachment's rows])) the per-row trace items are collected
    too; None: no trace. ``keep_plugin``: also return each interpolating plug-in's own distribution per row
    (``StepOutput.plugin``). ``phys`` (``BatchDecode``'s compact layout): ``fc_last`` holds one row per distinct
    live batch row and batch row ``b`` reads its row ``phys[b]``, so P_LM is computed once per distinct row."""
    kept: dict = {}
    N = batch.N
    P = fc_last.shape[0]

    def rows_of(t: torch.Tensor, rr: torch.Tensor, at=None) -> torch.Tensor:  # batch rows ``rr`` of a per-f(c) tensor
        return (t[rr if at is None else at]) if phys is None else t[phys[rr]]

    with torch.no_grad(), small_work_threads():  # small operators on one thread, the LM head on all
        normed = backbone.final_norm(fc_last)
        extra = [(grp, grp.plugin.extra_states(rows_of(fc_last, grp.rows), grp.settings)) for grp in batch.out]
        # States whose plug-in needs every token's logit share one pass over the LM head's weights with f(c); a
        # plug-in with a restricted vocabulary (PEMA after candidate training) uses only its rows.
        full_vocab = [e is not None and grp.plugin.head_vocab() is None for grp, e in extra]
        states = [normed] + [backbone.final_norm(e.to(backbone.dtype)) for (_, e), f in zip(extra, full_vocab) if f]
        logits = backbone.head_logits(torch.cat(states))
        with vocab_wide_threads(logits[:P]):
            lm_lp = torch.log_softmax(logits[:P], dim=-1)
        with vocab_wide_threads(lm_lp):  # 7 rows: 0.42 ms on one thread, 0.14 on two (one-off probe)
            final = lm_lp.clone() if phys is None else lm_lp[phys]
        info: list[dict] = [{} for _ in range(N)]
        off = P
        for (grp, e), full in zip(extra, full_vocab):
            rr, at = grp.rows, grp.row_index
            ex_logits = None
            if full:
                ex_logits = logits[off:off + len(rr)]
                off += len(rr)
            elif e is not None:
                ex_logits = backbone.head_logits_subset(backbone.final_norm(e.to(backbone.dtype)),
                                                        grp.plugin.head_vocab())
            mo = grp.plugin.mix(MixInput(fc=rows_of(fc_last, rr), lm_logprobs=rows_of(lm_lp, rr, at),
                                         extra_logits=ex_logits, step=step, src_len=grp.src_lens,
                                         settings=grp.settings, ref_len=grp.ref_lens))
            final[at] = mo.logprobs
            if attached is not None:
                _mix_trace(backbone, info, rr.tolist(), mo)
            if keep_plugin and grp.plugin.interpolates and mo.plugin_logprobs is not None:
                kept.update({b: mo.plugin_logprobs[j] for j, b in enumerate(rr.tolist())})
        if attached is not None:
            _network_trace(batch, attached, info)
    return StepOutput(lm_lp, final.cpu(), info, kept, phys)


def _mix_trace(backbone: Backbone, info: list[dict], rows: list[int], mo: MixOutput) -> None:
    for j, b in enumerate(rows):
        info[b]["lambda"] = round(mo.lam[j], 4) if mo.lam else None
        if mo.plugin_logprobs is not None:
            info[b]["top_plugin"] = _top(mo.plugin_logprobs[j], backbone)
        if mo.extras and mo.extras[j]:
            info[b].update(mo.extras[j])


def _network_trace(batch: Batch, attached: list, info: list[dict]) -> None:
    """Each in-network group's trace of the forward pass that made this step's f(c): its step attachment's, or
    before the first step's pass its prefill attachment's (one prefill row per source). An entry's optional fourth
    item maps the group's rows to their positions in the step attachment's rows (a compact layout; None: the same)."""
    for grp, handles, prefill_handles, *where in attached:
        rows = grp.rows.tolist()
        per_row = grp.plugin.network_trace(handles)
        if per_row is None:
            pre = grp.plugin.network_trace(prefill_handles) or {}
            per_row = {j: pre.get(batch.source_of(b)) for j, b in enumerate(rows)}
        elif where and where[0] is not None:
            per_row = {j: per_row.get(at) for j, at in enumerate(where[0]) if at is not None}
        for j, b in enumerate(rows):
            if per_row.get(j) is not None:
                info[b]["memory_attention"] = per_row[j]


def trace_item(backbone: Backbone, out: StepOutput):
    """``item(b, token, logprob)``: the trace entry of a token chosen for batch row ``b`` at this step."""
    def item(b: int, tok: int, logprob: float) -> dict:
        return {"token": tok, "text": backbone.token_str(tok), "logprob": round(logprob, 4),
                "top_lm": _top(out.lm(b).cpu(), backbone), "top_final": _top(out.final[b], backbone),
                **out.info[b]}
    return item


# --- token selection: greedy = beam search with one beam -----------------------------------------------------------
class Beams:
    """Token selection for ``n_rows`` independent rows of ``num_beams`` beams each (batch row ``r·B + j``).

    Scores are summed log-probabilities (no length penalty). A row stops when it has B finished hypotheses, no live
    candidate, or a finished hypothesis scoring at least its best live one — exact, since scores only decrease.
    """

    def __init__(self, n_rows: int, num_beams: int, stop_ids, pad: int = 0):
        self.n_rows, self.B, self.stop_ids, self.pad = n_rows, num_beams, stop_ids, pad
        self.scores = torch.zeros(n_rows, num_beams)
        if num_beams > 1:
            self.scores[:, 1:] = float("-inf")  # all beams start identical: expand from the first only
        self.tokens: list[list[int]] = [[] for _ in range(n_rows * num_beams)]
        self.traces: list[list[dict]] = [[] for _ in range(n_rows * num_beams)]
        self.finished: list[list[tuple[float, list[int], list[dict]]]] = [[] for _ in range(n_rows)]
        self.done = [False] * n_rows

    @property
    def all_done(self) -> bool:
        return all(self.done)

    def select(self, logprobs: torch.Tensor, item=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend every live row by one token: of the row's 2B best continuations (beam score + ``logprobs``,
        (n_rows·B, V) on the CPU) the B best that do not end in a stop token stay live; those that do finish a
        hypothesis. ``item(b, token, logprob)`` makes a candidate's trace entry (None: no trace).

        Returns (the next token per batch row — ``pad`` for finished rows —, the batch row each beam continues)."""
        B, N = self.B, self.n_rows * self.B
        next_tok = torch.full((N,), self.pad, dtype=torch.long)
        src = torch.arange(N)
        new_tokens, new_traces = list(self.tokens), list(self.traces)
        V = logprobs.shape[1]
        # every row's 2B best continuations in one call
        with vocab_wide_threads(logprobs):
            if B == 1:  # greedy: one score per row ranks nothing, so it is added to the two best only (not to
                # every token of the vocabulary first: a vocabulary-wide pass of each row fewer)
                top_vs, top_is = top_k(logprobs.view(self.n_rows, V), 2)
                top_vs = top_vs + self.scores
            else:
                top_vs, top_is = top_k((self.scores.unsqueeze(2) + logprobs.view(self.n_rows, B, V))
                                       .view(self.n_rows, -1), 2 * B)
        for r in range(self.n_rows):
            if self.done[r]:
                continue
            live = []
            for v, ci in zip(top_vs[r].tolist(), top_is[r].tolist()):
                if v == float("-inf"):
                    break
                j, tok = divmod(ci, logprobs.shape[1])
                b = r * B + j
                entry = item(b, tok, v - float(self.scores[r, j])) if item is not None else None
                if tok in self.stop_ids:
                    self.finished[r].append((v, self.tokens[b] + [tok], self.traces[b] + ([entry] if entry else [])))
                else:
                    live.append((v, b, tok, entry))
                if len(live) == B:
                    break
            best_done = max((f[0] for f in self.finished[r]), default=float("-inf"))
            if not live or len(self.finished[r]) >= B or best_done >= live[0][0]:
                self.done[r] = True
                continue
            for j in range(B):
                v, b, tok, entry = live[j] if j < len(live) else (float("-inf"), *live[0][1:])
                tgt = r * B + j
                self.scores[r, j] = v
                src[tgt] = b
                next_tok[tgt] = tok
                new_tokens[tgt] = self.tokens[b] + [tok]
                new_traces[tgt] = self.traces[b] + ([entry] if entry else [])
        self.tokens, self.traces = new_tokens, new_traces
        return next_tok, src

    def best(self, r: int) -> tuple[float, list[int], list[dict]]:
        """Row r's result (score, tokens, trace): its best finished hypothesis, or when it ran out of tokens its best
        live beam."""
        if self.finished[r]:
            return max(self.finished[r], key=lambda f: f[0])
        j = int(self.scores[r].argmax())
        return float(self.scores[r, j]), self.tokens[r * self.B + j], self.traces[r * self.B + j]


# --- the next forward pass, results --------------------------------------------------------------------------------
def forward_step(backbone: Backbone, cache, mask: torch.Tensor, next_tok: torch.Tensor,
                 src: torch.Tensor | None = None, padded: bool = False):
    """Run the backbone on one new token per batch row (hooks attached act as they are); ``src``: reorder the KV
    cache first (beam search: the batch row each beam continues). ``padded``: left-padded rows need the mask.
    Returns (f(c) per batch row, the cache, the mask)."""
    dev = backbone.device
    if src is not None:
        with torch.no_grad(), small_work_threads():
            relayout_kv_rows(cache, src.tolist(), row_capacity=len(src))
        mask = mask[src.to(dev)]
    mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=dev)], dim=1)
    with torch.no_grad():
        fc, out = backbone.forward_fc(next_tok.unsqueeze(1).to(dev), past_key_values=cache, use_cache=True,
                                      attention_mask=mask if padded else None)
    return fc[:, -1], out.past_key_values, mask


def _comparisons(backbone: Backbone, batch: Batch, beams: Beams, steps: int, seconds: float) -> list[Comparison]:
    comparisons = []
    for s_i, source in enumerate(batch.sources):
        results = []
        for r_i, row in enumerate(batch.rows):
            score, toks, tr = beams.best(s_i * batch.R + r_i)
            results.append(_row_result(backbone, row, toks, tr, {**batch.settings[r_i], **batch.comparison}, score))
        comparisons.append(Comparison(source=source, context_ids=batch.contexts[s_i], src_len=batch.src_lens[s_i],
                                      rows=results, seconds=seconds, steps=steps, num_beams=batch.B,
                                      backbone=backbone.name))
    return comparisons


def _row_result(backbone: Backbone, row: Row, toks: list[int], trace: list[dict], settings: dict,
                score: float) -> RowResult:
    raw = backbone.decode(toks).rstrip("\n")  # a stop token may carry text before its line break
    return RowResult(label=row.label, method=row.method, text=postprocess(raw), raw_text=raw, tokens=list(toks),
                     token_texts=[backbone.token_str(t) for t in toks], trace=list(trace), settings=settings,
                     score=round(float(score), 4))


# --- slider moves: re-decode only what changed ---------------------------------------------------------------------
TRACE_OWN = ("token", "text", "logprob", "top_lm", "top_final", "lambda")  # a trace entry's keys besides the plug-in's


class LiveComparison:
    """A finished greedy comparison of one source, kept so that a move of the rows' settings (the Compare tab's
    live controls: λ_max, GU, k, T, λ — any declared setting; no per-method code) re-decodes only what changes.

    Kept (``BatchDecode(keep=True)``): each row's tokens, trace and score, its ``StepRecords`` and the KV cache. On
    a move, for each row whose settings changed: λ_t (``mix_lambdas``) and the mix are recomputed for the kept
    steps from the records — exact on the kept top tokens; every other token is under the bound that each side's
    K-th value gives, and where that bound does not settle a step's choice (or its trace's top 5) the step's full
    distributions are recomputed from the kept f(c) by the LM head alone (``decode_step`` on that row). A setting
    that changes the plug-in's own distribution (``distribution_key``: kNN's k and T) recomputes it from the kept
    f(c), without the backbone. The first step whose token changes is where that row's re-decode starts
    (``BatchDecode.resume``), from its KV cache cropped to that step; rows, and moves, that change no token need
    no forward pass at all.

    ``move`` returns None — the caller decodes in full — for: beam search or several sources (never kept), another
    source, prompt, max tokens, comparison setting or set of rows, a plug-in changed (retrained) since, a changed
    setting of a row whose plug-in does not interpolate (in-network plug-ins, the memory adapter's "+ kNN"), and a
    KV cache that cannot be cropped (a sliding-window layer already past its window)."""

    def __init__(self, dec: BatchDecode):
        b, bb = dec.batch, dec.backbone
        self.backbone = bb
        self._model = weakref.ref(bb.model)
        self._numerics = (bb.name, str(bb.dtype))
        self.source, self.context, self.src_len = b.sources[0], list(b.contexts[0]), b.src_lens[0]
        self.prompt = b.prompt
        self.rows, self.settings, self.comparison = list(b.rows), list(b.settings), dict(b.comparison)
        self.max_new_tokens, self.trace = dec.max_new_tokens, dec.trace
        self._plugins = [(weakref.ref(r.plugin), PrefixKV._version(r.plugin)) if r.plugin is not None else None
                         for r in b.rows]
        best = [dec.beams.best(r) for r in range(b.R)]
        self.scores = [float(s) for s, _, _ in best]
        self.tokens = [list(t) for _, t, _ in best]
        self.traces = [list(tr) for _, _, tr in best]
        self.records: list[StepRecords | None] = [dec.records.get(r) for r in range(b.R)]
        self.caches = [dec.row_cache(r) for r in range(b.R)]  # (the KV cache holding the row, its row in it)

    def matches(self, backbone: Backbone, batch: Batch, max_new_tokens: int) -> bool:
        """Whether ``batch`` is this comparison with other row settings only."""
        if (self._model() is not backbone.model or self._numerics != (backbone.name, str(backbone.dtype))
                or batch.S != 1 or batch.B != 1 or batch.sources[0] != self.source
                or list(batch.contexts[0]) != self.context or int(max_new_tokens) != self.max_new_tokens
                or batch.comparison != self.comparison or len(batch.rows) != len(self.rows)):
            return False
        for new, old, kept in zip(batch.rows, self.rows, self._plugins):
            if new.label != old.label or (new.plugin is None) != (old.plugin is None):
                return False
            if new.plugin is not None and (kept[0]() is not new.plugin or PrefixKV._version(new.plugin) != kept[1]):
                return False
        return True

    def move(self, backbone: Backbone, batch: Batch, max_new_tokens: int) -> "LiveMove | None":
        """The re-decode of ``batch`` (this comparison with other row settings), or None when it needs a full
        decode (see the class docstring). Runs no forward pass itself."""
        t0 = time.time()
        if not self.matches(backbone, batch, max_new_tokens):
            return None
        changed = [i for i, s in enumerate(batch.settings) if s != self.settings[i]]
        for i in changed:
            p = self.rows[i].plugin
            if p is None or p.level != "output" or not p.interpolates or self.records[i] is None \
                    or len(self.records[i].fc) != len(self.tokens[i]):
                return None
        kept: dict[int, tuple] = {}
        starts: dict[tuple, list[int]] = {}
        for i in changed:
            t, traces, score, rec = self._evaluate(i, batch.settings[i])
            kept[i] = (t, traces, score, rec)
            if t is not None:
                cache, _ = self.caches[i]
                starts.setdefault((t, id(cache)), []).append(i)
        tails = []
        for (t, _), members in starts.items():
            cache, _ = self.caches[members[0]]
            try:
                sub_cache = _rows_cache(cache, [self.caches[i][1] for i in members],
                                        cache.get_seq_length() - (len(self.context) + t))
            except (RuntimeError, ValueError):  # a sliding-window layer past its window cannot go back
                return None
            sub = plan_batch(backbone, [self.source], [batch.rows[i] for i in members], self.prompt, 1,
                             [self.context], self.comparison)
            dec = BatchDecode(backbone, sub, self.max_new_tokens, self.trace, keep=True, t0=t0).resume(
                t, torch.stack([self.records[i].fc[t] for i in members]), sub_cache,
                [self.tokens[i][:t] for i in members], [kept[i][1] for i in members], [kept[i][2] for i in members])
            tails.append((dec, members))
        return LiveMove(self, batch, kept, tails, t0)

    # --- one row's kept steps under new settings ---------------------------------------------------------------
    def _evaluate(self, i: int, settings: dict) -> tuple[int | None, list[dict], float, StepRecords]:
        """Row ``i``'s kept steps under ``settings``: (the first step whose token changes or None, the trace
        entries and float32 score of the steps before it, the records refreshed for them)."""
        plugin, toks, old_traces = self.rows[i].plugin, self.tokens[i], self.traces[i]
        rec = self.records[i].sliced(len(toks))
        infos, exact_all = None, False
        if plugin.distribution_key(settings) != plugin.distribution_key(self.settings[i]):
            infos = self._new_distribution(plugin, rec, settings)
            exact_all = infos is None  # a distribution through the LM head: every step from f(c)
        guard = int(self.comparison.get("no_repeat_ngram", 0))
        score = torch.zeros((), dtype=torch.float32)  # Beams' running score, summed as it sums
        traces: list[dict] = []
        for t, tok in enumerate(toks):
            lam = float(plugin.mix_lambdas(MixInput(fc=rec.fc[t][None], lm_logprobs=rec.lm_val[t][None],
                                                    extra_logits=None, step=t, src_len=[self.src_len],
                                                    settings=[settings]))[0])
            bad = repeated_ngram_ends(toks[:t], guard)
            got = None if exact_all else self._from_records(rec, t, lam, bad, score)
            if got is None:  # the bound does not settle it: this step's full distributions from f(c)
                new_tok, v, top_final, info = self._exact_step(i, rec, t, settings, bad, score)
            else:
                new_tok, v, top_final = got
                info = {"lambda": round(lam, 4)}
                if infos is not None:
                    info.update(infos[t])
            if new_tok != tok:
                return t, traces, float(score), rec.sliced(t)
            if self.trace:
                old = old_traces[t]
                keep = {k: old[k] for k in old if k in TRACE_OWN} if info.keys() - {"lambda"} or got is None \
                    else dict(old)
                traces.append({**keep, "logprob": round(float(v) - float(score), 4), "top_final": top_final,
                               **info})
            score = v
        return None, traces, float(score), rec

    def _from_records(self, rec: StepRecords, t: int, lam: float, bad: set, score: torch.Tensor):
        """(token, its float32 score, the top 5 of the final distribution) of step ``t`` from the records, or None
        when the bound on the tokens not kept does not settle them."""
        V = self.backbone.vocab_size
        lm_idx, plug_idx = rec.lm_idx[t], rec.plug_idx[t]
        fresh = ~torch.isin(plug_idx, lm_idx)  # the plug-in's top tokens not among the LM's
        idx = torch.cat([lm_idx, plug_idx[fresh]])
        lm_v = torch.cat([rec.lm_val[t], rec.lm_at_plug[t][fresh]])
        plug_v = torch.cat([rec.plug_at_lm[t], rec.plug_val[t][fresh]])
        full = len(lm_idx) >= V  # every token is kept: nothing outside
        lm_floor = rec.lm_val[t][-1] if not full else torch.tensor(float("-inf"))
        plug_floor = rec.plug_val[t][-1] if not full else torch.tensor(float("-inf"))
        known = ~torch.isnan(lm_v)
        lam_t = torch.tensor([lam])
        mix = mix_logprobs(torch.where(known, lm_v, lm_floor)[None], plug_v[None], lam_t)[0]  # upper bound if unknown
        if bad:
            mix = torch.where(torch.isin(idx, torch.tensor(sorted(bad))), torch.tensor(float("-inf")), mix)
        outside = mix_logprobs(lm_floor.reshape(1, 1), plug_floor.reshape(1, 1), lam_t)[0, 0]
        ceiling = torch.maximum(outside, mix[~known].max()) if (~known).any() else outside
        cand = score + mix[known]
        best = cand.max()
        if not bool(best > score + ceiling) or int((cand == best).sum()) != 1:
            return None
        ki, kv = idx[known], mix[known]
        top_final = None
        if self.trace:
            n = min(TOP, len(kv))
            v5, o5 = kv.topk(n)
            if n < min(TOP, V) or not bool(v5[-1] > ceiling) or len(set(v5.tolist())) != n:
                return None
            top_final = [[int(tk), self.backbone.token_str(int(tk)), round(float(p), 4)]
                         for tk, p in zip(ki[o5].tolist(), v5.exp().tolist())]
        return int(ki[int(cand.argmax())]), best, top_final

    def _exact_step(self, i: int, rec: StepRecords, t: int, settings: dict, bad: set, score: torch.Tensor):
        """Step ``t`` of row ``i`` recomputed from its f(c) (``decode_step`` on that row: LM head, plug-in, mix);
        refreshes the step's records. Returns (token, float32 score, top 5 of the final distribution, trace info)."""
        row = Row(self.rows[i].label, self.rows[i].plugin, settings)
        one = Batch([self.source], [row], self.prompt, [self.context], [self.src_len], [settings], 1, [],
                    [OutGroup(row.plugin, torch.tensor([0], device=self.backbone.device), [settings],
                              [self.src_len])], 1, [0], dict(self.comparison))
        out = decode_step(self.backbone, one, rec.fc[t][None], t, [] if self.trace else None, keep_plugin=True)
        final = out.final[0]
        if bad:
            final[sorted(bad)] = float("-inf")
        v, k = top_k(score + final, 1)  # as Beams.select with one beam
        fresh = StepRecords()
        fresh.add(rec.fc[t], out.lm_logprobs[0], out.plugin[0], min(KEEP_TOP, final.shape[-1]))
        rec.set_step(t, fresh)
        return int(k[0]), v[0], _top(final, self.backbone) if self.trace else None, out.info[0]

    def _new_distribution(self, plugin: Plugin, rec: StepRecords, settings: dict) -> list[dict] | None:
        """The plug-in's distribution under ``settings`` for every kept step, from the kept f(c) alone (a plug-in
        without extra states through the LM head, e.g. kNN); refreshes the records' plug-in side (P_LM is known at
        its new top tokens only where the records had it). Returns each step's trace info, or None for a plug-in
        whose distribution needs the LM head (each step is then recomputed by ``_exact_step``)."""
        T = len(rec.fc)
        fc = torch.stack(rec.fc)
        if plugin.extra_states(fc[:1], [settings]) is not None:
            return None
        V = self.backbone.vocab_size
        with torch.no_grad():
            plp, extras = plugin.plugin_logprobs(MixInput(
                fc=fc, lm_logprobs=torch.empty(T, V, device=fc.device), extra_logits=None, step=0,
                src_len=[self.src_len] * T, settings=[settings] * T))
        k = min(KEEP_TOP, V)
        infos = []
        for t in range(T):
            p = plp[t]
            pv, pi = top_k(p, k)
            known_i = torch.cat([rec.lm_idx[t], rec.plug_idx[t]])
            known_v = torch.cat([rec.lm_val[t], rec.lm_at_plug[t]])
            hit = pi.cpu()[:, None] == known_i[None, :]
            lm_at = torch.where(hit.any(1), known_v[hit.int().argmax(1)], torch.tensor(float("nan")))
            rec.plug_at_lm[t] = p[rec.lm_idx[t].to(p.device)].float().cpu()
            rec.plug_idx[t], rec.plug_val[t], rec.lm_at_plug[t] = pi.cpu(), pv.float().cpu(), lm_at
            info = {"top_plugin": _top(p, self.backbone)}
            if extras and extras[t]:
                info.update(extras[t])
            infos.append(info)
        return infos


def _cache_view(cache):
    """A copy of a KV cache that shares its tensors: what the cache holds now, kept as it is (a cache only ever
    replaces its tensors — a row selection, a crop, an append of a growing cache into a buffer it owns alone)."""
    shared = {id(t): t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
              if isinstance(t, torch.Tensor)}
    return copy.deepcopy(cache, shared)


def _rows_cache(cache, rows: list[int], remove: int):
    """A KV cache of ``rows`` of ``cache`` without its last ``remove`` positions; ``cache`` is left as it is (its
    tensors are shared until selected, and a cache only ever replaces its tensors)."""
    out = _cache_view(cache)
    dev = next((t.device for layer in out.layers for t in (getattr(layer, "keys", None),)
                if isinstance(t, torch.Tensor)), None)
    out.batch_select_indices(torch.tensor(rows, device=dev))
    if remove < 0:
        raise ValueError("the cache is shorter than the step")
    if remove:
        out.crop(-remove)
    return out  # a growing cache's copy grows too (its layers are copies of the same kind)


class LiveMove:
    """A slider move on a ``LiveComparison``, run like a ``BatchDecode``: ``step()`` one step of every re-decode
    (several rows from the same step share one batch), ``partial()``, ``result()``. When it finishes the
    LiveComparison holds the new state; a move that is stopped half-way leaves it as it was."""

    def __init__(self, live: LiveComparison, batch: Batch, kept: dict, tails: list, t0: float):
        self.live, self.batch, self.kept, self.tails, self.t0 = live, batch, kept, tails, t0
        self.finished = False
        self.seconds = 0.0
        self.reused_steps = sum(len(toks) if kept[i][0] is None else kept[i][0]
                                for i, toks in enumerate(live.tokens) if i in kept) + sum(
            len(toks) for i, toks in enumerate(live.tokens) if i not in kept)
        if not tails:
            self._finish()

    @property
    def forwards(self) -> int:
        return sum(dec.forwards for dec, _ in self.tails)

    def step(self) -> bool:
        if self.finished:
            return False
        more = False
        for dec, _ in self.tails:
            if not dec.finished:
                more = dec.step() or more
        if not more:
            self._finish()
        return more

    def run(self) -> list[Comparison]:
        while self.step():
            pass
        return self.result()

    def _rows(self) -> list[tuple[list[int], list[dict], float]]:
        """(tokens, trace, score) of every row now."""
        live = self.live
        out = [(live.tokens[i], live.traces[i], live.scores[i]) for i in range(len(live.rows))]
        for i, (t, traces, score, _) in self.kept.items():
            if t is None:
                out[i] = (live.tokens[i], traces, score)
        for dec, members in self.tails:
            for j, i in enumerate(members):
                s, toks, tr = dec.beams.best(j)
                out[i] = (toks, tr, s)
        return out

    def _finish(self) -> None:
        live = self.live
        rows = self._rows()
        for i, (t, _traces, _score, rec) in self.kept.items():
            live.records[i] = rec
        for dec, members in self.tails:
            for j, i in enumerate(members):
                live.records[i] = live.records[i].extended(dec.records.get(j) or StepRecords())
                live.caches[i] = dec.row_cache(j)
        live.tokens = [list(r[0]) for r in rows]
        live.traces = [list(r[1]) for r in rows]
        live.scores = [float(r[2]) for r in rows]
        live.rows, live.settings = list(self.batch.rows), list(self.batch.settings)
        self.finished, self.seconds = True, time.time() - self.t0

    def partial(self) -> list[Comparison]:
        return [self._comparison(time.time() - self.t0)]

    def result(self) -> list[Comparison]:
        return [self._comparison(self.seconds if self.finished else time.time() - self.t0)]

    def _comparison(self, seconds: float) -> Comparison:
        live, bb = self.live, self.live.backbone
        rows = self._rows()
        results = [_row_result(bb, row, toks, tr, {**self.batch.settings[i], **self.batch.comparison}, score)
                   for i, (row, (toks, tr, score)) in enumerate(zip(self.batch.rows, rows))]
        return Comparison(source=live.source, context_ids=live.context, src_len=live.src_len, rows=results,
                          seconds=seconds, steps=max(len(r.tokens) for r in results), num_beams=1,
                          backbone=bb.name)


def start_compare(backbone: Backbone, source: str, rows: list[Row], prompt: Prompt | None = None,
                  max_new_tokens: int = 64, num_beams: int = 1, no_repeat_ngram: int | None = None,
                  live: LiveComparison | None = None, trace: bool = True):
    """A comparison of one source to run step by step (``step()`` until it returns False; ``partial()`` and
    ``result()``: one Comparison in a list; ``forwards``: backbone passes run): the re-decode of what changed when
    ``live`` (the previous comparison, kept) is this one with other row settings, else a full decode that keeps what the
    next move needs (greedy, one source)."""
    t0 = time.time()
    batch = plan_batch(backbone, [source], rows, prompt, num_beams, None,
                       {} if no_repeat_ngram is None else {"no_repeat_ngram": no_repeat_ngram})
    if live is not None:
        mv = live.move(backbone, batch, max_new_tokens)
        if mv is not None:
            return mv
    return BatchDecode(backbone, batch, max_new_tokens, trace, keep=True, t0=t0)
