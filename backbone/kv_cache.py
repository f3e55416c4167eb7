"""A decode's KV cache that appends into block-sized buffers instead of concatenating, and re-lays its rows out
when a comparison's rows part or finish (docs/precision.md, "Norms, KV cache and plug-in products")."""
from __future__ import annotations

import torch
from torch import nn

from backbone.cpu_attention import CPU_DECODE_ATTENTION
from backbone.hf_internals import (
    attn_implementation,
    count_appended,
    dynamic_layer_kinds,
    positions_seen,
    rebuilt_as,
    set_positions_seen,
)
from backbone.options import fast_paths

KV_BLOCK = 32  # a growing KV cache's buffers hold a multiple of this many positions


class GrowingKVLayer:
    """A transformers cache layer (``DynamicLayer``, ``DynamicSlidingWindowLayer`` below its window: the attributes
    it relies on are listed and checked in ``backbone.hf_internals``) that appends a
    decode step's keys and values into buffers of ``KV_BLOCK``-rounded capacity instead of concatenating: the
    dynamic cache copies every row's keys and values at every layer and step. ``keys``/``values`` stay exactly the
    cached rows and positions (views of a *store*, carried as ``pema_store``; ``pema_buffer`` is the rows' part of
    it, every position, for ``cpu_decode_attention``), so
    every other use of the cache — ``batch_select_indices``, ``crop``, ``reorder_cache``, the prefix cache's deep
    copies — sees what it saw before; any of them that replaces the tensors makes the next append copy them into a
    new store.

    A store's position capacity depends only on the length (``KV_BLOCK`` rounding), so a row's attention runs over
    the same shapes however its cache came to be — in a batch, alone, resumed from a slider move; positions past the
    fill are zero in every row of it. A store may hold spare rows (:meth:`relayout`: a comparison's rows part, and
    a parting row is written into a spare row instead of the whole cache being copied). An append writes in place
    only into the store its own ``keys`` view came from and only at that store's marks (``pema_fill`` positions,
    ``pema_rows`` rows): a copy of the cache that shares a store (a shallow copy; a deep copy whose memo keeps the
    tensors) and appends second gets a store of its own."""

    def _store(self, rows: int, length: int) -> tuple | None:
        """(key store, value store) this layer's views may write into at these marks, else None."""
        ks, vs = getattr(self.keys, "pema_store", None), getattr(self.values, "pema_store", None)
        if ks is None or vs is None:
            return None
        if any(getattr(t, "pema_fill", -1) != length or getattr(t, "pema_rows", -1) != rows for t in (ks, vs)):
            return None
        return ks, vs

    def _show(self, ks: torch.Tensor, vs: torch.Tensor, rows: int, length: int) -> None:
        """Make ``rows`` × ``length`` of the stores this layer's keys and values (and the stores' marks)."""
        for t in (ks, vs):
            t.pema_fill, t.pema_rows = length, rows
        self.keys, self.values = ks[:rows, :, :length], vs[:rows, :, :length]
        for view, t in ((self.keys, ks), (self.values, vs)):
            view.pema_store, view.pema_buffer = t, t[:rows]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        window = getattr(self, "sliding_window", None)
        if (not fast_paths().growing_kv or not self.is_initialized or self.keys is None or self.keys.dim() != 4
                or (window is not None and positions_seen(self) + n >= window)):
            return super().update(key_states, value_states, *args, **kwargs)
        rows, L = self.keys.shape[0], self.keys.shape[-2]
        stores = self._store(rows, L)
        if stores is None or stores[0].shape[-2] < L + n or stores[0].dtype != key_states.dtype:
            spare = stores[0].shape[0] if stores is not None else rows
            stores = tuple(_new_kv_store(view, spare, L + n, zero=False) for view in (self.keys, self.values))
            for store, view in zip(stores, (self.keys, self.values)):
                store[:rows, :, :L] = view
                store[:, :, L + n:].zero_()  # a spare row's first positions are written when a row moves in
        ks, vs = stores
        ks[:rows, :, L:L + n] = key_states
        vs[:rows, :, L:L + n] = value_states
        self._show(ks, vs, rows, L + n)
        count_appended(self, n)
        return self.keys, self.values

    def relayout(self, gather: list[int], row_capacity: int) -> None:
        """Row i of the cache becomes row ``gather[i]``, room kept for ``row_capacity`` rows. Where the first rows
        stay as they are (``gather`` starts 0, 1, …, rows − 1: rows that part are appended), only the appended rows
        are written, into the store's spare rows; otherwise one copy of the selected rows into a new store
        (transformers' ``reorder_cache`` selects into new tensors, which the next append copied again)."""
        keys, values = self.keys, self.values
        if not self.is_initialized or keys is None:
            return None
        if keys.dim() != 4 or keys.shape[-2] == 0:
            return super().reorder_cache(torch.tensor(gather, device=keys.device))
        rows, L, G = keys.shape[0], keys.shape[-2], len(gather)
        stores = self._store(rows, L)
        if stores is not None and gather[:rows] == list(range(rows)) and stores[0].shape[0] >= G:
            for j, s in enumerate(gather[rows:], start=rows):  # one row at a time: no temporary of the rows
                stores[0][j, :, :L].copy_(keys[s])
                stores[1][j, :, :L].copy_(values[s])
            return self._show(*stores, G, L)
        idx = torch.tensor(gather, device=keys.device)
        new = []
        for view, own in zip((keys, values), stores or (None, None)):
            # a spare row's positions below the fill are written when a row is appended there, the rest stay zero
            store = _new_kv_store(view, max(row_capacity, G), L + 1, zero=False)
            old = getattr(view, "pema_buffer", None)
            if own is not None and old.shape[-2] == store.shape[-2]:  # one copy, the positions past the fill (zero) too
                torch.index_select(old, 0, idx, out=store[:G])
                store[G:, :, L:].zero_()
            else:
                store[:, :, L:].zero_()
                for j, s in enumerate(gather):
                    store[j, :, :L].copy_(view[s])
            new.append(store)
        self._show(*new, G, L)


