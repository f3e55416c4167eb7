"""The three tasks: their prompts (with built-in few-shot examples, so the product needs no data files), their
metrics, and the decode-time defaults tuned on dev data (``eval/tuned_defaults.json``, written by
``python -m eval tune``; the app and the CLI start from them).
"""
from __future__ import annotations

import json
from pathlib import Path

from backbone.prompts import Prompt
from studio.errors import UserError

# Few-shot examples written for this project (not taken from any evaluation set).
FEW_SHOT = {
    "translation": [
        ("The weather is nice today.", "Das Wetter ist heute schön."),
        ("I would like to book a room for two nights.", "Ich möchte ein Zimmer für zwei Nächte buchen."),
        ("The government announced new measures on Tuesday.",
         "Die Regierung hat am Dienstag neue Maßnahmen angekündigt."),
        ("Prices have risen sharply over the past year.", "Die Preise sind im vergangenen Jahr stark gestiegen."),
        ("Open the file and save your changes.", "Öffnen Sie die Datei und speichern Sie Ihre Änderungen."),
    ],
    "formality": [
        ("gonna be late lol sorry", "I am sorry, but I will be late."),
        ("u coming to the meeting tmrw?", "Are you coming to the meeting tomorrow?"),
        ("thx for the help, it was sooo useful", "Thank you for your help; it was very useful."),
        ("idk what they want tbh", "To be honest, I do not know what they want."),
        ("the prices r going up again", "The prices are going up again."),
    ],
    "style": [
        ("Are you going to the market?", "Art thou going to the market?"),
        ("I don't know what you mean.", "I know not what thou mean'st."),
        ("Please give me your hand.", "I prithee, give me thy hand."),
        ("Why are you so sad today?", "Wherefore art thou so sad today?"),
        ("He has gone away and will not come back.", "He is gone hence and shall not return."),
    ],
}

METRICS = {"translation": ["sacrebleu", "chrf"], "formality": ["sacrebleu", "chrf", "informal_patterns"],
           "style": ["style_score", "content_similarity", "perplexity"]}

TUNED_PATH = Path(__file__).with_name("tuned_defaults.json")
FALLBACK = {"shots": 3, "decode": {"pema": {"lambda_max": 0.8, "gu": True}, "knn": {"k": 16, "temperature": 10.0,
                                                                                  "lambda": 0.3}}}


def tuned_defaults(task: str, backbone_name: str | None = None) -> dict:
    """The tuned settings of a task (per backbone when tuned for it), else sensible fallbacks."""
    data = json.loads(TUNED_PATH.read_text(encoding="utf-8")) if TUNED_PATH.exists() else {}
    t = data.get(task, {})
    if backbone_name and backbone_name in t.get("backbones", {}):
        t = {**t, **t["backbones"][backbone_name]}
    out = {**FALLBACK, **{k: v for k, v in t.items() if k != "backbones"}}
    out["decode"] = {**FALLBACK["decode"], **t.get("decode", {})}
    return out


def task_prompt(task: str, backbone, shots: int | None = None, paper: bool = False) -> Prompt:
    """The prompt for a task: the line format with ``shots`` built-in examples (tuned default), or the paper's
    Table 9 instruction with ``paper=True``; chat-wrapped on instruct backbones."""
    if task not in FEW_SHOT:
        raise UserError(f"Unknown task {task!r}; choose translation, formality or style.")
    if shots is None:
        shots = int(tuned_defaults(task, getattr(backbone, "name", None)).get("shots", 3))
    return Prompt.for_task(task, examples=FEW_SHOT[task][:shots], paper=paper, chat=getattr(backbone, "chat", False))
