"""The backbone's forward passes of a local decode: the prefill (prompts, the prefix cache, each in-network
group's hooks on its prefill rows) and the next step's pass over one new token per row."""
from __future__ import annotations

import torch

from backbone.kv_cache import join_left_padded
from backbone.model import Backbone, grow_kv_cache, relayout_kv_rows, small_work_threads
from backbone.padding import left_pad
from engine.batch import Batch
from engine.prefix_cache import PREFIX_KV
from engine.protocol import shared_prompt_len


def prefill(backbone: Backbone, batch: Batch, use_prefix_cache: bool = True, trace: bool = True,
            expand: bool = True):
    """Encode the prompts and start every batch row's KV cache.

    One prefill row per (source, prefill group), each in-network group's hooks attached to its prefill rows. Each
    context is prefilled in a pass of its own — a source's rows that read the comparison's prompt in one, after the
    prompt's shared prefix (its KV cache from ``PREFIX_KV``, or computed), and each row prompted its own way alone —
    and the passes' caches are then joined, left-padded: a row's prefill is the same computation whatever else the
    batch holds (docs/evaluation.md, "Batch-invariant rows"). Where passes cannot be joined (a context past a
    sliding window) or a trace of several sources' in-network rows is asked, one left-padded pass serves all rows.
    Each prefill row's cache is then repeated over its rows and beams (``expand``; else it stays one row per
    prefill row, batch row ``b`` starting from row ``batch.prefill_row(b)``: ``BatchDecode``'s compact layout).
    Returns (f(c) at the last position per batch row — or per prefill row —, the KV cache, the attention mask per
    batch row — or prefill row —, and per in-network group the handles of its prefill attachment — removed; their
    trace stands for the first step's).
    """
    dev = backbone.device
    contexts = batch.prefill_contexts
    ids, mask = left_pad(contexts, backbone.tokenizer.pad_token_id or 0)
    ids, mask = ids.to(dev), mask.to(dev)
    joined = None
    window = getattr(backbone.model.config, "sliding_window", None)
    if not (trace and batch.net and batch.S > 1) and not (window and ids.shape[1] >= window - 1):
        joined = _prefill_per_context(backbone, batch, use_prefix_cache, trace, ids.shape[1])
    fc, cache, attached = joined if joined is not None else _prefill_padded(backbone, batch, ids, mask, trace)
    if not expand:
        grow_kv_cache(cache, backbone.model)
        return fc, cache, mask, attached
    src_rows = torch.tensor([batch.prefill_row(b) for b in range(batch.N)], device=dev)
    cache.batch_select_indices(src_rows)
    grow_kv_cache(cache, backbone.model)
    return fc[src_rows], cache, mask[src_rows], attached


def _attach(batch: Batch, rows_of, trace: bool) -> list[list]:
    """Each in-network group's hooks on its rows of a pass (``rows_of(group)``: a device tensor)."""
    return [grp.plugin.attach(rows_of(grp), grp.settings, trace=trace) for grp in batch.net]


def _set_own_from(backbone: Backbone, batch: Batch, attached: list[list], contexts: list[list[int]], width: int,
                  P: int) -> None:
    """For the in-network groups that leave the prompt's shared prefix to the frozen backbone: per row of the pass,
    the first position of the source's own tokens, counted from the pass's first token (after ``P`` cached ones)."""
    frozen = [(grp.plugin, h) for grp, h in zip(batch.net, attached) if grp.plugin.leaves_shared_prefix]
    if not frozen:
        return
    own = torch.tensor([width - len(c) + shared_prompt_len(backbone, batch.prompt, c) for c in contexts],
                       device=backbone.device)
    for plugin, handles in frozen:
        plugin.set_own_from(handles, (own - P).clamp_min(0))


