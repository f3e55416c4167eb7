"""The CPU inference linears behind the precisions (docs/precision.md): oneDNN-packed bfloat16 and float32 (the LM
head), FBGEMM's float16 weight-only, int8 weight-only; each a frozen ``nn.Linear`` whose product without gradients
runs a maintained torch kernel, and whose rows keep their bits in products of any row count. Also what the CPU can
run (``*_available``, ``native_bf16_cpu``) and its description for benchmark results."""
from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path

import torch
from torch import nn

from backbone.options import fast_paths
from backbone.torch_internals import (
    copy_forward_hooks,
    fp16_linear,
    fp16_pack_linear,
    int8_weight_mm,
    mkldnn_linear,
    mkldnn_pack_linear,
)

_log = logging.getLogger("pema.backbone")


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
    is native, the cores. The precisions' speeds differ by CPU kind (AVX-512 BF16, AVX2 only): numbers from two
    kinds are not comparable (BENCHMARKS, "The machine")."""
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
    bfloat16 kernel: docs/precision.md, "A row decodes alike alone and in a batch") — ``FEW_ROWS``, per kernel.
    Exactness: a kernel may
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
        ``rows`` rows — what ``FEW_ROWS`` relies on (true of the CPUs the tests run on). Checked once per kernel
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
        limit = self.pad_limit  # (the few-row test first: a decode step makes ~130 of these calls)
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
        copy_forward_hooks(self, plain)
        return type(self)(plain, prepared=self._copied_prepared())


_ROWS_INVARIANT: dict = {}  # (kernel class, in, out, min_rows) → whether rows keep their bits (checked at load)


class PackedBF16Linear(KernelLinear):
    """A bfloat16 linear whose forward without gradients runs oneDNN's linear on a weight pre-packed into oneDNN's
    blocked layout once (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``: the calls torch's own
    Inductor emits for a frozen bfloat16 linear on a CPU). The plain bfloat16 GEMV that ``F.linear`` runs for 1-8
    rows does not read weights at bfloat16's bandwidth (docs/precision.md, bfloat16); the packed one does, and 4-6
    rows cost less than one (``FEW_ROWS``). Same arithmetic (bfloat16 inputs and
    weights, float32 accumulation, bfloat16 output); any 2-16 rows give a row the same bits (checked: tests). The
    packed copy costs the weights' bytes once more in RAM."""

    FEW_ROWS = 4
    PACKED_FOR_ROWS = 1  # the row count oneDNN's packed layout is chosen for
    OPTION = "packed_bf16"  # the fast-path option that turns it off (``backbone.options``)

    def _prepare(self) -> list:
        return [mkldnn_pack_linear(self.weight.detach(), self.PACKED_FOR_ROWS)]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return mkldnn_linear(x, self._prepared[0], self.bias)

    def _runs_kernel(self, x: torch.Tensor) -> bool:
        return self.kernel_ok and x.dtype == self.INPUT_DTYPE and x.is_cpu and getattr(fast_paths(), self.OPTION)


class PackedF32Linear(PackedBF16Linear):
    """The float32 LM head on a CPU through oneDNN's linear on a weight pre-packed once (the calls of
    :class:`PackedBF16Linear`, in float32: the same IEEE float32 multiply-adds as ``F.linear``, summed in another
    order — logits agree to ~1e-6 relative). MKL's ``F.linear`` re-reads (packs) the head's weights (670 MB for
    Gemma) at every call; the packed head reads them as they are (docs/precision.md, float32). Only the head: the
    decoder's small products for one row are faster in ``F.linear``, and f(c) — what memories and plug-ins are
    built from — stays bit-identical to plain float32. Packed for four rows, which gives a row the same bits alone
    as in a batch (checked at load: ``KernelLinear``). The packed copy costs the head's bytes once more in RAM."""

    INPUT_DTYPE = torch.float32
    FEW_ROWS = 1
    PACKED_FOR_ROWS = 4
    OPTION = "packed_f32_head"


