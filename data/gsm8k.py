"""
Convert the official GSM8K release (openai/grade-school-math: train.jsonl and test.jsonl, one
{"question", "answer"} object per line) into nanoRL rows (SkyRL's format, see support/rows.py):

    {"data_source": "openai/gsm8k", "env_class": "gsm8k",
     "prompt": [{"role": "system", "content": GSM8K_SYSTEM_PROMPT}, {"role": "user", "content": question}],
     "reward_spec": {"method": "rule", "ground_truth": "<number after ####, normalised: '1,080' -> '1080'>"},
     "extra_info": {"split": "train", "index": i, "question": question, "answer": solution}}

Every official answer must contain exactly one "####" followed by one number; anything else is
an error naming file:line (nothing is skipped). --src is a local folder holding train.jsonl and
test.jsonl, or a URL prefix (fetched with urllib), e.g. the official release (OFFICIAL)
https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data
A missing file or a failed fetch is one line naming it and where to get the files, exit status 1.

    python data/gsm8k.py --src PATH_OR_URL --out data/out/gsm8k [--format jsonl|parquet]

Expected: 7473 train rows, 1319 test rows.
"""

import argparse
import json
import sys
import urllib.request
from pathlib import Path

# run as `python data/gsm8k.py` from anywhere: put the repo root (parent of data/) on sys.path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import envs  # noqa: E402
from support.rows import save_rows, validate_row  # noqa: E402

OFFICIAL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data"


def read_lines(src: str, name: str) -> tuple[str, list[str]]:
    """(where, lines) of src/name; src is a folder or an http(s) URL prefix."""
    if src.startswith(("http://", "https://")):
        url = src.rstrip("/") + "/" + name
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                return url, resp.read().decode("utf-8").splitlines()
        except OSError as e:  # URLError (no network, DNS), HTTPError (404), a timeout
            raise FileNotFoundError(f"could not fetch {url} ({getattr(e, 'reason', e)}); offline, fetch train.jsonl and "
                                    f"test.jsonl of {OFFICIAL} elsewhere, copy them to a folder here and pass "
                                    "--src FOLDER") from None
    path = Path(src) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; --src wants a folder holding the official GSM8K train.jsonl "
                                f"and test.jsonl (from {OFFICIAL}), or that URL itself")
    return str(path), path.read_text(encoding="utf-8").splitlines()


def ground_truth(answer: str, where: str) -> str:
    """The normalised number after the solution's single '####'."""
    if answer.count("####") != 1:
        raise ValueError(f"{where}: answer must contain exactly one '####', "
                         f"found {answer.count('####')}")
    truth = envs.normalise_number(answer.split("####")[1])
    if truth is None:
        raise ValueError(f"{where}: the text after '####' is not one number: "
                         f"{answer.split('####')[1]!r}")
    return truth


def convert_split(src: str, split: str) -> list[dict]:
    where_file, lines = read_lines(src, f"{split}.jsonl")
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{where_file}:line {lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: bad JSON: {e}") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected an object with question and answer")
        for key in ("question", "answer"):
            if not isinstance(rec.get(key), str) or not rec[key].strip():
                raise ValueError(f"{where}: field {key!r} must be a non-empty string")
        row = {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": envs.GSM8K_SYSTEM_PROMPT},
                       {"role": "user", "content": rec["question"]}],
            "env_class": "gsm8k",
            "reward_spec": {"method": "rule", "ground_truth": ground_truth(rec["answer"], where)},
            "extra_info": {"split": split, "index": len(rows), "question": rec["question"],
                           "answer": rec["answer"]},
        }
        rows.append(validate_row(row, where))
    if not rows:
        raise ValueError(f"{where_file}: no rows")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="official GSM8K jsonl -> nanoRL train/test rows")
    p.add_argument("--src", required=True,
                   help="folder or URL prefix holding train.jsonl and test.jsonl")
    p.add_argument("--out", default="data/out/gsm8k", help="output folder")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="output format")
    args = p.parse_args(argv)
    for split in ("train", "test"):
        try:
            rows = convert_split(args.src, split)
        except (OSError, ValueError) as e:  # a missing file, a failed fetch, a bad row: one line, exit 1
            raise SystemExit(f"data/gsm8k.py: {e}") from None
        path = Path(args.out) / f"{split}.{args.format}"
        save_rows(rows, str(path))
        print(f"{split}: {len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
