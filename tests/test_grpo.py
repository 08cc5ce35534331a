"""Tests of grpo.py: hypothesis properties for every formula, plus hand-computed examples.

CPU only, float64 wherever precision matters. Run: python -m pytest -q tests/test_grpo.py
"""
import math
import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
import score  # noqa: E402
from options import critic, entropy  # noqa: E402

FAST = settings(max_examples=50, deadline=None)
F64 = torch.float64


def close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a, b)

# -----------------------------------------------------------------------------
# strategies

# quarter-step rewards: plenty of ties (equal-reward groups) and a std that is 0 or >= ~0.1
quarter = st.integers(-8, 8).map(lambda k: k / 4)


@st.composite
def grouped(draw, rewards=quarter, min_size=1, max_size=12):
    """(rewards (B,) f64, group_ids (B,) long): ids non-contiguous, negative allowed, any order."""
    n = draw(st.integers(min_size, max_size))
    gids = draw(st.lists(st.integers(-3, 7), min_size=n, max_size=n))
    r = draw(st.lists(rewards, min_size=n, max_size=n))
    return torch.tensor(r, dtype=F64), torch.tensor(gids)


@st.composite
def tokens(draw, max_b=5, max_t=7, p_mask=None):
    """Random (B, T) tensors from a seed: mask (0/1 f64), logp, old, adv, rewards, values."""
    B, T = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    p = draw(st.sampled_from([0.5, 0.8, 1.0])) if p_mask is None else p_mask
    d = dict(
        mask=(torch.rand(B, T, generator=g) < p).to(F64),
        logp=-torch.rand(B, T, generator=g, dtype=F64) * 3,
        old=-torch.rand(B, T, generator=g, dtype=F64) * 3,
        adv=torch.randn(B, T, generator=g, dtype=F64) * 2,
        rewards=torch.randn(B, T, generator=g, dtype=F64),
        values=torch.randn(B, T, generator=g, dtype=F64),
    )
    return d


def group_lists(r, gids):
    out = {}
    for i, gid in enumerate(gids.tolist()):
        out.setdefault(gid, []).append(i)
    return out

# -----------------------------------------------------------------------------
# token log-probs and entropy: properties


@FAST
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 3), T=st.integers(1, 5), V=st.integers(2, 11),
       temp=st.sampled_from([0.3, 1.0, 1.7]), chunk=st.integers(1, 6))
def test_token_logprobs_match_log_softmax_gather_and_grad(seed, B, T, V, temp, chunk):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g, dtype=F64) * 3).requires_grad_()
    tgt = torch.randint(0, V, (B, T), generator=g)
    w = torch.randn(B, T, generator=g, dtype=F64)  # a random upstream gradient
    ref = torch.log_softmax(logits / temp, -1).gather(-1, tgt[..., None]).squeeze(-1)
    (gref,) = torch.autograd.grad((ref * w).sum(), logits)
    out = score.token_logprobs_chunked(logits, tgt, temperature=temp, block=chunk)
    (gout,) = torch.autograd.grad((out * w).sum(), logits)
    close(out, ref, 1e-12)
    close(gout, gref, 1e-12)


@FAST
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e3, 1e4, 3e4]), temp=st.sampled_from([0.1, 1.0, 2.0]))
def test_token_logprobs_finite_for_extreme_logits(seed, scale, temp):
    g = torch.Generator().manual_seed(seed)
    logits32 = (torch.randint(-1, 2, (2, 3, 9), generator=g) * scale).float()  # entries in {-s, 0, +s}
    logits32 += torch.randn(2, 3, 9, generator=g)  # break ties a little
    logits32.requires_grad_()
    tgt = torch.randint(0, 9, (2, 3), generator=g)
    out = score.token_logprobs_chunked(logits32, tgt, temperature=temp, block=4)
    out.sum().backward()
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and (out <= 0).all()
    assert torch.isfinite(logits32.grad).all()
    ref = torch.log_softmax(logits32.detach().double() / temp, -1).gather(-1, tgt[..., None]).squeeze(-1)
    close(out.double(), ref, 1e-4 * scale / temp)  # float32 relative precision at this magnitude


def test_token_logprobs_saves_no_float32_copy_of_the_logits():
    # the point of the custom backward: autograd keeps the bf16 logits and a (N,) float32 lse, not
    # a float32 (B, T, V) tensor (19 GB at B*T = 32k, V = 152k). Record what is saved for backward.
    B, T, V = 2, 8, 1000
    logits = torch.randn(B, T, V).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        score.token_logprobs_chunked(logits, torch.randint(0, V, (B, T)), temperature=0.7, block=4)
    assert saved and all(not (dt == torch.float32 and n >= B * T * V // 4) for dt, n in saved), saved


@FAST
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 40))
def test_token_logprobs_bf16_upcasts_to_float32(seed, V):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 4, V, generator=g) * 5).bfloat16().requires_grad_()
    tgt = torch.randint(0, V, (3, 4), generator=g)
    out = score.token_logprobs_chunked(logits, tgt, block=5)
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, tgt[..., None]).squeeze(-1)
    assert out.dtype == torch.float32
    assert torch.allclose(out, ref, atol=1e-5)  # exact float32 math on the bf16 values
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


@FAST
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 20), temp=st.sampled_from([0.5, 1.0, 3.0]), chunk=st.integers(1, 7))
def test_entropy_matches_reference_and_is_bounded(seed, V, temp, chunk):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, V, generator=g, dtype=F64) * 4
    logits[0, 0, 0] = -float("inf")  # a banned token must not produce nan
    ref_p = torch.softmax(logits / temp, -1)
    ref = -(ref_p * torch.log_softmax(logits / temp, -1)).nan_to_num().sum(-1)
    h = score.entropy(logits, temperature=temp, block=chunk)
    close(h, ref, 1e-10)
    assert (h >= -1e-12).all() and (h <= math.log(V) + 1e-9).all()

