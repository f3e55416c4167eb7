"""Training batches of the in-network plug-ins without recomputing what never changes: the shared prompt prefix's
keys and values once per memory (``FrozenPrefix``, given as every sample's past through ``PastPrefix``), and the
frozen layers below the lowest layer a plug-in touches once per fixed, length-bucketed mini-batch
(``TrainingBatches``, ``PreparedBatch``); ``FullBatch`` is the reference path (whole sequences through the whole
backbone). Both shortcuts are exact (tests/test_training_shortcuts.py); docs/training.md has the measurements."""
from __future__ import annotations

import time

import torch

from backbone.model import StopForward
from backbone.torch_internals import forward_replaced
from plugins.seqtrain import SeqData, collate, collate_own, length_buckets


def first_tensor(output):
    """The hidden state of a module output (a tensor, or a tuple/list whose first element is the hidden state)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _detach(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, tuple):
        return tuple(_detach(x) for x in v)
    if isinstance(v, list):
        return [_detach(x) for x in v]
    if isinstance(v, dict):
        return {k: _detach(x) for k, x in v.items()}
    return v


def _repeat_rows(v, batch: int, repeat: int):
    """A layer argument with the batch's rows ``repeat`` times (one shared by all rows is kept as it is)."""
    if isinstance(v, torch.Tensor):
        return v.repeat(repeat, *([1] * (v.dim() - 1))) if v.dim() and v.shape[0] == batch and batch > 0 else v
    if isinstance(v, tuple):
        return tuple(_repeat_rows(x, batch, repeat) for x in v)
    if isinstance(v, dict):
        return {k: _repeat_rows(x, batch, repeat) for k, x in v.items()}
    return v


def layer_types(backbone) -> list:
    """Each decoder layer's attention type (Gemma 3: sliding / full); layers of one type get the same arguments."""
    types = getattr(backbone.model.config, "layer_types", None)
    return list(types) if types and len(types) == backbone.num_layers else ["all"] * backbone.num_layers


class PastPrefix:
    """Stands in for ``past_key_values`` in a training forward over samples' own positions: every layer's keys and
    values of the frozen shared prefix (one row, expanded over the batch) before the new ones. It stores nothing,
    so one prefix serves every batch."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        self.kv = kv

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        pk, pv = self.kv[layer_idx]
        n = key_states.shape[0]
        return (torch.cat([pk.to(key_states.dtype).expand(n, -1, -1, -1), key_states], dim=2),
                torch.cat([pv.to(value_states.dtype).expand(n, -1, -1, -1), value_states], dim=2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv[0][0].shape[2]


class FrozenPrefix:
    """The frozen backbone's keys and values of a shared prompt prefix (every layer), computed once."""

    def __init__(self, backbone, tokens: list[int]):
        self.tokens = list(tokens)
        ids = torch.tensor([self.tokens], dtype=torch.long)
        with torch.no_grad():
            _, out = backbone.forward_fc(ids, use_cache=True, inference=False)
        self.kv = [(layer.keys.detach(), layer.values.detach()) for layer in out.past_key_values.layers]
        # a cache layer that keeps fewer positions (a sliding window shorter than the prefix) cannot be stood in for
        self.complete = all(k.shape[2] == len(self.tokens) for k, _ in self.kv)

    def __len__(self) -> int:
        return len(self.tokens)

    def cache(self, backbone, rows: int):
        """A transformers cache holding the prefix for ``rows`` rows (for a forward through the whole decoder)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=backbone.model.config)
        for l, (k, v) in enumerate(self.kv):
            cache.update(k.expand(rows, -1, -1, -1).contiguous(), v.expand(rows, -1, -1, -1).contiguous(), l)
        return cache


class FullBatch:
    """A mini-batch as whole right-padded sequences (``collate``) run through the whole backbone: the reference path.
    ``own_from`` (B,): each row's first position the plug-in acts on (its shared prompt prefix length), or None."""

    def __init__(self, backbone, ids, mask, labels, own_from: torch.Tensor | None = None):
        self.backbone, self.ids, self.mask, self.labels, self.own_from = backbone, ids, mask, labels, own_from
        self.size = ids.shape[0]
        self.tokens = int(mask.sum())

    def fc(self, repeat: int = 1, replace: dict | None = None) -> torch.Tensor:
        ids, mask = (self.ids, self.mask) if repeat == 1 else (self.ids.repeat(repeat, 1), self.mask.repeat(repeat, 1))
        return self.backbone.forward_fc(ids, attention_mask=mask)[0]


class PreparedBatch:
    """A fixed mini-batch made ready once by the frozen backbone: the input of layer ``l0`` (the lowest the plug-in
    touches) at the samples' positions — without the shared prompt prefix when that is the past (``prefix``) —, each
    layer type's arguments, and the labels. ``fc`` runs layers ``l0``… only, with the prefix's keys and values as
    the past: exactly what the whole backbone computes at those positions (tests)."""

    own_from = None  # every position of a prepared batch is the samples' own

    def __init__(self, backbone, hidden, kwargs: dict, labels, tokens: int, prefix: FrozenPrefix | None, l0: int):
        self.backbone, self.hidden, self.kwargs, self.labels = backbone, hidden, kwargs, labels
        self.tokens, self.prefix, self.l0 = tokens, prefix, l0
        self.size = hidden.shape[0]
        self.types = layer_types(backbone)

    def fc(self, repeat: int = 1, replace: dict | None = None) -> torch.Tensor:
        """Pre-norm states (B·repeat, T, d) through layers ``l0``… with whatever hooks are attached; ``replace``:
        {layer index: module run instead of the backbone's layer} (LoRA's private copy of the last layer)."""
        h = self.hidden if repeat == 1 else self.hidden.repeat(repeat, 1, 1)
        past = PastPrefix(self.prefix.kv) if self.prefix is not None else None
        layers = self.backbone.layers
        for l in range(self.l0, len(layers)):
            kw = self.kwargs[self.types[l]]
            if repeat > 1:
                kw = _repeat_rows(kw, self.size, repeat)
            layer = replace.get(l, layers[l]) if replace else layers[l]
            h = first_tensor(layer(h, **kw, past_key_values=past))
        return h


