"""Memory-augmented adapter (Xu et al.) and its multi-granular phrase memory, on the tiny backbone."""
import re

import pytest
import torch

from backbone.torch_internals import forward_hook_count
from ground.errors import UserError

FOX = "The quick brown fox jumps over the lazy dog in the park."
GOLD_DE = "Es war noch nie leicht, ein rationales Gespräch über den Wert von Gold zu führen."
# 12 steps on the tiny model: a high constant rate (the paper's 2e-4 with warmup + decay would barely move it)
FAST = {"max_minutes": 0.5, "max_epochs": 4, "lr": 3e-2, "lr_schedule": "constant", "batch_size": 4, "eval_every": 3,
        "max_translate": 16}


def _words(p):
    return len(re.findall(r"\w+", p))


# --- phrases -------------------------------------------------------------------------------------------------------
def test_english_phrases_subtrees_words_and_max_len():
    from memories.phrases import english_parser, english_phrases

    if english_parser() is None:
        pytest.skip("spaCy English model not installed")
    ph = english_phrases(FOX)
    for want in ("The quick brown fox", "over the lazy dog in the park", "the lazy dog in the park", "in the park",
                 "jumps over the lazy dog in the park", "fox", "dog", "park", "jumps"):
        assert want in ph, want
    assert "the" not in ph and "." not in ph and "over" not in ph  # no lone function words / punctuation
    assert all(_words(p) <= 8 for p in ph)
    assert FOX.rstrip(".") not in ph  # 12 words > 8
    short = english_phrases(FOX, max_len=4)
    assert all(_words(p) <= 4 for p in short)
    assert "The quick brown fox" in short and "in the park" in short
    assert "over the lazy dog in the park" not in short


def test_german_chunker():
    from memories.phrases import chunk_phrases, is_english

    ph = chunk_phrases(GOLD_DE, max_len=10)
    for want in ("ein rationales Gespräch", "über den Wert", "von Gold", "über den Wert von Gold", "Gespräch", "Gold",
                 "zu führen"):
        assert want in ph, want
    assert not any("," in p or "." in p.rstrip(".")[-1:] for p in ph)  # never across punctuation
    assert "den" not in ph and "von" not in ph  # lone marker words are not phrases
    assert all(_words(p) <= 10 for p in ph)
    assert all(_words(p) <= 3 for p in chunk_phrases(GOLD_DE, max_len=3))
    assert not is_english([GOLD_DE]) and is_english([FOX])


def _fake_back_translation(monkeypatch, pattern, table, calls):
    """Replace the backbone's greedy generation in phrases.py by a table lookup of the phrase in the reverse
    prompt (the test fails if the phrase is not rendered with ``pattern``, i.e. not back-translated)."""
    import memories.phrases as ph

    def fake_generate(backbone, contexts, max_new_tokens=64, batch_size=8, progress=None):
        outs = []
        for c in contexts:
            phrase = re.search(pattern, backbone.decode(c)).group(1)
            calls.append(phrase)
            outs.append(backbone.encode_target(" " + table.get(phrase, "xyz")))
        return outs

    monkeypatch.setattr(ph, "generate_greedy", fake_generate)  # the name phrases.py calls


