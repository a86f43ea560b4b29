"""Test that kvflow.core stays sans-IO: importing it pulls in no torch, anyio, cuda or numpy."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import kvflow.core

SRC = Path(__file__).resolve().parents[2] / "src"
# asyncio itself is imported by structlog; what matters is that core never runs a loop.
FORBIDDEN = ("torch", "anyio", "cuda", "numpy", "zmq", "msgspec")


def test_core_modules_import_no_device_or_loop_libraries() -> None:
    """Every kvflow.core module imports in a fresh interpreter without torch/anyio/cuda/numpy."""
    modules = [m.name for m in pkgutil.walk_packages(kvflow.core.__path__, "kvflow.core.")]
    assert "kvflow.core.block_pool" in modules
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == []
