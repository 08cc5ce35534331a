"""
Why the entropy of a run's mixed-reward groups falls: because the policy got surer of the same kind
of text (sharpening), or because it now writes a different kind of text that any model would be
surer of (composition; a JSON tool call is near-certain after its first tokens, a sentence is not)?

It scores a run's logged episodes (train.py --viewer-groups N writes OUT/episodes.jsonl) with one
fixed model, usually the run's starting model, and prints the mean per-token entropy of the trained
tokens of the episodes that trained (advantage != 0), per span of steps, inside tool calls and
elsewhere. The run's own entropy_live metric is the same mean under the policy of that step. So,
with the starting model as the fixed one:

    entropy_live(step 1) - entropy_live(step N)
      = [H_start(step-1 episodes) - H_start(step-N episodes)]   composition: what is written
      + [H_start(step-N episodes) - entropy_live(step N)]       sharpening: how sure the policy is

From the repository root (a GPU takes seconds; a 2-core CPU ~20 minutes for 1.5B and 2 x 32 episodes):

    python lab/entropy_split.py runs/headline-rl/episodes.jsonl --model $QWEN_DIR --steps 1,20
    python lab/entropy_split.py runs/headline-rl/episodes.jsonl --model $QWEN_DIR --steps 1-2,19-20 --max-episodes 32
    python lab/entropy_split.py runs/headline-rl/episodes.jsonl --model runs/headline-rl/ckpt/step_000020 --steps 1

(A late span may hold no trained episode when its groups all score alike: take several steps. The
last line scores step 1's texts with the step-20 policy: how much surer it grew of the same text,
against the first line's step-1 row, the starting model on the same texts. Step 1's texts hold
what the policy no longer writes, where it may be unsure for that alone, so this ratio errs high.)

Tokens: each episode is tokenized piece by piece as the rollout builds it (the prompt, then each
segment on its own), so the ids are the rollout's up to tokenizer ambiguities. The prompts' common
token prefix (system prompt and tool schemas) is run once and its KV cache reused. Entropy is of
softmax(logits / --temperature), as train.py's metric. The interval is a bootstrap over the
span's prompts (its groups): a group's episodes share a prompt, so they are not independent draws,
and a late span may hold only a few groups (the ones whose rewards still differ).
docs/results.md (2026-11-26) has what this printed for the headline's runs.
"""
import argparse
import copy
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402
import score  # noqa: E402
from lab.episode_stats import read_episodes, spans  # noqa: E402  (the same steps syntax and reader)

CALL = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.S)  # an unclosed call runs to the segment's end


def encode(tok, episode):
    """An episode record -> (ids (L,), trained (L,) bool, in_call (L,) bool, prompt length): its
    prompt and segments tokenized piece by piece; in_call marks trained tokens inside a <tool_call>."""
    ids = tok(episode["prompt"], add_special_tokens=False)["input_ids"]
    n_prompt = len(ids)
    trained, in_call = [False] * n_prompt, [False] * n_prompt
    for seg in episode["segments"]:
        enc = tok(seg["text"], add_special_tokens=False, return_offsets_mapping=True)
        calls = [m.span() for m in CALL.finditer(seg["text"])] if seg["trained"] else []
        for start, _ in enc["offset_mapping"]:
            trained.append(bool(seg["trained"]))
            in_call.append(any(a <= start < b for a, b in calls))
        ids += enc["input_ids"]
    return torch.tensor(ids), torch.tensor(trained), torch.tensor(in_call), n_prompt


def common_prefix(seqs, limit):
    """The longest token prefix all seqs share, at most limit, less one: the last prefix token is
    run again with each remainder, so every position after the prefix gets its logits there."""
    n = min(limit, *(len(s) for s in seqs))
    for s in seqs[1:]:
        diff = (s[:n] != seqs[0][:n]).nonzero()
        n = int(diff[0]) if len(diff) else n
    return max(n - 1, 0)


@torch.no_grad()
def token_entropies(model, seqs, limit, temperature=1.0):
    """Per-position next-token entropy: out[i][t] is the entropy of the model's distribution for
    token t of seqs[i], for t past the shared prefix (nan before it). The common prefix of the seqs
    (at most limit tokens: keep it inside the prompts) runs once and its KV cache is reused."""
    dev = next(model.parameters()).device
    p = common_prefix(seqs, limit)
    cache = rollout.cache_of(model(seqs[0][None, :p].to(dev), **rollout.with_cache(model, None))) if p else None
    out = []
    for s in seqs:
        kw = rollout.with_cache(model, copy.deepcopy(cache)) if p else {}
        logits = model(s[None, p:].to(dev), **kw).logits[0]  # (L - p, V)
        h = torch.full((len(s),), float("nan"))
        h[p + 1:] = score.entropy(logits[:-1].float(), temperature).cpu()  # logits at j predict token j + 1
        out.append(h)
    return out


def interval(sums, counts, draws=2000, seed=0):
    """The 5th and 95th percentiles of the token mean sum(sums) / sum(counts) over units (table:
    groups) drawn with replacement: which prompts a span holds, and a few long episodes, move it."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(sums), (draws, len(sums)), generator=g)
    means = sums[idx].sum(1) / counts[idx].sum(1).clamp(min=1)
    return float(means.quantile(0.05)), float(means.quantile(0.95))


def table(model, tok, episodes, steps, max_episodes, temperature):
    rows = []
    for label, want in steps:
        eps = [e for e in episodes if e["step"] in want and e.get("advantage", 0) != 0][:max_episodes or None]
        if not eps:
            rows.append(f"| {label} | 0 | | none trained: each logged group had one reward, or none was logged | | |")
            continue
        ids, trained, in_call, n_prompt = zip(*(encode(tok, e) for e in eps))
        hs = [h[tr] for h, tr in zip(token_entropies(model, ids, min(n_prompt), temperature), trained)]  # per episode
        h, call = torch.cat(hs), torch.cat([c[tr] for c, tr in zip(in_call, trained)])
        groups = {}  # (step, group) -> [entropy sum, token count]: the bootstrap's units
        for e, x in zip(eps, hs):
            g = groups.setdefault((e["step"], e.get("group")), [0.0, 0.0])
            g[0], g[1] = g[0] + float(x.sum()), g[1] + len(x)
        lo, hi = interval(*torch.tensor(list(groups.values()), dtype=torch.float64).T)
        mean = lambda x: f"{float(x.mean()):.3f}" if len(x) else "-"  # noqa: E731
        rows.append(f"| {label} | {len(eps)} ({len(groups)}) | {len(h)} | {mean(h)} ({lo:.3f}-{hi:.3f}) | {mean(h[call])} "
                    f"({float(call.float().mean()):.0%}) | {mean(h[~call])} |")
    head = ("| steps | episodes (groups) | trained tokens | entropy (90% interval) | in tool calls (share of tokens) | elsewhere |\n"
            "|---|---|---|---|---|---|")
    return "\n".join([head, *rows])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("episodes", help="a run's episodes.jsonl (train.py --viewer-groups)")
    ap.add_argument("--model", required=True, help="the fixed model that scores them (HF folder or id)")
    ap.add_argument("--steps", default="1,20", help="spans of steps, one row each: '1,20' or '1-2,19-20'")
    ap.add_argument("--max-episodes", type=int, default=0, help="at most this many trained episodes a span (0: all)")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    episodes = read_episodes(args.episodes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    out = table(model, tok, episodes, spans(args.steps, []), args.max_episodes, args.temperature)
    print(f"entropy of the trained tokens of trained episodes, scored by {args.model} at T={args.temperature}")
    print(out)
    return out


if __name__ == "__main__":
    main()
