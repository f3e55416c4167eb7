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

Nothing half-written, nothing left behind:

* ``atomic_dir`` writes a folder under a temporary name that says which process writes it (``ground.lock``),
  fsyncs every file and the folder, then renames it into place (and fsyncs the parent); on any error the temporary
  folder is removed. ``write_json_atomic`` does the same for one file.
* ``Catalog.publish`` makes the folder and its catalog row one step: the rename happens inside an ``IMMEDIATE``
  SQLite transaction that inserts the row, so a crash leaves either both or — at worst, a crash between the rename
  and the commit — a folder without a row, which ``Catalog.repair`` moves to ``quarantine/`` at the next start.
* Folder paths are stored relative to the data directory (``memories/<id>``), so a copied, restored or moved data
  directory is a directory of its own; rows of older catalogs are migrated when the catalog opens. A data directory
  never deletes or rewrites a folder outside itself.
* ``Catalog.repair`` (run by the data directory's owner process at start-up, inside one write transaction so no
  writer can be between its rename and its commit meanwhile): a row whose folder is gone is re-pointed at
  ``<data_dir>/<table>/<id>`` when that exists, else removed (when its folder was inside the data directory; a
  folder elsewhere is not ours to judge: the row stays, logged); a folder that no row names (by path or by id) is
  moved to ``<data_dir>/quarantine/<table>/`` unless the process that wrote it (``writer`` in its JSON) is still
  alive — never deleted. ``clean_temporary`` removes temporary files and folders whose writer is gone. Every repair
  is logged (logger ``pema.store``) and returned.
* Deleting renames the folder away (to a temporary name) in the same transaction that deletes the row, then removes
  it: never a row with half a folder.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import sqlite_utils

from ground.lock import TMP_PREFIX, temp_name, temp_writer, writer_gone

log = logging.getLogger("pema.store")

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


def _fsync_path(path: Path, directory: bool = False) -> None:
    """fsync one file or folder (a no-op where a folder cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder (deepest first), so a rename after it publishes data
    that is on disk."""
    root = Path(root)
    dirs = []
    for dirpath, _dirnames, filenames in os.walk(root):
        dirs.append(Path(dirpath))
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
    for d in reversed(dirs):
        _fsync_path(d, directory=True)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename the finished folder ``tmp`` to ``final`` (an existing ``final`` is moved away first, then removed)."""
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = final.parent / temp_name(final.name)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_path(final.parent, directory=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


Publish = Callable[[Path, Path], None]


@contextmanager
def atomic_dir(final: Path, publish: Publish | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; rename it to ``final`` only if the block succeeds.

    The temporary name says which process writes it (``ground.lock.temp_name``), so a start-up clean-up removes it
    only once that process is gone. Before the rename every file is fsynced. ``publish(tmp, final)``, if given,
    does the rename itself (``Catalog.publish``: the rename and the catalog row in one transaction). On any
    exception the temporary folder is removed, so nothing half-written is ever visible.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / temp_name(final.name)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        (publish or replace_dir)(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temporary file beside ``path`` (named for its writer), fsync it, rename it into place."""
    path = Path(path)
    tmp = path.with_name(temp_name(path.name))
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(obj, indent=2, ensure_ascii=False))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent, directory=True)


LEGACY_TMP_AGE = 3600.0  # temporary names from before writers were tagged: removed once this old (seconds)


def _legacy_temp(name: str) -> bool:
    """A temporary name written by an older version (no writer in it)."""
    return (name.startswith(TMP_PREFIX) or name.endswith(".tmp")) and temp_writer(name) is None


