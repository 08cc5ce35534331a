#!/bin/bash
# Several GPUs (support/dist.py), on a machine with 2 GPUs (twonode: 4), from the repository root, into $OUT
# (what they measured: docs/results.md):
#   OUT=out bash lab/recipes/multigpu.sh smoke     # torchrun, 2 ranks, DDP, SmolLM2: 2 steps and a checkpoint, resumed on 1 GPU for step 3
#   OUT=out bash lab/recipes/multigpu.sh twonode   # 4 GPUs as 2 nodes x 2: two torchrun launches (GPUs 0,1 and 2,3) meet at a
#                                                  # c10d rendezvous on 127.0.0.1:$PORT (29500); smoke's 2 steps on 4 ranks,
#                                                  # resumed on 2 GPUs for step 3 and on 1 for step 4
#   OUT=out bash lab/recipes/multigpu.sh scaling   # 1 vs 2 GPUs at 32 prompts x 8 per GPU: SmolLM2 and a Qwen2.5-1.5B shape
#   OUT=out bash lab/recipes/multigpu.sh smollm2   # the SmolLM2 half of scaling again, + 2 one-GPU runs at once (--apart)
#   OUT=out bash lab/recipes/multigpu.sh fsdp7b    # a Qwen2.5-7B shape, full-parameter, FSDP2 over 2 GPUs, 5 steps
#   GSM8K_SRC=DIR OUT=out bash lab/recipes/multigpu.sh qwen   # the real 1.5B model ($QWEN_DIR) on GSM8K at the l40s
#                                                  # preset's batch (32 x 8 a GPU, no memory cap): 1 vs 2 GPUs, + 2 apart
# A random-weight model earns no reward: a k1 KL term makes every sequence train (k3's gradient is 0
# while policy = reference).
stage=$1
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
M=${SMOLLM2_DIR:-smollm2}
common="--gpu h200 --env multiply --digits 2,1 --fewshot 2 --max-tokens 128 --max-context 512 --n 8 --eval-limit 64"
case $stage in
smoke)
  rm -rf /tmp/smoke
  torchrun --nproc-per-node 2 -- train.py $common --model "$M" --prompts-per-step 32 --steps 2 --eval-every 2 \
    --out-dir /tmp/smoke > "$OUT/smoke.log" 2>&1; echo "smoke 2 ranks rc=$?"
  python train.py $common --model "$M" --prompts-per-step 32 --steps 3 --eval-every 0 --resume /tmp/smoke \
    --out-dir /tmp/smoke >> "$OUT/smoke.log" 2>&1; echo "resume on 1 rc=$?"
  grep -E "^step|^saved|resumed|Error|error" "$OUT/smoke.log" | tail -20 ;;
twonode)
  rm -rf /tmp/twonode
  # what two machines would each run, HOST:PORT being one of them; --local-addr: rank 0's address
  # for the other node's workers (here both nodes are this machine)
  rdzv="--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:${PORT:-29500} --rdzv-id twonode --local-addr 127.0.0.1"
  CUDA_VISIBLE_DEVICES=0,1 torchrun $rdzv -- train.py $common --model "$M" --prompts-per-step 32 --steps 2 --eval-every 2 \
    --out-dir /tmp/twonode > "$OUT/twonode.node0.log" 2>&1 & node0=$!
  CUDA_VISIBLE_DEVICES=2,3 torchrun $rdzv -- train.py $common --model "$M" --prompts-per-step 32 --steps 2 --eval-every 2 \
    --out-dir /tmp/twonode > "$OUT/twonode.node1.log" 2>&1 & node1=$!
  wait $node0; echo "node 0 (GPUs 0,1) rc=$?"
  wait $node1; echo "node 1 (GPUs 2,3) rc=$?"
  torchrun --nproc-per-node 2 -- train.py $common --model "$M" --prompts-per-step 32 --steps 3 --eval-every 0 \
    --resume /tmp/twonode --out-dir /tmp/twonode > "$OUT/twonode.log" 2>&1; echo "resume on 2 rc=$?"
  python train.py $common --model "$M" --prompts-per-step 32 --steps 4 --eval-every 0 --resume /tmp/twonode \
    --out-dir /tmp/twonode >> "$OUT/twonode.log" 2>&1; echo "resume on 1 rc=$?"
  cat "$OUT"/twonode.node[01].log "$OUT/twonode.log" | grep -E "^step|^saved|resumed|^torchrun|Error|error" | tail -20 ;;
scaling)
  python lab/bench.py --scaling 2 --model "$M" --out /tmp/scaling 2>&1 | tail -5
  python lab/bench.py --scaling 2 --model random-qwen2.5-1.5b --out /tmp/scaling 2>&1 | tail -5
  cp /tmp/scaling/scaling.json "$OUT/scaling.json"
  ;;
smollm2)
  python lab/bench.py --scaling 2 --apart --model "$M" --out /tmp/scaling2 2>&1 | tail -7
  cp /tmp/scaling2/scaling.json "$OUT/scaling-smollm2.json"; cp /tmp/scaling2/*.log "$OUT/" ;;
fsdp7b)
  python -c "from support import sources; print(sources.model_source('random-qwen2.5-7b'))"  # build the shape's folder once
  rm -rf /tmp/fsdp7b
  torchrun --nproc-per-node 2 -- train.py --gpu h200 --model random-qwen2.5-7b --shard fsdp --lora-rank 0 --env multiply \
    --digits 2,1 --fewshot 2 --max-tokens 64 --max-context 512 --prompts-per-step 16 --n 4 --kl-coef 0.001 --kl-type k1 \
    --steps 5 --eval-every 0 --save-every -1 --gpu-memory-utilization 0.3 --micro-batch-tokens 4096 \
    --viewer-groups 0 --out-dir /tmp/fsdp7b > "$OUT/fsdp7b.log" 2>&1; echo "fsdp7b rc=$?"
  cp /tmp/fsdp7b/metrics.jsonl "$OUT/fsdp7b.metrics.jsonl"
  grep -E "^step|memory|Error|error|torchrun" "$OUT/fsdp7b.log" | tail -20 ;;
qwen)
  [ -f data/out/gsm8k/train.jsonl ] || python data/gsm8k.py --src "${GSM8K_SRC:?set GSM8K_SRC}" --out data/out/gsm8k || exit 1
  python lab/bench.py --scaling 2 --apart --model "${QWEN_DIR:?set QWEN_DIR}" --out /tmp/scaling-qwen --step-flags="--gpu l40s \
    --env gsm8k --train-data data/out/gsm8k/train.jsonl --eval-data data/out/gsm8k/test.jsonl --max-tokens 512 \
    --max-context 2048 --fewshot 0 --kl-coef 0" 2>&1 | tail -7
  cp /tmp/scaling-qwen/scaling.json "$OUT/scaling-qwen.json" ;;
*) echo "usage: bash $0 smoke|twonode|scaling|smollm2|fsdp7b|qwen"; exit 2 ;;
esac
