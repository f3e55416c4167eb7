"""The Studio's plug-ins and jobs: methods and their declared settings, training jobs, the loaded plug-in cache —
plug-ins and jobs each for their owner."""
from __future__ import annotations

import json
from pathlib import Path

from backbone.model import resolve_name
from ground.errors import UserError
from ground.jobs import JobContext
from plugins.api import make_config, method_table, open_memory, open_plugin, train_plugin
from plugins.registry import available_methods, get_method
from plugins.settings import coerce_all, tuned_decode_settings


PLUGIN_CACHE = 8


class PluginService:
    """Plug-ins: methods, start settings, training jobs, loading (cached), deleting; the job table."""

    # --- plug-ins -----------------------------------------------------------------------------------------------
    def methods(self) -> list[dict]:
        return method_table()

    def start_settings(self, task: str) -> dict[str, dict]:
        """Every method's decode settings as a comparison of ``task`` starts them: the declared defaults with the
        values tuned on dev data for this backbone (``backbone/tuned_defaults.json``, written by ``python -m
        eval.quality --save-defaults``). ``{method: {name: value}}``; Compare and Evaluate both start here."""
        name = resolve_name(self.backbone_name)
        return {m: {**{s.name: s.default for s in cls.decode_settings},
                    **coerce_all(cls.decode_settings, tuned_decode_settings(m, task, name), cls.title)}
                for m, cls in available_methods().items() if cls.decode_settings}

    def submit_train(self, memory_id: str, method: str, config: dict | None = None, name: str = "", *,
                     owner: str | None = None) -> str:
        """Validate the memory (the owner's), the method and its settings now (``make_config`` →
        ``PluginConfig.from_dict``: types and declared ranges), then queue the training job for ``owner``."""
        owner = self._owner(owner)
        if not memory_id:
            raise UserError("Choose a memory to train on.")
        self._memory_row(memory_id, owner)
        name = self._check_name(name, "plug-in name")
        pending = len(self.jobs.list(kinds=("train_plugin",), states=("queued", "running"), owner=owner))
        self.limits.check_quota("plugins_per_owner", self.catalog.count("plugins", owner) + pending,
                                "plug-ins (with the trainings under way)")
        if isinstance(config, str):
            try:
                config = json.loads(config or "{}")
            except json.JSONDecodeError as e:
                raise UserError(f"The settings are not valid JSON: {e.msg} (line {e.lineno}).") from None
        if config is not None and not isinstance(config, dict):
            raise UserError("The settings must be a JSON object like {\"rank\": 64}.")
        if method not in available_methods():
            raise UserError(f"Unknown method {method!r}; choose one of {', '.join(sorted(available_methods()))}.")
        cfg = make_config(method, config or {}).to_dict()
        return self.jobs.submit("train_plugin", {"memory_id": memory_id, "method": method, "config": cfg,
                                                 "name": name}, owner=owner)

    def _job_train(self, job: JobContext) -> dict:
        a = job.args
        bb = self._job_backbone(job)
        row = self._memory_row(a["memory_id"], job.owner)  # still there, still the owner's
        mem = open_memory(row["path"], bb)
        cls = get_method(a["method"])
        with self.gate.use(holder=f"training {cls.title}"):
            job.checkpoint = self.gate.checkpoint  # plug-ins attach their hooks per batch (none at should_stop)
            job.log(f"Training {cls.title} on {mem.meta.get('name', mem.id)!r} ({len(mem):,} entries)")
            plugin, row = train_plugin(bb, mem, a["method"], a["config"], catalog=self.catalog.owned_by(job.owner),
                                       name=a.get("name", ""), progress=job.progress, should_stop=job.should_stop,
                                       on_metric=job.metric)
        job.set_metrics([{k: v for k, v in h.items() if isinstance(v, (int, float, str))}
                         for h in row.get("history", [])])
        return {"plugin_id": row["id"], "name": row["name"], "method": row["method"], "params": row["params"],
                "metrics": json.loads(row["metrics"]),
                "message": f"Plug-in {row['name']!r} ready ({row['params']:,} trainable parameters)"}

    def plugins(self, owner: str | None = None) -> list[dict]:
        """The owner's plug-ins."""
        owner = self._owner(owner)
        fp = self._bb.fingerprint if self._bb is not None else None
        mems = {m["id"]: m["name"] for m in self.catalog.memories(owner)}
        out = []
        for r in self.catalog.plugins(owner):
            metrics = json.loads(r.get("metrics") or "{}")
            out.append({"id": r["id"], "name": r["name"], "method": r["method"], "memory_id": r["memory_id"],
                        "memory": mems.get(r["memory_id"], "(deleted)"), "backbone": r["backbone"],
                        "params": r["params"], "metrics": metrics, "created": r["created"],
                        "usable": fp is None or r["fingerprint"] == fp})
        return out

    def _plugin_row(self, plugin_id: str, owner: str | None) -> dict:
        """The owner's plug-in row; another owner's plug-in reads as nonexistent."""
        row = self.catalog.plugin(str(plugin_id or ""), self._owner(owner))
        if row is None:
            raise UserError(f"No plug-in {plugin_id!r}: it may have been deleted.")
        return row

    def plugin_detail(self, plugin_id: str, *, owner: str | None = None) -> dict:
        row = self._plugin_row(plugin_id, owner)
        cfg = {}
        cfg_path = Path(row["path"]) / "plugin_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")).get("config", {})
        hist_path = Path(row["path"]) / "history.json"
        history = json.loads(hist_path.read_text(encoding="utf-8")) if hist_path.exists() else []
        return {"id": row["id"], "name": row["name"], "method": row["method"], "memory_id": row["memory_id"],
                "params": row["params"], "config": cfg, "metrics": json.loads(row.get("metrics") or "{}"),
                "history": history}

    def delete_plugin(self, plugin_id: str, *, owner: str | None = None) -> str:
        owner = self._owner(owner)
        row = self._plugin_row(plugin_id, owner)
        busy = [j for j in self.jobs.list(states=("queued", "running"), owner=owner)
                if plugin_id in (j["args"].get("methods") or []) or j["args"].get("plugin_id") == plugin_id]
        if busy:
            raise UserError("An evaluation is using this plug-in; cancel it or wait for it to finish first.")
        self.catalog.delete_plugin(plugin_id)
        with self._plugin_lock:
            self._plugins.pop(plugin_id, None)
        return f"Deleted plug-in {row['name']!r}."

    def _plugin(self, plugin_id: str, owner: str | None = None):
        """One of the owner's plug-ins, loaded (cached: loading reads safetensors and, for kNN, the memory's keys)."""
        row = self._plugin_row(plugin_id, owner)  # checked on every use, cached or not
        with self._plugin_lock:
            if plugin_id in self._plugins:
                self._plugins.move_to_end(plugin_id)
                return self._plugins[plugin_id]
        plugin = open_plugin(row["path"], self.backbone)
        with self._plugin_lock:
            self._plugins[plugin_id] = plugin
            while len(self._plugins) > PLUGIN_CACHE:
                self._plugins.popitem(last=False)
        return plugin

    # --- jobs ---------------------------------------------------------------------------------------------------
    @staticmethod
    def _public_job(j: dict) -> dict:
        """A job as its owner sees it: without the server's path of a pending upload."""
        return {**j, "args": {k: v for k, v in j["args"].items() if k != "upload"}}

    def job(self, job_id: str, *, owner: str | None = None) -> dict:
        """One of the owner's jobs (another owner's job reads as nonexistent)."""
        j = self.jobs.get(str(job_id or ""), self._owner(owner))
        if j is None:
            raise UserError(f"No job {job_id!r}.")
        return self._public_job(j)

    def list_jobs(self, kinds: tuple[str, ...] | None = None, limit: int = 30, *, owner: str | None = None,
                  states: tuple[str, ...] | None = None) -> list[dict]:
        """The owner's latest jobs, newest first."""
        return [self._public_job(j) for j in self.jobs.list(kinds=kinds, states=states,
                                                            limit=max(1, min(int(limit or 30), 200)),
                                                            owner=self._owner(owner))]

    def cancel_job(self, job_id: str, *, owner: str | None = None) -> dict:
        return self._public_job(self.jobs.cancel(str(job_id or ""), self._owner(owner)))

