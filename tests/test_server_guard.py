"""A public studio probed as a hostile visitor would: no server file leaves it, nothing a stranger sends exhausts it,
and a copied data directory is a directory of its own (on the tiny backbone, over real HTTP).

1. File inputs: every page event that takes a file, sent a server path (another owner's samples, a file outside the
   data directory, the owners' secret, the catalog, a URL) with no identity or a fresh browser cookie, is refused
   before Gradio reads or copies anything; with the studio's own check switched off, Gradio's own check (the app is
   marked launched, the data directory blocked) still refuses; a handler given a path it did not see uploaded by its
   caller refuses too.
2. Bounds: uploads need an identity and are bounded per owner and overall; request bodies, samples of a preview or
   build, waiting events per owner, the recent comparisons per owner, offsite positions; every event has a
   concurrency limit.
3. A copied data directory: start, list, delete in the copy, and the original is untouched.
4. Smaller holes: the import manifest oracle, nested / long-number JSON in a package, a cancel through a second
   process, a port left by a killed server, the offsite 429's wait, the offsite fingerprint in another precision.
"""
import asyncio
import json
import os
import shutil
import socket
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from _server import (  # noqa: E402
    TINY_PAIRS,
    build_tiny_memory,
    event_inputs,
    file_data,
    files_under,
    fn_indexes,
    free_port,
    hosted_site,
    join,
)

JSONL = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in TINY_PAIRS)
FILE_EVENTS = [("ui.memories", "preview_file"), ("ui.memories", "do_build"), ("ui.plugins", "import_plugin"),
               ("ui.evaluate", "do_run"), ("ui.evaluate", "do_sweep")]


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    """A multi-user studio over HTTP with its own Gradio upload folder; owner A has a memory and a plug-in."""
    from gradio_client import Client

    cache, data = tmp_path_factory.mktemp("gradio-cache"), tmp_path_factory.mktemp("hosted")
    clients = []
    with hosted_site(data, cache, ["uploads_per_owner=3"]) as (studio, served, url):
        try:
            ka, kb = studio.identity.new_browser_key(), studio.identity.new_browser_key()
            a = Client(url, headers={"X-Pema-Key": ka}, verbose=False)
            clients.append(a)
            job = a.predict(JSONL, "secret.jsonl", api_name="/build")["job_id"]
            assert studio.jobs.wait(job, 120)["state"] == "done"
            mid = studio.jobs.get(job)["result"]["memory_id"]
            pid = studio.jobs.wait(a.predict(mid, "knn", {}, "", api_name="/train")["job_id"], 120)["result"][
                "plugin_id"]
            mem_dir = Path(studio.catalog.memory(mid)["path"])
            export = studio.plugin_service.export_plugin_zip(pid, owner=studio.identity.owner_of_key(ka),
                                                             include_datastore=True)
            yield SimpleNamespace(studio=studio, served=served, url=url, a=a, ka=ka, kb=kb, mid=mid, pid=pid,
                                  cache=cache, data=data, mem_dir=mem_dir, export=export,
                                  blocks=served.blocks[0])
        finally:
            for c in clients:
                c.close()


def server_paths(h) -> list[str]:
    samples = next(h.mem_dir.glob("samples*"))
    return [str(samples), str(h.data / "owner-secret"), str(h.data / "studio.db"), "/etc/passwd",
            str(Path(__file__).resolve().parents[1] / "requirements-dev.txt"), str(h.export),
            "https://example.com/x.jsonl"]


# --- 1. no server file leaves the studio ---------------------------------------------------------------------------
def test_every_file_event_refuses_server_paths_and_copies_nothing(hosted):
    import httpx

    fresh = {"pema_owner": httpx.get(hosted.url).cookies["pema_owner"]}  # a stranger's browser
    before = files_under(hosted.cache)
    secret_text = (hosted.data / "owner-secret").read_text().strip()
    for module, name in FILE_EVENTS:
        for index in fn_indexes(hosted.blocks, module, name):
            for path in server_paths(hosted):
                for cookies in (None, fresh):
                    got = join(hosted.url, index, event_inputs(hosted.blocks, index, file_data(path)), cookies)
                    assert got["status"] == 403 and not got["success"], (name, path, got)
                    assert "das Haus" not in got["text"] and secret_text not in got["text"]
    assert files_under(hosted.cache) == before  # nothing was copied into Gradio's cache
    assert hosted.studio.catalog.count("memories") == 1  # nothing was built from another's file


