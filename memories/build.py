"""Build an external memory from samples: every target token y_i becomes one entry (f(c_i), y_i).

Two build modes:

* ``teacher`` (default, fast): c_i = prompt(source) + y_<i, all positions of a batch of samples captured in one
  teacher-forced forward pass.
* ``offsite``: c_i = prompt(source) + ŷ_<i, the model's own greedy predictions, one step at a time — how the PEMA
  paper describes its memory ("Including ŵ1 in the input prompt extends it to the next context") and its public
  code builds it with ``generate`` (value = the reference token y_i at step i). Slow; offered so results can be
  compared faithfully.

The default departs from the PEMA paper (docs/methods.md says so): a teacher-forced build is one batched forward pass
per batch of samples where the paper's is one decode step per target token and sample, and its keys are the states
the reference prefix gives — what PEMA is trained to map to the next reference token. On 300 WMT pairs the two
builds gave PEMAs that are level on 200 dev items, the per-step build taking many times as long (BENCHMARKS.md,
"Starts, presets and calibration, checked on WMT dev items", row "the memory built from the model's own greedy prefix").

Monolingual samples (no source) first get a synthetic source from the backbone itself (German → English for
translation, styled → plain for rewriting), as the memory-augmented adapter paper builds pairs from target-side
text; the synthetic sources are kept in ``samples.jsonl`` so a person can inspect them.

Cancelling: every long phase — synthetic sources (``generate_greedy``, per batch), tokenizing (every
``CHECK_EVERY`` samples), capture (per batch) — calls ``should_stop`` at least once per batch; a job's
``should_stop`` is also where it hands the backbone to a waiting interactive user, so the backbone is never held
for longer than one batch. A cancelled or failed build leaves nothing (``atomic_dir``); with ``catalog`` the folder
and its catalog row appear in one step (``Catalog.publish``).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from backbone.model import Backbone, generate_greedy
from backbone.prompts import CHAT_REVERSE_TEMPLATES, REVERSE_TEMPLATES, Prompt, common_prefix_len
from ground.errors import Cancelled, UserError
from ground.lock import writer_tag
from ground.store import atomic_dir, write_json_atomic
from ground.text import check_name
from memories.nearness import MEASURE, NEAR_DUPLICATE, NgramIndex, near_duplicate_groups, nearness_profile
from memories.parse import Sample
from memories.store import FORMAT_VERSION, Memory, disk_bytes

Progress = Callable[[float, str], None]
ShouldStop = Callable[[], bool]


def _noop(*a) -> None:
    pass


def heldout_split(n: int, frac: float = 0.1, seed: int = 123, max_heldout: int = 500) -> np.ndarray:
    """A fixed, seeded random choice of held-out sample indices (at least 1 when there are ≥ 5 samples): how
    memories were split before ``grouped_heldout_split``, which takes as many."""
    if n < 5 or frac <= 0:
        return np.zeros(0, dtype=np.int64)
    k = min(max_heldout, max(1, int(round(n * frac))))
    return np.sort(np.random.default_rng(seed).permutation(n)[:k])


def grouped_heldout_split(sources: list[str], frac: float = 0.1, seed: int = 123, max_heldout: int = 500,
                          threshold: float = NEAR_DUPLICATE) -> tuple[np.ndarray, dict]:
    """Held-out sample indices chosen like new inputs: sources at word 1–3-gram Jaccard ≥ ``threshold`` are grouped
    (``memories.nearness.near_duplicate_groups``) and each group goes wholly to one side, as grouped
    cross-validation does, so no held-out sample has a near-duplicate among the training samples. The groups are
    taken in a seeded random order, each while it fits in the held-out size ``heldout_split`` would choose (a group
    larger than what is left stays in training; when no group fits, the smallest group that leaves training samples
    is held out whole, larger than asked). Without near-duplicates the choice is ``heldout_split``'s. Returns the
    sorted indices and what the split did (``meta.json``'s ``split``, without its profile)."""
    n = len(sources)
    info = {"method": "grouped", "measure": MEASURE, "threshold": threshold}
    if n < 5 or frac <= 0:
        return np.zeros(0, dtype=np.int64), {**info, "groups": n, "largest_group": 1 if n else 0,
                                             "grouped_samples": 0}
    k = min(max_heldout, max(1, int(round(n * frac))))
    group = near_duplicate_groups(sources, threshold)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        members.setdefault(g, []).append(i)
    ids = sorted(members)
    held: list[int] = []
    order = [members[ids[j]] for j in np.random.default_rng(seed).permutation(len(ids))]
    for m in order:
        if len(held) + len(m) <= k:
            held.extend(m)
            if len(held) == k:
                break
    if not held:  # every group is larger than the held-out size: the smallest one that leaves training samples
        fits = [m for m in order if len(m) < n]
        if fits:
            held = list(min(fits, key=len))
    sizes = [len(m) for m in members.values()]
    return np.sort(np.asarray(held, dtype=np.int64)), {
        **info, "groups": len(members), "largest_group": max(sizes), "grouped_samples": sum(s for s in sizes if s > 1)}


def split_profile(sources: list[str], heldout: set[int] | list[int]) -> dict:
    """How near the held-out sources are to the training ones: ``nearness_profile`` of each held-out source's
    nearest training source (Jaccard)."""
    held = set(heldout)
    index = NgramIndex([s for i, s in enumerate(sources) if i not in held])
    return nearness_profile(index.nearest([sources[i] for i in sorted(held)])[0])


FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504: larger magnitudes become inf in float16


class KeyFile:
    """The keys ``.npy`` of one split, written row by row into a memory-mapped array of the requested dtype.

    float16 halves the disk and RAM of a memory, but it stops at ±65,504 and Gemma 3's raw f(c) has an RMS near
    1,300 with a few much larger "massive" features: a key beyond the range would be stored as inf (and turn every
    kNN distance and PEMA loss that touches it into inf/NaN). So before each write the rows are checked: the first
    time a float16 file would overflow, the whole file switches to float32 (the rows already written are copied
    exactly) and the build goes on; ``dtype`` says what was stored. A non-finite hidden state from the backbone
    itself is a UserError.
    """

    def __init__(self, path: Path, dtype: str, shape: tuple[int, int]):
        self.path, self.shape = Path(path), shape
        self.arr = np.lib.format.open_memmap(self.path, mode="w+", dtype=dtype, shape=shape)

    @property
    def dtype(self) -> str:
        return str(self.arr.dtype)

    def __setitem__(self, index, rows) -> None:
        rows = np.asarray(rows)
        if rows.size and not np.isfinite(rows).all():
            raise UserError("The backbone produced non-finite hidden states (NaN or inf) for this input, so no "
                            "memory can be built from them; try another dtype for the backbone (e.g. --dtype "
                            "float32).")
        if self.arr.dtype == np.float16 and rows.size and float(np.abs(rows).max()) > FLOAT16_MAX:
            self._widen()
        self.arr[index] = rows

    def _widen(self) -> None:
        import os

        tmp = self.path.with_name(self.path.stem + ".float32.npy")
        wide = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=self.shape)
        for b0 in range(0, self.shape[0], 65536):
            wide[b0:b0 + 65536] = self.arr[b0:b0 + 65536]
        self.arr.flush()
        del self.arr
        os.replace(tmp, self.path)
        self.arr = wide

    def flush(self) -> None:
        self.arr.flush()


