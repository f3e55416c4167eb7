"""A public studio probed as an attacker would, round four (issue 60), over raw HTTP on the tiny backbone
(``--multi-user``): what a stranger's calls leave in the server is bounded, a user's text is never drawn as markup in
a figure, quotas count the work in flight (the first-run tour included), every numeric argument is finite and in its
declared range, an owner can delete a share, and a client of an earlier release still gets answers.
"""
import json
import os
import time
import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from _server import TINY_PAIRS, hosted_site, owner_with_plugin  # noqa: E402

JSONL = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in TINY_PAIRS)
HOSTILE = ('<a href="https://evil.example/">Session expired: sign in</a><span style="font-size:60px">X</span>'
           '<b>bold</b><img src=x onerror=alert(1)>')


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A multi-user studio over HTTP; owner A has a memory and a kNN plug-in."""
    cache, data = tmp_path_factory.mktemp("gradio-cache"), tmp_path_factory.mktemp("site")
    with hosted_site(data, cache, ["queue_size=64"]) as (studio, served, url):
        ka, owner_a, mid, pid = owner_with_plugin(studio)
        yield SimpleNamespace(studio=studio, served=served, url=url, ka=ka, owner_a=owner_a, mid=mid, pid=pid,
                              blocks=served.blocks[0], share_blocks=served.blocks[1])


@pytest.fixture
def limits(site):
    """Set bounds for one test (``limits(plugins_per_owner=3)``); the old ones come back after it."""
    old = site.studio.limits

    def narrow(**values):
        site.studio.limits = replace(old, **values)
        site.studio.jobs.max_per_owner = site.studio.limits.jobs_per_owner
        site.studio.jobs.max_total = site.studio.limits.jobs_total

    yield narrow
    site.studio.limits = old
    site.studio.jobs.max_per_owner, site.studio.jobs.max_total = old.jobs_per_owner, old.jobs_total


@pytest.fixture
def paused(site):
    """The job worker takes nothing: what is queued stays queued (cancelled at the end)."""
    site.studio.jobs.pause()
    yield
    for j in site.studio.jobs.list(states=("queued",), limit=1000):
        site.studio.jobs.cancel(j["id"])
    site.studio.jobs.resume()


def post(url: str, api: str, body, key: str | None = None, prefix: str = ""):
    """``POST …/gradio_api/call/<api>`` with ``body`` as given (a string is sent as is: NaN and friends)."""
    import httpx

    text = body if isinstance(body, str) else json.dumps({"data": body})
    return httpx.post(f"{url}{prefix}gradio_api/call/{api}", content=text, timeout=60,
                      headers={"content-type": "application/json", **({"X-Pema-Key": key} if key else {})})


def call(url: str, api: str, data, key: str | None = None, prefix: str = "") -> tuple[int, str, object]:
    """An API call and its result: (status, "complete" | "error", payload), or (status, "", text) when refused."""
    import httpx

    r = post(url, api, data, key, prefix)
    if r.status_code != 200:
        return r.status_code, "", r.text
    event = ""
    with httpx.Client(base_url=url, headers={"X-Pema-Key": key} if key else {}, timeout=120) as h:
        with h.stream("GET", f"{prefix}gradio_api/call/{api}/{r.json()['event_id']}") as stream:
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event in ("complete", "error"):
                    raw = line[5:].strip()
                    out = json.loads(raw, parse_constant=_refuse_constant) if raw != "null" else None
                    if event == "complete" and isinstance(out, list) and len(out) == 1:
                        out = out[0]  # an endpoint's one output
                    return 200, event, out
    return 200, event, None


def _refuse_constant(name):
    raise AssertionError(f"the answer holds {name}, which JSON.parse refuses")


def new_key(site) -> tuple[str, str]:
    key = site.studio.identity.new_browser_key()
    return key, site.studio.identity.owner_of_key(key)


# --- 1. memory per caller: API calls keep no session, unread results go, a share page keeps the id only ------------
def test_api_calls_keep_no_session_and_unread_results_are_swept(site):
    studio_blocks, share_blocks = site.blocks, site.share_blocks
    assert studio_blocks.state_session_capacity == site.studio.limits.sessions == share_blocks.state_session_capacity
    assert studio_blocks._queue.ANALYTICS_MAX_EVENTS <= 64
    sessions = len(studio_blocks.state_holder.session_data)
    for i in range(12):  # anonymous calls, half of them never read
        r = post(site.url, "status", [])
        assert r.status_code == 200
        if i % 2 == 0:
            assert call(site.url, "status", [])[1] == "complete"
    for _ in range(3):
        assert call(site.url, "memories", [], site.ka)[1] == "complete"
    queue = studio_blocks._queue
    t0 = time.time()
    while queue.event_ids_to_events:  # the unread calls finish too
        assert time.time() - t0 < 60, "the queue never drained"
        time.sleep(0.1)
    assert len(studio_blocks.state_holder.session_data) <= sessions  # no session outlives its API call
    assert len(queue.pending_messages_per_session) >= 6  # the unread results (and the empty queues of the rest)
    sweeper, clock = site.served.sweeper, [0.0]
    old = sweeper.clock
    sweeper.clock = lambda: clock[0]
    try:
        sweeper._idle = [{} for _ in sweeper.blocks]
        sweeper._last_event = {}  # noted on the real clock; the calls ended before the fake one starts
        sweeper.sweep()
        assert len(queue.pending_messages_per_session) >= 6  # kept a while for a slow reader
        clock[0] = sweeper.keep_s + 1
        sweeper.sweep()
    finally:
        sweeper.clock = old
    assert not queue.pending_messages_per_session and not queue.pending_event_ids_session


def test_a_share_page_session_holds_the_share_id_not_its_payload(site):
    import httpx

    key, _ = new_key(site)
    p = call(site.url, "compare", ["the cat sleeps", "translation", ["base"], {}, 4, 1, 0], key)[2]
    sid = call(site.url, "share", [p["id"]], key)[2]["id"]
    config = httpx.get(site.url + "share/config", timeout=30).json()
    load = next(d["id"] for d in config["dependencies"] if any(t[1] == "load" for t in d["targets"]))
    session = uuid.uuid4().hex
    with httpx.Client(base_url=site.url, timeout=60) as h:
        r = h.post("share/gradio_api/queue/join", params={"c": sid},
                   json={"data": [], "fn_index": load, "session_hash": session, "event_data": None,
                         "trigger_id": None})
        assert r.status_code == 200
        with h.stream("GET", "share/gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if '"process_completed"' in line:
                    break
    state = site.share_blocks.state_holder.session_data[session]
    kept = [v for v in state.state_data.values() if v is not None]
    assert kept == [sid]  # the payload (up to share_bytes) is read again by id at each event, never kept


# --- 2. one escaping rule: a user's text is drawn as text in every figure ------------------------------------------
def _strings(value, key=""):
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            if k != "template":
                yield from _strings(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v, key)


def assert_no_markup(fig, where: str) -> None:
    """No text of the figure holds markup Plotly would draw; templates hold only this app's own tags."""
    import re

    d = json.loads(fig.to_json())
    for key, text in _strings(d):
        if key in ("hovertemplate", "texttemplate"):
            tags = set(re.findall(r"</?([a-zA-Z]+)", re.sub(r"%\{[^}]*\}", "", text)))
            assert tags <= {"br", "extra"}, (where, key, text)
        else:
            assert "<" not in text and ">" not in text, (where, key, text)


