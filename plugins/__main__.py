"""``python -m plugins``: train plug-ins on a memory, list them, and compare methods on a sentence.

Examples::

    python -m plugins methods                                   # every method with its paper defaults
    python -m plugins train <memory-id> --method pema           # paper defaults, progress bar
    python -m plugins train <memory-id> --method pema --set rank=256 --set kappa=0.3
    python -m plugins train <memory-id> --method pema --preset paper   # the public code's values (or: quick)
    python -m plugins train <memory-id> --method knn
    python -m plugins list
    python -m plugins compare "The house is small." --plugin <pema-id> --plugin <knn-id> \\
        --set lambda_max=0.9 --set k=8
    python -m plugins compare "..." --plugin <id> --json         # outputs + per-token traces as JSON
    python -m plugins compare "..." --plugin <id> --global-defaults   # not the settings calibrated on its memory
    python -m plugins export <id> out/my-plugin --eval results.json   # folder + model card (+ PEFT files for LoRA)
    python -m plugins import out/my-plugin                      # or a Hub repo id: owner/name
    python -m plugins push <id> owner/my-plugin                 # needs network and an HF token
"""
from __future__ import annotations

import argparse
import json
import sys

import ground

if sys.argv[1:2] == ["train"]:  # a training process: OpenMP threads spin briefly before sleeping (ground)
    ground.spin_briefly()  # before torch loads, i.e. before the imports below

