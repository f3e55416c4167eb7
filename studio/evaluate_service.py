"""The Studio's evaluations: methods or a λ_max sweep on held-out pairs, as background jobs; results as CSV."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from eval import run as eval_run
from ground.errors import UserError
from ground.jobs import JobContext
from memories.parse import parse_samples_strict
from studio.payload import json_safe


class EvaluateService:
    """Evaluations (background jobs) and their CSV."""

    # --- evaluating ---------------------------------------------------------------------------------------------
    def submit_evaluate(self, *, methods: list[str] | None = None, memory_id: str | None = None,
                        test_data: bytes | str | None = None, test_filename: str | None = None,
                        task: str = "translation", limit: int = 50, settings: dict | None = None,
                        sweep_plugin: str | None = None,
                        lambdas: list[float] | None = None, max_new_tokens: int = 48,
                        owner: str | None = None) -> str:
        """Queue an evaluation of ``methods`` (or, with ``sweep_plugin``, a λ_max sweep with and without GU) on one
        of the owner's memories' held-out split or an uploaded test file of source/reference pairs; the plug-ins
        must be the owner's. At most ``limits.eval_pairs`` pairs (``limit`` 0: all of them)."""
        owner = self._owner(owner)
        try:
            limit = int(limit or 0)
        except (TypeError, ValueError):
            raise UserError("The number of sentences must be a whole number.") from None
        if limit < 0:
            raise UserError("The number of sentences must be 0 (all) or more.")
        max_new_tokens, _ = self._check_decode(max_new_tokens)
        if settings is not None and not isinstance(settings, dict):
            raise UserError('Decode settings must be an object like {"pema": {"lambda_max": 0.5}}.')
        args: dict = {"task": task, "limit": limit, "settings": settings or {}, "max_new_tokens": max_new_tokens}
        if test_data:
            self._check_upload(test_data)
            samples = parse_samples_strict(test_data, test_filename)
            pairs = [(s.src, s.tgt) for s in samples if s.src is not None]
            if not pairs:
                raise UserError("The test file needs source and reference pairs (two columns, or src/tgt JSON).")
            n = min(limit, len(pairs)) if limit else len(pairs)
            args["pairs"] = pairs[:n]
            args["data"] = Path(test_filename).name if test_filename else "uploaded test file"
        elif memory_id:
            held = self.heldout_samples(memory_id, limit=100000, owner=owner)
            if not held:
                raise UserError("This memory has no held-out samples (it needs at least 5 samples); upload a "
                                "test file instead.")
            n = min(limit, len(held)) if limit else len(held)
            args["memory_id"] = memory_id
            args["data"] = f"held-out split of {self._memory_row(memory_id, owner)['name']!r}"
        else:
            raise UserError("Choose a memory (its held-out split is used) or upload a test file.")
        self.limits.check("eval_pairs", n, "The number of pairs to evaluate (set fewer sentences)")
        if sweep_plugin:
            try:
                lambdas = [float(x) for x in (lambdas or [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])]
            except (TypeError, ValueError):
                raise UserError("λ_max values must be numbers between 0 and 1.") from None
            if not lambdas or any(not 0 <= x <= 1 for x in lambdas):
                raise UserError("λ_max values must lie between 0 and 1.")
            self.limits.check("sweep_points", len(lambdas), "The number of λ_max values")
            self._plugin_row(sweep_plugin, owner)
            args.update(mode="sweep", plugin_id=sweep_plugin, lambdas=lambdas)
        else:
            if not methods:
                raise UserError("Choose at least one method to evaluate.")
            if not isinstance(methods, (list, tuple)):
                raise UserError('Methods must be a list like ["base", "<plug-in id>"].')
            self.limits.check("methods_per_comparison", len(methods), "The number of methods")
            for m in methods:
                if m not in ("base", "", None):
                    self._plugin_row(m, owner)
            args.update(mode="methods", methods=list(methods))
        return self.jobs.submit("evaluate", args, owner=owner)

    def _job_evaluate(self, job: JobContext) -> dict:
        a = job.args
        owner = job.owner
        bb = self._job_backbone(job)
        if a.get("pairs"):
            pairs = [tuple(p) for p in a["pairs"]]
        else:
            pairs = [(s["src"], s["tgt"]) for s in self.heldout_samples(a["memory_id"], limit=100000, owner=owner)]
        if a.get("limit"):
            pairs = pairs[: a["limit"]]
        with self.gate.use(holder="an evaluation"):
            job.checkpoint = self.gate.checkpoint
            job.log(f"Evaluating on {len(pairs)} pairs ({a.get('data', '')})")
            if a["mode"] == "sweep":
                plugin = self._plugin(a["plugin_id"], owner)
                rows = self._rows([a["plugin_id"]], a["task"], a.get("settings"), owner)
                prompt = self._prompt(a["task"], rows)
                sweep = eval_run.lambda_sweep(bb, pairs, plugin, prompt, a["lambdas"], task=a["task"],
                                              settings=rows[0].settings,
                                              max_new_tokens=a["max_new_tokens"], progress=job.progress,
                                              should_stop=job.should_stop)
                result = {"mode": "sweep", "sweep": json_safe(sweep), "plugin": rows[0].label}
                msg = f"λ sweep done: {len(sweep)} points on {len(pairs)} pairs"
            else:
                rows = self._rows(a["methods"], a["task"], a.get("settings"), owner)
                prompt = self._prompt(a["task"], rows)
                res = eval_run.evaluate(bb, pairs, rows, prompt, a["task"], max_new_tokens=a["max_new_tokens"],
                                        progress=job.progress, should_stop=job.should_stop)
                result = {"mode": "methods", **json_safe(res)}
                msg = f"Evaluated {len(rows)} method(s) on {len(pairs)} pairs"
        result.update(data=a.get("data"), pairs=len(pairs), message=msg)
        return result

    @staticmethod
    def results_csv(result: dict) -> str:
        """An evaluation result as CSV text (the methods table, or the λ sweep)."""
        rows = result.get("sweep") if result.get("mode") == "sweep" else result.get("methods")
        context = {"n": result.get("pairs", result.get("n")), "data": result.get("data"),
                   "backbone": result.get("backbone")}
        rows = [{**r, **{k: v for k, v in context.items() if v is not None}} for r in rows or []]
        buf = io.StringIO()
        cols: list[str] = []
        for r in rows:
            cols += [k for k, v in r.items() if k not in cols and (k == "settings" or not isinstance(v, (list, dict)))]
        w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else v for k, v in r.items()})
        return buf.getvalue()
