"""The decode loop, one for every decode: ``BatchDecode.step`` (distributions, repetition guard, slider records, token
selection, the next forward pass). ``BatchDecode`` runs it around the backbone's forward pass in this process (one
step at a time: streaming, cancelling, the compact layout, a kept decode for slider moves), behind ``compare`` /
``decode_batch`` / ``start_compare``; ``ForwardDecode`` around a forward pass given as a function (a remote
backbone's: ``offsite.decode``), behind ``decode_loop``; a slider move (``LiveMove``) runs each of its re-decodes
as a ``BatchDecode``."""
from __future__ import annotations

import logging
import time
import weakref
from typing import Callable

import torch

from backbone.graph_decode import RUNNERS, graph_mode
from backbone.model import Backbone, relayout_kv_rows, small_work_threads
from backbone.prompts import Prompt
from engine.batch import Batch, NetGroup, plan_batch
from engine.beams import Beams, ban_repeated_ngrams
from engine.fixed_rows import FixedRowHooks, fixed_rows_refusal, hooks_key
from engine.forward import forward_step, prefill
from engine.live import KEEP_TOP, LiveComparison, StepRecords, cache_view
from engine.results import Comparison, Row, row_result
from engine.step import GroupAttachments, StepOutput, decode_step, mix_step, trace_item
from engine.stepping import DecodeRun

log = logging.getLogger(__name__)


def comparisons(backbone: Backbone, batch: Batch, beams: Beams, steps: int, seconds: float) -> list[Comparison]:
    """One Comparison per source of a decode whose token selection is ``beams``: each row's best hypothesis."""
    out = []
    own = {i: grp for grp in batch.prompts for i in grp.members}
    for s_i, source in enumerate(batch.sources):
        results = []
        for r_i, row in enumerate(batch.rows):
            score, toks, tr = beams.best(s_i * batch.R + r_i)
            settings = {**batch.settings[r_i].as_dict(), **batch.comparison}
            results.append(row_result(backbone, row, toks, tr, settings, score,
                                      own[r_i].prompts[s_i].to_dict() if r_i in own else None))
        out.append(Comparison(source=source, context_ids=batch.contexts[s_i], src_len=batch.src_lens[s_i],
                              rows=results, seconds=seconds, steps=steps, num_beams=batch.B, backbone=backbone.name))
    return out


def compare(backbone: Backbone, source: str, rows: list[Row], prompt: Prompt | None = None,
            max_new_tokens: int = 64, num_beams: int = 1, trace: bool = True,
            context_ids: list[int] | None = None, use_prefix_cache: bool = True,
            no_repeat_ngram: int | None = None, compact: bool = True) -> Comparison:
    """Decode ``source`` with every row at once and return each row's text, tokens and per-token trace."""
    return decode_batch(backbone, [source], rows, prompt, max_new_tokens, num_beams, trace,
                        [context_ids] if context_ids else None, use_prefix_cache, no_repeat_ngram, compact=compact)[0]


def warm_comparison(backbone: Backbone, force: bool = False) -> dict:
    """On a GPU, one short comparison of the base row with traces, as a start-up step after the backbone's own
    warm-up (``backbone.graph_decode.warm_up``): the tokenizer, the prefill, the graph runner's step, the token
    selection and the traces each run once, so their first-call work is not in the user's first comparison
    (docs/gpu.md). Its prompt has no examples, so no memory's prompt prefix is cached by it. Nothing on a CPU, where
    there is no first-call work to speak of (``force``: run anyway; the tests do). Returns what it did."""
    if backbone.device.type != "cuda" and not force:
        return {}
    t = time.perf_counter()
    compare(backbone, "Good morning.", [Row("base")], Prompt.for_task("translation", chat=backbone.chat),
            max_new_tokens=4, trace=True)
    if backbone.device.type == "cuda":
        torch.cuda.synchronize()
    return {"seconds": round(time.perf_counter() - t, 3)}


