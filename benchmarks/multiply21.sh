#!/bin/bash
# Issue 15's multiply curve: SmolLM2 on 2-digit x 1-digit products, strict \boxed{} answers, greedy
# pass@1 on 128 held-out rows every 10 steps. One run a call, into $OUT/NAME (GPU machine, vLLM):
#   bash benchmarks/multiply21.sh clip28            # no KL: learns, but its entropy collapses (session 7)
#   STEPS=330 bash benchmarks/multiply21.sh kl05 --kl-coef 0.05  # THE recipe (session 9): 0.609 in 20 min, no collapse
#   bash benchmarks/multiply21.sh kl20 --kl-coef 0.2           # a stronger anchor: more entropy, stops at ~0.5
#   bash benchmarks/multiply21.sh ctl --kl-coef 1e-6           # no anchor, every sequence trained (entropy_live,
#                                                   # logged since session 9, makes this control unnecessary)
#   bash benchmarks/multiply21.sh slowpath --old-logprobs recompute --micro-batch-tokens 0 --sync-check-every 1
#                                                   # issue 14's control: the curve on the pre-speedup path
#                                                   # (session 10: matches clip28 within noise, 6.3-9.1 s a step alone)
# Why these flags: --fewshot 2 shows two worked answers of the task's shape (envs.multiply_shots:
# "39 * 6 = 30 * 6 + 9 * 6 = 180 + 54 = 234, so the answer is \boxed{234}"), which a 135M model
# can copy out of 1-digit products it knows; n = 16 samples a prompt give mixed-reward groups on
# hard products. --clip-high 0.28 (DAPO's clip-higher) does nothing here: one update per step on
# the whole batch is exactly on-policy (ratio 1, clip_frac 0), so clip20 and clip28 are the same
# run up to sampling. Measured 2026-11-23 (H100, 4 runs sharing it; benchmarks/session7/):
# greedy pass@1 on 128 held-out rows 0.305 -> 0.609 at step 200, 11 min after launch, but the
# policy entropy fell from 0.58 to ~0.05 nats/token by step 25 and the share of groups with mixed
# rewards from ~0.55 to 0.2-0.45: entropy collapse is NOT prevented by clip28.
# Session 8 (4 runs sharing an H100, cut short at steps 28-53 when the device time ran out;
# benchmarks/session8/multiply21-anti-collapse.png): a KL term to the initial policy is what held
# the entropy. --kl-coef 0.2 kept it at 0.21-0.38 (mean 0.30) nats/token over steps 15-35 while eval pass@1 tracked
# clip28 (0.461 vs 0.445 at step 30); 0.05 let it fall to 0.11-0.24 (mean 0.15); 4 mini-batches at lr 3e-6
# (off-policy: the clip acts, on 0.1-0.3% of tokens) collapsed like clip28 (0.04-0.25), and with KL 0.05 held 0.17-0.31. Why KL: on a
# group with no reward variance (A = 0) the KL gradient is the only force, pulling its tokens back
# to the base model's spread. Caveat: with a KL term every sequence is trained, so its entropy is
# a mean over all groups; without one only over mixed-reward groups (ctl above measures the same
# way as kl20).
# Session 9 (each run alone on an H100; benchmarks/session9/multiply21-kl.png): kl05 reached 0.602
# greedy pass@1 at step 270 (16.7 min after launch) and 0.609 at step 330 (20.1 min), with the
# entropy of mixed-reward groups (entropy_live, the no-KL runs' measure) flat at 0.13-0.19; kl20
# held 0.25-0.34 but stayed at ~0.5 pass@1 from step 110 on. 3.3 s a step alone for either.
# One run a GPU, or several with KV=4 (--kv-cache-gb 4: a fixed KV cache, no start-up memory
# profiling to trip over the other runs' memory; session 7 lost 3 of 6 runs to it without). KL
# runs train every sequence, so they are slower a step than clip28 (~14-20 s vs ~4 s, 4 sharing;
# 3.3 s alone with the 16k-token micro-batches below).
# --micro-batch-tokens 16384 (session 9): the h100 preset's budget at its own 2048 context (8 x 2048);
# --max-context 512 alone would cut it to 8 x 512, 4x the forward/backward launches for the same math.
name=$1; shift
OUT=${OUT:?set OUT}
echo "start $(date +%s)" > "$OUT/$name.start"  # metrics.jsonl rows carry "time" (unix s): time to a pass rate
python train.py --gpu h100 --model "${SMOLLM2_DIR:-smollm2}" --env multiply --digits 2,1 --fewshot 2 \
  --max-tokens 96 --max-context 512 --lr 1e-5 --clip-high 0.28 --prompts-per-step 32 --n 16 \
  --steps "${STEPS:-200}" --eval-every 10 --eval-rows 128 --gpu-memory-utilization "${UTIL:-0.1}" \
  --micro-batch-tokens 16384 --no-progress --log-samples 2 ${KV:+--kv-cache-gb $KV} --out-dir "/tmp/m21-$name" "$@" > "$OUT/$name.log" 2>&1
echo "$name rc=$?"; grep -E "^step .*eval|error|Error" "$OUT/$name.log" | tail -20
cp "/tmp/m21-$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"; cp "/tmp/m21-$name/curves.png" "$OUT/$name.png"
