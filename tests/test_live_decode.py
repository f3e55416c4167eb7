"""Slider moves that re-decode only what changed, and streamed decodes, on the tiny backbone.

The reuse path (``engine.LiveComparison``) must give, token for token, what a full re-decode gives, for
every live setting of every method that has live settings, over many random moves; a move that changes no token
runs no backbone forward pass. A decode run step by step streams each row's tokens as a growing prefix of the
batch decode's output, and its end is the batch decode's output.
"""
from __future__ import annotations

import random
import time

import pytest
import torch
from _server import build_tiny_memory, tiny_studio

from backbone.prompts import Prompt
from backbone.torch_internals import forward_hook_count
from engine import BatchDecode, DecodeRun, LiveComparison, Row, compare, decode_batch, plan_batch, start_compare
from plugins.api import new_plugin
from plugins.knn import KNN, KNNConfig
from plugins.registry import available_methods

PROMPT = Prompt.for_task("translation")
SOURCE = "the cat sleeps"


@pytest.fixture(scope="module")
def plugins(tiny, tiny_memory):
    knn = KNN(KNNConfig(), tiny)
    knn.fit(tiny_memory)
    pema = new_plugin("pema", tiny, tiny_memory, {"seed": 1})  # untrained, random B: P_PEMA is far from P_LM
    pema_cand = new_plugin("pema", tiny, tiny_memory, {"seed": 2})
    pema_cand.candidates = torch.arange(0, tiny.vocab_size, 3)  # a restricted vocabulary: the head-subset path
    mt = new_plugin("memory_tuning", tiny, tiny_memory, {"variant": "MT-MF", "slots": 4})  # in-network, no live knobs
    return {"knn": knn, "pema": pema, "pema_cand": pema_cand, "mt": mt}


class ForwardCounter:
    """Counts the backbone's forward passes (``forward_fc``: prefill and every step's pass)."""

    def __init__(self, backbone, monkeypatch):
        self.n = 0
        inner = backbone.forward_fc

        def counted(*a, **k):
            self.n += 1
            return inner(*a, **k)

        monkeypatch.setattr(backbone, "forward_fc", counted)


def _live_settings() -> dict[str, list]:
    """Every method's live settings (its declarations: what the Compare tab shows as controls)."""
    return {m: [s for s in cls.decode_settings if s.live] for m, cls in available_methods().items()
            if any(s.live for s in cls.decode_settings)}


def _random_value(s, rng: random.Random):
    if s.kind is bool:
        return rng.random() < 0.5
    if s.kind is int:
        return rng.randint(int(s.low), int(s.high))
    step = s.step or 0.05
    n = int(round((s.high - s.low) / step))
    return round(s.low + step * rng.randint(0, n), 6)


def _rows(plugins, settings: dict[str, dict]) -> list[Row]:
    return [Row("base"), Row("pema", plugins["pema"], settings.get("pema", {})),
            Row("pema (candidates)", plugins["pema_cand"], settings.get("pema_cand", {})),
            Row("knn", plugins["knn"], settings.get("knn", {})), Row("mt", plugins["mt"])]


def _same(a, b, what: str) -> None:
    for ra, rb in zip(a.rows, b.rows):
        assert ra.tokens == rb.tokens, (what, ra.label)
        assert ra.text == rb.text and ra.settings == rb.settings, (what, ra.label)
        assert ra.score == pytest.approx(rb.score, abs=2e-4), (what, ra.label)
        assert len(ra.trace) == len(rb.trace), (what, ra.label)
        for ea, eb in zip(ra.trace, rb.trace):
            assert ea.keys() == eb.keys(), (what, ra.label)
            assert ea["token"] == eb["token"] and ea.get("lambda") == eb.get("lambda"), (what, ra.label)
            assert ea["logprob"] == pytest.approx(eb["logprob"], abs=2e-4), (what, ra.label)
            assert [t for t, _, _ in ea["top_final"]] == [t for t, _, _ in eb["top_final"]], (what, ra.label)
            assert [t for t, _, _ in ea["top_lm"]] == [t for t, _, _ in eb["top_lm"]], (what, ra.label)
            if "top_plugin" in eb:
                assert [t for t, _, _ in ea["top_plugin"]] == [t for t, _, _ in eb["top_plugin"]], (what, ra.label)


def _run(run) -> tuple:
    while run.step():
        pass
    return run.result()[0]


