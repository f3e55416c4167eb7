"""Hostile input: every abuse gets one clear UserError (or a per-line problem), never a traceback; the
process stays up; the data directory is exactly as before.

* uploads: deep JSON, huge integers, lone surrogates, U+2028 inside strings, NUL, encodings, BOMs, empty and huge
  lines, CSV quirks, wrong columns — each with the right line number;
* text sent through the API: the same size bound and NUL / surrogate checks as uploaded bytes;
* names: length, control characters, terminal escapes, bidi overrides — refused on input, escaped when printed;
* settings: types and ranges, training and decode;
* damaged plug-in / memory / index files: truncated or bit-flipped safetensors and FAISS index, NaN/inf weights,
  paths that leave their place, missing files — one UserError each, nothing written, the catalog sound.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ground.errors import UserError

PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3
JSONL = "\n".join(json.dumps({"src": s, "tgt": t}) for s, t in PAIRS)
OK = '{"src": "a", "tgt": "b"}'


def outcome(data, filename=None, fmt="auto") -> tuple[int, str]:
    """(samples parsed, every message) of parsing ``data``: its problems, or the one UserError."""
    from memories.parse import parse_samples

    try:
        samples, problems = parse_samples(data, filename, fmt)
    except UserError as e:
        return -1, str(e)
    return len(samples), " | ".join(str(p) for p in problems)


# --- uploads -------------------------------------------------------------------------------------------------------
DEEP = "[" * 40_000 + "]" * 40_000
UPLOADS = [
    # (id, data, filename, samples expected (-1: a UserError), regex the message must match)
    ("integer-5001-digits", '{"src": "a", "tgt": "b", "n": ' + "7" * 5001 + "}", "x.jsonl", 0,
     r"^line 1: not valid JSON \(Exceeds the limit"),
    ("nested-40k-arrays", DEEP, "x.jsonl", 0, r"^line 1: not valid JSON \(nested too deeply\)"),
    ("nested-in-an-object", '{"src": "a", "tgt": "b", "x": ' + DEEP + "}", "x.jsonl", 0, r"nested too deeply"),
    ("nested-100k-arrays", "[" * 100_000 + "]" * 100_000, "x.jsonl", 0, r"^line 1: the line has 200,000 characters"),
    ("lone-surrogate-escaped", '{"src": "\\ud800", "tgt": "b"}', "x.jsonl", 0,
     r"^line 1: the source contains a lone surrogate \(U\+D800\)"),
    ("lone-low-surrogate-escaped", OK + '\n{"src": "a", "tgt": "x\\udfff"}', "x.jsonl", 1,
     r"^line 2: the target contains a lone surrogate \(U\+DFFF\)"),
    ("lone-surrogate-in-api-text", "good line\n\ud800 bad", None, -1, r"^line 2: the text contains a lone surrogate"),
    ("u2028-inside-json-string", '{"src": "a\u2028b", "tgt": "c"}\n' + OK + "\n{broken", "x.jsonl", 1,
     r"^line 1: the source contains a line break \(U\+2028\) \| line 3: not valid JSON"),
    ("u2029-in-text", "one\u2029two\nthree", "x.txt", 1, r"^line 1: the target contains a line break \(U\+2029\)"),
    ("nel-0085-in-json", OK + '\n{"src": "a\u0085b", "tgt": "c"}\n{bad', "x.jsonl", 1,
     r"^line 2: .*line break \(U\+0085\) \| line 3: not valid JSON"),
    ("vertical-tab", "a\x0bb\nc", "x.txt", 1, r"^line 1: .*line break \(U\+000B\)"),
    ("form-feed", "c\na\x0cb", "x.txt", 1, r"^line 2: .*line break \(U\+000C\)"),
    ("json-escaped-newline", '{"src": "a\\nb", "tgt": "c"}', "x.jsonl", 0, r"line break \(U\+000A\)"),
    ("carriage-return-inside", "a\rb\nc", "x.txt", 1, r"^line 1: .*line break \(U\+000D\)"),
    ("crlf-line-ends-are-fine", "a\r\nb\r\n", "x.txt", 2, r"^$"),
    ("nul-in-bytes", b"abc\n\x00def", None, -1, r"^line 2: the file contains NUL bytes"),
    ("nul-in-api-text", "abc\x00def", None, -1, r"NUL bytes"),
    ("nul-in-csv", b"a,b\nc,\x00", "x.csv", -1, r"NUL bytes"),
    ("not-utf8", b"fine\n\xc3\x28", None, -1, r"^line 2: the file is not UTF-8 text \(byte 0xc3"),
    ("latin-1", "caf\xe9".encode("latin-1"), None, -1, r"^line 1: the file is not UTF-8"),
    ("utf16-le-bom", b"\xff\xfe" + "hi".encode("utf-16-le"), None, -1, r"UTF-16 text; save it as UTF-8"),
    ("utf16-be-bom", b"\xfe\xff" + "hi".encode("utf-16-be"), None, -1, r"UTF-16"),
    ("utf32-bom", "hi".encode("utf-32"), None, -1, r"UTF-32"),
    ("utf8-bom-bytes", b"\xef\xbb\xbf" + OK.encode(), None, 1, r"^$"),
    ("utf8-bom-api-text", "\ufeff" + OK, None, 1, r"^$"),
    ("bom-mid-file", OK + "\n\ufeff" + OK, "x.jsonl", 1, r"^line 2: not valid JSON"),
    ("empty-bytes", b"", None, 0, r"The file is empty"),
    ("only-whitespace", " \n\t\n  ", None, 0, r"The file is empty"),
    ("only-line-breaks", "\n\n\n", "x.jsonl", 0, r"The file is empty"),
    ("huge-line-text", "x" * 200_001, "x.txt", 0, r"^line 1: the line has 200,001 characters"),
    ("huge-line-json", OK + "\n" + '{"src": "' + "y" * 150_000 + '", "tgt": "b"}', "x.jsonl", 1,
     r"^line 2: the line has"),
    ("side-over-2000-chars", json.dumps({"src": "a" * 2001, "tgt": "b"}), "x.jsonl", 0, r"2001 characters"),
    ("empty-side", '{"src": "", "tgt": "b"}', "x.jsonl", 0, r"the source is empty"),
    ("blank-lines-numbered", OK + "\n\n" + OK + "\n\n{x", "x.jsonl", 2,
     r"^line 2: empty line \| line 4: empty line \| line 5: not valid JSON"),
    ("json-array-line", "[1, 2]", "x.jsonl", 0, r"expected a JSON object"),
    ("json-number-line", "5", "x.jsonl", 0, r"expected a JSON object"),
    ("json-nan-line", "NaN", "x.jsonl", 0, r"expected a JSON object"),
    ("json-non-string-side", '{"src": 1, "tgt": "b"}', "x.jsonl", 0, r'"src" and "tgt" must be strings'),
    ("json-null-side", '{"src": null, "tgt": "b"}', "x.jsonl", 0, r"must be strings"),
    ("json-wrong-fields", '{"foo": "bar"}', "x.jsonl", 0, r"missing fields"),
    ("json-text-not-string", '{"text": ["a"]}', "x.jsonl", 0, r"missing fields"),
    ("terminal-escape-in-sample", '{"src": "\\u001b[2J\\u001b[31mred", "tgt": "b"}', "x.jsonl", 0,
     r"control character \(U\+001B\)"),
    ("c1-csi-in-text", "a\x9b31mred", "x.txt", 0, r"control character \(U\+009B\)"),
    ("del-in-text", "a\x7fb", "x.txt", 0, r"control character \(U\+007F\)"),
    ("tabs-are-fine", "a\tb\tc", "x.txt", 1, r"^$"),
    ("csv-three-columns", "a,b,c\nd,e,f", "x.csv", 0, r"^line 1: expected 1 column .* found 3"),
    ("csv-mixed-widths", "a,b\nc\nd,e", "x.csv", 2, r"^line 2: expected 2 column\(s\), found 1"),
    ("csv-header-only", "src,tgt\n", "x.csv", 0, r"found 0"),
    ("csv-quoted-newline-line-numbers", 'src,tgt\n"a\nb",c\nd,e\nf,g,h\n', "x.csv", 1,
     r"^line 2: the source contains a line break .* \| line 5: expected 2 column\(s\), found 3"),
    ("csv-field-over-the-csv-limit", 'a,"' + ("x" * 60_000 + "\n") * 3 + '"\n', "x.csv", 0,
     r"^line 1: CSV error \(field larger than field limit"),
    ("csv-unbalanced-quote", 'a,"b\nc,d\n', "x.csv", 0, r"line break"),
    ("tsv-three-columns", "a\tb\tc", "x.tsv", 0, r"found 3"),
    ("csv-empty-rows", "a,b\n,\nc,d", "x.csv", 2, r"^line 2: empty line$"),
]


@pytest.mark.parametrize("data,filename,count,pattern", [u[1:] for u in UPLOADS], ids=[u[0] for u in UPLOADS])
def test_hostile_uploads_give_one_clear_message(data, filename, count, pattern):
    n, message = outcome(data, filename)
    assert n == count, message
    assert __import__("re").search(pattern, message), message
    assert "Traceback" not in message


def test_an_unknown_format_and_the_size_bound_are_user_errors(monkeypatch):
    import memories.parse as parse

    assert outcome(OK, None, fmt="xml") == (-1, "Unknown format 'xml'; use jsonl, csv, tsv or text.")
    monkeypatch.setattr(parse, "MAX_BYTES", 100)
    assert "the limit is" in outcome(b"x" * 101)[1]
    assert "the limit is" in outcome("x" * 101)[1]  # text through the API: the same bound
    assert "the limit is" in outcome("é" * 60)[1]  # 60 characters, 120 bytes: counted in UTF-8 bytes


# --- text through the API ------------------------------------------------------------------------------------------
@pytest.fixture
def studio(tmp_path):
    from studio.limits import Limits
    from studio.service import Studio

    st = Studio(tmp_path / "d", backbone="tiny", load=False, start_jobs=False,
                limits=Limits(upload_bytes=2000, name_chars=40))
    yield st
    st.close()


def snapshot(root: Path) -> dict:
    """Every file under ``root`` (but the catalog's own, which SQLite may touch on a read) with size and mtime."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file() and not p.name.startswith("studio.db"):
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


API_TEXT = [
    ("nul", "ok line\nbad \x00 line", r"NUL bytes"),
    ("lone-surrogate", "ok line\n\ud83d broken emoji", r"lone surrogate"),
    ("over-the-upload-bound-text", "x" * 2001, r"upload_bytes"),
    ("over-the-upload-bound-multibyte", "é" * 1001, r"upload_bytes"),  # 2002 bytes, 1001 characters
    ("not-text", {"src": "a"}, r"as text or as a file"),
    ("a-list", ["a", "b"], r"as text or as a file"),
]


@pytest.mark.parametrize("data,pattern", [a[1:] for a in API_TEXT], ids=[a[0] for a in API_TEXT])
def test_text_through_the_api_gets_the_same_checks_as_bytes(studio, data, pattern):
    before = snapshot(studio.root)
    for call in (lambda: studio.memory_service.preview(data, "x.txt"),
                 lambda: studio.memory_service.submit_build(data, "x.txt")):
        with pytest.raises(UserError, match=pattern):
            call()
    assert studio.jobs.list() == [] and snapshot(studio.root) == before


@pytest.mark.parametrize("text,pattern", [("a\x00b", "NUL"), ("x\ud800y", "lone surrogate"), (5, "must be text")])
def test_free_text_gets_the_upload_checks(text, pattern):
    from ground.text import check_text

    with pytest.raises(UserError, match=pattern):
        check_text(text, "sentence")
    assert check_text("a\tb\nc \u202e ✓", "sentence") == "a\tb\nc \u202e ✓"


COMPARE_TEXT = [  # (id, source, reference, pattern): every text a comparison decodes or stores
    ("source-nul", "a\x00b", None, r"sentence contains a NUL character"),
    ("source-lone-surrogate", "x\ud800y", None, r"sentence contains a lone surrogate \(U\+D800\)"),
    ("source-escape", "red \x1b[31m text", None, r"sentence contains U\+001B .*control character"),
    ("source-c1-csi", "a \x9b b", None, r"sentence contains U\+009B"),
    ("source-del", "a\x7fb", None, r"sentence contains U\+007F"),
    ("source-too-long", "x" * 2001, None, r"sentence's length in characters is 2,001; the limit is 2,000"),
    ("source-not-text", 12345, None, r"Type a sentence"),
    ("reference-nul", "fine", "r\x00", r"reference contains a NUL character"),
    ("reference-surrogate", "fine", "\udfff", r"reference contains a lone surrogate"),
    ("reference-bell", "fine", "ding\x07", r"reference contains U\+0007"),
    ("reference-too-long", "fine", "y" * 2001, r"reference's length in characters is 2,001"),
    ("reference-not-text", "fine", ["a"], r"reference must be text"),
]


@pytest.mark.parametrize("source,reference,pattern", [c[1:] for c in COMPARE_TEXT], ids=[c[0] for c in COMPARE_TEXT])
def test_compare_text_gets_the_text_checks(studio, source, reference, pattern):
    before = snapshot(studio.root)
    with pytest.raises(UserError, match=pattern):
        studio.compare_service.compare(source, reference=reference, max_new_tokens=4)
    assert snapshot(studio.root) == before


def test_plain_compare_text_passes_the_checks(studio):
    """Tabs, line breaks, bidi marks and any script are text: the check lets them through (the backbone is not
    loaded here, so the comparison stops only when it would decode)."""
    with pytest.raises(UserError, match="still loading"):
        studio.compare_service.compare("שלום\u200f\tworld\n✓ é", reference="ok\r\n", max_new_tokens=4)


EVAL_TEXT = [  # pairs pasted (or sent through the API) for an evaluation: the parser's checks, naming the line
    ("nul", "a\tb\nc\x00\td", r"NUL"),
    ("surrogate", "a\tb\nc\ud800\td", r"lone surrogate"),
    ("escape", "a\tb\nc\x1b[2J\td", r"line 2: the source contains a control character \(U\+001B\)"),
    ("c1", "a\tb\nc\td\x9be", r"line 2: the target contains"),
    ("too-long-side", "a\tb\n" + "x" * 2001 + "\td", r"line 2: the source has 2001 characters"),
    ("over-upload-bound", "a\tb\n" * 800, r"upload_bytes"),
    ("no-pairs", "just one column\n", r"source and reference pairs"),
]


@pytest.mark.parametrize("text,pattern", [e[1:] for e in EVAL_TEXT], ids=[e[0] for e in EVAL_TEXT])
def test_evaluation_pairs_get_the_text_checks(studio, text, pattern):
    import dataclasses

    studio.limits = dataclasses.replace(studio.limits, upload_bytes=3000)  # room for one over-long line
    before = snapshot(studio.root)
    with pytest.raises(UserError, match=pattern):
        studio.evaluate_service.submit_evaluate(methods=["base"], test_data=text, test_filename="t.tsv", limit=0,
                                                max_new_tokens=4)
    assert studio.jobs.list() == [] and snapshot(studio.root) == before


@pytest.mark.parametrize("label,pattern", [("\u202eevil", "U\\+202E"), ("two\nlines", "U\\+000A"),
                                           ("esc\x1b[1m", "U\\+001B"), ("x" * 41, "length in characters is 41"),
                                           ("   ", "non-empty text"), (7, "non-empty text")])
def test_share_labels_are_checked_like_names(studio, label, pattern):
    p = {"rows": [{"label": "Base model", "method": "base"}]}
    with pytest.raises(UserError, match=pattern):
        studio.compare_service.share_labels(p, {"Base model": label})
    assert studio.compare_service.share_labels(p, {"Base model": " Mein Modell "}) == {"Base model": "Mein Modell"}


def test_a_hostile_file_name_neither_breaks_nor_leaks_into_names(studio):
    with pytest.raises(UserError, match="file name must be text"):
        studio.memory_service.submit_build(JSONL, 12345)
    jid = studio.memory_service.submit_build(JSONL, "\x1b[2J\x1b]0;pwned\x07" + "n" * 300 + ".JSONL/../../x.exe")
    args = studio.jobs.get(jid)["args"]
    assert "\x1b" not in args["name"] and "\x07" not in args["name"] and len(args["name"]) <= 40
    assert Path(args["upload"]).parent == studio.root / "uploads" and Path(args["upload"]).suffix == ".txt"
    studio.job_service.cancel_job(jid)
    assert list((studio.root / "uploads").iterdir()) == []


# --- names ---------------------------------------------------------------------------------------------------------
NAMES = [
    ("terminal-escape", "\x1b[2J\x1b[31mowned", r"U\+001B"),
    ("osc-title", "\x1b]0;title\x07", r"U\+001B"),
    ("nul", "a\x00b", r"U\+0000"),
    ("newline", "line one\nline two", r"U\+000A"),
    ("carriage-return", "fake\rname", r"U\+000D"),
    ("c1-csi", "a\x9b2J", r"U\+009B"),
    ("del", "a\x7f", r"U\+007F"),
    ("bidi-override", "invoice\u202egnp.exe", r"U\+202E"),
    ("bidi-isolate", "a\u2066b", r"U\+2066"),
    ("line-separator", "a\u2028b", r"U\+2028"),
    ("lone-surrogate", "a\ud800", r"lone surrogate"),
    ("tab", "a\tb", r"U\+0009"),
    ("too-long", "n" * 41, r"name_chars"),
    ("not-text", 12345, r"must be text"),
    ("a-list", ["a"], r"must be text"),
]


@pytest.mark.parametrize("name,pattern", [n[1:] for n in NAMES], ids=[n[0] for n in NAMES])
def test_hostile_names_are_refused(studio, name, pattern):
    with pytest.raises(UserError, match=pattern):
        studio.memory_service.submit_build(JSONL, "x.jsonl", name=name)
    assert studio.jobs.list() == [] and not (studio.root / "uploads").exists()


def test_plain_unicode_names_are_fine(studio):
    jid = studio.memory_service.submit_build(JSONL, "x.jsonl", name="  Fußnoten – 日本語 ✓  ")
    assert studio.jobs.get(jid)["args"]["name"] == "Fußnoten – 日本語 ✓"


def test_names_are_escaped_when_listed(tmp_path, capsys):
    from ground.store import Catalog
    from memories.__main__ import main as memories_main
    from plugins.__main__ import main as plugins_main

    cat = Catalog(tmp_path)  # rows written before names were checked
    cat.add_memory({"id": "mem-1", "name": "\x1b[2J\x1b]0;pwned\x07\u202eevil", "path": str(tmp_path / "x"),
                    "backbone": "tiny", "task": "translation", "mode": "teacher", "samples": 1, "entries": 1,
                    "bytes": 0})
    cat.add_plugin({"id": "knn-1", "name": "\x9b31m\x1b[5m", "method": "knn", "memory_id": "mem-1",
                    "path": str(tmp_path / "y"), "backbone": "tiny", "params": 0})
    assert memories_main(["list", "--data-dir", str(tmp_path)]) == 0
    assert plugins_main(["list", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out and "\u202e" not in out
    assert "\\x1b[2J" in out and "\\u202eevil" in out and "\\x9b31m" in out


# --- settings ------------------------------------------------------------------------------------------------------
TRAINING_SETTINGS = [
    ("pema", {"rank": "16; rm -rf /"}), ("pema", {"rank": 1e309}), ("pema", {"rank": True}),
    ("pema", {"rank": -1}), ("pema", {"rank": 10 ** 30}), ("pema", {"rank": [16]}), ("pema", {"rank": {"a": 1}}),
    ("pema", {"lr": float("nan")}), ("pema", {"lr": "inf"}), ("pema", {"kappa": -0.1}), ("pema", {"rnak": 8}),
    ("knn", {"search": "rm -rf"}), ("knn", {"ivf_lists": -5}), ("knn", {"pq_m": 10 ** 6}),
]


@pytest.mark.parametrize("method,config", TRAINING_SETTINGS, ids=[f"{m}-{next(iter(c))}-{i}" for i, (m, c)
                                                                  in enumerate(TRAINING_SETTINGS)])
def test_hostile_training_settings_are_refused(method, config):
    from plugins.api import make_config

    with pytest.raises(UserError):
        make_config(method, config)


DECODE_SETTINGS = [{"k": "NaN"}, {"k": 10 ** 9}, {"k": 0}, {"k": 2.5}, {"temperature": -1.0},
                   {"temperature": float("inf")}, {"lambda": float("nan")}, {"lambda": 1.5}, {"lambda": "0.3; x"},
                   {"nope": 1}]


@pytest.mark.parametrize("overrides", DECODE_SETTINGS, ids=[json.dumps(o) for o in DECODE_SETTINGS])
def test_hostile_decode_settings_are_refused(tiny, overrides):
    from plugins.knn import KNN, KNNConfig

    with pytest.raises(UserError):
        KNN(KNNConfig(), tiny).settings(overrides)


@pytest.mark.parametrize("method,config,pattern", [
    ("pema", "{not json", "not valid JSON"), ("pema", "[1, 2]", "must be a JSON object"),
    ("pema", {"rank": "x"}, "rank"), ("../../etc/passwd", {}, "Unknown method"), ("pema", 5, "JSON object")])
def test_hostile_train_requests_through_the_studio(studio, tiny_memory, method, config, pattern):
    studio.catalog.add_memory({"id": "mem-t", "name": "t", "path": str(tiny_memory.path)})
    with pytest.raises(UserError, match=pattern):
        studio.plugin_service.submit_train("mem-t", method, config)
    assert studio.jobs.list() == []


# --- damaged plug-in, memory and index files ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tiny, tmp_path_factory):
    """A data directory with a memory and three plug-ins (PEMA, kNN exact, kNN with a FAISS index)."""
    from backbone.prompts import Prompt
    from ground.store import Catalog
    from memories.build import build_memory
    from memories.parse import Sample
    from plugins.api import train_plugin

    root = tmp_path_factory.mktemp("hostile-data")
    cat = Catalog(root)
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(PAIRS)]
    mem = build_memory(tiny, samples, root / "memories" / "mem-h", prompt=Prompt.for_task("translation"),
                       catalog=cat)
    ids = {}
    for label, method, cfg in (("pema", "pema", {"rank": 8, "max_epochs_rct": 1, "max_epochs_joint": 1,
                                                  "candidate_contexts": 16}),
                               ("knn", "knn", {}),
                               ("faiss", "knn", {"search": "faiss", "ivf_lists": 4, "pq_m": 16, "nprobe": 4})):
        _p, row = train_plugin(tiny, mem, method, cfg, catalog=cat)
        ids[label] = row["id"]
    return {"root": root, "cat": cat, "memory": mem, "ids": ids}


def _rewrite_weights(folder: Path, change, keep_checksum: bool = False) -> None:
    """Change the weights and (unless ``keep_checksum``) record the new file's sha256, as a careful forger would."""
    from safetensors.torch import load_file, save_file

    from plugins.base import file_sha256

    f = folder / "plugin_model.safetensors"
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f))
    if not keep_checksum:
        cfg = json.loads((folder / "plugin_config.json").read_text())
        cfg["files"]["plugin_model.safetensors"]["sha256"] = file_sha256(f)
        (folder / "plugin_config.json").write_text(json.dumps(cfg))


