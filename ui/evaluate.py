"""Evaluate tab: chosen methods on a memory's held-out split or an uploaded test file (a background job) →
scores table + bar chart; a λ_max sweep with and without Gradual Unrolling → line chart; CSV download."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import gradio as gr

from backbone.prompts import TASKS
from ground.errors import UserError
from ground.jobs import FINAL_STATES
from ui import plots, render
from ui.common import (BASE_CHOICE, keep_value, memory_choices, method_choices, owner_of, plugin_choices,
                       read_upload, user_errors)

SCORE_KEYS = ("label", "method", "sacrebleu", "chrf")


def _table(result: dict | None) -> tuple[list[str], list[list]]:
    if not result:
        return list(SCORE_KEYS), []
    rows = result.get("sweep") if result.get("mode") == "sweep" else result.get("methods")
    rows = rows or []
    cols: list[str] = []
    for r in rows:
        cols += [k for k, v in r.items() if k not in cols and (k == "settings" or not isinstance(v, (list, dict)))]
    if "settings" in cols:  # the decode settings each row ran with, last (they are long)
        cols = [c for c in cols if c != "settings"] + ["settings"]

    def fmt(v):
        if isinstance(v, dict):
            return json.dumps(v, ensure_ascii=False)
        return round(v, 2) if isinstance(v, float) else v

    return cols or list(SCORE_KEYS), [[fmt(r.get(c)) for c in cols] for r in rows]


def _outputs_table(result: dict | None) -> tuple[list[str], list[list]]:
    outs = (result or {}).get("outputs") or []
    if not outs or not isinstance(outs[0], dict):
        return ["output"], [[o] for o in outs[:200]] if outs else []
    cols: list[str] = []
    for o in outs[:200]:
        cols += [k for k in o if k not in cols]
    return cols, [[o.get(c) if not isinstance(o.get(c), (list, dict)) else str(o.get(c)) for c in cols]
                  for o in outs[:200]]


def build(studio, settings_inputs: list, settings_of) -> SimpleNamespace:
    """``settings_inputs`` / ``settings_of``: the Compare tab's decode controls and how to read them, so that an
    evaluation decodes with exactly the settings a comparison shows."""
    job_id = gr.State(None)
    seen = gr.State(None)
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=340):
            gr.Markdown("#### Test data")
            memory = gr.Dropdown([], label="A memory's held-out split")
            test_file = gr.File(label="…or a test file of source/reference pairs", type="filepath",
                                file_types=[".jsonl", ".json", ".csv", ".tsv"])
            with gr.Row():
                task = gr.Dropdown(list(TASKS), value="translation", label="Task")
                limit = gr.Number(50, label="Sentences (max)", precision=0, minimum=1)
                max_new = gr.Number(48, label="Max tokens", precision=0, minimum=4)
            gr.Markdown("#### Methods")
            methods = gr.CheckboxGroup(BASE_CHOICE, value=["base"], label="Compare these")
            gr.Markdown("Decode settings: those of the **Compare** tab (its live controls and “More decode "
                        "settings”), so scores match what Compare shows; each row's settings are in the table and the "
                        "CSV.", elem_classes=["pema-help"])
            run = gr.Button("Evaluate in background", variant="primary", elem_id="eval-run")
            gr.Markdown("#### λ_max sweep (with and without Gradual Unrolling)")
            with gr.Row():
                sweep_plugin = gr.Dropdown([], label="PEMA plug-in", scale=2)
                lambdas = gr.Textbox("0, 0.2, 0.4, 0.6, 0.8, 1.0", label="λ_max values", scale=2)
            sweep = gr.Button("Run the sweep in background")
        with gr.Column(scale=3, min_width=440):
            job_html = gr.HTML(render.job_card(None))
            scores = gr.Dataframe(headers=list(SCORE_KEYS), interactive=False, max_height=220, label="Scores",
                                  elem_id="eval-scores")
            with gr.Row():
                bar = gr.Plot(plots.eval_bars([]), show_label=False)
                line = gr.Plot(plots.sweep_lines([]), show_label=False)
            download = gr.DownloadButton("Download CSV", visible=False)
            outputs_df = gr.Dataframe(interactive=False, max_height=260, wrap=True, label="Outputs", visible=False)
    timer = gr.Timer(1.5)

    @user_errors
    def do_run(request: gr.Request, mem, path, tk, n, mx, ms, *svals):
        me = owner_of(studio, request)
        data, fname = read_upload(path, studio.limits.upload_bytes)
        jid = studio.submit_evaluate(methods=list(ms or []), memory_id=None if data else mem, test_data=data,
                                     test_filename=fname, task=tk, limit=int(n or 50), max_new_tokens=int(mx or 48),
                                     settings=settings_of(*svals), owner=me)
        return jid, render.job_card(studio.job(jid, owner=me)), None

    @user_errors
    def do_sweep(request: gr.Request, mem, path, tk, n, mx, pid, lams, *svals):
        me = owner_of(studio, request)
        data, fname = read_upload(path, studio.limits.upload_bytes)
        if not pid:
            raise UserError("Choose a PEMA plug-in for the sweep.")
        try:
            vals = [float(x) for x in lams.replace(";", ",").split(",") if x.strip()]
        except ValueError:
            raise UserError("Write the λ_max values as numbers separated by commas, e.g. 0, 0.5, 1.") from None
        jid = studio.submit_evaluate(memory_id=None if data else mem, test_data=data, test_filename=fname, task=tk,
                                     limit=int(n or 50), sweep_plugin=pid, lambdas=vals, max_new_tokens=int(mx or 48),
                                     settings=settings_of(*svals), owner=me)
        return jid, render.job_card(studio.job(jid, owner=me)), None

    run.click(do_run, [memory, test_file, task, limit, max_new, methods, *settings_inputs], [job_id, job_html, seen],
              api_visibility="private")
    sweep.click(do_sweep, [memory, test_file, task, limit, max_new, sweep_plugin, lambdas, *settings_inputs],
                [job_id, job_html, seen], api_visibility="private")

    def show(job):
        res = job.get("result") if job and job["state"] == "done" else None
        cols, rows = _table(res)
        if res and res.get("mode") == "sweep":
            fig_bar, fig_line = gr.skip(), plots.sweep_lines(res.get("sweep") or [])
        elif res:
            fig_bar, fig_line = plots.eval_bars(res.get("methods") or []), gr.skip()
        else:
            fig_bar = fig_line = gr.skip()
        dl = gr.update(visible=False)
        if res:
            out = Path(tempfile.mkdtemp(prefix="pema-eval-")) / f"{job['id']}.csv"
            out.write_text(studio.results_csv(res), encoding="utf-8")
            dl = gr.update(visible=True, value=str(out))
        ocols, orows = _outputs_table(res)
        outs = gr.update(visible=bool(orows), value={"headers": ocols, "data": orows}) if orows else \
            gr.update(visible=False)
        return (render.job_card(job), gr.update(value={"headers": cols, "data": rows}) if res else gr.skip(),
                fig_bar, fig_line, dl, outs)

    def tick(jid, last, request: gr.Request):
        n_out = 6
        if not jid:
            return (*[gr.skip()] * n_out, last)
        try:
            job = studio.job(jid, owner=owner_of(studio, request))
        except UserError:
            return (*[gr.skip()] * n_out, last)
        key = (jid, job["state"], round(job["progress"], 3), job["message"])
        if key == last:
            return (*[gr.skip()] * n_out, last)
        if job["state"] in FINAL_STATES:
            return (*show(job), key)
        return (render.job_card(job), *[gr.skip()] * (n_out - 1), key)

    timer.tick(tick, [job_id, seen], [job_html, scores, bar, line, download, outputs_df, seen], show_progress="hidden",
               api_visibility="private")

    def lists(me, current=None, mem_value=None):
        choices = method_choices(studio, me)
        mchoices = memory_choices(studio, me)
        pchoices = plugin_choices(studio, methods=("pema",), owner=me)
        return (gr.update(choices=choices, value=keep_value(choices, current or ["base"])),
                gr.update(choices=mchoices, value=keep_value(mchoices, mem_value)),
                gr.update(choices=pchoices, value=keep_value(pchoices, None)))

    @user_errors
    def refresh(current, mem_value, request: gr.Request):
        return lists(owner_of(studio, request), current, mem_value)

    def on_load(me):
        last = studio.list_jobs(("evaluate",), 1, owner=me)
        jid = last[0]["id"] if last else None
        return (*lists(me), jid, render.job_card(last[0]) if jid else render.job_card(None))

    return SimpleNamespace(refresh=refresh, refresh_inputs=[methods, memory],
                           refresh_outputs=[methods, memory, sweep_plugin], on_load=on_load,
                           load_outputs=[methods, memory, sweep_plugin, job_id, job_html])
