"""Per-memory calibration (eval/calibrate.py) on the tiny backbone: the declared grid tuned on a memory's held-out
tuning samples leaves the global start only on paired-bootstrap evidence (λ = 0 when the base model is clearly
better, a setting that clearly helps when one does); what it stores is where Compare, Evaluate and the CLIs start a
plug-in, and the global-defaults switch goes back; too few samples and a cancel are said plainly.

    python -m pytest -q tests/test_calibrate.py
"""
import json

import pytest
from test_rank import unique_pairs

from ground.errors import Cancelled, UserError
from plugins.settings import CALIBRATION_RULE, calibration_label

PAIRS = unique_pairs(80)  # distinct sources: none is a near-duplicate of another (the held-out split groups those)
CAP = 12  # new tokens per output: the tiny model rarely stops by itself, and the test needs only a few


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    """A memory with 32 held-out samples (16 to tune on) and a PEMA and a kNN plug-in trained on it."""
    from backbone.prompts import Prompt
    from memories.build import build_memory
    from memories.parse import Sample
    from plugins.api import train_plugin
    from plugins.registry import method_card

    root = tmp_path_factory.mktemp("cal")
    mem = build_memory(tiny, [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)], root / "m",
                       prompt=Prompt.for_task("translation"), heldout_frac=0.4, name="cal-mem")
    out = {"mem": mem}
    for m in ("pema", "knn"):
        out[m], _ = train_plugin(tiny, mem, m, dict(method_card(m).quick_settings), out_dir=root / m)
    return out


def _outputs(bb, plugin, settings, sources, prompt):
    """Each source decoded alone, greedy, by the base model (``plugin`` None) or one plug-in row — the full decode
    Compare runs — with calibration's length cap."""
    from engine import Row, compare

    row = Row("x") if plugin is None else Row("x", plugin, settings)
    return [compare(bb, s, [row], prompt, max_new_tokens=min(CAP, 2 * len(bb.encode_target(s)) + 16),
                    trace=False).rows[0].text for s in sources]


def _tune(mem):
    from eval.calibrate import split_heldout

    tune, report, info = split_heldout(mem)
    assert info["tune"] == len(tune) == 16 and info["report"] == len(report) == 16
    assert {s["index"] for s in tune}.isdisjoint({s["index"] for s in report})
    assert all(mem.samples[s["index"]]["split"] == "heldout" for s in tune + report)
    return tune


def test_every_setting_hurts_so_lambda_zero_is_chosen(tiny, setup):
    """References that are the base model's own outputs: any setting that changes an output scores below the base,
    the global start included; the base beats the start clearly, so calibration moves to λ = 0 (and the table must
    hold such hurting settings, or the test proves nothing)."""
    from eval.calibrate import calibrate

    pema, mem = setup["pema"], setup["mem"]
    tune = _tune(mem)
    refs = _outputs(tiny, None, None, [s["src"] for s in tune], mem.prompt)
    samples = [{**s, "tgt": r} for s, r in zip(tune, refs)]
    cal = calibrate(tiny, pema, mem, samples=samples, store=False, max_new_tokens=CAP)
    assert cal["is_base"] and cal["settings"]["lambda_max"] == 0.0 and cal["weight"] == "lambda_max"
    assert cal["base"]["chrf"] == pytest.approx(100.0)
    others = cal["table"][1:]
    assert len(others) >= 12 and any(r["chrf"] < cal["base"]["chrf"] for r in others)
    assert all(r["chrf"] <= cal["base"]["chrf"] for r in others)


