"""Rank tab: "rank every method" on a memory (a background job: train or reuse, calibrate, evaluate) → the
leaderboard (chrF and sacreBLEU with 95 % intervals, Δ vs the base model with p, training time, trainable parameters,
decode cost per token, tuned settings), Pareto plots of quality against training time and against trainable
parameters, the verdict, the phases' wall times and a read-only share link; and the first-run tour: the demo corpus
ranked in one click, with a time estimate. ``build_shared`` is the same leaderboard on the share page."""
from __future__ import annotations

import math
from types import SimpleNamespace

import gradio as gr
import plotly.graph_objects as go

from eval.rank import ORDER_RULE, ordered
from ground.errors import UserError
from ground.jobs import FINAL_STATES
from plugins.registry import available_methods
from plugins.timing import minutes
from studio.rank_service import TOUR_CORPORA, TOUR_CORPUS, TOUR_LIMIT
from ui import plots, render
from ui.common import choices_update, job_poll_key, keep_value, memory_choices, owner_of, read_upload, user_errors

# The leaderboard in two tables that each fit a 1,200 px page: the scores, then (folded) each method's costs and
# settings, in the same order and numbering.
HEADERS = ["#", "method", "chrF [95% CI]", "Δ chrF (p; Holm p)", "sacreBLEU [95% CI]", "Δ sacreBLEU (p; Holm p)"]
COST_HEADERS = ["#", "method", "training", "trainable parameters", "decode cost / token",
                "settings (tuned on this memory)"]
TOUR_LABELS = {"translation": "Translation: English→German software messages (gettext-de)",
               "formality": "Formality: informal→formal English, the informal side synthetic (formality-en)"}
PARETO = {"training_seconds": "training time (s)", "trainable_parameters": "trainable parameters"}
ZERO = {"training_seconds": "none (0 s)", "trainable_parameters": "none (0)"}


def _ci(v) -> str:
    return f" [{v[0]:.1f}–{v[1]:.1f}]" if isinstance(v, (list, tuple)) and len(v) == 2 else ""


def _delta(r: dict, k: str) -> str:
    if r.get(f"{k}_delta") is None:
        return "—"
    p, ph = r.get(f"p_{k}"), r.get(f"p_{k}_holm")
    if not isinstance(p, (int, float)):
        return f"{r[f'{k}_delta']:+.2f}"
    return f"{r[f'{k}_delta']:+.2f} (p={p:.3f}" + (f"; Holm p={ph:.3f})" if isinstance(ph, (int, float)) else ")")


def _settings(r: dict) -> str:
    if r["method"] == "base":
        return "—"
    tuned = r.get("tuned")
    if tuned:
        return "tuned: " + ", ".join(f"{k}={v}" for k, v in tuned.items()) + (
            f" — {r['calibration_evidence']}" if r.get("calibration_evidence") else "")
    return "defaults" + (f" ({r['calibration_note']})" if r.get("calibration_note") else "")


def rows_in_order(board: dict | None) -> list[dict]:
    """The leaderboard's rows in its one order (``eval.rank.ordered``, which the verdict and the ★ follow), numbered
    1…n; a leaderboard stored before that order is put in it here (a share without ``better``: its best first)."""
    board = board or {}
    better = board.get("better")
    if better is None:
        better = [board["best"]] if board.get("best") else []
    return ordered([dict(r) for r in board.get("methods", [])], better)


def _name(r: dict) -> str:
    return r.get("title", r["method"]) + (" ★" if r.get("best") else "")


def table(board: dict | None) -> list[list]:
    """The leaderboard's score rows (``rows_in_order``; ★ marks the verdict's best method, row 1 when there is one)."""
    return [[r["rank"], _name(r), f"{r['chrf']:.2f}{_ci(r.get('chrf_ci95'))}", _delta(r, "chrf"),
             f"{r['sacrebleu']:.2f}{_ci(r.get('sacrebleu_ci95'))}", _delta(r, "sacrebleu")]
            for r in rows_in_order(board)]


