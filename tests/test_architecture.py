"""The floors of ARCHITECTURE.md, checked by walking every import of the project's own modules (AST, no import).

1 ground · 2 backbone · 3 engine · 4 memories · 5 plugins · 6 eval, offsite · 7 studio · 8 ui, app.py, benchmarks
and every CLI (``<package>/__main__.py``). A module may import its own floor and the floors below it, never one
above; the module-level import graph has no cycle; a function-level import of a project module is allowed only with
a comment on its line that says why (a heavy or optional dependency behind it). The package holding the decode
engine (``BatchDecode``) imports no method, memory, evaluation, offsite, studio or UI module, at any level.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"ground": 1, "backbone": 2, "engine": 3, "memories": 4, "plugins": 5, "eval": 6, "offsite": 6,
          "studio": 7, "ui": 8, "app": 8, "benchmarks": 8}
ENTRY_FLOOR = 8
ENGINE_MAY_NOT_IMPORT = ("plugins", "studio", "ui", "eval", "memories", "offsite")
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


def package_defining(cls_name: str, modules: dict[str, Path]) -> str | None:
    """The top-level package of the module that defines class ``cls_name`` (found by its AST, wherever it moves)."""
    for mod, path in modules.items():
        _lines, tree = parsed(path)
        if any(isinstance(n, ast.ClassDef) and n.name == cls_name for n in tree.body):
            return mod.split(".")[0]
    return None


def engine_imports_above(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Every import, at any level (module, function, ``if``), by a module of the package holding ``BatchDecode`` of a
    module of a package it may not import."""
    engine = package_defining("BatchDecode", modules)
    assert engine is not None, "no module defines BatchDecode"
    bad = []
    for mod, path in modules.items():
        if mod.split(".")[0] != engine:
            continue
        for target, line, _top, src in imports_of(path, modules):
            if target.split(".")[0] in ENGINE_MAY_NOT_IMPORT:
                bad.append(f"{path.relative_to(root)}:{line}: {src.strip()}")
    return bad


def test_the_engine_imports_no_method_studio_ui_eval_memories_or_offsite_module():
    modules = project_modules()
    assert package_defining("BatchDecode", modules) == "engine"
    bad = engine_imports_above(modules)
    assert not bad, "the engine imports what sits above it:\n" + "\n".join(bad)


def test_the_engine_check_sees_an_import_of_a_method(tmp_path):
    """The engine rule fails when the package holding ``BatchDecode`` imports a method, even inside a function, and
    passes the same tree without that import."""
    def tree(root: Path, mixing: str) -> dict[str, Path]:
        for pkg in ("engine", "plugins"):
            (root / pkg).mkdir(parents=True)
            (root / pkg / "__init__.py").write_text("")
        (root / "engine" / "loop.py").write_text("import torch\n\nclass BatchDecode:\n    pass\n")
        (root / "engine" / "mixing.py").write_text(mixing)
        (root / "plugins" / "base.py").write_text("class Plugin:\n    pass\n")
        (root / "app.py").write_text("")
        return project_modules(root)

    bad = tree(tmp_path / "bad", "def f():\n    from plugins.base import Plugin  # heavy\n")
    assert package_defining("BatchDecode", bad) == "engine"
    assert engine_imports_above(bad, tmp_path / "bad") == [
        "engine/mixing.py:2: from plugins.base import Plugin  # heavy"]
    good = tree(tmp_path / "good", "import torch\n")
    assert engine_imports_above(good, tmp_path / "good") == []
