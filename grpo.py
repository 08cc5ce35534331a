"""
The RL math of nanoRL: token log-probs, advantages, policy losses, reductions, KL, TIS, DAPO, and
PPO's GAE and value loss (the critic model itself is critic.py).

Pure functions over torch tensors; nothing here knows about models, engines or configs.
Shapes: B sequences, T response tokens (right-padded), V vocabulary. mask (B, T) is 1 on tokens
the policy sampled and 0 on prompt / env / tool / pad tokens. group_ids (B,) are ints; samples
of one prompt share an id, groups need not be contiguous. Tested by `python -m pytest -q
tests/test_grpo.py` (hypothesis properties + hand-computed examples, CPU, seconds).

Token log-probs (the convention of the whole codebase: rollout.py's engines report the same)
    logp_t = x[y_t] - logsumexp(x),   x = logits_t / temperature      (no top-p renormalisation)
  computed in float32 chunks of rows with a custom backward, so neither the forward nor the
  saved-for-backward state holds a float32 (B, T, V) tensor (that is 19 GB at B*T = 32k, V = 152k).
  The backward recomputes softmax per chunk: d logp_t / d x = onehot(y_t) - softmax(x).
  The entropy H_t = -sum_v p_v log p_v can come out of the same pass, differentiable for an
  entropy bonus: dH_t / dx = -p * (log p + H_t).

Advantages (outcome reward r_i per sequence; group G of size n)
    GRPO         A_i = (r_i - mean_G r) / (std_G r + eps)
    Dr.GRPO      A_i = r_i - mean_G r
    RLOO         A_i = r_i - sum_{j != i} r_j / (n - 1) = (r_i - mean_G r) * n / (n - 1)
    REINFORCE++  G_t = r_t + gamma * G_{t+1} over policy tokens, then whitened over the batch's
                 masked tokens: (G - mu) / sqrt(var + 1e-8)
    RF++-baseline  a_i = r_i - mean_G r broadcast to tokens, then the same whitening
  Our choices: std is the unbiased (sample, n - 1) std, eps = 1e-6, and a group of one gets A = 0
  (no baseline, no signal). verl's core_algos differs there: it sets mean 0 and std 1 for a group
  of one, so A = r / (1 + eps); TRL uses eps 1e-4, nano-aha-moment the population std.
  Every estimator (and dynamic sampling) raises ValueError on a non-finite reward, naming its
  index: a NaN would otherwise be an advantage of 0 in some estimators and NaN in others. A group whose
  rewards are all equal gets exactly 0 (detected by max == min, not left to r - mean rounding,
  whose ~1e-7 residue over eps = 1e-6 would be an advantage of ~0.1 in float32). Whitening uses the
  unbiased variance over masked tokens (as verl's masked_whiten). For the per-token recursion
  (REINFORCE++) a mask-0 token inside a response (an env/tool observation in a multi-turn
  episode) is skipped: it is not a step of discounting, and
  rewards placed on it are ignored. With right padding only this is "reset at the mask end".
  (verl's core_algos REINFORCE++ multiplies the running return by the mask at every step, i.e.
  resets it at every mask-0 token, which cuts the final reward off earlier turns.) Mask-0
  positions get A = 0. Rewards on mask-0 positions are ignored (they may be junk).
  Positive weighting (weight_positive; W-REINFORCE of Zhu et al. 2025, arXiv 2506.01347, there on
  +1/-1 REINFORCE rewards, here on any estimator's A): A > 0 times w, A <= 0 as it is. A
  negative-advantage token's gradient pushes its probability down and spreads the mass over the
  other tokens in proportion to theirs, so the distribution keeps its spread; a positive one pulls
  mass onto itself and sharpens it. The paper found w = 0.1 kept pass@k at large k on math.

GAE (PPO with a learned critic V, critic.py; token rewards r_t and values V_t, both (B, T))
    delta_t = r_t + gamma V_t' - V_t,     A_t = delta_t + gamma lam A_t',     R_t = A_t + V_t
  t' is the next policy token of the same sequence; after the last one V = A = 0 (the episode is
  over; a truncated response is treated as finished too, as verl and SkyRL do: no bootstrap).
  A is then whitened over the batch's masked tokens like REINFORCE++ (as verl and SkyRL do for
  GAE); the returns R, the critic's regression targets, are not. A and R are 0 on mask-0 tokens.
  Special cases (pinned in tests/test_critic.py): lam = 1 gives A_t = G_t - V_t with G the
  discounted return above (Monte Carlo; V = 0 makes it exactly REINFORCE++), lam = 0 the one-step
  TD error A_t = delta_t, gamma = lam = 1 the reward-to-go minus V_t.
  Multi-turn: mask-0 tokens inside a response (tool output) are transparent, as in REINFORCE++:
  the recursion runs over policy tokens only, so an env block adds neither a discount step nor
  the values of its states. That is verl's core_algos compute_gae_advantage_return ("skip values
  and TD-error on observation tokens"); SkyRL's (skyrl_train/utils/ppo_utils.py) steps through
  every position, so an env block of k tokens adds k discounts and k bootstrapped values of
  tool-output states between two turns. verl and we agree on every policy token; off the mask
  verl leaves the running values in place, we put 0.

Value loss (PPO's clipped value loss, per token; v the critic now, v_old its values at rollout)
    l = 0.5 max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)       c = None or 0: 0.5 (v - R)^2
  (verl's compute_value_loss and SkyRL's ppo_critic_loss; verl's default c = 0.5.) Where the clipped
  term is the larger, its gradient is 0: vf_clipfrac is the share of masked tokens where it is
  strictly larger. Reduce with token_mean, as verl's critic does (SkyRL's takes seq-mean-token-mean).
  explained_variance = 1 - Var(R - V) / Var(R) over masked tokens: 1 for a perfect critic, 0 for
  one no better than a constant, < 0 worse.

Policy losses, per token (rho_t = exp(clamp(logp - logp_old, -20, 20)), sg = stop-gradient)
    PPO clip  l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)    (DAPO clip-higher:
              eps_low 0.2, eps_high 0.28);  dual clip where A < 0: l = min(l, -c A), c > 1
    GSPO      s_i = exp(sum_t m (logp - logp_old) / sum_t m);  token form
              s_it = sg(s_i) * exp(logp_t - sg(logp_t)), then the PPO clip with s_it for rho.
              s_it has the value s_i and d s_it / d logp_t = s_i; reduce with seq_mean_token_mean
              to get the paper's (1/|y_i|) sum_t. Its stats describe s_i (one value per sequence).
    CISPO     l = -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * logp   (eps_low = 1 disables
              the lower clip since rho > 0, as MiniMax-M1 does; eps_high is ours to tune)
    Clip-Cov  the PPO clip, times 0 on a random frac (2e-4, at least one) of the unclipped masked
              tokens with cov_t = (A_t - mean A)(logp_t - mean logp) in (1, 5): the few tokens
              that drive entropy collapse stop pushing (verl's and SkyRL's clip_cov; works
              on-policy).
    KL-Cov    no clip: l = -rho A, plus coef |logp - logp_old| on the frac (2e-4, at least one) of
              masked tokens with the largest cov_t (verl's kl_cov): those tokens are held near the
              policy that sampled them. Needs several updates a step: at ratio 1 the term and its
              gradient are 0.
  Forking tokens (top_entropy_mask; Wang et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939):
              any loss above on the ceil(frac n) masked tokens of highest entropy H_t only (the
              "forks" where the policy is unsure; 0.2 in the paper), the rest out of the gradient.
  The clip ranges have no defaults here: callers pass them (config.py's CLIP table is the one source).
  The log-ratio is taken as 0 on mask-0 tokens, so junk log-probs on pad positions reach neither
  the loss, the gradient nor the stats.
  Each returns (loss (B, T) with 0 on mask-0 tokens, stats) where stats are detached 0-d tensors
  (no .item() here: that would be a GPU sync per call) over masked tokens: clip_frac (fraction
  of tokens whose gradient the clip cut), ratio_min / ratio_mean / ratio_max.

Reductions (where frameworks disagree most)
    token_mean              sum_{i,t} l m / D,  D = sum_{i,t} m by default
    seq_mean_token_mean     (1/N) sum_i [sum_t l m / sum_t m]          (GRPO paper, TRL "grpo")
    seq_mean_token_sum_norm sum_{i,t} l m / (N * L_max)                (Dr.GRPO)
  D and N default to this call's batch; with gradient accumulation over micro-batches (or
  ranks) pass the global token count D / sequence count N of the whole optimizer step, so the
  sum of the micro-batch losses equals the loss of the full batch exactly. For Dr.GRPO we
  divide by the number of sequences as TRL does (verl does not); L_max is the configured max
  response length, a constant, not this batch's longest response.

KL to a reference policy (delta = logp - logp_ref), per token
    k1 = delta,  k2 = delta^2 / 2,  k3 = exp(-delta) + delta - 1  with -delta clamped to +-20.
  k3 >= 0 and is 0 exactly when the log-probs agree (computed as expm1(x) - x, x = -delta).

Truncated importance sampling (FlashRL) between trainer (old) and rollout-engine log-probs
    token:    w_t = sg(min(exp(logp_old_t - logp_rollout_t), C))                   C = 2 (SkyRL, verl)
    sequence: w_i = sg(min(exp(sum_t m (logp_old - logp_rollout)), C))   SkyRL uses C = 5 here
    mode "mask" (MIS / IcePop) instead keeps w = 1 where the ratio is in [low, C], else 0;
      low defaults to 1 / C.
  The loss becomes w * l_t. Log-ratios are clamped to +-20 before exp. In mask mode the caller
  (train.py) goes further and multiplies the loss mask by w: a rejected token is then out of
  every denominator, the advantages and their whitening, KL and entropy, exactly as if its mask
  were 0 (verl's rollout correction replaces response_mask the same way); w * l_t alone would
  leave it in the token-mean denominator with its KL term.

DAPO
    dynamic sampling: keep only groups whose rewards are not all equal (exact comparison;
      a group of one is dropped, it has no variance and A = 0 anyway).
    overlong punishment (L_max, L_buf, f):  0 if |y| <= L_max - L_buf;
      -(|y| - (L_max - L_buf)) / L_buf * f inside the buffer;  -f if |y| > L_max.
    overlong filtering: zero the mask of truncated samples.
"""

