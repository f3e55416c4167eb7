"""Offsite: a real model-owner process (``python -m offsite serve --backbone tiny`` on 127.0.0.1) and a
data owner working through it get what the local code gets — the same memory, the same trained PEMA, the same
greedy decode token for token (base, PEMA, kNN rows) — and the owner refuses bad requests with a clear 4xx and keeps
serving when a client dies mid-session."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backbone.prompts import Prompt
from engine import Row, compare
from ground.errors import UserError
from memories.build import build_memory
from memories.parse import Sample
from offsite.client import OwnerError, RemoteBackbone, connect, wait_for_owner
from offsite.decode import check_offsite_method, compare_remote
from offsite.protocol import Limits, pack, unpack
from offsite.server import ApiError, OwnerService, make_app
from plugins.api import train_plugin
from plugins.base import load_plugin
from plugins.registry import available_methods

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "offsite-test-token"
PROMPT = Prompt.for_task("translation")
PEMA_FAST = {"max_epochs_rct": 2, "max_epochs_joint": 2, "batch_size": 16, "rank": 16}
SOURCES = ["the house is small", "good morning", "the cat sleeps and the house"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PEMA_REMOTE_TOKEN"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


@pytest.fixture(scope="module")
def owner(tmp_path_factory):
    """The model owner: its own process, the tiny backbone, a bearer token, a free port on 127.0.0.1."""
    port = _free_port()
    log = tmp_path_factory.mktemp("owner") / "owner.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "offsite", "serve", "--backbone", "tiny", "--port", str(port),
                                 "--token", TOKEN, "--max-sessions", "8"], cwd=ROOT, env=_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_owner(url, lambda: proc.poll() is None, timeout=180, poll=0.3)
    except RuntimeError as e:
        proc.kill()
        pytest.fail(f"{e} (exit code {proc.poll()}):\n{log.read_text()}")
    yield SimpleNamespace(url=url, proc=proc, log=log)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def remote(owner, tmp_path_factory) -> RemoteBackbone:
    return connect(owner.url, TOKEN, data_dir=tmp_path_factory.mktemp("client"))


@pytest.fixture(scope="module")
def samples(tiny_pairs):
    # one monolingual sample: its synthetic source is the owner's greedy continuation (/v1/generate)
    return [Sample(s, t, i + 1) for i, (s, t) in enumerate(tiny_pairs)] + [Sample(None, "die Katze ist klein", 99)]


@pytest.fixture(scope="module")
def built(tiny, remote, samples, tmp_path_factory):
    d = tmp_path_factory.mktemp("memories")
    return (build_memory(tiny, samples, d / "local", prompt=PROMPT),
            build_memory(remote, samples, d / "remote", prompt=PROMPT))


@pytest.fixture(scope="module")
def trained(tiny, remote, built, tmp_path_factory):
    """PEMA and kNN trained on the remotely built memory, once locally and once with only the owner's head."""
    d = tmp_path_factory.mktemp("plugins")
    mem = built[1]
    out = {}
    for side, bb in (("local", tiny), ("remote", remote)):
        out[f"pema-{side}"] = train_plugin(bb, mem, "pema", PEMA_FAST, out_dir=d / f"pema-{side}")[0]
        out[f"knn-{side}"] = train_plugin(bb, mem, "knn", {}, out_dir=d / f"knn-{side}")[0]
    return out


def _arrays(mem) -> dict:
    return {k: np.asarray(getattr(mem, k)) for k in ("keys", "values", "entry_sample", "heldout_keys",
                                                      "heldout_values", "heldout_entry_sample")}