def cost_table(board: dict | None) -> list[list]:
    """Each row's costs and settings, in the score table's order and numbering."""
    out = []
    for r in rows_in_order(board):
        secs = r.get("training_seconds")
        out.append([r["rank"], _name(r),
                    "—" if r["method"] == "base" else ("none" if secs == 0 else minutes(secs)
                                                       if isinstance(secs, (int, float)) else "?")
                    + (" (reused)" if r.get("reused") else ""),
                    f"{int(r.get('trainable_parameters') or 0):,}",
                    "—" if r.get("decode_cost") is None else f"{r['decode_cost']:.2f}×", _settings(r)])
    return out


def verdict_html(board: dict | None) -> str:
    if not board:
        return "<div class='pema-muted'>No leaderboard yet.</div>"
    d = board.get("data") or {}
    where = "test pairs" if d.get("report_source") == "test file" else "held-out samples (report part)"
    mem = board.get("memory") or {}
    # the owner's view names the memory; a shared leaderboard holds only its size
    on = (f"Memory {mem['name']} ({mem.get('train_samples')} training samples). " if mem.get("name") else
          f"A memory of {mem['train_samples']} training samples. " if mem.get("train_samples") else "")
    info = (f"{on}Scored on {d.get('report')} {where}; the interpolating methods were tuned on {d.get('tune')} other "
            f"held-out samples, never scored. Backbone {board.get('backbone')}, task {board.get('task')}. "
            f"p: one-sided paired bootstrap against the base model ({board.get('bootstrap')} resamples); Holm p: "
            f"adjusted for the number of methods compared — the verdict claims a method better or worse only on it.")
    phases = board.get("phases") or {}
    ph = " · ".join(f"{k.replace('_', ' ')} {minutes(v)}" for k, v in phases.items() if isinstance(v, (int, float)))
    warn = f"<div class='pema-warn'>{render.esc(d['warning'])}</div>" if d.get("warning") else ""
    return (f"<div id='rank-verdict-text' class='pema-verdict'><b>{render.esc(board.get('verdict', ''))}</b></div>"
            f"<div class='pema-help'>{render.esc(info)}</div>{warn}"
            f"<div class='pema-help' id='rank-order'>{render.esc(ORDER_RULE)}</div>"
            f"<div class='pema-help' id='rank-phases'>Wall time per phase: {render.esc(ph)}</div>"
            + render.rank_transfer_html(board))


def _points(rows: list[dict], key: str, front: set, zero: bool) -> list[go.Scatter]:
    """One trace per method (its legend entry: "#. title"), the marker numbered like the table's row."""
    out = []
    for r in rows:
        star = bool(r.get("best"))
        out.append(go.Scatter(
            x=[ZERO[key]] if zero else [float(r[key])], y=[r["chrf"]], mode="markers+text", cliponaxis=False,
            name=f"{r['rank']}. {_name(r)}", legendrank=r["rank"], text=[str(r["rank"])], textposition="top center",
            marker=dict(size=14 if star else 11, color=plots.COLORS[(r["rank"] - 1) % len(plots.COLORS)],
                        symbol="star" if star else ("circle" if r["method"] in front else "circle-open"),
                        line=dict(width=1.5)),
            customdata=[[r.get("title", r["method"]), "none" if zero else f"{r[key]:,.4g}", r.get("chrf_delta"),
                         r.get("p_chrf")]],
            hovertemplate="%{customdata[0]}<br>" + PARETO[key] + ": %{customdata[1]}<br>chrF %{y:.2f} "
                          "(Δ %{customdata[2]:+.2f}, p=%{customdata[3]:.3f})<extra></extra>",
            xaxis="x2" if not zero else "x", yaxis="y"))
    return out


