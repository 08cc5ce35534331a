r"""
The MCP server side of env.MCPEnv: MCPPool keeps long-lived connections to the configured MCP
servers (config.py; one connection: conn.py), shared by every episode. It pins each episode to a
replica, keeps per-episode state apart with session keys, restarts dead or hung servers (backing
off from ones that stay down) and kills what it started. Its ServerFailed ends one episode, never
the run (MCPEnv: info["error"]).

Pool design (the simplest one we found that is correct under concurrency):
  - One asyncio loop in one daemon thread owns every connection (conn.Conn). Calls are blocking and
    thread-safe (asyncio.run_coroutine_threadsafe): the rollout's threads run many episodes' tool
    calls at once, and a slow tool blocks only its own episode.
  - `replicas` processes per server (default 1: mcp 2.3 runs sync tools in a thread pool, so one
    process serves concurrent calls); an episode is pinned to one replica.
  - Per-episode state via session keys, not a process per episode (run_episodes resets a whole
    batch before the first step). A server whose `reset(session)` carries the _meta mark
    config.session_hook reads is *session-aware*:
    the env calls reset(session=KEY) as the episode starts and reset(session=KEY, drop=True) at its
    close, hides `reset`, strips `session` from the schemas shown, and injects session=KEY into
    every tool that declares it (the bundled server works this way). KEY is per server,
    HMAC(episode key, server name) (session_key), so no server learns another's. Other servers
    are shared as they are: fine when stateless; a stateful one needs "isolation": "episode", a
    process per episode (started in env.reset, stopped by close_session; state in files is isolated
    only for the files its "copy" lists). Cost: a process start (spawn, imports, handshake) per
    episode per such server, concurrent across a batch, and one live process per live episode.
  - Restarts. A dead or hung server costs an episode at most one error observation, never the
    episode: it is restarted once (a generation counter makes concurrent failures restart it once),
    and each episode pinned to it is re-pinned to the new process (its session reset there) at its
    next call. That call fails ("what this episode stored on it is gone; not run") only where the
    episode had state: a session-aware server it had called. Elsewhere (a stateless server, an
    episode that had not called it yet) the call simply runs on the new process, as do calls that
    reach the pool while it is restarting a hung server; a call in flight when the process ended is
    an error that says who ended it: it exited by itself, or the pool stopped it and why (N calls
    in a row timed out), in which case the call may have run. A call an HTTP server refused unrun
    (a session it no longer knew) is sent again. Hung: _timed_out; between episodes: open_session.
  - A server that stays down: a failed restart is retried only after a backoff (1, 2, 4, ... 60 s);
    meanwhile its calls fail at once with ServerFailed. An episode is opened on a down server at
    its first call there, so episodes that never call it do not fail. Each restart prints one
    line; pool.down() says which servers are down, since when and why.
  - What is lost: a connection is lost when its transport ended (the SDK's dispatcher saw EOF),
    when an HTTP server no longer knows our session (404: it restarted on the same url, or
    expired the session; conn.py), or when calls keep timing out. A JSON-RPC error the server
    sends, whatever its code (-32000 and -32001 included), is a tool error for that call only.
  - Bad input stays in its episode: arguments UTF-8 cannot encode are refused before sending, a
    request the SDK cannot serialise fails that call only, results are bounded in transport.
  - Startup within startup_timeout, else ServerStartFailed (one line) and the child is killed.
    Cleanup: close() (also `with`, atexit, so Ctrl-C) stops and, if need be, SIGKILLs what it
    started; a hard-killed trainer leaves servers a closed stdin, and stdio servers exit on EOF.

Tool names: a tool keeps its server's name for it; a name two servers offer is "<server>__<tool>"
for both, except the bundled server's (the rows' state checks name them: _name_tools), which keep
theirs, the other server's being prefixed; each rename is printed. A name that still means two
tools (a tool really called "a__x"), and a server that shows no tool (an empty allow-list), are
config errors naming the servers. pool.tools: the schemas the model sees (OpenAI format; titles
and `session` stripped; descriptions cut at MAX_DESCRIPTION_CHARS, 2,000). Every prompt holds
them all (of a "row_tools" server, only those a row names: MCPEnv.reset): more than MAX_TOOLS (128)
tools or MAX_TOOL_CHARS (64,000 characters, ~16K tokens, half of a 32K context) is a config error;
the start prints what the prompt holds (pool.tool_chars). pool.no_argument: each shown name -> whether
the tool needs no argument and its server does not mark it as writing (MCP's readOnlyHint false): the
tools a --rescue probe may call on the policy's behalf (options/rescue.py); "row" for a row_tools server's
(a probe calls it only for a row that names it).
Secrets in a server's config never reach a message the pool prints or returns (conn.py, Secrets).

Use (what MCPEnv does per episode):
    with MCPPool(bundled_config()) as pool:             # or a config dict / file path; None = bundled
        sess = pool.open_session()
        text, is_error, timed_out, seconds = pool.call(sess, "calculate", {"expression": "2*21"})
        pool.close_session(sess)

Test: python -m pytest -q tests/test_mcp.py   (kill, timeout and restart tests use the real pool)
      python -m pytest -q tests/test_mcp.py  (its pool section: secrets, restarts of stateless servers, keys, tool caps)
"""
import asyncio
import atexit
import concurrent.futures
import hashlib
import hmac
import itertools
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import anyio

