"""Method registry: ``@register(CARD)`` a Plugin subclass under its ``method`` name (like PEFT's tuner mapping),
with the method's card (``plugins.card.MethodCard``: its paper, time estimate, neighbour map, ...).

A method is one module: every module of this package whose source registers a class (a line starting with
``@register``) is imported the first time the methods are asked for, and so is every such ``*.py`` file in the
folders that ``PEMA_METHOD_PATH`` lists (``os.pathsep``-separated; a method kept outside this repository). No list
of methods is kept anywhere else.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
from pathlib import Path

from ground.errors import UserError
from plugins.card import MethodCard, NeighbourMap

METHODS: dict[str, type] = {}
CARDS: dict[str, MethodCard] = {}
METHOD_PATH_ENV = "PEMA_METHOD_PATH"
_REGISTERS = re.compile(r"^@register\b", re.MULTILINE)
_scanned: set[str] = set()
_lock = threading.RLock()


def register(card: MethodCard):
    """The class decorator that registers a method class with its card."""
    if not isinstance(card, MethodCard):
        raise TypeError("register a method with its card: @register(MethodCard(...))")

    def add(cls):
        METHODS[cls.method] = cls
        CARDS[cls.method] = card
        return cls

    return add


def get_method(name: str):
    _import_all()
    try:
        return METHODS[name]
    except KeyError:
        raise UserError(f"Unknown method {name!r}; available: {', '.join(sorted(METHODS))}.") from None


def available_methods() -> dict[str, type]:
    """Every registered method by name, in name order."""
    _import_all()
    return dict(sorted(METHODS.items()))


def method_card(name: str) -> MethodCard:
    """The card a method was registered with (``plugins.card``)."""
    get_method(name)
    return CARDS[name]


def neighbour_map_of(method: str) -> NeighbourMap | None:
    """The neighbour map of a method's rows (``MethodCard.neighbour_map``); None for a method without one and for a
    row of no method (the base model)."""
    return CARDS[method].neighbour_map if method in available_methods() else None


def shown_first(method: str) -> bool:
    """Whether the studio shows this method's row first where it needs one (``MethodCard.shown_first``)."""
    return method in available_methods() and CARDS[method].shown_first


def method_modules(folder: Path) -> list[Path]:
    """The ``*.py`` files of ``folder`` (not private ones, not ``__main__``) that register a method, by name."""
    out = []
    for f in sorted(Path(folder).glob("*.py")):
        if f.name.startswith("_"):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if _REGISTERS.search(text):
            out.append(f)
    return out


def _import_all() -> None:
    """Import every method module once (this package's, then ``PEMA_METHOD_PATH``'s), so that each registers
    itself."""
    here = str(Path(__file__).resolve().parent)
    extra = [p for p in os.environ.get(METHOD_PATH_ENV, "").split(os.pathsep) if p]
    if here in _scanned and all(p in _scanned for p in extra):
        return
    with _lock:
        if here not in _scanned:
            for f in method_modules(Path(here)):
                importlib.import_module(f"{__package__}.{f.stem}")
            _scanned.add(here)
        for folder in extra:
            if folder not in _scanned:
                for f in method_modules(Path(folder)):
                    _load_file(f)
                _scanned.add(folder)


def _load_file(path: Path) -> None:
    """Import a method module kept outside this package (from its file), once."""
    name = f"pema_methods.{path.stem}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
