"""PEMA Studio web app.

    python app.py                         # embedded Gemma 3 270M, offline, http://127.0.0.1:7860
    python app.py --backbone tiny         # a tiny in-process model (tests, demos)
    python app.py --host 0.0.0.0 --port 7860 --data-dir /data --workers 1 --device auto

Flags fall back on environment variables: $HOST, $PORT, $PEMA_DATA_DIR, $PEMA_BACKBONE, $PEMA_BACKBONE_CACHE,
$PEMA_WORKERS, $PEMA_DEVICE. The backbone loads in the background (the first load of an embedded model
de-quantizes it, one to two minutes on 2 CPU cores, then it is cached under the data directory); the page shows
its progress meanwhile.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see ground/__init__.py

from backbone.model import DEFAULT_BACKBONE, EMBEDDED  # noqa: E402  (after the environment above is set)
from studio.service import Studio  # noqa: E402
from ui.app import launch_app  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="PEMA Studio: customize a frozen LM with your own text, no fine-tuning.")
    p.add_argument("--backbone", default=os.environ.get("PEMA_BACKBONE", DEFAULT_BACKBONE),
                   help=f"embedded short name ({', '.join(EMBEDDED)}), a Hugging Face id, a local folder, or 'tiny'")
    p.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"), help="0.0.0.0 to listen on all interfaces")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", 7860)))
    p.add_argument("--data-dir", default=os.environ.get("PEMA_DATA_DIR") or None,
                   help="catalog, memories, plug-ins and backbone caches (default ~/.cache/pema-studio)")
    p.add_argument("--backbone-cache", default=os.environ.get("PEMA_BACKBONE_CACHE") or None,
                   help="a read-only data directory whose backbones/ may hold pre-built weights (Docker image)")
    p.add_argument("--workers", type=int, default=int(os.environ.get("PEMA_WORKERS", 1)),
                   help="background job worker threads (jobs share one backbone; 1 is right on CPU)")
    p.add_argument("--device", default=os.environ.get("PEMA_DEVICE", "auto"), help="auto, cpu, cuda, cuda:1, …")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def start(argv: list[str] | None = None, block: bool = True):
    """Create the Studio and serve the app. With ``block=False`` returns ``(studio, demo, url)`` (tests)."""
    args = parse_args(argv)
    studio = Studio(args.data_dir, backbone=args.backbone, device=args.device, workers=args.workers,
                    backbone_cache=args.backbone_cache)
    demo, url = launch_app(studio, host=args.host, port=args.port, block=block, quiet=args.quiet)
    return studio, demo, url


def main(argv: list[str] | None = None) -> None:
    studio = None
    try:
        studio, _, _ = start(argv, block=True)
    except KeyboardInterrupt:
        pass
    finally:
        if studio is not None:
            studio.close()


if __name__ == "__main__":
    main()
