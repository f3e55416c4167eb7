"""Rank every method on one memory: train each registered method with its defaults (reusing a plug-in already trained
with the same settings on this memory), calibrate the interpolating ones on the tuning part of the memory's held-out
samples, evaluate all of them and the base model on the report part (or on a test file) and say which serves this
data best.

``rank`` is what ``python -m eval rank``, the studio's rank job and the tests call. Its result, the *leaderboard*, is
plain JSON: per method chrF and sacreBLEU with 95 % bootstrap intervals, the paired difference to the base model
with its one-sided p, training seconds, trainable parameters, decode seconds per token relative to the base, the
settings the row was decoded with (and which of them were tuned on this memory); a one-line verdict; the wall time
of every phase. Evaluation never sees a sample a setting was tuned on: ``eval.calibrate.split_heldout`` splits the
held-out samples once, calibration reads only the tuning part, the report part (or the test file) is scored.

Phases, one after another on the one backbone (each cancellable at its next batch): decode speed (the base model
alone on a few report sentences: the first measured pace of the ETA), training, calibration,
evaluation, decode cost (each method alone on the same sentences). With a ``trainer`` (``python -m eval rank
--workers N``, a studio on Ray) the trainings run at once on its workers instead, so that phase lasts about as
long as its slowest method, and the leaderboard's ``workers`` says where they ran. Progress is reported over all
phases as the time fraction of one ETA (``Plan``): the training-time estimates (``plugins.estimate``) and the decode
plan, re-estimated from the pace measured so far.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from backbone.prompts import Prompt
from backbone.tasks import task_prompt
from engine import Row, decode_batch
from eval import calibrate
from eval.metrics import holm, signatures
from eval.run import MIN_BOOTSTRAP_N, evaluate
from eval.transfer import memory_transfer, side_by_side
from ground.errors import Cancelled, UserError
from ground.store import LOCAL_OWNER, Catalog
from plugins.api import make_config, open_plugin, train_plugin
from plugins.estimate import estimate
from plugins.registry import available_methods, get_method
from plugins.settings import row_settings

Progress = Callable[[float, str], None]
LEADERBOARD_VERSION = 1
ALPHA = 0.05  # a difference to the base model counts when its one-sided paired-bootstrap p is below this
COST_SENTENCES = 4  # report sentences each method decodes alone to time its cost per token
UNMEASURED_TRAIN_S = 120.0  # the ETA's guess for a method without a measured training throughput
# a tuning sample's grid decode, in base-model sentences (the 1,000-pair rank's calibrations: BENCHMARKS.md,
# "Ranking every method"); a time budget, when given, caps it
CALIBRATION_SENTENCE_COST = 4.0
# the ETA's prior: the plan's pace starts at 1 with the weight of this share of the planned seconds (at least
# PRIOR_MIN_S), so the first seconds measured do not swing it and a tenth of the run outweighs it
PRIOR_SHARE, PRIOR_MIN_S = 0.02, 2.0
# where a rank trained (the leaderboard's "workers"): in this process unless a trainer is given; a trainer says
# {"executor", "workers", "address", "gpus"} (``studio.ray_executor.RankTrainer``) and offers ``runs(method)``,
# ``slots()`` and ``train_many(backbone, memory, jobs, catalog=, owner=, progress=(method, frac, msg), should_stop=)``
# → {method: catalog row}
IN_PROCESS = {"executor": "inprocess", "workers": 1}


def _noop(*a) -> None:
    pass


# --- which plug-ins ---------------------------------------------------------------------------------------------
def plugin_config(path: str | Path) -> dict | None:
    """The training config a saved plug-in was made with (its ``plugin_config.json``), or None."""
    p = Path(path) / "plugin_config.json"
    try:
        return json.loads(p.read_text(encoding="utf-8")).get("config")
    except (OSError, ValueError):
        return None


def same_config(method: str, stored: dict | None, wanted: dict) -> bool:
    """Whether a stored config trains what ``wanted`` (a complete config) trains: both through the method's
    ``Config`` (a field added since the plug-in was saved takes its default on load too)."""
    if not isinstance(stored, dict):
        return False
    try:
        return make_config(method, stored).to_dict() == wanted
    except (UserError, TypeError, ValueError):
        return False


def find_trained(catalog: Catalog, owner: str, memory_id: str, method: str, config: dict,
                 fingerprint: str) -> dict | None:
    """The newest of the owner's plug-ins of ``method`` trained on this memory with exactly ``config`` on this
    backbone (not one that continued another's training: its history differs), or None."""
    best = None
    for r in catalog.plugins(owner):
        if r["method"] != method or r["memory_id"] != memory_id or r["fingerprint"] != fingerprint:
            continue
        info = json.loads(r.get("metrics") or "{}").get("train_info") or {}
        if info.get("continued_from") or not same_config(method, plugin_config(r["path"]), config):
            continue
        if best is None or (r.get("created") or 0) > (best.get("created") or 0):
            best = r
    return best


def wanted_methods(methods: list[str] | None) -> list[str]:
    """The methods to rank: ``methods`` (checked) or every registered one."""
    known = available_methods()
    if not methods:
        return list(known)
    bad = [m for m in methods if m not in known]
    if bad:
        raise UserError(f"Unknown method(s) {', '.join(bad)}; available: {', '.join(known)}.")
    return list(dict.fromkeys(methods))


# --- the data ---------------------------------------------------------------------------------------------------
def split(memory, test_pairs: list[tuple[str, str]] | None = None, n_tune: int | None = None) -> dict:
    """The tuning samples and the pairs to report on: ``{"tune", "report", "info"}``. The tuning part is the
    held-out split's in either case (a plug-in's calibration does not depend on the report); the report is the
    held-out split's report part, or ``test_pairs`` (a test file). Refuses
    when too few sentences remain to report on (fewer than ``MIN_BOOTSTRAP_N``: no interval, no p)."""
    tune, rest, info = calibrate.split_heldout(memory, n_tune)
    if test_pairs is not None:
        report = [(s, t) for s, t in test_pairs]
        source = "test file"
    else:
        report = [(s["src"], s["tgt"]) for s in rest]
        source = "held-out"
    if len(report) < MIN_BOOTSTRAP_N:
        where = (f"the test file has {len(report)} pairs" if test_pairs is not None else
                 f"{info['report']} held-out samples remain after {info['tune']} for tuning")
        raise UserError(f"Too few sentences to rank on: {where}; at least {MIN_BOOTSTRAP_N} are needed for "
                        f"intervals and p-values. Build the memory from more samples or upload a test file.")
    warning = info.get("warning")
    if test_pairs is not None and len(report) < 20:
        warning = f"Only {len(report)} test pairs: intervals will be wide."
    return {"tune": tune, "report": report, "heldout_report": [(s["src"], s["tgt"]) for s in rest],
            "info": {"tune": len(tune), "report": len(report), "report_source": source, "warning": warning}}


def memory_prompt(memory, backbone, task: str) -> Prompt:
    """The memory's recorded prompt (what its plug-ins trained with) when it is for ``task``, else the task's."""
    meta = memory.meta or {}
    if meta.get("prompt") and meta.get("task", task) == task:
        return Prompt.from_dict(meta["prompt"])
    return task_prompt(task, backbone)


# --- the plan and its progress ------------------------------------------------------------------------------------
class Plan:
    """The run's items (phase, what, planned seconds) and the run's one ETA. Several items may run at once
    (trainings on workers): each counts its own fraction.

    The ETA is re-estimated from measured progress: the planned seconds not yet done × the run's pace so far (seconds
    spent ÷ planned seconds done; it starts at 1, a prior worth ``PRIOR_SHARE`` of the plan), so a machine twice as
    loaded as the estimates assume doubles every remaining item as soon as the first items show it. The progress
    reported is the time fraction spent ÷ (spent + remaining): ``studio.job_status.job_timing`` (elapsed × (1 − p) / p)
    then shows this very ETA, and the message carries the phase and its place among ``phases``, no ETA of its own."""

    def __init__(self, progress: Progress, clock: Callable[[], float] = time.monotonic):
        self.items: list[dict] = []
        self.progress = progress
        self.clock = clock
        self.t0 = clock()
        self.done_s = 0.0
        self.running: dict[int, tuple[dict, float]] = {}  # id(item) -> (item, its fraction done)
        self.phases: list[str] = []  # the run's phases in order (the message says "phase k of n")

    def add(self, phase: str, what: str, est_s: float) -> dict:
        item = {"phase": phase, "what": what, "est_s": max(0.5, float(est_s))}
        self.items.append(item)
        if phase not in self.phases:
            self.phases.append(phase)
        return item

    def total(self) -> float:
        return sum(i["est_s"] for i in self.items)

    def remaining(self, now: float | None = None) -> float:
        """Seconds left: the planned seconds not done yet × the pace measured so far."""
        now = self.clock() if now is None else now
        total = self.total()
        done = self.done_s + sum(i["est_s"] * f for i, f in self.running.values())
        prior = max(PRIOR_MIN_S, PRIOR_SHARE * total)
        pace = (max(0.0, now - self.t0) + prior) / (done + prior)
        return max(0.0, total - done) * pace

    def start(self, item: dict) -> Progress:
        self.running[id(item)] = (item, 0.0)

        def report(frac: float, msg: str = "") -> None:
            self.running[id(item)] = (item, min(1.0, max(0.0, float(frac or 0.0))))
            now = self.clock()
            spent, left = max(0.0, now - self.t0), self.remaining(now)
            where = f" (phase {self.phases.index(item['phase']) + 1} of {len(self.phases)})" \
                if item["phase"] in self.phases else ""
            text = f"{item['phase']}{where}: {item['what']}" + (f" — {msg}" if msg else "")
            self.progress(spent / (spent + left) if spent + left > 0 else 0.0, text)

        report(0.0)
        return report

    def finish(self, item: dict) -> None:
        self.done_s += item["est_s"]
        self.running.pop(id(item), None)


def _train_estimate(method: str, config: dict, bb_name: str, memory) -> float:
    est = estimate(method, config, bb_name, len(memory.split_samples("train")), len(memory))
    if not est.get("measured"):
        return UNMEASURED_TRAIN_S
    return float(est.get("converge_s") or 1.0)


# --- decoding cost ------------------------------------------------------------------------------------------------
def time_decode(backbone, sources: list[str], row: Row, prompt: Prompt, max_new_tokens: int,
                should_stop: Callable[[], bool], decode: Callable = decode_batch) -> dict:
    """Seconds per generated token of ``row`` decoded alone (greedy) on ``sources``, one sentence at a time."""
    secs, tokens = 0.0, 0
    for s in sources:
        if should_stop():
            raise Cancelled()
        t0 = time.perf_counter()
        for comp in decode(backbone, [s], [row], prompt, max_new_tokens=max_new_tokens, trace=False):
            tokens += sum(len(r.tokens) for r in comp.rows)
        secs += time.perf_counter() - t0
    return {"seconds": round(secs, 3), "tokens": tokens, "s_per_token": secs / max(tokens, 1)}


def decoding_seconds(s_per_sentence: float, methods: list[str], n_tune: int, n_report: int, cost_sentences: int,
                     calibrate_seconds: float | None = None) -> dict:
    """The ETA of a rank's decoding phases from the seconds the base model takes to decode one sentence alone:
    ``{"decode_speed", "calibration": {method: s} (the interpolating ones: every tuning sample, capped by a time
    budget only when one is given), "evaluation", "decode_cost": {method: s}}`` — the rank's own plan and the
    studio's estimate before it starts."""
    budget = calibrate.DEFAULT_SECONDS if calibrate_seconds is None else calibrate_seconds
    return {"decode_speed": max(1, cost_sentences) * s_per_sentence,
            "calibration": {m: min(float("inf") if budget is None else budget,
                                   CALIBRATION_SENTENCE_COST * n_tune * s_per_sentence)
                            for m in methods if get_method(m).interpolates},
            # every row of a batch decodes, but rows that agree share the forward pass
            "evaluation": n_report * s_per_sentence * (1 + 0.5 * len(methods)),
            # each method beside the base, sentence by sentence (``decode_cost``)
            "decode_cost": {m: cost_sentences * s_per_sentence * 2.2 for m in methods}}


def decode_cost(backbone, sources: list[str], row: Row, prompt: Prompt, max_new_tokens: int,
                should_stop: Callable[[], bool], decode: Callable = decode_batch) -> float:
    """``row``'s seconds per generated token over the base model's, each decoding ``sources`` alone, the two taking
    turns sentence by sentence: the base is timed beside the method, not once at another moment of a long run (a
    base timed at the rank's start made every method look dearer: BENCHMARKS.md, "Ranking every method", row "the
    cost column, timed in turns with the base")."""
    secs, tokens = {"base": 0.0, "row": 0.0}, {"base": 0, "row": 0}
    for s in sources:
        for key, r in (("base", Row("base")), ("row", row)):
            t = time_decode(backbone, [s], r, prompt, max_new_tokens, should_stop, decode)
            secs[key] += t["seconds"]
            tokens[key] += t["tokens"]
    per = {k: secs[k] / max(tokens[k], 1) for k in secs}
    return per["row"] / max(per["base"], 1e-12)


# --- the verdict --------------------------------------------------------------------------------------------------
def p_text(p: float | None, resamples: int = 1000) -> str:
    if p is None:
        return "p n/a"
    if p < 1 / max(resamples, 1):
        return f"p < {1 / max(resamples, 1):g}"
    if p < 0.01:
        return "p < 0.01"
    return f"p = {p:.2f}"


def _names(titles: list[str]) -> str:
    return titles[0] if len(titles) == 1 else ", ".join(titles[:-1]) + " and " + titles[-1]


def holm_adjusted(rows: list[dict], metric: str = "chrf") -> dict[str, tuple[float | None, float | None]]:
    """Per method (not the base model): ``(p that it beats the base, p that it loses to it)`` in ``metric``, each
    Holm-adjusted (``eval.metrics.holm``) over the methods compared with the base model. The first from the one-sided
    paired-bootstrap p (``p_<metric>``: the share of resamples where the method does not score above the base), the
    second from its complement (the share where it scores above it); a row without a p gets None."""
    others = [r for r in rows if r["method"] != "base"]
    raw = [r.get(f"p_{metric}") if r.get(f"{metric}_delta") is not None else None for r in others]
    up = holm(raw)
    down = holm([None if p is None else 1.0 - float(p) for p in raw])
    return {r["method"]: (u, d) for r, u, d in zip(others, up, down)}


def verdict(rows: list[dict], n: int, source: str = "held-out", metric: str = "chrf", resamples: int = 1000) -> dict:
    """One line a user can act on, from the leaderboard's rows: which method is best on these ``n`` samples (the
    largest gain in ``metric`` over the base model whose one-sided p, Holm-adjusted for the number of methods
    compared (``holm_adjusted``), is below ``ALPHA``), which are level with the base model and which are worse (the
    same, the other way). ``{"text", "best", "better", "level", "worse"}`` (method names)."""
    label = {"chrf": "chrF", "sacrebleu": "sacreBLEU"}[metric]
    others = [r for r in rows if r["method"] != "base" and r.get(f"{metric}_delta") is not None]
    adj = holm_adjusted(rows, metric)
    better = sorted([r for r in others if adj[r["method"]][0] < ALPHA and r[f"{metric}_delta"] > 0],
                    key=lambda r: -r[f"{metric}_delta"])
    worse = [r for r in others if adj[r["method"]][1] < ALPHA and r[f"{metric}_delta"] < 0]
    level = [r for r in others if r not in better and r not in worse]
    where = f"On your {n} {'held-out samples' if source == 'held-out' else 'test pairs'}"
    if better:
        b = better[0]
        text = f"{where} the best method is {b['title']}: {b[f'{metric}_delta']:+.1f} {label} " \
               f"({p_text(adj[b['method']][0], resamples)}, Holm-adjusted for {len(others)} methods)"
        if len(better) > 1:
            text += f"; {_names([r['title'] for r in better[1:]])} also beat{'s' if len(better) == 2 else ''} the " \
                    f"base model"
    elif others:
        text = f"{where} no method beats the base model in {label} (Holm-adjusted p < {ALPHA:g})"
    else:
        text = f"{where}: no method to compare with the base model"
    if level:
        text += f"; {_names([r['title'] for r in level])} {'is' if len(level) == 1 else 'are'} level with the base " \
                f"model"
    if worse:
        text += f"; {_names([r['title'] for r in worse])} {'is' if len(worse) == 1 else 'are'} worse than the base " \
                f"model"
    split = disagreements(rows)
    if split:
        text += "; chrF and sacreBLEU disagree in sign for " + _names(
            [f"{r['title']} ({r['chrf_delta']:+.1f} chrF, {r['sacrebleu_delta']:+.1f} sacreBLEU)" for r in split])
    return {"text": text + ".", "best": better[0]["method"] if better else None,
            "better": [r["method"] for r in better], "level": [r["method"] for r in level],
            "worse": [r["method"] for r in worse], "disagree": [r["method"] for r in split]}


def disagreements(rows: list[dict]) -> list[dict]:
    """The methods whose difference to the base model has one sign in chrF and the other in sacreBLEU."""
    return [r for r in rows if r["method"] != "base" and isinstance(r.get("chrf_delta"), (int, float))
            and isinstance(r.get("sacrebleu_delta"), (int, float)) and r["chrf_delta"] * r["sacrebleu_delta"] < 0]


# The leaderboard's one order (the table's rows, its ★ and the verdict follow it): the methods the verdict says beat
# the base model first, largest gain first; then every other row, the base model's included, by chrF.
ORDER_RULE = ("Order: first the methods the verdict finds better than the base model, largest Δ chrF first; then the "
              "others and the base model by chrF. ★ marks row 1 when it beats the base model.")


def ordered(rows: list[dict], better: list[str]) -> list[dict]:
    """``rows`` in the leaderboard's order (``ORDER_RULE``; ``better``: the verdict's, best first), ranks 1…n."""
    first = {m: i for i, m in enumerate(better)}
    out = sorted(rows, key=lambda r: (0, first[r["method"]], 0.0) if r["method"] in first else
                 (1, -(r.get("chrf") or 0.0), -(r.get("sacrebleu") or 0.0)))
    for i, r in enumerate(out, 1):
        r["rank"] = i
    return out


def pareto(rows: list[dict], cost_key: str, metric: str = "chrf") -> set[str]:
    """The methods no other method beats on both ``metric`` (higher) and ``cost_key`` (lower) at once."""
    pts = [(r["method"], r.get(metric), r.get(cost_key)) for r in rows
           if isinstance(r.get(metric), (int, float)) and isinstance(r.get(cost_key), (int, float))]
    front = set()
    for m, q, c in pts:
        if not any((q2 >= q and c2 <= c) and (q2 > q or c2 < c) for _, q2, c2 in pts):
            front.add(m)
    return front


# --- ranking ------------------------------------------------------------------------------------------------------
def rank(backbone, memory, *, catalog: Catalog, owner: str = LOCAL_OWNER, methods: list[str] | None = None,
         configs: dict[str, dict] | None = None, test_pairs: list[tuple[str, str]] | None = None,
         test_name: str | None = None, n_tune: int | None = None, max_new_tokens: int = 96,
         batch_sources: int = 4, bootstrap: int = 1000, cost_sentences: int = COST_SENTENCES,
         calibrate_seconds: float | None = None, progress: Progress = _noop,
         should_stop: Callable[[], bool] = lambda: False, log: Callable[[str], None] = _noop,
         on_metric: Callable[[dict], None] | None = None, trainer=None,
         s_per_sentence: float | None = None) -> dict:
    """Train (or reuse), calibrate, evaluate and rank ``methods`` (default: every registered one) on ``memory``.

    ``configs``: training overrides per method (default: each method's defaults — what the studio ships); a plug-in
    of the owner's already trained on this memory with the same complete config is reused, not trained again.
    ``test_pairs`` (source, reference): report on these instead of the held-out report part. ``n_tune``: held-out
    samples for calibration (default ``eval.calibrate``'s). ``calibrate_seconds``: a bound per method.
    ``trainer``: trains the methods it ``runs`` all at once on workers (``studio.ray_executor.RankTrainer``, see
    ``IN_PROCESS``); the others train here first. Calibration and evaluation stay on ``backbone``.
    ``s_per_sentence``: the base model's seconds per sentence the plan of the decoding phases starts from (the
    studio's figure for this kind of machine, as in its estimate before the run; ``Plan`` then follows the measured
    pace); None: planned from the decode-speed phase's measurement.
    Returns the leaderboard (see the module docstring)."""
    t_start = time.time()
    task = memory.task or "translation"
    names = wanted_methods(methods)
    configs = configs or {}
    data = split(memory, test_pairs, n_tune)
    report, info = data["report"], data["info"]
    info["report_name"] = test_name if test_pairs is not None else "held-out report part"
    if info.get("warning"):
        log(f"Warning: {info['warning']}")
    log(f"Ranking {len(names)} method(s) + the base model on {info['report']} {info['report_source']} sentences; "
        f"{info['tune']} held-out samples tune the interpolating methods.")
    prompt = memory_prompt(memory, backbone, task)
    plan = Plan(progress)
    cost_src = [s for s, _ in report[:max(0, cost_sentences)]]
    interp = [m for m in names if get_method(m).interpolates]
    plan.phases = ["decode speed", "training", *(["calibration"] if interp else []), "evaluation",
                   *(["decode cost"] if cost_src else [])]
    n_probe = max(1, len(cost_src))
    probe = plan.add("decode speed", f"the base model on {n_probe} sentence(s)", (s_per_sentence or 2.0) * n_probe)
    wanted = {m: make_config(m, configs.get(m) or {}).to_dict() for m in names}
    reuse = {m: find_trained(catalog, owner, memory.id, m, wanted[m], backbone.fingerprint) for m in names}
    remote = [m for m in names if trainer is not None and reuse[m] is None and trainer.runs(m)]
    # trainings side by side: their estimates share the workers (the phase lasts about as long as its slowest)
    share = 1.0 / max(1, min(len(remote), trainer.slots() if trainer is not None else 1))
    train_items = {m: plan.add("training", get_method(m).title, 1.0 if reuse[m] else
                               _train_estimate(m, configs.get(m) or {}, backbone.name, memory)
                               * (share if m in remote else 1.0)) for m in names}
    phases = {"decode_speed": 0.0, "training": 0.0, "calibration": 0.0, "evaluation": 0.0, "decode_cost": 0.0}

    def plan_decoding(spr: float) -> tuple[dict, dict, dict]:
        eta = decoding_seconds(spr, names, info["tune"], info["report"], len(cost_src), calibrate_seconds)
        return ({m: plan.add("calibration", get_method(m).title, eta["calibration"][m]) for m in interp},
                plan.add("evaluation", f"{len(names) + 1} rows on {info['report']} sentences", eta["evaluation"]),
                {m: plan.add("decode cost", get_method(m).title, eta["decode_cost"][m]) for m in names}
                if cost_src else {})

    if s_per_sentence is not None:
        cal_items, eval_item, cost_items = plan_decoding(s_per_sentence)

    # 1. decode speed: the base model alone (the plan's first measured pace; the decoding phases' plan without
    # ``s_per_sentence``)
    t0 = time.time()
    rep = plan.start(probe)
    base_cost = time_decode(backbone, cost_src or [report[0][0]], Row("base"), prompt, max_new_tokens, should_stop)
    rep(1.0)
    plan.finish(probe)
    phases["decode_speed"] = round(time.time() - t0, 2)
    log(f"phase decode speed: {phases['decode_speed']} s wall ({base_cost['seconds'] / n_probe:.2f} s a sentence)")
    if s_per_sentence is None:
        cal_items, eval_item, cost_items = plan_decoding(base_cost["seconds"] / n_probe)

    # 2. training: here one method after another, then the trainer's all at once on its workers
    t0 = time.time()
    plugins, rows_out = {}, {}
    label = f"{memory.meta.get('name', memory.id)} (ranking)"

    def record(m: str, plugin, prow: dict, trained_now: bool) -> None:
        cls = get_method(m)
        metrics = json.loads(prow["metrics"]) if isinstance(prow.get("metrics"), str) else (prow.get("metrics") or {})
        tinfo = metrics.get("train_info") or {}
        plugins[m] = plugin
        rows_out[m] = {"method": m, "title": cls.title, "level": cls.level, "plugin_id": prow["id"],
                       "reused": not trained_now, "training_seconds": tinfo.get("seconds"),
                       "trainable_parameters": int(prow.get("params") or plugin.trainable_parameters()),
                       "config": wanted[m], "trained_on": tinfo.get("trained_on") or "here"}

    for m in names:
        if m in remote:
            continue
        if should_stop():
            raise Cancelled()
        item, cls = train_items[m], get_method(m)
        rep = plan.start(item)
        if reuse[m] is not None:
            log(f"{cls.title}: reusing plug-in {reuse[m]['id']} (same settings, same memory)")
            record(m, open_plugin(reuse[m]["path"], backbone), reuse[m], False)
        else:
            log(f"{cls.title}: training with its defaults"
                + (f" (overrides {json.dumps(configs[m])})" if configs.get(m) else ""))
            plugin, prow = train_plugin(backbone, memory, m, configs.get(m) or {}, catalog=catalog.owned_by(owner),
                                        name=f"{cls.title} on {label}", progress=rep, should_stop=should_stop,
                                        on_metric=on_metric)
            record(m, plugin, prow, True)
        rep(1.0)
        plan.finish(item)
    if remote:
        if should_stop():
            raise Cancelled()
        log(f"{_names([get_method(m).title for m in remote])}: training at once on {trainer.slots()} worker(s)"
            + "".join(f"; {m} overrides {json.dumps(configs[m])}" for m in remote if configs.get(m)))
        reps = {m: plan.start(train_items[m]) for m in remote}
        prows = trainer.train_many(backbone, memory, [{"method": m, "config": configs.get(m) or {},
                                                       "name": f"{get_method(m).title} on {label}"} for m in remote],
                                   catalog=catalog, owner=owner, progress=lambda m, f, msg="": reps[m](f, msg),
                                   should_stop=should_stop)
        for m in remote:
            record(m, open_plugin(prows[m]["path"], backbone), prows[m], True)
            reps[m](1.0)
            plan.finish(train_items[m])
    phases["training"] = round(time.time() - t0, 2)
    log(f"phase training: {phases['training']} s wall")

    # 3. calibration of the interpolating methods on the tuning part only
    t0 = time.time()
    tuned: dict[str, dict] = {}
    for m in interp:
        if should_stop():
            raise Cancelled()
        item = cal_items[m]
        rep = plan.start(item)
        cal, note = _calibrated(backbone, plugins[m], memory, task, data["tune"], calibrate_seconds, rep,
                                should_stop)
        if cal is not None:
            tuned[m] = cal
            log(f"{get_method(m).title}: tuned on {cal.get('n')} held-out samples → {json.dumps(cal['settings'])}")
        rows_out[m]["calibration"] = ({"n": cal.get("n"), "seconds": cal.get("seconds"), "settings": cal["settings"],
                                       "reused": bool(cal.get("_reused")), "evidence": cal.get("evidence")}
                                      if cal is not None else None)
        if cal is not None and cal.get("evidence"):
            rows_out[m]["calibration_evidence"] = cal["evidence"]["text"]
            log(f"{get_method(m).title}: {cal['evidence']['text']}")
        if note:
            rows_out[m]["calibration_note"] = note
            log(f"{get_method(m).title}: {note}")
        rep(1.0)
        plan.finish(item)
    phases["calibration"] = round(time.time() - t0, 2)
    log(f"phase calibration: {phases['calibration']} s wall")

    # 4. evaluation of every row on the report sentences (none of them tuned anything)
    t0 = time.time()
    rows = [Row("base")] + [Row(m, plugins[m], row_settings(plugins[m], task, backbone.name,
                                                            (tuned.get(m) or {}).get("settings")))
                            for m in names]
    rep = plan.start(eval_item)
    # a test file: the held-out report part is scored too, for the held-out leaderboard beside the test's
    held_report = data["heldout_report"] if test_pairs is not None and \
        len(data["heldout_report"]) >= MIN_BOOTSTRAP_N else []
    share = len(report) / (len(report) + len(held_report))
    res = evaluate(backbone, report, rows, prompt, task, batch_sources=batch_sources, max_new_tokens=max_new_tokens,
                   progress=lambda f, m="": rep(share * f, m), should_stop=should_stop, bootstrap=bootstrap)
    res_held = evaluate(backbone, held_report, rows, prompt, task, batch_sources=batch_sources,
                        max_new_tokens=max_new_tokens, progress=lambda f, m="": rep(share + (1 - share) * f,
                                                                                     "held-out part: " + m),
                        should_stop=should_stop, bootstrap=bootstrap) if held_report else None
    plan.finish(eval_item)
    phases["evaluation"] = round(time.time() - t0, 2)
    log(f"phase evaluation: {phases['evaluation']} s wall")

    # 5. decode cost per token, each method alone, relative to the base model's
    t0 = time.time()
    for m in names:
        if m not in cost_items:
            break
        item = cost_items[m]
        rep = plan.start(item)
        cost = decode_cost(backbone, cost_src, rows[1 + names.index(m)], prompt, max_new_tokens, should_stop)
        rows_out[m]["decode_cost"] = round(cost, 2)
        rep(1.0)
        plan.finish(item)
    phases["decode_cost"] = round(time.time() - t0, 2)
    log(f"phase decode cost: {phases['decode_cost']} s wall")
    phases["total"] = round(time.time() - t_start, 2)

    board = _leaderboard_rows(res, rows_out, tuned)
    v = verdict(board, info["report"], info["report_source"], resamples=bootstrap)
    board = ordered(board, v["better"])
    for r in board:
        r["best"] = r["method"] == v["best"]
    extra = {}
    if test_pairs is not None:  # the held-out leaderboard beside the test's, and how far the test is from the memory
        extra["transfer"] = memory_transfer(memory, [s for s, _ in report], [s for s, _ in data["heldout_report"]])
        log(extra["transfer"]["text"])
        if res_held is not None:
            hboard = _leaderboard_rows(res_held, rows_out, tuned)
            hv = verdict(hboard, len(held_report), "held-out", resamples=bootstrap)
            hboard = ordered(hboard, hv["better"])
            for r in hboard:
                r["best"] = r["method"] == hv["best"]
            extra["heldout"] = {"data": {"report": len(held_report), "report_source": "held-out"}, "methods": hboard,
                                "verdict": hv["text"], "best": hv["best"], "better": hv["better"],
                                "level": hv["level"], "worse": hv["worse"]}
    progress(1.0, f"done: {v['text']}")
    return {**extra, "version": LEADERBOARD_VERSION, "task": task, "backbone": backbone.name,
            "memory": {"id": memory.id, "name": memory.meta.get("name", memory.id),
                       "train_samples": len(memory.split_samples("train")), "entries": len(memory)},
            "data": info, "methods": board, "verdict": v["text"], "best": v["best"],
            "better": v["better"], "level": v["level"], "worse": v["worse"], "disagree": v["disagree"],
            "order": ORDER_RULE, "pareto": {"training_seconds": sorted(pareto(board, "training_seconds")),
                       "trainable_parameters": sorted(pareto(board, "trainable_parameters"))},
            "phases": phases, "workers": trainer.describe() if trainer is not None else IN_PROCESS,
            "decode": res.get("decode"), "signatures": res.get("signatures") or signatures(),
            "bootstrap": bootstrap, "alpha": ALPHA, "created": time.time()}


def _calibrated(backbone, plugin, memory, task, tune: list[dict], max_seconds, progress, should_stop):
    """``(calibration, note)``: the plug-in's stored calibration when it was made on exactly these tuning samples
    (so on none of the report part's, and on all of the tuning part) of this memory, by the current rule
    (``load_calibration`` checks the rule, the weights and ``plugin_calibration`` the backbone), else a new one
    (``eval.calibrate.calibrate``); ``(None, why)`` when the memory has too few samples."""
    folder = plugin.plugin_path
    old = calibrate.load_calibration(folder) if folder is not None else None
    ids = {s.get("index") for s in tune}
    if old and old.get("memory_id") == memory.id and old.get("backbone") == plugin.backbone_name \
            and old.get("sample_ids") and set(old["sample_ids"]) == ids:
        return {**old, "_reused": True}, None
    try:
        cal = calibrate.calibrate(backbone, plugin, memory, task=task, samples=tune, max_seconds=max_seconds,
                                  progress=progress, should_stop=should_stop)
    except UserError as e:
        return None, f"not calibrated: {e} The global defaults are used."
    if cal is None:
        return None, None
    return cal, None


def _leaderboard_rows(res: dict, rows_out: dict, tuned: dict) -> list[dict]:
    keep = ("chrf", "sacrebleu", "chrf_ci95", "sacrebleu_ci95", "chrf_delta", "p_chrf", "sacrebleu_delta",
            "p_sacrebleu", "settings", "n")
    board = []
    for m in res["methods"]:
        scores = {k: m.get(k) for k in keep}
        if m["label"] == "base":
            board.append({"method": "base", "title": "Base model", "level": "none", "plugin_id": None,
                          "reused": None, "training_seconds": 0.0, "trainable_parameters": 0, "decode_cost": 1.0,
                          "tuned": None, **scores})
        else:
            out = rows_out[m["label"]]
            board.append({**out, "tuned": (tuned.get(m["label"]) or {}).get("settings"),
                          "decode_cost": out.get("decode_cost"), **scores})
    for k in ("chrf", "sacrebleu"):  # the p beside the raw one, corrected for the number of methods compared
        for r in board:
            if r["method"] != "base":
                r[f"p_{k}_holm"], r[f"p_{k}_worse_holm"] = holm_adjusted(board, k)[r["method"]]
    board.sort(key=lambda r: (-(r.get("chrf") or 0.0), -(r.get("sacrebleu") or 0.0)))
    for i, r in enumerate(board, 1):
        r["rank"] = i
    return board


def _p3(p) -> str:
    return "n/a" if p is None else f"{p:.3f}"


def format_leaderboard(board: dict) -> str:
    """The leaderboard as a text table (the CLI's), then the verdict and the phases' wall times."""
    head = ["#", "method", "chrF [95% CI]", "sacreBLEU [95% CI]", "ΔchrF (p; Holm p)", "ΔBLEU (p; Holm p)", "train s",
            "params",
            "cost/tok", "tuned"]
    lines = []
    for r in board["methods"]:
        ci = lambda k: f"[{r[k][0]:.1f}, {r[k][1]:.1f}]" if r.get(k) else ""  # noqa: E731
        d = lambda k: "" if r.get(f"{k}_delta") is None else f"{r[f'{k}_delta']:+.2f} ({r[f'p_{k}']:.3f}; " \
            f"{_p3(r.get(f'p_{k}_holm'))})"  # noqa: E731
        lines.append([str(r["rank"]), r["method"] + (" ★" if r.get("best") else ""),
                      f"{r['chrf']:.2f} {ci('chrf_ci95')}", f"{r['sacrebleu']:.2f} {ci('sacrebleu_ci95')}",
                      d("chrf"), d("sacrebleu"), f"{r.get('training_seconds') or 0:.0f}",
                      f"{r.get('trainable_parameters') or 0:,}",
                      "" if r.get("decode_cost") is None else f"{r['decode_cost']:.2f}×",
                      json.dumps(r["tuned"]) if r.get("tuned") else ""])
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    fmt = lambda x: " | ".join(c.ljust(w) for c, w in zip(x, widths))  # noqa: E731
    d = board["data"]
    out = [fmt(head), "-+-".join("-" * w for w in widths), *map(fmt, lines), "", board["verdict"],
           f"Report: {d['report']} {d['report_source']} sentences; tuning: {d['tune']} held-out samples. p: one-sided "
           f"paired bootstrap against the base model; Holm p: adjusted for the {len(board['methods']) - 1} methods "
           f"compared (the verdict reads it).",
           *(f"Calibration of {r['title']}: {r['calibration_evidence']}." for r in board["methods"]
             if r.get("calibration_evidence")),
           "Wall time per phase (s): " + ", ".join(f"{k} {v}" for k, v in board["phases"].items())]
    w = board.get("workers") or IN_PROCESS
    if w.get("executor") != "inprocess":
        gpus = f", {w['gpus']} GPU(s)" if w.get("gpus") else ""
        out.append(f"Trained on {w['workers']} {w['executor'].capitalize()} worker(s) "
                   f"({w.get('address') or 'a local cluster'}{gpus}).")
    if board.get("heldout"):
        out += ["", f"Held-out report part ({board['heldout']['data']['report']} sentences) beside the test file:",
                side_by_side(board["heldout"], board), "Held-out: " + board["heldout"]["verdict"]]
    if board.get("transfer", {}).get("text"):
        out.append("Transfer check: " + board["transfer"]["text"])
    if d.get("warning"):
        out.append(f"Warning: {d['warning']}")
    return "\n".join(out)
