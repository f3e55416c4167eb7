"""Assemble the page: header with the backbone's loading state and (multi-user mode) the caller's identity and key,
the four workspace tabs, and the explicit API endpoints. ``build_app(studio)`` returns the studio's ``gr.Blocks``;
the read-only share page is a separate one (``ui/shared.py``); ``launch_app`` serves both (``ui/server.py``)."""
from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import gradio as gr

from ground.errors import UserError
from ui import api, compare, evaluate, memories, plugins, rank, render, shared, shares
from ui.common import CSS, THEME, caller, idle_queue
from ui.gradio_internals import make_private
from ui.server import Served, serve

INTRO = ("Customize a frozen language model with your own text — no fine-tuning: build an external memory of the "
         "model's hidden states, train small plug-ins, compare methods side by side.")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
KEY_HELP = ("Everything you make here — memories, plug-ins, jobs, comparisons, shares — is visible only to you. "
            "This browser keeps your key in a cookie; to use the API as yourself, send it with every call:\n\n"
            "```python\nfrom gradio_client import Client\n"
            "client = Client(\"<this page's address>\", headers={\"X-Pema-Key\": \"<your key>\"})\n```\n\n"
            "Keep the key secret: whoever has it can read and delete your things. Losing it (clearing cookies) "
            "loses access to them.")


def oauth_enabled() -> bool:
    """A Hugging Face Space with ``hf_oauth: true`` (and Gradio's OAuth dependency, ``authlib``, installed): the
    page offers "Sign in with Hugging Face"."""
    return bool(os.environ.get("SPACE_ID") and os.environ.get("OAUTH_CLIENT_ID")
                and importlib.util.find_spec("authlib") is not None)


def multi_user_default(host: str) -> bool:
    """Multi-user unless the app is bound to this machine only."""
    return host not in LOCAL_HOSTS


def mode_banner(studio, host: str) -> str:
    """One line at start-up saying who may use the studio and how they are told apart."""
    if not studio.multi_user:
        where = "bound to this machine only" if host in LOCAL_HOSTS else f"bound to {host} (--single-user)"
        return (f"PEMA Studio: single-user mode ({where}): everything belongs to the local user. Pass --multi-user "
                f"(or bind to another --host) to host it for several people.")
    how = ("the signed-in Hugging Face user, else " if oauth_enabled() else "") + \
        "a per-browser key (cookie), or the X-Pema-Key header for API clients"
    lim = studio.limits
    return (f"PEMA Studio: multi-user mode (bound to {host}): each caller sees only their own things, told apart by "
            f"{how}. Limits: {lim.input_chars} characters, {lim.max_new_tokens} new tokens, {lim.beams} beams, "
            f"{lim.jobs_per_owner} jobs per user ({lim.jobs_total} overall); see --limit.")


SELECTIONS_KEY = "pema-studio-"  # localStorage keys of the selections this browser keeps (one per selection)
REMOTE_HELP = ("Work against a **model owner's offsite service** (`python -m offsite serve`, docs/offsite.md): "
               "the owner computes f(c) and runs the decoder; its final norm and LM head are fetched once; your "
               "memories and PEMA / kNN plug-ins stay here. In-network methods need the decoder's layers and are "
               "unavailable. The token is kept in this process's memory only. Leave the URL empty to go back to "
               "the local backbone.")


def status_html(st: dict) -> str:
    """The header: the backbone's state and, under a remote backbone, which side holds what."""
    remote = st.get("remote")
    extra = (f"<div class='pema-status' id='pema-remote-holds'>{render.esc(remote['holds'])} · offsite methods: "
             f"{render.esc(remote['methods'])}</div>") if remote else ""
    return render.status_header(st) + extra


def _header(studio) -> SimpleNamespace:
    """The title, the backbone's state (polled while it loads) and, in multi-user mode, the caller's identity and
    key."""
    h = SimpleNamespace()
    with gr.Row(equal_height=True):
        gr.Markdown(f"# PEMA Studio\n{INTRO}", elem_id="pema-title")
        if studio.multi_user and oauth_enabled():
            gr.LoginButton(scale=0, min_width=220)
    h.status = gr.HTML(status_html(studio.backbone_service.status()), elem_id="pema-status")
    h.status_timer = gr.Timer(1.0, active=not studio.backbone_service.status()["ready"])
    with gr.Accordion("Your key (for the API)", open=False, visible=studio.multi_user, elem_id="pema-identity"):
        h.who = gr.Markdown(elem_id="pema-who")
        h.key = gr.Textbox(label="Your key", type="password", buttons=["copy"], interactive=False,
                           elem_id="pema-key")
        gr.Markdown(KEY_HELP, elem_classes=["pema-help"])
    return h


