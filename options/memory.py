"""
Will this run fit the GPU? The memory estimate every GPU run checks before anything big is on the
GPU (train.py via config.py), and that chooses LoRA and the engine's sleep level when they are
left on auto.

    need = estimate_memory(cfg, n_params, micro_batch=4, max_context=2048, grad_checkpointing=True,
                           chunk=1024, engine_bytes=0.3 * total)      # bytes per phase and its parts
    ok = fits_gpu(src, lora_rank=0, compute_dtype=torch.bfloat16, ...)   # prints the estimate; bool or a clear error

The formulas (bytes):

    trainer   params x 16 bytes: fp32 weights 4 + fp32 grads 4 + AdamW's two fp32 moments 8
              (+ a frozen reference model in the compute dtype when --kl-coef > 0); LoRA: the
              frozen base in the compute dtype, 16 bytes per adapter parameter, no reference copy
    engine    --gpu-memory-utilization x the GPU's total memory (vLLM's weights + KV cache)
    rollout   trainer - grads (freed before every wake) + engine
    train     trainer + activations + logits, the engine asleep (+ the engine when it stays awake)
    offload   --offload-optimizer: AdamW's moments are on the GPU only inside the update, so the
              rollout holds no AdamW and train = max(weights + grads + activations + logits,
              weights + grads + AdamW)
    shard     --shard fsdp over W GPUs: weights, gradients and AdamW are 1/W per GPU, and FSDP2 adds
              its gathered units (compute dtype, c bytes): the root (embeddings, final norm, LM head:
              kept gathered from its forward to the end of the backward) and two decoder layers (the
              one running, the one prefetched), plus the largest unit's unsharded gradient and its
              float32 copy for the reduce-scatter: (root + 2 layer) c + max(root, layer) (c + 4).
              The KL reference is sharded too (1/W; support/dist.shard_reference), but with
              --ref-update-every (a whole copy in the compute dtype on every GPU); under DDP every
              GPU holds everything whole
    activations per micro-batch of b x L tokens, per layer per token (bf16 autocast, fp32 residual):
              ~ 2 (6 d + 3 d_ff) + 8 d bytes kept for backward; with gradient checkpointing only the
              fp32 layer input (4 d bytes) per layer plus one layer's worth while it is recomputed;
              b x L is at most --micro-batch-tokens (a longer row still trains whole: max(it, L))
    logits    chunk = 0: b x L x V x 2 (bf16, kept for backward) + 512 x V x 8 (fp32 chunks);
              chunk = C: C x V x 10
  These are estimates (the caching allocator, CUDA graphs and the CUDA context add to them); the
  measured peaks per phase are what train.py prints at the end of a run (logs.PhaseReport).
  Under PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction F (several runs sharing a GPU) the
  free memory is at most F x total, and the engine counts while it sleeps: vLLM unmaps its pages
  under tensors that live on, and PyTorch's allocator still counts them against F.

Test: python -m pytest -q tests/test_train.py tests/test_options.py   (the estimate against the shapes, the auto
choices, the FSDP2 shard)
"""
import torch

from options import lora


class DoesNotFit(ValueError):
    """The run needs more GPU memory than is free: the message names what to change (one line)."""