def test_phrase_pairing_target_phrases_back_translated_exact_fuzzy_back_identity(tiny, monkeypatch):
    """Paper: phrases come from the TARGET sentences and are back-translated into the source language; the source
    side is the back-translation's span in the real source (exact / fuzzy), else the back-translation itself."""
    from backbone.prompts import Prompt
    from memories.phrases import extract_phrase_pairs, normalize

    table = {"Das kleine Haus steht": "the small house stands", "in dem Garten": "in the gardens",
             "Haus": "house", "schwarze": "black", "Katze": "dog", "Garten": "",
             "kleine": "a b c d e f g h"}  # 8 words for 1: fails the length filter
    calls = []
    _fake_back_translation(monkeypatch, r"German: (.*)\nEnglish:$", table, calls)
    garden = ("The small house stands in the garden.", "Das kleine Haus steht in dem Garten.")
    cat = ("The black cat sleeps.", "Die schwarze Katze schläft.")
    samples = [{"src": s, "tgt": t} for s, t in (garden, cat, garden)]
    stats = {}
    pairs = extract_phrase_pairs(tiny, samples, Prompt.for_task("translation"), indices=[5, 6, 7], stats=stats)
    got = {(p.src, p.tgt, p.match) for p in pairs}
    assert ("The small house stands", "Das kleine Haus steht", "exact") in got  # cut from the real source
    assert ("in the garden", "in dem Garten", "fuzzy") in got  # "in the gardens" ≈ the source span
    assert ("house", "Haus", "exact") in got and ("black", "schwarze", "exact") in got
    assert ("dog", "Katze", "back") in got  # not in the source: the back-translation itself (paper)
    assert ("Garten", "Garten", "identity") in got and ("kleine", "kleine", "identity") in got  # unusable
    by_sample = {5: garden[1], 6: cat[1]}
    assert all(p.tgt in by_sample[p.sample_index] for p in pairs)  # every target phrase is cut from a target
    assert not any(normalize(p.tgt) == normalize(by_sample[p.sample_index]) for p in pairs)  # never the answer
    assert not any(p.match == "sentence" for p in pairs)  # whole sentences are off by default
    assert all(_words(p.tgt) <= 10 for p in pairs) and all(p.length == _words(p.tgt) for p in pairs)
    assert len(calls) == len(set(calls))  # each unique phrase back-translated once
    assert "Die schwarze Katze schläft" not in calls  # the whole target is never a phrase
    assert stats["pairs"] == len(pairs) and stats["extractor"] == "marker-chunker"
    assert stats["phrase_side"] == "target" and stats["target_language"] == "other"
    with_sent = extract_phrase_pairs(tiny, samples, Prompt.for_task("translation"), indices=[5, 6, 7],
                                     whole_sentences=True)
    sent = [p for p in with_sent if p.match == "sentence"]
    assert len(sent) == 2 and {p.sample_index for p in sent} == {5, 6}  # repeated sample kept once
    capped = extract_phrase_pairs(tiny, samples, Prompt.for_task("translation"), max_pairs=3, max_translate=2,
                                  whole_sentences=True)
    assert len(capped) == 3 and sum(p.match == "sentence" for p in capped) == 2


def test_english_targets_are_parsed_and_back_translated_with_the_tasks_reverse_prompt(tiny, monkeypatch):
    from backbone.prompts import Prompt
    from memories.phrases import english_parser, extract_phrase_pairs

    if english_parser() is None:
        pytest.skip("spaCy English model not installed")
    calls = []
    _fake_back_translation(monkeypatch, r"Shakespeare: (.*)\nModern:$", {"The quick brown fox": "a fast fox"},
                           calls)
    samples = [{"src": "a fast fox jumps over a dog in a park", "tgt": FOX}]
    stats = {}
    pairs = extract_phrase_pairs(tiny, samples, Prompt.for_task("style"), task="style", max_translate=100,
                                 stats=stats)
    tgts = {p.tgt for p in pairs}
    assert stats["extractor"].startswith("spacy") and stats["target_language"] == "en"
    assert {"The quick brown fox", "in the park", "fox"} <= tgts and all(_words(t) <= 8 for t in tgts)
    assert ("a fast fox", "The quick brown fox", "exact") in {(p.src, p.tgt, p.match) for p in pairs}


def test_allocation_short_to_long():
    from plugins.memory_adapter import allocate
    from plugins.network import parse_layers

    lengths = [5, 1, 3, 8, 2, 13]
    a = allocate(lengths, [0, 1, 2])
    assert a == {0: [1, 4], 1: [2, 0], 2: [3, 5]}
    assert allocate(lengths, [0, 1, 2], "long_to_short") == {0: [3, 5], 1: [2, 0], 2: [1, 4]}
    assert allocate([4, 2], [0, 1, 2, 3]) == {0: [1], 3: [0]}
    assert parse_layers("top:2", 18) == [16, 17] and parse_layers("every:6", 18) == [5, 11, 17]
    assert parse_layers("0, 3", 4) == [0, 3] and parse_layers("all", 3) == [0, 1, 2]


