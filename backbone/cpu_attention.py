"""A decode step's attention on a CPU (one query token), registered with transformers as ``CPU_DECODE_ATTENTION``,
and the hook point through which a plug-in adds attention for some batch rows (``RowAttention``)."""
from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from backbone.hf_internals import attn_implementation, register_attention, sdpa_attention, set_attn_implementation
from backbone.padding import PAD_NEUTRAL_SDPA, ROW_ATTENTION, pad_neutral
from backbone.torch_internals import unregistered

CPU_DECODE_ATTENTION = "pema_cpu_decode"


class RowAttention(Protocol):
    """Extra attention that only some batch rows read, in one decode step of one layer (memory-tuning's prefix):
    set by a plug-in as the attention module's ``ROW_ATTENTION`` attribute for the call. :func:`cpu_decode_attention`
    computes every row as without it, then lets it put its rows' outputs in place from the very scores those rows
    got, so the plug-in need not run the attention a second time for them."""

    def live(self) -> bool:
        """Whether it applies to this call."""
        ...

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """Its rows of a per-batch-row tensor."""
        ...

    def attend(self, out: torch.Tensor, q: torch.Tensor, scores: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``out`` (every row's attention output, (B, KV heads, heads per KV head, D)) with its rows' outputs
        replaced; ``scores``: its rows' scaled, masked scores over their own keys; ``value``: every row's values."""
        ...


def cpu_decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs):
    """A decode step's attention on a CPU (one query token), registered with transformers' ``AttentionInterface``
    for bfloat16 and float32 models on a CPU; everything else (a prefill, training, other dtypes) goes to
    transformers' SDPA function.

    bfloat16: two small matrix products and a softmax, as transformers' eager attention computes them (scores in
    bfloat16, softmax in float32). torch's bfloat16 SDPA kernel for one query token is slow on an AVX-512 BF16 CPU
    (a large share of a multi-row Gemma step in ``python -m benchmarks rows --dtype bfloat16``;
    BENCHMARKS.md, "Decode time per token").

    float32 (also float16 weight-only's activations): SDPA itself for every row (its kernel is the faster one there,
    and its bits are float32's reference), on the query heads of each KV head packed as that head's queries, as
    transformers packs them when a mask is given; plus only what rides on this function: a plug-in's attention for
    some rows (:class:`RowAttention`), which would otherwise re-run the whole attention module for those rows at
    every layer and step."""
    if (query.shape[2] != 1 or query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float32)
            or dropout or kwargs.get("softcap") is not None or kwargs.get("output_attentions")):
        return sdpa_attention()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                **kwargs)
    B, H, _, D = query.shape
    Hkv = key.shape[1]
    q = query.reshape(B, Hkv, H // Hkv, D)  # head h reads KV head h // (H / Hkv): as repeat_kv lays them out
    scale = scaling if scaling is not None else D ** -0.5
    extra: RowAttention | None = unregistered(module, ROW_ATTENTION)  # set by a plug-in's hook for this call
    if query.dtype == torch.float32:
        # SDPA with a KV head's query heads as that head's queries (transformers' own ``pack_gqa``, which it takes
        # only with a mask; unmasked it asks SDPA for ``enable_gqa``, whose CPU kernel reads each KV head once per
        # query head: slower, ``python -m benchmarks head`` times both)
        mask = attention_mask if attention_mask is None or attention_mask.shape[1] == 1 else \
            attention_mask.reshape(B, Hkv, H // Hkv, -1)
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
        if extra is not None and extra.live():
            # the scores of the hook's rows only (SDPA computed every row's attention: scoring all rows again would
            # cost a share of every step), over a growing cache's whole buffer
            scores = _decode_scores(q, key, attention_mask, scale, extra.take)
            out = extra.attend(out, q, scores, getattr(value, "pema_buffer", value), scale)
        return out.reshape(B, 1, H, D), None
    scores = _decode_scores(q, key, attention_mask, scale)
    key, value = getattr(key, "pema_buffer", key), getattr(value, "pema_buffer", value)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # (B, Hkv, H/Hkv, D)
    if extra is not None and extra.live():
        out = extra.attend(out, q, extra.take(scores), value, scale)
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def _decode_scores(q: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                   scale: float, take: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """A decode step's scaled, masked attention scores (B, KV heads, heads per KV head, C) of queries ``q`` (B, KV
    heads, heads per KV head, D) over ``key``'s positions — over its whole buffer (C ≥ L) where it is a growing
    cache's view (the unused positions at −inf). ``take``: only the batch rows it selects (``RowAttention.take``)."""
    L = key.shape[2]
    # Keys and values from a ``GrowingKVLayer`` are the first L positions of a block-sized buffer: the products run
    # over the whole (contiguous) buffer, its unused positions masked (−inf scores, zero values) — a strided view
    # would send torch's bmm down a copying path.
    key = getattr(key, "pema_buffer", key)
    if take is not None:
        if attention_mask is not None and attention_mask.shape[0] == q.shape[0]:
            attention_mask = take(attention_mask)
        q, key = take(q), take(key)
    B, Hkv, G, D = q.shape
    C = key.shape[2]
    # as a 3-D bmm: the same products and bits as the 4-D matmul, which first copied the transposed keys
    scores = torch.bmm(q.reshape(B * Hkv, G, D), key.reshape(B * Hkv, C, D).transpose(1, 2))
    scores = scores.view(B, Hkv, G, C) * scale  # (B, Hkv, G, C)
    if C > L:
        scores[..., L:] = float("-inf")
    if attention_mask is not None:
        m = attention_mask[:, :, :, :L]
        if m.dtype == torch.bool:
            scores[..., :L].masked_fill_(~m, float("-inf"))
        else:
            scores[..., :L] += m
    return scores


def use_cpu_decode_attention(model: nn.Module) -> bool:
    """Register :func:`cpu_decode_attention` (pad-neutral: ``backbone.padding``) and switch a model that runs SDPA
    to it; False when this transformers or model cannot (the model then keeps its attention)."""
    try:
        register_attention(CPU_DECODE_ATTENTION, pad_neutral(cpu_decode_attention))
        if attn_implementation(model) not in ("sdpa", PAD_NEUTRAL_SDPA):
            return False
        set_attn_implementation(model, CPU_DECODE_ATTENTION)
        return True
    except Exception:  # noqa: BLE001 - an older transformers: keep SDPA
        return False


def use_pad_neutral_attention(model) -> bool:
    """Switch a model that runs transformers' SDPA attention to it wrapped by :func:`backbone.padding.pad_neutral`
    (the CPU decode attention is registered wrapped). Returns whether the model's attention is now pad-neutral;
    False where this transformers cannot (the model keeps its attention: padded rows then compute to float rounding
    only)."""
    try:
        name = attn_implementation(model)
        if name == "sdpa":
            register_attention(PAD_NEUTRAL_SDPA, pad_neutral(sdpa_attention()))
            set_attn_implementation(model, PAD_NEUTRAL_SDPA)
            return True
        return name in (PAD_NEUTRAL_SDPA, CPU_DECODE_ATTENTION)
    except Exception:  # noqa: BLE001 - an older transformers: keep its attention
        return False
