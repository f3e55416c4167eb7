"""Memory-augmented adapters (Xu et al., "Pluggable Neural Machine Translation Models via Memory-augmented
Adapters", LREC-COLING 2024), adapted from an encoder–decoder NMT model to a frozen decoder-only LM.

Memory (``memories/phrases.py``), as the paper builds it: multi-granular phrases of the *target* sentences — spaCy
dependency subtrees, verb phrases and content words of English targets (≤ 8 words), and for other target languages
(German: no German parser can be installed here) the documented fallback, a marker-word / punctuation chunker
(≤ 10 words) —, never the whole target sentence; each phrase is back-translated by the frozen backbone itself with
the task's reverse prompt (the paper uses a reverse NMT model), and its source side is the back-translation's span in
the sample's real source sentence when it can be found there (exact, else trigram-fuzzy: our use of the parallel
data), else the back-translation itself (the paper's pairing; an unusable one — empty or far too long — leaves the
phrase paired with itself). The pairs are sorted by target length and split into equal shares over the adapted
layers, **short to long from the lowest layer up** (the paper's best allocation; ``allocation`` also offers
``long_to_short`` and ``random``; the authors' scripts cut fixed length bands for their 6 decoder layers, equal
shares fit any layer count). ``whole_sentences`` (default off, not in the paper) adds every training sentence pair as
an item; while training, every sample's attention to an item whose target is its own whole target sentence is masked
(weight 0; a layer left with no item skips its adapters for that row), so no sample can read its answer from the
memory — that mask is always on, also for a phrase of another sample that happens to equal a short target.

Memory items. For pair i held by layer l the frozen backbone (no adapters) runs teacher-forced on
``memory.prompt.render(src_phrase) + target_prefix + tgt_phrase``. Let ``a_l(t)`` be the output of layer l's
self-attention block (``layers[l].self_attn``'s output, before Gemma's post-attention norm and before the
residual add) at position t. Then

    source-side item  m^src_{l,i} = mean of a_l(t) over the tokens of the source phrase (found as the tokens that
                                    differ between the prompt rendered with the phrase and with an empty slot),
    target-side item  m^tgt_{l,i} = mean of a_l(t) over the tokens of the target phrase,

both divided by ``s_l``, the RMS of a_l over all captured (non-BOS) positions. They are buffers
``blocks.<l>.mem_src`` / ``blocks.<l>.mem_tgt`` (saved in safetensors); the phrase texts are in the plug-in's
``extra_config`` for the trace.

Adapter (per adapted layer and memory side; the paper's equations). With anchor A, query Q, keys K = values V =
the layer's memory items of that side, and learned W_q, W_k, W_v ∈ R^{d×d}, W_1 ∈ R^{2d×d}, W_2 ∈ R^{d×1}:

    R = softmax(Q·W_q·W_kᵀ·Kᵀ / (T·√d)) · V · W_v
    g = sigmoid(relu([A; R]·W_1)·W_2 + b_2)
    O = g·A + (1−g)·R

(the paper writes the logits over T; the authors' ``DatastoreReaderLayer`` also scales Q by d^-½, as here; their
gate layers are ``nn.Linear`` with biases on W_1 and W_2, here only b_2).

Where it acts (the decoder-only stand-in for the paper's two adapters). A decoder-only layer has one attention
sublayer, whose attention over the prompt plays the role of the NMT decoder's cross-attention to the source, so
**both adapters sit in series on the output of ``layers[l].self_attn``**, at every position (prompt and target):
first the target-memory adapter (the paper's adapter after decoder self-attention) with A = Q = a_l/s_l, then the
source-memory adapter (the paper's adapter after cross-attention) with A = Q = the first adapter's output; the
result times s_l replaces the self-attention output (a forward hook on ``self_attn``, first element of its output
tuple). Only batch rows given to ``attach`` are changed.

Adaptations (besides the decoder-only placement), recorded here and in ``train_info``:
    * scaling: A, Q and the memory are divided by the layer's activation RMS s_l and the result multiplied back
      (Gemma's raw states are far from the NMT model's layer-normed ones); the 1/√d on the logits is the authors'
      code's;
    * initialisation so that the untrained adapter is nearly the identity: W_q = W_k = W_v = I (the untrained
      adapter reads the memory items most similar to the current state), W_1 random, W_2 = 0 and a gate bias
      b_2 = ``gate_bias`` (4 ⇒ g = 0.982, 1.8 % memory) — the authors start W_q, W_k, W_v from Xavier;
    * memory items: mean states over each phrase's tokens from one teacher-forced pass of the frozen LM (the
      authors store per-token encoder / decoder states of force-decoded phrase pairs);
    * layers: the top 4 by default (the paper: every layer, the ``paper`` preset); ``layers="all"``, ``"top:N"``,
      ``"bottom:N"``, ``"every:K"`` or ``"3,7,11"`` — d×d matrices cost 2·(5d²+d+1) ≈ 4.1 M parameters per layer at
      d = 640 (73.8 M for Gemma's 18 layers), and with the top layers only, the frozen layers below run once per
      batch: a default step costs a fraction of the top 4's with the full softmax on Gemma (BENCHMARKS.md, "Training
      defaults, decided by measurement", row "the memory adapter's profile and its smaller default");
    * training softmax: over a candidate vocabulary by default (``softmax="candidates"``, below); the paper's full
      softmax in the ``paper`` preset;
    * training on the memory's samples (not on a parallel corpus), with the frozen backbone's teacher-forced
      sequences (``plugins/seqtrain.py``) and the CPU budget ``max_minutes``.

Training (paper): L = NLL(full memory) + α·NLL(memory after dropout) + β·½(KL(p‖q) + KL(q‖p)), p and q the output
distributions with the full and the dropped memory, token means; memory dropout drops each adapted layer's whole
memory (both sides: that layer's adapters become the identity) with probability 0.1, independently per sequence and
layer (the authors' code draws once per layer and batch and zeroes the attention, leaving (1−g)·A); T = 0.5, α = β = 5
(their script: α·(NLL_q + KL) with α = 5, i.e. α = β). Both passes run in one forward pass (``train_batch_loss``); a
sequence that drew no drop has q = p, so only the sequences that drew one run a second time (exact). Batches:
``batch_size`` sequences, or ``batch_tokens`` tokens a step (the paper's 8K, ``paper`` preset, with its 20K updates as
``max_steps``). Optimiser (paper's fairseq setup): Adam β (0.9, 0.98), peak lr 2e-4; the paper's inverse-sqrt schedule
with warmup is not offered by the shared loop (``plugins/training.py``), so the default is its closest one,
``lr_schedule="cosine"`` — linear warmup over ``warmup_steps`` (10; the authors warm up over 100 of up to 50k updates,
a CPU run here has a few hundred steps at most), then cosine decay. Not reproduced: the authors' label smoothing (0.1)
and their 100 updates of plain NLL before the dropout/KL terms start. The rest is the in-network plug-ins' shared
training (``NetworkPlugin.fit_sequences`` in ``plugins/network.py``): early stopping (NLL with the full memory and the
own-sentence mask, ``hooked_seq_loss``) on the samples that loop sets aside, of which this method evaluates a seeded
subset of ``max_heldout``, through ``plugins.training.run_training``; with a time budget, a guard evaluates the
early-stopping set once more before the step that would cross it, so the steps taken since the last evaluation are not
thrown away (the loop keeps the best *evaluated* weights). ``softmax="candidates"`` (the default; the ``paper`` preset
has the full softmax) restricts the training softmax (NLL and KL) to a candidate vocabulary — the memory's target
tokens, the stop tokens and the LM's top-16 tokens on sampled memory contexts —, which removes most of the LM-head
cost of a CPU training step (Gemma's vocabulary has 262k tokens); decoding always uses the full vocabulary.

Decoding: ``level = "network"``. Settings: ``temperature`` (default: the trained T), ``trace_top_k`` and the
"+ kNN" mix of the paper (``knn_lambda``, ``knn_k``, ``knn_temperature``; off at λ = 0): ``mix`` implements kNN-MT
over the same memory's datastore (its keys are the *base* model's f(c); queries are the adapted model's f(c), as the
paper queries its datastore with the adapted NMT model's decoder states). ``mixes_output = True`` makes the comparison
decoder call ``mix`` on this plug-in's rows after the LM head, like an output-level plug-in.

``network_trace(handles)`` returns, per row of the attachment ``handles`` (what ``attach`` returned), the attention
over memory items at each adapted layer at the newest position of its latest forward pass:
``{j: {"layers": {l: [[phrase_index, weight], ...top k]}, "source_layers": {...}, "memory_share": {l: [1−g_tgt,
1−g_src]}}}``; ``phrase_texts()[phrase_index]`` labels them. At decode time the memory products (W_q·W_kᵀ·Kᵀ, V·W_v,
V·W_v·W_1b) are computed once per temperature and cached, so a step costs about d² + 3·d·n per adapter and token
(n items in the layer).

The attach/hook machinery (rows, handles, traces) and the training loop are ``NetworkPlugin``'s
(``plugins/network.py``); the capture of the memory items from the backbone is ``memories.phrases``'
``capture_phrase_states``.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from backbone.torch_internals import set_unregistered, unregistered
from engine.protocol import MixInput, MixOutput
from ground.errors import UserError
from ground.settings import Setting
from memories.build import target_ids
from memories.phrases import capture_phrase_states, normalize, phrase_pairs_for_memory
from memories.store import Memory
from plugins.base import FitResult, OutputPlugin
from plugins.card import MethodCard
from plugins.knn import KNN, KNNConfig
from plugins.memory_adapter_layers import LayerBlock, MemoryAdapter, allocate  # noqa: F401  (re-exported)
from plugins.network import (
    NETWORK_ESTIMATE,
    NETWORK_QUICK_SETTINGS,
    Attachment,
    FullBatch,
    NetworkConfig,
    NetworkPlugin,
    PreparedBatch,
    TrainingBatches,
    derived,
    first_tensor,
    parse_layers,
    replace_first,
    rows_apply,
)
from plugins.registry import register
from plugins.seqtrain import SeqData
from plugins.settings import Preset, setting

SIDES = ("tgt", "src")


def _pick_rows(v, batch: int, rows: torch.Tensor):
    """A layer argument with the batch's rows ``rows`` (one shared by all rows — a leading dimension of 1 or no
    batch dimension — is kept as it is)."""
    if isinstance(v, torch.Tensor):
        return v.index_select(0, rows.to(v.device)) if v.dim() > 1 and v.shape[0] == batch else v
    if isinstance(v, tuple):
        return tuple(_pick_rows(x, batch, rows) for x in v)
    if isinstance(v, dict):
        return {k: _pick_rows(x, batch, rows) for k, x in v.items()}
    return v


def batch_rows(batch, rows: torch.Tensor):
    """A training batch (``PreparedBatch`` / ``FullBatch``) made of ``batch``'s rows ``rows`` (repeats allowed)."""
    if isinstance(batch, PreparedBatch):
        kwargs = {t: _pick_rows(kw, batch.size, rows) for t, kw in batch.kwargs.items()}
        return PreparedBatch(batch.backbone, batch.hidden.index_select(0, rows.to(batch.hidden.device)), kwargs,
                             batch.labels[rows], batch.tokens, batch.prefix, batch.l0)
    own = None if batch.own_from is None else batch.own_from[rows.to(batch.own_from.device)]
    return FullBatch(batch.backbone, batch.ids[rows], batch.mask[rows], batch.labels[rows], own)


