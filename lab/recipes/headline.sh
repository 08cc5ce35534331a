#!/bin/bash
# The headline: full-parameter GRPO of a 1.5B chat model (Qwen2.5-Coder-1.5B-Instruct as $MODEL) on
# multi-turn MCP tool use, l40s preset under a 45 GiB cap, scored on held-out tasks of the trained
# families (seen) and of families it never trains on (unseen); SFT-only vs SFT+RL vs RL-only; pass@k.
# On a GPU with vLLM, from the repository root, results into $OUT (flat); what each measured, with its
# exact command and variables: docs/results.md.
#   MODEL=$QWEN_DIR OUT=out bash lab/recipes/headline.sh rl|passk|sft|sftrl   # RL 20 steps; eval.py pass@1/8;
#                                                      # SFT on the seen oracle calls; RL from the SFT model
#   OUT=out bash lab/recipes/headline.sh plot          # headline.png from the runs' metrics
#   bash lab/recipes/headline.sh capped CAP CMD...     # CMD as if the GPU had only CAP GiB (the memory cap)
#   GSM8K_SRC=DIR MODEL=$QWEN_DIR OUT=out bash lab/recipes/headline.sh gsm8k-eval|gsm8k-rl   # GSM8K, same preset and
#                                # cap: eval.py greedy on all 1,319 test rows (MODEL); RL for at most MINUTES of training,
#                                # then eval.py on its last checkpoint
# Second split (trains multi, holds out state):
#   export SEEN_FAMILIES=arith,units,currency,dates,shop,multi,kb,text UNSEEN_FAMILIES=state
#   then sft, sftrl, and passk with MODEL=runs/headline-sft RL_DIR=runs/headline-sftrl/ckpt/step_000010
# RL alone on it plus the discovery and sales families, with --rescue (docs/results.md,
# "the rescue's ablation" and the entries before it):
#   MINUTES=12 STEPS=400 RESCUE=hint=1200 SEED=0 RL_FLAGS="--eval-every 25" MODEL=$QWEN_DIR OUT=out \
#     bash lab/recipes/headline.sh rescue     (the whole plan in the prompt for the whole run)
#   (SEEDS="0 1 2" in place of SEED: the three at once, one GPU each, as the entry ran them; PER_GPU=2 KV_GB=G: two a GPU,
#   PER_GPU=3: three, each at about half its step rate alone: docs/results.md, "three runs in one 135 GiB pool")
#   (RESCUE=hint=1200,credit=0.3: partial credit too, as every run before the ablation; RESCUE=credit=0.3:
#   credit alone; RESCUE=hint=1200,baseline=own: a guided group that passes replaces the all-wrong one
#   instead of joining it; the earlier entries' runs name the commits they used;
#   RESCUE=hint=15,credit=0.1,guide=prefix: masked turns)
#   (in-run evals every 10 steps: seen, state, and multi and discovery apart; RESCUE= for plain RL)
#   NO_ORACLE=1: the training rows without extra_info.oracle_calls (a user's rows); then only the oracle-free
#   sources apply: RESCUE=hint=1200,source=answer (options/rescue.py; source=found, found+answer, answer+similar);
#   TRANSFER=DIR: also eval.py on lab/transfer.py's rows (third-party servers); BASE_EVAL=0: the run alone
#   MINUTES=M: at most M minutes of training (SIGINT, then the final checkpoint), then eval.py, greedy,
#   on the held-out rows of every family (seen and state test rows), base MODEL vs the run's checkpoint,
#   and a line a model with the results log's rows (trained families pooled, multi, discovery, state, repeats)
#   VAL=K: K training rows a family held back as the val set (--eval-data val=...); the evals after the run then
#   score its policy at its best val pass@1 (OUT/best), PICK=last: its last checkpoint, as before VAL existed
#   REPEAT=discovery=2: each of a family's training rows twice (more of its prompts a step; its test rows as they were)
#   WORLD=DIR: lab/world.py's rows and servers trained beside them (third-party servers that the transfer set does not use)
# BFCL multi-turn, RL alone on synthesized conversations, then its four categories and the bundled held-out rows:
#   PYTHONPATH=/tmp/bfcl-site MINUTES=12 SEED=0 MODEL=$QWEN_DIR OUT=out bash lab/recipes/headline.sh bfcl
#   (TURN_CREDIT=W, 0.3: a failed conversation's credit a user turn passed; PLAYED=P, 0: a share P of them start at a
#   later turn, the turns before it played with the answer's calls; BUNDLED=N, 0: N bundled training rows beside them;
#   the synthesized in-run set is the val set: the evals score the policy at its best there, PICK=last: the last)
#   (GPUS=2: trained data-parallel on two GPUs under torchrun, each capped at 45 GiB, PROMPTS=16 prompts a step shared by
#   them (PROMPTS=32: 16 a GPU); the evals after it on both GPUs at once)
# The user's case on the third-party servers (lab/transfer.py's doc): RL on rows for them over a world of their own,
# then the transfer set:  TRANSFER=data/out/transfer MINUTES=16 VAL=5 RESCUE=... MODEL=$QWEN_DIR OUT=out bash ... transfer-rl
# Rows: mcp_tools/tasks.py (seed 0) -> data/out/mcp-seen, data/out/mcp-unseen.
stage=${1:?usage: bash $0 rl|passk|sft|sftrl|rescue|bfcl|transfer-rl|plot|capped|gsm8k-eval|gsm8k-rl}
capped() {  # $1: CAP GiB, then a command: a second process holds the rest of the GPU for the whole run
  # (an L40S has ~45 GiB usable, an A100 40GB ~39; --gpu-memory-utilization is a fraction of the *whole*
  # GPU: the l40s preset's 0.3 of 48 GB is $SHARE, below). Prints the device's peak used memory
  # (nvidia-smi every 0.5 s, the hog included).
  # The GPU is CUDA_VISIBLE_DEVICES' first (default 0), so two capped runs can share a 2-GPU host.
  local cap=$1; shift
  local total hog HOG POLL rc peak=${TMPDIR:-/tmp}/capped-peak.$BASHPID apps=${TMPDIR:-/tmp}/capped-apps.$BASHPID gpu=${CUDA_VISIBLE_DEVICES:-0}
  total=$(python -c "import torch; print(torch.cuda.mem_get_info()[1])") || return 1  # the GPU's bytes
  if [ -n "$CAP_SHARED" ]; then  # SEEDS with PER_GPU: the parent's hog leaves CAP_SHARED runs x cap on this GPU.
    # The engine sleeps while training (--sleep-level 2, what auto picks under a run's own 45 GiB): auto reads the
    # pool's free memory here and keeps the engine awake, and such a run grew to 46.6 GiB beside another, which then
    # ran out of memory at its first update. And the pool alone caps no run, so PyTorch's allocator in each is held
    # to cap less 1 GiB, the rest of a process (its CUDA context; 1.05 GiB measured) (PYTORCH_CUDA_ALLOC_CONF's
    # per_process_memory_fraction, in torch 2.11), plus the engine's pool: vLLM's sleep unmaps its pages under tensors
    # that live on, so PyTorch counts them while it sleeps (KV_GB, the weight files and 1.25 GiB of its own buffers:
    # 12.91-12.96 GiB measured at KV_GB=8.81 for the 1.5B; docs/results.md, "three runs in one 135 GiB pool")
    local eng=$(python -c "import glob; import os; print(sum(os.path.getsize(f) for f in glob.glob('${MODEL:-.}/*.safetensors')) / 2**30)")
    local frac=$(awk -v c="$cap" -v e="${eng:-0}" -v k="${KV_GB:-0}" -v t="$total" \
      'BEGIN {printf "%.4f", int((c - 1 + e + k + 1.25) * 2^30 / t * 10000) / 10000}')
    case " $* " in *" --sleep-level "*) ;; *" train.py "*) set -- "$@" --sleep-level 2 ;; esac
    local conf=${PYTORCH_CUDA_ALLOC_CONF:+$PYTORCH_CUDA_ALLOC_CONF,}per_process_memory_fraction:$frac
    case ",$PYTORCH_CUDA_ALLOC_CONF" in *,per_process_memory_fraction:*)  # the user's own fraction, as given
      conf=$PYTORCH_CUDA_ALLOC_CONF frac=${PYTORCH_CUDA_ALLOC_CONF##*per_process_memory_fraction:} frac=${frac%%,*} ;; esac
    PYTORCH_CUDA_ALLOC_CONF=$conf "$@"; rc=$?
    echo "capped: one of $CAP_SHARED runs in the $((CAP_SHARED * cap)) GiB a hog left, its PyTorch memory at most $frac of the GPU (the device's peak and each process's: OUT/capped-gpu${gpu%%,*}.out), exit $rc"
    return $rc
  fi
  gpu=${gpu%%,*}
  hog=$(python -c "print(int($total - $cap * 2**30 - 600 * 2**20))")
  python -c "import torch, time; x = torch.empty($hog, dtype=torch.uint8, device='cuda'); print('hog holds', round($hog / 2**30, 1), 'GiB', flush=True); time.sleep(36000)" &
  HOG=$!
  until [ "$(nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits)" -ge $((hog / 1048576)) ]; do
    kill -0 $HOG 2>/dev/null || { echo "capped: the hog of $((hog / 2**20)) MiB did not start"; return 1; }; sleep 1
  done
  ( while kill -0 $HOG 2>/dev/null; do nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits
      nvidia-smi -i "$gpu" --query-compute-apps=pid,used_memory --format=csv,noheader,nounits >> $apps; sleep 0.5; done > $peak ) &
  POLL=$!
  "$@"
  rc=$?
  kill $HOG; wait $HOG 2>/dev/null; kill $POLL 2>/dev/null
  echo "capped: cap $cap GiB, device peak used $(sort -n $peak | tail -1) MiB (hog $((hog / 2**20)) MiB), exit $rc"
  # each process's peak as the driver lists it (pids as the driver sees them; the hog's among them)
  echo "capped: processes' peaks, pid:MiB: $(awk -F', *' 'NF == 2 && $2 ~ /^[0-9]+$/ {if ($2 > m[$1]) m[$1] = $2} END {for (p in m) printf "%s:%s ", p, m[p]}' $apps 2>/dev/null)"
  rm -f $peak $apps
  return $rc
}
if [ "$stage" = capped ]; then shift; capped "$@"; exit $?; fi
OUT=${OUT:?set OUT to the folder for the results}
MODEL=${MODEL:-$QWEN_DIR}
RL=${RL_DIR:-runs/headline-rl}
SFT=${SFT_DIR:-runs/headline-sft}
SFTRL=${SFTRL_DIR:-runs/headline-sftrl}
# rescue's trained families: the second split's, discovery, and sales (a product's id looked up before a call
# that takes it); the entries before sales existed ran RESCUE_FAMILIES=arith,units,currency,dates,shop,multi,kb,text,discovery
[ "$stage" = rescue ] && SEEN_FAMILIES=${RESCUE_FAMILIES:-arith,units,currency,dates,shop,multi,kb,text,discovery,sales} UNSEEN_FAMILIES=state
# (RESCUE_FAMILIES=...,sales,joins adds the joins family, made only when named: mcp_tools/tasks.py; its held-out
# tables are scored apart, as discovery's, and left out of the trained families' pooled figure)
SEEN_FAMILIES=${SEEN_FAMILIES:-arith,units,currency,dates,shop,kb,text}  # trained on; their test rows: seen
UNSEEN_FAMILIES=${UNSEEN_FAMILIES:-multi,state}                           # never trained on: unseen
UNSEEN_TEST_FRACTION=${UNSEEN_TEST_FRACTION:-0.25}                        # the in-run unseen set (passk: all rows)
KL=${KL:-0}                                                               # --kl-coef (0: no reference model)
PENALTY=${PENALTY:-0.2}                                                   # --tool-error-penalty per failed call
ERROR_CAP=${ERROR_CAP:-2.0}                                               # --tool-error-cap: the most a wrong episode pays
MINI_BATCH=${MINI_BATCH:-64}                                              # --mini-batch-size (256: one update a step)
CLIP_HIGH=${CLIP_HIGH:-0.28}                                              # --clip-high (PPO's eps_high; 0.2: symmetric)
PASSK_UNSEEN=${PASSK_UNSEEN:-all}                                         # passk's unseen rows: all (900) or test (225)
mkdir -p "$OUT"
# vLLM's share of this GPU: the memory the l40s preset's 0.3 gives it on a 48 GB card, as a fraction of the
# whole GPU (0.17 of an 80 GB H100, 0.096 of a 141 GB H200, where 0.17 would be 24 GiB and the trainer would
# run out under the cap): lab/capped.py's share_here, as lab/bench.py's memory table and lab/trl_bench.py use it
[ "$stage" = plot ] || SHARE=${SHARE:-$(python -c "import sys; sys.path.insert(0, 'lab'); from capped import share_here; print(share_here(0.17))")}
EVAL_SHARE=${EVAL_SHARE:-$SHARE}  # eval.py's share after a run: no trainer beside it (0.3 of an H200 is 42 GiB, under the cap)
# KV_GB=G: vLLM's KV cache fixed at G GiB in every train.py and eval.py (--kv-cache-gb): its start-up profiling reads
# the device's free memory, which another run on the GPU changes (PER_GPU), and fails or misjudges the cache
KVF=${KV_GB:+--kv-cache-gb $KV_GB}
case $stage in gsm8k-*)  # DIR: the official release's train.jsonl and test.jsonl (data/gsm8k.py)
  [ -f data/out/gsm8k/test.jsonl ] || python data/gsm8k.py --src "${GSM8K_SRC:?set GSM8K_SRC}" --out data/out/gsm8k || exit 1
  if [ "$stage" = gsm8k-eval ]; then
    python eval.py --env gsm8k --gpu l40s --model "$MODEL" --gpu-memory-utilization "$EVAL_SHARE" $KVF \
      --eval-data data/out/gsm8k/test.jsonl --limit 100000 --n 0 --out-dir "$OUT/gsm8k-eval" > "$OUT/gsm8k-eval.log" 2>&1
    echo "gsm8k-eval rc=$?"; grep -E "^\|" "$OUT/gsm8k-eval.log"; exit
  fi
  GSM8K_RL=${GSM8K_RL_DIR:-runs/gsm8k-rl}; rm -rf -- "${GSM8K_RL:?}"
  # SIGINT after MINUTES: train.py finishes the step in flight, saves it and exits 0 (the training-time bound)
  capped 45 timeout --foreground --preserve-status -s INT "${MINUTES:-20}m" python train.py --env gsm8k --gpu l40s --model "$MODEL" \
    --gpu-memory-utilization "$SHARE" $KVF --train-data data/out/gsm8k/train.jsonl --eval-data data/out/gsm8k/test.jsonl \
    --eval-every 10 --eval-limit 200 --steps "${STEPS:-200}" --mini-batch-size "$MINI_BATCH" --clip-high "$CLIP_HIGH" \
    --save-every 0 --out-dir "$GSM8K_RL" $RL_FLAGS > "$OUT/gsm8k-rl.log" 2>&1
  echo "gsm8k-rl rc=$?"; cp "$GSM8K_RL/metrics.jsonl" "$OUT/gsm8k-rl.metrics.jsonl"; grep -E "^step|eval|rror|capped" "$OUT/gsm8k-rl.log" | tail -20
  # the trained run's last checkpoint, scored as gsm8k-eval scores the base: all 1,319 test rows, greedy
  python eval.py --env gsm8k --gpu l40s --model "$GSM8K_RL" --gpu-memory-utilization "$EVAL_SHARE" $KVF \
    --eval-data data/out/gsm8k/test.jsonl --limit 100000 --n 0 --out-dir "$OUT/gsm8k-rl-eval" > "$OUT/gsm8k-rl-eval.log" 2>&1
  echo "gsm8k-rl eval.py rc=$?"; grep -E "^\|" "$OUT/gsm8k-rl-eval.log"
  exit ;;
