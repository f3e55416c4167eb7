"""``python -m eval``: score methods on held-out data (sacreBLEU, chrF, task metrics) as a table and JSON.

Examples::

    # base vs PEMA vs kNN on 200 untouched WMT dev pairs (items 1000-1199)
    python -m eval run --task translation --split dev --start 1000 --n 200 --plugin <pema-id> --plugin <knn-id>
    # your own test file of pairs (JSONL / CSV / TSV)
    python -m eval run --test-file pairs.jsonl --plugin <id> --json results.json
    # a memory's held-out samples
    python -m eval run --memory <memory-id> --plugin <id>
    # λ_max sweep with and without Gradual Unrolling for a PEMA plug-in
    python -m eval sweep --plugin <pema-id> --n 50
    # tune an interpolating plug-in (PEMA, kNN) on its memory's held-out samples; Compare/Evaluate/CLI start there
    python -m eval calibrate <plugin-id>
    python -m eval run --memory <memory-id> --plugin <id> --global-defaults   # not at the calibrated settings
    # train (or reuse), calibrate and rank every registered method on a memory's held-out report samples
    python -m eval rank <memory-id> --json leaderboard.json
    python -m eval rank <memory-id> --methods pema,knn,adapter --test pairs.jsonl
    # the same, its trainings at once as Ray tasks: a local cluster of 2 CPUs, or an existing cluster (docs/ray.md)
    python -m eval rank <memory-id> --workers 2
    python -m eval rank <memory-id> --ray-address auto
    # offsite: base, PEMA and kNN rows through a model owner's service (python -m offsite serve)
    PEMA_REMOTE_TOKEN=... python -m eval run --memory <memory-id> --plugin <pema-id> --remote http://owner:8765
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import ground

if sys.argv[1:2] == ["rank"]:  # trainings, then evaluations: OpenMP threads spin briefly before sleeping (ground)
    ground.spin_briefly()  # before torch loads, i.e. before the imports below

from backbone.cli import load_backbone_from_args  # noqa: E402
from backbone.model import DEFAULT_BACKBONE  # noqa: E402
from backbone.prompts import Prompt  # noqa: E402
from backbone.tasks import task_prompt  # noqa: E402
from engine import Row  # noqa: E402
from eval import datasets  # noqa: E402
from eval.calibrate import calibrate, describe_choice  # noqa: E402
from eval.rank import format_leaderboard, rank  # noqa: E402
from eval.run import evaluate, format_table, lambda_sweep  # noqa: E402
from eval.style import train_shakespeare_classifier  # noqa: E402
from ground.cli import add_common, progress_bar, run_main  # noqa: E402
from ground.errors import UserError  # noqa: E402
from ground.store import Catalog  # noqa: E402
from memories.parse import parse_samples_strict  # noqa: E402
from offsite.cli import add_remote, remote_backbone_from_args  # noqa: E402
from offsite.decode import decode_batch_remote, open_offsite_plugin  # noqa: E402
from plugins.__main__ import plugin_rows, tuned_lines  # noqa: E402
from plugins.api import open_memory, open_plugin, plugin_folder  # noqa: E402
from plugins.settings import parse_sets, plugin_calibration  # noqa: E402
from studio.ray_executor import RayExecutor  # noqa: E402


def load_pairs(args, catalog) -> list[tuple[str, str | None]]:
    """Evaluation pairs from a test file, a memory's held-out split, or the shared reference data."""
    if args.test_file:
        path = Path(args.test_file)
        if not path.exists():
            raise UserError(f"No such file: {path}")
        samples = parse_samples_strict(path.read_bytes(), path.name)
        pairs = [(s.src, s.tgt) for s in samples] if all(s.src for s in samples) else [(s.tgt, None) for s in samples]
        start = args.start or 0  # a test file starts at its first pair
        if start >= len(pairs):
            raise UserError(f"--start {start} is past the end of {path.name} ({len(pairs)} pairs).")
        return pairs[start:start + args.n] if args.n else pairs[start:]
    if args.memory:
        mem = open_memory(args.memory, catalog=catalog)
        return [(s["src"], s["tgt"]) for s in mem.split_samples("heldout")][: args.n or None]

    start = 1000 if args.start is None else args.start  # the reference dev data: after the tuning items
    if args.task == "style":  # plain modern English inputs (the WMT English side); no references
        return [(en, None) for en, _ in datasets.wmt_pairs(args.split, start, args.n)]
    return datasets.task_pairs(args.task, args.split, start, args.n)


