"""``python -m benchmarks <name> [args]``: one entry point for every benchmark (``make bench`` runs ``all``).

    python -m benchmarks all | build | train | decode | softmax | head | rows | precision | knn1m | anchor | pair
                                            # the decode, training and precision benchmarks (benchmarks/core.py)
    python -m benchmarks live [...]         # live decode: slider moves against full decodes (benchmarks/live.py)
    python -m benchmarks explore [...]      # the studio's explore loop on a memory (benchmarks/explore.py)
    python -m benchmarks ray [...]          # memory builds on Ray workers vs in process (benchmarks/ray_workers.py)
    python -m benchmarks offsite [...]      # offsite decoding against a model owner's service (benchmarks/offsite.py)
    python -m benchmarks gpu [...]          # Gemma 3 270M's shapes with random weights: decode, build, training
                                            # speed on a GPU (or CPU-sized with --small; benchmarks/gpu.py)
    python -m benchmarks heldout MEMORY --plugin P   # teacher-forced NLL of a memory's held-out samples
    python -m benchmarks trainstep MEMORY [--method M] [--policies] [--threads]   # a training step's kernels,
                                            # OpenMP wait policy, and one process on every core against one a
                                            # core at once, A/B on the same batches (benchmarks/train_step.py)
    python -m benchmarks waitpolicy MEMORY [--beside]   # decode steps under each OpenMP wait policy, alone or
                                            # beside a training process (benchmarks/wait_policy.py)
    python -m benchmarks idle [--seconds 30] [--root CHECKOUT]   # an open tab with no running job: events sent,
                                            # DOM mutations, browser and server CPU (benchmarks/idle.py)
    python -m benchmarks domain-shift build --out DIR | prompts --split DIR   # a domain-shift split from gettext
                                            # catalogs; PEMA with built-in vs own prompt examples (domain_shift.py)
    python -m benchmarks batchrows [--memory DIR]   # an evaluation's decode with batch-invariant rows vs one
                                            # padded pass, paired (benchmarks/batch_rows.py)
"""
from __future__ import annotations

import importlib
import sys

OWN_MODULES = {"live": "benchmarks.live", "explore": "benchmarks.explore", "ray": "benchmarks.ray_workers",
               "offsite": "benchmarks.offsite", "gpu": "benchmarks.gpu", "heldout": "benchmarks.heldout",
               "trainstep": "benchmarks.train_step", "waitpolicy": "benchmarks.wait_policy", "idle": "benchmarks.idle",
               "domain-shift": "benchmarks.domain_shift", "batchrows": "benchmarks.batch_rows"}


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_MODULES:
        module = importlib.import_module(OWN_MODULES[argv[0]])  # heavy: only the benchmark asked for is imported
        result = module.main(argv[1:])
        return result if isinstance(result, int) else 0
    if "-h" in argv or "--help" in argv:  # core's benchmarks take positional arguments only: say so, run nothing
        print(__doc__)
        return 0
    from benchmarks import core  # heavy: the backbone and every method

    return core.main(argv)


if __name__ == "__main__":
    sys.exit(main())
