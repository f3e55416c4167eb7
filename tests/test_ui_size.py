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
