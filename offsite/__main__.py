"""``python -m offsite``: the model owner's service (PEMA's premise: the owner serves f(c) and the head only).

Examples::

    python -m offsite serve --backbone gemma-3-270m --port 8765 --token "$(openssl rand -hex 24)"
    python -m offsite serve --backbone tiny --port 8765 --token secret-token   # the tests' tiny random model

The data owner then works with ``--remote URL`` and ``$PEMA_REMOTE_TOKEN``::

    export PEMA_REMOTE_TOKEN=...           # the token the owner gave you
    python -m memories build data.jsonl --remote http://owner:8765
    python -m plugins train <memory-id> --method pema --remote http://owner:8765
    python -m plugins compare "..." --plugin <pema-id> --remote http://owner:8765
"""
from __future__ import annotations

import argparse
import os

from backbone.cli import load_backbone_from_args
from backbone.tiny import tiny_backbone
from ground.cli import add_common, run_main
from ground.errors import UserError
from offsite.client import TOKEN_ENV
from offsite.protocol import Limits
from offsite.server import serve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offsite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve f(c), the final norm + W_hd, the tokenizer and decode sessions")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; TLS is the "
                                                       "deployment's job: put a reverse proxy in front)")
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--token", default=None, help=f"the bearer token clients must send (default ${TOKEN_ENV})")
    d = Limits()
    s.add_argument("--max-batch", type=int, default=d.max_batch, help="rows per f(c) / generate request")
    s.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="tokens per row (prefix included)")
    s.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per f(c) request")
    s.add_argument("--max-sessions", type=int, default=d.max_sessions, help="open decode sessions")
    s.add_argument("--max-steps", type=int, default=d.max_steps, help="decode steps per session")
    s.add_argument("--session-idle", type=float, default=d.session_idle_s,
                   help="seconds after which an unused session is closed")
    s.add_argument("--rate", type=float, default=d.rate, help="requests per second per client address")
    s.add_argument("--burst", type=int, default=d.burst, help="request bursts per client address")
    add_common(s)
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        token = args.token or os.environ.get(TOKEN_ENV, "")
        if len(token) < 8:
            raise UserError(f"Give the service a bearer token of at least 8 characters (--token or ${TOKEN_ENV}).")
        limits = Limits(max_batch=args.max_batch, max_seq_len=args.max_seq_len, max_tokens=args.max_tokens,
                        max_sessions=args.max_sessions, max_steps=args.max_steps, session_idle_s=args.session_idle,
                        rate=args.rate, burst=args.burst)
        if args.backbone == "tiny":  # the tests' in-process random model (no download)
            bb = tiny_backbone(device=args.device if args.device not in (None, "auto") else None)
        else:
            bb = load_backbone_from_args(args)
        serve(bb, token, host=args.host, port=args.port, limits=limits)
        return 0
    return 1


if __name__ == "__main__":
    run_main(main)
