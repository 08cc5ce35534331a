"""
The scoring forward: token log-probs of padded rows under the policy, the one forward that the loss,
the old and reference logprobs, SFT and the sync check all run.

    logp[b, t] = log softmax(lm_head(h[b, t]) / temperature)[ids[b, t + 1]]      (b, t-1)
    H[b, t]    = -sum_v p_v log p_v   (the entropy, a metric or a bonus, from the same logits)

token_logprobs is that formula in four lines, the reference every fast path here is tested
against (tests/test_options.py, tests/test_grpo.py):
  - token_logprobs_chunked: the same numbers with a hand-written backward, upcasting a block of 512
    rows at a time, so no float32 (N, V) tensor is made or saved (at N = 32k, V = 152k it would be 19 GB).
  - --compile (options/memory.compile_model): token_logprobs compiled into one fused kernel.
  - chunk = C (--logprob-chunk): the decoder's hidden states, then the LM head over C tokens at a
    time under activation checkpointing, so the logits are C x V instead of b x t x V, for one more
    LM-head matmul in backward. Same numbers up to GEMM rounding.
  - --shared-prefix (options/prefix.py): a group's shared prompt run once, in one packed row.

Micro-batches (micro_batches): with a token budget, rows sorted by length, longest first, and packed
while (count x longest) <= budget, so short episodes do not pad to a long one.

Test: python -m pytest -q tests/test_options.py tests/test_grpo.py
"""
import functools

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint


def unwrap(model):
    """The plain HF module under torch.compile (OptimizedModule._orig_mod), whose names vLLM knows."""
    return getattr(model, "_orig_mod", model)


# ---- token log-probs from logits: the plain formula, then its fast paths

def token_logprobs(logits, targets, temperature=1.0, entropy=False):
    """(logp, entropy or None) of targets (...) under softmax(logits (..., V) / temperature), float32
    (float64 stays float64), both differentiable. The reference; finite logits only."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # (..., V)
    lse = torch.logsumexp(x, dim=-1)  # (...)  logp = x_y - lse,  H = lse - sum_v p_v x_v
    logp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return logp, (lse - (torch.softmax(x, dim=-1) * x).sum(-1)) if entropy else None


@functools.cache
def _compiled_token_logprobs():  # made on first use: importing torch._dynamo costs ~1 s
    return torch.compile(token_logprobs, dynamic=True)


class _ChunkedTokenLogprob(torch.autograd.Function):
    """(logp (N,), entropy (N,)) of targets (N,) under logits (N, V) / temperature, chunked over
    rows. The entropy is computed (and differentiable) only if with_entropy; else it is empty."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, block, with_entropy):
        # bf16/fp16 are upcast to float32 a block at a time; float64 stays float64 (for gradcheck)
        cdtype = torch.promote_types(logits.dtype, torch.float32)
        N = logits.shape[0]
        out = torch.empty(N, dtype=cdtype, device=logits.device)
        lse = torch.empty(N, dtype=cdtype, device=logits.device)
        ent = torch.empty(N if with_entropy else 0, dtype=cdtype, device=logits.device)
        for s in range(0, N, block):
            x = logits[s:s + block].to(cdtype) / temperature  # (n, V): the big temporary
            lse[s:s + block] = torch.logsumexp(x, dim=-1)
            tgt = x.gather(-1, targets[s:s + block, None]).squeeze(-1)  # (n,)
            out[s:s + block] = tgt - lse[s:s + block]
            if with_entropy:  # H = sum_i entr(p_i); entr(0) = 0, so -inf logits are fine
                ent[s:s + block] = torch.special.entr(x.sub_(lse[s:s + block, None]).exp_()).sum(-1)
        # save the model's (bf16) logits, which exist anyway, and the (N,) lse; not the float32 blocks
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.block = temperature, block
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None
        return out, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        T, C = ctx.temperature, ctx.block
        if grad_out is None:
            grad_out = torch.zeros_like(lse)
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], C):
            # recomputed instead of saved: lp = log softmax (n, V), p = softmax
            lp = (logits[s:s + C].to(lse.dtype) / T).sub_(lse[s:s + C, None])  # a new tensor: / is out of place
            p = lp.exp()
            go = grad_out[s:s + C, None].to(lse.dtype)  # (n, 1): dL/dlogp
            # dlogp/dx = onehot(y) - p;  dH/dx = -p * (log p + H)
            if grad_ent is None:
                g = p.mul_(-go)
            else:  # -p * (go + ge * (log p + H)); log p >= -1e4 (where p = exp(log p) is 0 anyway), so
                # a banned (-inf) token gives 0, not 0 * -inf
                lp.clamp_(min=-1e4).add_(ent[s:s + C, None]).mul_(grad_ent[s:s + C, None])
                g = p.mul_(lp.add_(go)).neg_()
            g.scatter_add_(-1, targets[s:s + C, None], go)  # + onehot(target) * dL/dlogp
            grad[s:s + C] = g.div_(T).to(grad.dtype)
        return grad, None, None, None, None


