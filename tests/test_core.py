"""Core engine on a tiny in-process model: memories, PEMA, kNN, the batched comparison decode."""
import json

import numpy as np
import pytest
import torch

from backbone.prompts import Prompt, postprocess
from engine import Row, compare
from engine.protocol import mix_logprobs
from ground.errors import UserError
from ground.store import Catalog
from memories.build import build_memory, target_ids
from memories.parse import Sample, parse_samples, parse_samples_strict
from memories.store import Memory
from plugins.api import make_config, open_plugin, train_plugin
from plugins.base import load_plugin
from plugins.knn import KNN, KNNConfig
from plugins.pema import PEMA, PEMAConfig, gu_lambda

PROMPT = Prompt.for_task("translation")


# --- memories ----------------------------------------------------------------------------------------

def test_memory_keys_are_fc_at_the_right_positions(tiny, tiny_memory):
    mem = tiny_memory
    s = mem.split_samples("train")[0]
    ctx = tiny.encode_context(mem.prompt.render(s["src"]))
    tgt = target_ids(tiny, mem.prompt, s["tgt"])
    fc, _ = tiny.forward_fc(torch.tensor([ctx + tgt[:-1]]))
    first = int(np.flatnonzero(mem.entry_sample == mem.samples.index(s))[0])
    want = fc[0, len(ctx) - 1:len(ctx) - 1 + len(tgt)].cpu().numpy()
    got = np.asarray(mem.keys[first:first + len(tgt)], dtype=np.float32)
    assert np.allclose(got, want, atol=2e-2 * np.abs(want).max())  # float16 storage
    assert mem.values[first:first + len(tgt)].tolist() == tgt
    assert tgt[-1] in tiny.stop_ids  # the memory also teaches where to stop


def test_memory_split_stats_and_catalog(tiny, tiny_memory, tmp_path):
    st = tiny_memory.meta["stats"]
    assert st["samples"] + st["heldout_samples"] == 12 and st["heldout_samples"] >= 1
    assert len(tiny_memory.keys) == st["entries"] and len(tiny_memory.heldout_keys) == st["heldout_entries"]
    assert st["key_rms"] > 0
    assert {s["split"] for s in tiny_memory.samples} == {"train", "heldout"}
    cat = Catalog(tmp_path)
    from memories.build import register_memory

    register_memory(cat, tiny_memory)
    assert cat.memory(tiny_memory.id)["entries"] == st["entries"]


def test_build_progress_says_held_out_entries_and_samples_apart(tiny, tiny_pairs, tmp_path):
    msgs = []
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(tiny_pairs)]
    m = build_memory(tiny, samples, tmp_path / "m", prompt=PROMPT, progress=lambda f, msg="": msgs.append(msg))
    st = m.meta["stats"]
    assert msgs[-1].startswith(f"Memory built: {st['entries']} entries from {st['samples']} samples "
                               f"(+{st['heldout_entries']} held-out entries from {st['heldout_samples']} samples)")


def test_offsite_mode_differs_and_is_recorded(tiny, tmp_path):
    samples = [Sample("the house is small", "das Haus ist klein", 1)]
    m = build_memory(tiny, samples, tmp_path / "off", prompt=PROMPT, mode="offsite", heldout_frac=0)
    t = build_memory(tiny, samples, tmp_path / "tf", prompt=PROMPT, heldout_frac=0)
    assert m.meta["mode"] == "offsite" and len(m) == len(t)
    assert np.array_equal(np.asarray(m.values), np.asarray(t.values))
    assert np.allclose(np.asarray(m.keys[0], np.float32), np.asarray(t.keys[0], np.float32), atol=1e-2)
    assert not np.allclose(np.asarray(m.keys, np.float32), np.asarray(t.keys, np.float32), atol=1e-2)


def test_monolingual_samples_get_synthetic_sources(tiny, tmp_path):
    samples = [Sample(None, "thou art kind", 1), Sample(None, "das Haus ist klein", 2)]
    m = build_memory(tiny, samples, tmp_path / "mono", prompt=PROMPT, heldout_frac=0)
    assert all(s["synthetic_src"] and s["src"] for s in m.samples)
    assert m.meta["stats"]["synthetic_sources"] == 2


