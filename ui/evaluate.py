"""Evaluate tab: chosen methods on a memory's held-out split or an uploaded test file (a background job) →
scores table (n, 95% bootstrap intervals, paired-bootstrap p against the base model, each row's decode settings
and backbone, sacreBLEU's signatures) + bar chart + per-sentence outputs with their chrF; a λ_max sweep with and
without Gradual Unrolling → line chart; downloads (scores CSV, outputs CSV, JSON)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import gradio as gr

from backbone.prompts import TASKS
from eval.run import MIN_BOOTSTRAP_N
from ground.errors import UserError
from ground.jobs import FINAL_STATES
from ui import plots, render
from ui.common import (
    BASE_CHOICE,
    choices_update,
    disable_while_running,
    hidden_plugins_note,
    job_poll_key,
    keep_value,
    memory_choices,
    method_choices,
    owner_of,
    plugin_choices,
    poll_while_running,
    read_upload,
    user_errors,
)
from ui.compare import PROMPT_CHOICES, wire_prompt

SCORE_KEYS = ("label", "method", "n", "sacrebleu", "chrf")
# Shown in their own columns (or not at all); every other number of a row is a metric of the task.
_NOT_METRICS = {"n", "max_new_tokens", "num_beams", "no_repeat_ngram", "lambda_max", "sacrebleu", "chrf",
                "sacrebleu_delta", "chrf_delta", "p_sacrebleu", "p_chrf"}
SHOWN_OUTPUTS = 200
RUN_LABEL, SWEEP_LABEL = "Evaluate in background", "Run the sweep in background"


def _num(v, digits: int = 2):
    return round(v, digits) if isinstance(v, float) else v


def _ci(v, n=None) -> str:
    if isinstance(v, (list, tuple)) and len(v) == 2:
        return f"{v[0]:.2f}–{v[1]:.2f}"
    return f"— (n < {MIN_BOOTSTRAP_N})" if isinstance(n, int) and n < MIN_BOOTSTRAP_N else "—"


def _vs_base(r: dict, metric: str) -> str:
    if f"p_{metric}" not in r:
        n = r.get("n")
        return f"— (n < {MIN_BOOTSTRAP_N})" if r.get("method") != "base" and isinstance(n, int) \
            and n < MIN_BOOTSTRAP_N else "—"
    return f"{r.get(f'{metric}_delta', 0):+.2f} (p={r[f'p_{metric}']:.3f})"


def decode_text(r: dict) -> str:
    """How a row was decoded, in one cell: "max 48 tokens · greedy · no_repeat_ngram=0"."""
    beams = int(r.get("num_beams") or 1)
    return (f"max {r.get('max_new_tokens', '?')} tokens · {'greedy' if beams == 1 else f'{beams} beams'} · "
            f"no_repeat_ngram={r.get('no_repeat_ngram', 0)}")


def _table(result: dict | None) -> tuple[list[str], list[list]]:
    """The scores table: for methods, one line per row with n, the metrics with their 95% intervals and the
    paired-bootstrap difference from the base model (p); for a sweep, one line per (λ_max, GU) point (λ_max = 0,
    the base model, once). How each row was decoded is in :func:`_decode_table`."""
    if not result:
        return list(SCORE_KEYS), []
    if result.get("mode") == "sweep":
        pts = result.get("sweep") or []
        metrics = [k for k in ("sacrebleu", "chrf") if any(k in p for p in pts)]
        cols = ["point", "λ_max", "GU", "n", *metrics]
        gu = lambda v: "—" if v is None else ("on" if v else "off")  # noqa: E731
        return cols, [[p.get("label", ""), p.get("lambda_max"), gu(p.get("gu")), p.get("n", result.get("pairs")),
                       *[_num(p.get(m)) for m in metrics]] for p in pts]
    rows = result.get("methods") or []
    has_ref = any("sacrebleu" in r for r in rows)
    other = []
    for r in rows:
        other += [k for k, v in r.items() if k not in other and k not in _NOT_METRICS and isinstance(v, (int, float))
                  and not isinstance(v, bool)]
    cols = ["method", "n"]
    if has_ref:
        cols += ["BLEU", "BLEU 95% CI", "BLEU Δ vs base (p)", "chrF", "chrF 95% CI", "chrF Δ vs base (p)"]
    cols += other
    out = []
    for r in rows:
        line = [f"{r.get('label')} [{r.get('method')}]", r.get("n", result.get("n"))]
        if has_ref:
            n = r.get("n")
            line += [_num(r.get("sacrebleu")), _ci(r.get("sacrebleu_ci95"), n), _vs_base(r, "sacrebleu"),
                     _num(r.get("chrf")), _ci(r.get("chrf_ci95"), n), _vs_base(r, "chrf")]
        line += [_num(r.get(k)) for k in other]
        out.append(line)
    return cols, out


def _widths(cols: list[str]) -> list[str]:
    """Column widths of the scores table (so that it fits its column at 1280 px instead of scrolling sideways)."""
    fixed = {"method": 20, "point": 20, "n": 5, "BLEU": 7, "chrF": 7, "BLEU 95% CI": 11, "chrF 95% CI": 11,
             "BLEU Δ vs base (p)": 14, "chrF Δ vs base (p)": 14, "λ_max": 10, "GU": 8}
    rest = [c for c in cols if c not in fixed]
    left = max(0, 100 - sum(fixed[c] for c in cols if c in fixed))
    share = left / len(rest) if rest else 0
    if not rest and cols:  # give what is left to the first column
        return [f"{fixed[c] + (left if i == 0 else 0):g}%" for i, c in enumerate(cols)]
    return [f"{fixed.get(c, share):g}%" for c in cols]


DECODE_HEADERS = ["method", "decode", "settings", "backbone"]


def _decode_table(result: dict | None) -> list[list]:
    """How each methods row was decoded: max tokens, greedy, the repetition guard, its complete settings (as
    Compare's controls set them), the backbone."""
    if not result or result.get("mode") == "sweep":
        return []
    out = []
    for r in result.get("methods") or []:
        settings = {k: v for k, v in (r.get("settings") or {}).items() if k != "no_repeat_ngram"}
        out.append([f"{r.get('label')} [{r.get('method')}]", decode_text(r),
                    json.dumps(settings, ensure_ascii=False) if settings else "— (no settings)",
                    r.get("backbone", result.get("backbone"))])
    return out


def _notes(result: dict | None) -> str:
    """What the numbers are: n, data, backbone, sacreBLEU's signatures, how the intervals and p were made."""
    if not result:
        return ""
    n = result.get("pairs", result.get("n"))
    data = f"data: {render.esc(result.get('data'))}"
    left_out = result.get("left_out_tuning_samples")
    if left_out:  # else n reads short of the memory's held-out split with no reason given
        data += f" without the {left_out} held-out samples a chosen plug-in was tuned on"
    parts = [f"<b>n = {n}</b> sentence pairs", data, f"backbone {render.esc(result.get('backbone'))}"]
    sig = result.get("signatures") or {}
    text = " · ".join(parts)
    if sig:
        text += (f"<br>sacreBLEU signatures — BLEU: <code>{render.esc(sig.get('sacrebleu'))}</code> · chrF: "
                 f"<code>{render.esc(sig.get('chrf'))}</code><br>95% CI: percentile bootstrap over the sentences "
                 f"(1000 resamples). vs base: the difference from the base model's row and the one-sided p-value "
                 f"of a paired bootstrap (Koehn 2004); p &lt; 0.05 is unlikely to be chance.")
    used = render.prompt_label(result.get("prompt_source"))
    if used:
        text += f"<br><span id='eval-prompt-used'>Prompt of every row without its own: <b>{render.esc(used)}</b></span>"
    if result.get("mode") == "sweep":
        text += "<br>λ_max = 0 is the base model: one point, drawn at 0 on both curves."
    return f"<div class='pema-help' id='eval-notes-text'>{text}</div>" + render.transfer_note(result.get("transfer"))


OUTPUT_HEADERS = ["#", "source", "reference", "method", "output", "chrF"]


def _outputs_table(result: dict | None) -> tuple[list[str], list[list]]:
    """Per sentence and method (the first ``SHOWN_OUTPUTS`` sentences): source, reference, the method's output
    and its sentence chrF — one line each (the CSV download has one line per sentence)."""
    outs = (result or {}).get("outputs") or []
    if not outs or not isinstance(outs[0], dict):
        return ["output"], [[o] for o in outs[:SHOWN_OUTPUTS]] if outs else []
    labels = [m["label"] for m in (result.get("methods") or [])]
    ref = lambda v: " | ".join(map(str, v)) if isinstance(v, (list, tuple)) else v  # noqa: E731
    rows = []
    for i, o in enumerate(outs[:SHOWN_OUTPUTS]):
        for j, lab in enumerate(labels):
            rows.append([i + 1 if j == 0 else "", o.get("source") if j == 0 else "",
                         ref(o.get("reference")) if j == 0 else "", lab, o.get(lab), o.get(f"chrF · {lab}", "")])
    return OUTPUT_HEADERS, rows


def _test_data_panel(c: SimpleNamespace) -> None:
    """The test data (a memory's held-out split or a test file), the methods, Evaluate, and the λ_max sweep."""
    gr.Markdown("#### Test data")
    c.memory = gr.Dropdown([], label="A memory's held-out split", elem_id="eval-memory")
    c.memory_warn = gr.HTML(elem_id="eval-memory-warning")
    c.test_file = gr.File(label="…or a test file of source/reference pairs", type="filepath",
                          file_types=[".jsonl", ".json", ".csv", ".tsv"], elem_id="eval-test-file")
    with gr.Row():
        c.task = gr.Dropdown(list(TASKS), value="translation", label="Task", elem_id="eval-task")
        c.limit = gr.Number(50, label="Sentences (max)", precision=0, minimum=1)
        c.max_new = gr.Number(48, label="Max tokens", precision=0, minimum=4)
    gr.Markdown("#### Methods")
    c.methods = gr.CheckboxGroup(BASE_CHOICE, value=["base"], label="Compare these", elem_id="eval-methods")
    # the same choice as Compare's picker (``ui.compare.wire_prompt``), with the same default
    c.prompt_from = gr.Dropdown(PROMPT_CHOICES, value=None, label="Examples in the prompt", elem_id="eval-prompt",
                                info="What every row without a prompt of its own reads, as in Compare; empty: the "
                                     "first chosen plug-in's memory, else the built-in examples")
    gr.Markdown("Decode settings: those of the **Compare** tab (its live controls and “More decode "
                "settings”), so scores match what Compare shows; each row's settings are in the table and the "
                "CSV.", elem_classes=["pema-help"])
    c.run = gr.Button(RUN_LABEL, variant="primary", elem_id="eval-run")
    gr.Markdown("#### λ_max sweep (with and without Gradual Unrolling)")
    c.sweep_plugin = gr.Dropdown([], label="PEMA plug-in")
    c.lambdas = gr.Textbox("0, 0.2, 0.4, 0.6, 0.8, 1.0", label="λ_max values")
    c.sweep = gr.Button(SWEEP_LABEL, elem_id="eval-sweep")


def _results_panel(c: SimpleNamespace) -> None:
    """The job, the scores, how each row was decoded, the charts, the downloads and the outputs per sentence."""
    c.job_html = gr.HTML(render.job_card(None))
    c.scores = gr.Dataframe(headers=list(SCORE_KEYS), interactive=False, max_height=260, label="Scores",
                            elem_id="eval-scores", wrap=True, show_search="none")
    c.notes = gr.HTML(elem_id="eval-notes")
    c.decode_df = gr.Dataframe(headers=DECODE_HEADERS, interactive=False, max_height=200, wrap=True,
                               label="How each row was decoded (Compare's settings at the time)",
                               elem_id="eval-decode", visible=False, show_search="none",
                               column_widths=["26%", "26%", "32%", "16%"])
    with gr.Row():
        c.bar = gr.Plot(plots.eval_bars([]), show_label=False)
        c.line = gr.Plot(plots.sweep_lines([]), show_label=False)
    c.download = gr.File(label="Download: scores (CSV), per-sentence outputs (CSV), everything (JSON)",
                         file_count="multiple", interactive=False, visible=False, elem_id="eval-downloads")
    c.outputs_df = gr.Dataframe(headers=OUTPUT_HEADERS, interactive=False, max_height=360, wrap=True,
                                visible=False, elem_id="eval-outputs",
                                column_widths=["6%", "21%", "21%", "16%", "28%", "8%"],
                                label=f"Outputs per sentence and method, with the sentence chrF (the first "
                                      f"{SHOWN_OUTPUTS} sentences; all of them in the downloads)")
    # what a result fills (``_result_views``), in this order
    c.result_outputs = [c.scores, c.notes, c.decode_df, c.bar, c.line, c.download, c.outputs_df]


def _cleared() -> tuple:
    """A new evaluation is under way: nothing of the previous result stays on show (``result_outputs``)."""
    return (gr.update(value={"headers": list(SCORE_KEYS), "data": []}), "", gr.update(visible=False),
            plots.eval_bars([]), plots.sweep_lines([]), gr.update(visible=False, value=None),
            gr.update(visible=False))


def _result_views(studio, job, me) -> tuple:
    """A finished job's card and result (``result_outputs``): table, notes, the chart of its kind (the other one is
    cleared, so no chart of an earlier result stays beside it), downloads and per-sentence outputs."""
    res = job.get("result") if job and job["state"] == "done" else None
    if not res:
        return (render.job_card(job), *_cleared())
    cols, rows = _table(res)
    if res.get("mode") == "sweep":
        fig_bar, fig_line = plots.eval_bars([]), plots.sweep_lines(res.get("sweep") or [])
    else:
        fig_bar, fig_line = plots.eval_bars(res.get("methods") or []), plots.sweep_lines([])
    try:
        files = [str(f) for f in studio.evaluate_service.evaluation_files(job["id"], owner=me)]
        dl = gr.update(visible=True, value=files)
    except UserError:
        dl = gr.update(visible=False, value=None)
    ocols, orows = _outputs_table(res)
    outs = gr.update(visible=True, value={"headers": ocols, "data": orows}) if orows else gr.update(visible=False)
    drows = _decode_table(res)
    dec = (gr.update(visible=True, value={"headers": DECODE_HEADERS, "data": drows}) if drows
           else gr.update(visible=False))
    return (render.job_card(job), gr.update(value={"headers": cols, "data": rows}, column_widths=_widths(cols)),
            _notes(res), dec, fig_bar, fig_line, dl, outs)


def _memory_warning(studio, mid, me) -> str:
    m = next((x for x in studio.memory_service.memories(owner=me) if x["id"] == mid), None) if mid else None
    return render.memory_warning(m, "heldout")


def _wire_runs(studio, c: SimpleNamespace, settings_inputs: list, settings_of, global_of) -> None:
    """Evaluate and the sweep: each submits a background job and clears the previous result; both decode as
    Compare does, at each plug-in's calibrated settings unless Compare's Global defaults is ticked."""
    @user_errors
    def do_run(request: gr.Request, mem, path, tk, n, mx, ms, pf, *svals):
        me = owner_of(studio, request)
        data, fname = read_upload(studio, request, path)
        jid = studio.evaluate_service.submit_evaluate(
            methods=list(ms or []), memory_id=None if data else mem, test_data=data, test_filename=fname, task=tk,
            limit=int(n or 50), max_new_tokens=int(mx or 48), settings=settings_of(*svals), owner=me,
            global_defaults=global_of(*svals), prompt_from=pf or None)
        studio.uploads.consume(path)  # the job holds the pairs it read
        return (jid, render.job_card(studio.job_service.job(jid, owner=me)), None, *_cleared())

    @user_errors
    def do_sweep(request: gr.Request, mem, path, tk, n, mx, pid, lams, pf, *svals):
        me = owner_of(studio, request)
        data, fname = read_upload(studio, request, path)
        if not pid:
            raise UserError("Choose a PEMA plug-in for the sweep.")
        try:
            vals = [float(x) for x in lams.replace(";", ",").split(",") if x.strip()]
        except ValueError:
            raise UserError("Write the λ_max values as numbers separated by commas, e.g. 0, 0.5, 1.") from None
        jid = studio.evaluate_service.submit_evaluate(
            memory_id=None if data else mem, test_data=data, test_filename=fname, task=tk, limit=int(n or 50),
            sweep_plugin=pid, lambdas=vals, max_new_tokens=int(mx or 48), settings=settings_of(*svals), owner=me,
            global_defaults=global_of(*svals), prompt_from=pf or None)
        studio.uploads.consume(path)
        return (jid, render.job_card(studio.job_service.job(jid, owner=me)), None, *_cleared())

    c.run.click(do_run, [c.memory, c.test_file, c.task, c.limit, c.max_new, c.methods, c.prompt_from,
                         *settings_inputs],
                [c.job_id, c.job_html, c.seen, *c.result_outputs], api_visibility="private")
    c.sweep.click(do_sweep, [c.memory, c.test_file, c.task, c.limit, c.max_new, c.sweep_plugin, c.lambdas,
                             c.prompt_from, *settings_inputs],
                  [c.job_id, c.job_html, c.seen, *c.result_outputs], api_visibility="private")


def _wire_poll(studio, c: SimpleNamespace) -> None:
    """The job's card while it runs; its result when it ends."""
    def tick(jid, last, request: gr.Request):
        n_out = 8
        if not jid:
            return (*[gr.skip()] * n_out, last)
        try:
            me = owner_of(studio, request)
            job = studio.job_service.job(jid, owner=me)
        except UserError:
            return (*[gr.skip()] * n_out, last)
        key = job_poll_key(job)
        if key == last:
            return (*[gr.skip()] * n_out, last)
        if job["state"] in FINAL_STATES:
            return (*_result_views(studio, job, me), key)
        return (render.job_card(job), *[gr.skip()] * (n_out - 1), key)

    c.timer.tick(tick, [c.job_id, c.seen], [c.job_html, *c.result_outputs, c.seen], show_progress="hidden",
                 api_visibility="private")


def eval_methods_update(studio, me, task: str, current) -> dict:
    """The methods to evaluate for ``task``: that task's plug-ins only, with a line saying what is hidden."""
    choices = method_choices(studio, me, task)
    value = keep_value(choices, list(current or []))
    return gr.update(choices=choices, value=value or ["base"], info=hidden_plugins_note(studio, me, task))


def _wire_task_filter(studio, c: SimpleNamespace) -> None:
    """A memory's held-out split is for the memory's task (the Task follows the memory); the Task filters the
    methods and the sweep's PEMA plug-ins."""
    def memory_task(mid, request: gr.Request):
        mems = studio.memory_service.memories(owner=owner_of(studio, request)) if mid else []
        m = next((x for x in mems if x["id"] == mid), None)
        return gr.update(value=m["task"]) if m and m["task"] in TASKS else gr.skip()

    @user_errors
    def on_task(tk, ms, request: gr.Request):
        me = owner_of(studio, request)
        pchoices = plugin_choices(studio, methods=("pema",), owner=me, task=tk)
        return eval_methods_update(studio, me, tk, ms), gr.update(choices=pchoices, value=keep_value(pchoices, None))

    c.memory.change(memory_task, c.memory, c.task, show_progress="hidden", api_visibility="private")
    c.task.change(on_task, [c.task, c.methods], [c.methods, c.sweep_plugin], show_progress="hidden",
                  api_visibility="private")


def build(studio, settings_inputs: list, settings_of, global_of=lambda *vals: False) -> SimpleNamespace:
    """``settings_inputs`` / ``settings_of``: the Compare tab's decode controls and how to read them, so that an
    evaluation decodes with exactly the settings a comparison shows."""
    c = SimpleNamespace(job_id=gr.State(None), seen=gr.State(None))
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=340):
            _test_data_panel(c)
        with gr.Column(scale=3, min_width=440):
            _results_panel(c)
    c.timer = gr.Timer(1.5, active=False)  # on while an evaluation runs or is not drawn yet (poll_while_running)
    _wire_runs(studio, c, settings_inputs, settings_of, global_of)
    _wire_poll(studio, c)
    poll_while_running(studio, c.timer, c.job_id, c.seen)
    busy = "An evaluation is running… (its card says how far it is)"
    disable_while_running(studio, {c.run: (RUN_LABEL, busy), c.sweep: (SWEEP_LABEL, busy)}, c.job_id, c.seen)

    @user_errors
    def on_memory(mid, request: gr.Request):
        return _memory_warning(studio, mid, owner_of(studio, request))

    c.memory.change(on_memory, c.memory, c.memory_warn, show_progress="hidden")
    _wire_task_filter(studio, c)
    wire_prompt(studio, c)

    def lists(me, current=None, mem_value=None, task=None):
        mchoices = memory_choices(studio, me)
        pchoices = plugin_choices(studio, methods=("pema",), owner=me, task=task or "translation")
        mem = keep_value(mchoices, mem_value)
        return (eval_methods_update(studio, me, task or "translation", current), choices_update(mchoices, mem_value),
                gr.update(choices=pchoices, value=keep_value(pchoices, None)), _memory_warning(studio, mem, me))

    @user_errors
    def refresh(current, mem_value, task, request: gr.Request):
        return lists(owner_of(studio, request), current, mem_value, task)

    def on_load(me):
        """Page (re)load for owner ``me``: lists and the latest evaluation (its result follows with the first
        timer tick)."""
        last = studio.job_service.list_jobs(("evaluate",), 1, owner=me)
        jid = last[0]["id"] if last else None
        return (*lists(me), jid, render.job_card(last[0]) if jid else render.job_card(None))

    def restore(me, saved: dict):
        """This browser's last memory, methods and task (``saved``; ids that are not the owner's are dropped)."""
        tk = saved.get("eval_task")
        choices, mchoices = method_choices(studio, me, tk if tk in TASKS else "translation"), memory_choices(studio, me)
        ms = keep_value(choices, list(saved.get("eval_methods") or []))
        mid = saved.get("eval_memory")
        ok = mid in [x[1] for x in mchoices]
        return (eval_methods_update(studio, me, tk if tk in TASKS else "translation", ms) if ms else gr.skip(),
                gr.update(value=mid) if ok else gr.skip(),
                _memory_warning(studio, mid, me) if ok else gr.skip(),
                gr.update(value=tk) if tk in TASKS else gr.skip())

    return SimpleNamespace(refresh=refresh, refresh_keys=["eval_methods", "eval_memory", "eval_task"],
                           refresh_inputs=[c.methods, c.memory, c.task],
                           refresh_outputs=[c.methods, c.memory, c.sweep_plugin, c.memory_warn], on_load=on_load,
                           load_outputs=[c.methods, c.memory, c.sweep_plugin, c.memory_warn, c.job_id, c.job_html],
                           persist=[("eval_memory", c.memory), ("eval_methods", c.methods), ("eval_task", c.task)],
                           restore=restore, restore_outputs=[c.methods, c.memory, c.memory_warn, c.task])
