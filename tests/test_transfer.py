"""The transfer check: a rank on a test file reports the held-out and the test leaderboards side by side and says how
far the test's sources are from the memory beside the held-out samples; Evaluate and Compare say it for their
inputs too."""
from __future__ import annotations

import json

import pytest

from eval import calibrate as calibration
from eval import rank as rank_mod
from eval.transfer import memory_transfer

NOUNS = ["house", "cat", "dog", "tree", "car", "book", "door", "bird", "table", "road"]
ADJS = ["small", "big", "old", "new", "red"]


def memory_pairs(n: int) -> list[tuple[str, str]]:
    return [(f"the {NOUNS[i % 10]} {i} is {ADJS[(i // 10) % 5]}", f"das ding {i} ist {ADJS[(i // 10) % 5]}")
            for i in range(n)]


FAR_TEST = [(f"please restart server number {i} before lunch", f"bitte server {i} neu starten") for i in range(8)]


@pytest.fixture(scope="module")
def memory(tiny, tmp_path_factory):
    from backbone.prompts import Prompt
    from ground.store import Catalog
    from memories.build import build_memory, memory_row
    from memories.parse import Sample

    cat = Catalog(tmp_path_factory.mktemp("transfer-data"))
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(memory_pairs(150))]
    mem = build_memory(tiny, samples, cat.root / "memories" / "m", prompt=Prompt.for_task("translation"),
                       heldout_frac=0.1)
    cat.add_memory(memory_row(mem))
    return cat, mem


@pytest.fixture(scope="module")
def ranked_on_test(tiny, memory):
    cat, mem = memory
    seen = []
    real_eval = rank_mod.evaluate

    def spy_eval(bb, pairs, rows, *a, **kw):
        seen.append([s for s, _ in pairs])
        return real_eval(bb, pairs, rows, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "calibrate", lambda *a, **kw: None)  # not what this tests: the global defaults
        mp.setattr(rank_mod, "evaluate", spy_eval)
        board = rank_mod.rank(tiny, mem, catalog=cat, methods=["knn"], test_pairs=FAR_TEST, test_name="far.jsonl",
                              n_tune=5, bootstrap=50, cost_sentences=0, max_new_tokens=6)
    return board, seen


def test_a_rank_on_a_test_file_scores_the_heldout_report_part_too(ranked_on_test, memory):
    board, seen = ranked_on_test
    _, mem = memory
    tune, rest, _ = calibration.split_heldout(mem, 5)
    assert seen == [[s for s, _ in FAR_TEST], [s["src"] for s in rest]]
    assert board["data"]["report_source"] == "test file" and board["data"]["report"] == len(FAR_TEST)
    held = board["heldout"]
    assert held["data"] == {"report": len(rest), "report_source": "held-out"}
    assert {r["method"] for r in held["methods"]} == {r["method"] for r in board["methods"]} == {"base", "knn"}
    assert held["verdict"].startswith(f"On your {len(rest)} held-out samples")
    assert board["verdict"].startswith(f"On your {len(FAR_TEST)} test pairs")


def test_the_rank_says_the_test_is_farther_than_the_heldout_samples(ranked_on_test):
    board, _ = ranked_on_test
    t = board["transfer"]
    assert t["farther"] and t["inputs"]["n"] == len(FAR_TEST) and t["heldout"]["n"] > 0
    assert t["inputs"]["median"] < t["heldout"]["median"]
    text = rank_mod.format_leaderboard(board)
    assert "beside the test file" in text and "held-out chrF" in text and "test chrF" in text
    assert "Transfer check: Your test inputs are farther from the memory than its held-out samples" in text


def test_a_rank_on_the_heldout_samples_has_no_second_board(tiny, memory):
    cat, mem = memory
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "calibrate", lambda *a, **kw: None)
        board = rank_mod.rank(tiny, mem, catalog=cat, methods=["knn"], n_tune=5, bootstrap=0, cost_sentences=0,
                              max_new_tokens=4)
    assert "heldout" not in board and "transfer" not in board
    assert "Transfer check" not in rank_mod.format_leaderboard(board)


def test_sentences_like_the_memorys_are_about_as_near_as_its_heldout_samples(memory):
    _, mem = memory
    near = memory_transfer(mem, ["the house 7 is big", "the car 300 is red"], input_label="your sentences")
    assert not near["farther"] and near["text"].startswith("Your sentences are about as near")
    far = memory_transfer(mem, [s for s, _ in FAR_TEST], input_label="your sentences")
    assert far["farther"] and far["text"].startswith("Your sentences are farther")


@pytest.fixture(scope="module")
def studio_knn(tmp_path_factory):
    from _server import build_tiny_memory, tiny_studio

    st = tiny_studio(tmp_path_factory.mktemp("transfer-studio"))
    mid = build_tiny_memory(st, memory_pairs(120), "transfer pairs")  # 12 held out: 6 tune, 6 report
    job = st.jobs.wait(st.plugin_service.submit_train(mid, "knn", {}, "kNN"), 120)
    assert job["state"] == "done", job
    yield st, job["result"]["plugin_id"]
    st.close()