from backbone.cli import load_backbone_from_args  # noqa: E402
from backbone.model import CPU_FLOAT16_TAG, FINGERPRINT_TAGS, PRECISIONS, resolve_name  # noqa: E402
from backbone.prompts import TASKS, Prompt  # noqa: E402
from backbone.tasks import task_prompt  # noqa: E402
from engine import Row, compare  # noqa: E402
from ground.cli import add_common, dump_json, print_table, progress_bar, run_main  # noqa: E402
from ground.errors import UserError  # noqa: E402
from ground.store import Catalog  # noqa: E402
from ground.text import printable  # noqa: E402
from offsite.cli import add_remote, remote_backbone_from_args  # noqa: E402
from offsite.decode import check_offsite_method, compare_remote, open_offsite_plugin  # noqa: E402
from plugins.api import method_table, open_memory, open_plugin, plugin_folder, train_plugin  # noqa: E402
from plugins.estimate import estimate  # noqa: E402
from plugins.hub import export_plugin, import_plugin, load_evaluation, push_plugin  # noqa: E402
from plugins.registry import get_method  # noqa: E402
from plugins.settings import (  # noqa: E402
    address_sets,
    calibration_label,
    describe_changes,
    load_calibration,
    method_row,
    parse_sets,
    plugin_calibration,
    preset_values,
    presets_table,
    resolve_row_settings,
    tuned_decode_settings,
    tuned_start_changes,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m plugins", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("methods", help="list the methods with their defaults")
    m.add_argument("--json", action="store_true")
    m.add_argument("--backbone", default=None, help="whose tuned start values to list (default: the default "
                   "backbone); nothing is loaded")
    t = sub.add_parser("train", help="train a plug-in on a memory")
    t.add_argument("memory", help="memory id (python -m memories list) or folder")
    t.add_argument("--method", required=True)
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    t.add_argument("--preset", default=None, help="start from a named preset of the method: default (what ships), "
                                                  "paper, quick (see 'python -m plugins methods'); --set wins")
    t.add_argument("--name", default="")
    add_common(t)
    add_remote(t)
    ls = sub.add_parser("list", help="list plug-ins")
    ls.add_argument("--json", action="store_true")
    add_common(ls, backbone=False)
    de = sub.add_parser("delete", help="delete a plug-in")
    de.add_argument("id")
    add_common(de, backbone=False)
    c = sub.add_parser("compare", help="decode a sentence with several methods side by side (one batch)")
    c.add_argument("sentence")
    c.add_argument("--plugin", action="append", default=[], help="plug-in id or folder (repeatable)")
    c.add_argument("--no-base", action="store_true", help="leave out the base model row")
    c.add_argument("--task", default=None, help="translation, formality, style (default: the memory's)")
    c.add_argument("--shots", type=int, default=None)
    c.add_argument("--set", action="append", metavar="[METHOD.]NAME=VALUE",
                   help="decode-time setting of one method's rows (pema.lambda_max=0.5, knn.k=8; a plug-in id "
                        "instead of the method addresses one row; a bare NAME only when one method has it); "
                        "see 'python -m plugins methods' (repeatable)")
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--beams", type=int, default=1)
    c.add_argument("--global-defaults", action="store_true",
                   help="start every plug-in at the global defaults, not at the settings calibrated on its memory's "
                        "held-out samples (python -m eval calibrate)")
    c.add_argument("--json", action="store_true")
    add_common(c)
    add_remote(c, decode=True)
    ex = sub.add_parser("export", help="write a plug-in as a self-contained folder with a model card (Hub package)")
    ex.add_argument("id", help="plug-in id or folder")
    ex.add_argument("dir", help="output folder (must be new or empty)")
    _add_package_args(ex)
    ex.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    add_common(ex)
    im = sub.add_parser("import", help="register an exported plug-in folder or Hub repository in the catalog")
    im.add_argument("source", help="exported folder, or Hub repo id (owner/name)")
    im.add_argument("--name", default="", help="catalog name (default: the package's)")
    im.add_argument("--revision", default=None, help="Hub branch, tag or commit")
    add_common(im)
    pu = sub.add_parser("push", help="export a plug-in and upload it to a Hugging Face Hub model repository")
    pu.add_argument("id", help="plug-in id or folder")
    pu.add_argument("repo_id", help="owner/name (created if needed; token from `hf auth login` or $HF_TOKEN)")
    pu.add_argument("--private", action="store_true")
    _add_package_args(pu)
    add_common(pu)
    args = ap.parse_args(argv)

    if args.cmd == "methods":
        rows = method_table()
        bb_name = resolve_name(args.backbone)
        if args.json:
            dump_json(rows)
        else:
            for r in rows:
                print(f"{r['method']:16s} {r['title']}  [{r['level']}]\n    {r['paper']}\n"
                      f"    config: {json.dumps(r['config'])}")
                for name, p in presets_table(get_method(r["method"]).Config).items():
                    if p["values"]:
                        print(f"    --preset {name}: {json.dumps(p['values'])} ({p['about']})")
                for d in r["decode_settings"]:
                    print(f"    decode {r['method']}.{d['name']} = {d['default']!r} ({d['type']}, "
                          f"{'live, ' if d['live'] else ''}{_range(d)}): {d['help']}")
                declared = {d["name"]: d["default"] for d in r["decode_settings"]}
                starts = {task: tuned_decode_settings(r["method"], task, bb_name) for task in TASKS}
                changes = describe_changes(tuned_start_changes(declared, starts))
                if changes:
                    print(f"    a comparison on {bb_name} starts at the values tuned on dev data: {changes}")
        return 0
    cat = Catalog(args.data_dir)
    if args.cmd == "list":
        rows = [{**r, "status": plugin_status(r), "calibrated": calibration_label(load_calibration(r["path"])) or "-"}
                for r in cat.plugins()]
        if args.json:
            dump_json(rows)
        else:
            print_table([{k: printable(v) for k, v in r.items()} for r in rows],
                        ["id", "name", "method", "memory_id", "backbone", "params", "status", "calibrated"])
        return 0
    if args.cmd == "delete":
        if cat.plugin(args.id) is None:
            raise UserError(f"No plug-in {args.id!r}.")
        cat.delete_plugin(args.id)
        print(f"deleted {args.id}")
        return 0
    if args.cmd == "train":
        if args.remote:
            check_offsite_method(args.method)  # in-network methods need the owner's decoder: refused first
        bb = remote_backbone_from_args(args) if args.remote else load_backbone_from_args(args)
        mem = open_memory(args.memory, bb, cat)
        overrides = {**preset_values(get_method(args.method).Config, args.preset), **parse_sets(args.set)}
        est = estimate(args.method, overrides, bb.name, len(mem.split_samples("train")), len(mem))
        print(f"time estimate: {est['text']}")
        with progress_bar(args.method) as prog:
            plugin, row = train_plugin(bb, mem, args.method, overrides, catalog=cat, name=args.name,
                                       progress=prog)
        print(f"plug-in {row['id']} ({args.method}, {row['params']:,} trainable parameters) -> {row['path']}")
        print(json.dumps(plugin.train_info, default=str, indent=1))
        return 0
    if args.cmd == "compare":
        return _compare(args, cat)
    if args.cmd in ("export", "import", "push"):
        return _package(args, cat)
    return 1


def _add_package_args(p) -> None:
    p.add_argument("--eval", default=None, metavar="FILE",
                   help="results of `python -m eval run --json FILE` for the card's evaluation table")
    p.add_argument("--include-datastore", action="store_true",
                   help="put the memory's training keys, values and samples in the package (needed for kNN; "
                        "it is your training data)")


def _package(args, cat) -> int:
    """export / import / push (``plugins.hub``)."""
    ev = load_evaluation(args.eval) if getattr(args, "eval", None) else None
    if args.cmd in ("export", "push"):
        plugin_backbone_args(args, cat)
    bb = load_backbone_from_args(args)
    with progress_bar(args.cmd) as prog:
        if args.cmd == "export":
            out = export_plugin(args.id, bb, args.dir, catalog=cat, evaluation=ev,
                                include_datastore=args.include_datastore, overwrite=args.force, progress=prog)
        elif args.cmd == "import":
            row = import_plugin(args.source, bb, cat, name=args.name, revision=args.revision, progress=prog)
        else:
            url = push_plugin(args.id, args.repo_id, bb, catalog=cat, private=args.private, evaluation=ev,
                              include_datastore=args.include_datastore, progress=prog)
    if args.cmd == "export":
        print(f"exported {args.id} -> {out} ({', '.join(sorted(f.name for f in out.iterdir()))})")
    elif args.cmd == "import":
        print(f"imported plug-in {row['id']} ({row['method']}, {row['params']:,} trainable parameters"
              f"{', with its datastore as memory ' + row['memory_id'] if row['memory_id'] else ''}) -> {row['path']}")
    else:
        print(f"pushed {args.id} -> {url}")
    return 0


def plugin_backbone_args(args, cat) -> None:
    """Fill in ``--backbone`` / ``--dtype`` (where not given) from the plug-in's own ``plugin_config.json``: the
    backbone and precision it was trained on, which loading it will check."""
    if args.backbone is not None and args.dtype is not None:
        return
    try:
        meta = json.loads((plugin_folder(args.id, cat) / "plugin_config.json").read_text(encoding="utf-8"))
    except (UserError, OSError, ValueError):
        return  # export/push say what is wrong with the reference
    if not isinstance(meta, dict):
        return
    if args.backbone is None and isinstance(meta.get("backbone"), str):
        args.backbone = meta["backbone"]
    fingerprint = meta.get("fingerprint")
    if args.dtype is None and isinstance(fingerprint, str):
        tag = fingerprint.split("|dtype=")[1] if "|dtype=" in fingerprint else "float32"
        made = {**{v: k for k, v in FINGERPRINT_TAGS.items()}, CPU_FLOAT16_TAG: "float16"}.get(tag, tag)
        if made in PRECISIONS:
            args.dtype = made


def _compare(args, cat) -> int:
    bb = remote_backbone_from_args(args) if args.remote else load_backbone_from_args(args)
    plugins = [(open_offsite_plugin if args.remote else open_plugin)(p, bb, cat) for p in args.plugin]
    task = args.task or next((p.memory_meta.get("task") for p in plugins if p.memory_meta.get("task")),
                             "translation")
    prompt = task_prompt(task, bb, shots=args.shots)
    if plugins and args.shots is None and plugins[0].memory_meta.get("prompt"):
        prompt = Prompt.from_dict(plugins[0].memory_meta["prompt"])  # decode with the prompt the memory used
    rows = [] if args.no_base else [Row("base")]
    rows += plugin_rows(plugins, task, bb.name, args.set, calibrated=not args.global_defaults)
    if args.remote:  # the owner runs the decoder in a session; the plug-ins mix here (offsite.decode)
        res = compare_remote(bb, args.sentence, rows, prompt, max_new_tokens=args.max_new_tokens,
                             num_beams=args.beams, lm=args.remote_lm)
    else:
        res = compare(bb, args.sentence, rows, prompt, max_new_tokens=args.max_new_tokens, num_beams=args.beams)
    if args.json:
        dump_json(res.to_dict())
        return 0
    print(f"input: {args.sentence}\n")
    width = max(len(r.label) for r in res.rows)
    for r in res.rows:
        print(f"{r.label.ljust(width)} | {r.text}")
    for line in tuned_lines(rows, not args.global_defaults):
        print(line)
    print(f"\n{len(res.rows)} methods in one batched decode: {res.seconds:.2f}s, {res.steps} steps")
    return 0


def plugin_status(row: dict) -> str:
    """How a plug-in's training ended, in the Plug-ins tab's words (``studio.plugin_service.training_status``):
    "converged: early stopping at 4 epochs", "stopped by time budget at 0.12 of 3 epochs — under-trained"."""
    from studio.plugin_service import training_status  # heavy: the studio package, only for `plugins list`

    metrics = row.get("metrics")
    if isinstance(metrics, str):
        try:
            metrics = json.loads(metrics)
        except ValueError:
            metrics = None
    return training_status(metrics if isinstance(metrics, dict) else None)["label"]


def _range(d: dict) -> str:
    if d["choices"]:
        return "one of " + "/".join(map(str, d["choices"]))
    return f"{d['low']}..{d['high']}" if d["low"] is not None else d["type"]


def tuned_lines(rows: list[Row], calibrated: bool) -> list[str]:
    """One line per row that starts at settings calibrated on its memory: "pema: tuned on 15 held-out samples of
    wmt300 (lambda_max=0.3, gu=False)"."""
    out = []
    for r in rows if calibrated else ():
        cal = plugin_calibration(r.plugin) if r.plugin is not None else None
        if cal:
            vals = ", ".join(f"{k}={v}" for k, v in cal["settings"].items() if r.settings.as_dict().get(k) == v)
            out.append(f"{r.label}: {calibration_label(cal)} ({vals}; --global-defaults for the global ones)")
    return out


def plugin_rows(plugins: list, task: str, backbone_name: str, set_args: list[str] | None,
                calibrated: bool = True) -> list[Row]:
    """One row per plug-in with its complete decode settings (declared ← tuned for the task ← calibrated on its
    memory, unless not ``calibrated`` ← ``--set``)."""
    labels = [p.method if sum(q.method == p.method for q in plugins) == 1 else f"{p.method}:{p.plugin_path.name}"
              for p in plugins]
    per_row = address_sets(parse_sets(set_args), [(p.plugin_path.name, type(p)) for p in plugins]
                           + [(lb, type(p)) for lb, p in zip(labels, plugins)])
    return [method_row(lb, p, task, backbone_name, resolve_row_settings((p.method, p.plugin_path.name, lb), per_row),
                       calibrated)
            for lb, p in zip(labels, plugins)]


if __name__ == "__main__":
    run_main(main)
