"""How many threads each part of a decode step runs on (docs/precision.md, "Threads (OpenMP)"): under
``OMP_WAIT_POLICY=PASSIVE`` every parallel region first wakes a sleeping thread, so a step's small work runs on one
thread and its large products (the LM head, a kNN scan, vocabulary-wide rows) on all of them."""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager, nullcontext

import torch

from backbone.options import fast_paths


def small_forward_threads(n_tokens: int) -> int | None:
    """How many threads a forward pass of ``n_tokens`` tokens (batch × length) should run on, or None to leave the
    count as it is. A decode step's products are small (Gemma 3 270M: 640-wide layers, 1-32 rows), and under
    ``OMP_WAIT_POLICY=PASSIVE`` — the project's default, see ``ground`` — every parallel region first wakes a sleeping
    thread: the 126 decoder linears of a bfloat16 step spent more waking threads than the second core gave back. One
    thread for such a forward, the LM head (one large product, outside the decoder) on all of them (``python -m
    benchmarks anchor``, BENCHMARKS.md, "Decode time per token"). With spinning threads (policy not PASSIVE) the second
    core wins, so the count is left alone; training (gradients on) is left alone too."""
    paths = fast_paths()
    if (not paths.small_forward_one_thread or n_tokens > paths.small_forward_max_tokens
            or torch.is_grad_enabled() or process_threads() <= 1
            or os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"):
        return None
    return 1


def wait_policy() -> str:
    """How this process's idle OpenMP threads wait, as its environment said before torch loaded (``ground``):
    ``"passive"`` (sleep at once: the studio's default) or ``"spin"`` (spin a while first: ``plugins train`` and the
    other batch commands, or a user's setting). Training-time records name it: a training step is slower under
    PASSIVE (``plugins.estimate``)."""
    return "passive" if os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE" else "spin"


# torch's thread count is one setting for the whole process, and the studio decodes in several threads at once: a
# per-caller save/restore could interleave (A saves 2 and sets 1, B saves 1, A restores 2, B restores 1) and leave
# the process on one thread. So one-thread sections are counted: the first to enter lowers the count, the last to
# leave restores what the process had.
_ONE_THREAD = {"sections": 0, "full": 0}
_ONE_THREAD_LOCK = threading.Lock()


def process_threads() -> int:
    """The process's thread count outside one-thread sections."""
    with _ONE_THREAD_LOCK:
        return _ONE_THREAD["full"] if _ONE_THREAD["sections"] else torch.get_num_threads()


@contextmanager
def one_thread_section(enabled: bool = True):
    """One thread while inside (``enabled``), counted across the process's threads (see above)."""
    if not enabled:
        yield
        return
    with _ONE_THREAD_LOCK:
        if _ONE_THREAD["sections"] == 0:
            _ONE_THREAD["full"] = torch.get_num_threads()
        _ONE_THREAD["sections"] += 1
        torch.set_num_threads(1)
    try:
        yield
    finally:
        with _ONE_THREAD_LOCK:
            _ONE_THREAD["sections"] -= 1
            if _ONE_THREAD["sections"] == 0:
                torch.set_num_threads(_ONE_THREAD["full"])


@contextmanager
def small_work_threads():
    """A decode step's work around the decoder and the LM head — the plug-ins' extra states and mixes, log-softmax,
    token selection: hundreds of small operators, each under ``OMP_WAIT_POLICY=PASSIVE`` a parallel region that
    first wakes a sleeping thread — on one thread, as ``small_forward_threads`` does for the decoder; the large
    products inside (the LM head, a kNN scan) take the process's threads back with :func:`all_threads`. Where
    ``small_forward_threads`` leaves the count alone (spinning threads, its fast path turned off) this does too."""
    few = None if torch.is_grad_enabled() or not fast_paths().small_work_one_thread else small_forward_threads(1)
    with one_thread_section(few is not None):
        yield


@contextmanager
def all_threads():
    """Inside a one-thread section: the process's thread count for one large product (the LM head over a
    262,144-token vocabulary, a scan of 100k memory keys); elsewhere nothing changes."""
    with _ONE_THREAD_LOCK:
        full = _ONE_THREAD["full"] if _ONE_THREAD["sections"] else 0
    if full <= 1 or torch.get_num_threads() == full:
        yield
        return
    torch.set_num_threads(full)
    try:
        yield
    finally:
        with _ONE_THREAD_LOCK:
            torch.set_num_threads(1 if _ONE_THREAD["sections"] else _ONE_THREAD["full"])


# Vocabulary-wide row operations (log-softmax, the top-k of token selection) of this many elements and more (4
# rows of Gemma's 262,144 tokens) take every thread inside a step's small work: a second thread saves them more
# than the one wake-up it costs. Both parallelise over rows (each row's reduction on one thread), so the bits do
# not change with the thread count.
VOCAB_WIDE_ELEMENTS = 1 << 20


def vocab_wide_threads(x: torch.Tensor):
    """``all_threads()`` for a vocabulary-wide operation on ``x`` that is large enough (``VOCAB_WIDE_ELEMENTS``),
    else nothing."""
    return all_threads() if x.numel() >= VOCAB_WIDE_ELEMENTS else nullcontext()
