"""Each method against its paper's (or public code's) equations, on tiny examples whose expected values are
computed here by hand — never by calling the project's own helper for the same quantity — and chosen so that a
plausible wrong variant (κ swapped, no α/r, dropout on the wrong tensor, exp(+d/T), mixing logits instead of
probabilities, ...) fails.

The last section holds the faithfulness checks that are not equations (no leakage of held-out samples into PEMA's
training, the FAISS index cache key, the exact re-rank, float16 key overflow).
"""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backbone.prompts import Prompt
from memories.build import build_memory, heldout_split
from memories.parse import Sample
from memories.store import Memory
from plugins.base import MixInput
from plugins.knn import KNN, KNNConfig
from plugins.pema import PEMA, PEMAConfig

pytestmark = pytest.mark.equations

PROMPT = Prompt.for_task("translation")


# --- helpers written from the equations (not from the project's code) ---------------------------------------------

def rms_norm_by_hand(tiny, h: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm: w ⊙ h / sqrt(mean(h²) + ε)."""
    norm = tiny.final_norm
    return norm.weight.float() * h / torch.sqrt((h * h).mean(-1, keepdim=True) + norm.variance_epsilon)


def head_by_hand(tiny, h: torch.Tensor) -> torch.Tensor:
    """W_hd · norm(h) (the tiny Llama has no logit soft-cap)."""
    return rms_norm_by_hand(tiny, h) @ tiny.lm_head.weight.float().T


def pema_with_random_weights(tiny, seed=0, **cfg) -> PEMA:
    p = PEMA(PEMAConfig(**cfg), tiny, {"key_rms": 1.0})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in (p.A, p.B_rct, p.B_pd):
            w.copy_(torch.randn(w.shape, generator=g))
    return p.to(tiny.device)


def public_code_gu(lambda_max: float, sl: int, p: float, steps: int) -> list[float]:
    """agwaBom/PEMA generation/utils.py: mix with lambda_apply, then ``if lambda_current - lambda_step > 0:
    lambda_current -= lambda_step; lambda_apply = lambda_current**2/y + (y-1)/y`` with y = 1/(1 − p·0.01)."""
    y = 1 / (1 - Fraction(p) / 100)
    current = apply = Fraction(lambda_max)
    step = Fraction(lambda_max) / sl
    out = []
    for _ in range(steps):
        out.append(float(apply))
        if current - step > 0:
            current -= step
            apply = current ** 2 / y + (y - 1) / y
    return out


# --- PEMA ---------------------------------------------------------------------------------------------------------

def test_pema_init_is_the_public_codes_lora_init(tiny):
    """LoraLinear.reset_parameters: A ~ kaiming_uniform_(a=√5) (bound 1/√d_in), B = 0 — for B_rct and B_pd."""
    d = tiny.hidden_size
    p = PEMA(PEMAConfig(rank=16, seed=7), tiny, {"key_rms": 1.0})
    assert torch.count_nonzero(p.B_rct) == 0 and torch.count_nonzero(p.B_pd) == 0
    assert p.A.abs().max() <= 1 / math.sqrt(d) and p.A.abs().max() > 0.5 / math.sqrt(d)
    # the option that keeps the earlier random start is a named deviation
    q = PEMA(PEMAConfig(rank=16, seed=7, b_init="random"), tiny, {"key_rms": 1.0})
    assert torch.count_nonzero(q.B_rct) == q.B_rct.numel()


@pytest.mark.parametrize("rank, alpha", [(16, 1.0), (16, 4.0), (1000, 1.0)])
def test_pema_alpha_over_r_scales_both_outputs(tiny, rank, alpha):
    """result = x·Aᵀ·B_pdᵀ·(α/r), r_result = x·Aᵀ·(α/r) → h_rct = r_result·B_rctᵀ; r capped at d."""
    p = pema_with_random_weights(tiny, rank=rank, lora_alpha=alpha)
    r = min(rank, tiny.hidden_size)
    x = torch.randn(5, tiny.hidden_size, device=tiny.device)
    s = alpha / r
    A, B_rct, B_pd = p.A.detach(), p.B_rct.detach(), p.B_pd.detach()
    with torch.no_grad():
        assert torch.allclose(p.h_pd(x), (x @ A.T @ B_pd.T) * s, rtol=1e-5, atol=1e-5)
        assert torch.allclose(p.h_rct(x), ((x @ A.T) * s) @ B_rct.T, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(p.h_pd(x), x @ A.T @ B_pd.T, rtol=1e-3)  # the factor is really there


def test_p_pema_is_softmax_of_the_frozen_head_on_the_normed_h_pd(tiny):
    """P_PEMA(w|c) = softmax(W_hd · norm(h_pd)), h_pd = (α/r)·B_pd·A·(f(c)/key_rms)."""
    p = PEMA(PEMAConfig(rank=16, decode_vocab="full"), tiny, {"key_rms": 2.5})
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in (p.A, p.B_pd):
            w.copy_(torch.randn(w.shape, generator=g))
    p.to(tiny.device)
    fc = torch.randn(4, tiny.hidden_size, generator=g).to(tiny.device) * 3
    h = (fc / 2.5) @ p.A.detach().T @ p.B_pd.detach().T * (1.0 / 16)
    want = torch.log_softmax(head_by_hand(tiny, h), -1)
    assert torch.allclose(p.pema_logprobs(fc), want, atol=1e-4)


def test_joint_loss_is_kappa_rct_plus_one_minus_kappa_pd(tiny):
    """Phase 2: L = κ·MSE(h_rct, x) + (1−κ)·CE(softmax(W_hd·norm(h_pd)), y)."""
    kappa = 0.2
    p = pema_with_random_weights(tiny, rank=8, kappa=kappa, dropout=0.0)
    p.eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, tiny.hidden_size, generator=g).to(tiny.device)
    y = torch.randint(0, tiny.vocab_size, (6,), generator=g).to(tiny.device)
    s = 1.0 / 8
    A, B_rct, B_pd = p.A.detach(), p.B_rct.detach(), p.B_pd.detach()
    l_rct = (((x @ A.T * s) @ B_rct.T - x) ** 2).mean()
    logp = torch.log_softmax(head_by_hand(tiny, x @ A.T @ B_pd.T * s), -1)
    l_pd = -logp[torch.arange(6), y].mean()
    assert abs(float(l_rct) - float(l_pd)) > 0.1  # so that swapping κ would show
    with torch.no_grad():
        total, got_rct, got_pd = p.joint_losses(x, y)
    assert float(got_rct) == pytest.approx(float(l_rct), rel=1e-4)
    assert float(got_pd) == pytest.approx(float(l_pd), rel=1e-4)
    assert float(total) == pytest.approx(float(kappa * l_rct + (1 - kappa) * l_pd), rel=1e-4)
    assert float(total) != pytest.approx(float((1 - kappa) * l_rct + kappa * l_pd), rel=1e-3)


def test_dropout_acts_on_the_adapter_input_only(tiny):
    """LoraLinear.forward: lora_dropout(x) @ Aᵀ ...; the reconstruction target is the clean x."""
    p = pema_with_random_weights(tiny, rank=8, dropout=0.5)
    assert isinstance(p.drop, nn.Dropout) and p.drop.p == 0.5
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(4, tiny.hidden_size, generator=g) > 0.5).float().to(tiny.device)

    class FixedMask(nn.Module):  # a dropout whose mask we know
        def forward(self, t):
            return t * mask / 0.5

    p.drop = FixedMask()
    p.train()
    x = torch.randn(4, tiny.hidden_size, generator=g).to(tiny.device)
    y = torch.randint(0, tiny.vocab_size, (4,), generator=g).to(tiny.device)
    xd = x * mask / 0.5
    A, B_rct, B_pd = p.A.detach(), p.B_rct.detach(), p.B_pd.detach()
    l_rct = (((xd @ A.T / 8) @ B_rct.T - x) ** 2).mean()
    l_pd = F.cross_entropy(head_by_hand(tiny, xd @ A.T @ B_pd.T / 8), y)
    with torch.no_grad():
        assert float(p.rct_loss(x)) == pytest.approx(float(l_rct), rel=1e-4)
        _, got_rct, got_pd = p.joint_losses(x, y)
    assert float(got_rct) == pytest.approx(float(l_rct), rel=1e-4)
    assert float(got_pd) == pytest.approx(float(l_pd), rel=1e-4)


def test_phase_two_reinitialises_a_freezes_b_rct_and_trains_a_and_b_pd(tiny, tiny_memory, monkeypatch):
    import plugins.pema as pema_mod

    real = pema_mod.run_training
    calls = []

    def spy(module, params, *args, **kw):
        params = list(params)
        names = {n for n, q in module.named_parameters() if q.requires_grad and any(q is t for t in params)}
        start = {n: q.detach().clone() for n, q in module.named_parameters()}
        out = real(module, params, *args, **kw)
        calls.append((names, start, {n: q.detach().clone() for n, q in module.named_parameters()}))
        return out

    monkeypatch.setattr(pema_mod, "run_training", spy)
    seed, rank = 5, 16
    cfg = PEMAConfig(rank=rank, seed=seed, lr=1e-2, batch_size=32, max_epochs_rct=2, max_epochs_joint=2,
                     patience=99, dropout=0.0)
    PEMA(cfg, tiny, {"key_rms": tiny_memory.key_scale}).fit(tiny_memory)
    (names1, start1, end1), (names2, start2, end2) = calls
    assert names1 == {"A", "B_rct"} and names2 == {"A", "B_pd"}
    assert torch.count_nonzero(start1["B_rct"]) == 0 and torch.count_nonzero(start2["B_pd"]) == 0  # B = 0
    # A re-initialised: a fresh kaiming_uniform_(a=√5) draw (generator seed+1), not phase 1's trained A
    fresh = torch.empty(rank, tiny.hidden_size)
    nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed + 1))
    assert torch.allclose(start2["A"].cpu(), fresh, atol=1e-7)
    assert not torch.allclose(start2["A"], end1["A"])
    # B_rct frozen at phase 1's result
    assert torch.equal(start2["B_rct"], end1["B_rct"]) and torch.equal(end2["B_rct"], end1["B_rct"])
    # both A and B_pd move although B_pd starts at 0
    assert not torch.equal(end2["A"], start2["A"]) and torch.count_nonzero(end2["B_pd"]) > 0


# --- the mix and Gradual Unrolling ----------------------------------------------------------------------------------

def test_pema_mix_is_lambda_p_pema_plus_one_minus_lambda_p_lm_with_gu(tiny):
    """P = λ_t·P_PEMA + (1−λ_t)·P_LM (probabilities, not logits), λ_t = (λ_max − t·λ_max/SL)² (paper GU)."""
    p = PEMA(PEMAConfig(rank=8, decode_vocab="full"), tiny, {"key_rms": 1.0}).to(tiny.device)
    g = torch.Generator().manual_seed(4)
    lm = torch.log_softmax(torch.randn(2, tiny.vocab_size, generator=g) * 3, -1).to(tiny.device)
    ex = (torch.randn(2, tiny.vocab_size, generator=g) * 3).to(tiny.device)
    sl, lam_max, step = 5, 0.6, 2
    settings = [p.settings({"lambda_max": lam_max, "gu": True})] * 2
    out = p.mix(MixInput(fc=torch.zeros(2, tiny.hidden_size, device=tiny.device), lm_logprobs=lm, extra_logits=ex,
                         step=step, src_len=[sl, sl], settings=settings))
    lam = (lam_max - step * lam_max / sl) ** 2
    want = torch.log(lam * torch.softmax(ex, -1) + (1 - lam) * lm.exp())
    assert out.lam == pytest.approx([lam, lam])
    assert torch.allclose(out.logprobs, want, atol=1e-5)
    assert not torch.allclose(out.logprobs, lam * torch.log_softmax(ex, -1) + (1 - lam) * lm, atol=1e-2)


def test_gradual_unrolling_paper_by_hand(tiny):
    """Paper §3.3: SS = λ_max/SL, CS_t = λ_max − t·SS, λ_t = CS_t² while CS_t > 0, then 0."""
    p = PEMA(PEMAConfig(rank=8), tiny, {"key_rms": 1.0})
    for lam_max, sl in ((0.8, 4), (0.9, 7), (0.3, 2)):
        s = p.settings({"lambda_max": lam_max, "gu": True})
        for t in range(sl + 3):
            inp = MixInput(fc=None, lm_logprobs=None, extra_logits=None, step=t, src_len=[sl], settings=[s])
            cs = lam_max - t * (lam_max / sl)
            assert p.mix_lambdas(inp)[0] == pytest.approx(cs * cs if cs > 1e-9 else 0.0, abs=1e-12)
        off = p.settings({"lambda_max": lam_max, "gu": False})
        assert p.mix_lambdas(MixInput(None, None, None, 3, [sl], [off]))[0] == lam_max


@pytest.mark.parametrize("lam_max, src, pct", [(0.8, 3, 0.0), (0.9, 5, 25.0), (0.5, 2, 50.0)])
def test_gradual_unrolling_code_variant_by_hand(tiny, lam_max, src, pct):
    """The public code's loop, with its SL = instruction + source + "German:" + reference tokens; a decode has no
    reference, so the source's length stands in for it (documented in plugins/pema.py)."""
    p = PEMA(PEMAConfig(rank=8), tiny, {"key_rms": 1.0, "prompt": PROMPT.to_dict()})
    sl = len(tiny.encode_target(PROMPT.template.format(src=""))) + src + src
    want = public_code_gu(lam_max, sl, pct, sl + 3)
    s = p.settings({"lambda_max": lam_max, "gu": True, "gu_variant": "code", "gu_min": pct})
    got = [p.mix_lambdas(MixInput(None, None, None, t, [src], [s]))[0] for t in range(sl + 3)]
    assert got == pytest.approx(want, abs=1e-12)


# --- kNN-LM / kNN-MT ------------------------------------------------------------------------------------------------

def test_knn_distribution_and_mix_by_hand(tiny, tiny_memory):
    """p_kNN(y) ∝ Σ_{j ∈ kNN, v_j = y} exp(−d_j/T), d = squared L2 (keys and query divided by the key RMS);
    P = λ·p_kNN + (1−λ)·P_LM."""
    knn = KNN(KNNConfig(search="exact"), tiny)
    knn.fit(tiny_memory)
    rms = tiny_memory.key_scale
    keys = np.asarray(tiny_memory.keys, dtype=np.float64) / rms
    vals = np.asarray(tiny_memory.values)
    rng = np.random.default_rng(0)
    q_raw = np.asarray(tiny_memory.keys[5], dtype=np.float64) + rng.normal(0, 0.3 * rms, keys.shape[1])
    k, T, lam = 8, 2.0, 0.3
    d = ((keys - q_raw / rms) ** 2).sum(1)
    nn_ids = np.argsort(d, kind="stable")[:k]
    w = np.exp(-d[nn_ids] / T)
    p_knn = np.zeros(tiny.vocab_size)
    for j, wj in zip(nn_ids, w):
        p_knn[vals[j]] += wj
    p_knn /= p_knn.sum()
    assert len(set(vals[nn_ids].tolist())) < k  # some neighbours share a token: their weights must add up
    assert len(set(vals[nn_ids].tolist())) > 1 and d[nn_ids].max() - d[nn_ids].min() > 0.5 * T

    q = torch.tensor(q_raw, dtype=torch.float32, device=tiny.device)[None]
    lp, dist, _ = knn.knn_logprobs(q, k, T)
    assert np.allclose(lp.exp().cpu().numpy()[0], p_knn, atol=1e-4)
    assert np.allclose(dist.cpu().numpy()[0], d[nn_ids], rtol=1e-3, atol=1e-3)

    lm = torch.log_softmax(torch.randn(1, tiny.vocab_size, generator=torch.Generator().manual_seed(0)), -1)
    s = knn.settings({"k": k, "temperature": T, "lambda": lam})
    out = knn.mix(MixInput(fc=q, lm_logprobs=lm.to(tiny.device), extra_logits=None, step=0, src_len=[3],
                           settings=[s]))
    want = np.log(lam * p_knn + (1 - lam) * lm.exp().numpy()[0])
    assert np.allclose(out.logprobs.cpu().numpy()[0], want, atol=1e-4)


# --- residual adapter and LoRA -------------------------------------------------------------------------------------

def test_residual_adapter_is_h_plus_relu_ln_h_we_wd(tiny):
    """Lin et al. 2020 eq. 1: Adapter(H) = ReLU(LN(H)·W_E)·W_D + H; the project adds biases and a fixed per-feature
    scale s_l (documented re-parametrisation): H + s_l ⊙ (ReLU(LN(H)·W_E + b_E)·W_D + b_D)."""
    from plugins.adapter import Adapter, AdapterConfig
    from plugins.network import Attachment

    ad = Adapter(AdapterConfig(bottleneck=8), tiny, {})
    g = torch.Generator().manual_seed(6)
    H = torch.randn(2, 3, tiny.hidden_size, generator=g) * 4
    a = ad.adapters[0]
    with torch.no_grad():
        a.W_D.weight.copy_(torch.randn(a.W_D.weight.shape, generator=g))
        a.ln.weight.copy_(1 + 0.1 * torch.randn(tiny.hidden_size, generator=g))
        a.ln.bias.copy_(0.1 * torch.randn(tiny.hidden_size, generator=g))
    ad.to(tiny.device)
    H = H.to(tiny.device)

    def by_hand(H):
        mu = H.mean(-1, keepdim=True)
        var = ((H - mu) ** 2).mean(-1, keepdim=True)
        ln = (H - mu) / torch.sqrt(var + a.ln.eps) * a.ln.weight + a.ln.bias
        return torch.relu(ln @ a.W_E.weight.T + a.W_E.bias) @ a.W_D.weight.T + a.W_D.bias

    hook = ad._hook(0, Attachment(None, {"scale": 1.0}))
    with torch.no_grad():
        # the paper's equation exactly: no biases, s_l = 1
        a.W_E.bias.zero_(), a.W_D.bias.zero_(), ad.out_scale.fill_(1.0)
        assert torch.allclose(hook(None, (H,), (H,))[0], H + by_hand(H), atol=1e-4)
        # with the project's biases and per-feature scale
        a.W_E.bias.copy_(torch.randn(8, generator=g).to(tiny.device))
        a.W_D.bias.copy_(torch.randn(tiny.hidden_size, generator=g).to(tiny.device))
        s = (torch.rand(tiny.hidden_size, generator=g) * 3 + 0.5).to(tiny.device)
        ad.out_scale[0] = s
        assert torch.allclose(hook(None, (H,), (H,))[0], H + s * by_hand(H), atol=1e-4)


def test_lora_delta_is_alpha_over_r_b_a_x(tiny):
    """Hu et al. 2022: h = W₀x + (α/r)·B·A·x on the last layer's attention output projection."""
    from plugins.lora import LoRA, LoRAConfig
    from plugins.network import Attachment

    lo = LoRA(LoRAConfig(rank=8, alpha=2.0), tiny, {})
    assert torch.count_nonzero(lo.lora_B) == 0  # B = 0: the untrained plug-in is the identity
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        lo.lora_B.copy_(torch.randn(lo.lora_B.shape, generator=g))
    lo.to(tiny.device)
    proj = tiny.layers[-1].self_attn.o_proj
    x = torch.randn(2, 3, proj.in_features, generator=g).to(tiny.device)
    handles = lo._register_hooks(Attachment(None, {"scale": 1.0}))
    try:
        with torch.no_grad():
            got = proj(x)
    finally:
        for h in handles:
            h.remove()
    base = x @ proj.weight.T + (proj.bias if proj.bias is not None else 0)
    want = base + (2.0 / 8) * (x @ lo.lora_A.T @ lo.lora_B.T)
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, base + x @ lo.lora_A.T @ lo.lora_B.T, atol=1e-2)


