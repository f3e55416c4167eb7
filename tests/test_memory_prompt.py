"""A memory's prompt takes its few-shot examples from the memory's own training samples (never held-out ones) when
it has enough, records where they came from, and plug-ins train and decode with it; a memory built before the record
keeps the prompt it was built with."""
from __future__ import annotations

import json

import pytest
from _server import build_tiny_memory, tiny_studio

from backbone.tasks import FEW_SHOT, task_prompt
from memories.build import OWN_EXAMPLES_MIN_SAMPLES, build_memory, choose_prompt_examples
from memories.parse import Sample
from memories.store import Memory
from plugins.api import train_plugin
from plugins.base import load_plugin

PAIRS = [("the red car is fast", "das rote Auto ist schnell"), ("a blue house", "ein blaues Haus"),
         ("the dog sleeps in the garden", "der Hund schlaeft im Garten"), ("good morning", "guten Morgen"),
         ("the red car", "das rote Auto"), ("my car is very fast", "mein Auto ist sehr schnell"),
         ("the garden is green", "der Garten ist gruen"), ("hello world", "hallo Welt"),
         ("a small cat", "eine kleine Katze"), ("the cat sleeps", "die Katze schlaeft"),
         ("we read a book", "wir lesen ein Buch"), ("the book is red", "das Buch ist rot"),
         ("the house is small", "das Haus ist klein"), ("it rains today", "es regnet heute")]


def samples(pairs):
    return [Sample(s, t, i + 1) for i, (s, t) in enumerate(pairs)]


def test_the_choice_is_the_training_samples_nearest_the_median_length_one_per_source():
    srcs = ["a b c", "a", "a b c d e f g h", "a b", "x y z", "a b c", "p q r s", "one\ntwo three", "k l m", "u v",
            "w x y z"]
    tgts = ["t"] * len(srcs)
    synthetic = [False] * len(srcs)
    synthetic[8] = True  # a model-made source is never an example
    train = [i for i in range(len(srcs)) if i != 4]  # sample 4 is held out
    # usable: 0 (3 words), 1, 2, 3, 6, 9, 10 (5 repeats 0's source; 7 has two lines); median length 3 words
    assert choose_prompt_examples(srcs, tgts, synthetic, train, 3) == [0, 3, 6]
    assert choose_prompt_examples(srcs, tgts, synthetic, train, 3) == choose_prompt_examples(
        srcs, tgts, synthetic, list(train), 3)  # deterministic
    assert choose_prompt_examples(srcs, tgts, synthetic, train, 6) == []  # 7 usable < 2 × 6: too few
    assert choose_prompt_examples(srcs, tgts, synthetic, train[:OWN_EXAMPLES_MIN_SAMPLES - 1], 2) == []
    assert choose_prompt_examples(srcs, tgts, synthetic, train, 0) == []


@pytest.fixture(scope="module")
def own_memory(tiny, tmp_path_factory):
    return build_memory(tiny, samples(PAIRS), tmp_path_factory.mktemp("own") / "m", prompt=task_prompt("translation",
                                                                                                       tiny))


def test_a_memory_built_from_own_samples_records_its_examples(own_memory):
    rec = own_memory.prompt_examples
    assert rec["source"] == "own" and len(rec["samples"]) == 3
    train = {(s["src"], s["tgt"]) for s in own_memory.split_samples("train")}
    held = {(s["src"], s["tgt"]) for s in own_memory.split_samples("heldout")}
    examples = own_memory.prompt.examples
    assert len(examples) == 3 and set(examples) <= train and not set(examples) & held
    assert [own_memory.samples[i]["src"] for i in rec["samples"]] == [s for s, _ in examples]
    assert [PAIRS[line - 1][0] for line in rec["lines"]] == [s for s, _ in examples]
    assert own_memory.prompt.template == task_prompt("translation", None).template  # the task's format, kept


def test_a_reloaded_plugin_decodes_with_the_memorys_prompt(tiny, own_memory, tmp_path):
    from engine import Row, compare

    plugin, _ = train_plugin(tiny, own_memory, "knn", {}, out_dir=tmp_path / "knn")
    loaded = load_plugin(tmp_path / "knn", tiny)
    assert loaded.memory_meta["prompt"] == own_memory.meta["prompt"]
    prompt = own_memory.prompt
    got = compare(tiny, "the red car", [Row("knn", loaded)], prompt, max_new_tokens=4)
    assert got.context_ids == tiny.encode_context(prompt.render("the red car"))


def test_too_few_samples_or_given_keep_the_prompts_examples(tiny, tmp_path):
    few = build_memory(tiny, samples(PAIRS[:6]), tmp_path / "few", prompt=task_prompt("translation", tiny))
    assert few.prompt_examples["source"] == "builtin" and "fewer than" in few.prompt_examples["reason"]
    assert few.prompt.examples == [tuple(e) for e in FEW_SHOT["translation"][:3]]
    given = build_memory(tiny, samples(PAIRS), tmp_path / "given", prompt=task_prompt("translation", tiny),
                         examples="given")
    assert given.prompt_examples == {"source": "given"}
    assert given.prompt.examples == [tuple(e) for e in FEW_SHOT["translation"][:3]]


def test_an_old_memory_without_the_record_keeps_its_built_in_prompt(tiny, tmp_path):
    mem = build_memory(tiny, samples(PAIRS), tmp_path / "old", prompt=task_prompt("translation", tiny),
                       examples="given")
    meta = json.loads((mem.path / "meta.json").read_text())
    del meta["prompt_examples"]  # as written before the record existed
    (mem.path / "meta.json").write_text(json.dumps(meta))
    old = Memory.load(mem.path, tiny)
    assert old.prompt_examples == {"source": "builtin"}
    assert old.prompt.examples == [tuple(e) for e in FEW_SHOT["translation"][:3]]
    train_plugin(tiny, old, "retrieval_icl", {}, out_dir=tmp_path / "p")
    assert load_plugin(tmp_path / "p", tiny).memory_meta["prompt"] == meta["prompt"]


def test_the_studio_builds_with_own_examples_and_compare_uses_them(tmp_path):
    st = tiny_studio(tmp_path / "studio")
    try:
        mid = build_tiny_memory(st, pairs=PAIRS, name="own examples")
        mem = Memory.load(st.catalog.memory(mid)["path"])
        assert mem.prompt_examples["source"] == "own"
        job = st.jobs.wait(st.plugin_service.submit_train(mid, "retrieval_icl", {}, "nearest"), 120)
        assert job["state"] == "done", job
        p = st.compare_service.compare("the red car", methods=["base", job["result"]["plugin_id"]], max_new_tokens=3)
        assert [tuple(e) for e in p["prompt"]["examples"]] == mem.prompt.examples
        base, nearest = p["rows"]
        assert [base["method"], nearest["method"]] == ["base", "retrieval_icl"]
        # the owner sees the row's own prompt (the retrieved examples); its attention map reads that context
        train = {(s["src"], s["tgt"]) for s in mem.split_samples("train")}
        assert base["prompt"] is None and nearest["prompt"]["examples"][-1] == ["the red car", "das rote Auto"]
        assert all(tuple(e) in train for e in nearest["prompt"]["examples"])
        att = st.compare_service.attention(p, nearest["label"])
        assert len(att["matrix"]) == len(nearest["tokens"])
        # a share never holds a prompt (the memory's samples)
        shared = st.compare_service.shared(st.compare_service.share(p["id"]))
        assert "the red car is fast" not in json.dumps(shared) and "das rote Auto" not in json.dumps(shared)
    finally:
        st.close()