@dataclass
class MemoryAdapterConfig(NetworkConfig):
    """The in-network plug-ins' training settings (``NetworkConfig``; this method's defaults below) and the
    paper's memory, loss and allocation settings."""

    # NetworkConfig's fields, with this method's defaults (its other fields: softmax, candidate_top_k,
    # evals_per_epoch — used only with eval_every = 0)
    lr: float = setting(
        2e-4, "peak learning rate (paper 2e-4; Adam β (0.9, 0.98) as the paper's fairseq setup)",
        low=0.0, low_open=True, high=1.0)
    lr_schedule: str = setting(
        "cosine", "\"cosine\" (linear warmup, then cosine decay: the loop's stand-in for the paper's inverse-sqrt "
        "schedule, which it does not offer) | \"constant\"", choices=("cosine", "constant"))
    warmup_steps: int = setting(
        10, "linear warmup steps of the \"cosine\" schedule (paper: 100 of up to 50k updates; a CPU run here has a "
        "few hundred at most)", low=0, high=100000)
    batch_size: int = setting(
        4, "sequences per step (those that draw a memory dropout run twice: full and dropped memory)", low=1,
        high=65536)
    batch_tokens: int = setting(
        0, "tokens per step instead of batch_size sequences (0 = off): a step takes as many sequences as fit this "
           "many of their own tokens on average (source and target; the shared prompt prefix is not counted); the "
           "paper: 8K tokens (fairseq's max_tokens 8192)", low=0, high=10_000_000)
    max_steps: int = setting(
        0, "optimizer steps at most (0 = none; the paper: 20K updates)", low=0, high=10_000_000)
    max_epochs: int = setting(2, low=0, high=1000)
    patience: int = setting(
        4, "held-out evaluations without improvement before stopping (with 4 evaluations an epoch: at least one "
           "epoch)", low=0, high=1000)
    max_heldout: int = setting(
        16, "held-out sequences used for early stopping (a seeded random subset)", low=1, high=100000)
    max_minutes: float = setting(
        60.0, "wall-clock cap of the training loop (0 = none); the epochs and early stopping end a default run "
              "before it", low=0.0, high=1440.0)
    softmax: str = setting(
        "candidates", "\"candidates\" (default: the training softmax over a candidate vocabulary — the memory's "
        "target tokens, the stop tokens and the LM's top tokens on sampled memory contexts —; the 262k-token LM head "
        "was most of a step) | \"full\" (exact NLL over every token; the paper)", choices=("full", "candidates"))
    candidate_contexts: int = setting(1024, "\"candidates\": how many memory contexts to sample", low=0, high=1000000)
    # this method's own
    eval_every: int = setting(
        0, "steps between held-out evaluations (0: evals_per_epoch per epoch)", low=0, high=100000)
    temperature: float = setting(0.5, "T of the memory attention (paper 0.5)", low=0.01, high=100.0)
    alpha: float = setting(5.0, "weight of the NLL with dropped memory (paper 5)", low=0.0, high=1e6)
    beta: float = setting(5.0, "weight of the symmetric KL (paper 5)", low=0.0, high=1e6)
    memory_dropout: float = setting(0.1, "probability of dropping one layer's memory (paper 0.1)", low=0.0, high=1.0)
    layers: str = setting(
        "top:4", "adapted layers: \"all\" (the paper) | \"top:N\" | \"bottom:N\" | \"every:K\" | \"0,4,8\"; the "
        "default, the top 4: the frozen layers below run once per batch and 16 M parameters train instead of 74 M "
        "(every layer), to train in minutes on two CPU cores; its held-out quality against every layer is not "
        "measured yet (BENCHMARKS.md)")
    allocation: str = setting("short_to_long", "\"short_to_long\" (paper's best) | \"long_to_short\" | \"random\"",
                              choices=("short_to_long", "long_to_short", "random"))
    memory_side: str = setting("both", "\"both\" | \"target\" | \"source\"", choices=("both", "target", "source"))
    gate_bias: float = setting(4.0, "initial gate logit (toward the anchor A)", low=-100.0, high=100.0)
    max_pairs: int = setting(2000, "phrase pairs in the memory", low=1, high=1000000)
    max_translate: int = setting(
        192, "unique target phrases back-translated by the backbone (the slow part)", low=0, high=1000000)
    max_phrase_len_en: int = setting(8, "longest target phrase, English targets (paper: 8 words)", low=1, high=64)
    max_phrase_len_other: int = setting(
        10, "longest target phrase, other target languages (paper: 10 words)", low=1, high=64)
    fuzzy_threshold: float = setting(
        0.6, "finding a back-translation in the real source: character-trigram Dice", low=0.0, high=1.0)
    whole_sentences: bool = setting(
        False, "also put every whole training sentence pair in the memory (not in the paper; each sample's own "
        "sentence is masked out of its attention while training)")
    capture_batch_size: int = setting(16, low=1, high=4096)

    PRESETS = {
        "paper": Preset({"lr": 2e-4, "warmup_steps": 100, "temperature": 0.5, "alpha": 5.0, "beta": 5.0,
                         "memory_dropout": 0.1, "layers": "all", "allocation": "short_to_long",
                         "memory_side": "both", "max_phrase_len_en": 8, "max_phrase_len_other": 10,
                         "whole_sentences": False, "batch_tokens": 8192, "max_steps": 20000, "max_epochs": 1000,
                         "eval_every": 100, "max_minutes": 0.0, "softmax": "full"},
                        "the paper's values: peak lr 2e-4 after 100 warmup updates, T 0.5, α = β = 5, memory "
                        "dropout 0.1, every layer (74 M parameters on Gemma 3 270M), short-to-long phrases of ≤ 8 / "
                        "10 words, the full softmax, batches of 8K tokens, up to 20K updates (evaluated every 100; no "
                        "time cap) — hours to days on a CPU"),
        "quick": Preset({"max_pairs": 500, "max_translate": 32, "layers": "top:4", "max_epochs": 1,
                         "max_heldout": 8, "softmax": "candidates", "max_minutes": 3.0},
                        "a short run for trying the studio: 32 back-translated phrases, the top 4 layers, "
                        "candidate softmax, 1 epoch, at most 3 minutes"),
    }

    def validate(self) -> None:
        super().validate()
        self._check(self.memory_dropout < 1.0, "Memory dropout must be in [0, 1).")
        self._check(self.fuzzy_threshold > 0.0, "fuzzy_threshold must be in (0, 1].")
        parse_layers(self.layers, None)


