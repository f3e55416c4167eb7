"""A studio served on 127.0.0.1 for tests that go through its HTTP API (``gradio_client``): the same pattern as
``tests/test_app.py`` (``app.start(..., block=False)`` on a free port, tiny backbone), factored for reuse."""
from __future__ import annotations

import os
import socket
import time
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
    assert st.wait_ready(120), st.status()
    return st


def build_tiny_memory(studio, pairs=TINY_PAIRS, name: str = "pairs") -> str:
    """Build a memory from sentence pairs through the studio's job (as an upload of a TSV would); its id."""
    tsv = "\n".join(f"{s}\t{t}" for s, t in pairs)
    job = studio.jobs.wait(studio.submit_build(tsv, "pairs.tsv", name=name), 120)
    assert job["state"] == "done", job
    return job["result"]["memory_id"]
