r"""
MCP tool use as an RL environment: MCPEnv (one episode) and its state checks. The pure answer and
reward functions it scores with (tagged_answer, answer_matches, check_ground_truth, matches_expected,
shown_by, invented, repeat_counts, failed_charge, episode_reward, oracle_credit) are in mcp_tools/rewards.py;
the tool-call parsers, one per model family, and the tool-aware chat template in mcp_tools/formats.py; the
server connections every episode calls through (MCPPool: config, sessions, restarts, cleanup) in pool.py.

An episode (what MCPEnv.step sees, turn by turn):

    prompt (system + user, tools shown by the chat template)
    model: "... <tool_call>{"name": "calculate", "arguments": {"expression": "2*21"}}</tool_call>"
    env:   [{"role": "tool", "content": "42"}]              -> rollout appends these with mask 0
    model: "... <answer>42</answer>"                        -> no tool call = final answer, done

    reward = base + credit - charge                                           (episode_reward)
    charge = min(error_penalty x failed, error_cap) + error_penalty x (refailed + stale)  (_charge)
             for a correct answer at most 0.5 in all
    base   = 1.0            if the answer matches the ground truth AND every state check passes
           = format_reward  else, if the final turn has an <answer>...</answer> tag (default 0)
           = 0.0            otherwise (a wrong answer, or an episode cut by the turn or length limit)
    credit = partial_credit x oracle_credit(calls, oracle_calls)  for a wrong answer with a tag, else 0
failed = tool_errors + parse_errors + doubled_braces (hermes only) + error_answer (a wrong tagged answer that
speaks of an error: stopping at a tool's error then ranks no higher than trying again) + unfounded_answer (any
other wrong tagged answer that no user turn or tool result of the episode showed, shown_by: a guess, such as a
"0" after a failed query or an empty listing, or after a schema with no count in it); refailed = identical
repeats of a failed call of the episode that fail again (repeat_counts; a turn the parser could not read
counts as a failed call keyed by its text, so the same malformed turn sent again is such a repeat): outside
the cap, so each one lowers a wrong episode's reward; stale = identical repeats of a call that did not fail
and got the same result again (stale_repeats: the call learnt nothing new), charged as refailed ones are.
credit reads the row's extra_info.oracle_calls (mcp_tools/tasks.py). error_penalty
(--tool-error-penalty) and partial_credit default to 0, so a correct answer scores exactly 1.0; any
correct answer beats any wrong one (keep format_reward and partial_credit < 0.5, and their sum < 0.5
once error_penalty > 0). A right answer whose state check fails is wrong (info["correct"] False, as
eval.py counts it; info["answer_correct"] says the answer alone was right).
The failed-call count reads the MCP error flag (isError), so a server that answers errors as ordinary
text counts 0 failed calls, though a call repeated as it was that gets the same error text again is
stale and pays (a trained policy resent mcp-server-sqlite's "Database error: no such column" query as
it was, and asked for the same empty `git_log` page, until the turn limit: docs/results.md).

Answers (SYSTEM_PROMPT of mcp_tools/tasks.py): the content of the LAST <answer>...</answer>, matched
against reward_spec.ground_truth = {"answer", "type": "number" | "text", "check": [state checks]} by
mcp_tools/rewards.py's rules (one number within a tolerance, or equal text after normalising); a row that
fails check_ground_truth ends its own episode as an error, never the batch.
State checks (tasks that change server state, e.g. kb_set, cart_add): after the final answer the
env calls check["tool"] with check["arguments"] in the episode's session and matches the result
against check["expect"] (matches_expected).

Tool calls: MCPEnv(tool_format=) picks the parser (formats.FORMATS; default "hermes", Qwen2.5's
<tool_call>{"name": ..., "arguments": {...}}</tool_call>; formats.detect reads it off a chat template;
info["tool_format"] names it; its special-token markers are MCPEnv.keep_special, which rollout keeps in
the text step() reads; where the format says call_ids (Mistral), every tool message carries a
tool_call_id, 9 alphanumerics counted per episode (_call_id), as Mistral's template demands). Any number
per turn, run concurrently, up to a tool result the model writes itself (formats.own_result_at: a call
after it would act on text no tool sent; the turn's note says so, a parse error). A turn shows at most
max_calls_per_turn parse errors, the rest in one line, each cut as a result is. Every problem (bad JSON,
NaN or Infinity in arguments, an unclosed tag, an unknown tool, bad arguments, a tool error, a timeout,
a call too long or deep) is a tool message the model reads, counted in info (tool_calls, tool_errors,
parse_errors, timeouts, tool_time_s, doubled_braces, repeat_calls, repeat_failed, stale_repeats,
credit), never an exception. invented_calls counts calls that pass a number or date no earlier text
showed (invented: a made-up id, amount or date), a diagnostic that pays nothing. A result over
max_result_chars (4000) is cut with a marker (cut_result). A server that dies or hangs costs one error
observation (pool.py); only one that stays down ends the episode (step returns ([], 0.0, True, info)
with info["error"]).

Conversations (several user turns; chat agents, BFCL): a row's extra_info.user_turns = the later
user turns, each a list of messages. A reply without a tool call ends a user turn; while turns
remain, step returns the next one (role "user": env tokens, mask 0 like tool results) with reward
0 (the failed-call charge aside) instead of ending, and the answer is read after the last one:

    prompt (system + user turn 0) | model ... tool ... model (no call) | user turn 1 | ... | last reply

max_turns caps the model's replies per user turn (the episode's cap, Env.max_turns, is that times the
number of user turns); a conversation whose turn runs out ends there, unanswered (info["cut"]). info:
user_turns (in the row), user_turns_done (ended by a reply without a call); turn_calls = the calls sent
to servers, by user turn (what bfcl.BFCLEnv judges). extra_info.tools: only these tools are shown and
callable (row_tools servers, mcp_tools/config.py); extra_info.new_tools = {"turn index": [names]}: tools
shown from that turn on, their schemas appended to its user message as the <tools> block's lines (a
prompt's tool block cannot change mid-episode: the sampled prefix is fixed).

Use (train.py): with MCPPool(args.mcp_config) as pool: formats.ensure_tool_template(tokenizer, pool.tools)
before any prompt is rendered, then run_episodes(..., lambda row: make_env("mcp", pool=pool, ...)). The
bundled server's tool block is long for a small model: set max_context to fit it.

Test: python -m pytest -q tests/test_mcp.py
"""
import hashlib
import json
import re

