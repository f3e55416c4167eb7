"""How long training will take, said before it starts: measured throughputs × the memory's size × the epochs.

``backbone/training_throughput.json`` holds, per backbone and method, what a short run of each method measured on
this kind of machine (``python -m plugins.estimate measure``): training units per second (memory *entries* for
PEMA and kNN, *samples* — sequences — for the in-network methods), the fixed costs before the loop (candidate
vocabulary, calibration, each batch's preparation per sample — the frozen prompt prefix and layers below the
plug-in, done the first time a batch is used —, the memory adapter's phrase memory) and, where a run to
convergence was measured, the epochs early stopping took. Records are kept per kind of machine (``machine_kind``:
a GPU, a CPU with native bfloat16, an AVX2 CPU) under ``"<backbone>@<kind>"``; a backbone's plain entry is the
fallback for a kind without records of its own. ``estimate`` turns that into one line for the training
form and the CLI, e.g. "≈ 6 min to converge (≈ 12 epochs); your budget of 5 min stops at ≈ 0.8 epochs —
under-trained".

The model, per training loop: one epoch = (training units + evaluations × early-stopping units × ``EVAL_COST``)
/ units per second, where an evaluation (forward only) is counted as ``EVAL_COST`` of a training unit (forward and
backward). Where convergence was not measured the estimate is for every epoch the settings allow (``max_epochs``)
and says so: early stopping may end it sooner.

    python -m plugins.estimate measure --backbone tiny --memory <memory folder>      # writes the JSON
    python -m plugins.estimate show <memory folder> --method adapter --set max_minutes=5
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from backbone.cli import load_backbone_from_args
from backbone.kernels import fp16_weight_available, native_bf16_cpu
from backbone.threads import wait_policy
from backbone.tiny import tiny_backbone
from ground.cli import add_common, run_main
from ground.errors import UserError
from ground.store import Catalog, write_json_atomic
from plugins.api import make_config, open_memory, open_plugin, plugin_folder, train_plugin
from plugins.registry import available_methods, get_method, method_card
from plugins.settings import parse_sets
from plugins.timing import EVAL_COST, budget_seconds, epochs_text, minutes, sig

__all__ = ["EVAL_COST", "PASSIVE_SLOWDOWN", "THROUGHPUT_PATH", "estimate", "for_wait_policy", "machine_kind",
           "measure", "record_for", "save_measurements", "throughputs"]

THROUGHPUT_PATH = Path(__file__).resolve().parents[1] / "backbone" / "training_throughput.json"
# a residual adapter's whole default run under PASSIVE over a short spin on two AVX2 cores, as measured (BENCHMARKS.md,
# "Training defaults, decided by measurement", row "OpenMP's wait policy in training": ``python -m benchmarks
# trainstep <memory> --policies``)
PASSIVE_SLOWDOWN = 1.15


def throughputs(path: Path | None = None) -> dict:
    """The measured throughputs: ``{backbone name: {method: record}}`` (empty when the file is missing)."""
    p = path or THROUGHPUT_PATH
    if not p.is_file():
        return {}
    data = json.loads(p.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}


def machine_kind() -> str:
    """The kind of machine this process trains on, as the throughput records are keyed: ``cuda`` when a GPU is
    present (the studio trains there), else the CPU's: ``cpu-bf16`` (native bfloat16: the default precision
    multiplies in bfloat16), ``cpu-avx2`` (AVX2 with FBGEMM's float16 kernel: training multiplies in float32, a
    slower step), or ``cpu``."""
    if torch.cuda.is_available():
        return "cuda"
    return "cpu-bf16" if native_bf16_cpu() else "cpu-avx2" if fp16_weight_available() else "cpu"


def record_for(table: dict, backbone_name: str, method: str, kind: str | None = None) -> dict | None:
    """The throughput record of ``method`` on ``backbone_name`` for this kind of machine (``kind``, default
    ``machine_kind()``) — with the plain record's convergence (``converge_*``) where it has none of its own —, else
    the backbone's plain record, else None."""
    own = table.get(f"{backbone_name}@{kind or machine_kind()}", {}).get(method)
    plain = table.get(backbone_name, {}).get(method)
    if own and plain:  # how many epochs a method takes to converge is the data's, not the machine's
        return {**{k: v for k, v in plain.items() if k.startswith("converge")}, **own}
    return own or plain


