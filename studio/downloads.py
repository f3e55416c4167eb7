"""The files a studio hands to the page (evaluation files, plug-in packages): a private temporary folder outside the
data directory, which the web server may neither read nor serve, one sub-folder per owner."""
from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
import time
from pathlib import Path

DOWNLOAD_MAX_AGE = 24 * 3600  # older files are removed whenever new ones are written


class Downloads:
    """Made on first use, removed when the studio closes (every file in it is written again on request)."""

    def __init__(self, max_age: float = DOWNLOAD_MAX_AGE):
        self.max_age = max_age
        self._folder: Path | None = None
        self._lock = threading.Lock()

    def downloads_root(self) -> Path:
        """The folder (made now if it is not yet)."""
        with self._lock:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="pema-downloads-")).resolve()
            return self._folder

    def owner_dir(self, owner: str) -> Path:
        """The owner's download folder (named by a hash: an owner id may be an e-mail-like name)."""
        return self.downloads_root() / hashlib.sha256(owner.encode("utf-8")).hexdigest()[:20]

    def fresh_owner_dir(self, owner: str) -> Path:
        """The owner's folder, made, after removing every file older than ``max_age`` (of any owner)."""
        self.prune()
        folder = self.owner_dir(owner)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def prune(self) -> None:
        root = self.downloads_root()
        if not root.is_dir():
            return
        cutoff = time.time() - self.max_age
        for folder in root.iterdir():
            for f in folder.glob("*") if folder.is_dir() else [folder]:
                try:
                    if f.stat().st_mtime < cutoff:
                        f.unlink()
                except OSError:
                    pass
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()

    def remove(self) -> None:
        """Remove the folder (the studio closes; its path stays what ``downloads_root`` answers)."""
        with self._lock:
            folder = self._folder
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
