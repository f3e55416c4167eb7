"""The studio as separate services: each built alone from what it is given (a context, its collaborators), the
studio handing each the objects they share (and forwarding nothing), and the shape rules of ``studio/`` (one project
base class at most, ≤ 40 methods a class, no state made lazily through ``__dict__``)."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUDIO = ROOT / "studio"
PROJECT = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
MAX_METHODS = 40
PAIRS = "\n".join(f"{s}\t{t}" for s, t in [("the house is small", "das Haus ist klein"),
                                          ("the cat sleeps", "die Katze schlaeft"),
                                          ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3)


# --- shape rules --------------------------------------------------------------------------------------------------
def studio_classes():
    """(module name, class) of every class defined in a module of ``studio/``."""
    for path in sorted(STUDIO.glob("*.py")):
        mod = importlib.import_module(f"studio.{path.stem}")
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == mod.__name__:
                yield mod.__name__, cls


def test_no_studio_class_has_more_than_one_project_base():
    many = {f"{m}.{c.__name__}": [b.__qualname__ for b in c.__bases__ if b.__module__.split(".")[0] in PROJECT]
            for m, c in studio_classes()}
    assert not {k: v for k, v in many.items() if len(v) > 1}


def test_no_studio_class_has_more_than_40_methods():
    counts = {}
    for path in sorted(STUDIO.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                counts[f"{path.stem}.{node.name}"] = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                                                         for n in node.body)
    assert counts and max(counts.values()) <= MAX_METHODS, sorted(counts.items(), key=lambda kv: -kv[1])[:3]


def test_no_studio_state_appears_lazily():
    lazy = [f"{p.name}:{i}" for p in STUDIO.glob("*.py")
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if "__dict__.setdefault" in line or "getattr(self, \"_" in line]
    assert not lazy


# --- the façade's forwarding table ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def idle_studio(tmp_path_factory):
    from studio.service import Studio

    st = Studio(tmp_path_factory.mktemp("facade"), backbone="tiny", load=False, start_jobs=False)
    yield st
    st.close()


def test_the_studio_hands_each_service_the_objects_it_shares(idle_studio):
    """One gate, one plug-in cache, one downloads folder: every service that uses one was given the studio's."""
    st = idle_studio
    for svc in (st.backbone_service, st.memory_service, st.plugin_service, st.evaluate_service, st.rank_service):
        assert svc.gate is st.gate, type(svc).__name__
    for svc in (st.backbone_service, st.memory_service, st.plugin_service, st.compare_service, st.rank_service):
        assert svc.plugin_cache is st.plugin_cache, type(svc).__name__
    assert st.plugin_service.downloads is st.evaluate_service.downloads is st.downloads
    assert st.compare_service.store is st.store and st.evaluate_service.job_svc is st.job_service


def test_the_studio_forwards_nothing(idle_studio):
    """A service's method is reached through its service only (``studio.compare_service.compare``), so
    go-to-definition and a reader land on the method itself."""
    st = idle_studio
    assert st.compare_service.compare.__self__ is st.compare_service
    for name in ("compare", "memories", "status", "busy_timeout", "backbone"):
        with pytest.raises(AttributeError):
            getattr(st, name)
    old = st.limits
    st.limits = type(old)(input_chars=5)  # the context every service reads
    try:
        assert st.context.limits.input_chars == 5
    finally:
        st.limits = old


# --- each service built alone ---------------------------------------------------------------------------------------
@pytest.fixture
def parts(tmp_path):
    """A context (catalog, limits, a started job queue), the plug-in cache, the backbone's gate and a loaded tiny
    backbone: what the services share."""
    from ground.jobs import JobQueue
    from ground.store import Catalog
    from studio.backbone_service import BackboneService
    from studio.caches import LRU
    from studio.context import StudioContext
    from studio.gate import BackboneGate
    from studio.limits import Limits

    catalog = Catalog(tmp_path)
    jobs = JobQueue(catalog)
    assert jobs.acquire()
    ctx = StudioContext(catalog, Limits.configure(False, environ={}), jobs)
    cache, gate = LRU(4), BackboneGate()
    bb = BackboneService(ctx, cache, gate, "tiny")
    bb.load_backbone_async()
    assert bb.wait_ready(120), bb.status()
    jobs.start()
    yield ctx, cache, gate, bb
    jobs.stop()


def _memory(ctx, cache, gate, bb):
    from studio.memory_service import MemoryService

    memory_svc = MemoryService(ctx, bb, gate, cache)
    ctx.jobs.handlers.update(memory_svc.job_handlers)
    job = ctx.jobs.wait(memory_svc.submit_build(PAIRS, "pairs.tsv", name="pairs"), 120)
    assert job["state"] == "done", job
    return memory_svc, job["result"]["memory_id"]


def _plugins(ctx, cache, gate, bb, memory_svc):
    from studio.downloads import Downloads
    from studio.plugin_service import PluginService

    return PluginService(ctx, bb, gate, memory_svc, cache, Downloads())


def test_the_backbone_service_alone(parts):
    ctx, cache, gate, bb = parts
    cache.put("p", object())
    status = bb.status()
    assert status["ready"] and status["backbone"] == bb.loaded_backbone().name and not status["read_only"]
    with bb.interactive("a test") as model:
        assert model is bb.loaded_backbone() and gate.holder == "a test"
    assert not bb.offsite() and bb.eval_decode(model) == {}