class Fp16WeightLinear(KernelLinear):
    """float16 *weight-only* on a CPU: the weights rounded to float16 once and packed for FBGEMM's float16 GEMM
    (``torch.ops.quantized.linear_prepack_fp16`` / ``linear_dynamic_fp16``: the kernel torch's dynamic float16
    quantization runs); activations, accumulation and outputs float32. Half of float32's bytes read per product, and
    float16's 11-bit significand (bfloat16 has 8, and bfloat16 also rounds every activation). The ``weight``
    Parameter keeps float32 storage holding the rounded values, so a product with gradients (``F.linear``, training
    through the frozen backbone) multiplies the very same weights.

    Why: on a CPU without native bfloat16 (AVX2 only) MKL's float32 products of 2-7 rows cost well over one row's;
    FBGEMM's float16 kernel runs up to six rows in one pass over the weights (BENCHMARKS.md, "Decode time per token";
    ``python -m benchmarks rows --dtype float16`` and ``anchor`` measure whole steps). The LM head too (a tied head
    rounds the input embedding with it; ``python -m benchmarks head --dtype float16`` times it per row count: a block's
    float16→float32 conversions of every weight cost about as much as reading it, so seven rows — two blocks — cost
    twice six).

    Row bits: FBGEMM splits a product into blocks of at most six rows, and a block of one or two rows rounds
    differently from the others (on an AVX2 EPYC: 1, 2, 7, 14, 31, 32, ... rows). So that a comparison row decodes
    alone as in a batch (slider re-decodes, the compact layout's changing row counts), a product of up to 64 rows
    runs padded to the nearest row count whose rows all keep their bits, found once per shape at load
    (``_steady_rows``)."""

    INPUT_DTYPE = torch.float32
    FEW_ROWS = 3  # min_rows > 1 makes KernelLinear run ``_check_rows_invariant``, which builds the padding table
    PAD_UP_TO = 64

    def __init__(self, linear: nn.Linear, prepared: list | None = None):
        with torch.no_grad():  # the weights the kernel multiplies, for the gradient path too
            linear.weight.copy_(linear.weight.to(torch.float16).float())
        super().__init__(linear, prepared)

    def _prepare(self) -> list:
        bias = None if self.bias is None else self.bias.detach().float().contiguous()
        return [fp16_pack_linear(self.weight.detach().float().contiguous(), bias)]

    def _copied_prepared(self) -> list | None:
        return None  # FBGEMM's packed weights are an opaque object: a copy packs its own

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = fp16_linear(x.reshape(-1, self.in_features).contiguous(), self._prepared[0])
        return y.view(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and self.kernel_ok and x.dtype == torch.float32 and x.is_cpu
                and not self.weight.requires_grad and (self.bias is None or not self.bias.requires_grad)):
            return _Fp16TrainingProduct.apply(x, self)
        return super().forward(x)

    def transposed(self):
        """FBGEMM's float16 copy of the weight's transpose (for g·W, the input's gradient), packed the first time
        a gradient passes through this layer and kept (float16: half of the float32 weight's bytes)."""
        packed = self.__dict__.get("_packed_t")
        if packed is None:
            packed = self.__dict__["_packed_t"] = fp16_pack_linear(self.weight.detach().float().t().contiguous(),
                                                                   None)
        return packed

    def _check_rows_invariant(self, rows: int = 16) -> bool:
        self.pad_to, self.pad_limit = _steady_rows(self), self.PAD_UP_TO
        return True

    def _padded_rows(self, rows: int) -> int:
        return self.pad_to[rows]


class _Fp16TrainingProduct(torch.autograd.Function):
    """x·Wᵀ (+ b) of a frozen :class:`Fp16WeightLinear` while training through it (gradients on): forward and the
    input's gradient g·W both on FBGEMM's float16 kernel — the same float16-rounded weight values that ``F.linear``
    would multiply in float32, with float32 accumulation (only the summation order differs): the kernel decoding already
    uses, reading half the weight bytes (its effect on a step: BENCHMARKS.md, "Training defaults, decided by
    measurement", row "OpenMP's wait policy in training").
    The weight gets no gradient: it is frozen."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "Fp16WeightLinear") -> torch.Tensor:
        ctx.layer = layer
        lead = x.shape[:-1]
        y = fp16_linear(x.reshape(-1, layer.in_features).contiguous(), layer._prepared[0])
        return y.view(*lead, layer.out_features)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        layer = ctx.layer
        lead = g.shape[:-1]
        gx = fp16_linear(g.reshape(-1, layer.out_features).contiguous().float(), layer.transposed())
        return gx.view(*lead, layer.in_features), None


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
            # slice of the output rows gives the table (Gemma's 262,144-row head: the same 64 entries, at a fraction
            # of the head's load time), checked on the whole weight for a few row counts
            w, b = layer.weight.detach()[:STEADY_ROWS_SLICE], layer.bias
            part = fp16_pack_linear(
                w.float().contiguous(), None if b is None else b.detach()[:STEADY_ROWS_SLICE].float().contiguous())
            table = table_of(lambda rows: fp16_linear(rows.contiguous(), part))
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

    Weight-only because quantizing each call's activations to 8 bits too (torch.ao's dynamic int8) loses badly on
    Gemma 3's outlier channels (BENCHMARKS.md, "Decode time per token", the quality guard of each precision); weights
    alone lose little."""

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
        y = int8_weight_mm(x.reshape(-1, self.in_features).contiguous(), *self._prepared)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


@functools.cache  # a property of this torch build and CPU: probed once per process (every kNN attach asks)
def packed_bf16_available() -> bool:
    """oneDNN's bfloat16 linear is built into this torch and runs on this CPU."""
    try:
        w = torch.zeros(4, 8, dtype=torch.bfloat16)
        mkldnn_linear(torch.zeros(1, 8, dtype=torch.bfloat16), mkldnn_pack_linear(w, 1), None)
        return bool(torch.backends.mkldnn.is_available())
    except Exception:  # noqa: BLE001 - any failure means: use the plain path
        return False


@functools.cache
def fp16_weight_available() -> bool:
    """FBGEMM's float16-weight linear (x86 with AVX2) is built into this torch and runs on this CPU."""
    try:
        packed = fp16_pack_linear(torch.ones(4, 8), None)
        return bool(torch.equal(fp16_linear(torch.ones(1, 8), packed),
                                torch.full((1, 4), 8.0)))
    except Exception:  # noqa: BLE001 - any failure means: not available
        return False


@functools.cache
def packed_f32_available() -> bool:
    """oneDNN's float32 linear on packed weights is built into this torch."""
    try:
        w = torch.zeros(4, 8)
        mkldnn_linear(torch.zeros(1, 8), mkldnn_pack_linear(w, 4), None)
        return bool(torch.backends.mkldnn.is_available())
    except Exception:  # noqa: BLE001 - any failure means: use the plain path
        return False
