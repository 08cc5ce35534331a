"""Is vLLM's generate faster with its engine core in a child process than in ours?

VLLMEngine runs vLLM in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0). This probe times
the same generate both ways, on a GPU, from the repository root:

    python lab/engine_process_probe.py MODEL_DIR 0            # in this process, as VLLMEngine runs it
    python lab/engine_process_probe.py MODEL_DIR 1            # vLLM's default: the engine core in a child process
    python lab/engine_process_probe.py MODEL_DIR 0 profile    # + a cProfile of one in-process generate

32 random-token prompts of 120-220 tokens x n = 8 x 256 sampled tokens (ignore_eos), 4 reps each
without and with logprobs, each rep after a level-2 sleep and wake as train.py did. It prints the
seconds of every rep as JSON. On an H100 with SmolLM2-135M (docs/results.md, 2026-11-23) the child
process was not faster, and the profile showed vLLM's scheduler in Python. It uses vLLM only,
nothing of the course. Checked against vLLM 0.26.0.
"""
import json
import os
import random
import sys
import time

if len(sys.argv) < 3 or sys.argv[2] not in ("0", "1"):
    sys.exit(__doc__)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = sys.argv[2]  # read when vLLM is imported: set it first
from vllm import LLM, SamplingParams  # noqa: E402

llm = LLM(model=sys.argv[1], gpu_memory_utilization=0.3, enable_sleep_mode=True, dtype="bfloat16",
          max_model_len=4096, seed=0, logprobs_mode="processed_logprobs")
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(120, 220))]} for _ in range(32)]
res = {}
for lp in (None, 0):
    sp = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=256, logprobs=lp, flat_logprobs=True,
                        detokenize=False, ignore_eos=True)
    ts = []
    for _ in range(4):
        llm.sleep(level=2)  # as train.py's loop did; the weights are garbage after level 2: fine for timing
        llm.wake_up()
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        ts.append(time.perf_counter() - t)
    res[f"logprobs={lp}"] = [round(x, 3) for x in ts]
print("MP", sys.argv[2], json.dumps(res), flush=True)
if len(sys.argv) > 3:
    import cProfile
    import pstats
    sp = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=256, detokenize=False, ignore_eos=True)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, sp, use_tqdm=False)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