# Longest target (in backbone tokens) a memory takes: a longer one is almost always a whole paragraph pasted as
# one sample, and capturing it would dominate the batch's padding.
MAX_TARGET_TOKENS = 256


def target_ids(backbone: Backbone, prompt: Prompt, tgt: str) -> list[int]:
    """The target continuation's tokens, ending with the line-end token so a plug-in also learns to stop."""
    ids = backbone.encode_target(prompt.target_prefix + tgt)
    nl = backbone.encode_target("\n")
    return ids + (nl if len(nl) == 1 else [backbone.tokenizer.eos_token_id])


CHECK_EVERY = 256  # samples tokenized between two should_stop calls


def _encode_all(encode: Callable[[str], list[int]], texts: list[str], should_stop: ShouldStop | None) -> list:
    out = []
    for i, t in enumerate(texts):
        if should_stop is not None and i % CHECK_EVERY == 0 and should_stop():
            raise Cancelled()
        out.append(encode(t))
    return out


def synthesize_sources(backbone: Backbone, targets: list[str], task: str, progress: Progress = _noop,
                       max_new_tokens: int = 96, should_stop: ShouldStop | None = None) -> list[str]:
    """Ask the backbone for a plain source of each styled/German target (few-shot free, reverse template; an
    instruct backbone gets an instruction instead). ``should_stop`` is checked before every generated batch."""
    templates = CHAT_REVERSE_TEMPLATES if backbone.chat else REVERSE_TEMPLATES
    tpl = templates.get(task, templates["style"])
    rev = Prompt(template=tpl, chat=backbone.chat)
    ctxs = _encode_all(lambda t: backbone.encode_context(rev.render(t)), targets, should_stop)
    outs = generate_greedy(backbone, ctxs, max_new_tokens=max_new_tokens, progress=progress,
                           should_stop=should_stop)
    srcs = [backbone.decode(o).strip() for o in outs]
    # An empty synthetic source would make a useless pair: fall back on the target itself (identity pair).
    return [s if s else t for s, t in zip(srcs, targets)]


