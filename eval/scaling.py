"""Scaling curve: quality of the plug-ins against the number of training pairs behind the memory (like the
memory-augmented adapter paper's data-scale figure), as a markdown table and a plotly chart.

    python -m eval.scaling --task translation --sizes 200,1000,5000 --run     # runs the missing eval.quality points
    python -m eval.scaling --task translation --sizes 200,1000,5000           # table + chart from existing results

Each point is one ``python -m eval.quality --task T --train N`` run with the same tuning and report items (the
defaults below), read back from ``out/quality-<task>-<N>-<backbone>.json``. The chart goes to
``out/scaling-<task>-<backbone>.html``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval import quality
from eval.metrics import bleu_chrf
from ground.cli import run_main

OUT = Path("out")
QUALITY_ARGS = ["--tune", "0:24", "--report", "1000:100", "--methods", "pema,knn",
                "--set", 'pema.rct_init="pca"', "--set", "pema.batch_size=64"]
METRIC = {"translation": ["sacrebleu", "chrf"], "formality": ["sacrebleu", "chrf"],
          "style": ["style_score", "content_similarity"]}


def result_path(task: str, n: int, backbone: str) -> Path:
    return OUT / f"quality-{task}-{n}-{backbone}.json"


REPORT_ITEMS = QUALITY_ARGS[QUALITY_ARGS.index("--report") + 1]


def on_common_items(d: dict, task: str, items: str = REPORT_ITEMS) -> dict[str, dict] | None:
    """A result reported on more dev items than the curve's (e.g. 1000:200 against 1000:100) is re-scored on the
    curve's items from its saved outputs, so every point of the curve is measured on the same sentences."""
    if d.get("report_items") == items or task == "style":
        return None
    start, n = map(int, items.split(":"))
    r_start, r_n = map(int, d.get("report_items", "0:0").split(":"))
    outs = d.get("outputs", [])
    if not (r_start <= start and start + n <= r_start + r_n and len(outs) == r_n):
        return None

    sub = outs[start - r_start:start - r_start + n]
    refs = [o["reference"] for o in sub]
    return {m["label"]: bleu_chrf([o[m["label"]] for o in sub], refs) for m in d["report"]}


def collect(task: str, sizes: list[int], backbone: str) -> list[dict]:
    """One row per (size, method) found in the results: the report's metrics plus memory size and train time."""
    rows = []
    for n in sizes:
        p = result_path(task, n, backbone)
        if not p.exists():
            continue
        d = json.loads(p.read_text(encoding="utf-8"))
        rescored = on_common_items(d, task)
        for m in d["report"]:
            if m["label"].startswith("ablation"):
                continue
            info = d.get("train_info", {}).get(m["label"], {})
            scores = {**m, **(rescored or {}).get(m["label"], {})}
            rows.append({"pairs": n, "entries": d["memory_entries"], "method": m["label"],
                         "train_seconds": info.get("seconds"), **{k: scores.get(k) for k in METRIC[task]}})
    return rows


def markdown(rows: list[dict], task: str) -> str:
    keys = METRIC[task]
    head = "| pairs | entries | method | " + " | ".join(keys) + " | train s |"
    lines = [head, "|" + " ---: |" * 2 + " --- |" + " ---: |" * (len(keys) + 1)]
    for r in rows:
        vals = " | ".join("-" if r[k] is None else f"{r[k]:.2f}" for k in keys)
        ts = "-" if r["train_seconds"] is None else f"{r['train_seconds']:.0f}"
        lines.append(f"| {r['pairs']:,} | {r['entries']:,} | {r['method']} | {vals} | {ts} |")
    return "\n".join(lines)


def chart(rows: list[dict], task: str, path: Path) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    keys = METRIC[task]
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=keys)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    palette = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04"]
    color = {m: palette[i % len(palette)] for i, m in enumerate(methods)}  # one colour per method in every panel
    for j, k in enumerate(keys, start=1):
        for method in methods:
            pts = [r for r in rows if r["method"] == method and r[k] is not None]
            fig.add_trace(go.Scatter(x=[r["pairs"] for r in pts], y=[r[k] for r in pts], mode="lines+markers",
                                     name=method, legendgroup=method, showlegend=j == 1,
                                     line=dict(color=color[method]), marker=dict(color=color[method])), row=1, col=j)
        fig.update_xaxes(type="log", title_text="training pairs", row=1, col=j)
    fig.update_layout(title=f"{task}: quality vs training pairs behind the memory", height=420)
    path.parent.mkdir(exist_ok=True)
    fig.write_html(str(path), include_plotlyjs=True)  # self-contained: the chart must open offline


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="translation", choices=list(METRIC))
    ap.add_argument("--sizes", default="200,1000,5000,10000", help="comma-separated training pair counts")
    ap.add_argument("--backbone", default="gemma-3-270m")
    ap.add_argument("--run", action="store_true", help="run eval.quality for the sizes that have no result yet")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.run:
        for n in sizes:
            if not result_path(args.task, n, args.backbone).exists():
                quality.main(["--task", args.task, "--train", str(n), "--backbone", args.backbone, *QUALITY_ARGS])
    rows = collect(args.task, sizes, args.backbone)
    if not rows:
        raise SystemExit(f"no results yet for {args.task} at sizes {sizes}; add --run")
    print(markdown(rows, args.task))
    path = OUT / f"scaling-{args.task}-{args.backbone}.html"
    chart(rows, args.task, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
