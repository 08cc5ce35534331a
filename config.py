"""
train.py's flags, all decided here: the preset table (PRESETS, per --gpu), the flags themselves
(`python train.py --help` shows the ~20 most runs use first, then groups marked advanced), one
commented block of derived defaults (each flag still unset gets its value there, in order: the
auto choices of LoRA and of the engine's sleep level from the memory estimate among them) and the
combinations that cannot work. train.py prints the preset and the final config at start and saves
the config with every checkpoint: the namespace the code reads.

    args = parse_args(["--gpu", "h100", "--env", "gsm8k"])         # argparse.Namespace, every flag set
    args = parse_args(argv, fits=fits_this_gpu)                      # train.py: auto choices by options/memory.py

An unknown flag names the nearest ones (--data: did you mean --train-data or --eval-data?).
--resume DIR takes the saved run's flags (its checkpoint's nanorl_config.json) for every flag not
given again (resumed()); a file or folder a flag names that cannot work is an error here, before
anything loads (check_paths).

Test: python -m pytest -q tests/test_train.py   (defaults, conflicts, the presets, the auto choices)
"""
import argparse
import difflib
import json
import math
import os
import sys
from pathlib import Path

import torch

import envs
from mcp_tools.conn import ServerStartFailed  # an MCP server that did not start
from options import memory, rescue
from support.checkpoint import run_folder, saved_config
from support.sources import EMBEDDED, SHAPES, model_source

# ---- presets: the flag defaults each --gpu value implies (printed at start with the final config)
QWEN = "Qwen/Qwen2.5-1.5B-Instruct"
GPU = dict(engine="vllm", model=QWEN, dtype="bfloat16", steps=200, n=8, lr=1e-6, digits=3, fewshot=0,
           format_reward=0.0, eval_limit=200, eval_every=20)
PRESETS = {
    "cpu":  dict(engine="hf", model=EMBEDDED, dtype="float32", steps=6, prompts_per_step=8, n=4, max_tokens=48,
                 max_context=256, micro_batch_size=8, lr=1e-5, digits=1, fewshot=1, format_reward=0.0,
                 eval_limit=16, eval_every=3, gpu_memory_utilization=None, grad_checkpointing=False, logprob_chunk=0,
                 offload_optimizer=False),
    # 48 GB and 40 GB cards: full-parameter 1.5B fits with checkpointed activations and chunked
    # logprobs (measured under a memory cap, docs/results.md); both cost step time, so the big cards
    # skip them. The 40 GB card also keeps AdamW's moments in host memory except in its update
    "l40s": dict(GPU, prompts_per_step=32, max_tokens=512, max_context=2048, micro_batch_size=4,
                 gpu_memory_utilization=0.3, grad_checkpointing=True, logprob_chunk=1024, offload_optimizer=False),
    "a100": dict(GPU, prompts_per_step=64, max_tokens=1024, max_context=2048, micro_batch_size=4,
                 gpu_memory_utilization=0.35, grad_checkpointing=True, logprob_chunk=1024, offload_optimizer=True),
    "h100": dict(GPU, prompts_per_step=64, max_tokens=1024, max_context=2048, micro_batch_size=8,
                 gpu_memory_utilization=0.35, grad_checkpointing=False, logprob_chunk=0, offload_optimizer=False),
    "h200": dict(GPU, prompts_per_step=64, max_tokens=1024, max_context=4096, micro_batch_size=16,
                 gpu_memory_utilization=0.5, grad_checkpointing=False, logprob_chunk=0, offload_optimizer=False),
}
# (eps_low, eps_high) per --loss: PPO's symmetric 0.2, GSPO's paper values, CISPO without a lower clip
# (kl-cov has no clip: its pair is never read)
CLIP = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28), "clip-cov": (0.2, 0.2), "kl-cov": (0.2, 0.2)}
# --loss ppo's dual clip (Ye et al. 2020; verl's clip_ratio_c): where A < 0 a token's loss stops at -3 A, gradient
# 0. Without it a token whose probability rose a millionfold within a step (--rescue's replays, trained under
# the prompt without their plan) carried a loss of 7e4 and a gradient norm of 1e6 before clipping.
DUAL_CLIP = 3.0
ALGOS = ["grpo", "drgrpo", "dapo", "rloo", "reinforce++", "reinforce++-baseline", "gae"]
REDUCTIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# --resume: flags given again that differ from the saved run's are named as overrides in one line,
# except these, which change where the run writes, how long it runs and how often it evaluates,
# saves and logs, not what a step computes
RESUME_FREE = ("resume", "out_dir", "steps", "eval_every", "save_every", "viewer_groups", "tensorboard", "wandb",
               "max_error_steps", "sync_check_every")


