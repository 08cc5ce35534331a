"""
vLLM in this process, on the trainer's GPU: the engine (VLLMEngine). It owns all the state of
the weight sync (plans, stale weights or an empty prefix cache, probe prompts, check schedule);
sync.py copies and checks, statelessly. These two files hold every vLLM internal the toolkit
touches (checked against vLLM 0.26.0), each named in a comment where it is used.

    engine = VLLMEngine(model_dir, gpu_memory_utilization=0.3, sleep_level=2, max_model_len=4096)
    engine.load_weights(model)    # wake, push (sync.push), prefix-cache reset, sync.check when scheduled
    outs = engine.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=512)
    engine.sleep()                                # give the GPU back to the trainer

Test: python -m pytest -q -m gpu tests/test_gpu.py      (GPU + vLLM; skipped elsewhere)
Bench: python lab/bench.py --model smollm2 --out runs/bench.json
"""
import gc
import os
import time

import torch

import sync
from rollout import Completion, Engine


def compile_cache_root(environ):
    """Under torchrun: vLLM's cache root for this process, one folder per CUDA device index (LOCAL_RANK,
    the index support/dist.World takes), so that a graph is only ever loaded on the index it was compiled
    for. vLLM 0.26 (torch >= 2.10: VLLM_USE_AOT_COMPILE) saves each compiled model under
    $VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/rank_<rank>_<dp index>/ (vllm/compilation/
    decorators.py), and neither the hash nor the folder names the device index: after a 4-GPU run, a
    two-node launch on the same host (CUDA_VISIBLE_DEVICES=2,3: global ranks 2 and 3 on cuda:0 and
    cuda:1) loaded graphs compiled on cuda:2 and cuda:3 and died with "CUDA error: invalid device
    ordinal". Inside one folder the graphs reuse across runs as before; a single process (cuda:0) keeps
    vLLM's own root. A VLLM_CACHE_ROOT set by the user is the base."""
    base = os.path.expanduser(environ.get("VLLM_CACHE_ROOT", "~/.cache/vllm"))
    leaf = f"torchrun-cuda{int(environ.get('LOCAL_RANK', '0'))}"
    return base if os.path.basename(base) == leaf else os.path.join(base, leaf)  # set once per process


