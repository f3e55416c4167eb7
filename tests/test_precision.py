"""Lower-precision weights: the bfloat16, int8 and float16 weight-only paths run and stay close to float32, float32 is
untouched, the precision is recorded with every memory and a memory or plug-in of another precision is refused."""
import pytest
import torch
from torch import nn

from backbone.hf_internals import attn_implementation, sdpa_attention
from backbone.model import (
    CPU_FLOAT16_TAG,
    DEFAULT_CPU_PRECISION,
    FINGERPRINT_TAGS,
    Backbone,
    Fp16WeightLinear,
    Int8Linear,
    PackedBF16Linear,
    fp16_weight_available,
    model_precision,
    packed_bf16_available,
    resolve_precision,
    set_precision,
    using_fast_paths,
)
from backbone.prompts import Prompt
from backbone.tiny import tiny_backbone
from backbone.torch_internals import mkldnn_linear
from engine import Row, compare
from ground.errors import UserError
from memories.build import build_memory
from memories.parse import Sample
from memories.store import Memory

PROMPT = Prompt.for_task("translation")
PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen")] * 3


def tiny_in(precision: str) -> Backbone:
    t = tiny_backbone()
    return Backbone(model=set_precision(t.model, precision), tokenizer=t.tokenizer, name=t.name)


def tiny_on_decode_attention(precision: str = "bfloat16") -> Backbone:
    """``tiny_in`` on the bfloat16 CPU decode attention whatever this CPU is: ``set_precision`` switches to it only
    where oneDNN's bfloat16 linear runs (AVX-512 BF16 / AMX), but what rides on it (RowKeys, the growing KV cache)
    needs only bfloat16 tensors on a CPU, and must hold on every machine the tests run on."""
    from backbone.model import CPU_DECODE_ATTENTION, use_cpu_decode_attention

    bb = tiny_in(precision)
    use_cpu_decode_attention(bb.model)
    assert attn_implementation(bb.model) == CPU_DECODE_ATTENTION
    return bb


def _logits(bb: Backbone, text: str = "English: the house is small\nGerman:") -> torch.Tensor:
    ids = torch.tensor([bb.encode_context(text)])
    with torch.no_grad():
        fc, _ = bb.forward_fc(ids)
        return bb.logits_from_fc(fc[0])


def test_float32_is_the_unchanged_reference(tiny):
    """float32 keeps every weight and the decoder as they are: the fingerprint keeps its old form and f(c) — what
    memories and plug-ins are built from — is bit-identical. On a CPU only the LM head runs packed (PackedF32Linear,
    the same weight Parameter): float32 arithmetic in another summation order, so logits agree to float32 rounding,
    a row gets the same bits alone and in a batch, and a greedy comparison decodes the same tokens."""
    from backbone.model import PackedF32Linear, packed_f32_available

    assert tiny.precision == "float32" and "dtype=" not in tiny.fingerprint
    ids = torch.tensor([tiny.encode_context("English: the house is small\nGerman:")])
    again = tiny_in("float32")
    assert again.fingerprint == tiny.fingerprint and again.precision == "float32"
    with torch.no_grad():
        assert torch.equal(again.forward_fc(ids)[0], tiny.forward_fc(ids)[0])
    head = again.lm_head
    if packed_f32_available():
        assert isinstance(head, PackedF32Linear) and head.weight is again.model.get_input_embeddings().weight
    assert torch.allclose(_logits(again), _logits(tiny), rtol=1e-5, atol=1e-5)
    normed = torch.randn(9, tiny.hidden_size) * torch.exp(torch.randn(9, tiny.hidden_size))
    with torch.no_grad():
        batch = again.head_logits(normed)
        assert all(torch.equal(again.head_logits(normed[i:i + 1]), batch[i:i + 1]) for i in range(9))
        with using_fast_paths(packed_f32_head=False):
            plain = again.head_logits(normed[:3])
    assert torch.equal(plain, nn.functional.linear(normed[:3], tiny.lm_head.weight))  # switched off: as before
    assert torch.allclose(batch[:3], plain, rtol=1e-5, atol=1e-5)
    a = compare(tiny, "the house is small", [Row("base")], PROMPT, max_new_tokens=6)
    b = compare(again, "the house is small", [Row("base")], PROMPT, max_new_tokens=6)
    assert a.rows[0].tokens == b.rows[0].tokens and abs(a.rows[0].score - b.rows[0].score) < 1e-4


@pytest.mark.parametrize("precision", ["bfloat16", "int8",
                                       pytest.param("float16", marks=pytest.mark.skipif(
                                           not fp16_weight_available(), reason="no FBGEMM float16 kernel here"))])
def test_lower_precision_runs_close_to_float32(tiny, precision):
    bb = tiny_in(precision)
    assert bb.precision == precision == model_precision(bb.model)
    tag = CPU_FLOAT16_TAG if precision == "float16" else FINGERPRINT_TAGS.get(precision, precision)
    assert bb.fingerprint == f"{tiny.fingerprint}|dtype={tag}"
    got, ref = _logits(bb), _logits(tiny)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert not torch.equal(got, ref)  # it really computed in another precision ...
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9  # ... and stays close
    assert torch.allclose(got, ref, atol=0.05 * float(ref.abs().max()))
    c = compare(bb, "the house is small", [Row("base")], PROMPT, max_new_tokens=6)
    assert c.rows[0].tokens


