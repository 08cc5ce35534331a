r"""
A peer benchmark: TRL's GRPOTrainer and nanoRL's train.py on the same GRPO config, on one GPU, one
after the other, each in its own process (so neither inherits the other's CUDA context, allocator
or vLLM engine).

Run from the repository root:

    python lab/trl_bench.py --config smollm2     --data GSM8K.jsonl --out runs/trl-smollm2.json
    python lab/trl_bench.py --config qwen-capped --data GSM8K.jsonl --out runs/trl-qwen.json
    python lab/trl_bench.py --no-vllm --model TINY_DIR --data GSM8K.jsonl --steps 2 --skip-steps 1 \
        --prompts 2 --n 2 --max-tokens 16      # CPU wiring check (below); not a benchmark

What it prints (a markdown table; the same numbers, the per-step lists and each side's settings as
JSON in --out, rewritten after each side so a killed run keeps the side that finished):
  - s/step: the median over the steps after --skip-steps (default 2 of --steps 8) of a step's wall
    time, one step = one optimizer update on P prompts x n completions (32 x 8), counted from the
    end of the previous step to the end of this one, so generation, the weight sync, sleep/wake,
    rewards, forward/backward, AdamW and the trainer's own logging are all in it. Ours: train.py's
    metrics.jsonl "step_time_s" (that definition). TRL: a TrainerCallback that takes the clock at
    on_train_begin and at each on_step_end (after a device sync; transformers calls it right after
    optimizer.step()); the on_step_begin -> on_step_end part is kept too ("in_step_s": it leaves
    out the data loader's fetch and the previous step's logging, which transformers runs outside it).
  - peak device memory: this process polls cudaMemGetInfo every --poll-s (0.2 s) while a side runs,
    and reports the peak of (used - used when the side started): the side's whole footprint (CUDA
    context, vLLM's pool, which torch's allocator stats miss, the trainer), without this process's
    context and the hog. A 0.2 s poll can miss a peak shorter than that, on both sides alike.
  - the ratios: TRL s/step / ours (> 1: ours is faster), ours peak / TRL peak (< 1: ours is smaller).
  - per side also: mean completion tokens and mean reward over the same steps (the step's work
    depends on how long the completions are), the process's wall time; a side that fails (an OOM
    under the cap, a timeout of --side-timeout s) shows its error line instead, and the other side
    still runs. The full output of each side is in OUT.{trl,ours}.log (or a temp folder, printed).

The memory cap (qwen-capped): exactly lab/bench.py's memory_table and headline.sh's capped (lab/recipes): this
process makes its CUDA context, then holds a "hog" tensor of all the free memory but CAP GiB for
the whole run, so each side finds CAP GiB free (an L40S's usable ~45 GiB), and vLLM's share is given
as a fraction of the whole H100 (0.3 x 48 GB on an L40S = 0.17 x 80 GB; on another GPU, the share that
gives vLLM the same memory: lab/capped.py's share_here, 0.096 of an H200).

The configs (the settings the two sides share are set on both; the rest is each side's default)

  shared: GSM8K train rows (--data), the system prompt and chat template train.py renders for
  gsm8k (envs.GSM8K_SYSTEM_PROMPT in the row, the tokenizer's template with add_generation_prompt;
  TRL renders the same messages with the same template), 32 prompts x 8 completions a step, one
  generation round and one optimizer update per step, temperature 1, top_p 1, lr 1e-6, no KL, no
  eval, full-parameter AdamW on fp32 weights under bf16 autocast (TRL: its default model dtype
  float32 + bf16=True; ours: the GPU presets' --dtype bfloat16 autocast), grad-norm clip 1.0, PPO
  clip 0.2 (TRL epsilon; ours --loss ppo), the vLLM engine in the trainer's process with a 2048-token
  context (ours --max-context 2048 from the presets; TRL vllm_max_model_length=2048) and vLLM's
  prefix cache, and one reward rule: envs.gsm8k_reward (last \boxed{} else last ####, exact match
  after normalisation), which the TRL side calls through a reward function on the decoded
  completion (skip_special_tokens=True, as rollout.decode_many decodes ours). Turns stop at the
  template's end-of-turn token on both sides: TRL stops at the model's EOS ids, and the script adds
  rollout.stop_token_ids(tokenizer) as vLLM stop_token_ids (generation_kwargs), which is what
  train.py passes (for a folder whose tokenizer calls <|im_start|> its EOS, as a GGUF conversion can).

  smollm2 (SmolLM2-135M-Instruct, $SMOLLM2_DIR): <= 256 completion tokens, each side at its own
  defaults for an 80 GB card.
    ours: train.py --gpu h100 --gpu-memory-utilization 0.3 (the flags of lab/bench.py's
          STEP_CONFIGS["gsm8k"], the config of docs/results.md's step table): micro-batches of 8,
          no grad checkpointing, full logits, --sleep-level auto (stays awake when training fits
          beside the engine by options/memory.py's estimate), old logprobs = the training forward's own
          (exactly on-policy: no extra forward), no engine logprobs, --compile.
    TRL:  GRPOConfig(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
          vllm_gpu_memory_utilization=0.3 (its default), bf16=True, gradient_checkpointing=True
          (TRL's default), per_device_train_batch_size=8 (TrainingArguments' default),
          gradient_accumulation_steps=32): 8 x 32 = 256 = 32 x 8 completions per update.
  qwen-capped (Qwen2.5-Coder-1.5B-Instruct, $QWEN_DIR, bf16 HF folder) under a 45 GiB cap: <= 512
  completion tokens, gradient checkpointing on both sides, vLLM at 0.17 of the H100 sleeping while
  training on both sides (TRL sleeps at level 2; ours --sleep-level 2, which auto picks for 1.5B).
    ours: train.py --gpu l40s --gpu-memory-utilization 0.17 --max-tokens 512 --sleep-level 2
          (the l40s preset's micro-batches of 4, grad checkpointing, --logprob-chunk 1024,
          --compile).
    TRL:  the smollm2 settings with vllm_gpu_memory_utilization=0.17, max_completion_length=512,
          gradient_checkpointing=True, per_device_train_batch_size=4, gradient_accumulation_steps=64.
  Both configs, ours also: --lora-rank 0 (full-parameter, as TRL; auto could pick LoRA where the
  estimate says full does not fit the cap), --eval-every 0, --save-every -1 (lab/bench.py's step
  table runs the same); TRL also: logging_steps=1
  (per-step reward and lengths for the JSON), save_strategy="no", report_to="none", disable_tqdm.

  How TRL 1.16 makes one step = one generation round of 32 x 8 (grpo_config.py __post_init__,
  grpo_trainer.py _prepare_inputs, read in the 1.16.0 wheel): with generation_batch_size and
  steps_per_generation unset, steps_per_generation = gradient_accumulation_steps and
  generation_batch_size = per_device_train_batch_size x steps_per_generation = 256 completions, i.e.
  256 / num_generations = 32 prompts; the data loader yields that batch (32 prompts, each repeated
  8 times) once per micro-batch of the update, and _prepare_inputs generates from the first only
  (at _step % steps_per_generation == 0), then serves the buffered completions in 32 (64)
  micro-batches of 8 (4): one generation round, one optimizer.step().
  TRL's vLLM runs max_num_seqs = 256, max_num_batched_tokens 4096, logprobs_mode
  "processed_logprobs", in the trainer's process (distributed_executor_backend "external_launcher").

  Defaults that differ, kept as each side's own (they are what a user of each gets):
    - TRL's vllm_importance_sampling_correction=True (mode sequence_mask, clip 3): vLLM returns the
      sampled tokens' logprobs and TRL runs a no-grad forward over all 256 sequences for the old
      logprobs; ours needs neither (--old-logprobs detach, no --tis-cap).
    - loss aggregation: TRL loss_type "dapo" (token-mean over the update's tokens), ours --algo
      grpo's seq-mean-token-mean; the same tensors, a different sum (no cost difference).
    - TRL's sleep mode: level 2 after each generation, weights re-pushed one tensor at a time
      through vLLM's model.load_weights; ours: a recorded copy plan (sync.py), and in smollm2 no
      sleep at all (auto). TRL's lr schedule decays linearly to 0 over --steps, ours is constant
      (no effect on time).
    - data order: each side shuffles the rows its own way, so the prompts of step k differ; the
      completion-token column shows how comparable the steps' work was.
    - ours compiles the trainer's layers and LM-head scoring (--compile, the GPU presets' default;
      TRL's torch_compile defaults to False). The compiling lands in the first step that trains:
      in qwen-capped step 1, a warm-up step; in smollm2, where groups with a reward are rare, it
      can land inside the measured steps (each step's time is in the table: read it there).

On a GPU machine without network (vLLM 0.26.0 installed as for train.py, here into /tmp/site, and
the environment train.py's GPU runs use, e.g. VLLM_USE_FLASHINFER_SAMPLER=0 where flashinfer is not
installed: both sides' processes inherit it):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/trl-site .whl/*.whl
    export PYTHONPATH=/tmp/site:/tmp/trl-site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    python lab/trl_bench.py --config smollm2 --model $SMOLLM2_DIR --data DIR/train.jsonl --out $OUT/trl-smollm2.json
  --data: official GSM8K ({"question", "answer"} a line, converted here with data/gsm8k.py's
  convert_split, so the ground truth is the normalised number after '####') or train.py's rows
  (data/out/gsm8k/train.jsonl, the default); ours reads the converted file as --train-data (and
  as --eval-data, which train.py loads even with --eval-every 0), TRL a datasets.Dataset of its
  rows' "prompt" messages and ground truths. Where a command's time is limited, run the sides
  apart (--sides trl, --sides ours; one --out each) or bound each one with --side-timeout.

The wheels (.whl/, git-ignored; 2,298,019 bytes = 2.2 MiB), for `import trl, datasets` beside the
packages the GPU image already has (each wheel's Requires-Dist checked against the image's list):
    trl-1.16.0-py3-none-any.whl                  926 KB  the trainer measured
    datasets-5.2.0-py3-none-any.whl              594 KB  trl imports it; GRPOTrainer wants a datasets.Dataset
    multiprocess-0.70.19-py312-none-any.whl      147 KB  datasets (< 0.70.20); not in the image
    dill-0.4.1-py3-none-any.whl                  117 KB  datasets (>= 0.3, < 0.4.2), multiprocess (>= 0.4.1);
                                                         not in the image (the vLLM bundle carries the same 0.4.1)
    xxhash-4.1.0-cp312-...manylinux_2_28.whl     461 KB  datasets; the image has an xxhash too: optional
  Taken from the image: accelerate (1.15.0; trl >= 1.10.1), transformers (5.17.0; trl >= 4.56.2),
  huggingface-hub (1.33.0; datasets >= 1.31, < 3), pandas, pyarrow (datasets >= 24.0.0: its
  version there is not recorded; datasets 5.2 does not check it at import), fsspec (datasets
  <= 2026.9.0, likewise unchecked at import), numpy, psutil, pyyaml, jinja2, requests, tqdm,
  filelock, packaging, and peft (trl imports it when present). No pyarrow wheel (~40 MB) is
  carried: the image has pyarrow.
  vLLM coupling (trl/import_utils.py is_vllm_available): TRL 1.16 only *warns* outside vLLM
  0.22.0-0.31.0, and 0.26.0 is inside; with vLLM < 0.28 trl/generation/vllm_client.py imports
  vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferEngine and
  vllm.utils.network_utils.get_ip (present in 0.26.0), and colocate mode uses
  llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights, LLM.sleep(level=2),
  LLM.wake_up(tags=["weights"] / ["kv_cache"]) and LLM.reset_prefix_cache (all in 0.26.0: the
  engine core runs in process under external_launcher). So the script pins nothing and patches
  nothing; it records the versions each run used.

CPU wiring check (--no-vllm; no vLLM, no GPU needed): TRL generates with transformers' generate,
ours runs the cpu preset (HF engine); both on a tiny model: it checks the dataset, the reward
function, the step clock, the result files and the table, not speed.
"""
import argparse
import contextlib
import importlib.metadata
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the course modules live one folder up

