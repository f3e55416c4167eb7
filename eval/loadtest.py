"""A bounded loopback load test of the hosted studio (results in BENCHMARKS.md, "Load test").

    python -m eval.loadtest                              # tiny backbone: 20 owners × 5 comparisons during a build
    python -m eval.loadtest --backbone gemma-3-270m      # the real backbone (cached weights; ~/.cache/pema-studio)
    python -m eval.loadtest --owners 3 --comparisons 2   # scaled down (the test does this)
    python -m eval.loadtest --baseline                   # the same comparisons on the idle studio first
    python -m eval.loadtest --json out/loadtest.json     # the report as JSON too

It starts ``python app.py --multi-user`` bound to 127.0.0.1 on a free port with a fresh data directory (removed at
the end), gets one anonymous identity per owner the way a browser does (the ``pema_owner`` cookie of a first visit,
then sent as the ``X-Pema-Key`` header through ``gradio_client``), queues one long memory build (a monolingual text:
synthetic sources, then the capture) as one more owner, and once the build is running lets every owner send its
comparisons at the same time, each after the last one's answer. It reports how many were served and their latency
(p50 / p95 / max, from the request to the answer: queueing included), then cancels the build and reports the time
from the cancel request to the job's ``cancelled`` state (the bar: 5 s). Then it stops the studio. It never listens
on anything but 127.0.0.1, and gives up after ``--timeout`` seconds (it always stops the studio).

Nothing here imports the studio: it is driven from outside, as its users would.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only, by design
CANCEL_BAR_S = 5.0
SENTENCES = ["The house is small.", "Good morning, how are you?", "The cat sleeps on the warm window sill.",
             "Please restart the application to apply the changes.", "Where is the nearest train station?",
             "This file could not be opened.", "We will meet again tomorrow evening."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0–100) of a non-empty list."""
    xs = sorted(values)
    return xs[max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))]


def monolingual_text(lines: int) -> str:
    """A monolingual upload of ``lines`` distinct sentences (each gets a synthetic source: the long phase)."""
    words = ["Das", "Programm", "speichert", "die", "Datei", "im", "Ordner", "nach", "jedem", "Schritt", "neu"]
    return "\n".join(f"{' '.join(words[(i + j) % len(words)] for j in range(6 + i % 5))} Nummer {i}."
                     for i in range(lines))


class Studio:
    """The studio as a subprocess on 127.0.0.1 (its output goes to a log file in its data directory)."""

    def __init__(self, backbone: str, data_dir: Path, backbone_cache: str | None, extra: list[str]):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}/"
        self.data_dir = data_dir
        self.log_path = data_dir.parent / f"{data_dir.name}-studio.log"
        cmd = [sys.executable, str(ROOT / "app.py"), "--backbone", backbone, "--host", HOST, "--port",
               str(self.port), "--multi-user", "--data-dir", str(data_dir), "--quiet", *extra]
        if backbone_cache:
            cmd += ["--backbone-cache", backbone_cache]
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_up(self, deadline: float) -> None:
        import httpx

        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the studio exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(self.url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the studio did not answer within the time limit:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # app.py stops its server and job worker on Ctrl-C
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def new_identity(url: str) -> str:
    """A fresh anonymous key, as a browser gets it: the cookie of a first visit."""
    import httpx

    r = httpx.get(url, timeout=30)
    key = r.cookies.get("pema_owner")
    if not key:
        raise RuntimeError("the studio set no pema_owner cookie (is it in multi-user mode?)")
    return key


def client(url: str, key: str):
    from gradio_client import Client  # heavy; only this script needs it

    return Client(url, headers={"X-Pema-Key": key}, verbose=False)


def comparison_phase(clients: list, comparisons: int, max_new_tokens: int, deadline: float) -> dict:
    """Every client (one owner each) sends ``comparisons`` comparisons, one after the other's answer, all owners at
    once. Returns served/failed counts, wall time, latency percentiles (request to answer, queueing included) and the
    studio's own time per comparison (``timings.total_s``: waiting for the backbone + decoding)."""
    latencies: list[float] = []
    in_studio: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    go = threading.Barrier(len(clients))

    def owner(i: int) -> None:
        go.wait()
        for j in range(comparisons):
            if time.time() > deadline:
                with lock:
                    errors.append(f"owner {i}: time limit")
                return
            t0 = time.time()
            try:
                out = clients[i].predict(SENTENCES[(i + j) % len(SENTENCES)], "translation", ["base"], {},
                                         max_new_tokens, 1, 0, api_name="/compare")
                ok = bool(out.get("rows")) and out["rows"][0].get("text") is not None
            except Exception as e:  # noqa: BLE001 — a failed comparison is counted, not raised
                ok, out = False, f"{type(e).__name__}: {e}"[:200]
            dt = time.time() - t0
            with lock:
                if ok:
                    latencies.append(dt)
                    in_studio.append(float(out["timings"]["total_s"]))
                else:
                    errors.append(f"owner {i}: {out}")

    t0 = time.time()
    threads = [threading.Thread(target=owner, args=(i,), daemon=True) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.time()))
    wall = time.time() - t0
    out = {"requested": len(clients) * comparisons, "served": len(latencies), "failed": len(errors),
           "errors": errors[:10], "wall_s": round(wall, 2),
           "throughput_per_s": round(len(latencies) / wall, 2) if wall else 0.0}
    if latencies:
        out.update(p50_s=round(percentile(latencies, 50), 3), p95_s=round(percentile(latencies, 95), 3),
                   max_s=round(max(latencies), 3), min_s=round(min(latencies), 3),
                   server_p50_s=round(percentile(in_studio, 50), 3), server_p95_s=round(percentile(in_studio, 95), 3),
                   server_max_s=round(max(in_studio), 3))
    return out


