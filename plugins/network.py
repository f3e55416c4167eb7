"""The machinery every in-network plug-in shares (residual adapter, LoRA, memory-tuning, memory-augmented adapter):
``NetworkConfig`` (the
sequence-level training settings), ``NetworkPlugin`` (attach forward hooks for one forward pass, restricted to a set
of batch rows — ``rows=None`` means all rows, as in training —, for multi-token (prefill, training) and one-token
(decoding step) inputs alike; teacher-forced training on the memory's training samples with early stopping on a
seeded tenth of them — never on the memory's held-out samples, which the evaluation reports on — and a time budget)
and small helpers to read and rewrite a module's input/output (``module_input``, ``first_tensor``,
``replace_first``, ``rows_apply``).

Hooks change only the hidden states of their own method's rows, so in-network rows share one comparison batch
with the output-level methods (PEMA, kNN) and the base row.

Shared prompt prefix (``prompt_prefix``, default ``"frozen"``; not in any of the papers, which adapt every
position): a plug-in acts on a sample's own positions only — its source's tokens, the target — and leaves the
prompt's instruction and few-shot examples, identical for every sample, to the frozen backbone. Training then
computes that prefix's keys and values once per memory and gives them as the past of every sample
(``FrozenPrefix``, ``PastPrefix``); decoding keeps the plug-in off the same positions (``Attachment.own_from``,
set by ``engine.prefill``), so what a plug-in decodes with is what it was trained with. Training also runs
the frozen layers below the lowest layer a plug-in touches once per fixed, length-bucketed mini-batch
(``TrainingBatches``, ``PreparedBatch``). Both are exact (tests/test_training_shortcuts.py); ``"adapted"`` (and
every plug-in saved before the setting existed) acts on every position, as the papers do. docs/training.md has the
measurements.
"""
from __future__ import annotations

import math
import operator
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backbone.torch_internals import hook_id, hook_tables, set_unregistered, unregistered, version
from engine.protocol import row_span
from ground.errors import UserError
from ground.settings import Setting, SettingsRecord
from plugins.base import FitResult, Plugin, PluginConfig
from plugins.card import TimeEstimate
from plugins.seqtrain import SeqData, collate, memory_sequences, split_for_early_stopping
from plugins.settings import setting
from plugins.timing import layers_scaled, sample_loops, sample_record
from plugins.training import BudgetGuard, LoopSettings, candidate_vocabulary, run_training
from plugins.training_batches import (  # noqa: F401  (re-exported: plug-ins and tests import them from here)
    FrozenPrefix,
    FullBatch,
    PastPrefix,
    PreparedBatch,
    TrainingBatches,
    first_tensor,
    layer_types,
    prepare_batch,
)

PROMPT_PREFIX = ("frozen", "adapted")

@dataclass
class NetworkConfig(PluginConfig):
    """Training settings common to the in-network plug-ins (sequence-level training through the backbone)."""

    lr: float = setting(1e-3, "Adam, β (0.9, 0.999), eps 1e-8", low=0.0, low_open=True, high=1.0)
    batch_size: int = setting(8, "samples (sequences) per step", low=1, high=65536)
    max_epochs: int = setting(2, "training ends here or by early stopping, whichever comes first", low=0, high=1000)
    patience: int = setting(
        4, "held-out evaluations without improvement before stopping (4 = an epoch)", low=0, high=1000)
    evals_per_epoch: int = setting(
        4, "held-out evaluations per epoch (more = a time budget wastes less)", low=1, high=1000)
    max_heldout: int = setting(
        32, "early stopping uses a seeded tenth of the memory's training samples, at most this many (their eval is "
            "slow); the memory's held-out samples are never used in training", low=1, high=100000)
    lr_schedule: str = setting("constant", "\"constant\" | \"cosine\"", choices=("constant", "cosine"))
    max_minutes: float = setting(
        60.0, "wall-clock cap (0 = none); the epochs and early stopping end a default run on two CPU cores before it "
              "(a budget in minutes makes a result depend on the machine's load)", low=0.0, high=1440.0)
    softmax: str = setting(
        "candidates", "\"candidates\" (default: the training softmax over a candidate vocabulary — the memory's target "
        "tokens, the stop tokens and the LM's top tokens on sampled memory contexts; decoding uses every token) | "
        "\"full\" (exact NLL over all tokens; the papers, their `paper` presets)", choices=("full", "candidates"))
    candidate_top_k: int = setting(
        16, "with \"candidates\": the LM's top tokens per sampled memory context", low=0, high=1024)
    candidate_contexts: int = setting(
        2048, "with \"candidates\": how many memory contexts to sample", low=0, high=1000000)
    prompt_prefix: str = setting(
        "frozen", "\"frozen\": the plug-in acts on a sample's own positions only, the prompt's shared prefix "
        "(instruction, few-shot examples) is the frozen backbone's, computed once per memory (fast; not in the "
        "papers) | \"adapted\": on every position (the papers)", choices=PROMPT_PREFIX)

    @classmethod
    def from_saved(cls, d: dict) -> "NetworkConfig":
        """The config of a saved plug-in: one saved before ``prompt_prefix`` existed acted on every position."""
        if isinstance(d, dict) and "prompt_prefix" not in d:
            d = {**d, "prompt_prefix": "adapted"}
        return cls.from_dict(d)

    def validate(self) -> None:
        super().validate()
        self._check(self.patience >= 1, "patience must be ≥ 1.")


