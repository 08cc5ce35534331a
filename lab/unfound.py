"""
What --rescue ...,narrow=N would take back from a run's logged passes (options/rescue.py): a number answer counts
as found only where a tool's result of at most N numbers showed it, from a call that did not write it first nor
made up all its numbers (options/plans.found_calls with most=N). Reads OUT/episodes.jsonl (train.py --viewer-groups writes it), each
episode rebuilt from its segments a character a token, and prints one row a data source (info.source):

| source | passes | taken back | guided passes | taken back |

passes: the unguided episodes that answered right; guided: the answer-hinted ones whose pass the text test
kept (info.answer_hint, not info.ungrounded). An unguided pass is judged by the trainer's own
rescue.take_back_unfound, over a row made of its question (read off the prompt's ChatML user turns, the whole
prompt for another template) and its answer; the logs keep no state checks, so none is exempt for one. --tool NAME splits each source by whether the policy called NAME, e.g. db_query for the
discovery family, whose right answers without it were numbers a listing held by chance. From the repository
root:

    python lab/unfound.py runs/rescue-s0/episodes.jsonl --most 8 --tool db_query
"""

import argparse
import json
import os
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from options.plans import found_calls  # noqa: E402
from options.rescue import take_back_unfound  # noqa: E402
from rollout import Episode  # noqa: E402

USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)  # ChatML's user turns


def rebuilt(record: dict) -> Episode:
    """An episodes.jsonl record as an Episode whose token ids are its characters (decode: chars)."""
    ids, mask = [], []
    for seg in record["segments"]:
        ids += [ord(c) for c in seg["text"]]
        mask += [int(bool(seg.get("trained")))] * len(seg["text"])
    return Episode([0], ids, mask, [0.0] * len(ids), float(record.get("reward", 0.0)), record.get("finish", "stop"),
                   record.get("group", 0), dict(record["info"]))


def chars(ids):
    return "".join(map(chr, ids))


def names(text: str) -> list[str]:
    """The tool names the policy wrote (a JSON "name" field, as the hermes and JSON formats write calls)."""
    return re.findall(r'"name"\s*:\s*"([^"]+)"', text)


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("episodes", help="a run's OUT/episodes.jsonl")
    p.add_argument("--most", type=int, default=8, help="N of narrow=N: the most numbers a result may hold (default 8)")
    p.add_argument("--tool", default=None, help="split each source by whether the policy called this tool")
    args = p.parse_args(argv)
    if args.most < 1:
        p.error("--most: want N >= 1")
    counts = Counter()
    try:
        lines = open(args.episodes, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise SystemExit(f"{args.episodes}: {e.strerror}")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            info = record["info"]
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"{args.episodes}:{i}: not an episode record (want JSON with info and segments)") from None
        guided = "hint_for" in info
        if not info.get("correct") or info.get("answer") is None or guided and not info.get("answer_hint"):
            continue  # a wrong answer, or a plan- or probe-guided pass: not what the answer hint's test decides
        episode, answer = rebuilt(record), str(info["answer"]).strip()
        source = info.get("source") or "?"
        if args.tool:
            said = chars([t for t, m in zip(episode.response_ids, episode.response_mask) if m])
            source += f"/{args.tool}" if args.tool in names(said) else f"/no {args.tool}"
        asked = "\n".join(USER.findall(record.get("prompt", ""))) or record.get("prompt", "")
        if guided:
            stays = found_calls(episode, answer, chars, lambda text: [], args.most, asked) is not None
        else:
            row = {"prompt": [{"role": "user", "content": asked}], "reward_spec": {"ground_truth": answer}}
            stays = take_back_unfound({0: [episode]}, {0: row}, args.most, chars, lambda text: []) == 0
        kind = "guided" if guided else "passes"
        counts[source, kind] += 1
        counts[source, kind + " back"] += not stays
    sources = sorted({s for s, _ in counts})
    rows = [f"| {s} | {counts[s, 'passes']} | {counts[s, 'passes back']} | {counts[s, 'guided']} | {counts[s, 'guided back']} |"
            for s in sources]
    print(f"narrow={args.most}: | source | passes | taken back | guided passes | taken back |")
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
