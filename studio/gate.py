"""Exclusive use of the one loaded backbone, with hand-over at a long job's checkpoints."""
from __future__ import annotations

import threading
from contextlib import contextmanager

from ground.errors import UserError


class BackboneGate:
    """A re-entrant lock on the backbone whose long-running holder can hand it over at checkpoints."""

    def __init__(self):
        self._cond = threading.Condition()
        self._owner: int | None = None
        self._depth = 0
        self._waiting = 0
        self._grants = 0
        self.holder = ""  # what holds it, for "busy" messages

    def acquire(self, timeout: float | None = None, holder: str = "") -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            self._waiting += 1
            try:
                if not self._cond.wait_for(lambda: self._owner is None, timeout):
                    return False
                self._owner, self._depth, self.holder = me, 1, holder
                self._grants += 1
                return True
            finally:
                self._waiting -= 1

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("release() by a thread that does not hold the backbone")
            self._depth -= 1
            if self._depth == 0:
                self._owner, self.holder = None, ""
                self._cond.notify_all()

    @contextmanager
    def use(self, timeout: float | None = None, holder: str = "", busy: str = ""):
        if not self.acquire(timeout, holder):
            raise UserError(busy or f"The backbone is busy ({self.holder or 'another task'}); try again shortly.")
        try:
            yield
        finally:
            self.release()

    def checkpoint(self) -> None:
        """Called by the holder between batches: let waiting users run, then take the backbone back."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me or self._waiting == 0:
                return
            depth, holder, gen = self._depth, self.holder, self._grants
            self._owner, self._depth, self.holder = None, 0, ""
            self._cond.notify_all()
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: self._owner is None and (self._grants != gen or self._waiting == 1))
                self._owner, self._depth, self.holder = me, depth, holder
                self._grants += 1
            finally:
                self._waiting -= 1


