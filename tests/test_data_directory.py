"""Durability: cancel within seconds, one owner process per data directory, nothing left behind.

* A monolingual build cancelled during its synthetic-source step stops within a few seconds and leaves no folder,
  row or upload; the backbone is handed to an interactive user within one batch meanwhile.
* ``<data_dir>/studio.lock``: a second Studio (another process) on a live directory runs read-only — it does not
  mark the first one's running job interrupted, take its queued job, or delete its temporary folders; a CLI-like
  writer's temporary folder survives an owner's start-up until that writer is gone.
* Nothing left behind: uploads go when their job is done, failed or cancelled; evaluation downloads go by age;
  Gradio's cache of both pages (studio, share page) is cleaned on a schedule; a read-only studio says so.
* Crash tests: a studio process killed with SIGKILL at ten points of a build, a training and an evaluation; the
  next start marks the job interrupted and leaves no orphan folder, no orphan row, no temporary folder and no upload.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MONO = "\n".join(f"Das ist der Satz Nummer {i} aus dem Test" for i in range(400))
PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3
JSONL = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in PAIRS)
QUICK_PEMA = {"rank": 8, "max_epochs_rct": 1, "max_epochs_joint": 2, "candidate_contexts": 16}


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def read_until(proc: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    """Lines of the child's stdout up to the one starting with ``marker`` (fails after ``timeout``)."""
    lines: list[str] = []
    found = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(marker):
                found.set()
                return

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    if not found.wait(timeout):
        proc.kill()
        t.join(5)
        pytest.fail(f"the child never reached {marker!r}; its output ended with:\n" + "\n".join(lines[-30:]))
    return lines


def folders(root: Path, sub: str) -> set[str]:
    d = root / sub
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def temporaries(root: Path) -> list[str]:
    out = []
    for sub in ("memories", "plugins"):
        d = root / sub
        if not d.is_dir():
            continue
        for p in d.rglob("*"):
            if p.name.startswith(".tmp-") or p.name.endswith(".tmp"):
                out.append(str(p.relative_to(root)))
    return out


def assert_consistent(root: Path) -> None:
    """Every folder has its row and every row its folder; no temporary file anywhere; the catalog is sound."""
    db = sqlite3.connect(root / "studio.db")
    try:
        assert db.execute("pragma integrity_check").fetchone()[0] == "ok"
        for table in ("memories", "plugins"):
            rows = {Path(p).name for (p,) in db.execute(f"select path from {table}")}
            assert rows == folders(root, table), (table, rows, folders(root, table))
            for (p,) in db.execute(f"select path from {table}"):
                assert not Path(p).is_absolute() and (root / p).is_dir()  # stored relative to the data directory
    finally:
        db.close()
    assert temporaries(root) == []
    assert not list((root / "uploads").glob("*")) if (root / "uploads").is_dir() else True


# --- 1. cancel within seconds ------------------------------------------------------------------------------------
def test_generate_greedy_checks_should_stop_before_every_batch_and_token(tiny):
    from backbone.model import generate_greedy
    from ground.errors import Cancelled

    ctxs = [tiny.encode_context(f"sentence {i}") for i in range(10)]
    calls = []

    def stop_after_two():
        calls.append(1)
        return len(calls) > 2

    with pytest.raises(Cancelled):
        generate_greedy(tiny, ctxs, max_new_tokens=4, batch_size=3, should_stop=stop_after_two)
    assert len(calls) == 3  # before batch 1, after its first token, then stopped inside batch 1
    calls.clear()
    outs = generate_greedy(tiny, ctxs, max_new_tokens=4, batch_size=3, should_stop=lambda: calls.append(1) or False)
    # before each of the 4 batches and after every generated token (1 to 4 per batch)
    assert len(outs) == 10 and 4 + 4 <= len(calls) <= 4 + 4 * 4


