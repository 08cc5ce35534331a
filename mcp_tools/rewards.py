r"""
Answers and rewards of MCP tool-use episodes, as pure functions (values in, values out: no server, no
session, no row). MCPEnv (mcp_tools/env.py) plays an episode and scores it with these; env.py's module
doc puts them together into the episode's reward.

Answers (SYSTEM_PROMPT of mcp_tools/tasks.py): the content of the LAST <answer>...</answer>
(tagged_answer; envs.extract_answer is GSM8K's rule). ground_truth = {"answer": str, "type":
"number" | "text", "check": [state checks]} (a bare str/number: {"answer": it, "type": guessed});
check_ground_truth says why a row's cannot be one, normalise_ground_truth fills it in.
  number: the answer must hold exactly one number (thousands commas allowed, "$", units and
          words around it are ignored): |pred - truth| <= max(1e-9, 1e-6 * |truth|).  (answer_matches)
  text:   equal after casefold, whitespace collapse and stripping a trailing '.'.
A state check's result matches check["expect"] as a subset (matches_expected; scalars by same_value).

The reward's parts (env.py's module doc):
  shown_by        whether the episode's user turns and tool results showed an answer (unfounded_answer)
  invented        whether a call passes a number or date no earlier text showed (pays nothing)
  repeat_counts   identical calls (call_key), and repeats of a failed call that fail again (refailed)
  failed_charge   min(error_penalty x failed, error_cap) + error_penalty x (refailed + stale)
  episode_reward  base - (min(charge, 0.5) if won else charge)
  oracle_credit   the share of the row's oracle_calls the calls match, in order (partial credit)

Test: python -m pytest -q tests/test_mcp.py
"""
import json
import math
import re

REL_TOL, ABS_TOL = 1e-6, 1e-9


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUM = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def tagged_answer(text: str) -> str | None:
    """Stripped content of the last <answer>...</answer>; None if there is none."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def _num(s: str) -> float | None:
    nums = _NUM.findall(s)
    if len(nums) != 1:
        return None
    try:
        return float(nums[0].replace(",", ""))
    except (ValueError, OverflowError):
        return None


def _norm_text(s: str) -> str:
    return " ".join(str(s).split()).casefold().rstrip(".")


def close_enough(pred: float, truth: float) -> bool:
    return math.isfinite(pred) and abs(pred - truth) <= max(ABS_TOL, REL_TOL * abs(truth))


def answer_matches(answer: str | None, truth, kind: str) -> bool:
    if answer is None:
        return False
    if kind == "number":
        pred = _num(answer)
        return pred is not None and close_enough(pred, float(truth))
    return _norm_text(answer) == _norm_text(truth)


def shown_by(answer: str, shown: str) -> bool:
    """Whether shown (an episode's user turns and tool results) shows answer: a number answer (one number,
    as answer_matches reads it) as a number of that value there, any other answer as its normalised text
    inside shown's. The unfounded-answer charge's test (env.py's module doc); "" is shown by nothing. A number
    is read both with thousands commas and without (a JSON row [[5,1498.15]] shows 5 and 1498.15)."""
    value = _num(answer)
    if value is not None:
        return any(close_enough(value, float(x.replace(",", ""))) for x in _NUM.findall(shown) + NUMBER.findall(shown))
    norm = _norm_text(answer)
    return bool(norm) and norm in _norm_text(shown)


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_ground_truth(gt) -> str | None:
    """Why gt cannot be an mcp row's reward_spec.ground_truth; None when it can: the answer is a
    non-empty string or a finite number ("number" answers must read as one), check is a list of
    {"tool", "expect", "arguments", "path"} with a tool and an expect. So null, "", true or {} never
    score 1.0 for "<answer>None</answer>". MCPEnv.reset calls it (and also fails a check tool no
    server offers); a loader can call it too, before any model loads (envs.py does)."""
    obj = gt if isinstance(gt, dict) else {"answer": gt}
    if unknown := sorted(set(obj) - {"answer", "type", "check"}):
        return f"unknown key(s) {', '.join(map(repr, unknown))} (known: 'answer', 'type', 'check')"
    a = obj.get("answer")
    if not (_finite_number(a) or isinstance(a, str) and a.strip()):
        return f"the answer must be a non-empty string or a finite number, got {repr(a)[:60]}"
    if obj.get("type", "text") not in ("number", "text"):
        return f"type must be 'number' or 'text', got {repr(obj['type'])[:60]}"
    if obj.get("type") == "number" and not _finite_number(_as_number(a)):
        return f"type 'number' needs an answer that reads as a number (e.g. 42 or \"118.5\"), got {repr(a)[:60]}"
    checks = obj.get("check", [])
    if not isinstance(checks, list):
        return f"check must be a list of state checks, got {repr(checks)[:60]}"
    for j, ck in enumerate(checks):
        if not (isinstance(ck, dict) and isinstance(ck.get("tool"), str) and "expect" in ck
                and set(ck) <= {"tool", "arguments", "expect", "path"} and isinstance(ck.get("arguments", {}), dict)
                and isinstance(ck.get("path", []), list)
                and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in ck.get("path", []))):
            return (f'check[{j}] must be {{"tool": str, "expect": ..., "arguments": {{...}}, "path": [str | int]}} '
                    f"(arguments and path optional), got {repr(ck)[:60]}")
    return None


def normalise_ground_truth(gt) -> dict:
    """{"answer", "type", "check": [...]} from any valid ground truth (ValueError if invalid)."""
    if err := check_ground_truth(gt):
        raise ValueError(f"mcp ground_truth: {err}")
    out = dict(gt) if isinstance(gt, dict) else {"answer": gt}
    if "type" not in out:  # guess: a bare number (or a string that is only a number) is numeric
        a = out["answer"]
        numeric = (isinstance(a, (int, float)) and not isinstance(a, bool)) or \
            (isinstance(a, str) and re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*", a) is not None)
        out["type"] = "number" if numeric else "text"
    out["check"] = list(out.get("check", []))
    return out


def _as_number(v) -> float | None:
    """A JSON number, or a string float() reads (stripped), as a float; None otherwise (bools too)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except (ValueError, OverflowError):
            return None
    return None


def same_value(got, expect) -> bool:
    """Scalars by one rule: both read as numbers (a JSON number, or a string float() reads, e.g.
    "5", " 5.0 "; not bools) -> compared as numbers with the answer tolerance, so "5" matches a
    stored 5; else as text, a string stripped, anything else as its JSON text ("abc " matches "abc",
    true matches "true", "True" does not match true)."""
    a, b = _as_number(got), _as_number(expect)
    if a is not None and b is not None:
        return math.isfinite(b) and close_enough(a, b)
    text = lambda v: v.strip() if isinstance(v, str) else json.dumps(v)  # noqa: E731
    return text(got) == text(expect)


def matches_expected(got, expect) -> bool:
    """Subset match: every key of an expected dict must match (extra keys in got are fine), lists
    elementwise with equal length, scalars by same_value. MCPEnv._check first follows check["path"]."""
    if isinstance(expect, dict):
        return isinstance(got, dict) and all(k in got and matches_expected(got[k], v) for k, v in expect.items())
    if isinstance(expect, list):
        return isinstance(got, list) and len(got) == len(expect) and all(map(matches_expected, got, expect))
    return not isinstance(got, (dict, list)) and same_value(got, expect)


def _own_arguments(arguments: dict) -> dict:
    """A call's arguments less "session": the pool injects the episode's key over whatever the model wrote."""
    return {k: v for k, v in arguments.items() if k != "session"}


def call_key(name: str, arguments: dict) -> tuple:
    """What makes two calls identical: the name and the arguments' canonical JSON (_own_arguments)."""
    return name, json.dumps(_own_arguments(arguments), sort_keys=True)


def repeat_counts(calls: list[tuple]) -> tuple[int, int, int]:
    """(repeat_calls, repeat_failed, refailed) of an episode's calls [(call_key, failed)] in order:
    calls identical to an earlier one; identical to an earlier one that failed; and of those, the
    ones that failed again (a deterministic tool answers a repeat as it did the first time)."""
    seen, failed_before = set(), set()
    repeats = repeat_failed = refailed = 0
    for key, failed in calls:
        repeats += key in seen
        if key in failed_before:
            repeat_failed += 1
            refailed += bool(failed)
        seen.add(key)
        if failed:
            failed_before.add(key)
    return repeats, repeat_failed, refailed


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# a whole number ("3.5." ends a sentence; 3 of 3.5: none); options/plans.NUMBER is the same pattern
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w]|\.\d)")


