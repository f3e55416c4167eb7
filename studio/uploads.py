"""Which caller uploaded which file: a file input of a page event is accepted only if it is the caller's own upload.

Gradio stores an upload (``POST /gradio_api/upload``) in its upload folder and answers with the stored path; the
page (or ``gradio_client``) then sends that path back as the value of a File input. Anyone can send any path, so
the studio records each upload's paths against the credentials of the request that made it (the owner of its key
header and of its browser cookie, see :meth:`studio.identity.Identity.credentials`) and accepts a path later only
from a request carrying one of those credentials (:meth:`UploadLedger.check`). The server middleware
(``ui.server``) asks before Gradio reads or copies anything; the handlers ask again before reading the bytes.

Uploads are bounded per owner and overall (``Limits.uploads_per_owner``, ``Limits.upload_bytes_total``): room is
reserved in one step under a lock when a request arrives (:meth:`UploadLedger.admit`) and for each further file part
of the same request (:meth:`UploadLedger.grow`), so concurrent requests or many parts in one cannot pass the bound.
Gradio names an upload by its contents, so identical bytes from two owners would share one path; the server moves
each stored upload into a folder of its own (:func:`own_folder`: the owner's tag and a random name), never shared.
Uploads expire after :data:`UPLOAD_TTL_S` (unless consumed sooner by the event that used them: a build, an import,
an evaluation) and are all removed when the server stops.

:class:`ServedFiles` records the files Gradio hands to an owner's page events (downloads), so that the server's file
route serves each only to its owner.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ground.errors import UserError
from ground.lock import host, writer_gone
from studio.limits import Limits, hint

UPLOAD_TTL_S = 3600.0  # an upload nobody used within an hour is removed (preview → build fits well inside)
MAX_PARTS = 32  # file parts of one upload request, whatever the per-owner bound (the page sends one)
SERVED_TTL_S = 24 * 3600.0  # as long as Gradio keeps its cached copies (ui.server.DELETE_CACHE)
SERVED_MAX = 100_000  # files remembered at once (the oldest are forgotten first: 404 for them)
NOT_YOURS = ("This file was not uploaded by you in this studio (or its upload has expired): upload it again with "
             "the file input.")


class TooManyParts(UserError):
    """An upload request holds more files than any request may (:data:`MAX_PARTS`)."""


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
        self._pending: dict[int, list] = {}  # admitted uploads whose answer is not back yet: [owners, bytes, parts]
        self._next = 0

    # --- bounds ---------------------------------------------------------------------------------------------------
    def _live(self, owners: frozenset) -> tuple[int, int, int]:
        """(files of these owners, bytes of these owners, bytes overall) of live and admitted uploads."""
        files = n_bytes = total = 0
        for u in self._files.values():
            total += u.size
            if u.owners & owners:
                files, n_bytes = files + 1, n_bytes + u.size
        for who, size, parts in self._pending.values():
            total += size
            if who & owners:
                files, n_bytes = files + parts, n_bytes + size
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
            self._pending[self._next] = [owners, int(size), 1]
            return self._next

    def grow(self, ticket: int, parts: int) -> None:
        """The request of ``ticket`` holds ``parts`` files (counted as its body arrives, before any is stored):
        reserve room for them too, or raise a UserError (the request is then refused whole): the owner's bound
        first, then :class:`TooManyParts` past :data:`MAX_PARTS`."""
        with self._lock:
            entry = self._pending.get(ticket)
            if entry is None or parts <= entry[2]:
                return
            per_owner = self.limits.uploads_per_owner
            files, _, _ = self._live(entry[0])
            if per_owner and files + parts - entry[2] > per_owner:
                raise UserError(f"This upload holds {parts} files or more and you have {files - entry[2]} that no "
                                f"build, import or evaluation has used yet (the limit per user is {per_owner}); "
                                f"upload fewer ({hint('uploads_per_owner')}).")
            if parts > MAX_PARTS:
                raise TooManyParts(f"One upload request may hold at most {MAX_PARTS} files; send fewer at a time.")
            entry[2] = parts

    def release(self, ticket: int) -> None:
        with self._lock:
            self._pending.pop(ticket, None)

    def record(self, ticket: int, paths: Iterable[str]) -> None:
        """The upload of ``ticket`` was stored at ``paths`` (what Gradio answered)."""
        with self._lock:
            owners, _, _ = self._pending.pop(ticket, (None, 0, 0))
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


def owner_tag(owners: Iterable[str]) -> str:
    """A short, stable tag of an upload's owners for its folder name (a hash: owner ids are not shown)."""
    return hashlib.sha256("|".join(sorted(owners)).encode()).hexdigest()[:16]