CARD = MethodCard(
    paper="Xu et al., Pluggable Neural Machine Translation Models via Memory-augmented Adapters, LREC-COLING 2024",
    estimate=dataclasses.replace(NETWORK_ESTIMATE,
                                 measure_settings={**NETWORK_ESTIMATE.measure_settings, "max_translate": 16}),
    quick_settings={**NETWORK_QUICK_SETTINGS, "max_pairs": 40, "max_translate": 8},
    without_datastore_note=("The memory's datastore is not included, so the '+ kNN' decode setting (`knn_lambda` > "
                            "0) does not work with this package; export with `--include-datastore` for it."))


@register(CARD)
class MemoryAdapterPlugin(NetworkPlugin, OutputPlugin):
    method = "memory_adapter"
    title = "Memory-augmented adapter"
    Config = MemoryAdapterConfig
    mixes_output: ClassVar[bool] = True  # "+ kNN": the decoder also calls mix() on this plug-in's rows
    decode_settings = (
        Setting("temperature", 0.5, "T of the attention over the phrase memory (default: the trained one)",
                low=0.01, high=100.0, step=0.05, label="memory temperature"),
        Setting("trace_top_k", 5, "memory items shown per token in the trace", low=1, high=50),
        Setting("knn_lambda", 0.0, "'+ kNN' (paper): weight of kNN-MT over the memory's datastore (0 = off)",
                low=0.0, high=1.0, step=0.05),
        Setting("knn_k", 16, "'+ kNN': neighbours per token", low=1, high=128),
        Setting("knn_temperature", 10.0, "'+ kNN': T in exp(−d/T)", low=0.5, high=100.0),
    )

    def __init__(self, config: MemoryAdapterConfig, backbone, memory_meta: dict | None = None):
        super().__init__(config, backbone, memory_meta)
        self.blocks = nn.ModuleDict()
        self.phrases: list[dict] = []
        self.phrase_stats: dict = {}
        self._knn = None
        self._drop_rng: torch.Generator | None = None  # memory dropout while training
        self._own: tuple[dict, dict] | None = None  # while training: what ``_exclusion`` masks (see there)

    # --- structure --------------------------------------------------------------------------------
    @property
    def sides(self) -> tuple[str, ...]:
        return {"both": SIDES, "target": ("tgt",), "source": ("src",)}[self.config.memory_side]

    @property
    def adapted_layers(self) -> list[int]:
        return sorted(int(k) for k in self.blocks)

    def _build_blocks(self, sizes: dict[int, int]) -> None:
        g = torch.Generator().manual_seed(self.config.seed)
        d = self.backbone.hidden_size
        self.blocks = nn.ModuleDict({str(l): LayerBlock(d, n, self.sides, self.config.gate_bias, g)
                                     for l, n in sorted(sizes.items()) if n > 0})

    @classmethod
    def build_for_load(cls, config, backbone, memory_meta, extra, tensors):
        p = cls(config, backbone, memory_meta)
        sizes = {int(k.split(".")[1]): int(v.shape[0]) for k, v in tensors.items()
                 if k.startswith("blocks.") and k.endswith(".mem_tgt")}
        p._build_blocks(sizes)
        p.phrases = list(extra.get("phrases", []))
        p.phrase_stats = dict(extra.get("phrase_stats", {}))
        return p

    def extra_config(self) -> dict:
        return {"phrases": self.phrases, "phrase_stats": self.phrase_stats, "layers": self.adapted_layers}

    def phrase_texts(self) -> list[str]:
        """Labels of the memory items, indexed by the phrase index used in the trace."""
        return [f"{p['src']} → {p['tgt']}" for p in self.phrases]

    # --- memory ---------------------------------------------------------------------------------------
    def build_memory(self, memory, progress=lambda f, m: None, should_stop=lambda: False) -> dict:
        """Extract phrase pairs from the memory's training samples, allocate them to layers and capture the
        memory items. Leaves the adapters at their (nearly identity) initialisation."""
        cfg, bb = self.config, self.backbone
        layers = parse_layers(cfg.layers, bb.num_layers)
        if not memory.split_samples("train"):
            raise UserError("The memory has no training samples.")
        stats: dict = {}
        pairs = phrase_pairs_for_memory(
            bb, memory, "train", max_pairs=cfg.max_pairs, max_translate=cfg.max_translate,
            max_len_english=cfg.max_phrase_len_en, max_len_other=cfg.max_phrase_len_other,
            fuzzy_threshold=cfg.fuzzy_threshold, whole_sentences=cfg.whole_sentences,
            progress=lambda f, m: progress(0.8 * f, m), should_stop=should_stop, stats=stats)
        if not pairs:
            raise UserError("No phrase could be extracted from the memory's target sentences "
                            "(with max_translate = 0 nothing is paired; turn whole_sentences on or raise it).")
        alloc = allocate([p.length for p in pairs], layers, cfg.allocation, cfg.seed)
        self.phrases = []
        for layer, idx in alloc.items():
            for i in idx:
                self.phrases.append({**pairs[i].to_dict(), "layer": layer})
        self._build_blocks({l: len(idx) for l, idx in alloc.items()})
        t0 = time.time()
        self._capture(memory.prompt, lambda f, m: progress(0.8 + 0.2 * f, m), should_stop)
        stats["seconds_capture"] = round(time.time() - t0, 2)
        stats["items_per_layer"] = {l: len(idx) for l, idx in alloc.items()}
        self.phrase_stats = stats
        self.to(bb.device)
        return stats

    def _capture(self, prompt, progress, should_stop) -> None:
        """Memory items: the backbone's states over each phrase pair at its layer (``capture_phrase_states``),
        divided by the layer's RMS s_l (kept as ``blocks.<l>.scale``)."""
        items = [(p["layer"], p["src"], p["tgt"]) for p in self.phrases]
        states = capture_phrase_states(self.backbone, prompt, items, self.adapted_layers,
                                       self.config.capture_batch_size, progress, should_stop)
        start = 0
        for l in self.adapted_layers:  # self.phrases holds each layer's items contiguously, lowest layer first
            blk = self.blocks[str(l)]
            n = blk.mem_tgt.shape[0]
            scale = states.rms[l]
            with torch.no_grad():
                blk.scale.fill_(scale)
                blk.mem_src.copy_((states.src[start:start + n] / scale).float())
                blk.mem_tgt.copy_((states.tgt[start:start + n] / scale).float())
                blk.phrase_ids.copy_(torch.arange(start, start + n))
            start += n

    # --- hooks ------------------------------------------------------------------------------------------
    def _register_hooks(self, att: Attachment) -> list:
        """Both adapters of every adapted layer on ``layers[l].self_attn``'s output, for ``att.rows`` only (all
        rows while training, where ``att.state["keep"]`` (batch, layers) False drops a layer's memory)."""
        if not len(self.blocks):
            return []
        preps = self._preps(att.settings.temperature, cached=att.forward_rows is not None)
        keep = att.state.get("keep")
        exclude = att.state.get("exclude") or {}  # layer → (B, n) items hidden from each row (training)
        recording: dict = {}  # layer → the newest position's memory attention, for the trace
        layers, adapted = self.backbone.layers, self.adapted_layers
        return [layers[l].self_attn.register_forward_hook(
                    self._hook(att, l, preps[l], None if keep is None else keep[:, i], recording, exclude.get(l),
                               adapted))
                for i, l in enumerate(adapted)]

    def _hook(self, att: Attachment, l: int, prep: dict, keep: torch.Tensor | None, recording: dict,
              exclude: torch.Tensor | None = None, layers: list[int] | None = None):
        blk = self.blocks[str(l)]
        layers = self.adapted_layers if layers is None else layers
        info: dict = {}
        # ``prep`` is then ``_preps(cached=True)``'s: decode_prep's folded products
        decoding = att.forward_rows is not None

        def fn(x, h):
            if decoding:
                new, info["sides"] = blk.decode(x, prep)
            else:
                new, info["sides"] = blk.apply(x, prep, keep, exclude)
            return new

        def hook(module, args, output):
            info.clear()
            h = first_tensor(output)
            out = replace_first(output, rows_apply(h, h, att.rows, fn, att.starts()))
            if att.rows is not None and att.recording and "sides" in info:  # decoding with a trace: record it
                if l == layers[0]:
                    recording.clear()
                # kept on the device: the trace is read after the step (``_trace_rows``), so no hooked layer waits
                # for a device-to-host copy
                recording[l] = {s: (a[:, -1].detach().float(), g[:, -1, 0].detach().float())
                                for s, (a, g) in info["sides"].items()}
                if l == layers[-1]:
                    att.trace = dict(recording)
            return out
        return hook

    def _preps(self, temperature: float, cached: bool) -> dict:
        """Every layer's memory products at ``temperature``: per forward pass while training (they carry the
        gradients), once per temperature (and weights) for decoding."""
        if not cached:
            return self._prepare_all(temperature)
        dtype = self.backbone.dtype
        return derived(self, ("decode_prep", temperature, dtype), self._block_tensors(),
                       lambda: {l: self.blocks[str(l)].decode_prep(temperature, dtype) for l in self.adapted_layers})

    def _block_tensors(self) -> tuple:
        """Every parameter and buffer of the blocks (what the decode products derive from), listed once per blocks
        object: walking the modules at every decode step cost more than the products' cache check."""
        listed = unregistered(self, "_listed")
        if listed is None or listed[0] is not self.blocks:
            listed = (self.blocks, (*self.blocks.parameters(), *self.blocks.buffers()))
            set_unregistered(self, "_listed", listed)
        return listed[1]

    def _prepare_all(self, temperature: float) -> dict:
        return {l: self.blocks[str(l)].prepare(temperature) for l in self.adapted_layers}

    def _trace_rows(self, att: Attachment) -> dict:
        """The recorded memory attention as the trace (module docstring), top ``trace_top_k`` items per layer."""
        latest = att.trace
        if not latest:
            return {}
        k = att.settings.trace_top_k
        out: dict[int, dict] = {}
        n_rows = next(iter(next(iter(latest.values())).values()))[0].shape[0]
        # every layer's top items of every row, then one copy to the host
        tops = {(l, side): (att.topk(min(k, att.shape[1]), dim=-1), g) for l, per_side in latest.items()
                for side, (att, g) in per_side.items()}
        tops = {key: ((w.cpu().tolist(), self.blocks[str(key[0])].phrase_ids.to(i.device)[i].cpu().tolist()),
                      g.cpu().tolist()) for key, ((w, i), g) in tops.items()}
        for j in range(n_rows):
            entry = {"layers": {}, "source_layers": {}, "memory_share": {}}
            for l, per_side in latest.items():
                share = []
                for side, key in (("tgt", "layers"), ("src", "source_layers")):
                    if side not in per_side:
                        share.append(None)
                        continue
                    (w, ids), g = tops[(l, side)]
                    entry[key][l] = [[int(a), round(float(b), 4)] for a, b in zip(ids[j], w[j])]
                    share.append(round(1.0 - float(g[j]), 4))
                entry["memory_share"][l] = share
            out[j] = entry
        return out

    # --- training ---------------------------------------------------------------------------------------
    def fit(self, memory, progress=lambda f, m: None, should_stop=lambda: False) -> FitResult:
        """Build the phrase memory (``build_memory``), then train the adapters (``train_adapters``)."""
        t0 = time.time()
        if self.resume_state is not None:  # continue training: the saved phrase memory stays as it is
            return self.train_adapters(memory, progress, should_stop)
        progress(0.0, "building the phrase memory")
        self.build_memory(memory, lambda f, m: progress(0.35 * f, m), should_stop)
        return self.train_adapters(memory, lambda f, m: progress(0.35 + 0.65 * f, m), should_stop,
                                   seconds_memory=time.time() - t0)

    def train_adapters(self, memory, progress=lambda f, m: None, should_stop=lambda: False,
                       seconds_memory: float = 0.0) -> FitResult:
        """Train the adapters of an already built phrase memory on the memory's samples: the in-network plug-ins'
        loop (``NetworkPlugin.fit_sequences``) with the paper's objective (``train_batch_loss``)."""
        cfg = self.config
        if not len(self.blocks):
            raise UserError("Build the phrase memory first (build_memory).")

        def prepare(train) -> dict:
            self._drop_rng = torch.Generator().manual_seed(cfg.seed)
            self._own = self._own_sentence_tables(memory)
            return {"temperature": cfg.temperature, "alpha": cfg.alpha, "beta": cfg.beta,
                    "memory_dropout": cfg.memory_dropout, "allocation": cfg.allocation,
                    "memory_side": cfg.memory_side, "placement": "self_attn output (both adapters in series)",
                    "attention_scaling": "1/(T*sqrt(d)), inputs divided by the layer RMS",
                    "whole_sentences": cfg.whole_sentences, "own_sentence_masked": True,
                    "adam_betas": list(self.ADAM_BETAS), "lr_schedule": cfg.lr_schedule,
                    "warmup_steps": cfg.warmup_steps}

        t1 = time.time()
        try:
            result = self.fit_sequences(memory, progress, should_stop, prepare)
        finally:
            self._own = None
        initial = next((h["heldout_loss"] for h in result.history if "heldout_loss" in h), None)
        extra = {"phrase_memory": self.phrase_stats, "memory_items": len(self.phrases),
                 "adapted_layers": self.adapted_layers, "initial_heldout_nll": initial,
                 "seconds_memory": round(seconds_memory, 2), "seconds_training": round(time.time() - t1, 2),
                 "candidates": self.train_info.get("candidates", self.backbone.vocab_size)}
        result.metrics.update(extra)
        self.train_info.update(extra)
        return result

    def _heldout_subset(self, held: SeqData) -> SeqData:
        """A seeded random subset of ``max_heldout`` held-out samples for early stopping."""
        pick = sorted(np.random.default_rng(self.config.seed).permutation(len(held))[:self.config.max_heldout]
                      .tolist())
        return held.pick(pick)

    ADAM_BETAS: ClassVar[tuple[float, float]] = (0.9, 0.98)  # the paper's fairseq setup

    def loop_settings(self, steps_per_epoch: int):
        """The shared loop's settings with the paper's Adam β and this method's warmup (with ``lr_schedule =
        "cosine"``: linear warmup over ``warmup_steps``, then cosine decay — the loop has no inverse-sqrt)."""
        s = super().loop_settings(steps_per_epoch)
        if self.config.eval_every:
            s.eval_every = self.config.eval_every
        s.betas = self.ADAM_BETAS
        s.warmup_steps = self.config.warmup_steps
        s.max_steps = self.config.max_steps
        return s

    def samples_per_step(self, data: SeqData) -> int:
        """Sequences per optimizer step: ``batch_size``, or with ``batch_tokens`` as many as fit that many of their
        own tokens on average (source and target; the shared prompt prefix is the past, not computed)."""
        cfg = self.config
        if not cfg.batch_tokens or not len(data):
            return cfg.batch_size
        own = sum(len(c) + len(t) - data.shared_len(i) for i, (c, t) in enumerate(zip(data.contexts, data.targets)))
        return max(1, min(len(data), round(cfg.batch_tokens * len(data) / max(1, own))))

    def training_batches(self, data: SeqData, fallback_full: bool = False) -> TrainingBatches:
        return TrainingBatches(self.backbone, data, self.samples_per_step(data), self.frozen_prefix,
                               self.lowest_layer(), full=fallback_full)

    def _own_sentence_tables(self, memory) -> tuple[dict, dict]:
        """What ``_exclusion`` needs: every sample's target tokens (as ``collate`` puts them in ``labels``) → its
        normalized target sentence, and per adapted layer: normalized item target → the item's local indices."""
        bb, prompt = self.backbone, memory.prompt
        by_tokens = {tuple(target_ids(bb, prompt, s["tgt"])): normalize(s["tgt"]) for s in memory.samples}
        per_layer: dict[int, dict[str, list[int]]] = {}
        for l in self.adapted_layers:
            table: dict[str, list[int]] = {}
            for j, g in enumerate(self.blocks[str(l)].phrase_ids.tolist()):
                table.setdefault(normalize(self.phrases[g]["tgt"]), []).append(j)
            per_layer[l] = table
        return by_tokens, per_layer

    def _exclusion(self, labels: torch.Tensor) -> dict[int, torch.Tensor] | None:
        """While training: per adapted layer, (B, n) True where item j's target is row b's whole target sentence —
        its own sentence entry (``whole_sentences``) or any item that happens to equal it — so that no training
        sample can read its own answer from the memory. None when nothing is masked (or not training)."""
        if self._own is None:
            return None
        by_tokens, per_layer = self._own
        rows = [by_tokens.get(tuple(r[r != -100].tolist())) for r in labels.cpu()]
        out, any_masked = {}, False
        for l in self.adapted_layers:
            m = torch.zeros(len(rows), self.blocks[str(l)].mem_tgt.shape[0], dtype=torch.bool)
            for b, t in enumerate(rows):
                for j in per_layer[l].get(t, ()) if t is not None else ():
                    m[b, j] = True
            any_masked |= bool(m.any())
            out[l] = m.to(labels.device)
        return out if any_masked else None

    def hooked_seq_loss(self, ids, mask=None, labels=None, **state):
        """The shared loop's early-stopping NLL, with the own-sentence mask while training (the samples it is measured
        on are training samples set aside, whose sentences are memory items with ``whole_sentences``)."""
        batch = self.as_batch(ids, mask, labels)
        state.setdefault("exclude", self._exclusion(batch.labels))
        return super().hooked_seq_loss(batch, **state)

    def lowest_layer(self) -> int:
        return min(self.adapted_layers) if self.adapted_layers else self.backbone.num_layers - 1

    def train_batch_loss(self, ids, mask=None, labels=None) -> tuple[torch.Tensor, int, dict]:
        """The paper's objective on one batch: NLL with the full memory + α·NLL with memory dropout + β·½(KL(p‖q) +
        KL(q‖p)) between the two output distributions, token means. Memory dropout drops each adapted layer's whole
        memory with probability ``memory_dropout``, independently per sequence. A sequence none of whose layers
        drew a drop has q = p exactly (the forward pass is deterministic): its dropped-memory NLL is its full one and
        its KL is 0, so only the sequences with a drop run a second time — in the same forward pass as the full
        batch — and the loss is the doubled batch's, term for term (``tests/test_memory_adapter.py``)."""
        cfg, bb = self.config, self.backbone
        batch = self.as_batch(ids, mask, labels)
        labels = batch.labels
        B = labels.shape[0]
        use_drop = cfg.alpha > 0 or cfg.beta > 0
        keep, again = None, torch.zeros(0, dtype=torch.long)
        if use_drop:
            L = len(self.adapted_layers)
            if self._drop_rng is None:
                self._drop_rng = torch.Generator().manual_seed(cfg.seed)
            drop = torch.rand(B, L, generator=self._drop_rng) < cfg.memory_dropout
            again = drop.any(1).nonzero().flatten()  # the sequences whose dropped pass differs from the full one
            if len(again):
                keep = torch.cat([torch.ones(B, L, dtype=torch.bool), ~drop[again]]).to(bb.device)
        run = batch if not len(again) else batch_rows(batch, torch.cat([torch.arange(B), again]))
        labels_run = run.labels
        fc = self.batch_fc(run, 1, keep=keep, exclude=self._exclusion(labels_run))
        sel = labels_run != -100
        lp = torch.log_softmax(self.target_logits(fc[sel]), dim=-1)
        y = self.target_index(labels_run[sel])
        tok_nll = -lp.gather(1, y[:, None]).squeeze(1)
        row = torch.arange(labels_run.shape[0], device=sel.device)[:, None].expand_as(sel)[sel]
        first = row < B  # tokens of the full-memory pass
        K = int(first.sum())
        nll_full = tok_nll[first].mean()
        parts = {"nll": nll_full.detach()}
        loss = nll_full
        if use_drop:
            rerun = torch.zeros(B, dtype=torch.bool, device=sel.device)
            rerun[again.to(sel.device)] = True
            twice = rerun[row[first]]  # full-pass tokens of the sequences that ran again, in the same order
            nll_drop = (tok_nll[first][~twice].sum() + tok_nll[~first].sum()) / K
            p, q = lp[first][twice], lp[~first]
            kl = 0.5 * ((p.exp() - q.exp()) * (p - q)).sum() / K  # ½(KL(p‖q) + KL(q‖p)), mean over all K tokens
            loss = loss + cfg.alpha * nll_drop + cfg.beta * kl
            parts.update(nll_dropped=nll_drop.detach(), kl=kl.detach())
        return loss, K, parts

    # --- decoding ---------------------------------------------------------------------------------------
    @property
    def decode_defaults(self) -> dict:
        """The declared defaults, with the memory temperature the adapter was trained at."""
        return {**super().decode_defaults, "temperature": float(self.config.temperature)}

    def _knn_plugin(self):
        if self._knn is None:
            path = self.memory_meta.get("path", "")
            try:
                mem = Memory.load(path, self.backbone)
            except UserError:
                raise UserError(f"'+ kNN' reads the plug-in's memory at {path or '(unknown)'}, "
                                "which is gone.") from None
            knn = KNN(KNNConfig(), self.backbone, self.memory_meta)
            knn.attach_memory(mem)
            self._knn = knn
        return self._knn

    def mix(self, inp: MixInput) -> MixOutput:
        """"+ kNN" (paper): kNN-MT over the memory's datastore mixed into this row's distribution."""
        lams = [s.knn_lambda for s in inp.settings]
        if max(lams, default=0.0) <= 0:
            return MixOutput(logprobs=inp.lm_logprobs, lam=lams)
        knn = self._knn_plugin()
        knn_settings = [knn.settings({"k": s.knn_k, "temperature": s.knn_temperature, "lambda": s.knn_lambda})
                        for s in inp.settings]
        return knn.mix(MixInput(fc=inp.fc, lm_logprobs=inp.lm_logprobs, extra_logits=None,
                                step=inp.step, src_len=inp.src_len, settings=knn_settings))
