"""Plug-ins tab: choose a memory, a method, a preset and its hyperparameters (a form generated from the method's
declared settings; the time estimate said before training), train in the background; watch queued/running jobs
with a live loss curve and log; cancel; list trained plug-ins and continue training them."""
from __future__ import annotations

import json
from types import SimpleNamespace

import gradio as gr

from backbone.prompts import TASKS
from ground.errors import UserError
from ground.jobs import FINAL_STATES
from plugins.registry import shown_first
from plugins.settings import describe_changes, tuned_start_changes
from studio.packages import without_server_paths
from ui import plots, render
from ui.common import (
    choices_update,
    disable_while_running,
    jobs_busy,
    keep_value,
    memory_choices,
    owner_of,
    poll_while_running,
    read_upload,
    training_control,
    user_errors,
)

TRAIN_LABEL = "Train in background"
CONTINUE_LABEL = "Continue training"


def _method_info(m: dict | None, starts: dict | None = None) -> str:
    """The method's summary; ``starts`` ({task: {setting: value}}, ``PluginService.start_settings``) are the values a
    comparison of each task starts this method at on this backbone — said where they differ from the declared
    defaults, so that this tab and Compare never show different numbers without saying why."""
    if not m:
        return ""
    level = {"output": "output-level: mixes the next-token distribution",
             "network": "in-network: changes the backbone's hidden states of its own rows",
             "prompt": "prompt-level: the frozen model, prompted with examples retrieved from the memory",
             }.get(m["level"], m["level"])
    declared = {d["name"]: d["default"] for d in m.get("decode_settings", [])}
    dec = ", ".join(f"{d['name']}={d['default']}" + (" (live)" if d["live"] else "")
                    for d in m.get("decode_settings", [])) or "none"
    tuned = describe_changes(tuned_start_changes(declared, starts or {}))
    start = (f"<br>A comparison starts at the values tuned on dev data for this backbone — {render.esc(tuned)}"
             if tuned else "")
    unavailable = (f"<br><b>Unavailable here:</b> {render.esc(m['unavailable'])}" if m.get("unavailable") else "")
    return (f"<div class='pema-help'><b>{render.esc(m['title'])}</b> — {render.esc(level)}.<br>"
            f"{render.esc(m['paper'])}<br>Decode-time settings (set in Compare), declared defaults: {render.esc(dec)}"
            f"{start}{unavailable}</div>")


def preset_form_values(m: dict, preset: str | None) -> dict:
    """The training form's values of method ``m`` (a ``PluginService.methods()`` row) under ``preset``: the shipped
    defaults with the preset's values over them."""
    presets = m.get("presets") or {}
    return {**m["config"], **(presets.get(preset or "default") or {}).get("values", {})}


def form_config(m: dict, values: list) -> dict:
    """The settings of method ``m`` from its form controls' ``values`` (in declaration order); an emptied number box
    is left out (the default stands). ``PluginConfig.from_dict`` validates them when the job is submitted."""
    return {d["name"]: v for d, v in zip(m["training_settings"], values) if v is not None and v != ""}


def preset_note(m: dict | None, preset: str | None) -> str:
    p = ((m or {}).get("presets") or {}).get(preset or "default")
    if not p:
        return ""
    vals = ", ".join(f"{k}={json.dumps(v)}" for k, v in p["values"].items()) or "no changes"
    return (f"<div class='pema-help' id='train-preset-note'><b>{render.esc(preset or 'default')}</b>: "
            f"{render.esc(p['about'])} ({render.esc(vals)})</div>")


def estimate_html(est: dict | None) -> str:
    """The time estimate line of the training form (amber when the budget stops training before it converges)."""
    if not est or not est.get("text"):
        return ""
    kind = "warn" if est.get("under_trained") else ("ok" if est.get("measured") else "")
    return f"<div class='pema-status {kind}' id='train-estimate-text'>Time: {render.esc(est['text'])}</div>"


