"""
What a rescue's hint shows and what a run finds (options/rescue.py's guide uses them):

  the hints      plan_row (a numbered plan of calls, values the prompt does not state as placeholders:
                 unstated), answer_row (the gold answer after the question, with a similar question's calls
                 when there are some), usable_calls (a row's oracle calls, when the tools have them)
  a pass         gold_answer (reward_spec.ground_truth), shows (a tool's result showed it: a number equal at
                 the answer's decimals, a word in any case), narrow (a result of few enough numbers to ground one),
                 made_up (a call whose numbers no earlier text showed, built to give one), grounds (both tests
                 of a result), question_text
  the turns      turn_spans, turns (an episode's (assistant, tool result) pairs), failed_result
  found plans    found_calls (hindsight: the calls up to the result that showed the answer, AgentHER arXiv
                 2603.21357), remember and keep_plan (a pass over a hindsight find, then the fewer calls, at most
                 MAX_PLAN), similar_plan (the nearest question's plan of the same data source, by the Jaccard
                 similarity of their words), row_key (what plans are kept under), uses (a later call took a
                 name from a result: whether a probe's call belongs in the plan)

Test: python -m pytest -q tests/test_train.py -k "rescue or hint or guide or plan or branch"
"""

import hashlib
import json
import math
import re

from support.rows import oracle_calls_error

MAX_PLAN = 8  # calls a found plan keeps
# a whole number in text: mcp_tools/rewards.NUMBER's pattern, written out because options/ imports nothing
# of mcp_tools/ (a test keeps the two equal)
NUMBER = r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w]|\.\d)"
DATE = r"\d{4}-\d{2}-\d{2}"  # an ISO date (made_up reads it whole, not as three numbers)
STAMP = DATE + r"(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?)?"  # a date or a time stamp: narrow counts none of its parts


def unstated(arguments: dict, prompt: list[dict]) -> dict:
    """arguments with each value that no message of prompt states (a whole word in any case, or a number
    of equal value) replaced by "<NAME>": what the plan shows of a call (plan_row)."""
    text = "\n".join(str(m.get("content") or "") for m in prompt)
    numbers = {float(x) for x in re.findall(NUMBER, text)}  # as values: 549.80 is 549.8

    def stated(v):
        if isinstance(v, bool) or not isinstance(v, (str, int, float)) or v == "":
            return False
        if not isinstance(v, str):
            return any(abs(x - v) <= 1e-9 * max(1.0, abs(v)) for x in numbers)
        return re.search(rf"(?<![A-Za-z0-9.]){re.escape(v)}(?![A-Za-z0-9]|\.[0-9])", text, re.I) is not None

    return {k: v if stated(v) else f"<{k}>" for k, v in arguments.items()}


def plan_row(row: dict, calls: list[tuple[str, dict]], total: int, first: str) -> dict:
    """row with a plan after the question: the last user message (a prompt with none: its last) gains
    the k calls (name, the arguments shown) of the oracle's total, a numbered line each, then call 1
    once more: `first`, as the model writes it. The row itself is not changed. Only call 1 is in the
    model's format: with every call so, the plan was copied whole into the first turn; and a value the
    prompt does not state is a placeholder (unstated), since a plan holding the values results give let
    the policy pass by writing its calls at once, which teaches guessing (docs/results.md, "a plan of
    names, one call a turn")."""
    head = ("Hint: one way to solve this is these tool calls, in this order, then the answer:"
            if len(calls) == total else "Hint: one way to solve this starts with "
            + (f"these {len(calls)} tool calls" if len(calls) > 1 else "this tool call") + f" (of {total}), in this order:")
    plan = "\n".join([head, *(f"{i}. {name} {json.dumps(arguments, ensure_ascii=False)}" for i, (name, arguments)
                                in enumerate(calls, 1)),
                      "Each value in angle brackets is yours to find, in the results of the calls before it or in "
                      "the tools' descriptions. Make only call 1 now, written so:", first,
                      "and each next call in a later turn, after you have read the result of the one before it."])
    return after_question(row, plan)


