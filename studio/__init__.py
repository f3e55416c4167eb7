"""Shared services of PEMA Studio: errors, the data directory and catalog, background jobs."""
from studio.errors import UserError

__all__ = ["UserError"]
