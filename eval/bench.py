"""Performance benchmarks (issue targets; results in BENCHMARKS.md). Ratios are measured within one run.

    python -m eval.bench build      # teacher-forced batched capture vs per-step generation (PEMA code's way)
    python -m eval.bench train      # peak extra memory + entries/s: PEMA vs last-layer LoRA (peft) and others
    python -m eval.bench decode     # per-token time: PEMA, exact kNN over 100k entries, 4-method batch vs base
    python -m eval.bench softmax    # PEMA's exact full-vocabulary training vs the fast candidate softmax
    python -m eval.bench head       # LM-head projection of 1-32 rows: F.linear vs W @ xᵀ (decode-step BLAS choice)
    python -m eval.bench all        # one run: the train children save their plug-ins, decode times them
    python -m eval.bench train pema,lora   # a subset of methods
    python -m eval.bench train pema,lora --backbone smollm2-135m-instruct   # another backbone (head share 21%)

Each training run happens in a fresh subprocess so its peak resident memory (ru_maxrss) can be measured above
the loaded backbone's. Uses ../shared/data/wmt22-en-de/train.jsonl.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from backbone import load_backbone
from backbone.tasks import task_prompt
from eval.datasets import wmt_pairs
from memories.build import build_memory
from memories.parse import Sample
from memories.store import Memory
from plugins.api import train_plugin
from plugins.base import load_plugin
from plugins.decode import Row, compare
from plugins.pema import mix_logprobs

# Idle OpenMP threads spin-wait by default and starve the other core on a busy 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

N_PAIRS = 200


def head_share(bb) -> float:
    """Share of the backbone's weights in the LM head (counted once when tied to the embeddings)."""
    head = bb.model.get_output_embeddings().weight
    total = sum(p.numel() for p in {id(p): p for p in bb.model.parameters()}.values())
    return round(head.numel() / total, 3)


def _mem(bb, n, tmp, mode="teacher", batch_size=16):
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


def _rss_kb() -> int:
    """Current resident set size (Linux /proc), in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not Linux: the lifetime peak, a poorer proxy


class _PeakSampler:
    """Samples the resident set size every 10 ms while training runs: the peak above the pre-training baseline
    is the training's own memory (activations, gradients, optimiser state, copies), whatever allocates it."""

    def __init__(self):
        self.peak_kb, self._stop = 0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, _rss_kb())
            self._stop.wait(0.01)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *a):
        self._stop.set()
        self._t.join()
        self.peak_kb = max(self.peak_kb, _rss_kb())


def _train_child(method: str, overrides: dict, mem_path: str, out_dir: str) -> dict:
    """Runs in a subprocess: load backbone, note RSS, train, note peak RSS."""
    bb = load_backbone(os.environ.get("PEMA_BENCH_BACKBONE"))
    mem = Memory.load(mem_path, bb)
    _ = [len(mem.samples), float(np.asarray(mem.keys).sum())]  # page the memory in before the baseline
    gc.collect()
    base_kb = _rss_kb()
    sampler = _PeakSampler()
    t0 = time.time()
    with sampler:
        p, row = train_plugin(bb, mem, method, overrides, out_dir=Path(out_dir) / method)
    secs = time.time() - t0
    info = p.train_info
    return {"method": method, "params": p.trainable_parameters(), "train_seconds": round(secs, 1),
            "extra_peak_mb": round((sampler.peak_kb - base_kb) / 1024, 1), "baseline_rss_mb": round(base_kb / 1024, 1),
            "train_info": {k: v for k, v in info.items() if isinstance(v, (int, float, str, dict))}}


TRAIN_RUNS = {
    # one epoch-equivalent of work each, so tokens/s compare like with like
    "pema": {"max_epochs_rct": 1, "max_epochs_joint": 2, "patience": 99},
    "lora": {"max_epochs": 1},
    "adapter": {"max_epochs": 1},
    "memory_tuning": {"max_epochs": 1},
    "memory_adapter": {"max_epochs": 1},
}


# `bench decode` alone needs plug-ins to time, not good ones: cap the slow trainings (the decode cost of a plug-in
# does not depend on how long it trained; the memory adapter's phrase memory is kept small).
DECODE_ONLY_RUNS = {m: {"max_minutes": 0.3} for m in ("lora", "adapter", "memory_tuning")}
DECODE_ONLY_RUNS["memory_adapter"] = {"max_minutes": 0.3, "max_translate": 24}


