"""A public studio probed as a hostile visitor and a long-running host would, round five (``--multi-user``, tiny
backbone, raw HTTP): probes the earlier rounds (``tests/test_hosting_bounds.py``, ``tests/test_hosting_security.py``,
``tests/test_server_guard.py``, ``tests/test_owners.py``) do not contain.

* Unread results are bounded by count and bytes, not only by time: a caller that joins events back to back into one
  session and never reads them, or that leaves the results of many fresh sessions unread, cannot pile them up in the
  server (each event's result waited for its caller for two minutes, and a busy session's never went at all).
"""
import json
import os
import time
import uuid
from types import SimpleNamespace

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from _server import hosted_site  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    cache, data = tmp_path_factory.mktemp("gradio-cache"), tmp_path_factory.mktemp("site")
    with hosted_site(data, cache, ["queue_size=64"]) as (studio, served, url):
        yield SimpleNamespace(studio=studio, served=served, url=url, blocks=served.blocks[0])


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
    assert json.dumps(server.UNREAD_PER_SESSION)  # a plain number


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
