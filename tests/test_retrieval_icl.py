"""Retrieved in-context examples (plugins/retrieval_icl.py): BM25 and the n-gram coverage re-ranking on hand-made
cases, the row's prompt (the nearest training samples, never held-out ones), and the row decoding in one batch with
other methods exactly as it decodes alone — and as the base model decodes with that prompt."""
from __future__ import annotations

import pytest

from backbone.prompts import Prompt
from engine import Row, compare, decode_batch, plan_batch
from memories.build import build_memory
from memories.parse import Sample
from plugins.api import method_table, train_plugin
from plugins.base import load_plugin
from plugins.retrieval_icl import BM25Index, rerank_by_coverage, words

PAIRS = [("the red car is fast", "das rote Auto ist schnell"), ("a blue house", "ein blaues Haus"),
         ("the dog sleeps in the garden", "der Hund schlaeft im Garten"), ("good morning", "guten Morgen"),
         ("the red car", "das rote Auto"), ("my car is very fast", "mein Auto ist sehr schnell"),
         ("the garden is green", "der Garten ist gruen"), ("hello world", "hallo Welt"),
         ("a small cat", "eine kleine Katze"), ("the cat sleeps", "die Katze schlaeft"),
         ("we read a book", "wir lesen ein Buch"), ("the book is red", "das Buch ist rot")]
PROMPT = Prompt.for_task("translation")


def test_bm25_ranks_by_source_similarity():
    docs = [words(d) for d in ("the red car", "a blue house", "red car red car wash", "the house", "blue sky")]
    idx = BM25Index(docs)
    assert idx.top(words("a red car"), 10)[:2] == [2, 0]  # both words, twice and once; then "a" only
    assert set(idx.top(words("a red car"), 10)) == {0, 1, 2}  # documents without a shared word are never returned
    assert idx.top(words("blue house"), 1) == [1]
    assert idx.top(words("nothing shared"), 5) == []


def test_reranking_covers_the_inputs_ngrams_and_stops_when_nothing_new_is_covered():
    docs = [words(d) for d in ("the red car", "a car is very fast", "the the the", "car is fast")]
    query = words("the red car is fast")
    # "the red car" and "car is fast" each cover the most; a tie goes to the better BM25 rank (first in the list)
    assert rerank_by_coverage(query, docs, [0, 1, 2, 3], 3)[0] == 0
    assert rerank_by_coverage(query, docs, [3, 1, 2, 0], 3)[0] == 3
    # after "the red car", "car is fast" covers more of what is left than "a car is very fast"; then only "red car
    # is" and the 4-grams are left, which no candidate has: the selection stops short of k
    assert rerank_by_coverage(query, docs, [0, 1, 2, 3], 4) == [0, 3]
    assert rerank_by_coverage(query, docs, [0, 1, 2], 4) == [0, 1]


@pytest.fixture(scope="module")
def memory(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("ricl") / "m"
    return build_memory(tiny, [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)], out, prompt=PROMPT,
                        heldout_frac=0.2)


@pytest.fixture(scope="module")
def plugin(tiny, memory, tmp_path_factory):
    out = tmp_path_factory.mktemp("ricl-p") / "p"
    p, row = train_plugin(tiny, memory, "retrieval_icl", {}, out_dir=out)
    assert row["params"] == 0
    return p, out


def test_the_rows_prompt_holds_the_nearest_training_samples_never_held_out_ones(memory, plugin):
    p, _ = plugin
    held = [(s["src"], s["tgt"]) for s in memory.split_samples("heldout")]
    train = [(s["src"], s["tgt"]) for s in memory.split_samples("train")]
    assert held and p.train_info["pool"] == len(train)
    settings = p.settings({"k": 3})
    for src, _tgt in held + train:  # a held-out input: its own pair is not in the pool, so never an example
        prompt = p.row_prompt(src, PROMPT, settings)
        assert prompt.template == PROMPT.template and len(prompt.examples) <= 3
        assert all(e in train for e in prompt.examples)
        assert not any(e in held for e in prompt.examples)
    # a training sample's own pair is its nearest neighbour: chosen first, so it stands next to the input
    src = max((s for s, _ in train), key=lambda s: len(words(s)))  # the split decides which samples train
    assert p.row_prompt(src, PROMPT, settings).examples[-1][0] == src
    rendered = p.row_prompt(src, PROMPT, settings).render(src)
    assert rendered.endswith(PROMPT.template.format(src=src))


def test_without_fill_the_selection_may_be_shorter_and_fill_tops_up_from_the_prompt(plugin):
    p, _ = plugin
    own = Prompt(template=PROMPT.template, examples=[("x one", "y one"), ("x two", "y two")])
    lonely = "zebra quartz"  # no word in common with the pool: nothing retrieved
    assert p.row_prompt(lonely, own, p.settings({"k": 2, "fill": False})).examples == []
    assert p.row_prompt(lonely, own, p.settings({"k": 2})).examples == own.examples