def test_every_phase_of_a_monolingual_build_checks_should_stop_per_batch(tiny, tmp_path):
    from backbone.prompts import Prompt
    from memories.build import build_memory
    from memories.parse import Sample

    samples = [Sample(None, f"Satz Nummer {i}", i + 1) for i in range(40)]
    seen: list[str] = []
    phase = {"now": ""}

    def progress(f, m):
        phase["now"] = m.split(":")[0]

    def should_stop():
        seen.append(phase["now"])
        return False

    build_memory(tiny, samples, tmp_path / "m", prompt=Prompt.for_task("translation"), batch_size=8,
                 progress=progress, should_stop=should_stop)
    assert seen.count("synthetic sources") >= 40 // 8 - 1  # one call per generated batch of 8
    assert sum(1 for s in seen if s.startswith("captured") or s.startswith("held-out")) >= 3


def test_a_monolingual_build_cancelled_mid_way_stops_within_seconds_and_leaves_nothing(tmp_path):
    from studio.service import Studio

    st = Studio(tmp_path / "d", backbone="tiny")
    try:
        assert st.backbone_service.wait_ready(120), st.backbone_service.status()
        before = {sub: folders(st.root, sub) for sub in ("memories", "plugins")}
        jid = st.memory_service.submit_build(MONO, "mono.txt", task="translation")
        t0 = time.time()
        while True:  # the synthetic-source step is under way
            job = st.jobs.get(jid)
            if job["message"].startswith("synthetic sources") and job["progress"] > 0.02:
                break
            assert job["state"] in ("queued", "running") and time.time() - t0 < 120, job
            time.sleep(0.02)
        assert job["progress"] < 0.4, "the build went too fast to cancel mid-way"
        t1 = time.time()
        with st.gate.use(timeout=10):  # an interactive user gets the backbone within one batch
            waited = time.time() - t1
        assert waited < 5, waited
        t1 = time.time()
        st.job_service.cancel_job(jid)
        job = st.jobs.wait(jid, 30, poll=0.02)
        assert job["state"] == "cancelled" and time.time() - t1 < 5, (job["state"], time.time() - t1)
        assert {sub: folders(st.root, sub) for sub in ("memories", "plugins")} == before
        assert st.catalog.memories() == [] and temporaries(st.root) == []
        assert list((st.root / "uploads").iterdir()) == []  # the upload went with the job
    finally:
        st.close()


# --- 2. one owner process ------------------------------------------------------------------------------------------
OWNER_CHILD = r"""
import json, os, sys, threading, time
from pathlib import Path
from ground.jobs import JobQueue
from ground.store import Catalog, atomic_dir

d = Path(sys.argv[1])
cat = Catalog(d)
ids_printed = threading.Event()  # the worker may start before IDS is out: RUNNING must come after it

def slow(job):
    ids_printed.wait(30)
    with atomic_dir(d / "memories" / f"mem-{job.args['n']}") as tmp:
        (tmp / "meta.json").write_text("{}")
        print("RUNNING", job.id, flush=True)
        while not (d / "go").exists():
            time.sleep(0.02)
    return {"pid": os.getpid()}

q = JobQueue(cat, {"slow": slow}, throttle=0.0).start()
first, second = q.submit("slow", {"n": 1}), q.submit("slow", {"n": 2})
print("IDS", first, second, flush=True)
ids_printed.set()
q.wait(second, 120)
print("DONE", json.dumps([q.get(first)["state"], q.get(second)["state"]]), flush=True)
q.stop()
"""

