"""The in-network plug-ins' training shortcuts on the tiny backbone: a shared prompt prefix computed once by the frozen
backbone and given as the past, the frozen layers below the plug-in run once per batch, length buckets — each
exact where it claims to be (the same per-token losses as whole sequences through the whole backbone, the plug-in
kept off the prefix) — for every in-network method (the memory adapter's doubled batch included), the decode path
(prefix cache, left padding) equal to the training path, and a trained plug-in's reported loss equal to the loss
recomputed through the decode path.

Tolerances are what the correct code reaches here (one thread, the tiny backbone): 0 where the arithmetic is the
same operation on the same numbers, else a bound a few times the measured difference, stated next to it. The
mistakes these tests are there for (a boundary one position off, a prefix token dropped, left padding ignored, the
plug-in acting on the shared prefix, a wrong lowest layer, a doubled batch in the wrong order) move per-token losses
by 1e-6 or more."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backbone.torch_internals import forward_hook_count
from engine import Row, forward_step, plan_batch, prefill
from engine.protocol import shared_prompt_len
from plugins.api import new_plugin, train_plugin
from plugins.network import FullBatch, PreparedBatch, TrainingBatches
from plugins.seqtrain import SeqData, length_buckets, memory_sequences, split_for_early_stopping

LONG = ("the old man who lives in the small house near the river walks to the market every morning with his dog",
        "der alte Mann der im kleinen Haus am Fluss wohnt geht jeden Morgen mit seinem Hund zum Markt")
# samples of very different lengths (3 to 90 tokens of their own), so that left padding and length buckets matter
PAIRS = [("the house is small", "das Haus ist klein"), ("hi", "hallo"), LONG, ("good morning", "Guten Morgen"),
         ("the cat sleeps", "die Katze schlaeft"), ("the small house", "das kleine Haus")] * 3
SHOTS = [("the house is small", "das Haus ist klein"), ("good morning", "Guten Morgen")]
CASES = [("adapter", {"bottleneck": 8}), ("adapter", {"bottleneck": 8, "layers": "top:1"}), ("lora", {"alpha": 64.0}),
         ("memory_tuning", {"variant": "MT-MF", "slots": 8}), ("memory_tuning", {"variant": "MT-M"}),
         ("memory_adapter", {"layers": "all"}), ("memory_adapter", {"layers": "1"})]
IDS = ["adapter", "adapter-top", "lora", "mt-mf", "mt-m", "madapter-all", "madapter-top"]
# per-token NLL, prepared batch vs whole sequences. ``adapted``: the same sequences through the same operations (the
# layers below the plug-in merely run earlier), measured equal to the last bit: exact. ``frozen``: the prefix's keys
# and values come as the past, so attention sums over keys of another layout — measured ≤ 2.3e-7 relative (1–2 ulp
# of NLLs near 60; the memory adapter's, over every layer, the largest)
PREPARED_RTOL = {"adapted": 0.0, "frozen": 1e-6}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def shots_memory(tiny, tmp_path_factory):
    """A memory whose prompt has few-shot examples: a shared prefix of ~37 tokens before each sample's own."""
    from backbone.prompts import Prompt
    from memories.build import build_memory
    from memories.parse import Sample

    out = tmp_path_factory.mktemp("shots") / "m"
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)]
    return build_memory(tiny, samples, out, prompt=Prompt.for_task("translation", examples=SHOTS))


def _perturbed(tiny, memory, method, extra, **more):
    """A plug-in whose weights are moved off its (identity) initialisation, so that every hook changes something;
    the memory adapter gets a random phrase memory on its layers (no back-translation) and an even gate."""
    if method == "memory_adapter":
        more = {"gate_bias": 0.0, "memory_dropout": 0.5, **more}
    p = new_plugin(method, tiny, memory, {**extra, "batch_size": 3, **more})
    g = torch.Generator().manual_seed(0)
    if method == "memory_adapter":
        from plugins.network import parse_layers

        p._build_blocks({l: 6 for l in parse_layers(extra["layers"], tiny.num_layers)})
        with torch.no_grad():
            for name, b in p.named_buffers():
                if ".mem_" in name:
                    b.copy_(torch.randn(b.shape, generator=g))
                elif name.endswith(".scale"):
                    b.fill_(0.7)
        p.to(tiny.device)
    with torch.no_grad():
        for q in p.parameters():
            q.add_(torch.randn(q.shape, generator=g) * 0.05)
    return p


