"""``python -m memories``: build, list, inspect and delete external memories.

Examples::

    python -m memories build ../shared/data/wmt22-en-de/train.jsonl --limit 1000 --name wmt1k
    python -m memories build my_style.txt --task style          # monolingual: synthetic sources
    python -m memories build --corpus gettext-de --limit 2000   # a demo corpus shipped by installed packages
    python -m memories build --dataset wmt/wmt19 --dataset-config de-en --src-field en --tgt-field de --limit 5000
    python -m memories build --dataset pairs.parquet --src-field en --tgt-field de   # local: works offline
    python -m memories list
    python -m memories inspect <id> --samples 5
    python -m memories delete <id>
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ground

if sys.argv[1:2] == ["build"]:  # a memory build: OpenMP threads spin briefly before sleeping (ground)
    ground.spin_briefly()  # before torch loads, i.e. before the imports below

from backbone.cli import load_backbone_from_args  # noqa: E402
from backbone.prompts import Prompt  # noqa: E402
from backbone.tasks import task_prompt  # noqa: E402
from ground.cli import add_common, dump_json, print_table, progress_bar, run_main  # noqa: E402
from ground.errors import UserError  # noqa: E402
from ground.store import Catalog, new_id  # noqa: E402
from ground.text import printable  # noqa: E402
from memories.build import build_memory  # noqa: E402
from memories.corpora import available_corpora, load_corpus  # noqa: E402
from memories.datasets_source import load_dataset_samples, record_source  # noqa: E402
from memories.nearness import profile_text  # noqa: E402
from memories.parse import parse_samples_strict, samples_from_dicts  # noqa: E402
from offsite.cli import add_remote, remote_backbone_from_args  # noqa: E402
from plugins.api import open_memory  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memories", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build a memory from a file of samples or a demo corpus")
    b.add_argument("file", nargs="?", help="JSONL ({src,tgt} / {en,de} / {text}), CSV/TSV, or plain text")
    b.add_argument("--corpus", help="a demo corpus instead of a file (see `python -m memories corpora`)")
    b.add_argument("--dataset", metavar="NAME_OR_PATH",
                   help="a 🤗 datasets source instead of a file: a Hub id (needs network), or a local Parquet, "
                        "Arrow, CSV/TSV or JSON/JSONL file (or save_to_disk folder); streamed, --limit honoured")
    b.add_argument("--dataset-config", default=None, help="the dataset's configuration (e.g. de-en)")
    b.add_argument("--split", default="train", help="the dataset's split (default train)")
    b.add_argument("--src-field", default=None, help="source column (translation.en and nested en both work)")
    b.add_argument("--tgt-field", default=None, help="target column (alone: monolingual samples)")
    b.add_argument("--text-field", default=None, help="the text column of a monolingual dataset")
    b.add_argument("--format", default="auto", choices=["auto", "jsonl", "csv", "tsv", "text"])
    b.add_argument("--task", default="translation", help="translation, formality, style (sets the prompt)")
    b.add_argument("--template", help="your own prompt template with a {src} slot (overrides --task's)")
    b.add_argument("--shots", type=int, default=None,
                   help="few-shot examples in the prompt (default: the task's tuned value, else 3)")
    b.add_argument("--paper-template", action="store_true", default=None,
                   help="use the PEMA paper's Table 9 instruction (default: the task's tuned prompt format)")
    b.add_argument("--builtin-examples", action="store_true",
                   help="keep the task's built-in few-shot examples (default: the memory's own training samples, "
                        "when it has enough)")
    b.add_argument("--mode", default="teacher", choices=["teacher", "offsite"])
    b.add_argument("--limit", type=int, default=None, help="use the first N samples")
    b.add_argument("--skip-invalid", action="store_true", help="skip bad lines instead of stopping")
    b.add_argument("--heldout", type=float, default=0.1, help="held-out fraction (default 0.1)")
    b.add_argument("--key-dtype", default="float16", choices=["float16", "float32"])
    b.add_argument("--batch-size", type=int, default=8)
    b.add_argument("--name", default="")
    add_common(b)
    add_remote(b)
    ls = sub.add_parser("list", help="list memories")
    ls.add_argument("--json", action="store_true")
    add_common(ls, backbone=False)
    ins = sub.add_parser("inspect", help="show a memory's statistics and samples")
    ins.add_argument("id")
    ins.add_argument("--samples", type=int, default=3)
    add_common(ins, backbone=False)
    de = sub.add_parser("delete", help="delete a memory")
    de.add_argument("id")
    add_common(de, backbone=False)
    co = sub.add_parser("corpora", help="list the demo corpora available on this machine")
    add_common(co, backbone=False)
    args = ap.parse_args(argv)

    cat = Catalog(args.data_dir)
    if args.cmd == "build":
        return _build(args, cat)
    if args.cmd == "list":
        rows = cat.memories()
        if args.json:
            dump_json(rows)
        else:
            print_table([{**{k: printable(v) for k, v in r.items()}, "MB": f"{(r['bytes'] or 0) / 1e6:.1f}"}
                         for r in rows], ["id", "name", "backbone", "task", "mode", "samples", "entries", "MB"])
        return 0
    if args.cmd == "inspect":
        m = open_memory(args.id, catalog=cat)
        dump_json({**m.summary(), "name": printable(m.summary()["name"]), "prompt": m.meta["prompt"],
                   "prompt_examples": m.prompt_examples, "split": m.split,
                   "stats": m.meta["stats"], "path": str(m.path)})
        print(profile_text(m.split["heldout_profile"], "Held-out sources") + f" ({m.split['method']} split"
              + (f"; {m.split['note']}" if m.split.get("note") else "") + ")")
        for s in m.samples[: args.samples]:
            print(f"[{s['split']}] {s['src']!r} -> {s['tgt']!r}{' (synthetic source)' if s['synthetic_src'] else ''}")
        return 0
    if args.cmd == "delete":
        if cat.memory(args.id) is None:
            raise UserError(f"No memory {args.id!r}.")
        cat.delete_memory(args.id)
        print(f"deleted {printable(args.id)}")
        return 0
    if args.cmd == "corpora":
        for k, v in available_corpora().items():
            print(f"{k}: {v}")
        return 0
    return 1


def _build(args, cat) -> int:
    source = None
    if args.corpus:
        samples = samples_from_dicts(load_corpus(args.corpus, args.limit))
        label = args.corpus
    elif args.dataset:
        if args.file:
            raise UserError("Give a file of samples or --dataset, not both.")
        with progress_bar("dataset") as prog:
            samples, source = load_dataset_samples(
                args.dataset, args.split, config=args.dataset_config,
                src_field=None if args.text_field and not args.tgt_field else args.src_field,
                tgt_field=args.tgt_field or args.text_field, limit=args.limit, skip_invalid=args.skip_invalid,
                progress=prog)
        label = Path(source["dataset"]).stem if not source["hub"] else source["dataset"]
    elif args.file:
        path = Path(args.file)
        if not path.exists():
            raise UserError(f"No such file: {path}")
        samples = parse_samples_strict(path.read_bytes(), path.name, args.format, args.skip_invalid)
        label = path.stem
    else:
        raise UserError("Give a file of samples, --dataset NAME_OR_PATH or --corpus NAME.")
    if args.limit:
        samples = samples[: args.limit]
    bb = remote_backbone_from_args(args) if args.remote else load_backbone_from_args(args)
    prompt = _prompt(args, bb)
    out = cat.root / "memories" / new_id()
    with progress_bar("memory") as prog:
        mem = build_memory(bb, samples, out, prompt=prompt, task=args.task, mode=args.mode,
                           examples="given" if args.builtin_examples else "own",
                           name=args.name or label, key_dtype=args.key_dtype, heldout_frac=args.heldout,
                           batch_size=args.batch_size, progress=prog, catalog=cat)  # folder + row: one step
    if source is not None:
        record_source(mem.path, source)  # where the samples came from (a plug-in's model card names it)
    s = mem.summary()
    print(f"memory {mem.id}: {s['entries']} entries from {s['samples']} samples "
          f"(+{s['heldout_samples']} held out) in {mem.meta['stats']['build_seconds']}s -> {mem.path}")
    return 0


def _prompt(args, bb):
    if args.template:
        return Prompt(template=args.template.replace("\\n", "\n"), chat=bb.chat)
    return task_prompt(args.task, bb, shots=args.shots, paper=args.paper_template)


if __name__ == "__main__":
    run_main(main)
