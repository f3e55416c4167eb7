"""Settings declared once: every method declares its decode-time settings (``Plugin.decode_settings``) and its
training settings (the fields of its ``Config``, with ``setting(...)`` metadata) as :class:`Setting` objects.

Everything else is generated from the declarations: the Compare tab's live controls and the Evaluate tab's
settings, the hyperparameter form, ``--set`` on the command lines, the tuning grids of ``eval.quality`` and
``eval.likelihood``, and validation (types and ranges). A knob is always addressed to one row — by method name,
plug-in id or row label — never by a bare name shared across methods (``resolve_row_settings``).

A row's complete decode settings are a frozen, typed record generated from the method's declarations
(``decode_record``: ``PEMASettings(lambda_max=0.8, gu=True, …)``), made in one place — declared ← tuned ← calibrated
← the caller's (``row_settings``) — and carried by the row (``method_row``) to the method's ``mix`` and hooks, which
read attributes. Plain dicts only at the edges (JSON, forms, ``--set``).

Adding a decode setting to a method is one edit: a ``Setting`` in its ``decode_settings``.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from engine.comparison import COMPARISON_NAMES, comparison_settings, split_comparison
from engine.results import Row
from ground.errors import UserError
from ground.settings import Setting, SettingsRecord, coerce_all, settings_record
from ground.store import write_json_atomic

ALL_ROWS = "all"  # the settings key that addresses every row of a comparison (``engine.comparison``)


def setting(default: Any, help: str = "", **kw) -> Any:
    """A dataclass field of a method's ``Config`` that declares a training setting (``Setting``'s keywords)."""
    return dataclasses.field(default=default, metadata={"setting": dict(help=help, **kw)})


def config_settings(config_cls) -> list[Setting]:
    """The training settings a ``Config`` dataclass declares (every field; help and range from its metadata)."""
    out = []
    for f in dataclasses.fields(config_cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        kind = _SIMPLE_TYPES.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        out.append(Setting(f.name, default, type=kind, **f.metadata.get("setting", {})))
    return out


_SIMPLE_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def decode_record(method_cls) -> type[SettingsRecord]:
    """The frozen, typed record of a method's declared decode settings (``Plugin.decode_settings``), generated once
    per declaration: ``PEMASettings``, ``KNNSettings``, …"""
    name = f"{method_cls.__name__}Settings"
    return settings_record(name, tuple(method_cls.decode_settings), str(getattr(method_cls, "title", "") or name))


@dataclass(frozen=True)
class Preset:
    """A named set of training-setting values declared beside a method's ``Config`` (its ``PRESETS``): ``values``
    override the shipped defaults; ``about`` says where they come from (a paper, its public code, a quick try)."""

    values: dict
    about: str = ""


DEFAULT_PRESET = "default"  # the shipped defaults: every method has it, with no values of its own


def config_presets(config_cls) -> dict[str, Preset]:
    """A ``Config``'s presets by name: "default" (the shipped values) first, then the ones it declares in
    ``PRESETS`` (e.g. "paper", "quick"); each preset's values are checked against the declarations."""
    out = {DEFAULT_PRESET: Preset({}, "the shipped defaults")}
    for name, p in (getattr(config_cls, "PRESETS", None) or {}).items():
        out[name] = p if isinstance(p, Preset) else Preset(dict(p))
    return out


def presets_table(config_cls) -> dict[str, dict]:
    """A ``Config``'s presets as JSON-able ``{name: {"values", "about"}}`` (for UIs and ``plugins methods``)."""
    return {name: {"values": preset_values(config_cls, name), "about": p.about}
            for name, p in config_presets(config_cls).items()}


def preset_values(config_cls, name: str | None) -> dict:
    """The values of preset ``name`` of a ``Config`` (``{}`` for None or "default"), checked against its
    declarations; an unknown name is a UserError listing the known ones."""
    if not name or name == DEFAULT_PRESET:
        return {}
    presets = config_presets(config_cls)
    if name not in presets:
        raise UserError(f"Unknown preset {name!r} for {config_cls.__name__}; its presets are: "
                        f"{', '.join(presets)}.")
    return coerce_all(config_settings(config_cls), dict(presets[name].values),
                      f"{config_cls.__name__} preset {name}")


def parse_sets(items: list[str] | None) -> dict:
    """``key=value`` pairs from a command line; values parsed as JSON when they can be (numbers, true/false),
    else kept as strings (the declarations convert them)."""
    out = {}
    for it in items or []:
        if "=" not in it:
            raise UserError(f"--set expects key=value, got {it!r}.")
        k, v = it.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except (json.JSONDecodeError, ValueError, RecursionError):
            out[k.strip()] = v
    return out