# --- the plug-in ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def untrained(tiny, tiny_memory):
    from plugins.api import new_plugin

    p = new_plugin("memory_adapter", tiny, tiny_memory, FAST)
    p.build_memory(tiny_memory)
    return p


@pytest.fixture(scope="module")
def trained(tiny, tiny_memory):
    from plugins.api import new_plugin

    p = new_plugin("memory_adapter", tiny, tiny_memory, FAST)
    result = p.fit(tiny_memory)
    return p, result


def _train_logprobs(tiny, memory, plugin):
    from plugins.seqtrain import collate, memory_sequences, target_logits

    data = memory_sequences(tiny, memory, "train")
    ids, mask, labels = collate(tiny, data, range(len(data)))
    handles = plugin.attach(torch.arange(len(data))) if plugin is not None else []
    try:
        with torch.no_grad():
            lp = torch.log_softmax(target_logits(tiny, ids, mask).float(), -1)
    finally:
        for h in handles:
            h.remove()
    sel = labels != -100
    return lp, lp[sel].gather(1, labels[sel][:, None])[:, 0]


def test_phrase_memory_holds_no_training_answer_by_default(untrained, tiny_memory):
    """The paper's memory is target phrases only: no item's target is a whole training target sentence."""
    from memories.phrases import normalize

    answers = {normalize(s["tgt"]) for s in tiny_memory.split_samples("train")}
    assert untrained.phrases and not any(normalize(p["tgt"]) in answers for p in untrained.phrases)
    assert not any(p["match"] == "sentence" for p in untrained.phrases)
    assert untrained.phrase_stats["phrase_side"] == "target"


def test_training_sample_never_attends_to_its_own_sentence_entry(tiny, tiny_memory, monkeypatch):
    """With ``whole_sentences`` on, each training sample's own sentence item gets attention weight exactly 0 in
    every adapter, position and pass (full and memory-dropped; also the early-stopping NLL), while other samples do
    attend to it — so a sample can never read its own answer out of the memory."""
    from memories.phrases import normalize
    from plugins.api import new_plugin
    from plugins.memory_adapter import LayerBlock
    from plugins.seqtrain import collate, memory_sequences

    p = new_plugin("memory_adapter", tiny, tiny_memory, {**FAST, "whole_sentences": True})
    p.build_memory(tiny_memory)
    sent = [i for i, ph in enumerate(p.phrases) if ph["match"] == "sentence"]
    assert len(sent) >= 2
    rows = tiny_memory.split_samples("train")
    data = memory_sequences(tiny, tiny_memory, "train")
    ids, mask, labels = collate(tiny, data, range(len(data)))
    seen = []
    orig = LayerBlock.apply

    def spy(self, a, prep, keep=None, exclude=None):
        out, info = orig(self, a, prep, keep, exclude)
        seen.append((self, info))
        return out, info

    monkeypatch.setattr(LayerBlock, "apply", spy)
    p.config.memory_dropout = 1.0  # every sequence draws a drop, so the second pass has every row, in order
    p._own = p._own_sentence_tables(tiny_memory)  # what train_adapters' prepare sets
    try:
        with torch.no_grad():
            p.train_batch_loss(ids, mask, labels)  # doubled batch: rows b and b + B are sample b
            n_train_pass = len(seen)
            p.hooked_seq_loss(ids, mask, labels)  # the early-stopping NLL
    finally:
        p._own = None
    assert n_train_pass == len(p.adapted_layers) and len(seen) == 2 * n_train_pass
    layer_of = {id(b): int(k) for k, b in p.blocks.items()}
    own_checked = other_positive = 0
    for blk, info in seen:
        ids_l = blk.phrase_ids.tolist()
        for side, (att, _g) in info.items():
            for r in range(att.shape[0]):
                answer = normalize(rows[r % len(rows)]["tgt"])
                for j, g in enumerate(ids_l):
                    if g not in sent:
                        continue
                    w = att[r, :, j]
                    if normalize(p.phrases[g]["tgt"]) == answer:
                        assert float(w.abs().max()) == 0.0, (layer_of[id(blk)], side, r, p.phrases[g])
                        own_checked += 1
                    else:
                        other_positive += bool((w > 0).all())
    assert own_checked > 0 and other_positive > 0
    # outside training (decoding) nothing is masked
    assert p._exclusion(labels) is None


