"""OpenMP's wait policy (ground): idle threads sleep at once by default, a training, build or rank command lets
them spin briefly first, and a user's own setting is kept. The policy must be in the environment before torch
loads, so each case runs the CLI module in a fresh interpreter (``--help``: nothing is loaded or trained)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ground

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json, os, runpy, sys
sys.argv = ["x", *sys.argv[2:], "--help"]
try:
    runpy.run_module(sys.argv_module, run_name="__main__")
except SystemExit:
    pass
print(json.dumps({k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}))
"""


def _policy_after(module: str, command: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = PROBE.replace("sys.argv_module", repr(module))
    out = subprocess.run([sys.executable, "-c", code, module, command], cwd=ROOT, env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module,command", [("plugins", "train"), ("memories", "build")])
def test_training_and_build_commands_spin_briefly(module, command):
    assert _policy_after(module, command) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": ground.BATCH_SPIN_COUNT}


def test_other_commands_sleep_at_once():
    assert _policy_after("plugins", "list") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}


def test_a_users_own_policy_is_kept():
    assert _policy_after("eval", "rank", OMP_WAIT_POLICY="ACTIVE") == {"OMP_WAIT_POLICY": "ACTIVE",
                                                                       "GOMP_SPINCOUNT": None}


def test_too_late_once_torch_has_loaded():
    import torch  # noqa: F401  (loaded already in a test process: its OpenMP runtime has read the policy)

    before = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert ground.spin_briefly() is False
    assert {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} == before
