"""A public studio probed as an attacker would, over raw HTTP (on the tiny backbone, ``--multi-user``): bounds hold
under concurrency and within one request, no file is served to anyone but its owner whatever route, prefix or
encoding asks for it, another site's page gets no credentialed access, unused Gradio routes answer 404, the offsite
service authenticates before it counts, and hostile packages and requests get one clean line.
"""
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from _server import (  # noqa: E402
    TINY_PAIRS,
    event_inputs,
    file_data,
    files_under,
    fn_indexes,
    hosted_site,
    join,
    owner_with_plugin,
)

JSONL = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in TINY_PAIRS)
EVIL = ("https://evil.example", "null")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A multi-user studio over HTTP (queue of 64), its own Gradio folder; owner A has a memory and a kNN plug-in."""
    cache, data = tmp_path_factory.mktemp("gradio-cache"), tmp_path_factory.mktemp("site")
    with hosted_site(data, cache, ["queue_size=64"]) as (studio, served, url):
        ka, owner_a, mid, pid = owner_with_plugin(studio)
        kb = studio.identity.new_browser_key()
        yield SimpleNamespace(studio=studio, served=served, url=url, ka=ka, kb=kb, owner_a=owner_a, mid=mid,
                              pid=pid, cache=cache, data=data, blocks=served.blocks[0])


def upload(url: str, files: list, key: str | None = None, cookie: str | None = None):
    import httpx

    return httpx.post(url + "gradio_api/upload", files=[("files", f) for f in files], timeout=60,
                      headers={"X-Pema-Key": key} if key else {}, cookies={"pema_owner": cookie} if cookie else {})


def call(url: str, api: str, data: list, key: str | None, prefix: str = "") -> tuple[int, str, object]:
    """``POST …/gradio_api/call/<api>`` and its result stream: (status, event, payload)."""
    import httpx

    headers = {"X-Pema-Key": key} if key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as h:
        r = h.post(f"{prefix}gradio_api/call/{api}", json={"data": data})
        if r.status_code != 200:
            return r.status_code, "", r.text
        event, payload = "", None
        with h.stream("GET", f"{prefix}gradio_api/call/{api}/{r.json()['event_id']}") as stream:
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event in ("complete", "error"):
                    payload = json.loads(line[5:]) if line[5:].strip() not in ("", "null") else None
                    return 200, event, payload
    return 200, event, payload


def drain(site, timeout: float = 120) -> None:
    t0 = time.time()
    while any(b._queue.event_ids_to_events for b in site.served.blocks):
        assert time.time() - t0 < timeout, "the queue never drained"
        time.sleep(0.1)


@pytest.fixture
def busy_decoder(site, monkeypatch):
    """The decoder is busy: every comparison waits for the gate (opened, and the queue drained, at the end)."""
    gate, running = threading.Event(), threading.Event()
    real = site.studio.compare_service.compare

    def compare(*args, **kwargs):
        running.set()
        gate.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(site.studio.compare_service, "compare", compare)
    yield running
    gate.set()
    drain(site)


COMPARE = ["the cat sleeps", "translation", ["base"], {}, 4, 1, 0]


def compare_data(site) -> list:
    """The /compare endpoint's inputs: a short sentence, the base model, 4 new tokens; later parameters' defaults."""
    fn = next(f for f in site.blocks.fns.values() if f.api_name == "compare")
    return COMPARE + [None] * (len(fn.inputs) - len(COMPARE))


# --- 1. the per-owner queue bound holds under concurrency; one owner cannot fill the queue --------------------------
def test_forty_concurrent_calls_from_one_key_admit_at_most_the_cap(site, busy_decoder):
    import httpx

    cap = site.studio.limits.owner_queue_cap()
    assert cap == 16
    data = compare_data(site)
    first = threading.Thread(target=call, args=(site.url, "compare", data, site.ka), daemon=True)
    first.start()
    assert busy_decoder.wait(60)

    def post(_):
        return httpx.post(site.url + "gradio_api/call/compare", json={"data": data},
                          headers={"X-Pema-Key": site.ka}, timeout=60).status_code

    with ThreadPoolExecutor(40) as pool:
        codes = list(pool.map(post, range(40)))
    assert codes.count(200) == cap - 1 and codes.count(429) == 40 - (cap - 1), codes
    assert post(0) == 429
    assert httpx.post(site.url + "gradio_api/call/compare", json={"data": data},
                      headers={"X-Pema-Key": site.kb}, timeout=60).status_code == 200  # another owner is served


def test_a_hundred_concurrent_joins_from_one_key_leave_room_for_others(site, busy_decoder):
    import httpx

    index = next(i for i, f in site.blocks.fns.items() if f.api_name == "compare")
    data = compare_data(site)
    first = threading.Thread(target=call, args=(site.url, "compare", data, site.kb), daemon=True)
    first.start()
    assert busy_decoder.wait(60)

    def join_(key):
        return httpx.post(site.url + "gradio_api/queue/join", timeout=60, headers={"X-Pema-Key": key},
                          json={"data": data, "fn_index": index, "session_hash": uuid.uuid4().hex,
                                "event_data": None, "trigger_id": None}).status_code

    with ThreadPoolExecutor(50) as pool:
        codes = list(pool.map(join_, [site.ka] * 100))
    assert codes.count(200) <= site.studio.limits.owner_queue_cap() and set(codes) == {200, 429}, codes
    assert len(site.blocks._queue) < site.studio.limits.queue_size
    others = [join_(site.studio.identity.new_browser_key()) for _ in range(3)]
    assert others == [200, 200, 200]  # not 503: the queue is not full


# --- 2. one upload request cannot pass the upload bound; nothing of a refused one is stored ------------------------
def test_one_upload_request_cannot_carry_more_files_than_the_bound(site):
    key = site.studio.identity.new_browser_key()
    bound = site.studio.limits.uploads_per_owner
    before = files_under(site.cache)
    r = upload(site.url, [(f"{i}.txt", f"part {i}".encode()) for i in range(40)], key)
    assert r.status_code == 429 and "limit per user is 8" in r.text
    assert files_under(site.cache) == before  # refused before Gradio stored any part
    r = upload(site.url, [(f"{i}.txt", f"part {i}".encode()) for i in range(3)], key)
    assert r.status_code == 200 and len(set(r.json())) == 3 and all(Path(p).is_file() for p in r.json())
    with ThreadPoolExecutor(20) as pool:  # concurrent requests of one owner: the bound still holds
        codes = list(pool.map(lambda i: upload(site.url, [(f"c{i}.txt", f"c {i}".encode())], key).status_code,
                              range(20)))
    assert codes.count(200) == bound - 3 and codes.count(429) == 20 - (bound - 3), codes
    r = upload(site.url, [(f"{i}.txt", b"x") for i in range(40)], site.studio.identity.new_browser_key())
    assert r.status_code == 429


# --- 3. uploads are their owner's: identical bytes never share a path ----------------------------------------------
def test_identical_uploads_of_two_owners_never_collide(site):
    src = b"the house is small\tdas Haus ist klein\n"
    kc, kd = site.studio.identity.new_browser_key(), site.studio.identity.new_browser_key()
    with ThreadPoolExecutor(2) as pool:
        rc, rd = pool.map(lambda k: upload(site.url, [("same.tsv", src)], k), (kc, kd))
    pc, pd = rc.json()[0], rd.json()[0]
    assert pc != pd and Path(pc).read_bytes() == Path(pd).read_bytes() == src
    owners = site.studio.identity.owner_of_key
    assert site.studio.uploads.owns(pc, {owners(kc)}) and not site.studio.uploads.owns(pc, {owners(kd)})
    build = fn_indexes(site.blocks, "ui.memories", "do_build")[0]
    got = join(site.url, build, with_choices(site.blocks, build, file_data(pd)), headers={"X-Pema-Key": kd})
    assert got["success"], got["text"]
    assert not Path(pd).exists()  # D's build consumed D's upload…
    preview = fn_indexes(site.blocks, "ui.memories", "preview_file")[0]
    got = join(site.url, preview, event_inputs(site.blocks, preview, file_data(pc)), headers={"X-Pema-Key": kc})
    assert got["success"] and "das Haus" in got["text"], got  # …and C's is still C's


def with_choices(blocks, index: int, file_value: dict) -> list:
    """``event_inputs`` with each dropdown at its first choice (a build needs its task)."""
    import gradio as gr

    out = event_inputs(blocks, index, file_value)
    for i, comp in enumerate(blocks.fns[index].inputs):
        if isinstance(comp, gr.Dropdown) and comp.choices:
            out[i] = comp.choices[0][1]
    return out


# --- 5. every file route answers only the file's owner ----------------------------------------------------------------
def variants(path: str) -> list[str]:
    p = Path(path)
    dotted = f"{p.parent}/../{p.parent.name}/{p.name}"
    return ["gradio_api/file=" + path, "gradio_api/file/" + path, "share/gradio_api/file=" + path,
            "/gradio_api/file=" + path, "gradio_api//file=" + path, "gradio_api/file=" + dotted,
            "gradio_api/file=" + quote(path, safe=""), "gradio_api/file%3D" + quote(path, safe=""),
            "gradio_api/file=" + path.replace("/", "//"), "file=" + path, "share/gradio_api/file/" + path,
            "gradio_api/file=" + quote(quote(path, safe=""), safe=""), "gradio_api/FILE=" + path]


def fetch(url: str, route: str, method: str = "GET", **kw):
    import httpx

    with httpx.Client(timeout=30) as h:  # the route exactly as written (no normalisation by the client)
        return h.send(h.build_request(method, httpx.URL(url.rstrip("/") + "/" + route.lstrip("/")), **kw))


def test_an_upload_is_served_to_its_owner_alone_by_every_route(site):
    content = b"a secret sample\tein geheimes Beispiel\n"
    path = upload(site.url, [("mine.tsv", content)], site.ka).json()[0]
    strangers = [{}, {"headers": {"X-Pema-Key": site.kb}}, {"cookies": {"pema_owner": site.kb}},
                 {"headers": {"X-Pema-Key": "pk1.a.forged.x"}}]
    for route in variants(path):
        for kw in strangers:
            for method in ("GET", "HEAD"):
                r = fetch(site.url, route, method, **kw)
                assert r.status_code == 404 and b"geheim" not in r.content, (route, kw, method, r.status_code)
            r = fetch(site.url, route, headers={**kw.get("headers", {}), "Range": "bytes=0-5"},
                      cookies=kw.get("cookies"))
            assert r.status_code == 404 and b"secret" not in r.content
        r = fetch(site.url, route, headers={"X-Pema-Key": site.ka})
        assert r.status_code == 200 and r.content == content, route
    r = fetch(site.url, variants(path)[0], headers={"X-Pema-Key": site.ka, "Range": "bytes=2-7"})
    assert r.status_code == 206 and r.content == content[2:8]
    assert r.headers["content-disposition"].startswith("attachment")  # never rendered in the studio's origin
    r = fetch(site.url, variants(path)[0], cookies={"pema_owner": site.ka})  # the owner's browser
    assert r.status_code == 200
    for other in (str(site.data / "owner-secret"), "/etc/passwd", "https://example.com/x",
                  str(Path(path).parent.parent)):
        assert fetch(site.url, "gradio_api/file=" + other, headers={"X-Pema-Key": site.ka}).status_code == 404


def test_an_export_is_served_to_its_owner_alone(site):
    status, event, payload = call(site.url, "export_plugin", [site.pid, True], site.ka)
    assert status == 200 and event == "complete", (status, event, payload)
    out = payload[0]
    url, path = out["url"], out["path"]
    assert "/gradio_api/file=" in url and Path(path).is_file()
    for kw in ({}, {"headers": {"X-Pema-Key": site.kb}}, {"cookies": {"pema_owner": site.kb}}):
        for route in variants(path):
            assert fetch(site.url, route, **kw).status_code == 404, (route, kw)
    import httpx

    r = httpx.get(url, headers={"X-Pema-Key": site.ka}, timeout=30)
    assert r.status_code == 200 and zipfile.ZipFile(io.BytesIO(r.content)).namelist()
    downloads = site.studio.downloads.downloads_root()
    theirs = next(downloads.rglob("*.zip"))
    assert fetch(site.url, "gradio_api/file=" + str(theirs), headers={"X-Pema-Key": site.ka}).status_code == 404


# --- 6. unused routes: 404, nothing written ---------------------------------------------------------------------------
def test_unused_gradio_routes_answer_404(site):
    import httpx

    session = uuid.uuid4().hex
    join(site.url, fn_indexes(site.blocks, "ui.api", "preview")[0], ["a\tb", "x.tsv", "", 0],
         headers={"X-Pema-Key": site.ka})
    for route in ("gradio_api/deep_link?session_hash=" + session, "share/gradio_api/deep_link?session_hash=x",
                  "gradio_api//deep_link?session_hash=x", "gradio_api/deep%5Flink?session_hash=x",
                  "config?deep_link=abc", "share/config?deep_link=abc", "gradio_api/proxy=https://example.com/",
                  "gradio_api/monitoring", "gradio_api/runs", "gradio_api/stream/x/y/1/playlist.m3u8",
                  "gradio_api/vibe-code"):
        for method in ("GET", "POST"):
            r = fetch(site.url, route, method, headers={"X-Pema-Key": site.ka})
            assert r.status_code == 404, (route, method, r.status_code)
    assert not list(site.cache.rglob("deep_links"))
    assert httpx.get(site.url + "config", timeout=30).status_code == 200


# --- 7. no credentialed cross-origin access ---------------------------------------------------------------------------
def test_another_sites_page_gets_no_credentialed_access(site):
    import httpx

    index = next(i for i, f in site.blocks.fns.items() if f.api_name == "compare")
    data = compare_data(site)
    body = {"data": data, "fn_index": index, "session_hash": "s" * 10, "event_data": None, "trigger_id": None}
    cookie = {"pema_owner": site.ka}
    for origin in EVIL:
        hdrs = {"Origin": origin}
        with httpx.Client(base_url=site.url, timeout=30, cookies=cookie) as h:
            r = h.get("config", headers=hdrs)
            assert r.status_code == 200 and not [k for k in r.headers if k.lower().startswith("access-control")]
            assert "set-cookie" not in r.headers
            with h.stream("GET", "gradio_api/queue/data", params={"session_hash": "s" * 10}, headers=hdrs) as r:
                assert not [k for k in r.headers if k.lower().startswith("access-control")]
            for route in ("gradio_api/queue/join", "gradio_api/call/compare", "gradio_api/upload"):
                r = h.post(route, json=body, headers=hdrs)
                assert r.status_code == 403 and site.ka not in r.text, (origin, route)
                r = h.options(route, headers={**hdrs, "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "content-type"})
                assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        r = httpx.post(site.url + "gradio_api/queue/join", json=body, timeout=30,
                       headers={"Origin": origin, "X-Pema-Key": site.ka})
        assert r.status_code == 403
    same = httpx.post(site.url + "gradio_api/call/compare", json={"data": data}, timeout=30,
                      headers={"Origin": site.url.rstrip("/"), "X-Pema-Key": site.ka})
    assert same.status_code == 200 and "access-control-allow-credentials" not in same.headers
    drain(site)


def test_an_allowed_origin_may_call_with_its_key_but_never_with_the_cookie(site):
    from starlette.testclient import TestClient

    from ui.server import OwnerCookieMiddleware

    seen = []

    async def gradio_like(scope, receive, send):  # reflects any origin with credentials, as Gradio does
        seen.append(dict(scope["headers"]).get(b"cookie"))
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"access-control-allow-origin", b"https://evil.example"),
            (b"access-control-allow-credentials", b"true"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = OwnerCookieMiddleware(gradio_like, site.studio, allow_origins=["https://partner.example"])
    client = TestClient(mw, base_url="http://studio.test")
    cookie = {"Cookie": f"pema_owner={site.ka}"}
    r = client.get("/config", headers={"Origin": "https://partner.example", **cookie})
    assert r.headers["access-control-allow-origin"] == "https://partner.example"
    assert "access-control-allow-credentials" not in r.headers and seen[-1] is None and "set-cookie" not in r.headers
    r = client.options("/gradio_api/call/compare", headers={"Origin": "https://partner.example",
                                                            "Access-Control-Request-Method": "POST"})
    assert r.status_code == 204 and "x-pema-key" in r.headers["access-control-allow-headers"]
    r = client.get("/config", headers={"Origin": "https://evil.example", **cookie})
    assert "access-control-allow-origin" not in r.headers and seen[-1] is None
    r = client.get("/config", headers={"Origin": "http://studio.test", **cookie})  # the studio's own page
    assert "access-control-allow-origin" not in r.headers and seen[-1] == f"pema_owner={site.ka}".encode()
    r = client.get("/config", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", **cookie})
    assert seen[-1] is None  # an <img> or <script> of another site: no Origin, but the browser says cross-site


# --- 4. offsite: authenticate, then count --------------------------------------------------------------------------
def test_offsite_strangers_cannot_spend_the_token_holders_requests(tiny):
    from starlette.testclient import TestClient

    from offsite.protocol import Limits
    from offsite.server import OwnerService, make_app

    client = TestClient(make_app(OwnerService(tiny, Limits(rate=1.0, burst=50)), "owner-token"))
    codes = [client.get("/v1/info").status_code for _ in range(600)]
    assert 50 <= codes.count(401) < 60 and codes[-1] == 429  # strangers are limited…
    codes = [client.get("/v1/info", headers={"Authorization": "Bearer wrong"}).status_code for _ in range(5)]
    assert set(codes) == {429}  # …wrong tokens with them…
    r = client.get("/v1/info", headers={"Authorization": "Bearer owner-token"})
    assert r.status_code == 200, r.text  # …and the token holder at the same address is not


# --- smaller items ----------------------------------------------------------------------------------------------------
def test_an_unknown_event_or_endpoint_is_a_clean_404_on_both_apps(site):
    import httpx

    for prefix in ("", "share/"):
        for route, body in (("gradio_api/queue/join", {"data": [], "fn_index": 99999, "session_hash": "x"}),
                            ("gradio_api/call/no_such_api", {"data": []}),
                            ("gradio_api/call/v2/no_such_api", {}),
                            ("gradio_api/run/no_such_api", {"data": []})):
            r = httpx.post(site.url + prefix + route, json=body, headers={"X-Pema-Key": site.ka}, timeout=30)
            assert r.status_code == 404 and "No such event" in r.json()["detail"], (prefix, route, r.text)
    # the page's own events without a queue go to run/predict with their fn_index: that name is Gradio's, not an API's
    known = min(site.blocks.fns)
    r = httpx.post(site.url + "gradio_api/run/predict", json={"data": [], "fn_index": known, "session_hash": "x"},
                   headers={"X-Pema-Key": site.ka}, timeout=30)
    assert r.status_code != 404 or "No such event" not in r.text, r.text
    r = httpx.post(site.url + "gradio_api/run/predict", json={"data": [], "fn_index": 99999, "session_hash": "x"},
                   headers={"X-Pema-Key": site.ka}, timeout=30)
    assert r.status_code == 404 and "No such event" in r.text, r.text


def test_a_file_value_without_its_marker_is_a_clean_400(site):
    path = upload(site.url, [("x.tsv", b"a\tb\n")], site.ka).json()[0]
    index = fn_indexes(site.blocks, "ui.memories", "preview_file")[0]
    got = join(site.url, index, event_inputs(site.blocks, index, {"path": path}), headers={"X-Pema-Key": site.ka})
    assert got["status"] == 400 and "FileData" in got["text"], got
    got = join(site.url, index, event_inputs(site.blocks, index, {"path": path, "meta": None}),
               headers={"X-Pema-Key": site.ka})
    assert got["status"] == 400


def zipped(files: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def damaged_export(site) -> bytes:
    """A's real export with one weight byte changed (its manifest hash no longer matches)."""
    src = zipfile.ZipFile(site.studio.plugin_service.export_plugin_zip(site.pid, owner=site.owner_a,
                                                                       include_datastore=True))
    files = {n: src.read(n) for n in src.namelist()}
    name = next(n for n in files if n.endswith("plugin_model.safetensors"))
    files[name] = files[name][:-1] + bytes([files[name][-1] ^ 1])
    return zipped(files)


