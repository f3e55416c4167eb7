"""A rank whose trainings run on workers (``eval.rank.rank(trainer=...)``; ``python -m eval rank --workers N``,
``studio.ray_executor.RankTrainer``): the trainer gets every method that trains, all in one call, the others train
here; the leaderboard records where they ran; the plan's progress counts trainings that run side by side. Then the
command itself on a local Ray cluster of 2 workers (slow: it starts Ray and its worker processes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_rank import unique_pairs

from eval import rank as rank_mod
from plugins.api import train_plugin
from plugins.registry import available_methods, get_method, method_card

ROOT = Path(__file__).resolve().parents[1]
QUICK = {m: method_card(m).quick_settings for m in available_methods()}


class InProcessTrainer:
    """A trainer that records its calls and trains here (the Ray one is tested below, end to end)."""

    def __init__(self):
        self.calls: list[list[str]] = []

    @staticmethod
    def runs(method: str) -> bool:
        return not get_method(method).needs_memory_at_decode and get_method(method).level != "prompt"

    @staticmethod
    def slots() -> int:
        return 2

    @staticmethod
    def describe() -> dict:
        return {"executor": "fake", "workers": 2, "address": None, "gpus": 0}

    def train_many(self, backbone, memory, jobs, *, catalog, owner, progress, should_stop):
        self.calls.append([j["method"] for j in jobs])
        out = {}
        for j in jobs:
            progress(j["method"], 0.5, "half way")
            _, row = train_plugin(backbone, memory, j["method"], j["config"], catalog=catalog.owned_by(owner),
                                  name=j["name"])
            out[j["method"]] = row
        return out


def _memory(bb, cat, n: int = 120):
    from backbone.prompts import Prompt
    from memories.build import build_memory, memory_row
    from memories.parse import Sample

    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(unique_pairs(n))]
    mem = build_memory(bb, samples, cat.root / "memories" / "m", prompt=Prompt.for_task("translation"),
                       heldout_frac=0.15, key_dtype="float32")
    cat.add_memory(memory_row(mem))
    return mem


def test_the_trainer_trains_the_methods_that_train_at_once_and_the_leaderboard_says_where(tiny, tmp_path):
    from ground.store import Catalog

    cat = Catalog(tmp_path)
    mem = _memory(tiny, cat)
    trainer, seen = InProcessTrainer(), []
    methods = ["knn", "retrieval_icl", "lora", "adapter"]
    board = rank_mod.rank(tiny, mem, catalog=cat, methods=methods, configs=QUICK, n_tune=8, bootstrap=50,
                          cost_sentences=1, max_new_tokens=8, trainer=trainer,
                          progress=lambda f, msg: seen.append((f, msg)))
    assert trainer.calls == [["lora", "adapter"]]  # one call, both at once; kNN and retrieval train here
    assert board["workers"] == trainer.describe()
    rows = {r["method"]: r for r in board["methods"]}
    assert set(rows) == {"base", *methods}
    assert {m: rows[m]["trained_on"] for m in methods} == {"knn": "here", "retrieval_icl": "here",
                                                           "lora": "here", "adapter": "here"}
    assert all(rows[m]["plugin_id"] and rows[m]["reused"] is False for m in methods)
    assert len({p["id"] for p in cat.plugins()}) == len(methods)
    assert seen[-1][0] == 1.0
    assert any("half way" in msg for _, msg in seen)  # the workers' progress reached the rank's
    assert "Trained on 2 Fake worker(s)" in rank_mod.format_leaderboard(board)
    # a second rank reuses them all and asks the trainer for nothing
    again = rank_mod.rank(tiny, mem, catalog=cat, methods=methods, configs=QUICK, n_tune=8, bootstrap=50,
                          cost_sentences=1, max_new_tokens=8, trainer=trainer)
    assert trainer.calls == [["lora", "adapter"]]
    assert all(r["reused"] for r in again["methods"] if r["method"] != "base")


def test_without_a_trainer_the_leaderboard_says_it_trained_in_process():
    assert rank_mod.IN_PROCESS == {"executor": "inprocess", "workers": 1}


def test_the_plan_counts_items_that_run_at_once():
    """Two trainings half done side by side leave as much to do as one of them done."""
    def plan_with(*fracs):
        plan = rank_mod.Plan(lambda f, msg: None, clock=lambda: 100.0)
        items = [plan.add("training", "A", 10), plan.add("training", "B", 10), plan.add("evaluation", "rows", 20)]
        for item, frac in zip(items, fracs):
            plan.start(item)(frac)
        return plan.remaining(100.0)

    assert plan_with(0.5, 0.5) == pytest.approx(plan_with(1.0, 0.0))
    assert plan_with(0.5, 0.5) < plan_with(0.5, 0.0) < plan_with(0.0, 0.0)


@pytest.mark.slow
def test_eval_rank_with_two_ray_workers_ranks_every_method(tiny_pairs, tmp_path):
    """``python -m eval rank <memory> --backbone <tiny folder> --workers 2`` on a local Ray cluster of 2 CPUs: every
    method in the leaderboard, the trainings on the workers (kNN and retrieval here), the workers recorded."""
    pytest.importorskip("ray")
    from backbone import load_backbone
    from backbone.tiny import tiny_backbone
    from ground.store import Catalog

    folder = tmp_path / "tiny-model"
    tb = tiny_backbone(device="cpu")
    tb.model.save_pretrained(folder)
    tb.tokenizer.save_pretrained(folder)
    env = {**os.environ, "PEMA_DTYPE": "float32", "OMP_WAIT_POLICY": "PASSIVE", "PEMA_TINY_DEVICE": "cpu"}
    bb = load_backbone(str(folder), device="cpu", dtype="float32")
    cat = Catalog(tmp_path / "data")
    mem = _memory(bb, cat)
    sets = [f"--set={m}.{k}={json.dumps(v)}" for m, kv in QUICK.items() for k, v in kv.items()]
    out = tmp_path / "board.json"
    cmd = [sys.executable, "-m", "eval", "rank", mem.id, "--backbone", str(folder), "--device", "cpu",
           "--data-dir", str(cat.root), "--workers", "2", "--tune", "8", "--max-new-tokens", "8", "--json", str(out),
           *sets]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    board = json.loads(out.read_text())
    rows = {r["method"]: r for r in board["methods"]}
    assert set(rows) == {"base", *available_methods()}
    assert board["workers"] == {"executor": "ray", "workers": 2, "address": None, "gpus": 0}
    for m in available_methods():
        expected = "here" if m in ("knn", "retrieval_icl") else "ray"
        assert rows[m]["trained_on"] == expected, (m, rows[m])
        assert isinstance(rows[m]["chrf"], float) and rows[m]["plugin_id"]
    assert "training at once on 2 worker(s)" in proc.stderr
    assert "Trained on 2 Ray worker(s) (a local cluster)" in proc.stdout
    assert all(Path(p["path"]).parent == cat.root / "plugins" for p in Catalog(cat.root).plugins())


def test_the_studio_estimates_the_training_phase_by_its_slowest_method_on_workers():
    from studio.rank_service import training_seconds

    per = {"knn": 2.0, "retrieval_icl": 1.0, "pema": 30.0, "lora": 20.0, "adapter": 60.0}
    assert training_seconds(per) == 113.0  # one process: one after another
    assert training_seconds(per, 8) == 3.0 + 60.0  # indexing here, then the slowest
    assert training_seconds(per, 2) == 3.0 + 60.0  # adapter | pema + lora
    assert training_seconds(per, 1) == 113.0
