"""
Supervised warm start on oracle tool-use trajectories, before RL (a "cold start" SFT).

    python sft.py --out-dir runs/sft                       # embedded SmolLM2, bundled MCP tasks (GPU if any)
    python sft.py --device cuda --model M --out-dir runs/sft   # on a GPU: bf16 autocast
    python train.py --env mcp --model runs/sft ...          # then RL from the warm-started model
    python sft.py --train-data data/out/mcp-seen/train.jsonl ...    # your rows: lab/recipes/headline.sh trains on seven families
    python -m pytest -q tests/test_train.py   (its sft.py section)

Why: RL only learns from what the policy already samples. SmolLM2-135M-Instruct never writes a
<tool_call> (0 in 512 sampled episodes on an H100, samples.jsonl), so every MCP reward is 0 and
GRPO has nothing to push on. A few hundred supervised steps on correct trajectories teach the
call format; RL then improves which calls and answers it makes.

The data is played, not written: for every training row (extra_info.oracle_calls, see
mcp_tools/tasks.py) an MCPEnv episode runs against the real servers, the assistant turns being
    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>        one oracle call a turn
    <answer>{oracle_answer}</answer>                                     the last turn
and the tool messages being whatever the server answered. Rows whose replay does not score
reward 1 are skipped (and counted). Tokens are laid out exactly as rollout.run_episodes lays out
an RL episode (render_prompt, then each assistant turn + the template's end-of-turn token with
mask 1, then observation_ids with mask 0), so SFT and RL train the same token sequence.

Loss: -sum(mask * log p(token)) / sum(mask) over each optimizer batch (token-mean, as RL's
default reduction), float32 weights, bf16 autocast on a GPU, AdamW, linear warmup then constant.
The result is an HF folder (the tool-aware chat template saved with the tokenizer) that
AutoModelForCausalLM, vLLM and train.py --model load.
"""
import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: train.py says why
import torch  # noqa: E402

from score import sequence_logprobs
from rollout import Episode, end_of_turn_id, episodes_to_batch, observation_ids, render_prompt
from support.sources import EMBEDDED, model_source

TOOL_CALL = "<tool_call>\n{}\n</tool_call>"


def oracle_turns(env, row):
    """Replay row's oracle through env: (prompt messages, [(text, tool messages)...], reward).

    The last turn's tool messages are [] (the final answer ends the episode)."""
    prompt = env.reset(row)
    turns = []
    try:
        for call in row["extra_info"].get("oracle_calls", []):
            text = TOOL_CALL.format(json.dumps({"name": call["name"], "arguments": call["arguments"]}))
            obs, _, done, _ = env.step(text)
            turns.append((text, obs))
            if done:  # a server failure ends the episode early: not a usable trajectory
                return prompt, turns, 0.0
        text = f"<answer>{row['extra_info']['oracle_answer']}</answer>"
        _, reward, _, _ = env.step(text)
        turns.append((text, []))
        return prompt, turns, reward
    finally:
        env.close()


def tokenize_trajectory(tokenizer, prompt, turns, tools, reward=1.0) -> Episode:
    """One trajectory as the Episode run_episodes would have built from the same turns
    (response_mask 1 = assistant tokens, 0 = tool messages; logprobs unused here)."""
    eot = end_of_turn_id(tokenizer)  # <|im_end|> for ChatML, whatever the tokenizer calls EOS
    ids, mask = [], []
    for text, obs in turns:
        t = tokenizer.encode(text, add_special_tokens=False) + [eot]
        ids, mask = ids + t, mask + [1] * len(t)
        if obs:
            o = observation_ids(tokenizer, obs, tools, ids[-1])
            ids, mask = ids + o, mask + [0] * len(o)
    return Episode(prompt_ids=render_prompt(tokenizer, prompt, tools), response_ids=ids, response_mask=mask,
                   logprobs=[0.0] * len(ids), reward=reward, finish_reason="stop", group=0)


