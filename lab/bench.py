"""Measure the GPU side of nanoRL on one model, side by side in one process, on one GPU.
Run from the repository root (the figures these commands measured are in docs/results.md):

    python lab/bench.py --model smollm2   --out runs/bench-smollm2.json   # the embedded SmolLM2 (support/sources.py)
    python lab/bench.py --model random-qwen2.5-0.5b --out runs/bench-0.5b.json   # Qwen2.5-0.5B shape, random weights
    python lab/bench.py --model random-qwen2.5-1.5b --out runs/bench-1.5b.json   # Qwen2.5-1.5B shape, random weights
    python lab/bench.py --model /path/to/hf_model_dir ...

What it prints (a markdown table on stdout; the same numbers as JSON in --out):
  1. rollout throughput: the same vLLM engine, the same prompts and sampling (n, temperature 1,
     top_p 1, max_tokens, ignore_eos so both sample exactly the same number of tokens), as two
     matched pairs (ratio = ours / raw generated tokens per second; target >= 1.0):
       raw   `llm.generate(text prompts, SamplingParams(...))`: text in, text out, vLLM's default
             detokenization -- what a plain vLLM user writes;
       ours  `VLLMEngine.generate(token ids)`: ids in, ids out, detokenize off;
     without logprobs (train.py's default: the trainer recomputes the old logprobs anyway), and
     with the sampled token's logprob (logprobs=0; what --tis-cap and --old-logprobs rollout
     need; ours uses flat logprobs). Also ours-with-logprobs / raw-without: what logprobs cost.
  2. sync: `VLLMEngine.load_weights(model)` (push + prefix-cache reset + logprob check), the push
     alone (the recorded-plan foreach copy, and vLLM's load_weights for comparison) vs the floor:
     one plain same-GPU copy of the same number of bytes (the trainer's fp32 -> bf16 cast reads
     twice as many bytes as the floor's copy, so ~1.5x floor is the bandwidth limit there).
  3. sleep / wake at levels 1 and 2.
  4. one GRPO training step, timed by phase: rollout (run_episodes on the multiply env), sleep,
     old and ref logprobs (no-grad forwards), train (forward + backward + AdamW), wake, sync; the
     rollout's generated tokens/s against vLLM alone on the same batch (LLM.generate, the same
     rendered prompts as text, n, max_tokens, stopping at EOS), and the training phase's MFU:
     6 N T / (old + ref + train seconds) / the GPU's peak dense bf16 FLOP/s (bench_tables.PEAK_BF16,
     named in the table), T the step's tokens (prompt + response, padding left out).
  5. peak GPU memory: device-wide (a thread polling cudaMemGetInfo every 10 ms; vLLM's sleep-mode
     pool is outside torch's allocator stats) and torch's max_memory_allocated.

The tables (--memory-table, --rollout-quant, --step-config, --prefix-table, --process-probe,
--scaling) measure train.py or whole engines instead: lab/bench_tables.py, which these flags reach.

Named shapes (sources.SHAPES; for speed and memory only, the random weights mean nothing) are
saved (bf16) with SmolLM2's tokenizer (49152 tokens, ChatML template): prompt ids are < 49152 <
151936, so they are valid for the model; sampled ids above the tokenizer's range decode to
nothing (tokenizers' DecodeStream returns None for them), which costs the same detokenizer call
per token as any other id. Reward is ~0 with random weights: the step's compute does not depend on it.

The trainer here is a compact inline GRPO step over grpo.py (fp32 master weights, bf16 autocast,
micro-batches, token-mean over the whole step); train.py's loop does the same work per step.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the course modules (train.py, grpo.py, ...) live one folder up
sys.path.insert(1, str(ROOT / "lab"))  # lab/bench_tables.py and lab/capped.py, however this file is loaded
import bench_tables  # noqa: E402
import envs  # noqa: E402
import grpo  # noqa: E402
import sync  # noqa: E402
from bench_tables import timed  # noqa: E402
from capped import PeakMemory  # noqa: E402
from rollout import episodes_to_batch, render_prompt, run_episodes  # noqa: E402
from score import sequence_logprobs  # noqa: E402
from support.sources import model_source  # noqa: E402
from vllm_engine import VLLMEngine  # noqa: E402


def bench_throughput(engine, tok, rows, args):
    """Two matched pairs, alternated rep by rep so drift hits both sides of a pair equally."""
    from vllm import SamplingParams
    ids = [render_prompt(tok, r["prompt"]) for r in rows]
    texts = [tok.decode(p) for p in ids]  # the same prompts as text (ChatML specials kept)

    def raw(logprobs, max_tokens=args.max_tokens):
        sp = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0 if logprobs else None)
        outs = engine.llm.generate(texts, sp, use_tqdm=False)
        return sum(len(o.token_ids) for ro in outs for o in ro.outputs)

    def ours(logprobs, max_tokens=args.max_tokens):
        outs = engine.generate(ids, n=args.n, temperature=1.0, top_p=1.0, max_tokens=max_tokens,
                               logprobs=logprobs, ignore_eos=True)
        return sum(len(c.token_ids) for cs in outs for c in cs)

    # Warm-up: every path once over all prompts (batch shapes, logprob kernels JIT-compiled on first
    # use, allocator growth); on an H100 the first timed run of a path was up to 20 % slow without it.
    runs = {"raw": (raw, False), "ours": (ours, False), "raw_logprobs": (raw, True), "ours_logprobs": (ours, True)}
    for fn, lp in runs.values():
        fn(lp, max_tokens=32)
    res = {k + "_tok_s": [] for k in runs}
    for _ in range(args.reps):  # alternate, so drift hits both sides of a pair alike
        for key, (fn, lp) in runs.items():
            ntok, dt = timed(lambda: fn(lp))
            res[key + "_tok_s"].append(ntok / dt)
            res["tokens"] = ntok
    med = statistics.median
    for key in runs:
        res[key] = med(res[key + "_tok_s"])
    # ratios: the median over reps of the paired (same-rep) ratios
    pair = lambda a, b: med(x / y for x, y in zip(res[a + "_tok_s"], res[b + "_tok_s"]))
    res["ratio"] = pair("ours", "raw")  # what train.py's default rollout runs (no logprobs needed)
    res["ratio_logprobs"] = pair("ours_logprobs", "raw_logprobs")  # with TIS / rollout old logprobs
    res["ratio_logprobs_vs_raw"] = pair("ours_logprobs", "raw")
    res["prompt_tokens_mean"] = sum(map(len, ids)) / len(ids)
    return res


def copy_floor_ms(nbytes, device="cuda", reps=5):
    """The floor for a sync: median ms of one plain same-GPU copy of nbytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    del src, dst
    return statistics.median(times)


def bench_sync(engine, model, args):
    first = engine.load_weights(model)  # load_weights path, records the copy plan, logprob check
    full = [engine.load_weights(model) for _ in range(args.reps + 1)]  # the fast path from here on
    slow = [sync.push_weights(engine.llm, model, engine.torch_dtype)["push_ms"] for _ in range(args.reps + 1)]
    fast = [sync.push_fast(engine.sync_plan, model)["push_ms"] for _ in range(args.reps + 1)] if engine.sync_plan else [float("nan")]
    floor = copy_floor_ms(first["bytes"])
    med = statistics.median
    return {"bytes": first["bytes"], "n_tensors": first["n_tensors"], "trainer_dtype": str(next(model.parameters()).dtype),
            "engine_dtype": str(engine.torch_dtype), "path": full[-1]["path"],
            "sync_ms": med([s["ms"] for s in full]), "push_ms": med([s["push_ms"] for s in full]),
            "push_load_weights_ms": med(slow), "push_fast_ms": med(fast),
            "reset_ms": med([s["reset_ms"] for s in full]), "check_ms": med([s.get("check_ms", 0.0) for s in full]),
            "floor_ms": floor, "push_over_floor": med([s["push_ms"] for s in full]) / floor,
            "dlogp_mean": first.get("dlogp_mean"), "dlogp_p95": first.get("dlogp_p95"),
            "probe_tokens": first.get("probe_tokens")}


def bench_sleep(engine, model, args):
    out = {}
    if engine.sleep_level == 0:  # the engine was built without sleep mode
        return {"sleep1_ms": float("nan"), "wake1_ms": float("nan"), "sleep2_ms": float("nan"), "wake2_ms": float("nan")}
    level0 = engine.sleep_level
    for level in (1, 2):
        engine.sleep_level = level
        s, w = [], []
        for _ in range(args.reps):
            s.append(engine.sleep()["sleep_ms"])
            w.append(engine.wake()["wake_ms"])
            if level == 2:
                engine.load_weights(model, check=False)  # level 2 dropped the weights
        out[f"sleep{level}_ms"], out[f"wake{level}_ms"] = statistics.median(s), statistics.median(w)
    engine.sleep_level = level0
    return out


