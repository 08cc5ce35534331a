"""lab/bench.py's tables: measurements of train.py or of whole engines, each printed as a markdown
table (the same rows as JSON in --out). lab/bench.py's flags choose one and dispatch here (run);
the in-process micro-benches of one model stay in lab/bench.py. From the repository root (the
figures these commands measured are in docs/results.md):

    python lab/bench.py --memory-table --shapes 0.5b,1.5b,3b,7b --out runs/memory.json

  The memory table instead: which Qwen2.5 shapes train full-parameter on a 48 GB L40S and a 40 GB
  A100, with each preset's own flags, at what step time. The card is made by the memory-cap
  protocol: this process holds all but CAP GiB of the GPU (45 for an L40S, 39 for an A100 40GB)
  while `train.py --env mcp --gpu l40s|a100 --model random-qwen2.5-X` runs in a subprocess with
  vLLM's memory on the small card (0.3 x 48 GB = 0.17, 0.35 x 40 GB = 0.175 of an 80 GB H100; capped.py), a
  KL term so that every sequence runs forward and backward (random weights earn no reward, nor do
  a real model's --ignore-eos episodes; the reference model makes it an upper bound; --table-kl 0:
  none, as the presets run, with a format reward and a failed-call charge so a real model's groups
  still train, and the share that did in the table),
  and single turns filling the 4096-token MCP context (--max-tokens 2048 after the ~1.9k-token
  tool prompt; --ignore-eos, so a real model's episodes fill it too: pass its folder in --shapes,
  e.g. --shapes $QWEN_DIR). Per run: the step time (median of the steps after the first), train.py's peak
  memory per phase, the device's peak seen from here minus the hog, or the error it stopped with.

    python lab/bench.py --process-probe 0|1 [--probe-profile] --model MODEL_DIR   (process_probe)
    python lab/bench.py --scaling 2 --model smollm2 --out runs/scaling [--apart] [--step-flags="--micro-batch-size 8"]
    python lab/bench.py --rollout-quant none,fp8,int8 --models smollm2,random-qwen2.5-7b --skip-check
    python lab/bench.py --step-config gsm8k --steps 20 [--step-flags="--micro-batch-tokens 0"]  (the = : a value that starts with --)

  The step-time table (step_table): train.main itself on a fixed config, the median step time after
  the warm-up steps, its breakdown by phase and the GPU's busy share over those steps. It reads
  what train.main returns and writes (the per-step metrics, and metrics.jsonl's "time" for each
  step's end); it patches nothing in train.py.

  The FlashRL table instead (quant_table): per model, a bf16 engine and then each quantized one on
  the same prompts: generation tok/s, sync ms (and the quantize part), engine vs trainer |dlogp|,
  and with --skip-check the check after a skipped sync.
"""
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the course modules (train.py, grpo.py, ...) live one folder up
sys.path.append(str(ROOT / "lab"))  # lab/capped.py, however this file is loaded
import envs  # noqa: E402
import score  # noqa: E402
import sync  # noqa: E402
from capped import PeakMemory, hold_all_but, share_here  # noqa: E402
from options import prefix  # noqa: E402
from rollout import render_prompt  # noqa: E402
from score import sequence_logprobs  # noqa: E402
from support.sources import load_model, model_source, on_device  # noqa: E402
from vllm_engine import VLLMEngine  # noqa: E402


def timed(fn):
    """(fn(), its seconds), the GPU's queued work included."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return r, time.perf_counter() - t0


def chosen(args):
    """Whether lab/bench.py's flags ask for a table."""
    return bool(args.process_probe is not None or args.scaling or args.rollout_quant or args.step_config
                or args.prefix_table or args.memory_table)


def run(args):
    """The table lab/bench.py's flags chose: printed, and written as JSON to --out."""
    if args.process_probe is not None:
        return process_probe(args)
    if args.scaling:  # train.py in subprocesses: this process needs no GPU
        return scaling(args)
    if not torch.cuda.is_available():  # every other table times vLLM or CUDA memory
        raise SystemExit("error: lab/bench.py measures GPU runs (vLLM, CUDA memory) and this machine has no "
                         "CUDA GPU; train.py's CPU run prints its own step times")
    tables = [(args.rollout_quant, quant_table, quant_markdown), (args.step_config, step_table, step_markdown),
              (args.prefix_table, prefix_table, prefix_markdown), (args.memory_table, memory_table, memory_markdown)]
    table_fn, markdown = next((fn, md) for asked, fn, md in tables if asked)
    res = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"), "rows": table_fn(args)}
    print(markdown(res["rows"]))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


