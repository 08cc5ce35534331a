"""
The weight sync from the trainer (a transformers model) into a VLLMEngine (vllm_engine.py),
checked. These functions keep no state: the engine owns its plans and flags, passes them in and
stores what comes back. VLLMEngine.load_weights(model) runs, after wake():

    stats, sync_plan = push(llm, model, dtype, sync_plan)
    llm.reset_prefix_cache()       # unless a sleep emptied the prefix cache since the last generate
    stats |= check(engine.generate, model, probe_prompts, threshold, probe_tokens, dtype)

Trainer and engine share one process and one GPU (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a sync is
a device-to-device copy: no NCCL group, no serialisation, no checkpoint on disk.

    first sync:  per bucket of (hf_name, tensor), <= bucket_mb of engine-dtype bytes:
                     llm.apply_model(lambda m: m.load_weights(bucket))   # vLLM's own HF-name loader
                 while recording each Tensor.copy_(dst, src) the loaders run -> a copy plan
    later syncs: torch._foreach_copy_(plan dsts, trainer tensors)      # the same copies, one call
    check:       mean |logp_engine - logp_trainer| on a fixed probe batch, temperature 1;
                 > CHECK_THRESHOLD raises (a stale cache or a missed sync is 0.17 .. 0.8)

Choices. Buckets bound the cast temporaries (fp32 -> bf16) to one bucket. vLLM's load_weights is
a Python loop, ~100x a plain copy: the plan is kept only if every trainer tensor went by one full
copy and vLLM's parameters then equal the cast tensors bit for bit. A prefix-cache hit after new
weights would reuse old KV, hence the reset. The check cannot see a sync skipped after a tiny
update; the name check (every vLLM parameter filled) catches the structural failures. An engine
that sends some weights its own way first (an 8-bit one) passes their names in skip and filled.

vLLM internals used here (checked against vLLM 0.26.0):
  - `LLM.apply_model(fn)` -> collective_rpc("apply_model") -> `fn(worker.get_model())`; with the
    in-process UniProcExecutor `fn` runs in this thread, unpickled, so it may close over CUDA tensors.
  - `model.load_weights(iterable of (hf_name, tensor))` takes HF names, fuses q/k/v and gate/up,
    copies *into* the existing parameters (CUDA graphs stay valid; the copy casts), returns the
    names it filled, and skips "lm_head.*" with tie_word_embeddings (so do we).

Test: python -m pytest -q tests/test_rollout.py   (its sync.py section: CPU, a stand-in for the vLLM model)
      python -m pytest -q -m gpu tests/test_gpu.py      (GPU + vLLM; skipped elsewhere)
"""
import contextlib
import time

import numpy as np
import torch

from score import pad, sequence_logprobs, unwrap

# check(): the largest healthy mean |dlogp| of a bf16 engine, kernel noise (docs/results.md; a quantized
# engine's own: options/quant.py)
CHECK_THRESHOLD = 0.1


def push(llm, model, dtype, plan=None, skip=(), filled=None, bucket_mb=512):
    """Every trainer weight into vLLM by the fastest path known to be right. Returns (stats, plan), the
    copy plan for the next call; raises if some vLLM parameter was left unfilled. plan None:
    load_weights, recording a plan; a plan: push_fast; False: load_weights every time. skip: trainer
    names another push sent, filled(vLLM name): parameters it filled (a quantized engine's push)."""
    stats = push_fast(plan, model, skip) if plan else None
    if stats is None:
        record = plan is None  # None: not tried yet; False: this model's loaders are not plain copies
        stats = push_weights(llm, model, dtype, bucket_mb, record=record, skip=skip)
        if record:
            plan = stats.pop("plan") or False
        stats["path"] = "load_weights"
    else:
        stats["path"] = "fast"
    missing = [n for n in stats.pop("missing") if not (filled and filled(n))]
    if missing:
        raise RuntimeError(f"weight sync: {len(missing)} vLLM parameters were not filled by load_weights "
                           f"(name mismatch between the trainer and vLLM?), e.g. {missing[:5]}")
    return stats, plan


