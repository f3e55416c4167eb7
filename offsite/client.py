"""The data owner's side: an HTTP client of the owner's service, and ``RemoteBackbone`` — a :class:`Backbone` whose
decoder lives with the model owner.

``RemoteBackbone`` holds what PEMA hands the data owner — the frozen final norm, the LM head W_hd and the
tokenizer — and asks the owner for f(c). It implements the part of ``Backbone`` that ``memories.build``, plug-in
training (PEMA, kNN) and the output-level side of a decode use, with the same arithmetic: ``final_norm``,
``lm_head``, ``head_logits``, ``head_logits_subset``, ``logits_from_fc`` (inherited unchanged), ``encode_*``,
``fingerprint`` (the owner's, checked against the tokenizer received), ``stop_ids``, and ``forward_fc``, which
sends the batch's tokens to ``/v1/fc``. A KV cache cannot travel: ``RemoteCache`` stands in for one by holding the
tokens it covers, and the owner re-uses its own cache of them (``offsite.server.PrefixStore``). ``model.generate``
asks ``/v1/generate`` (synthetic sources of monolingual samples). What needs the decoder's layers — in-network
plug-ins, hooks — is refused with a UserError.

The head and the tokenizer's files are cached under ``<data_dir>/offsite/<sha256>/`` (checked against the sha256
the owner announces), so a CLI run downloads W_hd once.
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import torch
from torch import nn

from backbone.model import Backbone
from ground.errors import UserError
from ground.store import data_dir as _data_dir
from offsite.protocol import LM_MODES, PROTOCOL_VERSION, unpack

TOKEN_ENV = "PEMA_REMOTE_TOKEN"


class OwnerError(UserError):
    """The owner's service refused a request (``status``: its HTTP status)."""

    def __init__(self, status: int, reason: str, url: str):
        super().__init__(f"The model owner's service at {url} refused the request ({status}): {reason}")
        self.status, self.reason = status, reason


