"""One base per comparison (studio.compare_service.CompareService.base_prompt): the prompt every row without its own
reads is chosen explicitly (the built-in examples or a memory's own), said in the payload and in shares, and is the
same whatever else is ticked; a row that brings its own prompt (the retrieved examples) changes no other row."""
from __future__ import annotations

import pytest
from _server import build_tiny_memory, tiny_studio

from ground.errors import UserError

SOURCE = "the house is small"
# enough distinct training samples that the memory's prompt holds its own examples (not the built-in ones)
PAIRS = [("the red car is fast", "das rote Auto ist schnell"), ("a blue house", "ein blaues Haus"),
         ("the dog sleeps in the garden", "der Hund schlaeft im Garten"), ("good morning", "guten Morgen"),
         ("the red car", "das rote Auto"), ("my car is very fast", "mein Auto ist sehr schnell"),
         ("the garden is green", "der Garten ist gruen"), ("hello world", "hallo Welt"),
         ("a small cat", "eine kleine Katze"), ("the cat sleeps", "die Katze schlaeft"),
         ("we read a book", "wir lesen ein Buch"), ("the book is red", "das Buch ist rot"),
         ("the children play", "die Kinder spielen"), ("the train is late", "der Zug ist spaet"),
         ("I like green tea", "ich mag gruenen Tee"), ("the window is open", "das Fenster ist offen")]


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    st = tiny_studio(tmp_path_factory.mktemp("prompt"))
    mid = build_tiny_memory(st, PAIRS)
    ids = {}
    for method in ("knn", "retrieval_icl"):
        job = st.jobs.wait(st.plugin_service.submit_train(mid, method, {}, method), 120)
        assert job["state"] == "done", job
        ids[method] = job["result"]["plugin_id"]
    formal = st.jobs.wait(st.memory_service.submit_build("hey there\tHello.\nthanks a lot\tThank you.\n" * 3, "f.tsv",
                                                         name="formal", task="formality"), 120)
    assert formal["state"] == "done", formal
    yield st, mid, ids, formal["result"]["memory_id"]
    st.close()


def _base(p: dict) -> dict:
    return next(r for r in p["rows"] if r["method"] == "base")


@pytest.mark.parametrize("chosen", ["builtin", "memory"])
def test_the_chosen_prompt_is_every_rows_whatever_is_ticked(studio, chosen):
    st, mid, ids, _formal = studio
    prompt_from = mid if chosen == "memory" else "builtin"
    ticks = [["base"], ["base", ids["knn"]], ["base", ids["retrieval_icl"]], ["base", ids["knn"], ids["retrieval_icl"]]]
    runs = [st.compare_service.compare(SOURCE, methods=m, prompt_from=prompt_from, max_new_tokens=6) for m in ticks]
    first = runs[0]
    assert first["prompt_source"]["kind"] == ("memory" if chosen == "memory" else "builtin")
    assert first["prompt_source"]["memory_id"] == (mid if chosen == "memory" else None)
    for p in runs:
        assert p["prompt_source"] == first["prompt_source"]
        assert p["prompt"] == first["prompt"] and p["context_ids"] == first["context_ids"]
        assert _base(p)["tokens"] == _base(first)["tokens"]
        for r in p["rows"]:  # the retrieved examples bring their own prompt; every other row reads the chosen one
            assert (r["prompt"] is not None) == (r["method"] == "retrieval_icl"), r["label"]


def test_auto_reads_the_first_plugins_memory_and_says_so(studio):
    """Without a choice (the API's default) the comparison reads the first chosen plug-in's memory, else the built-in
    examples: the two differ, which is why the page pins the first comparison's choice."""
    st, mid, ids, _formal = studio
    alone = st.compare_service.compare(SOURCE, methods=["base"], max_new_tokens=4)
    with_knn = st.compare_service.compare(SOURCE, methods=["base", ids["knn"]], max_new_tokens=4)
    assert alone["prompt_source"]["kind"] == "builtin" and alone["prompt_source"]["label"].startswith("built-in")
    assert with_knn["prompt_source"] == {**with_knn["prompt_source"], "kind": "memory", "memory_id": mid}
    assert "pairs" in with_knn["prompt_source"]["label"]  # the memory's name, in the owner's view
    assert alone["prompt"]["examples"] != with_knn["prompt"]["examples"]  # the memory's own examples
    assert alone["context_ids"] != with_knn["context_ids"]


