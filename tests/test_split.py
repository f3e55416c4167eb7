"""Held-out samples like new inputs: near-duplicate sources (word 1–3-gram Jaccard ≥ 0.5) are grouped exactly and each
group lands wholly on one side of a memory's split; the split's distance profile is recorded (and computed for a
memory built before, which keeps its random split); the transfer check compares a user's inputs with the held-out
samples."""
from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from backbone.prompts import Prompt
from memories.build import build_memory, grouped_heldout_split, heldout_split
from memories.nearness import NEAR_DUPLICATE, NgramIndex, jaccard, near_duplicate_groups, ngrams, transfer_check
from memories.parse import Sample
from memories.store import Memory

WORDS = ("file open read write could not the a directory server database connection table index user "
         "password invalid failed error value column row lock timeout backup restore").split()


def random_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n)]


def planted_corpus(n_base: int = 120, seed: int = 1) -> list[str]:
    """Distinct random sentences, a third of them with one or two near-duplicates (one word changed or added)."""
    rng = random.Random(seed)
    out = []
    for i, s in enumerate(random_sentences(n_base, seed)):
        out.append(f"{s} number{i}")
        if i % 3 == 0:
            for _ in range(rng.randint(1, 2)):
                w = out[-1].split()
                w[rng.randrange(len(w) - 1)] = f"changed{rng.randint(0, 9)}"
                out.append(" ".join(w))
    rng.shuffle(out)
    return out


def brute_groups(texts, t):
    sets = [ngrams(x) for x in texts]
    parent = list(range(len(texts)))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i
    for i, j in itertools.combinations(range(len(texts)), 2):
        if jaccard(sets[i], sets[j]) >= t:
            parent[max(find(i), find(j))] = min(find(i), find(j))
    return [find(i) for i in range(len(texts))]


def same_partition(a, b) -> bool:
    return {frozenset(i for i, g in enumerate(a) if g == x) for x in a} == \
        {frozenset(i for i, g in enumerate(b) if g == x) for x in b}


def test_ngrams_and_jaccard_count_word_1_to_3_grams():
    assert ngrams("Could not open file") == {"could", "not", "open", "file", "could not", "not open", "open file",
                                             "could not open", "not open file"}
    assert jaccard(ngrams("Could not open file"), ngrams("could not open directory.")) == pytest.approx(0.5)
    assert jaccard(ngrams("a b"), ngrams("c d")) == 0.0


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.8])
def test_near_duplicate_groups_are_exactly_the_brute_force_ones(threshold):
    texts = planted_corpus(60) + random_sentences(40, seed=7) + ["", "", "same words", "same words"]
    assert same_partition(near_duplicate_groups(texts, threshold), brute_groups(texts, threshold))


def test_nearest_is_the_brute_force_nearest():
    train, queries = random_sentences(200, 3), random_sentences(30, 4) + ["nothing shared here"]
    sims, best = NgramIndex(train).nearest(queries)
    for q, s, b in zip(queries, sims, best):
        expect = max(jaccard(ngrams(q), ngrams(t)) for t in train)
        assert s == pytest.approx(expect)
        if expect > 0:
            assert jaccard(ngrams(q), ngrams(train[b])) == pytest.approx(expect)
    assert sims[-1] == 0.0 and best[-1] == -1


def cross_split_near_duplicates(texts, held) -> int:
    train = [t for i, t in enumerate(texts) if i not in held]
    sims = NgramIndex(train).nearest([texts[i] for i in sorted(held)])[0]
    return int((sims >= NEAR_DUPLICATE).sum())


def test_planted_near_duplicates_never_straddle_the_grouped_split_but_do_the_random_one():
    texts = planted_corpus()
    held, info = grouped_heldout_split(texts, frac=0.2, seed=5)
    assert len(held) == len(heldout_split(len(texts), 0.2, 5))  # as many held out as before
    assert cross_split_near_duplicates(texts, set(held.tolist())) == 0
    assert info["method"] == "grouped" and info["grouped_samples"] > 0 and info["groups"] < len(texts)
    # the old random split of the same corpus does put near-duplicates across (what the grouping prevents)
    assert cross_split_near_duplicates(texts, set(heldout_split(len(texts), 0.2, 5).tolist())) > 0


def test_without_near_duplicates_the_split_is_the_random_one():
    texts = [f"sentence number{i} about topic{i}" for i in range(50)]
    held, info = grouped_heldout_split(texts, frac=0.1, seed=123)
    assert held.tolist() == heldout_split(50, 0.1, 123).tolist() and info["largest_group"] == 1


def test_when_no_group_fits_the_smallest_is_held_out_whole():
    texts = ["the house is small", "the cat sleeps", "good morning", "hello world"] * 3
    held, _ = grouped_heldout_split(texts, frac=0.1)
    assert len(held) == 3 and len({texts[i] for i in held}) == 1
    assert cross_split_near_duplicates(texts, set(held.tolist())) == 0


@pytest.fixture(scope="module")
def planted_memory(tiny, tmp_path_factory):
    texts = planted_corpus(60)
    samples = [Sample(t, t.upper(), i + 1) for i, t in enumerate(texts)]
    return build_memory(tiny, samples, tmp_path_factory.mktemp("split") / "m", prompt=Prompt.for_task("translation"),
                        heldout_frac=0.2)


def test_a_memory_built_from_planted_near_duplicates_has_none_across_its_split(planted_memory):
    train = [s["src"] for s in planted_memory.split_samples("train")]
    held = [s["src"] for s in planted_memory.split_samples("heldout")]
    assert len(held) >= 10
    sims = NgramIndex(train).nearest(held)[0]
    assert (sims >= NEAR_DUPLICATE).sum() == 0
    split = planted_memory.split
    assert split["method"] == "grouped" and "note" not in split
    assert split["heldout_profile"]["n"] == len(held)
    assert split["heldout_profile"]["median"] == pytest.approx(float(np.median(sims)), abs=1e-3)
    assert split["heldout_profile"]["share_near_duplicate"] == 0.0


def test_a_memory_built_before_keeps_its_random_split_and_says_so(planted_memory, tmp_path, capsys):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(planted_memory.path, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["split"]
    (old / "meta.json").write_text(json.dumps(meta))
    before = [s["split"] for s in Memory.load(old).samples]
    mem = Memory.load(old)
    assert [s["split"] for s in mem.samples] == before
    assert mem.split["method"] == "random" and "keeps its random split" in mem.split["note"]
    assert mem.split["heldout_profile"] == planted_memory.split["heldout_profile"]  # computed from its samples

    from memories.__main__ import main
    assert main(["inspect", str(old), "--samples", "0"]) == 0
    out = capsys.readouterr().out
    assert '"method": "random"' in out and "Held-out sources" in out and "keeps its random split" in out


def test_the_memory_profile_reports_the_split(planted_memory):
    from memories.profile import memory_profile

    prof = memory_profile(planted_memory, sample=50)
    assert prof["split"]["method"] == "grouped" and prof["split"]["heldout_profile"]["n"] > 0


def test_transfer_check_says_when_inputs_are_farther_than_the_heldout_samples():
    train = planted_corpus(60)
    near = [t + " again" for t in train[:20]]  # near-duplicates of training sources
    far = random_sentences(20, seed=99)
    check = transfer_check(train, near, far)
    assert check["farther"] and check["inputs"]["median"] < check["heldout"]["median"]
    assert "farther from the memory than its held-out samples" in check["text"]
    same = transfer_check(train, near, [t + " too" for t in train[20:40]])
    assert not same["farther"] and "about as near" in same["text"]
