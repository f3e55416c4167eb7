"""One batched decode for a comparison: every method is a row (or, with beam search, a block of rows) of one batch
that shares the backbone's forward pass.

Per step: the backbone runs once for the whole batch with the in-network plug-ins' hooks active on their own rows;
f(c) of every row and the output-level plug-ins' extra states (PEMA's h_pd) go through the frozen norm + LM head
in **one** matrix product; each output-level plug-in mixes its rows; tokens are picked per row; rows stop
independently at the end of the sentence line. The prompt is encoded once per distinct in-network state (rows
without in-network plug-ins share one prefill); the forward pass then runs one row per distinct live batch row
(``BatchDecode``'s compact layout: rows that agree share, finished rows leave).

The engine sits below the methods (floor 3 of ARCHITECTURE.md): it imports only ``backbone``, ``ground``, torch and
the standard library, never a method (tests/test_architecture.py). What it needs of a method is typed in
``protocol`` (``DecodeMethod``; ``OutputMethod``, ``NetworkMethod``, ``PromptMethod`` by the way it acts); the
methods (``plugins``) import ``MixInput`` / ``MixOutput``, the mixing rule and the shared helpers from there.

Glossary — "row" alone is never enough; each kind has one name, used in names and docstrings:

- **method row** (``Row``; index ``r`` < R, ``batch.rows``): one method of the comparison — a label, a plug-in or
  None (the base model), settings. A group's ``members`` are method rows.
- **batch row** (``b`` < N = S·R·B): one (source ``s``, method row ``r``, beam ``j``) of the batched decode, at
  ``(s·R + r)·B + j`` (``Batch.batch_rows``). Token selection (``Beams``), ``StepOutput.final``, an output group's
  ``rows`` and the traces are per batch row.
- **prefill row** (``s·G + g`` < S·G): one (source, prefill group) of the prefill's forward pass; batch row ``b``
  starts from prefill row ``batch.prefill_row(b)``. Prefill group 0 holds the method rows without an in-network or
  prompt plug-in (when there are any), then one per in-network group, then one per prompt group.
- **cache row** (``phys[b]``, below P): one row of a step's forward pass, KV cache, f(c) and P_LM. Without the
  compact layout a cache row is a batch row; with it (``BatchDecode``) batch rows whose tokens agree share one and
  finished ones have none (``phys``: batch row → cache row).
- **attachment rows** (``Attachment.rows``): the rows an in-network plug-in's hooks act on in one forward pass —
  prefill rows in the prefill, cache rows in a step —; a hook's trace is keyed by position among them.
- **sub-batch rows** (``plugins.network.sub_batch``): the rows of a module re-run for one plug-in's rows; inside it,
  every attachment's rows read as positions among them.

An **in-network group** (``NetGroup``: one plug-in with one set of settings) attaches once per forward pass; what a
step's trace reads of its prefill and step attachments is one ``GroupAttachments``. An **output group**
(``OutGroup``: one plug-in) mixes its batch rows after the LM head.

Greedy by default; ``num_beams > 1`` runs beam search per row (no length penalty; a row stops when its best
finished hypothesis scores at least as well as its best live one, which is exact since scores only decrease).

The pieces, each usable (and tested) alone, in the order a decode runs them:

- ``protocol``: what a method offers the engine, ``MixInput`` / ``MixOutput``, ``mix_logprobs``, ``row_span``,
  ``shared_prompt_len``; ``comparison``: the settings every row of a comparison decodes with alike (the repetition
  guard);
- ``results``: ``Row`` (what a comparison asks for), ``Comparison`` / ``RowResult`` (what it returns);
- ``batch``: ``plan_batch``, the request checked and laid out as a ``Batch``;
- ``prefix_cache``: ``PREFIX_KV``, the prompt prefix's KV cache across decodes;
- ``forward``: ``prefill`` (prompts, prefix cache, rows and beams) and ``forward_step`` (the next forward pass);
- ``step``: ``decode_step`` (LM head, mixing, trace of one step; ``mix_step`` with P_LM given);
- ``beams``: ``Beams.select`` (greedy / beam token selection) and the repetition guard;
- ``stepping``: ``DecodeRun``, what every decode run one step at a time offers (``step``, ``partial``, ``result``,
  ``run``, ``live``);
- ``engine``: the one decode loop, ``BatchDecode.step``: ``BatchDecode`` runs it around the local forward pass
  (behind ``compare`` / ``decode_batch`` / ``start_compare``: a full decode and a streamed one alike),
  ``ForwardDecode`` around a forward pass given as a function (``decode_loop``: offsite);
- ``live``: ``LiveComparison`` / ``LiveMove``, a slider move's re-decode of only what changed (each of its
  re-decodes a ``BatchDecode`` resumed at the first step that changes);
- ``topk``: exact top-k over vocabulary-wide rows.
"""
from engine.batch import Batch, NetGroup, OutGroup, plan_batch
from engine.beams import Beams, ban_repeated_ngrams, repeated_ngram_ends
from engine.engine import (
    BatchDecode,
    ForwardDecode,
    compare,
    comparisons,
    decode_batch,
    decode_loop,
    start_compare,
    warm_comparison,
)
from engine.forward import forward_step, prefill
from engine.live import KEEP_TOP, TRACE_OWN, LiveComparison, LiveMove, StepRecords
from engine.prefix_cache import PREFIX_KV, PrefixKV
from engine.results import Comparison, Row, RowResult, row_result
from engine.step import GroupAttachments, StepOutput, decode_step, mix_step, trace_item
from engine.stepping import DecodeRun
from engine.topk import TOP, top_k, top_tokens

__all__ = ["Batch", "NetGroup", "OutGroup", "plan_batch", "Beams", "ban_repeated_ngrams", "repeated_ngram_ends",
           "BatchDecode", "ForwardDecode", "DecodeRun", "compare", "comparisons", "decode_batch", "decode_loop",
           "start_compare", "warm_comparison",
           "forward_step", "prefill", "KEEP_TOP", "TRACE_OWN", "LiveComparison", "LiveMove", "StepRecords",
           "PREFIX_KV", "PrefixKV", "Comparison", "Row", "RowResult", "row_result", "GroupAttachments", "StepOutput",
           "decode_step",
           "mix_step", "trace_item", "TOP", "top_k", "top_tokens"]