def test_gradios_own_check_refuses_when_the_studios_is_off(hosted, monkeypatch):
    """Defence in depth: with the studio's ledger answering yes to everything, Gradio's own check (the mounted app
    is marked launched; the data directory is blocked) still refuses a server path, before copying it."""
    monkeypatch.setattr(hosted.studio.uploads, "owns", lambda path, owners: True)
    assert all(b.has_launched for b in hosted.served.blocks)
    assert str(hosted.data.resolve()) in hosted.blocks.blocked_paths
    before = files_under(hosted.cache)
    index = fn_indexes(hosted.blocks, "ui.memories", "preview_file")[0]
    for path in server_paths(hosted)[:5]:
        got = join(hosted.url, index, event_inputs(hosted.blocks, index, file_data(path)),
                   headers={"X-Pema-Key": hosted.kb})
        assert not got["success"] and "das Haus" not in got["text"], got
    assert files_under(hosted.cache) == before


def test_a_handler_reads_only_its_callers_own_upload(hosted, tmp_path):
    from ground.errors import UserError
    from ui.common import read_upload

    mine = tmp_path / "x.tsv"
    mine.write_text("a\tb\n")
    owner_a = hosted.studio.identity.owner_of_key(hosted.ka)
    ticket = hosted.studio.uploads.admit({owner_a}, 4)
    hosted.studio.uploads.record(ticket, [str(mine)])
    as_a = SimpleNamespace(headers={"x-pema-key": hosted.ka}, cookies={})
    as_b = SimpleNamespace(headers={}, cookies={"pema_owner": hosted.kb})
    assert read_upload(hosted.studio, as_a, str(mine)) == (b"a\tb\n", "x.tsv")
    for request, path in ((as_b, str(mine)), (as_a, str(hosted.data / "owner-secret")), (None, str(mine)),
                          (as_a, str(mine.parent / ".." / mine.parent.name / "y.tsv"))):
        with pytest.raises(UserError, match="not uploaded by you"):
            read_upload(hosted.studio, request, path)
    hosted.studio.uploads.consume(str(mine))
    assert not mine.exists()


def test_an_upload_is_its_uploaders_alone(hosted):
    """A's own upload works through the page's preview event; B (another key) naming A's upload is refused."""
    import httpx

    src = hosted.data.parent / "mine.tsv"
    src.write_text("the cat sleeps\tdie Katze schlaeft\n")
    with httpx.Client(base_url=hosted.url, headers={"X-Pema-Key": hosted.ka}, timeout=30) as h:
        r = h.post("gradio_api/upload", files={"files": ("mine.tsv", src.read_bytes())})
    assert r.status_code == 200, r.text
    stored = r.json()[0]
    index = fn_indexes(hosted.blocks, "ui.memories", "preview_file")[0]
    ok = join(hosted.url, index, event_inputs(hosted.blocks, index, file_data(stored)),
              headers={"X-Pema-Key": hosted.ka})
    assert ok["success"] and "Katze" in ok["text"], ok
    stolen = join(hosted.url, index, event_inputs(hosted.blocks, index, file_data(stored)),
                  headers={"X-Pema-Key": hosted.kb})
    assert stolen["status"] == 403 and "Katze" not in stolen["text"]


def test_uploads_need_an_identity_are_bounded_and_never_reach_the_share_page(hosted):
    import httpx

    with httpx.Client(base_url=hosted.url, timeout=30) as h:
        assert h.post("gradio_api/upload", files={"files": ("x.txt", b"hi")}).status_code == 403
        assert h.post("share/gradio_api/upload", files={"files": ("x.txt", b"hi")},
                      headers={"X-Pema-Key": hosted.kb}).status_code == 404
        big = b"x" * (hosted.studio.limits.request_bytes() + 10)
        assert h.post("gradio_api/upload", files={"files": ("big.txt", big)},
                      headers={"X-Pema-Key": hosted.kb}).status_code == 413
        codes = [h.post("gradio_api/upload", files={"files": (f"{i}.txt", f"file {i}".encode())},
                        headers={"X-Pema-Key": hosted.kb}).status_code for i in range(5)]
    assert codes == [200, 200, 200, 429, 429]  # uploads_per_owner=3 unused uploads


# --- 2. nothing a stranger sends exhausts the machine --------------------------------------------------------------
def test_preview_needs_an_identity_and_every_event_has_a_concurrency_limit(hosted):
    index = fn_indexes(hosted.blocks, "ui.api", "preview")[0]
    got = join(hosted.url, index, ["a\tb", "x.tsv", "", 0])  # raw HTTP: no cookie, no key
    assert not got["success"] and "does not say whose" in got["text"], got
    mine = join(hosted.url, index, ["a\tb", "x.tsv", "", 0], headers={"X-Pema-Key": hosted.kb})
    assert mine["success"], mine
    for blocks in hosted.served.blocks:
        for f in blocks.fns.values():
            assert f.concurrency_limit is not None, f.name
    assert hosted.blocks._queue.max_size == hosted.studio.limits.queue_size


