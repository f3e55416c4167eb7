"""Serving: one FastAPI app with the studio (``/``) and the share page (``/share/``) mounted as two Gradio apps, an
ASGI middleware that gives each browser its anonymous key (multi-user mode) and sends old share links on, and the
uvicorn server (in a thread, so tests and ``app.py`` can stop it)."""
from __future__ import annotations

import json
import re
import socket
import time
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import parse_qs, quote

import gradio as gr
import uvicorn
from fastapi import FastAPI
from gradio.http_server import Server
from gradio.utils import get_upload_folder

from ground.errors import UserError
from studio.identity import COOKIE, NO_KEY
from studio.limits import hint
from studio.uploads import NOT_YOURS

COOKIE_MAX_AGE = 400 * 24 * 3600  # browsers cap cookie lifetimes at 400 days
# Gradio's cache (its copies of uploaded files and of files it served): every hour, files older than a day go
# (``delete_cache=(frequency, age)``; also emptied when the server stops). A Blocks that sets its own keeps it.
DELETE_CACHE = (3600, 24 * 3600)


class OwnerCookieMiddleware:
    """Pure ASGI middleware (streams and server-sent events pass untouched).

    * Multi-user mode: a request to the studio without a valid ``pema_owner`` cookie gets one in its response — a
      fresh anonymous key (``Identity.new_browser_key``), HttpOnly so page scripts cannot read it; ``SameSite=None;
      Secure; Partitioned`` over HTTPS (a Space embeds the app in an iframe of huggingface.co), else ``Lax``. The
      cookie is not added to the request itself: a caller that sends neither a cookie nor a key has no identity.
    * ``/?c=<id>`` (links shared before the share page moved) is redirected to ``share/?c=<id>``.
    * Uploads and file inputs (:class:`FileInputGuard`): an upload is bound to its caller; an event may name only
      its caller's own uploads as files; bodies and waiting events are bounded.
    """

    def __init__(self, app, studio, share_path: str = "/share", downloads: Path | None = None, blocks=()):
        self.app = app
        self.studio = studio
        self.share_path = share_path
        self.downloads = Path(downloads).resolve() if downloads else None
        self.guard = FileInputGuard(studio, share_path, blocks)

    def _into_downloads(self, path: str) -> bool:
        """A ``…/file=<path>`` request for a file under the owners' download folders: those are served only as
        the copies Gradio makes for their owner's own page events, never by their path."""
        if self.downloads is None or "file=" not in path:
            return False
        target = path.split("file=", 1)[1]
        try:
            return Path(target).resolve().is_relative_to(self.downloads)
        except (OSError, ValueError):
            return True

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path") or "/"
        if self._into_downloads(path):
            return await refuse(send, 404, "")
        if path in ("", "/", self.share_path) and scope.get("method") == "GET":
            c = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("c")
            if c or path == self.share_path:
                # relative (from "/" and from "/share" alike), so that it works under a proxy's path prefix too
                loc = f"{self.share_path.strip('/')}/" + (f"?c={quote(c[0], safe='')}" if c else "")
                await send({"type": "http.response.start", "status": 307,
                            "headers": [(b"location", loc.encode("latin-1")), (b"content-length", b"0")]})
                return await send({"type": "http.response.body", "body": b""})
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        jar = SimpleCookie()
        try:
            jar.load(headers.get("cookie", ""))
        except Exception:  # noqa: BLE001 — a malformed Cookie header: treat as none
            jar = SimpleCookie()
        cookies = {k: m.value for k, m in jar.items()}
        if scope.get("method") not in ("GET", "HEAD", "OPTIONS"):
            return await self.guard(scope, receive, self._with_cookie(scope, headers, cookies, send), path,
                                    headers, cookies, self.app)
        return await self.app(scope, receive, self._with_cookie(scope, headers, cookies, send))

    def _with_cookie(self, scope, headers: dict, cookies: dict, send):
        """``send``, adding a fresh browser key to the response where the request carries none (multi-user)."""
        path = scope.get("path") or "/"
        if not self.studio.multi_user or path.startswith(self.share_path):
            return send
        if self.studio.identity.owner_of_key(cookies.get(COOKIE)) is not None:
            return send
        https = scope.get("scheme") == "https" or \
            headers.get("x-forwarded-proto", "").split(",")[0].strip() == "https"
        attrs = "; Secure; SameSite=None; Partitioned" if https else "; SameSite=Lax"
        value = (f"{COOKIE}={self.studio.identity.new_browser_key()}; Path=/; Max-Age={COOKIE_MAX_AGE}; "
                 f"HttpOnly{attrs}").encode("latin-1")

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", value)]}
            await send(message)

        return send_with_cookie


