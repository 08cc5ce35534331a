"""
nanoRL's training script: RL on a chat model, top to bottom: flags -> data -> the step -> the loop.

    python train.py                                   # embedded SmolLM2-135M-Instruct, CPU, 1-digit multiply
    python train.py --gpu h100 --env gsm8k            # Qwen2.5-1.5B-Instruct, vLLM rollouts
    python train.py --env mcp --gpu l40s [--mcp-config FILE]   # multi-turn tool use against MCP servers
    python train.py --gpu l40s --model Qwen/Qwen2.5-7B-Instruct --lora-rank 32   # LoRA (lora.py)
    python train.py --gpu h100 --rollout-quant fp8    # FlashRL: fp8/int8 rollouts + TIS (quant.py)
    python sft.py --device cuda --out-dir runs/sft    # warm start a model that never calls tools
    python train.py --resume runs/nanorl              # continue exactly where a run stopped
    python -m pytest -q tests/test_train.py           # CPU tests with a tiny random model

One step (every variant is a visible if/elif; the formulas and our choices are in grpo.py):
  1. collect: P prompts x n rollouts (HFEngine sharing this model on the CPU, vLLM on a GPU);
     DAPO: + overlong punishment, then dynamic sampling (drop all-equal-reward groups, draw more)
  2. train_step: advantages (--algo); old logprobs: the engine's (--old-logprobs rollout), a
     no-grad forward (recompute), or, exactly on-policy, the training forward's own (detach);
     reference logprobs if --kl-coef > 0; TIS weights w if --tis-cap. Then --ppo-epochs passes of
     mini-batches (one AdamW step each) of micro-batches, per policy token
         l_t = loss(ppo | gspo | cispo)(logp, old, A) * w + kl_coef * k(logp, ref)
     reduced (--reduction) with the mini-batch's global denominators, so accumulation is exact.
  3. the next step pushes the weights to the engine (vLLM: wake, sync + check, generate, sleep).

Defaults: one preset table (PRESETS, per --gpu) and one commented block of derived defaults in
parse_args, both printed at start; the config saved with every checkpoint is the namespace the
code reads. Choices: trainer parameters are float32 (--dtype bfloat16 is autocast: bf16 weights
would swallow 1e-6-sized AdamW updates), except LoRA's frozen base, which stays in the compute
dtype; a non-finite loss or grad norm skips the update (--max-bad-updates in a row stop the run);
Ctrl-C finishes the step and saves; checkpoints are atomic and resume exactly; an --out-dir
holding another run is an error; bad input is one error line and leaves no folder behind; eval is
greedy pass@1 on the held-out rows, before training and every --eval-every steps.
"""
import argparse
import contextlib
import difflib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

import envs
import grpo
import lora
import rows as rowio
from checkpoint import CtrlC, find_checkpoint, load_trainer_state, rng_state, save_checkpoint
from logs import Logger, Means, PhaseReport, console_line, episode_metrics, log_samples, write_plot
from models import (EMBEDDED, SHAPES, batch_logprobs, compute_dtype, fits_gpu, load_policy, load_tokenizer,
                    micro_batches, model_source, sequence_logprobs, unwrap)
from rollout import HFEngine, end_of_turn_id, episodes_to_batch, run_episodes

# ---- presets: the flag defaults each --gpu value implies (printed at start with the final config)
QWEN = "Qwen/Qwen2.5-1.5B-Instruct"
GPU = dict(engine="vllm", model=QWEN, dtype="bfloat16", steps=200, n=8, lr=1e-6, digits=3, fewshot=0,
           format_reward=0.0, eval_rows=200, eval_every=20)
