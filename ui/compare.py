"""Compare tab: one sentence, several methods decoded in one batch, outputs side by side with differences from the
base model highlighted; live decode controls (a move re-decodes only from the first token it changes); token-level
views; Share."""
from __future__ import annotations

import json
from collections import OrderedDict, namedtuple
from types import SimpleNamespace
from typing import Any, NamedTuple

import gradio as gr

from backbone.prompts import TASKS
from engine.comparison import COMPARISON_SETTINGS
from ground.errors import UserError
from plugins.registry import get_method, shown_first
from plugins.settings import ALL_ROWS
from ui import inspect as neighbour_panel
from ui import plots, render, several
from ui.common import (
    BASE_CHOICE,
    choices_update,
    hidden_plugins_note,
    keep_value,
    memory_choices,
    method_choices,
    owner_of,
    setting_control,
    user_errors,
)

TOKEN_COLORS = {"selected": "#2563eb", "λ high": "#fb923c", "λ low": "#fde68a"}
TOKEN_HELP = ("Colours: <b>λ high</b> = the plug-in's weight λ_t in the mix P = λ_t·P_plug-in + (1−λ_t)·P_LM was "
              "≥ 0.5 at that token, <b>λ low</b> = between 0 and 0.5, no colour = 0 or a method without λ (the base "
              "model, in-network plug-ins); <b>selected</b> = the token the views below show. ⏎ is a line break, "
              "∅ an empty token.")
NEIGHBOUR_HEADERS = ["rank", "token", "distance", "memory sample: source", "memory sample: target"]
NEIGHBOUR_HELP = ("The k nearest memory entries of this output token's context f(c): their value token, the squared "
                  "L2 distance of their key (smaller = closer) and the memory sample they come from. A token shown "
                  "as #1234 is a token id whose text this page does not have (a shared view).")


def row_of(payload: dict | None, label: str | None) -> dict | None:
    """The row called ``label``, else the most interesting one: PEMA, another plug-in, the base model."""
    if not payload:
        return None
    rows = payload["rows"]
    return (next((r for r in rows if r["label"] == label), None)
            or next((r for r in rows if shown_first(r["method"])), None)
            or next((r for r in rows if r["method"] != "base"), rows[0] if rows else None))


def token_views(payload: dict | None, label: str | None, idx: int, neighbours=None) -> tuple:
    """(chips, λ curve, top-token bars, neighbour rows, neighbour plot, memory-attention heat map) for one token.

    ``neighbours(label, idx)`` returns the kNN neighbours with their memory samples (owner's view); without it
    only what the trace itself holds (token and distance) is shown — the shared view.
    """
    row = row_of(payload, label)
    if row is None:
        e = plots.empty("Run a comparison first")
        return [], e, e, [], e, e
    n = len(row.get("trace") or [])
    idx = max(0, min(int(idx or 0), n - 1)) if n else 0
    entry = row["trace"][idx] if n else None
    lam = plots.lambda_curve(payload["rows"], (row["label"], idx))
    bars = plots.token_bars(entry)
    nb_rows, nb_plot = [], plots.empty("No kNN neighbours for this method")
    if entry and entry.get("neighbours"):
        if neighbours is not None:
            nbs = neighbours(row["label"], idx)
        else:
            nbs = [{"token": _tok_text(payload, row, nb), "distance": nb.get("distance")} for nb in entry["neighbours"]]
        nb_rows = [[i + 1, nb.get("token", ""), nb.get("distance"), nb.get("source", "—"), nb.get("target", "—")]
                   for i, nb in enumerate(nbs)]
        nb_plot = plots.neighbour_bars(nbs)
    mem_att = plots.memory_attention_heatmap(row)
    return render.token_chips(row, idx), lam, bars, nb_rows, nb_plot, mem_att


def _tok_text(payload, row, nb) -> str:
    """A neighbour's value token as text, from the token texts that the payload already holds."""
    tid = nb.get("token")
    for r in payload["rows"]:
        for t, s in zip(r.get("tokens", []), r.get("token_texts", [])):
            if t == tid:
                return s
        for e in r.get("trace", []):
            for key in ("top_lm", "top_plugin", "top_final"):
                for t, s, _ in e.get(key) or []:
                    if t == tid:
                        return s
    return f"#{tid}"


class TokenViewOutputs(NamedTuple):
    """The token views of one output token, in the order of the components they update (``TokenInspector.views``)."""

    chips: Any
    lambda_plot: Any
    bars_plot: Any
    neighbours: Any
    neighbour_plot: Any
    memory_attention: Any
    attention: Any
    neighbour_row: Any
    memory_column: Any


