"""Serving: one FastAPI app with the studio (``/``) and the share page (``/share/``) mounted as two Gradio apps, an
ASGI middleware that gives each browser its anonymous key (multi-user mode) and sends old share links on, and the
uvicorn server (in a thread, so tests and ``app.py`` can stop it)."""
from __future__ import annotations

import socket
import time
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import parse_qs, quote

import gradio as gr
import uvicorn
from fastapi import FastAPI
from gradio.http_server import Server

from studio.identity import COOKIE

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
    """

    def __init__(self, app, studio, share_path: str = "/share", downloads: Path | None = None):
        self.app = app
        self.studio = studio
        self.share_path = share_path
        self.downloads = Path(downloads).resolve() if downloads else None

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
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-length", b"0")]})
            return await send({"type": "http.response.body", "body": b""})
        if path in ("", "/", self.share_path) and scope.get("method") == "GET":
            c = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("c")
            if c or path == self.share_path:
                # relative (from "/" and from "/share" alike), so that it works under a proxy's path prefix too
                loc = f"{self.share_path.strip('/')}/" + (f"?c={quote(c[0], safe='')}" if c else "")
                await send({"type": "http.response.start", "status": 307,
                            "headers": [(b"location", loc.encode("latin-1")), (b"content-length", b"0")]})
                return await send({"type": "http.response.body", "body": b""})
        if not self.studio.multi_user or path.startswith(self.share_path):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        jar = SimpleCookie()
        try:
            jar.load(headers.get("cookie", ""))
        except Exception:  # noqa: BLE001 — a malformed Cookie header: treat as none
            jar = SimpleCookie()
        have = jar[COOKIE].value if COOKIE in jar else None
        if self.studio.identity.owner_of_key(have) is not None:
            return await self.app(scope, receive, send)
        https = scope.get("scheme") == "https" or \
            headers.get("x-forwarded-proto", "").split(",")[0].strip() == "https"
        attrs = "; Secure; SameSite=None; Partitioned" if https else "; SameSite=Lax"
        value = (f"{COOKIE}={self.studio.identity.new_browser_key()}; Path=/; Max-Age={COOKIE_MAX_AGE}; "
                 f"HttpOnly{attrs}").encode("latin-1")

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", value)]}
            await send(message)

        return await self.app(scope, receive, send_with_cookie)


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

    ``downloads``: the folder of the owners' evaluation downloads (under the data directory). The studio may hand
    files from it to its page (Gradio copies each into its cache, under a name made from the file's contents), but
    nobody may fetch them there by path (the middleware answers 404)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(OwnerCookieMiddleware, studio=studio, downloads=downloads)
    for blocks in (studio_blocks, share_blocks):  # read by mount_gradio_app: each app cleans its own cache
        blocks.delete_cache = blocks.delete_cache or DELETE_CACHE
    common = dict(server_name=host, server_port=port, ssr_mode=False, show_error=True, theme=theme, css=css,
                  head=head, max_file_size=max_file_size)
    gr.mount_gradio_app(app, share_blocks, path="/share", footer_links=[], run_history=False, **common)
    gr.mount_gradio_app(app, studio_blocks, path="/", footer_links=["api"], run_history=False,
                        allowed_paths=[str(downloads)] if downloads else None, **common)
    _check_port(host, port)
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=1))  # open event streams are cut after 1 s
    server.run_in_thread()
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return Served(server, [studio_blocks, share_blocks], f"http://{shown}:{port}/")


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"Cannot listen on {host}:{port} ({e.strerror}); is another studio running there? "
                          f"Choose another port with --port.") from None