@pytest.mark.parametrize("guard", [0, 2])
def test_slider_moves_equal_a_full_redecode_and_a_no_change_move_runs_no_forward(tiny, plugins, monkeypatch, guard):
    live_settings = _live_settings()
    assert set(live_settings) == {"pema", "knn"}  # every method with live settings is covered below
    rng = random.Random(7 + guard)
    counter = ForwardCounter(tiny, monkeypatch)
    settings: dict[str, dict] = {"pema": {}, "pema_cand": {}, "knn": {}}
    first = start_compare(tiny, SOURCE, _rows(plugins, settings), PROMPT, max_new_tokens=12, no_repeat_ngram=guard)
    assert isinstance(first, BatchDecode)
    prev = _run(first)
    live = first.live()
    assert isinstance(live, LiveComparison)
    kinds = {"reuse": 0, "no change": 0, "token change": 0}
    for n in range(12):
        key = rng.choice(["pema", "pema_cand", "knn"])
        s = rng.choice(live_settings["knn" if key == "knn" else "pema"])
        settings = {k: dict(v) for k, v in settings.items()}
        settings[key][s.name] = _random_value(s, rng)
        rows = _rows(plugins, settings)
        counter.n = 0
        run = start_compare(tiny, SOURCE, rows, PROMPT, max_new_tokens=12, no_repeat_ngram=guard, live=live)
        assert not isinstance(run, BatchDecode), f"move {n} ({key}.{s.name}) fell back to a full decode"
        assert isinstance(run, DecodeRun)  # driven as a full decode is: step, partial, result, live
        got = _run(run)
        reuse_forwards = counter.n
        want = compare(tiny, SOURCE, _rows(plugins, settings), PROMPT, max_new_tokens=12, no_repeat_ngram=guard)
        _same(got, want, f"move {n}: {key}.{s.name}={settings[key][s.name]}")
        kinds["reuse"] += 1
        if all(a.tokens == b.tokens for a, b in zip(got.rows, prev.rows)):
            assert reuse_forwards == 0, f"move {n} changed no token but ran {reuse_forwards} forward passes"
            kinds["no change"] += 1
        else:
            assert reuse_forwards < 12  # never the prefill; a change at the last step may need no pass at all
            kinds["token change"] += 1
        prev = got
    assert kinds["no change"] >= 2 and kinds["token change"] >= 2, kinds  # both paths were exercised


def test_a_move_back_and_forth_and_the_kept_cache_is_untouched(tiny, plugins):
    rows = _rows(plugins, {"knn": {"lambda": 0.0}})
    first = start_compare(tiny, SOURCE, rows, PROMPT, max_new_tokens=10)
    base = _run(first)
    live = first.live()
    for lam in (1.0, 0.0, 1.0):
        got = _run(start_compare(tiny, SOURCE, _rows(plugins, {"knn": {"lambda": lam}}), PROMPT, max_new_tokens=10,
                                 live=live))
        want = compare(tiny, SOURCE, _rows(plugins, {"knn": {"lambda": lam}}), PROMPT, max_new_tokens=10)
        _same(got, want, f"λ={lam}")
    assert got.row("knn").tokens != base.row("knn").tokens  # the move did change that row


def test_a_row_that_finished_early_resumes_from_its_kept_cache(tiny, plugins):
    """In the compact layout a finished row leaves the cache; the comparison keeps that row's cache as it was, and a
    move that changes one of its tokens re-decodes from there exactly as a full decode does."""
    first = start_compare(tiny, SOURCE, _rows(plugins, {"knn": {"lambda": 0.9}}), PROMPT, max_new_tokens=24)
    base = _run(first)
    knn = [r.label for r in base.rows].index("knn")
    assert len(base.rows[knn].tokens) < 24 <= max(len(r.tokens) for r in base.rows)  # kNN finished before the rest
    assert knn in first.finished_caches
    live = first.live()
    assert live.caches[knn] == first.finished_caches[knn] and live.caches[knn][0] is not first.cache
    moved = 0
    for lam in (0.85, 0.7, 0.5, 0.9):
        got = _run(start_compare(tiny, SOURCE, _rows(plugins, {"knn": {"lambda": lam}}), PROMPT, max_new_tokens=24,
                                 live=live))
        _same(got, compare(tiny, SOURCE, _rows(plugins, {"knn": {"lambda": lam}}), PROMPT, max_new_tokens=24),
              f"λ={lam}")
        moved += got.rows[knn].tokens != base.rows[knn].tokens
    assert moved >= 1