def parse_layers(spec: str, num_layers: int | None) -> list[int]:
    """Layer indices of a ``layers`` spec; with ``num_layers`` None only the syntax is checked."""
    spec = str(spec).strip().lower()
    bad = UserError(f"Bad layers setting {spec!r}: use 'all', 'top:N', 'bottom:N', 'every:K' or a list like '0,4,8'.")
    L = num_layers
    try:
        if spec == "all":
            out = list(range(L)) if L else []
        elif spec.startswith(("top:", "bottom:", "every:")):
            kind, n = spec.split(":")
            n = int(n)
            if n < 1:
                raise bad
            if L is None:
                return []
            out = {"top": list(range(max(0, L - n), L)), "bottom": list(range(min(n, L))),
                   "every": list(range(L - 1, -1, -n))[::-1]}[kind]
        else:
            out = sorted({int(x) for x in spec.split(",") if x.strip()})
            if not out:
                raise bad
    except ValueError:
        raise bad from None
    if L is not None:
        wrong = [i for i in out if not 0 <= i < L]
        if wrong:
            raise UserError(f"Layer(s) {wrong} do not exist: the backbone has layers 0..{L - 1}.")
    return out


def derived(owner, key, sources, build: Callable[[], object]):
    """What ``build()`` derives from the tensors ``sources`` (a plug-in's weights: folded products, packed copies,
    a dtype's copy), computed once under ``no_grad`` and kept on ``owner`` under ``key`` until a source changes —
    another tensor, an in-place update (its version counter: an optimiser step, ``load_state_dict``), new storage
    (``.to()``) —, so that a decode step reads constants instead of recomputing them at every layer. The entry holds
    its sources, so no freed tensor's address can pass for one of them."""
    sources = tuple(sources)
    try:
        versions = tuple([version(t) for t in sources])
    except RuntimeError:  # an inference tensor (made under ``inference_mode``) has no version counter, and cannot
        versions = tuple([-1 if t.is_inference() else version(t) for t in sources])  # change in place outside it
    stamp = (versions, tuple([t.data_ptr() for t in sources]), tuple([(t.dtype, t.device) for t in sources]))
    cache = unregistered(owner, "_derived")
    if cache is None:
        cache = {}
        set_unregistered(owner, "_derived", cache)
    hit = cache.get(key)
    if hit is None or hit[1] != stamp or len(hit[0]) != len(sources) or any(map(operator.is_not, hit[0], sources)):
        with torch.no_grad():
            hit = cache[key] = (sources, stamp, build())
    return hit[2]


def replace_first(output, new: torch.Tensor):
    if isinstance(output, tuple):
        return (new, *output[1:])
    if isinstance(output, list):
        return [new, *output[1:]]
    return new


