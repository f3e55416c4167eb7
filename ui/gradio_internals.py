"""Every use of a Gradio internal (a module below ``gradio``'s top level, a private attribute, an attribute of a
``Blocks`` or of its queue that Gradio does not document, a method the server wraps) goes through this module, so
that a Gradio upgrade has one place to check: ``tests/test_library_internals.py`` names the pinned version
(requirements.txt) and checks the behaviour each function relies on.

- the server: ``gradio.http_server.Server`` (uvicorn's server in a thread: ``run_in_thread()``, ``close()``,
  ``thread``), the MIME types Gradio serves inline (``route_utils.XSS_SAFE_MIMETYPES``), its upload and cache
  folder (``utils.get_upload_folder``);
- a ``Blocks``' events: ``fns`` (index → ``BlockFunction`` with ``fn``, ``inputs``, ``outputs``, ``api_name``,
  ``api_visibility``), the ``Api`` component of ``gr.api`` endpoints, and ``process_api(block_fn, inputs, state,
  request, ..., session_hash=...)``, which runs every event and which the server wraps;
- its queue (``_queue``): the events queued or running (``event_ids_to_events``: ``session_hash``, ``request``), the
  messages kept per session (``pending_messages_per_session``, ``pending_event_ids_session``), its idle loops' sleep
  intervals, its analytics bound, ``close()``;
- its session states (``state_holder``: ``lock``, ``session_data``, ``time_last_used``), the bound on them
  (``state_session_capacity``), the cache cleaning (``delete_cache``, ``upload_file_set``), ``has_launched``, and
  what stops it (``is_running``, ``app.stop_event``);
- its frontend: the built status tracker (``templates/frontend/assets/statustracker-*.js``), served with the
  teardown its timer loop lacks (:func:`serve_fixed_frontend`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gradio.http_server import Server
from gradio.route_utils import BUILD_PATH_LIB, XSS_SAFE_MIMETYPES
from gradio.utils import get_upload_folder

PINNED = "6.31.0"  # the gradio these internals are checked against (requirements.txt)

__all__ = ["PINNED", "Server", "XSS_SAFE_MIMETYPES", "upload_folder"]


# --- files -----------------------------------------------------------------------------------------------------------
def upload_folder() -> str:
    """Gradio's upload and cache folder (uploads and its copies of the files events return)."""
    return get_upload_folder()


def track_moved_uploads(blocks, old: list[str], new: list[str]) -> None:
    """Tell ``blocks``' cache cleaning (which knows each upload by the path Gradio gave it) that the uploads ``old``
    now lie at ``new``."""
    files = getattr(blocks, "upload_file_set", None)
    if isinstance(files, set):
        files.difference_update(old)
        files.update(new)


UPLOAD_PROGRESS_KEPT = 256  # uploads whose progress Gradio keeps (and ids a progress stream may wait on)


def forget_upload_progress(upload_id: str | None, keep: int = UPLOAD_PROGRESS_KEPT, progress=None) -> None:
    """Gradio keeps an upload's progress by its ``upload_id`` until a progress stream reads it to the end, and the
    signal such a stream waits on for every id anyone asks about, forever: drop ``upload_id``'s signal unless an
    upload of it is tracked, and keep at most ``keep`` finished uploads (the newest) and ``keep`` signals without an
    upload (a stream waits on one at most 3 s)."""
    if progress is None:
        from gradio.routes import file_upload_statuses as progress
    statuses, signals = getattr(progress, "_statuses", None), getattr(progress, "_signals", None)
    if not isinstance(statuses, dict) or not isinstance(signals, dict):
        return
    if upload_id is not None and upload_id not in statuses:
        signals.pop(upload_id, None)
    done = [k for k, s in statuses.items() if getattr(s, "is_done", False)]
    for k in done[:max(0, len(done) - keep)]:
        statuses.pop(k, None)
        signals.pop(k, None)
    waiting = [k for k in signals if k not in statuses]
    for k in waiting[:max(0, len(waiting) - keep)]:
        signals.pop(k, None)


# --- events ----------------------------------------------------------------------------------------------------------
def event_functions(blocks) -> dict | None:
    """``blocks``' events: index (``fn_index``) → ``BlockFunction`` (``fn``, ``inputs``, ``outputs``, ``api_name``);
    None where ``blocks`` shows none."""
    fns = getattr(blocks, "fns", None)
    return fns if isinstance(fns, dict) else None


def make_private(blocks, keep=()) -> None:
    """Hide every event of ``blocks`` from its API page and its clients, except the endpoints named in ``keep``."""
    for fn in blocks.fns.values():
        if fn.api_name not in keep:
            fn.api_visibility = "private"


