"""Lazy dataset rows (rows.Rows): flat memory at scale, the same rows as an eager read, the same
file:line errors, and next_rows' exact order over a lazy sequence (what a resume relies on).

The memory test runs this file as a script in a fresh interpreter (one per mode), so the peak
RSS it reports (ru_maxrss) is the load + draws and nothing pytest did before:
    python tests/test_rows.py lazy|list PATH STEPS K -> JSON {"grow_mb", ...}

Test: python -m pytest -q tests/test_rows.py        (200k rows, ~15 s on 2 cores)
      NANORL_SLOW=1 python -m pytest -q tests/test_rows.py -k slow   (1M rows, ~1 min)
"""

import hashlib
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.rows import load_rows, next_rows, save_rows, validate_row  # noqa: E402

def small_row(i: int) -> dict:
    """A multiply-style row of ~170 bytes of JSON; extra_info.index = i names it."""
    a, b = 10 + i % 90, 10 + (i * 7) % 90
    return {"data_source": "synthetic_multiply",
            "prompt": [{"role": "user", "content": f"{a} * {b}?"}],
            "env_class": "multiply", "reward_spec": {"method": "rule", "ground_truth": str(a * b)},
            "extra_info": {"index": i}}


def write_jsonl(path, n: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(small_row(i)) + "\n" for i in range(n))


def peak_mb() -> float:
    """Peak RSS of this process. Linux: VmHWM, since ru_maxrss survives exec, so a child of a
    big pytest process would start at its parent's peak and show no growth at all."""
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**10
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 2**10  # bytes on macOS, KiB elsewhere


def measure(mode: str, path: str, steps: int, k: int) -> dict:
    """Peak RSS growth of reading the file (lazy: load_rows with envs.load_splits' row check;
    list: the old eager list of dicts), one full iteration and `steps` next_rows draws of k."""
    import envs  # before the baseline: its imports (torch) are not the rows' memory
    base = peak_mb()
    t0 = time.perf_counter()
    if mode == "lazy":
        rows = load_rows(path, lambda row, where: envs.check_row(row, "multiply", where))
    else:  # what load_rows returned before Rows: every row parsed and kept
        with open(path, encoding="utf-8") as f:
            rows = [validate_row(json.loads(line), f"{path}:line {n}")
                    for n, line in enumerate(f, 1) if line.strip()]
    t_load = time.perf_counter() - t0
    after_load = peak_mb()
    t0 = time.perf_counter()
    n_iter = sum(1 for _ in rows)
    t_iter = time.perf_counter() - t0
    state, drawn, h, t0 = {"epoch": 0, "pos": 0}, 0, hashlib.sha256(), time.perf_counter()
    for step in range(steps):
        batch = next_rows(rows, state, k, seed=3)
        h.update(json.dumps(batch, sort_keys=True).encode())
        drawn += len(batch)
        if step == 0:
            after_first = peak_mb()
    t_steps = time.perf_counter() - t0
    return {"mode": mode, "rows": len(rows), "iterated": n_iter, "drawn": drawn,
            "load_mb": round(after_load - base, 1), "grow_mb": round(peak_mb() - base, 1),
            "steps_grow_mb": round(peak_mb() - after_first, 1), "digest": h.hexdigest(),
            "state": state, "t_load": round(t_load, 2), "t_iter": round(t_iter, 2),
            "t_step": round(t_steps / steps, 3)}


if __name__ == "__main__":  # script mode, for the memory tests' fresh interpreters
    mode, path, steps, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(measure(mode, path, steps, k)))
    sys.exit(0)

import pytest  # noqa: E402

slow = pytest.mark.skipif(not os.environ.get("NANORL_SLOW"),
                          reason="1M-row measurement: set NANORL_SLOW=1 to run it")


