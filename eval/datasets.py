"""Held-out data for the three evaluation tasks: EN→DE translation, informal→formal, modern→Shakespeare.

Why this module exists: evaluation must read the developers' reference data (``../shared/data``) when it is
there, and the product must keep working when it is not. So every loader either takes an explicit ``root`` or
finds the data with :func:`shared_data_dir`, and raises :class:`UserError` with a clear message when the files are
missing (tests turn that into a skip).

The informal→formal task has no freely redistributable corpus (GYAFC needs a licence from Yahoo), so
:func:`formality_pairs` builds a synthetic one: it takes formal English sentences (the WMT English side) and
makes them informal with the seeded, documented rules of :func:`memories.informal.informalize`; the original
sentence is the reference. Users who have GYAFC can load it with :func:`load_gyafc`.
"""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from ground.errors import UserError
from memories.informal import CONTRACTIONS, RULE_PROBS, SLANG_RULES, informalize  # noqa: F401 (re-exported)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA_ENV = "PEMA_SHARED_DATA"


# --- locating the reference data ----------------------------------------------------------------------------------
def shared_data_dir() -> Path | None:
    """The developers' reference data folder: ``$PEMA_SHARED_DATA`` if set, else ``<repo>/../shared/data``.

    Returns None when neither exists: the product never needs this folder, only tests and benchmarks do.
    """
    env = os.environ.get(SHARED_DATA_ENV)
    if env and Path(env).is_dir():
        return Path(env)
    default = REPO_ROOT.parent / "shared" / "data"
    return default if default.is_dir() else None


def _data_file(root: str | Path | None, folder: str, filename: str) -> Path:
    """``<root>/<folder>/<filename>``; ``root`` may also be the task folder itself. UserError when missing."""
    if root is None:
        root = shared_data_dir()
        if root is None:
            raise UserError(f"Reference data not found: set ${SHARED_DATA_ENV} or put it at {REPO_ROOT.parent}/"
                            f"shared/data (needed only for evaluation, not by the app).")
    root = Path(root)
    for candidate in (root / folder / filename, root / filename):
        if candidate.is_file():
            return candidate
    raise UserError(f"{filename} not found under {root / folder}.")


def _window(items: list, start: int, n: int | None) -> list:
    if start < 0 or (n is not None and n < 0):
        raise UserError("start and n must not be negative.")
    return items[start:] if n is None else items[start:start + n]


# --- EN→DE ----------------------------------------------------------------------------------------------------------
def wmt_pairs(split: str, start: int = 0, n: int | None = None,
              root: str | Path | None = None) -> list[tuple[str, str]]:
    """``(en, de)`` pairs from ``wmt22-en-de/<split>.jsonl``, lines ``start`` to ``start + n``."""
    path = _data_file(root, "wmt22-en-de", f"{split}.jsonl")
    pairs = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                pairs.append((d["en"].strip(), d["de"].strip()))
    return _window(pairs, start, n)


# --- Shakespeare ----------------------------------------------------------------------------------------------------
def shakespeare_lines(split: str, start: int = 0, n: int | None = None,
                      root: str | Path | None = None) -> list[str]:
    """Shakespeare-style sentences from ``shakespeare/<split>.txt`` (one a line; blank lines dropped)."""
    path = _data_file(root, "shakespeare", f"{split}.txt")
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    return _window([ln for ln in lines if ln], start, n)


# --- informal → formal: WMT's English side made informal by memories.informal's rules ---------------------------
def formality_pairs(split: str, start: int = 0, n: int | None = None, seed: int = 123,
                    root: str | Path | None = None, max_words: int = 40) -> list[tuple[str, str]]:
    """``(informal, formal)`` pairs built from the WMT English side; the formal reference is the original.

    Sentences longer than ``max_words`` words are skipped (GYAFC sentences are short); ``start``/``n`` index
    the kept sentences, so consecutive windows never overlap. Each sentence gets its own
    ``random.Random(seed * 1_000_003 + line index)``, so a pair does not depend on the window it is read in.
    """
    kept = [(i, en) for i, (en, _de) in enumerate(wmt_pairs(split, root=root))
            if en and len(en.split()) <= max_words]
    return [(informalize(en, random.Random(seed * 1_000_003 + i)), en) for i, en in _window(kept, start, n)]