def own_folder(path: str | os.PathLike, owners: Iterable[str]) -> str:
    """Move an upload Gradio stored under a name made from its contents (``<upload dir>/<sha>/<name>``) into a
    folder of its own beside it (``<upload dir>/u-<owner tag>-<random>/<name>``); returns the new path (or the
    old one, unchanged, when it cannot be moved). Two owners' identical bytes never share a path this way."""
    src = Path(path)
    dest = src.parent.parent / f"u-{owner_tag(owners)}-{secrets.token_hex(12)}" / src.name
    try:
        dest.parent.mkdir(mode=0o700)
        os.rename(src, dest)
    except OSError:
        try:
            dest.parent.rmdir()
        except OSError:
            pass
        return str(src)
    try:
        src.parent.rmdir()
    except OSError:
        pass
    return str(dest)


class ServedFiles:
    """Thread-safe record of the files Gradio's file route may serve and to whom: ``grant`` when a page event or
    API call of these owners returns a file (Gradio has copied it into its cache), ``owns`` when the file is
    asked for. Entries expire with Gradio's cache (:data:`SERVED_TTL_S`); at most :data:`SERVED_MAX` are kept."""

    def __init__(self, ttl: float = SERVED_TTL_S, clock: Callable[[], float] = time.time, cap: int = SERVED_MAX):
        self.ttl, self.clock, self.cap = float(ttl), clock, int(cap)
        self._lock = threading.Lock()
        self._files: dict[str, tuple[frozenset, float]] = {}

    def grant(self, paths: Iterable[str], owners: Iterable[str]) -> None:
        owners = frozenset(owners)
        if not owners:
            return
        now = self.clock()
        with self._lock:
            for p in paths:
                key = _key(p)
                if not key:
                    continue
                old = self._files.pop(key, (frozenset(), now))[0]
                self._files[key] = (old | owners, now)  # re-inserted: the dict stays in order of last grant
            while len(self._files) > self.cap:
                self._files.pop(next(iter(self._files)))

    def owns(self, path, owners: Iterable[str]) -> bool:
        owners = frozenset(owners)
        with self._lock:
            who, at = self._files.get(_key(path), (frozenset(), 0.0))
        return bool(owners and who & owners and self.clock() - at <= self.ttl)


def _remove(path: Path) -> None:
    """Remove an upload and its folder when that is left empty (Gradio stores each upload in a folder of its own)."""
    try:
        path.unlink(missing_ok=True)
        path.parent.rmdir()
    except OSError:
        pass


DOWNLOADS_PREFIX = "pema-downloads-"  # studio.evaluate_service makes each studio's downloads folder so
LEFTOVER_AGE_S = 2 * 24 * 3600.0  # an unmarked downloads folder untouched this long belongs to nobody


def mark_downloads(folder: Path) -> None:
    """Say beside a studio's downloads folder which process serves it (``<folder>.owner``: host and pid), so that a
    later start can tell it from a folder left by a killed studio (:func:`sweep_downloads`)."""
    marker = folder.with_name(folder.name + ".owner")
    tmp = marker.with_name(f".{marker.name}.{secrets.token_hex(4)}")
    tmp.write_text(f"{host()} {os.getpid()}\n")
    os.replace(tmp, marker)


def sweep_downloads(current: Path | None = None, parent: Path | None = None) -> list[str]:
    """Remove the downloads folders that studios killed without a chance to clean up (``kill -9``) left in the
    temporary folder: those whose marker names a process of this host that is gone, and unmarked ones untouched
    for :data:`LEFTOVER_AGE_S`. A live studio's folder, and another host's, are never touched. Returns the removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed, now = [], time.time()
    try:
        entries = [p for p in parent.iterdir() if p.name.startswith(DOWNLOADS_PREFIX)]
    except OSError:
        return removed
    folders = [p for p in entries if p.is_dir() and not p.is_symlink()]
    for marker in entries:  # a marker whose folder its studio removed on the way out
        if marker.name.endswith(".owner") and not marker.with_name(marker.name[:-6]).exists():
            marker.unlink(missing_ok=True)
    for folder in folders:
        if current is not None and folder.resolve() == Path(current).resolve():
            continue
        marker = folder.with_name(folder.name + ".owner")
        try:
            if marker.is_file():
                host, pid = marker.read_text().split()[:2]
                gone = writer_gone((host, int(pid)))
            else:
                gone = now - folder.stat().st_mtime > LEFTOVER_AGE_S
        except (OSError, ValueError):
            continue
        if gone:
            shutil.rmtree(folder, ignore_errors=True)
            marker.unlink(missing_ok=True)
            removed.append(str(folder))
    return removed
