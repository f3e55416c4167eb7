"""Ranking every method (``eval.rank``, ``studio.rank_service``) on the tiny backbone: every registered method in the
leaderboard with all its fields; a second ranking reuses the plug-ins (and calibrations) of the first and trains
nothing; evaluation never sees a tuning sample; too few samples are refused; the verdict and the Pareto front by
hand; a ranking interrupted by a restart is resumed; a shared leaderboard survives a restart and holds no id, name or
key."""
import json

import pytest

from eval import calibrate as calibration
from eval import rank as rank_mod
from ground.errors import UserError

FIELDS = ("method", "title", "rank", "chrf", "sacrebleu", "chrf_ci95", "sacrebleu_ci95", "training_seconds",
          "trainable_parameters", "decode_cost", "settings", "tuned", "best")
VS_BASE = ("chrf_delta", "p_chrf", "sacrebleu_delta", "p_sacrebleu")
NOUNS = [("house", "Haus"), ("cat", "Katze"), ("dog", "Hund"), ("tree", "Baum"), ("car", "Auto"), ("book", "Buch"),
         ("door", "Tuer"), ("bird", "Vogel"), ("table", "Tisch"), ("road", "Strasse")]
ADJS = [("small", "klein"), ("big", "gross"), ("old", "alt"), ("new", "neu"), ("red", "rot")]


