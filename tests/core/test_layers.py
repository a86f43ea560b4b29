"""Test that no kvflow module imports upward: errors < core < backends < runtime < connector <
engine, integrations < bench < cli.

Checked statically, from every module's syntax tree, so an import inside a function (a lazy
import) or under ``TYPE_CHECKING`` counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "kvflow"

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
    "bench": 6,
    "cli": 7,
}
"""Each top-level part of kvflow and its layer; a part may import its own package and lower
layers, never a peer of its own layer or a higher one."""


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every kvflow import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kvflow"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target == "kvflow":
                out += [(node.lineno, f"kvflow.{a.name}") for a in node.names]
            elif target.split(".")[0] == "kvflow":
                out.append((node.lineno, target))
    return out


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
        source = _module_name(path)
        src_part = _part(source)
        for line, target in _imports(path):
            dst_part = _part(target)
            if dst_part == src_part:
                continue
            if dst_part not in LAYERS or LAYERS[dst_part] >= LAYERS[src_part]:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert bad == [], "imports against the layers:\n" + "\n".join(bad)
