"""kNN's certified exact search: the 16-bit pre-filter scan (bfloat16 or float16) returns what a float64 scan of all
keys returns."""
import numpy as np
import pytest
import torch

from backbone.model import fp16_weight_available, packed_bf16_available, packed_f32_available
from plugins.knn import KNN, CertifiedL2Search, KNNConfig, ProjectedL2Search, certified_search

needs_onednn = pytest.mark.skipif(not packed_bf16_available(), reason="oneDNN bfloat16 linear not available")
# the 16-bit scan kernels this CPU runs (bfloat16: oneDNN, native; float16: FBGEMM, x86 with AVX2)
KERNELS = [k for k, ok in (("bfloat16", packed_bf16_available()), ("float16", fp16_weight_available())) if ok]
each_kernel = pytest.mark.parametrize("kernel", KERNELS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no 16-bit scan kernel on this CPU"))])


def _rounded_scan(q, keys, kernel):
    """q·kᵀ as the kernel's roundings alone would give it (without the certificate)."""
    if kernel == "bfloat16":
        return torch.nn.functional.linear(q.bfloat16(), keys.bfloat16()).float()
    return torch.nn.functional.linear(q, keys.half().float())


def _clustered_keys(n=6000, d=64, seed=0):
    """Hard for a bfloat16 scan: near-duplicate keys (tiles of 300 centres with 0.1 % noise), large norms (RMS ~40,
    so bfloat16's rounding of q·k is far larger than the gaps between neighbours), and a dominant shared direction."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(300, d, generator=g) * 40 + 200 * torch.randn(1, d, generator=g)
    keys = centres.repeat(n // 300, 1)
    return keys + 0.04 * torch.randn(keys.shape, generator=g)


class _Datastore:
    """The datastore interface ``KNN.attach_memory`` reads, over given keys (values: 50 token ids in turn)."""

    def __init__(self, keys: np.ndarray, key_scale: float):
        self.path, self.id, self.key_scale = "m", "m", key_scale
        self.keys = keys
        self.values = np.arange(len(keys)) % 50
        self.entry_sample = np.zeros(len(keys), dtype=np.int64)

    def __len__(self):
        return len(self.keys)


def _float64_topk(keys, q, k):
    d = ((keys.double()[None] - q.double()[:, None]) ** 2).sum(-1)
    return d.topk(k, dim=1, largest=False)


@each_kernel
@pytest.mark.parametrize("k", [1, 8, 64])
def test_certified_search_equals_a_float64_scan(k, kernel):
    keys = _clustered_keys()
    q = keys[torch.randperm(len(keys), generator=torch.Generator().manual_seed(1))[:5]] + 0.03 * torch.randn(5, 64)
    search = CertifiedL2Search(keys, kernel)
    assert search.kernel == kernel
    d, i = search.search(q, k)
    ref_d, ref_i = _float64_topk(keys, q, k)
    # the same neighbour sets (orders may differ only between float-equal distances) and their float32 distances
    for r in range(len(q)):
        assert set(i[r].tolist()) == set(ref_i[r].tolist())
    assert torch.allclose(d.double(), ref_d, rtol=1e-5, atol=1e-3)
    assert (d.diff(dim=1) >= 0).all()
    # the pre-filter alone would be wrong here: the 16-bit approximate top-k differs from the true one
    s = _rounded_scan(q, keys, kernel)
    approx = (q * q).sum(1, keepdim=True) - 2 * s + (keys * keys).sum(1)
    approx_i = approx.topk(k, dim=1, largest=False).indices
    assert any(set(approx_i[r].tolist()) != set(ref_i[r].tolist()) for r in range(len(q)))


@each_kernel
def test_certified_search_centres_keys_that_share_a_large_common_component(kernel):
    """Hidden states share a large common vector (Gemma's: |k − c| ≈ 0.44·|k|; here 0.2): the search is still the
    float64 scan's, and its bound — on centred keys — re-checks only a few entries in float32. With the bound on
    uncentred norms, as before, over half of the keys would need the re-check here."""
    keys = _clustered_keys()
    offset = 4 * keys.norm(dim=1).mean() * torch.nn.functional.normalize(torch.randn(64), dim=0)
    keys = keys + offset
    q = keys[torch.randperm(len(keys), generator=torch.Generator().manual_seed(2))[:4]] + 0.03 * torch.randn(4, 64)
    search = CertifiedL2Search(keys, kernel)
    d, i = search.search(q, 8)
    ref_d, ref_i = _float64_topk(keys, q, 8)
    for r in range(len(q)):
        assert set(i[r].tolist()) == set(ref_i[r].tolist())
    assert torch.allclose(d.double(), ref_d, rtol=1e-5, atol=1e-2)
    assert search.checked <= 0.05 * len(keys) * len(q)
    # what the uncentred bound would admit: entries whose d̃ − 6u·|q|·|k| reaches D_k
    s = _rounded_scan(q, keys, kernel)
    approx = (q * q).sum(1, keepdim=True) - 2 * s + (keys * keys).sum(1)
    unit = 2 ** -8 if kernel == "bfloat16" else 2 ** -11
    uncentred = approx - 6 * unit * q.norm(dim=1, keepdim=True) * keys.norm(dim=1)
    admitted = int((uncentred <= ref_d[:, -1:].float()).sum())
    assert admitted > (0.5 * len(keys) * len(q) if kernel == "bfloat16" else 4 * max(search.checked, 1))


def _low_rank_keys(n=8000, d=64, rank=12, seed=0):
    """Keys as a model's hidden states are: most of their variance in a few directions (here 12 of 64), a little
    in every other, a large shared component, and near-duplicates (tiles of 400 points)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(rank, d, generator=g)
    points = torch.randn(400, rank, generator=g) * 10 @ mix + 0.3 * torch.randn(400, d, generator=g)
    keys = points.repeat(n // 400, 1) + 200 * torch.randn(1, d, generator=g)
    return keys + 0.02 * torch.randn(keys.shape, generator=g)


@each_kernel
@pytest.mark.parametrize("k", [1, 8, 64])
def test_projected_search_equals_a_float64_scan(k, kernel):
    """Keys whose variance lies mostly in a few directions are scanned over their principal components only (r of
    d coordinates), and the answer is still the float64 scan's: every key the projection could misplace is
    re-checked in float32. The projected distances alone would be wrong."""
    keys = _low_rank_keys()
    q = keys[torch.randperm(len(keys), generator=torch.Generator().manual_seed(1))[:6]] + 0.3 * torch.randn(6, 64)
    search = certified_search(keys, kernel)
    assert isinstance(search, ProjectedL2Search) and search.kernel == kernel and search.rank <= 32
    d, i = search.search(q, k)
    ref_d, ref_i = _float64_topk(keys, q, k)
    for r in range(len(q)):
        assert set(i[r].tolist()) == set(ref_i[r].tolist())
    assert torch.allclose(d.double(), ref_d, rtol=1e-5, atol=1e-2)
    assert search.checked <= 0.1 * len(keys) * len(q)
    approx, _ = search.bounds(q)
    approx_i = approx.topk(k, dim=1, largest=False).indices
    assert any(set(approx_i[r].tolist()) != set(ref_i[r].tolist()) for r in range(len(q)))


@each_kernel
def test_projected_search_is_exact_with_any_orthonormal_basis(kernel):
    """The bound holds for every orthonormal basis, not only the keys' principal one: a random 8-dimensional
    projection of isotropic keys (a poor pre-filter) still gives the float64 scan's neighbours — it only
    re-checks more keys. Isotropic keys are not projected by default."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(6000, 64, generator=g) * 5
    assert not isinstance(certified_search(keys, kernel), ProjectedL2Search)
    basis, _ = torch.linalg.qr(torch.randn(64, 8, generator=g, dtype=torch.float64))
    search = ProjectedL2Search(keys, basis, kernel)
    q = keys[:4] + torch.randn(4, 64, generator=g)
    d, i = search.search(q, 8)
    ref_d, ref_i = _float64_topk(keys, q, 8)
    for r in range(4):
        assert set(i[r].tolist()) == set(ref_i[r].tolist())
    assert torch.allclose(d.double(), ref_d, rtol=1e-5, atol=1e-2)
    assert search.checked > 8 * 4


@pytest.mark.skipif(not KERNELS, reason="no 16-bit scan kernel on this CPU")
def test_knn_scans_the_principal_components_of_low_rank_keys(tiny):
    keys = _low_rank_keys(d=tiny.hidden_size).numpy()
    plugin = KNN(KNNConfig(search="exact"), tiny)
    plugin.attach_memory(_Datastore(keys, 40.0))
    assert isinstance(plugin.exact_l2, ProjectedL2Search) and "principal components" in plugin.search_kind
    q = torch.from_numpy(keys[5:8] * 1.001) / 40.0
    _, i = plugin.search(q, 16)
    _, ref_i = _float64_topk(plugin.keys, q, 16)
    assert all(set(i[r].tolist()) == set(ref_i[r].tolist()) for r in range(3))


@pytest.mark.skipif(not packed_f32_available(), reason="oneDNN float32 linear not available")
def test_knn_float32_scan_on_packed_keys_finds_the_exact_neighbours(tiny, monkeypatch):
    """Where the certified 16-bit search cannot run (no oneDNN bfloat16, no FBGEMM float16: switched off here), the
    float32 scan from 4,096 entries reads the keys packed once for oneDNN's linear: the k nearest by a float64 scan,
    the plain matmul's distances to float32 rounding, and a query's bits the same alone and beside others."""
    from plugins import knn as knn_module

    monkeypatch.setattr(knn_module, "packed_bf16_available", lambda: False)
    monkeypatch.setattr(knn_module, "fp16_weight_available", lambda: False)

    # keys without the certified test's near-ties (a float32 scan's cancellation would reorder those)
    keys = torch.randn(5000, tiny.hidden_size, generator=torch.Generator().manual_seed(0)).numpy()
    plugin = KNN(KNNConfig(search="exact"), tiny)
    plugin.attach_memory(_Datastore(keys, 1.0))
    assert plugin.exact_l2 is None and plugin.packed_keys is not None and "packed" in plugin.search_kind
    q = torch.from_numpy(keys[:5]) + 0.5 * torch.randn(5, tiny.hidden_size)
    d, i = plugin.search(q, 16)
    _, ref_i = _float64_topk(plugin.keys, q, 16)
    for r in range(5):
        assert set(i[r].tolist()) == set(ref_i[r].tolist())
    for r in range(5):
        d1, i1 = plugin.search(q[r:r + 1], 16)
        assert torch.equal(d1, d[r:r + 1]) and torch.equal(i1, i[r:r + 1])
    plugin.packed_scan = False
    plain_d, plain_i = plugin.search(q, 16)
    assert torch.allclose(d, plain_d, rtol=1e-4, atol=1e-3)
    small = KNN(KNNConfig(search="exact"), tiny)
    small.attach_memory(_Datastore(keys[:4095], 1.0))
    assert small.packed_keys is None and "matmul" in small.search_kind


@pytest.mark.skipif(not KERNELS, reason="no 16-bit scan kernel on this CPU")
def test_knn_uses_the_certified_search_from_4096_entries(tiny, monkeypatch):
    keys = _clustered_keys(d=tiny.hidden_size).numpy()
    plugin = KNN(KNNConfig(search="exact"), tiny)
    plugin.attach_memory(_Datastore(keys, 40.0))
    assert plugin.exact_l2 is not None and "certified" in plugin.search_kind
    assert plugin.exact_l2.kernel == KERNELS[0] and KERNELS[0] in plugin.search_kind
    q = torch.from_numpy(keys[:3] * 1.001) / 40.0
    d, i = plugin.search(q, 16)
    ref_d, ref_i = _float64_topk(plugin.keys, q, 16)
    for r in range(3):
        assert set(i[r].tolist()) == set(ref_i[r].tolist())
    # the plain float32 scan (|q|² − 2q·k + |k|², cancellation and all) gives the same distances to its precision
    plugin.certified_search = False
    d32, _ = plugin.search(q, 16)
    assert torch.allclose(d, d32, rtol=1e-3, atol=0.05)

    small = KNN(KNNConfig(search="exact"), tiny)
    small.attach_memory(_Datastore(keys[:4095], 40.0))
    assert small.exact_l2 is None and "certified" not in small.search_kind


@pytest.mark.skipif(not fp16_weight_available(), reason="no FBGEMM float16 kernel")
def test_keys_beyond_float16s_range_scan_in_float32(tiny, monkeypatch):
    """A centred key that float16 cannot hold (|x| > 65,504) leaves the float16 pre-filter out: the float32 scan,
    still the exact neighbours."""
    from plugins import knn as knn_module

    monkeypatch.setattr(knn_module, "packed_bf16_available", lambda: False)
    keys = torch.randn(5000, tiny.hidden_size, generator=torch.Generator().manual_seed(0))
    keys[7, 3] = 1e6
    with pytest.raises(OverflowError):
        CertifiedL2Search(keys, "float16")
    plugin = KNN(KNNConfig(search="exact"), tiny)
    plugin.attach_memory(_Datastore(keys.numpy(), 1.0))
    assert plugin.exact_l2 is None and "certified" not in plugin.search_kind
    q = keys[:3] + 0.5 * torch.randn(3, tiny.hidden_size)
    _, i = plugin.search(q, 8)
    _, ref_i = _float64_topk(plugin.keys, q, 8)
    assert all(set(i[r].tolist()) == set(ref_i[r].tolist()) for r in range(3))
