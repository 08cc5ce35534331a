"""
Write the MCP tool-use tasks (mcp_server/tasks.py: families, ground truth, oracle calls) to files.

    python data/mcp_tasks.py --out data/out/mcp          # writes train.jsonl and test.jsonl
    python data/mcp_tasks.py --out data/out/mcp --format parquet --seed 1

train.py can also build the same rows in memory, with no files (mcp_server.tasks.mcp_rows).
"""
import argparse
import os
import sys

# run as `python data/mcp_tasks.py` from anywhere: put the repo root (parent of data/) on sys.path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mcp_server.tasks import mcp_rows  # noqa: E402
from rows import save_rows  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description="Generate MCP tool-use tasks (train/test) for the bundled server.")
    ap.add_argument("--out", default="data/out/mcp", help="output folder (gets train.<fmt> and test.<fmt>)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (same seed, same rows)")
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="file format")
    ap.add_argument("--test-fraction", type=float, default=0.1, help="share of each family held out for test")
    a = ap.parse_args()
    train, test = mcp_rows(a.seed, test_fraction=a.test_fraction)
    for name, rows in (("train", train), ("test", test)):
        path = os.path.join(a.out, f"{name}.{a.format}")
        save_rows(rows, path)
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