def logprobs_of(model, batch, args, grad=False):
    """Trainer logprobs (B, T-1) of input_ids[:, 1:], in micro-batches, under bf16 autocast."""
    outs = []
    for i in range(0, batch["input_ids"].shape[0], args.micro_batch):
        ids = batch["input_ids"][i:i + args.micro_batch]
        am = batch["attention_mask"][i:i + args.micro_batch]
        with torch.set_grad_enabled(grad), torch.autocast("cuda", dtype=torch.bfloat16):
            outs.append(sequence_logprobs(model, ids, am)[0])  # (b, T-1)
    return torch.cat(outs)


def vllm_alone(engine, tok, rows, args):
    """Generated tokens/s of LLM.generate on the step's batch (text prompts, n, max_tokens, EOS stops):
    vLLM alone, what the step's rollout phase is compared with."""
    from vllm import SamplingParams
    texts = [tok.decode(render_prompt(tok, r["prompt"])) for r in rows]
    sp = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens)
    outs, dt = timed(lambda: engine.llm.generate(texts, sp, use_tqdm=False))
    engine.llm.reset_prefix_cache()  # the rollout after it prefills these prompts anew, as after a sync
    return sum(len(o.token_ids) for ro in outs for o in ro.outputs) / dt


def bench_step(engine, model, ref, opt, tok, rows, args):
    t = {}

    def phase(name, fn):
        r, dt = timed(fn)
        t[name] = dt
        return r

    def make_env(row):
        return envs.make_env("multiply")

    alone = vllm_alone(engine, tok, rows, args)  # before the timed phases: not in total_s
    eps = phase("rollout_s", lambda: run_episodes(engine, tok, rows, make_env, n=args.n, temperature=1.0,
                                                  top_p=1.0, max_tokens=args.max_tokens, max_turns=1,
                                                  max_context=args.max_model_len, logprobs=False))
    phase("sleep_s", engine.sleep)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batch = {k: v.cuda() for k, v in episodes_to_batch(eps, pad).items()}
    mask = batch["loss_mask"][:, 1:]  # (B, T-1) aligned with logprobs of input_ids[:, 1:]
    old = phase("old_logprobs_s", lambda: logprobs_of(model, batch, args))
    refl = phase("ref_logprobs_s", lambda: logprobs_of(ref, batch, args))

    def train():
        adv = grpo.broadcast_to_tokens(grpo.grpo_advantages(batch["rewards"], batch["groups"]), mask)  # (B, T-1)
        denom = mask.sum().clamp(min=1)  # global token count of the step
        for i in range(0, mask.shape[0], args.micro_batch):
            sl = slice(i, i + args.micro_batch)
            mb = {k: batch[k][sl] for k in ("input_ids", "attention_mask")}
            logp = logprobs_of(model, mb, args, grad=True)
            loss, _ = grpo.ppo_clip_loss(logp, old[sl], adv[sl], mask[sl], 0.2, 0.28)
            loss = loss + 0.001 * grpo.kl(logp, refl[sl])
            grpo.token_mean(loss, mask[sl], denom=denom).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    phase("train_s", train)
    phase("wake_s", engine.wake)
    s = phase("sync_s", lambda: engine.load_weights(model))
    t["total_s"] = sum(v for k, v in t.items())
    t["episodes"] = len(eps)
    t["response_tokens"] = int(mask.sum())
    t["tokens"] = int(batch["attention_mask"].sum())  # what the training phase ran forward (and backward)
    t["rollout_tok_s"] = sum(len(e.response_ids) for e in eps) / t["rollout_s"]
    t["vllm_alone_tok_s"] = alone
    n = sum(p.numel() for p in model.parameters())
    t["peak"], peak = bench_tables.peak_flops(torch.cuda.get_device_name())
    t["mfu"] = bench_tables.mfu(n, t["tokens"], t["old_logprobs_s"] + t["ref_logprobs_s"] + t["train_s"], peak)
    t["reward_mean"] = float(batch["rewards"].mean())
    t["sync_dlogp_mean"] = s.get("dlogp_mean")
    return t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | random-qwen2.5-{0.5b,1.5b,3b,7b} | a Hugging Face model folder")
    p.add_argument("--prompts", type=int, default=128, help="prompts for the throughput runs")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="sampled tokens per completion")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each timing (medians are reported)")
    p.add_argument("--step-prompts", type=int, default=32, help="prompts in the timed training step")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per trainer forward")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU")
    p.add_argument("--sleep-level", type=int, default=2, help="the engine's sleep level in the step")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM context length")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW lr of the timed step")
    p.add_argument("--out", default=None, help="write the results as JSON here too")
    p.add_argument("--memory-table", action="store_true", help="only the memory table (module doc)")
    p.add_argument("--shapes", default="0.5b,1.5b,3b,7b", help="memory table: Qwen2.5 shapes")
    p.add_argument("--cards", default="l40s,a100", help="memory table: cards to emulate (l40s, a100)")
    p.add_argument("--table-steps", type=int, default=3, help="memory table: train.py steps per run")
    p.add_argument("--table-kl", type=float, default=0.001, help="memory table: --kl-coef of the runs (every sequence "
                   "trains; an upper bound); 0: none, as the presets, with rewards that vary between episodes")
    p.add_argument("--rollout-quant", default=None, help="only the FlashRL table (quant_table): engines to run one after another, e.g. none,fp8,int8, "
                   "each in a process of its own")
    p.add_argument("--models", default="smollm2", help="--rollout-quant: comma-separated models")
    p.add_argument("--skip-check", action="store_true", help="--rollout-quant: also show a skipped sync caught")
    p.add_argument("--no-check-limit", action="store_true", help="--rollout-quant: report the sync check, never raise")
    p.add_argument("--step-config", choices=list(bench_tables.STEP_CONFIGS), default=None, help="only the step-time table "
                   "(step_table): train.py on this config, median step time and its breakdown")
    p.add_argument("--step-flags", default="", help="--step-config: extra train.py flags, given with =: --step-flags='--micro-batch-tokens 0'")
    p.add_argument("--prefix-table", default=None, metavar="EPISODES", help="only the shared-prefix table "
                   "(prefix_table): padded vs packed training on the trained rows of a run's episodes.jsonl")
    p.add_argument("--prefix-rows", type=int, default=256, help="--prefix-table: the last N episodes of the file")
    p.add_argument("--steps", type=int, default=None, help="--step-config: steps to run (default 10); --scaling: 8")
    p.add_argument("--process-probe", choices=["0", "1"], default=None, help="only the engine-process probe "
                   "(process_probe): vLLM's engine core in this process (0) or in a child process (1)")
    p.add_argument("--probe-profile", action="store_true", help="--process-probe: + a cProfile of one generate")
    p.add_argument("--scaling", type=int, default=None, metavar="GPUS", help="only the scaling runs (scaling): train.py "
                   "on 1 GPU, then on GPUS under torchrun, --step-prompts per GPU (+ --step-flags)")
    p.add_argument("--apart", action="store_true", help="--scaling: + GPUS one-GPU runs at once, each on its own "
                   "GPU: the host's share of a rank's slowdown, told apart from DDP's")
    p.add_argument("--profile", default=None, help="--step-config: write a cProfile of the whole train.main run here, "
                   "printed for the functions outside vLLM's package only (paths containing /vllm/ are left out); its "
                   "timings are inflated by the profiler: a separate run from the one whose times you report")
    p.add_argument("--skip-steps", type=int, default=2, help="--step-config: warm-up steps left out of the medians")
    args = p.parse_args(argv)
    if bench_tables.chosen(args):  # a table instead of the one-model measurements (lab/bench_tables.py)
        return bench_tables.run(args)
    if not torch.cuda.is_available():  # every measurement here times vLLM or CUDA memory
        raise SystemExit("error: lab/bench.py measures GPU runs (vLLM, CUDA memory) and this machine has no "
                         "CUDA GPU; train.py's CPU run prints its own step times")

    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = model_source(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    res = {"model": args.model, "path": path, "gpu": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}
    import vllm
    res["vllm"], res["torch"] = vllm.__version__, torch.__version__
    with PeakMemory() as peak:
        torch.cuda.reset_peak_memory_stats()
        # the trainer exists before the engine, as in train.py: vLLM sizes its KV cache around it
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
        ref = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        t0 = time.perf_counter()
        engine = VLLMEngine(path, gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=args.sleep_level,
                            dtype="bfloat16", max_model_len=args.max_model_len, seed=0)
        res["engine_start_s"] = time.perf_counter() - t0
        rows = envs.multiply_rows(args.prompts, seed=0)
        res["throughput"] = bench_throughput(engine, tok, rows, args)
        res["sync"] = bench_sync(engine, model, args)
        res["sleep"] = bench_sleep(engine, model, args)
        step_rows = envs.multiply_rows(args.step_prompts, seed=1)
        bench_step(engine, model, ref, opt, tok, step_rows, args)  # warm-up step (allocator, autocast caches)
        res["step"] = bench_step(engine, model, ref, opt, tok, step_rows, args)
    res["peak_device_gb"] = peak.peak / 1e9
    res["peak_torch_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(table(res))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


def table(r):
    th, sy, sl, st = r["throughput"], r["sync"], r["sleep"], r["step"]
    a = r["args"]
    rows = [
        ("engine start", f"{r['engine_start_s']:.1f} s"),
        (f"raw LLM.generate, text, no logprobs ({a['prompts']}x{a['n']}x{a['max_tokens']} tokens)", f"{th['raw']:,.0f} tok/s"),
        ("VLLMEngine.generate, ids, no logprobs (train.py default)", f"{th['ours']:,.0f} tok/s"),
        ("ratio ours / raw, no logprobs", f"{th['ratio']:.2f}"),
        ("raw LLM.generate, text, logprobs=0", f"{th['raw_logprobs']:,.0f} tok/s"),
        ("VLLMEngine.generate, ids + logprobs (TIS runs)", f"{th['ours_logprobs']:,.0f} tok/s"),
        ("ratio ours / raw, with logprobs", f"{th['ratio_logprobs']:.2f}"),
        ("  ours with logprobs / raw without", f"{th['ratio_logprobs_vs_raw']:.2f}"),
        (f"sync (push + reset + check), {sy['bytes'] / 1e9:.2f} GB {sy['trainer_dtype']} -> {sy['engine_dtype']}",
         f"{sy['sync_ms']:.1f} ms"),
        (f"  push ({sy['path']}) / reset / check", f"{sy['push_ms']:.2f} / {sy['reset_ms']:.2f} / {sy['check_ms']:.1f} ms"),
        ("  floor: same-GPU copy of the same bytes", f"{sy['floor_ms']:.2f} ms (push = {sy['push_over_floor']:.1f}x floor)"),
        ("  push via vLLM load_weights (first sync, fallback)", f"{sy['push_load_weights_ms']:.1f} ms"),
        ("  probe mean / p95 abs dlogp after sync", f"{sy['dlogp_mean']:.3f} / {sy['dlogp_p95']:.3f}"),
        ("sleep / wake, level 1", f"{sl['sleep1_ms']:.0f} / {sl['wake1_ms']:.0f} ms"),
        ("sleep / wake, level 2", f"{sl['sleep2_ms']:.0f} / {sl['wake2_ms']:.0f} ms"),
        (f"train step ({st['episodes']} episodes, {st['response_tokens']} response tokens)", f"{st['total_s']:.2f} s"),
    ]
    for k in ("rollout_s", "sleep_s", "old_logprobs_s", "ref_logprobs_s", "train_s", "wake_s", "sync_s"):
        rows.append((f"  {k[:-2]}", f"{st[k]:.3f} s"))
    rows += [("  rollout / vLLM alone on the same batch (generated tok/s)",
              f"{st['rollout_tok_s']:,.0f} / {st['vllm_alone_tok_s']:,.0f} ({st['rollout_tok_s'] / st['vllm_alone_tok_s']:.2f}x)"),
             (f"  training-phase MFU, 6 N x {st['tokens']} tokens / (old + ref + train) / peak",
              f"{st['mfu']:.1%} of {st['peak']} dense bf16" if st["mfu"] else "n/a (GPU not in bench_tables.PEAK_BF16)")]
    rows += [("peak GPU memory, device-wide", f"{r['peak_device_gb']:.1f} GB"),
             ("peak torch.cuda.max_memory_allocated", f"{r['peak_torch_allocated_gb']:.1f} GB")]
    head = f"### {r['model']} on {r['gpu']}, vLLM {r['vllm']}, torch {r['torch']}, {r['date']}\n\n| what | value |\n|---|---|\n"
    return head + "\n".join(f"| {k} | {v} |" for k, v in rows)


if __name__ == "__main__":
    main()