from mcp_tools.config import (BUNDLED_SERVER_NAME, MAX_SECONDS, bundled_config, check_config, load_config,
                              openai_schema, sane_seconds, session_hook, unencodable)
from mcp_tools.conn import Conn, ServerStartFailed, child_pids

HIDDEN_TOOLS = ("reset",)  # hidden only on session-aware servers (see module doc)
MAX_TIMEOUTS = 3  # calls in a row on one connection that time out before the pool restarts it
MAX_TOOLS = 128   # tools the model may be shown (OpenAI's API takes no more in one request)
MAX_TOOL_CHARS = 64_000  # characters of tool schemas in every prompt: ~16K tokens, half of a 32K context
MAX_DESCRIPTION_CHARS = 2_000  # a tool's description past this is cut, with a warning
# transport failures that mean the connection is gone (anyio's, as raised under mcp 2.3)
_TRANSPORT_ERRORS = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, ConnectionError)


class ServerFailed(RuntimeError):
    """An episode's server is down: it could not be restarted, or the pool is backing off from
    restarting it. MCPEnv catches it and ends the episode as an error (info["error"])."""


class _Lost(Exception):
    """The connection died under a call (or was restarted because it hung): the episode re-pins.
    unsent: no server ran the call (the process had ended before it, or an HTTP server refused it for
    a session it no longer knew), so it may be sent again."""

    def __init__(self, why: str, timed_out: bool = False, unsent: bool = False):
        super().__init__(why)
        self.timed_out, self.unsent = timed_out, unsent


def _closed(session, unknown: bool = True) -> bool:
    """Has the session's transport ended? mcp 2.3's JSONRPCDispatcher sets _closed at EOF before it
    fails the pending calls with CONNECTION_CLOSED, which is how a real close differs from a server
    that sends -32000 itself. Unknown SDK layout: `unknown` (closed, the old behaviour, after an error)."""
    return getattr(getattr(session, "_dispatcher", None), "_closed", unknown)


