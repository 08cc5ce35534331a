r"""
Write synthetic multiplication splits (SkyRL's tutorial task, see envs.Multiply):
"What is 4821 * 37?", answer in \boxed{}. Rows come from envs.multiply_rows; train and test use
different seeds (seed, seed + 1), so the splits are independent draws (small digit counts can
repeat a problem across splits: 2x2 digits has only 8100 distinct pairs).

    python data/multiply.py --out data/out/multiply --n-train 10000 --n-test 200 --digits 4 \
        [--digits-b 2] [--format parquet]

train.py can also build the same rows in memory, with no files (envs.multiply_rows).
"""

import argparse
import sys
from pathlib import Path

# run as `python data/multiply.py` from anywhere: put the repo root (parent of data/) on sys.path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import envs  # noqa: E402
from support.rows import save_rows  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description="synthetic n-digit x m-digit multiplication rows")
    p.add_argument("--out", default="data/out/multiply", help="output folder")
    p.add_argument("--n-train", type=int, default=10000, help="train rows")
    p.add_argument("--n-test", type=int, default=200, help="test rows")
    p.add_argument("--digits", type=int, default=2, help="digits of the first factor")
    p.add_argument("--digits-b", type=int, default=None,
                   help="digits of the second factor (default: --digits)")
    p.add_argument("--seed", type=int, default=0, help="train seed; test uses seed + 1")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="output format")
    args = p.parse_args(argv)
    digits_b = args.digits if args.digits_b is None else args.digits_b
    splits = (("train", args.n_train, args.seed), ("test", args.n_test, args.seed + 1))
    for split, n, seed in splits:
        rows = envs.multiply_rows(n, args.digits, digits_b, seed, split=split)
        path = Path(args.out) / f"{split}.{args.format}"
        save_rows(rows, str(path))
        print(f"{split}: {len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
