"""Making formal English informal, with seeded, documented rules: the informal→formal task's synthetic data.

The task has no freely redistributable corpus (GYAFC needs a licence from Yahoo), so the studio makes its own pairs:
formal sentences become informal by :func:`informalize` (contractions, slang such as "going to" → "gonna" and
"you" → "u", dropped commas and final punctuation, stretched words, fillers, lower case); the original is the
formal reference. Used by the ``formality-en`` demo corpus (``memories.corpora``) and by the evaluation's
formality pairs (``eval.datasets.formality_pairs``), so both are made by the same rules.
"""
from __future__ import annotations

import random
import re

# Probability of each rule. Per-match rules (contractions, slang) draw once per occurrence; the others once per
# sentence. Tuned by eye so that most sentences get 2-4 informal traits, like GYAFC's informal side.
RULE_PROBS: dict[str, float] = {
    "contraction": 0.8,     # "do not" -> "don't" (per occurrence)
    "slang": 0.35,          # "going to" -> "gonna", "you" -> "u", ... (per occurrence)
    "drop_commas": 0.4,     # remove every comma
    "stretch": 0.3,         # "so" -> "sooo" (one intensifier, when the sentence has one)
    "drop_final": 0.45,     # remove the sentence-final . ! ?
    "emphatic": 0.15,       # else: end with "!!" or an emoticon
    "filler_start": 0.2,    # "like, ...", "honestly ...", "omg ..."
    "filler_end": 0.25,     # "... lol", "... haha", "... tbh"
    "lower_all": 0.45,      # lower-case the whole sentence
    "lower_first": 0.35,    # else: lower-case its first letter only
}

# Contractions we never produce: archaic, dialectal, ambiguous or double ones ("couldn't've" has two apostrophes
# and is excluded by the rule below).
_CONTRACTION_EXCLUDE = {"ain't", "amn't", "daresn't", "dasn't", "gon't", "he've", "so've", "so's", "this's",
                        "which's", "e'er", "ne'er", "o'er", "o'clock", "ma'am", "sha'n't", "shalln't", "to've",
                        "when've", "will've", "mayn't", "I'm'a", "I'm'o", "'tis", "'twas", "'cause", "'em", "ol'",
                        "o'"}

# "going to" / "want to" / "got to" only before a verb-like word: "going to the store" must stay as it is.
_NOT_BEFORE_VERB = (r"(?=\s+(?!(?:the|a|an|my|your|his|her|its|our|their|this|that|these|those|be|me|him|us|them)\b)"
                    r"[a-z])")

# (pattern, replacement): informal spellings a formal sentence can take. Patterns are case-insensitive.
SLANG_RULES: list[tuple[str, str]] = [
    (r"\bgoing to\b" + _NOT_BEFORE_VERB, "gonna"),
    (r"\bwant to\b" + _NOT_BEFORE_VERB, "wanna"),
    (r"\bgot to\b" + _NOT_BEFORE_VERB, "gotta"),
    (r"\bkind of\b", "kinda"),
    (r"\bto be honest\b", "tbh"),
    (r"\bby the way\b", "btw"),
    (r"\bright now\b", "rn"),
    (r"\bbecause\b", "cuz"),
    (r"\byour\b", "ur"),
    (r"\byou\b", "u"),
    (r"\bare\b", "r"),
    (r"\bokay\b", "ok"),
    (r"\bplease\b", "pls"),
    (r"\bthanks\b", "thx"),
    (r"\bpeople\b", "ppl"),
    (r"\bprobably\b", "prolly"),
    (r"\breally\b", "rly"),
    (r"\bthough\b", "tho"),
    (r"\btomorrow\b", "tmrw"),
    (r"\bbefore\b", "b4"),
    (r"\babout\b", "abt"),
    (r"\bgreat\b", "gr8"),
    (r"\byes\b", "yeah"),
]

# Words that people stretch ("sooo", "reallyyy") and fillers added at the start or the end of a sentence.
STRETCHABLE = {"so", "very", "really", "too", "much", "good", "great", "nice", "cool", "long", "love", "lot", "now",
               "no", "yes", "please", "all", "well", "big", "bad", "way", "hard", "huge", "many", "more", "sure"}
START_FILLERS = ["like,", "so", "well", "honestly", "omg", "lol", "um"]
END_FILLERS = ["lol", "haha", "tbh", "lmao", "idk", "imo"]
EMPHATIC_ENDINGS = ["!!", "!!!", " :)", " :D", " xD", " :P"]