# --- faithfulness checks that are not equations ---------------------------------------------------------------------

def _memory_with_unique_heldout_token(tiny, path):
    pairs = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
             ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3
    held = set(heldout_split(len(pairs)).tolist())
    assert held
    samples = [Sample(s, "XQZ 987 !?" if i in held else t, i + 1) for i, (s, t) in enumerate(pairs)]
    return build_memory(tiny, samples, path, prompt=PROMPT)


def test_pema_candidates_and_early_stopping_never_see_the_heldout_samples(tiny, tmp_path):
    mem = _memory_with_unique_heldout_token(tiny, tmp_path / "m")
    only_held = set(np.asarray(mem.heldout_values).tolist()) - set(np.asarray(mem.values).tolist()) \
        - set(tiny.stop_ids)
    assert only_held  # the held-out target has tokens no training target has

    class TrainingOnly(Memory):  # any access to the held-out split fails the test
        def _arr(self, name):
            assert not name.startswith("heldout"), f"PEMA training read {name}"
            return super()._arr(name)

    cfg = PEMAConfig(rank=8, batch_size=32, max_epochs_rct=1, max_epochs_joint=1, candidate_top_k=0)
    p = PEMA(cfg, tiny, {"key_rms": mem.key_scale})
    res = p.fit(TrainingOnly(path=mem.path, meta=mem.meta))
    assert not only_held & set(p.candidates.tolist())
    train_samples = {i for i, s in enumerate(mem.samples) if s["split"] == "train"}
    from plugins.training import early_stopping_split

    tr, es = early_stopping_split(np.asarray(mem.entry_sample), seed=cfg.seed)
    stop_samples = set(np.asarray(mem.entry_sample)[es].tolist())
    assert stop_samples and stop_samples <= train_samples
    assert not set(np.asarray(mem.entry_sample)[tr].tolist()) & stop_samples  # never trained on either
    assert res.metrics["early_stop_entries"] == len(es) and res.metrics["train_entries"] == len(tr)


