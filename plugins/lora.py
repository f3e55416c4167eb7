"""LoRA on the last decoder layer's attention output projection — the PEMA paper's LoRA baseline.

LoRA (Hu et al., ICLR 2022): a frozen linear map W₀ ∈ R^{d_out×d_in} becomes

    h = W₀·x + ΔW·x,    ΔW = (α / r) · B·A,    A ∈ R^{r×d_in},  B ∈ R^{d_out×r}

with A random (Kaiming-uniform), B = 0 at the start (so the untrained plug-in is the identity) and only A, B
trained. The PEMA paper (Kim et al., NAACL 2024) compares against LoRA applied to the *last* layer's attention
output projection with r = 512 and α = 1; those are the defaults here (r is capped at the hidden size d and at the
projection's own dimensions).

How it is adapted to our decoder-only backbones and to the shared-backbone protocol:
    * Target: ``decoder.layers[L−1].self_attn.o_proj`` (Llama, Gemma 3; ``out_proj``/``dense``/``c_proj`` are
      accepted for other families).
    * Training uses ``peft`` (``LoraConfig`` + ``get_peft_model``, ``target_modules=["self_attn.o_proj"]``), but on
      a private deep copy of the last decoder layer (its hooks cleared), never on the shared backbone: the
      backbone's modules are not replaced even for a moment, so nothing else that uses the backbone while
      LoRA trains can see a half-trained LoRA, and the tied embeddings / GGUF-loaded Gemma are never touched by
      peft. After training, A and B are copied out of the peft layer, the peft model is unloaded
      (``unload()``) and the copy dropped.
    * Only the last layer changes, so the inputs of the last decoder layer (hidden states + the arguments the
      decoder passes it: rotary embeddings, attention mask, positions) are computed once per fixed mini-batch by
      the frozen backbone (``plugins.network.TrainingBatches``, the first time the batch is used, so the budget
      bounds that work too); each training step then runs only [last layer with LoRA → final norm → LM head at
      target positions]. This is exact, not an approximation (tests/test_training_shortcuts.py). LoRA on the last
      layer's o_proj cannot change any position's keys or values, so ``prompt_prefix`` (the shared prompt prefix
      given as the frozen backbone's past) changes nothing it computes, only what a step costs.
    * The training objective is the teacher-forced NLL of the reference target tokens of the memory's samples
      (fixed mini-batches of similar-length samples, their order shuffled every epoch), Adam, early stopping on
      a seeded tenth of the memory's training samples, set aside from training (``NetworkPlugin._data``; never the
      memory's held-out samples, which the evaluation reports on); ``max_minutes`` covers the preparation too.
    * Decoding: a forward hook on the backbone's own o_proj adds (x·Aᵀ·Bᵀ)·(α/r)·σ to the output of the batch
      rows ``rows`` only; σ is the decode-time setting ``scale`` (default 1, not in the paper).
    * Learning rate: 1e-2 (Adam), a named deviation from the PEMA paper's 1e-3 (the preset ``"paper"``). With α = 1
      and r = 512 the scaling α/r is 1/512, so the delta moves slowly: at one epoch of 1,000 WMT pairs on Gemma 3
      270M, lr 1e-2 scored significantly above lr 1e-3, which at that budget was still below the base model
      (BENCHMARKS.md, "Translation quality", row "LoRA lr 1e-2 vs the paper's 1e-3"; ``python -m plugins train …
      --method lora --set lr=…``).
    * The LM head dominates the cost of a step (Gemma's vocabulary is 262k), so the default ``softmax="candidates"``
      (see ``plugins.adapter``) makes LoRA steps several times faster on CPU at the price of a sampled softmax;
      decoding uses every token, and the ``paper`` preset trains with the full softmax.
    * PEFT's own format (``save_peft``; every ``save`` writes it beside the studio's files through the
      ``save_extra_files`` hook, checksummed in ``plugin_config.json``, so the studio's own plug-in folder and an
      export both load with PEFT):
      ``adapter_config.json`` (``LoraConfig`` with r, α, ``target_modules`` = the full module name of the last
      layer's projection in the backbone's model, ``task_type="CAUSAL_LM"``) and ``adapter_model.safetensors``
      (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), so ``PeftModel.from_pretrained(base,
      folder)`` gives the studio's logits outside the studio. PEFT's scaling is α / r as here; the decode setting σ
      has no PEFT counterpart (the export is σ = 1, the default). The studio's own files (``plugin_config.json`` +
      ``plugin_model.safetensors``, keys ``lora_A`` / ``lora_B``) are unchanged, so plug-ins saved before keep
      loading.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from backbone.torch_internals import clear_module_hooks
from ground.errors import UserError
from plugins.base import FitResult
from plugins.card import MethodCard
from plugins.hub import hub_base_model
from plugins.network import (
    NETWORK_ESTIMATE,
    NETWORK_QUICK_SETTINGS,
    Attachment,
    NetworkConfig,
    NetworkPlugin,
    first_tensor,
    replace_first,
    rows_apply,
)
from plugins.registry import register
from plugins.settings import Preset, setting
from plugins.training import BudgetGuard, run_training

OUT_PROJ_NAMES = ("o_proj", "out_proj", "dense", "c_proj")


@dataclass
class LoRAConfig(NetworkConfig):
    rank: int = setting(512, "r (PEMA paper's LoRA baseline), capped at d and the projection's sizes", low=1, high=8192)
    alpha: float = setting(1.0, "α (paper); the delta is scaled by α / r", low=0.0, high=1e6)
    dropout: float = setting(0.0, "LoRA dropout on the projection's input (peft ``lora_dropout``)", low=0.0, high=0.99)
    lr: float = setting(1e-2, "Adam; the PEMA paper's LoRA baseline uses 1e-3 (preset \"paper\"), 1e-2 measured "
                                "better on WMT dev at equal steps (BENCHMARKS.md, \"Translation quality\")",
                        low=0.0, low_open=True, high=1.0)
    max_epochs: int = setting(3, "steps are cheap: only the last layer and the LM head run", low=0, high=1000)

    PRESETS = {
        "paper": Preset({"rank": 512, "alpha": 1.0, "lr": 1e-3, "batch_size": 16, "softmax": "full"},
                        "the PEMA paper's LoRA baseline: r 512, α 1, lr 1e-3 on the last layer's o_proj, batch 16 "
                        "(the paper: 10–30; the shipped default is 8), exact softmax"),
        "quick": Preset({"rank": 64, "softmax": "candidates", "max_epochs": 2, "max_heldout": 16,
                         "max_minutes": 3.0},
                        "a short run for trying the studio: r 64, candidate softmax (much faster steps), 2 epochs, "
                        "at most 3 minutes"),
    }

    def validate(self) -> None:
        super().validate()
        self._check(self.alpha > 0, "LoRA α must be a positive number.")


CARD = MethodCard(
    paper="Hu et al., LoRA: Low-Rank Adaptation of Large Language Models, ICLR 2022 (as the PEMA paper's baseline)",
    estimate=dataclasses.replace(NETWORK_ESTIMATE,
                                 measure_settings={"max_epochs": 1, "max_minutes": 2.5, "patience": 1000}),
    quick_settings={**NETWORK_QUICK_SETTINGS, "rank": 8})


@register(CARD)
class LoRA(NetworkPlugin):
    method = "lora"
    title = "LoRA (last layer's attention output)"
    Config = LoRAConfig
    # Continue training: ``resume_state`` (set before ``fit``; ``training.optimizer_from_tensors``) resumes Adam's
    # moments and the step count from the saved ``optimizer.safetensors``; ``fit`` starts from the plug-in's own
    # A and B, so a loaded plug-in continues where it stopped. ``optimizer_state`` holds the state after ``fit``.
    resumable = True
    resume_state: dict | None = None

    def __init__(self, config: LoRAConfig, backbone, memory_meta: dict | None = None):
        super().__init__(config, backbone, memory_meta)
        proj_name, proj = self.find_out_proj(backbone)
        self.proj_name = proj_name
        d_in, d_out = proj.in_features, proj.out_features
        r = min(config.rank, backbone.hidden_size, d_in, d_out)
        self.rank = r
        g = torch.Generator().manual_seed(config.seed)
        bound = 1.0 / math.sqrt(d_in)  # nn.init.kaiming_uniform_(a=√5), as peft initialises lora_A
        self.lora_A = nn.Parameter((torch.rand(r, d_in, generator=g) * 2 - 1) * bound)
        self.lora_B = nn.Parameter(torch.zeros(d_out, r))

    @property
    def scaling(self) -> float:
        return self.config.alpha / self.rank

    @staticmethod
    def find_out_proj(backbone) -> tuple[str, nn.Linear]:
        attn = getattr(backbone.layers[-1], "self_attn", None)
        if attn is None:
            raise UserError(f"LoRA: the backbone {backbone.name} has no self_attn in its last layer.")
        for name in OUT_PROJ_NAMES:
            m = getattr(attn, name, None)
            if isinstance(m, nn.Linear):
                return f"self_attn.{name}", m
        raise UserError(f"LoRA: no attention output projection ({', '.join(OUT_PROJ_NAMES)}) found in the last "
                        f"layer of {backbone.name}.")

    def _proj(self) -> nn.Linear:
        return self.find_out_proj(self.backbone)[1]

    # --- PEFT's own format ----------------------------------------------------------------------------------
    def peft_module_name(self) -> str:
        """The adapted projection's full module name in the backbone's model (``model.layers.17.self_attn.o_proj``
        for Gemma 3 270M): PEFT's ``target_modules`` and the prefix of its tensor keys."""
        proj = self._proj()
        for name, mod in self.backbone.model.named_modules():
            if mod is proj:
                return name
        raise UserError(f"LoRA: the adapted projection was not found among the modules of {self.backbone.name}.")

    def peft_config(self, base_model_name_or_path: str | None = None):
        """The ``peft.LoraConfig`` that describes this plug-in (same r, α and scaling α / r, one target module)."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.config.alpha, lora_dropout=self.config.dropout,
                          target_modules=[self.peft_module_name()], bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base_model_name_or_path, inference_mode=True)

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """A and B under the keys ``PeftModel.save_pretrained`` writes (adapter name removed)."""
        key = f"base_model.model.{self.peft_module_name()}"
        return {f"{key}.lora_A.weight": self.lora_A.detach().float().cpu().contiguous(),
                f"{key}.lora_B.weight": self.lora_B.detach().float().cpu().contiguous()}

    def save_peft(self, folder: str | Path, base_model_name_or_path: str | None = None) -> list[Path]:
        """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``folder`` (PEFT's layout):
        ``PeftModel.from_pretrained(base_model, folder)`` then computes what this plug-in's rows compute with the
        decode setting ``scale`` = 1. Returns the files written."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.peft_config(base_model_name_or_path).save_pretrained(str(folder))
        save_file(self.peft_state_dict(), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        return [folder / "adapter_config.json", folder / "adapter_model.safetensors"]

    def save_extra_files(self, folder: Path) -> list[str]:
        """Every saved LoRA folder is also a PEFT adapter folder (``Plugin.save`` checksums both files)."""
        return [f.name for f in self.save_peft(folder, hub_base_model(self.backbone_name))]

    # --- decoding -----------------------------------------------------------------------------------------
    def delta(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return F.linear(F.linear(x.float(), self.lora_A), self.lora_B) * (self.scaling * scale)

    def _register_hooks(self, att: Attachment) -> list:
        scale = self._scale_of(att)

        def fn(x, h):
            return h + self.delta(x, scale).to(h.dtype)

        def hook(mod, args, output):
            if scale == 0.0:
                return None
            h = first_tensor(output)
            return replace_first(output, rows_apply(h, args[0], att.rows, fn, att.starts()))

        return [self._proj().register_forward_hook(hook)]

    # --- training -----------------------------------------------------------------------------------------
    def lowest_layer(self) -> int:
        return self.backbone.num_layers - 1

    def fit(self, memory, progress=lambda f, m: None, should_stop=lambda: False) -> FitResult:
        from peft import LoraConfig, get_peft_model

        cfg = self.config
        bb = self.backbone
        torch.manual_seed(cfg.seed)
        self.to(bb.device)
        progress(0.0, "preparing the memory's samples")
        train, held = self._data(memory)
        cand_info = self.prepare_candidates(memory, lambda f, m: progress(0.005 * f, m))
        # fixed length-bucketed batches whose last layer's inputs the frozen backbone computes once, the first time
        # each is used: inside the loop, so the wall-clock budget bounds that work too
        tb, hb = self.training_batches(train), self.training_batches(held)

        # peft on a private copy of the last decoder layer: the shared backbone is never modified.
        holder = nn.Module()
        holder.layer = copy.deepcopy(bb.layers[-1])
        clear_module_hooks(holder.layer)
        for p in holder.layer.parameters():
            p.requires_grad_(False)
        torch.manual_seed(cfg.seed)
        pconf = LoraConfig(r=self.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=[self.proj_name], bias="none")
        pm = get_peft_model(holder, pconf)
        lora_layer = holder.layer.get_submodule(self.proj_name)
        A, B = lora_layer.lora_A["default"], lora_layer.lora_B["default"]
        with torch.no_grad():  # start from this plug-in's own initialisation (B = 0: identity)
            A.weight.copy_(self.lora_A.to(A.weight))
            B.weight.copy_(self.lora_B.to(B.weight))
        trainable = nn.ModuleList([A, B, lora_layer.lora_dropout["default"]])
        params = [A.weight, B.weight]
        counts = {"tokens": 0, "targets": 0, "samples": 0}
        last = {bb.num_layers - 1: holder.layer}

        def loss_of(batch) -> tuple[torch.Tensor, int]:
            h = batch.fc(1, replace=last)
            sel = batch.labels != -100
            return self.target_nll(h[sel], batch.labels[sel]), int(sel.sum())

        history = self.new_history()
        guard = BudgetGuard(trainable, lambda: heldout_loss(), cfg.max_minutes, history, self.method)

        def train_loss(idx):
            guard.before_step()
            batch = tb[int(idx[0])]
            loss, n = loss_of(batch)
            counts["tokens"] += batch.tokens
            counts["targets"] += n
            counts["samples"] += batch.size
            return loss, {}

        def heldout_loss():
            tot, n = 0.0, 0
            with torch.no_grad():
                for i in range(len(hb)):
                    loss, k = loss_of(hb[i])
                    tot += float(loss) * k
                    n += k
            return tot / max(n, 1)

        s = self.loop_settings(len(tb))
        s.batch_size = 1  # one index = one fixed mini-batch of samples
        t0 = time.time()
        resume = (self.resume_state or {}).get("") if self.resume_state else None
        self.optimizer_state = {}
        try:
            summary = run_training(trainable, params, len(tb), train_loss, guard.heldout_loss, s, self.method,
                                   progress, should_stop, history, (0.005, 1.0), resume=resume,
                                   state_out=self.optimizer_state)
            summary = guard.restore(summary)
            with torch.no_grad():
                self.lora_A.copy_(A.weight.detach().float())
                self.lora_B.copy_(B.weight.detach().float())
        finally:
            self._cand = None
            pm.unload()
            del pm, holder, trainable
        wall = time.time() - t0
        for p in self.parameters():
            p.requires_grad_(False)
        metrics = {**summary, "train_samples": len(train), "early_stop_samples": len(held),
                   "entries_per_second": round(counts["samples"] / max(wall, 1e-9), 2),
                   "samples_per_second": round(counts["samples"] / max(wall, 1e-9), 2),
                   "precompute_seconds": round(tb.prepare_seconds + hb.prepare_seconds, 2),
                   "tokens_per_second": round(counts["tokens"] / max(wall, 1e-9), 1),
                   "target_tokens_per_second": round(counts["targets"] / max(wall, 1e-9), 1),
                   "train_tokens_seen": counts["tokens"], "seconds_per_step": round(guard.mean_step(), 2),
                   **tb.info(), "prepare_seconds": round(tb.prepare_seconds + hb.prepare_seconds, 2)}
        self.train_info = {"rank": self.rank, "alpha": cfg.alpha, "scaling": self.scaling,
                           "target": f"layers.{bb.num_layers - 1}.{self.proj_name}", "trained_with": "peft",
                           **cand_info, **metrics}
        return FitResult(metrics=metrics, history=history)
