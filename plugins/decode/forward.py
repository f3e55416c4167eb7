"""The backbone's forward passes of a local decode: the prefill (prompts, the prefix cache, each in-network
group's hooks on its prefill rows) and the next step's pass over one new token per row."""
from __future__ import annotations

import torch

from backbone.model import Backbone, grow_kv_cache, relayout_kv_rows, small_work_threads
from plugins.decode.batch import Batch
from plugins.decode.prefix_cache import PREFIX_KV
from plugins.seqtrain import shared_prompt_len


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
    contexts = batch.prefill_contexts
    ids, mask = _left_padded(contexts, backbone.tokenizer.pad_token_id or 0)
    ids, mask = ids.to(dev), mask.to(dev)
    attached: list[list] = []
    # (plug-in, its attachment) of the in-network groups that leave the prompt's shared prefix to the frozen backbone
    frozen: list[tuple] = []
    own = None
    try:
        for grp in batch.net:
            attached.append(grp.plugin.attach(torch.tensor([s * G + grp.prefill for s in range(S)], device=dev),
                                              grp.settings, trace=trace))
            if grp.plugin.leaves_shared_prefix:
                frozen.append((grp.plugin, attached[-1]))
        if frozen:  # per prefill row, the first position of the source's own tokens (after left padding)
            width = ids.shape[1]
            own = torch.tensor([width - len(c) + shared_prompt_len(backbone, batch.prompt, c)
                                for c in contexts], device=dev)
            for plugin, handles in frozen:
                plugin.set_own_from(handles, own)
        with torch.no_grad():
            # the prefix cache holds the comparison prompt's prefix: rows prompted otherwise share none of it
            cacheable = S == 1 and use_prefix_cache and not batch.prompts
            P, past = _cached_prefix(backbone, batch, ids) if cacheable else (0, None)
            for plugin, handles in frozen:  # positions counted from the first token of the forward pass below
                plugin.set_own_from(handles, (own - P).clamp_min(0))
            fc, out = backbone.forward_fc(ids[:, P:], attention_mask=mask if batch.padded else None,
                                          past_key_values=past, use_cache=True)
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


def _left_padded(contexts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill rows' contexts left-padded to one width, and their attention mask."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for r, c in enumerate(contexts):
        ids[r, width - len(c):] = torch.tensor(c)
        mask[r, width - len(c):] = 1
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
