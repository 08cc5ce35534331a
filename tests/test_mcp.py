"""MCP environment tests: real server subprocesses over stdio (and one over HTTP), no network; then
the pool's robustness (its section) and lab/transfer.py's set on third-party servers (the last).

One pool of the bundled server (with its test-only `sleep` and `pid` tools) is shared by the
whole module; tests that kill or time out a server use that same pool, so they also show the
pool surviving those failures. Tests of a server that stays down, floods or chatters write small
MCP servers of their own. Run: python -m pytest -q tests/test_mcp.py   (~2-3 min on 2 cores)
"""
import asyncio
import collections
import functools
import importlib.util
import json
import math
import os
import re
import shlex
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import wait
from contextlib import closing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from conftest import load_script, say_engine  # noqa: E402
from mcp_tools import config as mcp_config  # noqa: E402
from mcp_tools import conn as mcp_conn  # noqa: E402
from mcp_tools import pool as mcp_pool  # noqa: E402
from mcp_tools import rewards as mcp_rewards  # noqa: E402
from mcp_tools import server, shop as S  # noqa: E402
from mcp_tools.config import BUNDLED_SERVER, bundled_config, load_config, strip_titles  # noqa: E402
from mcp_tools.env import MCPEnv, parse_tool_calls  # noqa: E402
from mcp_tools.rewards import answer_matches, check_ground_truth  # noqa: E402
from mcp_tools import formats  # noqa: E402
from mcp_tools.formats import ensure_tool_template  # noqa: E402
from mcp_tools.pool import MCPPool, ServerStartFailed  # noqa: E402
from mcp_tools.tasks import FAMILIES, mcp_rows  # noqa: E402
from support.rows import load_rows  # noqa: E402

TIME_SERVER = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}


@pytest.fixture(scope="module")
def pool():
    with MCPPool(bundled_config(test_tools=True), call_timeout=10.0) as p:
        yield p


@pytest.fixture(scope="module")
def rows():
    train, test = mcp_rows(seed=0)
    return train, test


def tc(tool, /, **arguments):
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


def row_for(answer, typ="number", check=()):
    return {"data_source": "t", "prompt": [{"role": "user", "content": "q"}], "env_class": "mcp",
            "reward_spec": {"method": "rule", "ground_truth": {"answer": answer, "type": typ, "check": list(check)}}}


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped
    except OSError:
        return False

# ---------------------------------------------------------------------------------------------
# the bundled server's tools


def test_tools_listed_and_schemas_clean(pool):
    names = [t["function"]["name"] for t in pool.tools]
    for want in ["calculate", "convert_units", "convert_currency", "date_add", "date_diff", "weekday",
                 "search_products", "get_product", "find_customer", "list_orders", "get_order", "sql_query",
                 "kb_get", "kb_search", "kb_set", "cart_add", "cart_view", "text_stats", "transform_text"]:
        assert want in names
    assert "reset" not in names  # hidden: the env calls it, the model never sees it
    blob = json.dumps(pool.tools)
    assert '"title"' not in blob and '"session"' not in blob
    kb_set = next(t for t in pool.tools if t["function"]["name"] == "kb_set")["function"]["parameters"]
    assert kb_set["required"] == ["key", "value"] and set(kb_set["properties"]) == {"key", "value"}


def test_strip_titles_keeps_properties_named_title():
    s = {"title": "A", "type": "object", "properties": {"title": {"title": "Title", "type": "string"}},
         "$defs": {"B": {"title": "B", "type": "integer"}}}
    assert strip_titles(s) == {"type": "object", "properties": {"title": {"type": "string"}},
                               "$defs": {"B": {"type": "integer"}}}


def test_calls_and_tool_errors(pool):
    env = MCPEnv(pool=pool)
    env.reset(row_for("1"))
    obs, r, done, info = env.step(tc("calculate", expression="(12.5 * 4 - 3) / 7") + "\n" +
                                  tc("sql_query", sql="SELECT COUNT(*) FROM customers"))
    assert not done and r == 0.0
    assert float(obs[0]["content"]) == pytest.approx(47 / 7)
    assert json.loads(obs[1]["content"])["rows"] == [[24]]
    bad = [tc("calculate", expression="__import__('os').system('echo hi')"),  # not eval'd: rejected
           tc("sql_query", sql="DELETE FROM orders"), tc("sql_query", sql="SELECT 1; DROP TABLE orders"),
           tc("date_add", date="2024-01-01", days="many"), tc("date_add", date="2024-01-01", days=10**12),
           tc("get_product", product_id=9999),
           tc("no_such_tool"), '<tool_call>{"name": "calculate", "arguments": {"expr</tool_call>',
           tc("convert_units", value=1, from_unit="kg", to_unit="km")]
    obs, r, done, info = env.step(" ".join(bad) + " <tool_call>{\"name\": \"calc")
    assert not done and len(obs) == len(bad) + 1
    assert all(o["role"] == "tool" and "rror" in o["content"] for o in obs), obs
    assert info["parse_errors"] == 2 and info["tool_errors"] == 8 and info["tool_calls"] == 9
    text = " ".join(o["content"] for o in obs)
    assert "cannot convert mass (kg) to length (km)" in text and "outside the years 1-9999" in text
    env.close()


def test_demo_is_what_the_server_answers(pool):
    # train.py --fewshot 1 shows DEMO to the model: its call must parse and its tool message must be
    # the bundled server's real answer, its final turn an answer the reward accepts
    from mcp_tools.tasks import DEMO
    user, call, tool, final = DEMO
    env = MCPEnv(pool=pool)
    env.reset(row_for("395"))
    obs, r, done, info = env.step(call["content"])
    assert info["tool_calls"] == 1 and info["parse_errors"] == 0 and not done
    assert obs == [{"role": "tool", "content": tool["content"]}]
    obs, r, done, info = env.step(final["content"])
    assert done and r == 1.0
    env.close()


def test_safe_eval_whitelist():
    assert S.safe_eval("2^10 + sqrt(16)") == 1028.0
    assert S.safe_eval("-(3 + 4) * 2 // 3 % 5") == (-(3 + 4) * 2 // 3) % 5
    for bad in ["__import__('os')", "().__class__", "[1, 2]", "lambda: 1", "a + 1", "9 ** 9 ** 9", "1/0", ""]:
        with pytest.raises(S.CalcError):
            S.safe_eval(bad)


def test_calculate_refuses_a_result_too_long_to_print_with_a_tool_error(caplog):
    """Python 3.11+ refuses str() of an int over 4,300 digits: calculate raised that ValueError inside the
    tool (a crash and a traceback on the server's stderr). Now a ToolError saying why."""
    from mcp.server.mcpserver.exceptions import ToolError
    huge = " * ".join(["999999 ** 100"] * 8)  # 8 x 600 digits: 4,800
    with pytest.raises(S.CalcError, match="4,000 digits"):
        S.safe_eval(huge)
    assert len(repr(S.safe_eval(" * ".join(["999999 ** 100"] * 6)))) == 3600  # under the bound: a number
    server, _ = _bundled_server()
    with pytest.raises(ToolError) as e:
        asyncio.run(server.call_tool("calculate", {"expression": huge}))
    assert type(e.value) is ToolError and str(e.value).endswith(": result too large (4,000 digits or more)")
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged


def test_timeout_and_slow_tool_does_not_stall_others(pool):
    slow, fast = MCPEnv(pool=pool), MCPEnv(pool=pool)
    slow.reset(row_for("1"))
    fast.reset(row_for("1"))
    out = {}
    t = threading.Thread(target=lambda: out.update(r=slow.step(tc("sleep", seconds=2))))
    t.start()
    time.sleep(0.2)
    obs, *_ = fast.step(tc("calculate", expression="6*7"))
    assert obs[0]["content"] == "42" and t.is_alive()  # answered while `sleep` is still running
    t.join()
    assert out["r"][0][0]["content"] == "slept 2.0"
    slow.call_timeout = 0.5
    obs, r, done, info = slow.step(tc("sleep", seconds=2))
    assert "timed out after 0.5 s" in obs[0]["content"] and info["timeouts"] == 1 and not done
    obs, *_ = slow.step(tc("calculate", expression="1+1"))  # the server is still healthy
    assert obs[0]["content"] == "2"
    slow.close()
    fast.close()


def test_killed_server_costs_one_error_observation_not_the_episode(pool):
    env = MCPEnv(pool=pool)
    env.reset(row_for("2"))
    obs, *_ = env.step(tc("pid"))
    pid = int(obs[0]["content"])
    restarts = pool.restarts
    os.kill(pid, 9)
    time.sleep(0.2)
    obs, r, done, info = env.step(tc("calculate", expression="1+1"))
    assert not done and r == 0.0 and "error" not in info, info
    assert obs[0]["content"].startswith("Error:") and "was restarted" in obs[0]["content"], obs
    assert pool.restarts == restarts + 1
    obs, *_ = env.step(tc("pid"))  # the same episode goes on, on the fresh server
    assert int(obs[0]["content"]) != pid
    assert env.step("<answer>2</answer>")[1] == 1.0

# ---------------------------------------------------------------------------------------------
# parser fuzz

_PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', ":",
                           ",", '"calculate"', "null", "1e999", "\\u0000", "x", " ", "\n", '"'])


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(), st.lists(_PIECES, max_size=40).map("".join)))
def test_parser_total(text):
    calls, errors = parse_tool_calls(text)
    assert isinstance(calls, list) and isinstance(errors, list)
    assert all(isinstance(c["name"], str) and isinstance(c["arguments"], dict) for c in calls)
    assert all(isinstance(e, str) for e in errors)
    if "<tool_call>" not in text and "</tool_call>" not in text:
        assert calls == [] and errors == []


def test_parser_cases():
    assert parse_tool_calls("<tool_call>" + "[" * 100000 + "</tool_call>")[1]  # RecursionError -> error
    calls, errors = parse_tool_calls('a <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> b '
                                     '<tool_call>\n{"name": "g"}\n</tool_call>')
    assert calls == [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}] and errors == []
    calls, errors = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert calls == [] and "not closed" in errors[0]
    # SmolLM2's format: a JSON list of calls in one block; bad elements are errors, good ones run
    calls, errors = parse_tool_calls('<tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g"}, 3]</tool_call>')
    assert calls == [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}] and len(errors) == 1
    assert parse_tool_calls("<tool_call>[]</tool_call>")[1]  # an empty list is no call: an error


def test_parser_reads_doubled_braces():
    """Qwen2.5's template shows {{"name": ..., "arguments": ...}}; the lenient parser reads the copy,
    the strict one does not, and nothing else changes meaning."""
    call = {"name": "calculate", "arguments": {"expression": "2*21"}}
    for body in ['{{"name": "calculate", "arguments": {"expression": "2*21"}}}',   # both ends doubled
                 '{{"name": "calculate", "arguments": {"expression": "2*21"}}',    # only the opening one
                 '{{"name": "calculate", "arguments": {"expression": "2*21"}} }']:
        assert parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>") == ([call], [])
        calls, errors = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>", strict=True)
        assert calls == [] and "invalid JSON" in errors[0]
    for bad in ['{{"name": "f"}}}}', '{{"name": "f", "arguments": {}}} x', '{{}', '{{[1, 2]}', '{{{"name": "f"}}}']:
        assert parse_tool_calls(f"<tool_call>{bad}</tool_call>")[0] == [], bad  # one layer only, then exact JSON
    from mcp_tools.formats import doubled_braces
    assert doubled_braces('{"name": "f"}') is None  # plain JSON is not the doubled form


def test_several_calls_in_one_block_get_an_error_that_says_how_to_write_them():
    """Calls one after another in one <tool_call> block (a trained policy did this on the state family,
    then answered with the parser's "Extra data" text): not run, and the error says to write one call a
    block and shows them so. Anything else that is not one object keeps the JSON error."""
    two = '{"name": "cart_add", "arguments": {"product_id": 1}}\n{"name": "cart_view", "arguments": {}}'
    for strict in (False, True):
        calls, errors = parse_tool_calls(f"<tool_call>\n{two}\n</tool_call>", strict=strict)
        assert calls == [] and len(errors) == 1 and errors[0].startswith(
            "tool call 1: 2 JSON objects in one <tool_call> block; the calls were not run. Write each call in "
            "its own <tool_call>...</tool_call> block:\n<tool_call>")
        # the error shows the calls one a block (policies resent the packed turn when told only the
        # rule): the shown text, sent back as it is, runs both calls
        shown = errors[0][errors[0].index("<tool_call>\n"):]
        again, errs = parse_tool_calls(shown, strict=strict)
        assert errs == [] and again == [{"name": "cart_add", "arguments": {"product_id": 1}},
                                        {"name": "cart_view", "arguments": {}}]
    for bad in ('{"name": "f"} x', '{"name": "f"} [1]', '{"name": "f"}{', '{"name": "f"} "g"'):
        assert "invalid JSON" in parse_tool_calls(f"<tool_call>{bad}</tool_call>")[1][0], bad
    first, second = two.splitlines()
    calls, errors = parse_tool_calls(f"<tool_call>{first}</tool_call><tool_call>{second}</tool_call>")
    assert [c["name"] for c in calls] == ["cart_add", "cart_view"] and errors == []  # one a block: both run


def test_own_result_at_finds_a_result_the_model_wrote_outside_its_calls():
    from mcp_tools.formats import FORMATS, own_result_at
    m = "<tool_response>"
    assert [FORMATS[f].result_marker for f in ("hermes", "qwen3-xml", "llama3-json", "mistral")] == [m, m, "", ""]
    call = '<tool_call>{"name": "t", "arguments": {"text": "a <tool_response> b"}}</tool_call>'
    assert own_result_at("no result here", m) == -1 and own_result_at(f"x {m} y", "") == -1
    assert own_result_at(call, m) == -1                       # inside a call's arguments: the call's text
    assert own_result_at(f"{call}\n{m}[1]</tool_response>", m) == len(call) + 1
    assert own_result_at(f"{m}{call}", m) == 0
    assert own_result_at(f"<tool_call>{{\"a\": \"{m}", m) == -1   # an unclosed block runs to the end


def test_a_result_the_model_writes_itself_ends_what_its_turn_runs(pool, rows):
    """A trained policy wrote a call, then the call's result itself (a made-up id), then a call on that
    id, all in one turn: only the calls before its own result run, and the turn's note says why."""
    row = next(r for r in rows[0] if r["extra_info"]["family"] == "state"
               and [c["name"] for c in r["extra_info"]["oracle_calls"]] == ["search_products", "cart_add"])
    search, add = row["extra_info"]["oracle_calls"]
    env = MCPEnv(pool=pool)
    env.reset(row)
    fake = '<tool_response>\n[{"id": 123, "name": "%s"}]\n</tool_response>' % search["arguments"]["query"]
    obs, r, done, info = env.step(f"{tc('search_products', **search['arguments'])}\n{fake}\n"
                                  f"{tc('cart_add', product_id=123, quantity=1)}")
    assert not done and info["tool_calls"] == 1 and info["parse_errors"] == 1 and info["tool_errors"] == 0
    assert obs[0]["content"] == ("Error: this turn wrote a <tool_response> of its own; results come only from "
                                 "the tools, so nothing written after it was run")
    assert json.loads(obs[1]["content"])[0]["id"] == add["arguments"]["product_id"] != 123
    obs, *_ = env.step(tc("cart_view"))
    assert json.loads(obs[0]["content"])["items"] == []       # the cart_add after the made-up result never ran
    # the marker inside a call's arguments is that call's text, and the call runs
    obs, _, _, info = env.step(tc("transform_text", text="a <tool_response> b", operation="upper"))
    assert obs == [{"role": "tool", "content": "A <TOOL_RESPONSE> B"}] and info["parse_errors"] == 1
    # a turn with no call on either side of its own result is a final answer, scored as one
    _, r, done, info = env.step(f"{fake}\n<answer>{row['extra_info']['oracle_answer']}</answer>")
    assert done and info["answer_correct"] and info["state_ok"] is False and r == 0.0
    env.close()


def test_a_result_in_call_tags_or_before_an_unwrapped_call_ends_the_turn(pool):
    """A tool result the model wrote itself ends what its turn runs, wherever it sits: inside call tags
    that do not hold a call (hermes), or inside an unclosed <tool_call> before an unwrapped qwen3-xml call;
    both calls after it ran. One inside a parameter of a well-formed unwrapped qwen3-xml call is that
    call's text: that call was refused."""
    from mcp_tools.formats import own_result_at
    note = ("Error: this turn wrote a <tool_response> of its own; results come only from the tools, so "
            "nothing written after it was run")
    fake = "<tool_call><tool_response>42</tool_response></tool_call>"
    calc = "<function=calculate>\n<parameter=expression>\n6*7\n</parameter>\n</function>"
    unwrapped = ("<function=transform_text>\n<parameter=text>\na <tool_response> b\n</parameter>\n"
                 "<parameter=operation>\nupper\n</parameter>\n</function>")
    for family, turn, want in [
            ("hermes", f"{fake}\n{tc('calculate', expression='6*7')}", [note]),
            ("qwen3-xml", f"<tool_call>\n<tool_response>42</tool_response>\n{calc}", [note]),
            ("qwen3-xml", f"<tool_call>\n{calc}\n</tool_call>\n<tool_response>", [note, "42"]),
            ("qwen3-xml", unwrapped, ["A <TOOL_RESPONSE> B"])]:
        env = MCPEnv(pool=pool, tool_format=family)
        env.reset(row_for("42"))
        obs, _, done, info = env.step(turn)
        assert [o["content"] for o in obs] == want and not done, (family, turn)
        assert info["tool_calls"] == want.count("42") + want.count("A <TOOL_RESPONSE> B")
        assert info["parse_errors"] == want.count(note)
        env.close()
    m = "<tool_response>"
    assert own_result_at(f"{fake} x", m) == 0                         # in call tags that hold no call
    assert own_result_at(f"{unwrapped}\n{m}", m, "qwen3-xml") == len(unwrapped) + 1
    assert own_result_at(unwrapped, m, "qwen3-xml") == -1
    assert own_result_at(f"<tool_call>{m}{calc}", m, "qwen3-xml") == len("<tool_call>")
    assert own_result_at(f"<function=f>\n<parameter=x>\n{m}", m, "qwen3-xml") == -1  # unclosed: runs to the end


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(), st.lists(_PIECES, max_size=40).map("".join)))
def test_strict_parser_reads_a_subset(text):
    """Whatever the strict parser reads, the lenient one reads the same way, and more calls only."""
    strict, lenient = parse_tool_calls(text, strict=True), parse_tool_calls(text)
    assert len(lenient[0]) >= len(strict[0]) and len(lenient[0]) + len(lenient[1]) >= len(strict[0])
    assert all(c in lenient[0] for c in strict[0])

# ---------------------------------------------------------------------------------------------
# tasks and rewards


def test_task_generator(rows):
    train, test = rows
    assert len(train) + len(test) == sum(FAMILIES.values()) >= 1000
    from support.rows import validate_row
    for i, r in enumerate(train + test):
        validate_row(r, f"row {i}")
    prompts = [r["prompt"][1]["content"] for r in train + test]
    assert len(set(prompts)) == len(prompts)
    assert {r["extra_info"]["family"] for r in test} == set(FAMILIES)
    again = mcp_rows(seed=0)
    assert again == (train, test) and mcp_rows(seed=1)[0] != train


def test_default_rows_pinned(rows):
    # the default rows are what earlier runs trained and evaluated on: a change to a generator (or
    # to the selection code around mcp_rows) must not move them; update this hash only on purpose.
    # discovery's, sales' and state's rows are pinned apart: adding a family moves no other family's row,
    # and the shop's catalogue numbers (the product ids only state's and sales' oracle calls name) moved
    # only those two
    import hashlib
    from mcp_tools.tasks import select_rows

    def digest(families):
        return hashlib.sha256(json.dumps([select_rows(r, families) for r in rows], sort_keys=True).encode()).hexdigest()
    assert digest([f for f in FAMILIES if f not in ("discovery", "sales", "state")]) == \
        "11d5556dec0d14dfdab1d9c86880b1a65b9145a629b70872c28071e738fcf258"
    assert digest(["discovery"]) == "49a190dbb33fdc315667675c475e7d4ce2b70372a6b403bc2aae720af4140cd0"
    assert digest(["sales"]) == "5782cc484759815942f8cb992467f840f91776ffac03e5b201491ddac5365168"
    assert digest(["state"]) == "0cb0e3040aa799056eeb6504e6245b9b6430363f11ae7087c7b23bef6f89f50e"


def _mcp_tasks_cli():
    from mcp_tools import tasks  # its main() is the command line: python mcp_tools/tasks.py --out ...
    return tasks


def test_select_rows_by_calls_and_family(rows):
    from mcp_tools.tasks import n_calls, select_rows
    train, test = rows
    assert select_rows(train) == train and select_rows(test) == test
    one, many = select_rows(train, max_calls=1), select_rows(train, min_calls=2)
    assert {n_calls(r) for r in one} == {1} and min(n_calls(r) for r in many) == 2
    assert len(one) + len(many) == len(train)  # every oracle makes at least one call
    # the counts the module docstring and the SmolLM2 held-out study in docs/results.md quotes (its
    # families: all but discovery and sales, whose 3-call and 2-3-call rows add 180 + 135 train and
    # 20 + 15 test rows to the >= 2-call ones)
    studied = [f for f in FAMILIES if f not in ("discovery", "sales")]
    assert (len(select_rows(train, studied, max_calls=1)), len(select_rows(train, studied, min_calls=2))) == (1032, 543)
    assert (len(select_rows(test, studied, max_calls=1)), len(select_rows(test, studied, min_calls=2))) == (112, 63)
    assert (len(one), len(many), len(select_rows(test, min_calls=2))) == (1032, 543 + 180 + 135, 63 + 20 + 15)
    assert {n_calls(r) for r in select_rows(train, min_calls=2, max_calls=2)} == {2}
    two = select_rows(train + test, families=["shop", "kb"], min_calls=2)
    assert {r["extra_info"]["family"] for r in two} == {"shop", "kb"} and {n_calls(r) for r in two} == {2}
    # state tasks all change state and then report: >= 2 calls, every one with its check
    state = select_rows(train + test, families=["state"])
    assert state == select_rows(state, min_calls=2)
    assert all(r["reward_spec"]["ground_truth"]["check"] for r in state)
    assert select_rows(train, families=["state"], max_calls=1) == []


def test_mcp_tasks_cli_selection(tmp_path, rows, pool):
    from mcp_tools.tasks import n_calls, select_rows
    from support.rows import load_rows
    cli = _mcp_tasks_cli()
    # a family selection at the default counts is a filter of the default rows (no row moves)
    train, test = cli.main(["--families", "shop,kb", "--min-calls", "2", "--out", str(tmp_path / "a")])
    assert (train, test) == tuple(select_rows(r, ["shop", "kb"], min_calls=2) for r in rows)
    assert load_rows(str(tmp_path / "a" / "train.jsonl")) == train
    # the held-out set of that study: larger counts, >= 2 calls, deterministic
    argv = ["--min-calls", "2", "--families", "multi,shop,kb,state", "--count", "multi=500", "--count", "kb=300",
            "--count", "state=400", "--out", str(tmp_path / "m")]
    train, test = cli.main(argv)
    assert (len(train), len(test)) == (1081, 119)
    assert cli.main(argv) == (train, test)
    assert min(n_calls(r) for r in train + test) == 2
    assert {r["extra_info"]["family"] for r in test} == {"multi", "shop", "kb", "state"}
    prompts = [r["prompt"][1]["content"] for r in train + test]
    assert len(set(prompts)) == len(prompts)
    # a larger count keeps the default tasks, in order: the default multi rows are its first 250
    big = [r for r in test + train if r["extra_info"]["family"] == "multi"]
    big.sort(key=lambda r: r["extra_info"]["index"])
    small = sorted((r for r in rows[0] + rows[1] if r["extra_info"]["family"] == "multi"),
                   key=lambda r: r["extra_info"]["index"])
    assert [r["prompt"] for r in big[:250]] == [r["prompt"] for r in small]
    # the rows read back from the file still score 1 with the oracle, state checks included
    back = load_rows(str(tmp_path / "m" / "test.jsonl"))
    by_family = {}
    for r in back:
        by_family.setdefault((r["extra_info"]["family"], n_calls(r)), r)
    for key, row in by_family.items():
        r, info = _play_oracle(MCPEnv(pool=pool), row)
        assert r == 1.0, (key, info)
    state = next(r for r in back if r["extra_info"]["family"] == "state")
    assert _play_oracle(MCPEnv(pool=pool), state, skip_state_calls=True)[0] == 0.0  # the check still bites


def _play_oracle(env, row, answer=None, skip_state_calls=False):
    env.reset(row)
    for c in row["extra_info"]["oracle_calls"]:
        if skip_state_calls and c["name"] in ("kb_set", "cart_add"):
            continue
        obs, r, done, info = env.step(f"Let me check. {tc(c['name'], **c['arguments'])}")
        assert not done and r == 0.0 and not obs[0]["content"].startswith("Error"), (row, obs)
    answer = row["extra_info"]["oracle_answer"] if answer is None else answer
    obs, r, done, info = env.step(f"The result is <answer>{answer}</answer>.")
    assert done and obs == []
    return r, info