class VLLMEngine(Engine):
    """vLLM in this process, on the trainer's GPU: token ids in, token ids + logprobs out.

    Colocation: `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the V1 engine core in this process, so
    the sync can hand the trainer's CUDA tensors straight to the vLLM model; gpu_memory_utilization
    is vLLM's share of the GPU (weights + KV cache), the rest is the trainer's.
    Sleep (enable_sleep_mode; vLLM's CuMem allocator owns the engine's memory): level 1 offloads
    the weights to CPU and drops the KV cache, level 2 drops both (safe: every wake is followed by
    a sync that rewrites all weights; generate() refuses stale weights), level 0 keeps them.
    Logprobs: `logprobs_mode="processed_logprobs"` reports log_softmax *after* temperature (top_p
    = 1 in RL runs), our convention; greedy requests get log_softmax(logits), as in HFEngine;
    detokenize=False and flat_logprobs=True win back most of what logprobs cost.
    Stop strings need detokenization, so only stop *token ids* are supported; the stop token
    (EOS or one of stop_token_ids) is included in token_ids, as in HFEngine.
    """

    def __init__(self, model_path, gpu_memory_utilization=0.3, sleep_level=2, dtype="bfloat16",
                 max_model_len=4096, seed=0, probe_n=4, probe_tokens=32, check_threshold=sync.CHECK_THRESHOLD,
                 check_every=1, llm=None, **llm_kwargs):
        """llm=None starts vLLM's LLM; tests/test_rollout.py passes a CPU stand-in with the same methods."""
        # before the engine is built (vllm.envs reads it lazily); forced: the zero-copy sync needs it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"VLLMEngine: sleep_level must be 0, 1 or 2, got {sleep_level}")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun (support/dist.py): one engine per rank.
            # vLLM's torchrun executor joins our process group; with tensor parallel 1 every rank is
            # its own "external data parallel" replica (vLLM 0.26 parallel_state) on its own prompts
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
            os.environ["VLLM_CACHE_ROOT"] = compile_cache_root(os.environ)  # before vLLM reads it (its compile)
        if llm is None:
            from vllm import LLM
            llm = LLM(model=str(model_path), gpu_memory_utilization=gpu_memory_utilization,
                      enable_sleep_mode=sleep_level > 0, dtype=dtype, max_model_len=max_model_len,
                      seed=seed, logprobs_mode="processed_logprobs", **llm_kwargs)
        self.llm = llm
        self.torch_dtype = self.llm.llm_engine.model_config.dtype  # the resolved torch dtype
        # enable_prefix_caching=False: no KV is ever reused, nothing to reset
        self.prefix_caching = self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        self.max_model_len, self.sleep_level, self.asleep = max_model_len, sleep_level, False
        self.weights_stale = False  # True after a level-2 sleep until the next load_weights
        self.cache_empty = False    # True after a level-1/2 sleep until the next generate (load_weights)
        # sync.check: the first prompts ever generated become the fixed probe batch
        self.probe_prompts, self.probe_n, self.probe_tokens = [], probe_n, probe_tokens
        self.check_threshold = check_threshold  # sync.check's limit on mean |dlogp|
        self.sync_plan = None  # sync.push's copy plan (None: record on the first sync; False: none possible)
        self.check_every, self.syncs, self.checks = check_every, 0, 0  # load_weights' check schedule
        self.stats = {}  # the last phase-switch timings, merged into load_weights' stats

    def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True,
                 ignore_eos=False):
        """Engine.generate; ignore_eos (--ignore-eos) samples exactly max_tokens per completion.
        logprobs=False: vLLM skips a full-vocabulary log_softmax (train.py asks only when needed)."""
        from vllm import SamplingParams
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate while asleep: call wake() first")
        if self.weights_stale:
            raise RuntimeError("VLLMEngine.generate after a level-2 sleep: weights were discarded; "
                               "call load_weights(model) after wake()")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("VLLMEngine.generate: empty prompt")
        self.cache_empty = False  # this call's prompts enter the prefix cache
        if not self.probe_prompts:  # keep short ones: the probe should cost milliseconds
            short = [list(p) for p in prompts if len(p) + self.probe_tokens <= min(512, self.max_model_len)]
            self.probe_prompts = short[:self.probe_n]
        sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                            stop_token_ids=list(stop_token_ids or []), logprobs=0 if logprobs else None,
                            flat_logprobs=True, detokenize=False, ignore_eos=ignore_eos)
        # the cyclic GC would pause the engine loop every few thousand allocations; what a call
        # allocates is mostly freed by refcount, the rest waits for the next collection
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        finally:
            if gc_was_on:
                gc.enable()
        res = []
        for ro in outs:  # LLM.generate returns outputs in prompt order
            comps = []
            for o in sorted(ro.outputs, key=lambda o: o.index):
                ids = list(o.token_ids)
                lps = _sampled_logprobs(o.logprobs, len(ids)) if logprobs else None
                comps.append(Completion(token_ids=ids, logprobs=lps,
                                        finish_reason="stop" if o.finish_reason == "stop" else "length"))
            res.append(comps)
        return res

    def sleep(self):
        if self.sleep_level == 0 or self.asleep:
            return {}
        t0 = time.perf_counter()
        try:
            self.llm.sleep(level=self.sleep_level)
        except AssertionError as e:
            # vLLM 0.26's worker checks, after freeing its memory, that the GPU's free memory grew; another
            # process on the card can allocate meanwhile. Freed by then: only the executor's flags are missing
            if "Memory usage increased after sleeping" not in str(e):
                raise
            executor = self.llm.llm_engine.engine_core.engine_core.model_executor  # InprocClient -> EngineCore
            executor.sleeping_tags, executor.is_sleeping = {"weights", "kv_cache"}, True
        self.asleep = True
        self.weights_stale = self.sleep_level == 2
        # vLLM 0.26 EngineCore.sleep(level >= 1) clears the prefix cache first (so also if the assert fired)
        self.cache_empty = True
        self.stats["sleep_ms"] = 1000 * (time.perf_counter() - t0)
        return {"sleep_ms": self.stats["sleep_ms"]}

    def wake(self):
        if not self.asleep:
            return {}
        t0 = time.perf_counter()
        # vLLM's CuMem pool cannot use the blocks torch's caching allocator keeps reserved: free them
        torch.cuda.empty_cache()
        # the trainer's memory, read before the wake: vLLM's pool allocates through torch's allocator, so a
        # failed wake's count also holds what it mapped (43.2 GiB read for a ~20 GiB trainer and 23 GiB engine)
        held = torch.cuda.memory_allocated()
        try:
            self.llm.wake_up()
        except RuntimeError as e:  # vLLM 0.26: "CUDA Error: out of memory at cumem_allocator.cpp"
            if "out of memory" not in str(e).lower():
                raise
            free, total = torch.cuda.mem_get_info()
            raise RuntimeError(
                f"waking vLLM ran out of GPU memory ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free, the "
                f"trainer holds {held / 2**30:.1f} GiB): lower --gpu-memory-utilization, "
                "or use --grad-checkpointing / --logprob-chunk 1024 / a smaller --micro-batch-size or model") from e
        self.asleep = False
        self.stats["wake_ms"] = 1000 * (time.perf_counter() - t0)
        return {"wake_ms": self.stats["wake_ms"]}

    def load_weights(self, model, check=None):
        """Wake, push, reset the prefix cache, check; returns the sync's stats, raises if it is broken.
        check=None: the first sync with probe prompts, any sync that did not replay the copy plan,
        and every check_every-th sync (check_every <= 1: every sync); True/False force it."""
        self.wake()  # a sync into discarded/offloaded memory would be lost
        t0 = time.perf_counter()
        stats = self.push(model)
        t1 = time.perf_counter()
        # else KV of the old weights is reused (sync.py); not after a sleep emptied it, nor without a cache
        if self.prefix_caching and not self.cache_empty:
            self.llm.reset_prefix_cache()
        stats["reset_ms"] = 1000 * (time.perf_counter() - t1)
        self.weights_stale = False
        if check is None:
            check = (not self.checks or self.check_every <= 1 or self.syncs % self.check_every == 0
                     or stats["path"] != "fast")
        if check:
            stats.update(sync.check(self.generate, model, self.probe_prompts, self.check_threshold,
                                    self.probe_tokens, self.torch_dtype))
        stats["ms"] = 1000 * (time.perf_counter() - t0)
        self.syncs += 1
        self.checks += "dlogp_mean" in stats
        stats.update(self.stats)
        return stats

    def push(self, model):
        """sync.push of every trainer weight, its copy plan kept for the next sync; returns its stats.
        An engine that sends some weights its own way (an 8-bit one) overrides this."""
        stats, self.sync_plan = sync.push(self.llm, model, self.torch_dtype, self.sync_plan)
        return stats

    def close(self):
        """Free the GPU memory and vLLM's process-global state, so another engine can start here."""
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        self.wake()  # shutting down asleep frees unmapped memory: vLLM 0.26's cumem allocator hangs
        self.llm.llm_engine.engine_core.shutdown()  # vLLM 0.26: LLMEngine has no shutdown(); its client has
        self.llm = None
        self.sync_plan = None  # views into the freed parameters
        cleanup_dist_env_and_memory()


def _sampled_logprobs(lp, n_tokens):
    """The sampled token's logprob per position from vLLM's logprobs=0 output (FlatLogprobs or list of dicts)."""
    if lp is None:
        raise RuntimeError("vLLM returned no logprobs (was logprobs=0 dropped from SamplingParams?)")
    if hasattr(lp, "start_indices"):  # FlatLogprobs: the sampled token is first at each position
        vals = [lp.logprobs[s] for s in lp.start_indices]
    else:
        vals = [next(iter(d.values())).logprob for d in lp]
    if len(vals) != n_tokens:
        raise RuntimeError(f"vLLM returned {len(vals)} logprobs for {n_tokens} tokens")
    return vals
