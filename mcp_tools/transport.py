r"""
The bounded transports conn.Conn talks to an MCP server through: stdio_transport for a command,
bounded_http_client for mcp's streamable_http_client. Neither knows Conn: Conn hands them callbacks
(on_junk, on_cut, on_stderr, on_lost) and redacts what those print (conn.py, Secrets).

stdio_transport: mcp's stdio_client (mcp 2.3), re-done in ~100 lines so that one badly behaved
server costs at most one call, never the run:
  - Bounded messages. A message is one line of JSON on the server's stdout. A line is kept up to
    MAX_MESSAGE_BYTES (1 MiB, far above what MCPEnv shows the model); the rest is read and
    dropped as it arrives, each byte looked at once (mcp 2.3's reader rejoins the whole line per
    64 KiB chunk: quadratic). An over-long response becomes an error result holding the first
    KEEP_CHARS (16 K) characters of its first text block and a marker:
        <text>\n[... truncated: the server's reply was 20000123 bytes]
    (the id is read from the line's start, or its end, where TypeScript servers put it). An
    error, since it is not the tool's whole answer, and since mcp 2.3's client rejects a success
    that lacks the structured content the tool's output schema promises. Over streamable HTTP the
    same cut is made on the response body (a JSON reply, or each SSE data line) as it streams in
    (bounded_http_client), so a 200 MB reply is never held whole and an oversized SSE event is an error
    for its call, not a broken connection. A tools/list reply that is cut fails the start in one line.
  - Junk lines. A line that is not JSON-RPC (a banner, a debug print) is dropped with one
    warning per server (on_junk; the pool prints it once), not a traceback per line (mcp 2.3).
  - A request that cannot be serialised (e.g. pydantic's depth limit) is answered at once with
    a JSON-RPC error, instead of failing inside the writer task.
bounded_http_client also calls on_lost on a 404 to a request that carries our mcp-session-id
(conn.py, HTTP sessions).
Process handling is mcp's: the server runs in its own session (so its whole process group can
be killed), shutdown closes its stdin, waits 2 s, then SIGTERMs the group and SIGKILLs it 2 s
later (mcp.os.posix.utilities.terminate_posix_process_tree, mcp 2.3). We read the server's
stderr (conn.py, Secrets). POSIX only, as the pool's cleanup is.

Test: python -m pytest -q tests/test_mcp.py -k "huge or junk or splitter or depth or http"
"""
import json
import re
import subprocess
from contextlib import asynccontextmanager

import anyio


# ----------------------------------------------------------------------------------------------
# the stdio transport (module doc)

MAX_MESSAGE_BYTES = 1 << 20
KEEP_CHARS = 16384
_TAIL_BYTES = 256  # of an over-long line: where a TypeScript server puts the id
_GRACE_S = 2.0     # after stdin closes, before SIGTERM (mcp 2.3's PROCESS_TERMINATION_TIMEOUT)


