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


# --- the studio's services ------------------------------------------------------------------------------------------
# A service reaches a sibling only through its methods: what several services share (the gate, the plug-in cache, …)
# each receives from its constructor (ARCHITECTURE.md, "The studio's services"); and nothing in ``studio/`` or ``ui/``
# forwards names through ``__getattr__``, so go-to-definition lands on the method a caller names.
FORWARDING_FREE = ("studio", "ui")
ENTRY_MODULES = ("ui", "app.py")  # where ``studio`` is always the Studio instance


def getattr_definitions(path: Path) -> list[int]:
    """Lines where ``path`` defines ``__getattr__`` (a module's or a class's)."""
    return [n.lineno for n in ast.walk(parsed(path)[1])
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "__getattr__"]


def sibling_reads(source: str) -> list[str]:
    """Reads of a service's attributes that are not method calls, in ``source``: ``self.<x>.<attr>`` where
    ``self.<x>`` holds a service (set in ``__init__`` from a parameter annotated ``…Service``), and ``<p>.<attr>``
    where ``<p>`` is a function's parameter that is a service (annotated ``…Service`` or named ``…_svc``)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def is_service(arg: ast.arg) -> bool:
        return arg.arg.endswith("_svc") or (arg.annotation is not None
                                             and ast.unparse(arg.annotation).strip("'\"").endswith("Service"))

    def reads(scope, holds) -> list[str]:
        found = []
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and holds(node.value):
                parent = parents.get(node)
                if not (isinstance(parent, ast.Call) and parent.func is node):
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
        return found

    out = []
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        if init is None:
            continue
        params = {a.arg for a in [*init.args.args, *init.args.kwonlyargs] if is_service(a)}
        pairs = [(t, s.value) for s in ast.walk(init) if isinstance(s, ast.Assign) for t in s.targets]
        pairs += [p for t, v in pairs if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple)
                  for p in zip(t.elts, v.elts)]
        held = {t.attr for t, v in pairs if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
                and isinstance(v, ast.Name) and v.id in params}
        out += reads(cls, lambda v: isinstance(v, ast.Attribute) and v.attr in held and ast.unparse(v.value) == "self")
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        params = {a.arg for a in [*fn.args.args, *fn.args.kwonlyargs] if is_service(a)}
        if params and fn.name != "__init__":
            out += reads(fn, lambda v, p=params: isinstance(v, ast.Name) and v.id in p)
    return sorted(set(out), key=lambda hit: (int(hit.split(":")[0]), hit))


def studio_attributes(root: Path = ROOT) -> set[str]:
    """What a ``Studio`` has: the names its class defines and the ``self.<name>`` it assigns."""
    tree = parsed(root / "studio" / "service.py")[1]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Studio")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}
    return names


def unknown_studio_names(path: Path, known: set[str], root: Path = ROOT) -> list[str]:
    """``studio.<name>`` in ``path`` where the Studio has no ``<name>`` (it forwards nothing)."""
    return [f"{path.relative_to(root)}:{n.lineno}: studio.{n.attr}" for n in ast.walk(parsed(path)[1])
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "studio"
            and n.attr not in known]


def test_nothing_in_studio_or_ui_forwards_through_getattr():
    found = [f"{p.relative_to(ROOT)}:{line}" for pkg in FORWARDING_FREE for p in sorted((ROOT / pkg).glob("*.py"))
             for line in getattr_definitions(p)]
    assert not found, "__getattr__ hides where a name is defined: " + ", ".join(found)


def test_no_service_reads_a_siblings_attributes():
    found = [f"studio/{p.name}:{r}" for p in sorted((ROOT / "studio").glob("*.py"))
             for r in sibling_reads(p.read_text(encoding="utf-8"))]
    assert not found, ("a service reads another service's attributes (give it what it needs through its "
                       "constructor, or call a method):\n" + "\n".join(found))


def test_the_ui_and_the_app_name_only_what_a_studio_has():
    known = studio_attributes()
    assert {"compare_service", "gate", "jobs", "limits"} <= known
    paths = [p for entry in ENTRY_MODULES for p in sorted((ROOT / entry).glob("*.py") if (ROOT / entry).is_dir()
                                                          else [ROOT / entry])]
    found = [hit for p in paths for hit in unknown_studio_names(p, known)]
    assert not found, "names a Studio does not have:\n" + "\n".join(found)


def test_the_service_checks_see_each_kind_of_violation(tmp_path):
    """The checks themselves work: a sibling's attribute read (not a call), one through a function's parameter, a
    ``__getattr__``, and a forwarded name in the UI are each found; calls of a sibling's methods are not."""
    source = '''
class MemoryService:
    def __init__(self, ctx, backbone_svc: BackboneService, gate: BackboneGate):
        self.backbone_svc, self.gate = backbone_svc, gate
        self.backbones = backbone_svc

    def build(self):
        with self.gate.use():
            return self.backbone_svc.status(), self.backbones.loaded_backbone()

    def bad(self):
        return self.backbones.gate.use(), self.backbones.backbone_name

def spec(backbone_svc):
    return backbone_svc.remote_url, backbone_svc.worker_spec()
'''
    assert sibling_reads(source) == ["12: self.backbones.backbone_name", "12: self.backbones.gate",
                                     "15: backbone_svc.remote_url"]
    assert sibling_reads(source.replace("def bad", "def fine").replace(
        "self.backbones.gate.use(), self.backbones.backbone_name", "self.backbone_svc.status()")) == [
        "15: backbone_svc.remote_url"]
    (tmp_path / "studio").mkdir()
    (tmp_path / "studio" / "service.py").write_text(
        "class Studio:\n    def __init__(self):\n        self.compare_service = 1\n\n    def __getattr__(self, n):\n"
        "        return n\n")
    (tmp_path / "ui.py").write_text("def f(studio):\n    return studio.compare_service.compare(), studio.compare()\n")
    assert getattr_definitions(tmp_path / "studio" / "service.py") == [5]
    known = studio_attributes(tmp_path)
    assert known == {"__init__", "__getattr__", "compare_service"}
    assert unknown_studio_names(tmp_path / "ui.py", known, tmp_path) == ["ui.py:2: studio.compare"]


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


