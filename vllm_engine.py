"""
vLLM in this process, on the trainer's GPU: the engine (VLLMEngine). The engine owns all the
state of the weight sync (the recorded plans, whether its weights are stale or its prefix cache
empty, the probe prompts, the check schedule); the stateless functions that copy and check are
sync.py. These two files hold every vLLM internal the toolkit touches (checked against vLLM 0.26.0).

    engine = VLLMEngine(model_dir, gpu_memory_utilization=0.3, sleep_level=2, max_model_len=4096)
    engine.load_weights(model)    # wake, sync.push, prefix-cache reset, sync.check when scheduled
    outs = engine.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=512)
    engine.sleep()                                # give the GPU back to the trainer

vLLM internals used here:
  - `LLM.sleep(level)` / `wake_up()` (enable_sleep_mode), `llm_engine.model_config.dtype`,
    `llm_engine.vllm_config.cache_config.enable_prefix_caching`, `llm_engine.engine_core.shutdown()`,
    the in-process executor's `sleeping_tags` / `is_sleeping` (set by sleep() when vLLM's memory
    check trips), that `EngineCore.sleep(level >= 1)` resets the prefix cache (it pauses the
    scheduler with clear_cache=True; load_weights relies on it), `LLM.reset_prefix_cache()`,
    `vllm.distributed.parallel_state.cleanup_dist_env_and_memory`, SamplingParams'
    `flat_logprobs` / `detokenize`, and `logprobs_mode="processed_logprobs"` (VLLMEngine's doc).

Test: python -m pytest -q -m gpu tests/test_gpu.py      (GPU + vLLM; skipped elsewhere)
Bench: python lab/bench.py --model smollm2 --out runs/bench.json
"""
import os
import time

import torch

import sync
from rollout import Completion, Engine


