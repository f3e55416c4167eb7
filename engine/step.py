"""One decode step's distributions: the LM head over f(c) (and the output-level plug-ins' extra states) in one
product, each output-level plug-in's mix of its rows, and the trace of the step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backbone.model import Backbone, small_work_threads, vocab_wide_threads
from engine.batch import Batch, NetGroup
from engine.protocol import MixInput, MixOutput
from engine.topk import top_tokens


@dataclass
class GroupAttachments:
    """What a step's trace reads of one in-network group: the handles of the attachment of the forward pass that made
    the step's f(c) (empty before the first step's pass), those of its prefill attachment (whose trace stands in
    for the first step's: one prefill row per source), and — in a compact layout — each of the group's batch rows'
    position among the step attachment's rows (None: a finished row; ``positions`` None: the group's own order)."""

    group: NetGroup
    handles: list
    prefill_handles: list
    positions: list[int | None] | None = None


@dataclass
class StepOutput:
    """One step's distributions of every batch row, and what its trace shows."""

    lm_logprobs: torch.Tensor  # (N, V) log P_LM, on the backbone's device; with ``phys``: (P, V), one per cache row
    final: torch.Tensor        # (N, V) the final log-probabilities after every plug-in's mix, on the backbone's
    # device: the token selection reads only each row's best few from it (on a GPU, a few numbers per row cross to
    # the host instead of the whole vocabulary)
    info: list[dict]           # per batch row: trace items (λ_t, the plug-in's top tokens, extras, memory attention)
    plugin: dict = field(default_factory=dict)  # with ``keep_plugin``: batch row → log P_plug-in (V,) of its mix
    phys: torch.Tensor | None = None  # batch row → cache row, its row of ``lm_logprobs`` (a compact step)

    def lm(self, b: int) -> torch.Tensor:
        """Batch row ``b``'s log P_LM (V,)."""
        return self.lm_logprobs[b if self.phys is None else int(self.phys[b])]


def decode_step(backbone: Backbone, batch: Batch, fc_last: torch.Tensor, step: int,
                attached: list[GroupAttachments] | None = None, keep_plugin: bool = False,
                phys: torch.Tensor | None = None) -> StepOutput:
    """One step's distributions from the last position's f(c) of every batch row: f(c) and the output-level
    plug-ins' extra states go through the frozen norm + LM head in one matrix product, then each output-level
    plug-in mixes its rows. With ``attached`` (one ``GroupAttachments`` per in-network group) the per-row trace
    items are collected too; None: no trace. ``keep_plugin``: also return each interpolating plug-in's own
    distribution per batch row (``StepOutput.plugin``). ``phys`` (``BatchDecode``'s compact layout): ``fc_last``
    holds one cache row per distinct live batch row and batch row ``b`` reads cache row ``phys[b]``, so P_LM is
    computed once per cache row."""
    kept: dict = {}
    N = batch.N
    P = fc_last.shape[0]

    def rows_of(t: torch.Tensor, rr: torch.Tensor, at=None) -> torch.Tensor:  # batch rows ``rr`` of a per-cache-row one
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
        with vocab_wide_threads(lm_lp):  # a copy of vocabulary-wide rows: every thread once it is large
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
    return StepOutput(lm_lp, final, info, kept, phys)


def mix_step(backbone: Backbone, batch: Batch, fc_last: torch.Tensor, lm_logprobs: torch.Tensor, step: int,
             trace: bool = True) -> StepOutput:
    """``decode_step`` with log P_LM given (a remote backbone's: ``offsite.decode``): each output-level plug-in's
    extra states go through this side's final norm and LM head, then the plug-in mixes its rows."""
    N = batch.N
    with torch.no_grad():
        final = lm_logprobs.clone()
        info: list[dict] = [{} for _ in range(N)]
        for grp in batch.out:
            rr = grp.rows
            e = grp.plugin.extra_states(fc_last[rr], grp.settings)
            ex_logits = None
            if e is not None:
                normed = backbone.final_norm(e.to(backbone.dtype))
                vocab = grp.plugin.head_vocab()
                ex_logits = backbone.head_logits(normed) if vocab is None \
                    else backbone.head_logits_subset(normed, vocab)
            mo = grp.plugin.mix(MixInput(fc=fc_last[rr], lm_logprobs=lm_logprobs[rr], extra_logits=ex_logits,
                                         step=step, src_len=grp.src_lens, settings=grp.settings))
            final[rr] = mo.logprobs
            if trace:
                _mix_trace(backbone, info, rr.tolist(), mo)
    return StepOutput(lm_logprobs, final.cpu(), info)


def _mix_trace(backbone: Backbone, info: list[dict], rows: list[int], mo: MixOutput) -> None:
    """Each row's mix in its trace entry: λ_t, the plug-in's top tokens, the plug-in's extras."""
    for j, b in enumerate(rows):
        info[b]["lambda"] = round(mo.lam[j], 4) if mo.lam else None
        if mo.plugin_logprobs is not None:
            info[b]["top_plugin"] = top_tokens(mo.plugin_logprobs[j], backbone)
        if mo.extras and mo.extras[j]:
            info[b].update(mo.extras[j])


def _network_trace(batch: Batch, attached: list[GroupAttachments], info: list[dict]) -> None:
    """Each in-network group's trace of the forward pass that made this step's f(c): its step attachment's, or
    before the first step's pass its prefill attachment's (one prefill row per source)."""
    for ga in attached:
        grp = ga.group
        rows = grp.rows.tolist()
        per_row = grp.plugin.network_trace(ga.handles)
        if per_row is None:
            pre = grp.plugin.network_trace(ga.prefill_handles) or {}
            per_row = {j: pre.get(batch.source_of(b)) for j, b in enumerate(rows)}
        elif ga.positions is not None:
            per_row = {j: per_row.get(at) for j, at in enumerate(ga.positions) if at is not None}
        for j, b in enumerate(rows):
            if per_row.get(j) is not None:
                info[b]["memory_attention"] = per_row[j]


def trace_item(backbone: Backbone, out: StepOutput):
    """``item(b, token, logprob)``: the trace entry of a token chosen for batch row ``b`` at this step."""
    def item(b: int, tok: int, logprob: float) -> dict:
        return {"token": tok, "text": backbone.token_str(tok), "logprob": round(logprob, 4),
                "top_lm": top_tokens(out.lm(b), backbone), "top_final": top_tokens(out.final[b], backbone),
                **out.info[b]}
    return item
