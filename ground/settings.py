"""A declared setting: its name, default (whose type is the setting's type), range or choices, help text and how UIs
and tuners show it, and the one check every value given for it passes (``Setting.coerce``, ``coerce_all``). Methods
declare their decode and training settings with it (``plugins.settings``), the engine its comparison settings
(``engine.comparison``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from ground.errors import UserError


@dataclass(frozen=True)
class Setting:
    """One declared setting: name, default (its type is the setting's type), range or choices, help text, and
    how the UI and the tuners use it."""

    name: str
    default: Any
    help: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False        # the low bound itself is not allowed (e.g. a temperature > 0)
    choices: tuple = ()
    live: bool = False            # a Compare control: every move re-decodes
    step: float | None = None     # the control's step (sliders)
    label: str = ""               # short UI label (default: the name)
    grid: tuple = ()              # values tried when tuning by decoding (eval.quality)
    fine_grid: tuple = ()         # values tried when tuning teacher-forced (eval.likelihood); default: ``grid``
    type: type | None = None      # default: the default's type

    @property
    def kind(self) -> type:
        return self.type or (type(self.default) if self.default is not None else str)

    @property
    def title(self) -> str:
        return self.label or self.name

    def describe(self) -> dict:
        """A JSON-able description (for UIs, ``python -m plugins methods --json`` and model cards)."""
        return {"name": self.name, "type": self.kind.__name__, "default": self.default, "help": self.help,
                "low": self.low, "high": self.high, "low_open": self.low_open, "choices": list(self.choices),
                "live": self.live, "step": self.step, "label": self.title}

    def range_text(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        if self.low is not None and self.high is not None:
            return f"between {self.low} and {self.high}" + (f" (not {self.low})" if self.low_open else "")
        if self.low is not None:
            return f"{'>' if self.low_open else '≥'} {self.low}"
        if self.high is not None:
            return f"≤ {self.high}"
        name = self.kind.__name__
        return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"

    def coerce(self, value: Any, owner: str = "") -> Any:
        """``value`` as this setting's type, checked against its range/choices; a UserError naming the setting
        otherwise (strings from forms and command lines are parsed)."""
        where = f"{owner} setting {self.name!r}" if owner else f"Setting {self.name!r}"
        if self.help:
            where += f" ({self.help})"
        bad = UserError(f"{where} must be {self.range_text()}; got {value!r}.")
        kind = self.kind
        if kind is bool:
            if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
                value = value.strip().lower() in ("true", "1", "yes")
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and value in (0, 1):
                value = bool(value)
            if not isinstance(value, bool):
                raise bad
        elif kind is int:
            if isinstance(value, str):
                try:
                    value = int(value.strip())
                except ValueError:
                    raise bad from None
            elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 2**53:
                raise bad
        elif kind is float:
            if isinstance(value, str):
                try:
                    value = float(value.strip())
                except ValueError:
                    raise bad from None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad
            value = float(value)
            if not math.isfinite(value):
                raise bad
        elif not isinstance(value, kind):
            raise bad
        if self.choices and value not in self.choices:
            raise bad
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            raise bad
        if self.high is not None and value > self.high:
            raise bad
        return value


def coerce_all(declared: Iterable[Setting], values: dict, owner: str) -> dict:
    """Check and convert ``values`` against ``declared``; an unknown name is an error that lists the known ones."""
    by_name = {s.name: s for s in declared}
    out = {}
    for k, v in values.items():
        if k not in by_name:
            raise UserError(f"Unknown setting {k!r} for {owner}; its settings are: {', '.join(by_name) or 'none'}.")
        out[k] = by_name[k].coerce(v, owner)
    return out
