"""Teacher-forced sequence batches for in-network plug-ins (adapters, LoRA, memory-tuning, memory-augmented
adapters). They train on a memory's *samples* — the same prompt + target token sequences whose positions are the
memory's entries — through the frozen backbone with their hooks attached, minimising the NLL of the target tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from backbone.model import Backbone
from engine.protocol import shared_prompt_len
from memories.build import target_ids
from memories.store import Memory
from plugins.training import early_stopping_split


@dataclass
class SeqData:
    """Samples as token sequences. ``shared[i]``: how many leading tokens of ``contexts[i]`` are the prompt's shared
    prefix (instruction and few-shot examples, rendered the same for any source: ``shared_prompt_len``); None
    where unknown (then 0 for every sample)."""

    contexts: list[list[int]]
    targets: list[list[int]]
    shared: list[int] | None = None

    def __len__(self) -> int:
        return len(self.contexts)

    def shared_len(self, i: int) -> int:
        return 0 if self.shared is None else self.shared[i]

    def pick(self, idx) -> "SeqData":
        idx = list(idx)
        return SeqData([self.contexts[i] for i in idx], [self.targets[i] for i in idx],
                       None if self.shared is None else [self.shared[i] for i in idx])


def memory_sequences(backbone: Backbone, memory: Memory, split: str = "train") -> SeqData:
    """The (context, target) token sequences of a memory's samples of one split (train / heldout), with each
    context's shared prompt prefix length."""
    prompt = memory.prompt
    rows = memory.split_samples(split)
    contexts = [backbone.encode_context(prompt.render(s["src"])) for s in rows]
    return SeqData(contexts, [target_ids(backbone, prompt, s["tgt"]) for s in rows],
                   [shared_prompt_len(backbone, prompt, c) for c in contexts])


def collate(backbone: Backbone, data: SeqData, idx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (−100 outside target positions).

    ``labels[b, t]`` is the token to predict *from* position t (already shifted).
    """
    seqs = [data.contexts[i] + data.targets[i][:-1] for i in idx]
    width = max(len(s) for s in seqs)
    pad = backbone.tokenizer.pad_token_id or 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for b, i in enumerate(idx):
        s = seqs[b]
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
        start = len(data.contexts[i]) - 1
        labels[b, start:start + len(data.targets[i])] = torch.tensor(data.targets[i])
    dev = backbone.device
    return ids.to(dev), mask.to(dev), labels.to(dev)


def collate_own(backbone: Backbone, data: SeqData, idx, start: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``collate`` of the samples ``idx`` without their first ``start`` tokens (a shared prompt prefix whose keys and
    values are given as the past): right-padded ``input_ids`` (B, T) of the rest, the ``attention_mask`` (B,
    start + T) over past and rest, and ``labels`` (B, T)."""
    seqs = [(data.contexts[i] + data.targets[i][:-1])[start:] for i in idx]
    width = max(len(s) for s in seqs)
    pad = backbone.tokenizer.pad_token_id or 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), start + width), dtype=torch.long)
    mask[:, :start] = 1
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for b, i in enumerate(idx):
        s = seqs[b]
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, start:start + len(s)] = 1
        first = len(data.contexts[i]) - 1 - start
        labels[b, first:first + len(data.targets[i])] = torch.tensor(data.targets[i])
    dev = backbone.device
    return ids.to(dev), mask.to(dev), labels.to(dev)


def length_buckets(data: SeqData, size: int, frozen_prefix: bool) -> list[list[int]]:
    """Fixed mini-batches of ``size`` samples of similar lengths (less padding than random batches), samples with
    the same shared prefix together when that prefix is given as the past (``frozen_prefix``); a training loop
    shuffles their order every epoch. Lengths count the tokens a step computes: without the prefix when it is the
    past."""
    def key(i):
        p = data.shared_len(i) if frozen_prefix else 0
        return (p, len(data.contexts[i]) + len(data.targets[i]) - p, i)
    order = sorted(range(len(data)), key=key)
    out: list[list[int]] = []
    for i in order:
        p = data.shared_len(i) if frozen_prefix else 0
        if out and len(out[-1]) < size and (not frozen_prefix or data.shared_len(out[-1][0]) == p):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def target_logits(backbone: Backbone, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits (B, T, V) of the backbone with whatever hooks are attached."""
    fc, _ = backbone.forward_fc(ids, attention_mask=mask)
    return backbone.logits_from_fc(fc)


def nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean NLL over target positions."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def heldout_nll(backbone: Backbone, data: SeqData, batch_size: int = 8) -> float:
    """Token-weighted mean NLL over a data set (no gradients)."""
    tot, n = 0.0, 0
    with torch.no_grad():
        for b0 in range(0, len(data), batch_size):
            ids, mask, labels = collate(backbone, data, range(b0, min(len(data), b0 + batch_size)))
            k = int((labels != -100).sum())
            tot += float(nll(target_logits(backbone, ids, mask), labels)) * k
            n += k
    return tot / max(n, 1)


def split_for_early_stopping(train: SeqData, seed: int = 123, max_samples: int = 500,
                             frac: float = 0.1) -> tuple[SeqData, SeqData]:
    """Split the memory's *training* samples into (samples to train on, samples to early-stop on): a seeded
    ``frac`` of them (at least one, at most ``max_samples``), as ``plugins.training.early_stopping_split`` does for
    PEMA's entries. The memory's held-out samples are never used: they are what ``eval --memory`` and the Studio's
    Evaluate tab report on. A memory with a single training sample cannot spare one: then both are that sample."""
    if len(train) < 2:
        return train, train
    keep, stop = early_stopping_split(np.arange(len(train)), frac=frac, seed=seed, max_samples=max_samples)
    return train.pick(keep), train.pick(stop)
