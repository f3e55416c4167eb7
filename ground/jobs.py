"""Background jobs: rows of the catalog's ``jobs`` table, run in FIFO order by a small pool of worker threads.

A job is ``(kind, args)``; a *handler* registered for the kind does the work::

    def handler(job: JobContext) -> dict:      # the result, stored as JSON
        job.progress(0.5, "half way")           # throttled writes to the row (progress, message)
        job.log("a line for the log")
        job.metric({"phase": "joint", "step": 10, "loss": 1.2})   # the live loss curve
        if job.should_stop(): raise Cancelled()  # the engine's loops already do this

States: ``queued → running → done | failed | cancelled``; rows found ``running`` when a queue starts (the app was
stopped or crashed mid-job) become ``interrupted``. Rows left ``queued`` are run again.

Owners: each job row has the ``owner`` that submitted it (``JobContext.owner`` for the handler); ``get`` / ``list`` /
``cancel`` given an owner see only that owner's jobs (another owner's job reads as nonexistent). ``max_per_owner``
and ``max_total`` (0: no limit) bound the jobs queued or running, per owner and overall; ``submit`` refuses more.

One owner: the queue that runs jobs holds the data directory's lock (``ground.lock.DataDirLock``) from ``start`` /
``recover`` until ``stop``; ``start`` refuses (UserError) when another process holds it. Only the holder marks
``running`` rows ``interrupted`` and claims queued jobs, so a second process on a live directory never touches the
first one's jobs; ``read_only`` (set by a studio that did not get the lock) makes ``submit`` refuse.

``on_finish(job)``, if set, is called once a job reaches a final state — done, failed, cancelled (also when
cancelled before it started), interrupted at start-up — e.g. to remove the upload the job was given.

Errors: a :class:`UserError`'s message is stored as is (it is written for the user); any other exception is
stored as ``"<Type>: <message>"`` with a short traceback appended to the log. Handlers must register catalog rows
only once their work has fully succeeded (the engine writes folders atomically), so a failed or cancelled job
leaves nothing half-made behind.
"""
from __future__ import annotations

import json
import math
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from ground.errors import Cancelled, UserError
from ground.lock import DataDirLock
from ground.store import LOCAL_OWNER, Catalog, new_id

STATES = ("queued", "running", "done", "failed", "cancelled", "interrupted")
FINAL_STATES = ("done", "failed", "cancelled", "interrupted")
MAX_LOG_LINES = 400
MAX_METRIC_POINTS = 1500
INTERRUPTED_MESSAGE = "Interrupted: the app stopped while this job was running. Start it again."
READ_ONLY_MESSAGE = ("This studio cannot run jobs: another PEMA Studio process owns its data directory and runs "
                     "its jobs. Use that studio, or stop it and restart this one.")

def finite(obj, depth: int = 0):
    """``obj`` with every NaN or infinite float replaced by None (JSON has no such numbers: a browser's
    ``JSON.parse`` refuses them), however deeply nested."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if depth > 64:
        return obj
    if isinstance(obj, dict):
        return {k: finite(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v, depth + 1) for v in obj]
    return obj


def dumps(obj) -> str:
    """A job column's JSON: standard JSON only (no NaN, no Infinity)."""
    return json.dumps(finite(obj), default=str, allow_nan=False)


def _loads(text: str | None, default):
    if not text:
        return default
    try:
        return finite(json.loads(text))
    except (TypeError, ValueError):
        return default


def row_to_job(row: dict) -> dict:
    """A catalog row with its JSON columns decoded."""
    job = dict(row)
    job["args"] = _loads(row.get("args"), {})
    job["result"] = _loads(row.get("result"), None)
    job["metrics"] = _loads(row.get("metrics"), [])
    job["cancel"] = bool(row.get("cancel"))
    return job