def module_input(args: tuple, kwargs: dict, name: str = "hidden_states") -> torch.Tensor:
    """The first input of a module call, positional or keyword (HF calls ``self_attn(hidden_states=...)``)."""
    if args:
        return args[0]
    if name in kwargs:
        return kwargs[name]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def rows_apply(h: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None,
               fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               starts: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``h`` with batch rows ``rows`` replaced by ``fn(x[rows], h[rows])`` (all rows when ``rows`` is None).

    Shapes are (batch, tokens, features) for any number of tokens. Rows not selected are returned bit-identical.
    ``starts`` (one per selected row; ``Attachment.starts``): the row's positions before it keep ``h`` (a shared
    prompt prefix the plug-in does not act on). Without gradients (decoding) the rows are written into ``h``
    itself — a module's fresh output that the hook replaces anyway — instead of into a copy of the whole batch.

    ``rows`` may also be a **row mask** (a bool tensor, one entry per batch row: ``fixed_rows``): ``fn`` then runs
    on every row and the masked rows take its result — fixed shapes, no index read on the host, so a CUDA graph
    can record the hook once and a decode changes its rows by writing the mask in place.
    """
    if rows is not None and rows.dtype == torch.bool:
        if starts is not None:
            raise ValueError("a row mask acts on every position of its rows (a decode step's)")
        return torch.where(rows.view(-1, *(1,) * (h.dim() - 1)), fn(x, h).to(h.dtype), h)
    if starts is not None and h.dim() == 3:
        starts = starts.to(h.device)
        if bool((starts >= h.shape[1]).all()):
            return h  # every position is the shared prefix: nothing to change
        if not bool((starts > 0).any()):
            starts = None
    else:
        starts = None

    def gated(xs, hs):
        out = fn(xs, hs).to(h.dtype)
        if starts is None:
            return out
        before = torch.arange(h.shape[1], device=h.device)[None, :] < starts[:, None]
        return torch.where(before[..., None], hs, out)

    if rows is None:
        return gated(x, h)
    if rows.numel() == 0:
        return h
    new = h if not torch.is_grad_enabled() and not h.requires_grad else h.clone()
    span = row_span(rows)
    if span is not None:  # consecutive rows (a comparison's usual layout): views and one copy, no index operators
        sub_h = h[span]
        new[span] = gated(sub_h if x is h else x[span], sub_h)
        return new
    rows = rows.to(h.device)
    sub_h = h.index_select(0, rows)
    new[rows] = gated(sub_h if x is h else x.index_select(0, rows), sub_h)
    return new


def keep_before(new: torch.Tensor, old: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
    """``new`` (rows, tokens, features) with each row's positions before its ``starts`` taken from ``old``."""
    if starts is None or new.dim() != 3:
        return new
    before = torch.arange(new.shape[1], device=new.device)[None, :] < starts.to(new.device)[:, None]
    return torch.where(before[..., None], old.to(new.dtype), new)


_SUB_BATCH: ContextVar = ContextVar("pema_sub_batch", default=None)


@contextmanager
def sub_batch(rows: torch.Tensor):
    """While inside, forward passes run on the *sub-batch rows* ``rows`` (indices of the whole pass's rows) only — a
    module re-run for one plug-in's rows (memory-tuning's prefixed attention) —, so every attachment's ``rows`` reads
    as positions within them: another method's hooks on the re-run's submodules (LoRA on ``o_proj``) act on none of
    them, a hook for all rows (None) on all. (The decode's kinds of rows: ``engine``'s glossary.)"""
    token = _SUB_BATCH.set(rows)
    try:
        yield
    finally:
        _SUB_BATCH.reset(token)


class Attachment:
    """One ``attach`` call: its rows and settings, per-pass inputs of a training forward (``state``, e.g. the memory
    adapter's memory-dropout mask), and what its hooks recorded for ``network_trace``. Its *attachment rows*
    (``forward_rows``) index the rows of the forward passes it sees: a decode's prefill rows in the prefill, cache
    rows in a step (batch rows where the layout is not compact), every row in training (None)."""

    def __init__(self, rows, settings: SettingsRecord, state: dict | None = None, recording: bool = True):
        # the forward pass's rows the hooks act on, indices of the whole pass (None: all; a bool tensor: a row mask,
        # ``NetworkPlugin.fixed_rows``, whose rows a decode changes in place between replays of a recorded step)
        self.forward_rows = rows
        self.settings = settings
        self.state = dict(state or {})
        self.live = True
        self.recording = recording  # whether a decode wants the trace (False: the hooks skip recording it)
        self.trace = None  # what the latest forward pass recorded (default layout: {"per_row": [dict per row]})
        # per row of the next forward pass, the first position the plug-in acts on (the positions before are
        # a shared prompt prefix, kept as the frozen backbone computes them); None: every position
        self.own_from: torch.Tensor | None = None

    def starts(self) -> torch.Tensor | None:
        """``own_from`` of the rows the hooks act on (``rows``; every row when None), or None."""
        if self.own_from is None:
            return None
        if self.forward_rows is None:
            return self.own_from
        sub = _SUB_BATCH.get()
        rows = self.rows
        full = rows if sub is None else sub.to(rows.device)[rows]
        return self.own_from.to(full.device)[full]

    @property
    def rows(self) -> torch.Tensor | None:
        """The attachment rows (None: every row); inside ``sub_batch``, as positions within the sub-batch rows."""
        sub = _SUB_BATCH.get()
        if sub is None or self.forward_rows is None:
            return self.forward_rows
        return torch.isin(sub, self.forward_rows.to(sub.device)).nonzero().flatten()