def _training_form(studio, c: SimpleNamespace) -> None:
    """Train a plug-in: memory, method, name, preset, the time estimate, and the hyperparameters — one generated
    group of controls per method (declared settings: type, range, choices, help), only the chosen method's visible.
    No hand-written per-method widgets."""
    methods, first = c.methods, c.first
    gr.Markdown("#### Train a plug-in")
    c.memory = gr.Dropdown([], label="Memory", elem_id="train-memory")
    c.memory_warn = gr.HTML(elem_id="train-memory-warning")
    c.method = gr.Dropdown([(m["title"], k) for k, m in methods.items()], value=first, label="Method",
                           elem_id="train-method")
    c.info = gr.HTML(_method_info_now(studio, methods, first))
    c.name = gr.Textbox(label="Name (optional)", placeholder="defaults to “<method> on <memory>”")
    with gr.Row(equal_height=False, elem_classes="pema-actions"):
        c.preset = gr.Radio(list((methods.get(first) or {}).get("presets") or ["default"]), value="default",
                            label="Preset", info="default: what ships · paper: the paper's / public code's "
                            "values · quick: a short run to try the studio", scale=4, elem_id="train-preset")
        c.reset = gr.Button("Reset to preset", size="sm", scale=1, min_width=120)
    c.note = gr.HTML(preset_note(methods.get(first), "default"))
    c.estimate = gr.HTML(elem_id="train-estimate")
    c.train = gr.Button(TRAIN_LABEL, variant="primary", elem_id="train-plugin")
    c.train_msg = gr.HTML()
    c.groups, c.controls = {}, {}
    with gr.Accordion("Hyperparameters — every setting of the method, with its help and range", open=False,
                      elem_id="train-form"):
        for k, m in methods.items():
            with gr.Column(visible=k == first) as c.groups[k]:
                descs = m["training_settings"]
                c.controls[k] = []
                for i in range(0, len(descs), 2):
                    with gr.Row(equal_height=False):
                        for d in descs[i:i + 2]:
                            c.controls[k].append(training_control(k, d, m["config"][d["name"]]))
    c.all_controls = [ctl for k in methods for ctl in c.controls[k]]


def _jobs_panel(c: SimpleNamespace) -> None:
    """The owner's jobs, the chosen one's card, loss curve and log, Cancel."""
    gr.Markdown("#### Jobs")
    c.jobs_df = gr.Dataframe(headers=render.JOB_HEADERS, interactive=False, max_height=190, wrap=True,
                             elem_id="jobs-table", column_widths=["10%", "22%", "14%", "13%", "15%", "26%"])
    with gr.Row(equal_height=False, elem_classes="pema-actions"):
        c.job_pick = gr.Dropdown([], label="Show job", scale=4)
        # on while the job shown is queued or running (``disable_while_running``'s stops)
        c.cancel = gr.Button("Cancel job", variant="stop", size="sm", scale=1, elem_id="cancel-job",
                             interactive=False)
    c.job_html = gr.HTML(render.job_card(None), elem_id="job-card")
    c.loss = gr.Plot(plots.loss_curve([]), show_label=False)
    c.log = gr.Textbox(label="Log", lines=6, max_lines=6, autoscroll=True, interactive=False)


def _plugin_list_panel(c: SimpleNamespace) -> None:
    """The owner's plug-ins: details, Continue training, Delete."""
    gr.Markdown("#### Your plug-ins")
    c.plug_df = gr.Dataframe(headers=render.PLUGIN_HEADERS, interactive=False, max_height=220, wrap=True,
                             elem_id="plugins-table",
                             column_widths=["15%", "7%", "19%", "12%", "9%", "18%", "9%", "11%"])
    with gr.Row(equal_height=False, elem_classes="pema-actions"):
        c.plug_pick = gr.Dropdown([], label="Inspect a plug-in", scale=4, elem_id="plugin-pick")
        # shown for a plug-in that can continue (every in-network method and PEMA, saved with its optimizer)
        c.more_minutes = gr.Number(5, label="Budget (min)", precision=1, minimum=0.1, scale=1, min_width=110,
                                   elem_id="continue-minutes", visible=False)
        c.plug_continue = gr.Button(CONTINUE_LABEL, size="sm", scale=1, min_width=150,
                                    elem_id="continue-training", visible=False)
        c.plug_delete = gr.Button("Delete plug-in", variant="stop", size="sm", scale=1, min_width=130)
    c.plug_status = gr.HTML(elem_id="plugin-status")
    c.plug_detail = gr.Code(language="json", label="Plug-in details", visible=False, lines=8, max_lines=16)


def _method_info_now(studio, methods: dict, k: str | None) -> str:
    """The method's summary with the start values read now (a remote backbone may change them)."""
    return _method_info(methods.get(k), {task: studio.plugin_service.start_settings(task).get(k, {}) for task in TASKS})


def _memory_names(studio, me) -> dict:
    return {m["id"]: m["name"] for m in studio.memory_service.memories(owner=me)}