def token_logprobs_chunked(logits, targets, temperature=1.0, block=512, entropy=False):
    """token_logprobs' numbers without its float32 (..., V) copies: (..., V), (...) -> (...) float32
    (float64 stays float64); with
    entropy=True, (logp, entropy of softmax(logits / temperature)), both differentiable (one pass
    over the logits; an entropy bonus in the loss backpropagates through the second).

    targets must be valid ids everywhere (pad with any id and mask later; -100 would index out of
    range). block rows are upcast at a time: 512 x 152k x 4 bytes = 311 MB of temporaries.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logprobs_chunked: logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"token_logprobs_chunked: temperature must be > 0, got {temperature}")
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)  # (B*T, V): a view if contiguous, else one copy in the logits' dtype
    logp, ent = _ChunkedTokenLogprob.apply(flat, targets.reshape(-1).long(), float(temperature), int(block),
                                           bool(entropy))
    return (logp.view(targets.shape), ent.view(targets.shape)) if entropy else logp.view(targets.shape)


@torch.no_grad()
def entropy(logits, temperature=1.0, block=512):
    """Entropy of softmax(logits / temperature), (..., V) -> (...) float32. A metric: no gradient."""
    cdtype = torch.promote_types(logits.dtype, torch.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=cdtype, device=logits.device)
    for s in range(0, flat.shape[0], block):
        p = torch.softmax(flat[s:s + block].to(cdtype) / temperature, dim=-1)  # (n, V)
        out[s:s + block] = torch.special.entr(p).sum(-1)  # entr(0) = 0, so -inf logits are fine
    return out.view(logits.shape[:-1])


def score_logits(logits, targets, temperature, entropy, fused=False):
    """(logp, entropy or None) of targets under logits, both differentiable (an entropy bonus
    backpropagates through the entropy; as a metric, detach it): token_logprobs' numbers, by the
    fast path that fits -- compiled into one kernel (fused: a --compile model), else chunked."""
    if fused:
        return _compiled_token_logprobs()(logits, targets, temperature, entropy)
    if entropy:
        return token_logprobs_chunked(logits, targets, temperature, entropy=True)
    return token_logprobs_chunked(logits, targets, temperature), None


def score_chunks(head, h, y, temperature, chunk, entropy, fused=False):
    """(logp (N,), entropy (N,) or None) of tokens y (N,) from hidden states h (N, d): the LM head
    over `chunk` positions at a time, each under activation checkpointing (module doc)."""
    def score(hc, yc):  # run twice per chunk when grad is on: forward, then again in backward
        lp, ent = score_logits(head(hc), yc, temperature, entropy, fused)  # head(hc) (c, V): the one big tensor
        return lp, ent if entropy else lp.new_zeros(())

    lps, ents = [], []
    for s in range(0, len(y), chunk):
        if torch.is_grad_enabled():
            lp, ent = checkpoint(score, h[s:s + chunk], y[s:s + chunk], use_reentrant=False)
        else:
            lp, ent = score(h[s:s + chunk], y[s:s + chunk])
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents) if entropy else None


def is_compiled(model):
    """Whether options/memory.compile_model ran on this model (it then scores with one fused kernel)."""
    return getattr(unwrap(model), "nanorl_compiled", False)


# ---- the forward

def sequence_logprobs(model, ids, attn, temperature=1.0, chunk=0, entropy=False):
    """(logp (b, t-1) float32 of ids[:, 1:], entropy (b, t-1) or None) of right-padded rows; chunk:
    the module doc. Runs under the caller's autocast; gradients flow unless the caller is in no_grad.
    No KV cache: a scoring forward never reuses one. Right-padded rows run without their attention
    mask: under the causal mask no real token attends a later pad, so the real tokens' outputs are
    the same and SDPA takes its causal kernel. The pads' own outputs change; every caller masks them."""
    targets = ids[:, 1:]  # (b, t-1): token t+1 is scored by the logits at t
    if bool((attn[:, 1:] <= attn[:, :-1]).all()):  # right-padded (rollout.episodes_to_batch)
        attn = None  # no mask needed (the docstring)
    if not chunk:
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]  # (b, t-1, V)
        return score_logits(logits, targets, temperature, entropy, is_compiled(model))
    b, t = targets.shape
    logp, ent = in_chunks(model, dict(input_ids=ids, attention_mask=attn, use_cache=False), (slice(None), slice(None, -1)),
                          targets.reshape(b * t), temperature, chunk, entropy)
    return logp.view(b, t), ent.view(b, t) if entropy else None


