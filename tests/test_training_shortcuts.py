"""The in-network plug-ins' training shortcuts on the tiny backbone: a shared prompt prefix computed once by the frozen
backbone and given as the past, the frozen layers below the plug-in run once per batch, length buckets — each
exact where it claims to be (the same losses as whole sequences through the whole backbone, the plug-in kept off
the prefix) — and a trained plug-in's reported loss equal to the loss recomputed through the decode path."""
from __future__ import annotations

import pytest
import torch

from plugins.api import new_plugin, train_plugin
from plugins.decode import Row, plan_batch, prefill
from plugins.network import FullBatch, PreparedBatch, TrainingBatches
from plugins.seqtrain import length_buckets, memory_sequences

PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt"), ("the cat", "die Katze"),
         ("the small house", "das kleine Haus")] * 3
SHOTS = [("the house is small", "das Haus ist klein"), ("good morning", "Guten Morgen")]
CASES = [("adapter", {"bottleneck": 8}), ("lora", {"alpha": 64.0}), ("memory_tuning", {"slots": 8}),
         ("memory_tuning", {"variant": "MT-M"})]
IDS = ["adapter", "lora", "mt-mf", "mt-m"]


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
    """A plug-in whose weights are moved off its (identity) initialisation, so that every hook changes something."""
    p = new_plugin(method, tiny, memory, {**extra, "batch_size": 3, **more})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for q in p.parameters():
            q.add_(torch.randn(q.shape, generator=g) * 0.05)
    return p


def _losses(p, batches):
    with torch.no_grad():
        return [p.hooked_seq_loss(batches[i]) for i in range(len(batches))]


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
    """Exact: the loss of a prepared batch (prefix as the past, layers below the plug-in once) is the loss of the
    same samples as whole sequences through the whole backbone, with the plug-in kept off the shared prefix
    (``frozen``) or on every position (``adapted``)."""
    p = _perturbed(tiny, shots_memory, method, extra, prompt_prefix=prompt_prefix)
    data = memory_sequences(tiny, shots_memory, "train")
    fast = TrainingBatches(tiny, data, 3, p.frozen_prefix, p.lowest_layer())
    full = TrainingBatches(tiny, data, 3, p.frozen_prefix, p.lowest_layer(), full=True)
    assert all(isinstance(fast[i], PreparedBatch) for i in range(len(fast)))
    assert all(isinstance(full[i], FullBatch) for i in range(len(full)))
    if prompt_prefix == "frozen":
        assert all(fast[i].hidden.shape[1] < full[i].ids.shape[1] - 25 for i in range(len(fast)))  # no prefix
    for (a, na), (b, nb) in zip(_losses(p, fast), _losses(p, full)):
        assert na == nb
        assert float(a) == pytest.approx(float(b), rel=1e-5, abs=1e-5)


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
            _losses(p, [fast[0]])
        assert len(calls) == n  # training steps never run layer 0 again
    finally:
        h.remove()


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
            assert not torch.allclose(fc[:, P + 2:], base[:, P + 2:])


def _decode_path_nll(bb, plugin, prompt, data, idx, sources_at_once: int) -> float:
    """Token-weighted mean NLL of samples ``idx``'s targets through the decode path: ``prefill`` (the prompt's shared
    prefix from the prefix cache for one source, left-padded prompts for several) and then one decode step per
    target token, teacher-forced, with the plug-in attached to its rows as a comparison attaches it."""
    from plugins.network import set_own_from  # noqa: F401  (the prefill sets it; imported to fail loudly if gone)

    tot, n = 0.0, 0
    for b0 in range(0, len(idx), sources_at_once):
        chunk = idx[b0:b0 + sources_at_once]
        ctxs = [data.contexts[i] for i in chunk]
        batch = plan_batch(bb, [f"s{i}" for i in chunk], [Row("p", plugin)], prompt, contexts=ctxs)
        with torch.no_grad():
            fc_last, cache, mask, _ = prefill(bb, batch, use_prefix_cache=True, trace=False)
            targets = [data.targets[i] for i in chunk]
            for t in range(max(len(y) for y in targets)):
                lp = torch.log_softmax(bb.logits_from_fc(fc_last).float(), dim=-1)
                for r, y in enumerate(targets):
                    if t < len(y):
                        tot -= float(lp[r, y[t]])
                        n += 1
                step = torch.tensor([[y[t] if t < len(y) else 0] for y in targets], device=bb.device)
                mask = torch.cat([mask, torch.ones_like(step)], dim=1)
                handles = plugin.attach(batch.net[0].rows, batch.net[0].settings, trace=False)
                try:
                    fc, out = bb.forward_fc(step, attention_mask=mask if len(chunk) > 1 else None,
                                            past_key_values=cache, use_cache=True)
                finally:
                    for h in handles:
                        h.remove()
                fc_last, cache = fc[:, -1], out.past_key_values
    return tot / n


@pytest.mark.parametrize("method,extra", CASES, ids=IDS)
def test_reported_loss_is_the_decode_paths(tiny, shots_memory, method, extra, tmp_path):
    """A trained plug-in's reported early-stopping loss equals the NLL of the same samples recomputed through the
    decode path (one source with the prefix cache, and two left-padded sources at once)."""
    fast = {"lr": 1e-2, "batch_size": 3, "max_epochs": 2, "evals_per_epoch": 1, "patience": 3, "max_minutes": 0,
            "max_heldout": 4}
    plugin, _ = train_plugin(tiny, shots_memory, method, {**extra, **fast}, out_dir=tmp_path / "p")
    info = plugin.train_info
    assert info["prompt_prefix"] == "frozen" and info["steps"] > 0
    _, held = plugin._data(shots_memory)
    for at_once in (1, 2):
        got = _decode_path_nll(tiny, plugin, shots_memory.prompt, held, list(range(len(held))), at_once)
        assert got == pytest.approx(info["best_heldout_loss"], rel=1e-4, abs=1e-4), at_once


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
