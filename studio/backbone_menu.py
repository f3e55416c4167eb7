"""The backbones the studio offers to switch to (the header's "Backbone" menu): on a machine with a CUDA GPU, larger
Hugging Face Hub models beside the embedded ones, each with the defaults that suit it there. Without CUDA there is no
menu: the embedded Gemma 3 270M is what a CPU serves at interactive speed, and the studio keeps ``--backbone``.

A Hub entry is loaded by its id (``backbone.loading.load_model``: bfloat16 on the GPU, ``device_map="auto"``); the
Gemma models are gated on the Hub, so the machine needs their licence accepted and a token (``HF_TOKEN``), or a local
copy under the same path. Their shapes were checked on a GPU with random weights (``python -m benchmarks gpu
--config-dir gemma-3-1b``; docs/gpu.md).
"""
from __future__ import annotations

import torch

from backbone.model import EMBEDDED, resolve_name

# Hub backbones offered on a GPU, smallest first. ``dtype``: the precision they load in there (bfloat16: float32's
# range, half its memory; Gemma 3's residual stream overflows float16). ``build_batch_size``: samples per forward
# pass of a memory build (the CPU default, 8, leaves a GPU idle between launches). ``min_gpu_gib``: the weights in
# bfloat16, the KV caches of a comparison and a training's activations, with room to spare.
GPU_BACKBONES: dict[str, dict] = {
    "google/gemma-3-1b-pt": {"label": "Gemma 3 1B (pre-trained), multilingual", "parameters": "1.0B",
                             "dtype": "bfloat16", "build_batch_size": 32, "min_gpu_gib": 6.0},
    "google/gemma-3-1b-it": {"label": "Gemma 3 1B (instruction-tuned), multilingual, plain few-shot prompts",
                             "parameters": "1.0B", "dtype": "bfloat16", "build_batch_size": 32, "min_gpu_gib": 6.0},
}
EMBEDDED_BUILD_BATCH_SIZE = 8  # memories.build's default


def cuda_memory_gib() -> float | None:
    """The first CUDA device's memory in GiB, or None without CUDA (tests replace this function)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def backbone_menu(gpu_gib: float | None = None) -> list[dict]:
    """The backbones to offer, ``[{"name", "label", "parameters", "dtype", "build_batch_size", "hub"}]``: empty
    without a GPU (``gpu_gib`` None: no menu), else the embedded ones and the Hub ones that fit ``gpu_gib``."""
    if gpu_gib is None:
        return []
    out = [{"name": name, "label": info["description"], "parameters": None, "dtype": None,
            "build_batch_size": EMBEDDED_BUILD_BATCH_SIZE, "hub": False} for name, info in EMBEDDED.items()]
    out += [{"name": name, **{k: v for k, v in info.items() if k != "min_gpu_gib"}, "hub": True}
            for name, info in GPU_BACKBONES.items() if gpu_gib >= info["min_gpu_gib"]]
    return out


def menu_entry(name: str, menu: list[dict]) -> dict | None:
    """``name``'s entry in ``menu`` (an embedded alias counts as its name), or None."""
    name = resolve_name(name)
    return next((e for e in menu if e["name"] == name), None)


def build_batch_size(name: str) -> int:
    """Samples per forward pass of a memory build on ``name``: the menu's for a Hub backbone, else the default."""
    info = GPU_BACKBONES.get(resolve_name(name or ""))
    return int(info["build_batch_size"]) if info else EMBEDDED_BUILD_BATCH_SIZE
