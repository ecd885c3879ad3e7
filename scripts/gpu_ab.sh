#!/usr/bin/env bash
# On the GPU machine: this tree's GPU tests, and `mleagle bench gpu` of this tree against another tree
# of the project (for example the commit before a change), alternating in one session, so that a
# change's speed is compared on one machine within the same minutes.
#
#   scripts/gpu_ab.sh OUT OTHER_TREE [--tests] [--order new,old] [bench gpu options]
#
# OUT gets gpu_tests.log (with --tests), {new,old}_<n>.json (one per run, n counting up in OUT) and
# bench.log. OTHER_TREE is a checkout or `git archive` of the other tree (code only: the drafts are
# read from this tree). Defaults: SmolLM2 with its shipped draft, batch 1/32/64, 256 new tokens,
# two static batches per size (MT-Bench from $MLEAGLE_DATA_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_ab.sh OUT OTHER_TREE [--tests] [--order new,old] [bench gpu options]}"
OTHER="$(cd "${2:?OTHER_TREE}" && pwd)"
shift 2
TESTS=0
ORDER="new,old"
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) TESTS=1; shift ;;
    --order) ORDER="$2"; shift 2 ;;
    *) break ;;
  esac
done
mkdir -p "$OUT" /tmp/mleagle-ab/new /tmp/mleagle-ab/old
# Import each tree as `mleagle` (the repository root is the package).
ln -sfn "$PWD" /tmp/mleagle-ab/new/mleagle
ln -sfn "$OTHER" /tmp/mleagle-ab/old/mleagle
PY="${PYTHON:-python3}"
BASE_PP="${PYTHONPATH:-}"
if [ "$TESTS" = 1 ]; then
  PYTHONPATH="/tmp/mleagle-ab/new${BASE_PP:+:$BASE_PP}" "$PY" -m pytest -q -p no:cacheprovider \
    tests/engine/test_gpu_graphs.py tests/engine/test_kernels_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
fi
ARGS=(--model smollm2-135m --configs graphs,spec --draft drafts/smollm2-135m-mtp3 --batch-sizes 1,32,64
      --max-new-tokens 256 --batches 2 "$@")
for side in ${ORDER//,/ }; do
  n=1
  while [ -e "$OUT/${side}_$n.json" ]; do n=$((n + 1)); done
  echo "== $side run $n: bench gpu ${ARGS[*]}" | tee -a "$OUT/bench.log"
  PYTHONPATH="/tmp/mleagle-ab/$side${BASE_PP:+:$BASE_PP}" "$PY" -m mleagle.cli bench gpu "${ARGS[@]}" \
    --out "$OUT/${side}_$n.json" 2>&1 | tee -a "$OUT/bench.log" | tail -n 12
done
