"""
mcp_tools/bfcl.py: the row converter and BFCL's call semantics on small fixtures written here (no
bfcl-eval needed), then, where bfcl-eval is importable, our verdict against bfcl-eval's own
multi_turn_checker on every multi-turn task (800): the answers' own trajectories (all pass) and
three perturbations of each (a wrong argument, a missing call, an extra state-changing call: all
fail), task by task; and the MCP server over stdio, driven by mcp_tools/pool.MCPPool.

Test: PYTHONPATH=/tmp/bfcl-site python -m pytest -q tests/test_bfcl.py
      (bfcl-eval: pip install --no-deps bfcl-eval==2026.3.23 --target /tmp/bfcl-site)
"""
import copy
import importlib.util
import inspect
import itertools
import json
import os
import re
from pathlib import Path

import pytest

from mcp_tools import bfcl, bfcl_synth
from support.rows import validate_row

HAVE_BFCL = importlib.util.find_spec("bfcl_eval") is not None
if not HAVE_BFCL and os.environ.get("NANORL_REQUIRE_BFCL"):  # CI (.ci/run) installs it: fail, never skip
    raise ImportError("NANORL_REQUIRE_BFCL is set but bfcl_eval is not importable (PYTHONPATH?)")
needs_bfcl = pytest.mark.skipif(not HAVE_BFCL, reason="bfcl-eval is not importable: pip install --no-deps "
                                "bfcl-eval==2026.3.23 --target /tmp/bfcl-site; PYTHONPATH=/tmp/bfcl-site")

# a miss_func task as BFCL writes one (shortened): turn 1 is empty, and `sort` comes back there
TASK = {"id": "multi_turn_miss_func_7",
        "question": [[{"role": "user", "content": "Go to 'docs' and make a file 'a.txt'."}], [],
                     [{"role": "user", "content": "Sort 'a.txt'."}]],
        "initial_config": {"GorillaFileSystem": {"root": {"alex": {"type": "directory", "contents": {
            "docs": {"type": "directory", "contents": {}}}}}}},
        "path": ["GorillaFileSystem.cd", "GorillaFileSystem.touch", "GorillaFileSystem.sort"],
        "involved_classes": ["GorillaFileSystem", "MathAPI"],
        "missed_function": {"1": ["sort"]}, "excluded_function": ["cp"],
        "ground_truth": [["cd(folder='docs')", "touch(file_name='a.txt')"], ["sort(file_name='a.txt')"], []]}
CLASS_TOOLS = {"GorillaFileSystem": ["cd", "touch", "sort"], "MathAPI": ["add"]}


def test_row_of_a_task():
    row = bfcl.to_row(TASK, CLASS_TOOLS)
    validate_row(row, "the fixture's row")  # the project's row format
    assert row["data_source"] == "bfcl/miss_func" and row["env_class"] == "bfcl"
    assert row["prompt"] == [{"role": "system", "content": bfcl.SYSTEM_PROMPT}, TASK["question"][0][0]]
    info = row["extra_info"]
    assert info["bfcl_id"] == "multi_turn_miss_func_7" and info["category"] == "miss_func"
    assert info["user_turns"] == [[{"role": "user", "content": bfcl.ADDITIONAL_FUNCTION_PROMPT}],
                                  TASK["question"][2]]  # the empty turn says what BFCL says there
    assert info["tools"] == ["cd", "touch", "add"]  # sort is held out until turn 1
    assert info["missed_function"] == {"1": ["sort"]}
    assert info["bfcl_answer"] == row["reward_spec"]["ground_truth"] == TASK["ground_truth"]
    assert info["involved_classes"] == TASK["involved_classes"] and info["initial_config"] == TASK["initial_config"]
    base = bfcl.to_row({**TASK, "id": "multi_turn_base_7", "missed_function": {}}, CLASS_TOOLS)
    assert "missed_function" not in base["extra_info"] and "sort" in base["extra_info"]["tools"]
    json.dumps(row)  # rows are JSON


def test_json_schema_maps_bfcl_types_at_every_depth():
    p = {"type": "dict", "required": ["x"], "properties": {
        "x": {"type": "float", "description": "d"}, "t": {"type": "tuple", "items": {"type": "float"}},
        "o": {"type": "dict", "properties": {"k": {"type": "any"}}}, "s": {"type": "string", "default": "a"}}}
    assert bfcl.json_schema(p) == {"type": "object", "required": ["x"], "properties": {
        "x": {"type": "number", "description": "d"}, "t": {"type": "array", "items": {"type": "number"}},
        "o": {"type": "object", "properties": {"k": {"type": "string"}}}, "s": {"type": "string", "default": "a"}}}


class Toy:
    def __init__(self):
        self.n, self._seen = 0, []

    def bump(self, by: int = 1):
        self.n += by
        return {"n": self.n}

    def words(self, text):
        return text.split()

    def echo(self, text):
        return text

    def odd(self):
        return {"a": {1, 2}}  # json.dumps fails: BFCL falls back to str()

    def boom(self):
        raise KeyError("nope")