# --- what the data owner holds -------------------------------------------------------------------------------------
def test_the_remote_backbone_holds_the_head_and_no_decoder(tiny, remote):
    assert remote.fingerprint == tiny.fingerprint and remote.stop_ids == tiny.stop_ids
    assert (remote.hidden_size, remote.vocab_size, remote.chat) == (tiny.hidden_size, tiny.vocab_size, tiny.chat)
    assert {n for n, _ in remote.model.named_parameters()} == {"norm.weight", "lm_head.weight"}
    x = torch.randn(6, tiny.hidden_size) * 3
    assert torch.equal(remote.logits_from_fc(x), tiny.logits_from_fc(x))
    text = "English: the house is small\nGerman:"
    assert remote.encode_context(text) == tiny.encode_context(text)
    with pytest.raises(UserError, match="in-network plug-ins .* cannot be trained or decoded offsite"):
        remote.layers
    head, meta = unpack(remote.client.request("GET", "/v1/head").content)
    assert set(head) == {"norm.weight", "lm_head.weight"} and meta["norm_class"] == "LlamaRMSNorm"
    assert torch.equal(head["lm_head.weight"], tiny.lm_head.weight)


def test_fc_at_requested_positions_is_the_local_f_c(tiny, remote):
    seqs = [[1, 40, 41, 42, 43], [1, 50, 51]]
    got = remote.client.fc(seqs, positions=[[4, 0], [2]])
    with torch.no_grad():
        ref = [tiny.forward_fc(torch.tensor([s]))[0][0] for s in seqs]
    assert torch.allclose(got, torch.stack([ref[0][4], ref[0][0], ref[1][2]]), atol=1e-5)


# --- the same memory, the same plug-ins, the same decode -----------------------------------------------------------
def test_a_memory_built_remotely_equals_the_local_build(built):
    local, remote = built
    a, b = _arrays(local), _arrays(remote)
    assert len(local) > 0 and len(local.heldout_values) > 0
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        if k.endswith("keys"):
            np.testing.assert_allclose(a[k].astype(np.float32), b[k].astype(np.float32), atol=1e-3, rtol=1e-3)
        else:
            assert np.array_equal(a[k], b[k]), k
    assert local.samples == remote.samples  # the synthetic source of the monolingual sample included
    assert local.fingerprint == remote.fingerprint
    assert local.meta["stats"]["key_rms"] == pytest.approx(remote.meta["stats"]["key_rms"], rel=1e-6)


def test_a_per_step_offsite_mode_build_equals_the_local_one(tiny, remote, samples, tmp_path):
    part = samples[:4]
    local = build_memory(tiny, part, tmp_path / "l", prompt=PROMPT, mode="offsite")
    far = build_memory(remote, part, tmp_path / "r", prompt=PROMPT, mode="offsite")
    a, b = _arrays(local), _arrays(far)
    np.testing.assert_allclose(a["keys"].astype(np.float32), b["keys"].astype(np.float32), atol=1e-3, rtol=1e-3)
    assert np.array_equal(a["values"], b["values"])


def test_pema_trained_with_only_the_owners_head_equals_local_training(trained):
    local, far = trained["pema-local"].state_dict(), trained["pema-remote"].state_dict()
    assert local.keys() == far.keys()
    for k in local:
        assert torch.allclose(local[k].float(), far[k].float(), atol=1e-5), k
    assert trained["pema-local"].train_info["candidates"] == trained["pema-remote"].train_info["candidates"]


@pytest.mark.parametrize("lm", ["full", "none"])
def test_a_remote_greedy_decode_equals_the_local_one_token_for_token(tiny, remote, trained, lm):
    def rows(bb):
        return [Row("base"),
                Row("pema", load_plugin(trained["pema-remote"].plugin_path, bb), {"lambda_max": 0.9}),
                Row("knn", load_plugin(trained["knn-remote"].plugin_path, bb), {"lambda": 0.5, "k": 4})]

    local_rows, remote_rows = rows(tiny), rows(remote)
    for src in SOURCES:
        a = compare(tiny, src, local_rows, PROMPT, max_new_tokens=16)
        b = compare_remote(remote, src, remote_rows, PROMPT, max_new_tokens=16, lm=lm)
        assert [r.label for r in a.rows] == [r.label for r in b.rows]
        for ra, rb in zip(a.rows, b.rows):
            assert ra.tokens == rb.tokens, (src, ra.label)
            assert ra.score == pytest.approx(rb.score, abs=1e-3)
            assert [t.get("lambda") for t in ra.trace] == [t.get("lambda") for t in rb.trace]
        assert b.rows[2].trace[0]["neighbours"] == a.rows[2].trace[0]["neighbours"]  # kNN searched here


