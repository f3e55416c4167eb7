"""The read-only page of a shared comparison (``/share/?c=<id>``): a Gradio app of its own, mounted beside the studio,
with no studio component in it (its page config holds nothing but this view). It renders the stored payload only: no
memory, plug-in, job or sample of anyone is read, and kNN neighbours show token and distance without their samples.
Old links (``/?c=<id>``) are redirected here (``ui/app.py``)."""
from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from ground.errors import UserError
from ui import plots, rank, render
from ui.common import idle_queue
from ui.compare import TOKEN_COLORS, TOKEN_HELP, row_of, token_views
from ui.gradio_internals import make_private

SETTINGS_HEADERS = ["method", "kind", "decode settings", "tokens"]


def build(studio) -> SimpleNamespace:
    # A page's session keeps the share's id only, never the payload (up to share_bytes): what a visitor costs the
    # server stays small however many open the link (ui/server.py bounds the sessions), and a share its owner
    # deleted is gone from every open page at its next event.
    payload = gr.State(None)

    def read(sid):
        try:
            return studio.compare_service.shared(sid) if isinstance(sid, str) and sid else None
        except UserError:
            return None
    header = gr.HTML(elem_id="shared-header")
    with gr.Column() as body:
        cards = gr.HTML(elem_id="shared-outputs", js_on_load=render.CARDS_JS)
        settings = gr.Dataframe(headers=SETTINGS_HEADERS, interactive=False, max_height=200, wrap=True,
                                label="Methods and their settings")
        gr.Markdown("#### Token by token")
        with gr.Row(equal_height=True):
            row_pick = gr.Dropdown([], label="Method", scale=2)
            tok = gr.Slider(0, 1, 0, step=1, label="Output token", scale=3)
        chips = gr.HighlightedText([], color_map=TOKEN_COLORS, combine_adjacent=False, show_legend=True,
                                   label="Output tokens — click one")
        gr.HTML(f"<div class='pema-help'>{TOKEN_HELP}</div>")
        with gr.Row(equal_height=True):
            lam_plot = gr.Plot(show_label=False)
            bars_plot = gr.Plot(show_label=False)
        with gr.Row(equal_height=True):
            nb_plot = gr.Plot(show_label=False, visible=False)
            mem_att = gr.Plot(show_label=False, visible=False)
            att_plot = gr.Plot(show_label=False)

    def att_fig(p, label):
        row = row_of(p, label)
        att = (p.get("attention") or {}).get(row["label"]) if row else None
        return plots.input_attention_heatmap(att) if att else plots.empty("No attention map was stored")

    def views(sid, label, idx):
        return token_views_of(read(sid), label, idx)

    def token_views_of(p, label, idx):
        if p is None:
            e_fig = plots.empty("This shared comparison is no longer available")
            return [], e_fig, e_fig, gr.update(visible=False), gr.update(visible=False), e_fig
        ch, lp, bp, _, npl, ma = token_views(p, label, idx, neighbours=None)
        trace = (row_of(p, label) or {}).get("trace") or []
        has_nb = any(t.get("neighbours") for t in trace)
        has_mem = any(t.get("memory_attention") for t in trace)
        return (ch, lp, bp, gr.update(value=npl, visible=has_nb), gr.update(value=ma, visible=has_mem),
                att_fig(p, label))

    outs = [chips, lam_plot, bars_plot, nb_plot, mem_att, att_plot]

    def open_shared(sid: str):
        """Outputs for the whole view from the stored payload (or an error message)."""
        try:
            p = studio.compare_service.shared(sid)
        except UserError as e:
            msg = f"<div class='pema-status err'>{render.esc(e)} <a href='../'>Open the studio</a></div>"
            e_fig = plots.empty("")
            return (None, msg, gr.update(visible=False), "", [], gr.update(choices=[]), gr.update(), [], e_fig, e_fig,
                    gr.update(visible=False), gr.update(visible=False), e_fig)
        labels = [r["label"] for r in p["rows"]]
        first = row_of(p, None)["label"]
        row = row_of(p, first)
        rows = [[r["label"], r["method"], render._settings_text(r.get("settings")), r.get("n_tokens")]
                for r in p["rows"]]
        return (sid, render.shared_header(p), gr.update(visible=True), render.output_cards(p, shared=True), rows,
                gr.update(choices=labels, value=first), gr.update(maximum=max(1, len(row["trace"]) - 1), value=0),
                *token_views_of(p, first, 0))

    def on_row(sid, label):
        p = read(sid)
        row = row_of(p, label) if p is not None else None
        return (gr.update(maximum=max(1, len(row["trace"]) - 1) if row else 1, value=0),
                *token_views_of(p, label, 0))

    row_pick.input(on_row, [payload, row_pick], [tok, *outs], show_progress="hidden")
    tok.input(views, [payload, row_pick, tok], outs, trigger_mode="always_last", show_progress="hidden")

    def on_chip(sid, label, evt: gr.SelectData):
        i = evt.index if isinstance(evt.index, int) else (evt.index[0] if evt.index else 0)
        return (gr.update(value=i), *views(sid, label, i))

    chips.select(on_chip, [payload, row_pick], [tok, *outs], show_progress="hidden")

    return SimpleNamespace(open=open_shared,
                           outputs=[payload, header, body, cards, settings, row_pick, tok, *outs])


def build_app(studio) -> gr.Blocks:
    """The share page: the view above, filled on load from the link's ``c`` parameter; no API endpoints. A shared
    leaderboard (``studio.rank_service``) has the same kind of link and shows the leaderboard instead."""
    with gr.Blocks(title="PEMA Studio · shared comparison", analytics_enabled=False) as demo:
        sh = build(studio)
        lb = rank.build_shared()

        def on_load(request: gr.Request):
            sid = (dict(request.query_params).get("c") or "").strip() if request else ""
            try:
                board = studio.rank_service.shared_leaderboard(sid)
            except UserError:
                return (*sh.open(sid), *lb.hide())
            header = render.esc(f"Shared leaderboard · {board.get('task')} · {board.get('backbone')}")
            return (None, f"<div id='shared-leaderboard-header'><h3>{header}</h3></div>", gr.update(visible=False),
                    *[gr.skip()] * (len(sh.outputs) - 3), *lb.show(board))

        demo.load(on_load, None, [*sh.outputs, *lb.outputs], show_progress="hidden")
        make_private(demo)
    demo.queue(default_concurrency_limit=4, max_size=64)
    idle_queue(demo)
    return demo

