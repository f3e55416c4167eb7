"""Batch-invariant rows (docs/evaluation.md, "Batch-invariant rows"): a method's output for a sentence does not depend
on which other sentences or methods share its batch — the same tokens and the very same f(c) bits at every step,
alone, beside longer and shorter sentences (left padding), beside a row that brings its own prompt (the retrieved
examples: a longer context), and with other methods ticked — in the default precision of this CPU, whose linears keep
a row's bits in products of any row count (``backbone.kernels``)."""
from __future__ import annotations

import pytest
import torch

from backbone.model import DEFAULT_CPU_PRECISION, Backbone, set_precision
from backbone.padding import left_pads, positions
from backbone.prompts import Prompt
from backbone.tiny import tiny_backbone
from engine import BatchDecode, Row, plan_batch
from memories.build import build_memory
from memories.parse import Sample
from plugins.api import train_plugin
from plugins.registry import method_card

PROMPT = Prompt.for_task("translation")
PAIRS = [("the red car is fast", "das rote Auto ist schnell"), ("a blue house", "ein blaues Haus"),
         ("the dog sleeps in the garden", "der Hund schlaeft im Garten"), ("good morning", "guten Morgen"),
         ("the red car", "das rote Auto"), ("my car is very fast", "mein Auto ist sehr schnell"),
         ("the garden is green", "der Garten ist gruen"), ("hello world", "hallo Welt"),
         ("a small cat", "eine kleine Katze"), ("the cat sleeps", "die Katze schlaeft"),
         ("we read a book", "wir lesen ein Buch"), ("the book is red", "das Buch ist rot")]
SENTENCE = "the house is small"
SHORTER, LONGER = "good morning", "hello world, this is a much longer sentence with many more words in it"