import math

import torch
from torch.autograd.function import once_differentiable

# -----------------------------------------------------------------------------
# token log-probs and entropy from logits

class _ChunkedTokenLogprob(torch.autograd.Function):
    """(logp (N,), entropy (N,)) of targets (N,) under logits (N, V) / temperature, chunked over
    rows. The entropy is computed (and differentiable) only if with_entropy; else it is empty."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size, with_entropy):
        # bf16/fp16 are upcast to float32 per chunk; float64 stays float64 (for gradcheck)
        cdtype = torch.promote_types(logits.dtype, torch.float32)
        N = logits.shape[0]
        out = torch.empty(N, dtype=cdtype, device=logits.device)
        lse = torch.empty(N, dtype=cdtype, device=logits.device)
        ent = torch.empty(N if with_entropy else 0, dtype=cdtype, device=logits.device)
        for s in range(0, N, chunk_size):
            x = logits[s:s + chunk_size].to(cdtype) / temperature  # (n, V): the big temporary
            lse[s:s + chunk_size] = torch.logsumexp(x, dim=-1)
            tgt = x.gather(-1, targets[s:s + chunk_size, None]).squeeze(-1)  # (n,)
            out[s:s + chunk_size] = tgt - lse[s:s + chunk_size]
            if with_entropy:  # H = sum_i entr(p_i); entr(0) = 0, so -inf logits are fine
                ent[s:s + chunk_size] = torch.special.entr(x.sub_(lse[s:s + chunk_size, None]).exp_()).sum(-1)
        # save the model's (bf16) logits, which exist anyway, and the (N,) lse; not the float32 chunks
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None
        return out, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        T, C = ctx.temperature, ctx.chunk_size
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


def token_logprobs(logits, targets, temperature=1.0, chunk_size=512, entropy=False):
    """log p(targets) under softmax(logits / temperature): (..., V), (...) -> (...) float32; with
    entropy=True, (logp, entropy of softmax(logits / temperature)), both differentiable (one pass
    over the logits; an entropy bonus in the loss backpropagates through the second).

    targets must be valid ids everywhere (pad with any id and mask later; -100 would index out of
    range). chunk_size rows are upcast at a time: 512 x 152k x 4 bytes = 311 MB of temporaries.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)  # (B*T, V): a view if contiguous, else one copy in the logits' dtype
    logp, ent = _ChunkedTokenLogprob.apply(flat, targets.reshape(-1).long(), float(temperature), int(chunk_size),
                                           bool(entropy))
    return (logp.view(targets.shape), ent.view(targets.shape)) if entropy else logp.view(targets.shape)


