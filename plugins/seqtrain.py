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
from memories.build import target_ids
from memories.store import Memory


@dataclass
class SeqData:
    contexts: list[list[int]]
    targets: list[list[int]]

    def __len__(self) -> int:
        return len(self.contexts)


def memory_sequences(backbone: Backbone, memory: Memory, split: str = "train") -> SeqData:
    """The (context, target) token sequences of a memory's samples of one split (train / heldout)."""
    prompt = memory.prompt
    rows = memory.split_samples(split)
    return SeqData([backbone.encode_context(prompt.render(s["src"])) for s in rows],
                   [target_ids(backbone, prompt, s["tgt"]) for s in rows])


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


def split_for_early_stopping(train: SeqData, heldout: SeqData, seed: int = 123) -> tuple[SeqData, SeqData]:
    """Use the memory's held-out samples; a memory with none gives up a tenth of its training samples."""
    if len(heldout):
        return train, heldout
    k = max(1, len(train) // 10)
    order = np.random.default_rng(seed).permutation(len(train))
    h, t = sorted(order[:k]), sorted(order[k:]) or sorted(order[:k])
    pick = lambda d, ix: SeqData([d.contexts[i] for i in ix], [d.targets[i] for i in ix])  # noqa: E731
    return pick(train, t), pick(train, h)