@pytest.mark.parametrize("chat", [False, True])
def test_synthetic_sources_use_an_instruction_on_chat_backbones(tiny, monkeypatch, chat):
    from backbone.prompts import CHAT_REVERSE_TEMPLATES, REVERSE_TEMPLATES
    from memories import build

    seen = []
    monkeypatch.setattr(tiny, "chat", chat)
    monkeypatch.setattr(tiny, "encode_context", lambda text: seen.append(text) or [1])
    monkeypatch.setattr(build, "generate_greedy", lambda bb, ctxs, **kw: [[] for _ in ctxs])
    assert build.synthesize_sources(tiny, ["thou art kind"], "style") == ["thou art kind"]  # empty → identity
    want = (CHAT_REVERSE_TEMPLATES if chat else REVERSE_TEMPLATES)["style"].format(src="thou art kind")
    assert seen == [want]


def test_wrong_backbone_is_refused(tiny_memory):
    from backbone.tiny import tiny_backbone

    other = tiny_backbone(hidden=32)
    with pytest.raises(UserError, match="another backbone"):
        Memory.load(tiny_memory.path, other)


def test_cancel_and_failures_leave_nothing_behind(tiny, tmp_path):
    from ground.errors import Cancelled

    with pytest.raises(Cancelled):
        build_memory(tiny, [Sample("a", "b", 1)] * 3, tmp_path / "x", should_stop=lambda: True)
    with pytest.raises(UserError):
        build_memory(tiny, [Sample("a", "b " * 400, 1)], tmp_path / "y")
    assert list(tmp_path.iterdir()) == []


# --- parsing -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("data,name,msg", [
    (b"", "a.jsonl", "empty"),
    ("{\"src\": \"a\", \"tgt\": \"b\"}\n\n{\"src\": \"c\", \"tgt\": \"d\"}", "a.jsonl", "line 2: empty line"),
    ("{\"src\": \"a\"}", "a.jsonl", "line 1: missing fields"),
    ("{\"src\": \"a\", \"tgt\": ", "a.jsonl", "line 1: not valid JSON"),
    ("a,b\nc\n", "a.csv", "line 2: expected 2 column"),
    ("a\tb\tc\n", "a.tsv", "expected 1 column"),
    ("x" * 3000, "a.txt", "line 1: the target has 3000 characters"),
    ("{\"src\": \"\", \"tgt\": \"b\"}", "a.jsonl", "line 1: the source is empty"),
    ("ok\n\xff".encode("latin-1"), "a.txt", "line 2: the file is not UTF-8"),
])
def test_bad_input_names_the_line(data, name, msg):
    with pytest.raises(UserError, match=msg):
        parse_samples_strict(data, name)


def test_input_formats():
    s, p = parse_samples('{"en": "Hello", "de": "Hallo"}\n{"text": "mono"}\n', "x.jsonl")
    assert not p and (s[0].src, s[0].tgt, s[1].src, s[1].tgt) == ("Hello", "Hallo", None, "mono")
    s, p = parse_samples("src,tgt\n\"a, b\",c\n", "x.csv")
    assert not p and (s[0].src, s[0].tgt) == ("a, b", "c")
    s, p = parse_samples("a\tb\nc\td\n", "x.tsv")
    assert [(x.src, x.tgt) for x in s] == [("a", "b"), ("c", "d")]
    s, p = parse_samples("one\ntwo\n\n", "x.txt")
    assert [x.tgt for x in s] == ["one", "two"] and all(x.src is None for x in s) and not p
    assert parse_samples_strict("a\n\nb", "x.txt", skip_invalid=True)[1].tgt == "b"


def test_prompt_templates():
    p = Prompt(template="Translate this from English to German:\n{src}\nGerman:", examples=[("Hi", "Hallo")])
    assert p.render("Yes") == ("Translate this from English to German:\nHi\nGerman: Hallo\n\n"
                               "Translate this from English to German:\nYes\nGerman:")
    with pytest.raises(UserError):
        Prompt(template="no slot")
    assert postprocess(" Das ist gut.\nEnglish: more") == "Das ist gut."


# --- PEMA --------------------------------------------------------------------------------------------

def test_gradual_unrolling_schedule():
    # Paper: SL = 4, λ_max = 0.8 → SS = 0.2; CS = 0.8, 0.6, 0.4, 0.2, 0 → λ_t = CS².
    assert [round(gu_lambda(t, 0.8, 4), 6) for t in range(6)] == [0.64, 0.36, 0.16, 0.04, 0.0, 0.0]
    assert gu_lambda(3, 0.8, 4, gu=False) == 0.8