def trainer_weights(model):
    """(hf_name, tensor) pairs to send: the state dict, tied lm_head dropped, each storage once.

    A LoRA-wrapped linear (options/lora.py) sends W + (alpha/r) B A in place of W as a zero-arg
    callable, run when the tensor is sent (full_tensor): one bucket of merged weights at a time."""
    model = unwrap(model)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    merged = {f"{n}.weight": m.merged_weight for n, m in model.named_modules() if hasattr(m, "merged_weight")}
    seen = set()
    out = []
    for name, t in model.state_dict().items():
        if tied and name.startswith("lm_head."):
            continue  # vLLM skips it too when tied; sending it would only cost a copy
        if ".lora_" in name:
            continue
        key = (getattr(t, "_local_tensor", t).data_ptr(), t.dtype, tuple(t.shape))  # FSDP2: its shard's storage
        if key in seen:  # another name for a tensor we already send (tied aliases)
            continue
        seen.add(key)
        out.append((name, merged.get(name, t)))
    return out


def full_tensor(t):
    """The tensor of a trainer_weights pair (a LoRA merge is computed here; an FSDP2 shard is
    all-gathered into the full tensor here, a collective that every rank runs in the same order)."""
    t = t() if callable(t) else t
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def buckets(weights, dtype, bucket_bytes):
    """Group (name, tensor) into lists of at most bucket_bytes (engine dtype); a bigger tensor is alone."""
    item = torch.empty((), dtype=dtype).element_size()
    cur, size = [], 0
    for name, t in weights:
        b = (t.__self__.weight if callable(t) else t).numel() * item  # a LoRA merge: its module's weight
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


def push_weights(llm, model, dtype, bucket_mb=512, record=False, skip=()):
    """Copy the trainer's weights into the in-process vLLM model through vLLM's load_weights.
    Returns stats (ms, bytes, names vLLM did not fill); record=True adds "plan" (push_fast's, or None
    if some loader did more than one plain copy per tensor). skip: names another push sends."""
    _cuda_sync()
    t0 = time.perf_counter()
    weights = [(n, t) for n, t in trainer_weights(model) if n not in skip]
    loaded, nbytes, nbuckets, plan = set(), 0, 0, {}
    for bucket in buckets(weights, dtype, bucket_mb * 2**20):
        # cast only what needs it; the cast temporaries live for one bucket
        sent = [(n, t if t.dtype == dtype else t.to(dtype)) for n, t in ((n, full_tensor(t)) for n, t in bucket)]
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
    if not all(torch.equal(d, full_tensor(t).to(d.dtype)) for d, (_, t) in zip(dsts, weights)):
        return None
    return {"names": [n for n, _ in weights], "dsts": dsts}


@torch.no_grad()
def push_fast(plan, model, skip=()):
    """The same copies as load_weights, as one torch._foreach_copy_ (casts in the copy kernel).

    The plan (push_weights(record=True)) maps each trainer tensor to the view of the vLLM parameter
    it was copied into (q/k/v -> slices of qkv_proj, ...). Views survive sleep/wake: vLLM remaps
    physical memory at the same virtual addresses. Returns None if the trainer's names changed.
    LoRA merges and FSDP2's gathered tensors (support/dist.py) go one tensor at a time."""
    _cuda_sync()
    t0 = time.perf_counter()
    weights = [(n, t) for n, t in trainer_weights(model) if n not in skip]
    if [n for n, _ in weights] != plan["names"]:
        return None
    if any(callable(t) or hasattr(t, "full_tensor") for _, t in weights):  # LoRA merges, FSDP2 shards:
        for d, (_, t) in zip(plan["dsts"], weights):  # one full tensor at a time, never a second model
            d.copy_(full_tensor(t))
    else:
        torch._foreach_copy_(plan["dsts"], [t for _, t in weights])
    _cuda_sync()
    ms = 1000 * (time.perf_counter() - t0)
    nbytes = sum(d.numel() * d.element_size() for d in plan["dsts"])
    return {"push_ms": ms, "bytes": nbytes, "n_tensors": len(weights), "n_buckets": 0,
            "gbps": nbytes / 1e9 / max(ms / 1000, 1e-9), "missing": []}


