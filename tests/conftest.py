import inspect
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("PEMA_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def tiny():
    from backbone.tiny import tiny_backbone

    return tiny_backbone()


@pytest.fixture(scope="session")
def tiny_pairs():
    return [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schlaeft"),
            ("good morning", "Guten Morgen"), ("hello world", "hallo Welt")] * 3


@pytest.fixture(scope="session")
def tiny_memory(tiny, tiny_pairs, tmp_path_factory):
    from backbone.prompts import Prompt
    from memories.build import build_memory
    from memories.parse import Sample

    out = tmp_path_factory.mktemp("mem") / "m"
    samples = [Sample(s, t, i + 1) for i, (s, t) in enumerate(tiny_pairs)]
    return build_memory(tiny, samples, out, prompt=Prompt.for_task("translation"))


@pytest.fixture(scope="session")
def shared_data():
    if not SHARED.exists():
        pytest.skip(f"reference data not found at {SHARED} (set PEMA_SHARED_DATA)")
    return SHARED


@pytest.fixture(scope="session")
def gemma():
    """The real embedded default backbone (de-quantized once and cached under the data directory)."""
    if os.environ.get("PEMA_SKIP_REAL_BACKBONE"):
        pytest.skip("PEMA_SKIP_REAL_BACKBONE is set")
    from backbone import load_backbone

    try:
        return load_backbone("gemma-3-270m")
    except Exception as e:  # missing package: say so instead of failing obscurely
        pytest.skip(f"embedded Gemma backbone unavailable: {e}")


# Tests that start Ray or other processes (a model-owner server, studio processes killed mid-job, the load test's
# studio) take most of the suite's time on 2 cores: marked `slow`, so `make test-fast` can leave them out.
SLOW_MODULES = {"test_ray.py", "test_loadtest.py"}
SLOW_FIXTURES = {"owner", "crashed"}  # test_offsite's owner process; test_data_directory's forked studios


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        try:
            source = inspect.getsource(fn) if fn else ""
        except (OSError, TypeError):
            source = ""
        if (item.path.name in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
                or "spawn(" in source or "subprocess.Popen" in source):
            item.add_marker(pytest.mark.slow)


def _tracked_changes() -> dict[str, bytes] | None:
    """Tracked files that differ from the index, with their current bytes (None outside a git checkout)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    changed = {}
    for line in out.splitlines():
        name = line[3:].split(" -> ")[-1]
        path = root / name
        changed[name] = path.read_bytes() if path.is_file() else b""
    return changed


def pytest_sessionstart(session):
    # The suite must never write into the checkout (a test once left a fake backbone in the tuned defaults);
    # checked when asked (make test), since a developer may be editing files while the tests run.
    if os.environ.get("PEMA_CHECK_CLEAN_TREE") == "1":
        session.config._tracked_before = _tracked_changes()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_tracked_before", None)
    if before is None:
        return
    after = _tracked_changes() or {}
    written = sorted(name for name, data in after.items() if before.get(name) != data)
    if written:
        sys.stderr.write("\nThe test suite changed tracked files: " + ", ".join(written) + "\n")
        session.exitstatus = 1
