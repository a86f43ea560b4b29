#!/usr/bin/env bash
# renamed_tree.sh REF DIR [NAME]: kvflow's package as of git ref REF, copied to DIR/NAME (default
# kvflow_base) with every import of kvflow renamed, so that it loads beside this tree's kvflow in
# one process (scripts/bench_vllm_scheduler.py --base NAME, with DIR on PYTHONPATH).
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: renamed_tree.sh REF DIR [NAME]" >&2
  exit 2
fi
ref=$1 dir=$2 name=${3:-kvflow_base}
[[ $name =~ ^[a-z_][a-z0-9_]*$ ]] || { echo "renamed_tree.sh: $name is not a package name" >&2; exit 2; }
git rev-parse --verify -q "$ref^{commit}" >/dev/null || { echo "renamed_tree.sh: no commit $ref" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git archive "$ref" src/kvflow | tar -x -C "$tmp"
find "$tmp/src/kvflow" -name '*.py' -exec sed -i -E \
  "s/\bkvflow\./$name./g; s/^from kvflow import /from $name import /; s/^import kvflow$/import $name/" {} +
mkdir -p "$dir"
rm -rf "${dir:?}/$name"
mv "$tmp/src/kvflow" "$dir/$name"
echo "$dir/$name: kvflow at $(git rev-parse --short "$ref")"