def test_int8_swaps_every_linear_keeping_the_weight_parameters(tiny):
    """int8 is weight-only: every linear (LM head included) an Int8Linear, the rest of the model bfloat16; the
    weight Parameters stay (tied embeddings tied, the same state_dict keys) for training's F.linear."""
    bb = tiny_in("int8")
    linears = [m for m in bb.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    assert bb.lm_head.weight is bb.model.get_input_embeddings().weight
    assert bb.lm_head.weight.dtype == torch.bfloat16 and bb.dtype == torch.bfloat16
    assert set(bb.model.state_dict()) == set(tiny.model.state_dict())


@pytest.mark.skipif(not fp16_weight_available(), reason="no FBGEMM float16 kernel in this torch / on this CPU")
def test_float16_on_a_cpu_is_weight_only_and_a_row_keeps_its_bits_alone_and_in_a_batch(tiny):
    """``float16`` on a CPU: every projection and the LM head Fp16WeightLinear — float16-rounded weights (the
    float32 Parameter holds them: the gradient path multiplies the same weights; the head's is the tied input
    embedding, rounded with it), float32 activations and outputs; FBGEMM's kernel rounds a row in a block of one or
    two rows differently, so products are padded to row counts that keep every row's bits: a row alone, in any batch
    of up to 64 rows, and a comparison row alone decode alike."""
    bb = tiny_in("float16")
    swapped = [m for m in bb.model.modules() if isinstance(m, Fp16WeightLinear)]
    assert len(swapped) == len([m for m in tiny.model.modules() if type(m) is nn.Linear])  # the head too
    assert isinstance(bb.lm_head, Fp16WeightLinear) and bb.dtype == torch.float32
    emb = bb.model.get_input_embeddings().weight
    assert bb.lm_head.weight is emb and torch.equal(emb, emb.half().float())
    assert not torch.equal(emb, tiny.model.get_input_embeddings().weight)  # rounded: not the float32 model's
    with torch.no_grad():
        h = torch.randn(5, bb.hidden_size)
        assert torch.allclose(bb.head_logits(h), nn.functional.linear(h, emb).float(), rtol=1e-4, atol=1e-4)
        assert torch.equal(bb.head_logits(h[:1]), bb.head_logits(h)[:1])  # a lone row's logits as in a batch
    lin = swapped[0]
    assert torch.equal(lin.weight, lin.weight.half().float())  # float16 values in float32 storage
    x = torch.randn(64, lin.in_features) * torch.exp(2 * torch.randn(64, lin.in_features))
    with torch.no_grad():
        want = nn.functional.linear(x, lin.weight, lin.bias)
        batch = lin(x)
        assert torch.allclose(batch, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        for n in (1, 2, 3, 7, 14, 31, 32, 64):  # row counts FBGEMM rounds differently unpadded (on an AVX2 CPU)
            assert torch.equal(lin(x[:n]), batch[:n]), n
        assert all(torch.equal(lin(x[i:i + 1]), batch[i:i + 1]) for i in range(0, 64, 9))
    # with gradients (training through the frozen backbone): FBGEMM for x·Wᵀ and for the input's gradient g·W, on
    # the same rounded weights as F.linear — equal up to the summation order; the frozen weight gets no gradient
    xg = x[:40].clone().requires_grad_(True)
    out = lin(xg)
    want = nn.functional.linear(x[:40], lin.weight, lin.bias)
    assert out.requires_grad and torch.allclose(out, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    g = torch.randn_like(out)
    out.backward(g)
    want_grad = g @ lin.weight
    assert torch.allclose(xg.grad, want_grad, rtol=1e-4, atol=1e-4 * float(want_grad.abs().max()))
    assert lin.weight.grad is None
    lin.weight.requires_grad_(True)  # a weight that trains: the plain product, whose weight gradient exists
    try:
        nn.functional.linear(x[:3], lin.weight, lin.bias).sum().backward()
        lin(x[:3]).sum().backward()
        assert lin.weight.grad is not None
    finally:
        lin.weight.requires_grad_(False)
        lin.weight.grad = None
    copy_ = __import__("copy").deepcopy(lin)  # LoRA copies the last layer: the copy packs its own weights
    with torch.no_grad():
        assert isinstance(copy_, Fp16WeightLinear) and torch.equal(copy_(x[:5]), batch[:5])
    rows = [Row("base")]
    alone = compare(bb, "the house is small", rows, PROMPT, max_new_tokens=6)
    among = decode_batch_rows(bb, "the house is small", 7)
    assert all(r.tokens == alone.rows[0].tokens and r.score == alone.rows[0].score for r in among.rows)


def decode_batch_rows(bb: Backbone, source: str, n: int):
    """``n`` base rows of one comparison, each in a row of its own (the compact layout would share them: off)."""
    return compare(bb, source, [Row(f"base {i}") for i in range(n)], PROMPT, max_new_tokens=6, compact=False)


def test_int8_linear_is_weight_only_without_gradients_and_f_linear_with_them():
    """Without gradients: int8 weights (per output row, scale ≥ max|w|/127 so nothing is clipped) times bfloat16
    activations, i.e. x·(q·s)ᵀ up to bfloat16 rounding — not an activation-quantized product; with gradients the
    original weight through F.linear, exact."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    q = Int8Linear(lin)
    w8, scale = q._prepared
    assert w8.dtype == torch.int8 and int(w8.abs().max()) <= 127
    dequant = w8.float() * scale.float()[:, None]
    assert torch.allclose(dequant, lin.weight, atol=float(scale.float().max()) / 2 + 1e-6)
    x = torch.randn(5, 32) * torch.exp(2 * torch.randn(5, 32))  # outlier activations: weight-only keeps them
    with torch.no_grad():
        exact = nn.functional.linear(x, lin.weight, lin.bias)
        fast = q(x.bfloat16()).float()
        want = nn.functional.linear(x.bfloat16().float(), dequant, lin.bias)
    assert not torch.equal(fast, exact)
    assert torch.allclose(fast, want, atol=0.01 * float(want.abs().max()))
    xg = x.clone().requires_grad_(True)
    out = q(xg)  # training through the frozen backbone: F.linear on the weight, with a gradient
    assert torch.equal(out, exact)
    out.sum().backward()
    assert torch.allclose(xg.grad, lin.weight.sum(0).expand(5, -1))
    # a width torch's int8 kernel cannot take (not a multiple of 16: it would crash the process) runs F.linear
    odd = nn.Linear(1000, 8).to(torch.bfloat16)
    q = Int8Linear(odd)
    xo = torch.randn(2, 1000).bfloat16()
    with torch.no_grad():
        assert not q.kernel_ok and torch.equal(q(xo), nn.functional.linear(xo, odd.weight, odd.bias))


@pytest.mark.skipif(not packed_bf16_available(), reason="this torch/CPU has no oneDNN bfloat16 linear")
def test_bfloat16_linears_run_oneDNN_packed_weights_with_the_plain_paths_arithmetic(tiny):
    """On a CPU, bfloat16 swaps every linear (LM head included) for a PackedBF16Linear: the same weight Parameter
    (tied embeddings stay tied), the same numbers as bfloat16 F.linear, F.linear with gradients (training), and
    a decode identical to the plain bfloat16 path's."""
    import copy

    bb = tiny_in("bfloat16")
    linears = [m for m in bb.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, PackedBF16Linear) for m in linears)
    assert bb.lm_head.weight is bb.model.get_input_embeddings().weight and bb.dtype == torch.bfloat16
    assert set(bb.model.state_dict()) == set(tiny.model.state_dict())
    lin = linears[0]
    x = torch.randn(5, lin.in_features).bfloat16()
    with torch.no_grad():
        fast, plain = lin(x), nn.functional.linear(x, lin.weight, lin.bias)
    assert torch.equal(fast, plain) or torch.allclose(fast.float(), plain.float(), atol=1e-2)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    try:  # no gradients: the packed kernel; with gradients: F.linear on the Parameter
        torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(1) or real(*a)
        with torch.no_grad():
            lin(x)
        assert calls == [1]
        out = lin(x.clone().requires_grad_(True))
        assert calls == [1] and out.grad_fn is not None
    finally:
        torch.ops.mkldnn._linear_pointwise = real
    c = copy.deepcopy(bb.model)  # LoRA trains on a deep copy of the last layer: the copy packs its own weight
    assert all(isinstance(m, PackedBF16Linear) for m in c.modules() if isinstance(m, nn.Linear))
    a = compare(bb, "the house is small", [Row("base")], PROMPT, max_new_tokens=8)
    with using_fast_paths(packed_bf16=False):
        b = compare(bb, "the house is small", [Row("base")], PROMPT, max_new_tokens=8)
    assert a.rows[0].tokens == b.rows[0].tokens


def test_cpu_decode_attention_is_sdpa_with_its_masks():
    """bfloat16 decode steps on a CPU use cpu_decode_attention: the same result as transformers' SDPA function up to
    bfloat16 rounding, with grouped KV heads and boolean or additive masks (padding, sliding window)."""
    from backbone.model import cpu_decode_attention

    sdpa_attention_forward = sdpa_attention()

    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, D = 3, 8, 2, 37, 16
    q, k, v = (torch.randn(*s, generator=g).bfloat16() for s in ((B, H, 1, D), (B, Hkv, L, D), (B, Hkv, L, D)))
    keep = torch.ones(B, 1, 1, L + 5, dtype=torch.bool)
    keep[0, ..., :10] = False
    keep[2, ..., 30:] = False
    for mask in (None, keep, torch.where(keep, 0.0, float("-inf")).bfloat16()):
        got, _ = cpu_decode_attention(module, q, k, v, mask, scaling=0.25)
        want, _ = sdpa_attention_forward(module, q, k, v, None if mask is None else mask[..., :L], scaling=0.25)
        assert got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=2e-2)
    masked, _ = cpu_decode_attention(module, q, k, v, keep, scaling=0.25)
    assert not torch.allclose(masked.float(), cpu_decode_attention(module, q, k, v, None, scaling=0.25)[0].float(),
                              atol=0.1)


@pytest.mark.skipif(not packed_bf16_available(), reason="this torch/CPU has no oneDNN bfloat16 linear")
def test_bfloat16_backbone_masks_padding_in_batched_decodes(tiny):
    """The bfloat16 CPU backbone runs the registered decode attention with SDPA's masks: a context left-padded
    beside a longer one gives the f(c) it gives alone, at the prefill and at a decode step (one query token)."""
    from backbone.model import CPU_DECODE_ATTENTION

    bb = tiny_in("bfloat16")
    assert attn_implementation(bb.model) == CPU_DECODE_ATTENTION
    short = bb.encode_context("English: good morning\nGerman:")
    long = bb.encode_context("English: the house is small and the cat sleeps on the old red chair\nGerman:")
    pad = len(long) - len(short)
    ids = torch.tensor([long, [0] * pad + short])
    mask = torch.tensor([[1] * len(long), [0] * pad + [1] * len(short)])
    nxt = torch.tensor([[5], [7]])
    with torch.no_grad():
        fc_b, out_b = bb.forward_fc(ids, attention_mask=mask, use_cache=True)
        step_b, _ = bb.forward_fc(nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                                  past_key_values=out_b.past_key_values, use_cache=True)
        fc_a, out_a = bb.forward_fc(torch.tensor([short]), use_cache=True)
        step_a, _ = bb.forward_fc(nxt[1:], past_key_values=out_a.past_key_values, use_cache=True)
    for got, want in ((fc_b[1, -1], fc_a[0, -1]), (step_b[1, -1], step_a[0, -1])):
        assert torch.allclose(got.float(), want.float(), atol=0.005 * float(want.abs().max()))


@pytest.mark.skipif(not packed_bf16_available(), reason="this torch/CPU has no oneDNN bfloat16 linear")
def test_memory_tuning_prefix_runs_on_the_bfloat16_cpu_attention(tmp_path):
    """MT-M hands its prefix to the attention as extra keys with an additive mask: the bfloat16 CPU decode
    attention takes it (a batched MT-M row decodes as it does alone)."""
    from engine import decode_batch
    from plugins.api import train_plugin

    bb = tiny_in("bfloat16")
    mem = build_memory(bb, [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)], tmp_path / "m", prompt=PROMPT)
    mt, _ = train_plugin(bb, mem, "memory_tuning", {"max_epochs": 1, "max_minutes": 0, "variant": "MT-MF"},
                         out_dir=tmp_path / "mt")
    rows = [Row("base"), Row("mt", mt)]
    both = decode_batch(bb, ["the house is small", "good morning"], rows, PROMPT, max_new_tokens=5)
    alone = compare(bb, "good morning", rows, PROMPT, max_new_tokens=5)
    assert [r.tokens for r in both[1].rows] == [r.tokens for r in alone.rows]


