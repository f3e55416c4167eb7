"""The Ray executor (``studio.ray_executor``) on a local ``ray.init(num_cpus=2)`` and the tiny
backbone: a memory build sharded over Ray workers equals the single-process build (same entries in order, keys
within float tolerance), trainings queued in the studio run as Ray tasks and land in the catalog, and cancel
reaches a running task. Those tests skip where Ray is not installed or cannot start; one Ray instance serves the
module (its start and each worker process's imports are most of this file's time). The job queue's lanes, which
the executor runs trainings on, are tested without Ray."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from backbone.prompts import Prompt
from memories.build import build_memory
from memories.parse import Sample
from memories.store import Memory

ROOT = Path(__file__).resolve().parents[1]
PROMPT = Prompt.for_task("translation")
LORA = {"rank": 8, "alpha": 8.0, "lr": 1e-2, "batch_size": 4, "max_epochs": 2, "max_minutes": 0}
ADAPTER = {"max_epochs": 2, "batch_size": 4, "max_minutes": 0}


def test_a_lane_runs_its_kinds_in_parallel_beside_the_ordinary_worker(tmp_path):
    """JobQueue.add_lane: jobs of the lane's kinds run on its own threads (two at once here), the ordinary worker
    takes the other kinds meanwhile and never a lane job."""
    import threading

    from ground.jobs import JobQueue
    from ground.store import Catalog

    release, threads = threading.Event(), {}

    def slow(job):
        threads[job.id] = threading.current_thread().name
        assert release.wait(30)
        return {"message": "slow done"}

    def fast(job):
        threads[job.id] = threading.current_thread().name
        return {"message": "fast done"}

    q = JobQueue(Catalog(tmp_path), {"slow": slow, "fast": fast}, workers=1, throttle=0.0)
    q.add_lane(("slow",), 2)
    q.start()
    try:
        s1, s2 = q.submit("slow"), q.submit("slow")
        f = q.submit("fast")  # queued behind two slow jobs, yet not waiting for them
        assert q.wait(f, timeout=30)["state"] == "done"
        t0 = time.time()
        while {q.get(s1)["state"], q.get(s2)["state"]} != {"running"} and time.time() - t0 < 30:
            time.sleep(0.05)
        assert q.get(s1)["state"] == q.get(s2)["state"] == "running"  # both at once, on the lane
        release.set()
        assert q.wait(s1, timeout=30)["state"] == q.wait(s2, timeout=30)["state"] == "done"
    finally:
        release.set()
        q.stop()
    assert threads[f].startswith("pema-job-worker-")
    assert threads[s1].startswith("pema-job-lane-0-") and threads[s2].startswith("pema-job-lane-0-")
    assert threads[s1] != threads[s2]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "PEMA_TINY_DEVICE": "cpu"}})
    except Exception as e:  # noqa: BLE001 — no Ray here (ports, sandbox): skip, do not fail
        pytest.skip(f"Ray cannot start here: {type(e).__name__}: {str(e)[:200]}")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def spec(tiny):
    """How the workers load the tiny backbone (one spec for the module: its warm build workers are reused)."""
    return {"name": "tiny", "device": None, "data_dir": str(ROOT), "fingerprint": tiny.fingerprint}


@pytest.fixture(scope="module")
def executor(local_ray):
    from studio.ray_executor import RayExecutor

    return RayExecutor(shard_samples=2).start()  # joins the module's Ray; small shards: several per worker


def _arrays(mem: Memory) -> dict:
    return {n: np.load(mem.path / f"{n}.npy") for n in ("keys", "values", "entry_sample", "heldout_keys",
                                                        "heldout_values", "heldout_entry_sample")}


def test_a_sharded_build_equals_the_single_process_build(tiny, tiny_pairs, executor, spec, tmp_path):
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(tiny_pairs)]
    one = build_memory(tiny, samples, tmp_path / "one", prompt=PROMPT, key_dtype="float32")
    sharded = build_memory(tiny, samples, tmp_path / "sharded", prompt=PROMPT, key_dtype="float32",
                           capture=executor.capture(spec))
    train_split = executor.captures[-2]  # then the held-out split's (one sample)
    assert train_split["workers"] == 2 and train_split["shards"] > 2
    assert [w["entries"] > 0 for w in train_split["per_worker"]] == [True, True]  # both workers captured shards
    a, b = _arrays(one), _arrays(sharded)
    for name in ("values", "entry_sample", "heldout_values", "heldout_entry_sample"):
        assert np.array_equal(a[name], b[name]), name  # the same entries, in the same order
    for name in ("keys", "heldout_keys"):
        assert a[name].shape == b[name].shape and len(a[name]) > 0
        np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-4)
    assert (one.path / "samples.jsonl").read_text() == (sharded.path / "samples.jsonl").read_text()
    assert one.meta["stats"]["entries"] == sharded.meta["stats"]["entries"]
    assert one.meta["stats"]["key_rms"] == pytest.approx(sharded.meta["stats"]["key_rms"], rel=1e-5)


def test_a_worker_with_another_backbone_is_refused(tiny, tiny_pairs, executor, spec, tmp_path):
    from ground.errors import UserError

    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(tiny_pairs)]
    other = {**spec, "fingerprint": "not-" + tiny.fingerprint}
    with pytest.raises(UserError, match="same backbone weights"):
        build_memory(tiny, samples, tmp_path / "m", prompt=PROMPT, capture=executor.capture(other))
    assert not (tmp_path / "m").exists()  # nothing half-built is left


@pytest.fixture(scope="module")
def studio(executor, tmp_path_factory):
    from studio.service import Studio

    st = Studio(tmp_path_factory.mktemp("ray-studio"), backbone="tiny", executor=executor)
    assert st.backbone_service.wait_ready(120), st.backbone_service.status()
    yield st
    st.close()


def test_the_studio_builds_on_ray_and_trainings_run_as_ray_tasks(studio, tiny_pairs):
    st = studio
    assert st.executor.training_slots() == 2  # one per CPU of the local Ray (no GPU)
    text = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in tiny_pairs)
    build = st.jobs.wait(st.memory_service.submit_build(text, "pairs.jsonl", name="pairs"), timeout=300)
    assert build["state"] == "done", build
    assert "Ray workers" in build["log"]  # the capture ran sharded
    mid = build["result"]["memory_id"]
    j1 = st.plugin_service.submit_train(mid, "lora", LORA, "lora on ray")
    j2 = st.plugin_service.submit_train(mid, "adapter", ADAPTER, "adapter on ray")
    jobs = [st.jobs.wait(j, timeout=300) for j in (j1, j2)]
    for job in jobs:
        assert job["state"] == "done", job
        assert job["result"]["executor"] == "ray" and "Ray task" in job["log"]
        assert job["metrics"] and job["progress"] == 1.0  # the loss curve and progress came back
    # both started before either finished: they ran side by side on the training lane
    assert max(j["started"] for j in jobs) < min(j["finished"] for j in jobs)
    plugins = {p["id"]: p for p in st.plugin_service.plugins()}
    for job in jobs:
        p = plugins[job["result"]["plugin_id"]]
        assert p["memory_id"] == mid and p["params"] > 0 and p["usable"]
        assert Path(st.catalog.plugin(p["id"])["path"]).parent == st.root / "plugins"
    lora = next(j for j in jobs if j["args"]["method"] == "lora")["result"]["plugin_id"]
    assert st.plugin_service.plugin_detail(lora, owner=None)["history"]
    out = st.compare_service.compare("the house is small", "translation", ["base", lora], {}, 8)
    assert len(out["rows"]) == 2 and out["rows"][1]["text"] is not None


def test_cancel_reaches_a_running_ray_training(studio, tiny_pairs):
    st = studio
    mid = next(m["id"] for m in st.memory_service.memories())
    long = {**LORA, "max_epochs": 1000, "patience": 1000}
    jid = st.plugin_service.submit_train(mid, "lora", long, "cancel me")
    t0 = time.time()
    while st.job_service.job(jid)["progress"] < 0.1 and time.time() - t0 < 180:
        time.sleep(0.2)
    assert st.job_service.job(jid)["state"] == "running" and st.job_service.job(jid)["progress"] >= 0.1
    st.job_service.cancel_job(jid)
    job = st.jobs.wait(jid, timeout=120)
    assert job["state"] == "cancelled", job
    assert "cancel me" not in {p["name"] for p in st.plugin_service.plugins()}


def test_a_studio_ranking_trains_on_the_ray_workers(studio):
    """The Rank tab's job on a studio with workers: the methods that train run as Ray tasks (kNN here), the
    leaderboard records the workers, and the estimate said so before."""
    from test_rank import unique_pairs

    st = studio
    text = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in unique_pairs(120))
    build = st.jobs.wait(st.memory_service.submit_build(text, "rank.jsonl", name="rank on ray"), timeout=300)
    assert build["state"] == "done", build
    mid = build["result"]["memory_id"]
    assert "on 2 Ray worker(s)" in st.rank_service.rank_estimate(mid, methods=["knn", "adapter"])["text"]
    job = st.jobs.wait(st.rank_service.submit_rank(mid, methods=["knn", "adapter"]), timeout=600)
    assert job["state"] == "done", job
    board = job["result"]["leaderboard"]
    assert board["workers"] == {"executor": "ray", "workers": 2, "address": None, "gpus": 0}
    rows = {r["method"]: r for r in board["methods"]}
    assert set(rows) == {"base", "knn", "adapter"}
    assert rows["adapter"]["trained_on"] == "ray" and rows["knn"]["trained_on"] == "here"
    assert "training at once on 2 worker(s)" in job["log"]
