"""The offsite protocol: what travels between the model owner and the data owner, and the bounds the owner keeps.

Requests are JSON (token ids as integers); tensors come back as **safetensors bytes** (a JSON header + raw
little-endian arrays: no pickle, no code), with small string metadata (a session id) in the header's
``__metadata__``. f(c) always travels as float32 — lossless for float32/bfloat16/float16 models, and Gemma 3's
pre-norm states exceed float16's range. P_LM (decode sessions) travels as full float32 log-probabilities (exact),
float16 ones (half the bytes, not exact), or not at all: the data owner holds W_hd and the final norm and computes
P_LM from f(c) itself (exact, fewest bytes). ``offsite.decode.compare_remote`` asks for "full" by default.

Endpoints (every one but ``/healthz`` needs ``Authorization: Bearer <token>``):

    GET    /healthz                     {"ok": true}
    GET    /v1/info                     backbone name, fingerprint, sizes, stop ids, soft-cap, sha256 of head and
                                        tokenizer files, the limits below
    GET    /v1/head                     safetensors: the final norm's parameters (``norm.*``) and W_hd
                                        (``lm_head.weight``), with the norm's class in the metadata
    GET    /v1/tokenizer                {"files": {name: base64}} — the tokenizer's files (not weights)
    POST   /v1/fc                       {"prefix": [ids], "sequences": [[ids]], "positions": [[i]]?}
                                        -> safetensors {"fc": (Σ positions, d)}: f(c) at each row's requested
                                        positions (default: all), row after row; the prefix is shared by every row
                                        (the owner caches its KV), positions index each row's own tokens
    POST   /v1/generate                 {"contexts": [[ids]], "max_new_tokens": n} -> {"outputs": [[ids]]}: the
                                        backbone's greedy continuation to the end of the line (synthetic sources)
    POST   /v1/sessions                 {"context": [ids], "rows": R, "prefix_len": P, "lm": "full|half|none"}
                                        -> safetensors {"fc": (1, d), "lm": (1, V)?}, metadata {"session": id}
    POST   /v1/sessions/{id}/step       {"tokens": [R ids], "reorder": [R rows]?, "rows": [rows wanted]?}
                                        -> safetensors {"fc": (n, d), "lm": (n, V)?} for the wanted rows
    DELETE /v1/sessions/{id}            {"closed": id}

Errors are ``{"error": "<reason>"}`` with a 4xx status: 400 malformed JSON, 401 missing or wrong token, 404
unknown session or path, 413 body or batch too large, 422 a value out of range (ids, positions, lengths), 429 too
many sessions or requests (``Retry-After``).
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass

import torch

PROTOCOL_VERSION = 1
LM_MODES = ("full", "half", "none")  # P_LM per decode step: float32 log-probs, float16 log-probs, not sent


@dataclass
class Limits:
    """What one request, one session and one client may ask of the owner (``python -m offsite serve --help``)."""

    max_batch: int = 64                 # rows of one /v1/fc or /v1/generate request
    max_seq_len: int = 2048             # tokens of one row, prefix included (a session: context + steps)
    max_tokens: int = 32768             # tokens of one /v1/fc request, all rows together
    max_sessions: int = 16              # open decode sessions
    max_session_rows: int = 64          # rows (methods × beams) of one session
    max_steps: int = 512                # decode steps of one session
    max_new_tokens: int = 256           # /v1/generate
    session_idle_s: float = 300.0       # a session unused this long is closed (a client that died)
    max_body_bytes: int = 4 << 20       # request bodies
    rate: float = 200.0                 # requests per second per client address (token bucket) ...
    burst: int = 400                    # ... and its bucket size

    def to_dict(self) -> dict:
        return asdict(self)


def pack(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes of ``tensors`` (made contiguous, on the CPU) with string ``metadata``."""
    from safetensors.torch import save  # heavy: only where tensors travel

    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                metadata={k: str(v) for k, v in (metadata or {}).items()})


def unpack(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of safetensors bytes (``ValueError`` for anything else)."""
    from safetensors.torch import load  # heavy: only where tensors travel

    if len(data) < 8:
        raise ValueError("not safetensors data (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError("not safetensors data (header length beyond the data)")
    header = json.loads(data[8:8 + n])
    meta = header.get("__metadata__") or {} if isinstance(header, dict) else {}
    return load(data), {str(k): str(v) for k, v in meta.items()}
