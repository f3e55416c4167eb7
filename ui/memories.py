"""Memories tab: upload / paste / demo corpus → preview with per-line problems → build in the background → list,
inspect (with the memory's profile: counts, value-token frequencies, a 2-D map of its keys, a token's spread),
delete."""
from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from backbone.prompts import TASKS
from ground.errors import UserError
from ground.jobs import FINAL_STATES
from memories.corpora import CORPUS_TASKS
from ui import plots, render
from ui.common import (
    disable_while_running,
    keep_value,
    memory_choices,
    owner_of,
    poll_while_running,
    read_upload,
    user_errors,
)

SOURCES = ["Upload a file", "Paste text", "Demo corpus"]
BUILD_LABEL = "Build memory"
PASTE_HINT = ('One sample a line: {"src": "...", "tgt": "..."} JSON lines, "source<TAB>target", '
              "or plain target-side text (the backbone then writes a synthetic source).")
SAMPLE_HEADERS = ["line", "split", "source", "synthetic?", "target"]
ALL_TOKENS = "— every frequent token, coloured —"
# What each build mode puts in a key's context (memories.build), shown under the mode that is selected.
MODE_HELP = {
    "teacher": "teacher-forced: each key's context is the source and the reference's words so far, all of a "
               "sample's positions in one forward pass (fast; the studio's default)",
    "offsite": "offsite: each key's context is the source and the model's own predictions so far, one decode step "
               "per token, as PEMA's code builds its memory (slow)",
}


def _samples_panel(studio, c: SimpleNamespace) -> None:
    """1 · the samples (a file, pasted text or a demo corpus); 2 · the memory's name, task and build mode, Build."""
    gr.Markdown("#### 1 · Your samples")
    c.source = gr.Radio(SOURCES, value=SOURCES[0], show_label=False, container=False)
    c.upload = gr.File(label="JSONL, CSV/TSV pairs or plain text", type="filepath",
                       file_types=[".jsonl", ".json", ".ndjson", ".csv", ".tsv", ".txt"])
    c.paste = gr.Textbox(label="Paste samples", lines=7, max_lines=14, visible=False, placeholder=PASTE_HINT)
    corpora = studio.memory_service.corpora()
    with gr.Row(visible=False) as c.corpus_row:
        c.corpus = gr.Dropdown([(f"{k} — {v}", k) for k, v in corpora.items()],
                               value=next(iter(corpora), None), label="Demo corpus", scale=3, elem_id="demo-corpus",
                               info=None if corpora else "No demo corpus is available on this machine.")
        c.limit = gr.Number(200, label="Samples", precision=0, minimum=5, maximum=20000, scale=1,
                            elem_id="demo-corpus-size")
    gr.Markdown("#### 2 · Build the memory")
    with gr.Row():
        c.name = gr.Textbox(label="Name", placeholder="e.g. my product manuals", scale=2)
        c.task = gr.Dropdown(list(TASKS), value="translation", label="Task", scale=1, elem_id="build-task")
    with gr.Row():
        c.mode = gr.Radio([("teacher-forced (fast)", "teacher"), ("offsite (slow)", "offsite")],
                          value="teacher", label="Build mode", scale=2, info=MODE_HELP["teacher"],
                          elem_id="build-mode")
        c.skip = gr.Checkbox(False, label="Skip invalid lines", scale=1)
    with gr.Row():
        c.build_btn = gr.Button(BUILD_LABEL, variant="primary", elem_id="build-memory", scale=3)
        c.cancel_btn = gr.Button("Cancel build", scale=1, interactive=False, elem_id="cancel-build")
    c.build_status = gr.HTML(elem_id="build-status")