class _Lines:
    """Split a byte stream into lines in O(n), keeping at most max_bytes of each (plus its tail)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.parts, self.kept, self.size, self.tail = [], 0, 0, b""

    def feed(self, chunk: bytes) -> list[tuple[bytes, bytes, int]]:
        """The lines chunk completes: (first max_bytes bytes, last _TAIL_BYTES bytes, full size)."""
        done, start = [], 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._add(chunk[start:end])
            done.append((b"".join(self.parts), self.tail, self.size))
            self.parts, self.kept, self.size, self.tail = [], 0, 0, b""
            start = end + 1
        self._add(chunk[start:])
        return done

    def _add(self, piece: bytes):
        self.size += len(piece)
        if self.kept < self.max_bytes:
            self.parts.append(piece[:self.max_bytes - self.kept])
            self.kept += len(self.parts[-1])
        if self.size > self.max_bytes:
            self.tail = (self.tail + piece[-_TAIL_BYTES:])[-_TAIL_BYTES:]


_ID = rb'(-?\d+|"(?:[^"\\]|\\.)*")'
_HEAD_ID = re.compile(rb'\s*\{\s*"jsonrpc"\s*:\s*"2\.0"\s*,\s*"id"\s*:\s*' + _ID)
_TAIL_ID = re.compile(rb'"id"\s*:\s*' + _ID + rb'\s*\}\s*$')
_TEXT = re.compile(rb'"text"\s*:\s*"')
_JSON_STR = re.compile(r'(?:[^"\\]|\\.)*', re.DOTALL)


def truncated_response(head: bytes, tail: bytes, size: int) -> dict | None:
    """The JSON-RPC response an over-long line becomes (module doc); None if it names no id."""
    m = _HEAD_ID.match(head) or _TAIL_ID.search(tail)
    if m is None or b'"result"' not in head:
        return None
    text = ""
    if t := _TEXT.search(head):
        # at most 6 bytes per kept character (\uXXXX): the regex's backtracking stack grows with its
        # input, ~100 MB for a 1 MiB string
        raw = head[t.end():t.end() + 6 * (KEEP_CHARS + 8)]
        body = _JSON_STR.match(raw.decode("utf-8", "ignore")).group()[:KEEP_CHARS + 8]
        for cut in range(min(len(body), KEEP_CHARS), max(min(len(body), KEEP_CHARS) - 8, -1), -1):
            try:  # a cut inside an escape (\u12) does not decode: step back a character
                text = json.loads('"' + body[:cut] + '"')
                break
            except ValueError:
                continue
    marker = f"\n[... truncated: the server's reply was {size} bytes]"
    return {"jsonrpc": "2.0", "id": json.loads(m.group(1)),
            "result": {"content": [{"type": "text", "text": text + marker}], "isError": True}}


def parse_line(head: bytes, tail: bytes, size: int, max_bytes: int, on_junk):
    """One stdout line -> a SessionMessage, or None for a blank or junk line (on_junk(line))."""
    from mcp.shared.message import SessionMessage
    from mcp_types import jsonrpc_message_adapter
    if size <= max_bytes and not head.strip():
        return None
    try:
        if size <= max_bytes:
            return SessionMessage(jsonrpc_message_adapter.validate_json(head, by_name=False))
        if (obj := truncated_response(head, tail, size)) is not None:
            return SessionMessage(jsonrpc_message_adapter.validate_python(obj))
    except ValueError:  # pydantic's ValidationError is one
        pass
    on_junk(head[:200].decode("utf-8", "replace") if size <= max_bytes else f"a {size}-byte line that is not a response")
    return None


@asynccontextmanager
async def stdio_transport(command: str, args: list[str], env: dict | None, cwd: str | None, on_junk=print,
                          max_bytes: int = MAX_MESSAGE_BYTES, on_cut=None, on_stderr=None):
    """Start the server; yield (read stream, write stream) for mcp's ClientSession. Its stderr goes
    to on_stderr line by line (Conn redacts it), or straight to ours when on_stderr is None."""
    from mcp.client.stdio import get_default_environment
    process = await anyio.open_process([command, *args], env=get_default_environment() | (env or {}), cwd=cwd,
                                       stderr=subprocess.PIPE if on_stderr else None, start_new_session=True)
    send, read = anyio.create_memory_object_stream(0)
    write, outbox = anyio.create_memory_object_stream(0)
    drained = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_reader, process, send, max_bytes, on_junk, on_cut or (lambda size: None))
        tg.start_soon(_writer, process, outbox, send)
        if on_stderr:
            tg.start_soon(_stderr_lines, process, on_stderr, drained)
        try:
            yield read, write
        finally:
            with anyio.CancelScope(shield=True):  # must finish even when we are cancelled: no server left behind
                await read.aclose()  # the reader now drains stdout without delivering
                await write.aclose()
                await _stop(process)
                if on_stderr:  # its last words (why it failed to start): read, unless a grandchild holds the pipe
                    with anyio.move_on_after(0.5):
                        await drained.wait()
                    await process.stderr.aclose()
            tg.cancel_scope.cancel()


async def _stderr_lines(process, on_line, drained, max_bytes: int = 4096):
    """The server's stderr as lines of at most max_bytes (the rest dropped, its size said)."""
    lines = _Lines(max_bytes)
    try:
        async for chunk in process.stderr:
            for head, _, size in lines.feed(chunk):
                cut = f" [... {size} bytes]" if size > max_bytes else ""
                on_line(head.decode("utf-8", "replace").rstrip("\r") + cut)
        if lines.size:
            on_line(b"".join(lines.parts).decode("utf-8", "replace"))
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        pass
    finally:
        drained.set()


async def _reader(process, send, max_bytes: int, on_junk, on_cut):
    lines, deliver = _Lines(max_bytes), True
    async with send:  # closing it is what tells the session the connection ended
        try:
            async for chunk in process.stdout:
                for head, tail, size in lines.feed(chunk):
                    if size > max_bytes:
                        on_cut(size)
                    msg = parse_line(head, tail, size, max_bytes, on_junk)
                    if msg is not None and deliver:
                        try:
                            await send.send(msg)
                        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                            deliver = False  # shutting down: keep draining so the server can flush and exit
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            pass


