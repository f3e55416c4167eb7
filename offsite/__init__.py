"""Offsite: PEMA's premise as two processes.

The **model owner** serves only what PEMA says it hands over (``offsite.server``, ``python -m offsite serve``):
f(c) — the final norm's input — of contexts it is given (teacher-forced, batched), the frozen final norm and the LM
head W_hd, the tokenizer's files, and per-step decode sessions (f(c) of the last position and, on request, P_LM;
the KV cache stays with the owner). It never returns decoder weights.

The **data owner** (``offsite.client.RemoteBackbone``) builds its memory, trains PEMA or kNN and decodes with the
project's own code (``memories.build``, ``plugins.api.train_plugin``, the plug-ins' ``mix``); its samples' targets,
the memory and the plug-in never leave it (the contexts it asks f(c) of do: see docs/offsite.md).

Floor 6 (beside ``eval``): imports ground, backbone, engine, memories and plugins; only entry points import it.
"""
