"""The plug-in protocol shared by every method (in the spirit of PEFT's tuners: one config + one module each).

A plug-in is trained from a memory (``fit``), saved as ``plugin_config.json`` + ``plugin_model.safetensors``
(never pickle), loaded back only onto the backbone it was made for (``Plugin``), and acts at decode time in one
of three ways, each one protocol of ``engine.protocol``:

* **output-level** (PEMA, kNN; ``OutputPlugin``): ``extra_states`` may return pre-norm states to be projected
  through the frozen norm + LM head *in the same matrix product* as the backbone's own f(c) (the head's weight
  traffic dominates a CPU decoding step); ``mix`` then turns the step's LM log-probabilities of its rows into the
  final ones.
* **in-network** (adapters, memory-tuning, LoRA, ...; ``plugins.network.NetworkPlugin``): ``attach(rows)`` registers
  forward hooks that change the hidden states of *its own batch rows only*, so several methods share one batched
  forward pass.
* **prompt-level** (retrieved in-context examples): ``row_prompt`` gives the row a prompt of its own.

``conformance_problems`` checks that a method class offers exactly its level's protocol.

Saved plug-ins are checked on load: ``plugin_config.json`` lists the sha256 of its weight file (``files``) and the
kNN plug-in the sha256 of its FAISS index; a mismatch, a truncated or unreadable file, NaN/inf weights (refused on
save too), a path that leaves its place (a plug-in in a data directory may only read that directory's memories; file
names are plain names; see ``check_plugin_paths``) — each is one UserError naming the plug-in's folder, and
nothing is written.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Protocol

import torch
from torch import nn

from engine.protocol import DecodeMethod, MixInput, MixOutput, NetworkMethod, OutputMethod, PromptMethod, mix_logprobs
from ground.errors import UserError
from ground.lock import writer_tag
from ground.settings import Setting, SettingsRecord, coerce_all
from ground.store import atomic_dir, write_json_atomic
from plugins.registry import get_method
from plugins.settings import config_settings, decode_record

Progress = Callable[[float, str], None]
ShouldStop = Callable[[], bool]
FORMAT_VERSION = 1
WEIGHTS_FILE = "plugin_model.safetensors"


def _noop(*a) -> None:
    pass


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [k for k, v in tensors.items() if v.is_floating_point() and v.numel() and not torch.isfinite(v).all()]


def plain_file_name(name, what: str, where: Path) -> str:
    """``name`` if it is a plain file name (no folder, no ``..``), else the UserError of a damaged plug-in."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name:
        raise UserError(f"The plug-in at {where} is damaged: {what} {str(name)[:80]!r} is not a plain file name.")
    return name


@dataclass
class PluginConfig:
    """Base of every method's config: JSON round trip and validation hooks."""

    seed: int = 123

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PluginConfig":
        """A config from JSON-like values, each checked against its declaration (type, range; unknown names
        refused), then the method's own cross-field ``validate``."""
        if not isinstance(d, dict):
            raise UserError(f"The settings of {cls.__name__} must be an object of name: value pairs.")
        cfg = cls(**coerce_all(config_settings(cls), d, cls.__name__))
        cfg.validate()
        return cfg

    @classmethod
    def declared(cls) -> list[Setting]:
        """The training settings this config declares (``plugins.settings.setting`` metadata on its fields)."""
        return config_settings(cls)

    def validate(self) -> None:
        """Raise UserError for a bad value: every field against its declaration (type, range, choices), so that a
        config built in code is checked like one read from JSON. Subclasses add the checks a single declaration
        cannot say (several fields, a stricter bound, a syntax) after ``super().validate()``."""
        for s in config_settings(type(self)):
            s.coerce(getattr(self, s.name), type(self).__name__)

    @staticmethod
    def _check(cond: bool, msg: str) -> None:
        if not cond:
            raise UserError(msg)


class TrainingHistory(list):
    """A plug-in's training history: structured points (``{"phase", "step", "epoch", "loss" | "heldout_loss",
    ...}``). Each appended point is also handed to ``on_point`` — a job's live loss curve — so nobody has to parse
    progress text for it."""

    def __init__(self, on_point: Callable[[dict], None] | None = None):
        super().__init__()
        self.on_point = on_point

    def append(self, point: dict) -> None:
        super().append(point)
        if self.on_point is not None:
            self.on_point(dict(point))


