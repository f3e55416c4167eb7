"""A tiny random backbone built in-process (no downloads): a 2-layer Llama with a 64-dim hidden size and a
byte-level BPE tokenizer trained on a few sentences. For unit tests and fast app tests only.
"""
from __future__ import annotations

import torch

from backbone.model import Backbone

TINY_CORPUS = [
    "English: the house is small\nGerman: das Haus ist klein",
    "English: the cat sleeps\nGerman: die Katze schlaeft",
    "Informal: gonna go home lol\nFormal: I am going to go home.",
    "Modern: you are kind\nShakespeare: thou art kind",
    "Translate this from English to German:\nGood morning\nGerman: Guten Morgen",
    "hello world, this is a tiny test corpus with numbers 0123456789 and punctuation .,;:!?'\"()-",
]


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TINY_CORPUS * 4, trainer)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def tiny_backbone(seed: int = 0, hidden: int = 64, layers: int = 2, device: str | None = None) -> Backbone:
    """``device`` defaults to ``$PEMA_TINY_DEVICE`` or the CPU (``PEMA_TINY_DEVICE=cuda`` runs the unit tests on a
    GPU)."""
    import os

    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # Larger-than-default init so that the random model's outputs are not nearly uniform.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)
    model.to(device or os.environ.get("PEMA_TINY_DEVICE") or "cpu")
    return Backbone(model=model, tokenizer=tok, name=f"tiny-llama-{hidden}x{layers}-seed{seed}")
