"""One batched decode for a comparison: every method is a row (or, with beam search, a block of rows) of one batch
that shares the backbone's forward pass.

Per step: the backbone runs once for the whole batch with the in-network plug-ins' hooks active on their own rows;
f(c) of every row and the output-level plug-ins' extra states (PEMA's h_pd) go through the frozen norm + LM head
in **one** matrix product; each output-level plug-in mixes its rows; tokens are picked per row; rows stop
independently at the end of the sentence line. The prompt is encoded once per distinct in-network state (rows
without in-network plug-ins share one prefill) and its KV cache is repeated over the rows.

Greedy by default; ``num_beams > 1`` runs beam search per row (no length penalty; a row stops when its best
finished hypothesis scores at least as well as its best live one, which is exact since scores only decrease).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch

from backbone.model import Backbone
from backbone.prompts import Prompt, postprocess
from plugins.base import MixInput, Plugin
from studio.errors import UserError

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


def _top(lp: torch.Tensor, backbone: Backbone, k: int = TOP) -> list[list]:
    v, i = lp.topk(k)
    return [[int(t), backbone.token_str(int(t)), round(float(p), 4)] for t, p in zip(i.tolist(), v.exp().tolist())]


def _key(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True, default=str)


def compare(backbone: Backbone, source: str, rows: list[Row], prompt: Prompt | None = None,
            max_new_tokens: int = 64, num_beams: int = 1, trace: bool = True,
            context_ids: list[int] | None = None) -> Comparison:
    """Decode ``source`` with every row at once and return each row's text, tokens and per-token trace."""
    if not rows:
        raise UserError("Choose at least one method to compare.")
    if not source or not source.strip():
        raise UserError("Type a sentence to translate or rewrite.")
    if num_beams < 1:
        raise UserError("The number of beams must be ≥ 1.")
    for r in rows:
        if r.plugin is not None and r.plugin.fingerprint != backbone.fingerprint:
            backbone.check_fingerprint(r.plugin.fingerprint, f"The plug-in of row {r.label!r}")
    t0 = time.time()
    prompt = prompt or Prompt(chat=backbone.chat)
    ctx = context_ids or backbone.encode_context(prompt.render(source))
    src_len = len(backbone.encode_target(source.strip()))
    dev = backbone.device
    B = num_beams
    R = len(rows)
    N = R * B
    settings = [r.plugin.settings(r.settings) if r.plugin is not None else {} for r in rows]
    for r in rows:
        if r.plugin is not None:
            r.plugin.prepare_decode()

    # Groups: in-network plug-ins by (plug-in, settings); output-level plug-ins by plug-in.
    net_groups: dict[tuple, list[int]] = {}
    out_groups: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r.plugin is None:
            continue
        if r.plugin.level == "network":
            net_groups.setdefault((id(r.plugin), _key(settings[i])), []).append(i)
        elif r.plugin.level == "output":
            out_groups.setdefault(id(r.plugin), []).append(i)
    plugin_of = {id(r.plugin): r.plugin for r in rows if r.plugin is not None}

    # Prefill: one batch row for all rows without in-network plug-ins, one per in-network group.
    prefill_of_row = [0] * R
    net_list = list(net_groups.items())
    for g, (_, members) in enumerate(net_list, start=1):
        for i in members:
            prefill_of_row[i] = g
    G = 1 + len(net_list)
    handles = []
    try:
        for g, ((pid, _), members) in enumerate(net_list, start=1):
            handles += plugin_of[pid].attach(torch.tensor([g], device=dev), settings[members[0]])
        ids = torch.tensor([ctx], device=dev).repeat(G, 1)
        with torch.no_grad():
            fc, out = backbone.forward_fc(ids, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    cache = out.past_key_values
    src_rows = torch.tensor([prefill_of_row[b // B] for b in range(N)], device=dev)
    cache.batch_select_indices(src_rows)
    fc_last = fc[src_rows, -1]

    def rows_of(members: list[int]) -> torch.Tensor:
        return torch.tensor([i * B + j for i in members for j in range(B)], device=dev)

    net_rows = [(plugin_of[pid], rows_of(m), settings[m[0]]) for (pid, _), m in net_list]
    out_rows = [(plugin_of[pid], rows_of(m), [settings[i] for i in m for _ in range(B)])
                for pid, m in out_groups.items()]

    scores = torch.zeros(R, B)
    if B > 1:
        scores[:, 1:] = float("-inf")  # all beams start identical: expand from the first only
    beam_tokens: list[list[int]] = [[] for _ in range(N)]
    beam_traces: list[list[dict]] = [[] for _ in range(N)]
    finished: list[list[tuple[float, list[int], list[dict]]]] = [[] for _ in range(R)]
    done = [False] * R
    stop_ids = backbone.stop_ids
    steps = 0
    handles = []
    try:
        for pl, rr, st in net_rows:
            handles += pl.attach(rr, st)
        for step in range(max_new_tokens):
            steps = step + 1
            with torch.no_grad():
                normed = backbone.final_norm(fc_last)
                extra = [(pl, rr, sts, pl.extra_states(fc_last[rr], sts)) for pl, rr, sts in out_rows]
                states = [normed] + [backbone.final_norm(e.to(backbone.dtype)) for *_, e in extra if e is not None]
                logits = backbone.head_logits(torch.cat(states))  # one pass over the LM head's weights
                lm_lp = torch.log_softmax(logits[:N], dim=-1)
                final = lm_lp.clone()
                info: list[dict] = [{} for _ in range(N)]
                off = N
                for pl, rr, sts, e in extra:
                    ex_logits = None
                    if e is not None:
                        ex_logits = logits[off:off + len(rr)]
                        off += len(rr)
                    mo = pl.mix(MixInput(fc=fc_last[rr], lm_logprobs=lm_lp[rr], extra_logits=ex_logits, step=step,
                                         src_len=src_len, settings=sts))
                    final[rr] = mo.logprobs
                    if trace:
                        for j, b in enumerate(rr.tolist()):
                            info[b]["lambda"] = round(mo.lam[j], 4) if mo.lam else None
                            if mo.plugin_logprobs is not None:
                                info[b]["top_plugin"] = _top(mo.plugin_logprobs[j], backbone)
                            if mo.extras and mo.extras[j]:
                                info[b].update(mo.extras[j])
                if trace:
                    for pl, rr, _ in net_rows:
                        nt = pl.network_trace()
                        if nt:
                            for j, b in enumerate(rr.tolist()):
                                info[b]["memory_attention"] = nt.get(j)
            final = final.cpu()
            # Pick tokens per row (greedy = beam search with one beam).
            next_tok = torch.full((N,), backbone.tokenizer.pad_token_id or 0, dtype=torch.long)
            src = torch.arange(N)
            new_tokens, new_traces = list(beam_tokens), list(beam_traces)
            for r in range(R):
                if done[r]:
                    continue
                blk = slice(r * B, (r + 1) * B)
                cand = (scores[r].unsqueeze(1) + final[blk]).flatten()
                top_v, top_i = cand.topk(min(2 * B, cand.numel()))
                live = []
                for v, ci in zip(top_v.tolist(), top_i.tolist()):
                    if v == float("-inf"):
                        break
                    j, tok = divmod(ci, final.shape[1])
                    b = r * B + j
                    entry = None
                    if trace:
                        entry = {"token": tok, "text": backbone.token_str(tok), "logprob": round(v - float(scores[r, j]), 4),
                                 "top_lm": _top(lm_lp[b].cpu(), backbone), "top_final": _top(final[b], backbone),
                                 **info[b]}
                    if tok in stop_ids:
                        finished[r].append((v, beam_tokens[b] + [tok], beam_traces[b] + ([entry] if entry else [])))
                    else:
                        live.append((v, b, tok, entry))
                    if len(live) == B:
                        break
                best_done = max((f[0] for f in finished[r]), default=float("-inf"))
                if not live or len(finished[r]) >= B or best_done >= live[0][0]:
                    done[r] = True
                    continue
                for j in range(B):
                    v, b, tok, entry = live[min(j, len(live) - 1)] if j < len(live) else (float("-inf"), *live[0][1:])
                    tgt = r * B + j
                    scores[r, j] = v
                    src[tgt] = b
                    next_tok[tgt] = tok
                    new_tokens[tgt] = beam_tokens[b] + [tok]
                    new_traces[tgt] = beam_traces[b] + ([entry] if entry else [])
            beam_tokens, beam_traces = new_tokens, new_traces
            if all(done):
                break
            if B > 1:
                cache.reorder_cache(src.to(dev))
            with torch.no_grad():
                fc, out = backbone.forward_fc(next_tok.unsqueeze(1).to(dev), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            fc_last = fc[:, -1]
    finally:
        for h in handles:
            h.remove()

    results = []
    for r, row in enumerate(rows):
        if finished[r]:
            score, toks, tr = max(finished[r], key=lambda f: f[0])
        else:  # ran out of tokens: the best live beam
            j = int(scores[r].argmax())
            score, toks, tr = float(scores[r, j]), beam_tokens[r * B + j], beam_traces[r * B + j]
        body = [t for t in toks if t not in stop_ids]
        raw = backbone.decode(body)
        results.append(RowResult(label=row.label, method=row.method, text=postprocess(raw), raw_text=raw,
                                 tokens=toks, token_texts=[backbone.token_str(t) for t in toks], trace=tr,
                                 settings=settings[r], score=round(float(score), 4)))
    return Comparison(source=source, context_ids=ctx, src_len=src_len, rows=results, seconds=time.time() - t0,
                      steps=steps, num_beams=B, backbone=backbone.name)