def _prefill_per_context(backbone: Backbone, batch: Batch, use_prefix_cache: bool, trace: bool, width: int):
    """(f(c) per prefill row, the joined cache, per in-network group its handles) from one pass per context (see
    ``prefill``), or None when the passes' caches cannot be joined."""
    dev = backbone.device
    shared = batch.shared + len(batch.net)  # the prefill groups that read the comparison's prompt
    fcs, caches, lengths = [], [], []
    handles: list[list] = [[] for _ in batch.net]
    for s in range(batch.S):
        if shared:
            ctx = batch.contexts[s]
            ids = torch.tensor([ctx] * shared, device=dev)
            attached: list[list] = []
            try:
                attached = _attach(batch, lambda grp: torch.tensor([grp.prefill], device=dev), trace)
                with torch.no_grad():
                    _set_own_from(backbone, batch, attached, [ctx] * shared, len(ctx), 0)  # the prefix's pass
                    P, past = _cached_prefix(backbone, batch, s, ids, use_prefix_cache)
                    _set_own_from(backbone, batch, attached, [ctx] * shared, len(ctx), P)
                    fc, out = backbone.forward_fc(ids[:, P:], past_key_values=past, use_cache=True)
            finally:
                for g, hs in enumerate(attached):
                    for h in hs:
                        h.remove()
                    handles[g].extend(hs)
            fcs.append(fc[:, -1])
            caches.append(out.past_key_values)
            lengths.append(len(ctx))
        for grp in batch.prompts:  # a row prompted its own way: its context alone
            ctx = grp.contexts[s]
            with torch.no_grad():
                fc, out = backbone.forward_fc(torch.tensor([ctx], device=dev), use_cache=True)
            fcs.append(fc[:, -1])
            caches.append(out.past_key_values)
            lengths.append(len(ctx))
    cache = join_left_padded(caches, lengths, width) if len(caches) > 1 else caches[0]
    if cache is None:
        return None
    return torch.cat(fcs), cache, handles


def _prefill_padded(backbone: Backbone, batch: Batch, ids: torch.Tensor, mask: torch.Tensor, trace: bool):
    """(f(c) per prefill row, the cache, per in-network group its handles) from one left-padded pass of every
    prefill row (pad-neutral: ``backbone.padding``)."""
    S, G, dev = batch.S, batch.G, backbone.device
    attached: list[list] = []
    try:
        attached = _attach(batch, lambda grp: torch.tensor([s * G + grp.prefill for s in range(S)], device=dev),
                           trace)
        with torch.no_grad():
            _set_own_from(backbone, batch, attached, batch.prefill_contexts, ids.shape[1], 0)
            fc, out = backbone.forward_fc(ids, attention_mask=mask if batch.padded else None, use_cache=True,
                                          pad_neutral=True)
    finally:
        for handles in attached:
            for h in handles:
                h.remove()
    return fc[:, -1], out.past_key_values, attached




def _cached_prefix(backbone: Backbone, batch: Batch, s: int, ids: torch.Tensor, use_prefix_cache: bool):
    """``(P, KV cache of ids[:, :P])`` for source ``s``'s pass: P is the prompt's shared prefix, always the same for
    a context (so that the pass after it has the same shapes whatever was cached before); its cache from
    ``PREFIX_KV`` (with ``use_prefix_cache``), or computed (with the hooks that are attached) and stored; ``(0,
    None)`` when the shared prefix is too short."""
    groups = [(None, None)] * batch.shared + [(grp.plugin, grp.key) for grp in batch.net]
    ctx = batch.contexts[s]
    P = PREFIX_KV.shared_len(backbone, batch.prompt, batch.sources[s], ctx)
    if not P:
        return 0, None
    got, past = PREFIX_KV.get(backbone, groups, ctx, length=P) if use_prefix_cache else (0, None)
    if past is None:
        past = backbone.forward_fc(ids[:, :P], use_cache=True)[1].past_key_values
        if use_prefix_cache:
            PREFIX_KV.put(backbone, groups, ctx[:P], past)
    return P, past


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
                                      attention_mask=mask if padded else None, pad_neutral=True)
    return fc[:, -1], out.past_key_values, mask
