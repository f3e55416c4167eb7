"""``python -m benchmarks batchrows``: what batch-invariant rows cost (docs/evaluation.md, "Batch-invariant rows").

An evaluation's decode — chunks of sentences × methods in one batch, as ``eval.run.evaluate`` decodes them — in two
modes, alternated in one process (paired, so that a loaded machine weighs on both alike):

* ``invariant`` (the decode as it is): each context prefilled in a pass of its own after the prompt's shared prefix
  (its KV cache reused), the passes joined left-padded; decode steps pad-neutral;
* ``padded`` (the decode before): one left-padded prefill pass of every row (no prefix cache for several sentences),
  masked padding in the steps (positions shifted, attention over the padding).

Reports the seconds of each mode (median over the repeats), their ratio, and how many base outputs of the batched
decode differ from the sentence decoded alone with the base model (a one-row comparison), per mode.

    python -m benchmarks batchrows [--sentences 12] [--chunk 4] [--repeats 2] [--max-new-tokens 32]
                                   [--memory DIR]   # with a memory: kNN and the retrieved examples ticked too
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import engine.forward as forward
from backbone.cli import load_backbone_from_args
from backbone.model import Backbone
from backbone.tasks import task_prompt
from engine import Row, compare, decode_batch
from ground.cli import add_common

# English sentences of different lengths (a software message, news, a greeting): padding within every chunk
SENTENCES = [
    "Could not open file for reading: permission denied.",
    "The weather was cold, so we stayed inside and read books all afternoon.",
    "Good morning!",
    "The committee will publish its final report on the new railway line next spring.",
    "Press the button to continue.",
    "Thousands of people gathered in the main square to celebrate the end of the long strike.",
    "Where is the station?",
    "The update failed because the disk is full; free some space and try again.",
    "She has lived in this small village by the sea for more than forty years.",
    "Thank you very much.",
    "Unable to connect to the server. Check your network settings.",
    "After months of negotiations, the two companies finally agreed on the terms of the merger.",
]


@contextlib.contextmanager
def padded_mode():
    """The decode before batch-invariant rows: one left-padded prefill pass, masked padding in the steps."""
    per_context, forward_fc = forward._prefill_per_context, Backbone.forward_fc
    forward._prefill_per_context = lambda *a, **kw: None
    Backbone.forward_fc = lambda self, *a, **kw: forward_fc(self, *a, **{**kw, "pad_neutral": False})
    try:
        yield
    finally:
        forward._prefill_per_context, Backbone.forward_fc = per_context, forward_fc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks batchrows", description=__doc__.split("\n\n")[0])
    add_common(ap)
    ap.add_argument("--sentences", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=4, help="sentences per batch (eval.run.evaluate's batch_sources)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--memory", help="a memory folder: kNN and the retrieved examples join the base row")
    args = ap.parse_args(argv)
    bb = load_backbone_from_args(args)
    prompt = task_prompt("translation", bb)
    sources = SENTENCES[:args.sentences]
    rows = [Row("base")]
    if args.memory:
        import tempfile  # optional: only with a memory

        from plugins.api import open_memory, train_plugin  # optional: only with a memory

        mem = open_memory(args.memory, bb)
        for method in ("knn", "retrieval_icl"):
            rows.append(Row(method, train_plugin(bb, mem, method, {}, out_dir=tempfile.mkdtemp())[0]))
        prompt = mem.prompt
    alone = [compare(bb, s, [Row("base")], prompt, max_new_tokens=args.max_new_tokens, trace=False).rows[0].tokens
             for s in sources]
    seconds: dict[str, list[float]] = {"invariant": [], "padded": []}
    differ: dict[str, int] = {}
    for rep in range(args.repeats):
        for mode in ("invariant", "padded") if rep % 2 == 0 else ("padded", "invariant"):
            with padded_mode() if mode == "padded" else contextlib.nullcontext():
                t = time.perf_counter()
                base = []
                for c0 in range(0, len(sources), args.chunk):
                    for comp in decode_batch(bb, sources[c0:c0 + args.chunk], rows, prompt,
                                             max_new_tokens=args.max_new_tokens, trace=False):
                        base.append(comp.rows[0].tokens)
                seconds[mode].append(time.perf_counter() - t)
            differ[mode] = sum(a != b for a, b in zip(base, alone))
    med = {m: statistics.median(v) for m, v in seconds.items()}
    out = {"backbone": bb.name, "precision": bb.precision, "device": str(bb.device), "threads": torch.get_num_threads(),
           "sentences": len(sources), "chunk": args.chunk, "rows": [r.label for r in rows],
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
           "seconds": {m: [round(x, 2) for x in v] for m, v in seconds.items()},
           "median_s": {m: round(v, 2) for m, v in med.items()},
           "invariant_over_padded": round(med["invariant"] / med["padded"], 3),
           "base_outputs_unlike_alone": differ}
    print(json.dumps(out, indent=2))
    return 0