def test_a_setting_that_helps_on_some_samples_and_hurts_on_others_does_not_move_the_global_start(tiny, setup):
    """References that are λ_max 0.9's outputs on every other sample where it differs from the global start, and the
    start's outputs elsewhere: no clear evidence either way, so the start stays and the record says so."""
    from eval.calibrate import calibrate
    from plugins.settings import row_settings

    pema, mem = setup["pema"], setup["mem"]
    tune = _tune(mem)
    start = row_settings(pema, mem.task, tiny.name, calibrated=False)
    srcs = [s["src"] for s in tune]
    refs = _outputs(tiny, pema, start, srcs, mem.prompt)
    target = _outputs(tiny, pema, pema.settings({"lambda_max": 0.9, "gu": False}), srcs, mem.prompt)
    differ = [j for j, (a, b) in enumerate(zip(refs, target)) if a != b]
    assert len(differ) >= 4, "λ_max 0.9 must change several outputs of the tiny PEMA for this test to mean anything"
    for j in differ[::2]:
        refs[j] = target[j]
    cal = calibrate(tiny, pema, mem, samples=[{**s, "tgt": r} for s, r in zip(tune, refs)], store=False,
                    max_new_tokens=CAP)
    ev = cal["evidence"]
    assert not ev["moved"] and cal["settings"] == start.as_dict() and not cal["is_base"]
    assert ev["text"].startswith("the global start") and "kept" in ev["text"]
    assert all(r["p_vs_start_holm"] is None or r["p_vs_start_holm"] >= 0.05 or r["chrf_vs_start"] <= 0
               or r["bleu_vs_start"] < 0 for r in cal["table"])


def test_a_setting_that_helps_is_chosen_and_scores_as_a_full_decode(tiny, setup):
    """References that are one setting's own full-decode outputs: that setting scores 100 through calibration's
    kept-decode moves (so a move decodes what a full decode does) and is chosen over the base."""
    from eval.calibrate import calibrate

    pema, mem = setup["pema"], setup["mem"]
    tune = _tune(mem)
    target = pema.settings({"lambda_max": 0.9, "gu": False})
    refs = _outputs(tiny, pema, target, [s["src"] for s in tune], mem.prompt)
    base = _outputs(tiny, None, None, [s["src"] for s in tune], mem.prompt)
    assert refs != base, "the tiny PEMA must change some output at λ_max 0.9 for this test to mean anything"
    cal = calibrate(tiny, pema, mem, samples=[{**s, "tgt": r} for s, r in zip(tune, refs)], store=False,
                    max_new_tokens=CAP)
    row = next(r for r in cal["table"] if r["settings"] == target.as_dict())
    assert row["chrf"] == pytest.approx(100.0)  # (sacreBLEU of the tiny model's short outputs is often 0)
    assert not cal["is_base"] and cal["chrf"] == pytest.approx(100.0)
    assert cal["chrf"] >= cal["base"]["chrf"] and cal["bleu"] >= cal["base"]["bleu"]


def _cand(lam, chrf, bleu, p_holm, start=(50.0, 20.0)):
    return {"settings": {"lam": lam}, "chrf": chrf, "bleu": bleu, "chrf_vs_start": round(chrf - start[0], 4),
            "bleu_vs_start": round(bleu - start[1], 4), "p_vs_start": p_holm, "p_vs_start_holm": p_holm}


def test_choose_moves_only_on_evidence_and_never_trades_one_metric_for_the_other():
    from eval.calibrate import ALPHA, choose

    start = {"settings": {"lam": 0.2}, "chrf": 50.0, "bleu": 20.0, "chrf_vs_start": 0.0, "bleu_vs_start": 0.0,
             "p_vs_start": None, "p_vs_start_holm": None}
    worse_bleu = _cand(0.5, 55.0, 19.9, 0.001)
    weak = _cand(0.7, 58.0, 25.0, ALPHA)  # the largest gain, but its adjusted p is not below α
    assert choose(start, [start, worse_bleu, weak], "lam") is start
    better, same_better = _cand(0.4, 51.0, 20.0, 0.01), _cand(0.3, 51.0, 20.0, 0.01)
    assert choose(start, [start, worse_bleu, weak, better, same_better], "lam") is same_better  # a tie: nearer base
    base = {**_cand(0.0, 53.0, 21.0, 0.002), "base": True}  # λ = 0 stays possible when the base is better
    assert choose(start, [base, start, better], "lam") is base
    assert choose(start, [{**base, "p_vs_start_holm": 0.2}, start, better], "lam") is better