@torch.no_grad()
def entropy(logits, temperature=1.0, chunk_size=512):
    """Entropy of softmax(logits / temperature), (..., V) -> (...) float32. A metric: no gradient."""
    cdtype = torch.promote_types(logits.dtype, torch.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=cdtype, device=logits.device)
    for s in range(0, flat.shape[0], chunk_size):
        p = torch.softmax(flat[s:s + chunk_size].to(cdtype) / temperature, dim=-1)  # (n, V)
        out[s:s + chunk_size] = torch.special.entr(p).sum(-1)  # entr(0) = 0, so -inf logits are fine
    return out.view(logits.shape[:-1])

# -----------------------------------------------------------------------------
# masked helpers

def masked_mean(x, mask):
    """Mean of x over mask == 1 (0 if the mask is empty); values under mask 0 may be inf/nan."""
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum() / (mask > 0).sum().clamp(min=1)


def masked_whiten(x, mask, eps=1e-8):
    """(x - mu) / sqrt(var + eps) over masked entries, unbiased var; 0 where mask is 0."""
    keep = mask > 0
    n = keep.sum()
    mu = masked_mean(x, mask)
    dev = torch.where(keep, x - mu, torch.zeros_like(x))
    var = (dev ** 2).sum() / (n - 1).clamp(min=1)
    return dev * torch.rsqrt(var + eps)


