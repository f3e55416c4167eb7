"""The decode engine's pieces alone (tiny model, hand-made tensors): token selection (greedy vs beam), one step equal
to the same step of a full decode, traces addressed by attach handle, and the one soft-cap."""
from __future__ import annotations

import math

import pytest
import torch

from backbone.prompts import Prompt
from backbone.torch_internals import forward_hook_count
from engine import (
    Beams,
    GroupAttachments,
    Row,
    compare,
    decode_loop,
    decode_step,
    forward_step,
    plan_batch,
    prefill,
    top_tokens,
)
from plugins.api import new_plugin
from plugins.knn import KNN, KNNConfig

PROMPT = Prompt.for_task("translation")
SOURCE = "the cat sleeps"
A, B_, C, STOP = 0, 1, 2, 3  # a 4-token vocabulary for the hand-made distributions


def _lp(rows: list[list[float]]) -> torch.Tensor:
    return torch.log(torch.tensor(rows))


# --- token selection -----------------------------------------------------------------------------------------------
def test_greedy_takes_the_best_token_and_a_stop_token_ends_the_row():
    beams = Beams(2, 1, stop_ids={STOP}, pad=7)
    seen = []
    tok, src = beams.select(_lp([[0.5, 0.4, 0.06, 0.04], [0.1, 0.15, 0.05, 0.7]]),
                            lambda b, t, lp: seen.append((b, t, round(lp, 4))) or {"b": b, "t": t})
    assert tok.tolist() == [A, 7] and src.tolist() == [0, 1]  # row 1 finished: it gets the pad token
    assert beams.done == [False, True] and not beams.all_done
    # the 2·B best candidates of a row get a trace item: row 1's stop (finished) and its best live token
    assert seen == [(0, A, round(math.log(0.5), 4)), (1, STOP, round(math.log(0.7), 4)),
                    (1, B_, round(math.log(0.15), 4))]
    tok, _ = beams.select(_lp([[0.25, 0.25, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]]))
    assert beams.all_done
    score, toks, trace = beams.best(0)
    assert toks == [A, STOP] and score == pytest.approx(math.log(0.5 * 0.3), abs=1e-6)
    assert trace == [{"b": 0, "t": A}]  # no item function on the second call: no trace entry
    assert beams.best(1)[1] == [STOP]


def test_beam_search_finds_what_greedy_misses():
    """a then anything: 0.5 · ≤0.3; b then stop: 0.4 · 0.9 — greedy takes a, two beams find b, stop."""
    step0 = [0.5, 0.4, 0.06, 0.04]
    after = {A: [0.25, 0.25, 0.2, 0.3], B_: [0.02, 0.02, 0.06, 0.9]}
    greedy = Beams(1, 1, {STOP})
    t, _ = greedy.select(_lp([step0]))
    greedy.select(_lp([after[int(t[0])]]))
    assert greedy.all_done and greedy.best(0)[1] == [A, STOP]

    beam = Beams(1, 2, {STOP})
    t, src = beam.select(_lp([step0, step0]))  # both beams start identical: only the first one expands
    assert t.tolist() == [A, B_] and src.tolist() == [0, 0]
    beam.select(_lp([after[A], after[B_]]))
    assert beam.all_done  # two finished hypotheses
    score, toks, _ = beam.best(0)
    assert toks == [B_, STOP] and score == pytest.approx(math.log(0.4 * 0.9), abs=1e-6)


def test_beam_search_reorders_beams_and_keeps_their_histories():
    beam = Beams(1, 2, {STOP})
    beam.select(_lp([[0.5, 0.4, 0.06, 0.04]] * 2))
    # the two best continuations (b b: 0.4 · 0.5, b c: 0.4 · 0.4) both extend beam 1 (b); a's best is 0.5 · 0.3
    t, src = beam.select(_lp([[0.3, 0.25, 0.25, 0.2], [0.04, 0.5, 0.4, 0.06]]))
    assert src.tolist() == [1, 1] and t.tolist() == [B_, C]
    assert beam.tokens == [[B_, B_], [B_, C]] and not beam.finished[0] and not beam.all_done
    assert beam.scores[0].tolist() == pytest.approx([math.log(0.2), math.log(0.16)], abs=1e-6)