def is_api_endpoint(block_fn) -> bool:
    """An event of ``gr.api`` (every input and output an ``Api`` component): it needs no session state."""
    from gradio.components.api_component import Api

    comps = [*getattr(block_fn, "inputs", []), *getattr(block_fn, "outputs", [])]
    return bool(comps) and all(isinstance(c, Api) for c in comps)


@dataclass
class EventCall:
    """What one run of an event is given: its ``BlockFunction``, its session state (None for some calls), its session
    hash and its request (the first one, for a batch)."""
    block_fn: object
    state: object
    session_hash: str | None
    request: object


def wrap_events(blocks, wrapper) -> None:
    """Run every event of ``blocks`` through ``wrapper(run, call)``: ``call`` an :class:`EventCall`, ``run()`` the
    awaitable of the event itself (its output: a dict with ``data``); what ``wrapper`` returns is the event's
    output. Wrappers added later run outside earlier ones."""
    process_api = blocks.process_api

    async def process_api_wrapped(*args, **kwargs):
        block_fn = kwargs.get("block_fn", args[0] if args else None)
        if isinstance(block_fn, int):
            block_fn = blocks.fns.get(block_fn)
        request = kwargs.get("request", args[3] if len(args) > 3 else None)
        request = request[0] if isinstance(request, list) and request else request
        call = EventCall(block_fn, kwargs.get("state", args[2] if len(args) > 2 else None),
                         kwargs.get("session_hash"), request)
        return await wrapper(lambda: process_api(*args, **kwargs), call)

    blocks.process_api = process_api_wrapped


def forget_session(blocks, session: str, state) -> None:
    """Drop ``blocks``' session state of ``session`` if it is still ``state``."""
    holder = getattr(blocks, "state_holder", None)
    if holder is None:
        return
    with holder.lock:
        if holder.session_data.get(session) is state:
            holder.session_data.pop(session, None)
            holder.time_last_used.pop(session, None)


# --- the queue -------------------------------------------------------------------------------------------------------
def _queue(blocks):
    return getattr(blocks, "_queue", None)


def set_queue_idle_sleeps(blocks, idle_s: float, progress_s: float) -> None:
    """Make the idle loops of ``blocks``' queue (after ``queue()``) sleep at least ``idle_s`` between looks for a new
    event and ``progress_s`` between looks for progress to send (its own intervals, read on every pass)."""
    q = blocks._queue
    q.sleep_when_free = max(q.sleep_when_free, idle_s)
    q.progress_update_sleep_when_free = max(q.progress_update_sleep_when_free, progress_s)


def queue_idle_sleeps(blocks) -> tuple[float, float]:
    """(idle, progress) sleep intervals of ``blocks``' queue."""
    return blocks._queue.sleep_when_free, blocks._queue.progress_update_sleep_when_free


def bound_analytics(blocks, events: int) -> None:
    """Keep at most ``events`` events in the analytics of ``blocks``' queue (if it has one)."""
    q = _queue(blocks)
    if q is not None:
        q.ANALYTICS_MAX_EVENTS = events


def queued_events(blocks) -> list:
    """The events queued or running in ``blocks`` (each with ``session_hash`` and ``request``)."""
    q = _queue(blocks)
    return list(getattr(q, "event_ids_to_events", {}).values()) if q is not None else []


def sessions_with_messages(blocks) -> list[str]:
    """The sessions whose messages (results not yet read, or an empty message queue) ``blocks``' queue keeps."""
    q = _queue(blocks)
    return list(q.pending_messages_per_session) if q is not None else []


def waiting_messages(blocks, session: str) -> int:
    """How many messages ``blocks``' queue holds for ``session`` that nobody has read yet."""
    q = _queue(blocks)
    messages = q.pending_messages_per_session.get(session) if q is not None else None
    return messages.qsize() if messages is not None else 0


def drop_ended_messages(blocks, session: str, keep: int) -> int:
    """Drop the oldest unread messages of ``session`` that belong to events which have ended (their result is among
    them) until at most ``keep`` are left; how many went. The messages of an event still running always stay (a
    stream is read as a chain of diffs), and so does the session's queue (an open stream waits on it)."""
    q = _queue(blocks)
    messages = q.pending_messages_per_session.get(session) if q is not None else None
    if messages is None or messages.qsize() <= keep:
        return 0
    held = []
    while not messages.empty():
        held.append(messages.get_nowait())
    ended = {getattr(m, "event_id", None) for m in held if getattr(m, "msg", None) == "process_completed"}
    over, kept = len(held) - keep, []
    for m in held:
        if over > 0 and getattr(m, "event_id", None) in ended:
            over -= 1
        else:
            kept.append(m)
    for m in kept:
        messages.put_nowait(m)
    return len(held) - len(kept)