def clean_temporary(root: Path, subs: tuple[str, ...] = ("memories", "plugins")) -> list[str]:
    """Remove the temporary folders and files under ``<root>/<sub>/`` (and inside each memory / plug-in folder)
    whose writer process is gone; keep those of a live writer (a CLI still writing) and, from another host, all.
    Returns what was removed (also logged)."""
    notes: list[str] = []
    now = time.time()

    def consider(p: Path) -> None:
        writer = temp_writer(p.name)
        if writer is not None:
            gone = writer_gone(writer, me_is_gone=True)
        elif _legacy_temp(p.name):
            try:
                gone = now - p.stat().st_mtime > LEGACY_TMP_AGE
            except OSError:
                return
        else:
            return
        if not gone:
            return
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        notes.append(f"removed {p.relative_to(root)} (left by a process that is gone)")

    for sub in subs:
        folder = Path(root) / sub
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            if p.name.startswith(TMP_PREFIX) or _legacy_temp(p.name):
                consider(p)
            elif p.is_dir() and not p.is_symlink():
                for q in sorted(p.iterdir()):
                    if q.name.startswith(TMP_PREFIX) or _legacy_temp(q.name):
                        consider(q)
    for n in notes:
        log.warning("data directory clean-up: %s", n)
    return notes


def _read_writer(config: Path) -> dict | None:
    try:
        meta = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    w = meta.get("writer") if isinstance(meta, dict) else None
    return w if isinstance(w, dict) else None


