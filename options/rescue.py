"""
Rescue for prompts the policy cannot solve yet (--rescue hint=S,credit=W,guide=plan|tiers|prefix,
baseline=joint|own,source=oracle|found|answer|found+answer|answer+similar,branch=F,probe=F,replay=K,narrow=N;
off by default, but source=answer+similar,branch=0.5 for --env mcp rows without oracle calls: default_spec).
A group of n episodes with no correct one has equal rewards, every A_i = 0: it shows no way to solve its
prompt. With hint=S such a group is sampled again in the same step with guidance, only where unguided
rollouts reach no reward (ActGuide-RL, arXiv 2605.12004), with a share that decays over the first S steps (QuestA, arXiv 2507.13266):

    share = max(0, 1 - step / S)      k = ceil(share x most)      (hint_calls)

What guides a group (source=):
  oracle     the first k of the row's extra_info.oracle_calls (usable_calls).
  found      calls this run found for the row: an episode whose results showed its answer, passed or not
             (hindsight, AgentHER arXiv 2603.21357; found_calls, remember), kept in train.py's state.
  answer     the gold answer after the question, to be found with the tools (answer_row: a self-hint from
             the question and its answer, as NuRL's, arXiv 2509.25666). A pass counts only where a tool's
             result showed the answer before the policy wrote it; a copied or guessed answer is no pass.
  found+answer: the found plan, else the answer. answer+similar: the answer, and the calls that answered
             the nearest question of the same data source (similar_plan).
  branch=F   with an answer source: a share F of the answer-hinted groups starts again from a turn
             boundary one of its own episodes reached (branch_head; Tree-GRPO's branching, arXiv 2509.21240).
  probe=F    with an answer source: a share F of the answer-asked groups that do not branch is sampled again,
             without the answer, after a played call to a tool none of its episodes called that needs no
             argument and that its server does not mark as writing (pool.no_argument: a tool that lists what
             the servers hold, db_tables or list_tables): exploration over the tools, where a policy that
             settled on a look-alike tool never tries the one the question needs (probe_calls). Its passes
             give the row a found plan, which answer+similar then shows; it starts with the probe's call
             where a later call took a name from its result (plans.uses), else that call was a detour.
  told=1     with probe=F: the probe's continuation is sampled under the answer hint too, and its pass counts as
             a told one does (found_calls): after the listing, told what to find, the policy may reach the tool the
             listing names, where alone it rarely did ("the probe at three seeds": 10 / 7 / 16 probe passes).
  narrow=N   a number answer counts as found only where a tool's result of at most N numbers showed it
             (plans.narrow), from a call that did not write it first, nor made up every number it passed
             (plans.made_up: no earlier text showed any, as date_diff("2023-04-01", "2023-04-15") for a told 14): the
             test of a guided pass and of a found plan, and every unguided pass of the step whose row has an answer
             and no state check, and whose question does not state it, is taken back without one (info["unfound"],
             rescue_unfound; eval.py scores answers alone). A listing of a whole table holds most small integers: a
             policy told the answers dumped the shop's tables and answered records questions with counts they held by
             chance, which the hint's text test passed (docs/results.md, "the probe at three seeds": on three seeds'
             logged episodes N=8 took back 133 of 148 such answer-hinted passes and 21 of 23 such unguided ones,
             against 3 of 173 and 32 of 8,216 others; lab/unfound.py). With it, one seed's told discovery answers
             came from such built calls instead (date_diff, calculate: "narrow=8 at two seeds"), which made_up takes
             back. A date's or time stamp's parts neither count nor show a number (a record's created_at), and an
             unguided pass may also rest on a wide result that holds a specific answer (decimals, or 100 or more)
             once (plans.narrow's told=False). All of it together, over five seeds' logged episodes: 176 of 206
             discovery passes without db_query taken back, 0 of 302 with it, 38 of 12,906 others (lab/unfound.py).
  replay=K   a row whose all-wrong group a guided pass joined is asked again K steps later, in place of a
             fresh row, and again each time the rescue solves it, at most REPLAY_MOST times; rows the
             policy passes alone leave (replays; Prompt Replay's reuse of prompts, not of samples, arXiv
             2603.21177). Its unguided episodes are on-policy samples like any row's: only the data order
             changes, toward the rows the rescue showed to be in reach. The fresh rows a replay displaces
             wait for the next epoch. Under torchrun each rank queues its own rows, and a checkpoint keeps
             the main rank's queue, as it keeps its found plans.
How (guide=): plan writes the k calls into the prompt as a numbered plan, values the prompt does not state
as placeholders (plan_row); tiers adds one call at a time while the group stays all wrong (Scaf-GRPO, arXiv
2510.19807); prefix plays the calls as given assistant turns (Hinted). baseline=joint trains a guided group
that passes with its all-wrong one, one baseline over the 2n (LUFFY's mixed-policy groups, arXiv
2504.14945); own puts it in its place. A guided group with no pass is not trained, nor, under the
oracle-free sources, an all-wrong group that no guided pass joins (untrained_all_wrong). credit=W (partial
credit for calls that follow the oracle's, MatchTIR arXiv 2601.10712) is mcp_tools/rewards.py's oracle_credit.

Which tokens are sampled under which context, and what is off-policy:
  plan and answer hints (and a branch's continuation): sampled under prompt + hint, trained under the
  prompt alone (their prompt_ids are the unguided group's), so off-policy for it. With --old-logprobs
  recompute (the default at several updates a step) PPO's ratio and clip are taken against the trainer's
  unhinted policy: a mixed-policy update biased toward the hinted behaviour, as ActGuide-RL's. With
  --old-logprobs rollout the ratio is p(token | prompt) / p(token | prompt + hint), and --tis-cap C caps
  it at C: Guide's importance correction (Nath et al., arXiv 2506.13923), truncated.
  prefix turns, a branch's head and a probe's call: context, not samples, mask 0 like tool results (no loss, KL
  or entropy, out of every denominator); every token that trains was sampled given exactly that context (a probe's
  continuation with no hint at all: on-policy after a first turn the policy did not choose; told=1: under the
  answer hint, off-policy as the answer hints are). A
  head is its episode's own tokens; the env runs its calls again, so a tool whose result changes between
  the two runs (a clock) adds off-policy context.
  A guided pass trains an answer that a tool's result showed. That test is a text match (shows): a number
  equal at the answer's decimals, a word in any case, so a small integer can show by chance (a date's day);
  narrow=N counts only results of at most N numbers.

Shaped knowing held-out failures, as docs/results.md says beside their figures: the answer hint's advice
to list or describe first (discovery, the sqlite transfer rows), branch= (transfer rows that answer
after a call that failed), probe= (a seed whose records questions stayed on the shop's SQL tool: "prompt
replay, seeds 0 and 1"), narrow= (the chance passes of the entry "the probe at three seeds") and its
made_up test and told= (the seed of "narrow=8 at two seeds" that never passed a discovery row genuinely). The
measurements behind each choice are in docs/results.md ("the rescue's ablation", "a plan of names, one call
a turn", "rows without oracle calls at three seeds"), and the notes this docstring carried until then in
the entry "the branch after a failed first call".

The hints' texts, the test of a pass and the found plans are in options/plans.py.

Test: python -m pytest -q tests/test_train.py -k "rescue or hint or guide or plan or tiers or branch"
"""

