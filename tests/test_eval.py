"""Tests for eval.py: the pass@k estimator and standard errors by hand and by hypothesis, and
eval.main end to end with the tiny random model of conftest.py: the same greedy pass@1 as train.py's
in-loop eval on the same model and rows, a train.py run folder, a LoRA adapter folder, the bundled
MCP server, bad input. The tiny model never writes a boxed product, so multiply's env is swapped for
a toy one whose verdict is a deterministic function of the row and the sampled bytes (passes and fails mix).
CPU, ~20 s. The GPU test (vLLM, one engine for two models) skips without CUDA, vLLM or $SMOLLM2_DIR.

Run: python -m pytest -q tests/test_eval.py
"""
import json
import math
import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import envs
import eval as ev
import support.logs
from options import lora
import train
from conftest import make_tiny_model
from rollout import Episode


class ByteSumEnv(envs.Env):
    """Single turn; reward = ((sum of the reply's bytes + the row's product) mod 5) / 4, a pass when
    it is >= 0.5 (the row's product in it: a greedy tiny model writes the same bytes to every row)."""

    def __init__(self, **kwargs):
        self.truth = 0

    def reset(self, row):
        self.truth = int(row["reward_spec"]["ground_truth"])
        return [dict(m) for m in row["prompt"]]

    def step(self, text):
        r = ((sum(text.encode()) + self.truth) % 5) / 4
        return [], r, True, {"correct": r >= 0.5}


@pytest.fixture
def toy_env(monkeypatch):
    monkeypatch.setattr(envs, "make_env", lambda name, **kw: ByteSumEnv())


def _argv(out_dir, *models, extra=()):
    return [a for m in models for a in ("--model", str(m))] + [
        "--out-dir", str(out_dir), "--limit", "6", "--max-tokens", "6", "--max-context", "512", "--fewshot", "0",
        "--k", "1,2", "--n", "2", "--no-progress", *extra]


def _episode(group, correct, reward=None):
    return Episode(prompt_ids=[1], response_ids=[2], response_mask=[1], logprobs=[0.0],
                   reward=float(correct) if reward is None else reward, finish_reason="stop", group=group,
                   info={"correct": correct})

# ---- the formulas


def test_pass_at_k_by_hand():
    # n = 5 samples, c = 2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10; pass@4: only 3 wrong ones, every draw of 4 holds a right one
    assert ev.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert ev.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert ev.pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert ev.pass_at_k(5, 2, 4) == 1.0 and ev.pass_at_k(5, 0, 5) == 0.0
    assert ev.pass_at_k(200, 1, 100) == pytest.approx(0.5)  # 1 - C(199,100)/C(200,100) = 1 - 100/200
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 1, 5)


@given(st.integers(1, 60), st.data())
def test_pass_at_k_properties(n, data):
    c = data.draw(st.integers(0, n))
    values = [ev.pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))  # more tries never hurt
    assert values[0] == pytest.approx(c / n)  # pass@1 is the share of correct samples
    assert values[-1] == (1.0 if c else 0.0)  # all n samples: right iff one of them is
    if c < n:  # one more correct sample never lowers it
        assert all(ev.pass_at_k(n, c + 1, k) >= v - 1e-12 for k, v in enumerate(values, 1))


@given(st.lists(st.floats(0, 1), min_size=2, max_size=40))
def test_standard_error_properties(xs):
    se = ev.standard_error(xs)
    m = sum(xs) / len(xs)
    assert se >= 0 and se == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)))
    assert ev.standard_error([x + 3.0 for x in xs]) == pytest.approx(se, abs=1e-9)  # shift-invariant


