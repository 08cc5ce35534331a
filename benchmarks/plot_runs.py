"""Train-reward curves of several runs in one plot (README figures), from their metrics.jsonl files.

    python benchmarks/plot_runs.py OUT.png "title" label=path/metrics.jsonl [label=path ...]
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out, title, runs = sys.argv[1], sys.argv[2], [a.split("=", 1) for a in sys.argv[3:]]
fig, (ax, ev) = plt.subplots(1, 2, figsize=(10, 3.6))
for label, path in runs:
    rows = [json.loads(line) for line in open(path)]
    tr = [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r]
    e = [(r["step"], r["eval_pass1"]) for r in rows if "eval_pass1" in r]
    ax.plot(*zip(*tr), label=label)
    ev.plot(*zip(*e), marker="o", label=label)
ax.set(xlabel="step", ylabel="train reward (mean of 256 episodes)", title=title)
ev.set(xlabel="step", ylabel="greedy eval pass@1 (64 rows)", ylim=(0, 1.02), title="eval")
ax.legend()
ev.legend()
fig.tight_layout()
fig.savefig(out, dpi=110)
