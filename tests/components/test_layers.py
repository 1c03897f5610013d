"""The layers' imports, read from the source (every import, a function's lazy ones too; only type-checking
ones are left out): no cycle among the layers a run's plan passes through, the config layer imports no other,
and the settings module loads without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

COMPONENTS = Path(__file__).resolve().parents[2] / "components"
CORE = {"config", "settings", "plan", "rl", "rollout", "training"}


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def layer_edges() -> dict[str, dict[str, list[str]]]:
    """layer -> {layer it imports: [file:line, ...]}; a layer is a package or module under components/."""
    edges: dict[str, dict[str, list[str]]] = {}
    for path in COMPONENTS.rglob("*.py"):
        src = path.relative_to(COMPONENTS).parts[0].removesuffix(".py")
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("components."):
                continue
            dst = node.module.split(".")[1]
            if dst != src and not _type_checking_only(node, parents):
                edges.setdefault(src, {}).setdefault(dst, []).append(f"{path.name}:{node.lineno}")
    return edges


def test_no_cycle_among_config_settings_plan_rl_rollout_and_training():
    edges = {a: {b for b in bs if b in CORE} for a, bs in layer_edges().items() if a in CORE}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, "import cycle: " + " -> ".join([*path, node])
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for layer in sorted(CORE):
        visit(layer, [])


def test_the_config_layer_imports_no_other_layer():
    assert set(layer_edges().get("config", {})) <= {"errors"}, layer_edges()["config"]


def test_settings_import_neither_torch_nor_a_worker():
    assert set(layer_edges().get("settings", {})) == set()
    code = "import sys, components.settings; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    )
