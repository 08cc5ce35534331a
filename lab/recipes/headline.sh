#!/bin/bash
# The headline: full-parameter GRPO of a real 1.5B chat model on multi-turn MCP tool use, at the l40s
# preset under a 45 GiB cap (lab/recipes/capped.sh), scored on held-out tasks of the families it
# trains on (seen) and of two families it never sees (unseen: multi, 3 dependent calls; state, 2-4
# calls that change server state, checked after the episode). Also SFT-only vs SFT+RL vs RL-only on
# the unseen families, and pass@1/pass@8 before and after with eval.py.
# On a GPU with vLLM, from the repository root, results into $OUT (flat):
#   MODEL=$QWEN_DIR OUT=out bash lab/recipes/headline.sh rl        # RL-only, 20 steps (~5-8 min on an H100)
#   MODEL=$QWEN_DIR OUT=out bash lab/recipes/headline.sh passk     # eval.py: base vs RL, pass@1 and pass@8 (~5.5 min
#                                                                  #   for the default 1030 rows on an H100)
#   MODEL=$QWEN_DIR OUT=out bash lab/recipes/headline.sh sft       # SFT on the seen families' oracle calls
#   MODEL=$QWEN_DIR OUT=out bash lab/recipes/headline.sh sftrl     # RL from the SFT model (SFT_STEPS steps)
#   OUT=out bash lab/recipes/headline.sh plot                     # headline.png from the runs' metrics
# The second split trains multi (three dependent calls) and holds out state (2 or 4 calls that change
# server state); this is the run that lifts a family it never trains on (docs/results.md):
#   export SEEN_FAMILIES=arith,units,currency,dates,shop,multi,kb,text UNSEEN_FAMILIES=state
#   MODEL=$QWEN_DIR OUT=out2 bash lab/recipes/headline.sh sft      # ~3 min
#   MODEL=$QWEN_DIR OUT=out2 bash lab/recipes/headline.sh sftrl    # 10 RL steps from it, ~4.5 min
#   MODEL=runs/headline-sft RL_DIR=runs/headline-sftrl/ckpt/step_000010 OUT=out2 bash lab/recipes/headline.sh passk
#   (state, all 400 rows, greedy: base 0.000, RL-only 0.010, SFT 0.258, SFT+RL 0.490 and 0.260 at seeds
#   0 and 1. SFT on multi's three-call chains does most of it; RL from SFT sees 0-8 mixed groups of 32 a
#   step, and at seed 0 taught the 4-call state rows, 0.00 -> 0.32, more calls than any trained row.)
# docs/results.md has what these measured, with Qwen2.5-Coder-1.5B-Instruct as $MODEL, and each run's
# exact command (earlier runs set other values of the variables below).
#
# Rows (data/mcp_tasks.py, seed 0, deterministic):
#   data/out/mcp-seen     arith, units, currency, dates, shop, kb, text (1-call tasks, and the 2-call
#                         order-count and kb tasks): 1170 train rows, 130 held out (seen)
#   data/out/mcp-unseen   multi (500 generated) and state (400), never trained on: its 225 test rows are
#                         the in-run unseen set; passk scores all 900 (PASSK_UNSEEN)
# The RL flags: the l40s preset (32 prompts x 8, lr 1e-6, 256 tokens a turn, 4096 context, 8 turns,
# grad checkpointing, chunked logprobs, shared-prefix training) with --mini-batch-size $MINI_BATCH: four
# AdamW updates a step instead of one, PPO's clip now acting (old logprobs from a no-grad forward), with
# DAPO's clip-higher (--clip-high $CLIP_HIGH). Seeds 0 and 1: seen 0.969 and 0.954 after 20 steps (seed 0
# again: 0.900; vLLM's sampling is not bitwise repeatable) against 0.85-0.89 with one update, failed
# calls 0.17 -> 0.01-0.02 an episode, peak 40.3-40.6 GiB. CLIP_HIGH=0.2 did as well (0.977, one seed):
# the four updates do it. Unseen (passk over all 900 rows, seed 0): greedy 0.003 -> 0.004, pass@8
# 0.020 -> 0.107. The seen rows need one call (88%) or two, the unseen two to four, and the policy
# learns to answer after one. MINI_BATCH=256 CLIP_HIGH=0.2 is the one-update run
# of the earlier entries (docs/results.md). vLLM at 0.17 of an 80 GB GPU
# (0.3 of 48 GB), --tool-error-penalty $PENALTY up to --tool-error-cap $ERROR_CAP (mcp_env.py: why;
# every episode pays for its failed calls, doubled-brace ones included: charged to correct answers
# only, wrong episodes looped on failed calls to the turn limit; with a cap of 0.5 a fourth failed
# call was free), and --kl-coef $KL (default 0: a KL anchor of 0.05 held no more entropy and cost
# ~3 s a step). ENTROPY_TARGET > 0 adds adaptive entropy control (--entropy-target, its coefficient
# moving by ENTROPY_STEP a step, at most ENTROPY_MAX; train.py entropy_coef). Off by default: at a
# step of 0.01 it held no entropy in 20 steps; at 0.05 it held it only by breaking the tool-call
# format (parse rate 0.90 -> 0.51), with a ceiling of 0.3 too. Nor does RL_FLAGS="--loss clip-cov
# --clip-cov F 1 5" hold it and learn: at F = 0.005 it learns as without and keeps a third of the
# entropy; at F = 0.02 it keeps all of it and learns nothing. --positive-weight 0.1 (W-REINFORCE) learns
# slower (0.77) and loops wrong episodes on failed calls; --top-entropy-frac 0.2 (forking tokens)
# learns best of the one-update runs (0.89); both end at a quarter to two fifths of step 1's entropy, as
# do four updates (21-32%) and Clip-Cov at F = 0.01 (39%, 0.84). RL_FLAGS="--loss kl-cov" (verl's
# defaults) learns as the recipe does (0.954) and keeps the least (16%); --kl-cov 2e-3 1 (verl's 7B
# recipe) too (0.969, 15%), after dropping the tools for five steps. --temperature 1.2 unlearns the
# tools: it answers without a call by step 13 (docs/results.md).
# Eval: greedy pass@1 on both sets before step 1 and every 5 steps (eval_pass1/seen, eval_pass1/unseen).
# SFT-only = the sftrl run's step-0 eval.
stage=${1:?usage: bash $0 rl|passk|sft|sftrl|plot}
OUT=${OUT:?set OUT to the folder for the results}
MODEL=${MODEL:-$QWEN_DIR}
RL=${RL_DIR:-runs/headline-rl}
SFT=${SFT_DIR:-runs/headline-sft}
SFTRL=${SFTRL_DIR:-runs/headline-sftrl}
SEEN_FAMILIES=${SEEN_FAMILIES:-arith,units,currency,dates,shop,kb,text}  # trained on; their test rows: seen
UNSEEN_FAMILIES=${UNSEEN_FAMILIES:-multi,state}                           # never trained on: unseen
UNSEEN_TEST_FRACTION=${UNSEEN_TEST_FRACTION:-0.25}                        # the in-run unseen set (passk: all rows)
KL=${KL:-0}                                                               # --kl-coef (0: no reference model)
PENALTY=${PENALTY:-0.2}                                                   # --tool-error-penalty per failed call
ERROR_CAP=${ERROR_CAP:-2.0}                                               # --tool-error-cap: the most a wrong episode pays
ENTROPY_TARGET=${ENTROPY_TARGET:-0}                                       # --entropy-target (0: no entropy bonus)
ENTROPY_STEP=${ENTROPY_STEP:-0.05}                                        # --entropy-coef-step
ENTROPY_MAX=${ENTROPY_MAX:-0}                                             # --entropy-coef-max (0: no ceiling)
MINI_BATCH=${MINI_BATCH:-64}                                              # --mini-batch-size (256: one update a step)
CLIP_HIGH=${CLIP_HIGH:-0.28}                                              # --clip-high (PPO's eps_high; 0.2: symmetric)
PASSK_UNSEEN=${PASSK_UNSEEN:-all}                                         # passk's unseen rows: all (900) or test (225)
mkdir -p "$OUT"
counts() {  # --count flags for the families in $1 (multi 500, state 400 tasks: 125 and 100 test rows)
  for f in multi=500 state=400; do [[ ",$1," == *",${f%=*},"* ]] && echo --count $f; done
}
python data/mcp_tasks.py --families "$SEEN_FAMILIES" $(counts "$SEEN_FAMILIES") --out data/out/mcp-seen > /dev/null || exit 1
python data/mcp_tasks.py --families "$UNSEEN_FAMILIES" $(counts "$UNSEEN_FAMILIES") --test-fraction "$UNSEEN_TEST_FRACTION" --out data/out/mcp-unseen > /dev/null || exit 1

