"""Trainer -> vLLM weight sync, in-process, and the check that it happened.

The trainer (a transformers model) and the vLLM engine live in one Python process on one GPU
(VLLMEngine in rollout.py starts vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0). So a sync is a
device-to-device copy and nothing more: no NCCL group, no serialisation, no checkpoint on disk.

    first sync:  for each bucket of (hf_name, tensor) pairs, <= bucket_mb of engine-dtype bytes:
                     llm.apply_model(lambda m: m.load_weights(bucket))   # vLLM's own HF-name loader
                 while recording each Tensor.copy_(dst, src) the loaders run -> a copy plan
    later syncs: torch._foreach_copy_(plan dsts, trainer tensors)      # the same copies, one call
    every sync:  llm.reset_prefix_cache()
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
  - The copy plan: vLLM's load_weights is a Python loop over names with a weight_loader per
    parameter (~60 us per tensor; 16 ms for SmolLM2's 272 tensors, 100x a plain copy of the same
    bytes). Its effect, for unquantized single-GPU models, is one plain copy per trainer tensor into
    a view of a vLLM parameter. We record those copies once (a TorchFunctionMode around
    load_weights), keep the plan only if every trainer tensor went by exactly one full copy and
    vLLM's parameters then equal the cast trainer tensors bit for bit, and replay it with a single
    torch._foreach_copy_. Anything else (quantized weights, tensor parallel slices, permuting
    loaders) fails those checks and stays on load_weights every time.
  - Prefix cache: vLLM keeps KV blocks keyed by token-prefix hashes across requests. After new
    weights, any prompt seen before would reuse KV computed with the *old* weights (measured on
    an H200, SmolLM2: mean |dlogp| 0.17 without the reset vs 0.041 with it; shared/device/README).
    A sync is only finished after `llm.reset_prefix_cache()`.
  - The check: silent non-syncs (wrong names, a stale cache, weights never copied) are a known
    failure of RL frameworks. After every sync the engine samples a few tokens on a fixed probe
    batch (prompts it has seen before, so a stale prefix cache would show), the trainer scores the
    same tokens (under bf16 autocast, see check()), and we log mean / p95 / max of
    |logp_engine - logp_trainer| at temperature 1.
    mean > threshold (0.1) raises. Healthy bf16 engine vs trainer: mean ~0.03-0.045, p95 ~0.13;
    a broken sync: 0.17 (stale cache) .. 0.8. It cannot see a sync that was skipped after a tiny
    update (the old and new policies agree within the bf16 noise then); the name check catches
    the structural failures: every vLLM parameter must be among the names load_weights filled.

Test: python -m pytest -q -m gpu tests/test_gpu.py    (GPU + vLLM; skipped elsewhere)
Bench: python bench.py --model smollm2 --out runs/bench.json
"""
import contextlib
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


def _key(t):
    """Identity of a tensor's data: a full-extent view (e.g. narrow(0, 0, n)) has the same key."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _RecordCopies(torch.overrides.TorchFunctionMode):
    """Records every Tensor.copy_(dst, src) run inside (vLLM's weight loaders end in one)."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.copies.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


def push_weights(llm, model, dtype, bucket_mb=512, record=False):
    """Copy the trainer's weights into the in-process vLLM model through vLLM's load_weights.

    Returns stats (ms, bytes, names vLLM did not fill); with record=True also "plan": for each
    trainer tensor, the view of the vLLM parameter that load_weights copied it into (or None if
    some loader did more than one plain copy per tensor, see push_fast).
    """
    _cuda_sync()
    t0 = time.perf_counter()
    weights = trainer_weights(model)
    loaded, nbytes, nbuckets, plan = set(), 0, 0, {}
    for bucket in buckets(weights, dtype, bucket_mb * 2**20):
        # cast only what needs it; the cast temporaries live for one bucket
        sent = [(n, t if t.dtype == dtype else t.to(dtype)) for n, t in bucket]
        nbytes += sum(t.numel() * t.element_size() for _, t in sent)
        rec = _RecordCopies() if record else contextlib.nullcontext()
        with rec:
            # apply_model returns one result per worker (one here): the set of filled vLLM names
            for names in llm.apply_model(lambda m, b=sent: m.load_weights(weights=b)):
                loaded |= set(names or ())
        if record:
            by_key = {_key(t): n for n, t in sent}
            for dst, src in rec.copies:
                n = by_key.get(_key(src))
                if n is not None and dst.shape == src.shape:
                    plan.setdefault(n, []).append(dst)
        nbuckets += 1
    _cuda_sync()  # the copies are queued on the stream; time their completion
    ms = 1000 * (time.perf_counter() - t0)
    expected = set(llm.apply_model(lambda m: [n for n, _ in m.named_parameters()])[0])
    stats = {"push_ms": ms, "bytes": nbytes, "n_tensors": len(weights), "n_buckets": nbuckets,
             "gbps": nbytes / 1e9 / max(ms / 1000, 1e-9), "missing": sorted(expected - loaded)}
    if record:
        stats["plan"] = _verified_plan(weights, plan)
    return stats


@torch.no_grad()
def _verified_plan(weights, plan):
    """names + destination views if every trainer tensor went by exactly one plain copy, else None."""
    if any(len(plan.get(n, [])) != 1 for n, _ in weights):
        return None
    dsts = [plan[n][0] for n, _ in weights]
    # what load_weights left in vLLM must be exactly the cast source: then one copy per tensor
    # reproduces it bit for bit (e.g. a loader that also permuted rows would fail here)
    if not all(torch.equal(d, t.to(d.dtype)) for d, (_, t) in zip(dsts, weights)):
        return None
    return {"names": [n for n, _ in weights], "dsts": dsts}


@torch.no_grad()
def push_fast(plan, model):
    """The same copies as load_weights, as one torch._foreach_copy_ (casts in the copy kernel).

    The plan is recorded from vLLM's own loaders on the first sync (push_weights(record=True)):
    each trainer tensor -> the view of the vLLM parameter it was copied into (q/k/v -> slices
    of qkv_proj, gate/up -> slices of gate_up_proj, ...). Views stay valid across sleep/wake:
    vLLM's sleep mode unmaps and remaps physical memory at the same virtual addresses (that is
    how vLLM keeps its own parameter objects). Returns None if the trainer's names changed.
    """
    _cuda_sync()
    t0 = time.perf_counter()
    weights = trainer_weights(model)
    if [n for n, _ in weights] != plan["names"]:
        return None
    torch._foreach_copy_(plan["dsts"], [t for _, t in weights])
    _cuda_sync()
    ms = 1000 * (time.perf_counter() - t0)
    nbytes = sum(d.numel() * d.element_size() for d in plan["dsts"])
    return {"push_ms": ms, "bytes": nbytes, "n_tensors": len(weights), "n_buckets": 0,
            "gbps": nbytes / 1e9 / max(ms / 1000, 1e-9), "missing": []}


@torch.no_grad()
def trainer_logprobs(model, prompts, completions, temperature=1.0, autocast_dtype=None):
    """Per-token logprobs (list of lists) of each completion after its prompt under the trainer.

    autocast_dtype (e.g. torch.bfloat16, CUDA only): run the forward under autocast, so the matmuls
    use the same rounded weights the engine holds (see check())."""
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
    use_amp = autocast_dtype in (torch.bfloat16, torch.float16) and dev.type == "cuda"
    try:
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=use_amp) if use_amp else contextlib.nullcontext():
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


