"""The plug-in protocol, checked on every registered method alike (tiny model): conformance to exactly its level's
protocol and its declarations (``plugins.base.conformance_problems``: how it mixes, whether it resumes), save/load
round trip, refusal of a foreign
backbone, a batched row equals its own single decode, and the same seed gives the same plug-in."""
from __future__ import annotations

import json

import pytest
import torch

from backbone.prompts import Prompt
from engine import Row, compare
from engine.protocol import DecodeMethod, MixInput, NetworkMethod, OutputMethod
from ground.errors import UserError
from plugins.api import train_plugin
from plugins.base import LEVEL_PROTOCOLS, OutputPlugin, Plugin, conformance_problems, load_plugin
from plugins.registry import available_methods, method_card

METHODS = sorted(available_methods())
PROMPT = Prompt.for_task("translation")


def quick_config(method: str) -> dict:
    return dict(method_card(method).quick_settings)


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


def check_conformance(cls) -> None:
    """The conformance check of a method class (fails naming each protocol member or declaration it gets wrong)."""
    problems = conformance_problems(cls)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_conforms_to_its_levels_protocol(method):
    check_conformance(available_methods()[method])


@pytest.mark.parametrize("method", METHODS)
def test_every_method_offers_exactly_what_the_engine_calls_at_its_level(method, tiny):
    """The engine reads a method through ``engine.protocol``: every method is a ``DecodeMethod`` and fulfils the
    protocol of the way it acts (its level; an in-network one that mixes too is also an ``OutputMethod``), and no
    other level's: an output method is no ``NetworkMethod``, an in-network one no ``PromptMethod``."""
    cls = available_methods()[method]
    plugin = cls(cls.Config(), tiny)
    assert isinstance(plugin, DecodeMethod)
    wanted = {cls.level} | ({"output"} if cls.mixes_output else set())
    for level, protocol in LEVEL_PROTOCOLS.items():
        assert isinstance(plugin, protocol) == (level in wanted), f"{method} ({cls.level!r}) and {protocol.__name__}"


def test_the_conformance_check_sees_another_levels_members_and_missing_ones(tiny):
    """A prompt-level method that also attaches hooks, or an output-level one without ``mix``'s base, is refused."""

    class Prompting(Plugin):  # built here, never registered
        method, level = "prompting", "prompt"

        def row_prompt(self, source, prompt, settings):
            return prompt

    check_conformance(Prompting)

    class Hooking(Prompting):
        def attach(self, rows, settings=None, trace=True):
            return []

    with pytest.raises(AssertionError, match="attach at level 'prompt'"):
        check_conformance(Hooking)

    class Bare(Plugin):
        method, level, interpolates = "bare", "output", True

    with pytest.raises(AssertionError, match="output-level plug-in without .*mix"):
        check_conformance(Bare)


def test_the_engine_protocols_see_a_missing_member():
    """The protocol check fails for an object without a member the engine calls (here ``mix``, ``attach``)."""

    class NoMix:
        method, level, mixes_output, interpolates, fingerprint = "half", "output", False, False, "f"
        leaves_shared_prefix = False

        def settings(self, overrides=None):
            return {}

        def prepare_decode(self):
            pass

        def parameters(self):
            return iter(())

        buffers = parameters
        extra_states = head_vocab = plugin_logprobs = mix_lambdas = distribution_key = settings

    half = NoMix()
    assert isinstance(half, DecodeMethod)
    assert not isinstance(half, OutputMethod) and not isinstance(half, NetworkMethod)
    half.mix = lambda inp: None
    assert isinstance(half, OutputMethod)


@pytest.mark.parametrize("method", METHODS)
def test_a_resumable_method_leaves_its_optimizer_state_after_fit(method, trained):
    plugin, _ = trained(method)
    if type(plugin).resumable:
        assert isinstance(plugin.optimizer_state, dict) and plugin.optimizer_state
    else:
        assert plugin.optimizer_state is None


