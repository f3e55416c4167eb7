"""Slider benchmark: how long a live-control move takes when only what changed is re-decoded, against a
full decode of the same comparison. Results in BENCHMARKS.md, "Slider re-decode and streaming".

    python -m benchmarks live                          # Gemma 3 270M: 20 WMT dev sentences × 10 random moves
    python -m benchmarks live --backbone tiny          # the tiny in-process backbone (seconds)
    python -m benchmarks live --sentences 5 --moves 4 --check 99   # fewer; check every move against a full decode

Setup: a memory of 200 WMT train pairs, a PEMA plug-in trained briefly (30 s budget) and a kNN plug-in (exact
search); every comparison decodes base + PEMA + kNN together, greedy, up to ``--tokens`` new tokens (the studio's
default, 48), with the prompt-prefix KV cache as in the studio. Per dev sentence (0, 1, …): one plain full decode
(``engine.compare``: the reference time), one kept decode (what the studio runs: it also records what moves
need — its overhead is reported), then ``--moves`` random moves, each one live setting (from the methods'
declarations: PEMA λ_max / GU, kNN k / T / λ) of one row set to a random value on its slider's grid, each timed from
the request to the final comparison (``engine.start_compare`` with the kept comparison). The first
``--check`` moves are also decoded in full with the new settings and compared token for token.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from backbone import load_backbone
from backbone.model import cpu_description
from backbone.tasks import task_prompt
from backbone.tiny import tiny_backbone
from engine import LiveMove, Row, compare, start_compare
from eval.datasets import wmt_pairs
from memories.build import build_memory
from memories.parse import Sample
from plugins.api import train_plugin


def random_value(s, rng: random.Random):
    """A random value of a declared live setting on its control's grid."""
    if s.kind is bool:
        return rng.random() < 0.5
    if s.kind is int:
        return rng.randint(int(s.low), int(s.high))
    step = s.step or (s.high - s.low) / 100
    return round(s.low + step * rng.randint(0, int(round((s.high - s.low) / step))), 6)


def _run(run):
    while run.step():
        pass
    return run.result()[0]


def bench(backbone: str = "gemma-3-270m", sentences: int = 20, moves: int = 10, tokens: int = 48,
          pairs: int = 200, check: int = 20, seed: int = 0) -> dict:
    bb = tiny_backbone() if backbone == "tiny" else load_backbone(backbone)
    prompt = task_prompt("translation", bb)
    train = wmt_pairs("train", 0, pairs)
    if backbone == "tiny":  # its byte-level tokenizer makes long real sentences exceed the memory's token limit
        train = [(s, t) for s, t in train if max(len(s), len(t)) < 100]
    dev = wmt_pairs("dev", 0, sentences)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        mem = build_memory(bb, [Sample(s, t, i) for i, (s, t) in enumerate(train)], Path(tmp) / "mem",
                           prompt=prompt, heldout_frac=0.1)
        pema, _ = train_plugin(bb, mem, "pema", {"max_minutes": 0.5}, out_dir=Path(tmp) / "pema")
        knn, _ = train_plugin(bb, mem, "knn", {"search": "exact"}, out_dir=Path(tmp) / "knn")
        plugins = {"pema": pema, "knn": knn}
        live_settings = {m: [s for s in p.decode_settings if s.live] for m, p in plugins.items()}
        per_move, full_times, keep_times, checked, identical, kinds = [], [], [], 0, 0, {}
        for n, (src, _) in enumerate(dev):
            settings = {"pema": {}, "knn": {}}

            def rows():
                return [Row("base"), Row("PEMA", pema, dict(settings["pema"])), Row("kNN", knn, dict(settings["knn"]))]

            compare(bb, src, rows(), prompt, max_new_tokens=tokens)  # warm (prefix cache), as a studio session is
            t = time.perf_counter()
            compare(bb, src, rows(), prompt, max_new_tokens=tokens)
            full = time.perf_counter() - t
            t = time.perf_counter()
            first = start_compare(bb, src, rows(), prompt, max_new_tokens=tokens)
            _run(first)
            keep_times.append(time.perf_counter() - t)
            full_times.append(full)
            live = first.live()
            for _ in range(moves):
                m = rng.choice(sorted(plugins))
                s = rng.choice(live_settings[m])
                settings[m][s.name] = random_value(s, rng)
                t = time.perf_counter()
                run = start_compare(bb, src, rows(), prompt, max_new_tokens=tokens, live=live)
                got = _run(run)
                dt = time.perf_counter() - t
                kind = ("no token changed" if run.forwards == 0 else "re-decode from the first change") \
                    if isinstance(run, LiveMove) else "full decode (fallback)"
                kinds[kind] = kinds.get(kind, 0) + 1
                per_move.append({"sentence": n, "setting": f"{m}.{s.name}", "value": settings[m][s.name],
                                 "seconds": round(dt, 4), "ratio": round(dt / full, 4), "kind": kind,
                                 "forward_passes": run.forwards,
                                 "reused_steps": getattr(run, "reused_steps", 0)})
                if checked < check:
                    want = compare(bb, src, rows(), prompt, max_new_tokens=tokens)
                    checked += 1
                    identical += all(a.tokens == b.tokens for a, b in zip(got.rows, want.rows))
            print(f"sentence {n}: full {full:.2f}s, moves median "
                  f"{statistics.median(x['ratio'] for x in per_move if x['sentence'] == n):.3f}×", file=sys.stderr)
    ratios = [x["ratio"] for x in per_move]
    return {"backbone": bb.name, "dtype": str(bb.dtype), "precision": bb.precision, "machine": cpu_description(),
            "sentences": sentences, "moves_per_sentence": moves,
            "max_new_tokens": tokens, "rows": ["base", "PEMA", "kNN"],
            "full_decode_s_median": round(statistics.median(full_times), 3),
            "kept_decode_over_full_median": round(statistics.median(k / f for k, f in zip(keep_times, full_times)), 3),
            "move_over_full_median": round(statistics.median(ratios), 4),
            "move_over_full_p90": round(sorted(ratios)[int(0.9 * (len(ratios) - 1))], 4),
            "move_over_full_max": round(max(ratios), 4), "moves": len(ratios), "kinds": kinds,
            "checked_against_full_decode": checked, "identical": identical, "per_move": per_move}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="gemma-3-270m")
    ap.add_argument("--sentences", type=int, default=20, help="WMT dev sentences 0 … n−1")
    ap.add_argument("--moves", type=int, default=10, help="random slider moves per sentence")
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens (the studio's default)")
    ap.add_argument("--pairs", type=int, default=200, help="WMT train pairs in the memory")
    ap.add_argument("--check", type=int, default=20, help="moves also decoded in full and compared token by token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON result here")
    a = ap.parse_args(argv)
    res = bench(a.backbone, a.sentences, a.moves, a.tokens, a.pairs, a.check, a.seed)
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text, encoding="utf-8")
    print(json.dumps({k: v for k, v in res.items() if k != "per_move"}, indent=1))


if __name__ == "__main__":
    main()
