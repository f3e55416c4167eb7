"""The Studio service: everything the web app does, as plain methods (the ``ui/`` modules only call these).

It owns the data directory and its catalog, the loaded backbone (loaded in a background thread so the page can
show progress), the job queue (memory builds, plug-in training, evaluations), a cache of loaded plug-ins, the
recent comparisons of this process and the shared ones (stored in the catalog under unguessable ids).

Sharing the backbone between threads: the backbone is one frozen model, but decoding and training attach forward
hooks to it (f(c) capture, in-network plug-ins), so two threads must never run it at the same time. A
:class:`BackboneGate` makes its use exclusive; a background job holds it for its whole run but hands it over at
its checkpoints (between batches, where the engine calls ``should_stop``) whenever an interactive user is
waiting, so a comparison runs within one training batch instead of after the whole job. This relies on the engine's
convention that a plug-in's ``fit`` attaches its hooks per batch and holds none while it calls ``should_stop``.
An interactive call waits at most ``busy_timeout`` seconds and then says why it cannot run.
"""
from __future__ import annotations

import csv
import difflib
import io
import json
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from backbone.attention import input_attention
from backbone.model import DEFAULT_BACKBONE, load_backbone, resolve_name
from backbone.prompts import Prompt, TASKS
from backbone.tasks import task_prompt
from backbone.tiny import tiny_backbone
from eval import run as eval_run
from ground.errors import Cancelled, UserError
from ground.jobs import JobContext, JobQueue
from ground.store import Catalog, new_id
from memories.build import build_memory, register_memory
from memories.corpora import available_corpora, load_corpus
from memories.parse import Sample, detect_format, parse_samples, parse_samples_strict
from memories.store import Memory
from plugins.api import make_config, method_table, open_memory, open_plugin, train_plugin
from plugins.decode import Row, compare as decode_compare
from plugins.registry import available_methods, get_method
from plugins.settings import coerce_all, resolve_row_settings, row_settings, tuned_decode_settings

TINY_NAMES = ("tiny", "tiny-llama")
MAX_PREVIEW_ROWS = 100
RECENT_COMPARISONS = 64
PLUGIN_CACHE = 8
# What a shared comparison may contain in each output token's trace (never memory samples or file paths).
SHARED_TRACE_KEYS = ("token", "text", "logprob", "lambda", "top_lm", "top_plugin", "top_final",
                     "memory_attention")


