"""The model owner's service: f(c), the final norm + W_hd, the tokenizer's files and decode sessions over HTTP.

``OwnerService`` holds the backbone and does the work (validation, prefix KV cache, sessions); ``make_app`` wraps
it in a FastAPI app behind one ASGI guard (request-rate bucket per client address, body-size limit, bearer token);
``serve`` runs it with uvicorn (``python -m offsite serve``). The protocol is in ``offsite.protocol``.

The arithmetic mirrors the local code exactly so that both sides get the same numbers: ``/v1/fc`` runs a
right-padded batch over the shared prefix's KV cache as ``memories.build`` does, a session's prefill and steps
are ``engine.prefill`` / ``forward_step`` for one source. One lock serialises every use of the model.
Nothing here returns a decoder weight: the head file holds only the final norm's parameters and W_hd.
"""
# No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations (``Request``) at runtime.
import base64
import copy
import hashlib
import hmac
import json
import math
import secrets
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from backbone.model import Backbone, generate_greedy
from ground.errors import UserError
from offsite.protocol import LM_MODES, PROTOCOL_VERSION, Limits, pack

TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja")  # tokenizer files (vocabularies, merges, templates)


class ApiError(Exception):
    """A refused request: HTTP ``status`` and the reason, sent as ``{"error": reason}``."""

    def __init__(self, status: int, reason: str, headers: dict | None = None):
        super().__init__(reason)
        self.status, self.reason, self.headers = status, reason, headers or {}


