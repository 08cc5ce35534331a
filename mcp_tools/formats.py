r"""
Tool-call formats: one parser per model family, chosen from the chat template (detect) or a flag.

    family       a call as the family's chat template renders it (and the model writes it)
    hermes       <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>  (Qwen2.5, Qwen3, SmolLM2's
                 JSON list of calls in one block); Qwen2.5's doubled-brace copy {{...}} read unless strict;
                 objects one after another in one block are not run; the error shows them one a block
    qwen3-xml    <tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>
                 (Qwen3-Coder, Qwen3.5); a value is JSON if it reads as JSON, else text, except where the
                 tool's schema says "string" (then always text: vLLM's qwen3_coder parser does the same);
                 a value also ends at the next <parameter= or </function> (a missing </parameter>, as vLLM)
    llama3-json  {"name": "f", "parameters": {"x": 1}} as the whole turn, optionally after <|python_tag|>,
                 several separated by ';' or newlines (Llama 3.1 / 3.2); the engine also stops on <|eom_id|>
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, ...] (v3 tokenizers) or
                 [TOOL_CALLS]f[ARGS]{"x": 1} (v11+; an optional [CALL_ID]id before [ARGS] is skipped; also
                 read without [ARGS], [TOOL_CALLS]f{"x": 1}, the form vLLM's tests give its parser)

FORMATS[name].parse(text, strict=False, tools=None) -> (calls [{"name", "arguments": dict}], errors [str]).
FORMATS[name].render(name, arguments) -> the assistant text for one call, as the family's template writes
it (tojson: json.dumps with ensure_ascii=False) and its parser reads back exactly, except a value holding
the family's own end marker (</tool_call>, [TOOL_CALLS]; qwen3-xml: </parameter>, </function>,
<function=, <parameter=) and, for qwen3-xml, a string that reads as JSON where tools= does not type it "string".
Every parser is a pure, total function, linear in the turn's length: malformed text, NaN / Infinity in
the arguments (nonfinite), a call too long or nested too deep (json_too_big, json_value_at: measured on
the call alone) are error strings the model reads, never an exception. A turn with no call and no error
is the final answer (MCPEnv). `marker` is the text a call starts with; `stop_strings` are end-of-call
strings the engine must stop on besides the template's end of turn; `call_ids`: the template demands a
tool_call_id on each tool result; `result_marker`: the text the template starts a tool result with,
where the model may write one itself (own_result_at: MCPEnv runs no call written after it, see
mcp_tools/env.py; one inside a well-formed call's value is that call's text).

Special tokens: rollout decodes without special tokens, except those an env lists in keep_special;
MCPEnv lists its format's `specials` (Llama's <|python_tag|>, Mistral's [TOOL_CALLS] / [ARGS] /
[CALL_ID], special tokens in the real tokenizers), so they reach the parser and the end-of-turn
token does not. Without them (a plain decode): llama3-json reads bare JSON anyway; mistral reads a
turn that starts with a bare JSON list of calls (what is left of [TOOL_CALLS][...]).

resolve_tool_format(--tool-format, tokenizer, stop ids) -> (the family, the stop ids with its end-of-call tokens):
what train.py and eval.py run once the servers are open.

Adding a family: a parse and a render function below, an entry in FORMATS, a rule in detect, and a chat-template
fixture plus its round-trip tests in tests/test_mcp.py.

TOOL_CHAT_TEMPLATE and ensure_tool_template (the file's end): a hermes-format chat template installed
for models whose own template drops tools (SmolLM2-Instruct).

Test: python -m pytest -q tests/test_mcp.py -k "format or parser"
"""
import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable

# far above any real call (8x a 1024-token turn; real arguments nest a few levels); deeper nesting
# stalls the bundled server and breaks mcp's request serialisation
MAX_CALL_CHARS, MAX_CALL_DEPTH = 32_000, 32
_JSON_TOKENS = re.compile(r'\\.|["\[\]{}]', re.DOTALL)


