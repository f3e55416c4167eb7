"""The Studio service: everything the web app does, as plain methods (the ``ui/`` modules only call these).

It owns the data directory and its catalog, the loaded backbone (loaded in a background thread so the page can
show progress), the job queue (memory builds, plug-in training, evaluations), a cache of loaded plug-ins, the
recent comparisons of this process and the shared ones (stored in the catalog under unguessable ids).

Sharing the backbone between threads: the backbone is one frozen model, but decoding and training attach forward
hooks to it (f(c) capture, in-network plug-ins), so two threads must never run it at the same time. A
:class:`BackboneGate` makes its use exclusive; a background job holds it for its whole run but hands it over at
its checkpoints (between batches, where the engine calls ``should_stop``) whenever an interactive user is
waiting, so a comparison runs within one training batch instead of after the whole job. This relies on the engine's
convention that a plug-in's ``fit`` attaches its hooks per batch and holds none while it calls ``should_stop``.
An interactive call waits at most ``busy_timeout`` seconds and then says why it cannot run.

Owners: every method that reads or acts on a memory, plug-in, job, comparison or share takes ``owner`` (see
``studio.identity``) and treats another owner's things as nonexistent ("No memory 'x'"); ``owner=None`` means the
local user in single-user mode and is refused in multi-user mode. Shares are the exception by design: anyone with a
share's unguessable id may read it. ``limits`` (``studio.limits.Limits``) bound each request and each owner.

One data directory, one owner process: the Studio's job queue takes ``<data_dir>/studio.lock`` (``ground.lock``) for
the process's lifetime. The owner repairs the directory at start-up — temporary folders and files of writers that
are gone, catalog rows without folders and folders without rows (``Catalog.repair``), uploads no queued job needs —
marks jobs left running ``interrupted`` and runs the queue. A second Studio on a live directory (another process, or
another Studio in this one) gets ``read_only = True``: it serves pages, comparisons and shares (and deletes, as a CLI
may) but has no job worker and refuses to queue builds, trainings and evaluations; it never cleans, repairs, marks
or claims anything.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from backbone.model import DEFAULT_BACKBONE
from ground.errors import UserError
from ground.jobs import JobQueue
from ground.store import Catalog, clean_temporary
from studio.backbone_service import BackboneService, check_remote_url
from studio.compare_service import CompareService
from studio.evaluate_service import EvaluateService
from studio.gate import BackboneGate
from studio.identity import LOCAL, NO_KEY, Identity
from studio.limits import Limits
from studio.memory_service import MemoryService
from studio.plugin_service import PluginService
from studio.rank_service import RankService
from studio.ray_executor import make_executor
from studio.several_service import SeveralService
from studio.uploads import UploadLedger

__all__ = ["BackboneGate", "Studio"]
log = logging.getLogger("pema.studio")


class Studio(BackboneService, MemoryService, PluginService, CompareService, SeveralService, EvaluateService,
             RankService):
    """The app's service object. ``backbone`` is a name ("gemma-3-270m", a hub id, a local path, or "tiny")."""

    def __init__(self, data_dir: str | Path | None = None, backbone: str | None = None, device: str | None = None,
                 workers: int = 1, load: bool = True, start_jobs: bool = True, busy_timeout: float = 120.0,
                 backbone_cache: str | Path | None = None, multi_user: bool = False, limits: Limits | None = None,
                 secret: str | None = None, remote: str | None = None, remote_token: str | None = None,
                 executor=None):
        """``backbone_cache``: another data directory whose ``backbones/`` may already hold the de-quantized
        weights (e.g. baked into a Docker image); used when it has the requested backbone, else ``data_dir``.
        ``multi_user``: callers are told apart by their keys (``studio.identity``); else everyone is the local user.
        ``limits``: default ``Limits.configure(multi_user)`` (defaults ← ``PEMA_LIMIT_*``). ``secret``: signs the
        keys (default ``$PEMA_SECRET``, else a secret file in the data directory). ``remote``: a model owner's
        offsite service instead of a local backbone (``studio.backbone_service``; bearer ``remote_token``, else
        ``$PEMA_REMOTE_TOKEN``). ``executor``: None / "inprocess" (the default, unless ``$PEMA_RAY_ADDRESS`` is
        set), "ray", or a started ``studio.ray_executor.RayExecutor``."""
        if remote:
            self.remote_url, self._remote_token = check_remote_url(remote), remote_token or None
        self.catalog = Catalog(data_dir)
        self.root = self.catalog.root
        self.multi_user = bool(multi_user)
        self.identity = Identity(self.root, self.multi_user, secret)
        self.limits = limits or Limits.configure(self.multi_user)
        self.uploads = UploadLedger(self.limits)  # who uploaded which file through the web app
        self.backbone_name = backbone or DEFAULT_BACKBONE
        self.backbone_cache = Path(backbone_cache) if backbone_cache else None
        self.device = device
        self.busy_timeout = busy_timeout
        self.gate = BackboneGate()
        self._bb = None
        self._load = {"state": "idle", "progress": 0.0, "message": "Not loaded", "error": "", "started": None,
                      "finished": None, "stage_started": None}
        self._ready = threading.Event()
        self._plugins: OrderedDict[str, Any] = OrderedDict()
        self._plugin_lock = threading.Lock()
        self._recent: OrderedDict[str, dict] = OrderedDict()
        self._recent_lock = threading.Lock()
        self.jobs = JobQueue(self.catalog, {"build_memory": self._job_build, "train_plugin": self._job_train,
                                            "evaluate": self._job_evaluate, "calibrate_plugin": self._job_calibrate,
                                            "rank": self._job_rank},
                             workers=workers)
        self.jobs.max_per_owner, self.jobs.max_total = self.limits.jobs_per_owner, self.limits.jobs_total
        self.jobs.on_finish = self._job_finished
        # --executor ray / $PEMA_RAY_ADDRESS (studio.ray_executor): sharded builds, trainings as Ray tasks on a lane
        self.executor = make_executor(executor) if executor is None or isinstance(executor, str) else executor
        if self.executor is not None:
            self.jobs.add_lane(("train_plugin",), self.executor.training_slots())
        self.read_only = not self.jobs.acquire()
        self.repairs: list[str] = []  # what the start-up repair did (also logged)
        if self.read_only:
            self.jobs.read_only = True
            log.warning("PEMA Studio: the data directory %s is in use by %s; this studio runs without a job worker "
                        "(no builds, trainings or evaluations) and repairs nothing.", self.root,
                        self.jobs.lock.describe_holder())
        else:
            ranking = self._running_rankings()
            self.jobs.recover()  # before the clean-up: an interrupted job's upload goes with it
            self._clean_temporary_folders()
            self._resume_rankings(ranking)  # they go on where they stopped (finished plug-ins are reused)
            if start_jobs:
                self.jobs.start()
        if load:
            self.load_backbone_async()

    # --- owners -------------------------------------------------------------------------------------------------
    def _owner(self, owner: str | None) -> str:
        """The owner a call acts for: ``None`` is the local user in single-user mode, refused in multi-user mode."""
        if owner is None or owner == "":
            if self.multi_user:
                raise UserError(NO_KEY)
            return LOCAL
        if not isinstance(owner, str):
            raise TypeError(f"owner must be a string, not {type(owner).__name__}")
        return owner

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the job worker and give up the data directory (a read-only studio holds nothing)."""
        self.jobs.stop()
        if getattr(self, "executor", None) is not None:
            self.executor.close()  # shuts Ray down only if this studio started it
        self.uploads.close()
        self._remove_downloads()

    def _clean_temporary_folders(self) -> None:
        """The owner's start-up repair: temporary folders/files of writers that are gone (never those of a CLI
        still writing), rows and folders that do not match (``Catalog.repair``), uploads no queued job needs."""
        self.repairs = clean_temporary(self.root) + self.catalog.repair() + self._clean_uploads()

    def _clean_uploads(self) -> list[str]:
        folder = self.root / "uploads"
        if not folder.is_dir():
            return []
        wanted = {Path(j["args"]["upload"]).resolve() for j in self.jobs.list(states=("queued",), limit=100000)
                  if j["args"].get("upload")}
        removed = []
        for p in sorted(folder.iterdir()):
            if p.resolve() not in wanted and (p.is_file() or p.is_symlink()):
                p.unlink(missing_ok=True)
                removed.append(f"removed the upload {p.name} (no queued job needs it)")
        for n in removed:
            log.warning("data directory clean-up: %s", n)
        return removed

    def _job_finished(self, job: dict) -> None:
        """A job reached a final state (done, failed, cancelled — also before it started —, interrupted): the upload
        it was given goes at once."""
        upload = (job.get("args") or {}).get("upload")
        if upload:
            path = Path(upload)
            if path.resolve().parent == (self.root / "uploads").resolve():
                path.unlink(missing_ok=True)

