"""The Studio's evaluations: methods or a λ_max sweep on held-out pairs, as background jobs; results as CSV and
JSON files for download (per owner, in the studio's private downloads folder, one set per evaluation)."""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from eval import run as eval_run
from ground.errors import UserError
from ground.jobs import JobContext
from memories.parse import parse_samples_strict
from plugins.settings import load_calibration
from studio.backbone_service import BackboneService
from studio.compare_service import PROMPT_BUILTIN, CompareService, check_decode, with_comparison
from studio.context import StudioContext
from studio.downloads import Downloads
from studio.gate import BackboneGate
from studio.job_service import JobService
from studio.limits import Limits
from studio.memory_service import MemoryService
from studio.payload import json_safe
from studio.plugin_service import PluginService


def read_test_pairs(limits: Limits, test_data, test_filename: str | None) -> list[tuple[str, str]]:
    """The (source, reference) pairs of an uploaded test file, checked and bounded (Evaluate and Rank)."""
    limits.check_upload(test_data)
    samples = parse_samples_strict(test_data, test_filename, max_samples=limits.samples or None)
    pairs = [(s.src, s.tgt) for s in samples if s.src is not None]
    if not pairs:
        raise UserError("The test file needs source and reference pairs (two columns, or src/tgt JSON).")
    return pairs


