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

from ground.errors import UserError
from ground.jobs import FINAL_STATES
from plugins.registry import available_methods
from plugins.timing import minutes
from studio.rank_service import TOUR_CORPUS, TOUR_LIMIT
from ui import plots, render
from ui.common import choices_update, job_poll_key, keep_value, memory_choices, owner_of, read_upload, user_errors

HEADERS = ["#", "method", "chrF [95% CI]", "sacreBLEU [95% CI]", "Δ chrF (p)", "Δ sacreBLEU (p)", "training",
           "trainable parameters", "decode cost / token", "settings (tuned on this memory)"]
PARETO = {"training_seconds": "training time (s)", "trainable_parameters": "trainable parameters"}


def _ci(v) -> str:
    return f" [{v[0]:.1f}–{v[1]:.1f}]" if isinstance(v, (list, tuple)) and len(v) == 2 else ""


def _delta(r: dict, k: str) -> str:
    if r.get(f"{k}_delta") is None:
        return "—"
    p = r.get(f"p_{k}")
    return f"{r[f'{k}_delta']:+.2f} (p={p:.3f})" if isinstance(p, (int, float)) else f"{r[f'{k}_delta']:+.2f}"


def _settings(r: dict) -> str:
    if r["method"] == "base":
        return "—"
    tuned = r.get("tuned")
    if tuned:
        return "tuned: " + ", ".join(f"{k}={v}" for k, v in tuned.items())
    return "defaults" + (f" ({r['calibration_note']})" if r.get("calibration_note") else "")