class SetupError(RuntimeError):
    """A run this machine cannot do as asked (a GPU preset without CUDA): train.py prints it as one line."""


# What a user fixes by changing flags, data, servers or the machine: train.py and eval.py print it as
# one line, `error: ...`, and exit 1, not a traceback
USER_ERRORS = (FileNotFoundError, FileExistsError, ValueError, SetupError, ServerStartFailed)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # an unknown flag also names the nearest ones: --data -> --train-data
        if message.startswith("unrecognized arguments"):
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            for bad in (w.split("=")[0] for w in message.split(":", 1)[1].split() if w.startswith("--")):
                near = [f for f in flags if bad[2:] in f] or difflib.get_close_matches(bad, flags, n=3, cutoff=0.6)
                message += f"; {bad}: did you mean {' or '.join(near)}?" if near else ""
        super().error(message)


def preset_line(args):
    """The start line: the preset's keys (preset_for) with this run's values, then the ones that are
    not the preset's, with the preset's value: `preset cpu multiply {...}; not the preset's: steps (6)`."""
    preset = preset_for(args.gpu, args.env)
    run = {k: getattr(args, k) for k in preset}
    other = ", ".join(f"{k} ({json.dumps(v)})" for k, v in preset.items() if run[k] != v)
    return f"preset {args.gpu} {args.env} {json.dumps(run)}" + (f"; not the preset's: {other}" if other else "")


def preset_for(gpu, env):
    """The defaults that apply: the --gpu preset, adjusted for --env (printed at start)."""
    preset = dict(PRESETS[gpu])
    if env == "mcp":  # every MCP prompt carries a ~1.9k-token tool block; episodes take several turns
        preset.update(max_context=4096, max_tokens=256)
        if gpu == "cpu":  # the HF engine re-reads the whole ~2k-token context every turn: a small demo
            preset.update(prompts_per_step=2, n=4, eval_limit=4, max_tokens=128, max_turns=5, steps=3, fewshot=0)
    return preset


def _sleep_level(v):
    """--sleep-level's values: 0, 1, 2, or auto (None: train.py decides from the memory estimate)."""
    return None if v == "auto" else int(v)


def add_flags(p):
    """Every flag, with help. The first group is what most runs set; the rest is marked advanced."""
    g = p.add_argument_group("common flags")
    g.add_argument("--gpu", choices=list(PRESETS), default="cpu", help="preset of defaults (printed at start)")
    g.add_argument("--env", choices=list(envs.ENV_CLASSES), default="multiply", help="env for rows without env_class")
    g.add_argument("--model", default=None, help=f"hub id or local HF folder; '{EMBEDDED}' = embedded SmolLM2-135M-Instruct; "
                                                 f"{', '.join(SHAPES)} = random weights (measurements only)")
    g.add_argument("--train-data", default=None, help="train rows (.jsonl/.parquet); default: generated (multiply, mcp) or data/out/gsm8k")
    g.add_argument("--eval-data", action="append", default=None, metavar="[NAME=]FILE",
                   help="held-out rows; repeat for several sets, each scored apart (eval_pass1/NAME; NAME: the "
                   "file's stem unless given); a set named val (rows held back from training) picks OUT/best, the "
                   "policy at its best val pass@1 (a tie: the later step); default as for --train-data")
    g.add_argument("--mcp-config", default=None, help="mcpServers JSON file (default: the bundled server)")
    g.add_argument("--algo", choices=ALGOS, default="grpo", help="advantage estimator (+ its defaults)")
    g.add_argument("--loss", choices=list(CLIP), default="ppo", help="per-token policy loss")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-reference coefficient (0: no reference model)")
    g.add_argument("--steps", type=int, default=None, help="RL steps to run (total, counting resumed ones; 0: only "
                   "the eval before training and a step-0 checkpoint, a baseline)")
    g.add_argument("--prompts-per-step", type=int, default=None, help="prompts per step (P)")
    g.add_argument("--n", type=int, default=None, help="samples per prompt (group size)")
    g.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
    g.add_argument("--max-tokens", type=int, default=None, help="sampled tokens per turn")
    g.add_argument("--max-context", type=int, default=None, help="prompt + response token limit per episode")
    g.add_argument("--lora-rank", type=int, default=None, help="LoRA adapter rank r (0: full-parameter; default: "
                   "0 if full-parameter fits this GPU by the memory estimate, else 32)")
    g.add_argument("--eval-every", type=int, default=None, help="greedy pass@1 on held-out rows every k steps (0: off)")
    g.add_argument("--eval-limit", type=int, default=None, help="evaluate the first N held-out rows")
    g.add_argument("--out-dir", default=None, help="metrics, plot, episodes page and checkpoints go here (default: "
                   "runs/nanorl; with --resume, the resumed run's folder)")
    g.add_argument("--resume", default=None, help="a run folder (uses ckpt/latest) or a step_NNNNNN folder: the run "
                   "continues there, in the folder that holds ckpt/")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every k steps (0: only at the end / Ctrl-C; -1: never)")
    g.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and init")
    add_advanced_flags(p)


