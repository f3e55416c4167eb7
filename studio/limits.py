"""Bounds on what one request, and one owner, may ask of the studio (a hosted studio is one shared CPU).

Each bound is a field of :class:`Limits`; 0 means "no limit". They are set, in this order of precedence, by the
app's ``--limit name=value`` flags, by ``PEMA_LIMIT_<NAME>`` environment variables (``PEMA_LIMIT_INPUT_CHARS=4000``),
and by the defaults below. The per-owner quotas (:data:`QUOTAS`) and rate limits (:data:`RATES`) are off in
single-user mode unless set explicitly: a local studio belongs to one person. Every refusal is a :class:`UserError`
naming the bound and how to change it.

Rate limits count an owner's calls in a sliding window of :data:`RATE_WINDOW_S` seconds (``check_rate``, called by
the service at the top of ``compare``, ``compare_several`` and ``submit_evaluate``); the window lives in the
``Limits`` object (this process), so a restart forgets it. ``check_input`` is the one check of free text to decode.

Training settings are bounded where they are declared (``plugins.settings.setting(low=…, high=…)``).
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Callable, Mapping

from ground.errors import UserError
from ground.text import check_name, check_text, describe_char

ENV_PREFIX = "PEMA_LIMIT_"
QUOTAS = ("memories_per_owner", "plugins_per_owner", "shares_per_owner", "jobs_per_owner", "uploads_per_owner",
          "queued_per_owner", "tours_per_owner")
RATES = {"compares_per_minute": "comparisons", "evaluations_per_minute": "evaluations"}  # bound: what it counts
RATE_WINDOW_S = 60.0


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
    compare_lines: int = 32            # sentences of one several-sentences comparison (one batch)
    sweep_points: int = 11             # λ_max values of one sweep
    name_chars: int = 120              # characters of a memory's, plug-in's or share label's name
    compares_per_minute: int = 30      # comparisons per owner in any 60 s (a slider's re-decodes included)
    evaluations_per_minute: int = 10   # evaluations queued per owner in any 60 s
    uploads_per_owner: int = 8         # uploads per owner that no event has used yet (they expire after an hour)
    upload_bytes_total: int = 1_000_000_000  # bytes of all such uploads together
    queue_size: int = 256              # page events and API calls waiting in the queue overall
    queued_per_owner: int = 16         # of those, per owner (one caller cannot fill the queue for all)
    sessions: int = 200                # browser sessions whose page state each app keeps (least recently used out)
    tours_per_owner: int = 1           # first-run tours queued or running per owner
    tours_total: int = 2               # first-run tours queued or running overall

    def __post_init__(self):
        # not a field: the per-owner windows of the rate limits (a fresh, empty set for every Limits object)
        object.__setattr__(self, "_rates", RateWindows())

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def configure(cls, multi_user: bool = True, environ: Mapping[str, str] | None = None,
                  overrides: list[str] | dict | None = None) -> "Limits":
        """Defaults ← ``PEMA_LIMIT_*`` ← ``overrides`` (``["name=value", …]`` or a dict); quotas off in single-user
        mode unless set."""
        environ = os.environ if environ is None else environ
        values: dict[str, int] = {} if multi_user else {q: 0 for q in (*QUOTAS, *RATES)}
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

    def request_bytes(self) -> int:
        """Bytes of one event's or API call's request body (pasted samples travel in it, JSON-escaped): twice the
        upload bound and 1 MB for the rest; 0 (no limit) when uploads are unbounded."""
        return 2 * self.upload_bytes + 1_000_000 if self.upload_bytes else 0

    def owner_queue_cap(self) -> int:
        """Events one owner may have queued or running at once: ``queued_per_owner``, and never more than half of
        ``queue_size``, so that one owner cannot fill the queue for everyone (0: no limit)."""
        if not self.queued_per_owner:
            return 0
        return min(self.queued_per_owner, max(1, self.queue_size // 2)) if self.queue_size else self.queued_per_owner

    def describe(self) -> list[dict]:
        """Every bound with its value and the environment variable that sets it (docs/security.md, ``--limits``)."""
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

    def check_input(self, text, what: str = "sentence", name: str = "input_chars") -> str:
        """Free text a caller sends to be decoded (a sentence, a reference; the page and the API alike): text,
        without NUL, lone surrogates (``ground.text.check_text``) or other control characters (tabs and line breaks
        are fine), at most ``name`` characters once stripped. Returns it unchanged."""
        check_text(text, what)
        bad = next((ch for ch in text if _control(ch)), None)
        if bad is not None:
            raise UserError(f"The {what} contains {describe_char(bad)}, a control character; send plain text.")
        self.check(name, len(text.strip()), f"The {what}'s length in characters")
        return text

    def check_name(self, name: str | None, what: str) -> str:
        """A name typed by the user: text, within ``name_chars``, without control characters, terminal escapes,
        bidirectional overrides or lone surrogates (``ground.text.check_name``). Returns it as checked."""
        name = check_name(name, what)
        self.check("name_chars", len(name), f"The {what}'s length in characters")
        return name

    def check_upload(self, data: bytes | str | None) -> None:
        """The size bound of an upload or pasted text, for bytes and text alike (the parser then gives both the
        same encoding / NUL / surrogate checks, ``memories.parse``)."""
        if data is not None and not isinstance(data, (str, bytes)):
            raise UserError("Send the samples as text or as a file.")
        n = len(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data or b"")
        self.check("upload_bytes", n, "The uploaded text's size in bytes")

    def check_rate(self, name: str, owner: str | None) -> None:
        """Count one call of ``owner`` against the rate limit ``name`` (:data:`RATES`), or refuse it (not counted)
        with how long to wait."""
        bound = getattr(self, name)
        if not bound or owner is None:
            return
        wait = self._rates.take(name, owner, bound)
        if wait > 0:
            raise UserError(f"Too many {RATES[name]}: at most {bound} per minute per user; try again in "
                            f"{max(1, math.ceil(wait))} s ({hint(name)}).")


class RateWindows:
    """Sliding windows of recent calls per (limit, owner), thread-safe: at most ``bound`` calls in any ``window``
    seconds. Owners whose window has emptied are forgotten, so memory stays bounded by the owners active lately."""

    def __init__(self, window: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window, self.clock = float(window), clock
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, str], deque] = {}

    def take(self, name: str, owner: str, bound: int) -> float:
        """Record one call and return 0.0, or (not recorded) the seconds until one more is allowed."""
        now = self.clock()
        with self._lock:
            calls = self._calls.setdefault((name, owner), deque())
            while calls and calls[0] <= now - self.window:
                calls.popleft()
            if len(calls) >= bound:
                return calls[0] + self.window - now
            calls.append(now)
            if len(self._calls) > 4096:  # forget the owners who have been quiet for a whole window
                for key in [k for k, c in self._calls.items() if not c or c[-1] <= now - self.window]:
                    del self._calls[key]
            return 0.0


def check_number(value, name: str, low: float, high: float, *, integer: bool = False) -> int | float:
    """A numeric argument as sent: a finite number (never a bool, NaN or Infinity), whole when ``integer``, within
    ``[low, high]``; returned as int or float, else a UserError naming the argument and its range."""
    kind = "a whole number" if integer else "a number"
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise UserError(f"{name} must be {kind} from {_n(low)} to {_n(high)}, not {value[:40]!r}.") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{name} must be {kind} from {_n(low)} to {_n(high)}, not {type(value).__name__}.")
    if not math.isfinite(value):
        raise UserError(f"{name} must be a finite number (from {_n(low)} to {_n(high)}), not {value}.")
    if integer and value != int(value):
        raise UserError(f"{name} must be a whole number, not {value}.")
    if not low <= value <= high:
        raise UserError(f"{name} must be from {_n(low)} to {_n(high)}, not {_n(value)}.")
    return int(value) if integer else float(value)


def _control(ch: str) -> bool:
    """C0 controls but tab and line breaks, DEL, C1 controls (a terminal or a tokenizer would act on them)."""
    o = ord(ch)
    return (o < 0x20 and ch not in "\t\n\r") or 0x7F <= o <= 0x9F


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
