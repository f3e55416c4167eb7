"""What every studio service shares, handed to each through its constructor (``studio.service.Studio`` builds it)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ground.errors import UserError
from ground.jobs import JobQueue
from ground.store import Catalog
from studio.identity import LOCAL, NO_KEY
from studio.limits import Limits


@dataclass
class StudioContext:
    """The data directory's catalog, the request bounds, the job queue and the owner rule.

    ``limits`` may be replaced while the studio runs (a test narrowing a bound): services read it from here at each
    call, never keep a copy. ``read_only``: another process owns the data directory (no job worker, no imports)."""

    catalog: Catalog
    limits: Limits
    jobs: JobQueue
    multi_user: bool = False
    read_only: bool = False

    @property
    def root(self) -> Path:
        return self.catalog.root

    def owner(self, owner: str | None) -> str:
        """The owner a call acts for: ``None`` is the local user in single-user mode, refused in multi-user mode."""
        if owner is None or owner == "":
            if self.multi_user:
                raise UserError(NO_KEY)
            return LOCAL
        if not isinstance(owner, str):
            raise TypeError(f"owner must be a string, not {type(owner).__name__}")
        return owner