# --- request checking ----------------------------------------------------------------------------------------------
def _int(v, what: str, low: int, high: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(422, f"{what} must be an integer, not {type(v).__name__} {str(v)[:40]!r}")
    if not low <= v <= high:
        raise ApiError(422, f"{what} = {v} is outside [{low}, {high}]")
    return v


def _ids(v, what: str, vocab: int, max_len: int, allow_empty: bool = False) -> list[int]:
    if not isinstance(v, list):
        raise ApiError(422, f"{what} must be a list of token ids")
    if not v and not allow_empty:
        raise ApiError(422, f"{what} is empty")
    if len(v) > max_len:
        raise ApiError(413, f"{what} has {len(v)} tokens (limit {max_len})")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ApiError(422, f"{what}[{i}] = {str(t)[:40]} is not a token id (an integer in [0, {vocab}))")
    return v


def _list(v, what: str, max_len: int, status_too_long: int = 413) -> list:
    if not isinstance(v, list) or not v:
        raise ApiError(422, f"{what} must be a non-empty list")
    if len(v) > max_len:
        raise ApiError(status_too_long, f"{what} has {len(v)} rows (limit {max_len})")
    return v


def _body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ApiError(400, "the request body is not JSON (or nested too deeply)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _only(body: dict, allowed: tuple[str, ...]) -> None:
    extra = sorted(set(body) - set(allowed))
    if extra:
        raise ApiError(422, f"unknown field(s) {', '.join(map(repr, extra))}; this request takes "
                            f"{', '.join(allowed)}")


# --- the service ---------------------------------------------------------------------------------------------------
class PrefixStore:
    """A small LRU of prompt-prefix KV caches on the owner's side: the instruction and few-shot examples every
    memory build batch and every decode of one prompt share. A request's prefix reuses the longest stored prefix
    that starts it and encodes only the rest (a per-step offsite build grows its prefix one token at a time)."""

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: OrderedDict[tuple, object] = OrderedDict()

    def get(self, backbone: Backbone, prefix: list[int]):
        """A private copy of the KV cache of ``prefix`` (encoded now, or from the store)."""
        key = tuple(prefix)
        best = max((k for k in self.entries if len(k) <= len(key) and key[:len(k)] == k), key=len, default=None)
        if best == key:
            self.entries.move_to_end(key)
            return copy.deepcopy(self.entries[key])
        past = copy.deepcopy(self.entries[best]) if best else None
        rest = prefix[len(best):] if best else prefix
        with torch.no_grad():
            _, out = backbone.forward_fc(torch.tensor([rest], device=backbone.device), past_key_values=past,
                                         use_cache=True)
        self.entries[key] = out.past_key_values
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return copy.deepcopy(out.past_key_values)


@dataclass
class Session:
    id: str
    cache: object
    rows: int
    lm: str
    length: int
    steps: int = 0
    last_used: float = 0.0


class OwnerService:
    """Everything the owner does, without HTTP (``make_app`` serves it). Methods take a parsed JSON body and return
    bytes / JSON-able objects, or raise :class:`ApiError`."""

    def __init__(self, backbone: Backbone, limits: Limits | None = None, workdir: str | Path | None = None):
        self.bb = backbone
        self.limits = limits or Limits()
        self.lock = threading.Lock()  # one user of the model at a time
        self.sessions: dict[str, Session] = {}
        self.prefixes = PrefixStore()
        self._tmp = tempfile.TemporaryDirectory(prefix="pema-offsite-") if workdir is None else None
        self.workdir = Path(workdir or self._tmp.name)
        self.head_file, self.head_sha256 = self._write_head()
        self.tokenizer_files = self._tokenizer_files()
        h = hashlib.sha256()
        for name in sorted(self.tokenizer_files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.tokenizer_files[name]).digest())
        self.tokenizer_sha256 = h.hexdigest()
        self.started = time.time()
        self.counters = {"fc_rows": 0, "fc_positions": 0, "sessions_opened": 0, "steps": 0, "generated": 0}

    # --- what is handed over -------------------------------------------------------------------------------------
    def _norm_record(self) -> dict:
        norm = getattr(self.bb.final_norm, "original", self.bb.final_norm)  # the model's class, not a fused stand-in
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        return {"module": type(norm).__module__, "class": type(norm).__qualname__,
                "eps": float(eps) if eps is not None else None}

    def _write_head(self) -> tuple[Path, str]:
        """The final norm's parameters and W_hd as one safetensors file (written once; served from disk)."""
        tensors = {f"norm.{k}": v for k, v in self.bb.final_norm.state_dict().items()}
        tensors["lm_head.weight"] = self.bb.lm_head.weight
        rec = self._norm_record()
        data = pack(tensors, {"norm_module": rec["module"], "norm_class": rec["class"], "norm_eps": rec["eps"],
                              "fingerprint": self.bb.fingerprint})
        path = self.workdir / "head.safetensors"
        path.write_bytes(data)
        return path, hashlib.sha256(data).hexdigest()

    def _tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer's own files (vocabulary, merges, special tokens, chat template) — no model weights."""
        with tempfile.TemporaryDirectory() as d:
            self.bb.tokenizer.save_pretrained(d)
            return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())
                    if p.is_file() and p.suffix in TOKENIZER_SUFFIXES}

    def info(self) -> dict:
        bb = self.bb
        return {"protocol": PROTOCOL_VERSION, "name": bb.name, "fingerprint": bb.fingerprint, "chat": bool(bb.chat),
                "hidden_size": bb.hidden_size, "vocab_size": bb.vocab_size, "num_layers": bb.num_layers,
                "softcap": bb.softcap, "dtype": str(bb.dtype).replace("torch.", ""),
                "stop_ids": sorted(int(t) for t in bb.stop_ids),
                "pad_token_id": bb.tokenizer.pad_token_id, "norm": self._norm_record(),
                "head_sha256": self.head_sha256, "head_bytes": self.head_file.stat().st_size,
                "tokenizer_sha256": self.tokenizer_sha256, "limits": self.limits.to_dict(),
                "sessions_open": len(self.sessions)}

    def tokenizer(self) -> dict:
        return {"files": {k: base64.b64encode(v).decode("ascii") for k, v in self.tokenizer_files.items()}}

    # --- f(c), teacher-forced ------------------------------------------------------------------------------------
    def fc(self, body: dict) -> bytes:
        lim, V = self.limits, self.bb.vocab_size
        _only(body, ("prefix", "sequences", "positions"))
        prefix = _ids(body.get("prefix", []), "prefix", V, lim.max_seq_len, allow_empty=True)
        seqs = _list(body.get("sequences"), "sequences", lim.max_batch)
        seqs = [_ids(s, f"sequences[{r}]", V, lim.max_seq_len - len(prefix)) for r, s in enumerate(seqs)]
        total = len(prefix) + sum(len(s) for s in seqs)
        if total > lim.max_tokens:
            raise ApiError(413, f"the request holds {total} tokens (limit {lim.max_tokens}); send fewer rows")
        positions = body.get("positions")
        if positions is None:
            positions = [list(range(len(s))) for s in seqs]
        else:
            if not isinstance(positions, list) or len(positions) != len(seqs):
                raise ApiError(422, f"positions must hold one list per sequence ({len(seqs)})")
            for r, (pos, s) in enumerate(zip(positions, seqs)):
                if not isinstance(pos, list):
                    raise ApiError(422, f"positions[{r}] must be a list of positions")
                if len(pos) > len(s):  # each position once at most: the answer is never larger than the input
                    raise ApiError(422, f"positions[{r}] holds {len(pos)} positions; sequences[{r}] has only "
                                        f"{len(s)}")
                if len(set(p for p in pos if isinstance(p, int))) != len(pos):
                    raise ApiError(422, f"positions[{r}] repeats a position (or holds one that is not a number)")
                for i, p in enumerate(pos):
                    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(s):
                        raise ApiError(422, f"positions[{r}][{i}] = {str(p)[:40]} is not a position of "
                                            f"sequences[{r}] (length {len(s)}: 0 to {len(s) - 1})")
        bb = self.bb
        P, B, width = len(prefix), len(seqs), max(len(s) for s in seqs)
        pad = bb.tokenizer.pad_token_id or 0
        ids = torch.full((B, width), pad, dtype=torch.long)
        mask = torch.zeros((B, P + width), dtype=torch.long)
        mask[:, :P] = 1
        for r, s in enumerate(seqs):  # right-padded, as memories.build's teacher-forced capture
            ids[r, :len(s)] = torch.tensor(s)
            mask[r, P:P + len(s)] = 1
        with self.lock:
            past = self.prefixes.get(bb, prefix) if P else None
            if past is not None:
                past.batch_repeat_interleave(B)
            with torch.no_grad():
                fc, _ = bb.forward_fc(ids, attention_mask=mask, past_key_values=past, use_cache=past is not None)
        fc = fc.float().cpu()
        out = torch.cat([fc[r, torch.tensor(pos, dtype=torch.long)] for r, pos in enumerate(positions)]) \
            if any(positions) else torch.zeros(0, bb.hidden_size)
        self.counters["fc_rows"] += B
        self.counters["fc_positions"] += len(out)
        return pack({"fc": out})

    # --- greedy continuations (synthetic sources of monolingual samples) -----------------------------------------
    def generate(self, body: dict) -> dict:
        lim, V = self.limits, self.bb.vocab_size
        _only(body, ("contexts", "max_new_tokens"))
        ctxs = _list(body.get("contexts"), "contexts", lim.max_batch)
        ctxs = [_ids(c, f"contexts[{r}]", V, lim.max_seq_len) for r, c in enumerate(ctxs)]
        n = _int(body.get("max_new_tokens", 64), "max_new_tokens", 1, lim.max_new_tokens)
        with self.lock:
            outs = generate_greedy(self.bb, ctxs, max_new_tokens=n, batch_size=len(ctxs))
        self.counters["generated"] += sum(len(o) for o in outs)
        return {"outputs": outs}

    # --- decode sessions -----------------------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for sid in [s.id for s in self.sessions.values() if now - s.last_used > self.limits.session_idle_s]:
            self.sessions.pop(sid, None)

    def _lm(self, fc_last: torch.Tensor, mode: str) -> dict:
        if mode == "none":
            return {}
        bb = self.bb
        lp = torch.log_softmax(bb.head_logits(bb.final_norm(fc_last)), dim=-1)
        return {"lm": lp.half() if mode == "half" else lp}

    def open_session(self, body: dict) -> bytes:
        lim, V = self.limits, self.bb.vocab_size
        _only(body, ("context", "rows", "prefix_len", "lm"))
        ctx = _ids(body.get("context"), "context", V, lim.max_seq_len)
        rows = _int(body.get("rows", 1), "rows", 1, lim.max_session_rows)
        P = _int(body.get("prefix_len", 0), "prefix_len", 0, len(ctx) - 1)
        mode = body.get("lm", "full")
        if mode not in LM_MODES:
            raise ApiError(422, f"lm must be one of {', '.join(LM_MODES)}, not {str(mode)[:40]!r}")
        bb = self.bb
        with self.lock:
            self.expire()
            if len(self.sessions) >= lim.max_sessions:
                raise ApiError(429, f"{len(self.sessions)} decode sessions are open (limit {lim.max_sessions}); "
                                    f"close one, or wait: an idle session closes after {lim.session_idle_s:g} s",
                               {"Retry-After": str(max(1, math.ceil(lim.session_idle_s / 10)))})
            past = self.prefixes.get(bb, ctx[:P]) if P else None
            with torch.no_grad():  # engine.prefill for one source: prefix cache, the rest, repeat over rows
                fc, out = bb.forward_fc(torch.tensor([ctx[P:]], device=bb.device), past_key_values=past,
                                        use_cache=True)
                cache = out.past_key_values
                cache.batch_select_indices(torch.zeros(rows, dtype=torch.long, device=bb.device))
                fc_last = fc[:, -1]
                tensors = {"fc": fc_last.float(), **self._lm(fc_last, mode)}
            sid = secrets.token_urlsafe(12)
            self.sessions[sid] = Session(sid, cache, rows, mode, len(ctx), last_used=time.time())
            self.counters["sessions_opened"] += 1
        return pack(tensors, {"session": sid, "rows": rows})

    def _session(self, sid: str) -> Session:
        self.expire()
        s = self.sessions.get(sid)
        if s is None:
            raise ApiError(404, f"no decode session {sid[:40]!r}: it was closed, or idle longer than "
                                f"{self.limits.session_idle_s:g} s, or never opened")
        return s

    def step(self, sid: str, body: dict) -> bytes:
        lim, V, bb = self.limits, self.bb.vocab_size, self.bb
        _only(body, ("tokens", "reorder", "rows"))
        with self.lock:
            s = self._session(sid)
            toks = body.get("tokens")
            if not isinstance(toks, list) or len(toks) != s.rows:
                raise ApiError(422, f"tokens must hold one token id per row of the session ({s.rows})")
            _ids(toks, "tokens", V, s.rows)
            reorder = body.get("reorder")
            if reorder is not None:
                if not isinstance(reorder, list) or len(reorder) != s.rows:
                    raise ApiError(422, f"reorder must hold one row index per row of the session ({s.rows})")
                for i, r in enumerate(reorder):
                    _int(r, f"reorder[{i}]", 0, s.rows - 1)
            want = body.get("rows")
            if want is None:
                want = list(range(s.rows))
            elif not isinstance(want, list) or len(set(map(str, want))) != len(want):
                raise ApiError(422, "rows must be a list of distinct row indices")
            else:
                for i, r in enumerate(want):
                    _int(r, f"rows[{i}]", 0, s.rows - 1)
            if s.steps >= lim.max_steps:
                raise ApiError(422, f"the session has made {s.steps} steps (limit {lim.max_steps})")
            if s.length >= lim.max_seq_len:
                raise ApiError(413, f"the session's sequence has {s.length} tokens (limit {lim.max_seq_len})")
            try:
                with torch.no_grad():  # engine.forward_step, one source (no padding)
                    if reorder is not None:
                        s.cache.reorder_cache(torch.tensor(reorder, device=bb.device))
                    fc, out = bb.forward_fc(torch.tensor(toks, device=bb.device).unsqueeze(1),
                                            past_key_values=s.cache, use_cache=True)
                    s.cache = out.past_key_values
                    fc_last = fc[:, -1][torch.tensor(want, dtype=torch.long, device=bb.device)]
                    tensors = {"fc": fc_last.float(), **self._lm(fc_last, s.lm)}
            except Exception:
                self.sessions.pop(sid, None)  # its cache may be half-updated: never use it again
                raise
            s.steps += 1
            s.length += 1
            s.last_used = time.time()
            self.counters["steps"] += 1
        return pack(tensors, {"session": sid, "step": s.steps})

    def close(self, sid: str) -> dict:
        with self.lock:
            self._session(sid)
            self.sessions.pop(sid, None)
        return {"closed": sid}


