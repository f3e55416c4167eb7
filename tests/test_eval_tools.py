"""The benchmark helpers' logic: tuning criteria and the scaling curve's collection (no backbone needed)."""
import json

from eval import quality, scaling


def test_best_setting_translation_maximises_chrf_plus_bleu():
    rows = [{"label": "base", "chrf": 30, "sacrebleu": 5},
            {"label": "a", "chrf": 31, "sacrebleu": 1}, {"label": "b", "chrf": 29, "sacrebleu": 6}]
    assert quality.best_setting("translation", rows)["label"] == "b"


def test_best_setting_style_keeps_content_similarity():
    base = {"label": "base", "style_score": 0.2, "content_similarity": 0.8}
    too_far = {"label": "far", "style_score": 0.9, "content_similarity": 0.5}  # < 0.8 × 0.8
    kept = {"label": "kept", "style_score": 0.4, "content_similarity": 0.7}
    assert quality.best_setting("style", [base, too_far, kept])["label"] == "kept"
    # none keeps the content: the most similar setting wins, never the most stylish one
    assert quality.best_setting("style", [base, too_far, {**kept, "content_similarity": 0.6}])["label"] == "kept"


def test_scaling_collects_points_and_skips_ablation_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "OUT", tmp_path)
    d = {"memory_entries": 1234, "train_info": {"pema": {"seconds": 12.0}},
         "report": [{"label": "base", "sacrebleu": 3.0, "chrf": 20.0},
                    {"label": "pema", "sacrebleu": 4.0, "chrf": 22.0},
                    {"label": "ablation: +B_pd", "sacrebleu": 9.0, "chrf": 9.0}]}
    (tmp_path / "quality-translation-200-bb.json").write_text(json.dumps(d))
    rows = scaling.collect("translation", [200, 5000], "bb")  # 5000 has no result yet: skipped
    assert [(r["pairs"], r["method"]) for r in rows] == [(200, "base"), (200, "pema")]
    table = scaling.markdown(rows, "translation")
    assert "| 200 | 1,234 | pema | 4.00 | 22.00 | 12 |" in table
    scaling.chart(rows, "translation", tmp_path / "c.html")
    assert "plotly" in (tmp_path / "c.html").read_text()


def test_scaling_rescores_a_longer_report_on_the_curves_items(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "OUT", tmp_path)
    start, n = map(int, scaling.REPORT_ITEMS.split(":"))
    refs = [f"Satz Nummer {i} ist hier." for i in range(2 * n)]
    # "pema" is perfect on the curve's items and wrong on the extra ones; the stored score covers all of them
    outs = [{"source": "s", "reference": r, "base": "x", "pema": r if i < n else "nein"} for i, r in enumerate(refs)]
    d = {"memory_entries": 9, "report_items": f"{start}:{2 * n}", "outputs": outs,
         "report": [{"label": "base", "sacrebleu": 0.0, "chrf": 1.0},
                    {"label": "pema", "sacrebleu": 50.0, "chrf": 50.0}]}
    (tmp_path / "quality-translation-10000-bb.json").write_text(json.dumps(d))
    rows = {r["method"]: r for r in scaling.collect("translation", [10000], "bb")}
    assert round(rows["pema"]["sacrebleu"], 6) == 100.0 and round(rows["pema"]["chrf"], 6) == 100.0
    d["outputs"] = outs[:20]  # only some outputs kept (older results): the stored scores stay
    (tmp_path / "quality-translation-10000-bb.json").write_text(json.dumps(d))
    rows = {r["method"]: r for r in scaling.collect("translation", [10000], "bb")}
    assert rows["pema"]["sacrebleu"] == 50.0


def test_pairs_that_fit_drops_targets_a_memory_refuses(tiny):
    from backbone.prompts import Prompt
    from memories.build import MAX_TARGET_TOKENS, target_ids

    prompt = Prompt(template="{src} =", chat=False)
    short, long_ = ("a", "ein Haus"), ("b", " ".join(["Haus"] * (MAX_TARGET_TOKENS + 5)))
    assert len(target_ids(tiny, prompt, long_[1])) > MAX_TARGET_TOKENS
    assert quality.pairs_that_fit(tiny, prompt, [short, long_, short]) == ([short, short], 1)


