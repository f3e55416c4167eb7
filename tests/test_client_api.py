"""The documented client API (docs/client-api.md): its gradio_client session — build → train → poll the
job → compare → share, then export the plug-in as a package and import it back — run against a studio served on
127.0.0.1 with the tiny backbone. If this test changes, change docs/client-api.md's session with it."""
from __future__ import annotations

import json
import zipfile

import pytest
from _server import start_app, wait_job

PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3
LORA = {"rank": 8, "alpha": 8.0, "lr": 1e-2, "batch_size": 4, "max_epochs": 2, "max_minutes": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from gradio_client import Client

    studio, served, url = start_app(tmp_path_factory.mktemp("client-api"))
    assert studio.backbone_service.wait_ready(120), studio.backbone_service.status()
    yield studio, Client(url, verbose=False), url
    served.close()
    studio.close()


def test_the_readme_session_build_train_poll_compare_share_export_import(served, tmp_path):
    from gradio_client import handle_file

    studio, client, url = served
    # --- docs/client-api.md's session, step by step ----------------------------------------------------------------
    samples = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in PAIRS)
    job_id = client.predict(samples, "pairs.jsonl", "my pairs", "translation", api_name="/build")["job_id"]
    job = wait_job(client, job_id)
    assert job["state"] == "done", job
    memory_id = job["result"]["memory_id"]

    job_id = client.predict(memory_id, "lora", LORA, "my lora", api_name="/train")["job_id"]
    job = wait_job(client, job_id)
    assert job["state"] == "done", job
    assert job["progress"] == 1.0 and any(m.get("loss") is not None for m in job["metrics"])
    plugin_id = job["result"]["plugin_id"]
    assert plugin_id in {p["id"] for p in client.predict(api_name="/plugins")}

    result = client.predict("the house is small", "translation", ["base", plugin_id], {}, 12, api_name="/compare")
    assert [r["label"] for r in result["rows"]][:1] and len(result["rows"]) == 2
    assert all(r["text"] is not None for r in result["rows"])
    share = client.predict(result["id"], api_name="/share")
    assert share["link"] == f"/share/?c={share['id']}"
    assert client.predict(share["id"], api_name="/shared")["source"] == "the house is small"

    # --- a package out and back in --------------------------------------------------------------------------
    path = client.predict(plugin_id, False, api_name="/export_plugin")
    with zipfile.ZipFile(path) as z:
        names = {n.split("/")[-1] for n in z.namelist()}
    assert {"plugin_config.json", "plugin_model.safetensors", "adapter_config.json", "README.md",
            "pema_export.json"} <= names
    imported = client.predict(handle_file(path), "my lora (imported)", api_name="/import_plugin")
    assert imported["id"] != plugin_id and imported["method"] == "lora" and imported["name"] == "my lora (imported)"
    again = client.predict("the house is small", "translation", [plugin_id, imported["id"]], {}, 12,
                           api_name="/compare")
    assert again["rows"][0]["tokens"] == again["rows"][1]["tokens"]  # the same weights decode the same
