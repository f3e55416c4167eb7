"""The frozen backbone's decode step replayed from a CUDA graph over a static KV cache.

On a GPU a decode step of Gemma 3 270M is bound by the host: the eager forward pass launches hundreds of small
kernels a step, and the GPU is idle most of the step's wall time (measured: docs/gpu.md). A CUDA graph records the
step's kernels once and replays them with one launch. A graph replays fixed shapes and addresses, so the step runs
on fixed buffers:

* a **static KV cache** (transformers' ``StaticCache``: each layer's keys/values preallocated for ``rows`` ×
  ``length`` positions, written at the layer's own device-side position counter, so a replay appends where the
  previous one stopped);
* the next token per row, the position, and a 4-D boolean attention mask (rows × positions) that the step marks
  for its own position, all on the device, updated in place before each replay;
* f(c) (the final norm's input, captured by a pre-hook while recording) is read from the graph's output buffer.

A runner holds ``rows`` rows (a power of two at least the decode's rows: spare rows compute values nobody reads)
and ``length`` positions. Models with sliding-window layers are served only while the whole decode fits inside the
window (a static sliding layer's roll past its window is decided on the host, which a replay cannot do); longer
decodes and beam search keep the eager path (``engine.engine``).

In-network plug-ins' per-layer work is recorded too: a runner made for a set of them (``hooks``: an object whose
``on()`` / ``off()`` put their forward hooks on the backbone and take them off, and whose rows are device row masks
that the decode rewrites in place) runs its forward pass, and records its graph, with those hooks on; it is pooled
under that set's key (``hooks_key``: which plug-ins, their weights and settings), the last few sets per model kept.

``graph_decode`` in ``backbone.options.fast_paths``: "auto" (CUDA graphs on a GPU, the eager path elsewhere),
"static" (this module's static cache without graph capture, on any device: the tests check it against the eager
path on the CPU), "off".
"""
from __future__ import annotations

import threading

import torch

from backbone.hf_internals import set_positions_seen
from backbone.options import fast_paths

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
LENGTH_BLOCK = 128
WARM_PROMPT = 240  # tokens: about a few-shot translation prompt's


def graph_mode(device: torch.device) -> str | None:
    """"graph", "static" or None (the eager path) for a decode on ``device``."""
    mode = fast_paths().graph_decode
    if mode == "static":
        return "static"
    if mode == "auto" and device.type == "cuda":
        return "graph"
    return None


