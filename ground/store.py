"""The data directory: one SQLite catalog (sqlite-utils) plus folders for memories, plug-ins and backbone caches.

Layout::

    <data_dir>/studio.db       tables: memories, plugins, jobs, comparisons (each row has an ``owner``)
    <data_dir>/memories/<id>/  written under a temporary name, renamed when complete
    <data_dir>/plugins/<id>/
    <data_dir>/backbones/      de-quantized weights of the embedded backbones

The directory comes from ``--data-dir``, else ``$PEMA_DATA_DIR``, else ``~/.cache/pema-studio``.

Owners: every catalog row belongs to an owner (a string the studio derives from the caller's identity; rows written
by the CLIs, and rows of a catalog made before owners existed, belong to :data:`LOCAL_OWNER`). The read methods take
an optional ``owner`` and then return only that owner's rows; ``Catalog.owned_by(owner)`` is a view whose
``add_memory`` / ``add_plugin`` stamp the owner on the row, for the engine functions that register what they made.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import sqlite_utils

DEFAULT_DATA_DIR = Path(os.environ.get("PEMA_DATA_DIR", Path.home() / ".cache" / "pema-studio"))
LOCAL_OWNER = "local"  # the single user of a local studio, the CLIs, and every row made before owners existed
OWNED_TABLES = ("memories", "plugins", "jobs", "comparisons")


def data_dir(path: str | os.PathLike | None = None) -> Path:
    d = Path(path) if path else Path(os.environ.get("PEMA_DATA_DIR", DEFAULT_DATA_DIR))
    d.mkdir(parents=True, exist_ok=True)
    return d


def new_id(prefix: str = "") -> str:
    """Short readable ids for memories/plug-ins/jobs (catalog keys, not secrets)."""
    return prefix + time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def secret_id() -> str:
    """Unguessable ids for shared comparisons (128 bits)."""
    return secrets.token_urlsafe(16)


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; rename it to ``final`` only if the block succeeds.

    On any exception the temporary folder is removed, so nothing half-written is ever visible.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json_atomic(path: Path, obj) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


class Catalog:
    """The SQLite catalog. One connection per thread (sqlite3 objects are not shareable across threads)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = data_dir(root)
        self.path = self.root / "studio.db"
        self._local = threading.local()
        self._ensure_tables()

    @property
    def db(self) -> sqlite_utils.Database:
        db = getattr(self._local, "db", None)
        if db is None:
            import sqlite3

            conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            db = sqlite_utils.Database(conn)
            self._local.db = db
        return db

    def _ensure_tables(self) -> None:
        db = self.db
        if "memories" not in db.table_names():
            db["memories"].create({"id": str, "name": str, "path": str, "backbone": str, "fingerprint": str,
                                   "task": str, "mode": str, "samples": int, "entries": int, "bytes": int,
                                   "created": float, "meta": str}, pk="id")
        if "plugins" not in db.table_names():
            db["plugins"].create({"id": str, "name": str, "method": str, "memory_id": str, "path": str,
                                  "backbone": str, "fingerprint": str, "params": int, "metrics": str,
                                  "created": float}, pk="id")
        if "jobs" not in db.table_names():
            db["jobs"].create({"id": str, "kind": str, "args": str, "state": str, "progress": float,
                               "message": str, "log": str, "error": str, "result": str, "metrics": str,
                               "created": float, "started": float, "finished": float, "cancel": int}, pk="id")
        if "comparisons" not in db.table_names():
            db["comparisons"].create({"id": str, "created": float, "backbone": str, "payload": str}, pk="id")
        self._migrate_owners()

    def _migrate_owners(self) -> None:
        """Add the ``owner`` column to catalogs made before owners existed: their rows become the local user's."""
        db = self.db
        for name in OWNED_TABLES:
            table = db[name]
            if "owner" not in table.columns_dict:
                table.add_column("owner", str, not_null_default=LOCAL_OWNER)
            db.execute(f"create index if not exists idx_{name}_owner on {name}(owner)")

    def owned_by(self, owner: str) -> "OwnedCatalog":
        """A view of this catalog whose ``add_memory`` / ``add_plugin`` register rows for ``owner``."""
        return OwnedCatalog(self, owner)

    @staticmethod
    def _where(owner: str | None, where: str = "", params: list | None = None) -> tuple[str | None, list]:
        params = list(params or [])
        if owner is not None:
            where = f"({where}) and owner = ?" if where else "owner = ?"
            params.append(owner)
        return where or None, params

    def count(self, table: str, owner: str | None = None) -> int:
        where, params = self._where(owner)
        return self.db[table].count_where(where, params) if where else self.db[table].count

    # memories / plug-ins -------------------------------------------------------------------------
    def add_memory(self, row: dict) -> None:
        self.db["memories"].insert(row, replace=True)

    def memories(self, owner: str | None = None) -> list[dict]:
        """Every memory, newest first; with ``owner``, only that owner's."""
        where, params = self._where(owner)
        return list(self.db["memories"].rows_where(where, params, order_by="created desc"))

    def memory(self, memory_id: str, owner: str | None = None) -> dict | None:
        """One memory's row; with ``owner``, ``None`` unless it belongs to that owner."""
        where, params = self._where(owner, "id = ?", [memory_id])
        rows = list(self.db["memories"].rows_where(where, params))
        return rows[0] if rows else None

    def delete_memory(self, memory_id: str) -> None:
        row = self.memory(memory_id)
        if row:
            shutil.rmtree(row["path"], ignore_errors=True)
            self.db["memories"].delete(memory_id)

    def add_plugin(self, row: dict) -> None:
        self.db["plugins"].insert(row, replace=True)

    def plugins(self, owner: str | None = None) -> list[dict]:
        where, params = self._where(owner)
        return list(self.db["plugins"].rows_where(where, params, order_by="created desc"))

    def plugin(self, plugin_id: str, owner: str | None = None) -> dict | None:
        where, params = self._where(owner, "id = ?", [plugin_id])
        rows = list(self.db["plugins"].rows_where(where, params))
        return rows[0] if rows else None

    def delete_plugin(self, plugin_id: str) -> None:
        row = self.plugin(plugin_id)
        if row:
            shutil.rmtree(row["path"], ignore_errors=True)
            self.db["plugins"].delete(plugin_id)

    # shared comparisons --------------------------------------------------------------------------
    def save_comparison(self, payload: dict | str, backbone: str, owner: str = LOCAL_OWNER) -> str:
        """Store a shared comparison (``payload``: a dict, or its JSON text) under a new unguessable id."""
        cid = secret_id()
        text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        self.db["comparisons"].insert({"id": cid, "created": time.time(), "backbone": backbone, "payload": text,
                                       "owner": owner})
        return cid

    def comparison(self, cid: str) -> dict | None:
        """A shared comparison's payload: anyone with its id may read it (that is what sharing means)."""
        rows = list(self.db["comparisons"].rows_where("id = ?", [cid]))
        return json.loads(rows[0]["payload"]) if rows else None


class OwnedCatalog:
    """A catalog seen by one owner when registering: rows added through it carry ``owner``; everything else is the
    catalog's own (``root``, reads, deletes)."""

    def __init__(self, catalog: Catalog, owner: str):
        self._catalog = catalog
        self.owner = owner

    def add_memory(self, row: dict) -> None:
        self._catalog.add_memory({**row, "owner": self.owner})

    def add_plugin(self, row: dict) -> None:
        self._catalog.add_plugin({**row, "owner": self.owner})

    def __getattr__(self, name: str):
        return getattr(self._catalog, name)
