"""Tests of PPO's critic side: critic.gae_advantages / value_loss / explained_variance, and critic.py.

Hand-computed examples, hypothesis properties against a slow per-sequence reference, and a tiny
random critic (conftest's tiny Llama, plus a tiny Qwen2 built here) that learns a toy problem and
saves/loads bit-exact; on 2 processes (gloo, test_dist.py's helpers) a --algo gae step updates the
critic and the policy as one process does. CPU, no downloads. Run: python -m pytest -q tests/test_critic.py
"""
import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from options import critic  # noqa: E402
import grpo  # noqa: E402
import score  # noqa: E402
from support import sources  # noqa: E402

FAST = settings(max_examples=50, deadline=None)
F64 = torch.float64
NAN = float("nan")


def close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a, b)


def t64(rows):
    return torch.tensor(rows, dtype=F64)


def slow_gae(rewards, values, mask, gamma, lam):
    """Reference: per sequence, take the policy tokens out, run textbook GAE on that list
    (terminal after the last one), put the results back. (A, R) unwhitened, 0 off the mask."""
    A, R = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for b in range(mask.shape[0]):
        pos = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        r = [float(rewards[b, t]) for t in pos]
        v = [float(values[b, t]) for t in pos] + [0.0]
        a = 0.0
        for k in reversed(range(len(pos))):
            a = r[k] + gamma * v[k + 1] - v[k] + gamma * lam * a
            A[b, pos[k]], R[b, pos[k]] = a, a + v[k]
    return A, R


@st.composite
def episodes(draw, max_b=4, max_t=8):
    """(rewards, values, mask) (B, T) f64 from a seed; junk (nan) rewards and values off the mask."""
    B, T = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    p = draw(st.sampled_from([0.5, 0.8, 1.0]))
    mask = (torch.rand(B, T, generator=g) < p).to(F64)
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    junk = torch.full_like(mask, NAN)
    return torch.where(mask > 0, rewards, junk), torch.where(mask > 0, values, junk), mask


unit = st.floats(0.0, 1.0)

# -----------------------------------------------------------------------------
# GAE: hand-computed examples


def test_hand_gae_single_turn():
    # one sequence: position 0 is the prompt (junk value 9, junk reward 5), policy tokens 1..3,
    # outcome reward 1 on the last one
    mask = t64([[0, 1, 1, 1]])
    rew = t64([[5, 0, 0, 1]])
    val = t64([[9, 0.5, 0.6, 0.8]])
    # gamma 0.9, lam 0.8 (gamma lam = 0.72):
    #   delta3 = 1 + 0.9 * 0 - 0.8 = 0.2                 A3 = 0.2
    #   delta2 = 0 + 0.9 * 0.8 - 0.6 = 0.12              A2 = 0.12 + 0.72 * 0.2 = 0.264
    #   delta1 = 0 + 0.9 * 0.6 - 0.5 = 0.04              A1 = 0.04 + 0.72 * 0.264 = 0.23008
    #   returns = A + V = [-, 0.73008, 0.864, 1.0]
    adv, ret = critic.gae_advantages(rew, val, mask, gamma=0.9, lam=0.8, whiten=False)
    close(adv, [[0, 0.23008, 0.264, 0.2]])
    close(ret, [[0, 0.73008, 0.864, 1.0]])
    # lam = 0: one-step TD errors, A = delta = [-, 0.04, 0.12, 0.2]
    adv0, ret0 = critic.gae_advantages(rew, val, mask, gamma=0.9, lam=0.0, whiten=False)
    close(adv0, [[0, 0.04, 0.12, 0.2]])
    close(ret0, [[0, 0.54, 0.72, 1.0]])  # r + gamma V_next: the TD target
    # gamma = lam = 1: returns are the reward-to-go (1 everywhere), A = 1 - V
    adv1, ret1 = critic.gae_advantages(rew, val, mask, gamma=1.0, lam=1.0, whiten=False)
    close(ret1, [[0, 1, 1, 1]])
    close(adv1, [[0, 0.5, 0.4, 0.2]])


