"""The training form a researcher trusts, on the tiny backbone:

* presets declared beside each method's Config ("default", "paper", "quick"), validated by the Config's own
  declarations, selectable on the CLI (``--preset``) and in the form;
* the time estimate said before training (``plugins.estimate``): measured throughputs × the memory's size × the
  epochs, and whether the time budget stops training before it converges;
* the form generated from the declared settings (one control per setting, no hand-written widgets);
* continue training for every in-network method: the optimizer (Adam's moments, step count) is saved as
  safetensors and resumed — the step counter and the loss go on from where they stopped.

    python -m pytest -q tests/test_training_form.py
"""
import json
import os
import time

import pytest
import torch
from _server import build_tiny_memory, tiny_studio

from ground.errors import UserError

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

NETWORK_METHODS = ("adapter", "memory_tuning", "memory_adapter")
SHORT = {"max_epochs": 1, "patience": 1000, "max_minutes": 0.0}
SHORT_BY_METHOD = {"memory_adapter": {**SHORT, "max_epochs": 2, "max_translate": 4, "max_pairs": 40, "eval_every": 2,
                                     "lr": 1e-2, "warmup_steps": 0},
                   "memory_tuning": {**SHORT, "slots": 8, "prefix_length": 4}}


# --- presets -----------------------------------------------------------------------------------------------------
def test_every_method_declares_default_paper_and_quick_presets_that_validate():
    from plugins.registry import available_methods
    from plugins.settings import config_presets, preset_values

    for m, cls in available_methods().items():
        presets = config_presets(cls.Config)
        assert list(presets)[:1] == ["default"] and {"paper", "quick"} <= set(presets), m
        assert preset_values(cls.Config, "default") == {}
        for name, p in presets.items():
            cfg = cls.Config.from_dict({**cls.Config().to_dict(), **preset_values(cls.Config, name)})
            for k, v in p.values.items():
                assert getattr(cfg, k) == v, (m, name, k)
            assert name == "default" or p.about, (m, name)


def test_paper_presets_carry_the_papers_values():
    from plugins.registry import get_method
    from plugins.settings import preset_values

    pema = preset_values(get_method("pema").Config, "paper")
    assert (pema["lora_alpha"], pema["b_init"], pema["batch_size"]) == (1.0, "zeros", 2048)  # the public code
    assert preset_values(get_method("lora").Config, "paper")["lr"] == 1e-3
    # the defaults' candidate softmax is not the papers'
    for m in ("adapter", "lora", "memory_tuning", "memory_adapter"):
        assert get_method(m).Config().softmax == "candidates", m
        assert preset_values(get_method(m).Config, "paper")["softmax"] == "full", m
    assert preset_values(get_method("memory_tuning").Config, "paper")["lr"] == 1e-4
    ma = preset_values(get_method("memory_adapter").Config, "paper")
    assert (ma["lr"], ma["temperature"], ma["alpha"], ma["beta"]) == (2e-4, 0.5, 5.0, 5.0)


@pytest.mark.parametrize("method", ["pema", "knn", "adapter", "lora", "memory_tuning", "memory_adapter"])
def test_quick_preset_trains(tiny, tiny_memory, tmp_path, method):
    from plugins.api import train_plugin
    from plugins.registry import get_method
    from plugins.settings import preset_values

    quick = preset_values(get_method(method).Config, "quick")
    plugin, row = train_plugin(tiny, tiny_memory, method, quick, out_dir=tmp_path / method)
    for k, v in quick.items():
        assert getattr(plugin.config, k) == v
    assert (tmp_path / method / "plugin_config.json").exists()


def test_unknown_preset_is_one_clear_error():
    from plugins.registry import get_method
    from plugins.settings import preset_values

    with pytest.raises(UserError, match="Unknown preset 'fast'.*default, paper, quick"):
        preset_values(get_method("pema").Config, "fast")