# --- counting informal patterns ---------------------------------------------------------------------------------
# The categories of informal expressions the PEMA paper counts in its formality analysis (Table 6).
PATTERN_NAMES = ["contractions_slang", "lowercase_start", "missing_final_punct", "repeated_letters",
                 "fillers_abbrev", "exclaim_emoticon"]

_TOKEN_RE = re.compile(r"[A-Za-z0-9]+(?:['’][A-Za-z]+)*|['’][A-Za-z]+")
_APOS_CONTRACTION_RE = re.compile(
    r"^(?:[a-z]+n['’]t|[a-z]+['’](?:re|ve|ll|d|m)|(?:it|he|she|that|there|what|where|who|here|how|let|when|why|"
    r"everyone|somebody|someone|something)['’]s|y['’]all|['’](?:em|cause|coz|tis|twas)|[a-z]+in['’])$",
    re.IGNORECASE)
SLANG_WORDS = {"gonna", "wanna", "gotta", "kinda", "sorta", "dunno", "lemme", "gimme", "cuz", "coz", "cos", "ya",
               "yeah", "yep", "yup", "nope", "ok", "okay", "kk", "thx", "pls", "plz", "ppl", "prolly", "rly", "tho",
               "tmrw", "b4", "gr8", "abt", "msg", "cya", "rn", "ur", "luv", "sux", "finna", "ima", "imma", "nah"}
SLANG_LOWER_ONLY = {"u", "r", "k"}  # single letters: only lower case, so "U.S." or "R&D" are not counted
FILLER_WORDS = {"lol", "lmao", "lmfao", "rofl", "tbh", "idk", "imo", "imho", "omg", "btw", "fyi", "smh", "ikr", "jk",
                "brb", "ttyl", "ugh", "um", "umm", "uh", "uhh", "hmm", "meh", "haha", "hahaha", "hehe", "xoxo"}
_LAUGH_RE = re.compile(r"^(?:h[ae]){2,}h?$|^lo+l$", re.IGNORECASE)
_LIKE_FILLER_RE = re.compile(r"\blike,", re.IGNORECASE)
_REPEAT_RE = re.compile(r"([A-Za-z])\1{2,}", re.IGNORECASE)
_EXCLAIM_RE = re.compile(r"!{2,}")
_EMOTICON_RE = re.compile(r"(?<![\w:;=])(?:[:;=][-'^]?[)(\]\[DPpOo/\\|3*]|[xX]D|<3)(?![\w])")
_TRAILING_CLOSERS = "\"'”’)»]"


def _patterns_in(text: str) -> dict[str, int]:
    tokens = _TOKEN_RE.findall(text)
    counts = dict.fromkeys(PATTERN_NAMES, 0)
    for tok in tokens:
        low = tok.lower()
        if (_APOS_CONTRACTION_RE.match(tok) or low in SLANG_WORDS or tok in SLANG_LOWER_ONLY):
            counts["contractions_slang"] += 1
        if low in FILLER_WORDS or _LAUGH_RE.match(tok):
            counts["fillers_abbrev"] += 1
        if _REPEAT_RE.search(tok):
            counts["repeated_letters"] += 1
    counts["fillers_abbrev"] += len(_LIKE_FILLER_RE.findall(text))
    first_letter = next((c for c in text if c.isalpha()), "")
    counts["lowercase_start"] = int(first_letter.islower())
    end = text.rstrip().rstrip(_TRAILING_CLOSERS).rstrip()
    counts["missing_final_punct"] = int(bool(end) and end[-1] not in ".!?…")
    counts["exclaim_emoticon"] = len(_EXCLAIM_RE.findall(text)) + len(_EMOTICON_RE.findall(text))
    return counts


