"""Small Gradio helpers shared by the tabs: who is calling, error handling, choices, the theme and the page's CSS."""
from __future__ import annotations

import functools
import time
from collections import Counter

import gradio as gr

from ground.errors import UserError
from ground.jobs import FINAL_STATES
from studio.identity import LOCAL, Caller
from ui.gradio_internals import set_queue_idle_sleeps


def hf_user(request) -> str | None:
    """The Hugging Face user signed in with the page's LoginButton (a Space with ``hf_oauth: true``), if any: read
    from the signed session that Gradio's OAuth support keeps (absent without it)."""
    underlying = getattr(request, "request", None) if request is not None else None
    scope = getattr(underlying, "scope", None)
    session = scope.get("session") if isinstance(scope, dict) else None
    info = (session or {}).get("oauth_info") if isinstance(session, dict) else None
    if not info or (info.get("expires_at") is not None and info["expires_at"] < time.time()):
        return None
    return (info.get("userinfo") or {}).get("preferred_username") or None


def caller(studio, request) -> Caller:
    """Who makes this page event or API call (``studio.identity``): the local user in single-user mode; else the
    key sent in a header, the signed-in HF user, or the browser's key cookie. A header key that is not valid is a
    UserError. Every handler that touches an owner's things asks this for each call (the page's events are callable
    over raw HTTP too, so nothing is taken from the page's own state)."""
    if not studio.multi_user:
        return Caller(LOCAL)
    if request is None:
        return Caller(None, how="none")
    headers = dict(getattr(request, "headers", {}) or {})
    cookies = dict(getattr(request, "cookies", {}) or {})
    return studio.identity.resolve(headers, cookies, hf_user(request))


def owner_of(studio, request) -> str | None:
    """The owner of a call (``None`` when it carries no identity: the service then refuses, saying why)."""
    return caller(studio, request).owner


def user_errors(fn):
    """Show a :class:`UserError` as a Gradio error toast with its message as is (it is written for the user)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            raise gr.Error(str(e), print_exception=False) from None

    return wrapper


def upload_owners(studio, request) -> frozenset[str]:
    """The credentials a request carries itself (``Identity.credentials``): those an upload is bound to."""
    headers = dict(getattr(request, "headers", {}) or {}) if request is not None else {}
    cookies = dict(getattr(request, "cookies", {}) or {}) if request is not None else {}
    return studio.identity.credentials(headers, cookies)


def read_upload(studio, request, path: str | None) -> tuple[bytes | None, str | None]:
    """Bytes and original name of a ``gr.File(type="filepath")`` value: only the caller's own upload
    (``studio.uploads``; any other path gets the same error, whether or not it exists) of at most
    ``limits.upload_bytes`` bytes."""
    if not path:
        return None, None
    p = studio.uploads.check(path, upload_owners(studio, request))
    limit = studio.limits.upload_bytes
    size = p.stat().st_size
    if limit and size > limit:
        raise UserError(f"The file is {size / 1e6:.1f} MB; the limit is {limit / 1e6:.1f} MB (the studio's operator "
                        f"sets it with --limit upload_bytes=… or $PEMA_LIMIT_UPLOAD_BYTES).")
    with open(p, "rb") as f:
        data = f.read(limit + 1) if limit else f.read()
    return data, p.name


def job_poll_key(job: dict) -> tuple:
    """What a polled job card shows; the same key means nothing to redraw. A running job's card also moves on with
    its elapsed time (every 5 s) between progress reports."""
    return (job["id"], job["state"], round(job["progress"], 3), job["message"],
            int((job.get("elapsed_s") or 0) // 5) if job["state"] == "running" else 0)


def jobs_busy(studio, owner, jid=None, drawn=True) -> bool:
    """Whether a tab's job poll has something to show: job ``jid`` (``None``: any of the owner's jobs) is queued or
    running, or has not been drawn yet (``drawn`` False)."""
    try:
        if jid is None:
            return bool(studio.job_service.list_jobs(limit=1, owner=owner, states=("queued", "running"))) or not drawn
        job = studio.job_service.job(jid, owner=owner)
    except UserError:
        return False
    return job["state"] not in FINAL_STATES or not drawn


def poll_while_running(studio, timer, job_state, seen, any_job: bool = False) -> None:
    """A tab's job poll (``timer``, made with ``active=False``) on only while it has something to show: its job
    (``job_state``; with ``any_job`` any of the owner's jobs) is queued or running, or is not drawn yet (``seen``,
    what the poll last drew, still None). An idle page then polls and redraws nothing (BENCHMARKS, "An idle tab").
    Asked whenever the job or what was drawn of it changes: a job started, the page loaded, the poll drew."""
    def switch(jid, last, request: gr.Request):
        try:
            me = owner_of(studio, request)
        except UserError:
            return gr.Timer(active=False)
        if not jid and not any_job:
            return gr.Timer(active=False)
        return gr.Timer(active=jobs_busy(studio, me, None if any_job else jid, last is not None))

    for state in (job_state, seen):
        state.change(switch, [job_state, seen], timer, show_progress="hidden", api_visibility="private")


def disable_while_running(studio, buttons: dict, job_state, seen, kind: str | None = None,
                          stops: tuple = ()) -> None:
    """``buttons`` (``{button: (label, label while its job runs)}``) disabled, their label saying what runs, while
    the tab's job (``job_state``; with ``kind``, any of the owner's jobs of that kind) is queued or running; back
    when it ends, fails or is cancelled. ``stops``: buttons the other way round, enabled only while the job runs
    (its Cancel: made with ``interactive=False``, so that an idle page offers nothing to cancel). Asked when
    ``poll_while_running`` asks (a job started, the page (re)loaded, the poll drew), so a reload during the job finds
    the buttons as the job has them too."""
    def update(jid, _last, request: gr.Request):
        try:
            me = owner_of(studio, request)
            if kind is not None:
                busy = bool(studio.job_service.list_jobs((kind,), 1, owner=me, states=("queued", "running")))
            else:
                busy = bool(jid) and studio.job_service.job(jid, owner=me)["state"] not in FINAL_STATES
        except UserError:
            busy = False
        updates = tuple(gr.update(interactive=not busy, value=running if busy else label)
                        for label, running in buttons.values()) + tuple(gr.update(interactive=busy) for _ in stops)
        return updates[0] if len(updates) == 1 else updates  # (a list or tuple is one output's value)

    for state in (job_state, seen):
        state.change(update, [job_state, seen], [*buttons, *stops], show_progress="hidden",
                     api_visibility="private")


# Gradio's queue looks for new events every 1 ms and for progress to send every 10 ms while nothing happens (Linux
# defaults): a noticeable share of a core for an idle server (BENCHMARKS.md, "An idle tab"). 20 ms and 100 ms instead:
# an event starts at most 20 ms later; what a handler streams (its yields) is sent as before, not by this loop.
QUEUE_IDLE_S, QUEUE_PROGRESS_S = 0.02, 0.1


def idle_queue(demo: gr.Blocks) -> gr.Blocks:
    """``demo`` (after ``demo.queue()``) with its queue's idle loops at ``QUEUE_IDLE_S`` / ``QUEUE_PROGRESS_S``."""
    set_queue_idle_sleeps(demo, QUEUE_IDLE_S, QUEUE_PROGRESS_S)
    return demo