def test_compare_and_evaluate_say_how_near_their_inputs_are(studio_knn):
    from ui import render
    from ui.compare import transfer_html

    st, knn = studio_knn
    # no plug-in: no memory to measure against
    assert st.memory_service.transfer_check(["the house 7 is big"], ["base"]) is None
    near = st.memory_service.transfer_check(["the house 7 is big"], ["base", knn], input_label="this sentence")
    assert not near["farther"] and near["text"].startswith("This sentence is about as near")
    assert near["memory_name"] == "transfer pairs"
    html = transfer_html(st, FAR_TEST[0][0], ["base", knn], None)
    assert "pema-warn" in html and "This sentence is farther from the memory" in html
    tsv = "\n".join(f"{s}\t{t}" for s, t in FAR_TEST[:5])
    job = st.jobs.wait(st.evaluate_service.submit_evaluate(methods=["base", knn], test_data=tsv,
                                                           test_filename="far.tsv", max_new_tokens=4), 120)
    assert job["state"] == "done", job
    t = job["result"]["transfer"]
    assert t["farther"] and t["inputs"]["n"] == 5
    assert "Your test inputs are farther" in render.transfer_note(t)


def test_the_domain_shift_split_keeps_the_memory_programs_messages_out_of_the_test(tmp_path):
    import json

    from test_datasets import build_mo

    from benchmarks.domain_shift import main as domain_shift

    def catalog(name, pairs):
        (tmp_path / "loc" / f"{name}.mo").write_bytes(build_mo([(e.encode(), d.encode()) for e, d in pairs]))

    (tmp_path / "loc").mkdir()
    server = [(f"Could not open the relation number {i} now", f"Konnte Relation Nummer {i} jetzt nicht öffnen")
              for i in range(30)]
    shared = ("Connection to the server was lost", "Verbindung zum Server wurde getrennt")
    catalog("server-15", server + [shared])
    catalog("client-15", [(f"Enter the name of role {i} to drop", f"Namen der Rolle {i} zum Löschen eingeben")
                          for i in range(12)] + [shared])
    catalog("dump-15", [(f"Dumping the contents of table {i} now", f"Inhalt der Tabelle {i} wird ausgegeben")
                        for i in range(12)])
    catalog("other-16", [("This catalog is another product", "Dieser Katalog ist ein anderes Produkt")])
    out = tmp_path / "split"
    assert domain_shift(["build", "--out", str(out), "--locale-dir", str(tmp_path / "loc"), "--memory-catalog",
                         "server-15", "--memory-n", "20", "--test-n", "15"]) == 0
    memory = [json.loads(x)["src"] for x in (out / "memory.jsonl").read_text().splitlines()]
    test = [json.loads(x)["src"] for x in (out / "test.jsonl").read_text().splitlines()]
    assert len(memory) == 20 and set(memory) <= {e for e, _ in server + [shared]}
    assert len(test) == 15 and not set(test) & {e for e, _ in server + [shared]}  # none of the memory program's
    assert all(t.startswith(("Enter the name", "Dumping")) for t in test)  # only the product's other programs
    info = json.loads((out / "split.json").read_text())
    assert [c["catalog"] for c in info["test_catalogs"]] == ["client-15.mo", "dump-15.mo"]
    assert info["grouped_split"]["test"]["n"] == 15 and "transfer_check" in info["grouped_split"]


def test_a_rank_job_on_a_test_file_shares_both_leaderboards_and_the_check_without_ids(studio_knn):
    from ui import rank as rank_ui

    st, _ = studio_knn
    mid = st.memory_service.memories()[0]["id"]
    tsv = "\n".join(f"{s}\t{t}" for s, t in FAR_TEST)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "calibrate", lambda *a, **kw: None)  # the global defaults: fast
        job = st.jobs.wait(st.rank_service.submit_rank(mid, methods=["knn"], test_data=tsv, test_filename="far.tsv"),
                           300)
    assert job["state"] == "done", job
    board = st.rank_service.leaderboard(job["id"])
    assert board["transfer"]["farther"] and board["heldout"]["methods"]
    html = rank_ui.verdict_html(board)
    assert "rank-transfer" in html and "rank-heldout-beside" in html
    shared = st.rank_service.shared_leaderboard(st.rank_service.share_leaderboard(job["id"]))
    assert shared["transfer"]["farther"] and "memory_id" not in shared["transfer"]
    assert {r["method"] for r in shared["heldout"]["methods"]} == {"base", "knn"}
    assert mid not in json.dumps(shared) and "rank-heldout-beside" in rank_ui.verdict_html(shared)