rl() {  # $1: model, $2: out folder, $3: steps
  rm -rf -- "${2:?}"  # train.py appends to an existing metrics.jsonl
  bash lab/recipes/capped.sh 45 python train.py --env mcp --gpu l40s --model "$1" --gpu-memory-utilization 0.17 \
    --train-data data/out/mcp-seen/train.jsonl --eval-data seen=data/out/mcp-seen/test.jsonl \
    --eval-data unseen=data/out/mcp-unseen/test.jsonl --eval-every 5 --steps "$3" --tool-error-penalty "$PENALTY" --tool-error-cap "$ERROR_CAP" --kl-coef "$KL" \
    --entropy-target "$ENTROPY_TARGET" --entropy-coef-step "$ENTROPY_STEP" --entropy-coef-max "$ENTROPY_MAX" \
    --mini-batch-size "$MINI_BATCH" --clip-high "$CLIP_HIGH" \
    --viewer-groups 8 --log-samples 8 --save-every 0 --keep-checkpoints 1 --no-progress --out-dir "$2" $RL_FLAGS
}
keep() {  # $1: run folder, $2: name in $OUT
  cp "$1/metrics.jsonl" "$OUT/$2.metrics.jsonl"; cp "$1/episodes.jsonl" "$OUT/$2.episodes.jsonl" 2>/dev/null
  grep -E "^step|eval|Error|capped" "$OUT/$2.log" | tail -40
}

