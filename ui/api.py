"""Explicit API endpoints (``gradio_client`` / HTTP), named with ``api_name``. Each calls one Studio method and
returns plain JSON; a user error comes back as the client's error with the same message as in the page.

    /status /preview /build /job /jobs /cancel /memories /memory /delete_memory /methods /train /plugins
    /continue_training /compare /share /shared /evaluate /calibrate /rank /leaderboard /share_leaderboard
    /export_plugin /import_plugin   (files: the Plug-ins tab's Export / Import events, ``TAB_NAMES``)

Identity: every endpoint about an owner's things acts for the caller (``ui.common.caller``): in multi-user mode the
key sent in the ``X-Pema-Key`` header (``Client(url, headers={"X-Pema-Key": key})``), else the signed-in HF user or
the browser's cookie; another owner's memory, plug-in, job or comparison reads as nonexistent. ``/status``,
``/methods`` and ``/shared`` (given a share's id) are public; everything else refuses a caller with no identity.

Note: no ``from __future__ import annotations`` here — ``gr.api`` reads the real type hints.
"""
import inspect
import json
import typing
from typing import Optional

import gradio as gr

from ground.errors import UserError
from studio.limits import check_number
from studio.plugin_service import CALIBRATE_MAX_SAMPLES, CALIBRATE_MAX_SECONDS
from studio.rank_service import TOUR_CORPUS
from ui.common import owner_of, user_errors

_api = user_errors  # API endpoints report a UserError as the same Gradio error the UI shows


NAMES = ["status", "preview", "build", "job", "jobs", "cancel", "memories", "memory", "delete_memory", "methods",
         "train", "plugins", "continue_training", "compare", "share", "shared", "evaluate", "calibrate", "rank",
         "leaderboard", "share_leaderboard", "shares", "delete_share"]
# Named events of a tab that are API endpoints too (files in and out: ui/plugins.py's Export / Import block)
TAB_NAMES = ["export_plugin", "import_plugin"]


# The declared range of every numeric argument ("endpoint.argument": (lowest, highest), inclusive); the server
# refuses a call outside it (or with a number that is not finite), naming the argument, before anything runs.
# Bounds an operator sets (Limits: max_new_tokens, beams, eval_pairs, ...) are checked again by the service.
RANGES = {"preview.limit": (0, 20_000), "build.limit": (0, 20_000), "jobs.limit": (0, 200),
          "calibrate.max_samples": (0, CALIBRATE_MAX_SAMPLES), "calibrate.max_seconds": (0, CALIBRATE_MAX_SECONDS),
          "compare.max_new_tokens": (1, 4096), "compare.num_beams": (1, 64), "compare.no_repeat_ngram": (0, 64),
          "share.layer": (-1, 4096), "evaluate.limit": (0, 100_000), "evaluate.no_repeat_ngram": (0, 64)}
# What the items of each list argument are: names (text), or numbers within a range.
ITEMS = {"compare.methods": str, "evaluate.methods": str, "rank.methods": str, "evaluate.lambdas": (0.0, 1.0)}
MAX_ITEMS = 256  # items of one list argument


def _kind(annotation) -> tuple[type | None, bool]:
    """(the argument's type, whether null is allowed) from its type hint."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        return _kind(args[0])[0], True
    return (annotation if isinstance(annotation, type) else None), False


def check_arguments(fn, api_name: str, data: list) -> str | None:
    """Why a call of the API endpoint ``fn`` with ``data`` (its positional arguments, as sent) must be refused, or
    None: every argument of the type its hint declares (text, a whole number, a number, true/false, a list, an
    object; null only where the hint allows it), every number finite and in its declared range (``RANGES``), the
    items of a list argument of their declared kind (``ITEMS``)."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.annotation is not gr.Request and p.name != "request"]
    for p, value in zip(params, data):
        kind, nullable = _kind(p.annotation)
        key = f"{api_name}.{p.name}"
        where = f"The argument {p.name!r} of /{api_name}"
        if value is None:
            if nullable or p.default is None or kind is str:
                continue
            return f"{where} must not be null."
        if kind is bool:
            if not isinstance(value, bool):
                return f"{where} must be true or false, not {_shown(value)}."
        elif kind in (int, float):
            low, high = RANGES.get(key, (-1e15, 1e15))
            if isinstance(value, str):
                return f"{where} must be a number from {low:,} to {high:,}, not {_shown(value)}."
            try:
                check_number(value, p.name, low, high, integer=kind is int)
            except UserError as e:
                return f"{where}: {e}"
        elif kind is str:
            if not isinstance(value, str):
                return f"{where} must be text, not {_shown(value)}."
        elif kind is list:
            if not isinstance(value, list):
                return f"{where} must be a list, not {_shown(value)}."
            if len(value) > MAX_ITEMS:
                return f"{where} has {len(value)} items; at most {MAX_ITEMS}."
            items = ITEMS.get(key)
            for i, item in enumerate(value):
                if items is str and not isinstance(item, str):
                    return f"{where} must be a list of names (text); item {i + 1} is {_shown(item)}."
                if isinstance(items, tuple):
                    try:
                        if isinstance(item, str):
                            raise UserError(f"item {i + 1} must be a number, not {_shown(item)}.")
                        check_number(item, f"item {i + 1}", *items)
                    except UserError as e:
                        return f"{where}: {e}"
        elif kind is dict:
            if not isinstance(value, dict):
                return f"{where} must be an object, not {_shown(value)}."
    return None