def test_score_by_hand():
    # 4 rows, two sources; greedy passes rows 0 and 3; n = 2 samples a row, correct (1,1), (1,0), (0,0), (0,1)
    greedy = [_episode(0, True), _episode(1, False), _episode(2, False, 0.5), _episode(3, True)]
    sampled = [_episode(g, c) for g, cs in enumerate([(1, 1), (1, 0), (0, 0), (0, 1)]) for c in map(bool, cs)]
    m = ev.score(greedy, sampled, 2, ["a", "a", "b", "b"], [1, 2])
    # greedy: mean 0.5, sd = sqrt(4 * 0.25 / 3), SE = sd / 2 = 0.2887; reward (1 + 0 + 0.5 + 1) / 4
    assert m["greedy_pass@1"] == 0.5 and m["greedy_pass@1_se"] == pytest.approx(0.288675, abs=1e-6)
    assert m["greedy_reward"] == 0.625
    # pass@1 per row 1, 0.5, 0, 0.5 -> 0.5; pass@2 per row 1, 1, 0, 1 -> 0.75, sd = sqrt(0.75 / 3) = 0.5, SE 0.25
    assert m["pass@1"] == 0.5 and m["pass@2"] == 0.75 and m["pass@2_se"] == pytest.approx(0.25)
    assert m["by_source"]["a"] == pytest.approx({"rows": 2, "greedy_pass@1": 0.5, "greedy_pass@1_se": 0.5,
                                                 "greedy_reward": 0.5, "pass@1": 0.75, "pass@1_se": 0.25,
                                                 "pass@2": 1.0, "pass@2_se": 0.0, "sampled_reward": 0.75})
    assert m["by_source"]["b"]["pass@2"] == 0.5 and m["greedy"]["correct"] == 0.5
    assert ev.tally(greedy) == [2, 2.5, 4]  # what train.evaluate sums over ranks

# ---- eval.main


def _train_step0_eval(model_dir, run):
    """train.py's in-loop eval before any update (--steps 0): its metrics.jsonl line for step 0."""
    train.main(["--model", model_dir, "--out-dir", str(run), "--steps", "0", "--eval-every", "1",
                "--eval-limit", "6", "--max-tokens", "6", "--max-context", "512", "--fewshot", "0",
                ])
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def test_in_loop_eval_and_eval_py_agree(tiny_model_dir, tmp_path, toy_env, monkeypatch):
    """train.py's eval_pass1 at step 0 == eval.py's greedy pass@1, same model and rows; the run
    folder (its step-0 checkpoint) and the model folder it started from score the same; and
    train.py's number comes from eval.py's scoring (one code path, not a copy)."""
    run = tmp_path / "run"
    logged = _train_step0_eval(tiny_model_dir, run)
    assert logged["step"] == 0 and 0 < logged["eval_pass1"] < 1  # passes and fails: a real comparison
    out = ev.main(_argv(tmp_path / "eval", run, tiny_model_dir))
    for m in out["models"]:
        assert m["rows"] == 6
        assert m["greedy_pass@1"] == logged["eval_pass1"] and m["greedy_reward"] == logged["eval_reward"]
    assert out["models"][0]["weights"].endswith("step_000000")  # the run folder's latest checkpoint
    assert out["models"][0]["pass@2"] == out["models"][1]["pass@2"]  # same weights, same seed: same samples
    monkeypatch.setattr(Episode, "passed", lambda episode: True)  # one verdict: it changes train.py's number
    assert _train_step0_eval(tiny_model_dir, tmp_path / "run2")["eval_pass1"] == 1.0


