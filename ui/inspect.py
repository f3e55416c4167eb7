"""Compare tab: the neighbour map panel. For a kNN or PEMA row and one of its output tokens: where the query lands
on the memory's 2-D map (the memory profile's projection) — kNN: f(c) / key RMS; PEMA: h_pd — with its nearest
memory entries, each listed with its value token marked inside its sample's target
(``NeighbourMapService.neighbour_map``).

``mount(studio, payload)`` places the panel where it is called and follows the comparison in ``payload`` (a
``gr.State``): every new comparison refreshes the row and token choices, keeping the picked row and token when the
new one has them (a live control's re-decode)."""
from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from ground.errors import UserError
from plugins.registry import neighbour_map_of, shown_first
from ui import plots, render
from ui.common import owner_of, user_errors

MAP_HELP = ("The map is the memory profile's (Memories tab): a PCA of a seeded sample of the memory's keys, grey "
            "behind. The star is the query for the picked output token — kNN: the context's f(c) divided by the "
            "keys' RMS, as kNN searches; PEMA: h_pd = B_pd·A·f(c), the state its LM head reads, rescaled to the "
            "keys' RMS. Coloured dots are its nearest memory entries (green: their value is the output token). "
            "Two dimensions keep only part of the distances: the table's distances are the real ones.")


def mapped_rows(payload: dict | None) -> list[dict]:
    """The rows of a comparison that have a neighbour map (a kNN or PEMA plug-in), PEMA first."""
    rows = [r for r in (payload or {}).get("rows") or []
            if neighbour_map_of(r.get("method")) is not None and r.get("plugin_id")]
    return sorted(rows, key=lambda r: (not shown_first(r["method"]), r["method"]))


def output_token_choices(row: dict | None) -> list[tuple[str, int]]:
    """("3: “Haus”", 3) for each output token of a row."""
    texts = (row or {}).get("token_texts") or []
    return [(f"{i}: “{(t or '').replace(chr(10), '⏎') or '∅'}”", i) for i, t in enumerate(texts)]


def mount(studio, payload) -> SimpleNamespace:
    with gr.Column(elem_id="neighbour-panel"):
        gr.Markdown("#### Neighbour map — where this token's query lands among the memory's keys")
        with gr.Row(equal_height=True):
            row_pick = gr.Dropdown([], label="kNN or PEMA row", scale=2, elem_id="map-row")
            tok_pick = gr.Dropdown([], label="Output token", scale=3, elem_id="map-token")
        plot = gr.Plot(plots.neighbour_map(None), show_label=False, elem_id="neighbour-map")
        table = gr.HTML(render.neighbour_list(None), elem_id="neighbour-table")
        gr.HTML(f"<div class='pema-help'>{render.esc(MAP_HELP)}</div>")

    def view(p, label, idx, me):
        if not p or label is None or idx is None:
            return plots.neighbour_map(None), render.neighbour_list(None)
        try:
            m = studio.neighbour_map_service.neighbour_map(p["id"], label, int(idx), owner=me)
        except UserError as e:  # the comparison is gone (a restart), or a plug-in/memory was deleted since
            return plots.empty(str(e)[:140]), f"<div class='pema-error'>{render.esc(e)}</div>"
        return plots.neighbour_map(m), render.neighbour_list(m)

    @user_errors
    def on_payload(p, label, idx, request: gr.Request):
        me = owner_of(studio, request)
        if p:
            try:
                studio.compare_service.recent(p.get("id"), owner=me)
            except UserError:  # not a finished comparison of this owner (e.g. one still streaming): keep the map
                return tuple(gr.skip() for _ in range(4))
        rows = mapped_rows(p)
        if not rows:
            msg = "No kNN or PEMA row in this comparison: choose one of their plug-ins and compare again"
            return (gr.update(choices=[], value=None), gr.update(choices=[], value=None), plots.empty(msg),
                    render.neighbour_list(None))
        row = next((r for r in rows if r["label"] == label), rows[0])
        toks = output_token_choices(row)
        i = idx if isinstance(idx, int) and 0 <= idx < len(toks) and row["label"] == label else 0
        if not toks:
            return (gr.update(choices=[r["label"] for r in rows], value=row["label"]),
                    gr.update(choices=[], value=None), plots.empty(f"{row['label']} has no output tokens"),
                    render.neighbour_list(None))
        return (gr.update(choices=[r["label"] for r in rows], value=row["label"]),
                gr.update(choices=toks, value=i), *view(p, row["label"], i, me))

    @user_errors
    def on_row(p, label, request: gr.Request):
        row = next((r for r in mapped_rows(p) if r["label"] == label), None)
        toks = output_token_choices(row)
        if not toks:
            return gr.update(choices=[], value=None), plots.neighbour_map(None), render.neighbour_list(None)
        return (gr.update(choices=toks, value=0), *view(p, label, 0, owner_of(studio, request)))

    @user_errors
    def on_token(p, label, idx, request: gr.Request):
        return view(p, label, idx, owner_of(studio, request))

    payload.change(on_payload, [payload, row_pick, tok_pick], [row_pick, tok_pick, plot, table],
                   trigger_mode="always_last", show_progress="hidden", api_visibility="private")
    row_pick.input(on_row, [payload, row_pick], [tok_pick, plot, table], show_progress="hidden",
                   api_visibility="private")
    tok_pick.input(on_token, [payload, row_pick, tok_pick], [plot, table], trigger_mode="always_last",
                   show_progress="hidden", api_visibility="private")
    return SimpleNamespace(row=row_pick, token=tok_pick, plot=plot, table=table)
