"""What a comparison asks for (``Row``) and what it returns (``Comparison``: one ``RowResult`` per row)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from backbone.model import Backbone
from backbone.prompts import postprocess
from engine.protocol import DecodeMethod
from ground.settings import SettingsRecord


@dataclass
class Row:
    """One method in a comparison: a label, a plug-in (None for the base model), its decode-time settings and the
    settings of the whole comparison it asks for.

    ``settings``: the method's complete settings, its typed record (``plugins.settings.row_settings`` merges them), or
    ``{name: value}`` overrides of its declared defaults (scripts, tests), which may also hold comparison settings;
    the batch checks them against the method's declarations (``DecodeMethod.settings``). ``comparison``: settings
    of the whole comparison (``engine.comparison``: the batch applies them to every row alike)."""

    label: str
    plugin: DecodeMethod | None = None
    settings: SettingsRecord | dict = field(default_factory=dict)
    comparison: dict = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.plugin.method if self.plugin is not None else "base"


@dataclass
class RowResult:
    label: str
    method: str
    text: str          # post-processed (first line, stripped), as the paper's Table 10
    raw_text: str
    tokens: list[int]
    token_texts: list[str]
    trace: list[dict]  # per output token: λ_t, top-5 of P_LM / plug-in / final, extras (kNN neighbours, ...)
    settings: dict
    score: float
    prompt: dict | None = None  # the row's own prompt, where it is not the comparison's (a plug-in of level "prompt")


@dataclass
class Comparison:
    source: str
    context_ids: list[int]
    src_len: int
    rows: list[RowResult]
    seconds: float
    steps: int
    num_beams: int
    backbone: str

    def to_dict(self) -> dict:
        return asdict(self)

    def row(self, label: str) -> RowResult:
        return next(r for r in self.rows if r.label == label)


def row_result(backbone: Backbone, row: Row, toks: list[int], trace: list[dict], settings: dict,
               score: float, prompt: dict | None = None) -> RowResult:
    """A row's result from its chosen tokens, their trace, its complete settings and its score (and its own
    prompt, for a row prompted otherwise than the comparison)."""
    raw = backbone.decode(toks).rstrip("\n")  # a stop token may carry text before its line break
    return RowResult(label=row.label, method=row.method, text=postprocess(raw), raw_text=raw, tokens=list(toks),
                     token_texts=[backbone.token_str(t) for t in toks], trace=list(trace), settings=settings,
                     score=round(float(score), 4), prompt=prompt)
