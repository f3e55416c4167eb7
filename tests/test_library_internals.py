"""The library internals the project relies on, one module per library (``backbone/torch_internals.py``,
``backbone/hf_internals.py``): each names the version it was checked against, which must be the one requirements.txt
pins and the one installed; and each internal it uses is checked here for the behaviour the project relies on, so
that an upgrade fails here — naming the internal — rather than as a wrong decode somewhere else."""
from __future__ import annotations

import re
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backbone import hf_internals, torch_internals

ROOT = Path(__file__).resolve().parent.parent


def pinned(package: str) -> str:
    m = re.search(rf"^{re.escape(package)}==([^\s#]+)", (ROOT / "requirements.txt").read_text(), re.MULTILINE)
    assert m, f"requirements.txt pins no {package}"
    return m.group(1)


@pytest.mark.parametrize("package,module", [("torch", torch_internals), ("transformers", hf_internals)])
def test_the_internals_are_checked_against_the_pinned_and_installed_version(package, module):
    where = f"backbone/{module.__name__.split('.')[-1]}.py"
    pin = pinned(package)
    assert module.PINNED == pin, (
        f"requirements.txt pins {package}=={pin}, but {where} was checked against {package} {module.PINNED}: run "
        f"tests/test_library_internals.py with {pin} installed, fix what fails in {where}, then set its PINNED")
    have = installed_version(package).split("+")[0]  # a local build tag (+cpu, +cu128) is the same release
    assert have == pin, (
        f"{package} {have} is installed but {pin} is pinned (requirements.txt), and {where} relies on {package} "
        f"{pin}'s internals: install {package}=={pin}, or check {where} against {have} and update the pin")


# --- torch ---------------------------------------------------------------------------------------------------------
def test_a_hook_handle_shows_its_tables_and_its_entries_can_be_put_back():
    lin = nn.Linear(2, 2)
    calls = []
    h = lin.register_forward_hook(lambda mod, args, kwargs, out: calls.append(1), with_kwargs=True)
    tables = torch_internals.hook_tables(h)
    key = torch_internals.hook_id(h)
    assert tables[0] is lin._forward_hooks and key in tables[0] and key in lin._forward_hooks_with_kwargs
    assert any(t is lin._forward_hooks_with_kwargs for t in tables)
    kept = [(t, key, t[key]) for t in tables if key in t]
    h.remove()
    lin(torch.ones(1, 2))
    assert not calls
    for t, key, entry in kept:
        t[key] = entry
    lin(torch.ones(1, 2))
    assert calls == [1]  # the very same hook, with its with_kwargs flag
    assert torch_internals.hook_tables(object()) is None


def test_module_hook_tables_are_cleared_and_copied_by_name():
    assert all(isinstance(getattr(nn.Module(), n), dict) for n in torch_internals.MODULE_HOOK_TABLES)
    outer = nn.Sequential(nn.Linear(2, 2))
    calls = []
    outer[0].register_forward_pre_hook(lambda mod, args: calls.append("pre"))
    outer[0].register_forward_hook(lambda mod, args, out: calls.append("post"))
    copy = nn.Linear(2, 2)
    torch_internals.copy_forward_hooks(outer[0], copy)
    copy(torch.ones(1, 2))
    assert calls == ["pre", "post"]
    torch_internals.clear_module_hooks(outer)
    outer(torch.ones(1, 2))
    assert calls == ["pre", "post"]


def test_an_unregistered_attribute_is_no_parameter_buffer_or_submodule():
    owner = nn.Linear(2, 2)
    sub = nn.Linear(2, 2)
    assert torch_internals.unregistered(owner, "kept") is None
    torch_internals.set_unregistered(owner, "kept", (sub, 1))
    assert torch_internals.unregistered(owner, "kept") == (sub, 1) and owner.kept == (sub, 1)
    assert set(owner.state_dict()) == {"weight", "bias"} and not list(owner.children())


