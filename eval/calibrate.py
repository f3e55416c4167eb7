"""Per-memory calibration: tune an interpolating plug-in's decode settings (PEMA's λ_max × GU, kNN's k × T × λ —
its declared grid, ``plugins.settings.decode_grid``) on held-out samples of its own memory, as the papers tune them
per dataset on a development set.

Every setting is scored by the greedy decode Compare runs, sentence by sentence: one batched decode per sentence whose
rows are the base model and every setting (``engine.BatchDecode``). Rows whose tokens agree share one row of the forward
pass (the compact layout), so a setting that changes no token costs nothing and the rows that part run together — the
whole grid costs little more than one decode per sentence. (Re-decoding each setting as a slider move of one kept
decode, ``LiveComparison``, gives the same outputs but ran the backbone once per changed setting: several times the CPU
time on Gemma for kNN's grid, BENCHMARKS.md, "Starts, presets and calibration, checked on WMT dev items", row "a
calibration's grid decoded as one batch against slider moves".) The grid and the tuning samples set the cost, not the
clock: every tuning sample is decoded (``DEFAULT_TUNE`` at most) unless a caller gives a time budget, and a budget never
stops calibration before ``MIN_TUNE`` samples.

The evidence rule: the plug-in starts at the *global start* (the declared defaults ← the ones tuned for the task and
backbone, ``row_settings(calibrated=False)``) unless another setting — λ = 0, the base model, included — beats the
global start on the tuning samples by a margin the paired bootstrap says is real: corpus chrF (the tuning metric)
higher with a one-sided paired-bootstrap p, Holm-adjusted for the number of settings whose outputs differ from the
global start's (the best of many settings is otherwise chosen for its luck), below ``ALPHA``, and sacreBLEU not lower.
Among the settings that pass, the best chrF, then sacreBLEU; ties go to the setting nearer the base (the smaller
weight). The global start and λ = 0 are always among the settings tried. The evidence (the difference, its raw and
adjusted p, the number of samples and of settings tested) is stored with the choice (``evidence``) and shown where
the choice is read ("λ_max 0.3: +2.1 chrF over the global start on 40 samples, p 0.01 …").

The held-out samples are split (``split_heldout``): the tuning part is what calibration decodes; the rest is left
for reports (``eval.rank``, the Evaluate tab), which never score a setting on the samples it was tuned on.

The result is stored atomically as ``calibration.json`` in the plug-in's folder (JSON only), tied to the checksum of
its weights, the backbone and the rule it was chosen by (``plugins.settings.CALIBRATION_RULE``);
``plugins.settings.row_settings`` starts the plug-in there unless asked for the global defaults.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

from engine import BatchDecode, Row, plan_batch
from engine.protocol import MixInput
from eval.metrics import bleu_chrf, holm, paired_bootstrap
from ground.errors import Cancelled, UserError
from ground.store import write_json_atomic
from plugins.settings import (
    CALIBRATION_FILE,
    CALIBRATION_RULE,
    _weights_sha,
    calibration_label,
    decode_grid,
    load_calibration,
    row_settings,
)

__all__ = ["DEFAULT_TUNE", "MIN_TUNE", "MIN_REPORT", "DEFAULT_SECONDS", "ALPHA", "tuning_count", "split_heldout",
           "calibrate", "load_calibration", "calibration_label", "weight_setting", "choose", "evidence",
           "CALIBRATION_FILE"]

DEFAULT_TUNE = 40      # tuning samples at most (the first of the held-out split)
MIN_TUNE = 8           # fewer tuning samples: no calibration (a choice on fewer says nothing)
MIN_REPORT = 20        # fewer report samples left after the tuning part: split_heldout warns
DEFAULT_SECONDS = None  # no time budget by default: the grid and the tuning samples set the cost (a budget, when
#                        given, is checked between samples once MIN_TUNE are done)
# what one calibration at the default sizes takes on Gemma 3 270M, for progress shares and estimates only: its 40
# tuning samples at the pace of the 12-setting grids on two loaded CPU cores (BENCHMARKS.md, "Ranking every method")
TYPICAL_SECONDS = 160.0
ALPHA = 0.05           # a setting leaves the global start when its Holm-adjusted one-sided p is below this
BOOTSTRAP = 1000       # paired-bootstrap resamples of the evidence
MAX_NEW_TOKENS = 96    # as the Evaluate tab: capped per sentence at 2 × its source tokens + 16

Progress = Callable[[float, str], None]


def _noop(*a) -> None:
    pass


def tuning_count(heldout: int) -> int:
    """How many of a memory's ``heldout`` held-out samples calibration tunes on by default (``split_heldout``)."""
    return min(DEFAULT_TUNE, heldout // 2)


def split_heldout(memory, n_tune: int | None = None) -> tuple[list[dict], list[dict], dict]:
    """The memory's held-out samples (in file order) split into a tuning part (the first ``n_tune``; default
    ``min(DEFAULT_TUNE, len // 2)``) and a report part (the rest). Each sample is its samples.jsonl dict with
    ``index`` (its line in samples.jsonl) added. Third value: ``{"tune", "report", "warning"}`` — the warning says
    when too few samples remain to tune on (< MIN_TUNE) or to report on (< MIN_REPORT)."""
    held = [{**s, "index": i} for i, s in enumerate(memory.samples)
            if s.get("split") == "heldout" and isinstance(s.get("src"), str) and s["src"].strip()
            and isinstance(s.get("tgt"), str)]
    if n_tune is None:
        n_tune = tuning_count(len(held))
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

    base = row_settings(plugin, None, None, calibrated=False).as_dict()
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
    the weight setting's name). Settings as plain ``{name: value}``: they go into the calibration file as they are."""
    weight = weight_setting(plugin)
    if weight is None:
        raise UserError(f"{plugin.title} declares no mixing weight that turns it off; nothing to calibrate.")
    start = row_settings(plugin, task, plugin.backbone_name, calibrated=False).as_dict()
    out, seen = [], set()
    for g in decode_grid(type(plugin)) + [start]:
        full = plugin.settings({**start, **g}).as_dict()
        if float(full[weight]) == 0.0:
            continue  # the base row is decoded anyway
        key = tuple(sorted(full.items()))
        if key not in seen:
            seen.add(key)
            out.append(full)
    return out, start, weight


def evidence(start: dict, rows: list[dict], hyps: list[list[str]], start_hyps: list[str], refs: list[str],
             resamples: int = BOOTSTRAP) -> int:
    """Each row of ``rows`` (with its outputs ``hyps``) against the global start (``start_hyps``) on the tuning
    samples: ``chrf_vs_start`` / ``bleu_vs_start`` (corpus differences), ``p_vs_start`` (one-sided paired-bootstrap p
    of chrF, ``eval.metrics.paired_bootstrap``) and ``p_vs_start_holm`` (Holm-adjusted over the distinct output sets
    that differ from the start's: the same outputs are one test, and outputs equal to the start's test nothing — their
    p stays None). ``start`` is the start's row; it gets zeros and None. Returns the number of tests."""
    key_start = tuple(start_hyps)
    tests: dict[tuple, dict] = {}
    for h in hyps:
        key = tuple(h)
        if key != key_start and key not in tests:
            pb = paired_bootstrap(start_hyps, h, refs, n_samples=resamples)
            tests[key] = {"chrf": pb["chrf"]["delta"], "bleu": pb["sacrebleu"]["delta"], "p": pb["chrf"]["p_value"]}
    keys = list(tests)
    for key, adj in zip(keys, holm([tests[k]["p"] for k in keys])):
        tests[key]["p_holm"] = adj
    for r, h in zip(rows, hyps):
        t = tests.get(tuple(h))
        if r is start or t is None:
            r.update(chrf_vs_start=0.0, bleu_vs_start=0.0, p_vs_start=None, p_vs_start_holm=None)
        else:
            r.update(chrf_vs_start=t["chrf"], bleu_vs_start=t["bleu"], p_vs_start=t["p"], p_vs_start_holm=t["p_holm"])
    return len(tests)


def choose(start: dict, table: list[dict], weight: str, alpha: float = ALPHA) -> dict:
    """The chosen row of ``table`` (rows ``{"settings", "chrf", "bleu", "chrf_vs_start", "bleu_vs_start",
    "p_vs_start_holm"}``, the base model's row at weight 0 among them; ``start``: the global start's row): a row
    other than the start only when it beats the start in chrF with a Holm-adjusted p below ``alpha`` and does not
    lose sacreBLEU to it; among those the best by chrF, then sacreBLEU, ties to the smaller weight (nearer the base).
    Otherwise the start."""
    ok = [r for r in table if r is not start and r.get("p_vs_start_holm") is not None
          and r["p_vs_start_holm"] < alpha and r["chrf_vs_start"] > 0 and r["bleu_vs_start"] >= 0]
    if not ok:
        return start
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
    none: every sample) stops taking new samples once MIN_TUNE are done and the time is spent; ``n`` says how many
    were used. The choice follows the evidence rule (module docstring); ``evidence`` records it."""
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
    progress(0.0, f"calibrating {plugin.title}: {len(candidates)} settings + the base on {n_all} held-out "
                  f"samples of {mem_name}")
    for i, s in enumerate(samples):
        if budget is not None and i >= MIN_TUNE and time.time() - t0 > budget:
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
        progress(min((i + 1) / n_all, 0.99), f"calibrating {plugin.title}: {i + 1}/{n_all} held-out samples × "
                                             f"{len(candidates) + 1} settings")
    n = len(refs)
    sc = bleu_chrf(base_h, refs)
    base_settings = plugin.settings({**start, weight: 0.0}).as_dict()
    base = {"settings": base_settings, "chrf": round(sc["chrf"], 4), "bleu": round(sc["sacrebleu"], 4),
            "base": True, "changed": 0, "global_default": base_settings == start}
    table = []
    for c, h in zip(candidates, hyps):
        m = bleu_chrf(h, refs)
        table.append({"settings": c, "chrf": round(m["chrf"], 4), "bleu": round(m["sacrebleu"], 4),
                      "changed": sum(a != b for a, b in zip(h, base_h)), "global_default": c == start})
    rows, outs = [base] + table, [base_h] + hyps
    at = next(i for i, r in enumerate(rows) if r["global_default"])  # the start: a candidate, or the base itself
    progress(0.99, f"calibrating {plugin.title}: the paired bootstrap of every setting against the global start")
    tests = evidence(rows[at], rows, outs, outs[at], refs)
    best = choose(rows[at], rows, weight)
    cfg_sha = _weights_sha(_read_config(plugin))
    ev = {"metric": "chrF", "alpha": ALPHA, "n": n, "tests": tests, "resamples": BOOTSTRAP,
          "moved": best is not rows[at], "start": dict(start)}
    contender = best if ev["moved"] else max((r for r in rows if r.get("p_vs_start") is not None),
                                             key=lambda r: (r["chrf"], r["bleu"], -float(r["settings"][weight])),
                                             default=None)
    if contender is not None:
        ev.update(settings=dict(contender["settings"]), is_base=bool(contender.get("base")),
                  chrf_delta=contender["chrf_vs_start"], bleu_delta=contender["bleu_vs_start"],
                  p=contender["p_vs_start"], p_holm=contender["p_vs_start_holm"])
    result = {"settings": dict(best["settings"]), "chrf": best["chrf"], "bleu": best["bleu"],
              "is_base": bool(best.get("base")), "weight": weight, "base": {"chrf": base["chrf"], "bleu": base["bleu"]},
              "global_default": {"settings": start, "chrf": rows[at]["chrf"], "bleu": rows[at]["bleu"]},
              "table": rows, "n": n, "memory": mem_name, "memory_id": memory.id, "sample_ids": used,
              "task": task, "backbone": plugin.backbone_name, "method": plugin.method, "rule": CALIBRATION_RULE,
              "seconds": round(time.time() - t0, 1), "stopped_by_time": stopped_by_time,
              "time_budget_seconds": budget, "forwards": forwards,
              "forwards_per_sample": round(forwards / max(1, n), 1), "max_new_tokens": int(max_new_tokens),
              "created": time.time(), "weights_sha256": cfg_sha}
    ev["text"] = evidence_text(result, ev, _labels(plugin))
    result["evidence"] = ev
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
    """One line: the choice with its evidence ("λ_max 0.3: +2.1 chrF over the global start on 40 samples, p 0.01
    (Holm-adjusted for 12 settings)"), then its scores beside the base model's."""
    what = (cal.get("evidence") or {}).get("text") or ", ".join(
        f"{k}={v}" for k, v in cal["settings"].items() if k in _grid_names(cal))
    return (f"{what} (chrF {cal['chrf']:.2f} vs base {cal['base']['chrf']:.2f}, sacreBLEU {cal['bleu']:.2f} vs "
            f"{cal['base']['bleu']:.2f})")


def p_short(p: float | None, resamples: int = BOOTSTRAP) -> str:
    """A p-value as the evidence line writes it: "p 0.21", "p 0.004", "p < 0.001" (the bootstrap's resolution)."""
    if p is None:
        return "p n/a"
    if p < 1 / resamples:
        return f"p < {1 / resamples:g}"
    return f"p {p:.3f}" if p < 0.01 else f"p {p:.2f}"


def _labels(plugin) -> dict:
    """Each decode setting's UI label without the method's name ("λ_max", not "PEMA λ_max")."""
    names = {plugin.method.lower(), plugin.title.split()[0].lower()}
    out = {}
    for s in plugin.decode_settings:
        first, _, rest = s.title.partition(" ")
        out[s.name] = rest if rest and first.lower() in names else s.title
    return out


def _setting_text(settings: dict, names: list[str], labels: dict) -> str:
    return ", ".join(f"{labels.get(k, k)} {settings[k]}" for k in names if k in settings)


def evidence_text(cal: dict, ev: dict, labels: dict | None = None) -> str:
    """The choice in one line with its evidence against the global start (``calibrate``'s ``evidence``)."""
    labels = labels or {}
    names = [k for k in ev["start"] if k in _grid_names(cal)]
    start = _setting_text(ev["start"], names, labels)
    tested = f"Holm-adjusted for {ev['tests']} setting{'s' if ev['tests'] != 1 else ''}"
    if "settings" in ev:
        what = "λ = 0 (the base model)" if ev["is_base"] else _setting_text(ev["settings"], names, labels)
        gain = f"{ev['chrf_delta']:+.1f} chrF"
        p = f"{p_short(ev['p_holm'], ev['resamples'])} ({tested})"
    if ev["moved"]:
        return f"{what}: {gain} over the global start ({start}) on {ev['n']} samples, {p}"
    if "settings" not in ev:
        return f"the global start ({start}) kept: no setting changed an output on {ev['n']} samples"
    if ev["chrf_delta"] <= 0:
        return f"the global start ({start}) kept: no setting beat it on {ev['n']} samples"
    return (f"the global start ({start}) kept: the best other setting, {what}, {gain} on {ev['n']} samples, {p} — "
            f"not clear evidence (p < {ev['alpha']:g} needed)")


def _grid_names(cal: dict) -> set:
    """The setting names that vary across the calibration table (what was tuned)."""
    rows = [r["settings"] for r in cal.get("table", []) if isinstance(r.get("settings"), dict)]
    names = set().union(*rows) if rows else set()
    return {k for k in names if len({str(r.get(k)) for r in rows}) > 1}