def _job_choices(studio, me) -> list:
    return [(f"{render.KIND_LABEL.get(j['kind'], j['kind'])} · {j['state']} · {j['id']}", j["id"])
            for j in studio.job_service.list_jobs(limit=30, owner=me)]


def _get_job(studio, jid, me):
    try:
        return studio.job_service.job(jid, owner=me) if jid else None
    except UserError:
        return None


def _show_job(studio, jid, me) -> tuple:
    """The job's card, its loss (or progress) curve and its log."""
    job = _get_job(studio, jid, me)
    if job is None:
        return render.job_card(None), plots.loss_curve([]), ""
    if job["kind"] != "train_plugin" and not job["metrics"]:  # a build, an evaluation: no curve is coming
        return (render.job_card(job), plots.empty("A loss curve is drawn for a plug-in's training job only"),
                job.get("log") or "")
    title = "Training loss" if job["kind"] == "train_plugin" else "Progress"
    return render.job_card(job), plots.loss_curve(job["metrics"], title), job.get("log") or ""


def _memory_warning(studio, mid, me) -> str:
    m = next((x for x in studio.memory_service.memories(owner=me) if x["id"] == mid), None) if mid else None
    return render.memory_warning(m, "train")


def _wire_training_form(studio, c: SimpleNamespace) -> None:
    """The form follows the method and preset, says the time estimate, and submits the training job."""
    methods = c.methods

    def selected_values(m, values):
        """The chosen method's control values out of every method's controls (``all_controls`` order)."""
        at = 0
        for k in methods:
            n = len(c.controls[k])
            if k == m:
                return values[at:at + n]
            at += n
        return []

    def fill(m, pre):
        """Every control: the chosen method's set to its preset's values, the others left as they are."""
        mm = methods.get(m)
        vals = preset_form_values(mm, pre) if mm else {}
        return [gr.update(value=vals[d["name"]]) if k == m else gr.skip()
                for k in methods for d in methods[k]["training_settings"]]

    def on_method(m):
        mm = methods.get(m)
        names = list((mm or {}).get("presets") or ["default"])
        return [_method_info_now(studio, methods, m), gr.update(choices=names, value="default"),
                preset_note(mm, "default")] + [gr.update(visible=k == m) for k in methods] + fill(m, "default")

    c.method.change(on_method, c.method, [c.info, c.preset, c.note] + [c.groups[k] for k in methods] + c.all_controls,
                    show_progress="hidden", api_visibility="private")

    def on_preset(m, pre):
        return [preset_note(methods.get(m), pre)] + fill(m, pre)

    c.preset.input(on_preset, [c.method, c.preset], [c.note] + c.all_controls, show_progress="hidden",
                   api_visibility="private")
    c.reset.click(on_preset, [c.method, c.preset], [c.note] + c.all_controls, show_progress="hidden",
                  api_visibility="private")

    def show_estimate(request: gr.Request, mid, m, *values):  # the request first: Gradio injects it by place
        if not mid or m not in methods:
            return ""
        try:
            est = studio.plugin_service.training_estimate(mid, m, form_config(methods[m], selected_values(m, values)),
                                                          owner=owner_of(studio, request))
        except UserError as e:  # a value out of range while typing: say so where the estimate goes
            return f"<div class='pema-status err' id='train-estimate-text'>{render.esc(str(e))}</div>"
        return estimate_html(est)

    gr.on([c.memory.change, c.method.change] + [ctl.change for ctl in c.all_controls], show_estimate,
          [c.memory, c.method] + c.all_controls, c.estimate, show_progress="hidden", trigger_mode="always_last",
          api_visibility="private")

    @user_errors
    def on_memory(mid, request: gr.Request):
        return _memory_warning(studio, mid, owner_of(studio, request))

    c.memory.change(on_memory, c.memory, c.memory_warn, show_progress="hidden")

    @user_errors
    def do_train(request: gr.Request, mem, m, nm, *values):
        me = owner_of(studio, request)
        if m not in methods:
            raise UserError("Choose a method.")
        jid = studio.plugin_service.submit_train(mem, m, form_config(methods[m], selected_values(m, values)), nm,
                                                 owner=me)
        job = studio.job_service.job(jid, owner=me)
        choices = _job_choices(studio, me)
        return (f"<div class='pema-status ok'>Queued job <code>{render.esc(jid)}</code>.</div>", jid,
                gr.update(choices=choices, value=jid), render.job_card(job), plots.loss_curve([]), "")

    c.train.click(do_train, [c.memory, c.method, c.name] + c.all_controls,
                  [c.train_msg, c.selected_job, c.job_pick, c.job_html, c.loss, c.log], api_visibility="private")


