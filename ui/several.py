"""Compare tab pieces: clickable example sentences per task, and several sentences at once (pasted lines → one
batched decode → a table with one column per method; sentence-level sacreBLEU/chrF where a line gives a reference:
``CompareService.compare_several``).

``examples_row(source, task, reference)`` places the example buttons where it is called (a click fills the sentence
box, and the example's reference, so the cards score the outputs against it); ``panel()`` places the
several-sentences accordion; ``wire(...)`` connects it once the tab's method and decode controls exist."""
from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from backbone.tasks import example_sentences
from ui import render
from ui.common import owner_of, user_errors

EXAMPLE_BUTTONS = 4
SEVERAL_PLACEHOLDER = ("One sentence a line. Add a reference to score the outputs:\n"
                       "The train leaves at nine. ||| Der Zug fährt um neun Uhr ab.\n"
                       "or a tab between sentence and reference.")


def examples_row(source, task, reference, start_task: str = "translation") -> list:
    """Buttons with the task's example sentences; they follow the Task choice."""
    first = example_sentences(start_task)
    with gr.Row(equal_height=True, elem_id="compare-examples"):
        gr.HTML("<span class='pema-help'>Try an example:</span>", min_width=100, padding=False)
        buttons = [gr.Button(first[i][0] if i < len(first) else "", visible=i < len(first), size="sm",
                             variant="secondary", min_width=200, elem_classes=["pema-example"])
                   for i in range(EXAMPLE_BUTTONS)]

    def on_task(tk):
        ex = example_sentences(tk)
        return [gr.update(value=ex[i][0] if i < len(ex) else "", visible=i < len(ex)) for i in range(EXAMPLE_BUTTONS)]

    def pick(text, tk):
        ref = dict(example_sentences(tk)).get(text)
        return text, ({"src": text, "tgt": ref} if ref else None)

    task.change(on_task, task, buttons, show_progress="hidden", api_visibility="private", queue=False)
    for b in buttons:
        b.click(pick, [b, task], [source, reference], show_progress="hidden", api_visibility="private", queue=False)
    return buttons


def panel() -> SimpleNamespace:
    with gr.Accordion("…or several sentences at once", open=False, elem_id="several-panel"):
        text = gr.Textbox(label="Sentences, one a line (optionally “sentence ||| reference”)", lines=5,
                          max_lines=16, placeholder=SEVERAL_PLACEHOLDER, elem_id="several-input")
        with gr.Row():
            run = gr.Button("Compare all", variant="primary", scale=2, elem_id="several-run")
            fill = gr.Button("Fill in the task's examples (with references)", scale=2, elem_id="several-fill")
        out = gr.HTML(render.several_table(None), elem_id="several-table")
    return SimpleNamespace(text=text, run=run, fill=fill, out=out)


def wire(studio, p: SimpleNamespace, task, methods, max_new, beams, prompt_from, settings_inputs: list,
         settings_of) -> None:
    """Compare all: the chosen methods with the tab's decode settings (``settings_of(*settings_inputs)``) and its
    prompt choice (``prompt_from``, the picker Compare reads: every row without its own prompt reads the same)."""

    @user_errors
    def do_several(request: gr.Request, text, tk, ms, mx, bm, pf, *values):
        res = studio.compare_service.compare_several(text, tk, list(ms or []), settings_of(*values), int(mx), int(bm),
                                                     owner=owner_of(studio, request), prompt_from=pf or None)
        return render.several_table(res)

    p.run.click(do_several, [p.text, task, methods, max_new, beams, prompt_from, *settings_inputs], p.out,
                api_visibility="private", concurrency_id="decode", show_progress_on=p.out)
    p.fill.click(lambda tk: "\n".join(f"{s} ||| {r}" for s, r in example_sentences(tk)), task, p.text,
                 show_progress="hidden", api_visibility="private", queue=False)
