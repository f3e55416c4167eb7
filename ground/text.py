"""Text a person gave us that is later shown to people: names checked on the way in, escaped on the way out.

``check_name`` refuses what would hurt a terminal or a page when the name is printed (control characters — C0, C1,
DEL —, line and paragraph separators, bidirectional overrides that reorder what follows, lone surrogates that cannot
be written as UTF-8); ``printable`` escapes the same characters (``\\x1b``, ``\\u202e``) for names stored before the
check existed, so ``python -m memories list`` never sends a terminal escape sequence to the terminal.
"""
from __future__ import annotations

import unicodedata

from ground.errors import UserError

# bidirectional embeddings/overrides/isolates (U+202A–U+202E, U+2066–U+2069) and the line/paragraph separators
_BIDI_AND_SEPARATORS = set(range(0x202A, 0x202F)) | set(range(0x2066, 0x206A)) | {0x2028, 0x2029, 0x200E, 0x200F,
                                                                                  0x061C, 0xFEFF}


def unsafe_char(ch: str, allow_tab: bool = False) -> bool:
    """Whether ``ch`` must not appear in a name or a sample (``allow_tab``: a tab is fine)."""
    o = ord(ch)
    if ch == "\t":
        return not allow_tab
    if o < 0x20 or 0x7F <= o <= 0x9F:  # C0 controls, DEL, C1 controls (0x9B is a CSI on some terminals)
        return True
    if 0xD800 <= o <= 0xDFFF:  # a lone surrogate: not writable as UTF-8
        return True
    if o in _BIDI_AND_SEPARATORS:
        return True
    return unicodedata.category(ch) == "Cs"


def first_unsafe(text: str, allow_tab: bool = False) -> str | None:
    """The first character of ``text`` that :func:`unsafe_char` refuses, else None."""
    return next((ch for ch in text if unsafe_char(ch, allow_tab)), None)


def describe_char(ch: str) -> str:
    o = ord(ch)
    name = unicodedata.name(ch, "")
    if 0xD800 <= o <= 0xDFFF:
        name = "a lone surrogate"
    elif o < 0x20 or 0x7F <= o <= 0x9F:
        name = name or "a control character"
    return f"U+{o:04X}" + (f" ({name.lower()})" if name else "")


def check_name(name, what: str = "name", max_chars: int = 0) -> str:
    """A name, stripped, or a UserError naming what is wrong with it (type, length, an unsafe character)."""
    if name is None:
        return ""
    if not isinstance(name, str):
        raise UserError(f"The {what} must be text.")
    name = name.strip()
    if max_chars and len(name) > max_chars:
        raise UserError(f"The {what} has {len(name):,} characters; the limit is {max_chars:,}.")
    bad = first_unsafe(name)
    if bad is not None:
        raise UserError(f"The {what} contains {describe_char(bad)}, which is not allowed in a name; use plain "
                        f"text.")
    return name


def check_text(text: str, what: str = "text") -> str:
    """Free text a user sends (a sentence to compare, a reference): a UserError for a NUL character or a lone
    surrogate (not valid Unicode: tokenizers fail on it), the same checks an upload gets (``memories.parse``)."""
    if not isinstance(text, str):
        raise UserError(f"The {what} must be text.")
    if "\x00" in text:
        raise UserError(f"The {what} contains a NUL character (U+0000).")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"The {what} contains a lone surrogate (U+{ord(text[e.start]):04X}), which is not valid "
                        f"Unicode text.") from None
    return text


def printable(value) -> str:
    """``str(value)`` with every character :func:`unsafe_char` refuses written as an escape (``\\x1b``)."""
    text = value if isinstance(value, str) else str(value)
    if first_unsafe(text) is None:
        return text
    out = []
    for ch in text:
        if unsafe_char(ch):
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o <= 0xFF else f"\\u{o:04x}")
        else:
            out.append(ch)
    return "".join(out)
