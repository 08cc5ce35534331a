"""Curves of several runs in one plot (the figures in docs/), from their metrics.jsonl files.

    python lab/plot_runs.py OUT.png "title" label=path/metrics.jsonl [label=path ...]
        two panels: train reward and greedy eval pass@1 against step
    python lab/plot_runs.py OUT.png "title" --metric eval_pass1 \
        --label "SFT-only" sft/metrics.jsonl --label "SFT+RL" rl/metrics.jsonl
        one panel: that metric against step, one curve a run (label=path works here too)
    python lab/plot_runs.py OUT.png "title" --metric entropy,eval_pass1 --max-step 60 a=... b=...
        one panel a metric, side by side (4 a row); --max-step leaves out later steps (runs cut short)
    python lab/plot_runs.py OUT.png "title" --metric "eval_pass1/seen+eval_pass1/unseen,tool_errors" run=...
        a+b: both metrics in one panel (train.py's eval_pass1/NAME: one curve per --eval-data set)

entropy_live (the entropy over mixed-reward groups, train.py) is read as entropy from a run without a
KL term that predates it: there the two are the same number.

In --metric mode a run that logged the metric at one step only (a model evaluated once, e.g.
train.py --steps 0) is drawn as a dashed horizontal line across the other runs' steps: the
baseline a curve has to beat. It reads only the metrics files (matplotlib, nothing of the course).
Example, three lab/recipes/multiply21.sh runs side by side (the panels of the multiply 2x1 KL picture):

    python lab/plot_runs.py out/kl.png "multiply 2x1" --metric eval_pass1,entropy_live,reward_mean \
        --label "no KL" out/clip28.metrics.jsonl --label "KL 0.05" out/kl05.metrics.jsonl --label "KL 0.2" out/kl20.metrics.jsonl

Test: python -m pytest -q tests/test_train.py -k plot_runs
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

YLABEL = {"eval_pass1": "greedy pass@1 on the held-out rows", "reward_mean": "train reward (mean)",
          "tool_calls": "tool calls per episode", "tool_errors": "failed tool calls per episode",
          "tool_parse_rate": "share of <tool_call> blocks parsed",
          "entropy": "policy entropy (nats/token)",
          "entropy_live": "entropy of mixed-reward groups (nats/token)"}


def points(path, key, max_step=None):
    """(step, value) of every step that logged key (up to max_step); a rewritten (resumed) step keeps its last value."""
    by_step = {}
    for line in open(path):
        r = json.loads(line)
        if key == "entropy_live" and key not in r and "entropy" in r and not r.get("kl"):
            r[key] = r["entropy"]  # a no-KL run from before entropy_live was logged: the same quantity
        if key in r and (max_step is None or r["step"] <= max_step):
            by_step[r["step"]] = r[key]
    return sorted(by_step.items())


def plot_metric(out, title, runs, keys, ylabel=None, max_step=None):
    """One panel per key (a name or a list): key against step for each (label, path); single-point
    runs as flat lines."""
    keys = [keys] if isinstance(keys, str) else keys
    cols = min(len(keys), 4)
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 if len(keys) == 1 else 5.2 * cols, 4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        _panel(ax, runs, key, ylabel if len(keys) == 1 else None, max_step)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _panel(ax, runs, key, ylabel, max_step):
    parts = key.split("+")  # several metrics in one panel: curves labelled by metric (and run)
    curves = [(label if len(parts) == 1 else part if len(runs) == 1 else f"{label}: {part}",
               points(path, part, max_step)) for label, path in runs for part in parts]
    steps = [s for _, pts in curves if len(pts) > 1 for s, _ in pts] or [0, 1]
    for label, pts in curves:
        if len(pts) > 1:
            ax.plot(*zip(*pts), marker="o" if len(pts) <= 40 else None, lw=1 if len(pts) > 40 else 1.5, label=label)
        elif pts:
            ax.plot([min(steps), max(steps)], [pts[0][1]] * 2, "--", label=f"{label} ({pts[0][1]:.3f})")
        else:
            print(f"{label}: no {key} in its metrics file")
    ax.set(xlabel="step", ylabel=ylabel or YLABEL.get(key, key.replace("+", ", ")))
    if key.startswith("eval_pass1"):
        ax.set_ylim(0, 1.02)
    ax.legend()
    ax.grid(alpha=0.3)


def plot_reward_and_eval(out, title, runs):
    fig, (ax, ev) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, path in runs:
        ax.plot(*zip(*points(path, "reward_mean")), label=label)
        ev.plot(*zip(*points(path, "eval_pass1")), marker="o", label=label)
    ax.set(xlabel="step", ylabel="train reward (mean of 256 episodes)", title=title)
    ev.set(xlabel="step", ylabel="greedy eval pass@1 (64 rows)", ylim=(0, 1.02), title="eval")
    ax.legend()
    ev.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description="plot several runs' metrics.jsonl (see the module docstring)")
    p.add_argument("out", help="the png to write")
    p.add_argument("title", help="the plot's title")
    p.add_argument("runs", nargs="*", help="label=path/metrics.jsonl")
    p.add_argument("--label", nargs=2, action="append", default=[], metavar=("LABEL", "PATH"),
                   help="a run: its legend label and its metrics.jsonl (repeatable)")
    p.add_argument("--metric", default=None, help="plot only this metric (e.g. eval_pass1) against step; "
                   "comma-separated: one panel each")
    p.add_argument("--max-step", type=int, default=None, help="--metric mode: leave out steps after this one")
    p.add_argument("--ylabel", default=None, help="--metric mode: the y axis label (default: named after the metric)")
    a = p.parse_intermixed_args(argv)  # runs may come after the options
    runs = [tuple(r.split("=", 1)) for r in a.runs] + [tuple(r) for r in a.label]
    if not runs or any(len(r) != 2 for r in runs):
        p.error("give runs as label=path or --label LABEL PATH")
    if a.metric:
        plot_metric(a.out, a.title, runs, a.metric.split(","), a.ylabel, a.max_step)
    else:
        plot_reward_and_eval(a.out, a.title, runs)


if __name__ == "__main__":
    main()
