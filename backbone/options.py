"""The backbone's fast paths as options of a scope, not as process-wide switches.

Each fast path gives what the plain path gives (bit for bit, or to float rounding where docs/precision.md says so)
and is on by default. A benchmark or a test that times or checks the plain path turns one off for the code it runs
— ``with using_fast_paths(fused_norms=False): ...`` — and only there: the options live in a context variable, so
another thread (the studio decodes in several) keeps the defaults.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class FastPaths:
    packed_bf16: bool = True               # bfloat16 linears through oneDNN's packed weights (``PackedBF16Linear``)
    packed_f32_head: bool = True           # float32's LM head through oneDNN's packed weights (``PackedF32Linear``)
    fused_norms: bool = True               # RMSNorms as one fused operator (``FusedRMSNorm``)
    growing_kv: bool = True                # a decode's KV cache appends into blocks (``GrowingKVLayer``)
    small_forward_one_thread: bool = True  # a small forward pass on one thread (``small_forward_threads``)
    small_forward_max_tokens: int = 32     # ... up to this many tokens (batch × length)
    small_work_one_thread: bool = True     # a step's small work around the decoder on one thread
    graph_decode: str = "auto"             # the frozen step from a CUDA graph on a GPU ("static": no graph, any
    # device — the tests' check of the static path; "off": the eager path) (``backbone.graph_decode``)


_PATHS: ContextVar[FastPaths] = ContextVar("backbone_fast_paths", default=FastPaths())


def fast_paths() -> FastPaths:
    """The fast paths in force here."""
    return _PATHS.get()


@contextmanager
def using_fast_paths(**changes):
    """The fast paths with ``changes`` (e.g. ``packed_bf16=False``) while inside, in this context only."""
    token = _PATHS.set(dataclasses.replace(_PATHS.get(), **changes))
    try:
        yield
    finally:
        _PATHS.reset(token)
