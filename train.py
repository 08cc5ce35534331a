r"""
nanoRL's training script, in the order a run happens: set up, then the loop, each phase one call.

    python train.py                                   # embedded SmolLM2-135M-Instruct, CPU, 1-digit multiply
    python train.py --env mcp --gpu l40s              # multi-turn tool use against MCP servers, vLLM rollouts
    python train.py --resume runs/nanorl              # continue exactly where a run stopped
    torchrun --nproc-per-node 2 -- train.py --gpu h100   # one rank per GPU (support/dist.py)
    python -m pytest -q tests/test_train.py           # CPU tests with a tiny random model

One step:
  1. collect: P prompts x n episodes (CPU: HFEngine sharing this model; GPU: vLLM in this process, woken,
     synced, put to sleep); DAPO's overlong punishment, dynamic sampling; --rescue's guided groups.
  2. train_step: advantages (--algo); old logprobs: the engine's, a no-grad forward, or exactly
     on-policy the training forward's own, detached (--old-logprobs); reference logprobs (--kl-coef);
     TIS weights w (--tis-cap). Then --ppo-epochs passes of mini-batches, one AdamW update each:
         l_t = loss(logp, old, A) * w + kl_coef * k(logp, ref) - entropy_coef * H_t
     reduced (--reduction) with the mini-batch's global denominators, so accumulation is exact.
  3. evaluate (greedy pass@1 on held-out rows, every --eval-every steps), log, save.
Each option (options/) enters at one visible `if args.X:` line. Choices: trainer weights are float32
(--dtype bfloat16 is autocast: bf16 weights would swallow 1e-6-sized AdamW updates); a non-finite
update is skipped (MAX_BAD_UPDATES in a row stop the run); Ctrl-C finishes the step and saves;
checkpoints are atomic and resume exactly; bad input is one error line and leaves no folder; after
--max-error-steps steps in which every episode failed (servers down) the run saves and stops.
Under torchrun each rank runs this loop on its share of the prompts; `run.world` does the rest.
"""
import contextlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# torch's OpenMP threads spin while they wait (libgomp's default, read when torch loads): on a CPU
# shared with other work a spinning thread holds the core the working one needs. A value you set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import envs  # noqa: E402
import grpo  # noqa: E402
from config import DUAL_CLIP, USER_ERRORS, fits_this_gpu, parse_args, preset_line, require_cuda  # noqa: E402
from mcp_tools.formats import FORMATS, resolve_tool_format  # noqa: E402
from options import critic, entropy, lora, memory, prefix, quant, rescue  # noqa: E402
from rollout import HFEngine, decode_many, episodes_to_batch, run_episodes, stop_token_ids  # noqa: E402
from score import Scorer, batch_logprobs, micro_batches, sequence_logprobs, unwrap  # noqa: E402
from support import dist  # noqa: E402
from support.checkpoint import CtrlC, check_not_complete, find_checkpoint, load_trainer_state, resume_point, save_best, save_run  # noqa: E402
from support.logs import Guard, Means, PhaseReport, RunLog, step_metrics, tally  # noqa: E402
from support.rows import next_rows  # noqa: E402
from support.sources import load_model, load_reference, load_tokenizer, model_source, on_device  # noqa: E402
from vllm_engine import VLLMEngine  # noqa: E402  (vLLM itself is imported when an engine starts)

MAX_BAD_UPDATES = 3      # non-finite updates in a row that stop the run
MAX_RESAMPLE_ROUNDS = 3  # DAPO dynamic sampling: extra generation rounds a step at most
TRAIN_PHASES = ["old_ref_logprobs", "forward", "backward", "optimizer"]  # timed in train_step


class RunStopped(RuntimeError):
    """The run stopped itself after its final checkpoint (e.g. servers down for --max-error-steps steps)."""


@dataclass
class Run:
    """What one run holds: the trainer's side (a test builds one from the first four), the rollout side."""
    args: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    ref_model: torch.nn.Module | None = None  # the frozen KL reference (None: no KL, or LoRA's base)
    critic: torch.nn.Module | None = None     # --algo gae (options/critic.py) and its AdamW
    critic_optimizer: torch.optim.Optimizer | None = None
    scorer: torch.nn.Module | None = None     # the loss's forward (score.Scorer), DDP-wrapped under torchrun
    world: dist.World = field(default_factory=dist.World)  # this rank under torchrun (support/dist.py)
    pad_id: int = 0
    phases: object = lambda name: contextlib.nullcontext()  # support/logs.PhaseReport: memory and time per phase
    engine: object = None
    tokenizer: object = None
    pool: object = None                       # the MCP servers (mcp_tools/pool.py) when rows need them
    stop_ids: list | None = None
    timing: dict = field(default_factory=dict)
    host_state: dict = field(default_factory=dict)  # --offload-optimizer: AdamW's pinned host buffers
    guard: Guard = field(default_factory=Guard)

    def __post_init__(self):  # the scoring forward and its micro-batches (scoring, below)
        self.forward, self.split = scoring(self.args)
        if self.scorer is None:
            self.scorer = Scorer(self.model, self.forward)

    def autocast(self):
        """The forward passes' autocast (--dtype bfloat16), or a disabled one."""
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=self.args.dtype == "bfloat16")