def _first_float(tensors) -> str:
    return next(k for k, v in tensors.items() if v.is_floating_point() and v.numel())


def _set(tensors, value):
    k = _first_float(tensors)
    t = tensors[k].clone()
    t.view(-1)[0] = value
    tensors[k] = t


def _edit_config(folder: Path, edit) -> None:
    cfg = json.loads((folder / "plugin_config.json").read_text())
    edit(cfg)
    (folder / "plugin_config.json").write_text(json.dumps(cfg))


def _truncate(f: Path, keep: float = 0.5) -> None:
    b = f.read_bytes()
    f.write_bytes(b[: int(len(b) * keep)])


def _flip(f: Path, at: float = 0.6) -> None:
    b = bytearray(f.read_bytes())
    b[int(len(b) * at)] ^= 0x10
    f.write_bytes(bytes(b))


def _index(folder: Path) -> Path:
    cfg = json.loads((folder / "plugin_config.json").read_text())
    return Path(cfg["memory"]["path"]) / cfg["extra"]["index"]["file"]


W = "plugin_model.safetensors"
DAMAGE = [
    # (id, plug-in, damage(plugin folder, memory folder), regex)
    ("weights-truncated", "pema", lambda p, m: _truncate(p / W), r"does not match its checksum"),
    ("weights-emptied", "pema", lambda p, m: (p / W).write_bytes(b""), r"does not match its checksum"),
    ("weights-missing", "pema", lambda p, m: (p / W).unlink(), r"plugin_model.safetensors is missing"),
    ("weights-bit-flipped", "pema", lambda p, m: _flip(p / W), r"does not match its checksum"),
    ("weights-huge-header", "pema", lambda p, m: (p / W).write_bytes(b"\xff" * 8 + b"{}"), r"checksum"),
    ("weights-nan", "pema", lambda p, m: _rewrite_weights(p, lambda t: _set(t, float("nan"))),
     r"hold NaN or infinite values"),
    ("weights-inf", "pema", lambda p, m: _rewrite_weights(p, lambda t: _set(t, float("inf"))),
     r"hold NaN or infinite values"),
    ("weights-nan-no-checksum", "pema", lambda p, m: (_rewrite_weights(p, lambda t: _set(t, float("nan"))),
                                                      _edit_config(p, lambda c: c.pop("files"))),
     r"hold NaN or infinite values"),
    ("weights-truncated-no-checksum", "pema", lambda p, m: (_edit_config(p, lambda c: c.pop("files")),
                                                            _truncate(p / W)), r"cannot be read"),
    ("weights-garbage-no-checksum", "pema", lambda p, m: (_edit_config(p, lambda c: c.pop("files")),
                                                          (p / W).write_bytes(os.urandom(64))), r"cannot be read"),
    ("weights-unexpected-tensor", "pema",
     lambda p, m: _rewrite_weights(p, lambda t: t.update(evil=torch.zeros(2))), r"unexpected \['evil'\]"),
    ("weights-wrong-shape", "pema",
     lambda p, m: _rewrite_weights(p, lambda t: t.update({_first_float(t): torch.zeros(3, 3)})),
     r"do not fit the method|damaged"),
    ("config-not-json", "pema", lambda p, m: (p / "plugin_config.json").write_text("{not json"), r"unreadable"),
    ("config-empty", "pema", lambda p, m: (p / "plugin_config.json").write_text(""), r"unreadable"),
    ("config-a-list", "pema", lambda p, m: (p / "plugin_config.json").write_text("[]"), r"not an object"),
    ("config-deeply-nested", "pema", lambda p, m: (p / "plugin_config.json").write_text(DEEP), r"unreadable"),
    ("config-not-utf8", "pema", lambda p, m: (p / "plugin_config.json").write_bytes(b"\xff\xfe{"), r"unreadable"),
    ("config-no-method", "pema", lambda p, m: _edit_config(p, lambda c: c.pop("method")), r"no valid 'method'"),
    ("config-unknown-method", "pema", lambda p, m: _edit_config(p, lambda c: c.update(method="evil")),
     r"Unknown method"),
    ("config-method-not-text", "pema", lambda p, m: _edit_config(p, lambda c: c.update(method=["pema"])),
     r"no valid 'method'"),
    ("config-bad-setting", "pema", lambda p, m: _edit_config(p, lambda c: c["config"].update(rank="x")), r"rank"),
    ("config-no-fingerprint", "pema", lambda p, m: _edit_config(p, lambda c: c.pop("fingerprint")),
     r"no valid 'fingerprint'"),
    ("config-newer-version", "pema", lambda p, m: _edit_config(p, lambda c: c.update(format_version=99)),
     r"newer PEMA Studio"),
    ("config-files-escape", "pema",
     lambda p, m: _edit_config(p, lambda c: c["files"].update({"../../studio.db": {"sha256": "0"}})),
     r"not a plain file name"),
    ("config-memory-not-an-object", "knn", lambda p, m: _edit_config(p, lambda c: c.update(memory="x")),
     r"'memory' is not an object"),
    ("memory-path-etc", "knn", lambda p, m: _edit_config(p, lambda c: c["memory"].update(path="/etc")),
     r"is gone"),
    ("memory-path-relative", "knn",
     lambda p, m: _edit_config(p, lambda c: c["memory"].update(path="../../memories/mem-h")),
     r"relative or climbs out"),
    ("memory-path-dotdot", "knn",
     lambda p, m: _edit_config(p, lambda c: c["memory"].update(path=str(m) + "/../../plugins")),
     r"relative or climbs out"),
    ("memory-path-a-plugin", "knn",
     lambda p, m: _edit_config(p, lambda c: c["memory"].update(path=str(p))),
     r"not at one of its memories"),
    ("memory-path-the-data-dir", "knn",
     lambda p, m: _edit_config(p, lambda c: c["memory"].update(path=str(m.parent.parent))),
     r"not at one of its memories"),
    ("memory-path-nul", "knn", lambda p, m: _edit_config(p, lambda c: c["memory"].update(path="/tmp/\x00x")),
     r"not a path"),
    ("memory-path-not-text", "knn", lambda p, m: _edit_config(p, lambda c: c["memory"].update(path=5)),
     r"not a path"),
    ("index-bit-flipped", "faiss", lambda p, m: _flip(_index(p)), r"FAISS index .* does not match its checksum"),
    ("index-truncated", "faiss", lambda p, m: _truncate(_index(p)), r"does not match its checksum"),
    ("index-missing", "faiss", lambda p, m: _index(p).unlink(), r"FAISS index .* is missing"),
    ("index-name-escapes", "faiss",
     lambda p, m: _edit_config(p, lambda c: c["extra"]["index"].update(file="../mem-h/keys.npy")),
     r"not a plain file name"),
    ("index-no-checksum", "faiss", lambda p, m: _edit_config(p, lambda c: c["extra"]["index"].pop("sha256")),
     r"no checksum"),
    ("memory-meta-broken", "knn", lambda p, m: (m / "meta.json").write_text("{"), r"meta.json is unreadable"),
    ("memory-meta-no-stats", "knn", lambda p, m: (m / "meta.json").write_text(json.dumps(
        {k: v for k, v in json.loads((m / "meta.json").read_text()).items() if k != "stats"})), r"'stats'"),
    ("memory-meta-bad-rms", "knn", lambda p, m: (m / "meta.json").write_text(json.dumps(
        {**json.loads((m / "meta.json").read_text()),
         "stats": {**json.loads((m / "meta.json").read_text())["stats"], "key_rms": "NaN"}})), r"key_rms"),
    ("memory-keys-truncated", "knn", lambda p, m: _truncate(m / "keys.npy", 0.7), r"keys.npy cannot be read"),
    ("memory-keys-missing", "knn", lambda p, m: (m / "keys.npy").unlink(), r"keys.npy is missing"),
    ("memory-keys-nan", "knn", lambda p, m: np.save(m / "keys.npy", np.full(np.load(m / "keys.npy").shape, np.nan,
                                                                           np.float16)), r"NaN or infinite keys"),
    ("memory-keys-pickled", "knn", lambda p, m: np.save(m / "keys.npy", np.array([{"x": 1}], dtype=object),
                                                        allow_pickle=True), r"keys.npy cannot be read"),
    ("memory-keys-wrong-shape", "knn", lambda p, m: np.save(m / "keys.npy", np.zeros((3, 3), np.float16)),
     r"has shape \(3, 3\)"),
    ("memory-values-float", "knn", lambda p, m: np.save(m / "values.npy", np.zeros(
        np.load(m / "values.npy").shape, np.float32)), r"values.npy has shape"),
]


