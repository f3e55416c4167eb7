"""Memory-Tuning (Qi, Liu, Zuo, Li, Chen & Wu, "Memory-Tuning: A Unified Parameter-Efficient Tuning Method for
Pre-trained Language Models", IEEE/ACM TASLP 2024).

The paper's idea: every Transformer block gets learnable memory that its hidden states read by attention, and what
is read is added to the block's representations — at the feed-forward network (MT-F), at the multi-head attention
(MT-M), or at both (MT-MF, the unified method). The paper proves that prefix tuning is one kind of memory tuning
and states MT-M as prefix tuning with l prefix tokens.

Sizes (the paper's Table II, as the issue gives it: l = s = 16, k = 50): s is the slot size d_m (the paper's W_key
and W_value are s × s), l the prefix length of MT-M, k the number of MT-F's memory slots per layer. Deviations from
Table II, named: MT-F run alone keeps s = 16 where the table gives 32 (set ``slot_size=32``); MT-F's s × s matrices
are W_key and W_value (2s², plus W_query, W_o and M) where the table counts 3r²; MT-M trains P̃ directly, without the
table's prefix MLP reparametrisation (m = 768). Learning rate: the paper's 1e-4 is the ``paper`` preset; the shipped
default is the in-network plug-ins' 1e-3 (a CPU run here has a few hundred steps, where 1e-4 moves the weights a
tenth as far; measured: BENCHMARKS.md, "Starts, presets and calibration, checked on WMT dev items", row
"memory-tuning below the base").

Default variant (a departure): MT-F. The paper's unified MT-MF is the ``paper`` preset. MT-M's prefix, initialised
from real tokens' keys and values, starts far from the frozen model and does not recover within the default two
epochs, so MT-MF decoded below the base model; MT-F starts at the frozen model (W_o = 0) and gained on the same
items (BENCHMARKS.md, "Starts, presets and calibration, checked on WMT dev items", row "memory-tuning below the base").

MT-F, per layer (§III; the memory attention is unscaled — no 1/√s —, footnote 2):

    H    = FFN(x)                                          the FFN's OUTPUT (t × d)
    a(H) = softmax( H·W_query · (M·W_key)ᵀ ) ∈ R^{t×k}     M ∈ R^{k×s}, W_query ∈ R^{d×s}, W_key ∈ R^{s×s}
    ΔH   = a(H) · M·W_value · W_o                          W_value ∈ R^{s×s}, W_o ∈ R^{s×d}
    H'   = H + ΔH

by one forward hook on ``layers[l].mlp``: queried with, and added to, the MLP's output (on Gemma 3 the sum then goes
through the block's post-FFN norm, exactly as the MLP's own output does). W_o brings the slot size s back to the
model's width d.

MT-M, per layer: prefix tuning with l prefix tokens — l learned key vectors P_k and value vectors P_v per
key/value head, prepended to the keys and values of the layer's own self-attention (in its post-RoPE key space, and
on Gemma 3 after its k_norm, as prefix tuning through ``past_key_values`` does), so the backbone's own attention —
its heads, its scaling c, its masks — reads them:

    head_i = softmax( c·q_i·[P_k ; K]ᵀ + [log σ ; mask] ) · [P_v ; V]
           = (1 − λ_i)·Attn(q_i, K, V) + λ_i·softmax(c·q_i·P_kᵀ)·P_v       (He et al., ICLR 2022, eq. 6–7)

with the gate λ_i the share of the head's attention on the prefix. The prefix takes no positions: the real tokens
keep theirs (0…T−1), so prompts, masks and KV caches are unchanged. (peft's prefix tuning starts the real tokens at
position l instead; with rotary embeddings that only turns every P_k by a fixed rotation — the same functions.)

Mechanism: a forward pre-hook on ``layers[l].self_attn`` hands the attention a stand-in for ``past_key_values``
(``PrefixKV``) whose ``update`` prepends P_k, P_v to what the real cache (or the new tokens) gives, and an additive
attention mask with l more columns (``prefixed_mask``); the KV cache itself never holds the prefix. In training (all
rows, no cache) that is the attention's one pass. In a comparison batch, where only this method's rows may see the
prefix, every other row must stay bit-identical: at a decode step on the CPU decode attention (bfloat16 or float32,
``plugins.row_keys.RowKeys``) the attention itself computes the other rows as usual and then, for this method's rows,
the attention over [P_k; K] with [log σ; mask] from the same scores — as the mixture above, (1 − λ)·(the row's own
attention, already computed) + λ·softmax(c·q·P_kᵀ + log σ)·P_v with λ the prefix's share of the joint softmax, so its
values are not copied behind the prefix at every step (the trace's last layer keeps the joint softmax itself) — one
attention call per layer, o_proj once.
Elsewhere (prefill, a GPU) the attention first runs as usual (the stand-in records its keys and values) and
a forward hook re-runs it for this method's rows only (``network.sub_batch``: another method's hooks inside the
attention, e.g. LoRA on o_proj, act on none of them) and puts their outputs in place. Needs ``eager`` or ``sdpa``
attention (the project's default).

Adaptations (recorded in ``train_info``):
    * s_l ∈ R^d (a saved buffer, not trained): the per-feature RMS of the MLP output at layer l, measured on the
      memory's training samples before training. MT-F's query reads H ⊘ s_l and its output is s_l ⊙ ΔH — a pure
      re-parametrisation of W_query and W_o (the same functions): Gemma's MLP outputs have an RMS ~0.1 with a few
      features far larger, Llama's differ again, and s_l lets one learning rate fit all.
    * P_k = P̃_k ⊙ r_k and P_v = P̃_v ⊙ r_v, with r_k, r_v the per-feature RMS of the layer's real keys and values
      (saved buffers): again a pure re-parametrisation. ``fit`` initialises P̃ from the keys and values of l random
      real tokens of the training samples (Li & Liang 2021's initialisation with real activations), so MT-M starts
      near the frozen model but — this is prefix tuning — not exactly at it; before ``fit``, P = 0.
    * M ~ N(0, 1); W_o starts at zero, so MT-F is the identity at the start.
    * Decode-time setting ``scale`` σ (not in the paper) multiplies ΔH (MT-F) and the prefix's unnormalised
      attention weights (MT-M: log σ is added to its scores); 1 = as trained, 0 = off (exactly the frozen model).
    * Training softmax over a candidate vocabulary by default (``softmax="candidates"``, ``plugins.adapter``): a
      sampled-softmax approximation of the paper's NLL; decoding uses every token; ``--preset paper`` trains with
      the full softmax.

``network_trace(handles)`` gives, per decoded row, at the newest position of the last layer: MT-F's attention over
its k slots (for MT-M alone: the head-averaged attention within the l prefix slots), and for MT-M / MT-MF
``attention_lambda``, the head-averaged share λ of the attention on the prefix.

Plug-ins saved by the earlier implementation (settings ``query_dim`` / ``key_dim`` / ``slot_dim`` / ``value_dim``:
l and s read as projection sizes, d_m = 64, a 1/√l scaling, MT-F queried with the FFN input, MT-M an output-hook
stand-in) do not fit this layout and are refused on loading with a message to train them again.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from backbone.hf_internals import attn_implementation
from backbone.model import CPU_DECODE_ATTENTION, ROW_ATTENTION
from backbone.padding import PAD_NEUTRAL_SDPA
from backbone.torch_internals import set_unregistered
from ground.errors import UserError
from plugins.base import FitResult
from plugins.card import MethodCard
from plugins.network import (
    NETWORK_ESTIMATE,
    NETWORK_QUICK_SETTINGS,
    Attachment,
    NetworkConfig,
    NetworkPlugin,
    PastPrefix,
    derived,
    first_tensor,
    keep_before,
    module_input,
    replace_first,
    rows_apply,
    sub_batch,
)
from plugins.registry import register
from plugins.row_keys import RowKeys
from plugins.seqtrain import SeqData, collate
from plugins.settings import Preset, setting

VARIANTS = ("MT-F", "MT-M", "MT-MF")
TRACE_TOP = 5
# those that take an additive float mask of any key length (the CPU decode attention adds it as eager does)
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", PAD_NEUTRAL_SDPA, CPU_DECODE_ATTENTION)
LEGACY_SETTINGS = ("query_dim", "key_dim", "slot_dim", "value_dim")


@dataclass
class MemoryTuningConfig(NetworkConfig):
    variant: str = setting(
        "MT-F", "MT-F (FFN memory; the default) | MT-M (attention memory = prefix tuning) | MT-MF (both: the paper's "
        "unified method, preset \"paper\"; its prefix starts far from the frozen model, BENCHMARKS)",
                           choices=("MT-F", "MT-M", "MT-MF"))
    slots: int = setting(50, "k: MT-F's memory slots per layer", low=1, high=4096)
    slot_size: int = setting(16, "s = d_m: the size of a memory slot (W_key, W_value are s × s); Table II: 16 in "
                                 "MT-MF, 32 for MT-F alone", low=1, high=4096)
    prefix_length: int = setting(16, "l: MT-M's prefix tokens per layer (trained directly: no prefix MLP, Table "
                                     "II's m = 768)", low=1, high=4096)
    lr: float = setting(
        1e-3, "Adam. Qi et al. train with 1e-4 (preset \"paper\"); the shipped 1e-3 is the in-network plug-ins' "
        "shared rate for CPU runs of a few hundred steps, not measured against 1e-4 for this method",
        low=0.0, low_open=True, high=1.0)

    PRESETS = {
        "paper": Preset({"variant": "MT-MF", "slots": 50, "slot_size": 16, "prefix_length": 16, "lr": 1e-4,
                         "softmax": "full"},
                        "the paper's Table II sizes: MT-MF with k = 50 slots, s = l = 16, its learning rate 1e-4, "
                        "exact softmax"),
        "quick": Preset({"variant": "MT-F", "slots": 16, "softmax": "candidates", "max_epochs": 1,
                         "max_heldout": 8, "evals_per_epoch": 2, "max_minutes": 3.0},
                        "a short run for trying the studio: MT-F with 16 slots, candidate softmax, 1 epoch, at most "
                        "3 minutes"),
    }

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryTuningConfig":
        old = sorted(k for k in LEGACY_SETTINGS if isinstance(d, dict) and k in d)
        if old:
            raise UserError(
                f"This memory-tuning plug-in (settings {', '.join(old)}) was made by an earlier implementation whose "
                f"memory had another layout (l and s read as projection sizes, d_m = 64, MT-M an output-hook "
                f"stand-in); it cannot be loaded into the paper's layout (slots k, slot_size s, prefix_length l). "
                f"Train it again.")
        return super().from_dict(d)



class SlotMemory(nn.Module):
    """MT-F's memory of one layer: k slots M ∈ R^{k×s} read by unscaled attention (module docstring)."""

    def __init__(self, d: int, k: int, s: int):
        super().__init__()
        self.M = nn.Parameter(torch.randn(k, s))
        self.W_query = nn.Linear(d, s, bias=False)
        self.W_key = nn.Linear(s, s, bias=False)
        self.W_value = nn.Linear(s, s, bias=False)
        self.W_o = nn.Linear(s, d, bias=False)
        nn.init.zeros_(self.W_o.weight)  # the identity at the start

    def read(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ΔH, attention over the slots) for queries ``q`` (..., d), float32:
        softmax(q·W_query·(M·W_key)ᵀ) · M·W_value·W_o, no 1/√s."""
        q = q.float()
        if torch.is_grad_enabled():
            a = torch.softmax(self.W_query(q) @ self.W_key(self.M).T, dim=-1)        # (..., k)
            return self.W_o(a @ self.W_value(self.M)), a
        # Decoding / evaluation: the slot keys and values are constants, so fold them once into two (d×k), (k×d)
        # matrices — the same products, two small matmuls a layer instead of five (they dominate a CPU step).
        qk, vo = self._folded()
        a = torch.softmax(q @ qk, dim=-1)
        return a @ vo, a

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        def build():
            return ((self.W_query.weight.T @ self.W_key(self.M).T).contiguous(),   # (d, k)
                    self.W_o(self.W_value(self.M)).contiguous())                   # (k, d)
        return derived(self, "folded", (self.M, self.W_query.weight, self.W_key.weight, self.W_value.weight,
                                        self.W_o.weight), build)


# --- MT-M: the prefix inside the backbone's own attention -----------------------------------------------------------
class PrefixKV:
    """Stands in for one attention call's ``past_key_values``: ``update`` passes the new keys/values on to the real
    cache (``inner``; none: they are returned as they are) — or returns ``replay`` instead —, records what the
    attention will read (``seen``), and prepends ``prefix`` = (P_k, P_v), each (kv heads, l, head dim), when given."""

    def __init__(self, inner=None, prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                 replay: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.inner, self.prefix, self.replay = inner, prefix, replay
        self.seen: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.replay is not None:
            k, v = self.replay
        elif self.inner is not None:
            k, v = self.inner.update(key_states, value_states, *args, **kwargs)
        else:
            k, v = key_states, value_states
        self.seen = (k, v)
        if self.prefix is None:
            return k, v
        pk, pv = self.prefix
        n = k.shape[0]
        return (torch.cat([pk.to(k.dtype).unsqueeze(0).expand(n, -1, -1, -1), k], dim=2),
                torch.cat([pv.to(v.dtype).unsqueeze(0).expand(n, -1, -1, -1), v], dim=2))

    def __getattr__(self, name):  # anything else the model asks of its cache goes to the real one
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def prefixed_mask(mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, prefix_len: int,
                  allowed: torch.Tensor | None, log_sigma: float, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The additive attention mask (batch, 1, q_len, prefix_len + k_len) over the keys [prefix; context]. Context
    columns: the layer's ``mask`` (None: causal, the queries being the newest q_len of k_len positions; bool: True =
    attend; float: additive). Prefix columns: log σ for the rows in ``allowed`` (a bool (batch,) tensor; None: every
    row), the dtype's minimum (−∞ in effect) for the others."""
    neg = torch.finfo(dtype).min
    if mask is None:
        newest = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        ctx = torch.where(torch.arange(k_len, device=device)[None, :] <= newest, 0.0, neg)
    elif mask.dtype == torch.bool:
        ctx = torch.where(mask[..., :k_len].to(device), 0.0, neg)
    else:
        ctx = mask[..., :k_len].to(device)
    ctx = ctx.to(dtype).expand(batch, 1, q_len, k_len)
    if allowed is None:
        pre = torch.full((batch, 1, q_len, prefix_len), log_sigma, dtype=dtype, device=device)
    else:  # a select, not a boolean-mask assignment: no host read of how many rows are allowed (a CUDA graph's step)
        pre = torch.where(allowed.to(device).view(batch, 1, 1, 1), log_sigma, neg).to(dtype)
        pre = pre.expand(batch, 1, q_len, prefix_len)
    return torch.cat([pre, ctx], dim=-1)


