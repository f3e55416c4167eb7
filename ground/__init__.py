"""Floor 1, the ground: the data directory and its catalog, the user-error and cancellation types, background-job
primitives, shared CLI pieces and the declared setting (``settings``). It imports nothing of the project; every
other package may import it.

It also chooses how OpenMP's idle threads wait, which must happen before torch loads its OpenMP runtime (the first
import of ``ground`` does it; ``backbone`` and ``app`` import ``ground`` first): by default they sleep at once
(``OMP_WAIT_POLICY=PASSIVE``): idle spinning threads starve other work on a small shared CPU (measured: BENCHMARKS.md,
"Training defaults, decided by measurement", row "the studio's wait policy"), and a decode step runs its small work on
one thread (docs/precision.md, "Threads"). A process that only trains, builds or ranks calls :func:`spin_briefly` first:
its threads then spin for a short while before they sleep (``GOMP_SPINCOUNT``), because under PASSIVE each of a training
step's thousands of parallel regions first wakes a sleeping thread (BENCHMARKS.md, "Training defaults, decided by
measurement", row "OpenMP's wait policy in training"). A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left as
it is."""
import os
import sys

USER_WAIT_POLICY = any(k in os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
BATCH_SPIN_COUNT = "20000"  # libgomp's spin iterations before an idle thread sleeps (its own default: 300,000)
if not USER_WAIT_POLICY:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def spin_briefly() -> bool:
    """For a process that only trains, builds or ranks (a CLI's ``train``, ``build``, ``rank``): OpenMP's idle threads
    spin ``BATCH_SPIN_COUNT`` iterations before they sleep. Only before torch has loaded, and not over a user's own
    setting; returns whether it took effect."""
    if USER_WAIT_POLICY or "torch" in sys.modules:
        return False
    os.environ.pop("OMP_WAIT_POLICY", None)
    os.environ["GOMP_SPINCOUNT"] = BATCH_SPIN_COUNT
    return True


from ground.errors import Cancelled, UserError  # noqa: E402

__all__ = ["Cancelled", "UserError", "spin_briefly", "BATCH_SPIN_COUNT", "USER_WAIT_POLICY"]