# ---- the two configs: what differs between them; the settings both share are in ours_cmd / trl_side
CONFIGS = {
    "smollm2": dict(model_env="SMOLLM2_DIR", fallback="smollm2", cap_gib=None, max_tokens=256, vllm_share=0.3,
                    ours=["--gpu", "h100"],  # --sleep-level auto, as STEP_CONFIGS["gsm8k"]
                    trl={}),  # TRL's own: batch 8 (TrainingArguments), gradient checkpointing on (TRL)
    "qwen-capped": dict(model_env="QWEN_DIR", fallback=None, cap_gib=45, max_tokens=512, vllm_share=0.17,
                        ours=["--gpu", "l40s", "--sleep-level", "2"],
                        trl=dict(per_device_train_batch_size=4, gradient_checkpointing=True)),
}
MAX_CONTEXT = 2048  # the GPU presets' --max-context; TRL's vllm_max_model_length
TRL_KEYS = ["per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
            "num_generations", "max_completion_length", "learning_rate", "lr_scheduler_type", "beta", "loss_type",
            "scale_rewards", "epsilon", "epsilon_high", "num_iterations", "max_grad_norm", "optim", "bf16",
            "gradient_checkpointing", "temperature", "top_p", "use_vllm", "vllm_mode", "vllm_enable_sleep_mode",
            "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode", "generation_kwargs", "logging_steps"]