# Gradio's slider sends "release" when the pointer lets go, not after a move with the arrow keys: a key released on a
# slider settles it the same way (its one decode runs then). Once per page.
SLIDER_KEYS_JS = """
if (!window.pemaSliderKeys) {
  window.pemaSliderKeys = true;
  document.addEventListener('keyup', (e) => {
    const t = e.target;
    if (t instanceof HTMLInputElement && t.type === 'range') {
      t.dispatchEvent(new PointerEvent('pointerup', {bubbles: true, composed: true}));
    }
  }, true);
}
"""


class CompareOutputs(namedtuple("CompareOutputs", ("payload", "cards", "method", "token", "share_link", "layer",
                                                   "token_section", *TokenViewOutputs._fields))):
    """What a comparison updates: one field a component (``build`` declares which), the token views last, so that
    ``do_compare`` says what each value is for instead of relying on its position."""

    __slots__ = ()

    @classmethod
    def skip(cls, **given) -> CompareOutputs:
        """The ``given`` updates; every other component is left as it is."""
        return cls(**{f: given.get(f, gr.skip()) for f in cls._fields})


def _sentence_panel(c: SimpleNamespace) -> None:
    """The sentence, its task, Compare / Stop, the examples, a memory's held-out samples and several sentences."""
    with gr.Row(equal_height=True):
        c.source = gr.Textbox(label="Sentence", lines=2, max_lines=4, scale=5, elem_id="compare-source",
                              placeholder="Type a sentence to translate or rewrite, then press Compare")
        with gr.Column(scale=1, min_width=170):
            c.task = gr.Dropdown(list(TASKS), value="translation", label="Task", elem_id="compare-task")
            c.run = gr.Button("Compare", variant="primary", elem_id="compare-run")
            c.stop = gr.Button("Stop", variant="stop", size="sm", elem_id="compare-stop")
    several.examples_row(c.source, c.task, c.reference)
    with gr.Accordion("…or pick a held-out sample of a memory", open=False):
        with gr.Row():
            c.hmem = gr.Dropdown([], label="Memory", scale=2, elem_id="compare-memory")
            c.hsample = gr.Dropdown([], label="Held-out sample", scale=3, elem_id="compare-sample")
        c.hmem_warn = gr.HTML(elem_id="compare-memory-warning")
    c.several_box = several.panel()


def _methods_panel(studio, c: SimpleNamespace) -> None:
    """The methods to decode together and their live controls, generated from the methods' declared decode settings
    (``live=True``); each is addressed to its own method only. They start at the task's tuned values and follow the
    Task choice."""
    c.methods = gr.CheckboxGroup(BASE_CHOICE, value=["base"], label="Methods (decoded together in one batch)",
                                 elem_id="compare-methods")
    # one prompt for every row without its own (the retrieved examples bring theirs): chosen here, or set by the first
    # comparison (the first ticked plug-in's memory, else the built-in examples) and then kept whatever is ticked
    c.prompt_from = gr.Dropdown(PROMPT_CHOICES, value=None, label="Examples in the prompt", elem_id="compare-prompt",
                                info="What every row without a prompt of its own reads; the first comparison sets "
                                     "it, ticking methods never changes it")
    c.table = {m["method"]: m for m in studio.plugin_service.methods()}
    start = studio.plugin_service.start_settings("translation")
    c.live_keys = []  # (method, setting name) of every live control, in component order
    c.live_ctls = []
    with gr.Row(equal_height=True, elem_id="live-controls"):
        for m, info in c.table.items():
            for d in info["decode_settings"]:
                if d["live"]:
                    c.live_keys.append((m, d["name"]))
                    c.live_ctls.append(setting_control(m, d, start[m][d["name"]], visible=False, min_width=180))
    c.live_names = {m: {n for mm, n in c.live_keys if mm == m} for m in c.table}
    c.glob = gr.Checkbox(False, label="Global defaults", elem_id="compare-global-defaults",
                         info="Start every plug-in at the settings tuned once on WMT dev, not at those tuned on its "
                              "own memory's held-out samples (the picker says which plug-ins have them)")
    # what each live control was last set to by this page (a plug-in's tuned start, or the task's): a control at
    # that value is untouched and not sent, so every row starts at its own plug-in's settings; a moved one is sent
    c.starts = gr.State({f"{m}|{n}": start[m][n] for m, n in c.live_keys})
    c.knob_hint = gr.HTML("<div class='pema-help'>Live controls appear for the chosen methods that have them; a move "
                          "(once the slider settles) re-mixes the moved row's kept steps and decodes again only from "
                          "the first token it "
                          "changes (no forward pass when no token changes). Other settings are under “More decode "
                          "settings”.</div>", js_on_load=SLIDER_KEYS_JS)