def test_execute_formats_results_as_bfcl_does():
    m = bfcl._methods({"Toy": Toy()})
    assert sorted(m) == ["boom", "bump", "echo", "odd", "words"]
    assert bfcl.execute(m, {"name": "bump", "arguments": {"by": 2}}) == '{"n": 2}'  # a dict: json.dumps
    assert bfcl.execute(m, "bump(3)") == '{"n": 5}'  # a call string, positional argument
    assert bfcl.execute(m, {"name": "words", "arguments": {"text": "a b"}}) == "['a', 'b']"  # str()
    assert bfcl.execute(m, "echo(text='x y')") == "x y"
    assert bfcl.execute(m, {"name": "odd", "arguments": {}}) == "{'a': {1, 2}}"
    assert bfcl.execute(m, {"name": "boom", "arguments": {}}) == "Error during execution: 'nope'"
    assert bfcl.execute(m, {"name": "bump", "arguments": {"b": 1}}) == (
        "Error during execution: Toy.bump() got an unexpected keyword argument 'b'")
    assert bfcl.execute(m, {"name": "ghost", "arguments": {}}) == "Error during execution: name 'ghost' is not defined"
    assert bfcl.execute(m, {"name": "exit", "arguments": {}}) == "Error during execution: Function call exit is not allowed."
    assert bfcl.execute(m, "bump(by=x)").startswith("Error during execution: ")  # not a literal: not run
    assert m["bump"].n == 5


def test_state_differences_compare_public_attributes_only():
    a, b = {"Toy": Toy()}, {"Toy": Toy()}
    b["Toy"]._seen.append(1)
    assert bfcl.state_differences(a, b) == []  # private attributes are not state
    b["Toy"].bump()
    assert bfcl.state_differences(a, b) == ["Toy.n"]


def test_an_episode_cut_short_fails_and_sessionless_calls_error():
    row = bfcl.to_row(TASK, CLASS_TOOLS)
    v = bfcl.verdict(row, [[{"name": "cd", "arguments": {"folder": "docs"}}]])
    assert v == {"pass": False, "turn": 1, "why": "the episode played 1 of 3 turns"}
    text, is_error = bfcl.call_tool("cd", {"folder": "docs", "session": "never-reset"})
    assert is_error and "reset(session, config)" in text


# ---- with bfcl-eval: our verdict against bfcl-eval's checker

def _theirs(task: dict, turns: list[list[str]]) -> bool:
    """bfcl-eval's multi_turn_checker on call strings, one step per call. It keeps instances in
    multi_turn_utils' globals under the model name: a fresh name each time, deleted after."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker as mtc, multi_turn_utils as mtu
    name = f"nanorl{next(_names)}"
    out = mtc.multi_turn_checker([[[c] for c in t] for t in turns], task["ground_truth"], task,
                                 task["id"].rsplit("_", 1)[0], name)
    for k in [k for k in vars(mtu) if k.startswith(name + "_")]:
        del vars(mtu)[k]
    return out["valid"]


_names = itertools.count()


def _as_dict(methods: dict, text: str) -> dict:
    """A call string as the {"name", "arguments"} an episode parses (positional arguments named)."""
    name, args, kwargs = bfcl.parse_call(text)
    bound = inspect.signature(getattr(methods[name], name)).bind(*args, **kwargs)
    return {"name": name, "arguments": dict(bound.arguments)}


def _as_text(call: dict) -> str:
    """bfcl-eval's convert_to_function_call (model_handler/utils.py), how it writes a model's call."""
    return f"{call['name']}({','.join(f'{k}={v!r}' for k, v in call['arguments'].items())})"


def _tasks():
    return [(t, r) for c in bfcl.CATEGORIES for t, r in zip(bfcl.load_bfcl(c), bfcl.bfcl_rows(c))]


@needs_bfcl
def test_package_constants_and_data():
    from bfcl_eval.constants import default_prompts as dp, executable_backend_config as cfg, type_mappings as tm
    assert bfcl.ADDITIONAL_FUNCTION_PROMPT == dp.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
    assert bfcl.MAX_STEPS == dp.MAXIMUM_STEP_LIMIT
    assert list(bfcl.STATELESS) == cfg.STATELESS_CLASSES
    for cls, (module, doc) in bfcl.CLASSES.items():
        assert cfg.CLASS_FILE_PATH_MAPPING[cls] == f"{cfg.BACKEND_PATH_PREFIX}.{module}"
        assert cfg.MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls] == doc
        assert sorted(bfcl._methods(bfcl.new_instances([cls], {}))) == sorted(d["name"] for d in bfcl.function_docs(cls))
    assert all(tm.GORILLA_TO_OPENAPI[k] == v for k, v in bfcl._TYPES.items())
    tasks = _tasks()
    assert len(tasks) == 800 and {r["data_source"] for _, r in tasks} == {f"bfcl/{c}" for c in bfcl.CATEGORIES}
    for t, r in tasks:
        validate_row(r, t["id"])
        assert 1 + len(r["extra_info"]["user_turns"]) == len(t["question"]) == len(r["reward_spec"]["ground_truth"])
    tools = bfcl.server_tools()
    assert len(tools) == 129 and tools[-1]["meta"] == {bfcl.SESSION_HOOK_META: True}  # 128 functions + reset
    assert all(json.dumps(t["input_schema"]).count('"dict"') == 0 for t in tools)


@needs_bfcl
def test_ground_truth_passes_in_both_checkers():
    n = 0
    for task, row in _tasks():
        answer = task["ground_truth"]
        methods = bfcl._methods(bfcl.new_instances(task["involved_classes"], task["initial_config"]))
        as_dicts = [[_as_dict(methods, c) for c in turn] for turn in answer]
        assert bfcl.verdict(row, answer)["pass"], task["id"]  # the call strings themselves
        assert bfcl.verdict(row, as_dicts)["pass"], task["id"]  # as an episode would record them
        assert _theirs(task, [[_as_text(c) for c in turn] for turn in as_dicts]), task["id"]
        n += 1
    assert n == 800


# an extra call for each class that changes its state where it can (the first that does is used)
EXTRA = {"GorillaFileSystem": ["touch(file_name='nanorl_extra.txt')", "mkdir(dir_name='nanorl_extra')"],
         "MessageAPI": ["add_contact(user_name='nanorl_extra')", "send_message(receiver_id='USR002', message='x')"],
         "TwitterAPI": ["post_tweet(content='nanorl extra')", "follow_user(username_to_follow='nanorl_extra')"],
         "TicketAPI": ["create_ticket(title='nanorl extra', description='x', priority=1)",
                       "ticket_login(username='nanorl_extra', password='x')"],
         "TradingBot": ["fund_account(amount=1.0)", "trading_logout()", "trading_login(username='x', password='y')"],
         "TravelAPI": ["authenticate_travel(client_id='c', client_secret='s', refresh_token='r', "
                       "grant_type='read_write', user_first_name='Nano', user_last_name='RL')"],
         "VehicleControlAPI": ["setHeadlights(mode='on')", "lockDoors(unlock=False, door=['driver'])",
                               "fillFuelTank(fuelAmount=1.0)"],
         "MathAPI": []}


def _replay(task, calls):
    """Fresh instances after calls (dicts); -> (methods, instances, results)."""
    inst = bfcl.new_instances(task["involved_classes"], task["initial_config"], "long_context" in task["id"])
    methods = bfcl._methods(inst)
    return methods, inst, [bfcl.execute(methods, c) for c in calls]


def _wrong(value):
    """A different value of the same kind, or None."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 10 + 7
    if isinstance(value, str):
        return value + "_x"
    if isinstance(value, list):
        return value[1:] if value else ["x"]
    return None