NAMES = {"trl": "TRL GRPOTrainer", "ours": "nanoRL train.py"}


# ---- the TRL side (runs in its own process: this script with --child trl)

def trl_side(args):
    """GRPOTrainer on the config; writes the step clock, the log history and the settings to --child-out."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from support import rows
    from envs import gsm8k_reward
    from rollout import stop_token_ids

    cfg, cuda = CONFIGS[args.config], torch.cuda.is_available() and not args.no_vllm
    data = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": str(r["reward_spec"]["ground_truth"])}
                              for r in rows.load_rows(args.rows)])

    def gsm8k(completions, ground_truth, **kwargs):  # TRL passes dataset columns by name; logged as rewards/gsm8k
        return [gsm8k_reward(c[0]["content"], gt)[0] for c, gt in zip(completions, ground_truth)]

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t0, self.begin, self.end = time.perf_counter(), [], []

        def on_step_begin(self, *a, **k):
            self.begin.append(time.perf_counter())

        def on_step_end(self, *a, **k):  # transformers 5.x: right after optimizer.step() and zero_grad
            if cuda:
                torch.cuda.synchronize()  # the step's kernels are done; nothing of it spills into the next
            self.end.append(time.perf_counter())

    completions = args.prompts * args.n  # per optimizer update = per generation round (module doc)
    batch = min(cfg["trl"].get("per_device_train_batch_size", 8), completions)  # 8: TrainingArguments' default
    if completions % batch:
        raise SystemExit(f"{args.prompts} x {args.n} completions do not split into TRL micro-batches of {batch}")
    settings = dict(cfg["trl"], per_device_train_batch_size=batch, gradient_accumulation_steps=completions // batch)
    tok = AutoTokenizer.from_pretrained(args.model)
    conf = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-"), max_steps=args.steps, num_generations=args.n,
                      max_completion_length=args.max_tokens, learning_rate=1e-6, beta=0.0, temperature=1.0, top_p=1.0,
                      use_vllm=not args.no_vllm, vllm_mode="colocate", vllm_enable_sleep_mode=True,
                      vllm_gpu_memory_utilization=args.vllm_share, vllm_max_model_length=MAX_CONTEXT,
                      # train.py's stop rule (rollout.stop_token_ids); vLLM SamplingParams only
                      generation_kwargs=None if args.no_vllm else {"stop_token_ids": stop_token_ids(tok)},
                      bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to="none",
                      disable_tqdm=True, seed=args.seed, **settings)
    clock = StepClock()
    trainer = GRPOTrainer(model=args.model, reward_funcs=gsm8k, args=conf, train_dataset=data, callbacks=[clock])
    trainer.train()
    ends = clock.end
    res = {"step_s_all": [b - a for a, b in zip([clock.t0] + ends[:-1], ends)],
           "in_step_s_all": [e - b for b, e in zip(clock.begin, ends)],
           "settings": {k: getattr(conf, k) for k in TRL_KEYS},
           "torch_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "log_history": trainer.state.log_history}
    with open(args.child_out, "w") as f:
        json.dump(res, f, indent=1, default=str)


# ---- our side: train.py as a user runs it

def ours_cmd(args, cfg, out_dir):
    device = ["--gpu", "cpu"] if args.no_vllm else cfg["ours"] + ["--gpu-memory-utilization", str(args.vllm_share)]
    return [sys.executable, "train.py", *device, "--env", "gsm8k", "--model", args.model,
            "--train-data", args.rows, "--eval-data", args.rows, "--steps", str(args.steps),
            "--prompts-per-step", str(args.prompts), "--n", str(args.n), "--max-tokens", str(args.max_tokens),
            "--max-context", str(MAX_CONTEXT), "--temperature", "1", "--top-p", "1", "--lr", "1e-6",
            "--kl-coef", "0", "--lora-rank", "0", "--eval-every", "0", "--save-every", "-1",
            "--seed", str(args.seed), "--out-dir", out_dir, *shlex.split(args.ours_flags)]


def ours_result(out_dir):
    """train.py's per-step metrics (metrics.jsonl rows with a step time)."""
    path = Path(out_dir) / "metrics.jsonl"
    steps = [r for r in map(json.loads, path.open()) if "step_time_s" in r] if path.exists() else []
    return {"step_s_all": [r["step_time_s"] for r in steps], "reward_all": [r.get("reward_mean") for r in steps],
            "completion_tokens_all": [r.get("response_tokens") for r in steps]}


