"""The Studio's comparisons: one batched decode of every chosen method, token traces, attention, and shares."""
from __future__ import annotations

import secrets
import time
from typing import Any

from backbone.attention import input_attention
from backbone.prompts import Prompt
from backbone.tasks import task_prompt
from ground.errors import UserError
from plugins.decode import Row, compare as decode_compare
from plugins.settings import resolve_row_settings, row_settings
from studio.payload import json_safe, shared_trace, word_diff


RECENT_COMPARISONS = 64


class CompareService:
    """Comparisons (kept in memory per process) and shared comparisons (stored under unguessable ids)."""

    # --- comparing ----------------------------------------------------------------------------------------------
    def _rows(self, methods: list[str], task: str, settings: dict | None):
        """``Row``s for the chosen methods ("base" or plug-in ids), each with its complete decode settings:
        declared defaults ← tuned for (task, backbone) ← ``settings`` addressed to the row by method name, plug-in
        id or label (``{key: {name: value}}``; a name the row's method does not declare is an error)."""
        if settings is not None and not isinstance(settings, dict):
            raise UserError('Decode settings must be an object like {"pema": {"lambda_max": 0.5}}.')
        rows, labels = [], set()
        if not methods:
            raise UserError("Choose at least one method to compare.")
        for m in methods:
            if m in ("base", "", None):
                rows.append(Row("Base model", None, {}))
                labels.add("Base model")
                continue
            plugin = self._plugin(m)
            row = self.catalog.plugin(m)
            label = row["name"] if row else m
            if label in labels:
                label = f"{label} [{m[-6:]}]"
            labels.add(label)
            own = resolve_row_settings((plugin.method, m, label), settings)
            rows.append(Row(label, plugin, row_settings(plugin, task, self.backbone.name, own)))
        return rows

    def _prompt(self, task: str, rows) -> Any:
        """The memory's prompt of the chosen plug-ins when it is for this task, else the task's tuned prompt."""
        for r in rows:
            meta = getattr(r.plugin, "memory_meta", None) or {}
            if r.plugin is not None and meta.get("prompt") and meta.get("task") == task:
                return Prompt.from_dict(meta["prompt"])
        return task_prompt(task, self.backbone)

    def compare(self, source: str, task: str = "translation", methods: list[str] | None = None,
                settings: dict | None = None, max_new_tokens: int = 48, num_beams: int = 1,
                reference: str | None = None) -> dict:
        """Decode ``source`` with every chosen method in one batch; return a JSON-able comparison payload.

        ``methods``: "base" and/or plug-in ids. ``settings``: ``{method | plug-in id | label: {name: value}}``,
        each block given only to the rows it names (see ``_rows``); each row's complete settings are in the payload.
        """
        if not source or not source.strip():
            raise UserError("Type a sentence to translate or rewrite.")
        if int(max_new_tokens) < 1:
            raise UserError("Max new tokens must be at least 1.")
        t0 = time.time()
        methods = list(methods or ["base"])
        with self._interactive("a comparison") as bb:
            rows = self._rows(methods, task, settings)
            t_load = time.time() - t0
            prompt = self._prompt(task, rows)
            comp = decode_compare(bb, source.strip(), rows, prompt=prompt, max_new_tokens=int(max_new_tokens),
                                  num_beams=int(num_beams))
        total = time.time() - t0
        base = next((r for r in comp.rows if r.method == "base"), comp.rows[0])
        out_rows = []
        for spec, r in zip(methods, comp.rows):
            out_rows.append({"label": r.label, "method": r.method, "plugin_id": None if spec == "base" else spec,
                             "text": r.text, "raw_text": r.raw_text, "tokens": r.tokens,
                             "token_texts": r.token_texts, "trace": json_safe(r.trace),
                             "settings": json_safe(r.settings), "score": r.score, "n_tokens": len(r.tokens),
                             "diff": word_diff(base.text, r.text) if r is not base else [[r.text, "same"]]})
        n_tok = sum(len(r.tokens) for r in comp.rows)
        payload = {"id": secrets.token_urlsafe(12), "source": source.strip(), "task": task,
                   "reference": reference or None, "backbone": bb.name, "prompt": prompt.to_dict(),
                   "context_ids": comp.context_ids, "src_len": comp.src_len, "base_label": base.label,
                   "rows": out_rows, "steps": comp.steps, "num_beams": comp.num_beams,
                   "max_new_tokens": int(max_new_tokens),
                   "timings": {"load_plugins_s": round(t_load, 3), "decode_s": round(comp.seconds, 3),
                               "total_s": round(total, 3), "tokens": n_tok,
                               "tokens_per_s": round(n_tok / max(comp.seconds, 1e-9), 1)},
                   "created": time.time()}
        with self._recent_lock:
            self._recent[payload["id"]] = payload
            while len(self._recent) > RECENT_COMPARISONS:
                self._recent.popitem(last=False)
        return payload

    def recent(self, comparison_id: str) -> dict:
        with self._recent_lock:
            p = self._recent.get(comparison_id)
        if p is None:
            raise UserError("That comparison is no longer in memory (the app was restarted?). Run it again.")
        return p

    def neighbours(self, comparison_id: str, label: str, token_index: int) -> list[dict]:
        """The kNN neighbours of one output token with their memory samples (owner's view only)."""
        p = self.recent(comparison_id)
        row = next((r for r in p["rows"] if r["label"] == label), None)
        if row is None or not 0 <= token_index < len(row["trace"]):
            return []
        nb = row["trace"][token_index].get("neighbours") or []
        if not nb:
            return []
        samples = []
        plugin = self._plugins.get(row["plugin_id"]) if row.get("plugin_id") else None
        mem = getattr(plugin, "memory", None)
        if mem is None and row.get("plugin_id"):
            prow = self.catalog.plugin(row["plugin_id"])
            if prow is not None and self.catalog.memory(prow["memory_id"]):
                mem = self._memory(prow["memory_id"])
        if mem is not None:
            samples = mem.samples
        bb = self._bb
        out = []
        for n in nb:
            s = samples[n["sample"]] if samples and 0 <= n.get("sample", -1) < len(samples) else {}
            out.append({"token": bb.token_str(n["token"]) if bb else str(n["token"]), "distance": n["distance"],
                        "entry": n.get("entry"), "source": s.get("src", ""), "target": s.get("tgt", "")})
        return out

    def attention(self, comparison: dict, label: str, layer: int = -1) -> dict:
        """The backbone's attention from one row's output tokens to the input sentence's tokens."""
        row = next((r for r in comparison["rows"] if r["label"] == label), None)
        if row is None:
            raise UserError(f"No output {label!r} in this comparison.")
        if comparison.get("backbone") != (self._bb.name if self._bb else None):
            raise UserError("This comparison was made on another backbone.")
        with self._interactive("attention") as bb:
            return input_attention(bb, Prompt.from_dict(comparison["prompt"]), comparison["source"], row["tokens"],
                                   layer=int(layer), context_ids=comparison.get("context_ids"))

    # --- sharing ------------------------------------------------------------------------------------------------
    def share(self, comparison_id: str, layer: int | None = None) -> str:
        """Store a comparison of this process for read-only viewing at ``/?c=<id>``; return the id.

        Stored: input, task, reference, methods and settings, outputs, token traces (kNN neighbours reduced to
        token and distance), timings, the backbone's name and the attention maps at ``layer``. Never stored:
        memory samples, file paths, plug-in/memory ids or the prompt's few-shot examples.
        """
        p = self.recent(comparison_id)
        attention = {}
        if self._bb is not None and p.get("backbone") == self._bb.name:
            lay = self._bb.num_layers - 1 if layer is None else int(layer)
            for r in p["rows"]:
                try:
                    attention[r["label"]] = self.attention(p, r["label"], lay)
                except UserError:
                    pass
        payload = {
            "version": 1, "source": p["source"], "task": p["task"], "reference": p.get("reference"),
            "backbone": p["backbone"], "prompt_template": p["prompt"].get("template"),
            "base_label": p["base_label"], "steps": p["steps"], "num_beams": p["num_beams"],
            "max_new_tokens": p.get("max_new_tokens"), "timings": p["timings"],
            "rows": [{"label": r["label"], "method": r["method"], "text": r["text"], "tokens": r["tokens"],
                      "token_texts": r["token_texts"], "settings": r["settings"], "score": r["score"],
                      "n_tokens": r["n_tokens"], "diff": r["diff"],
                      "trace": [shared_trace(t) for t in r["trace"]]} for r in p["rows"]],
            "attention": attention, "created": p["created"], "shared": time.time()}
        return self.catalog.save_comparison(payload, backbone=p["backbone"])

    def shared(self, share_id: str) -> dict:
        """A shared comparison's stored payload (nothing else is read)."""
        if not share_id or len(share_id) > 100:
            raise UserError("This link is not valid.")
        p = self.catalog.comparison(share_id)
        if p is None:
            raise UserError("This shared comparison does not exist (the link may be incomplete).")
        return p

