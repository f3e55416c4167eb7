"""The page in a real browser: headless Chromium from Debian (never a downloaded one) driven by Playwright.

The fixture prepares a memory and a PEMA plug-in (and a kNN one) through the service on the tiny backbone, then
serves the app; the tests run a comparison, move the λ_max slider and check that the outputs follow, share the
comparison and open its link, and take screenshots of every tab at 1280×800 into ``screenshots/`` (gitignored).

If ``/usr/bin/chromium`` is missing the fixture runs ``apt-get install -y chromium`` itself and skips the tests
with a clear message when that fails.
"""
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "screenshots"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWPORT = {"width": 1280, "height": 800}
PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3
# Trained hard enough that the tiny model's PEMA output differs from the base model's at λ_max = 0.8.
STRONG_PEMA = {"rank": 32, "lr": 1e-2, "max_epochs_rct": 15, "max_epochs_joint": 40, "patience": 100}


def ensure_chromium() -> str:
    if Path(CHROMIUM).exists():
        return CHROMIUM
    if shutil.which("apt-get") is None:
        pytest.skip(f"{CHROMIUM} is missing and apt-get is not available to install Debian's chromium")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update"], check=True, capture_output=True, timeout=600, env=env)
        subprocess.run(["apt-get", "install", "-y", "chromium"], check=True, capture_output=True, timeout=1200,
                       env=env)
    except (subprocess.SubprocessError, OSError) as e:
        detail = getattr(e, "stderr", b"") or b""
        pytest.skip(f"{CHROMIUM} is missing and `apt-get install -y chromium` failed: {e} "
                    f"{detail.decode('utf-8', 'replace')[-300:]}")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"`apt-get install -y chromium` ran but {CHROMIUM} is still missing")
    return CHROMIUM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    exe = ensure_chromium()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from studio.service import Studio
    from ui.app import launch_app

    studio = Studio(tmp_path_factory.mktemp("browser-data"), backbone="tiny")
    assert studio.wait_ready(120), studio.status()
    tsv = "\n".join(f"{s}\t{t}" for s, t in PAIRS)
    job = studio.jobs.wait(studio.submit_build(tsv, "pairs.tsv", name="demo pairs"), 120)
    assert job["state"] == "done", job
    mid = job["result"]["memory_id"]
    pema = studio.jobs.wait(studio.submit_train(mid, "pema", STRONG_PEMA, "PEMA demo"), 180)
    knn = studio.jobs.wait(studio.submit_train(mid, "knn", {}, "kNN demo"), 120)
    assert pema["state"] == "done" and knn["state"] == "done", (pema, knn)
    demo, url = launch_app(studio, port=free_port(), block=False, quiet=True)
    SHOTS.mkdir(exist_ok=True)
    yield {"url": url.rstrip("/"), "studio": studio, "memory_id": mid}
    demo.close()
    studio.close()


@pytest.fixture()
def page(browser):
    ctx = browser.new_context(viewport=VIEWPORT)
    pg = ctx.new_page()
    pg.set_default_timeout(60_000)
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not errors, f"JavaScript errors on the page: {errors[:3]}"


def open_app(page, url: str) -> None:
    page.goto(url, wait_until="domcontentloaded")
    page.wait_for_selector("#pema-status .pema-status.ok")


def cards(page) -> list[dict]:
    out = []
    for c in page.locator("#compare-outputs .pema-card, #shared-outputs .pema-card").all():
        out.append({"label": c.locator(".pema-card-head b").inner_text(),
                    "text": c.locator(".pema-card-text").inner_text().strip(),
                    "foot": c.locator(".pema-card-foot").inner_text()})
    return out


def test_compare_live_slider_share(page, app):
    open_app(page, app["url"])
    page.get_by_role("tab", name="Compare").click()
    page.locator("#compare-source textarea").fill("the house is small")
    for label in page.locator("#compare-methods label").all():
        if "PEMA demo" in label.inner_text() or "kNN demo" in label.inner_text():
            label.click()
    page.wait_for_selector("#set-pema-lambda-max input[type=range]")  # the PEMA controls appear once PEMA is chosen
    t0 = time.time()
    page.locator("#compare-run").click()
    page.wait_for_function("document.querySelectorAll('#compare-outputs .pema-card').length === 3")
    first = {c["label"]: c for c in cards(page)}
    print(f"first comparison shown after {time.time() - t0:.2f}s")
    assert sorted(first) == ["Base model", "PEMA demo", "kNN demo"]
    base, pema, knn = first["Base model"], first["PEMA demo"], first["kNN demo"]
    assert "lambda_max=0.8" in pema["foot"] and "k=16" in knn["foot"]
    assert pema["text"] != base["text"]  # the trained plug-in changes the output at λ_max = 0.8
    page.wait_for_selector("#token-chips")
    page.screenshot(path=str(SHOTS / "compare.png"))
    page.screenshot(path=str(SHOTS / "compare-full.png"), full_page=True)

    # Move the λ_max slider to 0: every method is decoded again at once, and PEMA falls back to the base model.
    slider = page.locator("#set-pema-lambda-max input[type=range]")
    slider.focus()
    t0 = time.time()
    page.keyboard.press("Home")
    page.wait_for_function("[...document.querySelectorAll('#compare-outputs .pema-card-foot')]"
                           ".some(e => e.innerText.includes('lambda_max=0,'))")
    print(f"re-decoded after the slider moved in {time.time() - t0:.2f}s")
    after = {c["label"]: c for c in cards(page)}
    assert after["PEMA demo"]["text"] == after["Base model"]["text"] != pema["text"]
    assert after["kNN demo"]["text"] == knn["text"]  # kNN's settings did not change
    page.screenshot(path=str(SHOTS / "compare-lambda0.png"), full_page=True)

    # Share, then open the link: the same outputs under neutral labels (the methods' titles), read-only, on a page
    # of its own (no workspace tabs).
    page.locator("#share-btn").click()
    page.wait_for_function("(document.querySelector('#share-link textarea, #share-link input') || {}).value"
                           "?.includes('?c=')")
    link = page.locator("#share-link textarea, #share-link input").first.input_value()
    assert link.startswith("http") and "/share/?c=" in link
    page.goto(link, wait_until="domcontentloaded")
    page.wait_for_function("document.querySelectorAll('#shared-outputs .pema-card').length === 3")
    shared = {c["label"]: c["text"] for c in cards(page)}
    assert shared == {"Base model": after["Base model"]["text"],
                      "PEMA (+ Gradual Unrolling)": after["PEMA demo"]["text"],
                      "kNN-LM / kNN-MT": after["kNN demo"]["text"]}
    tab = page.get_by_role("tab", name="Memories")
    assert tab.count() == 0 or not tab.is_visible()  # the owner's workspace is not shown
    assert "Shared comparison" in page.locator("#shared-header").inner_text()
    page.screenshot(path=str(SHOTS / "shared.png"), full_page=True)


