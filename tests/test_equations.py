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
from engine.protocol import MixInput
from memories.build import build_memory, heldout_split
from memories.parse import Sample
from memories.store import Memory
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
    p = PEMA(PEMAConfig(rank=16, seed=7, b_init="zeros"), tiny, {"key_rms": 1.0})
    assert torch.count_nonzero(p.B_rct) == 0 and torch.count_nonzero(p.B_pd) == 0
    assert p.A.abs().max() <= 1 / math.sqrt(d) and p.A.abs().max() > 0.5 / math.sqrt(d)
    # the random start is the measured default (BENCHMARKS.md, "PEMA one change at a time" row), a named deviation
    q = PEMA(PEMAConfig(rank=16, seed=7), tiny, {"key_rms": 1.0})
    assert q.config.b_init == "random" and q.scaling == 1.0
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


@pytest.mark.parametrize("alpha", [1.0, 256.0])
def test_pema_pca_start_is_the_autoencoders_optimum_at_any_scaling(tiny, tiny_memory, alpha):
    """rct_init="pca" at s = α/r ≠ 1: A = the keys' top-r right singular vectors V_r, so s·B_rct·A = V_rᵀ·V_r — the
    reconstruction error after the start is the discarded singular values' (≈ 0 at full rank) whatever s is, and
    pd_init="warm" then starts P_PEMA at the LM. (At s = 1 a B_rct scaled the wrong way changes nothing; here it
    multiplies the reconstruction by s² instead of 1.)"""
    d = tiny.hidden_size
    keys = torch.from_numpy(np.asarray(tiny_memory.keys, dtype=np.float32)).to(tiny.device)
    for rank in (d, d // 4):
        cfg = PEMAConfig(rank=rank, lora_alpha=alpha, max_epochs_rct=0, max_epochs_joint=0, dropout=0.0,
                         rct_init="pca", pd_init="warm", decode_vocab="full")
        p = PEMA(cfg, tiny, {"key_rms": tiny_memory.key_scale})
        assert p.scaling == pytest.approx(alpha / rank) and abs(p.scaling - 1) > 0.5
        p.fit(tiny_memory)
        x = p.scaled(keys)
        with torch.no_grad():
            A = p.A.detach()
            assert torch.allclose(A @ A.T, torch.eye(rank, device=A.device), atol=1e-4)  # orthonormal rows
            rec = p.h_rct(x)
            assert torch.allclose(rec, x @ A.T @ A, rtol=1e-4, atol=1e-4 * float(x.abs().max()))
            err = float(((rec - x) ** 2).mean() / (x ** 2).mean())
            if rank == d:
                assert err < 1e-9  # measured ~1e-13
                lm = torch.log_softmax(tiny.logits_from_fc(keys[:8]).float(), -1)
                assert torch.allclose(p.pema_logprobs(keys[:8]), lm, atol=1e-3)
            else:  # Eckart–Young: the energy outside the top r directions of these keys, no more
                sv = torch.linalg.svdvals(x)
                assert err <= 1.05 * float((sv[rank:] ** 2).sum() / (sv ** 2).sum()) + 1e-6


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
    p = pema_with_random_weights(tiny, rank=8, kappa=kappa, dropout=0.0, lora_alpha=1.0)  # s = 1/8
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
    p = pema_with_random_weights(tiny, rank=8, dropout=0.5, lora_alpha=1.0)  # s = 1/8
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
                     patience=99, dropout=0.0, b_init="zeros", lora_alpha=1.0)  # the public code
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


@pytest.mark.parametrize("raw", [False, True])
def test_pema_h_pd_on_the_rms_divided_or_the_raw_f_c(tiny, raw):
    """h_pd = (α/r)·B_pd·A·x with x = f(c)/key_rms (``normalize_input`` true, the default) or x = f(c) (false: the
    public code's raw scale); P_PEMA = softmax(W_hd·norm(h_pd)) on either."""
    p = pema_with_random_weights(tiny, seed=11, rank=16, lora_alpha=1.0, decode_vocab="full",
                                 normalize_input=not raw)
    p.key_scale.fill_(40.0)
    fc = torch.randn(4, tiny.hidden_size, generator=torch.Generator().manual_seed(12)).to(tiny.device) * 40
    x = fc if raw else fc / 40.0
    A, B_pd = p.A.detach(), p.B_pd.detach()
    h = x @ A.T @ B_pd.T * (1.0 / 16)
    with torch.no_grad():
        assert torch.allclose(p.extra_states(fc, []), h, rtol=1e-5, atol=1e-4)
        other = (fc / 40.0 if raw else fc) @ A.T @ B_pd.T / 16
        assert not torch.allclose(p.extra_states(fc, []), other, rtol=1e-2)
        assert torch.allclose(p.pema_logprobs(fc), torch.log_softmax(head_by_hand(tiny, h), -1), atol=1e-4)


def test_pema_rms_division_with_a_small_s_lets_the_norms_epsilon_shrink_the_logits(tiny):
    """RMSNorm's ε: norm(h) = w·h/√(mean(h²) + ε) is scale invariant only while mean(h²) ≫ ε. With h_pd tiny
    (s = α/r small on the RMS-divided input) P_PEMA flattens; on the raw f(c) it does not."""
    eps = tiny.final_norm.variance_epsilon
    p = pema_with_random_weights(tiny, seed=13, rank=16, lora_alpha=1.0, decode_vocab="full")
    g = torch.Generator().manual_seed(14)
    with torch.no_grad():
        p.B_pd.mul_(1e-4)
    fc = torch.randn(3, tiny.hidden_size, generator=g).to(tiny.device) * 1000
    for raw, flattened in ((False, True), (True, False)):
        p.config.normalize_input = not raw
        p.key_scale.fill_(1000.0)
        with torch.no_grad():
            h = p.extra_states(fc, [])
            lp = p.pema_logprobs(fc)
        ms = float((h.float() ** 2).mean())
        want = torch.log_softmax(head_by_hand(tiny, h.float()), -1)
        assert torch.allclose(lp, want, atol=1e-3)
        scale_free = torch.log_softmax(head_by_hand(tiny, h.float() / math.sqrt(ms)), -1)  # ε negligible
        assert (ms < eps) == flattened
        assert torch.allclose(lp, scale_free, atol=1e-2) != flattened


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


def test_pema_on_its_candidates_mixes_as_over_the_whole_vocabulary(tiny):
    """Restricted to its candidate vocabulary, P_PEMA is the softmax over the candidates' logits (−inf elsewhere),
    and the mix runs on those columns only (``plugin_support``): the vocabulary-wide mix of that P_PEMA bit for bit,
    λ of 0 and 1 included."""
    from engine.protocol import mix_logprobs

    p = PEMA(PEMAConfig(rank=8), tiny, {"key_rms": 1.0}).to(tiny.device)
    g = torch.Generator().manual_seed(9)
    p.candidates = torch.randperm(tiny.vocab_size, generator=g)[:40].to(tiny.device)
    lm = torch.log_softmax(torch.randn(4, tiny.vocab_size, generator=g) * 3, -1).to(tiny.device)
    ex = (torch.randn(4, tiny.vocab_size, generator=g) * 3).to(tiny.device)
    settings = [p.settings({"lambda_max": lam, "gu": False}) for lam in (0.3, 0.7, 0.0, 1.0)]
    out = p.mix(MixInput(fc=torch.zeros(4, tiny.hidden_size, device=tiny.device), lm_logprobs=lm, extra_logits=ex,
                         step=0, src_len=[5] * 4, settings=settings))
    masked = torch.full_like(ex, float("-inf"))
    masked[:, p.candidates] = ex[:, p.candidates]
    assert torch.allclose(out.plugin_logprobs, torch.log_softmax(masked, -1), atol=1e-6)
    outside = torch.ones(tiny.vocab_size, dtype=torch.bool, device=tiny.device)
    outside[p.candidates] = False
    assert torch.isinf(out.plugin_logprobs[:, outside]).all()
    assert torch.equal(out.logprobs, mix_logprobs(lm, out.plugin_logprobs, torch.tensor([0.3, 0.7, 0.0, 1.0])))
    assert torch.equal(out.logprobs[2], lm[2]) and torch.equal(out.logprobs[3], out.plugin_logprobs[3])
    assert torch.equal(p.plugin_support(2), p.candidates.expand(2, -1))  # … so only those columns were mixed


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