def top_ids(row) -> list[list[int]]:
    """Each step's top-5 tokens of P_LM: the tiny model's greedy tokens hardly depend on the prompt, their runners-up
    do."""
    return [[t[0] for t in e["top_lm"]] for e in row.trace]


def test_the_row_decodes_in_one_batch_as_alone_and_as_the_base_model_with_its_prompt(tiny, memory, plugin):
    p, path = plugin
    from plugins.registry import method_card

    knn, _ = train_plugin(tiny, memory, "knn", {}, out_dir=path.parent / "knn")
    adapter, _ = train_plugin(tiny, memory, "adapter", dict(method_card("adapter").quick_settings),
                              out_dir=path.parent / "adapter")
    src = "the red car sleeps"
    alone = compare(tiny, src, [Row("ricl", p)], PROMPT, max_new_tokens=8).rows[0]
    batched = compare(tiny, src, [Row("base"), Row("knn", knn), Row("ricl", p), Row("adapter", adapter)], PROMPT,
                      max_new_tokens=8)
    assert batched.rows[2].tokens == alone.tokens and top_ids(batched.rows[2]) == top_ids(alone)
    # an in-network row in the same (now left-padded) batch also decodes as alone
    single = compare(tiny, src, [Row("adapter", adapter)], PROMPT, max_new_tokens=8).rows[0]
    assert batched.rows[3].tokens == single.tokens and top_ids(batched.rows[3]) == top_ids(single)
    assert batched.rows[2].prompt["examples"] and batched.rows[0].prompt is None
    own = p.row_prompt(src, PROMPT, p.settings())
    as_base = compare(tiny, src, [Row("base")], own, max_new_tokens=8).rows[0]
    assert alone.tokens == as_base.tokens and top_ids(alone) == top_ids(as_base)
    base = compare(tiny, src, [Row("base")], PROMPT, max_new_tokens=8).rows[0]
    assert top_ids(batched.rows[0]) == top_ids(base) != top_ids(alone)  # the base row keeps the comparison's prompt
    # the batch gave the row a prefill row of its own, from its own context
    plan = plan_batch(tiny, [src], [Row("base"), Row("ricl", p)], PROMPT)
    assert plan.G == 2 and plan.padded and plan.prefill_contexts[1] == tiny.encode_context(own.render(src))
    # several sources in one batch: each row as in its own single decode
    srcs = ["the red car sleeps", "a book in the garden"]
    many = decode_batch(tiny, srcs, [Row("base"), Row("ricl", p)], PROMPT, max_new_tokens=8)
    for s, comp in zip(srcs, many):
        single = compare(tiny, s, [Row("ricl", p)], PROMPT, max_new_tokens=8).rows[0]
        assert comp.rows[1].tokens == single.tokens and top_ids(comp.rows[1]) == top_ids(single)


def test_a_saved_plugin_reloads_its_pool_and_prompts_the_same(tiny, plugin):
    p, path = plugin
    loaded = load_plugin(path, tiny)
    s = loaded.settings()
    assert loaded.row_prompt("the red car", PROMPT, s).to_dict() == p.row_prompt("the red car", PROMPT, s).to_dict()
    assert (path / "retrieval_index.json").is_file() and not list(path.glob("*.pkl"))


def test_a_damaged_pool_is_refused(tiny, plugin, tmp_path):
    import json
    import shutil

    from ground.errors import UserError
    from plugins.base import file_sha256

    _p, path = plugin
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    (copy / "retrieval_index.json").write_text(json.dumps({"format": 1, "pool": [{"src": 1}]}))
    cfg = json.loads((copy / "plugin_config.json").read_text())  # a consistent checksum: the shape check refuses
    cfg["files"]["retrieval_index.json"]["sha256"] = file_sha256(copy / "retrieval_index.json")
    (copy / "plugin_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="damaged"):
        load_plugin(copy, tiny).prepare_decode()


def test_it_is_a_registered_method_with_no_training():
    row = next(m for m in method_table() if m["method"] == "retrieval_icl")
    assert row["level"] == "prompt" and row["decode"]["k"] == 4 and row["decode"]["candidates"] == 100


def test_evaluate_scores_it_as_a_row_like_any_other(tiny, plugin):
    from eval.run import evaluate

    p, _ = plugin
    pairs = PAIRS[:3]
    res = evaluate(tiny, pairs, [Row("base"), Row("ricl", p)], PROMPT, "translation", batch_sources=2,
                   max_new_tokens=6)
    assert [m["label"] for m in res["methods"]] == ["base", "ricl"]
