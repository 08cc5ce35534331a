"""
The weight sync from the trainer (a transformers model) into a VLLMEngine (vllm_engine.py),
checked. These functions keep no state: the engine owns its plans and flags, passes them in and
stores what comes back. VLLMEngine.load_weights(model) runs, after wake():

    stats, sync_plan, quant_plan = push(llm, model, dtype, sync_plan, quant, quant_plan)
    llm.reset_prefix_cache()       # unless a sleep emptied the prefix cache since the last generate
    stats |= check(engine.generate, model, probe_prompts, threshold, probe_tokens, dtype)

push raises if a vLLM parameter was left unfilled, check if the engine samples from other weights.

The sync. Trainer (a transformers model) and engine live in one Python process on one GPU
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so a sync is a device-to-device copy and nothing more: no
NCCL group, no serialisation, no checkpoint on disk.

    first sync:  for each bucket of (hf_name, tensor) pairs, <= bucket_mb of engine-dtype bytes:
                     llm.apply_model(lambda m: m.load_weights(bucket))   # vLLM's own HF-name loader
                 while recording each Tensor.copy_(dst, src) the loaders run -> a copy plan
    later syncs: torch._foreach_copy_(plan dsts, trainer tensors)      # the same copies, one call
    every sync:  llm.reset_prefix_cache(), unless a sleep (level 1 or 2) has emptied it since the
                 last generate, or the engine runs without a prefix cache (the engine decides:
                 it knows both)
                 check: |logp_engine - logp_trainer| on a fixed probe batch

Quantized engines (FlashRL, --rollout-quant fp8|int8): vLLM holds fp8 (online quantization,
`LLM(quantization="fp8")`, one scale per fused layer) or int8 weights (started from the W8A8
compressed-tensors checkpoint quant.save_int8_checkpoint writes, one scale per output row). Every
sync quantizes the trainer's new weights on the GPU with quant.py and copies weights and scales
straight into vLLM's quantized parameters (push_quant; layouts in make_quant_plan), instead of
re-running vLLM's loader and process_weights_after_loading; the rest (embeddings, norms, biases)
goes by the bf16 path. The check then compares a quantized engine with the bf16/fp32 trainer, so
its threshold is per format (CHECK_THRESHOLD; measured values: docs/results.md). LoRA (lora.py):
trainer_weights sends W + (alpha/r) B A for the adapted layers, merged one tensor at a time.

vLLM internals used here:
  - `LLM.apply_model(fn)` -> `LLMEngine.apply_model` -> `collective_rpc("apply_model")` ->
    `WorkerBase.apply_model(fn)` = `fn(worker.get_model())`. With the in-process engine
    (`UniProcExecutor`, multiprocessing off) `fn` runs in this thread and is never pickled, so it
    may close over the trainer's CUDA tensors.
  - `model.load_weights(iterable of (hf_name, tensor))` (LlamaForCausalLM / Qwen2ForCausalLM)
    takes Hugging Face names, fuses q/k/v -> qkv_proj and gate/up -> gate_up_proj itself, copies
    *into* the existing parameters (`param.data.copy_`, so CUDA graphs stay valid and the copy
    casts dtype), and returns the set of vLLM parameter names it filled. With
    tie_word_embeddings it skips "lm_head.*" (vLLM's lm_head *is* embed_tokens), and so do we.
  - vLLM's fp8 / int8 parameter layouts (make_quant_plan).

Sync choices
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
    an H200, SmolLM2: mean |dlogp| 0.17 without the reset vs 0.041 with it, 2026-11-22).
    A sync is only finished after `llm.reset_prefix_cache()`, or a sleep since the last generate
    (vLLM's sleep resets the cache too; a reset walks every KV block, ~10 ms at 0.3 of an H100).
  - The check: silent non-syncs (wrong names, a stale cache, weights never copied) are a known
    failure of RL frameworks. After every sync the engine samples a few tokens on a fixed probe
    batch (prompts it has seen before, so a stale prefix cache would show), the trainer scores the
    same tokens (under bf16 autocast, see check()), and we log mean / p95 / max of
    |logp_engine - logp_trainer| at temperature 1.
    mean > threshold (0.1) raises. Healthy bf16 engine vs trainer: mean ~0.03-0.045, p95 ~0.13;
    a broken sync: 0.17 (stale cache) .. 0.8. It cannot see a sync that was skipped after a tiny
    update (the old and new policies agree within the bf16 noise then); the name check catches
    the structural failures: every vLLM parameter must be among the names load_weights filled.

Test: python -m pytest -q tests/test_sync.py            (CPU, a stand-in for the vLLM model)
      python -m pytest -q -m gpu tests/test_gpu.py      (GPU + vLLM; skipped elsewhere)
Bench: python lab/bench.py --model smollm2 --out runs/bench.json   (the sync vs a plain copy)
"""
import contextlib
import time

import numpy as np
import torch

from models import pad, sequence_logprobs, unwrap

