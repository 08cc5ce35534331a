r"""
The MCP server side of mcp_env.MCPEnv: MCPPool keeps long-lived connections to the configured
MCP servers, shared by every episode. It reads the config, pins each episode to a replica, keeps
per-episode state apart with session keys, restarts dead or hung servers, and kills what it
started. MCPEnv turns a ServerFailed from it into a failed episode (info["error"]).

Pool design (our choice; the simplest one we found that is correct under concurrency):
  - One asyncio loop in one daemon thread owns every connection. Each server connection is one
    long-lived asyncio task that enters stdio_client/streamable_http_client and ClientSession
    and exits them itself (anyio requires the same task to enter and exit). MCPEnv.step is
    blocking and thread-safe: it submits coroutines with asyncio.run_coroutine_threadsafe, so
    the rollout's thread pool runs many episodes' tool calls at once and a slow tool only blocks
    its own episode.
  - `replicas` processes per configured server (default 1; mcp 2.3 runs sync tools in a thread
    pool, so one process already serves concurrent calls). An episode is pinned to one replica.
  - Per-episode state via session keys, not one process per episode (run_episodes resets all
    episodes of a batch before the first step, so leasing processes would need one per episode).
    A server with a `reset` tool whose schema has a `session` property is *session-aware*:
    the env calls reset(session=KEY) at the episode's start and reset(session=KEY, drop=True)
    at close, hides `reset`, strips `session` from every schema it shows the model, and injects
    session=KEY into every call of a tool that declares it. The bundled server works this way.
    Servers without it (third-party ones, e.g. mcp-server-time) are shared as they are:
    fine for stateless servers; a stateful third-party server is NOT isolated between episodes
    unless its config says "isolation": "episode": then each episode's session starts its own
    process of that server and close_session stops it. The cost: one process start per episode
    per such server (~0.7-1 s of spawn + handshake, mostly the server's imports; a batch of
    episodes starts them concurrently), paid in env.reset, plus one process per live episode.
  - A dead connection (MCPError CONNECTION_CLOSED, or the owner task ended) is restarted once
    (a generation counter makes concurrent failures restart it only once); episodes pinned to
    the old generation fail, since their session state died with it, and the failed call counts
    in their tool_calls and tool_errors. After a call timeout the server is pinged; if the ping
    times out too, it is restarted (a hung server). A server that died between episodes is found
    when the next episode opens its session (the reset call of a session-aware server; one ping,
    ~1 ms, for the others) and restarted then, so it costs no episode. Only a closed connection
    counts as dead there: a slow ping must not restart a server other episodes are using.
  - Bad text stays in its episode: arguments holding a string or key that UTF-8 cannot encode
    (a lone surrogate such as "\ud800", which json.loads accepts) are refused before sending,
    as a tool error the model reads; sent, they would kill the shared stdio connection (mcp 2.3's
    writer encodes with errors="strict").
  - Startup: a server must finish the MCP handshake and list its tools within startup_timeout
    (a command that never speaks MCP, e.g. `sleep 1000`, would hang forever); past it, or when
    the command cannot start, the error names the server, its command and the config file, and
    the child is killed.
  - Cleanup: stdio_client (mcp 2.3) starts each server with start_new_session=True and kills
    its process group on exit. MCPPool.close() (also from `with MCPPool(...)`, atexit, and so
    on Ctrl-C) stops every connection task, then SIGKILLs the process group of any child that
    is still alive. A hard-killed trainer leaves servers with a closed stdin, and MCP stdio
    servers exit on EOF.

Tool names: each server's tools keep their own names; a name offered by two servers is shown as
"<server>__<tool>" for both (only on collision, so single-server setups read naturally).
pool.tools holds the schemas the model sees (OpenAI function format, pydantic "title" keywords
and the injected `session` argument stripped); they are built here because the tool table is.

Config: mcp_config.py (the mcpServers file, its keys, the bundled default, tool schemas).

Use (what MCPEnv does per episode; env.reset opens the session, the episode's end closes it):
    with MCPPool(bundled_config()) as pool:             # or a config dict / file path; None = bundled
        sess = pool.open_session()
        text, is_error, timed_out, seconds = pool.call(sess, "calculate", {"expression": "2*21"})
        pool.close_session(sess)

Test: python -m pytest -q tests/test_mcp.py   (kill, timeout and restart tests use the real pool)
"""
import asyncio
import atexit
import concurrent.futures
import itertools
import json
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import anyio

from mcp_config import bundled_config, check_config, load_config, openai_schema, unencodable