esac
counts() {  # --count flags for the families in $1 (multi 500, state 400 tasks: 125 and 100 test rows)
  for f in multi=500 state=400; do [[ ",$1," == *",${f%=*},"* ]] && echo --count $f; done
}
if [ -z "$ROWS_READY" ] && [ "$stage" != transfer-rl ]; then  # the bundled rows (transfer-rl trains on none of them);
  # ROWS_READY is set for the runs SEEDS starts: their parent wrote the rows (and read SHARE) once
  python mcp_tools/tasks.py --families "$SEEN_FAMILIES" $(counts "$SEEN_FAMILIES") --out data/out/mcp-seen > /dev/null || exit 1
  python mcp_tools/tasks.py --families "$UNSEEN_FAMILIES" $(counts "$UNSEEN_FAMILIES") --test-fraction "$UNSEEN_TEST_FRACTION" --out data/out/mcp-unseen > /dev/null || exit 1
fi

hold_val() {  # $1: training rows, $2: val rows, $3: K; VAL=K: K training rows a family held back (out of $1), the
  # val set that picks OUT/best (train.py's keep_best)
  python -c 'import json, random, sys
path, val, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(line) for line in open(path)]
by_family = {}
for i, r in enumerate(rows):
    by_family.setdefault(r["extra_info"]["family"], []).append(i)