@pytest.mark.parametrize("kind", ["deep config", "deep jsonl", "pickle with a space", "pickle upper case",
                                  "pickle with a dot", "pickle inside", "damaged"])
def test_a_hostile_package_is_one_line_frees_its_upload_and_shows_no_server_path(site, kind):
    deep = b"[" * 100_000 + b"]" * 100_000
    base = {"p/plugin_config.json": b"{}", "p/pema_export.json": b"{}"}
    data = {"deep config": lambda: zipped({**base, "p/plugin_config.json": deep}),
            "deep jsonl": lambda: zipped({**base, "p/datastore_samples.jsonl": b'{"a": 1}\n' + deep}),
            "pickle with a space": lambda: zipped({**base, "p/x.pkl ": b"x"}),
            "pickle upper case": lambda: zipped({**base, "p/x.PKL": b"x"}),
            "pickle with a dot": lambda: zipped({**base, "p/x.pkl.": b"x"}),
            "pickle inside": lambda: zipped({**base, "p/x.pkl.txt": b"x"}),
            "damaged": lambda: damaged_export(site)}[kind]()
    before = site.studio.catalog.count("plugins")
    path = upload(site.url, [("pkg.zip", data)], site.ka).json()[0]
    status, event, payload = call(site.url, "import_plugin", [file_data(path), ""], site.ka)
    assert status == 200 and event == "error", (status, event, payload)
    message = payload.get("error") if isinstance(payload, dict) else payload
    assert message and "\n" not in message and "Traceback" not in message and "recursion" not in message
    assert tempfile.gettempdir() not in message and "pema-import" not in message, message
    if kind == "damaged":
        assert "does not match its SHA-256" in message
    assert site.studio.catalog.count("plugins") == before
    assert not site.studio.uploads.owns(path, {site.owner_a}) and not Path(path).exists()  # the upload is freed


