"""Offsite benchmark: what the protocol costs on loopback, against the same work done locally.

    python -m benchmarks offsite --backbone tiny                      # the tests' tiny random model
    python -m benchmarks offsite --backbone gemma-3-270m --pairs 40   # the embedded Gemma (cached weights)
    python -m benchmarks offsite --backbone gemma-3-270m --owner-in-process   # one Gemma in memory

Starts a model owner (``python -m offsite serve``) on 127.0.0.1 in its own process and loads the same backbone here
(``--owner-in-process``: the owner's HTTP service runs in a thread of this process on the backbone loaded here —
one copy of the weights, one heavy process on a shared machine; requests still go through loopback HTTP), then
measures: the memory build (local vs through the owner; request + response body bytes per memory entry, sent and
received), and greedy decodes of base + PEMA + kNN rows (local ``engine.compare`` vs
``offsite.decode.compare_remote`` with each P_LM mode, interleaved sentence by sentence in a rotating order:
generated tokens per second over all rows and its ratio to local, body bytes per decode step and sent / received
per generated token, and whether every row's tokens equal the local ones). Body bytes exclude HTTP headers
(~150–250 bytes a request).
Uses ``../shared/data/wmt22-en-de/train.jsonl`` when present, else a few built-in pairs.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from backbone.model import load_backbone  # noqa: E402
from backbone.tasks import task_prompt  # noqa: E402
from backbone.tiny import tiny_backbone  # noqa: E402
from engine import Row, compare  # noqa: E402
from memories.build import build_memory  # noqa: E402
from memories.parse import Sample, parse_samples_strict  # noqa: E402
from offsite.client import connect, wait_for_owner  # noqa: E402
from offsite.decode import compare_remote  # noqa: E402
from offsite.protocol import Limits  # noqa: E402
from offsite.server import OwnerService, make_app  # noqa: E402
from plugins.api import train_plugin  # noqa: E402
from plugins.base import load_plugin  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WMT = ROOT.parent / "shared" / "data" / "wmt22-en-de" / "train.jsonl"
PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
         ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")]
SENTENCES = ["The government wants to cut taxes.", "The house is small.", "I would like a cup of coffee."]


def _samples(n: int) -> list[Sample]:
    if WMT.is_file():
        return parse_samples_strict(WMT.read_bytes(), WMT.name)[:n]
    return [Sample(s, t, i + 1) for i, (s, t) in enumerate((PAIRS * (n // len(PAIRS) + 1))[:n])]


def _owner(name: str, token: str, log: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "offsite", "serve", "--backbone", name, "--port", str(port),
                                 "--token", token, "--rate", "100000", "--burst", "100000"], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


class _ThreadOwner:
    """The owner's service in a thread of this process, on a backbone already loaded here (``--owner-in-process``):
    the same HTTP app as ``python -m offsite serve``; ``terminate`` / ``wait`` / ``poll`` as a process has them."""

    def __init__(self, backbone, token: str):
        import uvicorn  # heavy: only the benchmark's in-process owner serves HTTP

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = make_app(OwnerService(backbone, Limits(rate=100000, burst=100000)), token)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="offsite-owner", daemon=True)
        self.thread.start()

    def poll(self):
        return None if self.thread.is_alive() else 0

    def terminate(self) -> None:
        self.server.should_exit = True

    def wait(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    kill = terminate


def run(name: str, pairs: int, new_tokens: int, repeats: int, owner_in_process: bool = False) -> dict:
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if owner_in_process:
            local = tiny_backbone() if name == "tiny" else load_backbone(name)
            proc = _ThreadOwner(local, token)
            url = f"http://127.0.0.1:{proc.port}"
        else:
            proc, url = _owner(name, token, tmp / "owner.log")
        try:
            if not owner_in_process:
                local = tiny_backbone() if name == "tiny" else load_backbone(name)
            try:
                wait_for_owner(url, lambda: proc.poll() is None, timeout=600)
            except RuntimeError:
                log = tmp / "owner.log"
                raise RuntimeError(log.read_text() if log.is_file() else "the owner's thread stopped") from None
            t0 = time.time()
            remote = connect(url, token, data_dir=tmp / "client")
            client = remote.client
            out: dict = {"backbone": local.name, "hidden_size": local.hidden_size, "vocab_size": local.vocab_size,
                         "connect": {"seconds": round(time.time() - t0, 2), "bytes": client.received,
                                     "head_bytes": remote.info["head_bytes"]}}
            prompt = task_prompt("translation", local)
            samples = _samples(pairs)
            t0 = time.time()
            mem_l = build_memory(local, samples, tmp / "mem-local", prompt=prompt, batch_size=8)
            t_local = time.time() - t0
            client.reset_counters()
            t0 = time.time()
            mem_r = build_memory(remote, samples, tmp / "mem-remote", prompt=prompt, batch_size=8)
            t_remote = time.time() - t0
            entries = len(mem_r) + len(mem_r.heldout_values)
            out["build"] = {"pairs": len(samples), "entries": entries, "local_s": round(t_local, 2),
                            "remote_s": round(t_remote, 2), "requests": client.requests,
                            "bytes_sent": client.sent, "bytes_received": client.received,
                            "bytes_per_entry": round((client.sent + client.received) / entries, 1),
                            "sent_per_entry": round(client.sent / entries, 1),
                            "received_per_entry": round(client.received / entries, 1),
                            "f32_key_bytes": 4 * local.hidden_size,
                            "keys_max_abs_diff": float(np.abs(np.asarray(mem_l.keys, np.float32)
                                                              - np.asarray(mem_r.keys, np.float32)).max())}
            fast = {"max_epochs_rct": 2, "max_epochs_joint": 2, "max_minutes": 2.0}
            pema, _ = train_plugin(local, mem_r, "pema", fast, out_dir=tmp / "pema")
            knn, _ = train_plugin(local, mem_r, "knn", {}, out_dir=tmp / "knn")

            def rows(bb):
                return [Row("base"), Row("pema", load_plugin(tmp / "pema", bb)),
                        Row("knn", load_plugin(tmp / "knn", bb))]

            rl, rr = rows(local), rows(remote)
            compare(local, SENTENCES[0], rl, prompt, max_new_tokens=2)  # warm-up (prefix KV caches, BLAS)
            compare_remote(remote, SENTENCES[0], rr, prompt, max_new_tokens=2)
            modes = ("local", "full", "half", "none")
            acc = {m: {"tokens": 0, "steps": 0, "seconds": 0.0, "sent": 0, "received": 0, "requests": 0,
                       "same": True} for m in modes}
            # Interleaved (each sentence through every mode in turn, the order rotating from one sentence to the
            # next): a shared machine's load changes hit every mode alike, so the ratios hold better than the
            # absolute seconds.
            group = 0
            for _ in range(repeats):
                for s in SENTENCES:
                    tokens = {}
                    for mode in modes[group % len(modes):] + modes[:group % len(modes)]:
                        a = acc[mode]
                        client.reset_counters()
                        t0 = time.time()
                        if mode == "local":
                            res = compare(local, s, rl, prompt, max_new_tokens=new_tokens, trace=False)
                        else:
                            res = compare_remote(remote, s, rr, prompt, max_new_tokens=new_tokens, trace=False,
                                                 lm=mode)
                        tokens[mode] = [r.tokens for r in res.rows]
                        a["seconds"] += time.time() - t0
                        a["tokens"] += sum(len(r.tokens) for r in res.rows)
                        a["steps"] += res.steps
                        a["sent"] += client.sent
                        a["received"] += client.received
                        a["requests"] += client.requests
                    for mode in modes[1:]:
                        acc[mode]["same"] &= tokens[mode] == tokens["local"]
                    group += 1
            results = {}
            local_tps = acc["local"]["tokens"] / acc["local"]["seconds"]
            for mode, a in acc.items():
                toks, steps = a["tokens"], a["steps"]
                results[mode] = {"tokens": toks, "steps": steps, "seconds": round(a["seconds"], 2),
                                 "tokens_per_s": round(toks / a["seconds"], 2)}
                if mode != "local":
                    total = a["sent"] + a["received"]
                    results[mode].update(speed_vs_local=round(toks / a["seconds"] / local_tps, 3),
                                         bytes_per_step=round(total / steps), bytes_per_token=round(total / toks),
                                         sent_per_token=round(a["sent"] / toks),
                                         received_per_token=round(a["received"] / toks),
                                         requests=a["requests"], same_tokens_as_local=a["same"])
            out["decode"] = {"rows": [r.label for r in rl], "sentences": len(SENTENCES), "repeats": repeats,
                             "max_new_tokens": new_tokens, **results}
            remote.client.close()
            return out
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks offsite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="tiny")
    ap.add_argument("--pairs", type=int, default=40, help="samples in the memory")
    ap.add_argument("--new-tokens", type=int, default=24, help="max new tokens per decode")
    ap.add_argument("--repeats", type=int, default=2, help="times each sentence is decoded per mode")
    ap.add_argument("--owner-in-process", action="store_true",
                    help="serve the owner from a thread of this process on the backbone loaded here (one copy of "
                         "the weights: one heavy process on a shared machine), still over loopback HTTP")
    args = ap.parse_args(argv)
    print(json.dumps(run(args.backbone, args.pairs, args.new_tokens, args.repeats, args.owner_in_process),
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
