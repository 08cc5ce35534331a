"""Probe: vLLM generate time in-process (MP=0) vs engine core in its own process (MP=1).
python benchmarks/session8/engine_process_probe.py MODEL_DIR MP [profile]
(MP 0: in this process, as VLLMEngine runs it; 1: vLLM's default, the engine core in a child process)"""
import os, sys, time, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = sys.argv[2]
from vllm import LLM, SamplingParams
import random
llm = LLM(model=sys.argv[1], gpu_memory_utilization=0.3, enable_sleep_mode=True, dtype="bfloat16",
          max_model_len=4096, seed=0, logprobs_mode="processed_logprobs")
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(120, 220))] for _ in range(32)]
res = {}
for lp in (None, 0):
    sp = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=256, logprobs=lp, flat_logprobs=True,
                        detokenize=False, ignore_eos=True)
    ts = []
    for r in range(4):
        llm.sleep(level=2); llm.wake_up()  # as train.py does; weights garbage after level 2: fine for timing
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        ts.append(time.perf_counter() - t)
    res[f"logprobs={lp}"] = [round(x, 3) for x in ts]
print("MP", sys.argv[2], json.dumps(res), flush=True)
if len(sys.argv) > 3:
    import cProfile, pstats
    sp = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=256, detokenize=False, ignore_eos=True)
    pr = cProfile.Profile(); pr.enable()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
