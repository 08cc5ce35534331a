"""
Where a run's failed tool calls are: per step of an MCP run's logged episodes (train.py
--viewer-groups N writes them to OUT/episodes.jsonl, N groups a step), failed calls per episode in
the correct and in the wrong episodes, how episodes ended, and what share of the failed calls the
episodes with more than --many of them made. From the repository root:

    python lab/episode_stats.py runs/headline-rl/episodes.jsonl
    python lab/episode_stats.py runs/headline-rl/episodes.jsonl --steps 1-3,16-20   # two spans

A failed call is what mcp_tools/env.py's charge counts: tool_errors + parse_errors + doubled_braces
(doubled-brace calls run, but are charged); --without-doubled leaves those out, as train.py's
tool_errors metric does. Output, one row a step (or a span of steps):

| steps | episodes | correct | failed / ep | in correct | in wrong | ended: stop / max_turns / length | share in eps with > 3 |

--rows FILE (the rows the episodes came from, jsonl: a run's training rows, or eval.py's --eval-data;
each with extra_info.oracle_calls as the bundled MCP tasks have) adds a second table: the same spans split by how many calls each row's oracle makes,
an episode matched to its row by the row's last user message, found in the episode's prompt:

| steps | oracle calls | episodes | calls / ep | correct | repeats / ep | of failed / ep |

A run with --rescue also logs its guided replays (info.hint_for): they are left out, as train.py's
step metrics leave them out; --guided counts them alone.

The last two columns, where the episodes record them (info.repeat_calls, info.repeat_failed): calls
identical to an earlier call of the episode, and to an earlier call that failed. --family splits
that table by the row's family too (FAMILY/CALLS, extra_info.family). It reads eval.py's
OUT/episodes.jsonl the same way: there "step" i is the i-th --model, and --sampling greedy keeps its
greedy episodes (one a row; the others are "T=1"). For the held-out rows of the recipe's passk stage:

    python lab/episode_stats.py OUT/passk/episodes.jsonl --rows data/out/mcp-heldout.jsonl --family --sampling greedy

--first-calls (with --rows) adds a third table: per row of the second, the share of episodes whose
first call is the tool the row's oracle calls first, and the tools they called first (the top
three; "none" answered without a call). It shows whether a policy looks things up before it acts:

    python lab/episode_stats.py OUT/rescue-s0-eval/episodes.jsonl --rows data/out/mcp-rescue-eval.jsonl \
        --family --sampling greedy --steps 1 --first-calls

| steps | family/oracle calls | episodes | first call as the oracle's | first calls |

The first call is read from the episode's first trained segment: the first `"name": "..."` (Hermes,
Llama 3 and Mistral JSON) or `<function=...>` (Qwen3 XML) in it.

--after-errors adds a table of what episodes do after a tool's error: per span (and per row key with
--rows), the episodes whose observations hold an error (an untrained segment with "error" in it, in any
case: the env's and the servers' error texts), the share of them that called a tool again after the
first, the share correct, and the share whose answer speaks of an error (info.answer holds "error" in any
case: what mcp_tools/env.py charges as error_answer):

    python lab/episode_stats.py OUT/rescue-s0-eval/episodes.jsonl --rows data/out/mcp-rescue-eval.jsonl \
        --family --sampling greedy --after-errors

| steps | rows | episodes | with an error | called again | correct | answer quotes an error |

--answers adds a table of the wrong answers: per span (and per row key with --rows), the wrong episodes,
those with no tagged answer (info.answer), and the tagged ones split three ways: a number that what the
episode saw showed (the prompt from its last user turn on, and the tool results: a guess it could have read
off, e.g. a schema's 0), a number nothing it saw showed (made up), and a text; then the three most common
wrong answers. A policy that answers "0" with no count to read shows here:

    python lab/episode_stats.py OUT/rescue-s0-transfer/episodes.jsonl --sampling greedy --answers

| steps | rows | wrong | no answer | number seen | number not seen | text | most common |

docs/results.md (2026-11-26) has the tables this printed for the headline's runs. It reads the
jsonl only (no torch, nothing of the course).
"""
import argparse
import collections
import json
import re
import sys


