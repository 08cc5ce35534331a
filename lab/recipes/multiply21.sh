#!/bin/bash
# SmolLM2-135M on synthetic multiply, one run a call (a GPU with vLLM; from the repository root).
# The 2-digit x 1-digit curve: strict \boxed{} answers, greedy pass@1 on 128 held-out rows every 10
# steps, into $OUT/NAME.{log,metrics.jsonl,png}:
#   STEPS=330 OUT=out bash lab/recipes/multiply21.sh kl05 --kl-coef 0.05   # THE recipe
#   OUT=out bash lab/recipes/multiply21.sh clip28                          # no KL: its entropy collapses
#   OUT=out bash lab/recipes/multiply21.sh kl20 --kl-coef 0.2              # a stronger anchor
#   OUT=out bash lab/recipes/multiply21.sh slowpath --old-logprobs recompute --micro-batch-tokens 0 --sync-check-every 1
# The 1-digit runs of the FlashRL / LoRA / critic comparisons, same seed and flags, into $OUT/NAME:
#   OUT=out bash lab/recipes/multiply21.sh learn NAME [flags]   # e.g. learn bf16; learn fp8-tis --rollout-quant fp8;
#        # learn fp8-notis --rollout-quant fp8 --tis-cap 0; learn lora16 --lora-rank 16 --lr 1e-4; learn gae --algo gae
# Several runs on one GPU: KV=4 (--kv-cache-gb 4) and UTIL (vLLM's share, default 0.1).
# Results and why these flags: docs/results.md. Compare runs with lab/plot_runs.py.
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
if [ "$1" = learn ]; then
  name=$2; shift 2
  python train.py --gpu h100 --model "${SMOLLM2_DIR:-smollm2}" --env multiply --digits 1 --fewshot 1 --max-tokens 48 \
    --max-context 256 --lr 1e-5 --steps "${STEPS:-20}" --prompts-per-step 32 --n 8 --eval-every 10 --eval-limit 64 \
    --old-logprobs recompute --out-dir "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "^step|error|Error" "$OUT/$name.log" | tail -25
  exit 0
fi
name=$1; shift
echo "start $(date +%s)" > "$OUT/$name.start"  # metrics.jsonl rows carry "time" (unix s): time to a pass rate
# --micro-batch-tokens 16384: the h100 preset's budget at its own 2048 context (8 x 2048)
python train.py --gpu h100 --model "${SMOLLM2_DIR:-smollm2}" --env multiply --digits 2,1 --fewshot 2 \
  --max-tokens 96 --max-context 512 --lr 1e-5 --clip-high 0.28 --prompts-per-step 32 --n 16 \
  --steps "${STEPS:-200}" --eval-every 10 --eval-limit 128 --gpu-memory-utilization "${UTIL:-0.1}" \
  --micro-batch-tokens 16384 ${KV:+--kv-cache-gb $KV} --out-dir "/tmp/m21-$name" "$@" > "$OUT/$name.log" 2>&1
echo "$name rc=$?"; grep -E "^step .*eval|error|Error" "$OUT/$name.log" | tail -20
cp "/tmp/m21-$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"; cp "/tmp/m21-$name/curves.png" "$OUT/$name.png"