def test_two_models_side_by_side_with_a_lora_adapter(tiny_model_dir, tiny_tokenizer, tmp_path, toy_env, capsys):
    model = make_tiny_model(tiny_tokenizer)
    lora.apply_lora(model, 4, 8.0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.normal_(0, 0.5, generator=gen)  # B = 0 would be the base model itself
    lora.save_adapter(model, tmp_path / "adapter", tiny_model_dir)
    out_dir = tmp_path / "eval"
    out = ev.main(_argv(out_dir, tiny_model_dir, tmp_path / "adapter"))
    base, tuned = out["models"]
    assert tuned["adapter"] == str(tmp_path / "adapter") and tuned["weights"] == tiny_model_dir
    assert base["tool_format"] is None and tuned["tool_format"] is None  # no MCP rows: no tool calls to parse
    for m in (base, tuned):
        assert 0 <= m["pass@1"] <= m["pass@2"] <= 1 and m["pass@2_se"] is not None
        assert set(m["by_source"]) == {"synthetic_multiply"} and m["sampled"]["turns"] == 1
    saved = json.loads((out_dir / "eval.json").read_text())
    assert [m["model"] for m in saved["models"]] == [tiny_model_dir, str(tmp_path / "adapter")]
    assert saved["config"]["k"] == [1, 2] and saved["config"]["limit"] == 6
    records = [json.loads(line) for line in open(out_dir / "episodes.jsonl")]
    assert len(records) == 2 * (6 + 4 * 2)  # per model: 6 greedy episodes, the sampled ones of 4 rows
    assert {r["step"] for r in records} == {0, 1} and {r["info"]["sampling"] for r in records} == {"greedy", "T=1"}
    greedy_text = [[r["segments"][0]["text"] for r in records if r["step"] == i and r["info"]["sampling"] == "greedy"]
                   for i in (0, 1)]
    assert greedy_text[0] != greedy_text[1]  # the adapter changed what the model writes
    assert (out_dir / "episodes.html").stat().st_size > 0
    table = capsys.readouterr().out.split("| metric |")[1]
    assert tiny_model_dir in table and str(tmp_path / "adapter") in table
    assert "| greedy pass@1 |" in table and "| pass@2 (T=1, n=2) |" in table and " ± " in table


def test_bundled_mcp_server(tiny_model_dir, tmp_path):  # no capsys: the server's stdio needs real files
    out = ev.main(["--model", tiny_model_dir, "--env", "mcp", "--limit", "2", "--max-turns", "2",
                   "--max-tokens", "8", "--max-context", "8192",  # byte tokens: the tool list alone is ~6k
                   "--k", "1,2", "--no-progress", "--out-dir", str(tmp_path)])
    m = out["models"][0]
    assert m["rows"] == 2 and m["greedy"]["finish_error"] == 0.0
    for key in ("tool_calls", "tool_errors", "turns"):
        assert key in m["greedy"] and key in m["sampled"]
    assert all(s.startswith("nanorl_mcp/") for s in m["by_source"])
    assert "| tool calls / episode (greedy) |" in ev.table(out["models"], [1, 2], 2, 1.0)
    assert m["tool_format"] == "hermes"  # auto: the tiny ChatML template writes <tool_call> JSON
    assert all(0 <= b["greedy_tool_errors"] <= 2 for b in m["by_source"].values())  # --max-turns 2


def test_source_groups_add_shared_prefixes():
    g = ev.source_groups(["seen", "unseen/multi", "unseen/state", "unseen/multi", "seen"])
    assert g == {"seen": [0, 4], "unseen": [1, 2, 3], "unseen/multi": [1, 3], "unseen/state": [2]}
    assert list(ev.source_groups(["x/a", "x/b", "x/a"])) == ["x/a", "x/b"]  # a prefix of every row: no set
    assert list(ev.source_groups(["seen", "unseen/state"])) == ["seen", "unseen/state"]  # of one source: none
    m = ev.score([_episode(0, True), _episode(1, False), _episode(2, True)], [], 1, ["s", "u/a", "u/b"], [1])
    assert m["by_source"]["u"]["rows"] == 2 and m["by_source"]["u"]["greedy_pass@1"] == 0.5


def test_failed_calls_by_source():
    # MCP episodes carry tool_calls and tool_errors: a: 3 and 0 failed calls, b: 1 (all rows: 4/3);
    # a makes 3 calls an episode, b 2; rows without tool use get no row
    greedy = [_episode(0, True), _episode(1, False), _episode(2, False)]
    for e, calls, errors in zip(greedy, (3, 3, 2), (3, 0, 1)):
        e.info.update(tool_calls=calls, tool_errors=errors)
    m = ev.score(greedy, [], 1, ["a", "a", "b"], [1])
    assert m["by_source"]["a"]["greedy_tool_errors"] == 1.5 and m["by_source"]["b"]["greedy_tool_errors"] == 1.0
    assert m["by_source"]["a"]["greedy_tool_calls"] == 3.0 and m["by_source"]["b"]["greedy_tool_calls"] == 2.0
    text = ev.table([{**m, "model": "x"}], [1], 0, 1.0)
    assert "| b: tool errors / episode (greedy) | 1.000 |" in text and "| b: tool calls / episode (greedy) | 2.000 |" in text
    plain = ev.score([_episode(0, True), _episode(1, False)], [], 1, ["a", "b"], [1])
    assert "greedy_tool_errors" not in plain["by_source"]["a"] and "greedy_tool_calls" not in plain["by_source"]["a"]
    assert "tool errors" not in ev.table([{**plain, "model": "x"}], [1], 0, 1.0)


def test_bad_input_fails_before_any_weights_load(tiny_model_dir, tmp_path, monkeypatch, capsys):
    def no_weights(*a, **kw):
        raise AssertionError("weights loaded before the input was checked")
    monkeypatch.setattr(ev, "load_model", no_weights)
    good = envs.multiply_rows(1)[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, "prompt": "oops"}) + "\n")
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    cases = [  # (argv, exception, message)
        (_argv(tmp_path / "o", tiny_model_dir, extra=["--eval-data", str(bad)]), ValueError, r"bad.jsonl:line 2: prompt must be"),
        (_argv(tmp_path / "o", tiny_model_dir, extra=["--eval-data", str(tmp_path / "no.jsonl")]), FileNotFoundError, "no.jsonl"),
        (_argv(tmp_path / "o", tiny_model_dir, tmp_path / "nope"), FileNotFoundError, "no such folder"),
        (_argv(tmp_path / "o", run), FileNotFoundError, "run folder without a complete checkpoint"),
        (_argv(run, tiny_model_dir), FileExistsError, "holds a training run"),
        (_argv(tmp_path / "o", tiny_model_dir, extra=["--mcp-config", str(bad)]), ValueError, "pass your rows with --eval-data"),
    ]
    for argv, exc, msg in cases:
        with pytest.raises(exc, match=msg) as e:
            ev.main(argv)
        assert "\n" not in str(e.value) and not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):
        ev.main(_argv(tmp_path / "o", tiny_model_dir, extra=["--k", "1,4"]))  # k > n
    assert "need 1 <= k <= n" in capsys.readouterr().err