def hidden_then_head(m, kw, at, targets, temperature, chunk, entropy, fused=False):
    """chunk > 0: the decoder's last hidden states m.base_model(**kw) at index `at`, flattened to (N, d),
    then the LM head over them by score_chunks -> (logp (N,), entropy (N,) or None) of targets (N,)."""
    h = m.base_model(**kw).last_hidden_state[at]
    return score_chunks(m.get_output_embeddings(), h.reshape(-1, h.shape[-1]), targets, temperature, chunk, entropy, fused)


def in_chunks(model, kw, at, targets, temperature, chunk, entropy):
    """hidden_then_head on the plain module, or FSDP2's registered copy of it (support/dist.wrap), which
    gathers the root's weights (embeddings, final norm, LM head) around it as the root's forward does."""
    m = unwrap(model)
    run = getattr(m, "hidden_then_head", None) or functools.partial(hidden_then_head, m)
    return run(kw, at, targets, temperature, chunk, entropy, is_compiled(model))


class Scorer(torch.nn.Module):
    """The loss's forward as a module, which torchrun's DDP wraps (support/dist.py): DDP only reduces
    the gradients of forwards that ran through it. forward: sequence_logprobs, or --shared-prefix's
    packed one (options/prefix.py)."""

    def __init__(self, model, forward=sequence_logprobs):
        super().__init__()
        self.model, self.fn = model, forward

    def forward(self, ids, attn, temperature=1.0, chunk=0, entropy=False):
        return self.fn(self.model, ids, attn, temperature, chunk, entropy)


# ---- micro-batches and no-grad passes over a whole batch

def micro_batches(lengths, idx, size, tokens=0, ids=None):
    """Split the row indices idx (1-D) into micro-batches, a list of index tensors. tokens = 0: `size`
    rows at a time, in order. tokens > 0 (--micro-batch-tokens): longest first, packed while (rows in
    it) x (its longest row) <= tokens; a row over the budget goes alone, and a budget that does not
    fit fails on the first micro-batch, not the last. ids: read by --shared-prefix's micro_batches
    (options/prefix.py) only. The loss's denominators are the mini-batch's (train.py), so how rows
    are grouped changes no result beyond float rounding."""
    if not tokens:
        return [idx[s:s + size] for s in range(0, len(idx), size)]
    idx = idx[torch.argsort(lengths[idx], descending=True, stable=True)]  # idx[0]: each micro-batch's longest
    return next_fit(idx, lambda mb: len(mb) * int(lengths[mb[0]]) <= tokens)


def next_fit(idx, fits):
    """idx cut in order into runs, each as long as fits(run) allows, a new run where the next index
    does not fit the open one (next-fit packing; a run of one always goes)."""
    out, start = [], 0
    for i in range(1, len(idx) + 1):  # idx[start:i] is the open micro-batch
        if i == len(idx) or not fits(idx[start:i + 1]):
            out.append(idx[start:i])
            start = i
    return out


@torch.no_grad()
def batched(fn, batch, micro_batch_size, device="cpu", tokens=0, even=None, split=micro_batches):
    """No-grad fn(ids, attn) -> (b, t-1) over a whole padded batch (episodes_to_batch's dict), on the
    CPU as (B, T-1) float32, by micro-batches (split) each trimmed to its longest row; columns past a
    row's length stay 0. even: torchrun's World.even (every rank runs as many forwards: FSDP2)."""
    ids_all, attn_all = batch["input_ids"], batch["attention_mask"]
    lengths = attn_all.sum(1)
    out = torch.zeros(ids_all.shape[0], ids_all.shape[1] - 1)
    todo = split(lengths, torch.arange(len(lengths)), micro_batch_size, tokens, ids=ids_all)
    for idx in even(todo) if even else todo:
        t = int(lengths[idx].max())
        out[idx, :t - 1] = fn(ids_all[idx, :t].to(device), attn_all[idx, :t].to(device)).float().cpu()
    return out


def batch_logprobs(model, batch, micro_batch_size, temperature=1.0, chunk=0, device="cpu", tokens=0, even=None,
                   forward=sequence_logprobs, split=micro_batches):
    """No-grad logprobs (B, T-1) of a whole padded batch (old or reference logprobs; batched)."""
    return batched(lambda ids, attn: forward(model, ids, attn, temperature, chunk)[0],
                   batch, micro_batch_size, device, tokens, even, split)


def pad(seqs, pad_id=0):
    """Right-pad lists of token ids: (input_ids, attention_mask), both (B, T) long."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, :len(s)] = 1
    return ids, attn
