"""Trainer -> vLLM weight sync, in-process, and the check that it happened.

The trainer (a transformers model) and the vLLM engine live in one Python process on one GPU
(VLLMEngine in rollout.py starts vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0). So a sync is a
device-to-device copy and nothing more: no NCCL group, no serialisation, no checkpoint on disk.

    for each bucket of (hf_name, tensor) pairs, <= bucket_mb of engine-dtype bytes:
        llm.apply_model(lambda m: m.load_weights(bucket))   # vLLM's own HF-name loader
    llm.reset_prefix_cache()
    check: |logp_engine - logp_trainer| on a fixed probe batch

Where the code touches vLLM internals (checked against vLLM 0.26.0):
  - `LLM.apply_model(fn)` -> `LLMEngine.apply_model` -> `collective_rpc("apply_model")` ->
    `WorkerBase.apply_model(fn)` = `fn(worker.get_model())`. With the in-process engine
    (`UniProcExecutor`, multiprocessing off) `fn` runs in this thread and is never pickled, so it
    may close over the trainer's CUDA tensors.
  - `model.load_weights(iterable of (hf_name, tensor))` (LlamaForCausalLM / Qwen2ForCausalLM)
    takes Hugging Face names, fuses q/k/v -> qkv_proj and gate/up -> gate_up_proj itself, copies
    *into* the existing parameters (`param.data.copy_`, so CUDA graphs stay valid and the copy
    casts dtype), and returns the set of vLLM parameter names it filled. With
    tie_word_embeddings it skips "lm_head.*" (vLLM's lm_head *is* embed_tokens), and so do we.

Choices
  - Buckets: in-process a single call would do; we bucket so that (a) a dtype cast (fp32 trainer
    -> bf16 engine) never holds more than one bucket of temporaries, and (b) the same code would
    work over `collective_rpc` with one message per bucket. Tensors already in the engine dtype are
    passed as they are (zero copies beyond the one into vLLM's parameter).
  - Prefix cache: vLLM keeps KV blocks keyed by token-prefix hashes across requests. After new
    weights, any prompt seen before would reuse KV computed with the *old* weights (measured on
    an H200, SmolLM2: mean |dlogp| 0.17 without the reset vs 0.041 with it; shared/device/README).
    A sync is only finished after `llm.reset_prefix_cache()`.
  - The check: silent non-syncs (wrong names, a stale cache, weights never copied) are a known
    failure of RL frameworks. After every sync the engine samples a few tokens on a fixed probe
    batch (prompts it has seen before, so a stale prefix cache would show), the trainer scores the
    same tokens, and we log mean / p95 / max of |logp_engine - logp_trainer| at temperature 1.
    mean > threshold (0.1) raises. Healthy bf16 engine vs trainer: mean ~0.03-0.045, p95 ~0.13;
    a broken sync: 0.17 (stale cache) .. 0.8. It cannot see a sync that was skipped after a tiny
    update (the old and new policies agree within the bf16 noise then); the name check catches
    the structural failures: every vLLM parameter must be among the names load_weights filled.

Test: python -m pytest -q -m gpu tests/test_gpu.py    (GPU + vLLM; skipped elsewhere)
Bench: python bench.py --model smollm2 --out runs/bench.json
"""
import time

import numpy as np
import torch

import grpo


def unwrap(model):
    """The plain HF module under torch.compile (OptimizedModule._orig_mod), whose names vLLM knows."""
    return getattr(model, "_orig_mod", model)


def trainer_weights(model):
    """(hf_name, tensor) pairs to send: the state dict, tied lm_head dropped, each storage once."""
    model = unwrap(model)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    seen = set()
    out = []
    for name, t in model.state_dict().items():
        if tied and name.startswith("lm_head."):
            continue  # vLLM skips it too when tied; sending it would only cost a copy
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key in seen:  # another name for a tensor we already send (tied aliases)
            continue
        seen.add(key)
        out.append((name, t))
    return out


def buckets(weights, dtype, bucket_bytes):
    """Group (name, tensor) into lists of at most bucket_bytes (engine dtype); a bigger tensor is alone."""
    item = torch.empty((), dtype=dtype).element_size()
    cur, size = [], 0
    for name, t in weights:
        b = t.numel() * item
        if cur and size + b > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += b
    if cur:
        yield cur


