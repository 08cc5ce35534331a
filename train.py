r"""
nanoRL's training script: RL on a chat model, top to bottom: data -> rollouts -> the step -> the loop.

    python train.py                                   # embedded SmolLM2-135M-Instruct, CPU, 1-digit multiply
    python train.py --gpu h100 --env gsm8k            # Qwen2.5-1.5B-Instruct, vLLM rollouts
    python train.py --env mcp --gpu l40s [--mcp-config FILE]   # multi-turn tool use against MCP servers
    python train.py --gpu l40s --model Qwen/Qwen2.5-7B-Instruct --lora-rank 32   # LoRA (lora.py)
    python train.py --gpu h100 --rollout-quant fp8    # FlashRL: fp8/int8 rollouts + TIS (quant.py)
    python train.py --resume runs/nanorl              # continue exactly where a run stopped
    torchrun --nproc-per-node 2 -- train.py --gpu h100   # one rank per GPU, DDP or --shard fsdp (dist.py)
    python -m pytest -q tests/test_train.py           # CPU tests with a tiny random model

One step (every variant is a visible if/elif; the formulas and our choices are in grpo.py):
  1. collect: P prompts x n rollouts (HFEngine sharing this model on the CPU, vLLM on a GPU);
     DAPO: + overlong punishment, then dynamic sampling (drop all-equal-reward groups, draw more)
  2. train_step: advantages (--algo; gae: GAE on a critic's values, then the critic's own update,
     critic.py); old logprobs: the engine's (--old-logprobs rollout), a no-grad forward
     (recompute), or, exactly on-policy, the training forward's own (detach); reference
     logprobs if --kl-coef > 0; TIS weights w if --tis-cap. Then --ppo-epochs passes of
     mini-batches (one AdamW step each) of micro-batches, per policy token
         l_t = loss(ppo | gspo | cispo)(logp, old, A) * w + kl_coef * k(logp, ref) - c * H_t
     reduced (--reduction) with the mini-batch's global denominators, so accumulation is exact.
     H_t: the policy's token entropy; c: --entropy-coef, or adaptive with --entropy-target.
  3. the next step pushes the weights to the engine (vLLM: wake, sync (+ check every
     --sync-check-every syncs), generate, sleep); --ref-update-every K moves the KL reference.
Micro-batches are packed by a token budget (--micro-batch-tokens, models.micro_batches); every
phase of a step is timed (time_*_s in metrics.jsonl) and its peak memory kept (logs.PhaseReport).
Under torchrun each rank runs this same loop on its share of the step's prompts; the few places
where that differs call `run.world` (a world of one makes each call the identity; dist.py says why).

Flags (config.py) are all decided there: one preset table (PRESETS, per --gpu) and one commented
block of derived defaults (the auto choices of LoRA and of the engine's sleep level too), printed
at start; the config saved with every checkpoint is the namespace the code reads. Choices: trainer
parameters are float32 (--dtype bfloat16 is autocast: bf16 weights would swallow 1e-6-sized AdamW
updates), except LoRA's frozen base, which stays in the compute dtype; --offload-optimizer (the a100
preset) keeps AdamW's moments in host memory outside the update; a non-finite loss or grad
norm skips the update (--max-bad-updates in a row stop the run); Ctrl-C finishes the step and
saves; checkpoints are atomic and resume exactly; an --out-dir holding another run is an error;
bad input is one error line and leaves no folder behind; eval is greedy pass@1 on the held-out
rows, before training and every --eval-every steps. A failure in logging, the plot or the viewer
is one warning line and training goes on (logs.Guard). --max-error-steps steps in a row in which
every episode ended in an error (servers down) stop the run after its final checkpoint, with one
line saying how to resume; resuming a run already at --steps says how to extend it instead.
"""
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# torch's OpenMP threads (one per core) wait for work by spinning: libgomp's default, read once
# when torch loads it, so it is set before the import. On a CPU shared with other work a spinning
# thread holds a core the thread with the work needs. One CPU step of the default job, 2 cores,
# 2 threads: 52 s with both cores free, spinning or passive; beside one busy process 122 s
# spinning, 88 s passive (1 thread: 83 s); beside two, 151 s vs 95 s (1 thread: 135 s). A value
# you set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import critic
import dist
import envs
import grpo
import lora
import rows
import viewer
from checkpoint import CtrlC, checkpoint_step, find_checkpoint, load_trainer_state, rng_state, save_checkpoint
from config import PRESETS, SetupError, fits_this_gpu, parse_args, preset_for, require_cuda  # noqa: F401 (PRESETS: train.PRESETS for readers)
from eval import tally  # eval.py scores the same way (it imports nothing of train.py)
from logs import Guard, Logger, Means, PhaseReport, console_line, episode_metrics, log_samples, write_plot
from models import Scorer, batch_logprobs, compile_model, load_policy, micro_batches, packable, unwrap
from rollout import HFEngine, episodes_to_batch, run_episodes, stop_token_ids
from sources import load_tokenizer, model_source

TRAIN_PHASES = ["old_ref_logprobs", "forward", "backward", "optimizer"]  # timed in train_step (logs.PhaseReport)


class RunStopped(RuntimeError):
    """The run stopped itself after its final checkpoint (e.g. servers down for --max-error-steps steps)."""


