"""What every decode run one step at a time offers (``DecodeRun``), so that a caller — the studio's streaming, a
CLI, a test — drives each alike: ``BatchDecode`` (a full or streamed comparison, or the same steps around a forward
pass given as a function) and ``LiveMove`` (a slider move, each of whose re-decodes is a ``BatchDecode``)."""
from __future__ import annotations


class DecodeRun:
    """A decode run one step at a time. ``step()`` runs the next step and says whether the run goes on (to cancel,
    stop calling it: nothing stays attached to the backbone between two steps); ``partial()`` is every row's output
    so far, as comparisons; ``result()`` the comparisons; ``run()`` every step, then ``result()``; ``live()`` the
    finished comparison kept for the next slider move (None where nothing is kept); ``forwards`` counts the backbone
    forward passes run; ``finished`` and ``seconds`` say whether it finished and in how long."""

    finished: bool = False
    seconds: float = 0.0
    forwards: int = 0

    def step(self) -> bool:
        raise NotImplementedError

    def partial(self) -> list:
        raise NotImplementedError

    def result(self) -> list:
        raise NotImplementedError

    def live(self):
        return None

    def run(self) -> list:
        while self.step():
            pass
        return self.result()
