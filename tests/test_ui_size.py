"""The page's builders stay readable: no function in ``ui/`` is longer than 120 lines (a long builder is split by
panel into named functions: a panel's layout, then its events)."""
import ast
from pathlib import Path

UI = Path(__file__).resolve().parents[1] / "ui"
MAX_LINES = 120


def test_no_ui_function_over_120_lines():
    long = []
    for path in sorted(UI.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"ui/{path.relative_to(UI)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_LINES} lines (split them by panel):\n" + "\n".join(long)


def test_every_methods_level_has_a_readable_label():
    """The Plug-ins tab names each method's level in words (not the raw key, e.g. retrieval_icl's "prompt")."""
    from plugins.api import method_table
    from ui.plugins import _method_info

    for m in method_table():
        text = _method_info(m)
        assert f"— {m['level']}." not in text, m["name"]
        assert "-level" in text or "in-network" in text, m["name"]
