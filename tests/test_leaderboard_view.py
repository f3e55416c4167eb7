"""The leaderboard's one order and how it reads: the table's rows, its ★ and the verdict follow
``eval.rank.ordered``; metric disagreements are named; zero-cost methods are not drawn at a made-up position."""
from eval.rank import disagreements, ordered, verdict
from ui import rank as ui_rank

# a leaderboard where the largest Δ chrF (memory-tuning) is not significant, the ★ method's is
ROWS = [{"method": "base", "title": "Base model", "chrf": 40.0, "sacrebleu": 10.0, "training_seconds": 0.0,
         "trainable_parameters": 0, "decode_cost": 1.0},
        {"method": "memory_tuning", "title": "Memory-Tuning", "chrf": 46.9, "sacrebleu": 9.0, "chrf_delta": 6.9,
         "p_chrf": 0.23, "sacrebleu_delta": -1.0, "p_sacrebleu": 0.7, "training_seconds": 300.0,
         "trainable_parameters": 10_000},
        {"method": "retrieval_icl", "title": "Retrieved in-context examples", "chrf": 45.2, "sacrebleu": 12.0,
         "chrf_delta": 5.2, "p_chrf": 0.001, "sacrebleu_delta": 2.0, "p_sacrebleu": 0.01, "training_seconds": 0.0,
         "trainable_parameters": 0},
        {"method": "knn", "title": "kNN-LM / kNN-MT", "chrf": 39.0, "sacrebleu": 10.5, "chrf_delta": -1.0,
         "p_chrf": 0.6, "sacrebleu_delta": 0.5, "p_sacrebleu": 0.4, "training_seconds": 12.0,
         "trainable_parameters": 0}]


def board() -> dict:
    rows = [dict(r) for r in ROWS]
    v = verdict(rows, 100)
    for r in rows:
        r["best"] = r["method"] == v["best"]
    return {"methods": rows, "best": v["best"], "better": v["better"], "verdict": v["text"],
            "pareto": {"training_seconds": ["retrieval_icl", "memory_tuning"], "trainable_parameters": []}}


def test_significant_gains_come_first_and_the_star_is_row_1():
    b = board()
    assert b["best"] == "retrieval_icl"
    rows = ordered([dict(r) for r in b["methods"]], b["better"])
    assert [r["method"] for r in rows] == ["retrieval_icl", "memory_tuning", "base", "knn"]
    assert [r["rank"] for r in rows] == [1, 2, 3, 4]
    table = ui_rank.table(b)
    assert table[0][:2] == [1, "Retrieved in-context examples ★"]
    assert sum("★" in row[1] for row in table) == 1
    assert [row[1] for row in ui_rank.cost_table(b)] == [row[1] for row in table]  # the same order and names


def test_a_share_without_better_puts_its_best_first():
    b = board()
    b.pop("better")
    assert ui_rank.table(b)[0][1].endswith("★")


def test_metric_disagreements_are_named_in_the_verdict():
    text = board()["verdict"]
    assert "chrF and sacreBLEU disagree in sign for Memory-Tuning (+6.9 chrF, -1.0 sacreBLEU) and kNN-LM / kNN-MT" \
           in text
    assert "Retrieved in-context examples (" not in text.split("disagree")[1]


def test_a_zero_or_same_signed_delta_is_no_disagreement_and_chrf_ties_go_to_sacrebleu():
    rows = [{"method": "base", "chrf": 40.0, "sacrebleu": 10.0},
            {"method": "zero", "chrf": 40.0, "sacrebleu": 10.5, "chrf_delta": 0.0, "sacrebleu_delta": 0.5},
            {"method": "both_up", "chrf": 40.5, "sacrebleu": 11.0, "chrf_delta": 0.5, "sacrebleu_delta": 1.0},
            {"method": "split", "chrf": 40.5, "sacrebleu": 9.5, "chrf_delta": 0.5, "sacrebleu_delta": -0.5}]
    assert [r["method"] for r in disagreements(rows)] == ["split"]
    assert [r["method"] for r in ordered(rows, [])] == ["both_up", "split", "zero", "base"]


def test_zero_cost_methods_sit_in_a_none_panel_named_like_the_table():
    fig = ui_rank.pareto_figure(board(), "training_seconds")
    points = {t.name: t for t in fig.data if t.name}
    assert set(points) == {"1. Retrieved in-context examples ★", "2. Memory-Tuning", "4. kNN-LM / kNN-MT"}
    icl = points["1. Retrieved in-context examples ★"]
    assert list(icl.x) == [ui_rank.ZERO["training_seconds"]] and icl.xaxis == "x"  # the "none" panel
    assert list(points["2. Memory-Tuning"].x) == [300.0] and points["2. Memory-Tuning"].xaxis == "x2"
    assert all(t.cliponaxis is False for t in points.values())
    assert fig.layout.xaxis2.type == "log" and fig.layout.xaxis.visible
    assert 0.1 not in [x for t in fig.data for x in (t.x or ()) if isinstance(x, float)]