import random

from options.plans import (MAX_PLAN, answer_row, failed_result, found_calls, gold_answer, grounds, keep_plan, plan_of,
                           plan_row, question_text, remember, row_key, shows, similar_plan, turn_spans, turns, usable_calls,
                           uses)
from rollout import Env

GUIDES = ("plan", "tiers", "prefix")
SOURCES = ("oracle", "found", "answer", "found+answer", "answer+similar")


def parse(spec: str) -> dict:
    """--rescue SPEC -> {"hint": steps or 0, "credit": w or 0.0, "guide": "plan" | "tiers" | "prefix",
    "baseline": "joint" | "own", "source": one of SOURCES, "branch": F or 0.0, "probe": F or 0.0, "told": bool,
    "replay": K or 0, "narrow": N or 0}:
    "" or "off" (off), "hint=15", "credit=0.1", "hint=15,credit=0.1,guide=prefix"; anything else is a ValueError
    naming --rescue and the bad part."""
    out, seen = {"hint": 0, "credit": 0.0, "guide": "plan", "baseline": "joint", "source": "oracle", "branch": 0.0,
                 "probe": 0.0, "told": False, "replay": 0, "narrow": 0}, set()
    for part in (p.strip() for p in ("" if spec.strip() == "off" else spec).split(",") if p.strip()):
        key, _, value = part.partition("=")
        try:
            if key in seen or not value:
                raise ValueError
            elif key == "hint" and value.isdigit():
                out["hint"] = int(value)
            elif key == "credit" and 0.0 <= float(value) < 1.0:  # below a correct answer's 1.0
                out["credit"] = float(value)
            elif key == "guide" and value in GUIDES:
                out["guide"] = value
            elif key == "baseline" and value in ("joint", "own"):
                out["baseline"] = value
            elif key == "source" and value in SOURCES:
                out["source"] = value
            elif key in ("branch", "probe") and 0.0 < float(value) <= 1.0:
                out[key] = float(value)
            elif key in ("replay", "narrow") and value.isdigit() and int(value) >= 1:
                out[key] = int(value)
            elif key == "told" and value in ("0", "1"):
                out["told"] = value == "1"
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--rescue {spec!r}: bad part {part!r}; want hint=STEPS (an integer >= 0), "
                             "credit=W (0 <= W < 1), guide=plan|tiers|prefix, baseline=joint|own, "
                             "source=oracle|found|answer|found+answer|answer+similar, branch=F or probe=F "
                             "(0 < F <= 1), told=0|1, replay=K (K >= 1 steps), narrow=N (N >= 1 numbers), or several: "
                             "hint=15,credit=0.3") from None
        seen.add(key)
    if out["replay"] and not out["hint"]:
        raise ValueError(f"--rescue {spec!r}: replay= asks again the rows that guided groups solved; it needs hint=S")
    if out["told"] and not out["probe"]:
        raise ValueError(f"--rescue {spec!r}: told=1 tells the probes the answer; it needs probe=F")
    for key in ("branch", "probe"):
        if out[key] and "answer" not in out["source"]:
            raise ValueError(f"--rescue {spec!r}: {key}= starts the answer-asked groups again; it needs source=answer, "
                             "found+answer or answer+similar")
    return out


