"""One small training loop for every plug-in: mini-batches over memory entries, Adam, an optional cosine
learning-rate schedule, early stopping on a seeded split of the memory's *training* samples (never on its held-out
samples, which the evaluation reports on), a step budget and a wall-clock budget, progress and cancellation. The
best weights (by early-stopping loss, called ``heldout_loss`` in the loop and its history) are restored at the end.

Early stopping evaluates every ``eval_every`` steps (0: once an epoch) and stops by one of two rules:
``stop_rule="best"`` after ``patience`` evaluations in a row without a new best; ``stop_rule="rising"`` (PEMA's
public code, ``train_rct_pd.py``: every 100 steps, "give up if the loss is increasing for 2 consecutive validation
steps") when an evaluation's loss is above each of the ``patience`` evaluations before it, counting only the
evaluations made during training (the code has no evaluation before its first step).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from ground.errors import Cancelled


@dataclass
class LoopSettings:
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    batch_size: int = 256
    max_epochs: int = 20
    patience: int = 2
    lr_schedule: str = "constant"  # "constant" (paper) | "cosine"
    max_minutes: float = 0.0       # 0: no wall-clock budget
    seed: int = 123
    eval_every: int = 0            # steps between held-out evaluations; 0: once an epoch
    warmup_steps: int = 0
    max_steps: int = 0             # optimizer steps of this run at most (0: none); evaluated once more at the last
    stop_rule: str = "best"        # "best" | "rising" (see the module docstring)


def loss_text(loss: float, parts: dict, best: float) -> str:
    """The training progress line's losses, each named: a method whose objective adds terms to the NLL (the
    memory adapter's dropout NLL and KL) says so and gives the NLL part, so that it is not read against the
    held-out loss, which early stopping watches."""
    nll = parts.get("nll")
    if nll is not None and abs(float(nll) - loss) > 1e-6:
        train = f"training objective {loss:.4f} on this batch (its NLL part {float(nll):.4f})"
    else:
        train = f"training loss {loss:.4f} on this batch"
    return f"{train} · best held-out loss {best:.4f} (early stopping)"


def run_training(module: torch.nn.Module, params: Iterable[torch.nn.Parameter], n_train: int,
                 train_loss: Callable[[np.ndarray], tuple[torch.Tensor, dict]],
                 heldout_loss: Callable[[], float], s: LoopSettings, phase: str,
                 progress: Callable[[float, str], None], should_stop: Callable[[], bool],
                 history: list[dict], progress_span: tuple[float, float] = (0.0, 1.0),
                 resume: dict | None = None, state_out: dict | None = None) -> dict:
    """Train ``params`` by minimising ``train_loss(batch_indices)``; early-stop on ``heldout_loss()``.

    Returns a summary: best held-out loss, epochs (and ``max_epochs``), steps, seconds, tokens/s, and
    ``stopped_by``: "early_stopping" (converged by the early-stopping rule), "max_epochs" (ran every epoch),
    "max_steps" (the step budget ``max_steps`` ran out) or "time_budget" (``max_minutes`` ran out first: the
    plug-in may be under-trained).

    Continuing a run: ``state_out`` (a dict) receives the optimizer's state and the loop's counters at the end
    (:func:`optimizer_state`); passed back as ``resume`` (with the same parameters, in the same order), training
    goes on from there — Adam's moments, the step count (so the learning-rate schedule continues), the epochs
    done so far — for ``s.max_epochs`` more epochs at most. The weights to continue from are the module's own.
    """
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.Adam(params, lr=s.lr, betas=tuple(s.betas), eps=s.eps)
    rng = np.random.default_rng(s.seed)
    steps_per_epoch = max(1, math.ceil(n_train / s.batch_size))
    total_steps = steps_per_epoch * s.max_epochs
    if s.max_steps:
        total_steps = min(total_steps, s.max_steps)
    eval_every = s.eval_every or steps_per_epoch
    step0 = 0  # steps done before this run (continued training)
    if resume:
        step0 = int(resume.get("loop", {}).get("steps", 0))
        if resume.get("optimizer"):  # Adam's moments per parameter; the hyperparameters are this run's
            sd = opt.state_dict()
            sd["state"] = resume["optimizer"]["state"]
            opt.load_state_dict(sd)
        rng = np.random.default_rng([s.seed, step0])  # another shuffle than the first run's epochs
        total_steps += step0
    if s.lr_schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + step0 + 1) / max(1, s.warmup_steps))
                                                  * 0.5 * (1 + math.cos(math.pi * min(t + step0, total_steps)
                                                                        / total_steps)))
    else:
        sched = None
    lo, hi = progress_span
    t0 = time.time()
    module.eval()
    progress(lo, f"{phase}: evaluating the early-stopping loss before training")
    best = heldout_loss()
    best_state = copy.deepcopy(module.state_dict())
    history.append({"phase": phase, "step": 0, "epoch": 0.0, "heldout_loss": best, "time": 0.0})
    bad = 0
    during: list[float] = []  # the evaluations made during training ("rising" compares with the last ones)
    step = 0
    reason = "max_epochs"
    seen = 0
    done = False
    for epoch in range(s.max_epochs):
        order = rng.permutation(n_train)
        module.train()
        for b0 in range(0, n_train, s.batch_size):
            if should_stop():
                raise Cancelled()
            idx = np.sort(order[b0:b0 + s.batch_size])  # sorted: friendlier reads from a memory-mapped file
            loss, parts = train_loss(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sched:
                sched.step()
            step += 1
            seen += len(idx)
            if step % 10 == 0 or step == 1:
                history.append({"phase": phase, "step": step, "epoch": step / steps_per_epoch,
                                "loss": float(loss.detach()), **{k: float(v) for k, v in parts.items()},
                                "time": time.time() - t0})
            frac = min(1.0, step / max(1, total_steps - step0))
            if s.max_minutes:  # with a budget, the run ends at whichever comes first: the epochs or the time
                frac = max(frac, min(1.0, (time.time() - t0) / (60 * s.max_minutes)))
            progress(lo + (hi - lo) * frac, f"{phase}: epoch {epoch + 1}/{s.max_epochs} step {step} · "
                                             + loss_text(float(loss.detach()), parts, best))
            out_of_time = bool(s.max_minutes) and time.time() - t0 > 60 * s.max_minutes
            out_of_steps = bool(s.max_steps) and step >= s.max_steps
            # evaluate on schedule, and once more when a budget ends, so the last steps are not thrown away
            if step % eval_every == 0 or out_of_time or out_of_steps:
                module.eval()
                progress(lo + (hi - lo) * frac, f"{phase}: evaluating the early-stopping loss (step {step})")
                h = heldout_loss()
                module.train()
                history.append({"phase": phase, "step": step, "epoch": step / steps_per_epoch,
                                "heldout_loss": h, "time": time.time() - t0})
                rising = s.stop_rule == "rising" and len(during) >= s.patience \
                    and all(h > p for p in during[len(during) - s.patience:])
                during.append(h)
                if h < best - 1e-6:
                    best, bad = h, 0
                    best_state = copy.deepcopy(module.state_dict())
                else:
                    bad += 1
                if rising or (s.stop_rule != "rising" and bad >= s.patience):
                    reason, done = "early_stopping", True
            if out_of_time and not done:
                reason, done = "time_budget", True
            if out_of_steps and not done:
                reason, done = "max_steps", True
            if done:
                break
        if done:
            break
    if state_out is not None:  # the optimizer as it ended (before the best weights are restored)
        state_out.update(optimizer=opt.state_dict(),
                         loop={"steps": step0 + step, "epochs": round((step0 + step) / steps_per_epoch, 4)})
    module.load_state_dict(best_state)
    module.eval()
    secs = time.time() - t0
    epochs_before = round(step0 / steps_per_epoch, 2)
    return {"phase": phase, "best_heldout_loss": best, "epochs": round(step / steps_per_epoch, 2), "steps": step,
            "max_epochs": s.max_epochs, "seconds": round(secs, 2),
            "entries_per_second": round(seen / max(secs, 1e-9), 1), "stopped_by": reason,
            **({"continued_from_epochs": epochs_before,
                "total_epochs": round((step0 + step) / steps_per_epoch, 2)} if resume else {})}


def optimizer_tensors(state: dict) -> dict[str, torch.Tensor]:
    """A ``run_training`` ``state_out`` (one phase: ``{"optimizer", "loop"}``, or several keyed by phase) as flat
    tensors for safetensors: ``<phase>/state/<i>/<name>`` and ``<phase>/loop/<counter>``."""
    out: dict[str, torch.Tensor] = {}
    phases = state if "optimizer" not in state else {"": state}
    for phase, st in phases.items():
        pre = f"{phase}/" if phase else ""
        for i, ps in st["optimizer"]["state"].items():
            for k, v in ps.items():
                out[f"{pre}state/{i}/{k}"] = (v if isinstance(v, torch.Tensor) else torch.tensor(v)).detach().cpu() \
                    .contiguous()
        for k, v in st.get("loop", {}).items():
            out[f"{pre}loop/{k}"] = torch.tensor(float(v), dtype=torch.float64)
    return out


def optimizer_from_tensors(tensors: dict[str, torch.Tensor]) -> dict:
    """The inverse of :func:`optimizer_tensors`: ``{phase: {"optimizer": {"state"}, "loop"}}`` (phase "" for a
    single one), each ready for ``run_training(resume=…)`` (Adam: ``step``, ``exp_avg``, ``exp_avg_sq`` per
    parameter index)."""
    phases: dict[str, dict] = {}
    for key, v in tensors.items():
        parts = key.split("/")
        phase = parts[0] if parts[0] not in ("state", "loop") else ""
        rest = parts[1:] if phase else parts
        st = phases.setdefault(phase, {"optimizer": {"state": {}}, "loop": {}})
        if rest[0] == "state":
            st["optimizer"]["state"].setdefault(int(rest[1]), {})[rest[2]] = v
        else:
            st["loop"][rest[1]] = int(v) if rest[1] == "steps" else float(v)
    return phases


class BudgetGuard:
    """Keeps the progress of a run that the wall-clock budget would cut off between two held-out evaluations.

    For in-network plug-ins a training step on the real backbone can take a minute on a busy CPU; running
    one more step past the budget and then evaluating (what ``run_training`` does) overshoots by a whole step. The
    guard wraps the held-out loss (mirroring the best state) and, when the *next* step would cross the budget,
    evaluates at the start of that step; ``restore()`` loads the best state it saw when that beats run_training's.
    """

    def __init__(self, module: torch.nn.Module, heldout: Callable[[], float], max_minutes: float,
                 history: list[dict], phase: str):
        self.module, self._heldout, self.budget = module, heldout, 60.0 * max_minutes
        self.history, self.phase = history, phase
        self.best, self.state = math.inf, None
        self.t0: float | None = None
        self.last: float | None = None
        self.step_s, self.steps, self.evaluated_at, self.extra_evals = 0.0, 0, -1, 0
        self.step_times: list[float] = []

    def heldout_loss(self) -> float:
        if self.t0 is None:
            self.t0 = time.time()
        h = self._heldout()
        if h < self.best - 1e-6:
            self.best = h
            self.state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        self.evaluated_at = self.steps
        return h

    def before_step(self) -> None:
        now = time.time()
        if self.last is not None:
            self.step_s = now - self.last
            self.step_times.append(self.step_s)
        self.last = now
        if (self.budget and self.t0 is not None and self.steps > self.evaluated_at
                and now - self.t0 + self.step_s > self.budget):
            was_training = self.module.training
            self.module.eval()
            h = self.heldout_loss()
            self.module.train(was_training)
            self.extra_evals += 1
            self.history.append({"phase": self.phase, "step": self.steps, "heldout_loss": h,
                                 "time": time.time() - self.t0, "before_budget": True})
            self.last = time.time()
        self.steps += 1

    def mean_step(self) -> float:
        """Median seconds per training step (robust to the evaluation steps)."""
        return float(np.median(self.step_times)) if self.step_times else 0.0

    def restore(self, summary: dict) -> dict:
        if self.state is not None and self.best < summary.get("best_heldout_loss", math.inf) - 1e-9:
            self.module.load_state_dict(self.state)
            self.module.eval()
        return {**summary, "best_heldout_loss": min(self.best, summary.get("best_heldout_loss", math.inf)),
                "extra_evals": self.extra_evals}


def early_stopping_split(entry_sample: np.ndarray, frac: float = 0.1, seed: int = 123,
                         max_samples: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """Split a memory's *training* entries by sample into (entries to train on, entries to early-stop on): a seeded
    ``frac`` of the samples (at least one, at most ``max_samples``) with all their entries. The memory's held-out
    samples are never used for early stopping: they are what ``eval --memory`` and ``eval.likelihood --heldout``
    report. A memory with a single training sample cannot spare one: then both are all of its entries."""
    entry_sample = np.asarray(entry_sample)
    every = np.arange(len(entry_sample))
    samples = np.unique(entry_sample)
    if len(samples) < 2:
        return every, every
    k = min(max_samples, len(samples) - 1, max(1, int(round(len(samples) * frac))))
    stop = np.random.default_rng(seed).permutation(samples)[:k]
    held = np.isin(entry_sample, stop)
    return every[~held], every[held]


CANDIDATE_VOCABULARIES_KEPT = 4  # per backbone: (memory, top_k, contexts, seed) → the sorted token ids


def candidate_vocabulary(backbone, memory, top_k: int, contexts: int, seed: int,
                         include_heldout: bool = False,
                         progress: Callable[[float, str], None] | None = None) -> torch.Tensor:
    """The fast-softmax candidate vocabulary shared by every method that offers ``softmax="candidates"``: every token
    that occurs as a value of the memory's training entries, the backbone's stop tokens, and the LM's ``top_k`` tokens
    on ``contexts`` seeded sampled memory contexts (keys = f(c), training entries). Sorted token ids (long) on the
    backbone's device. A backbone keeps the last few it made: a memory's candidates are the same for every method
    that asks with the same settings (memories are immutable; the backbone is frozen).

    ``include_heldout`` (default False; no method uses it) would also add the held-out samples' target tokens. That
    leaks the evaluation split into the model (a token seen only in held-out targets becomes reachable): every
    method early-stops on a split of its training data instead (``early_stopping_split``,
    ``plugins.seqtrain.split_for_early_stopping``), whose targets are memory values already."""
    key = (str(getattr(memory, "path", "")), getattr(memory, "id", None), len(memory), top_k, contexts, seed,
           include_heldout)
    kept = backbone.__dict__.setdefault("_candidate_vocabularies", {})
    if key[1] is not None and key in kept:  # a rank trains four methods on the same memory and settings
        return kept[key].clone()
    toks = set(np.unique(np.asarray(memory.values)).tolist())
    if include_heldout and len(memory.heldout_values):
        toks |= set(np.unique(np.asarray(memory.heldout_values)).tolist())
    toks |= set(backbone.stop_ids)
    n = len(memory)
    if top_k and contexts and n:
        pick = np.sort(np.random.default_rng(seed).choice(n, size=min(n, contexts), replace=False))
        with torch.no_grad():
            for b0 in range(0, len(pick), 32):  # 32 rows × V float32 logits: ~34 MB on Gemma, not ~270 MB
                if progress is not None:
                    progress(b0 / len(pick), f"candidate vocabulary: the LM's top tokens on {b0}/{len(pick)} "
                                             f"memory contexts")
                fc = torch.from_numpy(np.asarray(memory.keys[pick[b0:b0 + 32]], dtype=np.float32))
                top = backbone.logits_from_fc(fc.to(backbone.device)).topk(top_k, dim=-1).indices
                toks |= set(top.flatten().tolist())
    out = torch.tensor(sorted(toks), dtype=torch.long, device=backbone.device)
    if key[1] is not None:
        while len(kept) >= CANDIDATE_VOCABULARIES_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = out.clone()
    return out