def _shown(value) -> str:
    """What was sent, briefly, for a message (its JSON type and a short excerpt)."""
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "text", list: "a list", dict: "an object"}
    text = json.dumps(value, allow_nan=True, default=str)
    return f"{kind.get(type(value), type(value).__name__)} ({text[:40]}{'…' if len(text) > 40 else ''})"


# Every endpoint runs in a bounded group: decoding one at a time with the page's comparisons, parsing samples one at
# a time, quick reads (catalog, job state) a few at once.
CONCURRENCY = {"compare": ("decode", 1), "share": ("decode", 1), "preview": ("parse", 1), "build": ("parse", 1),
               "evaluate": ("parse", 1), "rank": ("parse", 1), "train": ("api-submit", 2),
               "continue_training": ("api-submit", 2), "calibrate": ("api-submit", 2)}


def _job_endpoints(studio) -> list:
    """The backbone's state and the caller's jobs."""

    @_api
    def status() -> dict:
        """Backbone loading state: state (loading/ready/failed), progress 0-1, message."""
        return studio.backbone_service.status()

    @_api
    def job(job_id: str, request: gr.Request = None) -> dict:
        """One of your jobs: state, progress, message, log, error, result, metrics (loss history)."""
        return studio.job_service.job(job_id, owner=owner_of(studio, request))

    @_api
    def jobs(limit: int = 30, request: gr.Request = None) -> list:
        """Your latest jobs, newest first."""
        return studio.job_service.list_jobs(limit=limit, owner=owner_of(studio, request))

    @_api
    def cancel(job_id: str, request: gr.Request = None) -> dict:
        """Cancel one of your queued jobs, or ask a running one to stop."""
        return studio.job_service.cancel_job(job_id, owner=owner_of(studio, request))

    return [status, job, jobs, cancel]


def _memory_endpoints(studio) -> list:
    """Samples and memories."""

    @_api
    def preview(text: str, filename: str = "samples.jsonl", corpus: str = "", limit: int = 0,
                request: gr.Request = None) -> dict:
        """Parse samples (file contents as text, or a demo corpus) and report samples and per-line problems."""
        me = owner_of(studio, request)
        if corpus:
            return studio.memory_service.preview(corpus=corpus, limit=limit or 200, owner=me)
        return studio.memory_service.preview(text, filename or None, owner=me)

    @_api
    def build(text: str, filename: str = "samples.jsonl", name: str = "", task: str = "translation",
              mode: str = "teacher", corpus: str = "", limit: int = 0, skip_invalid: bool = False,
              request: gr.Request = None) -> dict:
        """Validate samples and queue a memory build; returns {"job_id"}. Bad samples fail here (no job)."""
        me = owner_of(studio, request)
        if corpus:
            jid = studio.memory_service.submit_build(corpus=corpus, limit=limit or None, name=name, task=task,
                                                     mode=mode, owner=me)
        else:
            jid = studio.memory_service.submit_build(text, filename or None, name=name, task=task, mode=mode,
                                                     skip_invalid=skip_invalid, owner=me)
        return {"job_id": jid}

    @_api
    def memories(request: gr.Request = None) -> list:
        """Your memories with their statistics."""
        return studio.memory_service.memories(owner=owner_of(studio, request))

    @_api
    def memory(memory_id: str, request: gr.Request = None) -> dict:
        """One of your memories: summary, statistics, prompt, samples (incl. synthetic sources)."""
        return studio.memory_service.memory_detail(memory_id, owner=owner_of(studio, request))

    @_api
    def delete_memory(memory_id: str, request: gr.Request = None) -> dict:
        return {"message": studio.memory_service.delete_memory(memory_id, owner=owner_of(studio, request))}

    return [preview, build, memories, memory, delete_memory]


