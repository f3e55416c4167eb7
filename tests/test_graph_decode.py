"""The frozen decode step over a static KV cache (``backbone.graph_decode``): on a GPU it is replayed from a CUDA
graph; here (``graph_decode="static"``, no graph capture) the same buffers, positions and masks run eagerly, and a
decode must give what the eager path gives — tokens equal, log-probabilities to float rounding (the static step's
attention runs over the runner's whole length with the unfilled positions masked: a sum over more terms)."""
from __future__ import annotations

import gc

import pytest
import torch

from backbone.graph_decode import RUNNERS, capacity
from backbone.options import using_fast_paths
from backbone.prompts import Prompt
from engine import Row, compare, decode_batch, start_compare
from plugins.api import new_plugin
from plugins.knn import KNN, KNNConfig

PROMPT = Prompt.for_task("translation")


@pytest.fixture(scope="module")
def mode(tiny):
    """The static path as it runs on this device: from CUDA graphs on a GPU (``PEMA_TINY_DEVICE=cuda``), else
    eagerly."""
    return "auto" if tiny.device.type == "cuda" else "static"


@pytest.fixture(scope="module")
def rows(tiny, tiny_memory):
    knn = KNN(KNNConfig(), tiny)
    knn.fit(tiny_memory)
    pema = new_plugin("pema", tiny, tiny_memory, {"seed": 1})  # untrained, random B: its row parts from the base's
    return [Row("base"), Row("kNN", knn, {"lambda": 0.9, "temperature": 1.0}), Row("PEMA", pema, {"lambda_max": 0.9})]


def _runs(comparisons):
    return [[(r.tokens, [round(t["logprob"], 4) for t in r.trace]) for r in c.rows] for c in comparisons]


def _same(a, b):
    for ca, cb in zip(a, b):
        for ra, rb in zip(ca.rows, cb.rows):
            assert ra.tokens == rb.tokens
            assert torch.allclose(torch.tensor([t["logprob"] for t in ra.trace]),
                                  torch.tensor([t["logprob"] for t in rb.trace]), atol=1e-4)


@pytest.mark.parametrize("sources", [["the cat sleeps"], ["the cat sleeps", "a very long sentence about the house"]])
def test_static_step_decodes_what_the_eager_step_decodes(tiny, rows, sources, mode):
    with using_fast_paths(graph_decode="off"):
        eager = decode_batch(tiny, sources, rows, PROMPT, max_new_tokens=10)
    with using_fast_paths(graph_decode=mode):
        static = decode_batch(tiny, sources, rows, PROMPT, max_new_tokens=10)
    assert len({tuple(r.tokens) for r in eager[0].rows}) > 1  # the rows part: the relayout path runs
    _same(eager, static)


def test_a_kept_static_decode_serves_slider_moves_like_the_eager_one(tiny, rows, mode):
    moved = [rows[0], rows[1], Row("PEMA", rows[2].plugin, {"lambda_max": 0.3})]
    out = {}
    for m in ("off", mode):
        with using_fast_paths(graph_decode=m):
            first = start_compare(tiny, "the cat sleeps", rows, PROMPT, max_new_tokens=10)
            while first.step():
                pass
            move = start_compare(tiny, "the cat sleeps", moved, PROMPT, max_new_tokens=10, live=first.live())
            while move.step():
                pass
            out[m] = (first.result(), move.result())
    _same(out["off"][0], out[mode][0])
    _same(out["off"][1], out[mode][1])
    with using_fast_paths(graph_decode="off"):
        full = compare(tiny, "the cat sleeps", moved, PROMPT, max_new_tokens=10)
    _same([full], out[mode][1])


