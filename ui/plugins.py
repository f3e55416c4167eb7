"""Plug-ins tab: choose a memory, a method and its hyperparameters (paper defaults), train in the background;
watch queued/running jobs with a live loss curve and log; cancel; list trained plug-ins."""
from __future__ import annotations

import json
from types import SimpleNamespace

import gradio as gr

from ground.errors import UserError
from ground.jobs import FINAL_STATES
from ui import plots, render
from ui.common import choices_update, keep_value, memory_choices, owner_of, user_errors


def _method_info(m: dict | None) -> str:
    if not m:
        return ""
    level = {"output": "output-level: mixes the next-token distribution",
             "network": "in-network: changes the backbone's hidden states of its own rows",
             }.get(m["level"], m["level"])
    dec = ", ".join(f"{d['name']}={d['default']}" + (" (live)" if d["live"] else "")
                    for d in m.get("decode_settings", [])) or "none"
    return (f"<div class='pema-help'><b>{render.esc(m['title'])}</b> — {render.esc(level)}.<br>"
            f"{render.esc(m['paper'])}<br>Decode-time settings (set in Compare): {render.esc(dec)}</div>")


SETTING_HEADERS = ["setting", "default", "allowed", "what it does"]


def settings_rows(m: dict | None) -> list[list]:
    """The method's declared training settings as a reference table for the hyperparameter editor."""
    out = []
    for d in (m or {}).get("training_settings", []):
        if d["choices"]:
            allowed = " | ".join(map(str, d["choices"]))
        elif d["low"] is not None or d["high"] is not None:
            lo = "" if d["low"] is None else f"{'>' if d['low_open'] else '≥'} {d['low']}"
            hi = "" if d["high"] is None else f"≤ {d['high']}"
            allowed = f"{d['type']} {lo}{', ' if lo and hi else ''}{hi}"
        else:
            allowed = d["type"]
        out.append([d["name"], json.dumps(d["default"]), allowed, d["help"]])
    return out