# --- one step ------------------------------------------------------------------------------------------------------
def test_one_step_equals_the_step_of_a_full_decode(tiny, tiny_memory):
    knn = KNN(KNNConfig(), tiny)
    knn.fit(tiny_memory)
    # untrained, but its hooks run and trace
    mt = new_plugin("memory_tuning", tiny, tiny_memory, {"variant": "MT-MF", "slots": 4})
    rows = [Row("base"), Row("knn", knn, {"k": 4, "lambda": 0.3}), Row("mt", mt)]
    full = compare(tiny, SOURCE, rows, PROMPT, max_new_tokens=4, use_prefix_cache=False)
    batch = plan_batch(tiny, [SOURCE], rows, PROMPT)
    assert (batch.S, batch.R, batch.B, batch.G) == (1, 3, 1, 2)  # base + knn share prefill group 0
    fc, cache, mask, prefill_handles = prefill(tiny, batch, use_prefix_cache=False)
    handles = mt.attach(batch.net[0].rows, batch.net[0].settings)
    try:
        for step in range(3):
            out = decode_step(tiny, batch, fc, step, [GroupAttachments(batch.net[0], handles, prefill_handles[0])])
            for b, row in enumerate(full.rows):
                if step >= len(row.tokens):
                    continue
                want = row.trace[step]
                assert int(out.final[b].topk(1).indices) == row.tokens[step], (row.label, step)
                assert round(float(out.final[b, row.tokens[step]]), 4) == want["logprob"]
                assert top_tokens(out.final[b], tiny) == want["top_final"]
                assert top_tokens(out.lm_logprobs[b].cpu(), tiny) == want["top_lm"]
                assert out.info[b] == {k: want[k] for k in out.info[b]}
            assert "lambda" in out.info[1] and "memory_attention" in out.info[2] and not out.info[0]
            nxt = torch.tensor([r.tokens[step] if step < len(r.tokens) else 0 for r in full.rows])
            fc, cache, mask = forward_step(tiny, cache, mask, nxt)
    finally:
        for h in handles:
            h.remove()
    assert not forward_hook_count(tiny.model)


@pytest.mark.parametrize("beams,guard", [(1, 0), (2, 2)])
def test_decode_loop_around_the_local_forward_pass_decodes_as_compare(tiny, tiny_memory, beams, guard):
    """``decode_loop`` takes the forward pass as a function (offsite's remote backbone); around the local one
    (``prefill`` + ``forward_step``) it decodes what ``compare`` decodes."""
    knn = KNN(KNNConfig(), tiny)
    knn.fit(tiny_memory)
    rows = [Row("base"), Row("knn", knn, {"k": 4, "lambda": 0.3})]
    full = compare(tiny, SOURCE, rows, PROMPT, max_new_tokens=6, num_beams=beams, use_prefix_cache=False,
                   no_repeat_ngram=guard)
    batch = plan_batch(tiny, [SOURCE], rows, PROMPT, beams, comparison={"no_repeat_ngram": guard})
    fc, cache, mask, _ = prefill(tiny, batch, use_prefix_cache=False)
    state = {"cache": cache, "mask": mask}

    def forward(last, next_tok, src, beams_):
        assert last[1] is None  # P_LM is computed from f(c) by the loop itself
        fc_next, state["cache"], state["mask"] = forward_step(tiny, state["cache"], state["mask"], next_tok,
                                                              src if batch.B > 1 else None)
        return fc_next, None

    calls = []
    counted = lambda *a: calls.append(1) or forward(*a)  # noqa: E731
    got = decode_loop(tiny, batch, (fc, None), counted, max_new_tokens=6)[0]
    # one forward pass between two selected tokens, none after the last (an offsite session's step budget)
    assert len(calls) == got.steps - 1 <= 5
    for a, b in zip(got.rows, full.rows):
        assert a.tokens == b.tokens and a.text == b.text and a.settings == b.settings, a.label
        assert a.score == pytest.approx(b.score, abs=2e-4), a.label
        assert [e["token"] for e in a.trace] == [e["token"] for e in b.trace], a.label