def test_gradual_unrolling_code_variant_takes_the_reference_length_in_evaluation(tiny):
    """With references (evaluation only), the code variant's SL is the public code's own: instruction + source +
    the *reference's* tokens, handed from ``evaluate(reference_sl=True)`` through the batched decode to each row."""
    from engine import Row, decode_batch
    from eval.run import evaluate
    from ground.errors import UserError

    p = PEMA(PEMAConfig(rank=8, decode_vocab="full"), tiny, {"key_rms": 1.0, "prompt": PROMPT.to_dict()})
    p = p.to(tiny.device)
    tpl = len(tiny.encode_target(PROMPT.template.format(src="")))
    lam_max, pct = 0.7, 20.0
    row = Row("code", p, {"lambda_max": lam_max, "gu": True, "gu_variant": "code", "gu_min": pct})
    pairs = [("the house is small", "das Haus ist sehr sehr klein und alt"), ("good morning", "Guten Morgen")]
    src = [len(tiny.encode_target(s)) for s, _ in pairs]
    ref = [len(tiny.encode_target(r)) for _, r in pairs]
    assert src != ref
    for ref_lens, sl in ((ref, [tpl + a + b for a, b in zip(src, ref)]), (None, [tpl + 2 * a for a in src])):
        comps = decode_batch(tiny, [s for s, _ in pairs], [row], PROMPT, max_new_tokens=8, ref_lens=ref_lens)
        for comp, n in zip(comps, sl):
            got = [t["lambda"] for t in comp.rows[0].trace]
            assert got and got == pytest.approx([round(x, 4) for x in public_code_gu(lam_max, n, pct, len(got))])
    seen = []

    def spy(*a, **kw):
        seen.append(kw.get("ref_lens"))
        return decode_batch(*a, **kw)

    res = evaluate(tiny, pairs, [Row("base"), row], PROMPT, batch_sources=1, max_new_tokens=4, bootstrap=0,
                   decode=spy, reference_sl=True)
    assert seen == [[ref[0]], [ref[1]]] and res["decode"]["gu_code_sl"] == "reference"
    seen.clear()
    evaluate(tiny, pairs, [row], PROMPT, batch_sources=2, max_new_tokens=4, bootstrap=0, decode=spy)
    assert seen == [None]
    with pytest.raises(UserError):
        evaluate(tiny, [("a", None)], [row], PROMPT, task="style", decode=spy, reference_sl=True)


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


def test_knn_mixes_on_its_support_exactly_as_over_the_whole_vocabulary(tiny, tiny_memory):
    """P_kNN is −inf beyond the neighbours' tokens, so kNN mixes only those columns (mix_logprobs(support=)): bit
    for bit the vocabulary-wide mix, rows of different k and λ of 0 and 1 included; the same on random rows of a
    262,144-token vocabulary."""
    from engine.protocol import mix_logprobs

    knn = KNN(KNNConfig(search="exact"), tiny)
    knn.fit(tiny_memory)
    g = torch.Generator().manual_seed(1)
    q = torch.tensor(np.asarray(tiny_memory.keys[:4], dtype=np.float32)) + 0.3 * torch.randn(4, tiny.hidden_size,
                                                                                           generator=g)
    lm = torch.log_softmax(torch.randn(4, tiny.vocab_size, generator=g), -1)
    settings = [knn.settings({"k": k, "temperature": 2.0, "lambda": lam})
                for k, lam in ((8, 0.3), (3, 0.6), (8, 0.0), (5, 1.0))]
    out = knn.mix(MixInput(fc=q.to(tiny.device), lm_logprobs=lm.to(tiny.device), extra_logits=None, step=0,
                           src_len=[3] * 4, settings=settings))
    assert torch.isinf(out.plugin_logprobs).any(1).all()  # a sparse P_kNN: the case the support path is for
    dense = mix_logprobs(lm.to(tiny.device), out.plugin_logprobs, torch.tensor([0.3, 0.6, 0.0, 1.0]))
    assert torch.equal(out.logprobs, dense)
    assert torch.equal(out.logprobs[2], lm[2].to(out.logprobs.device))
    assert torch.equal(out.logprobs[3], out.plugin_logprobs[3])
    V, n = 262_144, 3
    for trial in range(5):
        lm = torch.log_softmax(3 * torch.randn(n, V, generator=g), -1)
        support = torch.randint(0, V, (n, 8), generator=g)
        plp = torch.full((n, V), float("-inf")).scatter_(1, support, torch.log_softmax(torch.randn(n, 8), 1))
        lam = torch.rand(n, generator=g)
        assert torch.equal(mix_logprobs(lm, plp, lam, support=support), mix_logprobs(lm, plp, lam))


def test_knn_temperature_divides_the_distance_on_a_spread_out_softmax(tiny, tiny_memory):
    """p_kNN(y) ∝ Σ_{j: v_j = y} exp(−d_j/T) where the softmax is far from one-hot: the query sits between two stored
    keys of different tokens, so the neighbours' distances differ by about T and several tokens keep real weight.
    exp(−d·T), exp(−d) (no T) and exp(−d/T²) give other distributions here, and the test checks that they do."""
    knn = KNN(KNNConfig(search="exact"), tiny)
    knn.fit(tiny_memory)
    rms = tiny_memory.key_scale
    keys = np.asarray(tiny_memory.keys, dtype=np.float64) / rms
    vals = np.asarray(tiny_memory.values)
    k, T = 8, 10.0

    def between(a):
        """The query 0.6 of the way from key a to its nearest key of another token; its distances to all keys."""
        b = next(j for j in np.argsort(((keys - keys[a]) ** 2).sum(1), kind="stable") if vals[j] != vals[a])
        q = 0.6 * keys[a] + 0.4 * keys[b]
        return q, ((keys - q) ** 2).sum(1)

    def p_by_hand(weight, d):
        p = np.zeros(tiny.vocab_size)
        for j in np.argsort(d, kind="stable")[:k]:
            p[vals[j]] += weight(d[j])
        return p / p.sum()

    right = lambda dj: math.exp(-dj / T)  # noqa: E731
    wrongs = (lambda dj: math.exp(-dj * T), lambda dj: math.exp(-dj), lambda dj: math.exp(-dj / T ** 2))

    def telling(d):
        """p_kNN far from one-hot here, and each wrong weighting far from it."""
        p = p_by_hand(right, d)
        return (p.max() < 0.85 and np.sort(p)[-2] > 0.1
                and all(np.abs(p_by_hand(w, d) - p).sum() > 0.1 for w in wrongs))

    # the first stored key whose in-between query tells them apart (which keys the memory holds is the split's)
    a = next(a for a in range(len(keys)) if telling(between(a)[1]))
    q_scaled, d = between(a)
    nn_ids = np.argsort(d, kind="stable")[:k]
    want = p_by_hand(right, d)

    q = torch.tensor(q_scaled * rms, dtype=torch.float32, device=tiny.device)[None]
    lp, dist, _ = knn.knn_logprobs(q, k, T)
    assert np.allclose(dist.cpu().numpy()[0], d[nn_ids], rtol=1e-4, atol=1e-3)
    assert np.allclose(lp.exp().cpu().numpy()[0], want, atol=1e-5)
    lam = 0.4
    lm = torch.log_softmax(torch.randn(1, tiny.vocab_size, generator=torch.Generator().manual_seed(3)), -1)
    out = knn.mix(MixInput(fc=q, lm_logprobs=lm.to(tiny.device), extra_logits=None, step=0, src_len=[3],
                           settings=[knn.settings({"k": k, "temperature": T, "lambda": lam})]))
    assert np.allclose(out.logprobs.exp().cpu().numpy()[0], lam * want + (1 - lam) * lm.exp().numpy()[0], atol=1e-5)


def test_knn_faiss_index_is_trained_on_the_seeds_sample_and_named_by_the_seed(tiny, tmp_path):
    """The IVF-PQ index is trained on sorted(default_rng(seed).choice(N, min(N, max(64·lists, 40·lists, 10000)),
    replace=False)) — a seed-dependent sample once N exceeds it — and its cached file name carries the seed, so a
    plug-in of another seed never reads an index trained on another sample. Checked against indexes trained by hand
    on each seed's sample."""
    import faiss

    n, d, nlist, m = 12_000, 32, 4, 8
    g = torch.Generator().manual_seed(4)
    centres = torch.randn(6, d, generator=g) * 3
    keys = (centres[torch.randint(0, 6, (n,), generator=g)] + torch.randn(n, d, generator=g)).numpy()

    class Keys:  # what the index build reads of a memory
        def __init__(self, path):
            self.keys, self.path = keys, path

        def __len__(self):
            return n

    def by_hand(seed):
        size = min(n, max(256 * nlist // 4, 40 * nlist, 10000))
        sample = np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))
        index = faiss.IndexIVFPQ(faiss.IndexFlatL2(d), d, nlist, m, 8)
        index.train(keys[sample])
        return faiss.vector_to_array(index.pq.centroids)

    mem = Keys(tmp_path)
    got = {}
    for seed in (1, 2, 1):
        knn = KNN(KNNConfig(search="faiss", ivf_lists=nlist, pq_m=m, normalize_keys=False, seed=seed), tiny)
        knn.memory = mem
        knn._build_faiss()
        assert knn.index_record["file"] == f"faiss_ivfpq_rawkeys_{nlist}lists_{m}x8pq_seed{seed}.index"
        got.setdefault(seed, faiss.vector_to_array(knn.index.pq.centroids))
    assert sorted(p.name for p in tmp_path.glob("*.index")) == [f"faiss_ivfpq_rawkeys_{nlist}lists_{m}x8pq_seed{s}"
                                                                ".index" for s in (1, 2)]
    want1, want2 = by_hand(1), by_hand(2)
    assert not np.allclose(want1, want2, atol=1e-3)  # the seeds' samples train different codebooks
    assert np.allclose(got[1], want1, atol=1e-4) and np.allclose(got[2], want2, atol=1e-4)


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

    hook = ad._hook(0, Attachment(None, ad.settings({"scale": 1.0})))
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
    handles = lo._register_hooks(Attachment(None, lo.settings({"scale": 1.0})))
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