@dataclass
class FitResult:
    metrics: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # one row per logged step: {"step","phase","loss",...}


class Plugin(nn.Module):
    """Base of every method: its config, ``fit``, save and load, and what the engine reads of every method alike
    (``engine.protocol.DecodeMethod``: name, level, settings, ``prepare_decode``). Subclasses set ``method``,
    ``title``, ``Config``, ``level``, ``decode_settings`` and implement ``fit``.

    How a method acts at decode time comes from the base of its level, each fulfilling one protocol of
    ``engine.protocol``: ``OutputPlugin`` (below; ``OutputMethod``) mixes the output distribution,
    ``plugins.network.NetworkPlugin`` (``NetworkMethod``) attaches inside the network, and a prompt-level method
    subclasses ``Plugin`` and defines ``row_prompt`` (``PromptMethod``). What the studio, the time estimate and the
    model card know of a method besides is its card (``plugins.card.MethodCard``), registered with the class
    (``@register(CARD)``).

    The declarations (class attributes read by the decode, the tuners and the studio; never looked up with a default
    elsewhere) are checked for every registered method by ``conformance_problems`` (tests/test_methods.py), with
    the protocol of its level:

    - ``interpolates``: how an output plug-in mixes. True: ``mix`` is λ_t·P_plugin + (1−λ_t)·P_LM from
      ``plugin_logprobs`` and ``mix_lambdas`` (the slider moves, the likelihood tuner and calibration rely on it).
      False: the plug-in's own ``mix`` says how. A class that defines ``plugin_logprobs`` or ``mix_lambdas``
      without declaring it would have ``OutputPlugin.mix`` return P_LM unchanged: refused.
    - ``mixes_output``: an in-network plug-in whose ``mix`` also runs after the LM head (it is an ``OutputPlugin``
      too).
    - ``resumable``: training can continue from a saved plug-in: ``fit`` then fills ``optimizer_state`` (saved by
      the studio as ``optimizer.safetensors``) and honours ``resume_state`` (set before ``fit`` from that file).
    """

    method: ClassVar[str] = ""
    title: ClassVar[str] = ""
    Config: ClassVar[type[PluginConfig]] = PluginConfig
    level: ClassVar[str] = ""  # "output" (``OutputPlugin``) | "network" (``NetworkPlugin``) | "prompt" (``row_prompt``)
    decode_settings: ClassVar[tuple[Setting, ...]] = ()  # declared once; UIs, CLIs and tuners are generated
    needs_memory_at_decode: ClassVar[bool] = False
    mixes_output: ClassVar[bool] = False  # an in-network plug-in whose ``mix`` also runs after the LM head
    interpolates: ClassVar[bool] = False  # ``mix`` is λ_t·P_plugin + (1−λ_t)·P_LM (see the class docstring)
    # Training continues from a saved plug-in (the studio's "continue training"; see the class docstring).
    resumable: ClassVar[bool] = False
    # A resumable plug-in's optimizer state after ``fit`` (``plugins.training.optimizer_state``), else None.
    optimizer_state: dict | None = None
    # Set before ``fit`` to continue training from a saved optimizer state (``training.optimizer_from_tensors``).
    resume_state: dict | None = None
    # The folder it was saved to or loaded from (``load_plugin``, ``plugins.api.train_plugin``); None: never saved.
    plugin_path: Path | None = None

    def __init__(self, config: PluginConfig, backbone, memory_meta: dict | None = None):
        super().__init__()
        self.config = config
        self.backbone_name = backbone.name
        self.fingerprint = backbone.fingerprint
        self.memory_meta = dict(memory_meta or {})
        self.train_info: dict = {}
        self.on_metric: Callable[[dict], None] | None = None  # receives each training-history point as it is made
        self._backbone = [backbone]  # a list, so nn.Module does not register the frozen model as a child

    @property
    def backbone(self):
        return self._backbone[0]

    # --- training ---------------------------------------------------------------------------------
    def fit(self, memory, progress: Progress = _noop, should_stop: ShouldStop = lambda: False) -> FitResult:
        raise NotImplementedError

    def new_history(self) -> TrainingHistory:
        """The list ``fit`` records its training points in (reported live to ``on_metric``)."""
        return TrainingHistory(self.on_metric)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # --- decoding ---------------------------------------------------------------------------------
    @property
    def decode_defaults(self) -> dict:
        """The declared decode settings' defaults (before any tuned value; see ``plugins.settings.row_settings``)."""
        return {s.name: s.default for s in self.decode_settings}

    def settings(self, overrides: dict | SettingsRecord | None = None) -> SettingsRecord:
        """This plug-in's complete decode settings, its method's typed record (``plugins.settings.decode_record``):
        the declared defaults with ``overrides`` (a record of this method's, or ``{name: value}``) checked against
        the declarations (an unknown name, a wrong type or a value out of range is a UserError naming it)."""
        record = decode_record(type(self))
        if not isinstance(overrides, record):
            given = overrides.as_dict() if isinstance(overrides, SettingsRecord) else dict(overrides or {})
            overrides = record.from_dict({**self.decode_defaults, **given})
        self.validate_settings(overrides)
        return overrides

    def validate_settings(self, s: SettingsRecord) -> None:
        """Checks that involve several settings at once (single values are checked by their declarations)."""

    def prepare_decode(self) -> None:
        """Called once before decoding (e.g. to move weights or build a search index)."""
        self.to_backbone()

    # --- persistence ------------------------------------------------------------------------------
    def extra_config(self) -> dict:
        """Anything besides the config that ``load`` needs (e.g. the memory it reads at decode time)."""
        return {}

    def save_extra_files(self, folder: Path) -> list[str]:
        """Write files besides the studio's own into the folder being saved (e.g. PEFT's ``adapter_config.json``
        + ``adapter_model.safetensors`` for LoRA, so the saved folder loads with ``PeftModel.from_pretrained``);
        return their plain names. ``save`` lists them with their sha256 under ``files``, so ``load_plugin``
        refuses a folder where one was changed. Default: none."""
        return []

    def save(self, out_dir: str | Path, publish=None) -> Path:
        """Write ``plugin_config.json`` (with the sha256 of the weight file and of ``save_extra_files``' files, and
        who wrote it) and the safetensors atomically (``atomic_dir``; ``publish``: its catalog step). NaN/inf
        weights are refused: nothing is saved."""
        from safetensors.torch import save_file  # heavy: optional at import time

        out_dir = Path(out_dir)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        bad = nonfinite_tensors(tensors)
        if bad:
            raise UserError(f"Training {self.title or self.method} diverged: {', '.join(bad[:3])} hold NaN or "
                            f"infinite values, so nothing was saved. Try a lower learning rate.")
        with atomic_dir(out_dir, publish) as tmp:
            save_file(tensors, str(tmp / WEIGHTS_FILE))
            names = [WEIGHTS_FILE]
            for name in self.save_extra_files(tmp):
                if plain_file_name(name, "the extra file", tmp) in names or name == "plugin_config.json":
                    raise ValueError(f"{type(self).__name__}.save_extra_files wrote {name!r} twice or over the "
                                     f"studio's own files")
                names.append(name)
            write_json_atomic(tmp / "plugin_config.json", {
                "format_version": FORMAT_VERSION, "method": self.method, "config": self.config.to_dict(),
                "backbone": self.backbone_name, "fingerprint": self.fingerprint, "memory": self.memory_meta,
                "train_info": self.train_info, "trainable_parameters": self.trainable_parameters(),
                "extra": self.extra_config(), "saved": time.time(),
                "files": {n: {"sha256": file_sha256(tmp / n), "bytes": (tmp / n).stat().st_size} for n in names},
                "writer": writer_tag()})
        return out_dir

    @classmethod
    def build_for_load(cls, config: PluginConfig, backbone, memory_meta: dict, extra: dict,
                       tensors: dict[str, torch.Tensor]) -> "Plugin":
        """Create an empty instance whose parameters have the shapes in ``tensors`` (override if needed)."""
        return cls(config, backbone, memory_meta)

    def to_backbone(self) -> "Plugin":
        """Put the weights where the backbone is (a no-op when they are there already)."""
        dev = self.backbone.device
        # the first tensor only (called at every decode step's attach, where building a state_dict is not free)
        t = next(itertools.chain(self.parameters(), self.buffers()), None)
        return self if t is None or t.device == dev else self.to(device=dev)


