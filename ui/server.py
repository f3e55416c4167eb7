"""Serving: one FastAPI app with the studio (``/``) and the share page (``/share/``) mounted as two Gradio apps, an
ASGI middleware in front of both (each browser's anonymous key, the same-origin policy, the file routes, the checks
on what a stranger sends: :class:`OwnerCookieMiddleware`), and the uvicorn server (in a thread, so tests and
``app.py`` can stop it)."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import math
import mimetypes
import os
import re
import socket
import tempfile
import threading
import time
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import gradio as gr
import uvicorn
from fastapi import FastAPI
from starlette.responses import FileResponse

from ground.errors import UserError
from studio.identity import COOKIE, NO_KEY
from studio.limits import hint
from studio.packages import without_server_paths
from studio.uploads import NOT_YOURS, ServedFiles, TooManyParts, mark_downloads, own_folder, sweep_downloads
from ui import gradio_internals as gri
from ui.api import check_arguments
from ui.gradio_internals import XSS_SAFE_MIMETYPES, EventCall, Server, is_api_endpoint

COOKIE_MAX_AGE = 400 * 24 * 3600  # browsers cap cookie lifetimes at 400 days
# Gradio's cache (its copies of uploaded files and of files it served): every hour, files older than a day go
# (``delete_cache=(frequency, age)``; also emptied when the server stops). A Blocks that sets its own keeps it.
DELETE_CACHE = (3600, 24 * 3600)
ALLOW_ORIGINS_ENV = "PEMA_ALLOW_ORIGINS"  # comma-separated origins that may call the studio from their pages
CROSS_SITE = ("This studio does not take requests from another site's pages (its operator can allow an origin with "
              "--allow-origin).")
# Gradio routes the studio does not use: some write a session's state where others can fetch it (deep links),
# fetch URLs for a caller (proxy), show the server's internals, or make a session state for any session hash named
# (component_server: no component of the studio has a server function); all answer 404.
UNUSED = re.compile(r"^/(gradio_api/)?(deep_link|proxy=.*|monitoring|run-history|runs|stream|process_recording|"
                    r"vibe-edit|undo-vibe-edit|vibe-code|vibe-starter-queries|dev|custom_component|"
                    r"component_server)(/.*)?$", re.I)
# An upload's progress id, as the page makes one (a short random token): Gradio keeps a table entry per id
UPLOAD_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class OwnerCookieMiddleware:
    """Pure ASGI middleware (streams and server-sent events pass untouched).

    * Multi-user mode: a request to the studio without a valid ``pema_owner`` cookie gets one in its response — a
      fresh anonymous key (``Identity.new_browser_key``), HttpOnly so page scripts cannot read it; ``SameSite=None;
      Secure; Partitioned`` over HTTPS (a Space embeds the app in an iframe of huggingface.co), else ``Lax``. The
      cookie is not added to the request itself: a caller that sends neither a cookie nor a key has no identity.
    * Same origin: a request from another site's page (an ``Origin`` that is not this server's, or a cross-site
      fetch) never carries the cookie's identity, gets no cookie and no CORS header, and may only read (GET/HEAD);
      origins in ``allow_origins`` may also send, with their key header and without credentials.
    * Files (:meth:`_serve_file`): every ``…file=…`` / ``…/gradio_api/file/…`` request, whatever its prefix,
      encoding or method, is answered here — the file only to its owner (an upload of theirs, or a file one of
      their own events returned), else 404; Gradio's file route is never reached. Unused Gradio routes: 404.
    * ``/?c=<id>`` (links shared before the share page moved) is redirected to ``share/?c=<id>``.
    * Uploads and event requests (:class:`FileInputGuard`): bounded, bound to their caller, admitted atomically.
    """

    def __init__(self, app, studio, share_path: str = "/share", downloads: Path | None = None, blocks=(),
                 served: ServedFiles | None = None, allow_origins=()):
        self.app = app
        self.studio = studio
        self.share_path = share_path
        self.downloads = Path(downloads).resolve() if downloads else None
        self.served = served if served is not None else ServedFiles()
        self.allow_origins = {o.strip().rstrip("/").lower() for o in allow_origins if o.strip()}
        self.guard = FileInputGuard(studio, share_path, blocks)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path") or "/"
        method = scope.get("method") or "GET"
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        origin = headers.get("origin")
        cross = cross_site(origin, headers)
        allowed = cross and origin is not None and origin.rstrip("/").lower() in self.allow_origins
        raw_send, send = send, self._cors(send, origin if allowed else None)
        if cross:
            if method == "OPTIONS":
                return await self._preflight(raw_send, origin if allowed else None)
            if not allowed and method not in ("GET", "HEAD"):
                return await refuse(send, 403, CROSS_SITE)
            # another site's page never acts with the visitor's browser identity: only with a key it sends itself
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"cookie"]}
            headers.pop("cookie", None)
        route = normalise(path)
        if UNUSED.match(strip_mount(route, self.share_path)) or (
                route.rstrip("/").endswith("/config") and b"deep_link" in scope.get("query_string", b"")):
            return await refuse(send, 404, "")
        cookies = parse_cookies(headers.get("cookie", ""))
        if is_file_route(path):
            return await self._serve_file(scope, receive, send, path, headers, cookies)
        if route.rstrip("/").lower().endswith("/gradio_api/upload_progress"):
            return await self._upload_progress(scope, receive, send, headers, cookies)
        if path in ("", "/", self.share_path) and method == "GET":
            c = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("c")
            if c or path == self.share_path:
                # relative (from "/" and from "/share" alike), so that it works under a proxy's path prefix too
                loc = f"{self.share_path.strip('/')}/" + (f"?c={quote(c[0], safe='')}" if c else "")
                await send({"type": "http.response.start", "status": 307,
                            "headers": [(b"location", loc.encode("latin-1")), (b"content-length", b"0")]})
                return await send({"type": "http.response.body", "body": b""})
        if not cross:
            send = self._with_cookie(scope, headers, cookies, send)
        if method not in ("GET", "HEAD", "OPTIONS"):
            return await self.guard(scope, receive, send, path, headers, cookies, self.app)
        return await self.app(scope, receive, send)

    # --- files ----------------------------------------------------------------------------------------------------
    async def _serve_file(self, scope, receive, send, path: str, headers: dict, cookies: dict):
        """A file route: the file, to its owner only (404 for anyone else, for a file that does not exist, for a URL
        and for anything outside Gradio's cache). Ranges and HEAD as Starlette serves them."""
        owners = self.studio.identity.credentials(headers, cookies)
        real = next((r for r in map(self._servable, file_targets(path)) if r and (
            self.studio.uploads.owns(r, owners) or self.served.owns(r, owners))), "")
        if not real or scope.get("method") not in ("GET", "HEAD"):
            return await refuse(send, 404, "")
        mime = mimetypes.guess_type(real)[0]
        safe = mime in XSS_SAFE_MIMETYPES
        response = FileResponse(real, media_type=mime if safe else "application/octet-stream",
                                filename=Path(real).name, content_disposition_type="inline" if safe else "attachment",
                                headers={"Cache-Control": "private, no-store", "X-Content-Type-Options": "nosniff"})
        await response(scope, receive, send)

    def _servable(self, target: str) -> str:
        """The real path of a file route's target if it may be served at all (a file in Gradio's cache, not in the
        downloads folder, not a URL), else ''."""
        if not target or "://" in target or "\x00" in target:
            return ""
        real = os.path.realpath(target)
        if not in_cache(real) or (self.downloads is not None and Path(real).is_relative_to(self.downloads)):
            return ""
        return real if os.path.isfile(real) else ""

    async def _upload_progress(self, scope, receive, send, headers: dict, cookies: dict):
        """Gradio's upload progress stream, for a caller who may upload (an identity, in multi-user mode) and an id
        such as the page makes; whatever Gradio kept for the id is dropped when the stream ends (it kept a signal
        for every id anyone asked about, forever)."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        upload_id = (query.get("upload_id") or [""])[0]
        if not UPLOAD_ID.fullmatch(upload_id) or (
                self.studio.multi_user and not self.studio.identity.credentials(headers, cookies)):
            return await refuse(send, 404, "Upload not found")
        try:
            return await self.app(scope, receive, send)
        finally:
            gri.forget_upload_progress(upload_id)

    # --- cross-origin ---------------------------------------------------------------------------------------------
    @staticmethod
    def _cors(send, origin: str | None):
        """``send`` without Gradio's CORS headers (it reflects any origin with credentials); for an allowed origin,
        that origin alone, without credentials."""
        async def send_cors(message):
            if message["type"] == "http.response.start":
                hdrs = [(k, v) for k, v in message.get("headers", []) if not k.lower().startswith(b"access-control-")
                        and k.lower() != b"vary"]
                hdrs.append((b"vary", b"Origin"))
                if origin is not None:
                    hdrs.append((b"access-control-allow-origin", origin.encode("latin-1")))
                message = {**message, "headers": hdrs}
            await send(message)

        return send_cors

    @staticmethod
    async def _preflight(send, origin: str | None):
        """A cross-origin preflight: 403 without CORS headers, unless ``origin`` is allowed."""
        if origin is None:
            return await refuse(send, 403, "")
        await send({"type": "http.response.start", "status": 204, "headers": [
            (b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", b"content-type, x-pema-key, authorization"),
            (b"access-control-max-age", b"600"), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

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


def parse_cookies(header: str) -> dict:
    jar = SimpleCookie()
    try:
        jar.load(header)
    except Exception:  # noqa: BLE001 — a malformed Cookie header: treat as none
        return {}
    return {k: m.value for k, m in jar.items()}


def _netloc(scheme: str, netloc: str) -> str:
    netloc = netloc.strip().lower()
    default = {"http": ":80", "https": ":443"}.get(scheme)
    return netloc[: -len(default)] if default and netloc.endswith(default) else netloc


def cross_site(origin: str | None, headers: dict) -> bool:
    """Whether a request comes from another site's page: an ``Origin`` (``null`` included) whose host is not the
    one the request was sent to (``Host``, or a proxy's ``X-Forwarded-Host``), or a browser's own word for a
    cross-site fetch that is not a navigation (a link to the studio is a navigation, and stays welcome)."""
    if origin is not None:
        parts = urlsplit(origin.strip())
        if not parts.scheme or not parts.netloc:
            return True
        mine = _netloc(parts.scheme, parts.netloc)
        hosts = [headers.get("host", "")] + headers.get("x-forwarded-host", "").split(",")[:1]
        return mine not in {_netloc(parts.scheme, h) for h in hosts if h.strip()}
    return headers.get("sec-fetch-site") == "cross-site" and headers.get("sec-fetch-mode") != "navigate"


def normalise(path: str) -> str:
    """A request path as routes are compared here: percent-decoded (twice: what a second decoder would see),
    repeated slashes collapsed."""
    return re.sub(r"/+", "/", unquote(unquote(path))) or "/"


def strip_mount(route: str, share_path: str) -> str:
    return route[len(share_path):] or "/" if route.startswith(share_path + "/") else route


def is_file_route(path: str) -> bool:
    """Gradio's file routes under any mount, prefix, case or encoding (``…/file=<path>``, ``…/gradio_api/file/<path>``,
    the pre-``gradio_api`` ``/file=<path>``)."""
    low = normalise(path).lower()
    return "file=" in low or re.search(r"(^|/)(gradio_api/)?file(/|$)", low) is not None


def file_targets(path: str) -> list[str]:
    """The path a file request names (what follows ``file=`` or ``/file/``) as the server decoded it, and decoded
    once more (a client that encoded twice); each is checked on its own."""
    low = path.lower()
    i = low.find("file=")
    m = re.search(r"(^|/)file/", low)
    raw = path[i + 5:] if i >= 0 else path[m.end():] if m else ""
    return [raw, unquote(raw)] if raw and unquote(raw) != raw else [raw] if raw else []


def in_cache(real: str) -> bool:
    """Under Gradio's upload and cache folder (where uploads and the copies of returned files live)."""
    return Path(real).is_relative_to(os.path.realpath(gri.upload_folder()))


async def refuse(send, status: int, message: str) -> None:
    """Answer a request at once (nothing of it reaches Gradio) with ``{"detail": message}``."""
    body = json.dumps({"detail": message}).encode() if message else b""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


FILE_DATA_KEYS = {"path", "url", "size", "orig_name", "mime_type", "is_stream", "meta"}
FILE_META = ('A file is sent as Gradio\'s FileData, with "meta": {"_type": "gradio.FileData"} (gradio_client\'s '
             'handle_file() writes it).')
NO_SUCH_EVENT = "No such event or API endpoint in this app (see its API page for the names)."
EVENT_ROUTE = re.compile(r"/gradio_api/(queue/join|(call/v2|call|run|api)/(?P<api>[^/]+))/?$")


def file_values(value, depth: int = 0) -> list[dict]:
    """Every value that Gradio would treat as a file in a request's JSON (a ``FileData``: a dict with a ``path``
    and Gradio's file marker, or with only FileData's fields), however deeply nested."""
    if depth > 64:
        raise ValueError("nested too deeply")
    if isinstance(value, dict):
        meta = value.get("meta")
        if "path" in value and ((isinstance(meta, dict) and meta.get("_type") == "gradio.FileData")
                                or set(value) <= FILE_DATA_KEYS):
            return [value]
        return [f for v in value.values() for f in file_values(v, depth + 1)]
    if isinstance(value, list):
        return [f for v in value for f in file_values(v, depth + 1)]
    return []


def file_paths(value) -> list:
    return [f["path"] for f in file_values(value)]


NOT_FINITE = "NaN and Infinity are not numbers JSON allows (nor numbers too large for one); send finite numbers."


class NotFinite(ValueError):
    pass


def not_finite(constant: str):
    raise NotFinite(constant)


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotFinite(text)
    return value


def api_parameters(fn) -> list[tuple[str, object]]:
    """``(name, default)`` of an API endpoint's arguments as a client sends them (``gr.Request`` is not one)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [(p.name, p.default) for p in sig.parameters.values()
            if p.annotation is not gr.Request and p.annotation != "gr.Request" and p.name != "request"]


def multipart_boundary(content_type: str) -> bytes | None:
    m = re.match(r'\s*multipart/form-data\s*;.*?\bboundary="?([^";]+)"?', content_type or "", re.I)
    return m.group(1).strip().encode("latin-1") if m and 0 < len(m.group(1).strip()) <= 200 else None


class FileInputGuard:
    """The server's checks on what a stranger sends to Gradio, applied before Gradio reads or stores anything.

    * ``POST …/gradio_api/upload``: refused without an identity (multi-user mode) and on the share page; admitted
      within the caller's bounds (``studio.uploads``: files per owner — each file part reserved as the body
      arrives, the body held back until all of it is counted —, bytes overall; the body's declared size); each
      stored file is moved into a folder of its own and recorded against the caller's credentials before the
      answer (with the new paths) reaches the caller.
    * Every other ``POST …/gradio_api/…`` (queue joins, API calls): the body is bounded (``Limits.request_bytes``),
      every file it names must be one of the caller's own live uploads (never on the share page) sent as a
      FileData, an event or endpoint must exist, and a caller may have at most ``Limits.owner_queue_cap()`` events
      queued or running: counted and reserved in one step, so concurrent requests cannot pass it.
    """

    def __init__(self, studio, share_path: str, blocks=()):
        self.studio, self.share_path, self.blocks = studio, share_path, list(blocks)
        self._lock = threading.Lock()
        self._admitted: dict[int, frozenset] = {}  # event requests let through whose event may not be queued yet
        self._tickets = itertools.count(1)
        self._upload_lock: asyncio.Lock | None = None

    async def __call__(self, scope, receive, send, path: str, headers: dict, cookies: dict, app):
        studio = self.studio
        path = normalise(path).rstrip("/") or "/"
        owners = studio.identity.credentials(headers, cookies)
        on_share = path.startswith(self.share_path + "/") or path == self.share_path
        declared = headers.get("content-length")
        try:
            declared = int(declared) if declared is not None else None
        except ValueError:
            return await refuse(send, 400, "Invalid Content-Length.")
        if path.endswith("/gradio_api/upload"):
            return await self._upload(scope, receive, send, owners, on_share, declared, headers, app)
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
            value = json.loads(body, parse_constant=not_finite, parse_float=finite_float) if body else None
        except NotFinite:
            return await refuse(send, 400, NOT_FINITE)
        except (ValueError, RecursionError):
            value = None  # not JSON (or not JSON Gradio could read): Gradio refuses it itself; it names no file
        try:
            files = file_values(value)
        except ValueError:
            return await refuse(send, 400, "The request is nested too deeply.")
        for f in files:
            if on_share or not studio.uploads.owns(f["path"], owners):
                return await refuse(send, 403, NOT_YOURS)
            if not isinstance(f.get("meta"), dict):
                return await refuse(send, 400, FILE_META)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        event = EVENT_ROUTE.search(path)
        if event is None:
            return await app(scope, replay, send)
        if not self._known(event.group("api"), value, on_share):
            return await refuse(send, 404, NO_SUCH_EVENT)
        completed = self._with_defaults(event.group("api"), value, on_share)
        if isinstance(completed, str):
            return await refuse(send, 400, completed)
        if completed is not None:  # an earlier release's arguments: the newer ones take their defaults
            body = json.dumps(completed).encode()
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
                     + [(b"content-length", str(len(body)).encode())]}
        ticket, waiting = self._admit(owners)
        if ticket is None:
            cap = studio.limits.owner_queue_cap()
            return await refuse(send, 429, f"You have {waiting} requests queued or running (the limit per user is "
                                           f"{cap}); wait for them to finish ({hint('queued_per_owner')}).")
        try:
            return await app(scope, replay, send)
        finally:
            with self._lock:  # the event is in Gradio's queue now (or was refused): counted there from here on
                self._admitted.pop(ticket, None)

    def _known(self, api_name: str | None, value, on_share: bool) -> bool:
        """Whether the event (``fn_index``) or endpoint (``api_name``) a request names exists in its app."""
        blocks = self.blocks[1 if on_share else 0] if len(self.blocks) > (1 if on_share else 0) else None
        fns = gri.event_functions(blocks)
        if fns is None:
            return True
        index = value.get("fn_index") if isinstance(value, dict) else None
        if isinstance(index, int) and not isinstance(index, bool):
            return index in fns  # as Gradio routes it: a given fn_index wins over the path's name (run/predict)
        return api_name is None or any(getattr(f, "api_name", None) == api_name for f in fns.values())

    def _with_defaults(self, api_name: str | None, value, on_share: bool):
        """An API call as its endpoint takes it: with fewer arguments than it takes (a client written for an earlier
        release, before an argument was added), the request with each missing argument's default; a message
        naming the first missing argument that has no default, or the first argument of the wrong type or out of
        its declared range (``ui.api.check_arguments``); else None (nothing to change; page events are left
        alone)."""
        blocks = self.blocks[1 if on_share else 0] if len(self.blocks) > (1 if on_share else 0) else None
        fns = gri.event_functions(blocks)
        if fns is None or not isinstance(value, dict) or not isinstance(value.get("data"), list):
            return None
        index = value.get("fn_index")
        if isinstance(index, int) and not isinstance(index, bool):
            fn = fns.get(index)
        else:
            fn = next((f for f in fns.values() if getattr(f, "api_name", None) == api_name), None)
        if fn is None or not is_api_endpoint(fn):
            return None
        params = api_parameters(fn.fn)
        if len(params) != len(fn.inputs):
            return None
        data = list(value["data"])
        for name, default in params[len(data):]:
            if default is inspect.Parameter.empty:
                return f"The argument {name!r} is missing (this endpoint takes {', '.join(n for n, _ in params)})."
            data.append(default)
        # null for an argument that has a default: the default (as gradio_client's own filling does)
        data = [default if v is None and default is not inspect.Parameter.empty else v
                for v, (_, default) in zip(data, params)] + data[len(params):]
        wrong = check_arguments(fn.fn, getattr(fn, "api_name", None) or "", data)
        if wrong:
            return wrong
        return {**value, "data": data} if data != value["data"] else None

    def _admit(self, owners: frozenset) -> tuple[int | None, int]:
        """Count the caller's events (queued, running, let through a moment ago) and, within the bound, reserve
        one more — in one step under the lock: ``(ticket, count)``, ticket ``None`` when refused."""
        cap = self.studio.limits.owner_queue_cap()
        with self._lock:
            n = self._waiting(owners) + sum(bool(o & owners) if owners else not o for o in self._admitted.values())
            if cap and n >= cap:
                return None, n
            ticket = next(self._tickets)
            self._admitted[ticket] = owners
            return ticket, n

    def _waiting(self, owners: frozenset) -> int:
        """Events of these owners (of callers with no identity, when empty) queued or running in the apps."""
        n = 0
        for blocks in self.blocks:
            for event in gri.queued_events(blocks):
                req = getattr(event, "request", None)
                theirs = self.studio.identity.credentials(dict(getattr(req, "headers", {}) or {}),
                                                          dict(getattr(req, "cookies", {}) or {}))
                n += bool(theirs & owners) if owners else not theirs
        return n

    async def _upload(self, scope, receive, send, owners, on_share: bool, declared: int | None, headers: dict, app):
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
        boundary = multipart_boundary(headers.get("content-type", ""))
        if boundary is None:
            return await refuse(send, 400, "An upload is a multipart/form-data request.")
        upload_id = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("upload_id")
        if upload_id is not None and not UPLOAD_ID.fullmatch(upload_id[0]):
            return await refuse(send, 400, "An upload's upload_id is a short token (letters, digits, - and _).")
        try:
            ticket = studio.uploads.admit(owners, declared or 0)
        except UserError as e:
            return await refuse(send, 429, str(e))
        spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)
        try:
            # The whole body is read and its file parts counted (and reserved) before Gradio sees any of it: a
            # request over the bound stores nothing. Every "--boundary" counts (a part cannot contain it).
            delim, tail, end, seen, got, more = b"--" + boundary, b"", b"", 0, 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                got += len(chunk)
                if bound and got > bound:
                    return await refuse(send, 413, f"The upload is over {bound / 1e6:.1f} MB, the limit "
                                                   f"({hint('upload_bytes')}).")
                window = tail + chunk
                seen += window.count(delim)
                tail = window[-(len(delim) - 1):]
                end = (end + chunk)[-(len(delim) + 8):]
                spool.write(chunk)
                closed = not more and end.rstrip().endswith(delim + b"--")
                try:  # while the body arrives, the last delimiter seen may open a part not yet complete
                    studio.uploads.grow(ticket, max(0, seen - 1) if more or closed else seen)
                except UserError as e:
                    return await refuse(send, 413 if isinstance(e, TooManyParts) else 429, str(e))
            if self._upload_lock is None:
                self._upload_lock = asyncio.Lock()
            async with self._upload_lock:  # Gradio names a stored file by its contents: one upload at a time
                return await self._store(scope, receive, send, spool, owners, ticket, app)
        finally:
            spool.close()
            studio.uploads.release(ticket)
            gri.forget_upload_progress(None)  # a finished upload's progress nobody reads: within the bound

    async def _store(self, scope, receive, send, spool, owners, ticket, app):
        """Hand the counted body to Gradio, move what it stored into folders of their own, record them, answer."""
        spool.seek(0)
        start, chunks, done = None, [], False

        async def replay():
            nonlocal done
            if done:
                return await receive()
            block = spool.read(1 << 20)
            done = not block
            return {"type": "http.request", "body": block, "more_body": bool(block)}

        async def keep(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            else:
                chunks.append(message.get("body", b""))

        await app(scope, replay, keep)
        body = b"".join(chunks)
        if start is None:
            return await refuse(send, 500, "The upload was not stored.")
        if start.get("status") == 200:
            try:
                stored = json.loads(body)
            except ValueError:
                stored = []
            stored = [p for p in stored if isinstance(p, str)] if isinstance(stored, list) else []
            moved = [own_folder(p, owners) for p in stored]
            for blocks in self.blocks[:1]:
                gri.track_moved_uploads(blocks, stored, moved)
            stored = moved
            self.studio.uploads.record(ticket, stored)
            body = json.dumps(stored).encode()
        hdrs = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*hdrs, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class Served:
    """The running server: ``url``, ``close()``; ``blocks`` are the studio's and the share page's Gradio apps;
    ``files`` the record of which owner may fetch which returned file."""

    def __init__(self, server: Server, blocks: list[gr.Blocks], url: str, files: ServedFiles | None = None):
        self.server, self.blocks, self.url, self.files = server, blocks, url, files

    def close(self) -> None:
        for b in self.blocks:
            gri.stop(b)
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
          downloads: Path | None = None, allow_origins=None) -> Served:
    """Mount both Gradio apps on one FastAPI app with the middleware and start the server in a thread.

    ``downloads``: the folder of the owners' evaluation files and plug-in packages (outside the data directory).
    The studio hands files from it to its page (Gradio copies each into its cache, under a name made from the
    file's contents): the copy is served only to the owner whose event returned it, and nothing is served from
    the folder itself. ``allow_origins``: other sites whose pages may call the studio (default
    ``$PEMA_ALLOW_ORIGINS``, comma-separated; none)."""
    if allow_origins is None:
        allow_origins = [o for o in os.environ.get(ALLOW_ORIGINS_ENV, "").split(",") if o.strip()]
    if downloads is not None:
        mark_downloads(Path(downloads))
        sweep_downloads(Path(downloads), Path(downloads).parent)
    files = ServedFiles()
    for blocks in (studio_blocks, share_blocks):
        grant_returned_files(blocks, files, studio.identity)
    sweeper = ResultSweeper([studio_blocks, share_blocks])
    for blocks in (studio_blocks, share_blocks):
        gri.wrap_events(blocks, sweeper.noting)
        if studio.multi_user:
            hide_server_paths(blocks, studio.root)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.get_running_loop().create_task(sweeper.run())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(OwnerCookieMiddleware, studio=studio, downloads=downloads,
                       blocks=[studio_blocks, share_blocks], served=files, allow_origins=allow_origins)
    for blocks in (studio_blocks, share_blocks):  # read by mount_gradio_app: each app cleans its own cache
        gri.default_delete_cache(blocks, DELETE_CACHE)
        bound_sessions(blocks, studio.limits.sessions)
    common = dict(server_name=host, server_port=port, ssr_mode=False, show_error=True, theme=theme, css=css,
                  head=head, max_file_size=max_file_size, allowed_paths=None,
                  blocked_paths=blocked_paths(studio.root))
    # before the mounts: Gradio's status tracker with the teardown its timer loop lacks (else an idle tab runs a
    # requestAnimationFrame loop from its loading screen for as long as it stays open)
    gri.serve_fixed_frontend(app, ["/share", "/"])
    gr.mount_gradio_app(app, share_blocks, path="/share", footer_links=[], run_history=False, **common)
    gr.mount_gradio_app(app, studio_blocks, path="/", footer_links=["api"], run_history=False, **common)
    for blocks in (studio_blocks, share_blocks):  # Gradio checks events' files only in an app that has launched
        gri.mark_launched(blocks)
    _check_port(host, port)
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=1))  # open event streams are cut after 1 s
    server.run_in_thread()
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    served = Served(server, [studio_blocks, share_blocks], f"http://{shown}:{port}/", files)
    served.sweeper = sweeper
    return served


def hide_server_paths(blocks: gr.Blocks, root: Path) -> None:
    """Multi-user mode: an event's error message names no path of the data directory and no temporary file, on one
    line (where the data lives is the operator's business; a kNN plug-in whose memory its owner deleted said
    "…but /data/pema-studio/memories/mem-… is gone"). Errors without such a path are left as they are."""

    async def hiding(run, call: EventCall):
        try:
            return await run()
        except gr.Error as e:
            shown = without_server_paths(str(e.message), root)
            if shown != e.message:
                e.message = shown
            raise
        except Exception as e:  # noqa: BLE001 — an unexpected error is shown too (show_error): without the paths
            text = str(e)
            shown = without_server_paths(text, root)
            if shown != text:
                raise gr.Error(shown) from e
            raise

    gri.wrap_events(blocks, hiding)


def forget_api_sessions(blocks: gr.Blocks) -> None:
    """Gradio makes a session state (a copy of the app's whole config, large for the studio) for every session
    hash it sees, and raw-HTTP calls name a new one each time. An API endpoint needs none: after its event, the
    session goes unless a page event has used it (a browser tab's session stays, within ``Limits.sessions``)."""

    async def forgetting(run, call: EventCall):
        api = is_api_endpoint(call.block_fn)
        if call.state is not None and not api:
            call.state.pema_page = True
        try:
            return await run()
        finally:
            if api and call.session_hash and not getattr(call.state, "pema_page", False):
                gri.forget_session(blocks, call.session_hash, call.state)

    gri.wrap_events(blocks, forgetting)


RESULT_KEEP_S = 120.0  # an event's result waits this long (at least) for its caller to read it
SWEEP_S = 30.0
UNREAD_PER_SESSION = 48  # messages one session's queue keeps unread (about 16 events' results), the oldest out first
UNREAD_BYTES = 64_000_000  # all sessions' unread results together (their JSON), the oldest sessions' out first


class ResultSweeper:
    """Gradio keeps an event's messages until its caller reads them, and an empty message queue per session hash
    after that, forever: a caller that never reads (or names a fresh session each time) grows the server. Every
    ``SWEEP_S`` seconds, in the server's event loop (so never between a join's steps), the messages of a session
    with no event queued or running that have waited ``RESULT_KEEP_S`` go. Time alone does not bound them (a
    session joined back to back is never idle; fresh sessions' results wait two minutes each), so when each event
    starts (:meth:`trim`) a session keeps at most ``UNREAD_PER_SESSION`` unread messages of ended events, and while
    all unread results together (their JSON, counted as each event ends) are over ``UNREAD_BYTES``, the session
    whose unread results are oldest loses its ended events' messages. A reader with an open stream never has any
    waiting, and the messages of a running event are never dropped."""

    def __init__(self, blocks: list[gr.Blocks], keep_s: float = RESULT_KEEP_S, clock=time.monotonic):
        self.blocks, self.keep_s, self.clock = list(blocks), float(keep_s), clock
        self._idle: list[dict[str, float]] = [{} for _ in self.blocks]
        self._last_event: dict[str, float] = {}  # session → when an event of it last started or ended
        self.per_session, self.max_bytes = UNREAD_PER_SESSION, UNREAD_BYTES
        self._unread: dict[str, list] = {}  # session → [when its oldest unread result came, bytes of its results]

    def note(self, session: str | None) -> None:
        """An event of ``session`` starts or ends: its messages are in use (a page polling between two sweeps, or
        an open stream about to read an event's result), so they do not count as waiting until ``keep_s`` after."""
        if session:
            self._last_event[session] = self.clock()

    async def noting(self, run, call: EventCall):
        """An events wrapper (``gri.wrap_events``) that notes each event's session when it starts and ends."""
        self.note(call.session_hash)
        self.trim()
        try:
            out = await run()
        finally:
            self.note(call.session_hash)
        self.count(call.session_hash, out)
        return out

    def count(self, session: str | None, out) -> None:
        """An event of ``session`` returned ``out``: its result waits in the session's queue until read."""
        if not session or not isinstance(out, dict):
            return
        try:
            size = len(json.dumps(out.get("data"), default=str))
        except (TypeError, ValueError, RecursionError):
            return
        self._unread.setdefault(session, [self.clock(), 0])[1] += size

    def trim(self) -> int:
        """Keep unread messages within ``per_session`` per session and ``max_bytes`` in all (class docstring); the
        number of messages dropped."""
        dropped, waiting = 0, set()
        for blocks in self.blocks:
            for session in gri.sessions_with_messages(blocks):
                dropped += gri.drop_ended_messages(blocks, session, self.per_session)
                if gri.waiting_messages(blocks, session):
                    waiting.add(session)
        for session in [s for s in self._unread if s not in waiting]:
            del self._unread[session]  # read (or dropped): none of its results waits
        total = sum(size for _, size in self._unread.values())
        for session in sorted(self._unread, key=lambda s: self._unread[s][0])[:-1]:  # the newest always stays
            if total <= self.max_bytes:
                break
            total -= self._unread.pop(session)[1]
            dropped += sum(gri.drop_ended_messages(blocks, session, 0) for blocks in self.blocks)
        return dropped

    def sweep(self) -> int:
        """Drop what has waited long enough; the number of sessions dropped."""
        now, dropped, seen = self.clock(), 0, set()
        for blocks, idle in zip(self.blocks, self._idle):
            busy = {e.session_hash for e in gri.queued_events(blocks)}
            pending = set(gri.sessions_with_messages(blocks))
            seen |= pending
            for session in [s for s in idle if s not in pending or s in busy]:
                idle.pop(session, None)
            for session in pending:
                if session in busy:
                    continue
                since = max(idle.setdefault(session, now), self._last_event.get(session, -math.inf))
                if now - since >= self.keep_s:
                    gri.drop_session_messages(blocks, session)
                    idle.pop(session, None)
                    dropped += 1
        for session in [s for s in self._last_event if s not in seen]:
            del self._last_event[session]
        self.trim()
        return dropped

    async def run(self, every: float = SWEEP_S) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 — a sweep must never stop the server; the next one tries again
                pass


def bound_sessions(blocks: gr.Blocks, sessions: int) -> None:
    """Gradio's bound on kept session states (``state_session_capacity``; read when the app is mounted) and on its
    event analytics (no page reads them: the monitoring route is off)."""
    gri.set_session_capacity(blocks, int(sessions) if sessions else 10000)
    gri.bound_analytics(blocks, 64)
    forget_api_sessions(blocks)


def grant_returned_files(blocks: gr.Blocks, files: ServedFiles, identity) -> None:
    """Record every file an event of ``blocks`` returns (its copy in Gradio's cache) against the credentials of the
    request that ran the event, so the file route serves it to that owner alone."""

    async def granting(run, call: EventCall):
        out = await run()
        request = call.request
        paths = [f["path"] for f in returned_files(out.get("data") if isinstance(out, dict) else None)]
        if paths and request is not None:
            files.grant(paths, identity.credentials(dict(getattr(request, "headers", {}) or {}),
                                                    dict(getattr(request, "cookies", {}) or {})))
        return out

    gri.wrap_events(blocks, granting)


def returned_files(value, depth: int = 0) -> list[dict]:
    """The file values (dicts with a string ``path`` and a ``url`` or Gradio's file marker) in an event's output."""
    if depth > 32:
        return []
    if isinstance(value, dict):
        here = [value] if isinstance(value.get("path"), str) and ("url" in value or "meta" in value) else []
        return here + [f for v in value.values() for f in returned_files(v, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [f for v in value for f in returned_files(v, depth + 1)]
    return []


def blocked_paths(data_dir: Path) -> list[str]:
    """What Gradio must never read or serve: the data directory (catalog, memories, plug-ins, the owners' secret) —
    all of it, or, where Gradio's own upload folder lies inside it, everything in it but that folder."""
    root = Path(data_dir).resolve()
    uploads = Path(gri.upload_folder()).resolve()
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