def _settings_panel(c: SimpleNamespace) -> None:
    """More decode settings: length, beams, the settings of the whole comparison, other settings per method."""
    with gr.Accordion("More decode settings", open=False):
        with gr.Row():
            c.max_new = gr.Slider(4, 128, 48, step=1, label="Max new tokens")
            c.beams = gr.Slider(1, 4, 1, step=1, label="Beams (1 = greedy)")
            # settings of the whole comparison (every row alike, the base model's included), declared once in
            # engine.comparison.COMPARISON_SETTINGS: the repetition guard
            c.comp_keys = [(ALL_ROWS, d.name) for d in COMPARISON_SETTINGS]
            c.comp_ctls = [setting_control(ALL_ROWS, d.describe(), d.default) for d in COMPARISON_SETTINGS]
        c.extra = gr.Code("{}", language="json", lines=4, max_lines=12,
                          label="Other decode settings per method (or plug-in id); edit and press Compare")
        gr.Markdown("Each output card lists the complete settings its row was decoded with.",
                    elem_classes=["pema-help"])
    c.extra_auto = gr.State("{}")


def _outputs_panel(c: SimpleNamespace) -> None:
    """The output cards and Share."""
    c.cards = gr.HTML(render.output_cards(None), elem_id="compare-outputs", js_on_load=render.CARDS_JS)
    with gr.Row(equal_height=True):
        c.share_btn = gr.Button("Share this comparison", scale=1, elem_id="share-btn")
        c.share_link = gr.Textbox(show_label=False, placeholder="The link appears here", buttons=["copy"],
                                  interactive=False, scale=4, elem_id="share-link", container=False)


def _token_panel(studio, c: SimpleNamespace) -> None:
    """Token by token (shown after a comparison): the chosen method's tokens, its λ curve and top tokens, the kNN
    neighbours, attention over the memory and over the input, the neighbour map."""
    n_layers = max(1, int(studio.backbone_service.status().get("layers") or 1))
    with gr.Column(visible=False) as c.token_section:
        gr.Markdown("#### Token by token")
        with gr.Row(equal_height=True):
            c.row_pick = gr.Dropdown([], label="Method", scale=2, elem_id="inspect-method")
            c.tok = gr.Slider(0, 1, 0, step=1, label="Output token", scale=3, elem_id="inspect-token")
            c.layer = gr.Slider(0, max(1, n_layers - 1), max(0, n_layers - 1), step=1,
                                label="Backbone attention layer", scale=2, elem_id="attention-layer")
        c.chips = gr.HighlightedText([], color_map=TOKEN_COLORS, combine_adjacent=False, show_legend=True,
                                     label="Output tokens — click one", elem_id="token-chips")
        gr.HTML(f"<div class='pema-help'>{TOKEN_HELP}</div>", elem_id="token-help")
        with gr.Row(equal_height=True):
            c.lam_plot = gr.Plot(plots.empty("Run a comparison first"), show_label=False)
            c.bars_plot = gr.Plot(plots.empty("Run a comparison first"), show_label=False)
        with gr.Row(equal_height=True, visible=False) as c.nb_row:
            with gr.Column():
                c.nb_df = gr.Dataframe(headers=NEIGHBOUR_HEADERS, interactive=False, max_height=300, wrap=True,
                                       label="kNN neighbours of the chosen token, with their memory samples",
                                       column_widths=["9%", "12%", "19%", "30%", "30%"],
                                       elem_id="compare-neighbours", show_search="none")
                gr.HTML(f"<div class='pema-help'>{NEIGHBOUR_HELP}</div>")
            c.nb_plot = gr.Plot(plots.empty("No kNN neighbours yet"), show_label=False)
        with gr.Row(equal_height=True):
            with gr.Column(visible=False, min_width=400) as c.mem_col:
                c.mem_att = gr.Plot(plots.empty("Attention over memory items (in-network methods)"),
                                    show_label=False)
            c.att_plot = gr.Plot(plots.empty("Backbone attention appears after a comparison"), show_label=False)
        neighbour_panel.mount(studio, c.payload)
    c.token_views = TokenViewOutputs(
        chips=c.chips, lambda_plot=c.lam_plot, bars_plot=c.bars_plot, neighbours=c.nb_df, neighbour_plot=c.nb_plot,
        memory_attention=c.mem_att, attention=c.att_plot, neighbour_row=c.nb_row, memory_column=c.mem_col)
    c.outputs = CompareOutputs(payload=c.payload, cards=c.cards, method=c.row_pick, token=c.tok,
                               share_link=c.share_link, layer=c.layer, token_section=c.token_section,
                               **c.token_views._asdict())