CARDS = {"l40s": (45, 0.17), "a100": (39, 0.175)}  # usable GiB, vLLM's share of an 80 GB H100 (capped.share_here)


def memory_table(args):
    """train.py under each card's memory cap, in a subprocess per (card, shape); see the module doc."""
    import subprocess
    import tempfile
    torch.cuda.init()
    torch.empty(1, device="cuda")  # this process's CUDA context exists before the hog is sized
    results = []
    for shape in args.shapes.split(","):
        model = shape if os.path.isdir(shape) else f"random-qwen2.5-{shape}"  # a real model's folder, or a shape
        model_source(model)  # built once, before any cap
        for card in args.cards.split(","):
            cap, util = CARDS[card][0], share_here(CARDS[card][1])
            free, total = torch.cuda.mem_get_info()
            hog = hold_all_but(cap)
            out = tempfile.mkdtemp(prefix=f"mem-{card}-{Path(shape).name}-")  # a folder's name, not its path
            # a KL term makes every sequence train: random weights earn no reward, and a real model's
            # --ignore-eos episodes earn none either (without it, a Qwen2.5-Coder-1.5B-Instruct run
            # trained no sequence: live_frac 0, docs/results.md). Its reference model (the policy's
            # weights in bf16) makes the figure an upper bound for the presets, which have no KL.
            # --table-kl 0 measures the presets as they are: no reference model, and rewards that vary
            # between a real model's episodes (a wrong <answer> earns 0.5, each failed call costs 0.2)
            # so that its groups train; live_frac says how many sequences did
            reward = (["--kl-coef", str(args.table_kl)] if args.table_kl > 0 else
                      ["--kl-coef", "0", "--format-reward", "0.5", "--tool-error-penalty", "0.2"])
            cmd = [sys.executable, "train.py", "--env", "mcp", "--gpu", card, "--model", model, *reward,
                   "--gpu-memory-utilization", str(util), "--steps", str(args.table_steps), "--prompts-per-step", "8",
                   "--n", "4", "--max-tokens", "2048", "--ignore-eos", "--eval-every", "0",
                   "--save-every", "-1", "--out-dir", out]
            t0 = time.perf_counter()
            with PeakMemory() as peak:
                r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            row = {"card": card, "cap_gib": cap, "model": model, "ok": r.returncode == 0, "wall_s": time.perf_counter() - t0,
                   "peak_device_gib": (peak.peak - hog.numel() - (total - free)) / 2**30}
            del hog
            torch.cuda.empty_cache()
            metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))] if row["ok"] else []
            if metrics:
                row["step_s"] = statistics.median(m["step_time_s"] for m in metrics[1:] or metrics)
                row["live_frac"] = [round(m.get("live_frac", 0.0), 3) for m in metrics]  # each step's
                row["memory"] = {k: max(m.get(k, 0.0) for m in metrics) for k in metrics[-1] if k.startswith("mem_")}
            else:
                row["error"] = next((ln for ln in reversed(r.stderr.splitlines()) if "Error" in ln), r.stderr[-300:])
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def memory_markdown(rows):
    lines = ["| card (cap) | model | fits | step time | sequences trained, by step | trainer peak (fwd / bwd / optimizer) "
             "| rollout, process | device peak |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["ok"]:
            m = r["memory"]
            lines.append(f"| {r['card']} ({r['cap_gib']} GiB) | {r['model']} | yes | {r['step_s']:.1f} s | "
                         f"{' / '.join(f'{x:.0%}' for x in r['live_frac'])} | "
                         f"{m.get('mem_forward_gb', 0):.1f} / {m.get('mem_backward_gb', 0):.1f} / "
                         f"{m.get('mem_optimizer_gb', 0):.1f} GiB | {m.get('mem_process_rollout_gb', 0):.1f} GiB | "
                         f"{r['peak_device_gib']:.1f} GiB |")
        else:
            lines.append(f"| {r['card']} ({r['cap_gib']} GiB) | {r['model']} | no | - | - | {r['error'][:160]} | - | - |")
    return "\n".join(lines)


def quant_table(args):
    """FlashRL's table (--rollout-quant): per model, a bf16 engine and then each quantized one, each in a
    process of its own when there are several (quant_child), on the same prompts: generation tok/s (no
    logprobs, ignore_eos), sync ms (push, quantize, prefix-cache reset and logprob check), engine vs
    trainer |dlogp| on the probe tokens, and whether a skipped sync is caught: the trainer's weights x
    (1 + 0.05 N(0, 1)) with no sync, then synced."""
    pairs = [(m, q) for m in args.models.split(",") for q in args.rollout_quant.split(",")]
    if len(pairs) == 1:
        return with_ratios([quant_row(args, *pairs[0])])
    rows = []  # one engine a process: a second engine in one process tripped torch's allocator in CUDA-graph
    for m, q in pairs:  # capture (H200, vLLM 0.26); each row printed as it comes: engine starts take minutes
        rows.append(quant_child(args, m, q))
        print(f"quant child {m} {q}: {json.dumps(rows[-1])}", flush=True)
    return with_ratios(rows)


def quant_row(args, name, q):
    """quant_table's row for one model and one engine, measured in this process."""
    from options import quant
    from transformers import AutoModelForCausalLM, AutoTokenizer
    med, path = statistics.median, model_source(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()  # train.py's fp32 master weights
    prompts = [render_prompt(tok, r["prompt"]) for r in envs.multiply_rows(args.prompts, seed=0)]
    t0 = time.perf_counter()
    kw = dict(gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=0, max_model_len=args.max_model_len, seed=0)
    engine = VLLMEngine(path, **kw) if q == "none" else quant.QuantizedEngine(model, tok, path, q, **kw)
    r = {"model": name, "quant": q, "engine_start_s": time.perf_counter() - t0, "threshold": engine.check_threshold}
    if args.no_check_limit:  # random weights: measure the mismatch, do not stop on it
        engine.check_threshold = float("inf")
    engine.load_weights(model)  # the first sync: records both plans (no probe prompts yet, no check)
    gen = lambda mt: sum(len(c.token_ids) for cs in engine.generate(  # noqa: E731
        prompts, n=args.n, temperature=1.0, top_p=1.0, max_tokens=mt, logprobs=False, ignore_eos=True) for c in cs)
    gen(32)  # warm-up; also makes the probe batch
    tps = []
    for _ in range(args.reps):
        ntok, dt = timed(lambda: gen(args.max_tokens))
        tps.append(ntok / dt)
    syncs = [engine.load_weights(model) for _ in range(args.reps + 1)][1:]
    r.update(tok_s=med(tps), sync_ms=med(s["ms"] for s in syncs), push_ms=med(s["push_ms"] for s in syncs),
             quant_ms=med(s.get("quant_ms", 0.0) for s in syncs), check_ms=med(s["check_ms"] for s in syncs),
             dlogp_mean=med(s["dlogp_mean"] for s in syncs), dlogp_p95=med(s["dlogp_p95"] for s in syncs))
    if args.skip_check:  # the check after a skipped sync, and after the real one
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 0.05 * torch.randn_like(p))
        engine.llm.reset_prefix_cache()
        r["skipped_dlogp"] = sync.probe(engine.generate, model, engine.probe_prompts, engine.probe_tokens,
                                        autocast_dtype=engine.torch_dtype)["dlogp_mean"]
        r["resynced_dlogp"] = engine.load_weights(model)["dlogp_mean"]
    engine.close()
    print(json.dumps(r), flush=True)  # quant_child reads this line
    return r


def quant_child(args, model, q):
    """quant_table's row for one (model, engine), measured by lab/bench.py in a process of its own."""
    import subprocess
    cmd = [sys.executable, str(ROOT / "lab" / "bench.py"), "--rollout-quant", q, "--models", model, "--prompts",
           str(args.prompts), "--n", str(args.n), "--max-tokens", str(args.max_tokens), "--reps", str(args.reps),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--max-model-len", str(args.max_model_len)]
    cmd += ["--skip-check"] * args.skip_check + ["--no-check-limit"] * args.no_check_limit
    done = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"model"')]
    if done.returncode or not rows:
        raise RuntimeError(f"lab/bench.py --rollout-quant {q} --models {model} failed (exit {done.returncode}):\n"
                           + (done.stdout + done.stderr)[-3000:])
    return rows[0]


def with_ratios(rows):
    """rows with each engine's tok/s and sync ms over the same model's bf16 engine (when "none" was run too)."""
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["quant"] == "none"), None)
        r["tok_s_ratio"] = r["tok_s"] / base["tok_s"] if base else float("nan")
        r["sync_ratio"] = r["sync_ms"] / base["sync_ms"] if base else float("nan")
    return rows