class OutputPlugin(Plugin):
    """Base of the output-level plug-ins (``engine.protocol.OutputMethod``; PEMA, kNN), and of an in-network one that
    also mixes (``mixes_output``). ``extra_states`` may return pre-norm states to be projected through the frozen
    norm + LM head *in the same matrix product* as the backbone's own f(c) (the head's weight traffic dominates a
    CPU decoding step); ``mix`` then turns the step's LM log-probabilities of its rows into the final ones.

    Plug-ins that *interpolate* (PEMA, kNN-LM/MT: P = λ_t·P_plugin + (1−λ_t)·P_LM) set ``interpolates`` and
    implement ``plugin_logprobs`` and ``mix_lambdas``; the base ``mix`` combines them. The split lets a scorer
    evaluate many λ settings on the same states while computing P_plugin once per ``distribution_key``
    (eval.likelihood)."""

    level = "output"

    def extra_states(self, fc: torch.Tensor, settings: list[SettingsRecord]) -> torch.Tensor | None:
        return None

    def head_vocab(self) -> torch.Tensor | None:
        """Token ids the extra states' logits are needed for (others are −inf), or None for all of them. A
        restricted vocabulary lets the decode project those states through only these rows of the LM head."""
        return None

    def mix(self, inp: MixInput) -> MixOutput:
        if not self.interpolates:
            return MixOutput(logprobs=inp.lm_logprobs)
        plp, extras = self.plugin_logprobs(inp)
        lams = self.mix_lambdas(inp)
        out = mix_logprobs(inp.lm_logprobs, plp, torch.tensor(lams), support=self.plugin_support(len(plp)))
        return MixOutput(logprobs=out, plugin_logprobs=plp, lam=lams, extras=extras)

    def plugin_support(self, n: int) -> torch.Tensor | None:
        """Interpolating plug-ins whose P_plugin is zero outside a fixed set of tokens (PEMA restricted to its
        candidate vocabulary): those token ids for ``n`` rows, (n, s), so that ``mix`` mixes only those columns
        (``mix_logprobs(support=)``: the same result); None: every token may have mass."""
        return None

    def plugin_logprobs(self, inp: MixInput) -> tuple[torch.Tensor, list[dict] | None]:
        """Interpolating plug-ins: log P_plugin (n, V) of the rows, and per-row trace extras (or None)."""
        raise NotImplementedError

    def mix_lambdas(self, inp: MixInput) -> list[float]:
        """Interpolating plug-ins: λ_t of every row at this step."""
        raise NotImplementedError

    def distribution_key(self, settings: SettingsRecord) -> tuple:
        """The part of a row's settings that changes P_plugin (the rest changes only λ_t): rows with the same key
        share one ``plugin_logprobs``. Default: all of them."""
        return (settings,)