def test_stored_settings_are_where_rows_start_and_global_defaults_go_back(tiny, setup):
    from eval.calibrate import calibrate, load_calibration
    from plugins.settings import row_settings

    knn, mem = setup["knn"], setup["mem"]
    glob = row_settings(knn, "translation", tiny.name, calibrated=False)
    cal = calibrate(tiny, knn, mem, max_seconds=600, max_new_tokens=CAP)
    stored = load_calibration(knn.plugin_path)
    assert stored["settings"] == cal["settings"] and stored["n"] == 16 and stored["memory"] == "cal-mem"
    assert stored["sample_ids"] == [s["index"] for s in _tune(mem)]
    assert cal["label"] == "tuned on 16 held-out samples of cal-mem (few samples: a rough guide)"
    assert calibration_label({**cal, "n": 30}) == "tuned on 30 held-out samples of cal-mem"
    assert row_settings(knn, "translation", tiny.name).as_dict() == cal["settings"]
    assert row_settings(knn, "translation", tiny.name, calibrated=False) == glob
    assert row_settings(knn, "translation", tiny.name, {"k": 3}).k == 3  # an override still wins
    # made for other weights (the plug-in trained again in place): not used
    path = knn.plugin_path / "calibration.json"
    saved = path.read_text(encoding="utf-8")
    path.write_text(json.dumps({**stored, "weights_sha256": "0" * 64}), encoding="utf-8")
    try:
        assert load_calibration(knn.plugin_path) is None
        assert row_settings(knn, "translation", tiny.name) == glob
    finally:
        path.write_text(saved, encoding="utf-8")


def test_cli_compare_and_run_start_tuned_and_global_defaults_go_back(tiny, setup, monkeypatch, capsys):
    """``python -m plugins compare`` / ``python -m eval run`` decode a calibrated plug-in at its stored settings
    and say so; ``--global-defaults`` uses the global ones. A forced calibration (λ 0.9, GU off) makes the two
    starts differ."""
    import eval.__main__ as eval_cli
    import plugins.__main__ as cli
    from engine import compare as real_compare
    from eval.calibrate import load_calibration
    from ground.store import write_json_atomic
    from plugins.settings import row_settings

    pema, mem = setup["pema"], setup["mem"]
    cfg = json.loads((pema.plugin_path / "plugin_config.json").read_text(encoding="utf-8"))
    forced = pema.settings({"lambda_max": 0.9, "gu": False})
    write_json_atomic(pema.plugin_path / "calibration.json", {
        "settings": forced.as_dict(), "table": [], "n": 16, "memory": "cal-mem", "memory_id": mem.id, "sample_ids": [],
        "backbone": tiny.name, "weights_sha256": cfg["files"]["plugin_model.safetensors"]["sha256"],
        "rule": CALIBRATION_RULE})
    assert load_calibration(pema.plugin_path) is not None
    seen = []

    def spy(bb, sentence, rows, *a, **k):
        seen.append({r.label: r.settings for r in rows})
        return real_compare(bb, sentence, rows, *a, **k)

    monkeypatch.setattr(cli, "load_backbone_from_args", lambda args: tiny)
    monkeypatch.setattr(cli, "compare", spy)
    assert cli.main(["compare", "the house is small", "--plugin", str(pema.plugin_path)]) == 0
    assert seen[-1]["pema"] == forced
    assert "tuned on 16 held-out samples of cal-mem" in capsys.readouterr().out
    assert cli.main(["compare", "the house is small", "--plugin", str(pema.plugin_path), "--global-defaults"]) == 0
    assert seen[-1]["pema"] == row_settings(pema, "translation", tiny.name, calibrated=False) != forced
    assert "tuned on" not in capsys.readouterr().out

    used, prompts = [], []
    real_eval = eval_cli.evaluate

    def eval_spy(bb, pairs, rows, prompt, *a, **k):
        used.append({r.label: r.settings for r in rows})
        prompts.append(prompt)
        return real_eval(bb, pairs, rows, prompt, *a, **k)

    monkeypatch.setattr(eval_cli, "load_backbone_from_args", lambda args: tiny)
    monkeypatch.setattr(eval_cli, "evaluate", eval_spy)
    for extra, want in (([], forced), (["--global-defaults"], row_settings(pema, "translation", tiny.name,
                                                                            calibrated=False))):
        assert eval_cli.main(["run", "--memory", str(mem.path), "--plugin", str(pema.plugin_path), "--n", "3",
                              *extra]) == 0
        assert used[-1]["pema"] == want
    # the memory's held-out split is read with the memory's own prompt (as its calibration and the studio's
    # Evaluate read it), not the built-in examples; --shots asks for the built-in ones
    from backbone.prompts import Prompt
    from backbone.tasks import task_prompt

    own, builtin = Prompt.from_dict(pema.memory_meta["prompt"]), task_prompt("translation", tiny)
    assert own != builtin and prompts[-1] == own
    assert eval_cli.main(["run", "--memory", str(mem.path), "--plugin", str(pema.plugin_path), "--n", "3",
                          "--shots", str(len(builtin.examples))]) == 0
    assert prompts[-1] == builtin
    (pema.plugin_path / "calibration.json").unlink()