def _token_nll(p, batch, **state) -> torch.Tensor:
    """Per target token NLL of ``batch`` with the plug-in on every row, in the order of the samples' targets."""
    fc = p.batch_fc(batch, **state)
    sel = batch.labels != -100
    return F.cross_entropy(p.target_logits(fc[sel]), p.target_index(batch.labels[sel]), reduction="none")


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, what=""):
    if rtol == 0:
        assert torch.equal(a, b), (what, float((a - b).abs().max()))
    else:
        torch.testing.assert_close(a, b, rtol=rtol, atol=0.0, msg=lambda m: f"{what}: {m}")


def _batches(tiny, p, data, full=False):
    return TrainingBatches(tiny, data, 3, p.frozen_prefix, p.lowest_layer(), full=full)


def test_length_buckets_cover_every_sample_once_one_prefix_each(tiny, shots_memory):
    data = memory_sequences(tiny, shots_memory, "train")
    assert min(data.shared) >= 30  # the few-shot prefix
    for frozen in (True, False):
        buckets = length_buckets(data, 4, frozen)
        assert sorted(i for b in buckets for i in b) == list(range(len(data)))
        assert all(len(b) <= 4 for b in buckets)
        if frozen:
            assert all(len({data.shared[i] for i in b}) == 1 for b in buckets)


@pytest.mark.parametrize("method,extra", CASES, ids=IDS)
@pytest.mark.parametrize("prompt_prefix", ["frozen", "adapted"])
def test_prepared_batches_equal_whole_sequences(tiny, shots_memory, method, extra, prompt_prefix):
    """Every target token's loss in a prepared batch (prefix as the past, layers below the plug-in once) is its loss
    with the same samples as whole sequences through the whole backbone, with the plug-in kept off the shared
    prefix (``frozen``) or on every position (``adapted``)."""
    p = _perturbed(tiny, shots_memory, method, extra, prompt_prefix=prompt_prefix)
    data = memory_sequences(tiny, shots_memory, "train")
    fast, full = _batches(tiny, p, data), _batches(tiny, p, data, full=True)
    assert all(isinstance(fast[i], PreparedBatch) for i in range(len(fast))) and fast.fallbacks == 0
    assert all(isinstance(full[i], FullBatch) for i in range(len(full)))
    if prompt_prefix == "frozen":
        assert all(fast[i].hidden.shape[1] < full[i].ids.shape[1] - 25 for i in range(len(fast)))  # no prefix
    rtol = PREPARED_RTOL[prompt_prefix]
    with torch.no_grad():
        for i in range(len(fast)):
            a, b = _token_nll(p, fast[i]), _token_nll(p, full[i])
            assert len(a) == len(b) == int((full[i].labels != -100).sum())
            _close(a, b, rtol, (i, fast.buckets[i]))


def _hooked_layers(tiny, p) -> list[int]:
    """The decoder layers whose modules carry one of the plug-in's hooks while it is attached."""
    before = [forward_hook_count(layer) for layer in tiny.layers]
    handles = p.attach(None, {})
    try:
        after = [forward_hook_count(layer) for layer in tiny.layers]
    finally:
        for h in handles:
            h.remove()
    return [l for l, (a, b) in enumerate(zip(after, before)) if a > b]


@pytest.mark.parametrize("method,extra", CASES, ids=IDS)
def test_lowest_layer_is_the_lowest_hooked_one(tiny, shots_memory, method, extra):
    """A prepared batch starts at the lowest layer the plug-in hooks: higher would skip a hook (caught by the test
    above), lower runs frozen layers at every step for nothing."""
    p = _perturbed(tiny, shots_memory, method, extra)
    hooked = _hooked_layers(tiny, p)
    assert hooked and p.lowest_layer() == min(hooked)
    if method == "memory_adapter":
        assert hooked == p.adapted_layers == ([0, 1] if extra["layers"] == "all" else [1])