def _memory_list_panel(c: SimpleNamespace) -> None:
    """The owner's memories; the chosen one's summary, profile (token frequencies, a 2-D map of its keys, one
    token's spread) and samples."""
    gr.Markdown("#### Your memories")
    c.mem_df = gr.Dataframe(headers=render.MEMORY_HEADERS, interactive=False, max_height=240, wrap=True)
    with gr.Row(equal_height=False, elem_classes="pema-actions"):
        c.pick = gr.Dropdown([], label="Inspect a memory", scale=4, elem_id="memory-pick")
        c.delete_btn = gr.Button("Delete memory", variant="stop", scale=1, size="sm")
    c.detail = gr.HTML()
    with gr.Accordion("Profile: what the memory holds", open=True, elem_id="memory-profile"):
        c.profile_html = gr.HTML(render.profile_summary(None), elem_id="memory-profile-box")
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=300):
                c.freq_plot = gr.Plot(plots.token_frequencies(None), show_label=False, elem_id="memory-token-freq")
            with gr.Column(scale=3, min_width=400):
                c.map_plot = gr.Plot(plots.memory_map(None), show_label=False, elem_id="memory-map")
                c.token_pick = gr.Dropdown([], label="Show one token's spread (its keys highlighted on the map)",
                                           elem_id="memory-token")
        c.token_html = gr.HTML(elem_id="memory-token-box")
    c.samples_df = gr.Dataframe(headers=SAMPLE_HEADERS, interactive=False, max_height=320, wrap=True,
                                column_widths=["7%", "9%", "38%", "8%", "38%"], label="Samples")


def _wire_preview(studio, c: SimpleNamespace) -> None:
    """The preview (with per-line problems) follows the chosen source."""
    def on_source(src):
        """Show the chosen source's input; another source lets go of the file (it is not sent again)."""
        return (gr.update(visible=True) if src == SOURCES[0] else gr.update(visible=False, value=None),
                gr.update(visible=src == SOURCES[1]), gr.update(visible=src == SOURCES[2]))

    def do_preview(src, path, text, corpus_name, n, request: gr.Request):
        try:
            me = owner_of(studio, request)
            if src == SOURCES[0]:
                data, fname = read_upload(studio, request, path)
                pv = studio.memory_service.preview(data, fname, owner=me)
            elif src == SOURCES[1]:
                pv = studio.memory_service.preview(text or "", None, owner=me)
            else:
                if not corpus_name:
                    return render.preview_summary({}), gr.update(value=[])
                pv = studio.memory_service.preview(corpus=corpus_name, limit=int(n or 200), owner=me)
        except UserError as e:
            pv = {"count": 0, "problems": [str(e)], "problem_count": 1, "rows": [], "ok": False}
        return render.preview_summary(pv), gr.update(value=pv["rows"])

    def preview_without_file(src, text, corpus_name, n, request: gr.Request):
        """The pasted text's or the demo corpus's preview: these events do not send the file input, so a file
        that is gone (a build consumed it, or its upload expired) cannot make them fail."""
        if src == SOURCES[0]:
            return render.preview_summary({}), gr.update(value=[])  # the file input is empty when chosen again
        return do_preview(src, None, text, corpus_name, n, request)

    c.source.change(on_source, c.source, [c.upload, c.paste, c.corpus_row])
    c.source.change(lambda src, k: gr.update(value=CORPUS_TASKS[k]) if src == SOURCES[2] and k in CORPUS_TASKS
                    else gr.skip(), [c.source, c.corpus], c.task, show_progress="hidden")
    c.corpus.change(lambda k: gr.update(value=CORPUS_TASKS[k]) if k in CORPUS_TASKS else gr.skip(), c.corpus,
                    c.task, show_progress="hidden")  # a demo corpus is for one task: the memory's task follows it
    c.mode.change(lambda m: gr.update(info=MODE_HELP.get(m, "")), c.mode, c.mode, show_progress="hidden")
    def preview_file(src, path, request: gr.Request):
        if src != SOURCES[0]:  # the file input was cleared because another source was chosen: nothing to show
            return gr.skip(), gr.skip()
        return do_preview(src, path, None, None, None, request)

    # One queue for every preview, in the order asked: a slow preview (the first parse of a demo corpus) never
    # lands after, and over, the one the user asked for next.
    outs, one_queue = [c.preview_html, c.preview_df], {"concurrency_id": "memories-preview", "concurrency_limit": 1}
    c.upload.change(preview_file, [c.source, c.upload], outs, trigger_mode="always_last", show_progress="hidden",
                    **one_queue)
    for ev in (c.source.change, c.corpus.change, c.limit.change, c.paste.change):
        ev(preview_without_file, [c.source, c.paste, c.corpus, c.limit], outs, trigger_mode="always_last",
           show_progress="hidden", **one_queue)


