"""Per-memory calibration: tune an interpolating plug-in's decode settings (PEMA's λ_max × GU, kNN's k × T × λ —
its declared grid, ``plugins.settings.decode_grid``) on held-out samples of its own memory, as the papers tune them
per dataset on a development set.

Every setting is scored by the greedy decode Compare runs, sentence by sentence: one batched decode per sentence
whose rows are the base model and every setting (``plugins.decode.BatchDecode``). Rows whose tokens agree share one
row of the forward pass (the compact layout), so a setting that changes no token costs nothing and the rows that
part run together — the whole grid costs little more than one decode per sentence. (Re-decoding each setting as a
slider move of one kept decode, ``LiveComparison``, gives the same outputs but ran the backbone once per changed
setting: 4.4× the CPU time on Gemma for kNN's grid, BENCHMARKS.) The score is corpus chrF, then sacreBLEU. λ = 0
(the base model) is always a candidate and a setting is chosen only when it is at least as good as the base on
*both* metrics, so a tuned setting never loses to the base on its tuning samples; when nothing beats the base,
λ = 0 is stored and the plug-in starts there (the same output as the base: the data said it does not help).

The held-out samples are split (``split_heldout``): the tuning part is what calibration decodes; the rest is left
for reports (``eval.rank``, the Evaluate tab), which never score a setting on the samples it was tuned on.

The result is stored atomically as ``calibration.json`` in the plug-in's folder (JSON only), tied to the checksum of
its weights; ``plugins.settings.row_settings`` starts the plug-in there unless asked for the global defaults.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

from eval.metrics import bleu_chrf
from ground.errors import Cancelled, UserError
from ground.store import write_json_atomic
from plugins.base import MixInput
from plugins.decode import BatchDecode, Row, plan_batch
from plugins.settings import (
    CALIBRATION_FILE,
    _weights_sha,
    calibration_label,
    decode_grid,
    load_calibration,
    row_settings,
)

__all__ = ["DEFAULT_TUNE", "MIN_TUNE", "MIN_REPORT", "DEFAULT_SECONDS", "split_heldout", "calibrate",
           "load_calibration", "calibration_label", "weight_setting", "choose", "CALIBRATION_FILE"]

DEFAULT_TUNE = 40      # tuning samples at most (the first of the held-out split)
MIN_TUNE = 8           # fewer tuning samples: no calibration (a choice on fewer says nothing)
MIN_REPORT = 20        # fewer report samples left after the tuning part: split_heldout warns
DEFAULT_SECONDS = 100.0  # time budget of one calibration; checked between samples once MIN_TUNE are done
MAX_NEW_TOKENS = 96    # as the Evaluate tab: capped per sentence at 2 × its source tokens + 16

Progress = Callable[[float, str], None]


def _noop(*a) -> None:
    pass


def split_heldout(memory, n_tune: int | None = None) -> tuple[list[dict], list[dict], dict]:
    """The memory's held-out samples (in file order) split into a tuning part (the first ``n_tune``; default
    ``min(DEFAULT_TUNE, len // 2)``) and a report part (the rest). Each sample is its samples.jsonl dict with
    ``index`` (its line in samples.jsonl) added. Third value: ``{"tune", "report", "warning"}`` — the warning says
    when too few samples remain to tune on (< MIN_TUNE) or to report on (< MIN_REPORT)."""
    held = [{**s, "index": i} for i, s in enumerate(memory.samples)
            if s.get("split") == "heldout" and isinstance(s.get("src"), str) and s["src"].strip()
            and isinstance(s.get("tgt"), str)]
    if n_tune is None:
        n_tune = min(DEFAULT_TUNE, len(held) // 2)
    n_tune = max(0, min(int(n_tune), len(held)))
    tune, report = held[:n_tune], held[n_tune:]
    warn = []
    if len(tune) < MIN_TUNE:
        warn.append(f"only {len(tune)} held-out samples to tune on (calibration needs {MIN_TUNE})")
    if len(report) < MIN_REPORT:
        warn.append(f"only {len(report)} held-out samples left to report on (fewer than {MIN_REPORT}: wide "
                    f"intervals)")
    return tune, report, {"tune": len(tune), "report": len(report), "warning": "; ".join(warn) or None}


def weight_setting(plugin) -> str | None:
    """The name of the decode setting that is the plug-in's mixing weight: the declared float setting with a lower
    bound of 0 at which ``mix_lambdas`` gives λ_t = 0 at every step (PEMA's λ_max, kNN's λ) — found by asking the
    plug-in, not by name. None when there is none."""
    import torch

    base = row_settings(plugin, None, None, calibrated=False)
    fc = torch.zeros(1, plugin.backbone.hidden_size)
    for s in plugin.decode_settings:
        if s.kind is not float or s.low != 0.0 or s.low_open or not s.grid:
            continue
        try:
            trial = plugin.settings({**base, s.name: 0.0})
            lams = [plugin.mix_lambdas(MixInput(fc=fc, lm_logprobs=torch.zeros(1, 1), extra_logits=None, step=t,
                                                src_len=[8], settings=[trial]))[0] for t in (0, 1, 3)]
            trial_on = plugin.settings({**base, s.name: max(s.grid)})
            on = plugin.mix_lambdas(MixInput(fc=fc, lm_logprobs=torch.zeros(1, 1), extra_logits=None, step=0,
                                             src_len=[8], settings=[trial_on]))[0]
        except (UserError, NotImplementedError, KeyError, TypeError, ValueError):
            continue
        if all(float(x) == 0.0 for x in lams) and float(on) > 0.0:
            return s.name
    return None


def _candidates(plugin, task: str | None) -> tuple[list[dict], dict, str]:
    """(the settings to try: the declared grid, plus the global start when the grid lacks it; the global start;
    the weight setting's name)."""
    weight = weight_setting(plugin)
    if weight is None:
        raise UserError(f"{plugin.title} declares no mixing weight that turns it off; nothing to calibrate.")
    start = row_settings(plugin, task, plugin.backbone_name, calibrated=False)
    out, seen = [], set()
    for g in decode_grid(type(plugin)) + [start]:
        full = plugin.settings({**start, **g})
        if float(full[weight]) == 0.0:
            continue  # the base row is decoded anyway
        key = tuple(sorted(full.items()))
        if key not in seen:
            seen.add(key)
            out.append(full)
    return out, start, weight


def choose(base: dict, table: list[dict], weight: str) -> dict:
    """The chosen row of ``table`` (rows ``{"settings", "chrf", "bleu"}``; ``base``: the base model's scores and
    settings at weight 0): the best by chrF, then sacreBLEU, among the rows at least as good as the base on both;
    ties go to the smaller weight, and to the base itself — so the choice never loses to the base."""
    ok = [r for r in table if r["chrf"] >= base["chrf"] and r["bleu"] >= base["bleu"]
          and (r["chrf"], r["bleu"]) != (base["chrf"], base["bleu"])]
    if not ok:
        return base
    return max(ok, key=lambda r: (r["chrf"], r["bleu"], -float(r["settings"][weight])))


def _run(dec, should_stop: Callable[[], bool]) -> None:
    while True:
        if should_stop():
            raise Cancelled()
        if not dec.step():
            return


def decode_grid_on(backbone, plugin, source: str, candidates: list[dict], prompt, max_new_tokens: int,
                   should_stop: Callable[[], bool] = lambda: False) -> tuple[str, list[str], int]:
    """One sentence under every candidate setting: (the base model's output, each candidate's output, backbone
    forward passes run). One batched greedy decode whose rows are the base model and every candidate: rows whose
    tokens agree share one row of the forward pass (the compact layout), so settings that change nothing cost
    nothing, and the rows that part run together in one forward pass. Stopped between steps by ``should_stop``."""
    rows = [Row("base")] + [Row(f"setting {i}", plugin, s) for i, s in enumerate(candidates)]
    dec = BatchDecode(backbone, plan_batch(backbone, [source], rows, prompt), max_new_tokens, trace=False)
    _run(dec, should_stop)
    comp = dec.result()[0]
    return comp.rows[0].text, [r.text for r in comp.rows[1:]], dec.forwards


def calibrate(backbone, plugin, memory, *, task: str | None = None, samples: list[dict] | None = None,
              max_samples: int | None = None, max_seconds: float | None = None, progress: Progress | None = None,
              should_stop: Callable[[], bool] | None = None, store: bool = True,
              max_new_tokens: int = MAX_NEW_TOKENS) -> dict | None:
    """Tune ``plugin``'s declared decode grid on held-out samples of ``memory`` (default: the tuning part of
    ``split_heldout``, at most ``max_samples`` = DEFAULT_TUNE) and store the result in its folder (``store``).

    Returns ``{"settings", "table", "n", "memory", "memory_id", "sample_ids", "seconds", "base", ...}`` (see the
    module docstring), or None for a plug-in that does not interpolate (nothing to calibrate). A UserError when the
    memory has too few held-out samples; ``Cancelled`` when ``should_stop()`` turns true. ``max_seconds`` (default
    DEFAULT_SECONDS) stops taking new samples once MIN_TUNE are done and the time is spent; ``n`` says how many
    were used."""
    if not plugin.interpolates or plugin.level != "output":  # declared on ``Plugin``
        return None
    progress = progress or _noop
    should_stop = should_stop or (lambda: False)
    t0 = time.time()
    mem_name = memory.meta.get("name") or memory.id
    if samples is None:
        samples, _, info = split_heldout(memory, max_samples)
        if len(samples) < MIN_TUNE:
            raise UserError(f"Calibration skipped: the memory {mem_name!r} has too few held-out samples "
                            f"({info['tune']} to tune on; it needs {MIN_TUNE}, i.e. at least {2 * MIN_TUNE} "
                            f"held-out samples — about {20 * MIN_TUNE} samples at the default 10% held out). "
                            f"The plug-in keeps the global defaults.")
    elif len(samples) < MIN_TUNE:
        raise UserError(f"Calibration skipped: too few held-out samples ({len(samples)}; it needs {MIN_TUNE}).")
    if max_samples is not None:
        samples = samples[:max(MIN_TUNE, int(max_samples))]
    budget = DEFAULT_SECONDS if max_seconds is None else float(max_seconds)
    task = task or memory.task  # the global start is the one tuned for the memory's task
    candidates, start, weight = _candidates(plugin, task)
    prompt = memory.prompt
    n_all = len(samples)
    base_h, hyps, refs, used, forwards = [], [[] for _ in candidates], [], [], 0
    stopped_by_time = False
    progress(0.0, f"calibrating {plugin.title}: {len(candidates)} settings + the base on up to {n_all} held-out "
                  f"samples of {mem_name}")
    for i, s in enumerate(samples):
        elapsed = time.time() - t0
        if i >= MIN_TUNE and elapsed > budget:
            stopped_by_time = True
            break
        src = s["src"].strip()
        cap = min(int(max_new_tokens), 2 * len(backbone.encode_target(src)) + 16)
        b, outs, fw = decode_grid_on(backbone, plugin, src, candidates, prompt, cap, should_stop)
        base_h.append(b)
        for h, o in zip(hyps, outs):
            h.append(o)
        refs.append(s["tgt"])
        used.append(s.get("index", i))
        forwards += fw
        frac = max((i + 1) / n_all, min(1.0, (time.time() - t0) / budget) if i + 1 >= MIN_TUNE else 0.0)
        progress(min(frac, 0.99), f"calibrating {plugin.title}: {i + 1}/{n_all} held-out samples × "
                                  f"{len(candidates) + 1} settings")
    n = len(refs)
    sc = bleu_chrf(base_h, refs)
    base_settings = plugin.settings({**start, weight: 0.0})
    base = {"settings": base_settings, "chrf": round(sc["chrf"], 4), "bleu": round(sc["sacrebleu"], 4),
            "base": True}
    table = []
    for c, h in zip(candidates, hyps):
        m = bleu_chrf(h, refs)
        table.append({"settings": c, "chrf": round(m["chrf"], 4), "bleu": round(m["sacrebleu"], 4),
                      "changed": sum(a != b for a, b in zip(h, base_h)), "global_default": c == start})
    best = choose(base, table, weight)
    cfg_sha = _weights_sha(_read_config(plugin))
    result = {"settings": dict(best["settings"]), "chrf": best["chrf"], "bleu": best["bleu"],
              "is_base": bool(best.get("base")), "weight": weight, "base": {"chrf": base["chrf"], "bleu": base["bleu"]},
              "global_default": {"settings": start,
                                 **next(({"chrf": r["chrf"], "bleu": r["bleu"]} for r in table if r["global_default"]),
                                        {})},
              "table": [base] + table, "n": n, "memory": mem_name, "memory_id": memory.id, "sample_ids": used,
              "task": task, "backbone": plugin.backbone_name, "method": plugin.method,
              "seconds": round(time.time() - t0, 1), "stopped_by_time": stopped_by_time,
              "time_budget_seconds": budget, "forwards": forwards,
              "forwards_per_sample": round(forwards / max(1, n), 1), "max_new_tokens": int(max_new_tokens),
              "created": time.time(), "weights_sha256": cfg_sha}
    result["label"] = calibration_label(result)
    folder = plugin.plugin_path
    if store and folder is not None:
        write_json_atomic(Path(folder) / CALIBRATION_FILE, _finite(result))
    progress(1.0, f"calibrated {plugin.title} on {n} held-out samples: "
                  f"{describe_choice(result)} in {result['seconds']:.0f} s")
    return result


def _read_config(plugin) -> dict:
    import json

    folder = plugin.plugin_path
    if folder is None:
        return {}
    try:
        return json.loads((Path(folder) / "plugin_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _finite(obj):
    """JSON-safe: NaN/inf floats (an empty hypothesis set's score) as None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def describe_choice(cal: dict) -> str:
    """One line: "λ_max=0.3, gu=False (chrF 55.1 vs base 54.2, sacreBLEU 30.0 vs 29.1)" or "λ = 0 (the base) …"."""
    tuned = {k: v for k, v in cal["settings"].items() if k in _grid_names(cal)}
    what = "λ = 0: the base model (no setting beat it)" if cal.get("is_base") else \
        ", ".join(f"{k}={v}" for k, v in tuned.items())
    return (f"{what} (chrF {cal['chrf']:.2f} vs base {cal['base']['chrf']:.2f}, sacreBLEU {cal['bleu']:.2f} vs "
            f"{cal['base']['bleu']:.2f})")


def _grid_names(cal: dict) -> set:
    """The setting names that vary across the calibration table (what was tuned)."""
    rows = [r["settings"] for r in cal.get("table", []) if isinstance(r.get("settings"), dict)]
    names = set().union(*rows) if rows else set()
    return {k for k in names if len({str(r.get(k)) for r in rows}) > 1}
