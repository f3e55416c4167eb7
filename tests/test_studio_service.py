"""A studio a researcher trusts at a glance, on the tiny backbone, without a browser:

* honest training: elapsed time and ETA of jobs, progress in every phase (LoRA's precomputation included), the
  "stopped by time budget — under-trained" label, continue training from the saved optimizer state;
* evaluations a reviewer accepts: n, backbone and decode settings per row, 95% bootstrap intervals, paired-bootstrap
  p against the base model, sacreBLEU's signatures, per-sentence outputs with chrF, CSV/JSON downloads under the
  data directory (no pile-up), a sweep without duplicate rows;
* the repetition guard (``no_repeat_ngram``): off by default, the same for every row, it stops a looping row;
* warnings for memories too small to hold anything out or to train on.

    python -m pytest -q tests/test_studio_service.py
"""
import csv
import io
import json
import os
import time

import pytest
from _server import backbone_held, build_tiny_memory, tiny_studio

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3
# A budget far too small for the epochs asked for: training stops on the time budget.
BUDGET_PEMA = {"rank": 16, "max_minutes": 0.0003, "max_epochs_rct": 2, "max_epochs_joint": 400, "patience": 1000,
               "candidate_contexts": 64}


def has_repeated_ngram(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    st = tiny_studio(tmp_path_factory.mktemp("ux-data"))
    yield st
    st.close()


@pytest.fixture(scope="module")
def memory_id(studio):
    return build_tiny_memory(studio, PAIRS, "ux pairs")


@pytest.fixture(scope="module")
def budget_pema(studio, memory_id):
    job = studio.jobs.wait(studio.plugin_service.submit_train(memory_id, "pema", BUDGET_PEMA, "PEMA on a budget"), 180)
    assert job["state"] == "done", job
    return job


# --- honest training ---------------------------------------------------------------------------------------------
def test_training_status_labels_every_way_a_training_ends():
    from studio.job_status import training_status

    pema = {"reconstruction": {"phase": "reconstruction", "epochs": 2.0, "max_epochs": 2, "stopped_by": "max_epochs"},
            "joint": {"phase": "joint", "epochs": 0.39, "max_epochs": 20, "stopped_by": "time_budget"},
            "train_info": {"joint": {"stopped_by": "early_stopping"}}}
    st = training_status(pema)
    assert st["under_trained"] and st["stopped_by"] == "time_budget"
    assert st["label"] == "stopped by time budget at 0.39 of 20 epochs (joint phase) — under-trained"
    lora = {"phase": "lora", "epochs": 3.5, "max_epochs": 10, "stopped_by": "early_stopping",
            "train_info": {"stopped_by": "early_stopping"}}
    assert training_status(lora) == {"stopped_by": "early_stopping", "phase": "lora", "epochs": 3.5,
                                     "max_epochs": 10, "under_trained": False,
                                     "label": "converged: early stopping at 3.5 epochs"}
    assert training_status({"epochs": 10.0, "max_epochs": 10, "stopped_by": "max_epochs"})["label"] == \
        "ready: ran all 10 epochs"
    assert training_status({"entries": 88, "search": "exact"}) == {"stopped_by": None, "under_trained": False,
                                                                   "label": "ready"}  # kNN: nothing to train


def test_job_timing_and_its_rendering():
    from studio.job_status import job_timing
    from ui import render

    now = 1000.0
    running = {"state": "running", "started": 900.0, "finished": None, "progress": 0.25, "created": 890.0}
    t = job_timing(running, now)
    assert t == {"elapsed_s": 100.0, "eta_s": 300.0}
    assert render.job_time({**running, **t}) == "1m 40s elapsed · about 5m 00s left"
    early = job_timing({**running, "progress": 0.0}, now)
    assert early["eta_s"] is None and render.job_time({**running, **early}).endswith("estimating the time left…")
    assert job_timing({"state": "queued", "created": 990.0}, now) == {"elapsed_s": 10.0, "eta_s": None}
    done = job_timing({"state": "done", "started": 900.0, "finished": 965.0, "progress": 1.0}, now)
    assert done == {"elapsed_s": 65.0, "eta_s": None}
    assert render.job_time({"state": "done", **done}) == "ran 1m 05s"


def test_a_budget_stopped_plugin_is_labelled_under_trained_everywhere(studio, budget_pema):
    from ui import render

    res = budget_pema["result"]
    assert res["training"]["under_trained"] and "under-trained" in res["message"]
    assert "ready" not in res["message"]
    job = studio.job_service.job(budget_pema["id"])
    assert job["training"]["under_trained"] and job["elapsed_s"] >= 0 and job["eta_s"] is None
    card = render.job_card(job)
    assert "under-trained" in card and "stopped by time budget at" in card and "100%" not in card
    assert "ran " in card  # how long it ran
    row = render.jobs_table([job])[0]
    assert row[2] == "under-trained" and row[3] == "stopped early" and row[4].startswith("ran ")
    plug = next(p for p in studio.plugin_service.plugins() if p["id"] == res["plugin_id"])
    assert plug["training"]["under_trained"] and plug["can_continue"]
    line = render.plugins_table([plug])[0]
    assert line[render.PLUGIN_HEADERS.index("training")].startswith("⚠ stopped by time budget at ")
    assert "Continue training" in render.plugin_status(plug)


def test_every_phase_reports_progress_lora_precomputation_included(studio, memory_id):
    """No silent phase: LoRA prepares each batch's last-layer inputs inside the loop, the first time the batch is
    used (steps and early-stopping evaluations report it), and every training loop reports its evaluations."""
    from plugins.api import open_memory, train_plugin

    mem = open_memory(studio.catalog.memory(memory_id)["path"], studio.backbone_service.backbone())
    seen: list[tuple[float, float, str]] = []
    with studio.gate.use(holder="test"):
        train_plugin(studio.backbone_service.backbone(), mem, "lora", {"rank": 8, "max_epochs": 2, "batch_size": 2},
                     out_dir=studio.root / "lora-progress",
                     progress=lambda f, m: seen.append((time.time(), f, m)))
    msgs = [m for _, _, m in seen]
    assert sum(1 for m in msgs if m.startswith("lora: epoch")) >= 3, msgs[:10]  # one per step (batch_size 2)
    assert any("evaluating the early-stopping loss" in m for m in msgs)
    fracs = [f for _, f, _ in seen]
    assert fracs == sorted(fracs) and fracs[-1] <= 1.0  # progress only moves forward
    gaps = [b[0] - a[0] for a, b in zip(seen, seen[1:])]
    assert max(gaps) < 5.0


def test_run_training_resumes_from_its_optimizer_state():
    import torch

    from plugins.training import LoopSettings, optimizer_from_tensors, optimizer_tensors, run_training

    def setup():
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 1)
        x, y = torch.randn(32, 4), torch.randn(32, 1)
        loss = lambda idx: (((m(x[idx]) - y[idx]) ** 2).mean(), {})  # noqa: E731
        held = lambda: float(((m(x) - y) ** 2).mean().detach())  # noqa: E731
        return m, loss, held

    m, loss, held = setup()
    state: dict = {}
    s = LoopSettings(lr=1e-2, batch_size=8, max_epochs=2, patience=100)
    first = run_training(m, m.parameters(), 32, loss, held, s, "p", lambda f, msg: None, lambda: False, [],
                         state_out=state)
    assert first["steps"] == 8 and first["max_epochs"] == 2 and first["stopped_by"] == "max_epochs"
    assert state["loop"] == {"steps": 8, "epochs": 2.0}
    back = optimizer_from_tensors(optimizer_tensors(state))[""]
    assert back["loop"]["steps"] == 8
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    again: dict = {}
    second = run_training(m, m.parameters(), 32, loss, held, s, "p", lambda f, msg: None, lambda: False, [],
                          resume=back, state_out=again)
    assert second["continued_from_epochs"] == 2.0 and second["total_epochs"] == 4.0
    assert again["loop"]["steps"] == 16
    assert float(again["optimizer"]["state"][0]["step"]) == 16  # Adam's step count went on


