"""The web app end to end through its explicit API (gradio_client), on the tiny in-process backbone; the job queue
at unit level; the figure/HTML builders; one integration path on the real embedded backbone.

    python -m pytest -q tests/test_app.py                 # tiny backbone only: about a minute
    python -m pytest -q tests/test_app.py -m integration  # + the real Gemma 3 270M (cached weights)
"""
import json
import os
import threading
import time

import pytest
from _server import start_app, wait_job

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3
JSONL = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in PAIRS)
SMALL_PEMA = {"rank": 16, "max_epochs_rct": 2, "max_epochs_joint": 2, "candidate_contexts": 64}
API = ["status", "preview", "build", "job", "jobs", "cancel", "memories", "memory", "delete_memory", "methods",
       "train", "plugins", "continue_training", "compare", "share", "shared", "evaluate",
       "export_plugin", "import_plugin", "calibrate", "rank", "leaderboard", "share_leaderboard", "shares",
       "delete_share"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from gradio_client import Client

    studio, demo, url = start_app(tmp_path_factory.mktemp("studio-data"))
    assert studio.backbone_service.wait_ready(120), studio.backbone_service.status()
    client = Client(url, verbose=False)
    yield studio, client, url
    demo.close()
    studio.close()


@pytest.fixture(scope="module")
def flow(served):
    """upload → build → train a small PEMA (and a kNN) → compare → share, through the API."""
    studio, client, url = served
    out = {"studio": studio, "client": client, "url": url}
    pv = client.predict(JSONL, "mine.jsonl", api_name="/preview")
    assert pv["count"] == 12 and pv["problem_count"] == 0 and pv["ok"]
    job = wait_job(client, client.predict(JSONL, "mine.jsonl", "my memory", "translation", api_name="/build")["job_id"])
    assert job["state"] == "done", job
    out["memory_id"] = job["result"]["memory_id"]
    j1 = client.predict(out["memory_id"], "pema", SMALL_PEMA, "", api_name="/train")["job_id"]
    j2 = client.predict(out["memory_id"], "knn", {}, "", api_name="/train")["job_id"]  # queued behind the first
    out["pema_job"], out["knn_job"] = wait_job(client, j1), wait_job(client, j2)
    assert out["pema_job"]["state"] == "done", out["pema_job"]
    assert out["knn_job"]["state"] == "done", out["knn_job"]
    out["pema_id"] = out["pema_job"]["result"]["plugin_id"]
    out["knn_id"] = out["knn_job"]["result"]["plugin_id"]
    out["comparison"] = client.predict("the house is small", "translation", ["base", out["pema_id"], out["knn_id"]],
                                       {"pema": {"lambda_max": 0.7, "gu": True}, "knn": {"k": 8}}, 24, 1,
                                       api_name="/compare")
    out["share"] = client.predict(out["comparison"]["id"], -1, api_name="/share")
    return out


# --- the app through its API ---------------------------------------------------------------------------------------
def test_api_endpoints_are_named_and_the_rest_is_private(served):
    _, client, _ = served
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {f"/{n}" for n in API} <= names
    assert names == {f"/{n}" for n in API}  # the page's own events are not part of the API


def test_status_reports_the_loaded_backbone(served):
    _, client, _ = served
    st = client.predict(api_name="/status")
    assert st["state"] == "ready" and st["ready"] and st["progress"] == 1.0
    assert st["backbone"].startswith("tiny-llama")


def test_build_and_train_leave_catalog_rows_and_history(flow):
    client = flow["client"]
    mems = client.predict(api_name="/memories")
    mem = next(m for m in mems if m["id"] == flow["memory_id"])
    assert mem["name"] == "my memory" and mem["samples"] == 12 and mem["entries"] > 0 and mem["usable"]
    detail = client.predict(flow["memory_id"], api_name="/memory")
    assert {s["split"] for s in detail["samples"]} == {"train", "heldout"}
    # built with the task's tuned prompt (few-shot examples included), the one the benchmarks measured
    from backbone.tasks import task_prompt

    meta = json.loads((flow["studio"].root / "memories" / flow["memory_id"] / "meta.json").read_text())
    assert meta["prompt"] == task_prompt("translation", flow["studio"].backbone_service.backbone()).to_dict()
    assert meta["prompt"]["examples"]
    plugins = {p["id"]: p for p in client.predict(api_name="/plugins")}
    assert plugins[flow["pema_id"]]["params"] > 0 and plugins[flow["pema_id"]]["method"] == "pema"
    assert plugins[flow["knn_id"]]["params"] == 0
    job = flow["pema_job"]
    assert job["progress"] == 1.0 and "Started train_plugin" in job["log"]
    losses = [m for m in job["metrics"] if m.get("loss") is not None]
    assert losses and {m["phase"] for m in losses} >= {"reconstruction", "joint"}
    # FIFO: the kNN job queued after the PEMA job started after it finished
    assert flow["knn_job"]["started"] >= job["finished"] - 1e-3


def test_compare_is_one_batch_with_traces_and_diffs(flow):
    c = flow["comparison"]
    assert [r["method"] for r in c["rows"]] == ["base", "pema", "knn"]
    assert c["timings"]["decode_s"] > 0 and c["timings"]["total_s"] >= c["timings"]["decode_s"]
    pema, knn = c["rows"][1], c["rows"][2]
    assert pema["settings"]["lambda_max"] == 0.7 and knn["settings"]["k"] == 8
    assert all("lambda" in t and t["top_lm"] and t["top_final"] for t in pema["trace"])
    assert pema["trace"][0]["lambda"] == pytest.approx(0.49, abs=1e-3)  # GU: λ_0 = λ_max²
    assert knn["trace"][0]["neighbours"] and "sample" in knn["trace"][0]["neighbours"][0]
    for r in c["rows"]:
        assert " ".join(seg for seg, tag in r["diff"] if tag != "removed").split() == r["text"].split()


def test_owner_view_shows_neighbour_samples(flow):
    studio, c = flow["studio"], flow["comparison"]
    nbs = studio.compare_service.neighbours(c["id"], c["rows"][2]["label"], 0)
    assert nbs and all(n["target"] in {t for _, t in PAIRS} for n in nbs)


def test_shared_comparison_restores_the_same_outputs_without_private_data(flow):
    client, c, sh = flow["client"], flow["comparison"], flow["share"]
    assert len(sh["id"]) >= 20 and sh["link"] == f"/share/?c={sh['id']}"
    p = client.predict(sh["id"], api_name="/shared")
    assert p["source"] == c["source"] and p["task"] == "translation" and p["backbone"] == c["backbone"]
    assert [(r["method"], r["text"], r["tokens"]) for r in p["rows"]] == \
        [(r["method"], r["text"], r["tokens"]) for r in c["rows"]]
    # neutral labels: the method's title, never the plug-in's name (which defaults to the memory's / file's name)
    assert [r["label"] for r in p["rows"]] == ["Base model", "PEMA (+ Gradual Unrolling)", "kNN-LM / kNN-MT"] \
        != [r["label"] for r in c["rows"]]
    assert [r["settings"] for r in p["rows"]] == [r["settings"] for r in c["rows"]]
    assert p["rows"][1]["trace"][0]["lambda"] == c["rows"][1]["trace"][0]["lambda"]
    assert set(p["attention"]) == {r["label"] for r in p["rows"]}
    assert "reference" not in p and "prompt_template" not in p and "my memory" not in json.dumps(p)
    text = json.dumps(p, ensure_ascii=False)
    for _, tgt in PAIRS:  # no memory sample leaks (kNN neighbours keep token and distance only)
        assert tgt not in text
    assert '"sample"' not in text and '"entry"' not in text and "context_ids" not in text
    assert str(flow["studio"].root) not in text and flow["memory_id"] not in text and flow["pema_id"] not in text


def test_shared_link_page_loads_and_survives_a_restart(flow, tmp_path):
    import urllib.request

    from gradio_client import Client

    studio = flow["studio"]
    with urllib.request.urlopen(flow["url"].rstrip("/") + flow["share"]["link"], timeout=30) as r:
        assert r.status == 200
    # A second app process on the same data directory (the first one's in-memory comparisons are gone).
    studio2, demo2, url2 = start_app(studio.root)
    try:
        # Its page config goes to every visitor (shared links too): the owner's data is only sent on load.
        with urllib.request.urlopen(url2.rstrip("/") + "/config", timeout=30) as r:
            config = r.read().decode("utf-8")
        assert '"components"' in config
        assert "my memory" not in config and str(studio.root) not in config
        assert flow["memory_id"] not in config and flow["pema_id"] not in config
        p = Client(url2, verbose=False).predict(flow["share"]["id"], api_name="/shared")
        assert [r["text"] for r in p["rows"]] == [r["text"] for r in flow["comparison"]["rows"]]
        with pytest.raises(Exception, match="does not exist"):
            Client(url2, verbose=False).predict("not-a-real-id", api_name="/shared")
    finally:
        demo2.close()
        studio2.close()


def test_bad_upload_shows_the_message_and_builds_nothing(served):
    studio, client, _ = served
    before_mem = client.predict(api_name="/memories")
    before_jobs = client.predict(50, api_name="/jobs")
    bad = JSONL.split("\n")[:3] + ['{"src": "broken', '{"en": "only one side"}']
    pv = client.predict("\n".join(bad), "bad.jsonl", api_name="/preview")
    assert pv["count"] == 3 and not pv["ok"]
    assert pv["problems"][0].startswith("line 4: not valid JSON") and pv["problems"][1].startswith("line 5: missing")
    with pytest.raises(Exception, match="line 4: not valid JSON"):
        client.predict("\n".join(bad), "bad.jsonl", "bad", "translation", api_name="/build")
    with pytest.raises(Exception, match="expected 1 column .* found 3"):
        client.predict("a,b,c\nd,e,f", "three.csv", api_name="/build")
    with pytest.raises(Exception, match="Upload a file"):
        client.predict("", "empty.jsonl", api_name="/build")
    assert client.predict(api_name="/memories") == before_mem
    assert len(client.predict(50, api_name="/jobs")) == len(before_jobs)
    assert not [p for p in (studio.root / "memories").glob("*") if p.name not in {m["id"] for m in before_mem}]


def test_bad_settings_and_unknown_ids_are_user_errors(flow):
    client = flow["client"]
    with pytest.raises(Exception, match="kappa.*κ.*between 0.0 and 1.0"):
        client.predict(flow["memory_id"], "pema", {"kappa": 3}, "", api_name="/train")
    with pytest.raises(Exception, match="Unknown setting"):
        client.predict(flow["memory_id"], "pema", {"rnak": 3}, "", api_name="/train")
    with pytest.raises(Exception, match="No memory"):
        client.predict("mem-nope", "pema", {}, "", api_name="/train")
    with pytest.raises(Exception, match="Type a sentence"):
        client.predict("  ", "translation", ["base"], {}, 8, 1, api_name="/compare")
    with pytest.raises(Exception, match="Unknown setting 'temperature' for PEMA"):  # addressed to its row only
        client.predict("a", "translation", ["base", flow["pema_id"]], {"pema": {"temperature": 3}}, 8, 1,
                       api_name="/compare")
    with pytest.raises(Exception, match="no longer in memory"):
        client.predict("not-a-comparison", -1, api_name="/share")


def test_failed_and_cancelled_jobs_leave_nothing_behind(flow):
    studio = flow["studio"]
    mems, plugs = len(studio.memory_service.memories()), len(studio.plugin_service.plugins())
    orig = studio.jobs.handlers["build_memory"]

    def cancel_then_run(job):  # the user presses Cancel as soon as the job starts
        studio.jobs.cancel(job.id)
        return orig(job)

    studio.jobs.handlers["build_memory"] = cancel_then_run
    try:
        job = studio.jobs.wait(studio.memory_service.submit_build(JSONL, "again.jsonl", name="cancelled"), 60)
    finally:
        studio.jobs.handlers["build_memory"] = orig
    assert job["state"] == "cancelled" and "nothing was saved" in job["log"]
    # a training job that fails inside fit: the catalog gets no row and no folder stays behind
    import studio.plugin_service as papi  # the name the service calls

    real = papi.train_plugin

    def boom(*a, **k):
        k["progress"](0.5, "half way")
        raise RuntimeError("simulated crash")

    papi.train_plugin = boom
    try:
        job = studio.jobs.wait(studio.plugin_service.submit_train(flow["memory_id"], "pema", SMALL_PEMA), 60)
    finally:
        papi.train_plugin = real
    assert job["state"] == "failed" and job["error"] == "RuntimeError: simulated crash"
    assert "Traceback" in job["log"] and "simulated crash" in job["log"]
    assert len(studio.memory_service.memories()) == mems and len(studio.plugin_service.plugins()) == plugs
    assert not list((studio.root / "memories").glob(".tmp-*")) and not list((studio.root / "plugins").glob(".tmp-*"))


def test_evaluate_job_scores_methods_and_sweeps(flow):
    studio, client = flow["studio"], flow["client"]
    tsv = "\n".join(f"{s}\t{t}" for s, t in PAIRS[:4])
    jid = client.predict(["base", flow["pema_id"]], "", tsv, "test.tsv", "translation", 4, api_name="/evaluate")
    job = wait_job(client, jid["job_id"])
    assert job["state"] == "done", job
    res = job["result"]
    assert [m["method"] for m in res["methods"]] == ["base", "pema"] and "sacrebleu" in res["methods"][0]
    assert "sacrebleu" in studio.evaluate_service.results_csv(res).splitlines()[0]
    jid = client.predict(None, flow["memory_id"], "", "test.tsv", "translation", 2, flow["pema_id"], [0.0, 1.0],
                         api_name="/evaluate")
    job = wait_job(client, jid["job_id"])
    assert job["state"] == "done", job
    assert {(p["lambda_max"], p["gu"]) for p in job["result"]["sweep"]} >= {(1.0, True), (1.0, False)}


# --- the job queue, unit level ---------------------------------------------------------------------------------------
def _queue(tmp_path, handlers, workers=1):
    from ground.jobs import JobQueue
    from ground.store import Catalog

    return JobQueue(Catalog(tmp_path), handlers, workers=workers, throttle=0.0)


def test_restart_marks_running_jobs_interrupted_and_resumes_queued(tmp_path):
    from ground.jobs import INTERRUPTED_MESSAGE

    q = _queue(tmp_path, {"x": lambda job: {"ok": True}})
    running = q.submit("x", {"n": 1})
    queued = q.submit("x", {"n": 2})
    q._update(running, state="running", started=time.time())  # as if the process died mid-job
    q2 = _queue(tmp_path, {"x": lambda job: {"ok": job.args["n"]}}).start()
    try:
        job = q2.get(running)
        assert job["state"] == "interrupted" and job["message"] == INTERRUPTED_MESSAGE
        assert INTERRUPTED_MESSAGE in job["log"] and job["finished"]
        assert q2.wait(queued, 10)["state"] == "done" and q2.get(queued)["result"] == {"ok": 2}
    finally:
        q2.stop()


def test_queue_runs_fifo_reports_progress_and_classifies_errors(tmp_path):
    from ground.errors import Cancelled, UserError

    order = []
    gate = threading.Event()

    def work(job):
        order.append(job.args["n"])
        if job.args["n"] == 0:
            gate.wait(5)
        for i in range(5):
            job.progress((i + 1) / 5, f"joint: epoch 1/1 step {i + 1} loss {1.0 / (i + 1):.4f} (best held-out 1)")
            job.metric({"phase": "joint", "step": i + 1, "loss": 1.0 / (i + 1)})  # the live curve's points
        if job.args.get("fail") == "user":
            raise UserError("Your file has a problem on line 3.")
        if job.args.get("fail") == "bug":
            raise KeyError("oops")
        return {"n": job.args["n"]}

    def slow(job):
        while not job.should_stop():
            time.sleep(0.01)
        raise Cancelled()

    q = _queue(tmp_path, {"w": work, "slow": slow}).start()
    try:
        ids = [q.submit("w", {"n": i}) for i in range(3)]
        user = q.submit("w", {"n": 3, "fail": "user"})
        bug = q.submit("w", {"n": 4, "fail": "bug"})
        queued_cancel = q.submit("w", {"n": 5})
        assert q.cancel(queued_cancel)["state"] == "cancelled"
        gate.set()
        for j in ids:
            assert q.wait(j, 10)["state"] == "done"
        assert q.wait(bug, 10)["state"] == "failed"
        assert order == [0, 1, 2, 3, 4]
        job = q.get(ids[1])
        assert job["progress"] == 1.0 and [m["step"] for m in job["metrics"]] == [1, 2, 3, 4, 5]
        assert job["metrics"][-1]["loss"] == pytest.approx(0.2) and job["metrics"][0]["phase"] == "joint"
        u = q.get(user)
        assert u["state"] == "failed" and u["error"] == "Your file has a problem on line 3."
        assert "Traceback" not in u["log"]
        b = q.get(bug)
        assert b["error"] == "KeyError: 'oops'" and "Traceback" in b["log"]
        s = q.submit("slow")
        t0 = time.time()
        while q.get(s)["state"] != "running":
            assert time.time() - t0 < 10
            time.sleep(0.01)
        q.cancel(s)
        assert q.wait(s, 10)["state"] == "cancelled"
    finally:
        q.stop()


def test_stopping_the_app_interrupts_running_jobs(tmp_path):
    from ground.errors import Cancelled

    started = threading.Event()

    def slow(job):
        started.set()
        while not job.should_stop():
            time.sleep(0.01)
        raise Cancelled()

    q = _queue(tmp_path, {"slow": slow}).start()
    jid = q.submit("slow")
    assert started.wait(10)
    q.stop()
    job = q.get(jid)
    assert job["state"] == "interrupted" and "Stopped with the app" in job["log"]


def test_backbone_gate_hands_over_at_checkpoints():
    from studio.service import BackboneGate

    g = BackboneGate()
    log = []
    started = threading.Event()

    def job():
        with g.use(holder="job"):
            started.set()
            for i in range(50):
                log.append("job")
                g.checkpoint()
                time.sleep(0.005)

    t = threading.Thread(target=job)
    t.start()
    started.wait(5)
    time.sleep(0.02)
    with g.use(timeout=5, holder="ui"):
        log.append("ui")
    t.join(5)
    i = log.index("ui")
    assert 0 < i < len(log) - 1  # the interactive call ran in the middle of the job, not after it


# --- figures and HTML, without a browser ------------------------------------------------------------------------
def test_figures_build_from_plain_data(flow):
    from ui import plots

    c = flow["comparison"]
    pema = c["rows"][1]
    assert len(plots.lambda_curve(c["rows"], (pema["label"], 0)).data) >= 2  # PEMA and kNN lines (+ marker)
    bars = plots.token_bars(pema["trace"][0])
    assert [t.name for t in bars.data] == ["P_LM", "plug-in", "final"]
    assert plots.neighbour_bars(flow["studio"].compare_service.neighbours(c["id"], c["rows"][2]["label"], 0)).data
    assert plots.loss_curve(flow["pema_job"]["metrics"]).data
    att = flow["studio"].compare_service.attention(c, pema["label"], 1)
    assert len(att["matrix"]) == len(pema["tokens"]) and len(att["matrix"][0]) == len(att["input_tokens"])
    assert all(abs(sum(r) - 1) < 1e-2 for r in att["matrix"])
    assert plots.input_attention_heatmap(att).data
    fake = {"label": "MT", "trace": [{"text": "a", "memory_attention": {"weights": [0.7, 0.3]}},
                                     {"text": "b", "memory_attention": {"layers": {"3": [[5, 0.9], [2, 0.1]]}}}]}
    assert plots.memory_attention_heatmap(fake).data[0].z is not None
    assert plots.memory_weights([[1, 0.5], [2, 0.5]]) == {"#1": 0.5, "#2": 0.5}
    assert plots.memory_weights([[0.2, 0.8], [0.4, 0.6]]) == {"m0": pytest.approx(0.3), "m1": pytest.approx(0.7)}
    assert plots.eval_bars([{"label": "base", "sacrebleu": 1.0, "chrf": 20.0}]).data
    assert plots.sweep_lines([{"lambda_max": 0.5, "gu": True, "sacrebleu": 3.0},
                              {"lambda_max": 0.5, "gu": False, "sacrebleu": 2.0}]).data
    for empty in (plots.loss_curve([]), plots.token_bars(None), plots.input_attention_heatmap(None),
                  plots.memory_attention_heatmap({"label": "x", "trace": [{}]})):
        assert not empty.data and empty.layout.annotations


def test_a_job_that_is_no_training_says_no_loss_curve_is_coming(flow):
    """Plug-ins → Show job lists every job: a build's plot says a loss curve is a training's, not "appears once
    training starts"; a training's draws its loss."""
    from ui.plugins import _show_job

    studio = flow["studio"]
    build = studio.job_service.list_jobs(("build_memory",), 1)[0]
    _, fig, log = _show_job(studio, build["id"], None)
    assert not fig.data and "training job only" in fig.layout.annotations[0].text and log
    _, fig, _ = _show_job(studio, flow["pema_job"]["id"], None)
    assert fig.data


def test_html_escapes_user_text():
    from ui import render

    evil = "<script>alert(1)</script>"
    p = {"source": evil, "reference": evil, "base_label": "Base model", "timings": {}, "rows": [
        {"label": "Base model", "method": "base", "text": evil, "tokens": [1], "diff": [[evil, "same"]]},
        {"label": evil, "method": "pema", "text": "x", "tokens": [1], "diff": [[evil, "removed"], ["x", "added"]],
         "settings": {"lambda_max": 0.5}}]}
    for html in (render.output_cards(p), render.shared_header({**p, "prompt_template": evil}),
                 render.preview_summary({"count": 1, "problems": [evil], "problem_count": 1})):
        assert "<script>" not in html and "&lt;script&gt;" in html


# --- the real embedded backbone -------------------------------------------------------------------------------
@pytest.mark.integration
def test_real_backbone_build_train_compare_share(tmp_path, gemma, monkeypatch):
    """The same path on Gemma 3 270M: a few samples, a few epochs. The studio is handed the session's Gemma (the
    loading path itself is what ``gemma`` runs): one load of the real backbone per test session, not two."""
    from gradio_client import Client

    monkeypatch.setattr("studio.backbone_service.load_backbone", lambda *a, **k: gemma)
    studio, demo, url = start_app(tmp_path / "data", backbone="gemma-3-270m")
    try:
        assert studio.backbone_service.wait_ready(600), studio.backbone_service.status()
        client = Client(url, verbose=False)
        job = wait_job(client, client.predict(JSONL, "mine.jsonl", "gemma memory", api_name="/build")["job_id"], 300)
        assert job["state"] == "done", job
        cfg = {"rank": 32, "max_epochs_rct": 1, "max_epochs_joint": 2, "candidate_contexts": 128}
        job = wait_job(client, client.predict(job["result"]["memory_id"], "pema", cfg, "", api_name="/train")
                       ["job_id"], 300)
        assert job["state"] == "done", job
        c = client.predict("the house is small", "translation", ["base", job["result"]["plugin_id"]],
                           {"pema": {"lambda_max": 0.8}}, 16, 1, api_name="/compare")
        assert c["backbone"] == "gemma-3-270m" and c["rows"][0]["text"] and c["timings"]["decode_s"] > 0
        sh = client.predict(c["id"], -1, api_name="/share")
        p = client.predict(sh["id"], api_name="/shared")
        assert [r["text"] for r in p["rows"]] == [r["text"] for r in c["rows"]]
        assert p["attention"]  # the backbone's attention at the last layer, stored with the share
    finally:
        demo.close()
        studio.close()


def test_live_controls_start_from_the_tasks_tuned_settings(tmp_path):
    """The Compare tab's sliders start from plugins/tuned_defaults.json for the studio's backbone and task."""
    import json

    from plugins.settings import TUNED_PATH
    from studio.service import Studio

    tuned = json.loads(TUNED_PATH.read_text())
    st = Studio(tmp_path / "d", backbone="gemma", load=False, start_jobs=False)  # an alias of gemma-3-270m
    try:
        for task in ("translation", "formality", "style"):
            want = tuned[task]["gemma-3-270m"]
            got = st.plugin_service.start_settings(task)
            assert {k: got["pema"][k] for k in want["pema"]} == want["pema"]
            assert {k: got["knn"][k] for k in want["knn"]} == want["knn"]
    finally:
        st.close()
    other = Studio(tmp_path / "e", backbone="tiny", load=False, start_jobs=False)  # nothing tuned: declared defaults
    try:
        from plugins.knn import KNN
        from plugins.pema import PEMA

        got = other.plugin_service.start_settings("translation")
        assert got["pema"] == {s.name: s.default for s in PEMA.decode_settings}
        assert got["knn"] == {"k": 16, "temperature": 10.0, "lambda": 0.3} == {s.name: s.default
                                                                              for s in KNN.decode_settings}
    finally:
        other.close()


def test_plugin_choices_name_their_task_and_offer_only_the_chosen_tasks():
    from types import SimpleNamespace

    from ui.common import hidden_plugins_note, plugin_choices

    rows = [{"id": "knn-1-aaaaaa", "name": "software", "method": "knn", "usable": True, "task": "translation"},
            {"id": "pema-1-bbbbbb", "name": "chat", "method": "pema", "usable": True, "task": "formality"},
            {"id": "knn-1-cccccc", "name": "orphan", "method": "knn", "usable": True, "task": None}]
    st = SimpleNamespace(plugin_service=SimpleNamespace(plugins=lambda owner=None: rows))
    assert plugin_choices(st) == [("software [knn] · translation", rows[0]["id"]),
                                  ("chat [pema] · formality", rows[1]["id"]), ("orphan [knn]", rows[2]["id"])]
    assert [pid for _l, pid in plugin_choices(st, task="formality")] == [rows[1]["id"], rows[2]["id"]]
    assert hidden_plugins_note(st, None, "formality") == ("Only plug-ins trained for formality are offered; 1 plug-in "
                                                          "of translation is hidden (choose that task to use them).")
    assert hidden_plugins_note(st, None, "style").startswith("Only plug-ins trained for style are offered; 2 plug-ins")
    assert hidden_plugins_note(st, None, None) == ""


def test_the_method_pickers_line_is_cleared_when_nothing_is_hidden():
    """Switching to a task whose plug-ins are all there clears the line (a None in an update would keep the old)."""
    from types import SimpleNamespace

    from ui.compare import methods_update
    from ui.evaluate import eval_methods_update

    rows = [{"id": "knn-1-aaaaaa", "name": "chat", "method": "knn", "usable": True, "task": "formality",
             "calibration": None}]
    st = SimpleNamespace(plugin_service=SimpleNamespace(plugins=lambda owner=None: rows),
                         rank_service=SimpleNamespace(best_methods=lambda owner=None: {}))
    for update in (methods_update, eval_methods_update):
        assert update(st, None, "formality", ["base", rows[0]["id"]])["info"] == ""
        hidden = update(st, None, "translation", ["base", rows[0]["id"]])
        assert hidden["value"] == ["base"] and "1 plug-in of formality is hidden" in hidden["info"]


def test_training_progress_names_its_losses():
    """A training objective with terms beyond the NLL (the memory adapter's) is not shown as if it were the held-out
    loss it sits beside."""
    import torch

    from plugins.training import loss_text

    plain = loss_text(2.5, {}, 1.9)
    assert plain == "training loss 2.5000 on this batch · best held-out loss 1.9000 (early stopping)"
    mixed = loss_text(12.8, {"nll": torch.tensor(2.0), "kl": torch.tensor(5.4)}, 1.9)
    assert mixed.startswith("training objective 12.8000 on this batch (its NLL part 2.0000)")
    assert "best held-out loss 1.9000" in mixed


def test_plugin_choices_tell_variants_of_one_method_on_one_memory_apart():
    from types import SimpleNamespace

    from ui.common import plugin_choices

    rows = [{"id": "pema-20261123-121815-fe6ca0", "name": "translation-1000", "method": "pema", "usable": True},
            {"id": "pema-20261123-122132-203c26", "name": "translation-1000", "method": "pema", "usable": True},
            {"id": "knn-20261123-122717-1d6993", "name": "translation-1000", "method": "knn", "usable": True}]
    choices = plugin_choices(SimpleNamespace(plugin_service=SimpleNamespace(plugins=lambda owner=None: rows)))
    assert choices == [("translation-1000 [pema · fe6ca0]", rows[0]["id"]),
                       ("translation-1000 [pema · 203c26]", rows[1]["id"]),
                       ("translation-1000 [knn]", rows[2]["id"])]
