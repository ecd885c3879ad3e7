#!/usr/bin/env bash
# On the GPU machine: one round of the serving figures (issues of speculation policy and serving
# speed), each step's output in OUT, in the order a short session wants them:
#
#   scripts/gpu_serve_round.sh OUT [--repeats N] [--concurrency LIST] [--requests-per-concurrency N]
#                              [--arms LIST] [--offline] [--skip STEPS | --only STEPS]
#
#   1. tests: OUT/gpu_tests.log: the GPU tests of graphs, kernels, the engine loop and the policy, and
#      the graph runners', slot state's, binding's and mixed steps' tests on this device (real CUDA
#      graphs); they need the `test` extras' pytest-asyncio and xgrammar installed there (without them
#      the channel and grammar-masked graph tests fail at import, not on a finding);
#   2. static: OUT/bench_gpu.{json,log}: `Engine.generate`'s static batch of 32 on this machine
#      (`bench gpu --configs graphs --batch-sizes 32`), the baseline every served c32 figure is read
#      against (hosts differ: rerun it on each machine);
#   3. matrix: OUT/serve_matrix.{json,md,log}: `bench serve-matrix` with `--arms` of target
#      (`--draft none`), auto (the default config) and always (`--spec-policy always`), baseline
#      target, N repeats (default 3) at concurrency 1,8,32,64, each server fresh, 16 warm-up requests;
#      with `--offline` each run's prompts are also replayed through the engine alone at the same
#      concurrency (served/offline splits the daemon from the engine). The JSON holds per run the TTFT
#      split (also after the first wave), the policy's explore iterations by reason and the daemon's
#      merged deltas;
#   4. ab: OUT/fused_ab.{json,md,log}: target-only at c32, fused mixed steps (the default) against two
#      forwards (`--no-fuse-mixed-steps`), N repeats: what the fused step is worth on this host;
#   5. alone: OUT/daemon_alone.{json,log}: `scripts/daemon_alone.py --spin` at a step every 2 and 1 ms,
#      32 and 64 streams: the daemon's own ceiling on this host, beside what the engine makes there;
#   6. host: OUT/engine_host_step{,_spec}.{json,log}: `scripts/engine_host_step.py --events`,
#      target-only and with three random draft layers: the engine's host time per decode step beside
#      the model (the tiny model on this host's CPU), to set against the dev VM's figures; then
#      OUT/engine_host_step_gpu.*: the same script with `--device cuda` and SmolLM2, for what a lone
#      arrival's prefill step (a first token's `prefill` phase) is made of on this GPU, part by part.
#
# `--skip` leaves steps out, `--only` runs those named alone (comma-separated step names as above). A
# GPU call is limited in time, so a session runs the steps over several calls on one warm machine, e.g.
# `--only tests,static`, then `--only matrix --arms target,auto --offline --concurrency 1,8,32,64
# --repeats 2 --requests-per-concurrency 16`, then `--only ab,alone`.
#
# `--requests-per-concurrency N` (default 4) sets each run's requests to N x concurrency: issue 27's c32
# figures use 16, so that a run's drain (its last wave) is a small part of it.
#
# Prompts from $MLEAGLE_DATA_DIR (MT-Bench). PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_serve_round.sh OUT [--repeats N] [--concurrency LIST] [--requests-per-concurrency N] [--arms LIST] [--offline] [--skip STEPS | --only STEPS]}"
shift
REPEATS=3
RPC=4
CONC="1,8,32,64"
SKIP=""
ONLY=""
ARMS="target,auto,always"
OFFLINE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --repeats) REPEATS="$2"; shift 2 ;;
    --concurrency) CONC="$2"; shift 2 ;;
    --requests-per-concurrency) RPC="$2"; shift 2 ;;
    --skip) SKIP="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --arms) ARMS="$2"; shift 2 ;;
    --offline) OFFLINE=(--offline); shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
skip() {
  if [ -n "$ONLY" ]; then [[ ",$ONLY," != *",$1,"* ]]; else [[ ",$SKIP," == *",$1,"* ]]; fi
}
declare -A ARM_FLAGS=([target]="--draft none" [auto]="" [always]="--spec-policy always")
ARM_ARGS=()
IFS=, read -ra arm_names <<< "$ARMS"
for a in "${arm_names[@]}"; do
  [ -n "${ARM_FLAGS[$a]+x}" ] || { echo "unknown arm $a (target, auto, always)" >&2; exit 2; }
  ARM_ARGS+=(--arm "$a=${ARM_FLAGS[$a]}")
done
if ! skip tests; then
  echo "[round] GPU tests"
  "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_gpu_graphs.py tests/engine/test_kernels_gpu.py \
    tests/engine/test_engine_loop.py tests/daemon/test_channel.py tests/engine/test_spec_policy.py \
    tests/engine/test_graph_runner.py tests/engine/test_slot_state.py tests/engine/test_spec_binding.py \
    tests/engine/test_overlap.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 5
fi
if ! skip static; then
  echo "[round] Engine.generate, static batch of 32"
  "$PY" -m mleagle.cli bench gpu --configs graphs --batch-sizes 32 --max-new-tokens 256 --out "$OUT/bench_gpu.json" \
    2>&1 | tee "$OUT/bench_gpu.log" | tail -n 6
fi
if ! skip matrix; then
  echo "[round] serve matrix: $ARMS at c$CONC, $REPEATS repeats ${OFFLINE[*]}"
  "$PY" -m mleagle.cli bench serve-matrix --config smollm2-135m "${ARM_ARGS[@]}" --baseline "${arm_names[0]}" \
    --concurrency "$CONC" --repeats "$REPEATS" --requests-per-concurrency "$RPC" --min-requests 48 \
    --warmup 16 "${OFFLINE[@]}" --output "$OUT/serve_matrix.json" --markdown "$OUT/serve_matrix.md" 2>&1 | tee "$OUT/serve_matrix.log" | tail -n 30
fi
if ! skip ab; then
  echo "[round] fused mixed steps against two forwards, target-only c32, $REPEATS repeats"
  "$PY" -m mleagle.cli bench serve-matrix --config smollm2-135m --arm "fused=--draft none" \
    --arm "two=--draft none --no-fuse-mixed-steps" --baseline two --concurrency 32 --repeats "$REPEATS" \
    --requests-per-concurrency "$RPC" --warmup 16 --output "$OUT/fused_ab.json" --markdown "$OUT/fused_ab.md" \
    2>&1 | tee "$OUT/fused_ab.log" | tail -n 12
fi
if ! skip alone; then
  echo "[round] the daemon alone"
  "$PY" scripts/daemon_alone.py --spin --step-ms 2,1 --concurrency 32,64 --repeats 2 \
    --output "$OUT/daemon_alone.json" 2>&1 | tee "$OUT/daemon_alone.log" | tail -n 8
fi
if ! skip host; then
  echo "[round] the engine's host time per decode step"
  "$PY" scripts/engine_host_step.py --events --output "$OUT/engine_host_step.json" 2>&1 | tee "$OUT/engine_host_step.log" | tail -n 4
  "$PY" scripts/engine_host_step.py --events --draft random:3 --repeats 3 --output "$OUT/engine_host_step_spec.json" \
    2>&1 | tee "$OUT/engine_host_step_spec.log" | tail -n 4
  "$PY" scripts/engine_host_step.py --device cuda --config smollm2-135m --batch-sizes 32 --repeats 3 \
    --output "$OUT/engine_host_step_gpu.json" 2>&1 | tee "$OUT/engine_host_step_gpu.log" | tail -n 4
fi
