"""Resident memory of a hosted studio under strangers' calls (results in BENCHMARKS.md, "Memory per caller").

    python -m eval.memload                                   # 5,000 anonymous calls, 2,000 fresh cookies, 2,000 shares,
                                                             # 300 unread results in one session
    python -m eval.memload --anonymous 500 --cookies 200 --shares 200   # scaled down (the test does this)
    python -m eval.memload --json out/memload.json           # the report as JSON too

It starts ``python app.py --multi-user`` on the tiny backbone, bound to 127.0.0.1 on a free port with a fresh data
directory (removed at the end), makes one share (a comparison of the base model, shared by one identity), then runs
up to four phases from ``--threads`` threads, reading the studio process's resident memory (``VmRSS``) before each
phase, at every tenth of it and after it:

1. **anonymous API calls**: ``POST /gradio_api/call/status`` with neither cookie nor key; every other call reads its
   result stream, the rest never do (a careless or hostile client);
2. **fresh-cookie calls**: a first visit (``GET /``: a new anonymous key in the ``pema_owner`` cookie), then
   ``POST /gradio_api/call/memories`` with that cookie, result read;
3. **share-page loads**: what a browser does for ``/share/?c=<id>``: the page, then its load event joined with a
   fresh session hash (``POST /share/gradio_api/queue/join?c=<id>``) and its result stream read to the end;
4. **unread results in one session** (``--unread``): one owner with a memory of 500 long samples joins its
   ``/memory`` event (~0.3 MB an answer) into one session hash, back to back, and never reads a result (the session
   is never idle, so the two-minute sweep never takes them; the per-session bound does).

Growth "levels off" when the last half of a phase adds little: the report gives each phase's RSS before, at its
midpoint and after, and the MB per 1,000 calls of each half. Nothing here imports the studio: it is driven from
outside, as its visitors would.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eval.loadtest import Studio, client, new_identity


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def read_stream(h, url: str, params: dict | None = None) -> str:
    """Read a server-sent event stream to its end (or its first complete/error event); the last event's name."""
    last = ""
    with h.stream("GET", url, params=params) as r:
        for line in r.iter_lines():
            if line.startswith("event:"):
                last = line[6:].strip()
                if last in ("complete", "error"):
                    break
            elif line.startswith("data:") and ('"process_completed"' in line or '"close_stream"' in line):
                last = "process_completed"
                break
    return last


def anonymous_call(h, i: int) -> bool:
    r = h.post("gradio_api/call/status", json={"data": []})
    if r.status_code != 200:
        return False
    if i % 2 == 0:
        return read_stream(h, f"gradio_api/call/status/{r.json()['event_id']}") == "complete"
    return True


def fresh_cookie_call(h, i: int) -> bool:
    import httpx

    first = h.get("")
    key = first.cookies.get("pema_owner")
    if not key:
        return False
    with httpx.Client(base_url=str(h.base_url), cookies={"pema_owner": key}, timeout=60) as c:
        r = c.post("gradio_api/call/memories", json={"data": []})
        return r.status_code == 200 and read_stream(c, f"gradio_api/call/memories/{r.json()['event_id']}") == \
            "complete"


def share_page_load(h, i: int, share_id: str, fn_index: int) -> bool:
    session = uuid.uuid4().hex
    if h.get("share/", params={"c": share_id}).status_code != 200:
        return False
    r = h.post("share/gradio_api/queue/join", params={"c": share_id},
               json={"data": [], "fn_index": fn_index, "session_hash": session, "event_data": None,
                     "trigger_id": None})
    return r.status_code == 200 and read_stream(h, "share/gradio_api/queue/data",
                                                {"session_hash": session}) == "process_completed"


def unread_join(h, i: int, key: str, session: str, fn_index: int, memory_id: str) -> bool:
    """Join the ``/memory`` event into ``session`` and never read its result (a 429 for too many in flight: retried)."""
    for _ in range(600):
        r = h.post("gradio_api/queue/join", headers={"X-Pema-Key": key},
                   json={"data": [memory_id], "fn_index": fn_index, "session_hash": session, "event_data": None,
                         "trigger_id": None})
        if r.status_code != 429:
            return r.status_code == 200
        time.sleep(0.05)
    return False


def unread_setup(url: str) -> tuple[str, str, int]:
    """(key, memory id, fn_index of /memory) of a new owner with a memory of 500 long samples."""
    import httpx

    key = new_identity(url)
    c = client(url, key)
    text = "\n".join(json.dumps({"src": f"{i} " + "word " * 60, "tgt": f"{i} " + "Wort " * 60}) for i in range(500))
    job_id = c.predict(text, "long.jsonl", api_name="/build")["job_id"]
    while (job := c.predict(job_id, api_name="/job"))["state"] in ("queued", "running"):
        time.sleep(0.5)
    if job["state"] != "done":
        raise RuntimeError(f"the memory for the unread phase was not built: {job['error']}")
    config = httpx.get(url + "config", timeout=30).json()
    index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "memory")
    return key, job["result"]["memory_id"], index


def load_event(url: str) -> int:
    """The share page's load event (its ``fn_index``), from the page's config."""
    import httpx

    config = httpx.get(url + "share/config", timeout=30).json()
    for dep in config["dependencies"]:
        if any(t[1] == "load" for t in dep.get("targets", [])):
            return dep["id"]
    raise RuntimeError("the share page has no load event")


