"""The Studio's plug-ins: methods and their declared settings, training, continuing and calibration jobs, loading
through the plug-in cache, export and import — each plug-in for its owner."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from backbone.model import resolve_name
from eval.calibrate import (
    DEFAULT_TUNE,
    MIN_TUNE,
    TYPICAL_SECONDS,
    calibrate,
    describe_choice,
    split_heldout,
    tuning_count,
)
from ground.errors import Cancelled, UserError
from ground.jobs import JobContext
from ground.store import new_id
from offsite.client import NOT_OFFSITE
from plugins.api import make_config, method_table, open_memory, open_plugin, train_plugin
from plugins.estimate import estimate
from plugins.hub import check_package, export_plugin, import_plugin
from plugins.registry import available_methods, get_method
from plugins.settings import load_calibration, presets_table, start_record
from plugins.timing import minutes
from plugins.training import optimizer_from_tensors, optimizer_tensors
from studio.backbone_service import BackboneService
from studio.caches import LRU
from studio.context import StudioContext
from studio.downloads import Downloads
from studio.gate import BackboneGate
from studio.job_status import training_status
from studio.limits import check_number
from studio.memory_service import MemoryService
from studio.packages import unpack_zip, zip_folder

OPTIMIZER_FILE = "optimizer.safetensors"  # a resumable plug-in's optimizer state, next to its weights
# What "continue training" may change: how long it goes on, never the plug-in's shape.
CONTINUE_SETTINGS = ("max_minutes", "max_epochs", "max_epochs_joint", "patience", "lr")
def calibration_share(method: str, config: dict, backbone_name: str, memory) -> float:
    """The part of a training job's progress bar that training takes when calibration follows it (1.0: no
    calibration — the method does not interpolate, or its memory has too few held-out samples): from the training
    estimate and what a calibration typically takes."""
    cls = get_method(method)
    if not (cls.interpolates and cls.level == "output") or split_heldout(memory)[2]["tune"] < MIN_TUNE:
        return 1.0
    try:
        est = estimate(method, config, backbone_name, len(memory.split_samples("train")), len(memory))
    except UserError:
        est = {}
    train_s = float(est.get("converge_s") or 30.0)
    return max(0.05, min(0.95, train_s / (train_s + TYPICAL_SECONDS)))


def calibration_after_training(method: str, heldout_samples: int) -> dict | None:
    """The calibration a training job of ``method`` runs after training, on a memory of ``heldout_samples``
    held-out samples: ``{"samples", "seconds"}`` (its tuning part, at the typical pace of ``TYPICAL_SECONDS`` for
    ``DEFAULT_TUNE`` samples); None when none follows (the method does not interpolate, too few samples)."""
    cls = get_method(method)
    n = tuning_count(int(heldout_samples or 0))
    if not (cls.interpolates and cls.level == "output") or n < MIN_TUNE:
        return None
    return {"samples": n, "seconds": round(TYPICAL_SECONDS * n / DEFAULT_TUNE, 1)}


def with_calibration(est: dict, cal: dict | None) -> dict:
    """A training estimate with the calibration that follows training in the same job said after it (on a small
    memory it takes longer than the training itself)."""
    if not cal:
        return est
    return {**est, "calibration": cal,
            "text": f"{est['text']} Then its decode settings are tuned on {cal['samples']} held-out samples "
                    f"(≈ {minutes(cal['seconds'])})."}


# Declared ranges of a calibration's budgets (0: the defaults): a held-out split has at most a few thousand samples,
# and an hour of the shared CPU is already far more than the grid needs (BENCHMARKS.md,
# "Starts, presets and calibration, checked on WMT dev items", row "per-memory calibration").
CALIBRATE_MAX_SAMPLES = 5000
CALIBRATE_MAX_SECONDS = 3600.0


class PluginService:
    """Plug-ins: methods, start settings, training jobs, loading (cached), deleting, packages.

    Receives the context, the backbone service (training, loading, the offsite rule), its gate (training and
    calibrating hold it), the memories (what a plug-in is trained on), the loaded plug-in cache, the downloads
    folder (exported packages) and the optional Ray executor (trainings as Ray tasks)."""

    def __init__(self, ctx: StudioContext, backbone_svc: BackboneService, gate: BackboneGate,
                 memory_svc: MemoryService, plugin_cache: LRU, downloads: Downloads, executor=None):
        self.ctx = ctx
        self.backbone_svc = backbone_svc
        self.gate = gate
        self.memory_svc = memory_svc
        self.plugin_cache = plugin_cache
        self.downloads = downloads
        self.executor = executor

    @property
    def job_handlers(self) -> dict:
        """The job kinds this service submits, with their handlers (``JobQueue.handlers``)."""
        return {"train_plugin": self.job_train, "calibrate_plugin": self.job_calibrate}

    # --- plug-ins -----------------------------------------------------------------------------------------------
    def methods(self) -> list[dict]:
        """``plugins.api.method_table``, each with ``offsite`` (whether it works against a model owner's service)
        and, under a remote backbone, ``unavailable``: why an in-network method cannot be used."""
        out = []
        for m in method_table():
            m["offsite"] = m["level"] == "output"
            if self.backbone_svc.offsite() and not m["offsite"]:
                m["unavailable"] = NOT_OFFSITE.format(what=m["title"])
            # the training form's presets ({name: {"values", "about"}}, "default" first) and "continue training"
            m["presets"] = presets_table(get_method(m["method"]).Config)
            m["resumable"] = bool(getattr(get_method(m["method"]), "resumable", False))
            out.append(m)
        return out

    def training_estimate(self, memory_id: str, method: str, config: dict | None = None, *,
                          owner: str | None = None) -> dict:
        """How long training ``method`` with ``config`` (validated as ``submit_train`` does) on one of the owner's
        memories will take, said before it is queued (``plugins.estimate``: measured throughputs on the memory's
        backbone × its size × the epochs; whether the time budget stops it first)."""
        row = self.memory_svc.memory_row(memory_id, self.ctx.owner(owner))
        if method not in available_methods():
            raise UserError(f"Unknown method {method!r}; choose one of {', '.join(sorted(available_methods()))}.")
        est = estimate(method, config or {}, row["backbone"], int(row["samples"] or 0), int(row["entries"] or 0))
        meta = json.loads(row.get("meta") or "{}")
        return with_calibration(est, calibration_after_training(method, int(meta.get("heldout_samples") or 0)))

    def start_settings(self, task: str) -> dict[str, dict]:
        """Every method's decode settings as a comparison of ``task`` starts them: the declared defaults with the
        values tuned on dev data for this backbone (``plugins/tuned_defaults.json``, written by ``python -m
        eval.quality --save-defaults``). ``{method: {name: value}}``; Compare and Evaluate both start here."""
        bb = self.backbone_svc.loaded_backbone()
        name = resolve_name(bb.name if bb is not None and self.backbone_svc.offsite(bb)
                            else self.backbone_svc.requested_name())  # owner's model
        return {m: start_record(cls, task, name).as_dict()
                for m, cls in available_methods().items() if cls.decode_settings}

    def submit_train(self, memory_id: str, method: str, config: dict | None = None, name: str = "", *,
                     owner: str | None = None) -> str:
        """Validate the memory (the owner's), the method and its settings now (``make_config`` →
        ``PluginConfig.from_dict``: types and declared ranges), then queue the training job for ``owner``."""
        owner = self.ctx.owner(owner)
        if not memory_id:
            raise UserError("Choose a memory to train on.")
        self.memory_svc.memory_row(memory_id, owner)
        name = self.ctx.limits.check_name(name, "plug-in name")
        self.plugin_quota(owner)
        if isinstance(config, str):
            try:
                config = json.loads(config or "{}")
            except json.JSONDecodeError as e:
                raise UserError(f"The settings are not valid JSON: {e.msg} (line {e.lineno}).") from None
        if config is not None and not isinstance(config, dict):
            raise UserError("The settings must be a JSON object like {\"rank\": 64}.")
        if method not in available_methods():
            raise UserError(f"Unknown method {method!r}; choose one of {', '.join(sorted(available_methods()))}.")
        self.backbone_svc.check_offsite(method)  # a remote backbone: output-level methods only, with the reason
        cfg = make_config(method, config or {}).to_dict()
        with self.ctx.admission:
            self.plugin_quota(owner)
            return self.ctx.jobs.submit("train_plugin", {"memory_id": memory_id, "method": method, "config": cfg,
                                                         "name": name}, owner=owner)

    def submit_continue(self, plugin_id: str, config: dict | None = None, name: str = "", *,
                        owner: str | None = None) -> str:
        """Queue "continue training" of one of the owner's plug-ins: it resumes from the plug-in's weights and
        saved optimizer state (Adam's moments, the step count) on the same memory, as a new plug-in (the original
        stays). ``config`` may change only how long it runs (``CONTINUE_SETTINGS``: ``max_minutes``, the epochs,
        ``patience``, ``lr``); the epochs count from where it stopped."""
        owner = self.ctx.owner(owner)
        row = self.plugin_row(plugin_id, owner)
        cls = get_method(row["method"])
        self.backbone_svc.check_offsite(row["method"])
        if not cls.resumable:
            raise UserError(f"{cls.title} plug-ins cannot continue training (only "
                            f"{', '.join(m for m, c in available_methods().items() if getattr(c, 'resumable', 0))}"
                            f" save their optimizer state); train a new one with more time instead.")
        if not (Path(row["path"]) / OPTIMIZER_FILE).exists():
            raise UserError("This plug-in was saved without its optimizer state (trained before continuing was "
                            "possible); train a new one instead.")
        self.memory_svc.memory_row(row["memory_id"], owner)  # its memory is still there, still the owner's
        config = dict(config or {})
        bad = sorted(set(config) - set(CONTINUE_SETTINGS))
        if bad:
            raise UserError(f"Continuing can change only {', '.join(CONTINUE_SETTINGS)}; not {', '.join(bad)}.")
        name = self.ctx.limits.check_name(name, "plug-in name") or f"{row['name']} (continued)"
        self.plugin_quota(owner)
        cfg_path = Path(row["path"]) / "plugin_config.json"
        old = json.loads(cfg_path.read_text(encoding="utf-8")).get("config", {}) if cfg_path.exists() else {}
        cfg = make_config(row["method"], {**old, **config}).to_dict()
        with self.ctx.admission:  # checked and queued under one lock: two clicks never queue two continuations
            self._refuse_second_continuation(plugin_id, row["name"], owner)
            self.plugin_quota(owner)
            return self.ctx.jobs.submit("train_plugin", {"memory_id": row["memory_id"], "method": row["method"],
                                                         "config": cfg, "name": name, "continue_from": plugin_id},
                                        owner=owner)

    def _refuse_second_continuation(self, plugin_id: str, plugin_name: str, owner: str) -> None:
        """Refuse to continue ``plugin_id`` while one of the owner's trainings already continues it (queued or
        running): both would start from the same saved state, and with several training slots run at once."""
        jobs = self.ctx.jobs.list(kinds=("train_plugin",), states=("queued", "running"), owner=owner, limit=1000)
        job = next((j for j in jobs if (j.get("args") or {}).get("continue_from") == plugin_id), None)
        if job is not None:
            raise UserError(f"Plug-in {plugin_name!r} is already being continued by job {job['id']} ({job['state']}); "
                            f"wait for it to end, or cancel it, before continuing it again.")

    def plugin_quota(self, owner: str, more: int = 1) -> None:
        """Refuse ``more`` plug-ins beyond the owner's quota, counting those the queued or running trainings and
        rankings will add (``StudioContext.plugins_in_flight``)."""
        self.ctx.limits.check_quota("plugins_per_owner", self.ctx.catalog.count("plugins", owner) + more - 1
                                    + self.ctx.plugins_in_flight(owner),
                                    "plug-ins (with the trainings and rankings under way)")

    def _continue_train(self, job: JobContext, bb, mem, cls) -> tuple:
        """Load the plug-in to continue (a fresh copy: the cached one may be decoding), resume, save a new one."""
        a = job.args
        prow = self.plugin_row(a["continue_from"], job.owner)
        plugin = open_plugin(prow["path"], bb)
        plugin.config = make_config(a["method"], a["config"])
        plugin.resume_state = optimizer_from_tensors(load_file(str(Path(prow["path"]) / OPTIMIZER_FILE)))
        plugin.on_metric = job.metric
        job.log(f"Continuing {prow['name']!r} from its saved weights and optimizer state")
        t0 = time.time()
        result = plugin.fit(mem, progress=job.progress, should_stop=job.should_stop)
        plugin.train_info = {**plugin.train_info, "seconds": round(time.time() - t0, 2),
                             "trainable_parameters": plugin.trainable_parameters(),
                             "continued_from": prow["id"]}
        out_dir = self.ctx.root / "plugins" / new_id(f"{a['method']}-")
        plugin.save(out_dir)
        (out_dir / "history.json").write_text(json.dumps(result.history), encoding="utf-8")
        row = {"id": out_dir.name, "name": a["name"], "method": a["method"], "memory_id": mem.id,
               "path": str(out_dir), "backbone": bb.name, "fingerprint": bb.fingerprint,
               "params": plugin.trainable_parameters(),
               "metrics": json.dumps({**result.metrics, "train_info": plugin.train_info}, default=str),
               "created": time.time()}
        self.ctx.catalog.owned_by(job.owner).add_plugin(row)
        return plugin, {**row, "history": result.history}

    @staticmethod
    def _save_optimizer(plugin, folder: str | Path) -> None:
        """A resumable plug-in's optimizer state after ``fit``, as safetensors next to its weights (written to a
        temporary name first: a half-written file is never taken for a state to resume from)."""
        state = plugin.optimizer_state
        if not state or not plugin.resumable:
            return
        tmp = Path(folder) / f".{OPTIMIZER_FILE}.tmp"
        save_file(optimizer_tensors(state), str(tmp))
        os.replace(tmp, Path(folder) / OPTIMIZER_FILE)

    def job_train(self, job: JobContext) -> dict:
        a = job.args
        bb = self.backbone_svc.for_job(job)
        row = self.memory_svc.memory_row(a["memory_id"], job.owner)  # still there, still the owner's
        if self.executor is not None and self.executor.runs_training(a):
            # a Ray task (studio.ray_executor); no gate: not this backbone
            res = self.executor.train(self.backbone_svc.worker_spec(), bb, job, row, self.ctx.catalog)
            return self._calibrate_ray_trained(job, bb, row, res)
        self.backbone_svc.check_offsite(a["method"], bb)  # queued before the studio switched to a remote backbone
        mem = open_memory(row["path"], bb)
        cls = get_method(a["method"])
        # an interpolating plug-in is calibrated after training, in this job: training gets the first part of the bar
        share = calibration_share(a["method"], a["config"], bb.name, mem)
        job_progress = job.progress
        if share < 1.0:
            job.progress = lambda f, m="": job_progress(float(f) * share, m)  # type: ignore[method-assign]
        with self.gate.use(holder=f"training {cls.title}"):
            job.checkpoint = self.gate.checkpoint  # plug-ins attach their hooks per batch (none at should_stop)
            job.log(f"Training {cls.title} on {mem.meta.get('name', mem.id)!r} ({len(mem):,} entries)")
            if a.get("continue_from"):
                plugin, row = self._continue_train(job, bb, mem, cls)
            else:
                est = estimate(a["method"], a["config"], bb.name, len(mem.split_samples("train")), len(mem))
                cal = calibration_after_training(a["method"], len(mem.split_samples("heldout")))
                job.log("Time estimate: " + with_calibration(est, cal)["text"])
                plugin, row = train_plugin(bb, mem, a["method"], a["config"],
                                           catalog=self.ctx.catalog.owned_by(job.owner), name=a.get("name", ""),
                                           progress=job.progress, should_stop=job.should_stop, on_metric=job.metric)
        self._save_optimizer(plugin, row["path"])
        job.set_metrics([{k: v for k, v in h.items() if isinstance(v, (int, float, str))}
                         for h in row.get("history", [])])
        metrics = json.loads(row["metrics"])
        status = training_status(metrics)
        how = status["label"] if status["under_trained"] else "ready"
        job.progress = job_progress  # type: ignore[method-assign]
        cal = self._calibrate_trained(job, bb, mem, plugin, share) if cls.interpolates and cls.level == "output" \
            else None  # (too few held-out samples: skipped at once, and the result says so)
        return {"plugin_id": row["id"], "name": row["name"], "method": row["method"], "params": row["params"],
                "metrics": metrics, "training": status, **({"calibration": cal} if cal else {}),
                "message": f"Plug-in {row['name']!r} {how} ({row['params']:,} trainable parameters)"
                           + (f"; {cal['message']}" if cal else "")}

    # --- per-memory calibration (eval.calibrate) ------------------------------------------------------------------
    def _calibrate_trained(self, job: JobContext, bb, mem, plugin, start: float) -> dict:
        """Calibrate a just-trained interpolating plug-in on its memory's held-out tuning samples, as the rest of
        the training job (progress from ``start`` to 1). Too few samples, or a cancel, leave the plug-in trained at
        the global defaults and say so; the job still succeeds (the plug-in is saved)."""
        job.log(f"Calibrating {plugin.title} on held-out samples of {mem.meta.get('name', mem.id)!r}")
        try:
            with self.gate.use(holder=f"calibrating {plugin.title}"):
                job.checkpoint = self.gate.checkpoint
                cal = calibrate(bb, plugin, mem, progress=lambda f, m: job.progress(start + (1 - start) * f, m),
                                should_stop=job.should_stop)
        except UserError as e:
            job.log(str(e))
            return {"skipped": True, "message": str(e)}
        except Cancelled:
            msg = "calibration cancelled: the plug-in starts at the global defaults"
            job.log(msg)
            return {"skipped": True, "message": msg}
        if cal is None:
            return {}
        msg = f"{cal['label']}: {describe_choice(cal)}"
        job.log(msg)
        return {"skipped": False, "settings": cal["settings"], "n": cal["n"], "label": cal["label"],
                "is_base": cal["is_base"], "chrf": cal["chrf"], "bleu": cal["bleu"], "base": cal["base"],
                "seconds": cal["seconds"], "evidence": cal.get("evidence"), "message": msg}

    def _calibrate_ray_trained(self, job: JobContext, bb, mem_row: dict, res: dict) -> dict:
        """A plug-in trained by the Ray executor, calibrated here (the decode needs this process's backbone)."""
        if not isinstance(res, dict) or not res.get("plugin_id"):
            return res
        cls = get_method(res.get("method") or job.args["method"])
        if not (cls.interpolates and cls.level == "output"):
            return res
        mem = open_memory(mem_row["path"], bb)
        plugin = open_plugin(self.plugin_row(res["plugin_id"], job.owner)["path"], bb)
        cal = self._calibrate_trained(job, bb, mem, plugin, 0.95)
        return {**res, **({"calibration": cal, "message": f"{res.get('message', '')}; {cal['message']}"}
                          if cal else {})}

    def submit_calibrate(self, plugin_id: str, *, owner: str | None = None, max_samples: int | None = None,
                         max_seconds: float | None = None) -> str:
        """Queue the calibration of one of the owner's interpolating plug-ins on its memory's held-out tuning
        samples (``eval.calibrate``); a plug-in of another kind, or a memory that is gone, is refused now."""
        owner = self.ctx.owner(owner)
        row = self.plugin_row(plugin_id, owner)
        cls = get_method(row["method"])
        if not (cls.interpolates and cls.level == "output"):
            raise UserError(f"{cls.title} does not mix distributions; there is nothing to calibrate.")
        self.memory_svc.memory_row(row["memory_id"], owner)
        args: dict = {"plugin_id": row["id"]}
        for key, v, high, whole in (("max_samples", max_samples, CALIBRATE_MAX_SAMPLES, True),
                                    ("max_seconds", max_seconds, CALIBRATE_MAX_SECONDS, False)):
            if v is not None and not (isinstance(v, str) and not v.strip()):
                v = check_number(v, key, 0, high, integer=whole)
                if v:  # 0: the default
                    args[key] = v
        return self.ctx.jobs.submit("calibrate_plugin", args, owner=owner)

    def job_calibrate(self, job: JobContext) -> dict:
        a = job.args
        bb = self.backbone_svc.for_job(job)
        prow = self.plugin_row(a["plugin_id"], job.owner)
        mrow = self.memory_svc.memory_row(prow["memory_id"], job.owner)
        mem = open_memory(mrow["path"], bb)
        plugin = open_plugin(prow["path"], bb)
        with self.gate.use(holder=f"calibrating {plugin.title}"):
            job.checkpoint = self.gate.checkpoint
            cal = calibrate(bb, plugin, mem, max_samples=a.get("max_samples"), max_seconds=a.get("max_seconds"),
                            progress=job.progress, should_stop=job.should_stop)
        msg = f"{prow['name']!r} {cal['label']}: {describe_choice(cal)}"
        job.log(msg)
        return {"plugin_id": prow["id"], "settings": cal["settings"], "n": cal["n"], "label": cal["label"],
                "is_base": cal["is_base"], "table": cal["table"], "message": msg}

    @staticmethod
    def _calibration_summary(path: str | Path, backbone: str | None) -> dict | None:
        """What the plug-in lists show of a plug-in's calibration (None: none): settings, label, scores, samples."""
        cal = load_calibration(path)
        if cal is None or cal.get("backbone") not in (None, backbone):
            return None
        return {k: cal.get(k) for k in ("settings", "label", "n", "is_base", "chrf", "bleu", "base", "weight",
                                        "seconds", "created", "global_default", "evidence")}

    def plugins(self, owner: str | None = None) -> list[dict]:
        """The owner's plug-ins, each with its memory's name and task (None when the memory was deleted)."""
        owner = self.ctx.owner(owner)
        bb = self.backbone_svc.loaded_backbone()
        fp = bb.fingerprint if bb is not None else None
        mems = {m["id"]: m for m in self.ctx.catalog.memories(owner)}
        out = []
        for r in self.ctx.catalog.plugins(owner):
            metrics = json.loads(r.get("metrics") or "{}")
            cls = available_methods().get(r["method"])
            mem = mems.get(r["memory_id"]) or {}
            out.append({"id": r["id"], "name": r["name"], "method": r["method"], "memory_id": r["memory_id"],
                        "memory": mem.get("name", "(deleted)"), "task": mem.get("task"), "backbone": r["backbone"],
                        "params": r["params"], "metrics": metrics, "created": r["created"],
                        "usable": fp is None or r["fingerprint"] == fp, "training": training_status(metrics),
                        "can_continue": bool(cls.resumable
                                             and (Path(r["path"]) / OPTIMIZER_FILE).exists()),
                        "calibration": self._calibration_summary(r["path"], r["backbone"])})
        return out

    def plugin_row(self, plugin_id: str, owner: str | None) -> dict:
        """The owner's plug-in row; another owner's plug-in reads as nonexistent."""
        row = self.ctx.catalog.plugin(str(plugin_id or ""), self.ctx.owner(owner))
        if row is None:
            raise UserError(f"No plug-in {plugin_id!r}: it may have been deleted.")
        return row

    def plugin_detail(self, plugin_id: str, *, owner: str | None = None) -> dict:
        row = self.plugin_row(plugin_id, owner)
        cfg = {}
        cfg_path = Path(row["path"]) / "plugin_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")).get("config", {})
        hist_path = Path(row["path"]) / "history.json"
        history = json.loads(hist_path.read_text(encoding="utf-8")) if hist_path.exists() else []
        metrics = json.loads(row.get("metrics") or "{}")
        cal = load_calibration(row["path"])
        if cal is not None:
            cal = {k: v for k, v in cal.items() if k not in ("weights_sha256", "memory_id")}
        return {"id": row["id"], "name": row["name"], "method": row["method"], "memory_id": row["memory_id"],
                "params": row["params"], "config": cfg, "training": training_status(metrics), "metrics": metrics,
                "history": history, "calibration": cal}

    def delete_plugin(self, plugin_id: str, *, owner: str | None = None) -> str:
        owner = self.ctx.owner(owner)
        row = self.plugin_row(plugin_id, owner)
        busy = [j for j in self.ctx.jobs.list(states=("queued", "running"), owner=owner)
                if plugin_id in (j["args"].get("methods") or []) or plugin_id in (j["args"].get("plugin_id"),
                                                                                  j["args"].get("continue_from"))]
        if busy:
            raise UserError("A job (an evaluation, or training that continues it) is using this plug-in; cancel it "
                            "or wait for it to finish first.")
        self.ctx.catalog.delete_plugin(plugin_id)
        self.plugin_cache.pop(plugin_id)
        return f"Deleted plug-in {row['name']!r}."

    def load_plugin(self, plugin_id: str, owner: str | None = None):
        """One of the owner's plug-ins, loaded (cached: loading reads safetensors and, for kNN, the memory's keys)."""
        row = self.plugin_row(plugin_id, owner)  # checked on every use, cached or not
        self.backbone_svc.check_offsite(row["method"])  # an in-network plug-in cannot decode through a model owner
        plugin = self.plugin_cache.get(plugin_id)
        if plugin is None:
            plugin = self.plugin_cache.put(plugin_id, open_plugin(row["path"], self.backbone_svc.backbone()))
        return plugin

    # --- plug-in packages: the Plug-ins tab's Export (zip download) and Import (zip upload) ----------------------
    def export_plugin_zip(self, plugin_id: str, *, owner: str | None = None,
                          include_datastore: bool = False) -> Path:
        """One of the owner's plug-ins as a zip of the package ``python -m plugins export`` writes (config,
        safetensors, PEFT files for LoRA, model card, manifest; with ``include_datastore`` — required for kNN — the
        memory's training entries and samples). Written under the owner's download folder (``pema-plugin-<id>.zip``,
        the same name each time; files older than a day are removed)."""
        owner = self.ctx.owner(owner)
        row = self.plugin_row(plugin_id, owner)
        folder = self.downloads.fresh_owner_dir(owner)
        with tempfile.TemporaryDirectory(prefix="pema-export-") as tmp:
            pkg = export_plugin(row["path"], self.backbone_svc.backbone(), Path(tmp) / "package",
                                catalog=self.ctx.catalog.owned_by(owner), include_datastore=bool(include_datastore))
            return zip_folder(pkg, folder / f"pema-plugin-{row['id']}.zip", f"pema-plugin-{row['id']}")

    def import_plugin_zip(self, upload: str | Path | bytes, name: str = "", *, owner: str | None = None) -> dict:
        """Import a zipped plug-in package (an Export of any studio) into the owner's catalog under a new id, with
        ``python -m plugins import``'s checks (``plugins.hub.import_plugin``: manifest hashes, backbone
        fingerprint, safetensors only, the plug-in's own checks on load) after the zip's (``studio.packages``: size
        bounds from ``limits.upload_bytes``, zip slip, links, bombs, pickle-capable files). A package with a
        datastore also becomes one of the owner's memories. Returns the new plug-in as ``plugins`` lists it."""
        owner = self.ctx.owner(owner)
        if self.ctx.read_only:
            raise UserError("This studio is read-only (another process owns its data directory); import there.")
        name = self.ctx.limits.check_name(name, "plug-in name")
        self.plugin_quota(owner)
        with tempfile.TemporaryDirectory(prefix="pema-import-") as tmp:
            if isinstance(upload, (bytes, bytearray)):
                data = Path(tmp) / "upload.zip"
                data.write_bytes(bytes(upload))
            else:
                data = Path(str(upload or ""))
                if not str(upload or "") or not data.is_file():
                    raise UserError("Choose a plug-in package (.zip) to import.")
            pkg = unpack_zip(data, Path(tmp) / "package", self.ctx.limits.upload_bytes)
            manifest = check_package(pkg)
            if manifest.get("datastore"):
                self.memory_svc.memory_quota(owner)
            row = import_plugin(str(pkg), self.backbone_svc.backbone(), self.ctx.catalog.owned_by(owner), name=name)
        return next(p for p in self.plugins(owner=owner) if p["id"] == row["id"])

