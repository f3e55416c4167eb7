"""A memory on disk: keys f(c) (N×d, float16/float32), values y (int32 token ids), the sample each entry came
from, the samples themselves, and meta.json. Arrays are memory-mapped on load, so a memory larger than RAM works.

Folder layout::

    meta.json              backbone fingerprint, prompt, task, build mode, statistics
    samples.jsonl          {"src","tgt","synthetic_src","split"} one a line (split: train / heldout)
    keys.npy values.npy entry_sample.npy                    training entries (the kNN datastore)
    heldout_keys.npy heldout_values.npy heldout_entry_sample.npy   entries of the held-out samples
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from backbone.prompts import Prompt
from ground.errors import UserError

FORMAT_VERSION = 1


@dataclass
class Memory:
    path: Path
    meta: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path, backbone=None) -> "Memory":
        path = Path(path)
        if not (path / "meta.json").exists():
            raise UserError(f"No memory at {path} (meta.json is missing).")
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        if meta.get("format_version", 0) > FORMAT_VERSION:
            raise UserError(f"The memory at {path} was written by a newer PEMA Studio.")
        mem = cls(path=path, meta=meta)
        if backbone is not None:
            backbone.check_fingerprint(meta["fingerprint"], "This memory")
        return mem

    def _arr(self, name: str) -> np.ndarray:
        # allow_pickle=False: a memory is data, never code.
        return np.load(self.path / f"{name}.npy", mmap_mode="r", allow_pickle=False)

    @cached_property
    def keys(self) -> np.ndarray:
        return self._arr("keys")

    @cached_property
    def values(self) -> np.ndarray:
        return self._arr("values")

    @cached_property
    def entry_sample(self) -> np.ndarray:
        return self._arr("entry_sample")

    @cached_property
    def heldout_keys(self) -> np.ndarray:
        return self._arr("heldout_keys")

    @cached_property
    def heldout_values(self) -> np.ndarray:
        return self._arr("heldout_values")

    @cached_property
    def heldout_entry_sample(self) -> np.ndarray:
        return self._arr("heldout_entry_sample")

    @cached_property
    def samples(self) -> list[dict]:
        with open(self.path / "samples.jsonl", encoding="utf-8") as f:
            return [json.loads(ln) for ln in f]

    def split_samples(self, split: str) -> list[dict]:
        return [s for s in self.samples if s["split"] == split]

    @property
    def id(self) -> str:
        return self.meta.get("id", self.path.name)

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def prompt(self) -> Prompt:
        return Prompt.from_dict(self.meta["prompt"])

    @property
    def task(self) -> str:
        return self.meta.get("task", "custom")

    @property
    def key_scale(self) -> float:
        """RMS of the keys: plug-ins divide f(c) by it so that losses and distances have a sane scale
        (Gemma's pre-norm states have an RMS near 1,300)."""
        return float(self.meta["stats"]["key_rms"])

    def __len__(self) -> int:
        return int(self.meta["stats"]["entries"])

    def summary(self) -> dict:
        st = self.meta["stats"]
        return {"id": self.id, "name": self.meta.get("name", ""), "backbone": self.meta["backbone"],
                "task": self.task, "mode": self.meta["mode"], "samples": st["samples"],
                "heldout_samples": st["heldout_samples"], "entries": st["entries"],
                "heldout_entries": st["heldout_entries"], "bytes": disk_bytes(self.path)}


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
