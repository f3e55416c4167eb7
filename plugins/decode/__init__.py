"""One batched decode for a comparison: every method is a row (or, with beam search, a block of rows) of one batch
that shares the backbone's forward pass.

Per step: the backbone runs once for the whole batch with the in-network plug-ins' hooks active on their own rows;
f(c) of every row and the output-level plug-ins' extra states (PEMA's h_pd) go through the frozen norm + LM head
in **one** matrix product; each output-level plug-in mixes its rows; tokens are picked per row; rows stop
independently at the end of the sentence line. The prompt is encoded once per distinct in-network state (rows
without in-network plug-ins share one prefill); the forward pass then runs one row per distinct live batch row
(``BatchDecode``'s compact layout: rows that agree share, finished rows leave).

Greedy by default; ``num_beams > 1`` runs beam search per row (no length penalty; a row stops when its best
finished hypothesis scores at least as well as its best live one, which is exact since scores only decrease).

The pieces, each usable (and tested) alone, in the order a decode runs them:

- ``results``: ``Row`` (what a comparison asks for), ``Comparison`` / ``RowResult`` (what it returns);
- ``batch``: ``plan_batch``, the request checked and laid out as a ``Batch``;
- ``prefix_cache``: ``PREFIX_KV``, the prompt prefix's KV cache across decodes;
- ``forward``: ``prefill`` (prompts, prefix cache, rows and beams) and ``forward_step`` (the next forward pass);
- ``step``: ``decode_step`` (LM head, mixing, trace of one step; ``mix_step`` with P_LM given);
- ``beams``: ``Beams.select`` (greedy / beam token selection) and the repetition guard;
- ``engine``: ``BatchDecode`` (the local loop, one step at a time) behind ``compare`` / ``decode_batch`` /
  ``start_compare``, and ``decode_loop`` (the same steps around a forward pass given as a function: offsite);
- ``live``: ``LiveComparison`` / ``LiveMove``, a slider move's re-decode of only what changed;
- ``topk``: exact top-k over vocabulary-wide rows.
"""
from plugins.decode.batch import Batch, NetGroup, OutGroup, plan_batch
from plugins.decode.beams import Beams, ban_repeated_ngrams, repeated_ngram_ends
from plugins.decode.engine import (
    BatchDecode,
    compare,
    comparisons,
    decode_batch,
    decode_loop,
    start_compare,
)
from plugins.decode.forward import forward_step, prefill
from plugins.decode.live import KEEP_TOP, TRACE_OWN, LiveComparison, LiveMove, StepRecords
from plugins.decode.prefix_cache import PREFIX_KV, PrefixKV
from plugins.decode.results import Comparison, Row, RowResult, row_result
from plugins.decode.step import StepOutput, decode_step, mix_step, trace_item
from plugins.decode.topk import TOP, top_k, top_tokens

__all__ = ["Batch", "NetGroup", "OutGroup", "plan_batch", "Beams", "ban_repeated_ngrams", "repeated_ngram_ends",
           "BatchDecode", "compare", "comparisons", "decode_batch", "decode_loop", "start_compare",
           "forward_step", "prefill", "KEEP_TOP", "TRACE_OWN", "LiveComparison", "LiveMove", "StepRecords",
           "PREFIX_KV", "PrefixKV", "Comparison", "Row", "RowResult", "row_result", "StepOutput", "decode_step",
           "mix_step", "trace_item", "TOP", "top_k", "top_tokens"]
