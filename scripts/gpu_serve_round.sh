#!/usr/bin/env bash
# On the GPU machine: one round of the serving figures (issues of speculation policy and serving
# speed), each step's output in OUT, in the order a short session wants them:
#
#   scripts/gpu_serve_round.sh OUT [--repeats N] [--concurrency LIST] [--requests-per-concurrency N]
#                              [--skip tests,matrix,alone,host]
#
#   1. OUT/gpu_tests.log: the GPU tests of graphs, kernels, the engine loop and the policy, and the
#      graph runners', slot state's, binding's and mixed steps' tests on this device (real CUDA graphs);
#   2. OUT/serve_matrix.{json,md,log}: `bench serve-matrix` with arms target (`--draft none`), auto (the
#      default config) and always (`--spec-policy always`), baseline target, N repeats (default 3) at
#      concurrency 1,8,32,64, each server fresh, 16 warm-up requests; the JSON holds per run the TTFT
#      split (also after the first wave), the policy's explore iterations by reason and the daemon's
#      merged deltas;
#   3. OUT/daemon_alone.{json,log}: `scripts/daemon_alone.py --spin` at a step every 2 and 1 ms, 32 and
#      64 streams: the daemon's own ceiling on this host, beside what the engine makes there;
#   4. OUT/engine_host_step{,_spec}.{json,log}: `scripts/engine_host_step.py --events`, target-only and
#      with three random draft layers: the engine's host time per decode step beside the model (the tiny
#      model on this host's CPU), to set against the dev VM's figures; then OUT/engine_host_step_gpu.*:
#      the same script with `--device cuda` and SmolLM2, for what a lone arrival's prefill step (a first
#      token's `prefill` phase) is made of on this GPU, part by part.
#
# `--requests-per-concurrency N` (default 4) sets each run's requests to N x concurrency: issue 27's c32
# figures use 16, so that a run's drain (its last wave) is a small part of it.
#
# Prompts from $MLEAGLE_DATA_DIR (MT-Bench). PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_serve_round.sh OUT [--repeats N] [--concurrency LIST] [--requests-per-concurrency N] [--skip tests,matrix,alone,host]}"
shift
REPEATS=3
RPC=4
CONC="1,8,32,64"
SKIP=""
while [ $# -gt 0 ]; do
  case "$1" in
    --repeats) REPEATS="$2"; shift 2 ;;
    --concurrency) CONC="$2"; shift 2 ;;
    --requests-per-concurrency) RPC="$2"; shift 2 ;;
    --skip) SKIP="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
skip() { [[ ",$SKIP," == *",$1,"* ]]; }
if ! skip tests; then
  echo "[round] GPU tests"
  "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_gpu_graphs.py tests/engine/test_kernels_gpu.py \
    tests/engine/test_engine_loop.py tests/daemon/test_channel.py tests/engine/test_spec_policy.py \
    tests/engine/test_graph_runner.py tests/engine/test_slot_state.py tests/engine/test_spec_binding.py \
    tests/engine/test_overlap.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 5
fi
if ! skip matrix; then
  echo "[round] serve matrix: c$CONC, $REPEATS repeats"
  "$PY" -m mleagle.cli bench serve-matrix --config smollm2-135m --arm "target=--draft none" --arm "auto=" \
    --arm "always=--spec-policy always" --baseline target --concurrency "$CONC" --repeats "$REPEATS" \
    --requests-per-concurrency "$RPC" \
    --output "$OUT/serve_matrix.json" --markdown "$OUT/serve_matrix.md" 2>&1 | tee "$OUT/serve_matrix.log" | tail -n 30
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
