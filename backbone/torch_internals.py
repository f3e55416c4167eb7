"""Every use of a torch internal (an attribute or operator outside torch's documented API) goes through this module,
so that a torch upgrade has one place to check: ``tests/test_library_internals.py`` names the pinned version
(requirements.txt) and checks the behaviour each function relies on.

- hook tables: a ``RemovableHandle``'s weak references to the tables its hook sits in (a decode step takes an
  attachment's hooks off and puts the very same entries back: ``plugins.network._Handle``), a module's hook tables
  by name (cleared on a training copy, carried over to a kernel's deep copy);
- unregistered attributes: a plain value kept in a module's instance ``__dict__`` (a hook's value for the module's
  next call, a cache of what a plug-in derives) — ``nn.Module.__setattr__`` costs more than the rest of a decode
  step's hook, and ``nn.Module.__getattr__`` raises for a missing one;
- a module's forward replaced for a while: an instance attribute ``forward`` shadows the class's method, and
  ``nn.Module.__call__`` calls it with the module's hooks around it (``plugins.training_batches`` reads the layers'
  arguments without running them);
- tensor version counters: whether a tensor changed in place (derived products kept until a source changes);
- CPU kernels: oneDNN's packed linear, the float16 weight-only (FBGEMM) and int8 weight-only linears.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

PINNED = "2.13.0"  # the torch these internals are checked against (requirements.txt)

# nn.Module's hook tables (instance attributes; a training copy of a layer drops the decode's hooks from them all)
MODULE_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                      "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                      "_state_dict_hooks", "_load_state_dict_pre_hooks")
FORWARD_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks")


# --- hooks ---------------------------------------------------------------------------------------------------------
def hook_tables(handle) -> list[dict] | None:
    """The tables (live dicts: hook id → entry) the hook of ``handle`` sits in — the hooks table itself, then its
    ``with_kwargs`` / ``always_call`` flags —, or None when ``handle`` does not show them (not a torch
    ``RemovableHandle``)."""
    first = getattr(handle, "hooks_dict_ref", None)
    if first is None:
        return None
    return [t for t in (ref() for ref in (first, *getattr(handle, "extra_dict_ref", ()))) if t is not None]


def hook_id(handle) -> int:
    """The key of ``handle``'s hook in its tables."""
    return handle.id


def forward_hook_count(module: nn.Module) -> int:
    """How many forward hooks and pre-hooks ``module`` and its submodules carry (none between two decode steps)."""
    return sum(len(getattr(m, name)) for m in module.modules() for name in FORWARD_HOOK_TABLES)


def clear_module_hooks(module: nn.Module) -> None:
    """Remove every hook of ``module`` and its submodules (a copy of a layer that must run without the hooks
    attached to the original)."""
    for m in module.modules():
        for name in MODULE_HOOK_TABLES:
            d = getattr(m, name, None)
            if d is not None and hasattr(d, "clear"):
                d.clear()


def copy_forward_hooks(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst`` the forward (pre-)hooks of ``src`` (a module rebuilt as another class keeps them)."""
    for name in FORWARD_HOOK_TABLES:
        getattr(dst, name).update(getattr(src, name))


# --- unregistered attributes ---------------------------------------------------------------------------------------
def set_unregistered(module: nn.Module, name: str, value) -> None:
    """Keep ``value`` on ``module`` under ``name`` as a plain attribute, without ``nn.Module.__setattr__`` (which
    checks parameters, buffers and submodules first): never a parameter, buffer or submodule of it (not saved, not
    moved by ``.to()``), even when ``value`` holds modules."""
    module.__dict__[name] = value


def unregistered(module: nn.Module, name: str):
    """What ``set_unregistered`` kept on ``module`` under ``name`` (None: nothing)."""
    return module.__dict__.get(name)


# --- a forward replaced ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def forward_replaced(modules, forward):
    """Within the block, calling any of ``modules`` runs ``forward(*args, **kwargs)`` in place of its own forward,
    its hooks still around it; afterwards each module's own forward is back (an instance-level one included)."""
    modules = list(modules)
    own = [m.__dict__.get("forward") for m in modules]
    for m in modules:
        m.__dict__["forward"] = forward
    try:
        yield
    finally:
        for m, fwd in zip(modules, own):
            if fwd is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = fwd


# --- version counters ----------------------------------------------------------------------------------------------
def version(t: torch.Tensor) -> int:
    """``t``'s version counter: it grows with every in-place change (an optimiser step, ``load_state_dict``,
    ``copy_``). An inference tensor (made under ``inference_mode``) has none: RuntimeError."""
    return t._version


# --- CPU kernels (each probed before use: ``backbone.kernels``) ----------------------------------------------------
def mkldnn_pack_linear(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """oneDNN's blocked copy of a linear's weight (out × in) for products of about ``rows`` rows — the call torch's
    Inductor emits for a frozen bfloat16 linear on a CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def mkldnn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` with ``packed`` from ``mkldnn_pack_linear``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def fp16_pack_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """FBGEMM's float16 copy of a float32 linear weight (float16 weight-only)."""
    return torch.ops.quantized.linear_prepack_fp16(weight, bias)


def fp16_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """``x @ weight.T + bias`` (float32 ``x``) with ``packed`` from ``fp16_pack_linear``."""
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


def int8_weight_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight · scales).T`` with an int8 weight (out × in) and one scale per output row: the CPU kernel of
    torchao's int8 weight-only quantization."""
    return torch._weight_int8pack_mm(x, weight, scales)