class Catalog:
    """The SQLite catalog. One connection per thread (sqlite3 objects are not shareable across threads)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = data_dir(root)
        self.path = self.root / "studio.db"
        self._local = threading.local()
        self._ensure_tables()
        self._migrate_paths()

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

    # folder paths: stored relative to the data directory, so that a copied directory is a directory of its own ----
    def stored_path(self, path: str | os.PathLike) -> str:
        """How a folder's path is stored: relative to the data directory when inside it (``memories/<id>``), else
        absolute (a folder a CLI was given)."""
        p = Path(path)
        p = p if p.is_absolute() else self.root / p
        try:
            return p.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return str(p)

    def full_path(self, stored: str | None) -> Path | None:
        """The folder a stored path names (relative ones are inside this data directory)."""
        if not stored:
            return None
        p = Path(stored)
        return p if p.is_absolute() else self.root / p

    def _row(self, row: dict) -> dict:
        if "path" in row and row["path"]:
            row = {**row, "path": str(self.full_path(row["path"]))}
        return row

    def _migrate_paths(self) -> None:
        """Rows of catalogs that stored absolute paths: a folder inside this data directory becomes relative; a
        folder in another place that this directory holds too under the row's id (a copied or restored data
        directory) is re-pointed at this directory's own. Paths elsewhere stay as they are."""
        if not any(self.db.execute(f"select 1 from [{t}] where path like '/%' limit 1").fetchone()
                   for t in ("memories", "plugins")):
            return
        with self.transaction() as conn:
            for table in ("memories", "plugins"):
                for rid, path in conn.execute(f"select id, path from [{table}]").fetchall():
                    if not path or not Path(path).is_absolute():
                        continue
                    p, own = Path(path), self.root / table / str(rid)
                    if p.resolve().is_relative_to(self.root.resolve()):
                        new = self.stored_path(p)
                    elif own.is_dir() and not own.is_symlink():
                        new = f"{table}/{rid}"
                        log.warning("catalog: %s %s pointed at %s, outside this data directory; it now points at "
                                    "this directory's own %s", table, rid, path, own)
                    else:
                        continue
                    conn.execute(f"update [{table}] set path = ? where id = ?", [new, rid])

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

    # one step: folder + row ------------------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator:
        """A write transaction on this thread's connection (``BEGIN IMMEDIATE``: other writers wait until it ends);
        committed when the block succeeds, rolled back otherwise. Use raw SQL inside it (sqlite-utils' helpers
        commit on their own)."""
        conn = self.db.conn
        if conn.in_transaction:
            conn.commit()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.rollback()
            raise
        conn.commit()

    def _insert_sql(self, conn, table: str, row: dict) -> None:
        cols = set(self.db[table].columns_dict)
        unknown = [k for k in row if k not in cols]
        if unknown:
            raise ValueError(f"unknown columns for {table}: {unknown}")
        names = list(row)
        conn.execute(f"insert or replace into [{table}] ({', '.join(f'[{n}]' for n in names)}) "
                     f"values ({', '.join('?' * len(names))})", [row[n] for n in names])

    def publish(self, table: str, row: dict, tmp: Path, final: Path) -> None:
        """Rename the finished folder ``tmp`` to ``final`` and insert its catalog ``row`` as one step: both happen
        inside one write transaction, committed only after the rename (see the module docstring)."""
        if table not in ("memories", "plugins"):
            raise ValueError(table)
        with self.transaction() as conn:
            self._insert_sql(conn, table, {**row, "path": self.stored_path(final)})
            replace_dir(tmp, final)

    def publisher(self, table: str, row_for: Callable[[Path, Path], dict]) -> Publish:
        """An ``atomic_dir`` ``publish`` callback: ``row_for(tmp, final)`` makes the row from the finished folder."""
        return lambda tmp, final: self.publish(table, row_for(tmp, final), tmp, final)

    def _delete(self, table: str, row_id: str, marker: str) -> None:
        """Delete a row and its folder: the folder is renamed away in the row's transaction, then removed. Only a
        folder inside this data directory that holds what the row says (its ``marker`` file) is removed; for any
        other the row alone goes."""
        rows = list(self.db[table].rows_where("id = ?", [row_id]))
        if not rows:
            return
        path = self.full_path(rows[0]["path"])
        trash = None
        with self.transaction() as conn:
            conn.execute(f"delete from [{table}] where id = ?", [row_id])
            if path is not None and (path / marker).is_file() and not path.is_symlink() \
                    and path.resolve().is_relative_to(self.root.resolve()):
                trash = path.parent / temp_name(path.name)
                os.replace(path, trash)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def repair(self) -> list[str]:
        """Make rows and folders agree (start-up, by the data directory's owner; see the module docstring).
        Returns what was repaired (also logged as warnings). Nothing is deleted but rows: a folder no row names is
        moved to ``<data_dir>/quarantine/`` (its owner may still want it), and a folder whose id a row names is
        never touched."""
        notes: list[str] = []
        root = self.root.resolve()
        with self.transaction() as conn:
            for table, marker in (("memories", "meta.json"), ("plugins", "plugin_config.json")):
                folder = self.root / table
                known: set[Path] = set()
                ids: set[str] = set()
                for rid, path in conn.execute(f"select id, path from [{table}]").fetchall():
                    ids.add(str(rid))
                    p = self.full_path(path)
                    if p is not None and (p / marker).is_file():
                        known.add(p.resolve())
                        continue
                    alt = folder / str(rid)
                    if (alt / marker).is_file():
                        conn.execute(f"update [{table}] set path = ? where id = ?", [f"{table}/{rid}", rid])
                        known.add(alt.resolve())
                        notes.append(f"{table} {rid}: its folder {path} is gone; the row now points at {alt}")
                    elif p is None or not p.resolve().is_relative_to(root):
                        # outside the data directory (a CLI's own folder, a disk not mounted now): not ours to judge
                        notes.append(f"{table} {rid}: its folder {path} is missing; the row is kept (the folder is "
                                     f"outside the data directory)")
                    else:
                        conn.execute(f"delete from [{table}] where id = ?", [rid])
                        notes.append(f"{table} {rid}: removed its catalog row (its folder {path} is missing or "
                                     f"incomplete)")
                if not folder.is_dir():
                    continue
                for d in sorted(folder.iterdir()):
                    if d.name.startswith(".") or not d.is_dir() or d.is_symlink() or d.resolve() in known \
                            or d.name in ids:
                        continue
                    if writer_gone(_read_writer(d / marker), me_is_gone=True) is False:
                        notes.append(f"{table}/{d.name}: no catalog row yet, but the process writing it is alive; "
                                     f"kept")
                        continue
                    target = self.root / "quarantine" / table / d.name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if target.exists():
                        target = target.with_name(f"{d.name}-{secrets.token_hex(3)}")
                    os.replace(d, target)
                    notes.append(f"{table}/{d.name}: a folder without a catalog row (its writer stopped before "
                                 f"registering it) was moved to {target.relative_to(self.root)}")
        for n in notes:
            log.warning("catalog repair: %s", n)
        return notes

    def integrity(self) -> str:
        """SQLite's own check of the catalog file: ``"ok"`` when sound."""
        return str(self.db.execute("pragma integrity_check").fetchone()[0])

    def count(self, table: str, owner: str | None = None) -> int:
        where, params = self._where(owner)
        return self.db[table].count_where(where, params) if where else self.db[table].count

    # memories / plug-ins -------------------------------------------------------------------------
    def add_memory(self, row: dict) -> None:
        self.db["memories"].insert({**row, "path": self.stored_path(row["path"])}, replace=True)

    def memories(self, owner: str | None = None) -> list[dict]:
        """Every memory, newest first; with ``owner``, only that owner's. Rows carry absolute paths."""
        where, params = self._where(owner)
        return [self._row(r) for r in self.db["memories"].rows_where(where, params, order_by="created desc")]

    def memory(self, memory_id: str, owner: str | None = None) -> dict | None:
        """One memory's row; with ``owner``, ``None`` unless it belongs to that owner."""
        where, params = self._where(owner, "id = ?", [memory_id])
        rows = list(self.db["memories"].rows_where(where, params))
        return self._row(rows[0]) if rows else None

    def delete_memory(self, memory_id: str) -> None:
        self._delete("memories", memory_id, "meta.json")

    def add_plugin(self, row: dict) -> None:
        self.db["plugins"].insert({**row, "path": self.stored_path(row["path"])}, replace=True)

    def plugins(self, owner: str | None = None) -> list[dict]:
        where, params = self._where(owner)
        return [self._row(r) for r in self.db["plugins"].rows_where(where, params, order_by="created desc")]

    def plugin(self, plugin_id: str, owner: str | None = None) -> dict | None:
        where, params = self._where(owner, "id = ?", [plugin_id])
        rows = list(self.db["plugins"].rows_where(where, params))
        return self._row(rows[0]) if rows else None

    def delete_plugin(self, plugin_id: str) -> None:
        self._delete("plugins", plugin_id, "plugin_config.json")

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

    def shares(self, owner: str, limit: int = 1000) -> list[dict]:
        """The owner's shared comparisons and leaderboards, newest first: id, created, backbone and what it is
        (``kind``: "comparison" or "leaderboard"; ``source``: a comparison's input), never another owner's."""
        out = []
        for r in self.db["comparisons"].rows_where("owner = ?", [owner], order_by="created desc", limit=limit):
            try:
                p = json.loads(r["payload"])
            except ValueError:
                p = {}
            p = p if isinstance(p, dict) else {}
            out.append({"id": r["id"], "created": r["created"], "backbone": r["backbone"],
                        "kind": "leaderboard" if p.get("kind") == "leaderboard" else "comparison",
                        "source": p.get("source") if isinstance(p.get("source"), str) else ""})
        return out

    def delete_comparison(self, cid: str, owner: str) -> bool:
        """Delete one of the owner's shares (its link stops working at once); False when the owner has no such
        share (another owner's reads as nonexistent)."""
        with self.transaction() as conn:
            return bool(conn.execute("delete from comparisons where id = ? and owner = ?", [cid, owner]).rowcount)


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

    def publish(self, table: str, row: dict, tmp: Path, final: Path) -> None:
        self._catalog.publish(table, {**row, "owner": self.owner}, tmp, final)

    def publisher(self, table: str, row_for: Callable[[Path, Path], dict]) -> Publish:
        return lambda tmp, final: self.publish(table, row_for(tmp, final), tmp, final)

    def __getattr__(self, name: str):
        return getattr(self._catalog, name)
