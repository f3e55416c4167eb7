"""Shared services of PEMA Studio: errors, the data directory and catalog, background jobs."""
import os

# Idle OpenMP threads spin-wait by default; on a small shared CPU that starves the other work (measured: small
# matmuls ~50x slower on 2 busy cores). Must be set before torch starts its thread pool; users can override it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from studio.errors import UserError

__all__ = ["UserError"]