def test_a_time_budget_stop_reports_time_budget():
    import torch

    from plugins.training import LoopSettings, run_training

    m = torch.nn.Linear(4, 1)
    x = torch.randn(64, 4)

    def slow_loss(idx):
        time.sleep(0.02)
        return m(x[idx]).pow(2).mean(), {}

    s = LoopSettings(batch_size=1, max_epochs=50, max_minutes=0.2 / 60, patience=1000)
    out = run_training(m, m.parameters(), 64, slow_loss, lambda: 1.0, s, "p", lambda f, msg: None, lambda: False, [])
    assert out["stopped_by"] == "time_budget" and out["epochs"] < 1


@pytest.mark.parametrize("method,config", [("pema", BUDGET_PEMA),
                                           ("lora", {"rank": 8, "max_epochs": 2, "batch_size": 4})])
def test_continue_training_resumes_from_the_saved_optimizer(studio, memory_id, method, config):
    from safetensors.torch import load_file

    from studio.plugin_service import OPTIMIZER_FILE

    first = studio.jobs.wait(studio.plugin_service.submit_train(memory_id, method, config, f"{method} first"), 180)
    assert first["state"] == "done", first
    pid = first["result"]["plugin_id"]
    folder = studio.root / "plugins" / pid
    saved = load_file(str(folder / OPTIMIZER_FILE))
    assert any("/exp_avg" in k for k in saved) and any(k.endswith("loop/steps") for k in saved)
    with pytest.raises(Exception, match="can change only"):
        studio.plugin_service.submit_continue(pid, {"rank": 4})
    jid = studio.plugin_service.submit_continue(pid, {"max_minutes": 0.5})
    job = studio.jobs.wait(jid, 180)
    assert job["state"] == "done", job
    new = job["result"]
    assert new["plugin_id"] != pid and new["name"] == f"{method} first (continued)"
    info = new["metrics"]["train_info"]
    assert info["continued_from"] == pid
    phase = new["metrics"]["joint"] if method == "pema" else new["metrics"]
    before = first["result"]["metrics"]["joint"] if method == "pema" else first["result"]["metrics"]
    assert phase["continued_from_epochs"] == pytest.approx(before["epochs"], abs=0.01)
    assert phase["total_epochs"] > before["epochs"]
    assert (studio.root / "plugins" / new["plugin_id"] / OPTIMIZER_FILE).exists()
    assert any(p["id"] == pid for p in studio.plugin_service.plugins())  # the original stays
    c = studio.compare_service.compare("the house is small", "translation", ["base", new["plugin_id"]],
                                       max_new_tokens=6)
    assert len(c["rows"]) == 2


def test_only_resumable_methods_continue(studio, memory_id):
    job = studio.jobs.wait(studio.plugin_service.submit_train(memory_id, "knn", {}, "knn"), 120)
    with pytest.raises(Exception, match="cannot continue training"):
        studio.plugin_service.submit_continue(job["result"]["plugin_id"])
    assert not next(p for p in studio.plugin_service.plugins() if p["id"] == job["result"]["plugin_id"])["can_continue"]