def test_request_bodies_are_bounded(hosted):
    import httpx

    index = fn_indexes(hosted.blocks, "ui.memories", "preview_file")[0]
    body = {"data": ["Paste text", None, "x" * (hosted.studio.limits.request_bytes() + 10), None, 10],
            "fn_index": index, "session_hash": "s", "event_data": None, "trigger_id": None}
    r = httpx.post(hosted.url + "gradio_api/queue/join", json=body, headers={"X-Pema-Key": hosted.kb}, timeout=60)
    assert r.status_code == 413


def test_a_preview_or_build_past_the_sample_bound_stops_early(tmp_path):
    from ground.errors import UserError
    from studio.limits import Limits
    from studio.service import Studio

    st = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False, limits=Limits.configure(False, overrides={
        "samples": 1000}))
    try:
        text = "a line of text\n" * 200_000
        t0 = time.perf_counter()
        for call in (lambda: st.memory_service.preview(text, "x.txt"),
                     lambda: st.memory_service.submit_build(text, "x.txt")):
            with pytest.raises(UserError, match="more than 1,000 samples"):
                call()
        assert time.perf_counter() - t0 < 20
        assert not list((tmp_path / "uploads").glob("*")) if (tmp_path / "uploads").exists() else True
    finally:
        st.close()


def test_one_owner_cannot_fill_the_queue(tmp_path):
    """The guard counts the events a caller has queued or running (and those it let through a moment ago) and
    refuses one more past the bound."""
    from studio.limits import Limits
    from studio.service import Studio
    from ui.server import FileInputGuard

    st = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False, multi_user=True,
                limits=Limits.configure(True, overrides={"queued_per_owner": 2}))
    try:
        ka, kb = st.identity.new_browser_key(), st.identity.new_browser_key()
        waiting = {str(i): SimpleNamespace(request=SimpleNamespace(headers={"x-pema-key": ka}, cookies={}))
                   for i in range(2)}
        blocks = SimpleNamespace(_queue=SimpleNamespace(event_ids_to_events=waiting))
        guard = FileInputGuard(st, "/share", [blocks])
        reached = []

        async def app(scope, receive, send):
            reached.append(scope["path"])

        def call(key):
            sent = []

            async def send(m):
                sent.append(m)

            async def receive():
                return {"type": "http.request", "body": b'{"data": [], "fn_index": 0}', "more_body": False}

            asyncio.run(guard({"type": "http", "path": "/gradio_api/queue/join"}, receive, send,
                              "/gradio_api/queue/join", {"x-pema-key": key}, {}, app))
            return sent[0]["status"] if sent else 200

        assert call(ka) == 429 and call(kb) == 200 and reached == ["/gradio_api/queue/join"]
    finally:
        st.close()


def test_recent_comparisons_are_kept_per_owner(tmp_path):
    from studio import compare_service
    from studio.service import Studio

    st = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
    try:
        st.store.keep_recent("victim", {"id": "victim-1"})
        for i in range(3 * compare_service.RECENT_PER_OWNER):
            st.store.keep_recent(f"stranger-{i % 3}", {"id": f"s-{i}"})
        assert "victim-1" in st.store.recent_owners()
        assert sum(o == "stranger-0" for o in st.store.recent_owners().values()) == compare_service.RECENT_PER_OWNER
    finally:
        st.close()


def test_offsite_positions_are_bounded_and_the_429_says_a_real_wait(tiny):
    from offsite.server import ApiError, Guard, OwnerService

    svc = OwnerService(tiny)
    ids = tiny.tokenizer("hello world")["input_ids"]
    with pytest.raises(ApiError, match="holds 1000000 positions"):
        svc.fc({"sequences": [ids], "positions": [[0] * 10 ** 6]})
    with pytest.raises(ApiError, match="repeats"):
        svc.fc({"sequences": [ids], "positions": [[0, 0]]})
    guard = Guard(lambda *a: None, "t", svc.limits)
    sent = []

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "client": ("1.2.3.4", 1), "path": "/v1/info", "headers": []}
    for _ in range(20 * svc.limits.burst):
        asyncio.run(guard(scope, None, send))
        if sent[-2]["status"] == 429:
            break
    assert sent[-2]["status"] == 429
    text = sent[-1]["body"].decode()
    assert "retry after 0" not in text and "retry after 1 s" in text, text