def _result_text(result) -> str:
    parts = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and isinstance(getattr(block.resource, "text", None), str):
            parts.append(block.resource.text)  # an embedded text resource (a blob stays a marker)
        else:
            parts.append(f"[{kind or '?'} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


class MCPPool:
    """Long-lived MCP server connections shared by every episode. Use as a context manager."""

    def __init__(self, config: dict | str | None = None, replicas: int = 1, call_timeout: float = 30.0,
                 start_timeout: float = 30.0, max_timeouts: int = MAX_TIMEOUTS):
        for key, v in (("call_timeout", call_timeout), ("start_timeout", start_timeout)):
            if not sane_seconds(v):  # 0, -1, nan: every call "timed out after 0 s", or none ever does
                raise ValueError(f"MCPPool {key}={v!r}: want a positive number of seconds, at most {MAX_SECONDS:g} "
                                 "(a day)")
        for key, v in (("replicas", replicas), ("max_timeouts", max_timeouts)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MCPPool {key}={v!r}: want a whole number >= 1")
        self.where = "mcp config"  # what config errors name: the file, when there is one
        if config is None:
            config = bundled_config()
        elif isinstance(config, (str, Path)):
            self.where = str(config)
            config = load_config(self.where)
        self.config = check_config(config, self.where)
        self.call_timeout, self.start_timeout = call_timeout, start_timeout  # defaults for the per-server keys
        self.max_timeouts = max_timeouts
        self.restarts = 0
        self._closed = False
        self._junk_warned = set()  # servers already warned about junk on their stdout
        self._rr = itertools.count()  # next() on it is atomic under the GIL: round-robin pinning
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-pool", daemon=True)
        self._thread.start()
        servers = self.config["mcpServers"]
        self.isolation = {name: spec.get("isolation", "shared") for name, spec in servers.items()}
        # an "episode" server gets one process here, only to list its tools (stopped below); that
        # Conn stays as the server's health record (backoff, down())
        self.conns = {name: [self._conn(name, r) for r in range(replicas if self.isolation[name] == "shared" else 1)]
                      for name in servers}
        self._private = set()  # live per-episode connections of "episode" servers (owned by the loop)
        atexit.register(self.close)
        try:
            self._run(self._start_all(), timeout=max(map(self.startup_timeout, servers)) + 30)
            self._build_tool_table()
            self._run(self._stop_probes())
        except BaseException:
            self.close()
            raise

    # -- plumbing
    def _run(self, coro, timeout: float | None = None):
        """Run a coroutine on the pool's loop from any thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _conn(self, name: str, replica: int) -> Conn:
        return Conn(name, self.config["mcpServers"][name], replica, self.where, self._junk)

    def _junk(self, server: str, line: str):
        """A line on a stdio server's stdout that is not MCP: one warning per server, not per line."""
        if server not in self._junk_warned:
            self._junk_warned.add(server)
            print(f"[mcp] server {server!r} wrote a line that is not MCP JSON-RPC on stdout, ignored "
                  f"(and so are later ones): {line[:120]!r}", file=sys.stderr)

    def startup_timeout(self, server: str) -> float:
        return self.config["mcpServers"][server].get("startup_timeout", self.start_timeout)

    def timeout_for(self, server: str, override: float | None = None) -> float:
        """A call's timeout: the caller's override, else the server's "timeout", else the pool's call_timeout."""
        return override or self.config["mcpServers"][server].get("timeout", self.call_timeout)

    async def _start_all(self):
        # every start runs to its end (a failed one has killed its child) before the first error is raised
        results = await asyncio.gather(*(c.start(self.startup_timeout(c.name)) for cs in self.conns.values() for c in cs),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _stop_probes(self):
        """An "episode" server's first process only listed its tools: each episode starts its own."""
        await asyncio.gather(*(cs[0].shutdown() for name, cs in self.conns.items() if self.isolation[name] == "episode"))

    def _build_tool_table(self):
        """route: visible name -> (server, real name, inject session?); tools: what the model sees."""
        self.session_aware, shown = {}, {}
        for name, cs in self.conns.items():
            spec, tools = self.config["mcpServers"][name], {t.name: t for t in cs[0].tools}
            for key in ("tools", "exclude_tools"):
                if unknown := [t for t in spec.get(key, []) if t not in tools]:
                    raise ValueError(f"{self.where}: mcpServers.{name}.{key}: unknown tool(s) {', '.join(unknown)}; "
                                     f"the server offers: {', '.join(tools)}")
            self.session_aware[name] = session_hook(tools.get("reset"))  # marked by _meta (config.session_hook)
            hidden = HIDDEN_TOOLS if self.session_aware[name] else ()
            shown[name] = [t for t in cs[0].tools if ("tools" not in spec or t.name in spec["tools"])
                           and t.name not in spec.get("exclude_tools", ()) and t.name not in hidden]
            if not shown[name]:
                why = (f"its tools/exclude_tools leave none of {', '.join(tools)}" if set(tools) - set(hidden)
                       else "the server offers none")
                raise ValueError(f"{self.where}: mcpServers.{name}: no tool to show the model ({why})")
        self.route, self.tools, self.no_argument = {}, [], {}
        self._name_tools(shown)
        self._check_tool_budget()

    def _name_tools(self, shown: dict):
        """The names the model sees (module doc, Tool names). A name two servers offer is prefixed for
        both, except that the bundled server's tools keep theirs: the rows and their state checks name
        them (prefixing kb_get failed every state-checked row at reset, "names unknown tool(s)"), while
        no row names a third-party tool. Each rename and each description cut is said in one line."""
        offered = {}  # real name -> servers showing it
        for name, ts in shown.items():
            for t in ts:
                offered.setdefault(t.name, []).append(name)
        bundled = {name for name in shown if self.conns[name][0].server_name == BUNDLED_SERVER_NAME}
        renamed, cut = {}, {}
        for name, ts in shown.items():
            for t in ts:
                plain = len(offered[t.name]) == 1 or (name in bundled and len(bundled & set(offered[t.name])) == 1)
                visible = t.name if plain else f"{name}__{t.name}"
                if not plain and bundled & set(offered[t.name]) - {name}:
                    renamed.setdefault(name, []).append(t.name)
                inject = self.session_aware[name] and "session" in (t.input_schema or {}).get("properties", {})
                if visible in self.route:
                    other = self.route[visible][0]
                    raise ValueError(f"{self.where}: tool name {visible!r} would mean two tools, of servers {other!r} "
                                     f"and {name!r}; rename a server or hide one with exclude_tools")
                self.route[visible] = (name, t.name, inject)
                description = t.description or ""
                if len(description) > MAX_DESCRIPTION_CHARS:
                    cut.setdefault(name, []).append(t.name)
                    description = description[:MAX_DESCRIPTION_CHARS] + " [... cut]"
                self.tools.append(openai_schema(visible, description, t.input_schema,
                                                drop=("session",) if inject else ()))
                writes = getattr(t.annotations, "read_only_hint", None) is False
                free = not self.tools[-1]["function"]["parameters"].get("required") and not writes
                self.no_argument[visible] = free and ("row" if self.config["mcpServers"][name].get("row_tools") else True)
        for name, names in renamed.items():
            print(f"[mcp] server {name!r}: {', '.join(names)} shown as {', '.join(f'{name}__{n}' for n in names)}: "
                  f"the bundled server offers tools of those names, and they keep them", file=sys.stderr)
        for name, names in cut.items():
            print(f"[mcp] server {name!r}: the description of {', '.join(names)} cut to {MAX_DESCRIPTION_CHARS} "
                  "characters", file=sys.stderr)

    def _check_tool_budget(self):
        """At most MAX_TOOLS tools and MAX_TOOL_CHARS characters of schemas: every prompt holds them all
        (a row_tools server's: only a row's, checked by MCPEnv.reset). Prints what the prompt will hold;
        tool_chars is that size."""
        size = {}
        for t in self.tools:
            server = self.route[t["function"]["name"]][0]
            if self.config["mcpServers"][server].get("row_tools"):  # each row names its few (MCPEnv.reset)
                continue
            n, chars = size.get(server, (0, 0))
            size[server] = (n + 1, chars + len(json.dumps(t, ensure_ascii=False)))
        self.tool_chars = sum(chars for _, chars in size.values())
        count = sum(n for n, _ in size.values())
        what = f"{count} tools, {self.tool_chars:,} characters of tool schemas"
        if count > MAX_TOOLS or self.tool_chars > MAX_TOOL_CHARS:
            per = "; ".join(f"{name}: {n} tools, {chars:,} characters" for name, (n, chars) in size.items())
            raise ValueError(f"{self.where}: the servers show the model {what}, in every prompt; at most "
                             f"{MAX_TOOLS} tools and {MAX_TOOL_CHARS:,} characters (~{MAX_TOOL_CHARS // 4000}K "
                             f"tokens) are allowed: hide some with \"tools\" or \"exclude_tools\" ({per})")
        rows = [n for n, spec in self.config["mcpServers"].items() if spec.get("row_tools")]
        print(f"[mcp] every prompt holds {what} (~{self.tool_chars // 4:,} tokens at ~4 characters a token), "
              f"from {len(size)} server(s)" + (f", and the tools its row names of {', '.join(rows)}" if rows else ""),
              file=sys.stderr)

    # -- episodes
    def open_session(self) -> dict:
        """Pin a fresh episode to one replica of every server (or a fresh process: isolation "episode").

        A server found dead here (a ping for servers without `reset`, the reset call for
        session-aware ones) is restarted before the episode starts, so a crash between episodes
        costs no episode. Raises ServerFailed when a server is down (MCPEnv.reset catches it)."""
        # used: the (server, generation) pairs of session-aware servers this episode has called: where it has state
        sess = {"key": uuid.uuid4().hex, "pins": {}, "rr": next(self._rr), "used": set()}
        self._run(self._open(sess))
        return sess

    def session_key(self, sess: dict, server: str) -> str:
        """The key a session-aware server knows this episode by: HMAC-SHA256(episode key, server name),
        so a server learns no other server's key (a third-party server that marks its own reset would
        otherwise read the bundled server's). The episode key itself is never sent: _call turns a
        `session` argument equal to it (env's state checks, close_session's drop) into this one."""
        return hmac.new(sess["key"].encode(), server.encode(), hashlib.sha256).hexdigest()[:32]

    async def _open(self, sess: dict):
        try:
            for name in self.conns:
                try:
                    await self._open_one(sess, name)
                except ServerFailed:
                    pass  # down: the episode's first call there tries again (and fails fast), see _call
        except BaseException:
            await asyncio.gather(*(self._stop_private(c) for name, (c, _) in sess["pins"].items()
                                   if self.isolation[name] == "episode"))
            raise

    async def _open_one(self, sess: dict, name: str):
        cs = self.conns[name]
        try:
            if self.isolation[name] == "episode":
                await self._open_private(sess, name, cs[0])
            else:
                await self._open_shared(sess, name, cs[sess["rr"] % len(cs)])
        except ServerFailed:
            pin = sess["pins"].pop(name, None)  # not pinned: a later call opens it afresh
            if pin is not None and self.isolation[name] == "episode":
                await self._stop_private(pin[0])
            raise

    async def _open_shared(self, sess: dict, name: str, c: Conn):
        """Pin sess to c's live process (restarting a dead one) and open its session there."""
        aware, gen = self.session_aware[name], c.generation
        dead = c.session is None or (not aware and await self._lost(c))
        for attempt in (0, 1):
            if dead:
                await self._restart(c, gen)
                if c.session is None:
                    raise ServerFailed(c.down_line())
            gen = c.generation
            sess["pins"][name] = (c, gen)
            if not aware:
                return
            try:
                text, is_error, _, _ = await self._send(c, gen, "reset", {"session": self.session_key(sess, name)},
                                                        self.timeout_for(name))
            except _Lost as e:
                if attempt == 1:
                    why = f"MCP server {name!r} failed twice as an episode started: {e}"
                    raise ServerFailed(c.redact(why)) from None
                dead = True
                continue
            if is_error:
                raise ServerFailed(c.redact(f"MCP server {name!r}: reset failed: {text}"))
            return

    async def _open_private(self, sess: dict, name: str, record: Conn):
        """A process of its own for this episode; record (the server's probe Conn) holds the health."""
        if record.backing_off():
            raise ServerFailed(record.down_line())
        c = self._conn(name, -1)
        self._private.add(c)
        sess["pins"][name] = (c, 0)  # in pins before it starts, so a failed start is stopped by _open
        try:
            await c.start(self.startup_timeout(name))
        except ServerStartFailed as e:
            record.failed(str(e))
            raise ServerFailed(record.down_line()) from None
        record.up()
        sess["pins"][name] = (c, c.generation)

    def close_session(self, sess: dict) -> None:
        for name, (c, gen) in list(sess["pins"].items()):  # a copy: the loop thread may re-pin
            if self._closed:
                return  # close() stops everything
            if self.isolation[name] == "episode":
                # not waited for: the episode's last step need not pay for the process's exit
                asyncio.run_coroutine_threadsafe(self._stop_private(c), self._loop)
            elif self.session_aware[name] and c.generation == gen and c.session is not None:
                # not waited for either (a round trip per episode's close): best effort, its errors
                # go unread, the server caps its session count, and a dropped key is never reused
                asyncio.run_coroutine_threadsafe(
                    self._call(sess, name, "reset", {"session": sess["key"], "drop": True}, self.timeout_for(name, 5.0)),
                    self._loop)

    async def _stop_private(self, c: Conn):
        try:
            await c.shutdown()
        finally:
            self._private.discard(c)

    def submit(self, sess: dict, visible_name: str, arguments: dict, timeout: float | None = None):
        """Start a call by the tool's visible name; a Future of (text, is_error, timed_out, seconds).

        The future raises ServerFailed if the episode's server is down; KeyError for unknown names."""
        server, real, inject = self.route[visible_name]
        if inject:
            arguments = {**arguments, "session": sess["key"]}
        return asyncio.run_coroutine_threadsafe(self._call(sess, server, real, arguments,
                                                           self.timeout_for(server, timeout)), self._loop)

    def call(self, sess: dict, visible_name: str, arguments: dict, timeout: float | None = None):
        """Blocking call by visible name -> (text, is_error, timed_out, seconds)."""
        return self.submit(sess, visible_name, arguments, timeout).result(self.wait_for(self.route[visible_name][0], timeout))

    def call_real(self, sess: dict, server: str, tool: str, arguments: dict, timeout: float | None = None):
        """Blocking call by the server's own tool name (hidden tools, state checks); no injection."""
        return self._run(self._call(sess, server, tool, arguments, self.timeout_for(server, timeout)),
                         timeout=self.wait_for(server, timeout))

    def wait_for(self, server: str, timeout: float | None = None) -> float:
        """How long a caller waits for a call's future: the call, a restart inside it, and a ping."""
        return self.timeout_for(server, timeout) + self.startup_timeout(server) + 30

    async def _call(self, sess: dict, server: str, tool: str, arguments: dict, timeout: float):
        """One call in an episode's session. Whatever happens to the server, the episode reads an
        error and goes on, on the restarted server; only a server that stays down raises ServerFailed.
        A restart costs the episode a call only where it had state there (module doc, Restarts)."""
        t0 = time.perf_counter()
        if bad := unencodable(arguments):  # the episode's own mistake: never let it reach the shared transport
            return (f"Error: {bad} holds text that is not valid Unicode (a lone surrogate such as \\ud800); "
                    "the call was not sent"), True, False, 0.0
        if server not in sess["pins"]:
            await self._open_one(sess, server)  # it was down as the episode opened: ServerFailed if it still is
        if self.session_aware[server] and arguments.get("session") == sess["key"]:
            arguments = {**arguments, "session": self.session_key(sess, server)}
        for attempt in (0, 1):
            c, gen = sess["pins"][server]
            if c.generation != gen or c.session is None or c.stopped[0] == gen:  # restarted, or being restarted
                if await self._recover(sess, server, gen):
                    return (c.redact(f"Error: MCP server {server!r} was restarted since this episode's last call "
                                     f"({c.ended}), and what this episode stored on it is gone; this call was not run"),
                            True, False, time.perf_counter() - t0)
                c, gen = sess["pins"][server]  # it had no state there: the call runs on the new process
            try:
                out = await self._send(c, gen, tool, arguments, timeout)
            except _Lost as e:
                if self.session_aware[server] and not e.unsent:
                    sess["used"].add((server, gen))  # it may have changed state before the process ended
                gone = await self._recover(sess, server, gen)
                if e.unsent and not gone and attempt == 0:
                    continue  # refused unrun: send it again, on the new connection
                stored = ", and what this episode stored on it is gone" if gone else ""
                return (c.redact(f"Error: {e}; MCP server {server!r} was restarted{stored}"), True, e.timed_out,
                        time.perf_counter() - t0)
            if self.session_aware[server]:
                sess["used"].add((server, gen))
            return out

    async def _send(self, c: Conn, gen: int, tool: str, arguments: dict, timeout: float):
        """One call on c's live session -> (text, is_error, timed_out, seconds); _Lost if the
        connection died under it, or hung and was restarted. Error texts are redacted (conn.py)."""
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT
        t0, session = time.perf_counter(), c.session
        if session is None or _closed(session, unknown=False):  # it ended before this call: not sent
            raise _Lost(f"MCP server {c.name!r} had ended before this call ({c.exit_reason()}), which was not sent",
                        unsent=True)
        try:
            result = await session.call_tool(tool, arguments, read_timeout_seconds=timeout)
        except MCPError as e:
            if c.session_lost:
                raise _Lost(c.redact(f"the server no longer knows this connection's session: it restarted or expired "
                                     f"it ({e.error.message})"), unsent=True) from None
            if e.code == CONNECTION_CLOSED and _closed(session):
                if c.stopped[0] == gen:  # the pool stopped it (_restart), not the server itself
                    raise _Lost(f"the pool stopped the server during this call ({c.stopped[1]}), so this call may or "
                                "may not have run") from None
                raise _Lost(c.redact(f"the server exited during this call ({e.error.message})")) from None
            if e.code == REQUEST_TIMEOUT and time.perf_counter() - t0 >= timeout:  # ours, not the server's -32001
                await self._timed_out(c, gen, tool, timeout)
                return f"Error: tool {tool} timed out after {timeout:g} s", True, True, time.perf_counter() - t0
            c.timeouts = 0
            return c.redact(f"Error: {e.error.message}"), True, False, time.perf_counter() - t0
        except _TRANSPORT_ERRORS as e:
            raise _Lost(c.redact(f"the connection failed during this call ({type(e).__name__}: {e})")) from None
        except Exception as e:  # noqa: BLE001 -- e.g. a request mcp cannot serialise, a result that breaks its
            # tool's output schema (mcp 2.3 raises RuntimeError): an error for this call only
            return (c.redact(f"Error: the call failed: {type(e).__name__}: {c.redact(str(e))[:200]}"), True, False,
                    time.perf_counter() - t0)
        c.timeouts = 0
        text = _result_text(result)
        return (c.redact(text) if result.is_error else text), bool(result.is_error), False, time.perf_counter() - t0

    async def _timed_out(self, c: Conn, gen: int, tool: str, timeout: float):
        """After a call timeout (the tool may keep running server-side): a server that ignores a
        ping, or whose last max_timeouts calls all timed out (e.g. a runaway query holding a lock
        while pings still work), is restarted; the call that saw it reads that (_Lost)."""
        if c.generation != gen:
            return  # a timeout on a process that is already gone says nothing about its successor
        c.timeouts += 1
        if c.timeouts < self.max_timeouts and await self._alive(c):
            return
        why = (f"{c.timeouts} calls in a row timed out" if c.timeouts >= self.max_timeouts
               else "it did not answer a ping either")
        await self._restart(c, gen, why)
        raise _Lost(f"tool {tool} timed out after {timeout:g} s and {why}", timed_out=True)

    async def _recover(self, sess: dict, server: str, gen: int) -> bool:
        """The episode's process died or was restarted: restart it if no one has (ServerFailed when
        that fails or is backing off), pin the episode to the new process, open its session there.
        True when the episode had state on the old process (a session-aware server it had called): gone."""
        c = sess["pins"][server][0]
        await self._restart(c, gen)
        if c.session is None:
            raise ServerFailed(c.down_line())
        gone = (server, gen) in sess["used"]
        if sess["pins"][server][1] == c.generation:
            return gone  # another call of this episode's turn re-pinned it already
        sess["pins"][server] = (c, c.generation)
        if self.session_aware[server]:
            try:
                key = {"session": self.session_key(sess, server)}
                text, is_error, _, _ = await self._send(c, c.generation, "reset", key, self.timeout_for(server))
            except _Lost as e:
                why = f"MCP server {server!r} failed again right after its restart: {e}"
                raise ServerFailed(c.redact(why)) from None
            if is_error:
                raise ServerFailed(c.redact(f"MCP server {server!r}: reset failed: {text}"))
        return gone

    async def _alive(self, c: Conn, timeout: float = 5.0) -> bool:
        try:
            await asyncio.wait_for(c.session.send_ping(), timeout)
            return True
        except Exception:  # noqa: BLE001 -- any failure to answer a ping means "not alive"
            return False

    async def _lost(self, c: Conn, timeout: float = 5.0) -> bool:
        """Has c's connection closed (its process died)? One ping.

        A ping that is only slow is not a lost connection: restarting would cost every live
        episode pinned to c a failed call, and a hung server is caught by the call timeout path."""
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED
        if c.session is None or c.session_lost:
            return True
        try:
            await asyncio.wait_for(c.session.send_ping(), timeout)
        except asyncio.TimeoutError:
            return False
        except MCPError as e:
            return c.session_lost or (e.code == CONNECTION_CLOSED and _closed(c.session))
        except _TRANSPORT_ERRORS:
            return True
        return False

    async def _restart(self, c: Conn, gen: int, why: str = ""):
        """Restart c unless someone already did (c is past gen and up), or a failed restart is too
        recent (backoff: the caller finds c.session None and fails fast). why: the pool's reason to
        stop a live process (it hung); empty when it ended by itself. Prints why, once per restart;
        c.stopped and c.ended keep it for the calls that meet the restart (module doc, Restarts)."""
        async with c.restart_lock:
            if (c.generation != gen and c.session is not None) or self._closed or c.backing_off():
                return
            if why:
                c.stopped = (c.generation, why)  # from here on, calls wait for the new process (_call)
            c.ended = f"the pool restarted it: {why}" if why else c.exit_reason()
            print(c.redact(f"[mcp] server {c.name!r}: {why or c.exit_reason()}; restarting it"), file=sys.stderr)
            await c.shutdown()
            self.restarts += 1
            try:
                await c.start(self.startup_timeout(c.name))
            except ServerStartFailed as e:
                c.failed(str(e))
            else:
                c.up()

    def down(self) -> dict[str, dict]:
        """Servers that are down now (their last restart failed): name -> {"since": unix time of the
        first failed restart, "failures": failed restarts in a row, "error": the last one}. Empty
        when every server is up. A trainer can stop a run whose servers stay down (module doc)."""
        out = {}
        for name, cs in self.conns.items():
            for c in cs:
                if c.failures and name not in out:
                    out[name] = {"since": c.down_since, "failures": c.failures, "error": c.last_error}
        return out

    async def _shutdown_all(self):
        await asyncio.gather(*(c.shutdown() for c in self._all_conns()), return_exceptions=True)

    def _all_conns(self) -> list[Conn]:
        return [c for cs in self.conns.values() for c in cs] + list(self._private)

    def pids(self) -> set[int]:
        return {p for c in self._all_conns() for p in c.pids}

    # -- lifecycle
    def close(self) -> None:
        """Stop every server (idempotent; safe from atexit and after Ctrl-C)."""
        if self._closed:
            return
        self._closed = True
        pids = self.pids()
        if self._loop.is_running():
            try:
                self._run(self._shutdown_all(), timeout=15)
            except (TimeoutError, RuntimeError, concurrent.futures.TimeoutError):
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        # last resort: anything the transports' own shutdown left behind. Only pids that are still
        # our children: a reaped server's pid may since belong to an unrelated process.
        for pid in pids & child_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for c in self._all_conns():
            c._remove_workdir()
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_default_pool = None
_default_lock = threading.Lock()


def default_pool() -> MCPPool:
    """A process-wide pool on the bundled server, created on first use (closed at exit)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool._closed:
            _default_pool = MCPPool()
        return _default_pool