def _batch_rows(value, rows: torch.Tensor, batch: int):
    """A per-batch-row attention argument (a tensor, or a tuple of them — the rotary ``position_embeddings``) cut to
    batch rows ``rows``; one shared by all rows (first dimension 1) or not per row is passed on as it is."""
    if isinstance(value, tuple):
        return tuple(_batch_rows(v, rows, batch) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == batch and batch > 1:
        return value.index_select(0, rows.to(value.device))
    return value


def kv_layout(backbone) -> tuple[int, int]:
    """(key/value heads, head dim) of the backbone's self-attention."""
    attn = getattr(backbone.layers[0], "self_attn", None)
    hd = getattr(attn, "head_dim", None)
    k_proj = getattr(attn, "k_proj", None)
    if attn is None or not hd or not isinstance(k_proj, nn.Linear):
        raise UserError(f"MT-M needs a Llama/Gemma-style self_attn (k_proj, head_dim) in {backbone.name}'s layers.")
    return k_proj.out_features // hd, hd


CARD = MethodCard(
    paper=("Qi et al., Memory-Tuning: A Unified Parameter-Efficient Tuning Method for Pre-trained Language Models, "
           "IEEE/ACM TASLP 2024"),
    estimate=NETWORK_ESTIMATE, quick_settings=NETWORK_QUICK_SETTINGS)


@register(CARD)
class MemoryTuning(NetworkPlugin):
    method = "memory_tuning"
    title = "Memory-Tuning"
    Config = MemoryTuningConfig
    # A decode step on the CPU decode attention hands the prefix to the attention for this method's rows only
    # (``RowKeys``) instead of re-running the attention; an option of the plug-in, so that a test or a benchmark
    # can turn it off on one plug-in to compare the two.
    row_keys_in_attention: bool = True

    def __init__(self, config: MemoryTuningConfig, backbone, memory_meta: dict | None = None):
        super().__init__(config, backbone, memory_meta)
        d, L = backbone.hidden_size, backbone.num_layers
        self.use_ffn = config.variant in ("MT-F", "MT-MF")
        self.use_attn = config.variant in ("MT-M", "MT-MF")
        if self.use_ffn:
            with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
                torch.manual_seed(config.seed)
                self.ffn_mem = nn.ModuleList(SlotMemory(d, config.slots, config.slot_size) for _ in range(L))
            self.register_buffer("ffn_scale", torch.ones(L, d))
        if self.use_attn:
            n_kv, hd = kv_layout(backbone)
            self.prefix_k = nn.Parameter(torch.zeros(L, n_kv, config.prefix_length, hd))  # P̃_k (``fit`` sets it)
            self.prefix_v = nn.Parameter(torch.zeros(L, n_kv, config.prefix_length, hd))  # P̃_v
            self.register_buffer("key_rms", torch.ones(L, n_kv, 1, hd))     # r_k: per-feature RMS of real keys
            self.register_buffer("value_rms", torch.ones(L, n_kv, 1, hd))   # r_v

    def prefix(self, l: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's prefix keys and values P_k = P̃_k ⊙ r_k, P_v = P̃_v ⊙ r_v, each (kv heads, l, head dim); in
        ``dtype`` when given. Without gradients they are constants: computed once per weights (and dtype), not at
        every decode step's layer."""
        if torch.is_grad_enabled():
            pk, pv = self.prefix_k[l] * self.key_rms[l], self.prefix_v[l] * self.value_rms[l]
            return (pk, pv) if dtype is None else (pk.to(dtype), pv.to(dtype))

        pk, pv = self._all_prefixes(dtype)
        return pk[l], pv[l]

    def _all_prefixes(self, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's P_k, P_v (layers, kv heads, l, head dim) without gradients, in ``dtype`` when given."""
        def build():
            pk, pv = self.prefix_k * self.key_rms, self.prefix_v * self.value_rms
            return (pk, pv) if dtype is None else (pk.to(dtype), pv.to(dtype))
        return derived(self, ("prefix", dtype), (self.prefix_k, self.prefix_v, self.key_rms, self.value_rms), build)

    # --- hooks --------------------------------------------------------------------------------------------
    def _register_hooks(self, att: Attachment) -> list:
        if self.use_attn:
            impl = attn_implementation(self.backbone.model) or "eager"
            if impl not in ATTENTION_IMPLEMENTATIONS:
                raise UserError(f"Memory-tuning's MT-M hands its prefix to the attention as extra keys with an "
                                f"additive mask, which needs {' or '.join(ATTENTION_IMPLEMENTATIONS)} attention; "
                                f"{self.backbone.name} uses {impl!r}.")
        handles = []
        L = self.backbone.num_layers
        ffn_folded = (self._ffn_folded(self._scale_of(att)) if self.use_ffn and att.forward_rows is not None
                      else None)  # decoding: the slot reads with their scales folded in, every layer at once
        # decoding on the CPU decode attention: every layer's prefix in the backbone's dtype, looked up once
        row_keys = (self._all_prefixes(self.backbone.dtype) if self.use_attn and self.row_keys_in_attention
                    and att.forward_rows is not None and att.forward_rows.dtype != torch.bool
                    and attn_implementation(self.backbone.model) == CPU_DECODE_ATTENTION
                    else None)
        for l, layer in enumerate(self.backbone.layers):
            trace = att.rows is not None and att.recording and l == L - 1
            shared: dict = {}  # MT-MF: the attention hook leaves λ for the FFN hook's trace of the same layer
            if self.use_attn:
                pre, post = self._prefix_hooks(l, att, trace, shared,
                                               None if row_keys is None else (row_keys[0][l], row_keys[1][l]))
                handles.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(layer.self_attn.register_forward_hook(post, with_kwargs=True))
            if self.use_ffn:
                handles.append(layer.mlp.register_forward_hook(
                    self._ffn_hook(l, att, trace, shared, None if ffn_folded is None else ffn_folded[l])))
        return handles

    def _ffn_hook(self, l: int, att: Attachment, trace: bool, shared: dict,
                  folded: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``folded``: layer l's entry of ``_ffn_folded`` when decoding (None: the read as trained)."""
        mem = self.ffn_mem[l]
        scale = self._scale_of(att)

        def fn(h, _h):
            if folded is None:
                s = self.ffn_scale[l]
                delta, a = mem.read(h.float() / s)         # queried with the FFN's output H (⊘ s_l) ...
                delta = delta * (s * scale)
            else:  # the same, with s_l and σ folded into the read's two products
                a = torch.softmax(h.float() @ folded[0], dim=-1)
                delta = a @ folded[1]
            if trace:
                self._trace_weights(att, l, "ffn", a[:, -1], shared.pop("lambda", None))
            return h + delta.to(h.dtype)  # ... and added to it

        def hook(mod, args, output):
            if scale == 0.0:
                return None
            h = first_tensor(output)
            return replace_first(output, rows_apply(h, h, att.rows, fn, att.starts()))
        return hook

    def _ffn_folded(self, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's slot read for decoding with the query divisor s_l and the output factor s_l·σ folded in:
        softmax((H ⊘ s_l)·QK)·VO ⊙ (s_l·σ) = softmax(H·(QK ⊘ s_l))·(VO ⊙ s_l·σ), QK and VO ``SlotMemory._folded``'s
        (one cache check for all layers: a decode step attaches the hooks anew)."""
        mems, s = self.ffn_mem, self.ffn_scale
        sources = [s, *(t for m in mems for t in (m.M, m.W_query.weight, m.W_key.weight, m.W_value.weight,
                                                   m.W_o.weight))]

        def build():
            out = []
            for l, m in enumerate(mems):
                qk, vo = m._folded()
                out.append(((qk / s[l][:, None]).contiguous(), (vo * (s[l] * scale)).contiguous()))
            return out
        return derived(self, ("ffn", scale), sources, build)

    def _prefix_hooks(self, l: int, att: Attachment, trace: bool, shared: dict,
                      decode_prefix: tuple[torch.Tensor, torch.Tensor] | None = None):
        """MT-M on layer l's self-attention (module docstring): the pre-hook and the forward hook. ``decode_prefix``
        (decoding on the CPU decode attention): the layer's P_k, P_v in the backbone's dtype for ``RowKeys``."""
        scale = self._scale_of(att)
        log_sigma = math.log(scale) if scale > 0 else 0.0
        n_prefix = self.config.prefix_length
        call: dict = {}

        def pre(mod, args, kwargs):
            if scale == 0.0 or (att.rows is not None and att.rows.numel() == 0):
                return None
            x = module_input(args, kwargs)
            starts = att.starts()
            if starts is not None and bool((starts.to(x.device) >= x.shape[1]).all()):
                return None  # only shared prompt prefix positions: the plug-in leaves them to the frozen backbone
            past = kwargs.get("past_key_values")
            if att.rows is None and att.own_from is None and (past is None or isinstance(past, PastPrefix)):
                # training: every row sees the prefix, in the one pass (after a frozen prompt prefix's keys and
                # values when they are the past)
                k_len = x.shape[1] + (past.get_seq_length() if past is not None else 0)
                mask = prefixed_mask(kwargs.get("attention_mask"), x.shape[0], x.shape[1], k_len, n_prefix,
                                     None, log_sigma, x.dtype, x.device)
                return args, {**kwargs, "past_key_values": PrefixKV(past, self.prefix(l)), "attention_mask": mask}
            call["kv"] = PrefixKV(past)  # a plain pass that records the keys/values; ``post`` re-runs it …
            if (decode_prefix is not None and x.shape[1] == 1 and x.dtype == decode_prefix[0].dtype
                    and x.device.type == "cpu"):
                # … unless the CPU decode attention reads the prefix for this method's rows itself
                # (an unregistered attribute: nn.Module's __setattr__ costs more than the rest of this hook)
                call["row_keys"] = RowKeys(att.rows, *decode_prefix, log_sigma, lambda: att.live, keep_probs=trace)
                set_unregistered(mod, ROW_ATTENTION, call["row_keys"])
            return args, {**kwargs, "past_key_values": call["kv"]}

        def post(mod, args, kwargs, output):
            kv, row_keys = call.pop("kv", None), call.pop("row_keys", None)
            if row_keys is not None:
                set_unregistered(mod, ROW_ATTENTION, None)
                if row_keys.done:  # the attention read the prefix for these rows: nothing to re-run
                    if trace and row_keys.probs is not None:
                        got = self._trace_from_probs(row_keys.probs, n_prefix)
                        if not self.use_ffn:
                            self._trace_weights(att, l, "attention", got[0], got[1])
                        else:
                            shared["lambda"] = got[1]
                    return None
            if kv is None or kv.seen is None:
                return None
            keys, values = kv.seen
            x = module_input(args, kwargs)
            rows = None if att.rows is None else att.rows.to(x.device)
            if rows is not None and rows.dtype == torch.bool:
                return self._masked_rerun(mod, args, kwargs, output, x, rows, keys, values, l, att, trace, shared,
                                          log_sigma)
            allowed = None
            if rows is not None:
                allowed = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
                allowed[rows] = True
            mask = None  # the whole batch's prefixed mask: for a re-run of every row, and the trace
            if rows is None or trace:
                mask = prefixed_mask(kwargs.get("attention_mask"), x.shape[0], x.shape[1], keys.shape[-2], n_prefix,
                                     allowed, log_sigma, x.dtype, x.device)
            pk, pv = self.prefix(l)
            h = first_tensor(output)
            starts = att.starts()  # positions of a shared prompt prefix keep the attention without P_k, P_v
            if rows is None:
                redo = first_tensor(mod.forward(*args, **{**kwargs, "attention_mask": mask, "past_key_values":
                                                          PrefixKV(None, (pk, pv), (keys, values))}))
                new = keep_before(redo.to(h.dtype), h, starts)
            else:  # the re-run for this method's rows only: a sub-batch (every other row is kept as it is)
                B = x.shape[0]
                sub_mask = prefixed_mask(_batch_rows(kwargs.get("attention_mask"), rows, B), rows.numel(),
                                         x.shape[1], keys.shape[-2], n_prefix, None, log_sigma, x.dtype, x.device)
                sub_kwargs = {k: _batch_rows(v, rows, B) for k, v in kwargs.items() if k != "cache_position"}
                sub_kwargs.update(attention_mask=sub_mask, past_key_values=PrefixKV(
                    None, (pk, pv), (keys.index_select(0, rows), values.index_select(0, rows))))
                sub_args = (x.index_select(0, rows), *args[1:]) if args else ()
                if "cache_position" in kwargs:
                    sub_kwargs["cache_position"] = kwargs["cache_position"]
                with sub_batch(rows):  # other methods' hooks inside the attention (LoRA) act on none of these rows
                    redo = first_tensor(mod.forward(*sub_args, **sub_kwargs))
                new = h.clone()
                new[rows] = keep_before(redo.to(h.dtype), h.index_select(0, rows), starts)
            if trace:
                got = self._prefix_trace(mod, args, kwargs, rows, keys, mask, pk)
                if got is not None and not self.use_ffn:
                    self._trace_weights(att, l, "attention", got[0], got[1])
                elif got is not None:
                    shared["lambda"] = got[1]
            return replace_first(output, new)

        return pre, post

    def _masked_rerun(self, mod, args, kwargs, output, x, allowed, keys, values, l, att, trace, shared, log_sigma):
        """MT-M's re-run on a row mask (``NetworkPlugin.fixed_rows``): the attention again over every row with the
        prefix allowed for the masked rows only, whose outputs replace theirs — fixed shapes, no index on the host,
        and another method's hooks inside the attention (LoRA on o_proj) act on their own rows as in the first
        run, which the masked rows are not."""
        mask = prefixed_mask(kwargs.get("attention_mask"), x.shape[0], x.shape[1], keys.shape[-2],
                             self.config.prefix_length, allowed, log_sigma, x.dtype, x.device)
        pk, pv = self.prefix(l)
        h = first_tensor(output)
        redo = first_tensor(mod.forward(*args, **{**kwargs, "attention_mask": mask, "past_key_values":
                                                  PrefixKV(None, (pk, pv), (keys, values))}))
        new = torch.where(allowed.view(-1, *(1,) * (h.dim() - 1)), redo.to(h.dtype), h)
        if trace:
            got = self._prefix_trace(mod, args, kwargs, torch.arange(x.shape[0], device=x.device), keys, mask, pk)
            if got is not None and not self.use_ffn:
                self._trace_weights(att, l, "attention", got[0], got[1])
            elif got is not None:
                shared["lambda"] = got[1]
        return replace_first(output, new)

    @staticmethod
    def _trace_from_probs(probs: torch.Tensor, n_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``_prefix_trace``, from the attention weights (rows, KV heads, heads per KV head, prefix + keys) that
        the decode attention kept (``RowKeys.probs``)."""
        p = probs.flatten(1, 2)                                                    # (n, heads, l + K)
        lam = p[..., :n_prefix].sum(-1)
        within = p[..., :n_prefix] / lam.clamp_min(1e-30).unsqueeze(-1)
        return within.mean(1), lam.mean(1)

    @staticmethod
    def _prefix_trace(mod, args, kwargs, rows, keys, mask, pk) -> tuple[torch.Tensor, torch.Tensor] | None:
        """At the newest position of batch rows ``rows``: the head-averaged attention within the prefix slots
        (n, l) and the head-averaged share λ of the attention on the prefix (n,). Recomputes the query as the
        Llama/Gemma attention does (q_proj, q_norm when present, the model's rotary embedding); None when it cannot."""
        pos = kwargs.get("position_embeddings")
        rope = getattr(sys.modules.get(type(mod).__module__), "apply_rotary_pos_emb", None)
        hd = getattr(mod, "head_dim", None)
        if pos is None or rope is None or hd is None or not hasattr(mod, "q_proj"):
            return None
        with torch.no_grad():
            x = module_input(args, kwargs).index_select(0, rows)[:, -1:]
            n = x.shape[0]
            q = mod.q_proj(x).view(n, 1, -1, hd).transpose(1, 2)                    # (n, heads, 1, hd)
            if getattr(mod, "q_norm", None) is not None:
                q = mod.q_norm(q)
            cos, sin = (t[:, -1:] if t.shape[0] == 1 else t.index_select(0, rows)[:, -1:] for t in pos)
            q, _ = rope(q, q, cos, sin)
            kk = torch.cat([pk.to(keys.dtype).unsqueeze(0).expand(n, -1, -1, -1), keys.index_select(0, rows)], 2)
            kk = kk.repeat_interleave(q.shape[1] // kk.shape[1], dim=1)              # (n, heads, l + K, hd)
            scores = (q.float() @ kk.float().transpose(-1, -2))[:, :, 0] * float(mod.scaling)
            p = torch.softmax(scores + mask.index_select(0, rows)[:, :, -1].float(), dim=-1)  # (n, heads, l + K)
            lam = p[..., :pk.shape[1]].sum(-1)                                      # (n, heads)
            within = p[..., :pk.shape[1]] / lam.clamp_min(1e-30).unsqueeze(-1)
        return within.mean(1), lam.mean(1)

    def _trace_weights(self, att: Attachment, l: int, component: str, w: torch.Tensor,
                       lam: torch.Tensor | None = None) -> None:
        """Record, per row, the attention ``w`` (rows, slots) over the slots at the newest position (and λ of MT-M
        when known): kept on the device and read after the forward pass (``_trace_rows``), so that no hook waits for
        a device-to-host copy and a step recorded in a CUDA graph refreshes the very tensors it recorded."""
        att.trace = {"device": (l, component, w.detach().float(), None if lam is None else lam.detach().float())}

    def _trace_rows(self, att: Attachment) -> dict:
        if "device" not in att.trace:
            return super()._trace_rows(att)
        l, component, w, lam = att.trace["device"]
        w = w.cpu()
        lams = lam.cpu().tolist() if lam is not None else [None] * len(w)
        per_row = []
        for row, lv in zip(w, lams):
            top = torch.topk(row, min(TRACE_TOP, row.numel()))
            entry = {"layer": l, "component": component, "weights": [round(float(v), 4) for v in row],
                     "top": [[int(i), round(float(v), 4)] for v, i in zip(top.values, top.indices)]}
            if lv is not None:
                entry["attention_lambda"] = round(lv, 4)
            per_row.append(entry)
        return dict(enumerate(per_row))

    # --- training -----------------------------------------------------------------------------------------
    def calibrate_prefix(self, data: SeqData, n: int = 16) -> None:
        """Set r_k, r_v to the per-feature RMS of every layer's real keys and values (over the real tokens of up to
        ``n`` training samples, floored at 1% of their mean) and P̃_k, P̃_v to the keys and values of l seeded
        random real tokens among them (never a sequence's first token, the usual attention sink) divided by r."""
        bb, cfg = self.backbone, self.config
        L, n_prefix = bb.num_layers, cfg.prefix_length
        idx = list(range(min(n, len(data))))
        lengths = [len(data.contexts[i]) + len(data.targets[i]) - 1 for i in idx]
        tokens = [(i, t) for i in idx for t in range(1, lengths[i])] or [(i, 0) for i in idx]
        pick = np.random.default_rng(cfg.seed).choice(len(tokens), size=n_prefix, replace=len(tokens) < n_prefix)
        chosen = [tokens[j] for j in pick]
        sums: list[list] = [[0.0, 0.0] for _ in range(L)]
        init: list[list] = [[[None] * n_prefix, [None] * n_prefix] for _ in range(L)]
        state: dict = {"count": 0}

        def hooks(l):
            call = {}

            def pre(mod, args, kwargs):
                call["kv"] = PrefixKV(kwargs.get("past_key_values"))
                return args, {**kwargs, "past_key_values": call["kv"]}

            def post(mod, args, kwargs, output):
                m, b0 = state["mask"], state["b0"]
                for j, t in enumerate(call.pop("kv").seen):
                    t = t.detach().float()                                           # (B, kv heads, T, hd)
                    sums[l][j] = sums[l][j] + t.permute(0, 2, 1, 3)[m].pow(2).sum(0)  # (kv heads, hd)
                    for slot, (i, pos) in enumerate(chosen):
                        if b0 <= i < b0 + t.shape[0]:
                            init[l][j][slot] = t[i - b0, :, pos].cpu()                # (kv heads, hd)
            return pre, post

        handles = []
        for l, layer in enumerate(bb.layers):
            pre, post = hooks(l)
            handles.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.self_attn.register_forward_hook(post, with_kwargs=True))
        try:
            with torch.no_grad():
                for b0 in range(0, len(idx), cfg.batch_size):
                    ids, mask, _ = collate(bb, data, idx[b0:b0 + cfg.batch_size])
                    state.update(mask=mask.bool(), b0=b0)
                    state["count"] += int(mask.sum())
                    bb.forward_fc(ids, attention_mask=mask)
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad():
            for l in range(L):
                for j, (rms, par) in enumerate(((self.key_rms, self.prefix_k), (self.value_rms, self.prefix_v))):
                    r = (sums[l][j] / max(state["count"], 1)).sqrt().cpu()
                    r = torch.nan_to_num(r, nan=0.0, posinf=0.0)
                    r = r.clamp_min(max(float(r.mean()) * 1e-2, 1e-6))
                    rms[l].copy_(r.unsqueeze(1).to(rms))
                    real = torch.stack(init[l][j], dim=1)                                   # (kv heads, l, hd)
                    par[l].copy_((real / r.unsqueeze(1)).to(par))

    def fit(self, memory, progress=lambda f, m: None, should_stop=lambda: False) -> FitResult:
        def prepare(train):
            cfg = self.config
            info = {"variant": cfg.variant, "k": cfg.slots, "s": cfg.slot_size, "l": cfg.prefix_length,
                    "ffn_attention_scaling": "none (paper, footnote 2)",
                    "mt_m": "prefix tuning inside the backbone's attention (its own scaling)"}
            if self.use_ffn:
                rms = self.calibrate_rms([ly.mlp for ly in self.backbone.layers], train)
                for l, r in enumerate(rms):
                    if r is not None:
                        self.ffn_scale[l].copy_(r.to(self.ffn_scale))
                info["ffn_scale_rms"] = self.scale_summary(list(self.ffn_scale))
            if self.use_attn:
                self.calibrate_prefix(train)
                info["key_rms"] = self.scale_summary(list(self.key_rms))
                info["value_rms"] = self.scale_summary(list(self.value_rms))
                info["prefix_init"] = "keys/values of l random real tokens of the training samples"
            return info

        return self.fit_sequences(memory, progress, should_stop, prepare)