def test_best_prompt_needs_style_and_content_together():
    rows = [{"label": "copies-an-example", "style_score": 0.95, "content_similarity": 0.05},
            {"label": "restyles", "style_score": 0.5, "content_similarity": 0.6},
            {"label": "copies-the-input", "style_score": 0.1, "content_similarity": 1.0}]
    assert quality.best_prompt("style", rows)["label"] == "restyles"
    rows = [{"label": "a", "chrf": 30, "sacrebleu": 5}, {"label": "b", "chrf": 33, "sacrebleu": 4}]
    assert quality.best_prompt("translation", rows)["label"] == "b"  # every row is a base: none is skipped


def test_task_prompt_follows_the_tuned_prompt_of_its_backbone(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from backbone import tasks

    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"style": {"chatty": {"shots": 0, "paper_prompt": True}}}))
    monkeypatch.setattr(tasks, "TUNED_PROMPTS_PATH", path)
    chatty, other = SimpleNamespace(name="chatty", chat=True), SimpleNamespace(name="other", chat=False)
    p = tasks.task_prompt("style", chatty)
    assert p.examples == [] and p.template == tasks.Prompt.for_task("style", paper=True).template and p.chat
    q = tasks.task_prompt("style", other)  # not tuned for it: 3 examples, line format
    assert len(q.examples) == 3 and q.template == tasks.Prompt.for_task("style").template
    assert tasks.task_prompt("style", chatty, shots=1, paper=False).examples == tasks.FEW_SHOT["style"][:1]


def test_save_defaults_keeps_what_it_is_not_given(tmp_path, monkeypatch):
    from backbone import tasks
    from plugins import settings

    prompts, decode = tmp_path / "prompts.json", tmp_path / "decode.json"
    monkeypatch.setattr(tasks, "TUNED_PROMPTS_PATH", prompts)
    monkeypatch.setattr(settings, "TUNED_PATH", decode)
    quality.save_defaults("formality", "bb", decode={"pema": {"lambda_max": 0.3, "gu": True}})
    quality.save_defaults("formality", "bb", prompt={"shots": 0, "paper_prompt": False})  # prompt-only run
    assert json.loads(decode.read_text()) == {"formality": {"bb": {"pema": {"lambda_max": 0.3, "gu": True}}}}
    assert json.loads(prompts.read_text()) == {"formality": {"bb": {"shots": 0, "paper_prompt": False}}}
    assert tasks.tuned_prompt("formality", "bb")["shots"] == 0
    assert settings.tuned_decode_settings("pema", "formality", "bb") == {"lambda_max": 0.3, "gu": True}


def test_bench_pair_compares_two_precisions_runs_item_by_item(tmp_path):
    from benchmarks.core import bench_pair

    refs = [f"das ist satz nummer {i} hier" for i in range(30)]
    def run(precision, adapter, steps):
        return {"precision": precision, "report": [{"label": "base"}, {"label": "adapter"}],
                "train_info": {"adapter": {"steps": steps, "epochs": 0.1}},
                "outputs": [{"reference": r, "base": "das ist", "adapter": a} for r, a in zip(refs, adapter)]}
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps(run("float32", refs[:15] + ["nichts"] * 15, 18)))
    b.write_text(json.dumps(run("bfloat16", refs, 40)))
    res = bench_pair(str(a), str(b))
    ad = res["methods"]["adapter"]
    assert res["other"]["precision"] == "bfloat16"
    assert ad["identical_outputs"] == 15 and ad["train_steps"] == [18, 40]
    assert ad["other"]["sacrebleu"] > ad["ref"]["sacrebleu"] and ad["other_vs_ref"]["sacrebleu"]["delta"] > 0
    assert res["methods"]["base"]["identical_outputs"] == 30
    c = tmp_path / "c.json"
    c.write_text(json.dumps({**run("bfloat16", refs, 1), "outputs": []}))
    try:
        bench_pair(str(a), str(c))
        raise AssertionError("different items must be refused")
    except SystemExit as e:
        assert "same items" in str(e)


def test_paired_ratios_take_each_turns_ratio_to_its_own_base():
    """The rows benchmark's ratios pair each config with the base step of the same turn: a turn where the machine
    was slow for both leaves the ratio alone, where a ratio of medians would mix turns."""
    from benchmarks.core import paired_ratios

    turns = {"base": [40.0, 50.0, 60.0], "7 rows": [64.0, 80.0, 96.0]}  # 1.6× in every turn
    assert paired_ratios(turns, "base") == {"base": 1.0, "7 rows": 1.6}
    skew = {"base": [40.0, 60.0, 45.0], "x": [60.0, 66.0, 63.0]}  # ratios 1.5, 1.1, 1.4
    assert paired_ratios(skew, "base")["x"] == 1.4
