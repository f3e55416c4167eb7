"""The frozen backbone (``Backbone``): everything a plug-in needs from the model, and ``load_backbone``.

f(c), the context representation of PEMA, is the last decoder layer's output, i.e. the input of the final norm
(and so of norm + LM head), exactly as PEMA's public code takes it. We capture it with a forward pre-hook on the
final norm rather than forking the model code.

The pieces live in their own modules and are re-exported here (``from backbone.model import X`` names any of them):
``kernels`` (the CPU inference linears), ``precision`` (choosing and applying a precision), ``threads`` (thread
counts inside a decode step), ``norms`` (fused RMSNorm), ``cpu_attention`` (a decode step's attention, and the hook
through which a plug-in adds attention for some rows), ``kv_cache`` (the growing KV cache), ``loading`` (names,
devices, GGUF files, the float16 range check).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from backbone.cpu_attention import (
    CPU_DECODE_ATTENTION,
    ROW_ATTENTION,
    RowAttention,
    cpu_decode_attention,
    use_cpu_decode_attention,
    use_pad_neutral_attention,
)
from backbone.graph_decode import warm_up
from backbone.kernels import (
    Fp16WeightLinear,
    Int8Linear,
    KernelLinear,
    PackedBF16Linear,
    PackedF32Linear,
    cpu_description,
    fp16_weight_available,
    native_bf16_cpu,
    packed_bf16_available,
    packed_f32_available,
)
from backbone.kv_cache import KV_BLOCK, GrowingKVLayer, grow_kv_cache, relayout_kv_rows
from backbone.loading import (
    ALIASES,
    DEFAULT_BACKBONE,
    EMBEDDED,
    FLOAT16_MAX,
    FLOAT16_SAFE,
    RANGE_PROBE,
    Progress,
    check_float16_range,
    load_model,
    no_progress,
    pick_device,
    residual_peak,
    resolve_name,
)
from backbone.norms import FusedRMSNorm
from backbone.options import FastPaths, fast_paths, using_fast_paths
from backbone.padding import left_pad, left_padded
from backbone.precision import (
    CPU_FLOAT16_TAG,
    DEFAULT_CPU_PRECISION,
    FINGERPRINT_TAGS,
    PRECISIONS,
    model_precision,
    resolve_precision,
    set_precision,
)
from backbone.threads import (
    all_threads,
    one_thread_section,
    process_threads,
    small_forward_threads,
    small_work_threads,
    vocab_wide_threads,
)
from backbone.torch_internals import version
from ground.errors import Cancelled, UserError

__all__ = [
    "CPU_DECODE_ATTENTION", "ROW_ATTENTION", "RowAttention", "cpu_decode_attention", "use_cpu_decode_attention",
    "Fp16WeightLinear", "Int8Linear", "KernelLinear",
    "PackedBF16Linear", "PackedF32Linear", "cpu_description", "fp16_weight_available", "native_bf16_cpu",
    "packed_bf16_available", "packed_f32_available",
    "KV_BLOCK", "GrowingKVLayer", "grow_kv_cache", "relayout_kv_rows",
    "ALIASES", "DEFAULT_BACKBONE", "EMBEDDED", "FLOAT16_MAX", "FLOAT16_SAFE", "RANGE_PROBE", "Progress", "no_progress",
    "check_float16_range", "load_model", "pick_device", "residual_peak", "resolve_name",
    "FusedRMSNorm", "FastPaths", "fast_paths", "using_fast_paths",
    "CPU_FLOAT16_TAG", "DEFAULT_CPU_PRECISION", "FINGERPRINT_TAGS", "PRECISIONS", "model_precision",
    "resolve_precision", "set_precision",
    "all_threads", "one_thread_section",
    "process_threads", "small_forward_threads", "small_work_threads", "vocab_wide_threads",
    "Backbone", "StopForward", "load_backbone", "generate_greedy",
]


def _project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x · weightᵀ, choosing the BLAS call by the number of rows on a CPU: MKL's ``F.linear`` over a vocabulary-wide
    head (Gemma's, SmolLM2's) is slow for 7–15 rows, where ``weight @ xᵀ`` is not (``python -m benchmarks head``
    times both). The full float32 head on a CPU runs :class:`PackedF32Linear`; this serves the plain path: a subset
    of the head's rows, a switched-off kernel, gradients."""
    if x.dim() == 2 and 7 <= x.shape[0] <= 15 and x.device.type == "cpu":
        return (weight @ x.T).T.contiguous()
    return torch.nn.functional.linear(x, weight)


