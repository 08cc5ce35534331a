#!/bin/bash
# Issue 15's multiply curve: SmolLM2 on 2-digit x 1-digit products, strict \boxed{} answers, greedy
# pass@1 on 128 held-out rows every 10 steps. One run a call, into $OUT/NAME (GPU machine, vLLM):
#   bash benchmarks/multiply21.sh clip28            # the recipe: clip-higher 0.28 keeps entropy up
#   bash benchmarks/multiply21.sh clip20 --clip-high 0.2      # its control: PPO's symmetric clip
#   bash benchmarks/multiply21.sh lr2e-5 --lr 2e-5
# Why these flags: --fewshot 2 shows two worked answers of the task's shape (envs.multiply_shots:
# "39 * 6 = 30 * 6 + 9 * 6 = 180 + 54 = 234, so the answer is \boxed{234}"), which a 135M model
# can copy out of 1-digit products it knows; n = 16 samples a prompt give mixed-reward groups on
# hard products; DAPO's clip-higher (eps_high 0.28) lets unlikely tokens gain probability, which
# a symmetric clip caps, the usual cause of entropy collapse in GRPO (DAPO paper, section 3.1).
# Several runs may share one GPU: --gpu-memory-utilization 0.1 each (SmolLM2's KV cache is small).
name=$1; shift
OUT=${OUT:?set OUT}
echo "start $(date +%s)" > "$OUT/$name.start"  # metrics.jsonl rows carry "time" (unix s): time to a pass rate
python train.py --gpu h100 --model "${SMOLLM2_DIR:-smollm2}" --env multiply --digits 2,1 --fewshot 2 \
  --max-tokens 96 --max-context 512 --lr 1e-5 --clip-high 0.28 --prompts-per-step 32 --n 16 \
  --steps "${STEPS:-200}" --eval-every 10 --eval-rows 128 --gpu-memory-utilization "${UTIL:-0.1}" \
  --no-progress --log-samples 2 --out-dir "/tmp/m21-$name" "$@" > "$OUT/$name.log" 2>&1
echo "$name rc=$?"; grep -E "^step .*eval|error|Error" "$OUT/$name.log" | tail -20
cp "/tmp/m21-$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"; cp "/tmp/m21-$name/curves.png" "$OUT/$name.png"
