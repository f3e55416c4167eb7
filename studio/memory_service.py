"""The Studio's memories: preview and validate uploads, build jobs, list, inspect, delete — each for its owner; a
memory's profile (``memories.profile``) and, per output token of a comparison's kNN or PEMA row, a neighbour map on
the same 2-D projection."""
from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from backbone.prompts import TASKS
from backbone.tasks import task_prompt
from ground.errors import UserError
from ground.jobs import READ_ONLY_MESSAGE, JobContext
from ground.store import new_id
from ground.text import check_name, first_unsafe
from memories.build import build_memory
from memories.corpora import available_corpora, load_corpus
from memories.parse import Sample, detect_format, parse_samples, parse_samples_strict
from memories.profile import highlighted_target, memory_profile, project, scaled_keys
from memories.store import Memory
from plugins.registry import available_methods
from studio.payload import human_bytes
from studio.ray_executor import backbone_spec

MAX_PREVIEW_ROWS = 100
UPLOAD_SUFFIXES = (".jsonl", ".json", ".ndjson", ".csv", ".tsv", ".txt")
PROFILE_CACHE = 16      # memory profiles kept (a memory never changes after its build: cached by id)
QUERY_CACHE = 16        # per (comparison, row): the output tokens' f(c), recomputed once
MAP_NEIGHBOURS = 8      # neighbours on a map (kNN: at most what its decode traced)
SEARCH_CHUNK = 32768    # keys compared at once in the exact search of a map's neighbours
TOKEN_OCCURRENCES = 6   # a picked token's occurrences listed with their sentence