def informal_pattern_counts(texts: list[str]) -> dict:
    """Count informal patterns, to show how informal a system's outputs still are (lower is more formal).

    Categories (:data:`PATTERN_NAMES`), per text:

    * ``contractions_slang``: tokens that are contractions ("don't", "it's"; possessive "'s" only after
      pronouns such as it/that/there) or slang spellings (:data:`SLANG_WORDS`, lower-case "u"/"r"/"k");
    * ``lowercase_start``: 1 when the first letter of the text is lower case;
    * ``missing_final_punct``: 1 when the text does not end with . ! ? or … (closing quotes/brackets ignored);
    * ``repeated_letters``: tokens with a letter three or more times in a row ("sooo");
    * ``fillers_abbrev``: filler words and chat abbreviations (:data:`FILLER_WORDS`, "hahaha", "lool") plus
      "like," used as a filler;
    * ``exclaim_emoticon``: runs of two or more "!" plus emoticons (":)", ";-P", "xD", "<3").

    Returns ``{"n_texts": N, "totals": {category: count, "all": sum}, "per_text": {category: total / N, ...}}``.
    """
    texts = list(texts)
    totals = dict.fromkeys(PATTERN_NAMES, 0)
    for text in texts:
        for k, v in _patterns_in(text).items():
            totals[k] += v
    totals["all"] = sum(totals[k] for k in PATTERN_NAMES)
    n = len(texts)
    per_text = {k: (v / n if n else 0.0) for k, v in totals.items()}
    return {"n_texts": n, "totals": totals, "per_text": per_text}


# --- GYAFC --------------------------------------------------------------------------------------------------------
GYAFC_DOMAINS = {"em": "Entertainment_Music", "fr": "Family_Relationships"}
GYAFC_SPLITS = {"dev": "tune", "valid": "tune", "validation": "tune"}


def load_gyafc(root: str | Path, split: str = "test", domain: str = "Family_Relationships") -> list[tuple[str, str]]:
    """``(informal, formal)`` pairs from a GYAFC copy in its standard layout.

    Layout: ``<root>/<domain>/<split>/informal`` and ``formal`` (train) or ``formal.ref0`` (tune/test; the first
    of the four references), one sentence a line. ``root`` may be the ``GYAFC_Corpus`` folder or its parent;
    ``domain`` may be "em"/"fr" for short and ``split`` "dev" for "tune".
    """
    domain = GYAFC_DOMAINS.get(domain.lower(), domain)
    split = GYAFC_SPLITS.get(split.lower(), split)
    root = Path(root)
    base = next((d for d in (root / domain, root / "GYAFC_Corpus" / domain) if d.is_dir()), None)
    if base is None:
        raise UserError(f"GYAFC domain folder {domain!r} not found under {root} (expected {root / domain}).")
    folder = base / split
    informal = folder / "informal"
    formal = next((f for f in (folder / "formal", folder / "formal.ref0") if f.is_file()), None)
    if not informal.is_file() or formal is None:
        raise UserError(f"GYAFC files missing in {folder}: expected 'informal' and 'formal' (or 'formal.ref0').")
    src = informal.read_text(encoding="utf-8", errors="replace").splitlines()
    ref = formal.read_text(encoding="utf-8", errors="replace").splitlines()
    if len(src) != len(ref):
        raise UserError(f"GYAFC files in {folder} do not line up: {len(src)} informal vs {len(ref)} formal lines.")
    return [(s.strip(), r.strip()) for s, r in zip(src, ref) if s.strip()]


def task_pairs(task: str, split: str, start: int, n: int) -> list[tuple]:
    """(source, reference) pairs of a task's reference data (style: monolingual targets for train, sources for dev)."""
    if task == "translation":
        return wmt_pairs(split, start, n)
    if task == "formality":
        return formality_pairs(split, start, n)
    if task == "style":
        if split == "train":  # monolingual targets: the memory makes their plain sources
            return [(None, line) for line in shakespeare_lines("train", start, n)]
        return [(en, None) for en, _de in wmt_pairs(split, start, n)]
    raise UserError(f"Unknown task {task!r}; choose translation, formality or style.")