WRITER_CHILD = r"""
import sys, time
from pathlib import Path
from ground.store import atomic_dir

d = Path(sys.argv[1])
with atomic_dir(d / "plugins" / "pema-cli") as tmp:
    (tmp / "plugin_model.safetensors").write_bytes(b"half")
    print("WRITING", tmp.name, flush=True)
    time.sleep(600)
"""


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_a_second_studio_on_a_live_directory_runs_read_only_and_touches_nothing(tmp_path):
    from ground.errors import UserError
    from ground.jobs import JobQueue
    from ground.store import Catalog
    from studio.service import Studio

    d = tmp_path / "d"
    d.mkdir()
    owner = spawn(OWNER_CHILD, str(d))
    try:
        lines = read_until(owner, "RUNNING", 60)
        first, second = next(ln for ln in lines if ln.startswith("IDS")).split()[1:]
        tmp_name = next(p.name for p in (d / "memories").iterdir())
        second_studio = Studio(d, backbone="tiny", load=False)  # another process holds the lock
        try:
            assert second_studio.read_only and second_studio.repairs == []
            jobs = {j["id"]: j["state"] for j in second_studio.jobs.list()}
            assert jobs == {first: "running", second: "queued"}  # not interrupted, not taken
            assert (d / "memories" / tmp_name).is_dir()  # its temporary folder is left alone
            with pytest.raises(UserError, match="another PEMA Studio process owns"):
                second_studio.memory_service.submit_build(JSONL, "x.jsonl")
            assert not (d / "uploads").exists() or not list((d / "uploads").iterdir())
            with pytest.raises(UserError, match=r"in use by another PEMA Studio \(process \d+"):
                JobQueue(Catalog(d)).start()
            time.sleep(0.5)  # the read-only studio has no worker: the queued job stays queued
            assert second_studio.jobs.get(second)["state"] == "queued"
        finally:
            second_studio.close()
        (d / "go").write_text("go")
        done = read_until(owner, "DONE", 60)[-1]
        assert json.loads(done.split(" ", 1)[1]) == ["done", "done"]
        assert owner.wait(30) == 0
        assert second_studio.jobs.get(second)["result"] == {"pid": owner.pid}  # the owner ran both
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_the_owner_cleans_only_temporaries_of_writers_that_are_gone(tmp_path):
    from ground.lock import host
    from studio.service import Studio

    d = tmp_path / "d"
    (d / "plugins").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = d / "plugins" / f".tmp-pema-old@{host()}@{dead.pid}@abcd1234"
    stale.mkdir()
    elsewhere = d / "plugins" / f".tmp-pema-nfs@some-other-host@{os.getpid()}@abcd1234"
    elsewhere.mkdir()
    writer = spawn(WRITER_CHILD, str(d))
    try:
        live = read_until(writer, "WRITING", 60)[-1].split()[1]
        st = Studio(d, backbone="tiny", load=False, start_jobs=False)  # the owner: it repairs at start-up
        try:
            assert not st.read_only
            assert not stale.exists() and elsewhere.exists() and (d / "plugins" / live).is_dir()
            assert any("left by a process that is gone" in r for r in st.repairs)
        finally:
            st.close()
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        st = Studio(d, backbone="tiny", load=False, start_jobs=False)
        try:
            assert not (d / "plugins" / live).exists()  # its writer is gone now
        finally:
            st.close()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def test_the_lock_is_released_on_close_and_taken_again(tmp_path):
    from studio.service import Studio

    a = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
    b = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)  # same process, second studio
    try:
        assert not a.read_only and b.read_only
        assert not a.backbone_service.status()["read_only"] and b.backbone_service.status()["read_only"]
    finally:
        b.close()
        a.close()
    c = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
    try:
        assert not c.read_only
    finally:
        c.close()


def test_a_read_only_studio_says_so_in_its_status_line_and_at_start_up(tmp_path, capsys):
    import app
    from studio.service import Studio
    from ui.render import status_header

    owner = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
    try:
        second = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
        try:
            assert "Read-only" in status_header(second.backbone_service.status()) and "another PEMA Studio" in \
                status_header(second.backbone_service.status())
            assert "Read-only" not in status_header(owner.backbone_service.status())
        finally:
            second.close()

        class NoServer(Exception):
            pass

        def no_launch(*a, **k):
            raise NoServer()

        real, app.launch_app = app.launch_app, no_launch
        try:
            with pytest.raises(NoServer):
                app.start(["--backbone", "tiny", "--data-dir", str(tmp_path), "--quiet"], block=False)
        finally:
            app.launch_app = real
        out = capsys.readouterr().out
        assert "PEMA Studio: read-only" in out and "studio.lock is held by process" in out, out
    finally:
        owner.close()


