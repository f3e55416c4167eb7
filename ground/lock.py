"""One data directory, one owner process; temporary files that say who writes them.

**The owner lock.** ``<data_dir>/studio.lock`` is locked with ``fcntl.flock`` (exclusive, non-blocking) by the
process that runs the job queue — the Studio — for as long as it lives; the kernel drops the lock when the process
ends, however it ends (``kill -9`` included), so a stale lock never needs cleaning. The file holds
``{"pid", "host", "started"}`` of the holder for the messages of a second process. A second Studio on a live
directory does not get the lock and runs without a job worker (see ``studio.service``); it never cleans, repairs,
marks jobs interrupted or claims queued jobs — only the holder does. ``flock`` locks belong to an open file
description, so a second Studio *in the same process* is refused just the same. Where ``fcntl`` does not exist
(Windows) every process is the owner (documented: one studio per data directory there).

**Temporary names.** Every temporary file or folder a writer makes in the data directory carries its writer:
``.tmp-<name>@<host>@<pid>@<random>`` (``temp_name``). The owner's start-up clean-up removes one only when its
writer is gone (same host, process no longer alive) — never the temporary folder of a CLI that is still writing
(``python -m memories build`` / ``python -m plugins train`` may run beside a studio).
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path

try:  # POSIX only; optional: without it every process owns its data directory
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_NAME = "studio.lock"
TMP_PREFIX = ".tmp-"
_HOST = socket.gethostname().replace("@", "_") or "localhost"


def host() -> str:
    return _HOST


def writer_tag() -> dict:
    """Who is writing: this host and process (stored in temporary names and in saved configs)."""
    return {"host": _HOST, "pid": os.getpid()}


def temp_name(base: str, suffix: str = "") -> str:
    """A temporary name for ``base`` that says which process writes it: ``.tmp-<base>@<host>@<pid>@<hex><suffix>``."""
    return f"{TMP_PREFIX}{base}@{_HOST}@{os.getpid()}@{secrets.token_hex(4)}{suffix}"


def temp_writer(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of a name made by :func:`temp_name`; ``None`` for any other name."""
    if not name.startswith(TMP_PREFIX):
        return None
    parts = name[len(TMP_PREFIX):].rsplit("@", 3)
    if len(parts) != 4:
        return None
    try:
        return parts[1], int(parts[2])
    except ValueError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    try:  # a killed child not yet reaped by its parent is a zombie: it writes nothing any more
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def writer_gone(writer: tuple[str, int] | dict | None, *, me_is_gone: bool = False) -> bool | None:
    """True when the writer process is known to be gone, False when it is alive, None when unknowable (another
    host). ``me_is_gone``: treat this very process as gone (at start-up nothing of ours is being written yet)."""
    if writer is None:
        return None
    h, pid = (writer.get("host"), writer.get("pid")) if isinstance(writer, dict) else writer
    if h != _HOST:
        return None
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return None
    if pid == os.getpid():
        return me_is_gone
    return not pid_alive(pid)


class DataDirLock:
    """The exclusive, process-lifetime lock on ``<root>/studio.lock``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock without waiting; True when this object holds it (now or already)."""
        if self._fd is not None:
            return True
        if fcntl is None:  # pragma: no cover - Windows
            self._fd = -1
            return True
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        info = json.dumps({**writer_tag(), "started": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None or fd < 0:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def holder(self) -> dict:
        """What the lock file says about its holder (``{}`` when it says nothing readable)."""
        try:
            info = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def describe_holder(self) -> str:
        h = self.holder()
        if not h:
            return "another process"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"])) if h.get("started") else "?"
        return f"process {h.get('pid', '?')} on {h.get('host', '?')} (since {since})"

    def __del__(self):  # pragma: no cover - the kernel releases it anyway when the process ends
        try:
            self.release()
        except Exception:  # noqa: BLE001
            pass