from mcp_tools.config import sane_seconds
from mcp_tools.formats import FORMATS, own_result_at, parse_tool_calls
from mcp_tools.pool import MCPPool, ServerFailed, default_pool
from mcp_tools.rewards import (answer_matches, call_key, check_ground_truth, episode_reward, failed_charge, invented,
                               matches_expected, normalise_ground_truth, oracle_credit, repeat_counts, shown_by,
                               tagged_answer)
from rollout import Env  # not from envs: envs imports this module (make_env("mcp"))


def _oracle_calls(row: dict) -> list[dict] | None:
    """The row's extra_info.oracle_calls when it is a list of {"name": str, "arguments": {...}}; else
    None (no credit: rows from elsewhere need not carry one)."""
    extra = row.get("extra_info")
    calls = extra.get("oracle_calls") if isinstance(extra, dict) else None
    ok = isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                         and isinstance(c.get("arguments"), dict) for c in calls)
    return calls if ok else None


_MARKER = re.compile(r"\n\[\.\.\. truncated: [^\n\]]*\]$")


def cut_result(text: str, limit: int) -> str:
    """text, or its first limit characters and a marker saying how long it was; a marker the
    transport already put at its end (a message over 1 MiB, transport.py) is kept instead."""
    if len(text) <= limit:
        return text
    m = _MARKER.search(text)
    return text[:limit] + (m.group() if m else f"\n[... truncated: {len(text)} characters in all]")


def _call_id(n: int) -> str:
    """n in 9 base-36 digits ("00000000a" for 10): Mistral's templates want a tool_call_id of exactly
    9 alphanumerics on each tool result. Per episode, so the same calls render the same tokens. The
    model's own [CALL_ID] (v11+) is not echoed back: parse_mistral drops it (the fixture's strict
    template, like Mistral's v3 one, checks each id's form, not that it matches a call's)."""
    digits = ""
    for _ in range(9):
        n, r = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + digits
    return digits