def broadcast_to_tokens(adv, mask):
    """Outcome advantages (B,) -> per-token (B, T), 0 on mask-0 tokens."""
    return adv[:, None].to(torch.promote_types(adv.dtype, torch.float32)) * mask


def _check_finite(rewards, where):
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"{where}: non-finite rewards at indices {bad[:8]} ({rewards[bad[0]].item()}): "
                         "every reward must be a finite number")


def last_token_rewards(rewards, mask):
    """Put each sequence's outcome reward (B,) on its last masked token -> (B, T) (for REINFORCE++)."""
    _check_finite(rewards, "last_token_rewards")
    B, T = mask.shape
    pos = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask > 0, pos, -1).max(dim=1).values  # (B,) index of the last policy token, -1 if none
    out = torch.zeros(B, T, dtype=torch.promote_types(rewards.dtype, torch.float32), device=mask.device)
    has = last >= 0
    out[has, last[has]] = rewards[has].to(out.dtype)
    return out

# -----------------------------------------------------------------------------
# advantages

def _groups(rewards, group_ids, where):
    """Float rewards (B,), dense group index inv (B,), and per-sample "group rewards not all equal" (B,)."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"{where}: rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be (B,)")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    _check_finite(r, where)
    _, inv = torch.unique(group_ids, return_inverse=True)  # (B,) dense group index; any ids, any order
    G = int(inv.max()) + 1 if inv.numel() else 0
    hi = torch.full((G,), -float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    lo = torch.full((G,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin")
    return r, inv, (hi > lo)[inv]


def _group_stats(rewards, group_ids, where):
    """Per-sample (r - group mean, unbiased group std, group size), each (B,)."""
    r, inv, varied = _groups(rewards, group_ids, where)
    G = int(inv.max()) + 1 if inv.numel() else 0
    n = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, r) / n
    # two-pass variance: subtracting the mean first avoids cancellation for large rewards
    ss = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, (r - mean[inv]) ** 2)
    std = torch.sqrt(ss / (n - 1).clamp(min=1))  # groups of one: ss = 0 -> std 0
    # a group of equal rewards must give exactly 0: sum/n rounds, and (r - mean) ~ 1e-7 divided
    # by std + eps ~ 1e-6 would be an advantage of ~0.1 in float32
    centered = torch.where(varied, r - mean[inv], torch.zeros_like(r))
    return centered, std[inv], n[inv]


def grpo_advantages(rewards, group_ids, eps=1e-6):
    """GRPO: (r - mean_G) / (std_G + eps), (B,) -> (B,). A group of one gets 0."""
    centered, std, _ = _group_stats(rewards, group_ids, "advantages")
    return centered / (std + eps)


def drgrpo_advantages(rewards, group_ids):
    """Dr.GRPO: r - mean_G (no std division), (B,) -> (B,)."""
    return _group_stats(rewards, group_ids, "advantages")[0]


def rloo_advantages(rewards, group_ids):
    """RLOO: r_i minus the mean of the others in its group, (B,) -> (B,). A group of one gets 0."""
    centered, _, n = _group_stats(rewards, group_ids, "advantages")
    return centered * n / (n - 1).clamp(min=1)  # n = 1: centered = 0 already


def weight_positive(adv, weight):
    """A > 0 times weight, A <= 0 unchanged (module doc: W-REINFORCE); any shape. weight 1: adv itself."""
    return adv if weight == 1 else torch.where(adv > 0, adv * weight, adv)


def _discounted_returns(token_rewards, mask, gamma):
    """G_t = r_t + gamma G_{t'} where t' is the next policy token; mask-0 tokens are skipped. (B, T)."""
    m = mask.to(torch.promote_types(token_rewards.dtype, torch.float32))
    r = torch.where(mask > 0, token_rewards, torch.zeros_like(m))  # (B, T); where: junk off-mask may be nan
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])  # (B,)
    for t in reversed(range(r.shape[1])):  # T python steps of (B,) ops, cheap next to a forward pass
        running = torch.where(m[:, t] > 0, r[:, t] + gamma * running, running)
        out[:, t] = running * m[:, t]
    return out


def reinforce_pp_advantages(token_rewards, mask, gamma=1.0):
    """REINFORCE++: discounted returns of token rewards (B, T), whitened over masked tokens -> (B, T)."""
    return masked_whiten(_discounted_returns(token_rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(rewards, group_ids, mask):
    """REINFORCE++-baseline: (r - mean_G) broadcast to tokens, whitened over masked tokens -> (B, T)."""
    return masked_whiten(broadcast_to_tokens(drgrpo_advantages(rewards, group_ids), mask), mask)


def gae_advantages(token_rewards, values, mask, gamma, lam, whiten=True):
    """GAE over policy tokens (mask-0 tokens skipped): (advantages, returns), both (B, T), 0 off the mask.

    returns = A + V before the whitening; see the module docstring for the multi-turn convention."""
    if not (token_rewards.shape == values.shape == mask.shape):
        raise ValueError(f"gae_advantages: token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)}, "
                         f"mask {tuple(mask.shape)} must all be (B, T)")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae_advantages: need 0 <= gamma, lam <= 1, got gamma={gamma}, lam={lam}")
    on = mask > 0
    dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)
    # where(), not * mask: off-mask values and rewards may be junk (nan on pad positions)
    r = torch.where(on, token_rewards.to(dtype), torch.zeros((), dtype=dtype))  # (B, T)
    v = torch.where(on, values.to(dtype), torch.zeros((), dtype=dtype))  # (B, T)
    if not torch.isfinite(v).all():
        raise ValueError(f"gae_advantages: {int((~torch.isfinite(v)).sum())} non-finite values on policy tokens "
                         "(a diverged critic?)")
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])  # (B,) V of the next policy token; 0 after the last one
    running = torch.zeros_like(r[:, 0])  # (B,) A of the next policy token
    for t in reversed(range(r.shape[1])):  # T python steps of (B,) ops, cheap next to a forward pass
        delta = r[:, t] + gamma * next_v - v[:, t]
        running = torch.where(on[:, t], delta + gamma * lam * running, running)  # mask 0: carried through
        next_v = torch.where(on[:, t], v[:, t], next_v)
        adv[:, t] = torch.where(on[:, t], running, torch.zeros_like(running))
    returns = adv + v  # 0 + 0 off the mask
    return (masked_whiten(adv, mask) if whiten else adv), returns

# -----------------------------------------------------------------------------
# policy losses: per-token (B, T) losses + stats; reduce with the functions below

def _ratio_stats(ratio, mask, clipped):
    """Detached 0-d stats over masked tokens (zeros for an empty mask)."""
    with torch.no_grad():
        keep = mask > 0
        has = keep.any()
        inf = torch.tensor(float("inf"), dtype=ratio.dtype, device=ratio.device)
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        return {
            "clip_frac": masked_mean(clipped.to(ratio.dtype), mask),
            "ratio_min": torch.where(has, torch.where(keep, ratio, inf).min(), zero),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": torch.where(has, torch.where(keep, ratio, -inf).max(), zero),
        }


def _clip_terms(log_ratio, adv, eps_low, eps_high):
    """(ratio, -rho A, -clip(rho) A), each (B, T): PPO's two terms; where the second is larger the
    clip cuts the token's gradient."""
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # (B, T); clamp keeps exp finite
    return ratio, -adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)