def bench_train(mem, plugin_dir: Path, methods=None) -> list[dict]:
    out = []
    for m in methods or TRAIN_RUNS:
        cmd = [sys.executable, "-m", "eval.bench", "_child", m, json.dumps(TRAIN_RUNS[m]), str(mem.path),
               str(plugin_dir)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            out.append({"method": m, "error": r.stderr.strip().splitlines()[-3:]})
            print(json.dumps(out[-1]), file=sys.stderr)
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["memory_entries"] = len(mem)
        out.append(res)
        print(json.dumps(res), file=sys.stderr)
    return out


def _time_decode(bb, rows, prompt, sources, max_new_tokens=24, reps=1, prefix_cache=True):
    """Seconds per generated token, prefill included (the warm-up fills the prompt-prefix KV cache)."""
    compare(bb, sources[0], rows, prompt, max_new_tokens=4, use_prefix_cache=prefix_cache)  # warm-up
    tot_t, tot_steps = 0.0, 0
    for _ in range(reps):
        for s in sources:
            t0 = time.time()
            c = compare(bb, s, rows, prompt, max_new_tokens=max_new_tokens, trace=False,
                        use_prefix_cache=prefix_cache)
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


def _datastore_100k(mem, path: Path):
    """A 100k-entry copy of ``mem`` for timing only: the real keys tiled with small noise (search cost depends on
    the number and size of the keys, not on where they came from)."""
    path.mkdir()
    for f in mem.path.iterdir():
        if f.is_file():
            (path / f.name).write_bytes(f.read_bytes())
    reps = int(np.ceil(100_000 / len(mem)))
    keys = np.tile(np.asarray(mem.keys, np.float32), (reps, 1))[:100_000]
    keys += np.random.default_rng(0).normal(0, 0.01 * mem.key_scale, keys.shape).astype(np.float32)
    np.save(path / "keys.npy", keys.astype(np.float16))
    np.save(path / "values.npy", np.tile(np.asarray(mem.values), reps)[:100_000])
    np.save(path / "entry_sample.npy", np.tile(np.asarray(mem.entry_sample), reps)[:100_000])
    meta = json.loads((path / "meta.json").read_text())
    meta["stats"]["entries"] = 100_000
    (path / "meta.json").write_text(json.dumps(meta))
    return Memory.load(path)


def bench_decode(bb, mem, plugin_dir: Path, tokens: int = 24) -> dict:
    """Per-token decode time of each plug-in alone, of exact kNN over 100k entries, and of a 4-method batch,
    all relative to the base model, with every decode forced to run exactly ``tokens`` steps."""
    sources = [en for en, _ in wmt_pairs("dev", 0, 3)]
    prompt = mem.prompt
    plugins = {d.name: load_plugin(d, bb) for d in sorted(Path(plugin_dir).iterdir()) if d.is_dir()}
    big = _datastore_100k(mem, Path(plugin_dir).parent / "big")
    knn, _ = train_plugin(bb, big, "knn", {"search": "exact"}, out_dir=Path(plugin_dir).parent / "knn100k")
    res: dict = {"tokens_per_decode": tokens, "sources": len(sources), "knn_search": knn.search_kind}
    with _FixedSteps(bb):
        t_base = _time_decode(bb, [Row("base")], prompt, sources, tokens)
        res["base_ms_per_token"] = round(1000 * t_base, 1)
        per = {}
        for name, p in [*plugins.items(), ("knn100k", knn)]:
            t = _time_decode(bb, [Row(name, p)], prompt, sources, tokens)
            per[name] = {"ms_per_token": round(1000 * t, 1), "over_base": round(t / t_base, 3)}
            print(name, per[name], file=sys.stderr)
        res["per_method"] = per
        four = [Row("base")] + [Row(n, plugins[n]) for n in ("pema", "adapter") if n in plugins] + [Row("knn", knn)]
        t_four = _time_decode(bb, four, prompt, sources, tokens)
        res["four_rows"] = [r.label for r in four]
        res["four_rows_ms_per_step"] = round(1000 * t_four, 1)
        res["four_methods_over_one"] = round(t_four / t_base, 3)
        # the same two decodes with every prompt prefilled in full (no prompt-prefix KV cache)
        t_base_full = _time_decode(bb, [Row("base")], prompt, sources, tokens, prefix_cache=False)
        t_four_full = _time_decode(bb, four, prompt, sources, tokens, prefix_cache=False)
        res["full_prefill"] = {"base_ms_per_token": round(1000 * t_base_full, 1),
                               "four_rows_ms_per_step": round(1000 * t_four_full, 1),
                               "four_methods_over_one": round(t_four_full / t_base_full, 3)}
    return res


def _heldout_scores(bb, plugin, mem, lam: float = 0.5, n: int = 2000) -> dict:
    """Mean log-probability of the memory's held-out reference tokens under P_PEMA (over the whole vocabulary:
    what the decode sees with ``decode_vocab="full"``), under the λ-mixture with P_LM (GU off), and under P_LM."""
    import torch

    keys = torch.from_numpy(np.asarray(mem.heldout_keys[:n], np.float32))
    y = torch.from_numpy(np.asarray(mem.heldout_values[:n], np.int64))[:, None]
    saved = plugin.config.decode_vocab
    plugin.config.decode_vocab = "full"
    out = {"pema": 0.0, "mixture": 0.0, "lm": 0.0, "tokens": len(y)}
    with torch.no_grad():
        for i in range(0, len(y), 256):
            fc, yy = keys[i:i + 256], y[i:i + 256]
            lm = torch.log_softmax(bb.logits_from_fc(fc).float(), -1)
            pp = plugin.pema_logprobs(fc).float()
            mx = mix_logprobs(lm, pp, torch.full((len(fc),), lam))
            for k, lp in (("pema", pp), ("mixture", mx), ("lm", lm)):
                out[k] += lp.gather(1, yy).sum().item()
    plugin.config.decode_vocab = saved
    return {k: (round(v / len(y), 4) if k != "tokens" else v) for k, v in out.items()}


def bench_head(bb, rows=(1, 2, 3, 4, 6, 7, 8, 12, 16, 32), reps: int = 5) -> dict:
    """ms per LM-head projection of a few rows: ``F.linear`` (x·Wᵀ) vs ``W @ xᵀ`` (see ``backbone.model._project``)."""
    import torch

    w = bb.lm_head.weight
    out = {}
    with torch.no_grad():
        for m in rows:
            x = torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device)
            res = {}
            for name, f in (("linear", lambda: torch.nn.functional.linear(x, w)), ("w_xt", lambda: (w @ x.T).T)):
                f(), f()
                t0 = time.perf_counter()
                for _ in range(reps):
                    f()
                res[name] = round(1000 * (time.perf_counter() - t0) / reps, 1)
            out[m] = res
            print(m, res, file=sys.stderr)
    return out