def _load_contraction_map() -> dict[str, str]:
    """``{expansion (lower case): contraction}`` from the ``contractions`` package's expansion table, inverted.

    Only single-apostrophe, standard contractions are kept (see ``_CONTRACTION_EXCLUDE``); when several map to
    the same expansion the alphabetically first wins. Falls back to a small built-in table without the package.
    """
    try:
        import contractions

        table = dict(contractions.contractions_dict)
    except ImportError:
        table = {"don't": "do not", "doesn't": "does not", "didn't": "did not", "can't": "cannot",
                 "isn't": "is not", "aren't": "are not", "won't": "will not", "it's": "it is", "I'm": "I am",
                 "that's": "that is", "they're": "they are", "we're": "we are", "you're": "you are"}
    inverted: dict[str, str] = {}
    for short, long in sorted(table.items()):
        if short.count("'") != 1 or short.startswith("'") or short.endswith("'") or short in _CONTRACTION_EXCLUDE:
            continue
        if " " not in long and long != "cannot":
            continue  # abbreviations such as "jan." -> "january"
        inverted.setdefault(long.lower(), short)
    return inverted


CONTRACTIONS: dict[str, str] = _load_contraction_map()
_CONTRACTION_RE = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(CONTRACTIONS, key=len, reverse=True))
                             + r")\b", re.IGNORECASE)
# "(?!['’])": never touch a word that is part of a contraction ("you're" must not become "u're").
_SLANG_RES = [(re.compile(p + r"(?!['’])", re.IGNORECASE), r) for p, r in SLANG_RULES]


def _match_case(original: str, replacement: str) -> str:
    """Keep a capital first letter ("It is" -> "It's"); "I'm"-style replacements keep their own capital."""
    if original[:1].isupper() and replacement[:1].islower():
        return replacement[:1].upper() + replacement[1:]
    return replacement


def informalize(sentence: str, rng: random.Random, probs: dict[str, float] | None = None) -> str:
    """Make a formal English sentence informal with seeded random rules (same rng state -> same output).

    Rules, in order, each fired with probability ``probs[rule]`` (defaults: :data:`RULE_PROBS`):

    1. contraction: expansions become contractions ("do not" -> "don't", "it is" -> "it's"), per occurrence,
       from the ``contractions`` package's table inverted;
    2. slang: :data:`SLANG_RULES` per occurrence ("going to" -> "gonna", "you" -> "u", "because" -> "cuz");
    3. drop_commas: every comma removed;
    4. stretch: one stretchable word repeats its last letter ("so" -> "sooo");
    5. drop_final: the final . ! ? removed; else emphatic: it becomes "!!" or an emoticon is appended;
    6. filler_start / filler_end: "like," / "honestly" ... at the start, "lol" / "haha" / "tbh" ... at the end;
    7. lower_all: everything lower-cased; else lower_first: the first letter lower-cased.

    If no rule fired, the final punctuation is dropped (or the first letter lower-cased, or " lol" appended) so
    that the output always differs from the input.
    """
    p = {**RULE_PROBS, **(probs or {})}
    text = " ".join(sentence.split())

    def fire(rule: str) -> bool:
        return rng.random() < p[rule]

    def contract(m: re.Match) -> str:
        return _match_case(m.group(0), CONTRACTIONS[m.group(0).lower()]) if fire("contraction") else m.group(0)

    text = _CONTRACTION_RE.sub(contract, text)
    for pattern, repl in _SLANG_RES:
        text = pattern.sub(lambda m, r=repl: r if fire("slang") else m.group(0), text)  # slang stays lower case
    if "," in text and fire("drop_commas"):
        text = re.sub(r"\s*,", "", text)
    if fire("stretch"):
        words = text.split(" ")
        spots = [i for i, w in enumerate(words) if w.strip(".,;:!?\"'()[]").lower() in STRETCHABLE]
        if spots:
            i = rng.choice(spots)
            words[i] = re.sub(r"([A-Za-z])(\W*)$", lambda m: m.group(1) * rng.randint(3, 4) + m.group(2), words[i])
            text = " ".join(words)
    if re.search(r"[.!?]$", text) and fire("drop_final"):
        text = re.sub(r"\s*[.!?]+$", "", text)
    elif fire("emphatic"):
        ending = rng.choice(EMPHATIC_ENDINGS)
        text = re.sub(r"\s*[.!?]+$", "", text) + ending if ending.startswith("!") else text + ending
    if fire("filler_start"):
        first = text.split(" ", 1)[0]
        if first[:1].isupper() and not first.isupper() and not re.match(r"I\b", first):
            text = text[:1].lower() + text[1:]
        text = rng.choice(START_FILLERS) + " " + text
    if fire("filler_end"):
        text = text + " " + rng.choice(END_FILLERS)
    if fire("lower_all"):
        text = text.lower()
    elif text[:1].isupper() and fire("lower_first"):
        text = text[:1].lower() + text[1:]

    if text == " ".join(sentence.split()):
        if re.search(r"[.!?]$", text):
            text = re.sub(r"\s*[.!?]+$", "", text)
        elif text[:1].isupper():
            text = text[:1].lower() + text[1:]
        else:
            text = text + " lol"
    return text