held = {i for ids in by_family.values() for i in random.Random(0).sample(ids, min(k, len(ids) - 1))}
open(val, "w").write("".join(json.dumps(rows[i]) + "\n" for i in sorted(held)))
open(path, "w").write("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if i not in held))
print("VAL:", len(held), "training rows held back as the val set,", len(by_family), "families")' "$@"
}
rl() {  # $1: model, $2: out folder, $3: steps
  rm -rf -- "${2:?}"  # train.py appends to an existing metrics.jsonl
  capped 45 $BOUND python train.py --env mcp --gpu l40s --model "$1" --gpu-memory-utilization "$SHARE" $KVF \
    --train-data data/out/mcp-seen/train.jsonl --eval-data seen=data/out/mcp-seen/test.jsonl \
    --eval-data unseen=data/out/mcp-unseen/test.jsonl --eval-every 5 --steps "$3" --tool-error-penalty "$PENALTY" --tool-error-cap "$ERROR_CAP" --kl-coef "$KL" \
    --mini-batch-size "$MINI_BATCH" --clip-high "$CLIP_HIGH" \
    --viewer-groups 8 --save-every 0 --out-dir "$2" $RL_FLAGS
}
picked() {  # $1: run folder; the policy the evals after a run score: PICK=best (default) its best on the val set
  # (OUT/best, train.py's keep_best) where the run had one, else, and with PICK=last, its last checkpoint
  if [ "${PICK:-best}" = best ] && [ -f "$1/best/best.json" ]; then echo "$1/best"; else echo "$1"; fi
}
scored() {  # $1: run folder; models: the --model flags of the evals after a run, the base MODEL and the picked policy
  # (BASE_EVAL=0: the run alone)
  models=(--model "$(picked "$1")"); [ "${BASE_EVAL:-1}" = 0 ] || models=(--model "$MODEL" "${models[@]}")
}
transfer_eval() {  # $1: the run's name, $2: lab/transfer.py's folder (servers.json, rows.jsonl); eval.py, greedy, of models
  python eval.py --env mcp --gpu l40s "${models[@]}" --gpu-memory-utilization "$EVAL_SHARE" $KVF --mcp-config "$2/servers.json" \
    --eval-data "$2/rows.jsonl" --limit 100000 --n 0 --out-dir "$OUT/$1-transfer" > "$OUT/$1-transfer.log" 2>&1
  echo "$1 transfer rc=$?"; grep -E "^\|" "$OUT/$1-transfer.log"
}
keep() {  # $1: run folder, $2: name in $OUT
  cp "$1/metrics.jsonl" "$OUT/$2.metrics.jsonl"; cp "$1/episodes.jsonl" "$OUT/$2.episodes.jsonl" 2>/dev/null
  grep -E "^step|eval|Error|capped" "$OUT/$2.log" | tail -40
}
gpu_list() {  # gpus: the GPUs a run may use, CUDA_VISIBLE_DEVICES' list, else every GPU nvidia-smi lists
  IFS=, read -ra gpus <<< "${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)}"
}
hold_gpus() {  # $1: the GiB each GPU leaves, then GPU indices: a hog on each (capped's; its figures in OUT/capped-gpuN.out)
  # until release_gpus or the end of this script, however it ends; returns once every hog holds its GPU
  local cap=$1 g h; shift
  held=$(mktemp -d) held_gpus=("$@") holders=()
  trap 'touch "$held/done"; wait; rm -rf "$held"' EXIT
  trap 'exit 130' INT TERM
  for g in "$@"; do
    CUDA_VISIBLE_DEVICES=$g capped "$cap" bash -c "touch $held/ready.$g; until [ -f $held/done ]; do sleep 1; done" \
      > "$OUT/capped-gpu$g.out" 2>&1 &
    holders+=($!)
  done
  until [ "$(ls "$held"/ready.* 2>/dev/null | wc -l)" -ge $# ]; do
    for h in "${holders[@]}"; do kill -0 $h 2>/dev/null || { echo "a hog did not start:"; for g in "$@"; do cat "$OUT/capped-gpu$g.out"; done; exit 1; }; done
    sleep 1
  done
}
release_gpus() {  # hold_gpus' hogs end; each GPU's figures (the device's peak, each process's)
  touch "$held/done"; wait "${holders[@]}"
  for g in "${held_gpus[@]}"; do grep -h "capped:" "$OUT/capped-gpu$g.out"; done
}
interrupt_after() {  # $1: minutes (a decimal), then a command (torchrun): its child processes (the ranks) get SIGINT then
  # (train.py: finish the step, save, exit; the ranks agree on the step), not torchrun, whose agent would kill its
  # workers 30 s after passing a signal on, mid-save
  local s=$(awk -v m="$1" 'BEGIN {print int(m * 60)}') pid rc; shift
  "$@" & pid=$!
  ( end=$((SECONDS + s)); while kill -0 $pid 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 1; done
    kill -0 $pid 2>/dev/null && pkill -INT -P $pid ) &
  wait $pid; rc=$?
  wait $!
  return $rc
}

case $stage in
rl)
  rl "$MODEL" "$RL" "${STEPS:-20}" > "$OUT/rl.log" 2>&1; echo "rl rc=$?"; keep "$RL" rl ;;