def _wire_build(studio, c: SimpleNamespace) -> None:
    """Build in the background, cancel, and poll the build job (the list follows when it finishes)."""
    @user_errors
    def do_build(src, path, text, corpus_name, n, nm, tk, md, sk, request: gr.Request):
        me = owner_of(studio, request)
        if src == SOURCES[0]:
            data, fname = read_upload(studio, request, path)
            if data is None:
                raise UserError("Upload a file first.")
            jid = studio.memory_service.submit_build(data, fname, name=nm, task=tk, mode=md, skip_invalid=sk, owner=me)
            studio.uploads.consume(path)  # the build job keeps its own copy: the file input lets go of it too
            return jid, render.job_card(studio.job_service.job(jid, owner=me)), gr.update(value=None)
        elif src == SOURCES[1]:
            jid = studio.memory_service.submit_build(text or "", None, name=nm, task=tk, mode=md, skip_invalid=sk,
                                                     owner=me)
        else:
            if not corpus_name:
                raise UserError("Pick a demo corpus first.")
            jid = studio.memory_service.submit_build(corpus=corpus_name, limit=int(n or 200), name=nm, task=tk,
                                                     mode=md, owner=me)
        return jid, render.job_card(studio.job_service.job(jid, owner=me)), gr.skip()

    c.build_btn.click(do_build, [c.source, c.upload, c.paste, c.corpus, c.limit, c.name, c.task, c.mode, c.skip],
                      [c.build_job, c.build_status, c.upload], api_visibility="private")

    @user_errors
    def do_cancel(jid, request: gr.Request):
        if not jid:
            raise UserError("No memory is being built.")
        return render.job_card(studio.job_service.cancel_job(jid, owner=owner_of(studio, request)))

    c.cancel_btn.click(do_cancel, c.build_job, c.build_status, api_visibility="private")

    def tick(jid, last, request: gr.Request):
        if not jid:
            return gr.skip(), gr.skip(), gr.skip(), last
        try:
            me = owner_of(studio, request)
            job = studio.job_service.job(jid, owner=me)
        except UserError:
            return gr.skip(), gr.skip(), gr.skip(), last
        key = (jid, job["state"], round(job["progress"], 3), job["message"])
        if key == last:
            return gr.skip(), gr.skip(), gr.skip(), last
        card = render.job_card(job)
        if job["state"] in FINAL_STATES and (last is None or last[1] not in FINAL_STATES or last[0] != jid):
            table, choices = render.memories_table(studio.memory_service.memories(owner=me)), memory_choices(studio, me)
            new = (job.get("result") or {}).get("memory_id")
            return card, table, gr.update(choices=choices, value=new or keep_value(choices, None)), key
        return card, gr.skip(), gr.skip(), key

    c.timer.tick(tick, [c.build_job, c.seen], [c.build_status, c.mem_df, c.pick, c.seen], show_progress="hidden",
                 api_visibility="private")


def _detail_html(d: dict) -> str:
    """A memory's summary line (``MemoryService.memory_detail``) with its size warnings."""
    s, st = d["summary"], d["stats"]
    shown, total = len(d["samples"]), d["total_samples"]
    more = f" · showing the first {shown} of {total} samples" if total > shown else ""
    html = (f"<div class='pema-status ok'><b>{render.esc(s['name'])}</b> · {render.esc(s['task'])} · "
            f"{render.esc(s['mode'])} build · {s['samples']} training + {s['heldout_samples']} held-out "
            f"samples · "
            f"{s['entries']:,} entries (+{s['heldout_entries']:,} held-out) · "
            f"{st.get('synthetic_sources', 0)} synthetic sources · built in {st.get('build_seconds', '?')}s · "
            f"backbone {render.esc(s['backbone'])}"
            f"<br><span class='pema-muted'>Prompt: <code>{render.esc((d['prompt'] or {}).get('template'))}</code>"
            f"{more}"
            f"</span></div>")
    sizes = {"name": s["name"], "samples": s["samples"] + s["heldout_samples"],  # summary: training samples
             "heldout_samples": s["heldout_samples"]}
    return html + render.memory_warning(sizes, "train") + render.memory_warning(sizes, "heldout")


