"""Declared settings (plugins/settings.py): one declaration per setting drives validation, per-row addressing,
the Compare controls, the CLI's --set and the tuning grids."""
from __future__ import annotations

import csv
import io

import pytest

from ground.errors import UserError
from ground.settings import Setting
from plugins.api import method_table, new_plugin
from plugins.knn import KNN
from plugins.settings import address_sets, decode_grid, parse_sets, resolve_row_settings, row_settings, setting

PROBE = Setting("probe", 2, "a setting added for this test", low=1, high=5, live=True, step=1, grid=(1, 3))


def test_coerce_parses_checks_types_and_ranges():
    k = Setting("k", 16, low=1, high=128)
    assert k.coerce("8") == 8 and k.coerce(8.0) == 8
    for bad in ("x", 0, 129, 2.5, True, None, "1e400"):
        with pytest.raises(UserError, match="'k' must be between 1 and 128"):
            k.coerce(bad, "kNN")
    t = Setting("temperature", 10.0, low=0.0, low_open=True)
    assert t.coerce(3) == 3.0 and isinstance(t.coerce(3), float)
    for bad in (0, float("nan"), float("inf"), "warm"):
        with pytest.raises(UserError):
            t.coerce(bad)
    gu = Setting("gu", True)
    assert gu.coerce("false") is False and gu.coerce(1) is True
    with pytest.raises(UserError):
        gu.coerce("maybe")
    v = Setting("gu_variant", "paper", choices=("paper", "code"))
    with pytest.raises(UserError, match="one of paper, code"):
        v.coerce("other")


def test_config_fields_are_declared_settings_with_types(tiny, tiny_memory):
    from dataclasses import dataclass

    from plugins.base import PluginConfig

    @dataclass
    class ProbeConfig(PluginConfig):
        epochs: int = setting(3, "passes over the memory", low=0, high=100)

    assert ProbeConfig.from_dict({"epochs": "7"}).epochs == 7
    with pytest.raises(UserError, match=r"'epochs' \(passes over the memory\) must be between 0 and 100"):
        ProbeConfig.from_dict({"epochs": 10**9})
    with pytest.raises(UserError, match="'seed' must be an int"):
        ProbeConfig.from_dict({"seed": "x"})
    with pytest.raises(UserError, match="Unknown setting 'rank'"):
        ProbeConfig.from_dict({"rank": 5})


def test_knn_temperature_never_reaches_the_memory_adapter(tiny, tiny_memory):
    """Regression: the kNN temperature slider (10.0) used to be handed to every method with a 'temperature'."""
    from ui.compare import decode_settings_of

    knn = new_plugin("knn", tiny, tiny_memory, {})
    adapter = new_plugin("memory_adapter", tiny, tiny_memory, {})
    own_temperature = adapter.settings().temperature
    assert own_temperature != 10.0
    live_keys = [("pema", "lambda_max"), ("knn", "k"), ("knn", "temperature"), ("knn", "lambda")]
    per_method = decode_settings_of(live_keys, [0.5, 8, 10.0, 0.3], "{}")
    knn_row = row_settings(knn, None, None, resolve_row_settings(("knn", "knn-1", "kNN"), per_method))
    adapter_row = row_settings(adapter, None, None,
                               resolve_row_settings(("memory_adapter", "ma-1", "Memory adapter"), per_method))
    assert knn_row.temperature == 10.0 and knn_row.k == 8
    assert adapter_row.temperature == own_temperature
    # a setting addressed to a method that does not declare it is refused, not ignored
    with pytest.raises(UserError, match="Unknown setting 'k'"):
        adapter.settings({"k": 8})
    # a bare name on the command line is ambiguous when two chosen methods declare it
    with pytest.raises(UserError, match="write METHOD.temperature"):
        address_sets(parse_sets(["temperature=10"]), [("knn-1", KNN), ("ma-1", type(adapter))])
    assert address_sets(parse_sets(["knn.temperature=10"]), [("knn-1", KNN), ("ma-1", type(adapter))]) == \
        {"knn": {"temperature": 10}}