def _public_code_gu(lambda_max: float, sl: int, p: float, steps: int) -> list[float]:
    """λ of each generated token, written out from agwaBom/PEMA: ema_generate.py turns gradual_unrolling_min p
    into y = 1/(1 − p·0.01); generation/utils.py (greedy_search) sets lambda_current = lambda_apply = λ_max and
    lambda_step = λ_max / SL, then per token *first* mixes with lambda_apply and *then*
    ``if (lambda_current - lambda_step > 0): lambda_current -= lambda_step;
    lambda_apply = lambda_current**2 / y + (y - 1) / y``. Exact fractions (the code's float32 is not the point)."""
    from fractions import Fraction

    y = 1 / (1 - Fraction(p) * Fraction(1, 100))
    current = apply = Fraction(lambda_max)
    step = Fraction(lambda_max) / sl
    out = []
    for _ in range(steps):
        out.append(float(apply))  # this token is mixed with lambda_apply
        if current - step > 0:
            current -= step
            apply = current ** 2 / y + (y - 1) / y
    return out


@pytest.mark.parametrize("lambda_max, sl, p", [(0.8, 4, 0.0), (0.9, 3, 25.0), (0.5, 6, 50.0), (0.7, 1, 10.0)])
def test_gradual_unrolling_code_variant_is_the_public_loop(lambda_max, sl, p):
    want = _public_code_gu(lambda_max, sl, p, steps=sl + 4)
    got = [gu_lambda(t, lambda_max, sl, variant="code", gu_min=p) for t in range(sl + 4)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] == lambda_max                     # first token unsquared
    assert got[-1] == got[-2] == got[max(0, sl - 1)]  # stuck at the last value after SL−1 decrements, not 0
    if sl > 1:
        assert got[-1] > 0


def test_mix_logprobs_extremes():
    lm = torch.log_softmax(torch.randn(2, 7), -1)
    pl = torch.log_softmax(torch.randn(2, 7), -1)
    assert torch.allclose(mix_logprobs(lm, pl, torch.tensor([0.0, 1.0]))[0], lm[0])
    assert torch.allclose(mix_logprobs(lm, pl, torch.tensor([0.0, 1.0]))[1], pl[1])
    half = mix_logprobs(lm, pl, torch.tensor([0.5, 0.5]))
    assert torch.allclose(half.exp(), 0.5 * lm.exp() + 0.5 * pl.exp(), atol=1e-6)


def _target_logprob(plugin, mem):
    dev = plugin.backbone.device  # the tiny backbone sits on $PEMA_TINY_DEVICE (cpu unless set)
    x = torch.from_numpy(np.asarray(mem.keys, np.float32)).to(dev)
    y = torch.from_numpy(np.asarray(mem.values, np.int64)).to(dev)
    with torch.no_grad():
        lp = torch.log_softmax(plugin.backbone.logits_from_fc(plugin.h_pd(plugin.scaled(x))), -1)
        lm = torch.log_softmax(plugin.backbone.logits_from_fc(x), -1)
    return lp.gather(1, y[:, None]).mean().item(), lm.gather(1, y[:, None]).mean().item()


@pytest.mark.parametrize("softmax", ["full", "candidates"])
def test_pema_phases_lower_losses_and_raise_target_probability(tiny, tiny_memory, softmax):
    cfg = PEMAConfig(rank=32, lr=1e-2, max_epochs_rct=15, max_epochs_joint=40, patience=100, softmax=softmax)
    p = PEMA(cfg, tiny, {"key_rms": tiny_memory.key_scale})
    res = p.fit(tiny_memory)
    for phase in ("reconstruction", "joint"):
        h = [r["heldout_loss"] for r in res.history if r["phase"] == phase and "heldout_loss" in r]
        assert min(h[1:]) < h[0]
    tr = [r["loss"] for r in res.history if r["phase"] == "joint" and "loss" in r]
    assert tr[-1] < tr[0]
    pema_lp, lm_lp = _target_logprob(p, tiny_memory)
    assert pema_lp > lm_lp + 1.0
    if softmax == "candidates":
        assert 0 < len(p.candidates) < tiny.vocab_size


