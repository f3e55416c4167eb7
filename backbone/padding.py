"""Left padding that changes nothing: a row of a left-padded batch computes the very bits it computes alone.

A comparison or an evaluation batches rows whose contexts differ in length (several sentences; a row that brings
its own prompt, such as the retrieved-examples baseline), left-padded to one width. Masking the padding is not
enough for the same bits: the padded row's tokens sit at shifted positions (rotary embeddings of other angles) and
its attention reduces over a longer, masked key range (other partial sums). So a row's output would depend on which
other rows share its batch (docs/evaluation.md, "Batch-invariant rows").

A forward pass run with :func:`left_padded` instead gives each row

- its own positions, counted from its first real token (``position_ids``: what it gets alone), and
- attention over its own keys only: :func:`pad_neutral` wraps an attention function so that consecutive rows with
  the same padding attend in one call over their keys without the padding (a view, no copy), as they would in a
  batch without padding.

Together with the linears' row-count invariance (``backbone.kernels``: the precisions whose products keep a row's
bits in a batch of any size) a row then computes the same bits in any batch; tested in tests/test_batch_invariance.py.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from backbone.torch_internals import set_unregistered, unregistered

# (per row: its leading pad positions, the mask's width) during a forward pass run with ``left_padded``; else None
_PADDING: ContextVar[tuple[list[int], int] | None] = ContextVar("pema_left_padding", default=None)
ROW_ATTENTION = "pema_row_keys"  # the attention module's attribute a plug-in sets for one call (cpu_attention)
PAD_NEUTRAL_SDPA = "pema_sdpa"  # transformers' SDPA attention, wrapped by ``pad_neutral``


def left_pad(contexts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token contexts left-padded with ``pad`` to one width, and their attention mask (1 on real tokens)."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for r, c in enumerate(contexts):
        ids[r, width - len(c):] = torch.tensor(c)
        mask[r, width - len(c):] = 1
    return ids, mask


def left_pads(mask: torch.Tensor | None) -> list[int] | None:
    """Per row of a 2-D attention mask (1: a real position), how many leading positions are padding; None when
    no row is padded or the mask is not left padding (a masked position after a real one)."""
    if mask is None or mask.dim() != 2:
        return None
    real = mask.bool()
    if bool(real.all()):
        return None
    lead = (~real).long().cumprod(dim=-1).sum(dim=-1)
    if int(real.sum()) != int((real.shape[1] - lead).sum()):  # a hole inside a row: not left padding
        return None
    return lead.tolist()


def positions(mask: torch.Tensor, new: int) -> torch.Tensor:
    """The position ids of the last ``new`` columns of a left-padded 2-D mask, counted from each row's first real
    token (padding at 0: its outputs are never read)."""
    return (mask.long().cumsum(dim=-1) - 1).clamp_min(0)[:, -new:]


@contextmanager
def left_padded(mask: torch.Tensor | None):
    """Within it, attention wrapped by :func:`pad_neutral` reads each row's own keys only; yields the position ids
    of the pass's ``new`` tokens as a function (``None``: no row is padded, the model's own positions are each row's
    already)."""
    pads = left_pads(mask)
    token = _PADDING.set(None if pads is None else (pads, mask.shape[1]))
    try:
        yield None if pads is None else (lambda new: positions(mask, new))
    finally:
        _PADDING.reset(token)


def _runs(pads: list[int]) -> list[tuple[int, int, int]]:
    """(first row, end row, padding) of each run of consecutive rows with the same padding."""
    out: list[tuple[int, int, int]] = []
    for r, p in enumerate(pads):
        if out and out[-1][2] == p and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1, p)
        else:
            out.append((r, r + 1, p))
    return out


def _keys_from(t: torch.Tensor, a: int, b: int, p: int) -> torch.Tensor:
    """Rows a:b of a key or value tensor without their first ``p`` positions (a view); a growing cache's buffer
    (``pema_buffer``: every position of the block) is carried along, cut alike."""
    view = t[a:b, :, p:]
    buf = getattr(t, "pema_buffer", None)
    if buf is not None:
        view.pema_buffer = buf[a:b, :, p:]
    return view


def pad_neutral(inner):
    """``inner`` (a transformers attention function: ``module, query, key, value, attention_mask, **kw`` →
    (output (B, q, H, D), weights)) that, inside :func:`left_padded`, attends each run of equally padded rows over
    its keys without the padding. Outside it, or for a call it cannot read so (another row count than the pass's —
    a plug-in's sub-batch —, keys that are not one per mask position — a sliding window past its width, a prefix
    in front), it is ``inner`` itself. A plug-in's own attention for some rows (``ROW_ATTENTION``, memory-tuning's
    prefix in a decode step) is computed as before for its rows; every other row attends over its own keys."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        state = _PADDING.get()
        if state is None or kwargs.get("output_attentions"):
            return inner(module, query, key, value, attention_mask, *args, **kwargs)
        pads, width = state
        B, _, q_len, _ = query.shape
        if B != len(pads) or key.shape[0] != B or key.shape[2] != width or q_len > width:
            return inner(module, query, key, value, attention_mask, *args, **kwargs)
        extra = unregistered(module, ROW_ATTENTION)
        own_rows, full = None, None
        if extra is not None and extra.live():
            full = inner(module, query, key, value, attention_mask, *args, **kwargs)[0]
            own_rows = extra.take(torch.arange(B, device=query.device))
            set_unregistered(module, ROW_ATTENTION, None)
        try:
            out = None
            for a, b, p in _runs(pads):
                q0 = max(0, p - (width - q_len))  # queries at padding positions (a prefill's): left at zero
                if q0 >= q_len:
                    continue
                mask = attention_mask
                if mask is not None and mask.dim() == 4:
                    mask = mask[a:b] if mask.shape[0] == B else mask
                    mask = mask[:, :, q0:, p:] if mask.shape[2] == q_len else mask[..., p:]
                o = inner(module, query[a:b, :, q0:], _keys_from(key, a, b, p), _keys_from(value, a, b, p), mask,
                          *args, **kwargs)[0]
                if out is None:
                    out = o.new_zeros((B, q_len) + tuple(o.shape[2:]))
                out[a:b, q0:] = o
        finally:
            if own_rows is not None:
                set_unregistered(module, ROW_ATTENTION, extra)
        if own_rows is not None:
            out[own_rows] = full[own_rows]
        return out, None

    attention.pema_inner = inner
    return attention

