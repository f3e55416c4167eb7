"""The Studio's memories: preview and validate uploads, build jobs, list, inspect, delete — each for its owner — and
a memory's profile (``memories.profile``; the neighbour maps of ``studio.neighbour_map`` are drawn on it)."""
from __future__ import annotations

import json
import secrets
from pathlib import Path

import numpy as np

from backbone.prompts import TASKS
from backbone.tasks import task_prompt
from eval.transfer import memory_transfer
from ground.errors import UserError
from ground.jobs import READ_ONLY_MESSAGE, JobContext
from ground.store import new_id
from ground.text import first_unsafe
from memories.build import build_memory
from memories.corpora import CORPUS_TASKS, available_corpora, load_corpus
from memories.parse import Sample, detect_format, parse_samples, parse_samples_strict
from memories.profile import highlighted_target, memory_profile
from memories.store import Memory
from studio.backbone_menu import build_batch_size
from studio.backbone_service import BackboneService
from studio.caches import LRU
from studio.context import StudioContext
from studio.gate import BackboneGate
from studio.payload import human_bytes

MAX_PREVIEW_ROWS = 100
UPLOAD_SUFFIXES = (".jsonl", ".json", ".ndjson", ".csv", ".tsv", ".txt")
PROFILE_CACHE = 16      # memory profiles kept (a memory never changes after its build: cached by id)
TOKEN_OCCURRENCES = 6   # a picked token's occurrences listed with their sentence