def test_memory_records_its_precision_and_other_precisions_are_refused(tmp_path, tiny):
    bb = tiny_in("int8")
    mem = build_memory(bb, [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)], tmp_path / "m8", prompt=PROMPT,
                       heldout_frac=0)
    assert mem.meta["precision"] == "int8" and mem.fingerprint.endswith("|dtype=int8-weight-only")
    assert len(Memory.load(mem.path, bb)) == len(mem)  # the same precision loads it
    with pytest.raises(UserError, match="int8.*float32"):
        Memory.load(mem.path, tiny)
    with pytest.raises(UserError, match="float32.*bfloat16"):
        tiny_in("bfloat16").check_fingerprint(tiny.fingerprint)
    with pytest.raises(UserError, match="another backbone"):  # a different model is still a different model
        bb.check_fingerprint(tiny_backbone(seed=0, hidden=32).fingerprint)
    with pytest.raises(UserError, match="earlier version's dynamic int8.*rebuild"):  # int8 before weight-only
        bb.check_fingerprint(f"{tiny.fingerprint}|dtype=int8")


def test_plugin_of_another_precision_is_refused_in_a_comparison(tmp_path, tiny):
    from plugins.api import train_plugin

    bb = tiny_in("bfloat16")
    mem = build_memory(bb, [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)], tmp_path / "m16", prompt=PROMPT,
                       heldout_frac=0)
    knn, _ = train_plugin(bb, mem, "knn", {}, out_dir=tmp_path / "knn")
    ok = compare(bb, "the house is small", [Row("base"), Row("knn", knn)], PROMPT, max_new_tokens=4)
    assert [r.label for r in ok.rows] == ["base", "knn"]
    with pytest.raises(UserError, match="bfloat16"):
        compare(tiny, "the house is small", [Row("knn", knn)], PROMPT, max_new_tokens=4)