class TokenInspector:
    """The token views of a comparison for one owner, with the backbone attention maps it computed (the last 32)."""

    def __init__(self, studio):
        self.studio = studio
        self.att_cache: OrderedDict = OrderedDict()

    def attention(self, p, label, lay):
        if not p:
            return plots.empty("Backbone attention appears after a comparison")
        row = row_of(p, label)
        key = (p["id"], row["label"], int(lay))
        if key not in self.att_cache:
            try:
                self.att_cache[key] = self.studio.compare_service.attention(p, row["label"], int(lay))
            except UserError as e:
                return plots.empty(str(e)[:120])
            while len(self.att_cache) > 32:
                self.att_cache.popitem(last=False)
        return plots.input_attention_heatmap(self.att_cache[key],
                                             f"{row['label']}: backbone attention, layer {int(lay)}")

    def views(self, p, label, idx, lay, me, with_attention=True) -> TokenViewOutputs:
        """The token views of the chosen method (for owner ``me``: the kNN neighbours' samples are the owner's);
        the neighbour and memory-attention panels show only when that method reports them."""
        def nbf(lb, i):
            try:
                return self.studio.compare_service.neighbours(p["id"], lb, i, owner=me)
            except UserError:  # the comparison is gone (restart, or not this owner's): no samples
                return []

        ch, lp, bp, nr, npl, ma = token_views(p, label, idx, nbf if p else None)
        row = row_of(p, label)
        trace = row["trace"] if row else []
        return TokenViewOutputs(
            chips=ch, lambda_plot=lp, bars_plot=bp, neighbours=nr, neighbour_plot=npl, memory_attention=ma,
            attention=self.attention(p, label, lay) if with_attention else gr.skip(),
            neighbour_row=gr.update(visible=any(t.get("neighbours") for t in trace)),
            memory_column=gr.update(visible=any(t.get("memory_attention") for t in trace)))


def _start_values(studio, live_keys, me, ids, tk, global_defaults: bool) -> dict:
    """Each live control's start: the tuned value of the first chosen plug-in of its method that has a calibration
    (unless ``global_defaults``), else the task's start value."""
    base = studio.plugin_service.start_settings(tk if tk in TASKS else "translation")
    cal: dict[str, dict] = {}
    if not global_defaults:
        by_id = {p["id"]: p for p in studio.plugin_service.plugins(owner=me)}
        for i in ids or []:
            c = (by_id.get(i) or {}).get("calibration")
            if c and by_id[i]["method"] not in cal:
                cal[by_id[i]["method"]] = c["settings"]
    return {f"{m}|{n}": cal.get(m, {}).get(n, base[m][n]) for m, n in live_keys}


def _moved_to_start(live_keys, values, old: dict, new: dict) -> list:
    """Updates of the live controls to ``new`` starts: an untouched control (at its ``old`` start) follows; a control
    the user moved keeps its value."""
    out = []
    for (m, n), v in zip(live_keys, values):
        key = f"{m}|{n}"
        out.append(gr.update(value=new[key]) if key not in old or old[key] == v else gr.skip())
    return out


def _task_starts(studio, live_keys, tk) -> tuple:
    t = studio.plugin_service.start_settings(tk)
    return tuple(gr.update(value=t[m][n]) for m, n in live_keys)


def _wire_method_choice(studio, c: SimpleNamespace) -> None:
    """Choosing methods shows their live controls (at their starts) and fills the other settings' JSON."""
    @user_errors
    def on_methods(request: gr.Request, ids, text, auto, tk, gl, old, *values):
        me = owner_of(studio, request)
        by_id = {p["id"]: p["method"] for p in studio.plugin_service.plugins(owner=me)}
        ms = [by_id[i] for i in ids or [] if i in by_id]
        other = {}
        for m in dict.fromkeys(ms):
            rest = {d["name"]: d["default"] for d in c.table.get(m, {}).get("decode_settings", [])
                    if d["name"] not in c.live_names.get(m, ())}
            if rest:
                other[m] = rest
        gen = render.settings_json(other) if other else "{}"
        new_text = gen if (text or "{}").strip() in ("", "{}", (auto or "{}").strip()) else gr.skip()
        new = _start_values(studio, c.live_keys, me, ids, tk, gl)
        moved = _moved_to_start(c.live_keys, values, old or {}, new)
        shown = [gr.update(visible=m in ms, **({"value": u["value"]} if isinstance(u, dict) and "value" in u else {}))
                 for (m, _n), u in zip(c.live_keys, moved)]
        any_live = any(m in ms for m, _n in c.live_keys)
        return (*shown, gr.update(visible=not any_live), new_text, gen, new)

    c.methods.change(on_methods, [c.methods, c.extra, c.extra_auto, c.task, c.glob, c.starts, *c.live_ctls],
                     [*c.live_ctls, c.knob_hint, c.extra, c.extra_auto, c.starts], show_progress="hidden")


PROMPT_CHOICES = [("Built-in examples", "builtin")]


