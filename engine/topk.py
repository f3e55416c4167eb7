"""Exact, stable top-k over vocabulary-wide rows, and the top tokens a trace shows."""
from __future__ import annotations

import torch

from backbone.model import Backbone

TOP = 5  # tokens per distribution in a trace entry


def _stable_top(y: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of ``y`` (R, n), largest first, ties broken by the lower index: ``torch.topk``
    for the k-th value, then of the entries equal to it the lowest-indexed ones (``topk`` leaves ties unspecified)."""
    R = y.shape[0]
    vk = y.topk(k, dim=-1).values[:, -1:]
    gt = y > vk
    eq = y == vk
    take = gt | (eq & (eq.cumsum(-1) <= k - gt.sum(-1, keepdim=True)))
    if int(take.sum()) != R * k:  # NaN: no order to keep; a full stable sort decides
        v, i = torch.sort(y, dim=-1, descending=True, stable=True)
        return v[:, :k], i[:, :k]
    pos = take.nonzero()[:, 1].view(R, k)  # ascending positions per row
    v, o = torch.sort(y.gather(1, pos), dim=-1, descending=True, stable=True)
    return v, pos.gather(1, o)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values along the last dimension of ``x`` (1-D or 2-D) and their indices, largest first,
    ties broken by the lower index (as a stable descending sort). For a vocabulary-sized row (Gemma: 262,144) in two
    stages — each chunk's maximum, the k chunks with the largest maxima, then the top k among their entries —,
    exact: a chunk whose maximum is not among the top k maxima holds none of the top k values. ``torch.topk`` on
    such a row first copies all of it into a scratch vector of (value, index) pairs; this reads the row once."""
    one = x.dim() == 1
    x2 = x.unsqueeze(0) if one else x
    R, V = x2.shape
    k = min(k, V)
    C = 1024 if k <= 8 else 128  # chunk width: the candidates (k·C) stay a small share of the row
    if V < 8 * k * C:
        v, i = _stable_top(x2, k)
    else:
        pad = (-V) % C
        xp = torch.nn.functional.pad(x2, (0, pad), value=float("-inf")) if pad else x2
        chunks = xp.reshape(R, -1, C)
        order = _stable_top(chunks.amax(-1), k)[1].sort(-1).values       # the chunks, in index order
        cand = chunks.gather(1, order.unsqueeze(-1).expand(-1, -1, C)).reshape(R, -1)
        v, j = _stable_top(cand, k)                                       # candidates are in index order too
        i = order.gather(1, j // C) * C + j % C
    return (v[0], i[0]) if one else (v, i)


def top_tokens(lp: torch.Tensor, backbone: Backbone, k: int = TOP) -> list[list]:
    """The ``k`` most likely tokens of log-probabilities ``lp`` as trace items: [id, text, probability]."""
    v, i = top_k(lp, k)
    return [[int(t), backbone.token_str(int(t)), round(float(p), 4)] for t, p in zip(i.tolist(), v.exp().tolist())]