def _pass_through(hidden_states, *args, **kwargs):
    """A decoder layer's stand-in while ``prepare_batch`` reads the layers' arguments: its input unchanged."""
    return hidden_states


def prepare_batch(backbone, data: SeqData, idx: list[int], prefix: FrozenPrefix | None, l0: int
                  ) -> PreparedBatch | None:
    """Run the frozen backbone once over the samples ``idx`` (their own positions, the prefix as the past) up to
    where the input of layer ``l0`` and every layer type's arguments above it are known. None when the layers'
    arguments do not fit a prefix stand-in (an attention mask over another number of keys)."""
    bb = backbone
    P = len(prefix) if prefix is not None else 0
    ids, mask, labels = collate_own(bb, data, idx, P) if prefix is not None else collate(bb, data, idx)
    types = layer_types(bb)
    need = {types[l] for l in range(l0, bb.num_layers)}
    got: dict = {}
    hidden: dict = {}

    def hook_for(l):
        def pre(mod, args, kwargs):
            if l == l0:
                hidden["h"] = (args[0] if args else kwargs["hidden_states"]).detach()
            if types[l] not in got:
                got[types[l]] = _detach({k: v for k, v in kwargs.items()
                                         if k not in ("hidden_states", "past_key_values")})
            if "h" in hidden and need <= set(got):
                raise StopForward()
        return pre

    above = [bb.layers[l] for l in range(l0, bb.num_layers)]
    handles = [layer.register_forward_pre_hook(hook_for(l), with_kwargs=True) for l, layer in enumerate(above, l0)]
    # the layers from l0 up only show their arguments: running them would compute states nobody reads (for l0 = 0
    # with Gemma's first full-attention layer at 5, a third of a forward pass per batch)
    try:
        with torch.no_grad(), forward_replaced(above, _pass_through):
            past = prefix.cache(bb, len(idx)) if prefix is not None else None
            try:
                bb.forward_fc(ids, attention_mask=mask, past_key_values=past, use_cache=past is not None,
                              inference=False)
            except StopForward:
                pass
    finally:
        for h in handles:
            h.remove()
    if "h" not in hidden or not need <= set(got):
        return None
    keys = P + ids.shape[1]
    for kw in got.values():
        m = kw.get("attention_mask")
        if isinstance(m, torch.Tensor) and m.dim() == 4 and m.shape[-1] != keys:
            return None
    return PreparedBatch(bb, hidden["h"], got, labels, int(mask.sum()) - P * len(idx), prefix, l0)


class TrainingBatches:
    """A data set as fixed length-bucketed mini-batches, each prepared the first time it is used and kept
    (``prepare_batch``; a wall-clock budget then bounds the preparation too). With ``frozen`` the shared prompt
    prefix of each bucket is computed once by the frozen backbone (``FrozenPrefix``, one per distinct prefix)."""

    def __init__(self, backbone, data: SeqData, batch_size: int, frozen: bool, l0: int, full: bool = False):
        self.backbone, self.data, self.frozen, self.l0, self.full = backbone, data, frozen, l0, full
        self.buckets = length_buckets(data, batch_size, frozen)
        self._prepared: dict[int, object] = {}
        self._prefixes: dict[tuple, FrozenPrefix] = {}
        self.prepare_seconds = 0.0
        self.fallbacks = 0

    def __len__(self) -> int:
        return len(self.buckets)

    def __getitem__(self, i: int):
        got = self._prepared.get(i)
        if got is None:
            t0 = time.time()
            got = self._prepared[i] = self._prepare(self.buckets[i])
            self.prepare_seconds += time.time() - t0
        return got

    def _prefix(self, idx: list[int]) -> FrozenPrefix | None:
        if not self.frozen:
            return None
        P = self.data.shared_len(idx[0])
        if P <= 0:
            return None
        tokens = tuple(self.data.contexts[idx[0]][:P])
        if tokens not in self._prefixes:
            self._prefixes[tokens] = FrozenPrefix(self.backbone, list(tokens))
        pre = self._prefixes[tokens]
        return pre if pre.complete else None

    def _full(self, idx: list[int]) -> FullBatch:
        ids, mask, labels = collate(self.backbone, self.data, idx)
        own = (torch.tensor([self.data.shared_len(i) for i in idx], device=ids.device) if self.frozen else None)
        return FullBatch(self.backbone, ids, mask, labels, own)

    def _prepare(self, idx: list[int]):
        if self.full:
            return self._full(idx)
        prefix = self._prefix(idx)
        if self.frozen and prefix is None and self.data.shared_len(idx[0]) > 0:
            self.fallbacks += 1
            return self._full(idx)
        got = prepare_batch(self.backbone, self.data, idx, prefix, self.l0)
        if got is None:
            self.fallbacks += 1
            return self._full(idx)
        return got

    def info(self) -> dict:
        return {"prompt_prefix": "frozen" if self.frozen else "adapted", "lowest_layer": self.l0,
                "batches_per_epoch": len(self.buckets), "prepare_seconds": round(self.prepare_seconds, 2),
                **({"shared_prefix_tokens": sorted({len(p) for p in self._prefixes.values()})} if self.frozen else {}),
                **({"unprepared_batches": self.fallbacks} if self.fallbacks else {})}
