"""The studio's job table as its owners see it: one job, the latest jobs, cancelling (``ground.jobs.JobQueue``
runs them; each service submits its own kinds and registers their handlers)."""
from __future__ import annotations

from ground.errors import UserError
from ground.jobs import finite
from studio.context import StudioContext
from studio.job_status import job_timing, training_status
from studio.limits import check_number


class JobService:
    """Reads and cancels the owner's jobs; never another owner's (it reads as nonexistent)."""

    def __init__(self, ctx: StudioContext):
        self.ctx = ctx

    @staticmethod
    def public_job(j: dict) -> dict:
        """A job as its owner sees it: without the server's path of a pending upload; with its elapsed time and
        ETA (``job_timing``) and, for a finished training, how it ended (``training``: ``training_status``)."""
        out = {**j, "args": {k: v for k, v in j["args"].items() if k != "upload"}, **job_timing(j)}
        res = j.get("result") if isinstance(j.get("result"), dict) else None
        if j["kind"] == "train_plugin" and res and "metrics" in res:
            out["training"] = res.get("training") or training_status(res["metrics"])
        return finite(out)  # standard JSON only: no NaN or Infinity reaches a client

    def job(self, job_id: str, *, owner: str | None = None) -> dict:
        """One of the owner's jobs (another owner's job reads as nonexistent)."""
        j = self.ctx.jobs.get(str(job_id or ""), self.ctx.owner(owner))
        if j is None:
            raise UserError(f"No job {job_id!r}.")
        return self.public_job(j)

    def list_jobs(self, kinds: tuple[str, ...] | None = None, limit: int = 30, *, owner: str | None = None,
                  states: tuple[str, ...] | None = None) -> list[dict]:
        """The owner's latest jobs, newest first."""
        limit = check_number(30 if limit is None else limit, "limit", 0, 200, integer=True) or 30
        return [self.public_job(j) for j in self.ctx.jobs.list(kinds=kinds, states=states, limit=limit,
                                                               owner=self.ctx.owner(owner))]

    def cancel_job(self, job_id: str, *, owner: str | None = None) -> dict:
        return self.public_job(self.ctx.jobs.cancel(str(job_id or ""), self.ctx.owner(owner)))
