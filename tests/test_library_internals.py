"""The library internals the project relies on, one module per library (``backbone/torch_internals.py``,
``backbone/hf_internals.py``, ``ui/gradio_internals.py``; tests/test_architecture.py keeps them there): each names
the version it was checked against, which must be the one requirements.txt pins and the one installed; and each
internal it uses is checked here for the behaviour the project relies on, so that an upgrade fails here — naming
the internal — rather than as a wrong decode (or an open door in the server) somewhere else."""
from __future__ import annotations

import re
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backbone import hf_internals, torch_internals
from ui import gradio_internals

ROOT = Path(__file__).resolve().parent.parent


def pinned(package: str) -> str:
    m = re.search(rf"^{re.escape(package)}==([^\s#]+)", (ROOT / "requirements.txt").read_text(), re.MULTILINE)
    assert m, f"requirements.txt pins no {package}"
    return m.group(1)


@pytest.mark.parametrize("package,module", [("torch", torch_internals), ("transformers", hf_internals),
                                            ("gradio", gradio_internals)])
def test_the_internals_are_checked_against_the_pinned_and_installed_version(package, module):
    where = module.__name__.replace(".", "/") + ".py"
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


def test_a_forward_is_replaced_for_a_while_with_the_hooks_still_around_it():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    own_b = lambda x: x * 10  # noqa: E731 — an instance-level forward of its own, put back afterwards
    b.forward = own_b
    calls = []
    a.register_forward_pre_hook(lambda mod, args: calls.append("pre"))
    x = torch.ones(1, 2)
    want_a = a(x)
    with torch_internals.forward_replaced([a, b], lambda h, *args, **kwargs: h + 1):
        assert torch.equal(a(x), x + 1) and torch.equal(b(x), x + 1)
        assert calls == ["pre", "pre"]  # the hook ran around the replacement
    assert torch.equal(a(x), want_a) and torch.equal(b(x), x * 10) and "forward" not in a.__dict__
    with pytest.raises(KeyError), torch_internals.forward_replaced([a], lambda h: h):
        raise KeyError("put back on the way out")
    assert torch.equal(a(x), want_a)


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


def test_a_cache_filled_outside_update_is_told_how_many_positions_it_holds():
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    full, sliding = hf_internals.dynamic_layer_kinds()
    k = torch.randn(1, 1, 3, 4)
    for kind in (StaticLayer(max_cache_len=8), StaticSlidingWindowLayer(max_cache_len=8, sliding_window=8)):
        kind.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))  # allocates the buffers, counts 1
        kind.keys[:, :, :3].copy_(k)  # filled outside update: three positions
        hf_internals.set_positions_seen(kind, 3)
        one = torch.ones(1, 1, 1, 4)
        keys, _ = kind.update(one, one)  # the next position written is the fourth
        assert torch.equal(keys[:, :, :3], k) and torch.equal(keys[:, :, 3:4], one), type(kind).__name__
        assert int(kind.get_seq_length()) == 4
    win = sliding(sliding_window=8)
    win.update(k, k)
    assert hf_internals.positions_seen(win) == 3
    hf_internals.count_appended(win, 2)
    assert hf_internals.positions_seen(win) == 5 == win.get_seq_length()
    hf_internals.set_positions_seen(win, 7)
    assert hf_internals.positions_seen(win) == 7
    layer = full()
    layer.update(k, k)
    hf_internals.count_appended(layer, 2)
    hf_internals.set_positions_seen(layer, 9)
    assert hf_internals.positions_seen(layer) is None and layer.get_seq_length() == 3  # a full layer counts none


def test_an_attention_module_attends_over_what_its_cache_stand_in_returns(tiny):
    """``PastPrefix`` / ``PrefixKV`` stand in for one attention module's cache: it calls ``update(k, v, layer_idx,
    ...)`` and reads what that returns."""
    attn = tiny.layers[0].self_attn
    calls, outs = [], []

    class StandIn:
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            calls.append((key_states.shape, layer_idx))
            return key_states, torch.zeros_like(value_states)  # every value zero: the attention's output is zero

    pre = attn.register_forward_pre_hook(lambda mod, args, kwargs: (args, {**kwargs, "past_key_values": StandIn()}),
                                         with_kwargs=True)
    post = attn.register_forward_hook(lambda mod, args, out: outs.append(out[0]))
    try:
        with torch.no_grad():
            tiny.model(torch.tensor([[1, 5, 7]], device=tiny.device), use_cache=False)
    finally:
        pre.remove()
        post.remove()
    assert calls and calls[0][1] == 0 and calls[0][0][-2] == 3
    assert outs and not outs[0].abs().any()


