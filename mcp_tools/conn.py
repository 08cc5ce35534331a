r"""
One connection to one MCP server, for pool.MCPPool: its transport, start and stop, the
per-process copies of the files a config lists ("copy"), and its health (restart backoff).

Conn: one long-lived asyncio task enters the transport and mcp's ClientSession and exits them
itself (anyio requires the same task to enter and exit); start() waits for the handshake and
the tool list, shutdown() sets an event that makes the task leave. Urls use mcp's
streamable_http_client, or sse_client for "type": "sse". Commands use transport.stdio_transport.
Health: a failed restart sets a backoff (1, 2, 4, ... 60 s: BACKOFF_FIRST_S, BACKOFF_MAX_S)
during which the pool does not try again, and is printed as one line; down_line() says why.

The bounded stdio and HTTP transports (long messages, junk lines, the server process): transport.py.
HTTP sessions: a 404 to a request that carries our mcp-session-id means the server no longer
knows the session (it restarted on the same url, or expired it): session_lost is set (_on_lost)
and the pool reconnects; that request was refused unrun (the pool may send it again).
Secrets, by value (secrets_of, redact): a server is described by its name, its program's basename
and its argument count (a url: scheme://host[:port]/path), never by values. Every text from a
server or its connection (start, down and restart lines, its stderr, which we forward line by line
as "[mcp NAME] ...", junk lines, exception texts, tool errors; not successful results, which may
rightly echo an argument, a timezone) shows *** for each secret, also URL-quoted, JSON-escaped, or
cut off at the text's end. A secret: each piece of an argument, an env or header value, or the url
(the value; VALUE of KEY=VALUE or "Name: value", and its words; a url's user, password, query
values) unless it looks plain: under 4 characters, a flag, a lowercase word or package name (stdio,
mcp-server-time, @scope/pkg, server.py), a number of <= 5 digits, a path that exists. A url's
userinfo, and a value whose name looks secret (--token X, API_KEY=X, env PGPASSWORD, an
Authorization header), always are. Cost: a lowercase-only password passed positionally is missed.

Test: python -m pytest -q tests/test_mcp.py -k "stays_down or copies or restart_is or secret"
      python -m pytest -q tests/test_mcp.py   (its pool section)
"""
import asyncio
import collections
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import anyio

from mcp_tools.transport import MAX_MESSAGE_BYTES, bounded_http_client, stdio_transport

BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 60.0  # wait before retrying a failed restart: 1, 2, 4, ... 60 s


class ServerStartFailed(RuntimeError):
    """A server did not start: one line naming the server, its program or url, and the config file."""


_SECRET_NAME = re.compile(r"token|key|secret|passw|pwd|auth|credential|bearer|session|cookie|signature|sig$|pat$|dsn",
                          re.I)
_FLAG = re.compile(r"--?[A-Za-z][\w-]*")                   # -k, --github-pat: a flag's name, never its value
_WORD = re.compile(r"@?[a-z]+(?:[-_./@]+[a-z]+)*")           # stdio, mcp-server-time, @scope/pkg, server.py
_AUTH_SCHEMES = {"bearer", "basic", "token", "digest"}       # the word after one is a credential
MIN_SECRET = 4  # shorter values are not redacted: "***" for every "a" or "on" would garble each message


def _looks_plain(v: str) -> bool:
    """A value that is not taken for a secret unless its name says so (module doc)."""
    if len(v) < MIN_SECRET or _FLAG.fullmatch(v) or _WORD.fullmatch(v) or (v.isdigit() and len(v) <= 5):
        return True
    try:  # a path (or PATH-like list) that exists: a script, a folder, PYTHONPATH
        return ("/" in v or v.startswith(".")) and all(os.path.exists(p) for p in v.split(os.pathsep) if p)
    except ValueError:  # a NUL byte
        return False


def _pieces(value: str, named: bool) -> list[tuple[str, bool]]:
    """(piece, named) for a value and what a message may show of it alone: VALUE of KEY=VALUE and of
    "Name: value", the word after an auth scheme ("Bearer TOKEN"), a url's user, password and query
    values. named: the piece's name (or place) says secret, so it is one whatever it looks like."""
    out = [(value, named)]
    for sep in ("=", ":"):
        key, found, rest = value.partition(sep)
        if found and re.fullmatch(r"-{0,2}[A-Za-z][\w.-]*", key) and rest.strip():
            out.append((rest.strip(), named or bool(_SECRET_NAME.search(key))))
    out += [(w, n) for v, n in list(out) for prev, w in itertools.pairwise(v.split()) if prev.lower() in _AUTH_SCHEMES]
    if "://" in value:
        out += [(p, True) for p in _url_secrets(value)]
    return out


def _url_secrets(url: str) -> list[str]:
    """A url's user, password and query values: secrets by where they stand."""
    try:
        u = urllib.parse.urlsplit(url.strip())
        return [p for p in (u.username, u.password) if p] + [v for _, v in urllib.parse.parse_qsl(u.query)]
    except ValueError:  # a bad port or bracket: nothing more to take apart
        return []