def scoring(args):
    """(forward, micro_batches) of the loss and the old and reference logprobs: score.py's padded rows,
    or --shared-prefix's packed ones."""
    if args.shared_prefix:  # options/prefix.py (on by default): a micro-batch's shared prompt run once, in one packed row
        return prefix.sequence_logprobs, prefix.micro_batches
    return sequence_logprobs, micro_batches


# ---- main: set up, then the loop

def main(argv=None):
    args = parse_args(argv, fits=fits_this_gpu)  # every flag decided (config.py), the auto choices too
    run, state, train_rows, eval_rows, ckpt = setup(args)
    out_dir, world, log, stopped = Path(args.out_dir), run.world, None, None
    last_saved, history = state["step"] if ckpt is not None else None, []
    try:
        run.pool = envs.open_mcp_pool([train_rows, eval_rows], args.env, args.mcp_config, 30.0, run.tokenizer)
        args.tool_format, run.stop_ids = resolve_tool_format(args.tool_format, run.tokenizer, run.stop_ids)
        log = RunLog(args, out_dir, world.main, run.guard)  # OUT/: metrics, samples, viewer, plot
        with CtrlC() as ctrl_c:
            if args.eval_every and ckpt is None:  # before training
                log.step(0, keep_best(run, state, out_dir, evaluate(run, eval_rows)))
            t_next = time.perf_counter()  # a step's time runs from the last one's end (its logging is in it)
            while state["step"] < args.steps and not world.max(int(ctrl_c.stop)):  # Ctrl-C on any rank stops all
                t_step = t_next
                episodes, sampled, rounds, metrics = collect(run, train_rows, state)               # 1. rollouts
                if episodes:  # dynamic sampling may keep nothing: then no update this step
                    metrics.update(world.mean_metrics(train_step(run, episodes, state)))  # 2. the update
                state["step"] += 1
                if args.ref_update_every and state["step"] % args.ref_update_every == 0:  # a moving KL anchor
                    dist.copy_weights(run.model, run.ref_model)  # FSDP2: gathered tensor by tensor
                sampled = world.gather(sampled)  # every rank's episodes, for the log (rank 0)
                metrics.update(step_metrics(run.phases, run.timing, sampled, int(world.sum([len(episodes)])[0]), rounds,
                                            run.scheduler.get_last_lr()[0], state["skipped_updates"], t_step, TRAIN_PHASES))
                t_next = time.perf_counter()  # evals and checkpoints are timed on their own, not in a step
                last = state["step"] == args.steps or world.max(int(ctrl_c.stop))  # the run's last step is evaluated
                if args.eval_every and (state["step"] % args.eval_every == 0 or last):
                    metrics.update(keep_best(run, state, out_dir, evaluate(run, eval_rows)))          # 3. held-out rows
                    t_next = time.perf_counter()
                with run.phases("log"):  # host work, timed into the next step
                    log.step(state["step"], metrics, sampled, run.tokenizer)
                    history.append({"step": state["step"], **metrics})
                if args.save_every > 0 and state["step"] % args.save_every == 0:
                    t_save = time.perf_counter()
                    save(run, state, out_dir)
                    last_saved, t_next = state["step"], t_next + time.perf_counter() - t_save
                stopped = errors_in_a_row(args, state, sampled, out_dir)  # servers down: stop, with a checkpoint
                if stopped:
                    break
            finish(run, state, out_dir, log, last_saved)
    finally:
        for closing in (log, run.pool, run.engine):
            if hasattr(closing, "close"):
                closing.close()
        world.close()
    if stopped:
        raise RunStopped(stopped)
    if run.phases.on:
        print(run.phases.table())
    return {"history": history if world.main else [], "step": state["step"], "memory": run.phases.metrics(),
            "checkpoint": str(find_checkpoint(out_dir)) if world.main and args.save_every >= 0 else None}


# ---- set up: data, models, engine, optimizer