@pytest.fixture
def damaged(data):
    """Undo each test's damage: the folders of the module's data directory are restored afterwards."""
    root = data["root"]
    saved = {sub: Path(str(root) + f".{sub}.bak") for sub in ("memories", "plugins")}
    for sub, bak in saved.items():
        if bak.exists():
            shutil.rmtree(bak)
        shutil.copytree(root / sub, bak)
    yield data
    for sub, bak in saved.items():
        shutil.rmtree(root / sub)
        shutil.copytree(bak, root / sub)
        shutil.rmtree(bak)


@pytest.mark.parametrize("case,which,damage,pattern", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_file_is_one_user_error_and_nothing_changes(tiny, damaged, case, which, damage, pattern):
    from plugins.api import open_memory, open_plugin

    root, cat = damaged["root"], damaged["cat"]
    pid = damaged["ids"][which]
    damage(Path(cat.plugin(pid)["path"]), damaged["memory"].path)
    before = snapshot(root)
    with pytest.raises(UserError, match=pattern) as err:
        open_plugin(pid, tiny, cat)
    assert "Traceback" not in str(err.value)
    if case.startswith("memory-") and "path" not in case:  # the damaged memory on its own too
        with pytest.raises(UserError):
            m = open_memory("mem-h", tiny, cat)
            _ = (m.keys, m.values, m.entry_sample, m.samples, len(m), m.summary())
    assert snapshot(root) == before  # nothing written: no rebuilt index, no temporary file
    assert cat.integrity() == "ok" and {r["id"] for r in cat.plugins()} == set(damaged["ids"].values())


def test_the_undamaged_data_loads(tiny, data):
    from plugins.api import open_plugin

    for pid in data["ids"].values():
        assert open_plugin(pid, tiny, data["cat"]).method in ("pema", "knn")
    cfg = json.loads((Path(data["cat"].plugin(data["ids"]["faiss"])["path"]) / "plugin_config.json").read_text())
    assert len(cfg["files"]["plugin_model.safetensors"]["sha256"]) == 64 and len(cfg["extra"]["index"]["sha256"]) == 64


def test_a_damaged_memory_through_the_studio_is_a_user_error(tiny, data, tmp_path):
    from ground.store import Catalog
    from studio.service import Studio

    shutil.copytree(data["memory"].path, tmp_path / "memories" / "mem-s")
    (tmp_path / "memories" / "mem-s" / "samples.jsonl").write_text('{"src": "a"\n')
    Catalog(tmp_path).add_memory({"id": "mem-s", "name": "s", "path": str(tmp_path / "memories" / "mem-s"),
                                  "meta": "{}", "owner": "local"})
    st = Studio(tmp_path, backbone="tiny", load=False, start_jobs=False)
    try:
        assert st.repairs == []  # its folder has its row: nothing to repair
        before = snapshot(tmp_path)
        with pytest.raises(UserError, match="samples.jsonl is unreadable"):
            st.memory_service.memory_detail("mem-s")
        with pytest.raises(UserError, match="samples.jsonl is unreadable"):
            st.memory_service.heldout_samples("mem-s")
        assert snapshot(tmp_path) == before and st.catalog.integrity() == "ok"
    finally:
        st.close()


def test_nan_weights_are_never_saved(tiny, tiny_memory, tmp_path):
    from plugins.api import new_plugin

    p = new_plugin("pema", tiny, tiny_memory, {"rank": 8})
    with torch.no_grad():
        next(t for t in p.parameters() if t.is_floating_point()).view(-1)[0] = float("nan")
    with pytest.raises(UserError, match="diverged"):
        p.save(tmp_path / "p")
    assert list(tmp_path.iterdir()) == []