async def _writer(process, outbox, send):
    from mcp_types import INVALID_PARAMS, ErrorData, JSONRPCError, JSONRPCRequest
    from mcp.shared.message import SessionMessage
    async with outbox:
        try:
            async for m in outbox:
                try:
                    data = (m.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n").encode("utf-8")
                except Exception as e:  # noqa: BLE001 -- e.g. "Maximum serialization depth exceeded"
                    if isinstance(m.message, JSONRPCRequest):  # answer it here, or its caller waits out its timeout
                        err = ErrorData(code=INVALID_PARAMS, message=f"request not sent: {type(e).__name__}: {e}"[:300])
                        await send.send(SessionMessage(JSONRPCError(jsonrpc="2.0", id=m.message.id, error=err)))
                    continue
                await process.stdin.send(data)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await send.aclose()  # stdin is gone: end the session rather than leave a request hanging


async def _stop(process):
    """Close stdin, wait _GRACE_S, then SIGTERM the process group and SIGKILL it 2 s later (mcp 2.3's order)."""
    from mcp.os.posix.utilities import terminate_posix_process_tree
    try:
        await process.stdin.aclose()
    except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    with anyio.move_on_after(_GRACE_S):
        while process.returncode is None:
            await anyio.sleep(0.01)
    if process.returncode is None:
        await terminate_posix_process_tree(process, 2.0)
        with anyio.move_on_after(2.0):
            while process.returncode is None:
                await anyio.sleep(0.01)
    try:
        await process.stdout.aclose()
    except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass


# ----------------------------------------------------------------------------------------------
# streamable HTTP: bounded bodies and lost sessions (module doc)

def bounded_http_client(on_cut, on_lost, headers: dict | None = None, max_bytes: int = MAX_MESSAGE_BYTES):
    """An httpx2 client as mcp's create_mcp_http_client makes it (mcp 2.3: 30 s, 300 s read; the
    config's headers), whose responses are cut at max_bytes while they stream (on_cut(size)) and
    whose 404s to our session mark it lost (on_lost())."""
    import httpx2
    from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

    class Transport(httpx2.AsyncBaseTransport):
        def __init__(self):
            self.inner = httpx2.AsyncHTTPTransport()

        async def handle_async_request(self, request):
            response = await self.inner.handle_async_request(request)
            if response.status_code == 404 and "mcp-session-id" in request.headers:
                on_lost()
            kind = response.headers.get("content-type", "").lower()
            body = _sse_lines if kind.startswith("text/event-stream") else _whole_body
            return httpx2.Response(response.status_code, headers=response.headers, request=request,
                                   stream=_Stream(body(response.stream, max_bytes, on_cut), response.stream),
                                   extensions=response.extensions)

        async def aclose(self):
            await self.inner.aclose()

    class _Stream(httpx2.AsyncByteStream):
        def __init__(self, chunks, raw):
            self.chunks, self.raw = chunks, raw

        def __aiter__(self):
            return self.chunks

        async def aclose(self):
            await self.chunks.aclose()
            await self.raw.aclose()

    timeout = httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT)
    return httpx2.AsyncClient(timeout=timeout, transport=Transport(), headers=headers)


async def _whole_body(raw, max_bytes: int, on_cut):
    """A JSON reply: passed on if it fits, else the error response truncated_response makes of it."""
    lines = _Lines(max_bytes)
    async for chunk in raw:
        lines._add(chunk)  # the whole body is one message, newlines and all
    if lines.size <= max_bytes:
        yield b"".join(lines.parts)
        return
    on_cut(lines.size)
    obj = truncated_response(b"".join(lines.parts), lines.tail, lines.size)
    yield json.dumps(obj).encode() if obj else b"{}"  # no id to answer: the SDK's parse error for this call


async def _sse_lines(raw, max_bytes: int, on_cut):
    """An SSE stream, line by line: a data line over max_bytes becomes truncated_response's error."""
    lines = _Lines(max_bytes)
    async for chunk in raw:
        out = []
        for head, tail, size in lines.feed(chunk):
            if size <= max_bytes:
                out.append(head + b"\n")
                continue
            on_cut(size)
            obj = truncated_response(head[5:].lstrip(), tail, size) if head.startswith(b"data:") else None
            out.append(b"data: " + json.dumps(obj).encode() + b"\n" if obj else b": dropped an over-long line\n")
        if out:
            yield b"".join(out)
    if lines.size and lines.size <= max_bytes:
        yield b"".join(lines.parts)