def build_examples(rows, make_env, tokenizer, tools, max_len, progress=True, workers=16):
    """Oracle trajectories of rows as Episodes, and counts of what was skipped. Replays run
    concurrently (each in its own MCP session, as RL episodes do); a tool call takes ~30 ms."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm
    todo = [r for r in rows if "oracle_answer" in (r.get("extra_info") or {})]
    skipped = {"no_oracle": len(rows) - len(todo), "reward": 0, "too_long": 0}
    with ThreadPoolExecutor(max_workers=workers) as ex:
        played = list(tqdm(ex.map(lambda r: oracle_turns(make_env(r), r), todo), total=len(todo),
                           desc="oracle replays", disable=not progress, leave=False))
    examples = []
    for prompt, turns, reward in played:
        if reward < 1.0:
            skipped["reward"] += 1
            continue
        ep = tokenize_trajectory(tokenizer, prompt, turns, tools, reward)
        if len(ep.prompt_ids) + len(ep.response_ids) > max_len:
            skipped["too_long"] += 1
            continue
        examples.append(ep)
    return examples, skipped


def sft_loss(model, batch, n_tokens, autocast, device):
    """Summed masked NLL of a micro-batch (episodes_to_batch's dict) divided by the whole optimizer
    batch's token count, so accumulation over micro-batches is exact."""
    ids, attn, mask = (batch[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask"))
    with autocast():
        logp, _ = sequence_logprobs(model, ids, attn)  # (b, t-1)
    return -(logp * mask[:, 1:]).sum() / n_tokens


def fit(model, examples, opt, sched, args, pad_id, autocast, device, log):
    """--epochs passes over the trajectories in shuffled batches; returns (steps, last loss)."""
    from tqdm import tqdm
    rng, step, loss_sum = random.Random(args.seed), 0, 0.0
    n_steps = args.epochs * -(-len(examples) // args.batch_size)
    bar = tqdm(total=n_steps, desc="sft", disable=args.no_progress)
    for epoch in range(args.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        for s in range(0, len(order), args.batch_size):
            batch = [examples[i] for i in order[s:s + args.batch_size]]
            n_tokens = max(sum(sum(e.response_mask) for e in batch), 1)
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for u in range(0, len(batch), args.micro_batch_size):
                micro = episodes_to_batch(batch[u:u + args.micro_batch_size], pad_id)
                loss = sft_loss(model, micro, n_tokens, autocast, device)
                loss.backward()
                loss_sum += float(loss.detach())  # note: a device sync per micro-batch
            if not torch.isfinite(torch.tensor(loss_sum)):
                raise RuntimeError(f"sft step {step}: non-finite loss {loss_sum} (lower --lr?)")
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            sched.step()
            step += 1
            log.write(json.dumps({"step": step, "epoch": epoch, "loss": loss_sum, "grad_norm": gnorm,
                                  "lr": sched.get_last_lr()[0]}) + "\n")
            bar.set_postfix(loss=f"{loss_sum:.3f}")
            bar.update(1)
    bar.close()
    return step, loss_sum


def main(argv=None):
    p = argparse.ArgumentParser(description="SFT warm start on oracle MCP trajectories (see the module docstring)")
    p.add_argument("--model", default=EMBEDDED, help=f"hub id, local HF folder, or '{EMBEDDED}' (the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--train-data", default=None, help="SkyRL rows with extra_info.oracle_calls (default: mcp_tools/tasks.py's train split)")
    p.add_argument("--mcp-config", default=None, help="mcpServers JSON file (default: the bundled server)")
    p.add_argument("--rows", type=int, default=0, help="use only the first N rows (0: all)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the trajectories")
    p.add_argument("--batch-size", type=int, default=16, help="trajectories per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4, help="trajectories per forward/backward")
    p.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear LR warmup, in optimizer steps")
    p.add_argument("--max-len", type=int, default=4096, help="skip trajectories longer than this many tokens")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda (bf16 autocast) if there is one")
    p.add_argument("--seed", type=int, default=0, help="data order")
    p.add_argument("--out-dir", default="runs/sft", help="the HF folder to write (and sft_metrics.jsonl in it)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mcp_tools import env as mcp_env
    from mcp_tools import pool as mcp_pool
    from mcp_tools.formats import ensure_tool_template
    from support.rows import load_rows
    if args.train_data:
        rows = load_rows(args.train_data)
    else:
        from mcp_tools.tasks import mcp_rows
        rows = mcp_rows(seed=0)[0]  # the train split only: train.py evaluates on the test split
    rows = rows[:args.rows] if args.rows else rows
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but CUDA is not available")
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda"
                else (lambda: torch.autocast("cpu", enabled=False)))
    src = model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(src)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    t0 = time.perf_counter()
    with mcp_pool.MCPPool(args.mcp_config) as pool:
        ensure_tool_template(tokenizer, pool.tools)
        examples, skipped = build_examples(rows, lambda row: mcp_env.MCPEnv(pool=pool), tokenizer, pool.tools,
                                           args.max_len, progress=not args.no_progress)
    n_tok = sum(sum(e.response_mask) for e in examples)
    print(f"{len(examples)} trajectories ({n_tok} assistant tokens) from {len(rows)} rows in "
          f"{time.perf_counter() - t0:.1f} s; skipped {skipped}")
    if not examples:
        raise RuntimeError(f"no usable trajectories (skipped {skipped}): do the rows carry extra_info.oracle_calls?")

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device)
    model.train(False)  # no dropout in the Llama/Qwen configs; eval mode matches what RL samples
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min(1.0, (u + 1) / max(args.warmup_steps, 1)))
    # everything goes to a temporary folder that replaces --out-dir only once the model is saved:
    # an interrupted run leaves a previous result intact
    out = Path(args.out_dir)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t_train = time.perf_counter()
    with open(tmp / "sft_metrics.jsonl", "w") as log:
        step, loss_sum = fit(model, examples, opt, sched, args, pad_id, autocast, device, log)
    model.save_pretrained(tmp)  # float32 weights; vLLM casts to its dtype on load
    tokenizer.save_pretrained(tmp)  # with the tool-aware chat template, if one was installed
    old = out.with_name(out.name + f".old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    train_s = time.perf_counter() - t_train
    print(f"saved {out} after {step} steps in {train_s:.0f} s (last loss {loss_sum:.4f})")
    return {"steps": step, "loss": loss_sum, "examples": len(examples), "skipped": skipped, "out": str(out),
            "train_s": train_s}


if __name__ == "__main__":
    from mcp_tools import pool as mcp_pool
    try:
        main()
    except (FileNotFoundError, ValueError, mcp_pool.ServerStartFailed) as e:  # bad input or a server: one line
        raise SystemExit(f"error: {e}") from None