def memory_choices(studio, owner: str | None = None) -> list[tuple[str, str]]:
    return [(f"{m['name']} · {m['task']} · {m['samples']} samples" + ("" if m["usable"] else " (other backbone)"),
             m["id"]) for m in studio.memory_service.memories(owner=owner)]


def plugin_choices(studio, usable_only: bool = True, methods: tuple[str, ...] | None = None,
                   owner: str | None = None, task: str | None = None) -> list[tuple[str, str]]:
    """The owner's plug-ins as ``(label, id)``, each label naming its method and its memory's task; with ``task``,
    only the plug-ins trained on a memory of that task (a translation plug-in answers a formality input in
    German)."""
    out, tasks = [], {}
    for p in studio.plugin_service.plugins(owner=owner):
        if usable_only and not p["usable"]:
            continue
        if methods and p["method"] not in methods:
            continue
        if task and p.get("task") not in (task, None):
            continue
        out.append((f"{p['name']} [{p['method']}]", p["id"]))
        tasks[p["id"]] = p.get("task")
    # Several plug-ins of one method on one memory (e.g. κ or rank variants) would read alike: add the id's tail.
    counts = Counter(label for label, _ in out)
    labels = [(f"{label[:-1]} · {pid.rsplit('-', 1)[-1]}]" if counts[label] > 1 else label, pid) for label, pid in out]
    return [(f"{label} · {tasks[pid]}" if tasks[pid] else label, pid) for label, pid in labels]


def hidden_plugins_note(studio, owner: str | None, task: str | None) -> str:
    """The picker's info line when ``task`` hides plug-ins of other tasks (empty when none are hidden)."""
    if not task:
        return ""
    hidden = [p["task"] for p in studio.plugin_service.plugins(owner=owner)
              if p["usable"] and p.get("task") not in (task, None)]
    if not hidden:
        return ""
    n = len(hidden)
    return (f"Only plug-ins trained for {task} are offered; {n} plug-in{'s' if n != 1 else ''} of "
            f"{' and '.join(sorted(set(hidden)))} {'are' if n != 1 else 'is'} hidden (choose that task to use them).")