def trl_result(path):
    res = json.load(open(path))
    logs = {h["step"]: h for h in res["log_history"] if "reward" in h}  # one per step (logging_steps=1)
    steps = sorted(logs)
    res["reward_all"] = [logs[s]["reward"] for s in steps]
    res["completion_tokens_all"] = [logs[s].get("completions/mean_length") for s in steps]
    return res


# ---- the parent: data, the cap, one subprocess per side, the memory poll, the table

def gsm8k_rows(path, tmp):
    """path if it holds train.py's rows; official GSM8K jsonl converted to them (data/gsm8k.py's rule)."""
    from support import rows
    with open(path) as f:
        first = json.loads(next(line for line in f if line.strip()))
    if "prompt" in first:
        return path
    if not (isinstance(first, dict) and "question" in first and "answer" in first and path.endswith(".jsonl")):
        raise SystemExit(f"--data {path}: want train.py's rows or the official GSM8K .jsonl ({{question, answer}} a line)")
    from data.gsm8k import convert_split  # data/ is a folder of scripts, imported as a namespace package
    out = os.path.join(tmp, "gsm8k-rows.jsonl")
    rows.save_rows(convert_split(str(Path(path).parent), Path(path).stem), out)
    return out


def used_bytes():
    import torch
    free, total = torch.cuda.mem_get_info()
    return total - free


