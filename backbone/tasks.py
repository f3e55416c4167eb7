"""The three tasks: their prompts (with built-in few-shot examples, so the product needs no data files), their
metrics, and the prompt tuned on dev data per backbone (``backbone/tuned_prompts.json``: how many examples, which
template; written by ``python -m eval.quality --tune-prompt --save-defaults``). The methods' tuned decode settings
live with the methods (``plugins/tuned_defaults.json``).
"""
from __future__ import annotations

import json
from pathlib import Path

from backbone.prompts import Prompt
from ground.errors import UserError
from ground.store import write_json_atomic

# Few-shot examples written for this project (not taken from any evaluation set).
FEW_SHOT = {
    "translation": [
        # News-length examples first (the default uses 3): with the short ones only, Gemma 3 270M base scored far
        # lower on WMT dev (docs/benchmarks-history.md, the translation prompt's examples).
        ("The minister said on Tuesday that the government would present a new plan to reduce energy prices next "
         "month.",
         "Der Minister sagte am Dienstag, die Regierung werde im nächsten Monat einen neuen Plan zur Senkung der "
         "Energiepreise vorlegen."),
        ("According to the police, two people were injured in the accident, which happened shortly after midnight.",
         "Nach Angaben der Polizei wurden bei dem Unfall, der sich kurz nach Mitternacht ereignete, zwei Menschen "
         "verletzt."),
        ("The company, which employs more than 5,000 people, reported a sharp rise in profits for the last quarter.",
         "Das Unternehmen, das mehr als 5.000 Menschen beschäftigt, meldete für das letzte Quartal einen starken "
         "Gewinnanstieg."),
        ("The weather is nice today.", "Das Wetter ist heute schön."),
        ("I would like to book a room for two nights.", "Ich möchte ein Zimmer für zwei Nächte buchen."),
        ("The government announced new measures on Tuesday.",
         "Die Regierung hat am Dienstag neue Maßnahmen angekündigt."),
        ("Prices have risen sharply over the past year.", "Die Preise sind im vergangenen Jahr stark gestiegen."),
        ("Open the file and save your changes.", "Öffnen Sie die Datei und speichern Sie Ihre Änderungen."),
    ],
    "formality": [
        # News-length sentences first (the default uses 3 examples): with only short chat lines as examples the
        # 270M base model answered long inputs with an example's output ("I am sorry, but I will be late.").
        ("um the city council said it'll vote on the new budget next week lol",
         "The city council said it will vote on the new budget next week."),
        ("officials haven't confirmed how many ppl were hurt in the fire tho they r expected to speak tmrw",
         ("Officials have not confirmed how many people were hurt in the fire, though they are expected to speak "
         "tomorrow.")),
        ("like, the company's profits rose sooo much in the last quarter, analysts say",
         "The company's profits rose so much in the last quarter, analysts say."),
        ("gonna be late lol sorry", "I am sorry, but I will be late."),
        ("thx for the help, it was sooo useful", "Thank you for your help; it was so useful."),
    ],
    "style": [
        # Long sentences first, for the same reason as the formality examples.
        ("The king has told his soldiers that they will march to the city tomorrow morning.",
         "The king hath told his soldiers that they shall march unto the city on the morrow."),
        ("I do not believe that you have told me the whole truth about what happened last night.",
         "I do not believe thou hast told me the whole truth of what befell last night."),
        ("Why are you so sad today?", "Wherefore art thou so sad today?"),
        ("Are you going to the market?", "Art thou going to the market?"),
        ("Please give me your hand.", "I prithee, give me thy hand."),
    ],
}

# Example sentences offered in the Compare tab (click one to fill the sentence box; "several sentences" takes them
# all, with their references): short, written for this project, not from any evaluation set nor the few-shot
# examples above.
EXAMPLES = {
    "translation": [
        ("The train to Berlin leaves at nine o'clock.", "Der Zug nach Berlin fährt um neun Uhr ab."),
        ("Our team finished the new report yesterday.", "Unser Team hat den neuen Bericht gestern fertiggestellt."),
        ("Please close the window when you leave the room.",
         "Bitte schließen Sie das Fenster, wenn Sie den Raum verlassen."),
        ("The museum is free for children under twelve.", "Das Museum ist für Kinder unter zwölf Jahren kostenlos."),
    ],
    "formality": [
        ("hey can u send me the file asap thx", "Could you please send me the file as soon as possible? Thank you."),
        ("gonna miss the meeting today, sorry guys", "I am sorry, but I will miss the meeting today."),
        ("the new phone is kinda expensive tbh", "To be honest, the new phone is rather expensive."),
        ("lemme know if the package shows up", "Please let me know if the package arrives."),
    ],
    "style": [
        ("Where are you going so late tonight?", "Whither goest thou so late this night?"),
        ("I have never seen a sadder face than yours.", "I never saw a sadder face than thine."),
        ("You must not trust a man who smiles too much.", "Thou must not trust a man who smileth overmuch."),
        ("Tell me the truth, my friend.", "Tell me the truth, my friend, I prithee."),
    ],
}


def example_sentences(task: str) -> list[tuple[str, str]]:
    """The task's example (sentence, reference) pairs (none for an unknown task)."""
    return list(EXAMPLES.get(task, []))


METRICS = {"translation": ["sacrebleu", "chrf"], "formality": ["sacrebleu", "chrf", "informal_patterns"],
           "style": ["style_score", "content_similarity", "perplexity"]}

TUNED_PROMPTS_PATH = Path(__file__).with_name("tuned_prompts.json")  # {task: {backbone: {shots, paper_prompt}}}
PROMPT_FALLBACK = {"shots": 3, "paper_prompt": False}


def tuned_prompt(task: str, backbone_name: str | None = None) -> dict:
    """The prompt tuned for a task on this backbone (``shots``, ``paper_prompt``), else 3 shots in the line
    format."""
    data = json.loads(TUNED_PROMPTS_PATH.read_text(encoding="utf-8")) if TUNED_PROMPTS_PATH.exists() else {}
    return {**PROMPT_FALLBACK, **data.get(task, {}).get(backbone_name or "", {})}


def save_tuned_prompt(task: str, backbone_name: str, prompt: dict) -> None:
    """Make ``prompt`` (``shots``, ``paper_prompt``) the task's prompt on this backbone (keeps the other entries)."""
    data = json.loads(TUNED_PROMPTS_PATH.read_text(encoding="utf-8")) if TUNED_PROMPTS_PATH.exists() else {}
    data.setdefault(task, {}).setdefault(backbone_name, {}).update(prompt)
    write_json_atomic(TUNED_PROMPTS_PATH, data)


def task_prompt(task: str, backbone, shots: int | None = None, paper: bool | None = None) -> Prompt:
    """The prompt for a task: the line format, or the paper's Table 9 instruction with ``paper=True``, with
    ``shots`` built-in examples; chat-wrapped on instruct backbones. What is not given comes from the task's tuned
    defaults for this backbone (``python -m eval.quality --tune-prompt --save-defaults``), else 3 shots, line format."""
    if task not in FEW_SHOT:
        raise UserError(f"Unknown task {task!r}; choose translation, formality or style.")
    tuned = tuned_prompt(task, getattr(backbone, "name", None))
    shots = int(tuned["shots"]) if shots is None else shots
    paper = bool(tuned["paper_prompt"]) if paper is None else paper
    return Prompt.for_task(task, examples=FEW_SHOT[task][:shots], paper=paper, chat=getattr(backbone, "chat", False))