def decode_batch(backbone: Backbone, sources: list[str], rows: list[Row], prompt: Prompt | None = None,
                 max_new_tokens: int = 64, num_beams: int = 1, trace: bool = True,
                 contexts: list[list[int]] | None = None, use_prefix_cache: bool = True,
                 no_repeat_ngram: int | None = None, ref_lens: list[int] | None = None,
                 compact: bool = True) -> list[Comparison]:
    """Decode several sources × every row in one batch (left-padded prompts); one Comparison per source.

    Each source reuses the KV cache of the prompt's shared prefix (instruction and few-shot examples) from an
    earlier decode with the same prefill groups (``PREFIX_KV``), so only the source's own tokens are prefilled.

    Batch layout: index ``(s * R + r) * B + j`` for source s, row r, beam j (``Batch``). Each context is prefilled
    in a pass of its own and the left padding is neutral in the steps (``prefill``, ``backbone.padding``): a row
    computes what it computes alone, bit for bit where the linears keep a row's bits in any batch (docs/evaluation.md,
    "Batch-invariant rows").

    Repetition guard (``no_repeat_ngram``, a comparison setting: ``engine.comparison.COMPARISON_SETTINGS``; given
    here or in any row's settings): no row may repeat an n-gram of its own output tokens — every row alike, the
    base model's included. Off (0) by default.

    ``ref_lens``: per source, the token length of its reference — evaluation only, for plug-ins whose schedule
    the public code ties to the reference (PEMA's GU ``gu_variant="code"``, ``MixInput.ref_len``); a decode
    without references leaves it None.

    The loop itself is ``BatchDecode`` (one step at a time: streaming and cancelling between steps); ``compact``
    is its layout (off: one cache row per batch row, for tests and benchmarks to compare with).
    """
    t0 = time.time()
    batch = plan_batch(backbone, sources, rows, prompt, num_beams, contexts,
                       {} if no_repeat_ngram is None else {"no_repeat_ngram": no_repeat_ngram}, ref_lens)
    return BatchDecode(backbone, batch, max_new_tokens, trace, use_prefix_cache, t0=t0, compact=compact).run()


