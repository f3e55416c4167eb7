"""Hugging Face ecosystem on the tiny backbone, offline: plug-ins exported as self-contained
folders with a model card and imported into another data directory (same weights, same decoded tokens), LoRA in
PEFT's own format loaded by ``PeftModel.from_pretrained`` (same logits and tokens as the studio's row), the checks
on import (safetensors only, hashes, backbone), Hub errors as one line, and memories from ``datasets`` sources (a
local Parquet file written here)."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from backbone.prompts import Prompt
from engine import Row, compare
from ground.errors import UserError
from ground.store import Catalog, new_id
from memories.build import build_memory
from memories.parse import Sample
from plugins.api import open_plugin, train_plugin
from plugins.base import load_plugin
from plugins.registry import available_methods, method_card

METHODS = sorted(available_methods())
# LoRA with α = r (scaling 1) and a few epochs, so that it visibly changes the tiny model's logits
LORA = {"rank": 8, "alpha": 8.0, "lr": 1e-2, "batch_size": 4, "max_epochs": 4, "evals_per_epoch": 1, "patience": 3,
        "max_minutes": 0}
PROMPT = Prompt.for_task("translation")
SOURCE = "the house is small"


def quick_config(method: str) -> dict:
    return dict(method_card(method).quick_settings)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops gain nothing from threads on a busy 2-core box
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def home(tiny, tiny_pairs, tmp_path_factory):
    """A data directory with a memory built in it (plug-ins there may read only its own memories)."""
    cat = Catalog(tmp_path_factory.mktemp("home"))
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(tiny_pairs)]
    mem = build_memory(tiny, samples, cat.root / "memories" / new_id(), prompt=PROMPT, name="tiny pairs",
                       catalog=cat)
    return cat, mem


@pytest.fixture(scope="module")
def trained(tiny, home):
    cat, mem = home
    cache: dict = {}

    def get(method):
        if method not in cache:
            cfg = LORA if method == "lora" else quick_config(method)
            plugin, row = train_plugin(tiny, mem, method, cfg, catalog=cat)
            cache[method] = (plugin, row)
        return cache[method]

    return get


def tokens(bb, plugin, n=6):
    return compare(bb, SOURCE, [Row("p", plugin)], PROMPT, max_new_tokens=n).rows[0].tokens


def card_metadata(readme: str) -> dict:
    import yaml

    assert readme.startswith("---\n")
    return yaml.safe_load(readme.split("---\n")[1])


@pytest.mark.parametrize("method", METHODS)
def test_export_import_round_trip_decodes_the_same(method, tiny, home, trained, tmp_path):
    from plugins.hub import MANIFEST, export_plugin, import_plugin

    cat, mem = home
    plugin, row = trained(method)
    needs_store = type(plugin).needs_memory_at_decode
    out = export_plugin(row["id"], tiny, tmp_path / "pkg", catalog=cat, include_datastore=needs_store)
    files = {f.name for f in out.iterdir()}
    assert {"plugin_config.json", "plugin_model.safetensors", "README.md", MANIFEST} <= files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl", ".npy"))]
    assert ("adapter_config.json" in files) == (method == "lora")
    assert ("datastore.safetensors" in files) == needs_store
    config = json.loads((out / "plugin_config.json").read_text())
    assert "path" not in config["memory"]  # no path of the exporting machine in the package

    meta = card_metadata((out / "README.md").read_text())
    info = meta["pema_studio"]
    assert info["method"] == method and info["paper"] == method_card(method).paper
    assert info["memory_fingerprint"] == mem.fingerprint == tiny.fingerprint
    assert len(info["memory_sha256"]) == 64 and info["train_samples"] == mem.meta["stats"]["samples"]
    assert method in meta["tags"] and meta["library_name"] == ("peft" if method == "lora" else "pema-studio")
    readme = (out / "README.md").read_text()
    assert "No evaluation was run" in readme
    for s in type(plugin).decode_settings:
        assert f"| {s.name} |" in readme

    other = Catalog(tmp_path / "other")
    new = import_plugin(str(out), tiny, other)
    assert new["id"] != row["id"] and other.plugin(new["id"]) is not None
    assert (new["memory_id"] != "") == needs_store
    loaded = open_plugin(new["id"], tiny, other)
    assert type(loaded) is type(plugin) and loaded.config == plugin.config
    a, b = plugin.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)
    assert tokens(tiny, loaded) == tokens(tiny, plugin)


def test_knn_export_needs_the_datastore(tiny, home, trained, tmp_path):
    from plugins.hub import export_plugin

    cat, _ = home
    _, row = trained("knn")
    with pytest.raises(UserError, match="--include-datastore"):
        export_plugin(row["id"], tiny, tmp_path / "pkg", catalog=cat)
    assert not (tmp_path / "pkg").exists()


def test_knn_with_a_faiss_index_round_trips(tiny, tiny_pairs, tmp_path):
    """A kNN plug-in over a FAISS index: the package holds the datastore (readable by safetensors' own loader), not
    the index; the importing data directory rebuilds the seeded index and decodes the same tokens."""
    from safetensors.numpy import load_file

    from plugins.hub import export_plugin, import_plugin

    cat = Catalog(tmp_path / "a")
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(tiny_pairs * 5)]
    mem = build_memory(tiny, samples, cat.root / "memories" / new_id(), prompt=PROMPT, catalog=cat)
    plugin, row = train_plugin(tiny, mem, "knn", {"search": "faiss", "ivf_lists": 2, "pq_m": 8}, catalog=cat)
    assert plugin.search_kind.startswith("FAISS")
    out = export_plugin(row["id"], tiny, tmp_path / "pkg", catalog=cat, include_datastore=True)
    store = load_file(str(out / "datastore.safetensors"))
    assert store["keys"].shape == mem.keys.shape and (store["values"] == mem.values).all()
    assert not list(out.glob("*.index"))
    other = Catalog(tmp_path / "b")
    new = import_plugin(str(out), tiny, other)
    loaded = open_plugin(new["id"], tiny, other)
    assert loaded.search_kind.startswith("FAISS") and other.memory(new["memory_id"])["entries"] == len(mem)
    assert tokens(tiny, loaded) == tokens(tiny, plugin)


def _studio_logits(bb, plugin, ids):
    handles = plugin.attach(None, {})
    try:
        with torch.no_grad():
            return bb.model(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()


def test_lora_loads_in_peft_with_the_same_logits_and_tokens(tiny, home, trained, tmp_path):
    """The exported folder is a PEFT adapter: PeftModel.from_pretrained on the tiny base gives the studio's logits,
    and its greedy tokens are the studio's LoRA row's."""
    from peft import PeftModel

    from plugins.hub import export_plugin

    cat, _ = home
    plugin, row = trained("lora")
    out = export_plugin(row["id"], tiny, tmp_path / "pkg", catalog=cat)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == plugin.rank and cfg["lora_alpha"] == plugin.config.alpha
    assert cfg["target_modules"] == [f"model.layers.{tiny.num_layers - 1}.self_attn.o_proj"]

    peft_model = PeftModel.from_pretrained(copy.deepcopy(tiny.model), str(out)).eval()
    ctx = tiny.encode_context(PROMPT.render(SOURCE))
    ids = torch.tensor([ctx], device=tiny.device)
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        base = tiny.model(input_ids=ids).logits
    got = _studio_logits(tiny, plugin, ids)
    assert not torch.allclose(want, base, atol=1e-3)  # the adapter does change the model
    assert torch.allclose(want, got, atol=1e-5, rtol=1e-5)

    row_tokens = compare(tiny, SOURCE, [Row("lora", plugin)], PROMPT, max_new_tokens=6).rows[0].tokens
    seq = list(ctx)
    with torch.no_grad():
        for _ in row_tokens:
            nxt = int(peft_model(input_ids=torch.tensor([seq], device=tiny.device)).logits[0, -1].argmax())
            seq.append(nxt)
    assert seq[len(ctx):] == row_tokens


def test_the_studios_own_lora_folder_is_a_peft_adapter(tiny, home, trained, tmp_path):
    """Plugin.save's extra-files hook: the LoRA folder in the data directory (no export) loads with
    PeftModel.from_pretrained and gives the studio's logits; the PEFT files are checksummed like the weights, so a
    changed adapter_config.json makes the plug-in refuse to load."""
    import shutil

    from peft import PeftModel

    plugin, row = trained("lora")
    folder = tmp_path / "lora"
    shutil.copytree(row["path"], folder)
    files = json.loads((folder / "plugin_config.json").read_text())["files"]
    assert {"adapter_config.json", "adapter_model.safetensors", "plugin_model.safetensors"} <= set(files)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(tiny.model), str(folder)).eval()
    ids = torch.tensor([tiny.encode_context(PROMPT.render(SOURCE))], device=tiny.device)
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
    assert torch.allclose(want, _studio_logits(tiny, plugin, ids), atol=1e-5, rtol=1e-5)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": cfg["lora_alpha"] * 2}))
    with pytest.raises(UserError, match="adapter_config.json does not match its checksum"):
        load_plugin(folder, tiny)


def test_old_lora_plugins_still_load_and_export(tiny, home, trained, tmp_path):
    """A LoRA plug-in saved before checksums and PEFT export (no "files" / "writer" in its config) loads, decodes
    the same and exports a PEFT adapter."""
    import shutil

    from plugins.hub import export_plugin

    plugin, row = trained("lora")
    old = tmp_path / "old-lora"
    shutil.copytree(row["path"], old)
    cfg = json.loads((old / "plugin_config.json").read_text())
    for k in ("files", "writer"):
        cfg.pop(k, None)
    (old / "plugin_config.json").write_text(json.dumps(cfg))
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors"):
        (old / name).unlink(missing_ok=True)  # saved before the PEFT files were written on every save
    loaded = load_plugin(old, tiny)
    assert tokens(tiny, loaded) == tokens(tiny, plugin)
    out = export_plugin(str(old), tiny, tmp_path / "pkg")
    assert (out / "adapter_model.safetensors").exists()


def test_import_checks_like_loading(tiny, home, trained, tmp_path):
    import shutil

    from backbone.tiny import tiny_backbone
    from plugins.hub import export_plugin, import_plugin

    cat, _ = home
    _, row = trained("adapter")
    out = export_plugin(row["id"], tiny, tmp_path / "pkg", catalog=cat)
    other = Catalog(tmp_path / "other")

    with pytest.raises(UserError, match="another backbone"):
        import_plugin(str(out), tiny_backbone(seed=1), other)

    pickled = tmp_path / "pickled"
    shutil.copytree(out, pickled)
    (pickled / "extra_weights.bin").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(UserError, match="safetensors only"):
        import_plugin(str(pickled), tiny, other)

    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    data = bytearray((tampered / "plugin_model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tampered / "plugin_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(UserError, match="SHA-256"):
        import_plugin(str(tampered), tiny, other)
    assert other.plugins() == [] and other.memories() == []

    with pytest.raises(UserError, match="not empty"):
        export_plugin(row["id"], tiny, out, catalog=cat)


def test_card_carries_the_evaluation_and_its_sacrebleu_signature(tiny, home, trained, tmp_path):
    from plugins.hub import export_plugin, load_evaluation

    cat, _ = home
    _, row = trained("adapter")
    refs = ["das Haus ist klein", "die Katze schlaeft"]
    hyps = {"base": ["das Haus", "die Katze"], "adapter": ["das Haus ist klein", "die Katze schlaeft"]}
    from eval.metrics import bleu_chrf

    ev = {"task": "translation", "n": 2, "backbone": tiny.name, "data": "held-out split",
          "methods": [{"label": lb, "method": lb, "settings": {}, **bleu_chrf(h, refs)} for lb, h in hyps.items()],
          "outputs": [{"source": s, "reference": r, **{lb: h[i] for lb, h in hyps.items()}}
                      for i, (s, r) in enumerate(zip(["the house is small", "the cat sleeps"], refs))]}
    (tmp_path / "ev.json").write_text(json.dumps(ev))
    out = export_plugin(row["id"], tiny, tmp_path / "pkg", catalog=cat,
                        evaluation=load_evaluation(tmp_path / "ev.json"))
    readme = (out / "README.md").read_text()
    meta = card_metadata(readme)
    assert meta["pema_studio"]["evaluated"] is True
    assert meta["pema_studio"]["sacrebleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")
    assert "| ★ adapter |" in readme and "chrF signature" in readme and "No evaluation" not in readme
    assert "did not reproduce" not in readme

    with pytest.raises(UserError, match="methods"):
        (tmp_path / "bad.json").write_text("{}")
        load_evaluation(tmp_path / "bad.json")


def test_hub_errors_are_one_line(tiny, home, trained, tmp_path):
    """Offline (or without a token) the Hub calls fail with one UserError line that names the repository."""
    from plugins.hub import import_plugin, push_plugin

    cat, _ = home
    _, row = trained("adapter")
    with pytest.raises(UserError) as e:
        push_plugin(row["id"], "pema-studio-tests/no-such-repo", tiny, catalog=cat)
    assert "pema-studio-tests/no-such-repo" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError) as e:
        import_plugin("pema-studio-tests/no-such-repo", tiny, Catalog(tmp_path / "other"))
    assert "pema-studio-tests/no-such-repo" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="not a Hub repo id"):
        import_plugin(str(tmp_path / "missing-folder"), tiny, Catalog(tmp_path / "other"))


def test_cli_export_and_import(tiny, home, trained, tmp_path, monkeypatch, capsys):
    import plugins.__main__ as cli

    cat, _ = home
    _, row = trained("adapter")
    monkeypatch.setattr(cli, "load_backbone_from_args", lambda args: tiny)
    assert cli.main(["export", row["id"], str(tmp_path / "pkg"), "--data-dir", str(cat.root)]) == 0
    assert cli.main(["import", str(tmp_path / "pkg"), "--data-dir", str(tmp_path / "other"), "--name", "mine"]) == 0
    assert "imported plug-in" in capsys.readouterr().out
    assert [r["name"] for r in Catalog(tmp_path / "other").plugins()] == ["mine"]


# --- memories from datasets ---------------------------------------------------------------------------------------
@pytest.fixture()
def parquet(tmp_path, tiny_pairs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"en": s, "de": t, "translation": {"en": s, "de": t}, "id": i} for i, (s, t) in enumerate(tiny_pairs)]
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_dataset_samples_from_local_parquet(parquet, tiny_pairs, tmp_path):
    from memories.datasets_source import load_dataset_samples

    samples, src = load_dataset_samples(str(parquet), "train", src_field="en", tgt_field="de")
    assert [(s.src, s.tgt) for s in samples] == tiny_pairs and src["hub"] is False
    assert src["dataset"] == "pairs.parquet" and src["rows_read"] == len(tiny_pairs)
    few, src = load_dataset_samples(str(parquet), src_field="translation.en", tgt_field="de", limit=5)
    assert [(s.src, s.tgt) for s in few] == tiny_pairs[:5] and src["rows_read"] == 5  # streamed: stops at --limit
    mono, _ = load_dataset_samples(str(parquet), tgt_field="de", limit=2)
    assert all(s.src is None for s in mono)
    guessed, src = load_dataset_samples(str(parquet))  # en/de found like a JSONL upload's keys
    assert src["fields"] == {"src": "en", "tgt": "de"}
    with pytest.raises(UserError, match="no field 'fr'"):
        load_dataset_samples(str(parquet), src_field="en", tgt_field="fr")

    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"en": "a", "de": "b"}, {"en": "", "de": "c"}, {"en": "d", "de": None}]),
                   bad)
    with pytest.raises(UserError, match="row 2: the source is empty"):
        load_dataset_samples(str(bad), src_field="en", tgt_field="de")
    ok, src = load_dataset_samples(str(bad), src_field="en", tgt_field="de", skip_invalid=True)
    assert [(s.src, s.tgt) for s in ok] == [("a", "b")] and src["skipped"] == 2

    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"source": s, "target": t}) for s, t in tiny_pairs[:3]) + "\n")
    js, _ = load_dataset_samples(str(jsonl), src_field="source", tgt_field="target")
    assert [(s.src, s.tgt) for s in js] == tiny_pairs[:3]


def test_dataset_hub_id_offline_is_one_line():
    from memories.datasets_source import load_dataset_samples

    with pytest.raises(UserError) as e:
        load_dataset_samples("pema-studio-tests/no-such-dataset")
    assert "pema-studio-tests/no-such-dataset" in str(e.value) and "\n" not in str(e.value)


def test_cli_builds_a_memory_from_a_dataset(parquet, tiny, tmp_path, monkeypatch, capsys):
    import memories.__main__ as cli
    from memories.store import Memory

    monkeypatch.setattr(cli, "load_backbone_from_args", lambda args: tiny)
    assert cli.main(["build", "--dataset", str(parquet), "--split", "train", "--src-field", "en", "--tgt-field", "de",
                     "--limit", "6", "--data-dir", str(tmp_path / "d")]) == 0
    rows = Catalog(tmp_path / "d").memories()
    assert len(rows) == 1 and rows[0]["samples"] == 6 and rows[0]["name"] == "pairs"
    mem = Memory.load(rows[0]["path"], tiny)
    assert mem.meta["source"]["dataset"] == "pairs.parquet" and mem.meta["source"]["fields"] == {"src": "en",
                                                                                                 "tgt": "de"}
    with pytest.raises(UserError, match="not both"):
        cli.main(["build", str(parquet), "--dataset", str(parquet), "--data-dir", str(tmp_path / "d")])


# --- the Plug-ins tab's Export / Import: zipped packages through the service ----------------------------------------
@pytest.fixture(scope="module")
def studio_home(home):
    """A Studio on the data directory where ``trained`` saves its plug-ins (all of the local owner)."""
    from studio.service import Studio

    cat, _ = home
    st = Studio(cat.root, backbone="tiny", start_jobs=False)
    assert st.backbone_service.wait_ready(120), st.backbone_service.status()
    yield st
    st.close()


def test_zip_export_import_through_the_service_is_owner_checked(tiny, studio_home, trained, tmp_path):
    """Export writes a zip of the CLI's package into the owner's downloads; another owner cannot export it; an
    import lands in the importer's catalog only, decodes the same, and keeps the package's checks."""
    import zipfile

    st = studio_home
    plugin, row = trained("lora")
    path = st.plugin_service.export_plugin_zip(row["id"])
    assert path.parent == st.downloads.owner_dir("local") and path.name == f"pema-plugin-{row['id']}.zip"
    with zipfile.ZipFile(path) as z:
        assert {n.split("/")[0] for n in z.namelist()} == {f"pema-plugin-{row['id']}"}
        assert {"plugin_config.json", "adapter_model.safetensors", "README.md", "pema_export.json"} <= \
            {n.split("/")[1] for n in z.namelist()}
    with pytest.raises(UserError, match="No plug-in"):
        st.plugin_service.export_plugin_zip(row["id"], owner="mallory")  # another owner's plug-in reads as nonexistent

    got = st.plugin_service.import_plugin_zip(path, "bob's copy", owner="bob")
    assert got["name"] == "bob's copy" and got["method"] == "lora" and got["id"] != row["id"]
    assert [p["id"] for p in st.plugin_service.plugins(owner="bob")] == [got["id"]]
    assert got["id"] not in {p["id"] for p in st.plugin_service.plugins(owner="local")}
    assert tokens(tiny, open_plugin(st.catalog.plugin(got["id"])["path"], tiny)) == tokens(tiny, plugin)
    # the bytes of an upload work too
    assert st.plugin_service.import_plugin_zip(path.read_bytes(), owner="bob")["name"]

    # a file changed inside the zip: the manifest's hash refuses it, nothing is added
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("plugin_model.safetensors"):
                data = data[:-4] + b"\0\0\0\1"
            dst.writestr(info, data)
    with pytest.raises(UserError, match="plugin_model.safetensors does not match its SHA-256"):
        st.plugin_service.import_plugin_zip(bad, owner="carol")
    assert st.plugin_service.plugins(owner="carol") == []


def _zip(path, members: dict, symlink: str | None = None):
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = (0o120777 << 16)  # a symbolic link (Unix mode bits)
            z.writestr(info, "/etc/passwd")
    return path


@pytest.mark.parametrize("members,symlink,limit,pattern", [
    ({"../evil.json": "{}", "plugin_config.json": "{}"}, None, 0, "plain files only"),
    ({"/abs/plugin_config.json": "{}"}, None, 0, "plain files only"),
    ({"a/b/plugin_config.json": "{}"}, None, 0, "plain files only"),
    ({"a/plugin_config.json": "{}", "b/x.json": "{}"}, None, 0, "more than one folder"),
    ({"plugin_config.json": "{}"}, "link.json", 0, "not a plain file"),
    ({"plugin_config.json": "{}", "weights.bin": "x"}, None, 0, "not safetensors"),
    ({"plugin_config.json": "{}", "x.json": "0" * 5_000_000}, None, 0, "zip bomb"),
    ({"plugin_config.json": "{}", "x.json": "0" * 500_000}, None, 100_000, "unpacks to more than"),
    ({"readme.md": "hi"}, None, 0, "no plugin_config.json"),
], ids=["slip", "absolute", "nested", "two-folders", "symlink", "pickle-capable", "bomb", "unpacked-size",
        "no-config"])
def test_hostile_zips_are_refused_before_anything_is_imported(members, symlink, limit, pattern, tmp_path):
    from studio.packages import unpack_zip

    z = _zip(tmp_path / "p.zip", members, symlink)
    with pytest.raises(UserError, match=pattern):
        unpack_zip(z, tmp_path / "out", limit)


def test_oversized_and_non_zip_uploads_are_one_line_errors(tmp_path):
    from studio.packages import unpack_zip

    z = _zip(tmp_path / "p.zip", {"plugin_config.json": "{}", "w.safetensors": os.urandom(3000)})
    with pytest.raises(UserError, match="the limit is 1,000"):
        unpack_zip(z, tmp_path / "out", 1000)
    (tmp_path / "n.zip").write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(UserError, match="not a zip file"):
        unpack_zip(tmp_path / "n.zip", tmp_path / "out2", 0)
    assert unpack_zip(z, tmp_path / "ok", 0) == tmp_path / "ok" and (tmp_path / "ok" / "w.safetensors").exists()