rescue)  # the second split + discovery + sales, RL alone, --rescue $RESCUE (empty: off), seed $SEED; SEEDS="0 1 2":
  # each seed at once on a GPU of its own (CUDA_VISIBLE_DEVICES' list, else every GPU), each run as SEED runs
  # it, its output in $OUT/rescue-sS.out
  if [ -z "$ROWS_READY" ]; then
    python mcp_tools/tasks.py --families multi --count multi=500 --out data/out/mcp-multi > /dev/null || exit 1
    python mcp_tools/tasks.py --families discovery --out data/out/mcp-discovery > /dev/null || exit 1
    cat data/out/mcp-seen/test.jsonl data/out/mcp-unseen/test.jsonl > data/out/mcp-rescue-eval.jsonl  # a row per family
    if [ -n "$NO_ORACLE" ]; then  # the training rows as a user brings them (a question and an answer, no oracle calls)
      python -c 'import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    r["extra_info"].pop("oracle_calls", None)
open(sys.argv[1], "w").write("".join(json.dumps(r) + "\n" for r in rows))
print("NO_ORACLE: oracle_calls stripped from", len(rows), "training rows")' data/out/mcp-seen/train.jsonl || exit 1
    fi
    [ -z "$VAL" ] || hold_val data/out/mcp-seen/train.jsonl data/out/mcp-seen/val.jsonl "$VAL" || exit 1
    if [ -n "$REPEAT" ]; then  # REPEAT=FAMILY=N,...: that family's training rows N times each (after VAL's split, so
      # no val row trains; the family's test rows unchanged): more of a family's prompts a step
      python -c 'import json, sys