def quant_markdown(rows):
    lines = ["| model | rollout | gen tok/s | vs bf16 | sync ms (quantize) | vs bf16 | dlogp mean / p95 | "
             "skipped sync: dlogp (threshold) | resynced |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        skip = (f"{r['skipped_dlogp']:.3f} ({r['threshold']})" if "skipped_dlogp" in r else "-")
        resynced = f"{r['resynced_dlogp']:.3f}" if "resynced_dlogp" in r else "-"  # both need --skip-check
        lines.append(f"| {r['model']} | {r['quant']} | {r['tok_s']:.0f} | {r['tok_s_ratio']:.2f} | {r['sync_ms']:.1f} "
                     f"({r['quant_ms']:.1f}) | {r['sync_ratio']:.2f} | {r['dlogp_mean']:.3f} / {r['dlogp_p95']:.3f} | "
                     f"{skip} | {resynced} |")
    return "\n".join(lines)


# The GSM8K step-time config: GSM8K train prompts, 32 x 8, <= 256 new tokens, T = 1, lr 1e-6, no KL,
# one update per step, vLLM at 0.3 of the GPU; everything else (the sleep level included: auto) is
# train.py's --gpu h100 default. Needs the GSM8K rows in data/out/gsm8k (data/gsm8k.py).
STEP_CONFIGS = {"gsm8k": ["--gpu", "h100", "--env", "gsm8k", "--prompts-per-step", "32", "--n", "8",
                          "--max-tokens", "256", "--temperature", "1", "--lr", "1e-6", "--kl-coef", "0",
                          "--gpu-memory-utilization", "0.3", "--eval-every", "0"]}
PHASES = ["wake", "sync", "rollout", "sleep", "batch", "old_ref_logprobs", "forward", "backward", "optimizer", "log", "host"]


def step_table(args):
    """train.main for --steps steps on a STEP_CONFIGS config (+ --step-flags): the median step time
    over the steps after --skip-steps, its breakdown by phase (logs.PhaseReport: each phase ends
    with a device sync; batch and log are host work: the padded batch, and metrics, samples, viewer
    and console; host is the rest: Python between phases), and the GPU busy share:
    torch.cuda.utilization() (NVML: share of time a kernel ran) polled every 50 ms over the same
    steps. The per-step metrics are train.main's returned history; a step ends when its row is
    written to OUT/metrics.jsonl, whose "time" (unix seconds) bounds the window of GPU samples."""
    import shlex
    import tempfile

    import train
    out = tempfile.mkdtemp(prefix="nanorl-step-")
    argv = STEP_CONFIGS[args.step_config] + ["--model", args.model, "--steps", str(args.steps or 10),
                                            "--out-dir", out] + shlex.split(args.step_flags)
    util, stop = [], threading.Event()

    def poll():  # time.time(), not perf_counter: the clock of metrics.jsonl's "time"
        while not stop.wait(0.05):
            util.append((time.time(), torch.cuda.utilization()))

    threading.Thread(target=poll, daemon=True).start()
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
    try:
        summary = prof.runcall(train.main, argv) if prof is not None else train.main(argv)
    finally:
        stop.set()
        if prof is not None:
            write_profile(prof, args.profile)
    hist = summary["history"]
    with open(os.path.join(out, "metrics.jsonl")) as f:  # training steps only (an eval-only step 0 has no step time)
        ends = {r["step"]: r["time"] for r in map(json.loads, f) if "step_time_s" in r}
    k = args.skip_steps
    steps = hist[k:]
    t_first = ends[hist[k - 1]["step"]] if k else float("-inf")  # the window opens when the last warm-up step ends
    window = [u for t, u in util if t_first < t <= ends[hist[-1]["step"]]]
    med = lambda key: statistics.median(h.get(key, 0.0) for h in steps)  # noqa: E731
    row = {"config": args.step_config, "flags": args.step_flags, "model": args.model, "steps": f"{k + 1}-{len(hist)}",
           "step_s": med("step_time_s"), "step_s_all": [round(h["step_time_s"], 3) for h in hist],
           "gpu_busy": sum(window) / max(len(window), 1) / 100, "response_tokens": med("response_tokens"),
           "reward_mean": med("reward_mean"), "rollout_generate": med("rollout_generate_s"),
           "sync_check_ms": med("sync_check_ms")}
    row.update({p: med(f"time_{p}_s") for p in PHASES})
    # rollout and training compute (time_train_s: no-grad logprobs, forward, backward, AdamW); the
    # rest is wake/sleep, the weight sync, host work (the batch, logging, Python between phases);
    # per step, then the median (a ratio of medians would mix different steps)
    row["other_share"] = statistics.median(
        1 - (h.get("time_rollout_s", 0.0) + h.get("time_train_s", 0.0)) / h["step_time_s"] for h in steps)
    return [row]


def write_profile(prof, path):
    """The cProfile of a whole train.main run, restricted to functions outside vLLM's package: the
    rollout is vLLM's scheduler in Python, whose thousands of calls a step would drown the rest.
    (Built-ins called from vLLM, e.g. len, still count; vLLM's share shows in the caller's cumtime.)"""
    import pstats
    outside_vllm = r"^(?!.*[/\\]vllm[/\\])"  # pstats matches it against "file:line(function)"
    with open(path, "w") as f:
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=f).sort_stats(key).print_stats(outside_vllm, 45)