def test_lowest_layer_runs_only_the_layers_above(tiny, shots_memory):
    """LoRA on the last layer: a prepared batch starts at the last layer's input (the frozen layer below runs once)."""
    p = _perturbed(tiny, shots_memory, "lora", {"alpha": 64.0})
    assert p.lowest_layer() == tiny.num_layers - 1
    data = memory_sequences(tiny, shots_memory, "train")
    fast = TrainingBatches(tiny, data, 3, True, p.lowest_layer())
    calls = []
    h = tiny.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        fast[0]  # prepared: runs layer 0 once
        n = len(calls)
        for _ in range(3):
            with torch.no_grad():
                p.hooked_seq_loss(fast[0])
        assert len(calls) == n  # training steps never run layer 0 again
    finally:
        h.remove()


def test_preparing_a_batch_runs_no_layer_from_the_lowest_up(tiny, shots_memory, monkeypatch):
    """The residual adapter (lowest layer 0): preparing a batch reads the layers' arguments without running any of
    them, leaves no stand-in behind, and the training step then runs every layer."""
    p = _perturbed(tiny, shots_memory, "adapter", {"bottleneck": 4})
    assert p.lowest_layer() == 0
    layer_cls = type(tiny.layers[0])
    runs = []
    real = layer_cls.forward

    def counted(self, *args, **kwargs):
        runs.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(layer_cls, "forward", counted)
    # two attention types, the second first seen at layer 1 (as Gemma's full attention at 5): the arguments of
    # layer 1 are needed, and layer 0 must not run to get there
    monkeypatch.setattr("plugins.training_batches.layer_types", lambda bb: ["sliding", "full"])
    data = memory_sequences(tiny, shots_memory, "train")
    batches = TrainingBatches(tiny, data, 3, True, 0)
    batches._prefix(batches.buckets[0])  # the shared prefix's keys and values: the whole frozen model, once
    runs.clear()
    prepared = batches[0]
    assert isinstance(prepared, PreparedBatch) and runs == []
    assert all("forward" not in layer.__dict__ for layer in tiny.layers)
    with torch.no_grad():
        p.hooked_seq_loss(prepared)
    assert len(runs) == tiny.num_layers


@pytest.mark.parametrize("layers", ["all", "1"])
@pytest.mark.parametrize("prompt_prefix", ["frozen", "adapted"])
def test_memory_adapter_doubled_batch_is_its_two_passes(tiny, shots_memory, layers, prompt_prefix):
    """The memory adapter's objective runs the full-memory and the dropped-memory pass as one doubled batch: its
    loss is NLL(full) + α·NLL(dropped) + β·½(KL(p‖q) + KL(q‖p)) computed from two separate passes over the same
    rows — on prepared batches and whole sequences alike, each row's dropped layers its own."""
    p = _perturbed(tiny, shots_memory, "memory_adapter", {"layers": layers}, prompt_prefix=prompt_prefix)
    cfg = p.config
    data = memory_sequences(tiny, shots_memory, "train")
    L = len(p.adapted_layers)
    dropped_some = kept_some = False
    # and one whole-sequence batch of samples whose shared prefixes differ in length (each row its own start)
    from plugins.seqtrain import collate

    mixed = sorted({data.shared[i]: i for i in range(len(data))}.values()) + [1, 2]
    assert len({data.shared[i] for i in mixed}) > 1
    own = torch.tensor([data.shared[i] for i in mixed]) if p.frozen_prefix else None
    for batches in (_batches(tiny, p, data), _batches(tiny, p, data, full=True),
                    [FullBatch(tiny, *collate(tiny, data, mixed), own)]):
        for i in range(len(batches)):
            b = batches[i]
            drop = torch.rand(b.size, L, generator=torch.Generator().manual_seed(100 + i)) < cfg.memory_dropout
            dropped_some |= bool(drop.any())
            kept_some |= bool((~drop).any())
            p._drop_rng = torch.Generator().manual_seed(100 + i)  # the same draw as ``drop``
            with torch.no_grad():
                loss, n, parts = p.train_batch_loss(b)
                sel = b.labels != -100
                every = torch.ones(b.size, L, dtype=torch.bool)
                lp = torch.log_softmax(p.target_logits(p.batch_fc(b, keep=every)[sel]), -1)
                lq = torch.log_softmax(p.target_logits(p.batch_fc(b, keep=~drop)[sel]), -1)
            y = b.labels[sel]
            nll_p, nll_q = F.nll_loss(lp, y), F.nll_loss(lq, y)
            kl = 0.5 * ((lp.exp() - lq.exp()) * (lp - lq)).sum(-1).mean()
            assert n == len(y)
            # one doubled batch vs two single ones: the same per-row arithmetic but for the batch size, measured
            # ≤ 8.2e-8 relative (the KL, near 0 when few layers are dropped, also 2e-12 absolute)
            assert float(parts["nll"]) == pytest.approx(float(nll_p), rel=5e-7, abs=0)
            assert float(parts["nll_dropped"]) == pytest.approx(float(nll_q), rel=5e-7, abs=0)
            assert float(parts["kl"]) == pytest.approx(float(kl), rel=5e-7, abs=1e-10)
            assert float(loss) == pytest.approx(float(nll_p + cfg.alpha * nll_q + cfg.beta * kl), rel=5e-7, abs=0)
            if bool(drop.any()):
                assert float(nll_q) != float(nll_p)  # the dropped pass is a different pass
    assert dropped_some and kept_some