def test_the_remote_backbone_takes_the_owners_precision(tiny):
    """An owner in another precision (float16 weight-only by default on an AVX2 CPU) announces a fingerprint with a
    precision tag; the client checks the tokenizer part and carries the owner's tag."""
    from offsite.client import RemoteBackbone
    from offsite.server import OwnerService

    info = dict(OwnerService(tiny).info())
    info["fingerprint"] = tiny.fingerprint.split("|dtype=")[0] + "|dtype=f16w"
    rb = RemoteBackbone(None, info, tiny.model.model.norm, tiny.model.lm_head, tiny.tokenizer)
    assert rb.fingerprint == info["fingerprint"]
    info["fingerprint"] = "other|d=1|dtype=f16w"
    with pytest.raises(Exception, match="does not match"):
        RemoteBackbone(None, info, tiny.model.model.norm, tiny.model.lm_head, tiny.tokenizer)


# --- 3. a copied data directory is a directory of its own ----------------------------------------------------------
def test_a_copied_data_directory_never_touches_the_original(tmp_path):
    from _server import tiny_studio

    from ground.store import Catalog
    from studio.service import Studio

    orig, copy = tmp_path / "orig", tmp_path / "copy"
    st = tiny_studio(orig)
    try:
        mid = build_tiny_memory(st)
        pid = st.jobs.wait(st.plugin_service.submit_train(mid, "knn", {}), 120)["result"]["plugin_id"]
    finally:
        st.close()
    # a catalog of the earlier format, with absolute paths (what copies of older directories hold)
    import sqlite3

    db = sqlite3.connect(orig / "studio.db")
    for table in ("memories", "plugins"):
        db.execute(f"update {table} set path = ? || '/' || path", [str(orig)])
    db.commit()
    db.close()
    shutil.copytree(orig, copy)
    st2 = Studio(copy, backbone="tiny", start_jobs=False)
    try:
        assert st2.backbone_service.wait_ready(60)
        assert [m["id"] for m in st2.memory_service.memories()] == [mid] and (copy / "memories" / mid).is_dir()
        assert Path(st2.catalog.memory(mid)["path"]).resolve() == (copy / "memories" / mid).resolve()
        assert not any("removed a folder" in r for r in st2.repairs), st2.repairs
        # a kNN plug-in: it reads its memory's keys, from the copy's own folder
        plugin = st2.plugin_service.load_plugin(pid)
        assert Path(plugin.memory_meta["path"]).resolve() == (copy / "memories" / mid).resolve()
        st2.plugin_service.delete_plugin(pid)
        st2.memory_service.delete_memory(mid)
        assert not (copy / "memories" / mid).exists()
    finally:
        st2.close()
    assert (orig / "memories" / mid / "meta.json").is_file() and (orig / "plugins" / pid).is_dir()
    assert Catalog(orig).memory(mid) is not None


def test_an_orphan_folder_is_quarantined_and_a_named_one_never_touched(tmp_path):
    from _server import tiny_studio

    from ground.store import Catalog

    st = tiny_studio(tmp_path / "d")
    try:
        mid = build_tiny_memory(st)
    finally:
        st.close()
    root = tmp_path / "d"
    orphan = root / "memories" / "mem-orphan"
    shutil.copytree(root / "memories" / mid, orphan)
    cat = Catalog(root)
    cat.db.execute("update memories set path = ? where id = ?", ["/nowhere/memories/" + mid, mid])
    cat.db.conn.commit()
    notes = cat.repair()
    assert (root / "memories" / mid / "meta.json").is_file()  # named by its row's id: re-pointed, kept
    assert cat.memory(mid)["path"] == str(root / "memories" / mid)
    assert not orphan.exists() and (root / "quarantine" / "memories" / "mem-orphan" / "meta.json").is_file()
    assert any("quarantine" in n for n in notes)


def test_a_plugin_in_a_copy_reads_its_own_directorys_memory(tmp_path):
    from plugins.base import own_memory

    orig, copy = tmp_path / "orig", tmp_path / "copy"
    for d in (orig, copy):
        (d / "memories" / "mem-1").mkdir(parents=True)
        (d / "memories" / "mem-1" / "meta.json").write_text("{}")
        (d / "plugins" / "p-1").mkdir(parents=True)
        (d / "studio.db").write_text("")
    meta = {"id": "mem-1", "path": str(orig / "memories" / "mem-1")}
    assert own_memory(copy / "plugins" / "p-1", meta)["path"] == str((copy / "memories" / "mem-1").resolve())
    assert own_memory(orig / "plugins" / "p-1", meta) == meta
    outside = {"id": "m", "path": str(tmp_path / "cli-memory")}
    assert own_memory(copy / "plugins" / "p-1", outside) == outside


