"""The loopback load test (``python -m eval.loadtest``), scaled down: 3 owners × 2 comparisons while a long build
runs; every comparison is served, each owner is its own identity, the build is cancelled, and the studio stops."""
from __future__ import annotations

import socket

import pytest


def test_a_scaled_down_load_test_serves_everyone_and_cancels_the_build():
    from eval.loadtest import HOST, percentile, run

    lines: list[str] = []
    report = run(owners=3, comparisons=2, backbone="tiny", build_lines=3000, max_new_tokens=8, timeout=400,
                 log=lines.append)
    assert report["host"] == "127.0.0.1" == HOST
    assert report["distinct_identities"] == 3
    assert report["requested"] == report["served"] == 6 and report["failed"] == 0, report
    assert report["build_state_after"] == "running", report  # the comparisons ran beside the build
    assert report["build_state_final"] == "cancelled", report
    assert 0 < report["p50_s"] <= report["p95_s"] <= report["max_s"]
    assert any("comparisons served" in ln for ln in lines) and any("after the cancel request" in ln for ln in lines)
    # the studio is gone: nothing listens on its port any more
    port = int(next(ln for ln in lines if ln.startswith("studio up at")).split(":")[-1].split("/")[0])
    with socket.socket() as s:
        assert s.connect_ex((HOST, port)) != 0
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([1.0] * 19 + [9.0], 95) == 1.0
    assert percentile([1.0] * 18 + [9.0, 9.0], 95) == 9.0


def test_the_load_test_refuses_nonsense_arguments(capsys):
    from eval.loadtest import main

    with pytest.raises(SystemExit):
        main(["--owners", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_a_scaled_down_memory_load_keeps_strangers_calls_out_of_the_server():
    """``python -m eval.memload`` scaled down: every call served; 60 anonymous API calls (half never read) leave the
    server's resident memory where it was (before issue 60 each kept about 1 MB: +60 MB)."""
    from eval.memload import run

    lines: list[str] = []
    report = run(anonymous=60, cookies=10, shares=10, threads=4, settle_s=0, log=lines.append)
    for phase, n in (("anonymous", 60), ("fresh_cookies", 10), ("share_loads", 10)):
        assert report[phase]["calls"] == n and report[phase]["ok"] >= n - 1, report[phase]
        assert report[phase]["rss_before_mb"] > 0
    anon = report["anonymous"]
    assert anon["rss_after_mb"] - anon["rss_before_mb"] < 20, anon
    assert any(ln.startswith("anonymous:") for ln in lines)
