"""
The critic of PPO with GAE: a second transformer, initialised from the policy's weights, with a
scalar value head; GAE turns its values into advantages and returns, the clipped value loss trains it.

    delta_t = r_t + gamma V_t' - V_t,   A_t = delta_t + gamma lam A_t',   R_t = A_t + V_t
    l_t = 0.5 max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)    (verl's c = 0.5; c = 0: plain)

    critic = load_critic(src)                      src: the policy's HF folder (or a saved critic)
    values = batch_values(critic, batch, mbs, dev) (B, T-1), no grad, before the update
    v = token_values(critic, ids, attn)            (b, t-1), with grad, in the update
    update_critic(critic, optimizer, batch, values, returns, mask, autocast, phases, ...)   train.py's critic step

What it is: transformers' AutoModelForTokenClassification with num_labels = 1 on the policy's
source (GenericForTokenClassification for Llama, Qwen2, ...; checked against transformers 5.23):
the policy's decoder without its LM head, plus `score`, a Linear(d, 1) with bias, over the final
(normed) hidden state of every position. save_critic / load_critic: a plain HF folder, float32,
bit-exact (head kept); in a checkpoint step_NNNNNN/critic/ (FOLDER), its AdamW in trainer_state.pt.

Why a separate model, not a value head on the policy's trunk (TRL's old ...WithValueHead): the
value loss cannot disturb the policy's features; the critic gets its own optimizer, learning rate
(verl: 1e-5 against the actor's 1e-6), warmup and grad clip; it can be dropped, saved or swapped
without touching the policy. The cost: a second model's weights, gradients and AdamW state, 16
bytes a parameter in float32 (options/memory.estimate_memory; Qwen2.5-1.5B: 1,543,715,841
parameters, 24.7 GB, counted in tests/test_options.py), so where policy and critic do not both fit
beside vLLM it needs a smaller critic with the same tokenizer.

Choices
  - Head init: zero (weight and bias), so a fresh critic says V = 0: the first advantages are GAE
    of the rewards alone (lam = 1: REINFORCE++'s), not noise from a random head; the first backward
    reaches only the head (dV/dh = w = 0, like LoRA's B = 0).
  - Dropout 0: with neither classifier_dropout nor hidden_dropout in the config (Llama, Qwen2) the
    head drops 0.1 in train mode (transformers 5.23); we set classifier_dropout = 0.0, as verl
    does, so train and eval modes are one function.
  - float32 master weights, like the policy's: an AdamW step (~lr) is below bf16's resolution. The
    head runs outside the caller's autocast: bf16's 2^-8 near 1 is the size of the TD errors GAE sums.
  - Alignment: values[:, t] = V(ids[:, :t+1]), the state in which ids[:, t+1] is chosen: the
    columns of sequence_logprobs' logp[:, t] and of mask[:, t] = loss_mask[:, t+1].
  - No LoRA critic: apply_lora would freeze `score`, and save_critic (which refuses it) would write
    adapter keys load_critic cannot read.

Test: python -m pytest -q tests/test_options.py   (its options/critic.py section; CPU, seconds)
"""
from pathlib import Path

import torch

from grpo import masked_mean, masked_whiten, token_mean
from support.dist import World
from score import batched, micro_batches, unwrap

FOLDER = "critic"  # the critic's subfolder in a checkpoint folder
HEAD = {"score.weight", "score.bias"}  # GenericForTokenClassification's head (transformers 5.23)


def load_critic(src, dtype=torch.float32):
    """The critic from src: the policy's HF folder (new zero head) or a save_critic folder (its head)."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging
    cfg = AutoConfig.from_pretrained(src)
    cfg.num_labels = 1
    cfg.classifier_dropout = 0.0  # else 0.1 for Llama/Qwen2 (see the module doc)
    # transformers (5.24) logs a "LOAD REPORT" table with ANSI codes about the new head, which is
    # expected here: quiet it, check the same keys below and print one line instead
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        critic, info = AutoModelForTokenClassification.from_pretrained(src, config=cfg, dtype=dtype,
                                                                       output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = set(info["missing_keys"])
    if missing - HEAD or info["mismatched_keys"]:
        raise RuntimeError(f"load_critic: {src} does not hold this model's decoder: missing "
                           f"{sorted(missing - HEAD)[:5]}, mismatched {sorted(info['mismatched_keys'])[:5]}")
    print(f"critic: {src}'s decoder + " + ("a new value head, zero (V = 0)" if missing else "its saved value head"))
    if missing:  # a policy's folder: the head is new, start it at V = 0 (transformers, verl: std 0.02)
        with torch.no_grad():
            critic.score.weight.zero_()
            if critic.score.bias is not None:
                critic.score.bias.zero_()
    if critic.dropout.p != 0:  # a transformers change in how the dropout is picked must not slip by
        raise RuntimeError(f"load_critic: head dropout is {critic.dropout.p}, want 0")
    return critic


def token_values(critic, ids, attn):
    """Values (b, t-1) float32: values[:, t] = V(ids[:, :t+1]), aligned with sequence_logprobs' logp.

    Runs under the caller's autocast and grad mode; the head runs in float32 (module doc)."""
    m = unwrap(critic)
    h = m.base_model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[:, :-1]  # (b, t-1, d)
    h = m.dropout(h)  # p = 0 (load_critic): kept so this is exactly the HF forward
    with torch.autocast(device_type=h.device.type, enabled=False):
        return m.score(h.to(m.score.weight.dtype)).squeeze(-1).float()  # (b, t-1)


def batch_values(critic, batch, micro_batch_size, device="cpu", tokens=0):
    """No-grad values (B, T-1) of a whole padded batch (episodes_to_batch's dict), on the CPU, in
    micro-batches like batch_logprobs (score.batched); 0 past a row's own length (under mask 0)."""
    return batched(lambda ids, attn: token_values(critic, ids, attn), batch, micro_batch_size, device, tokens)


