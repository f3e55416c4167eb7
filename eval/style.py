"""Style evaluation: a Shakespeare-style classifier trained inside the project, and LM perplexity.

Why our own classifier: the style-transfer benchmark needs "how Shakespearean is this output?", offline and
reproducible, without downloading a fine-tuned RoBERTa. A logistic regression over hashed word and character
n-grams separates Shakespeare from modern news English well (see :func:`heldout_accuracy`), trains in seconds on
CPU, and saves as plain JSON + a ``.npy`` weight vector (no pickle: a saved model is data, never code).

Features are hashed with ``zlib.crc32`` (stable across Python runs and versions, unlike ``hash()``), so a saved
model keeps working anywhere. Training is a few lines of numpy (sparse gradients via ``np.bincount``).
"""
from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path

import numpy as np

from eval.datasets import shakespeare_lines, wmt_pairs
from ground.errors import UserError

FORMAT = "pema-style-classifier/1"
CONFIG_FILE = "style_classifier.json"
WEIGHTS_FILE = "style_classifier_weights.npy"

_WORD_RE = re.compile(r"[a-z]+(?:'[a-z]+)*|[0-9]+|[^\sa-z0-9]", re.IGNORECASE)


class StyleClassifier:
    """P(text is in the target style), by logistic regression on hashed n-gram features.

    Features of a text (lower-cased, curly apostrophes made straight): word 1- and 2-grams and character 2- to
    4-grams of the text padded with spaces; each hashed into ``n_buckets`` buckets; the count vector is scaled to
    unit L2 norm so long and short texts are comparable.
    """

    def __init__(self, n_buckets: int = 2 ** 18, char_ngrams: tuple[int, int] = (2, 4), word_ngrams: int = 2,
                 positive_label: str = "shakespeare", negative_label: str = "plain English"):
        self.n_buckets = int(n_buckets)
        self.char_ngrams = (int(char_ngrams[0]), int(char_ngrams[1]))
        self.word_ngrams = int(word_ngrams)
        self.positive_label = positive_label
        self.negative_label = negative_label
        self.weights = np.zeros(self.n_buckets, dtype=np.float32)
        self.bias = 0.0
        self.info: dict = {}

    # --- features ---------------------------------------------------------------------------------------------
    def features(self, text: str) -> tuple[list[int], list[float]]:
        """Bucket ids and unit-norm weights of one text's hashed n-grams."""
        t = " ".join(text.replace("’", "'").replace("‘", "'").lower().split())
        grams = []
        words = _WORD_RE.findall(t)
        for n in range(1, self.word_ngrams + 1):
            grams += ["w:" + " ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
        padded = f" {t} "
        lo, hi = self.char_ngrams
        for n in range(lo, hi + 1):
            grams += ["c:" + padded[i:i + n] for i in range(len(padded) - n + 1)]
        counts: dict[int, float] = {}
        for g in grams:
            b = zlib.crc32(g.encode("utf-8")) % self.n_buckets
            counts[b] = counts.get(b, 0.0) + 1.0
        norm = math.sqrt(sum(v * v for v in counts.values())) or 1.0
        return list(counts), [v / norm for v in counts.values()]

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat bucket ids, their weights, and each text's start offset (every text has >= 1 feature)."""
        feats = [self.features(t) for t in texts]
        ids = np.fromiter((i for f in feats for i in f[0]), dtype=np.int64)
        wts = np.fromiter((w for f in feats for w in f[1]), dtype=np.float64)
        offsets = np.cumsum([0] + [len(f[0]) for f in feats[:-1]]).astype(np.int64)
        return ids, wts, offsets

    def _logits(self, ids: np.ndarray, wts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return np.add.reduceat(self.weights[ids].astype(np.float64) * wts, offsets) + self.bias

    # --- training / scoring --------------------------------------------------------------------------------------
    def fit(self, positives: list[str], negatives: list[str], epochs: int = 4, lr: float = 0.05,
            l2: float = 1e-6, batch_size: int = 256, seed: int = 0) -> "StyleClassifier":
        """Train on style examples (label 1) and plain examples (label 0), classes weighted to count equally.

        Minibatch Adam on the weighted logistic loss with a small L2 penalty, in numpy: the gradient of a hashed
        linear model is a ``bincount`` over the batch's bucket ids. Deterministic for a given seed.
        """
        positives, negatives = [t for t in positives if t.strip()], [t for t in negatives if t.strip()]
        if not positives or not negatives:
            raise UserError("The style classifier needs examples of both the style and plain text.")
        texts = positives + negatives
        y = np.array([1.0] * len(positives) + [0.0] * len(negatives))
        class_w = np.where(y > 0, len(texts) / (2 * len(positives)), len(texts) / (2 * len(negatives)))
        feats = [(np.asarray(i, dtype=np.int64), np.asarray(w, dtype=np.float64))
                 for i, w in (self.features(t) for t in texts)]

        rng = np.random.default_rng(seed)
        w = np.zeros(self.n_buckets)
        b = 0.0
        m_w, v_w, m_b, v_b = np.zeros_like(w), np.zeros_like(w), 0.0, 0.0
        beta1, beta2, eps, step = 0.9, 0.999, 1e-8, 0
        for _ in range(epochs):
            order = rng.permutation(len(texts))
            for start in range(0, len(texts), batch_size):
                idx = order[start:start + batch_size]
                ids = np.concatenate([feats[k][0] for k in idx])
                wts = np.concatenate([feats[k][1] for k in idx])
                lens = np.array([len(feats[k][0]) for k in idx])
                offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
                z = np.add.reduceat(w[ids] * wts, offsets) + b
                p = 1.0 / (1.0 + np.exp(-z))
                g = class_w[idx] * (p - y[idx]) / class_w[idx].sum()  # d(weighted mean loss)/dz
                grad_w = np.bincount(ids, weights=wts * np.repeat(g, lens), minlength=self.n_buckets) + 2 * l2 * w
                grad_b = float(g.sum())
                step += 1
                m_w = beta1 * m_w + (1 - beta1) * grad_w
                v_w = beta2 * v_w + (1 - beta2) * grad_w ** 2
                m_b = beta1 * m_b + (1 - beta1) * grad_b
                v_b = beta2 * v_b + (1 - beta2) * grad_b ** 2
                c1, c2 = 1 - beta1 ** step, 1 - beta2 ** step
                w -= lr * (m_w / c1) / (np.sqrt(v_w / c2) + eps)
                b -= lr * (m_b / c1) / (math.sqrt(v_b / c2) + eps)
        self.weights = w.astype(np.float32)
        self.bias = float(b)
        self.info = {"n_positive": len(positives), "n_negative": len(negatives), "epochs": epochs, "lr": lr,
                     "l2": l2, "seed": seed}
        return self

    def score(self, texts: list[str]) -> list[float]:
        """P(style) for each text, in [0, 1]."""
        texts = list(texts)
        if not texts:
            return []
        z = self._logits(*self._encode(texts))
        return [float(x) for x in 1.0 / (1.0 + np.exp(-z))]

    def accuracy(self, positives: list[str], negatives: list[str], threshold: float = 0.5) -> float:
        """Fraction of ``positives`` scored >= threshold plus ``negatives`` scored below it."""
        sp, sn = self.score(positives), self.score(negatives)
        if not sp and not sn:
            raise UserError("No texts to measure accuracy on.")
        return (sum(s >= threshold for s in sp) + sum(s < threshold for s in sn)) / (len(sp) + len(sn))

    # --- persistence (JSON + .npy, no pickle) ---------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write ``style_classifier.json`` (settings, bias, training info) and the weight vector as ``.npy``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / WEIGHTS_FILE, self.weights.astype(np.float32), allow_pickle=False)
        config = {"format": FORMAT, "n_buckets": self.n_buckets, "char_ngrams": list(self.char_ngrams),
                  "word_ngrams": self.word_ngrams, "positive_label": self.positive_label,
                  "negative_label": self.negative_label, "bias": self.bias, "hash": "crc32", "info": self.info}
        (d / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "StyleClassifier":
        d = Path(directory)
        if not (d / CONFIG_FILE).is_file() or not (d / WEIGHTS_FILE).is_file():
            raise UserError(f"No saved style classifier in {d} (expected {CONFIG_FILE} and {WEIGHTS_FILE}).")
        config = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
        if config.get("format") != FORMAT:
            raise UserError(f"{d / CONFIG_FILE} is not a style classifier of format {FORMAT}.")
        clf = cls(config["n_buckets"], tuple(config["char_ngrams"]), config["word_ngrams"],
                  config.get("positive_label", "shakespeare"), config.get("negative_label", "plain English"))
        weights = np.load(d / WEIGHTS_FILE, allow_pickle=False)
        if weights.shape != (clf.n_buckets,):
            raise UserError(f"{d / WEIGHTS_FILE} has shape {weights.shape}, expected ({clf.n_buckets},).")
        clf.weights = weights.astype(np.float32)
        clf.bias = float(config["bias"])
        clf.info = config.get("info", {})
        return clf


# --- the project's Shakespeare classifier ------------------------------------------------------------------------
def train_shakespeare_classifier(root: str | Path | None = None, n_positive: int | None = None,
                                 n_negative: int | None = None, seed: int = 0, **fit_kwargs) -> StyleClassifier:
    """Train on Shakespeare train lines (style) vs the WMT train English side (plain), from the reference data."""
    pos = shakespeare_lines("train", 0, n_positive, root=root)
    neg = [en for en, _de in wmt_pairs("train", 0, n_negative, root=root)]
    return StyleClassifier().fit(pos, neg, seed=seed, **fit_kwargs)


def heldout_accuracy(clf: StyleClassifier, root: str | Path | None = None) -> dict:
    """Accuracy on Shakespeare dev (positive) vs WMT dev English (negative), plus per-class recall, since the
    two sets differ in size (500 vs 2,203)."""
    pos = shakespeare_lines("dev", root=root)
    neg = [en for en, _de in wmt_pairs("dev", root=root)]
    sp, sn = clf.score(pos), clf.score(neg)
    recall_pos = sum(s >= 0.5 for s in sp) / len(sp)
    recall_neg = sum(s < 0.5 for s in sn) / len(sn)
    acc = (recall_pos * len(sp) + recall_neg * len(sn)) / (len(sp) + len(sn))
    return {"accuracy": acc, "balanced_accuracy": (recall_pos + recall_neg) / 2, "recall_style": recall_pos,
            "recall_plain": recall_neg, "n_style": len(sp), "n_plain": len(sn)}


# --- perplexity --------------------------------------------------------------------------------------------------
def text_perplexities(texts: list[str], backbone, max_tokens: int = 512) -> list[float]:
    """Token perplexity of each text under ``backbone.model`` (a HF causal LM) with ``backbone.tokenizer``.

    Each text is scored alone (no padding effects): BOS is prepended when the tokenizer has one and did not add
    it, so the first word is scored too; texts are cut to ``max_tokens``; a text with fewer than 2 tokens gets nan.
    """
    import torch

    model, tok = backbone.model, backbone.tokenizer
    device = next(model.parameters()).device
    bos = getattr(tok, "bos_token_id", None)
    out = []
    for text in texts:
        ids = list(tok(text, add_special_tokens=True)["input_ids"])
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        ids = ids[:max_tokens]
        if len(ids) < 2:
            out.append(float("nan"))
            continue
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            logits = model(input_ids=x).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="mean")
        out.append(float(torch.exp(nll)))
    return out


def perplexity(texts: list[str], backbone, max_tokens: int = 512) -> float:
    """Mean over texts of each text's token perplexity (texts too short to score are left out)."""
    values = [v for v in text_perplexities(texts, backbone, max_tokens) if not math.isnan(v)]
    if not values:
        raise UserError("No text long enough to compute a perplexity.")
    return float(sum(values) / len(values))