# --- gradio --------------------------------------------------------------------------------------------------------
def _demo_blocks():
    import gradio as gr

    with gr.Blocks(delete_cache=(5, 6)) as demo:
        text, out = gr.Textbox(), gr.Textbox()
        gr.Button().click(lambda x: x + "!", text, out, api_name="shout")

        def add(a: int, b: int = 2) -> int:
            return a + b

        gr.api(add, api_name="add")
    return demo


def test_gradio_serves_from_its_folder_in_a_thread_and_inlines_only_safe_types():
    import uvicorn

    assert issubclass(gradio_internals.Server, uvicorn.Server)
    assert all(callable(getattr(gradio_internals.Server, m, None)) for m in ("run_in_thread", "close"))
    assert "image/png" in gradio_internals.XSS_SAFE_MIMETYPES
    assert not {"text/html", "image/svg+xml", "application/javascript"} & set(gradio_internals.XSS_SAFE_MIMETYPES)
    assert Path(gradio_internals.upload_folder()).is_absolute()


def test_gradio_events_are_listed_recognised_as_api_endpoints_and_made_private():
    demo = _demo_blocks()
    fns = gradio_internals.event_functions(demo)
    assert sorted(f.api_name for f in fns.values()) == ["add", "shout"]
    shout = next(f for f in fns.values() if f.api_name == "shout")
    assert shout.fn("a") == "a!" and len(shout.inputs) == 1 and len(shout.outputs) == 1
    api = {f.api_name: gradio_internals.is_api_endpoint(f) for f in fns.values()}
    assert api == {"add": True, "shout": False}
    assert gradio_internals.event_functions(object()) is None
    gradio_internals.make_private(demo, keep=("add",))
    seen = {f.api_name: f.api_visibility for f in fns.values()}
    assert seen["shout"] == "private" and seen["add"] != "private"
    assert "shout" not in str(demo.get_api_info()) and "add" in str(demo.get_api_info())


def test_gradio_events_run_through_a_wrapper_that_sees_their_call():
    import asyncio

    from gradio.state_holder import SessionState

    demo = _demo_blocks()
    seen = []

    async def outer(run, call):
        seen.append(("outer", call.block_fn.api_name, call.session_hash, call.state, call.request))
        out = await run()
        return {**out, "data": [out["data"][0] + "?"]}

    gradio_internals.wrap_events(demo, outer)
    state = SessionState(demo)
    request = object()
    index = next(i for i, f in demo.fns.items() if f.api_name == "shout")
    out = asyncio.run(demo.process_api(block_fn=index, inputs=["a"], state=state, request=request,
                                       session_hash="s1"))
    assert out["data"] == ["a!?"] and seen == [("outer", "shout", "s1", state, request)]
    out = asyncio.run(demo.process_api(demo.fns[index], ["b"], state, [request], session_hash="s2"))  # positional
    assert out["data"] == ["b!?"] and seen[-1] == ("outer", "shout", "s2", state, request)


def test_gradio_session_states_are_forgotten_only_when_still_the_same():
    demo = _demo_blocks()
    state = demo.state_holder["s1"]
    assert "s1" in demo.state_holder.session_data
    gradio_internals.forget_session(demo, "s1", object())  # another state: kept
    assert "s1" in demo.state_holder.session_data
    gradio_internals.forget_session(demo, "s1", state)
    assert "s1" not in demo.state_holder.session_data and "s1" not in demo.state_holder.time_last_used