def run_measure(mode, path, steps, k) -> dict:
    out = subprocess.run([sys.executable, __file__, mode, str(path), str(steps), str(k)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def check_memory(path, n, lazy_cap_mb):
    # 10 steps of 64 prompts (the epoch boundary is tested on a small file, below)
    lazy, eager = run_measure("lazy", path, 10, 64), run_measure("list", path, 10, 64)
    print(f"\n{n} rows  lazy: {lazy}\n{n} rows  list: {eager}")
    assert lazy["rows"] == eager["rows"] == lazy["iterated"] == n
    assert lazy["digest"] == eager["digest"] and lazy["state"] == eager["state"]  # same draws
    assert lazy["grow_mb"] < lazy_cap_mb
    assert lazy["load_mb"] < 16 * n / 1e6 + 8  # the index: 8 B/row (+ allocator slack)
    assert lazy["steps_grow_mb"] < 4  # flat over the steps: nothing accumulates per draw
    assert eager["grow_mb"] > 5 * lazy["grow_mb"]
    return lazy, eager


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    n = 200_000
    path = tmp_path_factory.mktemp("rows") / "big.jsonl"
    write_jsonl(path, n)
    return path, n


def test_memory_flat_200k(big):
    # measured (2 CPU cores, Python 3.11): lazy peak +4.3 MB (index 1.6 MB, next_rows' order
    # 1.6 MB), list of dicts +375 MB (~1.9 KB a 170-byte row)
    path, n = big
    check_memory(path, n, lazy_cap_mb=100)


@slow
def test_slow_memory_flat_1m(tmp_path):
    n = 1_000_000
    path = tmp_path / "big.jsonl"
    write_jsonl(path, n)
    check_memory(path, n, lazy_cap_mb=100)


def test_rows_equal_eager_json_and_error_deep_in_file(big, tmp_path):
    path, n = big
    rows = load_rows(path)
    with open(path, "rb") as f:
        lines = f.readlines()
    for i in random.Random(0).sample(range(n), 200) + [0, n - 1]:
        assert rows[i] == json.loads(lines[i]) == small_row(i)
    assert rows[-1] == small_row(n - 1) and rows[n - 3:] == [small_row(i) for i in range(n - 3, n)]
    with pytest.raises(IndexError):
        rows[n]
    # a bad row after n good ones: the load names its line, not a row number
    bad = tmp_path / "bad.jsonl"
    shutil.copy(path, bad)
    row = small_row(0)
    del row["reward_spec"]
    with open(bad, "a") as f:
        f.write("\n" + json.dumps(row) + "\n" + json.dumps(small_row(1)) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:line {n + 2}: missing field 'reward_spec'"):
        load_rows(bad)
    with open(bad, "r+") as f:
        f.seek(0, 2)
        f.write("{not json\n")
    # the first error wins
    with pytest.raises(ValueError, match=f"bad.jsonl:line {n + 2}: missing field"):
        load_rows(bad)


def mixed_rows(n):
    """Rows with non-ASCII text (byte offsets != character offsets) and varied fields."""
    rows = []
    for i in range(n):
        r = small_row(i)
        r["prompt"].insert(0, {"role": "system", "content": "é\U0001F600 " * (i % 5)})
        r["extra_info"]["note"] = ["x", {"ü": i}] if i % 3 else None
        if i % 4 == 0:
            del r["env_class"]
        rows.append(validate_row(r, "test"))
    return rows


def test_jsonl_blank_lines_crlf_unicode_and_slices(tmp_path):
    rows = mixed_rows(300)
    path = tmp_path / "d.jsonl"
    with open(path, "w", encoding="utf-8", newline="") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(r, ensure_ascii=False) + ("\r\n" if i % 2 else "\n"))
            if i % 7 == 0:
                f.write("\n  \n")  # blank lines: skipped, but they count as lines
    lazy = load_rows(path)
    assert len(lazy) == 300 and lazy == rows and list(lazy) == rows
    assert lazy[5:17] == rows[5:17] and lazy[::-40] == rows[::-40] and lazy[-2] == rows[-2]
    lazy[3]["extra_info"]["index"] = -1  # a fresh dict each read: the file's rows do not change
    assert lazy[3] == rows[3]
    # a file changed after the load is an error, not silently other rows
    with open(path, "a") as f:
        f.write(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="changed since load_rows"):
        lazy[0]


def test_parquet_lazy_by_row_group(tmp_path):
    import pyarrow as pa
    rows = mixed_rows(1000)
    path = tmp_path / "d.parquet"
    save_rows(rows, path, row_group_size=100)
    before = pa.total_allocated_bytes()
    lazy = load_rows(path)
    assert len(lazy) == 1000 and lazy._group_starts == list(range(0, 1001, 100))
    assert len(lazy._groups) == 0  # the load pass decodes nothing it keeps
    back = lambda r: {k: v for k, v in r.items() if v is not None}  # noqa: E731 (env_class: None)
    for i in random.Random(0).sample(range(1000), 100):
        assert back(lazy[i]) == back(rows[i])
        assert len(lazy._groups) <= 2
    assert [back(r) for r in lazy] == [back(r) for r in rows]
    assert [back(r) for r in lazy[95:205]] == [back(r) for r in rows[95:205]]
    whole = pa.Table.from_pylist([{"p": json.dumps(r)} for r in rows]).nbytes
    assert pa.total_allocated_bytes() - before < whole / 3  # two groups of ten held at most
    # a bad row deep in the file: file:row N at load (written SkyRL-style, native structs, as
    # save_rows would refuse it)
    import pyarrow.parquet as pq
    bad = [small_row(i) for i in range(1000)]
    bad[876]["prompt"] = [{"role": "robot", "content": "x"}]
    pq.write_table(pa.Table.from_pylist(bad), path, row_group_size=100)
    with pytest.raises(ValueError, match="d.parquet:row 876: prompt\\[0\\].role"):
        load_rows(path)


def test_next_rows_lazy_equals_list_and_resumes_exactly(tmp_path):
    rows = mixed_rows(37)
    path = tmp_path / "d.jsonl"
    save_rows(rows, path)
    lazy = load_rows(path)
    s_list, s_lazy = {"epoch": 0, "pos": 0}, {"epoch": 0, "pos": 0}
    for k in [5, 10, 30, 1, 37, 50]:  # crosses several epochs, k > len(rows) too
        assert next_rows(lazy, s_lazy, k, seed=7) == next_rows(rows, s_list, k, seed=7)
        assert s_lazy == s_list
    # resume: a fresh load and a copy of data_state continue the same order
    saved = dict(s_lazy)
    want = next_rows(lazy, s_lazy, 20, seed=7)
    assert next_rows(load_rows(path), saved, 20, seed=7) == want and saved == s_lazy


def reference_next_rows(rows, data_state, k, seed):
    """next_rows as checkpoints saved before the kept order were drawn: one reshuffle a call."""
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


def test_next_rows_shuffles_once_an_epoch_in_the_old_order(monkeypatch):
    shuffles = []
    real = random.Random.shuffle
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: shuffles.append(len(x)) or real(self, x))
    rows = list(range(1000))
    new, old = {"epoch": 2, "pos": 10}, {"epoch": 2, "pos": 10}  # a resumed run's state
    for k in [64] * 20 + [7, 1000, 3]:  # 20 steps of 64 cross one epoch; k == len(rows) too
        assert next_rows(rows, new, k, seed=5) == reference_next_rows(rows, old, k, seed=5)
        assert new == old
    assert old["epoch"] == 4
    # the reference shuffled every call (23+); the kept order once per epoch it touched (2, 3, 4)
    assert len(shuffles) > 23 + 3
    shuffles.clear()
    for _ in range(10):
        next_rows(rows, new, 64, seed=5)
    assert len(shuffles) <= 1  # epoch 4 is already shuffled; 10 x 64 rows may start epoch 5
    next_rows(list(range(999)), {"epoch": 0, "pos": 0}, 1, seed=5)  # another length: its own order
    assert shuffles[-1] == 999


def test_load_check_names_file_and_line_or_row(tmp_path):
    # check(row, where) runs in the load pass: what envs.load_splits hangs its per-env rules on
    seen = []

    def check(row, where):
        seen.append(where)
        if row["extra_info"]["index"] == 4:
            raise ValueError(f"{where}: index 4 refused")

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(small_row(i)) + "\n" + ("\n" if i == 1 else "") for i in range(6)))
    with pytest.raises(ValueError, match=r"d.jsonl:line 6: index 4 refused"):  # a blank line 3
        load_rows(path, check)
    assert seen == [f"{path}:line {n}" for n in (1, 2, 4, 5, 6)]
    save_rows([small_row(i) for i in range(6)], tmp_path / "d.parquet", row_group_size=4)
    with pytest.raises(ValueError, match=r"d.parquet:row 4: index 4 refused"):
        load_rows(tmp_path / "d.parquet", check)
    assert len(load_rows(path)) == 6  # no check: the same file loads