class _Handle:
    """A handle for a group of hooks: ``remove()`` removes them all and marks the attachment finished."""

    def __init__(self, handles: list, att: Attachment):
        self.handles, self.att = handles, att
        self.kept: list | None = None  # while suspended: (hook table, hook id, entry) to put back

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.kept = None
        self.att.live = False

    def suspend(self) -> bool:
        """Take the hooks off the modules, keeping them for ``resume``: a decode's next step attaches the very same
        functions (same rows, settings and derived products) without building them anew — attaching a 7-row
        comparison's in-network plug-ins is a noticeable share of a step (BENCHMARKS.md, "Decode time per token").
        False (and the hooks removed for good) where a handle does not show its hook table (torch's
        ``RemovableHandle`` does: ``backbone.torch_internals.hook_tables``): attach anew then."""
        kept = []
        for h in self.handles:
            tables = hook_tables(h)
            if tables is None:
                self.remove()
                return False
            key = hook_id(h)
            kept += [(table, key, table[key]) for table in tables if key in table]
        for h in self.handles:
            h.remove()
        self.kept = kept
        self.att.live = False
        return True

    def resume(self) -> bool:
        """Put suspended hooks back (in their order: each table gets its entries appended as ``attach`` added
        them); False when there is nothing to resume."""
        if self.kept is None:
            return False
        for table, key, entry in self.kept:
            table[key] = entry
        self.kept = None
        self.att.live = True
        return True


# The in-network methods' card parts (``plugins.card``): the per-method tests' short run and the time estimate.
NETWORK_QUICK_SETTINGS = {"max_epochs": 1, "max_minutes": 0.0, "candidate_contexts": 16, "batch_size": 4,
                          "patience": 1}


def network_training_time(cls, config, rec: dict, samples: int, entries: int) -> dict:
    """One loop over the memory's samples (``plugins.timing.sample_loops``), the record scaled to the layers
    ``config`` adapts where they differ from the recorded run's (``plugins.timing.layers_scaled``)."""
    L, made = rec.get("num_layers"), rec.get("lowest_layer")
    now = cls.lowest_layer_of(config, L) if L and made is not None else None
    if now is not None:
        rec = layers_scaled(rec, L, made, now)
    return sample_loops(cls.method, config, rec, samples, entries)


def network_throughput_record(plugin, info: dict, history: list[dict], wall_s: float, memory) -> dict:
    """The sample loop's record (``plugins.timing.sample_record``) with the layers the run adapted."""
    return {**sample_record(plugin.config, info, history, wall_s), "num_layers": plugin.backbone.num_layers,
            "lowest_layer": plugin.lowest_layer()}


NETWORK_ESTIMATE = TimeEstimate(
    measure_settings={"max_epochs": 1, "max_minutes": 1.5, "patience": 1000, "max_heldout": 8},
    training_time=network_training_time, throughput_record=network_throughput_record)


