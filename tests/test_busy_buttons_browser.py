"""Buttons that start a job are disabled, their label saying what runs, while that job is queued or running — after
a reload too — and back when it ends or is cancelled (``ui.common.disable_while_running``), in headless Chromium on
the tiny backbone; "Continue training" with "Train in background" while any training of the owner runs. The test
holds the backbone from another thread, so a job that needs it stays running until the test lets go
(``backbone_held``). A Cancel is enabled only while its job runs."""
import os

import pytest
from _server import (
    TINY_PAIRS,
    backbone_held,
    browser_page,
    browser_session,
    build_tiny_memory,
    open_app,
    served_page_app,
    tiny_studio,
)

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

pytestmark = pytest.mark.browser
WAIT_MS = 30_000

browser = pytest.fixture(scope="module", name="browser")(browser_session)
page = pytest.fixture(name="page")(browser_page)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    studio = tiny_studio(tmp_path_factory.mktemp("busy-buttons-data"))
    mid = build_tiny_memory(studio, TINY_PAIRS, "busy pairs")
    with served_page_app(studio) as url:
        yield {"url": url, "studio": studio, "memory_id": mid}
    studio.close()




def disabled(page, sel: str, yes: bool = True) -> None:
    page.wait_for_function(f"{'' if yes else '!'}document.querySelector('{sel}').disabled", timeout=WAIT_MS)


def latest(studio, kind: str) -> dict:
    return studio.job_service.list_jobs((kind,), 1, owner=None)[0]


def test_build_is_disabled_while_its_build_runs_and_after_a_reload(page, app):
    st = app["studio"]
    with backbone_held(st):
        open_app(page, app["url"])
        page.get_by_role("tab", name="Memories").click()
        page.get_by_label("Paste text").check()
        page.get_by_placeholder("One sample a line", exact=False).fill(
            "\n".join(f"{s}\t{t}" for s, t in TINY_PAIRS))
        assert page.locator("#build-memory").is_enabled()
        assert not page.locator("#cancel-build").is_enabled()  # nothing to cancel on an idle page
        page.locator("#build-memory").click()
        disabled(page, "#build-memory")
        disabled(page, "#cancel-build", yes=False)
        assert "Building a memory" in page.locator("#build-memory").inner_text()
        job = latest(st, "build_memory")
        assert job["state"] in ("queued", "running"), job
        page.reload(wait_until="domcontentloaded")  # the page finds the build still running
        open_app(page, app["url"])
        disabled(page, "#build-memory")
        disabled(page, "#cancel-build", yes=False)
    done = st.jobs.wait(job["id"], 120)
    assert done["state"] == "done", done
    disabled(page, "#build-memory", yes=False)
    disabled(page, "#cancel-build")
    assert page.locator("#build-memory").inner_text().strip() == "Build memory"
    st.memory_service.delete_memory(done["result"]["memory_id"], owner=None)  # the pickers start at "busy pairs"


def test_evaluate_and_train_are_disabled_while_their_jobs_run_and_back_when_cancelled_or_done(page, app):
    st = app["studio"]
    with backbone_held(st):
        open_app(page, app["url"])
        page.get_by_role("tab", name="Evaluate").click()
        page.wait_for_function("(document.querySelector('#eval-memory input') || {}).value?.startsWith('busy pairs')")
        page.locator("#eval-run").click()
        disabled(page, "#eval-run")
        disabled(page, "#eval-sweep")
        assert "An evaluation is running" in page.locator("#eval-run").inner_text()
        evaluation = latest(st, "evaluate")
        assert evaluation["state"] in ("queued", "running"), evaluation

        page.get_by_role("tab", name="Plug-ins").click()
        page.wait_for_function("(document.querySelector('#train-memory input') || {}).value?.startsWith('busy pairs')")
        assert page.locator("#cancel-job").is_disabled()  # no job shown: nothing to cancel
        page.locator("#train-plugin").click()
        disabled(page, "#train-plugin")
        disabled(page, "#cancel-job", yes=False)  # the job shown (the new training) is queued
        assert "A training is running" in page.locator("#train-plugin").inner_text()
        assert latest(st, "train_plugin")["state"] in ("queued", "running")
        # queued behind the evaluation, the training is cancelled at once
        page.get_by_role("button", name="Cancel job", exact=True).click()
        disabled(page, "#train-plugin", yes=False)
        disabled(page, "#cancel-job")  # the job shown has ended
        assert latest(st, "train_plugin")["state"] == "cancelled"
        assert page.locator("#train-plugin").inner_text().strip() == "Train in background"

        page.get_by_role("tab", name="Evaluate").click()
        assert page.locator("#eval-run").is_disabled()  # its evaluation still waits for the backbone
    assert st.jobs.wait(evaluation["id"], 120)["state"] == "done"
    disabled(page, "#eval-run", yes=False)
    disabled(page, "#eval-sweep", yes=False)
    assert page.locator("#eval-run").inner_text().strip() == "Evaluate in background"


def choose(page, dropdown: str, option: str) -> None:
    """Pick the option whose text contains ``option`` in the Gradio dropdown ``dropdown`` (a CSS selector)."""
    page.locator(f"{dropdown} input").click()
    page.get_by_role("option", name=option).first.click()


def test_continue_training_is_disabled_while_a_training_runs_and_after_a_reload(page, app):
    st = app["studio"]
    short = {"max_epochs": 1, "patience": 1000, "max_minutes": 0.0}
    trained = st.jobs.wait(st.plugin_service.submit_train(app["memory_id"], "adapter", short, "busy adapter"), 120)
    assert trained["state"] == "done", trained
    open_app(page, app["url"])
    page.get_by_role("tab", name="Plug-ins").click()
    choose(page, "#plugin-pick", "busy adapter")
    page.locator("#continue-training").wait_for(state="visible", timeout=WAIT_MS)
    assert page.locator("#continue-training").is_enabled()
    with backbone_held(st):
        page.locator("#continue-training").click()
        disabled(page, "#continue-training")  # a second click would start a second training
        assert "A training is running" in page.locator("#continue-training").inner_text()
        disabled(page, "#train-plugin")
        job = latest(st, "train_plugin")
        assert job["state"] in ("queued", "running") and job["args"]["continue_from"] == trained["result"]["plugin_id"]
        page.reload(wait_until="domcontentloaded")  # the page finds the training still running
        open_app(page, app["url"])
        page.get_by_role("tab", name="Plug-ins").click()
        choose(page, "#plugin-pick", "busy adapter")
        page.locator("#continue-training").wait_for(state="visible", timeout=WAIT_MS)
        disabled(page, "#continue-training")
        assert "A training is running" in page.locator("#continue-training").inner_text()
    done = st.jobs.wait(job["id"], 120)
    assert done["state"] == "done", done
    disabled(page, "#continue-training", yes=False)
    assert page.locator("#continue-training").inner_text().strip() == "Continue training"
    disabled(page, "#train-plugin", yes=False)
