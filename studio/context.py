"""What every studio service shares, handed to each through its constructor (``studio.service.Studio`` builds it)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
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
    # held from a request's quota checks to its job's queuing, so that concurrent requests are counted one by one
    admission: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

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

    def plugins_in_flight(self, owner: str) -> int:
        """Plug-ins the owner's queued or running jobs will add: one per training, one per method a ranking trains
        (counted when it was admitted: ``args["to_train"]``)."""
        jobs = self.jobs.list(kinds=("train_plugin", "rank"), states=("queued", "running"), owner=owner, limit=1000)
        return sum(1 if j["kind"] == "train_plugin" else int((j.get("args") or {}).get("to_train") or 0)
                   for j in jobs)

    def memories_in_flight(self, owner: str) -> int:
        """Memories the owner's queued or running builds will add."""
        return len(self.jobs.list(kinds=("build_memory",), states=("queued", "running"), owner=owner, limit=1000))
