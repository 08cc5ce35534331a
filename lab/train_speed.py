r"""
The training phase alone: forward + backward of one step's GSM8K-shaped rows at the l40s preset,
the way train.py runs them (options/prefix.micro_batches and sequence_logprobs, float32 weights under
bf16 autocast, gradient checkpointing, the LM head in chunks), with variants side by side in one
process, on one GPU. No vLLM: it runs where torch and transformers are.

    python lab/train_speed.py --model random-qwen2.5-1.5b --out runs/train-speed.json
    python lab/train_speed.py --model random-qwen2.5-1.5b --variants base,compile --profile 15

The rows (seeded): --groups groups of --n rows; each group shares a prompt of --prompt tokens and
each row has an answer of N(--answer, --answer-sd) tokens, clipped to [16, --max-tokens] (the
default, 200 rows of 150 + 310 +- 110 <= 512, is the qwen-capped TRL config's trained rows: 0.5
reward leaves ~200 of 256 rows in mixed groups, 310 tokens the measured mean completion). Token
ids are random: the compute does not depend on them. The loss is a policy-gradient surrogate,
-sum(A logp) / tokens with random advantages, whose backward costs what train.py's does.

Variants (--variants, comma-separated; each is timed --reps times after one warm-up rep, best kept):
  base      train.py's eager path: padded micro-batches (right-padded, so they run without a mask:
            score.sequence_logprobs), --logprob-chunk 1024
  chunk4k   --logprob-chunk 4096
  noent     no entropy (train.py computes it on every step as a metric)
  mb16k     --micro-batch-tokens 16384 (the preset: 4 x 2048 = 8192)
  nockpt    no gradient checkpointing (what it costs, for scale)
  fused     the LM head's scoring compiled (score.token_logprobs compiled), the layers eager
  compile   --compile: fused, and each decoder layer under torch.compile (options/memory.compile_model)
  compile16k  --compile with --micro-batch-tokens 16384
  (a compiled variant's warm-up rep compiles; keep them last: the layers stay compiled)
What it prints: per variant the best time, x base, torch's peak allocated GiB, and the max |dlogp|
and the gradient's relative difference against base (equal functions agree to bf16 rounding).
--profile K: the K kernels with the most CUDA time in one base rep (torch.profiler).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import score  # noqa: E402
from options import memory, prefix  # noqa: E402
from support import sources  # noqa: E402

VARIANTS = {  # name -> (micro-batch tokens, chunk, entropy, grad checkpointing, compile)
    "base": (8192, 1024, True, True, False),
    "chunk4k": (8192, 4096, True, True, False),
    "noent": (8192, 1024, False, True, False),
    "mb16k": (16384, 1024, True, True, False),
    "nockpt": (8192, 1024, True, False, False),
    "fused": (8192, 1024, True, True, "head"),
    "compile": (8192, 1024, True, True, "all"),
    "compile16k": (16384, 1024, True, True, "all"),
}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_rows(groups, n, prompt, answer, answer_sd, max_tokens, vocab, seed=0):
    """(ids (B, T), attn (B, T), adv (B,)): right-padded rows, a group's n rows sharing their prompt."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(groups):
        p = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        for _ in range(n):
            a = int(min(max(16, answer + answer_sd * torch.randn((), generator=g).item()), max_tokens))
            seqs.append(p + torch.randint(0, vocab, (a,), generator=g).tolist())
    ids, attn = score.pad(seqs)
    return ids, attn, torch.randn(len(seqs), generator=g)


def run_phase(model, ids, attn, adv, tokens, chunk, entropy):
    """One step's forward + backward as train.update runs it; returns (seconds, logp (B, T-1) on CPU)."""
    device = next(model.parameters()).device
    lengths = attn.sum(1)
    n_tok = (attn[:, 1:]).sum()
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    sync()
    t0 = time.perf_counter()
    for idx in prefix.micro_batches(lengths, torch.arange(len(ids)), 4, tokens, ids=ids):
        T = int(lengths[idx].max())
        i, a = ids[idx, :T].to(device), attn[idx, :T].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logp, ent = prefix.sequence_logprobs(model, i, a, 1.0, chunk, entropy=entropy)
        m = a[:, 1:].float()
        loss = -(logp * adv[idx, None].to(device) * m).sum() / n_tok
        loss.backward()
        out[idx, :T - 1] = (logp.detach() * m).float().cpu()
    sync()
    return time.perf_counter() - t0, out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random-qwen2.5-1.5b", help="a sources.SHAPES name or an HF folder")
    p.add_argument("--variants", default="base,chunk4k,noent,mb16k,fused,compile,compile16k")
    p.add_argument("--groups", type=int, default=25)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt", type=int, default=150)
    p.add_argument("--answer", type=int, default=310)
    p.add_argument("--answer-sd", type=int, default=110)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--profile", type=int, default=0, help="print the K kernels with the most CUDA time (base)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM
    if args.model in sources.SHAPES:  # random weights from the config alone: no tokenizer needed here
        from transformers import Qwen2Config
        model = AutoModelForCausalLM.from_config(Qwen2Config(**sources.SHAPES[args.model]), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = model.to("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a wiring check only
    model.train()  # transformers checkpoints activations only in train mode (dropout is 0 in Qwen2)
    ids, attn, adv = make_rows(args.groups, args.n, args.prompt, args.answer, args.answer_sd, args.max_tokens,
                               model.config.vocab_size)
    print(f"{len(ids)} rows, {int(attn.sum())} tokens, longest {ids.shape[1]}; {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}",
          flush=True)
    results, ref, compiled_layers = {}, None, False
    for name in args.variants.split(","):
        tokens, chunk, entropy, ckpt, comp = VARIANTS[name]
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        if comp == "head":
            score.unwrap(model).nanorl_compiled = True  # score with one compiled kernel; layers stay eager
        elif comp == "all" and not compiled_layers:
            memory.compile_model(model)
            compiled_layers = True
        times = []
        for rep in range(args.reps + 1):  # rep 0 warms up (and compiles)
            model.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            s, logp = run_phase(model, ids, attn, adv, tokens, chunk, entropy)
            times.append(s)
        grad = torch.cat([q.grad.flatten().float() for q in model.parameters() if q.grad is not None])
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        if ref is None:
            ref = (logp, grad.cpu())
        dlogp = float((logp - ref[0]).abs().max())
        rel = float((grad.cpu() - ref[1]).norm() / ref[1].norm())
        results[name] = dict(s=min(times[1:]), all_s=times, peak_gib=peak, max_dlogp=dlogp, grad_rel_diff=rel)
        print(f"{name:8s} {min(times[1:]):6.2f} s (reps {', '.join(f'{t:.2f}' for t in times)})  "
              f"peak {peak:5.1f} GiB  max|dlogp| {dlogp:.3f}  grad rel diff {rel:.4f}", flush=True)
        del grad
    base = results.get("base", {}).get("s")
    print("\n| variant | s | x base | peak GiB | max abs dlogp | grad rel. diff |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        x = f"{base / r['s']:.2f}" if base else "-"
        print(f"| {name} | {r['s']:.2f} | {x} | {r['peak_gib']:.1f} | {r['max_dlogp']:.3f} | {r['grad_rel_diff']:.4f} |")
    if args.profile:  # the last variant's settings (compiled or not), base's micro-batches
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            run_phase(model, ids, attn, adv, *VARIANTS["base"][:3])
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile, max_name_column_width=60))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(rows=len(ids), tokens=int(attn.sum()), gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                                  results=results), indent=1))


if __name__ == "__main__":
    main()