def after_question(row: dict, hint: str) -> dict:
    """row with hint after the question: the last user message (a prompt with none: its last) gains it,
    after a blank line. The row itself is not changed."""
    at = max((i for i, m in enumerate(row["prompt"]) if m.get("role") == "user"), default=len(row["prompt"]) - 1)
    prompt = [dict(m) for m in row["prompt"]]
    prompt[at]["content"] = f"{prompt[at]['content']}\n\n{hint}"
    return {**row, "prompt": prompt}


_UNKNOWN_SAID = set()  # tool names usable_calls has warned about (once each)


def usable_calls(row, tools=None) -> list:
    """The row's extra_info.oracle_calls, or [] when there are none or they are unusable (not a
    list of {name, arguments}, too many or too long: support/rows.oracle_calls_error) or name a
    tool not among tools (the servers' tool names, when known; said once a name). A row's file is
    checked when it loads (an unusable list dropped there, named file:line); this checks again, since
    rows may come from elsewhere: a row whose calls cannot be used is not guided, never a crash."""
    extra = row.get("extra_info") if isinstance(row, dict) else None
    calls = extra.get("oracle_calls") if isinstance(extra, dict) else None
    if calls is None or oracle_calls_error(calls) is not None:
        return []
    unknown = {c["name"] for c in calls} - set(tools) if tools is not None else set()
    for name in sorted(unknown - _UNKNOWN_SAID):
        print(f"WARNING: --rescue: extra_info.oracle_calls names {name!r}, no tool the servers offer: "
              "rows calling it are not guided (said once)", flush=True)
    _UNKNOWN_SAID.update(unknown)
    return [] if unknown else calls


def gold_answer(row: dict) -> str | None:
    """The row's expected answer as text (reward_spec.ground_truth, or its "answer"), None if it has none."""
    gt = (row.get("reward_spec") or {}).get("ground_truth") if isinstance(row.get("reward_spec"), dict) else None
    if isinstance(gt, dict):
        gt = gt.get("answer")
    if isinstance(gt, bool) or not isinstance(gt, (str, int, float)) or not str(gt).strip():
        return None
    return str(gt).strip()


def shows(text: str, answer: str) -> bool:
    """answer occurs in text: a number as a number of that value (one that rounds to it at the answer's
    decimals, for an answer with decimals, or one the reward would take for it: within 1e-6 of it, relative, as
    mcp_tools/rewards.close_enough), a text as a whole word in any case."""
    try:
        a = float(answer)
    except ValueError:
        return re.search(rf"(?<![A-Za-z0-9]){re.escape(answer)}(?![A-Za-z0-9])", text, re.I) is not None
    if not math.isfinite(a):
        return False
    places = len(answer.partition(".")[2]) if "." in answer else 0
    return any(round(x, places) == round(a, places) or abs(x - a) <= max(1e-9, 1e-6 * abs(a))
               for x in map(float, re.findall(NUMBER, text)))


def question_text(row: dict) -> str:
    """The row's user turns as one text: what the question stated (made_up's seen, take_back_unfound)."""
    return "\n".join(str(m.get("content") or "") for m in row["prompt"] if m.get("role") == "user")


def made_up(text: str, seen: str) -> bool:
    """Whether a turn's text passes numbers or ISO dates, at least one, none of which seen (the question and the
    results before the turn) showed (shows; a date as written): a call built to give a number, such as
    date_diff("2023-04-01", "2023-04-15") by a policy told the answer 14, or calculate("7*2"). A call that takes
    one value it read and derives the others (a price times 1 - 0.05) is not. narrow=N's second test."""
    values = re.findall(DATE, text) + [v.lstrip("-") for v in re.findall(NUMBER, re.sub(DATE, " ", text))]
    return bool(values) and not any(v in seen if re.fullmatch(DATE, v) else shows(seen, v) for v in values)


def is_number(answer: str) -> bool:
    """Whether an answer is a number (narrow and made_up judge only those)."""
    try:
        float(answer)
    except ValueError:
        return False
    return True