def calibrate_main(args, cat) -> int:
    """``python -m eval calibrate``: tune one plug-in on its memory's held-out tuning samples and store it."""
    bb = load_backbone_from_args(args)
    plugin = open_plugin(args.plugin, bb, cat)
    mref = plugin.memory_meta.get("path") or plugin.memory_meta.get("id")
    if args.memory:
        mref = args.memory
    if not mref:
        raise UserError("This plug-in does not name its memory; give it with --memory.")
    mem = open_memory(mref, bb, catalog=cat)
    with progress_bar("calibrate") as prog:
        cal = calibrate(bb, plugin, mem, max_samples=args.n, max_seconds=args.max_seconds, progress=prog,
                        max_new_tokens=args.max_new_tokens)
    if cal is None:
        raise UserError(f"{plugin.title} does not mix distributions; there is nothing to calibrate.")
    rows = [{"settings": json.dumps({k: v for k, v in r["settings"].items()}), "chrF": r["chrf"],
             "sacreBLEU": r["bleu"], "changed": r.get("changed", 0)} for r in cal["table"]]
    width = max(len(r["settings"]) for r in rows)
    print(f"{'settings'.ljust(width)} | chrF   | BLEU   | outputs changed vs base")
    for r in rows:
        print(f"{r['settings'].ljust(width)} | {r['chrF']:6.2f} | {r['sacreBLEU']:6.2f} | {r['changed']}")
    print(f"\n{cal['label']} ({cal['seconds']:.0f} s, {cal['forwards_per_sample']} forward passes per sample"
          f"{', stopped by the time budget' if cal['stopped_by_time'] else ''}): {describe_choice(cal)}")
    print(f"stored in {plugin_folder(args.plugin, cat) / 'calibration.json'}")
    if args.json:
        Path(args.json).write_text(json.dumps(cal, indent=1, ensure_ascii=False), encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def rank_main(args, cat) -> int:
    """``python -m eval rank``: the leaderboard as a table, the verdict and the phases' wall times."""
    bb = load_backbone_from_args(args)
    mem = open_memory(args.memory, bb, catalog=cat)
    test_pairs = None
    if args.test:
        path = Path(args.test)
        if not path.exists():
            raise UserError(f"No such file: {path}")
        samples = parse_samples_strict(path.read_bytes(), path.name)
        test_pairs = [(s.src, s.tgt) for s in samples if s.src]
        if not test_pairs:
            raise UserError(f"{path.name} has no source/reference pairs.")
    configs: dict = {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        method, _, name = key.partition(".")
        if not name or not _:
            raise UserError(f"--set {item!r}: write METHOD.NAME=VALUE, e.g. pema.max_minutes=2.")
        configs.setdefault(method.strip(), {}).update(parse_sets([f"{name.strip()}={value}"]))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    executor = rank_executor(args)
    try:
        trainer = None
        if executor is not None:
            spec = {"name": args.backbone or DEFAULT_BACKBONE, "device": args.device, "dtype": args.dtype,
                    "data_dir": str(cat.root), "fingerprint": bb.fingerprint}
            trainer = executor.rank_trainer(spec)
            where = args.ray_address or f"a local Ray cluster of {args.workers} CPU(s)"
            print(f"training on {trainer.slots()} Ray worker(s) at {where}", file=sys.stderr)
        with progress_bar("rank") as prog:
            board = rank(bb, mem, catalog=cat, methods=methods, configs=configs, test_pairs=test_pairs,
                         test_name=Path(args.test).name if args.test else None, n_tune=args.tune,
                         max_new_tokens=args.max_new_tokens, batch_sources=args.batch, progress=prog,
                         log=lambda line: print(line, file=sys.stderr), trainer=trainer)
    finally:
        if executor is not None:
            executor.close()  # shuts Ray down when this process started it
    print(format_leaderboard(board))
    if args.json:
        Path(args.json).write_text(json.dumps(board, indent=1, ensure_ascii=False), encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def rank_executor(args):
    """``--workers N`` / ``--ray-address``: the Ray executor the rank trains on (None: in this process). Without an
    address, a local Ray cluster of N CPUs, one training per CPU (on a machine with GPUs, N trainings share each
    GPU); with one, that cluster, N trainings at a time (default: one per GPU, else per CPU)."""
    if args.workers is None and not args.ray_address:
        return None
    if args.workers is not None and args.workers < 1:
        raise UserError("--workers must be 1 or more.")
    if args.ray_address:
        return RayExecutor(args.ray_address, training_slots=args.workers).start()
    ex = RayExecutor(num_cpus=args.workers).start()
    if ex.gpus():
        ex.gpus_per_training = ex.gpus() / args.workers
    return ex


def untuned_pairs(args, cat, plugins, pairs) -> list:
    """``--memory``'s held-out pairs without those a plug-in was calibrated on (a calibrated setting is never
    scored on its own tuning samples); says how many were left out."""
    mem = open_memory(args.memory, catalog=cat)
    tuned: set = set()
    for p in plugins:
        cal = plugin_calibration(p)
        if cal and cal.get("memory_id") == mem.id:
            tuned |= set(cal.get("sample_ids") or [])
    if not tuned:
        return pairs
    held = [(s["src"], s["tgt"]) for i, s in enumerate(mem.samples) if s["split"] == "heldout" and i not in tuned]
    print(f"left out the {len(tuned)} held-out samples the plug-ins were calibrated on; {len(held)} remain",
          file=sys.stderr)
    if not held:
        raise UserError("Every held-out sample was used to calibrate; use --global-defaults or --test-file.")
    return held[: args.n or None]


def style_extra(task: str, bb_name: str) -> dict:
    if task != "style":
        return {}

    return {"style_classifier": train_shakespeare_classifier()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "sweep"):
        p = sub.add_parser(name, help="score methods" if name == "run" else "λ_max sweep with/without GU")
        p.add_argument("--task", default="translation", choices=["translation", "formality", "style"])
        p.add_argument("--split", default="dev", choices=["train", "dev"])
        p.add_argument("--start", type=int, default=None,
                       help="first item (default: 1000 of the reference data, after the tuning items; "
                            "0 of a test file)")
        p.add_argument("--n", type=int, default=200)
        p.add_argument("--test-file", help="your own pairs (JSONL/CSV/TSV) instead of the reference data")
        p.add_argument("--memory", help="evaluate on this memory's held-out samples")
        p.add_argument("--plugin", action="append", default=[], help="plug-in id or folder (repeatable)")
        p.add_argument("--set", action="append", metavar="[METHOD.]NAME=VALUE",
                       help="decode-time setting of one method's rows, e.g. pema.lambda_max=0.5 (repeatable)")
        p.add_argument("--shots", type=int, default=None)
        p.add_argument("--batch", type=int, default=4, help="sentences per batched decode")
        p.add_argument("--max-new-tokens", type=int, default=96)
        p.add_argument("--global-defaults", action="store_true",
                       help="decode every plug-in at the global defaults, not at the settings calibrated on its "
                            "memory (python -m eval calibrate)")
        p.add_argument("--json", help="also write the results (metrics + outputs) to this JSON file")
        add_remote(p, decode=True)  # offsite: base, PEMA and kNN rows through a model owner's service
        add_common(p)
    c = sub.add_parser("calibrate", help="tune an interpolating plug-in's decode settings on its memory's held-out "
                                         "samples (stored with it; Compare, Evaluate and the CLI start there)")
    c.add_argument("plugin", help="plug-in id or folder")
    c.add_argument("--memory", help="the plug-in's memory (id or folder), when it cannot be found from the plug-in")
    c.add_argument("--n", type=int, default=None, help="tuning samples at most (default: eval.calibrate's "
                                                       "DEFAULT_TUNE, and at most half of the held-out samples)")
    c.add_argument("--max-seconds", type=float, default=None,
                   help="time budget (default: none, every tuning sample); checked between samples, "
                        "never before eval.calibrate's MIN_TUNE")
    c.add_argument("--max-new-tokens", type=int, default=96)
    c.add_argument("--json", help="also write the calibration (with its table) to this JSON file")
    add_common(c)
    r = sub.add_parser("rank", help="train, calibrate and rank every method on a memory (leaderboard + verdict)")
    r.add_argument("memory", help="memory id (python -m memories list) or folder")
    r.add_argument("--methods", help="comma-separated methods (default: every registered method)")
    r.add_argument("--test", help="report on this test file of pairs (JSONL/CSV/TSV) instead of the held-out "
                                  "report part")
    r.add_argument("--tune", type=int, default=None, help="held-out samples that tune the interpolating methods "
                                                          "(default: eval.calibrate's)")
    r.add_argument("--set", action="append", metavar="METHOD.NAME=VALUE",
                   help="a training setting of one method instead of its default, e.g. pema.max_minutes=2 "
                        "(repeatable)")
    r.add_argument("--batch", type=int, default=4, help="sentences per batched decode")
    r.add_argument("--max-new-tokens", type=int, default=96)
    r.add_argument("--json", help="also write the leaderboard to this JSON file")
    r.add_argument("--workers", type=int, default=None,
                   help="train the methods at once as Ray tasks, N at a time: a local Ray cluster of N CPUs, or "
                        "--ray-address's cluster (docs/ray.md); calibration and evaluation stay here")
    r.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster to train on (host:6379, ray://host:10001, auto)")
    add_common(r)
    args = ap.parse_args(argv)

    cat = Catalog(args.data_dir)
    if args.cmd == "rank":
        return rank_main(args, cat)
    if args.cmd == "calibrate":
        return calibrate_main(args, cat)
    pairs = load_pairs(args, cat)
    bb = remote_backbone_from_args(args) if args.remote else load_backbone_from_args(args)
    plugins = [(open_offsite_plugin if args.remote else open_plugin)(p, bb, cat) for p in args.plugin]
    decode = {"decode": partial(decode_batch_remote, lm=args.remote_lm)} if args.remote else {}
    prompt = task_prompt(args.task, bb, shots=args.shots)
    meta = (getattr(plugins[0], "memory_meta", None) or {}) if plugins else {}
    if args.memory and not args.test_file and args.shots is None and meta.get("prompt") \
            and meta.get("task", args.task) == args.task:
        # its own held-out split is read with the memory's own examples, as its calibration and the studio's
        # Evaluate read it (the first plug-in's memory, else the built-in examples): the same sentences, the same scores
        prompt = Prompt.from_dict(meta["prompt"])
        print(f"prompt: the memory's own examples ({len(prompt.examples)})", file=sys.stderr)
    extra = style_extra(args.task, bb.name)
    if args.cmd == "run":
        rows = [Row("base")] + plugin_rows(plugins, args.task, bb.name, args.set,
                                           calibrated=not args.global_defaults)
        if args.memory and not args.test_file and not args.global_defaults:
            pairs = untuned_pairs(args, cat, plugins, pairs)
        for line in tuned_lines(rows, not args.global_defaults):
            print(line, file=sys.stderr)
        with progress_bar("eval") as prog:
            res = evaluate(bb, pairs, rows, prompt, args.task, batch_sources=args.batch,
                           max_new_tokens=args.max_new_tokens, progress=prog, extra=extra, **decode)
        print(format_table(res["methods"]))
        print(f"\n{res['n']} items, {res['seconds']}s, {res['tokens']} tokens decoded "
              f"({res['tokens_per_second']} tokens/s, all rows of a batch counted), backbone {bb.name}")
    else:
        pema = [p for p in plugins if p.method == "pema"]
        if not pema:
            raise UserError("sweep needs a PEMA plug-in (--plugin <pema-id>).")
        with progress_bar("sweep") as prog:
            row = plugin_rows(pema[:1], args.task, bb.name, args.set, calibrated=not args.global_defaults)[0]
            res = {"sweep": lambda_sweep(bb, pairs, pema[0], prompt, task=args.task, progress=prog, extra=extra,
                                         settings=row.settings, comparison=row.comparison, batch_sources=args.batch,
                                         max_new_tokens=args.max_new_tokens, **decode)}
        for r in res["sweep"]:
            print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, ensure_ascii=False), encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    run_main(main)
