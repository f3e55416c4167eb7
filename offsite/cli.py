"""The ``--remote URL`` flag of the data owner's command lines (``memories build``, ``plugins train`` / ``compare``)."""
from __future__ import annotations

import argparse

from backbone.model import resolve_name
from ground.cli import progress_bar
from ground.errors import UserError
from offsite.client import TOKEN_ENV, RemoteBackbone, connect
from offsite.protocol import LM_MODES


def add_remote(p: argparse.ArgumentParser, decode: bool = False) -> None:
    p.add_argument("--remote", default=None, metavar="URL",
                   help=f"use a model owner's offsite service (python -m offsite serve) instead of a local backbone: "
                        f"f(c) comes from the owner, the final norm, W_hd and the tokenizer are fetched once; bearer "
                        f"token from ${TOKEN_ENV}")
    if decode:
        p.add_argument("--remote-lm", default="full", choices=LM_MODES,
                       help="with --remote: P_LM per step as full float32 log-probs from the owner (exact), "
                            "float16 ones (half), or computed here from f(c) and W_hd (none: exact, fewest bytes)")


def remote_backbone_from_args(args) -> RemoteBackbone:
    """The owner's backbone behind ``args.remote`` (``--backbone``, if given, must name the same one)."""
    with progress_bar("remote") as prog:
        bb = connect(args.remote, data_dir=args.data_dir, device=getattr(args, "device", None), progress=prog)
    wanted = getattr(args, "backbone", None)
    if wanted and resolve_name(wanted) != bb.name:
        raise UserError(f"--backbone {wanted} was asked for, but the model owner at {args.remote} serves {bb.name}.")
    return bb
