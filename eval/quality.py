"""Quality runs for BENCHMARKS.md: build a memory from N training pairs of a task, train plug-ins, tune decode
settings on early dev items, and report on later dev items that tuning never saw.

    python -m eval.quality --task translation --train 1000 --tune 0:40 --report 1000:200 --methods pema,knn
    python -m eval.quality --task formality --train 1000 --tune 0:40 --report 1000:200
    python -m eval.quality --task style --train 500 --tune 0:24 --report 1000:100

The style task (Shakespeare) is monolingual: the memory is built from N Shakespeare train lines through synthetic
plain sources made by the backbone; tuning and report inputs are plain English (the WMT dev English side) with no
references, scored by the project's style classifier (its held-out accuracy is in the results), content similarity
to the input and perplexity under the other embedded backbone. Tuning picks the highest style score among the
settings that keep ≥ 0.8 of the base's content similarity (the issue's bar).

``--tune-prompt`` first chooses the prompt (the line format or the PEMA paper's instruction, with 0, 1 or 3 built-in
examples) by the bare model's score on the tuning items, then builds the memory with it; with ``--save-defaults``
the choice becomes the task's prompt on that backbone (app, CLI and later runs).

Results go to ``out/quality-<task>-<train>.json`` and a markdown table on stdout. Tuned decode settings can be
written into ``plugins/tuned_defaults.json`` with ``--save-defaults`` (the app and CLI then start from them).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from backbone import load_backbone
from backbone.tasks import save_tuned_prompt, task_prompt
from engine import Row
from eval.datasets import task_pairs
from eval.likelihood import tune_settings
from eval.metrics import paired_bootstrap
from eval.run import evaluate, format_table
from eval.style import heldout_accuracy, train_shakespeare_classifier
from ground.cli import progress_bar, run_main
from ground.store import Catalog, new_id, write_json_atomic
from memories.build import MAX_TARGET_TOKENS, build_memory, register_memory, target_ids
from memories.parse import Sample
from plugins.api import open_memory, open_plugin, train_plugin
from plugins.settings import decode_grid, save_tuned_decode_settings


def pairs_that_fit(backbone, prompt, pairs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], int]:
    """The pairs whose target fits a memory (≤ MAX_TARGET_TOKENS backbone tokens), and how many were dropped.

    The memory builder refuses a longer target (a user is told to split it); a benchmark skips and counts it
    instead. The limit is in backbone tokens, so it bites SmolLM2 on German (a WMT paragraph), not Gemma."""
    kept = [p for p in pairs if len(target_ids(backbone, prompt, p[1])) <= MAX_TARGET_TOKENS]
    return kept, len(pairs) - len(kept)


def best_setting(task: str, rows: list[dict]) -> dict:
    """The tuning criterion: chrF + sacreBLEU, or for style the highest style score among the settings that keep
    ≥ 0.8 of the base's content similarity (rows[0] is the base; if none does, the most similar one)."""
    if task != "style":
        return max(rows[1:], key=lambda r: r["chrf"] + r.get("sacrebleu", 0))
    keep = [r for r in rows[1:] if r["content_similarity"] >= 0.8 * rows[0]["content_similarity"]]
    if keep:
        return max(keep, key=lambda r: r.get("style_score", 0.0))
    return max(rows[1:], key=lambda r: r["content_similarity"])


PROMPT_GRID = [{"paper_prompt": paper, "shots": shots} for paper in (False, True) for shots in (0, 1, 3)]


def best_prompt(task: str, rows: list[dict]) -> dict:
    """The prompt-tuning criterion (every row is the bare model under one prompt): chrF + sacreBLEU, or for style
    style score × content similarity — with no base row to keep 0.8 of, a prompt must both restyle and keep the
    content (a prompt that makes the model repeat a few-shot example scores a high style and no similarity)."""
    if task != "style":
        return max(rows, key=lambda r: r["chrf"] + r.get("sacrebleu", 0))
    return max(rows, key=lambda r: r.get("style_score", 0.0) * r["content_similarity"])


def tune_prompt(bb, task: str, pairs, batch: int, extra: dict | None) -> tuple[dict, list[dict]]:
    """Decode the tuning items with the bare model under every prompt of ``PROMPT_GRID``; the best and the table."""
    rows = []
    for cand in PROMPT_GRID:
        prompt = task_prompt(task, bb, shots=cand["shots"], paper=cand["paper_prompt"])
        with progress_bar(f"prompt {json.dumps(cand)}") as prog:
            res = evaluate(bb, pairs, [Row("base")], prompt, task, batch_sources=batch, progress=prog, extra=extra)
        rows.append({"label": json.dumps(cand), **{k: v for k, v in res["methods"][0].items()
                                                  if k not in ("label", "method", "settings")}})
    return json.loads(best_prompt(task, rows)["label"]), rows


