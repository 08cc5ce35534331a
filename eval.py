r"""
Evaluate models on an env without training: greedy pass@1, sampled pass@k with standard errors, a
per-source breakdown, several models side by side. Same rows, envs, rewards, MCP servers, chat
templates and engines as train.py (vLLM on a GPU, the HF engine on the CPU), so a score means the
same thing in both places: train.py's in-loop eval scores its episodes with `tally` below.

    python eval.py --model smollm2 --model runs/nanorl        # base vs trained (python train.py's run), CPU
    python eval.py --model Qwen/Qwen2.5-1.5B-Instruct --model runs/qwen --env gsm8k --gpu h100   # vLLM
    python eval.py --model runs/sft --env mcp --eval-data ROWS --k 1,4,16 --n 16
    python -m pytest -q tests/test_eval.py

--model: a hub id, an HF folder, the embedded `smollm2`, a train.py run folder (its latest checkpoint)
or checkpoint (OUT/ckpt/step_N), or a LoRA adapter folder (adapter_config.json, PEFT's layout, as a
LoRA run saves it): its base, the base_model_name_or_path written there, with the adapter merged into
its weights (support/sources.merge_adapter), the model a LoRA run's vLLM engine samples from.

Per model, on the R rows (the first --limit of the eval split, envs.load_splits; the defaults are
the rows and limits train.py evaluates with the same --gpu and --env, config.preset_for):
  greedy pass@1   temperature 0, one episode a row, the share the env marks correct (info["correct"],
                  not reward > 0: a format reward is no pass). Computed by tally: train.py's eval_pass1.
  pass@k          n episodes a row at --temperature (1), c of them correct. Per row the unbiased
                  estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"),
                      pass@k_r = 1 - C(n - c, k) / C(n, k)        (1 when n - c < k)
                  the chance that k of the n samples, drawn without replacement, hold a correct one;
                  pass@k = mean_r pass@k_r, and pass@1_r = c / n. Python's exact integers (math.comb)
                  make the paper's product form, there for float overflow, unnecessary.
  standard error  SE = sd_r(x_r) / sqrt(R), sd with R - 1 in the denominator (x_r: a row's pass, or
                  its pass@k_r): the error of a mean over rows drawn from a larger pool of tasks; a
                  row's own sampling noise is part of the spread. None for a single row; 0 when every
                  row scores the same (all right or all wrong): no spread seen, not certainty.
  by source       the same rates per row["data_source"] (the bundled MCP tasks: one per family; a
                  prefix some of them share, as unseen/ of unseen/multi and unseen/state, too), and
                  for MCP the greedy episodes' tool calls, failed calls (tool errors) and repeated
                  calls per episode: repeat_calls, identical to an earlier call of the episode, and
                  repeat_failed, identical to an earlier failed one (the table: "1.000 (0.500)");
                  stale_repeats (eval.json), those that got the same result again; and
                  invented_calls, calls passing a number or date that no earlier text showed; and
                  error_answers, wrong answers that speak of an error (the model stopped at one); and
                  unfounded_answers, other wrong answers that no user turn or tool result showed.
  episodes        logs.episode_metrics of the greedy and of the sampled episodes: turns, response
                  tokens, finish reasons; for MCP tool calls, tool errors, repeated calls, timeouts,
                  parse rate.
  tool format     the tool-call family whose parser reads MCP calls (mcp_tools/formats.py): --tool-format,
                  or auto, each model's own, detected from its chat template once the MCP pool is
                  open (it may install a tool template), as train.py does (mcp_tools/formats.resolve_tool_format;
                  its end-of-call tokens stop a turn). In eval.json and the parse rate's label.
BFCL multi-turn (mcp_tools/bfcl.py; bfcl-eval on PYTHONPATH, as its docstring installs it): each
category's rows (data_source bfcl/<category>) get their by-source lines, and a last table sets their
greedy pass@1 beside the BFCL paper's Qwen2.5-1.5B-Instruct (BFCL_PAPER; another model, for scale):
    python -m mcp_tools.bfcl rows --category all --out data/out/bfcl/all.jsonl     # 800 rows
    python -m mcp_tools.bfcl config --out data/out/bfcl/mcp.json
    python eval.py --env mcp --mcp-config data/out/bfcl/mcp.json --eval-data data/out/bfcl/all.jsonl \
        --limit 800 --n 0 --max-context 32768 --max-tokens 512 --gpu l40s --model Qwen/Qwen2.5-Coder-1.5B-Instruct
(32K: a row's tools are up to ~5K tokens, and long_context's results up to ~8K each, shown uncut.)
Outputs: the table on the console (markdown: metric rows, one column per model), OUT/eval.json (per
model these numbers, the model's folders, and the config) and the episode viewer page
OUT/episodes.html (support/viewer.py): "step" i is the i-th --model, with the greedy episode of every row
and the sampled episodes of the first --viewer-groups rows. Each file is rewritten after every model.

Choices: models run one after another, each with freshly started MCP servers, so every model sees
the same server state. On the CPU each gets its own HF engine and the same RNG state (--seed). On a
GPU one vLLM engine (bf16, never asleep, the preset's --gpu-memory-utilization) serves them all: it
starts from the first model's folder (a LoRA adapter's: its base), and every later model, and every
adapter as W + (alpha/r) B A, goes in through the trainer's weight sync (engine.load_weights, with
its logprob check of engine vs model), so the models must share one architecture; the sampling RNG
runs on across models. Bad input fails as in train.py, before any weights load: rows are validated
as they load, every --model is resolved and its tokenizer loaded first; one error line.
"""
import json
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: train.py says why
import torch  # noqa: E402

