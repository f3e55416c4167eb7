"""PEMA Studio web app.

    python app.py                         # embedded Gemma 3 270M, offline, http://127.0.0.1:7860
    python app.py --backbone tiny         # a tiny in-process model (tests, demos)
    python app.py --host 0.0.0.0 --port 7860 --data-dir /data --workers 1 --device auto
    python app.py --multi-user --limit input_chars=1000 --limit jobs_per_owner=2   # hosted: owners and limits
    PEMA_REMOTE_TOKEN=... python app.py --remote http://owner:8765   # offsite: the model owner's f(c), PEMA/kNN here

Bound to 127.0.0.1 (the default) the studio is single-user: everything belongs to the local user. Bound to another
host, or with --multi-user, each caller sees only their own things (docs/security.md); --single-user forces
the single-user mode on another host (a private network only). Flags fall back on environment variables: $HOST,
$PORT, $PEMA_DATA_DIR, $PEMA_BACKBONE, $PEMA_BACKBONE_CACHE, $PEMA_WORKERS, $PEMA_DEVICE, $PEMA_MULTI_USER (1/0),
$PEMA_DTYPE (--dtype), $PEMA_REMOTE (+ $PEMA_REMOTE_TOKEN), $PEMA_LIMIT_<NAME>, $PEMA_ALLOW_ORIGINS
(--allow-origin). The backbone loads
in the background (the first load of an embedded model de-quantizes it, one to two minutes on 2 CPU cores, then it
is cached under the data directory); the page shows its progress meanwhile.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
import ground  # noqa: E402,F401  (before torch: OpenMP's wait policy, see ground/__init__.py)
from backbone.model import DEFAULT_BACKBONE, EMBEDDED  # noqa: E402  (after the environment above is set)
from ground.errors import UserError  # noqa: E402
from ground.jobs import READ_ONLY_MESSAGE  # noqa: E402
from studio.backbone_service import check_remote_url  # noqa: E402
from studio.limits import Limits  # noqa: E402
from studio.service import Studio  # noqa: E402
from ui.app import launch_app, mode_banner, multi_user_default  # noqa: E402


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
    p.add_argument("--dtype", default=os.environ.get("PEMA_DTYPE") or None,
                   choices=["float32", "bfloat16", "int8", "float16"],
                   help="backbone weight precision (default $PEMA_DTYPE, else the machine's, docs/precision.md)")
    p.add_argument("--remote", default=os.environ.get("PEMA_REMOTE") or None, metavar="URL",
                   help="work against a model owner's offsite service (python -m offsite serve) instead of loading "
                        "a backbone here: memories, PEMA and kNN plug-ins stay here, the owner computes f(c); bearer "
                        "token from $PEMA_REMOTE_TOKEN; in-network methods are unavailable")
    env_multi = os.environ.get("PEMA_MULTI_USER", "").strip().lower()
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--multi-user", dest="multi_user", action="store_true",
                      help="owners told apart by key / HF sign-in (the default when bound to a host other than "
                           "127.0.0.1)")
    mode.add_argument("--single-user", dest="multi_user", action="store_false",
                      help="everything belongs to one local user even on another host (a private network only)")
    p.set_defaults(multi_user={"1": True, "true": True, "yes": True, "0": False, "false": False,
                               "no": False}.get(env_multi))  # None: decided by --host
    p.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                   help=f"override a bound (0 = none), repeatable: {', '.join(Limits.names())}")
    p.add_argument("--executor", choices=("inprocess", "ray"), default=os.environ.get("PEMA_EXECUTOR") or None,
                   help="where builds and trainings run: the in-process queue (default) or Ray (memory builds "
                        "sharded over workers, trainings as Ray tasks; a local Ray, or the cluster at "
                        "$PEMA_RAY_ADDRESS, which alone also selects ray; docs/ray.md)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="another site whose pages may call this studio, e.g. https://example.org (repeatable; sets "
                        "$PEMA_ALLOW_ORIGINS): without credentials, with the caller's X-Pema-Key; by default only "
                        "the studio's own page may (docs/security.md)")
    p.add_argument("--limits", action="store_true", help="print the limits in force and exit")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def start(argv: list[str] | None = None, block: bool = True):
    """Create the Studio and serve the app. With ``block=False`` returns ``(studio, served, url)`` (tests;
    ``served.close()`` stops the server)."""
    args = parse_args(argv)
    if args.allow_origin:
        os.environ["PEMA_ALLOW_ORIGINS"] = ",".join(o.strip() for o in args.allow_origin)
    multi = multi_user_default(args.host) if args.multi_user is None else args.multi_user
    try:
        limits = Limits.configure(multi, overrides=args.limit)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    if args.limits:
        for d in limits.describe():
            print(f"{d['name']:24} {d['value']:>12,}   ${d['env']}")
        raise SystemExit(0)
    if args.remote:
        try:
            check_remote_url(args.remote)
        except UserError as e:
            raise SystemExit(f"error: {e}") from None
        if not os.environ.get("PEMA_REMOTE_TOKEN"):
            raise SystemExit("error: --remote needs the model owner's bearer token in $PEMA_REMOTE_TOKEN")
    try:
        studio = Studio(args.data_dir, backbone=args.backbone, device=args.device, workers=args.workers,
                        backbone_cache=args.backbone_cache, multi_user=multi, limits=limits, remote=args.remote,
                        executor=args.executor, dtype=args.dtype)
    except UserError as e:  # e.g. --executor ray without Ray installed: one line, no traceback
        raise SystemExit(f"error: {e}") from None
    print(mode_banner(studio, args.host), flush=True)
    if studio.read_only:
        print(f"PEMA Studio: read-only ({studio.root / 'studio.lock'} is held by "
              f"{studio.jobs.lock.describe_holder()}): {READ_ONLY_MESSAGE}", flush=True)
    try:
        served, url = launch_app(studio, host=args.host, port=args.port, block=block, quiet=args.quiet)
    except BaseException:
        studio.close()
        raise
    return studio, served, url


def _stop_on_sigterm() -> None:
    """A container or service manager stops the studio with SIGTERM: end like Ctrl-C, so that uploads, downloads
    and the data directory's lock are cleaned up on the way out."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread (embedded use): the caller handles its own signals
        pass


def main(argv: list[str] | None = None) -> None:
    studio = None
    _stop_on_sigterm()
    try:
        studio, _, _ = start(argv, block=True)
    except KeyboardInterrupt:
        pass
    finally:
        if studio is not None:
            studio.close()


if __name__ == "__main__":
    main()
    # Everything is closed and flushed: skip the interpreter's teardown of torch's and Gradio's object graphs
    # (seconds of garbage collection), so that a container stops well inside its grace period.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