def _clipped_surrogate(log_ratio, adv, mask, eps_low, eps_high, dual_clip):
    """The PPO clip given a (possibly GSPO token-form) log-ratio. Returns (loss (B, T), stats)."""
    if log_ratio.shape != adv.shape or adv.shape != mask.shape:
        raise ValueError(f"policy loss: log-ratio {tuple(log_ratio.shape)}, adv {tuple(adv.shape)}, "
                         f"mask {tuple(mask.shape)} must all be (B, T); broadcast outcome adv with broadcast_to_tokens")
    ratio, l1, l2 = _clip_terms(log_ratio, adv, eps_low, eps_high)
    loss = torch.maximum(l1, l2)  # -min(rho A, clip(rho) A)
    clipped = l2 > l1  # gradient cut by the clip
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        l3 = -adv * dual_clip
        dual = (adv < 0) & (l3 < loss)
        loss = torch.where(adv < 0, torch.minimum(loss, l3), loss)
        clipped = clipped | dual
    # where(), not loss * mask: pad tokens may carry inf/nan logp and inf * 0 = nan
    loss = torch.where(mask > 0, loss, torch.zeros_like(loss))
    stats = _ratio_stats(ratio, mask, clipped)
    if dual_clip is not None:
        stats["dual_clip_frac"] = masked_mean(dual.to(ratio.dtype), mask).detach()
    return loss, stats


def ppo_clip_loss(logp, old_logp, adv, mask, eps_low, eps_high, dual_clip=None):
    """PPO clipped surrogate per token (PPO: eps 0.2 / 0.2; DAPO clip-higher: 0.2 / 0.28), optional
    dual clip c for A < 0."""
    # mask-0 tokens get log-ratio 0: pad positions may hold junk logp, which must not reach the stats or grads
    log_ratio = torch.where(mask > 0, logp - old_logp.detach(), torch.zeros_like(logp))  # (B, T)
    return _clipped_surrogate(log_ratio, adv, mask, eps_low, eps_high, dual_clip)