def _plugin_endpoints(studio) -> list:
    """Methods, plug-ins, their training and calibration."""

    @_api
    def methods() -> list:
        """Every plug-in method with its paper defaults and decode-time settings."""
        return studio.plugin_service.methods()

    @_api
    def train(memory_id: str, method: str = "pema", config: Optional[dict] = None, name: str = "",
              request: gr.Request = None) -> dict:
        """Validate the settings and queue plug-in training on one of your memories; returns {"job_id"}."""
        return {"job_id": studio.plugin_service.submit_train(memory_id, method, config or {}, name,
                                                             owner=owner_of(studio, request))}

    @_api
    def plugins(request: gr.Request = None) -> list:
        """Your trained plug-ins with metrics, trainable parameter counts and how training ended ("training":
        stopped_by, under_trained, label) and whether it can continue ("can_continue")."""
        return studio.plugin_service.plugins(owner=owner_of(studio, request))

    @_api
    def continue_training(plugin_id: str, config: Optional[dict] = None, name: str = "",
                          request: gr.Request = None) -> dict:
        """Queue more training of one of your plug-ins (PEMA, LoRA) from its saved weights and optimizer state, as a
        new plug-in; ``config`` may change max_minutes, the epochs, patience and lr. Returns {"job_id"}. Refused
        while a continuation of the same plug-in is queued or running."""
        return {"job_id": studio.plugin_service.submit_continue(plugin_id, config or {}, name,
                                                                owner=owner_of(studio, request))}

    @_api
    def calibrate(plugin_id: str, max_samples: int = 0, max_seconds: float = 0.0, request: gr.Request = None) -> dict:
        """Queue the calibration of one of your interpolating plug-ins (PEMA, kNN): its declared decode grid and
        λ = 0 decoded on its memory's held-out tuning samples, the best by chrF then sacreBLEU that never loses to
        the base is stored with it (0: the defaults — at most 40 samples, no time budget). Returns {"job_id"}."""
        return {"job_id": studio.plugin_service.submit_calibrate(plugin_id, owner=owner_of(studio, request),
                                                                 max_samples=max_samples or None,
                                                                 max_seconds=max_seconds or None)}

    return [methods, train, plugins, continue_training, calibrate]


def _comparison_endpoints(studio) -> list:
    """Comparisons and their shares."""

    @_api
    def compare(source: str, task: str = "translation", methods: Optional[list] = None,
                settings: Optional[dict] = None, max_new_tokens: int = 48, num_beams: int = 1,
                no_repeat_ngram: int = 0, global_defaults: bool = False, prompt_from: Optional[str] = None,
                request: gr.Request = None) -> dict:
        """Decode a sentence with "base" and/or your plug-in ids in one batch; the payload has an "id" to share.
        ``settings``: {method | plug-in id: {name: value}} (see /methods for each method's declared settings).
        ``no_repeat_ngram``: the repetition guard for every row, the base model's included (0 = off).
        A plug-in calibrated on its memory (/calibrate; after training PEMA or kNN) starts at its tuned settings
        (its row's "tuned" says so); ``global_defaults``: at the global defaults instead.
        ``prompt_from``: the prompt of every row without its own — "builtin" (the task's built-in examples) or one
        of your memory ids (its own examples); empty: the first chosen plug-in's memory. The payload's
        "prompt_source" says which."""
        return studio.compare_service.compare(
            source, task, methods or ["base"], settings or {}, max_new_tokens, num_beams,
            owner=owner_of(studio, request), no_repeat_ngram=no_repeat_ngram or None,
            global_defaults=bool(global_defaults), prompt_from=prompt_from or None)

    @_api
    def share(comparison_id: str, layer: int = -1, labels: Optional[dict] = None, request: gr.Request = None) -> dict:
        """Store one of your recent comparisons for read-only viewing; returns {"id", "link"} (open
        /share/?c=<id>). Rows are labelled by method ("PEMA", "kNN-LM · 2") unless ``labels`` gives your own
        ({row label | plug-in id | method: label}).

        (Not "path": gradio_client would take a dict with a "path" key for a file to download.)"""
        sid = studio.compare_service.share(comparison_id, None if layer < 0 else layer, owner=owner_of(studio, request),
                                           labels=labels)
        return {"id": sid, "link": f"/share/?c={sid}"}

    @_api
    def shared(share_id: str) -> dict:
        """The stored payload of a shared comparison."""
        return studio.compare_service.shared(share_id)

    @_api
    def shares(request: gr.Request = None) -> list:
        """Your shares (comparisons and leaderboards), newest first: id, link, created, kind, the input."""
        return studio.compare_service.shares(owner=owner_of(studio, request))

    @_api
    def delete_share(share_id: str, request: gr.Request = None) -> dict:
        """Delete one of your shares (its id, or its link): the link stops working at once and it no longer counts
        against your limit of shares."""
        return {"message": studio.compare_service.delete_share(share_id, owner=owner_of(studio, request))}

    return [compare, share, shared, shares, delete_share]