case $stage in
rl)
  rl "$MODEL" "$RL" "${STEPS:-20}" > "$OUT/rl.log" 2>&1; echo "rl rc=$?"; keep "$RL" rl ;;
passk)  # base vs trained, one eval.py run: greedy pass@1 and pass@8 of 8 samples at temperature 1, per set
  # (the two sets' rows in one file, data_source "seen" / "unseen/FAMILY": eval.py's per-source rows are
  # the sets, and each unseen family).
  # PASSK_UNSEEN=all (default): every row of the unseen families (900), test and train split alike, since
  # no stage trains on them; their 225 test rows held 3-9 right answers, too few to tell a doubling from
  # noise (all 900, seed 0: 3 -> 4 greedy). PASSK_UNSEEN=test: those 225 only, as the earlier entries ran.
  [[ $PASSK_UNSEEN == all || $PASSK_UNSEEN == test ]] || { echo "PASSK_UNSEEN=$PASSK_UNSEEN: want all or test"; exit 2; }
  python -c 'import json, sys
files = [("seen", "test"), ("unseen", "test")] + [("unseen", "train")] * (sys.argv[1] == "all")
for name, split in files:
    for line in open(f"data/out/mcp-{name}/{split}.jsonl"):
        row = json.loads(line)
        source = name if name == "seen" else "unseen/" + row["extra_info"]["family"]
        print(json.dumps({**row, "data_source": source}))' "$PASSK_UNSEEN" > data/out/mcp-heldout.jsonl
  python eval.py --env mcp --gpu l40s --model "$MODEL" --model "$RL" --eval-data data/out/mcp-heldout.jsonl \
    --k 1,8 --n 8 --limit 100000 --out-dir "$OUT/passk" > "$OUT/passk.log" 2>&1
  echo "passk rc=$?"; grep -E "^\|" "$OUT/passk.log" ;;
sft)
  rm -rf -- "${SFT:?}"
  python sft.py --device cuda --model "$MODEL" --train-data data/out/mcp-seen/train.jsonl --epochs 1 --lr 1e-5 \
    --batch-size 16 --micro-batch-size 4 --no-progress --out-dir "$SFT" > "$OUT/sft.log" 2>&1
  echo "sft rc=$?"; tail -3 "$OUT/sft.log" ;;
sftrl)
  [ -f "$SFT/config.json" ] || { echo "no SFT model in $SFT: run the sft stage first"; exit 1; }
  rl "$SFT" "$SFTRL" "${SFT_STEPS:-10}" > "$OUT/sftrl.log" 2>&1; echo "sftrl rc=$?"; keep "$SFTRL" sftrl ;;
plot)
  python lab/plot_runs.py "$OUT/headline.png" "${TITLE:-Qwen2.5-Coder-1.5B-Instruct, MCP tools, l40s preset under a 45 GiB cap}" \
    --metric "eval_pass1/seen+eval_pass1/unseen,reward_mean,entropy_live,entropy_coef,tool_calls,tool_errors,tool_parse_rate+tool_parse_rate_strict" \
    --label RL-only "$OUT/rl.metrics.jsonl" $([ -f "$OUT/sftrl.metrics.jsonl" ] && echo --label SFT+RL "$OUT/sftrl.metrics.jsonl") ;;
*) echo "usage: bash $0 rl|passk|sft|sftrl|plot"; exit 2 ;;
esac