def pareto_figure(board: dict | None, key: str = "training_seconds") -> go.Figure:
    """chrF against ``key`` (log scale), one point per method numbered like the table, the Pareto front joined, the
    base model as a dashed line (as the PEFT method-comparison Space draws them, on the user's data). A method that
    costs nothing (no training, no trainable parameter) has no place on a log axis: it is drawn in a narrow panel of
    its own on the left, "none", not at a made-up 0.1 s or 1 parameter."""
    rows = [r for r in rows_in_order(board) if isinstance(r.get("chrf"), (int, float))]
    if not rows:
        return plots.empty("Rank the methods to see the trade-off")
    pts = [r for r in rows if r["method"] != "base" and isinstance(r.get(key), (int, float))]
    zero, pos = [r for r in pts if r[key] <= 0], [r for r in pts if r[key] > 0]
    front = set((board.get("pareto") or {}).get(key) or [])
    fig = go.Figure()
    fp = sorted((float(r[key]), r["chrf"]) for r in pos if r["method"] in front)
    if len(fp) > 1:
        fig.add_trace(go.Scatter(x=[a for a, _ in fp], y=[b for _, b in fp], mode="lines", showlegend=False,
                                 line=dict(color="#94a3b8", dash="dot", shape="hv"), hoverinfo="skip",
                                 xaxis="x2", yaxis="y"))
    for t in _points(zero, key, front, True) + _points(pos, key, front, False):
        fig.add_trace(t)
    split = 0.16 if zero else 0.0  # the "none" panel's share of the width
    fig.update_layout(xaxis=dict(domain=[0, max(split - 0.02, 0.0)], visible=bool(zero), type="category",
                                 tickangle=0, showgrid=False),
                      xaxis2=dict(domain=[split, 1], type="log", title=PARETO[key], anchor="y"),
                      yaxis=dict(title="chrF", anchor="x" if zero else "x2"))
    _pareto_ranges(fig, rows, [float(r[key]) for r in pos])
    base = next((r for r in rows if r["method"] == "base"), None)
    if base is not None:
        fig.add_shape(type="line", xref="paper", x0=0, x1=1, yref="y", y0=base["chrf"], y1=base["chrf"],
                      line=dict(color="#64748b", dash="dash"))
        fig.add_annotation(xref="paper", x=1, xanchor="right", yref="y", y=base["chrf"], yanchor="top",
                           text=f"base model {base['chrf']:.1f}", showarrow=False, font=dict(color="#64748b"))
    plots._layout(fig, f"Quality vs {PARETO[key]}", height=400)
    fig.update_layout(showlegend=True, margin=dict(l=56, r=24, t=40, b=40),
                      legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0, font=dict(size=11)))
    return fig


def _pareto_ranges(fig: go.Figure, rows: list[dict], x: list[float]) -> None:
    """Room around the points: for the numbers above them and the legend, and a decade each side on a narrow log
    axis."""
    top, low = max(r["chrf"] for r in rows), min(r["chrf"] for r in rows)
    pad = max(1.0, (top - low) * 0.15)
    fig.update_layout(yaxis=dict(range=[low - pad, top + 2 * pad]))
    if x and max(x) / min(x) < 10:
        fig.update_layout(xaxis2=dict(range=[math.log10(min(x)) - 1, math.log10(max(x)) + 1]))


def views(board: dict | None) -> tuple:
    """(verdict, table, costs table, Pareto vs training time, Pareto vs parameters) of a leaderboard."""
    return (verdict_html(board), gr.update(value={"headers": HEADERS, "data": table(board)}),
            gr.update(value={"headers": COST_HEADERS, "data": cost_table(board)}),
            pareto_figure(board, "training_seconds"), pareto_figure(board, "trainable_parameters"))


def leaderboard_components(prefix: str = "rank"):
    verdict = gr.HTML(verdict_html(None), elem_id=f"{prefix}-verdict")
    # shares of the width, not the cells' lengths: the table wraps inside its column instead of running past the page
    # tall enough for every registered method and the base model (two lines a row) without an inner scroll bar
    df = gr.Dataframe(headers=HEADERS, interactive=False, wrap=True, label="Leaderboard", elem_id=f"{prefix}-table",
                      show_search="none", max_height=640, column_widths=["4%", "26%", "14%", "21%", "14%", "21%"])
    with gr.Accordion("Costs and settings of each method (training time, trainable parameters, decode cost, tuned "
                      "settings)", open=False, elem_id=f"{prefix}-costs-fold"):
        costs = gr.Dataframe(headers=COST_HEADERS, interactive=False, wrap=True, show_label=False,
                             elem_id=f"{prefix}-costs", show_search="none", max_height=420,
                             column_widths=["4%", "24%", "12%", "12%", "10%", "38%"])
    with gr.Row(equal_height=True):
        p_time = gr.Plot(pareto_figure(None), show_label=False, elem_id=f"{prefix}-pareto-time")
        p_params = gr.Plot(pareto_figure(None), show_label=False, elem_id=f"{prefix}-pareto-params")
    return [verdict, df, costs, p_time, p_params]