PRESETS = {
    "cpu":  dict(engine="hf", model=EMBEDDED, dtype="float32", steps=6, prompts_per_step=8, n=4, max_tokens=48,
                 max_context=256, micro_batch_size=8, lr=1e-5, digits=1, fewshot=1, format_reward=0.0,
                 eval_rows=16, eval_every=3, gpu_memory_utilization=None, grad_checkpointing=False, logprob_chunk=0),
    # 48 GB and 40 GB cards: full-parameter 1.5B fits with checkpointed activations and chunked
    # logprobs (measured under a memory cap, README); both cost step time, so the big cards skip them
    "l40s": dict(GPU, prompts_per_step=32, max_tokens=512, max_context=2048, micro_batch_size=4,
                 gpu_memory_utilization=0.3, grad_checkpointing=True, logprob_chunk=1024),
    "a100": dict(GPU, prompts_per_step=64, max_tokens=1024, max_context=2048, micro_batch_size=4,
                 gpu_memory_utilization=0.35, grad_checkpointing=True, logprob_chunk=1024),
    "h100": dict(GPU, prompts_per_step=64, max_tokens=1024, max_context=2048, micro_batch_size=8,
                 gpu_memory_utilization=0.35, grad_checkpointing=False, logprob_chunk=0),
    "h200": dict(GPU, prompts_per_step=64, max_tokens=1024, max_context=4096, micro_batch_size=16,
                 gpu_memory_utilization=0.5, grad_checkpointing=False, logprob_chunk=0),
}
# (eps_low, eps_high) per --loss: PPO's symmetric 0.2, GSPO's paper values, CISPO without a lower clip
CLIP = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}
ALGOS = ["grpo", "drgrpo", "dapo", "rloo", "reinforce++", "reinforce++-baseline"]
REDUCTIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TRAIN_PHASES = ["old_ref_logprobs", "forward", "backward", "optimizer"]  # timed in train_step (logs.PhaseReport)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # an unknown flag also names the nearest ones: --data -> --train-data
        if message.startswith("unrecognized arguments"):
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            for bad in (w.split("=")[0] for w in message.split(":", 1)[1].split() if w.startswith("--")):
                near = [f for f in flags if bad[2:] in f] or difflib.get_close_matches(bad, flags, n=3, cutoff=0.6)
                message += f"; {bad}: did you mean {' or '.join(near)}?" if near else ""
        super().error(message)


def preset_for(gpu, env):
    """The defaults that apply: the --gpu preset, adjusted for --env (printed at start)."""
    preset = dict(PRESETS[gpu])
    if env == "mcp":  # every MCP prompt carries a ~1.9k-token tool block; episodes take several turns
        preset.update(max_context=4096, max_tokens=256)
        if gpu == "cpu":  # the HF engine re-reads the whole ~2k-token context every turn: a small demo
            preset.update(prompts_per_step=2, n=4, eval_rows=4, max_tokens=128, max_turns=5, steps=3, fewshot=0)
    return preset


