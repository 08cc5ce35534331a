r"""
Dataset rows (SkyRL's dataset format) and their files: validation, .jsonl and .parquet I/O.

One dict per prompt:
    {"data_source": str, "prompt": [{"role": .., "content": ..}, ...], "env_class": str,
     "reward_spec": {"method": "rule", "ground_truth": <str | number | dict | list>},
     "extra_info": {...}}
env_class and extra_info may be missing (default: the --env flag, {}); everything else is
required, and a bad row is an error naming file:line (jsonl) or file:row N (parquet), a key
twice in one object too (JSON parsers keep the last silently). Blank jsonl lines are the only
thing skipped; an empty file is an error. extra_info.oracle_calls (the oracle's tool calls:
--rescue's plan, partial credit, sft.py) is [{"name": str, "arguments": {...}}, ...], at most
MAX_ORACLE_CALLS calls and MAX_ORACLE_CHARS characters of JSON. An unusable one is the one thing
not refused: it is named file:line at load, a warning a row (the first _NOTES_SHOWN, then a count),
and dropped; the row trains without it and is never guided. Our choice: refusing would stop a run
over what only --rescue and partial credit read; dropping it loses no row and hides none.
Parquet layout (our choice): prompt as list<struct<role: string, content: string>> as SkyRL
writes it; reward_spec, extra_info (and any other non-string column) as JSON text, because
ground_truth and extra_info differ in type between rows and parquet needs one schema per
column. The JSON columns are listed in the file's metadata key b"nanorl_json_columns" and
decoded on read; files without that key (e.g. SkyRL's own, with native structs) read as is.
save_rows writes row groups of 4096 rows (the unit a lazy rows[i] decodes).

Lazy rows: load_rows(path, check=None) returns Rows, a read-only sequence (len, rows[i],
rows[a:b] -> list, iteration, == a list) that keeps no row in memory, so a 1M-row file costs
no Python objects per row. One streaming pass at load validates every row (a bad row fails
before any model loads), calls check(row, where) on it (envs.load_splits' per-env rules) and
keeps where each row is: jsonl, its line's byte offset (array('q'), 8 B/row); parquet, the first
row of each row group (rows[i] decodes the group holding i, an LRU of 2). Warts: jsonl lines
split on "\n" only; a file changed after the load is an error on the next read (size/mtime).

Few-shot prompts: with_fewshot(rows, shots) -> a list (for generated rows, not a 1M-row file):
    prompt = [system msgs of the row] + shots + [the row's other msgs, in order]

Data order: next_rows(rows, data_state, k, seed) hands out rows in a per-epoch shuffled order

    order(epoch) = random.Random(seed * 100003 + epoch).shuffle(0 .. len(rows) - 1)

data_state = {"epoch", "pos"} is all a resume needs, and the order is the same over Rows as
over a list of the same rows. The epoch's order is shuffled once and kept (array('q'), 8 B/row,
the last one per process), so a step costs O(k), not a reshuffle of every row.
Which env a row gets, and what its ground_truth means, is envs.py's business (env_class_of).

Test: python -m pytest -q tests/test_envs.py
      NANORL_SLOW=1 python -m pytest -q -s -k slow tests/test_envs.py   (the 1M-row measurement)
"""

import bisect
import json
import os
import random
from array import array
from itertools import accumulate
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

_ROLES = ("system", "user", "assistant", "tool")
_JSON_TYPES = (str, int, float, bool, dict, list, type(None))
_CACHE_GROUPS = 2  # parquet row groups kept decoded (Arrow tables) for rows[i]
MAX_ORACLE_CALLS = 16   # a row's oracle calls: --rescue writes them into the prompt as a plan
MAX_ORACLE_CHARS = 4096  # their JSON in all (~1k tokens); the bundled tasks' longest is 293
_NOTES_SHOWN = 20  # rows named one by one in the load's warnings; the rest are counted