def test_hand_gae_multi_turn_skips_the_env_block():
    # policy turn (positions 0, 1), a tool result (2, 3: mask 0, junk values 9 and rewards 5),
    # a second policy turn (4, 5) with the outcome reward 1 on its last token
    mask = t64([[1, 1, 0, 0, 1, 1]])
    rew = t64([[0, 0, 5, 5, 0, 1]])
    val = t64([[0.3, 0.2, 9, 9, 0.4, 0.5]])
    # gamma 0.5, lam 0.5 (gamma lam = 0.25); "next" of position 1 is position 4:
    #   delta5 = 1 - 0.5 = 0.5                         A5 = 0.5
    #   delta4 = 0.5 * 0.5 - 0.4 = -0.15               A4 = -0.15 + 0.25 * 0.5 = -0.025
    #   delta1 = 0.5 * 0.4 - 0.2 = 0.0                 A1 = 0 + 0.25 * -0.025 = -0.00625
    #   delta0 = 0.5 * 0.2 - 0.3 = -0.2                A0 = -0.2 + 0.25 * -0.00625 = -0.2015625
    # (stepping through the env block instead would use V = 9 and two more discounts)
    adv, ret = critic.gae_advantages(rew, val, mask, gamma=0.5, lam=0.5, whiten=False)
    close(adv, [[-0.2015625, -0.00625, 0, 0, -0.025, 0.5]])
    close(ret, [[0.0984375, 0.19375, 0, 0, 0.375, 1.0]])


def test_hand_gae_whitening():
    # two sequences, gamma = lam = 1, V = 0: A = reward-to-go = [[1, 1], [0, -]] before whitening;
    # whitened over the 3 policy tokens: mean 2/3, unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3
    mask = t64([[1, 1], [1, 0]])
    rew = t64([[0, 1], [0, NAN]])
    val = torch.zeros(2, 2, dtype=F64)
    raw, ret = critic.gae_advantages(rew, val, mask, 1.0, 1.0, whiten=False)
    white, ret_w = critic.gae_advantages(rew, val, mask, 1.0, 1.0, whiten=True)
    close(raw, [[1, 1], [0, 0]])
    sd = (1 / 3) ** 0.5
    close(white, [[1 / 3 / sd, 1 / 3 / sd], [-2 / 3 / sd, 0]], 1e-6)  # eps 1e-8 in the sqrt
    close(ret_w, ret)  # the returns are never whitened
    close(ret, [[1, 1], [0, 0]])


def test_gae_zeros_off_the_mask_and_junk_ignored():
    mask = t64([[0, 1, 1, 0, 0], [0, 0, 1, 0, 0]])  # prompt, response, padding
    rew = t64([[NAN, 0, 1, NAN, 7], [3, NAN, -1, 4, NAN]])
    val = t64([[NAN, 0.1, 0.2, NAN, 8], [float("inf"), NAN, 0.3, 2, NAN]])
    for whiten in (False, True):
        adv, ret = critic.gae_advantages(rew, val, mask, 0.99, 0.95, whiten=whiten)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    adv, ret = critic.gae_advantages(rew, val, mask, 0.99, 0.95, whiten=False)
    close(adv[1, 2], -1 - 0.3)  # a one-token response: A = r - V
    close(ret[1, 2], -1.0)


def test_gae_rejects_bad_input():
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match="must all be"):
        critic.gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), m, 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma"):
        critic.gae_advantages(torch.zeros(2, 3), torch.zeros(2, 3), m, 1.5, 1.0)
    v = torch.zeros(2, 3)
    v[1, 1] = NAN  # a nan value on a policy token is a broken critic, not junk
    with pytest.raises(ValueError, match="non-finite values"):
        critic.gae_advantages(torch.zeros(2, 3), v, m, 1.0, 1.0)

# -----------------------------------------------------------------------------
# GAE: properties


