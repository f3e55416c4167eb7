"""What the tests that serve a studio share: a studio on 127.0.0.1 for tests that go through its HTTP API
(``gradio_client``; ``app.start(..., block=False)`` on a free port, tiny backbone), a public multi-user site with its
own Gradio upload folder and the raw-HTTP helpers that probe it (``tests/test_server_guard.py``,
``tests/test_hosting_security.py``), and Debian's headless Chromium with a page that fails on JavaScript errors
(``tests/test_browser.py``, ``tests/test_rank_browser.py``)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(data_dir: Path, backbone: str = "tiny", extra: list[str] | None = None):
    """``(studio, served, url)`` of a studio serving ``data_dir`` (``served.close()`` and ``studio.close()``
    stop it)."""
    import app

    return app.start(["--backbone", backbone, "--data-dir", str(data_dir), "--port", str(free_port()), "--quiet",
                      *(extra or [])], block=False)


def wait_job(client, job_id: str, timeout: float = 120, poll: float = 0.2) -> dict:
    """Poll ``/job`` until the job is neither queued nor running (the way a client script does)."""
    t0 = time.time()
    while True:
        job = client.predict(job_id, api_name="/job")
        if job["state"] not in ("queued", "running"):
            return job
        assert time.time() - t0 < timeout, f"job {job_id} still {job['state']} after {timeout}s: {job['message']}"
        time.sleep(poll)


TINY_PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
              ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3


def tiny_studio(data_dir: Path):
    """A ``studio.service.Studio`` on the tiny backbone, ready (the caller closes it)."""
    from studio.service import Studio

    st = Studio(data_dir, backbone="tiny")
    assert st.backbone_service.wait_ready(120), st.backbone_service.status()
    return st


def build_tiny_memory(studio, pairs=TINY_PAIRS, name: str = "pairs") -> str:
    """Build a memory from sentence pairs through the studio's job (as an upload of a TSV would); its id."""
    tsv = "\n".join(f"{s}\t{t}" for s, t in pairs)
    job = studio.jobs.wait(studio.memory_service.submit_build(tsv, "pairs.tsv", name=name), 120)
    assert job["state"] == "done", job
    return job["result"]["memory_id"]


# --- a public multi-user site, probed over raw HTTP ------------------------------------------------------------------

def owner_with_plugin(studio, method: str = "knn", config: dict | None = None, pairs=TINY_PAIRS):
    """``(key, owner, memory id, plug-in id)``: a new browser key whose owner built a memory from ``pairs`` (a JSONL
    upload) and trained ``method`` on it."""
    key = studio.identity.new_browser_key()
    owner = studio.identity.owner_of_key(key)
    jsonl = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in pairs)
    build = studio.jobs.wait(studio.memory_service.submit_build(jsonl, "a.jsonl", owner=owner), 120)
    assert build["state"] == "done", build
    mid = build["result"]["memory_id"]
    job = studio.jobs.wait(studio.plugin_service.submit_train(mid, method, config or {}, owner=owner), 300)
    assert job["state"] == "done", job
    return key, owner, mid, job["result"]["plugin_id"]


@contextlib.contextmanager
def hosted_site(data_dir: Path, cache: Path, limits: list[str]):
    """``(studio, served, url)`` of a multi-user studio on the tiny backbone serving ``data_dir``, with ``cache`` as
    its Gradio upload folder (``$GRADIO_TEMP_DIR``, restored afterwards) and ``--limit`` values ``limits``
    (``["queue_size=64"]``); ready when entered, stopped on exit."""
    import app

    old = os.environ.get("GRADIO_TEMP_DIR")
    os.environ["GRADIO_TEMP_DIR"] = str(cache)
    limit_args = [a for value in limits for a in ("--limit", value)]
    studio, served, url = app.start(["--backbone", "tiny", "--multi-user", "--port", str(free_port()), "--quiet",
                                     "--data-dir", str(data_dir), *limit_args], block=False)
    try:
        assert studio.backbone_service.wait_ready(120), studio.backbone_service.status()
        yield studio, served, url
    finally:
        served.close()
        studio.close()
        if old is None:
            os.environ.pop("GRADIO_TEMP_DIR", None)
        else:
            os.environ["GRADIO_TEMP_DIR"] = old


def fn_indexes(blocks, module: str, name: str) -> list[int]:
    return [i for i, f in blocks.fns.items()
            if getattr(f.fn, "__module__", "") == module and getattr(f.fn, "__name__", "") == name]


def file_data(path: str) -> dict:
    return {"path": path, "orig_name": Path(path).name, "meta": {"_type": "gradio.FileData"}}


