"""``python -m benchmarks gpu``: the real model's speed without its weights — a model of Gemma 3 270M's exact shapes
(its ``config.json``) with random weights, built in the process, so that a GPU machine that cannot carry the embedded
weights still measures the studio's speed at the real scale. Speed does not depend on the weights' values; **quality
does: no quality number comes from this model.** One call measures, in a few minutes on a GPU:

* ``ready_s`` / ``first_compare_s``: building the model with the studio's start-up warm-ups, and the first
  comparison after it (no prefix cache) — what a user waits for after a start; ``second_compare_s``: a second
  one on another sentence;
* ``decode_step_ms``: the warm decode step of 1, 4 and 7 rows (the base row; base + PEMA + adapter + kNN; base + six
  methods), fixed-length decodes, ``(T(n) − T(1)) / (n − 1)``, and ``scalar_reads_per_step``: the host reads of a
  device value (``aten::_local_scalar_dense``: ``.item()``, ``int()``, ``float()``, ``bool()`` of a tensor) per step
  of the 7-row decode, each a wait for the GPU's queue (counted by ``torch.profiler``; on a GPU also
  ``cuda_syncs_per_step``, the ``cudaStreamSynchronize`` / ``cudaMemcpy*`` calls); ``over_one_row``: each
  step over the one-row step (issue #62's bar: 7 rows ≤ 1.5×); ``decode_path``: whether each comparison's steps
  ran from a CUDA graph ("graph"), the static cache without one ("static") or the eager path, and why;
* ``slider``: a PEMA slider move's re-decode against a full decode of the same comparison;
* ``memory_build``: teacher-forced memory build rate (entries/s) on ``--pairs`` WMT train pairs;
* ``training``: every method's shipped defaults on that memory, run to the epoch limit (early stopping off:
  patience 1000; no time cap): seconds, epochs, stopped_by.

On a CPU the same code runs with smaller sizes (``--small``: 24 pairs, 8 tokens, one epoch each, two decoder
layers) so that the test suite runs it (tests/test_benchmarks_gpu.py); ``--backbone tiny`` uses the tests' tiny
model instead of the Gemma shapes.

    python -m benchmarks gpu                       # on a GPU: the full run (config from the data directory)
    python -m benchmarks gpu --config-dir DIR      # DIR holds config.json + tokenizer files (gzipped: *.gz)
    python -m benchmarks gpu --config-dir gemma-3-1b --tokenizer-dir DIR   # Gemma 3 1B's shapes (benchmarks/configs)
    python -m benchmarks gpu --small --out r.json  # CPU-sized
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

T_IMPORT = time.time()

import torch  # noqa: E402

from backbone.graph_decode import RUNNERS, warm_up  # noqa: E402
from backbone.model import Backbone, cpu_description, resolve_precision, set_precision  # noqa: E402
from backbone.options import using_fast_paths  # noqa: E402
from backbone.tasks import task_prompt  # noqa: E402
from engine import Row, compare, start_compare, warm_comparison  # noqa: E402
from engine.batch import plan_batch  # noqa: E402
from engine.engine import BatchDecode  # noqa: E402
from eval.datasets import wmt_pairs  # noqa: E402
from ground.store import data_dir  # noqa: E402
from memories.build import build_memory  # noqa: E402
from memories.parse import Sample  # noqa: E402
from plugins.api import train_plugin  # noqa: E402
from plugins.registry import available_methods  # noqa: E402

SIX = ("pema", "knn", "memory_adapter", "memory_tuning", "adapter", "lora")
QUICK = {"max_minutes": 0.05, "max_epochs": 1}  # plug-ins for the decode timing: their values do not matter
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer.json.gz", "tokenizer.model.gz")
CONFIGS = Path(__file__).resolve().parent / "configs"  # shapes of larger Gemma 3 models (config.json only)


def default_config_dir() -> Path:
    return Path(data_dir()) / "backbones" / "gemma-3-270m"


def _unpacked(folder: Path) -> Path:
    """``folder`` with any ``*.gz`` file un-gzipped into a temporary copy (a GPU call carries them gzipped)."""
    if not any(folder.glob("*.gz")):
        return folder
    out = Path(tempfile.mkdtemp(prefix="pema-gpu-config-"))
    for f in folder.iterdir():
        if f.name.endswith(".gz"):
            with gzip.open(f, "rb") as src, open(out / f.name[:-3], "wb") as dst:
                shutil.copyfileobj(src, dst)
        elif f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).exists() for f in TOKENIZER_FILES)


def random_backbone(config_dir: str | Path, seed: int = 0, device: str | None = None, dtype: str | None = None,
                    layers: int | None = None, tokenizer_dir: str | Path | None = None) -> Backbone:
    """A backbone of the shapes in ``config_dir/config.json`` (and its tokenizer) with random weights (the
    architecture's own initialisation, seeded), in the precision the studio would load it in on ``device``.
    ``layers``: keep only the first N decoder layers (a CPU-sized run). A ``config_dir`` without a tokenizer (the
    repository's ``benchmarks/configs/gemma-3-1b``) takes ``tokenizer_dir``'s, by default the embedded Gemma 3
    270M's: the Gemma 3 models share one tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = _unpacked(Path(config_dir))
    tok_folder = folder if has_tokenizer(folder) else _unpacked(Path(tokenizer_dir or default_config_dir()))
    if not has_tokenizer(tok_folder):
        raise SystemExit(f"No tokenizer in {config_dir} nor in {tok_folder}: give --tokenizer-dir (the embedded "
                         f"Gemma 3 270M's folder, or its files gzipped).")
    cfg = AutoConfig.from_pretrained(folder)
    if layers:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types)[:layers]
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(dtype, dev)
    torch.manual_seed(seed)
    with torch.device(dev):  # initialised where it runs (on a GPU: seconds, not a CPU's minute)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if precision == "bfloat16"
                                                 else torch.float32)
    if dev.startswith("cuda") and precision == "float16":
        model = model.half()
    model = model.to(dev).eval()
    if not dev.startswith("cuda") and precision != "float32" or precision == "bfloat16":
        set_precision(model, precision)
    tok = AutoTokenizer.from_pretrained(tok_folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    name = f"{getattr(cfg, 'model_type', 'model')}-random-seed{seed}" + (f"-{layers}layers" if layers else "")
    bb = Backbone(model=model, tokenizer=tok, name=name)
    warm_up(bb)  # as load_backbone does: a GPU's first-call work and CUDA graphs before the first comparison
    warm_comparison(bb)  # as the studio does before it says ready
    return bb


class _FixedSteps:
    """Decodes run exactly ``max_new_tokens`` steps (no stop token ends one early)."""

    def __init__(self, bb):
        self.bb = bb

    def __enter__(self):
        self.saved, self.bb.stop_ids = self.bb.stop_ids, set()

    def __exit__(self, *a):
        self.bb.stop_ids = self.saved


def _sync(bb) -> None:
    if bb.device.type == "cuda":
        torch.cuda.synchronize()


def _decode_ms(bb, rows, prompt, source, tokens: int, reps: int) -> float:
    """Median milliseconds per decode step after the first: (T(tokens) − T(1)) / (tokens − 1)."""
    times = []
    for _ in range(reps):
        _sync(bb)
        t0 = time.perf_counter()
        compare(bb, source, rows, prompt, max_new_tokens=1, trace=False)
        _sync(bb)
        t1 = time.perf_counter()
        compare(bb, source, rows, prompt, max_new_tokens=tokens, trace=False)
        _sync(bb)
        t2 = time.perf_counter()
        times.append(max((t2 - t1) - (t1 - t0), 1e-6) / (tokens - 1))
    times.sort()
    return round(1000 * times[len(times) // 2], 2)


def decode_path(bb, rows, prompt, source, tokens: int) -> dict:
    """Which step a comparison of ``rows`` runs on (``BatchDecode.path``: "graph", "static" or "eager") and, for the
    eager path, why."""
    dec = BatchDecode(bb, plan_batch(bb, [source], rows, prompt), tokens, trace=False)
    dec.run()
    return {"path": dec.path, **({"reason": dec.path_reason} if dec.path == "eager" else {})}


def host_reads(bb, rows, prompt, source, tokens: int) -> dict:
    """Per decode step: host reads of device values (``aten::_local_scalar_dense``) and, on a GPU, the CUDA
    synchronisations and copies, from ``torch.profiler`` over a fixed-length decode with traces off (the first
    step's prefill excluded: a 1-token decode's counts are subtracted)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bb.device.type == "cuda" else [])

    def counts(n):
        with profile(activities=acts) as prof:
            compare(bb, source, rows, prompt, max_new_tokens=n, trace=False)
        out = {"scalar_reads": 0, "cuda_syncs": 0}
        for e in prof.key_averages():
            if e.key == "aten::_local_scalar_dense":
                out["scalar_reads"] += e.count
            elif e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync"):
                out["cuda_syncs"] += e.count
        return out

    one, many = counts(1), counts(tokens)
    res = {f"{k}_per_step": round((many[k] - one[k]) / (tokens - 1), 2) for k in one}
    if bb.device.type != "cuda":
        res.pop("cuda_syncs_per_step")
    return res


def _pairs(n: int, small: bool) -> list[tuple[str, str]]:
    pairs = wmt_pairs("train", 0, n * 8 if small else n)
    if small:  # short pairs: a CPU-sized run (and the tiny tokenizer's byte-level tokens) stays small
        pairs = [(s, t) for s, t in pairs if max(len(s), len(t)) < 90][:n]
    return pairs


def profile_tables(bb, rows, prompt, source, tokens: int, folder: Path, name: str) -> dict:
    """``torch.profiler`` over a warm fixed-length decode: the operator table (by self CPU time and, on a GPU, by
    device time) written to ``folder/<name>.txt``; returns the wall time per step and, on a GPU, the device's busy
    time per step (the kernels' summed time: what a step would cost without host overhead)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = bb.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(bb)
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        compare(bb, source, rows, prompt, max_new_tokens=tokens, trace=False)
        _sync(bb)
    wall = time.perf_counter() - t
    ka = prof.key_averages()
    text = ka.table(sort_by="self_cpu_time_total", row_limit=40)
    res = {"profiled_wall_ms_per_step": round(1000 * wall / tokens, 2)}
    if cuda:
        text += "\n\n" + ka.table(sort_by="self_device_time_total", row_limit=25)
        busy = sum(e.self_device_time_total for e in ka) / 1000.0  # µs → ms
        res["device_busy_ms_per_step"] = round(busy / tokens, 2)
        res["kernel_launches_per_step"] = round(sum(e.count for e in ka if e.key in (
            "cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")) / tokens, 1)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.txt").write_text(text, encoding="utf-8")
    return res


def run(bb: Backbone, pairs: int = 1000, tokens: int = 32, reps: int = 5, small: bool = False,
        methods: list[str] | None = None, work: Path | None = None, ready_s: float = 0.0,
        parts: tuple = ("build", "train", "decode"), profile_dir: Path | None = None, partial=None) -> dict:
    """``parts``: which measurements to run (the memory build, every method's training, the decode timings);
    without "build" the decode's plug-ins train on a small memory (64 pairs). ``profile_dir``: also write the
    profiler's operator tables of a warm 1-row and 7-row decode there."""
    methods = [m for m in (methods or SIX) if m in available_methods()]
    prompt = task_prompt("translation", bb)
    dev_src = [en for en, _ in wmt_pairs("dev", 0, 3)]
    out: dict = {"backbone": bb.name, "device": str(bb.device), "precision": bb.precision,
                 "hidden": bb.hidden_size, "layers": bb.num_layers, "vocab": bb.vocab_size,
                 "machine": torch.cuda.get_device_name(0) if bb.device.type == "cuda" else cpu_description(),
                 "torch": torch.__version__, "cuda": torch.version.cuda, "ready_s": round(ready_s, 2),
                 "note": "random weights: speed only, no quality number comes from this model"}
    if bb.device.type == "cuda":
        import subprocess

        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        out["driver"] = q.stdout.strip()
    work = work or Path(tempfile.mkdtemp(prefix="pema-gpu-"))
    t = time.perf_counter()
    compare(bb, dev_src[0], [Row("base")], prompt, max_new_tokens=tokens, trace=True)
    _sync(bb)
    out["first_compare_s"] = round(time.perf_counter() - t, 3)
    out["process_to_first_comparison_s"] = round(time.time() - T_IMPORT, 2)
    t = time.perf_counter()  # a second sentence: what of the first comparison was first-call work
    compare(bb, dev_src[1], [Row("base")], prompt, max_new_tokens=tokens, trace=True)
    _sync(bb)
    out["second_compare_s"] = round(time.perf_counter() - t, 3)

    # the memory build, then every method to its epoch limit
    train = _pairs(pairs if "build" in parts or "train" in parts else min(pairs, 64), small)
    t = time.perf_counter()
    mem = build_memory(bb, [Sample(s, tg, i) for i, (s, tg) in enumerate(train)], work / "mem", prompt=prompt,
                       heldout_frac=0.1)
    _sync(bb)
    dt = time.perf_counter() - t
    out["memory_build"] = {"pairs": len(train), "entries": len(mem), "seconds": round(dt, 2),
                           "entries_per_s": round(len(mem) / max(dt, 1e-9), 1)}
    out["training"] = {}
    for m in (methods if "train" in parts else ()):
        over = {} if m == "knn" else ({"max_minutes": 0.0, "patience": 1000}
                                     if m != "pema" else {"max_minutes": 0.0})
        if small and m != "knn":
            over.update({"max_epochs_rct": 1, "max_epochs_joint": 1} if m == "pema" else {"max_epochs": 1})
            if m == "memory_adapter":
                over["max_translate"] = 8
        t = time.perf_counter()
        p, row = train_plugin(bb, mem, m, over, out_dir=work / m)
        _sync(bb)
        met = json.loads(row["metrics"])
        phase = met.get("joint") if isinstance(met.get("joint"), dict) else met  # PEMA: its second phase ends it
        out["training"][m] = {"seconds": round(time.perf_counter() - t, 2), "stopped_by": phase.get("stopped_by"),
                              "epochs": phase.get("epochs"), "settings": over}
        print(f"trained {m}: {out['training'][m]}", file=sys.stderr)
        if partial is not None:
            partial(out)

    if "decode" not in parts:
        return out
    # the decode step: plug-ins trained briefly (a step's cost does not depend on how long one trained)
    plugins = {}
    for m in methods:
        over = {"search": "exact"} if m == "knn" else dict(QUICK, **({"max_translate": 8} if m == "memory_adapter"
                                                                     else {}))
        if m == "pema":
            over = {"max_minutes": 0.05, "max_epochs_rct": 1, "max_epochs_joint": 1}
        plugins[m], _ = train_plugin(bb, mem, m, over, out_dir=work / f"quick-{m}")
    configs = {"1 row": [Row("base")],
               "3 output-level rows": [Row("base")] + [Row(n, plugins[n]) for n in ("pema", "knn") if n in plugins],
               "4 rows": [Row("base")] + [Row(n, plugins[n]) for n in ("pema", "adapter", "knn") if n in plugins],
               "7 rows": [Row("base")] + [Row(n, plugins[n]) for n in methods]}
    with _FixedSteps(bb):
        for c in configs.values():  # warm: kernels, the prefix cache, derived products
            compare(bb, dev_src[0], c, prompt, max_new_tokens=2, trace=False)
        out["decode_step_ms"] = {k: _decode_ms(bb, c, prompt, dev_src[1], tokens, reps) for k, c in configs.items()}
        base = max(out["decode_step_ms"]["1 row"], 1e-3)  # a tiny model's step can round to 0
        out["over_one_row"] = {k: round(v / base, 3) for k, v in out["decode_step_ms"].items()}
        out["decode_path"] = {k: decode_path(bb, c, prompt, dev_src[1], tokens) for k, c in configs.items()}
        if bb.device.type == "cuda":  # the same steps on the eager path, in the same process: the graphs' gain
            with using_fast_paths(graph_decode="off"):
                for c in configs.values():
                    compare(bb, dev_src[0], c, prompt, max_new_tokens=2, trace=False)
                out["eager_decode_step_ms"] = {k: _decode_ms(bb, c, prompt, dev_src[1], tokens, reps)
                                               for k, c in configs.items()}
                eager = {k: compare(bb, dev_src[1], configs[k], prompt, max_new_tokens=tokens, trace=False)
                         for k in ("3 output-level rows", "7 rows")}
            graphed = {k: compare(bb, dev_src[1], configs[k], prompt, max_new_tokens=tokens, trace=False)
                       for k in eager}
            runners: dict = {}  # rows/positions (+ "hooked": a runner with in-network hooks) → runners made
            for k, n in RUNNERS.counts().items():
                name = "/".join(map(str, k[2:4])) + ("+hooked" if len(k) > 4 else "")
                runners[name] = runners.get(name, 0) + n
            out["graph_check"] = {"same_tokens": {k: [a.tokens == b.tokens for a, b in zip(eager[k].rows,
                                                                                              graphed[k].rows)]
                                                  for k in eager},
                                  "runners": runners,
                                  "disabled": dict((str(k[:2]) + ("+hooked" if len(k) > 2 else ""), v)
                                                   for k, v in RUNNERS.disabled.items())}
        out["host_reads_7_rows"] = host_reads(bb, configs["7 rows"], prompt, dev_src[1], min(tokens, 8))
        if profile_dir is not None:
            out["profile"] = {k: profile_tables(bb, configs[k], prompt, dev_src[1], tokens, Path(profile_dir),
                                                k.replace(" ", "_")) for k in ("1 row", "7 rows")}
    # a slider move (PEMA's λ_max) against a full decode of the same comparison
    if "pema" in plugins:
        rows = lambda lam: [Row("base"), Row("PEMA", plugins["pema"], {"lambda_max": lam})]  # noqa: E731
        t = time.perf_counter()
        compare(bb, dev_src[2], rows(0.5), prompt, max_new_tokens=tokens)
        _sync(bb)
        full = time.perf_counter() - t
        first = start_compare(bb, dev_src[2], rows(0.5), prompt, max_new_tokens=tokens)
        while first.step():
            pass
        t = time.perf_counter()
        move = start_compare(bb, dev_src[2], rows(0.3), prompt, max_new_tokens=tokens, live=first.live())
        while move.step():
            pass
        _sync(bb)
        dt = time.perf_counter() - t
        out["slider"] = {"full_decode_s": round(full, 3), "move_s": round(dt, 4),
                         "move_over_full": round(dt / max(full, 1e-9), 4)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", help="folder with config.json and the tokenizer (default: the embedded Gemma 3 "
                                         "270M's in the data directory); *.gz files are un-gzipped; a name in "
                                         "benchmarks/configs (gemma-3-1b, gemma-3-4b) for that model's shapes")
    ap.add_argument("--tokenizer-dir", help="the tokenizer when --config-dir has none (default: the embedded Gemma "
                                            "3 270M's, which the Gemma 3 models share)")
    ap.add_argument("--backbone", default="random", choices=["random", "tiny"],
                    help="random: the config's shapes, random weights; tiny: the tests' tiny model")
    ap.add_argument("--device", help="cuda / cpu (default: cuda when present)")
    ap.add_argument("--dtype", help="precision (default: the studio's for the device)")
    ap.add_argument("--pairs", type=int, default=1000, help="WMT train pairs in the memory")
    ap.add_argument("--tokens", type=int, default=32, help="decode length for the step timings")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--methods", help="comma-separated (default: every method)")
    ap.add_argument("--small", action="store_true", help="CPU-sized: 24 pairs, 8 tokens, 2 reps, one epoch each, "
                                                          "two decoder layers")
    ap.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    ap.add_argument("--parts", default="build,train,decode",
                    help="comma-separated: build (the memory on --pairs), train (every method to its epoch "
                         "limit), decode (first comparison, steps, host reads, slider)")
    ap.add_argument("--profile-dir", help="also write torch.profiler operator tables of warm decodes here")
    ap.add_argument("--out", help="also write the JSON result here")
    args = ap.parse_args(argv)
    if args.small:
        args.pairs, args.tokens, args.reps = min(args.pairs, 24), min(args.tokens, 8), min(args.reps, 2)
        args.layers = args.layers or 2
    t = time.time()
    if args.backbone == "tiny":
        from backbone.tiny import tiny_backbone  # heavy: tokenizer training, only for --backbone tiny

        bb = tiny_backbone(device=args.device)
    else:
        cfg = args.config_dir or default_config_dir()
        if args.config_dir and not Path(cfg).exists() and (CONFIGS / cfg / "config.json").exists():
            cfg = CONFIGS / cfg
        bb = random_backbone(cfg, device=args.device, dtype=args.dtype, layers=args.layers,
                             tokenizer_dir=args.tokenizer_dir)
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else None
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    bad = set(parts) - {"build", "train", "decode"}
    if bad:
        ap.error(f"unknown part(s): {', '.join(sorted(bad))}")
    def partial(res):
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1), encoding="utf-8")

    res = run(bb, args.pairs, args.tokens, args.reps, args.small, methods, ready_s=time.time() - t, parts=parts,
              profile_dir=Path(args.profile_dir) if args.profile_dir else None, partial=partial)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