def setting_control(method: str, desc: dict, value, **kw):
    """A Gradio control generated from a declared setting (``Setting.describe()``): a checkbox for a bool, a
    dropdown for choices, a slider for a bounded number, else a number box; its help text is the info line."""
    common = dict(label=desc["label"], info=desc["help"] or None, elem_id=setting_elem_id(method, desc["name"]), **kw)
    if desc["type"] == "bool":
        return gr.Checkbox(bool(value), **common)
    if desc["choices"]:
        return gr.Dropdown(desc["choices"], value=value, **common)
    if desc["type"] in ("int", "float") and desc["low"] is not None and desc["high"] is not None:
        step = desc["step"] or (1 if desc["type"] == "int" else (desc["high"] - desc["low"]) / 100)
        return gr.Slider(desc["low"], desc["high"], value, step=step, **common)
    if desc["type"] in ("int", "float"):
        return gr.Number(value, precision=0 if desc["type"] == "int" else None, **common)
    return gr.Textbox(str(value), **common)


def allowed_text(desc: dict) -> str:
    """A declared setting's range in a few words ("≥ 1, ≤ 65536", "> 0, ≤ 1"), or "" when it has none."""
    def num(x) -> str:
        return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e10 else f"{x:g}"

    lo = "" if desc["low"] is None else f"{'>' if desc['low_open'] else '≥'} {num(desc['low'])}"
    hi = "" if desc["high"] is None else f"≤ {num(desc['high'])}"
    return ", ".join(x for x in (lo, hi) if x)


def training_control(method: str, desc: dict, value, **kw):
    """A training-form control generated from a declared training setting: a checkbox for a bool, a dropdown for
    choices, a number box (with its range) for a number, else a text box; help and range are its info line.
    (Number boxes, not sliders: training ranges span decades, e.g. a learning rate or a batch size.)"""
    rng = allowed_text(desc) if desc["type"] in ("int", "float") else ""
    info = " · ".join(x for x in (desc["help"], rng and f"allowed {rng}") if x) or None
    common = dict(label=desc["label"], info=info, elem_id=f"train-{method}-{desc['name']}".replace("_", "-"),
                  min_width=160, **kw)
    if desc["type"] == "bool":
        return gr.Checkbox(bool(value), **common)
    if desc["choices"]:
        return gr.Dropdown(list(desc["choices"]), value=value, **common)
    if desc["type"] in ("int", "float"):
        return gr.Number(value, precision=0 if desc["type"] == "int" else None, minimum=desc["low"],
                         maximum=desc["high"], **common)
    return gr.Textbox(str(value), **common)


def setting_elem_id(method: str, name: str) -> str:
    return f"set-{method}-{name}".replace("_", "-")


# Components start with public values only (the page config is sent to every visitor, shared links included);
# the owner's memories and plug-ins are filled in when the workspace loads.
BASE_CHOICE = [("Base model (no plug-in)", "base")]


def method_choices(studio, owner: str | None = None, task: str | None = None) -> list[tuple[str, str]]:
    """The base model and the owner's plug-ins (with ``task``, only that task's); the best method of each memory's
    latest ranking marked ★."""
    best = studio.rank_service.best_methods(owner=owner)
    return BASE_CHOICE + [(f"{label} ★ {best[pid]}" if pid in best else label, pid)
                          for label, pid in plugin_choices(studio, owner=owner, task=task)]


def keep_value(choices: list[tuple[str, str]], value, default_first: bool = True):
    ids = [c[1] for c in choices]
    if isinstance(value, list):
        return [v for v in value if v in ids]
    if value in ids:
        return value
    return ids[0] if ids and default_first else None


def choices_update(choices: list[tuple[str, str]], current, default=None, default_first: bool = True):
    """New choices for a dropdown or checkbox group, and a value only where ``current`` has to change (an id that
    is gone, or no value yet): a refresh computed from a value that the user has changed since then must not undo
    that change."""
    value = keep_value(choices, current if current not in (None, "", []) else default, default_first)
    if value == current or (isinstance(value, list) and isinstance(current, list) and value == current):
        return gr.update(choices=choices)
    return gr.update(choices=choices, value=value)


THEME = gr.themes.Soft(
    primary_hue="blue", neutral_hue="slate",
    # local font stacks only: the app must render offline (no Google Fonts request)
    font=["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"],
    font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"],
).set(block_padding="10px 12px", layout_gap="12px")