def test_the_studio_gets_its_precision_as_an_argument(tmp_path, monkeypatch):
    """``$PEMA_DTYPE`` is read where the command line is parsed; the studio gets the precision as a parameter (and
    hands it to its backbone loads, Ray workers included), never through the environment."""
    import app
    from studio.service import Studio

    monkeypatch.setenv("PEMA_DTYPE", "float32")
    assert app.parse_args([]).dtype == "float32" and app.parse_args(["--dtype", "int8"]).dtype == "int8"
    monkeypatch.delenv("PEMA_DTYPE")
    assert app.parse_args([]).dtype is None
    st = Studio(tmp_path / "d", backbone="tiny", load=False, start_jobs=False, dtype="bfloat16")
    try:
        assert st.backbone_service.dtype == "bfloat16"
    finally:
        st.close()


def test_precision_choice(monkeypatch):
    monkeypatch.delenv("PEMA_DTYPE", raising=False)
    assert resolve_precision(None, "cpu") == DEFAULT_CPU_PRECISION
    assert resolve_precision("bf16", "cpu") == "bfloat16" and resolve_precision(torch.float32, "cpu") == "float32"
    monkeypatch.setenv("PEMA_DTYPE", "int8")  # the studio's setting
    assert resolve_precision(None, "cpu") == resolve_precision("auto", "cpu") == "int8"
    assert resolve_precision("float32", "cpu") == "float32"  # an explicit flag wins
    with pytest.raises(UserError, match="Unknown dtype"):
        resolve_precision("int4", "cpu")
    with pytest.raises(UserError, match="GPU"):
        resolve_precision("int8", "cuda")
    assert resolve_precision("fp16", "cpu") == resolve_precision("float16", "cuda") == "float16"
    import backbone.precision as precision

    monkeypatch.setattr(precision, "fp16_weight_available", lambda: False)  # no FBGEMM (e.g. an ARM CPU): said so
    with pytest.raises(UserError, match="FBGEMM.*--dtype float32"):
        set_precision(tiny_backbone().model, "float16")


@pytest.mark.skipif(not fp16_weight_available(), reason="no FBGEMM float16 kernel in this torch / on this CPU")
def test_a_float16_memory_is_refused_by_a_float32_backbone_naming_the_precision(tmp_path, tiny):
    mem = build_memory(tiny_in("float16"), [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)], tmp_path / "m",
                       prompt=PROMPT)
    assert mem.fingerprint.endswith(f"|dtype={CPU_FLOAT16_TAG}")
    with pytest.raises(UserError, match="--dtype float16"):
        Memory.load(mem.path, tiny)


def test_small_forwards_run_on_one_thread_only_where_threads_sleep(tiny, monkeypatch):
    """Under OMP_WAIT_POLICY=PASSIVE a decode step's decoder runs on one thread (each parallel region would wake a
    sleeping thread) and the caller's thread count is back afterwards; a long forward, a forward with gradients
    and spinning threads keep the count. The outputs are the same either way."""

    seen = []
    hook = tiny.decoder.register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        ids = torch.tensor([tiny.encode_context("English: the house is small\nGerman:")])
        with torch.no_grad():
            one, _ = tiny.forward_fc(ids[:, :4])
            assert seen[-1] == 1 and torch.get_num_threads() == 2
            tiny.forward_fc(torch.zeros(1, 33, dtype=torch.long))  # longer than max_tokens
            assert seen[-1] == 2
            with using_fast_paths(small_forward_one_thread=False):
                both, _ = tiny.forward_fc(ids[:, :4])
            assert seen[-1] == 2 and torch.equal(one, both)
            monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
            tiny.forward_fc(ids[:, :4])
            assert seen[-1] == 2
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        tiny.forward_fc(ids[:, :4])  # gradients on: training keeps its threads
        assert seen[-1] == 2 and torch.get_num_threads() == 2
    finally:
        hook.remove()
        torch.set_num_threads(threads)