def failed(e, doubled=True):
    """Failed calls of one logged episode, as the env's charge counts them (doubled=False: as the
    tool_errors metric does)."""
    i = e.get("info") or {}
    return i.get("tool_errors", 0) + i.get("parse_errors", 0) + (i.get("doubled_braces", 0) if doubled else 0)


def span_row(label, eps, many, doubled=True):
    """One table row for the episodes eps (a list of episodes.jsonl records)."""
    count = lambda e: failed(e, doubled)  # noqa: E731
    right = [e for e in eps if (e.get("info") or {}).get("correct")]
    wrong = [e for e in eps if not (e.get("info") or {}).get("correct")]
    per = lambda xs: sum(map(count, xs)) / len(xs) if xs else 0.0  # noqa: E731
    total = sum(map(count, eps))
    ends = collections.Counter(e.get("finish") for e in eps)
    share = sum(count(e) for e in eps if count(e) > many) / total if total else 0.0
    return (f"| {label} | {len(eps)} | {len(right) / len(eps):.2f} | {per(eps):.2f} | {per(right):.2f} | "
            f"{per(wrong):.2f} | {ends['stop']} / {ends['max_turns']} / {ends['length']} | {share:.2f} |")


def spans(text, steps):
    """'1-3,16-20' -> [(label, set of steps)]; '' -> one span a step."""
    if not text:
        return [(str(s), {s}) for s in steps]
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.append((part, set(range(int(lo), int(hi or lo) + 1))))
    return out


def read_episodes(path):
    """The records of an episodes.jsonl (blank lines skipped); a missing file or a bad record exits
    with an error naming the file (and the line)."""
    eps = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        eps.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        sys.exit(f"error: {path}:{n}: not a JSON record ({e})")
    except OSError as e:
        sys.exit(f"error: {path}: {e}")
    return eps


def oracle_calls_by_question(path, family=False):
    """{a row's last user message: (its oracle's call count, or "FAMILY/COUNT" with family; the name of
    its oracle's first call, or "none")} from a rows jsonl; a row without extra_info.oracle_calls (or
    .family) exits with an error naming the file and the row (blank lines not counted)."""
    out = {}
    for n, row in enumerate(read_episodes(path), 1):  # any jsonl reads the same way
        try:
            calls = row["extra_info"]["oracle_calls"]
            key = f"{row['extra_info']['family']}/{len(calls)}" if family else len(calls)
            first = calls[0].get("name", "none") if calls and isinstance(calls[0], dict) else "none"
            out[[m for m in row["prompt"] if m["role"] == "user"][-1]["content"]] = key, first
        except (KeyError, IndexError, TypeError):
            want = "extra_info.oracle_calls and extra_info.family" if family else "extra_info.oracle_calls"
            sys.exit(f"error: {path}: row {n}: want a chat prompt and {want}")
    return out


def by_row(eps, questions):
    """{a row key of questions (oracle_calls_by_question), or "no row": [(episode, its row's oracle's
    first call)]}, keys sorted: an episode's row is the longest question its prompt contains."""
    groups = collections.defaultdict(list)
    for e in eps:
        found = [q for q in questions if q in (e.get("prompt") or "")]
        key, first = questions[max(found, key=len)] if found else ("no row", None)
        groups[key].append((e, first))
    return {k: groups[k] for k in sorted(groups, key=str)}


_FIRST_CALL = re.compile(r'"name"\s*:\s*"([^"]+)"|<function=([^>\s]+)>')


def first_call(e):
    """The tool an episode called first: the first call named in its first trained segment, or "none"."""
    text = next((s.get("text", "") for s in e.get("segments") or [] if s.get("trained")), "")
    m = _FIRST_CALL.search(text)
    return (m.group(1) or m.group(2)) if m else "none"


def first_rows(label, eps, questions):
    """Table rows for the episodes eps, one per row key (as calls_rows): the share whose first call is
    their row's oracle's first call, and the top three first calls."""
    out = []
    for k, g in by_row(eps, questions).items():
        calls = [first_call(e) for e, _ in g]
        same = sum(c == want for c, (_, want) in zip(calls, g)) / len(g)
        top = ", ".join(f"{name} {n}" for name, n in collections.Counter(calls).most_common(3))
        out.append(f"| {label} | {k} | {len(g)} | {same:.2f} | {top} |")
    return out