def test_an_incomplete_model_folder_is_one_line(tiny_model_dir, tmp_path):
    """A --model folder holding config.json but no tokenizer or no weights: one line naming the folder and
    what is missing (was transformers' 4-line error asking to install sentencepiece or tiktoken)."""
    import shutil
    from support import sources
    only_config, no_weights = tmp_path / "only_config", tmp_path / "no_weights"
    shutil.copytree(tiny_model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    only_config.mkdir()
    shutil.copy(os.path.join(tiny_model_dir, "config.json"), only_config)
    for folder, missing in [(only_config, "no tokenizer files .* and no weights"), (no_weights, "but no weights")]:
        with pytest.raises(FileNotFoundError, match=f"{folder}.* {missing}") as e:
            ev.main(_argv(tmp_path / "o", folder))
        assert "\n" not in str(e.value) and not (tmp_path / "o").exists()
    assert "no tokenizer" not in str(e.value)  # no_weights: its tokenizer files are there
    assert sources.model_source(tiny_model_dir) == tiny_model_dir

# ---- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not os.environ.get("SMOLLM2_DIR"), reason="needs $SMOLLM2_DIR (SmolLM2-135M-Instruct)")
def test_vllm_eval_smollm2_and_an_adapter(tmp_path):
    """vLLM: SmolLM2, then a LoRA adapter over it with B = 0 (W + 0 = W, so the same model) pushed
    into the same engine by the weight sync (checked there): both columns must agree."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(os.environ["SMOLLM2_DIR"])
    lora.apply_lora(base, 8, 16.0)
    lora.save_adapter(base, tmp_path / "adapter", os.environ["SMOLLM2_DIR"])
    out = ev.main(["--gpu", "h100", "--model", os.environ["SMOLLM2_DIR"], "--model", str(tmp_path / "adapter"),
                   "--env", "multiply", "--limit", "16", "--no-progress", "--out-dir", str(tmp_path / "eval")])
    a, b = out["models"]
    assert a["rows"] == 16 and 0 <= a["greedy_pass@1"] <= 1 and a["pass@1"] <= a["pass@8"]
    assert a["greedy_pass@1"] == b["greedy_pass@1"] and a["greedy"]["response_tokens"] == b["greedy"]["response_tokens"]
    assert (tmp_path / "eval" / "eval.json").is_file() and (tmp_path / "eval" / "episodes.html").is_file()


# ---- one-line errors and the per-source table


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e10"])
def test_tool_timeout_must_be_sane_seconds(value, capsys):
    # 0, nan and inf made every call "time out after 0 s"; 1e10 overflowed asyncio's timer
    with pytest.raises(SystemExit) as e:
        ev.parse_args(["--model", "x", "--tool-timeout", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--tool-timeout" in err and "seconds" in err
    assert ev.parse_args(["--model", "x", "--tool-timeout", "0.5"]).tool_timeout == 0.5


def test_a_server_that_does_not_start_is_one_error_line(tiny_model_dir, tmp_path, capfd):
    # eval.py printed a traceback here, train.py one line: both now say `error: ...` and exit 1
    config = tmp_path / "servers.json"
    config.write_text(json.dumps({"mcpServers": {"broken": {"command": sys.executable, "args": ["-c", "raise SystemExit(3)"]}}}))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"data_source": "t", "prompt": [{"role": "user", "content": "q"}], "env_class": "mcp",
                                "reward_spec": {"method": "rule", "ground_truth": {"answer": "1", "type": "number"}}}) + "\n")
    with pytest.raises(SystemExit) as e:
        ev.cli(_argv(tmp_path / "o", tiny_model_dir, extra=["--env", "mcp", "--mcp-config", str(config),
                                                            "--eval-data", str(rows), "--n", "0", "--k", "1"]))
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "broken" in msg and "\n" not in msg, msg
    assert "Traceback" not in capfd.readouterr().err


def test_table_prints_each_source_row_once():
    # a source that is also a shared prefix (u beside u/a, u/b), two models, sampled pass@k: no label twice
    srcs = ["u/a", "u/b", "u", "v", "u/a"]
    greedy = [_episode(i, i % 2 == 0) for i in range(len(srcs))]
    for e in greedy:
        e.info.update(tool_calls=2, tool_errors=1)
    sampled = [_episode(i, i % 3 == 0) for i in range(len(srcs)) for _ in range(2)]
    models = [{**ev.score(greedy, sampled, 2, srcs, [1, 2]), "model": name} for name in ("a", "b")]
    labels = [line.split("|")[1] for line in ev.table(models, [1, 2], 2, 1.0).splitlines()]
    assert len(labels) == len(set(labels)) and sum(label.startswith(" u: ") for label in labels) == 4


# ---- tool-call formats: the parse rate per family, each model's family


def _mcp_episode(group, fmt, calls, parse_errors):
    e = _episode(group, True)
    e.info.update(tool_calls=calls, parse_errors=parse_errors, tool_errors=0)
    if fmt is not None:
        e.info["tool_format"] = fmt
    return e


def test_parse_rate_per_tool_format():
    # hermes: 3 + 0 calls, 1 + 0 parse errors -> 3/4; qwen3-xml: 1 call, 1 error -> 1/2; all: 4/6.
    # An episode without tool_format counts in the overall rate only
    eps = [_mcp_episode(0, "hermes", 3, 1), _mcp_episode(1, "hermes", 0, 0), _mcp_episode(2, "qwen3-xml", 1, 1),
           _mcp_episode(3, None, 2, 0)]
    m = support.logs.episode_metrics(eps, len(eps), 1)
    assert m["tool_parse_rate"] == pytest.approx(6 / 8)
    assert m["tool_parse_rate/hermes"] == 0.75 and m["tool_parse_rate/qwen3-xml"] == 0.5
    assert sorted(k for k in m if k.startswith("tool_parse_rate/")) == ["tool_parse_rate/hermes", "tool_parse_rate/qwen3-xml"]
    assert all(isinstance(v, (int, float)) for v in m.values())  # TensorBoard and W&B take every one
    none = support.logs.episode_metrics([_mcp_episode(0, "mistral", 0, 0)], 1, 1)  # no call written: no rate
    assert "tool_parse_rate" not in none and "tool_parse_rate/mistral" not in none
    plain = support.logs.episode_metrics([_episode(0, True)], 1, 1)
    assert not any(k.startswith("tool_parse_rate") for k in plain)


def test_table_names_each_models_tool_format():
    models = [{**ev.score([_mcp_episode(0, f, 3, 1)], [], 1, ["s"], [1]), "model": name, "tool_format": f}
              for name, f in (("a", "hermes"), ("b", "hermes"))]
    assert "| tool-call parse rate (greedy, hermes) | 0.750 | 0.750 |" in ev.table(models, [1], 0, 1.0)
    models[1]["tool_format"] = "qwen3-xml"
    assert "| tool-call parse rate (greedy, hermes / qwen3-xml) |" in ev.table(models, [1], 0, 1.0)
    plain = [{**ev.score([_episode(0, True)], [], 1, ["s"], [1]), "model": "x", "tool_format": None}]
    assert "parse rate" not in ev.table(plain, [1], 0, 1.0)


def test_bad_tool_format_is_one_error_line(capsys):
    from mcp_tools import formats
    with pytest.raises(SystemExit) as e:
        ev.parse_args(["--model", "x", "--tool-format", "harmony"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--tool-format harmony" in err and all(name in err for name in formats.FORMATS)
    assert ev.parse_args(["--model", "x"]).tool_format == "auto"
    assert ev.parse_args(["--model", "x", "--tool-format", "mistral"]).tool_format == "mistral"


def test_each_model_gets_its_own_tool_format(tiny_model_dir, tmp_path, monkeypatch):
    """Two models on the bundled server: the tiny one, whose template renders tools, and a copy
    whose template drops them (mcp_tools.formats installs its TOOL_CHAT_TEMPLATE once the pool is
    open). auto resolves per model, from the template the episodes are played with."""
    import shutil
    from mcp_tools import formats
    from mcp_tools.formats import TOOL_CHAT_TEMPLATE
    from transformers import AutoTokenizer
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, plain)
    tok = AutoTokenizer.from_pretrained(plain)
    tok.chat_template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"  # no tools
    tok.save_pretrained(plain)
    seen, envs_made = [], []
    monkeypatch.setattr(formats, "detect", lambda t: seen.append(t) or ("qwen3-xml" if t == TOOL_CHAT_TEMPLATE else "hermes"))
    real = envs.env_for_row
    monkeypatch.setattr(envs, "env_for_row", lambda *a, **kw: envs_made.append(kw.get("tool_format")) or real(*a, **kw))
    out_dir = tmp_path / "eval"
    out = ev.main(["--model", tiny_model_dir, "--model", str(plain), "--env", "mcp", "--limit", "1", "--max-turns", "1",
                   "--max-tokens", "4", "--max-context", "8192", "--k", "1", "--n", "0", "--no-progress",
                   "--out-dir", str(out_dir)])
    assert seen[1] == TOOL_CHAT_TEMPLATE  # detected after the pool installed the tool template
    assert [m["tool_format"] for m in out["models"]] == ["hermes", "qwen3-xml"]
    assert envs_made == ["hermes", "qwen3-xml"]  # one greedy episode per model, played with its family
    saved = json.loads((out_dir / "eval.json").read_text())
    assert [m["tool_format"] for m in saved["models"]] == ["hermes", "qwen3-xml"]
    records = [json.loads(line) for line in open(out_dir / "episodes.jsonl")]  # the viewer names each one's family
    assert [(r["step"], r["info"]["tool_format"]) for r in records] == [(0, "hermes"), (1, "qwen3-xml")]
    # a flag overrides the template: both models parse as mistral
    monkeypatch.setattr(formats, "detect", lambda t: pytest.fail("--tool-format mistral: nothing to detect"))
    envs_made.clear()
    out = ev.main(["--model", tiny_model_dir, "--env", "mcp", "--limit", "1", "--max-turns", "1", "--max-tokens", "4",
                   "--max-context", "8192", "--k", "1", "--n", "0", "--no-progress", "--out-dir", str(tmp_path / "e2"),
                   "--tool-format", "mistral"])
    assert out["models"][0]["tool_format"] == "mistral" and envs_made == ["mistral"]


# ---- recovery: repeated calls, repeats of failed calls, partial credit


def test_repeat_and_credit_metrics_per_episode():
    # 4 MCP episodes: repeats 2, 0, 1, - -> 3/4 an episode; of failed calls 1, 0, 1, - -> 2/4; credit
    # 0.5, 0, 0.25, - -> 0.75/4. The fourth records none of these keys (counted as 0, not a crash)
    eps = [_mcp_episode(g, "hermes", 3, 0) for g in range(4)]
    for e, rep, rep_fail, credit in zip(eps[:3], (2, 0, 1), (1, 0, 1), (0.5, 0.0, 0.25)):
        e.info.update(repeat_calls=rep, repeat_failed=rep_fail, stale_repeats=rep_fail + 1, credit=credit, error_answer=rep_fail)
    m = support.logs.episode_metrics(eps, len(eps), 1)
    assert m["repeat_calls"] == 0.75 and m["repeat_failed"] == 0.5  # 3 / 4 and 2 / 4
    assert m["error_answers"] == 0.5  # wrong answers that speak of an error: 2 of 4
    assert m["stale_repeats"] == 1.25  # (2 + 1 + 2) / 4: the same result again
    assert m["credit"] == pytest.approx(0.75 / 4)
    bare = support.logs.episode_metrics([_mcp_episode(0, "hermes", 1, 0)], 1, 1)  # MCP, counting none of them
    assert "tool_errors" in bare and not any(k.startswith("repeat") or k in ("credit", "error_answers") for k in bare)
    plain = support.logs.episode_metrics([_episode(0, True), _episode(1, False)], 2, 1)  # no tool use at all
    assert not any(k.startswith("repeat") or k == "credit" for k in plain)


def test_run_log_writes_two_samples_a_step_by_default():
    import inspect
    assert support.logs.SAMPLES_PER_STEP == 2
    assert inspect.signature(support.logs.RunLog.step).parameters["samples"].default == support.logs.SAMPLES_PER_STEP


def test_repeated_calls_by_source_and_in_the_table():
    # a: repeats 2 and 0 (of failed calls 1 and 0) -> 1.0 (0.5); b: 1 (1) -> 1.0 (1.0); all: 1.0 (0.667)
    greedy = [_mcp_episode(g, "hermes", 3, 0) for g in range(3)]
    for e, rep, rep_fail in zip(greedy, (2, 0, 1), (1, 0, 1)):
        e.info.update(repeat_calls=rep, repeat_failed=rep_fail, stale_repeats=rep)
    m = ev.score(greedy, [], 1, ["a", "a", "b"], [1])
    assert m["by_source"]["a"]["greedy_stale_repeats"] == 1.0 and m["by_source"]["b"]["greedy_stale_repeats"] == 1.0
    assert m["by_source"]["a"]["greedy_repeat_calls"] == 1.0 and m["by_source"]["a"]["greedy_repeat_failed"] == 0.5
    assert m["by_source"]["b"]["greedy_repeat_calls"] == 1.0 and m["by_source"]["b"]["greedy_repeat_failed"] == 1.0
    assert m["greedy"]["repeat_calls"] == 1.0 and m["greedy"]["repeat_failed"] == pytest.approx(2 / 3)
    text = ev.table([{**m, "model": "x"}], [1], 0, 1.0)
    assert "| repeated calls (of failed ones) / episode (greedy) | 1.000 (0.667) |" in text
    assert "| a: repeated calls (of failed ones) / episode (greedy) | 1.000 (0.500) |" in text
    assert "| b: repeated calls (of failed ones) / episode (greedy) | 1.000 (1.000) |" in text
    json.dumps(m, allow_nan=False)  # eval.json takes it
    plain = ev.score([_episode(0, True), _episode(1, False)], [], 1, ["a", "b"], [1])
    assert "greedy_repeat_calls" not in plain["by_source"]["a"] and "repeat_calls" not in plain["greedy"]
    assert "repeated" not in ev.table([{**plain, "model": "x"}], [1], 0, 1.0)


def test_invented_calls_in_the_step_metrics_by_source_and_in_the_table():
    # a: 2 and 0 calls with an invented number or date -> 1.0; b: 1 -> 1.0; all 3 / 3; a fourth records none
    greedy = [_mcp_episode(g, "hermes", 3, 0) for g in range(4)]
    for e, inv in zip(greedy, (2, 0, 1)):
        e.info.update(invented_calls=inv, error_answer=int(inv > 0))  # and wrong answers that speak of an error
    assert support.logs.episode_metrics(greedy, 4, 1)["invented_calls"] == 0.75
    m = ev.score(greedy[:3], [], 1, ["a", "a", "b"], [1])
    assert m["by_source"]["a"]["greedy_invented_calls"] == 1.0 and m["greedy"]["invented_calls"] == 1.0
    assert m["by_source"]["a"]["greedy_error_answers"] == 0.5 and m["greedy"]["error_answers"] == pytest.approx(2 / 3)
    text = ev.table([{**m, "model": "x"}], [1], 0, 1.0)
    assert "| calls with an invented number or date / episode (greedy) | 1.000 |" in text
    assert "| b: calls with an invented number or date / episode (greedy) | 1.000 |" in text
    assert "| a: wrong answers that speak of an error / episode (greedy) | 0.500 |" in text
    plain = ev.score([_episode(0, True)], [], 1, ["a"], [1])
    assert "invented_calls" not in plain["greedy"] and "invented" not in ev.table([{**plain, "model": "x"}], [1], 0, 1.0)


def test_bfcl_categories_are_printed_beside_the_papers_figures():
    # each BFCL multi-turn category its own line, beside BFCL's Qwen2.5-1.5B-Instruct (another model)
    m = {"model": "m", "by_source": {"bfcl/base": {"greedy_pass@1": 0.05, "rows": 200},
                                     "bfcl/long_context": {"greedy_pass@1": 0.0, "rows": 200}}}
    text = ev.bfcl_table([m])
    assert "| bfcl/base | 5.0 (200 rows) | 4.0 |" in text and "| bfcl/long_context | 0.0 (200 rows) | 1.5 |" in text
    assert "miss_func" not in text and "Qwen2.5-1.5B-Instruct, FC (another model)" in text
    assert ev.BFCL_PAPER == {"bfcl/base": 4.0, "bfcl/miss_func": 1.5, "bfcl/miss_param": 3.0, "bfcl/long_context": 1.5}
    assert ev.bfcl_table([{"model": "m", "by_source": {"nanorl_mcp/arith": {}}}]) == ""
    # a bfcl row's truth is its turns of call strings; anything else fails at load
    row = {"env_class": "bfcl", "reward_spec": {"ground_truth": [["cd(folder='a')"], []]}}
    envs.check_row(row, None, "rows.jsonl:1")
    with pytest.raises(ValueError, match="rows.jsonl:2: reward_spec.ground_truth \\(bfcl\\)"):
        envs.check_row({**row, "reward_spec": {"ground_truth": "42"}}, None, "rows.jsonl:2")