@FAST
@given(episodes(), unit, unit)
def test_gae_matches_slow_per_sequence_reference(ep, gamma, lam):
    rew, val, mask = ep
    adv, ret = critic.gae_advantages(rew, val, mask, gamma, lam, whiten=False)
    ref_a, ref_r = slow_gae(rew, val, mask, gamma, lam)
    close(adv, ref_a)
    close(ret, ref_r)
    close(critic.gae_advantages(rew, val, mask, gamma, lam)[0], grpo.masked_whiten(ref_a, mask))


@FAST
@given(episodes(), unit, unit, st.integers(0, 2**31 - 1))
def test_gae_inserting_env_tokens_anywhere_changes_nothing(ep, gamma, lam, seed):
    # multi-turn episodes interleave tool output (mask 0, junk values and rewards) with policy
    # tokens: wherever it lands, the policy tokens' advantages and returns stay the same
    rew, val, mask = ep
    B, T = mask.shape
    g = torch.Generator().manual_seed(seed)
    W = T + int(torch.randint(1, 6, (1,), generator=g))  # W - T env tokens per row
    rew2 = torch.full((B, W), 5.0, dtype=F64)
    val2 = torch.full((B, W), 9.0, dtype=F64)
    mask2 = torch.zeros(B, W, dtype=F64)
    cols = torch.stack([torch.randperm(W, generator=g)[:T].sort().values for _ in range(B)])  # (B, T)
    rows = torch.arange(B)[:, None]
    rew2[rows, cols], val2[rows, cols], mask2[rows, cols] = rew, val, mask
    for whiten in (False, True):
        a1, r1 = critic.gae_advantages(rew, val, mask, gamma, lam, whiten)
        a2, r2 = critic.gae_advantages(rew2, val2, mask2, gamma, lam, whiten)
        close(a2[rows, cols], a1)
        close(r2[rows, cols], r1)
        assert (a2[mask2 == 0] == 0).all() and (r2[mask2 == 0] == 0).all()


@FAST
@given(episodes(), unit)
def test_gae_lambda_one_is_return_minus_value_and_v0_is_reinforce_pp(ep, gamma):
    rew, val, mask = ep
    G = grpo._discounted_returns(rew, mask, gamma)  # REINFORCE++'s returns (mask-0 skipped)
    adv, ret = critic.gae_advantages(rew, val, mask, gamma, 1.0, whiten=False)
    close(ret, G)  # lam = 1: the returns are Monte Carlo, whatever V is
    close(adv, torch.where(mask > 0, G - val, 0.0))
    # with V = 0 the whitened advantages are exactly REINFORCE++'s (a fresh critic's first step)
    zero = torch.zeros_like(val)
    close(critic.gae_advantages(rew, zero, mask, gamma, 1.0)[0], grpo.reinforce_pp_advantages(rew, mask, gamma))


@FAST
@given(episodes(), unit)
def test_gae_lambda_zero_is_one_step_td(ep, gamma):
    rew, val, mask = ep
    adv, ret = critic.gae_advantages(rew, val, mask, gamma, 0.0, whiten=False)
    # V of the next policy token of the same row (0 after the last one), found by a plain scan
    nxt = torch.zeros_like(val)
    for b in range(mask.shape[0]):
        v_next = 0.0
        for t in reversed(range(mask.shape[1])):
            if mask[b, t] > 0:
                nxt[b, t], v_next = v_next, float(val[b, t])
    target = torch.where(mask > 0, rew + gamma * nxt, 0.0)  # r_t + gamma V_t'
    close(ret, target)  # lam = 0: the returns are the TD targets
    close(adv, torch.where(mask > 0, target - val, 0.0))  # and A the TD errors


# -----------------------------------------------------------------------------
# value loss