@pytest.mark.parametrize("method,extra", CASES, ids=IDS)
def test_frozen_prefix_is_the_frozen_backbones(tiny, shots_memory, method, extra):
    """``frozen``: at the shared prefix's positions the states are exactly the frozen backbone's; ``adapted`` acts
    there too."""
    from plugins.seqtrain import collate

    data = memory_sequences(tiny, shots_memory, "train")
    ids, mask, labels = collate(tiny, data, [0, 1, 2])
    P = min(data.shared[:3])
    with torch.no_grad():
        base = tiny.forward_fc(ids, attention_mask=mask)[0]
        for prompt_prefix in ("frozen", "adapted"):
            p = _perturbed(tiny, shots_memory, method, extra, prompt_prefix=prompt_prefix)
            batch = FullBatch(tiny, ids, mask, labels, torch.tensor(data.shared[:3]) if p.frozen_prefix else None)
            fc = p.batch_fc(batch)
            if method == "lora":  # on the last layer's output projection: the prefix's last states only
                continue
            same = torch.equal(fc[:, :P], base[:, :P])
            assert same == (prompt_prefix == "frozen")
            for r in range(3):  # from each row's own first position on, the plug-in acts
                s = data.shared[r]
                assert not torch.equal(fc[r, s], base[r, s]), r
            assert not torch.allclose(fc[:, P + 2:], base[:, P + 2:])


def _decode_path_nll(bb, plugin, prompt, data, idx, sources_at_once: int) -> list[float]:
    """Each sample's summed NLL of its target through the decode path: ``prefill`` (the prompt's shared prefix
    from the prefix cache for one source, left-padded prompts for several) and then one decode step per target
    token, teacher-forced, with the plug-in attached to its rows as a comparison attaches it."""
    out = []
    for b0 in range(0, len(idx), sources_at_once):
        chunk = idx[b0:b0 + sources_at_once]
        ctxs = [data.contexts[i] for i in chunk]
        batch = plan_batch(bb, [f"s{i}" for i in chunk], [Row("p", plugin)], prompt, contexts=ctxs)
        tot = [0.0] * len(chunk)
        with torch.no_grad():
            fc_last, cache, mask, _ = prefill(bb, batch, use_prefix_cache=True, trace=False)
            targets = [data.targets[i] for i in chunk]
            for t in range(max(len(y) for y in targets)):
                lp = torch.log_softmax(bb.logits_from_fc(fc_last).float(), dim=-1)
                for r, y in enumerate(targets):
                    if t < len(y):
                        tot[r] -= float(lp[r, y[t]])
                step = torch.tensor([y[t] if t < len(y) else 0 for y in targets], device=bb.device)
                handles = plugin.attach(batch.net[0].rows, batch.net[0].settings, trace=False)
                try:  # the decode's own step (pad-neutral: a left-padded row computes what it computes alone)
                    fc_last, cache, mask = forward_step(bb, cache, mask, step, padded=len(chunk) > 1)
                finally:
                    for h in handles:
                        h.remove()
        out += tot
    return out