def _new_kv_store(like: torch.Tensor, rows: int, length: int, zero: bool = True) -> torch.Tensor:
    """A store for ``rows`` rows of ``length`` positions, rounded up to ``KV_BLOCK``, shaped and typed like
    ``like`` (zero: positions past a store's fill are zero, see :class:`GrowingKVLayer`)."""
    cap = -(-length // KV_BLOCK) * KV_BLOCK
    make = like.new_zeros if zero else like.new_empty
    return make(rows, like.shape[1], cap, like.shape[-1])


def relayout_kv_rows(cache, gather: list[int], row_capacity: int) -> None:
    """Row i of a decode's KV cache becomes row ``gather[i]`` (a comparison's rows part or finish): a growing
    layer's :meth:`GrowingKVLayer.relayout`, any other layer transformers' ``reorder_cache``. A store made by an
    append inside the forward pass (``torch.inference_mode``) takes writes only in inference mode: the relayout of
    such a cache runs in it too."""
    idx = None
    for layer in cache.layers:
        if isinstance(layer, GrowingKVLayer) and fast_paths().growing_kv:
            keys = getattr(layer, "keys", None)
            with torch.inference_mode(isinstance(keys, torch.Tensor) and keys.is_inference()):
                layer.relayout(gather, row_capacity)
        else:
            if idx is None:
                idx = torch.tensor(gather, device=layer.keys.device if layer.keys is not None else None)
            layer.reorder_cache(idx)


def join_left_padded(caches: list, lengths: list[int], width: int):
    """The rows of ``caches`` (transformers caches of one forward pass each, ``lengths[i]`` positions) as one cache,
    in order, each pass's positions right-aligned to ``width`` (zeros in front: left padding, which the mask hides):
    separate prefills joined for one batched decode. The first cache becomes the joined one. None (nothing changed)
    when a layer does not hold every position of its pass (a sliding window past its width)."""
    first = caches[0]
    layers = [getattr(c, "layers", None) for c in caches]
    if any(ls is None or len(ls) != len(layers[0]) for ls in layers):
        return None
    for ls, n in zip(layers, lengths):
        if any(layer.keys is None or layer.keys.dim() != 4 or layer.keys.shape[-2] != n for layer in ls):
            return None
    for i, layer in enumerate(layers[0]):
        for name in ("keys", "values"):
            parts = [torch.nn.functional.pad(getattr(ls[i], name), (0, 0, width - n, 0))
                     for ls, n in zip(layers, lengths)]
            setattr(layer, name, torch.cat(parts))
        set_positions_seen(layer, width)  # a sliding layer below its window: every position it holds
    return first


def grow_kv_cache(cache, model: nn.Module) -> None:
    """Switch a transformers ``DynamicCache``'s layers to :class:`GrowingKVLayer` appends, in place (a decode's
    cache after its prefill), where ``model`` runs :func:`cpu_decode_attention` (bfloat16: its products read the
    buffers; float32 — also float16 weight-only's activations —: SDPA reads the views, the same bits as on
    concatenated tensors, and saves the concatenation). Layers of other kinds are left as they are."""
    if (attn_implementation(model) != CPU_DECODE_ATTENTION
            or getattr(model, "dtype", None) not in (torch.bfloat16, torch.float32)):
        return
    kinds = dynamic_layer_kinds()  # none on an older transformers: keep its cache
    layers = getattr(cache, "layers", None)
    for i, layer in enumerate(layers or ()):
        kind = type(layer)
        if kind in kinds:
            layers[i] = rebuilt_as(layer, _GROWING.setdefault(kind, type(f"Growing{kind.__name__}",
                                                                         (GrowingKVLayer, kind), {})))


_GROWING: dict = {}