class MemoryService:
    """Memories: samples → a memory of hidden states (built as a background job)."""

    # --- memories -----------------------------------------------------------------------------------------------
    def corpora(self) -> dict[str, str]:
        """Demo corpora this machine provides ({name: description}); empty when the module is missing."""
        try:
            return dict(available_corpora())
        except Exception:  # noqa: BLE001 — a broken demo corpus must not break the page
            return {}

    def _corpus_samples(self, name: str, limit: int | None):
        limit = int(limit) if limit else self.limits.samples or None
        self.limits.check("samples", limit or 0, "The number of samples asked for")
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
        self._owner(owner)
        if filename is not None and not isinstance(filename, str):
            raise UserError("The file name must be text.")
        if corpus:
            samples, problems, fmt = self._corpus_samples(corpus, limit or 200), [], "demo corpus"
        else:
            if data is None or (isinstance(data, (str, bytes)) and not data.strip()):
                return {"count": 0, "monolingual": 0, "problems": ["Nothing to preview yet: upload a file or "
                                                                   "paste samples."],
                        "problem_count": 1, "rows": [], "format": "", "ok": False}
            self._check_upload(data)
            samples, problems = parse_samples(data, filename, max_samples=self.limits.samples or None)
            text = data if isinstance(data, str) else data[:4096].decode("utf-8", "replace")
            fmt = detect_format(filename, text)
        return {"count": len(samples), "monolingual": sum(s.src is None for s in samples),
                "problems": [str(p) for p in problems[:200]], "problem_count": len(problems),
                "rows": [[s.line, s.src if s.src is not None else "(made by the backbone)", s.tgt]
                         for s in samples[:MAX_PREVIEW_ROWS]],
                "format": fmt, "ok": bool(samples) and not problems}

    def _check_upload(self, data: bytes | str | None) -> None:
        """The size bound, for bytes (an upload) and text (pasted, or sent through the API) alike; the parser then
        gives both the same encoding / NUL / surrogate checks (``memories.parse``)."""
        if data is not None and not isinstance(data, (str, bytes)):
            raise UserError("Send the samples as text or as a file.")
        n = len(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data or b"")
        self.limits.check("upload_bytes", n, "The uploaded text's size in bytes")

    def _check_name(self, name: str | None, what: str) -> str:
        """A name typed by the user: text, within ``name_chars``, without control characters, terminal escapes,
        bidirectional overrides or lone surrogates (``ground.text.check_name``)."""
        name = check_name(name, what)
        self.limits.check("name_chars", len(name), f"The {what}'s length in characters")
        return name

    def _default_name(self, text: str) -> str:
        """A name made from a file name: unsafe characters dropped, cut to the name bound."""
        name = "".join(ch for ch in text if first_unsafe(ch) is None).strip() or "uploaded samples"
        return name[: self.limits.name_chars] if self.limits.name_chars else name

    def submit_build(self, data: bytes | str | None = None, filename: str | None = None, *, name: str = "",
                     task: str = "translation", mode: str = "teacher", corpus: str | None = None,
                     limit: int | None = None, skip_invalid: bool = False, owner: str | None = None) -> str:
        """Validate the samples now (a bad upload fails here, before any job) and queue a memory build for
        ``owner`` (refused beyond the owner's quota of memories, counting the builds still queued)."""
        owner = self._owner(owner)
        if self.jobs.read_only:
            raise UserError(READ_ONLY_MESSAGE)
        name = self._check_name(name, "memory name")
        if filename is not None and not isinstance(filename, str):
            raise UserError("The file name must be text.")
        pending = len(self.jobs.list(kinds=("build_memory",), states=("queued", "running"), owner=owner))
        self.limits.check_quota("memories_per_owner", self.catalog.count("memories", owner) + pending,
                                "memories (with the builds under way)")
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
            self._check_upload(data)
            samples = parse_samples_strict(data, filename, skip_invalid=skip_invalid,
                                           max_samples=self.limits.samples or None)
            up = self.root / "uploads"
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
            return self.jobs.submit("build_memory", args, owner=owner)
        except BaseException:  # e.g. the job queue is full: no upload left behind
            if args.get("upload"):
                Path(args["upload"]).unlink(missing_ok=True)
            raise

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
                # every phase calls should_stop at least once per batch; the checkpoint in it hands the backbone
                # to a waiting comparison, so nobody waits longer than one batch
                job.checkpoint = self.gate.checkpoint
                mid = new_id("mem-")
                job.log(f"Building memory {a['name']!r} from {len(samples)} samples ({a['mode']} mode)")
                # the folder and its catalog row appear in one step (nothing to clean up after a failure)
                mem = build_memory(bb, samples, self.root / "memories" / mid,
                                   prompt=task_prompt(a["task"], bb), task=a["task"], mode=a["mode"],
                                   name=a["name"], progress=job.progress, should_stop=job.should_stop,
                                   catalog=self.catalog.owned_by(job.owner),
                                   # --executor ray: the capture sharded over Ray workers (studio.ray_executor)
                                   capture=self.executor.capture(backbone_spec(self)) if self.executor else None)
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
        fp = self._bb.fingerprint if self._bb is not None else None
        out = []
        for r in self.catalog.memories(self._owner(owner)):
            stats = json.loads(r.get("meta") or "{}")
            out.append({"id": r["id"], "name": r["name"], "task": r["task"], "mode": r["mode"],
                        "backbone": r["backbone"], "samples": r["samples"], "entries": r["entries"],
                        "heldout_samples": stats.get("heldout_samples", 0), "bytes": r["bytes"],
                        "size": human_bytes(r["bytes"]), "created": r["created"],
                        "usable": fp is None or r["fingerprint"] == fp})
        return out

    def _memory_row(self, memory_id: str, owner: str | None) -> dict:
        """The owner's memory row; another owner's memory reads as nonexistent."""
        row = self.catalog.memory(str(memory_id or ""), self._owner(owner))
        if row is None:
            raise UserError(f"No memory {memory_id!r}: it may have been deleted.")
        return row

    def _memory(self, memory_id: str, owner: str | None = None):
        return Memory.load(self._memory_row(memory_id, owner)["path"])

    def memory_detail(self, memory_id: str, limit: int = 500, *, owner: str | None = None) -> dict:
        """Summary, build statistics and samples (with synthetic sources flagged) of one of the owner's memories."""
        mem = self._memory(memory_id, owner)
        samples = mem.samples
        return {"summary": mem.summary(), "stats": mem.meta.get("stats", {}), "prompt": mem.meta.get("prompt"),
                "samples": [{"line": s.get("line"), "split": s["split"], "src": s["src"],
                             "synthetic_src": bool(s.get("synthetic_src")), "tgt": s["tgt"]}
                            for s in samples[:limit]],
                "total_samples": len(samples)}

    def heldout_samples(self, memory_id: str, limit: int = 200, *, owner: str | None = None) -> list[dict]:
        mem = self._memory(memory_id, owner)
        return [{"src": s["src"], "tgt": s["tgt"]} for s in mem.split_samples("heldout")[:limit]]

    def delete_memory(self, memory_id: str, *, owner: str | None = None) -> str:
        owner = self._owner(owner)
        row = self._memory_row(memory_id, owner)
        busy = [j for j in self.jobs.list(states=("queued", "running"), owner=owner)
                if j["args"].get("memory_id") == memory_id]
        if busy:
            raise UserError("A job is using this memory; cancel it or wait for it to finish first.")
        users = [p for p in self.catalog.plugins(owner) if p["memory_id"] == memory_id]
        self.catalog.delete_memory(memory_id)
        with self._plugin_lock:
            for p in users:
                self._plugins.pop(p["id"], None)
        note = (f" {len(users)} plug-in(s) were trained on it; kNN plug-ins read their memory when decoding and "
                f"stop working." if users else "")
        return f"Deleted memory {row['name']!r}.{note}"


    # --- a memory's profile and neighbour maps -------------------------------------------------------------------
    def _small_cache(self, name: str) -> tuple[OrderedDict, threading.Lock]:
        """One of this studio's small LRU caches, made on first use (the mixins do not own ``__init__``)."""
        return self.__dict__.setdefault(name, (OrderedDict(), threading.Lock()))

    def _token_namer(self, memory: Memory):
        """Token ids → text with the loaded backbone's tokenizer, when the memory was built on it (else "#id")."""
        bb = self._bb
        if bb is not None and bb.fingerprint == memory.fingerprint:
            return bb.token_str, bb.decode
        return (lambda t: f"#{int(t)}"), (lambda ids: " ".join(f"#{int(t)}" for t in ids))

    def _profile(self, memory: Memory) -> dict:
        cache, lock = self._small_cache("_profile_cache")
        with lock:
            if memory.id in cache:
                cache.move_to_end(memory.id)
                return cache[memory.id]
        prof = memory_profile(memory, self._token_namer(memory)[0])
        with lock:
            cache[memory.id] = prof
            while len(cache) > PROFILE_CACHE:
                cache.popitem(last=False)
        return prof

    def memory_profile(self, memory_id: str, *, owner: str | None = None) -> dict:
        """The profile of one of the owner's memories (``memories.profile.memory_profile``: counts, value-token
        frequencies, a 2-D PCA projection of a seeded sample of ≤ 2,000 keys), computed once per memory."""
        return self._profile(self._memory(memory_id, owner))

    def memory_token(self, memory_id: str, token_id: int, *, owner: str | None = None) -> dict:
        """One value token of one of the owner's memories: its count, its spread in the profile's sample and a few
        of its occurrences, each with the token marked inside its sample's target (``before``/``match``/
        ``after``)."""
        mem = self._memory(memory_id, owner)
        try:
            tid = int(token_id)
        except (TypeError, ValueError):
            raise UserError("Pick a token of the memory's frequency list.") from None
        prof = self._profile(mem)
        top = next((t for t in prof["top_tokens"] if t["token_id"] == tid), None)
        count = top["count"] if top else int((np.asarray(mem.values) == tid).sum())
        if not count:
            raise UserError(f"The memory has no entry with token #{tid}.")
        name, decode = self._token_namer(mem)
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

    def _output_states(self, p: dict, row: dict) -> np.ndarray:
        """f(c) before each of a row's output tokens (n × d, float32): one teacher-forced pass of the backbone over
        the comparison's context and the row's tokens, cached per (comparison, row). The decode computed the same
        states with a KV cache (equal up to float rounding)."""
        cache, lock = self._small_cache("_query_cache")
        key = (p["id"], row["label"])
        with lock:
            if key in cache:
                return cache[key]
        ctx, toks = list(p["context_ids"]), list(row["tokens"])
        with self._interactive("a neighbour map") as bb:
            with torch.no_grad():
                fc, _ = bb.forward_fc(torch.tensor([ctx + toks[:-1]], dtype=torch.long))
        start = len(ctx) - 1  # the position whose next token is the first output token
        out = fc[0, start:start + len(toks)].float().cpu().numpy()
        with lock:
            cache[key] = out
            while len(cache) > QUERY_CACHE:
                cache.popitem(last=False)
        return out

    @staticmethod
    def _nearest(memory: Memory, queries: np.ndarray, k: int) -> np.ndarray:
        """For each query (n × d, scaled like the keys), the ``k`` entries whose scaled keys are nearest (squared
        L2 over every entry, one pass over the keys in chunks): (n × k) entry indices, nearest first. The caller
        recomputes the exact distances of what it shows."""
        q = np.atleast_2d(np.asarray(queries, dtype=np.float32))
        q_sq = (q ** 2).sum(1)[:, None]
        best_e, best_d = np.zeros((len(q), 0), np.int64), np.zeros((len(q), 0), np.float32)
        for b0 in range(0, len(memory), SEARCH_CHUNK):
            rows = np.arange(b0, min(len(memory), b0 + SEARCH_CHUNK))
            keys = scaled_keys(memory, rows)
            d = (keys ** 2).sum(1)[None, :] - 2 * q @ keys.T + q_sq
            e = np.concatenate([best_e, np.broadcast_to(rows, d.shape)], 1)
            d = np.concatenate([best_d, d], 1)
            keep = np.argsort(d, axis=1, kind="stable")[:, :k]
            best_e, best_d = np.take_along_axis(e, keep, 1), np.take_along_axis(d, keep, 1)
        return best_e

    def _map_queries(self, p: dict, row: dict, plugin, memory: Memory, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The map's query before each of a row's output tokens (``Plugin.map_queries``, among the scaled keys) and
        each one's ``k`` nearest entries: one pass over the memory's keys for all the tokens, cached per
        (comparison, row, k) — picking another token then costs nothing."""
        cache, lock = self._small_cache("_query_cache")
        key = (p["id"], row["label"], row["method"], k)
        with lock:
            if key in cache:
                return cache[key]
        h = plugin.map_queries(self._output_states(p, row), memory)
        out = (h, self._nearest(memory, h, k))
        with lock:
            cache[key] = out
            while len(cache) > QUERY_CACHE:
                cache.popitem(last=False)
        return out

    def neighbour_map(self, comparison_id: str, label: str, token_index: int, *, owner: str | None = None,
                      k: int = MAP_NEIGHBOURS) -> dict:
        """One output token of a kNN or PEMA row of the owner's comparison, on its memory's 2-D map (the profile's
        projection): the query — kNN: f(c) / key RMS; PEMA: h_pd = B_pd·A·(f(c) / key RMS), rescaled to the keys'
        RMS — and its ``k`` nearest memory entries, each with its value token marked inside its sample's target
        and its source. The profile's sampled keys come along as the map's background."""
        owner = self._owner(owner)
        p = self.recent(comparison_id, owner=owner)
        row = next((r for r in p["rows"] if r["label"] == label), None)
        if row is None:
            raise UserError(f"No output {label!r} in this comparison.")
        kinds = getattr(available_methods().get(row["method"]), "map_kinds", None)
        if kinds is None or not row.get("plugin_id"):
            raise UserError(f"The neighbour map is for kNN and PEMA rows; {label!r} is {row['method']}.")
        try:
            i = int(token_index)
            k = int(k)
        except (TypeError, ValueError):
            raise UserError("The output token and k must be whole numbers.") from None
        if not 0 <= i < len(row["tokens"]):
            raise UserError(f"{label!r} has {len(row['tokens'])} output token(s); token {i} does not exist.")
        if not 1 <= k <= 64:
            raise UserError("k (neighbours on the map) must be between 1 and 64.")
        if p.get("backbone") != (self._bb.name if self._bb is not None else None):
            raise UserError("This comparison was made on another backbone.")
        if self._offsite():
            raise UserError("A neighbour map runs the decoder over the output again, and the model owner keeps the "
                            "decoder: not available with a remote backbone.")
        plugin = self._plugin(row["plugin_id"], owner)
        memory = getattr(plugin, "memory", None)
        if memory is None:
            try:
                memory = self._memory(self._plugin_row(row["plugin_id"], owner)["memory_id"], owner)
            except UserError:
                raise UserError(f"The memory {label!r} was trained on has been deleted: no map.") from None
        if len(memory) == 0:
            raise UserError("The memory has no training entries to map.")
        prof = self._profile(memory)
        traced = (row["trace"][i].get("neighbours") or []) if i < len(row["trace"]) else []
        if plugin.map_traced_neighbours:  # the neighbours the decode retrieved (an exact search if it traced none)
            query = plugin.map_queries(self._output_states(p, row)[i:i + 1], memory)
            entries = [int(n["entry"]) for n in traced if n.get("entry") is not None][:k] \
                or [int(e) for e in self._nearest(memory, query, k)[0]]
        else:
            h, nearest = self._map_queries(p, row, plugin, memory, k)
            query, entries = h[i:i + 1], [int(e) for e in nearest[i]]
        keys = scaled_keys(memory, np.asarray(entries, dtype=np.int64))
        dist = ((keys - query) ** 2).sum(1)
        xy, q_xy = project(prof, keys), project(prof, query)[0]
        name, decode = self._token_namer(memory)
        decode_dist = {int(n["entry"]): n.get("distance") for n in traced if n.get("entry") is not None}
        out_tok = int(row["tokens"][i])
        nbs = []
        for rank, (e, d, (x_, y_)) in enumerate(zip(entries, dist.tolist(), xy.tolist())):
            h = highlighted_target(memory, e, decode, name)
            tid = int(memory.values[e])
            nbs.append({"rank": rank + 1, "entry": e, "token_id": tid, "token": name(tid),
                        "same_as_output": tid == out_tok, "distance": round(float(d), 4),
                        "decode_distance": decode_dist.get(e), "xy": [round(x_, 4), round(y_, 4)],
                        "source": memory.samples[h["sample"]].get("src") or "", **h})
        query_label, query_kind, neighbour_kind = kinds
        proj = prof["projection"]
        return {"comparison_id": p["id"], "label": label, "method": row["method"], "token_index": i,
                "token_id": out_tok, "token": name(out_tok), "memory_id": memory.id, "memory_name": prof["name"],
                "query_label": query_label, "query_kind": query_kind, "neighbour_kind": neighbour_kind,
                "query": [round(float(q_xy[0]), 4), round(float(q_xy[1]), 4)], "neighbours": nbs,
                "matching": sum(n["same_as_output"] for n in nbs),
                "projection": {"method": proj["method"], "explained": proj["explained"],
                               "points": proj["points"], "tokens": proj["tokens"]}}