def _cuda_sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def push_weights(llm, model, dtype, bucket_mb=512):
    """Copy the trainer's weights into the in-process vLLM model; returns stats (ms, bytes, names)."""
    _cuda_sync()
    t0 = time.perf_counter()
    weights = trainer_weights(model)
    loaded, nbytes, nbuckets = set(), 0, 0
    for bucket in buckets(weights, dtype, bucket_mb * 2**20):
        # cast only what needs it; the cast temporaries live for one bucket
        bucket = [(n, t if t.dtype == dtype else t.to(dtype)) for n, t in bucket]
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        # apply_model returns one result per worker (one here): the set of filled vLLM names
        for names in llm.apply_model(lambda m, b=bucket: m.load_weights(weights=b)):
            loaded |= set(names or ())
        nbuckets += 1
    _cuda_sync()  # the copies are queued on the stream; time their completion
    ms = 1000 * (time.perf_counter() - t0)
    expected = set(llm.apply_model(lambda m: [n for n, _ in m.named_parameters()])[0])
    return {"push_ms": ms, "bytes": nbytes, "n_tensors": len(weights), "n_buckets": nbuckets,
            "gbps": nbytes / 1e9 / max(ms / 1000, 1e-9), "missing": sorted(expected - loaded)}


@torch.no_grad()
def trainer_logprobs(model, prompts, completions, temperature=1.0):
    """Per-token logprobs (list of lists) of each completion after its prompt under the trainer."""
    model = unwrap(model)
    dev = next(model.parameters()).device
    seqs = [p + c for p, c in zip(prompts, completions)]
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros((B, T), dtype=torch.long, device=dev)
    attn = torch.zeros((B, T), dtype=torch.long, device=dev)
    for i, s in enumerate(seqs):  # right padding: positions 0..len-1 are the real ones
        ids[i, :len(s)] = torch.tensor(s, device=dev)
        attn[i, :len(s)] = 1
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, attention_mask=attn).logits  # (B, T, V)
    finally:
        model.train(was_training)
    logp = grpo.token_logprobs(logits[:, :-1], ids[:, 1:], temperature)  # (B, T-1): token t+1 given <= t
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        out.append(logp[i, len(p) - 1:len(p) - 1 + len(c)].tolist())
    return out


def logprob_delta(engine_lps, trainer_lps):
    """mean / p95 / max of |engine - trainer| over all tokens, and the token count."""
    d = np.abs(np.concatenate([np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
                               for a, b in zip(engine_lps, trainer_lps)]))
    if d.size == 0:
        return {"dlogp_mean": float("nan"), "dlogp_p95": float("nan"), "dlogp_max": float("nan"), "probe_tokens": 0}
    return {"dlogp_mean": float(d.mean()), "dlogp_p95": float(np.percentile(d, 95)),
            "dlogp_max": float(d.max()), "probe_tokens": int(d.size)}


def probe(engine, model, prompts, max_tokens=32, temperature=1.0):
    """Sample from the engine on `prompts`, score the same tokens with the trainer at the same temperature."""
    outs = engine.generate(prompts, n=1, temperature=temperature, top_p=1.0, max_tokens=max_tokens)
    comps = [o[0] for o in outs]
    keep = [i for i, c in enumerate(comps) if c.token_ids]
    e_lps = [comps[i].logprobs for i in keep]
    t_lps = trainer_logprobs(model, [prompts[i] for i in keep], [comps[i].token_ids for i in keep], temperature)
    return logprob_delta(e_lps, t_lps)


def check(engine, model, threshold=0.1):
    """Engine vs trainer logprobs on the engine's probe prompts; raises if mean |dlogp| > threshold."""
    if not engine.probe_prompts:  # nothing generated yet: no probe batch to check on
        return {}
    t0 = time.perf_counter()
    stats = probe(engine, model, engine.probe_prompts, engine.probe_tokens)
    stats["check_ms"] = 1000 * (time.perf_counter() - t0)
    if not stats["dlogp_mean"] <= threshold:  # also catches NaN
        raise RuntimeError(
            f"weight sync check failed: engine vs trainer mean |dlogp| {stats['dlogp_mean']:.3f} "
            f"(p95 {stats['dlogp_p95']:.3f}) > {threshold} on {stats['probe_tokens']} probe tokens; "
            "the engine is not sampling from the trainer's weights")
    return stats


def sync_weights(engine, model, check_logprobs=True, threshold=0.1, bucket_mb=512):
    """The whole sync for a VLLMEngine: push, reset the prefix cache, check. Returns stats; raises if broken."""
    t0 = time.perf_counter()
    stats = push_weights(engine.llm, model, engine.torch_dtype, bucket_mb)
    missing = stats.pop("missing")
    if missing:
        raise RuntimeError(f"weight sync: {len(missing)} vLLM parameters were not filled by load_weights "
                           f"(name mismatch between the trainer and vLLM?), e.g. {missing[:5]}")
    t1 = time.perf_counter()
    engine.llm.reset_prefix_cache()  # else KV computed with the old weights is reused (module doc)
    stats["reset_ms"] = 1000 * (time.perf_counter() - t1)
    engine.weights_stale = False
    if check_logprobs:
        stats.update(check(engine, model, threshold))
    stats["ms"] = 1000 * (time.perf_counter() - t0)
    return stats


def copy_floor_ms(nbytes, device="cuda", reps=5):
    """The floor for a sync: median ms of one plain same-GPU copy of nbytes (bench.py's reference)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    del src, dst
    return float(np.median(times))
