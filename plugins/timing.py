"""The arithmetic of the training-time estimate (``plugins.estimate``), apart from the CLI so that each method's
card (``plugins.card.TimeEstimate``: ``training_time`` / ``throughput_record``) can use it without importing the rest
of the studio.

The model, per training loop: one epoch = (training units + evaluations × early-stopping units × ``EVAL_COST``)
/ units per second, where an evaluation (forward only) is counted as ``EVAL_COST`` of a training unit (forward and
backward). Where convergence was not measured the estimate is for every epoch the settings allow (``max_epochs``).
"""
from __future__ import annotations

import math

EVAL_COST = 1 / 3  # an early-stopping evaluation of one unit (forward only) vs training on it (forward + backward)
EARLY_STOP_FRACTION = 0.1  # the seeded tenth of the training samples set aside for early stopping (plugins.training)


def minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min" if seconds >= 600 else f"{seconds / 60:.1f}".rstrip("0").rstrip(".") + " min"
    return f"{seconds / 3600:.1f} h"


def epochs_text(x: float) -> str:
    return f"{x:.2g}" if x < 10 else f"{x:.0f}"


def sig(x: float) -> float:
    """``x`` to 4 significant digits (a rate on Gemma can be 0.2/s, on the tiny model 20,000/s)."""
    return float(f"{x:.4g}")


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


def loop(name: str, train_units: float, stop_units: float, evals_per_epoch: float, rate: float,
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


def loop_rate(summary: dict, history: list[dict], per_step: float, stop_units: int) -> float:
    """Units per second of one ``run_training`` loop (``per_step`` units a step; evaluations of ``stop_units``
    counted at ``EVAL_COST``)."""
    evals = sum(1 for h in history if "heldout_loss" in h and h.get("phase", summary.get("phase"))
                == summary.get("phase"))
    units = summary["steps"] * per_step + evals * stop_units * EVAL_COST
    return sig(units / max(summary["seconds"], 1e-9))


def budget_seconds(cfg) -> float:
    """A config's time budget in seconds (``max_minutes``; 0: none)."""
    return 60.0 * float(getattr(cfg, "max_minutes", 0.0) or 0.0)


def sample_loops(method: str, cfg, rec: dict, samples: int, entries: int) -> dict:
    """The estimate plan of one training loop over the memory's samples (the in-network methods): ``setup_s``
    (before the first step: fixed costs, the phrase memory's back-translations, each batch's preparation), the
    ``loops`` and the ``budget_text`` the estimate's line names."""
    budget_s = budget_seconds(cfg)
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
    loops = [loop(method, sizes["train_samples"], sizes["stop_samples"], evals, rec["samples_per_s"],
                  cfg.max_epochs, rec.get("converge_epochs"), loop_budget)]
    return {"setup_s": setup_s, "loops": loops, "budget_text": f"your budget of {minutes(budget_s)}"}


def sample_record(cfg, info: dict, history: list[dict], wall_s: float) -> dict:
    """A measured record of one training loop over samples (the in-network methods) from a finished short run:
    ``info`` is the plug-in's ``train_info`` with the fit's metrics over it."""
    per_step = cfg.batch_size
    if info.get("epochs") and info.get("steps"):  # steps are fixed mini-batches of similar-length samples
        per_step = info["train_samples"] * info["epochs"] / max(1, info["steps"])
    # each batch is prepared (the frozen prefix and layers below the plug-in) the first time it is used, inside the
    # loop: the rate is the loop's time without it, the preparation a rate of its own
    pre = info.get("prepare_seconds", info.get("precompute_seconds"))
    run = {**info, "seconds": max(1e-3, info["seconds"] - (pre or 0.0))} if "prepare_seconds" in info else info
    out = {"samples_per_s": loop_rate(run, history, per_step, info["early_stop_samples"]),
           "batch_size": cfg.batch_size}
    if pre:
        prepared = info["train_samples"] * min(1.0, info.get("epochs") or 1.0) + info["early_stop_samples"]
        out["precompute_samples_per_s"] = sig(prepared / pre)
    mem_s = info.get("seconds_memory")
    if mem_s is not None:  # the phrase memory: back-translations (``max_translate`` of them) + the rest
        phr = info.get("phrase_memory") or {}
        translated, bt_s = phr.get("phrases_back_translated") or 0, phr.get("seconds_back_translate") or 0.0
        out["memory_s"] = round(max(0.0, mem_s - bt_s), 1)
        if translated and bt_s:
            out["translations_per_s"] = sig(translated / bt_s)
    inside = 0.0 if "prepare_seconds" in info else (pre or 0.0)  # older runs prepared before the loop
    out["setup_s"] = round(max(0.0, wall_s - info["seconds"] - inside - (mem_s or 0.0)), 1)
    return out


def layers_scaled(rec: dict, num_layers: int, made: int, now: int) -> dict:
    """A record of a run whose lowest adapted layer was ``made`` as for a config whose lowest is ``now`` (of
    ``num_layers``): a step runs the layers from the lowest up, forward and backward, so the rate scales with how many
    run; preparing a batch runs the frozen layers below once (forward only: about half of a step's cost per layer)."""
    rate = rec.get("samples_per_s")
    if not rate or made == now or not 0 <= now < num_layers or not 0 <= made < num_layers:
        return rec
    above_made, above_now = num_layers - made, num_layers - now
    out = {**rec, "samples_per_s": sig(rate * above_made / above_now), "lowest_layer": now}
    pre = 1.0 / rec["precompute_samples_per_s"] if rec.get("precompute_samples_per_s") else 0.0
    pre = max(pre * 0.1, pre + (now - made) / (2.0 * above_made * rate))
    if pre > 0:
        out["precompute_samples_per_s"] = sig(1.0 / pre)
    return out
