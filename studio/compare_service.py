"""The Studio's comparisons: one batched decode of every chosen method, token traces, attention, and shares.

A comparison is its owner's (kept in this process, under a random id); sharing stores a reduced copy that anyone with
its unguessable id may read: input, outputs, settings, token traces, method names and neutral row labels ("PEMA",
"kNN-LM · 2" — never a plug-in's or memory's name, which often is the uploaded file's name, unless the owner typed
labels for the share); never the reference, samples, file names, ids or the prompt.
"""
from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections import Counter, OrderedDict
from typing import Any

from backbone.attention import input_attention
from backbone.prompts import Prompt
from backbone.tasks import task_prompt
from engine import BatchDecode, decode_batch, start_compare
from eval.metrics import bleu_chrf
from ground.errors import UserError
from offsite.decode import compare_remote
from plugins.registry import get_method
from plugins.settings import ALL_ROWS, calibration_label, method_row, plugin_calibration, resolve_row_settings
from studio.backbone_service import REMOTE_LM, BackboneService
from studio.caches import LRU
from studio.context import StudioContext
from studio.limits import Limits
from studio.memory_service import MemoryService
from studio.payload import json_safe, shared_trace, word_diff
from studio.plugin_service import PluginService
from studio.several_service import parse_lines, reference_scores

RECENT_PER_OWNER = 16  # comparisons an owner can still share (the newest)
RECENT_COMPARISONS = 1024  # of all owners together
RECENT_BYTES = 128_000_000  # and their JSON at most (a long comparison with token traces is large)
PROMPT_BUILTIN = "builtin"  # a comparison's prompt_from: the task's built-in examples (else a memory id, or None)
LIVE_PER_OWNER, LIVE_TOTAL = 2, 8  # kept for slider moves (each holds its KV cache: ~7 MB per row on Gemma 3 270M)


def with_comparison(settings: dict | None, no_repeat_ngram: int | None) -> dict | None:
    """``settings`` with the repetition guard given as a keyword added to its ``"all"`` block."""
    if no_repeat_ngram is None:
        return settings
    if settings is not None and not isinstance(settings, dict):
        raise UserError('Decode settings must be an object like {"pema": {"lambda_max": 0.5}}.')
    out = dict(settings or {})
    out[ALL_ROWS] = {**(out.get(ALL_ROWS) or {}), "no_repeat_ngram": no_repeat_ngram}
    return out


def check_decode(limits: Limits, max_new_tokens, num_beams: int = 1) -> tuple[int, int]:
    """(max new tokens, beams) as whole numbers within ``limits``, or a UserError (Compare and Evaluate)."""
    try:
        mx, nb = int(max_new_tokens), int(num_beams)
    except (TypeError, ValueError):
        raise UserError("Max new tokens and beams must be whole numbers.") from None
    if mx < 1:
        raise UserError("Max new tokens must be at least 1.")
    if nb < 1:
        raise UserError("Beams must be at least 1 (1 = greedy).")
    limits.check("max_new_tokens", mx, "Max new tokens")
    limits.check("beams", nb, "The number of beams")
    return mx, nb