def episode_batch(path, tok, limit):
    """The trained rows (advantage != 0) of the last `limit` episodes of an episodes.jsonl (support/viewer.py),
    re-tokenized: (ids, attn, mask (B, T-1), adv (B,)). Re-encoding the decoded text gives the
    episodes' lengths and shared prefixes, not always their sampled ids: right for timing."""
    seqs, masks, adv = [], [], []
    for line in open(path).readlines()[-limit:]:
        e = json.loads(line)
        if not e["advantage"]:
            continue
        ids = tok(e["prompt"], add_special_tokens=False).input_ids
        m = [0] * len(ids)
        for seg in e["segments"]:  # runs of trained (model) and untrained (env) tokens
            t = tok(seg["text"], add_special_tokens=False).input_ids
            ids, m = ids + t, m + [int(seg["trained"])] * len(t)
        seqs.append(ids), masks.append(m), adv.append(e["advantage"])
    ids, attn = score.pad(seqs, tok.pad_token_id or 0)
    mask = torch.zeros(len(seqs), ids.shape[1] - 1)
    for b, m in enumerate(masks):
        mask[b, :len(m) - 1] = torch.tensor(m[1:], dtype=torch.float)  # column t scores token t + 1
    return ids, attn, mask, torch.tensor(adv)


def prefix_table(args):
    """--prefix-table EPISODES: the training phase of one step -- forward + backward of every trained
    row in the preset's micro-batches (l40s: 4 rows or 4 x 4096 tokens, gradient checkpointing, bf16
    autocast, LM head in 1024-token chunks), the policy-gradient sum loss -- padded, packed
    (--shared-prefix), and packed without prefix.packed_limit, side by side in one process on the
    same rows; each pass's time (the best of --reps after a warm-up), forwards, tokens through the
    decoder and torch's peak memory, and the cosine and relative difference of its gradient against
    the padded pass's (equal up to bf16 rounding)."""
    from unittest import mock

    from transformers import AutoTokenizer
    path, dev = model_source(args.model), torch.device("cuda")
    tok = AutoTokenizer.from_pretrained(path)
    ids, attn, mask, adv = episode_batch(args.prefix_table, tok, args.prefix_rows)
    model = on_device(load_model(path), dev, grad_checkpointing=True)
    model.train()  # transformers checkpoints activations in train mode only (train.py trains in it too)
    lengths, rows, ref = attn.sum(1), torch.arange(len(ids)), None

    def train_pass(shared):
        todo = (prefix.micro_batches if shared else score.micro_batches)(lengths, rows, 4, 4 * 4096, ids=ids)
        model.zero_grad(set_to_none=True)
        for idx in todo:
            T = int(lengths[idx].max())
            with torch.autocast("cuda", dtype=torch.bfloat16):
                fwd = prefix.sequence_logprobs if shared else sequence_logprobs
                logp, _ = fwd(model, ids[idx, :T].to(dev), attn[idx, :T].to(dev), 1.0, 1024)
            (-(adv[idx, None].to(dev) * logp * mask[idx, :T - 1].to(dev)).sum() / mask.sum()).backward()
        return todo

    out = []
    for name, shared, limit in (("padded", False, None), ("packed", True, None), ("packed, no limit", True, 10**9)):
        with mock.patch.object(prefix, "packed_limit", lambda p: limit) if limit else contextlib.nullcontext():
            train_pass(shared)  # warm-up: kernels, allocator
            torch.cuda.reset_peak_memory_stats()
            todo, secs = min((timed(lambda: train_pass(shared)) for _ in range(args.reps)), key=lambda r: r[1])
        grads = [p.grad.to("cpu", torch.bfloat16) for p in model.parameters()]  # off the GPU: peaks stay comparable
        ref = ref or grads  # the padded pass's
        s = torch.zeros(4, dtype=torch.float64)  # a.b, |a|^2, |b|^2, |a - b|^2 over every parameter
        for a, b in zip(grads, ref):
            a, b = a.float(), b.float()
            s += torch.stack([(a * b).sum(), a.square().sum(), b.square().sum(), (a - b).square().sum()]).double()
        tokens = sum(prefix.forward_tokens(lengths[i], prefix.shared_prefix_len(ids[i], lengths[i]) if shared else 0)
                     for i in todo)
        row = {"path": name, "rows": len(ids), "forwards": len(todo), "tokens": tokens, "s": secs,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "grad_cos": float(s[0] / (s[1] * s[2]).sqrt()),
               "grad_rel_diff": float((s[3] / s[2]).sqrt())}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def prefix_markdown(rows):
    head = "| training phase | rows | forwards | decoder tokens | s | x padded | peak GiB | grad cos | grad rel diff |\n"
    return head + "|---" * 9 + "|\n" + "\n".join(
        f"| {r['path']} | {r['rows']} | {r['forwards']} | {r['tokens']:,} | {r['s']:.2f} | {rows[0]['s'] / r['s']:.2f} "
        f"| {r['peak_gib']:.1f} | {r['grad_cos']:.5f} | {r['grad_rel_diff']:.4f} |" for r in rows)


