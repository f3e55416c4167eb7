"""A declared setting: its name, default (whose type is the setting's type), range or choices, help text and how UIs
and tuners show it, and the one check every value given for it passes (``Setting.coerce``, ``coerce_all``). Methods
declare their decode and training settings with it (``plugins.settings``), the engine its comparison settings
(``engine.comparison``).

From a method's declared decode settings, ``settings_record`` generates (once) a frozen, typed record: a row's
complete settings travel as one (``SettingsRecord``) from the merge that makes them (``plugins.settings.row_settings``)
to the method's ``mix`` and hooks, which read attributes (``s.lambda_max``); plain dicts only at the edges (JSON:
``as_dict`` / ``from_dict``)."""
from __future__ import annotations

import functools
import keyword
import math
from dataclasses import dataclass, field, make_dataclass
from typing import Any, ClassVar, Iterable

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
                value = _parsed(value, int, bad)
            elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 2**53:
                raise bad
        elif kind is float:
            if isinstance(value, str):
                value = _parsed(value, float, bad)
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


def _parsed(text: str, kind: type, bad: Exception):
    """A number typed as text (a form, ``--set``), or ``bad`` raised when it is not one."""
    try:
        return kind(text.strip())
    except ValueError:
        raise bad from None


def coerce_all(declared: Iterable[Setting], values: dict, owner: str) -> dict:
    """Check and convert ``values`` against ``declared``; an unknown name is an error that lists the known ones."""
    by_name = {s.name: s for s in declared}
    out = {}
    for k, v in values.items():
        if k not in by_name:
            raise UserError(f"Unknown setting {k!r} for {owner}; its settings are: {', '.join(by_name) or 'none'}.")
        out[k] = by_name[k].coerce(v, owner)
    return out


class SettingsRecord:
    """The base of the frozen records ``settings_record`` generates: one method's complete decode settings, typed.
    A setting is read as an attribute (``s.lambda_max``; a name that is a Python keyword gets a trailing underscore:
    kNN's ``lambda`` is ``s.lambda_``), so a misspelt name fails where it is written: constructing a record with an
    unknown name is a UserError listing the valid ones, reading one an AttributeError naming them. Constructing one
    checks every value given against its declaration (``Setting.coerce``); a name left out takes its declared
    default. Equal records are equal settings (and hash alike: rows with equal settings share a group)."""

    declared: ClassVar[tuple[Setting, ...]] = ()
    owner: ClassVar[str] = ""           # who declares them, for messages ("PEMA", "kNN")
    attrs: ClassVar[dict[str, str]] = {}  # the setting's name → its attribute (``lambda`` → ``lambda_``)

    def __init__(self, **values: Any):
        by_key = {**{s.name: s for s in self.declared}, **{self.attrs[s.name]: s for s in self.declared}}
        unknown = [k for k in values if k not in by_key]
        if unknown:
            raise UserError(f"Unknown setting {unknown[0]!r} for {self.owner or type(self).__name__}; its settings "
                            f"are: {', '.join(s.name for s in self.declared) or 'none'}.")
        given = {by_key[k].name: v for k, v in values.items()}
        for s in self.declared:
            value = s.coerce(given[s.name], self.owner) if s.name in given else s.default
            object.__setattr__(self, self.attrs[s.name], value)

    def __getattr__(self, name: str) -> Any:  # reached only for a name the record does not have
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}; its settings are: "
                             f"{', '.join(self.attrs.values()) or 'none'}.")

    def as_dict(self) -> dict:
        """``{setting name: value}`` (names as declared: kNN's ``"lambda"``) — for JSON, results and messages."""
        return {s.name: getattr(self, self.attrs[s.name]) for s in self.declared}

    @classmethod
    def from_dict(cls, values: dict | None) -> "SettingsRecord":
        """A record from ``{setting name: value}`` (JSON, forms, command lines): names as declared only (not the
        attribute spelling ``lambda_``), values checked like the constructor's."""
        if values is not None and not isinstance(values, dict):
            raise UserError(f"The settings of {cls.owner or cls.__name__} must be an object of name: value pairs.")
        return cls(**coerce_all(cls.declared, dict(values or {}), cls.owner or cls.__name__))

    def replace(self, **changes: Any) -> "SettingsRecord":
        """This record with ``changes`` (setting or attribute names), checked like the constructor."""
        return type(self)(**{**self.as_dict(), **changes})


_RESERVED = {n for n in dir(SettingsRecord) if not n.startswith("__")}


@functools.lru_cache(maxsize=None)
def settings_record(name: str, declared: tuple[Setting, ...], owner: str = "") -> type[SettingsRecord]:
    """The frozen record class of ``declared`` settings (cached: one class per declaration), with each setting a
    typed field (its declared type; its declared default)."""
    attrs = {s.name: s.name + "_" if keyword.iskeyword(s.name) else s.name for s in declared}
    clash = sorted(set(attrs.values()) & _RESERVED)
    if clash or len(set(attrs.values())) != len(declared) or not all(a.isidentifier() for a in attrs.values()):
        raise ValueError(f"{owner or name}: setting names must be distinct identifiers, none of "
                         f"{', '.join(sorted(_RESERVED))}; got {', '.join(attrs)}.")
    fields = [(attrs[s.name], s.kind, field(default=s.default)) for s in declared]
    return make_dataclass(name, fields, bases=(SettingsRecord,), frozen=True, init=False,
                          namespace={"declared": tuple(declared), "owner": owner, "attrs": attrs})