def test_too_few_heldout_samples_is_said_and_nothing_is_stored(tiny, tiny_memory, tmp_path):
    from eval.calibrate import calibrate, split_heldout
    from plugins.api import train_plugin
    from plugins.registry import method_card

    knn, _ = train_plugin(tiny, tiny_memory, "knn", dict(method_card("knn").quick_settings),
                          out_dir=tmp_path / "knn")
    assert split_heldout(tiny_memory)[2]["warning"]
    with pytest.raises(UserError, match="too few held-out samples"):
        calibrate(tiny, knn, tiny_memory)
    assert not (knn.plugin_path / "calibration.json").exists()


def test_cancel_stops_and_stores_nothing(tiny, setup, tmp_path):
    import shutil

    from eval.calibrate import calibrate
    from plugins.api import open_plugin

    folder = tmp_path / "knn-copy"
    shutil.copytree(setup["knn"].plugin_path, folder)
    (folder / "calibration.json").unlink(missing_ok=True)
    knn = open_plugin(str(folder), tiny)
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 5

    with pytest.raises(Cancelled):
        calibrate(tiny, knn, setup["mem"], should_stop=stop)
    assert not (folder / "calibration.json").exists()


def test_a_plugin_that_does_not_mix_has_nothing_to_calibrate(tiny, setup):
    from eval.calibrate import calibrate

    class NotMixing:
        interpolates, level = False, "network"

    assert calibrate(tiny, NotMixing(), setup["mem"]) is None


# --- the studio: the training job calibrates; Compare, Evaluate and the picker start there -----------------------
@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    from _server import tiny_studio

    st = tiny_studio(tmp_path_factory.mktemp("cal-studio"))
    yield st
    st.close()


@pytest.fixture(scope="module")
def calibrated_knn(studio):
    """A kNN plug-in trained by the studio's job on a memory of 160 pairs (16 held out: 8 to tune on)."""
    from _server import build_tiny_memory

    from plugins.registry import method_card

    mid = build_tiny_memory(studio, PAIRS * 2, "cal-studio-mem")
    job = studio.jobs.wait(studio.plugin_service.submit_train(mid, "knn",
                                                              dict(method_card("knn").quick_settings),
                                                              "knn-cal"), 300)
    assert job["state"] == "done", job
    return mid, job


def test_training_job_calibrates_and_lists_show_it(studio, calibrated_knn):
    mid, job = calibrated_knn
    res = job["result"]
    assert res["calibration"]["n"] == 8 and res["calibration"]["label"] == \
        "tuned on 8 held-out samples of cal-studio-mem (few samples: a rough guide)"
    assert "tuned on 8 held-out samples" in res["message"]
    assert any("Calibrating" in line for line in job["log"]) if isinstance(job.get("log"), list) else True
    row = next(p for p in studio.plugin_service.plugins() if p["id"] == res["plugin_id"])
    assert row["calibration"]["settings"] == res["calibration"]["settings"]
    detail = studio.plugin_service.plugin_detail(res["plugin_id"])
    assert len(detail["calibration"]["table"]) >= 13 and "weights_sha256" not in detail["calibration"]