def test_oracle_scores_one_wrong_scores_zero(pool, rows):
    train, test = rows
    by_family = {}
    for r in test + train:
        by_family.setdefault(r["extra_info"]["family"], []).append(r)
    for fam, fam_rows in by_family.items():
        for row in fam_rows[:12]:
            r, info = _play_oracle(MCPEnv(pool=pool), row)
            assert r == 1.0, (fam, row["prompt"][1]["content"], info)
            assert info["invented_calls"] == 0, (fam, row["extra_info"]["oracle_calls"])  # every value looked up
        row = fam_rows[0]
        gt = row["reward_spec"]["ground_truth"]
        wrong = str(float(gt["answer"]) * 1.01 + 1) if gt["type"] == "number" else gt["answer"] + "x"
        assert _play_oracle(MCPEnv(pool=pool), row, answer=wrong)[0] == 0.0, fam
    # state tasks: the right answer without the state change scores 0 (the state check fails)
    for row in by_family["state"][:6]:
        r, info = _play_oracle(MCPEnv(pool=pool), row, skip_state_calls=True)
        assert r == 0.0 and info["answer_correct"] and info["state_ok"] is False
        assert not info["correct"]  # the task's verdict (Episode.passed): a right answer with the wrong state fails


def test_sessions_isolate_concurrent_state(pool, rows):
    """Many cart episodes at once on one server process: each sees only its own cart."""
    state_rows = [r for r in rows[0] if r["extra_info"]["family"] == "state"][:16]
    results = [None] * len(state_rows)

    def play(i):
        results[i] = _play_oracle(MCPEnv(pool=pool), state_rows[i])[0]
    threads = [threading.Thread(target=play, args=(i,)) for i in range(len(state_rows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1.0] * len(state_rows)


def test_close_session_does_not_wait_for_the_drop(pool, monkeypatch):
    """reset(drop=True) is sent, not waited for: a slow drop (0.5 s here) costs close_session nothing,
    and it still reaches the server with the episode's key."""
    import asyncio
    import time
    real, sent = pool._call, []

    async def slow_call(sess, server, tool, arguments, timeout):
        await asyncio.sleep(0.5)
        sent.append((tool, arguments))
        return await real(sess, server, tool, arguments, timeout)

    sess = pool.open_session()
    monkeypatch.setattr(pool, "_call", slow_call)
    t0 = time.perf_counter()
    pool.close_session(sess)
    assert time.perf_counter() - t0 < 0.25 and sent == []
    deadline = time.perf_counter() + 10
    while not sent and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert sent == [("reset", {"session": sess["key"], "drop": True})]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(st.sampled_from(["<answer>", "</answer>", "1", ",", ".", "e9", "-", "999",
                                                      "e999", " ", "x"]), max_size=30).map("".join)))
def test_reward_functions_total(text):
    a = mcp_rewards.tagged_answer(text)
    assert a is None or isinstance(a, str)
    for truth, kind in [("12.5", "number"), ("-3", "number"), ("Tuesday", "text")]:
        assert mcp_rewards.answer_matches(a, truth, kind) in (True, False)


def test_answer_rules():
    m = mcp_rewards.answer_matches
    assert m("$1,234.50", "1234.5", "number") and m("about 1234.5000001 USD", "1234.5", "number")
    assert not m("1234.51", "1234.5", "number") and not m("12 or 13", "12", "number") and not m(None, "1", "number")
    assert m(" Tuesday. ", "tuesday", "text") and not m("Tue", "Tuesday", "text")
    assert mcp_rewards.tagged_answer("<answer>1</answer> no, <answer>2</answer>") == "2"
    assert mcp_rewards.matches_expected({"items": [{"a": 1, "b": 2}], "t": 3.0000000001}, {"items": [{"a": 1}], "t": 3})
    assert not mcp_rewards.matches_expected({"items": []}, {"items": [{"a": 1}]})


def test_a_wrong_answer_no_result_showed_pays_as_a_failed_call(pool):
    """unfounded_answer: a wrong tagged answer that no user turn or tool result showed (a number of that
    value, or the text) pays as a failed call under --tool-error-penalty; one a result showed, a right one,
    or one that speaks of an error (error_answer's) does not; the system prompt's numbers show nothing."""
    env = MCPEnv(pool=pool, error_penalty=0.2, error_cap=2.0)
    row = lambda answer, q="How many rows are in 2024?": {**row_for(answer), "prompt": [  # noqa: E731
        {"role": "system", "content": "Answer like <answer>42</answer>."}, {"role": "user", "content": q}]}
    calc = '<tool_call>{"name": "calculate", "arguments": {"expression": "3*4"}}</tool_call>'
    for truth, turns, guessed in (
            ("7", [calc, "<answer>12</answer>"], 0),       # wrong, but read off the result
            ("7", [calc, "<answer>0</answer>"], 1),        # a guess after a result with no 0 in it
            ("7", ["<answer>0</answer>"], 1),              # a guess with no call
            ("7", ["<answer>42</answer>"], 1),             # the system prompt's example is no result
            ("7", ["<answer>2,024</answer>"], 0),          # the question's own number (commas read as answers are)
            ("7", ["<answer></answer>"], 1),               # an empty answer
            ("12", [calc, "<answer>12.0</answer>"], 0),    # right: nothing to charge
            ("7", [calc, "<answer>error</answer>"], 0)):   # error_answer's, charged once there
        env.reset(row(truth))
        rewards = [env.step(t)[1] for t in turns]
        info = env.info  # the episode's, after its answer
        assert info["unfounded_answer"] == guessed, (truth, turns)
        won = info["correct"]
        assert sum(rewards) == pytest.approx((1.0 if won else 0.0) - 0.2 * (guessed + info["error_answer"])), (truth, turns)
    text = MCPEnv(pool=pool, error_penalty=0.2)
    for answer, guessed in (("Ada Lovelace", 0), ("Grace Hopper", 1)):  # a text: inside the results' text, any case
        text.reset({**row_for("Alan Turing", "text"), "prompt": [{"role": "user", "content": "Who wrote note G? ada lovelace?"}]})
        text.step(f"<answer>{answer}</answer>")
        assert text.info["unfounded_answer"] == guessed
    plain = MCPEnv(pool=pool)  # no penalty: counted, never charged; counted only once an answer came
    plain.reset(row("7"))
    assert "unfounded_answer" not in plain.step(calc)[3]  # (BFCL's verdict sets none: no such metric there)
    _, r, _, info = plain.step("<answer>0</answer>")
    assert r == 0.0 and info["unfounded_answer"] == 1
    assert mcp_rewards.shown_by("1,234.5", "total: 1234.50 USD") and not mcp_rewards.shown_by("", "anything")
    # a JSON row's numbers side by side are not one number with a thousands comma: [[5,1498.15]] shows both
    row_json = '{"columns": ["n", "revenue"], "rows": [[5,1498.15]]}'
    assert mcp_rewards.shown_by("1498.15", row_json) and mcp_rewards.shown_by("5", row_json)
    assert mcp_rewards.shown_by("5,149", row_json) and not mcp_rewards.shown_by("149", row_json)

def test_format_reward(pool):
    env = MCPEnv(pool=pool, format_reward=0.1)
    env.reset(row_for("5"))
    assert env.step("<answer>6</answer>")[1] == pytest.approx(0.1)
    env.reset(row_for("5"))
    assert env.step("<answer>5</answer>")[1] == 1.0  # format_reward is for wrong answers only
    env.reset(row_for("5"))
    assert env.step("5")[1] == 0.0


def test_tool_error_penalty(pool):
    """--tool-error-penalty: each failed call (tool error or parse error) costs the episode that much,
    at most 0.5, and so does a call only the lenient parser reads (doubled braces, counted apart);
    paid on the turn that made it, so a right answer scores 1 - charge, a wrong one 0 - charge, and an
    episode the turn limit cuts off has paid its charge already."""
    env = MCPEnv(pool=pool, error_penalty=0.2, error_cap=0.5)  # a cap of 0.5, not the default 2.0
    env.reset(row_for("4"))
    obs, r1, done, info = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "2+"}}</tool_call>'
                                   '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad</tool_call>')
    assert not done and info["tool_errors"] == 2 and info["parse_errors"] == 1
    assert r1 == pytest.approx(-0.5)  # 3 failures x 0.2, capped at 0.5
    obs, r2, _, info = env.step('<tool_call>\n{{"name": "calculate", "arguments": {"expression": "2+2"}}}\n</tool_call>')
    assert obs[0]["content"] == "4" and info["doubled_braces"] == 1 and info["tool_errors"] == 2
    assert r2 == 0.0  # the cap was reached: nothing more to pay
    assert r1 + r2 + env.step("<answer>4</answer>")[1] == pytest.approx(0.5)
    env.reset(row_for("4"))  # a doubled-brace call runs and costs what a failed call costs
    obs, r1, _, info = env.step('<tool_call>{{"name": "calculate", "arguments": {"expression": "2+2"}}}</tool_call>')
    assert obs[0]["content"] == "4" and info["doubled_braces"] == 1 and info["tool_errors"] == 0
    assert r1 + env.step("<answer>4</answer>")[1] == pytest.approx(0.8)
    env.reset(row_for("4"))  # a good call is free
    _, r1, _, _ = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "2+2"}}</tool_call>')
    assert r1 == 0.0 and env.step("<answer>4</answer>")[1] == 1.0
    env.reset(row_for("4"))
    _, r1, _, _ = env.step('<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    assert r1 + env.step("<answer>5</answer>")[1] == pytest.approx(-0.4)  # a wrong answer pays too, and its guess
    # (no result showed a 5: unfounded_answer, test_a_wrong_answer_no_result_showed_pays_as_a_failed_call)
    # a wrong answer that speaks of an error (the policy stopped at a tool's error) pays as a failed call:
    # giving up after one failure costs what trying once more and failing costs
    give_up = MCPEnv(pool=pool, error_penalty=0.2, error_cap=2.0)
    for answer, total, charged in (("Error: unknown tool 'nope'", -0.4, 1), ("database error", -0.4, 1), ("5", -0.4, 0)):
        give_up.reset(row_for("4"))
        paid = give_up.step(tc("nope"))[1]
        _, r, done, info = give_up.step(f"<answer>{answer}</answer>")
        assert done and paid + r == pytest.approx(total) and info["error_answer"] == charged
        assert info["unfounded_answer"] == 1 - charged  # "5" is a guess instead, charged once all the same
    give_up.reset(row_for("error", "text"))  # a right answer that is the word pays nothing for it
    _, r, _, info = give_up.step("<answer>Error</answer>")
    assert r == 1.0 and info["error_answer"] == 0
    env.reset(row_for("4"))  # an episode of failed calls only (a rollout's turn limit ends it): it has paid
    # (distinct calls: an identical repeat of a failed call pays outside the cap, test_repeated_failed_calls_...)
    paid = sum(env.step(tc("nope", n=k))[1] for k in range(4))
    assert paid == pytest.approx(-0.5)
    # --tool-error-cap 2: a failing episode keeps paying past 0.5; a correct answer gets back all over 0.5
    capped = MCPEnv(pool=pool, error_penalty=0.2, error_cap=2.0)
    for answer, total in (("5", -1.4), ("4", 0.5)):  # the wrong "5" a guess too
        capped.reset(row_for("4"))
        paid = sum(capped.step(tc("nope", n=k))[1] for k in range(6))
        assert paid == pytest.approx(-1.2)
        assert paid + capped.step(f"<answer>{answer}</answer>")[1] == pytest.approx(total)
    plain = MCPEnv(pool=pool)
    plain.reset(row_for("4"))
    assert plain.step('<tool_call>{"name": "nope", "arguments": {}}</tool_call>')[1] == 0.0
    assert plain.step("<answer>4</answer>")[1] == 1.0  # the default: a correct answer is 1, failures free

# ---------------------------------------------------------------------------------------------
# chat template and the rollout


def test_ensure_tool_template(tiny_tokenizer, pool):
    from tests.conftest import make_tiny_tokenizer
    assert ensure_tool_template(tiny_tokenizer, pool.tools) is False  # conftest's template renders tools
    tok = make_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    assert ensure_tool_template(tok, pool.tools) is True
    assert ensure_tool_template(tok, pool.tools) is False  # now it renders them
    msgs = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": tc("calculate", expression="1+1")},
            {"role": "tool", "content": "2"}, {"role": "tool", "content": "3"}]
    text = tok.apply_chat_template(msgs, tools=pool.tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nSYS\n\n# Tools") and '"name": "calculate"' in text
    assert text.count("<|im_start|>system") == 1 and "<tools>" in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n3\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    from rollout import observation_ids  # the rollout's delta rendering must work with our template
    ids = observation_ids(tok, [{"role": "tool", "content": "42"}], pool.tools, tok.eos_token_id)
    assert tok.decode(ids) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    from tests.test_rollout import _observation_ids_reference  # the tool block rendered every time
    for obs in ([{"role": "tool", "content": "42"}], [{"role": "user", "content": "again"}],
                [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]):
        for _ in range(2):  # the probe, then the verdict
            assert observation_ids(tok, obs, pool.tools, tok.eos_token_id) == \
                _observation_ids_reference(tok, obs, pool.tools, tok.eos_token_id)


class ScriptedEngine:
    """Fake engine: turn 1 calls the calculator, turn 2 answers. Decides by looking at the context."""

    def __init__(self, tok):
        self.tok = tok
        self.turns = [tc("calculate", expression="6*7"), "It is <answer>42</answer>"]

    def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
        from rollout import Completion
        out = []
        for p in prompts:
            k = self.tok.decode(p).count("<tool_response>")
            ids = self.tok.encode(self.turns[k], add_special_tokens=False) + [self.tok.eos_token_id]
            out.append([Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")
                        for _ in range(n)])
        return out


def test_multi_turn_mask_covers_only_model_tokens(tiny_tokenizer, pool):
    from rollout import run_episodes
    tok = tiny_tokenizer
    row = row_for("42")
    row["prompt"] = [{"role": "system", "content": "S"}, {"role": "user", "content": "6 times 7?"}]
    eng = ScriptedEngine(tok)
    eps = run_episodes(eng, tok, [row], lambda r: MCPEnv(pool=pool), n=2, temperature=1.0, top_p=1.0,
                       max_tokens=200, max_turns=4, max_context=20000)  # byte tokens: the tool block alone is ~6k
    for ep in eps:
        assert ep.reward == 1.0 and ep.finish_reason == "stop" and ep.info["tool_calls"] == 1
        sampled = [t for t, m in zip(ep.response_ids, ep.response_mask) if m == 1]
        env_tok = [t for t, m in zip(ep.response_ids, ep.response_mask) if m == 0]
        assert tok.decode(sampled) == eng.turns[0] + "<|im_end|>" + eng.turns[1] + "<|im_end|>"
        assert tok.decode(env_tok) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.response_mask) if m == 0)
        # the mask-1 tokens are one contiguous run per turn: [turn 1][observation][turn 2]
        runs = [m for i, m in enumerate(ep.response_mask) if i == 0 or m != ep.response_mask[i - 1]]
        assert runs == [1, 0, 1]

def test_concurrent_resets_open_one_session_each(tiny_tokenizer, pool):
    # run_episodes resets its envs in worker threads: every MCPEnv still gets a session of its own
    from rollout import run_episodes
    keys = []

    class KeyEnv(MCPEnv):
        def reset(self, row):
            out = super().reset(row)
            keys.append(self.sess["key"])
            return out

    eps = run_episodes(ScriptedEngine(tiny_tokenizer), tiny_tokenizer, [row_for("42")], lambda r: KeyEnv(pool=pool),
                       n=16, temperature=1.0, top_p=1.0, max_tokens=200, max_turns=4, max_context=20000, max_workers=16)
    assert len(set(keys)) == 16
    assert all(e.reward == 1.0 and e.finish_reason == "stop" and e.info["tool_calls"] == 1 for e in eps)


