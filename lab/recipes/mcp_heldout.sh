#!/bin/bash
# Does RL add anything beyond the SFT warm start on MCP tool use? SFT sees only tasks that need ONE
# tool call; RL trains, and the eval measures, on tasks that need TWO OR MORE dependent calls
# (multi, the order-count shop tasks, the 2-call kb tasks, state), which the SFT data never shows.
# On a GPU with vLLM and $SMOLLM2_DIR, from the repository root, into $OUT:
#   OUT=out bash lab/recipes/mcp_heldout.sh          # data, SFT, RL (STEPS=30), plot
#   OUT=out bash lab/recipes/mcp_heldout.sh sft      # or one stage a call, to stay under a 10-minute limit:
#   OUT=out bash lab/recipes/mcp_heldout.sh rl       #   sft | rl | long | plot; data is made every time (~2 s)
#   LONG_EPOCHS=9 OUT=out bash lab/recipes/mcp_heldout.sh long   # the optional longer-SFT baseline (below)
#   RL_FLAGS="--gpu-memory-utilization 0.2"  # extra train.py flags for the RL runs (e.g. to share a GPU)
# Measured on an H100 (docs/results.md, 2026-11-23): SFT 105-190 s; RL 30 steps of 16 x 8 in ~2 min
# and 60 steps of 16 x 16 (STEPS=60 RL_FLAGS="--n 16 ...") in ~4.5 min, + a vLLM start. Held-out pass@1
# 0.017 (SFT-only) -> 0.034-0.059 under RL: 2 -> 4-7 of 119 rows; only 2.4% of the groups had mixed
# rewards, so the RL signal is thin at 135M.
#
# Rows (data/mcp_tasks.py, seed 0, deterministic):
#   data/out/mcp-1call   --max-calls 1: 1032 train / 112 test (arith, units, currency, dates, text,
#                        and the 1-call shop and kb tasks)
#   data/out/mcp-multi   --min-calls 2 of multi, shop, kb, state, with multi 500, kb 300, state 400
#                        tasks generated instead of 250 / 150 / 200: 1081 train / 119 test (the default
#                        counts leave only 63 test rows). State tasks keep their post-episode checks.
# SFT: 3 epochs of the 1032 oracle trajectories, 16 a step (195 steps, about the 198 of the earlier
#   all-families warm start), lr 5e-5 as that run; sft.log ends with the steps and seconds it took.
# SFT-only vs SFT+RL, on the same 119 held-out rows, greedy pass@1:
#   SFT-only = the RL run's step-0 eval (train.py evaluates before its first update), drawn in
#   heldout.png as a flat line under the RL run's eval curve (every 5 steps). That baseline has seen
#   less training compute than SFT+RL; `long` trains the SFT model LONG_EPOCHS epochs instead of 3 and
#   evaluates it once (train.py --steps 0), a second flat line, to show that more SFT on 1-call tasks
#   is not what lifts the curve. Off by default: a second, 3x longer SFT and another vLLM start.
# Out ($OUT, flat): sft.log, rl.log, rl.metrics.jsonl, rl.samples.jsonl, curves.png (the RL run's
#   reward, eval pass@1, entropy), heldout.png (SFT-only vs SFT+RL); `long` adds sft-long.log.
# Checkpoints stay in $SFT_DIR (/tmp/sft1), $RL_DIR (/tmp/rl), /tmp/sft1-long; the RL folder is
# cleared first, as train.py appends to an existing metrics.jsonl. Stages run in separate calls need
# the SFT folder to survive between them (SFT_DIR=runs/sft1: git-ignored, so kept in the checkout).
stage=${1:-all}
case $stage in all|sft|rl|long|plot) ;; *) echo "usage: bash $0 [all|sft|rl|long|plot]"; exit 2;; esac
OUT=${OUT:?set OUT to the folder for the results}
SFT=${SFT_DIR:-/tmp/sft1}
RL=${RL_DIR:-/tmp/rl}
LONG=/tmp/sft1-long
mkdir -p "$OUT"

