"""The owner's shared links (comparisons and leaderboards): listed, and deleted one by one (the link stops working at
once and the share no longer counts against ``shares_per_owner``). The API has the same: ``/shares``,
``/delete_share``."""
from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from ground.errors import UserError
from ui import render
from ui.common import owner_of

HEADERS = ["id", "what", "shared", "input"]


def rows(studio, owner) -> list[list]:
    return [[s["id"], s["kind"], render.when(s["created"], short=True), (s.get("source") or "")[:80]]
            for s in studio.compare_service.shares(owner=owner)]


def build(studio) -> SimpleNamespace:
    with gr.Accordion("Your shared links", open=False, elem_id="shares-panel"):
        gr.Markdown("Everything you shared, newest first. Deleting a share makes its link stop working at once.")
        table = gr.Dataframe(headers=HEADERS, interactive=False, wrap=True, max_height=260, elem_id="shares-table")
        with gr.Row(equal_height=True):
            pick = gr.Textbox(label="Share id (or its link)", scale=3, elem_id="shares-id")
            delete = gr.Button("Delete this share", variant="stop", scale=1, elem_id="shares-delete")
            refresh = gr.Button("Refresh", scale=1)
        note = gr.HTML(elem_id="shares-note")

    def on_refresh(request: gr.Request):
        try:
            return rows(studio, owner_of(studio, request)), ""
        except UserError as e:
            return [], f"<div class='pema-status err'>{render.esc(e)}</div>"

    def on_delete(sid, request: gr.Request):
        me = owner_of(studio, request)
        try:
            msg = f"<div class='pema-status ok'>{render.esc(studio.compare_service.delete_share(sid, owner=me))}</div>"
        except UserError as e:
            msg = f"<div class='pema-status err'>{render.esc(e)}</div>"
        try:
            return rows(studio, me), msg, ""
        except UserError:
            return [], msg, ""

    def on_select(evt: gr.SelectData, data):
        i = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        try:
            return str(data.iloc[int(i)][0]) if hasattr(data, "iloc") else str(data[int(i)][0])
        except (IndexError, KeyError, TypeError, ValueError):
            return gr.update()

    refresh.click(on_refresh, None, [table, note], show_progress="hidden")
    delete.click(on_delete, [pick], [table, note, pick], show_progress="hidden")
    table.select(on_select, [table], [pick], show_progress="hidden")
    return SimpleNamespace(table=table, refresh=on_refresh)