def table(board: dict | None) -> list[list]:
    """The leaderboard's rows for the table (best first; ★ marks the verdict's best method)."""
    out = []
    for r in (board or {}).get("methods", []):
        secs = r.get("training_seconds")
        out.append([r.get("rank"), r.get("title", r["method"]) + (" ★" if r.get("best") else ""),
                    f"{r['chrf']:.2f}{_ci(r.get('chrf_ci95'))}", f"{r['sacrebleu']:.2f}{_ci(r.get('sacrebleu_ci95'))}",
                    _delta(r, "chrf"), _delta(r, "sacrebleu"),
                    "—" if r["method"] == "base" else (minutes(secs) if isinstance(secs, (int, float)) else "?")
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
            f"p: one-sided paired bootstrap against the base model ({board.get('bootstrap')} resamples).")
    phases = board.get("phases") or {}
    ph = " · ".join(f"{k.replace('_', ' ')} {minutes(v)}" for k, v in phases.items() if isinstance(v, (int, float)))
    warn = f"<div class='pema-warn'>{render.esc(d['warning'])}</div>" if d.get("warning") else ""
    return (f"<div id='rank-verdict-text' class='pema-verdict'><b>{render.esc(board.get('verdict', ''))}</b></div>"
            f"<div class='pema-help'>{render.esc(info)}</div>{warn}"
            f"<div class='pema-help' id='rank-phases'>Wall time per phase: {render.esc(ph)}</div>")


def pareto_figure(board: dict | None, key: str = "training_seconds") -> go.Figure:
    """chrF against ``key`` (log scale), one point per method, the Pareto front joined, the base model as a
    dashed line (as the PEFT method-comparison Space draws them, on the user's data)."""
    rows = [r for r in (board or {}).get("methods", []) if isinstance(r.get("chrf"), (int, float))]
    if not rows:
        return plots.empty("Rank the methods to see the trade-off")
    base = next((r for r in rows if r["method"] == "base"), None)
    pts = [r for r in rows if r["method"] != "base" and isinstance(r.get(key), (int, float))]
    front = set((board.get("pareto") or {}).get(key) or [])
    floor = 0.1 if key == "training_seconds" else 1.0  # a log axis: nothing trained / no parameters sits here
    x = [max(floor, float(r[key])) for r in pts]
    fig = go.Figure()
    fp = sorted([(xv, r["chrf"]) for xv, r in zip(x, pts) if r["method"] in front])
    if len(fp) > 1:
        fig.add_trace(go.Scatter(x=[a for a, _ in fp], y=[b for _, b in fp], mode="lines", name="Pareto front",
                                 line=dict(color="#94a3b8", dash="dot", shape="hv"), hoverinfo="skip"))
    fig.add_trace(go.Scatter(
        x=x, y=[r["chrf"] for r in pts], mode="markers+text", name="methods",
        text=[r["method"] + (" ★" if r.get("best") else "") for r in pts], textposition="top center",
        marker=dict(size=11, color=[plots.COLORS[i % len(plots.COLORS)] for i in range(len(pts))],
                    symbol=["star" if r.get("best") else ("circle" if r["method"] in front else "circle-open")
                            for r in pts], line=dict(width=1.5)),
        customdata=[[r.get("title", r["method"]), r.get(key), r.get("chrf_delta"), r.get("p_chrf")] for r in pts],
        hovertemplate="%{customdata[0]}<br>" + PARETO[key] + ": %{customdata[1]:,}<br>chrF %{y:.2f} "
                      "(Δ %{customdata[2]:+.2f}, p=%{customdata[3]:.3f})<extra></extra>"))
    if base is not None:
        fig.add_hline(y=base["chrf"], line=dict(color="#64748b", dash="dash"),
                      annotation_text=f"base model {base['chrf']:.1f}", annotation_position="bottom right")
    fig.update_xaxes(type="log", title=PARETO[key])
    fig.update_yaxes(title="chrF")
    top = max(r["chrf"] for r in rows)
    low = min(r["chrf"] for r in rows)
    pad = max(1.0, (top - low) * 0.15)
    fig.update_yaxes(range=[low - pad, top + 2 * pad])
    if x and max(x) / min(x) < 10:
        fig.update_xaxes(range=[math.log10(min(x)) - 1, math.log10(max(x)) + 1])
    return plots._layout(fig, f"Quality vs {PARETO[key]}", height=330, showlegend=False)


def views(board: dict | None) -> tuple:
    """(verdict, table, Pareto vs training time, Pareto vs parameters) of a leaderboard."""
    return (verdict_html(board), gr.update(value={"headers": HEADERS, "data": table(board)}),
            pareto_figure(board, "training_seconds"), pareto_figure(board, "trainable_parameters"))


def leaderboard_components(prefix: str = "rank"):
    verdict = gr.HTML(verdict_html(None), elem_id=f"{prefix}-verdict")
    df = gr.Dataframe(headers=HEADERS, interactive=False, wrap=True, label="Leaderboard", elem_id=f"{prefix}-table",
                      show_search="none", max_height=420)
    with gr.Row(equal_height=True):
        p_time = gr.Plot(pareto_figure(None), show_label=False, elem_id=f"{prefix}-pareto-time")
        p_params = gr.Plot(pareto_figure(None), show_label=False, elem_id=f"{prefix}-pareto-params")
    return [verdict, df, p_time, p_params]


def _tour_panel(c: SimpleNamespace, corpora: dict) -> None:
    """The first-run tour: the demo corpus ranked in one click, with a time estimate."""
    with gr.Group(visible=TOUR_CORPUS in corpora, elem_id="rank-tour"):
        gr.Markdown(f"#### New here? See a real ranking without bringing data\nOne click builds a memory of "
                    f"{TOUR_LIMIT:,} English→German software messages (the demo corpus), trains every method on it "
                    f"with its defaults, tunes PEMA and kNN on part of its held-out samples and ranks all of them "
                    f"on the rest.")
        with gr.Row(equal_height=True):
            c.tour_est = gr.HTML(elem_id="rank-tour-estimate")
            c.tour = gr.Button("Rank every method on the demo corpus", variant="primary", scale=0, min_width=300,
                               elem_id="rank-tour-run")


def _ranking_panel(c: SimpleNamespace) -> None:
    """The memory, the methods, an optional test file, the time estimate, Rank and Cancel."""
    c.memory = gr.Dropdown([], label="Memory", elem_id="rank-memory")
    c.methods = gr.CheckboxGroup([(m.title, k) for k, m in available_methods().items()],
                                 value=list(available_methods()), label="Methods (default: every method)",
                                 elem_id="rank-methods")
    c.test_file = gr.File(label="…report on a test file of pairs instead of the held-out samples (optional)",
                          type="filepath", file_types=[".jsonl", ".json", ".csv", ".tsv"],
                          elem_id="rank-test-file")
    c.estimate = gr.HTML(elem_id="rank-estimate")
    with gr.Row():
        c.run = gr.Button("Rank every method", variant="primary", elem_id="rank-run", scale=3)
        c.cancel = gr.Button("Cancel", scale=1, elem_id="rank-cancel")
    gr.Markdown("Trains each method with its defaults (a plug-in already trained with the same settings on "
                "this memory is reused), tunes the interpolating ones on part of the held-out samples, "
                "scores every method and the base model on the rest. One job; the trainings run one after "
                "another.", elem_classes=["pema-help"])


def _estimate_text(studio, mid, ms, me) -> str:
    if not mid:
        return ""
    try:
        e = studio.rank_estimate(mid, methods=list(ms or []) or None, owner=me)
    except UserError as err:
        return f"<div class='pema-status err'>{render.esc(err)}</div>"
    return f"<div class='pema-help'>Time estimate: {render.esc(e['text'])}</div>"


def _tour_text(studio, me) -> str:
    try:
        e = studio.rank_estimate(corpus=TOUR_CORPUS, owner=me)
    except UserError as err:
        return f"<div class='pema-status err'>{render.esc(err)}</div>"
    return (f"<div class='pema-help' id='rank-tour-time'>Time estimate on this machine: "
            f"{render.esc(e['text'])}</div>")


def _wire_ranking(studio, c: SimpleNamespace) -> None:
    """The estimate follows the memory and methods; Rank, the tour, Cancel and Share."""
    @user_errors
    def on_pick(mid, ms, request: gr.Request):
        return _estimate_text(studio, mid, ms, owner_of(studio, request))

    c.memory.change(on_pick, [c.memory, c.methods], c.estimate, show_progress="hidden")
    c.methods.input(on_pick, [c.memory, c.methods], c.estimate, show_progress="hidden")

    def started(jid, me):
        return (jid, render.job_card(studio.job(jid, owner=me)), None, "", *views(None))

    @user_errors
    def do_run(request: gr.Request, mid, ms, path):
        me = owner_of(studio, request)
        data, fname = read_upload(studio, request, path)
        jid = studio.submit_rank(mid, methods=list(ms or []) or None, test_data=data, test_filename=fname, owner=me)
        studio.uploads.consume(path)
        return started(jid, me)

    @user_errors
    def do_tour(request: gr.Request):
        me = owner_of(studio, request)
        return started(studio.submit_rank(corpus=TOUR_CORPUS, owner=me), me)

    outs = [c.job_id, c.job_html, c.seen, c.share_link, *c.board_outputs]
    c.run.click(do_run, [c.memory, c.methods, c.test_file], outs, api_visibility="private")
    c.tour.click(do_tour, None, outs, api_visibility="private")

    @user_errors
    def do_cancel(jid, request: gr.Request):
        if not jid:
            raise UserError("No ranking to cancel.")
        return render.job_card(studio.cancel_job(jid, owner=owner_of(studio, request)))

    c.cancel.click(do_cancel, c.job_id, c.job_html, api_visibility="private")

    @user_errors
    def do_share(jid, request: gr.Request):
        if not jid:
            raise UserError("Rank the methods first: there is no leaderboard to share.")
        sid = studio.share_leaderboard(jid, owner=owner_of(studio, request))
        link = f"/share/?c={sid}"
        return (f"<div class='pema-help'>Read-only link (scores, settings and verdict; no ids, names or samples): "
                f"<a id='rank-share-url' href='{render.esc(link)}' target='_blank'>{render.esc(link)}</a></div>")

    c.share.click(do_share, c.job_id, c.share_link, api_visibility="private")


def _wire_poll(studio, c: SimpleNamespace) -> None:
    """The job's card while it runs; the leaderboard when it ends."""
    def tick(jid, last, request: gr.Request):
        n_out = 1 + len(c.board_outputs)
        if not jid:
            return (*[gr.skip()] * n_out, last)
        try:
            job = studio.job(jid, owner=owner_of(studio, request))
        except UserError:
            return (*[gr.skip()] * n_out, last)
        key = job_poll_key(job)
        if key == last:
            return (*[gr.skip()] * n_out, last)
        if job["state"] in FINAL_STATES:
            board = (job.get("result") or {}).get("leaderboard") if job["state"] == "done" else None
            return (render.job_card(job), *views(board), key)
        return (render.job_card(job), *[gr.skip()] * len(c.board_outputs), key)

    c.timer.tick(tick, [c.job_id, c.seen], [c.job_html, *c.board_outputs, c.seen], show_progress="hidden",
                 api_visibility="private")


def build(studio) -> SimpleNamespace:
    c = SimpleNamespace(job_id=gr.State(None), seen=gr.State(None))
    _tour_panel(c, studio.corpora())
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=320):
            _ranking_panel(c)
        with gr.Column(scale=3, min_width=440):
            c.job_html = gr.HTML(render.job_card(None), elem_id="rank-job")
            with gr.Row(equal_height=True):
                c.share = gr.Button("Share this leaderboard", size="sm", scale=0, min_width=200,
                                    elem_id="rank-share")
                c.share_link = gr.HTML(elem_id="rank-share-link")
    c.board_outputs = leaderboard_components("rank")
    c.timer = gr.Timer(1.5)
    _wire_ranking(studio, c)
    _wire_poll(studio, c)

    def lists(me, mem_value=None, default=None):
        mchoices = memory_choices(studio, me)
        return (choices_update(mchoices, mem_value, default),
                _estimate_text(studio, keep_value(mchoices, mem_value or default), None, me))

    def last_rank(me):
        """The caller's latest rank job and its memory: the picker starts there, whether the page's load or the
        tab's refresh answers first (both use it, so neither undoes the other)."""
        last = studio.list_jobs(("rank",), 1, owner=me)
        return (last[0] if last else None), ((last[0].get("args") or {}).get("memory_id") if last else None)

    @user_errors
    def refresh(mem_value, request: gr.Request):
        me = owner_of(studio, request)
        return lists(me, mem_value, last_rank(me)[1])

    def on_load(me):
        last, ranked = last_rank(me)
        return (*lists(me, None, ranked), _tour_text(studio, me), last["id"] if last else None,
                render.job_card(last))

    return SimpleNamespace(refresh=refresh, refresh_keys=[None], refresh_inputs=[c.memory],
                           refresh_outputs=[c.memory, c.estimate], on_load=on_load,
                           load_outputs=[c.memory, c.estimate, c.tour_est, c.job_id, c.job_html], persist=[],
                           restore=lambda me, saved: (), restore_outputs=[])


def build_shared() -> SimpleNamespace:
    """The leaderboard on the share page (hidden until a shared leaderboard is opened)."""
    with gr.Column(visible=False) as body:
        outs = leaderboard_components("shared-rank")
    return SimpleNamespace(body=body, outputs=[body, *outs],
                           show=lambda p: (gr.update(visible=True), *views(p)),
                           hide=lambda: (gr.update(visible=False), *[gr.skip()] * len(outs)))