def test_one_thread_sections_of_concurrent_decodes_leave_the_process_its_threads():
    """torch's thread count is process-wide and the studio decodes in several threads: sections entered and left
    interleaved (A in, B in, A out, B out — where a per-caller save/restore ends on one thread) give the process
    its count back when the last one leaves; all_threads inside one restores the count for a product."""
    import threading

    from backbone.model import all_threads, one_thread_section, process_threads

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with one_thread_section():
            a_in.set()
            b_in.wait(5)
            seen["a"] = torch.get_num_threads()
        a_out.set()

    def b():
        a_in.wait(5)
        with one_thread_section():
            b_in.set()
            a_out.wait(5)
            seen["b"] = torch.get_num_threads()
            seen["process"] = process_threads()
            with all_threads():
                seen["product"] = torch.get_num_threads()
            seen["after product"] = torch.get_num_threads()

    try:
        ta, tb = threading.Thread(target=a), threading.Thread(target=b)
        ta.start(), tb.start()
        ta.join(10), tb.join(10)
        assert seen == {"a": 1, "b": 1, "process": 2, "product": 2, "after product": 1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_decode_step_runs_small_work_on_one_thread_and_the_lm_head_on_all(tiny, tiny_memory, monkeypatch):
    """Under PASSIVE a decode step's work around the decoder (the plug-ins' mixes, token selection) runs on one
    thread, the LM head product and a kNN scan on the caller's threads; the caller's count is back afterwards and
    the comparison is the same with the switch off."""
    from backbone import model as model_module
    from plugins.knn import KNN, KNNConfig

    knn = KNN(KNNConfig(search="exact"), tiny)
    knn.fit(tiny_memory)
    seen: dict[str, list[int]] = {"head": [], "mix": [], "scan": []}
    real_project, real_mix, real_search = model_module._project, knn.mix, knn.search

    def project(x, w):  # the float32 LM head's product
        seen["head"].append(torch.get_num_threads())
        return real_project(x, w)

    def mix(inp):
        seen["mix"].append(torch.get_num_threads())
        return real_mix(inp)

    def search(q, k):
        out = real_search(q, k)
        seen["scan"].append(torch.get_num_threads())  # back to the small work's count after the scan
        return out

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(model_module, "_project", project)
    monkeypatch.setattr(knn, "mix", mix)
    monkeypatch.setattr(knn, "search", search)
    try:
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        rows = [Row("base"), Row("knn", knn)]
        a = compare(tiny, "the house is small", rows, PROMPT, max_new_tokens=4)
        assert seen["head"] and set(seen["head"]) == {2} and set(seen["mix"]) == {1} and set(seen["scan"]) == {1}
        assert torch.get_num_threads() == 2
        seen["mix"].clear()
        with using_fast_paths(small_work_one_thread=False):
            b = compare(tiny, "the house is small", rows, PROMPT, max_new_tokens=4)
        assert set(seen["mix"]) == {2}
        assert [r.tokens for r in a.rows] == [r.tokens for r in b.rows]
        assert [r.score for r in a.rows] == [r.score for r in b.rows]
    finally:
        torch.set_num_threads(threads)


def test_vocabulary_wide_row_operations_of_a_step_take_every_thread_with_the_same_bits(tiny, monkeypatch):
    """Inside a step's one-thread small work, the token selection's top-k over rows × vocabulary takes every thread
    once it is large (``VOCAB_WIDE_ELEMENTS``; lowered here for the tiny vocabulary), and the comparison is bit for
    bit the one-thread one."""
    from backbone import threads as threads_module
    from engine import beams as decode_module  # the token selection's top-k

    seen: list[int] = []
    real_top_k = decode_module.top_k

    def top_k(x, k):
        seen.append(torch.get_num_threads())
        return real_top_k(x, k)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(decode_module, "top_k", top_k)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    try:
        rows = [Row("base"), Row("base2")]
        a = compare(tiny, "the house is small", rows, PROMPT, max_new_tokens=4, trace=False)
        assert seen and set(seen) == {1}
        seen.clear()
        monkeypatch.setattr(threads_module, "VOCAB_WIDE_ELEMENTS", 2 * tiny.vocab_size)
        b = compare(tiny, "the house is small", rows, PROMPT, max_new_tokens=4, trace=False)
        assert seen and set(seen) == {2}
        assert [r.tokens for r in a.rows] == [r.tokens for r in b.rows]
        assert [r.score for r in a.rows] == [r.score for r in b.rows]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_memory_tuning_prefix_read_inside_the_decode_attention_equals_the_re_run(tmp_path, monkeypatch, precision):
    """On the CPU decode attention (bfloat16's own; float32's SDPA plus RowKeys), MT-M's rows read the prefix
    inside the layer's one attention call (RowKeys) instead of a second run of the attention: a decode step's f(c)
    for those rows as the re-run gives it (to the precision's rounding), the other rows bit-identical to a step
    without memory-tuning attached, and the same λ trace in a comparison."""
    import copy

    from plugins import memory_tuning
    from plugins.api import train_plugin

    bb = tiny_on_decode_attention(precision)
    mem = build_memory(bb, [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)], tmp_path / "m", prompt=PROMPT)
    mt, _ = train_plugin(bb, mem, "memory_tuning", {"max_epochs": 1, "max_minutes": 0, "variant": "MT-M"},
                         out_dir=tmp_path / "mt")
    with torch.no_grad():
        mt.prefix_v.mul_(30.0)  # a prefix that visibly moves the states (the briefly trained one barely does)
    ids = torch.tensor([bb.encode_context("English: the house is small\nGerman:")] * 3)
    with torch.no_grad():
        past = bb.forward_fc(ids, use_cache=True)[1].past_key_values
    calls = []
    real = memory_tuning.RowKeys.attend
    monkeypatch.setattr(memory_tuning.RowKeys, "attend", lambda self, *a: calls.append(1) or real(self, *a))

    def step(attached: bool):
        handles = mt.attach([1, 2], {"scale": 2.0}) if attached else []
        try:
            with torch.no_grad():
                return bb.forward_fc(ids[:, -1:] * 0 + 5, past_key_values=copy.deepcopy(past), use_cache=True)[0]
        finally:
            for h in handles:
                h.remove()

    plain, fused = step(False), step(True)
    assert calls
    mt.row_keys_in_attention = False
    n = len(calls)
    rerun = step(True)
    assert len(calls) == n  # switched off: the re-run
    assert torch.equal(fused[0], plain[0]) and torch.equal(rerun[0], plain[0])
    assert (fused[1:] - plain[1:]).abs().max() > 0.1  # the prefix does act
    tol = {"atol": 0.05, "rtol": 0.02} if precision == "bfloat16" else {"atol": 1e-4, "rtol": 1e-4}
    assert torch.allclose(fused[1:].float(), rerun[1:].float(), **tol)
    mt.row_keys_in_attention = True
    rows = [Row("base"), Row("mt", mt)]
    traces = []
    for on in (True, False):
        mt.row_keys_in_attention = on
        c = compare(bb, "the house is small", rows, PROMPT, max_new_tokens=4)
        traces.append([t["memory_attention"]["attention_lambda"] for t in c.row("mt").trace])
    assert all(abs(x - y) < 0.02 for x, y in zip(*traces)) and len(traces[0]) == 4


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_memory_tuning_row_steps_alone_as_among_other_rows_on_the_decode_attention(tmp_path, precision):
    """With float32 activations the decode attention scores only MT-M's own rows for the prefix read (SDPA gives
    every row's attention): a decode step's f(c) of its row alone is what it is among other rows — in float16
    weight-only (whose products keep a row's bits in any batch) bit for bit, in float32 to BLAS's rounding — and
    the prefix does act."""
    import copy

    if precision == "float16" and not fp16_weight_available():
        pytest.skip("no FBGEMM float16 kernel in this torch / on this CPU")
    from plugins.api import train_plugin

    bb = tiny_on_decode_attention(precision)
    mem = build_memory(bb, [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)], tmp_path / "m", prompt=PROMPT)
    mt, _ = train_plugin(bb, mem, "memory_tuning", {"max_epochs": 1, "max_minutes": 0, "variant": "MT-M"},
                         out_dir=tmp_path / "mt")
    with torch.no_grad():
        mt.prefix_v.mul_(30.0)  # a prefix that visibly moves the states
    contexts = ["English: the house is small\nGerman:", "a cat sleeps on the mat", "German: die Katze schlaeft"]
    width = min(len(bb.encode_context(c)) for c in contexts)  # three different rows, no padding
    ids = torch.tensor([bb.encode_context(c)[:width] for c in contexts])
    assert width >= 4 and len({tuple(r) for r in ids.tolist()}) == 3

    def step(rows: list[int], mt_rows: list[int]):
        with torch.no_grad():
            past = bb.forward_fc(ids[rows], use_cache=True)[1].past_key_values
            handles = mt.attach(mt_rows, {}) if mt_rows else []
            try:
                return bb.forward_fc(ids[rows, -1:] * 0 + 7, past_key_values=copy.deepcopy(past), use_cache=True)[0]
            finally:
                for h in handles:
                    h.remove()

    alone, among, plain = step([1], [0]), step([0, 1, 2], [1]), step([1], [])
    assert (alone[0] - plain[0]).abs().max() > 0.1  # the prefix acts
    if precision == "float16":
        assert torch.equal(among[1], alone[0])
    else:
        assert torch.allclose(among[1], alone[0], atol=1e-5, rtol=1e-5)