def hostile_figures():
    """Every figure builder of the studio and the share page, fed the hostile text wherever a user's text goes."""
    from ui import plots, rank

    h = HOSTILE
    trace = [{"token": 5, "text": h, "lambda": 0.4, "top_lm": [[1, h, 0.5], [2, "b", 0.2]],
              "top_plugin": [[1, h, 0.6]], "top_final": [[1, h, 0.55]],
              "neighbours": [{"token": h, "distance": 0.3, "rank": 1, "xy": [0.1, 0.2], "same_as_output": True}],
              "memory_attention": {h: 0.7, "m1": 0.3}}]
    row = {"label": h, "method": "knn", "trace": trace, "token_texts": [h]}
    profile = {"top_tokens": [{"token_id": 7, "text": h, "count": 3, "share": 0.5}], "distinct_tokens": 9,
               "projection": {"points": [[0.1, 0.2], [0.3, 0.4]], "tokens": [7, 8], "explained": [0.5, 0.2],
                              "sample_size": 2}}
    nmap = {"label": h, "token": h, "token_index": 0, "query": [0.0, 0.0], "query_label": h,
            "projection": profile["projection"],
            "neighbours": [{"rank": 1, "token": h, "distance": 0.2, "xy": [0.1, 0.1], "same_as_output": True},
                           {"rank": 2, "token": "x", "distance": 0.4, "xy": [0.3, 0.1]}]}
    board = {"methods": [{"rank": 1, "method": "knn", "title": h, "name": h, "plugin_name": h, "chrf": 40.0,
                          "training_seconds": 3.0, "trainable_parameters": 0, "chrf_delta": 1.0, "p_chrf": 0.1},
                         {"rank": 2, "method": "base", "title": "Base", "chrf": 39.0, "training_seconds": 0,
                          "trainable_parameters": 0}], "pareto": {"training_seconds": ["knn"]}}
    yield "empty", plots.empty(h)
    yield "loss_curve", plots.loss_curve([{"phase": h, "step": 1, "loss": 2.0, "heldout_loss": 2.1}], title=h)
    yield "lambda_curve", plots.lambda_curve([row], selected=(h, 0), title=h)
    yield "token_bars", plots.token_bars(trace[0])
    yield "neighbour_bars", plots.neighbour_bars(trace[0]["neighbours"], title=h)
    yield "memory_attention", plots.memory_attention_heatmap(row, title=h)
    yield "input_attention", plots.input_attention_heatmap({"matrix": [[0.5]], "output_tokens": [h],
                                                            "input_tokens": [h], "layer": h})
    yield "eval_bars", plots.eval_bars([{"label": h, "method": h, "chrf": 40.0, "sacrebleu": 20.0}], title=h)
    yield "sweep_lines", plots.sweep_lines([{"lambda_max": 0.5, "gu": True, "sacrebleu": 20.0}], title=h)
    yield "token_frequencies", plots.token_frequencies(profile, title=h)
    yield "memory_map", plots.memory_map(profile)
    yield "memory_map_token", plots.memory_map(profile, token_id=7, title=h)
    yield "neighbour_map", plots.neighbour_map(nmap)
    for key in ("training_seconds", "trainable_parameters"):
        yield f"pareto_{key}", rank.pareto_figure(board, key)