@torch.no_grad()
def trainer_logprobs(model, prompts, completions, temperature=1.0, autocast_dtype=None):
    """Per-token logprobs (list of lists) of each completion after its prompt under the trainer;
    autocast_dtype (CUDA only): the matmuls use the rounded weights the engine holds (check())."""
    model = unwrap(model)
    dev = next(model.parameters()).device
    ids, attn = pad([p + c for p, c in zip(prompts, completions)])  # right padding
    was_training = model.training
    model.eval()
    use_amp = autocast_dtype in (torch.bfloat16, torch.float16) and dev.type == "cuda"
    try:
        with torch.autocast("cuda", dtype=autocast_dtype) if use_amp else contextlib.nullcontext():
            logp, _ = sequence_logprobs(model, ids.to(dev), attn.to(dev), temperature)  # (B, T-1)
    finally:
        model.train(was_training)
    return [logp[i, len(p) - 1:len(p) - 1 + len(c)].tolist() for i, (p, c) in enumerate(zip(prompts, completions))]


def logprob_delta(engine_lps, trainer_lps):
    """mean / p95 / max of |engine - trainer| over all tokens, and the token count."""
    d = np.abs(np.concatenate([np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
                               for a, b in zip(engine_lps, trainer_lps)]))
    if d.size == 0:
        return {"dlogp_mean": float("nan"), "dlogp_p95": float("nan"), "dlogp_max": float("nan"), "probe_tokens": 0}
    return {"dlogp_mean": float(d.mean()), "dlogp_p95": float(np.percentile(d, 95)),
            "dlogp_max": float(d.max()), "probe_tokens": int(d.size)}


def probe(generate, model, prompts, max_tokens=32, temperature=1.0, autocast_dtype=None):
    """Sample on `prompts` with generate (any Engine's generate), score the same tokens with the
    trainer at the same temperature."""
    outs = generate(prompts, n=1, temperature=temperature, top_p=1.0, max_tokens=max_tokens)
    comps = [o[0] for o in outs]
    keep = [i for i, c in enumerate(comps) if c.token_ids]
    e_lps = [comps[i].logprobs for i in keep]
    t_lps = trainer_logprobs(model, [prompts[i] for i in keep], [comps[i].token_ids for i in keep], temperature,
                             autocast_dtype)
    return logprob_delta(e_lps, t_lps)


def check(generate, model, prompts, threshold=0.1, max_tokens=32, autocast_dtype=None):
    """Engine vs trainer logprobs on the probe prompts; raises if mean |dlogp| > threshold.

    Pass the engine's dtype as autocast_dtype: the trainer side then runs under autocast to it, because
    fp32 master weights drift off the bf16 grid, and an fp32 forward would part a little more from a
    correctly synced bf16 engine every step; under autocast only the kernel noise remains."""
    if not prompts:  # nothing generated yet: no probe batch to check on
        return {}
    t0 = time.perf_counter()
    stats = probe(generate, model, prompts, max_tokens, autocast_dtype=autocast_dtype)
    stats["check_ms"] = 1000 * (time.perf_counter() - t0)
    if not stats["dlogp_mean"] <= threshold:  # also catches NaN
        raise RuntimeError(
            f"weight sync check failed: engine vs trainer mean |dlogp| {stats['dlogp_mean']:.3f} "
            f"(p95 {stats['dlogp_p95']:.3f}) > {threshold} on {stats['probe_tokens']} probe tokens; "
            "the engine is not sampling from the trainer's weights")
    return stats