def test_remote_beam_search_equals_the_local_one(tiny, remote, trained):
    near, far = (load_plugin(trained["pema-remote"].plugin_path, bb) for bb in (tiny, remote))
    a = compare(tiny, SOURCES[0], [Row("base"), Row("pema", near)], PROMPT, max_new_tokens=10, num_beams=3)
    b = compare_remote(remote, SOURCES[0], [Row("base"), Row("pema", far)], PROMPT, max_new_tokens=10, num_beams=3)
    assert [r.tokens for r in a.rows] == [r.tokens for r in b.rows]


def test_in_network_methods_are_refused_offsite():
    network = [m for m, cls in available_methods().items() if cls.level == "network"]
    assert network
    for m in network:
        with pytest.raises(UserError, match="cannot be trained or decoded offsite"):
            check_offsite_method(m)
    check_offsite_method("pema")
    check_offsite_method("knn")


def test_the_command_lines_work_through_the_owner(tiny, owner, tmp_path, capsys, monkeypatch):
    """``memories build`` / ``plugins train`` / ``plugins compare`` with ``--remote`` (run in this process: the
    owner is the separate one)."""
    from memories.__main__ import main as memories_main
    from plugins.__main__ import main as plugins_main

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"src": s, "tgt": t}) + "\n" for s, t in
                            [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
                             ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 2))
    monkeypatch.setenv("PEMA_REMOTE_TOKEN", TOKEN)
    common = ["--remote", owner.url, "--data-dir", str(tmp_path / "dd")]

    def run(main, *args) -> str:
        capsys.readouterr()
        assert main([*args, *common]) == 0
        return capsys.readouterr().out

    mem_id = run(memories_main, "build", str(data), "--shots", "1").split()[1].rstrip(":")
    with pytest.raises(UserError, match="cannot be trained or decoded offsite"):
        plugins_main(["train", mem_id, "--method", "memory_tuning", *common])
    out = run(plugins_main, "train", mem_id, "--method", "pema",
              *sum((["--set", f"{k}={v}"] for k, v in PEMA_FAST.items()), []))
    plugin_dir = Path(out.split(" -> ")[1].split()[0])
    far = json.loads(run(plugins_main, "compare", SOURCES[0], "--plugin", str(plugin_dir), "--max-new-tokens", "12",
                         "--json"))
    plug = load_plugin(plugin_dir, tiny)
    prompt = Prompt.from_dict(plug.memory_meta["prompt"])
    near = compare(tiny, SOURCES[0], [Row("base"), Row("pema", plug, far["rows"][1]["settings"])], prompt,
                   max_new_tokens=12)
    assert [r["tokens"] for r in far["rows"]] == [r.tokens for r in near.rows]

    # python -m eval run --remote: the outputs and scores of the local evaluation (eval.run.evaluate), with the
    # memory's own prompt on its held-out split
    from eval.__main__ import main as eval_main
    from eval.run import evaluate
    from plugins.__main__ import plugin_rows

    run(eval_main, "run", "--memory", mem_id, "--plugin", str(plugin_dir), "--max-new-tokens", "8",
        "--json", str(tmp_path / "far.json"))
    far = json.loads((tmp_path / "far.json").read_text())
    pairs = [(o["source"], o["reference"]) for o in far["outputs"]]  # the memory's held-out split
    near = evaluate(tiny, pairs, [Row("base")] + plugin_rows([plug], "translation", tiny.name, None),
                    prompt, batch_sources=1, max_new_tokens=8)
    assert far["outputs"] and far["outputs"] == near["outputs"]
    assert [m["chrf"] for m in far["methods"]] == [m["chrf"] for m in near["methods"]]