def narrow(result: str, answer: str, most: int | None, told: bool = True) -> bool:
    """Whether result is narrow enough to ground a number answer: at most `most` numbers (NUMBER) in it, a date's or
    a time stamp's parts not counted (a record's created_at is no candidate value). Any result is, for a text answer
    or where most is None. A wide result (a table listed whole) holds most small integers, so it shows a guessed or
    recalled count by chance (rescue's narrow=N). told=False (a pass the policy reached without being told the
    answer): a wide result grounds a specific answer too, one with decimals or of 100 or more, that it holds once,
    as a record read whole shows a price (the wide results of unguided chance passes in five seeds' logs held
    small integers; a policy told the answer finds any number in a dump, so a told pass gets no such leave)."""
    if most is None or not is_number(answer):
        return True
    values = re.findall(NUMBER, re.sub(STAMP, " ", result))
    if len(values) <= most:
        return True
    x = float(answer)
    return not told and (x != int(x) or abs(x) >= 100) and sum(shows(v, answer) for v in values) == 1


def grounds(result: str, answer: str, most: int | None, told: bool = True) -> bool:
    """Whether a tool's result grounds answer: shows it and is narrow enough (narrow, told as there); under narrow
    (most set) a date's or time stamp's parts do not show a number answer. found_calls' test of each result, and
    of a probe's played one (options/rescue.py)."""
    plain = re.sub(STAMP, " ", result) if most is not None and is_number(answer) else result
    return shows(plain, answer) and narrow(result, answer, most, told)


def turn_spans(episode) -> list[tuple[int, int, int]]:
    """Each policy turn of an episode as (where its text starts, where it ends, where the observation after
    it ends) in episode.response_ids, read off its mask; context before the first turn (given turns:
    as_context, from_head) is skipped."""
    mask, out, i = episode.response_mask, [], 0
    while i < len(mask) and not mask[i]:
        i += 1
    while i < len(mask):
        start = i
        while i < len(mask) and mask[i]:
            i += 1
        said = i
        while i < len(mask) and not mask[i]:
            i += 1
        out.append((start, said, i))
    return out


def turns(episode, decode) -> list[tuple[str, str]]:
    """An episode as [(what the policy wrote, the observation after it)], read off its mask (turn_spans)."""
    ids = episode.response_ids
    return [(decode(ids[start:said]), decode(ids[said:end]) if end > said else "")
            for start, said, end in turn_spans(episode)]


def failed_result(obs: str) -> bool:
    """A turn's results hold a tool's error (found_calls leaves such a turn's calls out of a plan; branch_head
    starts again after one first)."""
    return "Error" in obs


def found_calls(episode, answer: str, decode, parse, most: int | None = None, seen: str = "",
                told: bool = True) -> list[dict] | None:
    """The calls that led to answer in this episode: every call up to the first tool result that shows it,
    less the calls of earlier turns whose results hold an error ([] if none parse), or None when no result
    showed the answer before the policy wrote it (an episode told the answer and copying it, or a guess): the
    grounding test of source=answer. parse(text) -> the
    turn's calls [{"name", "arguments"}]. Read from any episode, passed or not: one whose results showed the
    answer and which then answered otherwise reached the goal all the same (hindsight, options/rescue.py's doc).
    most: only a result of at most that many numbers shows a number answer (narrow; told=False: an unguided pass,
    as narrow says; a date's or time stamp's parts neither count nor show it), and only after a turn whose numbers
    were not all made up (made_up, over seen: the question, the context given before the episode's own turns, the
    results so far); None: any result after any turn."""
    calls, number = [], most is not None and is_number(answer)
    spans = turn_spans(episode)
    seen += "\n" + decode(episode.response_ids[:spans[0][0]]) if spans else ""  # a given turn's call and result
    for text, obs in turns(episode, decode):
        if shows(text, answer):  # written before any result showed it
            return None
        made = parse(text)
        if obs and grounds(obs, answer, most, told) and not (number and made_up(text, seen)):
            return (calls + made)[:MAX_PLAN]
        if not failed_result(obs):
            calls += made
        seen += "\n" + obs
    return None