def test_what_is_not_a_slider_move_decodes_in_full(tiny, plugins):
    first = start_compare(tiny, SOURCE, _rows(plugins, {}), PROMPT, max_new_tokens=8)
    _run(first)
    live = first.live()
    for kw in ({"max_new_tokens": 9}, {"no_repeat_ngram": 2}, {"num_beams": 2}):
        args = {"max_new_tokens": 8, **kw}
        assert isinstance(start_compare(tiny, SOURCE, _rows(plugins, {}), PROMPT, live=live, **args), BatchDecode)
    assert isinstance(start_compare(tiny, "the house is small", _rows(plugins, {}), PROMPT, max_new_tokens=8,
                                    live=live), BatchDecode)
    # a changed setting of an in-network plug-in (not an interpolating one) → full decode
    rows = _rows(plugins, {})
    rows[-1] = Row("mt", plugins["mt"], {"scale": 0.5})
    assert isinstance(start_compare(tiny, SOURCE, rows, PROMPT, max_new_tokens=8, live=live), BatchDecode)


# --- streaming ---------------------------------------------------------------------------------------------------
def test_streamed_decode_grows_token_by_token_and_ends_as_the_batch_decode(tiny, plugins):
    rows = _rows(plugins, {})
    batch = plan_batch(tiny, [SOURCE], rows, PROMPT)
    dec = BatchDecode(tiny, batch, max_new_tokens=12)
    seen = []
    while True:
        more = dec.step()
        seen.append([r.tokens for r in dec.partial()[0].rows])
        if not more:
            break
    assert all(len(t) == 1 for t in seen[0])  # the first step already shows a token of every row
    for a, b in zip(seen, seen[1:]):
        for ta, tb in zip(a, b):
            assert tb[:len(ta)] == ta  # each row's output only grows
    full = decode_batch(tiny, [SOURCE], _rows(plugins, {}), PROMPT, max_new_tokens=12)[0]
    _same(dec.result()[0], full, "streamed vs batch")


def test_a_stopped_decode_leaves_no_hook_attached(tiny, plugins):
    batch = plan_batch(tiny, [SOURCE], _rows(plugins, {}), PROMPT)
    dec = BatchDecode(tiny, batch, max_new_tokens=12)
    assert dec.step() and dec.step()
    assert not forward_hook_count(tiny.model)  # between steps: nothing attached
    part = dec.partial()[0]
    assert all(len(r.tokens) == 2 for r in part.rows)


# --- the compact layout: rows that agree share the forward pass, finished rows leave it ---------------------------
@pytest.mark.parametrize("sources,beams,guard", [(1, 1, 0), (1, 1, 2), (2, 1, 0), (1, 2, 0), (2, 3, 2)])
def test_the_compact_layout_decodes_as_one_row_per_batch_row(tiny, plugins, monkeypatch, sources, beams, guard):
    """``BatchDecode``'s compact layout (``compact``: one cache row per distinct live batch row) gives every row
    the tokens, scores and trace that one cache row per batch row gives — and does run fewer rows."""
    srcs = [SOURCE, "a dog barks at the moon"][:sources]
    rows = _rows(plugins, {"knn": {"lambda": 0.6}}) + [Row("mt again", plugins["mt"])]  # two rows of one mt group
    widths = []
    inner = tiny.forward_fc
    monkeypatch.setattr(tiny, "forward_fc", lambda ids, **k: widths.append(ids.shape[0]) or inner(ids, **k))
    results = {}
    for on in (False, True):
        widths.clear()
        results[on] = decode_batch(tiny, srcs, rows, PROMPT, max_new_tokens=14, num_beams=beams, no_repeat_ngram=guard,
                                   compact=on)
        if on:
            N = sources * len(rows) * beams
            # the prefill runs one row per source and prefill group; the steps run at most N rows, and fewer once
            # the base, PEMA and kNN rows share one or rows have finished
            assert widths[0] == sources * 2 and max(widths[1:]) <= N and min(widths[1:]) < N, widths
        else:
            assert set(widths[1:]) == {sources * len(rows) * beams}
    for a, b in zip(results[True], results[False]):
        _same(a, b, f"compact, {sources} sources, {beams} beams")
        for ra, rb in zip(a.rows, b.rows):  # (float32 products over other row counts may round differently)
            for ea, eb in zip(ra.trace, rb.trace):  # the in-network rows' memory attention, step by step
                ma, mb = ea.get("memory_attention"), eb.get("memory_attention")
                assert (ma is None) == (mb is None) == (ra.method not in ("memory_tuning",)), ra.label
                if ma is not None:
                    assert [t for t, _ in ma["top"]] == [t for t, _ in mb["top"]], ra.label
                    assert ma["weights"] == pytest.approx(mb["weights"], abs=1e-3), ra.label


# --- the studio: kept comparisons, streaming, Stop -----------------------------------------------------------------
PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3