def address_sets(sets: dict, rows: list[tuple[str, type]]) -> dict[str, dict]:
    """Turn command-line ``--set`` pairs into per-row settings.

    ``rows``: (row key, method class) for every plug-in row (the key is a method name, plug-in id or label).
    ``KEY.NAME=V`` addresses the rows whose method, id or label is KEY. A bare ``NAME=V`` is accepted only when
    exactly one method among the rows declares NAME (it is then addressed to that method); otherwise the error
    says to write ``method.NAME``.
    """
    out: dict[str, dict] = {}
    methods = {cls.method: cls for _k, cls in rows}
    keys = {k for k, _cls in rows} | set(methods)
    for name, value in sets.items():
        target, dot, rest = name.partition(".")
        if name in COMPARISON_NAMES or (target == ALL_ROWS and rest in COMPARISON_NAMES):
            out.setdefault(ALL_ROWS, {})[rest if target == ALL_ROWS else name] = value  # every row alike
            continue
        if dot and target in keys:
            out.setdefault(target, {})[rest] = value
            continue
        owners = [m for m, cls in methods.items() if any(s.name == name for s in cls.decode_settings)]
        if len(owners) != 1:
            where = f"methods {', '.join(owners)} all have" if owners else "no chosen method has"
            raise UserError(f"--set {name}: {where} a setting {name!r}; write METHOD.{name}=VALUE "
                            f"(methods here: {', '.join(methods) or 'none'}).")
        out.setdefault(owners[0], {})[name] = value
    return out


def resolve_row_settings(key_chain: Iterable[str], per_row: dict | None) -> dict:
    """One row's overrides from ``per_row`` ({method | plug-in id | label: {name: value}}), the more specific key
    last: ``key_chain`` is (method, plug-in id, label). The ``ALL_ROWS`` block (comparison settings only) comes
    first, for every row."""
    out: dict = {}
    every = (per_row or {}).get(ALL_ROWS)
    if every is not None:
        if not isinstance(every, dict):
            raise UserError(f"The settings for {ALL_ROWS!r} must be an object of name: value pairs.")
        other = sorted(set(every) - COMPARISON_NAMES)
        if other:
            raise UserError(f"Only settings of the whole comparison ({', '.join(sorted(COMPARISON_NAMES))}) can "
                            f"be given to {ALL_ROWS!r}; address {', '.join(other)} to a method instead.")
        out.update(every)
    for key in key_chain:
        block = (per_row or {}).get(key)
        if isinstance(block, dict):
            out.update(block)
        elif block is not None:
            raise UserError(f"The settings for {key!r} must be an object of name: value pairs.")
    return out


# The decode settings tuned on dev data per task, backbone and method ({task: {backbone: {method: {name: value}}}}),
# written by ``python -m eval.quality --save-defaults``; a row starts from them (``row_settings``).
TUNED_PATH = Path(__file__).with_name("tuned_defaults.json")


def _tuned_table() -> dict:
    return json.loads(TUNED_PATH.read_text(encoding="utf-8")) if TUNED_PATH.exists() else {}


def tuned_decode_settings(method: str, task: str | None, backbone_name: str | None) -> dict:
    """The decode settings tuned on dev data for ``method`` on ``task`` and this backbone (may be empty)."""
    if not task or not backbone_name:
        return {}
    return dict(_tuned_table().get(task, {}).get(backbone_name, {}).get(method, {}))


def save_tuned_decode_settings(task: str, backbone_name: str, decode: dict[str, dict]) -> None:
    """Make ``decode`` ({method: {name: value}}) where rows of ``task`` on this backbone start (replaces that
    backbone's entry of the task, keeps the others)."""
    data = _tuned_table()
    data.setdefault(task, {})[backbone_name] = {m: dict(v) for m, v in decode.items() if v}
    write_json_atomic(TUNED_PATH, data)


def tuned_start_changes(declared: dict, starts: dict[str, dict]) -> dict[str, dict]:
    """Per task, the settings whose start value (``starts``: {task: {name: value}}, e.g. declared ← tuned) differs
    from the declared default (``declared``: {name: default}) — what a listing of the declared defaults must add so
    that it never disagrees silently with where a comparison starts (the Plug-ins tab, ``python -m plugins
    methods``)."""
    out = {}
    for task, values in starts.items():
        changed = {k: v for k, v in values.items() if k in declared and v != declared[k]}
        if changed:
            out[task] = changed
    return out


def describe_changes(changes: dict[str, dict]) -> str:
    """``tuned_start_changes`` in one line: "translation: lambda_max=0.2, gu=False; style: …"."""
    return "; ".join(f"{task}: " + ", ".join(f"{k}={v}" for k, v in vals.items()) for task, vals in changes.items())


def row_settings(plugin, task: str | None, backbone_name: str | None, overrides: dict | None = None,
                 calibrated: bool = True) -> SettingsRecord:
    """A row's complete decode settings, the method's typed record (``decode_record``): the declared defaults
    (``plugin.settings`` starts there) ← tuned on dev data for (task, backbone) ← calibrated on the plug-in's own
    memory (its ``calibration.json``; skipped with ``calibrated=False``: the global defaults) ← the caller's
    ``overrides`` (a form, ``--set``, a request) — checked against the method's declarations. The one place where
    defaults are merged (Compare, Evaluate, CLIs, eval); settings of the whole comparison are not a method's
    (``method_row`` takes them apart)."""
    tuned = tuned_decode_settings(plugin.method, task, backbone_name)
    cal = plugin_calibration(plugin) if calibrated else None
    own = dict(overrides or {})
    return plugin.settings({**tuned, **(cal or {}).get("settings", {}), **own})