@dataclass
class Run:
    """What one training run holds: the trainer's side (a test builds one with the first four) and
    the rollout side (engine, tokenizer, MCP pool). world: this rank under torchrun (dist.py)."""
    args: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    ref_model: torch.nn.Module | None = None  # the frozen KL reference (None: no KL, or LoRA's base)
    critic: torch.nn.Module | None = None     # --algo gae (critic.py) and its AdamW
    critic_optimizer: torch.optim.Optimizer | None = None
    scorer: torch.nn.Module | None = None     # the loss's forward: models.Scorer, DDP-wrapped under torchrun
    world: dist.World = field(default_factory=dist.World)
    pad_id: int = 0
    phases: object = None                     # logs.PhaseReport: memory and time per phase
    engine: object = None
    tokenizer: object = None
    pool: object = None                       # the MCP servers (mcp_pool.MCPPool) when rows need them
    stop_ids: list | None = None
    timing: dict = field(default_factory=dict)
    host_state: dict = field(default_factory=dict)  # --offload-optimizer: AdamW's pinned host buffers
    guard: Guard = field(default_factory=Guard)  # logging, plots and the viewer never stop training (logs.Guard)

    def __post_init__(self):
        if self.scorer is None:
            self.scorer = Scorer(self.model)
        if self.phases is None:
            self.phases = lambda name: contextlib.nullcontext()

    def autocast(self):
        """The forward passes' autocast (--dtype bfloat16), or a disabled one."""
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=self.args.dtype == "bfloat16")


# ---- rollouts

def rollouts(run, batch_rows, n, temperature, group_ids=None):
    """n episodes per row from the engine (awake, weights synced) through run_episodes."""
    args = run.args
    # autocast is for the HF engine's forward only: vLLM runs in this process too, and an
    # ambient bf16 autocast would also reach its fp32 sampler/logprob math
    with run.autocast() if args.engine == "hf" else contextlib.nullcontext():
        make_env = lambda row: envs.env_for_row(row, args.env, run.pool, args.max_turns, args.format_reward,  # noqa: E731
                                                args.tool_error_penalty, args.tool_error_cap)
        return run_episodes(run.engine, run.tokenizer, batch_rows, make_env,
                            n=n, temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0,
                            max_tokens=args.max_tokens, max_turns=None, max_context=args.max_context,
                            stop_token_ids=None if args.ignore_eos else run.stop_ids, progress=not args.no_progress,
                            timing=run.timing, logprobs=args.rollout_logprobs and temperature > 0,
                            group_ids=group_ids, ignore_eos=args.ignore_eos)


def collect(run, train_rows, state):
    """(episodes to train on, every episode sampled, generation rounds). Group ids unique per step."""
    args = run.args
    kept, sampled, rounds = [], [], 0
    target = args.prompts_per_step * args.n
    while rounds == 0 or (args.dynamic_sampling and len(kept) < target and rounds <= args.max_resample_rounds):
        # every rank draws the same rows and keeps its share (torchrun; all of them on one GPU);
        # group ids are the single-GPU run's, unique across rounds
        mine = run.world.local_rows(rows.next_rows(train_rows, state["data"], args.prompts_per_step, args.seed))
        ids = [run.world.global_group(j) + rounds * args.prompts_per_step for j in range(len(mine))]
        new = rollouts(run, mine, args.n, args.temperature, group_ids=ids)
        check_rewards(new, dict(zip(ids, mine)), args.env)
        rounds += 1
        if args.overlong_buffer > 0:  # DAPO soft punishment on the episode's sampled length
            lens = torch.tensor([sum(e.response_mask) for e in new])
            pen = grpo.overlong_punishment(lens, args.max_tokens, args.overlong_buffer, args.overlong_factor)
            for e, p in zip(new, pen.tolist()):
                e.info["overlong_penalty"] = p
                e.reward += p
        sampled += new
        if args.dynamic_sampling:
            keep = grpo.dynamic_sampling_keep(torch.tensor([e.reward for e in new]),
                                              torch.tensor([e.group for e in new]))
            new = [e for e, k in zip(new, keep.tolist()) if k]
        kept += new
    too_long = sum(not e.response_ids and e.finish_reason == "length" for e in sampled)
    if too_long == len(sampled):
        raise ValueError(f"every prompt this step is at least --max-context {args.max_context} tokens long "
                         f"(e.g. {len(sampled[0].prompt_ids)}): raise --max-context")
    elif too_long:
        print(f"WARNING: {too_long} episodes had prompts of >= --max-context tokens (no response)", flush=True)
    return kept[:target], sampled, rounds  # whole groups: episodes of a group are contiguous


def check_rewards(episodes, row_of_group, default_env):
    """Rewards must be finite numbers: an env that returns NaN or inf is named with its row."""
    for e in episodes:
        if not math.isfinite(e.reward):
            row = row_of_group[e.group]
            raise ValueError(f"env {envs.env_class_of(row, default_env)!r} returned a non-finite reward ({e.reward}) "
                             f"for row {row['data_source']!r} {row.get('extra_info', {}).get('index', '')}: "
                             "rewards must be finite numbers")


def evaluate(run, eval_rows):
    """Greedy pass@1 and mean reward on the held-out rows (the engine synced first), scored by
    eval.tally: the greedy pass@1 `python eval.py` reports for the same model and rows. Several
    --eval-data sets (rows carrying "eval_set"): also eval_pass1/NAME and eval_reward/NAME per set."""
    t0 = time.perf_counter()
    run.engine.wake()
    run.engine.load_weights(run.model)
    mine = run.world.local_rows(eval_rows)
    eps = rollouts(run, mine, 1, 0.0)  # one greedy episode per row, in row order
    run.engine.sleep()
    names = sorted({row.get("eval_set", "") for row in eval_rows} - {""})  # the same list on every rank
    per_set = [tally([e for e, row in zip(eps, mine) if row.get("eval_set") == name]) for name in names]
    sums = run.world.sum(tally(eps) + [x for t in per_set for x in t])  # over all ranks
    m = {"eval_time_s": time.perf_counter() - t0}
    for k, suffix in enumerate([""] + [f"/{name}" for name in names]):
        passed, reward, count = sums[3 * k:3 * k + 3]
        m[f"eval_pass1{suffix}"], m[f"eval_reward{suffix}"] = passed / max(count, 1), reward / max(count, 1)
    return m