def add_advanced_flags(p):
    """The flags fewer runs touch, grouped by what they change."""
    g = p.add_argument_group("advanced: model, engine and memory")
    g.add_argument("--engine", choices=["hf", "vllm"], default=None, help="rollout engine (preset: cpu hf, GPUs vllm)")
    g.add_argument("--shard", choices=["ddp", "fsdp"], default="ddp", help="under torchrun (support/dist.py): replicate the "
                   "trainer (DDP) or split weights, gradients and AdamW over the GPUs (FSDP2)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="forward compute dtype (params stay float32)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share of the whole GPU's memory")
    g.add_argument("--kv-cache-gb", type=float, default=None,
                   help="vLLM's KV cache size in GiB, fixed: skips vLLM's start-up memory profiling, which fails "
                        "when another process on the GPU allocates or frees memory meanwhile (a shared GPU)")
    g.add_argument("--sleep-level", type=_sleep_level, choices=[0, 1, 2, None], default=None,
                   metavar="{0,1,2,auto}", help="vLLM sleep between rollouts: 0 = off, 1 = weights to CPU, 2 = discarded; "
                   "auto (default): 0 when training fits beside the awake engine by the memory estimate, else 2")
    g.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="keep only each layer's input for backward and recompute the rest (~1/3 more compute)")
    g.add_argument("--offload-optimizer", action=argparse.BooleanOptionalAction, default=None,
                   help="keep AdamW's two moments in pinned host memory (8 bytes a parameter) except during its "
                        "update: the rollout and the forward/backward run without them, each step copies them "
                        "in and out (~0.3 s a step at 1.5B on an H100; options/memory.move_optimizer_state)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decoder layers and the LM head's scoring (options/memory.compile_model): "
                        "the first step compiles (~45-80 s at 1.5B on an H100), later ones train ~1.6x faster; "
                        "default: on with a GPU preset on one GPU, full-parameter")
    g.add_argument("--logprob-chunk", type=int, default=None,
                   help="LM head over this many tokens at a time, recomputed in backward (0: full logits; score.py)")
    g.add_argument("--sync-check-every", type=int, default=10, help="vLLM: check engine vs trainer logprobs on every "
                   "k-th weight sync (1: every sync; the first, and any that changes the copy plan, always are)")
    g.add_argument("--rollout-quant", choices=["none", "fp8", "int8"], default="none",
                   help="vLLM rollouts with fp8 or int8 (W8A8) weights, re-quantized every sync (FlashRL; options/quant.py)")
    g = p.add_argument_group("advanced: LoRA (options/lora.py)")
    g.add_argument("--lora-alpha", type=float, default=32.0, help="adapter scale alpha (the update is alpha/r B A)")
    g.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="comma-separated names of the linear layers to adapt")
    g.add_argument("--save-merged", action="store_true", help="LoRA: also write OUT/merged, a plain HF folder")
    g = p.add_argument_group("advanced: env and data")
    g.add_argument("--digits", default=None, help="multiply: digits of each factor, N (N x N) or A,B (e.g. 2,1: "
                   "2-digit x 1-digit; generated rows)")
    g.add_argument("--fewshot", type=int, default=None, help="generated rows: worked examples put before each question (multiply: up to 4; mcp: 0 or 1 tool-call demo)")
    g.add_argument("--format-reward", type=float, default=None, help="reward for a well-formed but wrong answer (every env)")
    g.add_argument("--max-turns", type=int, default=None, help="policy turns per episode (default: env's; mcp 8, others 1)")
    g.add_argument("--tool-format", default="auto", help="mcp: how the model writes tool calls: auto (from its chat "
                   "template), hermes, qwen3-xml, llama3-json or mistral (mcp_tools/formats.py)")
    g.add_argument("--tool-error-penalty", type=float, default=0.0, help="mcp: an episode, right or wrong, loses this "
                   "much per failed tool call, at most 0.5 (mcp_tools/env.py; 0: failed calls are free)")
    g.add_argument("--tool-error-cap", type=float, default=2.0, help="mcp: the most --tool-error-penalty takes from a "
                   "wrong episode (a correct one loses at most 0.5, so it always beats a wrong one; mcp_tools/env.py: why 2)")
    g.add_argument("--max-error-steps", type=int, default=3, help="stop, with a checkpoint, after this many steps in a "
                   "row in which every episode ended in an error (e.g. MCP servers down; 0: never)")
    add_algorithm_flags(p)
    g = p.add_argument_group("advanced: logging")
    g.add_argument("--tensorboard", action="store_true", help="also log to OUT/tb (needs the tensorboard package)")
    g.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to Weights & Biases (needs wandb)")
    g.add_argument("--viewer-groups", type=int, default=4, help="groups per step shown in OUT/episodes.html (support/viewer.py; 0: none)")