def _perturb(task, as_dicts, t, kind):
    """The turns with turn t perturbed, or None where this kind changes nothing here. The choice
    of an argument or an extra call that makes a difference uses this module's execute; the
    judgement is both checkers'."""
    before = [c for turn in as_dicts[:t] for c in turn]
    truth = before + as_dicts[t]
    _, t_inst, t_res = _replay(task, truth)
    turn = as_dicts[t]
    if kind == "missing call":
        new = turn[:-1]
        return as_dicts[:t] + [new] + as_dicts[t + 1:]
    if kind == "wrong argument":
        for i, call in enumerate(turn):
            for k, v in call["arguments"].items():
                w = _wrong(v)
                if w is None:
                    continue
                new = turn[:i] + [{"name": call["name"], "arguments": {**call["arguments"], k: w}}] + turn[i + 1:]
                _, inst, res = _replay(task, before + new)
                if res != t_res or bfcl.state_differences(inst, t_inst):
                    return as_dicts[:t] + [new] + as_dicts[t + 1:]
        return None
    methods = bfcl._methods(t_inst)
    for cls in task["involved_classes"]:
        for text in EXTRA[cls]:
            extra = _as_dict(methods, text)
            _, inst, _ = _replay(task, truth + [extra])
            if bfcl.state_differences(inst, t_inst):
                return as_dicts[:t] + [turn + [extra]] + as_dicts[t + 1:]
    return None


@needs_bfcl
def test_perturbed_trajectories_fail_in_both_checkers():
    counts, skipped = {}, {}
    for i, (task, row) in enumerate(_tasks()):
        methods = bfcl._methods(bfcl.new_instances(task["involved_classes"], task["initial_config"]))
        as_dicts = [[_as_dict(methods, c) for c in turn] for turn in task["ground_truth"]]
        turns = [j for j, turn in enumerate(as_dicts) if turn]
        t = turns[i % len(turns)]  # a turn with calls, a different one from task to task
        for kind in ("wrong argument", "missing call", "extra state-changing call"):
            bad = _perturb(task, copy.deepcopy(as_dicts), t, kind)
            if bad is None:
                skipped[kind] = skipped.get(kind, 0) + 1
                continue
            mine = bfcl.verdict(row, bad)["pass"]
            theirs = _theirs(task, [[_as_text(c) for c in turn] for turn in bad])
            assert mine == theirs, (task["id"], kind, t, bad[t])
            assert not mine, (task["id"], kind, t, bad[t])
            counts[kind] = counts.get(kind, 0) + 1
    print("perturbed trajectories, all failed in both checkers:", counts, "no such perturbation:", skipped)
    # 800 tasks x 3, less the turns whose calls take no argument that changes anything
    # (view_messages_sent(), get_watchlist(), ...); measured 2,311 (711 + 800 + 800)
    assert sum(counts.values()) >= 2300, (counts, skipped)


@needs_bfcl
def test_server_config_keeps_the_callers_pythonpath(monkeypatch):
    # the SDK starts a server without our environment: where mcp itself is found through PYTHONPATH
    # (a --target install), a config that named only the repo and bfcl_eval's folder started nothing
    monkeypatch.setenv("PYTHONPATH", "/opt/site-a::/opt/site-b")
    path = bfcl.server_config()["mcpServers"]["bfcl"]["env"]["PYTHONPATH"].split(":")
    assert path[0] == str(Path(bfcl.__file__).resolve().parent.parent) and path[-2:] == ["/opt/site-a", "/opt/site-b"]
    assert Path(path[1], "bfcl_eval").is_dir()