def invented(arguments: dict, seen: str) -> bool:
    """Whether a call passes a number or an ISO date (a whole argument) that seen, the prompt and the
    tool results before the call, never showed: an id, amount or date made up where a lookup would
    give it (info["invented_calls"]). Text arguments are not judged (a query, an expression, SQL)."""
    shown = None  # the numbers seen holds (dates aside), as values: 549.80 is 549.8
    for v in _own_arguments(arguments).values():
        if isinstance(v, str) and _DATE.fullmatch(v) and v not in seen:
            return True
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            shown = {abs(float(x)) for x in NUMBER.findall(_DATE.sub(" ", seen))} if shown is None else shown
            if not any(abs(x - abs(v)) <= 1e-9 * max(1.0, abs(v)) for x in shown):  # "199 days before": -199
                return True
    return False


def failed_charge(failed: int, repeated: int, error_penalty: float, error_cap: float) -> float:
    """The episode's failed-call charge (env.py's module doc): error_penalty per failed call up to error_cap,
    plus error_penalty per repeat that learnt nothing (refailed + stale), outside the cap: inside it, a
    loop of one failing call would cost a wrong episode nothing once the cap is reached."""
    return min(error_penalty * failed, error_cap) + error_penalty * repeated


def episode_reward(base: float, won: bool, charge: float) -> float:
    """base less the charge, of which a correct answer pays at most 0.5 (so it beats any wrong one);
    MCPEnv pays the charge turn by turn and its turns sum to this."""
    return base - (min(charge, 0.5) if won else charge)


def _same_call(call: dict, oracle: dict) -> bool:
    a, b = _own_arguments(call["arguments"]), _own_arguments(oracle["arguments"])
    return call["name"] == oracle["name"] and a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)


def oracle_credit(calls: list[dict], oracle_calls: list[dict]) -> float:
    """The share of oracle_calls the episode's calls match in order, in [0, 1]; 0.0 for no oracle.
    Greedy: each call matches the next unmatched oracle call when the names are equal and the
    arguments have the same keys ("session" ignored) with values equal by same_value. So calls in
    between cost nothing, and a wrong argument leaves that oracle call (and all after it) unmatched."""
    matched = 0
    for c in calls:
        if matched < len(oracle_calls) and _same_call(c, oracle_calls[matched]):
            matched += 1
    return matched / len(oracle_calls) if oracle_calls else 0.0
