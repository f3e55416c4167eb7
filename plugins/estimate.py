"""How long training will take, said before it starts: measured throughputs × the memory's size × the epochs.

``backbone/training_throughput.json`` holds, per backbone and method, what a short run of each method measured on
this kind of machine (``python -m plugins.estimate measure``): training units per second (memory *entries* for
PEMA and kNN, *samples* — sequences — for the in-network methods), the fixed costs before the loop (candidate
vocabulary, calibration, each batch's preparation per sample — the frozen prompt prefix and layers below the
plug-in, done the first time a batch is used —, the memory adapter's phrase memory) and, where a run to
convergence was measured, the epochs early stopping took. ``estimate`` turns that into one line for the training
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
import math
import shutil
import tempfile
import time
from pathlib import Path

from backbone.cli import load_backbone_from_args
from backbone.tiny import tiny_backbone
from ground.cli import add_common, run_main
from ground.errors import UserError
from ground.store import write_json_atomic
from plugins.api import make_config, open_memory, train_plugin
from plugins.registry import available_methods, get_method
from plugins.settings import parse_sets

THROUGHPUT_PATH = Path(__file__).resolve().parents[1] / "backbone" / "training_throughput.json"
EVAL_COST = 1 / 3  # an early-stopping evaluation of one unit (forward only) vs training on it (forward + backward)
EARLY_STOP_FRACTION = 0.1  # the seeded tenth of the training samples set aside for early stopping (plugins.training)

# The short run of each method that ``measure`` times (a few steps of every phase, on the memory given).
MEASURE_SETTINGS = {
    "pema": {"max_epochs_rct": 2, "max_epochs_joint": 2, "patience": 1000, "max_minutes": 1.5},
    "knn": {},
    "adapter": {"max_epochs": 1, "max_minutes": 1.5, "patience": 1000, "max_heldout": 8},
    "lora": {"max_epochs": 1, "max_minutes": 2.5, "patience": 1000},
    "memory_tuning": {"max_epochs": 1, "max_minutes": 1.5, "patience": 1000, "max_heldout": 8},
    "memory_adapter": {"max_epochs": 1, "max_minutes": 1.5, "patience": 1000, "max_heldout": 8, "max_translate": 16},
}


def throughputs(path: Path | None = None) -> dict:
    """The measured throughputs: ``{backbone name: {method: record}}`` (empty when the file is missing)."""
    p = path or THROUGHPUT_PATH
    if not p.is_file():
        return {}
    data = json.loads(p.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min" if seconds >= 600 else f"{seconds / 60:.1f}".rstrip("0").rstrip(".") + " min"
    return f"{seconds / 3600:.1f} h"


def _epochs(x: float) -> str:
    return f"{x:.2g}" if x < 10 else f"{x:.0f}"


def split_sizes(samples: int, entries: int, max_stop_samples: int) -> dict:
    """Training and early-stopping units of a memory with ``samples`` training samples and ``entries`` training
    entries, as the training loops split them (a seeded tenth of the samples, at least one, at most
    ``max_stop_samples``; a single sample is both)."""
    if samples < 2:
        return {"train_samples": samples, "stop_samples": samples, "train_entries": entries, "stop_entries": entries}
    stop = min(max_stop_samples, samples - 1, max(1, round(samples * EARLY_STOP_FRACTION)))
    per = entries / samples
    return {"train_samples": samples - stop, "stop_samples": stop,
            "train_entries": round(per * (samples - stop)), "stop_entries": round(per * stop)}


def _loop(name: str, train_units: float, stop_units: float, evals_per_epoch: float, rate: float,
          max_epochs: int, converge_epochs, budget_s: float) -> dict:
    """One training loop's estimate: seconds per epoch, the epochs it will run, seconds to converge, and how far a
    budget of ``budget_s`` (0: none) gets."""
    epoch_s = (train_units + evals_per_epoch * stop_units * EVAL_COST) / max(rate, 1e-9)
    measured = isinstance(converge_epochs, (int, float))
    epochs = min(max_epochs, converge_epochs) if measured else max_epochs
    first_eval = stop_units * EVAL_COST / max(rate, 1e-9)
    out = {"phase": name, "epoch_s": round(epoch_s, 2), "epochs": epochs, "converge_measured": measured,
           "converge_s": round(first_eval + epoch_s * epochs, 1), "budget_s": budget_s or None,
           "epochs_in_budget": None, "budget_stops": False}
    if budget_s:
        in_budget = max(0.0, budget_s - first_eval) / max(epoch_s, 1e-9)
        out["epochs_in_budget"] = round(in_budget, 2)
        out["budget_stops"] = in_budget < epochs
    return out


def estimate(method: str, config: dict | None, backbone_name: str, samples: int, entries: int,
             table: dict | None = None) -> dict:
    """How long training ``method`` with ``config`` (its overrides; validated) on a memory of ``samples``
    training samples / ``entries`` training entries takes on ``backbone_name``, from the measured throughputs.

    ``{"measured": False, "text"}`` when this backbone/method was not measured; else ``setup_s``, ``loops`` (one
    per training loop: epoch seconds, epochs, seconds to converge, epochs within the budget), ``converge_s``,
    ``under_trained`` (the budget stops a loop before it converges) and ``text`` (one line for the form)."""
    cls = get_method(method)
    cfg = make_config(method, config or {})
    rec = (throughputs() if table is None else table).get(backbone_name, {}).get(method)
    if not rec:
        return {"measured": False, "under_trained": False,
                "text": f"No time estimate: {cls.title} was not measured on {backbone_name} "
                        f"(python -m plugins.estimate measure)."}
    if method == "knn":
        secs = rec.get("setup_s", 0.0) + entries / max(rec["entries_per_s"], 1e-9)
        return {"measured": True, "setup_s": round(secs, 1), "loops": [], "converge_s": round(secs, 1),
                "under_trained": False, "text": f"Nothing to train: ≈ {_minutes(secs)} to index {entries:,} entries."}
    budget_s = 60.0 * float(getattr(cfg, "max_minutes", 0.0) or 0.0)
    if method == "pema":
        sizes = split_sizes(samples, entries, 500)
        conv = rec.get("converge_epochs") or {}
        loops = [_loop(phase, sizes["train_entries"], sizes["stop_entries"], 1, rec[key], max_ep, conv.get(phase),
                       budget_s)
                 for phase, key, max_ep in (("reconstruction", "rct_entries_per_s", cfg.max_epochs_rct),
                                            ("joint", "joint_entries_per_s", cfg.max_epochs_joint))]
        setup_s = rec.get("setup_s", 0.0)
        budget_text = f"your budget of {_minutes(budget_s)} a phase"
    else:
        sizes = split_sizes(samples, entries, cfg.max_heldout)
        setup_s = rec.get("setup_s", 0.0) + rec.get("memory_s", 0.0)
        if rec.get("translations_per_s"):  # the memory adapter back-translates up to max_translate phrases
            setup_s += getattr(cfg, "max_translate", 0) / rec["translations_per_s"]
        pre_s = (sizes["train_samples"] + sizes["stop_samples"]) / rec["precompute_samples_per_s"] \
            if rec.get("precompute_samples_per_s") else 0.0
        loop_budget = budget_s
        if budget_s and pre_s:  # the budget covers each batch's preparation (inside the loop: plugins/network.py)
            loop_budget = max(budget_s - pre_s, 15.0)
        setup_s += pre_s
        steps_per_epoch = max(1, math.ceil(sizes["train_samples"] / cfg.batch_size))
        every = getattr(cfg, "eval_every", 0) or math.ceil(steps_per_epoch / cfg.evals_per_epoch)
        evals = steps_per_epoch / max(1, every)
        loops = [_loop(method, sizes["train_samples"], sizes["stop_samples"], evals, rec["samples_per_s"],
                       cfg.max_epochs, rec.get("converge_epochs"), loop_budget)]
        budget_text = f"your budget of {_minutes(budget_s)}"
    converge_s = setup_s + sum(lp["converge_s"] for lp in loops)
    total_epochs = sum(lp["epochs"] for lp in loops)
    measured = all(lp["converge_measured"] for lp in loops)
    what = (f"≈ {_minutes(converge_s)} to converge (≈ {_epochs(total_epochs)} epochs)" if measured else
            f"≈ {_minutes(converge_s)} for all {_epochs(total_epochs)} epochs (max_epochs; early stopping may end it "
            f"sooner)")
    if len(loops) > 1:
        what += " — " + ", ".join(f"{lp['phase']} {_epochs(lp['epochs'])} epochs ≈ {_minutes(lp['converge_s'])}"
                                  for lp in loops)
    if setup_s >= 60:  # LoRA's precomputation, the memory adapter's phrase memory: before the first step
        what += f", of which ≈ {_minutes(setup_s)} before the first step"
    cut = [lp for lp in loops if lp["budget_stops"]]
    if cut:
        lp = cut[0]
        where = f" the {lp['phase']} phase" if len(loops) > 1 else ""
        text = f"{what}; {budget_text} stops{where} at ≈ {_epochs(lp['epochs_in_budget'])} epochs — under-trained"
    elif budget_s:
        text = f"{what}; fits {budget_text}"
    else:
        text = f"{what}; no time budget"
    return {"measured": True, "backbone": backbone_name, "setup_s": round(setup_s, 1), "loops": loops,
            "converge_s": round(converge_s, 1), "under_trained": bool(cut), "text": text + "."}


# --- measuring ---------------------------------------------------------------------------------------------------
def _loop_rate(summary: dict, history: list[dict], per_step: float, stop_units: int) -> float:
    """Units per second of one ``run_training`` loop (``per_step`` units a step; evaluations of ``stop_units``
    counted at ``EVAL_COST``)."""
    evals = sum(1 for h in history if "heldout_loss" in h and h.get("phase", summary.get("phase"))
                == summary.get("phase"))
    units = summary["steps"] * per_step + evals * stop_units * EVAL_COST
    return _sig(units / max(summary["seconds"], 1e-9))


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a rate on Gemma can be 0.2/s, on the tiny model 20,000/s)."""
    return float(f"{x:.4g}")