class MemoryService:
    """Memories: samples → a memory of hidden states (built as a background job, ``build_memory``).

    Receives the context, the backbone service (builds, token names), its gate (a build holds it), the loaded
    plug-in cache (a deleted memory's plug-ins leave it) and the optional Ray executor (sharded builds)."""

    def __init__(self, ctx: StudioContext, backbone_svc: BackboneService, gate: BackboneGate, plugin_cache: LRU,
                 executor=None):
        self.ctx = ctx
        self.backbone_svc = backbone_svc
        self.gate = gate
        self.plugin_cache = plugin_cache
        self.executor = executor
        self.profiles = LRU(PROFILE_CACHE)

    @property
    def job_handlers(self) -> dict:
        """The job kinds this service submits, with their handlers (``JobQueue.handlers``)."""
        return {"build_memory": self.job_build}

    # --- memories -----------------------------------------------------------------------------------------------
    def corpora(self) -> dict[str, str]:
        """Demo corpora this machine provides ({name: description}); empty when the module is missing."""
        try:
            return dict(available_corpora())
        except Exception:  # noqa: BLE001 — a broken demo corpus must not break the page
            return {}

    def _corpus_samples(self, name: str, limit: int | None):
        limit = int(limit) if limit else self.ctx.limits.samples or None
        self.ctx.limits.check("samples", limit or 0, "The number of samples asked for")
        rows = load_corpus(name, limit=limit)
        if not rows:
            raise UserError(f"The demo corpus {name!r} is empty on this machine.")
        return [Sample(r.get("src"), r["tgt"], i + 1) for i, r in enumerate(rows)]

    def preview(self, data: bytes | str | None = None, filename: str | None = None, corpus: str | None = None,
                limit: int | None = None, *, owner: str | None = None) -> dict:
        """Parse uploaded/pasted samples (or a demo corpus) without building anything, for ``owner`` (refused
        without an identity in multi-user mode; at most ``limits.samples`` samples).

        Returns ``{"count", "monolingual", "problems": [...], "problem_count", "rows": [[line, src, tgt]],
        "format", "ok"}``; per-line problems name their line.
        """
        self.ctx.owner(owner)
        if filename is not None and not isinstance(filename, str):
            raise UserError("The file name must be text.")
        if corpus:
            samples, problems, fmt = self._corpus_samples(corpus, limit or 200), [], f"demo corpus {corpus}"
        else:
            if data is None or (isinstance(data, (str, bytes)) and not data.strip()):
                return {"count": 0, "monolingual": 0, "problems": ["Nothing to preview yet: upload a file or "
                                                                   "paste samples."],
                        "problem_count": 1, "rows": [], "format": "", "ok": False}
            self.ctx.limits.check_upload(data)
            samples, problems = parse_samples(data, filename, max_samples=self.ctx.limits.samples or None)
            text = data if isinstance(data, str) else data[:4096].decode("utf-8", "replace")
            fmt = detect_format(filename, text)
        return {"count": len(samples), "monolingual": sum(s.src is None for s in samples),
                "problems": [str(p) for p in problems[:200]], "problem_count": len(problems),
                "rows": [[s.line, s.src if s.src is not None else "(made by the backbone)", s.tgt]
                         for s in samples[:MAX_PREVIEW_ROWS]],
                "format": fmt, "ok": bool(samples) and not problems}

    def _default_name(self, text: str) -> str:
        """A name made from a file name: unsafe characters dropped, cut to the name bound."""
        name = "".join(ch for ch in text if first_unsafe(ch) is None).strip() or "uploaded samples"
        return name[: self.ctx.limits.name_chars] if self.ctx.limits.name_chars else name

    def submit_build(self, data: bytes | str | None = None, filename: str | None = None, *, name: str = "",
                     task: str | None = None, mode: str = "teacher", corpus: str | None = None,
                     limit: int | None = None, skip_invalid: bool = False, owner: str | None = None) -> str:
        """Validate the samples now (a bad upload fails here, before any job) and queue a memory build for
        ``owner`` (refused beyond the owner's quota of memories, counting the builds still queued). ``task``:
        the demo corpus's own task when not given (``CORPUS_TASKS``), else translation."""
        owner = self.ctx.owner(owner)
        task = task or CORPUS_TASKS.get(corpus or "", "translation")
        if self.ctx.jobs.read_only:
            raise UserError(READ_ONLY_MESSAGE)
        name = self.ctx.limits.check_name(name, "memory name")
        if filename is not None and not isinstance(filename, str):
            raise UserError("The file name must be text.")
        self.memory_quota(owner)
        if task not in TASKS:
            raise UserError(f"Unknown task {task!r}; choose one of {', '.join(TASKS)}.")
        if mode not in ("teacher", "offsite"):
            raise UserError("The build mode must be 'teacher' or 'offsite'.")
        args: dict = {"name": (name or "").strip(), "task": task, "mode": mode}
        if corpus:
            samples = self._corpus_samples(corpus, limit)
            args.update(corpus=corpus, limit=int(limit) if limit else None,
                        name=args["name"] or self._default_name(f"{corpus} ({len(samples)} samples)"))
        else:
            if data is None or not (data.strip() if isinstance(data, (str, bytes)) else data):
                raise UserError("Upload a file, paste some samples, or pick a demo corpus first.")
            self.ctx.limits.check_upload(data)
            samples = parse_samples_strict(data, filename, skip_invalid=skip_invalid,
                                           max_samples=self.ctx.limits.samples or None)
            up = self.ctx.root / "uploads"
            up.mkdir(parents=True, exist_ok=True)
            suffix = Path(filename or "pasted.txt").suffix.lower()
            suffix = suffix if suffix in UPLOAD_SUFFIXES else ""
            path = up / f"{secrets.token_hex(8)}{suffix or '.txt'}"
            path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
            stem = self._default_name(Path(filename).stem) if filename else "pasted samples"
            args.update(upload=str(path), filename=stem + suffix if filename else "pasted.txt",
                        skip_invalid=bool(skip_invalid), name=args["name"] or stem)
        args["count"] = len(samples)
        try:
            with self.ctx.admission:  # checked again with the job's queuing: concurrent builds count one by one
                self.memory_quota(owner)
                return self.ctx.jobs.submit("build_memory", args, owner=owner)
        except BaseException:  # e.g. the job queue is full: no upload left behind
            if args.get("upload"):
                Path(args["upload"]).unlink(missing_ok=True)
            raise

    def memory_quota(self, owner: str, more: int = 1) -> None:
        """Refuse ``more`` memories beyond the owner's quota, counting the builds queued or running."""
        self.ctx.limits.check_quota("memories_per_owner", self.ctx.catalog.count("memories", owner) + more - 1
                                    + self.ctx.memories_in_flight(owner), "memories (with the builds under way)")

    def job_build(self, job: JobContext) -> dict:
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
            bb = self.backbone_svc.for_job(job)
            with self.gate.use(holder=f"building memory {a['name']!r}"):
                # every phase calls should_stop at least once per batch; the checkpoint in it hands the backbone
                # to a waiting comparison, so nobody waits longer than one batch
                job.checkpoint = self.gate.checkpoint
                mid = new_id("mem-")
                job.log(f"Building memory {a['name']!r} from {len(samples)} samples ({a['mode']} mode)")
                # the folder and its catalog row appear in one step (nothing to clean up after a failure)
                batch = build_batch_size(self.backbone_svc.requested_name())  # a GPU menu backbone's is larger
                capture = self.executor.capture(self.backbone_svc.worker_spec(), batch) if self.executor else None
                mem = build_memory(bb, samples, self.ctx.root / "memories" / mid,
                                   prompt=task_prompt(a["task"], bb), task=a["task"], mode=a["mode"],
                                   name=a["name"], progress=job.progress, should_stop=job.should_stop,
                                   catalog=self.ctx.catalog.owned_by(job.owner), batch_size=batch,
                                   # --executor ray: the capture sharded over Ray workers (studio.ray_executor)
                                   capture=capture)
            s = mem.summary()
            return {"memory_id": mem.id, "name": s["name"], "samples": s["samples"],
                    "heldout_samples": s["heldout_samples"], "entries": s["entries"],
                    "message": f"Memory {s['name']!r} ready: {s['entries']:,} entries from {s['samples']} samples "
                               f"(+{s['heldout_samples']} held out)"}
        finally:
            if upload is not None:
                upload.unlink(missing_ok=True)

    def memories(self, owner: str | None = None) -> list[dict]:
        """The owner's memories (catalog rows), with ``usable`` (built on the loaded backbone) and a readable size."""
        bb = self.backbone_svc.loaded_backbone()
        fp = bb.fingerprint if bb is not None else None
        out = []
        for r in self.ctx.catalog.memories(self.ctx.owner(owner)):
            stats = json.loads(r.get("meta") or "{}")
            out.append({"id": r["id"], "name": r["name"], "task": r["task"], "mode": r["mode"],
                        "backbone": r["backbone"], "samples": r["samples"], "entries": r["entries"],
                        "heldout_samples": stats.get("heldout_samples", 0), "bytes": r["bytes"],
                        "size": human_bytes(r["bytes"]), "created": r["created"],
                        "usable": fp is None or r["fingerprint"] == fp})
        return out

    def memory_row(self, memory_id: str, owner: str | None) -> dict:
        """The owner's memory row; another owner's memory reads as nonexistent."""
        row = self.ctx.catalog.memory(str(memory_id or ""), self.ctx.owner(owner))
        if row is None:
            raise UserError(f"No memory {memory_id!r}: it may have been deleted.")
        return row

    def load_memory(self, memory_id: str, owner: str | None = None) -> Memory:
        """One of the owner's memories, loaded from its folder."""
        return Memory.load(self.memory_row(memory_id, owner)["path"])

    def transfer_check(self, sources: list[str], methods: list[str] | None = None, *, owner: str | None = None,
                       input_label: str = "your sentences") -> dict | None:
        """How near ``sources`` are to the memory of the first of ``methods`` that is one of the owner's plug-ins,
        beside that memory's held-out samples (``eval.transfer.memory_transfer``); None without such a plug-in
        or without a source. Compare and Evaluate show its ``text`` beside their scores."""
        owner = self.ctx.owner(owner)
        sources = [s for s in (sources or []) if isinstance(s, str) and s.strip()]
        for m in methods or []:
            row = self.ctx.catalog.plugin(m, owner) if m not in ("base", "", None) else None
            if row is not None and sources:
                try:
                    mem = self.load_memory(row["memory_id"], owner)
                except UserError:  # its memory was deleted: nothing to measure against
                    continue
                return {**memory_transfer(mem, sources, input_label=input_label),
                        "memory_name": mem.meta.get("name", mem.id)}
        return None

    def memory_detail(self, memory_id: str, limit: int = 500, *, owner: str | None = None) -> dict:
        """Summary, build statistics and samples (with synthetic sources flagged) of one of the owner's memories."""
        mem = self.load_memory(memory_id, owner)
        samples = mem.samples
        return {"summary": mem.summary(), "stats": mem.meta.get("stats", {}), "prompt": mem.meta.get("prompt"),
                "samples": [{"line": s.get("line"), "split": s["split"], "src": s["src"],
                             "synthetic_src": bool(s.get("synthetic_src")), "tgt": s["tgt"]}
                            for s in samples[:limit]],
                "total_samples": len(samples)}

    def heldout_samples(self, memory_id: str, limit: int = 200, *, owner: str | None = None) -> list[dict]:
        mem = self.load_memory(memory_id, owner)
        return [{"src": s["src"], "tgt": s["tgt"]} for s in mem.split_samples("heldout")[:limit]]

    def delete_memory(self, memory_id: str, *, owner: str | None = None) -> str:
        owner = self.ctx.owner(owner)
        row = self.memory_row(memory_id, owner)
        busy = [j for j in self.ctx.jobs.list(states=("queued", "running"), owner=owner)
                if j["args"].get("memory_id") == memory_id]
        if busy:
            raise UserError("A job is using this memory; cancel it or wait for it to finish first.")
        users = [p for p in self.ctx.catalog.plugins(owner) if p["memory_id"] == memory_id]
        self.ctx.catalog.delete_memory(memory_id)
        for p in users:
            self.plugin_cache.pop(p["id"])
        note = (f" {len(users)} plug-in(s) were trained on it; kNN plug-ins read their memory when decoding and "
                f"stop working." if users else "")
        return f"Deleted memory {row['name']!r}.{note}"


    # --- a memory's profile and neighbour maps -------------------------------------------------------------------
    def token_namer(self, memory: Memory):
        """Token ids → text with the loaded backbone's tokenizer, when the memory was built on it (else "#id")."""
        bb = self.backbone_svc.loaded_backbone()
        if bb is not None and bb.fingerprint == memory.fingerprint:
            return bb.token_str, bb.decode
        return (lambda t: f"#{int(t)}"), (lambda ids: " ".join(f"#{int(t)}" for t in ids))

    def profile(self, memory: Memory) -> dict:
        """``memories.profile.memory_profile`` of a loaded memory, computed once per memory (cached by id)."""
        prof = self.profiles.get(memory.id)
        if prof is None:
            prof = self.profiles.put(memory.id, memory_profile(memory, self.token_namer(memory)[0]))
        return prof

    def memory_profile(self, memory_id: str, *, owner: str | None = None) -> dict:
        """The profile of one of the owner's memories (``memories.profile.memory_profile``: counts, value-token
        frequencies, a 2-D PCA projection of a seeded sample of ≤ 2,000 keys), computed once per memory."""
        return self.profile(self.load_memory(memory_id, owner))

    def memory_token(self, memory_id: str, token_id: int, *, owner: str | None = None) -> dict:
        """One value token of one of the owner's memories: its count, its spread in the profile's sample and a few
        of its occurrences, each with the token marked inside its sample's target (``before``/``match``/
        ``after``)."""
        mem = self.load_memory(memory_id, owner)
        try:
            tid = int(token_id)
        except (TypeError, ValueError):
            raise UserError("Pick a token of the memory's frequency list.") from None
        prof = self.profile(mem)
        top = next((t for t in prof["top_tokens"] if t["token_id"] == tid), None)
        count = top["count"] if top else int((np.asarray(mem.values) == tid).sum())
        if not count:
            raise UserError(f"The memory has no entry with token #{tid}.")
        name, decode = self.token_namer(mem)
        proj = prof["projection"]
        mine = [e for e, t in zip(proj["entries"], proj["tokens"]) if t == tid]
        occ = []
        for e in mine[:TOKEN_OCCURRENCES]:
            h = highlighted_target(mem, e, decode, name)
            occ.append({"entry": e, "source": mem.samples[h["sample"]].get("src") or "", **h})
        return {"token_id": tid, "text": name(tid), "count": count, "share": round(count / max(1, len(mem)), 4),
                "in_sample": len(mine), "sample_size": proj["sample_size"],
                "spread": top["spread"] if top else None, "overall_spread": prof["overall_spread"],
                "occurrences": occ}