def test_pema_pca_start_reconstructs_and_warm_start_begins_at_the_lm(tiny, tiny_memory):
    """rct_init=pca starts phase 1 at the linear autoencoder's optimum (full rank: exact reconstruction);
    pd_init=warm then starts P_PEMA at the LM's distribution; decode_vocab switches the candidate restriction."""
    d = tiny.hidden_size
    cfg = PEMAConfig(rank=d, max_epochs_rct=0, max_epochs_joint=0, dropout=0.0, rct_init="pca", pd_init="warm",
                     decode_vocab="full")
    p = PEMA(cfg, tiny, {"key_rms": tiny_memory.key_scale})
    res = p.fit(tiny_memory)
    assert res.metrics["reconstruction"]["best_heldout_loss"] < 1e-8
    x = torch.from_numpy(np.asarray(tiny_memory.keys[:8], dtype=np.float32)).to(tiny.device)
    lm = torch.log_softmax(tiny.logits_from_fc(x).float(), -1)
    assert torch.allclose(p.pema_logprobs(x), lm, atol=1e-3)
    p.config.decode_vocab = "candidates"
    assert torch.isinf(p.pema_logprobs(x)).any()  # restricted to the candidates again
    with pytest.raises(UserError, match="pd_init"):
        PEMAConfig(pd_init="nope").validate()


def test_pema_save_load_round_trip_and_foreign_backbone(tiny, tiny_memory, tmp_path):
    from backbone.tiny import tiny_backbone

    p, row = train_plugin(tiny, tiny_memory, "pema", {"rank": 16, "max_epochs_rct": 2, "max_epochs_joint": 2},
                          out_dir=tmp_path / "p")
    assert row["params"] == p.trainable_parameters() == 3 * 16 * tiny.hidden_size
    cfg = json.loads((tmp_path / "p" / "plugin_config.json").read_text())
    assert cfg["method"] == "pema" and cfg["config"]["kappa"] == 0.2
    q = load_plugin(tmp_path / "p", tiny)
    x = torch.randn(3, tiny.hidden_size, device=tiny.device)
    assert torch.equal(p.h_pd(p.scaled(x)), q.h_pd(q.scaled(x)))
    assert torch.equal(p.candidates, q.candidates)
    with pytest.raises(UserError, match="another backbone"):
        load_plugin(tmp_path / "p", tiny_backbone(seed=1, hidden=32))
    assert not list(tmp_path.glob(".tmp-*"))


def test_bad_configs_are_refused():
    with pytest.raises(UserError, match="κ"):
        make_config("pema", {"kappa": 2})
    with pytest.raises(UserError, match="Unknown setting"):
        make_config("pema", {"rnk": 3})
    with pytest.raises(UserError, match="Unknown method"):
        make_config("nope")


# --- kNN ---------------------------------------------------------------------------------------------

def test_knn_k1_lambda1_reproduces_a_memorised_continuation(tiny, tiny_memory):
    knn = KNN(KNNConfig(), tiny)
    knn.fit(tiny_memory)
    s = tiny_memory.split_samples("train")[0]
    rows = [Row("base"), Row("knn", knn, {"k": 1, "lambda": 1.0})]
    c = compare(tiny, s["src"], rows, tiny_memory.prompt, max_new_tokens=20)
    assert c.row("knn").text == s["tgt"]
    assert c.row("base").text != s["tgt"]
    nb = c.row("knn").trace[0]["neighbours"][0]
    assert nb["distance"] < 1e-2 and tiny_memory.samples[nb["sample"]]["src"] == s["src"]
    assert "exact" in knn.search_kind


def test_knn_faiss_search_agrees_with_exact(tiny, tiny_memory):
    exact = KNN(KNNConfig(search="exact"), tiny)
    exact.fit(tiny_memory)
    fa = KNN(KNNConfig(search="faiss", ivf_lists=4, pq_m=16, nprobe=4), tiny)
    fa.fit(tiny_memory)
    assert "FAISS" in fa.search_kind
    q = torch.from_numpy(np.asarray(tiny_memory.keys[:5], np.float32))
    _, ie = exact.search(q / exact.key_scale, 1)
    _, ifa = fa.search(q / fa.key_scale, 1)
    same = (tiny_memory.values[ie[:, 0].cpu().numpy()] == tiny_memory.values[ifa[:, 0].cpu().numpy()]).mean()
    assert same >= 0.6  # PQ is approximate; the nearest entry's token mostly agrees


# --- batched comparison decode ----------------------------------------------------------------------