@pytest.mark.parametrize("layers,full", [("all", True), ("all", False), ("top:1", False)])
def test_second_pass_only_for_dropped_sequences_is_the_doubled_batch(tiny, tiny_memory, layers, full):
    """The objective runs the dropped-memory pass only for the sequences that drew a drop; loss, parts and
    gradients equal the paper's doubled batch (every sequence twice), on whole sequences and on prepared batches
    (with ``layers="top:1"`` the frozen layer below runs once per batch)."""
    import torch.nn.functional as F

    from plugins.api import new_plugin
    from plugins.seqtrain import memory_sequences

    p = new_plugin("memory_adapter", tiny, tiny_memory, {**FAST, "layers": layers, "memory_dropout": 0.3})
    p.build_memory(tiny_memory)
    with torch.no_grad():  # a trained-looking adapter: the gates let the memory in
        for prm in p.parameters():
            prm.add_(torch.randn_like(prm) * 0.05)
    data = memory_sequences(tiny, tiny_memory, "train")
    tb = p.training_batches(data, fallback_full=full)
    batch = max((tb[i] for i in range(len(tb))), key=lambda b: b.size)
    assert batch.size >= 3 and type(batch).__name__ == ("FullBatch" if full else "PreparedBatch")
    params = p._trainable()
    for prm in params:
        prm.requires_grad_(True)
    cfg = p.config
    for seed in range(4):
        p._drop_rng = torch.Generator().manual_seed(seed)
        loss, K, parts = p.train_batch_loss(batch)
        got = torch.autograd.grad(loss, params)
        # the reference: every sequence twice, the drop drawn the same way
        B, L = batch.size, len(p.adapted_layers)
        drop = torch.rand(B, L, generator=torch.Generator().manual_seed(seed)) < cfg.memory_dropout
        keep = torch.cat([torch.ones(B, L, dtype=torch.bool), ~drop])
        labels = torch.cat([batch.labels, batch.labels])
        fc = p.batch_fc(batch, 2, keep=keep)
        sel = labels != -100
        lp = torch.log_softmax(p.target_logits(fc[sel]), -1)
        y = labels[sel]
        k = len(y) // 2
        nll, nll_drop = F.nll_loss(lp[:k], y[:k]), F.nll_loss(lp[k:], y[k:])
        kl = 0.5 * ((lp[:k].exp() - lp[k:].exp()) * (lp[:k] - lp[k:])).sum(-1).mean()
        want_loss = nll + cfg.alpha * nll_drop + cfg.beta * kl
        want = torch.autograd.grad(want_loss, params)
        assert K == k
        assert 0 < int(drop.any(1).sum()) or seed  # some seed draws a drop
        for name, a, b in (("loss", loss, want_loss), ("nll", parts["nll"], nll),
                           ("nll_dropped", parts["nll_dropped"], nll_drop), ("kl", parts["kl"], kl)):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (name, seed, float(a), float(b))
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-6)