# check(): largest healthy mean |logp_engine - logp_trainer| per engine weight format. bf16: kernel
# noise ~0.03-0.045 vs a missed sync 0.17-0.8 (module doc). Quantized engines add their rounding
# (fp8 ~0.17, measured on SmolLM2 before any training); measured values: docs/results.md.
CHECK_THRESHOLD = {"none": 0.1, "fp8": 0.4, "int8": 0.3}


def trainer_weights(model):
    """(hf_name, tensor) pairs to send: the state dict, tied lm_head dropped, each storage once.

    A LoRA-wrapped linear (lora.py) sends its merged weight W + (alpha/r) B A in place of W, and
    its lora_A/lora_B stay home. The merge is a zero-arg callable in the pair, run when the tensor
    is sent (_get), so at most one bucket of merged weights exists at a time (a 7B model's merged
    copy would be ~13 GB)."""
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


def _get(t):
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

    Returns stats (ms, bytes, names vLLM did not fill); with record=True also "plan": for each
    trainer tensor, the view of the vLLM parameter that load_weights copied it into (or None if
    some loader did more than one plain copy per tensor, see push_fast). skip: names that
    push_quant sends (a quantized engine's linear weights).
    """
    _cuda_sync()
    t0 = time.perf_counter()
    weights = [(n, t) for n, t in trainer_weights(model) if n not in skip]
    loaded, nbytes, nbuckets, plan = set(), 0, 0, {}
    for bucket in buckets(weights, dtype, bucket_mb * 2**20):
        # cast only what needs it; the cast temporaries live for one bucket
        sent = [(n, t if t.dtype == dtype else t.to(dtype)) for n, t in ((n, _get(t)) for n, t in bucket)]
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
    if not all(torch.equal(d, _get(t).to(d.dtype)) for d, (_, t) in zip(dsts, weights)):
        return None
    return {"names": [n for n, _ in weights], "dsts": dsts}


@torch.no_grad()
def push_fast(plan, model, skip=()):
    """The same copies as load_weights, as one torch._foreach_copy_ (casts in the copy kernel).

    The plan is recorded from vLLM's own loaders on the first sync (push_weights(record=True)):
    each trainer tensor -> the view of the vLLM parameter it was copied into (q/k/v -> slices
    of qkv_proj, gate/up -> slices of gate_up_proj, ...). Views stay valid across sleep/wake:
    vLLM's sleep mode unmaps and remaps physical memory at the same virtual addresses (that is
    how vLLM keeps its own parameter objects). Returns None if the trainer's names changed.
    LoRA merges and FSDP2's gathered tensors (dist.py) are made and copied one tensor at a time (a
    loop, not one foreach call).
    """
    _cuda_sync()
    t0 = time.perf_counter()
    weights = [(n, t) for n, t in trainer_weights(model) if n not in skip]
    if [n for n, _ in weights] != plan["names"]:
        return None
    if any(callable(t) or hasattr(t, "full_tensor") for _, t in weights):  # LoRA merges, FSDP2 shards:
        for d, (_, t) in zip(plan["dsts"], weights):  # one full tensor at a time, never a second model
            d.copy_(_get(t))
    else:
        torch._foreach_copy_(plan["dsts"], [t for _, t in weights])
    _cuda_sync()
    ms = 1000 * (time.perf_counter() - t0)
    nbytes = sum(d.numel() * d.element_size() for d in plan["dsts"])
    return {"push_ms": ms, "bytes": nbytes, "n_tensors": len(weights), "n_buckets": 0,
            "gbps": nbytes / 1e9 / max(ms / 1000, 1e-9), "missing": []}

# ---- quantized engines (FlashRL): our own quantization, copied into vLLM's quantized parameters

# HF names that vLLM 0.26 fuses into one parameter (stacked_params_mapping in its llama.py and qwen2.py)
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def make_quant_plan(llm, names):
    """[(hf weight names, vLLM weight param, vLLM weight_scale param)] for every quantized linear.

    vLLM 0.26 keeps a quantized weight transposed, (in, out), possibly padded to multiples of 16
    for the cutlass kernels (CutlassFP8ScaledMMLinearKernel / CutlassInt8ScaledMMLinearKernel
    .process_weights_after_loading), and one scale per tensor (fp8 online: Fp8PerTensorOnline-
    LinearMethod, one scale for a whole fused qkv) or per output row (int8 compressed-tensors
    channel strategy, (out, 1)). The in-process engine hands us its model object itself."""
    vmodel = llm.apply_model(lambda m: m)[0]
    plan = []
    for mname, mod in vmodel.named_modules():
        w, s = getattr(mod, "weight", None), getattr(mod, "weight_scale", None)
        if not isinstance(w, torch.Tensor) or s is None or w.dtype not in QUANT_DTYPES:
            continue
        if w.dim() != 2 or w.stride(0) != 1:  # not the transposed (in, out) view of an (out, in) matrix
            raise RuntimeError(f"quantized sync: vLLM layer {mname} keeps its weight as {tuple(w.shape)} with strides "
                               f"{w.stride()}, not the (in, out) view this sync writes (checked on vLLM 0.26.0)")
        prefix, leaf = mname.rsplit(".", 1)
        parts = [f"{prefix}.{p}.weight" for p in STACKED.get(leaf, (leaf,))]
        if any(p not in names for p in parts):
            raise RuntimeError(f"quantized sync: vLLM layer {mname} wants {parts}, not all among the trainer's names")
        plan.append((parts, f"{mname}.weight", w, s))
    if not plan:
        raise RuntimeError("quantized sync: the engine has no int8/fp8 linear weights (was it started quantized?)")
    return plan


@torch.no_grad()
def push_quant(plan, model, kind):
    """Quantize the trainer's weights on the GPU (quant.py; scales from the new weights, one pass
    per layer) and copy them and their scales straight into the engine's quantized parameters.
    FlashRL re-runs vLLM's loader and process_weights_after_loading instead (the slow path the
    seed warns about for fp8)."""
    from quant import quantize_fp8_per_tensor, quantize_int8_per_channel
    quantize = quantize_fp8_per_tensor if kind == "fp8" else quantize_int8_per_channel
    _cuda_sync()
    t0 = time.perf_counter()
    src = dict(trainer_weights(model))
    nbytes = 0
    for parts, _, w, s in plan:
        W = torch.cat([_get(src[p]) for p in parts], 0)  # (out, in): q, k, v stacked as vLLM does
        q, scale = quantize(W)
        out_f, in_f = W.shape
        w[:in_f, :out_f].copy_(q.t())  # the engine's (in, out) layout, padding left as it is
        s.view(-1)[:scale.numel()].copy_(scale.view(-1))
        nbytes += q.numel() * q.element_size() + scale.numel() * 4
    _cuda_sync()
    return {"quant_ms": 1000 * (time.perf_counter() - t0), "quant_bytes": nbytes, "quant_layers": len(plan)}


@torch.no_grad()
def trainer_logprobs(model, prompts, completions, temperature=1.0, autocast_dtype=None):
    """Per-token logprobs (list of lists) of each completion after its prompt under the trainer.

    autocast_dtype (e.g. torch.bfloat16, CUDA only): run the forward under autocast, so the matmuls
    use the same rounded weights the engine holds (see check())."""
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

    Pass the engine's dtype as autocast_dtype: the trainer side then runs under autocast to it.
    Why: fp32 master weights drift off the bf16 grid (an AdamW step at lr 5e-6 moves a weight of
    0.02 by ~1/20 of its bf16 spacing), so an fp32 forward and a correctly synced bf16 engine part
    a little more every step: in a 10-step SmolLM2 run on an H200 the fp32-forward probe rose from
    0.027 to 0.085 (most likely this; the sampled text also changed), close to the threshold. Under
    autocast the matmuls use the same rounded weights the engine holds, leaving the kernel noise
    (~0.03-0.04) against a missing sync (0.17 .. 0.8)."""
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