@needs_bfcl
def test_server_over_mcp_matches_the_replay():
    """One task's answer through the stdio server and MCPPool's session hook: the texts the model
    would read equal the verdict's replay of the same calls."""
    from mcp_tools.pool import MCPPool
    task, row = next((t, r) for t, r in _tasks() if t["id"] == "multi_turn_base_0")
    info = row["extra_info"]
    cfg = bfcl.server_config()
    cfg["mcpServers"]["bfcl"]["tools"] = info["tools"]  # all 128 are more than a prompt may hold
    methods = bfcl._methods(bfcl.new_instances(task["involved_classes"], task["initial_config"]))
    calls = [_as_dict(methods, c) for turn in task["ground_truth"] for c in turn]
    _, _, want = _replay(task, calls)
    with MCPPool(cfg) as pool:
        assert sorted(t["function"]["name"] for t in pool.tools) == sorted(info["tools"])  # reset hidden
        assert all("session" not in t["function"]["parameters"]["properties"] for t in pool.tools)
        sess = pool.open_session()
        text, is_error, _, _ = pool.call(sess, "cd", {"folder": "document"})
        assert is_error and "reset(session, config)" in text  # the hook's reset loads no task
        config = {"involved_classes": info["involved_classes"], "initial_config": info["initial_config"]}
        assert pool.call_real(sess, "bfcl", "reset", {"session": sess["key"], "config": config})[:2] == ("ok", False)
        got = [pool.call(sess, c["name"], c["arguments"])[0] for c in calls]
        assert got == want
        text, is_error, _, _ = pool.call(sess, "cd", {"directory": "x"})
        assert is_error and text == "Error during execution: GorillaFileSystem.cd() got an unexpected keyword argument 'directory'"
        pool.close_session(sess)


# ----------------------------------------------------------------------------------------------
# episodes: BFCLEnv through MCPEnv against the stdio server, and eval.py

@pytest.fixture(scope="module")
def bfcl_pool():
    if not HAVE_BFCL:
        pytest.skip("bfcl-eval is not importable")
    from mcp_tools.pool import MCPPool
    with MCPPool(bfcl.server_config()) as p:  # row_tools: 128 tools routable, a row's shown
        yield p


def _reply(calls: list[dict]) -> str:
    return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)


def _play(env, task, row, turns=None):
    """Play a task's turns (default its answer, as dicts) through env, up to 8 calls a reply; -> (reward, info)."""
    methods = bfcl._methods(bfcl.new_instances(task["involved_classes"], task["initial_config"]))
    turns = [[_as_dict(methods, c) for c in t] for t in task["ground_truth"]] if turns is None else turns
    env.reset(row)
    total, info = 0.0, {}
    for t, calls in enumerate(turns):
        for i in range(0, len(calls), 8):
            obs, r, done, info = env.step("Working on it. " + _reply(calls[i:i + 8]))
            total += r
            assert not done and len(obs) == len(calls[i:i + 8]), (task["id"], t, info)
        obs, r, done, info = env.step("Done.")
        total += r
        assert done == (t == len(turns) - 1), (task["id"], t, info)
        if not done:
            assert obs[-1]["role"] == "user" and info["user_turns_done"] == t + 1
    env.close()
    return total, info


@needs_bfcl
def test_bfcl_env_passes_the_answers_and_fails_a_missing_turn(bfcl_pool):
    import envs
    tasks = [tr for tr in _tasks() if int(tr[0]["id"].rsplit("_", 1)[1]) < 6]  # 6 a category, 24 in all
    for task, row in tasks:
        env = envs.env_for_row(row, "mcp", bfcl_pool)
        assert isinstance(env, bfcl.BFCLEnv) and env.turn_limit == bfcl.MAX_STEPS
        reward, info = _play(env, task, row)
        n = len(task["ground_truth"])
        assert reward == 1.0 and info["correct"] and info["turns_passed"] == n == info["user_turns"], (task["id"], info)
    task, row = tasks[0]
    methods = bfcl._methods(bfcl.new_instances(task["involved_classes"], task["initial_config"]))
    turns = [[_as_dict(methods, c) for c in t] for t in task["ground_truth"]]
    t = next(i for i, calls in enumerate(turns) if calls)
    reward, info = _play(bfcl.BFCLEnv(pool=bfcl_pool), task, row, turns[:t] + [[]] + turns[t + 1:])
    assert reward == 0.0 and not info["correct"] and info["turns_passed"] == t and "no call" in info["why"]


@needs_bfcl
def test_bfcl_env_shows_held_functions_from_their_turn_and_reads_bad_calls_as_errors(bfcl_pool):
    task, row = next((t, r) for t, r in _tasks() if t["id"] == "multi_turn_miss_func_0")
    (turn, names), = task["missed_function"].items()
    env = bfcl.BFCLEnv(pool=bfcl_pool)
    env.reset(row)
    assert not set(names) & env.names and set(row["extra_info"]["tools"]) == env.names
    obs, r, done, info = env.step(_reply([{"name": names[0], "arguments": {}}]) + "<tool_call>{oops</tool_call>")
    assert not done and info["parse_errors"] == 1 and info["tool_errors"] == 1  # read as errors, nothing run
    assert any("unknown tool" in o["content"] for o in obs) and env.turn_calls == [[]]
    for k in range(1, int(turn) + 1):
        obs, r, done, info = env.step("Done.")
    assert "New tools:" in obs[-1]["content"] and set(names) <= env.names
    assert obs[-1]["content"].startswith(bfcl.ADDITIONAL_FUNCTION_PROMPT)
    env.close()


@needs_bfcl
def test_bfcl_env_runs_a_replys_calls_in_order(bfcl_pool, monkeypatch):
    # cd then mv in one reply: each call starts once the one before it answered (sequential_calls)
    task, row = next((t, r) for t, r in _tasks() if t["id"] == "multi_turn_base_0")
    methods = bfcl._methods(bfcl.new_instances(task["involved_classes"], task["initial_config"]))
    calls = [_as_dict(methods, c) for c in task["ground_truth"][0]]
    started, submit = [], bfcl_pool.submit

    def watched(*a, **kw):
        assert all(f.done() for f in started), "a call started before the one before it answered"
        started.append(submit(*a, **kw))
        return started[-1]

    monkeypatch.setattr(bfcl_pool, "submit", watched)
    env = bfcl.BFCLEnv(pool=bfcl_pool)
    env.reset(row)
    obs, r, done, info = env.step(_reply(calls))
    assert len(started) == len(calls) >= 3 and info["tool_errors"] == 0
    assert [c["name"] for c in env.turn_calls[0]] == [c["name"] for c in calls]
    env.close()


