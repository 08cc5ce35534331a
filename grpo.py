"""
The RL math: advantages, policy losses, reductions, KL, TIS and DAPO's pieces. Pure functions over
torch tensors; nothing here knows about models, engines or configs. Token log-probs are score.py's;
GAE and the value loss are options/critic.py's; Clip-Cov, KL-Cov and other entropy remedies
options/entropy.py's. Shapes: B sequences, T tokens (right-padded); mask (B, T) is 1 on tokens the
policy sampled, 0 on prompt / env / tool / pad tokens; group_ids (B,): a prompt's samples share one.

    GRPO          A_i = (r_i - mean_G r) / (std_G r + eps)
    Dr.GRPO       A_i = r_i - mean_G r
    RLOO          A_i = r_i - sum_{j != i} r_j / (n - 1)
    REINFORCE++   G_t = r_t + gamma G_t' over policy tokens, whitened over the batch's masked tokens
    RF++-baseline A_i = r_i - mean_G r on every token, whitened the same way
    PPO clip      l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A),  rho_t = exp(logp_t - old_t)
    dual clip     l_t = min(l_t, -c A) where A < 0                (config.DUAL_CLIP: c = 3, as verl)
    GSPO          the PPO clip with rho_t -> s_i = exp(mean_t (logp_t - old_t)), in token form
    CISPO         l_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A logp_t
    token-mean    sum_it l m / sum_it m          seq-mean-token-mean  (1/N) sum_i mean_t l
    seq-mean-token-sum-norm   sum_it l m / (N L_max)                             (Dr.GRPO)
    KL            k1 = d,  k2 = d^2 / 2,  k3 = exp(-d) + d - 1,        d = logp - logp_ref
    TIS           w_t = sg(min(exp(old_t - logp_rollout_t), C))                  (FlashRL, C = 2)
    DAPO          keep groups whose rewards differ; overlong punishment, overlong filtering

Our choices where frameworks disagree (each function's docstring says more):
  1. std is the unbiased group std, eps = 1e-6, and a group of one gets A = 0 (verl: r / (1 + eps);
     TRL's eps is 1e-4).
  2. A group of equal rewards gets exactly 0 (max == min), not the rounding residue of r - mean.
  3. A non-finite reward is a ValueError naming its index, in every estimator (token rewards: on
     the policy's tokens; junk off the mask is ignored).
  4. REINFORCE++'s recursion skips mask-0 tokens inside a response (tool output); verl resets it.
  5. Dr.GRPO's reduction divides by the number of sequences, as TRL does (verl does not).
  6. Reductions take the whole mini-batch's token / sequence count (denom, num_seqs), so
     micro-batching and several GPUs leave the gradient unchanged.
  7. Log-ratios are 0 on mask-0 tokens and clamped to +-20 before exp: pad junk reaches nothing.

Test: python -m pytest -q tests/test_grpo.py   (hypothesis properties + hand-computed examples)
"""
import torch

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
    """GRPO: (r - mean_G) / (std_G + eps), (B,) -> (B,), unbiased std. A group of one gets 0: no
    baseline, no signal (verl sets mean 0, std 1 there, so A = r / (1 + eps); TRL uses eps 1e-4,
    nano-aha-moment the population std)."""
    centered, std, _ = _group_stats(rewards, group_ids, "advantages")
    return centered / (std + eps)


def drgrpo_advantages(rewards, group_ids):
    """Dr.GRPO: r - mean_G (no std division), (B,) -> (B,)."""
    return _group_stats(rewards, group_ids, "advantages")[0]


def rloo_advantages(rewards, group_ids):
    """RLOO: r_i minus the mean of the others in its group, (B,) -> (B,). A group of one gets 0."""
    centered, _, n = _group_stats(rewards, group_ids, "advantages")
    return centered * n / (n - 1).clamp(min=1)  # n = 1: centered = 0 already