def other_backbone(bb, data_dir):
    """The other embedded backbone (for the style task's perplexity), or None when it cannot be loaded."""
    other = "smollm2-135m-instruct" if bb.name != "smollm2-135m-instruct" else "gemma-3-270m"
    try:
        return load_backbone(other, data_dir=data_dir)
    except Exception as e:  # noqa: BLE001 - perplexity is optional; say why it is missing
        print(f"perplexity skipped: {other} did not load ({e})")
        return None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m eval.quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="translation", choices=["translation", "formality", "style"])
    ap.add_argument("--train", type=int, default=1000, help="training pairs for the memory")
    ap.add_argument("--tune", default="0:40", help="START:N of dev items used for tuning")
    ap.add_argument("--tune-likelihood", default=None, metavar="START:N",
                    help="tune the output-level plug-ins (PEMA, kNN) teacher-forced on these dev items instead of "
                         "decoding the --tune items once per setting (eval.likelihood: highest top-1 agreement "
                         "with the reference tokens, then lowest NLL; a finer grid); translation and formality")
    ap.add_argument("--report", default="1000:200", help="START:N of dev items reported (never tuned on)")
    ap.add_argument("--methods", default="pema,knn",
                    help="comma-separated methods; LABEL=METHOD trains a variant under its own label "
                         "(e.g. pema-warm=pema with --set pema-warm.pd_init=\"warm\")")
    ap.add_argument("--set", action="append", metavar="METHOD.KEY=VALUE", help="training config override")
    ap.add_argument("--backbone", default=None)
    ap.add_argument("--dtype", default=None, help="the backbone's precision (float32, bfloat16, int8, float16; "
                    "default: the app's); results of a precision other than float32 go to a file named with it")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--save-defaults", action="store_true")
    ap.add_argument("--gu-code-sl", choices=["source", "reference"], default="source",
                    help="SL of PEMA's GU gu_variant='code' rows: 'source' (what a decode without a reference uses: "
                         "template + source + source tokens) or 'reference' (the public code's: template + source + "
                         "the reference's tokens; evaluation only)")
    ap.add_argument("--memory", default=None, help="reuse a memory (id or path) instead of building one")
    ap.add_argument("--plugin", action="append", default=[], metavar="LABEL=ID",
                    help="reuse a trained plug-in for LABEL instead of training it (e.g. pema=pema-1a2b)")
    ap.add_argument("--ablation", action="store_true",
                    help="also train PEMA without the reconstruction (A, B_pd on L_pd only: the paper's '+B_pd') "
                         "and report base < +B_pd < +B_pd+GU < full PEMA at the tuned λ_max")
    ap.add_argument("--tune-prompt", action="store_true",
                    help="first choose the prompt (line format or the paper's instruction, 0/1/3 examples) by the "
                         "bare model on the tuning items; the memory is built with it (not with --memory)")
    ap.add_argument("--prompt-only", action="store_true",
                    help="only tune the prompt (no memory, no plug-ins): out/prompt-<task>-<backbone>.json")
    args = ap.parse_args(argv)
    args.tune_prompt = args.tune_prompt or args.prompt_only
    if args.tune_prompt and args.memory:
        raise SystemExit("--tune-prompt chooses the prompt a memory is built with; it cannot reuse --memory")
    if any("=" not in x for x in args.plugin):
        raise SystemExit("--plugin takes LABEL=ID, e.g. --plugin pema=pema-1a2b")
    args.reuse = dict(x.split("=", 1) for x in args.plugin)  # LABEL → plug-in id
    if args.tune_likelihood and args.task == "style":
        raise SystemExit("--tune-likelihood needs references to score; the style task has none (use --tune)")
    return args


def span(text: str) -> tuple[int, int]:
    """``START:N`` → (start, n)."""
    try:
        start, n = map(int, text.split(":"))
    except ValueError:
        raise SystemExit(f"expected START:N (e.g. 0:1000), got {text!r}") from None
    return start, n


def open_or_build_memory(args, bb, cat, prompt):
    """The memory of ``--memory``, or one built from the first ``--train`` pairs with ``prompt`` (registered, so a
    later run can reuse it). Returns (memory, build seconds, pairs skipped as too long)."""
    t0 = time.time()
    if args.memory:
        return open_memory(args.memory, bb, cat), 0.0, 0
    train, skipped_long = pairs_that_fit(bb, prompt, task_pairs(args.task, "train", 0, args.train))
    if skipped_long:
        print(f"skipped {skipped_long} of {args.train} training pairs whose target has more than "
              f"{MAX_TARGET_TOKENS} {bb.name} tokens")
    with progress_bar("memory") as prog:
        mem = build_memory(bb, [Sample(s, t, i + 1) for i, (s, t) in enumerate(train)],
                           cat.root / "memories" / new_id(f"q-{args.task}-"), prompt=prompt, task=args.task,
                           name=f"{args.task}-{args.train}", batch_size=16, progress=prog)
    register_memory(cat, mem)
    return mem, time.time() - t0, skipped_long