def test_leftover_download_folders_are_swept_at_start(tmp_path, site):
    from studio.uploads import sweep_downloads

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folders = {n: tmp_path / f"pema-downloads-{n}" for n in ("killed", "live", "old", "new", "other-host")}
        for f in folders.values():
            (f / "owner").mkdir(parents=True)
            (f / "owner" / "pema-eval-x.json").write_text("{}")
        for name, who in (("killed", dead.pid), ("live", live.pid)):
            folders[name].with_name(folders[name].name + ".owner").write_text(f"{_host()} {who}\n")
        folders["other-host"].with_name(folders["other-host"].name + ".owner").write_text("elsewhere 1\n")
        os.utime(folders["old"], (time.time() - 3 * 24 * 3600,) * 2)
        removed = sweep_downloads(None, tmp_path)
        assert sorted(Path(p).name for p in removed) == ["pema-downloads-killed", "pema-downloads-old"]
        assert not folders["killed"].exists() and not folders["old"].exists()
        assert not (tmp_path / "pema-downloads-killed.owner").exists()
        assert all(folders[n].is_dir() for n in ("live", "new", "other-host"))
    finally:
        live.kill()
        live.wait()
    mine = site.studio.downloads.downloads_root()  # the running studio marked its own folder at start
    marker = mine.with_name(mine.name + ".owner")
    assert marker.read_text().split() == [_host(), str(os.getpid())]


def _host() -> str:
    from ground.lock import host

    return host()