def test_memory_items_and_untrained_adapter_is_nearly_identity(tiny, tiny_memory, untrained):
    p = untrained
    assert p.adapted_layers == [0, 1]
    n = sum(int(b.mem_tgt.shape[0]) for b in p.blocks.values())
    assert n == len(p.phrases) == len(p.phrase_texts()) >= 4
    lengths = [ph["length"] for ph in p.phrases]
    assert lengths == sorted(lengths)  # short to long, lowest layer first
    assert all(torch.isfinite(b.mem_src).all() and b.mem_src.abs().sum() > 0 for b in p.blocks.values())
    base, _ = _train_logprobs(tiny, tiny_memory, None)
    adapted, _ = _train_logprobs(tiny, tiny_memory, p)
    assert float((adapted - base).abs().max()) < 0.1
    assert torch.equal(adapted.argmax(-1), base.argmax(-1))


def test_training_lowers_loss_and_raises_reference_probability(tiny, tiny_memory, trained):
    p, result = trained
    hist = [h["heldout_loss"] for h in result.history if "heldout_loss" in h]
    assert min(hist[1:]) < hist[0]
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert losses[-1] < losses[0]
    assert {"nll", "nll_dropped", "kl"} <= set(next(h for h in result.history if "loss" in h))
    _, ref_base = _train_logprobs(tiny, tiny_memory, None)
    _, ref_trained = _train_logprobs(tiny, tiny_memory, p)
    assert float(ref_trained.mean()) > float(ref_base.mean()) + 0.1
    assert p.trainable_parameters() == 2 * 2 * (5 * 64 * 64 + 64 + 1)
    assert all(not q.requires_grad for q in p.parameters())


def test_save_load_round_trip(tiny, tiny_memory, trained, tmp_path):
    from plugins.base import load_plugin

    p, _ = trained
    p.save(tmp_path / "ma")
    q = load_plugin(tmp_path / "ma", tiny)
    assert q.method == "memory_adapter" and q.adapted_layers == p.adapted_layers
    assert q.phrase_texts() == p.phrase_texts()
    a, _ = _train_logprobs(tiny, tiny_memory, p)
    b, _ = _train_logprobs(tiny, tiny_memory, q)
    assert torch.equal(a, b)


def test_batched_compare_matches_single_rows(tiny, tiny_memory, trained):
    from backbone.prompts import Prompt
    from engine import Row, compare
    from plugins.api import new_plugin

    p, _ = trained
    knn = new_plugin("knn", tiny, tiny_memory)
    knn.fit(tiny_memory)
    prompt = Prompt.for_task("translation")
    rows = [Row("base"), Row("ma", p), Row("knn", knn), Row("ma-hot", p, {"temperature": 2.0})]
    src = "the house is small"
    batched = compare(tiny, src, rows, prompt=prompt, max_new_tokens=8)
    for r in rows:
        single = compare(tiny, src, [r], prompt=prompt, max_new_tokens=8)
        assert batched.row(r.label).tokens == single.rows[0].tokens, r.label
        assert batched.row(r.label).score == pytest.approx(single.rows[0].score, abs=1e-3)
    # the adapter really acts on its own row only, and changes it; no hook stays on the shared backbone
    assert batched.row("ma").trace[0]["top_lm"] != batched.row("base").trace[0]["top_lm"]
    assert not forward_hook_count(tiny.model)


def test_token_batches_and_step_budget(tiny, tiny_memory):
    """``batch_tokens`` sizes a step by the sequences' own tokens (the paper's 8K-token batches, its ``paper``
    preset) and ``max_steps`` ends the run there."""
    from plugins.api import new_plugin
    from plugins.seqtrain import memory_sequences

    data = memory_sequences(tiny, tiny_memory, "train")
    own = [len(c) + len(t) - data.shared_len(i) for i, (c, t) in enumerate(zip(data.contexts, data.targets))]
    mean = sum(own) / len(own)
    p = new_plugin("memory_adapter", tiny, tiny_memory, {**FAST, "batch_tokens": int(3 * mean)})
    assert p.samples_per_step(data) == 3
    assert new_plugin("memory_adapter", tiny, tiny_memory, FAST).samples_per_step(data) == FAST["batch_size"]
    p = new_plugin("memory_adapter", tiny, tiny_memory,
                   {**FAST, "batch_tokens": int(2 * mean), "max_steps": 3, "max_epochs": 50, "patience": 1000})
    result = p.fit(tiny_memory)
    assert p.train_info["steps"] == 3 and p.train_info["stopped_by"] == "max_steps"
    assert {"nll", "kl"} <= set(next(h for h in result.history if "loss" in h))
    from plugins.registry import get_method

    paper = get_method("memory_adapter").Config.PRESETS["paper"].values
    assert (paper["batch_tokens"], paper["max_steps"], paper["layers"], paper["softmax"]) == (8192, 20000, "all",
                                                                                             "full")


