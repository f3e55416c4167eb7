"""Performance benchmarks (issue targets; results in BENCHMARKS.md). Ratios are measured within one run.

    python -m eval.bench build      # teacher-forced batched capture vs per-step generation (PEMA code's way)
    python -m eval.bench train      # peak extra memory + entries/s: PEMA vs last-layer LoRA (peft) and others
    python -m eval.bench decode     # per-token time: PEMA, exact kNN over 100k entries, 4-method batch vs base
    python -m eval.bench all

Each training run happens in a fresh subprocess so its peak resident memory (ru_maxrss) can be measured above
the loaded backbone's. Uses ../shared/data/wmt22-en-de/train.jsonl.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_PAIRS = 200


def _mem(bb, n, tmp, mode="teacher", batch_size=16):
    from eval.datasets import wmt_pairs
    from eval.tasks import task_prompt
    from memories.build import build_memory
    from memories.parse import Sample

    pairs = wmt_pairs("train", 0, n)
    t0 = time.time()
    m = build_memory(bb, [Sample(s, t, i) for i, (s, t) in enumerate(pairs)], Path(tmp) / f"m-{mode}-{n}",
                     prompt=task_prompt("translation", bb), mode=mode, batch_size=batch_size, heldout_frac=0.1)
    return m, time.time() - t0


def bench_build(bb) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        n = 20
        m1, t1 = _mem(bb, n, tmp, "teacher")
        m2, t2 = _mem(bb, n, tmp, "offsite")
        tokens = len(m1) + len(m1.heldout_values)
        return {"pairs": n, "entries": tokens, "teacher_tokens_per_s": round(tokens / t1, 1),
                "per_step_tokens_per_s": round(tokens / t2, 1), "speedup": round(t2 / t1, 1)}


def _train_child(method: str, overrides: dict, mem_path: str) -> dict:
    """Runs in a subprocess: load backbone, note RSS, train, note peak RSS."""
    from backbone import load_backbone
    from memories.store import Memory
    from plugins.api import train_plugin

    bb = load_backbone()
    mem = Memory.load(mem_path, bb)
    _ = [len(mem.samples), float(mem.keys[:1].sum())]
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.time()
    with tempfile.TemporaryDirectory() as out:
        p, row = train_plugin(bb, mem, method, overrides, out_dir=Path(out) / "p")
    secs = time.time() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    info = p.train_info
    return {"method": method, "params": p.trainable_parameters(), "train_seconds": round(secs, 1),
            "extra_peak_mb": round((peak_kb - base_kb) / 1024, 1), "backbone_rss_mb": round(base_kb / 1024, 1),
            "train_info": {k: v for k, v in info.items() if k in ("reconstruction", "joint", "epochs", "steps",
                                                                 "seconds", "entries_per_second", "stopped_by",
                                                                 "tokens_per_second", "phase")}}


TRAIN_RUNS = {
    # one epoch-equivalent of work each, so tokens/s compare like with like
    "pema": {"max_epochs_rct": 1, "max_epochs_joint": 2, "patience": 99},
    "lora": {"max_epochs": 1},
    "adapter": {"max_epochs": 1},
    "memory_tuning": {"max_epochs": 1},
    "memory_adapter": {"max_epochs": 1},
}


def bench_train(bb, methods=None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mem, _ = _mem(bb, N_PAIRS, tmp)
        out = []
        for m in methods or TRAIN_RUNS:
            cmd = [sys.executable, "-m", "eval.bench", "_child", m, json.dumps(TRAIN_RUNS[m]), str(mem.path)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                out.append({"method": m, "error": r.stderr.strip().splitlines()[-1:]})
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            res["memory_entries"] = len(mem)
            out.append(res)
            print(json.dumps(res), file=sys.stderr)
        return out


def _time_decode(bb, rows, prompt, sources, max_new_tokens=24, reps=1):
    from plugins.decode import compare

    compare(bb, sources[0], rows, prompt, max_new_tokens=4)  # warm-up
    tot_t, tot_steps = 0.0, 0
    for _ in range(reps):
        for s in sources:
            t0 = time.time()
            c = compare(bb, s, rows, prompt, max_new_tokens=max_new_tokens, trace=False)
            tot_t += time.time() - t0
            tot_steps += c.steps
    return tot_t / tot_steps


class _FixedSteps:
    """Forces decodes to run exactly max_new_tokens steps so per-token times compare like with like."""

    def __init__(self, bb):
        self.bb, self.saved = bb, None

    def __enter__(self):
        self.saved = self.bb.stop_ids
        self.bb.stop_ids = set()
        return self

    def __exit__(self, *a):
        self.bb.stop_ids = self.saved


def bench_decode(bb) -> dict:
    import numpy as np

    from eval.datasets import wmt_pairs
    from memories.store import Memory
    from plugins.api import train_plugin
    from plugins.decode import Row

    sources = [en for en, _ in wmt_pairs("dev", 0, 3)]
    with tempfile.TemporaryDirectory() as tmp:
        mem, _ = _mem(bb, N_PAIRS, tmp)
        prompt = mem.prompt
        pema, _ = train_plugin(bb, mem, "pema", {"max_epochs_rct": 1, "max_epochs_joint": 1},
                               out_dir=Path(tmp) / "pema")
        # A 100k-entry datastore for timing only: the real keys tiled with small noise (search cost depends on
        # the number and size of keys, not on where they came from).
        big = Path(tmp) / "big"
        big.mkdir()
        for f in mem.path.iterdir():
            if f.is_file():
                (big / f.name).write_bytes(f.read_bytes())
        reps = int(np.ceil(100_000 / len(mem)))
        keys = np.tile(np.asarray(mem.keys, np.float32), (reps, 1))[:100_000]
        keys += np.random.default_rng(0).normal(0, 0.01 * mem.key_scale, keys.shape).astype(np.float32)
        np.save(big / "keys.npy", keys.astype(np.float16))
        np.save(big / "values.npy", np.tile(np.asarray(mem.values), reps)[:100_000])
        np.save(big / "entry_sample.npy", np.tile(np.asarray(mem.entry_sample), reps)[:100_000])
        meta = json.loads((big / "meta.json").read_text())
        meta["stats"]["entries"] = 100_000
        (big / "meta.json").write_text(json.dumps(meta))
        knn, _ = train_plugin(bb, Memory.load(big, bb), "knn", {"search": "exact"}, out_dir=Path(tmp) / "knn")
        extra = {}
        try:
            ad, _ = train_plugin(bb, mem, "adapter", {"max_epochs": 1}, out_dir=Path(tmp) / "ad")
            extra["adapter"] = ad
        except Exception as e:  # noqa: BLE001
            print("adapter unavailable:", e, file=sys.stderr)
        with _FixedSteps(bb):
            t_base = _time_decode(bb, [Row("base")], prompt, sources)
            t_pema = _time_decode(bb, [Row("pema", pema)], prompt, sources)
            t_knn = _time_decode(bb, [Row("knn", knn)], prompt, sources)
            four = [Row("base"), Row("pema", pema), Row("knn", knn)] + \
                   ([Row("adapter", extra["adapter"])] if "adapter" in extra else [Row("pema-nogu", pema, {"gu": False})])
            t_four = _time_decode(bb, four, prompt, sources)
        return {"base_ms_per_token": round(1000 * t_base, 1), "pema_ms_per_token": round(1000 * t_pema, 1),
                "knn100k_ms_per_token": round(1000 * t_knn, 1), "four_rows_ms_per_step": round(1000 * t_four, 1),
                "pema_over_base": round(t_pema / t_base, 3), "knn100k_over_base": round(t_knn / t_base, 3),
                "four_methods_over_one": round(t_four / t_base, 3), "four_rows": [r.label for r in four],
                "knn_search": knn.search_kind}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        print(json.dumps(_train_child(argv[1], json.loads(argv[2]), argv[3])))
        return 0
    what = argv[0] if argv else "all"
    from backbone import load_backbone

    bb = load_backbone()
    res = {}
    if what in ("build", "all"):
        res["build"] = bench_build(bb)
        print(json.dumps(res["build"]), file=sys.stderr)
    if what in ("train", "all"):
        res["train"] = bench_train(bb, argv[1].split(",") if len(argv) > 1 and what == "train" else None)
    if what in ("decode", "all"):
        res["decode"] = bench_decode(bb)
    Path("out").mkdir(exist_ok=True)
    Path(f"out/bench-{what}.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
