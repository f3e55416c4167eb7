"""The Rank tab in headless Chromium (Debian's, driven by Playwright) on the tiny backbone: a finished ranking shows
its leaderboard (every ranked method and the base model), both Pareto plots and the verdict; the tour offers the
demo corpus with a time estimate when the machine has it; the share link opens a read-only leaderboard that shows
no id, name or key. Screenshots go to ``screenshots/`` (gitignored)."""
import os

import pytest
from _server import SHOTS, browser_page, browser_session, build_tiny_memory, open_app, served_page_app, tiny_studio
from test_rank import unique_pairs

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

pytestmark = pytest.mark.browser
METHODS = ["knn", "pema", "adapter"]


browser = pytest.fixture(scope="module", name="browser")(browser_session)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    studio = tiny_studio(tmp_path_factory.mktemp("rank-browser-data"))
    mid = build_tiny_memory(studio, unique_pairs(110), "my pairs")
    job = studio.jobs.wait(studio.rank_service.submit_rank(mid, methods=METHODS), 300)
    assert job["state"] == "done", job
    with served_page_app(studio) as url:
        yield {"url": url, "studio": studio, "memory_id": mid, "job": job}
    studio.close()


page = pytest.fixture(name="page")(browser_page)


def test_leaderboard_plot_verdict_and_share(page, app):
    board = app["job"]["result"]["leaderboard"]
    open_app(page, app["url"])
    page.get_by_role("tab", name="Rank").click()
    page.wait_for_selector("#rank-verdict-text")
    verdict = page.locator("#rank-verdict-text").inner_text()
    assert verdict == board["verdict"]
    assert "Memory my pairs (" in page.locator("#rank-verdict").inner_text()  # the owner's view names the memory
    page.wait_for_selector("#rank-table [aria-rowcount='5']")  # a header and 4 rows: 3 methods and the base
    text = page.locator("#rank-table").inner_text()
    assert all(r["title"] in text for r in board["methods"]), text
    for plot in ("#rank-pareto-time", "#rank-pareto-params"):
        page.wait_for_selector(f"{plot} .js-plotly-plot .scatterlayer .point")
    assert "training time" in page.locator("#rank-pareto-time").inner_text()
    assert "trainable parameters" in page.locator("#rank-pareto-params").inner_text()
    assert "Wall time per phase" in page.locator("#rank-phases").inner_text()
    # the tour: the demo corpus, one click, a time estimate
    if app["studio"].memory_service.corpora().get("gettext-de"):
        page.wait_for_selector("#rank-tour-time")
        assert "Time estimate" in page.locator("#rank-tour-time").inner_text()
    page.screenshot(path=str(SHOTS / "rank.png"), full_page=True)

    # Compare's picker marks the leaderboard's best method (when one beat the base model)
    if board.get("best"):
        page.get_by_role("tab", name="Compare").click()
        page.wait_for_function("document.querySelector('#compare-methods').innerText.includes('★ best on')")

    page.get_by_role("tab", name="Rank").click()
    page.locator("#rank-share").click()
    page.wait_for_selector("#rank-share-url")
    href = page.locator("#rank-share-url").get_attribute("href")
    assert href.startswith("/share/?c=")
    page.goto(app["url"] + href, wait_until="domcontentloaded")
    page.wait_for_selector("#shared-rank-verdict #rank-verdict-text")
    assert page.locator("#rank-verdict-text").inner_text() == board["verdict"]
    assert "A memory of " in page.locator("#shared-rank-verdict").inner_text()  # its size, never its name
    page.wait_for_selector("#shared-rank-table [aria-rowcount='5']")
    page.wait_for_selector("#shared-rank-pareto-time .js-plotly-plot .scatterlayer .point")
    html = page.content()
    private = [app["memory_id"], app["job"]["id"], "my pairs",
               *(r["plugin_id"] for r in board["methods"] if r.get("plugin_id"))]
    for s in private:
        assert s not in html, s
    tab = page.get_by_role("tab", name="Memories")
    assert tab.count() == 0 or not tab.is_visible()
    page.screenshot(path=str(SHOTS / "rank-shared.png"), full_page=True)


def test_the_picker_opens_on_the_ranked_memory(page, app):
    """A memory built after the ranking is the newest (the default of every other picker), yet the Rank tab's
    picker opens on the memory of the caller's latest ranking, whichever of the page's load and the tab's refresh
    answers first (both start there)."""
    build_tiny_memory(app["studio"], unique_pairs(30), "later pairs")
    for wait_for_load in (False, True):  # the tab opened at once (its refresh races the load), then after the load
        if wait_for_load:
            open_app(page, app["url"])
        else:
            page.goto(app["url"], wait_until="domcontentloaded")
        page.get_by_role("tab", name="Rank").click()
        page.wait_for_function("(document.querySelector('#rank-memory input') || {}).value?.startsWith('my pairs')")
        page.wait_for_timeout(1500)  # a late answer of the other event must not move it
        assert page.locator("#rank-memory input").input_value().startswith("my pairs")