def event_inputs(blocks, index: int, file_value: dict) -> list:
    """Plausible inputs of a page event with ``file_value`` in every File input (the rest: a radio's first
    choice, empty text, numbers)."""
    import gradio as gr

    out = []
    for comp in blocks.fns[index].inputs:
        if isinstance(comp, gr.File):
            out.append(file_value)
        elif isinstance(comp, gr.Dropdown):
            out.append(None)
        elif isinstance(comp, gr.Radio):
            out.append(comp.choices[0][1] if comp.choices else None)
        elif isinstance(comp, (gr.Number, gr.Slider)):
            out.append(10)
        elif isinstance(comp, gr.CheckboxGroup):
            out.append(["base"])
        elif isinstance(comp, gr.Checkbox):
            out.append(False)
        else:
            out.append("")
    return out


def join(url: str, index: int, data: list, cookies: dict | None = None, headers: dict | None = None) -> dict:
    """``POST /gradio_api/queue/join`` and, when it is accepted, the event's completion message."""
    import httpx

    session = uuid.uuid4().hex
    with httpx.Client(base_url=url, cookies=cookies, headers=headers, timeout=60) as h:
        r = h.post("gradio_api/queue/join", json={"data": data, "fn_index": index, "session_hash": session,
                                                  "event_data": None, "trigger_id": None})
        if r.status_code != 200:
            return {"status": r.status_code, "text": r.text, "success": False}
        with h.stream("GET", "gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    msg = json.loads(line[5:])
                    if msg.get("msg") == "process_completed":
                        return {"status": 200, "text": json.dumps(msg), "success": msg.get("success")}
    raise AssertionError("the event never completed")


def files_under(folder: Path) -> set:
    return {str(p) for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()


# --- the page in headless Chromium -------------------------------------------------------------------------------

SHOTS = Path(__file__).resolve().parents[1] / "screenshots"  # gitignored
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWPORT = {"width": 1280, "height": 800}


def ensure_chromium() -> str:
    """Debian's Chromium (never a downloaded one): installed with apt-get when missing, else the test is skipped
    with a clear message."""
    import pytest

    if Path(CHROMIUM).exists():
        return CHROMIUM
    if shutil.which("apt-get") is None:
        pytest.skip(f"{CHROMIUM} is missing and apt-get is not available to install Debian's chromium")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update"], check=True, capture_output=True, timeout=600, env=env)
        subprocess.run(["apt-get", "install", "-y", "chromium"], check=True, capture_output=True, timeout=1200,
                       env=env)
    except (subprocess.SubprocessError, OSError) as e:
        detail = getattr(e, "stderr", b"") or b""
        pytest.skip(f"{CHROMIUM} is missing and `apt-get install -y chromium` failed: {e} "
                    f"{detail.decode('utf-8', 'replace')[-300:]}")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"`apt-get install -y chromium` ran but {CHROMIUM} is still missing")
    return CHROMIUM


@contextlib.contextmanager
def chromium_browser():
    """A headless Chromium driven by Playwright (the test is skipped without Playwright)."""
    import pytest

    exe = ensure_chromium()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@contextlib.contextmanager
def checked_page(browser):
    """A 1280×800 page that fails the test on exit when the page raised a JavaScript error."""
    ctx = browser.new_context(viewport=VIEWPORT)
    pg = ctx.new_page()
    pg.set_default_timeout(60_000)
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, f"JavaScript errors on the page: {errors[:3]}"


@contextlib.contextmanager
def served_page_app(studio):
    """The page of ``studio`` served on a free port (its URL without the trailing slash); ``screenshots/`` made."""
    from ui.app import launch_app

    demo, url = launch_app(studio, port=free_port(), block=False, quiet=True)
    SHOTS.mkdir(exist_ok=True)
    try:
        yield url.rstrip("/")
    finally:
        demo.close()


def browser_session():
    """The body of a module's ``browser`` fixture: ``browser = pytest.fixture(scope="module", name="browser")
    (browser_session)``."""
    with chromium_browser() as b:
        yield b


def browser_page(browser):
    """The body of a test's ``page`` fixture: ``page = pytest.fixture(name="page")(browser_page)``."""
    with checked_page(browser) as pg:
        yield pg


def open_app(page, url: str) -> None:
    page.goto(url, wait_until="domcontentloaded")
    page.wait_for_selector("#pema-status .pema-status.ok")


@contextlib.contextmanager
def backbone_held(studio, seconds: float = 300):
    """The backbone taken by another thread: a job that needs it waits (queued or running) until the block ends."""
    import threading

    taken, done = threading.Event(), threading.Event()

    def hold():
        with studio.gate.use(holder="the test"):
            taken.set()
            done.wait(seconds)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert taken.wait(30)
    try:
        yield
    finally:
        done.set()
        t.join(30)