# --- the studio under a remote backbone ----------------------------------------------------------------------------
STUDIO_TSV = "\n".join(f"{s}\t{t}" for s, t in [
    ("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
    ("good morning", "Guten Morgen"), ("hello world", "hallo Welt"), ("the dog runs", "der Hund rennt"),
    ("a small house", "ein kleines Haus")] * 2)


@pytest.fixture(scope="module")
def studios(owner, tmp_path_factory):
    """The same work through two studios: one on its own tiny backbone, one on the owner's (``remote=``)."""
    from studio.service import Studio

    local = Studio(tmp_path_factory.mktemp("studio-local"), backbone="tiny")
    # one at a time: transformers' lazy imports are not safe across two loader threads
    assert local.backbone_service.wait_ready(120)
    far = Studio(tmp_path_factory.mktemp("studio-remote"), backbone="tiny", remote=owner.url, remote_token=TOKEN)
    try:
        assert far.backbone_service.wait_ready(120), far.backbone_service.status()["message"]
        yield local, far
    finally:
        local.close()
        far.close()


def _studio_work(s) -> dict:
    """Build a memory, train PEMA and kNN on it, through the studio's jobs; their ids."""
    job = s.jobs.wait(s.memory_service.submit_build(STUDIO_TSV, "pairs.tsv", name="pairs"), 120)
    assert job["state"] == "done", job
    mid = job["result"]["memory_id"]
    out = {"memory": mid}
    for method, cfg in (("pema", PEMA_FAST), ("knn", {})):
        job = s.jobs.wait(s.plugin_service.submit_train(mid, method, cfg, method), 180)
        assert job["state"] == "done", job
        out[method] = job["result"]["plugin_id"]
    return out


def test_the_studio_builds_trains_and_compares_through_the_owner_as_it_does_locally(studios, owner):
    from memories.store import Memory
    from ui.app import status_html

    local, far = studios
    assert isinstance(far.backbone_service.backbone(), RemoteBackbone)
    assert not isinstance(local.backbone_service.backbone(), RemoteBackbone)
    holds = f"model weights: at {owner.url.split('//')[1]} (model owner); memory, plug-ins: here"
    far_status, local_status = far.backbone_service.status(), local.backbone_service.status()
    assert far_status["remote"]["holds"] == holds and local_status["remote"] is None
    assert holds in status_html(far_status) and "model owner" not in status_html(local_status)
    near_ids, far_ids = _studio_work(local), _studio_work(far)

    a, b = (_arrays(Memory.load(s.memory_service.memory_row(ids["memory"], None)["path"]))
            for s, ids in ((local, near_ids), (far, far_ids)))
    for k in a:
        if k.endswith("keys"):
            np.testing.assert_allclose(a[k].astype(np.float32), b[k].astype(np.float32), atol=1e-3, rtol=1e-3)
        else:
            assert np.array_equal(a[k], b[k]), k
    bb = local.backbone_service.backbone()
    pa, pb = (load_plugin(s.plugin_service.plugin_row(ids["pema"], None)["path"], bb).state_dict()
              for s, ids in ((local, near_ids), (far, far_ids)))
    assert pa.keys() == pb.keys() and all(torch.allclose(pa[k].float(), pb[k].float(), atol=1e-4) for k in pa)

    for src in SOURCES:
        near = local.compare_service.compare(src, methods=["base", near_ids["pema"], near_ids["knn"]],
                                             max_new_tokens=12)
        away = far.compare_service.compare(src, methods=["base", far_ids["pema"], far_ids["knn"]], max_new_tokens=12)
        assert [r["label"] for r in near["rows"]] == [r["label"] for r in away["rows"]] == ["Base model", "pema",
                                                                                          "knn"]
        assert [r["tokens"] for r in near["rows"]] == [r["tokens"] for r in away["rows"]], src
        assert [r["settings"] for r in near["rows"]] == [r["settings"] for r in away["rows"]]
    with pytest.raises(UserError, match="Attention maps need the decoder's layers"):
        far.compare_service.attention(away, "pema")

    evals = []  # the Evaluate tab's job: the held-out split, every row decoded through the owner's sessions
    for s, ids in ((local, near_ids), (far, far_ids)):
        job = s.jobs.wait(s.evaluate_service.submit_evaluate(methods=["base", ids["pema"], ids["knn"]],
                                                             memory_id=ids["memory"], limit=0, max_new_tokens=10), 120)
        assert job["state"] == "done", job
        evals.append(job["result"])
    assert evals[0]["outputs"] and evals[0]["outputs"] == evals[1]["outputs"]
    assert [m["chrf"] for m in evals[0]["methods"]] == [m["chrf"] for m in evals[1]["methods"]]


def test_in_network_methods_are_unavailable_in_the_studio_under_a_remote_backbone(studios):
    local, far = studios
    table, here = ({m["method"]: m for m in s.plugin_service.methods()} for s in (far, local))
    network = [m for m, d in table.items() if d["level"] == "network"]
    assert network and all(not table[m]["offsite"] and "cannot be trained or decoded offsite"
                           in table[m]["unavailable"] for m in network)
    assert table["pema"]["offsite"] and "unavailable" not in table["pema"] and "unavailable" not in table["knn"]
    assert not any("unavailable" in d for d in here.values())
    mems = far.memory_service.memories() or [  # when this test runs alone
        {"id": far.jobs.wait(far.memory_service.submit_build(STUDIO_TSV, "pairs.tsv"), 120)["result"]["memory_id"]}]
    mid = mems[0]["id"]
    for m in network:
        with pytest.raises(UserError, match="cannot be trained or decoded offsite"):
            far.plugin_service.submit_train(mid, m, {}, m)


def test_app_py_takes_remote_and_the_token_from_the_environment(monkeypatch):
    import app

    monkeypatch.delenv("PEMA_REMOTE_TOKEN", raising=False)
    monkeypatch.delenv("PEMA_REMOTE", raising=False)
    assert app.parse_args([]).remote is None
    assert app.parse_args(["--remote", "http://owner:8765"]).remote == "http://owner:8765"
    monkeypatch.setenv("PEMA_REMOTE", "https://owner.example")
    assert app.parse_args([]).remote == "https://owner.example"
    with pytest.raises(SystemExit, match=r"must be an http\(s\) URL"):
        app.start(["--remote", "ftp://owner", "--backbone", "tiny"], block=False)
    with pytest.raises(SystemExit, match=r"needs the model owner's bearer token in \$PEMA_REMOTE_TOKEN"):
        app.start(["--remote", "http://owner:8765", "--backbone", "tiny"], block=False)


def test_the_remote_setting_switches_in_single_user_mode_only(owner, tmp_path):
    from studio.service import Studio

    s = Studio(tmp_path / "one", backbone="tiny")
    try:
        assert s.backbone_service.wait_ready(60) and s.backbone_service.status()["remote"] is None
        with pytest.raises(UserError, match=r"http\(s\) URL"):
            s.backbone_service.set_remote("ftp://owner:21")
        s.backbone_service.set_remote(owner.url, TOKEN)
        assert s.backbone_service.wait_ready(60), s.backbone_service.status()
        assert isinstance(s.backbone_service.backbone(), RemoteBackbone)
        assert s.backbone_service.status()["remote"]["url"] == owner.url
        assert TOKEN not in json.dumps(s.backbone_service.status())
        s.backbone_service.set_remote(owner.url, "not-the-owners-token")
        assert not s.backbone_service.wait_ready(60)
        st = s.backbone_service.status()
        assert st["state"] == "failed" and "Could not connect to the model owner" in st["message"] \
            and "wrong bearer token" in st["message"]
        s.backbone_service.set_remote("", None)  # back to the local backbone
        assert s.backbone_service.wait_ready(60) and not isinstance(s.backbone_service.backbone(), RemoteBackbone)
        assert s.backbone_service.status()["remote"] is None
    finally:
        s.close()
    hosted = Studio(tmp_path / "many", backbone="tiny", multi_user=True, load=False, start_jobs=False)
    try:
        with pytest.raises(UserError, match="no per-user remote in multi-user mode"):
            hosted.backbone_service.set_remote(owner.url, TOKEN, owner="someone")
    finally:
        hosted.close()


# --- refusals and robustness ---------------------------------------------------------------------------------------
def test_bad_requests_get_a_clear_4xx(owner, remote):
    import httpx

    h = {"Authorization": f"Bearer {TOKEN}"}
    u = owner.url

    def post(path, body=None, headers=h, **kw):
        return httpx.post(u + path, json=body, headers=headers, timeout=30, **kw)

    r = httpx.get(u + "/v1/info")
    assert r.status_code == 401 and "missing bearer token" in r.json()["error"]
    r = httpx.get(u + "/v1/info", headers={"Authorization": "Bearer not-the-token"})
    assert r.status_code == 401 and r.json()["error"] == "wrong bearer token"
    with pytest.raises(UserError, match="wrong bearer token"):
        connect(u, "not-the-token")
    cases = [
        ({"sequences": [[1, 2]] * 65}, 413, "65 rows (limit 64)"),
        ({"sequences": [[1, "x"]]}, 422, "sequences[0][1] = x is not a token id"),
        ({"sequences": [[1, 400]]}, 422, "sequences[0][1] = 400 is not a token id (an integer in [0, 400))"),
        ({"sequences": [[1, -3]]}, 422, "sequences[0][1] = -3"),
        ({"sequences": [[1, 2.5]]}, 422, "sequences[0][1] = 2.5"),
        ({"sequences": []}, 422, "sequences must be a non-empty list"),
        ({"sequences": [[1, 2, 3]], "positions": [[5]]}, 422, "positions[0][0] = 5 is not a position of sequences[0]"),
        ({"sequences": [[1, 2, 3]], "positions": [[0], [1]]}, 422, "one list per sequence"),
        ({"sequences": [[1] * 3000]}, 413, "3000 tokens (limit 2048)"),
        ({"sequences": [[1]], "secret": 1}, 422, "unknown field(s) 'secret'"),
    ]
    for body, status, reason in cases:
        r = post("/v1/fc", body)
        assert r.status_code == status and reason in r.json()["error"], (body, r.status_code, r.text)
    r = httpx.post(u + "/v1/fc", content=b"{not json", headers=h)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    r = httpx.post(u + "/v1/fc", content=b"[" + b"1," * (3 << 20) + b"1]", headers=h)
    assert r.status_code == 413 and "limit" in r.json()["error"]
    r = httpx.post(u + "/v1/fc", content=(b"1" * (1 << 20) for _ in range(6)), headers=h)  # chunked: no length
    assert r.status_code == 413 and "request body over" in r.json()["error"]
    r = post("/v1/sessions/no-such-session/step", {"tokens": [1]})
    assert r.status_code == 404 and "no decode session 'no-such-session'" in r.json()["error"]
    assert httpx.delete(u + "/v1/sessions/nope", headers=h).status_code == 404
    r = post("/v1/sessions", {"context": [1, 2, 3], "rows": 2, "lm": "everything"})
    assert r.status_code == 422 and "lm must be one of full, half, none" in r.json()["error"]
    r = post("/v1/sessions", {"context": [1, 2, 3], "rows": 2, "prefix_len": 3})
    assert r.status_code == 422 and "prefix_len = 3 is outside [0, 2]" in r.json()["error"]
    r = post("/v1/sessions", {"context": [1, 2, 3], "rows": 2})
    assert r.status_code == 200
    sid = unpack(r.content)[1]["session"]
    r = post(f"/v1/sessions/{sid}/step", {"tokens": [5]})
    assert r.status_code == 422 and "one token id per row of the session (2)" in r.json()["error"]
    r = post(f"/v1/sessions/{sid}/step", {"tokens": [5, 6], "rows": [0, 7]})
    assert r.status_code == 422 and "rows[1] = 7 is outside [0, 1]" in r.json()["error"]
    for body, status, reason in [  # a session's steps: malformed ids, unknown rows; the session survives them
        ({"tokens": [5, "x"]}, 422, "tokens[1] = x is not a token id"),
        ({"tokens": [5, 400]}, 422, "tokens[1] = 400 is not a token id"),
        ({"tokens": [5, 6], "reorder": [0, -1]}, 422, "reorder[1] = -1 is outside [0, 1]"),
        ({"tokens": [5, 6], "rows": [1, 1]}, 422, "rows must be a list of distinct row indices"),
        ({"tokens": [5, 6], "beams": 2}, 422, "unknown field(s) 'beams'")]:
        r = post(f"/v1/sessions/{sid}/step", body)
        assert r.status_code == status and reason in r.json()["error"], (body, r.status_code, r.text)
    for path, body, status, reason in [  # oversized batches and malformed ids of the other requests
        ("/v1/sessions", {"context": [1, 2], "rows": 65}, 422, "rows = 65 is outside [1, 64]"),
        ("/v1/sessions", {"context": [1, None]}, 422, "context[1] = None is not a token id"),
        ("/v1/generate", {"contexts": [[1, 2]] * 65}, 413, "65 rows (limit 64)"),
        ("/v1/generate", {"contexts": [[1, True]]}, 422, "contexts[0][1] = True is not a token id"),
        ("/v1/fc", {"sequences": [[1, 2]], "positions": [[-1]]}, 422, "positions[0][0] = -1 is not a position"),
        ("/v1/fc", {"prefix": [1, 2], "sequences": [[3]] * 40, "positions": None}, 200, None)]:
        r = post(path, body)
        assert r.status_code == status and (reason is None or reason in r.json()["error"]), (path, body, r.text)
    t, meta = unpack(post(f"/v1/sessions/{sid}/step", {"tokens": [5, 6], "rows": [1]}).content)
    assert t["fc"].shape == (1, 64) and t["lm"].shape == (1, 400) and meta["step"] == "1"
    assert httpx.delete(u + f"/v1/sessions/{sid}", headers=h).json() == {"closed": sid}
    r = post("/v1/generate", {"contexts": [[1, 2]], "max_new_tokens": 100000})
    assert r.status_code == 422 and "max_new_tokens = 100000 is outside [1, 256]" in r.json()["error"]
    r = httpx.get(u + "/v1/weights", headers=h)
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]
    with pytest.raises(OwnerError) as e:
        remote.client.fc([[1, 999]])
    assert e.value.status == 422 and "is not a token id" in str(e.value)


