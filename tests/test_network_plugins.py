"""In-network plug-ins (residual adapter, LoRA on the last o_proj, Memory-Tuning) on the tiny backbone: identity
when untrained, training lowers the target NLL, save/load round trip, per-row hooks in the batched decode, config
validation, and LoRA's peft training leaving the shared backbone untouched."""
from __future__ import annotations

import pytest
import torch

from backbone.torch_internals import forward_hook_count
from engine import Row, compare, decode_batch
from ground.errors import UserError
from plugins.api import make_config, new_plugin, train_plugin
from plugins.base import load_plugin
from plugins.seqtrain import collate, heldout_nll, memory_sequences, target_logits

METHODS = ["adapter", "lora", "memory_tuning"]
# Small, fast settings for the 64-dim tiny model (the defaults are sized for Gemma 3 270M).
FAST = {
    "adapter": {"bottleneck": 16, "lr": 1e-2, "batch_size": 4, "max_epochs": 12, "evals_per_epoch": 1,
                "patience": 3, "max_minutes": 0},
    # α = r makes the LoRA scaling 1 so that a few steps visibly move the tiny model (paper: α = 1).
    "lora": {"alpha": 64.0, "lr": 1e-2, "batch_size": 4, "max_epochs": 12, "evals_per_epoch": 1, "patience": 3,
             "max_minutes": 0},
    # The tiny random model's attention outputs are small next to its residual stream, so MT-M's prefix barely
    # moves it; MT-F (added to the FFN output) carries the change here, and needs a higher rate than Gemma would.
    # MT-MF (the paper's; the default is MT-F) so that the tests cover both of its memories
    "memory_tuning": {"variant": "MT-MF", "slots": 10, "lr": 3e-2, "batch_size": 4, "max_epochs": 12,
                      "evals_per_epoch": 1, "patience": 3, "max_minutes": 0},
}
SOURCE = "the house is small"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are far too small to gain from threads, and on a busy 2-core box OpenMP's spin-waiting
    makes every small multi-row matmul take ~16 ms with 2 threads (the module ran 2m48s instead of 14 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _logits(bb, data, plugin=None, rows=None, n=4):
    ids, mask, _ = collate(bb, data, range(min(n, len(data))))
    handles = plugin.attach(rows, {}) if plugin is not None else []
    try:
        with torch.no_grad():
            return target_logits(bb, ids, mask)
    finally:
        for h in handles:
            h.remove()


def _nll(bb, data, plugin=None):
    handles = plugin.attach(None, {}) if plugin is not None else []
    try:
        return heldout_nll(bb, data)
    finally:
        for h in handles:
            h.remove()


@pytest.fixture(scope="module")
def train_data(tiny, tiny_memory):
    return memory_sequences(tiny, tiny_memory, "train")


@pytest.fixture(scope="module")
def base_state(tiny):
    return {k: v.clone() for k, v in tiny.model.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tiny, tiny_memory, train_data, base_state, tmp_path_factory):
    """Each method trained once: (plug-in, its folder, base logits before any training)."""
    before = _logits(tiny, train_data)
    out = {}
    for m in METHODS:
        path = tmp_path_factory.mktemp("plugins") / m
        plugin, row = train_plugin(tiny, tiny_memory, m, FAST[m], out_dir=path)
        out[m] = (plugin, path, row)
    return out, before


@pytest.mark.parametrize("method", METHODS)
def test_untrained_plugin_is_identity(tiny, tiny_memory, train_data, method):
    """Untrained adapter, LoRA and MT-F are the identity. MT-M is prefix tuning, which is not the identity at any
    initialisation (the prefix always takes some attention); ``scale`` 0 switches it off exactly."""
    base = _logits(tiny, train_data)
    cfg = {**FAST[method], "variant": "MT-F"} if method == "memory_tuning" else FAST[method]
    assert torch.equal(base, _logits(tiny, train_data, new_plugin(method, tiny, tiny_memory, cfg)))
    if method == "memory_tuning":
        for variant in ("MT-M", "MT-MF"):
            p = new_plugin(method, tiny, tiny_memory, {**FAST[method], "variant": variant})
            assert not torch.equal(base, _logits(tiny, train_data, p))
            handles = p.attach(None, {"scale": 0.0})
            try:
                ids, mask, _ = collate(tiny, train_data, range(4))
                with torch.no_grad():
                    assert torch.equal(base, target_logits(tiny, ids, mask))
            finally:
                for h in handles:
                    h.remove()


@pytest.mark.parametrize("method", METHODS)
def test_training_raises_reference_probability(tiny, train_data, trained, method):
    plugins, _ = trained
    plugin, _, row = plugins[method]
    base_nll = _nll(tiny, train_data)
    after = _nll(tiny, train_data, plugin)
    assert after < base_nll - 0.1, (method, base_nll, after)
    hist = [h for h in row["history"] if "heldout_loss" in h]
    assert hist[-1]["heldout_loss"] <= hist[0]["heldout_loss"]
    info = plugin.train_info
    assert info["trainable_parameters"] == plugin.trainable_parameters() > 0
    assert info["best_heldout_loss"] < hist[0]["heldout_loss"]
    assert info["tokens_per_second"] > 0


@pytest.mark.parametrize("method", METHODS)
def test_hooks_change_only_their_rows(tiny, train_data, trained, method):
    plugin = trained[0][method][0]
    base = _logits(tiny, train_data, n=3)
    mixed = _logits(tiny, train_data, plugin, rows=torch.tensor([1]), n=3)
    full = _logits(tiny, train_data, plugin, n=3)
    assert torch.equal(mixed[0], base[0]) and torch.equal(mixed[2], base[2])
    # float32 rounding only: a re-run of the attention for a sub-batch may take other kernel blocks (AVX2: 4e-5)
    assert torch.allclose(mixed[1], full[1], atol=1e-4, rtol=1e-5), (mixed[1] - full[1]).abs().max()
    assert not torch.allclose(mixed[1], base[1], atol=1e-3)


@pytest.mark.parametrize("method", METHODS)
def test_save_load_round_trip(tiny, train_data, trained, method):
    plugin, path, _ = trained[0][method]
    loaded = load_plugin(path, tiny)
    assert loaded.method == method and loaded.trainable_parameters() == plugin.trainable_parameters()
    assert loaded.train_info["best_heldout_loss"] == plugin.train_info["best_heldout_loss"]
    assert torch.equal(_logits(tiny, train_data, plugin), _logits(tiny, train_data, loaded))


def test_lora_training_leaves_backbone_untouched(tiny, train_data, trained, base_state):
    _, before = trained
    assert torch.equal(_logits(tiny, train_data), before)
    now = tiny.model.state_dict()
    assert set(now) == set(base_state)
    assert all(torch.equal(now[k], base_state[k]) for k in now)
    o = tiny.layers[-1].self_attn.o_proj
    assert type(o) is torch.nn.Linear and not forward_hook_count(o)
    assert not forward_hook_count(tiny.model)
    assert not hasattr(tiny.model, "peft_config")
    plugin = trained[0]["lora"][0]
    assert plugin.train_info["trained_with"] == "peft" and plugin.rank == 64  # r = 512 capped at d = 64


@pytest.mark.parametrize("method,other", [("adapter", "lora"), ("lora", "memory_tuning"),
                                          ("memory_tuning", "adapter")])
def test_batched_rows_equal_single_decodes(tiny, tiny_memory, trained, method, other):
    plugins = trained[0]
    pl, ot = plugins[method][0], plugins[other][0]
    kw = dict(prompt=tiny_memory.prompt, max_new_tokens=8)
    rows = [Row("base"), Row(method, pl), Row(other, ot), Row("off", pl, {"scale": 0.0})]
    batched = compare(tiny, SOURCE, rows, **kw)
    single = {r.label: compare(tiny, SOURCE, [r], **kw).rows[0] for r in rows}
    for r in batched.rows:
        assert r.tokens == single[r.label].tokens, r.label
    assert batched.row("base").tokens == batched.row("off").tokens  # scale 0 switches the plug-in off
    # the check is not vacuous: a trained plug-in of the batch changes its row (on the saturated tiny model one of
    # the two may still pick the base's tokens; test_hooks_change_only_their_rows checks each one's logits)
    assert any(batched.row(m).tokens != batched.row("base").tokens for m in (method, other))


def test_memory_attention_trace_and_multi_source_beams(tiny, tiny_memory, trained):
    mt = trained[0]["memory_tuning"][0]
    ad = trained[0]["adapter"][0]
    kw = dict(prompt=tiny_memory.prompt, max_new_tokens=6)
    c = compare(tiny, SOURCE, [Row("base"), Row("mt", mt)], **kw)
    att = c.row("mt").trace[0]["memory_attention"]
    assert att["layer"] == tiny.num_layers - 1 and len(att["weights"]) == mt.config.slots
    assert abs(sum(att["weights"]) - 1) < 1e-2 and "attention_lambda" in att
    assert all("memory_attention" not in t for t in c.row("base").trace)
    # two sources × [base, adapter, mt] with two beams each equals each source and row decoded alone
    srcs = [SOURCE, "the cat sleeps"]
    rows = [Row("base"), Row("ad", ad), Row("mt", mt)]
    many = decode_batch(tiny, srcs, rows, num_beams=2, **kw)
    for s, comp in zip(srcs, many):
        for r in rows:
            assert comp.row(r.label).tokens == compare(tiny, s, [r], num_beams=2, **kw).rows[0].tokens


def test_bad_configurations_raise_user_error(tiny, trained):
    bad = [("adapter", {"bottleneck": 0}), ("adapter", {"lr": -1}), ("adapter", {"lr_schedule": "linear"}),
           ("lora", {"rank": 0}), ("lora", {"alpha": 0}), ("lora", {"dropout": 1.5}),
           ("memory_tuning", {"variant": "MT-X"}), ("memory_tuning", {"query_dim": 8}),
           ("memory_tuning", {"slots": 0}), ("memory_tuning", {"nonsense": 1}), ("adapter", {"layers": "top:0"}),
           ("adapter", {"layers": "first"})]
    for method, over in bad:
        with pytest.raises(UserError):
            make_config(method, over)
    with pytest.raises(UserError):
        trained[0]["adapter"][0].settings({"scale": -1})


def test_paper_defaults():
    from plugins.settings import preset_values

    a, lo, mt = make_config("adapter"), make_config("lora"), make_config("memory_tuning")
    assert 10 <= a.bottleneck <= 300
    assert (lo.rank, lo.alpha) == (512, 1.0)
    # the paper's sizes; MT-F by default, MT-MF (the paper's) in the preset (BENCHMARKS.md, row "memory-tuning below
    # the base")
    assert (mt.variant, mt.slots, mt.slot_size, mt.prefix_length) == ("MT-F", 50, 16, 16)
    assert make_config("memory_tuning", preset_values(type(mt), "paper")).variant == "MT-MF"
    # lr 1e-2 measured better than the PEMA paper's 1e-3 on WMT dev (BENCHMARKS.md, "Translation quality"); preset
    # "paper" has the latter
    assert lo.lr == 1e-2
    assert all(c.max_minutes > 0 for c in (a, lo, mt))


def test_candidate_softmax_trains(tiny, tiny_memory, train_data, tmp_path):
    plugin, _ = train_plugin(tiny, tiny_memory, "lora", {**FAST["lora"], "softmax": "candidates", "max_epochs": 6},
                             out_dir=tmp_path / "lora-cand")
    assert plugin.train_info["softmax"] == "candidates" and plugin.train_info["candidates"] > 0
    assert _nll(tiny, train_data, plugin) < _nll(tiny, train_data) - 0.1  # full-vocabulary NLL improves too


def test_a_memorys_candidate_vocabulary_is_made_once_per_setting(tiny, tiny_memory, monkeypatch):
    """Methods trained one after another on a memory (a rank) share its candidates: the LM's top tokens are
    computed once per (memory, top_k, contexts, seed), and another setting computes its own."""
    from plugins.training import candidate_vocabulary

    tiny.__dict__.pop("_candidate_vocabularies", None)
    calls = []
    real = tiny.logits_from_fc
    monkeypatch.setattr(tiny, "logits_from_fc", lambda fc: calls.append(len(fc)) or real(fc))
    first = candidate_vocabulary(tiny, tiny_memory, 4, 64, 0)
    made = len(calls)
    assert made > 0
    again = candidate_vocabulary(tiny, tiny_memory, 4, 64, 0)
    assert torch.equal(first, again) and len(calls) == made  # nothing run again
    again[0] = -1  # a caller's copy: changing it changes nothing kept
    assert torch.equal(candidate_vocabulary(tiny, tiny_memory, 4, 64, 0), first)
    other = candidate_vocabulary(tiny, tiny_memory, 4, 64, 1)
    assert len(calls) > made  # another seed samples other contexts
    tiny.__dict__.pop("_candidate_vocabularies", None)
    assert torch.equal(candidate_vocabulary(tiny, tiny_memory, 4, 64, 1), other)  # what was kept is what it makes


def test_training_keeps_progress_cut_off_by_the_budget(monkeypatch):
    """A budget that ends between two held-out evaluations must not throw away the steps since the last one."""
    import plugins.network as ad
    from plugins.training import LoopSettings, run_training

    clock = {"t": 0.0}
    monkeypatch.setattr(ad.time, "time", lambda: clock["t"])
    import plugins.training as tr
    monkeypatch.setattr(tr.time, "time", lambda: clock["t"])
    w = torch.nn.Parameter(torch.tensor([5.0]))
    mod = torch.nn.Module()
    mod.w = w
    history: list[dict] = []
    guard = ad.BudgetGuard(mod, lambda: float(w.detach().abs()), 1.0, history, "t")

    def loss(idx):
        guard.before_step()
        clock["t"] += 25.0  # a slow step: the 60 s budget ends after the 3rd step, before any evaluation
        return w.abs().sum(), {}

    s = LoopSettings(lr=1.0, batch_size=1, max_epochs=1, eval_every=100, max_minutes=1.0)
    summary = run_training(mod, [w], 10, loss, guard.heldout_loss, s, "t", lambda *a: None, lambda: False, history)
    # run_training evaluates once more when the budget ends, so the unevaluated steps are kept...
    assert summary["stopped_by"] == "time_budget" and summary["steps"] == 3
    assert float(w.detach()) == 2.0 and summary["best_heldout_loss"] == 2.0
    # ...and the guard's restore never makes it worse
    summary = guard.restore(summary)
    assert float(w.detach()) <= 2.0 and summary["extra_evals"] >= 1 and summary["best_heldout_loss"] <= 2.0


def test_prefix_kv_cache_decodes_as_a_full_prefill(tiny, tiny_memory, trained):
    """A single-source decode reuses the KV cache of the prompt's shared prefix (instruction + few-shot examples):
    same tokens as a full prefill, for base and in-network rows; a plug-in whose weights change gets a new entry."""
    from backbone.prompts import Prompt
    from engine import PREFIX_KV

    prompt = Prompt.for_task("translation", examples=[("the house is small", "das Haus ist klein"),
                                                      ("good morning", "Guten Morgen")])
    ad = trained[0]["adapter"][0]
    rows = [Row("base"), Row("ad", ad), Row("ad-half", ad, {"scale": 0.5})]
    ctx = tiny.encode_context(prompt.render("the cat sleeps"))
    assert PREFIX_KV.shared_len(tiny, prompt, "the cat sleeps", ctx) >= PREFIX_KV.MIN_TOKENS
    PREFIX_KV.clear()
    full = compare(tiny, "the cat sleeps", rows, prompt, max_new_tokens=8, use_prefix_cache=False)
    assert not PREFIX_KV._entries
    miss = compare(tiny, "the cat sleeps", rows, prompt, max_new_tokens=8)
    hit = compare(tiny, "hello world", rows, prompt, max_new_tokens=8)  # another source, same prefix
    # one entry per prefix length: a decode reads only the prefix of its own shared length (the passes' shapes)
    lengths = {PREFIX_KV.shared_len(tiny, prompt, s, tiny.encode_context(prompt.render(s)))
               for s in ("the cat sleeps", "hello world")}
    assert len(PREFIX_KV._entries) == len(lengths)
    hit_full = compare(tiny, "hello world", rows, prompt, max_new_tokens=8, use_prefix_cache=False)
    for r in rows:
        assert miss.row(r.label).tokens == full.row(r.label).tokens, r.label
        assert hit.row(r.label).tokens == hit_full.row(r.label).tokens, r.label
    assert full.row("ad").tokens != full.row("base").tokens or full.row("ad").score != full.row("base").score
    saved = {k: v.clone() for k, v in ad.state_dict().items()}
    try:
        with torch.no_grad():
            ad.adapters[0].W_D.weight.mul_(2.0)  # weights changed in place: the old entry must not match
        compare(tiny, "the cat sleeps", rows, prompt, max_new_tokens=2)
        assert len(PREFIX_KV._entries) == len(lengths) + 1
    finally:
        ad.load_state_dict(saved)


def test_memory_tuning_refuses_a_plugin_saved_in_the_earlier_layout(tiny, trained, tmp_path):
    import json
    import shutil

    _, path, _ = trained[0]["memory_tuning"]
    old = tmp_path / "old"
    shutil.copytree(path, old)
    meta = json.loads((old / "plugin_config.json").read_text())
    for k in ("slot_size", "prefix_length"):
        meta["config"].pop(k)
    meta["config"].update({"query_dim": 16, "key_dim": 16, "slot_dim": 64, "value_dim": 64})
    (old / "plugin_config.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="earlier implementation.*Train it again"):
        load_plugin(old, tiny)


def test_mt_m_trace_and_attention_implementations(tiny, tiny_memory, tmp_path, monkeypatch):
    """MT-M alone traces the attention within its l prefix slots and λ; it needs eager or sdpa attention."""
    p, _ = train_plugin(tiny, tiny_memory, "memory_tuning", {**FAST["memory_tuning"], "variant": "MT-M",
                                                             "prefix_length": 5, "max_epochs": 1},
                        out_dir=tmp_path / "mt-m")
    assert p.train_info["prefix_init"] and len(p.train_info["key_rms"]) == tiny.num_layers
    c = compare(tiny, SOURCE, [Row("base"), Row("mt", p)], prompt=tiny_memory.prompt, max_new_tokens=4)
    for t in c.row("mt").trace:
        att = t["memory_attention"]
        assert att["component"] == "attention" and len(att["weights"]) == 5
        assert abs(sum(att["weights"]) - 1) < 1e-2 and 0 < att["attention_lambda"] < 1
    monkeypatch.setattr(tiny.model.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(UserError, match="eager or sdpa"):
        p.attach(None, {})
    assert not forward_hook_count(tiny.model)


def test_attachment_rows_read_as_positions_inside_a_sub_batch():
    """A module re-run for some batch rows (memory-tuning's prefixed attention) sees every other attachment's rows
    as positions within that sub-batch: none for a method whose rows are elsewhere, all for rows=None."""
    from plugins.network import Attachment, sub_batch

    lora, mt, every = Attachment(torch.tensor([1, 4]), {}), Attachment(torch.tensor([2, 5]), {}), Attachment(None, {})
    with sub_batch(torch.tensor([2, 5])):
        assert lora.rows.numel() == 0 and mt.rows.tolist() == [0, 1] and every.rows is None
    with sub_batch(torch.tensor([0, 4, 6])):
        assert lora.rows.tolist() == [1]
    assert lora.rows.tolist() == [1, 4]  # outside: the full batch's rows again


def test_derived_tensors_are_rebuilt_exactly_when_a_source_changes():
    """``derived`` keeps what it built from a plug-in's weights until one of them changes: in place (an optimiser
    step, ``load_state_dict``), by new storage (``.to()``), or by being another tensor; otherwise the same object."""
    from plugins.network import derived

    class Owner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

    owner, builds = Owner(), []

    def get():
        return derived(owner, "twice", (owner.w,), lambda: builds.append(1) or owner.w * 2)

    first = get()
    assert get() is first and len(builds) == 1
    with torch.no_grad():
        owner.w.add_(1.0)
    assert torch.equal(get(), torch.full((3,), 4.0)) and len(builds) == 2
    owner.load_state_dict({"w": torch.zeros(3)})
    assert torch.equal(get(), torch.zeros(3)) and len(builds) == 3
    owner.to(torch.float64)
    assert get().dtype == torch.float64 and len(builds) == 4
    owner.w = torch.nn.Parameter(torch.full((3,), 5.0, dtype=torch.float64))
    assert torch.equal(get(), torch.full((3,), 10.0, dtype=torch.float64)) and len(builds) == 5
    assert derived(owner, "other", (owner.w,), lambda: 7) == 7  # keys are independent
    with torch.inference_mode():
        frozen = owner.w.detach() * 1  # an inference tensor: no version counter
    assert derived(owner, "frozen", (frozen,), lambda: 1) == 1 == derived(owner, "frozen", (frozen,), lambda: 2)


def test_a_decode_puts_back_the_hooks_of_its_last_step(tiny, tiny_memory, trained, monkeypatch):
    """A decode attaches each in-network plug-in once and puts its hooks back at every later step (``suspend`` /
    ``resume``), nothing attached between steps; it decodes exactly as attaching anew at every step does."""
    from engine import BatchDecode, plan_batch
    from plugins import network

    plugins = trained[0]
    rows = [Row("base")] + [Row(m, plugins[m][0]) for m in METHODS]
    attaches = []
    real_attach = network.NetworkPlugin.attach
    monkeypatch.setattr(network.NetworkPlugin, "attach",
                        lambda self, *a, **k: attaches.append(self.method) or real_attach(self, *a, **k))

    def decode():
        dec = BatchDecode(tiny, plan_batch(tiny, [SOURCE], rows, tiny_memory.prompt), max_new_tokens=8)
        steps = 0
        live, moved = {m: 0 for m in METHODS}, {m: 0 for m in METHODS}  # forward passes with the method's row in
        while True:  # them; of those, the ones where its row moved in the compact layout (a row before it finished)
            before = {m: dec.row_cache(i + 1)[1] for i, m in enumerate(METHODS)} if dec.cache is not None else None
            if not dec.step():
                break
            steps += 1
            for i, m in enumerate(METHODS):
                if not dec.beams.done[i + 1]:
                    live[m] += 1
                    moved[m] += before is not None and dec.row_cache(i + 1)[1] != before[m]
            assert not forward_hook_count(tiny.model)
        return dec.result()[0], steps, (live, moved)

    kept, steps, (live, moved) = decode()
    # the prefill's attachment, the steps' one (a finished row's forward passes have none), one more where it moved
    assert steps >= 3 and sum(live.values()) >= steps
    assert sorted(attaches) == sorted(m for m in METHODS for _ in range(1 + min(live[m], 1) + moved[m]))
    assert sum(moved.values()) < sum(live.values()) / 2
    attaches.clear()
    monkeypatch.setattr(network._Handle, "resume", lambda self: False)  # as a handle that cannot put hooks back
    anew, _, _ = decode()
    assert len(attaches) == len(METHODS) + sum(live.values())
    for a, b in zip(kept.rows, anew.rows):
        assert a.tokens == b.tokens and a.score == b.score, a.label


def test_suspended_hooks_come_back_in_their_order():
    from plugins.network import Attachment, _Handle

    lin, calls = torch.nn.Linear(2, 2), []
    first = _Handle([lin.register_forward_hook(lambda *a: calls.append("a")),
                     lin.register_forward_pre_hook(lambda m, a, k: calls.append("pre") or None, with_kwargs=True)],
                    Attachment(None, {}))
    second = _Handle([lin.register_forward_hook(lambda *a: calls.append("b"))], Attachment(None, {}))
    for h in (first, second):
        assert h.suspend() and not h.att.live
    assert not forward_hook_count(lin) and not lin._forward_pre_hooks_with_kwargs
    lin(torch.ones(2))
    assert calls == []
    assert first.resume() and second.resume() and first.att.live and not first.resume()
    lin(torch.ones(2))
    assert calls == ["pre", "a", "b"]
    first.remove()
    second.remove()
    assert not forward_hook_count(lin)


@pytest.mark.parametrize("rows", [[1], [1, 2], [0, 2], [2, 0]])
def test_rows_apply_changes_exactly_its_rows(rows):
    """Consecutive rows go through views, others through index operators: either way only those rows change, to
    ``fn`` of their own inputs."""
    from plugins.network import rows_apply

    h, x = torch.randn(4, 3, 5), torch.randn(4, 3, 5)
    want = h.clone()
    want[rows] = x[rows] * 2 + h[rows]
    with torch.no_grad():
        got = rows_apply(h.clone(), x, torch.tensor(rows), lambda xs, hs: xs * 2 + hs)
    assert torch.equal(got, want)


def test_two_decodes_taking_turns_keep_their_own_hooks(tiny, tiny_memory, trained):
    """Two users' decodes with the same plug-in objects take turns step by step (as the studio's backbone gate lets
    them): each step puts back only its own decode's hooks, so both decode as they do alone."""
    from engine import BatchDecode, plan_batch

    plugins = trained[0]
    rows_a = [Row("base"), Row("adapter", plugins["adapter"][0]), Row("mt", plugins["memory_tuning"][0])]
    rows_b = [Row("mt", plugins["memory_tuning"][0], {"scale": 0.5}), Row("lora", plugins["lora"][0])]
    kw = dict(prompt=tiny_memory.prompt, max_new_tokens=8)
    alone = [compare(tiny, SOURCE, rows_a, **kw), compare(tiny, "a small house", rows_b, **kw)]
    decs = [BatchDecode(tiny, plan_batch(tiny, [SOURCE], rows_a, tiny_memory.prompt), max_new_tokens=8),
            BatchDecode(tiny, plan_batch(tiny, ["a small house"], rows_b, tiny_memory.prompt), max_new_tokens=8)]
    going = [True, True]
    while any(going):
        for i, d in enumerate(decs):
            if going[i]:
                going[i] = d.step()
    for want, d in zip(alone, decs):
        got = d.result()[0]
        assert [r.tokens for r in got.rows] == [r.tokens for r in want.rows]


def test_adapter_on_the_top_layers_only(tiny, tiny_memory, train_data, tmp_path):
    """``layers="top:1"``: one adapter, hooked on the top layer only, the frozen layers below run once per batch
    (``lowest_layer``); every layer's adapter keeps the state-dict keys of the list it was before ``layers``
    existed, so older plug-ins load."""
    L = tiny.num_layers
    every = new_plugin("adapter", tiny, tiny_memory, FAST["adapter"])
    assert sorted({k.split(".")[1] for k in every.state_dict() if k.startswith("adapters.")}) == \
        sorted(str(l) for l in range(L)) and every.lowest_layer() == 0
    path = tmp_path / "top"
    top, _ = train_plugin(tiny, tiny_memory, "adapter", {**FAST["adapter"], "layers": "top:1", "max_epochs": 2},
                          out_dir=path, name="top")
    assert top.lowest_layer() == L - 1 and top.train_info["layers"] == [L - 1]
    assert {k.split(".")[1] for k in top.state_dict() if k.startswith("adapters.")} == {str(L - 1)}
    assert top.trainable_parameters() * L == every.trainable_parameters()
    low, high = forward_hook_count(tiny.layers[0]), forward_hook_count(tiny.layers[L - 1])
    handles = top.attach(None, {})
    try:
        assert (forward_hook_count(tiny.layers[0]), forward_hook_count(tiny.layers[L - 1])) == (low, high + 1)
    finally:
        for h in handles:
            h.remove()
    loaded = load_plugin(path, tiny)
    assert torch.equal(_logits(tiny, train_data, top), _logits(tiny, train_data, loaded))
    assert not torch.equal(_logits(tiny, train_data, top), _logits(tiny, train_data, every))