pytestmark = pytest.mark.skipif(DEFAULT_CPU_PRECISION == "float32", reason=(
    "this CPU's default precision is float32, whose BLAS products round a row by the batch's row count: rows "
    "agree to float rounding only"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def bb() -> Backbone:
    t = tiny_backbone()
    return Backbone(model=set_precision(t.model, DEFAULT_CPU_PRECISION), tokenizer=t.tokenizer, name=t.name)


@pytest.fixture(scope="module")
def plugins(bb, tmp_path_factory):
    mem = build_memory(bb, [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)],
                       tmp_path_factory.mktemp("inv") / "m", prompt=PROMPT, heldout_frac=0.2)
    out = {}
    for m in ("knn", "retrieval_icl", "pema", "adapter", "memory_tuning"):
        cfg = dict(method_card(m).quick_settings)
        if m == "memory_tuning":  # the paper's unified variant: its prefix rides on the decode attention (RowKeys)
            cfg["variant"] = "MT-MF"
        out[m] = train_plugin(bb, mem, m, cfg, out_dir=tmp_path_factory.mktemp(m) / "p")[0]
    return out


def _decode(bb, sources: list[str], rows: list[Row], max_new_tokens: int = 10, use_prefix_cache: bool = True):
    """Every (source, row label): (tokens, f(c) per step), read from the decode as it runs."""
    batch = plan_batch(bb, sources, rows, PROMPT)
    run = BatchDecode(bb, batch, max_new_tokens, trace=False, use_prefix_cache=use_prefix_cache)
    fcs: dict[int, list[torch.Tensor]] = {b: [] for b in range(batch.N)}
    while True:
        for b in range(batch.N):
            if not run.beams.done[b]:
                fcs[b].append(run.row_fc(b).clone() if run.fc_last is not None else None)
        if not run.step():
            break
    out = {}
    for s, comp in enumerate(run.result()):
        for r, res in enumerate(comp.rows):
            b = s * batch.R + r
            out[(comp.source, res.label)] = (res.tokens, [f for f in fcs[b] if f is not None])
    return out


def _same(a, b, what: str) -> None:
    assert a[0] == b[0], f"{what}: other tokens"
    n = min(len(a[1]), len(b[1]))
    assert n > 0
    for i in range(n):
        assert torch.equal(a[1][i], b[1][i]), f"{what}: f(c) differs at step {i}"


def test_left_pads_and_positions_read_a_left_padded_mask():
    m = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    assert left_pads(m) == [2, 0, 1]
    assert positions(m, 2).tolist() == [[1, 2], [3, 4], [2, 3]]  # each row counted from its first real token
    assert left_pads(torch.ones(2, 4)) is None  # no padding: the model's own positions
    assert left_pads(torch.tensor([[1, 0, 1]])) is None  # a hole inside a row is not left padding


def test_a_row_decodes_alike_in_batches_of_any_composition(bb, plugins):
    """The base row, kNN and the residual adapter (an in-network plug-in) for one sentence: alone, beside a longer and
    a shorter sentence, beside the retrieved-examples row (its own, longer prompt) and memory-tuning, every method
    together — the same tokens and f(c) bits at every step. The retrieved-examples row itself decodes alike alone and
    beside the others."""
    knn, ricl, pema, adapter, mt = (plugins[m] for m in ("knn", "retrieval_icl", "pema", "adapter", "memory_tuning"))
    base, k, a, r, t, p = (Row("base"), Row("knn", knn), Row("adapter", adapter), Row("ricl", ricl),
                           Row("mt", mt), Row("pema", pema))
    alone = {lab: _decode(bb, [SENTENCE], [row])[(SENTENCE, lab)]
             for lab, row in (("base", base), ("knn", k), ("ricl", r), ("pema", p))}
    compositions = {
        "three methods": ([SENTENCE], [base, k, a]),
        "with the retrieved examples and memory-tuning": ([SENTENCE], [base, r, k, t, a]),
        "beside a longer sentence": ([LONGER, SENTENCE], [base, k, a, p]),
        "beside a shorter sentence": ([SENTENCE, SHORTER], [base, k, a, p]),
        "everything": ([SHORTER, SENTENCE, LONGER], [base, r, t, k, p, a]),
        "without the prefix cache": ([SENTENCE], [base, k, a, r]),
    }
    for what, (sources, rows) in compositions.items():
        got = _decode(bb, sources, rows, use_prefix_cache=what != "without the prefix cache")
        for lab in ("base", "knn", "ricl", "pema"):
            if (SENTENCE, lab) in got:
                _same(got[(SENTENCE, lab)], alone[lab], f"{lab} {what}")
    # the composition did pad: the longer sentence's row is the longest context, the retrieved examples' longer still
    batch = plan_batch(bb, [SENTENCE, LONGER], [base, r], PROMPT)
    assert batch.padded and len({len(c) for c in batch.prefill_contexts}) == 4


def test_the_padding_that_is_neutral_is_what_the_decode_needs(bb, monkeypatch):
    """The guard of the test above: with the forward passes left as plain masked padding (positions shifted, attention
    over the masked padding), the same sentence beside a longer one computes other f(c) bits."""
    alone = _decode(bb, [SENTENCE], [Row("base")])[(SENTENCE, "base")]
    forward_fc = Backbone.forward_fc
    monkeypatch.setattr(Backbone, "forward_fc", lambda self, *a, **kw: forward_fc(self, *a, **{
        **kw, "pad_neutral": False}))
    padded = _decode(bb, [LONGER, SENTENCE], [Row("base")])[(SENTENCE, "base")]
    assert any(not torch.equal(x, y) for x, y in zip(padded[1], alone[1]))


@pytest.mark.integration
def test_gemma_rows_decode_alike_in_an_evaluation_and_a_comparison(gemma, tmp_path):
    """On the embedded Gemma in this CPU's default precision: the base row of three sentences of different lengths
    decoded together beside the retrieved-examples row and kNN (an evaluation's batch, left-padded for both) is the
    base row of a one-sentence comparison of the base model alone — tokens and f(c) bits at every step; so are the
    retrieved-examples and kNN rows against their own one-row comparisons."""
    from backbone.tasks import task_prompt

    if gemma.device.type != "cpu":
        pytest.skip("the GPU's numbers: docs/evaluation.md, 'Batch-invariant rows'")
    prompt = task_prompt("translation", gemma)
    pairs = PAIRS + [("the children play in the park", "die Kinder spielen im Park"),
                     ("the train is late again", "der Zug ist wieder spaet")]
    mem = build_memory(gemma, [Sample(s, t, i + 1) for i, (s, t) in enumerate(pairs)], tmp_path / "m",
                       prompt=prompt, heldout_frac=0.2)
    ricl = train_plugin(gemma, mem, "retrieval_icl", {}, out_dir=tmp_path / "ricl")[0]
    knn = train_plugin(gemma, mem, "knn", {}, out_dir=tmp_path / "knn")[0]
    sources = ["The weather was cold, so we stayed inside and read books all afternoon.", "Good morning!",
               "Could not open file for reading: permission denied."]

    def decode(srcs, rows):
        batch = plan_batch(gemma, srcs, rows, prompt)
        run = BatchDecode(gemma, batch, 12, trace=False)
        fcs: dict[int, list[torch.Tensor]] = {b: [] for b in range(batch.N)}
        while True:
            if run.fc_last is not None:
                for b in range(batch.N):
                    if not run.beams.done[b]:
                        fcs[b].append(run.row_fc(b).clone())
            if not run.step():
                break
        return {(c.source, res.label): (res.tokens, fcs[s * batch.R + r])
                for s, c in enumerate(run.result()) for r, res in enumerate(c.rows)}

    together = decode(sources, [Row("base"), Row("ricl", ricl), Row("knn", knn)])
    assert plan_batch(gemma, sources, [Row("base"), Row("ricl", ricl)], prompt).padded
    for s in sources:
        for lab, row in (("base", Row("base")), ("ricl", Row("ricl", ricl)), ("knn", Row("knn", knn))):
            _same(together[(s, lab)], decode([s], [row])[(s, lab)], f"{lab} for {s!r}")