def setup(args):
    """(run, loop state, train rows, eval rows, checkpoint or None); bad data and a finished or
    occupied run folder fail here, before any model loads."""
    ckpt = resume_point(args)  # None for a new run; a finished or occupied run folder is an error
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    require_cuda(args.gpu)
    world = dist.World("cuda" if args.gpu != "cpu" else "cpu")  # torchrun: this process's rank and GPU
    if not world.main:  # rank 0 speaks for all: the others' stdout goes nowhere (errors still reach stderr)
        sys.stdout = open(os.devnull, "w")
    train_rows, eval_rows = envs.load_splits(args.env, args.train_data, args.eval_data, digits=args.digits,
                                             fewshot=args.fewshot, seed=args.seed, eval_limit=args.eval_limit,
                                             eval_every=args.eval_every, mcp_config=args.mcp_config)
    if args.rescue is None:  # not given: on where MCP rows carry no oracle calls (a question and an answer)
        args.rescue = rescue.default_spec(train_rows, args.steps) if args.env == "mcp" else ""
        if args.rescue:
            print(f"--rescue {args.rescue}: the training rows carry no oracle calls (options/rescue.py; --rescue off: without)")
    print(preset_line(args))  # the preset's keys, this run's values
    if args.gpu == "cpu":  # what a CPU step's time depends on (OMP_WAIT_POLICY above)
        print(f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS), OMP_WAIT_POLICY {os.environ['OMP_WAIT_POLICY']}")
    print("config", json.dumps(vars(args), sort_keys=True))
    if world.size > 1:
        print(f"torchrun: {world.size} ranks, --shard {args.shard}, {args.prompts_per_step // world.size} prompts per rank")
    return (*start(args, world, ckpt), train_rows, eval_rows, ckpt)  # start: (run, state)


def start(args, world, ckpt):
    """The Run: tokenizer, policy (+ reference, critic), engine, AdamW, scheduler; and the loop
    state (a new one, or the checkpoint's)."""
    phases = PhaseReport()  # before anything is loaded: its baseline is what others use on this GPU
    with world.rank0_first():  # rank 0 builds the embedded model or a shape's folder once
        src = model_source(args.model)
    tokenizer = load_tokenizer(ckpt or src, args.model)
    if world.device.type == "cuda":  # fail now, with what to change, before anything big is on the GPU
        fits_this_gpu(args, args.lora_rank, awake=args.engine == "vllm" and args.sleep_level == 0, fail=True)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    if args.lora_rank:  # options/lora.py: the frozen base in the compute dtype, float32 adapters (the checkpoint's)
        model = load_model(src, dtype)
        lora.apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets.split(","))
        if ckpt is not None:
            lora.load_adapter(model, ckpt)
    else:  # float32 master weights, the checkpoint's when resuming
        model = load_model(ckpt or src)
    model = on_device(model, world.device, args.grad_checkpointing)
    ref_model = None  # the frozen KL reference; LoRA's is its own base, the adapters off (lora.disabled)
    if args.kl_coef > 0 and not args.lora_rank:
        ref_model = load_reference(src, ckpt, dtype, world.device)
        if not args.ref_update_every:  # --shard fsdp: 1/W of it a GPU (support/dist.py); else as it was
            ref_model = dist.shard_reference(ref_model, world, args.shard, dtype)
    if args.compile and world.device.type == "cuda":  # options/memory.py: the trainer's forwards; vLLM compiles its own
        memory.compile_model(model)
    if args.shared_prefix and not prefix.packable(model):  # decided once: the micro-batches' budget counts packed tokens
        print(f"--shared-prefix off: {unwrap(model).config._attn_implementation} attention or sliding-window "
              "layers would not honour the packed row's mask (options/prefix.packable)")
        args.shared_prefix = False
    if args.engine == "hf":  # the trainer's own model samples (CPU)
        engine = HFEngine(model, tokenizer)
    else:  # vLLM in this process, from the folder the policy came from (a LoRA run's: its base)
        held, folder = torch.cuda.memory_allocated(), src if args.lora_rank or ckpt is None else ckpt
        kw = dict(seed=args.seed + world.rank, gpu_memory_utilization=args.gpu_memory_utilization,
                  sleep_level=args.sleep_level, max_model_len=args.max_context, check_every=args.sync_check_every,
                  kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else None)
        if args.rollout_quant != "none":  # options/quant.py: 8-bit weights, quantized again at every sync
            engine = quant.QuantizedEngine(model, tokenizer, folder, args.rollout_quant, **kw)
        else:
            engine = VLLMEngine(folder, **kw)
        phases.engine_pool = torch.cuda.memory_allocated() - held  # vLLM's pool, in torch's accounting
    scorer, model = dist.wrap(Scorer(model, scoring(args)[0]), world, args.shard, dtype)  # DDP / FSDP2
    if world.rank:  # every rank samples its own episodes (HF engine: torch's RNG)
        torch.manual_seed(args.seed + world.rank)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay,  # fused: one kernel per step (FSDP2: foreach)
                                  fused=world.device.type == "cuda" and args.shard != "fsdp" or None)
    warm = max(args.warmup_steps, 0)  # linear warmup, in updates
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / warm) if warm else 1.0)
    run = Run(args, model, optimizer, scheduler, ref_model=ref_model, scorer=scorer, world=world, pad_id=tokenizer.pad_token_id,
              phases=phases, engine=engine, tokenizer=tokenizer, stop_ids=stop_token_ids(tokenizer))  # a turn ends at end-of-turn
    if args.algo == "gae":  # options/critic.py: a second model from the policy's weights, or the checkpoint's
        run.critic, run.critic_optimizer = critic.start_critic(Path(ckpt) / critic.FOLDER if ckpt else src, world.device,
                                                               args.grad_checkpointing, args.critic_lr, args.weight_decay)
    state = {"step": 0, "data": {"epoch": 0, "pos": 0}, "skipped_updates": 0, "bad_in_a_row": 0, "error_steps": 0}
    if ckpt is not None:  # AdamW, scheduler, RNG and this dict as they were saved
        state = load_trainer_state(ckpt, optimizer, scheduler, run.critic_optimizer, world.rank, world.size)
        check_not_complete(state["step"], args)  # a checkpoint folder renamed from step_NNNNNN
        if args.offload_optimizer:  # options/memory.py: load_state_dict put AdamW's state on the GPU
            memory.move_optimizer_state(optimizer, run.host_state, "cpu")
    return run, state