def step_markdown(rows):
    head = "| config | flags | steps | median step s | " + " | ".join(PHASES) + " | not rollout/train | GPU busy |\n"
    head += "|---" * (len(PHASES) + 6) + "|\n"
    return head + "\n".join(f"| {r['config']} | {r['flags'] or 'defaults'} | {r['steps']} | {r['step_s']:.2f} | "
                            + " | ".join(f"{r[p]:.3f}" for p in PHASES)
                            + f" | {r['other_share']:.1%} | {r['gpu_busy']:.0%} |" for r in rows)


def process_probe(args):
    """--process-probe 0|1: is vLLM's generate faster with its engine core in a child process (1,
    vLLM's default) than in ours (0, as VLLMEngine runs it)? 32 random-token prompts of 120-220
    tokens x n = 8 x 256 sampled tokens (ignore_eos), 4 reps each without and with logprobs, each
    after a level-2 sleep and wake as train.py does; prints the seconds of every rep as JSON, and
    with --probe-profile a cProfile of one generate. vLLM only (checked against vLLM 0.26.0)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = args.process_probe  # read when vLLM is imported: set it first
    import random
    from vllm import LLM, SamplingParams
    llm = LLM(model=model_source(args.model), gpu_memory_utilization=0.3, enable_sleep_mode=True, dtype="bfloat16",
              max_model_len=4096, seed=0, logprobs_mode="processed_logprobs")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(120, 220))]} for _ in range(32)]
    res = {}
    for lp in (None, 0):
        sp = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=256, logprobs=lp, flat_logprobs=True,
                            detokenize=False, ignore_eos=True)
        ts = []
        for _ in range(4):
            llm.sleep(level=2)  # as train.py's loop does; the weights are garbage after level 2: fine for timing
            llm.wake_up()
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            ts.append(time.perf_counter() - t)
        res[f"logprobs={lp}"] = [round(x, 3) for x in ts]
    print("MP", args.process_probe, json.dumps(res), flush=True)
    if args.probe_profile:
        import cProfile
        import pstats
        sp = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=256, detokenize=False, ignore_eos=True)
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, sp, use_tqdm=False)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return res


# --scaling: 2-digit x 1-digit multiply with a k1 KL term, so every sequence trains (a non-zero
# gradient from the first step) even when a random-weight model earns no reward. --no-compile on both
# sides: --compile's default is on for one GPU and off under torchrun, and a compiled one-GPU step
# against eager ranks would charge the compile's gain (~1.6x on the training phase) to scaling
# (--step-flags="--compile" compares compiled against compiled)
SCALING_FLAGS = ["--gpu", "h200", "--env", "multiply", "--digits", "2,1", "--fewshot", "2", "--max-tokens", "128",
                 "--max-context", "512", "--n", "8", "--kl-coef", "0.001", "--kl-type", "k1", "--lora-rank", "0",
                 "--eval-every", "0", "--save-every", "-1", "--viewer-groups", "0", "--no-compile"]


def scaling_run(gpus, args, apart=False):
    """train.py on GPU 0 (gpus 1) or under torchrun on gpus GPUs, --step-prompts prompts per GPU.
    apart: gpus one-GPU runs at once instead, each on its own GPU with its share of the cores (no DDP,
    the same host load): what a rank's phases cost without the gradient all-reduce."""
    import shlex
    import subprocess
    prompts = args.step_prompts * (1 if apart else gpus)
    name = f"{Path(args.model).name}-{gpus}gpu" + ("-apart" if apart else "")
    flags = SCALING_FLAGS + ["--model", args.model, "--steps", str(args.steps or 8), "--prompts-per-step", str(prompts),
                             *shlex.split(args.step_flags)]
    # torchrun sets OMP_NUM_THREADS=1 in every rank unless told otherwise; give each rank its share of the cores
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or gpus) // gpus))
    if gpus == 1:
        runs = [([sys.executable, "train.py", *flags], dict(os.environ, CUDA_VISIBLE_DEVICES="0"), name)]
    elif apart:
        runs = [([sys.executable, "train.py", *flags], dict(os.environ, CUDA_VISIBLE_DEVICES=str(g), OMP_NUM_THREADS=threads),
                 f"{name}{g}") for g in range(gpus)]
    else:
        runs = [([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--", "train.py", *flags],
                 dict(os.environ, OMP_NUM_THREADS=threads), name)]
    procs = []
    for cmd, env, out in runs:  # all at once
        log = open(Path(args.out) / f"{out}.log", "w")
        procs.append((subprocess.Popen(cmd + ["--out-dir", str(Path(args.out) / out)], cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT), cmd, out, log))
    for proc, cmd, out, log in procs:
        if proc.wait():
            sys.exit(f"{' '.join(cmd)} failed (rc {proc.returncode}); see {Path(args.out) / out}.log")
        log.close()
    res = [run_figures(Path(args.out) / out) for _, _, out, _ in procs]
    train_tok_s = statistics.mean(r["train_tok_s"] for r in res) if all("train_tok_s" in r for r in res) else None
    phases = {k: statistics.mean(r["phases"].get(k, 0.0) for r in res) for k in res[0]["phases"]}  # apart: their mean
    return {"gpus": gpus, "apart": apart, "prompts_per_step": prompts * len(res), "episodes": sum(r["episodes"] for r in res),
            "step_s": statistics.mean(r["step_s"] for r in res), "rollout_s": phases["rollout"], "train_s": phases["train"],
            "phases": phases, "episodes_per_s": sum(r["episodes_per_s"] for r in res),
            "response_tokens": sum(r["response_tokens"] for r in res),
            "rollout_tok_s": sum(r["rollout_tok_s"] for r in res) / gpus,  # a GPU's: metrics count every rank's episodes
            "train_tok_s": train_tok_s,  # a GPU's
            "mfu": mfu(model_params(args.model), train_tok_s, 1.0, peak_flops(gpu_name())[1]) if train_tok_s else None}


def model_params(model):
    """The parameter count of --model's config (a meta model: no weights read), for MFU."""
    from options.memory import meta_model
    return sum(p.numel() for p in meta_model(model_source(model)).parameters())


def gpu_name():
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


# Peak dense bf16 tensor FLOP/s (no 2:4 sparsity) from NVIDIA's datasheets, by a piece of
# torch.cuda.get_device_name(); first match wins (the PCIe H100 before the SXM one)
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("L40S", 362e12),
             ("A100", 312e12)]