def _capture_teacher(backbone: Backbone, ctx: list[list[int]], tgt: list[list[int]], keys_out, values_out,
                     sample_out, sample_index: list[int], batch_size: int, progress: Progress,
                     should_stop: ShouldStop) -> float:
    """Teacher-forced batched capture. Writes entries in order; returns the sum of squares of the keys.

    The prompt prefix every sample shares (instruction + few-shot examples) is encoded once and its KV cache
    reused by every batch, so only each sample's own tokens are run.
    """
    import copy

    order = sorted(range(len(ctx)), key=lambda i: len(ctx[i]) + len(tgt[i]))  # length-sorted batches pad less
    offsets = np.cumsum([0] + [len(t) for t in tgt])
    pad = backbone.tokenizer.pad_token_id or 0
    dev = backbone.device
    P = max(0, min(common_prefix_len(ctx), min(len(c) for c in ctx) - 1))
    prefix_cache = None
    if P > 0:
        with torch.no_grad():
            _, out = backbone.forward_fc(torch.tensor([ctx[0][:P]], device=dev), use_cache=True)
        prefix_cache = out.past_key_values
    sumsq = 0.0
    done = 0
    for b0 in range(0, len(order), batch_size):
        if should_stop():
            raise Cancelled()
        idx = order[b0:b0 + batch_size]
        seqs = [ctx[i][P:] + tgt[i][:-1] for i in idx]  # the last target token is predicted, never input
        width = max(len(s) for s in seqs)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), P + width), dtype=torch.long)
        mask[:, :P] = 1
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.tensor(s)
            mask[r, P:P + len(s)] = 1
        past = None
        if prefix_cache is not None:
            past = copy.deepcopy(prefix_cache)
            past.batch_repeat_interleave(len(idx))
        with torch.no_grad():
            fc, _ = backbone.forward_fc(ids.to(dev), attention_mask=mask.to(dev), past_key_values=past,
                                        use_cache=past is not None)
        fc = fc.float().cpu()
        for r, i in enumerate(idx):
            start = len(ctx[i]) - 1 - P  # the position whose next token is y_0
            k = fc[r, start:start + len(tgt[i])]
            sumsq += float((k.double() ** 2).sum())
            keys_out[offsets[i]:offsets[i + 1]] = k.numpy()
            values_out[offsets[i]:offsets[i + 1]] = tgt[i]
            sample_out[offsets[i]:offsets[i + 1]] = sample_index[i]
        done += len(idx)
        progress(done / len(order), f"captured {done}/{len(order)} samples")
    return sumsq


def capture_entries(backbone: Backbone, ctx: list[list[int]], tgt: list[list[int]],
                    batch_size: int = 8) -> tuple[np.ndarray, float]:
    """One shard of a sharded teacher-forced build (a worker's part; ``studio.ray_executor``): the float32 keys of
    the samples' entries in order (len(tgt[0]) rows for the first sample, then the second's, ...) and their sum of
    squares. The caller knows the values (the target tokens) and the samples already."""
    n = int(sum(len(t) for t in tgt))
    keys = np.zeros((n, backbone.hidden_size), dtype=np.float32)
    vals, smp = np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
    sumsq = _capture_teacher(backbone, ctx, tgt, keys, vals, smp, list(range(len(ctx))), batch_size, _noop,
                             lambda: False) if ctx else 0.0
    return keys, sumsq


