"""
nanoRL's training script: RL on a chat model, top to bottom: flags -> data -> the step -> the loop.

    python train.py                                   # embedded SmolLM2-135M-Instruct, CPU, 1-digit multiply
    python train.py --gpu h100 --env gsm8k            # Qwen2.5-1.5B-Instruct, vLLM rollouts
    python train.py --env mcp --gpu l40s [--mcp-config FILE]   # multi-turn tool use against MCP servers
    python train.py --gpu l40s --model Qwen/Qwen2.5-7B-Instruct --lora-rank 32   # LoRA (lora.py)
    python train.py --gpu h100 --rollout-quant fp8    # FlashRL: fp8/int8 rollouts + TIS (quant.py)
    python sft.py --device cuda --out-dir runs/sft    # warm start a model that never calls tools
    python train.py --resume runs/nanorl              # continue exactly where a run stopped
    torchrun --nproc-per-node 2 -- train.py --gpu h100   # one rank per GPU, DDP or --shard fsdp (dist.py)
    python -m pytest -q tests/test_train.py           # CPU tests with a tiny random model

One step (every variant is a visible if/elif; the formulas and our choices are in grpo.py):
  1. collect: P prompts x n rollouts (HFEngine sharing this model on the CPU, vLLM on a GPU);
     DAPO: + overlong punishment, then dynamic sampling (drop all-equal-reward groups, draw more)
  2. train_step: advantages (--algo; gae: GAE on a critic's values, then the critic's own update,
     critic.py); old logprobs: the engine's (--old-logprobs rollout), a
     no-grad forward (recompute), or, exactly on-policy, the training forward's own (detach);
     reference logprobs if --kl-coef > 0; TIS weights w if --tis-cap. Then --ppo-epochs passes of
     mini-batches (one AdamW step each) of micro-batches, per policy token
         l_t = loss(ppo | gspo | cispo)(logp, old, A) * w + kl_coef * k(logp, ref)
     reduced (--reduction) with the mini-batch's global denominators, so accumulation is exact.
  3. the next step pushes the weights to the engine (vLLM: wake, sync (+ check every
     --sync-check-every syncs), generate, sleep); --ref-update-every K moves the KL reference.
Micro-batches are packed by a token budget (--micro-batch-tokens, models.micro_batches); every
phase of a step is timed (time_*_s in metrics.jsonl) and its peak memory kept (logs.PhaseReport).
Under torchrun each rank runs this same loop on its share of the step's prompts; the few places
where that differs call `dist` (a world of one makes each call the identity; dist.py says why).

Flags (config.py): one preset table (PRESETS, per --gpu) and one commented block of derived
defaults, both printed at start; the config saved with every checkpoint is the namespace the code
reads. Choices: trainer parameters are float32 (--dtype bfloat16 is autocast: bf16 weights
would swallow 1e-6-sized AdamW updates), except LoRA's frozen base, which stays in the compute
dtype; a non-finite loss or grad norm skips the update (--max-bad-updates in a row stop the run);
Ctrl-C finishes the step and saves; checkpoints are atomic and resume exactly; an --out-dir
holding another run is an error; bad input is one error line and leaves no folder behind; eval is
greedy pass@1 on the held-out rows, before training and every --eval-every steps.
"""
import contextlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

import critic
import dist as distributed
import envs
import grpo
import lora
import rows as rowio
import viewer
from checkpoint import CtrlC, find_checkpoint, load_trainer_state, rng_state, save_checkpoint
from logs import Logger, Means, PhaseReport, console_line, episode_metrics, log_samples, write_plot
from config import PRESETS, parse_args, preset_for  # noqa: F401 (PRESETS: train.PRESETS for readers and tests)
from models import (Scorer, batch_logprobs, compute_dtype, fits_gpu, load_policy, load_tokenizer, micro_batches,
                    model_source, unwrap)
from rollout import HFEngine, end_of_turn_id, episodes_to_batch, run_episodes

TRAIN_PHASES = ["old_ref_logprobs", "forward", "backward", "optimizer"]  # timed in train_step (logs.PhaseReport)


