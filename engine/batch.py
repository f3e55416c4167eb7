"""A comparison's request laid out as one batch: sources × rows × beams, the rows' complete settings, the groups
of rows that share an in-network plug-in (one prefill and one attachment of hooks each), a prompt of their own (a
plug-in of level "prompt": one prefill each, its own context per source) or an output-level one (one mix each)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from backbone.model import Backbone
from backbone.prompts import Prompt
from engine.comparison import comparison_settings, split_comparison
from engine.protocol import NO_SETTINGS, NetworkMethod, OutputMethod, PromptMethod, row_span
from engine.results import Row
from ground.errors import UserError
from ground.settings import SettingsRecord


def _key(settings: SettingsRecord) -> str:
    """Settings as a key: rows with equal settings share an in-network group."""
    return json.dumps(settings.as_dict(), sort_keys=True, default=str)


@dataclass
class NetGroup:
    """Rows with the same in-network plug-in and settings: one prefill row per source, one attachment of hooks."""

    plugin: NetworkMethod
    key: str                  # the settings as JSON (with the plug-in, what the prefix cache is keyed by)
    settings: SettingsRecord
    members: list[int]        # its method rows
    prefill: int = 0          # its prefill group
    rows: torch.Tensor | None = None  # its method rows' batch rows


@dataclass
class PromptGroup:
    """Rows whose plug-in prompts each source its own way (level "prompt", ``PromptMethod.row_prompt``) with the same
    settings: one prefill row per source, from its own context; no hooks, no mix (the model's distribution)."""

    plugin: PromptMethod
    key: str
    settings: SettingsRecord
    members: list[int]        # its method rows
    contexts: list[list[int]]  # per source: the row's context token ids
    prompts: list[Prompt]      # per source: the prompt they render
    prefill: int = 0


@dataclass
class OutGroup:
    """Rows whose plug-in mixes the output distribution (output-level, or in-network with ``mixes_output``)."""

    plugin: OutputMethod
    rows: torch.Tensor        # its method rows' batch rows
    settings: list[SettingsRecord]  # per batch row
    src_lens: list[int]       # per batch row
    ref_lens: list[int | None] | None = None  # per batch row, when the request gave reference lengths

    @property
    def row_index(self) -> slice | torch.Tensor:
        """``rows`` as a slice where they are consecutive (the usual layout): a step then reads the rows' P_LM as a
        view and writes their mixture with one copy, instead of an indexed copy of vocabulary-wide rows each way."""
        span = row_span(self.rows)
        return self.rows if span is None else span


@dataclass
class Batch:
    """One batched decode: S sources × R method rows × B beams at batch row ``(s·R + r)·B + j``, the method rows'
    settings and groups (the kinds of rows: ``engine``'s glossary). Prefill group 0 holds the method rows
    that decode the comparison's prompt without an in-network plug-in (when there are any: ``shared``), then one
    group per in-network group, then one per prompt group; prefill row ``s·G + g``, whose context is
    ``prefill_contexts[s·G + g]``."""

    sources: list[str]
    rows: list[Row]
    prompt: Prompt
    contexts: list[list[int]]
    src_lens: list[int]
    settings: list[SettingsRecord]  # per method row, complete (the method's own settings, its typed record)
    num_beams: int
    net: list[NetGroup]
    out: list[OutGroup]
    shared: int
    group_of_row: list[int]   # per method row: its prefill group
    comparison: dict = field(default_factory=dict)  # settings of every row alike that are on (repetition guard)
    ref_lens: list[int] | None = None  # per source: the reference's token length (evaluation only; else None)
    prompts: list[PromptGroup] = field(default_factory=list)

    @property
    def S(self) -> int:
        return len(self.sources)

    @property
    def R(self) -> int:
        return len(self.rows)

    @property
    def B(self) -> int:
        return self.num_beams

    @property
    def N(self) -> int:
        return self.S * self.R * self.B

    @property
    def G(self) -> int:
        return self.shared + len(self.net) + len(self.prompts)

    @property
    def prefill_contexts(self) -> list[list[int]]:
        """The context of every prefill row ``s·G + g``: a prompt group's own, else the source's."""
        own = {grp.prefill: grp for grp in self.prompts}
        return [own[g].contexts[s] if g in own else self.contexts[s] for s in range(self.S) for g in range(self.G)]

    @property
    def padded(self) -> bool:
        """Whether the prefill rows are left-padded (several sources, or contexts of unequal length), so that
        every forward pass needs the attention mask."""
        return self.S > 1 or len({len(c) for c in self.prefill_contexts}) > 1

    def batch_rows(self, members: list[int]) -> list[int]:
        """The batch rows of method rows ``members``: every source, every beam."""
        return [(s * self.R + i) * self.B + j for s in range(self.S) for i in members for j in range(self.B)]

    def source_of(self, b: int) -> int:
        """The source of batch row ``b``."""
        return b // (self.R * self.B)

    def method_row_of(self, b: int) -> int:
        """The method row of batch row ``b``."""
        return (b // self.B) % self.R

    def prefill_row(self, b: int) -> int:
        """The prefill row whose KV cache batch row ``b`` starts from."""
        return self.source_of(b) * self.G + self.group_of_row[self.method_row_of(b)]


def _comparison_of(rows: list[Row], given: dict | None) -> tuple[dict, list[SettingsRecord | dict]]:
    """The batch's comparison settings (``given``, else those the rows ask for, which must agree: they apply
    to every row alike) and each row's own settings without them."""
    found: dict = dict(given or {})
    own = []
    for r in rows:
        if isinstance(r.settings, SettingsRecord):
            comp, rest = dict(r.comparison), r.settings
        else:
            comp, rest = split_comparison(r.settings)
            comp = {**r.comparison, **comp}
        for k, v in comparison_settings(comp).items() if comp else ():
            if k in found and found[k] != v and not (given and k in given):
                raise UserError(f"The setting {k!r} applies to every row of a comparison alike; rows ask for "
                                f"{found[k]!r} and {v!r}.")
            found.setdefault(k, v)
        own.append(rest)
    return comparison_settings(found), own


def plan_batch(backbone: Backbone, sources: list[str], rows: list[Row], prompt: Prompt | None = None,
               num_beams: int = 1, contexts: list[list[int]] | None = None,
               comparison: dict | None = None, ref_lens: list[int] | None = None) -> Batch:
    """Check a request and lay out its batch: every row's complete settings, in-network groups by (plug-in,
    settings), output-level groups by plug-in; the comparison settings (``comparison``, or found in the rows'
    settings) that every row decodes with."""
    if not rows:
        raise UserError("Choose at least one method to compare.")
    if not sources or any(not s or not s.strip() for s in sources):
        raise UserError("Type a sentence to translate or rewrite.")
    if num_beams < 1:
        raise UserError("The number of beams must be ≥ 1.")
    if ref_lens is not None and (len(ref_lens) != len(sources) or any(int(n) < 0 for n in ref_lens)):
        raise UserError("Reference lengths: one non-negative token count per source.")
    for r in rows:
        if r.plugin is not None and r.plugin.fingerprint != backbone.fingerprint:
            backbone.check_fingerprint(r.plugin.fingerprint, f"The plug-in of row {r.label!r}")
    prompt = prompt or Prompt(chat=backbone.chat)
    ctxs = contexts or [backbone.encode_context(prompt.render(s)) for s in sources]
    src_lens = [len(backbone.encode_target(s.strip())) for s in sources]
    comp, own = _comparison_of(rows, comparison)
    settings = [r.plugin.settings(o) if r.plugin is not None else NO_SETTINGS for r, o in zip(rows, own)]
    for r in rows:
        if r.plugin is not None:
            r.plugin.prepare_decode()
    net: dict[tuple, NetGroup] = {}
    own: dict[tuple, PromptGroup] = {}
    out: dict[int, tuple[OutputMethod, list[int]]] = {}
    for i, r in enumerate(rows):
        if r.plugin is None:
            continue
        if r.plugin.level == "prompt":
            k = _key(settings[i])
            if (id(r.plugin), k) not in own:
                ps = [r.plugin.row_prompt(s, prompt, settings[i]) for s in sources]
                own[(id(r.plugin), k)] = PromptGroup(r.plugin, k, settings[i], [], [
                    backbone.encode_context(p.render(s)) for p, s in zip(ps, sources)], ps)
            own[(id(r.plugin), k)].members.append(i)
        if r.plugin.level == "network":
            k = _key(settings[i])
            if (id(r.plugin), k) not in net:
                net[(id(r.plugin), k)] = NetGroup(r.plugin, k, settings[i], [])
            net[(id(r.plugin), k)].members.append(i)
        if r.plugin.level == "output" or r.plugin.mixes_output:
            out.setdefault(id(r.plugin), (r.plugin, []))[1].append(i)
    shared = int(any(r.plugin is None or r.plugin.level not in ("network", "prompt") for r in rows))
    batch = Batch(list(sources), list(rows), prompt, ctxs, src_lens, settings, num_beams, list(net.values()), [],
                  shared, [0] * len(rows), comp, None if ref_lens is None else [int(n) for n in ref_lens],
                  list(own.values()))
    dev = backbone.device
    for g, grp in enumerate(batch.net, start=shared):
        grp.prefill = g
        grp.rows = torch.tensor(batch.batch_rows(grp.members), device=dev)
        for i in grp.members:
            batch.group_of_row[i] = g
    for g, pgrp in enumerate(batch.prompts, start=shared + len(batch.net)):
        pgrp.prefill = g
        for i in pgrp.members:
            batch.group_of_row[i] = g
    for plugin, members in out.values():
        rr = batch.batch_rows(members)
        batch.out.append(OutGroup(plugin, torch.tensor(rr, device=dev), [settings[batch.method_row_of(b)] for b in rr],
                                  [src_lens[batch.source_of(b)] for b in rr],
                                  None if batch.ref_lens is None else [batch.ref_lens[batch.source_of(b)] for b in rr]))
    return batch