# --- 4. smaller holes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("files", [{"../../../etc/hostname": "0" * 64}, {"/etc/hostname": "0" * 64},
                                   {"sub/x": "0" * 64}, {".hidden": "0" * 64}, {"plugin_config.json": 5}])
def test_the_import_manifest_is_no_path_oracle(tmp_path, files):
    from ground.errors import UserError
    from plugins.hub import EXPORT_FORMAT, EXPORT_VERSION, MANIFEST, check_package

    (tmp_path / "plugin_config.json").write_text("{}")
    (tmp_path / MANIFEST).write_text(json.dumps({"format": EXPORT_FORMAT, "version": EXPORT_VERSION,
                                                 "files": files}))
    with pytest.raises(UserError) as e:
        check_package(tmp_path)
    assert "plain files" in str(e.value) and "missing" not in str(e.value) and "match" not in str(e.value)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"format": ' + "9" * 5001 + "}", "[1, 2]",
                                  '{"format": "pema-plugin", "version": "x"}'])
def test_hostile_json_in_a_package_is_one_user_error(tmp_path, text):
    from ground.errors import UserError
    from plugins.hub import MANIFEST, check_package

    (tmp_path / "plugin_config.json").write_text("{}")
    (tmp_path / MANIFEST).write_text(text)
    with pytest.raises(UserError):
        check_package(tmp_path)


def test_a_cancel_from_a_second_process_reaches_the_running_job(tmp_path):
    from ground.jobs import JobQueue
    from ground.store import Catalog

    seen = []

    def slow(ctx):
        for _ in range(200):
            if ctx.should_stop():
                seen.append("stopped")
                from ground.errors import Cancelled
                raise Cancelled()
            time.sleep(0.05)
        return {}

    owner = JobQueue(Catalog(tmp_path), {"slow": slow})
    assert owner.acquire()
    owner.start()
    try:
        jid = owner.submit("slow", {})
        t0 = time.time()
        while owner.get(jid)["state"] != "running":
            assert time.time() - t0 < 10
            time.sleep(0.05)
        other = JobQueue(Catalog(tmp_path), {"slow": slow})  # a second process: no worker, no lock
        assert other.cancel(jid)["message"] == "Cancelling…"
        done = owner.wait(jid, 10)
        assert done["state"] == "cancelled" and seen == ["stopped"]
    finally:
        owner.stop()


def test_a_port_left_by_a_killed_server_is_free_at_once():
    """The start-up port check binds as the server does (SO_REUSEADDR), so a connection of a killed server left in
    TIME_WAIT does not refuse a restart."""
    from ui.server import _check_port

    port = free_port()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen()
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    srv.close()
    cli.close()
    _check_port("127.0.0.1", port)


def test_the_zip_import_through_the_page_takes_only_an_upload(hosted):
    index = fn_indexes(hosted.blocks, "ui.plugins", "import_plugin")[0]
    got = join(hosted.url, index, [file_data(str(hosted.export)), ""], headers={"X-Pema-Key": hosted.kb})
    assert got["status"] == 403
    assert zipfile.is_zipfile(hosted.export)  # it exists: the refusal is not "file not found"


@pytest.mark.slow
def test_sigterm_stops_the_studio_at_once_and_leaves_no_upload(tmp_path):
    """A container stops the studio with SIGTERM: it exits within seconds, its uploads gone and its data directory
    free for the next start."""
    import signal
    import subprocess
    import sys

    import httpx

    root = Path(__file__).resolve().parents[1]
    port, cache = free_port(), tmp_path / "gradio-cache"
    env = {**os.environ, "GRADIO_TEMP_DIR": str(cache), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen([sys.executable, "app.py", "--backbone", "tiny", "--port", str(port), "--multi-user",
                             "--data-dir", str(tmp_path / "d"), "--quiet"], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(300):
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        key = httpx.get(url).cookies["pema_owner"]
        r = httpx.post(url + "gradio_api/upload", files={"files": ("x.tsv", b"a\tb\n")},
                       headers={"X-Pema-Key": key}, timeout=30)
        assert r.status_code == 200 and Path(r.json()[0]).is_file()
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0 and time.time() - t0 < 10
        assert not Path(r.json()[0]).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