def test_a_version_counter_grows_with_in_place_changes():
    t = torch.zeros(3)
    v = torch_internals.version(t)
    t.add_(1)
    assert torch_internals.version(t) > v
    w = nn.Linear(2, 2)
    v = torch_internals.version(w.weight)
    w.load_state_dict({"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    assert torch_internals.version(w.weight) > v
    with torch.inference_mode():
        frozen = torch.zeros(2)
    with pytest.raises(RuntimeError):
        torch_internals.version(frozen)


def test_the_cpu_kernels_compute_a_linear():
    from backbone.kernels import fp16_weight_available, packed_bf16_available, packed_f32_available

    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(8, 16, generator=g), torch.randn(8, generator=g), torch.randn(3, 16, generator=g)
    if packed_f32_available():
        got = torch_internals.mkldnn_linear(x, torch_internals.mkldnn_pack_linear(w, 4), b)
        assert torch.allclose(got, F.linear(x, w, b), atol=1e-5)
    if packed_bf16_available():
        wb, xb = w.bfloat16(), x.bfloat16()
        got = torch_internals.mkldnn_linear(xb, torch_internals.mkldnn_pack_linear(wb, 1), None)
        assert torch.allclose(got.float(), F.linear(xb.float(), wb.float()), atol=0.1)
    if fp16_weight_available():
        got = torch_internals.fp16_linear(x, torch_internals.fp16_pack_linear(w, b))
        assert torch.allclose(got, F.linear(x, w.half().float(), b), atol=1e-2)
    q = torch.randint(-127, 128, (8, 16), dtype=torch.int8, generator=g)
    scale = torch.rand(8, generator=g).bfloat16() + 0.5
    xb = x.bfloat16()
    got = torch_internals.int8_weight_mm(xb, q, scale)
    want = xb.float() @ (q.float() * scale.float()[:, None]).T
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=0.5)


# --- transformers --------------------------------------------------------------------------------------------------
def test_the_attention_implementation_is_read_switched_and_registered(tiny):
    model = tiny.model
    before = hf_internals.attn_implementation(model)
    assert isinstance(before, str) and hf_internals.attn_implementation(model.config) == before
    ids = torch.tensor([[1, 5, 7, 9]], device=tiny.device)
    mask = torch.tensor([[0, 1, 1, 1]], device=tiny.device)  # left padding: the registered function gets a mask
    seen = []
    sdpa = hf_internals.sdpa_attention()

    def counting(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask is not None)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    hf_internals.register_attention("pema_test_counting", counting)
    try:
        with torch.no_grad():
            hf_internals.set_attn_implementation(model, "sdpa")
            want = model(ids, attention_mask=mask).logits
            hf_internals.set_attn_implementation(model, "pema_test_counting")
            assert hf_internals.attn_implementation(model) == "pema_test_counting"
            got = model(ids, attention_mask=mask).logits
    finally:
        hf_internals.set_attn_implementation(model, before)
    assert hf_internals.attn_implementation(model) == before
    assert seen and all(seen) and torch.allclose(got[:, 1:], want[:, 1:], atol=1e-5)


def test_the_dynamic_cache_layers_are_what_the_growing_cache_subclasses(tiny):
    full, sliding = hf_internals.dynamic_layer_kinds()
    with torch.no_grad():
        cache = tiny.model(torch.tensor([[1, 5, 7], [1, 6, 8]], device=tiny.device), use_cache=True).past_key_values
    assert cache.layers and all(type(layer) is full for layer in cache.layers)
    k = torch.randn(2, 1, 3, 4)
    layer = full()
    keys, values = layer.update(k, k + 1)  # (key_states, value_states, *args, **kwargs) → the cached tensors
    assert layer.is_initialized and layer.keys is keys and torch.equal(values, k + 1)
    assert torch.equal(layer.update(k[:, :, :1], k[:, :, :1])[0], torch.cat([k, k[:, :, :1]], dim=2))
    layer.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(layer.keys[0], layer.keys[1])
    layer.crop(-1)
    assert layer.keys.shape[-2] == 3 and layer.get_seq_length() == 3
    win = sliding(sliding_window=4)
    win.update(k, k)
    assert win.sliding_window == 4 and win.cumulative_length == 3


def test_a_cache_layer_is_rebuilt_as_a_subclass_holding_its_state():
    full, _ = hf_internals.dynamic_layer_kinds()
    layer = full()
    k = torch.randn(1, 1, 2, 4)
    layer.update(k, k)
    sub = type("Sub", (full,), {})
    new = hf_internals.rebuilt_as(layer, sub)
    assert type(new) is sub and new.keys is layer.keys and new.is_initialized
    assert new.update(k, k)[0].shape[-2] == 4
