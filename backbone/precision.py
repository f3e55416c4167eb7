"""The precisions (docs/precision.md): which one a load gets, and putting a model into one — its linears swapped for
the CPU kernels of ``backbone.kernels`` and its attention for ``backbone.cpu_attention``'s."""
from __future__ import annotations

import os

import torch
from torch import nn

from backbone.cpu_attention import use_cpu_decode_attention
from backbone.kernels import (
    Fp16WeightLinear,
    Int8Linear,
    PackedBF16Linear,
    PackedF32Linear,
    fp16_weight_available,
    native_bf16_cpu,
    packed_bf16_available,
    packed_f32_available,
)
from ground.errors import UserError

PRECISIONS = ("float32", "bfloat16", "int8", "float16")
# A precision's name in fingerprints where it differs from the name, so that memories made with other numerics are
# refused: ``int8`` is weight-only (a dynamic int8, fingerprinted "int8", computed other keys f(c)); ``float16`` on a
# CPU is weight-only (float32 activations: other f(c) than a GPU's float16 model, tagged "float16"), with its LM head
# and so a tied input embedding float16 too (a "float16-weight-only" tag kept them float32: other f(c)).
FINGERPRINT_TAGS = {"int8": "int8-weight-only"}
CPU_FLOAT16_TAG = "float16-weight-only-head"


# The precision a CPU load gets when none is asked for (``--dtype`` / ``$PEMA_DTYPE``), each chosen from the quality
# guard (the base model and the best plug-in's whole flow on WMT dev 1000–1199) and the decode benchmarks
# (BENCHMARKS.md, "Decode time per token"): bfloat16 where the CPU has it natively; else float16 weight-only where
# FBGEMM's kernel runs (x86 with AVX2: a comparison's multi-row steps, where float32's products of several rows are
# slow); else float32. float32 stays the exact reference path (--dtype float32).
DEFAULT_CPU_PRECISION = ("bfloat16" if native_bf16_cpu() else "float16" if fp16_weight_available() else "float32")


def resolve_precision(dtype: str | torch.dtype | None, device: str) -> str:
    """The precision to load in: ``dtype`` (``float32``, ``bfloat16``, ``int8``, ``float16``; a torch dtype; None or
    ``auto``: ``$PEMA_DTYPE``, else bfloat16 on a GPU that has it, else ``DEFAULT_CPU_PRECISION``). The studio and
    the CLIs pass theirs (their ``--dtype`` reads ``$PEMA_DTYPE`` at the command line); the variable is read here
    only for a caller that passes none (the benchmarks' child processes inherit it)."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).replace("torch.", "")
    if dtype in (None, "", "auto"):
        dtype = os.environ.get("PEMA_DTYPE") or "auto"
    if dtype == "auto":
        if device.startswith("cuda"):
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
        return DEFAULT_CPU_PRECISION
    names = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
             "bfloat16": "bfloat16", "bf16": "bfloat16", "int8": "int8", "qint8": "int8"}
    if dtype not in names:
        raise UserError(f"Unknown dtype {dtype!r}; use float32, bfloat16, float16 or int8.")
    if names[dtype] == "int8" and device.startswith("cuda"):
        raise UserError("--dtype int8 runs torch's CPU int8 kernels; on a GPU use --dtype bfloat16.")
    return names[dtype]


def set_precision(model: nn.Module, precision: str) -> nn.Module:
    """Put a float32 model into ``precision`` in place: ``bfloat16`` converts every weight; ``int8`` swaps every
    ``nn.Linear`` (the decoder's projections and the LM head) for an :class:`Int8Linear` (CPU only); ``float32``
    leaves the weights and the decoder as they are and, on a CPU, runs the LM head packed (:class:`PackedF32Linear`:
    same weight Parameter, f(c) bit-identical, logits to float32 rounding); ``float16`` on a CPU is float32's with the
    projections and LM head float16 weight-only (:class:`Fp16WeightLinear`), on a GPU the whole model in float16.
    Returns the model."""
    if precision not in PRECISIONS:
        raise UserError(f"Unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    if precision == "float16":
        if not on_cpu:
            return model.to(torch.float16)
        if not fp16_weight_available():
            raise UserError("--dtype float16 on a CPU runs FBGEMM's float16-weight kernel (x86 with AVX2), which this "
                            "torch or CPU lacks; use --dtype float32.")
        # every projection, the LM head too (a tied head's rounding rounds the input embedding with it: one weight)
        _swap_linears(model, Fp16WeightLinear)
        use_cpu_decode_attention(model)
        return model
    if precision == "bfloat16":
        model.to(torch.bfloat16)
        if all(p.device.type == "cpu" for p in model.parameters()) and packed_bf16_available():
            _swap_linears(model, PackedBF16Linear)
            use_cpu_decode_attention(model)
        return model
    if precision == "float32":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if (type(head) is nn.Linear and head.weight.dtype == torch.float32 and head.weight.device.type == "cpu"
                and packed_f32_available()):
            model.set_output_embeddings(PackedF32Linear(head))
        if all(p.device.type == "cpu" for p in model.parameters()):
            use_cpu_decode_attention(model)  # SDPA for every row; memory-tuning's prefix read inside it (RowKeys)
        return model
    if precision == "int8":
        if any(p.device.type != "cpu" for p in model.parameters()):
            raise UserError("--dtype int8 runs torch's CPU int8 kernels; on a GPU use --dtype bfloat16.")
        _swap_linears(model, Int8Linear)  # quantized from the float32 weights …
        model.to(torch.bfloat16)  # … and the rest in bfloat16 (the Parameters F.linear uses with gradients too)
        use_cpu_decode_attention(model)
    return model


def _swap_linears(model: nn.Module, cls, skip: nn.Module | None = None) -> None:
    """Replace every plain ``nn.Linear`` (the decoder's projections and the LM head, unless it is ``skip``) by
    ``cls(linear)``. An output embedding tied to the input embedding is reached through get_output_embeddings(),
    which is the module swapped (its weight stays the embedding's Parameter)."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child is not skip:
                setattr(parent, child_name, cls(child))


def model_precision(model: nn.Module) -> str:
    """``int8`` / ``float16`` when the model's projections run int8 / float16 weight-only (:func:`set_precision`),
    else its LM head's dtype name."""
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        return "int8"
    if any(isinstance(m, Fp16WeightLinear) for m in model.modules()):
        return "float16"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return str(head.weight.dtype).replace("torch.", "") if head is not None else "float32"