def test_compare_evaluate_and_picker_start_tuned_and_global_defaults_go_back(studio, calibrated_knn):
    from ui.compare import decode_settings_of, tuned_choices
    from ui.evaluate import _notes

    mid, job = calibrated_knn
    pid, cal = job["result"]["plugin_id"], job["result"]["calibration"]
    p = studio.compare_service.compare("the house is small", methods=["base", pid], max_new_tokens=8)
    row = next(r for r in p["rows"] if r["plugin_id"] == pid)
    assert row["settings"] == {**row["settings"], **cal["settings"]}
    assert row["tuned"]["label"] == "tuned on 8 held-out samples of cal-studio-mem (few samples: a rough guide)" \
        and row["tuned"]["at_tuned"]
    g = studio.compare_service.compare("the house is small", methods=["base", pid], max_new_tokens=8,
                                       global_defaults=True)
    grow = next(r for r in g["rows"] if r["plugin_id"] == pid)
    assert grow["tuned"] is None and grow["settings"] == studio.plugin_service.start_settings("translation")["knn"]
    # a share never carries the memory's name or the calibration
    shared = json.dumps(studio.compare_service.shared(studio.compare_service.share(p["id"])))
    assert "cal-studio-mem" not in shared and "tuned on" not in shared
    # the picker says where the plug-in starts
    label = dict((v, k) for k, v in tuned_choices(studio, None))[pid]
    assert "tuned:" in label and cal["evidence"]["text"] in label and "on 8 samples" in label
    # the Compare tab's untouched controls (at the start the page set) are not sent; moved ones are
    keys = [("knn", "k"), ("knn", "lambda")]
    starts = {"knn|k": cal["settings"]["k"], "knn|lambda": cal["settings"]["lambda"]}
    assert decode_settings_of(keys, [cal["settings"]["k"], 0.7], "{}", starts) == {"knn": {"lambda": 0.7}}
    assert decode_settings_of(keys, [cal["settings"]["k"], 0.7], "{}", starts, True) == \
        {"knn": {"k": cal["settings"]["k"], "lambda": 0.7}}
    # Evaluate on the memory: the 8 tuning samples are left out at the tuned settings, not at the global ones
    ev = studio.jobs.wait(studio.evaluate_service.submit_evaluate(methods=["base", pid], memory_id=mid, limit=0,
                                                                  max_new_tokens=8), 300)
    assert ev["state"] == "done", ev
    r = ev["result"]
    assert r["left_out_tuning_samples"] == 8 and r["pairs"] == 8 and r["tuned"]
    assert "without the 8 held-out samples a chosen plug-in was tuned on" in _notes(r)  # why n is 8, not 16
    assert next(m for m in r["methods"] if m["method"] == "knn")["settings"]["lambda"] == cal["settings"]["lambda"]
    ev = studio.jobs.wait(studio.evaluate_service.submit_evaluate(methods=["base", pid], memory_id=mid, limit=0,
                                                                  max_new_tokens=8, global_defaults=True), 300)
    assert ev["result"]["left_out_tuning_samples"] == 0 and ev["result"]["pairs"] == 16
    assert "tuned on" not in _notes(ev["result"])


def test_calibrate_job_on_demand_and_too_few_samples(studio, calibrated_knn):
    from _server import build_tiny_memory

    from plugins.registry import method_card

    mid, job = calibrated_knn
    j = studio.jobs.wait(studio.plugin_service.submit_calibrate(job["result"]["plugin_id"], max_samples=8), 300)
    assert j["state"] == "done", j
    assert j["result"]["n"] == 8 and j["result"]["table"][0]["settings"]["lambda"] == 0.0
    small = build_tiny_memory(studio, PAIRS[:12], "cal-small")
    t = studio.jobs.wait(studio.plugin_service.submit_train(small, "knn",
                                                            dict(method_card("knn").quick_settings), "s"), 300)
    assert t["state"] == "done", t
    assert t["result"]["calibration"]["skipped"] and "too few held-out samples" in t["result"]["message"]
    c = studio.jobs.wait(studio.plugin_service.submit_calibrate(t["result"]["plugin_id"]), 300)
    assert c["state"] == "failed" and "too few held-out samples" in json.dumps(c)