def test_bad_config_and_settings(tiny, tiny_memory, trained):
    from plugins.api import make_config, new_plugin

    for bad in ({"temperature": 0}, {"layers": "top:x"}, {"memory_side": "left"}, {"allocation": "middle"},
                {"memory_dropout": 1.0}, {"no_such_setting": 1}):
        with pytest.raises(UserError):
            make_config("memory_adapter", bad)
    with pytest.raises(UserError):
        new_plugin("memory_adapter", tiny, tiny_memory, {"layers": "5"}).fit(tiny_memory)
    p, _ = trained
    with pytest.raises(UserError):
        p.settings({"temperature": -1})
    with pytest.raises(UserError):
        p.settings({"knn_lambda": 1.5})
    assert p.settings().temperature == FAST.get("temperature", 0.5)


def test_trace_attention_sums_to_one(tiny, tiny_memory, trained):
    from backbone.prompts import Prompt
    from engine import Row, compare

    p, _ = trained
    texts = p.phrase_texts()
    assert all(b.mem_tgt.shape[0] <= 50 for b in p.blocks.values())  # top 50 (the declared maximum) = every item
    cmp = compare(tiny, "the cat sleeps", [Row("base"), Row("ma", p, {"trace_top_k": 50})],
                  prompt=Prompt.for_task("translation"), max_new_tokens=4)
    assert cmp.row("base").trace[0].get("memory_attention") is None
    tr = cmp.row("ma").trace
    assert len(tr) >= 1
    for step in tr:
        att = step["memory_attention"]
        assert set(att["layers"]) == set(att["source_layers"]) == set(p.adapted_layers)
        for key in ("layers", "source_layers"):
            for layer, items in att[key].items():
                assert sum(w for _, w in items) == pytest.approx(1.0, abs=1e-3)
                assert all(p.phrases[i]["layer"] == layer for i, _ in items)
                assert all(0 <= i < len(texts) for i, _ in items)
        assert all(0 <= s <= 1 for shares in att["memory_share"].values() for s in shares)
    top5 = compare(tiny, "the cat sleeps", [Row("ma", p)], prompt=Prompt.for_task("translation"),
                   max_new_tokens=2).rows[0].trace[0]["memory_attention"]
    assert all(len(v) <= 5 for v in top5["layers"].values())


def test_trace_by_handle_for_two_groups_of_one_plugin(tiny, trained):
    """Two attachments of one plug-in (different temperatures) each answer with their own rows, asked in any order."""
    from backbone.prompts import Prompt

    p, _ = trained
    ids = torch.tensor([tiny.encode_context(Prompt.for_task("translation").render(s))[-8:]
                        for s in ("the cat sleeps", "good morning", "hello world")])
    cold = p.attach(torch.tensor([0, 2]), {"temperature": 0.05})
    hot = p.attach(torch.tensor([1]), {"temperature": 50.0})
    try:
        with torch.no_grad():
            tiny.forward_fc(ids)
        t_hot, t_cold, t_hot2 = p.network_trace(hot), p.network_trace(cold), p.network_trace(hot)
    finally:
        for h in cold + hot:
            h.remove()
    assert set(t_cold) == {0, 1} and set(t_hot) == {0} and t_hot == t_hot2
    layer = p.adapted_layers[0]
    w_hot = max(w for _, w in t_hot[0]["layers"][layer])
    assert max(w for _, w in t_cold[0]["layers"][layer]) > w_hot  # the colder attention is the peakier one