def test_a_plugin_is_never_continued_twice_at_once(studio, memory_id):
    """While a continuation of a plug-in is queued or running, a second one (the API does not see the disabled
    button) is refused with a UserError naming the job; another plug-in's continuation queues behind it; once the
    first ends, the plug-in continues again."""
    from ground.errors import UserError

    short = {"max_epochs": 1, "patience": 1000, "max_minutes": 0.0}
    first, other = (studio.jobs.wait(studio.plugin_service.submit_train(memory_id, "adapter", short, name), 120)
                    for name in ("adapter once", "adapter other"))
    assert first["state"] == "done" and other["state"] == "done", (first, other)
    pid, other_pid = first["result"]["plugin_id"], other["result"]["plugin_id"]
    with backbone_held(studio, 120):  # the continuation waits for it, queued or running, until released
        jid = studio.plugin_service.submit_continue(pid, {"max_epochs": 2})
        assert studio.job_service.job(jid)["state"] in ("queued", "running")
        with pytest.raises(UserError, match=f"'adapter once' is already being continued by job {jid}"):
            studio.plugin_service.submit_continue(pid, {"max_epochs": 3})
        other_jid = studio.plugin_service.submit_continue(other_pid, {"max_epochs": 2})
    assert studio.jobs.wait(jid, 120)["state"] == "done"
    assert studio.jobs.wait(other_jid, 120)["state"] == "done"
    conts = [j for j in studio.job_service.list_jobs(("train_plugin",), 50, owner=None)
             if j["args"].get("continue_from") == pid]
    assert [j["id"] for j in conts] == [jid]  # the refused one was never queued
    again = studio.jobs.wait(studio.plugin_service.submit_continue(pid, {"max_epochs": 2}), 120)
    assert again["state"] == "done", again


# --- the repetition guard ----------------------------------------------------------------------------------------
def test_ban_repeated_ngrams_bans_exactly_the_completing_tokens():
    import torch

    from engine import ban_repeated_ngrams

    lp = torch.zeros(2, 10)
    n = ban_repeated_ngrams(lp, [[1, 2, 3, 1, 2], [4, 4]], 3)  # row 0: "1 2" → 3 would repeat "1 2 3"
    assert n == 1 and lp[0, 3] == float("-inf") and torch.isfinite(lp[0, :3]).all()
    assert torch.isfinite(lp[1]).all()  # "4 4" seen once, and 3-grams need 3 tokens of history
    lp = torch.zeros(1, 10)
    assert ban_repeated_ngrams(lp, [[5, 6, 5]], 2) == 1 and lp[0, 6] == float("-inf")
    assert ban_repeated_ngrams(torch.zeros(1, 10), [[5, 5, 5]], 0) == 0  # off


def test_the_guard_stops_a_looping_row_and_applies_to_every_row_alike(tiny):
    from engine import Row, compare

    loop = compare(tiny, "the house is small", [Row("base")], max_new_tokens=24)
    assert has_repeated_ngram(loop.rows[0].tokens, 3), "the tiny model is expected to loop here"
    assert loop.rows[0].settings == {}  # off by default: nothing recorded, the papers' decoding
    guarded = compare(tiny, "the house is small", [Row("base"), Row("again")], max_new_tokens=24,
                      no_repeat_ngram=3)
    for r in guarded.rows:
        assert not has_repeated_ngram(r.tokens, 3) and r.settings == {"no_repeat_ngram": 3}
    assert guarded.rows[0].tokens == guarded.rows[1].tokens
    # given in one row's settings (as --set no_repeat_ngram=3 does for the plug-in rows), every row gets it
    via_row = compare(tiny, "the house is small", [Row("base"), Row("b", None, {"no_repeat_ngram": 3})],
                      max_new_tokens=24)
    assert [r.tokens for r in via_row.rows] == [r.tokens for r in guarded.rows]
    with pytest.raises(Exception, match="every row of a comparison alike"):
        compare(tiny, "x", [Row("a", None, {"no_repeat_ngram": 2}), Row("b", None, {"no_repeat_ngram": 3})])


def test_the_guard_is_declared_once_and_addressed_to_all_rows():
    from engine.comparison import COMPARISON_SETTINGS
    from plugins.knn import KNN
    from plugins.pema import PEMA
    from plugins.settings import ALL_ROWS, address_sets, resolve_row_settings

    assert [s.name for s in COMPARISON_SETTINGS] == ["no_repeat_ngram"] and COMPARISON_SETTINGS[0].default == 0
    assert address_sets({"no_repeat_ngram": 3, "pema.lambda_max": 0.5}, [("pema", PEMA), ("knn", KNN)]) == \
        {ALL_ROWS: {"no_repeat_ngram": 3}, "pema": {"lambda_max": 0.5}}
    assert resolve_row_settings(("knn", "knn-1", "kNN"), {ALL_ROWS: {"no_repeat_ngram": 2}, "knn": {"k": 4}}) == \
        {"no_repeat_ngram": 2, "k": 4}
    with pytest.raises(Exception, match="Only settings of the whole comparison"):
        resolve_row_settings(("knn",), {ALL_ROWS: {"k": 4}})


def test_studio_compare_applies_the_guard_to_the_base_row_too(studio, budget_pema):
    pid = budget_pema["result"]["plugin_id"]
    plain = studio.compare_service.compare("the house is small", "translation", ["base", pid], max_new_tokens=24)
    assert all("no_repeat_ngram" not in r["settings"] for r in plain["rows"])
    g = studio.compare_service.compare("the house is small", "translation", ["base", pid],
                                       {"all": {"no_repeat_ngram": 3}},
                                       max_new_tokens=24)
    assert [r["settings"].get("no_repeat_ngram") for r in g["rows"]] == [3, 3]
    assert not any(has_repeated_ngram(r["tokens"], 3) for r in g["rows"])
    kw = studio.compare_service.compare("the house is small", "translation", ["base", pid], max_new_tokens=24,
                                        no_repeat_ngram=3)
    assert [r["tokens"] for r in kw["rows"]] == [r["tokens"] for r in g["rows"]]


