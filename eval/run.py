"""Run methods on held-out pairs and score them: one batched decode per chunk of sentences, all methods as rows.

``evaluate`` is what ``python -m eval``, the app's Evaluate tab and the benchmarks call.
"""
from __future__ import annotations

import time
from typing import Callable

from backbone.prompts import Prompt
from engine import Row, decode_batch
from eval.datasets import informal_pattern_counts
from eval.metrics import bleu_chrf, bootstrap_ci, content_similarity, paired_bootstrap, sentence_chrf, signatures
from eval.style import perplexity
from ground.errors import Cancelled, UserError
from ground.settings import SettingsRecord

Progress = Callable[[float, str], None]


def _noop(*a) -> None:
    pass


def score(task: str, sources: list[str], hyps: list[str], refs: list[str] | None, extra: dict | None = None) -> dict:
    """The task's metrics for one method's outputs."""
    out: dict = {}
    if refs is not None and task != "style":
        out.update(bleu_chrf(hyps, refs))
    if task == "formality":
        per = informal_pattern_counts(hyps)["per_text"]
        out["informal_patterns"] = per["all"]  # informal patterns per output (lower is more formal)
        out["informal_breakdown"] = {k: round(v, 3) for k, v in per.items() if k != "all"}
    if task == "style":
        extra = extra or {}
        clf = extra.get("style_classifier")
        if clf is not None:
            sc = clf.score(hyps)
            out["style_score"] = sum(sc) / len(sc)
        sim = content_similarity(hyps, sources)
        out["content_similarity"] = sum(sim) / len(sim)
        if refs is not None:
            out.update(bleu_chrf(hyps, refs))
        if extra.get("perplexity_backbone") is not None:
            out["perplexity"] = perplexity(hyps, extra["perplexity_backbone"])
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


# Numbers of a methods row that describe how it was decoded, not how well: not metrics (tables, bar charts).
DECODE_KEYS = ("n", "max_new_tokens", "num_beams", "no_repeat_ngram")
MIN_BOOTSTRAP_N = 5  # fewer sentences: no intervals or p-values (resampling 1–4 sentences says nothing)
CHRF_PREFIX = "chrF · "  # per-sentence chrF of a row in ``outputs``: key CHRF_PREFIX + the row's label


def evaluate(backbone, pairs: list[tuple[str, str | None]], rows: list[Row], prompt: Prompt, task: str = "translation",
             batch_sources: int = 4, max_new_tokens: int = 96, progress: Progress = _noop,
             should_stop: Callable[[], bool] = lambda: False, extra: dict | None = None,
             no_repeat_ngram: int | None = None, bootstrap: int = 1000, decode: Callable = decode_batch,
             reference_sl: bool = False) -> dict:
    """Decode every pair's source with every row; return per-method metrics and the outputs.

    ``pairs`` are (source, reference) — the reference may be None (style transfer without references).

    Each methods row reports what a reviewer needs to trust it: n, the backbone, how it was decoded (its complete
    settings, ``max_new_tokens``, greedy, the repetition guard ``no_repeat_ngram`` — one value for every row), the
    metrics with their 95% bootstrap confidence intervals (``sacrebleu_ci95``, ``chrf_ci95``; ``bootstrap``
    resamples, 0: none; none either below ``MIN_BOOTSTRAP_N`` sentences) and, against the base model's row when there is
    one, the paired-bootstrap difference and one-sided p-value (``sacrebleu_delta``, ``p_sacrebleu``, ...). The result
    holds sacreBLEU's ``signatures``.
    ``outputs``: one dict per pair with source, reference, every row's output (key: its label) and its sentence
    chrF (key ``"chrF · " + label``). ``decode``: ``engine.decode_batch``, or a function called alike
    (``offsite.decode.decode_batch_remote``: through a model owner's service).
    ``reference_sl``: hand each reference's token length to the decode (``ref_lens``), for PEMA's GU
    ``gu_variant="code"``, whose SL the public code counts with the reference; off by default (a user's decode
    has no reference, so the source's length stands in for it), and only where every pair has a reference.
    """
    if not pairs:
        raise UserError("No evaluation pairs.")
    if reference_sl and any(r is None or not isinstance(r, str) for _, r in pairs):
        raise UserError("A reference-length SL needs one reference (a string) per pair.")
    t0 = time.time()
    sources = [s for s, _ in pairs]
    hyps: dict[str, list[str]] = {r.label: [] for r in rows}
    used: dict[str, dict] = {}
    n_tokens = 0
    for b0 in range(0, len(sources), batch_sources):
        if should_stop():
            raise Cancelled()
        chunk = sources[b0:b0 + batch_sources]
        # An output far longer than its input is a runaway (repetition); capping the batch's length at twice the
        # longest source (+16 tokens) keeps one such row from making the whole batch decode to max_new_tokens.
        cap = min(max_new_tokens, 2 * max(len(backbone.encode_target(s.strip())) for s in chunk) + 16)
        ref_kw = {"ref_lens": [len(backbone.encode_target(r.strip())) for _, r in pairs[b0:b0 + batch_sources]]} \
            if reference_sl else {}
        for comp in decode(backbone, chunk, rows, prompt, max_new_tokens=cap, trace=False,
                           no_repeat_ngram=no_repeat_ngram, **ref_kw):
            for r in comp.rows:
                hyps[r.label].append(r.text)
                used.setdefault(r.label, r.settings)
                n_tokens += len(r.tokens)
        done = min(len(sources), b0 + batch_sources)
        progress(done / len(sources), f"decoded {done}/{len(sources)} sentences × {len(rows)} methods")
    refs = [r for _, r in pairs] if all(r is not None for _, r in pairs) else None
    methods = []
    for r in rows:
        settings = used.get(r.label, {})
        methods.append({"label": r.label, "method": r.method, "n": len(pairs), "backbone": backbone.name,
                        "max_new_tokens": max_new_tokens, "num_beams": 1,
                        "no_repeat_ngram": int(settings.get("no_repeat_ngram", 0)), "settings": settings,
                        **score(task, sources, hyps[r.label], refs, extra)})
    sigs = {}
    if refs is not None and any("sacrebleu" in m for m in methods):
        progress(1.0, f"confidence intervals: {bootstrap} bootstrap resamples per method")
        sigs = signatures(max(1 if isinstance(x, str) else len(x) for x in refs))
        base = next((r.label for r in rows if r.plugin is None), None)
        for m in methods:
            m["bleu_signature"], m["chrf_signature"] = sigs["sacrebleu"], sigs["chrf"]
            if bootstrap and len(pairs) >= MIN_BOOTSTRAP_N:
                ci = bootstrap_ci(hyps[m["label"]], refs, n_samples=bootstrap)
                m["sacrebleu_ci95"], m["chrf_ci95"] = ci["sacrebleu"], ci["chrf"]
                if base is not None and m["label"] != base:
                    pb = paired_bootstrap(hyps[base], hyps[m["label"]], refs, n_samples=bootstrap)
                    for k in ("sacrebleu", "chrf"):
                        m[f"{k}_delta"], m[f"p_{k}"] = pb[k]["delta"], pb[k]["p_value"]
    chrf = {lab: sentence_chrf(hyps[lab], refs) for lab in hyps} if refs is not None else {}
    outputs = [{"source": s, "reference": ref, **{lab: hyps[lab][i] for lab in hyps},
                **{CHRF_PREFIX + lab: chrf[lab][i] for lab in chrf}}
               for i, (s, ref) in enumerate(pairs)]
    secs = time.time() - t0
    return {"task": task, "n": len(pairs), "seconds": round(secs, 1), "tokens": n_tokens,
            "tokens_per_second": round(n_tokens / max(secs, 1e-9), 1), "methods": methods,
            "outputs": outputs, "backbone": backbone.name, "signatures": sigs,
            "decode": {"max_new_tokens": max_new_tokens, "num_beams": 1,
                       "length_cap": "per batch: min(max_new_tokens, 2 × the longest source's tokens + 16)",
                       "gu_code_sl": "reference" if reference_sl else "source",
                       "no_repeat_ngram": int(next(iter(used.values()), {}).get("no_repeat_ngram", 0))}}


