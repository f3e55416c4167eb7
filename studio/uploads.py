"""Which caller uploaded which file: a file input of a page event is accepted only if it is the caller's own upload.

Gradio stores an upload (``POST /gradio_api/upload``) in its upload folder and answers with the stored path; the
page (or ``gradio_client``) then sends that path back as the value of a File input. Anyone can send any path, so
the studio records each upload's paths against the credentials of the request that made it (the owner of its key
header and of its browser cookie, see :meth:`studio.identity.Identity.credentials`) and accepts a path later only
from a request carrying one of those credentials (:meth:`UploadLedger.check`). The server middleware
(``ui.server``) asks before Gradio reads or copies anything; the handlers ask again before reading the bytes.

Uploads are bounded per owner and overall (``Limits.uploads_per_owner``, ``Limits.upload_bytes_total``), expire
after :data:`UPLOAD_TTL_S` (unless consumed sooner by the event that used them: a build, an import, an evaluation)
and are all removed when the server stops.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ground.errors import UserError
from studio.limits import Limits, hint

UPLOAD_TTL_S = 3600.0  # an upload nobody used within an hour is removed (preview → build fits well inside)
NOT_YOURS = ("This file was not uploaded by you in this studio (or its upload has expired): upload it again with "
             "the file input.")


@dataclass
class Upload:
    path: Path
    owners: frozenset
    size: int
    at: float


def _key(path: str | os.PathLike) -> str:
    """A path as the ledger compares it: absolute and normalised, symlinks resolved where they exist."""
    try:
        return os.path.realpath(os.fspath(path))
    except (TypeError, ValueError, OSError):
        return ""


class UploadLedger:
    """Thread-safe record of live uploads: ``admit`` before an upload's body is read, ``record`` with the paths
    Gradio answered, ``check`` when a file input arrives, ``consume`` once its event has read it."""

    def __init__(self, limits: Limits, ttl: float = UPLOAD_TTL_S, clock: Callable[[], float] = time.time):
        self.limits, self.ttl, self.clock = limits, float(ttl), clock
        self._lock = threading.Lock()
        self._files: dict[str, Upload] = {}
        self._pending: dict[int, tuple[frozenset, int]] = {}  # admitted uploads whose answer is not back yet
        self._next = 0

    # --- bounds ---------------------------------------------------------------------------------------------------
    def _live(self, owners: frozenset) -> tuple[int, int, int]:
        """(files of these owners, bytes of these owners, bytes overall) of live and admitted uploads."""
        files = n_bytes = total = 0
        for u in self._files.values():
            total += u.size
            if u.owners & owners:
                files, n_bytes = files + 1, n_bytes + u.size
        for who, size in self._pending.values():
            total += size
            if who & owners:
                files, n_bytes = files + 1, n_bytes + size
        return files, n_bytes, total

    def admit(self, owners: Iterable[str], size: int) -> int:
        """Reserve room for an upload of ``size`` bytes (its request's Content-Length) by ``owners``; returns a
        ticket for :meth:`record` / :meth:`release`, or raises a UserError that names the bound."""
        owners = frozenset(owners)
        self.sweep()
        with self._lock:
            files, mine, total = self._live(owners)
            per_owner = self.limits.uploads_per_owner
            if per_owner and files >= per_owner:
                raise UserError(f"You have {files} uploads that no build, import or evaluation has used yet (the "
                                f"limit per user is {per_owner}); use them, or wait "
                                f"{int(self.ttl // 60)} minutes until they expire ({hint('uploads_per_owner')}).")
            bound = self.limits.upload_bytes_total
            if bound and total + size > bound:
                raise UserError(f"The studio holds {total / 1e6:.1f} MB of uploads; the limit is {bound / 1e6:.1f} "
                                f"MB; try again in a few minutes ({hint('upload_bytes_total')}).")
            self._next += 1
            self._pending[self._next] = (owners, int(size))
            return self._next

    def release(self, ticket: int) -> None:
        with self._lock:
            self._pending.pop(ticket, None)

    def record(self, ticket: int, paths: Iterable[str]) -> None:
        """The upload of ``ticket`` was stored at ``paths`` (what Gradio answered)."""
        with self._lock:
            owners, _ = self._pending.pop(ticket, (None, 0))
            if owners is None:
                return
            now = self.clock()
            for p in paths:
                key = _key(p)
                if not key:
                    continue
                try:
                    size = os.stat(key).st_size
                except OSError:
                    size = 0
                old = self._files.get(key)  # the same bytes uploaded again (Gradio names a file by its contents)
                self._files[key] = Upload(Path(key), (old.owners if old else frozenset()) | owners, size, now)

    # --- use --------------------------------------------------------------------------------------------------------
    def owns(self, path, owners: Iterable[str]) -> bool:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            return False
        owners = frozenset(owners)
        with self._lock:
            u = self._files.get(_key(path))
            return bool(u and owners and u.owners & owners and self.clock() - u.at <= self.ttl)

    def check(self, path, owners: Iterable[str]) -> Path:
        """The caller's own upload at ``path``, or a UserError (the same one for every other path, so that the
        answer says nothing of what exists on the server)."""
        if not self.owns(path, owners):
            raise UserError(NOT_YOURS)
        return Path(_key(path))

    def consume(self, path) -> None:
        """The event that needed this upload has read it: remove the file now."""
        key = _key(path)
        with self._lock:
            u = self._files.pop(key, None)
        if u is not None:
            _remove(u.path)

    def sweep(self) -> None:
        """Remove the uploads older than the TTL."""
        cutoff = self.clock() - self.ttl
        with self._lock:
            old = [k for k, u in self._files.items() if u.at < cutoff]
            gone = [self._files.pop(k) for k in old]
        for u in gone:
            _remove(u.path)

    def close(self) -> None:
        """Remove every upload (the server stops)."""
        with self._lock:
            gone, self._files = list(self._files.values()), {}
        for u in gone:
            _remove(u.path)

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)


def _remove(path: Path) -> None:
    """Remove an upload and its folder when that is left empty (Gradio stores each upload in a folder of its own)."""
    try:
        path.unlink(missing_ok=True)
        path.parent.rmdir()
    except OSError:
        pass