# --- 3. nothing left behind ---------------------------------------------------------------------------------------
def test_atomic_dir_names_its_writer_and_leaves_nothing_on_failure(tmp_path):
    from ground.lock import host, temp_writer
    from ground.store import atomic_dir, write_json_atomic

    seen = {}
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "m") as tmp:
            seen["tmp"] = tmp.name
            write_json_atomic(tmp / "meta.json", {"a": 1})
            raise RuntimeError("boom")
    assert temp_writer(seen["tmp"]) == (host(), os.getpid())
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(tmp_path / "m") as tmp:
        write_json_atomic(tmp / "meta.json", {"a": 1})
    with atomic_dir(tmp_path / "m") as tmp:  # replacing an existing folder
        write_json_atomic(tmp / "meta.json", {"a": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and json.loads((tmp_path / "m" / "meta.json").read_text()) \
        == {"a": 2}
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["meta.json"]


def test_a_build_with_a_catalog_publishes_folder_and_row_in_one_step(tiny, tmp_path):
    from backbone.prompts import Prompt
    from ground.store import Catalog
    from memories.build import build_memory
    from memories.parse import Sample

    cat = Catalog(tmp_path)
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)]
    mem = build_memory(tiny, samples, tmp_path / "memories" / "mem-a", prompt=Prompt.for_task("translation"),
                       catalog=cat.owned_by("anon:x"))
    row = cat.memory("mem-a")
    assert row["path"] == str(mem.path) and row["owner"] == "anon:x" and row["entries"] == len(mem)
    cat.delete_memory("mem-a")
    assert cat.memory("mem-a") is None and folders(tmp_path, "memories") == set()


def test_repair_at_start_up_fixes_rows_and_folders(tiny, tmp_path):
    import shutil

    from backbone.prompts import Prompt
    from ground.store import Catalog
    from memories.build import build_memory
    from memories.parse import Sample

    cat = Catalog(tmp_path)
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)]
    for mid in ("mem-kept", "mem-moved", "mem-rowless", "mem-gone"):
        build_memory(tiny, samples, tmp_path / "memories" / mid, prompt=Prompt.for_task("translation"),
                     catalog=cat)
    cat.db["memories"].update("mem-moved", {"path": str(tmp_path / "elsewhere-in-the-dir" / "mem-moved")})
    cat.db["memories"].delete("mem-rowless")
    shutil.rmtree(tmp_path / "memories" / "mem-gone")
    cat.add_memory({"id": "mem-outside", "name": "cli", "path": "/nonexistent/pema/mem-outside"})
    notes = cat.repair()
    assert {r["id"] for r in cat.memories()} == {"mem-kept", "mem-moved", "mem-outside"}
    assert cat.memory("mem-moved")["path"] == str(tmp_path / "memories" / "mem-moved")
    assert folders(tmp_path, "memories") == {"mem-kept", "mem-moved"}
    assert len(notes) == 4 and any("mem-rowless" in n for n in notes) and any("mem-gone" in n for n in notes)
    assert cat.repair() == [n for n in notes if "mem-outside" in n]  # nothing else left to repair
    assert cat.integrity() == "ok"


def test_an_upload_goes_when_its_queued_job_is_cancelled(tmp_path):
    from studio.service import Studio

    st = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
    try:
        jid = st.memory_service.submit_build(JSONL, "x.jsonl")
        assert len(list((st.root / "uploads").iterdir())) == 1
        assert st.job_service.cancel_job(jid)["state"] == "cancelled"
        assert list((st.root / "uploads").iterdir()) == []
    finally:
        st.close()