# ---- data

def load_data(args):
    """(train_rows, eval_rows): the files given, else generated rows (multiply, mcp) or data/out/gsm8k."""
    return envs.load_rows(args.env, args.train_data, args.eval_data, digits=args.digits, fewshot=args.fewshot,
                          seed=args.seed, eval_rows=args.eval_rows, eval_every=args.eval_every)


# ---- rollouts

def rollouts(run, rows, n, temperature, timing=None):
    """n episodes per row from the engine (awake, weights synced) through run_episodes."""
    args, autocast = run["args"], run["autocast"]
    # autocast is for the HF engine's forward only: vLLM runs in this process too, and an
    # ambient bf16 autocast would also reach its fp32 sampler/logprob math
    with autocast() if args.engine == "hf" else contextlib.nullcontext():
        make_env = lambda row: envs.env_for_row(row, args.env, run["pool"], args.max_turns, args.format_reward)  # noqa: E731
        return run_episodes(run["engine"], run["tokenizer"], rows, make_env,
                            n=n, temperature=temperature, top_p=args.top_p if temperature > 0 else 1.0,
                            max_tokens=args.max_tokens, max_turns=None, max_context=args.max_context,
                            stop_token_ids=run["stop_ids"], progress=not args.no_progress, timing=timing,
                            logprobs=args.rollout_logprobs and temperature > 0)


def collect(run, train_rows, state):
    """(episodes to train on, every episode sampled, generation rounds). Group ids unique per step."""
    args = run["args"]
    kept, sampled, rounds = [], [], 0
    target = args.prompts_per_step * args.n
    while rounds == 0 or (args.dynamic_sampling and len(kept) < target and rounds <= args.max_resample_rounds):
        # every rank draws the same rows and keeps its share (torchrun; all of them on one GPU)
        rows = run["dist"].shard(rowio.next_rows(train_rows, state["data"], args.prompts_per_step, args.seed))
        new = rollouts(run, rows, args.n, args.temperature, run["timing"])
        for e in new:  # group = the row's index in rows, until the offset below
            if not math.isfinite(e.reward):
                row = rows[e.group]
                raise ValueError(f"env {envs.env_class_of(row, args.env)!r} returned a non-finite reward ({e.reward}) "
                                 f"for row {row['data_source']!r} {row.get('extra_info', {}).get('index', '')}: "
                                 "rewards must be finite numbers")
        for e in new:  # row index within its round -> the single-GPU run's, unique across rounds
            e.group = run["dist"].global_group(e.group) + rounds * args.prompts_per_step
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


def evaluate(run, eval_rows):
    """Greedy pass@1 and mean reward on the held-out rows (the engine synced first)."""
    t0 = time.perf_counter()
    run["engine"].wake()
    run["engine"].load_weights(run["model"])
    eps = rollouts(run, run["dist"].shard(eval_rows), 1, 0.0)
    run["engine"].sleep()
    correct, reward, count = run["dist"].sum([sum(bool(e.info.get("correct")) for e in eps),
                                              sum(e.reward for e in eps), len(eps)])  # over all ranks
    return {"eval_pass1": correct / max(count, 1), "eval_reward": reward / max(count, 1),
            "eval_time_s": time.perf_counter() - t0}


# ---- the step: advantages, old logprobs, the loss, the update

