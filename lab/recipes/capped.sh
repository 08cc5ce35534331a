#!/usr/bin/env bash
# Run a command as if the GPU had only CAP GiB: a second process holds the rest for the whole run
# (the memory-cap protocol: an L40S has ~45 GiB usable, an A100 40GB ~39 GiB). Prints the device's
# peak used memory (nvidia-smi, polled every 0.5 s; the hog included) when the command ends.
# Run from the repository root (docs/results.md has the 48 GB / 40 GB figures it measured):
#   bash lab/recipes/capped.sh 45 python train.py --env mcp --gpu l40s --gpu-memory-utilization 0.17 ...
# --gpu-memory-utilization is a fraction of the *whole* GPU: the l40s preset's 0.3 of 48 GB is
# 0.17 of an 80 GB H100, the a100 preset's 0.35 of 40 GB is 0.175.
set -u
cap=$1; shift
total=$(python -c "import torch; print(torch.cuda.mem_get_info()[1])")
hog=$(python -c "print(int($total - $cap * 2**30 - 600 * 2**20))")
python -c "import torch, time; x = torch.empty($hog, dtype=torch.uint8, device='cuda'); print('hog holds', round($hog / 2**30, 1), 'GiB', flush=True); time.sleep(36000)" &
HOG=$!
until [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)" -ge $((hog / 1048576)) ]; do sleep 1; done
peak=/tmp/capped-peak.$$
( while kill -0 $HOG 2>/dev/null; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; sleep 0.5; done > $peak ) &
POLL=$!
"$@"
rc=$?
kill $HOG; wait $HOG 2>/dev/null; kill $POLL 2>/dev/null
echo "capped.sh: cap $cap GiB, device peak used $(sort -n $peak | tail -1) MiB (hog $((hog / 2**20)) MiB), exit $rc"
rm -f $peak
exit $rc
