"""The backbone flags' loader for the command-line tools (the flags themselves: ``ground.cli.add_common``)."""
from __future__ import annotations

from backbone.model import Backbone, load_backbone
from ground.cli import progress_bar


def load_backbone_from_args(args) -> Backbone:
    with progress_bar("backbone") as prog:
        return load_backbone(args.backbone, device=args.device, dtype=args.dtype, data_dir=args.data_dir,
                             progress=prog)