CSS = """
.gradio-container { max-width: 1400px !important; }
#pema-title h1 { margin: 0; font-size: 1.5rem; }
#pema-title p { margin: 2px 0 0 0; color: var(--body-text-color-subdued); }
.pema-status { padding: 6px 10px; border-radius: 6px; font-size: 0.9rem; }
.pema-status.ok { background: rgba(22,163,74,.10); border: 1px solid rgba(22,163,74,.35); }
.pema-status.warn { background: rgba(202,138,4,.10); border: 1px solid rgba(202,138,4,.35); }
.pema-status.err { background: rgba(220,38,38,.10); border: 1px solid rgba(220,38,38,.35); }
.pema-pb { font-size: 0.9rem; }
.pema-pb-title { font-weight: 600; margin-bottom: 4px; }
.pema-pb-track { height: 10px; background: var(--neutral-200); border-radius: 5px; overflow: hidden; }
.dark .pema-pb-track { background: var(--neutral-700); }
.pema-pb-fill { height: 100%; border-radius: 5px; transition: width .4s ease; }
.pema-pb-msg { margin-top: 4px; color: var(--body-text-color); overflow-wrap: anywhere; }
.pema-badge { color: white; border-radius: 4px; padding: 0 6px; font-size: 0.8rem; }
.pema-error { margin-top: 6px; padding: 6px 10px; border-radius: 6px; background: rgba(220,38,38,.08);
              border: 1px solid rgba(220,38,38,.35); overflow-wrap: anywhere; font-size: 0.9rem; }
.pema-error ul { margin: 4px 0 0 18px; }
.pema-muted { color: var(--body-text-color-subdued); font-size: 0.9rem; }
.pema-timing { font-size: 0.9rem; margin-bottom: 8px; }
.pema-ref { font-size: 0.95rem; margin-bottom: 8px; }
.pema-ref span { font-weight: 600; margin-right: 6px; color: var(--body-text-color-subdued); }
.pema-cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(260px, 1fr)); gap: 10px; }
.pema-card { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 10px 12px;
             background: var(--block-background-fill); min-width: 0; }
.pema-card.base { border-style: dashed; }
.pema-card-head { display: flex; justify-content: space-between; gap: 8px; align-items: flex-start;
                  margin-bottom: 6px; }
.pema-card-head b { min-width: 0; overflow-wrap: anywhere; line-height: 1.3; }
.pema-method { font-size: 0.75rem; padding: 1px 6px; border-radius: 4px; background: var(--neutral-100);
               color: var(--neutral-700); white-space: nowrap; }
.dark .pema-method { background: var(--neutral-700); color: var(--neutral-100); }
.pema-card-text { font-size: 1.02rem; line-height: 1.5; overflow-wrap: anywhere; min-height: 1.5em; }
.pema-card-text ins, .pema-timing ins { background: rgba(22,163,74,.18); text-decoration: none;
                                           border-radius: 3px; padding: 0 2px; }
.pema-card-text del, .pema-timing del { background: rgba(220,38,38,.14); color: #b91c1c; border-radius: 3px;
                                           padding: 0 2px; }
.pema-card-foot { margin-top: 8px; font-size: 0.78rem; color: var(--body-text-color-subdued);
                  overflow-wrap: anywhere; }
.pema-card-plain { display: none; }
.pema-card.plain .pema-card-plain { display: block; }
.pema-card.plain .pema-card-diff { display: none; }
.pema-card-actions { display: flex; gap: 6px; margin-top: 8px; }
.pema-act { font-size: 0.75rem; padding: 1px 8px; border-radius: 4px; cursor: pointer;
            border: 1px solid var(--border-color-primary); background: var(--background-fill-secondary);
            color: var(--body-text-color); }
.pema-act:hover { border-color: var(--color-accent); }
abbr.pema-term { text-decoration: underline dotted; cursor: help; }
.pema-warn { margin-top: 6px; padding: 6px 10px; border-radius: 6px; background: rgba(217,119,6,.10);
             border: 1px solid rgba(217,119,6,.45); overflow-wrap: anywhere; font-size: 0.9rem; }
.pema-pb-time { margin-top: 2px; font-size: 0.85rem; color: var(--body-text-color-subdued); }
/* dropdowns: the chosen text ends with an ellipsis before the arrow instead of running under it */
.gradio-container .secondary-wrap input[role="combobox"] { text-overflow: ellipsis; padding-right: 22px; }
/* table headers break between words, never inside one ("distanc e") */
.gradio-container table th, .gradio-container table th * { word-break: normal !important;
  overflow-wrap: normal !important; hyphens: none; }
.pema-shared { padding: 10px 12px; border-radius: 8px; border: 1px solid var(--border-color-primary);
               background: var(--block-background-fill); }
.pema-shared-src { font-size: 1.1rem; margin: 6px 0; overflow-wrap: anywhere; }
.pema-actions { align-items: flex-end !important; }
.pema-help { font-size: 0.88rem; color: var(--body-text-color-subdued); }
"""