def estimate_memory(cfg, n_params, micro_batch, max_context, grad_checkpointing, chunk, engine_bytes, ref_bytes=0,
                    weight_bytes=None, n_trainable=None, critic_params=0, shard=1, offload=False,
                    micro_batch_tokens=None, units=(0, 0), compute_bytes=2, ref_shard=1):
    """Bytes per phase {"rollout", "train"} and their parts, from the formulas in the module doc.
    weight_bytes (default fp32: 4 x n_params) and n_trainable (default all) cover LoRA: a bf16 base
    and gradients and AdamW moments for the adapters only. critic_params: a float32 critic (--algo gae,
    critic.py): 16 bytes each in training, 12 in the rollout phase (its gradients are freed). shard:
    FSDP2 over this many GPUs (support/dist.py) holds 1/shard of the weights, gradients and AdamW per GPU,
    plus its gathered units: units = (root parameters, largest decoder layer's parameters), gathered in
    compute_bytes per parameter. offload: --offload-optimizer (AdamW on the GPU only during its update).
    micro_batch_tokens: --micro-batch-tokens, the token budget of a micro-batch (None: b x L). ref_shard:
    the GPUs the reference is sharded over (1: whole on each)."""
    d, ff, layers, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    ref_bytes //= ref_shard
    tokens = micro_batch * max_context
    if micro_batch_tokens:  # packed to the budget; a row longer than the budget still trains alone
        tokens = min(tokens, max(micro_batch_tokens, max_context))
    per_layer = 2 * (6 * d + 3 * ff) + 8 * d  # bytes per token per layer kept for backward
    act = tokens * (layers * 4 * d + per_layer) if grad_checkpointing else tokens * layers * per_layer
    logits = chunk * V * 10 if chunk else tokens * V * 2 + 512 * V * 8
    n_trainable = n_params if n_trainable is None else n_trainable
    weights = (4 * n_params if weight_bytes is None else weight_bytes) // shard
    grads, adam = 4 * n_trainable // shard, 8 * n_trainable // shard
    root, layer = units
    gathered = (root + 2 * layer) * compute_bytes + max(root, layer) * (compute_bytes + 4) if shard > 1 else 0
    parts = {"weights": weights, "grads": grads, "adamw": adam, "reference": ref_bytes, "engine": engine_bytes,
             "activations": act, "logits": logits, "critic": 16 * critic_params, "gathered": gathered}
    held = weights + ref_bytes + 16 * critic_params + gathered  # through the whole train phase
    train = held + grads + (max(act + logits, adam) if offload else adam + act + logits)
    return {"rollout": weights + (0 if offload else adam) + ref_bytes + engine_bytes + 12 * critic_params,
            "train": train, "parts": parts}


def check_memory(model, ref_bytes_per_param, engine_share, micro_batch, max_context, grad_checkpointing, chunk,
                 fail=True, critic=False, shard=1, awake=False, headroom=1.0, offload=False, micro_batch_tokens=None,
                 compute_bytes=2, ref_shard=1):
    """Print the estimate (estimate_memory) for a model not yet on the GPU (meta_model will do); True
    if its peak fits the GPU's free memory, else a clear error naming what to change (fail=False:
    return False instead). ref_bytes_per_param: of the reference model (0: none); engine_share: the
    engine's --gpu-memory-utilization (0: none). Frozen parameters count as weights only (LoRA).
    awake: the engine stays mapped while training (--sleep-level 0), so training's peak includes it.
    headroom: fits only if need x headroom <= free (a margin for the estimate's error). offload:
    --offload-optimizer. shard: FSDP2's world size (its units: fsdp_units); ref_shard: the reference's."""
    free, total = torch.cuda.mem_get_info()
    frac = torch.cuda.get_per_process_memory_fraction() if torch.cuda.is_initialized() else 1.0  # (by mem_get_info)
    if frac < 1.0:  # a share of a GPU held by PYTORCH_CUDA_ALLOC_CONF: what this process may still take
        free, awake = min(free, frac * total - torch.cuda.memory_reserved()), True
    n = sum(p.numel() for p in model.parameters())
    est = estimate_memory(model.config, n, micro_batch, max_context, grad_checkpointing, chunk,
                          (engine_share or 0) * total, ref_bytes_per_param * n,
                          weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                          n_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                          critic_params=n if critic else 0, shard=shard, offload=offload,  # the critic: the policy's decoder + a scalar head
                          micro_batch_tokens=micro_batch_tokens, units=fsdp_units(model), compute_bytes=compute_bytes,
                          ref_shard=ref_shard)
    need = max(est["rollout"], est["train"] + (est["parts"]["engine"] if awake else 0))
    gb = {k: round(v / 1e9, 1) for k, v in est["parts"].items()}
    print(f"memory estimate{' (engine counted while training)' if frac < 1.0 else ' (engine awake while training)' if awake else ''}"
          f"{f' (per GPU, FSDP2 over {shard})' if shard > 1 else ''}: rollout {est['rollout'] / 1e9:.1f} GB, train {est['train'] / 1e9:.1f} GB {gb}; "
          f"{free / 1e9:.1f} GB free{f' (per_process_memory_fraction {frac})' if frac < 1.0 else ''}")
    if need * headroom > free and fail:
        raise DoesNotFit(
            f"this run needs ~{need / 1e9:.0f} GB of GPU memory ({gb}) and this GPU has {free / 1e9:.0f} GB free"
            + (f" under PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction {frac}, which counts the engine even "
               "while it sleeps" if frac < 1.0 else "") + ": try "
            + ("--grad-checkpointing, " if not grad_checkpointing else "")
            + ("--logprob-chunk 1024, " if not chunk else "")
            + ("--offload-optimizer, " if not offload and shard == 1 else "")
            + (f"more GPUs (--shard fsdp: 16/{shard} bytes per parameter per GPU), " if shard > 1 else "")
            + "a smaller --micro-batch-size or --max-context, a lower --gpu-memory-utilization, "
            + ("LoRA (--lora-rank 32) " if shard == 1 else "")
            + "or a smaller model (full-parameter training needs 16 bytes per parameter: weights, gradients and "
            "AdamW's two moments)")
    return need * headroom <= free


