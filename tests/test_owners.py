"""Safe to host in public: owners, shares, bounds — on the tiny backbone.

* A multi-user studio served over HTTP with two API clients holding different keys (``X-Pema-Key``): owner B can
  neither list, read, delete, cancel, train on, compare with, evaluate nor share owner A's things, and each refusal
  reads exactly like a nonexistent id; the page's own events called over raw HTTP (``/gradio_api/queue/join`` with
  their ``fn_index``) go through the same checks, with the identity of each request's own cookie.
* A share shows the comparison only: no sample, reference, file name, memory or plug-in name or id; the share page
  is a Gradio app of its own with no studio component.
* Every bound of ``studio.limits.Limits`` refuses with a message that names it and how to change it.
* Keys, the cookie, the modes, and the migration of a catalog made before owners existed.
"""
import dataclasses
import json
import os
import re
import socket
import sqlite3
import time
import uuid
from types import SimpleNamespace

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 2
JSONL = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in PAIRS)
TSV = "\n".join(f"{s}\t{t}" for s, t in PAIRS[:2])
SECRET_FILE = "acme_confidential_contracts_2024.jsonl"  # no memory name given: the name defaults to its stem
SECRET_STEM = "acme_confidential_contracts_2024"
SOURCE = "a quiet river"  # the compared sentence (not one of the samples)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_job(client, job_id: str, timeout: float = 60) -> dict:
    t0 = time.time()
    while True:
        job = client.predict(job_id, api_name="/job")
        if job["state"] not in ("queued", "running"):
            return job
        assert time.time() - t0 < timeout, job
        time.sleep(0.1)


def fn_index(blocks, module: str, name: str) -> int:
    """The fn_index of a page event by its handler (what a raw HTTP caller would find in /config)."""
    hits = [i for i, f in blocks.fns.items()
            if getattr(f.fn, "__module__", "") == module and getattr(f.fn, "__name__", "") == name]
    assert len(hits) == 1, (module, name, hits)
    return hits[0]


