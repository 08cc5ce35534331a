#!/bin/bash
# Several GPUs (support/dist.py), from the repository root, into $OUT (what they measured: docs/results.md).
# GPUS: the machine's GPUs for the stages that take it (default 2; twonode and after4 need 4):
#   OUT=out bash lab/recipes/multigpu.sh smoke     # torchrun, 2 ranks, DDP, SmolLM2: 2 steps and a checkpoint, resumed on 1 GPU for step 3
#   OUT=out bash lab/recipes/multigpu.sh twonode   # 4 GPUs as 2 nodes x 2: two torchrun launches (GPUs 0,1 and 2,3) meet at a
#                                                  # c10d rendezvous on 127.0.0.1:$PORT (default: a free port); smoke's 2 steps on
#                                                  # 4 ranks, resumed on 2 GPUs for step 3 and on 1 for step 4
#   OUT=out bash lab/recipes/multigpu.sh after4    # a 4-GPU run, then twonode on the same host (how twonode once failed: vLLM's
#                                                  # compile cache held cuda:2's graphs for a process on cuda:0)
#   OUT=out bash lab/recipes/multigpu.sh resume4   # argmax sampling (every world size samples the same episodes): 4 steps on
#                                                  # 4 GPUs uninterrupted, against 2 on 4 GPUs, step 3 resumed on 2, step 4 on 1
#   OUT=out GPUS=4 bash lab/recipes/multigpu.sh scaling   # 1 vs GPUS GPUs at 32 prompts x 8 per GPU: SmolLM2 and a Qwen2.5-1.5B shape
#   OUT=out GPUS=4 bash lab/recipes/multigpu.sh smollm2   # the SmolLM2 half of scaling again, + GPUS one-GPU runs at once (--apart)
#   OUT=out GPUS=4 bash lab/recipes/multigpu.sh fsdp7b    # a Qwen2.5-7B shape, full-parameter, FSDP2 over GPUS GPUs, 5 steps
#   OUT=out bash lab/recipes/multigpu.sh fsdpddp   # the real 1.5B model ($QWEN_DIR): FSDP2 against DDP on 2 GPUs, 10 steps each
#   GSM8K_SRC=DIR OUT=out GPUS=4 bash lab/recipes/multigpu.sh qwen   # the real 1.5B model ($QWEN_DIR) on GSM8K at the l40s
#                                                  # preset's batch (32 x 8 a GPU, no memory cap): 1 vs GPUS GPUs, + GPUS apart
# A random-weight model earns no reward: a k1 KL term makes every sequence train (k3's gradient is 0
# while policy = reference). NANORL_DIST_TIMEOUT_S=300: a rank whose peers died fails in 5 minutes.
stage=$1
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
M=${SMOLLM2_DIR:-smollm2}
G=${GPUS:-2}
export NANORL_DIST_TIMEOUT_S=${NANORL_DIST_TIMEOUT_S:-300}
common="--gpu h200 --env multiply --digits 2,1 --fewshot 2 --max-tokens 128 --max-context 512 --n 8 --eval-limit 64"
argmax="--top-p 1e-9 --kl-coef 0.1 --kl-type k1"  # tests/test_dist.py's ARGMAX: the same episodes on any world size
free_port() { python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
has_ckpt() { python -c "from support.checkpoint import find_checkpoint; find_checkpoint('$1')" 2>/dev/null; }
losses() { grep -hE "^step" "$@" | awk -F' \\| ' '{o=""; for (i = 1; i <= NF; i++) if ($i ~ /^(step|loss|kl|gnorm) /) o = o $i "  "; print o}'; }

twonode() {  # $1: the run folder; both launches as two machines would run them, each node its own vLLM cache
  rm -rf "$1"
  local port=${PORT:-$(free_port)} cache=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}
  # --local-addr: rank 0's address for the other node's workers (here both nodes are this machine)
  local rdzv="--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$port --rdzv-id twonode-$$ --local-addr 127.0.0.1"
  local run="-- train.py $common --model $M --prompts-per-step 32 --steps 2 --eval-every 2 --out-dir $1"
  CUDA_VISIBLE_DEVICES=0,1 VLLM_CACHE_ROOT=$cache/node0 torchrun $rdzv $run > "$OUT/twonode.node0.log" 2>&1 & node0=$!
  CUDA_VISIBLE_DEVICES=2,3 VLLM_CACHE_ROOT=$cache/node1 torchrun $rdzv $run > "$OUT/twonode.node1.log" 2>&1 & node1=$!
  wait -n $node0 $node1 || kill $node0 $node1 2>/dev/null  # one node failed: the other's agent stops its workers
  wait $node0; echo "node 0 (GPUs 0,1) rc=$?"
  wait $node1; echo "node 1 (GPUs 2,3) rc=$?"
  has_ckpt "$1" || { echo "no checkpoint in $1: see $OUT/twonode.node[01].log"; grep -hE "Error|error" "$OUT"/twonode.node[01].log | tail -5; return 1; }
  torchrun --nproc-per-node 2 --master-port "$(free_port)" -- train.py $common --model "$M" --prompts-per-step 32 --steps 3 \
    --eval-every 0 --resume "$1" --out-dir "$1" > "$OUT/twonode.log" 2>&1; echo "resume on 2 rc=$?"
  python train.py $common --model "$M" --prompts-per-step 32 --steps 4 --eval-every 0 --resume "$1" \
    --out-dir "$1" >> "$OUT/twonode.log" 2>&1; echo "resume on 1 rc=$?"
  cat "$OUT"/twonode.node[01].log "$OUT/twonode.log" | grep -E "^step|^saved|resumed|^torchrun|Error|error" | tail -20
}

