"""A public studio probed as a hostile visitor and a long-running host would, round five (``--multi-user``, tiny
backbone, raw HTTP): probes the earlier rounds (``tests/test_hosting_bounds.py``, ``tests/test_hosting_security.py``,
``tests/test_server_guard.py``, ``tests/test_owners.py``) do not contain.

* Unread results are bounded by count and bytes, not only by time: a caller that joins events back to back into one
  session and never reads them, or that leaves the results of many fresh sessions unread, cannot pile them up in the
  server (each event's result waited for its caller for two minutes, and a busy session's never went at all).
* A hostile plug-in package whose hashes are consistent (the attacker writes the manifest too) but whose contents are
  not — NaN keys in a kNN datastore, LoRA weights of the wrong shape — is refused in one line that names no server
  path (the data directory's was shown, and torch's several-line message).
* No error of a hosted studio names the data directory (the page hides it in multi-user mode; a kNN plug-in whose
  memory its owner deleted said "…but /data/pema-studio/memories/mem-… is gone").
* Gradio's upload progress route keeps nothing per id once a stream ends, answers only callers with an identity and
  short ids, and keeps at most a bound of finished uploads' progress (it kept an entry for every id anyone named).
* Gradio's component server (unused: no server functions) is closed: a stranger's call made a session state.
"""
import json
import os
import time
import uuid
from types import SimpleNamespace

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from _server import TINY_PAIRS, file_data, hosted_site, owner_with_plugin  # noqa: E402

