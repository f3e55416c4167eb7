"""The floors of ARCHITECTURE.md, checked by walking every import of the project's own modules (AST, no import).

1 ground · 2 backbone · 3 memories · 4 plugins · 5 eval, offsite · 6 studio · 7 ui, app.py, benchmarks and every
CLI (``<package>/__main__.py``). A module may import its own floor and the floors below it, never one above; the
module-level import graph has no cycle; a function-level import of a project module is allowed only with a comment
on its line that says why (a heavy or optional dependency behind it).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"ground": 1, "backbone": 2, "memories": 3, "plugins": 4, "eval": 5, "offsite": 5, "studio": 6,
          "ui": 7, "app": 7, "benchmarks": 7}
ENTRY_FLOOR = 7
REASON_WORDS = ("heavy", "optional")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {"app": root / "app.py"}
    for pkg in FLOORS:
        folder = root / pkg
        if folder.is_dir():
            for f in folder.rglob("*.py"):
                parts = f.relative_to(root).with_suffix("").parts
                mods[".".join(p for p in parts if p != "__init__")] = f
    return mods


def floor_of(module: str) -> int:
    if module.endswith(".__main__") or module == "app":
        return ENTRY_FLOOR
    return FLOORS[module.split(".")[0]]


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> tuple[list[str], ast.Module]:
    """Each file is parsed once per session (three tests walk the same tree)."""
    text = path.read_text(encoding="utf-8")
    return text.splitlines(), ast.parse(text)


def imports_of(path: Path, modules: dict[str, Path]):
    """(imported project module, line, top_level, source line) for every import in ``path``."""
    lines, tree = parsed(path)
    out = []

    def visit(node, in_def: bool):
        for child in ast.iter_child_nodes(node):
            nested = in_def or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            else:
                names = []
            for name in names:
                target = name
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    out.append((target, child.lineno, not in_def, lines[child.lineno - 1]))
                    break
            visit(child, nested)

    visit(tree, False)
    return out


def test_no_import_runs_upwards():
    modules = project_modules()
    bad = []
    for mod, path in modules.items():
        for target, line, _top, src in imports_of(path, modules):
            if floor_of(target) > floor_of(mod):
                bad.append(f"{path.relative_to(ROOT)}:{line} (floor {floor_of(mod)}) imports {target} "
                           f"(floor {floor_of(target)})")
    assert not bad, "imports that run upwards:\n" + "\n".join(bad)


def test_no_import_cycle():
    modules = project_modules()
    graph = {m: {t for t, _l, top, _s in imports_of(p, modules) if top and t != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    cycles = []

    def dfs(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                dfs(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [])
    # a package's __init__ importing its own submodules is how packages re-export: not a cycle of design
    cycles = [c for c in cycles if not all(part.split(".")[0] == c.split(".")[0] for part in c.split(" -> "))
              or len({p for p in c.split(" -> ")}) > 2]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_function_level_imports_say_why():
    modules = project_modules()
    bad = []
    for mod, path in modules.items():
        for target, line, top, src in imports_of(path, modules):
            if not top and not any(w in src.lower() for w in REASON_WORDS):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {src.strip()}")
    assert not bad, ("function-level imports of project modules without a reason (move them to the top, or say "
                     "on the line why they must be lazy):\n" + "\n".join(bad))


def test_the_checker_sees_a_violation(tmp_path):
    """The walk itself works: a lower floor's function-level import of a higher floor is found."""
    for pkg in ("backbone", "studio"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "backbone" / "bad.py").write_text("import torch\n\ndef f():\n    from studio.service import Studio\n")
    (tmp_path / "studio" / "service.py").write_text("import backbone.bad\n")
    (tmp_path / "app.py").write_text("")
    modules = project_modules(tmp_path)
    found = [(t, line, top) for t, line, top, _s in imports_of(modules["backbone.bad"], modules)]
    assert found == [("studio.service", 4, False)]
    assert floor_of("studio.service") > floor_of("backbone.bad")