def add_algorithm_flags(p):
    """The algorithm's knobs (grpo.py), sampling and optimisation."""
    g = p.add_argument_group("advanced: algorithm (grpo.py)")
    g.add_argument("--reduction", choices=REDUCTIONS, default=None, help="how per-token losses become a scalar (default per --algo)")
    g.add_argument("--clip-low", type=float, default=None, help="eps_low (default per --loss)")
    g.add_argument("--clip-high", type=float, default=None, help="eps_high (default per --loss; dapo+ppo: 0.28)")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus c: the loss gets - c x the token "
                   "entropy of the sequences that train (0: none; options/entropy.py has the other remedies)")
    g.add_argument("--clip-cov", type=float, nargs=3, default=[2e-4, 1.0, 5.0], metavar=("FRAC", "LOW", "HIGH"),
                   help="--loss clip-cov: take a random FRAC of the tokens whose logp-advantage covariance is in "
                        "(LOW, HIGH) out of the gradient (options/entropy.clip_cov_loss; verl's and SkyRL's defaults)")
    g.add_argument("--kl-cov", type=float, nargs=2, default=[2e-4, 1.0], metavar=("FRAC", "COEF"),
                   help="--loss kl-cov: the FRAC of the tokens with the largest logp-advantage covariance pay COEF "
                        "|logp - old logp| (options/entropy.kl_cov_loss; verl's defaults; needs several updates a step: "
                        "--ppo-epochs 2 or --mini-batch-size below prompts x n; TIS adds none)")
    g.add_argument("--kl-type", choices=["k1", "k2", "k3"], default="k3", help="KL estimator")
    g.add_argument("--old-logprobs", choices=["rollout", "recompute", "detach"], default=None,
                   help="PPO's old logprobs: the engine's, a no-grad trainer forward before the update, or the training "
                        "forward's own, detached (exactly on-policy: one epoch, one mini-batch; no extra forward)")
    g.add_argument("--tis-cap", type=float, default=None, help="truncated importance sampling cap C (0: off; "
                   "default 2 with --rollout-quant, else 0; needs --old-logprobs recompute, its default then)")
    g.add_argument("--tis-mode", choices=["truncate", "mask"], default="truncate",
                   help="truncate: w = min(ratio, C); mask: a token whose ratio is outside [1/C, C] is "
                        "dropped from the loss mask: no loss, KL or entropy, and out of every denominator")
    g.add_argument("--overlong-buffer", type=int, default=None, help="DAPO soft overlong punishment buffer in tokens (0: off; dapo: max_tokens/4)")
    g.add_argument("--overlong-filter", action="store_true", help="mask truncated (finish=length) episodes out of the loss")
    g.add_argument("--gamma", type=float, default=1.0, help="discount (reinforce++, gae)")
    g.add_argument("--lam", type=float, default=0.95, help="gae: GAE's lambda (1: Monte Carlo returns, 0: one-step TD)")
    g.add_argument("--ref-update-every", type=int, default=0, help="copy the policy into the KL reference every K steps (0: never)")
    g.add_argument("--rescue", default=None, metavar="SPEC", help="hint=S: an all-wrong group is sampled again with its oracle "
                   "calls as a plan in the prompt (fewer over S steps; trained without it; guide=tiers: from one call up "
                   "while all wrong; guide=prefix: played as masked turns; a guided group that passes joins the all-wrong "
                   "one, one baseline over both; baseline=own: it replaces it); credit=W: a wrong answer earns W x the share "
                   "of oracle calls it made in order (measured: no gain beside hint); e.g. hint=600; source=answer: rows without oracle "
                   "calls, the gold answer as the hint (options/rescue.py; replay=K: solved rows asked again K steps on; probe=F: after a listing call none made; told=1: the probes told the answer; narrow=N: a number answer found only in a result of <= N numbers, after a call not made up). Default: off, but hint=3xSTEPS,source=answer+similar,"
                   "branch=0.5 for --env mcp rows that carry no oracle calls; off: --rescue off")
    g = p.add_argument_group("advanced: sampling")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0; logprobs use it too)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (keep 1.0 for RL: the trainer's logprobs are "
                   "the full distribution's; < 1 rules out --tis-cap and --old-logprobs rollout)")
    g.add_argument("--ignore-eos", action="store_true", help="every turn samples --max-tokens tokens, past EOS and "
                   "stop tokens: a memory worst case (lab/bench.py --memory-table), not for training")
    g = p.add_argument_group("advanced: optimisation")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear LR warmup, in optimizer updates")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0: off)")
    g.add_argument("--ppo-epochs", type=int, default=1, help="passes over each step's batch")
    g.add_argument("--mini-batch-size", type=int, default=None, help="episodes per optimizer update (default: the whole batch)")
    g.add_argument("--micro-batch-size", type=int, default=None, help="episodes per forward/backward (and see --micro-batch-tokens)")
    g.add_argument("--micro-batch-tokens", type=int, default=None, help="token budget per forward/backward: episodes sorted "
                   "by length and packed while count x longest <= budget (0: fixed --micro-batch-size; default: "
                   "--micro-batch-size x --max-context, the memory the estimate plans for)")
    g.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="compute a micro-batch's shared prefix (a group's prompt, the MCP tool block) once, in one "
                   "packed row under a block mask, where that halves its tokens: same gradient (options/prefix.py); "
                   "--micro-batch-tokens then counts the packed tokens")