def settle(base, timeout_s=60):
    """Wait (up to timeout_s) until the device is back to base: the last side's process is gone with its memory."""
    t0 = time.perf_counter()
    while used_bytes() - base > 2**30 and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.5)


def error_line(log_path):
    lines = [ln.strip() for ln in Path(log_path).read_text(errors="replace").splitlines() if ln.strip()]
    hit = next((ln for ln in reversed(lines) if "Error" in ln or ln.startswith("error:")), None)
    return (hit or (lines[-1] if lines else "no output")).removeprefix("error: ")[:300]


def run_side(side, args, gpu, log_path):
    """One side in its own process group; its result dict (step times, peak memory) or its error line."""
    tmp = tempfile.mkdtemp(prefix=f"trl-bench-{side}-")
    out = os.path.join(tmp, "trl.json")  # the TRL child's results (ours: tmp is train.py's --out-dir)
    if side == "trl":
        cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv(args), "--child", "trl", "--child-out", out]
    else:
        cmd = ours_cmd(args, CONFIGS[args.config], tmp)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # no hub on the GPU machine: an id fails at once, not after retries
    base = used_bytes() if gpu else 0
    row = {"side": side, "cmd": cmd, "log": str(log_path)}
    t0 = time.perf_counter()
    from capped import PeakMemory  # lab/capped.py (this folder is on sys.path when run as a script)
    with open(log_path, "w") as log, (PeakMemory(args.poll_s) if gpu else contextlib.nullcontext()) as peak:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=args.side_timeout or None)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the side's own process group (start_new_session), nothing else
            p.wait()
            rc = None
    row.update(wall_s=time.perf_counter() - t0, rc=rc, peak_gib=(peak.peak - base) / 2**30 if gpu else None)
    if side == "ours" or os.path.exists(out):  # a failed run's steps before it stopped stay in the JSON
        row.update(trl_result(out) if side == "trl" else ours_result(tmp))
    if rc != 0 or not row.get("step_s_all"):
        row["error"] = f"timeout after {args.side_timeout:.0f} s" if rc is None else error_line(log_path)
        return row
    k = args.skip_steps if len(row["step_s_all"]) > args.skip_steps else 0
    mean = lambda xs: sum(xs) / len(xs) if xs and None not in xs else None  # noqa: E731
    row.update(steps=f"{k + 1}-{len(row['step_s_all'])}", step_s=statistics.median(row["step_s_all"][k:]),
               reward=mean(row["reward_all"][k:]), completion_tokens=mean(row["completion_tokens_all"][k:]))
    if side == "trl":
        row["in_step_s"] = statistics.median(row["in_step_s_all"][k:])
    return row