HIDDEN_TOOLS = ("reset",)  # hidden only on session-aware servers (see module doc)
# transport failures that mean the connection is gone (anyio's, as raised under mcp 2.3)
_TRANSPORT_ERRORS = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, ConnectionError)


class ServerFailed(RuntimeError):
    """The server an episode was using died or was restarted; its session state is gone."""


class _Conn:
    """One connection to one server process (or URL). Its asyncio task owns the transports."""

    def __init__(self, name: str, spec: dict, replica: int, where: str = "mcp config"):
        self.name, self.spec, self.replica, self.where = name, spec, replica, where
        self.session = None       # mcp ClientSession while connected
        self.tools = []           # mcp Tool objects
        self.generation = 0       # +1 per successful (re)connect; episodes pin to one generation
        self.task = None
        self.stop = None          # asyncio.Event: set -> the owner task leaves its context managers
        self.error = None
        self.restart_lock = asyncio.Lock()
        self.pids: set[int] = set()

    def describe(self) -> str:
        """Name, what runs it, where it is configured: a startup error must say all three."""
        if "url" in self.spec:
            what = f"url {self.spec['url']}"
        else:
            what = "command: " + shlex.join([self.spec["command"], *self.spec.get("args", [])])
        return f"MCP server {self.name!r} ({what}; config: {self.where})"

    async def start(self, timeout: float):
        self.stop = asyncio.Event()
        ready = asyncio.Event()
        self.error = None
        self.task = asyncio.get_running_loop().create_task(self._own(ready, timeout))
        try:
            # a backstop only: _own times the handshake out itself, and stopping a server that
            # ignores EOF takes the SDK up to ~6 s (mcp 2.3: 2 s grace, SIGTERM, 2 s, SIGKILL)
            await asyncio.wait_for(asyncio.shield(ready.wait()), timeout + 15)
        except asyncio.TimeoutError:
            self.task.cancel()
            self.error = TimeoutError()
        if self.session is None:
            e = self.error
            while isinstance(e, BaseExceptionGroup):  # anyio task groups wrap the real error
                e = e.exceptions[0]
            why = (f"no MCP handshake within {timeout:g} s (startup_timeout); is it an MCP server?"
                   if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}")
            raise RuntimeError(f"{self.describe()} failed to start: {why}")

    async def _own(self, ready: asyncio.Event, timeout: float):
        from mcp import ClientSession
        before = _child_pids()
        try:
            if "url" in self.spec:
                from mcp.client.streamable_http import streamable_http_client
                transport = streamable_http_client(self.spec["url"])
            else:
                from mcp.client.stdio import StdioServerParameters, stdio_client
                transport = stdio_client(StdioServerParameters(
                    command=self.spec["command"], args=self.spec.get("args", []),
                    env=self.spec.get("env") or None, cwd=self.spec.get("cwd")))
            async with transport as streams:
                self.pids = _child_pids() - before  # for the last-resort kill in close(), even if the handshake hangs
                read, write = streams[0], streams[1]
                async with ClientSession(read, write) as session:
                    # an anyio timeout, not asyncio's: the transport's own shutdown then kills the
                    # child (a command that never speaks MCP, e.g. `sleep 1000`, would hang here)
                    with anyio.fail_after(timeout):
                        await session.initialize()
                        self.tools = (await session.list_tools()).tools
                    self.session = session
                    self.generation += 1
                    ready.set()
                    await self.stop.wait()
        except Exception as e:  # noqa: BLE001 -- any transport failure: record, the pool restarts us
            self.error = e
        finally:
            self.session = None
            ready.set()

    async def shutdown(self, timeout: float = 10.0):
        if self.task is None:
            return
        self.stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
            self.pids = set()  # stopped and reaped: these pids may be reused by anyone now
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.task.cancel()
        self.task = None


def _child_pids() -> set[int]:
    """Our direct children that lead their own session (Linux /proc), as mcp's stdio_client starts
    servers; other children (e.g. vLLM workers) are never candidates for close()'s kill."""
    me, out = os.getpid(), set()
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # state ppid pgrp session ... (comm may hold spaces)
            if int(fields[1]) == me and int(fields[3]) == int(d):
                out.add(int(d))
    return out