path, spec = sys.argv[1], sys.argv[2]
times = {}
for part in spec.split(","):
    family, _, n = part.partition("=")
    if not n.isdigit() or int(n) < 1:
        sys.exit(f"REPEAT={spec}: want FAMILY=N,... with N >= 1, got {part!r}")
    times[family] = int(n)
rows = [json.loads(line) for line in open(path)]
missing = set(times) - {r["extra_info"]["family"] for r in rows}
if missing:
    sys.exit(f"REPEAT={spec}: no training rows of {sorted(missing)} in {path}")
out = [r for r in rows for _ in range(times.get(r["extra_info"]["family"], 1))]
open(path, "w").write("".join(json.dumps(r) + "\n" for r in out))
print("REPEAT:", len(rows), "->", len(out), "training rows")' data/out/mcp-seen/train.jsonl "$REPEAT" || exit 2
    fi
    if [ -n "$WORLD" ]; then  # WORLD=DIR: lab/world.py's training rows (a question and an answer) beside the bundled
      # ones (after VAL's split: the val set stays bundled), its three servers beside ours (row_tools: a world row shows
      # the world's tools, a bundled row ours), in data/out/world-train.json, the run's --mcp-config
      python -c 'import json, sys
from mcp_tools.config import bundled_config
world = json.load(open(sys.argv[1] + "/servers.json"))
world["mcpServers"].update(bundled_config()["mcpServers"])
open("data/out/world-train.json", "w").write(json.dumps(world, indent=1))
rows = open(sys.argv[1] + "/train.jsonl").read()
open("data/out/mcp-seen/train.jsonl", "a").write(rows)
print("WORLD:", rows.count("\n"), "training rows,", len(world["mcpServers"]) - 1, "servers beside ours, from", sys.argv[1])' "$WORLD" || exit 1
    fi
  fi
  if [ -n "$SEEDS" ]; then
    gpu_list
    seeds=($SEEDS) per=${PER_GPU:-1}
    [[ $per =~ ^[1-9]$ ]] || { echo "PER_GPU=$per: want the number of runs a GPU, 1-9"; exit 2; }
    [ "$per" = 1 ] || [ -n "$KV_GB" ] || { echo "PER_GPU=$per: set KV_GB too (a fixed KV cache: vLLM's profiling fails beside another run)"; exit 2; }
    [ ${#seeds[@]} -le $((${#gpus[@]} * per)) ] || { echo "SEEDS: ${#seeds[@]} seeds for ${#gpus[@]} GPUs ($per a GPU)"; exit 2; }
    used=("${gpus[@]:0:$(((${#seeds[@]} + per - 1) / per))}") runs=()
    # PER_GPU=K: K runs share a GPU, one hog leaving them K x 45 GiB (each run's own peak: the processes' peaks in
    # OUT/capped-gpuN.out); the runs slow each other, so a time-bounded run gets fewer steps
    [ "$per" -gt 1 ] && hold_gpus $((45 * per)) "${used[@]}"
    for i in "${!seeds[@]}"; do
      shared=()  # sharing a GPU: no hog of its own, and a vLLM compile cache of its own (no two writers at once)
      [ "$per" -gt 1 ] && shared=(CAP_SHARED=$per VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}/run$i")
      env CUDA_VISIBLE_DEVICES=${gpus[$((i / per))]} "${shared[@]}" SEED=${seeds[$i]} SEEDS= ROWS_READY=1 SHARE=$SHARE \
        bash "$0" rescue > "$OUT/rescue-s${seeds[$i]}.out" 2>&1 &
      runs+=($!)
    done
    wait "${runs[@]}"
    [ "$per" -gt 1 ] && release_gpus
    for s in "${seeds[@]}"; do echo "== seed $s"; grep -E "rc=|nanorl_mcp/(multi|state|discovery|sales|joins): greedy pass|: trained families less" "$OUT/rescue-s$s.out"; done
    exit 0
  fi
  name=rescue-s${SEED:-0}
  # MINUTES: SIGINT after M minutes; train.py finishes the step in flight and saves it (the time bound)
  BOUND=${MINUTES:+timeout --foreground --preserve-status -s INT ${MINUTES}m}
  RL_FLAGS="${RESCUE:+--rescue $RESCUE} ${WORLD:+--mcp-config data/out/world-train.json} --seed ${SEED:-0} --eval-every 10 --save-every $([ -n "$MINUTES" ] && echo 0 || echo -1) $RL_FLAGS \
    --eval-data multi=data/out/mcp-multi/test.jsonl --eval-data discovery=data/out/mcp-discovery/test.jsonl \
    ${VAL:+--eval-data val=data/out/mcp-seen/val.jsonl}" \
    rl "$MODEL" "runs/$name" "${STEPS:-20}" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; keep "runs/$name" "$name"
  [ -n "$MINUTES" ] || exit 0
  scored "runs/$name"
  python eval.py --env mcp --gpu l40s "${models[@]}" --gpu-memory-utilization "$EVAL_SHARE" $KVF \
    --eval-data data/out/mcp-rescue-eval.jsonl --limit 100000 --n 0 --out-dir "$OUT/$name-eval" > "$OUT/$name-eval.log" 2>&1
  echo "$name eval.py rc=$?"; grep -E "^\|" "$OUT/$name-eval.log"
  [ -z "$TRANSFER" ] || transfer_eval "$name" "$TRANSFER"  # TRANSFER=DIR: lab/transfer.py's folder, the same models
  # the results log's rows for this run, base model then the run: the trained families less multi and
  # discovery pooled by rows, and repeated failed calls an episode on discovery's rows and on all rows
  python -c 'import json, sys
models, trained = json.load(open(sys.argv[1]))["models"], set(sys.argv[2].split(",")) - {"multi", "discovery", "joins"}
for m in models:
    fam = {k.split("/")[-1]: v for k, v in m["by_source"].items()}
    rows = lambda names: sum(fam[f]["rows"] for f in names)
    pooled = lambda key, names: sum(fam[f][key] * fam[f]["rows"] for f in names) / max(rows(names), 1)
    t = [f for f in fam if f in trained]
    parts = ["trained families less multi and discovery (%d) %.3f" % (rows(t), pooled("greedy_pass@1", t))]
    parts += ["%s %.3f" % (f, fam[f]["greedy_pass@1"]) for f in ("multi", "discovery", "joins", "state") if f in fam]
    parts += ["repeated failed calls an episode: discovery %.3f" % fam.get("discovery", {}).get("greedy_repeat_failed", 0),
              "all %d rows %.3f" % (rows(fam), pooled("greedy_repeat_failed", fam))]
    print(m["model"] + ": " + "; ".join(parts))' "$OUT/$name-eval/eval.json" "$SEEN_FAMILIES" ;;
bfcl)  # BFCL multi-turn (bfcl_eval importable: mcp_tools/bfcl.py's doc). RL alone on conversations synthesized over
  # its classes that are none of its tests (mcp_tools/bfcl_synth.py) for at most MINUTES; then eval.py, greedy, on all
  # 800 test conversations (the four categories beside the paper) and on the bundled held-out rows (seen and unseen
  # test rows), base MODEL (BASE_EVAL=0: not) and the run's policy (picked: at its best val pass@1); TRANSFER=DIR: and on
  # lab/transfer.py's rows (third-party servers, whether RL on BFCL's classes carries there). The prompts hold 18-35 tool schemas
  # (13-23K characters): --max-context 12288 in training, 32768 in eval (long_context's results)
  python -m mcp_tools.bfcl config --out data/out/bfcl/mcp.json || exit 1
  python -m mcp_tools.bfcl rows --category all --out data/out/bfcl/all.jsonl || exit 1
  # TURN_CREDIT (0.3): the training rows' reward_spec.turn_credit, a failed conversation's credit a user turn
  # passed (mcp_tools/bfcl.py); TURN_CREDIT=0 is the entries' recipe before it (all or nothing).
  # PLAYED=P (0): a share P of them start at a later user turn, the turns before it played with the answer's calls
  python -m mcp_tools.bfcl_synth --n 2000 --seed 0 --turn-credit "${TURN_CREDIT:-0.3}" --played "${PLAYED:-0}" \
    --out data/out/bfcl/train.jsonl || exit 1
  python -m mcp_tools.bfcl_synth --n 64 --seed 1 --out data/out/bfcl/synth-eval.jsonl || exit 1  # in-run eval, the val set
  # BUNDLED=N (0): N of the bundled tasks' training rows (SEEN_FAMILIES', picked by a fixed seed) train beside the
  # conversations, the bundled server beside BFCL's, so that RL on BFCL does not cost the bundled families
  CONFIG=data/out/bfcl/mcp.json
  [[ ${BUNDLED:-0} =~ ^[0-9]+$ ]] || { echo "BUNDLED=$BUNDLED: want a number of rows"; exit 2; }
  if [ "${BUNDLED:-0}" -gt 0 ]; then
    CONFIG=data/out/bfcl/mcp-train.json
    python -m mcp_tools.bfcl config --bundled --out "$CONFIG" || exit 1
    shuf -n "$BUNDLED" --random-source=<(yes) data/out/mcp-seen/train.jsonl >> data/out/bfcl/train.jsonl || exit 1
  fi
  name=bfcl-s${SEED:-0}; rm -rf -- "runs/$name"
  # GPUS=N (1): data-parallel training on the first N GPUs (CUDA_VISIBLE_DEVICES' list, else every GPU) under torchrun, each
  # capped at 45 GiB by a hog of its own; PROMPTS (16) prompts a step are shared by the ranks: the same batch takes less
  # time a step, PROMPTS=32 on two GPUs twice the episodes (and updates) a step in about the time of one GPU's 16
  # (the evals after it: BFCL's on the first GPU, the others on the second)
  [[ ${GPUS:-1} =~ ^[1-9]$ ]] || { echo "GPUS=$GPUS: want a number of GPUs, 1-9"; exit 2; }
  if [ "${GPUS:-1}" -gt 1 ]; then
    gpu_list
    [ ${#gpus[@]} -ge "$GPUS" ] || { echo "GPUS=$GPUS: ${#gpus[@]} GPUs here"; exit 2; }
    hold_gpus 45 "${gpus[@]:0:$GPUS}"
    launch=(interrupt_after "${MINUTES:-20}" env CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${gpus[*]:0:$GPUS}")" \
      torchrun --standalone --nproc-per-node "$GPUS" -- train.py)
  else
    launch=(capped 45 timeout --foreground --preserve-status -s INT "${MINUTES:-20}m" python train.py)
  fi
  "${launch[@]}" --env mcp --gpu l40s --model "$MODEL" --gpu-memory-utilization "$SHARE" $KVF \
    --mcp-config "$CONFIG" --train-data data/out/bfcl/train.jsonl --eval-data val=data/out/bfcl/synth-eval.jsonl \
    --eval-every 10 --eval-limit 64 --steps "${STEPS:-200}" --seed "${SEED:-0}" --prompts-per-step "${PROMPTS:-16}" --max-context 12288 \
    --max-turns 6 --mini-batch-size "$MINI_BATCH" --clip-high "$CLIP_HIGH" --save-every 0 --out-dir "runs/$name" $RL_FLAGS \
    > "$OUT/$name.log" 2>&1; echo "$name rc=$?"
  [ "${GPUS:-1}" -gt 1 ] && release_gpus
  keep "runs/$name" "$name"
  scored "runs/$name"
  cat data/out/mcp-seen/test.jsonl data/out/mcp-unseen/test.jsonl > data/out/mcp-heldout-test.jsonl
  others() {  # the bundled held-out rows, then (TRANSFER) lab/transfer.py's rows on third-party servers, as rescue's
    python eval.py --env mcp --gpu l40s "${models[@]}" --gpu-memory-utilization "$EVAL_SHARE" $KVF --eval-data data/out/mcp-heldout-test.jsonl \
      --limit 100000 --n 0 --out-dir "$OUT/$name-bundled" > "$OUT/$name-bundled.log" 2>&1
    echo "$name bundled rc=$?"; grep -E "^\|" "$OUT/$name-bundled.log"
    [ -z "$TRANSFER" ] || transfer_eval "$name" "$TRANSFER"
  }
  bfcl_gpu=() beside=  # GPUS=N: BFCL's 800 conversations on the first GPU, the other evals beside them on the second
  if [ "${GPUS:-1}" -gt 1 ]; then
    bfcl_gpu=(CUDA_VISIBLE_DEVICES=${gpus[0]})
    CUDA_VISIBLE_DEVICES=${gpus[1]} others > "$OUT/$name-others.out" 2>&1 & beside=$!
  fi
  env "${bfcl_gpu[@]}" python eval.py --env mcp --gpu l40s "${models[@]}" --gpu-memory-utilization "$EVAL_SHARE" $KVF \
    --mcp-config data/out/bfcl/mcp.json --eval-data data/out/bfcl/all.jsonl --limit 800 --n 0 --max-context 32768 \
    --max-tokens 512 --out-dir "$OUT/$name-eval" > "$OUT/$name-eval.log" 2>&1
  echo "$name eval.py rc=$?"; grep -E "^\|" "$OUT/$name-eval.log" | tail -8
  if [ -n "$beside" ]; then wait $beside; cat "$OUT/$name-others.out"; else others; fi
  exit 0 ;;  # each step's rc is printed
transfer-rl)  # the user's case: RL alone on lab/transfer.py --split train's rows (the four third-party servers over a
  # world of their own, a question and an answer a row, no oracle calls) for at most MINUTES, --rescue $RESCUE (empty: the
  # default for such rows); VAL=K rows a family held back pick the policy; then eval.py, greedy, on the transfer set
  # (TRANSFER: its folder, built first; the test world and questions, none trained on), base MODEL (BASE_EVAL=0: not)
  T=${TRANSFER:?set TRANSFER to the folder of lab/transfer.py, the test set built first}
  TRAIN=${TRANSFER_TRAIN:-data/out/transfer-train-s${SEED:-0}}  # a run's own (it holds the servers' files)
  sqlite=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["mcpServers"]["sqlite"]["command"])' "$T/servers.json") || exit 1
  python lab/transfer.py --split train --out "$TRAIN" --sqlite-server "$sqlite" --exclude "$T/rows.jsonl" || exit 1
  [ -z "$VAL" ] || hold_val "$TRAIN/rows.jsonl" "$TRAIN/val.jsonl" "$VAL" || exit 1
  name=transfer-rl-s${SEED:-0}; rm -rf -- "runs/$name"
  BOUND="timeout --foreground --preserve-status -s INT ${MINUTES:-16}m"
  capped 45 $BOUND python train.py --env mcp --gpu l40s --model "$MODEL" --gpu-memory-utilization "$SHARE" $KVF \
    --mcp-config "$TRAIN/servers.json" --train-data "$TRAIN/rows.jsonl" ${VAL:+--eval-data val=$TRAIN/val.jsonl} \
    --eval-every 10 --steps "${STEPS:-400}" --seed "${SEED:-0}" --tool-error-penalty "$PENALTY" --tool-error-cap "$ERROR_CAP" \
    --kl-coef "$KL" --mini-batch-size "$MINI_BATCH" --clip-high "$CLIP_HIGH" --save-every 0 --out-dir "runs/$name" \
    ${RESCUE:+--rescue $RESCUE} $RL_FLAGS > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; keep "runs/$name" "$name"
  scored "runs/$name"
  transfer_eval "$name" "$T"; exit 0 ;;
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
    --batch-size 16 --micro-batch-size 4 --out-dir "$SFT" > "$OUT/sft.log" 2>&1
  echo "sft rc=$?"; tail -3 "$OUT/sft.log" ;;
sftrl)
  [ -f "$SFT/config.json" ] || { echo "no SFT model in $SFT: run the sft stage first"; exit 1; }
  rl "$SFT" "$SFTRL" "${SFT_STEPS:-10}" > "$OUT/sftrl.log" 2>&1; echo "sftrl rc=$?"; keep "$SFTRL" sftrl ;;
plot)
  python lab/plot_runs.py "$OUT/headline.png" "${TITLE:-Qwen2.5-Coder-1.5B-Instruct, MCP tools, l40s preset under a 45 GiB cap}" \
    --metric "eval_pass1/seen+eval_pass1/unseen,reward_mean,entropy_live,entropy_coef,tool_calls,tool_errors,tool_parse_rate+tool_parse_rate_strict" \
    --label RL-only "$OUT/rl.metrics.jsonl" $([ -f "$OUT/sftrl.metrics.jsonl" ] && echo --label SFT+RL "$OUT/sftrl.metrics.jsonl") ;;
*) echo "usage: bash $0 rl|passk|sft|sftrl|rescue|bfcl|transfer-rl|plot|capped|gsm8k-eval|gsm8k-rl"; exit 2 ;;
esac