def test_uploads_go_when_their_job_is_done_or_failed_and_old_downloads_go_by_age(tmp_path):
    from studio.service import Studio

    st = Studio(tmp_path, backbone="tiny", start_jobs=False)
    try:
        assert st.backbone_service.wait_ready(60)
        ok = st.memory_service.submit_build(JSONL, "x.jsonl")
        bad = st.memory_service.submit_build(JSONL, "y.jsonl")
        uploads = {Path(st.jobs.get(j)["args"]["upload"]) for j in (ok, bad)}
        assert set((st.root / "uploads").iterdir()) == uploads
        Path(st.jobs.get(bad)["args"]["upload"]).write_bytes(b"\x00 not text any more")  # its build will fail
        st.jobs.start()
        assert st.jobs.wait(ok, 120)["state"] == "done" and st.jobs.wait(bad, 120)["state"] == "failed"
        assert list((st.root / "uploads").iterdir()) == []  # both went as soon as their job ended
        # evaluation downloads: written per evaluation, and any older than a day is removed on the next write
        stale = st.downloads.downloads_root() / "0123456789abcdef0123"
        stale.mkdir(parents=True)
        (stale / "pema-eval-old.csv").write_text("old")
        os.utime(stale / "pema-eval-old.csv", (time.time() - 2 * 86400,) * 2)
        (stale / "pema-eval-recent.csv").write_text("recent")
        ev = st.evaluate_service.submit_evaluate(methods=["base"],
                                                 test_data="\n".join(f"{s}\t{t}" for s, t in PAIRS[:4]),
                                                 test_filename="t.tsv", limit=2, max_new_tokens=4)
        assert st.jobs.wait(ev, 120)["state"] == "done"
        files = st.evaluate_service.evaluation_files(ev)
        assert files and all(f.is_file() and f.parent.parent == st.downloads.downloads_root() for f in files)
        assert sorted(p.name for p in stale.iterdir()) == ["pema-eval-recent.csv"]
        os.utime(stale / "pema-eval-recent.csv", (time.time() - 2 * 86400,) * 2)
        st.evaluate_service.evaluation_files(ev)
        assert not stale.exists()  # an emptied owner folder goes too
    finally:
        st.close()


def test_gradio_caches_of_both_pages_are_cleaned(tmp_path, monkeypatch):
    """Both mounted apps (the studio and the share page) get ``delete_cache``; an uploaded file in Gradio's cache
    is removed by the schedule once older than the age, while the server runs."""
    import httpx

    import ui.server
    from studio.service import Studio
    from ui import shared
    from ui.app import build_app

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio-cache"))
    monkeypatch.setattr(ui.server, "DELETE_CACHE", (1, 1))  # every second, files older than one second
    st = Studio(tmp_path / "d", backbone="tiny", start_jobs=False)
    studio_blocks, share_blocks = build_app(st), shared.build_app(st)
    assert studio_blocks.delete_cache  # the studio sets its own (downloads are kept a day)
    studio_blocks.delete_cache = None  # …here the server's default applies to both
    served = ui.server.serve(st, studio_blocks, share_blocks, "127.0.0.1", free_port())
    try:
        assert studio_blocks.delete_cache == share_blocks.delete_cache == (1, 1)
        with httpx.Client(base_url=served.url, timeout=30) as h:
            r = h.post("gradio_api/upload", files={"files": ("samples.tsv", b"a\tb\n")})
            assert r.status_code == 200, r.text
            path = Path(r.json()[0])
        assert path.is_file() and str(path).startswith(str(tmp_path / "gradio-cache"))
        t0 = time.time()
        while path.exists() and time.time() - t0 < 20:
            time.sleep(0.2)
        assert not path.exists()
    finally:
        served.close()
        st.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_faiss_index_leaves_no_temporary_file(tiny, tiny_memory, tmp_path):
    import shutil

    from memories.store import Memory
    from plugins.knn import KNN, KNNConfig

    shutil.copytree(tiny_memory.path, tmp_path / "m")
    mem = Memory.load(tmp_path / "m")
    knn = KNN(KNNConfig(search="faiss", ivf_lists=4, pq_m=16, nprobe=4), tiny)
    knn.fit(mem)
    names = sorted(p.name for p in mem.path.iterdir() if p.name.startswith("faiss"))
    assert len(names) == 2 and names[0].endswith(".index") and names[1] == names[0] + ".json"
    assert temporaries(tmp_path) == [] and not [p for p in mem.path.iterdir() if p.name.startswith(".")]
    assert knn.extra_config()["index"]["file"] == names[0]