def prompt_choices(studio, me, task: str) -> list[tuple[str, str]]:
    """The prompts a comparison of ``task`` may read: the built-in examples and each of the owner's memories of it."""
    return PROMPT_CHOICES + [(f"{m['name']}'s own examples", m["id"]) for m in studio.memory_service.memories(owner=me)
                             if m["task"] == task and m["usable"]]


def _pin_prompt(studio):
    """After a comparison: the prompt it read (its ``prompt_source``) shown in the picker, so that the next
    comparisons read the same whatever is ticked."""
    def pin(p, tk, pf, request: gr.Request):
        src = (p or {}).get("prompt_source") or {}
        chosen = src.get("memory_id") or ("builtin" if src.get("kind") == "builtin" else None)
        if not chosen or chosen == pf:
            return gr.skip()
        return gr.update(choices=prompt_choices(studio, owner_of(studio, request), tk), value=chosen)

    return pin


def wire_prompt(studio, c: SimpleNamespace) -> None:
    """The prompt picker (``c.prompt_from``, of Compare or Evaluate) lists the task's (``c.task``) memories when
    opened; a new task starts it over (``_pin_prompt``: a comparison shows its prompt there)."""
    @user_errors
    def on_open(tk, pf, request: gr.Request):
        choices = prompt_choices(studio, owner_of(studio, request), tk)
        return gr.update(choices=choices, value=pf if pf in [v for _l, v in choices] else None)

    @user_errors
    def on_task(tk, request: gr.Request):
        return gr.update(choices=prompt_choices(studio, owner_of(studio, request), tk), value=None)

    c.prompt_from.focus(on_open, [c.task, c.prompt_from], c.prompt_from, show_progress="hidden",
                        api_visibility="private")
    c.task.change(on_task, c.task, c.prompt_from, show_progress="hidden", api_visibility="private")


def _wire_compare(studio, c: SimpleNamespace, insp: TokenInspector) -> None:
    """Compare (the button, Enter, every live control's move), Stop, and the controls' starts per task."""
    inputs = [c.source, c.task, c.methods, c.max_new, c.beams, c.extra, c.reference, c.row_pick, c.layer, c.glob,
              c.starts, c.prompt_from, *c.comp_ctls, *c.live_ctls]
    outputs = list(c.outputs)
    keys = c.comp_keys + c.live_keys

    def do_compare(request: gr.Request, src, tk, ms, mx, bm, ex, ref, label, lay, gl, st, pf, *values):
        """Compare, streamed: the cards fill token by token as the batch decodes (a generator: one update per
        step); the final update fills the token views too. A newer decode of this tab or Stop ends it."""
        try:
            me = owner_of(studio, request)
            refs = (ref.get("tgt") if isinstance(ref, dict) and ref.get("src", "").strip() == (src or "").strip()
                    else None)
            settings = decode_settings_of(keys, values, ex, st, gl)
            p = None
            for p in studio.compare_service.compare_stream(src, tk, list(ms or []), settings, int(mx), int(bm),
                                                           reference=refs, owner=me, stream=view_key(request),
                                                           global_defaults=bool(gl), prompt_from=pf or None):
                if p.get("partial"):
                    yield CompareOutputs.skip(cards=streaming_cards(p))
            if p is None or p.get("partial"):  # stopped (Stop, or a newer move): the partial cards stay
                return
            labels = [r["label"] for r in p["rows"]]
            keep = label if label in labels else row_of(p, None)["label"]
            n = max(1, len(row_of(p, keep)["trace"]))
            top = max(0, int(studio.backbone_service.status().get("layers") or 1) - 1)
            lay = min(int(lay), top)
            yield CompareOutputs(payload=p, cards=render.output_cards(p) + transfer_html(studio, src, ms, me),
                                 method=gr.update(choices=labels, value=keep),
                                 token=gr.update(maximum=max(1, n - 1), value=0), share_link="",
                                 layer=gr.update(maximum=max(1, top), value=lay),
                                 token_section=gr.update(visible=True),
                                 **insp.views(p, keep, 0, lay, me)._asdict())
        except UserError as e:
            raise gr.Error(str(e), print_exception=False) from None

    def live(request: gr.Request, p, *args):
        """A live control moved: re-decode at once — once a comparison has been run (Compare pressed). The
        service re-decodes only what the move changes (engine.LiveComparison)."""
        if not p or not args[0] or not args[0].strip() or not args[2]:
            yield CompareOutputs.skip()
            return
        yield from do_compare(request, *args)

    def stop_decode(request: gr.Request):
        """Stop (or a control moved while a decode runs): the running decode of this tab ends after its step."""
        studio.compare_service.cancel_compare(owner=owner_of(studio, request), stream=view_key(request))

    @user_errors
    def on_starts(request: gr.Request, tk, ids, gl, old, *values):
        """The task or the global-defaults switch changed: untouched live controls go to their new starts."""
        new = _start_values(studio, c.live_keys, owner_of(studio, request), ids, tk, gl)
        return (*_moved_to_start(c.live_keys, values, old or {}, new), new)

    for ctl in (c.task, c.glob):
        ctl.input(on_starts, [c.task, c.methods, c.glob, c.starts, *c.live_ctls], [*c.live_ctls, c.starts],
                  api_visibility="private", show_progress="hidden")
    for ev in (c.run.click, c.source.submit):  # then the prompt it read is shown in the picker (``wire_prompt``)
        ev(do_compare, inputs, outputs, api_visibility="private", concurrency_id="decode",
           show_progress_on=c.cards).then(_pin_prompt(studio), [c.payload, c.task, c.prompt_from], c.prompt_from,
                                          show_progress="hidden", api_visibility="private")
    c.stop.click(stop_decode, None, None, api_visibility="private", queue=False, show_progress="hidden")
    for ctl in (*c.live_ctls, *c.comp_ctls, c.max_new, c.beams, c.methods):
        # A slider decodes once it settles (let go, or a key released: SLIDER_KEYS_JS), not at every step of a
        # drag; the move first stops the decode in progress (not queued behind it), then queues its own decode.
        moved = ctl.release if isinstance(ctl, gr.Slider) else ctl.input
        moved(stop_decode, None, None, api_visibility="private", queue=False, show_progress="hidden")
        moved(live, [c.payload, *inputs], outputs, trigger_mode="always_last", show_progress="minimal",
              show_progress_on=c.cards, api_visibility="private", concurrency_id="decode")