def answer_row(row: dict, answer: str, plan: list[tuple[str, dict]] = ()) -> dict:
    """row with the answer after the question (source=answer, options/rescue.py's doc), and the calls (name, the
    arguments shown) that found the answer to a similar question when plan has some (answer+similar).
    The row itself is not changed."""
    hint = (f"Hint: the correct final answer is {answer}. Find it with the tools: make the calls that show it, "
            "one call a turn, reading each result before the next call. Where a call needs a name or an id you "
            "have not seen yet (a table, a column, a record), first call a tool that lists or describes them. "
            "A tool's error is not the answer: read it and make a better call. The answer counts only once a "
            "tool's result has shown it, so do not write it before then.")
    if plan:
        hint += "\nThese calls found the answer to a similar question (each value in angle brackets is yours to find):\n"
        hint += "\n".join(f"{i}. {name} {json.dumps(arguments, ensure_ascii=False)}" for i, (name, arguments) in enumerate(plan, 1))
    return after_question(row, hint)


NAME = r"[A-Za-z_][A-Za-z0-9_]+|\d{3,}"  # a name a call may take from a result: a word, an id of 3 digits or more


def uses(result: str, calls: list[dict], context: str) -> bool:
    """Some argument of calls holds a name (NAME) that result shows as a whole word and context (the prompt as
    the model read it: its tools, the question) does not: the calls looked something up in result (a table
    db_describe took from db_tables' list), so the call that gave it belongs in their plan; a result none of
    them drew on was a detour."""
    shown = set(re.findall(NAME, result.lower())) - set(re.findall(NAME, context.lower()))
    return any(w in shown for c in calls for v in c.get("arguments", {}).values()
               for w in re.findall(NAME, str(v).lower()))


def question_words(row: dict) -> set[str]:
    """The words of the row's last user message, lower case: what a found plan is matched on (similar_plan)."""
    text = next((str(m.get("content") or "") for m in reversed(row["prompt"]) if m.get("role") == "user"), "")
    return set(re.findall(r"[a-z]+", text.lower()))


def similar_plan(found: dict, row: dict) -> list[dict]:
    """source=answer+similar: the calls of the passed episode whose question is nearest row's (Jaccard
    similarity of their word sets, > 0), among the found plans of rows with row's data_source; row's own
    plan first. [] when there is none. A row rarely comes back within a run (1,935 rows, 32 a step), so
    its own plan seldom exists when it is all wrong again; a similar row's plan of names often does."""
    if row_key(row) in found:
        return found[row_key(row)]["calls"]
    words = question_words(row)
    best, score = [], 0.0
    for plan in found.values():
        if not plan["rank"][0] or plan.get("source") != row.get("data_source") or "words" not in plan:
            continue  # passes only: a hindsight find may hold detours
        other = set(plan["words"])
        s = len(words & other) / max(1, len(words | other))
        if s > score:
            best, score = plan["calls"], s
    return best


def plan_of(row: dict, calls: list[dict]) -> list[tuple[str, dict]]:
    """What a plan shows of each call: its name, the arguments the prompt states."""
    return [(c["name"], unstated(c["arguments"], row["prompt"])) for c in calls]


def row_key(row: dict) -> str:
    """What found plans are kept under: the row's prompt."""
    return hashlib.sha1(json.dumps(row["prompt"], sort_keys=True, default=str).encode()).hexdigest()[:16]


def remember(found: dict, row: dict, episode, decode, parse, most: int | None = None) -> bool:
    """Keep this episode's calls as the row's found plan (found_calls, most as there, seen: the row's question, told:
    a guided episode) when it has some: a pass over a hindsight find, then the fewer calls. True if it was kept."""
    answer, told = gold_answer(row), "hint_for" in episode.info
    calls = found_calls(episode, answer, decode, parse, most, question_text(row), told) if answer else None
    return keep_plan(found, row, calls, episode.passed())


def keep_plan(found: dict, row: dict, calls: list[dict] | None, passed: bool) -> bool:
    """remember's rule, for calls already read off an episode (found_calls)."""
    if not calls:
        return False
    key, rank = row_key(row), (passed, -len(calls))
    if key in found and tuple(found[key]["rank"]) > rank:
        return False
    found[key] = {"calls": calls, "rank": list(rank), "source": row.get("data_source"),
                  "words": sorted(question_words(row))}  # similar_plan's
    return True