def save_critic(critic, folder):
    """Write the critic as a plain HF folder (config.json + model.safetensors) that load_critic reads."""
    m = unwrap(critic)
    if any("lora_" in name for name, _ in m.named_parameters()):
        raise ValueError("save_critic: a LoRA critic is not supported (its adapters and head would not load back)")
    m.save_pretrained(folder)
    return str(Path(folder))


def start_critic(src, device, grad_checkpointing=False, lr=1e-5, weight_decay=0.0):
    """(critic, its AdamW) for a run: load_critic(src) on device, train mode for activation
    checkpointing (transformers only checkpoints in train mode; dropout is 0, module doc)."""
    model = load_critic(src).to(device)
    model.train(grad_checkpointing)
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    device = torch.device(device)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=device.type == "cuda")


def update_critic(critic, optimizer, batch, values, returns, mask, autocast, phases, stats, seed=0, epochs=1,
                  mini_batch_size=None, micro_batch_size=8, micro_batch_tokens=0, value_clip=0.5, grad_clip=1.0,
                  world=None):
    """The critic's own PPO epochs over the step's batch: per mini-batch (the policy's sizes, its
    own shuffle), value_loss against the GAE returns with the values from before the update
    as the clip anchor, token-mean over the mini-batch, grad clip, one AdamW step (skipped if the
    gradient is not finite). Every sequence trains the critic, also those whose advantages are 0.
    stats (support/logs.Means) collects them; returns their means (vf_loss, vf_clipfrac, value_mean,
    critic_grad_norm). Under torchrun (world: support/dist.World; mini_batch_size: this rank's M/W)
    every rank holds the whole critic, without DDP: the token-mean divides by all ranks' tokens and
    the gradients and loss are summed over ranks before the clip, the single-GPU update of the union."""
    world = world or World()  # None: this process alone
    B, lengths = mask.shape[0], batch["attention_mask"].sum(1)
    device = next(critic.parameters()).device
    mini_batch_size = mini_batch_size or B
    gen = torch.Generator().manual_seed(seed * 7919 + 1)
    for _ in range(epochs):
        order = torch.randperm(B, generator=gen) if epochs > 1 or mini_batch_size < B else torch.arange(B)
        for s in range(0, B, mini_batch_size):
            mb = order[s:s + mini_batch_size]
            tokens = torch.tensor(max(world.sum([mask[mb].sum()])[0], 1.0), device=device)  # every rank's
            loss_sum = torch.zeros((), device=device)
            for idx in micro_batches(lengths, mb, micro_batch_size, micro_batch_tokens):
                t = int(lengths[idx].max())
                mk = mask[idx, :t - 1].to(device)
                with autocast(), phases("critic"):
                    v = token_values(critic, batch["input_ids"][idx, :t].to(device), batch["attention_mask"][idx, :t].to(device))
                    per_tok, st = value_loss(v, values[idx, :t - 1].to(device), returns[idx, :t - 1].to(device),
                                                  mk, value_clip)
                    loss = token_mean(per_tok, mk, denom=tokens)
                    loss.backward()
                loss_sum += loss.detach()
                stats.add(st, weight=mk.sum())
            with phases("critic"):
                world.sum_grads(critic, loss_sum)  # torchrun: every rank's share summed (a world of one: nothing)
                gnorm = torch.nn.utils.clip_grad_norm_(critic.parameters(), grad_clip if grad_clip > 0 else float("inf"))
                if bool(torch.isfinite(gnorm) & torch.isfinite(loss_sum)):
                    optimizer.step()
                    stats.add({"vf_loss": loss_sum, "critic_grad_norm": gnorm})
                optimizer.zero_grad(set_to_none=True)
    return stats.means()


# ---- GAE and the value loss

def gae_advantages(token_rewards, values, mask, gamma, lam, whiten=True):
    """GAE over policy tokens: (advantages, returns), both (B, T), 0 off the mask. t' is the next
    policy token of the same sequence; after the last one V = A = 0 (a truncated response counts as
    finished too, as verl and SkyRL do: no bootstrap). A is whitened over the batch's masked tokens
    (as verl and SkyRL do for GAE), the returns R = A + V are not. lam = 1 gives G_t - V_t (V = 0:
    exactly REINFORCE++), lam = 0 the one-step TD error. Multi-turn: mask-0 tokens inside a response
    (tool output) are transparent, adding neither a discount step nor their states' values: verl's
    compute_gae_advantage_return does the same; SkyRL's (ppo_utils.py) steps through every position."""
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



def value_loss(values, old_values, returns, mask, clip=None):
    """PPO's clipped value loss per token (B, T), 0 on mask-0 tokens (verl's compute_value_loss, SkyRL's
    ppo_critic_loss), and detached 0-d stats over masked tokens: vf_clipfrac (where the clipped term
    is strictly larger, so the gradient is 0) and value_mean. clip None or 0: the plain 0.5 (v - R)^2."""
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
    """1 - Var(R - V) / Var(R) over masked tokens, a 0-d tensor: 1 for a perfect critic, 0 for one no
    better than a constant (and when Var(R) = 0 or the mask is empty), < 0 worse."""
    def var(x):
        keep = mask > 0
        dev = torch.where(keep, x - masked_mean(x, mask), torch.zeros_like(x))
        return (dev ** 2).sum() / keep.sum().clamp(min=1)
    var_r = var(returns)
    ev = 1.0 - var(returns - values) / var_r.clamp(min=torch.finfo(var_r.dtype).tiny)
    return torch.where(var_r > 0, ev, torch.zeros_like(ev))