LEVELS = ("output", "network", "prompt", "none")
LEVEL_PROTOCOLS = {"output": OutputMethod, "network": NetworkMethod, "prompt": PromptMethod}


def protocol_members(protocol: type) -> set[str]:
    """The members one of ``engine.protocol``'s protocols asks for, its bases' included."""
    out: set[str] = set()
    for base in protocol.__mro__:
        if getattr(base, "_is_protocol", False) and base is not Protocol:
            out |= {n for n in (*vars(base), *getattr(base, "__annotations__", {})) if not n.startswith("_")}
    return out


def _level_members(protocol: type) -> list[str]:
    """What ``protocol`` adds to ``DecodeMethod`` (the members of one way of acting), in name order."""
    return sorted(protocol_members(protocol) - protocol_members(DecodeMethod))


def _overrides(cls: type, name: str) -> bool:
    """Whether ``cls`` defines ``OutputPlugin.<name>`` itself (or in a base below ``OutputPlugin``)."""
    return getattr(cls, name, None) is not getattr(OutputPlugin, name)


def conformance_problems(cls: type) -> list[str]:
    """How a method class fails its level's protocol (``engine.protocol``: exactly the members the engine calls on
    rows of that level — an in-network one that ``mixes_output`` is an ``OutputMethod`` too — and none of another
    level's) or declares wrongly (the declarations of ``Plugin``'s docstring); empty when it conforms. A class that
    mixes without saying how (``plugin_logprobs`` / ``mix_lambdas`` without ``interpolates``) would decode as the
    base model and pass every other test."""
    name = cls.__name__
    if not (isinstance(cls, type) and issubclass(cls, Plugin)):
        return [f"{name} is not a Plugin subclass"]
    out = []
    if not cls.method:
        out.append(f"{name} declares no ``method`` name")
    if cls.level not in LEVELS:
        out.append(f"{name}.level is {cls.level!r}, not one of {', '.join(LEVELS)}")
    wanted = {cls.level} | ({"output"} if cls.mixes_output else set())
    for level, protocol in LEVEL_PROTOCOLS.items():
        members = _level_members(protocol)
        if level in wanted:
            missing = [m for m in members if not hasattr(cls, m)]
            if missing:
                out.append(f"{name} is a {level}-level plug-in without {', '.join(missing)} "
                           f"(engine.protocol.{protocol.__name__})")
        else:
            extra = [m for m in members if hasattr(cls, m)]
            if extra:
                out.append(f"{name} defines {', '.join(extra)} at level {cls.level!r}: the engine calls them only on "
                           f"{level}-level rows ({protocol.__name__})")
    mixes = "output" in wanted and issubclass(cls, OutputPlugin)
    parts = [m for m in ("plugin_logprobs", "mix_lambdas") if mixes and _overrides(cls, m)]
    if cls.interpolates:
        missing = [m for m in ("plugin_logprobs", "mix_lambdas") if m not in parts]
        if missing:
            out.append(f"{name} declares interpolates = True but does not define {' and '.join(missing)}")
        if "output" not in wanted:
            out.append(f"{name} declares interpolates = True at level {cls.level!r}: only output-level plug-ins "
                       f"(or in-network ones with mixes_output) are mixed")
    elif parts and not _overrides(cls, "mix"):
        out.append(f"{name} defines {' and '.join(parts)} but neither declares interpolates = True nor defines "
                   f"its own mix: the base mix would return P_LM unchanged (the base model's tokens)")
    if mixes and not (cls.interpolates or _overrides(cls, "mix")):
        what = "declares mixes_output = True" if cls.mixes_output else "is an output-level plug-in"
        out.append(f"{name} {what} but does not mix: declare interpolates = True (with plugin_logprobs and "
                   f"mix_lambdas) or define mix")
    if not isinstance(cls.resumable, bool) or not isinstance(cls.interpolates, bool):
        out.append(f"{name}.resumable and {name}.interpolates must be True or False")
    return out