# --- evaluations -------------------------------------------------------------------------------------------------
def test_metrics_intervals_pvalues_signatures_and_sentence_chrf():
    from eval.metrics import bleu_chrf, bootstrap_ci, paired_bootstrap, sentence_chrf, signatures

    refs = ["das Haus ist klein", "die Katze schlaeft", "Guten Morgen", "hallo Welt"] * 5
    good = list(refs)
    bad = ["das Haus", "Katze", "Morgen", "Welt"] * 5
    ci = bootstrap_ci(bad, refs, n_samples=300)
    corpus = bleu_chrf(bad, refs)
    for k in ("sacrebleu", "chrf"):
        assert ci[k][0] <= corpus[k] <= ci[k][1]
    pb = paired_bootstrap(bad, good, refs, n_samples=300)
    assert pb["chrf"]["delta"] > 0 and pb["chrf"]["p_value"] < 0.05
    assert sentence_chrf(["das Haus ist klein", "x"], ["das Haus ist klein", "hallo Welt"])[0] == 100.0
    sig = signatures()
    assert sig["sacrebleu"].startswith("nrefs:1|case:mixed|eff:no|tok:13a") and "nc:6" in sig["chrf"]
    assert signatures(4)["sacrebleu"].startswith("nrefs:4")


@pytest.fixture(scope="module")
def evaluation(studio, budget_pema):
    tsv = "\n".join(f"{s}\t{t}" for s, t in PAIRS[:6])
    jid = studio.evaluate_service.submit_evaluate(methods=["base", budget_pema["result"]["plugin_id"]], test_data=tsv,
                                                  test_filename="test.tsv", limit=6, max_new_tokens=16,
                                                  settings={"all": {"no_repeat_ngram": 2}})
    job = studio.jobs.wait(jid, 180)
    assert job["state"] == "done", job
    return job


def test_an_evaluation_reports_what_a_reviewer_needs(evaluation):
    res = evaluation["result"]
    base, pema = res["methods"]
    for m in (base, pema):
        assert m["n"] == 6 and m["backbone"].startswith("tiny") and m["max_new_tokens"] == 16
        assert m["no_repeat_ngram"] == 2 and m["settings"]["no_repeat_ngram"] == 2  # the base row too
        assert len(m["sacrebleu_ci95"]) == 2 and len(m["chrf_ci95"]) == 2
        assert m["bleu_signature"].startswith("nrefs:1") and m["chrf_signature"]
    assert "p_chrf" not in base and 0 <= pema["p_chrf"] <= 1 and "chrf_delta" in pema and "p_sacrebleu" in pema
    assert pema["settings"]["lambda_max"] == 0.8
    assert res["signatures"]["sacrebleu"].startswith("nrefs:1") and res["decode"]["no_repeat_ngram"] == 2
    o = res["outputs"][0]
    assert {"source", "reference", base["label"], pema["label"], f"chrF · {base['label']}",
            f"chrF · {pema['label']}"} <= set(o)


def test_evaluation_files_are_per_owner_and_do_not_pile_up(studio, evaluation):
    files = studio.evaluate_service.evaluation_files(evaluation["id"])
    names = sorted(f.name for f in files)
    stem = f"pema-eval-{evaluation['id']}"
    assert names == sorted([f"{stem}-scores.csv", f"{stem}.json", f"{stem}-outputs.csv"])
    root = studio.downloads.downloads_root()
    assert all(f.parent.parent == root for f in files)  # under the data directory, one folder per owner
    again = studio.evaluate_service.evaluation_files(evaluation["id"])
    assert again == files and len(list(files[0].parent.iterdir())) == 3  # the same files, nothing more
    scores = list(csv.DictReader(io.StringIO(files[[f.name for f in files].index(f"{stem}-scores.csv")]
                                              .read_text(encoding="utf-8"))))
    assert {"label", "n", "sacrebleu", "sacrebleu_ci95", "p_chrf", "settings", "backbone", "bleu_signature",
            "no_repeat_ngram", "max_new_tokens", "data"} <= set(scores[0])
    outs = list(csv.DictReader(io.StringIO(next(f for f in files if f.name.endswith("-outputs.csv"))
                                           .read_text(encoding="utf-8"))))
    assert len(outs) == 6 and outs[0]["source"] == PAIRS[0][0] and "chrF · Base model" in outs[0]
    data = json.loads(next(f for f in files if f.suffix == ".json").read_text(encoding="utf-8"))
    assert data["methods"][1]["chrf_ci95"] and len(data["outputs"]) == 6
    # an old file of anyone's is removed when new files are written
    old = root / "someone" / "old.csv"
    old.parent.mkdir(parents=True, exist_ok=True)
    old.write_text("x")
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    studio.evaluate_service.evaluation_files(evaluation["id"])
    assert not old.exists() and not old.parent.exists()
    with pytest.raises(Exception, match="No job"):
        studio.evaluate_service.evaluation_files(evaluation["id"], owner="someone-else")


def test_the_evaluate_tab_tables(evaluation):
    from ui.evaluate import _decode_table, _notes, _outputs_table, _table

    res = evaluation["result"]
    cols, rows = _table(res)
    assert cols[:8] == ["method", "n", "BLEU", "BLEU 95% CI", "BLEU Δ vs base (p)", "chrF", "chrF 95% CI",
                        "chrF Δ vs base (p)"]
    assert rows[0][0] == "Base model [base]" and rows[0][4] == "—" and "(p=" in rows[1][4] and "–" in rows[1][3]
    dec = _decode_table(res)
    assert dec[0][1] == "max 16 tokens · greedy · no_repeat_ngram=2" and "lambda_max" in dec[1][2]
    assert dec[1][3].startswith("tiny")
    notes = _notes(res)
    assert "n = 6" in notes and "nrefs:1|case:mixed" in notes and "95% CI" in notes
    ocols, orows = _outputs_table(res)
    assert ocols == ["#", "source", "reference", "method", "output", "chrF"] and len(orows) == 12
    assert orows[0][:4] == [1, PAIRS[0][0], PAIRS[0][1], "Base model"] and orows[1][1] == ""


