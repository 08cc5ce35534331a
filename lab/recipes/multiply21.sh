#!/bin/bash
# The 2-digit x 1-digit multiply curve: SmolLM2-135M on 2-digit x 1-digit products, strict \boxed{}
# answers, greedy pass@1 on 128 held-out rows every 10 steps. One run a call, into $OUT/NAME
# (a GPU with vLLM; run from the repository root; docs/results.md has every figure below):
#   STEPS=330 OUT=out bash lab/recipes/multiply21.sh kl05 --kl-coef 0.05   # THE recipe: 0.305 -> 0.609 in 20 min, no collapse
#   OUT=out bash lab/recipes/multiply21.sh clip28                  # no KL: learns, but its entropy collapses
#   OUT=out bash lab/recipes/multiply21.sh kl20 --kl-coef 0.2      # a stronger anchor: more entropy, stops at ~0.5
#   OUT=out bash lab/recipes/multiply21.sh slowpath --old-logprobs recompute --micro-batch-tokens 0 --sync-check-every 1
#                                            # the curve on the path before the step-time work (no-grad old
#                                            # logprobs, 8-sequence micro-batches, every sync checked): the
#                                            # same curve within noise, 6.3-9.1 s a step alone
# Why these flags: --fewshot 2 shows two worked answers of the task's shape (envs.multiply_shots:
# "39 * 6 = 30 * 6 + 9 * 6 = 180 + 54 = 234, so the answer is \boxed{234}"), which a 135M model
# can copy out of 1-digit products it knows; n = 16 samples a prompt give mixed-reward groups on
# hard products. --clip-high 0.28 (DAPO's clip-higher) does nothing here: one update per step on
# the whole batch is exactly on-policy (ratio 1, clip_frac 0), so a 0.2 clip gives the same run
# up to sampling.
# What holds the entropy is a KL term to the initial policy (--kl-coef): a group whose 16 answers
# all score the same has A = 0, so without KL it gets no gradient and the mixed groups alone sharpen
# the policy; with KL every sequence trains and the KL gradient pulls its tokens back toward the
# base model's spread. 0.05 reaches 0.6 with the entropy of mixed-reward groups (entropy_live) flat
# at 0.13-0.19; 0.2 holds 0.25-0.34 but stops at ~0.5. KL runs train every sequence: 3.3 s a step
# alone on an H100, with the 16k-token micro-batches below.
# Several runs on one GPU: KV=4 (--kv-cache-gb 4: a fixed KV cache, no start-up memory profiling to
# trip over the other runs' memory changes) and UTIL (vLLM's share of the GPU, default 0.1).
# --micro-batch-tokens 16384: the h100 preset's budget at its own 2048 context (8 x 2048);
# --max-context 512 alone would cut it to 8 x 512, 4x the forward/backward launches for the same math.
name=$1; shift
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
echo "start $(date +%s)" > "$OUT/$name.start"  # metrics.jsonl rows carry "time" (unix s): time to a pass rate
python train.py --gpu h100 --model "${SMOLLM2_DIR:-smollm2}" --env multiply --digits 2,1 --fewshot 2 \
  --max-tokens 96 --max-context 512 --lr 1e-5 --clip-high 0.28 --prompts-per-step 32 --n 16 \
  --steps "${STEPS:-200}" --eval-every 10 --eval-limit 128 --gpu-memory-utilization "${UTIL:-0.1}" \
  --micro-batch-tokens 16384 --no-progress --log-samples 2 ${KV:+--kv-cache-gb $KV} --out-dir "/tmp/m21-$name" "$@" > "$OUT/$name.log" 2>&1
echo "$name rc=$?"; grep -E "^step .*eval|error|Error" "$OUT/$name.log" | tail -20
cp "/tmp/m21-$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"; cp "/tmp/m21-$name/curves.png" "$OUT/$name.png"