def gspo_loss(logp, old_logp, adv, mask, eps_low, eps_high):
    """GSPO: the PPO clip on the sequence ratio in its token form (GSPO paper's eps 3e-4 / 4e-4)."""
    m = mask.to(logp.dtype)
    delta = torch.where(mask > 0, logp - old_logp.detach(), torch.zeros_like(logp))  # (B, T)
    seq_log_ratio = delta.sum(1) / m.sum(1).clamp(min=1)  # (B,) mean log-ratio over the sequence
    # value = seq ratio, gradient = seq ratio * d logp_t (each token pushed by its sequence's ratio)
    log_ratio = seq_log_ratio.detach()[:, None] + delta - delta.detach()  # (B, T)
    return _clipped_surrogate(log_ratio, adv, mask, eps_low, eps_high, None)


def cispo_loss(logp, old_logp, adv, mask, eps_low, eps_high):
    """CISPO: -sg(clip(rho)) * A * logp per token; the clip bounds the weight, never drops a gradient."""
    if logp.shape != adv.shape or adv.shape != mask.shape:
        raise ValueError(f"cispo_loss: logp {tuple(logp.shape)}, adv {tuple(adv.shape)}, mask {tuple(mask.shape)} must all be (B, T)")
    log_ratio = torch.where(mask > 0, (logp - old_logp).detach(), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # (B, T)
    w = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.where(mask > 0, -w * adv * logp, torch.zeros_like(logp))
    return loss, _ratio_stats(ratio, mask, w != ratio)


def _covariance(lp, adv, mask):
    """Clip-Cov's and KL-Cov's cov_t = (A_t - mean A)(logp_t - mean logp), the means over the masked
    tokens, (B, T); lp holds 0, not junk, on mask-0 tokens."""
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


def clip_cov_loss(logp, old_logp, adv, mask, eps_low, eps_high, frac=2e-4, cov_low=1.0, cov_high=5.0, generator=None):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv 2505.22617): PPO's clip, and the gradient of a few tokens taken out.
    Which: a random frac of the masked tokens (at least one; none at frac 0) among those the clip left alone whose
    centred covariance of log-prob and advantage

        cov_t = (A_t - mean A) (logp_t - mean logp)          (means over the masked tokens)

    lies in (cov_low, cov_high). Why: under a policy-gradient step the entropy falls by about the
    covariance of logp and A over the sampled tokens, and a small set of tokens with a large
    positive one (a likely token in a good answer, an unlikely one in a bad answer) drives most of
    the collapse. Those tokens' loss is set to 0, value and gradient (as verl and SkyRL do; their
    defaults are the ones here). It acts on-policy too: it needs no ratio away from 1. Where the
    means are taken is the caller's batch (train.py: a micro-batch, as verl's micro-batches).
    Returns (loss (B, T), stats + cov_clip_frac: the share of masked tokens taken out)."""
    loss, stats = ppo_clip_loss(logp, old_logp, adv, mask, eps_low, eps_high)
    with torch.no_grad():
        on = mask > 0
        lp = torch.where(on, logp, torch.zeros_like(logp))  # pad positions may hold junk
        _, l1, l2 = _clip_terms(torch.where(on, lp - old_logp, torch.zeros_like(lp)), adv, eps_low, eps_high)
        clipped = l2 > l1  # PPO cut these already
        cov = _covariance(lp, adv, mask)
        idx = (on & ~clipped & (cov > cov_low) & (cov < cov_high)).flatten().nonzero().squeeze(1)
        k = min(max(int(frac * int(on.sum())), 1) if frac > 0 else 0, len(idx))  # at least one, as verl
        pick = idx[torch.randperm(len(idx), generator=generator)[:k].to(idx.device)]
        keep = torch.ones(mask.numel(), dtype=loss.dtype, device=loss.device)
        keep[pick] = 0.0
        keep = keep.view_as(loss)
        stats["cov_clip_frac"] = masked_mean(1.0 - keep, mask)
    return loss * keep, stats


def kl_cov_loss(logp, old_logp, adv, mask, frac=2e-4, coef=1.0):
    """KL-Cov (Cui et al. 2025, Clip-Cov's paper): no clip; every token's loss is -rho A, and the
    frac of the masked tokens (at least one; none at frac 0) with the largest cov_t (Clip-Cov's
    covariance above) also pay coef |logp - logp_old|. Where Clip-Cov takes those tokens out of the
    gradient, KL-Cov pulls them back towards the policy that sampled them, the harder the further
    they have moved. verl's kl_cov, with its defaults. It needs an old policy to differ from: with
    logp_old = sg(logp) (one on-policy update a step) the term and its gradient are 0 (torch's
    d|x|/dx at 0 is 0), so config.py refuses it there. Where the means and the top frac are taken
    is the caller's batch (train.py: a micro-batch, as for Clip-Cov).
    Returns (loss (B, T), stats + kl_cov_frac: the share of masked tokens that pay the term)."""
    if logp.shape != adv.shape or adv.shape != mask.shape:
        raise ValueError(f"kl_cov_loss: logp {tuple(logp.shape)}, adv {tuple(adv.shape)}, mask {tuple(mask.shape)} must all be (B, T)")
    on = mask > 0
    zero = torch.zeros_like(logp)
    log_ratio = torch.where(on, logp - old_logp.detach(), zero)  # pad positions may hold junk
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # (B, T)
    with torch.no_grad():
        lp = torch.where(on, logp, zero)
        cov = _covariance(lp, adv, mask)
        n = int(on.sum())  # one host sync: topk needs k
        k = max(int(frac * n), 1) if n and frac > 0 else 0
        top = torch.where(on, cov, torch.full_like(cov, -math.inf)).flatten().topk(k).indices
        held = torch.zeros(mask.numel(), dtype=logp.dtype, device=logp.device)
        held[top] = 1.0
        held = held.view_as(logp)
    loss = torch.where(on, -adv * ratio + coef * held * log_ratio.abs(), zero)
    stats = _ratio_stats(ratio, mask, torch.zeros_like(on))
    stats["kl_cov_frac"] = masked_mean(held, mask)
    return loss, stats


def top_entropy_mask(entropy, mask, frac):
    """1.0 on the ceil(frac n) highest-entropy tokens of the n masked ones (ties at the threshold all
    kept), 0.0 elsewhere, as mask's dtype (B, T); frac >= 1 returns mask. Wang et al. 2025 (module
    doc) train on these "forking" tokens only: most tokens of a response are near-certain, and the
    paper found the policy gradient of the ~20% unsure ones carries the gains while keeping the
    entropy up. The threshold is over the caller's batch (train.py: a micro-batch, where the
    entropy is computed). entropy must be finite on masked tokens (pad junk is ignored)."""
    if frac >= 1:
        return mask
    on = mask > 0
    n = int(on.sum())  # one host sync: topk needs k
    if n == 0:
        return torch.zeros_like(mask)
    k = min(n, max(1, math.ceil(frac * n)))
    threshold = entropy[on].topk(k).values[-1]
    return (on & (entropy >= threshold)).to(mask.dtype)

# -----------------------------------------------------------------------------
# the critic's loss (PPO with GAE; the model is critic.py)

def value_loss(values, old_values, returns, mask, clip=None):
    """PPO's clipped value loss per token (B, T), 0 on mask-0 tokens, and detached 0-d stats
    (vf_clipfrac, value_mean) over masked tokens. clip None or 0: the plain 0.5 (v - R)^2."""
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(f"value_loss: values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, "
                         f"returns {tuple(returns.shape)}, mask {tuple(mask.shape)} must all be (B, T)")
    if clip is not None and clip < 0:
        raise ValueError(f"value_loss: clip must be None, 0 (off) or > 0, got {clip}")
    # junk off the mask (pad positions) is replaced before any arithmetic, not masked after it:
    # where() passes a zero gradient to the junk, but nan * 0 = nan in the squares' backward
    on = mask > 0
    v = torch.where(on, values, torch.zeros_like(values))  # (B, T)
    old = torch.where(on, old_values.detach(), torch.zeros_like(v))
    R = torch.where(on, returns.detach(), torch.zeros_like(v))
    l1 = (v - R) ** 2
    if clip:
        v_clipped = torch.maximum(torch.minimum(v, old + clip), old - clip)  # clip(v, old - c, old + c)
        l2 = (v_clipped - R) ** 2
        loss, clipped = 0.5 * torch.maximum(l1, l2), l2 > l1  # clipped: this token's gradient is 0
    else:
        loss, clipped = 0.5 * l1, torch.zeros_like(mask, dtype=torch.bool)
    loss = torch.where(on, loss, torch.zeros_like(loss))
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean(clipped.to(loss.dtype), mask), "value_mean": masked_mean(v, mask)}
    return loss, stats


@torch.no_grad()
def explained_variance(values, returns, mask):
    """1 - Var(R - V) / Var(R) over masked tokens, a 0-d tensor (0 when Var(R) = 0 or the mask is empty)."""
    def var(x):
        keep = mask > 0
        dev = torch.where(keep, x - masked_mean(x, mask), torch.zeros_like(x))
        return (dev ** 2).sum() / keep.sum().clamp(min=1)
    var_r = var(returns)
    ev = 1.0 - var(returns - values) / var_r.clamp(min=torch.finfo(var_r.dtype).tiny)
    return torch.where(var_r > 0, ev, torch.zeros_like(ev))

# -----------------------------------------------------------------------------
# reductions: per-token (B, T) -> scalar. Pass the global denominators under grad accumulation.

def token_mean(x, mask, denom=None):
    """sum(x m) / denom, denom = sum(m) of this batch unless given (the step's global token count)."""
    total = torch.where(mask > 0, x, torch.zeros_like(x)).sum()
    if denom is None:
        denom = mask.sum().clamp(min=1)
    return total / denom


def seq_mean_token_mean(x, mask, num_seqs=None):
    """(1/N) sum_i mean_t(x_i over m_i); N = B unless given. Empty sequences add 0 but count in N."""
    m = mask.to(x.dtype)
    per_seq = torch.where(mask > 0, x, torch.zeros_like(x)).sum(1) / m.sum(1).clamp(min=1)  # (B,)
    return per_seq.sum() / (x.shape[0] if num_seqs is None else num_seqs)


def seq_mean_token_sum_norm(x, mask, max_len, num_seqs=None):
    """Dr.GRPO: sum(x m) / (N * max_len), N = B unless given, max_len the configured response cap."""
    total = torch.where(mask > 0, x, torch.zeros_like(x)).sum()
    return total / ((x.shape[0] if num_seqs is None else num_seqs) * max_len)

# -----------------------------------------------------------------------------
# KL estimators and truncated importance sampling

def kl(logp, ref_logp, kind="k3"):
    """Per-token KL estimate of pi vs pi_ref from sampled-token log-probs: k1, k2 or k3."""
    delta = logp - ref_logp  # (B, T)
    if kind == "k1":
        return delta
    elif kind == "k2":
        return 0.5 * delta ** 2
    elif kind == "k3":
        x = (-delta).clamp(-20.0, 20.0)
        # expm1(x) - x is exp(x) - 1 - x without cancellation near 0; clamp guards a rounding ulp below 0
        return (torch.expm1(x) - x).clamp(min=0.0)
    else:
        raise ValueError(f"kl: kind must be 'k1', 'k2' or 'k3', got {kind!r}")


@torch.no_grad()
def tis_weights(old_logp, rollout_logp, mask, level="token", mode="truncate", cap=2.0, low=None):
    """Detached importance weights trainer/rollout (B, T), 0 on mask-0 tokens. See module docstring."""
    m = mask.to(torch.promote_types(old_logp.dtype, torch.float32))
    delta = torch.where(mask > 0, old_logp - rollout_logp, torch.zeros_like(m))  # (B, T)
    if level == "token":
        ratio = torch.exp(delta.clamp(-20.0, 20.0))  # (B, T)
    elif level == "sequence":
        ratio = torch.exp(delta.sum(1, keepdim=True).clamp(-20.0, 20.0)).expand_as(m)  # (B, T)
    else:
        raise ValueError(f"tis_weights: level must be 'token' or 'sequence', got {level!r}")
    if mode == "truncate":
        if low is not None:
            raise ValueError("tis_weights: low is only used by mode='mask' (truncate caps from above only)")
        w = ratio.clamp(max=cap)
    elif mode == "mask":
        lo = 1.0 / cap if low is None else low
        w = ((ratio >= lo) & (ratio <= cap)).to(m.dtype)
    else:
        raise ValueError(f"tis_weights: mode must be 'truncate' or 'mask', got {mode!r}")
    return w * m

# -----------------------------------------------------------------------------
# DAPO

def dynamic_sampling_keep(rewards, group_ids):
    """Bool (B,): True for samples whose group's rewards are not all equal (groups of one are dropped)."""
    return _groups(rewards, group_ids, "dynamic_sampling_keep")[2]


def overlong_punishment(lengths, max_len, buffer, factor=1.0):
    """DAPO soft overlong punishment (B,) -> (B,): 0, then linear to -factor over the last `buffer` tokens."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong_punishment: need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    L = lengths.to(torch.float64)
    over = (L - (max_len - buffer)).clamp(min=0.0) / buffer  # 0 .. 1 inside the buffer
    out = torch.where(L > max_len, torch.ones_like(L), over.clamp(max=1.0)) * -factor
    return out.to(torch.float32)


def overlong_filter_mask(mask, truncated):
    """DAPO overlong filtering: mask (B, T) with the rows of truncated (B,) bool samples zeroed."""
    return mask * (~truncated.bool())[:, None].to(mask.dtype)