def test_knn_faiss_index_is_cached_per_setting_and_reranked_exactly(tiny, tmp_path):
    pairs = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
             ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3
    mem = build_memory(tiny, [Sample(s, t, i + 1) for i, (s, t) in enumerate(pairs)], tmp_path / "m",
                       prompt=PROMPT)
    a = KNN(KNNConfig(search="faiss", ivf_lists=4, pq_m=16, nprobe=4), tiny)
    a.fit(mem)
    b = KNN(KNNConfig(search="faiss", ivf_lists=8, pq_m=16, nprobe=8), tiny)
    b.fit(mem)
    c = KNN(KNNConfig(search="faiss", ivf_lists=4, pq_m=16, nprobe=4, normalize_keys=False), tiny)
    c.fit(mem)
    assert (a.index.nlist, b.index.nlist, c.index.nlist) == (4, 8, 4)
    assert len(list(mem.path.glob("faiss_ivfpq*.index"))) == 3
    a2 = KNN(KNNConfig(search="faiss", ivf_lists=4, pq_m=16, nprobe=4), tiny)
    a2.fit(mem)  # same settings: the cached file
    assert len(list(mem.path.glob("faiss_ivfpq*.index"))) == 3

    rms = mem.key_scale
    keys = np.asarray(mem.keys, dtype=np.float64) / rms
    q = keys[:6] + np.random.default_rng(1).normal(0, 0.2, keys[:6].shape)
    dist, idx = a.search(torch.tensor(q, dtype=torch.float32), 4)
    dist, idx = dist.cpu().numpy(), idx.cpu().numpy()
    assert (idx >= 0).all()
    exact = ((keys[idx] - q[:, None, :]) ** 2).sum(-1)
    assert np.allclose(dist, exact, rtol=1e-4, atol=1e-4)
    assert (np.diff(dist, axis=1) >= 0).all()


def test_float16_keys_that_would_overflow_are_stored_as_float32(tiny, tmp_path, monkeypatch):
    from ground.errors import UserError

    real = tiny.forward_fc
    big = {"value": 1e5}

    def forward_fc(*a, **kw):
        fc, out = real(*a, **kw)
        fc = fc.clone()
        fc[..., 0] = big["value"]
        return fc, out

    monkeypatch.setattr(tiny, "forward_fc", forward_fc)
    samples = [Sample("good morning", "Guten Morgen", 1), Sample("the cat sleeps", "die Katze schlaeft", 2)]
    mem = build_memory(tiny, samples, tmp_path / "m", prompt=PROMPT, key_dtype="float16", heldout_frac=0)
    keys = np.asarray(mem.keys)
    assert keys.dtype == np.float32 and mem.meta["key_dtype"] == "float32"
    assert np.isfinite(keys).all() and (keys[:, 0] == 1e5).all()
    big["value"] = float("inf")
    with pytest.raises(UserError, match="non-finite"):
        build_memory(tiny, samples, tmp_path / "n", prompt=PROMPT, key_dtype="float16", heldout_frac=0)
    assert not (tmp_path / "n").exists()
