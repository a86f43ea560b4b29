"""Test that no kvflow module imports upward: errors < core < backends < runtime < connector <
engine, integrations < bench < cli.

Checked statically, from every module's syntax tree, so an import inside a function (a lazy
import) or under ``TYPE_CHECKING`` counts as much as one at the top.
"""

from __future__ import annotations

import runpy
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "kvflow"
GRAPH = runpy.run_path(str(ROOT / "scripts" / "gen_module_graph.py"))
module_name: Callable[[Path], str] = GRAPH["module_name"]
kvflow_imports: Callable[[Path], list[tuple[int, str]]] = GRAPH["kvflow_imports"]

LAYERS: dict[str, int] = {
    "": 0,  # kvflow/__init__.py
    "errors": 0,
    "core": 1,
    "backends": 2,
    "runtime": 3,
    "connector": 4,
    "engine": 5,
    "integrations": 5,
    "tracing": 5,  # trace files for the benchmarks and the CLI; imports only errors
    "pd": 6,  # the PD router and its engine processes: above the engine it runs
    "bench": 7,
    "cli": 8,
}
"""Each top-level part of kvflow and its layer; a part may import its own package and lower
layers, never a peer of its own layer or a higher one."""


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_part_of_kvflow_has_a_layer() -> None:
    """Each top-level module or package of kvflow is assigned a layer in LAYERS."""
    parts = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    parts = {"" if p == "__init__" else p for p in parts}
    assert parts <= LAYERS.keys(), f"parts without a layer: {sorted(parts - LAYERS.keys())}"


def test_no_module_imports_a_higher_layer_or_a_peer() -> None:
    """No kvflow module imports (at top level or lazily) from a higher layer or a peer part."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    bad: list[str] = []
    for path in files:
        source = module_name(path)
        src_part = _part(source)
        for line, target in kvflow_imports(path):
            dst_part = _part(target)
            if dst_part == src_part:
                continue
            if dst_part not in LAYERS or LAYERS[dst_part] >= LAYERS[src_part]:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert bad == [], "imports against the layers:\n" + "\n".join(bad)


def test_module_graph_doc_is_up_to_date() -> None:
    """docs/modules.md is exactly what scripts/gen_module_graph.py renders from the imports."""
    assert (ROOT / "docs" / "modules.md").read_text() == GRAPH["render"](), (
        "run scripts/gen_module_graph.py"
    )