class TalkEngine:
    """Fake engine for a two-turn conversation: user turn 0 -> calculate, then "Done." (no call, which
    ends the user turn); user turn 1 ("And the answer?") -> the answer."""

    def __init__(self, tok):
        self.tok = tok
        self.turns = [tc("calculate", expression="6*7"), "Done.", "It is <answer>42</answer>"]

    def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
        from rollout import Completion
        out = []
        for p in prompts:
            ctx = self.tok.decode(p)
            text = self.turns[2 if "And the answer?" in ctx else 1 if "<tool_response>" in ctx else 0]
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append([Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop") for _ in range(n)])
        return out


def test_conversation_sends_the_next_user_turn_as_env_tokens(tiny_tokenizer, pool):
    # a reply without a call ends a user turn; the next one comes back as env tokens (mask 0), and the
    # answer is read after the last one. Without user_turns the same "Done." ends the episode, unanswered
    from rollout import run_episodes
    tok, eng = tiny_tokenizer, TalkEngine(tiny_tokenizer)
    row = row_for("42")
    row["extra_info"] = {"user_turns": [[{"role": "user", "content": "And the answer?"}]]}
    play = lambda r: run_episodes(eng, tok, [r], lambda _: MCPEnv(pool=pool), n=1, temperature=1.0, top_p=1.0,  # noqa: E731
                                  max_tokens=200, max_turns=None, max_context=30000)[0]
    ep = play(row)
    assert ep.reward == 1.0 and ep.finish_reason == "stop" and ep.passed()
    assert ep.info["user_turns"] == 2 and ep.info["user_turns_done"] == 2 and ep.info["turns"] == 3
    sampled = [t for t, m in zip(ep.response_ids, ep.response_mask) if m == 1]
    env_tok = [t for t, m in zip(ep.response_ids, ep.response_mask) if m == 0]
    assert tok.decode(sampled) == "<|im_end|>".join(eng.turns) + "<|im_end|>"
    assert tok.decode(env_tok).endswith("\n<|im_start|>user\nAnd the answer?<|im_end|>\n<|im_start|>assistant\n")
    runs = [m for i, m in enumerate(ep.response_mask) if i == 0 or m != ep.response_mask[i - 1]]
    assert runs == [1, 0, 1, 0, 1]  # [call][tool result][Done.][user turn 1][answer]
    plain = play(row_for("42"))
    assert plain.reward == 0.0 and plain.info["turns"] == 2 and plain.info["user_turns"] == 1


def test_row_tools_new_tools_and_the_turn_limit(pool):
    # extra_info.tools: only these are shown and callable; new_tools shows more from a turn on, their
    # schemas in that turn's message; in a conversation max_turns caps the replies of each user turn
    row = row_for("42")
    row["extra_info"] = {"tools": ["calculate"], "new_tools": {"1": ["kb_get"]},
                         "user_turns": [[{"role": "user", "content": "Now look it up."}]]}
    env = MCPEnv(pool=pool, max_turns=3)
    env.reset(row)
    assert [t["function"]["name"] for t in env.tools] == ["calculate"] and env.max_turns == 6
    obs, r, done, info = env.step(tc("kb_get", key="x"))
    assert not done and "unknown tool 'kb_get'; available tools: calculate" in obs[0]["content"]
    assert info["tool_errors"] == 1
    obs, r, done, info = env.step("Done.")
    assert obs[0]["role"] == "user" and obs[0]["content"].startswith("Now look it up.\n\nNew tools:\n<tools>\n")
    assert json.loads(obs[0]["content"].split("<tools>\n")[1].split("\n</tools>")[0])["function"]["name"] == "kb_get"
    assert [t["function"]["name"] for t in env.tools] == ["calculate", "kb_get"] and info["user_turns_done"] == 1
    obs, r, done, info = env.step(tc("kb_get", key="x"))
    assert "unknown tool" not in obs[0]["content"] and not done
    env.step(tc("calculate", expression="1+1"))
    obs, r, done, info = env.step(tc("calculate", expression="2+2"))  # the turn's third reply still calls
    assert done and info["cut"] == "turn_limit" and info["correct"] is False and obs == []
    env.close()
    bad = row_for("42")
    bad["extra_info"] = {"tools": ["calculate", "no_such_tool"]}
    env.reset(bad)
    assert "unknown tool(s) 'no_such_tool'" in env.step("x")[3]["error"]
    env.close()


def test_row_tools_server_is_left_out_of_the_caps(tmp_path):
    spec = bundled_config(test_tools=True)["mcpServers"]
    (name, s), = spec.items()
    with MCPPool({"mcpServers": {name: {**s, "row_tools": True}}}) as p:
        assert p.tool_chars == 0 and len(p.tools) == 26  # all routable; a row shows its own
        env = MCPEnv(pool=p)
        assert env.reset(row_for("42")) and env.tools == []
        env.close()
    f = tmp_path / "mcp.json"
    f.write_text(json.dumps({"mcpServers": {name: {**s, "row_tools": "yes"}}}))
    with pytest.raises(ValueError, match="row_tools must be true or false"):
        MCPPool(str(f))


class KillingEngine(ScriptedEngine):
    """Turn 1 asks for the server's pid; turn 2 kills that server, then calls a tool on it; after
    an error it calls again; then it answers with the last result."""

    def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
        from rollout import Completion
        out = []
        for p in prompts:
            seen = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", self.tok.decode(p), re.DOTALL)
            if not seen:
                text = tc("pid")
            elif len(seen) == 1:
                if _alive(int(seen[0])):
                    os.kill(int(seen[0]), 9)
                    time.sleep(0.2)
                text = tc("calculate", expression="6*7")
            elif seen[-1].startswith("Error"):
                text = tc("calculate", expression="6*7")
            else:
                text = f"<answer>{seen[-1]}</answer>"
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append([Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")])
        return out


def test_killed_server_mid_rollout_costs_those_episodes_one_error(tiny_tokenizer, pool):
    from rollout import run_episodes
    row = row_for("42")
    kw = dict(temperature=1.0, top_p=1.0, max_tokens=200, max_turns=5, max_context=30000)
    eps = run_episodes(KillingEngine(tiny_tokenizer), tiny_tokenizer, [row, row], lambda r: MCPEnv(pool=pool), n=1, **kw)
    for ep in eps:  # both episodes were pinned to the killed process
        # the first call to reach the dead server sees it exit; a later one finds it restarted;
        # either way the episode reads an error, calls again on the new process, and answers
        assert ep.reward == 1.0 and ep.finish_reason == "stop" and "error" not in ep.info, ep.info
        assert ep.info["tool_errors"] == 1 and ep.info["tool_calls"] == 3

# ---------------------------------------------------------------------------------------------
# other servers, transports, config, cleanup


def test_third_party_time_server_and_name_collisions():
    cfg = {"mcpServers": {"time": TIME_SERVER, "clock": TIME_SERVER}}  # same tools twice -> prefixed
    with MCPPool(cfg) as p:
        names = sorted(t["function"]["name"] for t in p.tools)
        assert names == ["clock__convert_time", "clock__get_current_time", "time__convert_time", "time__get_current_time"]
        pids = p.pids()
        env = MCPEnv(pool=p)
        env.reset(row_for("21:00", "text"))
        obs, r, done, info = env.step(tc("time__convert_time", source_timezone="UTC", time="12:00",
                                         target_timezone="Asia/Tokyo") + tc("clock__get_current_time", timezone="Europe/Paris"))
        assert not done and info["tool_errors"] == 0
        assert json.loads(obs[0]["content"])["target"]["datetime"].endswith("T21:00:00+09:00")
        assert json.loads(obs[1]["content"])["timezone"] == "Europe/Paris"
        assert env.step("<answer>21:00</answer>")[1] == 1.0
    assert pids and not any(_alive(pid) for pid in pids)  # closed: no child left


def test_streamable_http_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, mcp_config.BUNDLED_SERVER, "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:  # wait until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        with MCPPool({"mcpServers": {"shop": {"url": f"http://127.0.0.1:{port}/mcp"}}}) as p:
            env = MCPEnv(pool=p)
            env.reset(row_for("3"))
            obs, *_ = env.step(tc("cart_add", product_id=min(S.PRODUCTS), quantity=3))
            assert json.loads(obs[0]["content"])["items"][0]["quantity"] == 3
            env.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_config_errors(tmp_path):
    f = tmp_path / "mcp.json"
    f.write_text('{"mcpServers": {"x": {"args": []}}}')
    with pytest.raises(ValueError, match="mcp.json: mcpServers.x: needs exactly one of"):
        mcp_config.load_config(str(f))
    f.write_text("{oops")
    with pytest.raises(ValueError, match="mcp.json: bad JSON"):
        mcp_config.load_config(str(f))


def test_children_killed_on_error_exit():
    """A run that dies with an exception (as on Ctrl-C) leaves no server behind (atexit)."""
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {ROOT!r})
        from mcp_tools.pool import MCPPool
        p = MCPPool()
        print(" ".join(map(str, p.pids())), flush=True)
        raise KeyboardInterrupt
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "KeyboardInterrupt" in res.stderr
    pids = [int(x) for x in res.stdout.split()]
    time.sleep(0.2)
    assert pids and not any(_alive(pid) for pid in pids)


def test_bundled_server_sees_our_pythonpath(monkeypatch):
    # the mcp SDK gives stdio servers a minimal environment; packages found through PYTHONPATH
    # (as on a host whose packages are not in the venv) must reach our own server too, or it
    # cannot import mcp
    monkeypatch.setenv("PYTHONPATH", "/some/site")
    assert bundled_config()["mcpServers"]["nanorl"]["env"] == {"PYTHONPATH": "/some/site"}
    monkeypatch.delenv("PYTHONPATH")
    assert "env" not in bundled_config()["mcpServers"]["nanorl"]

# ---------------------------------------------------------------------------------------------
# failures that stay in their episode; per-server config keys (timeout, startup_timeout, tools,
# exclude_tools, isolation)


def test_unencodable_finds_lone_surrogates_anywhere():
    assert mcp_config.unencodable({"a": ["ok", {"b": "fine \u00e9 \U0001f600"}]}) is None
    assert mcp_config.unencodable({"expression": "\ud800"}) == "arguments.expression"
    assert mcp_config.unencodable({"a": ["ok", {"b": "x\udfff"}]}) == "arguments.a[1].b"
    assert mcp_config.unencodable({"a": {"\ud800": 1}}) == "a key of arguments.a"
    deep = "\ud800"
    for _ in range(5000):  # deeper than the recursion limit: the walk is iterative
        deep = [deep]
    assert mcp_config.unencodable({"d": deep}).endswith("[0]")


def test_lone_surrogate_call_stays_in_its_episode(pool):
    # json.loads accepts "\ud800" and a sampling model can write it; sent as is, the mcp SDK's
    # stdio writer fails on UTF-8 encoding and the shared connection dies with every episode on it
    other, env = MCPEnv(pool=pool), MCPEnv(pool=pool)
    other.reset(row_for("1"))
    env.reset(row_for("1"))
    restarts = pool.restarts
    bad = [{"expression": "\ud800"}, {"expression": "1", "x": [{"y": "a\udfffb"}]}, {"\ud800": "1+1"}]
    text = "".join(f"<tool_call>{json.dumps({'name': 'calculate', 'arguments': a})}</tool_call>" for a in bad)
    assert "\\ud800" in text  # json.dumps writes the escape, as a model would
    obs, r, done, info = env.step(text)
    assert not done and "error" not in info and len(obs) == 3
    assert all("not valid Unicode" in o["content"] and "not sent" in o["content"] for o in obs), obs
    assert all(o["content"].encode("utf-8") for o in obs)  # the observation itself is valid text
    assert info["tool_calls"] == 3 and info["tool_errors"] == 3
    # nothing reached the server: both episodes go on, on the same connection
    assert env.step(tc("calculate", expression="2+2"))[0][0]["content"] == "4"
    assert other.step(tc("calculate", expression="6*7"))[0][0]["content"] == "42"
    assert pool.restarts == restarts
    env.close()
    other.close()


def test_failed_call_counts_in_tool_calls(pool):
    env = MCPEnv(pool=pool)
    env.reset(row_for("1"))
    pid = int(env.step(tc("pid"))[0][0]["content"])
    os.kill(pid, 9)
    time.sleep(0.2)
    obs, r, done, info = env.step(tc("calculate", expression="1+1") + tc("calculate", expression="2+2"))
    assert not done and all("was restarted" in o["content"] for o in obs), obs
    assert info["tool_calls"] == 3 and info["tool_errors"] == 2  # pid + the two calls that met a dead server
    assert env.step(tc("calculate", expression="2+2"))[0][0]["content"] == "4"
    env.close()


def _processes_with_cmdline(argv):
    want, out = ("\0".join(argv) + "\0").encode(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read() == want and _alive(int(d)):
                        out.append(int(d))
            except OSError:
                pass
    return out


def test_server_that_never_speaks_mcp_is_named_and_killed(tmp_path):
    f = tmp_path / "mcp.json"
    argv = ["sleep", "987.25"]  # an unusual duration: no other process has this command line
    f.write_text(json.dumps({"mcpServers": {"sleepy": {"command": argv[0], "args": argv[1:], "startup_timeout": 1}}}))
    before = set(_processes_with_cmdline(argv))
    t0 = time.time()
    with pytest.raises(RuntimeError) as e:
        MCPPool(str(f))
    msg = str(e.value)
    assert time.time() - t0 < 15, msg  # startup_timeout (1 s) + the SDK's kill escalation, not ~70 s
    assert "'sleepy'" in msg and "command sleep with 1 argument" in msg and "987.25" not in msg and str(f) in msg and "startup_timeout" in msg, msg
    assert set(_processes_with_cmdline(argv)) <= before  # the child was killed
    f.write_text(json.dumps({"mcpServers": {"ghost": {"command": "no-such-binary-7f3a", "args": ["--x"]}}}))
    with pytest.raises(RuntimeError) as e:
        MCPPool(str(f))
    msg = str(e.value)
    assert "'ghost'" in msg and "command no-such-binary-7f3a with 1 argument" in msg and str(f) in msg and "FileNotFoundError" in msg, msg


def test_server_dead_between_episodes_is_restarted_before_the_next():
    # mcp-server-time has no `reset` tool, so no reset call finds the death at the episode's start
    with MCPPool({"mcpServers": {"time": TIME_SERVER}}) as p:
        env = MCPEnv(pool=p)
        env.reset(row_for("x", "text"))
        assert json.loads(env.step(tc("get_current_time", timezone="UTC"))[0][0]["content"])["timezone"] == "UTC"
        env.step("<answer>x</answer>")
        (pid,) = p.pids()
        os.kill(pid, 9)  # no call in flight
        time.sleep(0.3)
        env = MCPEnv(pool=p)
        env.reset(row_for("x", "text"))
        obs, r, done, info = env.step(tc("get_current_time", timezone="UTC"))
        assert not done and "error" not in info and info["tool_errors"] == 0, (obs, info)
        assert json.loads(obs[0]["content"])["timezone"] == "UTC"
        assert p.restarts == 1 and pid not in p.pids()
        env.close()


def test_per_server_call_timeout():
    spec = bundled_config(test_tools=True)["mcpServers"]["nanorl"]
    with MCPPool({"mcpServers": {"nanorl": {**spec, "timeout": 0.5}}}, call_timeout=10.0) as p:
        env = MCPEnv(pool=p)
        env.reset(row_for("1"))
        t0 = time.time()
        obs, r, done, info = env.step(tc("sleep", seconds=3))
        assert "timed out after 0.5 s" in obs[0]["content"] and info["timeouts"] == 1 and time.time() - t0 < 2.5
        assert p.timeout_for("nanorl") == 0.5 and p.timeout_for("nanorl", 2.0) == 2.0  # MCPEnv(call_timeout=) wins
        env.close()


def test_tool_allow_and_deny_lists(tmp_path):
    cfg = {"mcpServers": {"time": {**TIME_SERVER, "tools": ["get_current_time"]},
                          "clock": {**TIME_SERVER, "exclude_tools": ["get_current_time"]}}}
    with MCPPool(cfg) as p:
        # each server now shows one tool, so there is no collision and no prefix
        assert sorted(t["function"]["name"] for t in p.tools) == ["convert_time", "get_current_time"]
        assert p.route["get_current_time"][0] == "time" and p.route["convert_time"][0] == "clock"
        env = MCPEnv(pool=p)
        env.reset(row_for("x", "text"))
        obs, r, done, info = env.step(tc("time__convert_time", source_timezone="UTC", time="12:00",
                                         target_timezone="Asia/Tokyo") + tc("convert_time", source_timezone="UTC",
                                                                            time="12:00", target_timezone="Asia/Tokyo"))
        assert "unknown tool" in obs[0]["content"]  # filtered out: not callable either
        assert json.loads(obs[1]["content"])["target"]["datetime"].endswith("T21:00:00+09:00")
        env.close()
    f = tmp_path / "mcp.json"
    for key in ("tools", "exclude_tools"):
        f.write_text(json.dumps({"mcpServers": {"time": {**TIME_SERVER, key: ["get_current_time", "rm_rf"]}}}))
        with pytest.raises(ValueError, match=rf"mcp.json: mcpServers.time.{key}: unknown tool\(s\) rm_rf"):
            MCPPool(str(f))


def test_config_keys_checked(tmp_path):
    f = tmp_path / "mcp.json"
    for spec, err in [({"command": "x", "timout": 3}, r"mcpServers.s: unknown key\(s\) timout"),
                      ({"command": "x", "timeout": -1}, r"mcpServers.s.timeout must be a positive number"),
                      ({"command": "x", "startup_timeout": "5"}, r"mcpServers.s.startup_timeout must be a positive"),
                      ({"command": "x", "tools": "calc"}, r"mcpServers.s.tools must be a list of strings"),
                      ({"command": "x", "isolation": "process"}, r"mcpServers.s.isolation must be"),
                      ({"url": "http://127.0.0.1:1/mcp", "isolation": "episode"}, r"mcpServers.s: isolation \"episode\""),
                      ({"command": "x", "env": {"A": 1}}, r"mcpServers.s.env must be an object of strings")]:
        f.write_text(json.dumps({"mcpServers": {"s": spec}}))
        with pytest.raises(ValueError, match="mcp.json: " + err):
            mcp_config.load_config(str(f))


COUNTER_SERVER = '''
import os
from mcp.server import MCPServer

srv = MCPServer("counter", log_level="WARNING")
count = 0


@srv.tool()
def bump() -> str:
    """Add one to this process's counter; returns the count and the pid."""
    global count
    count += 1
    return f"{count} {os.getpid()}"


srv.run()
'''


def test_episode_isolation_starts_each_episode_clean(tmp_path):
    script = tmp_path / "counter.py"
    script.write_text(COUNTER_SERVER)
    spec = {**bundled_config()["mcpServers"]["nanorl"], "args": [str(script)]}  # our python (and PYTHONPATH)
    with MCPPool({"mcpServers": {"shared": spec, "fresh": {**spec, "isolation": "episode"}}}) as p:
        assert sorted(t["function"]["name"] for t in p.tools) == ["fresh__bump", "shared__bump"]
        a, b = MCPEnv(pool=p), MCPEnv(pool=p)
        a.reset(row_for("1"))
        b.reset(row_for("1"))  # two live episodes at once: one process each
        bump = lambda env, tool: env.step(tc(tool))[0][0]["content"].split()  # noqa: E731
        a1, a2, b1 = bump(a, "fresh__bump"), bump(a, "fresh__bump"), bump(b, "fresh__bump")
        assert (a1[0], a2[0], b1[0]) == ("1", "2", "1") and a1[1] == a2[1] != b1[1]
        assert (bump(a, "shared__bump")[0], bump(b, "shared__bump")[0]) == ("1", "2")  # shared: state leaks
        a.close()
        b.close()
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(int(x[1])) for x in (a1, b1)):
            time.sleep(0.05)
        assert not any(_alive(int(x[1])) for x in (a1, b1))  # stopped when their sessions closed
        c = MCPEnv(pool=p)
        c.reset(row_for("1"))
        c1 = bump(c, "fresh__bump")
        assert c1[0] == "1" and c1[1] not in (a1[1], b1[1])
        c.close()
        pids = p.pids()
    assert not any(_alive(pid) for pid in pids)

# ---------------------------------------------------------------------------------------------
# a server that exits mid-call, hangs, stays down, floods or chatters on stdout


def test_server_exit_mid_call_costs_each_episode_one_error(pool):
    # three live episodes on one process: two with a call in flight, one between calls
    a, b, idle = MCPEnv(pool=pool), MCPEnv(pool=pool), MCPEnv(pool=pool)
    for env in (a, b, idle):
        env.reset(row_for("42", check=[{"tool": "cart_view", "expect": {"total_usd": 0}}]))
    pid = int(idle.step(tc("pid"))[0][0]["content"])
    out = {}
    threads = [threading.Thread(target=lambda e=e, k=k: out.update({k: e.step(tc("sleep", seconds=4))}))
               for k, e in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(pid, 9)
    for t in threads:
        t.join()
    for obs, r, done, info in out.values():  # in flight: an error to read, not the end of the episode
        assert not done and "error" not in info and "exited during this call" in obs[0]["content"], (obs, info)
    obs, r, done, info = idle.step(tc("calculate", expression="6*7"))
    assert not done and "restarted since this episode's last call" in obs[0]["content"], obs
    for env in (a, b, idle):  # all go on, on the new process, each in a fresh session of its own
        obs, r, done, info = env.step(tc("calculate", expression="6*7") + tc("pid"))
        assert obs[0]["content"] == "42" and int(obs[1]["content"]) != pid and not done
        assert env.step("<answer>42</answer>")[1] == 1.0  # the state check runs in the new session


def test_runaway_sql_query_is_stopped():
    runaway = "with recursive c(x) as (select 1 union all select x+1 from c) select count(*) from c"
    t0 = time.time()
    with pytest.raises(ValueError, match="ran longer than 0.3 s"):
        S.run_select(runaway, time_limit=0.3)
    assert time.time() - t0 < 2
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(ValueError, match="SQL error: interrupted"):
        S.run_select(runaway, stop=stop)  # what sql_query does when the client cancels the call
    assert time.time() - t0 < 4


def test_sql_query_values_stay_small_and_json():
    # a blob has no JSON form (it crashed the tool), and a 1 GB zeroblob cost the server 1 GB
    assert S.run_select("select randomblob(4), 'x'")["rows"] == [["<blob of 4 bytes>", "x"]]
    with pytest.raises(ValueError, match="SQL error: string or blob too big"):
        S.run_select("select zeroblob(1000000000)")
    assert S.run_select("select printf('%.*c', 100000000, 'x')")["rows"] == [[None]]  # sqlite's answer past the limit
    assert S.run_select("select length(printf('%.*c', 90000, 'x'))")["rows"] == [[90000]]


# Arguments as a model writes them: the types the schema asks for, with extremes (huge ints, inf, nan,
# long or odd strings), plausible values the tools accept, and sometimes a value of the wrong type.
_WORDS = ["2024-02-29", "9999-12-31", "0001-01-01", "kg", "lb", "C", "USD", "JPY", "upper", "reverse", "kitchen",
          "Mug", "capital_of_france", "SELECT * FROM products", "SELECT x'00'", "select sum(total) from orders",
          "sqrt(2) ** 99", "9 ** 9 ** 9", "round(1.5, 10 ** 9)", "s1", ""]
_BY_TYPE = {"string": st.one_of(st.sampled_from(_WORDS), st.text(max_size=40)),
            "integer": st.one_of(st.integers(), st.sampled_from([0, -1, 10 ** 12, -(10 ** 30)])),
            "number": st.one_of(st.floats(), st.integers(-(10 ** 40), 10 ** 40)),
            "boolean": st.booleans()}
_ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10), st.lists(st.integers(), max_size=2))


@functools.cache
def _bundled_server():
    """One in-process server (no stdio) and each tool's argument schemas."""
    srv = server.build_server()
    return srv, {t.name: t.input_schema.get("properties", {}) for t in asyncio.run(srv.list_tools())}


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_tool_answers_or_raises_a_tool_error(data):
    # the bundled server's promise to the model (module docstring): bad arguments get a ToolError it can
    # read, never a crash inside a tool (mcp wraps those as UnexpectedToolError, with no message)
    from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
    server, schemas = _bundled_server()
    name = data.draw(st.sampled_from(sorted(schemas)), label="tool")
    args = {}
    for key, prop in schemas[name].items():  # a tenth of the values may be of any type
        typed = _BY_TYPE[prop.get("type", "string")]
        args[key] = data.draw(st.one_of(typed, _ANY) if data.draw(st.integers(0, 9)) == 0 else typed, label=key)
    try:
        asyncio.run(asyncio.wait_for(server.call_tool(name, args), 30))
    except UnexpectedToolError as e:
        pytest.fail(f"{name}({args!r}) crashed inside the tool: {e.__cause__!r}")
    except ToolError:
        pass


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_timed_out_sql_query_stops_on_the_server(pool):
    env = MCPEnv(pool=pool, call_timeout=1.0)
    env.reset(row_for("1"))
    pid = int(env.step(tc("pid"))[0][0]["content"])
    runaway = "with recursive c(x) as (select 1 union all select x+1 from c) select count(*) from c"
    obs, r, done, info = env.step(tc("sql_query", sql=runaway))
    assert "timed out after 1 s" in obs[0]["content"] and info["timeouts"] == 1 and not done
    time.sleep(0.3)  # the client's cancel reaches the server; the query stops at its next progress check
    cpu = _cpu_seconds(pid)
    time.sleep(1.0)
    assert _cpu_seconds(pid) - cpu < 0.3  # not still counting in a worker thread
    t0 = time.time()
    obs, *_ = env.step(tc("sql_query", sql="SELECT COUNT(*) FROM customers"))
    assert json.loads(obs[0]["content"])["rows"] == [[24]] and time.time() - t0 < 2
    env.close()


def test_server_whose_calls_keep_timing_out_is_restarted():
    # `sleep` ignores the client's cancel and pings still work: only the run of timeouts says it is stuck
    with MCPPool(bundled_config(test_tools=True), call_timeout=10.0) as p:
        env = MCPEnv(pool=p, call_timeout=0.3)
        env.reset(row_for("1"))
        pid = int(env.step(tc("pid"))[0][0]["content"])
        stuck = lambda: env.step(tc("sleep", seconds=4))[0][0]["content"]  # noqa: E731
        assert "timed out" in stuck() and "timed out" in stuck()
        assert env.step(tc("calculate", expression="1+1"))[0][0]["content"] == "2"  # an answer resets the count
        assert "timed out" in stuck() and "timed out" in stuck() and p.restarts == 0
        text = stuck()
        assert "3 calls in a row timed out; MCP server 'nanorl' was restarted" in text and p.restarts == 1, text
        obs, r, done, info = env.step(tc("pid"))  # the episode goes on, on the new process
        assert int(obs[0]["content"]) != pid and not done and info["timeouts"] == 5
        env.close()


FLAKY_SERVER = '''
import os, sys

if os.path.exists(sys.argv[1]):  # the flag: fail to start
    sys.exit(3)
from mcp.server import MCPServer

srv = MCPServer("flaky", log_level="WARNING")


@srv.tool()
def pid() -> int:
    """This process's id."""
    return os.getpid()


srv.run()
'''


def test_server_that_stays_down_fails_episodes_fast_and_backs_off(tmp_path):
    script, flag = tmp_path / "flaky.py", tmp_path / "down"
    script.write_text(FLAKY_SERVER)
    spec = {**bundled_config()["mcpServers"]["nanorl"], "args": [str(script), str(flag)]}
    with MCPPool({"mcpServers": {"flaky": spec}}) as p:
        env = MCPEnv(pool=p)
        env.reset(row_for("1"))
        pid = int(env.step(tc("pid"))[0][0]["content"])
        env.close()
        flag.write_text("1")
        os.kill(pid, 9)
        time.sleep(0.2)
        t0, results = time.time(), []
        for _ in range(8):  # 8 episodes: one or two restart attempts (backoff 1 s, then 2 s), not 8
            env = MCPEnv(pool=p)
            env.reset(row_for("1"))  # never raises
            results.append(env.step(tc("pid")))
            env.close()
        assert time.time() - t0 < 8
        for obs, r, done, info in results:
            assert done and r == 0.0 and obs == [] and "MCP server 'flaky' is down" in info["error"], info
        assert "failed to start: " in results[-1][3]["error"]
        down = p.down()
        assert list(down) == ["flaky"] and down["flaky"]["failures"] in (1, 2) and down["flaky"]["since"] <= time.time()
        assert p.restarts <= 2
        flag.unlink()  # the server can start again: after the backoff the next episode restarts it
        time.sleep(2.1)
        env = MCPEnv(pool=p)
        env.reset(row_for("1"))
        obs, r, done, info = env.step(tc("pid"))
        assert not done and int(obs[0]["content"]) != pid and p.down() == {}
        env.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_bundled(flag, port):
    proc = subprocess.Popen([sys.executable, mcp_config.BUNDLED_SERVER, flag, str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:  # wait until it listens
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the bundled server did not listen")


def test_http_server_down_ends_episodes_as_errors():
    # session-aware (the bundled server) over HTTP: its episodes start with a reset call
    port = _free_port()
    proc = _serve_bundled("--http", port)
    try:
        with MCPPool({"mcpServers": {"shop": {"url": f"http://127.0.0.1:{port}/mcp", "startup_timeout": 3}}}) as p:
            proc.kill()
            proc.wait(10)
            t0 = time.time()
            for _ in range(8):
                env = MCPEnv(pool=p)
                prompt = env.reset(row_for("3"))  # does not raise
                assert prompt == row_for("3")["prompt"]
                obs, r, done, info = env.step(tc("calculate", expression="1+2"))
                assert done and r == 0.0 and "MCP server 'shop' is down" in info["error"], info
                env.close()
            assert time.time() - t0 < 10 and p.down()["shop"]["failures"] >= 1
    finally:
        proc.kill()
        proc.wait(10)


BIG_SERVER = '''
import os
from mcp.server import MCPServer

srv = MCPServer("big", log_level="WARNING")


@srv.tool()
def big(n: int) -> str:
    """n bytes of text."""
    return "x" * n


srv.run()
'''


def test_huge_result_is_truncated_fast(tmp_path):
    script = tmp_path / "big.py"
    script.write_text(BIG_SERVER)
    spec = {**bundled_config()["mcpServers"]["nanorl"], "args": [str(script)]}
    with MCPPool({"mcpServers": {"big": spec}}, call_timeout=30.0) as p:
        env = MCPEnv(pool=p)
        env.reset(row_for("1"))
        t0 = time.time()
        obs, r, done, info = env.step(tc("big", n=20_000_000))
        assert time.time() - t0 < 5  # mcp 2.3's own reader: ~14 s on an idle machine, 30 s (timeout) on a busy one
        text = obs[0]["content"]
        assert not done and info["timeouts"] == 0 and info["tool_errors"] == 1
        assert text.startswith("x" * 4000) and len(text) < 4100
        # the reply holds the text twice (content and structured content): over 40 MB
        m = re.search(r"\n\[\.\.\. truncated: the server's reply was (\d+) bytes\]$", text)
        assert m and int(m.group(1)) > 40_000_000, text[-100:]
        obs, *_ = env.step(tc("big", n=5000))  # below the transport's cap: MCPEnv cuts it for the model
        assert obs[0]["content"] == "x" * 4000 + "\n[... truncated: 5000 characters in all]"
        env.close()


def test_line_splitter_keeps_a_bounded_prefix():
    from mcp_tools import transport
    lines, chunk = transport._Lines(1000), b"y" * 65536
    for _ in range(50):
        assert lines.feed(chunk) == []
        assert sum(map(len, lines.parts)) <= 1000 and len(lines.tail) <= 256
    (head, tail, size), = lines.feed(b'"id": 7}\n')
    assert (len(head), size) == (1000, 50 * 65536 + 8) and tail.endswith(b'"id": 7}')
    head = b'{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"ab\\u00e9c\\u12'
    obj = transport.truncated_response(head, b"", 10**7)
    assert obj["id"] == 7 and obj["result"]["content"][0]["text"].startswith("ab\u00e9c\n[... truncated")
    ts = b'{"result":{"content":[{"type":"text","text":"hi'  # a TypeScript server: the id comes last
    assert transport.truncated_response(ts, b'x"}]},"jsonrpc":"2.0","id":"r-9"}', 10**7)["id"] == "r-9"
    assert transport.truncated_response(b"garbage", b"more", 10**7) is None


def test_junk_on_stdout_is_one_warning(capfd):
    # three lines of junk before the server speaks (mcp 2.3 logged a ~20-line traceback for each)
    spec = bundled_config()["mcpServers"]["nanorl"]
    banner = "echo starting up; echo 'not json'; echo '{\"also\": \"not jsonrpc\"}'; exec "
    cmd = banner + shlex.join([spec["command"], *spec["args"]])
    with MCPPool({"mcpServers": {"chatty": {**spec, "command": "sh", "args": ["-c", cmd]}}}) as p:
        env = MCPEnv(pool=p)
        env.reset(row_for("1"))
        assert env.step(tc("calculate", expression="6*7"))[0][0]["content"] == "42"
        env.close()
    err = capfd.readouterr().err
    assert err.count("[mcp] server 'chatty' wrote a line that is not MCP JSON-RPC") == 1, err
    assert "Traceback" not in err and "starting up" in err


def test_start_failure_is_one_line(tmp_path):
    f = tmp_path / "mcp.json"
    f.write_text(json.dumps({"mcpServers": {"broken": {"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]}}}))
    with pytest.raises(mcp_pool.ServerStartFailed) as e:
        MCPPool(str(f))
    msg = str(e.value)
    assert "\n" not in msg and "'broken'" in msg and str(f) in msg and "with 2 arguments" in msg, msg

# ---------------------------------------------------------------------------------------------
# bad tool calls (the malformed-call corpus), ground truth, state checks


def _nested(depth, inner="1"):
    return "[" * depth + inner + "]" * depth


def test_parser_bounds_depth_and_size():
    ok = f'<tool_call>{{"name": "f", "arguments": {{"a": {_nested(29)}}}}}</tool_call>'  # 31 levels in all
    assert parse_tool_calls(ok)[0] and not parse_tool_calls(ok)[1]
    for depth in (31, 200, 300, 10000):  # 33 levels and up: refused before json.loads
        calls, errors = parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {{"a": {_nested(depth)}}}}}</tool_call>')
        assert calls == [] and "nested deeper than 32 levels" in errors[0]
    deep_obj = '{"k": ' * 40 + "1" + "}" * 40
    assert "nested deeper" in parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {deep_obj}}}</tool_call>')[1][0]
    # brackets inside strings are text, not nesting
    text = json.dumps({"name": "f", "arguments": {"s": "[{" * 500 + '\\"'}})
    assert parse_tool_calls(f"<tool_call>{text}</tool_call>") == ([{"name": "f", "arguments": {"s": "[{" * 500 + '\\"'}}], [])
    # a double-encoded arguments string is bounded the same way: left a string, so an error
    enc = json.dumps({"name": "f", "arguments": json.dumps({"a": json.loads(_nested(40))})})
    assert parse_tool_calls(f"<tool_call>{enc}</tool_call>")[0] == [] 
    long = json.dumps({"name": "f", "arguments": {"s": "a" * 40_000}})
    calls, errors = parse_tool_calls(f"<tool_call>{long}</tool_call>")
    assert calls == [] and "over the limit of 32000" in errors[0]


def test_deep_arguments_are_an_error_at_once(pool):
    env = MCPEnv(pool=pool)
    env.reset(row_for("1"))
    for depth in (200, 300):  # were: the whole tool timeout, and a serialisation error out of step
        t0 = time.time()
        obs, r, done, info = env.step(f'<tool_call>{{"name": "text_stats", "arguments": {{"text": {_nested(depth)}}}}}</tool_call>')
        assert time.time() - t0 < 1 and not done and "nested deeper than 32 levels" in obs[0]["content"]
    assert info["parse_errors"] == 2 and info["tool_calls"] == 0
    env.close()


def test_a_turn_of_many_broken_calls_keeps_its_observations_small(pool):
    """Each parse error was an observation, and each kept a copy of the whole turn as its repeat key: a
    240 KB Mistral turn of 20,000 [TOOL_CALLS] took 4.6 GB. A turn shows at most max_calls_per_turn errors
    (the rest in one line), each cut to max_result_chars, and keys an unread call by a digest."""
    env = MCPEnv(pool=pool, tool_format="mistral", max_result_chars=300)
    env.reset(row_for("1"))
    turn = "[TOOL_CALLS]" * 2_000
    obs, _, done, info = env.step(turn)
    assert not done and len(obs) == 9 and info["parse_errors"] == 9
    assert obs[-1]["content"] == "Error: 1992 more tool calls of this turn were not run (errors not shown)"
    assert sum(len(k[1]) for k, _ in env.keys) < 1_000  # was 9 x 24 KB: now 9 digests
    obs, _, _, info = env.step(turn)  # the same turn again: the same errors, repeats that failed again
    assert info["repeat_failed"] == 9 and env.refailed == 9
    env.close()
    env = MCPEnv(pool=pool, max_result_chars=300)  # hermes: 4,000 bad blocks, and an error over the limit
    env.reset(row_for("1"))
    big = json.dumps({"name": "f", "arguments": {"s": "x" * 1000}})
    obs, *_ = env.step(f"<tool_call>{big}\n{big}</tool_call>" + "<tool_call>{bad}</tool_call>" * 4_000)
    assert len(obs) == 9 and sum(len(o["content"]) for o in obs) < 9 * 400
    assert obs[0]["content"].startswith("Error: tool call 1: 2 JSON objects") and "[... truncated" in obs[0]["content"]
    env.close()


def test_check_ground_truth_corpus():
    check = mcp_rewards.check_ground_truth
    for good in ["42", 42, 1.5, "Tuesday", {"answer": "5"}, {"answer": 5, "type": "number"},
                 {"answer": "118.5", "type": "number", "check": [{"tool": "kb_get", "arguments": {"key": "k"},
                                                                  "expect": "5", "path": ["a", 0]}]}]:
        assert check(good) is None, good
    for bad, why in [(None, "non-empty string or a finite number"), ("", "non-empty"), ("  ", "non-empty"),
                     (True, "non-empty"), ({}, "non-empty"), ({"answer": None}, "non-empty"),
                     (float("nan"), "finite"), ([1], "non-empty"), ({"answer": "six", "type": "number"}, "reads as a number"),
                     ({"answer": 1, "type": "num"}, "type must be"), ({"answer": 1, "chek": []}, "unknown key"),
                     ({"answer": 1, "check": "cart_view"}, "check must be a list"),
                     ({"answer": 1, "check": {"tool": "cart_view", "expect": {}}}, "check must be a list"),
                     ({"answer": 1, "check": [{"tool": "t"}]}, "check[0] must be"),
                     ({"answer": 1, "check": [{"tool": "t", "expect": 1, "path": [True]}]}, "check[0] must be"),
                     ({"answer": 1, "check": [{"tool": "t", "expect": 1, "args": {}}]}, "check[0] must be")]:
        assert why in (check(bad) or ""), (bad, check(bad))
        with pytest.raises(ValueError):
            mcp_rewards.normalise_ground_truth(bad)


def test_bad_ground_truth_is_an_error_episode_not_a_crash(pool):
    for gt in [None, "", True, {}, {"answer": "1", "check": [{"tool": "no_such_tool", "expect": 1}]}]:
        env = MCPEnv(pool=pool)
        row = {**row_for("1"), "reward_spec": {"method": "rule", "ground_truth": gt}}
        assert env.reset(row) == row["prompt"]  # no exception: the batch goes on
        obs, r, done, info = env.step("<answer>None</answer>")
        assert done and r == 0.0 and obs == [] and info["error"].startswith(("invalid reward_spec", "a state check")), info


def test_state_check_values_compare_by_one_rule(pool):
    same = mcp_rewards.same_value
    assert same(5, "5") and same("5", 5) and same(" 5.0 ", 5) and same(5.0000001, 5) and same("abc ", "abc")
    assert same(True, "true") and same(None, "null") and not same("True", True) and not same(1, True)
    assert not same("5", "6") and not same("abc", "ABC") and not same("", 0)
    assert mcp_rewards.matches_expected({"a": [1, "2"]}, {"a": ["1", 2]}) and not mcp_rewards.matches_expected([5], 5)
    for expect in ("5", 5, 5.0, " 5"):  # kb_get returns the text "5", which parses as the number 5
        env = MCPEnv(pool=pool)
        env.reset(row_for("ok", "text", check=[{"tool": "kb_get", "arguments": {"key": "n"}, "expect": expect}]))
        env.step(tc("kb_set", key="n", value="5"))
        assert env.step("<answer>ok</answer>")[1] == 1.0, expect

# ---------------------------------------------------------------------------------------------
# mcpServers files as other clients write them; per-episode copies of file-backed state


def test_config_corpus_other_clients(tmp_path):
    f = tmp_path / "mcp.json"
    cases = [('{"mcpServers": {"a": {"command": "x"}, "a": {"command": "y"}}}', r"key 'a' appears twice"),
             ('{"mcpServers": {"a": {"command": "x", "args": [], "args": ["-v"]}}}', r"key 'args' appears twice"),
             ('{"mcpServers": {"a": {"command": "x", "disabled": "yes"}}}', r"mcpServers.a.disabled must be true or false"),
             ('{"mcpServers": {"a": {"command": "x", "disabled": true}}}', r"every server is disabled"),
             ('{"mcpServers": {"a": {"command": "x", "type": "http"}}}', r"mcpServers.a: type 'http' needs \"url\""),
             ('{"mcpServers": {"a": {"url": "http://h/mcp", "type": "stdio"}}}', r"mcpServers.a: type 'stdio' needs \"command\""),
             ('{"mcpServers": {"a": {"url": "http://h/mcp", "type": "websocket"}}}', r"mcpServers.a.type must be one of"),
             ('{"mcpServers": {"a": {"command": "x", "copy": ["db"]}}}', r"mcpServers.a.copy gives each episode its own files"),
             ('{"mcpServers": {"a": {"command": "x", "isolation": "episode", "copy": ["../db"]}}}', r"mcpServers.a.copy: '../db' must be a path relative"),
             ('{"mcpServers": {"a": {"command": "x", "isolation": "episode", "copy": ["/db"]}}}', r"mcpServers.a.copy: '/db' must be a path relative"),
             ('{"mcpServers": {"a": {"command": "x", "autoApprove": "all"}}}', r"mcpServers.a.autoApprove must be a list of strings")]
    for text, err in cases:
        f.write_text(text)
        with pytest.raises(ValueError, match="mcp.json: " + err):
            mcp_config.load_config(str(f))
    f.write_text(json.dumps({"mcpServers": {
        "off": {"command": "no-such-binary", "disabled": True, "whatever": 1},  # skipped: not even started
        "a": {"command": "x", "type": "stdio", "disabled": False, "autoApprove": ["t"], "alwaysAllow": []},
        "b": {"url": "http://h/mcp", "type": "streamableHttp"}, "c": {"url": "http://h/mcp", "type": "http"},
        "d": {"url": "http://h/mcp", "type": "streamable-http"}, "e": {"url": "http://h/sse", "type": "sse"}}}))
    assert list(mcp_config.load_config(str(f))["mcpServers"]) == ["a", "b", "c", "d", "e"]
    spec = bundled_config()["mcpServers"]["nanorl"]
    with MCPPool({"mcpServers": {"ghost": {"command": "no-such-binary", "disabled": True},
                                 "nanorl": {**spec, "type": "stdio"}}}) as p:
        assert set(p.conns) == {"nanorl"}


def test_sse_server():
    port = _free_port()
    proc = _serve_bundled("--sse", port)
    try:
        with MCPPool({"mcpServers": {"shop": {"url": f"http://127.0.0.1:{port}/sse", "type": "sse"}}}) as p:
            env = MCPEnv(pool=p)
            env.reset(row_for("3"))
            obs, *_ = env.step(tc("cart_add", product_id=min(S.PRODUCTS), quantity=3))
            assert json.loads(obs[0]["content"])["items"][0]["quantity"] == 3
            env.close()
    finally:
        proc.kill()
        proc.wait(10)


FILE_SERVER = '''
from pathlib import Path
from mcp.server import MCPServer

srv = MCPServer("files", log_level="WARNING")


@srv.tool()
def take() -> str:
    """Take one item from the stock kept in ./stock.txt in the working directory; returns what is left."""
    f = Path("stock.txt")
    left = int(f.read_text()) - 1
    f.write_text(str(left))
    return str(left)


srv.run()
'''


def test_episode_isolation_copies_file_backed_state(tmp_path):
    (tmp_path / "files.py").write_text(FILE_SERVER)
    (tmp_path / "stock.txt").write_text("10")
    spec = {**bundled_config()["mcpServers"]["nanorl"], "args": [str(tmp_path / "files.py")], "cwd": str(tmp_path),
            "isolation": "episode"}
    take = lambda env: env.step(tc("take"))[0][0]["content"]  # noqa: E731
    with MCPPool({"mcpServers": {"files": spec}}) as p:  # a fresh process alone: the file is shared
        for want in ("9", "8"):
            env = MCPEnv(pool=p)
            env.reset(row_for("1"))
            assert take(env) == want
            env.close()
    (tmp_path / "stock.txt").write_text("10")
    with MCPPool({"mcpServers": {"files": {**spec, "copy": ["stock.txt"]}}}) as p:
        a, b = MCPEnv(pool=p), MCPEnv(pool=p)
        a.reset(row_for("1"))
        b.reset(row_for("1"))
        assert (take(a), take(a), take(b)) == ("9", "8", "9")  # each episode starts from its own copy
        dirs = [c.workdir for c, _ in (a.sess["pins"]["files"], b.sess["pins"]["files"])]
        assert all(os.path.isfile(os.path.join(d, "stock.txt")) for d in dirs)
        a.close()
        b.close()
        c = MCPEnv(pool=p)
        c.reset(row_for("1"))
        assert take(c) == "9"
        c.close()
    assert (tmp_path / "stock.txt").read_text() == "10"  # the original is never touched
    assert not any(os.path.exists(d) for d in dirs)  # and the copies are gone


def test_tool_error_cap_flag():
    import config
    assert config.parse_args(["--env", "mcp", "--tool-error-cap", "3"]).tool_error_cap == 3.0
    assert config.parse_args(["--env", "mcp"]).tool_error_cap == 2.0  # the default: ten failed calls at 0.2
    with pytest.raises(SystemExit):
        config.parse_args(["--env", "mcp", "--tool-error-cap", "-1"])


# ---- HTTP restarts, JSON-RPC errors, bounded HTTP replies, redaction, tool tables

def test_http_server_restart_is_reconnected_on_the_same_url():
    port = _free_port()
    proc = _serve_bundled("--http", port)
    try:
        with MCPPool({"mcpServers": {"shop": {"url": f"http://127.0.0.1:{port}/mcp", "startup_timeout": 5}}}) as p:
            env = MCPEnv(pool=p)
            env.reset(row_for("3"))
            obs, *_ = env.step(tc("calculate", expression="1+2"))
            assert obs[0]["content"] == "3"
            proc.kill()
            proc.wait(10)
            proc = _serve_bundled("--http", port)  # same url, a new process: the old session id is unknown there
            obs, r, done, info = env.step(tc("calculate", expression="2+2"))  # lost with the old session
            assert not done and "restarted" in obs[0]["content"], (obs, info)  # the episode reads it and goes on
            obs, r, done, info = env.step(tc("calculate", expression="2+3"))
            assert not done and obs[0]["content"] == "5" and "error" not in info, (obs, info)
            env.close()
            for _ in range(3):  # later episodes run on the restarted server
                env = MCPEnv(pool=p)
                env.reset(row_for("3"))
                obs, r, done, info = env.step(tc("calculate", expression="2+5"))
                assert not done and obs[0]["content"] == "7" and "error" not in info, (obs, info)
                env.close()
            assert not p.down()
    finally:
        proc.kill()
        proc.wait(10)


RPC_ERROR_SERVER = r'''
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m:
        continue
    if m["method"] == "initialize":
        r = {"protocolVersion": m["params"]["protocolVersion"], "capabilities": {"tools": {}},
             "serverInfo": {"name": "rpc", "version": "1"}}
    elif m["method"] == "tools/list":
        r = {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in ("busy", "slow", "pid")]}
    elif m["method"] == "tools/call" and m["params"]["name"] != "pid":
        code = -32000 if m["params"]["name"] == "busy" else -32001
        print(json.dumps({"jsonrpc": "2.0", "id": m["id"], "error": {"code": code, "message": "server says " + str(code)}}), flush=True)
        continue
    elif m["method"] == "tools/call":
        r = {"content": [{"type": "text", "text": str(os.getpid())}]}
    else:
        r = {}
    print(json.dumps({"jsonrpc": "2.0", "id": m["id"], "result": r}), flush=True)
'''


def test_jsonrpc_error_responses_are_tool_errors_not_a_dead_server(tmp_path):
    script = tmp_path / "rpc.py"
    script.write_text(RPC_ERROR_SERVER)
    with MCPPool({"mcpServers": {"rpc": {"command": sys.executable, "args": [str(script)]}}}) as p:
        sess = p.open_session()
        pid = p.call(sess, "pid", {})[0]
        for tool, code in [("busy", "-32000"), ("slow", "-32001")] * 3:
            text, is_error, timed_out, _ = p.call(sess, tool, {})
            assert is_error and not timed_out and text == f"Error: server says {code}", text
        assert p.call(sess, "pid", {}) [:2] == (pid, False) and p.restarts == 0


HTTP_BIG_SERVER = '''
import sys
from mcp.server import MCPServer

srv = MCPServer("big", log_level="WARNING")


@srv.tool()
def big(n: int) -> str:
    """n bytes of text."""
    return "x" * n


srv.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]), json_response=sys.argv[2] == "json")
'''


def _rss_peak_mb():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024


@pytest.mark.parametrize("mode", ["json", "sse"])
def test_http_huge_result_is_cut_without_a_restart(tmp_path, mode):
    script = tmp_path / "big_http.py"
    script.write_text(HTTP_BIG_SERVER)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(port), mode], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        with MCPPool({"mcpServers": {"big": {"url": f"http://127.0.0.1:{port}/mcp"}}}) as p:
            sess = p.open_session()
            assert p.call(sess, "big", {"n": 10})[:2] == ("x" * 10, False)
            before = _rss_peak_mb()
            text, is_error, timed_out, _ = p.call(sess, "big", {"n": 20_000_000})
            grew = _rss_peak_mb() - before
            assert is_error and not timed_out and text.startswith("x" * 4000) and len(text) < 20_000, len(text)
            assert re.search(r"\[\.\.\. truncated: the server's reply was \d+ bytes\]$", text), text[-100:]
            assert grew < 100, grew  # the 40 MB reply (its text twice) was never held whole
            assert p.call(sess, "big", {"n": 10})[:2] == ("x" * 10, False) and p.restarts == 0
    finally:
        proc.kill()
        proc.wait(10)


def test_secrets_in_a_server_spec_are_redacted_from_errors(tmp_path):
    from mcp_tools.conn import Conn
    secrets = ["s3cr3t-arg-1", "s3cr3t-arg-2", "s3cr3t-env-3", "s3cr3t-url-4", "s3cr3t-url-5", "s3cr3t-arg-6"]
    specs = {
        "cmd": {"command": str(tmp_path / "no-such-server"), "env": {"GITHUB_TOKEN": secrets[2]},
                "args": ["--token", secrets[0], "API_KEY=" + secrets[1], "--api-key=" + secrets[5],
                         "--from-env", secrets[2], "plain"]},
        "web": {"url": f"http://me:{secrets[3]}@127.0.0.1:{_free_port()}/mcp?api_key={secrets[4]}&x=1",
                "startup_timeout": 3},
    }
    for name, spec in specs.items():
        with pytest.raises(mcp_pool.ServerStartFailed) as e:
            MCPPool({"mcpServers": {name: spec}})
        msg = str(e.value)
        assert name in msg and not any(s in msg for s in secrets), msg
        d = Conn(name, spec, 0).describe()  # the program and the count of its arguments, or the URL without its secrets
        assert not any(s in d for s in secrets) and "plain" not in d and "x=1" not in d, d


TOOLS_SERVER = '''
import sys
from mcp.server import MCPServer

srv = MCPServer("t", log_level="WARNING")
for n in sys.argv[1:]:
    if n.startswith("big"):  # a tools/list over 1 MiB
        for i in range(40):
            srv.tool(name=f"t{i}", description="d" * 30000)(lambda: "x")
    else:
        srv.tool(name=n)(lambda: "ok " + n)
srv.run()
'''


def test_tool_table_errors_name_the_server(tmp_path):
    script = tmp_path / "t.py"
    script.write_text(TOOLS_SERVER)

    def srv(*names, **kw):
        return {**bundled_config()["mcpServers"]["nanorl"], "args": [str(script), *names], **kw}
    with pytest.raises(ValueError, match=r"mcp config: mcpServers.a: .*no tool"):
        MCPPool({"mcpServers": {"a": srv("one", tools=[])}})
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"mcpServers": {"a": srv("one", exclude_tools=["one"])}}))
    with pytest.raises(ValueError, match=r"cfg.json: mcpServers.a: .*no tool"):
        MCPPool(str(cfg))
    # b's tool "a__x" and a's "x" (shared with b, so shown as "a__x") would be one name
    with pytest.raises(ValueError, match=r"'a__x'.*servers 'a' and 'b'|'a__x'.*servers 'b' and 'a'"):
        MCPPool({"mcpServers": {"a": srv("x"), "b": srv("x", "a__x")}})
    with pytest.raises(mcp_pool.ServerStartFailed) as e:
        MCPPool({"mcpServers": {"big": srv("big")}})
    assert "'big'" in str(e.value) and "1 MiB" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_embedded_text_resource_is_shown():
    from mcp_types import CallToolResult, EmbeddedResource, TextResourceContents
    r = CallToolResult(content=[EmbeddedResource(type="resource", resource=TextResourceContents(
        uri="file:///a.txt", text="the resource's text"))])
    assert "the resource's text" in mcp_pool._result_text(r)


def test_a_down_server_fails_only_episodes_that_use_it():
    port = _free_port()
    proc = _serve_bundled("--http", port)
    cfg = {"mcpServers": {"shop": {"url": f"http://127.0.0.1:{port}/mcp", "startup_timeout": 3},
                          "local": bundled_config()["mcpServers"]["nanorl"]}}
    try:
        with MCPPool(cfg) as p:
            proc.kill()
            proc.wait(10)
            for _ in range(3):
                env = MCPEnv(pool=p)
                env.reset(row_for("3"))
                obs, r, done, info = env.step(tc("local__calculate", expression="1+2"))
                assert not done and obs[0]["content"] == "3" and "error" not in info, (obs, info)
                obs, r, done, info = env.step(tc("shop__calculate", expression="1+2"))
                assert done and "MCP server 'shop' is down" in info["error"], info
    finally:
        proc.kill()
        proc.wait(10)


def test_concurrent_timeouts_print_one_restart_line(capfd):
    spec = {**bundled_config()["mcpServers"]["nanorl"], "args": [mcp_config.BUNDLED_SERVER, "--test-tools"]}
    with MCPPool({"mcpServers": {"s": spec}}, call_timeout=0.5, max_timeouts=1) as p:
        sessions = [p.open_session() for _ in range(6)]
        futs = [p.submit(s, "sleep", {"seconds": 30}) for s in sessions]
        for f in futs:
            f.result(60)
        assert p.restarts == 1
    assert capfd.readouterr().err.count("restarting it") == 1


# ---- the bundled server under runaway queries, sane timeouts, untrusted arguments, the session hook

RUNAWAY_SQL = "with recursive c(x) as (select 1 union all select x+1 from c) select count(*) from c"


def test_runaway_sql_queries_neither_starve_other_tools_nor_restart_the_server():
    # 64 endless queries from several episodes (more than the 40 worker threads every sync tool
    # shares), with a 4 s tool timeout: each must end as a tool error before the client gives up,
    # other tools must answer meanwhile, and the server must keep its process and every session
    with MCPPool(bundled_config(test_tools=True), call_timeout=4.0) as pool:
        sessions = [pool.open_session() for _ in range(8)]
        pid = pool.call(sessions[0], "pid", {})[0]
        assert pool.call(sessions[0], "kb_set", {"key": "mine", "value": "kept"})[0] == "stored mine"
        t0 = time.monotonic()
        runaway = [pool.submit(sessions[i % 8], "sql_query", {"sql": RUNAWAY_SQL}) for i in range(64)]
        time.sleep(0.5)
        text, is_error, timed_out, seconds = pool.call(sessions[1], "calculate", {"expression": "6*7"})
        assert (text, is_error, timed_out) == ("42", False, False) and seconds < 2.0, (text, seconds)
        # a sane query still answers (or says the server is busy) within the time limit, never a timeout
        text, is_error, timed_out, _ = pool.call(sessions[2], "sql_query", {"sql": "select count(*) from products"})
        assert not timed_out and (text == '{"columns":["count(*)"],"rows":[[30]],"truncated":false}' or "busy" in text)
        done, _ = wait(runaway, timeout=30)
        results = [f.result() for f in done]
        assert len(results) == 64 and time.monotonic() - t0 < S.SQL_TIME_LIMIT + 3
        for text, is_error, timed_out, _ in results:
            assert is_error and not timed_out and ("ran longer than" in text or "busy" in text), text
        assert pool.call(sessions[0], "pid", {})[0] == pid  # no restart
        assert pool.call(sessions[0], "kb_get", {"key": "mine"})[0] == "kept"  # no state lost
        for s in sessions:
            pool.close_session(s)


def test_one_episodes_three_runaway_queries_under_a_short_timeout_keep_the_server():
    # the issue's case: --tool-timeout 5 (here the server's own "timeout" key, 4 s) and one
    # episode's 3 runaway queries in one turn: 3 timeouts in a row restarted the server
    spec = bundled_config(test_tools=True)
    spec["mcpServers"]["nanorl"]["timeout"] = 4.0
    with MCPPool(spec) as pool:
        sess = pool.open_session()
        pid = pool.call(sess, "pid", {})[0]
        futs = [pool.submit(sess, "sql_query", {"sql": RUNAWAY_SQL}) for _ in range(3)]
        for f in futs:
            text, is_error, timed_out, _ = f.result(30)
            assert is_error and not timed_out and "ran longer than" in text, text
        assert pool.call(sess, "pid", {})[0] == pid
        pool.close_session(sess)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), -float("inf"), 1e10, 1e300, True, "5"])