CLIENT = r"""
import json, sys, httpx
u, tok = sys.argv[1], sys.argv[2]
c = httpx.Client(base_url=u, headers={"Authorization": "Bearer " + tok}, timeout=60)
r = c.post("/v1/sessions", json={"context": list(range(1, 60)), "rows": 8})
n = int.from_bytes(r.content[:8], "little")  # safetensors: header length, JSON header with __metadata__
sid = json.loads(r.content[8:8 + n])["__metadata__"]["session"]
print("open", sid, flush=True)
while True:
    c.post(f"/v1/sessions/{sid}/step", json={"tokens": [7] * 8})
    print("step", flush=True)
"""


def test_the_owner_keeps_serving_when_a_client_is_killed_mid_session(tiny, owner, remote, trained):
    import httpx

    h = {"Authorization": f"Bearer {TOKEN}"}
    before = httpx.get(owner.url + "/v1/info", headers=h).json()["sessions_open"]
    for _ in range(2):
        p = subprocess.Popen([sys.executable, "-c", CLIENT, owner.url, TOKEN], stdout=subprocess.PIPE, text=True,
                             env=_env())
        assert p.stdout.readline().startswith("open")
        for _ in range(3):
            assert p.stdout.readline().strip() == "step"
        p.kill()  # mid-stream: between or inside a step request
        p.wait(10)
    info = httpx.get(owner.url + "/v1/info", headers=h).json()
    assert info["sessions_open"] == before + 2  # the orphans stay until their idle time runs out
    assert owner.proc.poll() is None
    near, far = (load_plugin(trained["pema-remote"].plugin_path, bb) for bb in (tiny, remote))
    a = compare(tiny, SOURCES[1], [Row("base"), Row("pema", near)], PROMPT, max_new_tokens=8)
    b = compare_remote(remote, SOURCES[1], [Row("base"), Row("pema", far)], PROMPT, max_new_tokens=8)
    assert [r.tokens for r in a.rows] == [r.tokens for r in b.rows]


