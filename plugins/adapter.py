"""Residual adapter (Lin, Madotto & Fung, "Exploring Versatile Generative Language Model via Parameter-Efficient
Transfer Learning", Findings of EMNLP 2020).

Paper (its §2, eq. 1): after the l-th Transformer block, whose output is H ∈ R^{t×d},

    Adapter(H) = ReLU(LN(H) · W_E) · W_D + H,        W_E ∈ R^{d×m},  W_D ∈ R^{m×d}

with LN a layer normalisation with its own (trainable) gain and bias, m the bottleneck size (the paper uses
m = 10…300 depending on the task) and the pretrained model frozen. One adapter per block, trained per task.

Not implemented: the paper's **task embedding** (trained per task alongside the adapters, on the input side of the
model). It is absent here: a plug-in serves one memory, i.e. one task, whose format the few-shot prompt gives, and
only the adapters are trained. This is a deviation from the paper, not an equivalent.

How it is adapted to our decoder-only backbones (Llama, Gemma 3):
    * "after each decoder block" = a forward hook on every ``decoder.layers[l]`` that rewrites its output H (the
      residual stream leaving the block) as H + σ · s_l ⊙ (ReLU(LN(H)·W_E + b_E)·W_D + b_D). W_E and W_D carry
      biases (``nn.Linear``; the paper's equation leaves them out); W_D and b_D start at exactly zero, so the
      untrained adapter is the identity (W_E, LN: PyTorch's default initialisation).
    * s_l ∈ R^d (a saved buffer, not trained; applied element-wise) is the per-feature RMS of H at block l,
      measured once on the memory's training samples before training. Gemma 3's residual stream grows to an RMS
      near 1,400 at the last block, with a few "massive" features hundreds of times larger than the typical ones
      (median |H| ≈ 225 there, 0.6 at block 0), so a raw delta would need W_D entries in the hundreds and Adam
      (whose steps are ~lr in parameter space) could not get there in minutes, while one scalar scale would make
      the typical features move far too fast. W_D·diag(s_l) is a pure re-parametrisation of the paper's W_D (same
      function class): each step changes every feature by an amount relative to its own typical size.
    * σ is the decode-time setting ``scale`` (default 1.0; 0 switches the adapter off) — not in the paper.
    * Training: teacher-forced NLL of the reference target tokens of the memory's samples, the backbone frozen,
      Adam, early stopping on a seeded tenth of the memory's training samples set aside from training (never on
      the memory's held-out samples, which the evaluation reports on; ``plugins.network`` + ``plugins.training``).
      The hooks are attached for each batch's forward pass only (autograd keeps what backward needs), so no hook
      stays on the shared backbone between batches. Logits are computed at target positions only.
    * Not applied to the prompt's shared prefix (``prompt_prefix="frozen"``, the default; a deviation: the paper
      adapts every position): the adapter acts on a sample's own positions, the instruction and few-shot examples
      are the frozen model's, computed once per memory (``plugins.network``; "adapted" = the paper's).
    * ``layers`` (default ``"all"``, the paper's every block): ``"top:N"`` etc. adapt fewer blocks, and training
      runs the frozen blocks below once per batch. Faster, but measured worse (BENCHMARKS.md, "Training
      defaults, decided by measurement", row "fewer adapted layers tried and rejected").
    * ``max_minutes`` bounds the training time; ``BudgetGuard`` evaluates once more just before the budget runs
      out, so a budget-stopped run keeps its last steps (``run_training`` alone restores the last *evaluated* best).
    * Training softmax over a candidate vocabulary by default (``softmax="candidates"``, as PEMA's fast mode): the
      memory's target tokens, the stop tokens and the LM's top tokens on sampled memory contexts instead of all V
      tokens — a sampled-softmax approximation of the paper's NLL (Gemma's LM head is 262k × 640: with every token it
      was a large share of a CPU step). Decoding always uses the full vocabulary. ``softmax="full"`` (and the ``paper``
      preset) is the exact NLL. Measured on held-out data: BENCHMARKS.md, "Training defaults, decided by
      measurement", row "the candidate softmax as the default".

The in-network machinery it shares with LoRA and memory-tuning (hooks restricted to a comparison's batch rows,
sequence-level training) is in ``plugins.network``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plugins.base import FitResult
from plugins.card import MethodCard
from plugins.network import (
    NETWORK_ESTIMATE,
    NETWORK_QUICK_SETTINGS,
    Attachment,
    NetworkConfig,
    NetworkPlugin,
    derived,
    first_tensor,
    parse_layers,
    replace_first,
    rows_apply,
)
from plugins.registry import register
from plugins.settings import Preset, setting


# --- the adapter ------------------------------------------------------------------------------------------------
@dataclass
class AdapterConfig(NetworkConfig):
    bottleneck: int = setting(64, "m (paper: 10–300 per task)", low=1, high=65536)
    ln_eps: float = setting(1e-5)
    layers: str = setting(
        "all", "adapted layers: \"all\" (the paper: after every block) | \"top:N\" | \"bottom:N\" | \"every:K\" | "
        "\"0,4,8\"; with the top layers only, the frozen layers below run once per batch (faster training)")

    PRESETS = {
        "paper": Preset({"bottleneck": 300, "batch_size": 32, "max_epochs": 8, "softmax": "full"},
                        "the paper's NMT setting: m 300, batch 32, 8 epochs, exact softmax (its learning rate is "
                        "not given: the shipped one; max_minutes may stop a CPU run sooner)"),
        "quick": Preset({"bottleneck": 32, "softmax": "candidates", "max_epochs": 1, "max_heldout": 8,
                         "evals_per_epoch": 2, "max_minutes": 3.0},
                        "a short run for trying the studio: m 32, candidate softmax, 1 epoch, at most 3 minutes"),
    }

    def validate(self) -> None:
        super().validate()
        self._check(self.bottleneck <= 4096, "The adapter bottleneck m must be between 1 and 4096.")
        self._check(self.ln_eps > 0, "ln_eps must be positive.")
        parse_layers(self.layers, None)


class LayerAdapters(nn.ModuleDict):
    """The adapters of the adapted layers, indexed by layer number; its state-dict keys (``adapters.<l>.…``) are a
    ``ModuleList``'s over every layer when every layer is adapted, so plug-ins saved before ``layers`` load as
    before."""

    def __getitem__(self, layer) -> "ResidualAdapter":
        return super().__getitem__(str(layer))

    def by_layer(self) -> list[tuple[int, "ResidualAdapter"]]:
        return [(int(k), m) for k, m in self.items()]


class ResidualAdapter(nn.Module):
    """ReLU(LN(H)·W_E + b_E)·W_D + b_D (the delta; the residual H is added by the hook)."""

    def __init__(self, d: int, m: int, eps: float):
        super().__init__()
        self.ln = nn.LayerNorm(d, eps=eps)
        self.W_E = nn.Linear(d, m)
        self.W_D = nn.Linear(m, d)
        nn.init.zeros_(self.W_D.weight)
        nn.init.zeros_(self.W_D.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.W_D(F.relu(self.W_E(self.ln(h))))


CARD = MethodCard(
    paper=("Lin, Madotto & Fung, Exploring Versatile Generative Language Model via Parameter-Efficient Transfer "
           "Learning, Findings of EMNLP 2020"),
    estimate=NETWORK_ESTIMATE, quick_settings=NETWORK_QUICK_SETTINGS)


@register(CARD)
class Adapter(NetworkPlugin):
    method = "adapter"
    title = "Residual adapter"
    Config = AdapterConfig

    def __init__(self, config: AdapterConfig, backbone, memory_meta: dict | None = None):
        super().__init__(config, backbone, memory_meta)
        d, L = backbone.hidden_size, backbone.num_layers
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
            torch.manual_seed(config.seed)
            self.layer_ids = parse_layers(config.layers, L)
            self.adapters = LayerAdapters({str(l): ResidualAdapter(d, config.bottleneck, config.ln_eps)
                                           for l in self.layer_ids})
        self.register_buffer("out_scale", torch.ones(L, d))  # s_l: per-feature RMS of block l's output

    def lowest_layer(self) -> int:
        return min(self.layer_ids)

    def _register_hooks(self, att: Attachment) -> list:
        folded = self._folded_out(self._scale_of(att)) if att.forward_rows is not None else None  # decoding
        return [self.backbone.layers[l].register_forward_hook(self._hook(l, att, None if folded is None else folded[l]))
                for l in self.layer_ids]

    def _hook(self, l: int, att: Attachment, out: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``out``: layer l's W_D, b_D with σ·s_l folded in when decoding (``_folded_out``; None: as trained)."""
        ad = self.adapters[l]
        scale = self._scale_of(att)

        def fn(x, h):
            if out is None:
                delta = ad(x.float()) * (self.out_scale[l] * scale)
            else:  # the same with σ·s_l folded into W_D and b_D
                delta = F.linear(F.relu(ad.W_E(ad.ln(x.float()))), *out)
            return h + delta.to(h.dtype)

        def hook(mod, args, output):
            if scale == 0.0:
                return None
            h = first_tensor(output)
            return replace_first(output, rows_apply(h, h, att.rows, fn, att.starts()))
        return hook

    def _folded_out(self, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's W_D and b_D times σ·s_l, for decoding: (ReLU(…)·W_D + b_D) ⊙ σ·s_l in one product (one
        cache check for all layers: a decode step attaches the hooks anew)."""
        s = self.out_scale
        pairs = self.adapters.by_layer()
        sources = [s, *(t for _, ad in pairs for t in (ad.W_D.weight, ad.W_D.bias))]
        return derived(self, ("out", scale), sources,
                       lambda: {l: (ad.W_D.weight * (s[l] * scale)[:, None], ad.W_D.bias * (s[l] * scale))
                                for l, ad in pairs})

    def fit(self, memory, progress=lambda f, m: None, should_stop=lambda: False) -> FitResult:
        def prepare(train):
            rms = self.calibrate_rms([self.backbone.layers[l] for l in self.layer_ids], train)
            for l, r in zip(self.layer_ids, rms):
                if r is not None:
                    self.out_scale[l].copy_(r.to(self.out_scale))
            return {"out_scale_rms": self.scale_summary([self.out_scale[l] for l in self.layer_ids]),
                    "bottleneck": self.config.bottleneck, "layers": self.layer_ids}

        return self.fit_sequences(memory, progress, should_stop, prepare)