# --- traces by handle ------------------------------------------------------------------------------------------------
def test_network_trace_is_addressed_by_handle_not_by_call_order(tiny, tiny_memory):
    mt = new_plugin("memory_tuning", tiny, tiny_memory, {"variant": "MT-MF", "slots": 4})
    ids = torch.tensor([tiny.encode_context(PROMPT.render(s))[-6:] for s in ("a b c", "hello world", "good day")])
    h1 = mt.attach(torch.tensor([0]), {"scale": 1.0})
    h2 = mt.attach(torch.tensor([1, 2]), {"scale": 0.5})
    try:
        assert mt.network_trace(h1) is None  # no forward pass yet
        with torch.no_grad():
            tiny.forward_fc(ids)
        t2, t1, t2_again = mt.network_trace(h2), mt.network_trace(h1), mt.network_trace(h2)
    finally:
        for h in h1 + h2:
            h.remove()
    assert set(t1) == {0} and set(t2) == {0, 1} and t2 == t2_again
    assert t2[0]["weights"] != t2[1]["weights"]  # rows 1 and 2 of the batch, in h2's own order
    assert mt.network_trace(h1) == t1  # still readable after remove()


# --- the one soft-cap ------------------------------------------------------------------------------------------------
def test_every_head_product_goes_through_one_softcap(tiny, monkeypatch):
    x = torch.randn(3, tiny.hidden_size)
    plain = tiny.head_logits(x)
    assert tiny.softcap is None and torch.equal(tiny.softcap_logits(plain), plain)
    monkeypatch.setattr(tiny, "softcap", 2.0)
    capped = tiny.head_logits(x)
    assert torch.allclose(capped, torch.tanh(plain / 2.0) * 2.0) and float(capped.abs().max()) <= 2.0
    vocab = torch.tensor([1, 5, 9])
    sub = tiny.head_logits_subset(x, vocab)
    assert torch.allclose(sub[:, vocab], capped[:, vocab])


def test_top_k_equals_a_stable_full_sort_on_vocabulary_sized_rows():
    """``top_k`` (two stages over chunks for long rows) gives exactly the first k of a stable descending sort — values
    and indices, ties broken by the lower index — on rows with many ties and −inf entries, 1-D and 2-D."""
    from engine import top_k

    g = torch.Generator().manual_seed(0)
    for trial in range(24):
        V, R, k = 20_000 + 7_919 * trial, 1 + trial % 3, [1, 2, 5, 64][trial % 4]
        x = torch.randn(R, V, generator=g)
        if trial % 2:
            x = x.to(torch.bfloat16).float()  # bfloat16 logits: many exact ties
        if trial % 3 == 0:
            x[:, torch.randint(0, V, (V // 2,), generator=g)] = float("-inf")
        if trial % 8 == 7:
            x = torch.full((R, V), float("-inf"))
            x[:, 5:8] = 1.0  # fewer finite entries than k, all tied
        ref_v, ref_i = torch.sort(x, dim=-1, descending=True, stable=True)
        v, i = top_k(x, k)
        assert torch.equal(v, ref_v[:, :k]) and torch.equal(i, ref_i[:, :k]), trial
        v1, i1 = top_k(x[0], k)
        assert torch.equal(v1, ref_v[0, :k]) and torch.equal(i1, ref_i[0, :k])


def test_output_group_rows_read_as_a_slice_when_consecutive():
    """A step reads an output-level group's P_LM rows as a view when they are consecutive (no indexed copy of
    vocabulary-wide rows), as an index otherwise."""
    import torch

    from engine import OutGroup

    assert OutGroup(None, torch.tensor([2, 3, 4]), [], []).row_index == slice(2, 5)
    scattered = OutGroup(None, torch.tensor([1, 3]), [], []).row_index
    assert isinstance(scattered, torch.Tensor) and scattered.tolist() == [1, 3]
