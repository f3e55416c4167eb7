"""The rules that keep the leaderboard honest, each guarded by a test that fails when the rule is broken by a one-line
change (docs/testing.md, "Honesty rules", lists them with the change each one catches): calibration tunes on the
tuning part only, a time budget never cuts it below MIN_TUNE (and without one every tuning sample is used), the
global start and λ = 0 are always tried, a setting leaves the start only on Holm-adjusted evidence, the verdict's
claims are Holm-adjusted over the methods; a calibration is used only with the weights, backbone and rule it was
made with, and reused by a rank only when made on exactly its tuning samples; the settings precedence; a plug-in is
reused only with identical settings on the same backbone; prompt examples come from training samples only; BM25's
coverage recall is normalised and k respected; kNN's covariance is centred and the projected bound shrunk; each
decode-cost row is its method's. All on the tiny backbone.

    python -m pytest -q tests/test_honesty_rules.py
"""
import json
import shutil

import pytest
import torch
from test_rank import unique_pairs

from eval import calibrate as cal_mod
from eval import rank as rank_mod
from eval.metrics import holm
from plugins.settings import CALIBRATION_RULE, row_settings

CAP = 6  # new tokens per output: every rule here is about which samples and settings, not about long outputs


class JumpingClock:
    """``time.time`` for eval.calibrate that moves 1,000 s a call: any time budget is spent at once."""

    def __init__(self):
        self.now = 0.0

    def time(self):
        self.now += 1000.0
        return self.now


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    """A memory of 60 distinct pairs, 24 held out (12 to tune on, 12 to report on), with a PEMA and a kNN plug-in."""
    from backbone.prompts import Prompt
    from memories.build import build_memory
    from memories.parse import Sample
    from plugins.api import train_plugin
    from plugins.registry import method_card

    root = tmp_path_factory.mktemp("honest")
    mem = build_memory(tiny, [Sample(s, t, i + 1) for i, (s, t) in enumerate(unique_pairs(60))], root / "m",
                       prompt=Prompt.for_task("translation"), heldout_frac=0.4, name="honest-mem")
    out = {"mem": mem, "root": root}
    for m in ("pema", "knn"):
        out[m], _ = train_plugin(tiny, mem, m, dict(method_card(m).quick_settings), out_dir=root / m)
    return out


@pytest.fixture(scope="module")
def pema_cal(tiny, setup):
    """PEMA calibrated with its defaults (no time budget) under a clock that jumps 1,000 s a call; the sources its
    grid decoded are recorded."""
    seen = []
    real = cal_mod.decode_grid_on

    def spy(backbone, plugin, source, *a, **k):
        seen.append(source)
        return real(backbone, plugin, source, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cal_mod, "time", JumpingClock())
        mp.setattr(cal_mod, "decode_grid_on", spy)
        cal = cal_mod.calibrate(tiny, setup["pema"], setup["mem"], store=False, max_new_tokens=CAP)
    return {"cal": cal, "decoded": seen}


def _copy_plugin(tiny, plugin, dest):
    from plugins.api import open_plugin

    shutil.copytree(plugin.plugin_path, dest)
    (dest / "calibration.json").unlink(missing_ok=True)
    return open_plugin(str(dest), tiny)


def _sha(plugin) -> str:
    cfg = json.loads((plugin.plugin_path / "plugin_config.json").read_text(encoding="utf-8"))
    return cfg["files"]["plugin_model.safetensors"]["sha256"]


def _write_cal(plugin, **fields):
    from ground.store import write_json_atomic

    write_json_atomic(plugin.plugin_path / "calibration.json",
                      {"table": [], "n": 12, "memory": "honest-mem", "sample_ids": [], **fields})