def test_a_sliding_window_model_decodes_the_same_on_the_static_step(tmp_path, tiny):
    from transformers import Gemma3TextConfig

    from benchmarks.gpu import random_backbone

    cfg = Gemma3TextConfig(vocab_size=len(tiny.tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           sliding_window=2048, max_position_embeddings=4096,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           pad_token_id=tiny.tokenizer.pad_token_id, bos_token_id=tiny.tokenizer.bos_token_id,
                           eos_token_id=tiny.tokenizer.eos_token_id)
    cfg.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    bb = random_backbone(tmp_path, device="cpu", dtype="float32")
    with using_fast_paths(graph_decode="off"):
        eager = decode_batch(bb, ["the cat sleeps", "a house"], [Row("base")], PROMPT, max_new_tokens=8)
    with using_fast_paths(graph_decode="static"):
        static = decode_batch(bb, ["the cat sleeps", "a house"], [Row("base")], PROMPT, max_new_tokens=8)
    _same(eager, static)
    assert capacity(cfg, 3, 2049) is None and capacity(cfg, 3, 100) == (4, 128)  # past the window: eager


def test_runners_are_reused_and_a_dropped_decode_gives_its_runner_back(tiny, rows, mode):
    with using_fast_paths(graph_decode=mode):
        compare(tiny, "the cat sleeps", rows[:1], PROMPT, max_new_tokens=4)
        counts = dict(RUNNERS.counts())
        compare(tiny, "the cat sleeps", rows[:1], PROMPT, max_new_tokens=4)
        assert RUNNERS.counts() == counts  # the same runner again
        dropped = start_compare(tiny, "the cat sleeps", rows[:1], PROMPT, max_new_tokens=8)
        dropped.step(), dropped.step()
        assert dropped.runner is not None
        del dropped
        gc.collect()
        compare(tiny, "the cat sleeps", rows[:1], PROMPT, max_new_tokens=4)
        assert RUNNERS.counts() == counts  # the dropped decode's runner came back
    assert not RUNNERS.disabled  # (on a GPU: every graph recorded)


def test_a_forgotten_model_leaves_the_pool(tiny, rows, mode):
    with using_fast_paths(graph_decode=mode):
        compare(tiny, "the cat sleeps", rows[:1], PROMPT, max_new_tokens=4)
    assert any(k[0] == id(tiny.decoder) for k in RUNNERS.counts())
    RUNNERS.forget(tiny.decoder)
    assert not any(k[0] == id(tiny.decoder) for k in RUNNERS.counts())


def test_the_start_up_comparison_runs_on_a_gpu_only_and_changes_no_later_comparison(tiny, rows, mode):
    """``warm_comparison`` (the studio's last start-up step on a GPU) decodes a short base row with another prompt;
    a user's comparison after it is what it would have been without it."""
    from engine import warm_comparison

    with using_fast_paths(graph_decode=mode):
        before = _runs([compare(tiny, "the red house", rows, PROMPT, max_new_tokens=6)])
        if tiny.device.type != "cuda":
            assert warm_comparison(tiny) == {}  # a CPU has no first-call work to move
        assert warm_comparison(tiny, force=True)["seconds"] >= 0
        after = _runs([compare(tiny, "the red house", rows, PROMPT, max_new_tokens=6)])
    assert after == before


# --- in-network rows on the static step (their hooks on fixed row masks: ``engine.fixed_rows``) -------------
def _perturbed(plugin, seed: int, std: float):
    """``plugin`` with seeded noise on every weight: the untrained adapter, LoRA and MT-F are the identity, and on the
    tiny model a small change leaves the next token's probability at 1, so the rows would show nothing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in plugin.parameters():
            if t.dtype.is_floating_point:
                t.add_(torch.randn(t.shape, generator=g).to(t) * std)
    return plugin


@pytest.fixture(scope="module")
def net(tiny, tiny_memory):
    ma = new_plugin("memory_adapter", tiny, tiny_memory, {"max_translate": 8})
    ma.build_memory(tiny_memory)
    made = {"adapter": (new_plugin("adapter", tiny, tiny_memory, {}), 3.0),
            "lora": (new_plugin("lora", tiny, tiny_memory, {}), 10.0),
            "MT-F": (new_plugin("memory_tuning", tiny, tiny_memory, {"variant": "MT-F", "slots": 10}), 3.0),
            "MT-M": (new_plugin("memory_tuning", tiny, tiny_memory, {"variant": "MT-M"}), 30.0),
            "MT-MF": (new_plugin("memory_tuning", tiny, tiny_memory, {"variant": "MT-MF", "slots": 10}), 3.0),
            "memory_adapter": (ma, 30.0)}
    return {k: _perturbed(p.to(tiny.device), i + 1, std) for i, (k, (p, std)) in enumerate(made.items())}


SETS = {  # base + six methods (the comparison the studio offers), and MT-M's prefix / MT-MF with the others
    "seven rows": ("kNN", "PEMA", "adapter", "memory_adapter", "MT-F", "lora"),
    "prefix rows": ("PEMA", "MT-M", "MT-MF", "adapter", "lora"),
}


def _set_rows(rows, net, names):
    out = {r.label: r for r in rows}
    return [rows[0]] + [out[n] if n in out else Row(n, net[n]) for n in names]


def _stepwise(tiny, rows, mode, stop=None, tokens=10):
    """A decode run step by step: (its comparison, each step's f(c) per live batch row, the decode)."""
    from engine.batch import plan_batch
    from engine.engine import BatchDecode

    saved = tiny.stop_ids
    tiny.stop_ids = set(saved) | set(stop or ())
    try:
        with using_fast_paths(graph_decode=mode):
            dec = BatchDecode(tiny, plan_batch(tiny, ["the cat sleeps"], rows, PROMPT), tokens, trace=True)
            fcs = []
            while dec.step():
                fcs.append({b: dec.row_fc(b).float().cpu() for b in range(len(rows)) if not dec.beams.done[b]})
    finally:
        tiny.stop_ids = saved
    return dec.result(), fcs, dec


def _stop_token(tiny, chosen) -> set:
    """A stop token that one in-network row emits at its third step: rows then end at different steps."""
    free, _, _ = _stepwise(tiny, chosen, "off")
    row = next(r for r in free[0].rows if r.label in ("adapter", "MT-MF") and len(r.tokens) > 2)
    return {row.tokens[2]}


@pytest.mark.parametrize("which", list(SETS))
def test_in_network_rows_decode_on_the_static_step_as_on_the_eager_one(tiny, rows, net, which, mode):
    """Every row — in-network ones mixed with the base, PEMA and kNN, finishing at different steps — decodes the
    same tokens, log-probabilities, hidden states and traces on the static step (one recorded step on a GPU) as on
    the eager one."""
    chosen = _set_rows(rows, net, SETS[which])
    stop = _stop_token(tiny, chosen)
    eager, eager_fc, dec_e = _stepwise(tiny, chosen, "off", stop)
    static, static_fc, dec_s = _stepwise(tiny, chosen, mode, stop)
    assert dec_e.path == "eager" and dec_s.path == ("graph" if mode == "auto" else "static"), dec_s.path_reason
    lengths = {len(r.tokens) for r in eager[0].rows}
    assert len(lengths) > 1 and min(lengths) < 10  # rows finished at different steps, some before the budget
    for r in eager[0].rows:  # every in-network row decodes otherwise than the base row
        if r.label in net:
            assert r.tokens != eager[0].rows[0].tokens or r.trace[0]["logprob"] != eager[0].rows[0].trace[0]["logprob"]
    _same(eager, static)
    for a, b in zip(eager[0].rows, static[0].rows):
        assert [t.get("memory_attention") for t in a.trace] == [t.get("memory_attention") for t in b.trace], a.label
    assert len(eager_fc) == len(static_fc)
    for fa, fb in zip(eager_fc, static_fc):
        assert fa.keys() == fb.keys()
        for b in fa:  # to float32 rounding of the row's scale (the noisy adapter's states reach ~10⁴)
            assert float((fa[b] - fb[b]).norm()) <= 1e-4 * float(fa[b].norm()) + 1e-4, b


FORBIDDEN_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten.item")
FORBIDDEN_CALLS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
                   "tensor", "as_tensor", "from_numpy", "masked_select")


def test_the_step_with_every_in_network_hook_is_recordable(tiny, rows, net, monkeypatch, mode):
    """What a CUDA graph needs of the step with in-network hooks on (their rows: row masks on the device): no host
    read of a device value, no data-dependent shape (``nonzero``, boolean indexing), no tensor made from host data —
    checked on every forward pass of the runner, on the CPU too — and every step, as rows part and finish, runs the
    same operators on the same shapes (the recorded step serves them all: the masks are written in place)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from backbone import graph_decode

    bad, passes = [], []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name.startswith(FORBIDDEN_OPS) or (name.startswith(("aten.index.", "aten.index_put")) and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))):
                bad.append(name)
            out = func(*args, **(kwargs or {}))
            shapes = [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                      if isinstance(t, torch.Tensor)]
            passes[-1].append((name, tuple(shapes)))
            return out

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in FORBIDDEN_CALLS:
                bad.append(getattr(func, "__qualname__", str(func)))
            return func(*args, **(kwargs or {}))

    step = graph_decode.GraphRunner._forward

    def guarded(runner):
        passes.append([])  # (a new runner's first pass, before ``start``, also allocates the static cache)
        with Calls(), Ops():
            out = step(runner)
        if not runner.rows:
            passes.pop()
        return out

    monkeypatch.setattr(graph_decode.GraphRunner, "_forward", guarded)
    chosen = _set_rows(rows, net, SETS["seven rows"]) + [Row("MT-M", net["MT-M"]), Row("MT-MF", net["MT-MF"])]
    stop = _stop_token(tiny, chosen)
    _, fcs, dec = _stepwise(tiny, chosen, "static", stop)
    assert dec.path == "static" and len(passes) == len(fcs)  # one pass per step that goes on
    assert {len(f) for f in fcs} != {len(chosen)}  # rows finished while others went on
    assert not bad, sorted(set(bad))
    assert all(p == passes[0] for p in passes), "a step ran other operators or shapes than the first"
    # a second decode of the same rows takes the same runner: its hooks and row masks are the very same objects
    def masks(d):  # each in-network group's row mask: its attachment's rows
        return [(id(h[0].att.forward_rows), h[0].att.forward_rows.data_ptr()) for h in d.net_handles]

    counts = dict(RUNNERS.counts())
    _, _, again = _stepwise(tiny, chosen, "static")
    assert masks(again) == masks(dec) and len(masks(dec)) == 6 and RUNNERS.counts() == counts


def test_the_eager_path_serves_what_the_static_step_cannot_and_says_why(tiny, rows, net, monkeypatch, mode):
    """A plug-in without fixed-row hooks, or a step whose recording fails, decodes on the eager path — the same
    output — with the reason recorded; a plug-in whose weights change gets a runner of its own."""
    from engine import fixed_rows

    chosen = [rows[0], rows[2], Row("adapter", net["adapter"])]
    eager, _, _ = _stepwise(tiny, chosen, "off")
    monkeypatch.setattr(net["adapter"], "fixed_rows", False, raising=False)
    out, _, dec = _stepwise(tiny, chosen, mode)
    assert dec.path == "eager" and "'adapter' has no fixed-row hooks" in dec.path_reason
    _same(eager, out)
    monkeypatch.undo()

    def broken(*a, **k):
        raise RuntimeError("not recordable")

    monkeypatch.setattr(fixed_rows.FixedRowHooks, "__init__", broken)
    try:
        out, _, dec = _stepwise(tiny, chosen, mode)
        assert dec.path == "eager" and "recording failed: RuntimeError: not recordable" in dec.path_reason
        _same(eager, out)
        _, _, dec = _stepwise(tiny, rows[:1], mode)  # a failed hook key leaves every other step recordable
        assert dec.path != "eager"
    finally:
        for k in [k for k in RUNNERS.disabled if len(k) > 2]:
            del RUNNERS.disabled[k]
    monkeypatch.undo()
    _, _, dec = _stepwise(tiny, chosen, mode)
    made = dict(RUNNERS.counts())
    with torch.no_grad():
        net["adapter"].adapters[0].W_D.weight.mul_(1.0)  # the same values, a new version: products are derived anew
    _, _, dec = _stepwise(tiny, chosen, mode)
    assert dec.path != "eager" and set(RUNNERS.counts()) - set(made)  # a runner of a new hook key


def test_the_pool_keeps_the_latest_hook_keys(tiny):
    """Runners with hooks are kept for the most recently used hook keys only; one of a dropped key that comes back
    from its decode is not pooled again."""
    from backbone.graph_decode import RunnerPool

    class Hooks:
        def on(self):
            pass

        def off(self):
            pass

    pool = RunnerPool(hooked_keys=2)

    def take(key):
        return pool.take_or_why(tiny.decoder, tiny.final_norm, 1, 10, graph=False, hooks_key=key,
                                make_hooks=lambda rows: Hooks())

    a, why = take("a")
    assert a is not None and not why and a.hooks is not None
    pool.give_back(take("b")[0])
    assert take("a")[0] is not a  # "a"'s only runner is still out: another is made
    pool.give_back(take("c")[0])  # "b" is now the least recently used of three: dropped
    assert {k[-1] for k in pool.counts()} == {"a", "c"}
    pool.give_back(a)
    assert take("a")[0] is a
    take("d"), take("e")  # "a" and "c" dropped while "a"'s runner is out
    pool.give_back(a)
    assert {k[-1] for k in pool.counts()} == {"d", "e"} and all(r is not a for f in pool._free.values() for r in f)