def capacity(config, rows: int, length: int) -> tuple[int, int] | None:
    """(rows, positions) of the runner for a decode of ``rows`` rows reaching ``length`` positions, or None when
    the static path cannot serve it."""
    r = next((b for b in ROW_BUCKETS if b >= rows), None)
    if r is None or rows < 1:
        return None
    cap = -(-length // LENGTH_BLOCK) * LENGTH_BLOCK
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ()
    if window and "sliding_attention" in types:
        if length > window:  # a static sliding layer rolls past its window on the host's count
            return None
        cap = min(cap, window)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and cap > limit:
        return None
    return r, cap


class GraphRunner:
    """One decode's static buffers and, on a GPU, the CUDA graph of its step (see the module docstring).

    ``start(cache, mask)`` loads a prefill's KV cache (rows × positions, every position a real one: left padding
    is masked by ``mask``); ``step(next_tok)`` runs one step and returns f(c) per row; ``relayout(gather)`` makes
    row i the old row ``gather[i]``; ``export(rows)`` copies rows out as a transformers ``DynamicCache`` (what a
    kept decode hands to slider moves). ``hooks`` (optional): in-network plug-ins' hooks, on for every forward pass
    of the runner (the recorded one included), off between them."""

    def __init__(self, model, final_norm, rows: int, length: int, graph: bool, hooks=None):
        from transformers import StaticCache

        self.model, self.final_norm = model, final_norm
        self.hooks = hooks
        self.pool_key: tuple | None = None  # set by the pool that made it
        self.R, self.L = rows, length
        dev = next(model.parameters()).device
        self.device = dev
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((1, 1), dtype=torch.long, device=dev)
        # per row, its left padding: a row's position ids count from its first real token (``backbone.padding``)
        self.pads = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.mask = torch.zeros((rows, 1, 1, length), dtype=torch.bool, device=dev)
        self.graph = None
        self.rows = self.fill = 0
        with torch.inference_mode():
            self.mask[..., 0] = True
            self.fc = self._forward()  # the cache's buffers are allocated here, outside any graph
            if graph:
                self._capture()

    def _forward(self) -> torch.Tensor:
        captured = {}
        handle = self.final_norm.register_forward_pre_hook(lambda m, a: captured.__setitem__("fc", a[0]))
        try:
            if self.hooks is not None:
                self.hooks.on()
            self.mask.index_fill_(-1, self.pos.view(-1), True)  # the step's own position
            self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=(self.pos - self.pads).clamp_min(0),
                       past_key_values=self.cache, use_cache=True)
        finally:
            handle.remove()
            if self.hooks is not None:
                self.hooks.off()
        return captured["fc"]

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up passes: the kernels' first-call work stays out of the graph
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.fc = self._forward()
        self.graph = graph

    def start(self, cache, mask: torch.Tensor) -> None:
        rows, length = mask.shape
        if rows > self.R or length >= self.L:
            raise ValueError(f"a runner of {self.R} rows × {self.L} positions cannot hold {rows} × {length}")
        with torch.inference_mode():
            for dyn, st in zip(cache.layers, self.cache.layers):
                st.keys[:rows, :, :length].copy_(dyn.keys)
                st.values[:rows, :, :length].copy_(dyn.values)
                set_positions_seen(st, length)
            self.mask.zero_()
            self.mask[:rows, 0, 0, :length] = mask.to(self.device, torch.bool)
            self.pads.zero_()
            self.pads[:rows, 0] = (mask.to(self.device) == 0).long().cumprod(dim=-1).sum(dim=-1)
            self.mask[rows:, 0, 0, 0] = True  # spare rows attend somewhere: no NaN anywhere
        self.rows, self.fill = rows, length

    def step(self, next_tok: torch.Tensor) -> torch.Tensor:
        if self.fill >= self.L:
            raise ValueError("the decode ran past the runner's positions")
        with torch.inference_mode():
            self.ids[:self.rows, 0].copy_(next_tok.view(-1)[:self.rows], non_blocking=True)
            self.pos.fill_(self.fill)
            if self.graph is not None:
                self.graph.replay()
                fc = self.fc
            else:
                fc = self._forward()
            self.fill += 1
            return fc[:self.rows, -1].clone()

    def relayout(self, gather: list[int]) -> None:
        if len(gather) > self.R:
            raise ValueError("more rows than the runner holds")
        idx = torch.tensor(list(gather) + [0] * (self.R - len(gather)), device=self.device)
        with torch.inference_mode():
            for st in self.cache.layers:
                st.keys.copy_(st.keys.index_select(0, idx))
                st.values.copy_(st.values.index_select(0, idx))
            self.mask.copy_(self.mask.index_select(0, idx))
            self.pads.copy_(self.pads.index_select(0, idx))
        self.rows = len(gather)

    def export(self, rows: list[int]):
        """A ``DynamicCache`` of ``rows`` with every position filled so far (copies)."""
        from transformers import DynamicCache

        out = DynamicCache(config=self.model.config)
        idx = torch.tensor(rows, device=self.device)
        with torch.inference_mode():
            for i, st in enumerate(self.cache.layers):
                out.update(st.keys.index_select(0, idx)[:, :, :self.fill].clone(),
                           st.values.index_select(0, idx)[:, :, :self.fill].clone(), i)
        return out