class OwnerClient:
    """Thin HTTP client of ``offsite.server`` (httpx, one keep-alive connection). Counts the bytes of request and
    response bodies (``sent``, ``received``; HTTP headers not included) and the requests."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 600.0):
        import httpx  # heavy: only a data owner talking to a model owner needs it

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UserError(f"--remote must be an http(s) URL such as http://127.0.0.1:8765, not {url!r}.")
        token = token or os.environ.get(TOKEN_ENV, "")
        if not token:
            raise UserError(f"Set ${TOKEN_ENV} to the bearer token the model owner gave you.")
        if parts.scheme == "http" and parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: {url} is plain HTTP: your token and the contexts you send travel unencrypted "
                  f"(use https)", file=sys.stderr)
        self.url = url.rstrip("/")
        self._httpx = httpx
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                 timeout=httpx.Timeout(timeout, connect=15.0))
        self.sent = self.received = self.requests = 0

    def close(self) -> None:
        self.http.close()

    def reset_counters(self) -> None:
        self.sent = self.received = self.requests = 0

    def request(self, method: str, path: str, body: dict | None = None):
        content = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        headers = {"content-type": "application/json"} if content is not None else None
        for attempt in range(6):
            try:
                r = self.http.request(method, path, content=content, headers=headers)
            except self._httpx.TransportError as e:
                raise UserError(f"Cannot reach the model owner's service at {self.url}: {type(e).__name__}: "
                                f"{e}") from None
            self.requests += 1
            self.sent += len(content or b"")
            self.received += len(r.content)
            wait = r.headers.get("retry-after", "")
            # over the owner's request rate: wait as told (a short wait only; a full session table is an error)
            if r.status_code != 429 or not wait.isdigit() or int(wait) > 5 or attempt == 5:
                break
            time.sleep(int(wait))
        if r.status_code >= 400:
            try:
                reason = r.json().get("error", r.text)
            except ValueError:
                reason = r.text[:300]
            raise OwnerError(r.status_code, reason, self.url)
        return r

    def json(self, method: str, path: str, body: dict | None = None):
        return self.request(method, path, body).json()

    def tensors(self, path: str, body: dict | None = None, method: str = "POST"):
        try:
            return unpack(self.request(method, path, body).content)
        except ValueError as e:
            raise UserError(f"The model owner's service at {self.url} sent a malformed answer to {path}: {e}") \
                from None

    # --- the protocol ------------------------------------------------------------------------------------------
    def info(self) -> dict:
        return self.json("GET", "/v1/info")

    def fc(self, sequences: list[list[int]], prefix: list[int] | None = None,
           positions: list[list[int]] | None = None) -> torch.Tensor:
        body = {"sequences": sequences, **({"prefix": prefix} if prefix else {}),
                **({"positions": positions} if positions is not None else {})}
        return self.tensors("/v1/fc", body)[0]["fc"]

    def generate(self, contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return self.json("POST", "/v1/generate", {"contexts": contexts, "max_new_tokens": max_new_tokens})["outputs"]

    def open_session(self, context: list[int], rows: int, prefix_len: int = 0, lm: str = "full") -> "RemoteSession":
        if lm not in LM_MODES:
            raise UserError(f"The P_LM mode must be one of {', '.join(LM_MODES)}, not {lm!r}.")
        t, meta = self.tensors("/v1/sessions", {"context": context, "rows": rows, "prefix_len": prefix_len,
                                                "lm": lm})
        return RemoteSession(self, meta["session"], rows, t["fc"], t.get("lm"))


class RemoteSession:
    """One decode session: the owner keeps its KV cache; each ``step`` sends one token per row and gets f(c) (and
    P_LM, by the session's mode) of the rows asked for. Close it (or use it as a context manager)."""

    def __init__(self, client: OwnerClient, sid: str, rows: int, fc: torch.Tensor, lm: torch.Tensor | None):
        self.client, self.id, self.rows, self.fc, self.lm = client, sid, rows, fc, lm
        self.closed = False

    def step(self, tokens: list[int], reorder: list[int] | None = None, rows: list[int] | None = None):
        body = {"tokens": tokens, **({"reorder": reorder} if reorder is not None else {}),
                **({"rows": rows} if rows is not None else {})}
        t, _ = self.client.tensors(f"/v1/sessions/{self.id}/step", body)
        return t["fc"], t.get("lm")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.client.request("DELETE", f"/v1/sessions/{self.id}")
            except UserError:
                pass  # gone already (expired), or the owner is unreachable: it expires on its own

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- the backbone ----------------------------------------------------------------------------------------------
class RemoteCache:
    """Stands in for a KV cache: the tokens of every batch row it covers (the owner encodes them again, from its own
    prefix cache). Supports what ``memories.build`` does with a cache: deep copy, ``batch_repeat_interleave``."""

    def __init__(self, rows: list[list[int]]):
        self.rows = [list(r) for r in rows]

    def batch_repeat_interleave(self, n: int) -> None:
        self.rows = [r for r in self.rows for _ in range(n)]

    def batch_select_indices(self, indices) -> None:
        self.rows = [self.rows[int(i)] for i in indices]

    reorder_cache = batch_select_indices

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return len(self.rows[0]) if self.rows else 0


class HeadModel(nn.Module):
    """What a ``Backbone`` finds in ``model`` on the data owner's side: the final norm (``get_decoder().norm``), the
    LM head (``get_output_embeddings()``), a config with the sizes, and ``generate`` through the owner."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, config: SimpleNamespace, client: OwnerClient):
        super().__init__()
        self.norm, self.lm_head, self.config = norm, lm_head, config
        self._client = [client]  # not a submodule

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def get_decoder(self) -> "HeadModel":
        return self

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 64, pad_token_id: int | None = None, **kw) -> torch.Tensor:
        """``backbone.model.generate_greedy``'s call, answered by the owner (greedy, to the end of the line; the
        owner stops at its backbone's stop tokens, the same ones this side holds): left-padded contexts in, the
        contexts followed by their continuations (padded with ``pad_token_id``) out."""
        ids = input_ids.cpu()
        mask = attention_mask.cpu() if attention_mask is not None else torch.ones_like(ids)
        ctxs = [ids[r][mask[r].bool()].tolist() for r in range(len(ids))]
        outs = self._client[0].generate(ctxs, max_new_tokens)
        pad = 0 if pad_token_id is None else pad_token_id
        width = max([len(o) for o in outs] + [0])
        gen = torch.full((len(ids), ids.shape[1] + width), pad, dtype=torch.long)
        gen[:, :ids.shape[1]] = ids
        for r, o in enumerate(outs):
            gen[r, ids.shape[1]:ids.shape[1] + len(o)] = torch.tensor(o, dtype=torch.long)
        return gen


NOT_OFFSITE = ("{what} needs the decoder's layers, which the model owner keeps: in-network plug-ins (adapters, "
               "LoRA, memory-tuning, memory adapters) cannot be trained or decoded offsite. Offsite methods: PEMA "
               "and kNN, which act on the output distribution.")


class RemoteBackbone(Backbone):
    """A backbone whose decoder is the model owner's (see the module docstring). Build with :func:`connect`."""

    def __init__(self, client: OwnerClient, info: dict, norm: nn.Module, lm_head: nn.Linear, tokenizer):
        # Backbone's dataclass fields, set by hand: its __post_init__ reads the decoder, which is not here.
        config = SimpleNamespace(hidden_size=info["hidden_size"], final_logit_softcapping=info["softcap"],
                                 name_or_path=info["name"], model_type="offsite")
        self.model = HeadModel(norm, lm_head, config, client)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = info["name"]
        self.chat = bool(info["chat"])
        self._fc_hook_state = {}
        self.client = client
        self.info = info
        self.hidden_size = int(info["hidden_size"])
        self.vocab_size = int(lm_head.weight.shape[0])
        self.num_layers = int(info["num_layers"])
        self.softcap = info["softcap"]
        self.stop_ids = {int(t) for t in info["stop_ids"]}
        if self.vocab_size != info["vocab_size"] or lm_head.weight.shape[1] != self.hidden_size:
            raise UserError(f"The model owner's W_hd has shape {tuple(lm_head.weight.shape)}, not the announced "
                            f"{info['vocab_size']} × {info['hidden_size']}.")
        # the tokenizer received must be the owner's; the precision part of the fingerprint is the owner's to say
        # (f(c) comes from its weights, in its precision), so memories and plug-ins made here carry it
        received, owners = self._fingerprint().split("|dtype=")[0], str(info["fingerprint"])
        if received != owners.split("|dtype=")[0]:
            raise UserError(f"The tokenizer the model owner sent does not match its backbone's fingerprint "
                            f"({received} vs {owners}).")
        self.fingerprint = owners
        self.max_batch = int(info["limits"]["max_batch"])
        self.max_tokens = int(info["limits"]["max_tokens"])

    def __repr__(self) -> str:
        return f"RemoteBackbone({self.name!r} at {self.client.url})"

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def layers(self):
        raise UserError(NOT_OFFSITE.format(what="This"))

    def forward_until_stopped(self, input_ids, attention_mask=None):
        raise UserError(NOT_OFFSITE.format(what="This"))

    def forward_fc(self, input_ids: torch.Tensor, attention_mask=None, past_key_values=None,
                   use_cache: bool = False, output_attentions: bool = False):
        """f(c) of every unmasked position, from the owner: ``(f(c) (B, W, d) in the head's dtype, zeros at masked
        positions; an object whose ``past_key_values`` is a :class:`RemoteCache` when ``use_cache``)``."""
        if output_attentions:
            raise UserError(NOT_OFFSITE.format(what="Attention weights"))
        ids = input_ids.detach().cpu()
        B, W = ids.shape
        if past_key_values is not None and not isinstance(past_key_values, RemoteCache):
            raise UserError("A remote backbone continues only its own caches (RemoteCache).")
        past = past_key_values.rows if past_key_values is not None else [[] for _ in range(B)]
        if len(past) != B:
            raise ValueError(f"the cache covers {len(past)} rows, the input has {B}")
        P = len(past[0]) if past else 0
        if any(len(r) != P for r in past):
            raise ValueError("the cache's rows differ in length")
        mask = attention_mask.detach().cpu() if attention_mask is not None else torch.ones((B, P + W), dtype=torch.long)
        if tuple(mask.shape) != (B, P + W):
            raise ValueError(f"attention mask of shape {tuple(mask.shape)} for {B} rows of {P} cached + {W} tokens")
        if P and not bool(mask[:, :P].all()):
            raise UserError("A remote backbone cannot continue a cache with padding in it.")
        keep = mask[:, P:].bool()
        rows = [torch.nonzero(keep[r]).flatten() for r in range(B)]
        seqs = [ids[r, rows[r]].tolist() for r in range(B)]
        out = torch.zeros((B, W, self.hidden_size), dtype=torch.float32)
        todo = [r for r in range(B) if seqs[r]]
        shared = all(past[r] == past[0] for r in range(B))
        for chunk in self._chunks(todo, seqs, P):
            if shared:
                got = self.client.fc([seqs[r] for r in chunk], prefix=past[0] if P else None)
            else:  # rows continue different tokens: each row sends its own, only its new positions come back
                got = self.client.fc([past[r] + seqs[r] for r in chunk],
                                     positions=[list(range(P, P + len(seqs[r]))) for r in chunk])
            at = 0
            for r in chunk:
                n = len(seqs[r])
                out[r, rows[r]] = got[at:at + n].float()
                at += n
        fc = out.to(self.device, self.dtype)
        cache = RemoteCache([past[r] + seqs[r] for r in range(B)]) if use_cache else None
        return fc, SimpleNamespace(past_key_values=cache, last_hidden_state=None)

    def _chunks(self, todo: list[int], seqs: list[list[int]], P: int):
        """Rows in requests the owner accepts (its ``max_batch`` rows and ``max_tokens`` tokens each)."""
        chunk: list[int] = []
        tokens = P
        for r in todo:
            n = len(seqs[r]) + P
            if chunk and (len(chunk) >= self.max_batch or tokens + n > self.max_tokens):
                yield chunk
                chunk, tokens = [], P
            chunk.append(r)
            tokens += n
        if chunk:
            yield chunk


# --- connecting ------------------------------------------------------------------------------------------------
def wait_for_owner(url: str, alive=lambda: True, timeout: float = 600.0, poll: float = 0.5) -> None:
    """Wait until an owner's service at ``url`` answers ``/healthz`` with 200. ``alive()`` is asked between tries
    (e.g. whether the owner's process still runs): False raises RuntimeError at once; so does ``timeout``."""
    import httpx

    deadline = time.time() + timeout
    while True:
        if not alive():
            raise RuntimeError("the owner's service stopped before it answered")
        try:
            if httpx.get(url.rstrip("/") + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            raise RuntimeError(f"the owner's service at {url} did not come up within {timeout:.0f} s")
        time.sleep(poll)


def _norm_module(rec: dict, d: int, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The owner's final-norm class, instantiated here from its name (transformers' or torch's norm classes only:
    nothing but a class name and numbers is taken from the owner) and loaded with its parameters."""
    module, cls_name, eps = rec.get("module", ""), rec.get("class", ""), rec.get("eps")
    params = {k[len("norm."):]: v for k, v in tensors.items() if k.startswith("norm.")}
    allowed = (module.startswith("transformers.models.") and cls_name.endswith(("RMSNorm", "LayerNorm"))) \
        or (module == "torch.nn.modules.normalization" and cls_name in ("LayerNorm", "RMSNorm"))
    if not allowed or "." in cls_name:
        raise UserError(f"The model owner's final norm {module}.{cls_name} is not a norm class this side knows.")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
        if module.startswith("torch."):
            kw = {"elementwise_affine": "weight" in params}
            if cls_name == "LayerNorm":
                kw["bias"] = "bias" in params
            norm = cls(d, eps=eps, **kw)
        else:
            norm = cls(d, eps=eps) if eps is not None else cls(d)
        dtype = next(iter(params.values())).dtype if params else None
        if dtype is not None:
            norm = norm.to(dtype)
        norm.load_state_dict(params, strict=True)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 — an unknown class, other parameters: say which
        raise UserError(f"Cannot rebuild the model owner's final norm {module}.{cls_name} here "
                        f"({type(e).__name__}: {str(e)[:200]}).") from None
    return norm


def _cached_download(client: OwnerClient, folder: Path, name: str, sha256: str, fetch) -> bytes:
    path = folder / name
    if path.is_file():
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() == sha256:
            return data
    data = fetch()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise UserError(f"The model owner's {name} does not match the sha256 it announced (changed while "
                        f"downloading?); try again.")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return data


def _tokenizer_blob(files: dict[str, bytes]) -> bytes:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest().encode()


def connect(url: str, token: str | None = None, data_dir=None, device: str | None = None,
            progress=lambda f, m: None) -> RemoteBackbone:
    """A :class:`RemoteBackbone` on the owner's service at ``url`` (token: ``$PEMA_REMOTE_TOKEN`` when not given).
    W_hd, the final norm and the tokenizer's files are downloaded once and cached under
    ``<data_dir>/offsite/<sha256 of the head>/``; ``device`` is where they (and the plug-ins) live here."""
    from safetensors.torch import load as load_tensors  # heavy: only where tensors travel
    from transformers import AutoTokenizer  # heavy: only when a tokenizer is built

    client = OwnerClient(url, token)
    progress(0.05, f"connecting to {client.url}")
    info = client.info()
    if info.get("protocol") != PROTOCOL_VERSION:
        raise UserError(f"The model owner's service speaks protocol {info.get('protocol')}, this side "
                        f"{PROTOCOL_VERSION}; update one of them.")
    folder = _data_dir(data_dir) / "offsite" / info["head_sha256"][:24]
    progress(0.1, f"W_hd and the final norm of {info['name']} ({info['head_bytes'] / 1e6:.1f} MB, cached after the "
                  f"first time)")
    head = _cached_download(client, folder, "head.safetensors", info["head_sha256"],
                            lambda: client.request("GET", "/v1/head").content)
    tensors = load_tensors(head)
    dev = device if device and device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    norm = _norm_module(info["norm"], int(info["hidden_size"]), tensors).to(dev)
    weight = tensors["lm_head.weight"]
    lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lm_head.weight = nn.Parameter(weight.to(dev), requires_grad=False)
    progress(0.8, "tokenizer files")
    tok_dir = folder / "tokenizer"
    files: dict[str, bytes] = {}
    if (tok_dir / "sha256").is_file() and (tok_dir / "sha256").read_text().strip() == info["tokenizer_sha256"]:
        files = {p.name: p.read_bytes() for p in tok_dir.iterdir() if p.is_file() and p.name != "sha256"}
    if _tokenizer_blob(files).decode() != info["tokenizer_sha256"]:
        raw = client.json("GET", "/v1/tokenizer")["files"]
        files = {}
        for name, b64 in raw.items():
            if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".") \
                    or not name.endswith((".json", ".txt", ".model", ".jinja")):
                raise UserError(f"The model owner sent a tokenizer file named {str(name)[:80]!r}: refused.")
            files[name] = base64.b64decode(b64)
        if _tokenizer_blob(files).decode() != info["tokenizer_sha256"]:
            raise UserError("The model owner's tokenizer files do not match the sha256 it announced.")
        tok_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (tok_dir / name).write_bytes(data)
        (tok_dir / "sha256").write_text(info["tokenizer_sha256"])
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
    if tokenizer.pad_token_id is None and info.get("pad_token_id") is not None:
        tokenizer.pad_token_id = info["pad_token_id"]
    bb = RemoteBackbone(client, info, norm, lm_head, tokenizer)
    progress(1.0, f"{bb.name} at {client.url}: f(c) from the owner, head here ({dev})")
    return bb