def json_too_big(text: str) -> str | None:
    """Why text may not be parsed as a tool call (too long, nested too deep); None if it may.
    One pass over its brackets and quotes, before json.loads builds anything."""
    if len(text) > MAX_CALL_CHARS:
        return f"{len(text)} characters, over the limit of {MAX_CALL_CHARS}"
    return _brackets(text, 0, len(text))[1]


def json_value_at(text: str, pos: int = 0) -> tuple[int, str | None]:
    """(end, why) for the JSON object or list that opens at text[pos]: text[pos:end] is that value as its
    brackets and quotes delimit it (json.loads still judges it; end is len(text) if it never closes), and
    why it may not be parsed: json_too_big's limits on the value alone, not on the text after it (a valid
    call followed by 32,000 characters or 33 '[' of prose was refused). Reads at most the limit."""
    end, why = _brackets(text, pos, pos + MAX_CALL_CHARS, stop_at_close=True)
    if why is None and end < 0 and len(text) - pos > MAX_CALL_CHARS:
        why = f"over the limit of {MAX_CALL_CHARS} characters"
    return (len(text) if end < 0 else end), why


def _brackets(text: str, pos: int, endpos: int, stop_at_close: bool = False) -> tuple[int, str | None]:
    """One pass over text[pos:endpos]'s brackets and quotes: (just past the bracket that closes the value
    opening at pos, if stop_at_close and it closes there, else -1; why it nests too deep, else None)."""
    depth, in_string = 0, False
    for m in _JSON_TOKENS.finditer(text, pos, endpos):
        t = m.group()
        if t == '"':
            in_string = not in_string
        elif in_string or t[0] == "\\":
            continue
        elif t in "[{":
            depth += 1
            if depth > MAX_CALL_DEPTH:
                return -1, f"nested deeper than {MAX_CALL_DEPTH} levels"
        else:
            depth -= 1
            if stop_at_close and depth == 0:
                return m.end(), None
    return -1, None


