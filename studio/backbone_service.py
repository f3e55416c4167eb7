"""The Studio's backbone: loaded in a background thread (the page shows progress), used exclusively through the gate.

The backbone is either this machine's (loaded here) or a model owner's (``remote_url``: PEMA's offsite protocol,
``offsite.client.RemoteBackbone``): f(c) and the decoder's steps come from the owner's service, the final norm and
W_hd are fetched once, the memories and plug-ins stay here. Under a remote backbone only output-level methods (PEMA,
kNN) build, train and decode; in-network ones are refused with the reason (``offsite.decode.check_offsite_method``)."""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from backbone.graph_decode import RUNNERS
from backbone.model import load_backbone, resolve_name
from backbone.tiny import tiny_backbone
from engine import warm_comparison
from ground.errors import Cancelled, UserError
from ground.jobs import JobContext
from offsite.client import TOKEN_ENV, RemoteBackbone, connect
from offsite.decode import check_offsite_method, decode_batch_remote
from studio import backbone_menu as menus
from studio.caches import LRU
from studio.context import StudioContext
from studio.gate import BackboneGate

TINY_NAMES = ("tiny", "tiny-llama")
# P_LM under a remote backbone: computed here from the owner's f(c) with the final norm and W_hd this side holds —
# exact (the local arithmetic), and per row and step ~2.5 KB on Gemma instead of ~1 MB for the owner's float32 P_LM
# (BENCHMARKS.md, "Offsite protocol").
REMOTE_LM = "none"
REMOTE_MULTI_USER = ("A remote backbone is set for the whole hosted studio by its operator (python app.py --remote "
                     "URL); there is no per-user remote in multi-user mode.")


def check_remote_url(url: str) -> str:
    """``url`` as an owner's service address (http(s)://host[:port]), or a one-line UserError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"The remote backbone must be an http(s) URL such as http://127.0.0.1:8765, not {url[:80]!r}.")
    return url.rstrip("/")


def remote_host(url: str) -> str:
    """``host[:port]`` of ``url`` (never its user-info part)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