# --- 3. crash tests: kill -9 at several points ------------------------------------------------------------------
# One parent process imports the studio once and forks one child per point (so ten studios cost one import); each
# child is a whole studio process that runs a build, a training or an evaluation and stops at its point, where the
# test kills it with SIGKILL. Points: where the hook is, and what it leaves half-done.
CRASH_POINTS = {
    "build-synthetic": "a monolingual build making its synthetic sources (the upload only)",
    "build-capture": "a build capturing f(c) (a half-written temporary folder, the upload)",
    "build-writing": "a build's folder fully written under its temporary name, not yet renamed",
    "build-publish": "a build's folder renamed into place, its catalog row not committed",
    "train-rct": "a PEMA training in its reconstruction phase",
    "train-fit": "a PEMA training in its joint phase",
    "train-writing": "a plug-in's folder written under its temporary name, not yet renamed",
    "train-saved": "a plug-in's folder saved, its catalog row not written",
    "evaluate-decoding": "an evaluation decoding its test sentences",
    "evaluate-finishing": "an evaluation done, its result not yet stored",
}
POINTS = tuple(CRASH_POINTS)

CRASH_PARENT = r"""
import json, os, sys, time, traceback
from pathlib import Path

import ground.store as store
from ground.jobs import JobContext, JobQueue
from studio.service import Studio

root, JSONL, MONO, QUICK, points = Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5:]
from backbone.tiny import tiny_backbone


def say(*words):  # one write per line: ten processes share this pipe
    os.write(1, (" ".join(map(str, words)) + "\n").encode())


tiny_backbone()  # once here: the children (forked below) find transformers' modules imported


def run(point, d):
    def hang(tag):
        say("AT", point)
        time.sleep(600)

    real_progress = JobContext.progress
    def progress(self, frac, message=""):
        if (point == "build-synthetic" and message.startswith("synthetic sources")
                or point == "build-capture" and self.kind == "build_memory" and message.startswith("captured")
                or point == "train-rct" and self.kind == "train_plugin" and message.startswith("reconstruction")
                or point == "train-fit" and self.kind == "train_plugin" and frac > 0.3
                or point == "evaluate-decoding" and self.kind == "evaluate" and message.startswith("decoded")):
            hang(point)
        return real_progress(self, frac, message)
    JobContext.progress = progress

    real_replace = store.replace_dir
    def replace_dir(tmp, final):
        if point == ("build-writing" if final.parent.name == "memories" else "train-writing"):
            hang(point)  # every file written and fsynced under the temporary name
        real_replace(tmp, final)
        if point == "build-publish" and final.parent.name == "memories":
            hang(point)  # renamed, its row not committed yet
    store.replace_dir = replace_dir

    real_add = store.Catalog.add_plugin
    def add_plugin(self, row):
        if point == "train-saved":
            hang(point)  # the folder is saved, its row not written yet
        return real_add(self, row)
    store.Catalog.add_plugin = add_plugin

    real_update = JobQueue._update
    def update(self, job_id, **fields):
        if point == "evaluate-finishing" and job_id.startswith("evaluate-") and fields.get("state") == "done":
            hang(point)  # the result is computed, the row not yet done
        return real_update(self, job_id, **fields)
    JobQueue._update = update

    st = Studio(d, backbone="tiny")
    assert st.backbone_service.wait_ready(300), st.backbone_service.status()
    if point == "build-synthetic":
        jid = st.memory_service.submit_build(MONO, "mono.txt")
    elif point.startswith("build"):
        jid = st.memory_service.submit_build(JSONL, "pairs.jsonl")
    else:
        job = st.jobs.wait(st.memory_service.submit_build(JSONL, "pairs.jsonl"), 120)
        assert job["state"] == "done", job
        mid = job["result"]["memory_id"]
        jid = st.plugin_service.submit_train(mid, "pema", QUICK)
        if point.startswith("evaluate"):
            job = st.jobs.wait(jid, 120)
            assert job["state"] == "done", job
            jid = st.evaluate_service.submit_evaluate(methods=["base", job["result"]["plugin_id"]], memory_id=mid,
                                                      limit=0, max_new_tokens=6)
    say("JOB", point, jid)
    time.sleep(600)


children = []
for point in points:
    pid = os.fork()
    if pid == 0:
        try:
            run(point, root / point)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
        finally:
            os._exit(1)
    say("PID", point, pid)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
say("ALL")
"""


