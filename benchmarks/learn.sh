#!/bin/bash
# One SmolLM2 multiply run of the FlashRL / LoRA comparisons (README), same seeds and flags, into $OUT/NAME:
#   bash benchmarks/learn.sh bf16                                  # the baseline
#   bash benchmarks/learn.sh fp8-tis   --rollout-quant fp8         # TIS at cap 2 is its default
#   bash benchmarks/learn.sh fp8-notis --rollout-quant fp8 --tis-cap 0
#   bash benchmarks/learn.sh lora16    --lora-rank 16 --lr 1e-4
#   bash benchmarks/learn.sh gae       --algo gae                  # PPO with a critic (session 5)
name=$1; shift
python train.py --gpu h100 --model "${SMOLLM2_DIR:-smollm2}" --env multiply --digits 1 --fewshot 1 --max-tokens 48 \
  --max-context 256 --lr 1e-5 --steps "${STEPS:-20}" --prompts-per-step 32 --n 8 --eval-every 10 --eval-rows 64 \
  --old-logprobs recompute --rollout-logprobs --no-progress --no-plot --log-samples 0 --out-dir "$OUT/$name" "$@" \
  > "$OUT/$name.log" 2>&1
echo "$name rc=$?"; grep -E "^step|error|Error" "$OUT/$name.log" | tail -25
