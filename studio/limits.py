"""Bounds on what one request, and one owner, may ask of the studio (a hosted studio is one shared CPU).

Each bound is a field of :class:`Limits`; 0 means "no limit". They are set, in this order of precedence, by the
app's ``--limit name=value`` flags, by ``PEMA_LIMIT_<NAME>`` environment variables (``PEMA_LIMIT_INPUT_CHARS=4000``),
and by the defaults below. The per-owner quotas (:data:`QUOTAS`) are off in single-user mode unless set explicitly:
a local studio belongs to one person. Every refusal is a :class:`UserError` naming the bound and how to change it.
Training settings are bounded where they are declared (``plugins.settings.setting(low=…, high=…)``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Mapping

from ground.errors import UserError

ENV_PREFIX = "PEMA_LIMIT_"
QUOTAS = ("memories_per_owner", "plugins_per_owner", "shares_per_owner", "jobs_per_owner")


@dataclass(frozen=True)
class Limits:
    input_chars: int = 2000            # characters of a sentence to compare
    max_new_tokens: int = 256          # tokens generated per row (compare, evaluate)
    beams: int = 4                     # beams of a comparison
    methods_per_comparison: int = 8    # rows of one comparison or evaluation
    upload_bytes: int = 20_000_000     # bytes of an upload or pasted text (samples, test file)
    samples: int = 20_000              # samples of one memory
    memories_per_owner: int = 20
    plugins_per_owner: int = 50
    shares_per_owner: int = 200
    jobs_per_owner: int = 4            # jobs queued or running per owner
    jobs_total: int = 64               # jobs queued or running overall
    share_bytes: int = 2_000_000       # bytes of a shared comparison's stored payload (JSON)
    eval_pairs: int = 500              # source/reference pairs of one evaluation
    sweep_points: int = 11             # λ_max values of one sweep
    name_chars: int = 120              # characters of a memory's, plug-in's or share label's name

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def configure(cls, multi_user: bool = True, environ: Mapping[str, str] | None = None,
                  overrides: list[str] | dict | None = None) -> "Limits":
        """Defaults ← ``PEMA_LIMIT_*`` ← ``overrides`` (``["name=value", …]`` or a dict); quotas off in single-user
        mode unless set."""
        environ = os.environ if environ is None else environ
        values: dict[str, int] = {} if multi_user else {q: 0 for q in QUOTAS}
        for name in cls.names():
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw not in (None, ""):
                values[name] = _int(name, raw, f"${ENV_PREFIX}{name.upper()}")
        items = overrides.items() if isinstance(overrides, dict) else [_split(o) for o in overrides or []]
        for name, raw in items:
            if name not in cls.names():
                raise UserError(f"Unknown limit {name!r}; the limits are: {', '.join(cls.names())}.")
            values[name] = _int(name, raw, f"--limit {name}")
        return replace(cls(), **values)

    def describe(self) -> list[dict]:
        """Every bound with its value and the environment variable that sets it (README, ``--limits``)."""
        return [{"name": f.name, "value": getattr(self, f.name), "env": ENV_PREFIX + f.name.upper()}
                for f in fields(self)]

    # --- checks: each raises a UserError that names the bound ------------------------------------------------
    def check(self, name: str, value: int | float, what: str) -> None:
        """Refuse ``value`` above the bound ``name`` (``what`` says what was counted)."""
        bound = getattr(self, name)
        if bound and value > bound:
            raise UserError(f"{what} is {_n(value)}; the limit is {_n(bound)} ({hint(name)}).")

    def check_quota(self, name: str, have: int, what: str) -> None:
        """Refuse to make one more when an owner already has ``have`` (of at most ``name``)."""
        bound = getattr(self, name)
        if bound and have >= bound:
            raise UserError(f"You have {have} {what} (the limit per user is {bound}); delete one first "
                            f"({hint(name)}).")


def hint(name: str) -> str:
    return f"the studio's operator sets it with --limit {name}=… or ${ENV_PREFIX}{name.upper()}"


def _n(v) -> str:
    return f"{v:,}" if isinstance(v, int) else str(v)


def _split(item: str) -> tuple[str, str]:
    name, sep, value = str(item).partition("=")
    if not sep:
        raise UserError(f"Write a limit as name=value (e.g. input_chars=4000), not {item!r}.")
    return name.strip().replace("-", "_"), value.strip()


def _int(name: str, raw, where: str) -> int:
    try:
        v = int(str(raw).replace("_", "").replace(",", ""))
    except ValueError:
        raise UserError(f"{where}: the limit {name} must be a whole number (0 = no limit), not {raw!r}.") from None
    if v < 0:
        raise UserError(f"{where}: the limit {name} must be 0 (no limit) or more, not {v}.")
    return v
