"""Plug-in packages as zip files, for the Plug-ins tab's Export (download) and Import (upload).

A package is the folder ``python -m plugins export`` writes (``plugins.hub``); here it travels as one zip. An
uploaded zip is hostile input until proven otherwise, so ``unpack_zip`` extracts it only after checking every
member — and reads at most the bytes it allows, whatever the zip's headers claim:

* the zip itself is at most ``max_bytes`` (``studio.limits``: ``upload_bytes``), the members together at most
  ``UNPACKED_FACTOR`` times that, each member at most ``MAX_RATIO`` times its compressed size (a zip bomb fails);
* at most ``MAX_MEMBERS`` members, every one a plain file name, flat or inside one top-level folder (the way a
  folder is zipped): no absolute path, no ``..``, no backslash or NUL, no deeper folder (zip slip fails);
* no symbolic link, device or other special file (Unix mode bits in the zip's external attributes), no encrypted
  member;
* no pickle-capable file (``plugins.hub.REFUSED_SUFFIXES``, any of a name's suffixes, whatever their case), no
  name that ends in a space or a dot or holds a control character (``"x.pkl "`` is no safetensors file either);
* no JSON or JSON Lines member nested deeper than ``MAX_JSON_DEPTH`` (a parser would overflow its stack).

Everything else — the manifest's SHA-256 of every file, the backbone fingerprint, safetensors-only weights, the
plug-in's own checks on load — is ``plugins.hub.import_plugin``'s, exactly as for ``python -m plugins import``.
"""
from __future__ import annotations

import os
import re
import stat
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ground.errors import UserError
from plugins.hub import REFUSED_SUFFIXES