def test_decode_passes_run_in_inference_mode_but_captures_for_training_do_not(tiny):
    """A forward without gradients (a decode step) runs in inference mode; what ``forward_until_stopped`` captures
    for training (LoRA's last-layer inputs) stays an ordinary tensor that backward may save."""
    from backbone.model import StopForward

    ids = torch.tensor([tiny.encode_context("English: the house is small\nGerman:")])
    with torch.no_grad():
        fc, _ = tiny.forward_fc(ids)
    assert fc.is_inference()
    fc, _ = tiny.forward_fc(ids)  # gradients on (training): no inference mode
    assert not fc.is_inference()

    def stop(mod, args):
        raise StopForward(args[0])

    h = tiny.layers[-1].register_forward_pre_hook(stop)
    try:
        got = tiny.forward_until_stopped(ids).captured
    finally:
        h.remove()
    assert not got.is_inference()
    w = torch.ones(got.shape[-1], requires_grad=True)
    (got * w).sum().backward()  # saving it for backward works
    assert w.grad is not None


@pytest.mark.skipif(not packed_bf16_available(), reason="oneDNN bfloat16 linear not available")
def test_packed_bfloat16_linear_gives_one_row_what_it_gives_that_row_in_a_batch():
    """oneDNN's one-row (GEMV) kernel rounds its 2048-long sums differently from its GEMM on heavy-tailed inputs
    (real activations; seen as batched comparison rows decoding differently from the same row alone on Gemma).
    PackedBF16Linear runs a product of fewer than four rows as four (its cheapest count; any 2-16 rows give a row
    the same bits), so a row's output does not depend on the batch it is in."""
    torch.manual_seed(0)
    lin = PackedBF16Linear(nn.Linear(2048, 640, bias=False, dtype=torch.bfloat16))
    raw = lambda x: mkldnn_linear(x, lin._prepared[0], None)  # noqa: E731
    differs = 0
    with torch.no_grad():
        for trial in range(20):
            g = torch.Generator().manual_seed(trial)
            x = (torch.randn(1, 1, 2048, generator=g) * torch.exp(torch.randn(1, 1, 2048, generator=g) * 2))
            x = x.to(torch.bfloat16)
            batch = torch.cat([x, torch.randn(4, 1, 2048, dtype=torch.bfloat16)])
            assert torch.equal(lin(x)[0], lin(batch)[0]), trial
            assert lin(x).shape == (1, 1, 640)
            differs += not torch.equal(raw(x[0]), raw(batch[:, 0])[:1])
    assert differs  # the kernel itself does differ on such inputs (else this test would prove nothing)
    assert lin.min_rows == 4
    shapes = ((640, 1024), (1024, 640), (640, 4096), (2048, 640))
    for cls, (d_in, d_out) in [(c, sh) for c in (PackedBF16Linear, Int8Linear) for sh in shapes]:
        weights = torch.bfloat16 if cls is PackedBF16Linear else torch.float32  # int8 quantizes float32 weights
        lin = cls(nn.Linear(d_in, d_out, bias=False, dtype=weights))  # whatever each kernel and shape decided …
        with torch.no_grad():
            for trial in range(8):
                g = torch.Generator().manual_seed(100 + trial)
                x = torch.randn(1, d_in, generator=g) * torch.exp(torch.randn(1, d_in, generator=g) * 2)
                batch = torch.cat([x, torch.randn(5, d_in)]).to(torch.bfloat16)
                for rows in (1, 2, 3, 5):  # padded to the kernel's fewest rows or not, a row is a row
                    got = lin(batch[:rows])
                    assert got.shape == (rows, d_out)
                    assert torch.equal(got, lin(batch)[:rows]), (cls, d_in, d_out, trial, rows)


