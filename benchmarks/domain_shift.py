"""``python -m benchmarks domain-shift``: a domain-shift check built from the machine's German gettext catalogs, and
PEMA measured on it with the prompt's built-in few-shot examples and with the memory's own.

The split (``build``): a product ships several programs' catalogs (PostgreSQL 15: ``postgres-15.mo``, ``psql-15.mo``,
``pg_dump-15.mo``, ...). The memory's pairs come from one program (``--memory-catalog``), the test's from the
product's other programs (``--family``: the catalogs whose name ends so), none with an English message that the
memory program's catalog holds. Pairs pass ``memories.corpora.is_sentence_like`` on both sides, one per English
message. The pairs stay out of the repository: they are written under ``--out`` (``memory.jsonl``, ``test.jsonl``
and ``split.json``, which also holds the transfer check of the test against the memory's held-out samples)::

    python -m benchmarks domain-shift build --out /work/data-local/domain-shift
    python -m memories build /work/data-local/domain-shift/memory.jsonl --name pg-postgres
    python -m eval rank <memory-id> --test /work/data-local/domain-shift/test.jsonl

The measurement (``prompts``): two memories of the same pairs, one whose prompt keeps the task's built-in examples
(``--builtin-examples``) and one with its own (the default); PEMA trained on each with its defaults; the base model
and PEMA (global tuned decode settings, no calibration) decoded on the test with each memory's prompt; paired
bootstrap of every difference. Everything else is equal (same samples, split, seed, backbone, decode)::

    nice -n 10 python -m benchmarks domain-shift prompts --split /work/data-local/domain-shift --batch 8 \\
        --json /work/data-local/domain-shift/prompts.json
    ... prompts --split /work/data-local/domain-shift --batch 8 --on heldout   # the same on the held-out samples

Steps already done are reused from ``state.json`` in the split folder (a memory, a plug-in, a decode), so an
interrupted run goes on where it stopped.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

from ground.cli import add_common, progress_bar
from memories.corpora import DEFAULT_LOCALE_DIR, is_sentence_like, read_mo
from memories.nearness import NgramIndex, nearness_profile, transfer_check

EXAMPLES = ("builtin", "own")


def catalog_pairs(path: Path) -> list[tuple[str, str]]:
    """Sentence-like (English, German) pairs of one catalog, one per English message, sorted."""
    out = {}
    for en, de in read_mo(path):
        en, de = en.strip(), de.strip()
        if en != de and is_sentence_like(en) and is_sentence_like(de):
            out.setdefault(en, de)
    return sorted(out.items())


def build_split(locale_dir: str, memory_catalog: str, family: str, memory_n: int, test_n: int, seed: int) -> dict:
    folder = Path(locale_dir)
    mem_path = folder / f"{memory_catalog}.mo"
    if not mem_path.is_file():
        sys.exit(f"no catalog {mem_path}")
    memory_all = catalog_pairs(mem_path)
    memory_en = {en for en, _ in memory_all} | {en for en, _ in read_mo(mem_path)}
    others: dict[str, tuple[str, str]] = {}
    catalogs = []
    for p in sorted(folder.glob(f"*{family}.mo")):
        if p == mem_path:
            continue
        pairs = [(en, de) for en, de in catalog_pairs(p) if en not in memory_en]
        catalogs.append({"catalog": p.name, "pairs": len(pairs)})
        for en, de in pairs:
            others.setdefault(en, (en, de))
    rng = random.Random(seed)
    memory = rng.sample(memory_all, min(memory_n, len(memory_all)))
    test_pool = sorted(others.values())
    test = rng.sample(test_pool, min(test_n, len(test_pool)))
    return {"memory": memory, "test": test,
            "info": {"locale_dir": str(folder), "memory_catalog": mem_path.name, "memory_pairs_available":
                     len(memory_all), "test_catalogs": catalogs, "test_pairs_available": len(test_pool),
                     "memory_n": len(memory), "test_n": len(test), "seed": seed}}


def write_jsonl(path: Path, pairs) -> str:
    text = "".join(json.dumps({"src": s, "tgt": t}, ensure_ascii=False) + "\n" for s, t in pairs)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


def build_main(a) -> int:
    from memories.build import grouped_heldout_split, heldout_split  # heavy: torch and the backbone

    split = build_split(a.locale_dir, a.memory_catalog, a.family, a.memory_n, a.test_n, a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = split["info"]
    info["memory_sha256"] = write_jsonl(out / "memory.jsonl", split["memory"])
    info["test_sha256"] = write_jsonl(out / "test.jsonl", split["test"])
    srcs = [s for s, _ in split["memory"]]
    tests = [s for s, _ in split["test"]]
    # how near the test is to the memory, beside the held-out samples of each kind of split (the build's defaults)
    for kind, held in (("random", heldout_split(len(srcs))), ("grouped", grouped_heldout_split(srcs)[0])):
        h = set(held.tolist())
        train = [s for i, s in enumerate(srcs) if i not in h]
        index = NgramIndex(train)
        info[f"{kind}_split"] = {"heldout": nearness_profile(index.nearest([srcs[i] for i in sorted(h)])[0]),
                                 "test": nearness_profile(index.nearest(tests)[0])}
        info[f"{kind}_split"]["transfer_check"] = transfer_check(train, [srcs[i] for i in sorted(h)], tests,
                                                                 index=index)["text"]
    (out / "split.json").write_text(json.dumps(info, indent=1, ensure_ascii=False), encoding="utf-8")
    print(json.dumps(info, indent=1, ensure_ascii=False))
    print(f"wrote {out / 'memory.jsonl'} ({info['memory_n']} pairs), {out / 'test.jsonl'} ({info['test_n']} pairs)")
    return 0


# --- the prompt measurement ---------------------------------------------------------------------------------------
def _load_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, ensure_ascii=False), encoding="utf-8")
    tmp.replace(path)


def prompts_main(a) -> int:
    from backbone.cli import load_backbone_from_args  # heavy
    from backbone.tasks import task_prompt  # heavy
    from engine import Row  # heavy
    from eval.metrics import bleu_chrf, paired_bootstrap  # heavy
    from eval.rank import memory_prompt  # heavy
    from eval.run import evaluate  # heavy
    from ground.store import Catalog, new_id  # heavy imports below: torch, the backbone and every method
    from memories.build import build_memory  # heavy
    from memories.parse import parse_samples_strict  # heavy
    from memories.store import Memory  # heavy
    from plugins.api import open_plugin, train_plugin  # heavy
    from plugins.settings import row_settings  # heavy

    folder = Path(a.split)
    state_path = folder / "state.json"
    state = _load_state(state_path)
    cat = Catalog(a.data_dir)
    bb = load_backbone_from_args(a)
    samples = parse_samples_strict((folder / "memory.jsonl").read_bytes(), "memory.jsonl")
    test_file = [(s.src, s.tgt) for s in parse_samples_strict((folder / "test.jsonl").read_bytes(), "test.jsonl")]
    key = "hyps" if a.on == "test" else "hyps_heldout"
    hyps: dict[str, list[str]] = {}
    result = {"backbone": bb.name, "precision": getattr(bb, "precision", None), "on": a.on, "rows": {}}
    chosen = [x.strip() for x in a.examples.split(",") if x.strip()]
    if not chosen or set(chosen) - set(EXAMPLES):
        sys.exit(f"--examples: a comma-separated choice of {', '.join(EXAMPLES)}")
    for ex in chosen:
        st = state.setdefault(ex, {})
        if not st.get("memory") or not Path(st["memory"]).is_dir():
            with progress_bar(f"memory ({ex})") as prog:
                mem = build_memory(bb, samples, cat.root / "memories" / new_id(), prompt=task_prompt("translation", bb),
                                   examples="given" if ex == "builtin" else "own", name=f"domain-shift {ex} examples",
                                   progress=prog, catalog=cat)
            st["memory"] = str(mem.path)
            st.pop("plugin", None)
            _save_state(state_path, state)
        mem = Memory.load(st["memory"])
        if not st.get("plugin") or not Path(st["plugin"]).is_dir():
            t0 = time.time()
            with progress_bar(f"pema ({ex})") as prog:
                plugin, row = train_plugin(bb, mem, "pema", {}, catalog=cat, progress=prog)
            st["plugin"], st["train_seconds"] = str(plugin.plugin_path), round(time.time() - t0, 1)
            st.pop("hyps", None), st.pop("hyps_heldout", None)
            _save_state(state_path, state)
        plugin = open_plugin(st["plugin"], bb)
        settings = row_settings(plugin, "translation", bb.name, calibrated=False)  # the global tuned defaults
        test = [(s["src"], s["tgt"]) for s in mem.split_samples("heldout")] if a.on == "heldout" else test_file
        test = test[:a.n] if a.n else test  # held-out: the same in both memories (the split reads sources only)
        sources = [x for x, _ in test]
        if not st.get(key) or len(st[key]["base"]) != len(test) or st.get(key + "_sources", sources) != sources:
            prompt = memory_prompt(mem, bb, "translation")
            with progress_bar(f"decode ({ex})") as prog:
                res = evaluate(bb, test, [Row("base"), Row("pema", plugin, settings)], prompt, "translation",
                               batch_sources=a.batch, progress=prog, bootstrap=0)
            st[key] = {m["label"]: [o[m["label"]] for o in res["outputs"]] for m in res["methods"]}
            st[key + "_sources"] = sources
            st[key.replace("hyps", "decode_seconds")] = res["seconds"]
            _save_state(state_path, state)
        for label in ("base", "pema"):
            hyps[f"{label} · {ex}"] = st[key][label]
        result["rows"][ex] = {"memory": mem.id, "prompt_examples": mem.prompt_examples,
                              "plugin": Path(st["plugin"]).name,
                              "settings": settings, "train_seconds": st.get("train_seconds"),
                              "train_info": json.loads((Path(st["plugin"]) / "plugin_config.json").read_text())
                              .get("train_info") if (Path(st["plugin"]) / "plugin_config.json").is_file() else None}
    result["n"] = len(test)
    refs = [t for _, t in test]
    scores = {k: bleu_chrf(v, refs) for k, v in hyps.items()}
    pairs = [(x, y) for x, y in [("base · builtin", "pema · builtin"), ("base · own", "pema · own"),
                                  ("base · builtin", "base · own"), ("pema · builtin", "pema · own")]
             if x in hyps and y in hyps]
    result["scores"] = scores
    result["differences"] = []
    for x, y in pairs:
        pb = paired_bootstrap(hyps[x], hyps[y], refs, n_samples=a.bootstrap)
        result["differences"].append({"from": x, "to": y, **{k: {"delta": pb[k]["delta"], "p": pb[k]["p_value"]}
                                                             for k in ("sacrebleu", "chrf")}})
    result["hyps"] = hyps
    print("row | sacreBLEU | chrF")
    for k, v in scores.items():
        print(f"{k} | {v['sacrebleu']:.2f} | {v['chrf']:.2f}")
    print("difference | ΔBLEU (one-sided p) | ΔchrF (one-sided p)")
    for d in result["differences"]:
        print(f"{d['to']} − {d['from']} | {d['sacrebleu']['delta']:+.2f} ({d['sacrebleu']['p']:.3f}) | "
              f"{d['chrf']['delta']:+.2f} ({d['chrf']['p']:.3f})")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, ensure_ascii=False), encoding="utf-8")
        print(f"wrote {a.json}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks domain-shift", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the memory and test pairs of a domain-shift split")
    b.add_argument("--out", required=True, help="folder for memory.jsonl, test.jsonl, split.json (not the repo)")
    b.add_argument("--locale-dir", default=DEFAULT_LOCALE_DIR)
    b.add_argument("--memory-catalog", default="postgres-15", help="the program the memory comes from")
    b.add_argument("--family", default="-15", help="the product's catalogs: names ending so (before .mo)")
    b.add_argument("--memory-n", type=int, default=1000)
    b.add_argument("--test-n", type=int, default=150)
    b.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("prompts", help="PEMA with the built-in vs the memory's own prompt examples")
    p.add_argument("--split", required=True, help="a folder written by `build`")
    p.add_argument("--n", type=int, default=None, help="pairs used (default all)")
    p.add_argument("--examples", default=",".join(EXAMPLES),
                   help="which memories to build, train and decode (default both; an interrupted or split run "
                        "reuses state.json)")
    p.add_argument("--on", default="test", choices=["test", "heldout"],
                   help="decode the test file (default) or the memory's own held-out samples (in-domain)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--json")
    add_common(p)
    a = ap.parse_args(argv)
    return build_main(a) if a.cmd == "build" else prompts_main(a)


if __name__ == "__main__":
    sys.exit(main())