def after_errors_row(label, key, eps):
    """One table row (--after-errors) for the episodes eps: how many met a tool's error (module doc), and
    of those the shares that called a tool again after it, that were correct, and that answered with an
    error's text."""
    met = []  # (episode, whether a trained segment after its first error makes a call)
    for e in eps:
        segs = e.get("segments") or []
        at = next((i for i, s in enumerate(segs) if not s.get("trained") and "error" in s.get("text", "").lower()), None)
        if at is not None:
            met.append((e, any(s.get("trained") and _FIRST_CALL.search(s.get("text", "")) for s in segs[at + 1:])))
    share = lambda test: sum(map(test, met)) / len(met) if met else 0.0  # noqa: E731
    info = lambda e: e.get("info") or {}  # noqa: E731
    return (f"| {label} | {key} | {len(eps)} | {len(met)} | {share(lambda m: m[1]):.2f} | "
            f"{share(lambda m: bool(info(m[0]).get('correct'))):.2f} | "
            f"{share(lambda m: 'error' in str(info(m[0]).get('answer') or '').lower()):.2f} |")


# a whole number, as mcp_tools/rewards.py's NUMBER (this script imports nothing of the course)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w]|\.\d)")
_USER_TURN = re.compile(r"<\|im_start\|>user|<\|start_header_id\|>user|\[INST\]")  # Qwen/Hermes, Llama 3, Mistral


def seen_text(e):
    """What an episode saw before it answered: its prompt from the last user turn on (the whole prompt when no
    known marker is in it: the tool schemas and the system prompt's example then count too) and its tool results."""
    prompt = e.get("prompt") or ""
    marks = list(_USER_TURN.finditer(prompt))
    shown = prompt[marks[-1].start():] if marks else prompt
    return shown + "".join(s.get("text", "") for s in e.get("segments") or [] if not s.get("trained"))


def answer_kind(e):
    """'none', 'seen', 'unseen' or 'text' for an episode's answer (module doc, --answers): a number is an
    answer holding exactly one number once thousands commas are dropped."""
    answer = (e.get("info") or {}).get("answer")
    if answer is None:
        return "none"
    nums = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", str(answer)))
    if len(nums) != 1:
        return "text"
    value = float(nums[0])
    seen = any(abs(float(x) - value) <= 1e-9 * max(1.0, abs(value)) for x in _NUMBER.findall(seen_text(e)))
    return "seen" if seen else "unseen"


def answers_row(label, key, eps):
    """One table row (--answers) for the wrong episodes of eps: how their answers split (answer_kind) and
    the three most common."""
    wrong = [e for e in eps if not (e.get("info") or {}).get("correct")]
    kinds = collections.Counter(answer_kind(e) for e in wrong)
    top = collections.Counter(str((e.get("info") or {}).get("answer"))[:30] for e in wrong
                              if (e.get("info") or {}).get("answer") is not None).most_common(3)
    common = ", ".join(f"{a!r} {n}" for a, n in top) or "-"
    return (f"| {label} | {key} | {len(wrong)} | {kinds['none']} | {kinds['seen']} | {kinds['unseen']} | "
            f"{kinds['text']} | {common} |")