# ---- 1. rollouts

def collect(run, train_rows, state):
    """The rollout phase (wake, sync, generate, sleep): (episodes to train on, every episode sampled
    (guided replays beside their groups), generation rounds, the phase's metrics). Group ids are unique per step."""
    args, engine, phases, world = run.args, run.engine, run.phases, run.world
    spec = rescue.parse(args.rescue) if args.rescue else None  # options/rescue.py (--rescue)
    with phases("wake"):
        engine.wake()
    with phases("sync"):  # vLLM: push + prefix-cache reset (+ logprob check, --sync-check-every)
        metrics = {f"sync_{k}".replace("sync_dlogp", "dlogp"): float(v) for k, v in
                   engine.load_weights(run.model).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    run.timing.clear()
    kept, sampled, rounds, row_of, replays = [], [], 0, {}, []  # row_of: group id -> its row
    queue = state.setdefault("rescue_replay", []) if spec and spec["replay"] else None  # --rescue replay=K

    def play(rows, ids):  # n episodes a row, their rewards checked; DAPO's overlong punishment
        new = rollouts(run, rows, args.n, args.temperature, group_ids=ids)
        envs.check_rewards(new, dict(zip(ids, rows)), args.env)  # finite numbers, or an error naming the row
        if args.overlong_buffer > 0:  # DAPO soft punishment on the longest turn (--max-tokens is per turn)
            lens = torch.tensor([e.longest_turn() for e in new])
            for e, p in zip(new, grpo.overlong_punishment(lens, args.max_tokens, args.overlong_buffer).tolist()):
                e.info["overlong_penalty"], e.reward = p, e.reward + p
        return new
    target = args.prompts_per_step * args.n // world.size  # this rank's share (whole groups)
    with phases("rollout"):  # dynamic sampling: the same rounds on every rank (support/dist.World.short)
        while rounds == 0 or (args.dynamic_sampling and world.short(len(kept), target) and rounds <= MAX_RESAMPLE_ROUNDS):
            # every rank draws the same rows and keeps its share; group ids are the one-GPU run's
            mine = world.local_rows(next_rows(train_rows, state["data"], args.prompts_per_step, args.seed))
            if rounds == 0 and queue:  # rows the rescue solved K steps ago, in place of the first fresh ones
                replays = rescue.due(queue, state["step"], len(mine))
                mine = [row for _, row in replays] + mine[len(replays):]
            ids = [world.global_group(j) + rounds * args.prompts_per_step for j in range(len(mine))]
            row_of.update(zip(ids, mine))
            new = play(mine, ids)
            rounds, sampled = rounds + 1, sampled + new
            if args.dynamic_sampling:  # DAPO: drop the groups whose rewards are all equal
                keep = grpo.dynamic_sampling_keep(torch.tensor([e.reward for e in new]), torch.tensor([e.group for e in new]))
                new = [e for e, k in zip(new, keep.tolist()) if k]
            kept += new
        if spec and spec["hint"]:  # options/rescue.py: all-wrong groups played again with a plan (oracle or found) or the answer
            tools = run.pool and run.pool.no_argument  # name -> a probe may call it; an unknown tool's calls: not guided
            fmt = FORMATS[args.tool_format]  # a turn's text as the env read it (decode), its calls (parse); found plans: in state
            decode = lambda ids: decode_many(run.tokenizer, [ids], getattr(fmt, "specials", ()))[0]  # noqa: E731
            kept, m, guided = rescue.guide(kept[:target], row_of, state["step"], spec, fmt.render, play, tools,
                                           state.setdefault("rescue_found", {}), decode, lambda t: fmt.parse(t)[0], args.max_turns)
            sampled = rescue.beside(sampled, guided)  # shown in the viewer, trained or not; step metrics skip them
            metrics.update(m)
            if queue is not None:  # the rows a guided pass joined come back spec["replay"] steps later
                times_of = {world.global_group(j): times for j, (times, _) in enumerate(replays)}
                metrics.update(rescue_replayed=len(replays), rescue_requeued=rescue.requeue(
                    queue, guided, row_of, times_of, state["step"], spec["replay"]))
    for e in sampled:  # the row's data_source, for the step's pass rate per source (support/logs.episode_metrics)
        e.info.setdefault("source", row_of.get(e.group, {}).get("data_source"))
    with phases("sleep"):
        engine.sleep()
    if world.size > 1:  # torchrun: the ranks meet here (time_wait_s: waiting for the slowest rollout)
        with phases("wait"):
            world.barrier()
    too_long = sum(not e.response_ids and e.finish_reason == "length" for e in sampled)
    if too_long == len(sampled):
        raise ValueError(f"every prompt this step is at least --max-context {args.max_context} tokens long "
                         f"(e.g. {len(sampled[0].prompt_ids)}): raise --max-context")
    elif too_long:
        print(f"WARNING: {too_long} episodes had prompts of >= --max-context tokens (no response)", flush=True)
    kept = world.trained(kept, len(kept) if spec and spec["hint"] else target)  # whole groups (joined: 2n)
    kept, sampled = world.balance(kept, sampled, skips_zero_advantage(args))  # torchrun: whole groups between ranks, equal work (support/dist.py)
    return kept, sampled, rounds, metrics


def rollouts(run, batch_rows, n, temperature, group_ids=None):
    """n episodes per row from the awake, synced engine."""
    args = run.args
    # autocast is for the HF engine's forward only: vLLM runs in this process too, and an ambient
    # bf16 autocast would also reach its fp32 sampler/logprob math
    with run.autocast() if args.engine == "hf" else contextlib.nullcontext():
        credit = rescue.parse(args.rescue)["credit"] if args.rescue else 0.0  # options/rescue.py: partial credit
        make_env = lambda row: envs.env_for_row(row, args.env, run.pool, args.max_turns, args.format_reward,  # noqa: E731
                                                args.tool_error_penalty, args.tool_error_cap, args.tool_format,
                                                partial_credit=credit)
        if args.rescue:  # options/rescue.py: a guided row's given turns (guide=prefix), played by a wrapping env
            make_env = rescue.with_hints(make_env)
        return run_episodes(run.engine, run.tokenizer, batch_rows, make_env, n=n, temperature=temperature,
                            top_p=args.top_p if temperature > 0 else 1.0, max_tokens=args.max_tokens, max_turns=None,
                            max_context=args.max_context, stop_token_ids=None if args.ignore_eos else run.stop_ids,
                            progress=not args.no_progress, timing=run.timing, logprobs=args.rollout_logprobs and temperature > 0,
                            group_ids=group_ids, ignore_eos=args.ignore_eos)


# ---- 2. the update: advantages, old and reference logprobs, then the mini-batches

def skips_zero_advantage(args) -> bool:
    """A sequence with A = 0 on every token adds exactly 0 to PPO's, GSPO's and CISPO's loss and gradient:
    without a KL term it is skipped (train_step; it still counts in the denominators, AdamW still steps)
    and is no work to balance (collect). clip-cov's and kl-cov's covariance terms reach such rows."""
    return args.kl_coef <= 0 and args.loss not in ("clip-cov", "kl-cov")


def train_step(run, eps, state):
    """One RL update on the kept episodes; returns its metrics."""
    args = run.args
    with run.phases("batch"):  # host work: the padded tensors
        batch = episodes_to_batch(eps, run.pad_id)
    B = batch["input_ids"].shape[0]
    mask = batch["loss_mask"][:, 1:]  # (B, T-1) aligned with logits[:, :-1] / targets input_ids[:, 1:]
    m = {}
    # eval mode (no dropout): we train the function we sampled from; --grad-checkpointing needs train
    # mode (transformers checkpoints only there), the same function as the Llama/Qwen dropout is 0
    run.model.train(args.grad_checkpointing)
    old, ref = old_and_reference_logprobs(run, batch, mask, m)  # (B, T-1) or None
    tis, mask = importance_weights(args, batch, old, mask, m)  # --tis-mode mask: rejected tokens leave the mask
    adv, values, returns = advantages(run, batch, mask)  # (B, T-1)
    for e, a in zip(eps, ((adv * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()):  # per sequence, for the viewer
        e.info["advantage"] = a
    if args.overlong_filter:  # DAPO: truncated episodes out of the loss
        mask = grpo.overlong_filter_mask(mask, torch.tensor([e.finish_reason == "length" for e in eps]))
    has_adv = (adv != 0).any(1)  # (B,) GRPO: the mixed-reward groups
    skip_zero = skips_zero_advantage(args)  # ref is None exactly when kl_coef <= 0
    live = has_adv if skip_zero else torch.ones(B, dtype=torch.bool)  # (B,) the sequences that train
    stats = Means(), Means(), Means()  # per token (loss statistics), per update (loss, grad norm), per live token
    tensors = dict(batch=batch, mask=mask, adv=adv, old=old, ref=ref, tis=tis, live=live, has_adv=has_adv, skip_zero=skip_zero)
    gen, mbs = torch.Generator().manual_seed(args.seed * 7919 + state["step"]), args.mini_batch_size // run.world.size  # shuffle; M/W a rank
    for epoch in range(args.ppo_epochs):
        order = torch.randperm(B, generator=gen) if args.ppo_epochs > 1 or mbs < B else torch.arange(B)
        for s in range(0, B, mbs):
            update(run, tensors, order[s:s + mbs], epoch, state, stats)
    if args.algo == "gae":  # options/critic.py: the critic's own epochs, on every sequence
        m.update(critic.update_critic(run.critic, run.critic_optimizer, batch, values, returns, mask, run.autocast,
                                      run.phases, Means(), seed=args.seed, epochs=args.ppo_epochs,
                                      mini_batch_size=mbs, micro_batch_size=args.micro_batch_size, world=run.world,
                                      micro_batch_tokens=args.micro_batch_tokens, grad_clip=args.grad_clip))
        m["vf_explained_var"] = float(critic.explained_variance(values, returns, mask))
    run.model.eval()
    run.optimizer.zero_grad(set_to_none=True)  # the grads' memory goes back before the engine wakes
    per_token, per_update, per_live = stats
    m.update(per_update.means(), **per_token.means())
    m.update(per_live.means() if not skip_zero else {"entropy_live": m["entropy"]} if "entropy" in m else {})
    m["trained_tokens"] = float(batch["attention_mask"][live].sum()) * args.ppo_epochs  # this rank's, for MFU (lab/bench_tables.mfu)
    m.update(entropy_coef=args.entropy_coef, updates=int(per_update.weights.get("loss", 0)),
             live_frac=float(live.float().mean()), adv_abs_mean=float(grpo.masked_mean(adv.abs(), mask)))
    return m


def old_and_reference_logprobs(run, batch, mask, m):
    """(old (B, T-1) or None, ref (B, T-1) or None) before any update. old is None with --old-logprobs
    detach: the training forward's own, set per micro-batch. m gets logprob_mismatch when measured."""
    args = run.args
    rollout_lp = batch["logprobs"][:, 1:]
    old = rollout_lp if args.old_logprobs == "rollout" else None
    fwd = dict(micro_batch_size=args.micro_batch_size, temperature=args.temperature, chunk=args.logprob_chunk,
               device=next(run.model.parameters()).device, tokens=args.micro_batch_tokens, even=run.world.even,
               forward=run.forward, split=run.split)
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
    """(TIS weights (B, T-1) or None, the loss mask); grpo.tis_weights. --tis-mode mask: a rejected
    token leaves the loss mask itself, and so every denominator, advantage, KL and entropy."""
    if args.tis_cap <= 0:
        return None, mask
    tis = grpo.tis_weights(old, batch["logprobs"][:, 1:], mask, mode=args.tis_mode, cap=args.tis_cap)  # (B, T-1)
    m["tis_mean"] = float(grpo.masked_mean(tis, mask))
    m["tis_clip_frac"] = float(grpo.masked_mean((tis >= args.tis_cap if args.tis_mode == "truncate" else tis == 0).float(), mask))
    if args.tis_mode == "mask":
        return None, mask * tis.to(mask.dtype)  # tis is 0 or 1 here
    return tis, mask


def advantages(run, batch, mask):
    """(adv (B, T-1), critic values, GAE returns) by --algo; values and returns are None but for gae."""
    args = run.args
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
    elif args.algo == "gae":  # options/critic.py: the critic's values before the update, GAE over policy tokens
        with run.autocast(), run.phases("critic"):
            values = critic.batch_values(run.critic, batch, args.micro_batch_size,
                                         next(run.model.parameters()).device, args.micro_batch_tokens)
        adv, returns = critic.gae_advantages(grpo.last_token_rewards(rewards, mask), values, mask, args.gamma, args.lam, whiten=False)
        return run.world.whiten(adv, mask), values, returns  # whitened over every rank's tokens (grpo.masked_whiten)
    raise ValueError(f"unknown --algo {args.algo!r}")


def update(run, tensors, mini_batch, epoch, state, stats):
    """One optimizer update on mini_batch (row indices into the step's tensors): forward, loss and
    backward per micro-batch, then AdamW. stats: (per token, per update, per live token) Means."""
    args, world = run.args, run.world
    per_token, per_update, per_live = stats
    device = next(run.model.parameters()).device
    batch, step_mask = tensors["batch"], tensors["mask"]
    lengths = batch["attention_mask"].sum(1)
    tokens, seqs = world.sum([step_mask[mini_batch].sum(), len(mini_batch)])  # the update's global denominators
    tokens = torch.tensor(max(tokens, 1.0), device=device)
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    todo = run.split(lengths, mini_batch[tensors["live"][mini_batch]], args.micro_batch_size, args.micro_batch_tokens,
                     ids=batch["input_ids"])
    for idx, real, last in world.lockstep(todo, filler=mini_batch[:1]):  # fillers: torchrun only (support/dist.py)
        T = int(lengths[idx].max())  # trim this micro-batch's padding
        take = lambda x: x[idx, :T - 1].to(device)  # noqa: E731  this micro-batch's (b, T-1) rows of a step tensor
        mask, adv = take(step_mask) * real, take(tensors["adv"])
        with run.autocast(), run.phases("forward"), dist.grad_sync(run.scorer, run.model, last):  # DDP: no-sync here
            logp, ent = run.scorer(batch["input_ids"][idx, :T].to(device), batch["attention_mask"][idx, :T].to(device),
                                   args.temperature, args.logprob_chunk, entropy=epoch == 0 or args.entropy_coef > 0)
        metrics = {} if ent is None or epoch else {"entropy": grpo.masked_mean(ent.detach(), mask)}
        if metrics and not tensors["skip_zero"]:  # every row trains: the entropy of the mixed-reward groups apart
            live_mask = mask * tensors["has_adv"][idx, None].to(device)
            per_live.add({"entropy_live": grpo.masked_mean(ent.detach(), live_mask)}, weight=live_mask.sum())
        old = logp.detach() if tensors["old"] is None else take(tensors["old"])  # detach: exactly on-policy, ratio 1
        if tensors["old"] is None and args.rollout_logprobs:
            metrics["logprob_mismatch"] = grpo.masked_mean((old - take(batch["logprobs"][:, 1:])).abs(), mask)
        per_tok, loss_metrics = policy_loss(args, logp, old, adv, mask)  # (b, T-1)
        metrics.update(loss_metrics)
        if tensors["tis"] is not None:
            per_tok = per_tok * take(tensors["tis"])
        if tensors["ref"] is not None:
            k = grpo.kl(logp, take(tensors["ref"]), args.kl_type)
            per_tok = per_tok + args.kl_coef * torch.where(mask > 0, k, torch.zeros_like(k))
            metrics["kl"] = grpo.masked_mean(k.detach(), mask)
        if args.entropy_coef > 0:  # the entropy bonus; its gradient flows through H_t
            per_tok = per_tok - args.entropy_coef * ent
        loss = reduce_loss(args, per_tok, mask, tokens, seqs)
        with run.phases("backward"):
            (loss * world.grad_scale).backward()  # DDP/FSDP average over ranks: x W makes it the sum
        if real:
            loss_sum += loss.detach()
            per_token.add(metrics, weight=mask.sum())
    with run.phases("optimizer"):
        gnorm = optimizer_step(run, loss_sum, state)
    if gnorm is not None:
        per_update.add({"loss": loss_sum, "grad_norm": gnorm})


def policy_loss(args, logp, old, adv, mask):
    """Per-token policy loss (b, t) and its statistics, by --loss (grpo.py)."""
    if args.loss == "ppo":
        return grpo.ppo_clip_loss(logp, old, adv, mask, args.clip_low, args.clip_high, DUAL_CLIP)  # config.py: why
    elif args.loss == "gspo":
        return grpo.gspo_loss(logp, old, adv, mask, args.clip_low, args.clip_high)
    elif args.loss == "cispo":
        return grpo.cispo_loss(logp, old, adv, mask, args.clip_low, args.clip_high)
    elif args.loss == "clip-cov":  # options/entropy.py; the covariance's means are this micro-batch's, as verl's
        return entropy.clip_cov_loss(logp, old, adv, mask, args.clip_low, args.clip_high, *args.clip_cov)
    elif args.loss == "kl-cov":  # options/entropy.py
        return entropy.kl_cov_loss(logp, old, adv, mask, *args.kl_cov)
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


def optimizer_step(run, loss_sum, state):
    """Clip and apply the accumulated gradients; returns the grad norm, or None when the update was
    skipped because the loss or the gradient norm is not finite (the weights stay untouched)."""
    args = run.args
    params = [p for p in run.model.parameters() if p.requires_grad]
    for p in (p for p in params if p.grad is None):  # all sequences skipped (or unused): zero, not None, grads
        p.grad = torch.zeros_like(p)
    gnorm = dist.full(torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf")))
    if not bool(torch.isfinite(gnorm) & torch.isfinite(loss_sum)):  # the one host sync of an update
        run.optimizer.zero_grad(set_to_none=True)
        state["skipped_updates"] += 1
        state["bad_in_a_row"] += 1
        print(f"WARNING: non-finite loss or grad norm at step {state['step']}: update skipped "
              f"({state['bad_in_a_row']} in a row, {state['skipped_updates']} total)", flush=True)
        if state["bad_in_a_row"] >= MAX_BAD_UPDATES:
            raise RuntimeError(f"{state['bad_in_a_row']} non-finite updates in a row: stopping "
                               "(lower --lr, check rewards and logprobs)")
        return None
    state["bad_in_a_row"] = 0
    if args.offload_optimizer:  # options/memory.py: AdamW's moments in for the update, out after it
        memory.move_optimizer_state(run.optimizer, run.host_state, params[0].device)
    run.optimizer.step()
    if args.offload_optimizer:
        memory.move_optimizer_state(run.optimizer, run.host_state, "cpu")
    run.scheduler.step()
    return float(gnorm)


# ---- 3. evaluate, log, save

def evaluate(run, eval_rows):
    """Greedy pass@1 and mean reward on the held-out rows (engine synced first), as `python eval.py`
    scores them (support/logs.tally). Several --eval-data sets: also eval_pass1/NAME, eval_reward/NAME."""
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


def keep_best(run, state, out_dir, metrics):
    """--eval-data val=FILE, rows held back from training: OUT/best holds the policy at its best val pass@1
    so far (the last step to reach it: on a tie, the one trained longer; step 0 is the base), a folder
    eval.py and vLLM load (save). The score is loop state, saved with checkpoints. Returns metrics."""
    score = metrics.get("eval_pass1/val")
    if score is not None and score >= state.get("best_val", -1.0) and run.args.save_every >= 0:
        state["best_val"] = score
        save(run, state, out_dir, best={"step": state["step"], "eval_pass1/val": score})
    return metrics


def errors_in_a_row(args, state, sampled, out_dir):
    """Why the run must stop, or None: every episode of --max-error-steps steps in a row ended in an
    error (servers or an env that stay down). The count is loop state, saved with checkpoints."""
    state["error_steps"] = state.get("error_steps", 0) + 1 if all(e.finish_reason == "error" for e in sampled) else 0
    if not args.max_error_steps or state["error_steps"] < args.max_error_steps:
        return None
    saved = (f"its checkpoint is saved; once they work again, continue with --resume {out_dir}"
             if args.save_every >= 0 else "no checkpoint (--save-every -1)")
    return (f"every episode of the last {state['error_steps']} steps ended in an error "
            f"(the first: {sampled[0].info.get('error')}): stopped at step {state['step']}; {saved}")


def save(run, state, out_dir, best=None):
    """A checkpoint (support/checkpoint.save_run) of the policy: its weights, or LoRA's adapter alone;
    and the critic's. With best (its step and score): OUT/best instead, the policy alone (save_best)."""
    def write_policy(folder, weights):  # weights: FSDP2's gathered full tensors, else None (the model's own)
        if run.args.lora_rank:  # options/lora.py: PEFT's adapter folder, naming its base model
            lora.save_adapter(run.model, folder, run.args.model)
        else:
            run.model.save_pretrained(folder, state_dict=weights)
        if run.critic is not None:  # options/critic.py
            critic.save_critic(run.critic, Path(folder) / critic.FOLDER)
    if best:
        save_best(run, out_dir, write_policy, best)
    else:
        save_run(run, state, out_dir, write_policy)


def finish(run, state, out_dir, log, last_saved):
    """After the loop (or Ctrl-C): the final checkpoint, the last viewer page and plot, LoRA's merged model."""
    if last_saved != state["step"] and run.args.save_every >= 0:
        save(run, state, out_dir)  # the final (or Ctrl-C, or servers-down) checkpoint
    log.finish()
    if run.world.main and run.args.save_merged and run.args.lora_rank:  # W + (alpha/r) B A as a plain HF folder
        unwrap(run.model).save_pretrained(out_dir / "merged", state_dict=lora.merged_state_dict(run.model))
        run.tokenizer.save_pretrained(out_dir / "merged")


def cli(argv=None):
    """`python train.py`: main, with what a user fixes by changing flags, data, servers or the machine
    printed as one line, `error: ...`, and exit status 1, not a traceback."""
    try:
        return main(argv)
    except USER_ERRORS + (RunStopped,) as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt as e:  # a second Ctrl-C (support/checkpoint.CtrlC): one line, no traceback
        raise SystemExit(f"interrupted: {str(e) or 'stopped mid-step, unsaved; --resume continues from the last checkpoint'}") from None


if __name__ == "__main__":
    cli()
