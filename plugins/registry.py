"""Method registry: ``@register`` a Plugin subclass under its ``method`` name (like PEFT's tuner mapping)."""
from __future__ import annotations

from ground.errors import UserError

METHODS: dict[str, type] = {}


def register(cls):
    METHODS[cls.method] = cls
    return cls


def get_method(name: str):
    _import_all()
    try:
        return METHODS[name]
    except KeyError:
        raise UserError(f"Unknown method {name!r}; available: {', '.join(sorted(METHODS))}.") from None


def available_methods() -> dict[str, type]:
    _import_all()
    return dict(METHODS)


def _import_all() -> None:
    """Import every method module once so that each registers itself (missing optional ones are skipped)."""
    import importlib

    for mod in ("plugins.pema", "plugins.knn", "plugins.adapter", "plugins.lora", "plugins.memory_tuning",
                "plugins.memory_adapter"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