def _remote_panel(studio, h: SimpleNamespace) -> None:
    """Single-user mode only: a hosted studio's remote is its operator's (app.py --remote), not per user."""
    with gr.Accordion("Remote backbone (offsite)", open=False, visible=not studio.multi_user,
                      elem_id="pema-remote"):
        gr.Markdown(REMOTE_HELP, elem_classes=["pema-help"])
        with gr.Row(equal_height=True):
            remote_url = gr.Textbox(studio.backbone_service.remote_url or "", label="Model owner's service URL",
                                    scale=3, placeholder="http://127.0.0.1:8765", elem_id="remote-url")
            remote_token = gr.Textbox(label="Bearer token (empty: $PEMA_REMOTE_TOKEN)", type="password",
                                      scale=2, elem_id="remote-token")
            remote_apply = gr.Button("Apply", variant="primary", size="sm", scale=0, min_width=90,
                                     elem_id="remote-apply")
        remote_msg = gr.HTML(elem_id="remote-message")

    def on_remote(url, token):
        try:
            st = studio.backbone_service.set_remote(url, token)
        except UserError as e:
            return gr.skip(), gr.skip(), f"<div class='pema-status err'>{render.esc(e)}</div>", gr.skip()
        where = f"the model owner at {st['remote']['host']}" if st.get("remote") else "the local backbone"
        return (status_html(st), gr.Timer(active=True), f"<div class='pema-help'>Switching to {where}: the "
                f"header shows its progress. Reopen a tab to refresh its lists.</div>", "")

    remote_apply.click(on_remote, [remote_url, remote_token], [h.status, h.status_timer, remote_msg, remote_token],
                       show_progress="hidden", api_visibility="private")


BACKBONE_HELP = ("This machine has a GPU: besides the embedded backbones the studio offers larger models from the "
                 "Hugging Face Hub, loaded in bfloat16 with memory builds of larger batches. The Gemma models are "
                 "gated: accept their licence on the Hub and set `HF_TOKEN` before starting the studio. Memories and "
                 "plug-ins belong to the backbone they were made with; switch back to use them again.")


def backbone_choices(menu: list[dict]) -> tuple[list[tuple[str, str]], str | None]:
    """The menu's dropdown choices (label, name) and the current backbone's name (None: not in the menu)."""
    choices = [(f"{e['label']}" + (f" · {e['parameters']}" if e.get("parameters") else "") + f" ({e['name']})",
                e["name"]) for e in menu]
    return choices, next((e["name"] for e in menu if e.get("current")), None)


def _backbone_panel(studio, h: SimpleNamespace) -> None:
    """On a GPU, single-user mode: switch to a larger backbone (``studio.backbone_menu``); hidden without one."""
    menu = studio.backbone_service.backbone_menu()
    choices, current = backbone_choices(menu)
    with gr.Accordion("Backbone (GPU)", open=False, visible=bool(menu), elem_id="pema-backbone-menu"):
        gr.Markdown(BACKBONE_HELP, elem_classes=["pema-help"])
        with gr.Row(equal_height=True):
            choice = gr.Dropdown(choices, value=current, label="Backbone", scale=4, elem_id="backbone-choice")
            load = gr.Button("Load", variant="primary", size="sm", scale=0, min_width=90, elem_id="backbone-load")
        msg = gr.HTML(elem_id="backbone-message")

    def load_backbone(name):
        try:
            st = studio.backbone_service.set_backbone(name)
        except UserError as e:
            return gr.skip(), gr.skip(), f"<div class='pema-status err'>{render.esc(e)}</div>"
        return (status_html(st), gr.Timer(active=True), f"<div class='pema-help'>Loading {render.esc(name)}: the "
                f"header shows its progress. Reopen a tab to refresh its lists.</div>")

    load.click(load_backbone, [choice], [h.status, h.status_timer, msg], show_progress="hidden",
               api_visibility="private")


def _tabs(studio) -> SimpleNamespace:
    """The workspace tabs (each a ``gr.Tab`` and what its builder returns)."""
    t = SimpleNamespace()
    with gr.Column(visible=True):
        with gr.Tabs():
            with gr.Tab("Memories", id="memories") as t.t_mem:
                t.mem = memories.build(studio)
            with gr.Tab("Plug-ins", id="plugins") as t.t_plug:
                t.plug = plugins.build(studio)
            with gr.Tab("Compare", id="compare") as t.t_cmp:
                t.cmp = compare.build(studio)
            with gr.Tab("Evaluate", id="evaluate") as t.t_eval:
                t.ev = evaluate.build(studio, t.cmp.settings_inputs, t.cmp.settings_of, t.cmp.global_of)
            with gr.Tab("Rank", id="rank") as t.t_rank:
                t.rk = rank.build(studio)
    return t


def _kept_selections(t: SimpleNamespace) -> dict:
    """Selections that persist per browser (localStorage): memory, methods, task of each tab. One BrowserState per
    selection (no two events write the same one); the user's own choices are kept (``.input``), and a page load
    restores them — ids that are not the caller's are dropped there."""
    persist = [*t.plug.persist, *t.cmp.persist, *t.ev.persist]
    kept = {name: gr.BrowserState(None, storage_key=SELECTIONS_KEY + name.replace("_", "-")) for name, _ in persist}
    for name, comp in persist:
        comp.input(lambda v: v, comp, kept[name], show_progress="hidden", api_visibility="private", queue=False)
    return kept


