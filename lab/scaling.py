"""
Throughput on 1 GPU and on N GPUs (torchrun, dist.py) at a fixed batch per GPU. From the repository root:

    python lab/scaling.py --gpus 2 --model smollm2 --out runs/scaling
    python lab/scaling.py --gpus 2 --model random-qwen2.5-1.5b --out runs/scaling -- --micro-batch-size 8

Runs train.py twice with the same flags: on GPU 0 with --prompts-per-step P, then under
`torchrun --nproc-per-node N` with N x P (so each GPU generates and trains P prompts x n). The
default task is 2-digit x 1-digit multiply with --kl-coef 0.001 --kl-type k1, so every sequence
trains (with a non-zero gradient from the first step) even when a random-weight model earns no
reward. The first measurement (2026-11-23) used k3, whose gradient is 0 while policy = reference:
the same forward/backward work, AdamW on zero gradients. Prints, per run, the median step time over steps
3.. (the first steps compile and warm up), episodes per second and the scaling ratio
(N-GPU episodes/s over 1-GPU episodes/s; N is perfect), and appends a line to OUT/scaling.json.
It runs train.py as a subprocess in the repository root, so it imports nothing of the course itself.
Figures: docs/results.md (two GPUs, 2026-11-23); lab/recipes/multigpu.sh scaling runs it for both models.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root: train.py lives one folder up
BASE = ["--gpu", "h200", "--env", "multiply", "--digits", "2,1", "--fewshot", "2", "--max-tokens", "128",
        "--max-context", "512", "--n", "8", "--kl-coef", "0.001", "--kl-type", "k1", "--lora-rank", "0", "--eval-every", "0",
        "--save-every", "-1", "--no-plot", "--viewer-groups", "0", "--log-samples", "0", "--no-progress"]


def run(gpus, prompts, args, extra):
    out = Path(args.out) / f"{Path(args.model).name}-{gpus}gpu"
    flags = BASE + ["--model", args.model, "--steps", str(args.steps), "--prompts-per-step", str(prompts * gpus),
                    "--out-dir", str(out), *extra]
    if gpus == 1:
        cmd, env = [sys.executable, "train.py", *flags], dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    else:
        # torchrun sets OMP_NUM_THREADS=1 in every rank unless told otherwise; give each rank its share of the cores
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or gpus) // gpus))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--", "train.py", *flags]
        env = dict(os.environ, OMP_NUM_THREADS=threads)
    log = Path(args.out) / f"{out.name}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"{' '.join(cmd)} failed (rc {rc}); see {log}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if r["step"] >= 3] or rows
    step_s = statistics.median(r["step_time_s"] for r in steps)
    phases = {k[5:-2]: statistics.median(r.get(k, 0.0) for r in steps)  # every time_*_s: where a step goes
              for k in sorted({k for r in steps for k in r if k.startswith("time_") and k.endswith("_s")})}
    return {"gpus": gpus, "prompts_per_step": prompts * gpus, "episodes": rows[-1]["episodes"], "step_s": step_s,
            "rollout_s": phases["rollout"], "train_s": phases["train"], "phases": phases,
            "episodes_per_s": rows[-1]["episodes"] / step_s, "response_tokens": rows[-1]["response_tokens"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=32, help="prompts per GPU per step")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("extra", nargs="*", help="more train.py flags, after --")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    one = run(1, args.prompts, args, args.extra)
    many = run(args.gpus, args.prompts, args, args.extra)
    ratio = many["episodes_per_s"] / one["episodes_per_s"]
    for r in (one, many):
        print(f"{args.model} {r['gpus']} GPU: {r['prompts_per_step']} prompts x n -> {r['episodes']} episodes, "
              f"step {r['step_s']:.2f} s (rollout {r['rollout_s']:.2f}, train {r['train_s']:.2f}), "
              f"{r['episodes_per_s']:.0f} episodes/s")
        print("   phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items()))
    print(f"{args.model} scaling {args.gpus} GPUs / 1 GPU: {ratio:.2f}x")
    with open(Path(args.out) / "scaling.json", "a") as f:
        f.write(json.dumps({"model": args.model, "one": one, "many": many, "ratio": ratio}) + "\n")


if __name__ == "__main__":
    main()