@FAST
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 11), temp=st.sampled_from([0.5, 1.0, 1.7]),
       chunk=st.integers(1, 6), use=st.sampled_from(["both", "logp", "entropy"]))
def test_token_logprobs_with_entropy_match_autograd(seed, V, temp, chunk, use):
    # the one-pass (logp, entropy) and its backward against plain autograd, with a banned (-inf)
    # token, for an upstream gradient on both outputs or on either alone (the other's is None)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2, 4, V, generator=g, dtype=F64) * 3)
    logits[0, 0, 0] = -float("inf")
    tgt = torch.randint(1, V, (2, 4), generator=g)  # never the banned id
    w1, w2 = torch.randn(2, 4, generator=g, dtype=F64), torch.randn(2, 4, generator=g, dtype=F64)
    x = logits.clone().requires_grad_()
    lsm = torch.log_softmax(x / temp, -1)
    ref_lp = lsm.gather(-1, tgt[..., None]).squeeze(-1)
    ref_h = -(lsm.exp() * torch.where(torch.isfinite(lsm), lsm, 0.0)).sum(-1)
    y = logits.clone().requires_grad_()
    lp, h = score.token_logprobs_chunked(y, tgt, temperature=temp, block=chunk, entropy=True)
    close(lp, ref_lp, 1e-12)
    close(h, ref_h, 1e-12)
    close(h, score.entropy(logits, temperature=temp), 1e-12)
    pick = {"both": lambda a, b: (a * w1 + b * w2).sum(), "logp": lambda a, b: (a * w1).sum(),
            "entropy": lambda a, b: (b * w2).sum()}[use]
    (gref,) = torch.autograd.grad(pick(ref_lp, ref_h), x)
    (gout,) = torch.autograd.grad(pick(lp, h), y)
    assert torch.isfinite(gout).all()
    close(gout, gref, 1e-10)


# -----------------------------------------------------------------------------
# advantages: properties


@FAST
@given(grouped())
def test_grpo_drgrpo_rloo_sum_to_zero_per_group(rg):
    r, gids = rg
    for fn in (grpo.grpo_advantages, grpo.drgrpo_advantages, grpo.rloo_advantages):
        a = fn(r, gids)
        for idx in group_lists(r, gids).values():
            assert abs(a[idx].sum().item()) < 1e-9


@FAST
@given(grouped(), st.lists(st.floats(-50, 50), min_size=11, max_size=11))
def test_advantages_invariant_to_per_group_shift(rg, shifts):
    r, gids = rg
    shifted = r + torch.tensor(shifts, dtype=F64)[gids + 3]  # one constant per group id
    for fn in (grpo.grpo_advantages, grpo.drgrpo_advantages, grpo.rloo_advantages):
        close(fn(shifted, gids), fn(r, gids), 1e-6)
    mask = torch.ones(len(r), 3, dtype=F64)
    close(grpo.reinforce_pp_baseline_advantages(shifted, gids, mask),
          grpo.reinforce_pp_baseline_advantages(r, gids, mask), 1e-6)


@FAST
@given(grouped(), st.floats(0.1, 100))
def test_grpo_invariant_to_positive_scaling(rg, s):
    r, gids = rg
    # eps = 1e-6 against stds >= ~0.1 (quarter-step rewards) gives < 1e-4 relative change
    close(grpo.grpo_advantages(r * s, gids), grpo.grpo_advantages(r, gids), 1e-4)


@FAST
@given(grouped())
def test_grpo_normalised_groups_have_unit_sample_std(rg):
    r, gids = rg
    a = grpo.grpo_advantages(r, gids)
    for idx in group_lists(r, gids).values():
        if len(idx) > 1 and r[idx].std() > 0:
            assert abs(a[idx].std().item() - 1) < 1e-4  # unbiased std, as the docstring says


@FAST
@given(grouped(), st.floats(-5, 5), st.sampled_from([torch.float32, F64]))
def test_equal_rewards_give_exactly_zero_advantage(rg, c, dtype):
    r, gids = rg
    r = torch.full(r.shape, c, dtype=dtype)  # e.g. 0.1 in float32: sum/n rounds, A must still be 0
    mask = torch.ones(len(r), 4, dtype=dtype)
    for fn in (grpo.grpo_advantages, grpo.drgrpo_advantages, grpo.rloo_advantages):
        a = fn(r, gids)
        assert a.dtype == dtype and (a == 0).all()
    assert (grpo.reinforce_pp_baseline_advantages(r, gids, mask) == 0).all()


@FAST
@given(grouped(rewards=st.floats(-10, 10)))
def test_singleton_groups_get_zero(rg):
    r, _ = rg
    gids = torch.arange(len(r)) * 7 - 5  # every sample alone in its group
    for fn in (grpo.grpo_advantages, grpo.drgrpo_advantages, grpo.rloo_advantages):
        assert (fn(r, gids) == 0).all()


@FAST
@given(grouped(rewards=st.floats(-10, 10)))
def test_rloo_is_reward_minus_mean_of_others(rg):
    r, gids = rg
    a = grpo.rloo_advantages(r, gids)
    groups = group_lists(r, gids)
    for idx in groups.values():
        for i in idx:
            others = [r[j].item() for j in idx if j != i]
            expect = r[i].item() - sum(others) / len(others) if others else 0.0
            assert abs(a[i].item() - expect) < 1e-9


