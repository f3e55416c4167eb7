"""Settings of a whole comparison, not of one method: the engine applies them to every row of a batch alike — the
base model's row included —, so they are declared once, here, and not in each method's decode settings. A caller
addresses them like a method's settings (``plugins.settings``: the ``"all"`` key, ``--set no_repeat_ngram=3``) or
gives them to the decode (``comparison=``, ``no_repeat_ngram=``); a row's recorded settings include them when they
are on."""
from __future__ import annotations

from ground.settings import Setting, coerce_all

COMPARISON_SETTINGS: tuple[Setting, ...] = (
    Setting("no_repeat_ngram", 0, "repetition guard: no output repeats an n-gram of its own tokens of this size "
            "(HF's no_repeat_ngram_size, over the output only); 0 = off, as in the papers — it changes their "
            "decoding. Applies to every row alike, the base model's included", low=0, high=10, step=1,
            label="No repeated n-gram"),
)
COMPARISON_NAMES = frozenset(s.name for s in COMPARISON_SETTINGS)


def split_comparison(values: dict | None) -> tuple[dict, dict]:
    """``(comparison settings, the rest)`` of one row's settings."""
    values = dict(values or {})
    return ({k: v for k, v in values.items() if k in COMPARISON_NAMES},
            {k: v for k, v in values.items() if k not in COMPARISON_NAMES})


def comparison_settings(values: dict | None) -> dict:
    """Comparison settings checked against their declarations; only those that are on (not their default)."""
    checked = coerce_all(COMPARISON_SETTINGS, dict(values or {}), "the comparison")
    defaults = {s.name: s.default for s in COMPARISON_SETTINGS}
    return {k: v for k, v in checked.items() if v != defaults[k]}