def run(owners: int = 20, comparisons: int = 5, backbone: str = "tiny", build_lines: int = 5000,
        max_new_tokens: int = 16, backbone_cache: str | None = None, timeout: float = 1800.0,
        data_dir: str | None = None, baseline: bool = False, log=print) -> dict:
    """Run the load test and return its report (see the module's docstring)."""
    t_start = time.time()
    deadline = t_start + timeout
    tmp = Path(tempfile.mkdtemp(prefix="pema-loadtest-"))
    studio = Studio(backbone, Path(data_dir) if data_dir else tmp / "data", backbone_cache, [])
    report: dict = {"backbone": backbone, "owners": owners, "comparisons_per_owner": comparisons,
                    "max_new_tokens": max_new_tokens, "build_lines": build_lines, "host": HOST,
                    "cpu_count": os.cpu_count()}
    try:
        studio.wait_up(deadline)
        log(f"studio up at {studio.url} ({time.time() - t_start:.1f}s)")
        builder = client(studio.url, new_identity(studio.url))
        while True:  # the backbone loads in the background
            st = builder.predict(api_name="/status")
            if st["state"] == "ready":
                break
            if st["state"] == "failed" or time.time() > deadline:
                raise RuntimeError(f"the backbone did not load: {st.get('message')}")
            time.sleep(0.5)
        report["backbone_loaded_s"] = round(time.time() - t_start, 1)
        log(f"backbone {st['backbone']} ready ({report['backbone_loaded_s']}s)")
        keys = [new_identity(studio.url) for _ in range(owners)]
        report["distinct_identities"] = len(set(keys))
        clients = [client(studio.url, k) for k in keys]

        if baseline:  # the same load on an idle studio first: what the build costs the comparisons
            idle = comparison_phase(clients, comparisons, max_new_tokens, deadline)
            report["idle"] = idle
            log(f"idle: {idle['served']}/{idle['requested']} served in {idle['wall_s']}s; latency p50 "
                f"{idle.get('p50_s')}s p95 {idle.get('p95_s')}s max {idle.get('max_s')}s")
        job_id = builder.predict(monolingual_text(build_lines), "long.txt", "", "translation", "teacher", "", 0,
                                 False, api_name="/build")["job_id"]
        while True:
            job = builder.predict(job_id, api_name="/job")
            if job["state"] == "running" and job.get("progress", 0) > 0:
                break
            if job["state"] not in ("queued", "running") or time.time() > deadline:
                raise RuntimeError(f"the build did not start: {job['state']} {job.get('message')}")
            time.sleep(0.2)
        log(f"build {job_id} running: {job['message']}")

        report.update(comparison_phase(clients, comparisons, max_new_tokens, deadline))
        job = builder.predict(job_id, api_name="/job")
        report.update(build_state_after=job["state"], build_progress_after=round(job.get("progress") or 0, 4),
                      build_message_after=job.get("message", ""))
        log(f"{report['served']}/{report['requested']} comparisons served in {report['wall_s']}s during the build; "
            f"latency p50 {report.get('p50_s')}s p95 {report.get('p95_s')}s max {report.get('max_s')}s (in the "
            f"studio: p50 {report.get('server_p50_s')}s); build {job['state']} at "
            f"{100 * (job.get('progress') or 0):.1f}% ({job.get('message', '')})")

        t0 = time.time()
        builder.predict(job_id, api_name="/cancel")
        while True:
            job = builder.predict(job_id, api_name="/job")
            if job["state"] not in ("queued", "running") or time.time() > deadline:
                break
            time.sleep(0.05)
        report.update(cancel_s=round(time.time() - t0, 2), build_state_final=job["state"],
                      cancel_within_bar=job["state"] == "cancelled" and time.time() - t0 <= CANCEL_BAR_S)
        log(f"build {job['state']} {report['cancel_s']}s after the cancel request (bar {CANCEL_BAR_S:.0f}s)")
    finally:
        studio.stop()
        report["total_s"] = round(time.time() - t_start, 1)
        if data_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Loopback load test: owners × comparisons while a long build runs, "
                                            "then the build's cancel time.")
    p.add_argument("--backbone", default="tiny", help="tiny (default) or gemma-3-270m (or any app.py backbone)")
    p.add_argument("--owners", type=int, default=20)
    p.add_argument("--comparisons", type=int, default=5, help="per owner, one after the other")
    p.add_argument("--build-lines", type=int, default=5000, help="lines of the monolingual text the build gets")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--backbone-cache", default=None,
                   help="a data directory whose backbones/ holds de-quantized weights (default for a non-tiny "
                        "backbone: ~/.cache/pema-studio)")
    p.add_argument("--data-dir", default=None, help="keep the studio's data here (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up (and stop the studio) after this many s")
    p.add_argument("--baseline", action="store_true",
                   help="first run the same comparisons on the idle studio (what the build costs them)")
    p.add_argument("--json", default=None, help="also write the report to this file")
    a = p.parse_args(argv)
    if min(a.owners, a.comparisons, a.build_lines, a.max_new_tokens) < 1:
        p.error("--owners, --comparisons, --build-lines and --max-new-tokens must be at least 1")
    cache = a.backbone_cache
    if cache is None and a.backbone != "tiny":
        cache = str(Path.home() / ".cache" / "pema-studio")
    report = run(a.owners, a.comparisons, a.backbone, a.build_lines, a.max_new_tokens, cache, a.timeout, a.data_dir,
                 a.baseline)
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
    ok = report.get("served") == report.get("requested") and report.get("build_state_final") == "cancelled"
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