class BatchDecode(DecodeRun):
    """``decode_batch`` one step at a time (``DecodeRun``). ``step()`` runs the next step (the prefill first) and says
    whether the decode goes on; ``partial()`` is every row's output so far (streaming), ``result()`` the comparisons,
    ``run()`` all steps. To cancel, stop calling ``step()``: no hook stays attached between two steps (in-network
    plug-ins attach for each forward pass only, a step putting back the hooks the previous one took off: the same
    functions, rows, settings and products derived from the plug-in's weights, which a decode reads as they were at
    its first step), so the backbone is free for others between steps.

    Compact layout (``compact``, on by default): the forward pass, the KV cache and the LM head's P_LM hold one row per
    *distinct live* batch row, not one per batch row. Rows of one prefill group (the base row, PEMA and kNN: no
    in-network plug-in) compute the very same hidden states while their tokens agree, so they share a row until
    their tokens part; a finished row leaves the forward pass (rows finish at different steps, and the decode runs
    until the last one does). ``phys[b]`` is batch row ``b``'s row; the cache is re-laid out (one row selection)
    only at a step where a row parts or finishes. A row computes what it computes in a batch of any other size —
    bit for bit where the linears pad their products for steady bits (packed bfloat16, float16 weight-only), else to
    the rounding of a product over another row count (float32's BLAS): the same tokens (tested on the tiny model; on
    Gemma, BENCHMARKS.md, "Decode time per token": ``python -m benchmarks rows``' whole comparisons).

    ``keep=True`` (one source, greedy): also record, per row and step, what a slider move needs
    (``StepRecords``), and keep each row's KV cache (``row_cache``) — ``live()`` is then the comparison's
    ``LiveComparison``. ``resume()`` starts from a kept state (a slider move's re-decode of the rows that
    change)."""

    def __init__(self, backbone: Backbone, batch: Batch, max_new_tokens: int = 64, trace: bool = True,
                 use_prefix_cache: bool = True, keep: bool = False, t0: float | None = None, compact: bool = True):
        self.t0 = time.time() if t0 is None else t0
        self.backbone, self.batch = backbone, batch
        self.max_new_tokens, self.trace, self.use_prefix_cache = int(max_new_tokens), trace, use_prefix_cache
        self.guard = int(batch.comparison.get("no_repeat_ngram", 0))
        # a kept decode's re-decodes assume unpadded rows: a row prompted otherwise (a longer context) pads
        self.keep = keep and batch.S == 1 and batch.B == 1 and not batch.padded
        self.compact = compact
        self.beams = Beams(batch.S * batch.R, batch.B, backbone.stop_ids, backbone.tokenizer.pad_token_id or 0)
        self.step_no = 0  # the next step's index
        self.fc_last = self.cache = self.mask = None  # per cache row (a batch row's: ``phys``)
        self.phys: torch.Tensor | None = None  # compact layout: batch row → its cache row (else a batch row is one)
        self.phys_list: list[int] = []  # the same as a list (no device round trip per use)
        self.finished_caches: dict[int, tuple] = {}  # keep: batch row → (cache, row) as it was when it finished
        self.prefill_handles: list[list] = [[] for _ in batch.net]
        self.net_handles: list[list] = [[] for _ in batch.net]  # per in-network group: its latest forward's
        # per in-network group: (the rows its step hooks act on, the position there of each of its batch rows)
        self.net_rows: list[tuple] = [(None, None) for _ in batch.net]
        self.member_rows: dict[int, list[int]] = {}  # per in-network group: its batch rows, read once
        self.forwards = 0  # backbone forward passes run (the prefill counts as one)
        self.finished = False
        self.seconds = 0.0
        self.records: dict[int, StepRecords] = {}
        self.runner = None  # a static-cache step (``backbone.graph_decode``) instead of the eager forward pass
        self._runner_back = None
        # which step ran the decode's forward passes after the prefill: "graph" (a CUDA graph's replay), "static"
        # (the static cache without a graph) or "eager", and for "eager" why
        self.path, self.path_reason = "eager", "not started"

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
        if self.runner is not None:
            return self.runner.export([self.phys_list[b]]), 0
        return self.cache, b if self.phys is None else self.phys_list[b]

    def step(self) -> bool:
        """The decode loop's one step, for every decode: the prefill before the first; this step's distributions
        (``_step_output``); the repetition guard; a kept decode's records; the token selection; then, unless every
        row finished or the token budget is spent, the next forward pass (``_forward``)."""
        if self.finished:
            return False
        bb = self.backbone
        if self.fc_last is None:
            self._prefill()
        step = self.step_no
        out = self._step_output(step)
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
        if self.beams.all_done or self.step_no >= self.max_new_tokens:  # no pass for a token nobody will select
            self.finished, self.seconds = True, time.time() - self.t0
            self._give_back_runner()
            return False
        self._forward(next_tok, src)
        self.forwards += 1
        return True

    def _prefill(self) -> None:
        """The prompts' forward pass: every batch row's f(c) and KV cache (the compact layout: per prefill row)."""
        batch = self.batch
        self.fc_last, self.cache, self.mask, self.prefill_handles = prefill(
            self.backbone, batch, self.use_prefix_cache, self.trace, expand=not self.compact)
        if self.compact:
            self._set_layout([batch.prefill_row(b) for b in range(batch.N)])
            self._take_runner()
        self.forwards += 1

    def _step_output(self, step: int) -> StepOutput:
        """This step's distributions from the last forward pass's f(c), with the in-network groups' traces."""
        attached = [GroupAttachments(grp, self.net_handles[g], self.prefill_handles[g], self.net_rows[g][1])
                    for g, grp in enumerate(self.batch.net)] if self.trace else None
        return decode_step(self.backbone, self.batch, self.fc_last, step, attached, keep_plugin=self.keep,
                           phys=self.phys)

    def _forward(self, next_tok: torch.Tensor, src: torch.Tensor | None) -> None:
        """The next forward pass over one new token per batch row (``src``: the batch row each beam continues), each
        in-network group's hooks on its rows for this pass only (the previous pass's put back)."""
        bb, batch = self.backbone, self.batch
        if self.phys is not None:
            with torch.no_grad(), small_work_threads():  # row copies: parallel regions that would wake a thread
                next_tok = self._relayout(next_tok, src)
            src = None
        if self.runner is not None:  # in-network groups: their row masks, in place (``fixed_rows``)
            for g, grp in enumerate(batch.net):
                self._runner_group_rows(g, grp)
            self.fc_last = self.runner.step(next_tok)
            return
        on: list[tuple] = []  # (plug-in, handles) attached for this pass
        try:
            for g, grp in enumerate(batch.net):  # hooks on for this forward pass only: the last step's put back
                rows, where, key = self._group_rows(g, grp)
                if rows is None:
                    continue
                kept = self.net_handles[g]
                if not (kept and self.net_rows[g][0] == key and grp.plugin.resume(kept)):
                    for h in kept:
                        h.remove()
                    self.net_handles[g] = grp.plugin.attach(rows, grp.settings, trace=self.trace)
                self.net_rows[g] = (key, where)
                on.append((grp.plugin, self.net_handles[g]))
            self.fc_last, self.cache, self.mask = forward_step(bb, self.cache, self.mask, next_tok,
                                                               src if batch.B > 1 else None, padded=batch.padded)
        finally:
            for plugin, handles in on:
                plugin.suspend(handles)

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
            if gone and self.runner is not None:  # the runner's buffers are reused: copy the rows out
                snapshot = self.runner.export([old[b] for b in gone])
                self.finished_caches.update({b: (snapshot, i) for i, b in enumerate(gone)})
            elif gone:
                snapshot = cache_view(self.cache)
                self.finished_caches.update({b: (snapshot, old[b]) for b in gone})
        gather = [r for r, _ in order]
        if self.runner is not None:
            if gather != list(range(self.runner.rows)):
                self.runner.relayout(gather)
        elif gather != list(range(self.mask.shape[0])):
            relayout_kv_rows(self.cache, gather, row_capacity=len(live))
            self.mask = self.mask[torch.tensor(gather, device=dev)]
        self._set_layout(phys)
        return torch.tensor([tok for _, tok in order], dtype=torch.long)

    def _take_runner(self) -> None:
        """After the prefill: the static-cache step for a decode it can serve (greedy, compact, short enough:
        ``backbone.graph_decode``; in-network groups' hooks on fixed row masks, ``engine.fixed_rows``),
        loaded with the prefill's cache. Else the eager step, and why (``path_reason``, logged)."""
        bb, batch = self.backbone, self.batch
        mode = graph_mode(bb.device)
        why = None
        if mode is None:
            why = "no static step on this device (graph_decode: auto is a GPU option)"
        elif batch.B != 1:
            why = "beam search"
        elif batch.net:
            why = fixed_rows_refusal(batch)
        if why is None:
            key = make = None
            if batch.net:
                key = hooks_key(batch, self.trace)
                make = lambda rows: FixedRowHooks(batch.net, rows, bb.device, self.trace)  # noqa: E731
            runner, why = RUNNERS.take_or_why(bb.decoder, bb.final_norm, batch.N,
                                              self.mask.shape[1] + self.max_new_tokens, graph=mode == "graph",
                                              hooks_key=key, make_hooks=make)
        if why:
            self.path, self.path_reason = "eager", why
            if mode is not None:
                log.info("decode on the eager path: %s", why)
            return
        runner.start(self.cache, self.mask)
        self.runner, self.cache = runner, None
        self.path, self.path_reason = ("graph" if runner.graph is not None else "static"), ""
        self._runner_back = weakref.finalize(self, RUNNERS.give_back, runner)  # a decode dropped half-way

    def _runner_group_rows(self, g: int, grp: NetGroup) -> None:
        """In-network group ``g``'s live rows as its row mask in the runner (written only when they changed), and
        each of its batch rows' runner row for the trace (the hooks compute every runner row)."""
        members = self.member_rows.get(g)
        if members is None:
            members = self.member_rows[g] = grp.rows.tolist()
        B = self.batch.B
        where = [self.phys_list[b] if not self.beams.done[b // B] else None for b in members]
        hooks = self.runner.hooks
        hooks.set_rows(g, sorted({p for p in where if p is not None}))
        self.net_handles[g] = hooks.handles(g)
        self.net_rows[g] = (None, where)

    def _give_back_runner(self) -> None:
        """A finished decode's runner goes back to the pool; a kept decode first copies its rows' caches out."""
        if self.runner is None:
            return
        if self.keep:
            rows = [b for b in range(self.batch.N) if b not in self.finished_caches]
            if rows:
                snapshot = self.runner.export([self.phys_list[b] for b in rows])
                self.finished_caches.update({b: (snapshot, i) for i, b in enumerate(rows)})
        self._runner_back()  # gives the runner back, once
        self.runner = None

    def _set_layout(self, phys: list[int]) -> None:
        self.phys_list = phys
        self.phys = torch.tensor(phys, device=self.backbone.device)

    def _group_rows(self, g: int, grp: NetGroup) -> tuple:
        """(the rows in-network group ``g``'s hooks act on in the next forward pass — None: none live —, for a
        compact layout the position there of each of the group's batch rows, the rows as a list). The group's rows
        are read from the host's copy: no device-to-host copy per step."""
        members = self.member_rows.get(g)
        if members is None:
            members = self.member_rows[g] = grp.rows.tolist()
        if self.phys is None:
            return grp.rows, None, members
        B = self.batch.B
        live = [b for b in members if not self.beams.done[b // B]]
        if not live:
            return None, None, None
        rows = sorted({self.phys_list[b] for b in live})
        at = {p: j for j, p in enumerate(rows)}
        return (torch.tensor(rows, device=self.backbone.device),
                [at[self.phys_list[b]] if not self.beams.done[b // B] else None for b in members], rows)

    def partial(self) -> list[Comparison]:
        return comparisons(self.backbone, self.batch, self.beams, self.step_no, time.time() - self.t0)

    def result(self) -> list[Comparison]:
        return comparisons(self.backbone, self.batch, self.beams, self.step_no,
                            self.seconds if self.finished else time.time() - self.t0)

    def live(self) -> "LiveComparison | None":
        """The finished kept decode as a ``LiveComparison`` (None without ``keep``)."""
        return LiveComparison(self) if self.keep and self.finished else None


Forward = Callable[[tuple, torch.Tensor, torch.Tensor, Beams], tuple]


class ForwardDecode(BatchDecode):
    """The decode loop (``BatchDecode.step``) around a forward pass given as a function (a remote backbone's:
    ``offsite.decode``), for a planned batch with one cache row per batch row and no in-network plug-in: ``first``
    is (f(c) per batch row, log P_LM per batch row or None) after the prompt, and ``forward(last, next_tok, src,
    beams)`` returns the same after one more token per batch row (``src``: the batch row each beam continues;
    ``beams.done``: the rows that finished). Where log P_LM is None it is computed here from f(c) (``decode_step``),
    else the plug-ins mix into it (``mix_step``)."""

    def __init__(self, backbone: Backbone, batch: Batch, first: tuple, forward: Forward, max_new_tokens: int = 64,
                 trace: bool = True, t0: float | None = None):
        super().__init__(backbone, batch, max_new_tokens, trace, use_prefix_cache=False, t0=t0, compact=False)
        self.fc_last, self.lm_logprobs = first
        self.forward = forward
        if self.max_new_tokens <= 0:  # not a single step
            self.finished = True

    def _prefill(self) -> None:  # the prompt's pass ran where the forward pass runs: ``first``
        raise AssertionError("ForwardDecode starts from the f(c) it is given")

    def _step_output(self, step: int) -> StepOutput:
        if self.lm_logprobs is None:
            return decode_step(self.backbone, self.batch, self.fc_last, step, [] if self.trace else None)
        return mix_step(self.backbone, self.batch, self.fc_last, self.lm_logprobs, step, self.trace)

    def _forward(self, next_tok: torch.Tensor, src: torch.Tensor | None) -> None:
        self.fc_last, self.lm_logprobs = self.forward((self.fc_last, self.lm_logprobs), next_tok, src, self.beams)


def decode_loop(backbone: Backbone, batch: Batch, first: tuple, forward: Forward, max_new_tokens: int = 64,
                trace: bool = True, t0: float | None = None) -> list[Comparison]:
    """Decode a planned ``batch`` (one row per batch row, no in-network plug-in) with the forward pass given
    (``ForwardDecode``: ``first`` and ``forward`` as there); the repetition guard, the token selection and the
    results are the local decode's, in the same loop."""
    return ForwardDecode(backbone, batch, first, forward, max_new_tokens, trace, t0).run()


def start_compare(backbone: Backbone, source: str, rows: list[Row], prompt: Prompt | None = None,
                  max_new_tokens: int = 64, num_beams: int = 1, no_repeat_ngram: int | None = None,
                  live: LiveComparison | None = None, trace: bool = True, compact: bool = True):
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
    return BatchDecode(backbone, batch, max_new_tokens, trace, keep=True, t0=t0, compact=compact)