@pytest.mark.parametrize("key", ["timeout", "startup_timeout"])
def test_config_timeouts_must_be_sane_seconds(key, value):
    cfg = {"mcpServers": {"srv": {"command": "x", key: value}}}
    with pytest.raises(ValueError, match=rf"^servers\.json: mcpServers\.srv\.{key} must be .*seconds"):
        mcp_config.check_config(cfg, where="servers.json")
    for ok in (0.5, 30, 86400):
        assert mcp_config.check_config({"mcpServers": {"srv": {"command": "x", key: ok}}})


def test_config_timeout_of_1e10_is_refused_before_any_call(tmp_path):
    # a per-server timeout >= 1e10 got past the check and raised OverflowError inside the call
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"mcpServers": {"nanorl": {**bundled_config()["mcpServers"]["nanorl"], "timeout": 1e10}}}))
    with pytest.raises(ValueError, match="servers.json: mcpServers.nanorl.timeout"):
        MCPPool(str(path))


@pytest.mark.parametrize("arguments, where", [
    ('{"value": NaN, "from_unit": "m", "to_unit": "km"}', "value"),
    ('{"value": Infinity, "from_unit": "m", "to_unit": "km"}', "value"),
    ('{"value": -Infinity, "from_unit": "m", "to_unit": "km"}', "value"),
    ('{"value": 1e999, "from_unit": "m", "to_unit": "km"}', "value"),  # a float literal json reads as inf
    ('{"a": {"b": [1, 2, NaN]}}', "a.b[2]"),
])
def test_nan_and_infinity_in_arguments_are_refused(arguments, where):
    # json.loads accepts NaN and Infinity, JSON does not: over the wire they arrived as null
    for text in (f'<tool_call>{{"name": "convert_units", "arguments": {arguments}}}</tool_call>',
                 f'<tool_call>{{"name": "convert_units", "arguments": {json.dumps(arguments)}}}</tool_call>'):
        calls, errors = parse_tool_calls(text)
        assert calls == [] and len(errors) == 1, (calls, errors)
        assert f"arguments.{where}" in errors[0] and "not a JSON number" in errors[0], errors
    calls, errors = parse_tool_calls('<tool_call>{"name": "calculate", "arguments": {"x": 1e308, "s": "NaN"}}</tool_call>')
    assert errors == [] and calls[0]["arguments"] == {"x": 1e308, "s": "NaN"} and math.isfinite(calls[0]["arguments"]["x"])