def peak_flops(name):
    """(the datasheet entry's name, its peak dense bf16 FLOP/s), or (None, None) for a GPU not listed."""
    return next(((k, v) for k, v in PEAK_BF16 if k in (name or "")), (None, None))


def mfu(n_params, tokens, seconds, peak):
    """Model FLOPs utilisation of a training phase: 6 N T / t / peak (forward 2 N, backward 4 N FLOPs per
    token; attention's T^2 terms and the no-grad forwards of old and reference logprobs left out, so
    it is a lower bound on the hardware's use). None without a known peak."""
    return 6 * n_params * tokens / seconds / peak if peak and seconds else None


def run_figures(out):
    """A train.py run's medians over steps 3.. (the first steps compile and warm up): step time, every
    time_*_s phase, episodes/s, the rollout's generated tokens/s, and where train.py reports
    trained_tokens the training phase's tokens/s (per GPU: the ranks' mean of trained_tokens over rank
    0's time_train_s), what MFU is made of."""
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if r["step"] >= 3] or rows
    step_s = statistics.median(r["step_time_s"] for r in steps)
    phases = {k[5:-2]: statistics.median(r.get(k, 0.0) for r in steps)  # every time_*_s: where a step goes
              for k in sorted({k for r in steps for k in r if k.startswith("time_") and k.endswith("_s")})}
    res = {"episodes": rows[-1]["episodes"], "step_s": step_s, "phases": phases,
           "episodes_per_s": rows[-1]["episodes"] / step_s, "response_tokens": rows[-1]["response_tokens"]}
    res["rollout_tok_s"] = statistics.median(r["episodes"] * r["response_tokens"] / r["time_rollout_s"] for r in steps)
    if all("trained_tokens" in r for r in steps):
        res["train_tok_s"] = statistics.median(r["trained_tokens"] / r["time_train_s"] for r in steps)
    return res