def child_argv(args):
    """The flags that make the TRL child see the parent's resolved config."""
    argv = ["--config", args.config, "--model", args.model, "--rows", args.rows, "--steps", str(args.steps),
            "--prompts", str(args.prompts), "--n", str(args.n), "--max-tokens", str(args.max_tokens),
            "--seed", str(args.seed), "--vllm-share", str(args.vllm_share)]
    return argv + (["--no-vllm"] if args.no_vllm else [])


def versions():
    out = {}
    for name in ("trl", "datasets", "vllm", "transformers", "accelerate", "torch"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def markdown(res):
    cap = f"{res['cap_gib']} GiB cap" if res["cap_gib"] else "no memory cap"
    v = res["versions"]
    lines = [f"### {res['config']}: {Path(res['model']).name}, {res['gpu']}, {cap}, {res['date']}", "",
             f"trl {v['trl']}, vLLM {v['vllm']}, transformers {v['transformers']}, torch {v['torch']}; "
             f"{res['prompts']} prompts x {res['n']}, <= {res['max_tokens']} tokens; medians after "
             f"{res['skip_steps']} warm-up steps of {res['steps']}", "",
             "| side | s/step (median) | steps | each step (s) | peak device memory | completion tokens | reward | wall |",
             "|---|---|---|---|---|---|---|---|"]
    gib = lambda x: f"{x:.1f} GiB" if x is not None else "-"  # noqa: E731
    for side, r in res["sides"].items():
        if "error" in r:
            err = r["error"].replace("|", "/")  # a table cell
            lines.append(f"| {NAMES[side]} | error: {err} | - | - | {gib(r['peak_gib'])} | - | - | {r['wall_s']:.0f} s |")
            continue
        each = " ".join(f"{s:.2f}" for s in r["step_s_all"])
        tokens = f"{r['completion_tokens']:.0f}" if r["completion_tokens"] is not None else "-"
        reward = f"{r['reward']:.3f}" if r["reward"] is not None else "-"
        lines.append(f"| {NAMES[side]} | {r['step_s']:.2f} | {r['steps']} | {each} | {gib(r['peak_gib'])} | "
                     f"{tokens} | {reward} | {r['wall_s']:.0f} s |")
    if res.get("ratio"):
        q = res["ratio"]
        mem = f"ours / TRL {q['peak_ours_over_trl']:.2f}" if q.get("peak_ours_over_trl") else "-"
        lines.append(f"| ratio | TRL / ours {q['step_trl_over_ours']:.2f}x | | | {mem} | | | |")
    return "\n".join(lines)


def ratio(sides):
    t, o = sides.get("trl", {}), sides.get("ours", {})
    if "step_s" not in t or "step_s" not in o:
        return None
    peaks = t.get("peak_gib") and o.get("peak_gib")
    return {"step_trl_over_ours": t["step_s"] / o["step_s"],
            "peak_ours_over_trl": o["peak_gib"] / t["peak_gib"] if peaks else None}


def write(res, path):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--config", choices=list(CONFIGS), default="smollm2", help="smollm2 | qwen-capped (module doc)")
    p.add_argument("--model", default=None, help="HF folder (default: $SMOLLM2_DIR or the embedded smollm2; $QWEN_DIR)")
    p.add_argument("--data", default=str(ROOT / "data/out/gsm8k/train.jsonl"), help="GSM8K train rows: train.py's row "
                   "format (default: data/gsm8k.py's output) or the official {question, answer} .jsonl")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per side")
    p.add_argument("--skip-steps", type=int, default=2, help="warm-up steps left out of the medians")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (both sides)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (both sides)")
    p.add_argument("--max-tokens", type=int, default=None, help="max completion tokens (default: the config's, 256 / 512)")
    p.add_argument("--ours-flags", default="", help="extra train.py flags for ours, given with =: "
                   "--ours-flags='--sleep-level 2' (both sides sleeping while they train)")
    p.add_argument("--sides", default="trl,ours", help="which sides to run, in this order")
    p.add_argument("--side-timeout", type=float, default=0, help="kill a side after this many seconds (0: no limit)")
    p.add_argument("--poll-s", type=float, default=0.2, help="device memory poll interval")
    p.add_argument("--seed", type=int, default=0, help="both sides' seed")
    p.add_argument("--no-vllm", action="store_true", help="CPU wiring check: TRL with transformers' generate, ours "
                   "on the cpu preset (a tiny --model); not a benchmark")
    p.add_argument("--out", default=None, help="write the results as JSON here (OUT.trl.log, OUT.ours.log beside it)")
    p.add_argument("--child", choices=["trl"], default=None, help=argparse.SUPPRESS)  # the TRL side's process
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rows", default=None, help=argparse.SUPPRESS)  # the converted rows, for the child
    p.add_argument("--vllm-share", type=float, default=None, help=argparse.SUPPRESS)  # the parent's, for the child
    args = p.parse_args(argv)
    cfg = CONFIGS[args.config]
    args.max_tokens = args.max_tokens or cfg["max_tokens"]
    if args.child == "trl":
        return trl_side(args)

    import torch
    gpu = torch.cuda.is_available()
    if not gpu and not args.no_vllm:
        raise SystemExit("error: lab/trl_bench.py times vLLM runs on a CUDA GPU; --no-vllm runs the CPU wiring check")
    from capped import hold_all_but, share_here  # the memory-cap protocol (lab/capped.py)
    args.vllm_share = share_here(cfg["vllm_share"]) if gpu and cfg["cap_gib"] else cfg["vllm_share"]
    name = args.model or os.environ.get(cfg["model_env"]) or cfg["fallback"]
    if not name:
        raise SystemExit(f"error: --config {args.config} needs --model or ${cfg['model_env']} (an HF folder)")
    from support.sources import model_source
    args.model = model_source(name)  # a folder both sides load (the embedded smollm2 is built here once)
    if os.path.isdir(args.model):
        args.model = os.path.abspath(args.model)  # the sides run in the repository root
    if not os.path.isfile(args.data):
        raise SystemExit(f"error: --data {args.data}: not found (python data/gsm8k.py --src ... writes the rows)")
    tmp = tempfile.mkdtemp(prefix="trl-bench-")
    args.rows = os.path.abspath(gsm8k_rows(args.data, tmp))
    res = {"config": args.config, "model": args.model, "data": args.data, "steps": args.steps,
           "skip_steps": args.skip_steps, "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens,
           "cap_gib": None if args.no_vllm else cfg["cap_gib"], "vllm_share": args.vllm_share, "gpu": torch.cuda.get_device_name() if gpu else "CPU",
           "date": time.strftime("%Y-%m-%d %H:%M"), "versions": versions(), "sides": {}}
    hog = None
    if gpu:
        torch.empty(1, device="cuda")  # this process's CUDA context exists before the hog is sized
        if res["cap_gib"]:
            hog = hold_all_but(res["cap_gib"])  # held for the whole run
            print(f"hog holds {hog.numel() / 2**30:.1f} GiB: {res['cap_gib']} GiB left for each side", flush=True)
    logs = os.path.splitext(os.path.abspath(args.out))[0] if args.out else os.path.join(tmp, "side")
    os.makedirs(os.path.dirname(logs), exist_ok=True)
    base = used_bytes() if gpu else 0
    for side in args.sides.split(","):
        if gpu:
            settle(base)
        print(f"{side}: running, log {logs}.{side}.log", flush=True)
        row = run_side(side, args, gpu, f"{logs}.{side}.log")
        res["sides"][side] = row
        res["ratio"] = ratio(res["sides"])
        write(res, args.out)  # after each side: a run cut short keeps what finished
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all") and k not in ("cmd", "log_history")}),
              flush=True)
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