@FAST
@given(grouped(rewards=st.floats(-10, 10)), st.randoms(use_true_random=False))
def test_advantages_equivariant_to_permutation_and_relabelling(rg, rnd):
    r, gids = rg
    perm = list(range(len(r)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    relabel = gids * 13 + 1000  # different ids, same partition
    for fn in (grpo.grpo_advantages, grpo.drgrpo_advantages, grpo.rloo_advantages):
        close(fn(r[perm], relabel[perm]), fn(r, gids)[perm], 1e-9)


@FAST
@given(grouped(rewards=st.floats(-10, 10)))
def test_grpo_matches_explicit_formula(rg):
    r, gids = rg
    a = grpo.grpo_advantages(r, gids)
    for idx in group_lists(r, gids).values():
        x = r[idx]
        std = x.std(unbiased=True) if len(idx) > 1 else torch.tensor(0.0, dtype=F64)
        close(a[idx], (x - x.mean()) / (std + 1e-6), 1e-7)


@FAST
@given(tokens())
def test_reinforce_pp_whitened_mean_zero_std_one(d):
    mask, rew = d["mask"], d["rewards"]
    a = grpo.reinforce_pp_advantages(rew, mask, gamma=0.9)
    n = int(mask.sum())
    assert (a[mask == 0] == 0).all()
    if n >= 2:
        v = a[mask > 0]
        assert abs(v.mean().item()) < 1e-9
        # std is 1 up to the eps inside the sqrt: sqrt(var / (var + 1e-8)) for the returns' var
        ret = torch.zeros_like(rew)
        run = torch.zeros(rew.shape[0], dtype=F64)
        for t in reversed(range(rew.shape[1])):  # returns over policy tokens only
            run = torch.where(mask[:, t] > 0, rew[:, t] + 0.9 * run, run)
            ret[:, t] = run
        var = ret[mask > 0].var().item()
        assert abs(v.std().item() - math.sqrt(var / (var + 1e-8))) < 1e-9


@FAST
@given(tokens(), st.lists(quarter, min_size=5, max_size=5))
def test_reinforce_pp_gamma1_outcome_equals_whitened_broadcast(d, rs):
    mask = d["mask"]
    r = torch.tensor(rs[: mask.shape[0]], dtype=F64)
    a = grpo.reinforce_pp_advantages(grpo.last_token_rewards(r, mask), mask, gamma=1.0)
    close(a, grpo.masked_whiten(grpo.broadcast_to_tokens(r, mask), mask), 1e-9)


@FAST
@given(tokens(), st.integers(0, 6), st.integers(1, 3), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_mask0_gaps_are_skipped_by_recursions(d, at, width, gamma, lam):
    # inserting env/tool tokens (mask 0, with junk rewards/values) inside the responses must not
    # change the advantages of the policy tokens: REINFORCE++ skips them
    mask, rew, val = d["mask"], d["rewards"], d["values"]
    B, T = mask.shape
    at = min(at, T)
    ins = lambda x, fill: torch.cat([x[:, :at], fill, x[:, at:]], 1)  # noqa: E731
    junk = torch.full((B, width), 123.0, dtype=F64)
    mask2, rew2, val2 = ins(mask, torch.zeros(B, width, dtype=F64)), ins(rew, junk), ins(val, junk)
    keep = torch.cat([torch.arange(at), torch.arange(at + width, T + width)])
    a1 = grpo.reinforce_pp_advantages(rew, mask, gamma)
    a2 = grpo.reinforce_pp_advantages(rew2, mask2, gamma)
    close(a2[:, keep], a1, 1e-9)
    assert (a2[mask2 == 0] == 0).all()


@FAST
@given(st.lists(quarter, min_size=1, max_size=6), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_last_token_rewards_and_broadcast(rs, T, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.tensor(rs, dtype=F64)
    mask = (torch.rand(len(rs), T, generator=g) < 0.6).to(F64)
    lt = grpo.last_token_rewards(r, mask)
    has = mask.sum(1) > 0
    close(lt.sum(1), torch.where(has, r, 0.0))
    assert (lt[mask == 0] == 0).all()
    close(grpo.broadcast_to_tokens(r, mask), r[:, None] * mask)

# -----------------------------------------------------------------------------
# policy losses: properties


@FAST
@given(tokens(), st.floats(0.01, 0.5), st.floats(0.01, 0.5))
def test_ppo_clip_at_ratio_one_is_minus_adv(d, el, eh):
    loss, stats = grpo.ppo_clip_loss(d["old"], d["old"], d["adv"], d["mask"], el, eh, dual_clip=3.0)
    close(loss, -d["adv"] * d["mask"])
    assert stats["clip_frac"].item() == 0
    if d["mask"].sum() > 0:
        assert stats["ratio_min"].item() == stats["ratio_max"].item() == 1.0


@FAST
@given(tokens(), st.floats(0.05, 0.4), st.floats(0.05, 0.4))
def test_ppo_clip_gradient_zero_where_clip_active(d, el, eh):
    logp = (d["old"] + torch.randn(d["old"].shape, dtype=F64) * 0.5).requires_grad_()
    loss, stats = grpo.ppo_clip_loss(logp, d["old"], d["adv"], d["mask"], el, eh)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    ratio = torch.exp(logp.detach() - d["old"])
    A = d["adv"]
    active = ((A > 0) & (ratio > 1 + eh)) | ((A < 0) & (ratio < 1 - el))
    assert (grad[active] == 0).all()
    assert (grad[d["mask"] == 0] == 0).all()
    # elsewhere the gradient is the unclipped one: d(-rho A)/dlogp = -rho A
    free = ~active & (d["mask"] > 0)
    close(grad[free], (-ratio * A)[free], 1e-9)
    close(stats["clip_frac"], grpo.masked_mean(active.to(F64), d["mask"]), 1e-12)


@FAST
@given(tokens(), st.floats(1.5, 5.0))
def test_ppo_loss_bounds_and_dual_clip(d, c):
    logp = d["old"] + torch.randn(d["old"].shape, dtype=F64)
    A, m = d["adv"], d["mask"]
    plain, st_ = grpo.ppo_clip_loss(logp, d["old"], A, m, 0.2, 0.28)
    dual, _ = grpo.ppo_clip_loss(logp, d["old"], A, m, 0.2, 0.28, dual_clip=c)
    ratio = torch.exp(logp - d["old"])
    keep = m > 0
    assert (plain[keep] >= (-ratio * A)[keep] - 1e-12).all()  # clip is pessimistic
    assert (dual[keep & (A < 0)] <= (-c * A)[keep & (A < 0)] + 1e-12).all()  # dual clip caps A<0 loss
    close(dual[A >= 0], plain[A >= 0])  # and leaves A >= 0 alone
    assert (dual <= plain + 1e-12).all()
    if keep.any():
        assert st_["ratio_min"] <= st_["ratio_mean"] + 1e-12 and st_["ratio_mean"] <= st_["ratio_max"] + 1e-12
        assert 0 <= st_["clip_frac"] <= 1


@FAST
@given(tokens(), st.integers(0, 2**31 - 1), st.floats(1e-4, 0.3), st.floats(1e-4, 0.3))
def test_gspo_equals_ppo_when_token_ratios_equal_per_sequence(d, seed, el, eh):
    g = torch.Generator().manual_seed(seed)
    B, T = d["old"].shape
    per_seq = torch.randn(B, 1, generator=g, dtype=F64) * 0.3  # one log-ratio per sequence
    logp1 = (d["old"] + per_seq).requires_grad_()
    logp2 = logp1.detach().clone().requires_grad_()
    l_ppo, s_ppo = grpo.ppo_clip_loss(logp1, d["old"], d["adv"], d["mask"], el, eh)
    l_gspo, s_gspo = grpo.gspo_loss(logp2, d["old"], d["adv"], d["mask"], el, eh)
    close(l_gspo, l_ppo, 1e-9)
    w = torch.randn(B, T, generator=g, dtype=F64)
    (g1,) = torch.autograd.grad((l_ppo * w).sum(), logp1)
    (g2,) = torch.autograd.grad((l_gspo * w).sum(), logp2)
    close(g2, g1, 1e-9)
    close(s_gspo["clip_frac"], s_ppo["clip_frac"], 1e-12)


@FAST
@given(tokens())
def test_gspo_uses_one_ratio_per_sequence(d):
    logp, old, m = d["logp"], d["old"], d["mask"]
    ones = torch.ones_like(m)
    loss, _ = grpo.gspo_loss(logp, old, -ones, m, eps_low=10.0, eps_high=1e9)  # A = -1, clip disabled
    # with A = -1 and no clip, loss_t = s_i for every policy token of row i
    s = torch.exp(((logp - old) * m).sum(1) / m.sum(1).clamp(min=1))
    close(loss, s[:, None] * m, 1e-9)


@FAST
@given(tokens(), st.floats(0.05, 1.0), st.floats(0.05, 1.0))
def test_cispo_gradient_is_minus_clipped_ratio_times_adv(d, el, eh):
    logp = (d["old"] + torch.randn(d["old"].shape, dtype=F64) * 0.5).requires_grad_()
    loss, stats = grpo.cispo_loss(logp, d["old"], d["adv"], d["mask"], el, eh)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    rho = torch.exp(logp.detach() - d["old"]).clamp(1 - el, 1 + eh)
    close(grad, -rho * d["adv"] * d["mask"], 1e-9)
    assert 0 <= stats["clip_frac"] <= 1


def clip_cov_candidates(logp, old, adv, mask, el, eh, low, high):
    """The tokens Clip-Cov may take out, computed here from its definition (not grpo's code)."""
    on = mask > 0
    mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    cov = (adv - mean(adv)) * (logp - mean(logp))
    ratio = torch.exp(logp - old)
    cut = -adv * ratio.clamp(1 - el, 1 + eh) > -adv * ratio  # PPO's clip already cut these
    return on & ~cut & (cov > low) & (cov < high)


@FAST
@given(tokens(p_mask=1.0), st.sampled_from([0.0, 0.1, 0.5, 1.0]), st.floats(-1.0, 1.0), st.floats(0.1, 3.0),
       st.integers(0, 2**31 - 1))
def test_clip_cov_takes_out_exactly_its_share_of_high_covariance_tokens(d, frac, low, width, seed):
    # every token but the ones taken out has PPO's loss and gradient; those have 0 and 0, are
    # candidates by the definition, and there are min(max(frac x N, 1), candidates) of them
    m, A, el, eh = d["mask"], d["adv"], 0.2, 0.28
    logp = (d["old"] + 0.3 * torch.randn(m.shape, dtype=F64, generator=torch.Generator().manual_seed(seed)))
    logp = logp.requires_grad_()
    ppo, _ = grpo.ppo_clip_loss(logp, d["old"], A, m, el, eh)
    loss, stats = entropy.clip_cov_loss(logp, d["old"], A, m, el, eh, frac, low, low + width,
                                     generator=torch.Generator().manual_seed(seed))
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    cand = clip_cov_candidates(logp.detach(), d["old"], A, m, el, eh, low, low + width)
    n_out = round(float(stats["cov_clip_frac"]) * int(m.sum()))
    k = 0 if frac == 0 else max(int(frac * int(m.sum())), 1)
    assert n_out == min(k, int(cand.sum()))
    changed = (loss != ppo) | (g != g_ppo)
    assert not (changed & ~cand).any()  # only candidates change ...
    assert (loss[changed] == 0).all() and (g[changed] == 0).all()  # ... and to 0
    assert int(changed.sum()) <= n_out  # (a taken-out token whose A is 0 changes nothing)


def test_hand_clip_cov():
    # on-policy (ratio 1). mean logp = -1, mean A = 0.5, so cov = (A - 0.5)(logp + 1) =
    # [[0.75, 1.25], [-0.25, -0.5]]: token (0, 1) is the one in (1, 5); frac 0.25 of 4 tokens takes it out
    logp = torch.tensor([[-2.0, 0.0], [-1.5, -0.5]], dtype=F64, requires_grad=True)
    A = torch.tensor([[-0.25, 1.75], [1.0, -0.5]], dtype=F64)
    m = torch.ones(2, 2, dtype=F64)
    loss, stats = entropy.clip_cov_loss(logp, logp.detach(), A, m, 0.2, 0.2, 0.25, 1.0, 5.0)
    close(loss, [[0.25, 0.0], [-1.0, 0.5]])  # -A, but 0 on (0, 1)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    close(g, [[0.25, 0.0], [-1.0, 0.5]])  # on-policy PPO's gradient is -A; the token taken out has none
    assert float(stats["cov_clip_frac"]) == 0.25
    assert float(entropy.clip_cov_loss(logp, logp.detach(), A, m, 0.2, 0.2, 0.0)[1]["cov_clip_frac"]) == 0  # frac 0: none
    # (1.3, 5): no candidate, nothing taken out, whatever frac says
    loss, stats = entropy.clip_cov_loss(logp, logp.detach(), A, m, 0.2, 0.2, 1.0, 1.3, 5.0)
    close(loss, -A)


@FAST
@given(tokens(), st.sampled_from([0.0, 0.1, 0.5, 1.0]), st.floats(0.1, 2.0))
def test_kl_cov_holds_exactly_its_share_of_the_highest_covariance_tokens(d, frac, coef):
    # every masked token has the unclipped -rho A; max(frac N, 1) of them (none at frac 0), of the
    # largest covariance by its definition, also pay coef |logp - old|, in value and in gradient
    m, A, old = d["mask"], d["adv"], d["old"]
    logp = d["logp"].clone().requires_grad_()
    loss, stats = entropy.kl_cov_loss(logp, old, A, m, frac, coef)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    on, n = m > 0, int(m.sum())
    k = 0 if frac == 0 or n == 0 else max(int(frac * n), 1)
    delta = d["logp"] - old
    plain = torch.where(on, -A * torch.exp(delta), torch.zeros_like(A))
    held = (loss.detach() - plain).abs() > 1e-12
    assert int(held.sum()) == k and not (held & ~on).any()
    close(loss.detach()[held], coef * delta.abs()[held] + plain[held], 1e-9)
    close(g, torch.where(on, -A * torch.exp(delta) + coef * torch.sign(delta) * held, torch.zeros_like(A)), 1e-9)
    if 0 < k < n:
        mean = lambda x: (x * m).sum() / m.sum()  # noqa: E731
        cov = (A - mean(A)) * (d["logp"] - mean(d["logp"]))
        assert cov[held].min() >= cov[on & ~held].max()
    assert float(stats["kl_cov_frac"]) == pytest.approx(k / max(n, 1)) and float(stats["clip_frac"]) == 0


def test_hand_kl_cov():
    # Clip-Cov's hand case: cov = [[0.75, 1.25], [-0.25, -0.5]], so token (0, 1) has the largest
    logp = torch.tensor([[-2.0, 0.0], [-1.5, -0.5]], dtype=F64, requires_grad=True)
    A = torch.tensor([[-0.25, 1.75], [1.0, -0.5]], dtype=F64)
    m = torch.ones(2, 2, dtype=F64)
    loss, stats = entropy.kl_cov_loss(logp, logp.detach(), A, m, 0.25, 1.0)  # on-policy: the term is 0 ...
    (g,) = torch.autograd.grad(loss.sum(), logp)
    close(loss, -A)
    close(g, -A)  # ... and so is its gradient
    assert float(stats["kl_cov_frac"]) == 0.25
    old = logp.detach() + torch.tensor([[0.0, 0.5], [0.0, 0.0]], dtype=F64)  # token (0, 1) fell by 0.5
    loss, _ = entropy.kl_cov_loss(logp, old, A, m, 0.25, 1.0)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    r = math.exp(-0.5)
    close(loss, [[0.25, -1.75 * r + 0.5], [-1.0, 0.5]])
    close(g, [[0.25, -1.75 * r - 1.0], [-1.0, 0.5]])  # pulled back up towards where it was


@FAST
@given(tokens())
def test_losses_ignore_garbage_on_mask0_tokens(d):
    m = d["mask"]
    # each loss with the defaults it had in grpo.py before the clip ranges became required
    for fn, el, eh in ((grpo.ppo_clip_loss, 0.2, 0.28), (grpo.gspo_loss, 3e-4, 4e-4), (grpo.cispo_loss, 1.0, 0.28),
                       (entropy.clip_cov_loss, 0.2, 0.2)):
        junk = torch.where(m > 0, d["logp"], torch.tensor(float("nan"), dtype=F64)).requires_grad_()
        loss, stats = fn(junk, d["old"], d["adv"], m, el, eh)
        assert torch.isfinite(loss).all() and (loss[m == 0] == 0).all()
        (grad,) = torch.autograd.grad(loss.sum(), junk)
        assert torch.isfinite(grad[m > 0]).all() and (grad[m == 0] == 0).all()
        assert all(torch.isfinite(v) for v in stats.values())
    junk = torch.where(m > 0, d["logp"], torch.tensor(float("nan"), dtype=F64)).requires_grad_()
    loss, stats = entropy.kl_cov_loss(junk, d["old"], d["adv"], m, 0.5, 1.0)
    (grad,) = torch.autograd.grad(loss.sum(), junk)
    assert torch.isfinite(loss).all() and (loss[m == 0] == 0).all() and (grad[m == 0] == 0).all()
    assert torch.isfinite(grad[m > 0]).all() and all(torch.isfinite(v) for v in stats.values())

# -----------------------------------------------------------------------------
# reductions: properties


def split_rows(k, B, seed):
    """Cut range(B) into up to k contiguous non-empty micro-batches."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, B, (k - 1,), generator=g).tolist())) if B > 1 and k > 1 else []
    edges = [0] + cuts + [B]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


@FAST
@given(tokens(max_b=8), st.integers(1, 4), st.integers(0, 2**31 - 1), st.integers(7, 20))
def test_reductions_exact_under_gradient_accumulation(d, k, seed, max_len):
    x, m = d["adv"], d["mask"]
    B = x.shape[0]
    parts = split_rows(k, B, seed)
    D = m.sum().clamp(min=1)
    close(sum(grpo.token_mean(x[p], m[p], denom=D) for p in parts), grpo.token_mean(x, m), 1e-12)
    close(sum(grpo.seq_mean_token_mean(x[p], m[p], num_seqs=B) for p in parts), grpo.seq_mean_token_mean(x, m), 1e-12)
    close(sum(grpo.seq_mean_token_sum_norm(x[p], m[p], max_len, num_seqs=B) for p in parts),
          grpo.seq_mean_token_sum_norm(x, m, max_len), 1e-12)


@FAST
@given(tokens(max_b=8), st.integers(7, 20))
def test_reductions_match_formulas_and_ignore_mask0(d, max_len):
    x, m = d["adv"], d["mask"]
    B = x.shape[0]
    junk = torch.where(m > 0, x, torch.tensor(float("inf"), dtype=F64))
    close(grpo.token_mean(junk, m), (x * m).sum() / m.sum().clamp(min=1))
    per_seq = [(x[i] * m[i]).sum() / m[i].sum() if m[i].sum() > 0 else torch.tensor(0.0, dtype=F64) for i in range(B)]
    close(grpo.seq_mean_token_mean(junk, m), sum(per_seq) / B)
    close(grpo.seq_mean_token_sum_norm(junk, m, max_len), (x * m).sum() / (B * max_len))

# -----------------------------------------------------------------------------
# KL: properties


@FAST
@given(tokens(), st.floats(0.0, 30.0))
def test_kl_estimators(d, scale):
    logp = d["logp"] * scale
    ref = d["old"] * scale
    k1, k2, k3 = (grpo.kl(logp, ref, k) for k in ("k1", "k2", "k3"))
    delta = logp - ref
    close(k1, delta)
    close(k2, delta ** 2 / 2)
    assert (k3 >= 0).all() and torch.isfinite(k3).all()
    x = (-delta).clamp(-20, 20)
    close(k3, torch.exp(x) - x - 1, 1e-9)
    assert (grpo.kl(logp, logp.clone(), "k3") == 0).all()
    assert (k3[delta.abs() > 1e-6] > 0).all()  # and positive once delta is above rounding


@FAST
@given(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6))
def test_kl_k3_finite_with_finite_grad_for_extremes(a, b):
    logp = torch.tensor([a], dtype=torch.float32, requires_grad=True)
    k3 = grpo.kl(logp, torch.tensor([b]), "k3")
    k3.sum().backward()
    assert torch.isfinite(k3).all() and (k3 >= 0).all() and torch.isfinite(logp.grad).all()

# -----------------------------------------------------------------------------
# TIS: properties


@FAST
@given(tokens(), st.floats(1.0, 5.0))
def test_tis_weights_bounded_detached_and_masked(d, cap):
    old = d["old"].clone().requires_grad_()
    roll = d["logp"]
    m = d["mask"]
    w = grpo.tis_weights(old, roll, m, mode="truncate", cap=cap)
    assert not w.requires_grad
    assert (w <= cap + 1e-12).all() and (w >= 0).all() and (w[m == 0] == 0).all()
    close(w, torch.exp(old.detach() - roll).clamp(max=cap) * m, 1e-9)
    wm = grpo.tis_weights(old, roll, m, mode="mask", cap=cap)
    assert not wm.requires_grad and set(wm.unique().tolist()) <= {0.0, 1.0}
    # mask mode keeps exactly the tokens the truncation leaves untouched and the floor 1/cap keeps
    ratio = w  # where w < cap, w is the ratio itself
    kept = (ratio >= 1 / cap) & (ratio < cap) & (m > 0)
    assert (wm[kept] == 1).all()


def test_tis_identical_logprobs_give_weight_one_and_bad_args_raise():
    m = torch.tensor([[1.0, 1.0, 0.0]])
    lp = torch.tensor([[-0.5, -1.0, -7.0]])
    for mode in ("truncate", "mask"):
        close(grpo.tis_weights(lp, lp, m, mode), m)
    with pytest.raises(ValueError):
        grpo.tis_weights(lp, lp, m, mode="batch")
    with pytest.raises(ValueError):
        grpo.tis_weights(lp, lp, m, mode="truncate", low=0.5)
    with pytest.raises(ValueError):
        grpo.kl(lp, lp, "k4")

# -----------------------------------------------------------------------------
# DAPO: properties


@FAST
@given(grouped())
def test_dynamic_sampling_keeps_exactly_groups_with_variance(rg):
    r, gids = rg
    keep = grpo.dynamic_sampling_keep(r, gids)
    assert keep.dtype == torch.bool
    for idx in group_lists(r, gids).values():
        varied = len(set(r[idx].tolist())) > 1
        assert (keep[idx] == varied).all()
    # dropped samples are exactly those with zero GRPO advantage
    a = grpo.grpo_advantages(r, gids)
    for idx in group_lists(r, gids).values():
        if not keep[idx[0]]:
            assert (a[idx] == 0).all()
        else:
            assert (a[idx] != 0).any()


@FAST
@given(st.lists(st.integers(0, 200), min_size=1, max_size=20), st.integers(50, 150), st.integers(1, 50), st.floats(0.1, 2.0))
def test_overlong_punishment_piecewise(lengths, max_len, buffer, f):
    L = torch.tensor(lengths)
    p = grpo.overlong_punishment(L, max_len, buffer, f)
    for y, v in zip(lengths, p.tolist()):
        if y <= max_len - buffer:
            assert v == 0
        elif y <= max_len:
            assert abs(v - -(y - (max_len - buffer)) / buffer * f) < 1e-6  # linear inside the buffer
        else:
            assert abs(v - -f) < 1e-6
    # monotone non-increasing in length, bounded in [-f, 0]
    order = torch.argsort(L)
    assert (p[order].diff() <= 1e-7).all() and (p >= -f - 1e-6).all() and (p <= 0).all()


@FAST
@given(tokens(), st.integers(0, 2**31 - 1))
def test_overlong_filter_mask(d, seed):
    m = d["mask"]
    trunc = torch.rand(m.shape[0], generator=torch.Generator().manual_seed(seed)) < 0.5
    out = grpo.overlong_filter_mask(m, trunc)
    assert (out[trunc] == 0).all()
    close(out[~trunc], m[~trunc])

# -----------------------------------------------------------------------------
# hand-computed examples


def test_hand_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=F64)  # softmax = [1/4, 3/4]
    tgt = torch.tensor([[1]])
    close(score.token_logprobs_chunked(logits, tgt), [[math.log(0.75)]])  # log 0.75 = -0.28768
    # temperature 2: logits/2 = [0, ln sqrt3], p1 = sqrt3 / (1 + sqrt3) = 0.63397 -> -0.45579
    close(score.token_logprobs_chunked(logits, tgt, temperature=2.0), [[math.log(math.sqrt(3) / (1 + math.sqrt(3)))]])
    # entropy of [1/4, 3/4] = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.56233
    close(score.entropy(logits), [[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    # extreme: logits [1e4, -1e4], target 1 -> logp = -2e4 exactly (float32 holds it)
    ext = torch.tensor([[[1e4, -1e4]]])
    close(score.token_logprobs_chunked(ext, tgt), [[-2e4]], 1e-6)
    close(score.entropy(ext), [[0.0]])


def test_hand_advantages():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 1.0, 0.0, 0.0, 0.0], dtype=F64)
    g = torch.tensor([3, 3, 3, 3, 9, 0, 0, 0, 0])  # group 9 is a singleton
    # group 3: mean 0.5, sample std = sqrt(4 * 0.25 / 3) = 0.57735 -> A = +-0.5 / 0.57735 = +-0.86603
    # group 0 = [1, 0, 0, 0]: mean 0.25, std = sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5]
    s = 0.5 / math.sqrt(1 / 3)
    close(grpo.grpo_advantages(r, g), [s, -s, s, -s, 0.0, 1.5, -0.5, -0.5, -0.5], 1e-5)
    # Dr.GRPO: r - mean
    close(grpo.drgrpo_advantages(r, g), [0.5, -0.5, 0.5, -0.5, 0.0, 0.75, -0.25, -0.25, -0.25])
    # RLOO group 0: 1 - 0 = 1, 0 - 1/3 = -0.33333 ; group 3: 1 - 1/3 = 0.66667, 0 - 2/3
    close(grpo.rloo_advantages(r, g), [2 / 3, -2 / 3, 2 / 3, -2 / 3, 0.0, 1.0, -1 / 3, -1 / 3, -1 / 3])


def test_hand_reinforce_pp_and_baseline():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    tr = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=F64)  # reward 1 on seq 0's last token, 0 for seq 1
    # gamma 0.5: returns [[0.5, 1], [0, -]]; mean 0.5, unbiased var (0 + 0.25 + 0.25) / 2 = 0.25 -> std 0.5
    close(grpo.reinforce_pp_advantages(tr, mask, gamma=0.5), [[0.0, 1.0], [-1.0, 0.0]], 1e-6)
    # baseline: r = [1, 0] one group -> a = [0.5, -0.5] -> tokens [0.5, 0.5, -0.5]; mean 1/6,
    # deviations [1/3, 1/3, -2/3], var = (1/9 + 1/9 + 4/9) / 2 = 1/3 -> std 0.57735
    sd = math.sqrt(1 / 3)
    out = grpo.reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0], dtype=F64), torch.tensor([0, 0]), mask)
    close(out, [[1 / 3 / sd, 1 / 3 / sd], [-2 / 3 / sd, 0.0]], 1e-6)


def test_hand_ppo_clip_and_dual_clip():
    old = torch.zeros(1, 4, dtype=F64)
    logp = torch.tensor([[0.5, -0.5, -0.5, 1.5]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, -1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=F64)
    loss, stats = grpo.ppo_clip_loss(logp, old, adv, mask, 0.2, 0.28)  # eps_low 0.2, eps_high 0.28
    # t0: ratio = e^0.5 = 1.6487 > 1.28, A > 0 -> clipped, loss = -1.28 * 2 = -2.56
    # t1: ratio = e^-0.5 = 0.6065 < 0.8, A > 0 -> unclipped is lower: loss = -0.6065 * 2 = -1.2131
    # t2: ratio 0.6065 < 0.8, A < 0 -> clipped, loss = -0.8 * -1 = 0.8
    # t3: ratio = e^1.5 = 4.4817, A < 0 -> loss = 4.4817 (no clip on that side)
    e = math.exp
    close(loss, [[-2.56, -2 * e(-0.5), 0.8, e(1.5)]], 1e-12)
    close(stats["clip_frac"], 0.5)  # t0 and t2
    close(stats["ratio_max"], e(1.5))
    close(stats["ratio_min"], e(-0.5))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    close(grad, [[0.0, -2 * e(-0.5), 0.0, e(1.5)]], 1e-12)  # d(-rho A) = -rho A where unclipped
    # dual clip c = 3: t3 -> min(4.4817, 3 * 1) = 3, gradient 0 there
    loss_d, stats_d = grpo.ppo_clip_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip=3.0)
    close(loss_d, [[-2.56, -2 * e(-0.5), 0.8, 3.0]], 1e-12)
    close(stats_d["dual_clip_frac"], 0.25)
    close(stats_d["clip_frac"], 0.75)
    with pytest.raises(ValueError):
        grpo.ppo_clip_loss(logp, old, adv[:, 0], mask, 0.2, 0.28)  # outcome adv must be broadcast first


def test_hand_gspo():
    old = torch.zeros(2, 2, dtype=F64)
    logp = torch.tensor([[0.2, -0.4], [0.2, -0.4]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=F64)
    mask = torch.ones(2, 2, dtype=F64)
    loss, stats = grpo.gspo_loss(logp, old, adv, mask, 3e-4, 4e-4)  # eps 3e-4 / 4e-4 -> clip range [0.9997, 1.0004]
    # s = exp(mean(0.2, -0.4)) = exp(-0.1) = 0.904837 for both rows
    # row 0, A = +1: s < 0.9997, unclipped is lower -> loss = -0.904837, gradient -s per token
    # row 1, A = -1: clipped -> loss = 0.9997, no gradient
    s = math.exp(-0.1)
    close(loss, [[-s, -s], [0.9997, 0.9997]], 1e-12)
    close(stats["clip_frac"], 0.5)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    close(grad, [[-s, -s], [0.0, 0.0]], 1e-12)


def test_hand_cispo():
    old = torch.zeros(1, 3, dtype=F64)
    logp = torch.tensor([[-1.0, -1.0, -2.0]], dtype=F64)
    old = logp.detach() - torch.tensor([[0.5, -0.5, 0.0]], dtype=F64)  # log-ratios 0.5, -0.5, 0
    logp = logp.requires_grad_()
    adv = torch.tensor([[2.0, 2.0, -1.0]], dtype=F64)
    loss, stats = grpo.cispo_loss(logp, old, adv, torch.ones(1, 3, dtype=F64), 1.0, 0.28)  # eps_low 1, eps_high 0.28
    # t0: rho = e^0.5 = 1.6487 -> clipped to 1.28: loss = -1.28 * 2 * (-1) = 2.56, grad = -2.56
    # t1: rho = e^-0.5 = 0.6065 (no lower clip): loss = -0.6065 * 2 * (-1) = 1.2131, grad = -1.2131
    # t2: rho = 1, A = -1: loss = -1 * -1 * -2 = -2, grad = +1
    r1 = math.exp(-0.5)
    close(loss, [[2.56, 2 * r1, -2.0]], 1e-12)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    close(grad, [[-2.56, -2 * r1, 1.0]], 1e-12)
    close(stats["clip_frac"], 1 / 3)


def test_hand_reductions():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]], dtype=F64)
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64)
    close(grpo.token_mean(x, m), 10 / 4)  # (1 + 2 + 3 + 4) / 4 tokens = 2.5
    close(grpo.token_mean(x, m, denom=8), 10 / 8)  # global count from outside
    close(grpo.seq_mean_token_mean(x, m), (2 + 4) / 2)  # row means 2 and 4 -> 3
    close(grpo.seq_mean_token_mean(x, m, num_seqs=4), 6 / 4)
    close(grpo.seq_mean_token_sum_norm(x, m, max_len=4), 10 / (2 * 4))  # 1.25
    close(grpo.seq_mean_token_sum_norm(x, m, max_len=4, num_seqs=5), 10 / 20)


def test_hand_kl():
    logp = torch.tensor([math.log(0.5), -1.0, 0.0], dtype=F64)
    ref = torch.tensor([math.log(0.25), -1.0, -30.0], dtype=F64)
    # t0: delta = ln 2 = 0.693147 -> k1 = 0.693147, k2 = 0.240227, k3 = 1/2 + 0.693147 - 1 = 0.193147
    # t1: delta = 0 -> all 0;  t2: delta = 30, -delta clamped to -20 -> k3 = e^-20 + 20 - 1 = 19.0000000021
    l2 = math.log(2)
    close(grpo.kl(logp, ref, "k1"), [l2, 0.0, 30.0])
    close(grpo.kl(logp, ref, "k2"), [l2 ** 2 / 2, 0.0, 450.0])
    close(grpo.kl(logp, ref, "k3"), [0.5 + l2 - 1, 0.0, math.exp(-20) + 19])


def test_hand_tis():
    old = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]], dtype=F64)
    roll = torch.zeros(1, 3, dtype=F64)
    m = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    # token ratios 3 and 0.5 -> truncate: min(3, 2) = 2, 0.5; mask mode [1/2, 2]: 3 dropped, 0.5 kept
    close(grpo.tis_weights(old, roll, m, "truncate"), [[2.0, 0.5, 0.0]])
    close(grpo.tis_weights(old, roll, m, "mask"), [[0.0, 1.0, 0.0]])
    close(grpo.tis_weights(old, roll, m, "mask", low=0.6), [[0.0, 0.0, 0.0]])


def test_hand_dapo():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    g = torch.tensor([5, 5, 2, 2, 8, 8, 4])  # group 5 all 1, group 2 mixed, group 8 all 0, group 4 alone
    assert grpo.dynamic_sampling_keep(r, g).tolist() == [False, False, True, True, False, False, False]
    # max_len 100, buffer 20, factor 1: 80 -> 0 (edge), 90 -> -(90 - 80) / 20 = -0.5, 100 -> -1, 120 -> -1
    p = grpo.overlong_punishment(torch.tensor([10, 80, 90, 100, 120]), 100, 20, 1.0)
    close(p, [0.0, 0.0, -0.5, -1.0, -1.0], 1e-7)
    m = torch.ones(2, 3)
    close(grpo.overlong_filter_mask(m, torch.tensor([True, False])), [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_are_one_error_for_every_estimator(bad):
    # before: NaN gave A = NaN in GRPO, 0 in Dr.GRPO / RLOO / RF++-baseline, and dynamic sampling dropped it
    r = torch.tensor([1.0, bad, 0.0, 1.0])
    g = torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 3)
    calls = [lambda: grpo.grpo_advantages(r, g), lambda: grpo.drgrpo_advantages(r, g),
             lambda: grpo.rloo_advantages(r, g), lambda: grpo.reinforce_pp_baseline_advantages(r, g, mask),
             lambda: grpo.reinforce_pp_advantages(grpo.last_token_rewards(r, mask), mask),
             lambda: grpo.dynamic_sampling_keep(r, g)]
    for call in calls:
        with pytest.raises(ValueError, match=r"non-finite rewards at indices \[1\]"):
            call()


def test_reinforce_pp_refuses_a_non_finite_reward_on_a_policy_token():
    # choice 3 of the module doc holds for token rewards too; junk off the mask is ignored
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)
    r = torch.tensor([[0.0, 1.0, float("nan")], [2.0, float("inf"), 0.0]], dtype=F64)
    out = grpo.reinforce_pp_advantages(r, mask)  # NaN and inf only off the mask: fine
    assert torch.isfinite(out).all()
    r[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"\(row, token\) \[\[0, 1\]\]"):
        grpo.reinforce_pp_advantages(r, mask)