def train_or_open_plugins(args, bb, cat, mem) -> tuple[dict, dict, dict]:
    """Every ``--methods`` entry: reused (``--plugin LABEL=ID``) or trained. Returns (plug-ins by label, training
    info by label, config overrides by label)."""
    overrides: dict[str, dict] = {}
    for it in args.set or []:
        k, v = it.split("=", 1)
        m, key = k.split(".", 1)
        overrides.setdefault(m, {})[key] = json.loads(v)
    plugins, train_info = {}, {}
    reuse = args.reuse
    for spec in args.methods.split(","):
        m, method = spec.split("=", 1) if "=" in spec else (spec, spec)
        if m in reuse:
            p = open_plugin(reuse[m], bb, cat)
            row = {"id": reuse[m], "params": p.trainable_parameters()}
        else:
            with progress_bar(m) as prog:
                p, row = train_plugin(bb, mem, method, overrides.get(m), catalog=cat, progress=prog)
        plugins[m] = p
        train_info[m] = {"id": row["id"], "params": row["params"], **p.train_info}
    return plugins, train_info, overrides


def tune_decode(args, bb, cat, plugins: dict, prompt, tune_pairs, tune_extra) -> tuple[dict, dict]:
    """Each plug-in's best decode settings and its tuning table: teacher-forced on ``--tune-likelihood`` items for
    interpolating plug-ins when asked, else by decoding the ``--tune`` items once per setting of its declared grid
    (``plugins.settings.decode_grid``). A plug-in with a single setting (the in-network ones) is not tuned."""
    tuned, tables = {}, {}
    if args.tune_likelihood:  # all interpolating plug-ins in one teacher-forced pass

        lik = [m for m, p in plugins.items() if p.interpolates]
        pairs = task_pairs(args.task, "dev", *span(args.tune_likelihood))
        if lik:
            with progress_bar(f"tune {','.join(lik)} (teacher-forced)") as prog:
                res = tune_settings(bb, [plugins[m] for m in lik], pairs, prompt, args.task, cat.root / "eval-cache",
                                    progress=prog)
            for m, (best, table) in zip(lik, res):
                tuned[m], tables[m] = best, table
    for m, p in plugins.items():
        if m in tuned:
            continue
        grid = decode_grid(type(p))
        if len(grid) == 1:
            tuned[m], tables[m] = grid[0], []
            continue
        rows = [Row("base")] + [Row(json.dumps(g), p, g) for g in grid]
        with progress_bar(f"tune {m}") as prog:
            res = evaluate(bb, tune_pairs, rows, prompt, args.task, batch_sources=max(1, args.batch // 2),
                           progress=prog, extra=tune_extra, reference_sl=args.gu_code_sl == "reference")
        tuned[m] = json.loads(best_setting(args.task, res["methods"])["label"])
        tables[m] = res["methods"]
    return tuned, tables


def ablation_rows(args, bb, cat, mem, plugins, tuned, overrides, train_info) -> list:
    """The paper's ablation (+B_pd, +B_pd+GU, full PEMA with GU flipped) at the tuned λ_max."""
    reuse = args.reuse
    if "pema+B_pd" in reuse:
        bpd = open_plugin(reuse["pema+B_pd"], bb, cat)
        row = {"id": reuse["pema+B_pd"], "params": bpd.trainable_parameters()}
    else:
        with progress_bar("pema +B_pd") as prog:
            bpd, row = train_plugin(bb, mem, "pema", {**overrides.get("pema", {}), "max_epochs_rct": 0,
                                                      "kappa": 0.0}, catalog=cat, progress=prog)
    train_info["pema +B_pd"] = {"id": row["id"], "params": row["params"], **bpd.train_info}
    lam = tuned["pema"].get("lambda_max", 0.7)
    gu = tuned["pema"].get("gu", True)
    return [Row("ablation: +B_pd", bpd, {"lambda_max": lam, "gu": False}),
            Row("ablation: +B_pd+GU", bpd, {"lambda_max": lam, "gu": True}),
            # full PEMA at the tuned λ_max with GU flipped (the tuned row is the other one)
            Row(f"ablation: PEMA (B_rct+B_pd){'' if gu else '+GU'}", plugins["pema"],
                {"lambda_max": lam, "gu": not gu})]


def main(argv=None) -> int:
    args = parse_args(argv)

    cat = Catalog(args.data_dir)
    bb = load_backbone(args.backbone, data_dir=args.data_dir, dtype=args.dtype)
    tune_pairs = task_pairs(args.task, "dev", *span(args.tune))
    tune_extra = report_extra = None
    style_info = {}
    if args.task == "style":
        clf = train_shakespeare_classifier()
        style_info = {"classifier_heldout": heldout_accuracy(clf)}
        tune_extra = {"style_classifier": clf}
    prompt_choice, prompt_table = None, []
    if args.tune_prompt:
        prompt_choice, prompt_table = tune_prompt(bb, args.task, tune_pairs, args.batch, tune_extra)
        print(format_table(prompt_table))
        print(f"prompt: {json.dumps(prompt_choice)}")
        prompt = task_prompt(args.task, bb, shots=prompt_choice["shots"], paper=prompt_choice["paper_prompt"])
        if args.prompt_only:
            Path("out").mkdir(exist_ok=True)
            path = Path("out") / f"prompt-{args.task}-{bb.name}.json"
            write_json_atomic(path, {"task": args.task, "backbone": bb.name, "tune_items": args.tune,
                                     "prompt": prompt.to_dict(), "chosen": prompt_choice,
                                     "prompt_tuning": prompt_table})
            print(f"wrote {path}")
            if args.save_defaults:
                save_defaults(args.task, bb.name, prompt=prompt_choice)
            return 0
    else:
        prompt = task_prompt(args.task, bb)
    if args.task == "style":  # the report's perplexity needs the other backbone; --prompt-only never loads it
        report_extra = {**tune_extra, "perplexity_backbone": other_backbone(bb, args.data_dir)}
        style_info["perplexity_backbone"] = getattr(report_extra["perplexity_backbone"], "name", None)

    mem, build_s, skipped_long = open_or_build_memory(args, bb, cat, prompt)
    prompt = mem.prompt  # decode as the memory was built, whatever the tuned defaults say now
    plugins, train_info, overrides = train_or_open_plugins(args, bb, cat, mem)
    tuned, tune_tables = tune_decode(args, bb, cat, plugins, prompt, tune_pairs, tune_extra)

    rows = [Row("base")] + [Row(m, p, tuned[m]) for m, p in plugins.items()]
    if args.ablation and "pema" in plugins:
        rows += ablation_rows(args, bb, cat, mem, plugins, tuned, overrides, train_info)
    with progress_bar("report") as prog:
        rep = evaluate(bb, task_pairs(args.task, "dev", *span(args.report)), rows, prompt, args.task,
                       batch_sources=args.batch, progress=prog, extra=report_extra,
                       reference_sl=args.gu_code_sl == "reference")
    if args.task != "style":  # paired bootstrap of every row against the base on the same report items

        refs = [o["reference"] for o in rep["outputs"]]
        for r in rep["methods"][1:]:
            r["vs_base"] = paired_bootstrap([o["base"] for o in rep["outputs"]],
                                            [o[r["label"]] for o in rep["outputs"]], refs)
    out = {"task": args.task, "backbone": bb.name, "precision": bb.precision, "train_pairs": args.train,
           "memory_entries": len(mem),
           "memory_build_seconds": round(build_s, 1), "skipped_long_pairs": skipped_long,
           "tune_items": args.tune, "tune_likelihood_items": args.tune_likelihood, "report_items": args.report,
           "prompt": prompt.to_dict(), "prompt_tuning": prompt_table,
           "tuned": tuned, "train_info": train_info, "tune": tune_tables, "report": rep["methods"],
           "outputs": rep["outputs"], "report_seconds": rep["seconds"], **style_info}
    Path("out").mkdir(exist_ok=True)
    precision = "" if bb.precision == "float32" else f"-{bb.precision}"
    path = Path("out") / f"quality-{args.task}-{args.train}-{bb.name}{precision}.json"
    write_json_atomic(path, json.loads(json.dumps(out, default=str)))  # default=str: numpy scalars in tables
    print(format_table(rep["methods"]))
    print(f"tuned: {json.dumps(tuned)}\nwrote {path}")
    if args.save_defaults:
        # variants trained under their own label (e.g. pema-warm) are reported, not made the app's defaults
        save_defaults(args.task, bb.name, decode={m: v for m, v in tuned.items() if m == plugins[m].method},
                      prompt=prompt_choice)
    return 0


def save_defaults(task: str, backbone_name: str, decode: dict | None = None, prompt: dict | None = None) -> None:
    """Write tuned decode settings (into ``plugins/tuned_defaults.json``, where rows start) and/or the tuned prompt
    (``shots``, ``paper_prompt``: into ``backbone/tuned_prompts.json``, which ``backbone.tasks.task_prompt`` reads)
    of a task on a backbone."""
    if decode is not None:
        save_tuned_decode_settings(task, backbone_name, decode)
    if prompt is not None:
        save_tuned_prompt(task, backbone_name, prompt)


if __name__ == "__main__":
    run_main(main)