# --- calibration: which samples, how many, which settings ----------------------------------------------------------
def test_calibration_decodes_only_the_tuning_part(setup, pema_cal):
    mem = setup["mem"]
    tune, report, info = cal_mod.split_heldout(mem)
    held = [i for i, s in enumerate(mem.samples) if s["split"] == "heldout"]
    assert info["tune"] == len(tune) == 12 and info["report"] == len(report) == 12
    assert sorted(s["index"] for s in tune + report) == held  # every held-out sample on exactly one side
    for n in (0, -1):  # nothing tuned, all reported
        assert cal_mod.split_heldout(mem, n)[:2] == ([], tune + report)
    assert cal_mod.split_heldout(mem, 100)[:2] == (tune + report, [])
    # the warnings start below MIN_TUNE tuning and MIN_REPORT report samples, not at them
    assert cal_mod.split_heldout(mem, cal_mod.MIN_TUNE)[2]["warning"] == \
        f"only {24 - cal_mod.MIN_TUNE} held-out samples left to report on (fewer than {cal_mod.MIN_REPORT}: wide " \
        f"intervals)"
    assert cal_mod.split_heldout(mem, 24 - cal_mod.MIN_REPORT)[2]["warning"] == \
        f"only {24 - cal_mod.MIN_REPORT} held-out samples to tune on (calibration needs {cal_mod.MIN_TUNE})"
    assert {s["index"] for s in tune}.isdisjoint({s["index"] for s in report})
    cal = pema_cal["cal"]
    assert cal["sample_ids"] == [s["index"] for s in tune]
    assert sorted(pema_cal["decoded"]) == sorted(s["src"].strip() for s in tune)
    data = rank_mod.split(mem)  # the rank tunes on the same part and reports on the rest
    assert [s["index"] for s in data["tune"]] == [s["index"] for s in tune]
    assert data["report"] == [(s["src"], s["tgt"]) for s in report]


def test_without_a_budget_every_tuning_sample_is_used(pema_cal):
    """The grid, not the clock, sets the cost: a clock that runs 1,000 s a call stops nothing by default."""
    assert pema_cal["cal"]["n"] == 12 and not pema_cal["cal"]["stopped_by_time"]


def test_a_budget_never_cuts_below_the_minimum_tuning_count(tiny, setup, monkeypatch):
    monkeypatch.setattr(cal_mod, "time", JumpingClock())
    cal = cal_mod.calibrate(tiny, setup["knn"], setup["mem"], max_seconds=1.0, store=False, max_new_tokens=CAP)
    assert cal["n"] == cal_mod.MIN_TUNE and cal["stopped_by_time"]
    tune = cal_mod.split_heldout(setup["mem"])[0]
    cal = cal_mod.calibrate(tiny, setup["knn"], setup["mem"], samples=tune, max_samples=1, store=False,
                            max_new_tokens=CAP)
    assert cal["n"] == cal_mod.MIN_TUNE


def test_the_global_start_and_lambda_zero_are_always_tried(tiny, setup, pema_cal):
    pema, cal = setup["pema"], pema_cal["cal"]
    start = row_settings(pema, setup["mem"].task, tiny.name, calibrated=False).as_dict()  # as calibration stores it
    assert start["lambda_max"] not in {g.get("lambda_max") for g in cal_mod.decode_grid(type(pema))}, \
        "the tiny PEMA's global start must lie off its grid for this test to mean anything"
    rows = cal["table"]
    assert [r["settings"] for r in rows if r["global_default"]] == [start]
    assert cal["weight"] == "lambda_max" and rows[0]["base"] and rows[0]["settings"]["lambda_max"] == 0.0
    assert cal["evidence"]["start"] == start and cal["global_default"]["settings"] == start
    candidates, cstart, weight = cal_mod._candidates(pema, setup["mem"].task)
    assert cstart == start and start in candidates and weight == "lambda_max"


def test_the_global_start_ignores_an_earlier_calibration(tiny, setup, tmp_path):
    """Calibrating again starts from the global start, not from where an earlier calibration left the plug-in."""
    pema = _copy_plugin(tiny, setup["pema"], tmp_path / "pema")
    start = row_settings(pema, setup["mem"].task, tiny.name, calibrated=False).as_dict()  # as calibration stores it
    _write_cal(pema, settings=pema.settings({"lambda_max": 0.9, "gu": False}).as_dict(), backbone=tiny.name,
               weights_sha256=_sha(pema), rule=CALIBRATION_RULE)
    assert row_settings(pema, setup["mem"].task, tiny.name).as_dict() != start  # the earlier calibration is in force
    candidates, cstart, _ = cal_mod._candidates(pema, setup["mem"].task)
    assert cstart == start and start in candidates