def test_lora_trains_with_dropout_and_early_stops_without_it(tiny, tiny_memory, monkeypatch):
    """peft's ``lora_dropout`` acts on the projection's input while training (LoRA, Hu et al.: dropout is a
    regulariser of training), never in the early-stopping evaluation: each reported evaluation is the deterministic
    loss of the weights it evaluated, recomputed here with the trained A, B through the decode hook."""
    from plugins.lora import LoRA, LoRAConfig
    from plugins.network import TrainingBatches
    from plugins.training import run_training as real_run

    modes = {"train": [], "eval": []}

    def spy(module, params, n, train_loss, heldout_loss, *a, **k):
        drop = [m for m in module.modules() if isinstance(m, nn.Dropout)]
        assert drop and all(m.p == 0.5 for m in drop)  # peft's lora_dropout, trained with the A and B it feeds

        def tl(idx):
            modes["train"].append([m.training for m in drop])
            return train_loss(idx)

        def hl():
            modes["eval"].append([m.training for m in drop])
            return heldout_loss()
        return real_run(module, params, n, tl, hl, *a, **k)

    import plugins.lora as lora_mod
    monkeypatch.setattr(lora_mod, "run_training", spy)
    cfg = LoRAConfig(rank=8, alpha=16.0, dropout=0.5, lr=1e-2, batch_size=4, max_epochs=2, evals_per_epoch=1,
                     patience=5, max_minutes=0.0, max_heldout=4)
    lo = LoRA(cfg, tiny, {})
    res = lo.fit(tiny_memory)
    assert modes["train"] and modes["eval"]
    assert all(all(m) for m in modes["train"]) and not any(any(m) for m in modes["eval"])
    # the kept weights' reported loss is their deterministic loss (no dropout): recompute it with the decode hook
    _, held = lo._data(tiny_memory)
    hb = TrainingBatches(tiny, held, cfg.batch_size, lo.frozen_prefix, lo.lowest_layer())
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(len(hb)):
            loss, k = lo.hooked_seq_loss(hb[i])
            tot, n = tot + float(loss) * k, n + k
    assert tot / n == pytest.approx(res.metrics["best_heldout_loss"], rel=1e-5)
    assert torch.count_nonzero(lo.lora_B) > 0


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


def _scripted_loop(losses: list[float], **settings):
    """run_training on one scalar weight, one entry a step, with the early-stopping losses scripted: returns the
    summary, the steps at which it evaluated and the weight's value at each evaluation."""
    from plugins.training import LoopSettings, run_training

    w = nn.Parameter(torch.zeros(()))
    mod = nn.Module()
    mod.w = w
    losses = list(losses)
    seen: list[tuple[int, float]] = []
    steps = [0]

    def train_loss(idx):
        steps[0] += 1
        return (w - 100.0) ** 2, {}

    def heldout():
        seen.append((steps[0], float(w)))
        return losses.pop(0)

    s = LoopSettings(batch_size=1, lr=0.1, **settings)
    out = run_training(mod, [w], 4, train_loss, heldout, s, "t", lambda f, m: None, lambda: False, [])
    return out, [st for st, _ in seen], [v for _, v in seen], float(w)


def test_public_codes_step_wise_early_stopping_by_hand():
    """train_rct_pd.py: evaluate every 100 steps; "give up if the loss is increasing for 2 consecutive validation
    steps": stop at the first evaluation whose loss is above both evaluations before it (the loop's evaluation
    before the first step does not count). Scripted losses: 10 (before training), then 5, 4, 4.5, 4.2, 4.6 — the
    rule stops at the 5th evaluation (4.6 > 4.5 and 4.2), the "best" rule with patience 2 at the 4th; the rising
    rule keeps the weights of the best evaluation (4, the 2nd)."""
    losses = [10, 5, 4, 4.5, 4.2, 4.6, 4.7, 4.8]
    out, at, weights, final = _scripted_loop(losses, eval_every=3, stop_rule="rising", patience=2, max_epochs=100)
    assert at == [0, 3, 6, 9, 12, 15] and out["steps"] == 15 and out["stopped_by"] == "early_stopping"
    assert out["best_heldout_loss"] == 4 and final == weights[2]
    best, at_b, _, _ = _scripted_loop(losses, eval_every=3, stop_rule="best", patience=2, max_epochs=100)
    assert at_b == [0, 3, 6, 9, 12] and best["steps"] == 12
    # the evaluation before training is not one of the two: 1 (before), 5, 6 does not stop at 6
    late, at_l, _, _ = _scripted_loop([1, 5, 6, 5.5, 5.2, 5.0], eval_every=2, stop_rule="rising", patience=2,
                                      max_epochs=100, max_steps=10)
    assert at_l == [0, 2, 4, 6, 8, 10] and late["stopped_by"] == "max_steps" and late["steps"] == 10


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
    # exact_rerank off: the index's own PQ distances (same index file), which are not the exact ones
    pq = KNN(KNNConfig(search="faiss", ivf_lists=4, pq_m=16, nprobe=4, exact_rerank=False), tiny)
    pq.fit(mem)
    assert len(list(mem.path.glob("faiss_ivfpq*.index"))) == 3 and "PQ distances" in pq.search_kind
    d_pq, i_pq = pq.search(torch.tensor(q, dtype=torch.float32), 4)
    d_idx, i_idx = a.index.search(q.astype(np.float32), 4)
    assert np.allclose(d_pq.numpy(), d_idx) and np.array_equal(i_pq.numpy(), i_idx)
    assert not np.allclose(d_pq.numpy(), ((keys[i_idx] - q[:, None, :]) ** 2).sum(-1), rtol=1e-3, atol=1e-3)


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


# --- memory-augmented adapter (Xu et al., LREC-COLING 2024) ---------------------------------------------------------

def _xu_adapter_by_hand(A, K, W_q, W_k, W_v, W_1, W_2, b_2, T, *, sqrt_d=True, transpose_k=True, swap_gate=False,
                        gate_order="AR"):
    """The paper's adapter, one position at a time in float64: R = softmax(Q·W_q·W_kᵀ·Kᵀ / T)·V·W_v with Q = A and
    V = K (the authors' DatastoreReaderLayer also scales Q by d^-½), λ = sigmoid(ReLU([A; R]·W_1)·W_2 + b_2),
    O = λ·A + (1−λ)·R. The keyword arguments produce the plausible wrong variants."""
    A, K = A.double(), K.double()
    W_q, W_k, W_v, W_1, W_2, b_2 = (w.detach().double() for w in (W_q, W_k, W_v, W_1, W_2, b_2))
    d = A.shape[-1]
    out, atts, lams = torch.empty_like(A), [], []
    for idx in np.ndindex(*A.shape[:-1]):
        a = A[idx]
        logits = torch.stack([(a @ W_q) @ ((W_k.T if transpose_k else W_k) @ k) for k in K])
        logits = logits / (T * math.sqrt(d) if sqrt_d else T)
        w = torch.exp(logits - logits.max())
        w = w / w.sum()
        r = sum(w[j] * (K[j] @ W_v) for j in range(len(K)))
        cat = torch.cat([a, r]) if gate_order == "AR" else torch.cat([r, a])
        lam = torch.sigmoid(torch.clamp(cat @ W_1, min=0) @ W_2 + b_2)
        out[idx] = (1 - lam) * a + lam * r if swap_gate else lam * a + (1 - lam) * r
        atts.append(w)
        lams.append(lam)
    return out, torch.stack(atts).reshape(*A.shape[:-1], len(K)), torch.stack(lams).reshape(*A.shape[:-1], 1)


def _random_xu_adapter(d, seed, b_2=0.3):
    from plugins.memory_adapter import MemoryAdapter

    g = torch.Generator().manual_seed(seed)
    ad = MemoryAdapter(d, gate_bias=0.0, g=g)
    with torch.no_grad():
        for w in (ad.W_q, ad.W_k, ad.W_v):
            w.copy_(torch.randn(w.shape, generator=g))
        for w in (ad.W_1, ad.W_2):  # small enough that the gate does not saturate
            w.copy_(0.3 * torch.randn(w.shape, generator=g))
        ad.b_2.fill_(b_2)
    return ad, g