def row_tools(pool: MCPPool, names: list[str] | None) -> tuple[list[dict], str | None]:
    """(the schemas a row's prompt shows, why they cannot be shown or None). names None: every tool
    but those of row_tools servers (which show a row's own only); else exactly those, within the caps."""
    from mcp_tools.pool import MAX_TOOL_CHARS, MAX_TOOLS
    servers = pool.config["mcpServers"]
    if names is None:
        names = [t["function"]["name"] for t in pool.tools if not servers[pool.route[t["function"]["name"]][0]].get("row_tools")]
    cache = vars(pool).setdefault("_row_tools", {})  # names -> one list per tool set: rollout caches by id(tools)
    key = tuple(names)
    if key not in cache:
        if unknown := [n for n in names if n not in pool.route]:
            return [], f"the row names unknown tool(s) {', '.join(map(repr, unknown[:8]))}"
        by_name = {t["function"]["name"]: t for t in pool.tools}
        tools = [by_name[n] for n in names]
        chars = sum(len(json.dumps(t, ensure_ascii=False)) for t in tools)
        if len(tools) > MAX_TOOLS or chars > MAX_TOOL_CHARS:
            return [], f"the row shows {len(tools)} tools, {chars:,} characters: over the pool's caps"
        cache[key] = tools
    return cache[key], None