def oracle_calls_error(calls, tools=None) -> str | None:
    """Why calls cannot be a row's extra_info.oracle_calls, or None; tools: the tool names the
    servers offer, when known (options/rescue.py), else any name goes."""
    if not isinstance(calls, list):
        return f"must be a list of {{name, arguments}} calls, got {type(calls).__name__}"
    if len(calls) > MAX_ORACLE_CALLS:
        return f"holds {len(calls)} calls, more than {MAX_ORACLE_CALLS}"
    for j, c in enumerate(calls):
        if not isinstance(c, dict):
            return f"[{j}] must be an object {{name, arguments}}, got {type(c).__name__}"
        if not isinstance(c.get("name"), str) or not c["name"]:
            return f"[{j}].name must be a non-empty string, got {repr(c.get('name'))[:40]}"
        if not isinstance(c.get("arguments"), dict):
            return f"[{j}].arguments must be an object, got {type(c['arguments']).__name__}" if "arguments" in c else f"[{j}] has no arguments"
        if tools is not None and c["name"] not in tools:
            return f"[{j}].name {c['name'][:40]!r} is no tool the servers offer"
    try:
        size = len(json.dumps(calls, ensure_ascii=False))
    except (TypeError, ValueError) as e:  # a parquet file's native column may hold what JSON cannot
        return f"is not JSON: {e}"
    return f"is {size} characters of JSON, more than {MAX_ORACLE_CHARS}" if size > MAX_ORACLE_CHARS else None


def validate_row(row: dict, where: str, notes: list | None = None) -> dict:
    """Check one row; returns it with defaults filled (extra_info = {}). where: 'file:line 3'.
    An unusable extra_info.oracle_calls is dropped, and named in notes when given (the load
    pass's; a later read of the row drops it without a word)."""
    def bad(msg):
        return ValueError(f"{where}: {msg}")
    if not isinstance(row, dict):
        raise bad(f"row must be a JSON object, got {type(row).__name__}")
    for key in ("data_source", "prompt", "reward_spec"):
        if key not in row:
            raise bad(f"missing field {key!r}")
    if not isinstance(row["data_source"], str):
        raise bad(f"data_source must be a string, got {type(row['data_source']).__name__}")
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt must be a non-empty list of chat messages")
    for j, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise bad(f"prompt[{j}] must be an object with role and content")
        if m.get("role") not in _ROLES:
            raise bad(f"prompt[{j}].role must be one of {_ROLES}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            got = type(m.get("content")).__name__
            raise bad(f"prompt[{j}].content must be a string, got {got}")
    env_class = row.get("env_class")
    if env_class is not None and (not isinstance(env_class, str) or not env_class):
        raise bad(f"env_class must be a non-empty string, got {env_class!r}")
    spec = row["reward_spec"]
    if not isinstance(spec, dict):
        raise bad(f"reward_spec must be an object, got {type(spec).__name__}")
    if not isinstance(spec.get("method"), str):
        raise bad("reward_spec.method must be a string")
    if "ground_truth" not in spec:
        raise bad("missing field reward_spec.ground_truth")
    if not isinstance(spec["ground_truth"], _JSON_TYPES):
        raise bad(f"reward_spec.ground_truth has type {type(spec['ground_truth']).__name__}")
    extra = row.get("extra_info")
    if extra is None:
        return {**row, "extra_info": {}}
    if not isinstance(extra, dict):
        raise bad(f"extra_info must be an object, got {type(extra).__name__}")
    if extra.get("oracle_calls") is None or (err := oracle_calls_error(extra["oracle_calls"])) is None:
        return row
    if notes is not None:
        notes.append(f"{where}: extra_info.oracle_calls {err}")
    return {**row, "extra_info": {k: v for k, v in extra.items() if k != "oracle_calls"}}


def _object(pairs):
    """json's object_pairs_hook: a dict, or a ValueError naming a key the object holds twice."""
    d = dict(pairs)
    if len(d) < len(pairs):
        seen = set()
        raise ValueError(f"duplicate key {next(k for k, _ in pairs if k in seen or seen.add(k))!r}")
    return d


def _parse_jsonl_line(line: bytes, where: str, notes=None):
    """One jsonl line -> validated row, or None for a blank line (the only thing skipped)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:  # a ValueError too: re-raised naming file:line
        raise ValueError(f"{where}: bad UTF-8: {e}") from None
    if not text.strip():
        return None
    try:
        row = json.loads(text, object_pairs_hook=_object)
    except (ValueError, RecursionError) as e:  # also a >4300-digit int, nesting too deep, a key twice
        raise ValueError(f"{where}: bad JSON: {e}") from None
    return validate_row(row, where, notes)


def _parquet_row(row: dict, json_cols: list, where: str, notes=None) -> dict:
    """One row as pyarrow's to_pylist gives it -> validated row (JSON columns decoded)."""
    for col in json_cols:
        if isinstance(row.get(col), str):
            try:
                row[col] = json.loads(row[col], object_pairs_hook=_object)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"{where}: column {col!r} is not valid JSON: {e}") from None
    if isinstance(row.get("prompt"), list):
        # struct columns get one schema for all rows: drop keys that are null-padding
        row["prompt"] = [{k: v for k, v in m.items() if v is not None or k == "content"}
                         if isinstance(m, dict) else m for m in row["prompt"]]
    return validate_row(row, where, notes)


