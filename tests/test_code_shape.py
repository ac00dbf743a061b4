"""The long tail rots first: no function in the shipped code grows past 80 lines (STYLE.md)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("megarl", "megatron_patches", "tools", "benchmarks", "scripts")
MAX_FUNCTION_LINES = 80


def test_no_function_over_80_lines():
    too_long = []
    for folder in SHIPPED:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert not too_long, "split these functions: " + ", ".join(too_long)