def test_the_conformance_check_catches_a_method_that_mixes_without_declaring_how(tiny):
    """A new interpolating method that forgets ``interpolates = True`` decodes as the base model (the base ``mix``
    returns P_LM unchanged), so every decode test passes on it; the conformance check refuses it."""

    class Forgetful(OutputPlugin):  # built here, never registered
        method = "forgetful_uniform"
        level = "output"

        def fit(self, memory, progress=None, should_stop=None):
            raise NotImplementedError

        def plugin_logprobs(self, inp):
            n, v = inp.lm_logprobs.shape
            return torch.full((n, v), -float(torch.log(torch.tensor(float(v))))), None

        def mix_lambdas(self, inp):
            return [0.5] * inp.lm_logprobs.shape[0]

    lm = torch.log_softmax(torch.randn(2, tiny.vocab_size), dim=-1)
    inp = MixInput(fc=torch.zeros(2, tiny.hidden_size), lm_logprobs=lm, extra_logits=None, step=0, src_len=[3, 3],
                   settings=[{}, {}])
    assert torch.equal(Forgetful(Plugin.Config(), tiny).mix(inp).logprobs, lm)  # the silent failure
    with pytest.raises(AssertionError, match="interpolates"):
        check_conformance(Forgetful)

    class Declared(Forgetful):
        interpolates = True

    check_conformance(Declared)
    assert not torch.equal(Declared(Plugin.Config(), tiny).mix(inp).logprobs, lm)


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


def test_pema_step_budget_stops_each_phase_at_exactly_max_steps_evaluating_every_n(tiny, tiny_memory, tmp_path):
    """``max_steps`` ends each phase after exactly that many optimizer steps (whatever the epoch limit and the
    machine's speed), with an early-stopping evaluation every ``eval_every`` steps and one at the last step."""
    cfg = {**quick_config("pema"), "batch_size": 2, "max_epochs_rct": 50, "max_epochs_joint": 50,
           "max_steps": 7, "eval_every": 3, "patience": 1000, "stop_rule": "rising"}
    plugin, row = train_plugin(tiny, tiny_memory, "pema", cfg, out_dir=tmp_path / "p")
    info = plugin.train_info
    for phase in ("reconstruction", "joint"):
        assert info[phase]["steps"] == 7 and info[phase]["stopped_by"] == "max_steps"
        evals = [h["step"] for h in row["history"] if h["phase"] == phase and "heldout_loss" in h]
        assert evals == [0, 3, 6, 7]
    assert info["max_steps"] == 7 and info["eval_every"] == 3 and info["stop_rule"] == "rising"
    assert info["early_stop_ce"] > 0


def test_pema_saved_before_the_step_settings_loads_and_decodes_as_before(tiny, trained, tmp_path):
    """A plugin_config.json without ``eval_every`` / ``stop_rule`` / ``max_steps`` / ``normalize_input`` (saved by
    an earlier version) loads with the defaults: epoch-wise early stopping, no step budget, f(c) divided by the
    key RMS — the same weights and the same decode."""
    import shutil

    plugin, path = trained("pema")
    copy = tmp_path / "old"
    shutil.copytree(path, copy)
    meta = json.loads((copy / "plugin_config.json").read_text())
    for key in ("eval_every", "stop_rule", "max_steps", "normalize_input"):
        meta["config"].pop(key)
    (copy / "plugin_config.json").write_text(json.dumps(meta))
    old = load_plugin(copy, tiny)
    assert (old.config.eval_every, old.config.stop_rule, old.config.max_steps, old.config.normalize_input) == \
        (0, "best", 0, True)
    assert old.config == plugin.config and same_state(state(old), state(plugin))
    assert float(old.key_scale) == float(plugin.key_scale) != 1.0
    a = compare(tiny, "the house is small", [Row("p", plugin)], PROMPT, max_new_tokens=6)
    b = compare(tiny, "the house is small", [Row("p", old)], PROMPT, max_new_tokens=6)
    assert a.rows[0].tokens == b.rows[0].tokens


def test_pema_raw_scale_trains_and_decodes_on_the_raw_f_c(tiny, tiny_memory, tmp_path):
    """``normalize_input=false``: trained on the raw f(c) (key_scale 1) and, after a save and load, decoded on it."""
    cfg = {**quick_config("pema"), "normalize_input": False}
    plugin, _ = train_plugin(tiny, tiny_memory, "pema", cfg, out_dir=tmp_path / "p")
    loaded = load_plugin(tmp_path / "p", tiny)
    assert float(plugin.key_scale) == 1.0 == float(loaded.key_scale) and not loaded.config.normalize_input
    fc = torch.from_numpy(tiny_memory.keys[:3].astype("float32")).to(tiny.device)
    with torch.no_grad():
        want = fc @ loaded.A.T @ loaded.B_pd.T * loaded.scaling
        assert torch.allclose(loaded.extra_states(fc, []), want, rtol=1e-5, atol=1e-5)
