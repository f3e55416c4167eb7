"""Teacher-forced scoring of output-level plug-ins (PEMA, kNN) on many dev pairs: a cheap tuning signal.

A BLEU sweep decodes every dev sentence once per setting (minutes per setting for 100 sentences on 2 cores), so
the BLEU tuning in ``eval.quality`` sees only a few dozen items. Here each dev pair's reference is fed to the
backbone once (a memory of dev hidden states, the same capture as a training memory), and every decode setting is
scored on every reference token from those states: the mean negative log-likelihood of the reference token
(what kNN-LM tunes on) and top-1 agreement (how often the greedy choice at that step is the reference token,
given the reference prefix). Both use the plug-in's own ``mix`` with the decode step and source length of each
token, so Gradual Unrolling's λ_t is the one a decode would use.

    python -m eval.likelihood --plugin pema-1a2b --task translation --dev 0:1000
    python -m eval.likelihood --plugin pema-1a2b --plugin knn-3c4d --dev 0:1000 --json out/lik.json
    python -m eval.likelihood --plugin pema-1a2b --heldout     # its memory's held-out samples (in-domain)

What it cannot see: exposure bias (a free-running decode conditions on its own earlier choices), so the BLEU of
the chosen setting is still measured by ``eval.quality`` on report items. Use it as a screen: on formality its
top-1 choice (PEMA λ 0.4 without GU) collapsed the decode (BENCHMARKS.md, "Formality").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from backbone import load_backbone
from backbone.prompts import Prompt
from backbone.tasks import task_prompt
from engine.protocol import MixInput, mix_logprobs
from eval.datasets import task_pairs
from eval.run import format_table
from ground.cli import progress_bar, run_main
from ground.settings import SettingsRecord
from ground.store import Catalog
from memories.build import build_memory
from memories.parse import Sample
from memories.store import Memory
from plugins.api import open_memory, open_plugin
from plugins.settings import decode_grid

# Scoring a setting costs little more than its λ_t (P_plugin is shared, see score_plugins), so the teacher-forced
# grids (each declared setting's ``fine_grid``) are finer than the BLEU grid of eval.quality (``grid``).


def best_likelihood_setting(rows: list[dict]) -> dict:
    """The tuning criterion: the highest top-1 agreement (a greedy decode emits the argmax), then the lowest NLL.
    rows[0] is the base model."""
    return max(rows[1:], key=lambda r: (r["top1"], -r["nll"]))["settings"]


def entry_steps(entry_sample: np.ndarray) -> np.ndarray:
    """The decode step of every entry: its position within its sample (entries of a sample are consecutive)."""
    es = np.asarray(entry_sample)
    if len(es) == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.r_[True, es[1:] != es[:-1]]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(es)), 0))
    return np.arange(len(es)) - first


def dev_memory(backbone, prompt, pairs: list[tuple[str, str]], cache_root: Path, task: str, progress=None):
    """A memory of the dev pairs' hidden states (no held-out split), cached by content under ``cache_root``."""
    h = hashlib.sha256(json.dumps([backbone.fingerprint, prompt.to_dict(), pairs], ensure_ascii=False)
                       .encode()).hexdigest()[:16]
    path = Path(cache_root) / f"dev-{task}-{h}"
    if (path / "meta.json").exists():
        return Memory.load(path, backbone)
    # examples="given": the scored pairs must never be the prompt's examples
    return build_memory(backbone, [Sample(s, t, i + 1) for i, (s, t) in enumerate(pairs)], path, prompt=prompt,
                        examples="given", task=task, heldout_frac=0.0, key_dtype="float32", batch_size=16,
                        max_target_tokens=1024,  # score long reference sentences too (training memories stop at 256)
                        progress=progress or (lambda f, m: None))