_RESET_SERVER = textwrap.dedent('''
    """A third-party server whose tool happens to be called reset and take a session: a game."""
    from mcp.server import MCPServer

    srv = MCPServer("game", log_level="WARNING")
    calls = []

    @srv.tool()
    def reset(session: str) -> str:
        """Restart the game saved under this name."""
        calls.append(session)
        return "ok"

    @srv.tool()
    def reset_count() -> int:
        """How many times reset ran."""
        return len(calls)

    srv.run()
''')


def test_a_third_party_reset_tool_is_never_called_by_the_pool(tmp_path):
    # only the bundled server's reset is the session hook (it carries config.SESSION_HOOK_META);
    # a game's reset(session) was called twice per episode (open and close) and hidden from the model
    script = tmp_path / "game.py"
    script.write_text(_RESET_SERVER)
    cfg = {"mcpServers": {"game": {"command": sys.executable, "args": [str(script)]}, **bundled_config()["mcpServers"]}}
    with MCPPool(cfg, call_timeout=10.0) as pool:
        assert pool.session_aware == {"game": False, "nanorl": True}
        assert "reset" in pool.route and "reset_count" in pool.route  # an ordinary tool the model may call
        for _ in range(2):
            sess = pool.open_session()
            pool.close_session(sess)
        sess = pool.open_session()
        assert pool.call(sess, "reset_count", {})[0] == "0"
        assert pool.call(sess, "reset", {"session": "level-1"})[0] == "ok"  # the model's own call goes through
        assert pool.call(sess, "reset_count", {})[0] == "1"
        pool.close_session(sess)


def test_the_bundled_reset_carries_the_session_hook_marker():
    import asyncio
    from mcp import Client
    srv = server.build_server()

    async def tools():
        async with Client(srv) as c:
            return {t.name: t for t in (await c.list_tools()).tools}
    ts = asyncio.run(tools())
    assert mcp_config.session_hook(ts["reset"]) and not any(mcp_config.session_hook(t) for n, t in ts.items() if n != "reset")


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), 1e10])
def test_env_call_timeout_must_be_sane_seconds(value):
    from mcp_tools.env import MCPEnv
    with pytest.raises(ValueError, match="call_timeout"):
        MCPEnv(pool=object(), call_timeout=value)

# ---------------------------------------------------------------------------------------------
# tool-call formats per model family (mcp_tools/formats.py): chat-template fixtures written here,
# each rendering its family's documented call format; small tokenizers with the family's specials

from mcp_tools import formats  # noqa: E402

# Qwen3-Coder / Qwen3.5: XML calls, tool results as <tool_response> blocks in one user turn. Values:
# objects and lists as JSON, scalars with Jinja's `| string` (so True, not true), as Qwen's own does.
QWEN3_XML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for t in tools %}{%- set f = t.function if t.function is defined else t %}"
    "{{- '\\n<function>\\n<name>' + f.name + '</name>\\n<parameters>' + (f.parameters | tojson) + '</parameters>\\n</function>' }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function reply in this format:\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for tc in (m.tool_calls or []) %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '\\n<tool_call>\\n<function=' + f.name + '>\\n' }}"
    "{%- for k, v in f.arguments | items %}"
    "{%- set v = v | tojson if v is mapping or (v is sequence and v is not string) else v | string %}"
    "{{- '<parameter=' + k + '>\\n' + v + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1 / 3.2: tools in the first user turn, a call is the whole turn as JSON with "parameters",
# results come back as role ipython. Llama's own template refuses more than one call per message.
LLAMA3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set msgs = messages[1:] %}"
    "{%- else %}{%- set sys = '' %}{%- set msgs = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n\\n' + sys + '<|eot_id|>' }}"
    "{%- for m in msgs %}"
    "{%- if m.role == 'user' and loop.first and tools %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON for a "
    "function call with its proper arguments.\\n\\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}. Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- (t | tojson) + '\\n\\n' }}{%- endfor %}{{- m.content + '<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.tool_calls | length != 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set f = m.tool_calls[0].function if m.tool_calls[0].function is defined else m.tool_calls[0] %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + f.name + '\", \"parameters\": ' }}"
    "{{- (f.arguments | tojson) + '}<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Mistral (v3 tokenizers, e.g. Mistral-7B-Instruct-v0.3): tools before the last user turn, the system
# prompt in front of it, calls as [TOOL_CALLS] [JSON list]</s>. Strict like Mistral's own: every call's
# id and every tool result's tool_call_id must be 9 alphanumerics, else raise_exception.
MISTRAL_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set msgs = messages[1:] %}"
    "{%- else %}{%- set msgs = messages %}{%- endif %}"
    "{%- set users = msgs | selectattr('role', 'equalto', 'user') | list %}"
    "{%- for m in msgs %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and m == users[-1] %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if sys is defined and m == users[-1] %}{{- '[INST] ' + sys + '\\n\\n' + m.content + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + m.content + '[/INST]' }}{%- endif %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tc in m.tool_calls %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' + (f.arguments | tojson) }}"
    "{%- if tc.id is not string or tc.id | length != 9 or not tc.id.isalnum() %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": ' + (tc.id | tojson) + '}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']</s>' }}"
    "{%- elif m.role == 'assistant' %}{{- ' ' + m.content + '</s>' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id is not string or m.tool_call_id | length != 9 or not m.tool_call_id.isalnum() %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + (m.content | tojson) + ', \"call_id\": ' + (m.tool_call_id | tojson) + '}[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)

# family -> (template, its special tokens (added to the tiny tokenizer as the real ones are), the text
# a tool result is rendered after). hermes uses the repo's own Qwen2.5-layout template.
FAMILY_FIXTURES = {
    "hermes": (formats.TOOL_CHAT_TEMPLATE, [], "<tool_response>"),
    "qwen3-xml": (QWEN3_XML_TEMPLATE, [], "<tool_response>"),
    "llama3-json": (LLAMA3_TEMPLATE, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                                      "<|python_tag|>"], "ipython<|end_header_id|>"),
    "mistral": (MISTRAL_TEMPLATE, ["</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                   "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]"],
                "[TOOL_RESULTS]"),
}


@functools.lru_cache(maxsize=None)
def family_tokenizer(family):
    from tests.conftest import make_tiny_tokenizer
    tok = make_tiny_tokenizer()
    template, specials, _ = FAMILY_FIXTURES[family]
    if specials:
        tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    return tok


def render_calls(tok, calls, tools=None) -> str:
    """The assistant turn the template renders for these calls, up to its end-of-turn token."""
    from rollout import end_of_turn_id
    msgs = [{"role": "user", "content": "q"}]
    prefix = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    tool_calls = [{"type": "function", "id": f"call{j:05d}", "function": {"name": c["name"], "arguments": c["arguments"]}}
                  for j, c in enumerate(calls)]  # 9-character ids: the strict Mistral fixture demands them
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "", "tool_calls": tool_calls}],
                                   tools=tools, tokenize=False)
    assert full.startswith(prefix)
    turn = full[len(prefix):]
    return turn[:turn.rindex(tok.decode([end_of_turn_id(tok)]))]


def as_env_sees(tok, text) -> str:
    """text as MCPEnv gets it from rollout: sampled ids decoded without special tokens."""
    from rollout import decode_many
    return decode_many(tok, [tok.encode(text, add_special_tokens=False)])[0]


def test_format_fixtures_render_a_conversation_the_parser_reads_back(pool):
    calls = [{"name": "convert_units", "arguments": {"value": 12.5, "from_unit": "km", "to_unit": "mi"}},
             {"name": "kb_set", "arguments": {"key": "price:x", "value": "118.5"}},  # a string that reads as a number
             {"name": "search_products", "arguments": {"query": "Desk Lamp", "tags": ["a", 1, [True, None]], "n": 3}}]
    for family in FORMATS_UNDER_TEST:
        tok = family_tokenizer(family)
        fmt = formats.FORMATS[family]
        per_turn = [[c] for c in calls] if family == "llama3-json" else [calls]  # Llama: one call a message
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        for turn_calls in per_turn:
            tool_calls = [{"type": "function", "id": "abcdefgh1", "function": c} for c in turn_calls]
            msgs += [{"role": "assistant", "content": "", "tool_calls": tool_calls}]
            msgs += [{"role": "tool", "content": f"result {c['name']}", "tool_call_id": "abcdefgh1"} for c in turn_calls]
        text = tok.apply_chat_template(msgs, tools=pool.tools, tokenize=False, add_generation_prompt=True)
        assert all(f"result {c['name']}" in text for c in calls) and FAMILY_FIXTURES[family][2] in text
        assert formats.detect(tok.chat_template) == family
        for turn_calls in per_turn:
            turn = render_calls(tok, turn_calls, pool.tools)
            for seen in (turn, as_env_sees(tok, turn)):  # with and without the special tokens
                assert fmt.parse(seen, tools=pool.tools) == (turn_calls, []), (family, seen)


FORMATS_UNDER_TEST = ["hermes", "qwen3-xml", "llama3-json", "mistral"]


def test_detect_families():
    from tests.conftest import CHATML_TEMPLATE
    assert sorted(formats.FORMATS) == sorted(FORMATS_UNDER_TEST)
    for family, (template, _, _) in FAMILY_FIXTURES.items():
        assert formats.detect(template) == family
    assert formats.detect(formats.TOOL_CHAT_TEMPLATE) == "hermes"  # the real Qwen2.5-style template
    assert formats.detect(CHATML_TEMPLATE) == "hermes" and formats.detect(None) == "hermes"
    assert formats.detect("... {{- '<|python_tag|>' + tool_call.name }} ...") == "llama3-json"
    assert formats.FORMATS["llama3-json"].stop_strings == ["<|eom_id|>"]
    assert all(formats.FORMATS[f].stop_strings == [] for f in ("hermes", "qwen3-xml", "mistral"))


_SAFE_TEXT = "abcxyzAB _-.,:'"  # no word json.loads reads (true, null, NaN, ...), no digits: qwen3-xml's values
_ANY_TEXT = _SAFE_TEXT + '0123456789"\\{}\n\té€'
_KEYS = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)


def _values(text_alphabet):
    scalars = st.one_of(st.text(alphabet=text_alphabet, max_size=12), st.integers(-10**18, 10**18),
                        st.floats(allow_nan=False, allow_infinity=False), st.booleans())
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=8)


def _calls(text_alphabet, max_calls=3):
    call = st.fixed_dictionaries({"name": st.text(alphabet="abcxyz_", min_size=1, max_size=8),
                                  "arguments": st.dictionaries(_KEYS, _values(text_alphabet), max_size=4)})
    return st.lists(call, min_size=1, max_size=max_calls)


@pytest.mark.parametrize("family", FORMATS_UNDER_TEST)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_format_round_trip(family, data):
    """Random calls rendered by the family's template parse back to the same names and arguments,
    with and without the special tokens (rollout decodes without them)."""
    tok, fmt = family_tokenizer(family), formats.FORMATS[family]
    calls = data.draw(_calls(_SAFE_TEXT if family == "qwen3-xml" else _ANY_TEXT,
                             max_calls=1 if family == "llama3-json" else 3))
    text = render_calls(tok, calls)
    for seen in (text, as_env_sees(tok, text), f"Let me look that up.\n{text}" if family in ("hermes", "qwen3-xml") else text):
        assert fmt.parse(seen) == (calls, []), (family, seen)


@settings(max_examples=100, deadline=None)
@given(_calls(_ANY_TEXT))
def test_format_round_trip_parallel_and_newer_forms(calls):
    """Forms the fixtures do not render: several Llama calls joined by ';' or newlines (vLLM's
    llama3_json reads them), after <|python_tag|>; Mistral's [TOOL_CALLS]NAME[ARGS]{...} (v11+)."""
    objs = [json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls]
    for text in ("; ".join(objs), "\n".join(objs), "<|python_tag|>" + ";".join(objs)):
        assert formats.parse_llama3_json(text) == (calls, [])
    text = "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in calls)
    assert formats.parse_mistral(text) == (calls, [])
    text = "".join(f"[TOOL_CALLS]{c['name']}[CALL_ID]a1b2c3d4e[ARGS]{json.dumps(c['arguments'])}" for c in calls)
    assert formats.parse_mistral(text) == (calls, [])


_FORMAT_PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<function=", "<function=f>", "</function>",
                                  "<parameter=", "<parameter=x>", "</parameter>", "[TOOL_CALLS]", "[ARGS]",
                                  "[CALL_ID]", "<|python_tag|>", "{", "}", "[", "]", '"name"', '"arguments"',
                                  '"parameters"', ":", ",", ";", '"f"', "null", "NaN", "1e999", "True", "x", " ",
                                  "\n", '"', ">"])


@pytest.mark.parametrize("family", FORMATS_UNDER_TEST)
@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(_FORMAT_PIECES, max_size=40).map("".join)))
def test_format_parsers_total(family, text):
    fmt = formats.FORMATS[family]
    calls, errors = fmt.parse(text)
    assert isinstance(calls, list) and isinstance(errors, list)
    assert all(isinstance(c["name"], str) and isinstance(c["arguments"], dict) for c in calls)
    assert all(formats.nonfinite(c["arguments"]) is None for c in calls)
    assert all(isinstance(e, str) for e in errors)
    starts = {"llama3-json": ("{", "<|python_tag|>"), "mistral": ("[{",)}.get(family, ())
    if fmt.marker not in text and "<tool_call>" not in text and "</tool_call>" not in text \
            and not text.lstrip().startswith(starts or "\0"):
        assert calls == [] and errors == [], (family, text)


def test_format_parser_cases():
    xml = formats.parse_qwen3_xml
    # no wrapper, a multi-line value, a JSON list, Python-literal bools as Qwen's template writes them
    calls, errors = xml("<function=f>\n<parameter=s>\nline 1\nline 2\n</parameter>\n<parameter=l>\n[1, 2]\n"
                        "</parameter>\n<parameter=b>\nTrue\n</parameter>\n</function>")
    assert calls == [{"name": "f", "arguments": {"s": "line 1\nline 2", "l": [1, 2], "b": True}}] and errors == []
    # the schema decides: a string parameter keeps "42" as text, others read it as JSON
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"s": {"type": "string"}}}}}]
    text = "<tool_call>\n<function=f>\n<parameter=s>\n42\n</parameter>\n<parameter=n>\n42\n</parameter>\n</function>\n</tool_call>"
    assert xml(text, tools=tools) == ([{"name": "f", "arguments": {"s": "42", "n": 42}}], [])
    for bad in ["<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n",  # unclosed function
                "<function=f>junk<parameter=x>\n1\n</parameter></function>",       # text outside parameters
                "<function=f>\n<parameter=x>\nNaN\n</parameter>\n</function>",     # refused as for JSON calls
                "<function=>\n</function>"]:
        calls, errors = xml(bad)
        assert calls == [] and len(errors) >= 1, bad
    llama = formats.parse_llama3_json
    assert llama("<answer>42</answer>") == ([], [])
    assert llama('{"name": "f", "arguments": {"x": 1}}') == ([{"name": "f", "arguments": {"x": 1}}], [])
    assert llama('{"name": "f", "parameters": "{\\"x\\": 1}"}')[0] == [{"name": "f", "arguments": {"x": 1}}]
    for bad in ['{"name": "f", "parameters": {"x": ', '{"parameters": {}}', '{"name": "f", "parameters": [1]}',
                '{"name": "f", "parameters": {"x": NaN}}', "{" + _nested(100) + "}"]:
        calls, errors = llama(bad)
        assert calls == [] and len(errors) == 1, bad
    mistral = formats.parse_mistral
    assert mistral("<answer>42</answer>") == ([], [])
    assert mistral('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}, "id": "abcdefgh1"}]</s>') == \
        ([{"name": "f", "arguments": {"x": 1}}], [])
    for bad in ["[TOOL_CALLS]", "[TOOL_CALLS] []", '[TOOL_CALLS] {"name": "f"}', "[TOOL_CALLS]f[ARGS]{",
                '[TOOL_CALLS] [{"name": 3}]', '[TOOL_CALLS]f[ARGS]{"x": Infinity}']:
        calls, errors = mistral(bad)
        assert calls == [] and len(errors) == 1, bad
    with pytest.raises(ValueError, match="known formats are hermes, qwen3-xml, llama3-json, mistral"):
        MCPEnv(pool=object(), tool_format="gemma")


# hostile turns that took time quadratic in their length (seconds measured on the 2-core dev machine before
# the fix): what MCPEnv.step runs on each, parse and own_result_at, must take well under a second now
_HOSTILE = {
    "hermes": ["<tool_call><tool_response></tool_call>" * 26_000,  # own_result_at: 17 s
               '<tool_call>{"name": "f", "arguments": {"a": "<tool_response>"}}</tool_call>' * 12_500],  # 6 s
    "qwen3-xml": ["<function=a>" * 83_000,  # unclosed: > 60 s (10,000 took 7 s)
                  ("<function=f>" + "<parameter=" * 2600 + "</function>") * 34],  # 42 s
    "llama3-json": ["{};" * 10_600,  # 32 KB (the old limit, on the rest of the turn): 37 s
                    '{"name":"f"};' * 77_000],  # read now (item: limits on the call alone)
    "mistral": ["[TOOL_CALLS]f[CALL_ID]" + " " * 1_000_000,  # regex backtracking: > 60 s (20,000: 3 s)
                "[TOOL_CALLS]" * 83_000],
}


@pytest.mark.parametrize("family", FORMATS_UNDER_TEST)
def test_parsers_take_linear_time_on_hostile_turns(family):
    fmt = formats.FORMATS[family]
    for text in _HOSTILE[family]:
        t0 = time.perf_counter()
        calls, errors = fmt.parse(text)
        formats.own_result_at(text, fmt.result_marker, family)
        assert time.perf_counter() - t0 < 5, (family, text[:60])  # ~0.4 s at most on 2 slow cores
        assert calls or errors
    assert len(formats.parse_llama3_json('{"name":"f"};' * 77_000)[0]) == 77_000


def test_qwen3_xml_missing_closing_parameter_ends_at_the_next_parameter():
    """vLLM's tests/tool_parsers/test_qwen3coder_tool_parser.py, "missing closing parameter tag": the value
    ends at the next <parameter= (or </function>); it swallowed the next parameter, without an error."""
    text = ("Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\n"
            "Dallas\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n"
            "</tool_call>")
    want = {"name": "get_current_weather", "arguments": {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}}
    assert formats.parse_qwen3_xml(text) == ([want], [])
    assert formats.parse_qwen3_xml("<function=f>\n<parameter=x>\n1\n</function>") == \
        ([{"name": "f", "arguments": {"x": 1}}], [])  # the last one ends at </function>
    calls, errors = formats.parse_qwen3_xml("<function=f>\n<parameter=x>\n1\n</parameter>junk</function>")
    assert calls == [] and "junk" in errors[0]  # text outside a closed parameter is still an error


def test_mistral_v11_calls_without_args_token():
    """[TOOL_CALLS]NAME{json}: vLLM's tests give its mistral parser this form (tests/tool_parsers)."""
    mistral = formats.parse_mistral
    assert mistral('[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}') == (
        [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "multiply", "arguments": {"a": 3, "b": 6}}], [])
    assert mistral('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e {"a": 1}') == ([{"name": "add", "arguments": {"a": 1}}], [])
    assert mistral('[TOOL_CALLS]add[1]')[1] and mistral('[TOOL_CALLS]add {"a": ')[1]  # still errors


def test_call_limits_are_measured_on_the_call_not_what_follows():
    """A valid call followed by over 32,000 characters or 33 '[' of text was refused as too long or too
    deep (the limits read a slice of the rest of the turn); the call alone is what they bound."""
    after = ["\n" + "x" * 40_000, " [" * 40, ' "' + "[" * 40]
    for tail in after:
        assert formats.parse_llama3_json('{"name": "f", "parameters": {"x": 1}}' + tail) == \
            ([{"name": "f", "arguments": {"x": 1}}], []), tail[:5]
        for text in ('[TOOL_CALLS]f[ARGS]{"x": 1}', '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]'):
            assert formats.parse_mistral(text + tail) == ([{"name": "f", "arguments": {"x": 1}}], []), text
    long, deep = {"s": "a" * 32_000}, json.loads(_nested(33, "{}"))
    for args, why in [(long, "over the limit of 32000"), (deep, "nested deeper than 32 levels")]:
        for text in (json.dumps({"name": "f", "parameters": args}), "[TOOL_CALLS]f[ARGS]" + json.dumps(args)):
            parse = formats.parse_mistral if text.startswith("[") else formats.parse_llama3_json
            calls, errors = parse(text + " done")
            assert calls == [] and why in errors[0], text[:40]