def read_lines_until(proc: subprocess.Popen, done, timeout: float) -> list[str]:
    """Lines of the child's stdout until ``done(lines)`` (fails after ``timeout``)."""
    lines: list[str] = []
    found = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if done(lines):
                found.set()
                return

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(timeout):
        proc.kill()
        pytest.fail("the crash children never all reached their points; output:\n" + "\n".join(lines[-40:]))
    return lines


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Ten studio processes (forked from one), each killed with SIGKILL when it reaches its point."""
    root = tmp_path_factory.mktemp("crash")
    for point in POINTS:
        (root / point).mkdir()
    mono = "\n".join(f"Das ist der Satz Nummer {i} aus dem Test" for i in range(20))
    parent = spawn(CRASH_PARENT, str(root), JSONL, mono, json.dumps(QUICK_PEMA), *POINTS)
    out = {}
    pids: dict[str, int] = {}
    try:
        lines = read_lines_until(parent, lambda ls: sum(ln.startswith("AT ") for ln in ls) == len(POINTS)
                                 or ls[-1] == "ALL", 600)
        assert sum(ln.startswith("AT ") for ln in lines) == len(POINTS), "\n".join(lines[-60:])
        pids = {ln.split()[1]: int(ln.split()[2]) for ln in lines if ln.startswith("PID ")}
        jobs = {ln.split()[1]: ln.split()[2] for ln in lines if ln.startswith("JOB ")}
        for point in POINTS:
            d = root / point
            state = {"tmp": temporaries(d), "memories": folders(d, "memories"), "plugins": folders(d, "plugins"),
                     "uploads": folders(d, "uploads")}
            os.kill(pids[point], signal.SIGKILL)  # kill -9
            out[point] = (d, jobs[point], state)
        assert parent.wait(60) == 0
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    return out


@pytest.mark.parametrize("point", POINTS)
def test_a_studio_killed_mid_job_restarts_clean(crashed, point):
    from ground.jobs import INTERRUPTED_MESSAGE
    from studio.service import Studio

    d, job_id, before = crashed[point]
    named = lambda names: {n for n in names if not n.startswith(".")}  # noqa: E731
    # what the kill left: half-written work of each kind
    if point.startswith("build"):
        assert before["uploads"]  # the job's upload
    if point in ("build-capture", "build-writing", "train-writing"):
        assert before["tmp"], before  # a temporary folder
    if point == "build-publish":
        assert named(before["memories"])  # renamed, no row
    if point == "train-saved":
        assert named(before["plugins"])  # saved, no row
    st = Studio(d, backbone="tiny", load=False, start_jobs=False)
    try:
        job = st.jobs.get(job_id)
        assert job["state"] == "interrupted" and job["message"] == INTERRUPTED_MESSAGE
        assert not job["result"]
        if point in ("build-publish", "train-saved"):
            assert any("without a catalog row" in r for r in st.repairs), st.repairs
        if point in ("build-capture", "build-writing", "train-writing"):
            assert any("gone" in r for r in st.repairs), st.repairs  # the dead writer's temporary folder
        memories, plugins = len(st.catalog.memories()), len(st.catalog.plugins())
        expected = {"build": (0, 0), "train": (1, 0), "evaluate": (1, 1)}[point.split("-")[0]]
        assert (memories, plugins) == expected
        assert not st.downloads.downloads_root().exists() or not any(st.downloads.downloads_root().iterdir())
    finally:
        st.close()
    assert_consistent(d)