# --- exclusive use of the backbone ----------------------------------------------------------------------------------
class BackboneGate:
    """A re-entrant lock on the backbone whose long-running holder can hand it over at checkpoints."""

    def __init__(self):
        self._cond = threading.Condition()
        self._owner: int | None = None
        self._depth = 0
        self._waiting = 0
        self._grants = 0
        self.holder = ""  # what holds it, for "busy" messages

    def acquire(self, timeout: float | None = None, holder: str = "") -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            self._waiting += 1
            try:
                if not self._cond.wait_for(lambda: self._owner is None, timeout):
                    return False
                self._owner, self._depth, self.holder = me, 1, holder
                self._grants += 1
                return True
            finally:
                self._waiting -= 1

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("release() by a thread that does not hold the backbone")
            self._depth -= 1
            if self._depth == 0:
                self._owner, self.holder = None, ""
                self._cond.notify_all()

    @contextmanager
    def use(self, timeout: float | None = None, holder: str = "", busy: str = ""):
        if not self.acquire(timeout, holder):
            raise UserError(busy or f"The backbone is busy ({self.holder or 'another task'}); try again shortly.")
        try:
            yield
        finally:
            self.release()

    def checkpoint(self) -> None:
        """Called by the holder between batches: let waiting users run, then take the backbone back."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me or self._waiting == 0:
                return
            depth, holder, gen = self._depth, self.holder, self._grants
            self._owner, self._depth, self.holder = None, 0, ""
            self._cond.notify_all()
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: self._owner is None and (self._grants != gen or self._waiting == 1))
                self._owner, self._depth, self.holder = me, depth, holder
                self._grants += 1
            finally:
                self._waiting -= 1


# --- small helpers ----------------------------------------------------------------------------------------------------
def word_diff(base: str, text: str) -> list[list]:
    """Word-level differences of ``text`` against ``base``: ``[[segment, "same"|"added"|"removed"], ...]``."""
    a, b = base.split(), text.split()
    out: list[list] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op == "equal":
            out.append([" ".join(b[j1:j2]), "same"])
            continue
        if op in ("replace", "delete"):
            out.append([" ".join(a[i1:i2]), "removed"])
        if op in ("replace", "insert"):
            out.append([" ".join(b[j1:j2]), "added"])
    return out


def human_bytes(n: int | float | None) -> str:
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _json_safe(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _shared_trace(entry: dict) -> dict:
    out = {k: entry[k] for k in SHARED_TRACE_KEYS if k in entry}
    if "neighbours" in entry:  # distances and tokens only: the entries' samples stay with the owner
        out["neighbours"] = [{"token": n.get("token"), "distance": n.get("distance")}
                             for n in entry.get("neighbours") or []]
    return out


class Studio:
    """The app's service object. ``backbone`` is a name ("gemma-3-270m", a hub id, a local path, or "tiny")."""

    def __init__(self, data_dir: str | Path | None = None, backbone: str | None = None, device: str | None = None,
                 workers: int = 1, load: bool = True, start_jobs: bool = True, busy_timeout: float = 120.0,
                 backbone_cache: str | Path | None = None):
        """``backbone_cache``: another data directory whose ``backbones/`` may already hold the de-quantized
        weights (e.g. baked into a Docker image); used when it has the requested backbone, else ``data_dir``."""
        self.catalog = Catalog(data_dir)
        self.root = self.catalog.root
        self.backbone_name = backbone or DEFAULT_BACKBONE
        self.backbone_cache = Path(backbone_cache) if backbone_cache else None
        self.device = device
        self.busy_timeout = busy_timeout
        self.gate = BackboneGate()
        self._bb = None
        self._load = {"state": "idle", "progress": 0.0, "message": "Not loaded", "error": "", "started": None,
                      "finished": None, "stage_started": None}
        self._ready = threading.Event()
        self._plugins: OrderedDict[str, Any] = OrderedDict()
        self._plugin_lock = threading.Lock()
        self._recent: OrderedDict[str, dict] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._clean_temporary_folders()
        self.jobs = JobQueue(self.catalog, {"build_memory": self._job_build, "train_plugin": self._job_train,
                                            "evaluate": self._job_evaluate}, workers=workers)
        if start_jobs:
            self.jobs.start()
        else:
            self.jobs.recover()
        if load:
            self.load_backbone_async()

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        self.jobs.stop()

    def _clean_temporary_folders(self) -> None:
        """Remove half-written folders a killed process left behind (``atomic_dir``'s ``.tmp-*``)."""
        for sub in ("memories", "plugins", "uploads"):
            folder = self.root / sub
            if not folder.is_dir():
                continue
            for p in folder.iterdir():
                if p.name.startswith(".tmp-") or (sub == "uploads" and time.time() - p.stat().st_mtime > 86400):
                    shutil.rmtree(p, ignore_errors=True)

    # --- the backbone -------------------------------------------------------------------------------------------
    def load_backbone_async(self) -> None:
        if self._load["state"] in ("loading", "ready"):
            return
        self._load.update(state="loading", progress=0.0, message=f"Loading {self.backbone_name}…", error="",
                          started=time.time(), stage_started=time.time())
        threading.Thread(target=self._load_backbone, name="pema-backbone-loader", daemon=True).start()

    def _load_backbone(self) -> None:
        def progress(frac: float, msg: str) -> None:
            self._load.update(progress=float(frac), message=msg, stage_started=time.time())

        try:
            if self.backbone_name.lower() in TINY_NAMES:
                progress(0.3, "Building the tiny test backbone")
                bb = tiny_backbone()
            else:
                cache_root = self.root
                name = resolve_name(self.backbone_name)
                if self.backbone_cache and (self.backbone_cache / "backbones" / name / "config.json").exists():
                    cache_root = self.backbone_cache
                bb = load_backbone(self.backbone_name, device=self.device, data_dir=cache_root, progress=progress)
            self._bb = bb
            self._load.update(state="ready", progress=1.0, finished=time.time(),
                              message=f"{bb.name} ready on {bb.device} "
                                      f"({time.time() - self._load['started']:.0f}s to load)")
        except Exception as e:  # noqa: BLE001 — shown to the user in the header
            msg = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            self._load.update(state="failed", error=msg, message=f"Could not load {self.backbone_name}: {msg}",
                              finished=time.time())
        finally:
            self._ready.set()

    def status(self) -> dict:
        """Backbone loading state for the page header: state, progress (0–1), message, elapsed seconds."""
        s = dict(self._load)
        now = time.time()
        s["elapsed"] = round(now - s["started"], 1) if s["started"] else 0.0
        if s["state"] == "loading" and s["message"].startswith("De-quantizing"):
            # The de-quantization step reports nothing for ~70 s: show an estimate so the bar moves.
            stage = now - (s["stage_started"] or now)
            s["progress"] = min(0.84, 0.15 + 0.69 * stage / 90.0)
        bb = self._bb
        s.update(backbone=bb.name if bb else self.backbone_name, ready=s["state"] == "ready",
                 device=str(bb.device) if bb else (self.device or "auto"),
                 layers=bb.num_layers if bb else 0, data_dir=str(self.root))
        s.pop("stage_started", None)
        return s

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self._load["state"] == "ready"

    @property
    def backbone(self):
        """The loaded backbone; a UserError saying what is happening when it is not ready."""
        if self._bb is not None:
            return self._bb
        st = self.status()
        if st["state"] == "failed":
            raise UserError(st["message"])
        raise UserError(f"The backbone is still loading ({st['progress'] * 100:.0f}%: {st['message']}). "
                        f"Try again in a moment.")

    def _job_backbone(self, job: JobContext):
        """The backbone for a job, waiting for it to finish loading."""
        if self._bb is None:
            job.progress(0.0, "Waiting for the backbone to load")
            while not self._ready.wait(1.0):
                if job.should_stop():
                    raise Cancelled()
        return self.backbone

    @contextmanager
    def _interactive(self, what: str):
        busy = (f"The backbone is busy ({self.gate.holder or 'a background job'}) and cannot pause: try again "
                f"when it finishes, or cancel it in the Plug-ins tab.")
        with self.gate.use(timeout=self.busy_timeout, holder=what, busy=busy):
            yield self.backbone

    # --- memories -----------------------------------------------------------------------------------------------
    def corpora(self) -> dict[str, str]:
        """Demo corpora this machine provides ({name: description}); empty when the module is missing."""
        try:
            return dict(available_corpora())
        except Exception:  # noqa: BLE001 — a broken demo corpus must not break the page
            return {}

    def _corpus_samples(self, name: str, limit: int | None):
        rows = load_corpus(name, limit=int(limit) if limit else None)
        if not rows:
            raise UserError(f"The demo corpus {name!r} is empty on this machine.")
        return [Sample(r.get("src"), r["tgt"], i + 1) for i, r in enumerate(rows)]

    def preview(self, data: bytes | str | None = None, filename: str | None = None, corpus: str | None = None,
                limit: int | None = None) -> dict:
        """Parse uploaded/pasted samples (or a demo corpus) without building anything.

        Returns ``{"count", "monolingual", "problems": [...], "problem_count", "rows": [[line, src, tgt]],
        "format", "ok"}``; per-line problems name their line.
        """
        if corpus:
            samples, problems, fmt = self._corpus_samples(corpus, limit or 200), [], "demo corpus"
        else:
            if data is None or (isinstance(data, (str, bytes)) and not data.strip()):
                return {"count": 0, "monolingual": 0, "problems": ["Nothing to preview yet: upload a file or "
                                                                   "paste samples."],
                        "problem_count": 1, "rows": [], "format": "", "ok": False}
            samples, problems = parse_samples(data, filename)
            text = data if isinstance(data, str) else data[:4096].decode("utf-8", "replace")
            fmt = detect_format(filename, text)
        return {"count": len(samples), "monolingual": sum(s.src is None for s in samples),
                "problems": [str(p) for p in problems[:200]], "problem_count": len(problems),
                "rows": [[s.line, s.src if s.src is not None else "(made by the backbone)", s.tgt]
                         for s in samples[:MAX_PREVIEW_ROWS]],
                "format": fmt, "ok": bool(samples) and not problems}

    def submit_build(self, data: bytes | str | None = None, filename: str | None = None, *, name: str = "",
                     task: str = "translation", mode: str = "teacher", corpus: str | None = None,
                     limit: int | None = None, skip_invalid: bool = False) -> str:
        """Validate the samples now (a bad upload fails here, before any job) and queue a memory build."""
        if task not in TASKS:
            raise UserError(f"Unknown task {task!r}; choose one of {', '.join(TASKS)}.")
        if mode not in ("teacher", "offsite"):
            raise UserError("The build mode must be 'teacher' or 'offsite'.")
        args: dict = {"name": (name or "").strip(), "task": task, "mode": mode}
        if corpus:
            samples = self._corpus_samples(corpus, limit)
            args.update(corpus=corpus, limit=int(limit) if limit else None,
                        name=args["name"] or f"{corpus} ({len(samples)} samples)")
        else:
            if data is None or not (data.strip() if isinstance(data, (str, bytes)) else data):
                raise UserError("Upload a file, paste some samples, or pick a demo corpus first.")
            samples = parse_samples_strict(data, filename, skip_invalid=skip_invalid)
            up = self.root / "uploads"
            up.mkdir(parents=True, exist_ok=True)
            path = up / f"{secrets.token_hex(8)}{Path(filename or 'pasted.txt').suffix or '.txt'}"
            path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
            stem = Path(filename).stem if filename else "pasted samples"
            args.update(upload=str(path), filename=filename or "pasted.txt", skip_invalid=bool(skip_invalid),
                        name=args["name"] or stem)
        args["count"] = len(samples)
        return self.jobs.submit("build_memory", args)

    def _job_build(self, job: JobContext) -> dict:
        a = job.args
        upload = Path(a["upload"]) if a.get("upload") else None
        try:
            if a.get("corpus"):
                samples = self._corpus_samples(a["corpus"], a.get("limit"))
            else:
                if upload is None or not upload.exists():
                    raise UserError("The uploaded file is gone (the app was restarted?); upload it again.")
                samples = parse_samples_strict(upload.read_bytes(), a.get("filename"),
                                               skip_invalid=a.get("skip_invalid", False))
            bb = self._job_backbone(job)
            with self.gate.use(holder=f"building memory {a['name']!r}"):
                job.checkpoint = self.gate.checkpoint
                mid = new_id("mem-")
                job.log(f"Building memory {a['name']!r} from {len(samples)} samples ({a['mode']} mode)")
                mem = build_memory(bb, samples, self.root / "memories" / mid,
                                   prompt=task_prompt(a["task"], bb), task=a["task"], mode=a["mode"],
                                   name=a["name"], progress=job.progress, should_stop=job.should_stop)
            register_memory(self.catalog, mem)  # only now, after the folder is complete
            s = mem.summary()
            return {"memory_id": mem.id, "name": s["name"], "samples": s["samples"],
                    "heldout_samples": s["heldout_samples"], "entries": s["entries"],
                    "message": f"Memory {s['name']!r} ready: {s['entries']:,} entries from {s['samples']} samples "
                               f"(+{s['heldout_samples']} held out)"}
        finally:
            if upload is not None:
                upload.unlink(missing_ok=True)

    def memories(self) -> list[dict]:
        """Catalog rows of the memories, with ``usable`` (built on the loaded backbone) and a readable size."""
        fp = self._bb.fingerprint if self._bb is not None else None
        out = []
        for r in self.catalog.memories():
            stats = json.loads(r.get("meta") or "{}")
            out.append({"id": r["id"], "name": r["name"], "task": r["task"], "mode": r["mode"],
                        "backbone": r["backbone"], "samples": r["samples"], "entries": r["entries"],
                        "heldout_samples": stats.get("heldout_samples", 0), "bytes": r["bytes"],
                        "size": human_bytes(r["bytes"]), "created": r["created"],
                        "usable": fp is None or r["fingerprint"] == fp})
        return out

    def _memory(self, memory_id: str):
        row = self.catalog.memory(memory_id)
        if row is None:
            raise UserError(f"No memory {memory_id!r}: it may have been deleted.")
        return Memory.load(row["path"])

    def memory_detail(self, memory_id: str, limit: int = 500) -> dict:
        """Summary, build statistics and samples (with synthetic sources flagged) of one memory."""
        mem = self._memory(memory_id)
        samples = mem.samples
        return {"summary": mem.summary(), "stats": mem.meta.get("stats", {}), "prompt": mem.meta.get("prompt"),
                "samples": [{"line": s.get("line"), "split": s["split"], "src": s["src"],
                             "synthetic_src": bool(s.get("synthetic_src")), "tgt": s["tgt"]}
                            for s in samples[:limit]],
                "total_samples": len(samples)}

    def heldout_samples(self, memory_id: str, limit: int = 200) -> list[dict]:
        mem = self._memory(memory_id)
        return [{"src": s["src"], "tgt": s["tgt"]} for s in mem.split_samples("heldout")[:limit]]

    def delete_memory(self, memory_id: str) -> str:
        busy = [j for j in self.jobs.list(states=("queued", "running"))
                if j["args"].get("memory_id") == memory_id]
        if busy:
            raise UserError("A job is using this memory; cancel it or wait for it to finish first.")
        row = self.catalog.memory(memory_id)
        if row is None:
            raise UserError(f"No memory {memory_id!r}.")
        users = [p for p in self.catalog.plugins() if p["memory_id"] == memory_id]
        self.catalog.delete_memory(memory_id)
        with self._plugin_lock:
            for p in users:
                self._plugins.pop(p["id"], None)
        note = (f" {len(users)} plug-in(s) were trained on it; kNN plug-ins read their memory when decoding and "
                f"stop working." if users else "")
        return f"Deleted memory {row['name']!r}.{note}"

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

    def submit_train(self, memory_id: str, method: str, config: dict | None = None, name: str = "") -> str:
        """Validate the method and its settings now, then queue the training job."""
        if not memory_id:
            raise UserError("Choose a memory to train on.")
        if self.catalog.memory(memory_id) is None:
            raise UserError(f"No memory {memory_id!r}: it may have been deleted.")
        if isinstance(config, str):
            try:
                config = json.loads(config or "{}")
            except json.JSONDecodeError as e:
                raise UserError(f"The settings are not valid JSON: {e.msg} (line {e.lineno}).") from None
        if config is not None and not isinstance(config, dict):
            raise UserError("The settings must be a JSON object like {\"rank\": 64}.")
        cfg = make_config(method, config or {}).to_dict()
        return self.jobs.submit("train_plugin", {"memory_id": memory_id, "method": method, "config": cfg,
                                                 "name": (name or "").strip()})

    def _job_train(self, job: JobContext) -> dict:
        a = job.args
        bb = self._job_backbone(job)
        mem = open_memory(a["memory_id"], bb, catalog=self.catalog)
        cls = get_method(a["method"])
        with self.gate.use(holder=f"training {cls.title}"):
            job.checkpoint = self.gate.checkpoint  # plug-ins attach their hooks per batch (none at should_stop)
            job.log(f"Training {cls.title} on {mem.meta.get('name', mem.id)!r} ({len(mem):,} entries)")
            plugin, row = train_plugin(bb, mem, a["method"], a["config"], catalog=self.catalog,
                                       name=a.get("name", ""), progress=job.progress, should_stop=job.should_stop)
        job.set_metrics([{k: v for k, v in h.items() if isinstance(v, (int, float, str))}
                         for h in row.get("history", [])])
        return {"plugin_id": row["id"], "name": row["name"], "method": row["method"], "params": row["params"],
                "metrics": json.loads(row["metrics"]),
                "message": f"Plug-in {row['name']!r} ready ({row['params']:,} trainable parameters)"}

    def plugins(self) -> list[dict]:
        fp = self._bb.fingerprint if self._bb is not None else None
        mems = {m["id"]: m["name"] for m in self.catalog.memories()}
        out = []
        for r in self.catalog.plugins():
            metrics = json.loads(r.get("metrics") or "{}")
            out.append({"id": r["id"], "name": r["name"], "method": r["method"], "memory_id": r["memory_id"],
                        "memory": mems.get(r["memory_id"], "(deleted)"), "backbone": r["backbone"],
                        "params": r["params"], "metrics": metrics, "created": r["created"],
                        "usable": fp is None or r["fingerprint"] == fp})
        return out

    def plugin_detail(self, plugin_id: str) -> dict:
        row = self.catalog.plugin(plugin_id)
        if row is None:
            raise UserError(f"No plug-in {plugin_id!r}.")
        cfg = {}
        cfg_path = Path(row["path"]) / "plugin_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")).get("config", {})
        hist_path = Path(row["path"]) / "history.json"
        history = json.loads(hist_path.read_text(encoding="utf-8")) if hist_path.exists() else []
        return {"id": row["id"], "name": row["name"], "method": row["method"], "memory_id": row["memory_id"],
                "params": row["params"], "config": cfg, "metrics": json.loads(row.get("metrics") or "{}"),
                "history": history}

    def delete_plugin(self, plugin_id: str) -> str:
        row = self.catalog.plugin(plugin_id)
        if row is None:
            raise UserError(f"No plug-in {plugin_id!r}.")
        self.catalog.delete_plugin(plugin_id)
        with self._plugin_lock:
            self._plugins.pop(plugin_id, None)
        return f"Deleted plug-in {row['name']!r}."

    def _plugin(self, plugin_id: str):
        """A loaded plug-in (cached: loading reads safetensors and, for kNN, the memory's keys)."""
        with self._plugin_lock:
            if plugin_id in self._plugins:
                self._plugins.move_to_end(plugin_id)
                return self._plugins[plugin_id]
        if self.catalog.plugin(plugin_id) is None:
            raise UserError(f"No plug-in {plugin_id!r}: it may have been deleted.")
        plugin = open_plugin(plugin_id, self.backbone, catalog=self.catalog)
        with self._plugin_lock:
            self._plugins[plugin_id] = plugin
            while len(self._plugins) > PLUGIN_CACHE:
                self._plugins.popitem(last=False)
        return plugin

    # --- jobs ---------------------------------------------------------------------------------------------------
    def job(self, job_id: str) -> dict:
        j = self.jobs.get(job_id)
        if j is None:
            raise UserError(f"No job {job_id!r}.")
        return j

    def list_jobs(self, kinds: tuple[str, ...] | None = None, limit: int = 30) -> list[dict]:
        return self.jobs.list(kinds=kinds, limit=limit)

    def cancel_job(self, job_id: str) -> dict:
        return self.jobs.cancel(job_id)

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
                             "token_texts": r.token_texts, "trace": _json_safe(r.trace),
                             "settings": _json_safe(r.settings), "score": r.score, "n_tokens": len(r.tokens),
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
                      "trace": [_shared_trace(t) for t in r["trace"]]} for r in p["rows"]],
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

    # --- evaluating ---------------------------------------------------------------------------------------------
    def submit_evaluate(self, *, methods: list[str] | None = None, memory_id: str | None = None,
                        test_data: bytes | str | None = None, test_filename: str | None = None,
                        task: str = "translation", limit: int = 50, settings: dict | None = None,
                        sweep_plugin: str | None = None,
                        lambdas: list[float] | None = None, max_new_tokens: int = 48) -> str:
        """Queue an evaluation of ``methods`` (or, with ``sweep_plugin``, a λ_max sweep with and without GU) on a
        memory's held-out split or an uploaded test file of source/reference pairs."""
        args: dict = {"task": task, "limit": int(limit or 0), "settings": settings or {},
                      "max_new_tokens": int(max_new_tokens)}
        if test_data:
            samples = parse_samples_strict(test_data, test_filename)
            pairs = [(s.src, s.tgt) for s in samples if s.src is not None]
            if not pairs:
                raise UserError("The test file needs source and reference pairs (two columns, or src/tgt JSON).")
            args["pairs"] = pairs
            args["data"] = Path(test_filename).name if test_filename else "uploaded test file"
        elif memory_id:
            held = self.heldout_samples(memory_id, limit=100000)
            if not held:
                raise UserError("This memory has no held-out samples (it needs at least 5 samples); upload a "
                                "test file instead.")
            args["memory_id"] = memory_id
            args["data"] = f"held-out split of {self.catalog.memory(memory_id)['name']!r}"
        else:
            raise UserError("Choose a memory (its held-out split is used) or upload a test file.")
        if sweep_plugin:
            lambdas = [float(x) for x in (lambdas or [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])]
            if not lambdas or any(not 0 <= x <= 1 for x in lambdas):
                raise UserError("λ_max values must lie between 0 and 1.")
            args.update(mode="sweep", plugin_id=sweep_plugin, lambdas=lambdas)
        else:
            if not methods:
                raise UserError("Choose at least one method to evaluate.")
            args.update(mode="methods", methods=list(methods))
        return self.jobs.submit("evaluate", args)

    def _job_evaluate(self, job: JobContext) -> dict:
        a = job.args
        bb = self._job_backbone(job)
        if a.get("pairs"):
            pairs = [tuple(p) for p in a["pairs"]]
        else:
            pairs = [(s["src"], s["tgt"]) for s in self.heldout_samples(a["memory_id"], limit=100000)]
        if a.get("limit"):
            pairs = pairs[: a["limit"]]
        with self.gate.use(holder="an evaluation"):
            job.checkpoint = self.gate.checkpoint
            job.log(f"Evaluating on {len(pairs)} pairs ({a.get('data', '')})")
            if a["mode"] == "sweep":
                plugin = self._plugin(a["plugin_id"])
                rows = self._rows([a["plugin_id"]], a["task"], a.get("settings"))
                prompt = self._prompt(a["task"], rows)
                sweep = eval_run.lambda_sweep(bb, pairs, plugin, prompt, a["lambdas"], task=a["task"],
                                              settings=rows[0].settings,
                                              max_new_tokens=a["max_new_tokens"], progress=job.progress,
                                              should_stop=job.should_stop)
                result = {"mode": "sweep", "sweep": _json_safe(sweep), "plugin": rows[0].label}
                msg = f"λ sweep done: {len(sweep)} points on {len(pairs)} pairs"
            else:
                rows = self._rows(a["methods"], a["task"], a.get("settings"))
                prompt = self._prompt(a["task"], rows)
                res = eval_run.evaluate(bb, pairs, rows, prompt, a["task"], max_new_tokens=a["max_new_tokens"],
                                        progress=job.progress, should_stop=job.should_stop)
                result = {"mode": "methods", **_json_safe(res)}
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