def fsdp_units(model):
    """(root parameters, the largest decoder layer's parameters): the units support/dist.wrap shards, one
    per decoder layer and the root (everything else: embeddings, final norm, an untied LM head)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    layer = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    in_layers = sum(p.numel() for m in layers for p in m.parameters())
    return sum(p.numel() for p in model.parameters()) - in_layers, layer


def meta_model(src):
    """The model's modules and parameter shapes on the meta device, no weights read (for check_memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)


def fits_gpu(src, lora_rank, compute_dtype, kl_coef, engine_share, micro_batch, max_context, grad_checkpointing,
             chunk, critic=False, shard=1, awake=False, headroom=1.0, fail=True, offload=False, micro_batch_tokens=None,
             ref_shard=1,
             lora_alpha=32.0, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
    """Whether training the model at src fits this GPU (check_memory on a meta model, with LoRA of
    rank lora_rank applied when it is > 0); fail=True: an error naming what to change instead of
    False. engine_share: vLLM's --gpu-memory-utilization (0: the HF engine, no pool). shard: FSDP2's
    world size (each GPU holds 1/shard of the trainer state). awake: the engine stays mapped while
    training (--sleep-level 0). headroom, offload, micro_batch_tokens, ref_shard: check_memory's."""
    shape = meta_model(src)
    if lora_rank:
        lora.apply_lora(shape.to(compute_dtype), lora_rank, lora_alpha, list(lora_targets))
    return check_memory(shape, compute_dtype.itemsize if kl_coef > 0 and not lora_rank else 0, engine_share,
                        micro_batch, max_context, grad_checkpointing, chunk, fail, critic=critic, shard=shard,
                        awake=awake, headroom=headroom, offload=offload, micro_batch_tokens=micro_batch_tokens,
                        compute_bytes=compute_dtype.itemsize, ref_shard=ref_shard)


# ---- --offload-optimizer and --compile

def move_optimizer_state(optimizer, host, device):
    """--offload-optimizer: AdamW's state tensors (two fp32 moments per parameter, 8 bytes) to
    `device` for the update, or to the CPU after it, into pinned buffers allocated once (host:
    (param index, key) -> buffer) so the copy is one DMA per tensor and the GPU's copies are freed.
    Both directions queue on the current stream, so the update's kernels run after the copies in;
    the way out waits for its copies, since vLLM's wake reuses that memory outside torch's stream
    order. The copies' time lands in the optimizer phase."""
    to_host = torch.device(device).type == "cpu"
    for i, st in enumerate(optimizer.state.values()):
        for k, t in st.items():
            if not torch.is_tensor(t) or t.dim() == 0:  # the step count stays where AdamW keeps it
                continue
            if not to_host:
                st[k] = t.to(device, non_blocking=True, copy=True)
                continue
            buf = host.get((i, k))
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = host[i, k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            st[k] = buf.copy_(t, non_blocking=True)
    if to_host and torch.cuda.is_available():
        torch.cuda.synchronize()


def compile_model(model):
    """--compile: each decoder layer under torch.compile, and the scoring of the LM head's logits
    (score.token_logprobs) as one compiled kernel. In place; names, state dict and the vLLM sync are
    unchanged. dynamic=True: one graph serves every micro-batch shape (a graph more for b = 1, for
    no-grad forwards and for the packed row's mask); the first step that trains pays the compiling
    (less with inductor's cache from an earlier run). It pays where a layer's matmuls are small and
    its RMSNorm, rotary, SiLU x up, residual adds and casts are memory-bound kernels the compiler
    fuses, and the eager LM-head scoring makes many float32 passes over a (c, V) tensor."""
    m = getattr(model, "_orig_mod", model)  # score.unwrap
    layers = getattr(m.base_model, "layers", None)  # decoder-only HF models (Llama, Qwen2, ...)
    if layers is None:
        print(f"--compile: {type(m).__name__} has no base_model.layers; only the LM head's scoring is compiled")
    for layer in layers or []:
        layer.compile(dynamic=True)
    m.nanorl_compiled = True
    return model