@pytest.fixture(scope="module")
def studio_knn(tmp_path_factory):
    st = tiny_studio(tmp_path_factory.mktemp("live-data"))
    job = st.jobs.wait(st.plugin_service.submit_train(build_tiny_memory(st, PAIRS, "live pairs"), "knn", {}, "kNN"),
                       120)
    assert job["state"] == "done", job
    yield st, job["result"]["plugin_id"]
    st.close()


def _texts(p):
    return [(r["label"], r["tokens"], r["text"]) for r in p["rows"]]


def test_studio_slider_move_reuses_and_equals_a_fresh_decode(studio_knn):
    st, knn_id = studio_knn
    args = dict(methods=["base", knn_id], max_new_tokens=10)
    first = st.compare_service.compare(SOURCE, settings={"knn": {"lambda": 0.3}}, **args)
    assert first["timings"]["reuse"]["kind"] == "full decode"
    moved = st.compare_service.compare(SOURCE, settings={"knn": {"lambda": 0.9}}, **args)
    assert moved["timings"]["reuse"]["kind"] == "slider move"
    same = st.compare_service.compare(SOURCE, settings={"knn": {"lambda": 0.9}}, **args)
    assert same["timings"]["reuse"] == {"kind": "slider move", "forward_passes": 0,
                                        "reused_steps": sum(len(r["tokens"]) for r in same["rows"])}
    st.store.forget_live()  # nothing kept: a full decode
    fresh = st.compare_service.compare(SOURCE, settings={"knn": {"lambda": 0.9}}, **args)
    assert fresh["timings"]["reuse"]["kind"] == "full decode"
    assert _texts(moved) == _texts(same) == _texts(fresh)
    assert [r["trace"] for r in moved["rows"]][1][0]["lambda"] == 0.9


def test_a_streamed_slider_move_says_so_while_it_decodes(studio_knn):
    """The Compare view's header read "One batched decode" while a move's tokens streamed in, and "Re-decoded …
    from the kept decode" only at its end: every partial payload of a move now carries the move's reuse."""
    st, knn_id = studio_knn
    args = dict(methods=["base", knn_id], max_new_tokens=10)
    st.compare_service.compare(SOURCE, settings={"knn": {"lambda": 0.0}}, **args)
    items = list(st.compare_service.compare_stream(SOURCE, settings={"knn": {"lambda": 1.0}}, **args))
    partials = [p for p in items if p.get("partial")]
    assert partials, "the move changed no token: pick settings that do"
    assert all(p["timings"]["reuse"]["kind"] == "slider move" for p in items)
    assert items[-1]["timings"]["reuse"]["forward_passes"] >= partials[-1]["timings"]["reuse"]["forward_passes"]


def test_studio_stream_ends_as_compare_and_stop_ends_it(studio_knn, monkeypatch):
    st, knn_id = studio_knn
    args = dict(methods=["base", knn_id], settings={"knn": {"k": 3}}, max_new_tokens=12)
    st.store.forget_live()
    want = st.compare_service.compare(SOURCE, **args)
    st.store.forget_live()
    items = list(st.compare_service.compare_stream(SOURCE, stream="tab-1", **args))
    assert all(p["partial"] and not p["cancelled"] for p in items[:-1]) and "partial" not in items[-1]
    assert _texts(items[-1]) == _texts(want)
    assert all(len(r["tokens"]) == 1 for r in items[0]["rows"])  # the first update after one step
    # Stop, and a newer decode of the same tab, end a running decode between two steps
    bb = st.backbone_service.backbone()
    monkeypatch.setattr(bb, "stop_ids", set())  # no row ends early: the decode runs to its token limit
    slow = bb.forward_fc

    def slow_forward(*a, **k):
        time.sleep(0.05)
        return slow(*a, **k)

    monkeypatch.setattr(bb, "forward_fc", slow_forward)
    long = dict(args, max_new_tokens=60)
    run = st.compare_service.compare_stream("hello world", stream="tab-1", **long)
    assert next(run)["partial"]
    st.compare_service.cancel_compare(stream="tab-1")
    rest = list(run)
    assert rest[-1]["cancelled"] and len(rest[-1]["rows"][0]["tokens"]) < 60
    older = st.compare_service.compare_stream("good morning", stream="tab-2", **long)
    assert next(older)["partial"]
    newer = st.compare_service.compare_stream("good morning", stream="tab-2", **dict(long, max_new_tokens=5))
    first_new = next(newer)  # starting it stops the older one (which holds the backbone) after its step
    assert list(older)[-1]["cancelled"]
    final = [first_new, *newer][-1]
    assert "partial" not in final and len(final["rows"][0]["tokens"]) == 5