def train_step(args, model, ref_model, optimizer, scheduler, eps, pad_id, state, phases=None, critic_pair=None,
               scorer=None, dist=None):
    """One RL update on the kept episodes; returns metrics. The --algo, --loss and --reduction
    switches are all here. phases: a logs.PhaseReport (memory and time per phase); critic_pair:
    (critic model, its AdamW) for --algo gae (critic.py); scorer: the loss's forward (models.Scorer,
    DDP-wrapped under torchrun); dist: this rank's dist.Dist (this rank's episodes, global denominators)."""
    phases = phases or (lambda name: contextlib.nullcontext())
    dist = dist or distributed.Dist()
    scorer = scorer or Scorer(model)
    device = next(model.parameters()).device
    autocast = autocast_for(args, device.type)
    with phases("batch"):  # host work: the padded tensors (numpy)
        batch = episodes_to_batch(eps, pad_id)
    B, lengths = batch["input_ids"].shape[0], batch["attention_mask"].sum(1)
    mask = batch["loss_mask"][:, 1:]  # (B, T-1) aligned with logits[:, :-1] / targets input_ids[:, 1:]
    rollout_lp = batch["logprobs"][:, 1:]  # (B, T-1)
    rewards, groups = batch["rewards"], batch["groups"]
    m = {}

    # -- advantages (B, T-1)
    if args.algo in ("grpo", "dapo"):
        adv = grpo.broadcast_to_tokens(grpo.grpo_advantages(rewards, groups), mask)
    elif args.algo == "drgrpo":
        adv = grpo.broadcast_to_tokens(grpo.drgrpo_advantages(rewards, groups), mask)
    elif args.algo == "rloo":
        adv = grpo.broadcast_to_tokens(grpo.rloo_advantages(rewards, groups), mask)
    elif args.algo == "reinforce++":
        adv = grpo.reinforce_pp_advantages(grpo.last_token_rewards(rewards, mask), mask, args.gamma)
    elif args.algo == "reinforce++-baseline":
        adv = grpo.reinforce_pp_baseline_advantages(rewards, groups, mask)
    elif args.algo == "gae":  # PPO's learned critic: its values before the update, GAE over the policy tokens
        with autocast(), phases("critic"):
            values = critic.batch_values(critic_pair[0], batch, args.micro_batch_size, device, args.micro_batch_tokens)
        adv, returns = grpo.gae_advantages(grpo.last_token_rewards(rewards, mask), values, mask, args.gamma, args.lam)
    else:
        raise ValueError(f"unknown --algo {args.algo!r}")
    for e, a in zip(eps, ((adv * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()):  # per sequence, for the viewer
        e.info["advantage"] = a
    if args.overlong_filter:
        mask = grpo.overlong_filter_mask(mask, torch.tensor([e.finish_reason == "length" for e in eps]))

    # -- old, reference and importance weights (B, T-1), before any update
    # Eval mode (no dropout): the trained function must be the one we sampled from. transformers
    # only checkpoints activations in train mode, so --grad-checkpointing switches it on (the
    # Llama/Qwen configs have dropout 0, so the function is the same).
    model.train(args.grad_checkpointing)
    old_lp = rollout_lp if args.old_logprobs == "rollout" else None  # detach: set per micro-batch below
    fwd = dict(micro_batch_size=args.micro_batch_size, temperature=args.temperature, chunk=args.logprob_chunk,
               device=device, tokens=args.micro_batch_tokens, even=dist.even)
    with autocast(), phases("old_ref_logprobs"):
        if args.old_logprobs == "recompute":
            old_lp = batch_logprobs(model, batch, **fwd)
            if args.rollout_logprobs:  # engine vs trainer on the sampled tokens (FlashRL's mismatch)
                m["logprob_mismatch"] = float(grpo.masked_mean((old_lp - rollout_lp).abs(), mask))
        ref_lp = None
        if args.kl_coef > 0:  # the initial policy: a frozen copy, or LoRA's base with the adapters off
            with lora.disabled(model) if ref_model is None else contextlib.nullcontext():
                ref_lp = batch_logprobs(model if ref_model is None else ref_model, batch, **fwd)
    tis = None
    if args.tis_cap > 0:
        tis = grpo.tis_weights(old_lp, rollout_lp, mask, level=args.tis_level, mode=args.tis_mode,
                               cap=args.tis_cap, low=args.tis_low)
        m["tis_mean"] = float(grpo.masked_mean(tis, mask))  # and the share of tokens capped or masked out:
        m["tis_clip_frac"] = float(grpo.masked_mean((tis >= args.tis_cap if args.tis_mode == "truncate" else tis == 0).float(), mask))

    # A sequence with A = 0 on every token adds exactly 0 to the loss and its gradient (every loss
    # here is proportional to A), so without a KL term its forward/backward is skipped; it still
    # counts in the denominators. On the CPU default most groups are all-wrong: this is most of
    # the step time saved. An update whose sequences are all skipped still steps AdamW (with
    # zero gradients) so the result equals the unskipped computation.
    has_adv = (adv != 0).any(1)  # (B,) a non-zero advantage somewhere (GRPO: the mixed-reward groups)
    live = has_adv if ref_lp is None else torch.ones(B, dtype=torch.bool)  # (B,) the sequences that train
    per_token, per_update = Means(), Means()  # loss statistics (token-weighted), loss and grad norm
    per_live = Means()  # with a KL term, the entropy over the live sequences alone (like-for-like with no KL)
    gen = torch.Generator().manual_seed(args.seed * 7919 + state["step"])  # mini-batch shuffling
    for epoch in range(args.ppo_epochs):
        order = torch.randperm(B, generator=gen) if args.ppo_epochs > 1 or args.mini_batch_size < B else torch.arange(B)
        for s in range(0, B, args.mini_batch_size):
            mb = order[s:s + args.mini_batch_size // dist.world]  # torchrun: each rank's share of the mini-batch
            # the global denominators of this update (summed over ranks under torchrun)
            tokens, seqs = dist.sum([mask[mb].sum(), len(mb)])
            tokens = torch.tensor(max(tokens, 1.0))
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=device)
            todo = micro_batches(lengths, mb[live[mb]], args.micro_batch_size, args.micro_batch_tokens)
            for idx, real, last in dist.lockstep(todo, filler=mb[:1]):  # fillers: torchrun only (dist.py)
                t = int(lengths[idx].max())  # trim this micro-batch's padding
                ids = batch["input_ids"][idx, :t].to(device)
                mk, a = mask[idx, :t - 1].to(device) * real, adv[idx, :t - 1].to(device)
                # DDP's forward decides if the backward after it all-reduces: the no-sync context goes here
                with autocast(), phases("forward"), distributed.grad_sync(scorer, model, last):
                    logp, ent = scorer(ids, batch["attention_mask"][idx, :t].to(device),
                                       args.temperature, args.logprob_chunk, entropy=epoch == 0)  # (b, t-1)
                st = {} if ent is None else {"entropy": grpo.masked_mean(ent, mk)}
                if ent is not None and ref_lp is not None:  # the no-KL runs' entropy: mixed-reward groups only
                    mk_live = mk * has_adv[idx, None].to(device)
                    per_live.add({"entropy_live": grpo.masked_mean(ent, mk_live)}, weight=mk_live.sum())
                if old_lp is None:  # --old-logprobs detach: exactly on-policy, the ratio is 1 on every token
                    old = logp.detach()
                    if args.rollout_logprobs:
                        st["logprob_mismatch"] = grpo.masked_mean((old - rollout_lp[idx, :t - 1].to(device)).abs(), mk)
                else:
                    old = old_lp[idx, :t - 1].to(device)
                # -- the per-token policy loss (b, t-1)
                if args.loss == "ppo":
                    per_tok, ls = grpo.ppo_clip_loss(logp, old, a, mk, args.clip_low, args.clip_high, args.dual_clip)
                elif args.loss == "gspo":
                    per_tok, ls = grpo.gspo_loss(logp, old, a, mk, args.clip_low, args.clip_high)
                elif args.loss == "cispo":
                    per_tok, ls = grpo.cispo_loss(logp, old, a, mk, args.clip_low, args.clip_high)
                else:
                    raise ValueError(f"unknown --loss {args.loss!r}")
                st.update(ls)
                if tis is not None:
                    per_tok = per_tok * tis[idx, :t - 1].to(device)
                if ref_lp is not None:
                    k = grpo.kl(logp, ref_lp[idx, :t - 1].to(device), args.kl_type)
                    per_tok = per_tok + args.kl_coef * torch.where(mk > 0, k, torch.zeros_like(k))
                    st["kl"] = grpo.masked_mean(k.detach(), mk)
                # -- the reduction, over the whole mini-batch's denominators (exact accumulation)
                if args.reduction == "token-mean":
                    loss = grpo.token_mean(per_tok, mk, denom=tokens.to(device))
                elif args.reduction == "seq-mean-token-mean":
                    loss = grpo.seq_mean_token_mean(per_tok, mk, num_seqs=seqs)
                elif args.reduction == "seq-mean-token-sum-norm":
                    loss = grpo.seq_mean_token_sum_norm(per_tok, mk, args.max_tokens, num_seqs=seqs)
                else:
                    raise ValueError(f"unknown --reduction {args.reduction!r}")
                with phases("backward"):
                    (loss * dist.grad_scale).backward()  # DDP/FSDP average over ranks: x W makes it the sum
                if real:
                    loss_sum += loss.detach()
                    per_token.add(st, weight=mk.sum())
            with phases("optimizer"):
                gnorm = optimizer_update(args, model, optimizer, scheduler, loss_sum, state)
            if gnorm is not None:
                per_update.add({"loss": loss_sum, "grad_norm": gnorm})
    if args.algo == "gae":  # the critic's own epochs, on every sequence (critic.update_critic)
        m.update(critic.update_critic(*critic_pair, batch, values, returns, mask, args, autocast, device, phases))
        m["vf_explained_var"] = float(grpo.explained_variance(values, returns, mask))
    model.eval()
    optimizer.zero_grad(set_to_none=True)  # the grads' memory goes back before the engine wakes
    m.update(per_update.means())
    m.update(per_token.means())
    m.update(per_live.means() if ref_lp is not None else
             {"entropy_live": m["entropy"]} if "entropy" in m else {})  # without KL only live sequences train
    m["updates"] = int(per_update.weights.get("loss", 0))
    m["live_frac"] = float(live.float().mean())
    m["adv_abs_mean"] = float(grpo.masked_mean(adv.abs(), mask))
    return m


def optimizer_update(args, model, optimizer, scheduler, loss_sum, state):
    """Clip and apply the accumulated gradients; returns the grad norm, or None when the update was
    skipped because the loss or the gradient norm is not finite (the weights stay untouched)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # all sequences skipped (or parameters unused): zero, not None, gradients
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
    gnorm = distributed.full(gnorm)  # FSDP2: a DTensor until gathered
    if not bool(torch.isfinite(gnorm) & torch.isfinite(loss_sum)):  # the one host sync of an update
        optimizer.zero_grad(set_to_none=True)
        state["skipped_updates"] += 1
        state["bad_in_a_row"] += 1
        print(f"WARNING: non-finite loss or grad norm at step {state['step']}: update skipped "
              f"({state['bad_in_a_row']} in a row, {state['skipped_updates']} total)", flush=True)
        if state["bad_in_a_row"] >= args.max_bad_updates:
            raise RuntimeError(f"{state['bad_in_a_row']} non-finite updates in a row: stopping "
                               "(lower --lr, check rewards and logprobs)")
        return None
    state["bad_in_a_row"] = 0
    optimizer.step()
    scheduler.step()
    return float(gnorm)


def autocast_for(args, device_type):
    """The forward passes' autocast context factory (--dtype bfloat16), or a disabled one."""
    dtype = compute_dtype(args)
    return lambda: torch.autocast(device_type=device_type, dtype=dtype, enabled=dtype != torch.float32)


# ---- main: set up, then the loop

def main(argv=None):
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    ckpt = find_checkpoint(args.resume) if args.resume else None
    continuing = ckpt is not None and out_dir.resolve() in ckpt.resolve().parents
    if not continuing and ((out_dir / "metrics.jsonl").exists() or (out_dir / "ckpt").exists()):
        raise FileExistsError(f"--out-dir {out_dir} already holds a run: continue it with --resume {out_dir}, "
                              "or pick a new --out-dir (a second run never mixes with the first)")

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = "cuda" if args.gpu != "cpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--gpu {args.gpu} but CUDA is not available (use --gpu cpu)")
    dist = distributed.Dist(device)  # torchrun: this process's rank and GPU (dist.py); else rank 0 of 1
    device = dist.device
    if not dist.main:  # rank 0 speaks for all: the others' stdout goes nowhere (errors still reach stderr)
        sys.stdout = open(os.devnull, "w")
    phases = PhaseReport()  # before anything is loaded: its baseline is what others use on this GPU

    train_rows, eval_rows = load_data(args)  # bad data fails before any model loads
    with dist.rank0_first():  # rank 0 builds the embedded model or a shape's folder once
        model_src = model_source(args.model)
    tokenizer = load_tokenizer(ckpt or model_src, args.model)
    shard = dist.world if args.shard == "fsdp" else 1  # FSDP2 splits weights, gradients and AdamW over ranks
    if device.type == "cuda":  # fail now, with what to change, before anything big is on the GPU
        if args.lora_rank is None:  # the default: full-parameter where it fits, else LoRA rank 32 (and 10x the LR)
            rank = 0 if fits_gpu(args, model_src, 0, fail=False, shard=shard) else 32
            print(f"--lora-rank {rank}: " + ("full-parameter training fits" if not rank else
                  "full-parameter training does not fit this GPU, LoRA does (--lora-rank 0 to insist)"))
            args = parse_args(list(sys.argv[1:] if argv is None else argv) + ["--lora-rank", str(rank)])
        if args.engine == "vllm" and args.sleep_level is None:  # auto: sleep only when training needs its memory
            # (level 0 saves a wake and a sleep, ~75 ms a step, less ~5 ms of prefix-cache reset in the sync:
            # 3.8% vs 6.3% of the GSM8K step outside rollout and training, session 10). 20% headroom on
            # the estimate: an OOM mid-run costs far more than a sleep and a wake a step
            awake = fits_gpu(args, model_src, args.lora_rank, fail=False, shard=shard, awake=True, headroom=1.2)
            args.sleep_level = 0 if awake else 2
            print(f"--sleep-level {args.sleep_level}: " + ("training fits beside the awake engine" if not args.sleep_level
                  else "the engine sleeps while training (its memory is needed)"))
        fits_gpu(args, model_src, args.lora_rank, fail=True, shard=shard)
    args.no_progress = args.no_progress or not dist.main  # one set of progress bars
    config = vars(args).copy()
    print("preset", args.gpu, args.env, json.dumps(preset_for(args.gpu, args.env)))
    print("config", json.dumps(config, sort_keys=True))
    if dist.world > 1:
        print(f"torchrun: {dist.world} ranks, --shard {args.shard}, {args.prompts_per_step // dist.world} prompts per rank")
    model, ref_model, engine_src = load_policy(args, model_src, ckpt, device)  # models.py

    pool = envs.open_mcp_pool([train_rows, eval_rows], args.env, args.mcp_config, args.tool_timeout, tokenizer)

    if args.engine == "hf":
        engine = HFEngine(model, tokenizer)  # shares the trainer's model: load_weights is free
    else:
        from vllm_engine import start_engine  # lazy: vLLM is only imported on GPU runs
        held = torch.cuda.memory_allocated()
        engine = start_engine(model, tokenizer, engine_src, args.rollout_quant, seed=args.seed + dist.rank,
                              gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=args.sleep_level,
                              max_model_len=args.max_context, check_every=args.sync_check_every,
                              enable_prefix_caching=args.prefix_caching,  # vLLM's defaults: on, None (profiled)
                              kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else None)
        phases.engine_pool = torch.cuda.memory_allocated() - held  # vLLM's pool, in torch's accounting

    # the loss's forward: plain on one GPU; DDP-wrapped, or the model FSDP2-sharded, under torchrun
    scorer, model = distributed.wrap(Scorer(model), dist, args.shard, compute_dtype(args))
    if dist.rank:  # every rank samples its own episodes (HF engine: torch's RNG)
        torch.manual_seed(args.seed + dist.rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay,  # fused: one kernel per step (FSDP2: foreach)
                                  fused=device.type == "cuda" and args.shard != "fsdp" or None)
    critic_pair = None
    if args.algo == "gae":  # a second model from the policy's weights, or the checkpoint's critic (critic.py)
        critic_model = critic.load_critic(Path(ckpt) / critic.FOLDER if ckpt else model_src).to(device)
        critic_model.train(args.grad_checkpointing)
        if args.grad_checkpointing:
            critic_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        critic_pair = (critic_model, torch.optim.AdamW(critic_model.parameters(), lr=args.critic_lr,
                                                       weight_decay=args.weight_decay, fused=device.type == "cuda"))
    warm = max(args.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / warm) if warm else 1.0)
    state = {"step": 0, "data": {"epoch": 0, "pos": 0}, "skipped_updates": 0, "bad_in_a_row": 0}
    if ckpt is not None:  # AdamW, scheduler, RNG and this dict as they were saved
        state = load_trainer_state(ckpt, optimizer, scheduler, config, critic_pair and critic_pair[1], dist.rank, dist.world)
    if dist.main:
        out_dir.mkdir(parents=True, exist_ok=True)  # only now: bad data, flags or models leave no folder behind
        (out_dir / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    logger = Logger(args, config) if dist.main else None
    # a turn also ends at the chat template's end-of-turn token, whatever the model calls EOS
    eot = end_of_turn_id(tokenizer) if tokenizer.chat_template else None
    run = {"args": args, "engine": engine, "model": model, "tokenizer": tokenizer, "pool": pool, "dist": dist,
           "autocast": autocast_for(args, device.type), "stop_ids": [eot] if eot is not None else None, "timing": {}}

    def save():  # every rank takes part (FSDP2 gathers full tensors); rank 0 writes
        weights = distributed.full_state_dict(model, dist.main) if args.shard == "fsdp" and dist.world > 1 else None
        ts = {"optimizer": distributed.optimizer_state(optimizer, dist.main), "scheduler": scheduler.state_dict(),
              "state": state, "rng": rng_state(), "rng_ranks": dist.gather([rng_state()]),
              "critic_optimizer": critic_pair and critic_pair[1].state_dict()}

        def write(d):  # the policy (LoRA: its adapter), + the critic, + a moved reference
            lora.save_adapter(model, d, args.model) if args.lora_rank else model.save_pretrained(d, state_dict=weights)
            if critic_pair is not None:
                critic.save_critic(critic_pair[0], Path(d) / critic.FOLDER)
            if args.ref_update_every and state["step"] >= args.ref_update_every:
                ref_model.save_pretrained(Path(d) / "reference")
        if dist.main:
            print(f"saved {save_checkpoint(out_dir, state['step'], write, tokenizer, ts, config, args.keep_checkpoints)}")
        dist.barrier()  # no rank runs ahead of a checkpoint being written

    summary, last_saved = {"history": []}, state["step"] if ckpt is not None else None
    page = viewer.Page(out_dir / "episodes.jsonl", out_dir / "episodes.html") if args.viewer_groups and dist.main else None
    try:
        with CtrlC() as ctrl_c:
            if args.eval_every and ckpt is None:  # before training
                ev = evaluate(run, eval_rows)
                if dist.main:
                    logger.log(0, ev)
                print(console_line(0, ev), flush=True)
            t_next = time.perf_counter()  # a step's time runs from the last one's (its logging is in it)
            while state["step"] < args.steps and not dist.max(int(ctrl_c.stop)):  # a Ctrl-C on any rank stops all
                t_step = t_next
                # -- rollout phase: the engine awake with this model's weights
                with phases("wake"):
                    engine.wake()
                with phases("sync"):  # vLLM: push + prefix-cache reset (+ logprob check, --sync-check-every)
                    metrics = {f"sync_{k}".replace("sync_dlogp", "dlogp"): float(v) for k, v in
                               engine.load_weights(model).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                run["timing"].clear()
                with phases("rollout"):
                    eps, sampled, rounds = collect(run, train_rows, state)
                with phases("sleep"):
                    engine.sleep()
                if dist.world > 1:  # torchrun: the ranks meet here (time_wait_s: waiting for the slowest rollout)
                    with phases("wait"):
                        dist.barrier()
                # -- training phase
                if eps:  # dynamic sampling may keep nothing: then no update this step
                    metrics.update(dist.mean_metrics(train_step(args, model, ref_model, optimizer, scheduler, eps,
                                                                tokenizer.pad_token_id, state, phases, critic_pair,
                                                                scorer, dist)))
                state["step"] += 1
                if args.ref_update_every and state["step"] % args.ref_update_every == 0:  # a moving KL anchor
                    ref_model.load_state_dict(model.state_dict())  # fp32 -> the reference's dtype
                sampled = dist.gather(sampled)  # every rank's episodes, for the log (rank 0)
                n_kept = int(dist.sum([len(eps)])[0])
                metrics.update(phases.step_times(), **episode_metrics(sampled, n_kept, rounds), lr=scheduler.get_last_lr()[0],
                               skipped_updates=state["skipped_updates"], step_time_s=time.perf_counter() - t_step)
                t_next = time.perf_counter()  # evals and checkpoints below are timed on their own, not in a step
                metrics["episodes_per_s"] = len(sampled) / metrics["time_rollout_s"]
                metrics["env_time_frac"] = run["timing"].get("env_s", 0.0) / metrics["time_rollout_s"]
                metrics["rollout_generate_s"] = run["timing"].get("generate_s", 0.0)  # of time_rollout_s: in engine.generate
                metrics["time_train_s"] = sum(metrics.get(f"time_{k}_s", 0.0) for k in TRAIN_PHASES)
                metrics["time_host_s"] = metrics["step_time_s"] - sum(v for k, v in metrics.items()
                                                                       if k.startswith("time_") and k != "time_train_s")
                metrics.update(phases.metrics())
                if args.eval_every and (state["step"] % args.eval_every == 0 or state["step"] == args.steps):
                    metrics.update(evaluate(run, eval_rows))
                    t_next += metrics["eval_time_s"]
                with phases("log"):  # host work, timed into the next step (whose time includes it)
                    if dist.main:  # rank 0 logs for all ranks (torchrun); the others' stdout goes nowhere anyway
                        logger.log(state["step"], metrics)
                        log_samples(out_dir / "samples.jsonl", state["step"], sampled, tokenizer, args.log_samples)
                        if page is not None:  # OUT/episodes.html: this step's first groups, as a person reads them
                            page.add(viewer.episode_records(state["step"], sampled, tokenizer,
                                                            [e.info.get("advantage") for e in sampled], args.viewer_groups))
                            page.write()  # at most every 30 s (and at the end); episodes.jsonl gets every step
                        summary["history"].append({"step": state["step"], **metrics})
                        print(console_line(state["step"], metrics), flush=True)
                        if not args.no_plot and "eval_pass1" in metrics:
                            write_plot(out_dir)
                if args.save_every > 0 and state["step"] % args.save_every == 0:
                    t_save = time.perf_counter()
                    save()
                    last_saved, t_next = state["step"], t_next + time.perf_counter() - t_save
            if page is not None:
                page.write(force=True)  # the steps the 30 s throttle held back
            if last_saved != state["step"] and args.save_every >= 0:
                save()  # the final (or Ctrl-C) checkpoint
            if dist.main and not args.no_plot and (out_dir / "metrics.jsonl").exists():
                write_plot(out_dir)
            if dist.main and args.save_merged and args.lora_rank:  # W + (alpha/r) B A as a plain HF folder
                unwrap(model).save_pretrained(out_dir / "merged", state_dict=lora.merged_state_dict(model))
                tokenizer.save_pretrained(out_dir / "merged")
    finally:
        if logger is not None:
            logger.close()
        if pool is not None:
            pool.close()
        if hasattr(engine, "close"):
            engine.close()
        dist.close()
    if phases.on:
        print(phases.table())
    summary["step"] = state["step"]
    summary["memory"] = phases.metrics()
    summary["checkpoint"] = str(find_checkpoint(out_dir)) if dist.main and args.save_every >= 0 else None
    return summary


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, FileExistsError, ValueError) as e:  # bad input: one line, not a traceback
        raise SystemExit(f"error: {e}")