@pytest.mark.skipif(not packed_bf16_available(), reason="oneDNN bfloat16 linear not available")
def test_a_kernel_whose_rows_change_bits_with_the_row_count_is_reported_at_load(caplog):
    """Padding few-row products (``FEW_ROWS``) keeps a row's bits only where the kernel gives a row the same bits in
    products of any row count: true of this CPU's packed kernel (checked for Gemma's shapes), and a kernel that
    does not (another CPU's) is named in a warning at load instead of decoding rows differently unannounced."""
    import logging

    from backbone import kernels as M

    for d_in, d_out in ((640, 1024), (2048, 640), (640, 4096)):
        assert PackedBF16Linear(nn.Linear(d_in, d_out, bias=False, dtype=torch.bfloat16))._check_rows_invariant()

    class RowCountDependent(PackedBF16Linear):
        def _product(self, x):
            y = super()._product(x)
            return y + 0.5 if x.shape[0] > self.FEW_ROWS else y  # rounds "differently" in larger products

    M._ROWS_INVARIANT.pop((RowCountDependent, 64, 32, 4), None)
    with caplog.at_level(logging.WARNING, logger="pema.backbone"):
        lin = RowCountDependent(nn.Linear(64, 32, bias=False, dtype=torch.bfloat16))
    assert not lin._check_rows_invariant()
    assert "decode slightly differently alone and in a batch" in caplog.text and "float32" in caplog.text