def _discounted_returns(token_rewards, mask, gamma):
    """G_t = r_t + gamma G_{t'} where t' is the next policy token, (B, T). A mask-0 token inside a
    response (a tool observation) is skipped: it is not a step of discounting, and rewards on it are
    ignored. verl's core_algos multiplies the running return by the mask at every step instead,
    which cuts the final reward off earlier turns. With right padding only the two agree."""
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
    bad = ((mask > 0) & ~torch.isfinite(token_rewards)).nonzero().tolist()  # [(row, token), ...]
    if bad:
        raise ValueError(f"reinforce_pp_advantages: non-finite token rewards at (row, token) {bad[:8]}: "
                         "every reward must be a finite number")
    return masked_whiten(_discounted_returns(token_rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(rewards, group_ids, mask):
    """REINFORCE++-baseline: (r - mean_G) broadcast to tokens, whitened over masked tokens -> (B, T)."""
    return masked_whiten(broadcast_to_tokens(drgrpo_advantages(rewards, group_ids), mask), mask)

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
    dual clip c > 1 where A < 0: l = min(l, -c A). The clip ranges have no defaults here: callers pass
    them (config.CLIP is the one source). Returns (loss (B, T), 0 off the mask; stats), stats being
    detached 0-d tensors over masked tokens (no .item(): that is a GPU sync per call): clip_frac (the
    share of tokens whose gradient the clip cut), ratio_min / ratio_mean / ratio_max."""
    # mask-0 tokens get log-ratio 0: pad positions may hold junk logp, which must not reach the stats or grads
    log_ratio = torch.where(mask > 0, logp - old_logp.detach(), torch.zeros_like(logp))  # (B, T)
    return _clipped_surrogate(log_ratio, adv, mask, eps_low, eps_high, dual_clip)


def gspo_loss(logp, old_logp, adv, mask, eps_low, eps_high):
    """GSPO: the PPO clip on the sequence ratio s_i = exp(mean_t (logp - old)) in its token form
    s_it = sg(s_i) exp(logp_t - sg(logp_t)): value s_i, d s_it / d logp_t = s_i. Reduce with
    seq_mean_token_mean for the paper's (1/|y_i|) sum_t; its eps are 3e-4 / 4e-4. Stats describe s_i."""
    m = mask.to(logp.dtype)
    delta = torch.where(mask > 0, logp - old_logp.detach(), torch.zeros_like(logp))  # (B, T)
    seq_log_ratio = delta.sum(1) / m.sum(1).clamp(min=1)  # (B,) mean log-ratio over the sequence
    # value = seq ratio, gradient = seq ratio * d logp_t (each token pushed by its sequence's ratio)
    log_ratio = seq_log_ratio.detach()[:, None] + delta - delta.detach()  # (B, T)
    return _clipped_surrogate(log_ratio, adv, mask, eps_low, eps_high, None)


def cispo_loss(logp, old_logp, adv, mask, eps_low, eps_high):
    """CISPO: -sg(clip(rho)) * A * logp per token; the clip bounds the weight, never drops a gradient
    (eps_low = 1 disables the lower clip since rho > 0, as MiniMax-M1 does). Its clip_frac is the
    share of tokens whose weight the clip bounded (no gradient is cut)."""
    if logp.shape != adv.shape or adv.shape != mask.shape:
        raise ValueError(f"cispo_loss: logp {tuple(logp.shape)}, adv {tuple(adv.shape)}, mask {tuple(mask.shape)} must all be (B, T)")
    log_ratio = torch.where(mask > 0, (logp - old_logp).detach(), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # (B, T)
    w = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.where(mask > 0, -w * adv * logp, torch.zeros_like(logp))
    return loss, _ratio_stats(ratio, mask, w != ratio)


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
    """Dr.GRPO: sum(x m) / (N * max_len), N = B unless given, max_len the configured response cap (a
    constant, not this batch's longest). We divide by N as TRL does; verl does not."""
    total = torch.where(mask > 0, x, torch.zeros_like(x)).sum()
    return total / ((x.shape[0] if num_seqs is None else num_seqs) * max_len)

# -----------------------------------------------------------------------------
# KL estimators and truncated importance sampling

def kl(logp, ref_logp, kind="k3"):
    """Per-token KL estimate of pi vs pi_ref from sampled-token log-probs: k1, k2 or k3 (k3 >= 0, and
    0 exactly when the log-probs agree; -delta clamped to +-20)."""
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
def tis_weights(old_logp, rollout_logp, mask, mode="truncate", cap=2.0, low=None):
    """Detached importance weights trainer/rollout (B, T), 0 on mask-0 tokens (FlashRL's TIS), per
    token: w_t = min(exp(old_t - rollout_t), C). mode "mask" (MIS / IcePop): w = 1 where the ratio is
    in [low, C], else 0, low = 1 / C by default; train.py then takes a rejected token out of the loss
    mask itself, so it leaves every denominator, advantage, KL and entropy too (verl's rollout
    correction does the same)."""
    m = mask.to(torch.promote_types(old_logp.dtype, torch.float32))
    delta = torch.where(mask > 0, old_logp - rollout_logp, torch.zeros_like(m))  # (B, T)
    ratio = torch.exp(delta.clamp(-20.0, 20.0))  # (B, T)
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
    """DAPO dynamic sampling. Bool (B,): True for samples whose group's rewards are not all equal (exact
    comparison; a group of one is dropped: no variance, A = 0 anyway)."""
    return _groups(rewards, group_ids, "dynamic_sampling_keep")[2]


def overlong_punishment(lengths, max_len, buffer, factor=1.0):
    """DAPO soft overlong punishment (B,) -> (B,): 0 if |y| <= L_max - L_buf, then linear to -factor
    over the buffer, -factor past L_max."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong_punishment: need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    L = lengths.to(torch.float64)
    over = (L - (max_len - buffer)).clamp(min=0.0) / buffer  # 0 .. 1 inside the buffer
    out = torch.where(L > max_len, torch.ones_like(L), over.clamp(max=1.0)) * -factor
    return out.to(torch.float32)


def overlong_filter_mask(mask, truncated):
    """DAPO overlong filtering: mask (B, T) with the rows of truncated (B,) bool samples zeroed."""
    return mask * (~truncated.bool())[:, None].to(mask.dtype)
