"""The model's RMSNorms as one fused operator where that reproduces them bit for bit (docs/precision.md, "Norms, KV
cache and plug-in products")."""
from __future__ import annotations

import torch
from torch import nn

from backbone.options import fast_paths
from backbone.torch_internals import version


class FusedRMSNorm(nn.Module):
    """An RMSNorm run as torch's ``F.rms_norm`` (one operator instead of the ~10 of a model's Python forward:
    float32 cast, pow, mean, add, rsqrt, mul, weight cast, 1 + w, mul, cast — for 109 norms a Gemma decode step;
    a small saving per step, within the noise of a whole step: BENCHMARKS.md, "Decode time per token").
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
        key = (w.data_ptr(), version(w), w.dtype, w.device)
        if self._scale_cache is None or self._scale_cache[0] != key:
            self._scale_cache = (key, 1.0 + w.detach().float())
        return self._scale_cache[1]

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        d = (x.shape[-1],)
        if self.style == "one_plus":
            return torch.nn.functional.rms_norm(x.float(), d, self._scale(), self.eps).type_as(x)
        return self.weight * torch.nn.functional.rms_norm(x.float(), d, None, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not fast_paths().fused_norms:
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