@pytest.mark.equations
def test_memory_adapter_retrieval_gate_and_fusion_by_hand():
    """R = softmax(Q·W_q·W_kᵀ·Kᵀ/T)·V·W_v (÷√d as in the authors' code), λ = sigmoid(ReLU([A; R]·W_1)·W_2 + b_2),
    O = λA + (1−λ)R — on a 4-dim hand-made input with non-symmetric random weights, so that W_k vs W_kᵀ, a missing
    √d, a swapped gate or [R; A] all fail."""
    d, n, T = 4, 3, 0.5
    ad, g = _random_xu_adapter(d, seed=11)
    K = torch.randn(n, d, generator=g)
    A = torch.randn(2, 5, d, generator=g)  # the anchor, also the query
    with torch.no_grad():
        O, att, lam = ad(A, ad.prepare(K, T))
    w = (ad.W_q, ad.W_k, ad.W_v, ad.W_1, ad.W_2, ad.b_2)
    want, want_att, want_lam = _xu_adapter_by_hand(A, K, *w, T)
    assert torch.allclose(att.double(), want_att, atol=1e-5) and torch.allclose(att.sum(-1), torch.ones(2, 5))
    assert torch.allclose(lam.double(), want_lam, atol=1e-5)
    assert torch.allclose(O.double(), want, atol=1e-4)
    assert 0.05 < float(lam.min()) and float(lam.max()) < 0.99  # both terms of the fusion matter here
    for wrong in ({"sqrt_d": False}, {"transpose_k": False}, {"swap_gate": True}, {"gate_order": "RA"}):
        bad, _, _ = _xu_adapter_by_hand(A, K, *w, T, **wrong)
        assert not torch.allclose(O.double(), bad, atol=1e-3), wrong
    bad, _, _ = _xu_adapter_by_hand(A, K, *w, 2 * T)  # T multiplies instead of divides (0.5 ↔ 2)
    assert not torch.allclose(O.double(), bad, atol=1e-3)


def _random_layer_block(d, n, s, seed, w_scale=1.0, w2_scale=1.0, b_2=0.0):
    """A memory-adapter layer (both sides) with random non-symmetric weights (W_q, W_k, W_v, W_1 times
    ``w_scale``, W_2 times ``w2_scale``), gate bias ``b_2``, random memories and layer scale ``s``; and its
    generator, to draw inputs from."""
    from plugins.memory_adapter import LayerBlock

    g = torch.Generator().manual_seed(seed)
    blk = LayerBlock(d, n, ("tgt", "src"), 0.0, g)
    with torch.no_grad():
        for side in ("tgt", "src"):
            ad = blk.adapters[side]
            for w in (ad.W_q, ad.W_k, ad.W_v, ad.W_1):
                w.copy_(w_scale * torch.randn(w.shape, generator=g))
            ad.W_2.copy_(w2_scale * torch.randn(ad.W_2.shape, generator=g))
            ad.b_2.fill_(b_2)
        blk.mem_tgt.copy_(torch.randn(n, d, generator=g))
        blk.mem_src.copy_(torch.randn(n, d, generator=g))
        blk.scale.fill_(s)
    return blk, g