def unique_pairs(n: int) -> list[tuple[str, str]]:
    """``n`` distinct sentence pairs (distinct sources: a report pair can be told from a tuning sample)."""
    out = []
    for i in range(n):
        (e, d), (a, b) = NOUNS[i % len(NOUNS)], ADJS[(i // len(NOUNS)) % len(ADJS)]
        out.append((f"the {e} {i} is {a}", f"das {d} {i} ist {b}"))
    return out


@pytest.fixture(scope="module")
def ranked(tiny, tmp_path_factory):
    """Two rankings of one memory (quick training settings): the second must reuse everything. The calibrations and
    evaluations both runs make are recorded."""
    from backbone.prompts import Prompt
    from ground.store import Catalog
    from memories.build import build_memory, memory_row
    from memories.parse import Sample
    from plugins.registry import available_methods, method_card

    cat = Catalog(tmp_path_factory.mktemp("rank-data"))
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(unique_pairs(180))]
    mem = build_memory(tiny, samples, cat.root / "memories" / "m", prompt=Prompt.for_task("translation"),
                       heldout_frac=0.1)
    cat.add_memory(memory_row(mem))
    configs = {m: method_card(m).quick_settings for m in available_methods()}
    seen = {"calibrated": [], "evaluated": []}
    real_cal, real_eval = calibration.calibrate, rank_mod.evaluate

    def spy_cal(bb, plugin, memory, **kw):
        seen["calibrated"].append([s["src"] for s in kw["samples"]])
        return real_cal(bb, plugin, memory, **{**kw, "max_new_tokens": 12})

    def spy_eval(bb, pairs, rows, *a, **kw):
        seen["evaluated"].append([s for s, _ in pairs])
        return real_eval(bb, pairs, rows, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "calibrate", spy_cal)
        mp.setattr(rank_mod, "evaluate", spy_eval)
        kw = dict(catalog=cat, configs=configs, n_tune=8, bootstrap=100, cost_sentences=1, max_new_tokens=12)
        first = rank_mod.rank(tiny, mem, **kw)
        n_plugins = len(cat.plugins())
        second = rank_mod.rank(tiny, mem, **kw)
    return {"first": first, "second": second, "seen": seen, "catalog": cat, "memory": mem,
            "n_plugins": n_plugins, "methods": list(available_methods())}


def test_every_registered_method_is_ranked_with_all_fields(ranked):
    board = ranked["first"]
    rows = {r["method"]: r for r in board["methods"]}
    assert set(rows) == {"base", *ranked["methods"]}
    for m, r in rows.items():
        for k in FIELDS:
            assert k in r, (m, k)
        assert isinstance(r["chrf"], float) and len(r["chrf_ci95"]) == 2
        if m != "base":
            for k in VS_BASE:
                assert isinstance(r[k], float), (m, k)
            assert r["plugin_id"] and r["trainable_parameters"] == r["trainable_parameters"] // 1
    assert rows["base"]["decode_cost"] == 1.0 and rows["base"]["trainable_parameters"] == 0
    assert sorted(r["rank"] for r in board["methods"]) == list(range(1, len(rows) + 1))
    assert board["data"]["tune"] == 8 and board["data"]["report"] == 10
    assert board["verdict"].startswith("On your 10 held-out samples")
    assert set(board["phases"]) >= {"training", "calibration", "evaluation", "decode_cost", "total"}
    json.dumps(board)  # plain JSON
    interp = [m for m in ranked["methods"] if rows[m].get("calibration") is not None]
    assert {"pema", "knn"} <= set(interp)
    for m in interp:  # the row decoded with the tuned settings
        assert all(rows[m]["settings"][k] == v for k, v in rows[m]["tuned"].items())


def test_a_second_ranking_reuses_every_plugin_and_calibration(ranked):
    first = {r["method"]: r for r in ranked["first"]["methods"]}
    second = {r["method"]: r for r in ranked["second"]["methods"]}
    assert len(ranked["catalog"].plugins()) == ranked["n_plugins"] == len(ranked["methods"])
    for m in ranked["methods"]:
        assert first[m]["reused"] is False and second[m]["reused"] is True
        assert second[m]["plugin_id"] == first[m]["plugin_id"]
        if first[m].get("calibration"):
            assert second[m]["calibration"]["reused"] is True
            assert second[m]["tuned"] == first[m]["tuned"]
    # two calibrations (PEMA and kNN) in the first run, none in the second
    assert len(ranked["seen"]["calibrated"]) == sum(1 for r in first.values() if r.get("calibration"))


def test_evaluation_never_sees_a_tuning_sample(ranked):
    tune, _, _ = calibration.split_heldout(ranked["memory"], 8)
    tuned = {s["src"] for s in tune}
    assert all(set(c) <= tuned for c in ranked["seen"]["calibrated"])
    assert ranked["seen"]["evaluated"]
    for evaluated in ranked["seen"]["evaluated"]:
        assert len(evaluated) == 10 and not set(evaluated) & tuned


def test_a_changed_setting_trains_a_new_plugin(ranked, tiny):
    from plugins.api import make_config

    cat, mem = ranked["catalog"], ranked["memory"]
    cfg = make_config("knn", {}).to_dict()
    assert rank_mod.find_trained(cat, "local", mem.id, "knn", cfg, tiny.fingerprint) is not None
    other = make_config("knn", {"k": 7} if "k" in cfg else {}).to_dict()
    if other != cfg:
        assert rank_mod.find_trained(cat, "local", mem.id, "knn", other, tiny.fingerprint) is None
    assert rank_mod.find_trained(cat, "local", "another-memory", "knn", cfg, tiny.fingerprint) is None


def test_too_few_report_samples_are_refused(tiny, tiny_memory, tmp_path):
    from ground.store import Catalog

    with pytest.raises(UserError, match="Too few sentences to rank on"):
        rank_mod.rank(tiny, tiny_memory, catalog=Catalog(tmp_path), methods=["knn"])
    with pytest.raises(UserError, match="the test file has 2 pairs"):
        rank_mod.split(tiny_memory, [("a", "b"), ("c", "d")])


def _row(method, delta, p, **kw):
    return {"method": method, "title": method.upper(), "chrf": 50 + delta, "chrf_delta": delta, "p_chrf": p, **kw}


def test_verdict_names_the_best_the_level_and_the_worse():
    """Claims on Holm-adjusted p over the 5 methods: ADAPTER 0.004 → 0.016, LORA 0.002 → 0.01 (better); MT's p of
    being worse 0.001 → 0.005; KNN's raw 0.03 of being worse → 0.12: level."""
    rows = [{"method": "base", "title": "Base", "chrf": 50.0}, _row("adapter", 4.4, 0.004), _row("lora", 1.2, 0.002),
            _row("pema", 0.3, 0.3), _row("knn", -0.1, 0.97), _row("mt", -3.0, 0.999)]
    v = rank_mod.verdict(rows, 100)
    assert v["best"] == "adapter" and v["better"] == ["adapter", "lora"]
    assert v["level"] == ["pema", "knn"] and v["worse"] == ["mt"]
    assert v["text"] == ("On your 100 held-out samples the best method is ADAPTER: +4.4 chrF (p = 0.02, Holm-adjusted "
                         "for 5 methods); LORA also beats the base model; PEMA and KNN are level with the base model; "
                         "MT is worse than the base model.")
    none = rank_mod.verdict([rows[0], _row("pema", 0.3, 0.3)], 30, "test file")
    assert none["best"] is None
    assert none["text"].startswith("On your 30 test pairs no method beats the base model")


def test_verdict_needs_p_below_alpha_and_the_deltas_sign_and_leaves_out_rows_without_a_p():
    """A Holm p of exactly ALPHA claims nothing; a gain needs a positive Δ and a loss a negative one (however small
    the p); a small positive Δ with a small p is a gain; a row without a p (too few sentences) is not compared."""
    base = {"method": "base", "title": "Base", "chrf": 50.0}
    assert rank_mod.verdict([base, _row("up", 2.0, rank_mod.ALPHA)], 100)["level"] == ["up"]
    assert rank_mod.verdict([base, _row("down", -2.0, 1 - rank_mod.ALPHA)], 100)["level"] == ["down"]
    # Holm over the 5 rows with a p: each p of 0.001 (or of 0.999 the other way) adjusts to 0.005
    rows = [base, _row("small", 0.3, 0.001), _row("zero", 0.0, 0.001), _row("zero_down", 0.0, 0.999),
            _row("p_up_delta_down", -0.5, 0.001), _row("p_down_delta_up", 0.5, 0.999),
            {"method": "no_p", "title": "NO_P", "chrf": 55.0}]
    v = rank_mod.verdict(rows, 100)
    assert v["better"] == ["small"] and v["worse"] == []
    assert v["level"] == ["zero", "zero_down", "p_up_delta_down", "p_down_delta_up"]
    assert "Holm-adjusted for 5 methods" in v["text"] and "NO_P" not in v["text"]
    assert rank_mod.verdict([base, rows[-1]], 3)["text"] == \
        "On your 3 held-out samples: no method to compare with the base model."


def test_a_test_file_of_min_bootstrap_n_pairs_is_ranked_and_one_under_twenty_is_warned(tiny_memory):
    pairs = [(f"source {i}", f"target {i}") for i in range(20)]
    n = rank_mod.MIN_BOOTSTRAP_N
    assert rank_mod.split(tiny_memory, pairs[:n])["info"]["report"] == n
    with pytest.raises(UserError, match=f"the test file has {n - 1} pairs"):
        rank_mod.split(tiny_memory, pairs[:n - 1])
    assert rank_mod.split(tiny_memory, pairs[:19])["info"]["warning"] == "Only 19 test pairs: intervals will be wide."
    assert "test pairs" not in (rank_mod.split(tiny_memory, pairs)["info"]["warning"] or "")


def test_pareto_front_by_hand():
    rows = [{"method": "a", "chrf": 60, "t": 100}, {"method": "b", "chrf": 55, "t": 10},
            {"method": "c", "chrf": 50, "t": 50}, {"method": "d", "chrf": 55, "t": 0}]
    assert rank_mod.pareto(rows, "t") == {"a", "d"}
    # the same cost and a higher chrF dominate; a row without a cost yet (its decode cost not timed) is left out
    tie = [{"method": "a", "chrf": 60, "t": 10}, {"method": "b", "chrf": 55, "t": 10}, {"method": "c", "chrf": 70}]
    assert rank_mod.pareto(tie, "t") == {"a"}


# --- the studio -------------------------------------------------------------------------------------------------
def _studio(root):
    from studio.service import Studio

    st = Studio(root, backbone="tiny")
    assert st.backbone_service.wait_ready(120), st.backbone_service.status()
    return st


def test_restart_mid_ranking_resumes_and_reuses(tmp_path):
    from _server import build_tiny_memory

    pairs = unique_pairs(110)
    st = _studio(tmp_path)
    try:
        mid = build_tiny_memory(st, pairs)
        done = st.jobs.wait(st.plugin_service.submit_train(mid, "knn"), 60)  # what the interrupted run had finished
        assert done["state"] == "done"
        st.jobs.stop()
        jid = st.rank_service.submit_rank(mid, methods=["knn", "adapter"])
        # the process dies while the ranking runs: its row is left "running"
        st.jobs._update(jid, state="running", started=1.0, progress=0.3, message="training: adapter")
    finally:
        st.close()
    st = _studio(tmp_path)
    try:
        old = st.job_service.job(jid)
        assert old["state"] == "interrupted" and "resumed as" in old["message"]
        new = [j for j in st.job_service.list_jobs(("rank",)) if j["args"].get("resume_of") == jid]
        assert len(new) == 1
        job = st.jobs.wait(new[0]["id"], 120)
        assert job["state"] == "done", job
        rows = {r["method"]: r for r in job["result"]["leaderboard"]["methods"]}
        assert set(rows) == {"base", "knn", "adapter"}
        assert rows["knn"]["reused"] is True and rows["knn"]["plugin_id"] == done["result"]["plugin_id"]
        assert rows["adapter"]["reused"] is False
        assert "Resuming the ranking" in job["log"]
        board = st.rank_service.leaderboard(memory_id=mid)
        assert board["job_id"] == job["id"]
        best = st.rank_service.best_methods()
        assert all(pid in {r["plugin_id"] for r in rows.values()} for pid in best)
        # sharing: no id, name or key in what anyone with the link reads, and it survives a restart
        sid = st.rank_service.share_leaderboard(job["id"])
    finally:
        st.close()
    st = _studio(tmp_path)
    try:
        shared = st.rank_service.shared_leaderboard(sid)
        text = json.dumps(shared)
        secrets = [mid, job["id"], jid, *(r["plugin_id"] for r in rows.values() if r.get("plugin_id")), "pairs",
                   str(tmp_path)]
        for s in secrets:
            assert s not in text, s
        key_file = tmp_path / "owner-secret"
        if key_file.exists():
            assert key_file.read_text().strip() not in text
        assert shared["verdict"] == board["verdict"]
        assert {r["method"] for r in shared["methods"]} == {"base", "knn", "adapter"}
        with pytest.raises(UserError):
            st.rank_service.shared_leaderboard("not-a-share")
    finally:
        st.close()


def test_rank_submission_is_checked(tmp_path):
    st = _studio(tmp_path)
    try:
        with pytest.raises(UserError, match="Choose a memory"):
            st.rank_service.submit_rank(None)
        with pytest.raises(UserError, match="No memory"):
            st.rank_service.submit_rank("nope")
        with pytest.raises(UserError, match="Unknown method"):
            st.rank_service.submit_rank("nope", methods=["not-a-method"])
        with pytest.raises(UserError, match="No memory"):
            st.rank_service.submit_rank("nope", owner="someone-else")
        with pytest.raises(UserError, match="No finished ranking"):
            st.rank_service.leaderboard()
    finally:
        st.close()


def test_a_stranger_can_neither_rank_nor_read_nor_share_nor_calibrate_anothers_things(tmp_path):
    from _server import TINY_PAIRS

    from studio.service import Studio

    st = Studio(tmp_path, backbone="tiny", multi_user=True)
    assert st.backbone_service.wait_ready(120), st.backbone_service.status()
    try:
        tsv = "\n".join(f"{s}\t{t}" for s, t in TINY_PAIRS)
        built = st.jobs.wait(st.memory_service.submit_build(tsv, "pairs.tsv", name="a's", owner="a"), 120)
        assert built["state"] == "done", built
        mid = built["result"]["memory_id"]
        trained = st.jobs.wait(st.plugin_service.submit_train(mid, "knn", {}, "a's knn", owner="a"), 120)
        assert trained["state"] == "done", trained
        pid = trained["result"]["plugin_id"]
        with pytest.raises(UserError, match="No memory"):
            st.rank_service.submit_rank(mid, owner="b")
        with pytest.raises(UserError):
            st.rank_service.rank_estimate(mid, owner="b")
        for call in (st.rank_service.leaderboard, st.rank_service.share_leaderboard):
            with pytest.raises(UserError, match="No ranking"):
                call(trained["id"], owner="b")
        with pytest.raises(UserError):
            st.plugin_service.submit_calibrate(pid, owner="b")
        assert st.rank_service.best_methods(owner="b") == {}
        assert st.jobs.list(owner="b") == []
    finally:
        st.close()


def test_decode_cost_times_the_base_beside_each_method(monkeypatch):
    """A method's decode cost is its seconds per token over the base model's, the two decoding the same sentences in
    turns (base, method, base, method …), so a slow or fast moment of a long run moves both alike. A fake clock:
    the base takes 1 s for 10 tokens a sentence, the method 3 s for 12."""
    from types import SimpleNamespace

    from engine import Row

    clock = [0.0]
    calls = []
    monkeypatch.setattr(rank_mod.time, "perf_counter", lambda: clock[0])

    def decode(backbone, sources, rows, prompt, max_new_tokens, trace):
        label = rows[0].label
        calls.append((sources[0], label))
        clock[0] += 1.0 if label == "base" else 3.0
        yield SimpleNamespace(rows=[SimpleNamespace(tokens=[0] * (10 if label == "base" else 12))])

    cost = rank_mod.decode_cost(None, ["a", "b"], Row("knn"), None, 16, lambda: False, decode=decode)
    assert calls == [("a", "base"), ("a", "knn"), ("b", "base"), ("b", "knn")]
    assert cost == pytest.approx((6.0 / 24) / (2.0 / 20))


def test_the_decoding_eta_caps_each_calibration_by_its_budget(monkeypatch):
    """The ETA of the decoding phases, one function for the rank's plan and the studio's estimate before it starts:
    a calibration costs a tuning sample 4 base sentences, up to a time budget when one is given; only the
    interpolating methods calibrate; the studio reads the base's sentence time for this kind of machine."""
    from studio import rank_service

    methods = ["knn", "adapter", "pema"]
    eta = rank_mod.decoding_seconds(0.8, methods, 40, 60, 4)
    assert eta["calibration"] == {"knn": 128.0, "pema": 128.0}  # 4 × 40 × 0.8 s: no budget unless given
    assert rank_mod.decoding_seconds(0.1, methods, 40, 60, 4)["calibration"]["knn"] == pytest.approx(16.0)
    assert rank_mod.decoding_seconds(0.8, methods, 40, 60, 4, calibrate_seconds=30)["calibration"]["pema"] == 30
    assert set(eta["decode_cost"]) == set(methods) and eta["evaluation"] == pytest.approx(60 * 0.8 * 2.5)
    monkeypatch.setattr(rank_service, "machine_kind", lambda: "cpu-bf16")
    assert rank_service.decode_s_per_sentence("gemma-3-270m") == rank_service.DECODE_S_PER_SENTENCE[
        "gemma-3-270m@cpu-bf16"] != rank_service.DECODE_S_PER_SENTENCE["gemma-3-270m"]
    monkeypatch.setattr(rank_service, "machine_kind", lambda: "cuda")
    assert rank_service.decode_s_per_sentence("gemma-3-270m") == 1.5  # no entry of its own: the backbone's
    assert rank_service.decode_s_per_sentence("tiny-llama") == 0.05