def parse_args(argv=None):
    p = Parser(description="nanoRL: RL for chat LLMs (see the module docstring)")
    g = p.add_argument_group("hardware preset")
    g.add_argument("--gpu", choices=list(PRESETS), default="cpu", help="preset of defaults below (printed at start)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help=f"hub id or local HF folder; '{EMBEDDED}' = embedded SmolLM2-135M-Instruct; "
                                                 f"{', '.join(SHAPES)} = random weights (measurements only)")
    g.add_argument("--engine", choices=["hf", "vllm"], default=None, help="rollout engine (preset: cpu hf, GPUs vllm)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="forward compute dtype (params stay float32)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share of the whole GPU's memory")
    g.add_argument("--sleep-level", type=int, choices=[0, 1, 2], default=2, help="vLLM sleep between rollouts (0 = off)")
    g.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="keep only each layer's input for backward and recompute the rest (~1/3 more compute)")
    g.add_argument("--logprob-chunk", type=int, default=None,
                   help="LM head over this many tokens at a time, recomputed in backward (0: full logits; models.py)")
    g.add_argument("--sync-check-every", type=int, default=10, help="vLLM: check engine vs trainer logprobs on every "
                   "k-th weight sync (1: every sync; the first, and any that changes the copy plan, always are)")
    g.add_argument("--rollout-quant", choices=["none", "fp8", "int8"], default="none",
                   help="vLLM rollouts with fp8 or int8 (W8A8) weights, re-quantized every sync (FlashRL; quant.py)")
    g = p.add_argument_group("LoRA (lora.py)")
    g.add_argument("--lora-rank", type=int, default=None, help="adapter rank r (0: full-parameter; default: "
                   "0 if full-parameter fits this GPU, else 32, decided at start)")
    g.add_argument("--lora-alpha", type=float, default=32.0, help="adapter scale alpha (the update is alpha/r B A)")
    g.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="comma-separated names of the linear layers to adapt")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapter's input")
    g.add_argument("--save-merged", action="store_true", help="LoRA: also write OUT/merged, a plain HF folder")
    g = p.add_argument_group("env and data")
    g.add_argument("--env", choices=list(envs.ENV_CLASSES), default="multiply", help="env for rows without env_class")
    g.add_argument("--train-data", default=None, help="train rows (.jsonl/.parquet); default: generated (multiply, mcp) or data/out/gsm8k")
    g.add_argument("--eval-data", default=None, help="held-out rows; default as for --train-data")
    g.add_argument("--digits", type=int, default=None, help="multiply: digits of each factor (generated rows)")
    g.add_argument("--fewshot", type=int, default=None, help="generated rows: worked examples put before each question (multiply: up to 4; mcp: 0 or 1 tool-call demo)")
    g.add_argument("--format-reward", type=float, default=None, help="reward for a well-formed but wrong answer (every env)")
    g.add_argument("--max-turns", type=int, default=None, help="policy turns per episode (default: env's; mcp 8, others 1)")
    g.add_argument("--mcp-config", default=None, help="mcpServers JSON file (default: the bundled server)")
    g.add_argument("--tool-timeout", type=float, default=30.0, help="seconds a tool call may take (a server's \"timeout\" key overrides)")
    g = p.add_argument_group("algorithm")
    g.add_argument("--algo", choices=ALGOS, default="grpo", help="advantage estimator (+ its defaults)")
    g.add_argument("--loss", choices=list(CLIP), default="ppo", help="per-token policy loss")
    g.add_argument("--reduction", choices=REDUCTIONS, default=None, help="how per-token losses become a scalar (default per --algo)")
    g.add_argument("--clip-low", type=float, default=None, help="eps_low (default per --loss)")
    g.add_argument("--clip-high", type=float, default=None, help="eps_high (default per --loss; dapo+ppo: 0.28)")
    g.add_argument("--dual-clip", type=float, default=None, help="dual-clip constant c > 1 for A < 0 (ppo loss)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-reference coefficient (0: no reference model)")
    g.add_argument("--kl-type", choices=["k1", "k2", "k3"], default="k3", help="KL estimator")
    g.add_argument("--old-logprobs", choices=["rollout", "recompute", "detach"], default=None,
                   help="PPO's old logprobs: the engine's, a no-grad trainer forward before the update, or the training "
                        "forward's own, detached (exactly on-policy: one epoch, one mini-batch; no extra forward)")
    g.add_argument("--rollout-logprobs", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the engine for sampled logprobs (default: only when --old-logprobs rollout or "
                        "--tis-cap need them; on, they also give the logprob_mismatch metric; vLLM is 25-45%% slower with them)")
    g.add_argument("--tis-cap", type=float, default=None, help="truncated importance sampling cap C (0: off; "
                   "default 2 with --rollout-quant, else 0; needs recompute)")
    g.add_argument("--tis-level", choices=["token", "sequence"], default="token", help="TIS weight per token or per sequence")
    g.add_argument("--tis-mode", choices=["truncate", "mask"], default="truncate",
                   help="truncate: w = min(ratio, C); mask: w = 1 inside [--tis-low, C], else 0 (the token/sequence is dropped)")
    g.add_argument("--tis-low", type=float, default=None, help="lower bound of --tis-mode mask (default 1 / C)")
    g.add_argument("--dynamic-sampling", type=int, choices=[0, 1], default=None, help="drop all-equal-reward groups (dapo: 1)")
    g.add_argument("--max-resample-rounds", type=int, default=3, help="dynamic sampling: extra generation rounds per step")
    g.add_argument("--overlong-buffer", type=int, default=None, help="DAPO soft overlong punishment buffer in tokens (0: off; dapo: max_tokens/4)")
    g.add_argument("--overlong-factor", type=float, default=1.0, help="DAPO overlong punishment at the limit")
    g.add_argument("--overlong-filter", action="store_true", help="mask truncated (finish=length) episodes out of the loss")
    g.add_argument("--gamma", type=float, default=1.0, help="reinforce++ discount")
    g = p.add_argument_group("sampling")
    g.add_argument("--prompts-per-step", type=int, default=None, help="prompts per step (P)")
    g.add_argument("--n", type=int, default=None, help="samples per prompt (group size)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0; logprobs use it too)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (keep 1.0 for RL; logprobs ignore it)")
    g.add_argument("--max-tokens", type=int, default=None, help="sampled tokens per turn")
    g.add_argument("--max-context", type=int, default=None, help="prompt + response token limit per episode")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=None, help="RL steps to run (total, counting resumed ones)")
    g.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear LR warmup, in optimizer updates")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0: off)")
    g.add_argument("--ppo-epochs", type=int, default=1, help="passes over each step's batch")
    g.add_argument("--mini-batch-size", type=int, default=None, help="episodes per optimizer update (default: the whole batch)")
    g.add_argument("--micro-batch-size", type=int, default=None, help="episodes per forward/backward (and see --micro-batch-tokens)")
    g.add_argument("--micro-batch-tokens", type=int, default=None, help="token budget per forward/backward: episodes sorted "
                   "by length and packed while count x longest <= budget (0: fixed --micro-batch-size; default: "
                   "--micro-batch-size x --max-context, the memory the estimate plans for)")
    g.add_argument("--max-bad-updates", type=int, default=3, help="stop after this many non-finite updates in a row")
    g.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and init")
    g = p.add_argument_group("eval")
    g.add_argument("--eval-every", type=int, default=None, help="greedy pass@1 every k steps (0: off)")
    g.add_argument("--eval-rows", type=int, default=None, help="held-out rows to evaluate (first N)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--out-dir", default="runs/nanorl", help="metrics, plot and checkpoints go here")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every k steps (0: only at the end / Ctrl-C)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="how many step folders to keep")
    g.add_argument("--resume", default=None, help="a run folder (uses ckpt/latest) or a step_NNNNNN folder")
    g = p.add_argument_group("logging")
    g.add_argument("--tensorboard", action="store_true", help="also log to OUT/tb (needs the tensorboard package)")
    g.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to Weights & Biases (needs wandb)")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    g.add_argument("--no-plot", action="store_true", help="do not write OUT/curves.png")
    g.add_argument("--log-samples", type=int, default=2, help="episodes per step written to OUT/samples.jsonl (0: none)")
    args = p.parse_args(argv)

    # ---- derived defaults: each flag still unset gets its value here, in this order
    for k, v in preset_for(args.gpu, args.env).items():
        if getattr(args, k) is None and k != "lr":
            setattr(args, k, v)
    if args.lora_rank is None and args.gpu == "cpu":  # on a GPU main() decides: LoRA only if full does not fit
        args.lora_rank = 0
    if args.reduction is None:  # each paper's own: GRPO's per-sequence mean, Dr.GRPO's constant normaliser
        args.reduction = {"grpo": "seq-mean-token-mean", "drgrpo": "seq-mean-token-sum-norm"}.get(args.algo, "token-mean")
    if args.dynamic_sampling is None:  # DAPO's dynamic sampling and soft overlong punishment
        args.dynamic_sampling = int(args.algo == "dapo")
    if args.overlong_buffer is None:
        args.overlong_buffer = args.max_tokens // 4 if args.algo == "dapo" else 0
    lo, hi = CLIP[args.loss]
    args.clip_low = lo if args.clip_low is None else args.clip_low
    args.clip_high = (0.28 if args.algo == "dapo" and args.loss == "ppo" else hi) if args.clip_high is None else args.clip_high
    if args.tis_cap is None:  # FlashRL: quantized rollouts come with token-level TIS at cap 2
        args.tis_cap = 2.0 if args.rollout_quant != "none" else 0.0
    if args.lr is None:  # LoRA: ~10x the full-parameter LR ("LoRA Without Regret", Thinking Machines 2025)
        args.lr = preset_for(args.gpu, args.env)["lr"] * (10 if args.lora_rank else 1)
    if args.micro_batch_tokens is None:  # same worst case as micro-batch-size full-length episodes, more short ones
        args.micro_batch_tokens = args.micro_batch_size * args.max_context
    if args.mini_batch_size is None:  # one optimizer update per step
        args.mini_batch_size = args.prompts_per_step * args.n
    on_policy = args.ppo_epochs == 1 and args.mini_batch_size >= args.prompts_per_step * args.n and not args.tis_cap
    if args.old_logprobs is None:  # the HF engine's logprobs are exact (same model, same kernels); vLLM's are not,
        # and exactly on-policy the trainer's old logprobs *are* the training forward's, ratio 1
        args.old_logprobs = "rollout" if args.engine == "hf" else "detach" if on_policy else "recompute"
    if args.rollout_logprobs is None:  # vLLM is 25-45% slower with them: ask only when something reads them
        args.rollout_logprobs = args.old_logprobs == "rollout" or args.tis_cap > 0

    # ---- flags that cannot work together
    if args.engine == "vllm" and args.gpu == "cpu":
        p.error("--engine vllm needs a GPU preset (--gpu l40s|a100|h100|h200)")
    if args.rollout_quant != "none" and args.engine != "vllm":
        p.error("--rollout-quant needs the vLLM engine (a GPU preset)")
    if args.old_logprobs == "detach" and not on_policy:
        p.error("--old-logprobs detach needs exactly one update per step on the whole batch "
                "(--ppo-epochs 1, --mini-batch-size >= prompts x n) and no --tis-cap")
    if args.tis_cap > 0 and args.old_logprobs != "recompute":
        p.error("--tis-cap needs --old-logprobs recompute (with rollout logprobs the weight is 1)")
    if (args.old_logprobs == "rollout" or args.tis_cap > 0) and not args.rollout_logprobs:
        p.error("--no-rollout-logprobs: --old-logprobs rollout and --tis-cap read the engine's logprobs")
    if args.tis_low is not None and args.tis_mode != "mask":
        p.error("--tis-low is the lower bound of --tis-mode mask")
    if args.temperature <= 0:
        p.error("--temperature must be > 0 for training (greedy is used for eval only)")
    if min(args.max_tokens, args.max_context, args.n, args.prompts_per_step, args.micro_batch_size) < 1:
        p.error("--max-tokens, --max-context, --n, --prompts-per-step and --micro-batch-size must be >= 1")
    return args


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
        rows = rowio.next_rows(train_rows, state["data"], args.prompts_per_step, args.seed)
        new = rollouts(run, rows, args.n, args.temperature, run["timing"])
        for e in new:  # group = the row's index in rows, until the offset below
            if not math.isfinite(e.reward):
                row = rows[e.group]
                raise ValueError(f"env {envs.env_class_of(row, args.env)!r} returned a non-finite reward ({e.reward}) "
                                 f"for row {row['data_source']!r} {row.get('extra_info', {}).get('index', '')}: "
                                 "rewards must be finite numbers")
        for e in new:  # row index within its round -> unique across rounds
            e.group += rounds * args.prompts_per_step
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
    eps = rollouts(run, eval_rows, 1, 0.0)
    run["engine"].sleep()
    return {"eval_pass1": sum(bool(e.info.get("correct")) for e in eps) / max(len(eps), 1),
            "eval_reward": sum(e.reward for e in eps) / max(len(eps), 1),
            "eval_time_s": time.perf_counter() - t0}