# --- HTTP ----------------------------------------------------------------------------------------------------------
class Guard:
    """ASGI middleware in front of every route: the bearer token (all but ``/healthz``), a request-rate token bucket
    per client address — one for requests with the right token, another for all others —, the body-size limit
    (Content-Length, and the bytes actually received)."""

    def __init__(self, app, token: str, limits: Limits):
        self.app, self.token, self.limits = app, token.encode(), limits
        self.buckets: dict[tuple, list[float]] = {}  # (token or stranger, address) -> [tokens, last refill]
        self.lock = threading.Lock()

    async def _refuse(self, send, status: int, reason: str, headers: dict | None = None) -> None:
        body = json.dumps({"error": reason}).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})

    def _allow(self, who) -> float:
        """0 when the request may go on, else the seconds until it could."""
        lim = self.limits
        now = time.monotonic()
        with self.lock:
            if len(self.buckets) > 10000:  # forget the quietest addresses rather than grow without bound
                self.buckets = {k: v for k, v in self.buckets.items() if now - v[1] < 60}
            tokens, last = self.buckets.get(who, [float(lim.burst), now])
            tokens = min(float(lim.burst), tokens + (now - last) * lim.rate)
            if tokens < 1.0:
                self.buckets[who] = [tokens, now]
                return (1.0 - tokens) / lim.rate
            self.buckets[who] = [tokens - 1.0, now]
            return 0.0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        who = (scope.get("client") or ("?", 0))[0]
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        token_ok = auth.startswith(b"Bearer ") and hmac.compare_digest(auth[7:].strip(), self.token)
        # The token is checked first: the token holder and strangers at the same address (a NAT, a proxy) count in
        # separate buckets, so strangers cannot spend the holder's requests; wrong tokens count as strangers'.
        wait = self._allow(("token" if token_ok else "stranger", who))
        if wait:
            return await self._refuse(send, 429, f"too many requests (limit {self.limits.rate:g}/s per client, "
                                                 f"bursts of {self.limits.burst}); "
                                                 f"retry after {max(1, math.ceil(wait))} s",
                                      {"Retry-After": str(max(1, math.ceil(wait)))})
        if scope.get("path") != "/healthz" and not token_ok:
            if not auth.startswith(b"Bearer "):
                return await self._refuse(send, 401, "missing bearer token (Authorization: Bearer <token>; "
                                                     "clients read $PEMA_REMOTE_TOKEN)",
                                          {"WWW-Authenticate": "Bearer"})
            return await self._refuse(send, 401, "wrong bearer token", {"WWW-Authenticate": "Bearer"})
        limit = self.limits.max_body_bytes
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            return await self._refuse(send, 400, "malformed Content-Length")
        if declared > limit:
            return await self._refuse(send, 413, f"request body of {declared} bytes (limit {limit})")
        # Read the body here, counting (a chunked body has no Content-Length), then hand it to the app.
        chunks, got = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # the client is gone: nothing to answer
            chunks.append(msg.get("body", b""))
            got += len(chunks[-1])
            if got > limit:
                return await self._refuse(send, 413, f"request body over {limit} bytes")
            if not msg.get("more_body"):
                break
        data, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()  # after the body: only the disconnect is left to wait for

        await self.app(scope, replay, send)