def nonfinite(arguments) -> str | None:
    """Where a NaN or +-Infinity sits in parsed arguments, e.g. "arguments.a[2]"; None if nowhere.
    json.loads reads NaN, Infinity and 1e999 (as inf); JSON has no such numbers, and mcp sent
    them as null, so the tool ran on an argument the model never wrote. Iterative (deep nesting)."""
    todo = [("arguments", arguments)]
    while todo:
        path, obj = todo.pop()
        if isinstance(obj, float) and not math.isfinite(obj):
            return path
        if isinstance(obj, dict):
            todo.extend((f"{path}.{k}", v) for k, v in obj.items())
        elif isinstance(obj, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
    return None


def _add_call(calls, errors, k, obj, args_key="arguments"):
    """Check one decoded call object {"name": str, args_key: object or a JSON string of one} and
    append it to calls, or why not to errors. Missing arguments mean {}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        errors.append(f'tool call {k}: want a JSON object with a string "name" and an object "{args_key}"')
        return
    args = obj.get(args_key, {})
    if isinstance(args, str) and json_too_big(args) is None:  # a double-encoded object
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        errors.append(f'tool call {k} ({obj["name"][:64]}): "{args_key}" must be a JSON object')
        return
    if where := nonfinite(args):
        errors.append(f"tool call {k} ({obj['name'][:64]}): {where[:100]} is NaN or Infinity, "
                      "not a JSON number; the call was not run")
        return
    calls.append({"name": obj["name"], "arguments": args})


def _loads(text: str, k: int, errors: list, want: str):
    """json.loads(text) bounded by json_too_big; None (and an error) if it fails."""
    if why := json_too_big(text):
        errors.append(f"tool call {k}: {why}; the call was not run")
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        errors.append(f"tool call {k}: invalid JSON ({str(e)[:200]}); want {want}")
        return None

# ----------------------------------------------------------------------------------------------
# hermes: <tool_call>{json}</tool_call>


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _call_blocks(text: str):
    """Each <tool_call> block of text -> (where it opens, where its </tool_call> starts): a block runs
    to the first close after its open; an unclosed one gives -1 and is the last."""
    start = text.find(_OPEN)
    while start >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        yield start, end
        if end < 0:
            return
        start = text.find(_OPEN, end + len(_CLOSE))


def _objects(body: str) -> list[dict]:
    """The whole JSON objects body holds one after another (whitespace between), [] if anything else
    is in it: a model that writes several calls in one block meant them as calls."""
    pos, objs, dec = 0, [], json.JSONDecoder()
    while pos < len(body):
        try:
            obj, pos = dec.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return []
        if not isinstance(obj, dict):
            return []
        objs.append(obj)
        while pos < len(body) and body[pos].isspace():
            pos += 1
    return objs


def doubled_braces(body: str) -> dict | None:
    """The call in a block written with its outer braces doubled, {{"name": ..., "arguments": {...}}}
    (or with only the opening one doubled), else None. Qwen2.5's chat template states the call
    format as that literal text and small models copy it: the model meant a call, so failing it
    would teach JSON escaping, not tool use. Such a call runs, but MCPEnv._charge counts it as failed
    (accepted for free, the doubled form and its broken variants spread); the metrics show
    tool_parse_rate and tool_parse_rate_strict. Only the outermost pair is undone: the object
    inside must be complete JSON, followed by at most the one extra '}'."""
    if not body.startswith("{{"):
        return None
    try:
        obj, end = json.JSONDecoder().raw_decode(body[1:])
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) and body[1 + end:].strip() in ("", "}") else None


def parse_tool_calls(text: str, strict: bool = False, tools=None) -> tuple[list[dict], list[str]]:
    """All <tool_call>JSON</tool_call> blocks of a turn -> (calls [{"name", "arguments"}], errors).

    Total over any string: json errors, huge ints (ValueError in 3.11+), NaN / Infinity in the
    arguments (nonfinite) and blocks too long or too deep (json_too_big) all become error strings.
    `arguments` may be an object or a JSON string of one (some models double-encode); missing
    arguments means {}. A block may hold a JSON list of calls (SmolLM2's format). An unclosed
    <tool_call> is an error. A block with doubled outer braces is read as its inner object
    (doubled_braces) unless strict."""
    calls, errors = [], []
    for k, (start, end) in enumerate(_call_blocks(text), 1):
        if end < 0:
            errors.append(f"tool call {k}: <tool_call> is not closed by </tool_call>")
            break
        body = text[start + len(_OPEN):end].strip()
        if why := json_too_big(body):
            errors.append(f"tool call {k}: {why}; the call was not run")
            continue
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            obj = None if strict else doubled_braces(body)
            if obj is None and len(objs := _objects(body)) > 1:  # calls one after another in one block
                # the error shows them written one a block: trained policies sent the same packed turn
                # up to the turn limit when told only the rule (json_too_big bounds what is echoed)
                blocks = "\n".join(map(_hermes_block, objs))
                errors.append(f"tool call {k}: {len(objs)} JSON objects in one <tool_call> block; the calls were "
                              f"not run. Write each call in its own <tool_call>...</tool_call> block:\n{blocks}")
                continue
            if obj is None:
                errors.append(f"tool call {k}: invalid JSON ({str(e)[:200]}); want "
                              '{"name": "<tool>", "arguments": {...}}')
                continue
        # one object, or a list of them in one block (SmolLM2's / APIGen's function-calling format)
        for obj in (obj if isinstance(obj, list) and obj else [obj]):
            _add_call(calls, errors, k, obj)
    stray = text.count(_CLOSE) - text.count(_OPEN)
    if stray > 0 and not any("not closed" in e for e in errors):
        errors.append(f"{stray} </tool_call> without a matching <tool_call>")
    return calls, errors


def render_hermes(name: str, arguments: dict) -> str:
    """One call as Qwen2.5's template renders it (its tojson is json.dumps with ensure_ascii=False)."""
    return _hermes_block({"name": name, "arguments": arguments})


def _hermes_block(obj: dict) -> str:
    """One JSON object in a call block, as the template writes a call (and the several-objects error shows one)."""
    return f"{_OPEN}\n{_tojson(obj)}\n{_CLOSE}"


def _tojson(obj) -> str:
    """What chat templates' tojson writes: json.dumps with non-ASCII kept (transformers 5.24,
    utils/chat_template_utils.py)."""
    return json.dumps(obj, ensure_ascii=False)

# ----------------------------------------------------------------------------------------------
# qwen3-xml: <tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>


_FN_OPEN, _FN_CLOSE, _PARAM_OPEN, _PARAM_CLOSE = "<function=", "</function>", "<parameter=", "</parameter>"
_PY_LITERALS = {"True": True, "False": False, "None": None}  # what Jinja's `| string` makes of them


def _string_params(tools) -> dict[str, set]:
    """tool name -> the parameters its JSON schema types as "string" (from MCPPool.tools)."""
    out = {}
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else {}
        props = (f.get("parameters") or {}).get("properties") or {}
        out[f.get("name")] = {p for p, s in props.items() if isinstance(s, dict) and s.get("type") == "string"}
    return out


def _xml_value(raw: str, as_text: bool):
    """A parameter's value: the text between <parameter=K>\\n and \\n</parameter> (_xml_params; one newline each
    side dropped, as Qwen3-Coder's template adds them), JSON if it reads as JSON, else the text.
    The template writes scalars with Jinja's `| string`, so True / False / None are Python's."""
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw
    if as_text:
        return raw
    if raw.strip() in _PY_LITERALS:
        return _PY_LITERALS[raw.strip()]
    if json_too_big(raw) is None:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            pass
    return raw


def _functions(text: str):
    """Each <function=NAME>...</function> of text -> (where it opens, where its body starts, where its
    </function> starts): a call runs to the first close after its open; an unclosed one gives -1 and is the
    last. A <function= whose NAME does not end in '>' on its line opens nothing. One pass: the next '>' and
    newline are looked up once, not once per <function= (as a regex, 10,000 unclosed ones took 22 s)."""
    gt = nl = -1
    at = text.find(_FN_OPEN)
    while at >= 0:
        name_at = at + len(_FN_OPEN)
        if gt < name_at:
            gt = _find(text, ">", name_at)
        if nl < name_at:
            nl = _find(text, "\n", name_at)
        if gt < min(nl, len(text)):
            end = text.find(_FN_CLOSE, gt + 1)
            yield at, gt + 1, end
            if end < 0:
                return
            at = text.find(_FN_OPEN, end + len(_FN_CLOSE))
        else:
            at = text.find(_FN_OPEN, at + 1)


def _find(text: str, sub: str, start: int) -> int:
    """text.find, with len(text) for "nowhere" (so a miss is not looked up again)."""
    at = text.find(sub, start)
    return len(text) if at < 0 else at


def _xml_params(body: str) -> tuple[list[tuple[str, str]], str]:
    """A function body -> ([(KEY, raw value)] of its <parameter=KEY>value</parameter> blocks, the text outside
    them). A value also ends at the next <parameter= or at </function>, as in vLLM's qwen3_coder parser: a
    missing </parameter> made the value swallow the next parameter, without an error."""
    head, *pieces = body.split(_PARAM_OPEN)
    params, outside = [], [head]
    for piece in pieces:
        gt = piece.find(">")
        if gt < 0 or "\n" in piece[:gt]:  # not <parameter=KEY> on one line: text, not a parameter
            outside.append(_PARAM_OPEN + piece)
            continue
        value, _, after = piece[gt + 1:].partition(_PARAM_CLOSE)
        params.append((piece[:gt].strip(), value))
        outside.append(after)
    return params, "".join(outside).strip()


def parse_qwen3_xml(text: str, strict: bool = False, tools=None) -> tuple[list[dict], list[str]]:
    """All <function=NAME>...</function> blocks of a turn, with or without their <tool_call> wrapper
    (Qwen3-Coder sometimes drops it; vLLM's parser reads both). tools (MCPPool.tools) say which
    parameters are strings: "42" stays "42" for a string parameter, else it is the number 42."""
    calls, errors = [], []
    strings = _string_params(tools)
    k = 0
    for start, body_at, end in _functions(text):
        if end < 0:
            break
        k += 1
        if end + len(_FN_CLOSE) - start > MAX_CALL_CHARS:
            errors.append(f"tool call {k}: {end + len(_FN_CLOSE) - start} characters, over the limit of "
                          f"{MAX_CALL_CHARS}; the call was not run")
            continue
        name = text[start + len(_FN_OPEN):body_at - 1].strip()
        params, outside = _xml_params(text[body_at:end])
        if not name or outside:
            errors.append(f"tool call {k}: want <function=NAME> then <parameter=KEY>\\nvalue\\n</parameter> "
                          f"blocks, then </function>; got {(outside or text[start:end + len(_FN_CLOSE)])[:100]!r}")
            continue
        args = {key: _xml_value(raw, key in strings.get(name, ())) for key, raw in params}
        _add_call(calls, errors, k, {"name": name, "arguments": args})
    if text.count(_FN_OPEN) > k:
        errors.append(f"tool call {k + 1}: <function=...> is not closed by </function>")
    return calls, errors


def render_qwen3_xml(name: str, arguments: dict) -> str:
    """One call as Qwen3-Coder's template renders it: objects and lists as JSON, other values with
    Jinja's `| string` (strings raw, True / None as Python writes them). The template's own newline
    before <tool_call> is the generation prompt's, so the model's turn starts at <tool_call>."""
    def text(v):
        return _tojson(v) if isinstance(v, (dict, list)) else str(v)
    params = "".join(f"<parameter={k}>\n{text(v)}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"

# ----------------------------------------------------------------------------------------------
# llama3-json: {"name": ..., "parameters": {...}} as the whole turn


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, strict: bool = False, tools=None) -> tuple[list[dict], list[str]]:
    """A turn that starts (after whitespace and an optional <|python_tag|>) with '{' is one or more
    call objects separated by ';' or newlines, {"name": ..., "parameters": {...}} ("arguments" also
    read); any other turn holds no call. Text after the last object is ignored. Llama 3.1's template
    renders one call per message; several in one turn are what vLLM's llama3_json parser reads."""
    calls, errors = [], []
    s = text.lstrip()
    s = s[len(_PYTHON_TAG):].lstrip() if s.startswith(_PYTHON_TAG) else s
    pos, k = 0, 0
    while pos < len(s) and s[pos] == "{":
        k += 1
        end, why = json_value_at(s, pos)  # this call's extent: the limits and json read it alone
        if why:
            errors.append(f"tool call {k}: {why}; the call was not run")
            break
        try:
            obj = json.loads(s[pos:end])
        except (ValueError, RecursionError) as e:
            errors.append(f"tool call {k}: invalid JSON ({str(e)[:200]}); "
                          'want {"name": "<tool>", "parameters": {...}}')
            break
        key = "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
        _add_call(calls, errors, k, obj, key)
        pos = end
        while pos < len(s) and s[pos] in " \t\r\n;":
            pos += 1
    return calls, errors



def render_llama3_json(name: str, arguments: dict) -> str:
    """One call as Llama 3.1's template renders it: the whole turn, with "parameters"."""
    return _tojson({"name": name, "parameters": arguments})

# ----------------------------------------------------------------------------------------------
# mistral: [TOOL_CALLS][{...}, ...] or [TOOL_CALLS]NAME[ARGS]{...}


_TOOL_CALLS = "[TOOL_CALLS]"
# NAME, an optional [CALL_ID]id, then [ARGS] or (a decode without it, vLLM's test form) the '{' of the
# arguments. The id is anything up to '[' or '{': one scan, where "\s*\S*?\s*" backtracked quadratically.
_NAME_ARGS = re.compile(r"\s*([A-Za-z0-9_.:-]+)\s*(?:\[CALL_ID\][^\[{]*)?(?:\[ARGS\]|(?=\{))")


def parse_mistral(text: str, strict: bool = False, tools=None) -> tuple[list[dict], list[str]]:
    """Each [TOOL_CALLS] is followed by a JSON list of {"name", "arguments"} objects (extra keys such
    as "id" ignored) or by NAME[ARGS]{json} (NAME{json} also read: [ARGS] dropped). A turn with no
    [TOOL_CALLS] that starts with a JSON list is read as one (a decode without special tokens drops
    [TOOL_CALLS]; module doc). Text after a call's JSON is not the call's."""
    calls, errors = [], []
    pieces = text.split(_TOOL_CALLS)[1:]
    if not pieces and text.lstrip().startswith("[{"):
        pieces = [text]
    dec = json.JSONDecoder()
    for k, piece in enumerate(pieces, 1):
        m = _NAME_ARGS.match(piece)
        name, body = (m.group(1), piece[m.end():].lstrip()) if m else (None, piece.lstrip())
        end, why = json_value_at(body) if body[:1] in ("{", "[") else (len(body), None)
        if why:
            errors.append(f"tool call {k}: {why}; the call was not run")
            continue
        try:
            obj, _ = dec.raw_decode(body[:end])
        except (ValueError, RecursionError) as e:
            errors.append(f"tool call {k}: invalid JSON ({str(e)[:200]}); want [TOOL_CALLS]"
                          '[{"name": "<tool>", "arguments": {...}}]')
            continue
        if name is not None:
            _add_call(calls, errors, k, {"name": name, "arguments": obj})
        elif isinstance(obj, list) and obj:
            for o in obj:
                _add_call(calls, errors, k, o)
        else:
            errors.append(f"tool call {k}: want a JSON list of "
                          '{"name": ..., "arguments": {...}} after [TOOL_CALLS]')
    return calls, errors



def render_mistral(name: str, arguments: dict) -> str:
    """One call in the v11+ form, [TOOL_CALLS]NAME[ARGS]{json}: no call id to invent, and parse_mistral
    reads it with or without the special tokens kept."""
    return f"{_TOOL_CALLS}{name}[ARGS]{_tojson(arguments)}"

# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    name: str
    parse: Callable  # (text, strict=False, tools=None) -> (calls, errors)
    render: Callable  # (name, arguments) -> the assistant text of one call, which parse reads back
    marker: str      # the text a call starts with
    stop_strings: list = field(default_factory=list)  # end-of-call strings besides the end of turn
    specials: tuple = ()     # marker texts the decode must keep where they are special tokens (module doc)
    call_ids: bool = False   # tool results need a tool_call_id (Mistral's template raises without one)
    result_marker: str = ""  # how the template opens a tool result, in text a model can write (own_result_at)


FORMATS = {
    "hermes": Format("hermes", parse_tool_calls, render_hermes, "<tool_call>", result_marker="<tool_response>"),
    "qwen3-xml": Format("qwen3-xml", parse_qwen3_xml, render_qwen3_xml, "<function=", result_marker="<tool_response>"),
    "llama3-json": Format("llama3-json", parse_llama3_json, render_llama3_json, '{"name"', ["<|eom_id|>"],
                          (_PYTHON_TAG,)),
    "mistral": Format("mistral", parse_mistral, render_mistral, _TOOL_CALLS,
                      specials=(_TOOL_CALLS, "[ARGS]", "[CALL_ID]"), call_ids=True),
}


def own_result_at(text: str, marker: str, family: str = "hermes", tools=None) -> int:
    """Where a model's turn starts a tool result of its own: the first `marker` outside every call that
    family's parser reads (hermes: <tool_call> blocks; qwen3-xml: <function=...> calls, wrapped or not);
    -1 if none, or no marker. One inside a well-formed call is that call's text (a parameter's value); one
    inside a call that does not parse is a result written in call tags, and the turn ends where that call
    opens; an unclosed call runs to the end (its parser reads nothing after it). What follows was written
    without any tool's answer, so MCPEnv runs no call from it. One walk over the calls and the markers."""
    if not marker:
        return -1
    spans, close = (_functions(text), _FN_CLOSE) if family == "qwen3-xml" else (_call_blocks(text), _CLOSE)
    at = text.find(marker)
    for start, *_, end in spans:
        if at < start:  # before this call, or no marker left (-1)
            return at
        if end < 0:
            return -1
        end += len(close)
        if at >= end:
            continue
        calls, errors = FORMATS[family].parse(text[start:end], tools=tools)
        if errors or not calls:
            return start
        at = text.find(marker, end)
    return at


def detect(chat_template: str | None) -> str:
    """The family whose calls this chat template renders (a pure function of its text): Qwen3-Coder /
    Qwen3.5 write <function=, Mistral [TOOL_CALLS], Llama 3.x <|python_tag|> or ipython results with
    "parameters"; anything else (Qwen2.5's, TOOL_CHAT_TEMPLATE, none) is hermes."""
    t = chat_template or ""
    if "<function=" in t:  # before hermes: Qwen3-Coder's template also has <tool_call>
        return "qwen3-xml"
    if _TOOL_CALLS in t:
        return "mistral"
    if _PYTHON_TAG in t or ("parameters" in t and "ipython" in t):
        return "llama3-json"
    return "hermes"


def resolve_tool_format(name: str, tokenizer, stop_ids: list | None) -> tuple:
    """(tool-call format, stop token ids) for --tool-format NAME: "auto" reads the family from the chat
    template (detect; after envs.open_mcp_pool, which may install a tool template), and the family's
    own end-of-call tokens join the stop ids (Llama 3.x ends a call with <|eom_id|>)."""
    fmt = detect(getattr(tokenizer, "chat_template", None)) if name == "auto" else name
    if fmt not in FORMATS:
        raise ValueError(f"--tool-format {name}: unknown; known: auto, {', '.join(FORMATS)}")
    vocab = tokenizer.get_vocab()
    extra = [vocab[s] for s in FORMATS[fmt].stop_strings if s in vocab]
    return fmt, (list(stop_ids or []) + [i for i in extra if i not in (stop_ids or [])]) or stop_ids


# ----------------------------------------------------------------------------------------------
# the chat template for models whose own template drops tools (e.g. SmolLM2-Instruct)

# ChatML with Qwen2.5's tool layout: a <tools> block of JSON schemas in the system turn, the
# model answers <tool_call>{json}</tool_call>, tool results come back as <tool_response> blocks
# in one user turn. No default system prompt (so observation rendering after a dummy
# conversation, as rollout.observation_ids does, adds nothing but the observation).
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou can call the functions described inside <tools></tools> (JSON schemas):\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, write one JSON object per call inside <tool_call></tool_call> tags:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for tc in (m.tool_calls or []) %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PROBE_TOOL = {"type": "function", "function": {"name": "zz_probe_tool_7f3a", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


def ensure_tool_template(tokenizer, tools: list[dict] | None = None) -> bool:
    """Install TOOL_CHAT_TEMPLATE if the tokenizer's template does not render tools (a probe tool's
    name is missing: SmolLM2's ChatML drops tools; Qwen2.5's renders a <tools> block and role "tool"
    as <tool_response> in a user turn); True if installed."""
    probe = (tools or []) + [_PROBE_TOOL]
    msgs = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(msgs, tools=probe, tokenize=False, add_generation_prompt=True)
        renders = _PROBE_TOOL["function"]["name"] in text
    except Exception:  # noqa: BLE001 -- a template that chokes on tools= is one that lacks tool support
        renders = False
    if not renders:
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return not renders
