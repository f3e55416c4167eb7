"""Token selection (greedy = beam search with one beam) and the repetition guard."""
from __future__ import annotations

import torch

from backbone.model import vocab_wide_threads
from engine.topk import top_k


class Beams:
    """Token selection for ``n_rows`` independent rows of ``num_beams`` beams each (batch row ``r·B + j``).

    Scores are summed log-probabilities (no length penalty). A row stops when it has B finished hypotheses, no live
    candidate, or a finished hypothesis scoring at least its best live one — exact, since scores only decrease.
    """

    def __init__(self, n_rows: int, num_beams: int, stop_ids, pad: int = 0):
        self.n_rows, self.B, self.stop_ids, self.pad = n_rows, num_beams, stop_ids, pad
        self.scores = torch.zeros(n_rows, num_beams)
        if num_beams > 1:
            self.scores[:, 1:] = float("-inf")  # all beams start identical: expand from the first only
        self.tokens: list[list[int]] = [[] for _ in range(n_rows * num_beams)]
        self.traces: list[list[dict]] = [[] for _ in range(n_rows * num_beams)]
        self.finished: list[list[tuple[float, list[int], list[dict]]]] = [[] for _ in range(n_rows)]
        self.done = [False] * n_rows

    @property
    def all_done(self) -> bool:
        return all(self.done)

    def select(self, logprobs: torch.Tensor, item=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend every live row by one token: of the row's 2B best continuations (beam score + ``logprobs``,
        (n_rows·B, V) on any device: only the 2B best per row come to the host) the B best that do not end in a stop
        token stay live; those that do finish a hypothesis. ``item(b, token, logprob)`` makes a candidate's trace
        entry (None: no trace).

        Returns (the next token per batch row — ``pad`` for finished rows —, the batch row each beam continues)."""
        B, N = self.B, self.n_rows * self.B
        next_tok = torch.full((N,), self.pad, dtype=torch.long)
        src = torch.arange(N)
        new_tokens, new_traces = list(self.tokens), list(self.traces)
        V = logprobs.shape[1]
        # every row's 2B best continuations in one call
        with vocab_wide_threads(logprobs):
            if B == 1:  # greedy: one score per row ranks nothing, so it is added to the two best only (not to
                # every token of the vocabulary first: a vocabulary-wide pass of each row fewer)
                top_vs, top_is = top_k(logprobs.view(self.n_rows, V), 2)
                top_vs = top_vs.cpu() + self.scores
            else:
                top_vs, top_is = top_k((self.scores.to(logprobs.device).unsqueeze(2)
                                        + logprobs.view(self.n_rows, B, V)).view(self.n_rows, -1), 2 * B)
                top_vs = top_vs.cpu()
            top_is = top_is.cpu()
        for r in range(self.n_rows):
            if self.done[r]:
                continue
            live = []
            for v, ci in zip(top_vs[r].tolist(), top_is[r].tolist()):
                if v == float("-inf"):
                    break
                j, tok = divmod(ci, logprobs.shape[1])
                b = r * B + j
                entry = item(b, tok, v - float(self.scores[r, j])) if item is not None else None
                if tok in self.stop_ids:
                    self.finished[r].append((v, self.tokens[b] + [tok], self.traces[b] + ([entry] if entry else [])))
                else:
                    live.append((v, b, tok, entry))
                if len(live) == B:
                    break
            best_done = max((f[0] for f in self.finished[r]), default=float("-inf"))
            if not live or len(self.finished[r]) >= B or best_done >= live[0][0]:
                self.done[r] = True
                continue
            for j in range(B):
                v, b, tok, entry = live[j] if j < len(live) else (float("-inf"), *live[0][1:])
                tgt = r * B + j
                self.scores[r, j] = v
                src[tgt] = b
                next_tok[tgt] = tok
                new_tokens[tgt] = self.tokens[b] + [tok]
                new_traces[tgt] = self.traces[b] + ([entry] if entry else [])
        self.tokens, self.traces = new_tokens, new_traces
        return next_tok, src

    def best(self, r: int) -> tuple[float, list[int], list[dict]]:
        """Row r's result (score, tokens, trace): its best finished hypothesis, or when it ran out of tokens its best
        live beam."""
        if self.finished[r]:
            return max(self.finished[r], key=lambda f: f[0])
        j = int(self.scores[r].argmax())
        return float(self.scores[r, j]), self.tokens[r * self.B + j], self.traces[r * self.B + j]


def ban_repeated_ngrams(logprobs: torch.Tensor, tokens: list[list[int]], n: int) -> int:
    """The repetition guard: for every batch row, set to −inf the log-probability of each token that would
    complete an n-gram already in that row's output ``tokens[b]`` (HF's ``no_repeat_ngram_size``, over the output
    only — the prompt and the source may be copied). In place; returns how many (row, token) pairs it banned."""
    if n <= 0:
        return 0
    banned = 0
    for b, toks in enumerate(tokens):
        bad = repeated_ngram_ends(toks, n)
        if bad:
            logprobs[b, list(bad)] = float("-inf")
            banned += len(bad)
    return banned


def repeated_ngram_ends(toks: list[int], n: int) -> set[int]:
    """The tokens that would complete an n-gram already in ``toks`` (what the repetition guard bans next)."""
    if n <= 0 or len(toks) < n:
        return set()
    prefix = tuple(toks[len(toks) - n + 1:]) if n > 1 else ()
    return {toks[i + n - 1] for i in range(len(toks) - n + 1) if tuple(toks[i:i + n - 1]) == prefix}