def test_hand_value_loss_clipped_and_unclipped():
    v = torch.tensor([[1.0, 0.0, 0.5, NAN]], dtype=F64, requires_grad=True)
    old = t64([[0.5, 0.5, 0.5, NAN]])
    R = t64([[2.0, 1.0, 0.0, NAN]])
    mask = t64([[1, 1, 1, 0]])  # the last token is padding with junk everywhere
    # c = 0.2, bounds [0.3, 0.7]:
    #   t0: (1 - 2)^2 = 1,   clip -> 0.7: (0.7 - 2)^2 = 1.69 larger -> 0.845, clipped, gradient 0
    #   t1: (0 - 1)^2 = 1,   clip -> 0.3: (0.3 - 1)^2 = 0.49        -> 0.5,   gradient v - R = -1
    #   t2: (0.5 - 0)^2 = 0.25, inside the bounds: equal              -> 0.125, gradient 0.5
    loss, st = critic.value_loss(v, old, R, mask, clip=0.2)
    close(loss, [[0.845, 0.5, 0.125, 0.0]])
    close(st["vf_clipfrac"], 1 / 3)
    close(st["value_mean"], 0.5)
    (grad,) = torch.autograd.grad(loss.sum(), v)
    close(grad, [[0.0, -1.0, 0.5, 0.0]])
    # unclipped (None or 0): 0.5 (v - R)^2 everywhere, nothing clipped
    for c in (None, 0, 0.0):
        loss_u, st_u = critic.value_loss(v, old, R, mask, clip=c)
        close(loss_u, [[0.5, 0.5, 0.125, 0.0]])
        close(st_u["vf_clipfrac"], 0.0)
    assert not st["vf_clipfrac"].requires_grad and st["vf_clipfrac"].dim() == 0
    with pytest.raises(ValueError):
        critic.value_loss(v, old, R, mask, clip=-0.1)


@FAST
@given(episodes(), st.floats(0.01, 2.0), st.integers(0, 2**31 - 1))
def test_value_loss_clip_only_adds(ep, c, seed):
    # max(l1, l2) >= l1; equal where v stays within c of v_old; 0 off the mask
    _, R, mask = ep
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(mask.shape, generator=g, dtype=F64)
    v = old + torch.randn(mask.shape, generator=g, dtype=F64)
    clipped, st = critic.value_loss(v, old, R, mask, clip=c)
    plain, _ = critic.value_loss(v, old, R, mask, clip=None)
    assert ((clipped - plain)[mask > 0] >= 0).all()
    inside = ((v - old).abs() <= c) & (mask > 0)
    close(clipped[inside], plain[inside])
    assert (clipped[mask == 0] == 0).all() and (plain[mask == 0] == 0).all()
    assert 0.0 <= float(st["vf_clipfrac"]) <= 1.0


def test_hand_explained_variance():
    R = t64([[1, 2, 3, NAN]])
    mask = t64([[1, 1, 1, 0]])
    close(critic.explained_variance(R, R, mask), 1.0)  # perfect critic
    close(critic.explained_variance(torch.full_like(R, 2.0), R, mask), 0.0)  # the mean: no better than a constant
    # V = [3, 2, 1]: R - V = [-2, 0, 2], Var 8/3 against Var(R) = 2/3 -> 1 - 4 = -3
    close(critic.explained_variance(t64([[3, 2, 1, NAN]]), R, mask), -3.0)
    close(critic.explained_variance(R, torch.ones_like(R), mask), 0.0)  # Var(R) = 0: reported as 0

# -----------------------------------------------------------------------------
# the critic model (tiny random Llama from conftest, a tiny Qwen2 built here)


def make_tiny_qwen2(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return Qwen2ForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("tiny_qwen2")
    make_tiny_qwen2(tiny_tokenizer).save_pretrained(d)
    return str(d)


@pytest.fixture(params=["llama", "qwen2"])
def policy_dir(request, tiny_model_dir, qwen2_dir):
    return tiny_model_dir if request.param == "llama" else qwen2_dir


def _policy(d):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)


