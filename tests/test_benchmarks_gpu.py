"""``python -m benchmarks gpu`` (a config's shapes with random weights) and ``python -m benchmarks heldout`` on tiny
models: what they build and report (no timing is asserted: timings go to BENCHMARKS.md and docs/gpu.md)."""
import gzip
import json

import pytest
import torch


def _config_dir(tmp_path, tiny, gz: bool):
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=len(tiny.tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           sliding_window=16, layer_types=["sliding_attention", "sliding_attention",
                                                           "full_attention"],
                           pad_token_id=tiny.tokenizer.pad_token_id, bos_token_id=tiny.tokenizer.bos_token_id,
                           eos_token_id=tiny.tokenizer.eos_token_id)
    d = tmp_path / "cfg"
    cfg.save_pretrained(d)
    tiny.tokenizer.save_pretrained(d)
    if gz:  # a GPU call carries the tokenizer gzipped
        big = d / "tokenizer.json"
        with gzip.open(d / "tokenizer.json.gz", "wb") as f:
            f.write(big.read_bytes())
        big.unlink()
    return d


@pytest.mark.parametrize("gz", [False, True])
def test_random_backbone_has_the_configs_shapes(tmp_path, tiny, gz):
    from benchmarks.gpu import random_backbone
    from engine import Row, compare

    bb = random_backbone(_config_dir(tmp_path, tiny, gz), device="cpu", dtype="float32", layers=2)
    assert (bb.hidden_size, bb.num_layers, bb.vocab_size) == (64, 2, len(tiny.tokenizer))
    assert bb.model.config.layer_types == ["sliding_attention", "sliding_attention"]
    again = random_backbone(_config_dir(tmp_path / "b", tiny, gz), device="cpu", dtype="float32", layers=2)
    assert torch.equal(bb.lm_head.weight, again.lm_head.weight)  # seeded
    out = compare(bb, "the house is small", [Row("base")], max_new_tokens=3, trace=False)
    assert len(out.rows) == 1


def test_gpu_benchmark_runs_cpu_sized(tiny, shared_data, tmp_path):
    from backbone.options import using_fast_paths
    from benchmarks.gpu import run

    with using_fast_paths(graph_decode="static"):  # the GPU's step without graph capture: every comparison takes it
        res = run(tiny, pairs=12, tokens=4, reps=1, small=True, methods=["pema", "knn", "adapter"], work=tmp_path)
    assert {k: v["path"] for k, v in res["decode_path"].items()} == dict.fromkeys(res["decode_step_ms"], "static")
    assert res["memory_build"]["entries"] > 0 and res["memory_build"]["pairs"] == 12  # short pairs of the first 96
    assert set(res["training"]) == {"pema", "knn", "adapter"}
    assert res["training"]["adapter"]["stopped_by"] == "max_epochs"
    assert res["training"]["adapter"]["epochs"] == 1
    assert set(res["decode_step_ms"]) == {"1 row", "3 output-level rows", "4 rows", "7 rows"}
    assert all(v >= 0 for v in res["decode_step_ms"].values())  # a tiny model's step may round to 0
    assert res["host_reads_7_rows"]["scalar_reads_per_step"] >= 0
    assert 0 < res["slider"]["move_over_full"]
    json.dumps(res)


def test_heldout_nll_base_by_hand_and_a_plugin(tiny, tiny_memory, tmp_path):
    from benchmarks.heldout import heldout_nll
    from plugins.api import train_plugin
    from plugins.seqtrain import collate, memory_sequences, target_logits

    base = heldout_nll(tiny, tiny_memory)
    data = memory_sequences(tiny, tiny_memory, "heldout")
    assert base["samples"] == len(data) > 0
    ids, mask, labels = collate(tiny, data, range(len(data)))
    with torch.no_grad():
        lp = torch.log_softmax(target_logits(tiny, ids, mask).float(), -1)
    sel = labels != -100
    want = float(-lp[sel].gather(1, labels[sel][:, None]).mean())
    assert base["tokens"] == int(sel.sum()) and abs(base["nll"] - want) < 1e-3
    knn, _ = train_plugin(tiny, tiny_memory, "knn", {}, out_dir=tmp_path / "knn")
    got = heldout_nll(tiny, tiny_memory, knn)
    assert got["tokens"] == base["tokens"] and got["nll"] != base["nll"]  # kNN mixes its neighbours in