def test_each_format_scores_one_through_run_episodes(pool, rows):
    """Done-when of the formats issue: for each family a scripted policy that writes the oracle's
    calls as the family's template renders them, then the answer, scores 1 on bundled tasks."""
    from rollout import Completion, end_of_turn_id, run_episodes
    train, test = rows
    picks = [next(r for r in test if r["extra_info"]["family"] == "multi" and len(r["extra_info"]["oracle_calls"]) == 3),
             next(r for r in test if r["extra_info"]["oracle_calls"][-1]["name"] == "kb_set")]  # a string "118.5"

    def newer_mistral(call, k):  # v11+: [TOOL_CALLS]NAME[ARGS]{...}, every other call with a [CALL_ID]
        call_id = f"[CALL_ID]a1b2c3d4{k}" if k % 2 else ""
        return f"[TOOL_CALLS]{call['name']}{call_id}[ARGS]{json.dumps(call['arguments'])}"

    class FormatPolicy:
        def __init__(self, tok, family, write=None):
            self.tok, self.results_marker = tok, FAMILY_FIXTURES[family][2]
            self.write = write or (lambda call, k: render_calls(tok, [call], pool.tools))

        def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
            out = []
            for p in prompts:
                ctx = self.tok.decode(p)
                row = next(r for r in picks if r["prompt"][1]["content"] in ctx)
                k, oracle = ctx.count(self.results_marker), row["extra_info"]["oracle_calls"]
                text = self.write(oracle[k], k) if k < len(oracle) else \
                    f"<answer>{row['extra_info']['oracle_answer']}</answer>"
                ids = self.tok.encode(text, add_special_tokens=False) + [end_of_turn_id(self.tok)]
                out.append([Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")] * n)
            return out

    # mistral twice: the v3 JSON list (its [TOOL_CALLS] may go: the bare list is read) and the newer
    # form, whose [TOOL_CALLS] / [ARGS] / [CALL_ID] are special tokens rollout must keep (keep_special);
    # both through the strict template, so every tool result needs its 9-character tool_call_id
    cases = [(family, None) for family in FORMATS_UNDER_TEST] + [("mistral", newer_mistral)]
    for family, write in cases:
        tok = family_tokenizer(family)
        eps = run_episodes(FormatPolicy(tok, family, write), tok, picks, lambda r: MCPEnv(pool=pool, tool_format=family), n=1,
                           temperature=1.0, top_p=1.0, max_tokens=400, max_turns=6, max_context=30000)
        for ep, row in zip(eps, picks):
            assert ep.reward == 1.0 and ep.finish_reason == "stop", (family, write, ep.info)
            assert ep.info["tool_calls"] == len(row["extra_info"]["oracle_calls"]) and ep.info["parse_errors"] == 0
            assert ep.info["tool_format"] == family


def test_mistral_tool_results_carry_call_ids_the_strict_template_accepts(pool):
    # Mistral's own template raises unless every tool result has a 9-alphanumeric tool_call_id (so does
    # the fixture); MCPEnv gives one per tool message, a counter per episode. hermes' messages are unchanged
    from rollout import observation_ids
    tok = family_tokenizer("mistral")
    for bad in ({}, {"tool_call_id": "abc"}, {"tool_call_id": "abcdefgh!"}):
        with pytest.raises(Exception, match="alphanumeric strings with length 9"):
            observation_ids(tok, [{"role": "tool", "content": "42", **bad}], pool.tools, tok.eos_token_id)
    env = MCPEnv(pool=pool, tool_format="mistral")
    assert set(env.keep_special) == {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"}
    assert MCPEnv(pool=pool).keep_special == () and MCPEnv(pool=pool, tool_format="qwen3-xml").keep_special == ()
    for _ in range(2):  # the same ids in every episode
        env.reset(row_for("395"))
        obs, *_ = env.step('[TOOL_CALLS]calculate[ARGS]{"expression": "6*7"}[TOOL_CALLS]nope[ARGS]{}[TOOL_CALLS]x[ARGS]{')
        assert [o["content"][:6] for o in obs] == ["Error:", "42", "Error:"]
        ids = [o["tool_call_id"] for o in obs]
        assert len(set(ids)) == 3 and all(len(i) == 9 and i.isalnum() for i in ids), ids
        obs2, *_ = env.step('[TOOL_CALLS]calculate[ARGS]{"expression": "1+1"}')
        assert obs2[0]["tool_call_id"] not in ids
        text = tok.decode(observation_ids(tok, obs + obs2, pool.tools, tok.eos_token_id))
        assert text.count("[TOOL_RESULTS]") == 4 and all(i in text for i in ids)
        env.close()
    env = MCPEnv(pool=pool)
    env.reset(row_for("395"))
    assert env.step(tc("calculate", expression="6*7"))[0] == [{"role": "tool", "content": "42"}]
    env.close()


def test_tasks_cli_runs_as_a_script(tmp_path):
    # python mcp_tools/tasks.py from another folder: its own folder must not shadow top-level modules
    out = subprocess.run([sys.executable, os.path.join(ROOT, "mcp_tools", "tasks.py"), "--families", "text",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "wrote 90 rows" in out.stdout and (tmp_path / "test.jsonl").exists()

# ---------------------------------------------------------------------------------------------
# render: the text a model of each family writes for one call (what the rescue hints replay)

_TOOL_NAMES = st.text(alphabet="abcxyzABC019_.-", min_size=1, max_size=10)  # MCP names; mistral reads only these
# text a family cannot carry inside a value: its own end-of-call markers (json.dumps escapes no '<' or '[');
# qwen3-xml also reads a value by its schema type, so its test passes tools= (strings stay text)
_CANNOT_CARRY = {"hermes": ("</tool_call>",), "llama3-json": (), "mistral": ("[TOOL_CALLS]",),
                 "qwen3-xml": ("</parameter>", "</function>", "<function=", "<parameter=")}
_TEXT_PIECES = st.sampled_from(list("ab Z1-.\n\t\"\\{}[]<>/=é€") + [
    "</tool_call>", "<tool_call>", "[TOOL_CALLS]", "[ARGS]", "</parameter>", "<parameter=x>", "</function>",
    "<function=", "true", "None", "True", "null", "42", " 7 ", "NaN", "1e999", "[1]"])


def _render_args(family):
    bad = _CANNOT_CARRY[family]
    text = st.one_of(st.text(max_size=12), st.lists(_TEXT_PIECES, max_size=6).map("".join)).filter(
        lambda s: not any(b in s for b in bad))
    scalars = st.one_of(text, st.integers(-10**18, 10**18), st.floats(allow_nan=False, allow_infinity=False),
                        st.booleans(), st.none())
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(text, inner, max_size=3)), max_leaves=8)
    # qwen3-xml keys sit in <parameter=KEY>: no '>' or newline, no surrounding space (the parser strips it)
    keys = st.text(alphabet="abcxyz_019", min_size=1, max_size=6) if family == "qwen3-xml" else text
    return st.dictionaries(keys, values, max_size=4)


def _string_schema(name, arguments):
    """tools= for qwen3-xml: the parameters holding strings typed "string", as a real schema types them."""
    props = {k: {"type": "string"} if isinstance(v, str) else {} for k, v in arguments.items()}
    return [{"type": "function", "function": {"name": name, "parameters": {"properties": props}}}]


@pytest.mark.parametrize("family", FORMATS_UNDER_TEST)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_render_round_trip(family, data):
    """parse(render(name, args)) gives back exactly that call, for any tool name and JSON-able arguments
    the family can carry (_CANNOT_CARRY; qwen3-xml with the schema that says which values are strings)."""
    fmt = formats.FORMATS[family]
    name, args = data.draw(_TOOL_NAMES, label="name"), data.draw(_render_args(family), label="arguments")
    text = fmt.render(name, args)
    tools = _string_schema(name, args) if family == "qwen3-xml" else None
    assert fmt.parse(text, tools=tools) == ([{"name": name, "arguments": args}], []), text


def test_render_is_what_the_family_template_renders(pool):
    # the fixture templates render each family's documented call text; render writes the same turn
    # (qwen3-xml's fixture puts a newline after the generation prompt's own, Qwen3-Coder's does not;
    # mistral's fixture renders the v3 list form, render the v11+ NAME[ARGS] form both parse)
    calls = [{"name": "convert_units", "arguments": {"value": 12.5, "from_unit": "km", "to_unit": "mi"}},
             {"name": "kb_set", "arguments": {"key": "price:x", "value": "118.5"}},
             {"name": "search_products", "arguments": {"query": "Café ☕", "tags": ["a", 1, [True, None]], "n": 3}}]
    for family in ("hermes", "qwen3-xml", "llama3-json"):
        tok = family_tokenizer(family)
        for c in calls:
            want = render_calls(tok, [c])
            want = want[1:] if family == "qwen3-xml" else want
            assert formats.FORMATS[family].render(c["name"], c["arguments"]) == want, family
    assert formats.FORMATS["hermes"].render("f", {"x": "é"}) == \
        '<tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call>'
    assert formats.FORMATS["qwen3-xml"].render("f", {"s": "a b", "n": 2, "b": True, "l": [1, "x"]}) == (
        "<tool_call>\n<function=f>\n<parameter=s>\na b\n</parameter>\n<parameter=n>\n2\n</parameter>\n"
        "<parameter=b>\nTrue\n</parameter>\n<parameter=l>\n[1, \"x\"]\n</parameter>\n</function>\n</tool_call>")
    assert formats.FORMATS["llama3-json"].render("f", {"x": 1}) == '{"name": "f", "parameters": {"x": 1}}'
    assert formats.FORMATS["mistral"].render("f", {"x": 1}) == '[TOOL_CALLS]f[ARGS]{"x": 1}'
    # what qwen3-xml cannot carry without the schema: a string that reads as JSON comes back typed
    assert formats.FORMATS["qwen3-xml"].parse(formats.FORMATS["qwen3-xml"].render("f", {"s": "42"}))[0] == \
        [{"name": "f", "arguments": {"s": 42}}]

# ---------------------------------------------------------------------------------------------
# recovery: repeated calls and their charge (rewards.repeat_counts, rewards.failed_charge, rewards.episode_reward)


def test_repeat_counts_and_charge_by_hand():
    a, b, c = ("f", '{"x": 1}'), ("f", '{"x": 2}'), ("g", "{}")
    # a fails, a again (a repeat of a failed call that fails again), b ok, b again, a third time but ok
    assert mcp_rewards.repeat_counts([(a, True), (a, True), (b, False), (b, False), (a, False), (c, True)]) == (3, 2, 1)
    assert mcp_rewards.repeat_counts([]) == (0, 0, 0)
    assert mcp_rewards.call_key("kb_get", {"key": "k", "session": "s1"}) == mcp_rewards.call_key("kb_get", {"key": "k"})
    assert mcp_rewards.call_key("f", {"a": 1, "b": 2}) == mcp_rewards.call_key("f", {"b": 2, "a": 1})
    assert mcp_rewards.call_key("f", {"a": 1}) != mcp_rewards.call_key("g", {"a": 1})
    # 5 failed calls, 2 of them failed repeats; penalty 0.2, cap 0.5: 0.5 inside the cap + 0.4 outside
    assert mcp_rewards.failed_charge(5, 2, 0.2, 0.5) == pytest.approx(0.9)
    assert mcp_rewards.episode_reward(0.1, False, 0.9) == pytest.approx(-0.8)
    assert mcp_rewards.episode_reward(1.0, True, 0.9) == pytest.approx(0.5)  # a correct answer pays at most 0.5


_OUTCOMES = st.lists(st.tuples(st.sampled_from([("f", "{}"), ("f", '{"x": 1}'), ("g", "{}"), ("h", "{}")]),
                               st.booleans()), max_size=12)


@settings(max_examples=500, deadline=None)
@given(calls=_OUTCOMES, parse_errors=st.integers(0, 5), pick=st.integers(0, 100),
       penalty=st.floats(0.001, 1.0), cap=st.floats(0.0, 3.0), fmt_reward=st.floats(0.0, 0.49),
       credit=st.floats(0.0, 0.49))
def test_repeat_charge_properties(calls, parse_errors, pick, penalty, cap, fmt_reward, credit):
    """Adding an identical repeat of a failed call that fails again strictly lowers a wrong episode's
    reward, never raises a correct one's, and any correct episode still beats any wrong one while
    format_reward + credit < 0.5."""
    from hypothesis import assume
    failed_keys = [k for k, failed in calls if failed]
    assume(failed_keys and fmt_reward + credit < 0.5)
    more = calls + [(failed_keys[pick % len(failed_keys)], True)]

    def rewards(seq):
        _, _, refailed = mcp_rewards.repeat_counts(seq)
        charge = mcp_rewards.failed_charge(sum(f for _, f in seq) + parse_errors, refailed, penalty, cap)
        return (mcp_rewards.episode_reward(fmt_reward + credit, False, charge),
                mcp_rewards.episode_reward(1.0, True, charge))
    (wrong, right), (wrong2, right2) = rewards(calls), rewards(more)
    assert wrong2 < wrong and right2 <= right
    assert min(right, right2) >= 0.5 > max(wrong, wrong2)
    rc, rf, refailed = mcp_rewards.repeat_counts(more)
    assert rc >= rf >= refailed >= 1


def test_repeated_failed_calls_are_counted_and_charged(pool):
    """Through the bundled server: repeats counted per episode (a model-written "session" ignored), a
    failed repeat that fails again charged past the cap, each turn paying its share."""
    env = MCPEnv(pool=pool, error_penalty=0.1, error_cap=0.2)
    for answer, total in (("5", -0.7), ("4", 0.5)):
        env.reset(row_for("4"))
        bad = tc("calculate", expression="2+")
        paid = [env.step(bad)[1], env.step(bad)[1], env.step(bad)[1]]  # failed 1, 2, 3; refailed 0, 1, 2
        assert paid == [pytest.approx(-0.1), pytest.approx(-0.2), pytest.approx(-0.1)]  # cap 0.2 + 0.1 a repeat
        obs, r, done, info = env.step(tc("calculate", expression="2+2") + tc("calculate", expression="2+2") +
                                      tc("kb_get", key="nope") + tc("kb_get", key="nope", session="mine"))
        assert [o["content"][:5] for o in obs] == ["4", "4", "Error", "Error"]
        assert (info["repeat_calls"], info["repeat_failed"]) == (4, 3)  # 2 + 1 (2+2) + 1 (kb_get)
        assert info["stale_repeats"] == 1  # the second 2+2: the same result again
        assert r == pytest.approx(-0.2)  # failed 5 (cap 0.2) + refailed 3 + stale 1 (0.4): 0.6 owed, 0.4 paid before
        obs, r2, done, info = env.step(bad)  # failed 6, refailed 4: 0.7 owed
        assert r2 == pytest.approx(-0.1) and (info["repeat_calls"], info["repeat_failed"]) == (5, 4)
        final = env.step(f"<answer>{answer}</answer>")
        assert sum(paid) + r + r2 + final[1] == pytest.approx(total)  # wrong: 0 - 0.7; right: 1 - at most 0.5
        assert final[1] == pytest.approx(0.0 if answer == "5" else 1.2)  # paid before; 0.2 back over 0.5
        assert final[3]["repeat_calls"] == 5 and final[3]["credit"] == 0.0
    env.reset(row_for("4"))
    assert env.step(tc("calculate", expression="2+2"))[3]["repeat_calls"] == 0  # reset starts at 0


def test_a_call_that_gets_the_same_result_again_is_a_stale_repeat(pool):
    """An identical call that did not fail and got the same result as before pays error_penalty outside
    the cap (stale_repeats), as a failed call that fails again does (refailed, never both); one whose
    result changed (state written in between) does not."""
    env = MCPEnv(pool=pool, error_penalty=0.1, error_cap=0.1)
    env.reset(row_for("4"))
    assert env.step(tc("calculate", expression="2+2"))[1] == 0.0
    obs, r, _, info = env.step(tc("calculate", expression="2+2") + tc("calculate", expression="2+2"))
    assert [o["content"] for o in obs] == ["4", "4"] and info["stale_repeats"] == 2 and r == pytest.approx(-0.2)
    key = "stale-test-key"
    steps = [env.step(tc("kb_get", key=key)),  # an error (no such key): failed, capped at 0.1
             env.step(tc("kb_get", key=key, session="mine")),  # the same call ("session" is the pool's), failing again
             env.step(tc("kb_set", key=key, value="v")),
             env.step(tc("kb_get", key=key)),  # the same call, another result: not stale
             env.step(tc("kb_get", key=key))]  # the same result again
    assert [s[3]["stale_repeats"] for s in steps] == [2, 2, 2, 2, 3]  # the repeated failure is refailed's
    assert [s[1] for s in steps] == [pytest.approx(-0.1), pytest.approx(-0.1), 0.0, 0.0, pytest.approx(-0.1)]
    assert steps[1][3]["repeat_failed"] == 1 and steps[-1][0][0]["content"] == "v"
    final = env.step("<answer>4</answer>")  # right: 0.5 paid, all of it kept (at most 0.5)
    assert final[1] == pytest.approx(1.0) and final[3]["stale_repeats"] == 3 and final[3]["repeat_calls"] == 5
    env.reset(row_for("4"))
    paid = [env.step(tc("calculate", expression="2+2"))[1] for _ in range(4)]
    assert paid == [0.0] + [pytest.approx(-0.1)] * 3  # wrong: keeps 0.3, and its guess pays (no result showed a 5)
    assert env.step("<answer>5</answer>")[1] == pytest.approx(-0.1) and env.info["unfounded_answer"] == 1
    env = MCPEnv(pool=pool)  # no penalty (the default): counted, free
    env.reset(row_for("4"))
    assert [env.step(tc("calculate", expression="2+2"))[1] for _ in range(2)] == [0.0, 0.0]
    assert env.info["stale_repeats"] == 1


def test_a_malformed_turn_sent_again_is_a_repeated_failed_call(pool):
    """A turn the parser cannot read counts as a failed call keyed by its text: sent again as it was
    (a trained policy resent calls written one after another in one block, on the state family), it is
    an identical repeat of a failed call, counted and charged past the cap; another malformed turn is not."""
    env = MCPEnv(pool=pool, error_penalty=0.1, error_cap=0.2)
    env.reset(row_for("4"))
    two = "<tool_call>\n" + '{"name": "calculate", "arguments": {"expression": "2+2"}}\n' * 2 + "</tool_call>"
    paid = [env.step(two)[1], env.step(two)[1], env.step(two)[1]]  # failed 1, 2, 3; refailed 0, 1, 2
    assert paid == [pytest.approx(-0.1), pytest.approx(-0.2), pytest.approx(-0.1)]
    obs, r, done, info = env.step("<tool_call>{oops</tool_call>")  # another malformed turn: no repeat
    assert "invalid JSON" in obs[0]["content"] and r == pytest.approx(0.0)
    assert (info["parse_errors"], info["repeat_calls"], info["repeat_failed"]) == (4, 2, 2)
    obs, r, done, info = env.step(tc("calculate", expression="2+2"))  # read and run: not a repeat of them
    assert obs[0]["content"] == "4" and (info["repeat_calls"], info["repeat_failed"]) == (2, 2)


def test_invented_calls_count_numbers_and_dates_no_prompt_or_earlier_result_showed(pool, rows):
    seen = "Omar's orders: [{\"id\":23,\"date\":\"2024-05-04\",\"total\":591.79}], 3.5 kg"
    assert not any(mcp_rewards.invented(a, seen) for a in ({"order_id": 23}, {"amount": 591.79}, {"date": "2024-05-04"},
                                                          {"x": 3.5}, {"q": "SELECT 1 WHERE x = 999"}, {"total": 591.79, "session": 7}))
    assert all(mcp_rewards.invented(a, seen) for a in ({"order_id": 2}, {"order_id": 3}, {"amount": 591.8}, {"date": "2024-05-05"},
                                                      {"x": 5}, {"n": 23.0, "m": 4}))  # 3 of 3.5, 5 of 591.79: not shown
    multi = next(r for r in rows[1] if r["extra_info"]["family"] == "multi" and r["extra_info"]["oracle_calls"][0]["name"] == "find_customer")
    env = MCPEnv(pool=pool)
    env.reset(multi)
    find, lst = multi["extra_info"]["oracle_calls"][:2]
    assert env.step(tc(find["name"], **find["arguments"]))[3]["invented_calls"] == 0  # the name is in the question
    info = env.step(tc(lst["name"], **lst["arguments"]) + tc("get_order", order_id=987654))[3]  # the id came back; 987654 did not
    assert info["invented_calls"] == 1
    env.reset(multi)  # the two lookups in one turn: the id is passed before its result is seen
    assert env.step(tc(find["name"], **find["arguments"]) + tc(lst["name"], **lst["arguments"]))[3]["invented_calls"] == 1


# ---------------------------------------------------------------------------------------------
# partial credit: rewards.oracle_credit and MCPEnv(partial_credit=)


def _c(tool, /, **arguments):
    return {"name": tool, "arguments": arguments}


def test_oracle_credit_cases():
    credit = mcp_rewards.oracle_credit
    a, b, c = _c("find_customer", name="Ada"), _c("list_orders", customer_id=3), _c("weekday", date="2024-01-02")
    assert credit([a, b, c], [a, b, c]) == 1.0
    assert credit([c, b, a], [a, b, c]) == pytest.approx(1 / 3)  # order matters: only a matches in order
    assert credit([b, a], [a, b]) == 0.5
    assert credit([a, _c("list_orders", customer_id=4), c], [a, b, c]) == pytest.approx(1 / 3)  # stops at the wrong one
    assert credit([a, _c("calculate", expression="1"), b, a, c], [a, b, c]) == 1.0  # extra calls between are fine
    assert credit([a, b, c], []) == 0.0 and credit([], [a]) == 0.0
    assert credit([_c("list_orders", customer_id="3")], [b]) == 1.0  # values by same_value: "3" is 3
    assert credit([_c("list_orders", customer_id=3, session="s")], [b]) == 1.0  # an injected session is ignored
    assert credit([_c("list_orders", customer_id=3, extra=1)], [b]) == 0.0  # same keys, or no match
    assert credit([_c("list_orders")], [b]) == 0.0


_ORACLE_CALLS = st.lists(st.builds(lambda n, v: _c(n, x=v), st.sampled_from(["f", "g", "h"]),
                                   st.one_of(st.integers(0, 3), st.sampled_from(["a", "b"]))), max_size=5)


@settings(max_examples=300, deadline=None)
@given(oracle=_ORACLE_CALLS, extra=_ORACLE_CALLS, where=st.lists(st.integers(0, 10), max_size=5), k=st.integers(0, 5))
def test_oracle_credit_properties(oracle, extra, where, k):
    credit = mcp_rewards.oracle_credit
    assert credit(oracle, oracle) == (1.0 if oracle else 0.0)
    # any calls inserted anywhere leave the oracle's order intact: still full credit
    calls = list(oracle)
    for e, w in zip(extra, where):
        calls.insert(w % (len(calls) + 1), e)
    assert credit(calls, oracle) == (1.0 if oracle else 0.0)
    if oracle:
        assert credit(oracle[:k], oracle) == min(k, len(oracle)) / len(oracle)  # a prefix earns its share
        assert 0.0 <= credit(extra, oracle) <= 1.0


def test_partial_credit_episode(pool, rows):
    """A wrong final answer after the oracle's first 2 of 3 calls earns partial_credit * 2/3; a right
    one earns no credit; no answer, or a row without (or with a malformed) oracle_calls, earns none."""
    train, test = rows
    row = next(r for r in test if r["extra_info"]["family"] == "multi" and len(r["extra_info"]["oracle_calls"]) == 3)
    oracle = row["extra_info"]["oracle_calls"]
    env = MCPEnv(pool=pool, partial_credit=0.3, format_reward=0.1)

    def play(row, calls, final):
        env.reset(row)
        for c in calls:
            obs, r, done, info = env.step(tc(c["name"], **c["arguments"]))
            assert not done and info["credit"] == 0.0
        return env.step(final)

    _, r, done, info = play(row, oracle[:2], "<answer>-1</answer>")
    assert done and r == pytest.approx(0.1 + 0.3 * 2 / 3) and info["credit"] == pytest.approx(0.2)
    _, r, _, info = play(row, oracle, f"<answer>{row['extra_info']['oracle_answer']}</answer>")
    assert r == 1.0 and info["credit"] == 0.0
    _, r, _, info = play(row, oracle, "I give up.")  # no answer tag: base 0, no credit
    assert r == 0.0 and info["credit"] == 0.0
    for bad in (None, "x", [{"name": 3}], [{"name": "f", "arguments": []}], {"name": "f"}):
        broken = {**row, "extra_info": {**row["extra_info"], "oracle_calls": bad}}
        if bad is None:
            del broken["extra_info"]["oracle_calls"]
        _, r, _, info = play(broken, oracle[:2], "<answer>-1</answer>")
        assert r == pytest.approx(0.1) and info["credit"] == 0.0, bad
    _, r, _, info = play(row_for("4"), [], "<answer>5</answer>")  # no extra_info at all
    assert r == pytest.approx(0.1) and info["credit"] == 0.0 and "error" not in info
    env.close()


@pytest.mark.parametrize("value", [-0.1, 0.5, 1.0, float("nan")])
def test_partial_credit_must_be_below_a_half(value):
    with pytest.raises(ValueError, match="partial_credit"):
        MCPEnv(pool=object(), partial_credit=value)


def test_env_for_row_passes_partial_credit(pool):
    import envs
    env = envs.env_for_row(row_for("4"), "mcp", pool=pool, partial_credit=0.25)
    assert isinstance(env, MCPEnv) and env.partial_credit == 0.25
    gsm = {"prompt": [{"role": "user", "content": "q"}], "env_class": "gsm8k", "reward_spec": {"ground_truth": "4"}}
    assert not isinstance(envs.env_for_row(gsm, "mcp", partial_credit=0.25), MCPEnv)  # other envs ignore it

# ---------------------------------------------------------------------------------------------
# the discovery family: a records database whose tables and columns must be looked up first


def _discovery(rows):
    return [r for r in rows if r["extra_info"]["family"] == "discovery"]


def _table_of(row):
    return row["extra_info"]["oracle_calls"][1]["arguments"]["table"]


def test_records_tools(pool):
    from mcp_tools.tasks import DISCOVERY_TEST_TABLES
    env = MCPEnv(pool=pool)
    env.reset(row_for("1"))
    obs, *_ = env.step(tc("db_tables") + tc("db_describe", table="t_shp") + tc("db_describe", table="shipments"))
    tables = json.loads(obs[0]["content"])
    assert len(tables) == 8 + 10 and all(set(t) == {"table", "about"} and t["about"] for t in tables)
    assert [t["table"] for t in tables] == list(S.RECORDS_SCHEMA) + list(S.LINKED_SCHEMA)
    assert set(DISCOVERY_TEST_TABLES) < set(S.RECORDS_SCHEMA)
    cols = json.loads(obs[1]["content"])
    assert [c["column"] for c in cols] == ["dst", "wt_kg", "n_pc"] and all(c["type"] and c["about"] for c in cols)
    assert obs[2]["content"].startswith("Error") and "shipments" in obs[2]["content"] and "db_tables" not in obs[2]["content"]
    data = {**S.records_data(), **S.linked_data()}
    for t in S.RECORDS_TABLES:  # every table is small, deterministic, and described column by column
        n = json.loads(env.step(tc("db_query", sql=f"SELECT COUNT(*) FROM {t}"))[0][0]["content"])["rows"][0][0]
        assert n == len(data[t]) >= (30 if t not in S.LINKED else 7)
        described = json.loads(env.step(tc("db_describe", table=t))[0][0]["content"])
        assert [c["column"] for c in described] == list(data[t][0])
    assert S.records_data() == S.records_data() and S.linked_data() == S.linked_data()
    # the model sees no schema: db_query's description names the lookup tools, not a table
    shown = {t["function"]["name"]: t["function"]["description"] for t in pool.tools}
    assert "db_tables" in shown["db_query"] and "db_describe" in shown["db_query"]
    assert not any(t in shown["db_query"] for t in S.RECORDS_TABLES)
    assert all(len(shown[t]) < 160 for t in ("db_tables", "db_describe", "db_query"))  # every prompt pays for them
    assert "products(id,name,category,price,stock)" in shown["sql_query"]  # sql_query unchanged
    env.close()


def test_discovery_natural_guess_fails_without_the_schema(pool, rows):
    train, test = rows
    row = next(r for r in _discovery(train)
               if _table_of(r) == "t_shp" and "dst =" in r["extra_info"]["oracle_calls"][2]["arguments"]["sql"])
    assert "shipments" in row["prompt"][1]["content"]
    env = MCPEnv(pool=pool)
    env.reset(row)
    obs, r, done, info = env.step(tc("db_query", sql="SELECT COUNT(*) FROM shipments WHERE destination = 'Lyon'"))
    err = obs[0]["content"]
    # sqlite's own words, as a real SQL server gives them: no pointer to the lookup tools (shop._DATABASES)
    assert err.startswith("Error") and "no such table: shipments" in err and "db_tables" not in err and "db_describe" not in err
    assert "sql_query" not in err  # named only when the query names a shop table (below)
    assert info["tool_errors"] == 1
    schema_words = list(S.RECORDS_SCHEMA) + [c for _, cols in S.RECORDS_SCHEMA.values() for c, *_ in cols]
    assert not any(re.search(rf"\b{re.escape(w)}\b", err) for w in schema_words), err
    obs, *_ = env.step(tc("db_query", sql="SELECT COUNT(*) FROM t_shp WHERE destination = 'Lyon'"))
    assert "no such column: destination" in obs[0]["content"] and "wt_kg" not in obs[0]["content"]
    # the shop's sql_query still lists its tables on an error
    obs, *_ = env.step(tc("sql_query", sql="SELECT * FROM shipments"))
    assert "tables: products(id,name,category,price,stock)" in obs[0]["content"]
    # a table asked of the other database's tool (trained policies sent sql_query on a records table
    # again and again, its error listing only the shop's tables): the error names the tool to use
    obs, *_ = env.step(tc("sql_query", sql="SELECT COUNT(*) FROM t_shp") + tc("db_query", sql="SELECT * FROM products"))
    assert "no such table: t_shp" in obs[0]["content"] and "queried with db_query" in obs[0]["content"]
    assert "no such table: products" in obs[1]["content"] and "queried with sql_query" in obs[1]["content"]
    env.close()


def test_discovery_oracle_scores_one_on_every_row(pool, rows):
    train, test = rows
    disc = _discovery(test + train)
    assert len(disc) == FAMILIES["discovery"] == 200
    for row in disc:
        calls = row["extra_info"]["oracle_calls"]
        assert [c["name"] for c in calls] == ["db_tables", "db_describe", "db_query"]
        assert _table_of(row) in calls[2]["arguments"]["sql"]
        r, info = _play_oracle(MCPEnv(pool=pool), row)
        assert r == 1.0, (row["prompt"][1]["content"], info)


def test_discovery_test_tables_are_never_in_train(rows):
    from mcp_tools.tasks import DISCOVERY_TEST_TABLES
    train, test = rows
    assert {_table_of(r) for r in _discovery(test)} == set(DISCOVERY_TEST_TABLES)
    assert {_table_of(r) for r in _discovery(train)} == set(S.RECORDS_SCHEMA) - set(DISCOVERY_TEST_TABLES)
    for counts, fraction in (({"discovery": 200}, 0.5), ({"discovery": 600}, 0.1), ({"discovery": 7}, 0.0),
                             ({"discovery": 1}, 0.1), ({"text": 20, "discovery": 300}, 0.3)):
        tr, te = mcp_rows(seed=3, counts=counts, test_fraction=fraction)
        tr, te = _discovery(tr), _discovery(te)
        assert len(te) == max(1, round(counts["discovery"] * fraction)) and len(tr) + len(te) == counts["discovery"]
        assert {_table_of(r) for r in te} <= set(DISCOVERY_TEST_TABLES)
        assert not {_table_of(r) for r in tr} & set(DISCOVERY_TEST_TABLES), (counts, fraction)
        prompts = [r["prompt"][1]["content"] for r in tr + te]
        assert len(set(prompts)) == len(prompts)


def test_discovery_rows_are_deterministic(rows):
    train, test = rows
    alone = mcp_rows(seed=0, counts={"discovery": 200})  # leaving the other families out changes no row
    assert alone == (_discovery(train), _discovery(test)) == mcp_rows(seed=0, counts={"discovery": 200})
    assert mcp_rows(seed=1, counts={"discovery": 200}) != alone
    # a larger count keeps each split's tasks in order
    big_train, big_test = mcp_rows(seed=0, counts={"discovery": 400})
    assert [r["prompt"] for r in big_test[:20]] == [r["prompt"] for r in alone[1]]
    assert [r["prompt"] for r in big_train[:180]] == [r["prompt"] for r in alone[0]]


# ---------------------------------------------------------------------------------------------
# joins: a named thing's child rows in the records database's linked tables (a join of two tables)


def _joins(rows):
    return [r for r in rows if r["extra_info"]["family"] == "joins"]


@pytest.fixture(scope="module")
def join_rows():
    return mcp_rows(seed=0, counts={"joins": 200})


def test_joins_are_made_only_when_named(rows, join_rows, tmp_path):
    from mcp_tools.tasks import EXTRA_FAMILIES, main
    train, test = rows  # the default rows (train.py --env mcp) stay as they were: no joins among them
    assert not _joins(train + test) and "joins" in EXTRA_FAMILIES and "joins" not in FAMILIES
    tr, te = join_rows
    assert len(tr) == 180 and len(te) == 20 and _joins(tr + te) == tr + te
    tr2, te2 = main(["--families", "discovery,joins", "--out", str(tmp_path)])
    assert _joins(tr2) == tr and _joins(te2) == te  # the command line makes the same rows
    assert _discovery(tr2 + te2) == _discovery(rows[0] + rows[1])  # and no discovery row moves


def test_joins_oracle_scores_one_and_a_wrong_answer_zero(pool, join_rows):
    tr, te = join_rows
    for row in te + tr:
        calls = row["extra_info"]["oracle_calls"]
        parent = calls[1]["arguments"]["table"]
        assert [c["name"] for c in calls] == ["db_tables", "db_describe", "db_describe", "db_query"]
        assert calls[2]["arguments"]["table"] == S.LINKED[parent].child and " JOIN " in calls[3]["arguments"]["sql"]
        r, info = _play_oracle(MCPEnv(pool=pool), row)
        assert r == 1.0, (row["prompt"][1]["content"], info)
    wrong = str(float(te[0]["reward_spec"]["ground_truth"]["answer"]) + 1)
    r, info = _play_oracle(MCPEnv(pool=pool), te[0], answer=wrong)
    assert r == 0.0 and not info["correct"]


def test_joins_need_both_tables(pool, join_rows):
    """The child rows give a number, never the name the question asks about, and the numbers are four
    digits no two rows of the database share: the child table alone cannot answer, nor a guessed number."""
    tr, te = join_rows
    data = S.linked_data()
    numbers = [v for rows in data.values() for r in rows for k, v in r.items() if k.endswith("_no")]
    assert len(numbers) == len(set(numbers)) and all(1000 <= n < 10000 for n in numbers)
    for parent, pair in S.LINKED.items():
        assert not any(isinstance(v, str) for r in data[pair.child] for v in r.values())
        assert {r[pair.ref_col] for r in data[pair.child]} <= {r[pair.id_col] for r in data[parent]}
        assert all(n in {r[pair.name_col] for r in data[parent]} for n in pair.names)
    # no one number answers many rows (with 40 child rows, "2" answered 17%): a constant guess earns little
    answers = collections.Counter(r["reward_spec"]["ground_truth"]["answer"] for r in tr + te)
    assert answers.most_common(1)[0][1] <= 0.06 * len(tr + te), answers.most_common(3)
    env = MCPEnv(pool=pool)
    env.reset(te[0])
    obs, *_ = env.step(tc("db_query", sql="SELECT COUNT(*) FROM dl_q WHERE sp_nm = 'Arden Mills'"))
    assert "no such column: sp_nm" in obs[0]["content"]
    env.close()


def test_joins_test_tables_are_never_in_train(join_rows):
    from mcp_tools.tasks import JOINS_TEST_PARENTS
    tr, te = join_rows
    parent = lambda r: r["extra_info"]["oracle_calls"][1]["arguments"]["table"]  # noqa: E731
    assert {parent(r) for r in te} == set(JOINS_TEST_PARENTS)
    assert {parent(r) for r in tr} == set(S.LINKED) - set(JOINS_TEST_PARENTS)
    for r in tr:  # no held-out table's name, nor a held-out thing's name, is in a train row
        sql = r["extra_info"]["oracle_calls"][3]["arguments"]["sql"]
        assert not any(p in sql or S.LINKED[p].child in sql for p in JOINS_TEST_PARENTS)
        assert not any(n in r["prompt"][1]["content"] for p in JOINS_TEST_PARENTS for n in S.LINKED[p].names)
    prompts = [r["prompt"][1]["content"] for r in tr + te]
    assert len(set(prompts)) == len(prompts)
    assert all(not re.search(r"\b(cl_ct|inv_b|vh_r|tp_lg|mb_s|vs_g|sp_v|dl_q|ar_p|sh_t)\b", p) for p in prompts)


# ---------------------------------------------------------------------------------------------
# sales: a read-only family whose tool takes a product id, which only search_products gives


def _sales(rows):
    return [r for r in rows if r["extra_info"]["family"] == "sales"]


def test_product_sales_agrees_with_the_shop_database():
    # the tool's figures, from the tables in Python, against SQL on the same tables
    for pid in S.PRODUCTS:
        s = S.product_sales_summary(pid)
        units, orders, revenue = S.run_select(
            f"SELECT SUM(quantity), COUNT(DISTINCT order_id), SUM(quantity * unit_price) FROM order_items "
            f"WHERE product_id = {pid}")["rows"][0]
        assert (s["units"], s["orders"], s["name"]) == (units or 0, orders, S.PRODUCTS[pid]["name"])
        assert s["revenue_usd"] == pytest.approx(revenue or 0, abs=0.006)


def test_sales_oracle_scores_one_and_a_guessed_id_reads_another_product(pool, rows):
    train, test = rows
    sales = _sales(test + train)
    assert len(sales) == FAMILIES["sales"] and len(_sales(test)) == 15
    for row in sales:
        calls = row["extra_info"]["oracle_calls"]
        assert [c["name"] for c in calls[:2]] == ["search_products", "product_sales"]
        assert row["prompt"][1]["content"].count(calls[0]["arguments"]["query"]) == 1  # the name, never the id
        r, info = _play_oracle(MCPEnv(pool=pool), row)
        assert r == 1.0, (row["prompt"][1]["content"], info)
    # a policy that skips the search and guesses an id reads no product's sales: the ids are catalogue
    # numbers, and the error says where they come from, so the family pays only for the lookup
    env = MCPEnv(pool=pool)
    env.reset(sales[0])
    for guess in (1, 2, 10, 123, 999):
        obs, *_ = env.step(tc("product_sales", product_id=guess))
        assert f"no product with id {guess}; use search_products to find ids" in obs[0]["content"]
    env.close()


def test_product_ids_are_catalogue_numbers_a_guess_does_not_hit(pool, rows):
    """With ids 1..n a guessed cart_add(product_id=1) silently put another product in the cart (trained
    policies opened every cart row so); catalogue numbers make the guess an error that says to search,
    and the cart stays empty."""
    ids = sorted(S.PRODUCTS)
    assert len(ids) == len(set(ids)) == len(S.SHOP["products"]) and ids[0] >= 1000 and ids[-1] < 10000
    assert {i["product_id"] for i in S.SHOP["order_items"]} <= set(ids)
    row = next(r for r in rows[1] if r["extra_info"]["family"] == "state"
               and r["extra_info"]["oracle_calls"][-1]["name"] == "cart_add")
    env = MCPEnv(pool=pool)
    env.reset(row)
    for guess in (0, 1, 2, 3, 12, 100, 123, 1000, 12345):
        obs, *_ = env.step(tc("cart_add", product_id=guess, quantity=1))
        assert f"no product with id {guess}; use search_products to find ids" in obs[0]["content"]
    obs, *_ = env.step(tc("cart_view"))
    assert json.loads(obs[0]["content"])["items"] == []
    r, info = _play_oracle(env, row)                        # the oracle's ids, from the search, still score
    assert r == 1.0, info
    env.close()


# ---- server robustness of mcp_tools/pool.py, conn.py and config.py, with real server processes:
# secrets redacted by value (unit tests per form, and end to end through train.py: no secret in any
# run file or on the console), restarts that cost a call only where an episode had state, one session
# key per server, the bundled tools' names kept, caps on the tool list, and the pool's own arguments
# checked (~30-40 s)

PY = bundled_config()["mcpServers"]["nanorl"]  # our python (and PYTHONPATH), for the servers written here

# A small third-party server. argv: tool names (each answers "ok NAME"), and flags:
#   --aware       a reset(session) marked as the session hook, and `keys`: the session keys it was given
#   --describe N  one more tool, `wordy`, with an N-character description
#   --many N:M    N more tools, t0 ... t{N-1}, with M-character descriptions
#   --http PORT   streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio
# and always `pid`, `crash` (exits mid-call), `slow(seconds)` and `leak` (an error holding $VAULT_TOKEN).
SERVER = textwrap.dedent('''
    import os, sys, time
    from mcp.server import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    srv = MCPServer("third-party", log_level="WARNING")
    args, keys, http = sys.argv[1:], [], None

    @srv.tool()
    def pid() -> int:
        """This process's id."""
        return os.getpid()

    @srv.tool()
    def crash() -> str:
        """Exit at once, mid-call."""
        os._exit(1)

    @srv.tool()
    def slow(seconds: float) -> str:
        """Sleep, then answer."""
        time.sleep(seconds)
        return "slept"

    @srv.tool()
    def leak() -> str:
        """Fail, echoing this process's token, as a careless server's error does."""
        raise ToolError("cannot connect with token " + os.environ.get("VAULT_TOKEN", ""))

    def named(n, description=None):
        srv.tool(name=n, description=description or f"the tool {n}")(lambda: "ok " + n)

    while args:
        a = args.pop(0)
        if a == "--aware":
            @srv.tool(meta={"nanorl/session_reset": True})
            def reset(session: str, drop: bool = False) -> str:
                """Open or drop a session."""
                keys.append(session)
                return "ok"

            @srv.tool()
            def seen_keys() -> str:
                """The session keys reset was given."""
                return " ".join(keys)
        elif a == "--describe":
            srv.tool(name="wordy", description="w" * int(args.pop(0)))(lambda: "ok")
        elif a == "--annotated":  # no argument each: one marked as writing, one as read-only
            from mcp.types import ToolAnnotations
            srv.tool(name="wipe", annotations=ToolAnnotations(read_only_hint=False))(lambda: "wiped")
            srv.tool(name="peek", annotations=ToolAnnotations(read_only_hint=True))(lambda: "seen")
        elif a == "--many":
            n, m = map(int, args.pop(0).split(":"))
            for i in range(n):
                named(f"t{i}", "d" * m)
        elif a == "--http":
            http = int(args.pop(0))
        else:
            named(a)
    if http:
        srv.run("streamable-http", host="127.0.0.1", port=http)
    else:
        srv.run()
''')


@pytest.fixture(scope="module")
def server_py(tmp_path_factory):
    path = tmp_path_factory.mktemp("servers") / "third_party.py"
    path.write_text(SERVER)
    return str(path)


def spec(server_py, *argv, **keys):
    return {**PY, "args": [server_py, *argv], **keys}


def text_row_for(answer, check=()):
    return {"data_source": "t", "prompt": [{"role": "user", "content": "q"}], "env_class": "mcp",
            "reward_spec": {"method": "rule", "ground_truth": {"answer": answer, "type": "text", "check": list(check)}}}


def _listen(argv, port):
    """Start argv (a server on port) and wait until it listens."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{argv} did not listen")


# ---------------------------------------------------------------------------------------------
# secrets, by value (conn.secrets_of, conn.redact, Conn.describe)

# (args, the secrets among them): the forms a flag-name rule missed
FORMS = [
    (["--header", "Authorization: Bearer tOk9Xq2Lm7"], ["tOk9Xq2Lm7"]),  # how mcp-remote passes headers
    (["postgres://app:pW7Hk3q@db.internal:5432/prod"], ["pW7Hk3q"]),     # a database url, positional
    (["--dsn", "postgresql://ro:Zr8zQx1@10.0.0.5/x"], ["Zr8zQx1"]),
    (["--github-pat", "ghp_abc123XYZ789"], ["ghp_abc123XYZ789"]),
    (["-k", "sk-live-51Hq0"], ["sk-live-51Hq0"]),
    (["--password", "hunter"], ["hunter"]),                              # a word, but its flag says secret
    (["API_KEY=abcd1234", "--api-key=Qq55-rr"], ["abcd1234", "Qq55-rr"]),
]


@pytest.mark.parametrize("args, secrets", FORMS)
def test_each_argument_form_is_redacted_and_never_described(args, secrets):
    c = mcp_conn.Conn("db", {"command": "/usr/local/bin/db-mcp", "args": ["stdio", *args]}, 0)
    assert set(secrets) <= set(c.secrets), c.secrets
    d = c.describe()
    assert d == f"MCP server 'db' (command db-mcp with {len(args) + 1} arguments; config: mcp config)", d
    for s in secrets:
        for text in (f"error: {' '.join(args)} failed", repr(args), json.dumps({"argv": args}),
                     f"dsn={s.replace('@', '%40')}", f"bad token {s[:-2]}"):  # a message cut inside the secret
            out = c.redact(text)
            assert s not in out and s[:-2] not in out, (text, out)


def test_env_url_and_header_values_are_secrets_plain_values_are_not():
    cfg = {"command": "npx", "env": {"API_TOKEN": "x7-s3cr3t", "PGPASSWORD": "hunter", "LOG_LEVEL": "debug",
                                     "PYTHONPATH": ROOT},
           "args": ["-y", "@modelcontextprotocol/server-github", "mcp-server-time", "--port", "8765", __file__]}
    s = mcp_conn.secrets_of(cfg)
    assert "x7-s3cr3t" in s and "hunter" in s  # by value; by name
    for plain in ("debug", ROOT, "-y", "@modelcontextprotocol/server-github", "mcp-server-time", "8765", __file__):
        assert plain not in s, plain
    web = {"url": "https://me:Pw-url-1@mcp.example.com:8443/mcp?key=Q-url-2&mode=fast",
           "headers": {"Authorization": "Bearer Hd-3x9", "Accept": "application/json"}}
    s = mcp_conn.secrets_of(web)
    assert {"Pw-url-1", "Q-url-2", "fast", "Hd-3x9"} <= set(s) and "application/json" not in s and "Bearer" not in s
    assert mcp_conn.Conn("web", web, 0).describe() == "MCP server 'web' (url https://mcp.example.com:8443/mcp; config: mcp config)"
    assert mcp_conn.redact('x "Pw\\"q1" y', ['Pw"q1']) == "x \"***\" y"  # JSON-escaped


def test_start_error_and_forwarded_stderr_hold_no_secret(capfd):
    secrets = ["tOk9Xq2Lm7", "pW7Hk3q", "ghp_abc123XYZ789", "sk-live-51Hq0", "Env-S3cret-9"]
    script = 'echo "starting with $*" >&2; echo "token $VAULT_TOKEN" >&2; exit 3'
    cfg = {"command": "sh", "args": ["-c", script, "sh", "--header", f"Authorization: Bearer {secrets[0]}",
                                     f"postgres://app:{secrets[1]}@db/prod", "--github-pat", secrets[2], "-k", secrets[3]],
           "env": {"VAULT_TOKEN": secrets[4]}}
    with pytest.raises(ServerStartFailed) as e:
        MCPPool({"mcpServers": {"vault": cfg}})
    msg, err = str(e.value), capfd.readouterr().err
    assert not any(s in msg or s in err for s in secrets), (msg, err)
    assert "'vault' (command sh with 10 arguments;" in msg and "its stderr ended: starting with" in msg, msg
    assert "[mcp vault] token ***" in err and "\n" not in msg, err


# ---------------------------------------------------------------------------------------------
# the end to end run: train.py on CPU, a scripted "model" that calls tools, and servers with secrets
# in their arguments, url, headers and env that die after step 1 and cannot come back

E2E_SECRETS = {"header": "Hdr-T0ken-4f1Q", "dsn": "Dsn-Pa55-7Kx2", "pat": "ghp_Pat9ZZq81w", "k": "Kk-7731-Zeta",
               "env": "Env-T0k-55Aq", "urlpw": "UrlPw-83Lm", "query": "Qry-K3y-19b", "hdr": "XHdr-Val-62z"}


def _vault(server_py, flag):
    """A stdio server started through sh -c with secrets in its arguments and env; once flag exists it
    prints its arguments and env to stderr and exits (it cannot come back)."""
    s = E2E_SECRETS
    script = (f'if [ -e {shlex.quote(str(flag))} ]; then echo "vault: cannot start: $* $VAULT_TOKEN" >&2; exit 3; fi; '
              f'echo "vault: starting with $*" >&2; exec {shlex.quote(PY["command"])} {shlex.quote(server_py)} vault_query')
    return {"command": "sh", "args": ["-c", script, "sh", "--header", f"Authorization: Bearer {s['header']}",
                                      f"postgresql://app:{s['dsn']}@db.internal:5432/prod", "--github-pat", s["pat"],
                                      "-k", s["k"]],
            "env": {**PY.get("env", {}), "VAULT_TOKEN": s["env"]}}


def test_no_secret_reaches_a_run_file_or_the_console(tiny_model_dir, tmp_path, server_py, monkeypatch, capfd):
    import rollout
    import train
    s, flag, port = E2E_SECRETS, tmp_path / "vault-gone", _free_port()
    web_proc = _listen([PY["command"], BUNDLED_SERVER, "--http", str(port)], port)
    cfg = tmp_path / "servers.json"
    cfg.write_text(json.dumps({"mcpServers": {
        "vault": _vault(server_py, flag),
        "web": {"url": f"http://me:{s['urlpw']}@127.0.0.1:{port}/mcp?api_key={s['query']}",
                "headers": {"X-Api-Key": s["hdr"]}, "tools": ["calculate"], "startup_timeout": 5}}}))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(text_row_for("42")) + "\n")
    calls = {"n": 0}

    class Scripted(rollout.HFEngine):
        """Turn 1: call both servers; turn 2: answer. As step 2 starts, both servers die for good."""

        def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
            calls["n"] += 1
            if calls["n"] == 3:
                flag.write_text("1")
                web_proc.kill()
                for pid in vault_pids():
                    os.kill(pid, signal.SIGKILL)
            out = []
            for p in prompts:
                text = self.tok.decode(p)
                turn = (tc("pid") + tc("leak") + tc("vault_query") + tc("calculate", expression="6*7")
                        if text.count("<tool_response>") == 0 else "<answer>42</answer>")
                ids = self.tok.encode(turn, add_special_tokens=False) + [self.tok.eos_token_id]
                out.append([rollout.Completion(ids, [-0.5] * len(ids), "stop") for _ in range(n)])
            return out

    def vault_pids():
        return [int(d) for d in os.listdir("/proc") if d.isdigit() and _cmdline_has(d, "vault_query")]

    def engine(model, tok):
        e = Scripted(model, tok)
        e.tok = tok
        return e
    monkeypatch.setattr(train, "HFEngine", engine)
    argv = ["--model", tiny_model_dir, "--out-dir", str(tmp_path / "run"), "--steps", "3", "--prompts-per-step", "1",
            "--n", "2", "--max-tokens", "400", "--max-context", "4096", "--fewshot", "0", "--micro-batch-size", "2",
            "--eval-every", "0", "--env", "mcp", "--mcp-config", str(cfg), "--train-data", str(rows),
            "--eval-data", str(rows), "--max-turns", "3", "--max-error-steps", "1"]
    try:
        with pytest.raises(train.RunStopped) as stopped:
            train.main(argv)
    finally:
        web_proc.kill()
        web_proc.wait(10)
    out, err = capfd.readouterr()
    texts = {"console stdout": out, "console stderr": err, "RunStopped": str(stopped.value)}
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            texts[str(path)] = path.read_bytes().decode("utf-8", "replace")
    assert {"samples.jsonl", "episodes.jsonl", "episodes.html"} <= {os.path.basename(p) for p in texts}
    for where, text in texts.items():
        leaked = [name for name, secret in s.items() if secret in text]
        assert not leaked, f"{leaked} in {where}"
    episodes = (tmp_path / "run" / "episodes.jsonl").read_text()
    assert "MCP server 'vault' is down" in episodes and "cannot connect with token ***" in episodes  # written, redacted
    assert "[mcp vault] vault: starting with" in err and "[mcp vault] vault: cannot start: " in err


def _cmdline_has(pid, word):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return word.encode() in f.read().split(b"\0")
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# restarts: only a server that declared session state invalidates its episodes' sessions


def test_a_crash_costs_other_episodes_on_a_stateless_server_no_call(server_py):
    with MCPPool({"mcpServers": {"plain": spec(server_py)}}, call_timeout=10.0) as p:
        sessions = [p.open_session() for _ in range(4)]
        pid = {p.call(s, "pid", {})[0] for s in sessions}
        assert len(pid) == 1
        text, is_error, _, _ = p.call(sessions[0], "crash", {})  # the episode whose call crashed it reads that
        assert is_error and "exited during this call" in text, text
        for s in sessions:  # every episode goes on, on the new process, at no cost
            text, is_error, _, _ = p.call(s, "pid", {})
            assert not is_error and text not in pid, text
        assert p.restarts == 1
        os.kill(int(text), signal.SIGKILL)  # dead between calls: the next call was never sent, and runs
        time.sleep(0.3)
        text2, is_error, _, _ = p.call(sessions[1], "pid", {})
        assert not is_error and text2 != text and p.restarts == 2, text2


def test_calls_the_pool_kills_say_so_and_calls_queued_behind_a_restart_run(server_py):
    with MCPPool({"mcpServers": {"plain": spec(server_py)}}, call_timeout=20.0, max_timeouts=1) as p:
        stuck, busy, late = (p.open_session() for _ in range(3))
        old = p.call(late, "pid", {})[0]
        f_stuck = p.submit(stuck, "slow", {"seconds": 30}, timeout=0.5)  # times out: the pool restarts the server
        f_busy = p.submit(busy, "slow", {"seconds": 5})                  # in flight as the pool stops it
        time.sleep(0.7)
        f_late = p.submit(late, "pid", {})                               # arrives while the restart runs
        text, is_error, timed_out, _ = f_stuck.result(60)
        assert timed_out and "1 calls in a row timed out" in text, text
        text, is_error, timed_out, _ = f_busy.result(60)
        assert is_error and "exited" not in text and "the pool stopped the server during this call" in text, text
        assert "1 calls in a row timed out" in text and "may or may not have run" in text, text
        text, is_error, _, _ = f_late.result(60)
        assert not is_error and text != old, text
        assert p.restarts == 1


def test_a_stateless_http_server_restart_costs_no_call(server_py):
    port = _free_port()
    argv = [PY["command"], server_py, "--http", str(port)]
    proc = _listen(argv, port)
    try:
        with MCPPool({"mcpServers": {"web": {"url": f"http://127.0.0.1:{port}/mcp", "startup_timeout": 5}}}) as p:
            a, b = p.open_session(), p.open_session()
            old = p.call(a, "pid", {})[0]
            assert p.call(b, "pid", {})[0] == old
            proc.kill()
            proc.wait(10)
            proc = _listen(argv, port)  # same url, new process: our session id is unknown there (404)
            for s in (a, b):  # a: refused unrun, sent again after the reconnect; b: re-pinned at its next call
                text, is_error, _, _ = p.call(s, "pid", {})
                assert not is_error and text == str(proc.pid), text
            assert p.restarts == 1
    finally:
        proc.kill()
        proc.wait(10)


def test_a_session_aware_restart_still_tells_the_episodes_that_had_state():
    # the bundled server declares session state: an episode that stored something reads that it is
    # gone; one that had not called it yet goes on at no cost
    with MCPPool(bundled_config(test_tools=True), call_timeout=10.0) as p:
        had, fresh = p.open_session(), p.open_session()
        pid = int(p.call(had, "pid", {})[0])
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)
        text, is_error, _, _ = p.call(fresh, "calculate", {"expression": "6*7"})
        assert (text, is_error) == ("42", False)
        text, is_error, _, _ = p.call(had, "calculate", {"expression": "6*7"})
        assert is_error and "restarted since this episode's last call (it exited by itself)" in text, text
        assert "what this episode stored on it is gone" in text
        assert p.call(had, "calculate", {"expression": "6*7"})[0] == "42"


# ---------------------------------------------------------------------------------------------
# session keys, the bundled tools' names, the tool list's size, the pool's arguments


def test_each_session_aware_server_gets_a_key_of_its_own(server_py):
    cfg = {"mcpServers": {**bundled_config()["mcpServers"], "other": spec(server_py, "--aware")}}
    with MCPPool(cfg, call_timeout=10.0) as p:
        assert p.session_aware == {"nanorl": True, "other": True}
        sess = p.open_session()
        seen = p.call(sess, "seen_keys", {})[0].split()
        mine, bundled = p.session_key(sess, "other"), p.session_key(sess, "nanorl")
        assert seen == [mine] and mine != bundled and sess["key"] not in (mine, bundled)
        # state on the bundled server lives under its own key, whoever passes the episode's key
        assert not p.call(sess, "kb_set", {"key": "k1", "value": "v1"})[1]
        assert p.call_real(sess, "nanorl", "kb_get", {"key": "k1", "session": sess["key"]})[0] == "v1"
        assert p.call_real(sess, "nanorl", "kb_get", {"key": "k1", "session": bundled})[0] == "v1"
        p.close_session(sess)


def test_third_party_tools_named_like_the_bundled_ones_never_rename_them(server_py, capfd):
    names = ["calculate", "kb_get", "kb_set", "sql_query"]
    cfg = {"mcpServers": {"other": spec(server_py, *names), **bundled_config()["mcpServers"]}}
    with MCPPool(cfg, call_timeout=10.0) as p:
        for n in names:
            assert p.route[n][:2] == ("nanorl", n) and p.route[f"other__{n}"][:2] == ("other", n)
        env = MCPEnv(pool=p)  # a bundled row with a state check: it used to fail at reset (unknown kb_get)
        env.reset(text_row_for("ok", check=[{"tool": "kb_get", "arguments": {"key": "k"}, "expect": "v"}]))
        obs, _, done, info = env.step(tc("kb_set", key="k", value="v") + tc("other__kb_get"))
        assert not done and info["tool_errors"] == 0 and obs[1]["content"] == "ok kb_get", obs
        assert env.step("<answer>ok</answer>")[1] == 1.0
    err = capfd.readouterr().err
    assert "server 'other': calculate, kb_get, kb_set, sql_query shown as other__calculate" in err, err


def test_no_argument_says_which_tools_a_probe_may_call(server_py):
    # needs no argument and is not marked as writing (MCP's readOnlyHint false); session is the pool's, not one
    with MCPPool({"mcpServers": {"other": spec(server_py, "--annotated"), **bundled_config()["mcpServers"]}}) as p:
        assert set(p.no_argument) == {t["function"]["name"] for t in p.tools}
        assert p.no_argument["pid"] and p.no_argument["peek"] and not p.no_argument["wipe"] and not p.no_argument["slow"]
        assert p.no_argument["db_tables"] and p.no_argument["cart_view"] and not p.no_argument["db_describe"]
        assert p.no_argument["pid"] is True and p.no_argument["db_tables"] is True
    # a row_tools server's: only for a row that names it (options/rescue.probe_calls)
    with MCPPool({"mcpServers": {"other": {**spec(server_py, "--annotated"), "row_tools": True}, **bundled_config()["mcpServers"]}}) as p:
        assert p.no_argument["pid"] == "row" and p.no_argument["db_tables"] is True and not p.no_argument["wipe"]


def test_long_descriptions_are_cut_and_the_prompt_size_is_said(server_py, capfd):
    with MCPPool({"mcpServers": {"wordy": spec(server_py, "--describe", "50000")}}) as p:
        d = next(t["function"]["description"] for t in p.tools if t["function"]["name"] == "wordy")
        assert d == "w" * mcp_pool.MAX_DESCRIPTION_CHARS + " [... cut]"
        assert p.tool_chars == sum(len(json.dumps(t, ensure_ascii=False)) for t in p.tools) < 4000
        n = len(p.tools)
    err = capfd.readouterr().err
    assert "server 'wordy': the description of wordy cut to 2000 characters" in err, err
    assert f"every prompt holds {n} tools, {p.tool_chars:,} characters of tool schemas" in err, err


@pytest.mark.parametrize("argv, what", [(["--many", "200:10"], "204 tools"),  # past 128 tools
                                        (["--many", "40:1900"], "44 tools, 8")])   # past 64,000 characters
def test_a_tool_list_too_big_for_the_prompt_is_an_error(server_py, argv, what):
    with pytest.raises(ValueError, match=rf"mcp config: the servers show the model .*{what}.*at most 128 tools "
                                         r"and 64,000 characters .*exclude_tools.*\(big: "):
        MCPPool({"mcpServers": {"big": spec(server_py, *argv)}})


def test_headers_are_checked_and_need_a_url():
    from mcp_tools.config import check_config
    assert check_config({"mcpServers": {"w": {"url": "http://127.0.0.1:1/mcp", "headers": {"X-Key": "v"}}}})
    with pytest.raises(ValueError, match=r"mcpServers.w.headers must be an object of strings"):
        check_config({"mcpServers": {"w": {"url": "http://127.0.0.1:1/mcp", "headers": {"X-Key": 1}}}})
    with pytest.raises(ValueError, match=r"mcpServers.w: headers are sent to an HTTP server: they need \"url\""):
        check_config({"mcpServers": {"w": {"command": "x", "headers": {"X-Key": "v"}}}})


@pytest.mark.parametrize("key, value", [("call_timeout", 0), ("call_timeout", -1), ("call_timeout", math.nan),
                                        ("call_timeout", math.inf), ("call_timeout", True), ("call_timeout", "5"),
                                        ("start_timeout", 0), ("start_timeout", math.nan), ("replicas", 0),
                                        ("max_timeouts", 0), ("max_timeouts", 1.5)])
def test_pool_arguments_are_checked(key, value):
    t0 = time.time()
    with pytest.raises(ValueError, match=rf"^MCPPool {key}="):
        MCPPool(bundled_config(), **{key: value})
    assert time.time() - t0 < 1  # refused before any server starts


# ---- lab/transfer.py: the transfer set on third-party MCP servers (sqlite, git, time, excel). The first
# tests need no server: the rows' answers against a recomputation from the data written
# (the tables read whole into Python, `git log` parsed here, UTC offsets, the workbook's XML read back),
# the families and their call counts, determinism (the repo's hashes, the workbook's bytes), and that no
# multi question names a table, sheet or column. The last replays a few rows of each family through
# MCPEnv on the real servers; it skips without mcp-server-git or excel-mcp-server, or without an
# mcp-server-sqlite that can start (it needs mcp<2: lab/transfer.py's doc; point NANORL_SQLITE_SERVER at its script)

T = load_script("lab/transfer.py", "transfer")
# the newest commit of the repo the script writes: every git-multi oracle call names a hash of this
# history, so a change here (a date, a name, a file's content) changes the rows
HEAD = "13ac3906029db78ac3a5e57a57894d012f41f5e8"
OFFSETS = {"Asia/Tokyo": 9.0, "Asia/Kolkata": 5.5, "Asia/Shanghai": 8.0, "UTC": 0.0, "Asia/Dubai": 4.0,
           "Europe/Moscow": 3.0, "Asia/Karachi": 5.0, "Asia/Bangkok": 7.0, "America/Bogota": -5.0, "Asia/Kathmandu": 5.75}
READ_TOOLS = {"list_tables", "describe_table", "read_query", "git_log", "git_show", "convert_time", "describe_workbook",
              "read_range"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("transfer")
    server = os.environ.get("NANORL_SQLITE_SERVER", "mcp-server-sqlite")
    assert T.main(["--out", str(out), "--sqlite-server", server]) == 0
    return out, list(load_rows(str(out / "rows.jsonl")))


def _recompute_sqlite(db_path, q):
    """The answer to a sqlite-multi question, from the three tables read whole (no SQL joins)."""
    with closing(sqlite3.connect(db_path)) as db:
        authors = {a: (name, ctry) for a, name, ctry, _ in db.execute("SELECT * FROM auth_reg")}
        books = {b: (title, a, pages, year) for b, title, a, pages, year, _ in db.execute("SELECT * FROM bk_cat")}
        loans = [(b, fee) for _, b, _, _, fee in db.execute("SELECT * FROM circulation")]
    by_title = {title: b for b, (title, *_) in books.items()}
    if m := re.search(r"more than (\d+) pages", q):
        return sum(p > int(m[1]) for _, _, p, _ in books.values())
    if m := re.search(r"published before (\d+)", q):
        return sum(y < int(m[1]) for *_, y in books.values())
    if m := re.search(r"authors from (\w+)\?", q):
        return sum(authors[a][1] == m[1] for _, a, _, _ in books.values())
    if m := re.search(r"Which country is the author of the book '(.+)' from", q):
        return authors[books[by_title[m[1]]][1]][1]
    if m := re.search(r"has the book '(.+)' been lent out", q):
        return sum(b == by_title[m[1]] for b, _ in loans)
    if m := re.search(r"late fee.* the book '(.+)'\?", q):
        return sum(fee for b, fee in loans if b == by_title[m[1]])
    if m := re.search(r"books written by (.+)\?", q):
        return sum(authors[books[b][1]][0] == m[1] for b, _ in loans)
    raise AssertionError(f"no recomputation for {q!r}")


def _git_history(repo):
    """message -> (author, email, files), from `git log --name-only` (not the script's diff-tree)."""
    text = subprocess.run(["git", "-C", str(repo), "log", "--format=%x00%s%x1f%an%x1f%ae", "--name-only"],
                          capture_output=True, text=True, check=True).stdout
    out = {}
    for block in text.split("\x00")[1:]:
        head, *files = block.strip().split("\n")
        msg, name, email = head.split("\x1f")
        out[msg] = (name, email, [f for f in files if f])
    return out


def _read_xlsx(path):
    """{sheet name: {cell reference: value}} from the workbook's own XML (not the script's data): a number
    cell as an int, an inline string as text."""
    import xml.etree.ElementTree as ET
    import zipfile
    ns = {"m": "http://schemas.openxmlformats.org/spreadsheetml/2006/main"}
    with zipfile.ZipFile(path) as z:
        names = [e.get("name") for e in ET.fromstring(z.read("xl/workbook.xml")).iter(f"{{{ns['m']}}}sheet")]
        out = {}
        for i, name in enumerate(names, 1):
            cells = {}
            for c in ET.fromstring(z.read(f"xl/worksheets/sheet{i}.xml")).iter(f"{{{ns['m']}}}c"):
                cells[c.get("r")] = c.find("m:is/m:t", ns).text if c.get("t") == "inlineStr" else int(c.find("m:v", ns).text)
            out[name] = cells
    return out


def _recompute_excel(cells, q):
    """The answer to an excel question, from the workbook's cells (by header: sheets' columns A.. in order)."""
    def rows(sheet):
        grid = collections.defaultdict(dict)
        for ref, v in cells[sheet].items():
            grid[int(ref[1:])][ref[0]] = v
        head = [grid[1][c] for c in sorted(grid[1])]
        return [dict(zip(head, (grid[r][c] for c in sorted(grid[r])))) for r in sorted(grid) if r > 1]
    if m := re.search(r"the cell (\w+) in the sheet '(\w+)'", q):
        return cells[m[2]][m[1]]
    items, sups, ships = rows("inv_q3"), rows("sup_ls"), rows("shp_24")
    item = next((i for i in items if f"'{i['itm_nm']}'" in q), None)
    if "in stock" in q:
        return item["qty"]
    if "unit price" in q:
        return item["unit_c"]
    if "which city" in q:
        return next(s["hq_cty"] for s in sups if s["sup_id"] == item["sup_ref"])
    if m := re.search(r"the supplier '(.+)' supply", q):
        sid = next(s["sup_id"] for s in sups if s["sup_nm"] == m[1])
        return sum(i["sup_ref"] == sid for i in items)
    if "shipped in total" in q:
        return sum(s["n_unt"] for s in ships if s["sku_ref"] == item["sku"])
    raise AssertionError(f"no recomputation for {q!r}")


def _check_answers(out, rows):
    """Every row's answer against a recomputation from the world written in out."""
    history, cells = _git_history(out / "repo"), _read_xlsx(out / "sheets" / T.WORKBOOK)
    for r in rows:
        q, gt, fam = r["prompt"][1]["content"], r["reward_spec"]["ground_truth"], r["extra_info"]["family"]
        assert check_ground_truth(gt) is None and gt["answer"] == r["extra_info"].get("oracle_answer", gt["answer"])
        if fam == "sqlite-multi":
            want = _recompute_sqlite(out / "library.db", q)
        elif fam == "sqlite-one":  # the question names table and column: one aggregate, computed here
            t, col = re.search(r"table (\w+),", q)[1], re.search(r"(?:have|column) (\w+)", q)[1]
            with closing(sqlite3.connect(out / "library.db")) as db:
                vals = [v for (v,) in db.execute(f"SELECT {col} FROM {t}")]
            m = re.search(r"greater than (\d+)", q)
            want = sum(v > int(m[1]) for v in vals) if m else \
                {"largest": max, "smallest": min, "sum": sum}[re.search(r"is (?:the )?(\w+)", q)[1]](vals)
        elif fam.startswith("excel"):
            want = _recompute_excel(cells, q)
        elif fam.startswith("git"):
            name, email, files = history[re.search(r"message '(.+)'", q)[1]]
            want = (name if "who is the author" in q else email if "email" in q
                    else len(files) if "how many files" in q else files[0])
        elif m := re.search(r"When it is (\d\d):(\d\d) in the time zone (\S+), what time is it in (\S+)\?", q):
            minutes = (int(m[1]) * 60 + int(m[2]) + round((OFFSETS[m[4]] - OFFSETS[m[3]]) * 60)) % 1440
            want = f"{minutes // 60:02d}:{minutes % 60:02d}"
        else:
            m = re.search(r"hours is (\S+) ahead of (\S+)\?", q)
            want = OFFSETS[m[1]] - OFFSETS[m[2]]
        assert answer_matches(str(want), gt["answer"], gt["type"]), (q, want, gt)


def test_rows_answer_what_the_data_says(built):
    out, rows = built
    assert all("oracle_answer" in r["extra_info"] for r in rows)
    _check_answers(out, rows)


def test_train_split_is_a_users_rows_over_a_world_of_its_own(built, tmp_path):
    # --split train: rows a user brings for the same servers (a question and an answer, no oracle calls), over
    # another world (its own database, workbook and repo of other commits), no question a test question
    out, test_rows = built
    assert T.main(["--split", "train", "--out", str(tmp_path), "--sqlite-server", "mcp-server-sqlite"]) == 0
    rows = list(load_rows(str(tmp_path / "rows.jsonl")))
    fams = collections.Counter(r["extra_info"]["family"] for r in rows)
    assert set(fams) == set(T.FAMILIES) and fams["sqlite-multi"] >= 90 and fams["excel-multi"] >= 40 and len(rows) > 250
    assert all(r["extra_info"]["split"] == "train" and "oracle_calls" not in r["extra_info"] for r in rows)
    assert not {r["prompt"][1]["content"] for r in rows} & {r["prompt"][1]["content"] for r in test_rows}
    text = lambda rs: {r["reward_spec"]["ground_truth"]["answer"] for r in rs if r["extra_info"]["family"] != "time-one"
                       and r["reward_spec"]["ground_truth"]["type"] == "text"}
    assert not text(rows) & text(test_rows)  # no name, email, path, country or city answers both (times may: HH:MM)
    _check_answers(tmp_path, rows)  # recomputed from the training world's own data
    assert not set(_git_history(tmp_path / "repo")) & set(_git_history(out / "repo"))  # no commit message shared
    assert (tmp_path / "library.db").read_bytes() != (out / "library.db").read_bytes()
    servers = load_config(str(tmp_path / "servers.json"))["mcpServers"]
    assert str(tmp_path / "library.db") in servers["sqlite"]["args"] and servers["git"]["cwd"] == str(tmp_path / "repo")
    assert T.main(["--split", "train", "--out", str(tmp_path / "ex"), "--sqlite-server", "mcp-server-sqlite",
                   "--exclude", str(out / "rows.jsonl")]) == 0  # the built test set's questions: the same rows
    assert (tmp_path / "ex" / "rows.jsonl").read_text() == (tmp_path / "rows.jsonl").read_text()
    with pytest.raises(SystemExit):  # the test set's own world
        T.main(["--split", "train", "--seed", "0", "--out", str(tmp_path / "x")])


def test_check_refuses_rows_without_oracle_calls(built, tmp_path, capsys):
    # --check replays each row's oracle calls: a training folder (--split train) has none, and says so
    out, rows = built
    (tmp_path / "servers.json").write_text((out / "servers.json").read_text())
    (tmp_path / "rows.jsonl").write_text(json.dumps({**rows[0], "extra_info": {"family": "sqlite-multi"}}) + "\n")
    assert not T.check(str(tmp_path)) and "a row without oracle calls" in capsys.readouterr().out


def test_families_calls_and_names(built):
    out, rows = built
    by_fam = collections.defaultdict(list)
    for r in rows:
        by_fam[r["extra_info"]["family"]].append(r)
        assert r["data_source"] == f"transfer/{r['extra_info']['family']}" and r["env_class"] == "mcp"
        assert {c["name"] for c in r["extra_info"]["oracle_calls"]} <= READ_TOOLS  # no write tool
    assert {f: len(rs) for f, rs in by_fam.items()} == T.FAMILIES
    calls = {f: collections.Counter(len(r["extra_info"]["oracle_calls"]) for r in rs) for f, rs in by_fam.items()}
    assert set(calls["sqlite-multi"]) <= {3, 4, 5} and calls["sqlite-multi"][3] <= 15  # most rows join tables
    assert calls["git-multi"] == {2: 20} and calls["excel-multi"] == {2: 8, 3: 12}
    assert all(calls[f] == {1: 10} for f in ("sqlite-one", "git-one", "excel-one", "time-one"))
    for fam, tables in (("sqlite-multi", T.TABLES), ("excel-multi", T.SHEETS)):
        names = {n for t, cols in tables.items() for n in [t, *cols]}
        for r in by_fam[fam]:  # discovery is needed: the question names no table, sheet or column
            words = set(re.findall(r"\w+", r["prompt"][1]["content"].lower()))
            assert not words & names, r["prompt"][1]["content"]
    assert str(out) not in (out / "rows.jsonl").read_text()  # the rows name no path of this machine
    servers = load_config(str(out / "servers.json"))["mcpServers"]
    assert {k: s.get("exclude_tools") for k, s in servers.items()} == {**T.HIDDEN, "time": None}
    assert "--read-only" in servers["excel"]["args"]  # the workbook server offers no write tool


def test_build_is_deterministic(built, tmp_path):
    out, _ = built
    T.main(["--out", str(tmp_path), "--sqlite-server", "mcp-server-sqlite"])
    assert (tmp_path / "rows.jsonl").read_text() == (out / "rows.jsonl").read_text()
    head = subprocess.run(["git", "-C", str(tmp_path / "repo"), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert head == HEAD
    book = os.path.join("sheets", T.WORKBOOK)
    assert (tmp_path / book).read_bytes() == (out / book).read_bytes()


def test_transfer_recipe_installs_the_servers_then_builds_and_checks(tmp_path):
    # lab/recipes/transfer.sh with stand-ins for python (and the venv's): the servers beside the project when they do
    # not import, mcp-server-sqlite in a venv of its own (mcp<2), from WHEELS only when given; then the rows, --check,
    # and with TRAIN=1 the training rows excluding the test set's questions; a failed check stops it
    import subprocess
    import textwrap
    bin_, log, venv = tmp_path / "bin", tmp_path / "calls.log", tmp_path / "sqv"
    bin_.mkdir()
    (bin_ / "python").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        echo "python $*" >> {log}
        case "$*" in
          "-c import mcp_server_git"*) exit 1 ;;
          "-m venv "*) mkdir -p $3/bin; printf '#!/bin/bash\\necho "venv $*" >> {log}\\n' > $3/bin/python; chmod +x $3/bin/python
                       touch $3/bin/mcp-server-sqlite; chmod +x $3/bin/mcp-server-sqlite ;;
          *--check*) exit ${{CHECK_RC:-0}} ;;
        esac
        """))
    (bin_ / "python").chmod(0o755)
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lab", "recipes", "transfer.sh")

    def run(**env):
        log.write_text("")
        e = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SQLITE_VENV": str(venv), **env}
        p = subprocess.run(["bash", recipe, "tx"], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=60)
        return p, log.read_text().splitlines()
    p, calls = run(WHEELS="/w", TRAIN="1")
    assert p.returncode == 0, p.stderr
    sq = f"{venv}/bin/mcp-server-sqlite"
    assert calls == [
        "python -c import mcp_server_git, excel_mcp, mcp_server_time",
        "python -m pip install -q --no-index --find-links /w mcp-server-git excel-mcp-server mcp-server-time",
        f"python -m venv {venv}",
        "venv -m pip install -q --no-index --find-links /w mcp-server-sqlite==2025.4.25 mcp>=1.6,<2",
        f"python lab/transfer.py --out tx --sqlite-server {sq}",
        "python lab/transfer.py --out tx --check",
        f"python lab/transfer.py --split train --out tx-train --sqlite-server {sq} --exclude tx/rows.jsonl"]
    p, calls = run(CHECK_RC="1", TRAIN="1")  # the venv is there now: not made again; no WHEELS: the index
    assert p.returncode == 1 and calls[1] == "python -m pip install -q mcp-server-git excel-mcp-server mcp-server-time"
    assert not any("venv" in c for c in calls) and calls[-1] == "python lab/transfer.py --out tx --check"


def test_oracle_scores_one_wrong_scores_zero_on_the_servers(built, capsys):
    out, _ = built
    for module, package in (("mcp_server_git", "mcp-server-git"), ("excel_mcp", "excel-mcp-server")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{package} is not installed (not in requirements.txt): pip install {package}")
    if why := T.sqlite_problem(json.loads((out / "servers.json").read_text())["mcpServers"]["sqlite"]["command"]):
        pytest.skip(f"no mcp-server-sqlite that can start: {why}; set NANORL_SQLITE_SERVER")
    ok = T.check(str(out), limit=3)
    printed = capsys.readouterr().out
    assert ok, printed
    assert printed.count(" ok") == len(T.FAMILIES), printed


@pytest.mark.parametrize("depth", [1, 2])
def test_rescue_branch_replays_the_groups_own_turns_on_the_real_server(tiny_model_dir, tmp_path, monkeypatch, depth):
    # --rescue ...,branch=1 through train.py, the bundled server over stdio and the hermes format: the unguided
    # group's turns up to its failed call (a bad expression; at depth 2 after a call that worked) are played again
    # as given turns under the answer hint, and the continuation passes after them, trained behind the group's
    # own turns (options/rescue.py, branch=F)
    import train
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({**row_for("391"), "prompt": [{"role": "user", "content": "What is 17 times 23?"}]}) + "\n")
    cfg = tmp_path / "servers.json"
    cfg.write_text(json.dumps({"mcpServers": {"nanorl": {**PY, "tools": ["calculate"]}}}))  # a short prompt
    seen = []

    def say(text):
        """Unhinted: calls that work (depth 2), one that fails, then a guess. Hinted, after the played turns: the
        right call, then 391."""
        hinted, results = "the correct final answer is 391" in text, text.count("<tool_response>")
        seen.append((hinted, results))
        if hinted:
            return tc("calculate", expression="17*23") if results == depth else "<answer>391</answer>"
        if results < depth - 1:
            return tc("calculate", expression="17+0")
        return tc("calculate", expression="17 x 23 apples") if results == depth - 1 else "<answer>0</answer>"
    say_engine(monkeypatch, train, say)
    argv = ["--model", tiny_model_dir, "--out-dir", str(tmp_path / "run"), "--steps", "1", "--prompts-per-step", "1",
            "--n", "2", "--max-tokens", "400", "--max-context", "4096", "--fewshot", "0", "--micro-batch-size", "2",
            "--eval-every", "0", "--env", "mcp", "--mcp-config", str(cfg), "--train-data", str(rows), "--max-turns", "4",
            "--rescue", "hint=10,source=answer,branch=1"]
    h = train.main(argv)["history"][0]
    assert h["rescue_branched"] == 1 and h["rescue_solved"] == 1.0 and h["rescue_ungrounded"] == 0
    assert h["rescue_branch_turns"] == depth
    assert (True, depth) in seen and not any(hinted and r < depth for hinted, r in seen)  # all after the played turns
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    branched = [e for e in episodes if e["info"].get("branched")]
    assert len(branched) == 2 and all(e["info"]["correct"] and e["info"]["branched"] == depth for e in branched)
    first = branched[0]["segments"][0]  # the group's own turns up to the failed call, as context
    assert not first["trained"] and "17 x 23 apples" in first["text"] and "Error" in first["text"]
    assert ("17+0" in first["text"]) == (depth == 2)
