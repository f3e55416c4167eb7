"""Timings of the studio's exploration views on a real memory: the memory profile, neighbour maps of a
kNN and a PEMA row, and several sentences decoded in one batch against one comparison per sentence.

    python -m benchmarks explore --memory ~/.cache/pema-studio/memories/<id> --sentences 8

The memory folder is only read: it is copied into a temporary data directory, where a kNN plug-in and a short PEMA
(a one-epoch-per-phase budget: the timings do not depend on how well it is trained) are trained on it. The
backbone's weights come from ``--backbone-cache`` (default ``~/.cache/pema-studio``), read only. Prints one JSON
object; compare ratios within one run (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from memories.build import register_memory
from memories.store import Memory
from studio.service import Studio

SHORT_PEMA = {"max_epochs_rct": 1, "max_epochs_joint": 1, "candidate_contexts": 64, "max_minutes": 2.0}


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t0, 3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", required=True, help="a built memory's folder (read only)")
    ap.add_argument("--backbone", default="gemma-3-270m")
    ap.add_argument("--backbone-cache", default=str(Path.home() / ".cache" / "pema-studio"))
    ap.add_argument("--sentences", type=int, default=8, help="held-out sources decoded together")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    a = ap.parse_args(argv)
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-explore-") as tmp:
        st = Studio(tmp, backbone=a.backbone, backbone_cache=a.backbone_cache)
        try:
            assert st.backbone_service.wait_ready(600), st.backbone_service.status()
            src = Path(a.memory).expanduser()
            dst = Path(tmp) / "memories" / src.name
            shutil.copytree(src, dst)
            register_memory(st.catalog.owned_by("local"), Memory.load(dst))
            mid = src.name
            knn = st.jobs.wait(st.plugin_service.submit_train(mid, "knn", {}, "kNN"), 1800)
            pema = st.jobs.wait(st.plugin_service.submit_train(mid, "pema", SHORT_PEMA, "PEMA"), 1800)
            assert knn["state"] == "done" and pema["state"] == "done", (knn, pema)
            knn_id, pema_id = knn["result"]["plugin_id"], pema["result"]["plugin_id"]
            prof, out["profile_first_s"] = _timed(lambda: st.memory_service.memory_profile(mid))
            _, out["profile_cached_s"] = _timed(lambda: st.memory_service.memory_profile(mid))
            out.update(entries=prof["entries"], sample=prof["projection"]["sample_size"])
            srcs = [s["src"] for s in st.memory_service.heldout_samples(mid)][:a.sentences]
            methods = ["base", knn_id, pema_id]
            p = st.compare_service.compare(srcs[0], prof["task"], methods, max_new_tokens=a.max_new_tokens)
            for r in p["rows"][1:]:
                _, first = _timed(lambda: st.neighbour_map_service.neighbour_map(p["id"], r["label"], 0))
                nxt = min(1, len(r["tokens"]) - 1)
                _, other = _timed(lambda: st.neighbour_map_service.neighbour_map(p["id"], r["label"], nxt))
                out[f"map_{r['method']}_first_token_s"], out[f"map_{r['method']}_next_token_s"] = first, other
            several, out["several_batch_s"] = _timed(lambda: st.compare_service.compare_several(
                "\n".join(srcs), prof["task"], methods, max_new_tokens=a.max_new_tokens))
            t0 = time.perf_counter()
            singles = [st.compare_service.compare(s, prof["task"], methods,
                                                  max_new_tokens=a.max_new_tokens) for s in srcs]
            out["several_one_by_one_s"] = round(time.perf_counter() - t0, 3)
            out["several_speedup"] = round(out["several_one_by_one_s"] / max(out["several_batch_s"], 1e-9), 2)
            same = sum(ln["outputs"] == [r["text"] for r in one["rows"]] for ln, one in zip(several["lines"], singles))
            out.update(sentences=len(srcs), methods=len(methods), batch_outputs_equal_single=f"{same}/{len(srcs)}")
        finally:
            st.close()
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