async def refuse(send, status: int, message: str) -> None:
    """Answer a request at once (nothing of it reaches Gradio) with ``{"detail": message}``."""
    body = json.dumps({"detail": message}).encode() if message else b""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# Gradio routes that store or act on files or code for components and modes this studio does not use
UNUSED_ROUTES = {"process_recording", "vibe-edit", "undo-vibe-edit", "vibe-code", "vibe-starter-queries"}
FILE_DATA_KEYS = {"path", "url", "size", "orig_name", "mime_type", "is_stream", "meta"}


def file_paths(value, depth: int = 0) -> list:
    """Every ``path`` that Gradio would treat as a file in a request's JSON (a ``FileData``: a dict with a ``path``
    and Gradio's file marker, or with only FileData's fields), however deeply nested."""
    if depth > 64:
        raise ValueError("nested too deeply")
    if isinstance(value, dict):
        meta = value.get("meta")
        if "path" in value and ((isinstance(meta, dict) and meta.get("_type") == "gradio.FileData")
                                or set(value) <= FILE_DATA_KEYS):
            return [value["path"]]
        return [p for v in value.values() for p in file_paths(v, depth + 1)]
    if isinstance(value, list):
        return [p for v in value for p in file_paths(v, depth + 1)]
    return []


class FileInputGuard:
    """The server's checks on what a stranger sends to Gradio, applied before Gradio reads or copies anything.

    * ``POST …/gradio_api/upload``: refused without an identity (multi-user mode) and on the share page; admitted
      within the caller's bounds (``studio.uploads``: files per owner, bytes overall; the body's declared size);
      the stored paths are recorded against the caller's credentials before the answer reaches the caller.
    * Every other ``POST …/gradio_api/…`` (queue joins, REST calls): the body is bounded
      (``Limits.request_bytes``) and every file it names must be one of the caller's own live uploads
      (never on the share page); a caller may have at most ``queued_per_owner`` events waiting in the queue.
    """

    def __init__(self, studio, share_path: str, blocks=()):
        self.studio, self.share_path, self.blocks = studio, share_path, list(blocks)

    async def __call__(self, scope, receive, send, path: str, headers: dict, cookies: dict, app):
        studio = self.studio
        path = re.sub(r"/+", "/", path).rstrip("/") or "/"
        if path.rsplit("/", 1)[-1] in UNUSED_ROUTES:
            return await refuse(send, 404, "")
        owners = studio.identity.credentials(headers, cookies)
        on_share = path.startswith(self.share_path + "/") or path == self.share_path
        declared = headers.get("content-length")
        try:
            declared = int(declared) if declared is not None else None
        except ValueError:
            return await refuse(send, 400, "Invalid Content-Length.")
        if path.endswith("/gradio_api/upload"):
            return await self._upload(scope, receive, send, owners, on_share, declared, app)
        bound = studio.limits.request_bytes()
        if bound and declared is not None and declared > bound:
            return await refuse(send, 413, f"The request is {declared / 1e6:.1f} MB; the limit is "
                                           f"{bound / 1e6:.1f} MB ({hint('upload_bytes')}).")
        buf, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            buf += message.get("body", b"")
            more = message.get("more_body", False)
            if bound and len(buf) > bound:
                return await refuse(send, 413, f"The request is over {bound / 1e6:.1f} MB, the limit "
                                               f"({hint('upload_bytes')}).")
        body = bytes(buf)
        try:
            value = json.loads(body) if body else None
        except (ValueError, RecursionError):
            value = None  # not JSON (or not JSON Gradio could read): Gradio refuses it itself; it names no file
        try:
            paths = file_paths(value)
        except ValueError:
            return await refuse(send, 400, "The request is nested too deeply.")
        for p in paths:
            if on_share or not studio.uploads.owns(p, owners):
                return await refuse(send, 403, NOT_YOURS)
        if path.endswith("/queue/join") or "/gradio_api/call/" in path or "/gradio_api/run/" in path \
                or "/gradio_api/api/" in path:
            waiting = self._waiting(owners)
            cap = studio.limits.queued_per_owner
            if cap and waiting >= cap:
                return await refuse(send, 429, f"You have {waiting} requests waiting in the queue (the limit per "
                                               f"user is {cap}); wait for them to finish ({hint('queued_per_owner')}).")
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await app(scope, replay, send)

    def _waiting(self, owners: frozenset) -> int:
        """Events of these owners (of callers with no identity, when empty) waiting in the studio's queues."""
        n = 0
        for blocks in self.blocks:
            queue = getattr(blocks, "_queue", None)
            for event_queue in list(getattr(queue, "event_queue_per_concurrency_id", {}).values()):
                for event in list(getattr(event_queue, "queue", [])):
                    req = getattr(event, "request", None)
                    theirs = self.studio.identity.credentials(dict(getattr(req, "headers", {}) or {}),
                                                              dict(getattr(req, "cookies", {}) or {}))
                    n += bool(theirs & owners) if owners else not theirs
        return n

    async def _upload(self, scope, receive, send, owners, on_share: bool, declared: int | None, app):
        studio = self.studio
        if on_share:
            return await refuse(send, 404, "")
        if studio.multi_user and not owners:
            return await refuse(send, 403, NO_KEY)
        bound = studio.limits.request_bytes()
        if declared is None and studio.multi_user:
            return await refuse(send, 411, "An upload must say its size (Content-Length).")
        if bound and (declared or 0) > bound:
            return await refuse(send, 413, f"The upload is {declared / 1e6:.1f} MB; the limit is "
                                           f"{studio.limits.upload_bytes / 1e6:.1f} MB ({hint('upload_bytes')}).")
        try:
            ticket = studio.uploads.admit(owners, declared or 0)
        except UserError as e:
            return await refuse(send, 429, str(e))
        start, chunks = None, []

        async def record_then_send(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            if start is not None and start.get("status") == 200:
                try:
                    stored = json.loads(body)
                except ValueError:
                    stored = []
                studio.uploads.record(ticket, [p for p in stored if isinstance(p, str)]
                                      if isinstance(stored, list) else [])
            await send(start)
            await send({"type": "http.response.body", "body": body})

        try:
            await app(scope, receive, record_then_send)
        finally:
            studio.uploads.release(ticket)


class Served:
    """The running server: ``url``, ``close()``; ``blocks`` are the studio's and the share page's Gradio apps."""

    def __init__(self, server: Server, blocks: list[gr.Blocks], url: str):
        self.server, self.blocks, self.url = server, blocks, url

    def close(self) -> None:
        for b in self.blocks:
            try:
                b._queue.close()
                b.is_running = False
                stop = b.app.stop_event  # ends the heartbeat streams; an asyncio.Event of the server's loop
                loop = getattr(stop, "_loop", None)
                if loop is not None and loop.is_running():
                    loop.call_soon_threadsafe(stop.set)
                else:
                    stop.set()
            except (AttributeError, RuntimeError):
                pass
        self.server.close()

    def block(self) -> None:
        """Wait until interrupted (Ctrl-C)."""
        try:
            while self.server.thread.is_alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("Stopping…")
        finally:
            self.close()


def serve(studio, studio_blocks: gr.Blocks, share_blocks: gr.Blocks, host: str, port: int, *, theme=None,
          css: str = "", head: str = "", max_file_size: int | None = None,
          downloads: Path | None = None) -> Served:
    """Mount both Gradio apps on one FastAPI app with the middleware and start the server in a thread.

    ``downloads``: the folder of the owners' evaluation files and plug-in packages (outside the data directory).
    The studio hands files from it to its page (Gradio copies each into its cache, under a name made from the
    file's contents), but nobody may fetch them there by path (the middleware answers 404)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(OwnerCookieMiddleware, studio=studio, downloads=downloads,
                       blocks=[studio_blocks, share_blocks])
    for blocks in (studio_blocks, share_blocks):  # read by mount_gradio_app: each app cleans its own cache
        blocks.delete_cache = blocks.delete_cache or DELETE_CACHE
    common = dict(server_name=host, server_port=port, ssr_mode=False, show_error=True, theme=theme, css=css,
                  head=head, max_file_size=max_file_size, allowed_paths=None,
                  blocked_paths=blocked_paths(studio.root))
    gr.mount_gradio_app(app, share_blocks, path="/share", footer_links=[], run_history=False, **common)
    gr.mount_gradio_app(app, studio_blocks, path="/", footer_links=["api"], run_history=False, **common)
    for blocks in (studio_blocks, share_blocks):
        # Gradio checks a page event's file inputs (only its own uploads) and a handler's file outputs (never a
        # blocked path) only in an app that says it has launched; mount_gradio_app never says so by itself.
        blocks.has_launched = True
    _check_port(host, port)
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=1))  # open event streams are cut after 1 s
    server.run_in_thread()
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return Served(server, [studio_blocks, share_blocks], f"http://{shown}:{port}/")


def blocked_paths(data_dir: Path) -> list[str]:
    """What Gradio must never read or serve: the data directory (catalog, memories, plug-ins, the owners' secret) —
    all of it, or, where Gradio's own upload folder lies inside it, everything in it but that folder."""
    root = Path(data_dir).resolve()
    uploads = Path(get_upload_folder()).resolve()
    if not uploads.is_relative_to(root):
        return [str(root)]
    out, at = [], root
    for part in uploads.relative_to(root).parts:
        out += [str(p) for p in (at.iterdir() if at.is_dir() else []) if p.name != part]
        at = at / part
    return out


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # as uvicorn binds: a port whose last server died (kill -9) and left connections in TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"Cannot listen on {host}:{port} ({e.strerror}); is another studio running there? "
                          f"Choose another port with --port.") from None