class NetworkPlugin(Plugin):
    """Base of the in-network plug-ins: per-row hooks, scale calibration, sequence-level training, traces.

    Subclasses implement ``_register_hooks(att) -> list[handle]`` (hooks acting on ``att.rows`` only; ``att.rows``
    is None for all rows) and ``_trainable()`` (the parameters ``fit`` optimises), and may record a trace in
    ``att.trace`` (``{"per_row": [dict, ...]}`` for the rows of the forward pass that recorded it; another layout
    with ``_trace_rows``). ``network_trace(handles)`` reads the trace of the attachment that ``attach`` returned.

    Training (``fit_sequences``) can be adapted without rewriting the loop: ``train_batch_loss`` (the objective of
    one batch; default the targets' NLL), ``_heldout_subset`` (which of the early-stopping samples, set aside from
    the training samples, are evaluated) and ``loop_settings``; the memory-augmented adapter uses all three.
    """

    level = "network"
    # Whether the hooks run on a bool row mask (``fixed_rows``: a decode step recorded once in a CUDA graph, its rows
    # changed in place) without host reads, data-dependent shapes or per-step Python decisions in the hooked modules
    fixed_rows = True
    # Continue training (every in-network method): ``resume_state`` — set before ``fit`` from the saved
    # ``optimizer.safetensors`` (``training.optimizer_from_tensors``) — resumes Adam's moments and the step count
    # (so the learning-rate schedule goes on) from the plug-in's own weights; its calibration (scales, prefix
    # init) is not redone. ``optimizer_state`` holds the state after ``fit`` (the Studio saves it as safetensors).
    resumable = True
    resume_state: dict | None = None
    decode_settings = (
        Setting("scale", 1.0, "multiplies the plug-in's change of the hidden states (1 = as trained, 0 = off)",
                low=0.0, high=10.0, step=0.1, label="scale"),
    )
    Config = NetworkConfig

    def __init__(self, config, backbone, memory_meta: dict | None = None):
        super().__init__(config, backbone, memory_meta)
        self._cand = None  # (token ids, vocab → candidate index, head rows) while training with candidates

    @classmethod
    def build_for_load(cls, config, backbone, memory_meta, extra, tensors):
        # Plug-ins saved before the scales became per-feature hold one scale per layer: broadcast them over d.
        for k, v in list(tensors.items()):
            if k.endswith("_scale") and v.dim() == 1:
                tensors[k] = v[:, None].expand(-1, backbone.hidden_size).contiguous()
        return cls(config, backbone, memory_meta)

    # --- attaching ------------------------------------------------------------------------------------------
    def attach(self, rows: torch.Tensor | None, settings: SettingsRecord | dict | None = None, trace: bool = True,
               own_from: torch.Tensor | None = None, **state) -> list:
        """Register this plug-in's forward hooks acting on batch rows ``rows`` (None: every row, as in training; a
        bool tensor: a row mask, ``fixed_rows``); return handles (pass them to ``network_trace``). ``trace`` False:
        nobody will ask for ``network_trace``, so the hooks need not record it (a decode without traces).
        ``own_from``: see ``set_own_from``. ``state``: per-pass inputs of a training forward."""
        self.to_backbone()
        s = self.settings(settings)  # a row's record, or overrides of the declared defaults (training: none)
        if rows is not None and not (isinstance(rows, torch.Tensor) and rows.dtype == torch.bool):
            rows = torch.as_tensor(rows, dtype=torch.long).flatten()
        att = Attachment(rows, s, state, recording=trace)
        att.own_from = own_from
        return [_Handle(self._register_hooks(att), att)]

    @property
    def frozen_prefix(self) -> bool:
        """Whether the plug-in leaves the prompt's shared prefix to the frozen backbone (``prompt_prefix``)."""
        return getattr(self.config, "prompt_prefix", "adapted") == "frozen"

    @property
    def leaves_shared_prefix(self) -> bool:
        return self.frozen_prefix

    def set_own_from(self, handles: list, own_from: torch.Tensor | None) -> None:
        set_own_from(handles, own_from)

    def suspend(self, handles: list) -> bool:
        kept = True
        for h in handles:
            if not (isinstance(h, _Handle) and h.suspend()):
                h.remove()
                kept = False
        return kept

    def resume(self, handles: list) -> bool:
        return all(isinstance(h, _Handle) and h.resume() for h in handles)

    def lowest_layer(self) -> int:
        """The lowest decoder layer whose forward pass carries one of this plug-in's hooks: the frozen layers below
        compute the same states at every training step, so training runs them once per batch (``PreparedBatch``)."""
        return 0

    @classmethod
    def lowest_layer_of(cls, config, num_layers: int) -> int | None:
        """What ``lowest_layer()`` will be for ``config`` on a backbone of ``num_layers`` layers, before the plug-in
        exists (the training-time estimate): the lowest of its ``layers`` setting; None for a method without one."""
        spec = getattr(config, "layers", None)
        return min(parse_layers(spec, num_layers), default=None) if spec is not None else None

    def _register_hooks(self, att: Attachment) -> list:
        raise NotImplementedError

    def network_trace(self, handles: list) -> dict | None:
        """What the attachment ``handles`` (returned by ``attach``) recorded in its latest forward pass, keyed by
        position within its ``rows``; None before its first pass (or for a plug-in without a trace). The handles
        may already be removed."""
        att = next((h.att for h in handles if isinstance(h, _Handle)), None)
        if att is None or att.rows is None or att.trace is None:
            return None
        return self._trace_rows(att)

    def _trace_rows(self, att: Attachment) -> dict:
        """``att.trace`` as {position within ``att.rows``: dict}; subclasses recording another layout override it."""
        return dict(enumerate(att.trace["per_row"]))

    def _record(self, att: Attachment, per_row: list[dict]) -> None:
        att.trace = {"per_row": per_row}

    # --- helpers for subclasses ---------------------------------------------------------------------------
    @staticmethod
    def _scale_of(att: Attachment) -> float:
        return att.settings.scale

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters()]

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self._trainable())

    def _data(self, memory) -> tuple[SeqData, SeqData]:
        """(samples to train on, samples to early-stop on), both from the memory's *training* samples: a seeded
        tenth of them, at most ``max_heldout``, is set aside for early stopping. The memory's held-out samples are
        never read: they are what ``eval --memory`` and the Studio's Evaluate tab report on."""
        train = memory_sequences(self.backbone, memory, "train")
        if not len(train):
            raise UserError("The memory has no training samples to train on.")
        train, held = split_for_early_stopping(train, self.config.seed, max_samples=self.config.max_heldout)
        if len(held) > self.config.max_heldout:
            held = self._heldout_subset(held)
        return train, held

    def _heldout_subset(self, held: SeqData) -> SeqData:
        """The ``max_heldout`` early-stopping samples evaluated (default: the first ones; the split already keeps at
        most ``max_heldout``, so this only matters for a subclass whose ``_data`` sets more aside)."""
        return held.pick(range(min(len(held), self.config.max_heldout)))

    def calibrate_rms(self, modules: list[nn.Module], data: SeqData, n: int = 16) -> list[torch.Tensor]:
        """Per-feature RMS (a (d,) tensor) of each module's output over the real tokens of up to ``n`` training
        samples, floored at 1% of its mean so that no feature gets a zero scale."""
        bb = self.backbone
        sums: list[torch.Tensor | None] = [None] * len(modules)
        count = [0] * len(modules)
        state = {}

        def mk(i):
            def hook(mod, args, kwargs, out):
                t = first_tensor(out)
                m = state["mask"]
                t = (t[m] if t.dim() == 3 and t.shape[:2] == m.shape else t.reshape(-1, t.shape[-1]))
                sq = t.detach().float().pow(2).sum(0).cpu()
                sums[i] = sq if sums[i] is None else sums[i] + sq
                count[i] += t.shape[0]
            return hook

        handles = [m.register_forward_hook(mk(i), with_kwargs=True) for i, m in enumerate(modules)]
        try:
            with torch.no_grad():
                idx = list(range(min(n, len(data))))
                for b0 in range(0, len(idx), self.config.batch_size):
                    ids, mask, _ = collate(bb, data, idx[b0:b0 + self.config.batch_size])
                    state["mask"] = mask.bool()
                    bb.forward_fc(ids, attention_mask=mask)
        finally:
            for h in handles:
                h.remove()
        out = []
        for sq, c in zip(sums, count):
            if sq is None or not c:
                out.append(None)
                continue
            r = (sq / c).sqrt()
            r = torch.nan_to_num(r, nan=0.0, posinf=0.0)
            floor = max(float(r.mean()) * 1e-2, 1e-6)
            out.append(r.clamp_min(floor))
        return out

    @staticmethod
    def scale_summary(scales: list[torch.Tensor]) -> list[float]:
        """Per-layer overall RMS of the per-feature scales, for ``train_info``."""
        return [round(float(s.pow(2).mean().sqrt()), 4) for s in scales]

    def as_batch(self, ids, mask=None, labels=None):
        """A training batch: ``ids`` itself when it is one (``FullBatch`` / ``PreparedBatch``), else whole
        right-padded sequences (``collate``'s ids, mask, labels) run through the whole backbone."""
        if mask is None and labels is None and hasattr(ids, "fc"):
            return ids
        return FullBatch(self.backbone, ids, mask, labels)

    def batch_fc(self, batch, repeat: int = 1, **state) -> torch.Tensor:
        """Pre-norm states of ``batch``'s positions (its rows ``repeat`` times) with this plug-in's hooks on every row
        for this one forward pass (``state``: see attach)."""
        own = batch.own_from
        if own is not None and repeat > 1:
            own = own.repeat(repeat)
        handles = self.attach(None, {}, own_from=own, **state)
        try:
            return batch.fc(repeat)
        finally:  # the graph is built: backward needs no hook, so none stays on the shared backbone
            for h in handles:
                h.remove()

    def seq_loss(self, ids, mask=None, labels=None) -> tuple[torch.Tensor, int]:
        """Mean NLL of the target tokens with whatever hooks are attached (logits only at target positions: the LM
        head is the costly part)."""
        batch = self.as_batch(ids, mask, labels)
        fc = batch.fc(1)
        sel = batch.labels != -100
        return self.target_nll(fc[sel], batch.labels[sel]), int(sel.sum())

    def hooked_seq_loss(self, ids, mask=None, labels=None, **state) -> tuple[torch.Tensor, int]:
        """``seq_loss`` with this plug-in's hooks on every row for this one forward pass (``state``: see attach)."""
        batch = self.as_batch(ids, mask, labels)
        fc = self.batch_fc(batch, **state)
        sel = batch.labels != -100
        return self.target_nll(fc[sel], batch.labels[sel]), int(sel.sum())

    def train_batch_loss(self, ids, mask=None, labels=None) -> tuple[torch.Tensor, int, dict]:
        """One training batch (a ``FullBatch``/``PreparedBatch``, or ``collate``'s ids, mask, labels): (loss to
        minimise, target tokens, loss parts for the history). Default: the NLL of the targets; a method with
        another objective (the memory adapter's) overrides it."""
        loss, n_tgt = self.hooked_seq_loss(self.as_batch(ids, mask, labels))
        return loss, n_tgt, {}

    def target_nll(self, fc: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of pre-norm states ``fc`` (n, d) against ``targets`` through the frozen norm + LM head:
        over the whole vocabulary, or over the candidate vocabulary when ``softmax="candidates"``."""
        return F.cross_entropy(self.target_logits(fc), self.target_index(targets))

    def target_logits(self, fc: torch.Tensor) -> torch.Tensor:
        """Float32 logits of pre-norm states ``fc`` (n, d) through the frozen norm + LM head: every token, or the
        candidate vocabulary's (in its order) while training with ``softmax="candidates"``."""
        bb = self.backbone
        cand = getattr(self, "_cand", None)
        if cand is None:
            return bb.logits_from_fc(fc).float()
        return bb.softcap_logits(F.linear(bb.final_norm(fc.to(bb.dtype)), cand[2]).float())

    def target_index(self, targets: torch.Tensor) -> torch.Tensor:
        """Token ids as column indices of ``target_logits``."""
        cand = getattr(self, "_cand", None)
        return targets if cand is None else cand[1][targets]

    def prepare_candidates(self, memory, progress=None) -> dict:
        """With ``softmax="candidates"`` (as PEMA's fast mode): every token occurring as a value of the memory's
        training entries, the backbone's stop tokens and the LM's top tokens on a sample of memory contexts (keys =
        f(c)); nothing of the held-out samples (the early-stopping samples are training samples, so their targets
        are among the candidates)."""
        cfg = self.config
        self._cand = None
        if cfg.softmax != "candidates":
            return {"softmax": "full"}
        bb = self.backbone
        ids = candidate_vocabulary(bb, memory, cfg.candidate_top_k, cfg.candidate_contexts, cfg.seed,
                                   include_heldout=False, progress=progress)
        remap = torch.zeros(bb.vocab_size, dtype=torch.long, device=bb.device)
        remap[ids] = torch.arange(len(ids), device=bb.device)
        self._cand = (ids, remap, bb.lm_head.weight[ids].detach())
        return {"softmax": "candidates", "candidates": len(ids)}

    def loop_settings(self, steps_per_epoch: int) -> LoopSettings:
        cfg = self.config
        return LoopSettings(lr=cfg.lr, batch_size=cfg.batch_size, max_epochs=cfg.max_epochs, patience=cfg.patience,
                            lr_schedule=cfg.lr_schedule, max_minutes=cfg.max_minutes, seed=cfg.seed,
                            eval_every=max(1, math.ceil(steps_per_epoch / cfg.evals_per_epoch)))

    def training_batches(self, data: SeqData, fallback_full: bool = False) -> "TrainingBatches":
        """``data`` as fixed length-bucketed mini-batches of ``batch_size`` samples, each made ready for training
        the first time it is used (``PreparedBatch``): with ``prompt_prefix="frozen"`` the shared prompt prefix's
        keys and values come from the frozen backbone once and are the past of every sample; the frozen layers below
        ``lowest_layer()`` run once per batch. ``fallback_full``: whole sequences through the whole backbone
        (``FullBatch``, the reference path) instead."""
        return TrainingBatches(self.backbone, data, self.config.batch_size, self.frozen_prefix, self.lowest_layer(),
                               full=fallback_full)

    def fit_sequences(self, memory, progress, should_stop, prepare: Callable[[SeqData], dict] | None = None
                      ) -> FitResult:
        """Train ``_trainable()`` on the memory's samples with this plug-in's hooks on every row: fixed
        length-bucketed mini-batches (their order shuffled every epoch), each prepared once (``training_batches``)."""
        cfg = self.config
        bb = self.backbone
        torch.manual_seed(cfg.seed)
        self.to(bb.device)
        resume = (self.resume_state or {}).get("") if self.resume_state else None
        progress(0.0, "preparing the memory's samples")
        train, held = self._data(memory)
        cand = self.prepare_candidates(memory, lambda f, m: progress(0.01 + 0.02 * f, m))
        progress(0.03, "calibrating the plug-in on the training samples")
        trained = {k: v.detach().clone() for k, v in self.state_dict().items()} if resume is not None else None
        info = {**cand, **(prepare(train) if prepare else {})}
        if trained is not None:  # continuing: ``prepare``'s set-up stays, its calibration/init gives way
            self.load_state_dict(trained)
            info["continued"] = True
        params = self._trainable()
        for p in self.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        tb, hb = self.training_batches(train), self.training_batches(held)
        counts = {"tokens": 0, "targets": 0, "samples": 0}

        history = self.new_history()
        guard = BudgetGuard(self, lambda: heldout_loss(), cfg.max_minutes, history, self.method)

        def train_loss(idx):
            guard.before_step()
            batch = tb[int(idx[0])]
            loss, n_tgt, parts = self.train_batch_loss(batch)
            counts["tokens"] += batch.tokens
            counts["targets"] += n_tgt
            counts["samples"] += batch.size
            return loss, parts

        def heldout_loss():
            tot, n = 0.0, 0
            with torch.no_grad():
                for i in range(len(hb)):
                    loss, k = self.hooked_seq_loss(hb[i])
                    tot += float(loss) * k
                    n += k
            return tot / max(n, 1)

        s = self.loop_settings(len(tb))
        s.batch_size = 1  # one index = one fixed mini-batch of samples
        t0 = time.time()
        self.optimizer_state = {}
        summary = run_training(self, params, len(tb), train_loss, guard.heldout_loss, s, self.method, progress,
                               should_stop, history, (0.05, 1.0), resume=resume, state_out=self.optimizer_state)
        summary = guard.restore(summary)
        wall = time.time() - t0
        for p in self.parameters():
            p.requires_grad_(False)
        self._cand = None
        metrics = {**summary, "train_samples": len(train), "early_stop_samples": len(held),
                   "entries_per_second": round(counts["samples"] / max(wall, 1e-9), 2),
                   "samples_per_second": round(counts["samples"] / max(wall, 1e-9), 2),
                   "tokens_per_second": round(counts["tokens"] / max(wall, 1e-9), 1),
                   "target_tokens_per_second": round(counts["targets"] / max(wall, 1e-9), 1),
                   "train_tokens_seen": counts["tokens"], "seconds_per_step": round(guard.mean_step(), 2),
                   **tb.info(), "prepare_seconds": round(tb.prepare_seconds + hb.prepare_seconds, 2)}
        self.train_info = {**info, **metrics}
        return FitResult(metrics=metrics, history=history)


def set_own_from(handles: list, own_from: torch.Tensor | None) -> None:
    """Tell the attachments ``handles`` (what ``attach`` returned) each batch row's first position they act on in
    the next forward pass (None: every position)."""
    for h in handles:
        if isinstance(h, _Handle):
            h.att.own_from = own_from