def test_no_intervals_on_too_few_sentences(tiny):
    from backbone.prompts import Prompt
    from engine import Row
    from eval.run import MIN_BOOTSTRAP_N, evaluate
    from ui.evaluate import _table

    res = evaluate(tiny, PAIRS[:MIN_BOOTSTRAP_N - 1], [Row("base"), Row("again")], Prompt.for_task("translation"),
                   max_new_tokens=4)
    assert all("sacrebleu_ci95" not in m and "p_chrf" not in m for m in res["methods"])
    assert res["methods"][0]["bleu_signature"]  # the signature is still there
    cols, rows = _table(res)
    assert rows[1][cols.index("BLEU 95% CI")] == f"— (n < {MIN_BOOTSTRAP_N})"
    res = evaluate(tiny, PAIRS[:MIN_BOOTSTRAP_N], [Row("base"), Row("again")], Prompt.for_task("translation"),
                   max_new_tokens=4, bootstrap=50)  # exactly MIN_BOOTSTRAP_N: intervals and p
    assert all("chrf_ci95" in m for m in res["methods"]) and "p_chrf" in res["methods"][1]


def test_a_sweep_has_one_base_point(studio, memory_id, budget_pema):
    from ui import plots
    from ui.evaluate import _table

    jid = studio.evaluate_service.submit_evaluate(memory_id=memory_id, limit=1,
                                                  sweep_plugin=budget_pema["result"]["plugin_id"],
                                                  lambdas=[0.0, 0.5, 0.5, 1.0], max_new_tokens=8)
    job = studio.jobs.wait(jid, 180)
    assert job["state"] == "done", job
    pts = job["result"]["sweep"]
    keys = [(p["lambda_max"], p["gu"]) for p in pts]
    assert len(keys) == len(set(keys)) == 5 and keys[0] == (0.0, None)
    cols, rows = _table(job["result"])
    assert cols[:3] == ["point", "λ_max", "GU"] and rows[0][2] == "—"
    fig = plots.sweep_lines(pts)
    assert all(tr.x[0] == 0.0 for tr in fig.data)  # the base point starts both curves


def test_downloads_are_not_served_by_their_path(studio, evaluation):
    import asyncio

    from ui.server import OwnerCookieMiddleware

    f = studio.evaluate_service.evaluation_files(evaluation["id"])[0]
    called = []

    async def app(scope, receive, send):
        called.append(scope["path"])

    mw = OwnerCookieMiddleware(app, studio, downloads=studio.downloads.downloads_root())
    sent = []

    async def send(msg):
        sent.append(msg)

    for path in (f"/gradio_api/file={f}", f"/gradio_api/file={f.parent}/../{f.parent.name}/{f.name}"):
        sent.clear()
        asyncio.run(mw({"type": "http", "path": path, "method": "GET", "headers": []}, None, send))
        assert sent[0]["status"] == 404
    sent.clear()
    asyncio.run(mw({"type": "http", "path": "/gradio_api/file=/tmp/gradio/abc/x.csv", "method": "GET",
                    "headers": []}, None, send))
    assert sent[0]["status"] == 404 and called == []  # the middleware answers every file route; Gradio's never runs


# --- small memories ------------------------------------------------------------------------------------------------
def test_memory_warnings():
    from ui.render import memory_warning

    tiny_mem = {"name": "four", "samples": 4, "heldout_samples": 0}
    assert "0 held-out samples" in memory_warning(tiny_mem, "heldout")
    assert "too few to train on" in memory_warning({"name": "one", "samples": 1, "heldout_samples": 0}, "train")
    assert "only 4 training samples" in memory_warning(tiny_mem, "train")
    assert "only 1 sample" in memory_warning({"name": "m", "samples": 12, "heldout_samples": 1}, "heldout")
    assert memory_warning({"name": "big", "samples": 500, "heldout_samples": 50}, "train") == ""
    assert memory_warning({"name": "big", "samples": 500, "heldout_samples": 50}, "heldout") == ""
    assert memory_warning(None, "train") == ""


def test_output_cards_have_copy_and_view_buttons_and_explain_the_score():
    from ui import render

    p = {"source": "s", "base_label": "Base model", "timings": {}, "rows": [
        {"label": "Base model", "method": "base", "text": "a b", "tokens": [1], "diff": [["a b", "same"]]},
        {"label": "A plug-in with a very long name that must not be cut", "method": "pema", "text": "a c",
         "tokens": [1], "diff": [["a", "same"], ["b", "removed"], ["c", "added"]], "settings": {"lambda_max": 0.5}}]}
    html = render.output_cards(p)
    assert html.count("data-pema-action='copy'") == 2 and html.count("data-pema-action='view'") == 1
    assert "pema-card-plain'>a c<" in html and "<del>b</del>" in html
    assert "<abbr class='pema-term' title='score: the output" in html
    assert "title='A plug-in with a very long name that must not be cut'" in html


def test_a_shared_comparison_shows_no_owner_timing():
    """A recipient of a shared link saw the owner's last action ("Re-decoded 3 method(s) from the kept decode:
    0.71s …"): the shared view says what was compared, not how long the owner's last slider move took."""
    from ui import render

    p = {"source": "s", "base_label": "Base model", "steps": 5,
         "timings": {"decode_s": 0.71, "total_s": 0.9, "reuse": {"kind": "slider move", "reused_steps": 4}},
         "rows": [{"label": "Base model", "method": "base", "text": "a b", "tokens": [1], "diff": [["a b", "same"]]},
                  {"label": "pema", "method": "pema", "text": "a c", "tokens": [1],
                   "diff": [["a", "same"], ["b", "removed"], ["c", "added"]]}]}
    own, shared = render.output_cards(p), render.output_cards(p, shared=True)
    assert "Re-decoded 2 method(s)" in own and "0.71s" in own
    assert "Re-decoded" not in shared and "0.71s" not in shared and "0.90s" not in shared
    assert "2 method(s), decoded in one batch" in shared and "<del>b</del>" in shared