def _wire_inspector(studio, c: SimpleNamespace, insp: TokenInspector) -> None:
    """The token views follow the chosen method, token (slider or chip) and attention layer."""
    insp_out = list(c.token_views)

    @user_errors
    def on_row(p, label, lay, request: gr.Request):
        row = row_of(p, label)
        n = max(1, len(row["trace"])) if row else 1
        return (gr.update(maximum=max(1, n - 1), value=0), *insp.views(p, label, 0, lay, owner_of(studio, request)))

    @user_errors
    def on_tok(p, lb, i, lay, request: gr.Request):
        return insp.views(p, lb, i, lay, owner_of(studio, request), with_attention=False)

    c.row_pick.input(on_row, [c.payload, c.row_pick, c.layer], [c.tok, *insp_out], show_progress="hidden")
    c.tok.input(on_tok, [c.payload, c.row_pick, c.tok, c.layer], insp_out, trigger_mode="always_last",
                show_progress="hidden")
    c.layer.input(lambda p, lb, lay: insp.attention(p, lb, lay), [c.payload, c.row_pick, c.layer], c.att_plot,
                  trigger_mode="always_last", show_progress="hidden")

    @user_errors
    def on_chip(p, lb, lay, evt: gr.SelectData, request: gr.Request):
        i = evt.index if isinstance(evt.index, int) else (evt.index[0] if evt.index else 0)
        return (gr.update(value=i), *insp.views(p, lb, i, lay, owner_of(studio, request), with_attention=False))

    c.chips.select(on_chip, [c.payload, c.row_pick, c.layer], [c.tok, *insp_out], show_progress="hidden")


def _wire_heldout(studio, c: SimpleNamespace) -> None:
    """Picking a memory lists its held-out samples; picking one fills the sentence and its reference."""
    def on_hmem(mid, request: gr.Request):
        if not mid:
            return gr.update(choices=[], value=None), ""
        me = owner_of(studio, request)
        try:
            held = studio.memory_service.heldout_samples(mid, owner=me)
        except UserError:
            held = []
        m = next((x for x in studio.memory_service.memories(owner=me) if x["id"] == mid), None)
        return (gr.update(choices=[((s["src"] or "")[:90], i) for i, s in enumerate(held)], value=None),
                render.memory_warning(m, "heldout") if m and not held else "")

    c.hmem.change(on_hmem, c.hmem, [c.hsample, c.hmem_warn], show_progress="hidden")

    @user_errors
    def on_sample(mid, i, request: gr.Request):
        if mid is None or i is None:
            return gr.skip(), gr.skip()
        held = studio.memory_service.heldout_samples(mid, owner=owner_of(studio, request))
        if not 0 <= int(i) < len(held):
            return gr.skip(), gr.skip()
        s = held[int(i)]
        return s["src"], {"src": s["src"], "tgt": s["tgt"]}

    c.hsample.input(on_sample, [c.hmem, c.hsample], [c.source, c.reference], show_progress="hidden")


