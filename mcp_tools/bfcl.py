r"""
BFCL multi-turn (Berkeley Function Calling Leaderboard v4; package bfcl-eval 2026.3.23) in nanoRL's
terms: its tasks as rows, its tool classes as an MCP server, its pass/fail rule as verdict().

Data: BFCL_v4_multi_turn_{base, miss_func, miss_param, long_context}.json, 200 tasks each, and
possible_answer/ files. A task names 1-2 tool classes (CLASSES), their start state (initial_config)
and 1-8 user turns; its answer is a list of call strings per turn ("cd(folder='document')"), empty
where nothing should be done. miss_func holds functions out ("missed_function": {"3": ["sort"]})
until that turn, whose user message is empty: BFCL then shows them and says
ADDITIONAL_FUNCTION_PROMPT (our rows too). "excluded_function" is read by nothing in the package.
Rows (bfcl_rows): prompt = SYSTEM_PROMPT + turn 0; extra_info.user_turns = the later turns,
extra_info.tools = the functions shown from turn 0; ground_truth = extra_info.bfcl_answer.

Verdict (BFCL's multi_turn_checker, replayed): the model's calls run in order on one instance set
M, the answer's on another, T, both fresh from initial_config. After each turn t:
    pass_t = answer_t == []                                       (nothing is checked)
          or (calls_t != [] and state(M) == state(T)              (public attributes, ==)
              and results(answer_t) within results(calls_0..t))   (a multiset, any order)
    pass   = every pass_t, and the episode played every turn     (BFCL: "force_terminated")
A result is the text BFCL shows the model (execute). Replaying, as BFCL's checker does, needs no
server and gives the live state: same classes, same seeds. Calls: {"name", "arguments"} (what an
episode parses) or call strings with literal arguments (BFCL eval()s any Python there).
Episodes (BFCLEnv, env_class "bfcl"): mcp_tools/env.MCPEnv's conversations against this server,
with the row's tools only (row_tools), its task loaded into the session as the episode opens, a
turn's calls run in the model's order (sequential_calls), and reward = 1.0 if verdict passes, else
turn_credit x turns_passed / user turns (info: correct, turns_passed = the user turns before the first
failing one, why). turn_credit is a row's reward_spec.turn_credit, 0 when absent (BFCL's tests), in
[0, 0.5) so any pass beats any failure: a training row's partial credit, a signal for groups where
no conversation passes every turn (pass@1 counts correct only). Only a conversation that plays every
turn gets it: one cut by the turn limit below scores 0, so a loop earns nothing. A reply without a
tool call ends a user turn; MAX_STEPS replies in one turn end the episode, failed (BFCL: "force
terminated"). A call the parser cannot read is an error message the model reads and a failed call
in info, not a call of the verdict (BFCL's handler ends the user turn there instead); a call of a tool
not shown is refused, unrun, the same way. Held-out functions (miss_func) are shown from their turn
on as new_tools, their schemas in that turn's user message (MCPEnv, Conversations).

Training rows (mcp_tools/bfcl_synth.py, data_source bfcl/synth): never BFCL's tasks; conversations
over the same classes, one or two a conversation, from other start states and goals, checked by the
same verdict.

Played turns (a training row's extra_info.played_turns = k, bfcl_synth --played): the episode starts at
user turn k, its first k turns played at reset with the answer's calls, a turn's calls in one reply in the
model's own tool-call format, run for real, each turn closed by PLAYED_REPLY. They are the prompt: context,
never sampled, no loss. Every token that trains is the policy's own, sampled given that context, so the
ratio is exact (on-policy). What differs from a whole conversation is only where it starts: in a state
the answer reached, as RL from states along a demonstration starts (Salimans & Chen, arXiv 1812.03381),
so that a late turn is practised without first passing every turn before it. The verdict is unchanged
(the played calls are the turns' calls; they pass by construction), and turn credit counts them, equal
for the whole group. Counters and charges (tool_calls, repeats, failed calls) are the policy's only.

Serving (python -m mcp_tools.bfcl serve, stdio): the 128 functions of the eight classes with
BFCL's docs as schemas, and reset(session, config, drop) marked as the session hook
(mcp_tools/server.py's): MCPPool calls reset(session) as an episode opens, the episode then
reset(session, config={"involved_classes", "initial_config", "long_context"}) (pool.call_real).
128 tools (~94K characters) exceed MCPPool's caps: a config allow-lists a row's (server_config()
+ "tools"). mcp's low-level Server, not MCPServer: MCPServer takes schemas from Python signatures
and coerces arguments with pydantic ("5" -> 5), unlike BFCL's eval(); the low-level one lists our
schemas and passes raw arguments. Its handlers run on the event loop, one at a time.

Install beside requirements.txt (bfcl-eval pins numpy 1.26.4 and ~30 API clients unused here):
pip install --no-deps bfcl-eval==2026.3.23 --target /tmp/bfcl-site; PYTHONPATH=/tmp/bfcl-site.
The eight classes and the checker need only the standard library and mpmath (torch brings it).
Rows: python -m mcp_tools.bfcl rows --category base --out data/out/bfcl/base.jsonl   (all: the four)
Config (eval.py --mcp-config): python -m mcp_tools.bfcl config --out data/out/bfcl/mcp.json
Training rows: python -m mcp_tools.bfcl_synth --n 2000 --seed 0 --out data/out/bfcl/train.jsonl
Test: PYTHONPATH=/tmp/bfcl-site python -m pytest -q tests/test_bfcl.py
"""
import argparse
import ast
import copy
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

