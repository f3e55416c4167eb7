"""Slider moves: a finished greedy comparison kept (``LiveComparison``) so that a move of the rows' settings
re-decodes only what changes (``LiveMove``), exactly as a full re-decode would."""
from __future__ import annotations

import copy
import dataclasses
import time
import weakref
from dataclasses import dataclass, field

import torch

from backbone.model import Backbone
from engine.batch import Batch, OutGroup, plan_batch
from engine.beams import repeated_ngram_ends
from engine.prefix_cache import PrefixKV
from engine.protocol import MixInput, OutputMethod, mix_logprobs
from engine.results import Comparison, Row, row_result
from engine.step import decode_step
from engine.stepping import DecodeRun
from engine.topk import TOP, top_k, top_tokens
from ground.settings import SettingsRecord

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

    def __init__(self, dec):
        """``dec``: a finished kept ``BatchDecode``, whose class also runs the re-decodes of the moves."""
        b, bb = dec.batch, dec.backbone
        self.backbone = bb
        self._engine = type(dec)
        self._model = weakref.ref(bb.model)
        self._numerics = (bb.name, str(bb.dtype))
        self.source, self.context, self.src_len = b.sources[0], list(b.contexts[0]), b.src_lens[0]
        self.prompt = b.prompt
        self.rows, self.settings, self.comparison = list(b.rows), list(b.settings), dict(b.comparison)
        self.max_new_tokens, self.trace, self.compact = dec.max_new_tokens, dec.trace, dec.compact
        self._plugins = [(weakref.ref(r.plugin), PrefixKV.plugin_version(r.plugin)) if r.plugin is not None
                         else None for r in b.rows]
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
            if new.plugin is not None and (kept[0]() is not new.plugin
                                           or PrefixKV.plugin_version(new.plugin) != kept[1]):
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
            dec = self._engine(backbone, sub, self.max_new_tokens, self.trace, keep=True, t0=t0,
                               compact=self.compact).resume(
                t, torch.stack([self.records[i].fc[t] for i in members]), sub_cache,
                [self.tokens[i][:t] for i in members], [kept[i][1] for i in members], [kept[i][2] for i in members])
            tails.append((dec, members))
        return LiveMove(self, batch, kept, tails, t0)

    # --- one row's kept steps under new settings ---------------------------------------------------------------
    def _evaluate(self, i: int, settings: SettingsRecord) -> tuple[int | None, list[dict], float, StepRecords]:
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

    def _exact_step(self, i: int, rec: StepRecords, t: int, settings: SettingsRecord, bad: set, score: torch.Tensor):
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
        return int(k[0]), v[0].cpu(), top_tokens(final, self.backbone) if self.trace else None, out.info[0]

    def _new_distribution(self, plugin: OutputMethod, rec: StepRecords, settings: SettingsRecord) -> list[dict] | None:
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
            info = {"top_plugin": top_tokens(p, self.backbone)}
            if extras and extras[t]:
                info.update(extras[t])
            infos.append(info)
        return infos


def cache_view(cache):
    """A copy of a KV cache that shares its tensors: what the cache holds now, kept as it is (a cache only ever
    replaces its tensors — a row selection, a crop, an append of a growing cache into a buffer it owns alone)."""
    shared = {id(t): t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
              if isinstance(t, torch.Tensor)}
    return copy.deepcopy(cache, shared)


def _rows_cache(cache, rows: list[int], remove: int):
    """A KV cache of ``rows`` of ``cache`` without its last ``remove`` positions; ``cache`` is left as it is (its
    tensors are shared until selected, and a cache only ever replaces its tensors)."""
    out = cache_view(cache)
    dev = next((t.device for layer in out.layers for t in (getattr(layer, "keys", None),)
                if isinstance(t, torch.Tensor)), None)
    out.batch_select_indices(torch.tensor(rows, device=dev))
    if remove < 0:
        raise ValueError("the cache is shorter than the step")
    if remove:
        out.crop(-remove)
    return out  # a growing cache's copy grows too (its layers are copies of the same kind)


class LiveMove(DecodeRun):
    """A slider move on a ``LiveComparison``, run like a ``BatchDecode`` (``DecodeRun``): ``step()`` one step of every
    re-decode — each a ``BatchDecode`` resumed at its first changed step, several rows from the same step sharing
    one batch —, ``partial()``, ``result()``. When it finishes the LiveComparison holds the new state; a move that
    is stopped half-way leaves it as it was."""

    def __init__(self, live: LiveComparison, batch: Batch, kept: dict, tails: list, t0: float):
        self._live, self.batch, self.kept, self.tails, self.t0 = live, batch, kept, tails, t0
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

    def _rows(self) -> list[tuple[list[int], list[dict], float]]:
        """(tokens, trace, score) of every row now."""
        live = self._live
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
        live = self._live
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

    def live(self) -> LiveComparison | None:
        """The kept decode with this move's new state once the move finished (None before), as
        ``BatchDecode.live()``: what the next move starts from."""
        return self._live if self.finished else None

    def partial(self) -> list[Comparison]:
        return [self._comparison(time.time() - self.t0)]

    def result(self) -> list[Comparison]:
        return [self._comparison(self.seconds if self.finished else time.time() - self.t0)]

    def _comparison(self, seconds: float) -> Comparison:
        live, bb = self._live, self._live.backbone
        rows = self._rows()
        results = [row_result(bb, row, toks, tr, {**self.batch.settings[i].as_dict(), **self.batch.comparison}, score)
                   for i, (row, (toks, tr, score)) in enumerate(zip(self.batch.rows, rows))]
        return Comparison(source=live.source, context_ids=live.context, src_len=live.src_len, rows=results,
                          seconds=seconds, steps=max(len(r.tokens) for r in results), num_beams=1,
                          backbone=bb.name)
