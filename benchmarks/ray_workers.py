"""Per-worker build throughput on Ray, for the build-time estimate in docs/ray.md (entries/s of one build worker),
and a rank's training phase across Ray workers (``--rank``).

    python -m benchmarks ray --backbone tiny --samples 400 --workers 1 2
    python -m benchmarks ray --backbone gemma-3-270m --samples 200 --workers 0   # in-process only
    python -m benchmarks ray --rank --backbone tiny --samples 300 --workers 1 2

``--rank``: the methods a rank trains on workers (``studio.ray_executor.RankTrainer.runs``: all but kNN and
retrieval, which index in seconds on the head) at their shipped defaults, on one memory: first in this process one
after another (what ``python -m eval rank`` does without ``--workers``), then through ``RayExecutor.train_many`` on a
local Ray cluster of N CPUs (what ``--workers N`` does), each run on a fresh cluster. Reports the phase's wall
seconds, each method's own training seconds and the slowest of them: with as many workers as methods the phase
should take about the slowest method plus a worker's start (a process, its imports and a backbone load).

Builds the same memory from the gettext EN→DE corpus once in-process and once sharded over each number of Ray
build workers (a local ``ray.init``; one CPU each), and prints entries, wall seconds and entries/s: of the whole
capture on the head, and per worker (the capture's own time inside the worker, backbone load excluded). The
per-worker rate is what scales: a build of E entries on N such workers takes about E / (N × rate) plus the
workers' start (a backbone load each) and the head's tokenizing and writing. ``--workers 0``: the in-process
build only, on one thread — what one CPU build worker computes, without a second copy of the backbone (a Ray build
worker runs the same ``capture_entries`` with ``OMP_NUM_THREADS=1``).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from backbone.model import load_backbone
from backbone.tasks import task_prompt
from backbone.tiny import tiny_backbone
from ground.store import Catalog
from memories.build import build_memory
from memories.corpora import load_corpus
from memories.parse import Sample
from memories.store import Memory
from plugins.api import train_plugin
from plugins.registry import available_methods
from studio.ray_executor import ROOT, RankTrainer, RayExecutor


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", default="tiny")
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--rank", action="store_true", help="a rank's training phase in process and on N Ray workers")
    p.add_argument("--methods", default=None, help="--rank: comma-separated (default: every method a worker trains)")
    a = p.parse_args(argv)
    if a.rank:
        return rank_training(a)
    import ray  # optional: a benchmark of the Ray executor
    import torch  # heavy: the head's own thread count, like a worker's

    torch.set_num_threads(1)
    bb = tiny_backbone() if a.backbone == "tiny" else load_backbone(a.backbone)
    samples = [Sample(s["src"], s["tgt"], i + 1) for i, s in enumerate(load_corpus("gettext-de", a.samples))]
    prompt = task_prompt("translation", bb)
    spec = {"name": a.backbone, "device": "cpu", "data_dir": None, "fingerprint": bb.fingerprint}
    out = {"backbone": bb.name, "samples": len(samples), "cpus": os.cpu_count(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        mem = build_memory(bb, samples, Path(tmp) / "inproc", prompt=prompt, batch_size=a.batch_size,
                           heldout_frac=0.0)
        secs = time.time() - t0
        out["runs"].append({"executor": "inprocess", "entries": len(mem), "seconds": round(secs, 2),
                            "entries_per_second": round(len(mem) / secs, 1)})
        print(json.dumps(out["runs"][-1]), flush=True)
        if not any(a.workers):
            a.workers = []
        else:
            ray.init(num_cpus=max(a.workers), include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
        try:
            for n in a.workers:
                ex = RayExecutor(build_workers=n, keep_alive=600).start()
                # a first build warms the workers (process start + one backbone load each), a second is measured
                for warm in (True, False):
                    t0 = time.time()
                    m = build_memory(bb, samples, Path(tmp) / f"ray{n}{warm}", prompt=prompt,
                                     batch_size=a.batch_size, heldout_frac=0.0, capture=ex.capture(spec))
                    secs = time.time() - t0
                cap = ex.captures[-1]
                per = [w["entries_per_second"] for w in cap["per_worker"] if w["entries_per_second"]]
                out["runs"].append({"executor": f"ray x{n}", "entries": len(m), "seconds": round(secs, 2),
                                    "entries_per_second": round(len(m) / secs, 1), "capture_seconds": cap["seconds"],
                                    "per_worker_entries_per_second": per})
                print(json.dumps(out["runs"][-1]), flush=True)
                ex.release_pool()
        finally:
            if ray.is_initialized():
                ray.shutdown()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()


def _seconds(row: dict) -> float:
    return float((json.loads(row["metrics"]).get("train_info") or {}).get("seconds") or 0.0)


def rank_training(a) -> None:
    """``--rank``: the training phase of a rank in this process and on N local Ray workers (module docstring)."""
    import ray  # optional: a benchmark of the Ray executor
    import torch  # heavy: the head's threads

    bb = tiny_backbone() if a.backbone == "tiny" else load_backbone(a.backbone)
    methods = ([m.strip() for m in a.methods.split(",")] if a.methods else
               [m for m in available_methods() if RankTrainer.runs(m)])
    samples = [Sample(s["src"], s["tgt"], i + 1) for i, s in enumerate(load_corpus("gettext-de", a.samples))]
    out = {"backbone": bb.name, "samples": len(samples), "methods": methods, "cpus": os.cpu_count(),
           "torch_threads_here": torch.get_num_threads(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        cat = Catalog(Path(tmp) / "data")
        mem = build_memory(bb, samples, cat.root / "memories" / "m", prompt=task_prompt("translation", bb),
                           batch_size=a.batch_size)
        mem = Memory.load(mem.path, bb)
        out["entries"] = len(mem)
        for n in [0, *[w for w in a.workers if w]]:
            run: dict = {"executor": "inprocess" if n == 0 else f"ray x{n}"}
            if n == 0:
                t0 = time.time()
                rows = {m: train_plugin(bb, mem, m, {}, catalog=cat)[1] for m in methods}
                wall = time.time() - t0
            else:
                t0 = time.time()  # a fresh local cluster of n CPUs (no GPU: CPU workers are measured)
                ray.init(num_cpus=n, num_gpus=0, include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
                run["ray_start_seconds"] = round(time.time() - t0, 2)
                try:
                    spec = {"name": a.backbone, "device": "cpu", "data_dir": None, "fingerprint": bb.fingerprint}
                    ex = RayExecutor().start()
                    t0 = time.time()
                    rows = ex.train_many(spec, bb, mem, [{"method": m, "config": {}} for m in methods], catalog=cat,
                                         owner="local")
                    wall = time.time() - t0
                    run["worker_clock"] = ex.trainings[-1]  # seconds from the call: process up, backbone, trained
                finally:
                    ray.shutdown()
            per = {m: round(_seconds(r), 2) for m, r in rows.items()}
            run.update(phase_seconds=round(wall, 2), per_method_seconds=per, slowest_method_seconds=max(per.values()),
                       sum_method_seconds=round(sum(per.values()), 2))
            out["runs"].append(run)
            print(json.dumps(out["runs"][-1]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
