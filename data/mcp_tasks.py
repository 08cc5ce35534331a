r"""
Write the MCP tool-use tasks (mcp_tools/tasks.py: families, ground truth, oracle calls) to files.

    python data/mcp_tasks.py --out data/out/mcp          # writes train.jsonl and test.jsonl
    python data/mcp_tasks.py --out data/out/mcp --format parquet --seed 1
    python data/mcp_tasks.py --max-calls 1 --out data/out/mcp-1call      # only tasks of one tool call
    python data/mcp_tasks.py --min-calls 2 --families multi,shop,kb,state \
        --count multi=500 --count kb=300 --count state=400 --out data/out/mcp-multi

--families, --min-calls and --max-calls select rows (tasks.select_rows) after the split, so a
selection's test rows are the same tasks as in the unselected files; --count FAMILY=N generates N
tasks of that family instead of the default (tasks.FAMILIES), for a selection too small to evaluate on.
train.py can also build the default rows in memory, with no files (mcp_tools.tasks.mcp_rows).
"""
import argparse
import collections
import os
import sys

# run as `python data/mcp_tasks.py` from anywhere: put the repo root (parent of data/) on sys.path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mcp_tools.tasks import FAMILIES, mcp_rows, n_calls, select_rows  # noqa: E402
from support.rows import save_rows  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate MCP tool-use tasks (train/test) for the bundled server.")
    ap.add_argument("--out", default="data/out/mcp", help="output folder (gets train.<fmt> and test.<fmt>)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (same seed, same rows)")
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="file format")
    ap.add_argument("--test-fraction", type=float, default=0.1, help="share of each family held out for test")
    ap.add_argument("--families", default=None,
                    help=f"comma-separated families to keep (default: all of {','.join(FAMILIES)})")
    ap.add_argument("--min-calls", type=int, default=None, help="keep tasks whose oracle makes at least K tool calls")
    ap.add_argument("--max-calls", type=int, default=None, help="keep tasks whose oracle makes at most K tool calls")
    ap.add_argument("--count", action="append", default=[], metavar="FAMILY=N",
                    help="generate N tasks of FAMILY (before the selection) instead of its default; repeatable")
    a = ap.parse_args(argv)
    families = a.families.split(",") if a.families else list(FAMILIES)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"--families: unknown {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    counts = {f: FAMILIES[f] for f in FAMILIES if f in families}  # FAMILIES' order, whatever --families says
    for f, n in (c.split("=", 1) if "=" in c else (c, "") for c in a.count):
        if f not in counts or not n.isdigit():
            ap.error(f"--count {f}={n}: want FAMILY=N with FAMILY one of {', '.join(counts)} and N a whole number")
        counts[f] = int(n)
    train, test = mcp_rows(a.seed, counts, test_fraction=a.test_fraction)
    train, test = (select_rows(rows, families, a.min_calls, a.max_calls) for rows in (train, test))
    if not test or not train:
        raise SystemExit(f"the selection leaves {len(train)} train and {len(test)} test rows: nothing to write")
    for name, rows in (("train", train), ("test", test)):
        path = os.path.join(a.out, f"{name}.{a.format}")
        save_rows(rows, path)
        mix = collections.Counter(f"{r['extra_info']['family']}/{n_calls(r)}" for r in rows)
        shown = ", ".join(f"{k} {v}" for k, v in sorted(mix.items()))
        print(f"wrote {len(rows)} rows to {path} (family/calls: {shown})")
    return train, test


if __name__ == "__main__":
    main()