def _damaged(path: Path, what: str) -> UserError:
    return UserError(f"The plug-in at {path} is damaged: {what}. Train it again.")


def _data_root(plugin_dir: Path) -> Path | None:
    """The data directory a plug-in folder lives in (``<root>/plugins/<id>`` beside ``<root>/studio.db``)."""
    parent = plugin_dir.parent
    if parent.name == "plugins" and (parent.parent / "studio.db").is_file():
        return parent.parent
    return None


def check_plugin_paths(path: Path, meta: dict) -> None:
    """Every path a saved config names stays where it belongs: file names are plain names (inside the plug-in's
    folder, or the memory's for a FAISS index); the memory path is absolute without ``..``, and when it points into
    the plug-in's data directory it must be one of its memories (``<root>/memories/<id>``) — never a plug-in, the
    catalog or a backbone. (A memory outside any data directory — a folder given to the CLI — stays allowed; the
    kNN plug-in then checks that it is a memory built on the same backbone.)"""
    plugin_dir = path.resolve()
    for name in meta.get("files") or {}:
        plain_file_name(name, "the file", path)
    index = (meta.get("extra") or {}).get("index")
    if index is not None:
        if not isinstance(index, dict):
            raise _damaged(path, "its index record is not an object")
        plain_file_name(index.get("file"), "the index file", path)
    mpath = (meta.get("memory") or {}).get("path")
    if mpath is None:
        return
    if not isinstance(mpath, str) or not mpath or "\x00" in mpath:
        raise _damaged(path, "its memory path is not a path")
    if not Path(mpath).is_absolute() or ".." in Path(mpath).parts:
        raise _damaged(path, f"its memory path {mpath[:200]!r} is relative or climbs out with '..'")
    root = _data_root(plugin_dir)
    if root is not None:
        target, root = Path(mpath).resolve(), root.resolve()
        if target.is_relative_to(root) and target.parent != root / "memories":
            raise _damaged(path, f"its memory path {mpath[:200]!r} points into the data directory but not at one of "
                                 f"its memories")