def throughput_record(method: str, plugin, history: list[dict], wall_s: float, memory,
                      metrics: dict | None = None) -> dict:
    """A measured record (see the module docstring) from a finished short run of ``method``; ``metrics``: the
    fit's own (its ``seconds`` are the training loop's — ``train_plugin`` overwrites ``train_info["seconds"]``
    with the whole run's)."""
    info = {**plugin.train_info, **{k: v for k, v in (metrics or {}).items() if k != "train_info"}}
    cfg = plugin.config
    if method == "knn":
        return {"entries_per_s": round(len(memory) / max(wall_s, 1e-3), 1), "setup_s": 0.0}
    if method == "pema":
        rct, joint = info["reconstruction"], info["joint"]
        stop = info["early_stop_entries"]
        return {"rct_entries_per_s": _loop_rate(rct, history, cfg.batch_size, stop),
                "joint_entries_per_s": _loop_rate(joint, history, cfg.batch_size, stop),
                "setup_s": round(max(0.0, wall_s - rct["seconds"] - joint["seconds"]), 1),
                "batch_size": cfg.batch_size, "candidates": info.get("candidates")}
    per_step = cfg.batch_size
    if info.get("epochs") and info.get("steps"):  # steps are fixed mini-batches of similar-length samples
        per_step = info["train_samples"] * info["epochs"] / max(1, info["steps"])
    # each batch is prepared (the frozen prefix and layers below the plug-in) the first time it is used, inside the
    # loop: the rate is the loop's time without it, the preparation a rate of its own
    pre = info.get("prepare_seconds", info.get("precompute_seconds"))
    loop = {**info, "seconds": max(1e-3, info["seconds"] - (pre or 0.0))} if "prepare_seconds" in info else info
    out = {"samples_per_s": _loop_rate(loop, history, per_step, info["early_stop_samples"]),
           "batch_size": cfg.batch_size}
    if pre:
        prepared = info["train_samples"] * min(1.0, info.get("epochs") or 1.0) + info["early_stop_samples"]
        out["precompute_samples_per_s"] = _sig(prepared / pre)
    mem_s = info.get("seconds_memory")
    if mem_s is not None:  # the phrase memory: back-translations (``max_translate`` of them) + the rest
        phr = info.get("phrase_memory") or {}
        translated, bt_s = phr.get("phrases_back_translated") or 0, phr.get("seconds_back_translate") or 0.0
        out["memory_s"] = round(max(0.0, mem_s - bt_s), 1)
        if translated and bt_s:
            out["translations_per_s"] = _sig(translated / bt_s)
    inside = 0.0 if "prepare_seconds" in info else (pre or 0.0)  # older runs prepared before the loop
    out["setup_s"] = round(max(0.0, wall_s - info["seconds"] - inside - (mem_s or 0.0)), 1)
    return out