@needs_bfcl
def test_eval_py_reports_bfcl_categories_beside_the_paper(tiny_model_dir, tmp_path, capsys):
    # the user's commands end to end on the CPU: rows, config, eval.py (a tiny random model; plumbing only)
    import subprocess
    import sys
    import eval as ev
    from mcp_tools.config import openai_schema
    from support.rows import save_rows
    schemas = {t["name"]: openai_schema(t["name"], t["description"], t["input_schema"]) for t in bfcl.server_tools()}
    size = lambda r: sum(len(json.dumps(schemas[n])) for n in r["extra_info"]["tools"])  # noqa: E731 byte tokens
    rows = [min(bfcl.bfcl_rows(c), key=size) for c in ("base", "miss_param")]
    save_rows(rows, str(tmp_path / "rows.jsonl"))
    repo = str(Path(__file__).resolve().parent.parent)
    subprocess.run([sys.executable, "-m", "mcp_tools.bfcl", "config", "--out", str(tmp_path / "mcp.json")], check=True, cwd=repo)
    report = ev.main(["--env", "mcp", "--mcp-config", str(tmp_path / "mcp.json"), "--eval-data", str(tmp_path / "rows.jsonl"),
                      "--model", tiny_model_dir, "--limit", "800", "--n", "0", "--max-tokens", "4",
                      "--max-context", "16000", "--out-dir", str(tmp_path / "out"), "--no-progress"])
    out = capsys.readouterr().out
    m = report["models"][0]
    assert m["rows"] == 2 and set(m["by_source"]) == {"bfcl/base", "bfcl/miss_param"}
    assert m["greedy"]["finish_error"] == 0.0 and report["bfcl_paper"] == ev.BFCL_PAPER
    assert "| bfcl/base | 0.0 (1 rows) | 4.0 |" in out and "| bfcl/miss_param | 0.0 (1 rows) | 3.0 |" in out
    assert "paper: Qwen2.5-1.5B-Instruct, FC (another model)" in out


@needs_bfcl
def test_synthesized_training_rows_are_none_of_bfcls_tests(bfcl_pool):
    # training rows from other start states and goals: no user message and no initial_config of theirs
    # equals a test task's; each one's answer passes its own verdict, doing nothing fails; one plays
    # through BFCLEnv as a test row does
    rows = bfcl_synth.synth_rows(300, seed=0, classes=("GorillaFileSystem",))
    questions, configs = bfcl_synth.held_out_keys()
    assert len(configs) == 205 and len(questions) == 1162  # distinct ones: the categories share tasks
    fs = {json.dumps(t["initial_config"].get("GorillaFileSystem"), sort_keys=True)
          for c in bfcl.CATEGORIES for t in bfcl.load_bfcl(c)}  # nor one class's start state alone
    used = set()
    for r in rows:
        validate_row(r, r["extra_info"]["bfcl_id"])
        info, answer = r["extra_info"], r["reward_spec"]["ground_truth"]
        msgs = r["prompt"][1:] + [m for turn in info["user_turns"] for m in turn]
        assert r["data_source"] == "bfcl/synth" and not any(m["content"] in questions for m in msgs)
        assert json.dumps(info["initial_config"], sort_keys=True) not in configs
        assert json.dumps(info["initial_config"]["GorillaFileSystem"], sort_keys=True) not in fs
        assert bfcl.verdict(r, answer)["pass"] and not bfcl.verdict(r, [[] for _ in answer])["pass"]
        used |= {bfcl.parse_call(c)[0] for turn in answer for c in turn}
    assert used == {"cd", "touch", "echo", "grep", "wc", "mkdir", "cp", "tail", "sum_values"}
    fs_only = dict(classes=("GorillaFileSystem",))
    assert bfcl_synth.synth_rows(20, seed=0, **fs_only) == rows[:20] and bfcl_synth.synth_rows(20, seed=1, **fs_only) != rows[:20]
    for r in rows[:3]:
        task = {"id": r["extra_info"]["bfcl_id"], "ground_truth": r["reward_spec"]["ground_truth"],
                **{k: r["extra_info"][k] for k in ("involved_classes", "initial_config")}}
        reward, info = _play(bfcl.BFCLEnv(pool=bfcl_pool), task, r)
        assert reward == 1.0 and info["turns_passed"] == len(task["ground_truth"])


def _refused(row, why, pool):
    """row is refused as the rows load (envs.check_row: the file, the line and why, a regex), and by the env
    for a row that skipped that check: its first step ends the episode with the error, reward 0."""
    import envs
    with pytest.raises(ValueError, match=rf"^train.jsonl:line 3: {why}"):
        envs.check_row(row, "mcp", "train.jsonl:line 3")
    env = bfcl.BFCLEnv(pool=pool)
    env.reset(row)
    _, reward, done, info = env.step("Done.")
    assert done and reward == 0.0 and re.search(why, info["error"])


