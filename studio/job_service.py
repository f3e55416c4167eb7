"""The studio's job table as its owners see it: one job, the latest jobs, cancelling (``ground.jobs.JobQueue``
runs them; each service submits its own kinds and registers their handlers)."""
from __future__ import annotations

from ground.errors import UserError
from studio.context import StudioContext
from studio.job_status import job_timing, training_status


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
        return out

    def job(self, job_id: str, *, owner: str | None = None) -> dict:
        """One of the owner's jobs (another owner's job reads as nonexistent)."""
        j = self.ctx.jobs.get(str(job_id or ""), self.ctx.owner(owner))
        if j is None:
            raise UserError(f"No job {job_id!r}.")
        return self.public_job(j)

    def list_jobs(self, kinds: tuple[str, ...] | None = None, limit: int = 30, *, owner: str | None = None,
                  states: tuple[str, ...] | None = None) -> list[dict]:
        """The owner's latest jobs, newest first."""
        return [self.public_job(j) for j in self.ctx.jobs.list(kinds=kinds, states=states,
                                                               limit=max(1, min(int(limit or 30), 200)),
                                                               owner=self.ctx.owner(owner))]

    def cancel_job(self, job_id: str, *, owner: str | None = None) -> dict:
        return self.public_job(self.ctx.jobs.cancel(str(job_id or ""), self.ctx.owner(owner)))