case $stage in
smoke)
  rm -rf /tmp/smoke
  torchrun --nproc-per-node 2 --master-port "$(free_port)" -- train.py $common --model "$M" --prompts-per-step 32 --steps 2 \
    --eval-every 2 --out-dir /tmp/smoke > "$OUT/smoke.log" 2>&1; echo "smoke 2 ranks rc=$?"
  python train.py $common --model "$M" --prompts-per-step 32 --steps 3 --eval-every 0 --resume /tmp/smoke \
    --out-dir /tmp/smoke >> "$OUT/smoke.log" 2>&1; echo "resume on 1 rc=$?"
  grep -E "^step|^saved|resumed|Error|error" "$OUT/smoke.log" | tail -20 ;;
twonode)
  twonode /tmp/twonode ;;
after4)
  rm -rf /tmp/four
  torchrun --nproc-per-node 4 --master-port "$(free_port)" -- train.py $common --model "$M" --prompts-per-step 64 --steps 2 \
    --eval-every 0 --save-every -1 --out-dir /tmp/four > "$OUT/four.log" 2>&1; echo "4 GPUs rc=$?"
  ls -d "${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}"/torchrun-cuda* 2>/dev/null  # one compile cache per device index
  twonode /tmp/twonode ;;
resume4)
  rm -rf /tmp/whole /tmp/cut
  torchrun --nproc-per-node 4 --master-port "$(free_port)" -- train.py $common $argmax --model "$M" --prompts-per-step 32 \
    --steps 4 --eval-every 0 --save-every -1 --out-dir /tmp/whole > "$OUT/resume4.whole.log" 2>&1; echo "4 steps on 4 rc=$?"
  torchrun --nproc-per-node 4 --master-port "$(free_port)" -- train.py $common $argmax --model "$M" --prompts-per-step 32 \
    --steps 2 --eval-every 0 --save-every 2 --out-dir /tmp/cut > "$OUT/resume4.cut.log" 2>&1; echo "2 steps on 4 rc=$?"
  torchrun --nproc-per-node 2 --master-port "$(free_port)" -- train.py $common $argmax --model "$M" --prompts-per-step 32 \
    --steps 3 --eval-every 0 --save-every 1 --resume /tmp/cut --out-dir /tmp/cut >> "$OUT/resume4.cut.log" 2>&1; echo "step 3 on 2 rc=$?"
  python train.py $common $argmax --model "$M" --prompts-per-step 32 --steps 4 --eval-every 0 --save-every -1 \
    --resume /tmp/cut --out-dir /tmp/cut >> "$OUT/resume4.cut.log" 2>&1; echo "step 4 on 1 rc=$?"
  echo "uninterrupted (4 GPUs):"; losses "$OUT/resume4.whole.log"
  echo "cut (4, 4, then 2, then 1):"; losses "$OUT/resume4.cut.log" ;;