def methods_update(studio, me, task: str, current) -> dict:
    """The method picker for ``task``: that task's plug-ins only (a translation plug-in answers a formality input
    in German), a ticked plug-in of another task unticked, and a line saying what is hidden (an empty line, not
    None, when nothing is: an update's None leaves the old line)."""
    choices = tuned_choices(studio, me, task)
    value = keep_value(choices, list(current or []))
    return gr.update(choices=choices, value=value or ["base"], info=hidden_plugins_note(studio, me, task))


def _wire_task_filter(studio, c: SimpleNamespace) -> None:
    """The Task choice filters the method picker (``methods_update``); a memory picked for its held-out samples
    sets the Task to the memory's."""
    @user_errors
    def on_task(tk, ms, request: gr.Request):
        return methods_update(studio, owner_of(studio, request), tk, ms)

    def memory_task(mid, request: gr.Request):
        mems = studio.memory_service.memories(owner=owner_of(studio, request)) if mid else []
        m = next((x for x in mems if x["id"] == mid), None)
        return gr.update(value=m["task"]) if m and m["task"] in TASKS else gr.skip()

    c.task.change(on_task, [c.task, c.methods], c.methods, show_progress="hidden", api_visibility="private")
    c.hmem.input(memory_task, c.hmem, c.task, show_progress="hidden", api_visibility="private")


def _wire_share(studio, c: SimpleNamespace) -> None:
    @user_errors
    def do_share(p, lay, request: gr.Request):
        if not p:
            raise UserError("Run a comparison first, then share it.")
        sid = studio.compare_service.share(p["id"], int(lay), owner=owner_of(studio, request))
        return share_url(request, sid)

    c.share_btn.click(do_share, [c.payload, c.layer], c.share_link, api_visibility="private")


def build(studio) -> SimpleNamespace:
    c = SimpleNamespace(payload=gr.State(None), reference=gr.State(None))
    _sentence_panel(c)
    _methods_panel(studio, c)
    _settings_panel(c)
    _outputs_panel(c)
    _token_panel(studio, c)
    insp = TokenInspector(studio)
    _wire_method_choice(studio, c)
    _wire_compare(studio, c, insp)
    _wire_inspector(studio, c, insp)
    _wire_heldout(studio, c)
    wire_prompt(studio, c)
    _wire_share(studio, c)
    _wire_task_filter(studio, c)

    def lists(me, current=None, mem_value=None, task=None):
        return (methods_update(studio, me, task or "translation", current),
                choices_update(memory_choices(studio, me), mem_value, default_first=False))

    @user_errors
    def refresh(current, mem_value, task, request: gr.Request):
        return lists(owner_of(studio, request), current, mem_value, task)

    def on_load(me):
        st = studio.backbone_service.status()
        top = max(0, int(st.get("layers") or 1) - 1)
        lay = gr.update(maximum=max(1, top), value=top) if st["ready"] else gr.skip()
        return (*lists(me), lay)

    def restore(me, saved: dict):
        """This browser's last task, methods and memory (``saved``; ids that are not the owner's are dropped), the
        live controls at that task's start values."""
        tk = saved.get("compare_task") if saved.get("compare_task") in TASKS else None
        ctl = _task_starts(studio, c.live_keys, tk) if tk else tuple(gr.skip() for _ in c.live_ctls)
        choices, mchoices = tuned_choices(studio, me, tk or "translation"), memory_choices(studio, me)
        ms = keep_value(choices, list(saved.get("compare_methods") or []))
        mid = saved.get("compare_memory")
        return (methods_update(studio, me, tk or "translation", ms) if ms else gr.skip(),
                gr.update(value=mid) if mid in [x[1] for x in mchoices] else gr.skip(),
                gr.update(value=tk) if tk else gr.skip(), *ctl)

    settings_inputs = [*c.comp_ctls, *c.live_ctls, c.extra, c.glob, c.starts]

    def settings_of(*vals):
        return decode_settings_of(c.comp_keys + c.live_keys, vals[:-3], vals[-3], vals[-1], vals[-2])

    def global_of(*vals) -> bool:  # the Global defaults switch among ``settings_inputs``' values
        return bool(vals[-2])

    several.wire(studio, c.several_box, c.task, c.methods, c.max_new, c.beams, c.prompt_from, settings_inputs,
                 settings_of)
    return SimpleNamespace(refresh=refresh, refresh_keys=["compare_methods", "compare_memory", "compare_task"],
                           refresh_inputs=[c.methods, c.hmem, c.task], refresh_outputs=[c.methods, c.hmem],
                           on_load=on_load, load_outputs=[c.methods, c.hmem, c.layer],
                           persist=[("compare_task", c.task), ("compare_methods", c.methods),
                                    ("compare_memory", c.hmem)],
                           restore=restore, restore_outputs=[c.methods, c.hmem, c.task, *c.live_ctls],
                           # what Evaluate decodes with by default: this tab's controls (untouched ones: each
                           # plug-in's own start, tuned on its memory unless Global defaults is ticked)
                           settings_inputs=settings_inputs, settings_of=settings_of, global_of=global_of)


