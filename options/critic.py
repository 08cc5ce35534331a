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
source (LlamaForTokenClassification, Qwen2ForTokenClassification, ... are all transformers'
GenericForTokenClassification, checked against 5.23): the policy's decoder without its LM head,
plus `score`, a Linear(d, 1) with bias, over the final (normed) hidden state of every position.
It saves and loads as an ordinary HF folder (save_pretrained / from_pretrained).

Why a separate model and not a value head on the policy's trunk (as TRL's old
AutoModelForCausalLMWithValueHead did):
  - the value loss cannot disturb the policy's features (with a shared trunk, the regression's
    gradient goes into the same weights as the policy gradient, at a scale set by a vf_coef knob);
  - the critic gets its own optimizer and learning rate (verl's critic: 1e-5 against the actor's
    1e-6; a critic usually wants a larger one), its own warmup and grad clip;
  - it can be dropped, saved, loaded or swapped for a smaller one without touching the policy.
  The cost: a second model's weights, gradients and AdamW state, 16 bytes per parameter in
  float32 (like the policy: score.estimate_memory). For Qwen2.5-1.5B the critic has
  1,543,715,841 parameters: the causal LM's 1,543,714,304 (its LM head is tied to the embeddings,
  so dropping it removes none) plus the 1,537 of `score`. So
      weights 4 x 1.544e9 = 6.2 GB,  gradients 6.2 GB,  AdamW's two moments 12.3 GB  ->  24.7 GB,
  on top of the same 24.7 GB for a full-parameter 1.5B policy. The l40s preset (48 GB, vLLM
  taking 0.3 x 48 = 14.4 GB) cannot hold both: 24.7 + 24.7 + 14.4 = 64 GB before any activation
  (and the rollout phase alone, gradients freed, still needs 18.5 + 18.5 + 14.4 = 51 GB). There it
  needs a LoRA critic or a smaller critic with the same tokenizer (Qwen2.5-0.5B: 494M parameters,
  7.9 GB). The critic's forward is a little cheaper than the policy's: no vocabulary projection.
  (tests/test_critic.py recomputes the parameter count from score.SHAPES.)

Choices
  - Head init: zero (weight and bias), so a fresh critic says V = 0 everywhere: the first
    advantages are then GAE of the rewards alone (with lam = 1 exactly REINFORCE++'s), not noise
    from a random head. The first backward reaches only the head (dV/dh = w = 0), like LoRA's
    B = 0; the trunk gets gradients from the second step on. (transformers' own init is normal
    with std initializer_range = 0.02; OpenRLHF uses std 1 / (d + 1); verl keeps transformers'.)
  - Dropout 0: GenericForTokenClassification takes config.classifier_dropout, else
    config.hidden_dropout, else 0.1 (transformers 5.23); Llama and Qwen2 configs have neither, so
    the head would drop 10% of the hidden state in train mode (which --grad-checkpointing needs).
    We set classifier_dropout = 0.0, as verl does, so train and eval modes are one function; the
    decoder's own attention_dropout is already 0 in these configs.
  - float32 master weights, like the policy's: an AdamW step moves a weight by ~lr (1e-5 on a
    weight of ~0.02), below bf16's resolution (2^-8 ~ 0.4% of the weight), so it would be lost.
    The forward runs under the caller's autocast (bf16 on GPU); the head itself runs outside it,
    in float32: a bf16 value near 1 is off by up to 2^-8 ~ 0.004, the size of the TD errors GAE sums.
  - Alignment: values[:, t] is the output at position t, the value of the state ids[:, :t+1] in
    which token ids[:, t+1] is chosen: the same columns as sequence_logprobs' logp[:, t] and the
    loss mask mask[:, t] = loss_mask[:, t+1].
  - A LoRA critic is not supported here: lora.apply_lora would freeze `score` (not a target) and
    save_critic would write adapter keys that load_critic cannot read; save_critic refuses it.

Saving: save_critic(critic, folder) writes config.json + model.safetensors (float32), which
load_critic(folder) reads back bit-exact (its head is kept, not zeroed). In a checkpoint it
belongs in step_NNNNNN/critic/ (FOLDER), with the critic's AdamW state in trainer_state.pt.

Test: python -m pytest -q tests/test_critic.py   (CPU, seconds)
"""
from pathlib import Path

import torch

from grpo import masked_mean, masked_whiten, token_mean
from score import batched, micro_batches, unwrap

FOLDER = "critic"  # the critic's subfolder in a checkpoint folder
HEAD = {"score.weight", "score.bias"}  # GenericForTokenClassification's head (transformers 5.23)


def load_critic(src, dtype=torch.float32):
    """The critic from src: the policy's HF folder (new zero head) or a save_critic folder (its head)."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    cfg = AutoConfig.from_pretrained(src)
    cfg.num_labels = 1
    cfg.classifier_dropout = 0.0  # else 0.1 for Llama/Qwen2 (see the module doc)
    critic, info = AutoModelForTokenClassification.from_pretrained(src, config=cfg, dtype=dtype,
                                                                   output_loading_info=True)
    missing = set(info["missing_keys"])
    if missing - HEAD or info["mismatched_keys"]:
        raise RuntimeError(f"load_critic: {src} does not hold this model's decoder: missing "
                           f"{sorted(missing - HEAD)[:5]}, mismatched {sorted(info['mismatched_keys'])[:5]}")
    if missing:  # a policy's folder: the head is new, start it at V = 0
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


def update_critic(critic, optimizer, batch, values, returns, mask, autocast, phases, seed=0, epochs=1,
                  mini_batch_size=None, micro_batch_size=8, micro_batch_tokens=0, value_clip=0.5, grad_clip=1.0):
    """The critic's own PPO epochs over the step's batch: per mini-batch (the policy's sizes, its
    own shuffle), value_loss against the GAE returns with the values from before the update
    as the clip anchor, token-mean over the mini-batch, grad clip, one AdamW step (skipped if the
    gradient is not finite). Every sequence trains the critic, also those whose advantages are 0.
    Returns the metrics (vf_loss, vf_clipfrac, value_mean, critic_grad_norm)."""
    from support.logs import Means
    B, lengths = mask.shape[0], batch["attention_mask"].sum(1)
    device = next(critic.parameters()).device
    mini_batch_size = mini_batch_size or B
    stats, gen = Means(), torch.Generator().manual_seed(seed * 7919 + 1)
    for _ in range(epochs):
        order = torch.randperm(B, generator=gen) if epochs > 1 or mini_batch_size < B else torch.arange(B)
        for s in range(0, B, mini_batch_size):
            mb = order[s:s + mini_batch_size]
            tokens, loss_sum = mask[mb].sum().clamp(min=1).to(device), torch.zeros((), device=device)
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
