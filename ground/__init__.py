"""Floor 1, the ground: the data directory and its catalog, the user-error and cancellation types, background-job
primitives and shared CLI pieces. It imports nothing of the project; every other package may import it."""
import os

# Idle OpenMP threads spin-wait by default; on a small shared CPU that starves the other work (measured: small
# matmuls ~50x slower on 2 busy cores). Must be set before torch starts its thread pool; users can override it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from ground.errors import Cancelled, UserError  # noqa: E402

__all__ = ["Cancelled", "UserError"]