def test_batched_rows_equal_single_method_decodes(tiny, tiny_memory, tmp_path):
    pema, _ = train_plugin(tiny, tiny_memory, "pema", {"rank": 16, "max_epochs_rct": 3, "max_epochs_joint": 5,
                                                       "lr": 1e-2}, out_dir=tmp_path / "p")
    knn = KNN(KNNConfig(), tiny)
    knn.fit(tiny_memory)
    rows = [Row("base"), Row("pema", pema, {"lambda_max": 0.9}), Row("pema-nogu", pema, {"gu": False}),
            Row("knn", knn, {"k": 4, "lambda": 0.7})]
    for beams in (1, 3):
        c = compare(tiny, "the cat sleeps", rows, PROMPT, max_new_tokens=10, num_beams=beams)
        for r in rows:
            single = compare(tiny, "the cat sleeps", [r], PROMPT, max_new_tokens=10, num_beams=beams)
            assert single.rows[0].tokens == c.row(r.label).tokens, (beams, r.label)
    # Base row equals transformers' own greedy generate.
    ids = torch.tensor([c.context_ids])
    g = tiny.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    base = compare(tiny, "the cat sleeps", [Row("base")], PROMPT, max_new_tokens=10).rows[0].tokens
    assert g[0, ids.shape[1]:].tolist()[:len(base)] == base
    c = compare(tiny, "the cat sleeps", rows, PROMPT, max_new_tokens=4)
    assert c.src_len == len(tiny.encode_target("the cat sleeps"))
    tr = c.row("pema").trace
    assert [t["lambda"] for t in tr] == [round(gu_lambda(i, 0.9, c.src_len), 4) for i in range(len(tr))]
    assert len(tr[0]["top_lm"]) == 5 and len(tr[0]["top_plugin"]) == 5 and len(tr[0]["top_final"]) == 5


def test_open_plugin_by_catalog_id(tiny, tiny_memory, tmp_path):
    cat = Catalog(tmp_path)
    p, row = train_plugin(tiny, tiny_memory, "knn", {}, catalog=cat)
    q = open_plugin(row["id"], tiny, cat)
    assert q.method == "knn" and len(q.values) == len(tiny_memory)
    with pytest.raises(UserError, match="No plug-in"):
        open_plugin("missing", tiny, cat)


def test_compare_rejects_bad_requests(tiny):
    with pytest.raises(UserError):
        compare(tiny, "  ", [Row("base")])
    with pytest.raises(UserError):
        compare(tiny, "x", [])


def test_decode_batch_of_sources_equals_one_at_a_time(tiny, tiny_memory):
    from engine import decode_batch

    knn = KNN(KNNConfig(), tiny)
    knn.fit(tiny_memory)
    rows = [Row("base"), Row("knn", knn, {"k": 2, "lambda": 0.8})]
    sources = ["the cat sleeps", "good morning", "the house is small and the cat sleeps"]
    many = decode_batch(tiny, sources, rows, PROMPT, max_new_tokens=8)
    for src, c in zip(sources, many):
        one = compare(tiny, src, rows, PROMPT, max_new_tokens=8)
        assert [r.tokens for r in c.rows] == [r.tokens for r in one.rows]


def test_head_logits_subset_equals_the_masked_full_head(tiny):
    """PEMA's candidate-restricted decode projects through only the candidates' rows of the LM head."""
    normed = tiny.final_norm(torch.randn(3, tiny.hidden_size, device=tiny.device))
    vocab = torch.tensor([0, 5, 17, tiny.vocab_size - 1], device=tiny.device)
    full = tiny.head_logits(normed)
    sub = tiny.head_logits_subset(normed, vocab)
    assert torch.allclose(sub[:, vocab], full[:, vocab], atol=1e-5)
    keep = torch.zeros(tiny.vocab_size, dtype=torch.bool, device=tiny.device)
    keep[vocab] = True
    assert torch.isinf(sub[:, ~keep]).all()


def test_every_line_break_token_stops_generation(tiny):
    """Generation ends at the end of the line: every token whose text holds a line break (e.g. "\\n\\n", which a
    model says after an answer when the prompt's examples are separated by blank lines) is a stop token."""
    texts = [tiny.tokenizer.decode([i]) for i in range(len(tiny.tokenizer))]
    breaks = {i for i, t in enumerate(texts) if "\n" in t}
    assert breaks  # the tiny tokenizer has "\n" only; tests/test_integration.py checks "\n\n" on Gemma
    assert breaks <= tiny.stop_ids
    assert tiny.stop_ids - breaks <= {tiny.tokenizer.eos_token_id}
