"""An open tab that idles: over a window on a page with no running job (one finished job listed), the events the page
sends (timer polls), the DOM mutations it makes, its requestAnimationFrame calls, and the CPU of the browser (Debian's
Chromium, headless, driven by Playwright) and of the studio's server (its own process, tiny backbone). Two floors are
measured first in the same run: a blank page (``about:blank``: headless Chromium itself) and an empty ``gr.Blocks()``
page as Gradio serves it.

    python -m benchmarks idle [--seconds 30] [--root CHECKOUT] [--tab Rank]

``--root`` serves another checkout (e.g. an older commit from ``git archive``) with the same data and browser, for a
before/after comparison on the same machine. Prints one JSON line; BENCHMARKS.md, "An idle tab", holds the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

CHROMIUM = "/usr/bin/chromium"
BUILD = """
import sys
from studio.service import Studio
st = Studio(sys.argv[1], backbone="tiny")
assert st.backbone_service.wait_ready(120)
tsv = "\\n".join(f"sentence number {i}\\tSatz Nummer {i}" for i in range(40))
job = st.jobs.wait(st.memory_service.submit_build(tsv, "pairs.tsv", name="idle pairs"), 120)
assert job["state"] == "done", job
st.close()
"""
# Gradio's own floor: an empty Blocks page as Gradio serves it (its loading screen's status tracker leaves a
# requestAnimationFrame loop running, ≈ 60 a second, which the studio's server fixes: ui.gradio_internals)
EMPTY = """
import sys, time
import gradio as gr
with gr.Blocks() as demo:
    pass
demo.queue()
demo.launch(server_port=int(sys.argv[1]), prevent_thread_lock=True, quiet=True)
while True:
    time.sleep(1)
"""
# counts the page's requestAnimationFrame calls from its first script on (a frame loop keeps the browser drawing)
COUNT_FRAMES = """(() => {
  const raf = window.requestAnimationFrame.bind(window);
  window.pemaFrames = 0;
  window.requestAnimationFrame = (cb) => { window.pemaFrames += 1; return raf(cb); };
})()"""
# counts what the page does from now on: DOM mutation records, and the events it sends (fetch and XHR to the queue)
OBSERVE = """() => {
  window.pemaIdle = {mutations: 0, frames: window.pemaFrames};
  new MutationObserver((records) => { window.pemaIdle.mutations += records.length; })
    .observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true});
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def browser_processes(exclude: set[int]) -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in exclude and "chrom" in (p.name() or "").lower()]


def serve(root: Path, data: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([sys.executable, "-c", BUILD, str(data)], cwd=root, env=env, check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "app.py", "--backbone", "tiny", "--data-dir", str(data), "--port",
                             str(port), "--quiet"], cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, wait_until_served(proc, f"http://127.0.0.1:{port}/", 240, "the studio")


def wait_until_served(proc: subprocess.Popen, url: str, tries: int, what: str) -> str:
    """``url`` once it answers (polled every 0.5 s, ``tries`` times); ``proc`` killed if it never does."""
    for _ in range(tries):
        try:
            urllib.request.urlopen(url, timeout=2)
            return url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{what} did not start")


def settle(proc: psutil.Process, below_pct: float = 3.0, window: float = 5.0, limit: float = 120.0) -> float:
    """Wait until ``proc`` uses less than ``below_pct`` of a core over ``window`` seconds (a studio warms up for a
    while after it starts); the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < limit:
        c0 = cpu_seconds([proc])
        time.sleep(window)
        if 100 * (cpu_seconds([proc]) - c0) / window < below_pct:
            break
    return time.time() - t0


def serve_empty() -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "-c", EMPTY, str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc, wait_until_served(proc, f"http://127.0.0.1:{port}/", 120, "the empty Gradio page")


def measure(url: str, server: psutil.Process | None, seconds: float, tab: str | None, page_settle_s: float) -> dict:
    """The window's figures on ``url`` (``server`` None: no server, e.g. ``about:blank``)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.add_init_script(COUNT_FRAMES)
        page.goto(url, wait_until="domcontentloaded")
        if tab != "-":  # "-": Gradio's empty page (no studio header to wait for)
            page.wait_for_selector("#pema-status .pema-status.ok", timeout=120_000)
        if tab and tab != "-":
            page.get_by_role("tab", name=tab).click()
        page.wait_for_timeout(page_settle_s * 1000)  # the page's load events and the tab's refresh settle
        sent = []
        page.on("request", lambda r: sent.append(r.url) if "/gradio_api/" in r.url else None)
        page.evaluate(OBSERVE)
        servers = [server] if server is not None else []
        procs = browser_processes({p.pid for p in servers})
        b0, s0, t0 = cpu_seconds(procs), cpu_seconds(servers), time.time()
        page.wait_for_timeout(seconds * 1000)
        b1, s1, wall = cpu_seconds(procs), cpu_seconds(servers), time.time() - t0
        mutations, frames = page.evaluate("[window.pemaIdle.mutations, window.pemaFrames - window.pemaIdle.frames]")
        browser.close()
    events = [u for u in sent if "/queue/join" in u or "/run/" in u]
    return {"seconds": round(wall, 1), "events_sent": len(events), "events_per_s": round(len(events) / wall, 2),
            "dom_mutations": mutations, "dom_mutations_per_s": round(mutations / wall, 1),
            "animation_frames": frames, "animation_frames_per_s": round(frames / wall, 1),
            "browser_cpu_pct": round(100 * (b1 - b0) / wall, 2),
            "server_cpu_pct": round(100 * (s1 - s0) / wall, 2) if servers else None,
            "browser_processes": len(procs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks idle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the checkout to serve")
    ap.add_argument("--tab", default=None, help="open this tab first (e.g. Plug-ins); default: the first")
    ap.add_argument("--page-settle", type=float, default=15.0, help="seconds between the page's load and the window")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the blank page and Gradio's empty page (measured first by default)")
    a = ap.parse_args(argv)
    if not a.no_floor:
        blank = measure("about:blank", None, a.seconds, "-", a.page_settle)
        print(json.dumps({"root": "about:blank (headless Chromium's floor)", **blank}))
        proc, url = serve_empty()
        try:
            server = psutil.Process(proc.pid)
            settle(server)
            floor = measure(url, server, a.seconds, "-", a.page_settle)
        finally:
            proc.terminate()
            proc.wait(30)
        print(json.dumps({"root": "an empty gr.Blocks (Gradio's floor)", **floor}))
    with tempfile.TemporaryDirectory(prefix="pema-idle-") as tmp:
        proc, url = serve(Path(a.root), Path(tmp) / "data")
        try:
            server = psutil.Process(proc.pid)
            warm = settle(server)
            out = measure(url, server, a.seconds, a.tab, a.page_settle)
        finally:
            proc.terminate()
            proc.wait(30)
    print(json.dumps({"root": a.root, "tab": a.tab or "Memories", "server_warm_s": round(warm, 1), **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
