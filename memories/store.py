"""A memory on disk: keys f(c) (N×d, float16/float32), values y (int32 token ids), the sample each entry came
from, the samples themselves, and meta.json. Arrays are memory-mapped on load, so a memory larger than RAM works.

Folder layout::

    meta.json              backbone fingerprint, prompt (and where its examples came from), task, build mode,
                           statistics
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
from memories.nearness import MEASURE, NgramIndex, nearness_profile

FORMAT_VERSION = 1


@dataclass
class Memory:
    path: Path
    meta: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path, backbone=None) -> "Memory":
        """A memory folder, its meta.json checked (a damaged one is a UserError naming the folder); the arrays are
        opened — and checked against meta.json — when first used."""
        path = Path(path)
        if not (path / "meta.json").is_file():
            raise UserError(f"No memory at {path} (meta.json is missing).")
        try:
            meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise UserError(f"The memory at {path} is damaged: meta.json is unreadable ({type(e).__name__}).") \
                from None
        problem = _meta_problem(meta)
        if problem:
            raise UserError(f"The memory at {path} is damaged: {problem}.")
        if meta.get("format_version", 0) > FORMAT_VERSION:
            raise UserError(f"The memory at {path} was written by a newer PEMA Studio.")
        mem = cls(path=path, meta=meta)
        if backbone is not None:
            backbone.check_fingerprint(meta["fingerprint"], "This memory")
        return mem

    def _arr(self, name: str) -> np.ndarray:
        """One array, memory-mapped, checked against meta.json (shape, dtype, finite keys for small ones): a
        missing, truncated, pickled or mismatched file is a UserError."""
        f = self.path / f"{name}.npy"
        if not f.is_file():
            raise UserError(f"The memory at {self.path} is damaged: {f.name} is missing. Build it again.")
        try:
            # allow_pickle=False: a memory is data, never code.
            arr = np.load(f, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise UserError(f"The memory at {self.path} is damaged: {f.name} cannot be read ({e}). "
                            f"Build it again.") from None
        st = self.meta["stats"]
        n = st["heldout_entries" if name.startswith("heldout_") else "entries"]
        if name.endswith("keys"):
            d = self.meta.get("hidden_size")
            ok = arr.ndim == 2 and arr.shape[0] == n and (d is None or arr.shape[1] == d) \
                and arr.dtype in (np.float16, np.float32)
            if ok and arr.size and arr.size <= FINITE_CHECK_MAX and not np.isfinite(arr).all():
                raise UserError(f"The memory at {self.path} is damaged: {f.name} holds NaN or infinite keys. "
                                f"Build it again.")
        else:
            ok = arr.shape == (n,) and arr.dtype.kind in "iu"
        if not ok:
            raise UserError(f"The memory at {self.path} is damaged: {f.name} has shape {arr.shape} "
                            f"({arr.dtype}), not what meta.json says ({n} entries). Build it again.")
        return arr

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
        try:
            with open(self.path / "samples.jsonl", encoding="utf-8", newline="\n") as f:
                rows = [json.loads(ln) for ln in f]
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise UserError(f"The memory at {self.path} is damaged: samples.jsonl is unreadable "
                            f"({type(e).__name__}). Build it again.") from None
        if not all(isinstance(r, dict) and isinstance(r.get("tgt"), str) and r.get("split") in ("train", "heldout")
                   for r in rows):
            raise UserError(f"The memory at {self.path} is damaged: samples.jsonl has malformed rows.")
        return rows

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
    def prompt_examples(self) -> dict:
        """Where the prompt's few-shot examples came from: ``{"source": "own", "samples": [index], "lines":
        [line]}`` (the memory's own training samples), ``{"source": "builtin"}`` (the task's built-in ones; also
        every memory built before this was recorded, whose prompt is kept as it is) or ``{"source": "given"}``."""
        rec = self.meta.get("prompt_examples")
        return dict(rec) if isinstance(rec, dict) and rec.get("source") in ("own", "builtin", "given") \
            else {"source": "builtin"}

    @cached_property
    def split(self) -> dict:
        """How the held-out samples were chosen, with their distance profile (``memories.nearness``): the build's
        record (``method`` "grouped": near-duplicates on one side), or, for a memory built before grouped splits,
        ``method`` "random" — it keeps its split, and says so — with the profile computed from its samples now."""
        rec = self.meta.get("split")
        if isinstance(rec, dict) and rec.get("method") == "grouped" and isinstance(rec.get("heldout_profile"), dict):
            return dict(rec)
        train = [s.get("src") or "" for s in self.split_samples("train")]
        held = [s.get("src") or "" for s in self.split_samples("heldout")]
        profile = nearness_profile(NgramIndex(train).nearest(held)[0]) if held else {"n": 0}
        return {"method": "random", "measure": MEASURE, "heldout_profile": profile,
                "note": "built before held-out samples were chosen apart from their near-duplicates: this memory "
                        "keeps its random split (build it again for a grouped one)"}

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


FINITE_CHECK_MAX = 50_000_000  # keys checked for NaN/inf when first opened (larger memories: not, costs a pass)


def _meta_problem(meta) -> str:
    """What is wrong with a memory's meta.json, or ""."""
    if not isinstance(meta, dict):
        return "meta.json is not an object"
    for key, kind in (("fingerprint", str), ("backbone", str), ("prompt", dict), ("stats", dict), ("mode", str)):
        if not isinstance(meta.get(key), kind):
            return f"meta.json has no valid {key!r}"
    st = meta["stats"]
    for key in ("samples", "heldout_samples", "entries", "heldout_entries"):
        v = st.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"meta.json's stats have no valid {key!r}"
    rms = st.get("key_rms")
    if not isinstance(rms, (int, float)) or isinstance(rms, bool) or not np.isfinite(rms) or rms <= 0:
        return "meta.json's key_rms is not a positive number"
    return ""


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