class VLLMEngine(Engine):
    """vLLM in this process, on the trainer's GPU: token ids in, token ids + logprobs out.

    Colocation: `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the V1 engine core in this process, so
    the sync below can hand the trainer's CUDA tensors straight to the vLLM model; gpu_memory_utilization
    is the share of the GPU vLLM may take (weights + KV cache), the rest is the trainer's.

    Sleep (`enable_sleep_mode=True`; vLLM's CuMem allocator owns the engine's memory):
      level 1  weights offloaded to CPU, KV cache dropped       (~0.5-2 s to sleep, measured)
      level 2  weights and KV cache dropped                     (~0.05 s)
      level 0  no sleep mode: the engine keeps its memory
    Level 2 is safe here because every wake is followed by a sync that rewrites all weights;
    generate() refuses to run on discarded weights until load_weights() has run. Sleeping also
    clears the prefix cache (vLLM 0.26 EngineCore.sleep pauses the scheduler with clear_cache).

    Logprobs: `logprobs_mode="processed_logprobs"` makes vLLM report log_softmax of the logits
    *after* temperature (and top-k/top-p, which we leave off: top_p = 1 in RL runs), i.e. our
    convention; the default "raw_logprobs" would be at temperature 1. For greedy requests vLLM
    reports log_softmax(logits), as HFEngine does.
    Speed: detokenize=False (no incremental detokenizer, and vLLM 0.26 then also skips decoding
    the logprob tokens) and flat_logprobs=True (a few flat lists per request instead of one
    dict + Logprob object per token) win back most of what logprobs cost; the cyclic GC is
    paused during generate().
    Stop strings need detokenization, so only stop *token ids* are supported; the stop token
    (EOS or one of stop_token_ids) is included in token_ids, as in HFEngine.
    """

    def __init__(self, model_path, gpu_memory_utilization=0.3, sleep_level=2, dtype="bfloat16",
                 max_model_len=4096, seed=0, probe_n=4, probe_tokens=32, check_threshold=None, quant="none",
                 check_every=1, llm=None, **llm_kwargs):
        """llm=None starts vLLM's LLM; tests/test_sync.py passes a CPU stand-in with the same methods."""
        # must be set before the engine is built (vllm.envs reads it lazily); in-process is what
        # makes the zero-copy sync below possible, so we force it rather than default it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"VLLMEngine: sleep_level must be 0, 1 or 2, got {sleep_level}")
        if quant not in sync.CHECK_THRESHOLD:
            raise ValueError(f"VLLMEngine: quant must be one of {list(sync.CHECK_THRESHOLD)}, got {quant!r}")
        if quant == "fp8":  # vLLM's online fp8 (Fp8Config -> Fp8PerTensorOnlineLinearMethod)
            llm_kwargs["quantization"] = "fp8"
        # int8: model_path is a compressed-tensors W8A8 checkpoint (quant.save_int8_checkpoint)
        self.quant, self.quant_plan = quant, None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun (dist.py): one engine per rank, on its GPU.
            # vLLM's torchrun executor takes RANK/LOCAL_RANK from the environment and joins the
            # process group we opened; with tensor parallel 1 every rank is its own "external data
            # parallel" replica (vLLM 0.26 parallel_state) and generates on its own prompts
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        if llm is None:
            from vllm import LLM
            llm = LLM(model=str(model_path), gpu_memory_utilization=gpu_memory_utilization,
                      enable_sleep_mode=sleep_level > 0, dtype=dtype, max_model_len=max_model_len,
                      seed=seed, logprobs_mode="processed_logprobs", **llm_kwargs)
        self.llm = llm
        self.torch_dtype = self.llm.llm_engine.model_config.dtype  # the resolved torch dtype
        # enable_prefix_caching=False (--no-prefix-caching): no KV is ever reused, nothing to reset
        self.prefix_caching = self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        self.max_model_len = max_model_len
        self.sleep_level = sleep_level
        self.asleep = False
        self.weights_stale = False  # True after a level-2 sleep until the next load_weights
        self.cache_empty = False    # True after a level-1/2 sleep until the next generate (load_weights)
        # sync.check: the first prompts ever generated become the fixed probe batch
        self.probe_prompts, self.probe_n, self.probe_tokens = [], probe_n, probe_tokens
        self.check_threshold = sync.CHECK_THRESHOLD[quant] if check_threshold is None else check_threshold
        self.sync_plan = None  # sync.push's copy plan (None: record on the first sync; False: none possible)
        self.check_every, self.syncs, self.checks = check_every, 0, 0  # load_weights' check schedule
        self.pause_gc = True   # see generate()
        self.stats = {}  # the last phase-switch timings, merged into load_weights' stats

    def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True,
                 ignore_eos=False):
        """Engine.generate; ignore_eos (bench only) samples exactly max_tokens per completion.

        logprobs=False leaves them out of SamplingParams: vLLM then skips a full-vocabulary
        log_softmax, the rank count and the per-token bookkeeping, and generates as fast as its
        own text path does (lab/bench.py). train.py asks for them only when something reads them
        (--old-logprobs rollout, --tis-cap, --rollout-logprobs), like verl's
        rollout.calculate_log_probs, which is off by default."""
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
                            flat_logprobs=True,
                            detokenize=False, ignore_eos=ignore_eos)
        # Python's cyclic GC pauses the engine loop every few thousand allocations (and now and then
        # for a full pass over the heap). Most of what a call allocates is freed by refcount; cyclic
        # garbage waits for the next collection after the call. pause_gc=False measures without.
        import gc
        gc_was_on = self.pause_gc and gc.isenabled()
        if gc_was_on:
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
            # vLLM 0.26's worker checks, after freeing its memory, that the GPU's free memory grew;
            # another process on the same GPU (runs sharing one card) can allocate meanwhile. The
            # memory is freed by then; only the executor's sleep flags, set after the check, are missing
            if "Memory usage increased after sleeping" not in str(e):
                raise
            executor = self.llm.llm_engine.engine_core.engine_core.model_executor  # InprocClient -> EngineCore
            executor.sleeping_tags, executor.is_sleeping = {"weights", "kv_cache"}, True
        self.asleep = True
        self.weights_stale = self.sleep_level == 2
        # vLLM 0.26 EngineCore.sleep(level >= 1) pauses the scheduler with clear_cache=True, which
        # resets the prefix cache (before the worker frees memory, so also when the assert above fired)
        self.cache_empty = True
        self.stats["sleep_ms"] = 1000 * (time.perf_counter() - t0)
        return {"sleep_ms": self.stats["sleep_ms"]}

    def wake(self):
        if not self.asleep:
            return {}
        t0 = time.perf_counter()
        # the trainer's caching allocator keeps freed blocks reserved, and vLLM's CuMem pool
        # cannot use them: give them back first (costs the allocator a re-grow on the next step)
        torch.cuda.empty_cache()
        try:
            self.llm.wake_up()
        except RuntimeError as e:  # vLLM 0.26: "CUDA Error: out of memory at cumem_allocator.cpp"
            if "out of memory" not in str(e).lower():
                raise
            free, total = torch.cuda.mem_get_info()
            raise RuntimeError(
                f"waking vLLM ran out of GPU memory ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free, the "
                f"trainer holds {torch.cuda.memory_allocated() / 2**30:.1f} GiB): lower --gpu-memory-utilization, "
                "or use --grad-checkpointing / --logprob-chunk 1024 / a smaller --micro-batch-size or model") from e
        self.asleep = False
        self.stats["wake_ms"] = 1000 * (time.perf_counter() - t0)
        return {"wake_ms": self.stats["wake_ms"]}

    def load_weights(self, model, check=None):
        """Wake, push, reset the prefix cache, check; returns the sync's stats, raises if it is broken.

        check=None: by schedule: the first sync that has probe prompts, any sync that did not replay
        the recorded copy plan (the first, or tensors whose names or shapes changed) and every
        check_every-th sync (check_every <= 1: every sync); True/False force it. The check is
        ~120-160 ms of a ~170 ms sync at 135M-1.5B (lab/bench.py), the copies are the rest."""
        self.wake()  # a sync into discarded/offloaded memory would be lost
        t0 = time.perf_counter()
        stats, self.sync_plan, self.quant_plan = sync.push(self.llm, model, self.torch_dtype, self.sync_plan,
                                                           self.quant, self.quant_plan)
        t1 = time.perf_counter()
        # else KV computed with the old weights is reused (sync.py's doc); not twice after a sleep, which
        # emptied the cache, and never without a prefix cache (--no-prefix-caching: no KV is reused)
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

    def close(self):
        """Free the GPU memory and vLLM's process-global state, so another engine can start here."""
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        # Shutting down a sleeping engine frees memory that sleep already unmapped: vLLM 0.26's
        # cumem allocator reports "CUDA Error: invalid argument" and the process hung (seen on an
        # H100, 2026-11-22). Waking first costs ~0.1 s.
        self.wake()
        self.llm.llm_engine.engine_core.shutdown()  # vLLM 0.26: LLMEngine has no shutdown(); its client has
        self.llm = None
        self.sync_plan = self.quant_plan = None  # views into the freed parameters
        cleanup_dist_env_and_memory()


def start_engine(model, tokenizer, src, quant="none", **kwargs):
    """A VLLMEngine for the trainer's `model`, started from the HF folder src; quant="int8": from a
    W8A8 copy of `model` (quant.save_int8_checkpoint) in a temp folder, deleted once vLLM has read
    it (every sync rewrites those weights anyway)."""
    if quant != "int8":
        return VLLMEngine(src, quant=quant, **kwargs)
    import shutil
    import tempfile
    import quant as q
    folder = q.save_int8_checkpoint(model, tokenizer, tempfile.mkdtemp(prefix="nanorl-int8-"))
    try:
        return VLLMEngine(folder, quant=quant, **kwargs)
    finally:  # read, or failed: never left in /tmp
        shutil.rmtree(folder, ignore_errors=True)


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