def toy_batch(B=4, T=12, seed=0):
    """A right-padded batch dict like episodes_to_batch's: rows of lengths T, T-3, T-5, ...;
    prompt = the first 3 tokens; reward +1 / -1 alternating."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    lengths = torch.tensor([max(T - 2 * i - (i > 0), 5) for i in range(B)])
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.where(attn > 0, ids, 256)  # pad id
    loss_mask = (attn > 0) & (torch.arange(T)[None] >= 3)
    rewards = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(B)])
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask.float(), "rewards": rewards,
            "groups": torch.zeros(B, dtype=torch.long)}


def test_load_critic_from_a_policy_folder(policy_dir):
    from transformers import AutoModelForCausalLM
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    c = critic.load_critic(policy_dir)
    assert type(c).__name__.endswith("ForTokenClassification")
    assert c.dropout.p == 0.0 and c.config.classifier_dropout == 0.0  # transformers' default would be 0.1
    assert all(p.dtype == torch.float32 for p in c.parameters())
    assert (c.score.weight == 0).all() and (c.score.bias == 0).all()  # zero head: V = 0 to start
    # the trunk is the policy's, weight for weight
    pol = policy.model.state_dict()
    for name, w in c.model.state_dict().items():
        assert torch.equal(w, pol[name]), name
    batch = toy_batch()
    v = critic.batch_values(c, batch, micro_batch_size=3)
    assert v.shape == (4, 11) and (v == 0).all()


def _critic_with_random_head(model_dir, bias):
    """A fresh critic whose head is N(0, 1) (seed 0) with a constant bias, so values are not all 0."""
    c = critic.load_critic(model_dir)
    with torch.no_grad():
        c.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
        c.score.bias.fill_(bias)
    return c


def test_token_values_are_the_hf_forward_aligned_with_logprobs(tiny_model_dir):
    c = _critic_with_random_head(tiny_model_dir, bias=0.3)
    batch = toy_batch()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        v = critic.token_values(c, ids, attn)
        ref = c(input_ids=ids, attention_mask=attn).logits[:, :-1, 0]  # position t's output: V(ids[:, :t+1])
        lp, _ = score.sequence_logprobs(_policy(tiny_model_dir), ids, attn)
    assert v.dtype == torch.float32 and v.shape == lp.shape == (4, 11)
    close(v, ref, 1e-6)
    # V at column t depends on tokens 0..t only: changing token t+1 leaves column t alone
    ids2 = ids.clone()
    ids2[:, 6] = (ids2[:, 6] + 1) % 256
    with torch.no_grad():
        v2 = critic.token_values(c, ids2, attn)
    assert torch.equal(v2[:, :6], v[:, :6]) and not torch.equal(v2[:, 6:], v[:, 6:])
    # batch_values == one row at a time, on each row's real positions (micro-batches, padding trimmed)
    bv = critic.batch_values(c, batch, micro_batch_size=3)
    for i in range(4):
        n = int(attn[i].sum())
        with torch.no_grad():
            one = critic.token_values(c, ids[i:i + 1, :n], attn[i:i + 1, :n])
        close(bv[i, :n - 1], one[0], 1e-5)


def test_token_values_head_runs_in_float32_under_bf16_autocast(tiny_model_dir):
    # the decoder's matmuls run in bf16 under autocast, the head does not: a bf16 value near 1 is
    # off by up to ~0.004, the size of the TD errors GAE sums
    c = _critic_with_random_head(tiny_model_dir, bias=1.0)
    batch = toy_batch()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        v = critic.token_values(c, ids, attn)
        h = c.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]  # (the final norm is fp32)
        assert c.score(h).dtype == torch.bfloat16  # what the head would give inside the autocast
    assert v.dtype == torch.float32
    with torch.no_grad():
        close(v, c.score(h).squeeze(-1), 1e-6)  # the fp32 head on the bf16 trunk's output
    assert (v != v.bfloat16().float()).any()  # values not rounded to bf16


def test_fresh_critic_gives_reinforce_pp_advantages(tiny_model_dir):
    # V = 0 everywhere at the start, so GAE with lam = 1 is exactly REINFORCE++ on the first step
    c = critic.load_critic(tiny_model_dir)
    batch = toy_batch()
    mask = batch["loss_mask"][:, 1:]
    tr = grpo.last_token_rewards(batch["rewards"], mask)
    adv, ret = critic.gae_advantages(tr, critic.batch_values(c, batch, 4), mask, gamma=1.0, lam=1.0)
    close(adv, grpo.reinforce_pp_advantages(tr, mask, 1.0))
    close(ret, grpo.broadcast_to_tokens(batch["rewards"], mask))  # returns = the outcome on every token


def train_critic(c, batch, rollouts, epochs=3, lr=1e-2, clip=0.5):
    """PPO's critic loop on one fixed batch: per "rollout" the old values (no grad, before the
    update), then `epochs` AdamW steps of the clipped value loss against fixed returns (GAE with
    gamma = lam = 1: the outcome on every token). Returns the loss of every step."""
    mask = batch["loss_mask"][:, 1:]
    R = grpo.broadcast_to_tokens(batch["rewards"], mask)
    opt = torch.optim.AdamW(c.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(rollouts):
        old = critic.batch_values(c, batch, 4)
        c.train()  # dropout 0: the same function as eval
        for _ in range(epochs):
            v = critic.token_values(c, batch["input_ids"], batch["attention_mask"])
            per_tok, _ = critic.value_loss(v, old, R, mask, clip=clip)
            loss = grpo.token_mean(per_tok, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        c.eval()
    return losses


def test_value_loss_falls_on_a_toy_problem(tiny_model_dir):
    torch.manual_seed(0)
    c = critic.load_critic(tiny_model_dir)
    losses = train_critic(c, toy_batch(), rollouts=10)  # 30 AdamW steps
    assert losses[0] == pytest.approx(0.5)  # V = 0, R = +-1: 0.5 * 1 on every token
    assert losses[-1] < 0.1 * losses[0], losses


def test_save_and_load_is_bit_exact(tiny_model_dir, tmp_path):
    c = critic.load_critic(tiny_model_dir)
    batch = toy_batch()
    train_critic(c, batch, rollouts=1)  # a trained head and trunk, not the initial weights
    assert (c.score.weight != 0).any()
    folder = critic.save_critic(c, tmp_path / critic.FOLDER)
    c2 = critic.load_critic(folder)
    sd, sd2 = c.state_dict(), c2.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert sd[k].dtype == sd2[k].dtype and torch.equal(sd[k], sd2[k]), k  # the head is not re-zeroed
    assert torch.equal(critic.batch_values(c, batch, 3), critic.batch_values(c2, batch, 3))


def test_save_refuses_a_lora_critic(tiny_model_dir, tmp_path):
    from options import lora
    c = critic.load_critic(tiny_model_dir)
    lora.apply_lora(c, 4, 8, ["q_proj"])
    with pytest.raises(ValueError, match="LoRA"):
        critic.save_critic(c, tmp_path / "c")


def test_memory_figure_in_the_docstring():
    # critic.py's docstring: a Qwen2.5-1.5B critic has 1,543,715,841 parameters, 16 bytes each in
    # float32 training (weights 4 + grads 4 + AdamW 8) = 24.7 GB
    from transformers import Qwen2Config, Qwen2ForTokenClassification
    with torch.device("meta"):
        c = Qwen2ForTokenClassification(Qwen2Config(num_labels=1, **sources.SHAPES["random-qwen2.5-1.5b"]))
    n = sum(p.numel() for p in c.parameters())
    assert n == 1_543_715_841
    assert round(16 * n / 1e9, 1) == 24.7 and round(4 * n / 1e9, 1) == 6.2


def test_load_critic_prints_one_plain_line(tiny_model_dir, capsys):
    # not transformers' load report (a table with ANSI codes about the new head): one line of ours
    import logging
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        critic.load_critic(tiny_model_dir)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert [r.getMessage()[:60] for r in records] == []
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "\x1b[" not in lines[0] and "value head" in lines[0], lines


# ---- torchrun: the critic on 2 processes (gloo, CPU) against one

def _gae_step(rank, size, model_dir, eps, shard, out):
    """One --algo gae train_step on this rank's groups, SGD for the policy (lr 1) and the critic (a
    random value head, so the trunk's gradient is not 0: ~1e3, so lr 1e-3); rank 0 saves both
    models' weight deltas."""
    import train
    from conftest import make_tiny_model, make_tiny_tokenizer
    from support import dist
    tok = make_tiny_tokenizer()
    policy, c = make_tiny_model(tok), _critic_with_random_head(model_dir, bias=0.3)
    before = {"policy": {k: v.clone() for k, v in policy.state_dict().items()},
              "critic": {k: v.clone() for k, v in c.state_dict().items()}}
    args = train.parse_args(["--model", "x", "--algo", "gae", "--prompts-per-step", "4", "--n", "4",
                             "--micro-batch-size", "2", "--max-context", "64", "--grad-clip", "0"])
    args.shard = shard  # train.py refuses FSDP with the HF engine; train_step alone needs no engine
    world = dist.World("cpu")
    scorer, policy = dist.wrap(score.Scorer(policy), world, shard, torch.float32)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    run = train.Run(args, policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0), critic=c,
                    critic_optimizer=torch.optim.SGD(c.parameters(), lr=1e-3), scorer=scorer, world=world,
                    pad_id=tok.pad_token_id)
    state = {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0}
    m = world.mean_metrics(train.train_step(run, [e for e in eps if e.group % size == rank], state))
    after = {"policy": dist.full_state_dict(policy, world.main) if size > 1 else policy.state_dict(),
             "critic": c.state_dict()}
    if world.main:
        torch.save({"delta": {name: {k: after[name][k] - v for k, v in b.items()} for name, b in before.items()},
                    "metrics": m}, out)
    world.close()