def _wire_jobs(studio, c: SimpleNamespace) -> None:
    """Show a job (picker or table row), cancel it, and poll: the table, the chosen job's card, curve and log, and
    the plug-in list when a job finishes."""
    @user_errors
    def pick_job(jid, request: gr.Request):
        card, fig, lg = _show_job(studio, jid, owner_of(studio, request))
        return jid, card, fig, lg, None

    c.job_pick.change(pick_job, c.job_pick, [c.selected_job, c.job_html, c.loss, c.log, c.seen],
                      show_progress="hidden")

    def select_row(evt: gr.SelectData):
        row = evt.row_value or []
        return gr.update(value=row[-1]) if row else gr.skip()

    c.jobs_df.select(select_row, None, c.job_pick, show_progress="hidden", api_visibility="private")

    @user_errors
    def do_cancel(jid, request: gr.Request):
        if not jid:
            raise UserError("Choose a job to cancel.")
        me = owner_of(studio, request)
        job = studio.job_service.cancel_job(jid, owner=me)
        jobs = studio.job_service.list_jobs(owner=me)
        return render.job_card(job), render.jobs_table(jobs, _memory_names(studio, me))

    c.cancel.click(do_cancel, c.selected_job, [c.job_html, c.jobs_df], api_visibility="private")

    def tick(jid, last, request: gr.Request):
        try:
            me = owner_of(studio, request)
            jobs = studio.job_service.list_jobs(limit=30, owner=me)
        except UserError:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
        # a running job's line also moves on with its elapsed time and ETA (every 5 s) between progress reports
        digest = tuple((j["id"], j["state"], round(j["progress"], 3), j["message"],
                        int((j.get("elapsed_s") or 0) // 5) if j["state"] in ("running", "queued") else 0)
                       for j in jobs)
        if last is not None and last[0] == digest and last[1] == jid:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
        table = render.jobs_table(jobs, _memory_names(studio, me))
        before = {(x[0], x[1]) for x in last[0]} if last is not None else set()
        finished_now = last is not None and any(
            j["state"] in FINAL_STATES and (j["id"], j["state"]) not in before for j in jobs)
        n_metrics = -1
        if jid:
            card, fig, lg = _show_job(studio, jid, me)
            job = _get_job(studio, jid, me)
            n_metrics = len(job["metrics"]) if job else -1
            if last is not None and last[1] == jid and last[2] == n_metrics:
                fig = gr.skip()  # the curve did not change: do not redraw it
        else:
            card, fig, lg = gr.skip(), gr.skip(), gr.skip()
        picker = (gr.update(choices=_job_choices(studio, me))
                  if last is None or len(last[0]) != len(digest) or finished_now else gr.skip())
        if finished_now:
            plist = studio.plugin_service.plugins(owner=me)
            pdf, pdd = render.plugins_table(plist), gr.update(choices=[(p["name"], p["id"]) for p in plist])
        else:
            pdf, pdd = gr.skip(), gr.skip()
        return table, card, fig, lg, picker, pdf, pdd, (digest, jid, n_metrics)

    c.timer.tick(tick, [c.selected_job, c.seen],
                 [c.jobs_df, c.job_html, c.loss, c.log, c.job_pick, c.plug_df, c.plug_pick, c.seen],
                 show_progress="hidden", api_visibility="private")


def _wire_plugin_list(studio, c: SimpleNamespace) -> None:
    """A plug-in's details and status; continue its training as a new plug-in; delete it."""
    def show_plugin(pid, request: gr.Request):
        hidden = gr.update(visible=False)
        if not pid:
            return hidden, "", hidden, hidden
        me = owner_of(studio, request)
        try:
            d = studio.plugin_service.plugin_detail(pid, owner=me)
        except UserError as e:
            return gr.update(visible=True, value=json.dumps({"error": str(e)})), "", hidden, hidden
        d.pop("history", None)
        p = next((x for x in studio.plugin_service.plugins(owner=me) if x["id"] == pid), {})
        can = gr.update(visible=bool(p.get("can_continue")))
        return gr.update(visible=True, value=json.dumps(d, indent=2, default=str)), render.plugin_status(p), can, can

    c.plug_pick.change(show_plugin, c.plug_pick, [c.plug_detail, c.plug_status, c.plug_continue, c.more_minutes],
                       show_progress="hidden")

    @user_errors
    def do_continue(pid, minutes, request: gr.Request):
        if not pid:
            raise UserError("Choose a plug-in to continue training.")
        me = owner_of(studio, request)
        cfg = {"max_minutes": float(minutes)} if minutes else {}
        jid = studio.plugin_service.submit_continue(pid, cfg, owner=me)
        job = studio.job_service.job(jid, owner=me)
        return (jid, gr.update(choices=_job_choices(studio, me), value=jid), render.job_card(job),
                plots.loss_curve([]), "",
                f"<div class='pema-status ok'>Queued job <code>{render.esc(jid)}</code>: continues from the saved "
                f"weights and optimizer state as a new plug-in.</div>")

    c.plug_continue.click(do_continue, [c.plug_pick, c.more_minutes],
                          [c.selected_job, c.job_pick, c.job_html, c.loss, c.log, c.plug_status],
                          api_visibility="private")

    @user_errors
    def do_delete(pid, request: gr.Request):
        if not pid:
            return gr.skip(), gr.skip(), gr.skip()
        me = owner_of(studio, request)
        gr.Info(studio.plugin_service.delete_plugin(pid, owner=me))
        plist = studio.plugin_service.plugins(owner=me)
        return (render.plugins_table(plist), gr.update(choices=[(p["name"], p["id"]) for p in plist], value=None),
                gr.update(visible=False))

    c.plug_delete.click(do_delete, c.plug_pick, [c.plug_df, c.plug_pick, c.plug_detail],
                        js="(p) => (p && confirm('Delete this plug-in?')) ? p : null", api_visibility="private")


def build(studio) -> SimpleNamespace:
    methods = {m["method"]: m for m in studio.plugin_service.methods()}
    c = SimpleNamespace(methods=methods, first=next((k for k in methods if shown_first(k)), next(iter(methods), None)),
                        selected_job=gr.State(None), seen=gr.State(None))
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=340):
            _training_form(studio, c)
        with gr.Column(scale=3, min_width=440):
            _jobs_panel(c)
    _plugin_list_panel(c)
    c.timer = gr.Timer(1.0, active=False)  # on while any of the owner's jobs runs (poll_while_running)
    _wire_training_form(studio, c)
    _wire_jobs(studio, c)
    _wire_plugin_list(studio, c)
    poll_while_running(studio, c.timer, c.selected_job, c.seen, any_job=True)
    # a continuation is a training too (the service also refuses a second continuation of one plug-in, API calls too)
    disable_while_running(studio, {c.train: (TRAIN_LABEL, "A training is running… (Cancel job stops it)"),
                                   c.plug_continue: (CONTINUE_LABEL, "A training is running…")},
                          c.selected_job, c.seen, kind="train_plugin")
    disable_while_running(studio, {}, c.selected_job, c.seen, stops=(c.cancel,))

    def lists(me, mem_value=None):
        choices = memory_choices(studio, me)
        plist = studio.plugin_service.plugins(owner=me)
        mem = keep_value(choices, mem_value)
        return (choices_update(choices, mem_value), render.plugins_table(plist),
                gr.update(choices=[(p["name"], p["id"]) for p in plist]), _memory_warning(studio, mem, me))

    @user_errors
    def refresh(mem_value, request: gr.Request):
        """Opening the tab: the lists, and the job poll on when a job started elsewhere runs."""
        me = owner_of(studio, request)
        return (*lists(me, mem_value), gr.Timer(active=jobs_busy(studio, me)))

    def on_load(me):
        """Page (re)load for owner ``me``: lists, and the running (else latest) job with its curve and log."""
        jobs = studio.job_service.list_jobs(limit=30, owner=me)
        active = ([j for j in jobs if j["state"] == "running"]
                  or [j for j in jobs if j["kind"] == "train_plugin" and j["metrics"]]
                  or [j for j in jobs if j["kind"] == "train_plugin"])
        jid = active[0]["id"] if active else None
        mem_dd, pdf, pdd, warn = lists(me)
        card, fig, lg = _show_job(studio, jid, me)
        return (mem_dd, pdf, pdd, render.jobs_table(jobs, _memory_names(studio, me)),
                gr.update(choices=_job_choices(studio, me), value=jid), jid, card, fig, lg, warn)

    def restore(me, saved: dict):
        """This browser's last memory and method (``saved``), when they are still the owner's and still exist."""
        mid = saved.get("train_memory")
        ids = [x[1] for x in memory_choices(studio, me)]
        meth = saved.get("train_method")
        return (gr.update(value=mid) if mid in ids else gr.skip(),
                _memory_warning(studio, mid, me) if mid in ids else gr.skip(),
                gr.update(value=meth) if meth in methods else gr.skip())

    build_packages(studio)
    return SimpleNamespace(refresh=refresh, refresh_keys=["train_memory"],
                           refresh_inputs=[c.memory],
                           refresh_outputs=[c.memory, c.plug_df, c.plug_pick, c.memory_warn, c.timer],
                           on_load=on_load, load_outputs=[c.memory, c.plug_df, c.plug_pick, c.jobs_df, c.job_pick,
                                                          c.selected_job, c.job_html, c.loss, c.log, c.memory_warn],
                           persist=[("train_memory", c.memory), ("train_method", c.method)],
                           restore=restore, restore_outputs=[c.memory, c.memory_warn, c.method])


PACKAGE_HELP = ("A package is what `python -m plugins export` writes — config, safetensors weights, PEFT's files for "
                "LoRA, a model card, SHA-256 manifest — zipped. Import checks it like the CLI does (hashes, backbone "
                "fingerprint, safetensors only) and adds it to your plug-ins under a new id. kNN packages need the "
                "datastore: it holds your memory's training entries and samples, i.e. your training data.")


def build_packages(studio) -> None:
    """The Export / Import block of the Plug-ins tab: a plug-in package as a zip download, and a zip upload into the
    caller's catalog (``PluginService.export_plugin_zip`` / ``import_plugin_zip``). Its two events are API endpoints
    (``/export_plugin``, ``/import_plugin``)."""
    with gr.Accordion("Export / import a plug-in package", open=False, elem_id="plugin-packages"):
        gr.Markdown(PACKAGE_HELP, elem_classes=["pema-help"])
        with gr.Row(equal_height=False):
            with gr.Column(min_width=300):
                # any id is accepted (the API passes one); the service answers only for the caller's own
                pick = gr.Dropdown([], label="Plug-in to export", elem_id="export-pick", allow_custom_value=True)
                with_datastore = gr.Checkbox(False, label="Include the datastore (required for kNN)")
                export = gr.Button("Export (.zip)", size="sm", elem_id="export-plugin")
                exported = gr.File(label="Package", interactive=False, elem_id="export-file")
            with gr.Column(min_width=300):
                upload = gr.File(label="Package to import (.zip)", file_types=[".zip"], type="filepath",
                                 elem_id="import-file")
                new_name = gr.Textbox(label="Name (optional)", placeholder="defaults to the package's name")
                do_import = gr.Button("Import", size="sm", variant="primary", elem_id="import-plugin")
                imported = gr.JSON(label="Imported", visible=True, elem_id="import-result")

    def choices(request: gr.Request):
        try:
            plist = studio.plugin_service.plugins(owner=owner_of(studio, request))
        except UserError:
            return gr.skip()
        return gr.update(choices=[(f"{p['name']} · {p['method']}", p["id"]) for p in plist])

    pick.focus(choices, None, pick, show_progress="hidden", api_visibility="private")

    @user_errors
    def export_plugin(plugin_id: str, include_datastore: bool, request: gr.Request):
        """One of your plug-ins as a zipped package (a file to download)."""
        if not plugin_id:
            raise UserError("Choose a plug-in to export.")
        return str(studio.plugin_service.export_plugin_zip(plugin_id, include_datastore=bool(include_datastore),
                                                           owner=owner_of(studio, request)))

    export.click(export_plugin, [pick, with_datastore], exported, api_name="export_plugin")

    @user_errors
    def import_plugin(package: str, name: str, request: gr.Request):
        """Import a zipped plug-in package into your plug-ins; returns the new plug-in (id, name, method, ...)."""
        if not package:
            raise UserError("Choose a plug-in package (.zip) to import.")
        me = owner_of(studio, request)
        data, _ = read_upload(studio, request, package)
        try:
            return studio.plugin_service.import_plugin_zip(data, name or "", owner=me)
        except UserError as e:  # unpacked in a temporary folder, its datastore in the data directory: no paths
            raise UserError(without_server_paths(str(e), studio.root)) from None
        finally:
            studio.uploads.consume(package)  # read, imported or refused: a retry uploads it again

    do_import.click(import_plugin, [upload, new_name], imported, api_name="import_plugin")
