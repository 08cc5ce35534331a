"""
Rescue for prompts the policy cannot solve yet (--rescue hint=S,credit=W; off by default). A group
of n episodes with no correct one shows no way to solve its prompt (equal rewards: all A_i = 0). With hint=S,
such a group (a row with extra_info.oracle_calls, the calls a perfect policy makes, one a turn) is
sampled again in the same step with its first k oracle calls played as given assistant turns
(rollout.py's hints: rendered in the model's tool-call format, executed by the env for real), and
the guided group replaces it in the step's batch. k decays over the first S steps (hint_calls):

    share = max(0, 1 - step / S)      k = min(K - 1, ceil(share x (K - 1)))      K = oracle calls

so the policy always makes the last call itself and learns the earlier ones as k falls: a reverse
curriculum, guidance only where unguided rollouts reach no reward (ActGuide-RL, arXiv 2605.12004),
with a prefix share that decays over training (QuestA, arXiv 2507.13266).

Why training on it is sound: the hint's tokens are context, not samples (mask 0: no loss, KL or
entropy, out of every denominator). Every token that trains was sampled by the policy given that
context, and its old logprobs come from the same context, so the PPO ratio is exact and the update
is an ordinary policy gradient for the hint-conditioned policy (the same weights). Advantages are
computed within the guided group only (its own group id); the all-wrong group it replaces had no
correct episode to learn from. Guided episodes carry info["hint_for"] (the group they replay) and are
logged beside it (beside: the viewer, samples); step metrics (reward_mean, ...) skip them
(support/logs.episode_metrics), so runs with and without rescue compare.

credit=W (partial credit for a wrong answer's calls that follow the oracle's) is scored by the env
(mcp_tools/env.MCPEnv partial_credit; MatchTIR, arXiv 2601.10712): this module only parses it.

Test: python -m pytest -q tests/test_train.py -k "rescue or hint or guide"
"""


def parse(spec: str) -> dict:
    """--rescue SPEC -> {"hint": steps or 0, "credit": w or 0.0}: "" (off), "hint=15", "credit=0.1",
    "hint=15,credit=0.1"; anything else is a ValueError naming --rescue and the bad part."""
    out, seen = {"hint": 0, "credit": 0.0}, set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        key, _, value = part.partition("=")
        try:
            if key in seen or not value:
                raise ValueError
            elif key == "hint" and value.isdigit():
                out["hint"] = int(value)
            elif key == "credit" and 0.0 <= float(value) < 1.0:  # below a correct answer's 1.0
                out["credit"] = float(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--rescue {spec!r}: bad part {part!r}; want hint=STEPS (an integer >= 0), "
                             "credit=W (0 <= W < 1), or both: hint=15,credit=0.1") from None
        seen.add(key)
    return out


def hint_calls(step: int, steps: int, n_oracle: int) -> int:
    """Oracle calls given at this step: ceil(share x (n_oracle - 1)), share = max(0, 1 - step / steps)
    (module doc), in integers so that a share of exactly 2/3 of 3 calls is 2, not 3."""
    if steps <= 0 or n_oracle <= 1 or step >= steps:
        return 0
    return min(n_oracle - 1, -(-(steps - step) * (n_oracle - 1) // steps))


def guide(episodes, rows_by_group, step, steps, render, sample):
    """The step's kept episodes (a group's are contiguous), each all-wrong group with oracle calls
    replaced in place by a guided one -> (episodes, metrics). render(name, arguments) -> the call as
    the model writes it; sample(rows, group_ids, hints) -> their episodes, n a row, in row order."""
    groups = {}  # group id -> its episodes, in order
    for e in episodes:
        groups.setdefault(e.group, []).append(e)
    todo = []  # (group id, hint texts)
    for g, eps in groups.items():
        calls = (rows_by_group[g].get("extra_info") or {}).get("oracle_calls") or []
        k = hint_calls(step, steps, len(calls))
        if k and not any(e.passed() for e in eps):
            todo.append((g, [render(c["name"], c["arguments"]) for c in calls[:k]]))
    if not todo:
        return episodes, {"rescue_groups": 0, "rescue_hint_turns": 0.0}
    first = max([*rows_by_group, *groups]) + 1  # ids no group of this step has
    ids = [first + j for j in range(len(todo))]
    guided, replays = {}, dict(zip(ids, (g for g, _ in todo)))
    for e in sample([rows_by_group[g] for g, _ in todo], ids, [hints for _, hints in todo]):
        e.info["hint_for"] = replays[e.group]
        guided.setdefault(e.group, []).append(e)
    swap = {g: guided[new] for (g, _), new in zip(todo, ids)}
    out = [e for g, eps in groups.items() for e in swap.get(g, eps)]
    solved = [any(e.passed() for e in swap[g]) for g, _ in todo]
    return out, {"rescue_groups": len(todo), "rescue_solved": sum(solved) / len(todo),
                 "rescue_hint_turns": sum(len(hints) for _, hints in todo) / len(todo)}


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