def test_cli_train_with_preset_and_set(tiny, tiny_memory, tmp_path, monkeypatch, capsys):
    import plugins.__main__ as cli

    monkeypatch.setattr(cli, "load_backbone_from_args", lambda args: tiny)
    rc = cli.main(["train", str(tiny_memory.path), "--method", "pema", "--preset", "quick", "--set", "rank=8",
                   "--set", "max_epochs_joint=1", "--data-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "time estimate:" in out
    folder = next((tmp_path / "plugins").iterdir())
    cfg = json.loads((folder / "plugin_config.json").read_text())["config"]
    assert cfg["rank"] == 8 and cfg["max_epochs_joint"] == 1  # --set wins over the preset
    assert cfg["max_epochs_rct"] == 2 and cfg["candidate_contexts"] == 512  # the rest from "quick"
    with pytest.raises(UserError, match="Unknown preset"):
        cli.main(["train", str(tiny_memory.path), "--method", "pema", "--preset", "nope",
                  "--data-dir", str(tmp_path)])


# --- the time estimate -------------------------------------------------------------------------------------------
TABLE = {"bb": {"adapter": {"samples_per_s": 1.0, "setup_s": 10.0},
                "pema": {"rct_entries_per_s": 1000.0, "joint_entries_per_s": 500.0, "setup_s": 5.0,
                         "converge_epochs": {"reconstruction": 10, "joint": 12}},
                "lora": {"samples_per_s": 10.0, "precompute_samples_per_s": 2.0, "converge_epochs": 2}}}


def test_estimate_says_when_the_budget_stops_before_convergence():
    from plugins.estimate import EVAL_COST, estimate

    # 1,000 samples: max_heldout = 32 set aside for early stopping, 968 trained on; 8 per step → 121 steps, an
    # evaluation every ceil(121 / 4) = 31 steps
    est = estimate("adapter", {"max_minutes": 5, "max_epochs": 3}, "bb", 1000, 30000, table=TABLE)
    epoch_s = 968 + 121 / 31 * 32 * EVAL_COST
    assert est["loops"][0]["epoch_s"] == pytest.approx(epoch_s, abs=0.01)
    assert est["loops"][0]["epochs"] == 3 and not est["loops"][0]["converge_measured"]  # max_epochs: an upper bound
    assert est["under_trained"]
    assert est["loops"][0]["epochs_in_budget"] == pytest.approx((300 - 32 * EVAL_COST) / epoch_s, abs=0.01)
    assert "for all 3 epochs" in est["text"] and "your budget of 5 min stops at ≈ 0.29 epochs — under-trained" \
        in est["text"]
    ok = estimate("adapter", {"max_minutes": 0}, "bb", 1000, 30000, table=TABLE)
    assert not ok["under_trained"] and ok["text"].endswith("no time budget.")


def test_estimate_uses_measured_convergence_per_phase():
    from plugins.estimate import estimate

    est = estimate("pema", {"max_minutes": 60}, "bb", 1000, 30000, table=TABLE)
    assert [lp["epochs"] for lp in est["loops"]] == [10, 12]
    assert "to converge (≈ 22 epochs)" in est["text"] and "fits your budget of 60 min a phase" in est["text"]
    # the parts add up to the whole: the measured 5 s before the first step (the candidate vocabulary) are said
    parts = est["text"].split(" — ")[1].split(";")[0]
    assert parts.startswith("≈ 5 s before the first step, reconstruction 10 epochs ≈ "), parts
    assert est["converge_s"] == pytest.approx(est["setup_s"] + sum(lp["converge_s"] for lp in est["loops"]), abs=0.2)
    short = estimate("pema", {"max_minutes": 1}, "bb", 1000, 30000, table=TABLE)
    assert short["under_trained"] and "stops the reconstruction phase at" in short["text"]
    capped = estimate("pema", {"max_epochs_joint": 3, "max_minutes": 0}, "bb", 1000, 30000, table=TABLE)
    assert capped["loops"][1]["epochs"] == 3  # the settings' max_epochs caps the measured convergence


def test_estimate_counts_loras_precomputation_inside_its_budget():
    from plugins.estimate import estimate

    est = estimate("lora", {"max_minutes": 5}, "bb", 200, 6000, table=TABLE)
    assert est["setup_s"] == pytest.approx(100.0)  # 200 samples at 2/s
    assert est["loops"][0]["budget_s"] == pytest.approx(200.0)  # 300 s minus the precomputation


def test_estimate_without_a_measurement_says_so():
    from plugins.estimate import estimate

    est = estimate("adapter", {}, "another-backbone", 100, 3000, table=TABLE)
    assert not est["measured"] and "was not measured on another-backbone" in est["text"]


def test_estimate_prefers_the_record_of_this_kind_of_machine():
    from plugins.estimate import estimate, machine_kind

    table = {**TABLE, "bb@cpu-avx2": {"adapter": {"samples_per_s": 0.5, "setup_s": 10.0}}}
    bf16 = estimate("adapter", {"max_minutes": 0}, "bb", 1000, 30000, table=table, kind="cpu-bf16")
    avx2 = estimate("adapter", {"max_minutes": 0}, "bb", 1000, 30000, table=table, kind="cpu-avx2")
    # its own record: half the rate
    assert avx2["loops"][0]["epoch_s"] == pytest.approx(2 * bf16["loops"][0]["epoch_s"], abs=0.02)
    # a method without a record of its own kind falls back to the backbone's plain record
    assert estimate("lora", {}, "bb", 200, 6000, table=table, kind="cpu-avx2")["setup_s"] == pytest.approx(100.0)
    assert machine_kind() in ("cuda", "cpu-bf16", "cpu-avx2", "cpu")


def test_a_machines_own_record_keeps_the_plain_records_convergence():
    """A record of this kind of machine gives the rate; how many epochs early stopping took (the data's, not the
    machine's) comes from the plain record when the machine's own has none, and its own wins when it has one."""
    from plugins.estimate import estimate

    own = {"rct_entries_per_s": 2000.0, "joint_entries_per_s": 1000.0, "setup_s": 0.0}
    table = {**TABLE, "bb@cpu-bf16": {"pema": own}}
    est = estimate("pema", {"max_minutes": 0}, "bb", 900, 30000, table=table, kind="cpu-bf16")
    assert [lp["epochs"] for lp in est["loops"]] == [10, 12] and "to converge" in est["text"]
    assert est["loops"][1]["epoch_s"] == pytest.approx(
        estimate("pema", {"max_minutes": 0}, "bb", 900, 30000, table=TABLE)["loops"][1]["epoch_s"] / 2, rel=0.05)
    table["bb@cpu-bf16"]["pema"] = {**own, "converge_epochs": {"reconstruction": 10, "joint": 5}}
    est = estimate("pema", {"max_minutes": 0}, "bb", 900, 30000, table=table, kind="cpu-bf16")
    assert [lp["epochs"] for lp in est["loops"]] == [10, 5]


def test_estimate_follows_the_wait_policy_its_record_was_made_under(monkeypatch):
    """A record of a run whose OpenMP threads spun briefly (``plugins train``) estimates a studio's training
    (PASSIVE) ``PASSIVE_SLOWDOWN`` times slower, and the other way round; a record that names no policy is taken as
    it is."""
    from plugins.estimate import PASSIVE_SLOWDOWN, estimate

    spun = {"bb": {"adapter": {"samples_per_s": 2.0, "setup_s": 10.0, "wait_policy": "spin"}}}
    plain = {"bb": {"adapter": {"samples_per_s": 2.0, "setup_s": 10.0}}}

    def under(policy, table):
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        if policy == "passive":
            monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        else:
            monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
            monkeypatch.setenv("GOMP_SPINCOUNT", "20000")
        return estimate("adapter", {"max_minutes": 0}, "bb", 1000, 30000, table=table, kind="cpu-avx2")

    spin, passive = under("spin", spun), under("passive", spun)
    assert passive["loops"][0]["epoch_s"] == pytest.approx(PASSIVE_SLOWDOWN * spin["loops"][0]["epoch_s"], rel=0.01)
    assert passive["setup_s"] == pytest.approx(PASSIVE_SLOWDOWN * spin["setup_s"], rel=0.01)
    assert under("spin", plain)["converge_s"] == under("passive", plain)["converge_s"]


def test_estimate_scales_to_the_adapted_layers():
    """A residual adapter record of every layer (lowest 0 of 18) estimates one on the top 6 at about half the time
    for 2 epochs — a step runs a third of the layers, and each batch runs the 12 below once, forward only (the real
    runs on 1,000 pairs: 847 s against 428 s) —; a record that does not name its layers is taken as it is."""
    from plugins.estimate import estimate

    rec = {"samples_per_s": 2.0, "precompute_samples_per_s": 500.0, "setup_s": 0.0}
    table = {"bb": {"adapter": {**rec, "num_layers": 18, "lowest_layer": 0}}}
    every = estimate("adapter", {"max_minutes": 0}, "bb", 900, 30000, table=table, kind="cpu-avx2")
    top6 = estimate("adapter", {"max_minutes": 0, "layers": "top:6"}, "bb", 900, 30000, table=table, kind="cpu-avx2")
    assert 0.45 < top6["converge_s"] / every["converge_s"] < 0.6
    plain = {"bb": {"adapter": rec}}
    assert (estimate("adapter", {"max_minutes": 0, "layers": "top:6"}, "bb", 900, 30000, table=plain,
                     kind="cpu-avx2")["converge_s"]
            == estimate("adapter", {"max_minutes": 0}, "bb", 900, 30000, table=plain, kind="cpu-avx2")["converge_s"])


def test_record_of_a_finished_run_gives_back_its_time(tiny, tiny_memory, tmp_path):
    """``python -m plugins.estimate record``: the record of a finished run (a saved plug-in's ``train_info`` and
    ``history.json``) is read back from its folder, and an estimate from it, for the run's own memory size and
    settings, is that run's time (a 300-second run of 2 epochs: 900 samples, 100 set aside, 8 a step, 4
    evaluations an epoch, 60 s of batch preparation)."""
    from types import SimpleNamespace

    from plugins.api import make_config, open_plugin, train_plugin
    from plugins.estimate import estimate, record_from_run, save_measurements, throughputs

    plugin, _ = train_plugin(tiny, tiny_memory, "adapter", {"max_epochs": 2, "max_minutes": 0, "max_heldout": 4,
                                                            "patience": 1000}, out_dir=tmp_path / "p")
    rec = record_from_run(open_plugin(str(tmp_path / "p"), tiny), tmp_path / "p")
    assert rec["samples_per_s"] > 0 and rec["measured_on"]["epochs"] == plugin.train_info["epochs"] == 2

    settings = {"max_epochs": 2, "max_minutes": 0, "max_heldout": 100}
    cfg = make_config("adapter", settings)
    info = {"seconds": 300.0, "prepare_seconds": 60.0, "steps": 200, "epochs": 2, "train_samples": 800,
            "early_stop_samples": 100, "stopped_by": "max_epochs"}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "history.json").write_text(json.dumps(
        [{"step": i * 25, "heldout_loss": 2.0} for i in range(8)]))
    # a finished adapter run on every layer (``layers`` all: the lowest adapted is 0) of a backbone of 4
    run = SimpleNamespace(method="adapter", config=cfg, train_info=info, backbone=SimpleNamespace(num_layers=4),
                          lowest_layer=lambda: 0)
    rec = record_from_run(run, tmp_path / "run")
    path = save_measurements("bb@cpu-avx2", {"adapter": rec}, tmp_path / "t.json")
    est = estimate("adapter", settings, "bb", 900, 30000, table=throughputs(path), kind="cpu-avx2")
    assert est["converge_s"] == pytest.approx(300.0, rel=0.02)
    assert estimate("adapter", settings, "bb", 1800, 60000, table=throughputs(path),
                    kind="cpu-avx2")["converge_s"] == pytest.approx(600.0, rel=0.05)  # twice the samples


def test_record_of_a_saved_knn_index_counts_its_entries(tiny, tiny_memory, tmp_path):
    """A saved kNN plug-in has no memory attached when ``plugins.estimate record`` reads it: its rate comes from
    the entries its ``train_info`` counted, and the estimate for that memory gives back the run's time."""
    from plugins.api import open_plugin, train_plugin
    from plugins.estimate import estimate, record_from_run

    plugin, _ = train_plugin(tiny, tiny_memory, "knn", {}, out_dir=tmp_path / "k")
    rec = record_from_run(open_plugin(str(tmp_path / "k"), tiny), tmp_path / "k")
    info = plugin.train_info
    assert info["entries"] == len(tiny_memory)
    assert rec["entries_per_s"] == pytest.approx(len(tiny_memory) / max(info["seconds"], 1e-3), rel=0.01)
    est = estimate("knn", {}, "bb", 10, len(tiny_memory), table={"bb": {"knn": rec}}, kind="cpu")
    assert est["setup_s"] == pytest.approx(info["seconds"], abs=0.01)


def test_shipped_throughputs_cover_every_method_on_tiny_and_gemma():
    from plugins.estimate import throughputs
    from plugins.registry import available_methods

    table = throughputs()
    for bb in ("tiny-llama-64x2-seed0", "gemma-3-270m"):
        assert set(available_methods()) <= set(table.get(bb, {})), bb


# --- the studio: presets, estimate, the generated form ----------------------------------------------------------
@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    st = tiny_studio(tmp_path_factory.mktemp("form-data"))
    yield st
    st.close()


@pytest.fixture(scope="module")
def memory_id(studio):
    return build_tiny_memory(studio, name="form pairs")


def test_studio_estimate_before_training(studio, memory_id):
    est = studio.plugin_service.training_estimate(memory_id, "adapter", {"max_minutes": 5})
    assert est["measured"] and "epochs" in est["text"] and not est["under_trained"]
    tight = studio.plugin_service.training_estimate(memory_id, "adapter", {"max_minutes": 1e-5, "max_epochs": 1000})
    assert tight["under_trained"] and "under-trained" in tight["text"]
    with pytest.raises(UserError, match="batch_size"):  # the form's values are validated as the CLI's
        studio.plugin_service.training_estimate(memory_id, "adapter", {"batch_size": 0})
    with pytest.raises(UserError, match="No memory"):
        studio.plugin_service.training_estimate(memory_id, "adapter", {}, owner="someone-else")


def test_estimate_says_the_calibration_that_follows_training(studio, memory_id):
    """PEMA and kNN are tuned on held-out samples after training, in the same job (on a small memory it outlasts the
    training): the form's estimate and the job's log say on how many and about how long; an in-network method, or a
    memory with too few held-out samples to tune on, gets no such line."""
    import random

    from eval.calibrate import DEFAULT_TUNE, TYPICAL_SECONDS

    rng = random.Random(0)
    words = "house cat dog tree river city night music paper window garden light stone water bread".split()
    pairs = [(" ".join(rng.sample(words, 6)), " ".join(rng.sample(words, 6))) for _ in range(200)]
    mid = build_tiny_memory(studio, pairs, name="calibrated pairs")
    n = min(DEFAULT_TUNE, len(studio.memory_service.heldout_samples(mid, limit=10**6)) // 2)
    assert n >= 8
    line = f"Then its decode settings are tuned on {n} held-out samples"
    for method in ("pema", "knn"):
        est = studio.plugin_service.training_estimate(mid, method, {})
        assert line in est["text"], est["text"]
        assert est["calibration"]["seconds"] == pytest.approx(TYPICAL_SECONDS * n / DEFAULT_TUNE, abs=0.1)
    assert "calibration" not in studio.plugin_service.training_estimate(mid, "adapter", {"max_minutes": 5})
    assert "tuned on" not in studio.plugin_service.training_estimate(memory_id, "knn", {})["text"]  # 12 samples
    job = studio.jobs.wait(studio.plugin_service.submit_train(mid, "knn"), 120)
    assert job["state"] == "done", job
    assert any(line in ln and ln.split("] ", 1)[1].startswith("Time estimate:") for ln in job["log"].splitlines())


def test_generated_form_has_one_control_per_declared_setting(studio):
    import gradio as gr

    from ui import plugins as tab

    with gr.Blocks() as demo:
        tab.build(studio)
    ids = {getattr(b, "elem_id", None) for b in demo.blocks.values()}
    for m in studio.plugin_service.methods():
        assert {"default", "paper", "quick"} <= set(m["presets"]), m["method"]
        for d in m["training_settings"]:
            assert f"train-{m['method']}-{d['name']}".replace("_", "-") in ids, (m["method"], d["name"])
    pema = next(m for m in studio.plugin_service.methods() if m["method"] == "pema")
    vals = tab.preset_form_values(pema, "paper")
    assert vals["batch_size"] == 2048 and vals["kappa"] == pema["config"]["kappa"]
    order = [d["name"] for d in pema["training_settings"]]
    cfg = tab.form_config(pema, [vals[n] for n in order])
    assert cfg["b_init"] == "zeros" and set(cfg) == set(order)
    assert "rank" not in tab.form_config(pema, [None if n == "rank" else vals[n] for n in order])


# --- continue training for every in-network method ---------------------------------------------------------------
def _train_and_resume(tiny, memory, method, tmp_path):
    from safetensors.torch import load_file, save_file

    from plugins.api import open_plugin, train_plugin
    from plugins.training import optimizer_from_tensors, optimizer_tensors

    first, row = train_plugin(tiny, memory, method, SHORT_BY_METHOD.get(method, SHORT), out_dir=tmp_path / "a")
    assert first.resumable and first.optimizer_state["loop"]["steps"] == first.train_info["steps"] > 0
    save_file(optimizer_tensors(first.optimizer_state), str(tmp_path / "a" / "optimizer.safetensors"))
    before = {k: v.clone() for k, v in first.state_dict().items()}

    again = open_plugin(str(tmp_path / "a"), tiny)
    assert all(torch.equal(before[k], v) for k, v in again.state_dict().items())
    again.resume_state = optimizer_from_tensors(load_file(str(tmp_path / "a" / "optimizer.safetensors")))
    result = again.fit(memory)
    return first, row, again, result


@pytest.mark.parametrize("method", NETWORK_METHODS)
def test_continue_training_resumes_optimizer_and_loss(tiny, tiny_memory, tmp_path, method):
    first, row, again, result = _train_and_resume(tiny, tiny_memory, method, tmp_path)
    s1, s2 = first.train_info["steps"], again.train_info["steps"]
    # the step counter goes on: the saved loop counter and Adam's own step count are the sum of both runs
    assert again.optimizer_state["loop"]["steps"] == s1 + s2
    adam_steps = {float(st["step"]) for st in again.optimizer_state["optimizer"]["state"].values()}
    assert adam_steps == {float(s1 + s2)}
    assert again.train_info["continued_from_epochs"] == pytest.approx(first.train_info["epochs"], abs=0.01)
    assert again.train_info["total_epochs"] == pytest.approx(first.train_info["epochs"] + again.train_info["epochs"],
                                                             abs=0.02)
    # the loss goes on: the continued run starts at the first run's best early-stopping loss, not at the untrained one
    start_first = next(h["heldout_loss"] for h in row["history"] if "heldout_loss" in h)
    start_again = next(h["heldout_loss"] for h in result.history if "heldout_loss" in h)
    assert start_again == pytest.approx(first.train_info["best_heldout_loss"], rel=1e-4)
    assert start_again != pytest.approx(start_first, rel=1e-6)


def test_studio_continues_a_residual_adapter(studio, memory_id):
    job = studio.jobs.wait(studio.plugin_service.submit_train(memory_id, "adapter", SHORT, "adapter to continue"), 120)
    assert job["state"] == "done", job
    assert "Time estimate: " in studio.job_service.job(job["id"])["log"]  # said in the job's log before training starts
    pid = job["result"]["plugin_id"]
    assert next(p for p in studio.plugin_service.plugins() if p["id"] == pid)["can_continue"]
    assert next(m for m in studio.plugin_service.methods() if m["method"] == "adapter")["resumable"]
    cont = studio.jobs.wait(studio.plugin_service.submit_continue(pid, {"max_epochs": 2}), 120)
    assert cont["state"] == "done", cont
    metrics = cont["result"]["metrics"]
    assert metrics["continued_from_epochs"] == pytest.approx(job["result"]["metrics"]["epochs"], abs=0.01)
    assert metrics["total_epochs"] > metrics["continued_from_epochs"]
    assert "all 3 epochs" in cont["result"]["training"]["label"]  # 1 done + 2 more


# --- in the browser: preset → generated controls → estimate → train ---------------------------------------------
@pytest.mark.browser
def test_form_in_the_browser_preset_estimate_train(studio, memory_id):
    import socket

    pytest.importorskip("playwright")
    from pathlib import Path

    from playwright.sync_api import sync_playwright

    from ui.app import launch_app

    exe = "/usr/bin/chromium"
    if not Path(exe).exists():
        pytest.skip(f"{exe} is missing (tests/test_browser.py installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo, url = launch_app(studio, port=port, block=False, quiet=True)
    try:
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=exe, headless=True,
                                  args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = b.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(60_000)
            page.goto(url, wait_until="domcontentloaded")
            page.wait_for_selector("#pema-status .pema-status.ok")
            page.get_by_role("tab", name="Plug-ins").click()
            # the estimate appears for the memory picked on load and the default method (PEMA)
            page.wait_for_function("document.querySelector('#train-estimate-text')?.innerText.includes('epochs')")
            page.locator("#train-form").get_by_text("Hyperparameters").first.click()  # open the generated form
            page.locator("#train-preset label", has_text="paper").click()
            page.wait_for_function("document.querySelector('#train-pema-batch-size input')?.value === '2048'")
            assert "public code" in page.locator("#train-preset-note").inner_text()
            page.locator("#train-pema-rank input").fill("16")
            page.locator("#train-pema-rank input").press("Tab")
            shots = Path(__file__).resolve().parents[1] / "screenshots"
            shots.mkdir(exist_ok=True)
            page.screenshot(path=str(shots / "plugins-form.png"), full_page=True)
            n_before = len(studio.job_service.list_jobs())
            page.locator("#train-plugin").click()
            deadline = time.time() + 30
            while len(studio.job_service.list_jobs()) == n_before:
                assert time.time() < deadline, "no job was queued"
                time.sleep(0.2)
            job = studio.job_service.list_jobs()[0]
            cfg = job["args"]["config"]
            assert (cfg["rank"], cfg["batch_size"], cfg["b_init"], cfg["lora_alpha"]) == (16, 2048, "zeros", 1.0)
            studio.job_service.cancel_job(job["id"])
            b.close()
    finally:
        demo.close()


def test_method_info_says_where_a_comparison_starts_other_than_the_declared_defaults(studio):
    """The Plug-ins tab listed PEMA's declared λ_max 0.8 / GU on while Compare starts translation on Gemma at the
    tuned 0.2 / GU off: the tab now says which values a comparison starts at, per task, where they differ."""
    from ui import plugins as tab

    pema = next(m for m in studio.plugin_service.methods() if m["method"] == "pema")
    starts = {"translation": {"lambda_max": 0.2, "gu": False, "gu_min": 0.0}, "style": {"lambda_max": 0.8}}
    text = tab._method_info(pema, starts)
    assert "lambda_max=0.8 (live)" in text  # the declared defaults
    tuned = text.split("tuned on dev data")[1]
    assert "translation: lambda_max=0.2, gu=False" in tuned and "style" not in tuned and "gu_min" not in tuned
    assert "tuned" not in tab._method_info(pema, {"translation": {"lambda_max": 0.8}})


def test_cli_methods_lists_where_a_comparison_starts(capsys):
    """``python -m plugins methods`` lists the declared decode defaults, and — as the Plug-ins tab — the tuned values a
    comparison starts at where they differ (the shipped tuned file's, per backbone)."""
    import plugins.__main__ as cli
    from plugins.settings import tuned_decode_settings

    tuned = tuned_decode_settings("pema", "translation", "gemma-3-270m")
    assert tuned.get("lambda_max") not in (None, 0.8)  # the shipped file tunes it away from the paper's 0.8
    assert cli.main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "decode pema.lambda_max = 0.8" in out
    assert f"a comparison on gemma-3-270m starts at the values tuned on dev data: translation: lambda_max=" \
           f"{tuned['lambda_max']}" in out
    assert cli.main(["methods", "--backbone", "no-such-model"]) == 0  # no tuned values: only the declared ones
    assert "starts at the values tuned" not in capsys.readouterr().out