class RunnerPool:
    """Runners by (rows, positions) — and, for in-network plug-ins' hooks, by the hooks' key —, each used by one
    decode at a time (the studio decodes in several threads); a graph is recorded once per runner and replayed by
    every later decode that takes it. Runners with hooks are kept for the ``hooked_keys`` most recently used hook
    keys per model (a slider move or another plug-in makes a new key; an older key's free runners are dropped)."""

    def __init__(self, per_key: int = 2, hooked_keys: int = 4):
        self.per_key = per_key
        self.hooked_keys = hooked_keys
        self._free: dict[tuple, list[GraphRunner]] = {}
        self._count: dict[tuple, int] = {}
        self._recent: dict[tuple, list] = {}  # (model id, graph) → hook keys, least recently used first
        self._lock = threading.Lock()
        self.disabled: dict[tuple, str] = {}  # (model id, graph[, hook key]) → why recording failed (then eager)

    def take(self, model, final_norm, rows: int, length: int, graph: bool, hooks_key=None,
             make_hooks=None) -> GraphRunner | None:
        return self.take_or_why(model, final_norm, rows, length, graph, hooks_key, make_hooks)[0]

    def take_or_why(self, model, final_norm, rows: int, length: int, graph: bool, hooks_key=None,
                    make_hooks=None) -> tuple[GraphRunner | None, str]:
        """(a runner, "") or (None, why the decode takes the eager path). ``make_hooks(rows)``: the hooks of a new
        runner of ``rows`` rows, for ``hooks_key`` (a hashable key of what they do)."""
        cap = capacity(model.config, rows, length)
        if cap is None:
            return None, (f"{rows} rows × {length} positions: more than a runner holds (or past the model's "
                          f"sliding window)")
        mkey = (id(model), graph)
        key = mkey + cap + (() if hooks_key is None else (hooks_key,))
        dkey = mkey + (() if hooks_key is None else (hooks_key,))
        with self._lock:
            for k in (mkey, dkey):
                if k in self.disabled:
                    return None, f"recording failed: {self.disabled[k]}"
            if hooks_key is not None:
                recent = self._recent.setdefault(mkey, [])
                if hooks_key in recent:
                    recent.remove(hooks_key)
                recent.append(hooks_key)
                for old in recent[:-self.hooked_keys]:
                    recent.remove(old)
                    self._drop(mkey, old)
            free = self._free.setdefault(key, [])
            if free:
                return free.pop(), ""
            if self._count.get(key, 0) >= self.per_key:
                return None, f"every runner of {cap[0]} rows × {cap[1]} positions is in use"
            self._count[key] = self._count.get(key, 0) + 1
        try:
            hooks = None if make_hooks is None else make_hooks(cap[0])
            runner = GraphRunner(model, final_norm, cap[0], cap[1], graph, hooks)
        except Exception as exc:  # noqa: BLE001 — a step that cannot be recorded decodes eagerly
            import logging

            why = f"{type(exc).__name__}: {exc}"
            logging.getLogger(__name__).warning("decode step not recorded (%s): the eager path serves it", why)
            with self._lock:
                self._count[key] -= 1
                self.disabled[dkey] = why
            return None, f"recording failed: {why}"
        runner.pool_key = key
        return runner, ""

    def _drop(self, mkey: tuple, hooks_key) -> None:
        """Forget a hook key's runners (the lock held): free ones now, those in use when they come back."""
        for table in (self._free, self._count):
            for k in [k for k in table if k[:2] == mkey and len(k) == 5 and k[4] == hooks_key]:
                del table[k]
        self.disabled.pop(mkey + (hooks_key,), None)

    def prepare(self, model, final_norm, shapes) -> int:
        """Record the runners of ``shapes`` ((rows, length) pairs) ahead of the first decode that needs them (a
        start-up warm-up: recording a graph costs a few forward passes). Returns how many are ready."""
        ready = 0
        for rows, length in shapes:
            runner = self.take(model, final_norm, rows, length, graph=True)
            if runner is not None:
                self.give_back(runner)
                ready += 1
        return ready

    def give_back(self, runner: GraphRunner) -> None:
        key = runner.pool_key
        with self._lock:
            if self._count.get(key):  # not a forgotten model's (or hook key's)
                self._free.setdefault(key, []).append(runner)

    def forget(self, model) -> None:
        """Drop every runner of ``model`` (a backbone switched away: its runners hold the model and their buffers)."""
        with self._lock:
            for table in (self._free, self._count, self.disabled, self._recent):
                for key in [k for k in table if k[0] == id(model)]:
                    del table[key]

    def counts(self) -> dict:
        """Runners made, by (model id, graph, rows, positions[, hook key])."""
        with self._lock:
            return dict(self._count)


RUNNERS = RunnerPool()

# What a start-up warm-up records on a GPU: the comparison's row counts (a row, up to 4, up to 8) at the lengths of a
# short and a long few-shot prompt plus the default 64 new tokens.
WARM_SHAPES = tuple((r, n) for r in (1, 4, 8) for n in (256, 384, 512))


def warm_up(backbone) -> dict:
    """On a GPU: one short eager decode (the kernels' and libraries' first-call work) and the CUDA graphs of
    ``WARM_SHAPES``, so that the first comparison after a start runs warm. Nothing on a CPU. Returns what it did."""
    if backbone.device.type != "cuda" or graph_mode(backbone.device) != "graph":
        return {}
    try:
        return _warm_up(backbone)
    except Exception as exc:  # noqa: BLE001 — a warm-up that fails leaves the first comparison cold, nothing else
        import logging

        logging.getLogger(__name__).warning("GPU warm-up skipped: %s", exc)
        return {"error": str(exc)}


def _warm_up(backbone) -> dict:
    import time

    t = time.perf_counter()
    bos = backbone.tokenizer.bos_token_id or 0
    with torch.inference_mode():
        # a prompt's length too: attention and matrix kernels are chosen (and their libraries loaded) per shape
        backbone.forward_fc(torch.tensor([[bos] * WARM_PROMPT], device=backbone.device), use_cache=True)
        ids = torch.tensor([[bos] * 16], device=backbone.device)
        fc, out = backbone.forward_fc(ids, use_cache=True)
        past = out.past_key_values
        for _ in range(3):
            logits = backbone.head_logits(backbone.final_norm(fc[:, -1:]))
            tok = torch.log_softmax(logits[:, -1], dim=-1).topk(2).indices[:, :1]
            fc, out = backbone.forward_fc(tok, past_key_values=past, use_cache=True)
    ready = RUNNERS.prepare(backbone.decoder, backbone.final_norm, WARM_SHAPES)
    torch.cuda.synchronize()
    return {"graphs": ready, "seconds": round(time.perf_counter() - t, 2)}