def lambda_sweep(backbone, pairs, plugin, prompt: Prompt, lambdas=(0.1, 0.3, 0.5, 0.7, 0.9), task="translation",
                 progress: Progress = _noop, should_stop=lambda: False, extra: dict | None = None,
                 settings: SettingsRecord | dict | None = None, comparison: dict | None = None,
                 **kw) -> list[dict]:
    """PEMA's λ_max curves with and without Gradual Unrolling (the paper's Figures 4–5), all in one batch.
    ``settings``: the plug-in's other decode settings (λ_max and GU are swept); ``comparison``: settings of the
    whole comparison (``engine.comparison``). λ_max = 0 is the base model's row (decoded once)."""
    start = plugin.settings(settings)
    rows = [Row("base", comparison=dict(comparison or {}))]
    for lam in sorted({float(x) for x in lambdas} - {0.0}):
        for gu in (True, False):
            rows.append(Row(f"λ={lam} GU={'on' if gu else 'off'}", plugin, start.replace(lambda_max=lam, gu=gu),
                            dict(comparison or {})))
    kw.setdefault("bootstrap", 0)  # a curve: no intervals per point unless asked
    res = evaluate(backbone, pairs, rows, prompt, task, progress=progress, should_stop=should_stop, extra=extra, **kw)
    keep = lambda m: {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}  # noqa: E731
    # λ_max = 0 is the base model whatever GU says: one row (gu None), drawn at 0 on both curves.
    out = [{"label": "base (λ_max=0)", "lambda_max": 0.0, "gu": None, **keep(res["methods"][0])}]
    for m in res["methods"][1:]:
        out.append({"label": m["label"], "lambda_max": m["settings"]["lambda_max"], "gu": m["settings"]["gu"],
                    **keep(m)})
    return out


def format_table(methods: list[dict], keys: list[str] | None = None, digits: int = 2) -> str:
    keys = keys or [k for k in methods[0] if isinstance(methods[0][k], (int, float)) and k not in DECODE_KEYS
                    and not k.startswith("p_") and not k.endswith("_delta")]
    head = ["method"] + keys
    lines = [[m["label"]] + [f"{m.get(k, float('nan')):.{digits}f}" if isinstance(m.get(k), (int, float)) else "-"
                             for k in keys] for m in methods]
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(head)]
    fmt = lambda r: " | ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(head), "-+-".join("-" * w for w in widths)] + [fmt(r) for r in lines])