def test_hostile_labels_and_names_are_never_markup_in_any_figure():
    names = []
    for name, fig in hostile_figures():
        assert_no_markup(fig, name)
        names.append(name)
    assert len(names) >= 15


def test_a_hostile_share_label_is_text_in_the_share_pages_figures_over_raw_http(site):
    import httpx

    key, _ = new_key(site)
    p = call(site.url, "compare", ["the cat sleeps", "translation", ["base", site.pid], {}, 4, 1, 0], key)
    assert p[1] == "error"  # another owner's plug-in reads as nonexistent
    p = call(site.url, "compare", ["the cat sleeps", "translation", ["base", site.pid], {}, 4, 1, 0], site.ka)[2]
    label = HOSTILE[:110]  # within name_chars: the phishing link and 60 px text
    status, event, share = call(site.url, "share", [p["id"], -1, {site.pid: label, "base": "<b>base</b>"}],
                                site.ka)
    assert event == "complete", share
    config = httpx.get(site.url + "share/config", timeout=30).json()
    load = next(d["id"] for d in config["dependencies"] if any(t[1] == "load" for t in d["targets"]))
    session, outputs = uuid.uuid4().hex, None
    with httpx.Client(base_url=site.url, timeout=60) as h:
        h.post("share/gradio_api/queue/join", params={"c": share["id"]},
               json={"data": [], "fn_index": load, "session_hash": session, "event_data": None, "trigger_id": None})
        with h.stream("GET", "share/gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if '"process_completed"' in line:
                    outputs = json.loads(line[5:])["output"]["data"]
                    break
    from plotly.io import from_json

    figures = [o for o in outputs if isinstance(o, dict) and o.get("type") == "plotly"]
    assert figures
    for fig in figures:
        assert_no_markup(from_json(fig["plot"]), "share page")
    assert any("&lt;a href" in fig["plot"] for fig in figures)  # the label is there, drawn as its characters


# --- 3. quotas count the work in flight; a refused tour leaves nothing ---------------------------------------------
def test_trainings_and_rankings_in_flight_count_against_the_plugin_quota(site, limits, paused):
    limits(plugins_per_owner=3, jobs_per_owner=8)  # owner A has one kNN plug-in already
    assert call(site.url, "train", [site.mid, "lora", {"max_epochs": 1}], site.ka)[1] == "complete"  # 2
    status, event, out = call(site.url, "rank", [site.mid, ["knn", "pema"]], site.ka)  # kNN reused: +1 = 3
    assert event == "complete", out
    status, event, out = call(site.url, "train", [site.mid, "lora", {"max_epochs": 1}], site.ka)
    assert event == "error" and "limit per user is 3" in json.dumps(out), out
    status, event, out = call(site.url, "rank", [site.mid, ["lora"]], site.ka)
    assert event == "error" and "limit per user is 3" in json.dumps(out), out
    assert site.studio.context.plugins_in_flight(site.owner_a) == 2


def test_a_refused_tour_queues_nothing_and_tours_are_bounded(site, limits, paused):
    limits(jobs_per_owner=1, tours_per_owner=1, tours_total=2)
    key, owner = new_key(site)
    before = site.studio.jobs.count(("queued", "running"))
    assert call(site.url, "build", [JSONL, "b.jsonl"], key)[1] == "complete"  # the owner's one job slot
    status, event, out = call(site.url, "rank", ["", None, "", "test.tsv", True], key)
    assert event == "error" and "jobs queued or running" in json.dumps(out), out
    assert site.studio.jobs.count(("queued", "running")) == before + 1  # the tour's build was never queued
    limits(jobs_per_owner=4, tours_per_owner=1, tours_total=2)
    assert call(site.url, "rank", ["", None, "", "test.tsv", True], key)[1] == "complete"
    status, event, out = call(site.url, "rank", ["", None, "", "test.tsv", True], key)
    assert event == "error" and "tour is already under way" in json.dumps(out), out
    other, _ = new_key(site)
    assert call(site.url, "rank", ["", None, "", "test.tsv", True], other)[1] == "complete"
    status, event, out = call(site.url, "rank", ["", None, "", "test.tsv", True], new_key(site)[0])
    assert event == "error" and "first-run tours are under way" in json.dumps(out), out
    kinds = [j["kind"] for j in site.studio.jobs.list(states=("queued",), limit=1000)]
    assert kinds.count("rank") == 2 and kinds.count("build_memory") == 3  # two tours (build + rank), one build


# --- 4. strict numbers at every door --------------------------------------------------------------------------------
@pytest.mark.parametrize("max_seconds", ["NaN", "Infinity", "-Infinity", "1e999", "1e9", "1e300"])
def test_calibrate_refuses_budgets_that_are_not_finite_or_absurd(site, max_seconds):
    jobs = site.studio.jobs.count(("queued", "running", "done", "failed", "cancelled"))
    r = post(site.url, "calibrate", f'{{"data": ["{site.pid}", 0, {max_seconds}]}}', site.ka)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert "max_seconds" in detail or "NaN and Infinity" in detail, detail
    r = post(site.url, "calibrate", f'{{"data": ["{site.pid}", {max_seconds}, 0]}}', site.ka)
    assert r.status_code == 400 and ("max_samples" in r.text or "NaN and Infinity" in r.text), r.text
    assert site.studio.jobs.count(("queued", "running", "done", "failed", "cancelled")) == jobs  # nothing queued


def test_numbers_are_checked_by_the_service_too(site):
    from ground.errors import UserError

    for bad in (float("nan"), float("inf"), 1e9, -1, True, "lots"):
        with pytest.raises(UserError, match="max_seconds"):
            site.studio.plugin_service.submit_calibrate(site.pid, owner=site.owner_a, max_seconds=bad)
    with pytest.raises(UserError, match="max_samples"):
        site.studio.plugin_service.submit_calibrate(site.pid, owner=site.owner_a, max_samples=1e300)


@pytest.mark.parametrize("methods", [[{"a": 1}], [["knn"]], [1.5], "knn", {"knn": 1}])
def test_list_arguments_of_the_wrong_type_are_a_clean_400(site, methods):
    for api, data in (("rank", [site.mid, methods]), ("compare", ["the cat", "translation", methods]),
                      ("evaluate", [methods, site.mid])):
        r = post(site.url, api, data, site.ka)
        assert r.status_code == 400 and "'methods'" in r.json()["detail"], (api, r.text)
    r = post(site.url, "evaluate", [None, site.mid, "", "t.tsv", "translation", 5, site.pid, [0.5, "x"]], site.ka)
    assert r.status_code == 400 and "'lambdas'" in r.json()["detail"], r.text
    r = post(site.url, "compare", ["the cat", "translation", ["base"], {}, 4.5], site.ka)
    assert r.status_code == 400 and "'max_new_tokens'" in r.json()["detail"], r.text


def test_no_nan_is_stored_or_sent_for_a_job(site):
    import httpx

    jid = site.studio.jobs.submit("calibrate_plugin", {"plugin_id": site.pid, "x": float("nan")},
                                  owner=site.owner_a)
    site.studio.jobs.cancel(jid, site.owner_a)
    site.studio.jobs._update(jid, result='{"score": NaN, "eta": Infinity}')  # as an older studio stored it
    row = next(site.studio.catalog.db["jobs"].rows_where("id = ?", [jid]))
    assert "NaN" not in row["args"]
    for api, data in (("job", [jid]), ("jobs", [50])):
        status, event, out = call(site.url, api, data, site.ka)
        assert event == "complete", out
    text = httpx.get(site.url, timeout=30).text  # the page itself still answers
    assert text


# --- 5. shares an owner can delete; the cap counts live shares -------------------------------------------------------
def test_an_owner_deletes_a_share_and_may_share_again(site, limits):
    limits(shares_per_owner=1)
    key, owner = new_key(site)
    p = call(site.url, "compare", ["the cat sleeps", "translation", ["base"], {}, 4, 1, 0], key)[2]
    first = call(site.url, "share", [p["id"]], key)[2]["id"]
    status, event, out = call(site.url, "share", [p["id"]], key)
    assert event == "error" and "limit per user is 1" in json.dumps(out), out
    listed = call(site.url, "shares", [], key)[2]
    assert [s["id"] for s in listed] == [first] and listed[0]["link"] == f"/share/?c={first}"
    assert call(site.url, "delete_share", [first], site.ka)[1] == "error"  # another owner's: nonexistent
    assert call(site.url, "shared", [first], None)[1] == "complete"
    assert call(site.url, "delete_share", [f"/share/?c={first}"], key)[1] == "complete"
    assert call(site.url, "shared", [first], None)[1] == "error"  # the link stops working at once
    assert call(site.url, "shares", [], key)[2] == []
    assert call(site.url, "share", [p["id"]], key)[1] == "complete"  # room again


# --- 6. a client of an earlier release still gets answers ------------------------------------------------------------
def test_an_earlier_releases_arguments_get_the_new_ones_defaults(site):
    fn = next(f for f in site.blocks.fns.values() if f.api_name == "compare")
    assert len(fn.inputs) >= 8  # global_defaults (8th) and any later argument take their defaults
    status, event, out = call(site.url, "compare", ["the cat sleeps", "translation", ["base"], {}, 4, 1, 0],
                              site.ka)  # the seven inputs documented before global_defaults
    assert event == "complete" and out["rows"][0]["text"] is not None, out
    status, event, out = call(site.url, "compare", ["the cat sleeps"], site.ka)  # every other argument defaulted
    assert event == "complete", out
    status, event, out = call(site.url, "compare", ["the cat sleeps", None, None, None, None], site.ka)
    assert event == "complete", out  # null means the default
    r = post(site.url, "compare", [], site.ka)
    assert r.status_code == 400 and "'source' is missing" in r.json()["detail"], r.text


@pytest.mark.browser
def test_a_hostile_share_label_is_drawn_as_text_in_chromium(site):
    from _server import browser_page, chromium_browser

    p = call(site.url, "compare", ["the cat sleeps", "translation", ["base", site.pid], {}, 4, 1, 0], site.ka)[2]
    label = HOSTILE[:110]
    sid = call(site.url, "share", [p["id"], -1, {site.pid: label}], site.ka)[2]["id"]
    with chromium_browser() as browser:
        for page in browser_page(browser):
            page.goto(f"{site.url}share/?c={sid}", wait_until="domcontentloaded")
            page.wait_for_function("[...document.querySelectorAll('.js-plotly-plot .legendtext, .js-plotly-plot "
                                   ".gtitle')].some(t => t.textContent.includes('Session expired'))")
            found = page.evaluate("""() => {
                const plots = [...document.querySelectorAll('.js-plotly-plot')];
                const texts = plots.flatMap(p => [...p.querySelectorAll('.legendtext, .gtitle')]);
                return {links: plots.flatMap(p => [...p.querySelectorAll('a[href*="evil"], a[*|href*="evil"]')])
                                    .length,
                        big: plots.flatMap(p => [...p.querySelectorAll('[style*="60px"]')]).length,
                        bold: plots.flatMap(p => [...p.querySelectorAll('.legendtext tspan[style*="bold"]')])
                                   .length,
                        literal: texts.some(t => t.textContent.includes('<a href="https://evil.example/">'))};
            }""")
            assert found == {"links": 0, "big": 0, "bold": 0, "literal": True}, found


def test_the_comparison_store_is_bounded_in_bytes_too(monkeypatch):
    from studio import compare_service
    from studio.compare_service import ComparisonStore

    monkeypatch.setattr(compare_service, "RECENT_BYTES", 10_000)
    store = ComparisonStore()
    for i in range(50):  # 50 strangers, one ~1 kB comparison each: far under the count bound, over the bytes
        store.keep_recent(f"owner-{i}", {"id": f"c-{i}", "trace": "x" * 1000})
    kept = store.recent_owners()
    assert 5 <= len(kept) <= 10 and "c-49" in kept and "c-0" not in kept


def test_a_page_polling_between_sweeps_keeps_its_messages(monkeypatch):
    """A page whose events (a job's poll) run between two sweeps is never caught busy by one; its message queue must
    stay while it polls (dropping it cut the open stream and froze the page's job card), and go once it stops."""
    import asyncio

    from ui import server

    pending, dropped, clock = {"page", "unread"}, [], [0.0]
    monkeypatch.setattr(server.gri, "queued_events", lambda blocks: [])
    monkeypatch.setattr(server.gri, "sessions_with_messages", lambda blocks: sorted(pending))
    monkeypatch.setattr(server.gri, "drop_session_messages",
                        lambda blocks, session: (dropped.append(session), pending.discard(session)))
    sweeper = server.ResultSweeper([object()], keep_s=120, clock=lambda: clock[0])

    async def poll():
        return {"data": []}

    for t in range(0, 400, 5):  # a poll every 5 s, a sweep every 30 s: never at the same moment
        clock[0] = float(t)
        if t % 30 == 0:
            sweeper.sweep()
        else:
            asyncio.run(sweeper.noting(poll, server.EventCall(None, None, "page", None)))
    assert dropped == ["unread"]  # the unread result went after keep_s; the polling page kept its queue
    clock[0] += sweeper.keep_s
    sweeper.sweep()
    assert dropped == ["unread", "page"]  # and a page that stopped polling goes too