def quiet_record(rec: dict, speedup: float) -> dict:
    """A record as on a quiet machine: rates × ``speedup`` and fixed seconds ÷ it, where ``speedup`` = wall seconds
    / CPU seconds of the measuring run. On a shared machine a run gets a fraction of the cores; the CPU time it used
    is what it costs when it has the machine to itself (PEMA's joint phase on Gemma, measured with the machine at a
    load of ~20 on 2 cores: 268 entries/s as measured, ~2,000 as CPU-time rate, ~2,100 expected from BENCHMARKS §2's
    quiet run scaled to its candidate count — threads add little). Never slower than measured (speedup ≥ 1)."""
    k = max(1.0, speedup)
    out = {}
    for key, v in rec.items():
        if isinstance(v, (int, float)) and key.endswith("_per_s"):
            out[key] = _sig(v * k)
        elif isinstance(v, (int, float)) and key.endswith("_s"):
            out[key] = _sig(v / k)
        else:
            out[key] = v
    out["cpu_time_speedup"] = round(k, 2)
    return out


def measure(backbone, memory, methods: list[str], progress=print) -> dict:
    """Time a short run (``MEASURE_SETTINGS``) of each method on ``memory``: ``{method: record}``. Plug-ins are
    written to a temporary folder and removed; the memory is only read."""
    out = {}
    tmp = Path(tempfile.mkdtemp(prefix="pema-estimate-"))
    try:
        for m in methods:
            progress(f"measuring {m} on {len(memory.split_samples('train'))} samples / {len(memory):,} entries")
            t0, c0 = time.time(), time.process_time()
            plugin, row = train_plugin(backbone, memory, m, MEASURE_SETTINGS.get(m, {}), out_dir=tmp / m)
            wall, cpu = time.time() - t0, time.process_time() - c0
            rec = throughput_record(m, plugin, row["history"], wall, memory, json.loads(row["metrics"]))
            out[m] = {**quiet_record(rec, wall / max(cpu, 1e-9)),
                      "measured_on": {"samples": len(memory.split_samples("train")), "entries": len(memory),
                                      "settings": MEASURE_SETTINGS.get(m, {}), "wall_s": round(wall, 1),
                                      "cpu_s": round(cpu, 1), "as_measured": rec,
                                      "date": time.strftime("%Y-%m-%d")}}
            progress(f"  {m}: {json.dumps(out[m])}")
            shutil.rmtree(tmp / m, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


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
    me.add_argument("--methods", default=",".join(MEASURE_SETTINGS))
    me.add_argument("--no-write", action="store_true", help="print the records only")
    add_common(me)
    sh = sub.add_parser("show", help="the time estimate of training a method on a memory")
    sh.add_argument("memory", help="memory folder")
    sh.add_argument("--method", required=True)
    sh.add_argument("--set", action="append", metavar="KEY=VALUE")
    add_common(sh, backbone=False)
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = sorted(set(methods) - set(available_methods()))
        if unknown:
            raise UserError(f"Unknown method(s) {', '.join(unknown)}.")
        bb = tiny_backbone() if args.backbone in ("tiny", "tiny-llama") else load_backbone_from_args(args)
        mem = open_memory(args.memory, bb)
        records = measure(bb, mem, methods)
        if not args.no_write:
            print(f"wrote {save_measurements(bb.name, records)}")
        return 0
    mem = open_memory(args.memory)
    res = estimate(args.method, parse_sets(args.set), mem.meta.get("backbone", ""),
                   len(mem.split_samples("train")), len(mem))
    print(res["text"])
    return 0


if __name__ == "__main__":
    run_main(main)