@pytest.mark.parametrize("text", ["1" * 5000, "[" * 100_000])
def test_json_past_pythons_limits_names_the_line(tmp_path, text):
    # a 5000-digit int (int conversion limit) or deep nesting (RecursionError): bad JSON at
    # file:line, not an unnamed ValueError / RecursionError
    row = json.dumps(small_row(0))
    path = tmp_path / "d.jsonl"
    path.write_text(row + "\n" + row.replace('"index": 0', f'"index": {text}') + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:line 2: bad JSON"):
        load_rows(path)


def test_oracle_calls_checked_at_load_named_and_dropped(tmp_path, capsys):
    # extra_info.oracle_calls that --rescue cannot use (it crashed train.py the first time such a row's
    # group was all wrong): each is named file:line at load, once, and dropped; the row itself loads,
    # keeps the rest of its extra_info and trains (support/rows.py: why not refuse it)
    from support.rows import MAX_ORACLE_CALLS, MAX_ORACLE_CHARS, oracle_calls_error
    call = {"name": "t", "arguments": {"x": 1}}
    bad = {"abc": "must be a list", "7": "must be a list", '["a", "b"]': r"\[0\] must be an object",
           '{"name": "t", "arguments": {}}': "must be a list", '[{"name": "t"}]': r"\[0\] has no arguments",
           '[{"name": "t", "arguments": ["x"]}]': r"\[0\].arguments must be an object, got list",
           '[{"name": "t", "arguments": "x"}]': r"\[0\].arguments must be an object, got str",
           '[{"name": 5, "arguments": {}}]': r"\[0\].name must be a non-empty string, got 5",
           '[{"name": "", "arguments": {}}]': r"\[0\].name must be a non-empty string",
           json.dumps([call] * 10_000): "holds 10000 calls, more than 16",  # a 341 KB plan
           json.dumps([call] * (MAX_ORACLE_CALLS + 1)): "holds 17 calls",
           json.dumps([{"name": "t", "arguments": {"q": "x" * MAX_ORACLE_CHARS}}]): r"is 4\d\d\d characters of JSON, more than 4096"}
    rows = [small_row(0)]
    rows[0]["extra_info"]["oracle_calls"] = [call] * MAX_ORACLE_CALLS  # the most a row may carry
    for i, text in enumerate(bad, 1):
        r = small_row(i)
        r["extra_info"]["oracle_calls"] = "abc" if text == "abc" else json.loads(text)
        rows.append(r)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_rows(path)
    out = capsys.readouterr().out.splitlines()
    for n, why in enumerate(bad.values(), 2):
        assert re.search(rf"^WARNING: .*d.jsonl:line {n}: extra_info.oracle_calls {why}.*: dropped, the row trains", out[n - 2]), (n, out[n - 2])
    assert "unusable extra_info.oracle_calls dropped from 12 rows (12 named above)" in out[-1] and len(out) == 13
    assert len(loaded) == 13 and loaded[0] == rows[0]  # 16 calls: kept
    assert [r["extra_info"] for r in loaded[1:]] == [{"index": i} for i in range(1, 13)]  # the rest of extra_info stays
    assert loaded[3] == loaded[3] and capsys.readouterr().out == ""  # a read drops it again, without a word
    # many bad rows: the first 20 named, then the count
    path.write_text("".join(json.dumps(rows[1]) + "\n" for _ in range(30)))
    load_rows(path)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 21 and "d.jsonl:line 20:" in out[19] and "dropped from 30 rows (20 named above)" in out[20]
    # the check itself, and with the servers' tool names (options/rescue.usable_calls)
    assert oracle_calls_error([call]) is None and oracle_calls_error([]) is None
    assert oracle_calls_error([call], tools={"t"}) is None
    assert oracle_calls_error([call], tools={"u"}) == "[0].name 't' is no tool the servers offer"


def test_a_key_twice_in_a_row_is_an_error_naming_the_line(tmp_path):
    # json.loads keeps the last of two equal keys: a row with ground_truth twice trained on the second
    row = json.dumps(small_row(0))
    twice = row.replace('"ground_truth": "100"', '"ground_truth": "100", "ground_truth": "7"')
    assert twice != row
    path = tmp_path / "d.jsonl"
    path.write_text(row + "\n" + twice + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:line 2: bad JSON: duplicate key 'ground_truth'"):
        load_rows(path)
    path.write_text(row + "\n" + row.replace('{"data_source"', '{"prompt": [], "data_source"') + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:line 2: bad JSON: duplicate key 'prompt'"):
        load_rows(path)
    # parquet: the JSON text columns (reward_spec here) are read the same way
    import pyarrow.parquet as pq
    save_rows([small_row(0), small_row(1)], tmp_path / "d.parquet")
    table = pq.read_table(tmp_path / "d.parquet")
    spec = table.column("reward_spec").to_pylist()
    spec[1] = spec[1].replace('"ground_truth":', '"ground_truth": "1", "ground_truth":')
    table = table.set_column(table.schema.get_field_index("reward_spec"), table.schema.field("reward_spec"),
                             [spec])
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d.parquet:row 1: column 'reward_spec' is not valid JSON: duplicate key 'ground_truth'"):
        load_rows(tmp_path / "d.parquet")