def _prepared_nll(tiny, p, data) -> list[float]:
    """Each sample's summed target NLL through the training path (prepared batches of one sample each)."""
    tb = TrainingBatches(tiny, data, 1, p.frozen_prefix, p.lowest_layer())
    got = [0.0] * len(data)
    with torch.no_grad():
        for i in range(len(tb)):
            got[tb.buckets[i][0]] = float(_token_nll(p, tb[i]).double().sum())
    return got


INSTRUCTION = "Translate each English sentence below into German and keep the meaning and the tone of the original.\n"
# decoded in this order: each prompt's context starts with the previous one's shared prefix, so the prefix cache
# hands the next one a cached prefix shorter than its own shared prefix (52 tokens, then 52 of 54–55 and of ~125)
PROMPT_TEMPLATES = [(INSTRUCTION + "{src}\n", ()), (INSTRUCTION + "English: {src}\nGerman:", ()),
                    (INSTRUCTION + "English: {src}\nGerman:", SHOTS[:1])]
# the decode path vs prepared batches: exact arithmetic but for the order of additions in attention over a growing
# cache (and the memory adapter's folded decode products); measured ≤ 2.8e-7 relative on per-sample NLL sums
DECODE_RTOL = 1e-6


@pytest.mark.parametrize("method,extra", CASES, ids=IDS)
def test_decode_path_is_the_training_path(tiny, shots_memory, method, extra, monkeypatch):
    """Prompts whose shared prefixes differ in length (one a prefix of another's), the prefix cache reused, and
    samples of 3 to 90 own tokens left-padded together: every sample's NLL through the decode path is its NLL
    through the training path (prepared batches: the prefix as the frozen past); each pass reads exactly its
    prompt's shared prefix, never a shorter one that an earlier prompt cached."""
    from backbone.prompts import Prompt
    from engine import forward
    from engine.prefix_cache import PREFIX_KV, PrefixKV
    from memories.build import target_ids

    p = _perturbed(tiny, shots_memory, method, extra)
    assert p.frozen_prefix
    seen, hits = [], []
    real, real_get = forward._cached_prefix, PREFIX_KV.get

    def spy(bb, batch, s, ids, use_prefix_cache):
        P, past = real(bb, batch, s, ids, use_prefix_cache)
        seen.append((P, shared_prompt_len(bb, batch.prompt, batch.contexts[s])))
        return P, past

    def get_spy(*args, **kwargs):
        got = real_get(*args, **kwargs)
        hits.append(got[0])
        return got

    monkeypatch.setattr(forward, "_cached_prefix", spy)
    monkeypatch.setattr(PREFIX_KV, "get", get_spy)
    PREFIX_KV.clear()
    sources = [PAIRS[1], PAIRS[2], PAIRS[0]]  # 1, 22 and 4 words
    for template, shots in PROMPT_TEMPLATES:
        prompt = Prompt(template=template, examples=list(shots))
        ctx = [tiny.encode_context(prompt.render(s)) for s, _ in sources]
        data = SeqData(ctx, [target_ids(tiny, prompt, t) for _, t in sources],
                       [shared_prompt_len(tiny, prompt, c) for c in ctx])
        want = _prepared_nll(tiny, p, data)
        for at_once in (1, 3):
            got = _decode_path_nll(tiny, p, prompt, data, list(range(len(data))), at_once)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=DECODE_RTOL, atol=0.0,
                                       msg=lambda m: f"{template!r} {at_once}: {m}")
    PREFIX_KV.clear()
    assert all(P == (own if own >= PrefixKV.MIN_TOKENS else 0) for P, own in seen)
    assert any(hits)  # a cached prefix was reused
    assert len({own for _, own in seen}) >= 3


def _trained(tiny, memory, method, extra, tmp_path):
    fast = {"lr": 1e-2, "batch_size": 3, "max_epochs": 2, "evals_per_epoch": 1, "patience": 3, "max_minutes": 0,
            "max_heldout": 4}
    if method == "memory_adapter":
        fast = {**fast, "max_translate": 8, "max_epochs": 1, "lr_schedule": "constant", "lr": 3e-2}
    return train_plugin(tiny, memory, method, {**extra, **fast}, out_dir=tmp_path / "p")[0]