def raw_call(url: str, index: int, data: list, session: str, cookies: dict | None = None,
             headers: dict | None = None) -> dict:
    """One event over raw HTTP: ``POST /gradio_api/queue/join`` then its server-sent events; returns the
    ``process_completed`` message (``success`` and ``output``)."""
    import httpx

    with httpx.Client(base_url=url, cookies=cookies, headers=headers, timeout=60) as h:
        r = h.post("gradio_api/queue/join", json={"data": data, "fn_index": index, "session_hash": session,
                                                  "event_data": None, "trigger_id": None})
        assert r.status_code == 200, r.text
        with h.stream("GET", "gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    msg = json.loads(line[5:])
                    if msg.get("msg") == "process_completed":
                        return msg
    raise AssertionError("the event never completed")


def error_of(fn, *args) -> str:
    with pytest.raises(Exception) as e:
        fn(*args)
    return str(e.value)


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    """A multi-user studio over HTTP; owner A has a memory (from a "confidential" file), a kNN plug-in, a
    comparison and a share; B has a key and nothing else."""
    from gradio_client import Client

    import app

    studio, served, url = app.start(["--backbone", "tiny", "--multi-user", "--port", str(free_port()), "--quiet",
                                     "--data-dir", str(tmp_path_factory.mktemp("hosted"))], block=False)
    clients = []
    try:
        assert studio.backbone_service.wait_ready(120), studio.backbone_service.status()
        ka, kb = studio.identity.new_browser_key(), studio.identity.new_browser_key()
        a = Client(url, headers={"X-Pema-Key": ka}, verbose=False)
        b = Client(url, headers={"X-Pema-Key": kb}, verbose=False)
        clients += [a, b]
        build = wait_job(a, a.predict(JSONL, SECRET_FILE, api_name="/build")["job_id"])
        assert build["state"] == "done", build
        mid = build["result"]["memory_id"]
        train = wait_job(a, a.predict(mid, "knn", {}, "", api_name="/train")["job_id"])
        assert train["state"] == "done", train
        pid = train["result"]["plugin_id"]
        cmp = a.predict(SOURCE, "translation", ["base", pid], {}, 8, 1, api_name="/compare")
        share = a.predict(cmp["id"], -1, api_name="/share")
        yield SimpleNamespace(studio=studio, served=served, url=url, a=a, b=b, ka=ka, kb=kb, mid=mid, pid=pid,
                              job=build["id"], cmp=cmp, share=share,
                              owner_a=studio.identity.owner_of_key(ka), owner_b=studio.identity.owner_of_key(kb))
    finally:
        for client in clients:
            client.close()  # ends its heartbeat stream, so the server stops at once
        served.close()
        studio.close()


# --- owners ----------------------------------------------------------------------------------------------------
def test_the_plugin_name_would_have_leaked_the_file_name(hosted):
    """The premise of the share tests: names default to the uploaded file's stem."""
    names = {p["id"]: p["name"] for p in hosted.a.predict(api_name="/plugins")}
    assert SECRET_STEM in names[hosted.pid]
    assert [m["name"] for m in hosted.a.predict(api_name="/memories")] == [SECRET_STEM]


def test_another_owner_can_neither_see_nor_touch_anything(hosted):
    h, b = hosted, hosted.b
    assert b.predict(api_name="/memories") == [] and b.predict(api_name="/plugins") == []
    assert b.predict(30, api_name="/jobs") == []
    calls = [  # (endpoint, arguments with {x} for A's id, a fake id of the same kind)
        ("/memory", lambda x: (x,), h.mid, "mem-00000000-000000-000000"),
        ("/delete_memory", lambda x: (x,), h.mid, "mem-00000000-000000-000000"),
        ("/job", lambda x: (x,), h.job, "build_memory-00000000-000000-000000"),
        ("/cancel", lambda x: (x,), h.job, "build_memory-00000000-000000-000000"),
        ("/train", lambda x: (x, "knn", {}, ""), h.mid, "mem-00000000-000000-000000"),
        ("/compare", lambda x: (SOURCE, "translation", ["base", x], {}, 8, 1), h.pid, "knn-00000000-000000-000000"),
        ("/share", lambda x: (x, -1), h.cmp["id"], "not-a-comparison"),
        ("/evaluate", lambda x: (None, x, "", "t.tsv", "translation", 2), h.mid, "mem-00000000-000000-000000"),
        ("/evaluate", lambda x: (["base", x], "", TSV, "t.tsv", "translation", 2), h.pid,
         "knn-00000000-000000-000000"),
        ("/evaluate", lambda x: (None, "", TSV, "t.tsv", "translation", 2, x, [0.0, 1.0]), h.pid,
         "knn-00000000-000000-000000"),
    ]
    for api, args, theirs, fake in calls:
        got = error_of(lambda: b.predict(*args(theirs), api_name=api))
        none = error_of(lambda: b.predict(*args(fake), api_name=api))
        assert got == none.replace(fake, theirs), (api, got, none)  # indistinguishable from nonexistent
        assert "No " in got or "no longer in memory" in got, (api, got)
    # A still has everything, and nothing of B's calls happened
    assert [m["id"] for m in h.a.predict(api_name="/memories")] == [h.mid]
    assert h.pid in {p["id"] for p in h.a.predict(api_name="/plugins")}
    assert h.a.predict(h.job, api_name="/job")["state"] == "done"
    assert all(j["args"].get("memory_id") != h.mid or j["owner"] == h.owner_a for j in h.studio.jobs.list(limit=100))
    assert h.studio.catalog.count("comparisons", h.owner_b) == 0


def test_the_service_itself_refuses_other_owners(hosted):
    """The same checks without any web layer (what the CLIs and tests call)."""
    from ground.errors import UserError

    st, b = hosted.studio, hosted.owner_b
    for call in (lambda: st.memory_service.memory_detail(hosted.mid, owner=b),
                 lambda: st.memory_service.heldout_samples(hosted.mid, owner=b),
                 lambda: st.plugin_service.plugin_detail(hosted.pid, owner=b),
                 lambda: st.plugin_service.delete_plugin(hosted.pid, owner=b),
                 lambda: st.compare_service.neighbours(hosted.cmp["id"], hosted.cmp["rows"][1]["label"], 0, owner=b),
                 lambda: st.compare_service.recent(hosted.cmp["id"], owner=b),
                 lambda: st.job_service.job(hosted.job, owner=b)):
        with pytest.raises(UserError, match="No |no longer"):
            call()
    with pytest.raises(UserError, match="does not say whose"):  # multi-user: no owner is no access
        st.memory_service.memories()
    assert st.memory_service.memories(owner=hosted.owner_a)[0]["id"] == hosted.mid


def test_keys_that_are_missing_or_forged_are_refused(hosted):
    from gradio_client import Client

    forged = hosted.ka[:-4] + ("AAAA" if not hosted.ka.endswith("AAAA") else "BBBB")
    with pytest.raises(Exception, match="not valid for this studio"):
        Client(hosted.url, headers={"X-Pema-Key": forged}, verbose=False).predict(api_name="/memories")
    memories = fn_index(hosted.served.blocks[0], "ui.api", "memories")
    msg = raw_call(hosted.url, memories, [], uuid.uuid4().hex)  # raw HTTP: no key, no cookie
    assert not msg["success"] and "does not say whose" in json.dumps(msg)
    # public reads need no key
    assert Client(hosted.url, verbose=False).predict(hosted.share["id"], api_name="/shared")["rows"]


def test_page_events_over_raw_http_check_each_requests_own_identity(hosted):
    blocks, url = hosted.served.blocks[0], hosted.url
    on_load = fn_index(blocks, "ui.app", "on_load")
    show = fn_index(blocks, "ui.memories", "show")
    delete = fn_index(blocks, "ui.memories", "do_delete")
    cookie_a, cookie_b = {"pema_owner": hosted.ka}, {"pema_owner": hosted.kb}
    # A's own session: the page loads A's things and shows A's key (to copy for the API); A may open the memory
    sa = uuid.uuid4().hex
    loaded = raw_call(url, on_load, [], sa, cookies=cookie_a)
    assert loaded["success"] and hosted.ka in json.dumps(loaded["output"]["data"])
    assert SECRET_STEM in json.dumps(loaded["output"]["data"])
    mine = raw_call(url, show, [hosted.mid], sa, cookies=cookie_a)
    assert mine["success"] and "das Haus ist klein" in json.dumps(mine["output"]["data"])
    # B's own session knows nothing of A's
    sb = uuid.uuid4().hex
    loaded_b = raw_call(url, on_load, [], sb, cookies=cookie_b)
    assert loaded_b["success"] and SECRET_STEM not in json.dumps(loaded_b["output"]["data"])
    assert hosted.kb in json.dumps(loaded_b["output"]["data"]) and hosted.ka not in json.dumps(loaded_b)
    refused = raw_call(url, show, [hosted.mid], sb, cookies=cookie_b)
    assert "das Haus" not in json.dumps(refused)
    # Even in A's session (whose dropdown lists A's memory), a request carrying B's cookie acts as B
    stolen = raw_call(url, show, [hosted.mid], sa, cookies=cookie_b)
    text = json.dumps(stolen)
    assert "No memory" in text and "das Haus" not in text and "Guten Morgen" not in text
    gone = raw_call(url, delete, [hosted.mid], sa, cookies=cookie_b)
    assert not gone["success"] and "No memory" in json.dumps(gone)
    assert hosted.studio.catalog.memory(hosted.mid) is not None


# --- shares ------------------------------------------------------------------------------------------------------
def test_a_share_shows_the_comparison_and_nothing_private(hosted):
    import httpx

    p = hosted.b.predict(hosted.share["id"], api_name="/shared")  # anyone with the link
    assert p["source"] == SOURCE and [r["text"] for r in p["rows"]] == [r["text"] for r in hosted.cmp["rows"]]
    assert [r["label"] for r in p["rows"]] == ["Base model", "kNN-LM / kNN-MT"]
    text = json.dumps(p, ensure_ascii=False)
    for s, t in PAIRS:
        assert s not in text and t not in text
    for private in ("acme", SECRET_STEM, hosted.mid, hosted.pid, str(hosted.studio.root), "reference",
                    "prompt", '"sample"', '"entry"', "context_ids", "plugin_id", hosted.owner_a):
        assert private not in text, private
    # the share page is its own Gradio app: no studio component in its config, nothing of A's
    with httpx.Client(base_url=hosted.url, timeout=30) as h:
        page = h.get(f"share/?c={hosted.share['id']}")
        assert page.status_code == 200 and "set-cookie" not in page.headers
        config = h.get("share/config").text
        assert "shared-outputs" in config
        for studio_part in ("compare-source", "build-memory", "train-plugin", "pema-key", "Memories", "Plug-ins",
                            "acme"):
            assert studio_part not in config, studio_part
        old = h.get(f"?c={hosted.share['id']}")  # links made before the share page moved
        assert old.status_code == 307 and old.headers["location"] == f"share/?c={hosted.share['id']}"


def test_a_share_never_stores_the_reference_and_takes_the_owners_labels(hosted):
    st, me = hosted.studio, hosted.owner_a
    c = st.compare_service.compare(SOURCE, "translation", ["base", hosted.pid], reference="a held-out reference",
                                   owner=me)
    p = st.compare_service.shared(st.compare_service.share(c["id"], owner=me, labels={hosted.pid: "my own label"}))
    assert [r["label"] for r in p["rows"]] == ["Base model", "my own label"] and set(p["attention"]) == \
        {"Base model", "my own label"}
    assert "held-out reference" not in json.dumps(p)


def test_shares_made_before_neutral_labels_are_shown_neutral(tmp_path):
    from studio.service import Studio

    st = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
    try:
        old = {"version": 1, "source": "x", "task": "translation", "reference": "secret ref", "backbone": "tiny",
               "prompt_template": "English: {src}", "base_label": "Base model",
               "rows": [{"label": "Base model", "method": "base", "text": "y"},
                        {"label": f"kNN-LM / kNN-MT on {SECRET_STEM}", "method": "knn", "text": "z"}],
               "attention": {f"kNN-LM / kNN-MT on {SECRET_STEM}": {"matrix": []}}}
        p = st.compare_service.shared(st.catalog.save_comparison(old, backbone="tiny"))
        assert [r["label"] for r in p["rows"]] == ["Base model", "kNN-LM / kNN-MT"]
        assert SECRET_STEM not in json.dumps(p) and "secret ref" not in json.dumps(p)
    finally:
        st.close()


# --- bounds ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """A multi-user studio with small limits; its job worker does not run, so submitted jobs stay queued."""
    from studio.limits import Limits
    from studio.service import Studio

    limits = Limits(input_chars=40, max_new_tokens=64, beams=2, methods_per_comparison=2, upload_bytes=2000,
                    samples=6, memories_per_owner=1, plugins_per_owner=1, shares_per_owner=1, jobs_per_owner=2,
                    jobs_total=4, share_bytes=400, eval_pairs=3, sweep_points=2, name_chars=10)
    st = Studio(tmp_path_factory.mktemp("bounded"), backbone="tiny", multi_user=True, limits=limits,
                start_jobs=False)
    assert st.backbone_service.wait_ready(60)
    yield st
    st.close()


def fake_memory(st, owner: str) -> str:
    mid = f"mem-{uuid.uuid4().hex[:8]}"
    st.catalog.owned_by(owner).add_memory({"id": mid, "name": "m", "path": "/nonexistent", "backbone": "tiny",
                                           "fingerprint": "", "task": "translation", "mode": "teacher", "samples": 10,
                                           "entries": 10, "bytes": 1, "created": time.time(), "meta": "{}"})
    return mid


def test_each_bound_gives_a_clear_error(bounded):
    from ground.errors import UserError

    st = bounded
    small = "\n".join(f"{s}\t{t}" for s, t in PAIRS[:5])

    def refused(name: str, call):
        with pytest.raises(UserError) as e:
            call()
        msg = str(e.value)
        assert "limit" in msg and f"--limit {name}=" in msg and f"PEMA_LIMIT_{name.upper()}" in msg, msg
        return msg

    assert "is 41; the limit is 40" in refused("input_chars", lambda: st.compare_service.compare("x" * 41, owner="u1"))
    refused("max_new_tokens", lambda: st.compare_service.compare("hi", max_new_tokens=65, owner="u1"))
    refused("beams", lambda: st.compare_service.compare("hi", max_new_tokens=8, num_beams=3, owner="u1"))
    refused("methods_per_comparison",
            lambda: st.compare_service.compare("hi", methods=["base"] * 3, max_new_tokens=8, owner="u1"))
    refused("upload_bytes", lambda: st.memory_service.preview("a\tb\n" * 600, "big.tsv", owner="u1"))
    refused("upload_bytes", lambda: st.memory_service.submit_build("a\tb\n" * 600, "big.tsv", owner="u1"))
    refused("samples", lambda: st.memory_service.submit_build("\n".join(f"s{i}\tt{i}" for i in range(7)), "p.tsv",
                                                              owner="u1"))
    refused("name_chars", lambda: st.memory_service.submit_build(small, "p.tsv", name="a much too long name",
                                                                 owner="u1"))
    # queued (the worker does not run): counts against the quota
    st.memory_service.submit_build(small, "p.tsv", owner="u2")
    refused("memories_per_owner", lambda: st.memory_service.submit_build(small, "p.tsv", owner="u2"))
    mid = fake_memory(st, "u3")
    with pytest.raises(UserError, match="kappa.*between 0.0 and 1.0"):  # declared training ranges
        st.plugin_service.submit_train(mid, "pema", {"kappa": 3}, owner="u3")
    st.plugin_service.submit_train(mid, "knn", {}, owner="u3")
    refused("plugins_per_owner", lambda: st.plugin_service.submit_train(mid, "knn", {}, owner="u3"))
    evaluate = st.evaluate_service.submit_evaluate
    refused("eval_pairs", lambda: evaluate(methods=["base"], test_data=small, test_filename="t.tsv", limit=0,
                                           max_new_tokens=8, owner="u4"))
    evaluate(methods=["base"], test_data=small, test_filename="t.tsv", limit=3, max_new_tokens=8, owner="u4")
    refused("methods_per_comparison", lambda: evaluate(methods=["base"] * 3, test_data=small, test_filename="t.tsv",
                                                       limit=2, max_new_tokens=8, owner="u4"))
    refused("max_new_tokens", lambda: evaluate(methods=["base"], test_data=small, test_filename="t.tsv", limit=2,
                                               max_new_tokens=99, owner="u4"))
    # jobs (none runs here): u2, u3 and u4 have one queued each; u4's second fills the queue, a third is over the
    # per-owner bound, and nobody else may queue
    evaluate(methods=["base"], test_data=small, test_filename="t.tsv", limit=2, owner="u4")
    refused("jobs_per_owner", lambda: evaluate(methods=["base"], test_data=small, test_filename="t.tsv", limit=2,
                                               owner="u4"))
    assert "queue is full" in refused("jobs_total", lambda: evaluate(methods=["base"], test_data=small,
                                                                     test_filename="t.tsv", limit=2, owner="u5"))


def test_share_bounds(bounded):
    from ground.errors import UserError

    st = bounded
    c = st.compare_service.compare("hi", max_new_tokens=2, owner="s1")
    with pytest.raises(UserError, match="size in bytes is .*; the limit is 400 .*--limit share_bytes="):
        st.compare_service.share(c["id"], owner="s1")
    st.limits, old = dataclasses.replace(st.limits, share_bytes=0), st.limits
    try:
        st.compare_service.share(c["id"], owner="s1")
        with pytest.raises(UserError, match="You have 1 shared comparisons .*limit per user is 1"):
            st.compare_service.share(c["id"], owner="s1")
    finally:
        st.limits = old


def test_rate_limits_throttle_one_owner_and_not_another(tmp_path):
    from ground.errors import UserError
    from studio.limits import Limits
    from studio.service import Studio

    st = Studio(tmp_path, backbone="tiny", multi_user=True, start_jobs=False,
                limits=Limits(compares_per_minute=3, evaluations_per_minute=1))
    assert st.backbone_service.wait_ready(60)
    small = "\n".join(f"{s}\t{t}" for s, t in PAIRS[:5])
    try:
        for _ in range(3):
            assert st.compare_service.compare("hi", max_new_tokens=2, owner="rate-a")["rows"]
        with pytest.raises(UserError) as e:
            st.compare_service.compare("hi", max_new_tokens=2, owner="rate-a")
        msg = str(e.value)
        assert re.match(r"Too many comparisons: at most 3 per minute per user; try again in \d+ s", msg), msg
        assert "--limit compares_per_minute=" in msg and "PEMA_LIMIT_COMPARES_PER_MINUTE" in msg
        wait = int(re.search(r"in (\d+) s", msg).group(1))
        assert 1 <= wait <= 60
        # another owner is not throttled
        assert st.compare_service.compare("hi", max_new_tokens=2, owner="rate-b")["rows"]
        ev = dict(methods=["base"], test_data=small, test_filename="t.tsv", limit=2, max_new_tokens=4)
        st.evaluate_service.submit_evaluate(**ev, owner="rate-a")
        with pytest.raises(UserError, match=r"Too many evaluations: at most 1 per minute per user"):
            st.evaluate_service.submit_evaluate(**ev, owner="rate-a")
        st.evaluate_service.submit_evaluate(**ev, owner="rate-b")
    finally:
        st.close()


def test_a_rate_window_slides():
    from studio.limits import RateWindows

    now = [1000.0]
    w = RateWindows(window=60, clock=lambda: now[0])
    assert w.take("c", "a", 2) == 0.0
    now[0] += 10
    assert w.take("c", "a", 2) == 0.0
    now[0] += 20
    assert w.take("c", "a", 2) == pytest.approx(30.0)  # the oldest call leaves the window in 30 s
    assert w.take("c", "b", 2) == 0.0 and w.take("e", "a", 2) == 0.0  # per owner and per limit
    now[0] += 30.001
    assert w.take("c", "a", 2) == 0.0  # the first call has left the window; the refused one was not counted
    assert w.take("c", "a", 2) == pytest.approx(9.999, abs=1e-3)


def test_limits_come_from_env_and_flags_and_quotas_are_off_for_one_user():
    from ground.errors import UserError
    from studio.limits import Limits

    lim = Limits.configure(True, {"PEMA_LIMIT_INPUT_CHARS": "100"}, ["beams=1", "jobs_total=0"])
    assert (lim.input_chars, lim.beams, lim.jobs_total, lim.memories_per_owner) == (100, 1, 0, 20)
    local = Limits.configure(False, {})
    assert local.memories_per_owner == local.jobs_per_owner == 0 and local.input_chars == 2000
    assert local.compares_per_minute == local.evaluations_per_minute == 0  # rate limits: off for one user too
    hosted = Limits.configure(True, {"PEMA_LIMIT_COMPARES_PER_MINUTE": "5"})
    assert (hosted.compares_per_minute, hosted.evaluations_per_minute) == (5, 10)
    with pytest.raises(UserError, match="Unknown limit 'nope'"):
        Limits.configure(True, {}, ["nope=1"])
    with pytest.raises(UserError, match="whole number"):
        Limits.configure(True, {"PEMA_LIMIT_BEAMS": "many"})


# --- identity, modes, migration ----------------------------------------------------------------------------------
def test_keys_identify_their_holder_and_nothing_else(tmp_path):
    from ground.errors import UserError
    from studio.identity import LOCAL, Identity

    idn = Identity(tmp_path, multi_user=True)
    k = idn.new_browser_key()
    owner = idn.owner_of_key(k)
    assert owner.startswith("anon:") and k.split(".")[2] not in owner  # the catalog never holds the key
    assert idn.resolve({"X-Pema-Key": k}).owner == owner
    assert idn.resolve({"Authorization": f"Bearer {k}"}).owner == owner
    assert idn.resolve({"authorization": "Bearer hf_sometoken"}, {"pema_owner": k}).how == "browser"
    assert idn.resolve({}, {"pema_owner": k}).owner == owner
    assert idn.resolve({}, {}).owner is None
    assert idn.resolve({}, {}, hf_user="alice").owner == "hf:alice"
    assert idn.owner_of_key(idn.resolve({}, {}, hf_user="alice").key) == "hf:alice"
    assert idn.resolve({"x-pema-key": k}, {}, hf_user="alice").owner == owner  # an explicit key wins
    with pytest.raises(UserError, match="not valid"):
        idn.resolve({"x-pema-key": k[:-1] + ("x" if k[-1] != "x" else "y")})
    assert idn.owner_of_key(Identity(tmp_path / "other", True).new_browser_key()) is None  # another studio's
    assert idn.owner_of_key("pk1.hf.alice.forged") is None
    assert Identity(tmp_path, multi_user=False).resolve({"x-pema-key": "anything"}).owner == LOCAL
    assert oct((tmp_path / "owner-secret").stat().st_mode & 0o777) == "0o600"


def test_the_cookie_and_the_modes(hosted):
    import httpx

    from ui.app import mode_banner, multi_user_default

    with httpx.Client(base_url=hosted.url, timeout=30) as h:
        first = h.get("/")
        cookie = first.headers["set-cookie"]
        assert cookie.startswith("pema_owner=pk1.a.") and "HttpOnly" in cookie and "SameSite=Lax" in cookie
        key = cookie.split(";")[0].split("=", 1)[1]
        assert hosted.studio.identity.owner_of_key(key).startswith("anon:")
        assert "set-cookie" not in h.get("/", headers={"cookie": f"pema_owner={key}"}).headers  # kept
        secure = httpx.get(hosted.url, headers={"x-forwarded-proto": "https"}).headers["set-cookie"]
        assert "Secure" in secure and "SameSite=None" in secure and "Partitioned" in secure
    assert "data_dir" not in hosted.b.predict(api_name="/status")
    assert multi_user_default("0.0.0.0") and not multi_user_default("127.0.0.1")
    assert "multi-user mode" in mode_banner(hosted.studio, "0.0.0.0")


def test_single_user_mode_is_the_local_owner_and_sees_everything_it_made(tmp_path):
    from studio.service import Studio
    from ui.app import mode_banner

    st = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
    try:
        assert not st.multi_user and "single-user mode" in mode_banner(st, "127.0.0.1")
        jid = st.memory_service.submit_build(JSONL, "p.jsonl")
        assert st.job_service.job(jid)["owner"] == "local" and st.job_service.list_jobs()[0]["id"] == jid
        assert st.job_service.job(jid, owner="local")["id"] == jid
    finally:
        st.close()


def test_a_catalog_made_before_owners_is_migrated_to_the_local_user(tmp_path):
    from ground.store import Catalog
    from studio.service import Studio

    db = sqlite3.connect(tmp_path / "studio.db")
    db.execute("create table memories (id text primary key, name text, path text, backbone text, fingerprint text,"
               " task text, mode text, samples integer, entries integer, bytes integer, created float, meta text)")
    db.execute("insert into memories values ('mem-old', 'old memory', '/x', 'tiny', '', 'translation', 'teacher', "
               "10, 20, 30, 1.0, '{}')")
    db.execute("create table jobs (id text primary key, kind text, args text, state text, progress float, "
               "message text, log text, error text, result text, metrics text, created float, started float, "
               "finished float, cancel integer)")
    db.execute("insert into jobs values ('job-old', 'build_memory', '{}', 'done', 1.0, '', '', '', '{}', '[]', "
               "1.0, 1.0, 1.0, 0)")
    db.commit()
    db.close()
    cat = Catalog(tmp_path)
    assert cat.memory("mem-old")["owner"] == "local" and cat.memory("mem-old", "anon:x") is None
    st = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
    try:
        assert [m["id"] for m in st.memory_service.memories()] == ["mem-old"]
        assert st.job_service.job("job-old")["owner"] == "local"
        assert st.memory_service.memories(owner="anon:someone") == []
    finally:
        st.close()


def test_a_signed_in_hugging_face_user_is_the_owner(tmp_path):
    """On a Space with ``hf_oauth: true`` Gradio keeps the signed-in user in its signed session: that user owns."""
    from ui.common import caller, hf_user

    def request(expires_in: float, headers=None, cookies=None):
        info = {"userinfo": {"preferred_username": "alice"}, "expires_at": time.time() + expires_in}
        return SimpleNamespace(request=SimpleNamespace(scope={"session": {"oauth_info": info}}),
                               headers=headers or {}, cookies=cookies or {})

    from studio.identity import Identity

    studio = SimpleNamespace(multi_user=True, identity=Identity(tmp_path, multi_user=True))
    me = caller(studio, request(60))
    assert (me.owner, me.how) == ("hf:alice", "hf") and studio.identity.owner_of_key(me.key) == "hf:alice"
    assert hf_user(request(-1)) is None and caller(studio, request(-1)).owner is None  # expired: signed out
    assert hf_user(SimpleNamespace(request=SimpleNamespace(scope={}))) is None  # no OAuth on this server