@needs_bfcl
def test_turn_credit_pays_the_turns_passed_of_a_conversation_that_plays_every_turn(bfcl_pool):
    # reward_spec.turn_credit (a training row's): a failed conversation scores w x turns passed / turns;
    # a pass still scores 1.0, a conversation cut by the turn limit 0, and a row without it 0 (the tests')
    import envs
    rows = bfcl_synth.synth_rows(40, seed=0, turn_credit=0.3)
    assert all(r["reward_spec"]["turn_credit"] == 0.3 for r in rows)
    assert "turn_credit" not in bfcl_synth.synth_rows(1, seed=0)[0]["reward_spec"]
    r = next(r for r in rows if sum(bool(t) for t in r["reward_spec"]["ground_truth"]) >= 2)
    task = {"id": r["extra_info"]["bfcl_id"], "ground_truth": r["reward_spec"]["ground_truth"],
            **{k: r["extra_info"][k] for k in ("involved_classes", "initial_config")}}
    methods = bfcl._methods(bfcl.new_instances(task["involved_classes"], task["initial_config"]))
    turns = [[_as_dict(methods, c) for c in t] for t in task["ground_truth"]]
    n, last = len(turns), max(i for i, t in enumerate(turns) if t)  # the last turn with calls fails
    assert last >= 1
    failing = turns[:last] + [[]] + turns[last + 1:]
    reward, info = _play(bfcl.BFCLEnv(pool=bfcl_pool), task, r, failing)
    assert not info["correct"] and info["turns_passed"] == last and reward == pytest.approx(0.3 * last / n)
    plain = copy.deepcopy(r)
    del plain["reward_spec"]["turn_credit"]
    assert _play(bfcl.BFCLEnv(pool=bfcl_pool), task, plain, failing)[0] == 0.0
    assert _play(bfcl.BFCLEnv(pool=bfcl_pool), task, r)[0] == 1.0
    env = bfcl.BFCLEnv(pool=bfcl_pool, max_turns=2)  # turn 0 passes, then the next turn runs out of replies
    env.reset(r)
    assert turns[0] and len(turns[0]) <= 8
    env.step(_reply(turns[0]))
    env.step("Done.")
    rewards = [env.step(_reply(turns[0][:1])) for _ in range(2)]
    assert rewards[-1][2] and rewards[-1][3]["cut"] == "turn_limit" and rewards[-1][3]["turns_passed"] >= 1
    assert sum(x[1] for x in rewards) == 0.0
    env.close()
    for bad in (0.5, -0.1, float("nan"), True, "0.3"):  # refused as the rows load, naming the field
        row = copy.deepcopy(r)
        row["reward_spec"]["turn_credit"] = bad
        _refused(row, r"reward_spec.turn_credit \(bfcl\)", bfcl_pool)


