"""
--shared-prefix (on by default): a micro-batch's shared prefix computed once (Prefix Grouper, arXiv
2506.05433). A GRPO group's n rows share their prompt, and in the MCP env every row starts with the
same ~1.9k-token system + tool block. b rows whose real tokens agree on their first p run as ONE row

    [prefix (p) | suffix_1 (s_1) | ... | suffix_b (s_b)]      positions 0..p-1, p..l_1-1, ..., p..l_b-1

under a block mask: a prefix token attends causally within the prefix, a suffix token to the whole
prefix and causally to its own suffix. Every token sees the context and position it has in its
padded row, so logp, entropy and gradients are the padded path's up to float rounding; the prefix's
logprobs are gathered into every row, so backward sums the rows' gradients into one computation.
Tokens through the decoder: p + sum(s_i) instead of b x (p + max s_i).

Choices. The mask is additive, not boolean (SDPA would keep a float copy per layer for backward),
one (1, 1, L, L) tensor. A dense mask makes SDPA compute all L x L pairs, so a packed row stops at
packed_limit(p) tokens, where the linear layers' saving and the extra attention balance, and the
padded path runs where sharing does not pay (p < MIN_SHARED, or packing would not halve the
tokens). A mask, not the prefix's KV cache: under gradient checkpointing transformers' decoder
layers drop past_key_values (modeling_layers.GradientCheckpointingLayer, 5.17 and 5.23), so the
suffixes would silently attend to nothing. transformers passes a 4D attention_mask through as it is
(masking_utils, 5.17 and 5.23). train.py turns the flag off where the mask would not be honoured
(packable).

Test: python -m pytest -q tests/test_options.py   (its options/prefix.py section: packed == padded, logprobs and gradients)
"""
import math

import torch

from score import in_chunks, is_compiled, micro_batches as padded_micro_batches, score_logits
from score import next_fit, sequence_logprobs as padded_logprobs, unwrap

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
    else:  # the hidden states at `scored` (N, d), then the LM head chunk by chunk
        lp, ent = in_chunks(model, kw, (0, scored), targets, temperature, chunk, entropy)
    # a gather: a prefix position's value goes to every row, so backward sums the rows' gradients into it
    keep, at = where >= 0, where.clamp(min=0)  # (b, T-1)
    logp = torch.where(keep, lp[at], 0.0)
    return logp, torch.where(keep, ent[at], 0.0) if entropy else None


def sequence_logprobs(model, ids, attn, temperature=1.0, chunk=0, entropy=False):
    """score.sequence_logprobs' numbers, with the rows' shared prefix run once where that pays."""
    if packable(model):
        host, lengths = ids.cpu(), attn.sum(1).cpu()  # the packing's shapes are host ints: one sync
        p = shared_prefix_len(host, lengths)
        if p:
            return packed_logprobs(model, host, lengths, p, ids.device, temperature, chunk, entropy)
    return padded_logprobs(model, ids, attn, temperature, chunk, entropy)


def micro_batches(lengths, idx, size, tokens=0, ids=None):
    """score.micro_batches for packed rows. ids: the batch's input_ids (B, T) on the CPU. Rows in trie
    order (sorted by their tokens: a group's rows are adjacent, then groups sharing a system block),
    `size` at a time, or with a budget packed while the forward's tokens (forward_tokens) <= tokens
    and a packed row <= packed_limit(p). Micro-batches that do not pack (a short GSM8K prompt) give
    their rows back to the padded rule, by length: trie order would pad each group's answers to its
    longest one."""
    order = sorted(idx.tolist(), key=lambda r: ids[r, :int(lengths[r])].tolist())
    idx = torch.tensor(order, dtype=torch.long)
    if not tokens:
        return [idx[s:s + size] for s in range(0, len(idx), size)]

    def shared(r):  # within the budget, and a packed row no longer than pays (packed_limit)
        p = shared_prefix_len(ids[r], lengths[r])
        n = forward_tokens(lengths[r], p)
        return n <= tokens and (not p or n <= packed_limit(p))

    packs, rest = [], []
    for r in next_fit(idx, shared):
        (packs if shared_prefix_len(ids[r], lengths[r]) else rest).append(r)
    return packs + (padded_micro_batches(lengths, torch.cat(rest), size, tokens) if rest else [])
