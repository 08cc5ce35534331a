"""
Entropy remedies: what keeps a policy from collapsing onto one answer while it learns. Each is a
flag that train.py enters at one line; none is on by default.

    --loss clip-cov     PPO's clip, and a random 2e-4 of the tokens whose covariance
                        cov_t = (A_t - mean A)(logp_t - mean logp) is in (1, 5) out of the gradient
    --loss kl-cov       no clip; the 2e-4 of the tokens with the largest cov_t pay coef |logp - old|
    --entropy-coef      a bonus: the loss gets - c H_t on the tokens that train (train.update)

Why covariance: under a policy-gradient step the entropy falls by about the covariance of logp and
A over the sampled tokens, and a few tokens with a large positive one (a likely token in a good
answer, an unlikely one in a bad answer) drive most of the collapse (Cui et al. 2025, "The Entropy
Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617; verl's and
SkyRL's clip_cov / kl_cov, whose defaults are ours). Where the means and the top fraction are taken
is the caller's batch: train.py passes a micro-batch, as verl does. What each did on the headline:
docs/results.md.

Test: python -m pytest -q tests/test_grpo.py
"""
import math

import torch

from grpo import _clip_terms, _ratio_stats, masked_mean, ppo_clip_loss


def _covariance(lp, adv, mask):
    """Clip-Cov's and KL-Cov's cov_t = (A_t - mean A)(logp_t - mean logp), the means over the masked
    tokens, (B, T); lp holds 0, not junk, on mask-0 tokens."""
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


def clip_cov_loss(logp, old_logp, adv, mask, eps_low, eps_high, frac=2e-4, cov_low=1.0, cov_high=5.0, generator=None):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617; why: the module doc): PPO's clip, and the loss
    of a few tokens set to 0, value and gradient (as verl and SkyRL do, with their defaults). Which:
    a random frac of the masked tokens (at least one; none at frac 0) among those the clip left
    alone whose cov_t = (A_t - mean A) (logp_t - mean logp) lies in (cov_low, cov_high). It acts
    on-policy too: it needs no ratio away from 1. The means are over the caller's batch.
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
    d|x|/dx at 0 is 0), so config.py refuses it there. Means and top frac: over the caller's batch.
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