def _wire_tab_refresh(t: SimpleNamespace, kept: dict) -> None:
    """Tabs refresh their choices when opened (things made in other tabs appear)."""
    def refresher(tab):
        """A tab's refresh on opening it, with the kept selection standing in for each of its inputs that has
        one (``tab.refresh_keys``): it is the user's latest choice, and a refresh that started before the
        page load put it back would otherwise undo it."""
        keys = tab.refresh_keys
        named = [k for k in keys if k]

        def fn(request: gr.Request, *args):
            current, saved = list(args[:len(keys)]), dict(zip(named, args[len(keys):]))
            vals = [saved[k] if k and saved.get(k) not in (None, "", []) else c for k, c in zip(keys, current)]
            return tab.refresh(*vals, request)

        return fn, [*tab.refresh_inputs, *[kept[k] for k in named]]

    t.t_mem.select(t.mem.refresh, None, t.mem.refresh_outputs, show_progress="hidden", api_visibility="private")
    for tab_ev, tab in ((t.t_plug, t.plug), (t.t_cmp, t.cmp), (t.t_eval, t.ev), (t.t_rank, t.rk)):
        fn, ins = refresher(tab)
        tab_ev.select(fn, ins, tab.refresh_outputs, show_progress="hidden", api_visibility="private")


def _wire_page_load(studio, demo, h: SimpleNamespace, t: SimpleNamespace, kept: dict) -> None:
    """Page load: the caller's identity and their own things; then this browser's kept selections are put back
    (each tab keeps only what is the caller's)."""
    rest = [*t.mem.load_outputs, *t.plug.load_outputs, *t.cmp.load_outputs, *t.ev.load_outputs, *t.rk.load_outputs]

    def on_load(request: gr.Request):
        st = status_html(studio.backbone_service.status())
        try:
            me = caller(studio, request)
        except UserError as e:
            return (st, f"**{render.esc(e)}**", "", *[gr.skip()] * len(rest))
        if me.owner is None:  # multi-user mode and the browser refused the key cookie
            return (st, "**This browser did not keep the studio's cookie, so the studio cannot tell your things "
                        "from others': allow cookies for this site and reload.**", "", *[gr.skip()] * len(rest))
        who_text = f"You are **{render.esc(me.describe())}**."
        return (st, who_text, me.key, *t.mem.on_load(me.owner), *t.plug.on_load(me.owner), *t.cmp.on_load(me.owner),
                *t.ev.on_load(me.owner), *t.rk.on_load(me.owner))

    names = list(kept)
    restored = [*t.plug.restore_outputs, *t.cmp.restore_outputs, *t.ev.restore_outputs]

    def on_restore(request: gr.Request, *saved_values):
        saved = {n: v for n, v in zip(names, saved_values) if v not in (None, "", [])}
        try:
            me = caller(studio, request).owner
        except UserError:
            me = None
        if me is None or not saved:
            return tuple(gr.skip() for _ in restored)
        return (*t.plug.restore(me, saved), *t.cmp.restore(me, saved), *t.ev.restore(me, saved))

    demo.load(on_load, None, [h.status, h.who, h.key, *rest], show_progress="hidden",
              api_visibility="private").then(on_restore, [kept[n] for n in names], restored,
                                             show_progress="hidden", api_visibility="private")


def build_app(studio) -> gr.Blocks:
    # delete_cache: Gradio's copies of the files it served (evaluation downloads) go after a day
    with gr.Blocks(title="PEMA Studio", analytics_enabled=False, delete_cache=(3600, 86400)) as demo:
        h = _header(studio)
        _remote_panel(studio, h)
        _backbone_panel(studio, h)
        t = _tabs(studio)
        shares.build(studio)
        api.register(studio)

        def on_status():  # the header follows the backbone's loading
            st = studio.backbone_service.status()
            return status_html(st), gr.Timer(active=st["state"] == "loading")

        h.status_timer.tick(on_status, None, [h.status, h.status_timer], show_progress="hidden",
                            api_visibility="private")
        kept = _kept_selections(t)
        _wire_tab_refresh(t, kept)
        _wire_page_load(studio, demo, h, t, kept)
        # Only the explicit endpoints of ui/api.py are part of the API; the page's own events stay private.
        make_private(demo, keep=api.NAMES + api.TAB_NAMES)
    demo.queue(default_concurrency_limit=1, max_size=studio.limits.queue_size or None)
    idle_queue(demo)
    return demo


def launch_app(studio, host: str = "127.0.0.1", port: int = 7860, block: bool = True,
               quiet: bool = False) -> tuple[Served, str]:
    """Serve the studio at ``/`` and the share page at ``/share/``; ``block=False`` returns ``(served, url)`` at
    once (tests; ``served.close()`` stops it)."""
    limit = studio.limits.upload_bytes
    studio.downloads.downloads_root().mkdir(parents=True, exist_ok=True)
    served = serve(studio, build_app(studio), shared.build_app(studio), host, port, theme=THEME, css=CSS,
                   max_file_size=limit + 1_000_000 if limit else None,  # + room for the form around the file
                   downloads=studio.downloads.downloads_root())
    if not quiet:
        print(f"PEMA Studio running on {served.url}")
    if block:
        served.block()
    return served, served.url
