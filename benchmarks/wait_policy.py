"""``python -m benchmarks waitpolicy MEMORY [--beside]``: the decode step under each OpenMP wait policy — threads
sleeping at once (``OMP_WAIT_POLICY=PASSIVE``, the studio's) against a short spin (``GOMP_SPINCOUNT``, what the
training commands set: ``ground.spin_briefly``) — alone, and with ``--beside`` while a ``plugins train`` process
(threads spinning briefly, as it ships) trains the residual adapter on the same two cores.

Rows: the plug-ins of every in-network and output-level method trained on MEMORY (the newest one of each in
the catalog, e.g. a rank's; ``--plugin ID`` names others). A child process per policy and turn loads the backbone,
warms up, and times fixed-length decodes of the base row, 4 rows (base, PEMA, residual adapter, kNN) and 7 rows
(base + six methods): ms per step = (T(n) − T(1)) / (n − 1), the median of 3 sentences, and one whole 7-row
comparison of 48 tokens with traces, as the Compare tab decodes it. The training that ``--beside`` starts is killed
before it ends (it saves nothing). Which policy the studio keeps, and why: docs/precision.md, "Threads".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ground
from ground.store import Catalog

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("pema", "knn", "adapter", "lora", "memory_tuning", "memory_adapter")
FOUR = ("pema", "adapter", "knn")


def policies() -> dict[str, dict[str, str]]:
    return {"PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "short spin": {"GOMP_SPINCOUNT": ground.BATCH_SPIN_COUNT}}


def newest_plugins(memory_id: str, catalog) -> dict[str, str]:
    """The newest plug-in id of each of ``METHODS`` trained on the memory (any owner: a local benchmark)."""
    out: dict[str, str] = {}
    for row in sorted(catalog.plugins(), key=lambda r: r.get("created") or 0, reverse=True):
        if row.get("memory_id") == memory_id and row.get("method") in METHODS:
            out.setdefault(row["method"], row["id"])
    return out


def _child(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("memory")
    ap.add_argument("--plugins", required=True, help="method=id,...")
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args(argv)
    import numpy as np

    from backbone.model import load_backbone  # heavy (torch): after the wait policy is read from the environment
    from backbone.threads import wait_policy  # heavy, likewise
    from benchmarks.core import _decode_seconds, _FixedSteps  # heavy, likewise
    from engine import Row, compare  # heavy, likewise
    from eval.datasets import wmt_pairs  # heavy, likewise
    from plugins.api import open_memory, open_plugin  # heavy, likewise

    bb = load_backbone()
    catalog = Catalog()
    mem = open_memory(a.memory, bb, catalog)
    ids = dict(kv.split("=", 1) for kv in a.plugins.split(","))
    plugins = {m: open_plugin(catalog.plugin(i)["path"], bb) for m, i in ids.items()}
    src = [en for en, _ in wmt_pairs("dev", 0, 6)]
    configs = {"base": [Row("base")], "4 rows": [Row("base")] + [Row(m, plugins[m]) for m in FOUR],
               "7 rows": [Row("base")] + [Row(m, plugins[m]) for m in METHODS]}
    times: dict[str, list[float]] = {k: [] for k in configs}
    with _FixedSteps(bb):
        for c in configs.values():  # warm: kernels, the prefix cache
            compare(bb, src[0], c, mem.prompt, max_new_tokens=2, trace=False)
        for r in range(3):
            for k, c in configs.items():
                times[k].append(1000 * _decode_seconds(bb, c, mem.prompt, src[1 + r], a.tokens))
    t = time.perf_counter()
    compare(bb, src[4], configs["7 rows"], mem.prompt, max_new_tokens=48, trace=True)
    print(json.dumps({"policy": wait_policy(), "whole_7_rows_48_tokens_s": round(time.perf_counter() - t, 2),
                      "ms_per_step": {k: round(float(np.median(v)), 1) for k, v in times.items()}}))
    return 0


def run(memory: str, plugins: dict[str, str], turns: int, tokens: int, beside: bool) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    load = None
    if beside:
        load = subprocess.Popen([sys.executable, "-m", "plugins", "train", memory, "--method", "adapter", "--name",
                                 "waitpolicy-load"], cwd=ROOT, env=clean,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(45)  # past its backbone load and candidate vocabulary: into its training steps
    results: dict[str, list[dict]] = {k: [] for k in policies()}
    try:
        for _ in range(turns):
            for name, env in policies().items():
                out = subprocess.run([sys.executable, "-m", "benchmarks.wait_policy", "_child", memory, "--plugins",
                                      ",".join(f"{m}={i}" for m, i in plugins.items()), "--tokens", str(tokens)],
                                     cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, check=True)
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(name, results[name][-1], file=sys.stderr)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    return {"beside_training": beside, "turns": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks waitpolicy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("memory", help="memory id (in the default data directory)")
    ap.add_argument("--plugin", action="append", default=[], help="method=ID, to use instead of the newest")
    ap.add_argument("--beside", action="store_true", help="while a plugins-train process trains on the same cores")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    plugins = {**newest_plugins(args.memory, Catalog()), **dict(p.split("=", 1) for p in args.plugin)}
    missing = [m for m in METHODS if m not in plugins]
    if missing:
        ap.error(f"no plug-in of {', '.join(missing)} on memory {args.memory}: train them first "
                 f"(python -m eval rank {args.memory}) or name them with --plugin method=ID")
    out = run(args.memory, plugins, args.turns, args.tokens, args.beside)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:  # ``ground`` (imported above, before torch) read this child's environment
        sys.exit(_child(sys.argv[2:]))
    sys.exit(main())