def estimate(method: str, config: dict | None, backbone_name: str, samples: int, entries: int,
             table: dict | None = None, kind: str | None = None, policy: str | None = None) -> dict:
    """How long training ``method`` with ``config`` (its overrides; validated) on a memory of ``samples``
    training samples / ``entries`` training entries takes on ``backbone_name``, from the measured throughputs.

    ``kind``: the machine kind whose records to prefer (default: this one's, ``machine_kind``); ``policy``: the
    OpenMP wait policy the training runs under (default: this process's, ``backbone.threads.wait_policy``).
    ``{"measured": False, "text"}`` when this backbone/method was not measured; else ``setup_s``, ``loops`` (one
    per training loop: epoch seconds, epochs, seconds to converge, epochs within the budget), ``converge_s``,
    ``under_trained`` (the budget stops a loop before it converges) and ``text`` (one line for the form)."""
    cls = get_method(method)
    cfg = make_config(method, config or {})
    rec = record_for(throughputs() if table is None else table, backbone_name, method, kind)
    if rec:
        rec = for_wait_policy(rec, policy or wait_policy())
    if not rec:
        return {"measured": False, "under_trained": False,
                "text": f"No time estimate: {cls.title} was not measured on {backbone_name} "
                        f"(python -m plugins.estimate measure)."}
    plan = method_card(method).estimate.training_time(cls, cfg, rec, samples, entries)
    setup_s, loops, budget_text = plan["setup_s"], plan["loops"], plan.get("budget_text", "")
    if not loops:  # nothing to train (kNN builds an index): the method's own line
        return {"measured": True, "setup_s": round(setup_s, 1), "loops": [], "converge_s": round(setup_s, 1),
                "under_trained": False, "text": plan["text"]}
    budget_s = budget_seconds(cfg)
    converge_s = setup_s + sum(lp["converge_s"] for lp in loops)
    total_epochs = sum(lp["epochs"] for lp in loops)
    measured = all(lp["converge_measured"] for lp in loops)
    every = "its 1 epoch" if total_epochs == 1 else f"all {epochs_text(total_epochs)} epochs"
    what = (f"≈ {minutes(converge_s)} to converge (≈ {epochs_text(total_epochs)} epochs)" if measured else
            f"≈ {minutes(converge_s)} for {every} (max_epochs; early stopping may end it sooner)")
    if len(loops) > 1:  # the parts add up to the whole: what comes before the first step first (PEMA's vocabulary)
        before = [f"≈ {minutes(setup_s)} before the first step"] if setup_s >= 1 else []
        what += " — " + ", ".join(before + [f"{lp['phase']} {epochs_text(lp['epochs'])} epochs ≈ "
                                            f"{minutes(lp['converge_s'])}" for lp in loops])
    elif setup_s >= 60:  # LoRA's precomputation, the memory adapter's phrase memory: before the first step
        what += f", of which ≈ {minutes(setup_s)} before the first step"
    cut = [lp for lp in loops if lp["budget_stops"]]
    if cut:
        lp = cut[0]
        where = f" the {lp['phase']} phase" if len(loops) > 1 else ""
        text = f"{what}; {budget_text} stops{where} at ≈ {epochs_text(lp['epochs_in_budget'])} epochs — under-trained"
    elif budget_s:
        text = f"{what}; fits {budget_text}"
    else:
        text = f"{what}; no time budget"
    return {"measured": True, "backbone": backbone_name, "setup_s": round(setup_s, 1), "loops": loops,
            "converge_s": round(converge_s, 1), "under_trained": bool(cut), "text": text + "."}


