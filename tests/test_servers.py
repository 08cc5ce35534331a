"""Server robustness of mcp_tools/pool.py, conn.py and config.py, with real server processes (as in
tests/test_mcp.py): secrets redacted by value (unit tests per form, and end to end through
train.py: no secret in any run file or on the console), restarts that cost a call only where an
episode had state, one session key per server, the bundled tools' names kept, caps on the tool
list, and the pool's own arguments checked. Run: python -m pytest -q tests/test_servers.py (~30-40 s)
"""
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mcp_tools import conn as mcp_conn  # noqa: E402
from mcp_tools import pool as mcp_pool  # noqa: E402
from mcp_tools.config import BUNDLED_SERVER, bundled_config  # noqa: E402
from mcp_tools.env import MCPEnv  # noqa: E402
from mcp_tools.pool import MCPPool, ServerStartFailed  # noqa: E402

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


def tc(tool, /, **arguments):
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


def row_for(answer, check=()):
    return {"data_source": "t", "prompt": [{"role": "user", "content": "q"}], "env_class": "mcp",
            "reward_spec": {"method": "rule", "ground_truth": {"answer": answer, "type": "text", "check": list(check)}}}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    rows.write_text(json.dumps(row_for("42")) + "\n")
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
        env.reset(row_for("ok", check=[{"tool": "kb_get", "arguments": {"key": "k"}, "expect": "v"}]))
        obs, _, done, info = env.step(tc("kb_set", key="k", value="v") + tc("other__kb_get"))
        assert not done and info["tool_errors"] == 0 and obs[1]["content"] == "ok kb_get", obs
        assert env.step("<answer>ok</answer>")[1] == 1.0
    err = capfd.readouterr().err
    assert "server 'other': calculate, kb_get, kb_set, sql_query shown as other__calculate" in err, err


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