def scaling(args):
    """--scaling N: throughput on 1 GPU and on N (torchrun, support/dist.py) at a fixed batch per GPU:
    the median step time over steps 3.., episodes/s and the ratio (N-GPU over 1-GPU episodes/s; N is
    perfect); appends a line to OUT/scaling.json (--out: a folder here, default runs/scaling)."""
    args.out = args.out or "runs/scaling"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    one, many = scaling_run(1, args), scaling_run(args.scaling, args)
    apart = scaling_run(args.scaling, args, apart=True) if args.apart else None
    ratio = many["episodes_per_s"] / one["episodes_per_s"]
    label, peak = peak_flops(gpu_name())
    for r in (one, many) + ((apart,) if apart else ()):
        what = f"{r['gpus']} GPU" + (" runs apart (no DDP), each" if r.get("apart") else "")
        print(f"{args.model} {what}: {r['prompts_per_step']} prompts x n -> {r['episodes']} episodes, "
              f"step {r['step_s']:.2f} s (rollout {r['rollout_s']:.2f}, train {r['train_s']:.2f}), "
              f"{r['episodes_per_s']:.0f} episodes/s")
        print("   phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items()))
        print(f"   rollout {r['rollout_tok_s']:,.0f} generated tok/s a GPU; training phase "
              + (f"{r['train_tok_s']:,.0f} tok/s, MFU " if r.get("train_tok_s") else "MFU ")
              + (f"{r['mfu']:.1%} of {label}'s {peak / 1e12:.0f} TFLOP/s dense bf16 (6 N T / time_train_s)" if r.get("mfu")
                 else "n/a (a GPU not in PEAK_BF16, or train.py without the trained_tokens metric)"))
    print(f"{args.model} scaling {args.scaling} GPUs / 1 GPU: {ratio:.2f}x"
          + (f"; {args.scaling} runs apart / 1 GPU: {apart['episodes_per_s'] / one['episodes_per_s']:.2f}x" if apart else ""))
    with open(Path(args.out) / "scaling.json", "a") as f:
        f.write(json.dumps({"model": args.model, "one": one, "many": many, "apart": apart, "ratio": ratio}) + "\n")
