"""The data owner's decode: ``engine``'s batch plan, steps and token selection (``decode_loop``), with the
backbone's forward passes run by the model owner in a decode session.

Per step the owner returns f(c) of every live row (and P_LM, by ``lm``); this side projects each output-level
plug-in's extra states (PEMA's h_pd) through its own copy of the final norm and W_hd, lets the plug-in mix its rows
(``engine.mix_step``: ``plugin_logprobs`` + ``mix_lambdas``, kNN's search over the private memory included),
picks the tokens (greedy, or beam search) and sends them back. With ``lm="none"`` the owner sends f(c) only and this
side computes P_LM too, with ``engine.decode_step`` itself (the local arithmetic). The plug-ins never leave
this side. In-network plug-ins cannot be offsite (they act inside the owner's decoder).
"""
from __future__ import annotations

import json
import time

import torch

from backbone.prompts import Prompt
from engine import PrefixKV, Row, decode_loop, plan_batch
from ground.errors import UserError
from offsite.client import NOT_OFFSITE, RemoteBackbone
from offsite.protocol import LM_MODES
from plugins.api import plugin_folder
from plugins.base import Plugin, load_plugin
from plugins.registry import get_method


def check_offsite_method(method: str) -> None:
    """A UserError unless ``method`` acts on the output distribution only (PEMA, kNN)."""
    cls = get_method(method)
    if cls.level != "output":
        raise UserError(NOT_OFFSITE.format(what=f"{cls.title} ({method})"))


def open_offsite_plugin(ref: str, backbone, catalog=None) -> Plugin:
    """Load a plug-in for an offsite decode, refusing an in-network one before anything is built."""
    path = plugin_folder(ref, catalog)
    try:
        method = json.loads((path / "plugin_config.json").read_text(encoding="utf-8")).get("method")
    except (OSError, ValueError, AttributeError):
        method = None  # load_plugin names the problem
    if isinstance(method, str):
        check_offsite_method(method)
    return load_plugin(path, backbone)


def compare_remote(backbone: RemoteBackbone, source: str, rows: list[Row], prompt: Prompt | None = None,
                   max_new_tokens: int = 64, num_beams: int = 1, trace: bool = True,
                   context_ids: list[int] | None = None, use_prefix_cache: bool = True,
                   no_repeat_ngram: int | None = None, lm: str = "full"):
    """``engine.compare`` with the owner's decoder: one session of every row × beam, the same batch layout,
    settings, mixing and selection, the same ``Comparison``. ``lm``: how P_LM comes (``offsite.protocol``)."""
    t0 = time.time()
    if lm not in LM_MODES:
        raise UserError(f"The P_LM mode must be one of {', '.join(LM_MODES)}, not {lm!r}.")
    for r in rows:
        if r.plugin is not None and r.plugin.level != "output":
            raise UserError(NOT_OFFSITE.format(what=f"The row {r.label!r} ({r.plugin.title})"))
    batch = plan_batch(backbone, [source], rows, prompt, num_beams, [context_ids] if context_ids else None,
                       {} if no_repeat_ngram is None else {"no_repeat_ngram": no_repeat_ngram})
    limit = int(backbone.info["limits"]["max_steps"]) + 1
    if max_new_tokens > limit:
        raise UserError(f"The model owner allows {limit - 1} decode steps per session: ask for at most {limit} new "
                        f"tokens.")
    ctx = batch.contexts[0]
    P = PrefixKV.shared_len(backbone, batch.prompt, source, ctx) if use_prefix_cache else 0
    N, B = batch.N, batch.B
    with backbone.client.open_session(ctx, rows=N, prefix_len=P, lm=lm) as session:
        fc_first = session.fc.to(backbone.device, backbone.dtype).repeat(N, 1)
        lm_first = session.lm.float().to(backbone.device).repeat(N, 1) if session.lm is not None else None

        def forward(last, next_tok, src, beams):
            fc_last, lm_lp = last
            live = [b for b in range(N) if not beams.done[b // B]]  # finished rows: pad goes in, nothing back
            fc_new, lm_new = session.step(next_tok.tolist(), src.tolist() if B > 1 else None, live)
            idx = torch.tensor(live, dtype=torch.long)
            if B > 1:  # beams continue other beams: their stale rows follow, as the cache did
                fc_last = fc_last[src.to(fc_last.device)]
                lm_lp = lm_lp[src.to(lm_lp.device)] if lm_lp is not None else None
            fc_last = fc_last.clone()
            fc_last[idx] = fc_new.to(backbone.device, backbone.dtype)
            if lm_lp is not None:
                lm_lp = lm_lp.clone()
                lm_lp[idx] = lm_new.float().to(lm_lp.device)
            return fc_last, lm_lp

        return decode_loop(backbone, batch, (fc_first, lm_first), forward, max_new_tokens, trace, t0=t0)[0]


def decode_batch_remote(backbone: RemoteBackbone, sources: list[str], rows: list[Row], prompt: Prompt | None = None,
                        max_new_tokens: int = 64, num_beams: int = 1, trace: bool = True,
                        contexts: list[list[int]] | None = None, use_prefix_cache: bool = True,
                        no_repeat_ngram: int | None = None, lm: str = "none") -> list:
    """``engine.decode_batch``'s call answered through the owner: one decode session per source
    (:func:`compare_remote`), so ``eval.run.evaluate`` scores base, PEMA and kNN rows offsite (``decode=``). Each
    source decodes alone, as the local ``decode_batch`` does with one source per batch."""
    if contexts is not None and len(contexts) != len(sources):
        raise ValueError(f"{len(contexts)} contexts for {len(sources)} sources")
    return [compare_remote(backbone, s, rows, prompt, max_new_tokens=max_new_tokens, num_beams=num_beams,
                           trace=trace, context_ids=contexts[i] if contexts else None,
                           use_prefix_cache=use_prefix_cache, no_repeat_ngram=no_repeat_ngram, lm=lm)
            for i, s in enumerate(sources)]