import envs
from config import PRESETS, USER_ERRORS, Parser, preset_for, require_cuda
from mcp_tools.config import MAX_SECONDS, sane_seconds
from mcp_tools.formats import resolve_tool_format  # pure parsers: no MCP SDK
from rollout import HFEngine, run_episodes, stop_token_ids
from support import viewer
from support.checkpoint import find_checkpoint
from support.logs import episode_metrics, tally  # noqa: F401 (tally: what train.evaluate sums)
from support.sources import EMBEDDED, load_model, load_tokenizer, merge_adapter, model_source

# ---- scoring: pure functions of episodes (train.evaluate reports tally's sums)


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n samples (c correct), drawn without
    replacement, hold a correct one. Exact integers; int / int rounds once."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def standard_error(xs) -> float | None:
    """sd(xs) / sqrt(len(xs)), sd with len - 1 in the denominator; None for fewer than 2 values."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def rates(greedy, sampled, ks) -> dict:
    """Pass rates of some rows: greedy, one episode a row; sampled, a list of n episodes a row
    (empty: no sampling). Keys: rows, greedy_pass@1, greedy_reward, pass@k (sampled), each rate
    with its _se."""
    passes, reward, count = tally(greedy)
    m = {"rows": count, "greedy_pass@1": passes / count,
         "greedy_pass@1_se": standard_error([float(e.passed()) for e in greedy]), "greedy_reward": reward / count}
    for k in ks if sampled else []:
        xs = [pass_at_k(len(eps), sum(e.passed() for e in eps), k) for eps in sampled]  # (R,) per row
        m[f"pass@{k}"], m[f"pass@{k}_se"] = sum(xs) / len(xs), standard_error(xs)
    if sampled:
        m["sampled_reward"] = sum(e.reward for eps in sampled for e in eps) / sum(len(eps) for eps in sampled)
    return m


def source_groups(sources) -> dict:
    """The row sets by_source reports, name -> row indices, in first-seen order: each data_source, and
    before its members each prefix (up to a "/") that two or more of them share and the others do not:
    unseen/multi and unseen/state also make unseen; nanorl_mcp/arith, ... all alike make none."""
    names = list(dict.fromkeys(sources))
    groups = []
    for s in names:
        parts = s.split("/")
        for prefix in ("/".join(parts[:j]) for j in range(1, len(parts))):
            if 1 < sum(t.startswith(prefix + "/") for t in names) < len(names) and prefix not in groups:
                groups.append(prefix)
        groups.append(s)
    return {g: [i for i, x in enumerate(sources) if x == g or x.startswith(g + "/")] for g in groups}


def score(greedy, sampled, n, sources, ks) -> dict:
    """One model's numbers. greedy: one episode a row, sampled: n a row (or none), both in row order
    (run_episodes' order); sources: each row's data_source."""
    by_row = [sampled[i * n:(i + 1) * n] for i in range(len(greedy))] if sampled else []
    m = rates(greedy, by_row, ks)
    m["by_source"] = {}
    for s, idx in source_groups(sources).items():
        sub = [greedy[i] for i in idx]
        m["by_source"][s] = rates(sub, [by_row[i] for i in idx] if by_row else [], ks)
        em = episode_metrics(sub, len(sub), 1)  # MCP: how many calls each source's rows make, how many fail
        for key in ("tool_calls", "tool_errors", "repeat_calls", "repeat_failed", "stale_repeats", "invented_calls",
                    "error_answers", "unfounded_answers", "user_turns_done", "turns_passed"):
            if key in em:
                m["by_source"][s][f"greedy_{key}"] = em[key]
    drop = ("episodes", "gen_rounds", "kept_frac")  # a training step's bookkeeping, not the episodes'
    for name, eps in (("greedy", greedy), ("sampled", sampled)):
        if eps:
            m[name] = {k: v for k, v in episode_metrics(eps, len(eps), 1).items() if k not in drop}
    return m

# ---- models: what --model names, and its engine


def resolve(name: str) -> dict:
    """{"weights": HF folder or hub id, "adapter": LoRA folder or None, "lora": its config, "tokenizer"}.
    A train.py run folder means its latest checkpoint (checkpoint.find_checkpoint)."""
    path = Path(name).expanduser()
    if path.is_dir() and ((path / "ckpt").is_dir() or (path / "trainer_state.pt").is_file()):
        try:
            path = find_checkpoint(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"--model {name}: a train.py run folder without a complete checkpoint") from None
    if (path / "adapter_config.json").is_file():
        cfg = json.loads((path / "adapter_config.json").read_text())
        if not cfg.get("base_model_name_or_path"):
            raise ValueError(f"--model {name}: {path / 'adapter_config.json'} names no base_model_name_or_path")
        base = model_source(cfg["base_model_name_or_path"])
        tok = path if (path / "tokenizer_config.json").is_file() else base  # train.py's checkpoints have one
        return {"weights": base, "adapter": str(path), "lora": cfg, "tokenizer": str(tok)}
    src = model_source(str(path) if path.is_dir() else name)
    return {"weights": src, "adapter": None, "lora": None, "tokenizer": src}


def load_engine(spec: dict, tokenizer, args, engine=None):
    """The rollout engine holding this model's weights: a new HFEngine on the CPU (float32); on a GPU
    one vLLM engine (bf16) for every model, started from the first one's folder, into which each
    later model and any LoRA adapter, merged (W + (alpha/r) B A), is pushed by the trainer's weight sync."""
    gpu, model = args.gpu != "cpu", None
    if not gpu or spec["adapter"] or engine is not None:  # float32, or a LoRA base (bf16 on a GPU) + its adapter
        model = load_model(spec["weights"], torch.bfloat16 if gpu and spec["adapter"] else torch.float32)
        if spec["adapter"]:  # W + (alpha/r) B A: the weights a LoRA run's engine gets
            merge_adapter(model, spec["adapter"])
        model = model.to("cuda" if gpu else "cpu")
    if not gpu:
        return HFEngine(model, tokenizer)
    if engine is None:  # vLLM 0.26 in-process: a second engine after close() fails its CUDA graph capture
        from vllm_engine import VLLMEngine  # (a PyTorch allocator assert, seen on an H100), hence one engine for all models
        engine = VLLMEngine(spec["weights"], seed=args.seed, sleep_level=0, max_model_len=args.max_context,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else None)
    if model is not None:  # sync.push, then its logprob check of engine vs this model (once probes exist)
        engine.load_weights(model)
        del model
        torch.cuda.empty_cache()
    return engine


def architecture(spec: dict) -> dict:
    """What vLLM builds its model from (config.json), to check that a later model's weights fit it."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(spec["weights"]).to_dict()
    return {k: c.get(k) for k in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                  "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rope_scaling",
                                  "rope_parameters", "rms_norm_eps", "hidden_act")}


def play(engine, tokenizer, rows, pool, stop_ids, args, n, temperature, fmt):
    """n episodes a row, played as train.py's rollouts play them (top_p 1, no logprobs needed)."""
    make_env = lambda row: envs.env_for_row(row, args.env, pool, args.max_turns, args.format_reward,  # noqa: E731
                                            tool_format=fmt)
    return run_episodes(engine, tokenizer, rows, make_env, n=n, temperature=temperature, top_p=1.0,
                        max_tokens=args.max_tokens, max_turns=None, max_context=args.max_context,
                        stop_token_ids=stop_ids, progress=not args.no_progress, logprobs=False)


def evaluate_model(i, name, spec, tokenizer, rows, args, engine=None) -> tuple:
    """(model i's metrics, its viewer records (step i), the engine: vLLM's is kept for the next model)."""
    t0 = time.perf_counter()
    stop_ids = stop_token_ids(tokenizer)  # a turn ends at the template's end-of-turn token, as in training
    pool = None
    try:
        pool = envs.open_mcp_pool([rows], args.env, args.mcp_config, args.tool_timeout, tokenizer)
        # per model (two --model may write calls two ways), after the pool may have installed a tool
        # template; the family's end-of-call tokens join the stop ids, as in train.py
        fmt, stop_ids = resolve_tool_format(args.tool_format, tokenizer, stop_ids)
        engine = load_engine(spec, tokenizer, args, engine)
        torch.manual_seed(args.seed)  # the HF engine: each model samples from the same RNG state
        random.seed(args.seed)
        greedy = play(engine, tokenizer, rows, pool, stop_ids, args, 1, 0.0, fmt)
        sampled = play(engine, tokenizer, rows, pool, stop_ids, args, args.n, args.temperature, fmt) if args.n else []
    finally:
        if pool is not None:
            pool.close()
    m = {"model": name, **{k: spec[k] for k in ("weights", "adapter")},
         "tool_format": fmt if pool is not None else None,  # None: no MCP rows, no tool calls to parse
         **score(greedy, sampled, args.n, [r["data_source"] for r in rows], args.k),
         "time_s": time.perf_counter() - t0}
    for eps, how in ((greedy, "greedy"), (sampled, f"T={args.temperature:g}")):
        for e in eps:  # shown with each episode on the page
            e.info.update(model=name, sampling=how)
    records = viewer.episode_records(i, greedy, tokenizer, groups=len(rows))
    records += viewer.episode_records(i, sampled, tokenizer, groups=args.viewer_groups)
    return m, records, engine

# ---- the console table and the files


def _cell(m, key):
    if key not in m:
        return "-"
    se = m.get(f"{key}_se")
    return f"{m[key]:.3f}" + (f" ± {se:.3f}" if se is not None else "")


REPEATS = "repeated calls (of failed ones) / episode"  # repeat_failed counts a subset of repeat_calls
INVENTED = "calls with an invented number or date / episode"  # mcp_tools/rewards.invented
GAVE_UP = "wrong answers that speak of an error / episode"  # mcp_tools/env.py's error_answer
GUESSED = "other wrong answers no result showed / episode"  # mcp_tools/env.py's unfounded_answer


USER_TURNS = "user turns answered / user turns"  # conversations: the model replied without a call
TURNS_PASSED = "user turns passed before a failing one / user turns"  # BFCL (mcp_tools/bfcl.BFCLEnv)
# BFCL paper (Patil et al., ICML 2025), Table 1, function-calling mode, multi-turn accuracy in %:
# Qwen2.5-1.5B-Instruct. Another model than Qwen2.5-Coder-1.5B-Instruct: a scale, not a baseline
BFCL_PAPER = {"bfcl/base": 4.0, "bfcl/miss_func": 1.5, "bfcl/miss_param": 3.0, "bfcl/long_context": 1.5}


def bfcl_table(results) -> str:
    """Each BFCL multi-turn category's greedy pass@1 (%) beside the paper's Qwen2.5-1.5B-Instruct;
    "" when no row is a BFCL one."""
    cats = [s for s in BFCL_PAPER if any(s in r["by_source"] for r in results)]
    if not cats:
        return ""
    head = " | ".join(r["model"] for r in results)
    lines = [f"| BFCL multi-turn, greedy pass@1 (%) | {head} | paper: Qwen2.5-1.5B-Instruct, FC (another model) |",
             "|---" * (len(results) + 2) + "|"]
    for s in cats:
        cells = [f"{100 * r['by_source'][s]['greedy_pass@1']:.1f} ({r['by_source'][s]['rows']} rows)"
                 if s in r["by_source"] else "-" for r in results]
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {BFCL_PAPER[s]:.1f} |")
    return "\n".join(lines)


def _repeats(m, key):
    """'1.000 (0.500)': key (repeat_calls or greedy_repeat_calls) and, in brackets, its repeat_failed twin."""
    failed = key.replace("repeat_calls", "repeat_failed")
    return "-" if key not in m else f"{m[key]:.3f} ({m.get(failed, 0.0):.3f})"


def table(results, ks, n, temperature) -> str:
    """Markdown: one row per metric, one column per model (± is one standard error)."""
    lines = [("metric", [r["model"] for r in results]), ("rows", [str(r["rows"]) for r in results]),
             ("greedy pass@1", [_cell(r, "greedy_pass@1") for r in results])]
    lines += [(f"pass@{k} (T={temperature:g}, n={n})", [_cell(r, f"pass@{k}") for r in results]) for k in ks if n]
    lines.append(("greedy reward", [_cell(r, "greedy_reward") for r in results]))
    fmts = " / ".join(dict.fromkeys(r["tool_format"] for r in results if r.get("tool_format")))  # per model
    for key, label in (("turns", "turns / episode"), ("tool_calls", "tool calls / episode"),
                       ("tool_errors", "tool errors / episode"), ("repeat_calls", REPEATS),
                       ("invented_calls", INVENTED), ("error_answers", GAVE_UP), ("unfounded_answers", GUESSED),
                       ("user_turns_done", USER_TURNS),
                       ("turns_passed", TURNS_PASSED),
                       ("tool_parse_rate", "tool-call parse rate"),
                       ("response_tokens", "response tokens"), ("finish_length", "cut by a length limit")):
        if any(key in r["greedy"] for r in results):  # the tool rows: MCP episodes only
            how = f"greedy, {fmts}" if key == "tool_parse_rate" and fmts else "greedy"  # the parsers' families
            cell = _repeats if key == "repeat_calls" else _cell
            lines.append((f"{label} ({how})", [cell(r["greedy"], key) for r in results]))
    sources = list(dict.fromkeys(s for r in results for s in r["by_source"]))
    for s in sources if len(sources) > 1 else []:
        for key in ["greedy_pass@1"] + ([f"pass@{max(ks)}"] if n else []):
            lines.append((f"{s}: {key.replace('_', ' ')}", [_cell(r["by_source"].get(s, {}), key) for r in results]))
        for key, label in (("greedy_tool_calls", "tool calls / episode"), ("greedy_tool_errors", "tool errors / episode"),
                           ("greedy_repeat_calls", REPEATS), ("greedy_invented_calls", INVENTED), ("greedy_error_answers", GAVE_UP),
                           ("greedy_unfounded_answers", GUESSED),
                           ("greedy_user_turns_done", USER_TURNS), ("greedy_turns_passed", TURNS_PASSED)):
            if any(key in r["by_source"].get(s, {}) for r in results):
                cell = _repeats if key == "greedy_repeat_calls" else _cell
                lines.append((f"{s}: {label} (greedy)", [cell(r["by_source"].get(s, {}), key) for r in results]))
    out = [f"| {label} | " + " | ".join(cells) + " |" for label, cells in lines]
    return "\n".join(out[:1] + ["|---" * (len(results) + 1) + "|"] + out[1:])


def write_outputs(out_dir: Path, report: dict, records: list):
    """OUT/eval.json, OUT/episodes.jsonl and the page made from it, OUT/episodes.html."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(report, indent=1))
    (out_dir / "episodes.jsonl").unlink(missing_ok=True)
    viewer.append_episodes(out_dir / "episodes.jsonl", records)
    viewer.write_html(out_dir / "episodes.jsonl", out_dir / "episodes.html")

# ---- flags and main


def parse_args(argv=None):
    p = Parser(description="Evaluate models on an env without training (eval.py's docstring has the formulas)")
    g = p.add_argument_group("common flags")
    g.add_argument("--model", action="append", required=True, help=f"repeat to compare: hub id, HF folder, "
                   f"'{EMBEDDED}', a train.py run or checkpoint folder, or a LoRA adapter folder")
    g.add_argument("--env", choices=list(envs.ENV_CLASSES), default="multiply", help="env for rows without env_class")
    g.add_argument("--eval-data", default=None, help="rows (.jsonl/.parquet); default: train.py's eval split "
                   "(generated multiply / MCP test tasks, data/out/gsm8k/test.jsonl)")
    g.add_argument("--mcp-config", default=None, help="mcpServers JSON file (default: the bundled server)")
    g.add_argument("--tool-format", default="auto", help="mcp: how the models write tool calls: auto (each model's "
                   "from its chat template), hermes, qwen3-xml, llama3-json or mistral (mcp_tools/formats.py)")
    g.add_argument("--k", default="1,8", help="comma-separated k of the sampled pass@k (each <= --n)")
    g.add_argument("--n", type=int, default=None, help="samples a row for pass@k (default: the largest k; 0: greedy only)")
    g.add_argument("--limit", type=int, default=None, help="evaluate the first N rows (default: the preset's --eval-limit)")
    g.add_argument("--gpu", choices=list(PRESETS), default="cpu", help="cpu: HF engine; a GPU preset: vLLM")
    g.add_argument("--out-dir", default="runs/eval", help="eval.json and episodes.html go here")
    g.add_argument("--seed", type=int, default=0, help="generated rows and sampling")
    g = p.add_argument_group("advanced (defaults: train.py's preset for --gpu and --env)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of pass@k (> 0)")
    g.add_argument("--max-tokens", type=int, default=None, help="sampled tokens per turn")
    g.add_argument("--max-context", type=int, default=None, help="prompt + response token limit per episode")
    g.add_argument("--max-turns", type=int, default=None, help="policy turns per episode, per user turn "
                   "in conversations (default: env's; mcp 8, bfcl 20)")
    g.add_argument("--digits", default=None, help="multiply: digits of each factor, N or A,B (generated rows)")
    g.add_argument("--fewshot", type=int, default=None, help="generated rows: worked examples before each question")
    g.add_argument("--format-reward", type=float, default=None, help="reward for a well-formed wrong answer (no pass)")
    g.add_argument("--tool-timeout", type=float, default=30.0, help="seconds a tool call may take (0 < s <= 86400)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share of the GPU's memory")
    g.add_argument("--kv-cache-gb", type=float, default=None, help="vLLM's KV cache size in GiB, fixed (as train.py's: "
                   "for a GPU shared with another run, whose memory changes would fail vLLM's start-up profiling)")
    g.add_argument("--viewer-groups", type=int, default=4, help="rows whose sampled episodes go on the page")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = p.parse_args(argv)
    preset = preset_for(args.gpu, args.env)
    for k in ("max_tokens", "max_context", "max_turns", "digits", "fewshot", "format_reward", "gpu_memory_utilization"):
        if getattr(args, k) is None:  # the flags this script shares with train.py, and their defaults
            setattr(args, k, preset.get(k))
    args.limit = preset["eval_limit"] if args.limit is None else args.limit
    try:
        args.k = sorted({int(k) for k in args.k.split(",")})
    except ValueError:
        p.error(f"--k {args.k}: comma-separated integers, e.g. 1,8")
    args.n = max(args.k) if args.n is None else args.n
    if min(args.k) < 1 or (args.n and max(args.k) > args.n) or args.n < 0:
        p.error(f"--k {','.join(map(str, args.k))} --n {args.n}: need 1 <= k <= n (n = 0: greedy only)")
    if args.kv_cache_gb is not None and not args.kv_cache_gb > 0:
        p.error(f"--kv-cache-gb {args.kv_cache_gb:g}: want a positive number of GiB")
    if min(args.limit, args.max_tokens, args.max_context) < 1 or args.temperature <= 0:
        p.error("--limit, --max-tokens and --max-context must be >= 1, --temperature > 0")
    if not sane_seconds(args.tool_timeout):  # 0, nan, inf: every call "timed out after 0 s"; 1e10 overflowed
        p.error(f"--tool-timeout {args.tool_timeout:g}: want a positive number of seconds, at most {MAX_SECONDS:g} (a day)")
    from mcp_tools.formats import FORMATS
    if args.tool_format not in ("auto", *FORMATS):  # fails here, not after the first model's weights load
        p.error(f"--tool-format {args.tool_format}: unknown; known: auto, {', '.join(FORMATS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    if (out_dir / "metrics.jsonl").exists() or (out_dir / "ckpt").exists():
        raise FileExistsError(f"--out-dir {out_dir} holds a training run: pick another folder for the eval")
    require_cuda(args.gpu)
    if args.mcp_config and not args.eval_data:  # the bundled tasks call the bundled server's tools
        raise ValueError("--mcp-config names your own servers: pass your rows with --eval-data "
                         "(the bundled tasks need the bundled server)")
    # bad rows or models fail before any weights load. With --eval-data, load_splits' train split is
    # the same file (gsm8k then needs no data/out/gsm8k/train.jsonl); rows are validated as they load
    _, rows = envs.load_splits(args.env, args.eval_data, args.eval_data, digits=args.digits, fewshot=args.fewshot,
                               seed=args.seed, eval_limit=args.limit, eval_every=1)
    specs = [resolve(name) for name in args.model]
    tokenizers = [load_tokenizer(s["tokenizer"], name) for s, name in zip(specs, args.model)]
    if args.gpu != "cpu":  # one vLLM engine takes every model's weights: one architecture
        for name, spec in zip(args.model[1:], specs[1:]):
            if architecture(spec) != architecture(specs[0]):
                raise ValueError(f"--model {name}: another architecture than --model {args.model[0]}; on a GPU one "
                                 "vLLM engine takes every model's weights: run eval.py once per architecture")
    print("config", json.dumps(vars(args), sort_keys=True))
    report, records, engine = {"config": vars(args), "models": []}, [], None
    try:
        for i, (name, spec, tok) in enumerate(zip(args.model, specs, tokenizers)):
            m, recs, engine = evaluate_model(i, name, spec, tok, rows, args, engine)
            report["models"].append(m)
            records += recs
            write_outputs(out_dir, report, records)
            print(f"{name}: greedy pass@1 {_cell(m, 'greedy_pass@1')} on {m['rows']} rows ({m['time_s']:.0f} s)",
                  flush=True)
    finally:
        if hasattr(engine, "close"):  # vLLM's
            engine.close()
    print(table(report["models"], args.k, args.n, args.temperature))
    if bfcl := bfcl_table(report["models"]):
        print(bfcl)
        report["bfcl_paper"] = BFCL_PAPER  # the anchors printed beside the figures (BFCL_PAPER's comment)
        write_outputs(out_dir, report, records)
    print(f"wrote {out_dir / 'eval.json'} and {out_dir / 'episodes.html'}")
    return report


def cli(argv=None):
    """`python eval.py`: main, with what a user fixes (flags, rows, models, servers) printed as one
    line, `error: ...`, and exit status 1, not a traceback (as train.cli)."""
    try:
        return main(argv)
    except USER_ERRORS as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    cli()