python data/mcp_tasks.py --max-calls 1 --out data/out/mcp-1call || exit 1
python data/mcp_tasks.py --min-calls 2 --families multi,shop,kb,state \
  --count multi=500 --count kb=300 --count state=400 --out data/out/mcp-multi || exit 1
n_eval=$(wc -l < data/out/mcp-multi/test.jsonl)  # every held-out row

sft() {  # $1: epochs, $2: out folder
  python sft.py --device cuda --model "${SMOLLM2_DIR:-smollm2}" --train-data data/out/mcp-1call/train.jsonl \
    --epochs "$1" --lr 5e-5 --batch-size 16 --micro-batch-size 8 --no-progress --out-dir "$2"
  local rc=$?
  head -1 "$2/sft_metrics.jsonl" && tail -1 "$2/sft_metrics.jsonl"  # the first and last step's loss
  return $rc
}

rl() {  # $1: model, $2: out folder, $3: steps; the step-0 eval is the model before RL
  python train.py --gpu h100 --env mcp --model "$1" --train-data data/out/mcp-multi/train.jsonl \
    --eval-data data/out/mcp-multi/test.jsonl --steps "$3" --eval-every 5 --eval-limit "$n_eval" \
    --prompts-per-step 16 --n 8 --lr 1e-5 --max-turns 6 --log-samples 4 --no-progress --out-dir "$2" $RL_FLAGS
}

if [ "$stage" = all ] || [ "$stage" = sft ]; then
  sft 3 "$SFT" > "$OUT/sft.log" 2>&1
  echo "sft rc=$?"; tail -4 "$OUT/sft.log"
fi

if [ "$stage" = all ] || [ "$stage" = rl ]; then
  [ -f "$SFT/config.json" ] || { echo "no SFT model in $SFT: run the sft stage first"; exit 1; }
  rm -rf -- "${RL:?}"
  rl "$SFT" "$RL" "${STEPS:-30}" > "$OUT/rl.log" 2>&1
  echo "rl rc=$?"; grep -E "^step|Error" "$OUT/rl.log" | tail -40
  cp "$RL/metrics.jsonl" "$OUT/rl.metrics.jsonl"
  cp "$RL/samples.jsonl" "$OUT/rl.samples.jsonl"
  cp "$RL/curves.png" "$OUT/curves.png"
fi

if [ "$stage" = long ]; then
  { sft "${LONG_EPOCHS:-9}" "$LONG" && rm -rf -- "$LONG-eval" && rl "$LONG" "$LONG-eval" 0; } > "$OUT/sft-long.log" 2>&1
  echo "long rc=$?"; grep -E "^step|^saved|Error" "$OUT/sft-long.log"
fi

# heldout.png: eval pass@1 on the held-out rows against RL step; runs evaluated once are flat lines
if [ -f "$RL/metrics.jsonl" ]; then
  grep '^{"step": 0,' "$RL/metrics.jsonl" > /tmp/sft-only.metrics.jsonl  # the step-0 eval: SFT-only
  long=()
  [ -f "$LONG-eval/metrics.jsonl" ] && long=(--label "SFT-only, longer SFT" "$LONG-eval/metrics.jsonl")
  python lab/plot_runs.py "$OUT/heldout.png" "SmolLM2-135M: MCP tasks of >= 2 tool calls ($n_eval held out)" \
    --metric eval_pass1 --label "SFT-only (3 epochs on 1-call tasks)" /tmp/sft-only.metrics.jsonl \
    --label "SFT + RL on >= 2-call tasks" "$RL/metrics.jsonl" "${long[@]}"
  python -c 'import json, sys; [print("step", r["step"], "eval_pass1", r["eval_pass1"])
                for r in map(json.loads, open(sys.argv[1])) if "eval_pass1" in r]' "$RL/metrics.jsonl"
fi
ls -la "$OUT"
