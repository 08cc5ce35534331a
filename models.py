"""
The model as the trainer uses it: the one forward that scores tokens (a micro-batch's shared prefix
computed once), micro-batches by a token budget, and a run's policy and KL reference (load_policy).
Where weights come from is sources.py; whether a run fits the GPU is memory.py.

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

Shared prefixes (shared_prefix=True; Prefix Grouper, arXiv 2506.05433): a GRPO group's n rows share
their prompt, and in the MCP env every row starts with the same ~1.9k-token system + tool block. A
micro-batch of b rows whose real tokens agree on their first p (shared_prefix_len: the longest
common prefix, at most the shortest row's length - 1) runs as ONE packed row

    [prefix (p) | suffix_1 (s_1) | ... | suffix_b (s_b)]      positions 0..p-1, p..l_1-1, ..., p..l_b-1

  under a block mask: a prefix token attends causally within the prefix, a suffix token to the
  whole prefix and causally to its own suffix. Every token sees the context and position it has in
  its padded row, so logp, entropy and gradients are the padded path's up to float rounding
  (tests/test_prefix.py, atol 1e-5 in float32). The prefix's logprobs are gathered into every row,
  so backward sums the rows' gradients into the one computation. The LM head runs on the L - 1
  positions that score a token (the last prefix position once per row: it scores each row's own
  first suffix token) -- via logits_to_keep for chunk = 0, via the chunks otherwise.
  Tokens through the decoder: p + sum(s_i) instead of b x (p + max s_i). A group of 8 with
  p = 1900 and s_i = 100..600 (sum 2,800): 4,700 instead of 20,000.
  Costs. The mask: one additive (1, 1, L, L) tensor in the attention dtype (L = 4.7k: 44 MB; 16k:
  512 MB in bf16) that every layer reads. Additive, not boolean: SDPA turns a boolean mask into a
  float copy in every layer's call, which the memory-efficient kernel keeps for backward (+1.7 GB
  at L = 4.6k without gradient checkpointing); eager attention adds it to the scores. Attention: a
  dense mask sends SDPA to the memory-efficient kernel, which computes all L x L scores, masked
  ones included, where the padded batch computes b x T^2 -- less for one group (22M vs 50M pairs
  above), more when a big token budget packs many rows into one L (32 rows at 16k: 255M vs 180M),
  where the linear layers' saving still wins. flex_attention with a BlockMask would skip the
  masked blocks; not done. Measured (H100, Qwen2.5-1.5B's shape with random weights,
  bf16 autocast, gradient checkpointing, transformers 5.17): the group of 8, forward + backward
  0.93 -> 0.28 s and peak 24.8 -> 13.3 GB, no-grad 0.25 -> 0.07 s; 32 rows of 4 groups at a 16k
  budget, 5 padded micro-batches (76k tokens) 3.79 s -> 1 packed (16k) 1.42 s.
  So a packed row stops at packed_limit(p) tokens (~5.3k for the MCP tool block), where the linear
  layers' saving and the mask's extra attention balance. The padded path runs where sharing does
  not pay (one row, p < MIN_SHARED = 64, or packing would not halve the tokens: a GSM8K group's
  short prompt); train.py turns the flag off at start where the mask would not be honoured
  (packable: attention other than sdpa/eager; sliding-window layers), so micro_batches' budget
  and the forward agree.
  transformers (5.17 and 5.23, masking_utils._preprocess_mask_arguments) passes a 4D attention_mask
  through as it is, to every layer.
  Why a mask and not the prefix's KV cache (run the prefix once, then the b suffixes against its
  cache expanded to b rows): under gradient checkpointing in train mode transformers' decoder
  layers drop past_key_values (modeling_layers.GradientCheckpointingLayer, 5.17 and 5.23: a cache
  is written in forward and would be written again by the recompute), so the suffixes would
  silently attend to nothing (and a hand-made cache replayed by the recompute would be appended to
  twice); and the cache expanded to b rows is concatenated with each suffix's K/V, a b-fold copy of
  the prefix's K/V in every layer. LoRA is indifferent to either: its adapters sit in the Linear
  layers, which see tokens, not the mask.

Micro-batches (micro_batches): with a token budget, episodes sorted by length, longest first, and
packed while (count x longest) <= budget, so short episodes do not pad to a long one. With
shared prefixes, rows in trie order (sorted by their tokens: a group's rows are adjacent, groups
sharing a system block next to each other) and packed while the forward's tokens <= budget and
a packed row <= packed_limit.

Test: python -m pytest -q tests/test_train.py tests/test_prefix.py   (chunked == unchunked, packed ==
  padded: logprobs and gradients; micro-batch packing)
"""
import functools
import inspect
import math
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

