"""A method is one file: a toy output-level method — its class and, beside it, its card (``plugins.card``) —
written to a folder of its own and found through ``PEMA_METHOD_PATH`` (no other file names it), appears in
``python -m plugins methods``, in the training form's declared settings, in Compare's choices once trained (and
decodes there), and in the time estimate (its card's)."""
from __future__ import annotations

import json
import os
import sys

import pytest
from _server import build_tiny_memory, tiny_studio

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

TOY = '''
"""Toy: P = λ·uniform + (1−λ)·P_LM (a smoothing of the LM's distribution; nothing is learned)."""
from dataclasses import dataclass

import torch

from ground.settings import Setting
from plugins.base import FitResult, OutputPlugin, PluginConfig
from plugins.card import MethodCard, TimeEstimate
from plugins.registry import register
from plugins.settings import setting


@dataclass
class ToyConfig(PluginConfig):
    spread: float = setting(1.0, "a training setting the form shows (not used)", low=0.0, high=4.0, step=0.5)


def training_time(cls, config, rec, samples, entries):
    return {"setup_s": rec.get("setup_s", 0.0), "loops": [], "text": f"Nothing to train ({entries} entries)."}


CARD = MethodCard(paper="none (a test of the plug-in protocol)",
                  estimate=TimeEstimate(measure_settings={}, training_time=training_time,
                                        throughput_record=lambda plugin, info, history, wall_s, memory: {}))


@register(CARD)
class Toy(OutputPlugin):
    method = "toy_uniform"
    title = "Toy uniform smoothing"
    Config = ToyConfig
    level = "output"
    interpolates = True
    decode_settings = (Setting("lambda", 0.5, "the uniform distribution's weight", low=0.0, high=1.0, live=True,
                               step=0.05),)

    def __init__(self, config, backbone, memory_meta=None):
        super().__init__(config, backbone, memory_meta)
        self.register_buffer("spread", torch.tensor(float(config.spread)))

    def fit(self, memory, progress=lambda *a: None, should_stop=lambda: False):
        return FitResult(metrics={"entries": len(memory)})

    def plugin_logprobs(self, inp):
        n, v = inp.lm_logprobs.shape
        return torch.full((n, v), -float(torch.log(torch.tensor(float(v))))), None

    def mix_lambdas(self, inp):
        return [s.lambda_ for s in inp.settings]  # a setting named like a keyword: its attribute ends in _
'''


@pytest.fixture(scope="module")
def toy_method(tmp_path_factory):
    """The toy's one file in a folder of its own, on ``PEMA_METHOD_PATH`` for this module's tests (and for any
    process the studio starts); the registry forgets it afterwards."""
    from plugins import registry

    folder = tmp_path_factory.mktemp("methods")
    (folder / "toy_uniform.py").write_text(TOY, encoding="utf-8")
    old = os.environ.get(registry.METHOD_PATH_ENV)
    os.environ[registry.METHOD_PATH_ENV] = str(folder)
    yield "toy_uniform"
    if old is None:
        os.environ.pop(registry.METHOD_PATH_ENV, None)
    else:
        os.environ[registry.METHOD_PATH_ENV] = old
    registry.METHODS.pop("toy_uniform", None)
    registry.CARDS.pop("toy_uniform", None)
    registry._scanned.discard(str(folder))
    sys.modules.pop("pema_methods.toy_uniform", None)


@pytest.fixture(scope="module")
def studio(tmp_path_factory, toy_method):
    st = tiny_studio(tmp_path_factory.mktemp("toy-studio"))
    yield st
    st.close()


def test_the_toy_is_listed_by_plugins_methods(toy_method, capsys):
    from plugins.__main__ import main

    assert main(["methods", "--json"]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[toy_method]["level"] == "output" and rows[toy_method]["decode"] == {"lambda": 0.5}
    assert main(["methods"]) == 0
    assert "Toy uniform smoothing" in capsys.readouterr().out


def test_the_training_form_is_generated_from_the_toys_declarations(studio, toy_method):
    from ui.plugins import form_config, preset_form_values

    m = next(m for m in studio.plugin_service.methods() if m["method"] == toy_method)
    assert [d["name"] for d in m["training_settings"]] == ["seed", "spread"]
    spread = m["training_settings"][1]
    assert (spread["low"], spread["high"], spread["default"]) == (0.0, 4.0, 1.0)
    assert preset_form_values(m, "default") == {"seed": 123, "spread": 1.0}
    assert form_config(m, [7, 2.5]) == {"seed": 7, "spread": 2.5}


def test_the_time_estimate_asks_the_toy(studio, toy_method):
    from plugins.estimate import estimate

    mid = build_tiny_memory(studio, name="toy memory")
    est = studio.plugin_service.training_estimate(mid, toy_method, {"spread": 2.0})
    assert est["measured"] is False and "Toy uniform smoothing was not measured" in est["text"]
    measured = estimate(toy_method, {}, "tiny", 10, 40, table={"tiny": {toy_method: {"setup_s": 1.0}}})
    assert measured["measured"] and measured["text"] == "Nothing to train (40 entries)."


def test_a_trained_toy_is_a_compare_choice_and_decodes(studio, toy_method):
    from ui.common import method_choices

    mid = build_tiny_memory(studio, name="toy pairs")
    job = studio.jobs.wait(studio.plugin_service.submit_train(mid, toy_method, {"spread": 2.0}, "my toy"), 120)
    assert job["state"] == "done", job
    pid = job["result"]["plugin_id"]
    assert (f"my toy [{toy_method}] · translation", pid) in method_choices(studio)  # the label names its task
    p = studio.compare_service.compare("the house is small", methods=["base", pid],
                                       settings={toy_method: {"lambda": 0.0}},
                                       max_new_tokens=4)
    base, toy = p["rows"]
    assert toy["method"] == toy_method and toy["tokens"] == base["tokens"]  # λ 0: the LM's own output
    assert toy["settings"]["lambda"] == 0.0
