"""kNN-LM (Khandelwal et al., ICLR 2020) / kNN-MT (Khandelwal et al., ICLR 2021) over a memory.

Datastore = the memory's training entries (keys f(c), values y); retriever = the k nearest keys by squared L2
distance; combiner: P_kNN(y) ∝ Σ_{(k_j, v_j) ∈ N, v_j = y} exp(−d_j / T) and P = λ·P_kNN + (1−λ)·P_LM.
k, T and λ are decode-time settings: nothing is rebuilt when they change.

Search: exact (keys held in RAM as float32; on a CPU from 4,096 entries a 16-bit pre-filter scan whose result is
certified equal to the float32 scan's, :class:`CertifiedL2Search`: bfloat16 where oneDNN's bfloat16 linear runs,
else float16 keys through FBGEMM's float16 GEMM on x86 with AVX2 — over the keys' principal components where few
carry most of their variance, :class:`ProjectedL2Search`, still certified —; else a
chunked float32 scan — on a CPU from 4,096 entries by oneDNN's float32 linear on the keys packed once, ``packed_scan``,
which costs a decode step less than the plain matmul: BENCHMARKS.md, "Decode time per token", row "exact kNN over
100k entries alone") up to ``exact_max_entries``; beyond that FAISS
IVF-PQ as in the kNN-LM code (index trained on a sample, written next to the memory with ``faiss.write_index``,
never pickled, its file name keyed by every setting that changes it), keys left memory-mapped on disk. As kNN-LM
does, the k neighbours the approximate index returns get their exact squared L2 distances recomputed from the
stored keys (k rows per query) and are re-sorted by them, so P_kNN's weights are exact (``exact_rerank``, on by
default; off uses the index's PQ distances — measured on a 1M-entry datastore in BENCHMARKS.md, "kNN over 1M
entries", ``python -m benchmarks knn1m <memory-id>``). ``search_kind`` says which search is in use.

The index file is written under a temporary name (``ground.lock.temp_name``: a crashed writer's leftovers are
removed at the next start), fsynced and renamed into place, with ``<index>.json`` beside it holding its sha256; the
plug-in's config records the same sha256 (``extra["index"]``). Loading a saved plug-in verifies the index against
it before FAISS reads a byte — a bit-flipped, truncated or missing index is a UserError and nothing is rebuilt or
written; training reuses an index only when it matches its ``.json`` (else it is rebuilt).

Adaptation: keys and queries are divided by the memory's key RMS before distances are taken, so the temperature T
has the same meaning across backbones (Gemma 3's raw pre-norm states have an RMS near 1,300).

Departures from the papers' search settings, declared: kNN-LM (and PEMA's Table 11, its kNN baseline) use 4,096 IVF
centroids and k = 1,024 neighbours. The shipped default searches exactly up to ``exact_max_entries`` and above it
uses about 4·√N lists (the FAISS guideline for N entries; 4,096 at N ≈ 1M); k defaults to 16 (a decode setting, up
to 1,024), the value tuned on WMT dev starts at 8. The ``paper`` preset sets 4,096 lists, capped at one list per 39
entries (``ivf_min_points``: FAISS's k-means needs that many points a centroid, so 4,096 lists need ≥ 160k entries),
64 sub-quantizers and 32 probes. Training 4,096 centroids reads a sample of 262,144 keys (0.67 GB at d = 640); a
query with k = 1,024 re-ranks 1,024 stored keys and scatters 1,024 weights per row, and the exact search's certified
scan re-checks at least k entries a query in float32 — the same scan of every key, a larger top-k and re-check.

Quality (BENCHMARKS.md, "Starts, presets and calibration, checked on WMT dev items", row "kNN's tuned starts on Gemma"):
on Gemma 3 270M translation (a 1,000-pair WMT memory) no setting beat the base model on the dev items it was tuned on
(paired bootstrap); λ 0.2 (the earlier tuned start) and the declared defaults lowered chrF significantly there. The
tuned start there is k 8, T 100, λ 0.05 (``plugins/tuned_defaults.json``): level with the base on the tuning items, a
small, unconfirmed gain on later ones — not a reason to raise λ. Formality alike: λ 0.2 lost to the base, λ 0.05 is
level. λ 0.05 is in the tuning grid, so a tuning run can choose it where every larger λ hurts.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backbone.model import all_threads, fp16_weight_available, packed_bf16_available, packed_f32_available
from backbone.torch_internals import fp16_linear, fp16_pack_linear, mkldnn_linear, mkldnn_pack_linear
from engine.protocol import MixInput, MixOutput, mix_logprobs
from ground.errors import UserError
from ground.lock import temp_name
from ground.settings import Setting, SettingsRecord
from ground.store import write_json_atomic
from memories.store import Memory
from plugins.base import FitResult, OutputPlugin, PluginConfig, file_sha256, plain_file_name
from plugins.card import MethodCard, NeighbourMap, TimeEstimate
from plugins.registry import register
from plugins.settings import Preset, setting
from plugins.timing import minutes

_BF16_U = 2.0 ** -8          # bfloat16's unit roundoff (8 significant bits)
_FP32_U = 2.0 ** -24          # float32's unit roundoff
_SCAN_CHUNK = 262144  # keys per product: the (queries × chunk) distance matrix stays small


class CertifiedL2Search:
    """Exact k-nearest-neighbour search by squared L2 whose full scan reads the keys in 16 bits (half the bytes of
    float32: the scan is memory-bound) and whose answer is nevertheless the float32 search's. L2 distances do not
    change when every key and the query are shifted by one vector, so the scan runs on *centred* keys
    k'_j = k_j − c (c the keys' mean) and queries q' = q − c: a model's hidden states share a large common component
    (Gemma 3's keys: |k − c| ≈ 0.44·|k|), and every rounding error below scales with |q'|·|k'| instead of |q|·|k|.
    The 16-bit kernel (``kernel``): ``bfloat16`` — oneDNN's bfloat16 linear on the centred keys packed once (query
    rounded to bfloat16 too, bfloat16 output), where it runs natively —, else ``float16`` — FBGEMM's float16-weight
    GEMM (x86 with AVX2: keys rounded to float16, the float32 query as it is, float32 output). Per query:

    1. approximate distances d̃_j = |q'|² + |k'_j|² − 2·s̃_j, with s̃ = q̃'·k̃' by the kernel (q̃', k̃': the
       kernel's roundings, q̃' = q' for ``float16``; float32 accumulation);
    2. a rigorous error bound e_j ≥ |d̃_j − d_j|: q'·k' − s̃ = (q'−q̃')·k' + q̃'·(k'−k̃') + (accumulation) + (output
       rounding), so |q'·k' − s̃| ≤ |q'−q̃'|·|k'| + |q̃'|·|k'−k̃'| + γ·|q̃'|·|k̃'| + u/(1−u)·|s̃|, with the rounding
       residuals' norms computed exactly (a float minus its 16-bit rounding is exact in float32; per key once),
       γ = 2·d·2⁻²⁴ (twice the classic bound on a d-term float32 sum, in any order) and u the output's unit
       roundoff (2⁻⁸ for bfloat16, 0 for float32 output); e_j = 2·(1 + 10⁻³)·that + 10⁻⁵·(|q'|² + |k'_j|²) (the
       norms' and the centring's own float32 rounding, with room to spare);
    3. the k smallest d̃ give candidates whose float32 distances are computed from the float32 keys; D_k is the
       largest of them. Every entry that could beat D_k has d̃_j − e_j ≤ D_k: that set S (the candidates included;
       in practice a small set — ``checked`` counts it) gets float32 distances, and its k nearest are the answer —
       the same entries and distances (up to float32 rounding) as a float32 scan of all keys, which no entry outside
       S can enter.

    ``tests/test_knn.py`` checks it against a float64 scan; BENCHMARKS.md, "Decode time per token" times it
    (``python -m benchmarks rows``). Centring the keys and using exact residual norms keeps S small (a bound from
    |q|·|k| and elementwise rounding alone re-checks far more entries per query). The low-precision keys are
    float16, which every CPU converts natively."""

    MIN_ENTRIES = 4096  # below this the float32 scan is already cheap and exactly as before
    _CHUNK = 65536      # keys centred and rounded per chunk (no second float32 copy of every key)

    def __init__(self, keys: torch.Tensor, kernel: str | None = None):
        self.kernel = kernel or self.kernel_for(keys)
        if self.kernel not in ("bfloat16", "float16"):
            raise ValueError(f"no 16-bit scan kernel for these keys on this CPU ({self.kernel!r})")
        half = torch.bfloat16 if self.kernel == "bfloat16" else torch.float16
        self.keys = keys
        self.gamma = 2 * keys.shape[1] * _FP32_U
        self.u = _BF16_U if self.kernel == "bfloat16" else 0.0  # the product's output rounding
        self.center = self.mean64(keys).float()
        rounded, norm, resid, rnorm = [], [], [], []
        for b0 in range(0, len(keys), self._CHUNK):
            kc = keys[b0:b0 + self._CHUNK] - self.center
            kb = kc.to(half)
            if not torch.isfinite(kb).all():  # beyond float16's range: no 16-bit scan (the caller scans float32)
                raise OverflowError("a centred key does not fit in float16")
            rounded.append(kb)
            norm.append(kc.double().pow(2).sum(1))
            resid.append((kc - kb.float()).norm(dim=1))   # exact differences; their norm to float32 precision
            rnorm.append(kb.float().norm(dim=1))
        sq = torch.cat(norm).float()  # |k'|², rounded once from float64
        self.centered_sqnorm, self.centered_sqnorm_low = sq, sq * (1 - 1e-5)
        self.centered_norm = sq.sqrt()
        # the per-key part of the bound, γ·|k̃'| + |k' − k̃'| (times |q̃'| per query), folded once
        self.key_bound = self.gamma * torch.cat(rnorm) + torch.cat(resid)
        if self.kernel == "bfloat16":
            self.packed = mkldnn_pack_linear(torch.cat(rounded), 1)
        else:  # float16 values in float32: FBGEMM's packing rounds nothing further
            self.packed = fp16_pack_linear(torch.cat(rounded).float(), None)
        self.checked = 0  # entries whose float32 distance the last search computed (benchmarks, tests)

    @classmethod
    def mean64(cls, keys: torch.Tensor) -> torch.Tensor:
        """The keys' mean in float64, a chunk at a time (no float64 copy of every key)."""
        return sum(keys[b0:b0 + cls._CHUNK].double().sum(0) for b0 in range(0, len(keys), cls._CHUNK)) / len(keys)

    @staticmethod
    def kernel_for(keys: torch.Tensor) -> str | None:
        """The 16-bit kernel this CPU scans ``keys`` with (None: too few keys, not on a CPU, or no kernel)."""
        if keys.device.type != "cpu" or len(keys) < CertifiedL2Search.MIN_ENTRIES:
            return None
        return "bfloat16" if packed_bf16_available() else "float16" if fp16_weight_available() else None

    @staticmethod
    def applies(keys: torch.Tensor) -> bool:
        return CertifiedL2Search.kernel_for(keys) is not None

    def _scan(self, qc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(s̃, |q' − q̃'| or None where the kernel keeps the query as it is, |q̃'|) for centred float32 queries."""
        if self.kernel == "bfloat16":
            qb = qc.to(torch.bfloat16)
            with all_threads():  # the scan of every key: the one large product of the search
                s = mkldnn_linear(qb, self.packed, None).float()
            return s, (qc - qb.float()).norm(dim=1, keepdim=True), qb.float().norm(dim=1, keepdim=True)
        with all_threads():
            s = fp16_linear(qc.contiguous(), self.packed)
        return s, None, qc.norm(dim=1, keepdim=True)  # the float32 query is not rounded: no residual

    def bounds(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d̃, d̃ − e), each (n, N): every key's approximate squared distance to the float32 queries ``q`` (n, d)
        and a lower bound of its exact one (steps 1–2 above)."""
        u = self.u
        qc = q - self.center
        q_sqnorm = qc.double().pow(2).sum(1, keepdim=True).float()
        s, q_resid, q_round = self._scan(qc)   # s̃, |q' − q̃'|, |q̃'|
        approx = (q_sqnorm - 2 * s).add_(self.centered_sqnorm)
        slack = 2 * (1 + 1e-3)
        # lower_j = d̃_j − e_j (class docstring), in place over the scan's (n, N) buffer
        lower = q_sqnorm * (1 - 1e-5) - 2 * s
        if q_resid is not None:
            lower.addcmul_(q_resid * slack, self.centered_norm, value=-1)
        lower.addcmul_(q_round * slack, self.key_bound, value=-1).add_(self.centered_sqnorm_low)
        if u:
            lower.sub_(s.abs_().mul_(slack * u / (1 - u)))  # s is not needed after this
        return approx, lower

    def search(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(squared L2 distances, entry indices), each (n, k), ascending, for float32 queries ``q`` (n, d)."""
        approx, lower = self.bounds(q)
        return self._check(q, approx, lower, k)

    def _check(self, q: torch.Tensor, approx: torch.Tensor, lower: torch.Tensor, k: int):
        """Step 3: the float32 distances of the k best by ``approx`` give D_k; every key whose ``lower`` reaches
        it is re-checked in float32 against the float32 keys ``self.keys``."""
        cand = approx.topk(k, dim=1, largest=False).indices
        out_d, out_i = [], []
        self.checked = 0
        for r in range(len(q)):
            d_cand = ((self.keys[cand[r]] - q[r]) ** 2).sum(1)
            near = (lower[r] <= d_cand.max()).nonzero()[:, 0]  # ⊇ cand: d̃ − e ≤ d ≤ D_k for each candidate
            self.checked += len(near)
            d = ((self.keys[near] - q[r]) ** 2).sum(1)
            dv, o = d.topk(k, largest=False)
            out_d.append(dv)
            out_i.append(near[o])
        return torch.stack(out_d), torch.stack(out_i)


class ProjectedL2Search(CertifiedL2Search):
    """:class:`CertifiedL2Search` whose 16-bit scan reads each key's first r principal components instead of all
    d coordinates — fewer bytes and products a query (r/d of them) — and whose answer is still the float32 scan's.

    For orthonormal columns V (d × r), |Vᵀx| ≤ |x|, so the squared distance between the projections,
    |Vᵀ(q − c) − Vᵀ(k_j − c)|², is a lower bound of |q − k_j|². The projected keys y_j = Vᵀ(k_j − c) are computed
    once in float64 and kept in float32; a :class:`CertifiedL2Search` over them gives a certified lower bound of
    each |z − y_j|² (z = Vᵀ(q − c), float64 then float32; those roundings are within its 10⁻⁵ slack), which,
    divided by σ_max(V)² ≤ 1 + ‖VᵀV − I‖_F (V's own rounding, measured), bounds the full distance from below.
    Step 3 is unchanged: candidates by the projected distances, then every key whose bound reaches D_k gets its
    float32 distance from the float32 keys. A key far from the principal subspace only costs a re-check.

    A model's hidden states are far from isotropic (Gemma 3 270M's memory keys: docs/methods.md, "kNN"), which is
    what keeps the re-checked set small; ``principal_basis`` takes the projection only where
    the keys' spectrum allows it (``certified_search``). V comes from the covariance of up to ``SAMPLE`` keys: any
    orthonormal V keeps the answer exact, a better one only re-checks fewer keys."""

    SAMPLE = 16384
    VARIANCE = 0.95   # the share of the keys' variance the projection keeps
    MAX_SHARE = 0.5   # projections wider than this share of d save too little of the scan

    def __init__(self, keys: torch.Tensor, basis: torch.Tensor, kernel: str | None = None):
        self.keys = keys
        self.center64 = self.mean64(keys)
        self.basis = basis.double()  # (d, r)
        gram = self.basis.T @ self.basis
        self.shrink = 1.0 / (1.0 + float(torch.linalg.matrix_norm(gram - torch.eye(len(gram), dtype=gram.dtype)))
                             + 1e-9)
        projected = torch.cat([((keys[b0:b0 + self._CHUNK].double() - self.center64) @ self.basis).float()
                               for b0 in range(0, len(keys), self._CHUNK)])
        self.inner = CertifiedL2Search(projected, kernel)
        self.inner.keys = None  # its float32 copy was for the bound's norms; the re-check reads the full keys
        self.kernel = self.inner.kernel
        self.rank = self.basis.shape[1]
        self.checked = 0

    @classmethod
    def principal_basis(cls, keys: torch.Tensor) -> torch.Tensor | None:
        """The principal directions (d, r) of ``keys`` that keep ``VARIANCE`` of their variance, r a multiple of
        32, or None where that takes more than ``MAX_SHARE`` of the d dimensions (no projection pays there)."""
        n, d = keys.shape
        pick = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:cls.SAMPLE] if n > cls.SAMPLE else None
        x = (keys if pick is None else keys[pick]).double()
        x = x - x.mean(0)
        cov = x.T @ x
        if not torch.isfinite(cov).all():  # keys no 16-bit scan can hold: left to CertifiedL2Search's own checks
            return None
        values, vectors = torch.linalg.eigh(cov)
        values, vectors = values.flip(0).clamp_min(0), vectors.flip(1)
        if float(values.sum()) <= 0:
            return None
        share = values.cumsum(0) / values.sum()
        r = int((share < cls.VARIANCE).sum()) + 1
        r = min(d, -(-r // 32) * 32)
        return vectors[:, :r].contiguous() if r <= cls.MAX_SHARE * d else None

    def bounds(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = ((q.double() - self.center64) @ self.basis).float()
        approx, lower = self.inner.bounds(z)
        return approx, lower.mul_(self.shrink)


def certified_search(keys: torch.Tensor, kernel: str | None = None) -> CertifiedL2Search:
    """The exact search with a 16-bit pre-filter for ``keys``: over their principal components where few of them
    carry most of the variance (:class:`ProjectedL2Search`), else over every coordinate."""
    basis = ProjectedL2Search.principal_basis(keys)
    return ProjectedL2Search(keys, basis, kernel) if basis is not None else CertifiedL2Search(keys, kernel)


@dataclass
class KNNConfig(PluginConfig):
    search: str = setting("auto", "\"auto\" | \"exact\" | \"faiss\"", choices=("auto", "exact", "faiss"))
    exact_max_entries: int = setting(500_000)
    ivf_lists: int = setting(0, "0: about 4·√N; kNN-LM (and PEMA's Table 11): 4,096", low=0, high=1000000)
    ivf_min_points: int = setting(
        0, "at least this many entries per IVF list: fewer lists on a memory too small to train ivf_lists centroids "
           "(FAISS's k-means wants 39 a centroid; 0 = no cap)", low=0, high=1000000)
    pq_m: int = setting(64, "PQ sub-quantizers (must divide d; lowered automatically if not)", low=1, high=1024)
    nprobe: int = setting(32, "IVF lists searched per query", low=1, high=1000000)
    normalize_keys: bool = setting(True)
    exact_rerank: bool = setting(True, "FAISS only: recompute the k neighbours' exact L2 distances (kNN-LM); off: "
                                       "the index's PQ distances (BENCHMARKS.md, \"kNN over 1M entries\", measures the "
                                       "difference)")
    max_neighbours_traced: int = setting(8)

    # kNN trains nothing: its paper's knobs are decode settings (k, T, λ: the Compare tab). "paper" searches with
    # FAISS IVF-PQ as Khandelwal et al. do (exact search is used below exact_max_entries by default).
    PRESETS = {
        "paper": Preset({"search": "faiss", "ivf_lists": 4096, "ivf_min_points": 39, "pq_m": 64, "nprobe": 32},
                        "FAISS IVF-PQ as in kNN-LM (and PEMA's Table 11): 4,096 lists — fewer on a memory under "
                        "160k entries, 39 a list —, 64 sub-quantizers, 32 probes; needs enough entries to train the "
                        "index. Retrieve up to k = 1,024 neighbours at decode (PEMA's public code: 1,024)"),
        "quick": Preset({"search": "exact"}, "exact search (no index to build)"),
    }



def knn_training_time(cls, config: KNNConfig, rec: dict, samples: int, entries: int) -> dict:
    """Nothing to train: the index over the memory's entries."""
    secs = rec.get("setup_s", 0.0) + entries / max(rec["entries_per_s"], 1e-9)
    return {"setup_s": secs, "loops": [],
            "text": f"Nothing to train: ≈ {minutes(secs)} to index {entries:,} entries."}


def knn_throughput_record(plugin, info: dict, history: list[dict], wall_s: float, memory) -> dict:
    """``memory`` is None for a saved run (``plugins.estimate record``): its ``train_info`` counts the entries."""
    entries = len(memory) if memory is not None else int(info["entries"])
    return {"entries_per_s": round(entries / max(wall_s, 1e-3), 1), "setup_s": 0.0}


CARD = MethodCard(
    paper="Khandelwal et al., Generalization through Memorization (ICLR 2020); Nearest Neighbor MT (ICLR 2021)",
    estimate=TimeEstimate(measure_settings={}, training_time=knn_training_time,
                          throughput_record=knn_throughput_record),
    neighbour_map=NeighbourMap(
        kinds=("query f(c)",
               "f(c) / key RMS: the query kNN searches with (the backbone's pre-norm state before this token)",
               "its k nearest memory entries, as the decode retrieved them"),
        traced_neighbours=True))


@register(CARD)
class KNN(OutputPlugin):
    method = "knn"
    title = "kNN-LM / kNN-MT"
    Config = KNNConfig
    level = "output"
    interpolates = True
    decode_settings = (
        Setting("k", 16, "neighbours retrieved per output token (kNN-LM and PEMA's public code retrieve 1,024)",
                low=1, high=1024, live=True, step=1, label="kNN k",
                grid=(8, 32), fine_grid=(4, 8, 16, 32)),
        Setting("temperature", 10.0, "T in p_kNN ∝ Σ exp(−d/T) over the neighbours (d: squared L2 distance)",
                low=0.5, high=100.0, live=True, step=0.5, label="kNN temperature", grid=(10.0, 100.0),
                fine_grid=(1.0, 10.0, 100.0)),
        Setting("lambda", 0.3, "λ: p_kNN's weight in the mix λ·p_kNN + (1−λ)·p_LM. On Gemma 3 270M no λ beat the "
                "base on translation or formality dev items (BENCHMARKS.md, \"kNN's tuned starts on Gemma\"): kNN "
                "starts there at λ 0.05, level with the base; λ 0.2 and the declared 0.3 lowered chrF",
                low=0.0, high=1.0, live=True, step=0.05, label="kNN λ", grid=(0.05, 0.2, 0.4),
                fine_grid=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)),
    )
    needs_memory_at_decode = True
    # The exact search's fast paths, each an option of the plug-in (a benchmark or a test turns it off on one
    # plug-in to compare with the plain float32 matmul): the certified 16-bit pre-filter scan, and the float32 scan
    # through oneDNN's linear on the keys packed once (for four rows: a query gets the same bits alone and beside
    # others; costs the keys' bytes once more in RAM, as the certified search's 16-bit copy costs half of them).
    certified_search: bool = True
    packed_scan: bool = True

    def __init__(self, config: KNNConfig, backbone, memory_meta: dict | None = None):
        super().__init__(config, backbone, memory_meta)
        self.register_buffer("key_scale", torch.tensor(float((memory_meta or {}).get("key_rms", 1.0))))
        self.memory: Memory | None = None
        self.index = None
        self.index_record: dict | None = None  # {"file", "sha256"} of the FAISS index in use
        self.search_kind = ""
        self.exact_l2: CertifiedL2Search | None = None
        self.packed_keys: list | None = None  # the float32 scan's packed keys (``packed_scan``), per chunk

    @classmethod
    def build_for_load(cls, config, backbone, memory_meta, extra, tensors):
        p = cls(config, backbone, memory_meta)
        path = Path(memory_meta.get("path", ""))
        if not (path / "meta.json").exists():
            raise UserError(f"The kNN plug-in reads its memory at decode time, but {path} is gone. "
                            f"Rebuild the memory or train the kNN plug-in again.")
        record = (extra or {}).get("index")
        p.attach_memory(Memory.load(path, backbone), index_record=record if isinstance(record, dict) else None,
                        loading=True)
        return p

    def attach_memory(self, memory: Memory, index_record: dict | None = None, loading: bool = False) -> None:
        """Use ``memory`` as the datastore. ``loading`` (a saved plug-in): a FAISS index is verified against
        ``index_record`` (its sha256 in the plug-in's config) and never rebuilt."""
        self.memory = memory
        self.key_scale.fill_(memory.key_scale if self.config.normalize_keys else 1.0)
        self.memory_meta = {**self.memory_meta, "path": str(memory.path), "id": memory.id,
                            "key_rms": memory.key_scale}
        n = len(memory)
        use_faiss = self.config.search == "faiss" or (self.config.search == "auto"
                                                     and n > self.config.exact_max_entries)
        dev = self.backbone.device  # exact search runs where the backbone runs (a GPU when there is one)
        self.values = torch.from_numpy(np.asarray(memory.values, dtype=np.int64)).to(dev)
        self.entry_sample = np.asarray(memory.entry_sample)
        if use_faiss:
            self._build_faiss(index_record, loading)
        else:
            # one copy, divided in place (a float32 memory's keys are a read-only memory map: no view of them)
            keys = torch.tensor(np.asarray(memory.keys), dtype=torch.float32, device=dev).div_(float(self.key_scale))
            self.keys = keys
            self.key_sqnorm = (keys * keys).sum(1)
            try:
                self.exact_l2 = certified_search(keys) if CertifiedL2Search.applies(keys) else None
            except OverflowError:  # keys beyond float16's range: the float32 scan below
                self.exact_l2 = None
            self.packed_keys = (
                [mkldnn_pack_linear(keys[b0:b0 + _SCAN_CHUNK].contiguous(), 4)
                 for b0 in range(0, n, _SCAN_CHUNK)]
                if self.exact_l2 is None and keys.device.type == "cpu" and n >= CertifiedL2Search.MIN_ENTRIES
                and packed_f32_available() else None)
            over = (f" over {self.exact_l2.rank} principal components" if isinstance(self.exact_l2, ProjectedL2Search)
                    else "")
            self.search_kind = (f"exact ({self.exact_l2.kernel} pre-filter{over}, certified float32 distances, over "
                                f"{n:,} keys)"
                                if self.exact_l2 is not None else
                                f"exact (float32 scan of {n:,} packed keys)" if self.packed_keys is not None else
                                f"exact (torch matmul over {n:,} keys)")

    def _damaged_index(self, path: Path, what: str) -> UserError:
        return UserError(f"The kNN plug-in's FAISS index {path} {what}. Train the kNN plug-in again (a new index "
                         f"is built).")

    def _read_index(self, path: Path, sha256: str | None):
        """``faiss.read_index`` of a file whose sha256 is first checked against ``sha256`` (when given)."""
        import faiss  # heavy, optional: only for large memories

        if sha256 is not None and file_sha256(path) != sha256:
            raise self._damaged_index(path, "does not match its checksum (damaged or changed on disk)")
        try:
            return faiss.read_index(str(path))
        except Exception as e:  # noqa: BLE001 — FAISS raises RuntimeError for a bad file
            raise self._damaged_index(path, f"cannot be read ({type(e).__name__})") from None

    @staticmethod
    def _sidecar(path: Path) -> dict:
        try:
            rec = json.loads(path.with_name(path.name + ".json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return rec if isinstance(rec, dict) and isinstance(rec.get("sha256"), str) else {}

    def _build_faiss(self, record: dict | None = None, loading: bool = False) -> None:
        import faiss  # heavy, optional: only for large memories

        mem = self.memory
        d = mem.keys.shape[1]
        n = len(mem)
        m = self.config.pq_m
        while d % m:
            m -= 1
        nlist = self.config.ivf_lists or max(1, int(4 * np.sqrt(n)))
        if self.config.ivf_min_points:  # "where the memory is large enough": no list trained on too few entries
            nlist = max(1, min(nlist, n // self.config.ivf_min_points))
        nbits = 8 if n >= 256 * 40 else 4  # PQ codebooks need ≥ 2^nbits training points (tiny memories)
        # The index is cached next to the memory, keyed by everything that changes it: whether keys are divided by
        # the memory's key RMS, the IVF lists, the PQ sub-quantizers and bits, and the seed of the training sample.
        scale = "normkeys" if self.config.normalize_keys else "rawkeys"
        name = f"faiss_ivfpq_{scale}_{nlist}lists_{m}x{nbits}pq_seed{self.config.seed}.index"
        path = mem.path / name
        if loading and record is not None:  # a saved plug-in: exactly the index it was trained with, or an error
            if plain_file_name(record.get("file"), "the index file", mem.path) != name:
                raise self._damaged_index(path, f"is recorded as {record.get('file')!r}, which does not belong to "
                                                f"its settings")
            if not path.is_file():
                raise self._damaged_index(path, "is missing")
            if not isinstance(record.get("sha256"), str):
                raise self._damaged_index(path, "has no checksum in the plug-in's config")
            self.index, sha = self._read_index(path, record["sha256"]), record["sha256"]
        elif path.is_file() and (side := self._sidecar(path)) and (loading or file_sha256(path) == side["sha256"]):
            self.index, sha = self._read_index(path, side["sha256"] if loading else None), side["sha256"]
        elif loading and path.is_file():  # an index of an older version, without a checksum
            self.index, sha = self._read_index(path, None), None
        else:
            quant = faiss.IndexFlatL2(d)
            index = faiss.IndexIVFPQ(quant, d, nlist, m, nbits)
            rng = np.random.default_rng(self.config.seed)
            sample = np.sort(rng.choice(n, size=min(n, max(256 * nlist // 4, 40 * nlist, 10000)), replace=False))
            index.train(np.asarray(mem.keys[sample], dtype=np.float32) / float(self.key_scale))
            for b0 in range(0, n, 65536):
                index.add(np.asarray(mem.keys[b0:b0 + 65536], dtype=np.float32) / float(self.key_scale))
            tmp = path.with_name(temp_name(name))
            try:
                faiss.write_index(index, str(tmp))
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                sha = file_sha256(tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            write_json_atomic(path.with_name(name + ".json"), {"sha256": sha, "bytes": path.stat().st_size})
            self.index = index
        self.index_record = {"file": name, "sha256": sha} if sha else None
        self.index.nprobe = self.config.nprobe
        dists = "exact L2 re-rank" if self.config.exact_rerank else "PQ distances"
        self.search_kind = (f"FAISS IVF-PQ ({self.index.nlist} lists, {m}×{nbits}-bit PQ, nprobe "
                            f"{self.config.nprobe}, {n:,} keys; {dists})")

    def fit(self, memory, progress=lambda f, m: None, should_stop=lambda: False) -> FitResult:
        progress(0.1, "preparing the datastore")
        self.attach_memory(memory)
        progress(1.0, f"datastore ready: {self.search_kind}")
        self.train_info = {"search": self.search_kind, "entries": len(memory)}
        return FitResult(metrics={"entries": len(memory), "search": self.search_kind})

    def trainable_parameters(self) -> int:
        return 0

    # --- retrieval --------------------------------------------------------------------------------
    def _exact_rerank(self, q: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """kNN-LM recomputes exact distances for the neighbours the approximate index returns: squared L2 between
        each (scaled) query and its k stored keys, read from the memory (k rows per query), re-sorted ascending.
        Missing neighbours (index −1) get an infinite distance and stay last."""
        safe = np.where(idx >= 0, idx, 0)
        rows, inverse = np.unique(safe.ravel(), return_inverse=True)
        stored = np.asarray(self.memory.keys[rows], dtype=np.float32) / float(self.key_scale)
        vecs = stored[inverse.reshape(safe.shape)]                      # (n, k, d)
        dist = ((vecs - q[:, None, :]) ** 2).sum(-1, dtype=np.float64).astype(np.float32)
        dist[idx < 0] = np.inf
        order = np.argsort(dist, axis=1, kind="stable")
        return np.take_along_axis(dist, order, 1), np.take_along_axis(idx, order, 1)

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (squared L2 distances, entry indices), each (n, k), for queries already scaled."""
        k = max(1, min(k, len(self.values)))
        if self.index is not None:
            q = queries.float().cpu().numpy()
            dist, idx = self.index.search(q, k)
            if self.config.exact_rerank:
                dist, idx = self._exact_rerank(q, idx)
            else:
                dist = np.where(idx >= 0, dist, np.inf).astype(np.float32)
            return torch.from_numpy(dist).to(queries.device), torch.from_numpy(idx).long().to(queries.device)
        q = queries.float().to(self.keys.device)
        if self.exact_l2 is not None and self.certified_search:
            return self.exact_l2.search(q, k)
        best_d, best_i = None, None
        packed = self.packed_keys if self.packed_scan and q.device.type == "cpu" else None
        for c, b0 in enumerate(range(0, len(self.keys), _SCAN_CHUNK)):
            kc = self.keys[b0:b0 + _SCAN_CHUNK]
            with all_threads():
                qk = (q @ kc.T if packed is None else
                      mkldnn_linear(q.contiguous(), packed[c], None))
            d = (q * q).sum(1, keepdim=True) - 2 * qk + self.key_sqnorm[b0:b0 + _SCAN_CHUNK]
            dv, di = d.topk(min(k, len(kc)), dim=1, largest=False)
            di = di + b0
            if best_d is None:
                best_d, best_i = dv, di
            else:
                cat_d, cat_i = torch.cat([best_d, dv], 1), torch.cat([best_i, di], 1)
                best_d, o = cat_d.topk(k, dim=1, largest=False)
                best_i = cat_i.gather(1, o)
        return best_d.clamp_min(0), best_i

    def knn_logprobs(self, fc: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
        """log P_kNN (n, V) of the rows, the neighbours' distances and entry ids."""
        lp, _, dist, idx = self.knn_support(fc, k, temperature)
        return lp, dist, idx

    def knn_support(self, fc: torch.Tensor, k: int, temperature: float):
        """(log P_kNN (n, V), its support (n, k): the neighbours' tokens — a token once per neighbour carrying it —,
        distances, entry ids). P_kNN is zero beyond the neighbours' tokens, so the log runs over their k columns and
        the rest is −inf (a log over all of Gemma's 262,144 mostly-zero probabilities is a noticeable share of a
        row's step)."""
        dist, idx = self.search(fc.float() / float(self.key_scale), k)
        valid = idx >= 0
        w = torch.where(valid, -dist / temperature, torch.full_like(dist, float("-inf")))
        w = torch.log_softmax(w, dim=1)
        vals = self.values[idx.clamp_min(0).to(self.values.device)].to(fc.device)
        V = self.backbone.vocab_size
        lp = torch.zeros(len(fc), V, device=fc.device)
        lp.scatter_add_(1, vals, w.exp().to(fc.device))  # a token's probability: its neighbours' weights summed
        at_support = torch.log(lp.gather(1, vals).clamp_min(0))
        lp.fill_(float("-inf")).scatter_(1, vals, at_support)
        return lp, vals, dist, idx

    def plugin_logprobs(self, inp: MixInput) -> tuple[torch.Tensor, list[dict]]:
        plp, _, extras = self._logprobs(inp)
        return plp, extras

    def mix(self, inp: MixInput) -> MixOutput:
        """P = λ·P_kNN + (1−λ)·P_LM, mixed on P_kNN's support only (``mix_logprobs``: the same result)."""
        plp, support, extras = self._logprobs(inp)
        lams = self.mix_lambdas(inp)
        out = mix_logprobs(inp.lm_logprobs, plp, torch.tensor(lams), support=support)
        return MixOutput(logprobs=out, plugin_logprobs=plp, lam=lams, extras=extras)

    def _logprobs(self, inp: MixInput) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
        n = len(inp.fc)
        # Rows may have different k/T; group rows with the same settings into one search.
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(inp.settings):
            groups.setdefault(self.distribution_key(s), []).append(i)
        one = len(groups) == 1  # the usual case: the rows' own tensors, no vocabulary-wide copy into a shared one
        plp = None if one else torch.empty(n, inp.lm_logprobs.shape[1], device=inp.lm_logprobs.device)
        width = max(k for k, _ in groups)
        support = None if one else torch.zeros(n, width, dtype=torch.long, device=plp.device)
        extras: list[dict] = [{} for _ in range(n)]
        for (k, T), rows in groups.items():
            lp, vals, dist, idx = self.knn_support(inp.fc[rows], k, T)
            if one:
                plp, support = lp, vals.to(lp.device)
            else:
                plp[rows] = lp
                # rows of a smaller k repeat their first token up to the widest k (a column mixed twice is the same)
                support[rows] = torch.cat([vals, vals[:, :1].expand(-1, width - vals.shape[1])], 1).to(plp.device)
            m = self.config.max_neighbours_traced
            near_d, near_e, near_t = dist[:, :m].tolist(), idx[:, :m].tolist(), vals[:, :m].tolist()
            for j, r in enumerate(rows):  # the neighbours' tokens are ``vals`` (the values of entries idx)
                extras[r] = {"neighbours": [
                    {"token": int(t), "distance": round(float(d), 3), "entry": int(e),
                     "sample": int(self.entry_sample[e])}
                    for d, e, t in zip(near_d[j], near_e[j], near_t[j]) if e >= 0]}
        return plp, support, extras

    def mix_lambdas(self, inp: MixInput) -> list[float]:
        return [s.lambda_ for s in inp.settings]  # kNN-LM/MT: a constant λ

    def distribution_key(self, settings: SettingsRecord) -> tuple:
        return settings.k, settings.temperature

    def extra_config(self) -> dict:
        extra = {"search": self.search_kind}
        if self.index is not None and self.index_record is not None:
            extra["index"] = dict(self.index_record)  # verified on load
        return extra
