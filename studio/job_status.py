"""How a job reads to its owner: its elapsed time and ETA (``job_timing``) and how a training ended
(``training_status``); the job table (``studio.job_service``), the plug-in lists and the Ray executor show them."""
from __future__ import annotations

import time

STOPPED_BY = {"time_budget": "stopped by time budget", "early_stopping": "converged (early stopping)",
              "max_epochs": "ran every epoch"}


def _fmt_epochs(x) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if isinstance(x, (int, float)) else "?"


def training_status(metrics: dict | None) -> dict:
    """How a plug-in's training ended, from its metrics (``run_training``'s summaries: one per phase, at the top
    level or under the phase's name). ``under_trained`` when a phase stopped on the time budget before its
    early-stopping rule or its epochs ended it. ``label``: one line for cards and lists, e.g. "stopped by time
    budget at 0.39 of 10 epochs — under-trained"."""
    metrics = {k: v for k, v in (metrics or {}).items() if k != "train_info"}  # train_info repeats them
    summaries = [metrics] if "stopped_by" in metrics else []
    summaries += [v for v in metrics.values() if isinstance(v, dict) and "stopped_by" in v]
    if not summaries:
        return {"stopped_by": None, "under_trained": False, "label": "ready"}
    pick = next((x for x in summaries if x.get("stopped_by") == "time_budget"), summaries[-1])
    why = pick.get("stopped_by")
    epochs = pick.get("total_epochs", pick.get("epochs"))
    of = f" of {pick['max_epochs'] + (pick.get('continued_from_epochs') or 0):g}" \
        if isinstance(pick.get("max_epochs"), (int, float)) else ""
    under = why == "time_budget"
    phase = f" ({pick['phase']} phase)" if under and len(summaries) > 1 and pick.get("phase") else ""
    if under:
        label = f"stopped by time budget at {_fmt_epochs(epochs)}{of} epochs{phase} — under-trained"
    elif why == "early_stopping":
        label = f"converged: early stopping at {_fmt_epochs(epochs)} epochs{phase}"
    elif why == "max_epochs":
        label = f"ready: ran all {_fmt_epochs(epochs)} epochs{phase}"
    else:
        label = f"ready ({why})"
    return {"stopped_by": why, "phase": pick.get("phase"), "epochs": epochs, "max_epochs": pick.get("max_epochs"),
            "under_trained": under, "label": label}


def job_timing(job: dict, now: float | None = None) -> dict:
    """``elapsed_s`` (running: since it started; queued: waiting since it was queued; finished: its run time)
    and ``eta_s`` (running jobs only, from the progress so far; None until there is enough progress to tell)."""
    now = time.time() if now is None else now
    started, finished = job.get("started"), job.get("finished")
    state, p = job.get("state"), float(job.get("progress") or 0.0)
    if state == "queued":
        return {"elapsed_s": max(0.0, now - (job.get("created") or now)), "eta_s": None}
    if not started:
        return {"elapsed_s": None, "eta_s": None}
    elapsed = max(0.0, (finished or now) - started)
    eta = None
    if state == "running" and p >= 0.01 and elapsed >= 2.0:
        eta = elapsed * (1.0 - p) / p
    return {"elapsed_s": round(elapsed, 1), "eta_s": None if eta is None else round(eta, 1)}