def test_a_share_says_which_prompt_without_naming_the_memory(studio):
    st, mid, ids, _formal = studio
    p = st.compare_service.compare(SOURCE, methods=["base", ids["retrieval_icl"]], prompt_from=mid, max_new_tokens=4)
    shared = st.compare_service.shared(st.compare_service.share(p["id"]))
    assert shared["base_examples"] == {"kind": "memory", "count": p["prompt_source"]["examples"]}
    assert [r["own_examples"] for r in shared["rows"]] == [False, True]
    assert mid not in str(shared) and "pairs" not in str(shared["base_examples"])
    assert "prompt" not in str(shared)  # never the prompt (tests/test_owners.py), nor a key that reads like it


def test_a_bad_prompt_choice_is_a_clear_error(studio):
    st, _mid, _ids, formal = studio
    with pytest.raises(UserError, match="formality examples, not translation"):
        st.compare_service.compare(SOURCE, methods=["base"], prompt_from=formal)
    with pytest.raises(UserError, match="No memory"):
        st.compare_service.compare(SOURCE, methods=["base"], prompt_from="nope")
    with pytest.raises(UserError, match="prompt must be"):
        st.compare_service.compare(SOURCE, methods=["base"], prompt_from=["builtin"])


def _evaluated(st, **kw) -> dict:
    job = st.jobs.wait(st.evaluate_service.submit_evaluate(limit=3, max_new_tokens=6, **kw), 120)
    assert job["state"] == "done", job
    return job["result"]


@pytest.mark.parametrize("chosen", ["builtin", "memory"])
def test_evaluate_and_several_sentences_read_the_chosen_prompt(studio, chosen):
    """Evaluate and several sentences take Compare's choice: their base row is Compare's base row with that prompt,
    though without a choice they would read the other one (the memory's with kNN ticked, the built-in alone)."""
    st, mid, ids, _formal = studio
    prompt_from = mid if chosen == "memory" else "builtin"
    methods = ["base", ids["knn"]] if chosen == "builtin" else ["base"]
    res = _evaluated(st, methods=methods, memory_id=mid, prompt_from=prompt_from)
    assert res["prompt_source"]["kind"] == chosen
    assert res["prompt_source"]["memory_id"] == (mid if chosen == "memory" else None)
    sources = [o["source"] for o in res["outputs"]]
    compared = [_base(st.compare_service.compare(s, methods=["base"], prompt_from=prompt_from,
                                                 max_new_tokens=6))["text"]
                for s in sources]
    assert [o["Base model"] for o in res["outputs"]] == compared
    several = st.compare_service.compare_several("\n".join(sources), methods=methods, prompt_from=prompt_from,
                                                 max_new_tokens=6)
    assert several["prompt_source"] == res["prompt_source"]
    assert [ln["outputs"][0] for ln in several["lines"]] == compared
    auto = _evaluated(st, methods=methods, memory_id=mid)  # the choice is what moved it
    assert auto["prompt_source"]["kind"] != chosen


def test_evaluate_refuses_a_bad_prompt_choice_when_queued(studio):
    st, mid, _ids, formal = studio
    with pytest.raises(UserError, match="formality examples, not translation"):
        st.evaluate_service.submit_evaluate(methods=["base"], memory_id=mid, prompt_from=formal)
    with pytest.raises(UserError, match="No memory"):
        st.evaluate_service.submit_evaluate(methods=["base"], memory_id=mid, prompt_from="nope")


def test_the_page_passes_the_prompt_choice_to_evaluate_and_several_sentences(studio):
    """The Evaluate tab's picker and Compare's reach the services (the events' handlers, called as the page
    calls them)."""
    from _server import fn_indexes

    from ui.app import build_app

    st, mid, _ids, _formal = studio
    blocks = build_app(st)

    def call(module: str, name: str, **values):
        fn = blocks.fns[fn_indexes(blocks, module, name)[0]]
        args = [values.get(getattr(c, "elem_id", None), c.value) for c in fn.inputs]
        return fn.fn(None, *args), [getattr(c, "elem_id", None) for c in fn.inputs]

    html, ids = call("ui.several", "do_several", **{"several-input": SOURCE, "compare-prompt": mid})  # (base alone)
    assert "compare-prompt" in ids and "pairs&#x27;s own examples" in html
    out, ids = call("ui.evaluate", "do_run", **{"eval-memory": mid, "eval-prompt": mid})  # (the base alone)
    assert "eval-prompt" in ids
    job = st.jobs.wait(out[0], 120)
    assert job["state"] == "done" and job["result"]["prompt_source"]["kind"] == "memory", job
