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
from plugins.api import new_plugin
from plugins.decode import Row, compare, decode_batch, start_compare
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
    from plugins.decode import warm_comparison

    with using_fast_paths(graph_decode=mode):
        before = _runs([compare(tiny, "the red house", rows, PROMPT, max_new_tokens=6)])
        if tiny.device.type != "cuda":
            assert warm_comparison(tiny) == {}  # a CPU has no first-call work to move
        assert warm_comparison(tiny, force=True)["seconds"] >= 0
        after = _runs([compare(tiny, "the red house", rows, PROMPT, max_new_tokens=6)])
    assert after == before
