"""Assemble the page: header with the backbone's loading state, the four workspace tabs, the shared view, and the
explicit API endpoints. ``build_app(studio)`` returns the ``gr.Blocks``; ``launch_app`` serves it."""
from __future__ import annotations

import gradio as gr

from ui import api, compare, evaluate, memories, plugins, render, shared
from ui.common import CSS, THEME

INTRO = ("Customize a frozen language model with your own text — no fine-tuning: build an external memory of the "
         "model's hidden states, train small plug-ins, compare methods side by side.")


def build_app(studio) -> gr.Blocks:
    with gr.Blocks(title="PEMA Studio", analytics_enabled=False) as demo:
        with gr.Row(equal_height=True):
            gr.Markdown(f"# PEMA Studio\n{INTRO}", elem_id="pema-title")
        status = gr.HTML(render.status_header(studio.status()), elem_id="pema-status")
        status_timer = gr.Timer(1.0, active=not studio.status()["ready"])

        with gr.Column(visible=True) as workspace:
            with gr.Tabs():
                with gr.Tab("Memories", id="memories") as t_mem:
                    mem = memories.build(studio)
                with gr.Tab("Plug-ins", id="plugins") as t_plug:
                    plug = plugins.build(studio)
                with gr.Tab("Compare", id="compare") as t_cmp:
                    cmp = compare.build(studio)
                with gr.Tab("Evaluate", id="evaluate") as t_eval:
                    ev = evaluate.build(studio, cmp.settings_inputs, cmp.settings_of)
        with gr.Column(visible=False) as shared_col:
            sh = shared.build(studio)

        api.register(studio)

        # --- header: backbone loading progress -------------------------------------------------------------
        def on_status():
            st = studio.status()
            return render.status_header(st), gr.Timer(active=st["state"] == "loading")

        status_timer.tick(on_status, None, [status, status_timer], show_progress="hidden", api_visibility="private")

        # --- tabs refresh their choices when opened (things made in other tabs appear) -----------------------
        t_mem.select(mem.refresh, None, mem.refresh_outputs, show_progress="hidden", api_visibility="private")
        t_plug.select(plug.refresh, plug.refresh_inputs, plug.refresh_outputs, show_progress="hidden",
                      api_visibility="private")
        t_cmp.select(cmp.refresh, cmp.refresh_inputs, cmp.refresh_outputs, show_progress="hidden",
                     api_visibility="private")
        t_eval.select(ev.refresh, ev.refresh_inputs, ev.refresh_outputs, show_progress="hidden",
                      api_visibility="private")

        # --- page load: the workspace, or a shared comparison (/?c=<id>) read-only ----------------------------
        n_shared = len(sh.outputs)

        def on_load(request: gr.Request):
            sid = (dict(request.query_params).get("c") or "").strip() if request else ""
            st = render.status_header(studio.status())
            if sid:  # a visitor's read-only view: nothing about the studio's owner, not even the header
                return (gr.update(visible=False), gr.update(visible=True), gr.update(visible=False), *sh.open(sid),
                        *[gr.skip()] * n_rest)
            return (gr.update(visible=True), gr.update(visible=False), st, *[gr.skip()] * n_shared,
                    *mem.on_load(), *plug.on_load(), *cmp.on_load(), *ev.on_load())

        rest = [*mem.load_outputs, *plug.load_outputs, *cmp.load_outputs, *ev.load_outputs]
        n_rest = len(rest)
        demo.load(on_load, None, [workspace, shared_col, status, *sh.outputs, *rest], show_progress="hidden",
                  api_visibility="private")

        # Only the explicit endpoints of ui/api.py are part of the API; the page's own events stay private.
        for fn in demo.fns.values():
            if fn.api_name not in api.NAMES:
                fn.api_visibility = "private"
    demo.queue(default_concurrency_limit=1, max_size=64)
    return demo


def launch_app(studio, host: str = "127.0.0.1", port: int = 7860, block: bool = True, quiet: bool = False):
    """Serve the app; ``block=False`` returns ``(demo, url)`` at once (tests)."""
    demo = build_app(studio)
    _, url, _ = demo.launch(server_name=host, server_port=port, prevent_thread_lock=not block, show_error=True,
                            quiet=quiet, theme=THEME, css=CSS, ssr_mode=False, footer_links=["api"],
                            max_file_size="200mb", share=False)
    return demo, url