def parse_args(argv=None, fits=None):
    """Every flag decided: parsed, then the derived defaults, then the conflicts (an error naming
    the flags). fits(args, lora_rank, awake=False, headroom=1.0) -> bool is the memory estimate on a
    GPU preset (fits_this_gpu; train.py passes it); without it the auto choices take the safe
    side: full-parameter training and a sleeping engine."""
    p = Parser(usage="python train.py [--gpu PRESET] [--env ENV] [--model M] [FLAG ...]",
               description="nanoRL: RL for chat LLMs (train.py's docstring says what a step does). "
                           "The flags most runs set come first; the groups marked advanced hold the rest.")
    add_flags(p)
    args = p.parse_args(argv)
    if args.resume:
        resumed(args, argv)
    on_policy, one_update = derive_defaults(args, fits)
    if args.out_dir is None:  # --resume of a step folder outside any run's ckpt/: nowhere to continue
        p.error(f"--resume {args.resume}: a checkpoint outside a run folder's ckpt/; name the folder the run "
                "continues in with --out-dir")
    check_conflicts(p, args, on_policy, one_update)
    check_paths(args)
    return args


def resumed(args, argv):
    """--resume: each flag not given again takes the saved run's value, derived ones too, so the run
    goes on as it was (an older checkpoint's missing flags keep their defaults); where it writes
    does not (--out-dir: the resumed folder). Given flags win; those that differ from the saved
    value, RESUME_FREE aside, are named in one line. A saved value that an override would have
    derived otherwise (--mini-batch-size from --prompts-per-step) stays: give it too."""
    saved = saved_config(args.resume)
    given = Parser(add_help=False)  # the flags argv names: a parser with no defaults at all
    add_flags(given)
    for a in given._actions:
        a.default = argparse.SUPPRESS
    given = vars(given.parse_args(argv))
    for k in (set(vars(args)) & set(saved)) - set(given) - {"resume", "out_dir"}:
        setattr(args, k, saved[k])
    changed = [f"--{k.replace('_', '-')} {given[k]} (saved {saved[k]})" for k in given  # str: --digits 1 is 1
               if k in saved and str(given[k]) != str(saved[k]) and k not in RESUME_FREE and given[k] not in (None, "auto")]
    if changed:
        print(f"--resume {args.resume}: these flags override the saved run's: {', '.join(changed)}")


