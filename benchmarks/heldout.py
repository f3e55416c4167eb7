"""``python -m benchmarks heldout``: the teacher-forced NLL of a memory's *held-out* samples (never trained on) under
the base model and under each plug-in given: a quality check cheaper than a decoded evaluation (``python -m eval run``)
and on data no training loop saw. Full
softmax over the whole vocabulary; an in-network plug-in acts as it decodes (on the sample's own positions when it
leaves the shared prompt prefix to the frozen backbone); an output-level plug-in (PEMA, kNN) mixes its distribution
with the LM's at its decode defaults, so its NLL is the one it decodes with.

    python -m benchmarks heldout <memory folder> --plugin <folder> [--plugin <folder> ...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from backbone.cli import load_backbone_from_args
from engine.protocol import MixInput
from ground.cli import add_common
from plugins.api import open_memory
from plugins.base import load_plugin
from plugins.seqtrain import collate, memory_sequences


def heldout_nll(bb, memory, plugin=None, batch_size: int = 8) -> dict:
    """Mean NLL per target token of ``memory``'s held-out samples with ``plugin`` (None: the base model)."""
    data = memory_sequences(bb, memory, "heldout")
    if not len(data):
        return {"samples": 0}
    tot, n = 0.0, 0
    net = plugin is not None and plugin.level == "network"
    for b0 in range(0, len(data), batch_size):
        idx = list(range(b0, min(len(data), b0 + batch_size)))
        ids, mask, labels = collate(bb, data, idx)
        handles = []
        if net:
            own = torch.tensor([data.shared_len(i) for i in idx]) if plugin.frozen_prefix else None
            handles = plugin.attach(None, {}, trace=False, own_from=own)
        try:
            with torch.no_grad():
                fc, _ = bb.forward_fc(ids, attention_mask=mask)
                sel = labels != -100
                f = fc[sel]
                lp = torch.log_softmax(bb.logits_from_fc(f).float(), -1)
                if plugin is not None and plugin.level == "output":  # a prompt-level row scores as the base
                    settings = [plugin.settings()] * f.shape[0]
                    extra = plugin.extra_states(f, settings)
                    vocab = plugin.head_vocab()
                    normed = None if extra is None else bb.final_norm(extra.to(bb.dtype))
                    ex = None if extra is None else (bb.head_logits(normed) if vocab is None
                                                     else bb.head_logits_subset(normed, vocab))
                    lp = plugin.mix(MixInput(fc=f, lm_logprobs=lp, extra_logits=ex, step=0,
                                             src_len=[0] * f.shape[0], settings=settings)).logprobs
                tok = labels[sel].to(lp.device)
                tot += float(-lp.gather(1, tok[:, None]).sum())
                n += int(sel.sum())
        finally:
            for h in handles:
                h.remove()
    return {"samples": len(data), "tokens": n, "nll": round(tot / max(n, 1), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks heldout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("memory", help="memory id or folder")
    ap.add_argument("--plugin", action="append", default=[], help="plug-in folder (repeatable)")
    ap.add_argument("--json", help="also write the results here")
    add_common(ap)
    args = ap.parse_args(argv)
    bb = load_backbone_from_args(args)
    mem = open_memory(args.memory, bb)
    t = time.time()
    out = {"memory": str(mem.path), "base": heldout_nll(bb, mem)}
    for ref in args.plugin:
        p = load_plugin(ref, bb)
        out[ref] = {"method": p.method, **heldout_nll(bb, mem, p)}
        print(f"{p.method} {ref}: {out[ref]}", file=sys.stderr)
    out["seconds"] = round(time.time() - t, 1)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