# ---- the step: advantages, old logprobs, the loss, the update

def train_step(args, model, ref_model, optimizer, scheduler, eps, pad_id, state, phases=None):
    """One RL update on the kept episodes; returns metrics. The --algo, --loss and --reduction
    switches are all here. phases: a logs.PhaseReport (memory and time per phase)."""
    phases = phases or (lambda name: contextlib.nullcontext())
    device = next(model.parameters()).device
    autocast = autocast_for(args, device.type)
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
    else:
        raise ValueError(f"unknown --algo {args.algo!r}")
    if args.overlong_filter:
        mask = grpo.overlong_filter_mask(mask, torch.tensor([e.finish_reason == "length" for e in eps]))

    # -- old, reference and importance weights (B, T-1), before any update
    # Eval mode (no dropout): the trained function must be the one we sampled from. transformers
    # only checkpoints activations in train mode, so --grad-checkpointing switches it on (the
    # Llama/Qwen configs have dropout 0, so the function is the same).
    model.train(args.grad_checkpointing)
    old_lp = rollout_lp if args.old_logprobs == "rollout" else None  # detach: set per micro-batch below
    fwd = dict(micro_batch_size=args.micro_batch_size, temperature=args.temperature, chunk=args.logprob_chunk,
               device=device, tokens=args.micro_batch_tokens)
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
    live = (adv != 0).any(1) if ref_lp is None else torch.ones(B, dtype=torch.bool)  # (B,)
    per_token, per_update = Means(), Means()  # loss statistics (token-weighted), loss and grad norm
    gen = torch.Generator().manual_seed(args.seed * 7919 + state["step"])  # mini-batch shuffling
    for epoch in range(args.ppo_epochs):
        order = torch.randperm(B, generator=gen) if args.ppo_epochs > 1 or args.mini_batch_size < B else torch.arange(B)
        for s in range(0, B, args.mini_batch_size):
            mb = order[s:s + args.mini_batch_size]
            tokens, seqs = mask[mb].sum().clamp(min=1), len(mb)  # the global denominators of this update
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=device)
            for idx in micro_batches(lengths, mb[live[mb]], args.micro_batch_size, args.micro_batch_tokens):
                t = int(lengths[idx].max())  # trim this micro-batch's padding
                ids = batch["input_ids"][idx, :t].to(device)
                mk, a = mask[idx, :t - 1].to(device), adv[idx, :t - 1].to(device)
                with autocast(), phases("forward"):
                    logp, ent = sequence_logprobs(model, ids, batch["attention_mask"][idx, :t].to(device),
                                                  args.temperature, args.logprob_chunk, entropy=epoch == 0)  # (b, t-1)
                st = {} if ent is None else {"entropy": grpo.masked_mean(ent, mk)}
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
                    loss.backward()
                loss_sum += loss.detach()
                per_token.add(st, weight=mk.sum())
            with phases("optimizer"):
                gnorm = optimizer_update(args, model, optimizer, scheduler, loss_sum, state)
            if gnorm is not None:
                per_update.add({"loss": loss_sum, "grad_norm": gnorm})
    model.eval()
    optimizer.zero_grad(set_to_none=True)  # the grads' memory goes back before the engine wakes
    m.update(per_update.means())
    m.update(per_token.means())
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
    phases = PhaseReport()  # before anything is loaded: its baseline is what others use on this GPU

    train_rows, eval_rows = load_data(args)  # bad data fails before any model loads
    model_src = model_source(args.model)
    tokenizer = load_tokenizer(ckpt or model_src, args.model)
    if device == "cuda":  # fail now, with what to change, before anything big is on the GPU
        if args.lora_rank is None:  # the default: full-parameter where it fits, else LoRA rank 32 (and 10x the LR)
            rank = 0 if fits_gpu(args, model_src, 0, fail=False) else 32
            print(f"--lora-rank {rank}: " + ("full-parameter training fits" if not rank else
                  "full-parameter training does not fit this GPU, LoRA does (--lora-rank 0 to insist)"))
            args = parse_args(list(sys.argv[1:] if argv is None else argv) + ["--lora-rank", str(rank)])
        fits_gpu(args, model_src, args.lora_rank, fail=True)
    config = vars(args).copy()
    print("preset", args.gpu, args.env, json.dumps(preset_for(args.gpu, args.env)))
    print("config", json.dumps(config, sort_keys=True))
    model, ref_model, engine_src = load_policy(args, model_src, ckpt, device)  # models.py

    pool = envs.open_mcp_pool(train_rows + eval_rows, args.env, args.mcp_config, args.tool_timeout, tokenizer)

    if args.engine == "hf":
        engine = HFEngine(model, tokenizer)  # shares the trainer's model: load_weights is free
    else:
        from vllm_engine import start_engine  # lazy: vLLM is only imported on GPU runs
        held = torch.cuda.memory_allocated()
        engine = start_engine(model, tokenizer, engine_src, args.rollout_quant, seed=args.seed,
                              gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=args.sleep_level,
                              max_model_len=args.max_context, check_every=args.sync_check_every)
        phases.engine_pool = torch.cuda.memory_allocated() - held  # vLLM's pool, in torch's accounting

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    warm = max(args.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / warm) if warm else 1.0)
    state = {"step": 0, "data": {"epoch": 0, "pos": 0}, "skipped_updates": 0, "bad_in_a_row": 0}
    if ckpt is not None:  # AdamW, scheduler, RNG and this dict as they were saved
        state = load_trainer_state(ckpt, optimizer, scheduler, config)
    out_dir.mkdir(parents=True, exist_ok=True)  # only now: bad data, flags or models leave no folder behind
    (out_dir / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    logger = Logger(args, config)
    # a turn also ends at the chat template's end-of-turn token, whatever the model calls EOS
    eot = end_of_turn_id(tokenizer) if tokenizer.chat_template else None
    run = {"args": args, "engine": engine, "model": model, "tokenizer": tokenizer, "pool": pool,
           "autocast": autocast_for(args, device), "stop_ids": [eot] if eot is not None else None, "timing": {}}

    def save():
        ts = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "state": state, "rng": rng_state()}
        writer = (lambda d: lora.save_adapter(model, d, args.model)) if args.lora_rank else model
        print(f"saved {save_checkpoint(out_dir, state['step'], writer, tokenizer, ts, config, args.keep_checkpoints)}")

    summary, last_saved = {"history": []}, state["step"] if ckpt is not None else None
    try:
        with CtrlC() as ctrl_c:
            if args.eval_every and ckpt is None:  # before training
                ev = evaluate(run, eval_rows)
                logger.log(0, ev)
                print(console_line(0, ev), flush=True)
            while state["step"] < args.steps and not ctrl_c.stop:
                t_step = time.perf_counter()
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
                # -- training phase
                if eps:  # dynamic sampling may keep nothing: then no update this step
                    metrics.update(train_step(args, model, ref_model, optimizer, scheduler, eps,
                                              tokenizer.pad_token_id, state, phases))
                state["step"] += 1
                metrics.update(phases.step_times(), **episode_metrics(sampled, eps, rounds), lr=scheduler.get_last_lr()[0],
                               skipped_updates=state["skipped_updates"], step_time_s=time.perf_counter() - t_step)
                metrics["episodes_per_s"] = len(sampled) / metrics["time_rollout_s"]
                metrics["env_time_frac"] = run["timing"].get("env_s", 0.0) / metrics["time_rollout_s"]
                metrics["time_train_s"] = sum(metrics.get(f"time_{k}_s", 0.0) for k in TRAIN_PHASES)
                metrics["time_host_s"] = metrics["step_time_s"] - sum(v for k, v in metrics.items()
                                                                       if k.startswith("time_") and k != "time_train_s")
                metrics.update(phases.metrics())
                if args.eval_every and (state["step"] % args.eval_every == 0 or state["step"] == args.steps):
                    metrics.update(evaluate(run, eval_rows))
                logger.log(state["step"], metrics)
                log_samples(out_dir / "samples.jsonl", state["step"], sampled, tokenizer, args.log_samples)
                summary["history"].append({"step": state["step"], **metrics})
                print(console_line(state["step"], metrics), flush=True)
                if args.save_every and state["step"] % args.save_every == 0:
                    save()
                    last_saved = state["step"]
                if not args.no_plot and "eval_pass1" in metrics:
                    write_plot(out_dir)
            if last_saved != state["step"]:
                save()  # the final (or Ctrl-C) checkpoint
            if not args.no_plot and (out_dir / "metrics.jsonl").exists():
                write_plot(out_dir)
            if args.save_merged and args.lora_rank:  # W + (alpha/r) B A as a plain HF folder
                unwrap(model).save_pretrained(out_dir / "merged", state_dict=lora.merged_state_dict(model))
                tokenizer.save_pretrained(out_dir / "merged")
    finally:
        logger.close()
        if pool is not None:
            pool.close()
        if hasattr(engine, "close"):
            engine.close()
    if phases.on:
        print(phases.table())
    summary["step"] = state["step"]
    summary["memory"] = phases.metrics()
    summary["checkpoint"] = str(find_checkpoint(out_dir))
    return summary


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, FileExistsError, ValueError) as e:  # bad input: one line, not a traceback
        raise SystemExit(f"error: {e}")
