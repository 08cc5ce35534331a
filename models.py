"""
The model as the trainer uses it: the one forward that scores tokens, micro-batches by a token
budget, and a run's policy and KL reference (load_policy). Where weights come from is sources.py;
whether a run fits the GPU is memory.py.

Token log-probs of a padded batch (sequence_logprobs; train, sft, the sync check and bench all
call it):

    logp[b, t] = log softmax(lm_head(h[b, t]) / temperature)[ids[b, t + 1]]      (b, t-1)

  chunk = 0: the model's own forward, full logits (b, t, V) in the compute dtype; simple and the
    fastest, but at Qwen's V = 151,936 that tensor is the largest one of a step (4 x 4k tokens in
    bf16: 5 GB, held until backward).
  chunk = C: the decoder's hidden states (b, t, d), then the LM head over C tokens at a time, each
    chunk under activation checkpointing: its logits are freed at once and recomputed in backward.
    Peak logits memory is C x V instead of b x t x V; the cost is one more LM-head matmul per
    token in backward (lab/bench.py measures it). Same numbers as chunk = 0 up to GEMM rounding.
  Entropy (a metric, no gradient) comes from the same logits.

Micro-batches (micro_batches): with a token budget, episodes sorted by length, longest first, and
packed while (count x longest) <= budget, so short episodes do not pad to a long one.

Test: python -m pytest -q tests/test_train.py   (chunked == unchunked logprobs and gradients, packing)
"""
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

import grpo
import lora


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
    dist.World.even, which pads the list so every rank runs as many forwards (FSDP2)."""
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


# ---- the trainer's models for one run

def load_policy(src, ckpt, device, lora_rank=0, lora_alpha=32.0, lora_targets=(), lora_dropout=0.0,
                compute_dtype=torch.float32, reference=False, grad_checkpointing=False):
    """(model, ref_model, engine_src): the trainable policy on `device`, the frozen KL reference
    (reference=True, i.e. --kl-coef > 0; None with LoRA, whose reference is the base with the
    adapters off) and the folder the rollout engine starts from. Full-parameter: float32 master
    weights, from the checkpoint when resuming; the reference is the *initial* model
    (--ref-update-every: the policy as of the last update, saved in the checkpoint's reference/).
    LoRA: the frozen base in the compute dtype plus float32 adapters (the checkpoint's when resuming)."""
    from transformers import AutoModelForCausalLM
    full = not lora_rank
    model = AutoModelForCausalLM.from_pretrained(ckpt or src if full else src,
                                                 dtype=torch.float32 if full else compute_dtype)
    if not full:
        lora.apply_lora(model, lora_rank, lora_alpha, list(lora_targets), lora_dropout)
        if ckpt is not None:
            lora.load_adapter(model, ckpt)
    model = model.to(device)
    if grad_checkpointing:  # non-reentrant: also right when the inputs need no grad (a frozen base)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if reference and full:  # --ref-update-every: the checkpoint's moved reference, if it has one
        moved = ckpt is not None and (Path(ckpt) / "reference").is_dir()
        ref_model = AutoModelForCausalLM.from_pretrained(Path(ckpt) / "reference" if moved else src,
                                                         dtype=compute_dtype).to(device).eval()
        ref_model.requires_grad_(False)
    return model, ref_model, ckpt if ckpt is not None and full else src
