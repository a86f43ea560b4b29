"""Importing kvflow never imports vLLM: only ``kvflow.integrations.vllm`` does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvflow

PROBE = """
import sys
import kvflow, kvflow.integrations, kvflow.core.offload, kvflow.runtime.threaded, kvflow.cli.main
leaked = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print(len(leaked))
"""


def test_importing_kvflow_does_not_import_vllm() -> None:
    """A fresh interpreter that imports kvflow's packages has no vllm module loaded."""
    env = {**os.environ, "PYTHONPATH": str(Path(kvflow.__file__).resolve().parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=env,
    )
    assert out.stdout.strip() == "0"