scaling)
  python lab/bench.py --scaling "$G" --model "$M" --out /tmp/scaling 2>&1 | tail -7
  python lab/bench.py --scaling "$G" --model random-qwen2.5-1.5b --out /tmp/scaling 2>&1 | tail -7
  cp /tmp/scaling/scaling.json "$OUT/scaling.json"
  ;;
smollm2)
  python lab/bench.py --scaling "$G" --apart --model "$M" --out /tmp/scaling2 2>&1 | tail -10
  cp /tmp/scaling2/scaling.json "$OUT/scaling-smollm2.json"; cp /tmp/scaling2/*.log "$OUT/" ;;
fsdp7b)
  python -c "from support import sources; print(sources.model_source('random-qwen2.5-7b'))"  # build the shape's folder once
  rm -rf /tmp/fsdp7b
  # --grad-checkpointing: the estimate a GPU on 4 (options/memory.py) is 48 GB with it, 67 GB without (the reference
  # sharded: dist.shard_reference); on 2, 83 GB with it: an H200's
  torchrun --nproc-per-node "$G" --master-port "$(free_port)" -- train.py --gpu h200 --model random-qwen2.5-7b --shard fsdp \
    --lora-rank 0 --env multiply --digits 2,1 --fewshot 2 --max-tokens 64 --max-context 512 --prompts-per-step 16 --n 4 \
    --kl-coef 0.001 --kl-type k1 --steps 5 --eval-every 0 --save-every -1 --gpu-memory-utilization 0.3 \
    --micro-batch-tokens 4096 --grad-checkpointing --viewer-groups 0 --out-dir /tmp/fsdp7b > "$OUT/fsdp7b.log" 2>&1
  echo "fsdp7b on $G GPUs rc=$?"
  cp /tmp/fsdp7b/metrics.jsonl "$OUT/fsdp7b.metrics.jsonl"
  grep -E "^step|memory estimate|^\| |Error|error|torchrun" "$OUT/fsdp7b.log" | tail -30 ;;
fsdpddp)
  for shard in ddp fsdp; do
    rm -rf /tmp/$shard
    torchrun --nproc-per-node 2 --master-port "$(free_port)" -- train.py --gpu h200 --model "${QWEN_DIR:?set QWEN_DIR}" \
      --shard $shard --lora-rank 0 --env multiply --digits 2,1 --fewshot 2 --max-tokens 128 --max-context 512 \
      --prompts-per-step 32 --n 8 --steps 10 --eval-every 0 --save-every -1 --gpu-memory-utilization 0.3 --seed 1 \
      --viewer-groups 0 --out-dir /tmp/$shard > "$OUT/fsdpddp.$shard.log" 2>&1; echo "$shard rc=$?"
    echo "$shard:"; losses "$OUT/fsdpddp.$shard.log"
  done ;;
qwen)
  [ -f data/out/gsm8k/train.jsonl ] || python data/gsm8k.py --src "${GSM8K_SRC:?set GSM8K_SRC}" --out data/out/gsm8k || exit 1
  python lab/bench.py --scaling "$G" --apart --model "${QWEN_DIR:?set QWEN_DIR}" --out /tmp/scaling-qwen --step-flags="--gpu l40s \
    --env gsm8k --train-data data/out/gsm8k/train.jsonl --eval-data data/out/gsm8k/test.jsonl --max-tokens 512 \
    --max-context 2048 --fewshot 0 --kl-coef 0" 2>&1 | tail -10
  cp /tmp/scaling-qwen/scaling.json "$OUT/scaling-qwen.json" ;;
*) echo "usage: bash $0 smoke|twonode|after4|resume4|scaling|smollm2|fsdp7b|fsdpddp|qwen"; exit 2 ;;
esac