def _wire_inspect(studio, c: SimpleNamespace) -> None:
    """Picking a memory shows its summary, samples and profile (computed once per memory by the service: its first
    pick may take a moment on a large one); a token shows its spread; Delete."""
    def show(mid, request: gr.Request):
        if not mid:
            return "", []
        try:
            d = studio.memory_service.memory_detail(mid, owner=owner_of(studio, request))
        except UserError as e:
            return f"<div class='pema-error'>{render.esc(e)}</div>", []
        rows = [[x["line"], x["split"], x["src"], "yes" if x["synthetic_src"] else "", x["tgt"]] for x in d["samples"]]
        return _detail_html(d), rows

    c.pick.change(show, c.pick, [c.detail, c.samples_df], show_progress="hidden")

    def show_profile(mid, request: gr.Request):
        if not mid:
            return (render.profile_summary(None), plots.token_frequencies(None), plots.memory_map(None),
                    gr.update(choices=[], value=None), "")
        try:
            prof = studio.memory_service.memory_profile(mid, owner=owner_of(studio, request))
        except UserError as e:
            return (f"<div class='pema-error'>{render.esc(e)}</div>", plots.empty(), plots.empty(),
                    gr.update(choices=[], value=None), "")
        choices = [(ALL_TOKENS, -1), *render.token_choices(prof)]
        return (render.profile_summary(prof), plots.token_frequencies(prof), plots.memory_map(prof),
                gr.update(choices=choices, value=-1), "")

    c.pick.change(show_profile, c.pick, [c.profile_html, c.freq_plot, c.map_plot, c.token_pick, c.token_html],
                  show_progress="minimal", show_progress_on=[c.profile_html])

    def show_token(mid, tid, request: gr.Request):
        if not mid:
            return gr.skip(), ""
        me = owner_of(studio, request)
        try:
            prof = studio.memory_service.memory_profile(mid, owner=me)
            if tid is None or int(tid) < 0:
                return plots.memory_map(prof), ""
            info = studio.memory_service.memory_token(mid, int(tid), owner=me)
        except UserError as e:
            return gr.skip(), f"<div class='pema-error'>{render.esc(e)}</div>"
        return plots.memory_map(prof, info["token_id"]), render.token_detail(info)

    c.token_pick.input(show_token, [c.pick, c.token_pick], [c.map_plot, c.token_html], show_progress="hidden",
                       trigger_mode="always_last")

    @user_errors
    def do_delete(mid, request: gr.Request):
        if not mid:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        me = owner_of(studio, request)
        msg = studio.memory_service.delete_memory(mid, owner=me)
        gr.Info(msg)
        choices = memory_choices(studio, me)
        table = render.memories_table(studio.memory_service.memories(owner=me))
        return table, gr.update(choices=choices, value=None), "", []

    c.delete_btn.click(do_delete, c.pick, [c.mem_df, c.pick, c.detail, c.samples_df],
                       js="(m) => (m && confirm('Delete this memory? This cannot be undone.')) ? m : null",
                       api_visibility="private")


def build(studio) -> SimpleNamespace:
    c = SimpleNamespace(build_job=gr.State(None), seen=gr.State(None))
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=340):
            _samples_panel(studio, c)
        with gr.Column(scale=3, min_width=420):
            gr.Markdown("#### Preview")
            c.preview_html = gr.HTML(render.preview_summary({}), elem_id="preview-summary")
            c.preview_df = gr.Dataframe(headers=["line", "source", "target"], interactive=False, max_height=330,
                                        wrap=True, column_widths=["60px", "45%", "45%"])
    _memory_list_panel(c)
    data_dir = gr.HTML()
    c.timer = gr.Timer(1.0, active=False)  # on while a build runs (poll_while_running)
    _wire_preview(studio, c)
    _wire_build(studio, c)
    _wire_inspect(studio, c)
    poll_while_running(studio, c.timer, c.build_job, c.seen)
    disable_while_running(studio, {c.build_btn: (BUILD_LABEL, "Building a memory… (Cancel build stops it)")},
                          c.build_job, c.seen, stops=(c.cancel_btn,))

    def lists(me):
        choices = memory_choices(studio, me)
        return render.memories_table(studio.memory_service.memories(owner=me)), gr.update(choices=choices)

    @user_errors
    def refresh(request: gr.Request):
        return lists(owner_of(studio, request))

    def on_load(me):
        """Page (re)load for owner ``me``: the memory list and the latest unfinished build job."""
        active = studio.job_service.list_jobs(("build_memory",), 1, owner=me, states=("queued", "running"))
        jid = active[0]["id"] if active else None
        table, dd = lists(me)
        where = ("" if studio.multi_user else  # where the data lives is the local user's business only
                 f"<div class='pema-muted'>Data directory: <code>{render.esc(studio.root)}</code></div>")
        return table, dd, jid, render.job_card(active[0]) if jid else "", where

    return SimpleNamespace(refresh=refresh, refresh_outputs=[c.mem_df, c.pick], on_load=on_load,
                           load_outputs=[c.mem_df, c.pick, c.build_job, c.build_status, data_dir])
