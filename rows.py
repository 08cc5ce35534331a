"""
Dataset rows (SkyRL's dataset format) and their files: validation, .jsonl and .parquet I/O.

One dict per prompt:
    {"data_source": str, "prompt": [{"role": .., "content": ..}, ...], "env_class": str,
     "reward_spec": {"method": "rule", "ground_truth": <str | number | dict | list>},
     "extra_info": {...}}
env_class and extra_info may be missing (default: the --env flag, {}); everything else is
required, and a bad row is an error naming file:line (jsonl) or file:row N (parquet). Blank
jsonl lines are the only thing skipped; an empty file is an error.
Parquet layout (our choice): prompt as list<struct<role: string, content: string>> as SkyRL
writes it; reward_spec, extra_info (and any other non-string column) as JSON text, because
ground_truth and extra_info differ in type between rows and parquet needs one schema per
column. The JSON columns are listed in the file's metadata key b"nanorl_json_columns" and
decoded on read; files without that key (e.g. SkyRL's own, with native structs) read as is.

Few-shot prompts: with_fewshot(rows, shots) puts a list of chat messages (worked examples,
e.g. envs.multiply_shots(k) or mcp_server.tasks.DEMO) between each row's system message(s) and
the rest of its prompt:

    prompt = [system msgs of the row] + shots + [the row's other msgs, in order]

Data order: next_rows(rows, data_state, k, seed) hands out rows in a per-epoch shuffled order
(random.Random(seed * 100003 + epoch)); data_state = {"epoch", "pos"} is all a resume needs.

Which env a row gets, and what its ground_truth means, is envs.py's business (env_class_of).

Test: python -m pytest -q tests/test_envs.py
"""

import json
import random
from pathlib import Path

_ROLES = ("system", "user", "assistant", "tool")
_JSON_TYPES = (str, int, float, bool, dict, list, type(None))


def validate_row(row: dict, where: str) -> dict:
    """Check one row; returns it with defaults filled (extra_info = {}). where: 'file:line 3'."""
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
        row = {**row, "extra_info": {}}
    elif not isinstance(extra, dict):
        raise bad(f"extra_info must be an object, got {type(extra).__name__}")
    return row


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines are not rows (e.g. a trailing newline)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:line {lineno}: bad JSON: {e}") from None
            rows.append(validate_row(row, f"{path}:line {lineno}"))
    return rows


def _read_parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq  # imported here so jsonl-only users never load pyarrow
    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    json_cols = json.loads(meta.get(b"nanorl_json_columns", b"[]"))
    rows = []
    for i, row in enumerate(table.to_pylist()):
        where = f"{path}:row {i}"
        for col in json_cols:
            if isinstance(row.get(col), str):
                try:
                    row[col] = json.loads(row[col])
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: column {col!r} is not valid JSON: {e}") from None
        if isinstance(row.get("prompt"), list):
            # struct columns get one schema for all rows: drop keys that are null-padding
            row["prompt"] = [{k: v for k, v in m.items() if v is not None or k == "content"}
                             if isinstance(m, dict) else m for m in row["prompt"]]
        rows.append(validate_row(row, where))
    return rows


def load_rows(path: str) -> list[dict]:
    """All rows of a .jsonl or .parquet file, each validated; errors name file and line/row."""
    path = str(path)
    if path.endswith(".jsonl"):
        rows = _read_jsonl(path)
    elif path.endswith(".parquet"):
        rows = _read_parquet(path)
    else:
        raise ValueError(f"{path}: unknown dataset format (want .jsonl or .parquet)")
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def save_rows(rows: list[dict], path: str) -> None:
    """Write rows (validated first) as .jsonl or .parquet; layout in the module docstring."""
    path = str(path)
    rows = [validate_row(r, f"row {i} (writing {path})") for i, r in enumerate(rows)]
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
        pq.write_table(pa.table(data, schema=schema), path)
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


def next_rows(rows, data_state, k, seed):
    """k rows in a per-epoch shuffled order; data_state {"epoch", "pos"} is all a resume needs."""
    out = []
    while len(out) < k:
        order = list(range(len(rows)))
        random.Random(seed * 100003 + data_state["epoch"]).shuffle(order)
        take = order[data_state["pos"]:data_state["pos"] + k - len(out)]
        out += [rows[i] for i in take]
        data_state["pos"] += len(take)
        if data_state["pos"] >= len(rows):
            data_state["epoch"], data_state["pos"] = data_state["epoch"] + 1, 0
    return out