def transfer_html(studio, source: str, methods, owner: str | None) -> str:
    """The transfer check of the typed sentence against the first chosen plug-in's memory, under the cards."""
    try:
        check = studio.memory_service.transfer_check([source or ""], list(methods or []), owner=owner,
                                                     input_label="this sentence")
    except UserError:
        return ""
    return render.transfer_note(check, "compare-transfer")


def view_key(request: gr.Request | None) -> str | None:
    """The browser tab a decode belongs to (a newer decode or Stop of the same tab ends the running one)."""
    return getattr(request, "session_hash", None) if request is not None else None


def streaming_cards(p: dict) -> str:
    """The output cards of a partial payload (every row's tokens so far), under a line saying what runs."""
    t = p.get("timings", {})
    state = ("Stopped" if p.get("cancelled") else "Decoding") + (f" · step {p.get('steps', 0)} of at most "
                                                                  f"{p.get('max_new_tokens', '?')}")
    note = (f"<div class='pema-timing'>{state} · {t.get('decode_s', 0):.1f}s"
            + ("" if p.get("cancelled") else " · Stop, or move a control, to end it") + "</div>")
    return note + render.output_cards(p)


def tuned_choices(studio, owner: str | None, task: str | None = None) -> list[tuple[str, str]]:
    """The method picker's choices (with ``task``, only that task's plug-ins): each plug-in calibrated on its memory
    says where it starts — "· tuned: lambda_max=0.3, gu=False (15 held-out)", or "· tuned: λ = 0, the base was
    best" when no setting beat the base."""
    cal = {p["id"]: (p["method"], p["calibration"]) for p in studio.plugin_service.plugins(owner=owner)
           if p.get("calibration")}
    out = []
    for label, pid in method_choices(studio, owner, task):
        if pid in cal:
            m, c = cal[pid]
            label += f" · {tuned_text(m, c)}"
        out.append((label, pid))
    return out


def tuned_text(method: str, cal: dict) -> str:
    """A calibration in a few words: its choice with the evidence for it ("tuned: λ_max 0.3: +2.1 chrF over the
    global start (…) on 40 samples, p 0.01 (…)"), or, for one without evidence, the tuned values and N."""
    if (cal.get("evidence") or {}).get("text"):
        return f"tuned: {cal['evidence']['text']}"
    if cal.get("is_base"):
        return f"tuned: λ = 0, the base was best ({cal['n']} held-out)"
    try:
        names = [s.name for s in get_method(method).decode_settings if s.grid]
    except Exception:  # noqa: BLE001 — a method no longer registered: every stored setting
        names = list(cal["settings"])
    vals = ", ".join(f"{k}={cal['settings'][k]}" for k in names if k in cal["settings"])
    return f"tuned: {vals} ({cal['n']} held-out)"


def decode_settings_of(live_keys: list[tuple[str, str]], live_values, extra_text: str | None,
                       starts: dict | None = None, global_defaults: bool = False) -> dict:
    """Per-method decode settings from the live controls' values and the "more settings" JSON
    (``{method | plug-in id: {name: value}}``); each live value goes to its own method only. A live control still
    at the start this page set it to (``starts``: {"method|name": value}) is not sent, so each row starts at its
    own plug-in's settings (tuned on its memory, else the global ones) — unless ``global_defaults``."""
    try:
        extra = json.loads(extra_text or "{}")
    except json.JSONDecodeError as e:
        raise UserError(f"The per-method settings are not valid JSON: {e.msg}.") from None
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise UserError('Per-method settings must be a JSON object like {"pema": {"gu_variant": "code"}}.')
    out: dict = {}
    for (m, n), v in zip(live_keys, live_values):
        if not global_defaults and starts and starts.get(f"{m}|{n}") == v:
            continue
        out.setdefault(m, {})[n] = v
    for key, block in extra.items():
        out.setdefault(key, {}).update(block)
    return out


SHARE_PATH = "/share/"  # the read-only page of shared comparisons (ui/shared.py), a Gradio app of its own


def share_url(request: gr.Request | None, sid: str) -> str:
    """The public link of a shared comparison, from the request's (forwarded) host."""
    path = f"{SHARE_PATH}?c={sid}"
    if request is None:
        return path
    h = request.headers
    host = h.get("x-forwarded-host") or h.get("host")
    if not host:
        return path
    proto = (h.get("x-forwarded-proto") or "http").split(",")[0].strip()
    return f"{proto}://{host}{path}"
