"""
The MCP config: the mcpServers file every MCP client reads, checked key by key, the bundled
default server, and the JSON-schema helpers that turn a server's tools into what the model sees.
pool.MCPPool runs what this describes.

Config (the format Claude Desktop / Cursor use; train.py: --mcp-config FILE):
    {"mcpServers": {"name": {"command": "...", "args": [...], "env": {...}, "cwd": "..."},
                    "other": {"url": "http://127.0.0.1:8765/mcp"}}}
Default (no file): the bundled server, command = sys.executable, args = [mcp_tools/server.py].
Keys of one mcpServers entry (check_config rejects any other; errors name the server and file):
    command          stdio server: the program to run (exactly one of command / url)
    args             its arguments, a list of strings
    env              extra environment variables (the SDK passes only HOME, PATH, ... otherwise)
    cwd              its working directory
    url              HTTP server: its endpoint, e.g. http://127.0.0.1:8765/mcp (streamable HTTP)
    headers          HTTP server: headers sent with every request, e.g. {"Authorization": "Bearer ..."}
                     (args, env, url and header values are never printed: conn.py, Secrets)
    type             the transport, as other clients write it: "stdio" (needs command), "http",
                     "streamable-http" or "streamableHttp" (streamable HTTP; need url), "sse" (the
                     older HTTP+SSE transport; needs url). Optional: command means stdio, url
                     streamable HTTP. A type that disagrees with command/url is an error.
    disabled         true: skip this server, as Claude Desktop / Cursor / Cline do; only its name
                     and this key are checked (check_config returns the config without it).
    autoApprove, alwaysAllow   Cline's per-tool approval lists: accepted and ignored (no human
                     approves calls during training)
    timeout          seconds per tool call (default: MCPPool(call_timeout=), 30); MCPEnv(call_timeout=) overrides
    startup_timeout  seconds to start, handshake and list tools (default: MCPPool(start_timeout=), 30)
                     (both: a number in (0, 86400], sane_seconds; eval.py's --tool-timeout too)
    tools            allow-list: only these tools are shown and callable (unknown names: error)
    exclude_tools    deny-list: these tools are neither shown nor callable (unknown names: error)
    row_tools        true: a prompt shows only the tools its row names (extra_info.tools; MCPEnv.reset),
                     so the caps apply per row, not to the server's whole list (BFCL's 128: bfcl.py)
    isolation        "shared" (default: one process for every episode) or "episode" (a fresh
                     process per episode, command servers only; see Pool design for the cost)
    copy             isolation "episode" only: files or folders (relative to cwd, no "..") that
                     each episode's process gets its own copy of, in a fresh temporary directory
                     (its cwd, removed when the episode ends). A fresh process alone does not
                     isolate state kept in files (an sqlite database): name them here and use
                     relative paths in args; absolute paths are shared by every episode.
Filtering applies to the tools the model sees; a session-aware server's `reset` is still called.
Session-aware: a server whose reset tool is marked as the session hook (session_hook, below).
A key that appears twice in one object (JSON parsers silently keep the last) is an error.

Also here: unencodable(arguments), which keeps text UTF-8 cannot encode (a lone surrogate) off a
shared stdio connection, and strip_titles / openai_schema for the tool schemas.

Test: python -m pytest -q tests/test_mcp.py
"""
import json
import os
import re
import sys
from pathlib import Path

BUNDLED_SERVER = str(Path(__file__).resolve().parent / "server.py")
BUNDLED_SERVER_NAME = "nanorl-tools"  # the name server.py's MCPServer gives itself (initialize's serverInfo)


def bundled_config(test_tools: bool = False) -> dict:
    """The default config: our offline server over stdio, run by this Python."""
    args = [BUNDLED_SERVER] + (["--test-tools"] if test_tools else [])
    spec = {"command": sys.executable, "args": args}
    # the mcp SDK starts stdio servers with a minimal environment (HOME, PATH, ...) that drops
    # PYTHONPATH; our server must see the packages we do
    if os.environ.get("PYTHONPATH"):
        spec["env"] = {"PYTHONPATH": os.environ["PYTHONPATH"]}
    return {"mcpServers": {"nanorl": spec}}