class StopForward(Exception):
    """Raised by a forward hook to end a forward pass early, once it has captured what it needs (the only such
    exception of the project; see ``Backbone.forward_until_stopped``)."""

    def __init__(self, captured=None):
        super().__init__("forward pass stopped by a hook")
        self.captured = captured


@dataclass
class Backbone:
    """A frozen causal LM plus the pieces plug-ins use. Build with :func:`load_backbone` or ``tiny_backbone``."""

    model: nn.Module
    tokenizer: object
    name: str
    chat: bool = False
    _fc_hook_state: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        FusedRMSNorm.swap_into(self.model)
        use_pad_neutral_attention(self.model)
        cfg = self.model.config
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = self.lm_head.weight.shape[0]
        self.num_layers: int = len(self.layers)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.precision: str = model_precision(self.model)
        self.stop_ids = self._stop_token_ids()
        self.fingerprint = self._fingerprint()

    # --- the pieces -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def decoder(self) -> nn.Module:
        """The transformer without the LM head (``model.model`` for Llama/Gemma-style models). Looked up once per
        model: transformers' ``get_decoder`` searches attribute names, and a decode step asks several times."""
        found = self.__dict__.get("_decoder_of")
        if found is None or found[0] is not self.model:
            dec = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
            found = self.__dict__["_decoder_of"] = (self.model, dec)
        return found[1]

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def final_norm(self) -> nn.Module:
        return self.decoder.norm

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def softcap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's final-logit soft-capping (Gemma: tanh(logits / c) · c); the identity for models without one.
        Written once: every LM-head product of the project (full head, subset, candidate rows) goes through it."""
        if self.softcap:
            return torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """LM head on already-normed states (float32 result), with the model's logit soft-capping if any. On a CPU
        the product runs the head's kernel (``KernelLinear``: one call for all rows, without
        gradients), on every thread."""
        head = self.lm_head
        x = normed.to(head.INPUT_DTYPE) if isinstance(head, KernelLinear) else None
        with all_threads():  # one large product: on every thread even inside a decode step's small work
            if x is not None and not torch.is_grad_enabled() and head._runs_kernel(x):
                logits = head(x)
            else:
                logits = _project(normed.to(self.dtype), head.weight)
        return self.softcap_logits(logits.float())

    def head_logits_subset(self, normed: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
        """Like ``head_logits`` but computed only for the token ids ``vocab`` (−inf elsewhere): a fraction of the
        LM head's cost when the vocabulary is large (Gemma: 262,144 rows)."""
        cached = getattr(self, "_subset_rows", None)  # (vocab tensor held alive, its version, gathered rows)
        if cached is None or cached[0] is not vocab or cached[1] != version(vocab):
            cached = (vocab, version(vocab), self.lm_head.weight[vocab.to(self.lm_head.weight.device)])
            self._subset_rows = cached  # gathered once per vocabulary, not at every step
        part = self.softcap_logits(_project(normed.to(self.dtype), cached[2]).float())
        out = torch.full((normed.shape[0], self.vocab_size), float("-inf"), device=part.device)
        out[:, vocab.to(part.device)] = part
        return out

    def logits_from_fc(self, fc: torch.Tensor) -> torch.Tensor:
        """W_hd · norm(h): the frozen final norm and LM head applied to a pre-norm state (f(c) or h_pd)."""
        return self.head_logits(self.final_norm(fc.to(self.device, self.dtype)))

    # --- f(c) capture -----------------------------------------------------------------------------
    def forward_fc(self, input_ids: torch.Tensor, attention_mask=None, past_key_values=None,
                   use_cache: bool = False, output_attentions: bool = False, inference: bool = True,
                   pad_neutral: bool = False):
        """Run the decoder (no LM head) and return ``(f(c), outputs)``: f(c) is the final norm's input. Without
        gradients it runs in ``torch.inference_mode`` unless ``inference`` is False (what its hooks capture is
        then an ordinary tensor that a later pass with gradients may save for backward). ``pad_neutral``: a
        left-padded row computes what it computes alone (``backbone.padding``: its own positions, attention over its
        own keys) — a decode's passes, whose rows must not depend on which others share the batch."""
        input_ids = input_ids.to(self.device)  # callers may build ids on the CPU; the model may sit on a GPU
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        if pad_neutral and attention_mask is not None:
            with left_padded(attention_mask) as pos:
                return self._forward_fc(input_ids, attention_mask, past_key_values, use_cache, output_attentions,
                                        inference, None if pos is None else pos(input_ids.shape[1]))
        return self._forward_fc(input_ids, attention_mask, past_key_values, use_cache, output_attentions, inference)

    def _forward_fc(self, input_ids, attention_mask, past_key_values, use_cache, output_attentions, inference,
                    position_ids=None):
        captured = {}

        def pre_hook(module, args):
            captured["fc"] = args[0]

        handle = self.final_norm.register_forward_pre_hook(pre_hook)
        few = small_forward_threads(input_ids.numel()) if self.device.type == "cpu" else None
        try:
            # without gradients, inference mode: no version counters or autograd bookkeeping on the ~3,000 small
            # ops of a decode step
            with one_thread_section(few is not None), torch.inference_mode(inference and not torch.is_grad_enabled()):
                out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                   past_key_values=past_key_values, use_cache=use_cache,
                                   output_attentions=output_attentions,
                                   **({} if position_ids is None else {"position_ids": position_ids}))
        finally:
            handle.remove()
        return captured["fc"], out

    def forward_until_stopped(self, input_ids: torch.Tensor, attention_mask=None) -> "StopForward | None":
        """Run the decoder without gradients for what its hooks capture; a hook that has what it needs raises
        :class:`StopForward` to skip the layers above it. Returns that exception (its ``captured``), or None when
        the pass ran to the end."""
        try:
            with torch.no_grad():  # what the hooks capture feeds training (LoRA): no inference tensors
                self.forward_fc(input_ids, attention_mask=attention_mask, inference=False)
        except StopForward as stop:
            return stop
        return None

    # --- tokenization -----------------------------------------------------------------------------
    def encode_context(self, text: str) -> list[int]:
        """Token ids of a rendered prompt (with BOS when the tokenizer adds one; chat template for instruct)."""
        if self.chat:
            msgs = [{"role": "user", "content": text}]
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_target(self, text: str) -> list[int]:
        """Token ids of a target continuation, without special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_str(self, tid: int) -> str:
        return self.tokenizer.decode([int(tid)])

    def _stop_token_ids(self) -> set[int]:
        """EOS ids plus the newline token: generation stops at the end of the sentence line."""
        ids = set()
        for attr in ("eos_token_id",):
            v = getattr(self.tokenizer, attr, None)
            if v is not None:
                ids.add(int(v))
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        nl = self.tokenizer("\n", add_special_tokens=False)["input_ids"]
        if len(nl) == 1:
            ids.add(int(nl[0]))
        # Every token that contains a line break ends the line too ("\n\n" is what a model says after an answer
        # when the prompt's examples are separated by blank lines). Found from the vocabulary's token strings
        # (SentencePiece "\n" or "<0x0A>", byte-level "Ċ") and confirmed by decoding.
        toks = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        for i, t in enumerate(toks):
            if t and ("\n" in t or "Ċ" in t or "<0x0A>" in t) and "\n" in self.tokenizer.decode([i]):
                ids.add(i)
        return ids

    def _fingerprint(self) -> str:
        vocab = self.tokenizer.get_vocab()
        vh = hashlib.sha256("\n".join(f"{t}\t{i}" for t, i in sorted(vocab.items(), key=lambda x: x[1]))
                            .encode("utf-8", "surrogatepass")).hexdigest()[:16]
        base = f"{self.name}|d={self.hidden_size}|L={self.num_layers}|V={self.vocab_size}|vocab={vh}"
        # f(c) depends on the weights' precision, so memories (keys) and plug-ins name it; float32, the reference,
        # adds nothing (fingerprints made before precisions existed stay valid).
        precision = getattr(self, "precision", None) or model_precision(self.model)
        tag = FINGERPRINT_TAGS.get(precision, precision)
        if precision == "float16" and any(isinstance(m, Fp16WeightLinear) for m in self.model.modules()):
            tag = CPU_FLOAT16_TAG
        return base if precision == "float32" else f"{base}|dtype={tag}"

    def check_fingerprint(self, fingerprint: str, what: str = "This memory") -> None:
        mine, theirs = self.fingerprint.split("|dtype=")[0], fingerprint.split("|dtype=")[0]
        if fingerprint != self.fingerprint and mine == theirs:
            tag = fingerprint.split("|dtype=")[1] if "|dtype=" in fingerprint else "float32"
            now = getattr(self, "precision", "?")
            if tag == "int8":  # the dynamic int8 of earlier versions: no precision loads it any more
                raise UserError(f"{what} was made with an earlier version's dynamic int8 backbone (activations "
                                f"quantized too), which no precision of this version reproduces: rebuild it.")
            made = {**{v: k for k, v in FINGERPRINT_TAGS.items()}, CPU_FLOAT16_TAG: "float16"}.get(tag, tag)
            raise UserError(f"{what} was made with the backbone in {made}; the loaded {self.name} runs in {now}. "
                            f"Its keys f(c) come from {made} weights: load the backbone with --dtype {made} "
                            f"(studio: PEMA_DTYPE={made}), or rebuild it in this precision.")
        if fingerprint != self.fingerprint:
            raise UserError(f"{what} was made for another backbone ({fingerprint.split('|')[0]}, "
                            f"{fingerprint}); the loaded backbone is {self.fingerprint}. "
                            f"Load the backbone it was made for, or rebuild it on this one.")


def load_backbone(name: str | None = None, device: str | None = None, dtype: str | None = None,
                  data_dir: str | os.PathLike | None = None, progress: Progress = no_progress) -> Backbone:
    """Load a backbone by embedded short name, Hugging Face hub id or local path, in the precision ``dtype``
    (:func:`resolve_precision`: float32, bfloat16, int8 on a CPU, float16); see ``backbone.loading.load_model``."""
    bb = Backbone(**load_model(name, device, dtype, data_dir, progress))
    warm_up(bb)  # on a GPU: the first-call work and the CUDA graphs at load, not in the first comparison
    return bb


def generate_greedy(backbone: Backbone, contexts: list[list[int]], max_new_tokens: int = 64,
                    batch_size: int = 8, progress: Progress = no_progress,
                    should_stop: Callable[[], bool] | None = None) -> list[list[int]]:
    """Plain greedy continuation of many different contexts (left-padded batches, HF ``generate``), stopping each
    at the end of its line. Used to make synthetic sources; comparisons use ``engine`` instead.

    ``should_stop()`` is called before every batch and after every generated token (a job's checkpoint: it may
    hand the backbone to an interactive user there, so nobody waits longer than one step, and a cancel ends a long
    batch at once); when it returns True, :class:`Cancelled` is raised."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stop = torch.tensor(sorted(backbone.stop_ids), device=backbone.device)
    cancelled = []

    class StopAtLineEnd(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            if should_stop is not None and should_stop():
                cancelled.append(True)
                return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            return torch.isin(input_ids[:, -1], stop)

    pad = backbone.tokenizer.pad_token_id
    outs: list[list[int]] = []
    for b0 in range(0, len(contexts), batch_size):
        if should_stop is not None and should_stop():
            raise Cancelled()
        batch = contexts[b0:b0 + batch_size]
        ids, mask = left_pad(batch, pad)
        with torch.no_grad():
            gen = backbone.model.generate(input_ids=ids.to(backbone.device), attention_mask=mask.to(backbone.device),
                                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                          stopping_criteria=StoppingCriteriaList([StopAtLineEnd()]))
        if cancelled:
            raise Cancelled()
        for row in gen[:, ids.shape[1]:].tolist():
            cut = next((i for i, t in enumerate(row) if t in backbone.stop_ids or t == pad), len(row))
            outs.append(row[:cut])
        progress(min(1.0, (b0 + len(batch)) / len(contexts)), f"generated {b0 + len(batch)}/{len(contexts)}")
    return outs