def build(studio) -> SimpleNamespace:
    methods = {m["method"]: m for m in studio.methods()}
    first = "pema" if "pema" in methods else next(iter(methods), None)
    selected_job = gr.State(None)
    seen = gr.State(None)
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=340):
            gr.Markdown("#### Train a plug-in")
            memory = gr.Dropdown([], label="Memory", elem_id="train-memory")
            memory_warn = gr.HTML(elem_id="train-memory-warning")
            method = gr.Dropdown([(m["title"], k) for k, m in methods.items()], value=first, label="Method",
                                 elem_id="train-method")
            info = gr.HTML(_method_info(methods.get(first)))
            name = gr.Textbox(label="Name (optional)", placeholder="defaults to “<method> on <memory>”")
            config = gr.Code(render.settings_json(methods[first]["config"]) if first else "{}", language="json",
                             label="Hyperparameters (paper defaults; edit the JSON)", lines=10, max_lines=18)
            with gr.Accordion("What each setting does", open=False):
                settings_ref = gr.Dataframe(headers=SETTING_HEADERS, value=settings_rows(methods.get(first)),
                                            interactive=False, wrap=True, max_height=260,
                                            column_widths=["22%", "14%", "18%", "46%"], elem_id="train-settings-ref")
            with gr.Row():
                reset = gr.Button("Paper defaults", size="sm")
                train = gr.Button("Train in background", variant="primary", elem_id="train-plugin")
            train_msg = gr.HTML()
        with gr.Column(scale=3, min_width=440):
            gr.Markdown("#### Jobs")
            jobs_df = gr.Dataframe(headers=render.JOB_HEADERS, interactive=False, max_height=190, wrap=True,
                                   elem_id="jobs-table",
                                   column_widths=["10%", "22%", "14%", "13%", "15%", "26%"])
            with gr.Row(equal_height=False, elem_classes="pema-actions"):
                job_pick = gr.Dropdown([], label="Show job", scale=4)
                cancel = gr.Button("Cancel job", variant="stop", size="sm", scale=1)
            job_html = gr.HTML(render.job_card(None), elem_id="job-card")
            loss = gr.Plot(plots.loss_curve([]), show_label=False)
            log = gr.Textbox(label="Log", lines=6, max_lines=6, autoscroll=True, interactive=False)
    gr.Markdown("#### Your plug-ins")
    plug_df = gr.Dataframe(headers=render.PLUGIN_HEADERS, interactive=False, max_height=220, wrap=True,
                           elem_id="plugins-table",
                           column_widths=["15%", "7%", "19%", "12%", "9%", "18%", "9%", "11%"])
    with gr.Row(equal_height=False, elem_classes="pema-actions"):
        plug_pick = gr.Dropdown([], label="Inspect a plug-in", scale=4, elem_id="plugin-pick")
        more_minutes = gr.Number(5, label="Budget (min)", precision=1, minimum=0.1, scale=1, min_width=110,
                                 elem_id="continue-minutes")
        plug_continue = gr.Button("Continue training", size="sm", scale=1, min_width=150,
                                  elem_id="continue-training")
        plug_delete = gr.Button("Delete plug-in", variant="stop", size="sm", scale=1, min_width=130)
    plug_status = gr.HTML(elem_id="plugin-status")
    plug_detail = gr.Code(language="json", label="Plug-in details", visible=False, lines=8, max_lines=16)
    timer = gr.Timer(1.0)

    # --- training form ------------------------------------------------------------------------------------------
    def on_method(m):
        mm = methods.get(m)
        return (_method_info(mm), render.settings_json(mm["config"]) if mm else "{}",
                gr.update(value=settings_rows(mm)))

    method.change(on_method, method, [info, config, settings_ref], show_progress="hidden")

    def memory_warning(mid, me):
        m = next((x for x in studio.memories(owner=me) if x["id"] == mid), None) if mid else None
        return render.memory_warning(m, "train")

    @user_errors
    def on_memory(mid, request: gr.Request):
        return memory_warning(mid, owner_of(studio, request))

    memory.change(on_memory, memory, memory_warn, show_progress="hidden")
    reset.click(on_method, method, [info, config, settings_ref], show_progress="hidden", api_visibility="private")

    @user_errors
    def do_train(mem, m, cfg_text, nm, request: gr.Request):
        me = owner_of(studio, request)
        try:
            cfg = json.loads(cfg_text or "{}")
        except json.JSONDecodeError as e:
            raise UserError(f"The hyperparameters are not valid JSON: {e.msg} (line {e.lineno}).") from None
        jid = studio.submit_train(mem, m, cfg, nm, owner=me)
        job = studio.job(jid, owner=me)
        choices = job_choices(me)
        return (f"<div class='pema-status ok'>Queued job <code>{render.esc(jid)}</code>.</div>", jid,
                gr.update(choices=choices, value=jid), render.job_card(job), plots.loss_curve([]), "")

    train.click(do_train, [memory, method, config, name],
                [train_msg, selected_job, job_pick, job_html, loss, log], api_visibility="private")

    # --- jobs ---------------------------------------------------------------------------------------------------
    def memory_names(me):
        return {m["id"]: m["name"] for m in studio.memories(owner=me)}

    def job_choices(me):
        return [(f"{render.KIND_LABEL.get(j['kind'], j['kind'])} · {j['state']} · {j['id']}", j["id"])
                for j in studio.list_jobs(limit=30, owner=me)]

    def get_job(jid, me):
        try:
            return studio.job(jid, owner=me) if jid else None
        except UserError:
            return None

    def show_job(jid, me):
        job = get_job(jid, me)
        if job is None:
            return render.job_card(None), plots.loss_curve([]), ""
        title = "Training loss" if job["kind"] == "train_plugin" else "Progress"
        return render.job_card(job), plots.loss_curve(job["metrics"], title), job.get("log") or ""

    @user_errors
    def pick_job(jid, request: gr.Request):
        card, fig, lg = show_job(jid, owner_of(studio, request))
        return jid, card, fig, lg, None

    job_pick.change(pick_job, job_pick, [selected_job, job_html, loss, log, seen], show_progress="hidden")

    def select_row(evt: gr.SelectData):
        row = evt.row_value or []
        return gr.update(value=row[-1]) if row else gr.skip()

    jobs_df.select(select_row, None, job_pick, show_progress="hidden", api_visibility="private")

    @user_errors
    def do_cancel(jid, request: gr.Request):
        if not jid:
            raise UserError("Choose a job to cancel.")
        me = owner_of(studio, request)
        job = studio.cancel_job(jid, owner=me)
        return render.job_card(job), render.jobs_table(studio.list_jobs(owner=me), memory_names(me))

    cancel.click(do_cancel, selected_job, [job_html, jobs_df], api_visibility="private")

    def tick(jid, last, request: gr.Request):
        try:
            me = owner_of(studio, request)
            jobs = studio.list_jobs(limit=30, owner=me)
        except UserError:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
        # a running job's line also moves on with its elapsed time and ETA (every 5 s) between progress reports
        digest = tuple((j["id"], j["state"], round(j["progress"], 3), j["message"],
                        int((j.get("elapsed_s") or 0) // 5) if j["state"] in ("running", "queued") else 0)
                       for j in jobs)
        if last is not None and last[0] == digest and last[1] == jid:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
        table = render.jobs_table(jobs, memory_names(me))
        before = {(x[0], x[1]) for x in last[0]} if last is not None else set()
        finished_now = last is not None and any(
            j["state"] in FINAL_STATES and (j["id"], j["state"]) not in before for j in jobs)
        n_metrics = -1
        if jid:
            card, fig, lg = show_job(jid, me)
            job = get_job(jid, me)
            n_metrics = len(job["metrics"]) if job else -1
            if last is not None and last[1] == jid and last[2] == n_metrics:
                fig = gr.skip()  # the curve did not change: do not redraw it
        else:
            card, fig, lg = gr.skip(), gr.skip(), gr.skip()
        picker = gr.update(choices=job_choices(me)) if last is None or len(last[0]) != len(digest) or finished_now \
            else gr.skip()
        if finished_now:
            plist = studio.plugins(owner=me)
            pdf, pdd = render.plugins_table(plist), gr.update(choices=[(p["name"], p["id"]) for p in plist])
        else:
            pdf, pdd = gr.skip(), gr.skip()
        return table, card, fig, lg, picker, pdf, pdd, (digest, jid, n_metrics)

    timer.tick(tick, [selected_job, seen], [jobs_df, job_html, loss, log, job_pick, plug_df, plug_pick, seen],
               show_progress="hidden", api_visibility="private")

    # --- plug-in list -------------------------------------------------------------------------------------------
    def show_plugin(pid, request: gr.Request):
        if not pid:
            return gr.update(visible=False), ""
        me = owner_of(studio, request)
        try:
            d = studio.plugin_detail(pid, owner=me)
        except UserError as e:
            return gr.update(visible=True, value=json.dumps({"error": str(e)})), ""
        d.pop("history", None)
        p = next((x for x in studio.plugins(owner=me) if x["id"] == pid), {})
        return gr.update(visible=True, value=json.dumps(d, indent=2, default=str)), render.plugin_status(p)

    plug_pick.change(show_plugin, plug_pick, [plug_detail, plug_status], show_progress="hidden")

    @user_errors
    def do_continue(pid, minutes, request: gr.Request):
        if not pid:
            raise UserError("Choose a plug-in to continue training.")
        me = owner_of(studio, request)
        cfg = {"max_minutes": float(minutes)} if minutes else {}
        jid = studio.submit_continue(pid, cfg, owner=me)
        job = studio.job(jid, owner=me)
        return (jid, gr.update(choices=job_choices(me), value=jid), render.job_card(job), plots.loss_curve([]), "",
                f"<div class='pema-status ok'>Queued job <code>{render.esc(jid)}</code>: continues from the saved "
                f"weights and optimizer state as a new plug-in.</div>")

    plug_continue.click(do_continue, [plug_pick, more_minutes],
                        [selected_job, job_pick, job_html, loss, log, plug_status], api_visibility="private")

    @user_errors
    def do_delete(pid, request: gr.Request):
        if not pid:
            return gr.skip(), gr.skip(), gr.skip()
        me = owner_of(studio, request)
        gr.Info(studio.delete_plugin(pid, owner=me))
        plist = studio.plugins(owner=me)
        return (render.plugins_table(plist), gr.update(choices=[(p["name"], p["id"]) for p in plist], value=None),
                gr.update(visible=False))

    plug_delete.click(do_delete, plug_pick, [plug_df, plug_pick, plug_detail],
                      js="(p) => (p && confirm('Delete this plug-in?')) ? p : null", api_visibility="private")

    def lists(me, mem_value=None):
        choices = memory_choices(studio, me)
        plist = studio.plugins(owner=me)
        mem = keep_value(choices, mem_value)
        return (choices_update(choices, mem_value), render.plugins_table(plist),
                gr.update(choices=[(p["name"], p["id"]) for p in plist]), memory_warning(mem, me))

    @user_errors
    def refresh(mem_value, request: gr.Request):
        return lists(owner_of(studio, request), mem_value)

    def on_load(me):
        """Page (re)load for owner ``me``: lists, and the running (else latest) job with its curve and log."""
        jobs = studio.list_jobs(limit=30, owner=me)
        active = ([j for j in jobs if j["state"] == "running"]
                  or [j for j in jobs if j["kind"] == "train_plugin" and j["metrics"]]
                  or [j for j in jobs if j["kind"] == "train_plugin"])
        jid = active[0]["id"] if active else None
        mem_dd, pdf, pdd, warn = lists(me)
        card, fig, lg = show_job(jid, me)
        return (mem_dd, pdf, pdd, render.jobs_table(jobs, memory_names(me)),
                gr.update(choices=job_choices(me), value=jid), jid, card, fig, lg, warn)

    def restore(me, saved: dict):
        """This browser's last memory and method (``saved``), when they are still the owner's and still exist."""
        mid = saved.get("train_memory")
        ids = [c[1] for c in memory_choices(studio, me)]
        meth = saved.get("train_method")
        return (gr.update(value=mid) if mid in ids else gr.skip(),
                memory_warning(mid, me) if mid in ids else gr.skip(),
                gr.update(value=meth) if meth in methods else gr.skip())

    return SimpleNamespace(refresh=refresh, refresh_keys=["train_memory"],
                           refresh_inputs=[memory],
                           refresh_outputs=[memory, plug_df, plug_pick, memory_warn],
                           on_load=on_load, load_outputs=[memory, plug_df, plug_pick, jobs_df, job_pick,
                                                          selected_job, job_html, loss, log, memory_warn],
                           persist=[("train_memory", memory), ("train_method", method)],
                           restore=restore, restore_outputs=[memory, memory_warn, method])