def test_the_memory_service_alone(parts):
    memory_svc, mid = _memory(*parts)
    (row,) = memory_svc.memories()
    assert row["id"] == mid and row["usable"] and row["samples"] == 12
    assert memory_svc.memory_profile(mid)["name"] == "pairs"


def test_the_plugin_service_alone(parts):
    ctx, cache, gate, bb = parts
    memory_svc, mid = _memory(*parts)
    plugin_svc = _plugins(ctx, cache, gate, bb, memory_svc)
    ctx.jobs.handlers.update(plugin_svc.job_handlers)
    job = ctx.jobs.wait(plugin_svc.submit_train(mid, "knn", {}), 120)
    assert job["state"] == "done", job
    pid = job["result"]["plugin_id"]
    assert [p["id"] for p in plugin_svc.plugins()] == [pid]
    assert plugin_svc.load_plugin(pid) is plugin_svc.load_plugin(pid) is cache.get(pid)  # loaded once, cached


def test_the_job_service_alone(tmp_path):
    from ground.jobs import JobQueue
    from ground.store import Catalog
    from studio.context import StudioContext
    from studio.job_service import JobService
    from studio.limits import Limits

    catalog = Catalog(tmp_path)
    jobs = JobQueue(catalog, {"noop": lambda job: {"message": "done"}})
    assert jobs.acquire()
    svc = JobService(StudioContext(catalog, Limits(), jobs))
    jid = jobs.submit("noop", {"upload": "/server/path"}, owner="local")
    assert svc.job(jid)["args"] == {} and [j["id"] for j in svc.list_jobs()] == [jid]
    assert svc.cancel_job(jid)["state"] == "cancelled"
    with pytest.raises(Exception, match="No job"):
        svc.job(jid, owner="someone else")


def _comparisons(ctx, cache, gate, bb):
    from studio.compare_service import CompareService, ComparisonStore
    from studio.memory_service import MemoryService

    memory_svc = MemoryService(ctx, bb, gate, cache)
    plugin_svc = _plugins(ctx, cache, gate, bb, memory_svc)
    return memory_svc, plugin_svc, CompareService(ctx, bb, memory_svc, plugin_svc, cache, ComparisonStore())


def test_the_compare_service_alone(parts):
    *_, compare_svc = _comparisons(*parts)
    p = compare_svc.compare("the house is small", methods=["base"], max_new_tokens=3)
    assert p["rows"][0]["label"] == "Base model" and compare_svc.recent(p["id"]) is p
    assert compare_svc.store.recent(p["id"], "someone else") is None
    several = compare_svc.compare_several("good morning ||| Guten Morgen", methods=["base"], max_new_tokens=3)
    assert several["corpus"][0]["n"] == 1


def test_the_neighbour_map_service_alone(parts):
    from studio.neighbour_map import NeighbourMapService

    ctx, cache, gate, bb = parts
    memory_svc, plugin_svc, compare_svc = _comparisons(*parts)
    maps = NeighbourMapService(ctx, bb, memory_svc, plugin_svc, compare_svc)
    p = compare_svc.compare("hello world", methods=["base"], max_new_tokens=2)
    with pytest.raises(Exception, match="for kNN and PEMA rows"):
        maps.neighbour_map(p["id"], "Base model", 0)


def test_the_evaluate_service_alone(parts):
    from studio.downloads import Downloads
    from studio.evaluate_service import EvaluateService
    from studio.job_service import JobService

    ctx, cache, gate, bb = parts
    memory_svc, plugin_svc, compare_svc = _comparisons(*parts)
    downloads = Downloads()
    svc = EvaluateService(ctx, bb, gate, memory_svc, plugin_svc, compare_svc, JobService(ctx), downloads)
    ctx.jobs.handlers.update(svc.job_handlers)
    try:
        jid = svc.submit_evaluate(methods=["base"], test_data=PAIRS, test_filename="t.tsv", limit=2,
                                  max_new_tokens=3)
        assert ctx.jobs.wait(jid, 120)["state"] == "done"
        files = svc.evaluation_files(jid)
        assert {f.suffix for f in files} == {".csv", ".json"} and files[0].parent.parent == downloads.downloads_root()
    finally:
        downloads.remove()


def test_the_rank_service_alone(parts):
    from studio.rank_service import RankService

    ctx, cache, gate, bb = parts
    memory_svc, mid = _memory(*parts)
    svc = RankService(ctx, bb, gate, memory_svc, cache)
    est = svc.rank_estimate(mid, methods=["knn"])
    assert est["seconds"] >= 0 and set(est["per_method"]) == {"knn"}
    with pytest.raises(Exception, match="No finished ranking"):
        svc.leaderboard(memory_id=mid)


def test_the_comparison_store_keeps_per_owner():
    from studio import compare_service

    store = compare_service.ComparisonStore()
    store.keep_recent("a", {"id": "a-1"})
    for i in range(2 * compare_service.RECENT_PER_OWNER):
        store.keep_recent("b", {"id": f"b-{i}"})
    assert store.recent("a-1", "a") == {"id": "a-1"} and store.recent("a-1", "b") is None
    assert list(store.recent_owners().values()).count("b") == compare_service.RECENT_PER_OWNER
    assert store.bump_stream(("a", "tab")) == 1 and store.stream_generation(("a", "tab")) == 1
