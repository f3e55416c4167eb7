"""What the engine and the methods share: what an output-level method sees and returns at a step (``MixInput`` /
``MixOutput``), the mixing rule (``mix_logprobs``), what the engine needs of a method (``DecodeMethod`` and, by the
way a method acts, ``OutputMethod`` / ``NetworkMethod`` / ``PromptMethod``), and the helpers every method and the
engine use alike (``row_span``, ``shared_prompt_len``).

The protocols type exactly what the engine calls on a row's method, nothing more; a method (``plugins.base.Plugin``)
fulfils them without naming them. They are ``runtime_checkable``: ``isinstance(method, OutputMethod)`` says whether
an object has every member the engine reads (not their signatures).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable

import torch

from backbone.model import Backbone
from backbone.prompts import Prompt, common_prefix_len
from backbone.torch_internals import version
from ground.settings import SettingsRecord, settings_record

# the settings of a row without a method of its own (the base model's): none
NO_SETTINGS: SettingsRecord = settings_record("NoSettings", (), "the base model")()


@dataclass
class MixInput:
    """What an output-level plug-in sees for its rows at one decoding step."""

    fc: torch.Tensor            # (n, d) the step's f(c), pre-norm, backbone dtype
    lm_logprobs: torch.Tensor   # (n, V) float32 log P_LM
    extra_logits: torch.Tensor | None  # (n, V) float32 logits of the plug-in's extra states, if it asked for any
    step: int                   # number of tokens generated so far in this row (0 for the first)
    src_len: list[int]          # SL per row: token length of the row's input sentence (instruction excluded)
    settings: list[SettingsRecord]  # decode-time settings per row: the method's typed record (``s.lambda_max``)
    ref_len: list[int | None] | None = None  # per row: the reference's token length, in evaluations that ask for it
                                             # (PEMA's GU "code" variant, whose SL counts the reference); else None


@dataclass
class MixOutput:
    logprobs: torch.Tensor              # (n, V) final log P
    plugin_logprobs: torch.Tensor | None = None  # (n, V) the plug-in's own distribution, for the trace
    lam: list[float] | None = None      # λ_t per row
    extras: list[dict] | None = None    # per-row trace extras (e.g. kNN neighbours)


def mix_logprobs(lm_logprobs: torch.Tensor, plugin_logprobs: torch.Tensor, lam: torch.Tensor,
                 support: torch.Tensor | None = None) -> torch.Tensor:
    """log(λ·P_plugin + (1−λ)·P_LM) row-wise, stable in log space; λ of 0 or 1 selects one side exactly.
    Works on any column subset (e.g. only the reference token's column): each column is mixed on its own.

    ``support`` (rows × s column ids): the only columns where ``plugin_logprobs`` may be above −inf (kNN's
    neighbours' tokens). Elsewhere the mixture is log(1−λ) + log P_LM exactly — logaddexp(−inf, b) is b —, so only
    those columns are mixed: the same result without vocabulary-wide logaddexp work."""
    lam = lam.to(lm_logprobs).unsqueeze(1)
    log_lam, log_rest = torch.log(lam.clamp_min(1e-30)), torch.log((1 - lam).clamp_min(1e-30))
    if support is None:
        out = torch.logaddexp(plugin_logprobs + log_lam, lm_logprobs + log_rest)
    else:
        out = lm_logprobs + log_rest
        s = support.to(out.device)
        out.scatter_(1, s, torch.logaddexp(plugin_logprobs.gather(1, s) + log_lam, out.gather(1, s)))
    # λ of 1 or 0: that side's row as it is (row by row: no vocabulary-wide select)
    for sel, side in ((lam[:, 0] >= 1.0, plugin_logprobs), (lam[:, 0] <= 0.0, lm_logprobs)):
        if bool(sel.any()):
            rows = sel.expand(out.shape[0]) if sel.shape[0] == 1 else sel
            out[rows] = side.expand_as(out)[rows]
    return out


@runtime_checkable
class DecodeMethod(Protocol):
    """What the engine needs of every row's method, whatever its level."""

    method: str           # its name (a row's result, messages)
    level: str            # "output" (``OutputMethod``) | "network" (``NetworkMethod``) | "prompt" (``PromptMethod``)
    mixes_output: bool    # an in-network method that also mixes after the LM head (then an ``OutputMethod`` too)
    interpolates: bool    # its mix is λ_t·P_plugin + (1−λ_t)·P_LM: a slider move may re-mix kept steps
    fingerprint: str      # the backbone it was made for

    def settings(self, overrides: dict | SettingsRecord | None = None) -> SettingsRecord:
        """A row's complete decode settings, its method's typed record, from its overrides (checked)."""

    def prepare_decode(self) -> None:
        """Called once per planned batch, before its first step."""

    def parameters(self) -> Iterator[torch.Tensor]:
        """Its weights: their version counters say whether it changed since a cache was made."""

    def buffers(self) -> Iterator[torch.Tensor]:
        """Its buffers, read like ``parameters``."""


@runtime_checkable
class OutputMethod(DecodeMethod, Protocol):
    """A method acting on the output distribution: it mixes its rows after the LM head (level "output", or an
    in-network one with ``mixes_output``)."""

    def extra_states(self, fc: torch.Tensor, settings: list[SettingsRecord]) -> torch.Tensor | None:
        """Pre-norm states to project through the LM head in the step's one product, or None."""

    def head_vocab(self) -> torch.Tensor | None:
        """The token ids its extra states' logits are needed for (None: every token)."""

    def mix(self, inp: MixInput) -> MixOutput:
        """Its rows' final log-probabilities at one step."""

    def plugin_logprobs(self, inp: MixInput) -> tuple[torch.Tensor, list[dict] | None]:
        """An interpolating method's log P_plugin and trace extras (a slider move recomputes them from f(c))."""

    def mix_lambdas(self, inp: MixInput) -> list[float]:
        """An interpolating method's λ_t per row."""

    def distribution_key(self, settings: SettingsRecord) -> tuple:
        """The part of ``settings`` that changes P_plugin (the rest changes only λ_t)."""


@runtime_checkable
class NetworkMethod(DecodeMethod, Protocol):
    """A method attaching inside the network: hooks on its own rows of each forward pass (level "network"). A method
    whose hooks run on a row mask sets ``fixed_rows`` (read where present; the static step needs it)."""

    leaves_shared_prefix: bool  # it acts from each row's own tokens on: the prefill tells it where (``set_own_from``)

    def attach(self, rows: torch.Tensor, settings: SettingsRecord | None = None, trace: bool = True) -> list:
        """Hooks on rows ``rows`` of the next forward passes; returns their handles."""

    def suspend(self, handles: list) -> bool:
        """Take the hooks off between two passes, kept for ``resume`` (False: removed for good)."""

    def resume(self, handles: list) -> bool:
        """Put suspended hooks back (False: they cannot be; the engine attaches anew)."""

    def set_own_from(self, handles: list, own_from: torch.Tensor | None) -> None:
        """Each row's first position the hooks act on in the next pass."""

    def network_trace(self, handles: list) -> dict | None:
        """What the hooks recorded in their latest pass, by position among their rows (the trace)."""


@runtime_checkable
class PromptMethod(DecodeMethod, Protocol):
    """A method that gives its row a prompt of its own (level "prompt"): a prefill row of its own, no hooks, no mix."""

    def row_prompt(self, source: str, prompt: Prompt, settings: SettingsRecord) -> Prompt:
        """The prompt its row decodes ``source`` with, given the comparison's ``prompt``."""


def row_span(rows: torch.Tensor) -> slice | None:
    """``rows`` (a 1-D index tensor) as a slice when they are consecutive and ascending, else None: a step then reads
    and writes those batch rows as views instead of through index operators. Kept on the tensor: an attachment's
    rows are one tensor for every layer's hook and step, and reading them is a device-to-host copy (on a GPU, a
    wait for every queued kernel) that would otherwise come once per hooked layer."""
    kept = rows.__dict__.get("_pema_span")
    if kept is not None and kept[0] == version(rows):
        return kept[1]
    r = rows.tolist()
    span = slice(r[0], r[-1] + 1) if r and r == list(range(r[0], r[0] + len(r))) else None
    try:
        rows._pema_span = (version(rows), span)
    except RuntimeError:  # an inference tensor has no version counter (and cannot change outside inference mode)
        pass
    return span


_RENDERS: dict = {}  # (tokenizer, prompt) → the token ids of the prompt rendered for two unrelated sources


def shared_prompt_len(backbone: Backbone, prompt: Prompt, ctx: list[int]) -> int:
    """How many leading tokens of ``ctx`` (a source rendered by ``prompt``) the prompt renders the same for any
    source: the instruction and few-shot examples. Tokens at the slot's edge may merge with the source's first
    characters, so it is the prefix that ``ctx`` shares with the prompt rendered for two unrelated sources; at least
    one token of ``ctx`` is left over. Training and decoding both use it to tell the shared prefix from a sample's
    own positions."""
    key = (id(backbone.tokenizer), backbone.chat, json.dumps(prompt.to_dict(), sort_keys=True))
    others = _RENDERS.get(key)
    if others is None:
        if len(_RENDERS) > 64:
            _RENDERS.clear()
        others = _RENDERS[key] = [backbone.encode_context(prompt.render(s)) for s in ("0", "Xy")]
    return max(0, min(common_prefix_len([ctx, *others]), len(ctx) - 1))