# ---- the step: advantages, old logprobs, the loss, the update

def advantages(args, run, batch, mask):
    """(adv (B, T-1), critic values, GAE returns) by --algo; values and returns are None but for gae."""
    rewards, groups = batch["rewards"], batch["groups"]
    if args.algo in ("grpo", "dapo"):
        return grpo.broadcast_to_tokens(grpo.grpo_advantages(rewards, groups), mask), None, None
    elif args.algo == "drgrpo":
        return grpo.broadcast_to_tokens(grpo.drgrpo_advantages(rewards, groups), mask), None, None
    elif args.algo == "rloo":
        return grpo.broadcast_to_tokens(grpo.rloo_advantages(rewards, groups), mask), None, None
    elif args.algo == "reinforce++":
        return grpo.reinforce_pp_advantages(grpo.last_token_rewards(rewards, mask), mask, args.gamma), None, None
    elif args.algo == "reinforce++-baseline":
        return grpo.reinforce_pp_baseline_advantages(rewards, groups, mask), None, None
    elif args.algo == "gae":  # PPO's learned critic: its values before the update, GAE over the policy tokens
        device = next(run.model.parameters()).device
        with run.autocast(), run.phases("critic"):
            values = critic.batch_values(run.critic, batch, args.micro_batch_size, device, args.micro_batch_tokens)
        adv, returns = grpo.gae_advantages(grpo.last_token_rewards(rewards, mask), values, mask, args.gamma, args.lam)
        return adv, values, returns
    raise ValueError(f"unknown --algo {args.algo!r}")


def old_and_reference_logprobs(args, run, batch, mask, m):
    """(old (B, T-1) or None, ref (B, T-1) or None) before any update. old is None with --old-logprobs
    detach: the training forward's own, set per micro-batch. m gets logprob_mismatch when measured."""
    rollout_lp = batch["logprobs"][:, 1:]
    old = rollout_lp if args.old_logprobs == "rollout" else None
    fwd = dict(micro_batch_size=args.micro_batch_size, temperature=args.temperature, chunk=args.logprob_chunk,
               device=next(run.model.parameters()).device, tokens=args.micro_batch_tokens, even=run.world.even,
               shared_prefix=args.shared_prefix)
    with run.autocast(), run.phases("old_ref_logprobs"):
        if args.old_logprobs == "recompute":
            old = batch_logprobs(run.model, batch, **fwd)
            if args.rollout_logprobs:  # engine vs trainer on the sampled tokens (FlashRL's mismatch)
                m["logprob_mismatch"] = float(grpo.masked_mean((old - rollout_lp).abs(), mask))
        ref = None
        if args.kl_coef > 0:  # the initial policy: a frozen copy, or LoRA's base with the adapters off
            with lora.disabled(run.model) if run.ref_model is None else contextlib.nullcontext():
                ref = batch_logprobs(run.model if run.ref_model is None else run.ref_model, batch, **fwd)
    return old, ref


def importance_weights(args, batch, old, mask, m):
    """(TIS weights (B, T-1) or None, the loss mask). --tis-mode truncate: w = min(ratio, C) per token.
    mask: a token (sequence) whose ratio is outside [--tis-low, C] leaves the loss mask itself, so it
    is out of every denominator, the advantages and their whitening, KL and entropy, as if the env
    had written it (verl's rollout correction replaces its response_mask the same way); the kept
    tokens weigh 1. m gets tis_mean and tis_clip_frac (the share capped or dropped) over the sampled tokens."""
    if args.tis_cap <= 0:
        return None, mask
    tis = grpo.tis_weights(old, batch["logprobs"][:, 1:], mask, level=args.tis_level, mode=args.tis_mode,
                           cap=args.tis_cap, low=args.tis_low)  # (B, T-1)
    m["tis_mean"] = float(grpo.masked_mean(tis, mask))
    m["tis_clip_frac"] = float(grpo.masked_mean((tis >= args.tis_cap if args.tis_mode == "truncate" else tis == 0).float(), mask))
    if args.tis_mode == "mask":
        return None, mask * tis.to(mask.dtype)  # tis is 0 or 1 here
    return tis, mask


def policy_loss(args, logp, old, adv, mask):
    """Per-token policy loss (b, t) and its statistics, by --loss (grpo.py)."""
    if args.loss == "ppo":
        return grpo.ppo_clip_loss(logp, old, adv, mask, args.clip_low, args.clip_high, args.dual_clip)
    elif args.loss == "gspo":
        return grpo.gspo_loss(logp, old, adv, mask, args.clip_low, args.clip_high)
    elif args.loss == "cispo":
        return grpo.cispo_loss(logp, old, adv, mask, args.clip_low, args.clip_high)
    elif args.loss == "clip-cov":  # the covariance's means are over this micro-batch, as verl's
        return grpo.clip_cov_loss(logp, old, adv, mask, args.clip_low, args.clip_high, *args.clip_cov)
    elif args.loss == "kl-cov":  # the same micro-batch means as clip-cov's
        return grpo.kl_cov_loss(logp, old, adv, mask, *args.kl_cov)
    raise ValueError(f"unknown --loss {args.loss!r}")


def reduce_loss(args, per_tok, mask, tokens, seqs):
    """The scalar loss by --reduction, over the whole mini-batch's denominators (exact accumulation)."""
    if args.reduction == "token-mean":
        return grpo.token_mean(per_tok, mask, denom=tokens)
    elif args.reduction == "seq-mean-token-mean":
        return grpo.seq_mean_token_mean(per_tok, mask, num_seqs=seqs)
    elif args.reduction == "seq-mean-token-sum-norm":
        return grpo.seq_mean_token_sum_norm(per_tok, mask, args.max_tokens, num_seqs=seqs)
    raise ValueError(f"unknown --reduction {args.reduction!r}")