def test_capture_phrase_states_stops_early_and_equals_a_full_pass(tiny):
    from backbone.prompts import Prompt
    from memories.phrases import capture_phrase_states, phrase_site, slot_span

    prompt = Prompt.for_task("translation")
    items = [(0, "the house", "das Haus"), (1, "small", "klein"), (1, "the cat sleeps", "die Katze schlaeft")]
    top_calls = []
    probe = tiny.layers[1].register_forward_pre_hook(lambda *a: top_calls.append(1))
    try:
        st = capture_phrase_states(tiny, prompt, items, [0, 1], batch_size=1)
    finally:
        probe.remove()
    assert len(top_calls) == 3  # the shared prefix once, the layer-1 items: the layer-0 item's pass stopped before
    # the shared prompt prefix run once gives what every item's whole sequence gives
    whole = capture_phrase_states(tiny, prompt, items, [0, 1], batch_size=1, shared_prefix=False)
    assert torch.allclose(st.src, whole.src, atol=1e-5) and torch.allclose(st.tgt, whole.tgt, atol=1e-5)
    assert all(abs(st.rms[l] - whole.rms[l]) < 1e-5 * whole.rms[l] for l in (0, 1))
    assert st.src.shape == st.tgt.shape == (3, tiny.hidden_size) and set(st.rms) == {0, 1}
    assert all(r > 0 for r in st.rms.values())
    layer, src, tgt = items[2]
    ctx = tiny.encode_context(prompt.render(src))
    t = tiny.encode_target(prompt.target_prefix + tgt)
    seen = {}
    h = phrase_site(tiny, layer).register_forward_hook(lambda m, a, out: seen.update(a=out[0][0].double()))
    try:
        with torch.no_grad():
            tiny.forward_fc(torch.tensor([ctx + t]))
    finally:
        h.remove()
    a, b = slot_span(ctx, tiny.encode_context(prompt.render("")))
    assert torch.allclose(st.src[2], seen["a"][a:b].mean(0), atol=1e-5)
    assert torch.allclose(st.tgt[2], seen["a"][len(ctx):].mean(0), atol=1e-5)


def test_knn_mix_over_the_same_memory(tiny, trained):
    from engine.protocol import MixInput

    p, _ = trained
    V = tiny.vocab_size
    lm = torch.log_softmax(torch.randn(2, V), -1)
    fc = torch.randn(2, tiny.hidden_size)
    s = [p.settings({"knn_lambda": 0.0, "knn_k": 4, "knn_temperature": 10.0}),
         p.settings({"knn_lambda": 0.5, "knn_k": 4, "knn_temperature": 10.0})]
    out = p.mix(MixInput(fc=fc, lm_logprobs=lm, extra_logits=None, step=0, src_len=3, settings=s))
    assert torch.allclose(out.logprobs[0], lm[0])
    assert not torch.allclose(out.logprobs[1], lm[1])
    assert float(out.logprobs[1].exp().sum()) == pytest.approx(1.0, abs=1e-4)


def test_plus_knn_rows_in_the_batched_decode(tiny, trained):
    """The paper's "+ kNN": with λ = 1 and k = 1 every token is the nearest memory entry's value; with λ = 0 the row
    decodes exactly as the adapter alone."""
    from backbone.prompts import Prompt
    from engine import Row, compare

    p, _ = trained
    prompt = Prompt.for_task("translation")
    cmp = compare(tiny, "the cat sleeps", [Row("ma", p), Row("ma+knn", p, {"knn_lambda": 1.0, "knn_k": 1})],
                  prompt=prompt, max_new_tokens=5)
    alone = compare(tiny, "the cat sleeps", [Row("ma", p)], prompt=prompt, max_new_tokens=5)
    assert cmp.row("ma").tokens == alone.rows[0].tokens
    tr = cmp.row("ma+knn").trace
    assert tr and all(step["neighbours"] and step["token"] == step["neighbours"][0]["token"] for step in tr)
    assert all(step["lambda"] == 1.0 for step in tr)