class EvaluateService:
    """Evaluations (background jobs) and their CSV and JSON files.

    Receives the context, the backbone service and its gate (the job's decode), the memories (held-out splits),
    the plug-ins (the rows' plug-ins), the comparisons (rows, prompts and settings are built as a comparison
    builds them), the job table (a finished evaluation's result) and the downloads folder."""

    def __init__(self, ctx: StudioContext, backbone_svc: BackboneService, gate: BackboneGate,
                 memory_svc: MemoryService, plugin_svc: PluginService, compare_svc: CompareService,
                 job_svc: JobService, downloads: Downloads):
        self.ctx = ctx
        self.backbone_svc = backbone_svc
        self.gate = gate
        self.memory_svc = memory_svc
        self.plugin_svc = plugin_svc
        self.compare_svc = compare_svc
        self.job_svc = job_svc
        self.downloads = downloads

    @property
    def job_handlers(self) -> dict:
        """The job kinds this service submits, with their handlers (``JobQueue.handlers``)."""
        return {"evaluate": self.job_evaluate}

    # --- evaluating ---------------------------------------------------------------------------------------------

    def submit_evaluate(self, *, methods: list[str] | None = None, memory_id: str | None = None,
                        test_data: bytes | str | None = None, test_filename: str | None = None,
                        task: str = "translation", limit: int = 50, settings: dict | None = None,
                        sweep_plugin: str | None = None,
                        lambdas: list[float] | None = None, max_new_tokens: int = 48,
                        owner: str | None = None, no_repeat_ngram: int | None = None,
                        global_defaults: bool = False, prompt_from: str | None = None) -> str:
        """Queue an evaluation of ``methods`` (or, with ``sweep_plugin``, a λ_max sweep with and without GU) on one
        of the owner's memories' held-out split or an uploaded test file of source/reference pairs; the plug-ins
        must be the owner's. At most ``limits.eval_pairs`` pairs (``limit`` 0: all of them).

        A plug-in calibrated on its memory is evaluated at its tuned settings (``global_defaults``: at the global
        defaults); on that memory's held-out split, the samples it was tuned on are left out (never scored on the
        samples a setting was chosen on), and the result says how many.

        ``prompt_from`` chooses the prompt of every row without its own, as in Compare
        (``CompareService.base_prompt``: "builtin", one of the owner's memory ids, or None for the first chosen
        plug-in's memory, else the built-in examples); the result's ``prompt_source`` says which it was."""
        owner = self.ctx.owner(owner)
        self.ctx.limits.check_rate("evaluations_per_minute", owner)
        try:
            limit = int(limit or 0)
        except (TypeError, ValueError):
            raise UserError("The number of sentences must be a whole number.") from None
        if limit < 0:
            raise UserError("The number of sentences must be 0 (all) or more.")
        max_new_tokens, _ = check_decode(self.ctx.limits, max_new_tokens)
        settings = with_comparison(settings, no_repeat_ngram)
        if settings is not None and not isinstance(settings, dict):
            raise UserError('Decode settings must be an object like {"pema": {"lambda_max": 0.5}}.')
        args: dict = {"task": task, "limit": limit, "settings": settings or {}, "max_new_tokens": max_new_tokens,
                      "global_defaults": bool(global_defaults)}
        if prompt_from not in (None, "", "auto"):
            if prompt_from != PROMPT_BUILTIN:
                self.compare_svc.prompt_memory(prompt_from, task, owner)
            args["prompt_from"] = prompt_from
        if test_data:
            pairs = read_test_pairs(self.ctx.limits, test_data, test_filename)
            n = min(limit, len(pairs)) if limit else len(pairs)
            args["pairs"] = pairs[:n]
            args["data"] = Path(test_filename).name if test_filename else "uploaded test file"
        elif memory_id:
            held = self.memory_svc.heldout_samples(memory_id, limit=100000, owner=owner)
            if not held:
                raise UserError("This memory has no held-out samples (it needs at least 5 samples); upload a "
                                "test file instead.")
            n = min(limit, len(held)) if limit else len(held)
            args["memory_id"] = memory_id
            args["data"] = f"held-out split of {self.memory_svc.memory_row(memory_id, owner)['name']!r}"
        else:
            raise UserError("Choose a memory (its held-out split is used) or upload a test file.")
        self.ctx.limits.check("eval_pairs", n, "The number of pairs to evaluate (set fewer sentences)")
        if sweep_plugin:
            try:
                lambdas = [float(x) for x in (lambdas or [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])]
            except (TypeError, ValueError):
                raise UserError("λ_max values must be numbers between 0 and 1.") from None
            if not lambdas or any(not 0 <= x <= 1 for x in lambdas):
                raise UserError("λ_max values must lie between 0 and 1.")
            self.ctx.limits.check("sweep_points", len(lambdas), "The number of λ_max values")
            self.plugin_svc.plugin_row(sweep_plugin, owner)
            args.update(mode="sweep", plugin_id=sweep_plugin, lambdas=lambdas)
        else:
            if not methods:
                raise UserError("Choose at least one method to evaluate.")
            if not isinstance(methods, (list, tuple)):
                raise UserError('Methods must be a list like ["base", "<plug-in id>"].')
            self.ctx.limits.check("methods_per_comparison", len(methods), "The number of methods")
            for m in methods:
                if m not in ("base", "", None):
                    self.plugin_svc.plugin_row(m, owner)
            args.update(mode="methods", methods=list(methods))
        return self.ctx.jobs.submit("evaluate", args, owner=owner)

    def job_evaluate(self, job: JobContext) -> dict:
        a = job.args
        owner = job.owner
        bb = self.backbone_svc.for_job(job)
        calibrated = not a.get("global_defaults")
        left_out = 0
        if a.get("pairs"):
            pairs = [tuple(p) for p in a["pairs"]]
        else:
            pairs, left_out = self._untuned_heldout(a, owner, calibrated)
        if a.get("limit"):
            pairs = pairs[: a["limit"]]
        if not pairs:
            raise UserError("Every held-out sample of this memory was used to calibrate a chosen plug-in; evaluate "
                            "at the global defaults or on an uploaded test file.")
        with self.gate.use(holder="an evaluation"):
            job.checkpoint = self.gate.checkpoint
            job.log(f"Evaluating on {len(pairs)} pairs ({a.get('data', '')})")
            if left_out:
                job.log(f"Left out the {left_out} held-out samples a chosen plug-in was calibrated on")
            if a["mode"] == "sweep":
                plugin = self.plugin_svc.load_plugin(a["plugin_id"], owner)
                rows = self.compare_svc.rows([a["plugin_id"]], a["task"], a.get("settings"), owner, calibrated)
                prompt, prompt_source = self.compare_svc.base_prompt(a["task"], rows, a.get("prompt_from"), owner)
                sweep = eval_run.lambda_sweep(bb, pairs, plugin, prompt, a["lambdas"], task=a["task"],
                                              settings=rows[0].settings, comparison=rows[0].comparison,
                                              max_new_tokens=a["max_new_tokens"], progress=job.progress,
                                              should_stop=job.should_stop, **self.backbone_svc.eval_decode(bb))
                result = {"mode": "sweep", "sweep": json_safe(sweep), "plugin": rows[0].label}
                msg = f"λ sweep done: {len(sweep)} points on {len(pairs)} pairs"
            else:
                rows = self.compare_svc.rows(a["methods"], a["task"], a.get("settings"), owner, calibrated)
                prompt, prompt_source = self.compare_svc.base_prompt(a["task"], rows, a.get("prompt_from"), owner)
                res = eval_run.evaluate(bb, pairs, rows, prompt, a["task"], max_new_tokens=a["max_new_tokens"],
                                        progress=job.progress, should_stop=job.should_stop,
                                        **self.backbone_svc.eval_decode(bb))
                result = {"mode": "methods", **json_safe(res),
                          "tuned": {lb: t["label"] for lb, t in self.compare_svc.tuned(rows, calibrated).items()}}
                if a.get("pairs"):  # a test file: how near its sources are to the memory, beside the held-out
                    result["transfer"] = self.memory_svc.transfer_check([s for s, _ in pairs], a["methods"],
                                                                        owner=owner, input_label="your test inputs")
                msg = f"Evaluated {len(rows)} method(s) on {len(pairs)} pairs"
        result.update(data=a.get("data"), pairs=len(pairs), message=msg, calibrated=calibrated,
                      left_out_tuning_samples=left_out, prompt_source=prompt_source)
        return result

    def _untuned_heldout(self, a: dict, owner: str, calibrated: bool) -> tuple[list[tuple], int]:
        """The memory's held-out pairs without those a chosen plug-in (at its tuned settings) was calibrated on,
        and how many were left out."""
        tuned: set[int] = set()
        ids = [a["plugin_id"]] if a.get("mode") == "sweep" else [m for m in a.get("methods") or []
                                                                  if m not in ("base", "", None)]
        for pid in ids if calibrated else ():
            row = self.ctx.catalog.plugin(pid, owner)
            cal = load_calibration(row["path"]) if row else None
            if cal and cal.get("memory_id") == a["memory_id"]:
                tuned |= {int(i) for i in cal.get("sample_ids") or [] if isinstance(i, int)}
        mem = self.memory_svc.load_memory(a["memory_id"], owner)
        held = [(i, s) for i, s in enumerate(mem.samples) if s["split"] == "heldout"]
        pairs = [(s["src"], s["tgt"]) for i, s in held if i not in tuned]
        return pairs, len(held) - len(pairs)

    @staticmethod
    def results_csv(result: dict) -> str:
        """An evaluation result as CSV text (the methods table, or the λ sweep): one line per row with its metrics,
        confidence intervals and p-values, its complete decode settings, n, the data, the task, the backbone and
        sacreBLEU's signatures and the prompt examples of the rows without their own (``base_examples``)."""
        rows = result.get("sweep") if result.get("mode") == "sweep" else result.get("methods")
        sig = result.get("signatures") or {}
        context = {"n": result.get("pairs", result.get("n")), "data": result.get("data"), "task": result.get("task"),
                   "backbone": result.get("backbone"), "bleu_signature": sig.get("sacrebleu"),
                   "chrf_signature": sig.get("chrf"), "base_examples": (result.get("prompt_source") or {}).get("label")}
        rows = [{**{k: v for k, v in context.items() if v is not None}, **r} for r in rows or []]
        return _csv(rows)

    @staticmethod
    def outputs_csv(result: dict) -> str:
        """Per sentence: source, reference, every method's output and its sentence chrF (CSV text)."""
        return _csv(result.get("outputs") or [])

    # --- downloads ----------------------------------------------------------------------------------------------
    def evaluation_files(self, job_id: str, *, owner: str | None = None) -> list[Path]:
        """One of the owner's finished evaluations as files to download: the scores table (CSV), the per-sentence
        outputs (CSV; not for a sweep) and everything as JSON. Written once per evaluation under the owner's
        download folder (the same names each time, so nothing piles up; files older than a day are removed)."""
        owner = self.ctx.owner(owner)
        job = self.job_svc.job(job_id, owner=owner)
        res = job.get("result") if job["kind"] == "evaluate" and job["state"] == "done" else None
        if not res:
            raise UserError("This evaluation has no results (yet).")
        folder = self.downloads.fresh_owner_dir(owner)
        stem = f"pema-eval-{job['id']}"
        files = {f"{stem}-scores.csv": self.results_csv(res),
                 f"{stem}.json": json.dumps(res, indent=1, ensure_ascii=False)}
        if res.get("outputs"):
            files[f"{stem}-outputs.csv"] = self.outputs_csv(res)
        out = []
        for name, text in files.items():
            path = folder / name
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                tmp = folder / f".{name}.tmp"
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, path)
            else:
                os.utime(path)  # still wanted: keep it another day
            out.append(path)
        return out


def _csv(rows: list[dict]) -> str:
    """Dicts as CSV text: the union of their keys as columns, in first-seen order; dicts and lists as JSON."""
    buf = io.StringIO()
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v for k, v in r.items()})
    return buf.getvalue()
