"""The plain functions the CLI, the app's job worker, the benchmarks and the tests all call.

samples → memory (``memories.build``) → plug-in (``train_plugin``) → decode (``engine.compare``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from backbone.threads import wait_policy
from ground.errors import UserError
from ground.store import Catalog, new_id
from memories.store import Memory
from plugins.base import Plugin, load_plugin
from plugins.registry import available_methods, get_method, method_card

Progress = Callable[[float, str], None]


def _noop(*a) -> None:
    pass


def make_config(method: str, overrides: dict | None = None):
    """The method's Config with the paper defaults, overridden by ``overrides`` (validated)."""
    cls = get_method(method)
    base = cls.Config().to_dict()
    base.update(overrides or {})
    return cls.Config.from_dict(base)


def new_plugin(method: str, backbone, memory: Memory, overrides: dict | None = None) -> Plugin:
    cls = get_method(method)
    memory_meta = {"id": memory.id, "path": str(memory.path), "key_rms": memory.key_scale, "task": memory.task,
                   "prompt": memory.meta["prompt"]}
    return cls(make_config(method, overrides), backbone, memory_meta)


def train_plugin(backbone, memory: Memory, method: str, overrides: dict | None = None, *,
                 catalog: Catalog | None = None, out_dir: str | Path | None = None, name: str = "",
                 progress: Progress = _noop, should_stop: Callable[[], bool] = lambda: False,
                 on_metric: Callable[[dict], None] | None = None) -> tuple[Plugin, dict]:
    """Train a plug-in of ``method`` on ``memory``; save it (JSON + safetensors) and register it in the catalog.

    Returns the trained plug-in and its catalog row (with metrics and the loss history); ``on_metric`` receives
    every history point while training runs.
    """
    backbone.check_fingerprint(memory.fingerprint, "This memory")
    plugin = new_plugin(method, backbone, memory, overrides)
    plugin.on_metric = on_metric  # each training point as it is made (a job's live loss curve)
    t0 = time.time()
    result = plugin.fit(memory, progress=progress, should_stop=should_stop)
    plugin.train_info = {**plugin.train_info, "seconds": round(time.time() - t0, 2),
                         "trainable_parameters": plugin.trainable_parameters(), "openmp_wait": wait_policy()}
    pid = new_id(f"{method}-")
    if out_dir is None:
        if catalog is None:
            raise UserError("Give an output folder or a catalog to save the plug-in in.")
        out_dir = catalog.root / "plugins" / pid
    out_dir = Path(out_dir)
    plugin.save(out_dir)
    (out_dir / "history.json").write_text(json.dumps(result.history), encoding="utf-8")
    plugin.plugin_path = out_dir
    row = plugin_catalog_row(plugin, out_dir, name or f"{get_method(method).title} on "
                                              f"{memory.meta.get('name', memory.id)}", memory.id, result.metrics)
    if catalog is not None:
        catalog.add_plugin(row)
    return plugin, {**row, "history": result.history}


def plugin_catalog_row(plugin: Plugin, path: str | Path, name: str, memory_id: str, metrics: dict | None = None,
                       **extra) -> dict:
    """The catalog row of a saved plug-in (trained here, or imported by ``plugins.hub``): ``metrics`` holds the
    fit's metrics and the plug-in's ``train_info``; ``extra`` adds fields to that JSON (e.g. ``imported_from``)."""
    path = Path(path)
    return {"id": path.name, "name": name, "method": plugin.method, "memory_id": memory_id, "path": str(path),
            "backbone": plugin.backbone_name, "fingerprint": plugin.fingerprint,
            "params": plugin.trainable_parameters(),
            "metrics": json.dumps({**(metrics or {}), "train_info": plugin.train_info, **extra}, default=str),
            "created": time.time()}


def plugin_folder(ref: str, catalog: Catalog | None = None) -> Path:
    """The folder of a plug-in given by catalog id or folder path."""
    path = Path(ref)
    if not (path / "plugin_config.json").exists() and catalog is not None:
        row = catalog.plugin(ref)
        if row is None:
            raise UserError(f"No plug-in {ref!r} in the catalog ({catalog.root}).")
        path = Path(row["path"])
    return path


def open_plugin(ref: str, backbone, catalog: Catalog | None = None) -> Plugin:
    """Load a plug-in by catalog id or folder path."""
    return load_plugin(plugin_folder(ref, catalog), backbone)


def open_memory(ref: str, backbone=None, catalog: Catalog | None = None) -> Memory:
    """Load a memory by catalog id or folder path (checking the backbone when given)."""
    path = Path(ref)
    if not (path / "meta.json").exists() and catalog is not None:
        row = catalog.memory(ref)
        if row is None:
            raise UserError(f"No memory {ref!r} in the catalog ({catalog.root}).")
        path = Path(row["path"])
    return Memory.load(path, backbone)


def method_table() -> list[dict]:
    """Every registered method with its level, paper, and its declared settings: ``config`` / ``decode`` are the
    defaults, ``training_settings`` / ``decode_settings`` the full declarations (type, range, help, live)."""
    return [{"method": name, "title": cls.title, "level": cls.level, "paper": method_card(name).paper,
             "config": cls.Config().to_dict(), "decode": {s.name: s.default for s in cls.decode_settings},
             "training_settings": [s.describe() for s in cls.Config.declared()],
             "decode_settings": [s.describe() for s in cls.decode_settings]}
            for name, cls in sorted(available_methods().items())]
