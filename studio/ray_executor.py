"""Scale-out on Ray (``python app.py --executor ray``, or ``$PEMA_RAY_ADDRESS``): memory builds sharded over Ray
workers and plug-in trainings run as Ray tasks, while the studio process — the *head* — keeps the data directory
and its catalog, the single source of truth. Ray is optional: nothing here imports it until an executor starts,
and the default executor is the studio's in-process job queue.

Memory builds (``capture``; ``memories.build.build_memory(capture=...)``): the head parses, tokenizes, splits
and writes the memory exactly as an in-process build does; only the teacher-forced capture of f(c) — the forward
passes, nearly all of a build's time — is cut into shards of consecutive samples and sent to ``build_workers``
Ray actors, each of which loads the backbone once (``capture_entries`` per shard). Their keys come back through
Ray's object store and are written at their entries' offsets into the head's memory-mapped key file, so the
entries are in the same order as an in-process build's and the folder + catalog row still appear in one step.
Synthetic sources (monolingual samples) and the ``offsite`` build mode stay on the head.

Trainings (``train``): each queued training runs in its own Ray actor (one GPU each where the cluster has GPUs,
else ``cpus_per_training`` CPUs); the studio runs them on a job lane of their own (``JobQueue.add_lane``) with as
many threads as the cluster has GPUs (else CPUs / ``cpus_per_training``), so they run in parallel without
waiting behind — or holding up — memory builds and evaluations. The memory's files go to the actor through the
object store (no shared file system needed); the actor trains with ``plugins.api``'s own code and sends the saved
plug-in's files back; the head checks them (``load_plugin``: checksums, backbone fingerprint) and publishes the
folder and its catalog row in one step. Progress, the live loss curve and cancel flow through the actor (a
threaded actor answers ``poll`` and ``stop`` while it trains). kNN (nothing to train) and "continue training"
run in-process.

Workers load the backbone by name like the studio (``--backbone``; the embedded ones from the de-quantized cache
under the data directory, so on a cluster every node de-quantizes once or shares the cache): a worker whose
backbone has another fingerprint than the head's is refused. A remote (offsite) backbone cannot be sharded.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from backbone.model import load_backbone
from backbone.tiny import tiny_backbone
from ground.errors import Cancelled, UserError
from ground.store import atomic_dir, new_id
from memories.build import capture_entries
from memories.store import Memory
from plugins.api import new_plugin, plugin_catalog_row
from plugins.base import load_plugin
from plugins.registry import get_method
from plugins.training import optimizer_tensors
from studio.job_status import training_status

ROOT = Path(__file__).resolve().parents[1]
ADDRESS_ENV = "PEMA_RAY_ADDRESS"
RUNTIME_ENV_ENV = "PEMA_RAY_RUNTIME_ENV"
EXECUTORS = ("inprocess", "ray")
TINY_NAMES = ("tiny", "tiny-llama")
OPTIMIZER_FILE = "optimizer.safetensors"
POLL_SECONDS = 0.5


def make_executor(executor: str | None = None, address: str | None = None, **options) -> "RayExecutor | None":
    """The executor the studio runs builds and trainings with: None for the in-process queue (the default), a
    started ``RayExecutor`` for ``executor="ray"`` — also chosen when an address is given or ``$PEMA_RAY_ADDRESS``
    is set. A UserError when Ray is not installed or cannot start."""
    address = address or os.environ.get(ADDRESS_ENV) or None
    executor = (executor or ("ray" if address else "inprocess")).strip().lower()
    if executor not in EXECUTORS:
        raise UserError(f"Unknown executor {executor!r}; use one of {', '.join(EXECUTORS)}.")
    if executor == "inprocess":
        return None
    return RayExecutor(address, **options).start()


def _ray():
    try:
        import ray  # optional: only the Ray executor needs it
    except ImportError:
        raise UserError("The Ray executor needs `pip install ray` (see requirements-dev.txt); without it run the "
                        "studio with the in-process queue (the default).") from None
    return ray


_WORKER_BACKBONES: dict[tuple, object] = {}


def worker_backbone(spec: dict, device: str | None = None):
    """The backbone of ``spec`` in this worker process (loaded once, then reused), checked against the head's
    fingerprint."""
    key = (spec["name"], device or spec.get("device"), spec.get("dtype"), spec.get("data_dir"))
    bb = _WORKER_BACKBONES.get(key)
    if bb is None:
        if spec["name"].lower() in TINY_NAMES:
            bb = tiny_backbone()
        else:
            bb = load_backbone(spec["name"], device=device or spec.get("device"), dtype=spec.get("dtype"),
                               data_dir=spec.get("data_dir"))
        _WORKER_BACKBONES[key] = bb
    if spec.get("fingerprint") is not None:
        check_worker_fingerprint(bb, spec["fingerprint"])
    return bb


def check_worker_fingerprint(bb, fingerprint: str) -> None:
    if bb.fingerprint != fingerprint:
        raise UserError(f"A Ray worker loaded {bb.name} with fingerprint {bb.fingerprint[:12]}…, the studio has "
                        f"{str(fingerprint)[:12]}…: the workers need the same backbone weights.")


# --- what runs inside Ray (plain classes; ``ray.remote`` is applied when the executor starts) ---------------------
class CaptureWorker:
    """A build worker: loads the backbone once, then captures shard after shard."""

    def __init__(self, spec: dict):
        import torch  # heavy: the worker's own thread count

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
        self.bb = worker_backbone({**spec, "fingerprint": None}, spec.get("device"))  # checked per shard
        self.entries, self.seconds = 0, 0.0

    def reset(self) -> None:
        self.entries, self.seconds = 0, 0.0

    def capture(self, ctx: list[list[int]], tgt: list[list[int]], batch_size: int,
                fingerprint: str) -> tuple[np.ndarray, float]:
        check_worker_fingerprint(self.bb, fingerprint)
        t0 = time.time()
        keys, sumsq = capture_entries(self.bb, ctx, tgt, batch_size)
        self.entries += len(keys)
        self.seconds += time.time() - t0
        return keys, sumsq

    def throughput(self) -> dict:
        return {"entries": self.entries, "seconds": round(self.seconds, 3),
                "entries_per_second": round(self.entries / self.seconds, 1) if self.seconds else None}


class TrainWorker:
    """A training worker (a threaded actor: ``poll`` and ``stop`` are answered while ``train`` runs). It may train
    one method after another (a rank's pool: one process start and backbone load for several trainings)."""

    def __init__(self, spec: dict, device: str | None = None):
        self.spec, self.device = spec, device
        self._lock = threading.Lock()
        self._state = {"progress": 0.0, "message": "", "points": [], "method": None}
        self._stop = threading.Event()

    def _progress(self, frac: float, message: str = "") -> None:
        with self._lock:
            self._state["progress"] = float(frac)
            if message:
                self._state["message"] = str(message)

    def _metric(self, point: dict) -> None:
        with self._lock:
            self._state["points"].append({k: v for k, v in point.items() if isinstance(v, (int, float, str))})

    def poll(self) -> dict:
        """Progress so far and the loss-curve points made since the last poll."""
        with self._lock:
            out = {**self._state, "points": list(self._state["points"])}
            self._state["points"].clear()
        return out

    def stop(self) -> None:
        self._stop.set()

    def train(self, memory_files: dict[str, bytes], memory_path: str, method: str, config: dict) -> dict:
        """Train on the shipped memory; the saved plug-in's files (its memory path is the head's), or
        ``{"error": kind, "message"}`` for a cancel or a user error."""
        t_start = time.time()  # the worker process is up (its start is the cluster's cost, not the training's)
        with self._lock:  # a new training: the last one's progress and points are not this one's
            self._state = {"progress": 0.0, "message": "", "points": [], "method": method}
        import torch  # heavy: the worker's own thread count

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
        try:
            self._progress(0.0, "loading the backbone on a Ray worker")
            bb = worker_backbone(self.spec, self.device)
            t_loaded = time.time()
            with tempfile.TemporaryDirectory(prefix="pema-ray-train-") as tmp:
                mdir = Path(tmp) / Path(memory_path).name
                mdir.mkdir()
                for name, data in memory_files.items():
                    (mdir / name).write_bytes(data)
                memory = Memory.load(mdir, bb)
                plugin = new_plugin(method, bb, memory, config)
                plugin.on_metric = self._metric
                t0 = time.time()
                result = plugin.fit(memory, progress=self._progress, should_stop=self._stop.is_set)
                plugin.train_info = {**plugin.train_info, "seconds": round(time.time() - t0, 2),
                                     "trainable_parameters": plugin.trainable_parameters(),
                                     "trained_on": "ray"}
                plugin.memory_meta = {**plugin.memory_meta, "path": memory_path}  # where the head has it
                out = Path(tmp) / "plugin"
                plugin.save(out)
                (out / "history.json").write_text(json.dumps(result.history), encoding="utf-8")
                state = plugin.optimizer_state
                if state and plugin.resumable:
                    from safetensors.torch import save_file  # heavy

                    save_file(optimizer_tensors(state), str(out / OPTIMIZER_FILE))
                files = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
                # plain JSON values only (the history list holds this actor's callback, and so its lock)
                return {"files": files, "metrics": json.loads(json.dumps(result.metrics, default=str)),
                        "history": json.loads(json.dumps(list(result.history), default=str)),
                        "params": plugin.trainable_parameters(),
                        "clock": {"started": t_start, "backbone_loaded": t_loaded, "trained": time.time()}}
        except Cancelled:
            return {"error": "cancelled", "message": "Cancelled"}
        except UserError as e:
            return {"error": "user", "message": str(e)}


# --- the head's side -------------------------------------------------------------------------------------------------
class RayExecutor:
    """Memory builds and trainings on Ray (module docstring). ``address``: a running cluster (``ray://host:10001``
    or ``host:6379``, ``"auto"``); None starts (or joins, in a test) a local Ray with ``num_cpus``."""

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None, build_workers: int | None = None,
                 shard_samples: int | None = None, cpus_per_training: float = 1.0, training_slots: int | None = None,
                 keep_alive: float = 30.0, gpus_per_training: float = 1.0):
        self.address, self.num_cpus = address, num_cpus
        self.build_workers, self.shard_samples = build_workers, shard_samples
        self.cpus_per_training, self._training_slots = float(cpus_per_training), training_slots
        self.gpus_per_training = float(gpus_per_training)  # below 1: trainings share a GPU (Ray's fractional GPUs)
        self.started_ray = False
        self.keep_alive = float(keep_alive)
        self._pool_lock = threading.Lock()
        self._pool_actors: list = []
        self._pool_key = None
        self._pool_busy = 0  # captures using the warm pool now
        self._pool_timer: threading.Timer | None = None
        self.captures: list[dict] = []  # one record per sharded capture (a build has two: training, held-out)
        self.trainings: list[dict] = []  # one record per train_many: each worker's clock

    def start(self) -> "RayExecutor":
        ray = _ray()
        if not ray.is_initialized():
            runtime_env = {"env_vars": {"PYTHONPATH": str(ROOT)}}  # the project's modules on the workers
            if os.environ.get(RUNTIME_ENV_ENV):
                try:
                    runtime_env = json.loads(os.environ[RUNTIME_ENV_ENV])
                except json.JSONDecodeError as e:
                    raise UserError(f"${RUNTIME_ENV_ENV} is not JSON ({e.msg}).") from None
            kw = {"address": self.address} if self.address else {"num_cpus": self.num_cpus,
                                                                  "include_dashboard": False}
            try:
                ray.init(runtime_env=runtime_env, log_to_driver=False, **kw)
            except Exception as e:  # noqa: BLE001 — no cluster at the address, a port in use: one line
                raise UserError(f"Ray could not start{' at ' + self.address if self.address else ''}: "
                                f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__}") \
                    from None
            self.started_ray = True
        self._capture_actor = ray.remote(CaptureWorker)
        self._train_actor = ray.remote(TrainWorker)
        return self

    def close(self) -> None:
        if _ray().is_initialized():
            self.release_pool()
        if self.started_ray:
            _ray().shutdown()
            self.started_ray = False

    # resources ----------------------------------------------------------------------------------------------
    def _resources(self) -> dict:
        return _ray().cluster_resources()

    def gpus(self) -> int:
        return int(self._resources().get("GPU", 0))

    def training_slots(self) -> int:
        """Trainings that run at once: the GPUs / ``gpus_per_training``, else the cluster's CPUs /
        ``cpus_per_training``."""
        if self._training_slots:
            return int(self._training_slots)
        g = self.gpus()
        if g:
            return max(1, int(g // max(self.gpus_per_training, 1e-9)))
        return max(1, int(self._resources().get("CPU", 1) // max(self.cpus_per_training, 1e-9)))

    def _training_actor(self, spec: dict):
        """A new training actor for ``spec`` (a GPU, or a share of one, where the cluster has GPUs)."""
        g = self.gpus()
        opts = ({"num_gpus": min(1.0, self.gpus_per_training), "num_cpus": self.cpus_per_training} if g
                else {"num_cpus": self.cpus_per_training})
        return self._train_actor.options(max_concurrency=2, **opts).remote(spec, "cuda" if g else "cpu"), bool(g)

    # memory builds ----------------------------------------------------------------------------------------------
    def capture(self, spec: dict, batch_size: int = 8):
        """A ``memories.build.Capture`` that shards the capture over Ray actors (one backbone load each)."""

        def run(ctx, tgt, keys_out, values_out, sample_out, sample_index, progress, should_stop) -> float:
            return self._sharded_capture(spec, batch_size, ctx, tgt, keys_out, values_out, sample_out, sample_index,
                                         progress, should_stop)

        return run

    def _pool(self, spec: dict, workers: int, opts: dict) -> list:
        """The build workers for ``spec`` (each has loaded the backbone once): kept warm for ``keep_alive``
        seconds after a capture, so a build's held-out split and the next build reuse them; released before a
        training (it needs their CPUs / GPUs) and on close."""
        key = (spec["name"], spec.get("device"), spec.get("data_dir"), workers, tuple(sorted(opts.items())))
        with self._pool_lock:
            if self._pool_timer is not None:
                self._pool_timer.cancel()
                self._pool_timer = None
            if self._pool_key != key and not self._pool_busy:
                self._release_pool_locked()
                self._pool_actors = [self._capture_actor.options(**opts).remote(spec) for _ in range(workers)]
                self._pool_key = key
            elif self._pool_key != key:  # another build is using the warm pool: workers of this build's own
                return [self._capture_actor.options(**opts).remote(spec) for _ in range(workers)]
            self._pool_busy += 1
            return list(self._pool_actors)

    def _release_pool_locked(self) -> None:
        for actor in self._pool_actors:
            try:
                _ray().kill(actor)
            except Exception:  # noqa: BLE001 — already gone
                pass
        self._pool_actors, self._pool_key = [], None

    def release_pool(self, force: bool = True) -> None:
        """Kill the warm build workers (unless a build is using them and not ``force``)."""
        with self._pool_lock:
            if self._pool_busy and not force:
                return
            if self._pool_timer is not None:
                self._pool_timer.cancel()
                self._pool_timer = None
            self._release_pool_locked()
            self._pool_busy = 0

    def _done_with(self, actors: list, ok: bool) -> None:
        """A capture is over: park the pool's workers (``keep_alive``), or kill them after a cancel or a failure
        (they may still be busy with shards nobody wants); workers of a build's own are killed."""
        with self._pool_lock:
            mine = bool(actors) and actors == self._pool_actors
            if mine:
                self._pool_busy = max(0, self._pool_busy - 1)
        if not mine:
            for actor in actors:
                _ray().kill(actor)
        elif not ok:
            self.release_pool()
        else:
            with self._pool_lock:
                if not self._pool_busy:
                    self._pool_timer = threading.Timer(self.keep_alive, self.release_pool, kwargs={"force": False})
                    self._pool_timer.daemon = True
                    self._pool_timer.start()

    def _sharded_capture(self, spec, batch_size, ctx, tgt, keys_out, values_out, sample_out, sample_index,
                         progress, should_stop) -> float:
        ray = _ray()
        n = len(ctx)
        g = self.gpus()
        workers = self.build_workers or (g if g else max(1, int(self._resources().get("CPU", 1))))
        size = self.shard_samples or max(1, min(512, math.ceil(n / (workers * 4))))
        shards = [(b0, min(n, b0 + size)) for b0 in range(0, n, size)]
        offsets = np.cumsum([0] + [len(t) for t in tgt])
        for i in range(n):  # the values and entry samples are known here; only the keys are computed remotely
            values_out[offsets[i]:offsets[i + 1]] = tgt[i]
            sample_out[offsets[i]:offsets[i + 1]] = sample_index[i]
        actors = self._pool(spec, workers, {"num_gpus": 1} if g else {"num_cpus": 1})
        todo = list(range(len(shards)))
        running: dict = {}  # ref -> (shard, actor)
        sumsq, done, t0, ok = 0.0, 0, time.time(), False
        try:
            ray.get([a.reset.remote() for a in actors])
            def submit(actor):
                if todo:
                    s = todo.pop(0)
                    a, b = shards[s]
                    running[actor.capture.remote(ctx[a:b], tgt[a:b], batch_size, spec["fingerprint"])] = (s, actor)

            for actor in actors:  # two shards in flight per worker: the next one is there when one ends
                submit(actor)
                submit(actor)
            while running:
                if should_stop():
                    raise Cancelled()
                ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_SECONDS)
                for ref in ready:
                    s, actor = running.pop(ref)
                    try:
                        keys, part = ray.get(ref)
                    except Exception as e:
                        if isinstance(getattr(e, "cause", None), UserError):  # e.g. another backbone's weights
                            raise UserError(str(e.cause)) from None
                        raise
                    a, b = shards[s]
                    keys_out[offsets[a]:offsets[b]] = keys
                    sumsq += part
                    done += b - a
                    progress(done / n, f"captured {done}/{n} samples on {len(actors)} Ray workers")
                    submit(actor)
            stats = ray.get([a.throughput.remote() for a in actors])
            self.captures.append({"workers": len(actors), "shards": len(shards), "entries": int(offsets[-1]),
                                  "seconds": round(time.time() - t0, 2), "per_worker": stats})
            ok = True
            return sumsq
        finally:
            self._done_with(actors, ok)

    # trainings --------------------------------------------------------------------------------------------------
    @staticmethod
    def runs_training(args: dict) -> bool:
        """Whether a training job goes to Ray: not "continue training", not a method with nothing to train."""
        return not args.get("continue_from") and not get_method(args["method"]).needs_memory_at_decode

    def train(self, spec: dict, bb, job, mrow: dict, catalog) -> dict:
        """A studio training job (``train_plugin``) as a Ray actor; returns the job's result like the in-process
        handler. ``spec``: how a worker loads the studio's backbone ``bb`` (``BackboneService.worker_spec``);
        ``mrow``: the owner's memory row (checked by the caller); the plug-in lands in the owner's ``catalog``."""
        ray = _ray()
        self.release_pool(force=False)  # idle build workers' CPUs / GPUs go to the training
        a = job.args
        mdir = Path(mrow["path"])
        memory = Memory.load(mdir, bb)
        files = {f.name: f.read_bytes() for f in mdir.iterdir() if f.is_file() and not f.name.startswith(".")}
        cls = get_method(a["method"])
        actor, g = self._training_actor(spec)
        job.log(f"Training {cls.title} on {memory.meta.get('name', memory.id)!r} ({len(memory):,} entries) as a "
                f"Ray task{' on a GPU' if g else ''}")
        try:
            ref = actor.train.remote(ray.put(files), str(mdir), a["method"], a["config"])
            stopping, last = False, {}
            while True:
                ready, _ = ray.wait([ref], timeout=POLL_SECONDS)
                self._relay(ray, actor, job, last)
                if ready:
                    break
                if not stopping and job.should_stop():
                    actor.stop.remote()
                    stopping = True
            out = ray.get(ref)
        finally:
            ray.kill(actor)
        if out.get("error") == "cancelled":
            raise Cancelled()
        if out.get("error"):
            raise UserError(out["message"])
        row = self._publish(catalog, job.owner, bb, memory, out, a["method"], a.get("name"))
        metrics = json.loads(row["metrics"])
        status = training_status(metrics)
        job.set_metrics([{k: v for k, v in h.items() if isinstance(v, (int, float, str))}
                         for h in out.get("history", [])])
        how = status["label"] if status["under_trained"] else "ready"
        return {"plugin_id": row["id"], "name": row["name"], "method": row["method"], "params": row["params"],
                "metrics": metrics, "training": status, "executor": "ray",
                "message": f"Plug-in {row['name']!r} {how} ({row['params']:,} trainable parameters; trained on "
                           f"Ray)"}

    @staticmethod
    def _relay(ray, actor, job, last: dict) -> None:
        """The actor's progress and new loss-curve points into the job's row (a progress only when it moved)."""
        try:
            st = ray.get(actor.poll.remote(), timeout=10)
        except Exception:  # noqa: BLE001 — a poll that fails (actor ending) just skips one report
            return
        for p in st["points"]:
            job.metric(p)
        now = (st["progress"], st["message"])
        if now != last.get("seen"):
            last["seen"] = now
            job.progress(*now)

    @staticmethod
    def _publish(catalog, owner: str, bb, memory: Memory, out: dict, method: str, name: str | None = None) -> dict:
        """Write the worker's plug-in files into the data directory, check them as any saved plug-in (checksums,
        fingerprint, paths) and register the folder and its catalog row (``owner``'s) in one step."""
        final = catalog.root / "plugins" / new_id(f"{method}-")
        rows: list[dict] = []
        name = name or f"{get_method(method).title} on {memory.meta.get('name', memory.id)}"

        def row_for(tmp: Path, final_path: Path) -> dict:
            plugin = load_plugin(tmp, bb)
            rows.append(plugin_catalog_row(plugin, final_path, name, memory.id, out.get("metrics")))
            return rows[-1]

        with atomic_dir(final, catalog.owned_by(owner).publisher("plugins", row_for)) as tmp:
            for fname, data in out["files"].items():
                if "/" in fname or "\\" in fname or fname.startswith("."):
                    raise UserError(f"A Ray worker sent a file named {fname[:60]!r}; refused.")
                (tmp / fname).write_bytes(data)
        return rows[-1]

    # a rank's trainings -----------------------------------------------------------------------------------------
    def train_many(self, spec: dict, backbone, memory: Memory, jobs: list[dict], *, catalog, owner: str,
                   progress=None, should_stop=lambda: False) -> dict[str, dict]:
        """Several trainings on one memory at once: a rank's training phase across workers. ``training_slots()``
        training actors (no more than there are jobs) each load the backbone once and train one job after another,
        the next job going to the first actor that is free. ``jobs``: ``[{"method", "config" (overrides),
        "name"}]``; ``progress(method, frac, msg)``. The memory's files go through the object store once for all of
        them. Each plug-in is checked and published like a studio training's (``owner``'s); returns ``{method:
        catalog row}``. A cancel stops every actor; a worker's UserError is raised (after the others ended) with the
        method's name."""
        ray = _ray()
        self.release_pool(force=False)  # idle build workers' CPUs / GPUs go to the trainings
        t0 = time.time()
        mdir = Path(memory.path)
        files = ray.put({f.name: f.read_bytes() for f in mdir.iterdir() if f.is_file() and not f.name.startswith(".")})
        report = progress or (lambda *a: None)
        todo = list(jobs)
        actors = [self._training_actor(spec)[0] for _ in range(max(1, min(self.training_slots(), len(jobs))))]
        free = list(actors)
        running: dict = {}  # train ref -> (method, actor)
        polls: dict = {}  # poll ref -> (method, actor) (an actor Ray has not started yet answers once it has)
        outs: dict[str, dict] = {}
        stopping, seen = False, {}
        try:
            while len(outs) < len(jobs):
                while todo and free and not stopping:
                    j, actor = todo.pop(0), free.pop(0)
                    running[actor.train.remote(files, str(mdir), j["method"], j.get("config") or {})] = \
                        (j["method"], actor)
                if stopping and todo:  # never started: nothing to stop
                    outs.update({j["method"]: {"error": "cancelled"} for j in todo})
                    todo.clear()
                    continue
                ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_SECONDS)
                for ref in ready:
                    m, actor = running.pop(ref)
                    outs[m] = ray.get(ref)
                    free.append(actor)
                for m, actor in running.values():
                    if all(a is not actor for _, a in polls.values()):
                        polls[actor.poll.remote()] = (m, actor)
                answered, _ = ray.wait(list(polls), num_returns=len(polls), timeout=0.05) if polls else ([], [])
                for ref in answered:
                    m, _actor = polls.pop(ref)
                    try:
                        st = ray.get(ref)
                    except Exception:  # noqa: BLE001 — an actor that ended: its train ref says how
                        continue
                    now = (st["progress"], st["message"])
                    if st.get("method") == m and m not in outs and now != seen.get(m):
                        seen[m] = now
                        report(m, *now)
                if not stopping and should_stop():
                    for _m, actor in running.values():
                        actor.stop.remote()
                    stopping = True
        finally:
            for actor in actors:
                try:
                    ray.kill(actor)
                except Exception:  # noqa: BLE001 — already gone
                    pass
        if stopping or any(o.get("error") == "cancelled" for o in outs.values()):
            raise Cancelled()
        failed = [f"{get_method(m).title}: {o['message']}" for m, o in outs.items() if o.get("error")]
        if failed:
            raise UserError("Training on a Ray worker failed — " + "; ".join(failed))
        # when each training began (for a worker's first: its process was up), had the backbone and ended, in seconds
        # from the call (benchmarks ray --rank)
        self.trainings.append({m: {k: round(v - t0, 2) for k, v in o["clock"].items()} for m, o in outs.items()})
        return {j["method"]: self._publish(catalog, owner, backbone, memory, outs[j["method"]], j["method"],
                                           j.get("name")) for j in jobs}

    def rank_trainer(self, spec: dict) -> "RankTrainer":
        return RankTrainer(self, spec)


class RankTrainer:
    """``eval.rank.rank``'s ``trainer``: the methods that train run at once on the executor's Ray workers, each
    loading the backbone of ``spec`` (``BackboneService.worker_spec``, or a CLI's); kNN and retrieved examples,
    which only index the memory in seconds, stay on the head (a worker's start would cost more)."""

    def __init__(self, executor: RayExecutor, spec: dict):
        self.executor, self.spec = executor, spec

    @staticmethod
    def runs(method: str) -> bool:
        return RayExecutor.runs_training({"method": method}) and get_method(method).level != "prompt"

    def slots(self) -> int:
        return self.executor.training_slots()

    def describe(self) -> dict:
        """What the leaderboard records as ``workers``."""
        return {"executor": "ray", "workers": self.slots(), "address": self.executor.address,
                "gpus": self.executor.gpus()}

    def train_many(self, backbone, memory, jobs, *, catalog, owner, progress=None, should_stop=lambda: False):
        return self.executor.train_many(self.spec, backbone, memory, jobs, catalog=catalog, owner=owner,
                                        progress=progress, should_stop=should_stop)