@dataclass
class JobContext:
    """What a handler sees: its args and throttled reporting back to the job row."""

    id: str
    kind: str
    args: dict
    queue: "JobQueue"
    throttle: float = 0.5
    owner: str = LOCAL_OWNER
    _last_write: float = 0.0
    _progress: float = 0.0
    _message: str = ""
    _log: list = field(default_factory=list)
    _metrics: list = field(default_factory=list)
    _last_logged: float = 0.0
    _last_phase: str = ""
    _dirty: bool = False
    checkpoint: Callable[[], None] = lambda: None  # e.g. hand the backbone to an interactive user

    # reporting ---------------------------------------------------------------------------------
    def progress(self, frac: float, message: str = "") -> None:
        try:
            frac = float(frac)
        except (TypeError, ValueError):
            frac = self._progress
        self._progress = min(1.0, max(0.0, frac)) if math.isfinite(frac) else self._progress
        if message:
            self._message = str(message)
            # log the first message of a phase and then at most one line every 2 s
            phase = self._message.split(":", 1)[0]
            now = time.time()
            if phase != self._last_phase or now - self._last_logged > 2.0:
                self._last_phase, self._last_logged = phase, now
                self._append_log(self._message)
        self._dirty = True
        self.flush(force=self._progress >= 1.0)

    def log(self, line: str) -> None:
        self._append_log(line)
        self._dirty = True
        self.flush()

    def metric(self, point: dict) -> None:
        """A structured point of the job's live curve (e.g. a training-history point)."""
        self._add_metric({k: v for k, v in point.items() if isinstance(v, (int, float, str))})
        self._dirty = True
        self.flush()

    def set_metrics(self, points: list[dict]) -> None:
        """Replace the live curve (e.g. with the full history once training has finished)."""
        self._metrics = list(points)[-MAX_METRIC_POINTS:]
        self._dirty = True

    def should_stop(self) -> bool:
        self.checkpoint()
        return self.queue.cancel_requested(self.id)

    # internals ---------------------------------------------------------------------------------
    def _append_log(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self._log.append(f"[{stamp}] {line}")
        if len(self._log) > MAX_LOG_LINES:
            del self._log[: len(self._log) - MAX_LOG_LINES]

    def _add_metric(self, point: dict) -> None:
        self._metrics.append({**point, "t": round(time.time(), 2)})
        if len(self._metrics) > MAX_METRIC_POINTS:  # keep the curve's shape: drop every other old point
            head = self._metrics[: MAX_METRIC_POINTS // 2][::2]
            self._metrics = head + self._metrics[MAX_METRIC_POINTS // 2:]

    def flush(self, force: bool = False) -> None:
        now = time.time()
        if not self._dirty or (not force and now - self._last_write < self.throttle):
            return
        self._last_write, self._dirty = now, False
        self.queue._update(self.id, progress=round(self._progress, 4), message=self._message[:500],
                           log="\n".join(self._log), metrics=dumps(self._metrics))


Handler = Callable[[JobContext], dict | None]


class JobQueue:
    """FIFO job queue on the catalog's ``jobs`` table with ``workers`` threads (1 by default: one CPU backbone)."""

    def __init__(self, catalog: Catalog, handlers: dict[str, Handler] | None = None, workers: int = 1,
                 throttle: float = 0.5):
        self.catalog = catalog
        self.handlers: dict[str, Handler] = dict(handlers or {})
        self.workers = max(1, int(workers))
        self.throttle = throttle
        self._wake = threading.Condition()
        self._claim = threading.Lock()
        self._cancel: set[str] = set()
        self._cancel_by_user: set[str] = set()
        self._cancel_polled: dict[str, float] = {}  # job id → when its catalog row was last asked about a cancel
        self._threads: list[threading.Thread] = []
        self._lanes: list[tuple[tuple[str, ...], int]] = []  # (kinds, workers): threads of their own (add_lane)
        self._stopping = False
        self._paused = threading.Event()  # set: workers wait (e.g. until the backbone is loaded)
        self.max_per_owner = 0  # jobs queued or running per owner (0: no limit)
        self.max_total = 0  # jobs queued or running overall (0: no limit)
        self.lock = DataDirLock(catalog.root)
        self.read_only = False  # True: another process owns the data directory; submit refuses
        self.on_finish: Callable[[dict], None] | None = None

    # ownership -------------------------------------------------------------------------------------
    def acquire(self) -> bool:
        """Try to become the data directory's owner process (no waiting); True when this queue holds the lock."""
        return self.lock.acquire()

    def _require_lock(self) -> None:
        if not self.lock.acquire():
            raise UserError(f"The data directory {self.catalog.root} is in use by another PEMA Studio "
                            f"({self.lock.describe_holder()}); stop it first, or give this one another --data-dir.")

    def _finished(self, job: dict | None) -> None:
        if job is not None and self.on_finish is not None:
            try:
                self.on_finish(job)
            except Exception:  # noqa: BLE001 — clean-up must never take the worker down
                pass

    # lifecycle -------------------------------------------------------------------------------------
    def recover(self) -> int:
        """Mark rows left ``running`` by a previous process as ``interrupted``; return how many. Only the owner of
        the data directory may (a UserError otherwise: those rows are another live process's jobs)."""
        self._require_lock()
        db = self.catalog.db
        rows = list(db["jobs"].rows_where("state = ?", ["running"]))
        for r in rows:
            log = (r.get("log") or "") + f"\n[{time.strftime('%H:%M:%S')}] {INTERRUPTED_MESSAGE}"
            db["jobs"].update(r["id"], {"state": "interrupted", "message": INTERRUPTED_MESSAGE,
                                        "error": INTERRUPTED_MESSAGE, "finished": time.time(),
                                        "log": log.strip()})
            self._finished(self.get(r["id"]))
        return len(rows)

    def start(self) -> "JobQueue":
        """Become the data directory's owner (UserError when another process is), recover, start the workers."""
        self.recover()
        self._stopping = False
        laned = tuple(k for kinds, _ in self._lanes for k in kinds)
        for i in range(self.workers):
            t = threading.Thread(target=self._work, args=(None, laned), name=f"pema-job-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        for n, (kinds, workers) in enumerate(self._lanes):
            for i in range(workers):
                t = threading.Thread(target=self._work, args=(kinds, ()), name=f"pema-job-lane-{n}-{i}",
                                     daemon=True)
                t.start()
                self._threads.append(t)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the workers: running jobs stop at their next checkpoint and are marked ``interrupted``; then give
        up the data directory's lock."""
        self._stopping = True
        with self._wake:
            self._wake.notify_all()
        for t in self._threads:
            t.join(timeout)
        still_running = any(t.is_alive() for t in self._threads)
        self._threads = []
        if not still_running:  # a job still running keeps the data directory this process's until it ends
            self.lock.release()

    def add_lane(self, kinds: tuple[str, ...], workers: int) -> None:
        """Run the jobs of ``kinds`` on ``workers`` threads of their own (FIFO among themselves), which take no
        other job, while the ordinary workers take no job of ``kinds``: e.g. trainings that run on a Ray cluster
        and only wait here, in parallel, neither waiting behind a memory build nor holding one up. Before
        ``start``."""
        if self._threads:
            raise RuntimeError("add_lane must be called before start")
        self._lanes.append((tuple(kinds), max(1, int(workers))))

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        with self._wake:
            self._wake.notify_all()

    # API ---------------------------------------------------------------------------------------------
    def submit(self, kind: str, args: dict | None = None, owner: str = LOCAL_OWNER) -> str:
        if self.read_only:
            raise UserError(READ_ONLY_MESSAGE)
        if kind not in self.handlers:
            raise UserError(f"Unknown job kind {kind!r}.")
        jid = new_id(f"{kind}-")
        now = time.time()
        # created is made strictly increasing so that FIFO order is exact even within one clock tick
        with self._claim:
            self.check_room(owner)
            last = next(iter(self.catalog.db.query("select max(created) as m from jobs")), {}).get("m") or 0
            created = max(now, last + 1e-6)
            self.catalog.db["jobs"].insert({
                "id": jid, "kind": kind, "args": dumps(args or {}), "state": "queued",
                "progress": 0.0, "message": "Waiting for a worker", "log": "", "error": "", "result": "",
                "metrics": "[]", "created": created, "started": None, "finished": None, "cancel": 0,
                "owner": owner})
        with self._wake:
            self._wake.notify_all()
        return jid

    def check_room(self, owner: str, jobs: int = 1) -> None:
        """Refuse (a UserError) when ``jobs`` more jobs of ``owner`` would pass the bound per owner or overall."""
        if self.max_per_owner and self.count(("queued", "running"), owner) + jobs > self.max_per_owner:
            raise UserError(f"You already have {self.count(('queued', 'running'), owner)} jobs queued or running "
                            f"and this needs {jobs} more (the limit per user is {self.max_per_owner}); wait for "
                            f"one to finish or cancel one (the studio's operator sets the limit with --limit "
                            f"jobs_per_owner=… or $PEMA_LIMIT_JOBS_PER_OWNER)." if jobs > 1 else
                            f"You already have {self.max_per_owner} jobs queued or running (the limit per "
                            f"user); wait for one to finish or cancel one (the studio's operator sets the limit "
                            f"with --limit jobs_per_owner=… or $PEMA_LIMIT_JOBS_PER_OWNER).")
        if self.max_total and self.count(("queued", "running")) + jobs > self.max_total:
            raise UserError(f"The studio's job queue is full ({self.max_total} jobs queued or running); try "
                            f"again in a few minutes (the studio's operator sets the limit with --limit "
                            f"jobs_total=… or $PEMA_LIMIT_JOBS_TOTAL).")

    def discard(self, job_id: str) -> bool:
        """Remove a job that has not started, as if it had never been submitted (part of a request that was then
        refused); False when it has started already (cancel it instead)."""
        with self._claim, self.catalog.transaction() as conn:
            gone = conn.execute("delete from jobs where id = ? and state = 'queued'", [job_id]).rowcount
        return bool(gone)

    def count(self, states: tuple[str, ...], owner: str | None = None) -> int:
        where = f"state in ({','.join('?' * len(states))})"
        params = list(states)
        if owner is not None:
            where += " and owner = ?"
            params.append(owner)
        return self.catalog.db["jobs"].count_where(where, params)

    def get(self, job_id: str, owner: str | None = None) -> dict | None:
        """One job; with ``owner``, ``None`` unless that owner submitted it."""
        where, params = "id = ?", [job_id]
        if owner is not None:
            where, params = "id = ? and owner = ?", [job_id, owner]
        rows = list(self.catalog.db["jobs"].rows_where(where, params))
        return row_to_job(rows[0]) if rows else None

    def list(self, kinds: tuple[str, ...] | None = None, states: tuple[str, ...] | None = None,
             limit: int = 50, owner: str | None = None) -> list[dict]:
        where, params = [], []
        if kinds:
            where.append(f"kind in ({','.join('?' * len(kinds))})")
            params += list(kinds)
        if states:
            where.append(f"state in ({','.join('?' * len(states))})")
            params += list(states)
        if owner is not None:
            where.append("owner = ?")
            params.append(owner)
        rows = self.catalog.db["jobs"].rows_where(" and ".join(where) or None, params or None,
                                                  order_by="created desc", limit=limit)
        return [row_to_job(r) for r in rows]

    def cancel(self, job_id: str, owner: str | None = None) -> dict:
        """Cancel a queued job at once, or ask a running one to stop at its next checkpoint (with ``owner``: only
        that owner's job; another's reads as nonexistent)."""
        with self._claim:
            job = self.get(job_id, owner)
            if job is None:
                raise UserError(f"No job {job_id!r}.")
            if job["state"] == "queued":
                # only if still queued: another process (the directory's owner) may be claiming it right now
                with self.catalog.transaction() as conn:
                    claimed = conn.execute("update jobs set state = 'cancelled', cancel = 1, message = ?, "
                                           "finished = ? where id = ? and state = 'queued'",
                                           ["Cancelled before it started", time.time(), job_id]).rowcount
                if claimed:
                    self._finished(self.get(job_id))
                    return self.get(job_id)
                job = self.get(job_id, owner)
            if job["state"] == "running":
                self._cancel.add(job_id)
                self._cancel_by_user.add(job_id)
                self._update(job_id, cancel=1, message="Cancelling…")
        return self.get(job_id)

    def cancel_requested(self, job_id: str) -> bool:
        """Whether a job should stop: cancelled here, the queue stopping, or a cancel that another process (a CLI
        or a read-only studio on this directory) wrote into the job's row — read at most every half second."""
        if job_id in self._cancel or self._stopping:
            return True
        now = time.monotonic()
        if now - self._cancel_polled.get(job_id, 0.0) < 0.5:
            return False
        self._cancel_polled[job_id] = now
        row = self.catalog.db.execute("select cancel from jobs where id = ?", [job_id]).fetchone()
        if row and row[0]:
            self._cancel.add(job_id)
            self._cancel_by_user.add(job_id)
            return True
        return False

    def wait(self, job_id: str, timeout: float = 60.0, poll: float = 0.1) -> dict:
        """Block until the job reaches a final state (tests, CLI)."""
        t0 = time.time()
        while True:
            job = self.get(job_id)
            if job is None or job["state"] in FINAL_STATES or time.time() - t0 > timeout:
                return job
            time.sleep(poll)

    # worker ------------------------------------------------------------------------------------------
    def _update(self, job_id: str, **fields) -> None:
        self.catalog.db["jobs"].update(job_id, fields)

    def _next(self, kinds: tuple[str, ...] | None = None, exclude: tuple[str, ...] = ()) -> dict | None:
        """Claim the oldest queued job (atomically across this process's workers): of ``kinds`` only when given,
        never of ``exclude`` (``add_lane``)."""
        where, params = "state = ?", ["queued"]
        if kinds:
            where += f" and kind in ({','.join('?' * len(kinds))})"
            params += list(kinds)
        if exclude:
            where += f" and kind not in ({','.join('?' * len(exclude))})"
            params += list(exclude)
        with self._claim:
            rows = list(self.catalog.db["jobs"].rows_where(where, params, order_by="created", limit=1))
            if not rows:
                return None
            row = rows[0]
            with self.catalog.transaction() as conn:  # still queued? (another process may have cancelled it)
                taken = conn.execute("update jobs set state = 'running', started = ?, message = 'Starting' "
                                     "where id = ? and state = 'queued'", [time.time(), row["id"]]).rowcount
            return row_to_job({**row, "state": "running"}) if taken else None

    def _work(self, kinds: tuple[str, ...] | None = None, exclude: tuple[str, ...] = ()) -> None:
        while not self._stopping:
            job = None
            if not self._paused.is_set():
                job = self._next(kinds, exclude)
            if job is None:
                with self._wake:
                    self._wake.wait(timeout=1.0)
                continue
            self._run(job)

    def _run(self, job: dict) -> None:
        jid = job["id"]
        ctx = JobContext(id=jid, kind=job["kind"], args=job["args"], queue=self, throttle=self.throttle,
                         owner=job.get("owner") or LOCAL_OWNER)
        ctx.log(f"Started {job['kind']}")
        fields: dict = {}
        try:
            handler = self.handlers[job["kind"]]
            result = handler(ctx)
            fields = {"state": "done", "progress": 1.0, "result": dumps(result or {}),
                      "message": (result or {}).get("message") or "Done"}
            ctx._append_log(fields["message"])
        except Cancelled:
            if self._stopping and jid not in self._cancel_by_user:
                fields = {"state": "interrupted", "message": INTERRUPTED_MESSAGE, "error": INTERRUPTED_MESSAGE}
                ctx._append_log("Stopped with the app; nothing was saved. " + INTERRUPTED_MESSAGE)
            else:
                fields = {"state": "cancelled", "message": "Cancelled"}
                ctx._append_log("Cancelled; nothing was saved.")
        except UserError as e:
            fields = {"state": "failed", "error": str(e), "message": str(e)}
            ctx._append_log(f"Failed: {e}")
        except Exception as e:  # noqa: BLE001 — a job must never take the worker down
            msg = f"{type(e).__name__}: {e}"
            fields = {"state": "failed", "error": msg, "message": f"Failed: {msg}"}
            tb = traceback.format_exc(limit=-6).strip().splitlines()
            ctx._append_log("Failed with an unexpected error:\n" + "\n".join(tb[-16:]))
        finally:
            self._cancel.discard(jid)
            self._cancel_by_user.discard(jid)
            self._cancel_polled.pop(jid, None)
        fields["finished"] = time.time()
        ctx._dirty = True
        ctx.flush(force=True)
        self._update(jid, **fields)
        self._finished(self.get(jid))
