"""The backbone's own attention from output tokens to the input sentence's tokens (for the Compare view).

One teacher-forced pass over ``context + output`` with ``output_attentions=True`` at one layer, averaged over
heads. The row for output token i is the attention of the position that *predicted* token i (the last context
position for the first token), restricted to the tokens of the input sentence inside the prompt and
renormalised over them so that rows are comparable.

SDPA and flash kernels do not return attention weights, so the model is switched to ``eager`` attention for the
pass and switched back afterwards (``set_attn_implementation``; the config field on older transformers).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from backbone.hf_internals import attn_implementation, set_attn_implementation
from backbone.model import Backbone
from backbone.prompts import Prompt
from ground.errors import UserError


@contextmanager
def eager_attention(model):
    """Temporarily use eager attention (the only implementation that returns attention weights)."""
    before = attn_implementation(model)
    if before in (None, "eager"):
        yield
        return
    try:
        set_attn_implementation(model, "eager")
        yield
    finally:
        set_attn_implementation(model, before)


def _char_spans(backbone: Backbone, text: str, ids: list[int]) -> list[tuple[int, int]] | None:
    """Character span of every token of ``ids`` in ``text`` (None when the tokenizer cannot say)."""
    tok = backbone.tokenizer
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return None
    got = list(enc["input_ids"])
    offs = [tuple(o) for o in enc["offset_mapping"]]
    if got == ids:
        return offs
    if len(ids) > len(got) and ids[len(ids) - len(got):] == got:  # special tokens (BOS) in front
        return [(0, 0)] * (len(ids) - len(got)) + offs
    return None


def source_token_span(backbone: Backbone, prompt: Prompt, source: str, context_ids: list[int]) -> tuple[int, int]:
    """``[start, end)`` of the input sentence's tokens inside the encoded prompt."""
    src = source.strip()
    if backbone.chat:
        text = backbone.tokenizer.apply_chat_template([{"role": "user", "content": prompt.render(source)}],
                                                      add_generation_prompt=True, tokenize=False)
    else:
        text = prompt.render(source)
    lo = text.rfind(src)
    spans = _char_spans(backbone, text, context_ids)
    if lo >= 0 and spans is not None:
        hi = lo + len(src)
        idx = [i for i, (a, b) in enumerate(spans) if b > a and a < hi and b > lo]
        if idx:
            return idx[0], idx[-1] + 1
    # Fallback: the sentence's own tokens, searched from the end of the context.
    want = backbone.encode_target(src)
    n = len(want)
    for start in range(len(context_ids) - n, -1, -1):
        if context_ids[start:start + n] == want:
            return start, start + n
    want = backbone.encode_target(" " + src)
    n = len(want)
    for start in range(len(context_ids) - n, -1, -1):
        if context_ids[start:start + n] == want:
            return start, start + n
    raise UserError("Could not find the input sentence's tokens inside the prompt.")


def input_attention(backbone: Backbone, prompt: Prompt, source: str, output_ids: list[int], layer: int = -1,
                    context_ids: list[int] | None = None) -> dict:
    """Attention (head-averaged, one layer) from each output token to the input sentence's tokens.

    Returns ``{"layer", "matrix": [[...] per output token], "output_tokens", "input_tokens"}``.
    """
    if not output_ids:
        raise UserError("This output is empty: there is no attention to show.")
    n_layers = backbone.num_layers
    if layer < 0:
        layer += n_layers
    if not 0 <= layer < n_layers:
        raise UserError(f"Choose a layer between 0 and {n_layers - 1}.")
    ctx = list(context_ids) if context_ids else backbone.encode_context(prompt.render(source))
    a, b = source_token_span(backbone, prompt, source, ctx)
    seq = ctx + list(output_ids[:-1])
    ids = torch.tensor([seq], device=backbone.device)
    with torch.no_grad(), eager_attention(backbone.model):
        out = backbone.decoder(input_ids=ids, output_attentions=True, use_cache=False)
    att = out.attentions[layer]
    if att is None:
        raise UserError("This backbone does not report attention weights.")
    att = att[0].float().mean(0)  # (T, T), averaged over heads
    q = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(output_ids), device=att.device)
    m = att[q][:, a:b]
    m = m / m.sum(1, keepdim=True).clamp_min(1e-12)
    return {"layer": layer, "matrix": np.round(m.cpu().numpy(), 4).tolist(),
            "output_tokens": [backbone.token_str(t) for t in output_ids],
            "input_tokens": [backbone.token_str(t) for t in ctx[a:b]]}