JSONL = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in TINY_PAIRS)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A multi-user studio over HTTP; owner A has a memory, a kNN and a LoRA plug-in."""
    cache, data = tmp_path_factory.mktemp("gradio-cache"), tmp_path_factory.mktemp("site")
    with hosted_site(data, cache, ["queue_size=64"]) as (studio, served, url):
        ka, owner_a, mid, knn = owner_with_plugin(studio)
        job = studio.jobs.wait(studio.plugin_service.submit_train(mid, "lora", {"max_epochs": 1}, owner=owner_a), 300)
        assert job["state"] == "done", job
        plugins = {"knn": knn, "lora": job["result"]["plugin_id"]}
        yield SimpleNamespace(studio=studio, served=served, url=url, blocks=served.blocks[0], ka=ka, owner_a=owner_a,
                              mid=mid, plugins=plugins)


def api_index(blocks, name: str) -> int:
    return next(i for i, f in blocks.fns.items() if f.api_name == name)


def unread_results(blocks) -> dict[str, int]:
    """session → bytes of the event results (``process_completed`` messages) its queue holds unread."""
    out = {}
    for session, messages in list(blocks._queue.pending_messages_per_session.items()):
        done = [m for m in list(messages._queue) if getattr(m, "msg", "") == "process_completed"]
        if done:
            out[session] = sum(len(m.model_dump_json()) for m in done)
    return out


def join_unread(url: str, index: int, data: list, session: str, key: str | None = None) -> None:
    """Join an event into ``session`` and never read its result (a 429 for too many in flight: retried)."""
    import httpx

    headers = {"X-Pema-Key": key} if key else {}
    t0 = time.time()
    while True:
        r = httpx.post(f"{url}gradio_api/queue/join", headers=headers, timeout=60,
                       json={"data": data, "fn_index": index, "session_hash": session, "event_data": None,
                             "trigger_id": None})
        if r.status_code != 429:
            assert r.status_code == 200, r.text
            return
        assert time.time() - t0 < 60, r.text
        time.sleep(0.05)


def wait_idle(blocks) -> None:
    t0 = time.time()
    while blocks._queue.event_ids_to_events:
        assert time.time() - t0 < 60, "the queue never drained"
        time.sleep(0.05)


def test_one_session_never_read_keeps_a_bounded_backlog(site):
    """Events joined back to back into one session, never read: the session is always busy, so the two-minute sweep
    never takes its messages; they must still stay within the per-session bound (before: every result stayed, about
    3 messages per event, ~0.5 MB per /memory call of a 500-sample memory)."""
    from ui import server

    key = site.studio.identity.new_browser_key()
    session, index = uuid.uuid4().hex, api_index(site.blocks, "methods")
    events = server.UNREAD_PER_SESSION  # each event sends about three messages: three times the bound in all
    for _ in range(events):
        join_unread(site.url, index, [], session, key)
    wait_idle(site.blocks)
    join_unread(site.url, index, [], session, key)  # one more starts: the backlog is trimmed as it does
    wait_idle(site.blocks)
    waiting = site.blocks._queue.pending_messages_per_session[session].qsize()
    assert 0 < waiting <= server.UNREAD_PER_SESSION + 4, waiting  # + the last event's own messages
    assert site.served.sweeper.sweep() == 0  # recent: the time sweep keeps them (for a slow reader)


def test_unread_results_of_fresh_sessions_are_bounded_in_bytes(site):
    """Raw API calls name a fresh session each; a caller (no identity needed: /methods is public, ~47 kB an answer)
    that never reads grows the server by each result for two minutes, up to Gradio's 2,000 sessions per app (a
    /shared answer can be 2 MB: 4 GB). The unread results together must stay within the byte bound, the oldest
    going first, the newest kept."""
    import httpx

    sweeper = site.served.sweeper
    old = sweeper.max_bytes
    sweeper.max_bytes = 200_000
    try:
        calls = []
        for _ in range(12):
            r = httpx.post(f"{site.url}gradio_api/call/methods", json={"data": []}, timeout=60)
            assert r.status_code == 200, r.text
            calls.append(r.json()["event_id"])
            wait_idle(site.blocks)
        time.sleep(0.2)
        httpx.post(f"{site.url}gradio_api/call/status", json={"data": []}, timeout=60)  # an event starts: trims
        wait_idle(site.blocks)
        unread = unread_results(site.blocks)
        one = max(unread.values())
        assert one > 30_000  # the answers are there, unread
        assert sum(unread.values()) <= sweeper.max_bytes + one, unread
        # the newest result is still there for its caller
        with httpx.Client(base_url=site.url, timeout=60) as h:
            with h.stream("GET", f"gradio_api/call/methods/{calls[-1]}") as stream:
                events = [line[6:].strip() for line in stream.iter_lines() if line.startswith("event:")]
        assert "complete" in events, events
    finally:
        sweeper.max_bytes = old


def test_the_unread_bounds_are_documented():
    from ui import server

    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "security.md"), encoding="utf-8").read()
    assert f"{server.UNREAD_PER_SESSION} messages" in text
    assert f"{server.UNREAD_BYTES // 1_000_000} MB" in text


def test_only_ended_events_messages_are_dropped_and_in_order():
    """A stream is read as a chain of diffs: a running event's messages must never go, whatever the bound."""
    import asyncio

    from ui import gradio_internals as gri

    def m(kind, event):
        return SimpleNamespace(msg=kind, event_id=event)

    sent = [m("process_starts", "run"), m("process_generating", "run"), m("estimation", "a"),
            m("process_completed", "a"), m("process_generating", "run"), m("process_completed", "b"),
            m("estimation", "c"), m("process_completed", "c")]
    messages = asyncio.Queue()
    for msg in sent:
        messages.put_nowait(msg)
    blocks = SimpleNamespace(_queue=SimpleNamespace(pending_messages_per_session={"s": messages}))
    assert gri.waiting_messages(blocks, "s") == 8
    assert gri.drop_ended_messages(blocks, "s", 8) == 0
    assert gri.drop_ended_messages(blocks, "s", 5) == 3  # the oldest ended ones: a's two, b's result
    left = [messages.get_nowait() for _ in range(messages.qsize())]
    assert [(x.msg, x.event_id) for x in left] == [
        ("process_starts", "run"), ("process_generating", "run"), ("process_generating", "run"),
        ("estimation", "c"), ("process_completed", "c")]
    for msg in left:
        messages.put_nowait(msg)
    assert gri.drop_ended_messages(blocks, "s", 0) == 2  # everything ended goes; the running event's stay
    assert gri.waiting_messages(blocks, "s") == 3 and gri.waiting_messages(blocks, "other") == 0
    assert gri.drop_ended_messages(object(), "s", 0) == 0


# --- hostile packages with consistent hashes ------------------------------------------------------------------------
def exported(site, method: str) -> dict[str, bytes]:
    import zipfile

    path = site.studio.plugin_service.export_plugin_zip(site.plugins[method], owner=site.owner_a,
                                                        include_datastore=method == "knn")
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def rehashed(files: dict[str, bytes]) -> bytes:
    """The package zipped with every SHA-256 its plugin_config.json and manifest record made to fit again (what an
    attacker who edits a file does)."""
    import hashlib
    import io
    import zipfile

    def named(name):
        return next(n for n in files if n.endswith("/" + name))

    config = json.loads(files[named("plugin_config.json")])
    for name, record in (config.get("files") or {}).items():
        record["sha256"] = hashlib.sha256(files[named(name)]).hexdigest()
        record["bytes"] = len(files[named(name)])
    files = {**files, named("plugin_config.json"): json.dumps(config).encode()}
    manifest = json.loads(files[named("pema_export.json")])
    for name in manifest.get("files") or {}:
        manifest["files"][name] = hashlib.sha256(files[named(name)]).hexdigest()
    files[named("pema_export.json")] = json.dumps(manifest).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def with_tensors(files: dict[str, bytes], name: str, change) -> dict[str, bytes]:
    from safetensors.numpy import load, save

    full = next(n for n in files if n.endswith("/" + name))
    tensors = load(files[full])
    change(tensors)
    return {**files, full: save(tensors)}