# --- memory profile, neighbour maps, several sentences, examples --------------------------------------------------
@pytest.fixture(scope="module")
def knn_id(studio, memory_id):
    job = studio.jobs.wait(studio.plugin_service.submit_train(memory_id, "knn", {}, "kNN for maps"), 120)
    assert job["state"] == "done", job
    return job["result"]["plugin_id"]


def test_memory_profile_counts_tokens_and_projects_a_seeded_sample(studio, memory_id):
    import numpy as np

    from memories.profile import memory_profile, project, scaled_keys
    from memories.store import Memory

    prof = studio.memory_service.memory_profile(memory_id)
    assert studio.memory_service.memory_profile(memory_id) is prof  # computed once per memory
    mem = Memory.load(studio.catalog.memory(memory_id)["path"])
    ids, counts = np.unique(np.asarray(mem.values), return_counts=True)
    # 4 sentences x 3 exact duplicates: the grouped split holds out one whole group of 3
    assert (prof["entries"], prof["samples"], prof["heldout_samples"]) == (len(mem), 9, 3)
    assert prof["distinct_tokens"] == len(ids) and prof["entries_per_sample"] == round(len(mem) / 9, 2)
    got = {t["token_id"]: t["count"] for t in prof["top_tokens"]}
    assert got == {int(i): int(c) for i, c in zip(ids, counts) if int(i) in got}
    assert [t["count"] for t in prof["top_tokens"]] == sorted(got.values(), reverse=True)
    assert prof["top_tokens"][0]["count"] == counts.max()
    newline = next(t for t in prof["top_tokens"] if t["text"] == "\n")  # every target ends with a line end
    assert newline["count"] == 9
    proj = prof["projection"]
    assert proj["sample_size"] == len(mem) == len(proj["points"])  # a small memory: every key is on the map
    assert 1 >= proj["explained"][0] >= proj["explained"][1] >= 0
    # the stored points are the projection of the sampled keys / key RMS; so is any vector put on the map later
    again = project(prof, scaled_keys(mem, np.asarray(proj["entries"])))
    assert np.allclose(again, np.asarray(proj["points"]), atol=1e-3)
    assert [int(mem.values[e]) for e in proj["entries"]] == proj["tokens"]
    # the two directions are the principal ones: those of a full SVD of the centred sample
    x = scaled_keys(mem, np.asarray(proj["entries"])).astype(np.float64)
    _, s, vt = np.linalg.svd(x - x.mean(0), full_matrices=False)
    assert np.allclose(np.abs((np.asarray(proj["components"]) * vt[:2]).sum(1)), 1, atol=1e-6)
    assert np.allclose(proj["explained"], (s[:2] ** 2) / (s ** 2).sum(), atol=1e-4)
    # at most `sample` keys, a seeded sample: the same seed draws the same entries, another seed others
    a, b, c = (memory_profile(mem, sample=20, seed=s) for s in (0, 0, 1))
    assert len(a["projection"]["points"]) == 20 and a["projection"] == b["projection"]
    assert a["projection"]["entries"] != c["projection"]["entries"]


def test_a_picked_token_shows_its_spread_and_its_sentences(studio, memory_id):
    prof = studio.memory_service.memory_profile(memory_id)
    train = studio.memory_service.load_memory(memory_id).split_samples("train")  # the split decides which targets
    targets = sorted({s["tgt"] for s in train})

    def holders(text):
        return [t for t in targets if text in " " + t]

    # a word piece of one training target only (the tiny tokenizer: " Ha" "us", " Kat" "ze", " Mor" "gen")
    picked = next(t for t in prof["top_tokens"] if len(t["text"].strip()) >= 2 and len(holders(t["text"])) == 1)
    tgt = holders(picked["text"])[0]
    info = studio.memory_service.memory_token(memory_id, picked["token_id"])
    assert info["count"] == picked["count"] == info["in_sample"] and info["spread"] == picked["spread"]
    assert info["count"] == sum(s["tgt"] == tgt for s in train) > 0
    assert info["occurrences"] and all(o["match"] == picked["text"] for o in info["occurrences"])
    for o in info["occurrences"]:
        assert o["source"] == next(s["src"] for s in train if s["tgt"] == tgt)
        assert (o["before"] + o["match"] + o["after"]).strip() == tgt
    from ground.errors import UserError

    with pytest.raises(UserError, match="No memory"):  # another owner's memory does not exist for them
        studio.memory_service.memory_profile(memory_id, owner="someone-else")
    with pytest.raises(UserError, match="no entry with token"):
        studio.memory_service.memory_token(memory_id, 399)


def test_neighbour_map_of_a_knn_row_is_the_decode_s_retrieval(studio, memory_id, knn_id):
    import numpy as np

    from memories.profile import project

    p = studio.compare_service.compare("the house is small", "translation", ["base", knn_id], max_new_tokens=6)
    row = next(r for r in p["rows"] if r["method"] == "knn")
    prof = studio.memory_service.memory_profile(memory_id)
    for i in range(len(row["tokens"])):
        m = studio.neighbour_map_service.neighbour_map(p["id"], row["label"], i)
        traced = row["trace"][i]["neighbours"]
        assert [n["entry"] for n in m["neighbours"]] == [n["entry"] for n in traced][:len(m["neighbours"])]
        # the map's query is the decode's: its distances to the neighbours are the ones kNN computed
        assert np.allclose([n["distance"] for n in m["neighbours"]], [n["distance"] for n in traced][:8],
                           atol=2e-2, rtol=1e-3)
        assert m["token"] == row["token_texts"][i] and m["query_kind"].startswith("f(c) / key RMS")
        for n in m["neighbours"]:
            assert n["match"] == n["token"] and n["same_as_output"] == (n["token_id"] == row["tokens"][i])
            assert n["source"] == studio.memory_service.load_memory(memory_id).samples[n["sample"]]["src"]
            assert len(n["xy"]) == 2
    # the sentence is in the memory: the first token's context is a stored key, so it sits on its neighbour
    m0 = studio.neighbour_map_service.neighbour_map(p["id"], row["label"], 0)
    assert m0["neighbours"][0]["distance"] < 1e-3
    assert np.allclose(m0["query"], m0["neighbours"][0]["xy"], atol=1e-2)
    assert np.allclose(project(prof, np.zeros((1, len(prof["projection"]["mean"])))),
                       -np.asarray(prof["projection"]["components"]) @ np.asarray(prof["projection"]["mean"]),
                       atol=1e-4)


