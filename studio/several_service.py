"""Several sentences at once (the Compare tab, ``CompareService.compare_several``): pasted lines → one batched
decode of every chosen method → a table with one column per method and, where a line gives a reference, each
output's sentence-level sacreBLEU and chrF (``eval.metrics``) and the corpus scores over the lines that have one.

A line is ``source``, ``source ||| reference`` or ``source<TAB>reference``; blank lines are skipped. Bounds: the
``compare_lines`` limit (sentences of one request) and ``input_chars`` (each source and reference), as well as the
comparison's own (methods, max new tokens, beams); methods are the owner's plug-ins only (``CompareService.rows``).
"""
from __future__ import annotations

from eval.metrics import sentence_bleu, sentence_chrf
from ground.errors import UserError

REFERENCE_SEPARATORS = ("|||", "\t")


def parse_lines(text: str) -> list[dict]:
    """``[{"line", "source", "reference"}]`` from pasted text (``reference`` None when the line has none); a line
    with a separator but nothing before it is an error naming the line."""
    if not isinstance(text, str):
        raise UserError("Paste the sentences as text, one a line.")
    out = []
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        src, ref = raw, None
        for sep in REFERENCE_SEPARATORS:
            if sep in raw:
                src, ref = raw.split(sep, 1)
                break
        src, ref = src.strip(), (ref.strip() or None) if ref is not None else None
        if not src:
            raise UserError(f"Line {n}: there is no sentence before the reference.")
        out.append({"line": n, "source": src, "reference": ref})
    if not out:
        raise UserError("Paste one sentence a line (optionally “sentence ||| reference” or sentence<TAB>reference).")
    return out


def reference_scores(hyps: list[str], refs: list[str]) -> list[dict]:
    """Per output: sentence-level sacreBLEU and chrF against its reference."""
    if not hyps:
        return []
    return [{"sacrebleu": b, "chrf": c} for b, c in zip(sentence_bleu(hyps, refs), sentence_chrf(hyps, refs))]