# --- a narrow method protocol ---------------------------------------------------------------------------------------
# ``Plugin`` is config + fit + save/load + what the engine reads of every method; how a method acts comes from its
# level's base (``OutputPlugin``, ``NetworkPlugin``), what the studio and the estimate know of it from its card
# (``plugins.card``).
PLUGIN_MAX_METHODS = 15


def methods_of_class(path: Path, name: str) -> list[str]:
    """The functions defined in the body of the top-level class ``name`` of ``path`` (properties, class and static
    methods included; inherited ones not)."""
    cls = next(n for n in parsed(path)[1].body if isinstance(n, ast.ClassDef) and n.name == name)
    return [f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_plugin_has_at_most_15_methods():
    methods = methods_of_class(ROOT / "plugins" / "base.py", "Plugin")
    assert len(methods) <= PLUGIN_MAX_METHODS, f"Plugin defines {len(methods)} methods: {', '.join(methods)}"


def test_the_method_count_sees_every_kind_of_method(tmp_path):
    f = tmp_path / "base.py"
    f.write_text("class Plugin:\n    x = 1\n\n    def a(self):\n        pass\n\n    @property\n    def b(self):\n"
                 "        pass\n\n    @classmethod\n    def c(cls):\n        pass\n\n    async def d(self):\n"
                 "        pass\n\n\nclass Output(Plugin):\n    def e(self):\n        pass\n")
    assert methods_of_class(f, "Plugin") == ["a", "b", "c", "d"]


# --- library internals only in ``*_internals.py`` -------------------------------------------------------------------
CACHE_COUNTERS = {"cumulative_length", "cumulative_length_int", "_seen_tokens"}  # a transformers cache's counts
IN_PLACE = {"fill_", "add_", "sub_", "zero_", "copy_"}
GRADIO_INTERNALS = {"_queue", "fns", "state_holder", "process_api", "upload_file_set", "has_launched", "stop_event",
                    "state_session_capacity", "api_visibility"}  # the Blocks attributes ui/gradio_internals.py holds


def library_internals_in(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every library internal used in ``path``: an import of a Gradio submodule, a Gradio ``Blocks``
    attribute that ``ui/gradio_internals.py`` holds, ``_attn_implementation``, a write to a cache layer's position
    counter, a module's ``forward`` replaced (assigned, deleted or set on anything but ``self`` or a class of the
    project's own)."""
    _lines, tree = parsed(path)
    own_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
                 and n.module and n.module.split(".")[0] in FLOORS for a in n.names}
    found = []

    def attr_of(target):
        return target.attr if isinstance(target, ast.Attribute) else None

    def forward_owner_ok(target: ast.Attribute) -> bool:
        return isinstance(target.value, ast.Name) and (target.value.id == "self" or target.value.id in own_names)

    def written(target, line: int, verb: str):
        name = attr_of(target)
        if name in CACHE_COUNTERS:
            found.append((line, f"{verb} a cache counter ({name})"))
        elif name == "forward" and not (verb == "writes" and forward_owner_ok(target)):
            found.append((line, f"{'replaces' if verb == 'writes' else 'deletes'} a module's forward"))
        elif (isinstance(target, ast.Subscript) and attr_of(target.value) == "__dict__"
              and isinstance(target.slice, ast.Constant) and target.slice.value in CACHE_COUNTERS | {"forward"}):
            found.append((line, f"{verb} {target.slice.value} through __dict__"))

    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [(line, f"imports {a.name}") for a in node.names if a.name.startswith("gradio.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gradio."):
            found.append((line, f"imports from {node.module}"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    written(t, line, "writes")
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                written(t, line, "deletes")
        elif isinstance(node, ast.Call):
            func = node.func
            if attr_of(func) in IN_PLACE and attr_of(func.value) in CACHE_COUNTERS:
                found.append((line, f"writes a cache counter ({func.value.attr}.{func.attr})"))
            elif (isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in CACHE_COUNTERS | {"forward"}):
                found.append((line, f"{func.id}(…, {node.args[1].value!r})"))
        elif isinstance(node, ast.Attribute) and node.attr == "_attn_implementation":
            found.append((line, "_attn_implementation"))
        elif isinstance(node, ast.Attribute) and node.attr in GRADIO_INTERNALS:
            found.append((line, f"a Gradio internal (.{node.attr})"))
        elif isinstance(node, ast.Constant) and node.value in ("_attn_implementation", *GRADIO_INTERNALS):
            found.append((line, f"{node.value!r} (getattr by name)"))
    return sorted(set(found))


def test_library_internals_stay_in_the_internals_modules():
    """A Gradio submodule, a Gradio ``Blocks``' internals, ``_attn_implementation``, a cache layer's counters and a
    replaced ``forward`` appear only in ``backbone/hf_internals.py``, ``backbone/torch_internals.py`` and
    ``ui/gradio_internals.py``, which tests/test_library_internals.py checks against the pinned versions."""
    bad = [f"{path.relative_to(ROOT)}:{line}: {what}" for mod, path in project_modules().items()
           if not path.name.endswith("_internals.py") for line, what in library_internals_in(path)]
    assert not bad, ("library internals outside the *_internals.py modules (add a function there, checked in "
                     "tests/test_library_internals.py, and call it):\n" + "\n".join(bad))


def test_the_internals_check_sees_each_kind_of_internal(tmp_path):
    """Each kind is found, and the project's own ``forward`` (a method of ``self``, a class of its own) is not."""
    bad = tmp_path / "bad.py"
    bad.write_text("\n".join([
        "from gradio.utils import get_upload_folder",
        "import gradio.routes",
        "impl = model.config._attn_implementation",
        "layer.cumulative_length = 3",
        "st.cumulative_length.fill_(3)",
        "layer.forward = lambda h: h",
        "del layer.forward",
        "setattr(layer, 'forward', f)",
        "q = demo._queue",
        "h = getattr(demo, 'state_holder', None)",
        "m.__dict__['forward'] = f",
    ]) + "\n")
    assert [line for line, _what in library_internals_in(bad)] == list(range(1, 12))
    good = tmp_path / "good.py"
    good.write_text("from backbone.kernels import Fp16WeightLinear\n\nimport gradio as gr\n\n"
                    "class Decode:\n    def __init__(self, forward):\n        self.forward = forward\n\n"
                    "Fp16WeightLinear.forward = None\nn = cache.get_seq_length()\nx = gr.Blocks()\n")
    assert library_internals_in(good) == []