def secrets_of(spec: dict) -> list[str]:
    """The values in a server's spec that must not be printed or logged (module doc), longest first."""
    named = [(v, k) for k, v in [*(spec.get("env") or {}).items(), *(spec.get("headers") or {}).items()]]
    args = spec.get("args", [])
    named += [(a, args[i - 1] if i and _FLAG.fullmatch(args[i - 1]) else "") for i, a in enumerate(args)]
    out = [p for p in _url_secrets(spec.get("url", "")) if len(p) >= MIN_SECRET]  # not the url: describe shows it
    for value, name in named:
        out += [p for p, secret in _pieces(value, bool(_SECRET_NAME.search(name)))
                if len(p) >= MIN_SECRET and (secret or not _looks_plain(p))]
    return sorted(set(out), key=len, reverse=True)


def redact(text: str, secrets: list[str]) -> str:
    """text with *** for each secret (also URL-quoted or JSON-escaped) and for a secret's start where
    text ends inside it (a message cut at N characters)."""
    for v in secrets:
        for form in {v, urllib.parse.quote(v, safe=""), json.dumps(v)[1:-1]}:
            text = text.replace(form, "***")
    for v in secrets:
        for k in range(min(len(v) - 1, len(text)), MIN_SECRET - 1, -1):
            if text[-1] == v[k - 1] and text.endswith(v[:k]):
                text = text[:-k] + "***"
                break
    return text