# --- measuring ---------------------------------------------------------------------------------------------------
def throughput_record(method: str, plugin, history: list[dict], wall_s: float, memory,
                      metrics: dict | None = None) -> dict:
    """A measured record (see the module docstring) from a finished short run of ``method``; ``metrics``: the
    fit's own (its ``seconds`` are the training loop's — ``train_plugin`` overwrites ``train_info["seconds"]``
    with the whole run's)."""
    info = {**plugin.train_info, **{k: v for k, v in (metrics or {}).items() if k != "train_info"}}
    return method_card(method).estimate.throughput_record(plugin, info, history, wall_s, memory)


def quiet_record(rec: dict, speedup: float) -> dict:
    """A record as on a quiet machine: rates × ``speedup`` and fixed seconds ÷ it, where ``speedup`` = wall seconds
    / CPU seconds of the measuring run. On a shared machine a run gets a fraction of the cores; the CPU time it used
    is what it costs when it has the machine to itself (PEMA's joint phase on Gemma, measured on a heavily loaded
    machine: its CPU-time rate came close to what a quiet run, BENCHMARKS.md "Plug-in training", predicts, its wall
    rate far below — threads add little). Never slower than measured (speedup ≥ 1)."""
    k = max(1.0, speedup)
    out = {}
    for key, v in rec.items():
        if isinstance(v, (int, float)) and key.endswith("_per_s"):
            out[key] = sig(v * k)
        elif isinstance(v, (int, float)) and key.endswith("_s"):
            out[key] = sig(v / k)
        else:
            out[key] = v
    out["cpu_time_speedup"] = round(k, 2)
    return out


def for_wait_policy(rec: dict, policy: str) -> dict:
    """A record made under one OpenMP wait policy (its ``wait_policy``: the finished run's) as it would run under
    ``policy``: a training step of an in-network method pays a thread wake-up at each of its thousands of parallel
    regions under PASSIVE, so it is ``PASSIVE_SLOWDOWN`` times slower there than with a short spin (a record without
    a policy is left as it is)."""
    made = rec.get("wait_policy")
    if made is None or made == policy:
        return rec
    k = PASSIVE_SLOWDOWN if made == "spin" else 1.0 / PASSIVE_SLOWDOWN
    out = {key: (sig(v / k) if key.endswith("_per_s") else sig(v * k) if key.endswith("_s") else v)
           if isinstance(v, (int, float)) and not isinstance(v, bool) else v for key, v in rec.items()}
    return {**out, "wait_policy": policy}


