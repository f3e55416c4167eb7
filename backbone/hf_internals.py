"""Every use of a transformers internal (a private attribute, a module path outside ``transformers``' top level, a
class the project subclasses or rebuilds) goes through this module, so that a transformers upgrade has one place to
check: ``tests/test_library_internals.py`` names the pinned version (requirements.txt) and checks the behaviour each
function relies on.

- the attention implementation a model runs (``config._attn_implementation``), and registering one of our own with
  the masks SDPA gets (``AttentionInterface`` / ``AttentionMaskInterface``, ``masking_utils``' table);
- SDPA's attention function (``integrations.sdpa_attention``), which our CPU decode attention falls back to;
- the dynamic cache's layer classes (``cache_utils.DynamicLayer`` / ``DynamicSlidingWindowLayer``: their
  ``keys``, ``values``, ``is_initialized``, ``cumulative_length``, ``sliding_window``, ``update``,
  ``reorder_cache``), which ``backbone.kv_cache`` subclasses, and rebuilding a layer as such a subclass in place;
- the cache layers' position counters (a sliding layer's ``cumulative_length``; a static layer's device-side
  ``cumulative_length`` tensor and a static sliding layer's host-side ``cumulative_length_int``), which a cache
  filled or joined outside ``update`` must be told (``backbone.kv_cache``, ``backbone.graph_decode``);
- a cache stand-in (``plugins.training_batches.PastPrefix``, ``plugins.memory_tuning.PrefixKV``), given to one
  attention module as its ``past_key_values`` by a pre-hook: the module calls ``update(key_states, value_states,
  layer_idx, ...)`` and attends over the keys and values it returns (nothing else of the cache is asked there).
"""
from __future__ import annotations

import torch

PINNED = "5.23.0"  # the transformers these internals are checked against (requirements.txt)


# --- attention -----------------------------------------------------------------------------------------------------
def attn_implementation(model_or_config) -> str | None:
    """The attention implementation a model (or its config) runs ("sdpa", "eager", a registered name), or None."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "_attn_implementation", None)


def set_attn_implementation(model, name: str) -> None:
    """Switch ``model`` to the attention implementation ``name`` (the config field on a transformers without
    ``set_attn_implementation``)."""
    switch = getattr(model, "set_attn_implementation", None)
    if switch is not None:
        switch(name)
    else:  # pragma: no cover — an older transformers
        model.config._attn_implementation = name


def register_attention(name: str, fn) -> None:
    """Register ``fn`` as the attention implementation ``name``, with the masks SDPA gets (padding, sliding window:
    a name registered without masks gets none at all). Raises where this transformers cannot."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def sdpa_attention():
    """transformers' SDPA attention function (``module, query, key, value, attention_mask, dropout=, scaling=,
    **kwargs`` → (output, weights))."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


# --- the dynamic cache's layers ------------------------------------------------------------------------------------
def dynamic_layer_kinds() -> tuple[type, ...]:
    """The dynamic cache's layer classes (full attention, sliding window) a growing layer may stand in for; empty on
    a transformers without them."""
    try:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:  # pragma: no cover — an older transformers
        return ()
    return (DynamicLayer, DynamicSlidingWindowLayer)


def rebuilt_as(obj, cls: type):
    """A new ``cls`` instance holding ``obj``'s state (its instance ``__dict__``, shared tensors and all): a cache
    layer becomes a subclass of its own class without ``__init__`` running (a ``__class__`` assignment is refused
    for these classes)."""
    new = object.__new__(cls)
    new.__dict__.update(obj.__dict__)
    return new


# --- the cache layers' position counters ---------------------------------------------------------------------------
def positions_seen(layer) -> int | None:
    """How many positions a dynamic sliding-window layer has been given (it keeps at most its window of them); None
    for a layer that keeps every position (its keys' length says it)."""
    count = getattr(layer, "cumulative_length", None)
    return count if isinstance(count, int) else None


def count_appended(layer, n: int) -> None:
    """Count ``n`` positions appended to a dynamic layer without its ``update`` (a sliding layer's count; a full
    layer keeps none)."""
    if isinstance(getattr(layer, "cumulative_length", None), int):
        layer.cumulative_length += n


def set_positions_seen(layer, length: int) -> None:
    """Make a cache layer filled outside ``update`` (keys and values copied in) count ``length`` positions: a
    static layer's device-side counter (where its next ``update`` writes) and a static sliding layer's host-side
    one (what eager steps read), a dynamic sliding layer's count; a full dynamic layer keeps none."""
    count = getattr(layer, "cumulative_length", None)
    if isinstance(count, torch.Tensor):
        count.fill_(length)
    elif isinstance(count, int):
        layer.cumulative_length = length
    if hasattr(layer, "cumulative_length_int"):
        layer.cumulative_length_int = length