# the reported early-stopping loss (mean over the early-stopping samples' target tokens) vs the decode path:
# measured ≤ 1.2e-7 relative with the prefix cache, ≤ 5.4e-7 for memory-tuning's two samples left-padded together (their
# rotary positions shifted by the padding: the same attention up to rounding)
REPORTED_RTOL = 2e-6


@pytest.mark.parametrize("method,extra", CASES, ids=IDS)
def test_reported_loss_is_the_decode_paths(tiny, shots_memory, method, extra, tmp_path):
    """A trained plug-in's reported early-stopping loss equals the NLL of the same samples recomputed through the
    decode path (one source with the prefix cache, and the early-stopping samples — of very different lengths —
    left-padded together)."""
    def own_lengths(d):
        return [len(d.contexts[i]) - d.shared[i] + len(d.targets[i]) for i in range(len(d))]

    def spread(d):
        return max(own_lengths(d)) > 3 * min(own_lengths(d))

    # a seed whose early-stopping samples differ in length (which samples train is the grouped split's)
    train = memory_sequences(tiny, shots_memory, "train")
    seed = next(s for s in range(100) if spread(split_for_early_stopping(train, s, max_samples=4)[1]))
    plugin = _trained(tiny, shots_memory, method, {**extra, "seed": seed}, tmp_path)
    assert plugin.config.seed == seed
    info = plugin.train_info
    assert info["prompt_prefix"] == "frozen" and info["steps"] > 0
    _, held = plugin._data(shots_memory)
    assert spread(held)  # left padding matters
    n = sum(len(y) for y in held.targets)
    for at_once in (1, len(held)):
        got = sum(_decode_path_nll(tiny, plugin, shots_memory.prompt, held, list(range(len(held))), at_once)) / n
        assert got == pytest.approx(info["best_heldout_loss"], rel=REPORTED_RTOL, abs=0), at_once


def test_saved_before_prompt_prefix_loads_as_adapted(tiny, shots_memory, tmp_path):
    import json

    from plugins.adapter import AdapterConfig
    from plugins.base import load_plugin

    p = new_plugin("adapter", tiny, shots_memory, {"bottleneck": 4, "max_epochs": 0})
    assert p.frozen_prefix  # the default
    out = p.save(tmp_path / "a")
    meta = json.loads((out / "plugin_config.json").read_text())
    del meta["config"]["prompt_prefix"]
    (out / "plugin_config.json").write_text(json.dumps(meta))
    assert not load_plugin(out, tiny).frozen_prefix
    assert AdapterConfig.from_dict({}).prompt_prefix == "frozen"


def test_cli_list_status_and_export_backbone_from_the_plugin(tiny, shots_memory, tmp_path):
    """``plugins list`` says how training ended, as the Plug-ins tab; ``plugins export`` loads the backbone (and
    precision) the plug-in was trained on unless told otherwise."""
    import argparse
    import json

    from plugins.__main__ import plugin_backbone_args, plugin_status

    assert plugin_status({"metrics": json.dumps({"stopped_by": "time_budget", "epochs": 0.12, "max_epochs": 3})}) \
        == "stopped by time budget at 0.12 of 3 epochs — under-trained"
    assert plugin_status({"metrics": json.dumps({"stopped_by": "early_stopping", "epochs": 4.0})}) \
        == "converged: early stopping at 4 epochs"
    assert plugin_status({"metrics": None}) == "ready"
    out = new_plugin("adapter", tiny, shots_memory, {"bottleneck": 4}).save(tmp_path / "a")
    args = argparse.Namespace(id=str(out), backbone=None, dtype=None)
    plugin_backbone_args(args, None)
    assert (args.backbone, args.dtype) == (tiny.name, "float32")
    args = argparse.Namespace(id=str(out), backbone="other", dtype="bfloat16")
    plugin_backbone_args(args, None)
    assert (args.backbone, args.dtype) == ("other", "bfloat16")
