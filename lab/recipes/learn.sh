#!/bin/bash
# One SmolLM2 1-digit multiply run of the FlashRL / LoRA / critic comparisons (docs/results.md), same
# seed and flags, into $OUT/NAME (a GPU with vLLM; run from the repository root):
#   OUT=out bash lab/recipes/learn.sh bf16                                  # the baseline
#   OUT=out bash lab/recipes/learn.sh fp8-tis   --rollout-quant fp8         # TIS at cap 2 is its default
#   OUT=out bash lab/recipes/learn.sh fp8-notis --rollout-quant fp8 --tis-cap 0
#   OUT=out bash lab/recipes/learn.sh lora16    --lora-rank 16 --lr 1e-4
#   OUT=out bash lab/recipes/learn.sh gae       --algo gae                  # PPO with a critic
# Compare the runs with lab/plot_runs.py (their $OUT/NAME/metrics.jsonl).
name=$1; shift
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
python train.py --gpu h100 --model "${SMOLLM2_DIR:-smollm2}" --env multiply --digits 1 --fewshot 1 --max-tokens 48 \
  --max-context 256 --lr 1e-5 --steps "${STEPS:-20}" --prompts-per-step 32 --n 8 --eval-every 10 --eval-limit 64 \
  --old-logprobs recompute --rollout-logprobs --no-progress --no-plot --log-samples 0 --out-dir "$OUT/$name" "$@" \
  > "$OUT/$name.log" 2>&1
echo "$name rc=$?"; grep -E "^step|error|Error" "$OUT/$name.log" | tail -25