def _tour_panel(c: SimpleNamespace, corpora: dict) -> None:
    """The first-run tour: a demo corpus (one per task) ranked in one click, with a time estimate."""
    with gr.Group(visible=TOUR_CORPUS in corpora, elem_id="rank-tour"):
        gr.Markdown(f"#### New here? See a real ranking without bringing data\nOne click builds a memory of "
                    f"{TOUR_LIMIT:,} samples of a demo corpus, trains every method on it with its defaults, tunes "
                    f"PEMA and kNN on part of its held-out samples and ranks all of them on the rest.")
        tasks = [t for t, k in TOUR_CORPORA.items() if k in corpora]
        c.tour_task = gr.Radio([(TOUR_LABELS[t], t) for t in tasks], value=tasks[0] if tasks else None,
                               show_label=False, container=False, elem_id="rank-tour-task")
        with gr.Row(equal_height=True):
            c.tour_est = gr.HTML(elem_id="rank-tour-estimate")
            c.tour = gr.Button("Rank every method on the demo corpus", variant="primary", scale=0, min_width=300,
                               elem_id="rank-tour-run")


def _ranking_panel(c: SimpleNamespace) -> None:
    """The memory and the methods."""
    c.memory = gr.Dropdown([], label="Memory", elem_id="rank-memory")
    c.methods = gr.CheckboxGroup([(m.title, k) for k, m in available_methods().items()],
                                 value=list(available_methods()), label="Methods (default: every method)",
                                 elem_id="rank-methods")


def _run_panel(c: SimpleNamespace) -> None:
    """An optional test file, the time estimate, Rank and Cancel, and right under them the job's card and Share."""
    c.test_file = gr.File(label="…report on a test file of pairs instead of the held-out samples (optional)",
                          type="filepath", file_types=[".jsonl", ".json", ".csv", ".tsv"],
                          elem_id="rank-test-file")
    c.estimate = gr.HTML(elem_id="rank-estimate")
    with gr.Row():
        c.run = gr.Button("Rank every method", variant="primary", elem_id="rank-run", scale=3)
        c.cancel = gr.Button("Cancel", scale=1, elem_id="rank-cancel", interactive=False)  # on while a ranking runs
    gr.Markdown("Trains each method with its defaults (a plug-in already trained with the same settings on "
                "this memory is reused), tunes the interpolating ones on part of the held-out samples, "
                "scores every method and the base model on the rest. One job; the trainings run one after "
                "another.", elem_classes=["pema-help"])
    c.job_html = gr.HTML(render.job_card(None), elem_id="rank-job")
    with gr.Row(equal_height=True):
        c.share = gr.Button("Share this leaderboard", size="sm", scale=0, min_width=200, elem_id="rank-share")
        c.share_link = gr.HTML(elem_id="rank-share-link")


def _estimate_text(studio, mid, ms, me) -> str:
    if not mid:
        return ""
    try:
        e = studio.rank_service.rank_estimate(mid, methods=list(ms or []) or None, owner=me)
    except UserError as err:
        return f"<div class='pema-status err'>{render.esc(err)}</div>"
    return f"<div class='pema-help'>Time estimate before you start: {render.esc(e['text'])}</div>"


def _tour_text(studio, me) -> str:
    try:
        e = studio.rank_service.rank_estimate(corpus=TOUR_CORPUS, owner=me)
    except UserError as err:
        return f"<div class='pema-status err'>{render.esc(err)}</div>"
    return (f"<div class='pema-help' id='rank-tour-time'>Time estimate on this machine: "
            f"{render.esc(e['text'])}</div>")