def default_spec(rows: list[dict], steps: int) -> str:
    """--rescue when it is not given, for --env mcp (train.py): hint=3 x steps,source=answer+similar,branch=0.5
    where no training row carries oracle calls and some row has an answer (a user's rows: a question and an
    answer), else "" (off). The bundled rows carry oracle calls, so the default run is unchanged. Measured:
    docs/results.md, "the user's own servers" (third-party servers, rows of a question and an answer) and
    "the branch from any turn, seeds 0 and 1" (the second split, against source=answer alone)."""
    if any((r.get("extra_info") or {}).get("oracle_calls") for r in rows):
        return ""
    if not any(gold_answer(r) is not None for r in rows):
        return ""
    return f"hint={3 * max(steps, 1)},source=answer+similar,branch=0.5"


def hint_calls(step: int, steps: int, most: int) -> int:
    """Oracle calls given at this step: ceil(share x most), share = max(0, 1 - step / steps) (module
    doc), in integers so that a share of exactly 2/3 of 3 calls is 2, not 3."""
    if steps <= 0 or most <= 0 or step >= steps:
        return 0
    return -(-(steps - step) * most // steps)


def guide(episodes, rows_by_group, step, spec, render, sample, tools=None, found=None, decode=None, parse=None,
          max_turns=None):
    """The step's kept episodes (a group's are contiguous), each all-wrong group with a plan or an answer to
    give sampled again with it -> (episodes, metrics, every guided episode: for beside; those not trained
    carry info["not_trained"]). spec: parse()'s; render(name, arguments) -> the call as the model writes it
    (guide=prefix's played turns); sample(rows, group_ids) -> their episodes, n a row, in row order (a
    guide=prefix row carries its played turns: hint_row); tools: the servers' tool names, or None (unknown:
    any name goes), for probe=F a dict {name: a probe may call it} (pool.no_argument). source=found|answer
    need found (a dict the run keeps across steps and checkpoints), decode(token ids) -> text and parse(text)
    -> a turn's calls; max_turns: the run's turn limit, or None (the env's): where a branch may start
    (branch_head).

    Guided episodes carry info["hint_for"] (the group they replay), k as info["plan_calls"] or
    info["hint_turns"], info["answer_hint"] or info["probe"] (the tool a probe called), and a copied or
    guessed pass info["ungrounded"] (its 1.0 taken back). Step metrics (reward_mean, ...) skip them
    (support/logs.episode_metrics), so runs with and without rescue compare; rescue_passed/SOURCE counts the
    guided groups that passed by their rows' data_source, beside correct/SOURCE. Under baseline=joint a
    joined group adds n episodes to the step (rescue_joined); with several ranks each trains the fewest
    episodes any rank kept (support/dist.World.trained), which
    may cut a rank's last joined episodes."""
    groups = {}  # group id -> its episodes, in order
    for e in episodes:
        groups.setdefault(e.group, []).append(e)
    source, most = spec.get("source", "oracle"), spec.get("narrow") or None
    plan, tiers = spec["guide"] != "prefix", spec["guide"] == "tiers"
    unfound = {"rescue_unfound": take_back_unfound(groups, rows_by_group, most, decode, parse)} if most else {}
    new_plans = 0  # rows given a found plan this step (rescue_found_new)
    if "found" in source or "answer" in source:  # every episode of the step may give its row a plan (hindsight too)
        for g, eps in groups.items():
            new_plans += sum(remember(found, rows_by_group[g], e, decode, parse, most) for e in eps)
    todo, asked = [], []  # (group id, its plan's calls, calls given now, the most this step gives); answer groups
    for g, eps in groups.items():
        if any(e.passed() for e in eps):
            continue
        row = rows_by_group[g]
        if source == "oracle":
            calls = usable_calls(row, tools)
        else:
            calls = found.get(row_key(row), {}).get("calls", []) if "found" in source else []
        k = hint_calls(step, spec["hint"], len(calls) - (not plan))
        if k:
            todo.append((g, calls, 1 if tiers else k, k))
        elif "answer" in source and hint_calls(step, spec["hint"], 1) and gold_answer(row) is not None:
            asked.append(g)
    if not todo and not asked:
        groups, dropped = untrained_all_wrong(groups, {}, source)
        return [e for eps in groups.values() for e in eps], {"rescue_groups": 0, "rescue_hint_turns": 0.0, **unfound,
                      **({"rescue_found": len(found), "rescue_dropped": dropped} if source != "oracle" else {})}, []
    branch = branch_heads(groups, rows_by_group, asked, spec.get("branch", 0.0), step, decode, parse, max_turns)
    probes = probe_calls(groups, rows_by_group, [g for g in asked if g not in branch], spec.get("probe", 0.0), step,
                         decode, parse, tools)
    swap, given, rounds = {}, {}, 0  # group id -> the guided group that replaces it, the calls it was given
    fresh = max([*rows_by_group, *groups]) + 1  # ids no group of this step has
    left, ungrounded, similar_given = todo, 0, 0
    while left or asked:  # guide=tiers: a group still all wrong goes again with one call more, up to the most
        ids, rounds = list(range(fresh, fresh + len(left) + len(asked))), rounds + 1
        fresh += len(ids)
        if plan:  # the calls' names and the arguments the prompt states, numbered; call 1 as the model writes it
            plans = [plan_of(rows_by_group[g], calls[:k]) for g, calls, k, _ in left]
            rows = [plan_row(rows_by_group[g], p, len(calls), render(*p[0])) for (g, calls, _, _), p in zip(left, plans)]
        else:  # the calls as the model writes them, played as its turns
            rows = [hint_row(rows_by_group[g], [render(c["name"], c["arguments"]) for c in calls[:k]])
                    for g, calls, k, _ in left]
        similar = [similar_plan(found, rows_by_group[g]) if "similar" in source and g not in probes else []
                   for g in asked]
        similar_given += sum(map(bool, similar))
        for g, calls in zip(asked, similar):
            row = rows_by_group[g]
            if g in probes:  # the probe's call played, then the policy; told=1: under the answer hint too (module doc)
                told = answer_row(row, gold_answer(row)) if spec.get("told") else row
                rows.append(hint_row(told, [render(probes[g], {})]))
                continue
            row = answer_row(row, gold_answer(row), plan_of(row, calls))
            rows.append(hint_row(row, branch[g][1]) if g in branch else row)
        new = sample(rows, ids)
        by = {}
        for e in new:
            by.setdefault(e.group, []).append(e)
        again = []
        for (g, calls, k, most), i in zip(left, ids):
            for e in by[i]:
                e.info["hint_for"] = g
                if plan:  # trained under the prompt without the plan (module doc)
                    e.info["plan_calls"], e.prompt_ids = k, list(groups[g][0].prompt_ids)
                else:  # the played turns: context after the group's prompt, as tool results are
                    as_context(e, groups[g][0].prompt_ids, k)
            swap[g], given[g] = by[i], k
            if tiers and k < most and not any(e.passed() for e in by[i]):
                again.append((g, calls, k + 1, most))
        for g, i in zip(asked, ids[len(left):]):
            row = rows_by_group[g]
            truth = (row.get("reward_spec") or {}).get("ground_truth")
            checked = isinstance(truth, dict) and bool(truth.get("check"))  # a state check grounds a pass itself
            answer = gold_answer(row)
            context = decode(groups[g][0].prompt_ids) if g in probes else ""  # what the prompt stated (uses)
            for e in by[i]:  # a pass counts only if a result showed the answer first; trained without the answer
                e.info["hint_for"] = g
                if g in probes:  # the played call and its result: context after the group's prompt
                    as_context(e, groups[g][0].prompt_ids, 1, spec.get("told", False))
                    e.info["probe"] = probes[g]
                    if spec.get("told"):
                        e.info["answer_hint"] = True
                else:
                    e.info["answer_hint"], e.prompt_ids = True, list(groups[g][0].prompt_ids)
                head = decode(branch[g][0]) if g in branch else ""  # the branch's turns: seen before its own
                calls = found_calls(e, answer, decode, parse, most, question_text(row) + "\n" + head)
                if g in branch:  # after the group's own turns and their results (branch=F, module doc)
                    from_head(e, branch[g][0], len(branch[g][1]))
                    calls = (branch[g][2] + calls)[:MAX_PLAN] if calls else calls
                elif g in probes:  # the probe's call starts the plan where its result showed the answer or a later
                    shown = decode(given_turns(e))  # call took a name from it (uses); else it was a detour
                    calls = [] if calls is None and grounds(shown, answer, most) else calls
                    if calls is not None and (not calls or uses(shown, calls, context)):
                        calls = ([{"name": probes[g], "arguments": {}}] + calls)[:MAX_PLAN]
                if e.passed() and not checked and calls is None:
                    take_back(e, "ungrounded")
                    ungrounded += 1
                else:
                    new_plans += keep_plan(found, row, calls, e.passed())
            swap[g], given[g] = by[i], 0
        left, asked = again, []
    for g, eps in swap.items():  # a guided pass gives its row a plan for the steps to come
        if "found" in source:
            new_plans += sum(remember(found, rows_by_group[g], e, decode, parse, most) for e in eps if "plan_calls" in e.info)
    n_groups = len(swap)
    solved = {g: any(e.passed() for e in swap[g]) for g in swap}
    guided = [e for g in swap for e in swap[g]]  # shown beside their groups, trained or not
    joint = spec.get("baseline") == "joint"
    if plan or joint:  # a guided group with no pass is not trained (its rewards differ by shaping only); its group stays
        for e in (e for g in swap if not solved[g] for e in swap[g]):
            e.info["not_trained"] = True
        swap = {g: eps for g, eps in swap.items() if solved[g]}
    if joint:  # one group, one baseline: the guided episodes follow the unguided ones they join
        for g, eps in swap.items():
            for e in eps:
                e.group = g
    groups, dropped = untrained_all_wrong(groups, swap, source)
    out = [e for g, eps in groups.items() for e in (eps + swap.get(g, []) if joint else swap.get(g, eps))]
    m = {"rescue_groups": n_groups, "rescue_solved": sum(solved.values()) / n_groups,
         "rescue_hint_turns": sum(given.values()) / n_groups, **unfound}
    for g in solved:  # guided groups that passed, by their rows' data_source (which families the rescue reaches)
        if isinstance(src := rows_by_group[g].get("data_source"), str):
            m[f"rescue_passed/{src}"] = m.get(f"rescue_passed/{src}", 0) + solved[g]
    if source != "oracle":
        m.update(rescue_found=len(found), rescue_found_new=new_plans, rescue_ungrounded=ungrounded, rescue_dropped=dropped,
                 rescue_answer_groups=sum(1 for g in swap if given[g] == 0 and "answer_hint" in swap[g][0].info),
                 **({"rescue_similar": similar_given} if "similar" in source else {}),
                 **({"rescue_branched": len(branch), "rescue_branch_turns": sum(len(b[1]) for b in branch.values())
                     / max(len(branch), 1)} if spec.get("branch") else {}),
                 **({"rescue_probed": len(probes), "rescue_probe_passed": sum(solved[g] for g in probes)}
                    if spec.get("probe") else {}))
    if joint:
        m["rescue_joined"] = sum(map(len, swap.values()))  # episodes the step trains beyond its n a prompt
    return out, ({**m, "rescue_rounds": rounds} if tiers else m), guided


def take_back(episode, why: str):
    """A pass that does not count: info["correct"] False, info[why] True (ungrounded, unfound), its 1.0 off its reward
    (the failed-call charges it paid stay)."""
    episode.info["correct"], episode.info[why], episode.reward = False, True, episode.reward - 1.0


def take_back_unfound(groups: dict, rows_by_group: dict, most: int, decode, parse) -> int:
    """narrow=N: each unguided pass whose row has an answer and no state check, and whose question does not state
    the answer, with no result of at most N numbers that showed it before the policy wrote it, after a call not
    made up (found_calls), is taken back (take_back, as an ungrounded guided pass) -> how many were."""
    n = 0
    for g, eps in groups.items():
        row = rows_by_group[g]
        answer, truth = gold_answer(row), (row.get("reward_spec") or {}).get("ground_truth")
        question = question_text(row)
        if answer is None or isinstance(truth, dict) and truth.get("check") or shows(question, answer):
            continue
        for e in eps:
            if e.passed() and found_calls(e, answer, decode, parse, most, question, told=False) is None:
                take_back(e, "unfound")
                n += 1
    return n


def branch_head(episodes, answer: str, decode, parse, rng=None, max_turns=None):
    """branch=F: where one of a group's episodes starts again -> (the tokens of its turns and results up to
    there, those turns' texts as the env read them: decode, the calls of those turns whose results held no
    error: parse), or None. A boundary qualifies after a turn that made a call, with no result up to it that
    showed the answer (one that did was a find, not a failure) and no text that wrote it, and with two turns
    left to play after it: before the turn the episode answered in, two turns before the limit in an episode
    cut there (finish_reason max_turns), and two before max_turns (the run's --max-turns) where it is known.
    After an error first (failed_result), then any; rng (random.Random) draws among them."""
    heads = ([], [])  # after an error, after any other result
    for e in episodes:
        spans = turn_spans(e) if e.response_mask[:1] == [1] else []  # given turns first: not the group's own
        last = len(spans) - (2 if e.finish_reason == "max_turns" else 1)
        texts, calls = [], []
        for start, said, end in spans[:max(0, min(last, max_turns - 2) if max_turns else last)]:
            text, obs = decode(e.response_ids[start:said]), decode(e.response_ids[said:end])
            made = parse(text)
            if not made or end == said or shows(text, answer) or shows(obs, answer):
                break  # a call that wrote the answer before any result showed it is a guess (found_calls)
            failed = failed_result(obs)
            texts, calls = texts + [text], calls + ([] if failed else made)
            heads[not failed].append((e.response_ids[:end], texts, calls))
    pool = heads[0] or heads[1]
    return (rng or random.Random(0)).choice(pool) if pool else None


def branch_heads(groups: dict, rows_by_group: dict, asked: list, share: float, step: int, decode, parse,
                 max_turns=None) -> dict:
    """The answer-asked groups that start again from a turn boundary of their own (branch_head): of those
    that have one, each with chance share, the chance and the boundary drawn from the row and the step (the
    same on every rank and on a resumed run) -> {group id: (head tokens, turn texts, calls)}."""
    out = {}
    for g in asked if share else ():
        row = rows_by_group[g]
        rng = random.Random(f"{row_key(row)}:{step}")
        if rng.random() < share:
            head = branch_head(groups[g], gold_answer(row), decode, parse, rng, max_turns)
            if head is not None:
                out[g] = head
    return out


def probe_calls(groups: dict, rows_by_group: dict, asked: list, share: float, step: int, decode, parse, tools) -> dict:
    """probe=F: the answer-asked groups (those not branched) sampled again after a call the trainer makes for the
    policy -> {group id: the tool's name}. Of those groups, each with chance share, a tool none of its episodes
    called among those tools (a dict: name -> a probe may call it, pool.no_argument; "row": only for a row whose
    extra_info.tools names it, as such a row shows only those) allows, drawn from the row and the step (the same on
    every rank and on a resumed run). No probe where tools are unknown."""
    may = sorted(name for name, ok in tools.items() if ok) if isinstance(tools, dict) else []
    out = {}
    for g in asked if share and may else ():
        rng = random.Random(f"{row_key(rows_by_group[g])}:{step}:probe")
        if rng.random() < share:
            called = {c.get("name") for e in groups[g] for text, _ in turns(e, decode) for c in parse(text)}
            shown = (rows_by_group[g].get("extra_info") or {}).get("tools")  # a row that names its tools shows those
            untried = [name for name in may if name not in called and (name in shown if shown else tools[name] is True)]
            if untried:
                out[g] = rng.choice(untried)
    return out


def given_turns(episode) -> list[int]:
    """The tokens before an episode's first sampled one: its given turns and their results (as_context, from_head;
    what turn_spans skips)."""
    spans = turn_spans(episode)
    return episode.response_ids[:spans[0][0] if spans else len(episode.response_ids)]


def from_head(episode, head: list[int], k: int = 1):
    """A branched episode (played after a head of k turns: Hinted, under the answer hint) as trained: its
    prompt_ids already the group's, the head (the group's own turns and results, as its episode sampled and
    saw them) put before its response as mask-0 tokens; info["branched"] = k. An episode with nothing
    sampled (an error at reset, where nothing was played) is left as it is."""
    if not episode.response_ids:
        return
    before(episode, head, k)
    episode.info["branched"] = k


def before(episode, ids: list[int], k: int):
    """ids (k given turns and their results) put before an episode's response as context: mask 0 and
    logprob 0, like tool results (no loss, KL or entropy), and counted in info["turns"]."""
    episode.response_ids = list(ids) + episode.response_ids
    episode.response_mask, episode.logprobs = [0] * len(ids) + episode.response_mask, [0.0] * len(ids) + episode.logprobs
    episode.info["turns"] = episode.info.get("turns", 0) + k


def untrained_all_wrong(groups: dict, swap: dict, source: str):
    """Under the oracle-free sources, the groups with no pass that no guided pass joins or replaces (swap:
    the solved guided groups) are not trained -> (the groups left, how many were left out). Their rewards
    differ only by their shaping (failed-call charges), which favours the episodes that call no tool: with
    them trained, tool calls an episode fell 1.08 -> 0.26 over steps 1-6 and the discovery family ended at
    0.05 calls an episode (source=answer, seed 0, docs/results.md). Under source=oracle they stay (the
    plans pass often enough that few are left, and the entries measured so were run that way)."""
    if source == "oracle":
        return groups, 0
    left = {g: eps for g, eps in groups.items() if g in swap or any(e.passed() for e in eps)}
    return left, len(groups) - len(left)


# ---- replay=K: the rows the rescue solved, asked again

REPLAY_MOST = 3  # times a row comes back
REPLAY_SHARE = 4  # at most 1/REPLAY_SHARE of a step's rows are replays (the rest fresh, in the data order)


def due(queue: list, step: int, rows: int) -> list[tuple[int, dict]]:
    """replay=K: the queued rows due by step, oldest first, at most rows // REPLAY_SHARE (at least 1), taken off
    queue -> [(times asked again so far, row)]. queue: [[due step, times, row]], kept in the trainer's state."""
    out = [q for q in queue if q[0] <= step][:max(1, rows // REPLAY_SHARE)]
    for q in out:
        queue.remove(q)
    return [(times, row) for _, times, row in out]


def requeue(queue: list, guided, row_of: dict, times_of: dict, step: int, k: int) -> int:
    """After guide(): each group a guided pass joined (guided: its episodes, info["hint_for"]) puts its row back on
    queue, due at step + k, unless it came back REPLAY_MOST times already (times_of: group id -> times, for the
    replayed groups of this step) -> how many rows were queued."""
    solved = {e.info["hint_for"] for e in guided if e.passed() and not e.info.get("not_trained")}
    n = 0
    for g in sorted(solved):
        times = times_of.get(g, 0)
        if times < REPLAY_MOST:
            queue.append([step + k, times + 1, row_of[g]])
            n += 1
    return n


# ---- guide=prefix: the given turns, played by a wrapper around the row's env

def hint_row(row: dict, texts: list[str]) -> dict:
    """row carrying the assistant texts its env plays first (guide=prefix; Hinted). The row itself is not changed."""
    return {**row, "hints": list(texts)}


def with_hints(make_env):
    """make_env(row) -> its env, wrapped in Hinted where the row carries hints (hint_row)."""
    return lambda row: Hinted(make_env(row), row["hints"]) if row.get("hints") else make_env(row)


class Hinted(Env):
    """env with given assistant turns played before the policy's first: reset steps env with each text
    (the env runs its calls for real) and returns the prompt, then every turn and its observations, as
    the conversation the policy continues. The played steps' rewards (failed-call charges) come with
    the first sampled step's; they count against env.max_turns; info["hint_turns"] is their number.
    A played turn that ends the episode (a server down) makes reset raise: the episode's error. The
    tools and the turn limit are the env's as its reset set them (a row's own tools, its user turns)."""

    def __init__(self, env, texts):
        self.env, self.texts, self.paid = env, list(texts), 0.0
        self.keep_special = getattr(env, "keep_special", ())

    tools = property(lambda self: self.env.tools)
    max_turns = property(lambda self: self.env.max_turns - len(self.texts))

    def reset(self, row):
        messages, self.paid = self.env.reset(row), 0.0
        if self.max_turns < 1:
            raise ValueError(f"{len(self.texts)} hint turns leave no turn of the env's {self.env.max_turns}")
        for text in self.texts:
            obs, reward, done, info = self.env.step(text)
            if done:
                raise RuntimeError(f"a hint turn ended the episode: {info.get('error') or 'done'}")
            messages += [{"role": "assistant", "content": text}, *obs]
            self.paid += reward
        return messages

    def step(self, text):
        obs, reward, done, info = self.env.step(text)
        reward, self.paid = reward + self.paid, 0.0
        return obs, reward, done, {**info, "hint_turns": len(self.texts)}

    def close(self):
        self.env.close()


def as_context(episode, prompt_ids, k, told=False):
    """A Hinted episode's played turns moved from its prompt to the head of its response, as mask-0 tokens
    (tool results' layout): its prompt_ids become the group's own, and its k played turns count in
    info["turns"]. Left in the prompt where the template's rendering does not start with prompt_ids. told: the
    episode's prompt holds the answer hint too, inside its question, so the played turns start where the
    rendering of the question ends (played_start); where that is not found, the episode is not trained."""
    ids = episode.prompt_ids
    start = played_start(ids, prompt_ids) if told else len(prompt_ids)
    if told and start is None:
        episode.info["not_trained"] = True
        return
    given = ids[start:]
    if not told and ids[:len(prompt_ids)] != list(prompt_ids) or not given:  # not played (an error at reset)
        return
    episode.prompt_ids = list(prompt_ids)
    before(episode, given, k)
    episode.info.setdefault("hint_turns", k)


def played_start(ids: list[int], prompt_ids: list[int]) -> int | None:
    """Where the played turns start in ids, a told probe's prompt (the question with the answer hint after it, then
    the played turns), given prompt_ids, the question's prompt alone: after the first place past their common
    prefix where the longest tail of prompt_ids (at least 3 tokens, or all that is left: the end of the user's turn
    and the assistant's header) recurs. None where none does."""
    common = next((i for i, (a, b) in enumerate(zip(ids, prompt_ids)) if a != b), min(len(ids), len(prompt_ids)))
    rest = len(prompt_ids) - common
    if rest == 0:  # the question's prompt whole, then the turns
        return common
    for n in range(rest, min(3, rest) - 1, -1):
        tail = list(prompt_ids[len(prompt_ids) - n:])
        for j in range(common, len(ids) - n + 1):
            if ids[j:j + n] == tail:
                return j + n
    return None


def beside(shown, episodes):
    """shown (the step's unguided episodes) with each guided group of episodes put right after the
    group it replays (info["hint_for"]): what the viewer and samples.jsonl get."""
    guided = {}
    for e in episodes:
        if "hint_for" in e.info:
            guided.setdefault(e.info["hint_for"], []).append(e)
    out = []
    for i, e in enumerate(shown):
        out.append(e)
        if i + 1 == len(shown) or shown[i + 1].group != e.group:  # the group's last episode
            out += guided.pop(e.group, [])
    return out
