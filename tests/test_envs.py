"""Envs, rewards and dataset rows (support/rows.py) (CPU, a few seconds): python -m pytest tests/test_envs.py

The lazy rows' memory test runs this file as a script in a fresh interpreter (one per mode), so the
peak RSS it reports (ru_maxrss) is the load + draws and nothing pytest did before:
    python tests/test_envs.py lazy|list PATH STEPS K -> JSON {"grow_mb", ...}
    NANORL_SLOW=1 python -m pytest -q tests/test_envs.py -k slow   (1M rows, ~1 min)
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

import pytest
from hypothesis import given, settings, strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # import the flat modules at the repo root however pytest is run
import conftest  # noqa: E402
import envs  # noqa: E402
from support.rows import load_rows, next_rows, save_rows, validate_row  # noqa: E402

# 20 problems of the official GSM8K train.jsonl (github.com/openai/grade-school-math, MIT license),
# records unchanged: its lines 1-18, 346 (answer "1,080") and 5716 (answer "-7"), as one JSON list
GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k_sample.json"


def load_script(name):
    """data/<name>.py as a module."""
    return conftest.load_script(f"data/{name}.py", f"data_{name}")


def gsm_row(truth="18"):
    return {"data_source": "t", "prompt": [{"role": "user", "content": "q"}], "env_class": "gsm8k",
            "reward_spec": {"method": "rule", "ground_truth": truth}, "extra_info": {}}

# ---------------------------------------------------------------------------------------------
# golden examples


@pytest.mark.parametrize("text, want", [
    ("18", "18"), ("1,000", "1000"), ("$18", "18"), ("18.0", "18"), ("18.", "18"), ("-3", "-3"),
    ("018", "18"), ("-0", "0"), ("0.50", "0.5"), (".5", "0.5"), ("$1,234.50", "1234.5"),
    ("18 dollars", "18"), ("\\text{18}", "18"), ("\\$18", "18"), ("18%", "18"),
    ("3/4", None), ("5 - 3 = 2", None), ("10^3", None), ("", None), ("x", None),
    ("١٨", None),  # Arabic-Indic digits: ASCII only, by choice
])
def test_normalise_number(text, want):
    assert envs.normalise_number(text) == want


@pytest.mark.parametrize("text, want", [
    ("so #### 18", "18"),
    ("#### 1,000\n", "1000"),
    ("The answer is \\boxed{18}.", "18"),
    ("\\boxed{12} wait, no: \\boxed{14}", "14"),  # last boxed: self-correction wins
    ("#### 12\nactually #### 14", "14"),  # last ####
    ("\\boxed{\\text{18 dollars}}", "18"),  # nested braces
    ("\\boxed{\\$18.00}", "18"),
    ("\\boxed{18}\n#### Step 3", "18"),  # boxed wins over #### (markdown header)
    ("#### Step 1\nso the answer is 7", None),  # markdown header, not an answer
    ("#### $18 dollars", "18"),
    ("#### \\$-3.50", "-3.5"),
    ("#### Step 3: add 2 and 5", None),  # several numbers -> no answer
    ("\\boxed{7} then \\boxed{8", "7"),  # unclosed last box -> last closed one
    ("\\boxed{\\frac{3}{4}}", None),
    ("no answer 18", None),  # a bare number is not a marked answer
    ("\\boxed{}", None),
])
def test_extract_answer(text, want):
    assert envs.extract_answer(text) == want


def test_gsm8k_reward_and_format_reward():
    assert envs.gsm8k_reward("\\boxed{18}", "18")[0] == 1.0
    assert envs.gsm8k_reward("#### $18.00", 18)[0] == 1.0  # numeric ground truth is fine
    assert envs.gsm8k_reward("\\boxed{1080}", "1,080")[0] == 1.0
    assert envs.gsm8k_reward("\\boxed{19}", "18")[0] == 0.0
    r, info = envs.gsm8k_reward("\\boxed{19}", "18", format_reward=0.1)
    assert r == 0.1 and info == {"answer": "19", "ground_truth": "18", "format_ok": True,
                                 "correct": False}
    r, info = envs.gsm8k_reward("it is 18", "18", format_reward=0.1)  # no marked answer
    assert r == 0.0 and info["format_ok"] is False and info["answer"] is None


def test_gsm8k_env_single_turn():
    env = envs.make_env("gsm8k", format_reward=0.0)
    msgs = env.reset(gsm_row("18"))
    assert msgs == [{"role": "user", "content": "q"}]
    obs, r, done, info = env.step("2*9 = \\boxed{18}")
    assert (obs, r, done, info["answer"], info["format_ok"]) == ([], 1.0, True, "18", True)
    with pytest.raises(RuntimeError):
        env.step("again")  # single turn: a second step is a caller bug
    with pytest.raises(ValueError, match="ground_truth"):
        envs.make_env("gsm8k").reset(gsm_row("eighteen"))


def test_multiply_env_single_and_multi_turn():
    row = envs.multiply_rows(1, 3, 2, seed=1)[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert 100 <= a <= 999 and 10 <= b <= 99 and row["reward_spec"]["ground_truth"] == str(a * b)
    assert f"{a} * {b}" in row["prompt"][-1]["content"]
    env = envs.make_env("multiply")
    env.reset(row)
    assert env.step(f"\\boxed{{{a * b}}}")[1:3] == (1.0, True)
    env = envs.make_env("multiply")
    env.reset(row)
    assert env.step(f"#### {a * b}")[1:3] == (0.0, True)  # only \boxed counts here
    # multi-turn: feedback then a retry; the reward comes on the final step only
    env = envs.make_env("multiply", max_turns=3, format_reward=0.5)
    env.reset(row)
    obs, r, done, info = env.step("no idea")
    assert (r, done) == (0.0, False) and "\\boxed{}" in obs[0]["content"]
    obs, r, done, info = env.step(f"\\boxed{{{a * b + 1}}}")
    assert (r, done) == (0.0, False) and "incorrect" in obs[0]["content"]
    obs, r, done, info = env.step(f"\\boxed{{{a * b + 1}}}")
    assert (obs, r, done, info["turns"]) == ([], 0.5, True, 3)  # boxed but wrong, out of turns
    with pytest.raises(RuntimeError):
        env.step("more")


def test_multiply_rows_deterministic():
    assert envs.multiply_rows(5, 2, 2, seed=3) == envs.multiply_rows(5, 2, 2, seed=3)
    assert envs.multiply_rows(5, 2, 2, seed=3) != envs.multiply_rows(5, 2, 2, seed=4)
    for r in envs.multiply_rows(20, 1, 4, seed=0):
        validate_row(r, "gen")
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        assert 1 <= a <= 9 and 1000 <= b <= 9999


def test_make_env_unknown_and_env_class_of():
    with pytest.raises(ValueError, match="unknown env_class 'chess'.*gsm8k, multiply, mcp"):
        envs.make_env("chess")
    with pytest.raises(TypeError):
        envs.make_env("gsm8k", no_such_kwarg=1)
    assert envs.env_class_of({"env_class": "multiply"}, "gsm8k") == "multiply"
    assert envs.env_class_of({}, "gsm8k") == "gsm8k"
    with pytest.raises(ValueError, match="no env_class"):
        envs.env_class_of({}, None)

# ---------------------------------------------------------------------------------------------
# fuzz: rewards are total functions of any text

# text() with the full unicode range (surrogates excluded by hypothesis), plus text built from
# the characters the parsers care about, so boxes, braces and #### actually show up.
_PARSER_ALPHABET = st.sampled_from(["\\boxed{", "{", "}", "####", "#", "\n", "$", ",", ".", "-",
                                    "1", "23", "0", " ", "\\text{", "\u0661", "\U0001F600", "é"])
any_text = st.one_of(st.text(max_size=2000),
                     st.lists(_PARSER_ALPHABET, max_size=300).map("".join))


@settings(max_examples=300, deadline=None)
@given(text=any_text, truth=st.one_of(st.integers(-10**6, 10**6).map(str), st.just("1,080")),
       fmt=st.sampled_from([0.0, 0.1]))
def test_fuzz_rewards_never_raise(text, truth, fmt):
    ans = envs.extract_answer(text)
    assert ans is None or envs.normalise_number(ans) == ans  # canonical form is a fixed point
    envs.normalise_number(text)
    envs.last_boxed(text)
    envs.last_hashes(text)
    for fn in (envs.gsm8k_reward, envs.multiply_reward):
        r, info = fn(text, truth, fmt)
        assert r in (0.0, fmt, 1.0) and isinstance(info["format_ok"], bool)
    for name in ("gsm8k", "multiply"):
        env = envs.make_env(name, format_reward=fmt)
        env.reset(gsm_row(truth))
        obs, r, done, info = env.step(text)
        assert done and obs == [] and r in (0.0, fmt, 1.0)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(-10**30, 10**30), pad=st.text(alphabet="abc \n.", max_size=50))
def test_fuzz_correct_answer_always_scores(n, pad):
    # the exact ground truth, boxed or after ####, with or without thousands commas, scores 1.0
    assert envs.gsm8k_reward(f"{pad}\\boxed{{{n:,}}}", str(n))[0] == 1.0
    assert envs.gsm8k_reward(f"{pad}\n#### {n}", str(n))[0] == 1.0
    assert envs.gsm8k_reward(f"{pad}\\boxed{{{n + 1}}}", str(n))[0] == 0.0


@pytest.mark.parametrize("text", [
    "\\boxed{" * 100_000,  # unclosed boxes: the backward scan must stay linear
    "{" * 200_000 + "\\boxed{1}" + "}" * 10,
    "#" * 200_000,
    "1," * 100_000,  # number regex on a near-miss comma group
    "9" * 200_000,  # a huge number: string compare, no int() limit
    "\\boxed{" + "1" * 100_000 + "}",
    "-" * 100_000 + "." * 100_000,
])
def test_adversarial_long_inputs_are_fast(text):
    t0 = time.perf_counter()
    envs.gsm8k_reward(text, "18", 0.1)
    envs.multiply_reward(text, "18", 0.1)
    assert time.perf_counter() - t0 < 2.0  # linear scans: milliseconds; backtracking: minutes

# ---------------------------------------------------------------------------------------------
# rows: validation errors name file and line; jsonl/parquet round trips


@pytest.mark.parametrize("mutate, msg", [
    (lambda r: r.pop("prompt"), "missing field 'prompt'"),
    (lambda r: r.pop("reward_spec"), "missing field 'reward_spec'"),
    (lambda r: r.pop("data_source"), "missing field 'data_source'"),
    (lambda r: r.update(prompt=[]), "non-empty list"),
    (lambda r: r.update(prompt="hi"), "non-empty list"),
    (lambda r: r["prompt"][0].update(role="robot"), "prompt\\[0\\].role"),
    (lambda r: r["prompt"][0].update(content=3), "prompt\\[0\\].content"),
    (lambda r: r.update(env_class=5), "env_class"),
    (lambda r: r.update(reward_spec={"method": "rule"}), "reward_spec.ground_truth"),
    (lambda r: r.update(reward_spec="18"), "reward_spec must be an object"),
    (lambda r: r.update(extra_info=[1]), "extra_info must be an object"),
])
def test_validation_errors_name_file_and_line(tmp_path, mutate, msg):
    good, bad = gsm_row(), gsm_row()
    mutate(bad)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good, good, bad]) + "\n")
    with pytest.raises(ValueError, match=f"d.jsonl:line 3: .*{msg}"):
        load_rows(str(path))


def test_bad_json_empty_file_and_unknown_suffix(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(gsm_row()) + "\n\n{not json\n")
    with pytest.raises(ValueError, match="d.jsonl:line 3: bad JSON"):
        load_rows(str(path))
    path.write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_rows(str(path))
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_rows(str(tmp_path / "d.csv"))


def test_optional_fields_default():
    row = gsm_row()
    del row["env_class"], row["extra_info"]
    assert validate_row(row, "x")["extra_info"] == {}


def mixed_rows():
    """Rows whose ground_truth and extra_info differ in type, plus a tool-call style message."""
    rows = envs.multiply_rows(3, 2, 2, seed=0) + [gsm_row("1080")]
    rows[1]["reward_spec"]["ground_truth"] = {"tool": "get_time", "args": {"tz": "UTC"}}
    rows[1]["env_class"] = "mcp"
    rows[2]["extra_info"] = {"nested": [1, {"x": None}], "unicode": "é\U0001F600"}
    rows[3]["reward_spec"]["ground_truth"] = 1080
    del rows[3]["env_class"]
    return rows


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_round_trip(tmp_path, suffix):
    rows = mixed_rows()
    path = str(tmp_path / f"d.{suffix}")
    save_rows(rows, path)
    back = load_rows(path)
    rows[3]["env_class"] = None if suffix == "parquet" else rows[3].get("env_class")
    assert [{k: v for k, v in r.items() if v is not None} for r in back] == \
           [{k: v for k, v in r.items() if v is not None} for r in rows]
    # a prompt with extra message keys is stored as JSON text, and still round trips
    rows2 = envs.multiply_rows(2, 2, 2, seed=0)
    rows2[0]["prompt"].append({"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]})
    save_rows(rows2, path)
    assert load_rows(path) == rows2


def test_reads_skyrl_native_parquet(tmp_path):
    # SkyRL writes reward_spec / extra_info as native structs (via datasets/pandas): read as is
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = envs.multiply_rows(4, 2, 2, seed=0)
    path = tmp_path / "skyrl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_rows(str(path)) == rows
    bad = envs.multiply_rows(2, 2, 2, seed=0)
    bad[1]["prompt"] = []
    pq.write_table(pa.Table.from_pylist(bad), path)
    with pytest.raises(ValueError, match="skyrl.parquet:row 1: prompt must be a non-empty"):
        load_rows(str(path))

# ---------------------------------------------------------------------------------------------
# GSM8K conversion on the official files


def gsm8k_src(folder):
    """A folder laid out like the official release (train.jsonl, test.jsonl), both the sample."""
    folder.mkdir()
    lines = "".join(json.dumps(r) + "\n" for r in json.loads(GSM8K_SAMPLE.read_text(encoding="utf-8")))
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(lines, encoding="utf-8")
    return folder


def test_gsm8k_conversion_and_official_solutions_score(tmp_path):
    gsm8k = load_script("gsm8k")
    gsm8k.main(["--src", str(gsm8k_src(tmp_path / "src")), "--out", str(tmp_path), "--format", "parquet"])
    train = load_rows(str(tmp_path / "train.parquet"))
    test = load_rows(str(tmp_path / "test.parquet"))
    assert (len(train), len(test)) == (20, 20)
    truths = [r["reward_spec"]["ground_truth"] for r in test]
    assert (truths[0], truths[-2], truths[-1]) == ("72", "1080", "-7")  # Natalia's clips; commas; a minus
    assert test[0]["prompt"][0] == {"role": "system", "content": envs.GSM8K_SYSTEM_PROMPT}
    assert train[0]["extra_info"]["split"] == "train" and test[5]["extra_info"]["index"] == 5
    for row in test:
        solution = row["extra_info"]["answer"]
        env = envs.make_env("gsm8k")
        env.reset(row)
        assert env.step(solution)[1] == 1.0, solution
        wrong = int(row["reward_spec"]["ground_truth"]) + 1
        perturbed = solution.split("####")[0] + f"#### {wrong}"
        env = envs.make_env("gsm8k")
        env.reset(row)
        assert env.step(perturbed)[1] == 0.0, perturbed


def test_load_splits(tmp_path):
    kw = dict(digits="2,1", fewshot=0, seed=0, eval_every=5)
    # gsm8k: the files written by data/gsm8k.py; eval_limit keeps the first rows of the eval file
    load_script("gsm8k").main(["--src", str(gsm8k_src(tmp_path / "src")), "--out", str(tmp_path)])
    train, test = envs.load_splits("gsm8k", str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl"),
                                   eval_limit=3, **kw)
    assert (len(train), test) == (20, list(load_rows(str(tmp_path / "test.jsonl")))[:3])
    with pytest.raises(FileNotFoundError, match="--eval-data .*nope.jsonl: file not found; make the GSM8K rows"):
        envs.load_splits("gsm8k", str(tmp_path / "train.jsonl"), str(tmp_path / "nope.jsonl"), eval_limit=3, **kw)
    # generated rows: multiply with its worked examples, eval_limit rows to evaluate
    train, test = envs.load_splits("multiply", None, None, eval_limit=7, **{**kw, "fewshot": 1})
    assert (len(train), len(test)) == (10000, 7)
    assert test[0]["prompt"][1] == envs.multiply_shots(1, 2, 1)[0] and test[0]["extra_info"]["split"] == "test"
    with pytest.raises(ValueError, match="--train-data without --eval-data"):
        envs.load_splits("multiply", str(tmp_path / "train.jsonl"), None, eval_limit=7, **kw)
    with pytest.raises(ValueError, match="one worked example"):
        envs.load_splits("mcp", None, None, eval_limit=7, **{**kw, "fewshot": 2})
    bad = gsm_row()
    bad["env_class"] = "chess"
    save_rows([gsm_row(), bad], str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="bad.jsonl:line 2: unknown env_class 'chess'"):
        envs.load_splits("multiply", str(tmp_path / "train.jsonl"), str(tmp_path / "bad.jsonl"), eval_limit=7, **kw)
    # the bundled MCP tasks pass the mcp rule
    train, test = envs.load_splits("mcp", None, None, eval_limit=7, **kw)
    assert len(train) > 1000 and len(test) == 7


def test_gsm8k_conversion_errors(tmp_path):
    gsm8k = load_script("gsm8k")
    ok = {"question": "q?", "answer": "2+2=4\n#### 4"}
    for bad, msg in [({"question": "q?", "answer": "no marker"}, "exactly one '####'"),
                     ({"question": "q?", "answer": "#### four"}, "not one number"),
                     ({"question": "", "answer": "#### 4"}, "'question'")]:
        (tmp_path / "train.jsonl").write_text(json.dumps(ok) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=f"train.jsonl:line 2: .*{msg}"):
            gsm8k.convert_split(str(tmp_path), "train")
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        gsm8k.convert_split(str(tmp_path), "test")


def test_gsm8k_script_missing_source_is_one_line(tmp_path):
    """A --src folder without the files, or a URL that cannot be fetched: one line naming it and where
    the official files are, exit status 1 (was a 12-line FileNotFoundError / 56-line URLError traceback)."""
    import socket
    gsm8k = load_script("gsm8k")
    with pytest.raises(SystemExit) as e:
        gsm8k.main(["--src", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    msg = str(e.value.code)
    assert "\n" not in msg and "nowhere/train.jsonl: not found" in msg and gsm8k.OFFICIAL in msg, msg
    with socket.socket() as s:  # a local port nobody listens on: the fetch fails at once, as offline
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/data"
    with pytest.raises(SystemExit) as e:
        gsm8k.main(["--src", url, "--out", str(tmp_path / "out")])
    msg = str(e.value.code)
    assert "\n" not in msg and f"could not fetch {url}/train.jsonl" in msg and "--src FOLDER" in msg, msg
    assert not (tmp_path / "out").exists()


def test_multiply_script(tmp_path):
    multiply = load_script("multiply")
    multiply.main(["--out", str(tmp_path), "--n-train", "7", "--n-test", "3", "--digits", "3",
                   "--digits-b", "1"])
    train = load_rows(str(tmp_path / "train.jsonl"))
    test = load_rows(str(tmp_path / "test.jsonl"))
    assert (len(train), len(test)) == (7, 3)
    assert all(r["extra_info"]["digits_a"] == 3 and r["extra_info"]["b"] < 10 for r in train)


def test_multiply_shots_work_by_place_value():
    assert envs.worked_product(58, 7) == "58 * 7 = 50 * 7 + 8 * 7 = 350 + 56 = 406"
    assert envs.worked_product(305, 7) == "305 * 7 = 300 * 7 + 5 * 7 = 2100 + 35 = 2135"
    assert envs.worked_product(6, 7) == "6 * 7 = 42"
    one = envs.multiply_shots(2)  # 1 x 1: the fixed examples, as before
    assert one[1]["content"] == "3 * 4 = 12, so the answer is \\boxed{12}."
    shots = envs.multiply_shots(4, 2, 1)
    assert shots == envs.multiply_shots(4, 2, 1)  # deterministic
    for q, a in zip(shots[::2], shots[1::2]):
        x, y = (int(v) for v in q["content"][len("What is "):-1].split(" * "))
        assert 10 <= x <= 99 and 1 <= y <= 9
        assert envs.multiply_reward(a["content"], str(x * y))[0] == 1.0
        terms = a["content"].split(" = ")[2].split(" + ")  # the partial products add up
        assert sum(int(t) for t in terms) == x * y


# ---------------------------------------------------------------------------------------------
# load_splits: every row's ground truth is checked at load, naming file and line


NUMBER_BAD = [None, "", "  ", True, False, {}, [], "six", "1/2", "3 or 4", float("nan"), float("inf"),
              1e20]  # 1e20: str() is "1e+20", two numbers to the rule that scores replies
NUMBER_GOOD = [18, "18", "1,080", "$18.00", -7, 18.5, "0.50", "18 dollars"]
MCP_BAD = [None, "", "   ", True, {}, [], ["a"], float("nan"), {"answer": None}, {"answer": ""},
           {"answer": True}, {"answer": "x", "type": "date"}, {"answer": "abc", "type": "number"},
           {"answer": "1,000", "type": "number"}, {"answer": "1", "check": {"tool": "t", "expect": 1}},
           {"answer": "1", "check": [{"tool": "t"}]}, {"answer": "1", "check": [{"expect": 1}]},
           {"answer": "1", "check": [{"tool": "t", "expect": 1, "arguments": "x"}]},
           {"answer": "1", "typ": "number"}, {"anwser": "1"}]
MCP_GOOD = ["Paris", 5, 2.5, "0", {"answer": "Paris"}, {"answer": 3, "type": "number"},
            {"answer": "56.13", "type": "number",
             "check": [{"tool": "kb_get", "arguments": {"key": "k"}, "expect": 56.13, "path": ["v", 0]}]},
            {"answer": "yes", "type": "text", "check": []}]


@pytest.mark.parametrize("env, gt", [(e, gt) for e in ("gsm8k", "multiply") for gt in NUMBER_BAD]
                         + [("mcp", gt) for gt in MCP_BAD])
def test_bad_ground_truth_fails_at_load_naming_file_and_line(tmp_path, env, gt):
    # null, "", true, {} and "six" used to load: a 1.0 for "<answer>None</answer>", a crash at
    # reset hours into a run, or an error after the model loaded, with no file or line
    good = gsm_row("Paris" if env == "mcp" else "18")
    good["env_class"] = env
    bad = {**good, "reward_spec": {"method": "rule", "ground_truth": gt}}
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, good, bad, good]))
    kw = dict(digits=2, fewshot=0, seed=0, eval_limit=2, eval_every=5)
    with pytest.raises(ValueError, match="d.jsonl:line 3: reward_spec.ground_truth") as e:
        envs.load_splits(env, str(path), str(path), **kw)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300 + len(str(path))  # one line
    save_rows([good, bad], str(tmp_path / "d.parquet"))
    with pytest.raises(ValueError, match="d.parquet:row 1: reward_spec.ground_truth"):
        envs.load_splits(env, str(tmp_path / "d.parquet"), str(path), **kw)
    # a row without env_class gets --env's rule
    del bad["env_class"], good["env_class"]
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=f"d.jsonl:line 2: reward_spec.ground_truth.*{env}"):
        envs.load_splits(env, str(path), str(path), **kw)


@pytest.mark.parametrize("env, gt", [(e, gt) for e in ("gsm8k", "multiply") for gt in NUMBER_GOOD]
                         + [("mcp", gt) for gt in MCP_GOOD])
def test_good_ground_truth_loads(tmp_path, env, gt):
    row = {**gsm_row(gt), "env_class": env}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    train, test = envs.load_splits(env, str(path), str(path), digits=2, fewshot=0, seed=0, eval_limit=1,
                                   eval_every=5)
    assert list(train) == list(test) == [row]
    assert envs.ground_truth_error(env, gt) is None


def test_number_ground_truth_rule_is_the_scoring_rule():
    # what loads is what the env scores: a correct boxed reply gets 1.0, through reset's own check
    for gt in NUMBER_GOOD:
        for name in ("gsm8k", "multiply"):
            env = envs.make_env(name)
            env.reset({**gsm_row(gt), "env_class": name})
            truth = envs.normalise_number(str(gt))
            assert env.step(f"so \\boxed{{{truth}}}")[1] == 1.0, (name, gt)
    with pytest.raises(ValueError, match="multiply: reward_spec.ground_truth must be one number"):
        envs.make_env("multiply").reset(gsm_row("six"))


def test_mcp_config_without_train_data_is_an_error(tmp_path):
    # --mcp-config with no rows of the user's own used to train on the bundled tasks, whose tools
    # the user's servers do not have: every reward 0
    kw = dict(digits=2, fewshot=0, seed=0, eval_limit=2, eval_every=5)
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({**gsm_row("Paris"), "env_class": "mcp"}) + "\n")
    want = ("--mcp-config names your own servers: pass your rows with --train-data \\(and --eval-data or "
            "--eval-every 0\\); the bundled tasks need the bundled server")
    for train_data, eval_data in [(None, None), (None, str(mine))]:
        for env in ("mcp", "multiply"):
            with pytest.raises(ValueError, match=want):
                envs.load_splits(env, train_data, eval_data, mcp_config="servers.json", **kw)
    train, test = envs.load_splits("mcp", str(mine), str(mine), mcp_config="servers.json", **kw)
    assert len(train) == len(test) == 1
    train, _ = envs.load_splits("mcp", str(mine), None, mcp_config="servers.json", **{**kw, "eval_every": 0})
    assert len(train) == 1
    assert len(envs.load_splits("mcp", None, None, **kw)[0]) > 1000  # no config: the bundled server and tasks


def test_eval_data_without_train_data(tmp_path, capsys):
    # `--env mcp --eval-data F` trained silently on the bundled tasks while scoring
    # the user's rows. Like --mcp-config without --train-data, it is an error naming both flags.
    kw = dict(digits=1, fewshot=0, seed=0, eval_limit=2, eval_every=5)
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({**gsm_row("Paris"), "env_class": "mcp"}) + "\n")
    with pytest.raises(ValueError, match=r"--eval-data without --train-data.*bundled.*--train-data FILE"):
        envs.load_splits("mcp", None, str(mine), **kw)
    train, test = envs.load_splits("mcp", str(mine), str(mine), **kw)  # both given: the user's rows
    assert len(train) == len(test) == 1
    # multiply's generated rows are the task itself (--digits): allowed, and said in one line
    mul = tmp_path / "mul.jsonl"
    mul.write_text(json.dumps({**gsm_row("6"), "env_class": "multiply"}) + "\n")
    train, test = envs.load_splits("multiply", None, str(mul), **kw)
    assert len(train) == 10000 and len(test) == 1
    assert "--eval-data without --train-data: training on the generated multiply rows" in capsys.readouterr().out


def test_missing_train_data_is_named_first(tmp_path):
    # --train-data with a missing file first complained about --eval-data
    kw = dict(digits=1, fewshot=0, seed=0, eval_limit=2, eval_every=5)
    nope = str(tmp_path / "nope.jsonl")
    for env in ("multiply", "mcp", "gsm8k"):
        for eval_data in (None, str(tmp_path / "alsonope.jsonl")):
            with pytest.raises(FileNotFoundError, match=r"^--train-data .*nope\.jsonl: file not found"):
                envs.load_splits(env, nope, eval_data, **kw)


# ---- lazy dataset rows (support/rows.Rows): flat memory at scale (200k rows, ~15 s on 2 cores), the
# same rows as an eager read, the same file:line errors, and next_rows' exact order over a lazy
# sequence (what a resume relies on). The memory test runs this file as a script (module doc)

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


def varied_rows(n):
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
    rows = varied_rows(300)
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
    rows = varied_rows(1000)
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
    rows = varied_rows(37)
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
    # the check itself, and with the servers' tool names (options/plans.usable_calls)
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