def _wire_ranking(studio, c: SimpleNamespace) -> None:
    """The estimate follows the memory and methods; Rank, the tour, Cancel and Share."""
    @user_errors
    def on_pick(mid, ms, jid, request: gr.Request):
        me = owner_of(studio, request)
        try:
            running = bool(jid) and studio.job_service.job(jid, owner=me)["state"] not in FINAL_STATES
        except UserError:
            running = False
        return RUNNING_NOTE if running else _estimate_text(studio, mid, ms, me)

    c.memory.change(on_pick, [c.memory, c.methods, c.job_id], c.estimate, show_progress="hidden")
    c.methods.input(on_pick, [c.memory, c.methods, c.job_id], c.estimate, show_progress="hidden")

    def started(jid, me):
        return (jid, "", *_job_view(studio, c, studio.job_service.job(jid, owner=me), me, clear=True))

    @user_errors
    def do_run(request: gr.Request, mid, ms, path):
        me = owner_of(studio, request)
        data, fname = read_upload(studio, request, path)
        jid = studio.rank_service.submit_rank(mid, methods=list(ms or []) or None, test_data=data, test_filename=fname,
                                              owner=me)
        studio.uploads.consume(path)
        return started(jid, me)

    @user_errors
    def do_tour(task, request: gr.Request):
        me = owner_of(studio, request)
        return started(studio.rank_service.submit_rank(corpus=TOUR_CORPORA.get(task, TOUR_CORPUS), owner=me), me)

    outs = [c.job_id, c.share_link, *c.poll_outputs]
    # the card is where the eyes are: scrolled into view under the button just pressed
    show_card = "() => document.querySelector('#rank-job')?.scrollIntoView({block: 'nearest', behavior: 'smooth'})"
    c.run.click(do_run, [c.memory, c.methods, c.test_file], outs, api_visibility="private").then(
        None, js=show_card)
    c.tour.click(do_tour, c.tour_task, outs, api_visibility="private").then(None, js=show_card)

    @user_errors
    def do_cancel(jid, request: gr.Request):
        if not jid:
            raise UserError("No ranking to cancel.")
        return render.job_card(studio.job_service.cancel_job(jid, owner=owner_of(studio, request)))

    c.cancel.click(do_cancel, c.job_id, c.job_html, api_visibility="private")

    @user_errors
    def do_share(jid, request: gr.Request):
        if not jid:
            raise UserError("Rank the methods first: there is no leaderboard to share.")
        sid = studio.rank_service.share_leaderboard(jid, owner=owner_of(studio, request))
        link = f"/share/?c={sid}"
        return (f"<div class='pema-help'>Read-only link (scores, settings and verdict; no ids, names or samples): "
                f"<a id='rank-share-url' href='{render.esc(link)}' target='_blank'>{render.esc(link)}</a></div>")

    c.share.click(do_share, c.job_id, c.share_link, api_visibility="private")


RUNNING_NOTE = "<div class='pema-help'>A ranking is running: its card says how long it has to go.</div>"


def _job_view(studio, c: SimpleNamespace, job: dict | None, me, mid=None, ms=None, clear: bool = False) -> tuple:
    """``c.poll_outputs`` for a ranking job: its card; while it runs, the Rank buttons disabled and Cancel enabled,
    the estimates before a run replaced by a note (the card's ETA is the only one shown) and the poll on; once it
    ends (and with no job), the leaderboard, the buttons and estimates back, Cancel off and the poll off (an idle page
    offers nothing to cancel and polls nothing)."""
    n = len(c.board_outputs)
    if job is None:
        return (render.job_card(None), *[gr.skip()] * n, None, gr.skip(), gr.skip(), gr.update(interactive=False),
                gr.skip(), gr.skip(), gr.Timer(active=False))
    card, key, running = render.job_card(job), job_poll_key(job), job["state"] not in FINAL_STATES
    if running:
        off = gr.update(interactive=False)
        return (card, *(views(None) if clear else [gr.skip()] * n), key, off, off, gr.update(interactive=True),
                RUNNING_NOTE, RUNNING_NOTE, gr.Timer(active=True))
    board = (job.get("result") or {}).get("leaderboard") if job["state"] == "done" else None
    on = gr.update(interactive=True)
    return (card, *views(board), key, on, on, gr.update(interactive=False), _estimate_text(studio, mid, ms, me),
            _tour_text(studio, me), gr.Timer(active=False))