def _result_text(result) -> str:
    parts = []
    for block in result.content:
        parts.append(block.text if getattr(block, "type", "") == "text" else f"[{getattr(block, 'type', '?')} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


class MCPPool:
    """Long-lived MCP server connections shared by every episode. Use as a context manager."""

    def __init__(self, config: dict | str | None = None, replicas: int = 1, call_timeout: float = 30.0,
                 start_timeout: float = 30.0):
        self.where = "mcp config"  # what config errors name: the file, when there is one
        if config is None:
            config = bundled_config()
        elif isinstance(config, (str, Path)):
            self.where = str(config)
            config = load_config(self.where)
        self.config = check_config(config, self.where)
        self.call_timeout, self.start_timeout = call_timeout, start_timeout  # defaults for the per-server keys
        self.restarts = 0
        self._closed = False
        self._rr = itertools.count()  # next() on it is atomic under the GIL: round-robin pinning
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-pool", daemon=True)
        self._thread.start()
        servers = self.config["mcpServers"]
        self.isolation = {name: spec.get("isolation", "shared") for name, spec in servers.items()}
        # an "episode" server gets one process here, only to list its tools (stopped below)
        self.conns = {name: [_Conn(name, spec, r, self.where)
                             for r in range(replicas if self.isolation[name] == "shared" else 1)]
                      for name, spec in servers.items()}
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
            reset = tools.get("reset")
            self.session_aware[name] = reset is not None and "session" in (reset.input_schema or {}).get("properties", {})
            hidden = HIDDEN_TOOLS if self.session_aware[name] else ()
            shown[name] = [t for t in cs[0].tools if ("tools" not in spec or t.name in spec["tools"])
                           and t.name not in spec.get("exclude_tools", ()) and t.name not in hidden]
        offered = {}  # real name -> servers showing it
        for name, ts in shown.items():
            for t in ts:
                offered.setdefault(t.name, []).append(name)
        self.route, self.tools = {}, []
        for name, ts in shown.items():
            for t in ts:
                visible = t.name if len(offered[t.name]) == 1 else f"{name}__{t.name}"
                inject = self.session_aware[name] and "session" in (t.input_schema or {}).get("properties", {})
                self.route[visible] = (name, t.name, inject)
                self.tools.append(openai_schema(visible, t.description, t.input_schema,
                                                drop=("session",) if inject else ()))

    # -- episodes
    def open_session(self) -> dict:
        """Pin a fresh episode to one replica of every server (or a fresh process: isolation "episode").

        Called from env.reset, which the rollout does not guard: a server found dead here (a ping
        for servers without `reset`, the reset call for session-aware ones) is restarted before
        the episode starts, so a crash between episodes costs no episode."""
        rr = next(self._rr)
        for attempt in (0, 1):
            sess = {"key": uuid.uuid4().hex, "pins": self._run(self._pin(rr))}
            try:
                for name in sess["pins"]:
                    if self.session_aware[name]:
                        text, is_error, _, _ = self.call_real(sess, name, "reset", {"session": sess["key"]})
                        if is_error:
                            raise ServerFailed(f"{name}: reset failed: {text}")
                return sess
            except ServerFailed:
                self.close_session(sess)
                if attempt == 1:
                    raise

    async def _pin(self, rr: int) -> dict:
        """server -> (connection, generation) for a new episode."""
        pins = {}
        try:
            for name, cs in self.conns.items():
                if self.isolation[name] == "episode":
                    c = _Conn(name, cs[0].spec, -1, self.where)
                    self._private.add(c)
                    pins[name] = (c, 0)  # in pins before it starts, so a failed start is stopped below
                    await c.start(self.startup_timeout(name))
                else:
                    c = cs[rr % len(cs)]
                    gen = c.generation
                    if not self.session_aware[name] and await self._lost(c):
                        await self._restart(c, gen)
                pins[name] = (c, c.generation)
        except BaseException:
            for name, (c, _) in pins.items():
                if self.isolation[name] == "episode":
                    await self._stop_private(c)
            raise
        return pins

    def close_session(self, sess: dict) -> None:
        for name, (c, gen) in sess["pins"].items():
            if self._closed:
                return  # close() stops everything
            if self.isolation[name] == "episode":
                # not waited for: the episode's last step need not pay for the process's exit
                asyncio.run_coroutine_threadsafe(self._stop_private(c), self._loop)
            elif self.session_aware[name] and c.generation == gen and c.session is not None:
                try:
                    self.call_real(sess, name, "reset", {"session": sess["key"], "drop": True}, 5.0)
                except (ServerFailed, TimeoutError, concurrent.futures.TimeoutError):
                    pass  # best effort: the server caps its session count anyway

    async def _stop_private(self, c: _Conn):
        try:
            await c.shutdown()
        finally:
            self._private.discard(c)

    def submit(self, sess: dict, visible_name: str, arguments: dict, timeout: float | None = None):
        """Start a call by the tool's visible name; a Future of (text, is_error, timed_out, seconds).

        The future raises ServerFailed if the episode's server died; KeyError for unknown names."""
        server, real, inject = self.route[visible_name]
        if inject:
            arguments = {**arguments, "session": sess["key"]}
        c, gen = sess["pins"][server]
        return asyncio.run_coroutine_threadsafe(self._call(c, gen, real, arguments, self.timeout_for(server, timeout)),
                                                self._loop)

    def call(self, sess: dict, visible_name: str, arguments: dict, timeout: float | None = None):
        """Blocking call by visible name -> (text, is_error, timed_out, seconds)."""
        server = self.route[visible_name][0]  # the wait covers a restart inside the call too
        wait = self.timeout_for(server, timeout) + self.startup_timeout(server) + 30
        return self.submit(sess, visible_name, arguments, timeout).result(wait)

    def call_real(self, sess: dict, server: str, tool: str, arguments: dict, timeout: float | None = None):
        """Blocking call by the server's own tool name (hidden tools, state checks); no injection."""
        c, gen = sess["pins"][server]
        timeout = self.timeout_for(server, timeout)
        wait = timeout + self.startup_timeout(server) + 30
        return self._run(self._call(c, gen, tool, arguments, timeout), timeout=wait)

    async def _call(self, c: _Conn, gen: int, tool: str, arguments: dict, timeout: float):
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT
        t0 = time.perf_counter()
        if bad := unencodable(arguments):  # the episode's own mistake: never let it reach the shared transport
            return (f"Error: {bad} holds text that is not valid Unicode (a lone surrogate such as \\ud800); "
                    "the call was not sent"), True, False, 0.0
        if c.generation != gen or c.session is None:
            await self._restart(c, gen)
            raise ServerFailed(f"MCP server {c.name!r} was restarted during this episode (session state lost)")
        try:
            result = await c.session.call_tool(tool, arguments, read_timeout_seconds=timeout)
        except MCPError as e:
            if e.code == REQUEST_TIMEOUT:
                # the tool keeps running server-side; only a server that also ignores a ping is hung
                if not await self._alive(c):
                    await self._restart(c, gen)
                return f"Error: tool {tool} timed out after {timeout:g} s", True, True, time.perf_counter() - t0
            if e.code == CONNECTION_CLOSED:
                await self._restart(c, gen)
                raise ServerFailed(f"MCP server {c.name!r} died: {e.error.message}") from None
            return f"Error: {e.error.message}", True, False, time.perf_counter() - t0
        except _TRANSPORT_ERRORS as e:
            await self._restart(c, gen)
            raise ServerFailed(f"MCP server {c.name!r} connection failed: {type(e).__name__}: {e}") from None
        return _result_text(result), bool(result.is_error), False, time.perf_counter() - t0

    async def _alive(self, c: _Conn, timeout: float = 5.0) -> bool:
        try:
            await asyncio.wait_for(c.session.send_ping(), timeout)
            return True
        except Exception:  # noqa: BLE001 -- any failure to answer a ping means "not alive"
            return False

    async def _lost(self, c: _Conn, timeout: float = 5.0) -> bool:
        """Has c's connection closed (its process died)? One ping, ~1 ms on a live stdio server.

        A ping that is only slow is not a lost connection: restarting would fail every live
        episode pinned to c, and a hung server is caught by the call timeout path anyway."""
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED
        if c.session is None:
            return True
        try:
            await asyncio.wait_for(c.session.send_ping(), timeout)
        except asyncio.TimeoutError:
            return False
        except MCPError as e:
            return e.code == CONNECTION_CLOSED
        except _TRANSPORT_ERRORS:
            return True
        return False

    async def _restart(self, c: _Conn, gen: int):
        async with c.restart_lock:
            if c.generation != gen and c.session is not None:
                return  # someone already restarted this generation
            if self._closed:
                return
            await c.shutdown()
            self.restarts += 1
            try:
                await c.start(self.startup_timeout(c.name))
            except (RuntimeError, asyncio.TimeoutError) as e:
                print(f"[mcp] restarting server {c.name!r} failed: {e}", file=sys.stderr)

    async def _shutdown_all(self):
        conns = [c for cs in self.conns.values() for c in cs] + list(self._private)
        await asyncio.gather(*(c.shutdown() for c in conns), return_exceptions=True)

    def pids(self) -> set[int]:
        return {p for c in [c for cs in self.conns.values() for c in cs] + list(self._private) for p in c.pids}

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
            except (TimeoutError, RuntimeError):
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        # last resort: anything mcp's own shutdown left behind. Only pids that are still our
        # children: a reaped server's pid may since belong to an unrelated process.
        for pid in pids & _child_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
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
