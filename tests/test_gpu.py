"""The GPU path, end to end on a saved tiny model loaded the way a user loads a hub id or local folder
(``load_backbone(path, device="cuda")``): memory build, every plug-in's training, the batched comparison and the
per-method decodes agree. Skipped where CUDA is absent (CI has no GPU); the unit tests can also run on a GPU with
``PEMA_TINY_DEVICE=cuda``."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

FAST = {
    "pema": {"rank": 16, "max_epochs_rct": 3, "max_epochs_joint": 8, "lr": 1e-2},
    "knn": {},
    "adapter": {"bottleneck": 16, "lr": 1e-2, "batch_size": 4, "max_epochs": 4, "max_minutes": 0},
    "lora": {"alpha": 64.0, "lr": 1e-2, "batch_size": 4, "max_epochs": 4, "max_minutes": 0},
    "memory_tuning": {"slots": 10, "lr": 1e-2, "batch_size": 4, "max_epochs": 4, "max_minutes": 0},
}


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    from backbone.tiny import tiny_backbone

    bb = tiny_backbone(device="cpu")
    path = tmp_path_factory.mktemp("tiny-model")
    bb.model.save_pretrained(path)
    bb.tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_build_train_and_compare_on_cuda(saved_tiny, tiny_pairs, tmp_path, dtype):
    from backbone import load_backbone
    from backbone.prompts import Prompt
    from engine import Row, compare
    from memories.build import build_memory
    from memories.parse import Sample
    from plugins.api import train_plugin

    bb = load_backbone(str(saved_tiny), device="cuda", dtype=dtype)
    assert bb.device.type == "cuda" and bb.dtype == getattr(torch, dtype)
    prompt = Prompt.for_task("translation")
    mem = build_memory(bb, [Sample(s, t, i + 1) for i, (s, t) in enumerate(tiny_pairs)], tmp_path / "m",
                       prompt=prompt)
    assert len(mem) > 0
    plugins = {m: train_plugin(bb, mem, m, cfg, out_dir=tmp_path / m)[0] for m, cfg in FAST.items()}
    assert all(p.to_backbone() is p for p in plugins.values())  # trained where the backbone is
    rows = [Row("base")] + [Row(m, p) for m, p in plugins.items()]
    c = compare(bb, "the cat sleeps", rows, prompt, max_new_tokens=6)
    assert all(r.tokens for r in c.rows)
    if dtype == "float32":  # bfloat16 batches may round near-ties differently from single rows
        for r in rows:
            single = compare(bb, "the cat sleeps", [r], prompt, max_new_tokens=6)
            assert single.rows[0].tokens == c.row(r.label).tokens, r.label
