"""``python -m benchmarks trainstep MEMORY [--method adapter]``: where an in-network training step's time goes on a
CPU, two A/B timings on the same fixed mini-batches of a memory (the shipped default config of the method):

* **kernels** (one process, the conditions taking turns, threads spinning briefly as in ``plugins train``): a
  frozen float16 weight-only linear trained through on FBGEMM's float16 kernel (the default,
  ``backbone.kernels.Fp16WeightLinear``) against MKL's float32 ``F.linear`` on the same rounded weights;
* **wait policy** (``--policies``: a child process per condition, taking turns, each loading the backbone): OpenMP's
  idle threads sleeping at once (``OMP_WAIT_POLICY=PASSIVE``, the studio's) against a short spin
  (``GOMP_SPINCOUNT``, what ``plugins train`` sets: ``ground.spin_briefly``);
* **threads** (``--threads``: child processes, taking turns): one process on every core against one process a core,
  all at once, each on one thread — whether trainings side by side (a rank's ``--workers``) get more steps out of the
  same cores than one after another. Its ratio is the throughput of the processes at once over the one process's.

Each turn runs ``--steps`` training steps (forward, backward, Adam) over mini-batches spread over the memory's
length buckets; the table gives every turn's seconds and the median. Ratios within one run are what to compare.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _steps_runner(memory: str, method: str, steps: int):
    """A closure running ``steps`` fixed training steps of ``method`` on ``memory``, and its batches' tokens."""
    import torch

    from backbone.model import load_backbone  # heavy (torch): after the wait policy is chosen
    from ground.store import Catalog  # lazy with the heavy ones above
    from plugins.api import open_memory  # heavy, likewise
    from plugins.registry import get_method  # heavy, likewise

    bb = load_backbone()
    mem = open_memory(memory, bb, Catalog())  # an id in the default data directory, or a folder
    cls = get_method(method)
    plugin = cls(cls.Config(), bb, None)
    train, _ = plugin._data(mem)
    plugin.prepare_candidates(mem)
    params = plugin._trainable()
    for p in plugin.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    batches = plugin.training_batches(train)
    opt = torch.optim.Adam(params, lr=plugin.config.lr)
    picked = list(range(0, len(batches), max(1, len(batches) // steps)))[:steps]
    tokens = sum(batches[i].tokens for i in picked)  # prepared once, outside the timings

    def run() -> float:
        t = time.perf_counter()
        for i in picked:
            loss, _, _ = plugin.train_batch_loss(batches[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return time.perf_counter() - t

    run()  # warm-up
    return run, tokens


def kernels(memory: str, method: str, steps: int, turns: int) -> dict:
    from backbone.kernels import Fp16WeightLinear, KernelLinear  # heavy (torch): after the wait policy is chosen

    run, tokens = _steps_runner(memory, method, steps)
    fbgemm = Fp16WeightLinear.forward
    times: dict[str, list[float]] = {"fbgemm_float16": [], "mkl_float32": []}
    try:
        for _ in range(turns):
            for name, forward in (("fbgemm_float16", fbgemm), ("mkl_float32", KernelLinear.forward)):
                Fp16WeightLinear.forward = forward
                times[name].append(run())
    finally:
        Fp16WeightLinear.forward = fbgemm
    return {"tokens_per_turn": tokens, "seconds": times}


def policies(memory: str, method: str, steps: int, turns: int) -> dict:
    envs = {"PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "short spin": {"GOMP_SPINCOUNT": "20000"}}
    times: dict[str, list[float]] = {k: [] for k in envs}
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for _ in range(turns):
        for name, env in envs.items():
            out = subprocess.run([sys.executable, "-m", "benchmarks.train_step", "_child", memory, "--method", method,
                                  "--steps", str(steps)], cwd=ROOT, env={**base, **env}, capture_output=True,
                                 text=True, check=True)
            times[name].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    return {"seconds": times}


def threads(memory: str, method: str, steps: int, turns: int) -> dict:
    """Seconds of ``steps`` training steps: one child on every core, then one child a core at once (one thread each);
    ``throughput_ratio``: the children's steps per second together over the single child's (median turns)."""
    cores = max(1, os.cpu_count() or 1)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    cmd = [sys.executable, "-m", "benchmarks.train_step", "_child", memory, "--method", method, "--steps", str(steps)]
    times: dict[str, list[float]] = {f"1 process, {cores} threads": [], f"{cores} processes, 1 thread each": []}
    for _ in range(turns):
        out = subprocess.run(cmd, cwd=ROOT, env={**base, "GOMP_SPINCOUNT": "20000", "OMP_NUM_THREADS": str(cores)},
                             capture_output=True, text=True, check=True)
        times[f"1 process, {cores} threads"].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
        procs = [subprocess.Popen(cmd, cwd=ROOT, env={**base, "GOMP_SPINCOUNT": "20000", "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.PIPE, text=True) for _ in range(cores)]
        secs = [json.loads(p.communicate()[0].strip().splitlines()[-1])["seconds"] for p in procs]
        times[f"{cores} processes, 1 thread each"].append(max(secs))
    one, many = (statistics.median(v) for v in times.values())
    return {"seconds": times, "throughput_ratio": round(cores * one / many, 3)}


def _table(title: str, result: dict) -> str:
    rows = result["seconds"]
    med = {k: statistics.median(v) for k, v in rows.items()}
    first = next(iter(med.values()))
    lines = [title] + [f"  {k:16s} turns {', '.join(f'{t:.2f}' for t in v)} s   median {med[k]:.2f} s   "
                       f"ratio {med[k] / first:.3f}" for k, v in rows.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks trainstep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("memory", help="memory id or folder")
    ap.add_argument("--method", default="adapter")
    ap.add_argument("--steps", type=int, default=6, help="training steps per turn")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--policies", action="store_true", help="also time the two OpenMP wait policies (children)")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernels' A/B (the policies or threads only)")
    ap.add_argument("--threads", action="store_true",
                    help="also time one process on every core against one process a core at once (children)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    import ground  # heavy callers below: the wait policy first (not heavy itself, but it must precede torch)

    ground.spin_briefly()  # the kernels' turns under the policy ``plugins train`` trains with
    out: dict = {"method": args.method}
    if not args.no_kernels:
        out["kernels"] = kernels(args.memory, args.method, args.steps, args.turns)
        print(_table(f"{args.method}: {args.steps} steps a turn, kernels (one process)", out["kernels"]))
    if args.policies:
        out["policies"] = policies(args.memory, args.method, args.steps, args.turns)
        print(_table(f"{args.method}: wait policy (a process a turn)", out["policies"]))
    if args.threads:
        out["threads"] = threads(args.memory, args.method, args.steps, args.turns)
        print(_table(f"{args.method}: {args.steps} steps a process, threads (a turn each)", out["threads"]))
        print("  steps per second of the processes at once over the one process's: "
              f"{out['threads']['throughput_ratio']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


def _child(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("memory")
    ap.add_argument("--method", default="adapter")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args(argv)
    run, tokens = _steps_runner(a.memory, a.method, a.steps)
    print(json.dumps({"seconds": run(), "tokens": tokens}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:
        import ground  # noqa: F401  (not heavy: the wait policy from this child's environment, before torch loads)

        sys.exit(_child(sys.argv[2:]))
    sys.exit(main())
