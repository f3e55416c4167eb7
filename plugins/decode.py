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

import copy
import itertools
import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import torch

from backbone.model import Backbone
from backbone.prompts import Prompt, common_prefix_len, postprocess
from plugins.base import MixInput, Plugin
from ground.errors import UserError

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
            context_ids: list[int] | None = None, use_prefix_cache: bool = True) -> Comparison:
    """Decode ``source`` with every row at once and return each row's text, tokens and per-token trace."""
    return decode_batch(backbone, [source], rows, prompt, max_new_tokens, num_beams, trace,
                        [context_ids] if context_ids else None, use_prefix_cache)[0]


def decode_batch(backbone: Backbone, sources: list[str], rows: list[Row], prompt: Prompt | None = None,
                 max_new_tokens: int = 64, num_beams: int = 1, trace: bool = True,
                 contexts: list[list[int]] | None = None, use_prefix_cache: bool = True) -> list[Comparison]:
    """Decode several sources × every row in one batch (left-padded prompts); one Comparison per source.

    A single source reuses the KV cache of the prompt's shared prefix (instruction and few-shot examples) from an
    earlier decode with the same prefill groups (``PREFIX_KV``), so only the source's own tokens are prefilled.

    Batch layout: index ``(s * R + r) * B + j`` for source s, row r, beam j. Left padding is masked out; rotary
    position offsets cancel in attention scores, so a padded row computes what it would alone (up to float
    rounding).
    """
    if not rows:
        raise UserError("Choose at least one method to compare.")
    if not sources or any(not s or not s.strip() for s in sources):
        raise UserError("Type a sentence to translate or rewrite.")
    if num_beams < 1:
        raise UserError("The number of beams must be ≥ 1.")
    for r in rows:
        if r.plugin is not None and r.plugin.fingerprint != backbone.fingerprint:
            backbone.check_fingerprint(r.plugin.fingerprint, f"The plug-in of row {r.label!r}")
    t0 = time.time()
    prompt = prompt or Prompt(chat=backbone.chat)
    ctxs = contexts or [backbone.encode_context(prompt.render(s)) for s in sources]
    src_lens = [len(backbone.encode_target(s.strip())) for s in sources]
    dev = backbone.device
    S, R, B = len(sources), len(rows), num_beams
    SR = S * R
    N = SR * B
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
        if r.plugin.level == "output" or r.plugin.mixes_output:
            out_groups.setdefault(id(r.plugin), []).append(i)
    plugin_of = {id(r.plugin): r.plugin for r in rows if r.plugin is not None}
    net_list = list(net_groups.items())

    # Prefill: per source, one batch row for all rows without in-network plug-ins (if there are any) and one per
    # in-network group.
    shared = int(any(r.plugin is None or r.plugin.level != "network" for r in rows))
    G = shared + len(net_list)
    group_of_row = [0] * R
    for g, (_, members) in enumerate(net_list, start=shared):
        for i in members:
            group_of_row[i] = g
    width = max(len(c) for c in ctxs)
    pad = backbone.tokenizer.pad_token_id or 0
    ids = torch.full((S * G, width), pad, dtype=torch.long)
    mask = torch.zeros((S * G, width), dtype=torch.long)
    for s_i, c in enumerate(ctxs):
        for g in range(G):
            ids[s_i * G + g, width - len(c):] = torch.tensor(c)
            mask[s_i * G + g, width - len(c):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    handles = []
    try:
        for g, ((pid, _), members) in enumerate(net_list, start=shared):
            handles += plugin_of[pid].attach(torch.tensor([s_i * G + g for s_i in range(S)], device=dev),
                                             settings[members[0]])
        with torch.no_grad():
            P, past = 0, None
            if S == 1 and use_prefix_cache:
                groups = [(None, None)] * shared + [(plugin_of[pid], k) for pid, k in net_groups]
                P, past = PREFIX_KV.get(backbone, groups, ctxs[0])
                if past is None:
                    P = PREFIX_KV.shared_len(backbone, prompt, sources[0], ctxs[0])
                    if P:
                        past = backbone.forward_fc(ids[:, :P], use_cache=True)[1].past_key_values
                        PREFIX_KV.put(backbone, groups, ctxs[0][:P], past)
            fc, out = backbone.forward_fc(ids[:, P:], attention_mask=mask if S > 1 else None, past_key_values=past,
                                          use_cache=True)
    finally:
        for h in handles:
            h.remove()
    cache = out.past_key_values
    src_rows = torch.tensor([(b // (R * B)) * G + group_of_row[(b // B) % R] for b in range(N)], device=dev)
    cache.batch_select_indices(src_rows)
    mask = mask[src_rows]
    fc_last = fc[src_rows, -1]

    def rows_of(members: list[int]) -> torch.Tensor:
        return torch.tensor([(s_i * R + i) * B + j for s_i in range(S) for i in members for j in range(B)],
                            device=dev)

    net_rows = [(plugin_of[pid], rows_of(m), settings[m[0]]) for (pid, _), m in net_list]
    out_rows = []
    for pid, m in out_groups.items():
        rr = rows_of(m)
        out_rows.append((plugin_of[pid], rr, [settings[(b // B) % R] for b in rr.tolist()],
                         [src_lens[b // (R * B)] for b in rr.tolist()]))

    scores = torch.zeros(SR, B)
    if B > 1:
        scores[:, 1:] = float("-inf")  # all beams start identical: expand from the first only
    beam_tokens: list[list[int]] = [[] for _ in range(N)]
    beam_traces: list[list[dict]] = [[] for _ in range(N)]
    finished: list[list[tuple[float, list[int], list[dict]]]] = [[] for _ in range(SR)]
    done = [False] * SR
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
                extra = [(pl, rr, sts, sls, pl.extra_states(fc_last[rr], sts)) for pl, rr, sts, sls in out_rows]
                # States whose plug-in needs every token's logit share one pass over the LM head's weights with
                # f(c); a plug-in with a restricted vocabulary (PEMA after candidate training) uses only its rows.
                full_vocab = [e is not None and pl.head_vocab() is None for pl, _, _, _, e in extra]
                states = [normed] + [backbone.final_norm(x[4].to(backbone.dtype)) for x, f in zip(extra, full_vocab) if f]
                logits = backbone.head_logits(torch.cat(states))
                lm_lp = torch.log_softmax(logits[:N], dim=-1)
                final = lm_lp.clone()
                info: list[dict] = [{} for _ in range(N)]
                off = N
                for (pl, rr, sts, sls, e), full in zip(extra, full_vocab):
                    ex_logits = None
                    if full:
                        ex_logits = logits[off:off + len(rr)]
                        off += len(rr)
                    elif e is not None:
                        ex_logits = backbone.head_logits_subset(backbone.final_norm(e.to(backbone.dtype)),
                                                                pl.head_vocab())
                    mo = pl.mix(MixInput(fc=fc_last[rr], lm_logprobs=lm_lp[rr], extra_logits=ex_logits, step=step,
                                         src_len=sls, settings=sts))
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
                                if nt.get(j) is not None:
                                    info[b]["memory_attention"] = nt.get(j)
            final = final.cpu()
            # Pick tokens per row (greedy = beam search with one beam).
            next_tok = torch.full((N,), pad, dtype=torch.long)
            src = torch.arange(N)
            new_tokens, new_traces = list(beam_tokens), list(beam_traces)
            for r in range(SR):
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
                        entry = {"token": tok, "text": backbone.token_str(tok),
                                 "logprob": round(v - float(scores[r, j]), 4),
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
                    v, b, tok, entry = live[j] if j < len(live) else (float("-inf"), *live[0][1:])
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
                mask = mask[src.to(dev)]
            mask = torch.cat([mask, torch.ones((N, 1), dtype=mask.dtype, device=dev)], dim=1)
            with torch.no_grad():
                fc, out = backbone.forward_fc(next_tok.unsqueeze(1).to(dev), past_key_values=cache, use_cache=True,
                                              attention_mask=mask if S > 1 else None)
            cache = out.past_key_values
            fc_last = fc[:, -1]
    finally:
        for h in handles:
            h.remove()

    seconds = time.time() - t0
    comparisons = []
    for s_i, source in enumerate(sources):
        results = []
        for r_i, row in enumerate(rows):
            r = s_i * R + r_i
            if finished[r]:
                score, toks, tr = max(finished[r], key=lambda f: f[0])
            else:  # ran out of tokens: the best live beam
                j = int(scores[r].argmax())
                score, toks, tr = float(scores[r, j]), beam_tokens[r * B + j], beam_traces[r * B + j]
            raw = backbone.decode(toks).rstrip("\n")  # a stop token may carry text before its line break
            results.append(RowResult(label=row.label, method=row.method, text=postprocess(raw), raw_text=raw,
                                     tokens=toks, token_texts=[backbone.token_str(t) for t in toks], trace=tr,
                                     settings=settings[r_i], score=round(float(score), 4)))
        comparisons.append(Comparison(source=source, context_ids=ctxs[s_i], src_len=src_lens[s_i], rows=results,
                                      seconds=seconds, steps=steps, num_beams=B, backbone=backbone.name))
    return comparisons