import grpo
import lora


def unwrap(model):
    """The plain HF module under torch.compile (OptimizedModule._orig_mod), whose names vLLM knows."""
    return getattr(model, "_orig_mod", model)


def with_cache(model, cache):
    """The forward's keyword arguments that pass a KV cache (None: start one) and ask for it back.
    transformers renamed past_key_values to cache (the old name warns from 5.24 and is marked for
    removal in 5.40; requirements.txt allows 5.5.3 on), so the name is the one this model's forward
    takes."""
    return {_cache_name(type(model)): cache, "use_cache": True}


@functools.cache
def _cache_name(cls):  # once per model class: the HF engine asks at every token
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_of(out):
    """The KV cache a forward returned, under either name (with_cache)."""
    return out["cache"] if "cache" in out.keys() else out["past_key_values"]


# ---- the one forward

def sequence_logprobs(model, ids, attn, temperature=1.0, chunk=0, entropy=False, shared_prefix=False):
    """(logp (b, t-1) float32 of ids[:, 1:], entropy (b, t-1) or None); chunk, shared_prefix: see the
    module doc (shared_prefix=True packs the rows where that pays and gives the same numbers).

    Runs under whatever autocast the caller set; gradients flow into logp unless the caller is
    in no_grad. No KV cache (use_cache=False): a scoring forward never reuses one, and under
    --compile a cache's per-layer state would make each layer compile its own graph.
    Right-padded rows run without their attention mask: under the causal mask no real token
    attends a later pad, so the real tokens' outputs are the same function, and SDPA takes its
    causal kernel instead of a masked one (~5% of an eager forward + backward at 1.5B; under
    --compile, one graph for every padded micro-batch instead of one with and one without a mask).
    The pads' own outputs change; every caller masks them out."""
    if shared_prefix and packable(model):
        host, lengths = ids.cpu(), attn.sum(1).cpu()  # the packing's shapes are host ints: one sync
        p = shared_prefix_len(host, lengths)
        if p:
            return packed_logprobs(model, host, lengths, p, ids.device, temperature, chunk, entropy)
    targets = ids[:, 1:]  # (b, t-1): token t+1 is scored by the logits at t
    if bool((attn[:, 1:] <= attn[:, :-1]).all()):  # right-padded (every batch here is: rollout.episodes_to_batch)
        attn = None  # no mask needed (see below)
    if not chunk:
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]  # (b, t-1, V)
        return score_logits(logits, targets, temperature, entropy, is_compiled(model))
    m = unwrap(model)
    h = m.base_model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[:, :-1]  # (b, t-1, d)
    b, t, d = h.shape
    logp, ent = score_chunks(m.get_output_embeddings(), h.reshape(b * t, d), targets.reshape(b * t),
                             temperature, chunk, entropy, is_compiled(model))
    return logp.view(b, t), ent.view(b, t) if entropy else None


def score_logits(logits, targets, temperature, entropy, fused=False):
    """(logp, entropy or None) of targets under logits, both differentiable (an entropy bonus in the
    loss backpropagates through the entropy; as a metric, detach it). fused (a --compile model on a
    GPU): the same numbers from one compiled kernel (fused_scores)."""
    if fused:
        return fused_scores(logits, targets, temperature, entropy)
    if entropy:
        return grpo.token_logprobs(logits, targets, temperature, entropy=True)
    return grpo.token_logprobs(logits, targets, temperature), None


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