def calls_rows(label, eps, questions, repeats=False):
    """Table rows for the episodes eps, one per oracle call count (questions: oracle_calls_by_question;
    by_row). repeats: two more columns, repeated calls and repeats of a failed call per episode (an
    episode without them counts 0)."""
    out = []
    for k, pairs in by_row(eps, questions).items():
        g = [e for e, _ in pairs]
        calls = sum((e.get("info") or {}).get("tool_calls", 0) for e in g) / len(g)
        right = sum(bool((e.get("info") or {}).get("correct")) for e in g) / len(g)
        per = lambda key: sum((e.get("info") or {}).get(key, 0) for e in g) / len(g)  # noqa: E731
        more = f" {per('repeat_calls'):.2f} | {per('repeat_failed'):.2f} |" if repeats else ""
        out.append(f"| {label} | {k} | {len(g)} | {calls:.2f} | {right:.2f} |{more}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("episodes", help="a run's episodes.jsonl (train.py --viewer-groups N)")
    ap.add_argument("--steps", default="", help="spans of steps, e.g. 1-3,16-20 (default: every step)")
    ap.add_argument("--many", type=int, default=3, help="the last column: episodes with more failed calls than this")
    ap.add_argument("--without-doubled", action="store_true", help="leave doubled-brace calls out (the tool_errors metric)")
    ap.add_argument("--rows", default=None, help="the episodes' rows (jsonl; training or eval rows): a second table by oracle call count")
    ap.add_argument("--family", action="store_true", help="with --rows: split that table by the row's family too")
    ap.add_argument("--sampling", default=None, help="keep only episodes whose info.sampling is this (eval.py's: greedy)")
    ap.add_argument("--first-calls", action="store_true", help="with --rows: a third table, each episode's first "
                    "call against its row's oracle's first call")
    ap.add_argument("--after-errors", action="store_true", help="a table of what episodes do after a tool's "
                    "error: call again, pass, or answer with the error (per row key with --rows)")
    ap.add_argument("--answers", action="store_true", help="a table of the wrong answers: none, a number the "
                    "episode saw, one it did not, a text; the most common (per row key with --rows)")
    ap.add_argument("--guided", action="store_true", help="--rescue's guided replays (info.hint_for) only; "
                    "by default they are left out, as the step metrics leave them out")
    args = ap.parse_args(argv)
    if (args.family or args.first_calls) and not args.rows:
        ap.error("--family and --first-calls need --rows")
    eps = read_episodes(args.episodes)
    if args.sampling is not None:
        eps = [e for e in eps if (e.get("info") or {}).get("sampling") == args.sampling]
    eps = [e for e in eps if ("hint_for" in (e.get("info") or {})) == args.guided]
    questions = oracle_calls_by_question(args.rows, args.family) if args.rows else None
    repeats = any("repeat_calls" in (e.get("info") or {}) for e in eps)  # columns only where episodes count them
    by_step = collections.defaultdict(list)
    for e in eps:
        by_step[e.get("step")].append(e)
    print(f"| steps | episodes | correct | failed / ep | in correct | in wrong | ended: stop / max_turns / length "
          f"| share in eps with > {args.many} |")
    print("|---|---|---|---|---|---|---|---|")
    rows, by_calls, by_first, after, answers = [], [], [], [], []
    for label, keep in spans(args.steps, sorted(s for s in by_step if s is not None)):
        chosen = [e for s in sorted(keep) for e in by_step.get(s, [])]
        if chosen:
            rows.append(span_row(label, chosen, args.many, not args.without_doubled))
            print(rows[-1])
            by_calls += calls_rows(label, chosen, questions, repeats) if questions else []
            by_first += first_rows(label, chosen, questions) if args.first_calls else []
            keyed = {k: [e for e, _ in g] for k, g in by_row(chosen, questions).items()} if questions else {"all": chosen}
            after += [after_errors_row(label, k, g) for k, g in keyed.items()] if args.after_errors else []
            answers += [answers_row(label, k, g) for k, g in keyed.items()] if args.answers else []
    if questions:
        key = "family/oracle calls" if args.family else "oracle calls"
        more = " repeats / ep | of failed / ep |" if repeats else ""
        print(f"\n| steps | {key} | episodes | calls / ep | correct |{more}")
        print("|---" * (7 if repeats else 5) + "|")
        print("\n".join(by_calls))
    if args.first_calls:
        print(f"\n| steps | {key} | episodes | first call as the oracle's | first calls |")
        print("|---" * 5 + "|")
        print("\n".join(by_first))
    if args.after_errors:
        print("\n| steps | rows | episodes | with an error | called again | correct | answer quotes an error |")
        print("|---" * 7 + "|")
        print("\n".join(after))
    if args.answers:
        print("\n| steps | rows | wrong | no answer | number seen | number not seen | text | most common |")
        print("|---" * 8 + "|")
        print("\n".join(answers))
    return rows + by_calls + by_first + after + answers


if __name__ == "__main__":
    main()