def test_the_owner_keeps_serving_when_a_data_owner_is_killed_mid_decode(tiny, owner, remote, trained, tmp_path):
    """A real data owner (``python -m plugins compare --remote``) killed while its decode session runs; then
    another client decodes, token for token as locally."""
    import httpx

    h = {"Authorization": f"Bearer {TOKEN}"}
    sessions = lambda: httpx.get(owner.url + "/v1/info", headers=h).json()["sessions_open"]  # noqa: E731
    before = sessions()
    p = subprocess.Popen([sys.executable, "-m", "plugins", "compare", SOURCES[2], "--plugin",
                          str(trained["pema-remote"].plugin_path), "--remote", owner.url, "--max-new-tokens", "400",
                          "--data-dir", str(tmp_path)], cwd=ROOT, env={**_env(), "PEMA_REMOTE_TOKEN": TOKEN},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while sessions() == before:  # its decode session is open: it is mid-decode (400 steps of 2 rows)
            assert p.poll() is None, p.stderr.read()
            assert time.time() < deadline, "the data owner never opened a decode session"
            time.sleep(0.02)
    finally:
        p.kill()
        p.wait(10)
    assert p.returncode == -signal.SIGKILL  # killed, not finished
    assert owner.proc.poll() is None and sessions() == before + 1  # its orphan waits for the idle timeout
    near, far = (load_plugin(trained["pema-remote"].plugin_path, bb) for bb in (tiny, remote))
    a = compare(tiny, SOURCES[2], [Row("base"), Row("pema", near)], PROMPT, max_new_tokens=12)
    b = compare_remote(remote, SOURCES[2], [Row("base"), Row("pema", far)], PROMPT, max_new_tokens=12)
    assert [r.tokens for r in a.rows] == [r.tokens for r in b.rows]


# --- the owner's bounds, in process --------------------------------------------------------------------------------
def test_sessions_are_bounded_and_idle_ones_expire(tiny):
    svc = OwnerService(tiny, Limits(max_sessions=2, max_steps=2, session_idle_s=60))
    sids = [unpack(svc.open_session({"context": [1, 2, 3]}))[1]["session"] for _ in range(2)]
    with pytest.raises(ApiError) as e:
        svc.open_session({"context": [1, 2, 3]})
    assert e.value.status == 429 and "2 decode sessions are open (limit 2)" in e.value.reason
    assert "Retry-After" in e.value.headers
    svc.step(sids[0], {"tokens": [4]})
    svc.step(sids[0], {"tokens": [4]})
    with pytest.raises(ApiError, match="made 2 steps"):
        svc.step(sids[0], {"tokens": [4]})
    svc.expire(now=time.time() + 61)  # a dead client's sessions close after the idle time
    assert not svc.sessions
    with pytest.raises(ApiError) as e:
        svc.step(sids[1], {"tokens": [4]})
    assert e.value.status == 404
    unpack(svc.open_session({"context": [1, 2, 3]}))


def test_the_request_rate_is_bounded_per_client(tiny):
    from starlette.testclient import TestClient

    svc = OwnerService(tiny, Limits(rate=0.5, burst=2))
    client = TestClient(make_app(svc, TOKEN))
    h = {"Authorization": f"Bearer {TOKEN}"}
    assert [client.get("/v1/info", headers=h).status_code for _ in range(2)] == [200, 200]
    r = client.get("/v1/info", headers=h)
    assert r.status_code == 429 and "too many requests" in r.json()["error"] and int(r.headers["retry-after"]) >= 1


def test_safetensors_framing_round_trips_and_rejects_junk():
    t, meta = unpack(pack({"fc": torch.arange(6.0).reshape(2, 3)}, {"session": "abc"}))
    assert torch.equal(t["fc"], torch.arange(6.0).reshape(2, 3)) and meta == {"session": "abc"}
    for junk in (b"", b"\xff" * 8 + b"{}", b"12345678"):
        with pytest.raises(Exception):
            unpack(junk)