def test_neighbour_map_of_a_pema_row_places_h_pd_among_the_keys(studio, memory_id, budget_pema):
    import numpy as np
    import torch

    from memories.profile import scaled_keys
    from memories.store import Memory

    pid = budget_pema["result"]["plugin_id"]
    p = studio.compare_service.compare("the cat sleeps", "translation", ["base", pid], max_new_tokens=4)
    row = next(r for r in p["rows"] if r["method"] == "pema")
    m = studio.neighbour_map_service.neighbour_map(p["id"], row["label"], 1, k=5)
    assert m["method"] == "pema" and m["query_kind"].startswith("h_pd") and len(m["neighbours"]) == 5
    # the exact 5 nearest keys to h_pd (rescaled to the keys' RMS), recomputed here from the plug-in itself
    bb, plugin = studio.backbone_service.backbone(), studio.plugin_service.load_plugin(pid)
    ids = torch.tensor([p["context_ids"] + row["tokens"][:1]])
    with torch.no_grad():
        fc, _ = bb.forward_fc(ids)
        h = plugin.h_pd(plugin.scaled(fc[:, -1])).numpy()
    h = h / np.sqrt((h ** 2).mean())
    mem = Memory.load(studio.catalog.memory(memory_id)["path"])
    d = ((scaled_keys(mem, np.arange(len(mem))) - h) ** 2).sum(1)
    assert np.allclose(sorted(d)[:5], [n["distance"] for n in m["neighbours"]], rtol=1e-3, atol=1e-3)
    assert [n["rank"] for n in m["neighbours"]] == [1, 2, 3, 4, 5]


def test_neighbour_maps_are_for_knn_and_pema_rows_of_the_owner(studio, knn_id):
    from ground.errors import UserError

    p = studio.compare_service.compare("good morning", "translation", ["base", knn_id], max_new_tokens=3)
    with pytest.raises(UserError, match="for kNN and PEMA rows"):
        studio.neighbour_map_service.neighbour_map(p["id"], "Base model", 0)
    with pytest.raises(UserError, match="does not exist"):
        studio.neighbour_map_service.neighbour_map(p["id"], "kNN for maps", 99)
    with pytest.raises(UserError, match="no longer in memory"):  # another owner's comparison
        studio.neighbour_map_service.neighbour_map(p["id"], "kNN for maps", 0, owner="someone-else")


def test_several_sentences_one_batch_a_column_per_method_and_scores(studio, budget_pema):
    import dataclasses

    from eval.metrics import sentence_bleu, sentence_chrf
    from ground.errors import UserError
    from studio.several_service import parse_lines

    assert parse_lines("a ||| b\n\n c\td \ne |||  \n") == [
        {"line": 1, "source": "a", "reference": "b"}, {"line": 3, "source": "c", "reference": "d"},
        {"line": 4, "source": "e", "reference": None}]
    with pytest.raises(UserError, match="Line 2: there is no sentence"):
        parse_lines("a\n ||| b")
    pid = budget_pema["result"]["plugin_id"]
    text = "the house is small ||| das Haus ist klein\nthe cat sleeps\tdie Katze schlaeft\ngood morning"
    res = studio.compare_service.compare_several(text, "translation", ["base", pid], max_new_tokens=8)
    assert [c["method"] for c in res["columns"]] == ["base", "pema"] and res["timings"]["sentences"] == 3
    assert [ln["reference"] for ln in res["lines"]] == ["das Haus ist klein", "die Katze schlaeft", None]
    assert res["lines"][2]["scores"] is None
    for ln in res["lines"][:2]:
        assert ln["scores"] == [{"sacrebleu": sentence_bleu([o], [ln["reference"]])[0],
                                 "chrf": sentence_chrf([o], [ln["reference"]])[0]} for o in ln["outputs"]]
    assert [c["n"] for c in res["corpus"]] == [2, 2]
    # one batch computes what one comparison per sentence does
    for ln in res["lines"]:
        one = studio.compare_service.compare(ln["source"], "translation", ["base", pid], max_new_tokens=8)
        assert ln["outputs"] == [r["text"] for r in one["rows"]]
    limits = studio.limits
    try:
        studio.limits = dataclasses.replace(limits, compare_lines=2, input_chars=30)
        with pytest.raises(UserError, match="number of sentences is 3; the limit is 2.*compare_lines"):
            studio.compare_service.compare_several(text, "translation", ["base"])
        with pytest.raises(UserError, match="line 2's sentence's length"):
            studio.compare_service.compare_several("ok\n" + "x" * 31, "translation", ["base"])
    finally:
        studio.limits = limits
    with pytest.raises(UserError, match="No plug-in"):  # another owner's plug-in
        studio.compare_service.compare_several("a", "translation", ["base", pid], owner="someone-else")