def test_a_new_setting_in_one_declaration_reaches_ui_cli_and_grids(tiny, tiny_memory, monkeypatch, tmp_path):
    """One edit — a Setting in kNN's declaration — and it is validated, addressable from --set, in the tuning grid,
    listed by the method table, and a live control of the Compare tab."""
    import gradio as gr

    from studio.service import Studio
    from ui.app import build_app
    from ui.common import setting_elem_id

    grid_before = decode_grid(KNN)
    monkeypatch.setattr(KNN, "decode_settings", (*KNN.decode_settings, PROBE))
    knn = new_plugin("knn", tiny, tiny_memory, {})
    assert knn.settings().probe == 2 and knn.settings({"probe": "3"}).probe == 3
    with pytest.raises(UserError, match="between 1 and 5"):
        knn.settings({"probe": 9})
    assert address_sets(parse_sets(["probe=4"]), [("knn-1", KNN)]) == {"knn": {"probe": 4}}
    assert len(decode_grid(KNN)) == 2 * len(grid_before) and {g["probe"] for g in decode_grid(KNN)} == {1, 3}
    table = {m["method"]: m for m in method_table()}
    assert "probe" in [d["name"] for d in table["knn"]["decode_settings"]]
    assert "probe" not in [d["name"] for d in table["pema"]["decode_settings"]]
    studio = Studio(tmp_path / "d", backbone="tiny", load=False, start_jobs=False)
    try:
        assert studio.plugin_service.start_settings("translation")["knn"]["probe"] == 2
        demo = build_app(studio)
        ids = {getattr(b, "elem_id", None): b for b in demo.blocks.values()}
        ctl = ids.get(setting_elem_id("knn", "probe"))
        assert isinstance(ctl, gr.Slider) and (ctl.minimum, ctl.maximum, ctl.value) == (1, 5, 2)
    finally:
        studio.close()


def test_every_tuned_default_is_a_declared_setting():
    import json

    from plugins.registry import get_method
    from plugins.settings import TUNED_PATH

    for task, t in json.loads(TUNED_PATH.read_text()).items():
        for bb, entry in t.items():
            for method, values in entry.items():
                cls = get_method(method)
                names = {s.name for s in cls.decode_settings}
                assert set(values) <= names, (task, bb, method, set(values) - names)
                for s in cls.decode_settings:
                    if s.name in values:
                        s.coerce(values[s.name])


def test_evaluation_csv_records_settings_n_and_backbone():
    from studio.evaluate_service import EvaluateService

    result = {"mode": "methods", "pairs": 12, "backbone": "tiny-llama", "data": "held-out split",
              "methods": [{"label": "Base model", "method": "base", "settings": {}, "chrf": 30.0},
                          {"label": "PEMA", "method": "pema", "settings": {"lambda_max": 0.2, "gu": False},
                           "chrf": 31.0}]}
    rows = list(csv.DictReader(io.StringIO(EvaluateService.results_csv(result))))
    assert rows[1]["settings"] == '{"lambda_max": 0.2, "gu": false}'
    assert rows[1]["n"] == "12" and rows[1]["backbone"] == "tiny-llama"


# --- the typed record a row carries (ground.settings.settings_record, plugins.settings.decode_record) ---------------
def test_every_method_gets_a_frozen_typed_record_of_its_declarations():
    import dataclasses

    from plugins.registry import available_methods
    from plugins.settings import decode_record

    for name, cls in available_methods().items():
        record = decode_record(cls)
        assert decode_record(cls) is record, name  # generated once per declaration
        assert {f.name: f.type for f in dataclasses.fields(record)} == \
            {record.attrs[s.name]: s.kind for s in cls.decode_settings}, name
        declared = record()
        assert declared.as_dict() == {s.name: s.default for s in cls.decode_settings}, name
        assert record.from_dict(declared.as_dict()) == declared and hash(record.from_dict({})) == hash(declared)