class Conn:
    """One connection to one server process (or URL), and its health (module doc). Its asyncio
    task owns the transports; the pool's restart_lock and generation make restarts happen once."""

    def __init__(self, name: str, spec: dict, replica: int, where: str = "mcp config", on_junk=None):
        self.name, self.spec, self.replica, self.where = name, spec, replica, where
        self.on_junk = on_junk or (lambda name, line: None)
        self.base = Path(spec.get("cwd") or os.getcwd()).resolve()  # where "copy" entries are read
        self.workdir = None       # this process's own copy of the "copy" files (its cwd), if any
        self.session = None       # mcp ClientSession while connected
        self.tools = []           # mcp Tool objects
        self.generation = 0       # +1 per successful (re)connect; episodes pin to one generation
        self.task = None
        self.stop = None          # asyncio.Event: set -> the owner task leaves its context managers
        self.error = None
        self.restart_lock = asyncio.Lock()
        self.pids: set[int] = set()
        self.timeouts = 0         # calls in a row that timed out (pool.MAX_TIMEOUTS)
        self.failures, self.down_since, self.retry_at, self.last_error = 0, None, 0.0, ""
        self.secrets = secrets_of(spec)
        self.session_lost = False  # an HTTP server answered 404 to our session id (module doc)
        self.cut = 0              # size of the last reply cut at MAX_MESSAGE_BYTES
        self.server_name = ""     # the name the server gives itself (initialize's serverInfo)
        self.stopped = (0, "")    # (generation, why) of a live process the pool chose to stop (pool._restart)
        self.ended = ""           # why the last generation ended, as episodes read it (pool._restart)
        self.stderr_tail = collections.deque(maxlen=3)  # its last stderr lines (redacted), for start errors

    def describe(self) -> str:
        """Name, what runs it, where it is configured: a startup error must say all three, and no
        argument value, url userinfo or query (module doc, Secrets)."""
        if "url" in self.spec:
            u = urllib.parse.urlsplit(self.spec["url"])
            what = f"url {u.scheme}://{u.netloc.rpartition('@')[2]}{u.path}"
        else:
            n = len(self.spec.get("args", []))
            what = f"command {os.path.basename(self.spec['command'])} with {n} argument{'s' * (n != 1)}"
        return self.redact(f"MCP server {self.name!r} ({what}; config: {self.where})")

    def redact(self, text: str) -> str:
        return redact(text, self.secrets)

    def exit_reason(self) -> str:
        """Why the connection ended, when the pool did not end it."""
        if self.session_lost:
            return "it no longer knew this connection's session (it restarted or expired it)"
        if self.failures:
            return f"it is down: {self.failures} restart(s) in a row failed"
        return "its connection closed" if "url" in self.spec else "it exited by itself"

    def _on_stderr(self, line: str):
        """One line of the server's stderr: forwarded, redacted, named (module doc)."""
        line = self.redact(line)
        self.stderr_tail.append(line)
        print(f"[mcp {self.name}] {line}", file=sys.stderr)

    # -- health: restarts back off after a failure, so a server that stays down costs each
    # episode a fast error instead of a start-up timeout
    def failed(self, error: str):
        """A restart (or an episode's own process) failed to start: back off, say so in one line."""
        self.failures += 1
        self.down_since = self.down_since or time.time()
        self.retry_at = time.monotonic() + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.failures - 1))
        self.last_error = self.redact(error)
        print(f"[mcp] {self.down_line()}", file=sys.stderr)

    def up(self):
        self.failures, self.down_since, self.retry_at, self.last_error = 0, None, 0.0, ""

    def backing_off(self) -> bool:
        return time.monotonic() < self.retry_at

    def down_line(self) -> str:
        wait = max(0.0, self.retry_at - time.monotonic())
        return (f"MCP server {self.name!r} is down: {self.failures} restart(s) in a row failed, next try in "
                f"{wait:.0f} s; last: {self.last_error}")

    # -- lifecycle
    async def start(self, timeout: float):
        self.stop = asyncio.Event()
        ready = asyncio.Event()
        self.error = None
        self.timeouts = 0
        self.session_lost, self.cut = False, 0
        self.stderr_tail.clear()
        try:
            self._copy_files()
        except OSError as e:
            raise ServerStartFailed(self.redact(f"{self.describe()} failed to start: cannot copy its files: {e}")) from None
        self.task = asyncio.get_running_loop().create_task(self._own(ready, timeout))
        try:
            # a backstop only: _own times the handshake out itself, and stopping a server that
            # ignores EOF takes up to ~4 s (2 s grace, SIGTERM, 2 s, SIGKILL: transport._stop)
            await asyncio.wait_for(asyncio.shield(ready.wait()), timeout + 15)
        except asyncio.TimeoutError:
            self.task.cancel()
            self.error = TimeoutError()
        if self.session is None:
            e = self.error
            while isinstance(e, BaseExceptionGroup):  # anyio task groups wrap the real error
                e = e.exceptions[0]
            why = (f"no MCP handshake within {timeout:g} s (startup_timeout); is it an MCP server?"
                   if isinstance(e, TimeoutError) else " ".join(f"{type(e).__name__}: {e}".split()))  # one line
            if self.stderr_tail:
                why += "; its stderr ended: " + " | ".join(self.stderr_tail)[-400:]
            raise ServerStartFailed(self.redact(f"{self.describe()} failed to start: {why}"))

    def _copy_files(self):
        """A "copy" server runs in a fresh temporary directory holding its own copy of the files
        the config names (isolation "episode": each episode's process starts from the originals)."""
        self._remove_workdir()
        if not self.spec.get("copy"):
            return
        self.workdir = tempfile.mkdtemp(prefix=f"nanorl-mcp-{self.name}-")
        for rel in self.spec["copy"]:
            src, dst = self.base / rel, Path(self.workdir) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst)
            else:
                shutil.copy2(src, dst)

    def _remove_workdir(self):
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    async def _own(self, ready: asyncio.Event, timeout: float):
        from mcp import ClientSession
        before = child_pids()
        try:
            if "url" in self.spec and self.spec.get("type") == "sse":
                from mcp.client.sse import sse_client
                transport = sse_client(self.spec["url"], headers=self.spec.get("headers"))
            elif "url" in self.spec:
                from mcp.client.streamable_http import streamable_http_client
                # the SDK's own SSE event cap stays as a backstop above ours (an event of several data lines)
                client = bounded_http_client(self._on_cut, self._on_lost, self.spec.get("headers"))
                transport = streamable_http_client(self.spec["url"], http_client=client,
                                                   max_sse_event_size=4 * MAX_MESSAGE_BYTES)
            else:
                transport = stdio_transport(self.spec["command"], self.spec.get("args", []), self.spec.get("env"),
                                            self.workdir or self.spec.get("cwd"),
                                            on_junk=lambda line: self.on_junk(self.name, self.redact(line)),
                                            on_cut=self._on_cut, on_stderr=self._on_stderr)
            async with transport as streams:
                self.pids = child_pids() - before  # for the last-resort kill in close(), even if the handshake hangs
                read, write = streams[0], streams[1]
                async with ClientSession(read, write) as session:
                    # an anyio timeout, not asyncio's: the transport's own shutdown then kills the
                    # child (a command that never speaks MCP, e.g. `sleep 1000`, would hang here)
                    with anyio.fail_after(timeout):
                        self.server_name = (await session.initialize()).server_info.name
                        try:
                            self.tools = (await session.list_tools()).tools
                        except Exception as e:  # noqa: BLE001 -- a reply the SDK rejects: say why in one line
                            if self.cut:
                                raise RuntimeError(f"its tools/list reply was {self.cut} bytes, over the "
                                                   f"{MAX_MESSAGE_BYTES >> 20} MiB a reply may hold") from None
                            raise RuntimeError(f"its tools/list reply is not valid: {type(e).__name__}: "
                                               f"{str(e)[:200]}") from None
                    self.session = session
                    self.generation += 1
                    ready.set()
                    await self.stop.wait()
        except Exception as e:  # noqa: BLE001 -- any transport failure: record, the pool restarts us
            self.error = e
        finally:
            self.session = None
            ready.set()

    def _on_cut(self, size: int):
        self.cut = size

    def _on_lost(self):
        self.session_lost = True

    async def shutdown(self, timeout: float = 10.0):
        if self.task is not None:
            self.stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(self.task), timeout)
                self.pids = set()  # stopped and reaped: these pids may be reused by anyone now
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self.task.cancel()
            self.task = None
        self._remove_workdir()


def child_pids() -> set[int]:
    """Our direct children that lead their own session (Linux /proc), as stdio_transport starts
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
