"""Evaluation: held-out data, metrics (BLEU/chrF, content similarity) and the style classifier."""