class BackboneService:
    """Loading state, the loaded backbone and exclusive (interactive or job) use of it through ``gate``.

    Receives the studio's context (owners, the data directory for the de-quantized weights) and the loaded plug-in
    cache, which it empties when the backbone changes (a loaded plug-in holds the old head)."""

    def __init__(self, ctx: StudioContext, plugin_cache: LRU, gate: BackboneGate, name: str, *,
                 device: str | None = None, dtype: str | None = None, cache: str | Path | None = None,
                 busy_timeout: float = 120.0, remote: str | None = None, remote_token: str | None = None):
        """``name``: "gemma-3-270m", a hub id, a local path, or "tiny". ``dtype``: its precision (None: the machine's
        default, ``backbone.precision.resolve_precision``; a remote backbone's is its owner's). ``cache``: another
        data directory whose ``backbones/`` may already hold the de-quantized weights. ``remote``: a model owner's
        service instead of a local backbone (bearer ``remote_token``, else ``$PEMA_REMOTE_TOKEN``)."""
        self.ctx = ctx
        self.plugin_cache = plugin_cache
        self.backbone_name = name
        self.backbone_cache = Path(cache) if cache else None
        self.device = device
        self.dtype = dtype
        self.busy_timeout = busy_timeout
        self.gate = gate
        # a model owner's service (offsite), else None: the backbone is loaded here; its token is kept in memory only
        self.remote_url: str | None = check_remote_url(remote) if remote else None
        self._remote_token: str | None = (remote_token or None) if remote else None
        self._bb = None
        self._load = {"state": "idle", "progress": 0.0, "message": "Not loaded", "error": "", "started": None,
                      "finished": None, "stage_started": None}
        self._ready = threading.Event()

    def loaded_backbone(self):
        """The loaded backbone, or None while it loads (or failed): never waits, never raises."""
        return self._bb

    def requested_name(self) -> str:
        """The backbone this studio was asked to run (a menu name, hub id or local path; ``set_backbone`` changes
        it), loaded or not: the name build batch sizes and tuned settings are looked up by."""
        return self.backbone_name

    def worker_spec(self) -> dict:
        """How a Ray worker loads this studio's backbone (``studio.ray_executor``: its name, device, precision and
        the data directory holding its de-quantized weights) and the fingerprint it must have."""
        if self.remote_url:
            raise UserError("A remote (offsite) backbone cannot be sharded over Ray workers; use the in-process "
                            "queue.")
        cache = self.ctx.root
        if self.backbone_cache is not None and (Path(self.backbone_cache) / "backbones").is_dir():
            cache = self.backbone_cache
        return {"name": str(self.backbone_name), "device": self.device, "dtype": self.dtype,
                "data_dir": str(cache), "fingerprint": self.backbone().fingerprint}

    # --- a model owner's backbone (offsite) ---------------------------------------------------------------------
    def offsite(self, bb=None) -> bool:
        """Whether ``bb`` (default: the studio's backbone, loaded or to be loaded) is a model owner's."""
        return isinstance(bb, RemoteBackbone) if bb is not None else bool(self.remote_url)

    def check_offsite(self, method: str, bb=None) -> None:
        """Under a remote backbone, a UserError with the reason unless ``method`` is output-level (PEMA, kNN)."""
        if self.offsite(bb):
            check_offsite_method(method)

    def eval_decode(self, bb) -> dict:
        """``eval.run.evaluate``'s ``decode`` for ``bb``: through the owner's decode sessions when it is remote."""
        return {"decode": partial(decode_batch_remote, lm=REMOTE_LM)} if self.offsite(bb) else {}

    def set_remote(self, url: str | None, token: str | None = None, *, owner: str | None = None) -> dict:
        """Single-user mode: work against the model owner's service at ``url`` (bearer ``token``, else
        ``$PEMA_REMOTE_TOKEN``), or with an empty ``url`` on the local backbone again; the new backbone loads in
        the background (``status``). Refused in multi-user mode (the operator's ``--remote`` is the whole studio's),
        while the backbone loads, and while a job holds it. Loaded plug-ins are dropped (they hold the old head)."""
        if self.ctx.multi_user:
            raise UserError(REMOTE_MULTI_USER)
        self.ctx.owner(owner)
        url = check_remote_url(url.strip()) if isinstance(url, str) and url.strip() else None
        token = token.strip() if isinstance(token, str) and token.strip() else None
        if url and not (token or os.environ.get(TOKEN_ENV)):
            raise UserError(f"Give the bearer token the model owner gave you (or set ${TOKEN_ENV} before starting "
                            f"the studio).")
        with self._switching():
            self.remote_url, self._remote_token = url, token
        return self.status()

    # --- the GPU's backbone menu (studio.backbone_menu) ------------------------------------------------------------
    def backbone_menu(self) -> list[dict]:
        """The backbones this studio offers to switch to: none without a GPU, or in multi-user mode (the operator's
        ``--backbone`` is the whole studio's); each entry says whether it is the current one."""
        if self.ctx.multi_user:
            return []
        current = resolve_name(self.backbone_name) if not self.remote_url else None
        return [{**e, "current": e["name"] == current} for e in menus.backbone_menu(menus.cuda_memory_gib())]

    def set_backbone(self, name: str, *, owner: str | None = None) -> dict:
        """Single-user mode, on a GPU: switch to ``name``, one of ``backbone_menu()``'s, in its precision (the local
        backbone again when a remote one was in use); it loads in the background (``status``). Refused while the
        backbone loads or a job holds it. Memories and plug-ins stay bound to the backbone they were made with."""
        self.ctx.owner(owner)
        menu = self.backbone_menu()
        if not menu:
            raise UserError("Switching the backbone is offered on a GPU machine in single-user mode; start the "
                            "studio with --backbone NAME instead.")
        entry = menus.menu_entry(str(name or ""), menu)
        if entry is None:
            raise UserError(f"Not in this studio's backbone menu: {str(name)[:80]!r}; choose one of "
                            f"{', '.join(e['name'] for e in menu)}.")
        with self._switching():
            self.backbone_name, self.dtype = entry["name"], entry["dtype"] or self.dtype
            self.remote_url, self._remote_token = None, None
        return self.status()

    @contextmanager
    def _switching(self):
        """Drop the loaded backbone (its plug-ins and decode graphs) under the gate, let the body change what to
        load, then load it in the background."""
        busy = (f"The backbone is busy ({self.gate.holder or 'a background job'}): switch when it finishes, or "
                f"cancel it in the Plug-ins tab.")
        with self.gate.use(timeout=min(self.busy_timeout, 5.0), holder="switching the backbone", busy=busy):
            if self._load["state"] == "loading":
                raise UserError("The backbone is still loading; switch when it is ready (or has failed).")
            old = self._bb
            self._ready.clear()
            self._bb = None
            self.plugin_cache.clear()
            if old is not None and hasattr(old, "decoder"):  # its decode graphs hold it: let it go
                RUNNERS.forget(old.decoder)
            yield
            self._load.update(state="idle", progress=0.0, message="Not loaded", error="", started=None,
                              finished=None)
            if isinstance(old, RemoteBackbone):
                old.client.close()
            self.load_backbone_async()

    # --- the backbone -------------------------------------------------------------------------------------------
    def load_backbone_async(self) -> None:
        if self._load["state"] in ("loading", "ready"):
            return
        self._load.update(state="loading", progress=0.0, message=f"Loading {self.backbone_name}…", error="",
                          started=time.time(), stage_started=time.time())
        threading.Thread(target=self._load_backbone, name="pema-backbone-loader", daemon=True).start()

    def _load_backbone(self) -> None:
        def progress(frac: float, msg: str) -> None:
            self._load.update(progress=float(frac), message=msg, stage_started=time.time())

        try:
            if self.remote_url:
                host = remote_host(self.remote_url)
                progress(0.02, f"Connecting to the model owner at {host}")
                bb = connect(self.remote_url, self._remote_token, data_dir=self.ctx.root, device=self.device,
                             progress=progress)
                self._bb = bb
                self._load.update(state="ready", progress=1.0, finished=time.time(),
                                  message=f"{bb.name} at {host} (model owner): f(c) from the owner, final norm "
                                          f"and W_hd here on {bb.device} ({time.time() - self._load['started']:.0f}s "
                                          f"to connect)")
                return
            if self.backbone_name.lower() in TINY_NAMES:
                progress(0.3, "Building the tiny test backbone")
                bb = tiny_backbone()
            else:
                cache_root = self.ctx.root
                name = resolve_name(self.backbone_name)
                if self.backbone_cache and (self.backbone_cache / "backbones" / name / "config.json").exists():
                    cache_root = self.backbone_cache
                bb = load_backbone(self.backbone_name, device=self.device, dtype=self.dtype, data_dir=cache_root,
                                   progress=progress)
                self._warm(bb, progress)
            self._bb = bb
            self._load.update(state="ready", progress=1.0, finished=time.time(),
                              message=f"{bb.name} ready on {bb.device} "
                                      f"({time.time() - self._load['started']:.0f}s to load)")
        except Exception as e:  # noqa: BLE001 — shown to the user in the header
            msg = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            what = f"connect to the model owner at {remote_host(self.remote_url)}" if self.remote_url \
                else f"load {self.backbone_name}"
            self._load.update(state="failed", error=msg, message=f"Could not {what}: {msg}", finished=time.time())
        finally:
            self._ready.set()

    @staticmethod
    def _warm(bb, progress) -> None:
        """On a GPU, one short comparison before the studio says ready (``engine.warm_comparison``); a
        failure there leaves the first comparison cold, nothing else."""
        if bb.device.type != "cuda":
            return
        progress(0.97, "Warming up the GPU with a short comparison")
        try:
            warm_comparison(bb)
        except Exception as exc:  # noqa: BLE001 — the backbone itself loaded; only the warm-up is lost
            import logging

            logging.getLogger(__name__).warning("GPU warm-up comparison skipped: %s", exc)

    def status(self) -> dict:
        """Backbone loading state for the page header: state, progress (0–1), message, elapsed seconds."""
        s = dict(self._load)
        now = time.time()
        s["elapsed"] = round(now - s["started"], 1) if s["started"] else 0.0
        if s["state"] == "loading" and s["message"].startswith("De-quantizing"):
            # The de-quantization step reports nothing for a minute or more: show an estimate so the bar moves.
            stage = now - (s["stage_started"] or now)
            s["progress"] = min(0.84, 0.15 + 0.69 * stage / 90.0)
        bb = self._bb
        s.update(backbone=bb.name if bb else self.backbone_name, ready=s["state"] == "ready",
                 device=str(bb.device) if bb else (self.device or "auto"),
                 layers=bb.num_layers if bb else 0, precision=getattr(bb, "precision", None) if bb else None,
                 data_dir=str(self.ctx.root), multi_user=self.ctx.multi_user,
                 read_only=self.ctx.read_only)  # another process owns the data directory
        s.pop("stage_started", None)
        s["remote"] = None
        if self.remote_url:  # which side holds what (never the token)
            host = remote_host(self.remote_url)
            if bb is None:  # not the local backbone's name: the owner's is known once connected
                s["backbone"] = f"the model owner's backbone at {host}"
            s["remote"] = {"host": host, "url": self.remote_url if not self.ctx.multi_user else None,
                           "holds": f"model weights: at {host} (model owner); memory, plug-ins: here",
                           "methods": "PEMA and kNN (output-level); in-network methods need the decoder's layers, "
                                      "which the model owner keeps"}
        if self.ctx.multi_user:  # public: the server's paths are nobody's business but the operator's
            s.pop("data_dir")
            s["message"] = s["message"].replace(str(self.ctx.root), "<data dir>")
            s["error"] = s["error"].replace(str(self.ctx.root), "<data dir>")
        return s

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self._load["state"] == "ready"

    def backbone(self):
        """The loaded backbone; a UserError saying what is happening when it is not ready."""
        if self._bb is not None:
            return self._bb
        st = self.status()
        if st["state"] == "failed":
            raise UserError(st["message"])
        raise UserError(f"The backbone is still loading ({st['progress'] * 100:.0f}%: {st['message']}). "
                        f"Try again in a moment.")

    def for_job(self, job: JobContext):
        """The backbone for a job, waiting for it to finish loading."""
        if self._bb is None:
            job.progress(0.0, "Waiting for the backbone to load")
            while not self._ready.wait(1.0):
                if job.should_stop():
                    raise Cancelled()
        return self.backbone()

    @contextmanager
    def interactive(self, what: str):
        """The backbone for an interactive call (``with … as bb``), waiting at most ``busy_timeout`` seconds for a
        job's checkpoint, else a UserError that says why."""
        busy = (f"The backbone is busy ({self.gate.holder or 'a background job'}) and cannot pause: try again "
                f"when it finishes, or cancel it in the Plug-ins tab.")
        with self.gate.use(timeout=self.busy_timeout, holder=what, busy=busy):
            yield self.backbone()

