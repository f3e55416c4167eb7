"""float16 activations on a backbone whose residual stream exceeds float16's range (Gemma 3 270M: |h| ≈ 1.0e5, f(c)
66,095, float16's largest value 65,504): a full-float16 model (a GPU's ``--dtype float16``) is refused with a message
naming bfloat16; a CPU's float16 (weight-only, float32 activations) and bfloat16 are not. Checked on the CPU with the
tiny model, its embedding scaled so that its residual stream reaches Gemma's range."""
import copy

import pytest
import torch

import backbone.loading as loading
from backbone.model import FLOAT16_MAX, FLOAT16_SAFE, check_float16_range, load_backbone, residual_peak
from backbone.tiny import tiny_backbone
from ground.errors import UserError


def _scaled_tiny(factor: float):
    t = tiny_backbone()
    with torch.no_grad():
        t.model.get_input_embeddings().weight.mul_(factor)
    return t


def test_residual_peak_is_the_largest_state_of_every_layer(tiny):
    seen = []
    hooks = [m.register_forward_hook(lambda mod, a, out: seen.append(float(
        (out[0] if isinstance(out, tuple) else out).abs().max()))) for m in (tiny.decoder.embed_tokens, *tiny.layers)]
    try:
        peak = residual_peak(tiny.model, tiny.tokenizer)
    finally:
        for h in hooks:
            h.remove()
    assert peak == max(seen) and 0 < peak < 100


def test_float16_activations_beyond_the_range_are_refused_naming_bfloat16():
    big = _scaled_tiny(3e4)
    peak = residual_peak(big.model, big.tokenizer)
    assert FLOAT16_MAX < peak < float("inf")  # the float32 model is fine, its float16 copy is not
    half = copy.deepcopy(big.model).half()
    assert residual_peak(half, big.tokenizer) == float("inf")  # float16 overflows to inf on the CPU too
    with pytest.raises(UserError, match="bfloat16"):
        check_float16_range(half, big.tokenizer, "big")
    check_float16_range(big.model, big.tokenizer, "big")  # float32 activations: nothing to refuse
    check_float16_range(copy.deepcopy(big.model).to(torch.bfloat16), big.tokenizer, "big")
    # within float16's range but past the safety margin: refused too (another input may reach further)
    mid = _scaled_tiny(1.0)
    p0 = residual_peak(mid.model, mid.tokenizer)
    with torch.no_grad():
        mid.model.get_input_embeddings().weight.mul_(0.75 * FLOAT16_MAX / p0)
    half = mid.model.half()
    assert FLOAT16_SAFE < residual_peak(half, mid.tokenizer) < FLOAT16_MAX
    with pytest.raises(UserError, match="bfloat16"):
        check_float16_range(half, mid.tokenizer, "mid")


def test_an_ordinary_model_runs_in_float16():
    small = tiny_backbone()
    half = small.model.half()
    assert residual_peak(half, small.tokenizer) < FLOAT16_SAFE
    check_float16_range(half, small.tokenizer, "tiny")


def test_load_backbone_refuses_full_float16_and_keeps_the_cpus_weight_only_float16(tmp_path, monkeypatch):
    """The load path: a full-float16 load (what --dtype float16 does on a GPU, forced here on the CPU) of the scaled
    model is refused before any use; the CPU's own float16 (weight-only) and bfloat16 load it and give finite
    logits."""
    big = _scaled_tiny(3e4)
    big.model.save_pretrained(tmp_path / "big")
    big.tokenizer.save_pretrained(tmp_path / "big")
    for dtype in ("float16", "bfloat16"):
        bb = load_backbone(str(tmp_path / "big"), device="cpu", dtype=dtype)
        ids = torch.tensor([bb.encode_context("English: the house is small\nGerman:")])
        with torch.no_grad():
            fc, _ = bb.forward_fc(ids)
            assert torch.isfinite(bb.logits_from_fc(fc[:, -1])).all(), dtype
    real = loading._dtype
    monkeypatch.setattr(loading, "_dtype", lambda dtype, dev: torch.float16 if dtype == "float16" else real(dtype, dev))
    with pytest.raises(UserError, match="--dtype bfloat16"):
        load_backbone(str(tmp_path / "big"), device="cpu", dtype="float16")