def make_share(url: str) -> str:
    """One comparison of the base model, shared; its id."""
    c = client(url, new_identity(url))
    while c.predict(api_name="/status")["state"] != "ready":
        time.sleep(0.3)
    p = c.predict("the cat sleeps", "translation", ["base"], {}, 4, 1, 0, False, api_name="/compare")
    return c.predict(p["id"], -1, None, api_name="/share")["id"]


def phase(name: str, calls: int, threads: int, fn, url: str, pid: int, log=print) -> dict:
    """``calls`` calls of ``fn(h, i)`` from ``threads`` threads; RSS before, at every tenth, after."""
    import httpx

    marks = {0: rss_mb(pid)}
    ok, lock, done, failed = [0], threading.Lock(), [0], {}
    step = max(1, calls // 10)
    local = threading.local()

    def one(i: int) -> None:
        if not hasattr(local, "h"):
            local.h = httpx.Client(base_url=url, timeout=60)
        local.h.cookies.clear()  # every call is a stranger's: no cookie kept from an earlier answer
        why = "refused or incomplete"
        try:
            good = fn(local.h, i)
        except httpx.HTTPError as e:
            good, why = False, type(e).__name__
        with lock:
            ok[0] += bool(good)
            if not good:
                failed[why] = failed.get(why, 0) + 1
            done[0] += 1
            if done[0] % step == 0:
                marks[done[0]] = rss_mb(pid)

    t0 = time.time()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(calls)))
    wall = time.time() - t0
    marks[calls] = rss_mb(pid)
    xs = sorted(marks)
    mid = min(xs, key=lambda x: abs(x - calls / 2))
    before, middle, after = marks[0], marks[mid], marks[calls]
    out = {"calls": calls, "ok": ok[0], "failed": failed, "wall_s": round(wall, 1),
           "calls_per_s": round(calls / max(wall, 1e-9), 1),
           "rss_before_mb": round(before, 1), "rss_mid_mb": round(middle, 1), "rss_after_mb": round(after, 1),
           "mb_per_1000_first_half": round(1000 * (middle - before) / max(mid, 1), 1),
           "mb_per_1000_second_half": round(1000 * (after - middle) / max(calls - mid, 1), 1),
           "rss_marks_mb": {str(k): round(v, 1) for k, v in sorted(marks.items())}}
    log(f"{name}: {ok[0]}/{calls} ok in {out['wall_s']} s; RSS {out['rss_before_mb']} → {out['rss_mid_mb']} → "
        f"{out['rss_after_mb']} MB ({out['mb_per_1000_first_half']} then {out['mb_per_1000_second_half']} MB per "
        f"1,000 calls)")
    return out


def run(anonymous: int = 5000, cookies: int = 2000, shares: int = 2000, threads: int = 8, timeout: float = 3600.0,
        settle_s: float = 5.0, log=print, unread: int = 0) -> dict:
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="pema-memload-"))
    studio = Studio("tiny", tmp / "data", None, [])
    report: dict = {"backbone": "tiny", "threads": threads}
    try:
        studio.wait_up(t_start + timeout)
        share_id = make_share(studio.url)
        fn_index = load_event(studio.url)
        pid = studio.proc.pid
        report["rss_start_mb"] = round(rss_mb(pid), 1)
        log(f"studio up at {studio.url}; RSS {report['rss_start_mb']} MB after one comparison and its share")
        for name, n, fn in (("anonymous", anonymous, anonymous_call), ("fresh_cookies", cookies, fresh_cookie_call),
                            ("share_loads", shares,
                             lambda h, i: share_page_load(h, i, share_id, fn_index))):
            if n > 0:
                report[name] = phase(name, n, threads, fn, studio.url, pid, log)
        if unread > 0:
            key, memory_id, memory_event = unread_setup(studio.url)
            session = uuid.uuid4().hex
            report["unread_one_session"] = phase(
                "unread_one_session", unread, threads,
                lambda h, i: unread_join(h, i, key, session, memory_event, memory_id), studio.url, pid, log)
        time.sleep(settle_s)
        report["rss_end_mb"] = round(rss_mb(pid), 1)
        log(f"RSS {report['rss_end_mb']} MB {settle_s:.0f} s after the last call")
    finally:
        studio.stop()
        report["total_s"] = round(time.time() - t_start, 1)
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Resident memory of a hosted studio (tiny backbone) across anonymous "
                                            "API calls, fresh-cookie calls and share-page loads.")
    p.add_argument("--anonymous", type=int, default=5000, help="anonymous POST /gradio_api/call/status calls")
    p.add_argument("--cookies", type=int, default=2000, help="first visits, each followed by a /memories call")
    p.add_argument("--shares", type=int, default=2000, help="share-page loads (page and load event)")
    p.add_argument("--unread", type=int, default=300,
                   help="/memory events joined into one session and never read (0: no such phase)")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", default=None, help="also write the report to this file")
    a = p.parse_args(argv)
    if min(a.anonymous, a.cookies, a.shares, a.unread) < 0 or a.threads < 1:
        p.error("the counts must be 0 or more and --threads at least 1")
    report = run(a.anonymous, a.cookies, a.shares, a.threads, a.timeout, unread=a.unread)
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