def own_memory(path: Path, memory: dict) -> dict:
    """A plug-in inside a data directory reads its memory from that directory: a saved memory path that points into
    another data directory (this one was copied or restored from it) is re-pointed at this directory's
    ``memories/<id>`` — which may be missing, then the plug-in says its memory is gone — never left to read the other
    directory's files. A memory outside any data directory (a folder given to the CLI) stays where it is."""
    mpath = memory.get("path")
    root = _data_root(Path(path).resolve())
    if root is None or not isinstance(mpath, str) or not mpath:
        return memory
    target = Path(mpath)
    if target.resolve().is_relative_to(root.resolve()):
        return memory
    foreign = target.parent.name == "memories" and (target.parent.parent / "studio.db").is_file()
    own = root / "memories" / target.name
    if foreign or (own / "meta.json").is_file():
        return {**memory, "path": str(own)}
    return memory


def load_plugin(path: str | Path, backbone) -> Plugin:
    """Load any saved plug-in: JSON config + safetensors only; refuses a foreign backbone, and a damaged or
    tampered plug-in with one UserError (see the module docstring) — nothing is written while loading."""
    from safetensors.torch import load_file  # heavy: optional at import time

    path = Path(path)
    cfg_path = path / "plugin_config.json"
    if not cfg_path.is_file():
        raise UserError(f"No plug-in at {path} (plugin_config.json is missing).")
    try:
        meta = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _damaged(path, f"plugin_config.json is unreadable ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise _damaged(path, "plugin_config.json is not an object")
    for key, kind in (("method", str), ("fingerprint", str), ("config", dict)):
        if not isinstance(meta.get(key), kind):
            raise _damaged(path, f"plugin_config.json has no valid {key!r}")
    for key in ("memory", "extra", "files", "train_info"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise _damaged(path, f"plugin_config.json's {key!r} is not an object")
    version = meta.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise _damaged(path, "plugin_config.json's format_version is not a number")
    if version > FORMAT_VERSION:
        raise UserError(f"The plug-in at {path} was written by a newer PEMA Studio.")
    backbone.check_fingerprint(meta["fingerprint"], "This plug-in")
    cls = get_method(meta["method"])
    config = getattr(cls.Config, "from_saved", cls.Config.from_dict)(meta["config"])  # a saved one's defaults
    check_plugin_paths(path, meta)
    if meta.get("memory"):
        meta["memory"] = own_memory(path, meta["memory"])
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise _damaged(path, f"{WEIGHTS_FILE} is missing")
    for name, rec in (meta.get("files") or {}).items():
        f = path / name
        if not f.is_file():
            raise _damaged(path, f"{name} is missing")
        want = rec.get("sha256") if isinstance(rec, dict) else None
        if not isinstance(want, str) or file_sha256(f) != want:
            raise _damaged(path, f"{name} does not match its checksum (truncated or changed on disk)")
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 — safetensors raises its own error types for a bad file
        raise _damaged(path, f"{WEIGHTS_FILE} cannot be read ({type(e).__name__})") from None
    bad = nonfinite_tensors(tensors)
    if bad:
        raise _damaged(path, f"{', '.join(bad[:3])} hold NaN or infinite values")
    try:
        plugin = cls.build_for_load(config, backbone, meta.get("memory") or {}, meta.get("extra") or {}, tensors)
        missing, unexpected = plugin.load_state_dict(tensors, strict=False)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 — wrong shapes or types in a damaged file: the user's problem to know
        raise _damaged(path, f"its weights do not fit the method ({type(e).__name__}: {str(e)[:200]})") from None
    if missing or unexpected:
        raise UserError(f"The plug-in at {path} is damaged: missing {missing}, unexpected {unexpected}.")
    plugin.train_info = meta.get("train_info") or {}
    plugin.plugin_path = path
    plugin.eval()
    return plugin.to_backbone()