def test_the_views_of_profiles_maps_and_several_sentences(studio, memory_id, knn_id):
    from ui import plots, render
    from ui.inspect import mapped_rows, output_token_choices

    prof = studio.memory_service.memory_profile(memory_id)
    assert "entries" in render.profile_summary(prof) and "PCA" in render.profile_summary(prof)
    full = plots.memory_map(prof)
    assert sum(len(t.x) for t in full.data) == prof["projection"]["sample_size"]
    tid = prof["top_tokens"][0]["token_id"]
    one = plots.memory_map(prof, tid)
    assert [t.name for t in one.data] == ["other tokens", "“⏎”", "its centroid"]
    assert len(one.data[1].x) == prof["top_tokens"][0]["in_sample"]
    assert len(plots.token_frequencies(prof).data[0].y) == min(20, len(prof["top_tokens"]))
    detail = render.token_detail(studio.memory_service.memory_token(memory_id, tid))
    assert "<mark>⏎</mark>" in detail
    # one the split left in training
    src = studio.memory_service.load_memory(memory_id).split_samples("train")[0]["src"]
    p = studio.compare_service.compare(src, "translation", ["base", knn_id], max_new_tokens=3)
    assert [r["label"] for r in mapped_rows(p)] == ["kNN for maps"]
    assert output_token_choices(mapped_rows(p)[0])[0][1] == 0
    m = studio.neighbour_map_service.neighbour_map(p["id"], "kNN for maps", 0)
    fig = plots.neighbour_map(m)
    assert fig.data[-1].name == "query f(c)" and list(fig.data[-1].x) == [m["query"][0]]
    html = render.neighbour_list(m)
    assert html.count("<mark>") == len(m["neighbours"]) and src in html
    # several sentences: a column per method, scores under each output and the corpus row
    res = {"columns": [{"label": "Base model", "settings": {}}, {"label": "P <1>", "settings": {"lambda_max": 0.5}}],
           "lines": [{"line": 1, "source": "a", "reference": "b", "outputs": ["x", ""],
                      "scores": [{"sacrebleu": 1.5, "chrf": 2.25}, {"sacrebleu": 0.0, "chrf": 0.0}]}],
           "corpus": [{"label": "Base model", "sacrebleu": 1.5, "chrf": 2.25, "n": 1},
                      {"label": "P <1>", "sacrebleu": 0.0, "chrf": 0.0, "n": 1}], "timings": {"sentences": 1}}
    t = render.several_table(res)
    assert "<th>P &lt;1&gt;</th>" not in t and ">P &lt;1&gt;</th>" in t and "BLEU 1.5 · chrF 2.2" in t
    assert "(empty output)" in t and "<b>corpus</b> (1 sentence with a reference)" in t


def test_cards_score_each_output_against_a_given_reference():
    from eval.metrics import sentence_bleu
    from ui import render

    p = {"source": "s", "base_label": "Base model", "timings": {}, "reference": "das Haus ist klein", "rows": [
        {"label": "Base model", "method": "base", "text": "das Haus ist klein", "tokens": [1],
         "diff": [["das Haus ist klein", "same"]]},
        {"label": "PEMA", "method": "pema", "text": "das Haus", "tokens": [1], "diff": [["das Haus", "same"]]}]}
    html = render.output_cards(p)
    assert html.count("vs reference</abbr>") == 2 and "BLEU 100.0 · chrF 100.0" in html
    assert f"BLEU {sentence_bleu(['das Haus'], ['das Haus ist klein'])[0]:.1f}" in html
    assert "vs reference" not in render.output_cards({**p, "reference": None})


def test_example_sentences_for_every_task():
    from backbone.prompts import TASKS
    from backbone.tasks import FEW_SHOT, example_sentences

    for task in TASKS:
        ex = example_sentences(task)
        assert len(ex) >= 3 and all(s.strip() and r.strip() for s, r in ex)
        assert not {s for s, _ in ex} & {s for s, _ in FEW_SHOT.get(task, [])}
    assert example_sentences("no such task") == []


def test_output_cards_say_when_a_comparison_was_answered_from_the_kept_decode():
    """A slider move (or the same request again) answered from the kept decode says so and how many forward passes
    it ran, instead of a token rate over near-zero seconds."""
    from ui import render

    rows = [{"label": "Base model", "method": "base", "text": "a", "tokens": [1], "diff": [["a", "same"]]}]
    full = {"source": "s", "base_label": "Base model", "steps": 3, "rows": rows,
            "timings": {"decode_s": 1.5, "tokens": 3, "tokens_per_s": 2.0, "total_s": 1.6,
                        "reuse": {"kind": "full decode", "forward_passes": None, "reused_steps": 0}}}
    assert "One batched decode of 1 method(s)" in render.output_cards(full) and "2 tok/s" in render.output_cards(full)
    kept = {**full, "timings": {"decode_s": 0.001, "tokens": 3, "tokens_per_s": 3000.0, "total_s": 0.01,
                                "reuse": {"kind": "slider move", "forward_passes": 0, "reused_steps": 3}}}
    html = render.output_cards(kept)
    assert "from the kept decode" in html and "no forward pass" in html and "3 row-steps reused" in html
    assert "tok/s" not in html
    moved = {**kept, "timings": {**kept["timings"], "reuse": {"kind": "slider move", "forward_passes": 2,
                                                             "reused_steps": 1}}}
    assert "2 backbone forward pass(es)" in render.output_cards(moved)


def test_the_header_names_the_backbone_precision():
    """A user sees which precision decodes (f(c), and so memories and plug-ins, depend on it): docs/precision.md."""
    from ui.render import status_header

    ready = {"state": "ready", "backbone": "gemma-3-270m", "device": "cpu", "layers": 18}
    assert "ready on cpu in float16 · 18 layers" in status_header({**ready, "precision": "float16"})
    assert "ready on cpu · 18 layers" in status_header(ready)  # a status without one (a remote backbone's)