def _wire_poll(studio, c: SimpleNamespace) -> None:
    """The job's card while it runs; the leaderboard when it ends (the poll runs only meanwhile)."""
    def tick(jid, last, mid, ms, request: gr.Request):
        skip = [gr.skip()] * (len(c.poll_outputs) - 1)
        try:
            me = owner_of(studio, request)
            job = studio.job_service.job(jid, owner=me) if jid else None
        except UserError:
            job = None
        if job is None:
            return (*skip, gr.Timer(active=False))
        if job_poll_key(job) == last:
            return (*skip, gr.skip())
        if job["state"] not in FINAL_STATES:
            return (render.job_card(job), *[gr.skip()] * len(c.board_outputs), job_poll_key(job),
                    *[gr.skip()] * 6)
        return _job_view(studio, c, job, me, mid, ms)

    c.timer.tick(tick, [c.job_id, c.seen, c.memory, c.methods], c.poll_outputs, show_progress="hidden",
                 api_visibility="private")


def build(studio) -> SimpleNamespace:
    c = SimpleNamespace(job_id=gr.State(None), seen=gr.State(None))
    _tour_panel(c, studio.memory_service.corpora())
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=320):
            _ranking_panel(c)
        with gr.Column(scale=3, min_width=440):
            _run_panel(c)
    c.board_outputs = leaderboard_components("rank")
    c.timer = gr.Timer(1.5, active=False)  # on only while a ranking runs
    c.poll_outputs = [c.job_html, *c.board_outputs, c.seen, c.run, c.tour, c.cancel, c.estimate, c.tour_est,
                      c.timer]
    _wire_ranking(studio, c)
    _wire_poll(studio, c)

    def lists(me, mem_value=None, default=None):
        mchoices = memory_choices(studio, me)
        return (choices_update(mchoices, mem_value, default),
                _estimate_text(studio, keep_value(mchoices, mem_value or default), None, me))

    def last_rank(me):
        """The caller's latest rank job and its memory: the picker starts there, whether the page's load or the
        tab's refresh answers first (both use it, so neither undoes the other)."""
        last = studio.job_service.list_jobs(("rank",), 1, owner=me)
        return (last[0] if last else None), ((last[0].get("args") or {}).get("memory_id") if last else None)

    @user_errors
    def refresh(mem_value, request: gr.Request):
        me = owner_of(studio, request)
        last, ranked = last_rank(me)
        picker, estimate = lists(me, mem_value, ranked)
        return picker, (RUNNING_NOTE if last and last["state"] not in FINAL_STATES else estimate)

    def on_load(me):
        """The picker, and the latest ranking as the poll would show it (its leaderboard when it has ended; the
        poll on while it runs)."""
        last, ranked = last_rank(me)
        mchoices = memory_choices(studio, me)
        mid = keep_value(mchoices, ranked)
        view = list(_job_view(studio, c, last, me, mid))
        if last is None:  # no ranking yet: the estimates before a run
            i = c.poll_outputs.index(c.estimate)
            view[i], view[i + 1] = _estimate_text(studio, mid, None, me), _tour_text(studio, me)
        return (choices_update(mchoices, None, ranked), last["id"] if last else None, *view)

    return SimpleNamespace(refresh=refresh, refresh_keys=[None], refresh_inputs=[c.memory],
                           refresh_outputs=[c.memory, c.estimate], on_load=on_load,
                           load_outputs=[c.memory, c.job_id, *c.poll_outputs], persist=[],
                           restore=lambda me, saved: (), restore_outputs=[])


def build_shared() -> SimpleNamespace:
    """The leaderboard on the share page (hidden until a shared leaderboard is opened)."""
    with gr.Column(visible=False) as body:
        outs = leaderboard_components("shared-rank")
    return SimpleNamespace(body=body, outputs=[body, *outs],
                           show=lambda p: (gr.update(visible=True), *views(p)),
                           hide=lambda: (gr.update(visible=False), *[gr.skip()] * len(outs)))