@pytest.mark.equations
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_adapter_decode_path_is_the_layer_with_its_scale_folded_in(dtype):
    """Decoding, a layer's adapters run on unscaled states with the scale folded into their memory products
    (``decode_prep``) and, in a bfloat16 backbone, A·W_1[:d] on packed bfloat16 weights: the layer's output, its
    memory attention and gates as ``apply`` gives them — to float32 rounding for a float32 backbone, to the
    bfloat16 rounding of A and W_1[:d] for a bfloat16 one."""
    from backbone.model import packed_bf16_available
    if dtype == torch.bfloat16 and not packed_bf16_available():
        pytest.skip("no oneDNN bfloat16 linear on this CPU")
    d, n, T, s = 64, 5, 0.5, 37.0
    blk, g = _random_layer_block(d, n, s, seed=13, w_scale=0.3, w2_scale=0.05, b_2=0.2)  # the gate mixes at d = 64
    a = (torch.randn(3, 1, d, generator=g) * s).to(dtype)
    with torch.no_grad():
        want, want_info = blk.apply(a, blk.prepare(T))
        got, info = blk.decode(a, blk.decode_prep(T, dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = float((got.double() - want.double()).norm() / (want.double() - a.double()).norm())  # of the change
    assert err < tol
    for side in ("tgt", "src"):
        assert torch.allclose(info[side][0], want_info[side][0], atol=tol)
        assert torch.allclose(info[side][1], want_info[side][1], atol=tol)
        assert 0.05 < float(info[side][1].min()) and float(info[side][1].max()) < 0.95  # the gate mixes both
    assert not torch.allclose(got.float(), a.float(), atol=1e-2)


@pytest.mark.equations
def test_memory_adapter_layer_runs_target_then_source_adapter_on_rms_scaled_states():
    """Per adapted layer: x = a/s_l; O_tgt = adapter_tgt(x) with K = V = the target-side items; O_src =
    adapter_src(O_tgt) with the source-side items; the hook's output is s_l·O_src. Memory dropout (keep False) makes
    that row's layer the identity."""
    d, n, T, s = 4, 3, 0.5, 2.5
    blk, g = _random_layer_block(d, n, s, seed=12, b_2=-0.2)
    a = torch.randn(2, 3, d, generator=g) * s
    with torch.no_grad():
        out, _ = blk.apply(a, blk.prepare(T))
        dropped, _ = blk.apply(a, blk.prepare(T), keep=torch.tensor([False, True]))

    def side(x, name):
        ad = blk.adapters[name]
        return _xu_adapter_by_hand(x, getattr(blk, f"mem_{name}"), ad.W_q, ad.W_k, ad.W_v, ad.W_1, ad.W_2, ad.b_2,
                                   T)[0]

    want = s * side(side(a.double() / s, "tgt"), "src")
    assert torch.allclose(out.double(), want, atol=1e-4)
    assert not torch.allclose(out.double(), s * side(side(a.double() / s, "src"), "tgt"), atol=1e-3)  # order
    assert not torch.allclose(out.double(), side(side(a.double(), "tgt"), "src"), atol=1e-3)  # no RMS scaling
    assert torch.allclose(dropped[0], a[0], atol=1e-5) and torch.allclose(dropped[1], out[1], atol=1e-6)


@pytest.mark.equations
def test_memory_adapter_objective_nll_alpha_beta_symmetric_kl_by_hand(tiny, tiny_memory, monkeypatch):
    """L = NLL(p) + α·NLL(q) + β·½(KL(p‖q) + KL(q‖p)), p / q the output distributions with the full / the dropped
    memory, token means — with α = 2 ≠ β = 3 so that swapping them, a one-way KL or a missing ½ all fail. (The tiny
    random head is saturated — logit margins ~60 make p = q —, so both sides divide its logits by 20.)"""
    from plugins.api import new_plugin
    from plugins.seqtrain import collate, memory_sequences

    p = new_plugin("memory_adapter", tiny, tiny_memory, {"alpha": 2.0, "beta": 3.0, "memory_dropout": 0.5,
                                                        "max_translate": 8})
    p.build_memory(tiny_memory)
    monkeypatch.setattr(p, "target_logits", lambda fc: tiny.logits_from_fc(fc).float() / 20)
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for blk in p.blocks.values():
            for ad in blk.adapters.values():  # a gate near ½ and a loud R: the memory really changes the output
                ad.W_v.copy_(10 * torch.randn(ad.W_v.shape, generator=g))
                ad.W_2.copy_(torch.randn(ad.W_2.shape, generator=g) / 8)
                ad.b_2.fill_(0.0)
    L = len(p.adapted_layers)
    data = memory_sequences(tiny, tiny_memory, "train")
    B = min(4, len(data))
    ids, mask, labels = collate(tiny, data, range(B))
    p._drop_rng = torch.Generator().manual_seed(5)
    with torch.no_grad():
        loss, n_tok, parts = p.train_batch_loss(ids, mask, labels)
    drop = torch.rand(B, L, generator=torch.Generator().manual_seed(5)) < 0.5  # the same draw
    assert drop.any() and (~drop).any()

    def logprobs(keep):
        handles = p.attach(None, {}, keep=keep)
        try:
            with torch.no_grad():
                fc, _ = tiny.forward_fc(ids, attention_mask=mask)
        finally:
            for h in handles:
                h.remove()
        sel = labels != -100
        return torch.log_softmax(head_by_hand(tiny, fc[sel].float()).double() / 20, -1), labels[sel]

    P, y = logprobs(torch.ones(B, L, dtype=torch.bool))
    Q, _ = logprobs(~drop)
    nll_p = -P.gather(1, y[:, None]).mean()
    nll_q = -Q.gather(1, y[:, None]).mean()
    kl_pq = (P.exp() * (P - Q)).sum(-1).mean()
    kl_qp = (Q.exp() * (Q - P)).sum(-1).mean()
    sym = 0.5 * (kl_pq + kl_qp)
    assert float(kl_pq) > 1e-3 and float(abs(kl_pq - kl_qp)) > 2e-4  # p ≠ q, and KL(p‖q) ≠ KL(q‖p)
    assert n_tok == len(y)
    assert float(parts["nll"]) == pytest.approx(float(nll_p), abs=5e-5)
    assert float(parts["nll_dropped"]) == pytest.approx(float(nll_q), abs=5e-5)
    assert float(parts["kl"]) == pytest.approx(float(sym), abs=2e-5)
    assert float(parts["kl"]) != pytest.approx(float(kl_pq), abs=5e-5)  # not one-way
    assert float(parts["kl"]) != pytest.approx(float(kl_qp), abs=5e-5)
    assert float(loss) == pytest.approx(float(nll_p + 2.0 * nll_q + 3.0 * sym), abs=1e-4)
    for bad in (nll_p + 3.0 * nll_q + 2.0 * sym,  # α and β swapped
                nll_p + 2.0 * nll_q + 3.0 * 2 * sym,  # no ½
                nll_p + 2.0 * nll_q + 3.0 * kl_pq,  # one-way KL
                nll_p + 2.0 * (nll_q + sym)):  # β ignored (α on the KL too)
        assert float(loss) != pytest.approx(float(bad), abs=2e-4)


@pytest.mark.equations
def test_memory_adapter_memory_dropout_rate_per_sequence_and_layer(tiny, tiny_memory, monkeypatch):
    """Paper: memory dropout with p = 0.1 (the authors' --p-inter-dropout 0.1, α = β = 5, T = 0.5, lr 2e-4). Here (the
    documented adaptation: the authors draw once per layer and batch) each (sequence, layer) cell of the dropped pass
    is dropped independently with probability p; the full pass keeps all. A draw with 1 − p, one draw per sequence
    for all layers, or one per batch would fail."""
    from plugins.api import new_plugin
    from plugins.memory_adapter import MemoryAdapterConfig

    c = MemoryAdapterConfig()
    assert (c.memory_dropout, c.alpha, c.beta, c.temperature, c.lr) == (0.1, 5.0, 5.0, 0.5, 2e-4)
    p = new_plugin("memory_adapter", tiny, tiny_memory, {"max_translate": 8})
    p.build_memory(tiny_memory)
    L = len(p.adapted_layers)
    assert L == 2

    class Stop(Exception):
        pass

    kept = []

    def fake_attach(rows, settings=None, **state):
        kept.append(state["keep"].cpu())
        raise Stop

    monkeypatch.setattr(p, "attach", fake_attach)
    B = 100
    ids = torch.ones(B, 3, dtype=torch.long)
    labels = torch.full((B, 3), 5, dtype=torch.long)
    p._drop_rng = torch.Generator().manual_seed(0)
    for _ in range(100):
        with pytest.raises(Stop):
            p.train_batch_loss(ids, torch.ones_like(ids), labels)
    # per batch: the full pass keeps every layer (B rows), then one row per sequence that drew a drop (the only ones
    # whose dropped pass differs from the full one), each with at least one layer dropped
    assert all(k.shape[1] == L and k.shape[0] > B and bool(k[:B].all()) for k in kept)
    again = [~k[B:] for k in kept]  # (sequences with a drop, L): True where the layer's memory is dropped
    assert all(bool(a.any(-1).all()) for a in again)
    n = len(kept) * B
    assert sum(int(a.sum()) for a in again) / (n * L) == pytest.approx(0.1, abs=0.01)
    one_of_two = sum(int((a.sum(-1) == 1).sum()) for a in again) / n
    assert one_of_two == pytest.approx(2 * 0.1 * 0.9, abs=0.02)  # layers drawn independently
    both = sum(sum(0 < int(a[:, l].sum()) < B for l in range(L)) for a in again) / (len(kept) * L)
    assert both > 0.9  # both outcomes within a batch and layer


def _fast_back_translation(monkeypatch):
    """Back-translation by the backbone replaced by a constant (the phrase memory's source side is not under test)."""
    import memories.phrases as ph

    monkeypatch.setattr(ph, "generate_greedy", lambda backbone, contexts, **kw: [backbone.encode_target(" xyz")
                                                                                 for _ in contexts])


def _allocation_by_hand(lengths, layers, how):
    """Xu et al.'s allocation: items ordered by length (ties by index), cut into len(layers) contiguous shares as
    equal as can be (the first n mod L shares one longer), the shortest share on the lowest layer (short_to_long) or
    on the highest (long_to_short); with fewer items than layers, one item on each of n evenly spaced layers."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    k = min(n, len(layers))
    sizes = [n // k + (1 if j < n % k else 0) for j in range(k)]
    shares, at = [], 0
    for size in sizes:
        shares.append(order[at:at + size])
        at += size
    chosen = list(layers) if k == len(layers) else [layers[round(j * (len(layers) - 1) / (k - 1))]
                                                    for j in range(k)] if k > 1 else [layers[-1]]
    if how == "long_to_short":
        chosen = chosen[::-1]
    return dict(sorted(zip(chosen, shares)))


@pytest.mark.parametrize("lengths, layers", [([5, 1, 3, 8, 2, 13, 2], [0, 1, 2]), ([4, 4, 1, 9, 3], [2, 5]),
                                             ([7, 2], [0, 1, 2, 3, 4]), ([3, 1, 2, 6, 5, 4, 1, 8], [0, 1, 2, 3])])
def test_memory_adapter_allocates_short_phrases_to_low_layers_by_hand(lengths, layers):
    from plugins.memory_adapter import allocate

    for how in ("short_to_long", "long_to_short"):
        got = allocate(lengths, layers, how)
        assert got == _allocation_by_hand(lengths, layers, how), how
        order = sorted(got)
        longest = [max(lengths[i] for i in got[l]) for l in order]
        shortest = [min(lengths[i] for i in got[l]) for l in order]
        if how == "short_to_long":  # every item of a lower layer is no longer than any item of a higher one
            assert all(a <= b for a, b in zip(longest, shortest[1:]))
        else:
            assert all(a >= b for a, b in zip(shortest, longest[1:]))


def test_memory_adapter_phrase_memory_puts_short_phrases_on_the_lowest_layer(tiny, tiny_memory, monkeypatch):
    """The plug-in's memory build: the phrase pairs' items go to the layers in the paper's short-to-long order (the
    default), and each layer's memory rows (``phrase_ids``) are that layer's phrases."""
    import plugins.memory_adapter as ma
    from memories.phrases import PhrasePair
    from plugins.api import new_plugin

    words = ["Haus", "ist klein", "die Katze schlaeft", "Guten Morgen", "hallo", "das Haus ist klein und alt",
             "Welt", "die kleine Katze"]
    pairs = [PhrasePair(f"src {i}", w, 0, len(w.split()), "back") for i, w in enumerate(words)]
    monkeypatch.setattr(ma, "phrase_pairs_for_memory", lambda *a, **kw: list(pairs))
    for how in ("short_to_long", "long_to_short"):
        p = new_plugin("memory_adapter", tiny, tiny_memory, {"allocation": how, "max_translate": 0})
        p.build_memory(tiny_memory)
        want = _allocation_by_hand([q.length for q in pairs], list(range(tiny.num_layers)), how)
        got = {int(l): sorted(words.index(p.phrases[g]["tgt"]) for g in blk.phrase_ids.tolist())
               for l, blk in p.blocks.items()}
        assert got == {l: sorted(idx) for l, idx in want.items()}, how
        assert all(p.phrases[g]["layer"] == int(l) for l, blk in p.blocks.items() for g in blk.phrase_ids.tolist())
    assert p.config.allocation == "long_to_short" and ma.MemoryAdapterConfig().allocation == "short_to_long"


def test_memory_adapter_own_sentence_is_masked_out_of_each_training_rows_attention_by_hand(tiny, tiny_memory,
                                                                                           monkeypatch):
    """While training (both passes of ``train_batch_loss`` and the early-stopping NLL), each layer's adapters compute
    R = softmax over the items *other than* those whose target is the row's own whole target sentence — the weight of
    those is exactly 0 and the rest renormalise —, written here per row in float64 from the layer's input, the
    samples' sentences and the items' texts (not from the plug-in's mask), for both sides in series."""
    from memories.phrases import normalize
    from plugins.api import new_plugin
    from plugins.memory_adapter import LayerBlock
    from plugins.seqtrain import collate, memory_sequences

    _fast_back_translation(monkeypatch)
    p = new_plugin("memory_adapter", tiny, tiny_memory, {"whole_sentences": True, "max_translate": 8,
                                                        "memory_dropout": 0.3})
    p.build_memory(tiny_memory)
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():  # a gate that lets R through, so the mask changes the output
        for blk in p.blocks.values():
            for ad in blk.adapters.values():
                ad.W_2.copy_(0.3 * torch.randn(ad.W_2.shape, generator=g))
                ad.b_2.fill_(-1.0)
    rows = tiny_memory.split_samples("train")
    data = memory_sequences(tiny, tiny_memory, "train")
    ids, mask, labels = collate(tiny, data, range(len(data)))
    layer_of = {id(blk): int(l) for l, blk in p.blocks.items()}

    # the training pass's rows: every sample, then again each sample that drew a drop (the same draw as the plug-in's)
    B = len(data)
    drop = torch.rand(B, len(p.adapted_layers), generator=torch.Generator().manual_seed(0)) < p.config.memory_dropout
    sample_of = list(range(B)) + drop.any(1).nonzero().flatten().tolist()
    assert len(sample_of) > B

    def own_by_hand(blk, n_rows):
        items = [normalize(p.phrases[j]["tgt"]) for j in blk.phrase_ids.tolist()]
        return torch.tensor([[t == normalize(rows[sample_of[b]]["tgt"]) for t in items] for b in range(n_rows)])

    def layer_by_hand(blk, a, keep, own):
        x = a.double() / blk.scale.double()
        T = p.config.temperature
        for side in blk.sides:
            ad, K = blk.adapters[side], getattr(blk, f"mem_{side}").double()
            Wq, Wk, Wv, W1, W2, b2 = (w.detach().double() for w in (ad.W_q, ad.W_k, ad.W_v, ad.W_1, ad.W_2, ad.b_2))
            out = x.clone()
            for b in range(x.shape[0]):
                others = ~own[b]
                if not others.any() or (keep is not None and not bool(keep[b])):
                    continue  # no item left, or this layer's memory dropped for the row: the identity
                logits = (x[b] @ Wq @ Wk.T @ K[others].T) / (T * math.sqrt(ad.d))
                att = torch.softmax(logits, -1)
                r = att @ K[others] @ Wv
                lam = torch.sigmoid(torch.relu(torch.cat([x[b], r], -1) @ W1) @ W2 + b2)
                out[b] = lam * x[b] + (1 - lam) * r
            x = out
        return x * blk.scale.double()

    seen = []
    orig = LayerBlock.apply

    def spy(self, a, prep, keep=None, exclude=None):
        out, info = orig(self, a, prep, keep, exclude)
        seen.append((self, a.detach(), None if keep is None else keep.detach(), out.detach(), info))
        return out, info

    monkeypatch.setattr(LayerBlock, "apply", spy)
    p._own = p._own_sentence_tables(tiny_memory)  # what train_adapters' prepare sets
    p._drop_rng = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            p.train_batch_loss(ids, mask, labels)  # rows 0..B-1 the samples, then those that drew a drop
            p.hooked_seq_loss(ids, mask, labels)
    finally:
        p._own = None
    assert len(seen) == 2 * len(p.adapted_layers)
    masked = 0
    for blk, a, keep, out, info in seen:
        own = own_by_hand(blk, a.shape[0])
        masked += int(own.sum())
        want = layer_by_hand(blk, a, keep, own)
        assert torch.allclose(out.double(), want, atol=1e-4), layer_of[id(blk)]
        hidden = own & ~own.all(-1, keepdim=True)  # a row with no other item skips the layer instead
        for side, (att, _g) in info.items():
            assert float((att.double() * hidden[:, None, :].to(att.device)).abs().max()) == 0.0
    assert masked > 0  # the memory does hold training answers (whole sentences), so the mask is exercised
    assert p._exclusion(labels) is None  # outside training (decoding) nothing is masked


def test_memory_adapter_phrase_length_cap_by_hand(tiny, tmp_path, monkeypatch):
    """The chunker's phrases are at most ``max_len`` words and the cap is inclusive: for Xu et al.'s marker chunking
    of this sentence the phrases are, written out by hand, (markers: Es, ein, über, den, von, zu; a marker-free run
    longer than the cap cut into windows; runs of whole chunks up to the cap); and the plug-in's
    ``max_phrase_len_other`` is the cap its memory is built with (on a memory whose every target, whichever is held
    out, chunks into "das X ist" at cap 3 and "das X", "ist Y" at cap 2)."""
    from memories.phrases import chunk_phrases
    from plugins.api import new_plugin

    gold = "Es war noch nie leicht, ein rationales Gespräch über den Wert von Gold zu führen."
    words = {"war", "noch", "nie", "leicht", "rationales", "Gespräch", "Wert", "Gold", "führen"}
    assert set(chunk_phrases(gold, 3)) == words | {"Es war noch", "nie leicht", "ein rationales Gespräch",
                                                   "über den Wert", "von Gold", "zu führen"}
    assert set(chunk_phrases(gold, 4)) == words | {"Es war noch nie", "ein rationales Gespräch", "über den Wert",
                                                   "von Gold", "von Gold zu führen", "zu führen"}
    assert set(chunk_phrases(gold, 2)) == words | {"Es war", "noch nie", "ein rationales", "von Gold", "zu führen"}

    pairs = [("the house is small", "das Haus ist klein"), ("the car is red", "das Auto ist rot"),
             ("the book is new", "das Buch ist neu"), ("the child is here", "das Kind ist hier")] * 3
    mem = build_memory(tiny, [Sample(s, t, i + 1) for i, (s, t) in enumerate(pairs)], tmp_path / "m",
                       prompt=Prompt.for_task("translation"))
    assert 0 < len(mem.split_samples("heldout")) < len(pairs)
    _fast_back_translation(monkeypatch)
    longest = {}
    for cap in (2, 3):
        p = new_plugin("memory_adapter", tiny, mem, {"max_phrase_len_other": cap, "max_translate": 64})
        p.build_memory(mem)
        lengths = [len(ph["tgt"].split()) for ph in p.phrases]
        assert all(ph["length"] == n for ph, n in zip(p.phrases, lengths))
        longest[cap] = max(lengths)
    assert longest == {2: 2, 3: 3}


# --- Memory-Tuning (Qi et al., TASLP 2024) ------------------------------------------------------------------------

def _mt_with_random_weights(tiny, variant: str, seed: int = 21, **cfg):
    from plugins.memory_tuning import MemoryTuning, MemoryTuningConfig

    p = MemoryTuning(MemoryTuningConfig(variant=variant, **cfg), tiny, {})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in p.named_parameters():
            w.copy_(torch.randn(w.shape, generator=g) * (0.5 if "W_query" in name else 1.0))
    return p.to(tiny.device), g


def _slot_read_by_hand(mem, H: torch.Tensor, scaled: bool = False) -> torch.Tensor:
    """ΔH = softmax(H·W_query·(M·W_key)ᵀ)·M·W_value·W_o in float64 (nn.Linear stores the transposed matrices);
    ``scaled`` divides the scores by √s — the wrong variant."""
    H = H.double()
    Wq, Wk, Wv, Wo = (m.weight.detach().double() for m in (mem.W_query, mem.W_key, mem.W_value, mem.W_o))
    M = mem.M.detach().double()
    scores = (H @ Wq.T) @ (M @ Wk.T).T
    if scaled:
        scores = scores / math.sqrt(M.shape[1])
    return torch.softmax(scores, dim=-1) @ (M @ Wv.T) @ Wo.T


def test_memory_tuning_ffn_memory_attention_is_unscaled(tiny):
    """§III, footnote 2: a(H) = softmax(H·W_query·(M·W_key)ᵀ) without 1/√s; ΔH = a(H)·M·W_value·W_o, W_key and
    W_value s × s. With the project's fixed per-feature scale s_l: H + s_l ⊙ ΔH(H ⊘ s_l)."""
    from plugins.network import Attachment

    p, g = _mt_with_random_weights(tiny, "MT-F", slots=6, slot_size=4)
    mem = p.ffn_mem[0]
    assert tuple(mem.W_key.weight.shape) == tuple(mem.W_value.weight.shape) == (4, 4) and tuple(mem.M.shape) == (6, 4)
    X = (torch.randn(2, 3, tiny.hidden_size, generator=g) * 2).to(tiny.device)  # the FFN's input
    H = (torch.randn(2, 3, tiny.hidden_size, generator=g) * 2).to(tiny.device)  # the FFN's output
    hook = p._ffn_hook(0, Attachment(None, p.settings({"scale": 1.0})), False, {})
    with torch.no_grad():
        p.ffn_scale.fill_(1.0)  # the paper's equation exactly
        got = hook(None, (X,), H).double()
        assert torch.allclose(got, H.double() + _slot_read_by_hand(mem, H), atol=1e-4)
        assert not torch.allclose(got, H.double() + _slot_read_by_hand(mem, H, scaled=True), atol=1e-2)
        assert not torch.allclose(got, H.double() + _slot_read_by_hand(mem, X), atol=1e-2)  # queried with the input
        s = (torch.rand(tiny.hidden_size, generator=g) * 2 + 0.5).to(tiny.device)
        p.ffn_scale[0] = s
        got = hook(None, (X,), H).double()
        assert torch.allclose(got, H.double() + s.double() * _slot_read_by_hand(mem, H / s), atol=1e-4)
        # σ (decode-time ``scale``) multiplies ΔH
        half = p._ffn_hook(0, Attachment(None, p.settings({"scale": 0.5})), False, {})(None, (X,), H).double()
        assert torch.allclose(half, H.double() + 0.5 * s.double() * _slot_read_by_hand(mem, H / s), atol=1e-4)


def test_memory_tuning_mt_f_reads_and_writes_every_blocks_ffn_output(tiny, monkeypatch):
    """MT-F in the whole model equals each block's FFN replaced by H + ΔH(H), H = FFN(x) (written here by hand), and
    not H + ΔH(x) (queried with the FFN's input)."""
    p, g = _mt_with_random_weights(tiny, "MT-F", slots=5, slot_size=3)
    ids = torch.tensor([tiny.encode_context("the house is small")[:8]] * 2).to(tiny.device)

    def reference(query_from_input: bool):
        with monkeypatch.context() as m:
            for l, layer in enumerate(tiny.layers):
                def forward(x, f=layer.mlp.forward, mem=p.ffn_mem[l]):
                    h = f(x)
                    return (h.double() + _slot_read_by_hand(mem, x if query_from_input else h)).to(h.dtype)
                m.setattr(layer.mlp, "forward", forward)
            with torch.no_grad():
                return tiny.forward_fc(ids)[0]

    handles = p.attach(None, {})
    try:
        with torch.no_grad():
            got = tiny.forward_fc(ids)[0]
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        base = tiny.forward_fc(ids)[0]
    assert not torch.allclose(got, base, atol=1e-3)
    assert torch.allclose(got, reference(False), atol=1e-4)
    assert not torch.allclose(got, reference(True), atol=1e-3)


def test_memory_tuning_mt_f_training_path_one_step_matches_the_equation_and_the_decode_path(tiny, monkeypatch):
    """MT-F trained through its training path (gradients on: ``train_batch_loss``, one SGD step) computes
    H + s_l ⊙ softmax((H ⊘ s_l)·W_query·(M·W_key)ᵀ)·M·W_value·W_o (no 1/√s) at every layer: its forward and the
    targets' NLL equal the equation's written here in float64, its gradients equal the equation's gradients, and after
    the step the folded decode path (a comparison's rows, no gradients) gives the same states as the training path
    and the equation with the updated weights."""
    from plugins.seqtrain import SeqData, collate

    p, g = _mt_with_random_weights(tiny, "MT-F", slots=6, slot_size=16)
    texts = ("the house is small", "hello world, this is a test")
    data = SeqData([tiny.encode_context(t)[:6] for t in texts], [tiny.encode_target(" das Haus ist klein")] * 2)
    ids, mask, labels = collate(tiny, data, range(2))
    mlp_out = {}
    grabs = [layer.mlp.register_forward_hook(lambda mod, a, out, l=l: mlp_out.setdefault(l, out))
             for l, layer in enumerate(tiny.layers)]
    with torch.no_grad():
        tiny.forward_fc(ids, attention_mask=mask)
    for h in grabs:
        h.remove()
    with torch.no_grad():  # s_l near the MLP output's per-feature RMS (as ``fit`` sets it), W_query small: scores of
        for l, mem in enumerate(p.ffn_mem):  # order 1, so the attention mixes its slots and a 1/√s would show
            mem.W_query.weight.mul_(0.1)
            rms = mlp_out[l].float().pow(2).mean((0, 1)).sqrt()
            p.ffn_scale[l] = rms * (torch.rand(rms.shape, generator=g) + 0.5).to(rms.device)
    B = ids.shape[0]
    names = ("M", "W_query", "W_key", "W_value", "W_o")

    def weights(mem):  # (M, W_query, W_key, W_value, W_o) as float64 leaves; nn.Linear stores the transposes
        return [(mem.M if n == "M" else getattr(mem, n).weight).detach().double().requires_grad_(True) for n in names]

    def by_hand(ws):
        """(pre-norm states, target NLL) with every MLP output H replaced by the equation's H + s ⊙ ΔH(H ⊘ s)."""
        with monkeypatch.context() as mp:
            for l, layer in enumerate(tiny.layers):
                def forward(x, f=layer.mlp.forward, w=ws[l], s=p.ffn_scale[l].double()):
                    h = f(x)
                    M, Wq, Wk, Wv, Wo = w
                    Hs = h.double() / s
                    a = torch.softmax((Hs @ Wq.T) @ (M @ Wk.T).T, dim=-1)
                    return (h.double() + s * (a @ (M @ Wv.T) @ Wo.T)).to(h.dtype)
                mp.setattr(layer.mlp, "forward", forward)
            fc, _ = tiny.forward_fc(ids, attention_mask=mask)
        sel = labels != -100
        return fc, F.cross_entropy(head_by_hand(tiny, fc[sel].float()), labels[sel])

    hand_w = [weights(mem) for mem in p.ffn_mem]
    fc_hand, nll_hand = by_hand(hand_w)
    nll_hand.backward()

    params = p._trainable()
    for q in params:
        q.requires_grad_(True)
    with torch.enable_grad():
        handles = p.attach(None, {})
        try:
            fc_train, _ = tiny.forward_fc(ids, attention_mask=mask)
        finally:
            for h in handles:
                h.remove()
        loss, n_tgt, _ = p.train_batch_loss(ids, mask, labels)
    assert fc_train.requires_grad and loss.requires_grad
    assert torch.allclose(fc_train.double(), fc_hand.double(), atol=1e-4)
    assert float(loss.detach()) == pytest.approx(float(nll_hand.detach()), rel=1e-5)
    assert n_tgt == int((labels != -100).sum())
    loss.backward()
    for mem, ws in zip(p.ffn_mem, hand_w):
        for n, w in zip(names, ws):
            got = (mem.M if n == "M" else getattr(mem, n).weight).grad
            assert got is not None and float(got.abs().max()) > 0, n
            assert torch.allclose(got.double(), w.grad, rtol=1e-3, atol=1e-6), n

    # the attention really mixes its slots (else a 1/√s could not change it) and the scaled variant differs
    with torch.no_grad():
        for l, mem in enumerate(p.ffn_mem):
            scores = mem.W_query(mlp_out[l] / p.ffn_scale[l]) @ mem.W_key(mem.M).T
            assert float(torch.softmax(scores, -1).max(-1).values.mean()) < 0.9
            assert float((torch.softmax(scores, -1) - torch.softmax(scores / 4, -1)).abs().max()) > 0.05

    opt = torch.optim.SGD(params, lr=0.5)
    opt.step()
    with torch.no_grad():
        for ws in hand_w:
            for w in ws:
                w -= 0.5 * w.grad
    fc_hand2, _ = by_hand(hand_w)
    assert not torch.allclose(fc_hand2, fc_hand, atol=1e-3)  # the step moved the output
    with torch.enable_grad():
        handles = p.attach(None, {})
        try:
            fc_train2, _ = tiny.forward_fc(ids, attention_mask=mask)
        finally:
            for h in handles:
                h.remove()
    handles = p.attach(torch.arange(B), {})  # decoding: a comparison's rows, the folded read
    try:
        with torch.no_grad():
            fc_decode, _ = tiny.forward_fc(ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    assert torch.allclose(fc_train2.double(), fc_hand2.double(), atol=1e-4)
    assert torch.allclose(fc_decode.double(), fc_hand2.double(), atol=1e-4)
    assert torch.allclose(fc_decode, fc_train2.detach(), atol=1e-4)


def _rope_by_hand(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin


def test_memory_tuning_mt_m_is_prefix_attention_with_he_et_al_gate(tiny):
    """MT-M = prefix tuning (l prefix keys/values per key/value head, prepended in the attention): by He et al.
    (ICLR 2022, eq. 6–7), head = (1 − λ)·Attn(q, K, V) + λ·softmax(c·q·P_kᵀ + log σ)·P_v with the gate
    λ = Σ exp(c·q·P_kᵀ + log σ) / (Σ exp(c·q·P_kᵀ + log σ) + Σ_causal exp(c·q·Kᵀ)), written here per head in float64.
    Only the plug-in's rows get the prefix; the trace reports the head-averaged λ and attention within the prefix."""
    L = tiny.num_layers
    p, g = _mt_with_random_weights(tiny, "MT-M", prefix_length=3)
    with torch.no_grad():
        p.key_rms.copy_(torch.rand(p.key_rms.shape, generator=g) + 0.5)
        p.value_rms.copy_(torch.rand(p.value_rms.shape, generator=g) + 0.5)
    attn = tiny.layers[L - 1].self_attn
    H_, hd = tiny.model.config.num_attention_heads, attn.head_dim
    n_kv = tiny.model.config.num_key_value_heads
    T = 5
    x = torch.randn(2, T, tiny.hidden_size, generator=g).to(tiny.device)
    cos, sin = tiny.decoder.rotary_emb(x, torch.arange(T, device=tiny.device)[None])

    def by_hand(b: int, sigma: float | None, gate: bool = True):
        X = x[b].double()
        q = (X @ attn.q_proj.weight.double().T).view(T, H_, hd).transpose(0, 1)
        k = (X @ attn.k_proj.weight.double().T).view(T, n_kv, hd).transpose(0, 1)
        v = (X @ attn.v_proj.weight.double().T).view(T, n_kv, hd).transpose(0, 1)
        q, k = _rope_by_hand(q, cos[0].double(), sin[0].double()), _rope_by_hand(k, cos[0].double(), sin[0].double())
        Pk = (p.prefix_k[L - 1] * p.key_rms[L - 1]).detach().double()
        Pv = (p.prefix_v[L - 1] * p.value_rms[L - 1]).detach().double()
        c = attn.scaling
        heads, lams, within = [], [], []
        causal = torch.ones(T, T).tril().bool()
        for h in range(H_):
            j = h // (H_ // n_kv)
            e_ctx = torch.exp((q[h] @ k[j].T * c).masked_fill(~causal, -math.inf))
            ctx = (e_ctx / e_ctx.sum(-1, keepdim=True)) @ v[j]
            if sigma is None:
                heads.append(ctx)
                continue
            e_pre = torch.exp(q[h] @ Pk[j].T * c + math.log(sigma))
            lam = e_pre.sum(-1) / (e_pre.sum(-1) + e_ctx.sum(-1))
            pre = (e_pre / e_pre.sum(-1, keepdim=True)) @ Pv[j]
            heads.append((1 - lam)[:, None] * ctx + lam[:, None] * pre if gate else ctx + pre)
            lams.append(lam)
            within.append(e_pre / e_pre.sum(-1, keepdim=True))
        out = torch.cat(heads, dim=-1) @ attn.o_proj.weight.double().T
        return out, lams, within

    def run(rows, settings):
        handles = p.attach(rows, settings)
        try:
            with torch.no_grad():
                out = attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)[0]
        finally:
            for h in handles:
                h.remove()
        return out.double(), handles

    for sigma in (1.0, 0.5):
        got, _ = run(None, {"scale": sigma})  # training's path: every row, one pass
        for b in range(2):
            want, lams, _ = by_hand(b, sigma)
            assert torch.allclose(got[b], want, atol=1e-4)
            assert 0.05 < float(torch.stack(lams).min()) and float(torch.stack(lams).max()) < 0.95
        assert not torch.allclose(got[0], by_hand(0, sigma, gate=False)[0], atol=1e-2)
    got, handles = run(torch.tensor([1]), {})  # a comparison batch: row 1 is the plug-in's, row 0 is not
    want, lams, within = by_hand(1, 1.0)
    assert torch.allclose(got[1], want, atol=1e-4) and torch.allclose(got[0], by_hand(0, None)[0], atol=1e-4)
    trace = p.network_trace(handles)[0]
    assert trace["attention_lambda"] == pytest.approx(float(torch.stack(lams)[:, -1].mean()), abs=1e-3)
    assert trace["weights"] == pytest.approx(torch.stack(within)[:, -1].mean(0).tolist(), abs=1e-3)


def test_memory_tuning_mt_m_equals_prefix_tuning_through_past_key_values(tiny):
    """The whole model with MT-M equals prefix tuning as peft does it — the prefix keys/values handed to the model
    as a pre-filled KV cache, the real tokens keeping positions 0…T−1 — and a cached, row-restricted decode of the
    same tokens gives the same states for the plug-in's row and the frozen model's for the others."""
    from transformers import DynamicCache

    p, g = _mt_with_random_weights(tiny, "MT-M", prefix_length=4)
    ids = torch.tensor([tiny.encode_context(t)[:7] for t in ("the house is small", "hello world, this is a test")])
    ids = ids.to(tiny.device)
    B, T = ids.shape
    cache = DynamicCache()
    with torch.no_grad():
        for l in range(tiny.num_layers):
            pk = (p.prefix_k[l] * p.key_rms[l]).unsqueeze(0).expand(B, -1, -1, -1).contiguous()
            pv = (p.prefix_v[l] * p.value_rms[l]).unsqueeze(0).expand(B, -1, -1, -1).contiguous()
            cache.update(pk, pv, l)
        want = tiny.decoder(input_ids=ids, attention_mask=torch.ones(B, 4 + T, dtype=torch.long, device=ids.device),
                            past_key_values=cache, position_ids=torch.arange(T, device=ids.device)[None].expand(B, -1),
                            use_cache=True).last_hidden_state
        base = tiny.decoder(input_ids=ids).last_hidden_state
    handles = p.attach(None, {})
    try:
        with torch.no_grad():
            got = tiny.decoder(input_ids=ids).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    assert torch.allclose(got, want, atol=1e-4) and not torch.allclose(got, base, atol=1e-2)
    handles = p.attach(torch.tensor([1]), {})
    try:
        with torch.no_grad():
            out = tiny.decoder(input_ids=ids[:, :4], use_cache=True)
            steps, past = [out.last_hidden_state], out.past_key_values
            for t in range(4, T):
                out = tiny.decoder(input_ids=ids[:, t:t + 1], past_key_values=past, use_cache=True)
                steps.append(out.last_hidden_state)
                past = out.past_key_values
    finally:
        for h in handles:
            h.remove()
    steps = torch.cat(steps, dim=1)
    assert torch.allclose(steps[1], want[1], atol=1e-4) and torch.allclose(steps[0], base[0], atol=1e-5)


def test_in_network_methods_never_see_the_heldout_samples(tiny, tmp_path, monkeypatch):
    """Adapter, LoRA, memory-tuning and the memory adapter early-stop on a seeded tenth of the memory's *training*
    samples and draw their candidate vocabulary from training entries only: nothing of the held-out split (what
    ``eval --memory`` and the Evaluate tab report on) is read while training."""
    import plugins.network as network
    from plugins.api import make_config
    from plugins.registry import get_method
    from plugins.seqtrain import memory_sequences

    mem = _memory_with_unique_heldout_token(tiny, tmp_path / "m")
    only_held = set(np.asarray(mem.heldout_values).tolist()) - set(np.asarray(mem.values).tolist()) \
        - set(tiny.stop_ids)
    assert only_held
    pair = lambda d, i: (tuple(d.contexts[i]), tuple(d.targets[i]))  # noqa: E731
    train_all = memory_sequences(tiny, mem, "train")
    held = memory_sequences(tiny, mem, "heldout")
    train_pairs, held_pairs = {pair(train_all, i) for i in range(len(train_all))}, {pair(held, i) for i in
                                                                                 range(len(held))}

    class TrainingOnly(Memory):  # any access to the held-out split fails the test
        def _arr(self, name):
            assert not name.startswith("heldout"), f"training read {name}"
            return super()._arr(name)

        def split_samples(self, split):
            assert split != "heldout", "training read the held-out samples"
            return super().split_samples(split)

    seen: dict = {}
    data, vocab = network.NetworkPlugin._data, network.candidate_vocabulary

    def spy_data(self, memory):
        seen["data"] = data(self, memory)
        return seen["data"]

    def spy_vocab(*a, **kw):
        seen["candidates"] = vocab(*a, **kw)
        return seen["candidates"]

    monkeypatch.setattr(network.NetworkPlugin, "_data", spy_data)
    monkeypatch.setattr(network, "candidate_vocabulary", spy_vocab)
    common = {"max_epochs": 1, "batch_size": 4, "max_minutes": 0.0, "softmax": "candidates", "candidate_top_k": 0}
    own = {"lora": {"rank": 8}, "memory_adapter": {"max_pairs": 40, "max_translate": 8}}
    for method in ("adapter", "lora", "memory_tuning", "memory_adapter"):
        seen.clear()
        cls = get_method(method)
        p = cls(make_config(method, {**common, **own.get(method, {})}), tiny, {"key_rms": mem.key_scale})
        p.fit(TrainingOnly(path=mem.path, meta=mem.meta))
        train, stop = seen["data"]
        assert len(train) + len(stop) == len(train_all) and 1 <= len(stop) < len(train_all), method
        stop_pairs = {pair(stop, i) for i in range(len(stop))}
        assert stop_pairs <= train_pairs and not stop_pairs & held_pairs, method
        assert not only_held & set(seen["candidates"].tolist()), method
        assert p.train_info["early_stop_samples"] == len(stop), method