def measure(backbone, memory, methods: list[str], progress=print) -> dict:
    """Time a short run (its card's ``measure_settings``) of each method on ``memory``: ``{method: record}``.
    Plug-ins are written to a temporary folder and removed; the memory is only read."""
    out = {}
    tmp = Path(tempfile.mkdtemp(prefix="pema-estimate-"))
    try:
        for m in methods:
            progress(f"measuring {m} on {len(memory.split_samples('train'))} samples / {len(memory):,} entries")
            t0, c0 = time.time(), time.process_time()
            short = method_card(m).estimate.measure_settings
            plugin, row = train_plugin(backbone, memory, m, short, out_dir=tmp / m)
            wall, cpu = time.time() - t0, time.process_time() - c0
            rec = throughput_record(m, plugin, row["history"], wall, memory, json.loads(row["metrics"]))
            out[m] = {**quiet_record(rec, wall / max(cpu, 1e-9)), "wait_policy": wait_policy(),
                      "measured_on": {"samples": len(memory.split_samples("train")), "entries": len(memory),
                                      "settings": short, "wall_s": round(wall, 1),
                                      "cpu_s": round(cpu, 1), "as_measured": rec,
                                      "date": time.strftime("%Y-%m-%d")}}
            progress(f"  {m}: {json.dumps(out[m])}")
            shutil.rmtree(tmp / m, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def record_from_run(plugin, folder: Path, wait: str | None = None) -> dict:
    """The record of a finished real run: a saved plug-in's ``train_info`` and ``history.json``. Its ``seconds`` are
    the whole run's, so what happened before the first step (the candidate vocabulary) is in the rate, not in
    ``setup_s`` — a record of the run as the user waits for it."""
    info = dict(plugin.train_info)
    hist_path = Path(folder) / "history.json"
    history = json.loads(hist_path.read_text(encoding="utf-8")) if hist_path.is_file() else []
    rec = method_card(plugin.method).estimate.throughput_record(plugin, info, history, float(info["seconds"]), None)
    return {**rec, "cpu_time_speedup": 1.0, "wait_policy": wait or info.get("openmp_wait", "passive"),
            "measured_on": {"run": "a finished training run (python -m plugins.estimate record)",
                            "samples": info.get("train_samples"), "epochs": info.get("epochs"),
                            "wall_s": info.get("seconds"), "stopped_by": info.get("stopped_by"),
                            "date": time.strftime("%Y-%m-%d")}}


def save_measurements(backbone_name: str, records: dict, path: Path | None = None) -> Path:
    """Merge ``records`` into the JSON (atomically), keeping what a record already says about convergence."""
    p = path or THROUGHPUT_PATH
    data = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
    per = data.setdefault(backbone_name, {})
    for m, rec in records.items():
        keep = {k: v for k, v in (per.get(m) or {}).items() if k.startswith("converge")}
        per[m] = {**rec, **keep}
    write_json_atomic(p, data)
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m plugins.estimate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    me = sub.add_parser("measure", help="time a short run of each method and write backbone/training_throughput.json")
    me.add_argument("--memory", required=True, help="memory folder (only read)")
    me.add_argument("--methods", help="comma-separated (default: every method)")
    me.add_argument("--no-write", action="store_true", help="print the records only")
    add_common(me)
    rc = sub.add_parser("record", help="write the records of finished runs (saved plug-ins trained on a quiet "
                                       "machine of this kind) to backbone/training_throughput.json")
    rc.add_argument("plugins", nargs="+", help="plug-in ids or folders")
    rc.add_argument("--wait-policy", choices=("passive", "spin"),
                    help="the OpenMP wait policy the runs trained under, for runs saved before plug-ins recorded it "
                         "(default: the run's own record, else passive)")
    rc.add_argument("--no-write", action="store_true", help="print the records only")
    add_common(rc)
    sh = sub.add_parser("show", help="the time estimate of training a method on a memory")
    sh.add_argument("memory", help="memory folder")
    sh.add_argument("--method", required=True)
    sh.add_argument("--set", action="append", metavar="KEY=VALUE")
    sh.add_argument("--wait-policy", choices=("passive", "spin"),
                    help="estimate for a training under this OpenMP wait policy: spin = `plugins train`, passive = "
                         "the studio (default: this process's, passive unless set)")
    add_common(sh, backbone=False)
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        methods = [m.strip() for m in (args.methods or ",".join(available_methods())).split(",") if m.strip()]
        unknown = sorted(set(methods) - set(available_methods()))
        if unknown:
            raise UserError(f"Unknown method(s) {', '.join(unknown)}.")
        bb = tiny_backbone() if args.backbone in ("tiny", "tiny-llama") else load_backbone_from_args(args)
        mem = open_memory(args.memory, bb)
        records = measure(bb, mem, methods)
        if not args.no_write:
            print(f"wrote {save_measurements(f'{bb.name}@{machine_kind()}', records)}")
        return 0
    if args.cmd == "record":
        bb = tiny_backbone() if args.backbone in ("tiny", "tiny-llama") else load_backbone_from_args(args)
        catalog = Catalog(args.data_dir)
        records = {}
        for ref in args.plugins:
            folder = plugin_folder(ref, catalog)
            plugin = open_plugin(ref, bb, catalog)
            records[plugin.method] = record_from_run(plugin, folder, args.wait_policy)
            print(f"{plugin.method}: {json.dumps(records[plugin.method])}")
        if not args.no_write:
            print(f"wrote {save_measurements(f'{bb.name}@{machine_kind()}', records)}")
        return 0
    mem = open_memory(args.memory)
    res = estimate(args.method, parse_sets(args.set), mem.meta.get("backbone", ""),
                   len(mem.split_samples("train")), len(mem), policy=args.wait_policy)
    print(res["text"])
    return 0


if __name__ == "__main__":
    run_main(main)