def probe(engine, model, prompts, max_tokens=32, temperature=1.0, autocast_dtype=None):
    """Sample from the engine on `prompts`, score the same tokens with the trainer at the same temperature."""
    outs = engine.generate(prompts, n=1, temperature=temperature, top_p=1.0, max_tokens=max_tokens)
    comps = [o[0] for o in outs]
    keep = [i for i, c in enumerate(comps) if c.token_ids]
    e_lps = [comps[i].logprobs for i in keep]
    t_lps = trainer_logprobs(model, [prompts[i] for i in keep], [comps[i].token_ids for i in keep], temperature,
                             autocast_dtype)
    return logprob_delta(e_lps, t_lps)


def check(engine, model, threshold=0.1):
    """Engine vs trainer logprobs on the engine's probe prompts; raises if mean |dlogp| > threshold.

    The trainer side runs under autocast to the engine's dtype. Why: fp32 master weights drift off
    the bf16 grid (an AdamW step at lr 5e-6 moves a weight of 0.02 by ~1/20 of its bf16 spacing),
    so an fp32 forward and a correctly synced bf16 engine part a little more every step: in a
    10-step SmolLM2 run on an H200 the fp32-forward probe rose from 0.027 to 0.085 (most likely
    this; the sampled text also changed), close to the threshold. Under autocast the matmuls use
    the same rounded weights the engine holds, leaving the kernel noise (~0.03-0.04) against a
    missing sync (0.17 .. 0.8). (Added after the last GPU run: CPU-tested only.)"""
    if not engine.probe_prompts:  # nothing generated yet: no probe batch to check on
        return {}
    t0 = time.perf_counter()
    stats = probe(engine, model, engine.probe_prompts, engine.probe_tokens, autocast_dtype=engine.torch_dtype)
    stats["check_ms"] = 1000 * (time.perf_counter() - t0)
    if not stats["dlogp_mean"] <= threshold:  # also catches NaN
        raise RuntimeError(
            f"weight sync check failed: engine vs trainer mean |dlogp| {stats['dlogp_mean']:.3f} "
            f"(p95 {stats['dlogp_p95']:.3f}) > {threshold} on {stats['probe_tokens']} probe tokens; "
            "the engine is not sampling from the trainer's weights")
    return stats


def sync_weights(engine, model, check_logprobs=True, threshold=0.1, bucket_mb=512):
    """The whole sync for a VLLMEngine: push, reset the prefix cache, check. Returns stats; raises if broken.

    The first sync goes through vLLM's load_weights and records a copy plan (engine.sync_plan);
    later syncs replay it with one foreach copy (push_fast). engine.sync_plan = False disables that.
    """
    t0 = time.perf_counter()
    plan = getattr(engine, "sync_plan", None)
    stats = push_fast(plan, model) if plan else None
    if stats is None:
        record = plan is None  # None: not tried yet; False: this model's loaders are not plain copies
        stats = push_weights(engine.llm, model, engine.torch_dtype, bucket_mb, record=record)
        if record:
            engine.sync_plan = stats.pop("plan") or False
        stats["path"] = "load_weights"
    else:
        stats["path"] = "fast"
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