class ComparisonStore:
    """This process's comparisons, per owner, under one lock: the finished ones an owner can still share or
    inspect (``recent``), the kept decodes a slider move reuses (``live``: each holds a KV cache) and the generation
    of each streamed view (a newer stream in the same view stops the older one)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, tuple[str, dict]] = OrderedDict()
        self._sizes: dict[str, int] = {}  # each kept comparison's JSON size
        self._live: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        self._streams: OrderedDict[tuple, int] = OrderedDict()

    def keep_recent(self, owner: str, payload: dict) -> None:
        """Keep a finished comparison for its owner to share: the owner's newest ``RECENT_PER_OWNER`` (another
        owner's comparisons never push one out), at most ``RECENT_COMPARISONS`` and ``RECENT_BYTES`` (their JSON)
        in all, oldest out first."""
        size = len(json.dumps(payload, default=str))
        with self._lock:
            self._recent[payload["id"]] = (owner, payload)
            self._sizes[payload["id"]] = size
            for k in [k for k, (o, _) in self._recent.items() if o == owner][:-RECENT_PER_OWNER]:
                del self._recent[k]
            while len(self._recent) > RECENT_COMPARISONS or (
                    len(self._recent) > 1 and sum(self._sizes.get(k, 0) for k in self._recent) > RECENT_BYTES):
                self._recent.popitem(last=False)
            self._sizes = {k: self._sizes[k] for k in self._recent if k in self._sizes}

    def recent(self, comparison_id, owner: str) -> dict | None:
        """The owner's kept comparison, or None (gone, or another owner's)."""
        with self._lock:
            owner_p = self._recent.get(comparison_id) if isinstance(comparison_id, str) else None
        return owner_p[1] if owner_p is not None and owner_p[0] == owner else None

    def recent_owners(self) -> dict[str, str]:
        """``{comparison id: owner}`` of every kept comparison, oldest first."""
        with self._lock:
            return {k: o for k, (o, _) in self._recent.items()}

    def keep_live(self, owner: str, comparison_id: str, live) -> None:
        """Keep ``live`` (what the next slider move of this comparison reuses) for its owner: the owner's newest
        ``LIVE_PER_OWNER``, at most ``LIVE_TOTAL`` in all, least recently used out first."""
        with self._lock:
            self._live[comparison_id] = (owner, live)
            for k in [k for k, (o, _) in self._live.items() if o == owner][:-LIVE_PER_OWNER]:
                del self._live[k]
            while len(self._live) > LIVE_TOTAL:
                self._live.popitem(last=False)

    def take_live(self, owner: str, source: str, max_new_tokens: int, labels: list[str]):
        """(id, kept comparison) of the owner's newest kept comparison of this sentence, length and rows — taken
        out while a move uses it — or (None, None)."""
        with self._lock:
            for cid, (o, live) in reversed(list(self._live.items())):
                if o == owner and live.source == source and live.max_new_tokens == max_new_tokens \
                        and [r.label for r in live.rows] == labels:
                    del self._live[cid]
                    return cid, live
        return None, None

    def forget_live(self) -> None:
        """Drop every kept decode (the next comparison of each is a full decode)."""
        with self._lock:
            self._live.clear()

    def bump_stream(self, key) -> int:
        """A new generation of the streamed view ``key`` (the older stream in it stops at its next step)."""
        if key is None:
            return 0
        with self._lock:
            self._streams[key] = self._streams.get(key, 0) + 1
            self._streams.move_to_end(key)
            while len(self._streams) > 4096:  # forgetting an old view only forgets a finished stream
                self._streams.popitem(last=False)
            return self._streams[key]

    def stream_generation(self, key) -> int:
        with self._lock:
            return self._streams.get(key, 0)


class CompareService:
    """Comparisons (kept in memory per process), several sentences at once, and shared comparisons (stored under
    unguessable ids).

    Receives the context, the backbone (exclusive use for each decode), the memories (a row's samples), the
    plug-ins (each row's loaded plug-in), the loaded plug-in cache (a row's neighbours read its memory without
    loading it) and the store of this process's comparisons."""

    def __init__(self, ctx: StudioContext, backbone_svc: BackboneService, memory_svc: MemoryService,
                 plugin_svc: PluginService, plugin_cache: LRU, store: ComparisonStore):
        self.ctx = ctx
        self.backbone_svc = backbone_svc
        self.memory_svc = memory_svc
        self.plugin_svc = plugin_svc
        self.plugin_cache = plugin_cache
        self.store = store

    # --- comparing ----------------------------------------------------------------------------------------------
    def rows(self, methods: list[str], task: str, settings: dict | None, owner: str | None = None,
              calibrated: bool = True):
        """``Row``s for the chosen methods ("base" or plug-in ids), each with its complete decode settings:
        declared defaults ← tuned for (task, backbone) ← calibrated on the plug-in's memory (unless not
        ``calibrated``: the global defaults) ← ``settings`` addressed to the row by method name, plug-in id or
        label (``{key: {name: value}}``; a name the row's method does not declare is an error)."""
        if settings is not None and not isinstance(settings, dict):
            raise UserError('Decode settings must be an object like {"pema": {"lambda_max": 0.5}}.')
        rows, labels = [], set()
        if not methods:
            raise UserError("Choose at least one method to compare.")
        if not isinstance(methods, (list, tuple)) or not all(isinstance(m, (str, type(None))) for m in methods):
            raise UserError('Methods must be a list like ["base", "<plug-in id>"].')
        self.ctx.limits.check("methods_per_comparison", len(methods), "The number of methods")
        for m in methods:
            if m in ("base", "", None):
                # the base model has no settings of its own; the comparison's (repetition guard) apply to it too
                rows.append(method_row("Base model", None, task, None,
                                       resolve_row_settings(("base", "Base model"), settings)))
                labels.add("Base model")
                continue
            plugin = self.plugin_svc.load_plugin(m, owner)
            row = self.plugin_svc.plugin_row(m, owner)
            label = row["name"]
            if label in labels:
                label = f"{label} [{m[-6:]}]"
            labels.add(label)
            own = resolve_row_settings((plugin.method, m, label), settings)
            rows.append(method_row(label, plugin, task, self.backbone_svc.backbone().name, own, calibrated))
        return rows

    @staticmethod
    def tuned(rows, calibrated: bool) -> dict[str, dict]:
        """``{row label: {"label": "tuned on N held-out samples of <memory>", "settings", "at_tuned"}}`` for the
        rows whose plug-in is calibrated (``at_tuned``: the row decodes at the tuned values); none with
        ``calibrated`` off (the global defaults)."""
        out = {}
        for r in rows if calibrated else ():
            cal = plugin_calibration(r.plugin) if r.plugin is not None else None
            if cal:
                out[r.label] = {"label": calibration_label(cal), "settings": cal["settings"],
                                "at_tuned": all(r.settings.as_dict().get(k) == v
                                                for k, v in cal["settings"].items())}
        return out

    def prompt_for(self, task: str, rows) -> Any:
        """The memory's prompt of the chosen plug-ins when it is for this task, else the task's tuned prompt (an
        evaluation's or a rank's: its methods are fixed for the run)."""
        return self.base_prompt(task, rows)[0]

    def base_prompt(self, task: str, rows, prompt_from: str | None = None, owner: str | None = None) -> tuple:
        """``(prompt, what it is)``: the prompt of every row of a comparison that does not bring its own (the
        retrieved examples do), chosen by ``prompt_from`` — ``"builtin"`` (the task's tuned prompt, its built-in
        examples), one of the owner's memory ids (that memory's own examples), or None (``"auto"``: the memory of
        the first chosen plug-in of this task, else the built-in). What it is: ``{"kind": "memory" | "builtin",
        "label", "examples", "memory_id"}`` — the payload's ``prompt_source``; a share keeps only the kind and
        the number of examples (``base_examples``)."""
        if prompt_from in (None, "", "auto"):
            for r in rows:
                meta = getattr(r.plugin, "memory_meta", None) or {}
                if r.plugin is not None and meta.get("prompt") and meta.get("task") == task:
                    prompt = Prompt.from_dict(meta["prompt"])
                    row = self.ctx.catalog.memory(str(meta.get("id") or ""), self.ctx.owner(owner))
                    return prompt, self._prompt_source(prompt, row["id"] if row else None,
                                                       row["name"] if row else None)
        elif prompt_from != PROMPT_BUILTIN:
            row = self.prompt_memory(prompt_from, task, owner)
            prompt = self.memory_svc.load_memory(prompt_from, owner).prompt
            return prompt, self._prompt_source(prompt, prompt_from, row["name"])
        prompt = task_prompt(task, self.backbone_svc.backbone())
        return prompt, self._prompt_source(prompt, kind="builtin")

    def prompt_memory(self, prompt_from, task: str, owner: str | None = None) -> dict:
        """The owner's memory whose own examples ``prompt_from`` (a memory id) chooses, checked to be of ``task``
        (an evaluation checks it when queued, ``base_prompt`` when it decodes)."""
        if not isinstance(prompt_from, str):
            raise UserError('The prompt must be "builtin" or one of your memories\' ids.')
        row = self.memory_svc.memory_row(prompt_from, owner)
        if row.get("task") != task:
            raise UserError(f"The memory {row['name']!r} holds {row.get('task')} examples, not {task}: choose "
                            f"a {task} memory or the built-in examples for the prompt.")
        return row

    @staticmethod
    def _prompt_source(prompt, memory_id: str | None = None, name: str | None = None, kind: str = "memory") -> dict:
        n = len(prompt.examples or [])
        label = f"built-in examples ({n})" if kind == "builtin" else f"{name or 'the memory'}'s own examples ({n})"
        return {"kind": kind, "label": label, "examples": n, "memory_id": memory_id}

    def compare(self, source: str, task: str = "translation", methods: list[str] | None = None,
                settings: dict | None = None, max_new_tokens: int = 48, num_beams: int = 1,
                reference: str | None = None, *, owner: str | None = None, no_repeat_ngram: int | None = None,
                global_defaults: bool = False, prompt_from: str | None = None) -> dict:
        """Decode ``source`` with every chosen method (the owner's plug-ins) in one batch; return a JSON-able
        comparison payload, kept for its owner under ``payload["id"]``.

        ``methods``: "base" and/or plug-in ids. ``settings``: ``{method | plug-in id | label: {name: value}}``,
        each block given only to the rows it names (see ``_rows``), and ``{"all": {...}}`` for the settings of the
        whole comparison (``engine.comparison.COMPARISON_SETTINGS``: the repetition guard ``no_repeat_ngram``, also
        a keyword here); each row's complete settings are in the payload.

        A slider move — the same sentence, methods and decode length as one of the owner's last comparisons, other
        row settings — re-decodes only what changed (``engine.LiveComparison``; ``timings.reuse`` in the
        payload says what was reused and how many backbone forward passes ran).

        A plug-in calibrated on its memory (``eval.calibrate``) starts at its tuned settings (its row's ``tuned``
        says so: "tuned on N held-out samples of <memory>"); ``global_defaults`` starts every row at the global
        defaults instead.

        ``prompt_from`` chooses the one prompt of every row that does not bring its own (``base_prompt``:
        ``"builtin"``, a memory id, or None for the first chosen plug-in's memory); ticking or unticking methods
        then changes no other row's tokens (a row that brings its own prompt, the retrieved examples, is prefilled
        apart: ``engine.prefill``). The payload's ``prompt_source`` says which prompt it was.
        """
        payload = None
        for payload in self._compare_steps(source, task, methods, settings, max_new_tokens, num_beams, reference,
                                           owner=owner, no_repeat_ngram=no_repeat_ngram, partials=False,
                                           global_defaults=global_defaults, prompt_from=prompt_from):
            pass
        return payload

    def compare_stream(self, source: str, task: str = "translation", methods: list[str] | None = None,
                       settings: dict | None = None, max_new_tokens: int = 48, num_beams: int = 1,
                       reference: str | None = None, *, owner: str | None = None,
                       no_repeat_ngram: int | None = None, stream: str | None = None,
                       global_defaults: bool = False, prompt_from: str | None = None):
        """``compare`` streamed: yields a partial payload (``"partial": True``: every row's tokens so far) after
        each decoding step — the first after the first step — then the final payload, the same as ``compare``'s.

        ``stream`` names the caller's view (a browser tab): a later ``compare_stream`` with the same owner and
        ``stream``, or ``cancel_compare``, stops this one between two steps; it then ends with a payload marked
        ``"cancelled": True`` (the rows so far; not kept). The decode runs in a worker thread that holds the
        backbone for the decode, as ``compare`` does; closing this generator stops it too."""
        owner = self.ctx.owner(owner)
        key = (owner, stream) if stream is not None else None
        mine = self.store.bump_stream(key)
        closed = threading.Event()

        def stopped() -> bool:
            return closed.is_set() or (key is not None and self.store.stream_generation(key) != mine)

        items: queue.Queue = queue.Queue()

        def work() -> None:
            try:
                for p in self._compare_steps(source, task, methods, settings, max_new_tokens, num_beams, reference,
                                             owner=owner, no_repeat_ngram=no_repeat_ngram, should_stop=stopped,
                                             global_defaults=global_defaults, prompt_from=prompt_from):
                    items.put(("payload", p))
            except BaseException as e:  # noqa: BLE001 — handed over to the caller's thread as it is
                items.put(("error", e))
            finally:
                items.put(("end", None))

        threading.Thread(target=work, name="pema-compare-stream", daemon=True).start()
        try:
            while True:
                kind, value = items.get()
                if kind == "payload":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            closed.set()

    def cancel_compare(self, *, owner: str | None = None, stream: str | None = None) -> None:
        """Stop the owner's streamed comparison in view ``stream`` between two steps (nothing when none runs)."""
        self.store.bump_stream((self.ctx.owner(owner), stream))

    def _compare_steps(self, source: str, task: str, methods, settings, max_new_tokens, num_beams, reference,
                       *, owner: str | None, no_repeat_ngram: int | None, should_stop=lambda: False,
                       partials: bool = True, global_defaults: bool = False, prompt_from: str | None = None):
        """The comparison as a generator of payloads (with ``partials``, one after each decoding step; the last is
        the final one), holding the backbone for the whole decode; ``should_stop()`` is asked between steps."""
        owner = self.ctx.owner(owner)
        self.ctx.limits.check_rate("compares_per_minute", owner)
        settings = with_comparison(settings, no_repeat_ngram)
        if not isinstance(source, str) or not source.strip():
            raise UserError("Type a sentence to translate or rewrite.")
        self.ctx.limits.check_input(source, "sentence")  # length, NUL, lone surrogates, control characters
        if reference is not None:
            self.ctx.limits.check_input(reference, "reference")
        max_new_tokens, num_beams = check_decode(self.ctx.limits, max_new_tokens, num_beams)
        t0 = time.time()
        if not isinstance(methods, (list, tuple, type(None))):
            raise UserError('Methods must be a list like ["base", "<plug-in id>"].')
        methods = list(methods or ["base"])
        self.ctx.limits.check("methods_per_comparison", len(methods), "The number of methods")
        with self.backbone_svc.interactive("a comparison") as bb:
            rows = self.rows(methods, task, settings, owner, calibrated=not global_defaults)
            tuned = self.tuned(rows, not global_defaults)
            t_load = time.time() - t0
            prompt, prompt_source = self.base_prompt(task, rows, prompt_from, owner)
            src = source.strip()
            reuse = {"kind": "full decode", "forward_passes": None, "reused_steps": 0}
            if self.backbone_svc.offsite(bb):
                # a model owner's backbone decodes in the owner's session, the plug-ins mix here (offsite.decode)
                comp = compare_remote(bb, src, rows, prompt=prompt, max_new_tokens=int(max_new_tokens),
                                      num_beams=int(num_beams), lm=REMOTE_LM)
                new_live = None
            else:
                live_id, live = self.store.take_live(owner, src, int(max_new_tokens), [r.label for r in rows])
                run = start_compare(bb, src, rows, prompt, int(max_new_tokens), int(num_beams), live=live)
                moved = not isinstance(run, BatchDecode)

                def so_far() -> dict | None:  # a move's partial payloads say it is one (the view's header)
                    return ({"kind": "slider move", "forward_passes": run.forwards,
                             "reused_steps": run.reused_steps} if moved else None)
                while not should_stop() and run.step():
                    if partials:
                        yield self._payload(run.partial()[0], methods, task, reference, bb, prompt, t0, t_load,
                                            int(max_new_tokens), partial=True, reuse=so_far(),
                                            prompt_source=prompt_source)
                if not run.finished:  # stopped: what is kept stays as it was (a move commits when it finishes)
                    if live is not None:
                        self.store.keep_live(owner, live_id, live)
                    yield self._payload(run.partial()[0], methods, task, reference, bb, prompt, t0, t_load,
                                        int(max_new_tokens), partial=True, cancelled=True, reuse=so_far(),
                                        prompt_source=prompt_source)
                    return
                comp = run.result()[0]
                new_live = run.live()  # what the next slider move reuses (either kind of run)
                reuse = {"kind": "slider move" if moved else "full decode", "forward_passes": run.forwards,
                         "reused_steps": run.reused_steps if moved else 0}
        payload = self._payload(comp, methods, task, reference, bb, prompt, t0, t_load, int(max_new_tokens),
                                reuse=reuse, tuned=tuned, prompt_source=prompt_source)
        self.store.keep_recent(owner, payload)
        if new_live is not None:
            self.store.keep_live(owner, payload["id"], new_live)
        yield payload

    @staticmethod
    def _payload(comp, methods: list[str], task: str, reference, bb, prompt, t0: float, t_load: float,
                 max_new_tokens: int, partial: bool = False, cancelled: bool = False, reuse: dict | None = None,
                 tuned: dict | None = None, prompt_source: dict | None = None) -> dict:
        total = time.time() - t0
        base = next((r for r in comp.rows if r.method == "base"), comp.rows[0])
        out_rows = []
        for spec, r in zip(methods, comp.rows):
            out_rows.append({"label": r.label, "method": r.method, "plugin_id": None if spec == "base" else spec,
                             "text": r.text, "raw_text": r.raw_text, "tokens": r.tokens,
                             "token_texts": r.token_texts, "trace": json_safe(r.trace),
                             "settings": json_safe(r.settings), "score": r.score, "n_tokens": len(r.tokens),
                             "diff": word_diff(base.text, r.text) if r is not base else [[r.text, "same"]],
                             "tuned": (tuned or {}).get(r.label),  # the owner's view only: shares leave it out
                             "prompt": r.prompt})  # a row prompted its own way (its examples): the owner's view only
        n_tok = sum(len(r.tokens) for r in comp.rows)
        payload = {"id": secrets.token_urlsafe(12), "source": comp.source, "task": task,
                   "reference": reference or None, "backbone": bb.name, "prompt": prompt.to_dict(),
                   "prompt_source": prompt_source,
                   "context_ids": comp.context_ids, "src_len": comp.src_len, "base_label": base.label,
                   "rows": out_rows, "steps": comp.steps, "num_beams": comp.num_beams,
                   "max_new_tokens": int(max_new_tokens),
                   "timings": {"load_plugins_s": round(t_load, 3), "decode_s": round(comp.seconds, 3),
                               "total_s": round(total, 3), "tokens": n_tok,
                               "tokens_per_s": round(n_tok / max(comp.seconds, 1e-9), 1)},
                   "created": time.time()}
        if reuse is not None:
            payload["timings"]["reuse"] = reuse
        if partial:
            payload.update(partial=True, cancelled=cancelled)
        return payload

    def recent(self, comparison_id: str, *, owner: str | None = None) -> dict:
        """One of the owner's comparisons of this process (another owner's reads as gone)."""
        p = self.store.recent(comparison_id, self.ctx.owner(owner))
        if p is None:
            raise UserError("That comparison is no longer in memory (the app was restarted?). Run it again.")
        return p

    def neighbours(self, comparison_id: str, label: str, token_index: int, *, owner: str | None = None) -> list[dict]:
        """The kNN neighbours of one output token with their memory samples (the owner's view only)."""
        owner = self.ctx.owner(owner)
        p = self.recent(comparison_id, owner=owner)
        row = next((r for r in p["rows"] if r["label"] == label), None)
        if row is None or not 0 <= token_index < len(row["trace"]):
            return []
        nb = row["trace"][token_index].get("neighbours") or []
        if not nb:
            return []
        samples = []
        prow = self.ctx.catalog.plugin(row["plugin_id"], owner) if row.get("plugin_id") else None
        if prow is None:  # deleted since (or never the owner's): no samples
            return []
        plugin = self.plugin_cache.peek(row["plugin_id"])
        mem = getattr(plugin, "memory", None)
        if mem is None and self.ctx.catalog.memory(prow["memory_id"], owner):
            mem = self.memory_svc.load_memory(prow["memory_id"], owner)
        if mem is not None:
            samples = mem.samples
        bb = self.backbone_svc.loaded_backbone()
        out = []
        for n in nb:
            s = samples[n["sample"]] if samples and 0 <= n.get("sample", -1) < len(samples) else {}
            out.append({"token": bb.token_str(n["token"]) if bb else str(n["token"]), "distance": n["distance"],
                        "entry": n.get("entry"), "source": s.get("src", ""), "target": s.get("tgt", "")})
        return out

    def attention(self, comparison: dict, label: str, layer: int = -1) -> dict:
        """The backbone's attention from one row's output tokens to the input sentence's tokens. ``comparison`` is
        the caller's own payload (from ``compare``): this reads nothing of any owner, only runs the backbone."""
        row = next((r for r in comparison["rows"] if r["label"] == label), None)
        if row is None:
            raise UserError(f"No output {label!r} in this comparison.")
        loaded = self.backbone_svc.loaded_backbone()
        if comparison.get("backbone") != (loaded.name if loaded else None):
            raise UserError("This comparison was made on another backbone.")
        if self.backbone_svc.offsite():
            raise UserError("Attention maps need the decoder's layers, which the model owner keeps: not available "
                            "with a remote backbone.")
        with self.backbone_svc.interactive("attention") as bb:
            own = row.get("prompt")  # a row prompted its own way attends over its own context
            return input_attention(bb, Prompt.from_dict(own or comparison["prompt"]), comparison["source"],
                                   row["tokens"], layer=int(layer),
                                   context_ids=None if own else comparison.get("context_ids"))

    def compare_several(self, text: str, task: str = "translation", methods: list[str] | None = None,
                        settings: dict | None = None, max_new_tokens: int = 48, num_beams: int = 1, *,
                        owner: str | None = None, no_repeat_ngram: int | None = None,
                        prompt_from: str | None = None) -> dict:
        """Decode every pasted line (``studio.several_service.parse_lines``) with every chosen method in one batch.
        ``methods`` and ``settings`` as ``compare``. Returns ``{"task", "backbone", "columns": [{"label", "method",
        "plugin_id", "settings"}], "lines": [{"line", "source", "reference", "outputs": [text per column],
        "scores": [{"sacrebleu", "chrf"} per column] | None}], "corpus": [{"label", "sacrebleu", "chrf", "n"}]
        (lines with a reference), "timings"}``."""
        owner = self.ctx.owner(owner)
        if self.backbone_svc.offsite():
            raise UserError("Several sentences at once decode on this machine's backbone; with a remote backbone, "
                            "compare one sentence at a time.")
        limits = self.ctx.limits
        limits.check_rate("compares_per_minute", owner)
        settings = with_comparison(settings, no_repeat_ngram)
        lines = parse_lines(text)
        limits.check("compare_lines", len(lines), "The number of sentences")
        for ln in lines:  # the same text checks as one sentence (length, NUL, surrogates, control characters)
            limits.check_input(ln["source"], f"line {ln['line']}'s sentence")
            if ln["reference"] is not None:
                limits.check_input(ln["reference"], f"line {ln['line']}'s reference")
        max_new_tokens, num_beams = check_decode(limits, max_new_tokens, num_beams)
        if not isinstance(methods, (list, tuple, type(None))):
            raise UserError('Methods must be a list like ["base", "<plug-in id>"].')
        methods = list(methods or ["base"])
        t0 = time.time()
        with self.backbone_svc.interactive("several sentences") as bb:
            rows = self.rows(methods, task, settings, owner)
            prompt, prompt_source = self.base_prompt(task, rows, prompt_from, owner)
            comps = decode_batch(bb, [ln["source"] for ln in lines], rows, prompt=prompt,
                                 max_new_tokens=max_new_tokens, num_beams=num_beams, trace=False)
        decode_s = comps[0].seconds if comps else 0.0
        columns = [{"label": r.label, "method": r.method, "plugin_id": None if spec == "base" else spec,
                    "settings": json_safe(r.settings)} for spec, r in zip(methods, comps[0].rows)]
        with_ref = [i for i, ln in enumerate(lines) if ln["reference"] is not None]
        refs = [lines[i]["reference"] for i in with_ref]
        per_col = []  # per column: {line index: scores}
        corpus = []
        for c, col in enumerate(columns):
            hyps = [comps[i].rows[c].text for i in with_ref]
            per_col.append(dict(zip(with_ref, reference_scores(hyps, refs))))
            if with_ref:
                corpus.append({"label": col["label"], **bleu_chrf(hyps, refs), "n": len(with_ref)})
        out_lines = []
        for i, (ln, comp) in enumerate(zip(lines, comps)):
            out_lines.append({**ln, "outputs": [r.text for r in comp.rows],
                              "scores": [per_col[c][i] for c in range(len(columns))] if i in per_col[0] else None})
        n_tok = sum(len(r.tokens) for comp in comps for r in comp.rows)
        return {"task": task, "backbone": bb.name, "columns": columns, "lines": out_lines, "corpus": corpus,
                "prompt_source": prompt_source,
                "max_new_tokens": max_new_tokens, "num_beams": num_beams,
                "timings": {"decode_s": round(decode_s, 3), "total_s": round(time.time() - t0, 3), "tokens": n_tok,
                            "tokens_per_s": round(n_tok / max(decode_s, 1e-9), 1), "sentences": len(lines)}}

    # --- sharing ------------------------------------------------------------------------------------------------
    def share_labels(self, p: dict, labels: dict | None = None) -> dict[str, str]:
        """``{row label: label in the share}``: the method's title ("PEMA"; "PEMA · 2" for a second PEMA row), or
        the owner's own label from ``labels`` (keyed by row label, plug-in id or method name)."""
        if labels is not None and not isinstance(labels, dict):
            raise UserError('Share labels must be an object like {"<plug-in id or output name>": "my label"}.')
        labels = {str(k): v for k, v in (labels or {}).items()}
        titles = []
        for r in p["rows"]:
            if r["method"] == "base":
                titles.append("Base model")
            else:
                try:
                    titles.append(get_method(r["method"]).title)
                except Exception:  # noqa: BLE001 — a method no longer registered: its name will do
                    titles.append(r["method"])
        seen, n_of = Counter(), Counter(titles)
        out: dict[str, str] = {}
        for r, title in zip(p["rows"], titles):
            seen[title] += 1
            own = next((labels[k] for k in (r["label"], r.get("plugin_id") or "", r["method"]) if k in labels), None)
            if own is not None:
                if not isinstance(own, str) or not own.strip():
                    raise UserError("A share label must be non-empty text.")
                own = self.ctx.limits.check_name(own, "share label")  # shown on a public page: no control characters
                out[r["label"]] = own
            else:
                out[r["label"]] = title if n_of[title] == 1 else f"{title} · {seen[title]}"
        if len(set(out.values())) != len(out):
            raise UserError("Two outputs of the shared comparison would have the same label; give them different "
                            "labels.")
        return out

    def share(self, comparison_id: str, layer: int | None = None, *, owner: str | None = None,
              labels: dict | None = None) -> str:
        """Store one of the owner's comparisons for read-only viewing at ``/share/?c=<id>``; return the id.

        Stored: input, task, methods and settings, outputs, token traces (kNN neighbours reduced to token and
        distance), timings, the backbone's name and the attention maps at ``layer``, each row under a neutral label
        (see ``share_labels``). Never stored: the reference (a held-out sample), memory samples, file names or
        paths, plug-in or memory names and ids, or the prompt.
        """
        owner = self.ctx.owner(owner)
        p = self.recent(comparison_id, owner=owner)
        self.ctx.limits.check_quota("shares_per_owner", self.ctx.catalog.count("comparisons", owner),
                                    "shared comparisons")
        names = self.share_labels(p, labels)
        attention = {}
        bb = self.backbone_svc.loaded_backbone()
        if bb is not None and p.get("backbone") == bb.name:
            lay = bb.num_layers - 1 if layer is None else int(layer)
            for r in p["rows"]:
                try:
                    attention[names[r["label"]]] = self.attention(p, r["label"], lay)
                except UserError:
                    pass
        payload = {
            "version": 2, "source": p["source"], "task": p["task"], "backbone": p["backbone"],
            "base_label": names[p["base_label"]], "steps": p["steps"], "num_beams": p["num_beams"],
            "max_new_tokens": p.get("max_new_tokens"), "timings": p["timings"],
            # which examples the rows without their own read: their kind and number, never the memory's name or id
            "base_examples": {"kind": p["prompt_source"].get("kind"), "count": p["prompt_source"].get("examples")}
            if p.get("prompt_source") else None,
            "rows": [{"label": names[r["label"]], "method": r["method"], "text": r["text"], "tokens": r["tokens"],
                      "token_texts": r["token_texts"], "settings": r["settings"], "score": r["score"],
                      "n_tokens": r["n_tokens"], "diff": r["diff"], "own_examples": bool(r.get("prompt")),
                      "trace": [shared_trace(t) for t in r["trace"]]} for r in p["rows"]],
            "attention": attention, "created": p["created"], "shared": time.time()}
        text = json.dumps(json_safe(payload), ensure_ascii=False)
        self.ctx.limits.check("share_bytes", len(text.encode("utf-8")), "The shared comparison's size in bytes")
        return self.ctx.catalog.save_comparison(text, backbone=p["backbone"], owner=owner)

    def shared(self, share_id: str) -> dict:
        """A shared comparison's stored payload (nothing else is read): public to anyone with the id."""
        if not share_id or not isinstance(share_id, str) or len(share_id) > 100:
            raise UserError("This link is not valid.")
        p = self.ctx.catalog.comparison(share_id)
        if p is None:
            raise UserError("This shared comparison does not exist (the link may be incomplete).")
        if p.get("version", 1) < 2:  # shared before labels were neutral: show it as a new share would be
            p = self._neutral_v1(p)
        return p

    def shares(self, *, owner: str | None = None) -> list[dict]:
        """The owner's shares (comparisons and leaderboards), newest first, with their links."""
        return [{**r, "link": f"/share/?c={r['id']}"} for r in self.ctx.catalog.shares(self.ctx.owner(owner))]

    def delete_share(self, share_id: str, *, owner: str | None = None) -> str:
        """Delete one of the owner's shares: its link stops working at once, and it no longer counts against
        ``shares_per_owner``. Another owner's share reads as nonexistent."""
        owner = self.ctx.owner(owner)
        if not isinstance(share_id, str) or not share_id.strip() or len(share_id) > 100:
            raise UserError("Give the id of one of your shares (the part after ?c= in its link).")
        sid = share_id.strip().rsplit("c=", 1)[-1]
        if not self.ctx.catalog.delete_comparison(sid, owner):
            raise UserError(f"You have no share {sid!r}.")
        return f"Deleted the share {sid}; its link no longer works."

    def _neutral_v1(self, p: dict) -> dict:
        """A version-1 share without what version 2 no longer stores (reference, prompt template) and with neutral
        row labels instead of the plug-ins' names."""
        names = self.share_labels({"rows": [{"label": r["label"], "method": r["method"]} for r in p["rows"]]})
        out = {k: v for k, v in p.items() if k not in ("reference", "prompt_template")}
        out["rows"] = [{**r, "label": names[r["label"]]} for r in p["rows"]]
        out["base_label"] = names.get(p.get("base_label"), p.get("base_label"))
        out["attention"] = {names.get(k, k): v for k, v in (p.get("attention") or {}).items()}
        return out