# --- the evidence rule and the Holm-adjusted p ---------------------------------------------------------------------
def test_holm_by_hand():
    assert holm([0.01, 0.04, 0.03, None]) == [0.03, 0.06, 0.06, None]
    assert holm([0.5, 0.2]) == [0.5, 0.4]
    assert holm([0.02]) == [0.02]
    assert holm([0.6, 0.7]) == [1.0, 1.0]  # capped at 1, not below
    assert holm([0.0123]) == [0.0123]  # a bootstrap p's four decimals kept


def test_evidence_is_adjusted_over_the_distinct_settings_tested(monkeypatch):
    """Five settings each with a raw p of 0.02 against the start (Holm-adjusted: 0.1) — none may move the start;
    one that repeats another's outputs is one test, one with the start's outputs none."""
    p_of = {"a": 0.02, "b": 0.02, "c": 0.02, "d": 0.02, "e": 0.02}
    monkeypatch.setattr(cal_mod, "paired_bootstrap", lambda base, sys, refs, n_samples: {
        "chrf": {"delta": 3.0, "p_value": p_of[sys[0]]}, "sacrebleu": {"delta": 1.0, "p_value": p_of[sys[0]]}})
    start = {"settings": {"lam": 0.2}, "chrf": 50.0, "bleu": 20.0}
    rows = [start] + [{"settings": {"lam": 0.1 * i}, "chrf": 53.0, "bleu": 21.0} for i in range(7)]
    hyps = [["s"], ["a"], ["b"], ["c"], ["d"], ["e"], ["a"], ["s"]]
    assert cal_mod.evidence(start, rows, hyps, ["s"], ["r"]) == 5
    assert [r["p_vs_start"] for r in rows] == [None, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, None]
    assert [r["p_vs_start_holm"] for r in rows] == [None, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, None]
    # the start and a setting with the start's outputs differ from it by nothing
    assert [r["chrf_vs_start"] for r in rows] == [0.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 0.0]
    assert [r["bleu_vs_start"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert cal_mod.choose(start, rows, "lam") is start  # raw p 0.02 would have moved it


def test_choose_needs_the_adjusted_p_below_alpha_a_gain_and_no_bleu_loss():
    def row(lam, dchrf, dbleu, p):
        return {"settings": {"lam": lam}, "chrf": 50 + dchrf, "bleu": 20 + dbleu, "chrf_vs_start": dchrf,
                "bleu_vs_start": dbleu, "p_vs_start": None if p is None else p / 10, "p_vs_start_holm": p}

    start = row(0.2, 0.0, 0.0, None)
    assert cal_mod.choose(start, [start, row(0.5, 4.0, 1.0, cal_mod.ALPHA)], "lam") is start
    assert cal_mod.choose(start, [start, row(0.5, 4.0, -0.1, 0.001)], "lam") is start
    assert cal_mod.choose(start, [start, row(0.5, -1.0, 1.0, 0.001)], "lam") is start
    assert cal_mod.choose(start, [start, row(0.5, 0.0, 1.0, 0.001)], "lam") is start  # no chrF gain, no move
    assert cal_mod.choose(start, [start, row(0.5, 4.0, 1.0, 0.06)], "lam") is start  # α is 0.05
    moved = row(0.5, 4.0, 0.0, 0.049)
    assert cal_mod.choose(start, [start, moved], "lam") is moved
    near = row(0.3, 4.0, 0.0, 0.049)
    assert cal_mod.choose(start, [start, moved, near], "lam") is near  # a tie goes nearer the base


def test_the_verdict_claims_only_on_holm_adjusted_p():
    rows = [{"method": "base", "title": "Base", "chrf": 50.0}]
    for m, d, p in (("a", 4.0, 0.004), ("b", 1.2, 0.03), ("c", 0.3, 0.3), ("d", -0.1, 0.6), ("e", -2.0, 0.985),
                    ("f", -3.0, 0.999)):
        rows.append({"method": m, "title": m.upper(), "chrf": 50 + d, "chrf_delta": d, "p_chrf": p})
    adj = rank_mod.holm_adjusted(rows)
    assert adj["a"][0] == pytest.approx(0.024) and adj["b"][0] == pytest.approx(0.15)
    assert adj["f"][1] == pytest.approx(0.006) and adj["e"][1] == pytest.approx(0.075)
    v = rank_mod.verdict(rows, 100)
    assert v["better"] == ["a"] and v["worse"] == ["f"] and v["level"] == ["b", "c", "d", "e"]
    assert "Holm-adjusted for 6 methods" in v["text"]
    res = {"methods": [{"label": "base", "chrf": 50.0, "sacrebleu": 20.0},
                       *({"label": r["method"], "chrf": r["chrf"], "sacrebleu": 20.0, "chrf_delta": r["chrf_delta"],
                          "p_chrf": r["p_chrf"], "sacrebleu_delta": 0.0, "p_sacrebleu": 0.5} for r in rows[1:])]}
    board = rank_mod._leaderboard_rows(res, {r["method"]: {"method": r["method"], "title": r["title"]}
                                             for r in rows[1:]}, {})
    by = {r["method"]: r for r in board}
    assert by["b"]["p_chrf"] == 0.03 and by["b"]["p_chrf_holm"] == pytest.approx(0.15)  # beside the raw one
    assert by["f"]["p_chrf_worse_holm"] == pytest.approx(0.006) and "p_chrf_holm" not in by["base"]
    text = rank_mod.format_leaderboard({"methods": board, "verdict": v["text"], "phases": {},
                                        "data": {"report": 100, "report_source": "held-out", "tune": 40}})
    assert "+1.20 (0.030; 0.150)" in text


# --- where a calibration is used ---------------------------------------------------------------------------------
def test_a_calibration_is_used_only_with_its_weights_backbone_and_rule(tiny, setup, tmp_path):
    pema = _copy_plugin(tiny, setup["pema"], tmp_path / "pema")
    glob = row_settings(pema, "translation", tiny.name, calibrated=False)
    forced = pema.settings({"lambda_max": 0.9, "gu": False})
    assert forced != glob
    good = {"settings": forced.as_dict(), "backbone": tiny.name, "weights_sha256": _sha(pema), "rule": CALIBRATION_RULE}
    _write_cal(pema, **good)
    assert row_settings(pema, "translation", tiny.name) == forced
    for change in ({"weights_sha256": "0" * 64}, {"weights_sha256": None}, {"backbone": "another-backbone"},
                   {"backbone": None}, {"rule": "an-older-rule"}):
        _write_cal(pema, **{**good, **change})
        assert row_settings(pema, "translation", tiny.name) == glob, change


def test_settings_precedence_declared_then_tuned_then_calibrated_then_the_callers(tiny, setup, tmp_path,
                                                                                monkeypatch):
    from plugins import settings as settings_mod

    pema = _copy_plugin(tiny, setup["pema"], tmp_path / "pema")
    declared = pema.settings({})
    assert (declared.lambda_max, declared.gu) == (0.8, True)
    tuned_file = tmp_path / "tuned.json"
    tuned_file.write_text(json.dumps({"translation": {tiny.name: {"pema": {"lambda_max": 0.3, "gu": False}}}}),
                          encoding="utf-8")
    monkeypatch.setattr(settings_mod, "TUNED_PATH", tuned_file)
    assert row_settings(pema, "translation", tiny.name) == declared.replace(lambda_max=0.3, gu=False)
    _write_cal(pema, settings={"lambda_max": 0.5}, backbone=tiny.name, weights_sha256=_sha(pema),
               rule=CALIBRATION_RULE)
    assert row_settings(pema, "translation", tiny.name) == declared.replace(lambda_max=0.5, gu=False)
    assert row_settings(pema, "translation", tiny.name, calibrated=False).lambda_max == 0.3
    got = row_settings(pema, "translation", tiny.name, {"lambda_max": 0.6, "gu": True})
    assert (got.lambda_max, got.gu) == (0.6, True)
    assert row_settings(pema, "style", tiny.name).lambda_max == 0.5  # calibrated, over the declared
    (pema.plugin_path / "calibration.json").unlink()
    assert row_settings(pema, "style", tiny.name) == declared


def test_a_rank_reuses_a_calibration_only_when_made_on_exactly_its_tuning_samples(tiny, setup, tmp_path,
                                                                                  monkeypatch):
    knn, mem = _copy_plugin(tiny, setup["knn"], tmp_path / "knn"), setup["mem"]
    tune, report, _ = cal_mod.split_heldout(mem)
    fresh = []
    monkeypatch.setattr(rank_mod.calibrate, "calibrate", lambda *a, **k: fresh.append(k["samples"]) or
                        {"settings": {}, "n": len(k["samples"]), "fresh": True})
    base = {"settings": knn.settings({}).as_dict(), "backbone": tiny.name, "weights_sha256": _sha(knn),
            "rule": CALIBRATION_RULE, "memory_id": mem.id}
    ids = [s["index"] for s in tune]

    def run():
        cal, _ = rank_mod._calibrated(tiny, knn, mem, "translation", tune, None, lambda *a: None, lambda: False)
        return cal

    _write_cal(knn, **base, sample_ids=ids)
    assert run().get("_reused") and not fresh
    for other in ([*ids, report[0]["index"]], [*ids[:-1], report[0]["index"]], ids[:-1]):
        _write_cal(knn, **base, sample_ids=other)
        assert run().get("fresh"), other
    _write_cal(knn, **{**base, "memory_id": "another-memory"}, sample_ids=ids)
    assert run().get("fresh")
    assert all(s == tune for s in fresh)


def test_a_rank_without_enough_tuning_samples_keeps_the_global_defaults_and_says_why(tiny, setup, tmp_path,
                                                                                    monkeypatch):
    knn, mem = _copy_plugin(tiny, setup["knn"], tmp_path / "knn"), setup["mem"]
    tune = cal_mod.split_heldout(mem)[0][:cal_mod.MIN_TUNE - 1]
    cal, note = rank_mod._calibrated(tiny, knn, mem, "translation", tune, None, lambda *a: None, lambda: False)
    assert cal is None and note.startswith("not calibrated: Calibration skipped: too few held-out samples")
    assert note.endswith("The global defaults are used.")
    monkeypatch.setattr(rank_mod.calibrate, "calibrate", lambda *a, **k: None)  # nothing to calibrate: no note
    assert rank_mod._calibrated(tiny, knn, mem, "translation", tune, None, lambda *a: None, lambda: False) == \
        (None, None)


# --- which plug-in a rank reuses --------------------------------------------------------------------------------
def test_a_plugin_is_reused_only_with_identical_settings_on_the_same_backbone(tiny, setup, tmp_path):
    from ground.store import Catalog
    from memories.build import memory_row
    from plugins.api import make_config, train_plugin

    cat = Catalog(tmp_path / "data")
    mem = setup["mem"]
    cat.add_memory(memory_row(mem))
    cfg = make_config("knn", {}).to_dict()
    _, prow = train_plugin(tiny, mem, "knn", {}, catalog=cat.owned_by("local"), out_dir=tmp_path / "p")
    found = rank_mod.find_trained(cat, "local", mem.id, "knn", cfg, tiny.fingerprint)
    assert found is not None and found["id"] == prow["id"]
    assert rank_mod.find_trained(cat, "local", mem.id, "knn", cfg, "another-backbone") is None
    other = make_config("knn", {"exact_max_entries": cfg["exact_max_entries"] + 1}).to_dict()
    assert rank_mod.find_trained(cat, "local", mem.id, "knn", other, tiny.fingerprint) is None
    assert rank_mod.find_trained(cat, "local", "another-memory", "knn", cfg, tiny.fingerprint) is None
    assert rank_mod.find_trained(cat, "someone-else", mem.id, "knn", cfg, tiny.fingerprint) is None
    # a newer plug-in that continued another's training has another history: not reused
    cat.add_plugin({**cat.plugin(prow["id"]), "id": prow["id"] + "-continued",
                    "created": (found.get("created") or 0) + 100,
                    "metrics": json.dumps({"train_info": {"continued_from": prow["id"]}})})
    assert rank_mod.find_trained(cat, "local", mem.id, "knn", cfg, tiny.fingerprint)["id"] == prow["id"]
    # of two plug-ins trained alike, the newer, whatever order the catalog lists them in
    newer = (found.get("created") or 0) + 200
    cat.add_plugin({**cat.plugin(prow["id"]), "id": prow["id"] + "-newer", "created": newer})

    class OldestFirst:
        def plugins(self, owner):
            return list(reversed(cat.plugins(owner)))

    for c in (cat, OldestFirst()):
        assert rank_mod.find_trained(c, "local", mem.id, "knn", cfg, tiny.fingerprint)["id"] == prow["id"] + "-newer"
    # a stored config that is missing or does not load is never the same config
    assert rank_mod.same_config("knn", cfg, cfg)
    for stored in (None, "not a dict", {"no_such_field": 1}, {"exact_max_entries": "many"}):
        assert rank_mod.same_config("knn", stored, cfg) is False, stored


# --- prompt examples ------------------------------------------------------------------------------------------------
def test_prompt_examples_come_from_training_samples_only(tiny, tmp_path):
    """Held-out sources are the most typical length (what ``choose_prompt_examples`` prefers): taken from all the
    samples, the prompt's examples would be held-out ones."""
    from backbone.prompts import Prompt
    from memories.build import build_memory, choose_prompt_examples, heldout_split
    from memories.parse import Sample

    n, frac = 40, 0.25
    held = set(heldout_split(n, frac).tolist())
    lengths = iter([3, 7] * n)
    srcs = [" ".join(f"w{i}x{j}" for j in range(5 if i in held else next(lengths))) for i in range(n)]
    samples = [Sample(s, f"t{i} {s}", i + 1) for i, s in enumerate(srcs)]
    shots = [("one", "eins"), ("two", "zwei")]
    mem = build_memory(tiny, samples, tmp_path / "m", prompt=Prompt.for_task("translation", examples=shots),
                       heldout_frac=frac)
    got = {i for i, s in enumerate(mem.samples) if s["split"] == "heldout"}
    assert got == held, "the split must be heldout_split's here (distinct sources) for this test to mean anything"
    pe = mem.meta["prompt_examples"]
    assert pe["source"] == "own" and len(pe["samples"]) == 2
    assert all(mem.samples[i]["split"] == "train" for i in pe["samples"])
    assert {s for s, _ in mem.prompt.examples} <= {srcs[i] for i in range(n) if i not in held}
    pick = choose_prompt_examples(srcs, [f"t{i}" for i in range(n)], [False] * n, sorted(set(range(n)) - held), 2)
    assert pick and not set(pick) & held


def test_retrieved_examples_come_from_training_samples_only(tiny, setup):
    from plugins.api import new_plugin

    mem = setup["mem"]
    icl = new_plugin("retrieval_icl", tiny, mem, {})
    icl.fit(mem)
    assert {p["sample"] for p in icl.pool} == {i for i, s in enumerate(mem.samples) if s["split"] == "train"}
    for s in (s for s in mem.samples if s["split"] == "heldout"):
        assert all(ex["src"] != s["src"] for ex in icl.examples(s["src"], icl.settings({"k": 4})))


# --- retrieval: BM25 and coverage ----------------------------------------------------------------------------------
def test_coverage_recall_is_normalised_per_ngram_order():
    """A candidate that covers a 5-word run of a 16-word input (5 + 4 + 3 + 2 n-grams: mean recall 0.237) against
    one that covers 15 scattered words (15 unigrams only: 0.234): normalised per order the run wins; raw counts
    (14 vs 15 n-grams) would choose the scattered one."""
    from plugins.retrieval_icl import rerank_by_coverage

    query = [f"q{i}" for i in range(16)]
    run = query[3:8]
    scattered = [f"{w} z{i}" for i, w in enumerate(query[:15])]
    docs = [" ".join(scattered).split(), run]
    assert rerank_by_coverage(query, docs, [0, 1], 1) == [1]
    assert rerank_by_coverage(query, docs, [0, 1], 2) == [1, 0]


def test_k_is_respected_with_few_bm25_candidates(tiny, setup):
    from plugins.api import new_plugin
    from plugins.retrieval_icl import rerank_by_coverage

    query = "the house 7 is small".split()
    docs = [["the", "house"], ["7", "is"], ["small"], ["the", "house", "7"], ["is", "small", "the"]]
    assert len(rerank_by_coverage(query, docs, list(range(5)), 2)) == 2
    mem = setup["mem"]
    icl = new_plugin("retrieval_icl", tiny, mem, {})
    icl.fit(mem)
    for rerank in (True, False):
        for k in (1, 3, 6):
            got = icl.examples("the house 7 is small", icl.settings({"k": k, "candidates": 1, "rerank": rerank}))
            assert len(got) == k, (k, rerank)  # the candidates are never fewer than k


# --- kNN: the projected exact search -------------------------------------------------------------------------------
def test_principal_basis_is_from_the_centred_covariance():
    """Keys far from the origin along e0 but spread along e1: the first principal direction is e1 (the centred
    covariance); the uncentred second moment would give e0."""
    from plugins.knn import ProjectedL2Search

    g = torch.Generator().manual_seed(0)
    d = 128
    keys = torch.randn(2000, d, generator=g) * 0.05
    keys[:, 1] += torch.randn(2000, generator=g) * 3.0
    keys[:, 0] += 100.0
    basis = ProjectedL2Search.principal_basis(keys)
    assert basis is not None and basis.shape[1] == 32
    assert abs(float(basis[1, 0])) > 0.99 and abs(float(basis[0, 0])) < 0.1


class ExactScan:
    """A stand-in for the 16-bit scan under the projection (``CertifiedL2Search``): its bound is the exact squared
    distance between the projections, so what the test sees is the projection's own bound (and it needs no 16-bit
    kernel on this CPU)."""

    kernel = "exact"

    def __init__(self, keys, kernel=None):
        self.projected = keys

    def bounds(self, z):
        d = torch.cdist(z.double(), self.projected.double()).pow(2).float()
        return d.clone(), d


def test_the_projected_lower_bound_is_shrunk_for_a_basis_that_is_not_orthonormal(monkeypatch):
    """A basis whose columns are 10 % too long (σ_max 1.1) makes the projected distances up to 1.21× the true ones;
    shrunk by 1 / (1 + ‖VᵀV − I‖), the bound stays below every key's exact distance."""
    from plugins import knn as knn_mod

    monkeypatch.setattr(knn_mod, "CertifiedL2Search", ExactScan)
    g = torch.Generator().manual_seed(1)
    d, r = 64, 32
    keys = torch.zeros(500, d)
    keys[:, :r] = torch.randn(500, r, generator=g)  # keys in the basis's subspace: the bound is tight there
    search = knn_mod.ProjectedL2Search(keys, torch.eye(d)[:, :r] * 1.1)
    q = torch.zeros(3, d)
    q[:, :r] = torch.randn(3, r, generator=g)
    _, lower = search.bounds(q)
    exact = torch.cdist(q.double(), keys.double()).pow(2)
    assert float((lower.double() - exact).max()) <= 1e-4 * float(exact.max())
    assert float((lower.double() / exact).max()) > 0.5  # and still a useful bound


# --- the rank's rows ------------------------------------------------------------------------------------------------
def test_each_decode_cost_is_its_own_methods(tiny, setup, monkeypatch):
    """The decode-cost phase times each method's own row (a fake cost per row label), and each leaderboard row
    carries its own method's cost."""
    from ground.store import Catalog
    from memories.build import memory_row
    from plugins.registry import method_card

    costs = {"knn": 2.5, "retrieval_icl": 7.5, "adapter": 1.5}
    timed = []

    def fake_cost(backbone, sources, row, *a, **k):
        timed.append(row.label)
        return costs[row.label]

    monkeypatch.setattr(rank_mod, "decode_cost", fake_cost)
    monkeypatch.setattr(rank_mod, "_calibrated", lambda *a, **k: (None, None))
    cat = Catalog(setup["root"] / "rank-data")
    cat.add_memory(memory_row(setup["mem"]))
    board = rank_mod.rank(tiny, setup["mem"], catalog=cat, methods=list(costs), bootstrap=20, cost_sentences=1,
                          max_new_tokens=CAP, configs={m: method_card(m).quick_settings for m in costs})
    assert timed == list(costs)
    assert {r["method"]: r["decode_cost"] for r in board["methods"] if r["method"] != "base"} == costs


# --- a kept decode's rows -------------------------------------------------------------------------------------------
def test_a_kept_decode_keeps_each_finished_rows_own_cache(tiny, tiny_memory):
    """Rows that agree share one row of the forward pass, so a row's place in the cache is not its batch index: the
    base model and kNN at λ = 0 share the first place and kNN at λ 0.9 (which finishes early) sits in the second,
    while its batch index is 2. A slider move of that row must re-decode from its own kept cache, exactly as a full
    decode does."""
    from backbone.prompts import Prompt
    from engine import Row, compare, start_compare
    from plugins.api import new_plugin
    from plugins.knn import KNN, KNNConfig

    knn = KNN(KNNConfig(), tiny)
    knn.fit(tiny_memory)
    prompt, source = Prompt.for_task("translation"), "the cat sleeps"

    def rows(lam):
        return [Row("base"), Row("knn off", knn, {"lambda": 0.0}), Row("knn", knn, {"lambda": lam})]

    def run(r):
        while r.step():
            pass
        return r.result()[0]

    first = start_compare(tiny, source, rows(0.9), prompt, max_new_tokens=24)
    kept = run(first)
    assert len(kept.rows[2].tokens) < 24 <= len(kept.rows[0].tokens) and kept.rows[1].tokens == kept.rows[0].tokens
    assert 2 in first.finished_caches  # finished early: its cache kept as it was
    live = first.live()
    for lam in (0.85, 0.7, 0.5):
        got = run(start_compare(tiny, source, rows(lam), prompt, max_new_tokens=24, live=live))
        full = compare(tiny, source, rows(lam), prompt, max_new_tokens=24)
        assert [r.tokens for r in got.rows] == [r.tokens for r in full.rows], lam
    # a row that runs to the end in the second place, batch index 2: moved, it resumes from its own place
    pema = new_plugin("pema", tiny, tiny_memory, {"seed": 1})  # untrained, random B: far from the LM

    def pema_rows(lam):
        return [Row("base"), Row("knn off", knn, {"lambda": 0.0}), Row("pema", pema, {"lambda_max": lam, "gu": False})]

    first = start_compare(tiny, source, pema_rows(0.7), prompt, max_new_tokens=24)
    kept = run(first)
    assert kept.rows[2].tokens != kept.rows[0].tokens and len(kept.rows[2].tokens) == 24 and not first.finished_caches
    live = first.live()
    for lam in (0.75, 0.9, 0.6):
        got = run(start_compare(tiny, source, pema_rows(lam), prompt, max_new_tokens=24, live=live))
        full = compare(tiny, source, pema_rows(lam), prompt, max_new_tokens=24)
        assert [r.tokens for r in got.rows] == [r.tokens for r in full.rows], lam


def test_every_change_of_the_mutation_list_still_applies_once_to_the_code():
    """``scripts/honesty_mutations.py`` breaks each rule by replacing one text of the code; a text the code no longer
    has (or has twice) would be reported only when someone runs the script, so the list is checked here."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("honesty_mutations", root / "scripts" / "honesty_mutations.py")
    mutations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutations)
    assert len(mutations.CHANGES) >= 55
    stale = [(rule, rel, old) for rule, rel, old, new, _ in mutations.CHANGES
             if (root / rel).read_text(encoding="utf-8").count(old) != 1 or old == new]
    assert not stale, stale