def push(llm, model, dtype, sync_plan=None, quant="none", quant_plan=None, bucket_mb=512):
    """Every trainer weight into vLLM by the fastest path known to be right. Returns (stats, sync_plan,
    quant_plan), the plans for the next call; raises if some vLLM parameter was left unfilled.

    sync_plan None: go through vLLM's load_weights and record a copy plan (push_weights); a plan:
    replay it with one foreach copy (push_fast); False: this model's loaders are not plain copies,
    load_weights every time. quant fp8|int8: the linear weights go by push_quant (quant_plan, made
    on the first call) and the rest (embeddings, norms, biases) through the same two paths.
    """
    qstats, skip = {}, ()
    if quant != "none":
        if quant_plan is None:
            quant_plan = make_quant_plan(llm, {n for n, _ in trainer_weights(model)})
        skip = {p for parts, *_ in quant_plan for p in parts}
        qstats = push_quant(quant_plan, model, quant)
    stats = push_fast(sync_plan, model, skip) if sync_plan else None
    if stats is None:
        record = sync_plan is None  # None: not tried yet; False: this model's loaders are not plain copies
        stats = push_weights(llm, model, dtype, bucket_mb, record=record, skip=skip)
        if record:
            sync_plan = stats.pop("plan") or False
        stats["path"] = "load_weights"
    else:
        stats["path"] = "fast"
    stats.update(qstats)
    qmods = {vname.rsplit(".", 1)[0] for _, vname, _, _ in quant_plan} if qstats else set()
    # push_quant filled the quantized layers; a compressed-tensors model's Attention layers also own
    # KV-cache scales (attn._k_scale, ...: 1.0, read only by an fp8 KV cache, which we do not use)
    missing = [n for n in stats.pop("missing") if n.rsplit(".", 1)[0] not in qmods
               and not (qmods and n.endswith(("._k_scale", "._q_scale", "._v_scale", "._prob_scale")))]
    if missing:
        raise RuntimeError(f"weight sync: {len(missing)} vLLM parameters were not filled by load_weights "
                           f"(name mismatch between the trainer and vLLM?), e.g. {missing[:5]}")
    return stats, sync_plan, quant_plan


def copy_floor_ms(nbytes, device="cuda", reps=5):
    """The floor for a sync: median ms of one plain same-GPU copy of nbytes (lab/bench.py's reference)."""
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
