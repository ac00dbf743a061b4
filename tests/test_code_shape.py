"""The long tail rots first (STYLE.md): no function in the shipped code grows past 80 lines, no module
past 500, the package's import graph has no circle and no upward import between its layers, and
the whole tree passes ruff (lint and format check, rules in ruff.toml)."""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("megarl", "megatron_patches", "tools", "benchmarks", "scripts")
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500

# Layers of megarl, lowest first: a package may import its own layer's packages and lower ones, never
# higher (lazy imports inside functions count too: they are dependencies all the same).
LAYERS = (
    ("utils",),
    ("models", "rewards", "testing"),
    ("data", "algorithms"),
    ("engine", "rollout", "agent"),
    ("config",),
    ("plan",),
    ("workers",),
    ("controller",),
    ("trainer",),
    ("cli",),
)


def _shipped_files():
    for folder in SHIPPED:
        yield from sorted((REPO / folder).rglob("*.py"))


def test_no_function_over_80_lines():
    too_long = []
    for path in _shipped_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert not too_long, "split these functions: " + ", ".join(too_long)


def test_no_module_over_500_lines():
    too_long = [
        f"{p.relative_to(REPO)} ({n} lines)"
        for p in _shipped_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not too_long, "split these modules: " + ", ".join(too_long)


def _module_imports() -> dict[str, set[str]]:
    """megarl module -> the megarl modules it imports (module level or inside functions)."""
    modules = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (REPO / "megarl").rglob("*.py")
    }
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("megarl"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges[name].add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name.startswith("megarl"))
    return {m: {t for t in targets if t in modules} for m, targets in edges.items()}


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_packages_import_only_their_own_layer_or_lower():
    layer = {package: i for i, packages in enumerate(LAYERS) for package in packages}
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in _module_imports().items()
        for t in targets
        if layer.get(_package(t), -1) > layer.get(_package(m), len(LAYERS))
    )
    unknown = sorted({_package(m) for m in _module_imports()} - set(layer) - {"megarl"})
    assert not unknown, f"give these packages a layer in LAYERS: {unknown}"
    assert not upward, "imports from a higher layer: " + ", ".join(upward)


def test_no_import_circle_between_modules():
    graph = _module_imports()
    # a package's __init__ re-exporting its own modules is not a circle
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import circles: " + "; ".join(cycles)


@pytest.mark.parametrize("command", [["check", "--no-fix"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    """Fix with: .venv/bin/ruff format . && .venv/bin/ruff check --fix ."""
    done = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