MAX_MEMBERS = 64
MAX_RATIO = 200  # safetensors barely compress, JSON ~5-10×; a bomb is 1000× and more
UNPACKED_FACTOR = 4
BLOCK = 1 << 20
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def zip_folder(folder: Path, out: Path, top: str) -> Path:
    """Zip the files of ``folder`` (flat) under the top-level folder ``top``, written to a temporary name and
    renamed, so a half-written zip is never served."""
    tmp = out.with_name(f".{out.name}.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as z:
        for f in sorted(folder.iterdir()):
            if f.is_file() and not f.is_symlink():
                z.write(f, f"{top}/{f.name}")
    os.replace(tmp, out)
    return out


def _member_name(info: zipfile.ZipInfo) -> tuple[str | None, str]:
    """(top-level folder or None, file name) of a member, or a UserError for any other shape."""
    raw = info.filename
    bad = ("\\" in raw or "\x00" in raw or raw.startswith("/") or (len(raw) > 1 and raw[1] == ":"))
    parts = [p for p in raw.split("/") if p != ""]
    if bad or not parts or any(p in (".", "..") for p in parts) or len(parts) > 2:
        raise UserError(f"The zip holds {raw[:80]!r}: a plug-in package holds plain files only (flat, or in one "
                        f"folder).")
    name = parts[-1]
    if name != name.strip() or name.endswith(".") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise UserError(f"The zip holds {raw[:80]!r}: not a plain file name (it ends in a space or a dot, or holds a "
                        f"control character).")
    return (parts[0] if len(parts) == 2 else None), name


def refused_suffix(name: str) -> bool:
    """Whether any suffix of ``name`` (``x.pkl``, ``x.PKL``, ``x.pkl.txt``) is a pickle-capable format's."""
    return any(s.strip().lower() in REFUSED_SUFFIXES for s in Path(name.strip()).suffixes)


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON (or JSON Lines) text, counted without parsing it (strings
    first blanked out), so no recursion however deep it is."""
    a = np.frombuffer(_JSON_STRING.sub(b'""', data), dtype=np.uint8)
    if not a.size:
        return 0
    steps = ((a == ord("[")) | (a == ord("{"))).astype(np.int32) - ((a == ord("]")) | (a == ord("}")))
    return int(np.cumsum(steps).max())


def without_server_paths(message: str, *roots: str | os.PathLike) -> str:
    """An error message as a hosted studio's caller sees it (an import's, and every event's in multi-user mode): on
    one line, without the server's temporary paths (an import unpacks into one) or paths under ``roots`` (the data
    directory, where a package's datastore becomes a memory): "The package at /tmp/pema-import-…/package is
    damaged" → "The package is damaged", "The memory at /data/pema-studio/memories/… is damaged" → "The memory is
    damaged"."""
    message = re.sub(r"\s*\n\s*", " ", message)  # a library's several-line text (torch's state_dict errors)
    tmp = re.escape(tempfile.gettempdir().rstrip("/"))
    message = re.sub(rf"\s+at\s+{tmp}/pema-import-[^\s/]+/package\b", "", message)
    paths = {str(p).rstrip("/") for root in roots for p in (root, os.path.realpath(root))}
    for root in sorted((p for p in paths if p), key=len, reverse=True):
        message = re.sub(rf"\s+at\s+{re.escape(root)}/[^\s'\",;)]+", "", message)
        message = re.sub(rf"{re.escape(root)}(/[^\s'\",;)]*)?", "(a file of the studio)", message)
    return re.sub(rf"{tmp}/[^\s'\",;)]+", "(a temporary file)", message)


def unpack_zip(data: Path, dest: Path, max_bytes: int) -> Path:
    """Check the zip at ``data`` (module docstring) and extract its files into ``dest`` (an empty folder);
    returns the folder that holds the package's files. ``max_bytes`` 0: no size bound but the ratio's."""
    size = data.stat().st_size
    if max_bytes and size > max_bytes:
        raise UserError(f"The zip is {size:,} bytes; the limit is {max_bytes:,} (the studio's operator sets it with "
                        f"--limit upload_bytes=…).")
    try:
        z = zipfile.ZipFile(data)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise UserError(f"The upload is not a zip file ({str(e)[:120]}); export a plug-in with the Export button "
                        f"or zip the folder `python -m plugins export` wrote.") from None
    with z:
        infos = z.infolist()
        if len(infos) > MAX_MEMBERS:
            raise UserError(f"The zip holds {len(infos)} entries; a plug-in package has at most {MAX_MEMBERS}.")
        files, tops = [], set()
        for info in infos:
            mode = info.external_attr >> 16
            if info.is_dir():
                if len([p for p in info.filename.split("/") if p]) > 1:
                    raise UserError(f"The zip holds the folder {info.filename[:80]!r}: a plug-in package holds "
                                    f"plain files only (flat, or in one folder).")
                continue
            top, name = _member_name(info)
            if stat.S_IFMT(mode) not in (0, stat.S_IFREG):  # 0: no file type recorded (zips made elsewhere)
                raise UserError(f"The zip holds {info.filename[:80]!r}, which is not a plain file (a link or a "
                                f"special file); plug-in packages hold plain files only.")
            if info.flag_bits & 0x1:
                raise UserError("The zip is encrypted; export the plug-in again without a password.")
            if refused_suffix(name):
                raise UserError(f"The zip holds {name!r}, which is not safetensors: plug-ins are imported from "
                                f"safetensors only.")
            tops.add(top)
            files.append((info, name))
        if len(tops) > 1:
            raise UserError("The zip holds files in more than one folder; a plug-in package is one folder.")
        names = [n for _, n in files]
        if len(set(names)) != len(names):
            raise UserError("The zip holds the same file name twice.")
        if "plugin_config.json" not in names:
            raise UserError("The zip holds no plugin_config.json: it is not a plug-in package.")
        budget = max_bytes * UNPACKED_FACTOR if max_bytes else None
        total = 0
        dest.mkdir(parents=True, exist_ok=True)
        for info, name in files:
            allowed = max(info.compress_size, 1) * MAX_RATIO + BLOCK
            written = 0
            try:
                with z.open(info) as src, open(dest / name, "xb") as out:
                    while True:
                        block = src.read(BLOCK)
                        if not block:
                            break
                        written += len(block)
                        total += len(block)
                        if written > allowed:
                            raise UserError(f"{name} in the zip unpacks to more than {MAX_RATIO}× its compressed "
                                            f"size; refused (a zip bomb?).")
                        if budget and total > budget:
                            raise UserError(f"The zip unpacks to more than {budget:,} bytes; refused.")
                        out.write(block)
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
                raise UserError(f"{name} in the zip is damaged ({type(e).__name__}: {str(e)[:120]}).") from None
            if name.lower().endswith((".json", ".jsonl")) and json_depth((dest / name).read_bytes()) > MAX_JSON_DEPTH:
                raise UserError(f"{name} in the zip nests deeper than {MAX_JSON_DEPTH} levels; refused.")
    return dest
