"""Memory-Tuning (Qi, Liu, Zuo, Li, Chen & Wu, "Memory-Tuning: A Unified Parameter-Efficient Tuning Method for
Pre-trained Language Models", IEEE/ACM TASLP 2024).

The paper's idea: every Transformer block gets a small set of learnable memory slots that the hidden states query
by attention, and the retrieved content is added to the block's representations — at the feed-forward network
(MT-F), at the multi-head attention (MT-M), or at both (MT-MF, the unified method). The paper also shows that
prefix tuning is one kind of memory tuning. Per layer and per component:

    M ∈ R^{k×d_m}                                  k learnable memory slots of size d_m
    a(H) = softmax( (H·W_query) · (M·W_key)ᵀ / √l ) ∈ R^{t×k}      W_query ∈ R^{d×l}, W_key ∈ R^{d_m×s}, l = s
    ΔH   = a(H) · M·W_value · W_o                  W_value ∈ R^{d_m×d_v}, W_o ∈ R^{d_v×d}

Sizes. The issue gives the paper's sizes as "l = s = 16, k = 50 slots". We read l and s as the low dimensions of the
query projection (W_query: d → l) and of the key projection (W_key: d_m → s) — they meet in a dot product, so they
must be equal (checked) — and k as the number of slots. d_m (``slot_dim``) and d_v (``value_dim``) are not given;
we use 64 each.

MT-F (FFN memory), adapted to decoder-only backbones: H is the input of the block's MLP (already normalised by the
block's pre-FFN norm) and ΔH is added to the MLP's output, by one forward hook on ``layers[l].mlp``. On Gemma 3
the sum then goes through the block's post-FFN norm, exactly as the MLP's own output does.

MT-M (attention memory) — via the unified view of prefix tuning (He et al., "Towards a Unified View of
Parameter-Efficient Transfer Learning", ICLR 2022, eq. 6–7): attention over [P_k; C·W_k] with prefix keys/values
P_k, P_v equals

    head = (1 − λ(x)) · Attn(x W_q, C W_k, C W_v) + λ(x) · softmax(x W_q P_kᵀ) P_v,
    λ(x) = Σ_i exp(x W_q P_kᵀ)_i / ( Σ_i exp(x W_q P_kᵀ)_i + Σ_j exp(x W_q W_kᵀ Cᵀ)_j ).

We do not touch the KV cache: a forward hook on ``layers[l].self_attn`` (whose output is a tuple, the first element
the attention output after the output projection) rewrites that output o as

    o' = o + λ(x) · ( s_l · MemAttn(x) − o )   =   (1 − λ(x))·o + λ(x)·s_l·MemAttn(x)

where x is the self-attention's input (the normalised hidden state), MemAttn(x) = a(x)·M·W_value·W_o is the memory
read above (the output projection of the attention is linear, so it folds into W_o), and, since the context's
log-partition Σ_j exp(x W_q W_kᵀ Cᵀ)_j is not visible from an output hook, it is modelled by a learned linear
function z(x) = x̂·w_z + b_z:  λ(x) = tanh(g) · sigmoid( logsumexp_i(score_i(x)) − z(x) ). The scalar gate g
starts at 0 — the zero-init tanh gating of LLaMA-Adapter (Zhang et al., 2023), which makes the untrained MT-M exactly
the identity (and, as there, lets the gate turn negative). He et al.'s λ is per head, ours is per token (one for
all heads).

Further adaptations (all recorded in ``train_info``):
    * Queries use the RMS-normalised input x̂ = x / rms(x) (parameter-free), so the softmax temperature does not
      depend on the backbone's norm gains.
    * s_l ∈ R^d (a saved buffer, not trained) is the per-feature RMS of the hooked module's output at layer l,
      measured on the memory's training samples before training; the memory's output is s_l ⊙ ΔH. Gemma's MLP
      outputs have an RMS ~0.1 and its attention outputs ~1, Llama's differ again, and a few features are far
      larger than the rest; s_l makes one learning rate fit all (a pure re-parametrisation of W_o).
    * W_o of MT-F starts at zero (identity at start); W_o of MT-M is small random, its gate g is zero.
    * Decode-time setting ``scale`` σ multiplies ΔH (MT-F) and λ (MT-M); 1 = as trained, 0 = off.

``network_trace(handles)`` gives, per decoded row, the last layer's attention over its k FFN memory slots (the attention
memory's for MT-M) at the newest position, for the Studio's heat map.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from plugins.base import FitResult
from plugins.network import (
    Attachment,
    NetworkConfig,
    NetworkPlugin,
    first_tensor,
    module_input,
    replace_first,
    rows_apply,
)
from plugins.registry import register
from plugins.settings import setting

VARIANTS = ("MT-F", "MT-M", "MT-MF")
TRACE_TOP = 5


@dataclass
class MemoryTuningConfig(NetworkConfig):
    variant: str = setting("MT-MF", "MT-F (FFN memory) | MT-M (attention memory, prefix-style) | MT-MF (both)")
    slots: int = setting(50, "k memory slots per layer and component")
    query_dim: int = setting(16, "l: W_query maps d → l")
    key_dim: int = setting(16, "s: W_key maps d_m → s (must equal l)")
    slot_dim: int = setting(64, "d_m")
    value_dim: int = setting(64, "d_v")

    def validate(self) -> None:
        super().validate()
        self._check(self.variant in VARIANTS, f"variant must be one of {', '.join(VARIANTS)} (got {self.variant!r}).")
        self._check(1 <= self.slots <= 4096, "The number of memory slots k must be between 1 and 4096.")
        for name in ("query_dim", "key_dim", "slot_dim", "value_dim"):
            self._check(1 <= getattr(self, name) <= 4096, f"{name} must be between 1 and 4096.")
        self._check(self.query_dim == self.key_dim,
                    f"query_dim (l = {self.query_dim}) and key_dim (s = {self.key_dim}) must be equal: the query "
                    f"and key projections meet in a dot product.")


def rms_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class SlotMemory(nn.Module):
    """k learnable slots M with query/key/value/output projections; gated (prefix-style) when ``gated``."""

    def __init__(self, d: int, cfg: MemoryTuningConfig, gated: bool):
        super().__init__()
        k, dm, l, dv = cfg.slots, cfg.slot_dim, cfg.query_dim, cfg.value_dim
        self.M = nn.Parameter(torch.randn(k, dm))
        self.W_query = nn.Linear(d, l, bias=False)
        self.W_key = nn.Linear(dm, l, bias=False)
        self.W_value = nn.Linear(dm, dv, bias=False)
        self.W_o = nn.Linear(dv, d, bias=False)
        self.temp = 1.0 / math.sqrt(l)
        self.gated = gated
        if gated:
            nn.init.normal_(self.W_o.weight, std=1.0 / math.sqrt(dv))
            self.g = nn.Parameter(torch.zeros(()))       # zero-init gate: identity at the start
            self.w_z = nn.Parameter(torch.zeros(d))      # z(x) = x̂·w_z + b_z models the context's log-partition
            self.b_z = nn.Parameter(torch.zeros(()))
        else:
            nn.init.zeros_(self.W_o.weight)

    def read(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(memory output ΔH, attention weights over slots, their scores, normalised x̂), all float32."""
        xh = rms_normalize(x.float())
        if torch.is_grad_enabled():
            scores = (self.W_query(xh) @ self.W_key(self.M).T) * self.temp       # (..., k)
            a = torch.softmax(scores, dim=-1)
            return self.W_o(a @ self.W_value(self.M)), a, scores, xh
        # Decoding / evaluation: the slot keys and values are constants, so fold them once into two (d×k), (k×d)
        # matrices — the same products, two small matmuls a layer instead of six (they dominate a CPU step).
        qk, vo = self._folded()
        scores = xh @ qk
        a = torch.softmax(scores, dim=-1)
        return a @ vo, a, scores, xh

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        ver = tuple(p._version for p in (self.M, self.W_query.weight, self.W_key.weight, self.W_value.weight,
                                         self.W_o.weight)) + (self.M.device, self.M.data_ptr())
        cache = getattr(self, "_fold_cache", None)
        if cache is None or cache[0] != ver:
            with torch.no_grad():
                qk = (self.W_query.weight.T @ self.W_key(self.M).T * self.temp).contiguous()   # (d, k)
                vo = self.W_o(self.W_value(self.M)).contiguous()                                # (k, d)
            cache = (ver, qk, vo)
            self._fold_cache = cache
        return cache[1], cache[2]

    def gate(self, scores: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
        z = xh @ self.w_z + self.b_z
        return torch.tanh(self.g) * torch.sigmoid(torch.logsumexp(scores, dim=-1) - z)    # (...,)


@register
class MemoryTuning(NetworkPlugin):
    method = "memory_tuning"
    title = "Memory-Tuning"
    paper = ("Qi et al., Memory-Tuning: A Unified Parameter-Efficient Tuning Method for Pre-trained Language Models, "
             "IEEE/ACM TASLP 2024")
    Config = MemoryTuningConfig

    def __init__(self, config: MemoryTuningConfig, backbone, memory_meta: dict | None = None):
        super().__init__(config, backbone, memory_meta)
        d, L = backbone.hidden_size, backbone.num_layers
        self.use_ffn = config.variant in ("MT-F", "MT-MF")
        self.use_attn = config.variant in ("MT-M", "MT-MF")
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
            torch.manual_seed(config.seed)
            if self.use_ffn:
                self.ffn_mem = nn.ModuleList(SlotMemory(d, config, gated=False) for _ in range(L))
            if self.use_attn:
                self.attn_mem = nn.ModuleList(SlotMemory(d, config, gated=True) for _ in range(L))
        if self.use_ffn:
            self.register_buffer("ffn_scale", torch.ones(L, d))
        if self.use_attn:
            self.register_buffer("attn_scale", torch.ones(L, d))

    # --- hooks --------------------------------------------------------------------------------------------
    def _register_hooks(self, att: Attachment) -> list:
        handles = []
        L = self.backbone.num_layers
        for l, layer in enumerate(self.backbone.layers):
            trace = att.rows is not None and l == L - 1
            if self.use_ffn:
                handles.append(layer.mlp.register_forward_hook(self._ffn_hook(l, att, trace), with_kwargs=True))
            if self.use_attn:
                handles.append(layer.self_attn.register_forward_hook(
                    self._attn_hook(l, att, trace and not self.use_ffn, trace), with_kwargs=True))
        return handles

    def _ffn_hook(self, l: int, att: Attachment, trace: bool):
        mem = self.ffn_mem[l]
        scale = self._scale_of(att)

        def fn(x, h):
            out, a, _, _ = mem.read(x)
            if trace:
                self._trace_weights(att, l, "ffn", a, getattr(att, "pending_lambda", None))
            return h + (out * (self.ffn_scale[l] * scale)).to(h.dtype)

        def hook(mod, args, kwargs, output):
            if scale == 0.0:
                return None
            h = first_tensor(output)
            return replace_first(output, rows_apply(h, module_input(args, kwargs, "x"), att.rows, fn))
        return hook

    def _attn_hook(self, l: int, att: Attachment, trace: bool, trace_lambda: bool):
        mem = self.attn_mem[l]
        scale = self._scale_of(att)

        def fn(x, h):
            out, a, scores, xh = mem.read(x)
            lam = (mem.gate(scores, xh) * scale).unsqueeze(-1)
            if trace:
                self._trace_weights(att, l, "attention", a, lam)
            elif trace_lambda:  # MT-MF: the FFN hook of this layer (it runs next) records it with its weights
                att.pending_lambda = lam
            return h + (lam * (out * self.attn_scale[l] - h.float())).to(h.dtype)

        def hook(mod, args, kwargs, output):
            if scale == 0.0:
                return None
            h = first_tensor(output)
            return replace_first(output, rows_apply(h, module_input(args, kwargs), att.rows, fn))
        return hook

    def _trace_weights(self, att: Attachment, l: int, component: str, a: torch.Tensor,
                       lam: torch.Tensor | None = None) -> None:
        """Record, per row, the attention over the slots at the newest position (and MT-M's λ when known)."""
        w = a[:, -1, :].detach().float().cpu()
        lams = lam[:, -1, 0].detach().float().cpu().tolist() if lam is not None else [None] * len(w)
        per_row = []
        for row, lv in zip(w, lams):
            top = torch.topk(row, min(TRACE_TOP, row.numel()))
            entry = {"layer": l, "component": component, "weights": [round(float(v), 4) for v in row],
                     "top": [[int(i), round(float(v), 4)] for v, i in zip(top.values, top.indices)]}
            if lv is not None:
                entry["attention_lambda"] = round(lv, 4)
            per_row.append(entry)
        self._record(att, per_row)

    # --- training -----------------------------------------------------------------------------------------
    def fit(self, memory, progress=lambda f, m: None, should_stop=lambda: False) -> FitResult:
        def prepare(train):
            info = {"variant": self.config.variant, "slots": self.config.slots, "l": self.config.query_dim,
                    "s": self.config.key_dim, "slot_dim": self.config.slot_dim, "value_dim": self.config.value_dim}
            layers = list(self.backbone.layers)
            mods = ([ly.mlp for ly in layers] if self.use_ffn else []) + \
                   ([ly.self_attn for ly in layers] if self.use_attn else [])
            rms = self.calibrate_rms(mods, train)
            L = len(layers)
            for name, part in (("ffn_scale", rms[:L] if self.use_ffn else None),
                               ("attn_scale", rms[-L:] if self.use_attn else None)):
                if part is None:
                    continue
                buf = getattr(self, name)
                for l, r in enumerate(part):
                    if r is not None:
                        buf[l].copy_(r.to(buf))
                info[name + "_rms"] = self.scale_summary(list(buf))
            return info

        return self.fit_sequences(memory, progress, should_stop, prepare)