def train_step(args, run, eps, state):
    """One RL update on the kept episodes; returns metrics. The --algo, --loss and --reduction
    switches are the helpers above; this is their order."""
    with run.phases("batch"):  # host work: the padded tensors (numpy)
        batch = episodes_to_batch(eps, run.pad_id)
    B = batch["input_ids"].shape[0]
    mask = batch["loss_mask"][:, 1:]  # (B, T-1) aligned with logits[:, :-1] / targets input_ids[:, 1:]
    m = {}
    # Eval mode (no dropout): the trained function must be the one we sampled from. transformers
    # only checkpoints activations in train mode, so --grad-checkpointing switches it on (the
    # Llama/Qwen configs have dropout 0, so the function is the same).
    run.model.train(args.grad_checkpointing)
    old, ref = old_and_reference_logprobs(args, run, batch, mask, m)  # (B, T-1) or None
    tis, mask = importance_weights(args, batch, old, mask, m)  # --tis-mode mask: rejected tokens leave the mask
    adv, values, returns = advantages(args, run, batch, mask)  # (B, T-1)
    adv = grpo.weight_positive(adv, args.positive_weight)  # W-REINFORCE (1: as estimated)
    for e, a in zip(eps, ((adv * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()):  # per sequence, for the viewer
        e.info["advantage"] = a
    if args.overlong_filter:
        mask = grpo.overlong_filter_mask(mask, torch.tensor([e.finish_reason == "length" for e in eps]))
    # A sequence with A = 0 on every token adds exactly 0 to the loss and its gradient (every loss
    # here is proportional to A), so without a KL term its forward/backward is skipped; it still
    # counts in the denominators. On the CPU default most groups are all-wrong: this is most of
    # the step time saved. An update whose sequences are all skipped still steps AdamW (with
    # zero gradients) so the result equals the unskipped computation.
    has_adv = (adv != 0).any(1)  # (B,) a non-zero advantage somewhere (GRPO: the mixed-reward groups)
    live = has_adv if ref is None else torch.ones(B, dtype=torch.bool)  # (B,) the sequences that train
    stats = Means(), Means(), Means()  # per token (loss statistics), per update (loss, grad norm), per live token
    tensors = dict(batch=batch, mask=mask, adv=adv, old=old, ref=ref, tis=tis, live=live, has_adv=has_adv,
                   entropy_coef=entropy_coef(args, state))
    gen = torch.Generator().manual_seed(args.seed * 7919 + state["step"])  # mini-batch shuffling
    for epoch in range(args.ppo_epochs):
        order = torch.randperm(B, generator=gen) if args.ppo_epochs > 1 or args.mini_batch_size < B else torch.arange(B)
        for s in range(0, B, args.mini_batch_size):
            mb = order[s:s + args.mini_batch_size // run.world.size]  # torchrun: each rank's share of the mini-batch
            update(args, run, tensors, mb, epoch, state, stats)
    if args.algo == "gae":  # the critic's own epochs, on every sequence (critic.update_critic)
        m.update(critic.update_critic(run.critic, run.critic_optimizer, batch, values, returns, mask, run.autocast,
                                      run.phases, seed=args.seed, epochs=args.ppo_epochs,
                                      mini_batch_size=args.mini_batch_size, micro_batch_size=args.micro_batch_size,
                                      micro_batch_tokens=args.micro_batch_tokens, value_clip=args.value_clip,
                                      grad_clip=args.grad_clip))
        m["vf_explained_var"] = float(grpo.explained_variance(values, returns, mask))
    run.model.eval()
    run.optimizer.zero_grad(set_to_none=True)  # the grads' memory goes back before the engine wakes
    per_token, per_update, per_live = stats
    m.update(per_update.means(), **per_token.means())
    m.update(per_live.means() if ref is not None else
             {"entropy_live": m["entropy"]} if "entropy" in m else {})  # without KL only live sequences train
    adapt_entropy_coef(args, state, m.get("entropy_live"))
    m["entropy_coef"] = tensors["entropy_coef"]
    m["updates"] = int(per_update.weights.get("loss", 0))
    m["live_frac"] = float(live.float().mean())
    m["adv_abs_mean"] = float(grpo.masked_mean(adv.abs(), mask))
    return m


def entropy_coef(args, state):
    """This step's entropy-bonus coefficient c (the loss gets - c * H_t on the training tokens).
    --entropy-coef alone: a constant. With --entropy-target, adaptive entropy control as in
    Skywork-OR1 (arXiv 2505.22312): c applies only while the last step's entropy of the training
    sequences was under the target, and moves by --entropy-coef-step after every step
    (adapt_entropy_coef). The bonus acts where the policy gradient does: sequences skipped for a
    zero advantage (no KL) get none, so it holds the entropy of the groups still learning."""
    if args.entropy_target <= 0:
        return args.entropy_coef
    return state.get("entropy_coef", args.entropy_coef) if state.get("entropy_under", False) else 0.0


def adapt_entropy_coef(args, state, entropy):
    """--entropy-target: c += step after a step whose entropy was under the target, c -= step (to
    no less than 0) after one over it, and never over --entropy-coef-max (when > 0). In the
    trainer state, so a resumed run goes on exactly.
    Under torchrun each rank adapts c to its own share's entropy (no collective: a rank whose
    sequences were all skipped has none to share)."""
    if args.entropy_target <= 0 or entropy is None:
        return
    under = entropy < args.entropy_target
    c = state.get("entropy_coef", args.entropy_coef) + (args.entropy_coef_step if under else -args.entropy_coef_step)
    if args.entropy_coef_max > 0:
        c = min(c, args.entropy_coef_max)
    state["entropy_coef"], state["entropy_under"] = max(0.0, c), bool(under)


def update(args, run, t, mb, epoch, state, stats):
    """One optimizer update on mini-batch mb (row indices): forward/backward per micro-batch, then AdamW.
    t: the step's tensors (train_step); stats: (per token, per update, per live token) Means."""
    per_token, per_update, per_live = stats
    device = next(run.model.parameters()).device
    lengths, mask = t["batch"]["attention_mask"].sum(1), t["mask"]
    tokens, seqs = run.world.sum([mask[mb].sum(), len(mb)])  # the update's global denominators
    tokens = torch.tensor(max(tokens, 1.0), device=device)
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    todo = micro_batches(lengths, mb[t["live"][mb]], args.micro_batch_size, args.micro_batch_tokens,
                         ids=t["batch"]["input_ids"] if args.shared_prefix else None)  # rows sharing prefixes together
    for idx, real, last in run.world.lockstep(todo, filler=mb[:1]):  # fillers: torchrun only (dist.py)
        T = int(lengths[idx].max())  # trim this micro-batch's padding
        cut = lambda x: x[idx, :T - 1].to(device)  # noqa: E731  (b, T-1) slices of the step's tensors
        mk, a = cut(mask) * real, cut(t["adv"])
        # DDP's forward decides if the backward after it all-reduces: the no-sync context goes here
        need_entropy = epoch == 0 or t["entropy_coef"] > 0 or args.top_entropy_frac < 1  # metric, bonus, forks
        with run.autocast(), run.phases("forward"), dist.grad_sync(run.scorer, run.model, last):
            logp, ent = run.scorer(t["batch"]["input_ids"][idx, :T].to(device),
                                   t["batch"]["attention_mask"][idx, :T].to(device),
                                   args.temperature, args.logprob_chunk, entropy=need_entropy,
                                   shared_prefix=args.shared_prefix)  # (b, T-1)
        st = {} if ent is None or epoch else {"entropy": grpo.masked_mean(ent.detach(), mk)}
        if st and t["ref"] is not None:  # the no-KL runs' entropy: mixed-reward groups only
            mk_live = mk * t["has_adv"][idx, None].to(device)
            per_live.add({"entropy_live": grpo.masked_mean(ent.detach(), mk_live)}, weight=mk_live.sum())
        old = logp.detach() if t["old"] is None else cut(t["old"])  # detach: exactly on-policy, ratio 1
        if t["old"] is None and args.rollout_logprobs:
            st["logprob_mismatch"] = grpo.masked_mean((old - cut(t["batch"]["logprobs"][:, 1:])).abs(), mk)
        per_tok, ls = policy_loss(args, logp, old, a, mk)  # (b, T-1)
        st.update(ls)
        if args.top_entropy_frac < 1:  # the forking tokens only; / frac: the mean is over the tokens kept
            keep = grpo.top_entropy_mask(ent.detach(), mk, args.top_entropy_frac)
            per_tok = per_tok * keep / args.top_entropy_frac
            st["pg_token_frac"] = grpo.masked_mean(keep, mk)
        if t["tis"] is not None:
            per_tok = per_tok * cut(t["tis"])
        if t["ref"] is not None:
            k = grpo.kl(logp, cut(t["ref"]), args.kl_type)
            per_tok = per_tok + args.kl_coef * torch.where(mk > 0, k, torch.zeros_like(k))
            st["kl"] = grpo.masked_mean(k.detach(), mk)
        if t["entropy_coef"] > 0:  # the entropy bonus (entropy_coef); its gradient flows through H_t
            per_tok = per_tok - t["entropy_coef"] * ent
        loss = reduce_loss(args, per_tok, mk, tokens, seqs)
        with run.phases("backward"):
            (loss * run.world.grad_scale).backward()  # DDP/FSDP average over ranks: x W makes it the sum
        if real:
            loss_sum += loss.detach()
            per_token.add(st, weight=mk.sum())
    with run.phases("optimizer"):
        gnorm = optimizer_update(args, run, loss_sum, state)
    if gnorm is not None:
        per_update.add({"loss": loss_sum, "grad_norm": gnorm})


def optimizer_update(args, run, loss_sum, state):
    """Clip and apply the accumulated gradients; returns the grad norm, or None when the update was
    skipped because the loss or the gradient norm is not finite (the weights stay untouched)."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    for p in params:  # all sequences skipped (or parameters unused): zero, not None, gradients
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
    gnorm = dist.full(gnorm)  # FSDP2: a DTensor until gathered
    if not bool(torch.isfinite(gnorm) & torch.isfinite(loss_sum)):  # the one host sync of an update
        run.optimizer.zero_grad(set_to_none=True)
        state["skipped_updates"] += 1
        state["bad_in_a_row"] += 1
        print(f"WARNING: non-finite loss or grad norm at step {state['step']}: update skipped "
              f"({state['bad_in_a_row']} in a row, {state['skipped_updates']} total)", flush=True)
        if state["bad_in_a_row"] >= args.max_bad_updates:
            raise RuntimeError(f"{state['bad_in_a_row']} non-finite updates in a row: stopping "
                               "(lower --lr, check rewards and logprobs)")
        return None
    state["bad_in_a_row"] = 0
    if args.offload_optimizer:  # AdamW's moments come in for the update and go back out after it
        move_optimizer_state(run.optimizer, run.host_state, params[0].device)
    run.optimizer.step()
    if args.offload_optimizer:
        move_optimizer_state(run.optimizer, run.host_state, "cpu")
    run.scheduler.step()
    return float(gnorm)


def move_optimizer_state(optimizer, host, device):
    """--offload-optimizer: AdamW's state tensors (two fp32 moments per parameter, 8 bytes) to
    `device` for the update, or to the CPU after it, into pinned buffers allocated once (host:
    (param index, key) -> buffer) so the copy is one DMA per tensor and the GPU's copies are freed.
    Both directions queue on the current stream, so the update's kernels run after the copies in;
    the way out waits for its copies, since vLLM's wake reuses that memory outside torch's stream
    order. At 1.5B: 12.3 GB each way; ~0.3 s a step on an H100 (docs/results.md), in the optimizer phase."""
    to_host = torch.device(device).type == "cpu"
    for i, st in enumerate(optimizer.state.values()):
        for k, t in st.items():
            if not torch.is_tensor(t) or t.dim() == 0:  # the step count stays where AdamW keeps it
                continue
            if not to_host:
                st[k] = t.to(device, non_blocking=True, copy=True)
                continue
            buf = host.get((i, k))
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = host[i, k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            st[k] = buf.copy_(t, non_blocking=True)
    if to_host and torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- setting up a run

def start(args, world, ckpt):
    """The Run: tokenizer, policy (+ reference, critic), engine, MCP pool, AdamW, scheduler; and the
    loop state (a new one, or the checkpoint's)."""
    phases = PhaseReport()  # before anything is loaded: its baseline is what others use on this GPU
    with world.rank0_first():  # rank 0 builds the embedded model or a shape's folder once
        src = model_source(args.model)
    tokenizer = load_tokenizer(ckpt or src, args.model)
    if world.device.type == "cuda":  # fail now, with what to change, before anything big is on the GPU
        fits_this_gpu(args, args.lora_rank, awake=args.engine == "vllm" and args.sleep_level == 0, fail=True)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model, ref_model, engine_src = load_policy(src, ckpt, world.device, args.lora_rank, args.lora_alpha,
                                               args.lora_targets.split(","), args.lora_dropout, dtype,
                                               reference=args.kl_coef > 0, grad_checkpointing=args.grad_checkpointing)
    if args.compile and world.device.type == "cuda":  # the trainer's forwards only; vLLM compiles its own
        compile_model(model)
    if args.shared_prefix and not packable(model):  # decided once: micro_batches sizes by packed tokens
        print(f"--shared-prefix off: {unwrap(model).config._attn_implementation} attention or sliding-window "
              "layers would not honour the packed row's mask (models.packable)")
        args.shared_prefix = False
    engine = HFEngine(model, tokenizer) if args.engine == "hf" else start_vllm(args, model, tokenizer, engine_src, world, phases)
    # the loss's forward: plain on one GPU; DDP-wrapped, or the model FSDP2-sharded, under torchrun
    scorer, model = dist.wrap(Scorer(model), world, args.shard, dtype)
    if world.rank:  # every rank samples its own episodes (HF engine: torch's RNG)
        torch.manual_seed(args.seed + world.rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay,  # fused: one kernel per step (FSDP2: foreach)
                                  fused=world.device.type == "cuda" and args.shard != "fsdp" or None)
    warm = max(args.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / warm) if warm else 1.0)
    run = Run(args, model, optimizer, scheduler, ref_model=ref_model, scorer=scorer, world=world,
              pad_id=tokenizer.pad_token_id, phases=phases, engine=engine, tokenizer=tokenizer)
    if args.algo == "gae":  # a second model from the policy's weights, or the checkpoint's critic (critic.py)
        run.critic, run.critic_optimizer = critic.start_critic(Path(ckpt) / critic.FOLDER if ckpt else src, world.device,
                                                               args.grad_checkpointing, args.critic_lr, args.weight_decay)
    run.stop_ids = stop_token_ids(tokenizer)  # a turn ends at the template's end-of-turn token
    state = {"step": 0, "data": {"epoch": 0, "pos": 0}, "skipped_updates": 0, "bad_in_a_row": 0, "error_steps": 0}
    if ckpt is not None:  # AdamW, scheduler, RNG and this dict as they were saved
        state = load_trainer_state(ckpt, optimizer, scheduler, vars(args), run.critic_optimizer, world.rank, world.size)
        check_not_complete(state["step"], args)  # a checkpoint folder renamed from step_NNNNNN
        if args.offload_optimizer:  # load_state_dict put AdamW's state on the GPU
            move_optimizer_state(optimizer, run.host_state, "cpu")
    return run, state


def start_vllm(args, model, tokenizer, engine_src, world, phases):
    """The colocated vLLM engine (vllm_engine.py; imported here: only GPU runs need vLLM)."""
    from vllm_engine import start_engine
    held = torch.cuda.memory_allocated()
    engine = start_engine(model, tokenizer, engine_src, args.rollout_quant, seed=args.seed + world.rank,
                          gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=args.sleep_level,
                          max_model_len=args.max_context, check_every=args.sync_check_every,
                          enable_prefix_caching=args.prefix_caching,  # vLLM's defaults: on, None (profiled)
                          kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else None)
    phases.engine_pool = torch.cuda.memory_allocated() - held  # vLLM's pool, in torch's accounting
    return engine


def save(run, state, out_dir):
    """A checkpoint of the policy (LoRA: its adapter), the critic, a moved reference and the
    trainer state. Every rank takes part (FSDP2 gathers full tensors); rank 0 writes."""
    args, world = run.args, run.world
    weights = dist.full_state_dict(run.model, world.main) if args.shard == "fsdp" and world.size > 1 else None
    ts = {"optimizer": dist.optimizer_state(run.optimizer, world.main), "scheduler": run.scheduler.state_dict(),
          "state": state, "rng": rng_state(), "rng_ranks": world.gather([rng_state()]),
          "critic_optimizer": run.critic_optimizer and run.critic_optimizer.state_dict()}

    def write(d):
        lora.save_adapter(run.model, d, args.model) if args.lora_rank else run.model.save_pretrained(d, state_dict=weights)
        if run.critic is not None:
            critic.save_critic(run.critic, Path(d) / critic.FOLDER)
        if args.ref_update_every and state["step"] >= args.ref_update_every:
            run.ref_model.save_pretrained(Path(d) / "reference")
    if world.main:
        print(f"saved {save_checkpoint(out_dir, state['step'], write, run.tokenizer, ts, vars(args), args.keep_checkpoints)}")
    world.barrier()  # no rank runs ahead of a checkpoint being written


# ---- one step of the loop, and its log

def step(run, train_rows, state):
    """Rollout phase (wake, sync, collect, sleep), then the training phase; returns the step's
    metrics (without eval) and every episode sampled (gathered from all ranks)."""
    args, engine, phases, world = run.args, run.engine, run.phases, run.world
    with phases("wake"):
        engine.wake()
    with phases("sync"):  # vLLM: push + prefix-cache reset (+ logprob check, --sync-check-every)
        metrics = {f"sync_{k}".replace("sync_dlogp", "dlogp"): float(v) for k, v in
                   engine.load_weights(run.model).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    run.timing.clear()
    with phases("rollout"):
        eps, sampled, rounds = collect(run, train_rows, state)
    with phases("sleep"):
        engine.sleep()
    if world.size > 1:  # torchrun: the ranks meet here (time_wait_s: waiting for the slowest rollout)
        with phases("wait"):
            world.barrier()
    if eps:  # dynamic sampling may keep nothing: then no update this step
        metrics.update(world.mean_metrics(train_step(args, run, eps, state)))
    state["step"] += 1
    if args.ref_update_every and state["step"] % args.ref_update_every == 0:  # a moving KL anchor
        run.ref_model.load_state_dict(run.model.state_dict())  # fp32 -> the reference's dtype
    sampled = world.gather(sampled)  # every rank's episodes, for the log (rank 0)
    metrics.update(phases.step_times(), **episode_metrics(sampled, int(world.sum([len(eps)])[0]), rounds),
                   lr=run.scheduler.get_last_lr()[0], skipped_updates=state["skipped_updates"])
    metrics["episodes_per_s"] = len(sampled) / metrics["time_rollout_s"]
    metrics["env_time_frac"] = run.timing.get("env_s", 0.0) / metrics["time_rollout_s"]
    metrics["rollout_generate_s"] = run.timing.get("generate_s", 0.0)  # of time_rollout_s: in engine.generate
    metrics["time_train_s"] = sum(metrics.get(f"time_{k}_s", 0.0) for k in TRAIN_PHASES)
    metrics.update(phases.metrics())
    return metrics, sampled


def log_step(run, logger, page, n, metrics, sampled, out_dir):
    """Rank 0's record of step n: metrics.jsonl, samples, the viewer page, the console line, the plot.
    A failure in any of them is one warning line (the first time) and training goes on (logs.Guard)."""
    args, guard = run.args, run.guard
    with guard("logging (metrics.jsonl, TensorBoard, W&B)"):
        logger.log(n, metrics)
    with guard("samples.jsonl"):
        log_samples(out_dir / "samples.jsonl", n, sampled, run.tokenizer, args.log_samples)
    if page is not None:  # OUT/episodes.html: this step's first groups, as a person reads them
        with guard("the viewer (episodes.html)"):  # advantage None: not trained on (dynamic sampling dropped it)
            page.add(viewer.episode_records(n, sampled, run.tokenizer, [e.info.get("advantage") for e in sampled],
                                            args.viewer_groups))
            page.write()  # at most every 30 s (and at the end); episodes.jsonl gets every step
    with guard("the console line"):
        print(console_line(n, metrics), flush=True)
    if not args.no_plot and "eval_pass1" in metrics:
        with guard("the plot (curves.png)"):
            write_plot(out_dir)


def open_outputs(args, out_dir, guard):
    """Rank 0's run folder (made only now: bad data, flags or models leave no folder behind), its
    config.json, the Logger and the viewer's Page (None: --viewer-groups 0, or a page that failed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(vars(args), indent=1, sort_keys=True))
    logger, page = Logger(out_dir, vars(args), args.tensorboard, args.wandb), None
    if args.viewer_groups:
        with guard("the viewer (episodes.html)"):
            page = viewer.Page(out_dir / "episodes.jsonl", out_dir / "episodes.html")
    return logger, page


def errors_in_a_row(args, state, sampled, out_dir):
    """Why the run must stop, or None: every episode of --max-error-steps steps in a row ended in an
    error (servers or an env that stay down; reward-0 errors teach nothing). The count is loop state,
    saved with checkpoints: a run resumed while they are still down stops after one more such step."""
    all_errors = all(e.finish_reason == "error" for e in sampled)
    state["error_steps"] = state.get("error_steps", 0) + 1 if all_errors else 0
    if not args.max_error_steps or state["error_steps"] < args.max_error_steps:
        return None
    saved = (f"its checkpoint is saved; once they work again, continue with --resume {out_dir}"
             if args.save_every >= 0 else "no checkpoint (--save-every -1)")
    return (f"every episode of the last {state['error_steps']} steps ended in an error "
            f"(the first: {sampled[0].info.get('error')}): stopped at step {state['step']}; {saved}")


def check_not_complete(step, args):
    """--resume of a run already at --steps: an error that says so and how to go on, not a silent no-op."""
    if step is not None and step >= args.steps:
        raise ValueError(f"--resume {args.resume}: the run is complete at step {step} (--steps {args.steps}): "
                         f"pass a larger --steps to train further, e.g. --steps {step + args.steps}")


# ---- main: set up, then the loop

def main(argv=None):
    args = parse_args(argv, fits=fits_this_gpu)  # every flag decided (config.py), the auto choices too
    out_dir = Path(args.out_dir)
    ckpt = find_checkpoint(args.resume) if args.resume else None
    if ckpt is not None:  # a finished run says so before any model loads (step_NNNNNN's number)
        check_not_complete(checkpoint_step(ckpt), args)
    if not (ckpt is not None and out_dir.resolve() in ckpt.resolve().parents) and \
            ((out_dir / "metrics.jsonl").exists() or (out_dir / "ckpt").exists()):
        raise FileExistsError(f"--out-dir {out_dir} already holds a run: continue it with --resume {out_dir}, "
                              "or pick a new --out-dir (a second run never mixes with the first)")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    require_cuda(args.gpu)  # also checked by the memory estimate, when parse_args needed it
    world = dist.World("cuda" if args.gpu != "cpu" else "cpu")  # torchrun: this process's rank and GPU
    if not world.main:  # rank 0 speaks for all: the others' stdout goes nowhere (errors still reach stderr)
        sys.stdout = open(os.devnull, "w")
    # bad data fails before any model loads
    train_rows, eval_rows = envs.load_splits(args.env, args.train_data, args.eval_data, digits=args.digits,
                                             fewshot=args.fewshot, seed=args.seed, eval_limit=args.eval_limit,
                                             eval_every=args.eval_every, mcp_config=args.mcp_config)
    print("preset", args.gpu, args.env, json.dumps(preset_for(args.gpu, args.env)))
    if args.gpu == "cpu":  # what a CPU step's time depends on (the comment at OMP_WAIT_POLICY above)
        print(f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS), OMP_WAIT_POLICY {os.environ['OMP_WAIT_POLICY']}")
    print("config", json.dumps(vars(args), sort_keys=True))
    if world.size > 1:
        print(f"torchrun: {world.size} ranks, --shard {args.shard}, {args.prompts_per_step // world.size} prompts per rank")
    run, state = start(args, world, ckpt)
    logger, page, stopped = None, None, None
    summary, last_saved = {"history": []}, state["step"] if ckpt is not None else None
    try:
        run.pool = envs.open_mcp_pool([train_rows, eval_rows], args.env, args.mcp_config, args.tool_timeout, run.tokenizer)
        if world.main:
            logger, page = open_outputs(args, out_dir, run.guard)
        with CtrlC() as ctrl_c:
            if args.eval_every and ckpt is None:  # before training
                ev = evaluate(run, eval_rows)
                if world.main:
                    with run.guard("logging (metrics.jsonl, TensorBoard, W&B)"):
                        logger.log(0, ev)
                print(console_line(0, ev), flush=True)
            t_next = time.perf_counter()  # a step's time runs from the last one's end (its logging is in it)
            while state["step"] < args.steps and not world.max(int(ctrl_c.stop)):  # a Ctrl-C on any rank stops all
                t_step = t_next
                metrics, sampled = step(run, train_rows, state)
                metrics["step_time_s"] = time.perf_counter() - t_step
                metrics["time_host_s"] = metrics["step_time_s"] - sum(
                    v for k, v in metrics.items() if k.startswith("time_") and k != "time_train_s")
                t_next = time.perf_counter()  # evals and checkpoints below are timed on their own, not in a step
                if args.eval_every and (state["step"] % args.eval_every == 0 or state["step"] == args.steps):
                    metrics.update(evaluate(run, eval_rows))
                    t_next += metrics["eval_time_s"]
                with run.phases("log"):  # host work, timed into the next step (whose time includes it)
                    if world.main:
                        log_step(run, logger, page, state["step"], metrics, sampled, out_dir)
                        summary["history"].append({"step": state["step"], **metrics})
                if args.save_every > 0 and state["step"] % args.save_every == 0:
                    t_save = time.perf_counter()
                    save(run, state, out_dir)
                    last_saved, t_next = state["step"], t_next + time.perf_counter() - t_save
                stopped = errors_in_a_row(args, state, sampled, out_dir)  # servers down: stop, with a checkpoint
                if stopped:
                    break
            finish(run, state, out_dir, page, last_saved)
    finally:
        for closing in (logger, run.pool, run.engine):
            if hasattr(closing, "close"):
                closing.close()
        world.close()
    if stopped:
        raise RunStopped(stopped)
    if run.phases.on:
        print(run.phases.table())
    summary.update(step=state["step"], memory=run.phases.metrics(),
                   checkpoint=str(find_checkpoint(out_dir)) if world.main and args.save_every >= 0 else None)
    return summary


def finish(run, state, out_dir, page, last_saved):
    """After the loop (or Ctrl-C): the viewer's last page, the final checkpoint, the plot, LoRA's merged model."""
    args = run.args
    if page is not None:
        with run.guard("the viewer (episodes.html)"):
            page.write(force=True)  # the steps the 30 s throttle held back
    if last_saved != state["step"] and args.save_every >= 0:
        save(run, state, out_dir)  # the final (or Ctrl-C, or servers-down) checkpoint
    if run.world.main and not args.no_plot and (out_dir / "metrics.jsonl").exists():
        with run.guard("the plot (curves.png)"):
            write_plot(out_dir)
    if run.world.main and args.save_merged and args.lora_rank:  # W + (alpha/r) B A as a plain HF folder
        unwrap(run.model).save_pretrained(out_dir / "merged", state_dict=lora.merged_state_dict(run.model))
        run.tokenizer.save_pretrained(out_dir / "merged")


def one_line_errors():
    """What a user fixes by changing flags, data, servers or the machine: `python train.py` prints it as
    one line, not a traceback. mcp_pool (imported only by runs with MCP rows) adds a server that did not start."""
    mcp_pool = sys.modules.get("mcp_pool")
    return (FileNotFoundError, FileExistsError, ValueError, SetupError, RunStopped) + \
        ((mcp_pool.ServerStartFailed,) if mcp_pool is not None else ())


def cli(argv=None):
    """`python train.py`: main, with one_line_errors() as `error: ...` and exit status 1."""
    try:
        return main(argv)
    except one_line_errors() as e:  # evaluated when an exception arrives: mcp_pool may be imported by then
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    cli()