def _gae_worker(rank, size, port, model_dir, eps, shard, out):
    from test_dist import _as_rank
    _as_rank(rank, size, port)
    _gae_step(rank, size, model_dir, eps, shard, out)


@pytest.mark.parametrize("shard", ["ddp", "fsdp"])
def test_two_rank_critic_and_policy_updates_equal_one_rank(tiny_model_dir, tmp_path, shard):
    # each rank: every other group; the critic's loss divides by both ranks' tokens and its gradients
    # are summed over ranks, GAE's whitening reads both ranks' tokens: one update of each model equals
    # the one-process update on all the episodes (the critic is replicated, under FSDP2 too)
    from conftest import make_tiny_tokenizer
    from test_dist import _episodes, _free_port, _spawn
    eps = _episodes(make_tiny_tokenizer())
    _gae_step(0, 1, tiny_model_dir, eps, "ddp", tmp_path / "one.pt")  # in this process: a world of one
    _spawn(_gae_worker, (2, _free_port(), tiny_model_dir, eps, shard, tmp_path / "two.pt"))
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for name in ("policy", "critic"):
        assert any(v.abs().max() > 0 for v in one["delta"][name].values()), name  # the update moved it
        for k, v in one["delta"][name].items():
            torch.testing.assert_close(two["delta"][name][k], v, rtol=1e-4, atol=1e-6, msg=f"{name} {k}")
    assert any(v.abs().max() > 0 for k, v in one["delta"]["critic"].items() if k not in critic.HEAD)  # the trunk too
    for k in ("loss", "grad_norm", "vf_loss", "critic_grad_norm"):
        assert two["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-4, abs=1e-7), k


def test_gae_run_on_two_processes(tiny_model_dir, tmp_path):
    # train.py under 2 processes with a critic and 2 updates a step (--mini-batch-size 4 of 4 prompts x 2:
    # 2 episodes a rank each): 2 steps, every update counted, a checkpoint with the critic
    import json
    from test_dist import _run
    from test_train import _argv
    _run(2, _argv(tiny_model_dir, tmp_path, "--algo", "gae", "--prompts-per-step", "4", "--n", "2",
                  "--mini-batch-size", "4"))
    hist = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [h["step"] for h in hist] == [1, 2]
    for h in hist:
        assert h["episodes"] == 8 and h["updates"] == 2 and h["vf_loss"] > 0 and h["critic_grad_norm"] > 0
    assert (tmp_path / "ckpt" / "step_000002" / critic.FOLDER / "model.safetensors").exists()