def _seq_eq(a, b):
    """a == b row by row, for any sequence b but a string (a list, Rows)."""
    if not isinstance(b, Sequence) or isinstance(b, (str, bytes)):
        return NotImplemented
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


class Rows(Sequence):
    """The rows of a .jsonl or .parquet file, read lazily; len, rows[i], rows[a:b] (a list), iter.

    Built by one streaming pass that validates every row (errors name file:line / file:row N)
    and keeps only where each row is: jsonl, the byte offset of each row's line (array('q'),
    8 B/row); parquet, the first row of each row group (from the footer; nothing per row).
    rows[i] then reads row i again and validates it again: jsonl, open + seek + readline +
    json.loads; parquet, the row group holding i, decoded as an Arrow table into an LRU of
    _CACHE_GROUPS groups (a shuffled order misses it on most rows: one group decode per row).
    Every read checks the file's size and mtime against the load: a file changed
    since then (offsets now wrong) is an error, not other rows. Each read returns a fresh dict:
    mutating it does not change the file's rows (as with a list, it would have)."""

    def __init__(self, path: str, check=None):
        """check(row, where): called on every row of the load pass; it raises to refuse one."""
        self.path = str(path)
        if self.path.endswith(".jsonl"):
            self.kind = "jsonl"
        elif self.path.endswith(".parquet"):
            self.kind = "parquet"
        else:
            raise ValueError(f"{self.path}: unknown dataset format (want .jsonl or .parquet)")
        st = os.stat(self.path)
        self._stamp, notes = (st.st_size, st.st_mtime_ns), []  # notes: what the load pass dropped
        if self.kind == "jsonl":
            self._offsets = array("q")
            with open(self.path, "rb") as f:
                pos = 0
                for lineno, line in enumerate(f, 1):  # \n only (text mode: a lone \r too)
                    where = f"{self.path}:line {lineno}"
                    row = _parse_jsonl_line(line, where, notes)
                    if row is not None:
                        if check is not None:
                            check(row, where)
                        self._offsets.append(pos)
                    pos += len(line)
            self._len = len(self._offsets)
        else:
            import pyarrow.parquet as pq  # imported here so jsonl-only users never load pyarrow
            pf = pq.ParquetFile(self.path)
            meta = pf.schema_arrow.metadata or {}
            self._json_cols = json.loads(meta.get(b"nanorl_json_columns", b"[]"))
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            self._group_starts = list(accumulate(sizes, initial=0))  # [0, .., n]
            self._groups = OrderedDict()  # group -> pyarrow.Table, most recently used last
            for i, row in enumerate(self._iter_parquet(pf, notes)):  # it validates each row
                if check is not None:
                    check(row, f"{self.path}:row {i}")
            self._len = self._group_starts[-1]
        if not self._len:
            raise ValueError(f"{self.path}: no rows")
        warn_dropped(notes, self.path)

    def __len__(self):
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._read(range(self._len)[i])
        return self._read([range(self._len)[i]])[0]  # range() does negatives and IndexError

    def __iter__(self):
        """Streams the file (one pass, like the load), not rows[0], rows[1], ..."""
        if self.kind == "jsonl":
            with open(self.path, "rb") as f:
                self._check(os.fstat(f.fileno()))
                for lineno, line in enumerate(f, 1):
                    row = _parse_jsonl_line(line, f"{self.path}:line {lineno}")
                    if row is not None:
                        yield row
        else:
            import pyarrow.parquet as pq
            self._check(os.stat(self.path))
            yield from self._iter_parquet(pq.ParquetFile(self.path))

    def __eq__(self, other):  # == a list of the same rows
        return _seq_eq(self, other)

    __hash__ = None

    def __repr__(self):
        return f"Rows({self.path!r}, {self._len} rows, lazy {self.kind})"

    def _check(self, st):
        if (st.st_size, st.st_mtime_ns) != self._stamp:
            raise ValueError(f"{self.path}: changed since load_rows read it (size or mtime); "
                             f"load it again")

    def _iter_parquet(self, pf, notes=None):
        i = 0
        for batch in pf.iter_batches(batch_size=1024):  # memory: one row group, decoded
            for row in batch.to_pylist():
                yield _parquet_row(row, self._json_cols, f"{self.path}:row {i}", notes)
                i += 1

    def _read(self, idx) -> list:
        if self.kind == "jsonl":
            out = []
            with open(self.path, "rb") as f:
                self._check(os.fstat(f.fileno()))
                for i in idx:
                    f.seek(self._offsets[i])
                    out.append(_parse_jsonl_line(f.readline(), f"{self.path}:row {i}"))
            return out
        out = []
        for i in idx:
            g = bisect.bisect_right(self._group_starts, i) - 1
            table = self._groups.pop(g, None)
            if table is None:
                import pyarrow.parquet as pq
                self._check(os.stat(self.path))
                table = pq.ParquetFile(self.path).read_row_group(g)
            self._groups[g] = table  # (re)inserted last: most recently used. No lock: two
            # threads may decode a group twice, never read a wrong one
            while len(self._groups) > _CACHE_GROUPS:
                self._groups.popitem(last=False)
            j = i - self._group_starts[g]
            out.append(_parquet_row(table.slice(j, 1).to_pylist()[0], self._json_cols,
                                    f"{self.path}:row {i}"))
        return out