def bench_softmax(bb, mem, plugin_dir: Path) -> dict:
    """The same PEMA training (PCA start, 3 joint epochs, no early stop) with the exact full-vocabulary softmax and
    with the fast candidate softmax: joint seconds per epoch and held-out reference log-probabilities."""
    common = {"rct_init": "pca", "max_epochs_rct": 1, "max_epochs_joint": 3, "patience": 99, "batch_size": 64,
              "max_minutes": 0}
    out = {}
    for kind in ("candidates", "full"):
        t0 = time.time()
        p, _ = train_plugin(bb, mem, "pema", {**common, "softmax": kind}, out_dir=plugin_dir / f"pema-{kind}")
        joint = p.train_info["joint"]
        out[kind] = {"train_seconds": round(time.time() - t0, 1), "joint": joint,
                     "heldout_logprob": _heldout_scores(bb, p, mem)}
        print(kind, json.dumps(out[kind], default=str), file=sys.stderr)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--backbone" in argv:  # children inherit it through the environment
        i = argv.index("--backbone")
        os.environ["PEMA_BENCH_BACKBONE"] = argv[i + 1]
        del argv[i:i + 2]
    if argv and argv[0] == "_child":
        print(json.dumps(_train_child(argv[1], json.loads(argv[2]), argv[3], argv[4])))
        return 0
    what = argv[0] if argv else "all"
    if what not in ("build", "train", "decode", "softmax", "head", "all"):
        raise SystemExit(f"unknown benchmark {what!r}: build | train | decode | softmax | head | all")

    bb = load_backbone(os.environ.get("PEMA_BENCH_BACKBONE"))
    res: dict = {"backbone": bb.name, "torch_threads": __import__("torch").get_num_threads(),
                 "head_share": head_share(bb)}
    if what == "head":
        res["head"] = bench_head(bb)
    if what in ("build", "all"):
        res["build"] = bench_build(bb)
        print(json.dumps(res["build"]), file=sys.stderr)
    if what in ("train", "decode", "softmax", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            mem, secs = _mem(bb, N_PAIRS, tmp)
            res["memory"] = {"pairs": N_PAIRS, "entries": len(mem), "build_seconds": round(secs, 1)}
            plugin_dir = Path(tmp) / "plugins"
            methods = argv[1].split(",") if len(argv) > 1 else None
            if what == "softmax":
                res["softmax"] = bench_softmax(bb, mem, plugin_dir)
            elif what == "decode":  # decode alone: short trainings just to have plug-ins to time

                for m in methods or TRAIN_RUNS:
                    train_plugin(bb, mem, m, {**TRAIN_RUNS[m], **DECODE_ONLY_RUNS.get(m, {})}, out_dir=plugin_dir / m)
            else:
                res["train"] = bench_train(mem, plugin_dir, methods)
            if what in ("decode", "all"):
                res["decode"] = bench_decode(bb, mem, plugin_dir)
    Path("out").mkdir(exist_ok=True)
    Path(f"out/bench-{what}-{bb.name}.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
