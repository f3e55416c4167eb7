"""The prompt-prefix KV cache: a comparison's instruction and few-shot examples are prefilled once, not per decode."""
from __future__ import annotations

import copy
import itertools
import threading
import weakref
from collections import OrderedDict

from backbone.model import Backbone
from backbone.prompts import Prompt, common_prefix_len
from backbone.torch_internals import version


class PrefixKV:
    """A small LRU of prompt-prefix KV caches.

    Every comparison with the same prompt starts with the same instruction and few-shot examples (hundreds of
    tokens with the built-in prompts), and the app re-decodes the same rows each time a slider moves. The prefix's
    KV cache is kept per (backbone, prefill groups, prefix tokens); a group of in-network rows is keyed by its
    plug-in (held weakly, with its weights' version counters, so that a retrained or freed plug-in never matches)
    and settings. Every source of a batch reads it (each context is prefilled in a pass of its own:
    ``engine.forward.prefill``), always at its own shared length.
    """

    MIN_TOKENS = 16  # shorter shared prefixes are not worth a cache entry

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def shared_len(backbone: Backbone, prompt: Prompt, source: str, ctx: list[int]) -> int:
        """Tokens of ``ctx`` that the prompt renders the same for any source (at least one token is left over)."""
        # Tokens at the slot's edge may merge with the source's first characters, so the prefix is what the
        # prompt renders the same for two unrelated sources and for this one.
        others = [backbone.encode_context(prompt.render(s)) for s in ("0", "Xy")]
        n = min(common_prefix_len([ctx, *others]), len(ctx) - 1)
        return n if n >= PrefixKV.MIN_TOKENS else 0

    @staticmethod
    def plugin_version(plugin) -> int:
        """A number that changes whenever a weight or buffer of ``plugin`` is written (its version counters)."""
        return sum(version(t) for t in itertools.chain(plugin.parameters(), plugin.buffers()))

    def _key(self, backbone, groups: list) -> tuple:
        return (id(backbone.model),
                tuple((id(p), k, self.plugin_version(p)) if p is not None else None for p, k in groups))

    def get(self, backbone, groups: list, ctx: list[int], length: int | None = None):
        """``(P, cache)``: a copy of the longest stored prefix cache for these groups whose tokens start ``ctx``
        (at least one token of ``ctx`` left over) — with ``length``, only one of exactly that many tokens (a decode
        whose rows must not depend on what earlier decodes stored: the prefix's length sets the passes' shapes) —,
        or ``(0, None)``."""
        key = self._key(backbone, groups)
        owners = [backbone.model] + [p for p, _ in groups]
        with self._lock:
            best = None
            for (k, prefix), (refs, cache) in list(self._entries.items()):
                if k != key:
                    continue
                if any(r() is not o for r, o in zip(refs, owners)):
                    del self._entries[(k, prefix)]  # an id was reused by another object
                    continue
                n = len(prefix)
                if length is not None and n != length:
                    continue
                if n < len(ctx) and tuple(ctx[:n]) == prefix and (best is None or n > len(best[0])):
                    best = (prefix, cache)
            if best is None:
                return 0, None
            self._entries.move_to_end((key, best[0]))
        return len(best[0]), copy.deepcopy(best[1])

    def put(self, backbone, groups: list, prefix: list[int], cache) -> None:
        refs = [weakref.ref(backbone.model)] + [weakref.ref(p) if p is not None else (lambda: None)
                                                for p, _ in groups]
        entry_key = (self._key(backbone, groups), tuple(prefix))
        with self._lock:
            self._entries[entry_key] = (refs, copy.deepcopy(cache))
            self._entries.move_to_end(entry_key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


PREFIX_KV = PrefixKV()