def test_tabs_upload_preview_and_jobs(page, app, tmp_path):
    open_app(page, app["url"])
    bad = tmp_path / "mine.jsonl"
    bad.write_text('{"src": "a", "tgt": "b"}\n{"src": "c", "tgt": "d"}\n{"src": broken\n', encoding="utf-8")
    page.locator("input[type=file]").first.set_input_files(str(bad))
    page.wait_for_function("document.querySelector('#preview-summary')?.innerText.includes('problem')")
    summary = page.locator("#preview-summary").inner_text()
    assert "2 sample(s) parsed" in summary and "line 3: not valid JSON" in summary
    page.screenshot(path=str(SHOTS / "memories.png"), full_page=True)

    page.get_by_role("tab", name="Plug-ins").click()
    page.wait_for_function("document.querySelector('#job-card')?.innerText.includes('done')")
    page.wait_for_selector("#jobs-table")
    time.sleep(1.5)  # let the loss curve draw
    page.screenshot(path=str(SHOTS / "plugins.png"), full_page=True)

    page.get_by_role("tab", name="Evaluate").click()
    time.sleep(1)
    # the held-out split of the memory, base vs PEMA, in the background
    for label in page.locator("#tabs label, label").filter(has_text="PEMA demo [pema]").all():
        if label.is_visible():
            label.click()
    page.locator("#eval-run").click()
    page.wait_for_function("document.querySelector('#eval-scores')?.innerText.includes('PEMA demo')",
                           timeout=120_000)
    time.sleep(1)
    page.screenshot(path=str(SHOTS / "evaluate.png"), full_page=True)


def test_hosted_browsers_each_see_only_their_own(browser, tmp_path):
    """Multi-user mode in a real browser: the key cookie rides along with the page's requests (queue included), the
    page shows the browser's key, and a second browser sees nothing of the first one's."""
    from studio.service import Studio
    from ui.app import launch_app

    studio = Studio(tmp_path / "hosted", backbone="tiny", multi_user=True)
    assert studio.wait_ready(120), studio.status()
    served, url = launch_app(studio, port=free_port(), block=False, quiet=True)
    try:
        ctx_a, ctx_b = browser.new_context(viewport=VIEWPORT), browser.new_context(viewport=VIEWPORT)
        pa, pb = ctx_a.new_page(), ctx_b.new_page()
        for pg in (pa, pb):
            pg.set_default_timeout(60_000)
            open_app(pg, url)
            pg.get_by_text("Your key (for the API)").click()  # the accordion renders its contents when opened
            pg.wait_for_function("document.querySelector('#pema-key input, #pema-key textarea')?.value")
        key_a = next(c["value"] for c in ctx_a.cookies() if c["name"] == "pema_owner")
        cookie = next(c for c in ctx_a.cookies() if c["name"] == "pema_owner")
        assert cookie["httpOnly"] and key_a.startswith("pk1.a.")
        assert pa.locator("#pema-key input, #pema-key textarea").first.input_value() == key_a
        owner_a = studio.identity.owner_of_key(key_a)
        tsv = "\n".join(f"{s}\t{t}" for s, t in PAIRS)
        job = studio.jobs.wait(studio.submit_build(tsv, "pairs.tsv", name="only for A", owner=owner_a), 120)
        assert job["state"] == "done", job
        for pg in (pa, pb):
            pg.reload(wait_until="domcontentloaded")
            pg.wait_for_selector("#pema-status .pema-status.ok")
            pg.get_by_text("Your key (for the API)").click()
            pg.wait_for_function("document.querySelector('#pema-key input, #pema-key textarea')?.value")
        pa.wait_for_function("document.body.innerText.includes('only for A')")
        time.sleep(1)
        assert "only for A" not in pb.locator("body").inner_text()
        pa.screenshot(path=str(SHOTS / "hosted.png"), full_page=True)
        ctx_a.close()
        ctx_b.close()
    finally:
        served.close()
        studio.close()