# A sharded capture (``build_memory(capture=...)``): fills keys / values / entry samples of one split like
# ``_capture_teacher`` — ``capture(ctx, tgt, keys_out, values_out, sample_out, sample_index, progress, should_stop)``
# → the keys' sum of squares — with the shards computed elsewhere (Ray workers, ``studio.ray_executor``).
Capture = Callable[..., float]


def _capture_offsite(backbone: Backbone, ctx: list[list[int]], tgt: list[list[int]], keys_out, values_out,
                     sample_out, sample_index: list[int], progress: Progress, should_stop: ShouldStop) -> float:
    """Per-step greedy generation (PEMA public code): at step i the context holds the model's own tokens."""
    offsets = np.cumsum([0] + [len(t) for t in tgt])
    sumsq = 0.0
    for i in range(len(ctx)):
        if should_stop():
            raise Cancelled()
        past = None
        inp = torch.tensor([ctx[i]], device=backbone.device)
        for step, y in enumerate(tgt[i]):
            with torch.no_grad():
                fc, out = backbone.forward_fc(inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            k = fc[0, -1].float().cpu()
            sumsq += float((k.double() ** 2).sum())
            keys_out[offsets[i] + step] = k.numpy()
            values_out[offsets[i] + step] = y
            sample_out[offsets[i] + step] = sample_index[i]
            pred = int(backbone.head_logits(backbone.final_norm(fc[:, -1:]))[0, -1].argmax())
            inp = torch.tensor([[pred]], device=backbone.device)
        progress((i + 1) / len(ctx), f"generated {i + 1}/{len(ctx)} samples")
    return sumsq


# A memory's prompt takes its few-shot examples from the memory's own training samples when it has at least this many
# training samples and twice as many usable distinct ones as the prompt has examples; else the prompt's own.
OWN_EXAMPLES_MIN_SAMPLES = 10
OWN_EXAMPLE_MAX_WORDS = 60  # a longer source or target is a paragraph: too long to repeat in every context


def choose_prompt_examples(srcs: list[str], tgts: list[str], synthetic: list[bool], train: list[int],
                           shots: int) -> list[int]:
    """The training samples whose pairs become the prompt's ``shots`` few-shot examples, or [] when there are too
    few (``OWN_EXAMPLES_MIN_SAMPLES``). Deterministic: among training samples (never held-out ones) with a source of
    their own (not a synthetic one), one line each side and at most ``OWN_EXAMPLE_MAX_WORDS`` words, one per distinct
    source, those whose source length in words is nearest the median of theirs — typical of the data, neither a
    fragment nor a paragraph — the earlier sample first on a tie."""
    if shots <= 0 or len(train) < OWN_EXAMPLES_MIN_SAMPLES:
        return []
    usable, seen = [], set()
    for i in train:
        s, t = srcs[i].strip(), tgts[i].strip()
        if synthetic[i] or not s or not t or "\n" in s or "\n" in t or s in seen \
                or max(len(s.split()), len(t.split())) > OWN_EXAMPLE_MAX_WORDS:
            continue
        seen.add(s)
        usable.append(i)
    if len(usable) < 2 * shots:
        return []
    lengths = sorted(len(srcs[i].split()) for i in usable)
    median = lengths[len(lengths) // 2]
    return sorted(usable, key=lambda i: (abs(len(srcs[i].split()) - median), i))[:shots]


def build_memory(backbone: Backbone, samples: list[Sample], out_dir: str | Path, *, prompt: Prompt | None = None,
                 examples: str = "own",
                 task: str = "translation", mode: str = "teacher", name: str = "", key_dtype: str = "float16",
                 heldout_frac: float = 0.1, seed: int = 123, batch_size: int = 8,
                 max_target_tokens: int = MAX_TARGET_TOKENS,
                 progress: Progress = _noop, should_stop: ShouldStop = lambda: False, catalog=None,
                 capture: Capture | None = None) -> Memory:
    """Build a memory folder atomically at ``out_dir`` and return it loaded.

    ``examples``: "own" (the default) replaces the few-shot examples of ``prompt`` by as many of the memory's own
    training samples (``choose_prompt_examples``), keeping its template; with too few samples, or with "given", the
    prompt's examples stay. ``meta.json`` records the prompt and where its examples came from
    (``prompt_examples``), so plug-ins train and decode with the prompt the memory was built with.

    ``capture`` (teacher mode): a sharded capture in place of the in-process one (``Capture``); tokenizing,
    synthetic sources, the split, the files and the catalog row stay here, so the result is the same memory
    (the same entries in order; keys equal within float tolerance: the batches are made differently).

    ``progress(fraction, message)`` is called throughout; ``should_stop()`` returning True cancels (nothing is
    left behind). With ``catalog`` (a ``Catalog`` or ``OwnedCatalog``) the memory is registered in the same step
    as its folder appears (``Catalog.publish``). Raises :class:`UserError` for bad input.
    """
    t0 = time.time()
    name = check_name(name, "memory name")
    if mode not in ("teacher", "offsite"):
        raise UserError(f"Unknown build mode {mode!r}; use 'teacher' or 'offsite'.")
    if key_dtype not in ("float16", "float32"):
        raise UserError("key_dtype must be float16 or float32.")
    if not samples:
        raise UserError("No samples to build a memory from.")
    if examples not in ("own", "given"):
        raise UserError(f"Unknown prompt examples {examples!r}; use 'own' or 'given'.")
    prompt = prompt or Prompt.for_task(task, chat=backbone.chat)
    srcs = [s.src for s in samples]
    tgts = [s.tgt for s in samples]
    synthetic = [s is None for s in srcs]
    if any(synthetic):
        todo = [i for i, s in enumerate(srcs) if s is None]
        progress(0.0, f"Making synthetic sources for {len(todo)} monolingual samples with the backbone")
        made = synthesize_sources(backbone, [tgts[i] for i in todo], task,
                                  progress=lambda f, m: progress(0.5 * f, "synthetic sources: " + m),
                                  should_stop=should_stop)
        for i, s in zip(todo, made):
            srcs[i] = s
    base = 0.5 if any(synthetic) else 0.0

    progress(base, "choosing held-out samples (near-duplicates kept on one side)")
    held_idx, split_info = grouped_heldout_split(srcs, heldout_frac, seed)
    held = set(held_idx.tolist())
    split_info["heldout_profile"] = split_profile(srcs, held) if held else {"n": 0}
    own = choose_prompt_examples(srcs, tgts, synthetic, [i for i in range(len(samples)) if i not in held],
                                 len(prompt.examples)) if examples == "own" else []
    if own:
        prompt = Prompt(template=prompt.template, examples=[(srcs[i].strip(), tgts[i].strip()) for i in own],
                        separator=prompt.separator, chat=prompt.chat)
        prompt_examples = {"source": "own", "samples": own, "lines": [samples[i].line for i in own]}
    else:
        prompt_examples = {"source": "given" if examples == "given" or not prompt.examples else "builtin"}
        if examples == "own" and prompt.examples:
            prompt_examples["reason"] = (f"fewer than {OWN_EXAMPLES_MIN_SAMPLES} training samples or than "
                                         f"{2 * len(prompt.examples)} usable distinct ones")
    ctx = _encode_all(lambda s: backbone.encode_context(prompt.render(s)), srcs, should_stop)
    tgt = []
    for i, t in enumerate(tgts):
        if i % CHECK_EVERY == 0 and should_stop():
            raise Cancelled()
        ids = target_ids(backbone, prompt, t)
        if len(ids) > max_target_tokens:
            raise UserError(f"line {samples[i].line}: the target has {len(ids)} tokens "
                            f"(limit {max_target_tokens}); split it into sentences.")
        tgt.append(ids)

    d = backbone.hidden_size
    out_dir = Path(out_dir)
    publish = catalog.publisher("memories", lambda tmp, final: memory_row(Memory.load(tmp), final)) \
        if catalog is not None else None
    with atomic_dir(out_dir, publish) as tmp:
        stats = {"samples": 0, "heldout_samples": 0, "entries": 0, "heldout_entries": 0}
        sumsq = 0.0
        stored_dtype = key_dtype  # becomes float32 when float16 keys would overflow (KeyFile)
        for part, sel in (("", [i for i in range(len(samples)) if i not in held]),
                          ("heldout_", sorted(held))):
            n = int(sum(len(tgt[i]) for i in sel))
            keys = KeyFile(tmp / f"{part}keys.npy", stored_dtype, (n, d))
            vals = np.lib.format.open_memmap(tmp / f"{part}values.npy", mode="w+", dtype=np.int32, shape=(n,))
            smp = np.lib.format.open_memmap(tmp / f"{part}entry_sample.npy", mode="w+", dtype=np.int32,
                                            shape=(n,))
            share = (1 - base) * (len(sel) / len(samples))
            lo = base + (0 if not part else (1 - base) * (1 - len(sel) / len(samples)))

            def prog(f, m, lo=lo, share=share, part=part):
                progress(lo + share * f, ("held-out " if part else "") + m)

            if sel:
                args = ([ctx[i] for i in sel], [tgt[i] for i in sel], keys, vals, smp, sel)
                if mode == "teacher" and capture is not None:
                    s2 = capture(*args, progress=prog, should_stop=should_stop)
                elif mode == "teacher":
                    s2 = _capture_teacher(backbone, *args, batch_size=batch_size, progress=prog,
                                          should_stop=should_stop)
                else:
                    s2 = _capture_offsite(backbone, *args, progress=prog, should_stop=should_stop)
                if not part:
                    sumsq = s2
            keys.flush()
            vals.flush()
            smp.flush()
            stored_dtype = keys.dtype
            del keys, vals, smp
            stats[f"{part}samples"] = len(sel)
            stats[f"{part}entries"] = n
        n_train = max(1, stats["entries"])
        stats["key_rms"] = float(np.sqrt(sumsq / (n_train * d))) if sumsq > 0 else 1.0
        stats["build_seconds"] = round(time.time() - t0, 2)
        stats["synthetic_sources"] = int(sum(synthetic))
        stats["unique_target_tokens"] = int(len({t for ids in tgt for t in ids}))
        with open(tmp / "samples.jsonl", "w", encoding="utf-8") as f:
            import json
            for i, s in enumerate(samples):
                f.write(json.dumps({"src": srcs[i], "tgt": tgts[i], "synthetic_src": synthetic[i],
                                    "split": "heldout" if i in held else "train", "line": s.line},
                                   ensure_ascii=False) + "\n")
        meta = {"format_version": FORMAT_VERSION, "id": out_dir.name, "name": name or out_dir.name,
                "backbone": backbone.name, "fingerprint": backbone.fingerprint, "task": task, "mode": mode,
                # the backbone's weight precision the keys f(c) were computed in (also in the fingerprint)
                "precision": getattr(backbone, "precision", "float32"),
                "prompt": prompt.to_dict(), "prompt_examples": prompt_examples, "key_dtype": stored_dtype,
                "requested_key_dtype": key_dtype,
                "hidden_size": d, "seed": seed,
                "heldout_frac": heldout_frac, "split": split_info, "created": time.time(), "stats": stats,
                "writer": writer_tag()}
        if should_stop():
            raise Cancelled()
        write_json_atomic(tmp / "meta.json", meta)
    progress(1.0, f"Memory built: {stats['entries']} entries from {stats['samples']} samples "
                  f"(+{stats['heldout_entries']} held-out entries from {stats['heldout_samples']} samples) "
                  f"in {stats['build_seconds']}s")
    return Memory.load(out_dir)


def memory_row(memory: Memory, path: str | Path | None = None) -> dict:
    """A built memory's catalog row (``path``: where the folder is or is about to be renamed to)."""
    import json

    s = memory.summary()
    return {"id": Path(path).name if path is not None else memory.id, "name": s["name"],
            "path": str(path if path is not None else memory.path), "backbone": s["backbone"],
            "fingerprint": memory.fingerprint, "task": s["task"], "mode": s["mode"],
            "samples": s["samples"] + s["heldout_samples"], "entries": s["entries"],
            "bytes": disk_bytes(memory.path), "created": memory.meta["created"],
            "meta": json.dumps(memory.meta["stats"])}


def register_memory(catalog, memory: Memory) -> None:
    """Add a built memory to the SQLite catalog (``build_memory(..., catalog=...)`` does it in one step with the
    folder; this is for a memory built without one)."""
    catalog.add_memory(memory_row(memory))