def _extra_logits(backbone, plugin, fc_bb: torch.Tensor, settings: list[SettingsRecord]) -> torch.Tensor | None:
    """The logits of the plug-in's extra states, as a decode computes them (``engine``)."""
    extra = plugin.extra_states(fc_bb, settings)
    if extra is None:
        return None
    vocab = plugin.head_vocab()
    normed = backbone.final_norm(extra.to(backbone.dtype))
    return backbone.head_logits(normed) if vocab is None else backbone.head_logits_subset(normed, vocab)


def interpolated_scores(lm_lp: torch.Tensor, plp: torch.Tensor, lams: list[torch.Tensor], y: torch.Tensor,
                        top_k: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each λ vector (n,): log P(y) and the argmax of the mixture λ·P_plugin + (1−λ)·P_LM, without mixing the
    whole vocabulary.

    The argmax is searched among the top-k tokens of either side; a token outside both has P_LM and P_plugin no
    larger than the k-th values, so (the mixture being increasing in both) its mixed probability is bounded by the
    mixture of the k-th values. Rows whose best candidate does not beat that bound are mixed in full, so the
    result is exact. The top-k and the gathers are shared by all λ vectors."""
    y = y[:, None]
    lm_y, p_y = lm_lp.gather(1, y), plp.gather(1, y)
    k = min(top_k, lm_lp.shape[1])
    lm_top, p_top = lm_lp.topk(k, dim=1), plp.topk(k, dim=1)
    cand = torch.cat([lm_top.indices, p_top.indices], 1)
    lm_c, p_c = lm_lp.gather(1, cand), plp.gather(1, cand)
    lm_k, p_k = lm_top.values[:, -1:], p_top.values[:, -1:]
    out = []
    for lam in lams:
        logp_y = mix_logprobs(lm_y, p_y, lam)[:, 0]
        best, arg = mix_logprobs(lm_c, p_c, lam).max(1)
        pred = cand.gather(1, arg[:, None])[:, 0]
        unsure = ~(best > mix_logprobs(lm_k, p_k, lam)[:, 0])
        if bool(unsure.any()):
            pred[unsure] = mix_logprobs(lm_lp[unsure], plp[unsure], lam[unsure]).argmax(1)
        out.append((logp_y, pred))
    return out


def score_plugins(backbone, jobs: list[tuple], keys: np.ndarray, values: np.ndarray, steps: np.ndarray,
                  src_lens: np.ndarray, chunk: int = 128, progress=lambda f, m: None) -> list[list[dict]]:
    """Mean NLL and top-1 agreement of the reference tokens under the base model and under each (plug-in, grid)
    job's settings; one table per job, each starting with the base row.

    The LM head runs once per token for all jobs. An interpolating plug-in (PEMA, kNN) gets P_plugin once per
    distribution (``OutputPlugin.distribution_key``: PEMA has one for every λ_max/GU setting, kNN one per k/T) and each
    setting only its λ_t (``interpolated_scores``); any other output-level plug-in is scored through its full
    ``mix`` per setting."""
    prepared = []
    for plugin, grid in jobs:
        plugin.prepare_decode()
        settings = [plugin.settings(g) for g in grid]
        by_dist: dict[tuple, list[int]] = {}
        for j, s in enumerate(settings):
            by_dist.setdefault(plugin.distribution_key(s) if plugin.interpolates else (j,), []).append(j)
        prepared.append((plugin, settings, by_dist, np.zeros(len(grid)), np.zeros(len(grid))))
    base_nll = base_hit = 0.0
    order = np.lexsort((np.arange(len(steps)), steps))  # group by step: MixInput has one step for its rows
    groups = np.split(order, np.flatnonzero(np.diff(steps[order])) + 1) if len(order) else []
    batches = [g[i:i + chunk] for g in groups for i in range(0, len(g), chunk)]
    n_settings = 1 + sum(len(g) for _, g in jobs)
    done = 0
    with torch.no_grad():
        for b in batches:
            b = np.sort(b)  # sorted: friendlier reads from a memory-mapped file
            fc = torch.from_numpy(np.asarray(keys[b], dtype=np.float32)).to(backbone.device)
            fc_bb = fc.to(backbone.dtype)  # what a decode hands the plug-in
            y = torch.from_numpy(np.asarray(values[b], dtype=np.int64)).to(backbone.device)
            lm_lp = torch.log_softmax(backbone.logits_from_fc(fc), dim=-1)
            base_nll -= float(lm_lp.gather(1, y[:, None]).sum())
            base_hit += float((lm_lp.argmax(1) == y).sum())
            for plugin, settings, by_dist, nll, hit in prepared:
                for js in by_dist.values():
                    first = [settings[js[0]]] * len(b)
                    inp = MixInput(fc=fc_bb, lm_logprobs=lm_lp, step=int(steps[b[0]]),
                                   extra_logits=_extra_logits(backbone, plugin, fc_bb, first),
                                   src_len=[int(x) for x in src_lens[b]], settings=first)
                    if plugin.interpolates:
                        lams = []
                        for j in js:
                            inp.settings = [settings[j]] * len(b)
                            lams.append(torch.tensor(plugin.mix_lambdas(inp), dtype=lm_lp.dtype, device=lm_lp.device))
                        scores = interpolated_scores(lm_lp, plugin.plugin_logprobs(inp)[0], lams, y)
                    else:
                        scores = []
                        for j in js:
                            inp.settings = [settings[j]] * len(b)
                            lp = plugin.mix(inp).logprobs
                            scores.append((lp.gather(1, y[:, None])[:, 0], lp.argmax(1)))
                    for j, (logp_y, pred) in zip(js, scores):
                        nll[j] -= float(logp_y.sum())
                        hit[j] += float((pred == y).sum())
            done += len(b)
            progress(done / len(steps), f"scored {done}/{len(steps)} reference tokens × {n_settings} settings")
    n = max(1, len(steps))
    base = {"label": "base", "settings": {}, "nll": round(base_nll / n, 4), "top1": round(base_hit / n, 4)}
    return [[base] + [{"label": json.dumps(g), "settings": g, "nll": round(nll[j] / n, 4), "top1": round(hit[j] / n, 4)}
                      for j, g in enumerate(grid)]
            for (_, grid), (_, _, _, nll, hit) in zip(jobs, prepared)]


def score_settings(backbone, plugin, keys: np.ndarray, values: np.ndarray, steps: np.ndarray,
                   src_lens: np.ndarray, grid: list[dict], chunk: int = 128, progress=lambda f, m: None) -> list[dict]:
    """``score_plugins`` for one plug-in: its table, base row first."""
    return score_plugins(backbone, [(plugin, grid)], keys, values, steps, src_lens, chunk, progress)[0]


def tune_settings(backbone, plugins: list, pairs: list[tuple[str, str]], prompt, task: str, cache_root: Path,
                  progress=None) -> list[tuple[dict, list[dict]]]:
    """Score each plug-in's declared fine grid teacher-forced on ``pairs`` (one pass, the LM head shared); per plug-in
    the best setting (``best_likelihood_setting``) and the table. The dev memory is cached by content."""
    progress = progress or (lambda f, m: None)
    mem = dev_memory(backbone, prompt, pairs, cache_root, task, lambda f, m: progress(0.2 * f, m))
    sample_of = np.asarray(mem.entry_sample)
    src_len = np.array([len(backbone.encode_target(s["src"].strip())) for s in mem.samples])
    tables = score_plugins(backbone, [(p, decode_grid(type(p), fine=True)) for p in plugins], mem.keys, mem.values,
                           entry_steps(sample_of), src_len[sample_of], progress=lambda f, m: progress(0.2 + 0.8 * f, m))
    return [(best_likelihood_setting(t), t) for t in tables]


class FullMix:
    """A plug-in seen as non-interpolating: ``score_settings`` then mixes the whole vocabulary per setting."""

    interpolates = False

    def __init__(self, plugin):
        self._plugin = plugin

    def __getattr__(self, name):
        return getattr(self._plugin, name)


def apply_config(plugin, items: list[str]) -> None:
    """``KEY=JSON`` overrides of a loaded plug-in's config (fields read at decode time, e.g. PEMA's
    ``decode_vocab``); validated like a training config."""
    for it in items:
        key, _, val = it.partition("=")
        if not hasattr(plugin.config, key):
            raise SystemExit(f"{plugin.method} has no config field {key!r}")
        try:
            setattr(plugin.config, key, json.loads(val))
        except json.JSONDecodeError:
            raise SystemExit(f"--config {it}: the value must be JSON (a string needs quotes: {key}='\"...\"')")
    plugin.config.validate()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.likelihood", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plugin", action="append", required=True, help="output-level plug-in id (repeatable)")
    ap.add_argument("--task", default="translation", choices=["translation", "formality"])
    ap.add_argument("--dev", default="0:1000", help="START:N of dev pairs (keep them apart from report items)")
    ap.add_argument("--heldout", action="store_true",
                    help="score on the held-out samples of each plug-in's own memory instead of dev pairs "
                         "(in-domain: the same corpus as the training pairs)")
    ap.add_argument("--grid", default=None, help='JSON list of settings (default: a λ/GU or k/T/λ grid)')
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                    help='change a decode-time config field of the plug-ins, e.g. decode_vocab=\'"full"\'')
    ap.add_argument("--full-mix", action="store_true",
                    help="score every setting through the plug-in's whole-vocabulary mix (slow: the reference "
                         "that the shared-distribution scoring is checked against)")
    ap.add_argument("--backbone", default=None)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)

    cat = Catalog(args.data_dir)
    bb = load_backbone(args.backbone, data_dir=args.data_dir)
    start, n = map(int, args.dev.split(":"))
    pairs = task_pairs(args.task, "dev", start, n)
    result = {"task": args.task, "backbone": bb.name, "dev_items": args.dev, "plugins": {}}
    mem = None
    for ref in args.plugin:
        plugin = open_plugin(ref, bb, cat)
        apply_config(plugin, args.config)
        if plugin.level != "output":
            raise SystemExit(f"{ref} is an in-network plug-in; teacher-forced mixing applies to output-level ones")
        prompt = Prompt.from_dict(plugin.memory_meta["prompt"]) if plugin.memory_meta.get("prompt") \
            else task_prompt(args.task, bb)
        if args.heldout:  # the plug-in's own memory's held-out samples: same corpus as its training pairs
            mem = open_memory(plugin.memory_meta["id"], bb, cat)
            keys, values, sample_of = mem.heldout_keys, mem.heldout_values, np.asarray(mem.heldout_entry_sample)
            where = f"the held-out samples of memory {mem.id}"
        else:
            if mem is None or mem.prompt.to_dict() != prompt.to_dict():
                with progress_bar("dev memory") as prog:
                    mem = dev_memory(bb, prompt, pairs, cat.root / "eval-cache", args.task, prog)
            keys, values, sample_of = mem.keys, mem.values, np.asarray(mem.entry_sample)
            where = f"dev {args.dev}"
        steps = entry_steps(sample_of)
        src_len = np.array([len(bb.encode_target(s["src"].strip())) for s in mem.samples])
        grid = json.loads(args.grid) if args.grid else decode_grid(type(plugin), fine=True)
        scored = FullMix(plugin) if args.full_mix else plugin
        t0 = time.time()
        with progress_bar(f"score {ref}") as prog:
            rows = score_settings(bb, scored, keys, values, steps, src_len[sample_of], grid, progress=prog)
        seconds = round(time.time() - t0, 1)
        result["plugins"][ref] = {"method": plugin.method, "scored_on": where, "tokens": int(len(steps)),
                                  "full_mix": args.full_mix, "seconds": seconds, "rows": rows}
        print(f"\n{ref} ({plugin.method}), {len(steps)} reference tokens of {where}, {len(grid)} settings "
              f"scored in {seconds} s; best: {json.dumps(best_likelihood_setting(rows))}")
        print(format_table([{"label": r["label"], "nll": r["nll"], "top1": r["top1"]} for r in rows], digits=4))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    run_main(main)