def nan_keys(tensors):
    import numpy as np

    tensors["keys"] = np.full_like(tensors["keys"], np.nan)


def wrong_shape(tensors):
    import numpy as np

    tensors[sorted(tensors)[-1]] = np.zeros((3,), np.float32)


@pytest.mark.parametrize("method, file, change", [("knn", "datastore.safetensors", nan_keys),
                                                  ("lora", "plugin_model.safetensors", wrong_shape)],
                         ids=["knn NaN keys", "lora wrong shape"])
def test_a_package_with_consistent_hashes_and_bad_contents_is_one_line_without_server_paths(
        site, method, file, change, tmp_path, monkeypatch):
    import tempfile

    import httpx

    # the data directory outside the temporary folder, as on the Space (/data/pema-studio)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = rehashed(with_tensors(exported(site, method), file, change))
    before = (site.studio.catalog.count("plugins"), site.studio.catalog.count("memories"))
    r = httpx.post(site.url + "gradio_api/upload", files=[("files", ("pkg.zip", data))],
                   headers={"X-Pema-Key": site.ka}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(site.url + "gradio_api/call/import_plugin", json={"data": [file_data(r.json()[0]), ""]},
                   headers={"X-Pema-Key": site.ka}, timeout=60)
    assert r.status_code == 200, r.text
    with httpx.Client(base_url=site.url, headers={"X-Pema-Key": site.ka}, timeout=120) as h:
        with h.stream("GET", f"gradio_api/call/import_plugin/{r.json()['event_id']}") as stream:
            lines = list(stream.iter_lines())
    assert "event: error" in lines, lines
    message = json.loads(lines[lines.index("event: error") + 1][5:])["error"]
    assert "damaged" in message, message
    assert "\n" not in message and "\t" not in message, message
    root = str(site.studio.root)
    for path in (root, os.path.realpath(root), str(tmp_path), tempfile.gettempdir(), "/memories/", "pema-import"):
        assert path not in message, (path, message)
    assert (site.studio.catalog.count("plugins"), site.studio.catalog.count("memories")) == before


def test_no_error_names_the_data_directory(site, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the data directory outside it, as on the Space
    key = site.studio.identity.new_browser_key()
    owner = site.studio.identity.owner_of_key(key)
    mid = site.studio.jobs.wait(site.studio.memory_service.submit_build(JSONL, "b.jsonl", owner=owner),
                                120)["result"]["memory_id"]
    pid = site.studio.jobs.wait(site.studio.plugin_service.submit_train(mid, "knn", {}, owner=owner),
                                120)["result"]["plugin_id"]
    site.studio.memory_service.delete_memory(mid, owner=owner)
    status, event, payload = call(site.url, "compare", ["the house", "translation", ["base", pid], {}, 4], key)
    assert (status, event) == (200, "error"), (status, event, payload)
    message = payload["error"]
    assert "is gone" in message, message
    for path in (str(site.studio.root), os.path.realpath(site.studio.root), "/memories/"):
        assert path not in message, (path, message)


def call(url: str, api: str, data: list, key: str) -> tuple[int, str, object]:
    """``POST …/gradio_api/call/<api>`` and its result stream: (status, event, payload)."""
    import httpx

    with httpx.Client(base_url=url, headers={"X-Pema-Key": key}, timeout=120) as h:
        r = h.post(f"gradio_api/call/{api}", json={"data": data})
        if r.status_code != 200:
            return r.status_code, "", r.text
        with h.stream("GET", f"gradio_api/call/{api}/{r.json()['event_id']}") as stream:
            lines = list(stream.iter_lines())
    events = [line[6:].strip() for line in lines if line.startswith("event:")]
    data_lines = [json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip() != "null"]
    return 200, events[-1] if events else "", data_lines[-1] if data_lines else None


# --- Gradio's upload progress --------------------------------------------------------------------------------------
def progress_tables():
    from gradio.routes import file_upload_statuses

    return file_upload_statuses._statuses, file_upload_statuses._signals


def test_upload_progress_asked_for_unknown_ids_keeps_nothing(site):
    """``GET …/upload_progress?upload_id=<id>`` (a GET: no identity needed) left an entry in Gradio's progress
    signals for every id anyone named, forever (600 requests with 16 kB ids: +600 entries)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    _, signals = progress_tables()
    before = len(signals)
    key = site.studio.identity.new_browser_key()

    def ask(i):
        return httpx.get(site.url + "gradio_api/upload_progress", params={"upload_id": f"probe{i}x"},
                         headers={"X-Pema-Key": key}, timeout=30).status_code

    with ThreadPoolExecutor(20) as pool:
        codes = set(pool.map(ask, range(20)))
    assert codes == {404}
    assert len(signals) <= before, len(signals) - before
    # an id that is not a short token, or a caller with no identity: refused at once, nothing kept
    long_id = httpx.get(site.url + "gradio_api/upload_progress", params={"upload_id": "x" * 5000},
                        headers={"X-Pema-Key": key}, timeout=30)
    nobody = httpx.get(site.url + "gradio_api/upload_progress", params={"upload_id": "abc"}, timeout=30)
    assert long_id.status_code == 404 and nobody.status_code == 404
    assert len(signals) <= before


def test_an_upload_with_its_progress_stream_still_works_and_leaves_nothing(site):
    """What the page does for a file input: the progress stream opened first, then the upload with the same id."""
    import threading

    import httpx

    statuses, signals = progress_tables()
    key = site.studio.identity.new_browser_key()
    messages = []

    def stream():
        with httpx.Client(timeout=30) as h:
            with h.stream("GET", site.url + "gradio_api/upload_progress", params={"upload_id": "pageupload1"},
                          headers={"X-Pema-Key": key}) as r:
                messages.append(r.status_code)
                messages.extend(line for line in r.iter_lines() if line.startswith("data:"))

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    r = httpx.post(site.url + "gradio_api/upload", params={"upload_id": "pageupload1"}, timeout=60,
                   files=[("files", ("a.tsv", b"the cat\tdie Katze\n" * 4))], headers={"X-Pema-Key": key})
    t.join(30)
    assert r.status_code == 200 and len(r.json()) == 1, r.text
    assert messages and messages[0] == 200 and any('"done"' in m for m in messages[1:]), messages
    t0 = time.time()  # the server forgets the id once its stream's response has ended, a moment after the client
    while "pageupload1" in signals or "pageupload1" in statuses:
        assert time.time() - t0 < 10, (signals, statuses)
        time.sleep(0.05)
    # an upload whose progress nobody reads leaves its (finished) status behind only within a bound
    bad = httpx.post(site.url + "gradio_api/upload", params={"upload_id": "y" * 5000}, timeout=60,
                     files=[("files", ("b.tsv", b"x\ty\n"))], headers={"X-Pema-Key": key})
    assert bad.status_code == 400, bad.text


def test_gradios_upload_progress_tables_are_bounded():
    from gradio.route_utils import FileUploadProgress

    from ui import gradio_internals as gri

    progress = FileUploadProgress()
    for i in range(6):
        progress.track(f"done{i}")
        progress.set_done(f"done{i}")
    progress.track("running")
    for i in range(6):
        progress._signals[f"asked{i}"]  # a progress stream asked about an id no upload carries
    gri.forget_upload_progress("asked5", keep=3, progress=progress)
    assert "asked5" not in progress._signals and "running" in progress._statuses
    assert [k for k, st in progress._statuses.items() if st.is_done] == ["done3", "done4", "done5"]  # the newest
    assert len(progress._signals) <= 3 + len(progress._statuses)
    assert all(k in progress._signals for k in progress._statuses)  # a tracked upload keeps its signal


# --- Gradio's component server ---------------------------------------------------------------------------------------
def server_functions(blocks) -> list:
    return [(type(b).__name__, getattr(f, "__name__", "?")) for b in blocks.blocks.values()
            for f in getattr(b, "server_fns", None) or []]


def test_the_component_server_route_is_closed_and_makes_no_session(site):
    """``POST …/component_server`` (no identity needed: not an event) made a Gradio session state (a copy of the
    studio's page config, ~1.2 MB) for every session hash it named (100 calls: +100 sessions, +122 MB), pushing real
    tabs' sessions out of the ``sessions`` bound, and answered 500 with a traceback on the share page. No component
    of either app has a server function, so the route answers 404 before Gradio sees the request."""
    import httpx

    assert server_functions(site.blocks) == [] and server_functions(site.served.blocks[1]) == []
    key = site.studio.identity.new_browser_key()
    before = [len(b.state_holder.session_data) for b in site.served.blocks]
    for prefix in ("", "share/"):
        for headers in ({}, {"X-Pema-Key": key}):
            for _ in range(5):
                r = httpx.post(f"{site.url}{prefix}gradio_api/component_server", headers=headers, timeout=30,
                               json={"session_hash": uuid.uuid4().hex, "component_id": 1, "fn_name": "ls",
                                     "data": None})
                assert r.status_code == 404, r.text
    assert [len(b.state_holder.session_data) for b in site.served.blocks] == before
