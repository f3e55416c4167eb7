"""PEMA: Plug-in External Memory Adaptation (Kim et al., NAACL 2024), with Gradual Unrolling.

Model (paper §3, public code ``pema``):
    h_rct = B_rct · A · f(c),   h_pd = B_pd · A · f(c),   A ∈ R^{r×d}, B_rct, B_pd ∈ R^{d×r}
    P_PEMA(w|c) = softmax(W_hd · norm(h_pd))   with the backbone's frozen final norm and LM head W_hd.
Training:
    phase 1 (initial reconstruction): A, B_rct minimise MSE(h_rct, f(c));
    phase 2 (joint retraining): A re-initialised, B_rct frozen; A, B_pd minimise κ·L_rct + (1−κ)·L_pd,
    L_pd the cross-entropy of P_PEMA against the memory's value y.
Decoding:
    P = λ_t·P_PEMA + (1−λ_t)·P_LM, mixed in log space with logsumexp.
    Gradual Unrolling (paper): SL = token length of the input sentence (instruction excluded), SS = λ_max/SL,
    CS starts at λ_max and falls by SS after each generated token; λ_t = CS² while CS > 0, else 0.
    ``gu_variant="code"`` is the public code's schedule: the first token mixes with λ_max unsquared, tokens
    1..SL−1 use CS², and after SL tokens λ_t = ``gu_floor`` (default 0). With GU off λ_t = λ_max.

Adaptations, all recorded in the plug-in's ``train_info``:
    * f(c) is divided by the memory's key RMS (``key_scale``) before the adapter. Gemma 3's pre-norm states have
      an RMS near 1,300; raw, the reconstruction MSE (~1e5) swamps L_pd at κ = 0.2. The final RMSNorm is scale
      invariant, so P_PEMA is the paper's formula on the rescaled input.
    * ``softmax="candidates"`` (fast CPU training): L_pd's softmax runs over a candidate vocabulary — every
      token that occurs as a memory value plus the LM's top tokens on a sample of memory contexts — instead of
      all V tokens; at decode P_PEMA is then restricted to the same candidates, so training and decoding agree.
      ``softmax="full"`` is the exact method.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plugins.base import FitResult, MixInput, Plugin, PluginConfig, mix_logprobs  # noqa: F401 (re-export)
from plugins.registry import register
from plugins.training import LoopSettings, candidate_vocabulary, run_training


@dataclass
class PEMAConfig(PluginConfig):
    rank: int = 512            # r (paper/code: 512), capped at the hidden size d
    kappa: float = 0.2         # κ weight of L_rct in the joint phase
    lr: float = 1e-3           # Adam, β (0.9, 0.999), eps 1e-8
    dropout: float = 0.2       # on the adapter input
    batch_size: int = 256
    max_epochs_rct: int = 10
    max_epochs_joint: int = 20
    patience: int = 2
    lr_schedule: str = "constant"   # "constant" (paper) | "cosine"
    softmax: str = "candidates"     # "candidates" (fast) | "full" (exact)
    candidate_top_k: int = 16       # LM top tokens per sampled context added to the candidates
    candidate_contexts: int = 2048  # how many memory contexts to sample for the LM's top tokens
    max_minutes: float = 10.0       # wall-clock budget per phase (0 = none)
    normalize_input: bool = True    # divide f(c) by the memory's key RMS
    # joint-phase start: "random" (paper: A re-initialised, B_pd fresh) | "rct" (A re-initialised, B_pd = B_rct)
    # | "warm" (A kept, B_pd = B_rct: P_PEMA starts at the reconstruction's P, close to P_LM)
    pd_init: str = "random"
    decode_vocab: str = "candidates"  # after candidate training, P_PEMA over "candidates" | "full" vocabulary
    rct_init: str = "random"        # phase-1 start: "random" (paper) | "pca" (the linear autoencoder's optimum)
    seed: int = 123

    def validate(self) -> None:
        self._check(self.rank >= 1, "PEMA rank r must be ≥ 1.")
        self._check(0.0 <= self.kappa <= 1.0, "κ must be in [0, 1].")
        self._check(self.lr > 0, "The learning rate must be positive.")
        self._check(0.0 <= self.dropout < 1.0, "Dropout must be in [0, 1).")
        self._check(self.batch_size >= 1, "The batch size must be ≥ 1.")
        self._check(self.softmax in ("candidates", "full"), "softmax must be 'candidates' or 'full'.")
        self._check(self.decode_vocab in ("candidates", "full"), "decode_vocab must be 'candidates' or 'full'.")
        self._check(self.rct_init in ("random", "pca"), "rct_init must be 'random' or 'pca'.")
        self._check(self.pd_init in ("random", "rct", "warm"), "pd_init must be 'random', 'rct' or 'warm'.")
        self._check(self.lr_schedule in ("constant", "cosine"), "lr_schedule must be 'constant' or 'cosine'.")


def gu_lambda(step: int, lambda_max: float, src_len: int, gu: bool = True, variant: str = "paper",
              floor: float = 0.0) -> float:
    """λ_t of Gradual Unrolling after ``step`` generated tokens (see the module docstring)."""
    if not gu:
        return lambda_max
    sl = max(1, int(src_len))
    ss = lambda_max / sl
    cs = lambda_max - step * ss
    if variant == "code":
        if step == 0:
            return lambda_max
        return cs * cs if step < sl and cs > 0 else floor
    return cs * cs if cs > 1e-12 else 0.0


@register
class PEMA(Plugin):
    method = "pema"
    title = "PEMA (+ Gradual Unrolling)"
    paper = "Kim et al., PEMA: An Offsite-Tunable Plug-in External Memory Adaptation for Language Models, NAACL 2024"
    Config = PEMAConfig
    level = "output"
    interpolates = True
    decode_defaults = {"lambda_max": 0.8, "gu": True, "gu_variant": "paper", "gu_floor": 0.0}

    def __init__(self, config: PEMAConfig, backbone, memory_meta: dict | None = None):
        super().__init__(config, backbone, memory_meta)
        d = backbone.hidden_size
        r = min(config.rank, d)
        self.rank = r
        g = torch.Generator().manual_seed(config.seed)
        self.A = nn.Parameter(self._init(r, d, g))
        self.B_rct = nn.Parameter(self._init(d, r, g))
        self.B_pd = nn.Parameter(self._init(d, r, g))
        self.register_buffer("key_scale", torch.tensor(float((memory_meta or {}).get("key_rms", 1.0))))
        self.register_buffer("candidates", torch.zeros(0, dtype=torch.long))
        self.drop = nn.Dropout(config.dropout)

    @staticmethod
    def _init(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
        # nn.Linear's default (Kaiming-uniform, a=√5): bound 1/√fan_in, as the public code's Linear layers.
        bound = 1.0 / np.sqrt(cols)
        return (torch.rand(rows, cols, generator=g) * 2 - 1) * bound

    @classmethod
    def build_for_load(cls, config, backbone, memory_meta, extra, tensors):
        p = cls(config, backbone, memory_meta)
        p.candidates = torch.zeros_like(tensors["candidates"])
        return p

    # --- model ------------------------------------------------------------------------------------
    def scaled(self, fc: torch.Tensor) -> torch.Tensor:
        x = fc.float()
        return x / self.key_scale if self.config.normalize_input else x

    def h_rct(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B_rct)

    def h_pd(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B_pd)

    def _pd_logits(self, h_pd: torch.Tensor, cand: torch.Tensor | None) -> torch.Tensor:
        bb = self.backbone
        normed = bb.final_norm(h_pd.to(bb.dtype)).float()
        w = bb.lm_head.weight if cand is None else bb.lm_head.weight[cand]
        logits = normed @ w.float().T
        if bb.softcap:
            logits = torch.tanh(logits / bb.softcap) * bb.softcap
        return logits

    # --- training ---------------------------------------------------------------------------------
    def fit(self, memory, progress=lambda f, m: None, should_stop=lambda: False) -> FitResult:
        cfg = self.config
        bb = self.backbone
        dev = bb.device  # train where the frozen head lives (a GPU when there is one)
        self.to(dev)
        torch.manual_seed(cfg.seed)
        self.key_scale.fill_(memory.key_scale if cfg.normalize_input else 1.0)
        keys, values = memory.keys, np.asarray(memory.values, dtype=np.int64)
        hk, hv = memory.heldout_keys, np.asarray(memory.heldout_values, dtype=np.int64)
        if len(hk) == 0:  # tiny memories: early-stop on a slice of the training entries
            cut = max(1, len(keys) // 10)
            hk, hv = keys[-cut:], values[-cut:]
        hx = self.scaled(torch.from_numpy(np.asarray(hk, dtype=np.float32)).to(dev))
        hy = torch.from_numpy(hv).to(dev)

        if cfg.softmax == "candidates":
            progress(0.0, "choosing the candidate vocabulary")
            self.candidates = candidate_vocabulary(bb, memory, cfg.candidate_top_k, cfg.candidate_contexts,
                                                   cfg.seed).to(dev)
            remap = torch.full((bb.vocab_size,), -1, dtype=torch.long, device=dev)
            remap[self.candidates] = torch.arange(len(self.candidates), device=dev)
            cand = self.candidates
        else:
            self.candidates = torch.zeros(0, dtype=torch.long, device=dev)
            remap, cand = None, None

        def batch(idx):
            x = self.scaled(torch.from_numpy(np.asarray(keys[idx], dtype=np.float32)).to(dev))
            y = torch.from_numpy(values[idx]).to(dev)
            return x, y

        def target(y):
            return remap[y] if remap is not None else y

        history: list[dict] = []
        loop = dict(lr=cfg.lr, batch_size=cfg.batch_size, patience=cfg.patience, lr_schedule=cfg.lr_schedule,
                    max_minutes=cfg.max_minutes, seed=cfg.seed)

        # Phase 1: initial reconstruction (A, B_rct).
        if cfg.rct_init == "pca":
            # A bias-free linear autoencoder's optimum is the projection on the top-r right singular vectors of
            # the keys (Eckart–Young): start phase 1 there instead of at random.
            progress(0.03, "initialising the reconstruction from the keys' principal directions")
            pick = np.sort(np.random.default_rng(cfg.seed).choice(len(keys), size=min(len(keys), 20000),
                                                                 replace=False))
            _, _, vt = torch.linalg.svd(self.scaled(torch.from_numpy(np.asarray(keys[pick], dtype=np.float32))
                                                    .to(dev)), full_matrices=False)
            with torch.no_grad():
                self.A.copy_(vt[:self.rank])
                self.B_rct.copy_(vt[:self.rank].T)
        self.B_pd.requires_grad_(False)

        def rct_loss(idx):
            x, _ = batch(idx)
            loss = F.mse_loss(self.h_rct(self.drop(x)), x)
            return loss, {"l_rct": loss.detach()}

        def rct_heldout():
            with torch.no_grad():
                return float(F.mse_loss(self.h_rct(hx), hx))

        s1 = run_training(self, [self.A, self.B_rct], len(keys), rct_loss, rct_heldout,
                          LoopSettings(max_epochs=cfg.max_epochs_rct, **loop), "reconstruction", progress,
                          should_stop, history, (0.05, 0.3))

        # Phase 2: joint retraining. Re-initialise A, freeze B_rct, train A and B_pd.
        with torch.no_grad():
            g = torch.Generator().manual_seed(cfg.seed + 1)
            if cfg.pd_init != "warm":
                self.A.copy_(self._init(self.rank, bb.hidden_size, g).to(dev))
            if cfg.pd_init in ("rct", "warm"):  # start B_pd at the reconstruction decoder
                self.B_pd.copy_(self.B_rct)
        self.B_rct.requires_grad_(False)
        self.B_pd.requires_grad_(True)
        kappa = cfg.kappa

        def joint_parts(x_in, x, y):
            a = F.linear(x_in, self.A)
            l_rct = F.mse_loss(F.linear(a, self.B_rct), x)
            l_pd = F.cross_entropy(self._pd_logits(F.linear(a, self.B_pd), cand), target(y))
            return kappa * l_rct + (1 - kappa) * l_pd, l_rct, l_pd

        def joint_loss(idx):
            x, y = batch(idx)
            loss, l_rct, l_pd = joint_parts(self.drop(x), x, y)
            return loss, {"l_rct": l_rct.detach(), "l_pd": l_pd.detach()}

        def joint_heldout():
            with torch.no_grad():
                tot = 0.0
                for b0 in range(0, len(hx), 1024):
                    x, y = hx[b0:b0 + 1024], hy[b0:b0 + 1024]
                    tot += float(joint_parts(x, x, y)[0]) * len(x)
                return tot / len(hx)

        s2 = run_training(self, [self.A, self.B_pd], len(keys), joint_loss, joint_heldout,
                          LoopSettings(max_epochs=cfg.max_epochs_joint, **loop), "joint", progress,
                          should_stop, history, (0.3, 1.0))
        for p in self.parameters():
            p.requires_grad_(False)
        metrics = {"reconstruction": s1, "joint": s2, "heldout_entries": int(len(hx)),
                   "train_entries": int(len(keys)), "candidates": int(len(self.candidates)) or bb.vocab_size}
        self.train_info = {"softmax": cfg.softmax, "normalize_input": cfg.normalize_input, "pd_init": cfg.pd_init, "rct_init": cfg.rct_init,
                           "decode_vocab": cfg.decode_vocab,
                           "key_scale": float(self.key_scale), "lr_schedule": cfg.lr_schedule, **metrics}
        return FitResult(metrics=metrics, history=history)

    # --- decoding ---------------------------------------------------------------------------------
    def validate_settings(self, s: dict) -> None:
        PluginConfig._check(0.0 <= float(s["lambda_max"]) <= 1.0, "λ_max must be in [0, 1].")
        PluginConfig._check(s["gu_variant"] in ("paper", "code"), "gu_variant must be 'paper' or 'code'.")

    def extra_states(self, fc: torch.Tensor, settings: list[dict]) -> torch.Tensor:
        return self.h_pd(self.scaled(fc))

    def head_vocab(self) -> torch.Tensor | None:
        restricted = len(self.candidates) and self.config.decode_vocab == "candidates"
        return self.candidates if restricted else None

    def pema_logprobs_from_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """log P_PEMA from W_hd·norm(h_pd) logits (restricted to the candidates when trained that way)."""
        if len(self.candidates) and self.config.decode_vocab == "candidates":
            masked = torch.full_like(logits, float("-inf"))
            masked[:, self.candidates] = logits[:, self.candidates]
            logits = masked
        return torch.log_softmax(logits, dim=-1)

    def pema_logprobs(self, fc: torch.Tensor) -> torch.Tensor:
        """log P_PEMA(·|c) for pre-norm states f(c) (n, d) — outside a decode."""
        with torch.no_grad():
            fc = fc.to(self.backbone.device)
            return self.pema_logprobs_from_logits(self.backbone.logits_from_fc(self.h_pd(self.scaled(fc))))

    def plugin_logprobs(self, inp: MixInput) -> tuple[torch.Tensor, None]:
        return self.pema_logprobs_from_logits(inp.extra_logits), None

    def mix_lambdas(self, inp: MixInput) -> list[float]:
        return [gu_lambda(inp.step, float(s["lambda_max"]), sl, bool(s["gu"]), s["gu_variant"], float(s["gu_floor"]))
                for s, sl in zip(inp.settings, inp.src_len)]

    def distribution_key(self, settings: dict) -> tuple:
        return ()  # P_PEMA depends on f(c) only; λ_max and GU set λ_t