@needs_bfcl
def test_played_turns_start_the_policy_at_a_later_turn_in_the_answers_state(bfcl_pool):
    # extra_info.played_turns = k (bfcl_synth --played): reset plays turns 0..k-1 with the answer's calls in the
    # model's format, for real; the policy starts at turn k, counted and charged for its own calls only
    import envs
    from mcp_tools.formats import FORMATS
    plain, rows = bfcl_synth.synth_rows(60, seed=4), bfcl_synth.synth_rows(60, seed=4, played=0.5)
    assert [r["prompt"] for r in plain] == [r["prompt"] for r in rows]  # the same conversations at any share
    played = [r for r in rows if "played_turns" in r["extra_info"]]
    assert 15 <= len(played) <= 45 and all(1 <= r["extra_info"]["played_turns"] < len(r["reward_spec"]["ground_truth"])
                                           for r in played)
    r = max(played, key=lambda r: sum(map(len, r["reward_spec"]["ground_truth"][:r["extra_info"]["played_turns"]])))
    k, answer = r["extra_info"]["played_turns"], r["reward_spec"]["ground_truth"]
    envs.check_row(r, "mcp", "train.jsonl:line 1")
    task = {"ground_truth": answer, **{key: r["extra_info"][key] for key in ("involved_classes", "initial_config")}}
    methods = bfcl._methods(bfcl.new_instances(task["involved_classes"], task["initial_config"]))
    turns = [[_as_dict(methods, c) for c in t] for t in answer]
    env = envs.env_for_row(r, "mcp", bfcl_pool)
    msgs = env.reset(r)
    given = msgs[len(r["prompt"]):]
    said = [m["content"] for m in given if m["role"] == "assistant"]
    per = env.max_calls_per_turn  # a turn's calls in as few replies as the env runs, then the closing reply
    assert len(said) == sum(-(-len(t) // per) for t in turns[:k]) + k and said.count(bfcl.PLAYED_REPLY) == k
    assert [c for text in said for c in FORMATS["hermes"].parse(text, tools=env.tools)[0]] == [c for t in turns[:k] for c in t]
    assert not any(m["content"].startswith("Error") for m in given if m["role"] == "tool")
    assert given[-1] == r["extra_info"]["user_turns"][k - 1][-1]  # the policy's first turn: user turn k
    assert env.info["tool_calls"] == 0 and env.info["user_turns_done"] == k and env.info["played_turns"] == k
    total = 0.0
    for t in range(k, len(turns)):  # the policy passes the rest: the whole conversation passes
        if turns[t]:
            total += env.step(_reply(turns[t]))[1]
        _, reward, done, info = env.step("Done.")
        total += reward
    assert done and total == 1.0 and info["correct"] and info["turns_passed"] == len(turns)
    assert info["tool_calls"] == sum(map(len, turns[k:])) and info["repeat_calls"] == 0
    env.close()
    first = next(t for t in range(k, len(turns)) if turns[t])  # a policy that makes no call there fails there
    env = bfcl.BFCLEnv(pool=bfcl_pool)
    env.reset(r)
    for _ in range(k, first + 1):
        _, reward, done, info = env.step("Done.")
    if not done:
        for _ in range(first + 1, len(turns)):
            _, reward, done, info = env.step("Done.")
    assert done and reward == 0.0 and not info["correct"] and info["turns_passed"] == first
    env.close()
    env = bfcl.BFCLEnv(pool=bfcl_pool)  # a played call sent again is the policy's first of its kind, not a repeat
    env.reset(r)
    _, _, _, info = env.step(_reply([[c for t in turns[:k] for c in t][-1]]))
    assert info["tool_calls"] == 1 and info["repeat_calls"] == 0 and info["stale_repeats"] == 0
    env.close()
    assert max(map(len, turns[:k])) >= 2
    env = bfcl.BFCLEnv(pool=bfcl_pool, max_turns=2)  # a played turn takes two replies, whatever its calls
    assert env.reset(r)[-1] == given[-1] and env.failed is None and env.info["played_turns"] == k
    env.close()
    for bad, why in ((len(answer), "want an integer from 0"), (-1, "want an integer"), (True, "want an integer"),
                     ("1", "want an integer")):
        row = copy.deepcopy(r)
        row["extra_info"]["played_turns"] = bad
        _refused(row, rf"extra_info.played_turns \(bfcl\): {why}", bfcl_pool)
    row = copy.deepcopy(r)
    call = row["reward_spec"]["ground_truth"][0][0]
    row["reward_spec"]["ground_truth"][0][0] = call.split("(")[0] + "('x')"
    assert "keyword arguments only" in bfcl.played_error(row)


@needs_bfcl
def test_bundled_rows_and_conversations_train_in_one_pool_each_with_its_own_tools():
    # headline.sh bfcl BUNDLED=N: server_config(bundled=True) serves BFCL's classes beside the bundled server;
    # a conversation shows exactly its row's tools, a bundled row every tool but BFCL's, and both score
    import envs
    from mcp_tools.pool import MCPPool
    from mcp_tools.tasks import mcp_rows
    cfg = bfcl.server_config(bundled=True)
    assert set(cfg["mcpServers"]) == {"bfcl", "nanorl"} and cfg["mcpServers"]["bfcl"]["row_tools"]
    assert set(bfcl.server_config()["mcpServers"]) == {"bfcl"}
    conv = bfcl_synth.synth_rows(1, seed=5)[0]
    task = next(t for t in mcp_rows(seed=0, counts={"arith": 20})[0] if t["extra_info"]["family"] == "arith")
    with MCPPool(cfg) as pool:
        env = envs.env_for_row(conv, "mcp", pool)
        env.reset(conv)
        assert env.names == set(conv["extra_info"]["tools"])
        env.close()
        env = envs.env_for_row(task, "mcp", pool)
        env.reset(task)
        assert env.names and not env.names & {t for c in bfcl.CLASSES for t in (d["name"] for d in bfcl.function_docs(c))}
        calls = task["extra_info"]["oracle_calls"]
        for c in calls:
            _, _, done, info = env.step(_reply([c]))
            assert not done and info["tool_errors"] == 0
        _, reward, done, info = env.step(f"<answer>{task['reward_spec']['ground_truth']['answer']}</answer>")
        assert done and reward == 1.0 and info["correct"]
        env.close()


def _perturbed(call: str) -> str:
    """The call with one argument wrong: its first number plus one, else its first quoted string plus 'x'."""
    name, args = call.split("(", 1)
    num = re.search(r"=\[?(-?\d+(\.\d+)?)", args)
    if num:
        v = num.group(1)
        return name + "(" + args[:num.start(1)] + str(float(v) + 1 if "." in v else int(v) + 1) + args[num.end(1):]
    return name + "(" + re.sub(r"'([^']*)'", lambda m: f"'{m.group(1)}x'", args, count=1)


def _idle(result: str) -> bool:
    """A result of a call that found or changed nothing: an answer's calls each do something."""
    return result in ("[]", '{"results": []}') or '_status": false' in result or "error" in result.lower()


@needs_bfcl
@pytest.mark.parametrize("cls", [c for c in bfcl_synth.SYNTH if c != "GorillaFileSystem"])
def test_synthesized_rows_of_each_class_pass_their_answer_and_fail_a_wrong_argument(cls, bfcl_pool):
    # per class: every row's own answer passes every turn; the last call of any one turn with one
    # wrong argument (_perturbed) fails at that turn; no question or start state is a test task's; one
    # plays through BFCLEnv's MCP server; several classes are taken in turn
    rows = bfcl_synth.synth_rows(60, seed=3, classes=(cls,))
    questions, configs = bfcl_synth.held_out_keys()
    one = {json.dumps(t["initial_config"].get(cls), sort_keys=True)
           for c in bfcl.CATEGORIES for t in bfcl.load_bfcl(c)}  # nor this class's start state alone
    used, turns = set(), []
    for r in rows:
        info, answer = r["extra_info"], r["reward_spec"]["ground_truth"]
        validate_row(r, info["bfcl_id"])
        assert info["involved_classes"] == [cls] and 2 <= len(answer) <= 4
        assert not any(m["content"] in questions for turn in info["user_turns"] for m in turn)
        assert not any(m["content"] in questions for m in r["prompt"][1:])
        assert json.dumps(info["initial_config"], sort_keys=True) not in configs
        assert json.dumps(info["initial_config"][cls], sort_keys=True) not in one
        assert bfcl.verdict(r, answer)["pass"]
        task = {"id": info["bfcl_id"], **{k: info[k] for k in ("involved_classes", "initial_config")}}
        assert not any(_idle(x) for x in _replay(task, [c for turn in answer for c in turn])[2]), answer
        for t in range(len(answer)):
            wrong = [list(turn) for turn in answer]
            wrong[t][-1] = _perturbed(wrong[t][-1])
            assert wrong[t][-1] != answer[t][-1]
            v = bfcl.verdict(r, wrong)
            assert not v["pass"] and v["turn"] == t, (wrong[t][-1], v)
        used |= {bfcl.parse_call(c)[0] for turn in answer for c in turn}
        turns.append(len(answer))
    assert max(len(turn) for r in rows for turn in r["reward_spec"]["ground_truth"]) >= 2  # dependent calls
    assert len(used) >= 5 and set(turns) == {2, 3, 4}
    mixed = bfcl_synth.synth_rows(8, seed=3, classes=("GorillaFileSystem", cls))
    assert [r["extra_info"]["involved_classes"][-1] for r in mixed] == ["MathAPI", cls] * 4
    r = rows[0]
    task = {"id": r["extra_info"]["bfcl_id"], "ground_truth": r["reward_spec"]["ground_truth"],
            **{k: r["extra_info"][k] for k in ("involved_classes", "initial_config")}}
    reward, info = _play(bfcl.BFCLEnv(pool=bfcl_pool), task, r)
    assert reward == 1.0 and info["turns_passed"] == len(task["ground_truth"])


@needs_bfcl
def test_synthesized_pairs_pass_every_turn_and_fail_a_wrong_argument_at_its_turn(bfcl_pool):
    # two classes a conversation (bfcl_synth.synth_pair), each of the 12 pairs 4 times: both classes are
    # involved, and the last turn calls both (a MAIN value passed on with SIDE's tools); every row's
    # answer passes every turn; the last call of any one turn with one wrong argument (_perturbed) fails
    # at that turn; no question or start state (nor one class's alone) is a test task's; one plays
    # through BFCLEnv; the default mix (MIX) takes every class, then every pair, in turn
    rows = bfcl_synth.synth_rows(48, seed=5, classes=bfcl_synth.PAIRS)
    questions, configs = bfcl_synth.held_out_keys()
    alone = {json.dumps(state, sort_keys=True)  # any one class's start state in a test task
             for c in bfcl.CATEGORIES for t in bfcl.load_bfcl(c) for state in t["initial_config"].values()}
    docs = {c: {d["name"] for d in bfcl.function_docs(c)} for c in bfcl.CLASSES}
    pairs, turns = [], []
    for r in rows:
        info, answer = r["extra_info"], r["reward_spec"]["ground_truth"]
        validate_row(r, info["bfcl_id"])
        main, side = info["involved_classes"][0], info["involved_classes"][-1]
        assert main in bfcl_synth.MAIN and side in bfcl_synth.SIDE and sorted(info["initial_config"]) == sorted(
            c for c in info["involved_classes"] if c not in bfcl.STATELESS)
        last = [bfcl.parse_call(c)[0] for c in answer[-1]]
        assert last[-1] in docs[side] and any(n in docs[main] | docs["MathAPI"] for n in last), answer[-1]
        # the value passed on is what that turn's lookups show, after every turn before it: the
        # request's 'text with <value>' and the text sent (a message, tweet, ticket) differ in it alone
        msgs = r["prompt"][1:] + [m for turn in info["user_turns"] for m in turn]
        shown = re.findall(r"'([^']*<[^']*>[^']*)'", msgs[-1]["content"])[-1]
        args = bfcl.parse_call(answer[-1][-1])[2]
        sent = args.get("message") or args.get("content") or args["description"]
        head, tail = shown.split("<")[0], shown.split(">")[1]
        assert sent.startswith(head) and sent.endswith(tail) and len(sent) > len(head) + len(tail), (shown, sent)
        task = {"id": info["bfcl_id"], **{k: info[k] for k in ("involved_classes", "initial_config")}}
        results = _replay(task, [c for turn in answer for c in turn])[2]
        shows = results[-len(answer[-1]):-1]
        assert sent[len(head):len(sent) - len(tail)] in " ".join(shows), (sent, shows)
        assert not any(_idle(x) for x in results), answer
        assert not any(m["content"] in questions for m in msgs)
        assert json.dumps(info["initial_config"], sort_keys=True) not in configs
        assert not any(json.dumps(state, sort_keys=True) in alone for state in info["initial_config"].values())
        assert bfcl.verdict(r, answer)["pass"]
        for t in range(len(answer)):
            if answer[t][-1].startswith("tail("):  # more lines than a short file has show the same text
                continue
            wrong = [list(turn) for turn in answer]
            wrong[t][-1] = _perturbed(wrong[t][-1])
            assert wrong[t][-1] != answer[t][-1]
            v = bfcl.verdict(r, wrong)
            assert not v["pass"] and v["turn"] == t, (wrong[t][-1], v)
        pairs.append(f"{main}+{side}")
        turns.append(len(answer))
    assert sorted(set(pairs)) == sorted(bfcl_synth.PAIRS) and set(turns) == {3, 4, 5}
    assert bfcl_synth.synth_rows(10, seed=5, classes=bfcl_synth.PAIRS) == rows[:10]
    mixed = bfcl_synth.synth_rows(len(bfcl_synth.MIX), seed=5)
    names = ["+".join(c for c in r["extra_info"]["involved_classes"] if c != "MathAPI") for r in mixed]
    assert names == list(bfcl_synth.MIX) and sorted(names) == sorted([*bfcl_synth.SYNTH, *bfcl_synth.PAIRS])
    with pytest.raises(ValueError, match="unknown synth classes"):
        bfcl_synth.synth_rows(1, classes=("MessageAPI+TravelAPI",))  # SIDE+MAIN: no such pair
    r = rows[0]
    task = {"id": r["extra_info"]["bfcl_id"], "ground_truth": r["reward_spec"]["ground_truth"],
            **{k: r["extra_info"][k] for k in ("involved_classes", "initial_config")}}
    reward, info = _play(bfcl.BFCLEnv(pool=bfcl_pool), task, r)
    assert reward == 1.0 and info["turns_passed"] == len(task["ground_truth"])
