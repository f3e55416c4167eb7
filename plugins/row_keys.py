"""Memory-tuning's prefix read inside the CPU decode attention: the backbone's row-attention hook
(``backbone.cpu_attention.RowAttention``) for that method's rows of a comparison batch."""
from __future__ import annotations

from typing import Callable

import torch


class RowKeys:
    """Extra keys and values that only some batch rows' attention reads, in one decode step of one layer: prefix
    tuning's P_k, P_v (memory-tuning's MT-M) for that method's rows of a comparison batch. Set as the attention
    module's ``backbone.cpu_attention.ROW_ATTENTION`` attribute for the call; ``cpu_decode_attention`` computes the
    other rows exactly as
    without it and then, for ``rows``, the attention over [keys; the row's own keys] with the additive mask
    [log_weight; the row's mask] — from the very scores every row got, as the mixture of the rows' own attention
    and the prefix's by the prefix's share of the softmax (:meth:`attend`) — and puts those rows' outputs in place
    (before the module's ``o_proj``, which then runs once for all rows). ``done`` tells the caller
    the attention took it (otherwise it must do the work itself); ``probs`` keeps the rows' attention weights
    (rows, KV heads, heads per KV head, prefix + keys) in float32 when ``keep_probs``."""

    def __init__(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, log_weight: float,
                 live: Callable[[], bool] = lambda: True, keep_probs: bool = False):
        self.rows, self.keys, self.values, self.log_weight = rows, keys, values, log_weight
        self.live, self.keep_probs = live, keep_probs
        self.done, self.probs = False, None

    def _at(self, device: torch.device) -> slice | torch.Tensor:
        """``rows`` as an index: a lone row as a slice (a view), else the row tensor on ``device``."""
        r = self.rows
        return slice(int(r[0]), int(r[0]) + 1) if r.numel() == 1 else r.to(device)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """``rows`` of a per-batch-row tensor: a lone row as a view, else a copy."""
        at = self._at(t.device)
        return t[at] if isinstance(at, slice) else t.index_select(0, at)

    def attend(self, out: torch.Tensor, q: torch.Tensor, ctx: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``ctx``: ``rows``' scaled, masked scores over their own keys (``_decode_scores``), as the attention
        computes them for every row."""
        n = self.rows.numel()
        _, Hkv, G, D = q.shape
        l, C = self.keys.shape[1], value.shape[2]
        at = self._at(out.device)
        qr = self.take(q)
        pk = self.keys.to(qr.dtype)
        # 3-D products (same bits as the 4-D broadcast matmul, which first copied the expanded operand)
        pre = torch.bmm(qr.transpose(0, 1).reshape(Hkv, n * G, D), pk.transpose(1, 2))
        pre = pre.view(Hkv, n, G, l).transpose(0, 1) * scale + self.log_weight  # (n, Hkv, G, l)
        if self.keep_probs:  # the trace: the softmax over [prefix; keys] itself, and its product
            vr = self.take(value)
            probs = torch.softmax(torch.cat([pre.to(ctx.dtype), ctx], dim=-1), dim=-1, dtype=torch.float32)
            self.probs = probs
            vv = torch.cat([self.values.to(value.dtype).unsqueeze(0).expand(n, -1, -1, -1), vr], dim=2)
            out[at] = torch.bmm(probs.to(value.dtype).reshape(n * Hkv, G, l + C),
                                vv.reshape(n * Hkv, l + C, D)).view(n, Hkv, G, D)  # into the attention's product
            self.done = True
            return out
        # Otherwise the same attention as a mixture (He et al. 2022, eq. 6-7): the rows' attention over their own keys
        # is ``out`` already, so (1 − λ)·out + λ·softmax(pre)·P_v with λ = sigmoid(lse(pre) − lse(ctx)), the
        # prefix's share of the softmax over [pre; ctx]. The same function, without copying the rows' values behind
        # the prefix at every layer and step (those copies were most of this hook's cost).
        pre = pre.float()
        lse_pre = torch.logsumexp(pre, dim=-1, keepdim=True)
        share = torch.sigmoid(lse_pre - torch.logsumexp(ctx.float(), dim=-1, keepdim=True))  # (n, Hkv, G, 1)
        read = torch.matmul(torch.exp(pre - lse_pre).to(value.dtype), self.values.to(value.dtype))  # (n, Hkv, G, D)
        out[at] = torch.lerp(out[at].float(), read.float(), share).to(out.dtype)
        self.done = True
        return out