def drop_session_messages(blocks, session: str) -> None:
    """Drop what ``blocks``' queue keeps for ``session`` (its messages, its pending event ids)."""
    q = _queue(blocks)
    if q is not None:
        q.pending_messages_per_session.pop(session, None)
        q.pending_event_ids_session.pop(session, None)


# --- mounting and stopping -------------------------------------------------------------------------------------------
def default_delete_cache(blocks, default: tuple[int, int]) -> None:
    """``blocks``' cache cleaning (frequency, age in seconds; read when it is mounted), unless it set its own."""
    blocks.delete_cache = blocks.delete_cache or default


def set_session_capacity(blocks, sessions: int) -> None:
    """The most session states ``blocks`` keeps (read when it is mounted)."""
    blocks.state_session_capacity = int(sessions)


def mark_launched(blocks) -> None:
    """Say that a mounted ``blocks`` has launched: Gradio checks a page event's file inputs (only its own uploads)
    and a handler's file outputs (never a blocked path) only in an app that says so, and ``mount_gradio_app`` never
    says so by itself."""
    blocks.has_launched = True


def stop(blocks) -> None:
    """Close ``blocks``' queue and end its heartbeat streams (``app.stop_event``: an asyncio.Event of the server's
    loop, set from that loop when it runs)."""
    try:
        blocks._queue.close()
        blocks.is_running = False
        event = blocks.app.stop_event
        loop = getattr(event, "_loop", None)
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(event.set)
        else:
            event.set()
    except (AttributeError, RuntimeError):
        pass


# --- the frontend ----------------------------------------------------------------------------------------------------
# Gradio's status tracker (js/statustracker/static/index.svelte) counts a pending event's seconds in a
# requestAnimationFrame loop, ``run()``, that goes on while ``_timer`` is set; only an effect on ``status`` clears it,
# and nothing does when the tracker is destroyed. The page's loading screen (js/core/src/Index.svelte) shows a tracker
# with status "pending" and removes it as the app becomes ready, so on every page that loop runs ≈ 60 times a second
# for the life of the tab (and once more for every tracker removed while its event was pending). In the minified
# bundle: the effect ``E(()=>{p.status===`pending`?start():untrack(()=>{stop()})})``, ``function stop(){…,T&&=!1}``
# and ``function run(){raf(()=>{…,T&&run()})}``.
_TIMER_EFFECT = re.compile(r"(?P<effect>[\w$]+)\(\(\)=>\{[\w$]+\.status===`pending`\?[\w$]+\(\):[\w$]+"
                           r"\(\(\)=>\{(?P<stop>[\w$]+)\(\)\}\)\}\)")


def status_tracker_fix() -> tuple[str, str] | None:
    """(file name, text) of Gradio's built status tracker with one effect added whose teardown, run when a tracker
    is destroyed, clears the timer loop's flag (the loop ends at its next frame); None where the bundle is not the
    expected one (another Gradio: then it is served as it is)."""
    found = sorted(Path(BUILD_PATH_LIB).glob("statustracker-*.js"))
    if len(found) != 1:
        return None
    js = found[0].read_text(encoding="utf-8")
    effects = list(_TIMER_EFFECT.finditer(js))
    if len(effects) != 1:
        return None
    effect = effects[0]
    stop = re.search(rf"function {re.escape(effect['stop'])}\(\)\{{[^{{}}]*?([\w$]+)&&=!1\}}", js)
    if stop is None:
        return None
    flag = re.escape(stop[1])
    if not re.search(rf"function ([\w$]+)\(\)\{{[\w$]+\(\(\)=>\{{[^{{}}]*?{flag}&&\1\(\)\}}\)\}}", js):
        return None  # the flag is not the one the loop goes on with
    teardown = f",{effect['effect']}(()=>()=>{{{stop[1]}=!1}})"
    return found[0].name, js[:effect.end()] + teardown + js[effect.end():]


def serve_fixed_frontend(app, mounts) -> bool:
    """Serve :func:`status_tracker_fix` on ``app`` (a FastAPI app, before Gradio apps are mounted on it at the paths
    ``mounts``) where each of those pages loads Gradio's own (``<mount>/assets/<name>``); whether it could."""
    from starlette.responses import Response

    fix = status_tracker_fix()
    if fix is None:
        return False
    name, text = fix
    body = text.encode("utf-8")

    async def fixed_status_tracker():
        return Response(body, media_type="text/javascript")

    for mount in mounts:
        app.add_api_route(f"{mount.rstrip('/')}/assets/{name}", fixed_status_tracker, methods=["GET"],
                          include_in_schema=False)
    return True
