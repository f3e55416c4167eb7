"""The plug-in protocol, checked on every registered method alike (tiny model): save/load round trip, refusal of a
foreign backbone, a batched row equals its own single decode, and the same seed gives the same plug-in."""
from __future__ import annotations

import json

import pytest
import torch

from backbone.prompts import Prompt
from ground.errors import UserError
from plugins.api import train_plugin
from plugins.base import load_plugin
from plugins.decode import Row, compare
from plugins.registry import available_methods

METHODS = sorted(available_methods())
PROMPT = Prompt.for_task("translation")


def quick_config(method: str) -> dict:
    return dict(available_methods()[method].quick_settings)


@pytest.fixture(scope="module")
def trained(tiny, tiny_memory, tmp_path_factory):
    """One trained and saved plug-in per method (trained lazily, once)."""
    cache: dict = {}

    def get(method):
        if method not in cache:
            out = tmp_path_factory.mktemp(method) / "p"
            plugin, _row = train_plugin(tiny, tiny_memory, method, quick_config(method), out_dir=out)
            cache[method] = (plugin, out)
        return cache[method]

    return get


def state(plugin) -> dict:
    return {k: v.detach().cpu().clone() for k, v in plugin.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method", METHODS)
def test_save_load_round_trip_decodes_the_same(method, tiny, trained):
    plugin, path = trained(method)
    loaded = load_plugin(path, tiny)
    assert type(loaded) is type(plugin) and loaded.config == plugin.config
    assert same_state(state(loaded), state(plugin))
    a = compare(tiny, "the house is small", [Row("p", plugin)], PROMPT, max_new_tokens=6)
    b = compare(tiny, "the house is small", [Row("p", loaded)], PROMPT, max_new_tokens=6)
    assert a.rows[0].tokens == b.rows[0].tokens


@pytest.mark.parametrize("method", METHODS)
def test_a_foreign_backbone_is_refused(method, tiny, trained, tmp_path):
    import shutil

    _plugin, path = trained(method)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    cfg = json.loads((copy / "plugin_config.json").read_text())
    cfg["fingerprint"] = "0" * len(str(cfg["fingerprint"]))
    (copy / "plugin_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="backbone"):
        load_plugin(copy, tiny)


@pytest.mark.parametrize("method", METHODS)
def test_a_batched_row_equals_its_single_decode(method, tiny, trained):
    plugin, _ = trained(method)
    others = [Row("base")] + [Row(f"other-{m}", trained(m)[0]) for m in ("pema", "knn") if m != method]
    alone = compare(tiny, "the cat sleeps", [Row("p", plugin)], PROMPT, max_new_tokens=8)
    batched = compare(tiny, "the cat sleeps", [*others, Row("p", plugin)], PROMPT, max_new_tokens=8)
    assert batched.rows[-1].tokens == alone.rows[0].tokens


@pytest.mark.parametrize("method", METHODS)
def test_the_same_seed_gives_the_same_plugin(method, tiny, tiny_memory, trained, tmp_path):
    plugin, _ = trained(method)
    again, _ = train_plugin(tiny, tiny_memory, method, quick_config(method), out_dir=tmp_path / "again")
    assert same_state(state(again), state(plugin))


def test_training_reports_its_history_points_as_they_are_made(tiny, tiny_memory, tmp_path):
    """A job's live loss curve comes from structured points (no progress text is parsed)."""
    points: list[dict] = []
    _plugin, row = train_plugin(tiny, tiny_memory, "pema", quick_config("pema"), out_dir=tmp_path / "p",
                                on_metric=points.append)
    assert points == row["history"] and {p["phase"] for p in points} == {"reconstruction", "joint"}
    assert any("loss" in p for p in points) and any("heldout_loss" in p for p in points)