def start_record(method_cls, task: str | None, backbone_name: str | None) -> SettingsRecord:
    """A method's decode settings as a comparison of ``task`` on ``backbone_name`` starts them before a plug-in is
    chosen (the controls' starting values): the first two layers of ``row_settings``, declared ← tuned on dev data."""
    return decode_record(method_cls).from_dict(tuned_decode_settings(method_cls.method, task, backbone_name))


def method_row(label: str, plugin, task: str | None, backbone_name: str | None, overrides: dict | None = None,
               calibrated: bool = True) -> Row:
    """A comparison's row for ``plugin`` (None: the base model, which has no settings of its own) from the caller's
    ``overrides`` for it (``resolve_row_settings``): the method's settings record (``row_settings``) and, apart, the
    settings of the whole comparison among the overrides (checked; the batch applies them to every row alike)."""
    comparison, own = split_comparison(overrides)
    if plugin is None:
        return Row(label, None, comparison=comparison_settings(comparison))
    return Row(label, plugin, row_settings(plugin, task, backbone_name, own, calibrated),
               comparison_settings(comparison))


# --- per-memory calibration (written by ``eval.calibrate``) -------------------------------------------------------
CALIBRATION_FILE = "calibration.json"  # in the plug-in's folder, beside its weights
# the rule a stored calibration was chosen by (``eval.calibrate``: a setting leaves the global start only on
# Holm-adjusted paired-bootstrap evidence); one chosen by an earlier rule is not used
CALIBRATION_RULE = "evidence-holm-1"


def load_calibration(plugin_folder) -> dict | None:
    """The calibration stored in a plug-in's folder, or None: none there, unreadable or malformed JSON, or made for
    other weights (the weight file's checksum it records differs from the one ``plugin_config.json`` records now —
    a plug-in trained again in place is not calibrated), or chosen by another rule than ``CALIBRATION_RULE``."""
    from pathlib import Path

    if plugin_folder is None:
        return None
    folder = Path(plugin_folder)
    try:
        cal = json.loads((folder / CALIBRATION_FILE).read_text(encoding="utf-8"))
        cfg = json.loads((folder / "plugin_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not (isinstance(cal, dict) and isinstance(cal.get("settings"), dict) and isinstance(cal.get("n"), int)
            and isinstance(cal.get("table"), list) and isinstance(cfg, dict)):
        return None
    if cal.get("weights_sha256") != _weights_sha(cfg) or cal.get("rule") != CALIBRATION_RULE:
        return None
    return cal


def _weights_sha(plugin_config: dict) -> str | None:
    files = plugin_config.get("files") if isinstance(plugin_config, dict) else None
    rec = files.get("plugin_model.safetensors") if isinstance(files, dict) else None
    return rec.get("sha256") if isinstance(rec, dict) else None


def plugin_calibration(plugin) -> dict | None:
    """A loaded plug-in's calibration (``load_calibration`` of its folder) when it was made on this plug-in's
    backbone (one that does not say which is not used) and its settings pass the method's declarations; else None."""
    cal = load_calibration(getattr(plugin, "plugin_path", None))
    if cal is None or cal.get("backbone") != plugin.backbone_name:
        return None
    try:
        plugin.settings(cal["settings"])
    except UserError:
        return None
    return cal


# A calibration on fewer tuning samples than this says so in its label: on Gemma, kNN tuned on 14 held-out WMT samples
# gained there and lost on 200 WMT dev items (BENCHMARKS.md, "Starts, presets and calibration, checked on WMT dev
# items", row "per-memory calibration").
FEW_TUNING_SAMPLES = 30


def calibration_label(cal: dict | None) -> str:
    """The line a calibrated start is shown with: "tuned on 40 held-out samples of wmt300", and for fewer than
    ``FEW_TUNING_SAMPLES`` "… (few samples: a rough guide)"; "" without one."""
    if not cal:
        return ""
    few = " (few samples: a rough guide)" if int(cal["n"]) < FEW_TUNING_SAMPLES else ""
    return f"tuned on {cal['n']} held-out samples of {cal.get('memory') or 'its memory'}{few}"


def decode_grid(cls, fine: bool = False) -> list[dict]:
    """The tuning grid of a method: the product of its declared settings' grid values ([{}] when none)."""
    axes = [(s.name, (s.fine_grid or s.grid) if fine else s.grid) for s in cls.decode_settings]
    axes = [(n, vals) for n, vals in axes if vals]
    if not axes:
        return [{}]
    return [dict(zip([n for n, _ in axes], combo)) for combo in itertools.product(*[v for _, v in axes])]