def warn_dropped(notes: list, what: str) -> None:
    """The load's warnings: each row whose extra_info.oracle_calls was dropped, the first
    _NOTES_SHOWN by file:line, then how many in all."""
    for note in notes[:_NOTES_SHOWN]:
        print(f"WARNING: {note}: dropped, the row trains without it", flush=True)
    if notes:
        print(f"WARNING: {what}: unusable extra_info.oracle_calls dropped from {len(notes)} rows "
              f"({min(len(notes), _NOTES_SHOWN)} named above): they train, and --rescue never guides them", flush=True)


def load_rows(path: str, check=None) -> Rows:
    """All rows of a .jsonl or .parquet file, each validated at load (and passed to check(row,
    where) when given) and read lazily after."""
    return Rows(path, check)


def save_rows(rows: list[dict], path: str, row_group_size: int = 4096) -> None:
    """Write rows (validated first) as .jsonl or .parquet; layout in the module docstring.

    row_group_size (parquet): rows per row group, the unit Rows decodes for one rows[i]."""
    path, notes = str(path), []
    rows = [validate_row(r, f"row {i} (writing {path})", notes) for i, r in enumerate(rows)]
    warn_dropped(notes, path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if path.endswith(".jsonl"):
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    elif path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        columns = list(dict.fromkeys(k for r in rows for k in r))  # union, first-seen order
        plain_prompt = all(set(m) == {"role", "content"} for r in rows for m in r["prompt"])
        string_cols = {c for c in columns if all(isinstance(r.get(c), str) for r in rows)}
        json_cols = [c for c in columns if c not in string_cols
                     and not (c == "prompt" and plain_prompt)]
        data, fields = {}, []
        for c in columns:
            if c in json_cols:
                data[c] = [json.dumps(r.get(c), ensure_ascii=False) for r in rows]
                fields.append(pa.field(c, pa.string()))
            elif c == "prompt":
                data[c] = [r[c] for r in rows]
                fields.append(pa.field(c, pa.list_(pa.struct(
                    [("role", pa.string()), ("content", pa.string())]))))
            else:
                data[c] = [r[c] for r in rows]
                fields.append(pa.field(c, pa.string()))
        schema = pa.schema(fields, metadata={"nanorl_json_columns": json.dumps(json_cols)})
        pq.write_table(pa.table(data, schema=schema), path, row_group_size=row_group_size)
    else:
        raise ValueError(f"{path}: unknown dataset format (want .jsonl or .parquet)")


def with_fewshot(rows: list[dict], shots: list[dict]) -> list[dict]:
    """New rows with the messages `shots` between each row's system message(s) and the rest.

    Every system message moves to the front (in practice there is one and it is first); the
    input rows are not modified, and every row gets the same shots."""
    out = []
    for r in rows:
        sys_msgs = [m for m in r["prompt"] if m["role"] == "system"]
        rest = [m for m in r["prompt"] if m["role"] != "system"]
        out.append({**r, "prompt": sys_msgs + list(shots) + rest})
    return out


_order = (None, None)  # ((len, seed, epoch), that epoch's order): the last one next_rows shuffled


def epoch_order(n: int, seed: int, epoch: int) -> array:
    """The epoch's order of 0 .. n-1 (module docstring). Shuffled in an array('q'): 8 B/row and
    the same permutation as shuffling a list, since random.shuffle draws the same numbers for
    any sequence of that length. Kept until another (n, seed, epoch) is asked for."""
    global _order
    key, order = _order
    if key != (n, seed, epoch):
        order = array("q", range(n))
        random.Random(seed * 100003 + epoch).shuffle(order)  # once an epoch, not every call
        _order = ((n, seed, epoch), order)  # one assignment: a thread sees the old pair or this
    return order


def next_rows(rows, data_state, k, seed):
    """k rows in a per-epoch shuffled order; data_state {"epoch", "pos"} is all a resume needs.

    O(k) a call: the epoch's order is shuffled on the first call that needs it (epoch_order).
    random.shuffle's order, not numpy's, so a data_state saved by an older run resumes onto the
    same rows."""
    out = []
    while len(out) < k:
        order = epoch_order(len(rows), seed, data_state["epoch"])
        take = order[data_state["pos"]:data_state["pos"] + k - len(out)]
        out += [rows[i] for i in take]
        data_state["pos"] += len(take)
        if data_state["pos"] >= len(rows):
            data_state["epoch"], data_state["pos"] = data_state["epoch"] + 1, 0
    return out

# ---- a run's splits (envs.load_splits passes envs' row check and generated tasks)

def load_splits(env: str, train_data: str | None, eval_data, *, digits: int | str, fewshot: int,
                seed: int, eval_limit: int, eval_every: int, mcp_config: str | None = None,
                check_row, generated_splits) -> tuple:
    """(train rows, eval rows): the files given, else generated_splits(env, digits, fewshot, seed,
    eval_limit) (multiply, mcp) or data/out/gsm8k. Every row of both splits passes
    check_row(row, env, where) (envs.py's; file rows in their load pass), so a bad one fails here,
    before any model loads. eval_data: None, a file, or a list of
    "[NAME=]FILE" (train.py's repeatable --eval-data): of each set its first eval_limit rows; with
    several sets, or one named, every eval row is a copy carrying "eval_set": NAME (the file's stem unless given),
    which train.evaluate scores apart. A missing --train-data file is named before any rule on
    the other flags; mcp with --eval-data and no --train-data is an error (it would train on the
    bundled tasks), multiply then says in one line that it trains on the generated rows."""
    specs = [eval_data] if isinstance(eval_data, str) else list(eval_data or [])
    if train_data and not Path(train_data).is_file():  # before any rule about the other flags
        raise FileNotFoundError(f"--train-data {train_data}: file not found")
    if mcp_config and not train_data:
        raise ValueError("--mcp-config names your own servers: pass your rows with --train-data (and "
                         "--eval-data or --eval-every 0); the bundled tasks need the bundled server")
    if env == "mcp" and specs and not train_data:  # your eval rows, the bundled tasks trained: say which
        raise ValueError("--eval-data without --train-data: the run would train on the bundled MCP tasks, not "
                         "yours; pass --train-data FILE (the bundled tasks as files: python mcp_tools/tasks.py "
                         "--out data/out/mcp, then --train-data data/out/mcp/train.jsonl)")
    check = lambda row, where: check_row(row, env, where)  # noqa: E731
    if env == "gsm8k":  # rows written by data/gsm8k.py
        hint = ("; make the GSM8K rows first with\n  python data/gsm8k.py --src https://raw.githubusercontent.com/"
                "openai/grade-school-math/master/grade_school_math/data --out data/out/gsm8k\n(or pass --train-data/--eval-data)")
        train = _read_split(train_data or "data/out/gsm8k/train.jsonl", "--train-data", check, hint)
        return train, _eval_sets(specs or ["data/out/gsm8k/test.jsonl"], check, eval_limit, hint)
    if train_data and not specs and eval_every:
        raise ValueError("--train-data without --eval-data: eval would run the generated tasks, not yours; "
                         "pass --eval-data FILE (held-out rows of yours) or --eval-every 0")
    generated = (None, None)
    if not (train_data and specs):
        generated = generated_splits(env, digits, fewshot, seed, eval_limit)
        for name, split in zip(("train", "eval"), generated):
            for i, row in enumerate(split):
                check(row, f"generated {name} row {i}")
    if specs and not train_data:  # your eval rows, generated training rows: said, not silent
        print(f"--eval-data without --train-data: training on the generated {env} rows (--digits {digits})")
    train = _read_split(train_data, "--train-data", check) if train_data else generated[0]
    return train, _eval_sets(specs, check, eval_limit) if specs else generated[1][:eval_limit]


def _eval_sets(specs: list, check, eval_limit: int, hint: str = "") -> list:
    """The eval rows of one or more "[NAME=]FILE" specs (load_splits' doc)."""
    sets, named = {}, False
    for spec in specs:
        given = "=" in spec and not Path(spec).is_file()  # NAME=FILE
        named = named or given
        name, path = spec.split("=", 1) if given else (Path(spec).stem, spec)
        if name in sets:
            raise ValueError(f"--eval-data: two sets named {name!r}; name them, e.g. --eval-data seen={path}")
        sets[name] = _read_split(path, "--eval-data", check, hint)[:eval_limit]
    if len(sets) == 1 and not named:  # one file, unnamed: plain rows (a named one, e.g. val=FILE, keeps its name)
        return next(iter(sets.values()))
    return [{**row, "eval_set": name} for name, rows in sets.items() for row in rows]


def _read_split(path: str, flag: str, check, hint: str = ""):
    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag} {path}: file not found{hint}")
    return load_rows(path, check)
