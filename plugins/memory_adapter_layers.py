"""The memory-augmented adapter's layers (Xu et al.): which phrases go to which layer (``allocate``; the ``layers``
setting's ``parse_layers`` is ``plugins.network``'s), one adapter's attention over its phrase memory and gate
(``MemoryAdapter``), and a layer's adapters for the target and source sides (``LayerBlock``). The plug-in that
trains and attaches them is ``plugins.memory_adapter``."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from backbone.model import PackedBF16Linear, packed_bf16_available


def allocate(lengths: list[int], layers: list[int], how: str = "short_to_long", seed: int = 0
             ) -> dict[int, list[int]]:
    """Spread items (by index) over ``layers`` in equal shares: by length, short to long from the lowest layer up
    (or long to short, or at random). With fewer items than layers, evenly spaced layers get one item each."""
    n = len(lengths)
    if n == 0 or not layers:
        return {}
    if how == "random":
        order = np.random.default_rng(seed).permutation(n)
    else:
        order = np.array(sorted(range(n), key=lambda i: (lengths[i], i)))
    k = min(n, len(layers))
    shares = np.array_split(order, k)
    if k < len(layers):
        chosen = [layers[round(j * (len(layers) - 1) / (k - 1))] for j in range(k)] if k > 1 else [layers[-1]]
    else:
        chosen = list(layers)
    if how == "long_to_short":
        chosen = chosen[::-1]
    return {layer: [int(i) for i in share] for layer, share in sorted(zip(chosen, shares), key=lambda x: x[0])}


class MemoryAdapter(nn.Module):
    """One memory-augmented adapter (see the module docstring for the equations)."""

    def __init__(self, d: int, gate_bias: float, g: torch.Generator):
        super().__init__()
        self.d = d
        self.W_q = nn.Parameter(torch.eye(d))
        self.W_k = nn.Parameter(torch.eye(d))
        self.W_v = nn.Parameter(torch.eye(d))
        bound = 1.0 / math.sqrt(2 * d)
        self.W_1 = nn.Parameter((torch.rand(2 * d, d, generator=g) * 2 - 1) * bound)
        self.W_2 = nn.Parameter(torch.zeros(d, 1))
        self.b_2 = nn.Parameter(torch.full((1,), float(gate_bias)))

    def prepare(self, mem: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
        """Per-forward products of the memory: (W_q·W_kᵀ·Kᵀ/(T√d), V·W_v, V·W_v·W_1[d:], W_1[:d])."""
        k = mem @ self.W_k
        qk = (self.W_q @ k.T) / (temperature * math.sqrt(self.d))
        v = mem @ self.W_v
        # one split of W_1 for both halves: its backward is one concatenation, where two slices would each
        # zero-fill a gradient of W_1's whole size
        w1a, w1b = self.W_1.split(self.d)
        return qk, v, v @ w1b, w1a

    def forward(self, x: torch.Tensor, prep, exclude: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` (B, T, d) is both the anchor A and the query Q; ``exclude`` (B, n) True removes item j from row b's
        attention (a training sample's own sentence; a row must keep at least one item)."""
        qk, v, vw, w1a = prep
        logits = x @ qk
        if exclude is not None:
            logits = logits.masked_fill(exclude[:, None, :], float("-inf"))
        att = torch.softmax(logits, dim=-1)
        r = att @ v
        h = F.relu(x @ w1a + att @ vw)  # [A; R]·W_1 with R·W_1b = att·(V·W_v·W_1b)
        g = torch.sigmoid(h @ self.W_2 + self.b_2)
        return g * x + (1 - g) * r, att, g

    def decode_prep(self, mem: torch.Tensor, temperature: float, scale: torch.Tensor, dtype: torch.dtype) -> tuple:
        """``prepare``'s products folded for decoding on unscaled states A·s (``LayerBlock.decode``): with x = A·s,
        x·(W_q·W_kᵀ·Kᵀ/(T√d·s)) are the same logits, x·(W_1[:d]/s) the same gate input, and att·[s·V·W_v;
        V·W_v·W_1[d:]] gives s·R and R·W_1[d:] in one product, so the gate's g·A + (1−g)·R comes out times s. In a
        bfloat16 backbone W_1[:d]/s is packed for oneDNN's bfloat16 linear (bfloat16 inputs and weights, float32
        accumulation: the backbone's own linears' arithmetic): the adapter's one large product (d×d, 1.6 MB in
        float32, read twice per layer and step), the largest part of a memory-adapter row's hook time in float32
        (BENCHMARKS.md, "Decode time per token"). Returns (logit matrix, value matrix, anchor product, W_2, b_2)."""
        qk, v, vw, w1a = self.prepare(mem, temperature)
        w1a = w1a / scale
        if dtype == torch.bfloat16 and w1a.device.type == "cpu" and packed_bf16_available():
            lin = nn.Linear(self.d, self.d, bias=False)
            lin.weight = nn.Parameter(w1a.T.to(torch.bfloat16).contiguous(), requires_grad=False)
            packed = PackedBF16Linear(lin)
            anchor = lambda x: packed(x.to(torch.bfloat16)).float()  # noqa: E731
        else:
            anchor = lambda x: x @ w1a  # noqa: E731
        return qk / scale, torch.cat([v * scale, vw], 1), anchor, self.W_2.detach(), self.b_2.detach()

    @staticmethod
    def decode(x: torch.Tensor, prep: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` on x = A·s with ``decode_prep``'s folded products (no exclusion: decoding), output times s."""
        qk, values, anchor, w2, b2 = prep
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        att = torch.softmax(x @ qk, dim=-1)
        rv = att @ values
        d = x.shape[-1]
        h = F.relu(anchor(x).add_(rv[:, d:]))
        g = torch.sigmoid(torch.addmm(b2, h, w2))
        out = torch.lerp(rv[:, :d], x, g)  # g·x + (1 − g)·s·R
        return out.view(shape), att.view(*shape[:-1], -1), g.view(*shape[:-1], 1)


class LayerBlock(nn.Module):
    """The memory of one layer (both sides, divided by the layer scale) and its adapters."""

    def __init__(self, d: int, n: int, sides: tuple[str, ...], gate_bias: float, g: torch.Generator):
        super().__init__()
        self.register_buffer("mem_tgt", torch.zeros(n, d))
        self.register_buffer("mem_src", torch.zeros(n, d))
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("phrase_ids", torch.zeros(n, dtype=torch.long))
        self.sides = sides
        self.adapters = nn.ModuleDict({s: MemoryAdapter(d, gate_bias, g) for s in sides})

    def prepare(self, temperature: float) -> dict:
        return {s: self.adapters[s].prepare(getattr(self, f"mem_{s}"), temperature) for s in self.sides}

    def decode_prep(self, temperature: float, dtype: torch.dtype) -> dict:
        return {s: self.adapters[s].decode_prep(getattr(self, f"mem_{s}"), temperature, self.scale, dtype)
                for s in self.sides}

    def decode(self, a: torch.Tensor, prep: dict):
        """``apply`` for decoding (no memory dropout, no exclusion) with ``decode_prep``'s products: the layer scale
        is folded into them, so the states go through unscaled."""
        out = a.float()
        info = {}
        for s in self.sides:
            out, att, g = MemoryAdapter.decode(out, prep[s])
            info[s] = (att, g)
        return out.to(a.dtype), info

    def apply(self, a: torch.Tensor, prep: dict, keep: torch.Tensor | None = None,
              exclude: torch.Tensor | None = None):
        """Adapt self-attention outputs ``a`` (B, T, d); ``keep`` (B,) False drops this layer's memory; ``exclude``
        (B, n) True hides item j from row b (a row that would have no item left drops this layer's memory)."""
        x = a.float() / self.scale
        out = x
        info = {}
        if exclude is not None:
            empty = exclude.all(-1)
            exclude = exclude & ~empty[:, None]  # no all-masked softmax (NaN): such a row skips the layer instead
            keep = ~empty if keep is None else keep & ~empty
        for s in self.sides:
            o, att, g = self.adapters[s](out, prep[s], exclude)
            if keep is not None:
                o = torch.where(keep.view(-1, 1, 1), o, out)
            out = o
            info[s] = (att, g)
        return (out * self.scale).to(a.dtype), info