def test_a_misspelt_setting_fails_where_it_is_written(tiny, tiny_memory):
    import dataclasses

    from plugins.settings import decode_record

    knn = new_plugin("knn", tiny, tiny_memory, {})
    record = decode_record(KNN)
    with pytest.raises(UserError, match="Unknown setting 'lamda' for kNN-LM / kNN-MT; its settings are: k, "
                                        "temperature, lambda"):
        record(lamda=0.5)  # constructing one
    with pytest.raises(UserError, match="Unknown setting 'lamda'"):
        knn.settings({"lamda": 0.5})  # from a form, --set or a request
    with pytest.raises(UserError, match="Unknown setting 'lambda_'"):
        record.from_dict({"lambda_": 0.5})  # at the JSON edge, names as declared only
    s = knn.settings({"lambda": "0.5", "k": 8.0})
    assert (s.k, s.lambda_) == (8, 0.5) and type(s.k) is int and record(lambda_=0.5, k=8) == s
    with pytest.raises(AttributeError, match="KNNSettings has no setting 'lamda'; its settings are: k, temperature, "
                                             "lambda_"):
        s.lamda  # reading one  # noqa: B018
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.k = 3
    with pytest.raises(UserError, match="'k' .* must be between 1 and 1024"):
        s.replace(k=0)
    assert s.replace(k=4).as_dict() == {"k": 4, "temperature": 10.0, "lambda": 0.5}


def test_row_settings_merges_declared_then_tuned_then_calibrated_then_the_callers(tiny, tiny_memory, monkeypatch,
                                                                                  tmp_path):
    """The one place the layers meet: each one overrides the one before, setting by setting, into the record."""
    import json

    from plugins import settings as settings_mod
    from plugins.settings import decode_record

    knn = new_plugin("knn", tiny, tiny_memory, {})
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"translation": {tiny.name: {"knn": {"k": 8, "temperature": 20.0}}}}),
                     encoding="utf-8")
    monkeypatch.setattr(settings_mod, "TUNED_PATH", tuned)
    monkeypatch.setattr(settings_mod, "plugin_calibration", lambda p: {"settings": {"temperature": 30.0,
                                                                                    "lambda": 0.1}})
    declared = decode_record(KNN)()
    assert row_settings(knn, "style", tiny.name, calibrated=False) == declared
    assert row_settings(knn, "translation", tiny.name, calibrated=False) == declared.replace(k=8, temperature=20.0)
    assert row_settings(knn, "translation", tiny.name) == declared.replace(k=8, temperature=30.0, lambda_=0.1)
    assert row_settings(knn, "translation", tiny.name, {"lambda": 0.6, "k": 2}) == \
        declared.replace(k=2, temperature=30.0, lambda_=0.6)


def test_a_row_carries_its_record_to_mix_and_the_comparison_apart(tiny, tiny_memory, monkeypatch):
    from engine import Row, compare
    from plugins.settings import method_row

    knn = new_plugin("knn", tiny, tiny_memory, {})
    knn.fit(tiny_memory)
    row = method_row("kNN", knn, None, None, {"k": 4, "no_repeat_ngram": 2})
    assert row.settings == knn.settings({"k": 4}) and row.comparison == {"no_repeat_ngram": 2}
    with pytest.raises(UserError, match="Unknown setting 'no_repeat_ngram'"):
        row_settings(knn, None, None, {"no_repeat_ngram": 2})  # not a method's setting
    seen = []
    real_mix = knn.mix
    monkeypatch.setattr(knn, "mix", lambda inp: seen.append(list(inp.settings)) or real_mix(inp))
    res = compare(tiny, "the house is small", [Row("base"), row], max_new_tokens=3)
    assert seen and all(s == [row.settings] for s in seen)  # the row's own record, step after step
    assert res.rows[1].settings == {"k": 4, "temperature": 10.0, "lambda": 0.3, "no_repeat_ngram": 2}