from mcp_tools.env import MCPEnv  # brings torch (rollout.Env): ~1-2 s more per server start
from mcp_tools.rewards import episode_reward
from mcp_tools.formats import FORMATS

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
# class -> (module under bfcl_eval.eval_checker.multi_turn_eval.func_source_code, its doc file);
# bfcl_eval.constants.executable_backend_config's two mappings, for the multi-turn classes
CLASSES = {"GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
           "MathAPI": ("math_api", "math_api.json"),
           "MessageAPI": ("message_api", "message_api.json"),
           "TwitterAPI": ("posting_api", "posting_api.json"),
           "TicketAPI": ("ticket_api", "ticket_api.json"),
           "TradingBot": ("trading_bot", "trading_bot.json"),
           "TravelAPI": ("travel_booking", "travel_booking.json"),
           "VehicleControlAPI": ("vehicle_control", "vehicle_control.json")}
STATELESS = ("MathAPI",)  # BFCL's STATELESS_CLASSES: no _load_scenario
REFUSED = ("kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run")  # BFCL refuses these names
MAX_STEPS = 20  # BFCL's MAXIMUM_STEP_LIMIT: more model turns than this in one user turn fails the task
PLAYED_REPLY = "Done."  # a played turn's closing reply (no call: the next user turn comes)
# BFCL's DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC (2026.3.23), the user turn of a miss_func turn
ADDITIONAL_FUNCTION_PROMPT = "I have updated some more functions you can choose from. What about now?"
SYSTEM_PROMPT = (
    "You are a helpful assistant with tools. To use a tool, write a tool call in the format described "
    "below; its result comes back in the next message. Carry out the user's request with the tools, one "
    "call after another, until it is done. If no tool fits, or a value the request needs is missing, say "
    "so instead of guessing. When you are done with a request, reply without any tool call: the user's "
    "next request, if any, follows."
)


# ----------------------------------------------------------------------------------------------
# the package's data: tasks, answers, function docs

def _package():
    try:
        import bfcl_eval
    except ImportError:
        raise ImportError("BFCL needs the bfcl-eval package: pip install --no-deps bfcl-eval==2026.3.23 "
                          "--target /tmp/bfcl-site, then PYTHONPATH=/tmp/bfcl-site (module doc)") from None
    return bfcl_eval