def _evaluation_endpoints(studio) -> list:
    """Evaluations and rankings."""

    @_api
    def evaluate(methods: Optional[list] = None, memory_id: str = "", test_text: str = "",
                 test_filename: str = "test.tsv", task: str = "translation", limit: int = 50,
                 sweep_plugin: str = "", lambdas: Optional[list] = None, settings: Optional[dict] = None,
                 no_repeat_ngram: int = 0, global_defaults: bool = False, prompt_from: Optional[str] = None,
                 request: gr.Request = None) -> dict:
        """Queue an evaluation (or a λ_max sweep with sweep_plugin) of your plug-ins; returns {"job_id"}.
        Calibrated plug-ins at their tuned settings (on their memory's held-out split without the samples they
        were tuned on), unless ``global_defaults``.
        ``settings`` and ``no_repeat_ngram`` as for /compare (default: the same tuned settings Compare starts
        from). The job's result holds per row n, backbone, decode settings, scores with 95% bootstrap intervals
        and paired-bootstrap p-values against the base model, sacreBLEU's signatures and the per-sentence outputs
        with their chrF. ``prompt_from`` as for /compare; the result's "prompt_source" says which prompt it was."""
        jid = studio.evaluate_service.submit_evaluate(
            methods=methods, memory_id=memory_id or None, test_data=test_text or None, test_filename=test_filename,
            task=task, limit=limit, sweep_plugin=sweep_plugin or None, lambdas=lambdas, settings=settings,
            owner=owner_of(studio, request), no_repeat_ngram=no_repeat_ngram or None,
            global_defaults=bool(global_defaults), prompt_from=prompt_from or None)
        return {"job_id": jid}

    @_api
    def rank(memory_id: str = "", methods: Optional[list] = None, test_text: str = "", test_filename: str = "test.tsv",
             tour: bool = False, request: gr.Request = None) -> dict:
        """Queue "rank every method" (or ``methods``) on one of your memories: train each with its defaults (a
        plug-in already trained with the same settings on it is reused), tune the interpolating ones on part of the
        held-out samples, score all and the base model on the rest (or on ``test_text``, pairs). ``tour``: on a
        new memory of the demo corpus instead. Returns {"job_id", "estimate"}; the job's result holds the
        leaderboard (also /leaderboard)."""
        me = owner_of(studio, request)
        if tour:
            est = studio.rank_service.rank_estimate(corpus=TOUR_CORPUS, methods=methods, owner=me)
            jid = studio.rank_service.submit_rank(corpus=TOUR_CORPUS, methods=methods, owner=me)
        else:
            est = studio.rank_service.rank_estimate(memory_id, methods=methods, owner=me)
            jid = studio.rank_service.submit_rank(memory_id, methods=methods, test_data=test_text or None,
                                                  test_filename=test_filename, owner=me)
        return {"job_id": jid, "estimate": est["text"]}

    @_api
    def leaderboard(job_id: str = "", memory_id: str = "", request: gr.Request = None) -> dict:
        """One of your finished rankings (``job_id``), or the latest (for ``memory_id``): per method chrF,
        sacreBLEU, their 95% intervals, Δ vs the base model with p, training seconds, trainable parameters, decode
        cost per token relative to the base model, tuned settings; the verdict; the phases' wall times."""
        return studio.rank_service.leaderboard(job_id or None, memory_id=memory_id or None,
                                               owner=owner_of(studio, request))

    @_api
    def share_leaderboard(job_id: str, request: gr.Request = None) -> dict:
        """Store one of your leaderboards for read-only viewing (no ids, names or samples); returns {"id", "link"}."""
        sid = studio.rank_service.share_leaderboard(job_id, owner=owner_of(studio, request))
        return {"id": sid, "link": f"/share/?c={sid}"}

    return [evaluate, rank, leaderboard, share_leaderboard]


def register(studio) -> None:
    """Register the endpoints inside the current ``gr.Blocks`` context, in the order of ``NAMES``."""
    fns = {f.__name__: f for group in (_job_endpoints, _memory_endpoints, _plugin_endpoints, _comparison_endpoints,
                                       _evaluation_endpoints) for f in group(studio)}
    assert sorted(fns) == sorted(NAMES)
    for name in NAMES:
        group, limit = CONCURRENCY.get(name, ("api-read", 4))
        gr.api(fns[name], api_name=name, concurrency_id=group, concurrency_limit=limit)