def make_app(service: OwnerService, token: str):
    """The FastAPI app of ``service`` behind :class:`Guard` (no docs pages: nothing to browse)."""
    from fastapi import FastAPI, Request  # heavy: only the owner's process serves HTTP
    from fastapi.responses import FileResponse, JSONResponse, Response
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    if not token:
        raise UserError("The owner's service needs a bearer token (--token or $PEMA_REMOTE_TOKEN).")
    app = FastAPI(title="PEMA offsite model owner", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse({"error": exc.reason}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(UserError)
    async def _user_error(request, exc: UserError):
        return JSONResponse({"error": str(exc)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        reason = {404: f"no such endpoint {request.url.path[:80]!r}", 405: "method not allowed"} \
            .get(exc.status_code, str(exc.detail))
        return JSONResponse({"error": reason}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        print(f"offsite: internal error on {request.url.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return JSONResponse({"error": "internal error (see the owner's log)"}, status_code=500)

    binary = "application/octet-stream"

    async def body_of(request: Request) -> dict:
        return _body(await request.body())

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get("/v1/info")
    async def info():
        return service.info()

    @app.get("/v1/head")
    async def head():
        return FileResponse(service.head_file, media_type=binary, filename="head.safetensors")

    @app.get("/v1/tokenizer")
    async def tokenizer():
        return service.tokenizer()

    @app.post("/v1/fc")
    async def fc(request: Request):
        body = await body_of(request)
        return Response(await run_in_threadpool(service.fc, body), media_type=binary)

    @app.post("/v1/generate")
    async def generate(request: Request):
        body = await body_of(request)
        return await run_in_threadpool(service.generate, body)

    @app.post("/v1/sessions")
    async def open_session(request: Request):
        body = await body_of(request)
        return Response(await run_in_threadpool(service.open_session, body), media_type=binary)

    @app.post("/v1/sessions/{sid}/step")
    async def step(sid: str, request: Request):
        body = await body_of(request)
        return Response(await run_in_threadpool(service.step, sid, body), media_type=binary)

    @app.delete("/v1/sessions/{sid}")
    async def close(sid: str):
        return await run_in_threadpool(service.close, sid)

    return Guard(app, token, service.limits)


def serve(backbone: Backbone, token: str, host: str = "127.0.0.1", port: int = 8765,
          limits: Limits | None = None) -> None:
    """Serve ``backbone`` until interrupted (uvicorn, one process; ``limit_concurrency`` bounds open requests)."""
    import uvicorn  # heavy: only the owner's process serves HTTP

    service = OwnerService(backbone, limits)
    app = make_app(service, token)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print("offsite: listening beyond this machine over plain HTTP — the bearer token and every context travel "
              "unencrypted; put TLS in front (a reverse proxy) in a real deployment", file=sys.stderr)
    print(f"offsite: serving {backbone.name} ({backbone.fingerprint}) on http://{host}:{port} — f(c), final norm "
          f"+ W_hd, tokenizer files, decode sessions; bearer token required", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=30, limit_concurrency=64)