def _tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                           sliding_window=8)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)  # Gemma's norms start at w = 0, where (1 + w) and w could not be told apart
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_replace_only_norms_they_reproduce_bit_for_bit(tiny, dtype):
    """Both known RMSNorm formulations (Llama's w · x̂, Gemma's x̂ · (1 + w)) are swapped for torch's fused
    F.rms_norm, and a model's outputs are bit-identical with the fused norms on and off; a norm computing anything
    else is left alone; with gradients the original module runs (and gradients flow)."""
    from backbone.model import FusedRMSNorm

    llama = [m for m in tiny.model.modules() if isinstance(m, FusedRMSNorm)]
    assert len(llama) == 2 * tiny.num_layers + 1 and {m.style for m in llama} == {"times"}
    gemma = _tiny_gemma3().to(dtype)
    assert FusedRMSNorm.swap_into(gemma) == 2 * 6 + 1  # 4 per layer, q_norm, k_norm, the final norm
    assert {m.style for m in gemma.modules() if isinstance(m, FusedRMSNorm)} == {"one_plus"}
    assert FusedRMSNorm.swap_into(gemma) == 0  # already swapped: not wrapped twice
    ids = torch.randint(0, 97, (2, 11))
    for model in (gemma, tiny_backbone().model.to(dtype)):  # a fresh one: the fixture stays float32
        with torch.no_grad():
            fused = model(input_ids=ids).logits
            with using_fast_paths(fused_norms=False):
                plain = model(input_ids=ids).logits
        assert torch.equal(fused, plain)

    class ScaleOnlyRMSNorm(nn.Module):  # named like a norm, but no normalisation: no fused formulation matches
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight

    box = nn.Sequential(ScaleOnlyRMSNorm())
    assert FusedRMSNorm.swap_into(box) == 0 and isinstance(box[0], ScaleOnlyRMSNorm)
    norm = llama[0]
    x = torch.randn(3, tiny.hidden_size, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and torch.equal(norm(x.detach()), norm._original[0](x.detach()))



def test_growing_kv_cache_appends_in_place_and_decodes_as_the_concatenating_one(monkeypatch):
    """After the prefill a decode's KV cache appends into KV_BLOCK-rounded buffers instead of concatenating: the
    same comparison, token for token and score for score, as with transformers' own dynamic cache; a copy that
    shares the buffers (a deep copy whose memo keeps the tensors, as a slider move's) appends into a buffer of its
    own, leaving the original's positions as they were."""
    import copy

    from backbone.model import KV_BLOCK, grow_kv_cache

    bb = tiny_on_decode_attention()
    rows = [Row("base"), Row("again")]
    on = compare(bb, "the house is small", rows, PROMPT, max_new_tokens=6, trace=False)
    with using_fast_paths(growing_kv=False):
        off = compare(bb, "the house is small", rows, PROMPT, max_new_tokens=6, trace=False)
    assert [r.tokens for r in on.rows] == [r.tokens for r in off.rows]
    assert [r.score for r in on.rows] == [r.score for r in off.rows]

    ids = torch.tensor([bb.encode_context("a small house")])
    with torch.no_grad():
        cache = bb.decoder(input_ids=ids, use_cache=True).past_key_values
    grow_kv_cache(cache, bb.model)
    layer = cache.layers[0]
    assert type(layer).__name__.startswith("Growing")
    L = layer.keys.shape[-2]
    new_k = torch.randn(1, layer.keys.shape[1], 1, layer.keys.shape[-1], dtype=layer.keys.dtype)
    keys, _ = layer.update(new_k, new_k.clone())
    store = keys.pema_store
    assert store.shape[-2] % KV_BLOCK == 0 and store.shape[-2] >= L + 1 and keys.pema_buffer.shape == store.shape
    assert keys.shape[-2] == L + 1 and torch.equal(keys[:, :, -1:], new_k)
    keys2, _ = layer.update(new_k + 1, new_k + 1)
    assert keys2.pema_store is store  # in place while the block lasts
    shared = {id(t): t for t in (layer.keys, layer.values)}
    twin = copy.deepcopy(cache, shared).layers[0]
    assert twin.keys is layer.keys
    mine, _ = layer.update(new_k + 2, new_k + 2)
    theirs, _ = twin.update(new_k + 3, new_k + 3)
    assert theirs.pema_store is not store and mine.pema_store is store
    assert torch.equal(mine[:, :, -1:], new_k + 2) and torch.equal(theirs[:, :, -1:], new_k + 3)
    assert torch.equal(mine[:, :, :-1], theirs[:, :, :-1])
    cache.batch_select_indices(torch.tensor([0, 0]))  # replaced tensors: the next append copies them first
    again, _ = cache.layers[0].update(torch.cat([new_k, new_k]), torch.cat([new_k, new_k]))
    assert again.pema_store is not store and again.shape[0] == 2 and torch.equal(again[1, :, :-1], mine[0])
    plain = tiny_backbone()  # a model whose attention is not the decode attention: its cache is left as it is
    with torch.no_grad():
        kept = plain.decoder(input_ids=ids, use_cache=True).past_key_values
    grow_kv_cache(kept, plain.model)
    assert not type(kept.layers[0]).__name__.startswith("Growing")


def test_growing_kv_cache_relayout_appends_parting_rows_in_place_and_selects_with_one_copy():
    """``relayout_kv_rows``: rows that part are written into the store's spare rows (the kept rows' store and
    views stay as they were: a snapshot of the cache is unchanged), any other selection is one copy into a new
    store; either way the cache equals transformers' row selection, positions past the fill stay zero, and the
    next append goes in place."""
    from backbone.model import GrowingKVLayer, grow_kv_cache, relayout_kv_rows

    bb = tiny_on_decode_attention()
    one = bb.encode_context("a small house")
    ids = torch.tensor([one, one[::-1]])  # two rows of one length, different keys
    with torch.no_grad():
        cache = bb.decoder(input_ids=ids, use_cache=True).past_key_values
    grow_kv_cache(cache, bb.model)
    layers = [layer for layer in cache.layers if isinstance(layer, GrowingKVLayer)]
    assert layers
    step = lambda c, x: [layer.update(x, x + 1) for layer in c.layers]  # noqa: E731

    def zero_past_fill(layer) -> bool:  # every row of both stores, spare rows too
        L = layer.keys.shape[-2]
        return not layer.keys.pema_store[:, :, L:].any() and not layer.values.pema_store[:, :, L:].any()
    first = layers[0]
    x = torch.randn(2, first.keys.shape[1], 1, first.keys.shape[-1], dtype=first.keys.dtype)
    relayout_kv_rows(cache, [1, 0], row_capacity=4)  # from the prefill's tensors: one copy, room for 4 rows
    store = first.keys.pema_store
    assert store.shape[0] == 4 and first.keys.shape[0] == 2
    step(cache, x)
    assert first.keys.pema_store is store  # the append went in place
    before = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
    views = [(layer.keys, layer.values) for layer in layers]
    relayout_kv_rows(cache, [0, 1, 1, 0], row_capacity=4)  # rows 0 and 1 stay, two parted rows appended
    assert first.keys.pema_store is store and first.keys.shape[0] == 4
    for layer, (k, v), (vk, vv) in zip(layers, before, views):
        assert torch.equal(layer.keys, k[[0, 1, 1, 0]]) and torch.equal(layer.values, v[[0, 1, 1, 0]])
        assert torch.equal(vk, k) and torch.equal(vv, v)  # the old views (a snapshot's) unchanged
        assert zero_past_fill(layer)
    step(cache, torch.cat([x, x]))
    assert first.keys.pema_store is store
    want = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
    room = store.shape[-2] - first.keys.shape[-2]
    for i in range(room + 2):  # past the block: the appends move to a bigger store, spare rows kept
        y = torch.cat([x, x]) + i
        step(cache, y)
        want = [(torch.cat([k, y], dim=2), torch.cat([v, y + 1], dim=2)) for k, v in want]
    assert first.keys.pema_store is not store and first.keys.pema_store.shape[0] == 4
    for layer, (k, v) in zip(layers, want):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        assert zero_past_fill(layer)
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
    relayout_kv_rows(cache, [3, 1], row_capacity=3)  # a row left: one copy into a new store
    assert first.keys.pema_store is not store and first.keys.pema_store.shape[0] == 3
    for layer, (k, v) in zip(layers, kept):
        assert torch.equal(layer.keys, k[[3, 1]]) and torch.equal(layer.values, v[[3, 1]])
        assert zero_past_fill(layer)
    moved = first.keys.pema_store
    step(cache, x)
    assert first.keys.pema_store is moved
    with torch.inference_mode():  # a decode's forward appends in inference mode: past the block, a new store …
        for _ in range(moved.shape[-2] - first.keys.shape[-2] + 1):
            step(cache, x)
    assert first.keys.pema_store is not moved and first.keys.pema_store.is_inference()
    inferred = first.keys.pema_store
    before = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
    relayout_kv_rows(cache, [0, 1, 0], row_capacity=3)  # … that the relayout outside it writes in place
    assert first.keys.pema_store is inferred
    for layer, (k, v) in zip(layers, before):
        assert torch.equal(layer.keys, k[[0, 1, 0]]) and torch.equal(layer.values, v[[0, 1, 0]])


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_float32_activations_decode_alike_with_the_growing_kv_cache(monkeypatch, precision):
    """float32 activations (float32, float16 weight-only on a CPU): SDPA reads the growing cache's views — the
    same tokens and scores as on transformers' concatenated cache, across a buffer's growth (memory-tuning's rows on
    it: the test above)."""
    from backbone.model import KV_BLOCK

    if precision == "float16" and not fp16_weight_available():
        pytest.skip("no FBGEMM float16 kernel")
    bb = tiny_on_decode_attention(precision)
    bb.stop_ids = set()  # every row decodes all its steps
    rows = [Row("base"), Row("again")]
    on = compare(bb, "the house is small", rows, PROMPT, max_new_tokens=KV_BLOCK + 4, trace=False)
    with using_fast_paths(growing_kv=False):
        off = compare(bb, "the house is small", rows, PROMPT, max_new_tokens=KV_BLOCK + 4, trace=False)
    assert [r.tokens for r in on.rows] == [r.tokens for r in off.rows] and len(on.rows[0].tokens) == KV_BLOCK + 4
    assert [r.score for r in on.rows] == [r.score for r in off.rows]


@pytest.mark.skipif(not fp16_weight_available(), reason="no FBGEMM float16 kernel in this torch / on this CPU")
def test_float16_padding_table_of_a_wide_layer_is_found_on_a_slice_of_its_rows(monkeypatch):
    """A layer wider than ``STEADY_ROWS_SLICE`` output rows (Gemma's LM head) finds its padding table on a slice of
    its rows: the same table as the whole weight's, and with it every row count keeps each row's bits."""
    from backbone import kernels as bm

    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=True)
    monkeypatch.setattr(bm, "_STEADY_ROWS", {})
    whole = bm.Fp16WeightLinear(lin)
    monkeypatch.setattr(bm, "_STEADY_ROWS", {})
    monkeypatch.setattr(bm, "STEADY_ROWS_SLICE", 48)
    calls = []
    real = bm.Fp16WeightLinear._product
    monkeypatch.setattr(bm.Fp16WeightLinear, "_product", lambda self, x: calls.append(1) or real(self, x))
    sliced = bm.Fp16WeightLinear(lin)
    assert len(calls) <= 8  # the whole weight only checked (its own table: 65 products)
    assert sliced.pad_to == whole.pad_to and sliced.pad_to[1] >= 1
    x = sliced._test_rows(64)
    with torch.no_grad():
        batch = sliced(x)
        assert all(torch.equal(sliced(x[:n]), batch[:n]) for n in range(1, 65))
