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
exit $status