class Scorer(torch.nn.Module):
    """sequence_logprobs as a module: the loss's forward, which torchrun's DDP wraps (dist.py) --
    DDP only reduces the gradients of forwards that ran through it, chunked LM head included."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attn, temperature=1.0, chunk=0, entropy=False, shared_prefix=False):
        return sequence_logprobs(self.model, ids, attn, temperature, chunk, entropy, shared_prefix)


# ---- torch.compile (--compile)

def compile_model(model):
    """--compile: each decoder layer under torch.compile, and the scoring of the LM head's logits
    (fused_scores) as one compiled kernel. In place; names, state dict and the vLLM sync are
    unchanged. dynamic=True: one graph serves every micro-batch shape (a graph more for b = 1, for
    no-grad forwards and for the packed row's mask); the first step that trains pays the compiling
    (45-80 s at Qwen2.5-1.5B on an H100, ~50 s at SmolLM2-135M; less with inductor's cache from an
    earlier run), later ones train ~1.6x faster (docs/results.md: lab/train_speed.py).

    Why it pays at Qwen2.5-1.5B's shape: a layer's matmuls are small (d = 1536), and the rest of a
    layer -- RMSNorm, rotary, SiLU x up, the residual adds, autocast's casts -- is a dozen
    memory-bound kernels that the compiler fuses. The LM head's scoring reads a (c, V = 151,936)
    tensor: eagerly grpo.token_logprobs makes ~20 float32 passes over it (upcast, divide, logsumexp,
    entropy; as many in backward, and the chunk's recompute again), compiled about two in bf16."""
    m = unwrap(model)
    layers = getattr(m.base_model, "layers", None)  # decoder-only HF models (Llama, Qwen2, ...)
    if layers is None:
        print(f"--compile: {type(m).__name__} has no base_model.layers; only the LM head's scoring is compiled")
    for layer in layers or []:
        layer.compile(dynamic=True)
    m.nanorl_compiled = True
    return model


def is_compiled(model):
    """Whether compile_model ran on this model (its forwards then score with fused_scores)."""
    return getattr(unwrap(model), "nanorl_compiled", False)


def plain_scores(logits, targets, temperature, entropy):
    """grpo.token_logprobs' numbers written as plain tensor math, which torch.compile fuses and
    differentiates (fused_scores): logp = x_y - logsumexp(x) and H = logsumexp(x) - sum(softmax(x) x)
    with x = logits / T in float32 (float64 stays float64). Finite logits only (the trainer's are;
    grpo's handles -inf)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lse = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return logp, (lse - (torch.softmax(x, dim=-1) * x).sum(-1)) if entropy else None


@functools.cache
def _compiled_plain_scores():  # made on first use: importing torch._dynamo costs ~1 s
    return torch.compile(plain_scores, dynamic=True)


def fused_scores(logits, targets, temperature, entropy):
    """plain_scores compiled (dynamic shapes): (logp, entropy or None), float32, differentiable."""
    return _compiled_plain_scores()(logits, targets, temperature, entropy)


# ---- shared prefixes: one packed row per micro-batch

MIN_SHARED = 64  # a shorter common prefix is not worth the mask and the gathers: the padded path runs
PAIR_COST = 4096  # a token's linear-layer work in attention score pairs (packed_limit)


def shared_prefix_len(ids, lengths):
    """p, the tokens a packed forward computes once for rows ids (b, T) (on the CPU) of real `lengths`:
    their longest common prefix, at most the shortest length - 1 so every row keeps a token to score;
    0 where sharing does not pay: one row, p < MIN_SHARED, or a packed row more than half as long as
    the padded batch (b x longest) -- a smaller saving goes to the dense mask's extra attention."""
    n = max(int(lengths.min()) - 1, 0)
    same = (ids[:, :n] == ids[:1, :n]).all(0)  # (n,) column j holds the same token in every row
    p = int(same.long().cumprod(0).sum())
    pays = len(ids) > 1 and p >= MIN_SHARED and 2 * forward_tokens(lengths, p) <= len(ids) * int(lengths.max())
    return p if pays else 0


def forward_tokens(lengths, p):
    """Tokens a micro-batch's forward runs: p + sum(l_i - p) packed (p > 0), else b x longest (padded)."""
    return p + int((lengths - p).sum()) if p else len(lengths) * int(lengths.max())


def packed_limit(p):
    """The longest packed row worth making for a prefix of p tokens. A packed row of L = p + S tokens
    costs about a x L (the linear layers) + c x L^2 (attention under the dense mask computes every
    pair, masked ones too), so its cost per suffix token, (a L + c L^2) / S, is least at
    S = sqrt(p^2 + p a / c). a / c (PAIR_COST) is ~6 x the hidden size at equal efficiency (a token's
    ~12 d^2 weights x 2 flops per layer against 4 d flops per pair); the memory-efficient kernel's
    lower rate halves it at Qwen2.5-1.5B's d = 1536. The MCP tool block (p = 1,900): L <= 5,300."""
    return p + math.isqrt(p * p + p * PAIR_COST)


def packable(model):
    """Whether the packed row's 4D mask is honoured: sdpa or eager attention (FlashAttention-2 has no
    dense mask and would attend across rows) and full attention in every layer (a sliding-window
    layer would get the same full mask)."""
    cfg = unwrap(model).config
    full = set(getattr(cfg, "layer_types", None) or ["full_attention"]) == {"full_attention"}
    return cfg._attn_implementation in ("sdpa", "eager") and full


def pack(ids, lengths, p):
    """The packed row of rows ids (b, T) (on the CPU) that share their first p tokens, as index tensors:
    tokens, positions, segments (L,) -- segment 0 is the prefix, i + 1 row i's suffix; scored, targets
    (N,) = (L - 1,): the packed positions whose logits score a token, and that token; where (b, T-1):
    the entry of `scored` that the padded path's column t reads, -1 past a row's last scored column."""
    b, T = ids.shape
    n = lengths.tolist()
    s = lengths - p  # (b,) suffix lengths, >= 1
    start = (p + s.cumsum(0) - s).tolist()  # where each suffix begins in the packed row
    tokens = torch.cat([ids[0, :p]] + [ids[i, p:n[i]] for i in range(b)])  # (L,)
    pos = torch.cat([torch.arange(p)] + [torch.arange(p, n[i]) for i in range(b)])  # (L,)
    seg = torch.cat([torch.zeros(p, dtype=torch.long)] + [torch.full((n[i] - p,), i + 1) for i in range(b)])
    # scored: positions 0..p-2 once (they score prefix tokens, the same in every row), then per row the
    # last prefix position (it scores that row's own first suffix token) and its suffix but the last
    # token (whose target is padding)
    own = [torch.cat([torch.tensor([p - 1]), torch.arange(start[i], start[i] + n[i] - p - 1)]) for i in range(b)]
    scored = torch.cat([torch.arange(p - 1)] + own)  # (N,)
    targets = torch.cat([ids[0, 1:p]] + [ids[i, p:n[i]] for i in range(b)])  # (N,)
    col = torch.arange(T - 1)  # the padded path's column t scores token t + 1
    first = p - 1 + s.cumsum(0) - s  # (b,) row i's entry for column p - 1 in scored; its later columns follow
    where = torch.where(col < p - 1, col, first[:, None] + col - (p - 1))  # (b, T-1)
    return tokens, pos, seg, scored, targets, where.masked_fill(col >= lengths[:, None] - 1, -1)


def block_mask(seg, dtype):
    """The packed row's additive attention mask (1, 1, L, L) in `dtype`: 0 where a query may attend a key
    -- the key is not after it and lies in the prefix or in the query's own segment -- else dtype's min."""
    L = len(seg)
    keep = (seg[None, :] == seg[:, None]) | (seg[None, :] == 0)  # (L, L) same segment, or the prefix
    keep &= torch.ones_like(keep).tril_()  # causal: packed order is position order within a segment
    mask = torch.full((1, 1, L, L), torch.finfo(dtype).min, dtype=dtype, device=seg.device)
    return mask.masked_fill_(keep, 0.0)


def attention_dtype(model, device):
    """The dtype attention runs in, the mask's: autocast's when it is on, else the model's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return unwrap(model).get_input_embeddings().weight.dtype


def packed_logprobs(model, ids, lengths, p, device, temperature, chunk, entropy):
    """sequence_logprobs of rows ids (b, T) (on the CPU) that share their first p tokens, run as one
    packed row (module doc); the padded path's layout, 0 past each row's last scored column."""
    tokens, pos, seg, scored, targets, where = (x.to(device) for x in pack(ids, lengths, p))
    mask = block_mask(seg, attention_dtype(model, device))  # (1, 1, L, L): the one big extra tensor
    kw = dict(input_ids=tokens[None], attention_mask=mask, position_ids=pos[None], use_cache=False)
    if not chunk:  # logits_to_keep (1-D indices; transformers 5.17 and 5.23): the LM head on `scored` only
        logits = model(**kw, logits_to_keep=scored).logits[0]  # (N, V)
        lp, ent = score_logits(logits, targets, temperature, entropy, is_compiled(model))  # (N,)
    else:
        m = unwrap(model)
        h = m.base_model(**kw).last_hidden_state[0, scored]  # (N, d)
        lp, ent = score_chunks(m.get_output_embeddings(), h, targets, temperature, chunk, entropy, is_compiled(model))
    # a gather: a prefix position's value goes to every row, so backward sums the rows' gradients into it
    keep, at = where >= 0, where.clamp(min=0)  # (b, T-1)
    logp = torch.where(keep, lp[at], 0.0)
    return logp, torch.where(keep, ent[at], 0.0) if entropy else None


def micro_batches(lengths, rows, size, tokens=0, ids=None):
    """Split `rows` (a 1-D tensor of row indices) into micro-batches, a list of index tensors.

    tokens = 0: `size` rows at a time, in the given order. tokens > 0 (--micro-batch-tokens): rows
    sorted by length, longest first, and packed while (rows in it) x (its longest row) <= tokens;
    a row longer than the budget goes alone. A padded micro-batch costs compute and memory as if
    every row were as long as its longest one, so packing short rows together instead of padding
    them to a long one is most of what a token budget saves; longest first means a budget that
    does not fit fails on the first micro-batch, not the last.

    ids (the batch's input_ids (B, T), on the CPU; --shared-prefix): rows in trie order instead --
    sorted by their tokens, so rows with long common prefixes are adjacent (a group's n episodes,
    then groups whose prompts share a system block) -- `size` at a time, or with a budget packed
    while the forward's tokens (forward_tokens: p + sum(l_i - p) where a prefix is shared, else
    b x longest) <= tokens, a packed row no longer than packed_limit(p). The micro-batches of that
    pass that do not pack (a short prompt: GSM8K's) give their rows back to the padded rule above,
    by length: trie order pads each group's answers to its longest one. On GSM8K-shaped rows (32
    groups of 8, prompts of ~150 tokens, answers of 310 +- 110 up to 512, the l40s budget of 8,192)
    the decoder ran 1.34-1.40x the real tokens in trie order, 1.03-1.04x now (five random draws;
    tests/test_prefix.py checks the mechanism). The loss's denominators are the
    mini-batch's (train.py), so how rows are grouped changes no result beyond float rounding."""
    if ids is not None:
        order = sorted(rows.tolist(), key=lambda r: ids[r, :int(lengths[r])].tolist())
        rows = torch.tensor(order, dtype=torch.long)
    if not tokens:
        return [rows[s:s + size] for s in range(0, len(rows), size)]

    def by_length(r):  # the padded rule: longest first, so r[0] is each micro-batch's longest
        r = r[torch.argsort(lengths[r], descending=True, stable=True)]
        return _greedy(r, lambda mb: len(mb) * int(lengths[mb[0]]) <= tokens)

    if ids is None:
        return by_length(rows)

    def shared(r):  # within the budget, and a packed row no longer than pays (packed_limit)
        p = shared_prefix_len(ids[r], lengths[r])
        n = forward_tokens(lengths[r], p)
        return n <= tokens and (not p or n <= packed_limit(p))

    packs, rest = [], []
    for r in _greedy(rows, shared):
        (packs if shared_prefix_len(ids[r], lengths[r]) else rest).append(r)
    return packs + (by_length(torch.cat(rest)) if rest else [])


def _greedy(rows, fits):
    """rows cut in order into runs, each as long as fits(run) allows (a run of one always goes)."""
    out, start = [], 0
    for i in range(1, len(rows) + 1):  # rows[start:i] is the open micro-batch
        if i == len(rows) or not fits(rows[start:i + 1]):
            out.append(rows[start:i])
            start = i
    return out


@torch.no_grad()
def batched(fn, batch, micro_batch_size, device="cpu", tokens=0, even=None, shared_prefix=False):
    """No-grad fn(ids, attn) -> (b, t-1) over a whole padded batch (episodes_to_batch's dict), on the
    CPU as (B, T-1) float32, in micro-batches (micro_batches; in trie order with shared_prefix) each
    trimmed to its longest row; columns past a row's own length stay 0 (pad positions, under mask
    0). even: torchrun's dist.World.even, which pads the list so every rank runs as many forwards (FSDP2)."""
    ids_all, attn_all = batch["input_ids"], batch["attention_mask"]
    lengths = attn_all.sum(1)
    out = torch.zeros(ids_all.shape[0], ids_all.shape[1] - 1)
    todo = micro_batches(lengths, torch.arange(len(lengths)), micro_batch_size, tokens,
                         ids_all if shared_prefix else None)
    for idx in even(todo) if even else todo:
        t = int(lengths[idx].max())
        out[idx, :t - 1] = fn(ids_all[idx, :t].to(device), attn_all[idx, :t].to(device)).float().cpu()
    return out


def batch_logprobs(model, batch, micro_batch_size, temperature=1.0, chunk=0, device="cpu", tokens=0, even=None,
                   shared_prefix=False):
    """No-grad logprobs (B, T-1) of a whole padded batch (old or reference logprobs; batched)."""
    return batched(lambda ids, attn: sequence_logprobs(model, ids, attn, temperature, chunk,
                                                       shared_prefix=shared_prefix)[0],
                   batch, micro_batch_size, device, tokens, even, shared_prefix)


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