def test_gradio_queue_shows_its_events_and_messages_and_takes_its_bounds():
    import asyncio

    from gradio.data_classes import PredictBodyInternal

    demo = _demo_blocks()
    demo.queue()
    gradio_internals.set_queue_idle_sleeps(demo, 0.02, 0.1)
    assert gradio_internals.queue_idle_sleeps(demo) == (0.02, 0.1)
    gradio_internals.set_queue_idle_sleeps(demo, 0.001, 0.001)  # never shorter than it is
    assert gradio_internals.queue_idle_sleeps(demo) == (0.02, 0.1)
    gradio_internals.bound_analytics(demo, 64)
    assert demo._queue.ANALYTICS_MAX_EVENTS == 64
    assert gradio_internals.queued_events(demo) == [] and gradio_internals.sessions_with_messages(demo) == []

    class Request:
        headers, cookies = {"x-pema-key": "k"}, {}

    index = next(i for i, f in demo.fns.items() if f.api_name == "shout")
    body = PredictBodyInternal(session_hash="s1", fn_index=index, data=["a"])
    ok, _, status = asyncio.run(demo._queue.push(body, Request(), None))  # the queue is not started: it waits
    assert ok and status == "success"
    (event,) = gradio_internals.queued_events(demo)
    assert event.session_hash == "s1" and event.request.headers == {"x-pema-key": "k"}
    assert gradio_internals.sessions_with_messages(demo) == ["s1"]
    gradio_internals.drop_session_messages(demo, "s1")
    assert gradio_internals.sessions_with_messages(demo) == [] and "s1" not in demo._queue.pending_event_ids_session
    assert gradio_internals.queued_events(object()) == [] and gradio_internals.sessions_with_messages(object()) == []


def test_gradio_mounting_reads_the_bounds_set_before_and_stop_ends_the_app():
    import gradio as gr
    from fastapi import FastAPI

    demo, other = _demo_blocks(), _demo_blocks()
    other.delete_cache = None
    for b in (demo, other):
        gradio_internals.default_delete_cache(b, (1, 2))
        gradio_internals.set_session_capacity(b, 7)
        b.queue()
    assert demo.delete_cache == (5, 6) and other.delete_cache == (1, 2)  # an app's own setting is kept
    gr.mount_gradio_app(FastAPI(), demo, path="/")
    assert demo.state_holder.capacity == 7  # read when mounted
    gradio_internals.mark_launched(demo)
    assert demo.has_launched
    assert isinstance(demo.upload_file_set, set)
    demo.upload_file_set.add("/old")
    gradio_internals.track_moved_uploads(demo, ["/old"], ["/new"])
    assert demo.upload_file_set == {"/new"}
    gradio_internals.stop(demo)
    assert demo.app.stop_event.is_set() and demo._queue.stopped and not demo.is_running
    gradio_internals.stop(object())  # nothing to stop: no error


def test_gradio_status_tracker_is_served_with_the_teardown_its_timer_loop_lacks():
    """The pinned Gradio's built status tracker has the timer loop the fix ends (its effect on ``status``, the flag
    its loop goes on with): the fix adds one effect and nothing else, served in place of Gradio's own file on every
    mount; the browser tests (tests/test_idle_browser.py) check that it ends the loop."""
    import gradio as gr
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    name, fixed = gradio_internals.status_tracker_fix()
    original = (Path(gradio_internals.BUILD_PATH_LIB) / name).read_text(encoding="utf-8")
    added = re.fullmatch(r"(.*\}\)),([\w$]+)\(\(\)=>\(\)=>\{([\w$]+)=!1\}\)(,.*)", fixed, re.DOTALL)
    assert added and added[1] + added[4] == original, "the fix is one effect whose teardown clears a flag"
    assert f"{added[3]}&&=!1" in original and re.search(rf"{re.escape(added[3])}&&[\w$]+\(\)\}}\)\}}", original)
    app = FastAPI()
    assert gradio_internals.serve_fixed_frontend(app, ["/share", "/"])
    gr.mount_gradio_app(app, _demo_blocks(), path="/")
    client = TestClient(app)
    for url in (f"/assets/{name}", f"/share/assets/{name}"):
        got = client.get(url)
        assert got.status_code == 200 and got.text == fixed and "javascript" in got.headers["content-type"], url
    assert client.get("/assets/" + next(p.name for p in Path(gradio_internals.BUILD_PATH_LIB).glob("index-*.js"))
                      ).status_code == 200  # Gradio's other files are still Gradio's