def data_dir() -> Path:
    """The package's data folder (importlib.resources finds it wherever it is installed)."""
    from importlib.resources import files
    _package()
    return Path(str(files("bfcl_eval") / "data"))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_bfcl(category: str) -> list[dict]:
    """The category's tasks as BFCL ships them, each with its answer under "ground_truth"."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL multi-turn category {category!r}; known: {', '.join(CATEGORIES)}")
    name = f"BFCL_v4_multi_turn_{category}.json"
    tasks = _jsonl(data_dir() / name)
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(data_dir() / "possible_answer" / name)}
    for t in tasks:
        if len(answers[t["id"]]) != len(t["question"]):
            raise ValueError(f"{name}: {t['id']} has {len(t['question'])} turns and {len(answers[t['id']])} answers")
        t["ground_truth"] = answers[t["id"]]
    return tasks


_DOCS = {}


def function_docs(cls: str) -> list[dict]:
    """BFCL's docs of one class's functions (multi_turn_func_doc/*.json): name, description,
    parameters (BFCL's types: "dict", "float", ...), response."""
    if cls not in _DOCS:
        _DOCS[cls] = _jsonl(data_dir() / "multi_turn_func_doc" / CLASSES[cls][1])
    return _DOCS[cls]


_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}  # BFCL's GORILLA_TO_OPENAPI


def json_schema(p: dict) -> dict:
    """A BFCL parameter schema as JSON schema: "dict" -> "object", "float" -> "number", ... at any depth."""
    out = {}
    for k, v in p.items():
        if k == "type" and isinstance(v, str):
            out[k] = _TYPES.get(v, v)
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: json_schema(s) for name, s in v.items()}
        elif k == "items" and isinstance(v, dict):
            out[k] = json_schema(v)
        else:
            out[k] = v
    return out


# ----------------------------------------------------------------------------------------------
# rows

def to_row(task: dict, class_tools: dict[str, list[str]]) -> dict:
    """One nanoRL row of one BFCL task (load_bfcl's); class_tools: class -> its function names."""
    category = task["id"].rsplit("_", 1)[0].removeprefix("multi_turn_")
    missed = task.get("missed_function", {})
    held = {name for names in missed.values() for name in names}
    turns = [list(msgs) or [{"role": "user", "content": ADDITIONAL_FUNCTION_PROMPT}] for msgs in task["question"]]
    if not task["question"][0]:
        raise ValueError(f"{task['id']}: its first turn has no user message")
    extra = {"bfcl_id": task["id"], "category": category, "involved_classes": list(task["involved_classes"]),
             "initial_config": task["initial_config"], "user_turns": turns[1:],
             "bfcl_answer": task["ground_truth"],
             # the functions the model sees from the first turn; missed_function adds the rest
             "tools": [n for c in task["involved_classes"] for n in class_tools[c] if n not in held]}
    if missed:
        extra["missed_function"] = missed  # {"turn index": [names]}, as BFCL writes it
        extra["new_tools"] = missed        # what MCPEnv reads: shown from that turn on
    return {"data_source": f"bfcl/{category}",
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}] + turns[0],
            "env_class": "bfcl",
            "reward_spec": {"method": "rule", "ground_truth": task["ground_truth"]},
            "extra_info": extra}


def bfcl_rows(category: str) -> list[dict]:
    tools = {c: [d["name"] for d in function_docs(c)] for c in CLASSES}
    return [to_row(t, tools) for t in load_bfcl(category)]


# ----------------------------------------------------------------------------------------------
# executing calls as BFCL's multi_turn_utils.execute_multi_turn_func_call does

def new_instances(classes: list[str], initial_config: dict, long_context: bool = False) -> dict:
    """Fresh instances of the classes, each loaded with (a deep copy of) its start state."""
    _package()
    out = {}
    for cls in classes:
        module = importlib.import_module(f"bfcl_eval.eval_checker.multi_turn_eval.func_source_code.{CLASSES[cls][0]}")
        out[cls] = getattr(module, cls)()
        if cls not in STATELESS:
            out[cls]._load_scenario(copy.deepcopy(initial_config.get(cls, {})), long_context=long_context)
    return out


def _methods(instances: dict) -> dict:
    """Function name -> the instance that has it (a later class wins a clash, as in BFCL; the eight
    classes have none)."""
    return {name: inst for inst in instances.values()
            for name, _ in inspect.getmembers(inst, predicate=inspect.ismethod) if not name.startswith("_")}


def parse_call(text: str) -> tuple[str, list, dict]:
    """"mv(source='a', destination='b')" -> ("mv", [], {"source": "a", ...}); literal arguments only."""
    node = ast.parse(text.strip(), mode="eval").body
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise ValueError(f"not a function call: {text[:80]!r}")
    return (node.func.id, [ast.literal_eval(a) for a in node.args],
            {k.arg: ast.literal_eval(k.value) for k in node.keywords})


def execute(methods: dict, call) -> str:
    """Run one call ({"name", "arguments"} or a call string); the result as BFCL shows it: a str as
    is, a dict as json.dumps (str() if that fails), anything else str(); an exception as
    "Error during execution: <message>" (an unknown name: NameError's message, as eval() says it).

    Every call gets fresh argument objects, as BFCL's eval() of a string makes them: the classes
    keep what they are given (post_tweet stores `mentions`, mention() extends it later). Our one
    deviation: an omitted list or dict default is a fresh copy too. BFCL shares the one object
    Python keeps (post_tweet's tags=[], mentions=[]) across every instance of the process, so a
    mention() on one such tweet shows in every other one, the model's included, and what a served
    call returns would depend on the episodes before it."""
    try:
        if isinstance(call, dict):
            name, args, kwargs = call["name"], [], copy.deepcopy(dict(call.get("arguments") or {}))
        else:
            name, args, kwargs = parse_call(call)
        if name in REFUSED:
            raise Exception(f"Function call {name} is not allowed.")
        if name not in methods:
            raise NameError(f"name '{name}' is not defined")
        fn = getattr(methods[name], name)
        for i, p in enumerate(inspect.signature(fn).parameters.values()):
            if i >= len(args) and p.name not in kwargs and isinstance(p.default, (list, dict, set)):
                kwargs[p.name] = copy.deepcopy(p.default)
        out = fn(*args, **kwargs)
    except Exception as e:  # BFCL catches every exception of a call the same way
        return f"Error during execution: {e}"
    if type(out) is str:
        return out
    if type(out) is dict:
        try:
            return json.dumps(out)
        except (TypeError, ValueError, RecursionError):  # BFCL: a bare except
            return str(out)
    return str(out)


def state_differences(model: dict, truth: dict) -> list[str]:
    """The public attributes (no leading "_") where model's instances differ from truth's, as
    "Class.attr"; BFCL's state_checker compares exactly these with !=."""
    missing = object()
    return [f"{cls}.{attr}" for cls, t in truth.items() for attr in vars(t)
            if not attr.startswith("_") and getattr(model[cls], attr, missing) != getattr(t, attr)]


# ----------------------------------------------------------------------------------------------
# the verdict

def check_answer(gt) -> str | None:
    """Why gt cannot be a bfcl row's ground truth (a list of turns, each a list of call strings); None if it can."""
    if not (isinstance(gt, list) and gt and all(isinstance(t, list) and all(isinstance(c, str) for c in t) for t in gt)):
        return f"want a list of turns, each a list of call strings, got {repr(gt)[:60]}"
    return None


def check_turn_credit(w) -> str | None:
    """Why w cannot be a row's reward_spec.turn_credit (a number in [0, 0.5), module doc); None if it can."""
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < 0.5:  # nan fails too
        return f"reward_spec.turn_credit (bfcl): want a number in [0, 0.5) so any pass beats any failure, got {w!r}"
    return None


def row_error(row: dict) -> str | None:
    """Why a bfcl row's training fields cannot be used (reward_spec.turn_credit, extra_info.played_turns;
    its ground truth is check_answer's); None if they can. Read as rows load (envs.check_row) and at reset."""
    return check_turn_credit(row["reward_spec"].get("turn_credit", 0.0)) or played_error(row)


def _keywords(call: str) -> tuple[str, dict]:
    """A call string with keyword arguments only (played_error checks it) -> (name, arguments)."""
    name, _, kwargs = parse_call(call)
    return name, kwargs


def played_error(row: dict) -> str | None:
    """Why the row's extra_info.played_turns cannot be played (module doc, Played turns); None if it can."""
    k, answer = (row.get("extra_info") or {}).get("played_turns", 0), row["reward_spec"]["ground_truth"]
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(answer):
        return f"extra_info.played_turns (bfcl): want an integer from 0 to {len(answer) - 1} (a turn left to the policy), got {k!r}"
    for call in (c for turn in answer[:k] for c in turn):
        try:
            if parse_call(call)[1]:
                raise ValueError("positional arguments")
        except (ValueError, SyntaxError) as e:
            return f"extra_info.played_turns (bfcl): a played call must have keyword arguments only: {call[:80]!r} ({e})"
    return None


def verdict(row: dict, turns: list[list], played: bool = False) -> dict:
    """BFCL's pass/fail of one episode (module doc): turns = the model's calls, one list per user
    turn played. -> {"pass": bool, "turn": the first failing turn or None, "why": str}.
    played: judge only the turns played so far (an episode still going: turns_passed)."""
    info, answer = row["extra_info"], row["reward_spec"]["ground_truth"]
    if played:
        answer = answer[:len(turns)]
    if len(turns) != len(answer):
        return {"pass": False, "turn": len(turns), "why": f"the episode played {len(turns)} of {len(answer)} turns"}
    long = info["category"] == "long_context"
    model = new_instances(info["involved_classes"], info["initial_config"], long)
    truth = new_instances(info["involved_classes"], info["initial_config"], long)
    m_methods, t_methods = _methods(model), _methods(truth)
    seen = []  # the model's results, every turn so far: a result from an earlier turn counts
    for t, (calls, want_calls) in enumerate(zip(turns, answer)):
        seen += [execute(m_methods, c) for c in calls]
        want = [execute(t_methods, c) for c in want_calls]
        if not want_calls:
            continue
        if not calls:
            return {"pass": False, "turn": t, "why": "no call in a turn whose answer has calls"}
        if diff := state_differences(model, truth):
            return {"pass": False, "turn": t, "why": f"state differs: {', '.join(diff)}"}
        rest, missing = list(seen), []
        for r in want:  # a multiset: each result of the model's counts once
            if r in rest:
                rest.remove(r)
            else:
                missing.append(r)
        if missing:
            return {"pass": False, "turn": t, "why": f"result not produced: {missing[0][:200]}"}
    return {"pass": True, "turn": None, "why": ""}


# ----------------------------------------------------------------------------------------------
# the env

class BFCLEnv(MCPEnv):
    """One BFCL task as an MCPEnv conversation against this module's server (module doc, Episodes)."""
    sequential_calls = True  # a call may act on the state the one before it left (cd, then touch)

    def __init__(self, pool=None, max_turns: int = MAX_STEPS, max_result_chars: int = 32_000, **kwargs):
        # results uncut, as BFCL shows them: long_context's run to 31,706 characters (MCPEnv cuts at 4,000)
        super().__init__(pool, max_turns=max_turns, max_result_chars=max_result_chars, **kwargs)
        self.row = None

    def _load_truth(self, row: dict) -> str | None:
        self.row = row
        if err := check_answer((row.get("reward_spec") or {}).get("ground_truth")):
            return f"invalid reward_spec.ground_truth (bfcl): {err}"
        if len(row["reward_spec"]["ground_truth"]) != 1 + len(self.user_turns):
            return "reward_spec.ground_truth (bfcl): want one answer per user turn"
        return row_error(row)

    def reset(self, row: dict) -> list[dict]:
        messages = super().reset(row)
        k = (row.get("extra_info") or {}).get("played_turns", 0)
        if self.failed is None and k:  # a row checked (played_error) and a session open: turns 0..k-1 first
            messages += self._play(row["reward_spec"]["ground_truth"][:k])
        return messages

    def _play(self, answers: list[list[str]]) -> list[dict]:
        """Play the first user turns with the answer's calls (module doc, Played turns), written as the model
        writes them (a turn's calls in one reply, run for real), then PLAYED_REPLY to end the turn -> the messages
        after the row's prompt, up to the next user turn. What the policy is counted and charged for starts
        after them: info's counters, repeats and charges are set back (turn_calls keep the played calls,
        for the verdict)."""
        info, out, render = dict(self.info), [], FORMATS[self.tool_format].render
        for calls in answers:  # a turn's calls in as few replies as the env runs (in order: sequential_calls)
            texts = ["\n".join(render(*_keywords(c)) for c in calls[i:i + self.max_calls_per_turn])
                     for i in range(0, len(calls), self.max_calls_per_turn)]
            for text in texts + [PLAYED_REPLY]:
                obs, _, done, step_info = self.step(text)
                if done:  # a server down: the policy's first step ends the episode with this error
                    self.failed = step_info.get("error") or "a played turn ended the episode"
                    return out
                out += [{"role": "assistant", "content": text}, *obs]
        self.info = {**info, "user_turns_done": self.info["user_turns_done"], "played_turns": len(answers)}
        self.calls, self.keys, self.last_result, self.refailed, self.charged = [], [], {}, 0, 0.0
        return out

    def _opened(self, row: dict) -> str | None:
        """Load the task into the episode's session: reset(session, config) on the server of its tools."""
        info = row["extra_info"]
        server = self.pool.route[self.tools[0]["function"]["name"]][0]
        config = {"involved_classes": info["involved_classes"], "initial_config": info["initial_config"],
                  "long_context": info.get("category") == "long_context"}
        text, is_error, _, _ = self.pool.call_real(self.sess, server, "reset", {"session": self.sess["key"], "config": config})
        return f"bfcl reset: {text}" if is_error else None

    def _next_user_turn(self) -> list[dict]:
        v = verdict(self.row, self.turn_calls, played=True)
        self.info["turns_passed"] = len(self.turn_calls) if v["pass"] else v["turn"]
        return super()._next_user_turn()

    def _final_reward(self, text: str) -> float:
        v = verdict(self.row, self.turn_calls)
        won, spec = v["pass"], self.row["reward_spec"]
        self.info.update(correct=won, turns_passed=len(self.turn_calls) if won else v["turn"], why=v["why"])
        base = 1.0 if won else spec.get("turn_credit", 0.0) * self.info["turns_passed"] / len(spec["ground_truth"])
        self._end()
        paid = self.charged
        self._charge()
        return episode_reward(base, won, self.charged) + paid


# ----------------------------------------------------------------------------------------------
# the MCP server

SESSION_HOOK_META = "nanorl/session_reset"  # mcp_tools/server.py's marker (config.session_hook reads it)
_MAX_SESSIONS = 4096  # an episode that never drops its session must not grow memory forever
_sessions: dict[str, dict] = {}  # session key -> {"instances", "methods"}; empty until reset has a config


def reset_session(session: str, config: dict | None = None, drop: bool = False) -> str:
    _sessions.pop(session, None)
    if drop:
        return "ok"
    if len(_sessions) >= _MAX_SESSIONS:
        _sessions.pop(next(iter(_sessions)))  # oldest first
    _sessions[session] = {}
    if config:
        unknown = [c for c in config.get("involved_classes", []) if c not in CLASSES]
        if unknown:
            raise ValueError(f"unknown BFCL classes {unknown}; known: {', '.join(CLASSES)}")
        inst = new_instances(config["involved_classes"], config.get("initial_config", {}),
                             bool(config.get("long_context")))
        _sessions[session] = {"instances": inst, "methods": _methods(inst)}
    return "ok"


def server_tools() -> list[dict]:
    """Every tool the server lists: name, description, input_schema (BFCL's, with `session`), meta."""
    session = {"session": {"type": "string", "description": "the episode's key (the client fills it in)"}}
    tools = []
    for cls in CLASSES:
        for d in function_docs(cls):
            schema = json_schema(d["parameters"])
            schema = {**schema, "type": "object", "properties": {**schema.get("properties", {}), **session}}
            tools.append({"name": d["name"], "description": d["description"], "input_schema": schema, "meta": None})
    tools.append({"name": "reset", "input_schema": {
        "type": "object", "required": ["session"],
        "properties": {"session": {"type": "string"}, "drop": {"type": "boolean", "default": False},
                       "config": {"type": "object", "description": "involved_classes, initial_config, long_context"}}},
        "description": "Load a BFCL task's start state into a session (config), or drop it. Called by the "
                       "client, hidden from the model.", "meta": {SESSION_HOOK_META: True}})
    return tools


def call_tool(name: str, arguments: dict) -> tuple[str, bool]:
    """One tool call -> (text, is_error). BFCL's exception results are errors; a class's own error
    answers ({"error": ...}) are ordinary results, as BFCL shows them."""
    arguments = dict(arguments or {})
    session = arguments.pop("session", "")
    if name == "reset":
        try:
            return reset_session(session, arguments.get("config"), bool(arguments.get("drop"))), False
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # a bad config: said, not a crash
            return f"reset failed: {e}", True
    if not _sessions.get(session):
        return "Error: no BFCL task is loaded in this session; the client calls reset(session, config) first", True
    text = execute(_sessions[session]["methods"], {"name": name, "arguments": arguments})
    return text, text.startswith("Error during execution: ")


def build_server():
    """The low-level MCP server (module doc: why not MCPServer) over server_tools and call_tool."""
    import mcp_types as types
    from mcp.server.lowlevel import Server

    tools = [types.Tool(**t) for t in server_tools()]

    async def list_tools(ctx, params):
        return types.ListToolsResult(tools=tools)

    async def call(ctx, params):
        text, is_error = call_tool(params.name, params.arguments or {})
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=is_error)

    return Server("nanorl-bfcl", on_list_tools=list_tools, on_call_tool=call)


def serve() -> None:
    import anyio
    from mcp.server.stdio import stdio_server

    async def main():
        server = build_server()
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)


def server_config(bundled: bool = False) -> dict:
    """An mcpServers config that runs this server with this Python (PYTHONPATH: this repo, wherever
    bfcl_eval was found, and ours, since the SDK starts servers without our environment). bundled: the
    bundled server beside it (mcp_tools/config.bundled_config), for a run that trains conversations and
    the bundled tasks together: a BFCL row shows its own tools (row_tools), a bundled row (no
    extra_info.tools) every tool but BFCL's (env.row_tools)."""
    repo = str(Path(__file__).resolve().parent.parent)
    site = str(Path(_package().__file__).resolve().parent.parent)
    path = ":".join([repo, site] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p])  # mcp may live there too
    servers = {"bfcl": {"command": sys.executable, "args": ["-m", "mcp_tools.bfcl", "serve"],
                        "cwd": repo, "env": {"PYTHONPATH": path}, "row_tools": True}}
    if bundled:
        from mcp_tools.config import bundled_config
        servers.update(bundled_config()["mcpServers"])
    return {"mcpServers": servers}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="serve the eight classes over stdio (module doc)")
    rows_cmd = sub.add_parser("rows", help="write one category's rows")
    rows_cmd.add_argument("--category", choices=CATEGORIES + ("all",), required=True,
                          help="which BFCL multi-turn file (all: the four, 800 rows)")
    rows_cmd.add_argument("--out", required=True, help="a .jsonl or .parquet file")
    config_cmd = sub.add_parser("config", help="write the mcpServers file that runs this server (eval.py --mcp-config)")
    config_cmd.add_argument("--out", required=True, help="a .json file")
    config_cmd.add_argument("--bundled", action="store_true", help="the bundled server beside it (training both)")
    a = ap.parse_args()
    if a.cmd == "serve":
        serve()
    elif a.cmd == "config":
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(server_config(a.bundled), indent=1))
        print(f"wrote {a.out}")
    else:
        from support.rows import save_rows
        rows = [r for c in (CATEGORIES if a.category == "all" else [a.category]) for r in bfcl_rows(c)]
        save_rows(rows, a.out)
        print(f"{len(rows)} rows -> {a.out}")