class MCPEnv(Env):
    """One episode against the pool's MCP servers; reward from reward_spec.ground_truth."""
    sequential_calls = False  # True: a turn's calls run one after another, in order (bfcl.BFCLEnv)

    def __init__(self, pool: MCPPool | None = None, max_turns: int = 8, format_reward: float = 0.0,
                 call_timeout: float | None = None, max_calls_per_turn: int = 8, max_result_chars: int = 4000,
                 error_penalty: float = 0.0, error_cap: float = 2.0, tool_format: str = "hermes",
                 partial_credit: float = 0.0):
        if tool_format not in FORMATS:
            raise ValueError(f"MCPEnv tool_format {tool_format!r}: known formats are {', '.join(FORMATS)}")
        if call_timeout is not None and not sane_seconds(call_timeout):  # 0 or nan: every call "timed out after 0 s"
            raise ValueError(f"MCPEnv call_timeout {call_timeout!r}: want a positive number of seconds, at most a day")
        if not 0 <= partial_credit < 0.5:  # nan fails too
            raise ValueError(f"MCPEnv partial_credit {partial_credit!r}: want 0 <= w < 0.5, so any right "
                             "answer beats a wrong one")
        self.pool = pool if pool is not None else default_pool()
        self.tools = self.pool.tools  # reset: the row's (row_tools)
        self.names = set(self.pool.route)  # the tools this episode may call: those shown
        self.tool_format = tool_format
        self.keep_special = FORMATS[tool_format].specials  # rollout.decode_many keeps these in step's text
        self.turn_limit = max_turns  # model replies per user turn
        self.max_turns = max_turns  # per episode: turn_limit x the row's user turns (reset)
        self.format_reward = format_reward
        self.error_penalty = error_penalty
        self.error_cap = error_cap
        self.partial_credit = partial_credit
        self.call_timeout = call_timeout
        self.max_calls_per_turn = max_calls_per_turn
        self.max_result_chars = max_result_chars
        self.sess = None
        self.truth = None
        self.failed = None  # why this episode cannot run (a bad ground truth, a server down): its first step ends it
        self.charged = 0.0  # the failed-call charge paid so far this episode (_charge)
        self.results = 0    # tool messages so far this episode: the next one's tool_call_id (_call_id)
        self.calls = []     # this episode's calls, [(call, failed)], in the order they were made
        self.keys = []      # [(call_key, failed)] of those calls and of each unread one (_run_calls), in order
        self.refailed = 0   # of them, identical repeats of a failed call that failed again (repeat_counts)
        self.last_result = {}  # call_key -> a digest of the result its latest call got (stale repeats)
        self.oracle = None  # the row's oracle_calls (partial credit), None if it has none
        self.info = {}
        self.system = ""    # the prompt's system text: invented() reads it beside shown, shown_by does not
        self.shown = ""     # the user turns' and the results' text so far (shown_by, invented)
        self.user_turns = []  # the row's later user turns, not yet sent (module doc, Conversations)
        self.new_tools = {}   # user turn index -> names of tools shown from then on
        self.turn_calls = [[]]  # calls sent to servers, by user turn
        self.turn_steps = 0   # the model's replies in this user turn

    def reset(self, row: dict) -> list[dict]:
        """The row's prompt. Never raises for a bad ground truth or a server that is down: the
        episode's first step then ends it with info["error"] (module doc)."""
        self._end()
        self.info = {"tool_calls": 0, "tool_errors": 0, "parse_errors": 0, "timeouts": 0, "tool_time_s": 0.0,
                     "doubled_braces": 0, "repeat_calls": 0, "repeat_failed": 0, "stale_repeats": 0, "invented_calls": 0,
                     "credit": 0.0, "error_answer": 0, "tool_format": self.tool_format}  # + unfounded_answer once answered
        text = lambda system: "\n".join(str(m.get("content") or "") for m in row["prompt"]  # noqa: E731
                                        if (m.get("role") == "system") == system)
        self.system, self.shown = text(True), text(False)
        self.failed, self.truth, self.charged, self.results = None, None, 0.0, 0
        self.calls, self.keys, self.refailed, self.oracle = [], [], 0, _oracle_calls(row)
        self.last_result = {}
        extra = row.get("extra_info") or {}
        self.user_turns = [list(t) for t in extra.get("user_turns") or []]
        self.new_tools = {int(k): list(v) for k, v in (extra.get("new_tools") or {}).items()}
        self.turn_calls, self.turn_steps = [[]], 0
        self.max_turns = self.turn_limit * (1 + len(self.user_turns))
        self.info.update(user_turns=1 + len(self.user_turns), user_turns_done=0)
        self.tools, err = row_tools(self.pool, extra.get("tools"))
        self.names = {t["function"]["name"] for t in self.tools}
        self.failed = err or self._load_truth(row)
        if self.failed is None:
            try:
                self.sess = self.pool.open_session()
                self.failed = self._opened(row)
            except ServerFailed as e:
                self.failed = str(e)
        return [dict(m) for m in row["prompt"]]

    def _load_truth(self, row: dict) -> str | None:
        """Read the row's ground truth into self.truth; why it cannot be scored, or None."""
        gt = (row.get("reward_spec") or {}).get("ground_truth")
        if err := check_ground_truth(gt):
            return f"invalid reward_spec.ground_truth: {err}"
        self.truth = normalise_ground_truth(gt)
        if unknown := [ck["tool"] for ck in self.truth["check"] if ck["tool"] not in self.pool.route]:
            return (f"a state check names unknown tool(s) {', '.join(map(repr, unknown))}; "
                    f"the servers offer: {', '.join(self.pool.route)}")
        return None

    def _opened(self, row: dict) -> str | None:
        """Called once the episode's session is open (bfcl.BFCLEnv loads its task here); an error or None."""
        return None

    def _next_user_turn(self) -> list[dict]:
        """The next user turn's messages; tools it reveals (new_tools) are shown from now on, their
        schemas appended to its last message as the lines of a <tools> block."""
        msgs = [dict(m) for m in self.user_turns.pop(0)]
        self.turn_calls.append([])
        self.turn_steps = 0
        self.info["user_turns_done"] += 1
        if names := self.new_tools.get(self.info["user_turns_done"]):
            tools, err = row_tools(self.pool, [t["function"]["name"] for t in self.tools] + names)
            if err is None:  # unknown names: the turn goes on without them (said in its message)
                self.tools, self.names = tools, {t["function"]["name"] for t in tools}
            block = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools if t["function"]["name"] in names)
            msgs[-1]["content"] = (f"{msgs[-1].get('content') or ''}\n\nNew tools:\n<tools>\n{block}\n</tools>"
                                   if err is None else f"{msgs[-1].get('content') or ''}\n\n({err})")
        for m in msgs:
            self.shown += "\n" + str(m.get("content") or "")
        return msgs

    def step(self, text: str) -> tuple[list[dict], float, bool, dict]:
        if self.failed is not None:
            self.info["error"], self.failed = self.failed, None
            return [], 0.0, True, dict(self.info)
        if self.sess is None:
            raise RuntimeError("MCPEnv.step called before reset or after the episode ended")
        fmt = FORMATS[self.tool_format]
        cut = own_result_at(text, fmt.result_marker, self.tool_format, self.tools)
        head = text if cut < 0 else text[:cut]  # a result the model wrote itself: nothing after it runs
        calls, errors = fmt.parse(head, tools=self.tools)
        if (hidden := len(errors) - self.max_calls_per_turn) > 0:  # 20,000 broken calls made 20,000 observations
            errors = errors[:self.max_calls_per_turn] + [
                f"{hidden} more tool calls of this turn were not run (errors not shown)"]
        if cut >= 0 and (calls or errors or any(fmt.parse(text[cut:], tools=self.tools))):
            errors.append(f"this turn wrote a {fmt.result_marker} of its own; results come only from the tools, "
                          f"so nothing written after it was run")
        if self.tool_format == "hermes" and calls and "{{" in head:  # calls only the lenient parser reads
            self.info["doubled_braces"] += len(calls) - len(parse_tool_calls(head, strict=True)[0])
        self.turn_steps += 1
        try:
            if not calls and not errors:
                if self.user_turns:  # a user turn ends; the conversation goes on (module doc)
                    msgs = self._next_user_turn()
                    return msgs, self._charge(), False, dict(self.info)
                self.info["user_turns_done"] += 1
                return [], self._final_reward(text), True, dict(self.info)
            if self.info["user_turns"] > 1 and self.turn_steps >= self.turn_limit:  # a turn ran out: the rest never come
                self.info.update(cut="turn_limit", correct=False)
                self._end()
                return [], self._charge(), True, dict(self.info)
            obs = self._run_calls(calls, errors, text)
            return obs, self._charge(), False, dict(self.info)
        except ServerFailed as e:
            self.info["error"] = str(e)
            self._end()
            return [], 0.0, True, dict(self.info)

    def _run_calls(self, calls: list[dict], errors: list[str], text: str) -> list[dict]:
        self.info["parse_errors"] += len(errors)
        start = len(self.calls)  # this turn's calls are appended from here
        # an unread call's key is the turn's text, by its digest (a copy of it per error: 4.6 GB for a 240 KB
        # turn of 20,000): the same malformed turn again is an identical repeat
        turn = hashlib.blake2b(text.strip().encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
        self.keys += [(("<unread>", f"{i}:{turn}"), True) for i in range(len(errors))]
        obs = [{"role": "tool", "content": cut_result(f"Error: {e}", self.max_result_chars)} for e in errors]
        if len(calls) > self.max_calls_per_turn:
            obs.append({"role": "tool", "content": f"Error: at most {self.max_calls_per_turn} tool calls per "
                                                   f"turn; ignored the last {len(calls) - self.max_calls_per_turn}"})
            self.info["tool_errors"] += 1
            calls = calls[:self.max_calls_per_turn]
        # all calls of a turn are started first, so they run concurrently on the pool's loop (unless
        # sequential_calls: each is started once the one before it has answered, in the model's order)
        submit = lambda c: self.pool.submit(self.sess, c["name"], c["arguments"], self.call_timeout)  # noqa: E731
        futures = [None] * len(calls) if self.sequential_calls else \
            [submit(c) if c["name"] in self.names else None for c in calls]
        failed = None  # the first ServerFailed of the turn, raised once every call is counted
        seen = self.system + "\n" + self.shown  # before this turn's results
        self.info["invented_calls"] += sum(invented(c["arguments"], seen) for c in calls)
        keys = [call_key(c["name"], c["arguments"]) for c in calls]  # each call lands in self.calls once, in order
        for c, key, fut in zip(calls, keys, futures):
            if fut is None and self.sequential_calls and c["name"] in self.names:
                fut = submit(c)
            if fut is None:
                self.info["tool_errors"] += 1
                self.calls.append((c, True))
                content = f"Error: unknown tool {c['name'][:64]!r}; available tools: {', '.join(t['function']['name'] for t in self.tools)}"
            else:
                self.turn_calls[-1].append(c)
                self.info["tool_calls"] += 1  # a call that met a down server was made: it counts, as an error
                wait = self.pool.wait_for(self.pool.route[c["name"]][0], self.call_timeout)
                try:
                    content, is_error, timed_out, seconds = fut.result(wait)
                except ServerFailed as e:
                    self.info["tool_errors"] += 1
                    self.calls.append((c, True))
                    failed = failed or e
                    continue
                self.calls.append((c, bool(is_error or timed_out)))
                self.info["tool_time_s"] += seconds
                self.info["tool_errors"] += int(is_error)
                self.info["timeouts"] += int(timed_out)
            obs.append({"role": "tool", "content": cut_result(content, self.max_result_chars)})
            self.shown += "\n" + obs[-1]["content"]
            self._stale(key, obs[-1]["content"], self.calls[-1][1])
        self.keys += [(key, f) for key, (_, f) in zip(keys, self.calls[start:])]
        repeats, repeat_failed, self.refailed = repeat_counts(self.keys)
        self.info.update(repeat_calls=repeats, repeat_failed=repeat_failed)
        if failed is not None:
            raise failed
        if FORMATS[self.tool_format].call_ids:  # Mistral's template raises on a tool result without one
            for o in obs:
                o["tool_call_id"], self.results = _call_id(self.results), self.results + 1
        return obs

    def _stale(self, key: tuple, result: str, failed: bool) -> None:
        """Count the call of this call_key as a stale repeat (info["stale_repeats"]) when it did not fail
        and an identical call of this episode got the same result before: it learnt nothing new (a failed
        one is refailed's). State may change between two identical calls (a kb_set in between): the
        result decides."""
        seen = hashlib.blake2b(result.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        self.info["stale_repeats"] += not failed and self.last_result.get(key) == seen
        self.last_result[key] = seen

    def _final_reward(self, text: str) -> float:
        answer = tagged_answer(text)
        correct = answer_matches(answer, self.truth["answer"], self.truth["type"])
        state_ok = all(self._check(ck) for ck in self.truth["check"]) if correct else None
        # "correct" is the task's verdict (Episode.passed): the answer and every state check
        won = bool(correct and state_ok)
        gave_up = not correct and "error" in (answer or "").lower()  # charged give-ups and guesses (module doc)
        guessed = answer is not None and not correct and not gave_up and not shown_by(answer, self.shown)
        self.info.update(answer=answer, answer_correct=bool(correct), state_ok=state_ok, correct=won,
                         error_answer=int(gave_up), unfounded_answer=int(guessed))
        self._end()
        base = 1.0 if won else self.format_reward if answer is not None else 0.0  # (module doc)
        credit = 0.0
        if answer is not None and not won and self.oracle:  # a right answer needs no credit (module doc)
            credit = self.partial_credit * oracle_credit([c for c, _ in self.calls], self.oracle)
        self.info["credit"] = credit
        paid = self.charged  # what the earlier turns' rewards took
        self._charge()       # self.charged: the whole episode's charge
        return episode_reward(base + credit, won, self.charged) + paid  # the turns sum to episode_reward

    def _charge(self) -> float:
        """This turn's share of the failed-call charge (failed_charge of the episode so far, less what earlier
        turns paid). <= 0. Every episode pays, right or wrong (charged to correct answers only, a policy
        filled failing episodes with failed calls); error_cap is high enough (2.0: ten calls at 0.2) that late
        failed calls are not free, and a call repeated as it was that fails again, or gets the same result
        again, pays outside it; _final_reward gives a correct answer back all it paid over 0.5."""
        failed = (self.info["tool_errors"] + self.info["parse_errors"] + self.info["doubled_braces"] + self.info["error_answer"]
                  + self.info.get("unfounded_answer", 0))
        repeated = self.refailed + self.info["stale_repeats"]  # repeats that learnt nothing
        owed = failed_charge(failed, repeated, self.error_penalty, self.error_cap)
        turn, self.charged = self.charged - owed, owed
        return turn

    def _check(self, ck: dict) -> bool:
        """One read-only state check in this episode's session (see module doc; reset checked the tool)."""
        server, real, inject = self.pool.route[ck["tool"]]
        args = {**ck.get("arguments", {}), **({"session": self.sess["key"]} if inject else {})}
        text, is_error, _, _ = self.pool.call_real(self.sess, server, real, args)
        if is_error:
            return False
        try:
            got = json.loads(text)
        except (ValueError, RecursionError):
            got = text
        for key in ck.get("path", []):
            if isinstance(got, dict) and key in got:
                got = got[key]
            elif isinstance(got, list) and isinstance(key, int) and -len(got) <= key < len(got):
                got = got[key]
            else:
                return False
        return matches_expected(got, ck["expect"])

    def _end(self):
        if self.sess is not None:
            self.pool.close_session(self.sess)
            self.sess = None

    def close(self) -> None:
        self._end()