MAX_SECONDS = 86400.0  # a day: a timeout past it is a typo (and >= 1e10 s overflowed asyncio's timer)


def sane_seconds(v) -> bool:
    """A timeout in seconds: a finite number in (0, MAX_SECONDS] (not a bool; NaN, inf, 0 are no timeout)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= MAX_SECONDS


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    """json.load's object_pairs_hook: a key twice in one object is an error, not "the last one wins"."""
    seen = set()
    for k, _ in pairs:
        if k in seen:
            raise _DuplicateKey(k)
        seen.add(k)
    return dict(pairs)


def load_config(path: str) -> dict:
    """Read and check an mcpServers JSON file; errors name the file and the field."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: bad JSON: {e}") from None
    except _DuplicateKey as e:
        raise ValueError(f"{path}: key {e.args[0]!r} appears twice in one object (JSON readers keep only the last one)") from None
    return check_config(cfg, where=path)


SERVER_KEYS = ("command", "args", "env", "cwd", "url", "headers", "type", "disabled", "autoApprove", "alwaysAllow",
               "timeout", "startup_timeout", "tools", "exclude_tools", "isolation", "copy", "row_tools")
TYPES = {"stdio": "command", "http": "url", "streamable-http": "url", "streamableHttp": "url", "sse": "url"}


def check_config(cfg: dict, where: str = "mcp config") -> dict:
    """Check every key of every mcpServers entry (module doc, Config); errors name the file and server.
    Returns the config without its disabled servers."""
    servers = cfg.get("mcpServers") if isinstance(cfg, dict) else None
    if not isinstance(servers, dict) or not servers:
        raise ValueError(f"{where}: want {{\"mcpServers\": {{\"name\": {{\"command\": ..., \"args\": [...]}}}}}}")
    enabled = {}
    for name, spec in servers.items():
        w = f"{where}: mcpServers.{name}"
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", name):
            raise ValueError(f"{w}: server names must be 1-32 characters of letters, digits, _ -")
        if isinstance(spec, dict) and not isinstance(spec.get("disabled", False), bool):
            raise ValueError(f"{w}.disabled must be true or false")
        if isinstance(spec, dict) and spec.get("disabled"):
            continue
        _check_server(spec, w)
        enabled[name] = spec
    if not enabled:
        raise ValueError(f"{where}: every server is disabled")
    return {**cfg, "mcpServers": enabled}


def _check_server(spec, w: str):
    """One enabled mcpServers entry; w names it in errors ("file: mcpServers.name")."""
    def str_list(v):
        return isinstance(v, list) and all(isinstance(a, str) for a in v)

    if not isinstance(spec, dict) or ("command" in spec) == ("url" in spec):
        raise ValueError(f"{w}: needs exactly one of \"command\" (stdio) or \"url\" (HTTP)")
    if unknown := sorted(set(spec) - set(SERVER_KEYS)):
        raise ValueError(f"{w}: unknown key(s) {', '.join(unknown)}; known: {', '.join(SERVER_KEYS)}")
    for key in ("command", "url", "cwd"):
        if key in spec and not isinstance(spec[key], str):
            raise ValueError(f"{w}.{key} must be a string")
    if "type" in spec:
        if spec["type"] not in TYPES:
            raise ValueError(f"{w}.type must be one of {', '.join(map(repr, TYPES))}, got {spec['type']!r}")
        if TYPES[spec["type"]] not in spec:
            raise ValueError(f"{w}: type {spec['type']!r} needs \"{TYPES[spec['type']]}\"")
    for key in ("args", "tools", "exclude_tools", "autoApprove", "alwaysAllow", "copy"):
        if key in spec and not str_list(spec[key]):
            raise ValueError(f"{w}.{key} must be a list of strings")
    for key in ("env", "headers"):
        if not isinstance(spec.get(key, {}), dict) or not all(isinstance(v, str) for v in spec.get(key, {}).values()):
            raise ValueError(f"{w}.{key} must be an object of strings")
    if "headers" in spec and "url" not in spec:
        raise ValueError(f"{w}: headers are sent to an HTTP server: they need \"url\"")
    for key in ("timeout", "startup_timeout"):
        if key in spec and not sane_seconds(spec[key]):
            raise ValueError(f"{w}.{key} must be a positive number of seconds, at most {MAX_SECONDS:g} (a day), got {repr(spec[key])[:40]}")
    if not isinstance(spec.get("row_tools", False), bool):
        raise ValueError(f"{w}.row_tools must be true or false")
    if spec.get("isolation", "shared") not in ("shared", "episode"):
        raise ValueError(f"{w}.isolation must be \"shared\" or \"episode\"")
    if spec.get("isolation") == "episode" and "url" in spec:
        raise ValueError(f"{w}: isolation \"episode\" starts a process per episode: needs \"command\", not \"url\"")
    if "copy" in spec:
        if spec.get("isolation") != "episode":
            raise ValueError(f"{w}.copy gives each episode its own files: it needs \"isolation\": \"episode\"")
        for rel in spec["copy"]:
            if not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
                raise ValueError(f"{w}.copy: {rel!r} must be a path relative to the server's cwd, without ..")


def unencodable(arguments) -> str | None:
    r"""Where a string or dict key that UTF-8 cannot encode sits, e.g. "arguments.a[2]"; None if all encode.

    json.loads accepts lone surrogates ("\ud800") and a sampling model can emit them, but the
    mcp SDK's stdio writer (mcp 2.3) encodes each message with errors="strict" inside the
    transport's task group: one such call would kill the shared connection and every episode
    on it. Iterative, since json.loads accepts nesting as deep as the recursion limit."""
    todo = [("arguments", arguments)]
    while todo:
        path, obj = todo.pop()
        if isinstance(obj, str):
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if unencodable(k) is not None:
                    return f"a key of {path}"
                todo.append((f"{path}.{k}", v))
        elif isinstance(obj, (list, tuple)):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
    return None

# ----------------------------------------------------------------------------------------------
# tool schemas as the model sees them (pure functions)

SESSION_HOOK_META = "nanorl/session_reset"  # the same string as server.SESSION_HOOK_META (not imported:
# importing server.py builds its database)


def session_hook(tool) -> bool:
    """Is this mcp Tool a server's session hook, reset(session, ...) marked with _meta
    {"nanorl/session_reset": true} (the bundled server's; any server may add it)? A tool that is
    only named reset and takes a session (a game's "restart the level") is an ordinary tool: the
    pool called it twice an episode and hid it from the model."""
    return (tool is not None and tool.name == "reset" and (tool.meta or {}).get(SESSION_HOOK_META) is True
            and "session" in (tool.input_schema or {}).get("properties", {}))


def strip_titles(schema):
    """Drop pydantic's "title" keywords (noise for a small model); keep properties named title."""
    if isinstance(schema, list):
        return [strip_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "title":
            continue
        if k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
            out[k] = {name: strip_titles(sub) for name, sub in v.items()}  # keys here are names
        else:
            out[k] = strip_titles(v)
    return out


def openai_schema(name: str, description: str, input_schema: dict, drop: tuple = ()) -> dict:
    params = strip_titles(input_schema or {"type": "object", "properties": {}})
    if drop:
        params = dict(params)
        params["properties"] = {k: v for k, v in params.get("properties", {}).items() if k not in drop}
        if "required" in params:
            params["required"] = [r for r in params["required"] if r not in drop]
    return {"type": "function", "function": {"name": name, "description": description or "", "parameters": params}}
