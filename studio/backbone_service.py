"""The Studio's backbone: loaded in a background thread (the page shows progress), used exclusively through the gate."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from backbone.model import load_backbone, resolve_name
from backbone.tiny import tiny_backbone
from ground.errors import Cancelled, UserError
from ground.jobs import JobContext


TINY_NAMES = ("tiny", "tiny-llama")


class BackboneService:
    """Loading state, the loaded backbone and exclusive (interactive or job) use of it."""

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
            if self.backbone_name.lower() in TINY_NAMES:
                progress(0.3, "Building the tiny test backbone")
                bb = tiny_backbone()
            else:
                cache_root = self.root
                name = resolve_name(self.backbone_name)
                if self.backbone_cache and (self.backbone_cache / "backbones" / name / "config.json").exists():
                    cache_root = self.backbone_cache
                bb = load_backbone(self.backbone_name, device=self.device, data_dir=cache_root, progress=progress)
            self._bb = bb
            self._load.update(state="ready", progress=1.0, finished=time.time(),
                              message=f"{bb.name} ready on {bb.device} "
                                      f"({time.time() - self._load['started']:.0f}s to load)")
        except Exception as e:  # noqa: BLE001 — shown to the user in the header
            msg = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            self._load.update(state="failed", error=msg, message=f"Could not load {self.backbone_name}: {msg}",
                              finished=time.time())
        finally:
            self._ready.set()

    def status(self) -> dict:
        """Backbone loading state for the page header: state, progress (0–1), message, elapsed seconds."""
        s = dict(self._load)
        now = time.time()
        s["elapsed"] = round(now - s["started"], 1) if s["started"] else 0.0
        if s["state"] == "loading" and s["message"].startswith("De-quantizing"):
            # The de-quantization step reports nothing for ~70 s: show an estimate so the bar moves.
            stage = now - (s["stage_started"] or now)
            s["progress"] = min(0.84, 0.15 + 0.69 * stage / 90.0)
        bb = self._bb
        s.update(backbone=bb.name if bb else self.backbone_name, ready=s["state"] == "ready",
                 device=str(bb.device) if bb else (self.device or "auto"),
                 layers=bb.num_layers if bb else 0, data_dir=str(self.root), multi_user=self.multi_user)
        s.pop("stage_started", None)
        if self.multi_user:  # public: the server's paths are nobody's business but the operator's
            s.pop("data_dir")
            s["message"] = s["message"].replace(str(self.root), "<data dir>")
            s["error"] = s["error"].replace(str(self.root), "<data dir>")
        return s

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self._load["state"] == "ready"

    @property
    def backbone(self):
        """The loaded backbone; a UserError saying what is happening when it is not ready."""
        if self._bb is not None:
            return self._bb
        st = self.status()
        if st["state"] == "failed":
            raise UserError(st["message"])
        raise UserError(f"The backbone is still loading ({st['progress'] * 100:.0f}%: {st['message']}). "
                        f"Try again in a moment.")

    def _job_backbone(self, job: JobContext):
        """The backbone for a job, waiting for it to finish loading."""
        if self._bb is None:
            job.progress(0.0, "Waiting for the backbone to load")
            while not self._ready.wait(1.0):
                if job.should_stop():
                    raise Cancelled()
        return self.backbone

    @contextmanager
    def _interactive(self, what: str):
        busy = (f"The backbone is busy ({self.gate.holder or 'a background job'}) and cannot pause: try again "
                f"when it finishes, or cancel it in the Plug-ins tab.")
        with self.gate.use(timeout=self.busy_timeout, holder=what, busy=busy):
            yield self.backbone