def check_paths(args):
    """Files and folders the flags name that cannot work, found now rather than after the model
    loads: a FileNotFoundError / FileExistsError naming the flag and the path (train.cli: one line)."""
    if args.mcp_config and not os.path.isfile(args.mcp_config):
        raise FileNotFoundError(f"--mcp-config {args.mcp_config}: file not found")
    for p in (Path(args.out_dir), *Path(args.out_dir).parents):  # the first that exists must be a folder
        if p.exists():
            if not p.is_dir():
                raise FileExistsError(f"--out-dir {args.out_dir}: {p} is a file, not a folder")
            break


def derive_defaults(args, fits):
    """Each flag still unset gets its value here, in this order; returns (on_policy, one_update):
    whether the run is exactly on-policy (one update per step on the whole batch, no TIS) and
    whether it makes one update per step on the whole batch (TIS or not)."""
    for k, v in preset_for(args.gpu, args.env).items():
        if getattr(args, k) is None and k != "lr":
            setattr(args, k, v)
    if args.out_dir is None:  # a resumed run continues where it is (None: a stray step folder, parse_args' error)
        args.out_dir = run_folder(args.resume) if args.resume else "runs/nanorl"
    if args.lora_rank is None:  # full-parameter where it fits this GPU by options/memory.py's estimate, else LoRA rank 32
        args.lora_rank = 0 if args.gpu == "cpu" or fits is None or fits(args, 0) else 32
        if fits is not None and args.gpu != "cpu":
            print(f"--lora-rank {args.lora_rank}: " + ("full-parameter training fits" if not args.lora_rank else
                  "full-parameter training does not fit this GPU, LoRA does (--lora-rank 0 to insist)"))
    if args.reduction is None:  # each paper's own: GRPO's per-sequence mean, Dr.GRPO's constant normaliser
        args.reduction = {"grpo": "seq-mean-token-mean", "drgrpo": "seq-mean-token-sum-norm"}.get(args.algo, "token-mean")
    args.dynamic_sampling = args.algo == "dapo"  # DAPO's dynamic sampling and soft overlong punishment
    if args.overlong_buffer is None:
        args.overlong_buffer = args.max_tokens // 4 if args.algo == "dapo" else 0
    lo, hi = CLIP[args.loss]
    args.clip_low = lo if args.clip_low is None else args.clip_low
    args.clip_high = (0.28 if args.algo == "dapo" and args.loss == "ppo" else hi) if args.clip_high is None else args.clip_high
    if args.tis_cap is None:  # FlashRL: quantized rollouts come with token-level TIS at cap 2
        args.tis_cap = 2.0 if args.rollout_quant != "none" else 0.0
    if args.lr is None:  # LoRA: ~10x the full-parameter LR ("LoRA Without Regret", Thinking Machines 2025)
        args.lr = preset_for(args.gpu, args.env)["lr"] * (10 if args.lora_rank else 1)
    args.critic_lr = 10 * args.lr  # gae: the critic's AdamW (verl: 1e-5 against the actor's 1e-6)
    if args.compile is None:  # a GPU preset, one GPU, full-parameter: where it was measured (not yet
        # under torchrun's DDP/FSDP2 wrapping, nor with LoRA's adapters in the layers)
        args.compile = args.gpu != "cpu" and int(os.environ.get("WORLD_SIZE", "1")) == 1 and not args.lora_rank
    if args.micro_batch_tokens is None:  # same worst case as micro-batch-size full-length episodes, more short ones
        args.micro_batch_tokens = args.micro_batch_size * args.max_context
    if args.mini_batch_size is None:  # one optimizer update per step
        args.mini_batch_size = args.prompts_per_step * args.n
    one_update = args.ppo_epochs == 1 and args.mini_batch_size >= args.prompts_per_step * args.n
    on_policy = one_update and not args.tis_cap
    if args.old_logprobs is None:  # the HF engine's logprobs are exact (same model, same kernels); vLLM's are not,
        # and exactly on-policy the trainer's old logprobs *are* the training forward's, ratio 1. With
        # --top-p < 1 neither is the sampling distribution (check_conflicts): the default avoids them.
        # TIS weighs by trainer / engine logprobs: it needs the trainer's own, recomputed
        exact = args.engine == "hf" and args.top_p >= 1.0 and not args.tis_cap
        args.old_logprobs = "rollout" if exact else "detach" if on_policy else "recompute"
    # vLLM is slower with sampled logprobs: ask only when something reads them (quantized rollouts:
    # the logprob_mismatch metric)
    args.rollout_logprobs = args.old_logprobs == "rollout" or args.tis_cap > 0 or args.rollout_quant != "none"
    if args.sleep_level is None:  # auto: the engine sleeps while training only when training needs its memory.
        # Awake saves a wake and a sleep (~75 ms a step; the sync then resets the prefix cache itself,
        # ~5 ms). 20% headroom on the estimate: an OOM mid-run costs far more than a sleep and a wake
        if args.engine != "vllm":
            args.sleep_level = 0  # the HF engine shares the trainer's weights: nothing to sleep
        else:
            awake = fits is not None and fits(args, args.lora_rank, awake=True, headroom=1.2)
            args.sleep_level = 0 if awake else 2
            if fits is not None:
                print(f"--sleep-level {args.sleep_level}: " + ("training fits beside the awake engine" if awake
                      else "the engine sleeps while training (its memory is needed)"))
    # progress bars on a terminal only, and on torchrun's rank 0 alone
    args.no_progress = not sys.stderr.isatty() or int(os.environ.get("RANK", "0")) > 0
    return on_policy, one_update


