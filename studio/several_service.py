"""Several sentences at once (the Compare tab): pasted lines → one batched decode of every chosen method → a table
with one column per method and, where a line gives a reference, each output's sentence-level sacreBLEU and chrF
(``eval.metrics``) and the corpus scores over the lines that have one.

A line is ``source``, ``source ||| reference`` or ``source<TAB>reference``; blank lines are skipped. Bounds: the
``compare_lines`` limit (sentences of one request) and ``input_chars`` (each source and reference), as well as the
comparison's own (methods, max new tokens, beams); methods are the owner's plug-ins only (``_rows``).
"""
from __future__ import annotations

import time

from eval.metrics import bleu_chrf, sentence_bleu, sentence_chrf
from ground.errors import UserError
from plugins.decode import decode_batch
from studio.compare_service import with_comparison
from studio.payload import json_safe

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


class SeveralService:
    """Several sentences decoded together with every chosen method (composes with ``CompareService``)."""

    def compare_several(self, text: str, task: str = "translation", methods: list[str] | None = None,
                        settings: dict | None = None, max_new_tokens: int = 48, num_beams: int = 1, *,
                        owner: str | None = None, no_repeat_ngram: int | None = None) -> dict:
        """Decode every pasted line (see ``parse_lines``) with every chosen method in one batch. ``methods`` and
        ``settings`` as ``compare``. Returns ``{"task", "backbone", "columns": [{"label", "method", "plugin_id",
        "settings"}], "lines": [{"line", "source", "reference", "outputs": [text per column], "scores": [{"sacrebleu",
        "chrf"} per column] | None}], "corpus": [{"label", "sacrebleu", "chrf", "n"}] (lines with a reference),
        "timings"}``."""
        owner = self._owner(owner)
        if self._offsite():
            raise UserError("Several sentences at once decode on this machine's backbone; with a remote backbone, "
                            "compare one sentence at a time.")
        self.limits.check_rate("compares_per_minute", owner)
        settings = with_comparison(settings, no_repeat_ngram)
        lines = parse_lines(text)
        self.limits.check("compare_lines", len(lines), "The number of sentences")
        for ln in lines:  # the same text checks as one sentence (length, NUL, surrogates, control characters)
            self.limits.check_input(ln["source"], f"line {ln['line']}'s sentence")
            if ln["reference"] is not None:
                self.limits.check_input(ln["reference"], f"line {ln['line']}'s reference")
        max_new_tokens, num_beams = self._check_decode(max_new_tokens, num_beams)
        if not isinstance(methods, (list, tuple, type(None))):
            raise UserError('Methods must be a list like ["base", "<plug-in id>"].')
        methods = list(methods or ["base"])
        t0 = time.time()
        with self._interactive("several sentences") as bb:
            rows = self._rows(methods, task, settings, owner)
            prompt = self._prompt(task, rows)
            comps = decode_batch(bb, [ln["source"] for ln in lines], rows, prompt=prompt,
                                 max_new_tokens=max_new_tokens, num_beams=num_beams, trace=False)
        decode_s = comps[0].seconds if comps else 0.0
        columns = [{"label": r.label, "method": r.method, "plugin_id": None if spec == "base" else spec,
                    "settings": json_safe(r.settings)} for spec, r in zip(methods, comps[0].rows)]
        with_ref = [i for i, ln in enumerate(lines) if ln["reference"] is not None]
        refs = [lines[i]["reference"] for i in with_ref]
        per_col = []  # per column: {line index: scores}
        corpus = []
        for c, col in enumerate(columns):
            hyps = [comps[i].rows[c].text for i in with_ref]
            per_col.append(dict(zip(with_ref, reference_scores(hyps, refs))))
            if with_ref:
                corpus.append({"label": col["label"], **bleu_chrf(hyps, refs), "n": len(with_ref)})
        out_lines = []
        for i, (ln, comp) in enumerate(zip(lines, comps)):
            out_lines.append({**ln, "outputs": [r.text for r in comp.rows],
                              "scores": [per_col[c][i] for c in range(len(columns))] if i in per_col[0] else None})
        n_tok = sum(len(r.tokens) for comp in comps for r in comp.rows)
        return {"task": task, "backbone": bb.name, "columns": columns, "lines": out_lines, "corpus": corpus,
                "max_new_tokens": max_new_tokens, "num_beams": num_beams,
                "timings": {"decode_s": round(decode_s, 3), "total_s": round(time.time() - t0, 3), "tokens": n_tok,
                            "tokens_per_s": round(n_tok / max(decode_s, 1e-9), 1), "sentences": len(lines)}}