def check_conflicts(p, args, on_policy, one_update):
    """The flag combinations that cannot work: p.error names them (exit 2, one line)."""
    if args.steps < 0:
        p.error(f"--steps {args.steps}: want a number of steps >= 1 (0: only the eval before training and a checkpoint)")
    if not all(d.isdigit() and int(d) >= 1 for d in str(args.digits).split(",")) or str(args.digits).count(",") > 1:
        p.error(f"--digits {args.digits}: one number N >= 1 (N x N) or two, A,B")
    if args.engine == "vllm" and args.gpu == "cpu":
        p.error("--engine vllm needs a GPU preset (--gpu l40s|a100|h100|h200)")
    if args.ignore_eos and args.engine != "vllm":
        p.error("--ignore-eos needs the vLLM engine (a GPU preset)")
    for flag in ("entropy_coef", "tool_error_cap"):
        if getattr(args, flag) < 0 or not math.isfinite(getattr(args, flag)):
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: want a finite number >= 0")
    frac, low, high = args.clip_cov
    if not (0 <= frac <= 1 and low < high):
        p.error(f"--clip-cov {frac} {low} {high}: want FRAC in [0, 1] and LOW < HIGH")
    frac, coef = args.kl_cov
    if not (0 <= frac <= 1 and 0 <= coef < math.inf):
        p.error(f"--kl-cov {frac} {coef}: want FRAC in [0, 1] and a finite COEF >= 0")
    if args.loss == "kl-cov" and one_update:  # TIS or not: the one update's policy is the old one
        p.error("--loss kl-cov needs several updates a step (--mini-batch-size below prompts x n, or --ppo-epochs 2): "
                "with one update on the whole batch its |logp - old logp| term and gradient are 0")
    if not 0.0 <= args.tool_error_penalty <= 0.5:
        p.error(f"--tool-error-penalty {args.tool_error_penalty}: want 0..0.5 a failed call")
    if args.rollout_quant != "none" and args.engine != "vllm":
        p.error("--rollout-quant needs the vLLM engine (a GPU preset)")
    if args.old_logprobs == "detach" and not on_policy:
        p.error("--old-logprobs detach needs exactly one update per step on the whole batch "
                "(--ppo-epochs 1, --mini-batch-size >= prompts x n) and no --tis-cap")
    if args.tis_cap > 0 and args.old_logprobs != "recompute":
        p.error("--tis-cap needs --old-logprobs recompute (with rollout logprobs the weight is 1)")
    if args.ref_update_every and (args.kl_coef <= 0 or args.lora_rank):
        p.error("--ref-update-every moves the KL reference: it needs --kl-coef > 0 and full-parameter training "
                "(LoRA's reference is its frozen base)")
    if not 0.0 < args.top_p <= 1.0:
        p.error(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.top_p < 1.0 and (args.tis_cap > 0 or args.old_logprobs == "rollout"):
        # the engine samples from the top-p truncated distribution; the trainer's logprobs are the full
        # one's, and so are HFEngine's (vLLM's processed_logprobs are the truncated one's): either way
        # exp(logp_trainer - logp_engine) is not the ratio of the policies the tokens came from
        what = ("--old-logprobs rollout" if args.tis_cap <= 0 else
                "--tis-cap (2 by default with --rollout-quant)" if args.rollout_quant != "none" else "--tis-cap")
        p.error(f"--top-p {args.top_p} with {what}: top-p samples from a truncated distribution that the "
                "trainer's logprobs (the full one's) do not describe, so the importance ratio is biased; "
                "keep --top-p 1 for RL")
    try:
        rescue.parse(args.rescue or "")
    except ValueError as e:
        p.error(str(e))
    if args.rescue is not None and args.rescue.strip() == "off":  # off, and no default for rows without oracle calls
        args.rescue = ""
    if args.temperature <= 0:
        p.error("--temperature must be > 0 for training (greedy is used for eval only)")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's processes (support/dist.py)
    if world > 1:
        if args.prompts_per_step % world or args.mini_batch_size % world:
            p.error(f"torchrun with {world} processes: --prompts-per-step ({args.prompts_per_step}) and "
                    f"--mini-batch-size ({args.mini_batch_size}) must be multiples of {world} (whole prompts per rank)")
        if args.shard == "fsdp" and args.offload_optimizer:
            p.error("--offload-optimizer with --shard fsdp: not supported (FSDP2 shards AdamW over the GPUs instead)")
        if args.shard == "fsdp" and (args.engine == "hf" or args.lora_rank):
            p.error("--shard fsdp needs the vLLM engine (the HF engine would sample with the sharded trainer) and "
                    "full-parameter training (--lora-rank 0: LoRA's adapters are not sharded or merged under FSDP2)")
    if min(args.max_tokens, args.max_context, args.n, args.prompts_per_step, args.micro_batch_size) < 1:
        p.error("--max-tokens, --max-context, --n, --prompts-per-step and --micro-batch-size must be >= 1")


def require_cuda(gpu):
    """A GPU preset on a machine without CUDA: one SetupError line (train.py, eval.py, the estimate)."""
    if gpu != "cpu" and not torch.cuda.is_available():
        raise SetupError(f"--gpu {gpu} but CUDA is not available here (use --gpu cpu)")


def fits_this_gpu(args, lora_rank, awake=False, headroom=1.0, fail=False):
    """memory.fits_gpu for these flags (the estimate printed; fail=True: a clear error instead of False)."""
    require_cuda(args.gpu)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return memory.fits_gpu(model_source(args.model), lora_rank, dtype, args.kl_coef,
                           args.gpu_memory_utilization if args.engine == "vllm" else 0.0, args.micro_batch_size,
                           args.max_context, args.grad_checkpointing, args.logprob_chunk, critic=args.algo == "gae",
                           shard=world if args.shard == "fsdp" else 1, awake=awake, headroom=headroom, fail=fail,
                           offload=args.offload_optimizer, micro_batch_tokens=args.micro_batch_tokens,
                           ref_shard=world if args.shard == "fsdp" and not args.ref_update_every else 1,  # dist.shard_reference
                           lora_alpha=args.lora_alpha, lora_targets=args.lora_targets.split(","))
