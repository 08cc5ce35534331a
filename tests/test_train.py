"""Tests for train.py, in-process through main(argv), with the tiny random model of conftest.py,
and for sft.py (its section, last).

The tiny model never writes a boxed product, so the env is swapped for a toy one whose reward is
a deterministic function of the sampled bytes (rewards vary inside a group, advantages are
non-zero, weights move). DAPO's dynamic sampling also runs on 2 processes (gloo, test_dist.py's
helpers). CPU, ~30 s. Run: python -m pytest -q tests/test_train.py
"""
import collections
import json
import math
import os
import random
import re
import signal
import sys

import hypothesis
import pytest
import torch
from hypothesis import strategies as st
from safetensors.torch import load_file

from options import plans, prefix, rescue
import support.logs
import support.viewer
from support import checkpoint
import config
import envs
import grpo
import train
import sft
from conftest import load_script, say_engine
from mcp_tools.config import bundled_config
from mcp_tools.env import MCPEnv
from mcp_tools.pool import MCPPool
from mcp_tools.tasks import mcp_rows
from rollout import Completion, run_episodes


class ByteSumEnv(envs.Env):
    """Single turn; reward = (sum of the reply's bytes mod 5) / 4, 'correct' when it is 1."""

    def __init__(self, **kwargs):
        pass

    def reset(self, row):
        return [dict(m) for m in row["prompt"]]

    def step(self, text):
        r = (sum(text.encode()) % 5) / 4
        return [], r, True, {"correct": r == 1.0}


@pytest.fixture
def toy_env(monkeypatch):
    monkeypatch.setattr(train.envs, "make_env", lambda name, **kw: ByteSumEnv())


def _argv(model_dir, out_dir, *extra):
    return ["--model", model_dir, "--out-dir", str(out_dir), "--steps", "2", "--prompts-per-step", "2",
            "--n", "3", "--max-tokens", "6", "--max-context", "512", "--fewshot", "0", "--micro-batch-size", "2",
            "--eval-limit", "2", "--eval-every", "0", "--lr", "1e-3", *extra]


def _weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def test_two_steps_then_exact_resume(tiny_model_dir, tmp_path, toy_env):
    # uninterrupted: 2 steps, 2 updates per step (mini-batch 3 of 6 episodes, micro-batch 2)
    extra = ("--mini-batch-size", "3")
    a = train.main(_argv(tiny_model_dir, tmp_path / "a", *extra))
    assert a["step"] == 2 and len(a["history"]) == 2
    for h in a["history"]:
        assert math.isfinite(h["loss"]) and h["updates"] == 2 and h["grad_norm"] > 0
    w0, wa = _weights(tiny_model_dir), _weights(a["checkpoint"])
    assert any(not torch.equal(w0[k], wa[k]) for k in w0)  # training moved the weights
    # the checkpoint is a plain HF folder
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(a["checkpoint"])

    # interrupted: 1 step, stop; then resume for step 2
    b1 = train.main(_argv(tiny_model_dir, tmp_path / "b", *extra, "--steps", "1"))
    assert b1["step"] == 1
    b2 = train.main(_argv(tiny_model_dir, tmp_path / "b", *extra, "--resume", str(tmp_path / "b")))
    assert b2["step"] == 2 and [h["step"] for h in b2["history"]] == [2]
    ha, hb = a["history"][1], b2["history"][0]
    for k in ("reward_mean", "loss", "grad_norm", "response_tokens", "clip_frac", "entropy"):
        assert ha[k] == hb[k], k  # bit-identical: same data, sampling RNG, AdamW state
    wb = _weights(b2["checkpoint"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # metrics.jsonl holds steps 1 and 2 of run b (across the resume)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "b" / "metrics.jsonl")]
    assert steps == [1, 2]
    # samples.jsonl: two episodes a step (the default), readable text with reward and finish reason
    samples = [json.loads(line) for line in open(tmp_path / "b" / "samples.jsonl")]
    assert [s["step"] for s in samples] == [1, 1, 2, 2] and [s["group"] for s in samples[:2]] == [0, 1]
    assert all(isinstance(s["response"], str) and s["finish"] in ("stop", "length") for s in samples)
    # episodes.jsonl + episodes.html (viewer.py): whole groups (2 prompts x 3) of both steps, each with the
    # advantage it was trained with: GRPO's advantages sum to 0 over a group
    recs = [json.loads(line) for line in open(tmp_path / "b" / "episodes.jsonl")]
    assert [r["step"] for r in recs] == [1] * 6 + [2] * 6 and (tmp_path / "b" / "episodes.html").stat().st_size > 0
    for step in (1, 2):
        for g in (0, 1):
            adv = [r["advantage"] for r in recs if r["step"] == step and r["group"] == g]
            assert len(adv) == 3 and abs(sum(adv)) < 1e-4


def test_gae_critic_and_moving_reference_resume_exactly(tiny_model_dir, tmp_path, toy_env, capsys):
    # PPO with a critic (--algo gae) and a KL reference moved every 2 steps: 3 steps straight vs
    # 2 steps + resume; the policy, the critic, the reference and the metrics come out bit-identical
    from options import critic
    extra = ("--algo", "gae", "--kl-coef", "0.1", "--ref-update-every", "2", "--mini-batch-size", "3")
    a = train.main(_argv(tiny_model_dir, tmp_path / "a", *extra, "--steps", "3"))
    # the step line shows the critic's seconds (its values and update) beside train's (the policy's phases)
    assert re.search(r"^step 3 \|.* train [\d.]+s \| critic [\d.]+s \|", capsys.readouterr().out, re.M)
    assert all(h["time_critic_s"] > 0 for h in a["history"])
    train.main(_argv(tiny_model_dir, tmp_path / "b", *extra, "--steps", "2"))
    b = train.main(_argv(tiny_model_dir, tmp_path / "b", *extra, "--steps", "3", "--resume", str(tmp_path / "b")))
    for h in a["history"]:
        assert h["vf_loss"] > 0 and h["critic_grad_norm"] > 0 and math.isfinite(h["vf_explained_var"])
    # a fresh critic's zero head: V = 0 before the first update, so it explains none of the returns' variance
    assert a["history"][0]["vf_explained_var"] == 0.0 and a["history"][2]["vf_explained_var"] != 0.0
    ha, hb = a["history"][2], b["history"][0]
    for k in ("reward_mean", "loss", "grad_norm", "kl", "vf_loss", "value_mean", "adv_abs_mean"):
        assert ha[k] == hb[k], k
    for sub in ("", critic.FOLDER, "reference"):
        wa, wb = _weights(os.path.join(a["checkpoint"], sub)), _weights(os.path.join(b["checkpoint"], sub))
        assert all(torch.equal(wa[k], wb[k]) for k in wa), sub
    w0, ref = _weights(tiny_model_dir), _weights(os.path.join(a["checkpoint"], "reference"))
    assert any(not torch.equal(w0[k], ref[k].to(w0[k].dtype)) for k in w0)  # the reference moved
    with pytest.raises(SystemExit):  # LoRA's reference is its frozen base: it cannot move
        train.parse_args(["--model", "x", "--kl-coef", "0.1", "--ref-update-every", "2", "--lora-rank", "8"])


@pytest.mark.parametrize("extra", [
    ("--algo", "dapo"),                                          # clip-higher, dynamic sampling, overlong
    ("--algo", "drgrpo", "--loss", "gspo"),
    ("--algo", "rloo", "--loss", "cispo", "--ppo-epochs", "2"),
    ("--loss", "clip-cov", "--clip-cov", "0.5", "-10", "10"),       # half the tokens out of the gradient
    ("--loss", "kl-cov", "--kl-cov", "0.5", "1", "--mini-batch-size", "3"),  # half the tokens held, 2 updates
    ("--algo", "reinforce++", "--kl-coef", "0.1", "--old-logprobs", "recompute", "--tis-cap", "2"),
])
def test_algorithm_variants_run(tiny_model_dir, tmp_path, toy_env, extra):
    out = train.main(_argv(tiny_model_dir, tmp_path, "--steps", "1", *extra))
    h = out["history"][0]
    assert math.isfinite(h["loss"]) and h["updates"] >= 1
    if "clip-cov" in extra:  # tokens were taken out: the toy env's step has groups with mixed rewards
        assert 0 < h["cov_clip_frac"] <= 0.5 + 1e-6
    if "kl-cov" in extra:
        assert 0 < h["kl_cov_frac"] <= 0.5 + 1e-6 and h["updates"] == 2
    if "--kl-coef" in extra:
        assert h["kl"] >= 0 and h["logprob_mismatch"] < 1e-4  # HF engine shares the model
        assert 0 < h["tis_mean"] <= 2


def test_the_step_line_shows_the_critics_seconds():
    # --algo gae: the critic's values and update are timed as phase "critic" (options/critic.py), outside
    # time_train_s; on the CPU about half the step, so the step line shows them
    line = support.logs.console_line(4, {"time_rollout_s": 2.0, "time_train_s": 1.0, "time_critic_s": 0.96})
    assert line == "step 4 | gen 2.0s | train 1.0s | critic 1.0s"
    assert "critic" not in support.logs.console_line(4, {"time_train_s": 1.0})  # no critic, no field


def test_kl_cov_needs_several_updates_a_step():
    with pytest.raises(SystemExit):  # one on-policy update: its term and gradient would be 0
        train.parse_args(["--model", "x", "--loss", "kl-cov"])
    args = train.parse_args(["--model", "x", "--loss", "kl-cov", "--ppo-epochs", "2"])
    assert args.kl_cov == [2e-4, 1.0] and args.old_logprobs != "detach"
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "x", "--loss", "kl-cov", "--ppo-epochs", "2", "--kl-cov", "0.1", "-1"])


def test_ppo_dual_clip_stops_a_negative_advantage_tokens_loss():
    # the first token's ratio is e^15 (its probability rose from e^-15 within the step), advantage -1
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old, adv, mask = torch.tensor([[-15.0, -1.0]]), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2)
    loss, st = train.policy_loss(train.parse_args(["--model", "x"]), logp, old, adv, mask)
    loss.sum().backward()
    assert config.DUAL_CLIP == 3.0 and loss.tolist()[0] == pytest.approx([3.0, 1.0])  # not e^15 = 3.3e6
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 1.0]) and st["dual_clip_frac"].item() == pytest.approx(0.5)


def test_eval_plot_and_ctrl_c(tiny_model_dir, tmp_path, toy_env, monkeypatch):
    # Ctrl-C during step 1's rollout: the step finishes, a checkpoint is saved, main returns
    real_collect = train.collect

    def collect_then_interrupt(*a, **kw):
        out = real_collect(*a, **kw)
        os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(train, "collect", collect_then_interrupt)
    argv = _argv(tiny_model_dir, tmp_path, "--steps", "5", "--eval-every", "1")
    before = signal.getsignal(signal.SIGINT)
    out = train.main(argv)
    assert out["step"] == 1 and out["checkpoint"].endswith("step_000001")
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [0, 1] and all("eval_pass1" in m for m in lines)
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert signal.getsignal(signal.SIGINT) is before  # our handler is removed again


def test_val_set_keeps_the_policy_at_its_best_score(tiny_model_dir, tmp_path, toy_env, monkeypatch):
    # --eval-data val=FILE: OUT/best is the policy at its best eval_pass1/val (the last step to reach it, step
    # 0 being the base), with best.json; a Ctrl-C'd run evaluates its last step, which can win
    from transformers import AutoModelForCausalLM
    scores, seen = [], []

    def scripted(run, eval_rows):  # the val score each eval reads, and the weights it was read on
        seen.append({k: v.detach().clone() for k, v in train.unwrap(run.model).state_dict().items()})
        s = scores[len(seen) - 1]
        return {"eval_time_s": 0.0, "eval_pass1": s, "eval_pass1/val": s}
    monkeypatch.setattr(train, "evaluate", scripted)
    real_collect = train.collect

    def collect(run, rows, state):
        out = real_collect(run, rows, state)
        if state["step"] == 2:  # during step 3
            os.kill(os.getpid(), signal.SIGINT)
        return out
    monkeypatch.setattr(train, "collect", collect)
    scores[:] = [0.25, 0.75, 0.5]  # steps 0, 2 and 3 (the Ctrl-C): step 2 is the best
    out = train.main(_argv(tiny_model_dir, tmp_path / "a", "--steps", "10", "--eval-every", "2"))
    assert out["step"] == 3 and [m["step"] for m in map(json.loads, open(tmp_path / "a" / "metrics.jsonl"))
                                 if "eval_pass1" in m] == [0, 2, 3]
    best = tmp_path / "a" / "best"
    assert json.loads((best / "best.json").read_text()) == {"step": 2, "eval_pass1/val": 0.75}
    wb, final = _weights(best), _weights(out["checkpoint"])
    assert all(torch.equal(wb[k], seen[1][k]) for k in wb) and any(not torch.equal(wb[k], final[k]) for k in wb)
    AutoModelForCausalLM.from_pretrained(best)
    assert not list((tmp_path / "a").glob(".*-best-*"))  # no half-written folder left beside it

    seen.clear()
    monkeypatch.setattr(train, "collect", real_collect)
    scores[:] = [0.5, 0.25, 0.5, 0.25]  # a tie with the base: the later step, trained longer, is kept
    train.main(_argv(tiny_model_dir, tmp_path / "b", "--steps", "3", "--eval-every", "1"))
    assert json.loads((tmp_path / "b" / "best" / "best.json").read_text())["step"] == 2
    w0, wb = _weights(tiny_model_dir), _weights(tmp_path / "b" / "best")
    assert all(torch.equal(wb[k], seen[2][k]) for k in wb) and any(not torch.equal(w0[k], wb[k]) for k in w0)

    seen.clear()
    scores[:] = [0.5, 0.25, 0.25, 0.25]  # never up to the base: best is step 0, the base's weights
    train.main(_argv(tiny_model_dir, tmp_path / "c", "--steps", "3", "--eval-every", "1"))
    assert json.loads((tmp_path / "c" / "best" / "best.json").read_text())["step"] == 0
    assert all(torch.equal(w0[k], v) for k, v in _weights(tmp_path / "c" / "best").items())


def test_eval_sets_scored_apart(tiny_model_dir, tmp_path, toy_env):
    # several --eval-data sets: each scored apart (eval_pass1/NAME), and eval_pass1 over all of them
    from support.rows import save_rows
    train_rows, _ = train.envs.load_splits("multiply", None, None, digits="1", fewshot=0, seed=0, eval_limit=1,
                                           eval_every=1)
    save_rows(train_rows[:20], str(tmp_path / "a.jsonl"))
    save_rows(train_rows[20:40], str(tmp_path / "b.jsonl"))
    out = train.main(_argv(tiny_model_dir, tmp_path / "run", "--steps", "1", "--eval-every", "1", "--eval-limit", "3",
                           "--train-data", str(tmp_path / "a.jsonl"), "--eval-data", str(tmp_path / "a.jsonl"),
                           "--eval-data", f"other={tmp_path / 'b.jsonl'}"))
    assert out["step"] == 1
    for m in (json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")):
        assert m["eval_pass1"] == pytest.approx((m["eval_pass1/a"] + m["eval_pass1/other"]) / 2)  # 3 rows each
        assert m["eval_reward"] == pytest.approx((m["eval_reward/a"] + m["eval_reward/other"]) / 2)
    # one set, named: scored under its name, so val=FILE alone keeps OUT/best (keep_best reads eval_pass1/val)
    train.main(_argv(tiny_model_dir, tmp_path / "val", "--steps", "1", "--eval-every", "1", "--eval-limit", "3",
                     "--train-data", str(tmp_path / "a.jsonl"), "--eval-data", f"val={tmp_path / 'b.jsonl'}"))
    for m in (json.loads(line) for line in open(tmp_path / "val" / "metrics.jsonl")):
        assert m["eval_pass1/val"] == m["eval_pass1"]
    assert json.loads((tmp_path / "val" / "best" / "best.json").read_text())["step"] in (0, 1)
    with pytest.raises(ValueError, match="two sets named 'a'"):
        train.main(_argv(tiny_model_dir, tmp_path / "dup", "--train-data", str(tmp_path / "a.jsonl"),
                         "--eval-data", str(tmp_path / "a.jsonl"), "--eval-data", f"a={tmp_path / 'b.jsonl'}"))


def test_shared_prefix_trains_the_same(tiny_model_dir, tmp_path, toy_env, monkeypatch):
    # --shared-prefix: one packed forward per micro-batch of a group (options/prefix.py), the same update
    packed = []
    real = prefix.packed_logprobs
    monkeypatch.setattr(prefix, "packed_logprobs", lambda *a, **kw: packed.append(1) or real(*a, **kw))
    extra = ("--steps", "1", "--n", "4", "--micro-batch-size", "4", "--kl-coef", "0.01")  # KL: every row trains
    a = train.main(_argv(tiny_model_dir, tmp_path / "a", *extra, "--no-shared-prefix"))["history"][0]
    assert not packed
    b = train.main(_argv(tiny_model_dir, tmp_path / "b", *extra))["history"][0]  # on by default
    assert packed  # the packed path ran (the prompts share well over prefix.MIN_SHARED tokens)
    for key in ("loss", "grad_norm", "kl", "entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    # a model whose attention would ignore the packed mask: off once, at start, for every forward
    packed.clear()
    monkeypatch.setattr(prefix, "packable", lambda model: False)
    c = train.main(_argv(tiny_model_dir, tmp_path / "c", *extra))["history"][0]
    assert not packed and c["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


def test_nan_loss_skips_then_stops(tiny_model_dir, tmp_path, toy_env, monkeypatch):
    real = train.grpo.ppo_clip_loss

    def nan_loss(*a, **kw):
        loss, st = real(*a, **kw)
        return loss * float("nan"), st

    monkeypatch.setattr(train.grpo, "ppo_clip_loss", nan_loss)
    monkeypatch.setattr(train, "MAX_BAD_UPDATES", 5)
    out = train.main(_argv(tiny_model_dir, tmp_path / "a"))
    assert out["history"][-1]["skipped_updates"] == 2
    w0, w1 = _weights(tiny_model_dir), _weights(out["checkpoint"])
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # skipped updates leave the weights alone
    with pytest.raises(RuntimeError, match="non-finite updates in a row"):
        monkeypatch.setattr(train, "MAX_BAD_UPDATES", 2)
        train.main(_argv(tiny_model_dir, tmp_path / "b", "--steps", "3"))


def test_checkpoint_crash_leaves_previous_intact(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    checkpoint.save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, {"x": 1}, {}, keep=2)

    def crash(*a, **kw):  # what torch.save raises on a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9773273152 vs 9773273052")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(OSError, match=r"writing checkpoint .*step_000002 failed: .*unexpected pos.* GiB free"):
        checkpoint.save_checkpoint(tmp_path, 2, tiny_model, tiny_tokenizer, {"x": 2}, {}, keep=2)
    monkeypatch.undo()
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))  # the half-written folder is gone, not left holding the disk
    assert checkpoint.find_checkpoint(tmp_path).name == "step_000001"
    assert torch.load(checkpoint.find_checkpoint(tmp_path) / "trainer_state.pt") == {"x": 1}
    # keep=2 prunes the oldest once a third lands
    for s in (2, 3):
        checkpoint.save_checkpoint(tmp_path, s, tiny_model, tiny_tokenizer, {"x": s}, {}, keep=2)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_000002", "step_000003"]
    assert checkpoint.find_checkpoint(tmp_path).name == "step_000003"


def test_a_final_checkpoint_that_does_not_fit_keeps_the_trained_policy(tiny_model_dir, tmp_path, toy_env, monkeypatch):
    # the disk fills at the run's one checkpoint (--save-every 0: the end): the error says so and where the policy
    # alone went, and OUT/policy holds the trained weights (not the base's), ready for from_pretrained
    from transformers import AutoModelForCausalLM

    def full(obj, f, *a, **kw):  # what torch.save raises on a full disk, for the trainer state only
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9509031360 vs 9509031260")
    monkeypatch.setattr(checkpoint.torch, "save", full)
    out = tmp_path / "run"
    with pytest.raises(OSError, match=r"writing checkpoint .*step_000002 failed: .*GiB free.*the policy alone at step 2 "
                                      r"is in .*policy \(it loads; without the optimizer state it does not resume\)"):
        train.main(_argv(tiny_model_dir, out))
    assert not (out / "ckpt" / "step_000002").exists() and not list((out / "ckpt").glob(".tmp-*"))
    assert json.loads((out / "policy" / "step.json").read_text()) == {"step": 2}
    base, kept = _weights(tiny_model_dir), _weights(out / "policy")
    assert base.keys() == kept.keys() and not all(torch.equal(base[k], kept[k]) for k in base)  # trained (lr 1e-3)
    AutoModelForCausalLM.from_pretrained(out / "policy")  # a model folder, tokenizer beside it
    assert (out / "policy" / "tokenizer_config.json").exists()


def test_bad_inputs(tiny_model_dir, tmp_path, capsys, monkeypatch):
    with pytest.raises(FileNotFoundError, match="--train-data .*nope.jsonl: file not found"):
        train.main(_argv(tiny_model_dir, tmp_path, "--train-data", str(tmp_path / "nope.jsonl")))
    bad = tmp_path / "bad.jsonl"
    good = envs.multiply_rows(1)[0]
    bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, "prompt": "oops"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:line 2: prompt must be"):
        train.main(_argv(tiny_model_dir, tmp_path, "--train-data", str(bad)))
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({**good, "env_class": "chess"}) + "\n")
    with pytest.raises(ValueError, match="unknown env_class 'chess'"):
        train.main(_argv(tiny_model_dir, tmp_path, "--train-data", str(odd)))
    for flag, value in (("--env", "chess"), ("--algo", "ppo2"), ("--loss", "dpo")):
        with pytest.raises(SystemExit):
            train.main(_argv(tiny_model_dir, tmp_path, flag, value))
        assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(_argv(tiny_model_dir, tmp_path, "--tis-cap", "2", "--old-logprobs", "rollout"))  # needs recompute
    monkeypatch.chdir(tmp_path)  # no data/out/gsm8k here
    with pytest.raises(FileNotFoundError, match="python data/gsm8k.py"):
        train.main(_argv(tiny_model_dir, tmp_path, "--env", "gsm8k"))


def test_mcp_env_smoke(tiny_model_dir, tmp_path):
    # the bundled MCP server: pool starts, tool template installed, episodes run, pool closes
    out = train.main(_argv(tiny_model_dir, tmp_path, "--env", "mcp", "--steps", "1", "--max-turns", "2",
                                 "--max-context", "8192"))  # byte tokens: the tool list alone is ~6k
    h = out["history"][0]
    assert h["episodes"] == 6 and h["finish_error"] == 0.0 and h["response_tokens"] > 0


@pytest.mark.parametrize("told", ["", ",told=1"])
def test_mcp_probe_plays_a_listing_tool_of_the_bundled_server(tiny_model_dir, tmp_path, told):
    # rows of a question and an answer; the tiny random policy calls no tool, so each group is all wrong and
    # probe=1 plays a call the bundled server runs (db_tables, list_categories or cart_view), then the policy
    # (told=1: under the answer hint)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"data_source": "t", "env_class": "mcp", "prompt": [
        {"role": "user", "content": f"How many inspections scored above {80 + i} in the records?"}],
        "reward_spec": {"method": "rule", "ground_truth": str(7 + i)}}) + "\n" for i in range(2)))
    out = train.main(_argv(tiny_model_dir, tmp_path / "run", "--env", "mcp", "--steps", "1", "--max-turns", "3",
                           "--max-context", "8192", "--train-data", str(rows), "--rescue", "hint=10,source=answer,probe=1,narrow=8" + told))
    assert out["history"][0]["rescue_probed"] == 2 and out["history"][0]["rescue_unfound"] == 0  # no pass to take back
    probed = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").open()]
    probed = [e for e in probed if "probe" in e["info"]]
    assert probed and {e["info"]["probe"] for e in probed} <= {"db_tables", "list_categories", "cart_view"}
    assert all(e["info"].get("answer_hint", False) == bool(told) for e in probed)
    assert not any("correct final answer" in e["prompt"] for e in probed)  # trained without the answer
    head = probed[0]["segments"][0]  # the played call and the server's result: context, shown as the hint
    assert not head["trained"] and head.get("hint") and f'"name": "{probed[0]["info"]["probe"]}"' in head["text"]
    assert "tool_response" in head["text"] and "Error" not in head["text"]


@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_equal_one_big_batch(tiny_tokenizer, reduction):
    # gradient accumulation uses the mini-batch's global denominators: splitting 6 episodes of
    # unequal length into micro-batches of 1 gives the same update as one batch of 6
    from conftest import make_tiny_model
    from rollout import Episode
    g = torch.Generator().manual_seed(0)
    eps = []
    for i in range(6):
        P, R = 5 + i, 3 + 2 * i
        ids = torch.randint(0, 256, (P + R,), generator=g).tolist()
        mask = [1] * R
        mask[1] = 0  # an env token inside the response
        eps.append(Episode(ids[:P], ids[P:], mask, [-2.0 if m else 0.0 for m in mask], float(i % 3), "stop", i // 3))
    out = []  # one batch of 6; fixed micro-batches of 1; a 24-token budget (lengths 8..23: 1-3 per micro-batch)
    for mbs, budget in (("6", "0"), ("1", "0"), ("6", "24")):
        args = train.parse_args(["--model", "x", "--micro-batch-size", mbs, "--prompts-per-step", "2", "--n", "3",
                                 "--reduction", reduction, "--lr", "1e-2", "--grad-clip", "0",
                                 "--micro-batch-tokens", budget])
        model = make_tiny_model(tiny_tokenizer)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)  # AdamW's first step ~ sign(g): too touchy
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)
        state = {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0}
        m = train.train_step(train.Run(args, model, opt, sched, pad_id=tiny_tokenizer.pad_token_id), eps, state)
        out.append((m, {k: v.clone() for k, v in model.state_dict().items()}))
    (m6, w6), *split = out
    for m1, w1 in split:
        assert m6["loss"] == pytest.approx(m1["loss"], abs=1e-6)
        assert m6["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        assert all(torch.allclose(w6[k], w1[k], atol=1e-6) for k in w6)


def test_micro_batches_pack_by_token_budget():
    from score import micro_batches
    lengths = torch.tensor([5, 30, 12, 12, 3, 40, 7])
    rows = torch.arange(7)
    assert [b.tolist() for b in micro_batches(lengths, rows, 3)] == [[0, 1, 2], [3, 4, 5], [6]]  # fixed size
    packed = micro_batches(lengths, rows, 3, tokens=40)
    assert sorted(sum((b.tolist() for b in packed), [])) == list(range(7))  # every row exactly once
    assert all(len(b) * int(lengths[b].max()) <= 40 or len(b) == 1 for b in packed)  # within the budget
    assert [b.tolist() for b in packed] == [[5], [1], [2, 3, 6], [0, 4]]  # longest first, greedy


def test_rollout_logprobs_only_when_read(capsys):
    # vLLM rollouts skip the engine's logprobs unless --old-logprobs rollout or TIS reads them
    base = ["--model", "x", "--gpu", "h100", "--engine", "vllm"]
    assert train.parse_args(base).rollout_logprobs is False
    assert train.parse_args(base + ["--tis-cap", "2"]).rollout_logprobs is True
    assert train.parse_args(base + ["--old-logprobs", "rollout"]).rollout_logprobs is True
    assert train.parse_args(base + ["--rollout-quant", "fp8", "--tis-cap", "0"]).rollout_logprobs is True  # logprob_mismatch
    assert train.parse_args(["--model", "x"]).rollout_logprobs is True  # hf engine: old logprobs = rollout's


def load_data(args):
    return train.envs.load_splits(args.env, args.train_data, args.eval_data, digits=args.digits, fewshot=args.fewshot,
                                  seed=args.seed, eval_limit=args.eval_limit, eval_every=args.eval_every)


def test_mcp_fewshot_puts_the_tool_demo_before_the_question():
    from mcp_tools.tasks import DEMO
    train_rows, eval_rows = load_data(train.parse_args(["--model", "x", "--env", "mcp", "--fewshot", "1"]))
    for row in (train_rows[0], eval_rows[0]):
        roles = [m["role"] for m in row["prompt"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
        assert row["prompt"][1:5] == DEMO
    plain, _ = load_data(train.parse_args(["--model", "x", "--env", "mcp"]))  # CPU mcp default: no demo
    assert [m["role"] for m in plain[0]["prompt"]] == ["system", "user"]
    with pytest.raises(ValueError, match="one worked example"):
        load_data(train.parse_args(["--model", "x", "--env", "mcp", "--fewshot", "2"]))


def test_chunked_logprobs_equal_full_logits(tiny_tokenizer):
    # score.sequence_logprobs with chunk > 0 (LM head over chunks, recomputed in backward) gives the
    # same logprobs, entropy and gradients as the full-logits forward
    from conftest import make_tiny_model
    from score import sequence_logprobs
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (3, 11), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0  # right padding
    out = []
    for chunk in (0, 4):
        model = make_tiny_model(tiny_tokenizer)
        logp, ent = sequence_logprobs(model, ids, attn, temperature=0.7, chunk=chunk, entropy=True)
        (logp * attn[:, 1:]).sum().backward()
        out.append((logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, e0, g0), (lp4, e4, g4) = out
    assert torch.allclose(lp0, lp4, atol=1e-5) and torch.allclose(e0, e4, atol=1e-5)
    assert all(torch.allclose(g0[n], g4[n], atol=1e-5) for n in g0)


def _random_episodes(seed, reward=lambda i: float(i % 3)):
    """Two groups of three random episodes (prompt 4 + i, response 3 + i tokens), reward(i) each."""
    from rollout import Episode
    g = torch.Generator().manual_seed(seed)
    eps = []
    for i in range(6):
        P, R = 4 + i, 3 + i
        ids = torch.randint(0, 256, (P + R,), generator=g).tolist()
        eps.append(Episode(ids[:P], ids[P:], [1] * R, [0.0] * R, reward(i), "stop", i // 3))
    return eps


def test_detached_old_logprobs_equal_recompute(tiny_tokenizer):
    # exactly on-policy (one epoch, one mini-batch), old = logp.detach() skips the no-grad forward and
    # must give the same update as recomputing the old logprobs before it
    from conftest import make_tiny_model
    eps = _random_episodes(0)
    out = []
    for old in ("recompute", "detach"):
        args = train.parse_args(["--model", "x", "--gpu", "h100", "--engine", "vllm", "--micro-batch-size", "2",
                                 "--prompts-per-step", "2", "--n", "3", "--lr", "1e-2", "--grad-clip", "0",
                                 "--old-logprobs", old, "--dtype", "float32"])
        model = make_tiny_model(tiny_tokenizer)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)
        state = {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0}
        m = train.train_step(train.Run(args, model, opt, sched, pad_id=tiny_tokenizer.pad_token_id), eps, state)
        out.append((m, {k: v.clone() for k, v in model.state_dict().items()}))
    (mr, wr), (md, wd) = out
    assert train.parse_args(["--model", "x", "--gpu", "h100"]).old_logprobs == "detach"  # the on-policy default
    assert mr["loss"] == pytest.approx(md["loss"], abs=1e-6) and md["ratio_max"] == 1.0
    assert all(torch.allclose(wr[k], wd[k], atol=1e-6) for k in wr)
    with pytest.raises(SystemExit):  # two epochs are not on-policy
        train.parse_args(["--model", "x", "--old-logprobs", "detach", "--ppo-epochs", "2"])


def test_compile_defaults_on_for_one_gpu_only(monkeypatch):
    # --compile: on with a GPU preset on one GPU, full-parameter; off on the CPU, with LoRA and under
    # torchrun; the flag wins
    assert train.parse_args(["--model", "x", "--gpu", "l40s"]).compile is True
    assert train.parse_args(["--model", "x"]).compile is False
    assert train.parse_args(["--model", "x", "--gpu", "l40s", "--no-compile"]).compile is False
    assert train.parse_args(["--model", "x", "--gpu", "l40s", "--lora-rank", "8"]).compile is False
    assert train.parse_args(["--model", "x", "--gpu", "l40s", "--lora-rank", "8", "--compile"]).compile is True
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.parse_args(["--model", "x", "--gpu", "h100"]).compile is False


def test_kl_run_logs_the_no_kl_runs_entropy_as_entropy_live(tiny_tokenizer):
    # with a KL term every sequence trains and "entropy" is over all of them; "entropy_live" is over
    # the mixed-reward groups alone, which is what "entropy" means in a run without KL
    import copy
    from conftest import make_tiny_model
    # group 0: rewards 1, 1, 1 (A = 0); group 1: 0, 1, 2 (A = 0 on the middle one)
    eps = _random_episodes(2, reward=lambda i: 1.0 if i < 3 else float(i - 3))
    out = {}
    for kl in ("0", "0.1"):
        args = train.parse_args(["--model", "x", "--micro-batch-size", "2", "--prompts-per-step", "2", "--n", "3",
                                 "--kl-coef", kl, "--dtype", "float32"])
        model = make_tiny_model(tiny_tokenizer)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)
        state = {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0}
        ref = copy.deepcopy(model) if kl != "0" else None
        run = train.Run(args, model, opt, sched, ref_model=ref, pad_id=tiny_tokenizer.pad_token_id)
        out[kl] = train.train_step(run, eps, state)
    assert out["0"]["live_frac"] == pytest.approx(1 / 3)   # 0 and 2 of group 1
    assert out["0"]["entropy_live"] == out["0"]["entropy"]  # without KL only the live sequences train
    assert out["0.1"]["live_frac"] == 1.0
    assert out["0.1"]["entropy_live"] == pytest.approx(out["0"]["entropy"], abs=1e-5)
    assert out["0.1"]["entropy"] != pytest.approx(out["0"]["entropy"], abs=1e-5)  # all six sequences


@pytest.mark.parametrize("chunk", ["0", "4"])
def test_entropy_bonus_gradient_is_minus_c_times_the_reduced_entropy(tiny_tokenizer, chunk):
    # SGD at lr 1 moves the weights by minus the gradient: the run with --entropy-coef c minus the
    # run without is c times the gradient of the reduced token entropy of the sequences that train
    # (group 0 has equal rewards: A = 0, skipped), computed here by plain autograd from the logits
    from conftest import make_tiny_model
    eps = _random_episodes(3, reward=lambda i: 1.0 if i < 3 else float(i - 3))
    c, out = 0.5, {}
    for coef in ("0", str(c)):
        args = train.parse_args(["--model", "x", "--micro-batch-size", "2", "--prompts-per-step", "2", "--n", "3",
                                 "--dtype", "float32", "--grad-clip", "0", "--entropy-coef", coef,
                                 "--logprob-chunk", chunk])
        model = make_tiny_model(tiny_tokenizer).double()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        run = train.Run(args, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0),
                        pad_id=tiny_tokenizer.pad_token_id)
        m = train.train_step(run, eps, {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0})
        assert m["entropy_coef"] == float(coef)
        out[coef] = {k: v.clone() for k, v in model.state_dict().items()}
    model = make_tiny_model(tiny_tokenizer).double()
    batch = train.episodes_to_batch(eps, tiny_tokenizer.pad_token_id)
    mask = batch["loss_mask"][:, 1:].double()
    live = torch.tensor([0, 0, 0, 1, 0, 1], dtype=torch.double)[:, None]  # A != 0: the group-1 ends
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)  # (B, T-1)
    loss = train.reduce_loss(args, -c * ent * live, mask, mask.sum(), 6)
    loss.backward()
    for k, p in model.named_parameters():
        want = -p.grad  # SGD, lr 1
        assert torch.allclose(out[str(c)][k] - out["0"][k], want, atol=1e-10), k
    assert any(p.grad.abs().max() > 1e-6 for p in model.parameters())  # the bonus did move something
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "x", "--entropy-coef", "-1"])


def test_memory_estimate_parts():
    from transformers import Qwen2Config
    from options.memory import estimate_memory
    from support.sources import SHAPES
    cfg = Qwen2Config(**SHAPES["random-qwen2.5-1.5b"])
    n = 1_543_714_304  # Qwen2.5-1.5B's parameter count (tied embeddings)
    full = estimate_memory(cfg, n, 4, 4096, False, 0, 13e9)
    lean = estimate_memory(cfg, n, 4, 4096, True, 1024, 13e9)
    assert lean["parts"]["activations"] < full["parts"]["activations"] / 5  # checkpointing keeps layer inputs only
    assert lean["parts"]["logits"] < full["parts"]["logits"] / 3  # 1024 tokens of logits instead of 16k
    assert lean["rollout"] == full["rollout"] == 16 * n - 4 * n + 13e9  # weights + AdamW + engine, grads freed
    assert 24e9 < lean["train"] < 40e9  # what an L40S must hold while training 1.5B full-parameter
    off = estimate_memory(cfg, n, 4, 4096, True, 1024, 13e9, offload=True)  # --offload-optimizer
    assert off["rollout"] == lean["rollout"] - 8 * n  # no AdamW on the GPU while vLLM is awake
    act = lean["parts"]["activations"] + lean["parts"]["logits"]
    assert off["train"] == 8 * n + max(act, 8 * n) < lean["train"]  # AdamW only inside the update


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_offload_optimizer_trains_the_same(tiny_tokenizer, device):
    # --offload-optimizer: AdamW's state lives in host buffers between updates (allocated once, then
    # reused; pinned on a GPU machine) and comes in for the update (on a GPU: fused AdamW on GPU copies);
    # the weights after two steps equal the resident run's exactly
    from conftest import make_tiny_model
    from rollout import Episode
    g = torch.Generator().manual_seed(1)
    eps = [Episode(ids[:6], ids[6:], [1] * 6, [-2.0] * 6, float(i % 2), "stop", i // 2)
           for i, ids in enumerate(torch.randint(0, 256, (4, 12), generator=g).tolist())]
    out = {}
    for flag in ("--no-offload-optimizer", "--offload-optimizer"):
        args = train.parse_args(["--model", "x", "--prompts-per-step", "2", "--n", "2", "--lr", "1e-3", flag])
        model = make_tiny_model(tiny_tokenizer).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device == "cuda" or None)
        run = train.Run(args, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0),
                        pad_id=tiny_tokenizer.pad_token_id)
        state = {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0}
        ptrs = []
        for step in range(2):
            state["step"] = step
            train.train_step(run, eps, state)
            ptrs.append(sorted(t.data_ptr() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)))
        out[flag] = {k: v.clone() for k, v in model.state_dict().items()}
        if flag == "--offload-optimizer":
            held = sorted(b.data_ptr() for b in run.host_state.values())
            assert set(held) <= set(ptrs[0]) and ptrs[0] == ptrs[1] and len(held) == 2 * len(opt.state)  # the moments
            assert all(b.device.type == "cpu" and b.is_pinned() == (device == "cuda") for b in run.host_state.values())
        else:
            assert not run.host_state
    assert all(torch.equal(out["--no-offload-optimizer"][k], out["--offload-optimizer"][k]) for k in out["--offload-optimizer"])
    init = make_tiny_model(tiny_tokenizer).state_dict()
    assert any(not torch.equal(v.cpu(), init[k]) for k, v in out["--offload-optimizer"].items())  # it did train
    assert config.PRESETS["a100"]["offload_optimizer"] and not config.PRESETS["l40s"]["offload_optimizer"]


def test_sleep_level_auto_keeps_the_engine_awake_only_when_training_fits_beside_it(tmp_path, monkeypatch):
    # --sleep-level auto: the awake engine's share of the GPU counts in training's peak; level 2 when
    # that does not fit the free memory, level 0 (no sleep/wake each step) when it does
    from transformers import Qwen2Config
    import config
    from options import memory
    from options.memory import estimate_memory, fits_gpu, meta_model
    from support.sources import SHAPES
    Qwen2Config(**SHAPES["random-qwen2.5-1.5b"]).save_pretrained(tmp_path)  # a shape: the config is all it reads,
    for name in ("tokenizer.json", "model.safetensors"):  # but a local --model folder must hold these (sources.model_source)
        (tmp_path / name).write_text("")
    base = ["--model", str(tmp_path), "--gpu", "h100", "--engine", "vllm", "--gpu-memory-utilization", "0.3"]
    args = train.parse_args(base)
    assert args.sleep_level == 2  # no estimate (fits=None): the safe side
    assert train.parse_args(base + ["--sleep-level", "0"]).sleep_level == 0
    shape, total = meta_model(tmp_path), 80e9
    n = sum(p.numel() for p in shape.parameters())
    est = estimate_memory(shape.config, n, args.micro_batch_size, args.max_context, False, 0, 0.3 * total)
    asleep, awake = max(est["rollout"], est["train"]), est["train"] + est["parts"]["engine"]
    assert asleep < awake
    kw = dict(lora_rank=0, compute_dtype=torch.bfloat16, kl_coef=0.0, engine_share=0.3,
              micro_batch=args.micro_batch_size, max_context=args.max_context, grad_checkpointing=False, chunk=0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (awake * 1.1, total))  # fits, but not with auto's margin
    assert fits_gpu(str(tmp_path), fail=False, awake=True, **kw) is True
    assert fits_gpu(str(tmp_path), fail=False, awake=True, headroom=1.2, **kw) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # config.fits_this_gpu: a GPU preset needs CUDA
    assert train.parse_args(base, fits=config.fits_this_gpu).sleep_level == 2  # auto: the 20% margin says sleep
    for free, awake_fits in ((awake + 1e9, True), ((asleep + awake) / 2, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, total))
        assert fits_gpu(str(tmp_path), fail=False, **kw) is True  # asleep it fits either way
        assert fits_gpu(str(tmp_path), fail=False, awake=True, **kw) is awake_fits
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (awake * 1.3, total))
    chosen = train.parse_args(base, fits=config.fits_this_gpu)
    assert (chosen.sleep_level, chosen.lora_rank) == (0, 0)  # auto: awake, and full-parameter fits
    explicit = train.parse_args(base + ["--sleep-level", "0"])  # an explicit 0 checks the awake case:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: ((asleep + awake) / 2, total))
    with pytest.raises(memory.DoesNotFit, match="lower --gpu-memory-utilization"):  # it fails with what to change
        config.fits_this_gpu(explicit, 0, awake=True, fail=True)


def test_a_per_process_memory_fraction_is_the_memory_a_run_may_take_its_sleeping_engine_counted(tmp_path, monkeypatch,
                                                                                                 capsys):
    # several runs sharing one GPU, each held by PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction: the device's
    # free memory overstates what a run may take, and a sleeping vLLM engine still counts against the fraction (its
    # pages are unmapped under tensors that live on), so the check counts the engine whether it sleeps or not
    from transformers import Qwen2Config
    from options import memory
    from options.memory import estimate_memory, fits_gpu, meta_model
    from support.sources import SHAPES
    Qwen2Config(**SHAPES["random-qwen2.5-1.5b"]).save_pretrained(tmp_path)
    shape, total = meta_model(tmp_path), 140e9
    n = sum(p.numel() for p in shape.parameters())
    kw = dict(lora_rank=0, compute_dtype=torch.bfloat16, kl_coef=0.0, engine_share=0.1, micro_batch=4,
              max_context=4096, grad_checkpointing=True, chunk=1024)
    est = estimate_memory(shape.config, n, 4, 4096, True, 1024, 0.1 * total)
    asleep, awake = max(est["rollout"], est["train"]), est["train"] + est["parts"]["engine"]
    share = (asleep + awake) / 2  # holds the run with its engine asleep, not with the engine counted
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (130e9, total))  # the shared pool: much free
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: 1.0)
    assert fits_gpu(str(tmp_path), fail=False, **kw) is True  # no fraction: the device's free memory
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: share / total)
    assert fits_gpu(str(tmp_path), fail=False, **kw) is False
    assert "(engine counted while training)" in capsys.readouterr().out
    with pytest.raises(memory.DoesNotFit, match=r"GB free under PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction "
                                                r"0\.\d+, which counts the engine even while it sleeps: try"):
        fits_gpu(str(tmp_path), **kw)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: awake * 1.05 / total)
    assert fits_gpu(str(tmp_path), fail=False, **kw) is True
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0.1 * awake)  # what this process holds already
    assert fits_gpu(str(tmp_path), fail=False, **kw) is False


def test_lora_rank_auto_picks_lora_only_where_full_parameter_training_does_not_fit():
    calls = []

    def fits(args, lora_rank, awake=False, headroom=1.0):
        calls.append((lora_rank, awake))
        return lora_rank > 0 or awake is None  # full-parameter never fits here; LoRA does

    args = train.parse_args(["--model", "x", "--gpu", "l40s"], fits=fits)
    assert args.lora_rank == 32 and calls[0] == (0, False)
    assert args.lr == pytest.approx(10 * config.PRESETS["l40s"]["lr"])  # LoRA's LR default: 10x the preset's
    assert train.parse_args(["--model", "x", "--gpu", "l40s"]).lora_rank == 0  # no estimate: full-parameter
    assert train.parse_args(["--model", "x", "--gpu", "l40s", "--lora-rank", "0"], fits=fits).lora_rank == 0


def test_bad_input_corpus(tiny_model_dir, tmp_path, toy_env, monkeypatch, capsys):
    # each bad input (model, rows, MCP config, flags): one clear error line naming what is wrong,
    # and no run folder left behind. Malformed tool calls are not errors but observations the
    # model reads (tests/test_mcp.py has 27 kinds of them).
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    good = envs.multiply_rows(1)[0]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(good) + "\n")
    bad_rows = tmp_path / "bad_rows.jsonl"
    bad_rows.write_text(json.dumps(good) + "\n" + json.dumps({k: v for k, v in good.items() if k != "reward_spec"}) + "\n")
    bad_cfg = tmp_path / "bad_mcp.json"  # a key no MCP client knows
    bad_cfg.write_text(json.dumps({"mcpServers": {"time": {"command": "mcp-server-time", "colour": "red"}}}))
    dup_cfg = tmp_path / "dup_mcp.json"  # a server named twice: JSON parsers silently keep the last
    dup_cfg.write_text('{"mcpServers": {"time": {"command": "mcp-server-time"}, "time": {"command": "uvx"}}}')
    mcp_rows = tmp_path / "mcp_rows.jsonl"  # your own tasks, for your own servers
    mcp_rows.write_text(json.dumps({**good, "env_class": "mcp", "reward_spec": {"method": "rule", "ground_truth": "42"}}) + "\n")
    mine = ["--env", "mcp", "--train-data", str(mcp_rows), "--eval-data", str(mcp_rows)]
    cases = [  # (extra argv, exception, message)
        (["--model", str(tmp_path / "nope")], FileNotFoundError, "no such folder"),
        (["--model", "./runs/nope"], FileNotFoundError, "no such folder"),
        (["--model", "nobody/no-such-model-7f3a"], FileNotFoundError, "offline .* no copy in the Hugging Face cache"),
        (["--model", str(tmp_path)], FileNotFoundError, "not a Hugging Face model folder"),
        (["--train-data", str(rows), "--eval-every", "2"], ValueError, "--train-data without --eval-data"),
        (["--train-data", str(bad_rows), "--eval-data", str(rows)], ValueError, r"bad_rows.jsonl:line 2: missing field 'reward_spec'"),
        ([*mine, "--mcp-config", str(bad_cfg)], ValueError, r"bad_mcp.json: mcpServers.time: unknown key\(s\) colour"),
        ([*mine, "--mcp-config", str(tmp_path / "none.json")], FileNotFoundError, "none.json"),
        ([*mine, "--mcp-config", str(dup_cfg)], ValueError, r"dup_mcp\.json.*'time'.*(twice|duplicate)"),
        # your servers with the bundled tasks: their tools are not on your servers, every reward 0
        (["--env", "mcp", "--mcp-config", str(bad_cfg)], ValueError, "--mcp-config .* pass your rows with --train-data"),
        (["--env", "mcp", "--mcp-config", str(bad_cfg), "--eval-data", str(mcp_rows)], ValueError, "--train-data"),
    ]
    for i, (extra, exc, msg) in enumerate(cases):
        out = tmp_path / f"run{i}"
        argv = _argv(tiny_model_dir, out, *extra)
        if "--model" in extra:  # the case's --model replaces _argv's
            j = argv.index("--model")
            del argv[j:j + 2]
        with pytest.raises(exc, match=msg) as e:
            train.main(argv)
        assert "\n" not in str(e.value) and not out.exists(), extra
    # a ground truth multiply cannot score: one error naming file and line, before any model loads
    monkeypatch.setattr(train, "start", lambda *a, **kw: pytest.fail("a model loaded before the rows were checked"))
    for i, gt in enumerate([None, "", True, {}, "six"]):
        gt_rows = tmp_path / f"gt{i}.jsonl"
        gt_rows.write_text(json.dumps(good) + "\n" + json.dumps({**good, "reward_spec": {"method": "rule", "ground_truth": gt}}) + "\n")
        with pytest.raises(ValueError, match=rf"gt{i}.jsonl:line 2: .*ground_truth") as e:
            train.main(_argv(tiny_model_dir, tmp_path / "gt", "--train-data", str(gt_rows), "--eval-data", str(rows)))
        assert "\n" not in str(e.value) and not (tmp_path / "gt").exists(), gt
    with pytest.raises(SystemExit):  # a misspelt flag names the near ones
        train.parse_args(["--data", "x.jsonl"])
    err = capsys.readouterr().err
    assert "--data: did you mean" in err and "--train-data" in err and "--eval-data" in err


def test_second_run_never_mixes_with_the_first(tiny_model_dir, tmp_path, toy_env):
    out = tmp_path / "run"
    train.main(_argv(tiny_model_dir, out, "--steps", "1"))
    before = sorted(p.name for p in (out / "ckpt").iterdir()), (out / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match="already holds a run: continue it with --resume"):
        train.main(_argv(tiny_model_dir, out, "--steps", "2"))
    assert (sorted(p.name for p in (out / "ckpt").iterdir()), (out / "metrics.jsonl").read_text()) == before
    res = train.main(_argv(tiny_model_dir, out, "--steps", "2", "--resume", str(out)))  # continuing is fine
    assert res["step"] == 2
    other = tmp_path / "other"
    train.main(_argv(tiny_model_dir, other, "--steps", "1"))
    with pytest.raises(FileExistsError):  # resuming another run into this folder is not
        train.main(_argv(tiny_model_dir, out, "--steps", "3", "--resume", str(other)))


def test_non_finite_reward_names_env_and_row(tiny_model_dir, tmp_path, monkeypatch):
    class NaNEnv(ByteSumEnv):
        def step(self, text):
            return [], float("nan"), True, {}

    monkeypatch.setattr(train.envs, "make_env", lambda name, **kw: NaNEnv())
    with pytest.raises(ValueError, match=r"env 'multiply' returned a non-finite reward \(nan\) for row 'synthetic_multiply'"):
        train.main(_argv(tiny_model_dir, tmp_path / "run"))


def test_help_is_grouped_and_the_printed_preset_is_the_one_that_applies(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    groups = ["common flags:", "advanced: model, engine and memory:", "advanced: LoRA (options/lora.py):",
              "advanced: env and data:", "advanced: algorithm (grpo.py):", "advanced: sampling:",
              "advanced: optimisation:", "advanced: logging:"]
    at = [out.index("\n" + g) for g in groups]
    assert at == sorted(at)  # the common flags first, then the advanced groups
    common = out[at[0]:at[1]]
    assert 18 <= common.count("\n  --") <= 24  # the ~20 flags most runs use
    assert "--clip-high" in out[at[4]:at[5]] and "--clip-high" not in common
    mcp = config.preset_for("cpu", "mcp")  # what an mcp run prints and uses, not multiply's values
    args = train.parse_args(["--env", "mcp"])
    assert all(getattr(args, k) == v for k, v in mcp.items())
    assert config.preset_line(args) == f"preset cpu mcp {json.dumps(mcp)}"  # nothing overridden
    assert mcp["max_context"] == 4096 != config.PRESETS["cpu"]["max_context"]


def test_lora_run_trains_only_adapters_and_resumes_exactly(tiny_model_dir, tmp_path, toy_env):
    """--lora-rank: the checkpoint is a PEFT-layout adapter, the base never moves, resume is bit-exact,
    and --save-merged writes a plain HF folder equal to base + (alpha/r) B A."""
    extra = ("--mini-batch-size", "3", "--lora-rank", "4", "--lora-alpha", "8", "--kl-coef", "0.1")
    a = train.main(_argv(tiny_model_dir, tmp_path / "a", *extra, "--save-merged"))
    assert all(h["grad_norm"] > 0 for h in a["history"])
    ad = load_file(os.path.join(a["checkpoint"], "adapter_model.safetensors"))
    assert ad and all(k.startswith("base_model.model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in ad)
    assert any(v.abs().sum() > 0 for k, v in ad.items() if "lora_B" in k)  # B left zero: it trained
    assert not os.path.exists(os.path.join(a["checkpoint"], "model.safetensors"))  # the base is --model's
    merged, base = _weights(tmp_path / "a" / "merged"), _weights(tiny_model_dir)
    cfg = json.load(open(os.path.join(a["checkpoint"], "adapter_config.json")))
    name = "model.layers.0.self_attn.q_proj"
    A, B = ad[f"base_model.model.{name}.lora_A.weight"], ad[f"base_model.model.{name}.lora_B.weight"]
    want = base[f"{name}.weight"].float() + cfg["lora_alpha"] / cfg["r"] * (B @ A)
    assert torch.allclose(merged[f"{name}.weight"].float(), want, atol=1e-6)
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])  # untargeted: the base

    train.main(_argv(tiny_model_dir, tmp_path / "b", *extra, "--steps", "1"))
    b2 = train.main(_argv(tiny_model_dir, tmp_path / "b", *extra, "--resume", str(tmp_path / "b")))
    for k in ("reward_mean", "loss", "grad_norm", "kl"):
        assert a["history"][1][k] == b2["history"][0][k], k
    bd = load_file(os.path.join(b2["checkpoint"], "adapter_model.safetensors"))
    assert all(torch.equal(ad[k], bd[k]) for k in ad)


class DropHalfEnv(ByteSumEnv):
    """ByteSumEnv on rows with an odd product; reward 0 on the others, so their groups are all-equal
    and DAPO's dynamic sampling drops them (those episodes are never trained on)."""

    def reset(self, row):
        self.constant = int(row["reward_spec"]["ground_truth"]) % 2 == 0
        return super().reset(row)

    def step(self, text):
        obs, r, done, info = super().step(text)
        return obs, 0.0 if self.constant else r, done, info


def test_dapo_run_shows_dropped_groups_without_an_advantage(tiny_model_dir, tmp_path, monkeypatch):
    # the README's `--algo dapo --steps 2 --eval-every 0`: dropped groups have no advantage, which the
    # viewer writes as null; the run finishes with its checkpoint
    monkeypatch.setattr(train.envs, "make_env", lambda name, **kw: DropHalfEnv())
    out = train.main(_argv(tiny_model_dir, tmp_path, "--algo", "dapo", "--viewer-groups", "99"))
    assert out["step"] == 2 and out["checkpoint"].endswith("step_000002")
    adv = [json.loads(line)["advantage"] for line in open(tmp_path / "episodes.jsonl")]
    assert None in adv and any(isinstance(a, float) for a in adv)  # dropped and trained groups both shown
    assert (tmp_path / "episodes.html").stat().st_size > 0


class AlternatingEnv(ByteSumEnv):
    """Rewards 0, 1, 0, 1, ... in the order this process makes its envs (a group of n = 2 is mixed:
    DAPO keeps it), but 0.5 from the first `flat` ones (all equal: their groups are dropped)."""
    made, flat = 0, 0

    def __init__(self, **kwargs):
        self.k, AlternatingEnv.made = AlternatingEnv.made, AlternatingEnv.made + 1

    def step(self, text):
        r = 0.5 if self.k < self.flat else float(self.k % 2)
        return [], r, True, {"correct": r == 1.0}


def _worker_dapo(rank, world, port, argv, out):
    """train.main on one rank of a torchrun-style world, with AlternatingEnv (rank 1: its first round
    flat); the generation rounds of each step are written to out/rounds{rank}.json."""
    from test_dist import _as_rank
    _as_rank(rank, world, port)
    AlternatingEnv.flat = 4 if rank == 1 else 0  # 2 prompts x 2 a rank: rank 1 keeps nothing in round 1
    train.envs.make_env = lambda name, **kw: AlternatingEnv()
    collect, rounds = train.collect, []

    def counted(*a):
        out_ = collect(*a)
        rounds.append(out_[2])
        return out_
    train.collect = counted
    train.main(argv)
    (out / f"rounds{rank}.json").write_text(json.dumps(rounds))


def test_dapo_on_two_processes_every_rank_draws_as_many_rounds(tiny_model_dir, tmp_path):
    # 4 prompts x 2 a step on 2 processes: in step 1 rank 0 keeps its 4 episodes in one round, rank 1
    # none; both draw a second round (ranks that disagree stop pairing up their collectives) and each
    # trains 4 episodes; in step 2 one round does
    from test_dist import _free_port, _spawn
    argv = _argv(tiny_model_dir, tmp_path / "run", "--algo", "dapo", "--prompts-per-step", "4", "--n", "2",
                 "--overlong-buffer", "0")  # no length penalty: 0.5 stays all-equal
    _spawn(_worker_dapo, (2, _free_port(), argv, tmp_path))
    rounds = [json.loads((tmp_path / f"rounds{r}.json").read_text()) for r in (0, 1)]
    assert rounds[0] == rounds[1] == [2, 1]
    hist = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [h["gen_rounds"] for h in hist] == [2, 1] and [h["episodes"] for h in hist] == [8, 8]


def _worker_share(rank, world, port, out):
    from support import dist
    from test_dist import _as_rank
    _as_rank(rank, world, port)
    w = dist.World("cpu")
    kept = list(range(6 if rank == 0 else 2))  # share 4: rank 0 is full, rank 1 short
    (out / f"share{rank}.json").write_text(json.dumps([w.short(len(kept), 4), w.trained(kept, 4)]))
    w.close()


def test_dynamic_sampling_share_is_decided_over_all_ranks(tmp_path):
    # rank 0 holds 6 kept episodes, rank 1 holds 2, of a share of 4: both draw another round; were the
    # rounds spent, both train 2 (as many updates on each rank)
    from test_dist import _free_port, _spawn
    _spawn(_worker_share, (2, _free_port(), tmp_path))
    assert [json.loads((tmp_path / f"share{r}.json").read_text()) for r in (0, 1)] == [[True, [0, 1]], [True, [0, 1]]]
    one = train.dist.World()  # one process: the single-GPU rule, len(kept) < share and kept[:share]
    assert (one.short(3, 4), one.short(4, 4), one.trained(list(range(6)), 4)) == (True, False, [0, 1, 2, 3])


def test_failing_viewer_plot_and_metrics_never_stop_training(tiny_model_dir, tmp_path, toy_env, monkeypatch, capsys):
    def broken(*a, **kw):
        raise OSError("No space left on device")

    monkeypatch.setattr(support.viewer.Page, "write", broken)
    monkeypatch.setattr(support.logs, "write_plot", broken)
    monkeypatch.setattr(support.logs.Logger, "log", broken)
    argv = _argv(tiny_model_dir, tmp_path, "--steps", "3", "--eval-every", "1")
    out = train.main(argv)
    assert out["step"] == 3 and out["checkpoint"].endswith("step_000003")  # the run and its checkpoint
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]
    assert sorted(warnings) == sorted(  # each failure once, one line: what failed, the exception's type and message
        f"WARNING: {what} failed (OSError: No space left on device); training goes on without it (reported once)"
        for what in ("the viewer (episodes.html)", "the plot (curves.png)", "logging (metrics.jsonl, TensorBoard, W&B)"))
    assert len(open(tmp_path / "episodes.jsonl").readlines()) == 3 * 6  # the viewer's jsonl still gets every step


class DownEnv(ByteSumEnv):
    """A server that cannot be reached: every reset fails."""

    def reset(self, row):
        raise ConnectionError("MCP server 'shop' (url http://127.0.0.1:9/mcp) connection refused")


def test_servers_down_for_several_steps_stop_the_run_with_a_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train.envs, "make_env", lambda name, **kw: DownEnv())
    with pytest.raises(SystemExit) as e:
        train.cli(_argv(tiny_model_dir, tmp_path, "--steps", "6", "--max-error-steps", "2"))
    msg = str(e.value.code)
    assert msg.startswith("error: every episode of the last 2 steps ended in an error") and "\n" not in msg
    assert "connection refused" in msg and f"--resume {tmp_path}" in msg
    assert checkpoint.find_checkpoint(tmp_path).name == "step_000002"  # the final save ran
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2] and json.loads(open(tmp_path / "metrics.jsonl").readlines()[-1])["finish_error"] == 1.0
    monkeypatch.setattr(train.envs, "make_env", lambda name, **kw: ByteSumEnv())  # the servers are back
    out = train.main(_argv(tiny_model_dir, tmp_path, "--steps", "3", "--max-error-steps", "2", "--resume", str(tmp_path)))
    assert out["step"] == 3 and out["history"][0]["finish_error"] == 0.0


def test_resuming_a_complete_run_says_how_to_extend_it(tiny_model_dir, tmp_path, toy_env, monkeypatch):
    import shutil
    train.main(_argv(tiny_model_dir, tmp_path / "run", "--steps", "1"))
    real_start = train.start

    def no_model(*a, **kw):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(train, "start", no_model)  # the step is read from the folder name: nothing loads
    for steps in ("1", "0"):
        with pytest.raises(ValueError, match=r"the run is complete at step 1 \(--steps " + steps +
                           r"\): pass a larger --steps to train further, e.g. --steps"):
            train.main(_argv(tiny_model_dir, tmp_path / "run", "--steps", steps, "--resume", str(tmp_path / "run")))
    monkeypatch.setattr(train, "start", real_start)
    renamed = tmp_path / "best"  # no step in its name: the check runs once the trainer state is read
    shutil.copytree(checkpoint.find_checkpoint(tmp_path / "run"), renamed)
    with pytest.raises(ValueError, match=r"the run is complete at step 1 \(--steps 1\)"):
        train.main(_argv(tiny_model_dir, tmp_path / "new", "--steps", "1", "--resume", str(renamed)))
    assert not (tmp_path / "new").exists()


def test_setup_errors_are_one_line(tiny_model_dir, tmp_path, monkeypatch):
    # what `python train.py` / `python lab/bench.py` print instead of a traceback
    from mcp_tools import pool as mcp_pool
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        train.cli(["--gpu", "h100", "--out-dir", str(tmp_path / "gpu")])
    assert e.value.code == "error: --gpu h100 but CUDA is not available here (use --gpu cpu)"

    def no_server(*a, **kw):
        raise mcp_pool.ServerStartFailed("MCP server 'time' (command: mcp-server-time; config: s.json) failed to start: "
                                    "FileNotFoundError: mcp-server-time")

    monkeypatch.setattr(train.envs, "open_mcp_pool", no_server)
    with pytest.raises(SystemExit) as e:
        train.cli(_argv(tiny_model_dir, tmp_path / "mcp"))
    assert e.value.code.startswith("error: MCP server 'time'") and "\n" not in e.value.code
    assert not (tmp_path / "mcp").exists()
    bench = load_script("lab/bench.py")
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", "smollm2"])
    assert e.value.code.startswith("error: lab/bench.py measures GPU runs") and "\n" not in e.value.code



def test_share_here_gives_vllm_the_h100s_memory_on_any_gpu(monkeypatch):
    # lab/capped.py's share_here: the capped figures' vLLM shares were set on an 80 GB H100 (81,079 MiB
    # as torch counts it); on a 141 GB H200 (143,155 MiB) the same memory is a smaller share
    capped, tables = load_script("lab/capped.py"), load_script("lab/bench.py").bench_tables
    h100, h200 = 81_079 * 2**20, 143_155 * 2**20
    assert [capped.share_here(s, h100) for _, s in tables.CARDS.values()] == [0.17, 0.175]  # the table's own
    assert capped.share_here(0.17, h200) == 0.096 and capped.share_here(0.175, h200) == 0.099
    assert abs(capped.share_here(0.17, h200) * h200 - 0.17 * h100) < 0.002 * h200  # the same GiB, to the rounding
    assert tables.share_here.__module__ == tables.PeakMemory.__module__ == "capped"  # the tables use these, not copies
    # the hog: all the free memory but the cap, or one error line naming both when no more is free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (40 * 2**30, h100))
    with pytest.raises(SystemExit, match=r"^error: 40.0 GiB free, not more than the 45 GiB cap$"):
        capped.hold_all_but(45)
    made = []
    monkeypatch.setattr(torch, "empty", lambda n, **kw: made.append((n, kw)))
    capped.hold_all_but(39)
    assert made == [(1 * 2**30, {"dtype": torch.uint8, "device": "cuda"})]

def test_quant_table_rows_take_ratios_against_their_own_bf16_engine():
    # lab/bench_tables.py: each engine's tok/s and sync over the same model's bf16 row; a column that
    # was not measured (the skipped-sync check needs --skip-check) prints "-", never "nan"
    tables = load_script("lab/bench.py").bench_tables
    row = lambda m, q, tps, ms: dict(model=m, quant=q, tok_s=tps, sync_ms=ms, quant_ms=0.0, dlogp_mean=0.1,  # noqa: E731
                                     dlogp_p95=0.2, threshold=0.3)
    rows = tables.with_ratios([row("a", "none", 100.0, 10.0), row("a", "fp8", 75.0, 15.0), row("b", "int8", 50.0, 5.0)])
    assert [r["tok_s_ratio"] for r in rows[:2]] == [1.0, 0.75] and rows[1]["sync_ratio"] == 1.5
    assert rows[2]["tok_s_ratio"] != rows[2]["tok_s_ratio"]  # no bf16 row for b: nan, not another model's
    text = tables.quant_markdown(rows[:2])
    assert "nan" not in text and text.splitlines()[3].endswith("| - | - |")
    rows[1].update(skipped_dlogp=2.5, resynced_dlogp=0.12)
    assert tables.quant_markdown(rows[:2]).splitlines()[3].endswith("| 2.500 (0.3) | 0.120 |")


def test_top_p_below_one_refuses_engine_logprobs_as_the_old_policy(capsys):
    # top-p samples from a truncated distribution; the trainer's logprobs are the full one's: the ratio
    # with the engine's logprobs is biased, so TIS and --old-logprobs rollout refuse it
    gpu = ["--model", "x", "--gpu", "h100", "--engine", "vllm", "--top-p", "0.9"]
    for extra, flag in ((["--tis-cap", "2", "--old-logprobs", "recompute"], "--tis-cap"),
                        (["--rollout-quant", "fp8"], "--tis-cap (2 by default with --rollout-quant)"),
                        (["--old-logprobs", "rollout"], "--old-logprobs rollout")):
        with pytest.raises(SystemExit):
            train.parse_args(gpu + extra)
        assert f"--top-p 0.9 with {flag}: top-p samples from a truncated distribution" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "x", "--top-p", "0.9", "--old-logprobs", "rollout"])  # the HF engine too
    assert "importance ratio is biased" in capsys.readouterr().err
    # the defaults steer clear: the HF engine's default old logprobs become the trainer's own
    assert train.parse_args(["--model", "x", "--top-p", "0.9"]).old_logprobs == "detach"
    assert train.parse_args(["--model", "x"]).old_logprobs == "rollout"
    assert train.parse_args(gpu + ["--ppo-epochs", "2"]).old_logprobs == "recompute"
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "x", "--top-p", "0"])


@pytest.mark.parametrize("algo", ["grpo", "reinforce++"])
@pytest.mark.parametrize("level", ["token"])
def test_tis_mask_mode_drops_rejected_tokens_everywhere(tiny_tokenizer, algo, level):
    # --tis-mode mask: a rejected token (sequence) changes nothing: the update, the loss, KL and
    # entropy equal those of the same batch with that token's (sequence's) loss_mask 0
    import copy
    from conftest import make_tiny_model
    from score import sequence_logprobs
    from rollout import episodes_to_batch
    eps = _random_episodes(3)
    batch = episodes_to_batch(eps, tiny_tokenizer.pad_token_id)
    with torch.no_grad():  # the rollout logprobs: the trainer's own (ratio 1, kept) ...
        lp, _ = sequence_logprobs(make_tiny_model(tiny_tokenizer), batch["input_ids"], batch["attention_mask"])
    for i, e in enumerate(eps):
        P = len(e.prompt_ids)
        e.logprobs = lp[i, P - 1:P - 1 + len(e.response_ids)].tolist()
    rejected = copy.deepcopy(eps)
    rejected[4].logprobs[2] -= 5.0  # ... but one token's: ratio e^5 > C = 2, rejected
    dropped = copy.deepcopy(eps)
    dropped[4].response_mask = [1, 1, 0, 1, 1, 1, 1] if level == "token" else [0] * 7  # what mask mode must equal
    out = []
    for batch_eps in (rejected, dropped):
        args = train.parse_args(["--model", "x", "--micro-batch-size", "2", "--prompts-per-step", "2", "--n", "3",
                                 "--algo", algo, "--kl-coef", "0.1", "--old-logprobs", "recompute", "--tis-cap", "2",
                                 "--tis-mode", "mask", "--reduction", "token-mean", "--grad-clip", "0"])
        model = make_tiny_model(tiny_tokenizer)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)
        run = train.Run(args, model, opt, sched, ref_model=make_tiny_model(tiny_tokenizer, seed=1),
                        pad_id=tiny_tokenizer.pad_token_id)
        m = train.train_step(run, batch_eps,
                             {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0})
        out.append((m, {k: v.clone() for k, v in model.state_dict().items()}))
    (mr, wr), (md, wd) = out
    assert mr["tis_clip_frac"] > 0 and md["tis_clip_frac"] == 0  # one rejected, the other had none to reject
    for k in ("loss", "grad_norm", "kl", "entropy", "adv_abs_mean"):
        assert mr[k] == pytest.approx(md[k], rel=1e-6, abs=1e-9), k
    assert all(torch.allclose(wr[k], wd[k], atol=1e-7) for k in wr)


def test_openmp_threads_wait_passively_unless_told_otherwise():
    # spinning OpenMP waits cost a CPU step 1.4-1.6x beside other busy processes (train.py's comment):
    # train.py makes passive waiting the default before torch loads OpenMP; a value set by the user wins
    import subprocess
    code = "import os, train; print(os.environ['OMP_WAIT_POLICY'])"
    root = os.path.dirname(train.__file__)
    for given, want in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if given:
            env["OMP_WAIT_POLICY"] = given
        p = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert p.stdout.strip() == want, p.stderr[-2000:]


def test_resume_takes_the_saved_runs_flags(tmp_path, capsys):
    # --resume DIR without the run's flags continues the run that was saved (a --algo dapo run went on
    # as plain GRPO, with a note); a flag given again that differs from the saved one is named, in one
    # line; --steps, --out-dir and the eval and save cadence change without a word (config.RESUME_FREE)
    run = tmp_path / "run"
    step = run / "ckpt" / "step_000002"
    step.mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(b"")  # parse time reads the saved flags only
    saved = train.parse_args(["--model", "x", "--algo", "dapo", "--lr", "1e-3", "--max-tokens", "40", "--out-dir", str(run)])
    (step / "nanorl_config.json").write_text(json.dumps(vars(saved)))  # as support/checkpoint.save_run writes it
    capsys.readouterr()
    args = train.parse_args(["--resume", str(run)])
    assert vars(args) == {**vars(saved), "resume": str(run)}  # every flag, the derived ones too
    assert args.algo == "dapo" and args.dynamic_sampling and args.clip_high == 0.28 and args.overlong_buffer == 10
    assert capsys.readouterr().out == ""
    args = train.parse_args(["--resume", str(run), "--steps", "9", "--eval-every", "1", "--save-every", "2",
                             "--algo", "dapo", "--digits", "1", "--lr", "2e-3", "--tool-format", "auto"])
    assert capsys.readouterr().out.splitlines() == [f"--resume {run}: these flags override the saved run's: --lr 0.002 (saved 0.001)"]
    assert (args.lr, args.critic_lr, args.steps, args.eval_every, args.save_every) == (2e-3, 2e-2, 9, 1, 2)
    assert args.max_tokens == 40 and args.algo == "dapo"
    (step / "nanorl_config.json").unlink()  # a checkpoint without its flags: those given, and the defaults
    assert train.parse_args(["--model", "x", "--resume", str(run)]).algo == "grpo"


def test_negative_steps_are_refused(capsys):
    # --steps -3 ran nothing, exited 0 and wrote a checkpoint
    for steps in ("-3", "-1"):
        with pytest.raises(SystemExit):
            train.parse_args(["--model", "x", "--steps", steps])
        assert f"--steps {steps}: want a number of steps >= 1" in capsys.readouterr().err
    # 0 stays: the eval before training and a step-0 checkpoint, a baseline (lab/plot_runs.py, tests/test_eval.py)
    assert train.parse_args(["--model", "x", "--steps", "0"]).steps == 0


def test_a_missing_mcp_config_or_an_out_dir_that_is_a_file_fails_before_the_model(tiny_model_dir, tmp_path, monkeypatch):
    # both gave a bare "[Errno ...]" line naming no flag, --out-dir only once the model had loaded
    monkeypatch.setattr(train, "start", lambda *a, **kw: pytest.fail("a model loaded"))
    (tmp_path / "file").write_text("x")
    for out_dir in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(SystemExit) as e:
            train.cli(_argv(tiny_model_dir, out_dir))
        assert e.value.code == f"error: --out-dir {out_dir}: {tmp_path / 'file'} is a file, not a folder"
    with pytest.raises(SystemExit) as e:
        train.cli(_argv(tiny_model_dir, tmp_path / "run", "--env", "mcp", "--mcp-config", str(tmp_path / "none.json")))
    assert e.value.code == f"error: --mcp-config {tmp_path / 'none.json'}: file not found"
    assert not (tmp_path / "run").exists()


def test_the_preset_line_shows_this_runs_values(tiny_model_dir, tmp_path, monkeypatch, capsys):
    # it printed the preset's values ("steps": 6 after --steps 12): now this run's for the preset's keys,
    # then those that are not the preset's, with the preset's value
    class Stop(Exception):
        pass

    monkeypatch.setattr(train, "start", lambda *a, **kw: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        train.main(_argv(tiny_model_dir, tmp_path, "--steps", "12"))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("preset "))
    values, other = line.split(" ", 3)[3].split("; not the preset's: ")
    assert line.startswith("preset cpu multiply {") and set(json.loads(values)) == set(config.PRESETS["cpu"])
    assert json.loads(values)["steps"] == 12 and json.loads(values)["n"] == 3 and json.loads(values)["engine"] == "hf"
    assert "steps (6)" in other and "n (4)" in other and "engine" not in other


def test_resume_continues_in_the_resumed_run_folder(tiny_model_dir, tmp_path, toy_env, monkeypatch):
    # --resume DIR without --out-dir continues in DIR (a run folder, or a step folder inside its ckpt/),
    # even with a runs/nanorl beside it; the config shows the folder used; neither flag: runs/nanorl
    monkeypatch.chdir(tmp_path)
    argv = [a for a in _argv(tiny_model_dir, "x") if a not in ("--out-dir", "x")]
    assert train.parse_args(argv).out_dir == "runs/nanorl"
    train.main(argv + ["--steps", "1"])  # the default folder holds a run now
    run = tmp_path / "mine"
    train.main(_argv(tiny_model_dir, run, "--steps", "1"))
    step1 = checkpoint.find_checkpoint(run)
    assert train.parse_args(argv + ["--resume", str(step1)]).out_dir == str(run)
    res = train.main(argv + ["--steps", "2", "--resume", str(run)])
    assert res["step"] == 2 and res["checkpoint"] == str(run / "ckpt" / "step_000002")
    assert json.loads((run / "ckpt" / "step_000002" / "nanorl_config.json").read_text())["out_dir"] == str(run)
    assert [json.loads(m)["step"] for m in open(run / "metrics.jsonl")] == [1, 2]
    assert [json.loads(m)["step"] for m in open(tmp_path / "runs" / "nanorl" / "metrics.jsonl")] == [1]
    res = train.main(argv + ["--steps", "3", "--resume", str(run / "ckpt" / "step_000002")])  # a step folder
    assert res["checkpoint"] == str(run / "ckpt" / "step_000003")
    import shutil
    shutil.copytree(run / "ckpt" / "step_000003", tmp_path / "best")  # outside a run: where to write is unclear
    with pytest.raises(SystemExit):
        train.parse_args(argv + ["--resume", str(tmp_path / "best")])
    assert train.parse_args(argv + ["--resume", str(tmp_path / "best"), "--out-dir", "new"]).out_dir == "new"


def test_tis_cap_defaults_old_logprobs_to_recompute():
    # README's `python train.py --algo dapo --loss ppo --tis-cap 2` on the CPU preset (HF engine: rollout default)
    args = train.parse_args(["--algo", "dapo", "--loss", "ppo", "--tis-cap", "2"])
    assert args.old_logprobs == "recompute" and args.tis_cap == 2
    assert train.parse_args([]).old_logprobs == "rollout"


def test_kl_cov_check_counts_updates_not_tis():
    # one update on the whole batch: the KL-Cov term is 0 with or without TIS (TIS is no second update)
    for extra in ([], ["--tis-cap", "2"], ["--tis-cap", "2", "--old-logprobs", "recompute"]):
        with pytest.raises(SystemExit):
            train.parse_args(["--model", "x", "--loss", "kl-cov", *extra])
    for extra in (["--ppo-epochs", "2"], ["--mini-batch-size", "4"]):  # 8 prompts x 4 = 32 episodes a step
        assert train.parse_args(["--model", "x", "--loss", "kl-cov", *extra]).loss == "kl-cov"


def test_a_missing_model_path_fails_at_once_without_the_hub(tmp_path, monkeypatch):
    import time
    from support import sources
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for name in ("./nope", str(tmp_path / "runs" / "sft"), "runs/sft", "~/no-such-nanorl-model"):
        t = time.perf_counter()
        with pytest.raises(FileNotFoundError, match="no such folder") as e:
            sources.load_tokenizer(sources.model_source(name), name)
        assert time.perf_counter() - t < 5 and name in str(e.value) and "\n" not in str(e.value)
    assert sources.model_source("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"  # a hub id stays one


def test_building_a_model_folder_leaves_the_seeded_rngs_alone(tiny_model_dir, tmp_path, monkeypatch):
    # the first run on an empty cache builds the model folder after seeding: it must sample as later runs do
    import random
    import numpy as np
    from support import sources
    monkeypatch.setenv("NANORL_CACHE", str(tmp_path))
    monkeypatch.setenv("SMOLLM2_DIR", tiny_model_dir)  # the shape's tokenizer comes from the embedded model
    monkeypatch.setitem(sources.SHAPES, "random-qwen2.5-tiny", dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, tie_word_embeddings=True, vocab_size=300))
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    src = sources.model_source("random-qwen2.5-tiny")
    assert os.path.isfile(os.path.join(src, "config.json"))
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()


def test_second_ctrl_c_stops_with_one_line():
    with checkpoint.CtrlC() as c:
        c.handler(signal.SIGINT, None)
        assert c.stop
        with pytest.raises(KeyboardInterrupt) as e:
            c.handler(signal.SIGINT, None)
    msg = str(e.value)
    assert msg.startswith("Ctrl-C twice") and "\n" not in msg


@pytest.mark.parametrize("loss", ["clip-cov", "kl-cov"])
def test_covariance_losses_skip_no_row(tiny_tokenizer, loss):
    # Clip-Cov's and KL-Cov's covariance terms reach rows whose advantage is 0 (and their means are over
    # every row of the micro-batch, as verl's), so no row is skipped; PPO's zero-advantage rows are
    from conftest import make_tiny_model
    eps = _random_episodes(3, reward=lambda i: 1.0 if i < 3 else float(i - 3))  # group 0: equal rewards, A = 0
    fracs = {}
    for name in (loss, "ppo"):
        args = train.parse_args(["--model", "x", "--micro-batch-size", "2", "--prompts-per-step", "2", "--n", "3",
                                 "--loss", name, "--ppo-epochs", "2", "--old-logprobs", "recompute"])
        model = make_tiny_model(tiny_tokenizer)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        run = train.Run(args, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0),
                        pad_id=tiny_tokenizer.pad_token_id)
        fracs[name] = train.train_step(run, eps, {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0})["live_frac"]
    assert fracs[loss] == 1.0 and fracs["ppo"] < 1.0


def test_overlong_punishment_reads_the_longest_turn(monkeypatch):
    # --max-tokens caps a turn: a two-turn episode of 16 + 16 sampled tokens at --max-tokens 24 (buffer 6:
    # the punishment starts past 18) is not punished; one turn of 22 tokens is, by (22 - 18) / 6
    from rollout import Episode
    args = train.parse_args(["--model", "x", "--algo", "dapo", "--max-tokens", "24", "--overlong-buffer", "6",
                             "--prompts-per-step", "1", "--n", "2"])

    class Engine:
        def wake(self): pass
        def sleep(self): pass
        def load_weights(self, model): return {}

    def two_episodes(run, rows, n, temperature, group_ids=None):
        g = group_ids[0]
        return [Episode([1], [7] * 35, [1] * 16 + [0] * 3 + [1] * 16, [0.0] * 35, 1.0, "stop", g),
                Episode([1], [7] * 22, [1] * 22, [0.0] * 22, 0.0, "stop", g)]
    monkeypatch.setattr(train, "rollouts", two_episodes)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = train.Run(args, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0), engine=Engine())
    row = {"data_source": "t", "prompt": [{"role": "user", "content": "q"}], "reward_spec": {"ground_truth": "1"}}
    kept, sampled, _, _ = train.collect(run, [row], {"step": 0, "data": {"epoch": 0, "pos": 0}})
    assert [e.info["overlong_penalty"] for e in sampled] == pytest.approx([0.0, -4 / 6])
    assert [e.longest_turn() for e in sampled] == [16, 22]


def test_a_second_ctrl_c_is_one_line_not_a_traceback(monkeypatch):
    # support/checkpoint.CtrlC raises KeyboardInterrupt on the second Ctrl-C; `python train.py` says so in one line
    def interrupted(argv=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "main", interrupted)
    with pytest.raises(SystemExit, match="^interrupted: .*--resume"):
        train.cli([])



# ---- --rescue (options/rescue.py): all-wrong groups re-sampled with oracle calls as a plan or a masked prefix

def test_rescue_spec_parses_and_names_the_bad_part(capsys):
    own = {"baseline": "joint", "source": "oracle", "branch": 0.0, "probe": 0.0, "told": False, "replay": 0, "narrow": 0}  # defaults: one baseline over a guided group and its own; the rows' plans
    assert rescue.parse("") == {"hint": 0, "credit": 0.0, "guide": "plan", **own}
    assert rescue.parse("hint=15") == {"hint": 15, "credit": 0.0, "guide": "plan", **own}
    assert rescue.parse("credit=0.1") == {"hint": 0, "credit": 0.1, "guide": "plan", **own}
    assert rescue.parse("hint=15,credit=0.1") == rescue.parse(" credit=0.1 , hint=15 ") == {"hint": 15, "credit": 0.1, "guide": "plan", **own}
    assert rescue.parse("guide=prefix,hint=3") == {"hint": 3, "credit": 0.0, "guide": "prefix", **own}
    assert rescue.parse("hint=3,guide=tiers")["guide"] == "tiers"
    assert rescue.parse("hint=3,baseline=own") == {"hint": 3, "credit": 0.0, "guide": "plan", "baseline": "own", "source": "oracle", "branch": 0.0, "probe": 0.0, "told": False,
                                                "replay": 0, "narrow": 0}
    assert rescue.parse("hint=3,source=answer+similar,branch=0.5")["branch"] == 0.5
    with pytest.raises(ValueError, match="branch= .* needs source=answer"):
        rescue.parse("hint=3,branch=0.5")  # the oracle's plans: no answer-hinted group to start again
    assert [rescue.parse(f"hint=3,source={v}")["source"] for v in rescue.SOURCES] == list(rescue.SOURCES)
    for bad, part in (("hint", "hint"), ("hint=x", "hint=x"), ("hint=-1", "hint=-1"), ("hint=1.5", "hint=1.5"),
                      ("credit=nan", "credit=nan"), ("credit=-0.1", "credit=-0.1"), ("credit=1", "credit=1"),
                      ("guide=prompt", "guide=prompt"), ("hint=2,guide=plan,guide=prefix", "guide=prefix"),
                      ("hint=15;credit=0.1", "hint=15;credit=0.1"), ("hints=3", "hints=3"), ("hint=1,hint=2", "hint=2"),
                      ("baseline=group", "baseline=group"), ("baseline=", "baseline="), ("source=self", "source=self"),
                      ("source=found,source=answer", "source=answer"), ("source=answer,branch=0", "branch=0"),
                      ("source=answer,branch=1.5", "branch=1.5"), ("source=answer,branch=nan", "branch=nan")):
        with pytest.raises(ValueError, match="--rescue") as e:
            rescue.parse(bad)
        assert repr(part) in str(e.value), bad
    # the flag: not given (None: train.setup decides, below), off, or a spec, checked at parse time (one line, exit 2)
    assert train.parse_args([]).rescue is None and train.parse_args(["--rescue", "hint=15"]).rescue == "hint=15"
    assert train.parse_args(["--rescue", "off"]).rescue == "" and rescue.parse("off") == rescue.parse("")
    with pytest.raises(SystemExit):
        train.parse_args(["--rescue", "hint=soon"])
    assert "--rescue" in capsys.readouterr().err


def test_rescue_default_is_the_answer_hint_for_rows_without_oracle_calls():
    # a user's rows (a question and an answer) get hint=3 x steps,source=answer+similar,branch=0.5; rows with
    # oracle calls (the bundled tasks) or without any answer keep it off
    asked = [{"prompt": [{"role": "user", "content": "q"}], "reward_spec": {"ground_truth": {"answer": "7", "type": "number"}}}]
    assert rescue.default_spec(asked, 40) == "hint=120,source=answer+similar,branch=0.5"
    keyed = asked + [{**asked[0], "extra_info": {"oracle_calls": [{"name": "t", "arguments": {}}]}}]
    assert rescue.default_spec(keyed, 40) == "" and rescue.default_spec([{**asked[0], "reward_spec": {}}], 40) == ""
    spec = rescue.parse(rescue.default_spec(asked, 40))
    assert spec["hint"] == 120 and spec["source"] == "answer+similar" and spec["branch"] == 0.5


def test_rescue_flag_replaces_log_samples_and_the_flag_count_holds(capsys):
    p = config.Parser()
    config.add_flags(p)
    flags = [a for a in p._actions if any(s.startswith("--") for s in a.option_strings) and "--help" not in a.option_strings]
    assert len(flags) == 75  # the flag count does not grow
    with pytest.raises(SystemExit):
        train.parse_args(["--log-samples", "3"])
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    algo = out[out.index("\nadvanced: algorithm (grpo.py):"):out.index("\nadvanced: sampling:")]
    assert "--rescue SPEC" in algo and "--log-samples" not in out


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.integers(0, 200), st.integers(0, 100), st.integers(0, 12))
def test_hint_calls_decay_to_zero(step, steps, most):
    k = rescue.hint_calls(step, steps, most)
    assert 0 <= k <= most  # never more than the calls that may be given
    assert rescue.hint_calls(step + 1, steps, most) <= k  # non-increasing over training
    if step >= steps:
        assert k == 0
    if step == 0 and steps > 0:
        assert k == most  # from the start: all that may be given
    if 0 < step < steps and most > 0:  # ceil(share x most): some call given while share > 0
        assert k >= 1


def test_hint_calls_by_hand():
    # at most 3 calls, 15 steps: share 1, 2/3, 1/3, 1/15, 0 -> ceil(3 share) = 3, 2, 1, 1, 0 (2/3 x 3 is exactly 2)
    assert [rescue.hint_calls(s, 15, 3) for s in (0, 5, 10, 14, 15, 99)] == [3, 2, 1, 1, 0, 0]
    assert rescue.hint_calls(0, 0, 4) == rescue.hint_calls(0, 10, 0) == 0


def _ep(group, correct, reward=0.0):
    from rollout import Episode
    return Episode([1, 2], [3], [1], [-0.5], reward, "stop", group, {"correct": correct})


def _oracle_row(q, calls):
    return {"prompt": [{"role": "user", "content": q}],
            "extra_info": {"oracle_calls": [{"name": f"t{j}", "arguments": {"x": j}} for j in range(calls)]}}


def played(batch_rows):
    """The rows guide() sampled, less the hint turns a guide=prefix row carries (rescue.hint_row)."""
    return [{k: v for k, v in r.items() if k != "hints"} for r in batch_rows]


def test_guide_resamples_only_all_wrong_groups_with_oracle_calls():
    rows = {0: _oracle_row("one pass", 3), 1: _oracle_row("all wrong", 3), 2: {"prompt": [{"role": "user", "content": "no oracle"}]},
            3: _oracle_row("one call", 1), 5: _oracle_row("all wrong too", 4), 7: _oracle_row("dropped this step", 3)}
    eps = [_ep(0, False), _ep(0, True), _ep(1, False), _ep(1, False), _ep(2, False), _ep(2, False),
           _ep(3, False), _ep(3, False), _ep(5, False), _ep(5, False)]
    calls = []

    def sample(batch_rows, group_ids):
        calls.append((played(batch_rows), group_ids, [r.get("hints") for r in batch_rows]))
        return [_ep(g, j == 0 and g == group_ids[0], 0.5) for g in group_ids for j in range(2)]  # the first solved

    render = lambda name, arguments: f"<call {name} {json.dumps(arguments)}>"  # noqa: E731
    prefix = {"hint": 15, "credit": 0.0, "guide": "prefix"}
    out, m, _ = rescue.guide(eps, rows, 5, prefix, render, sample)
    (batch_rows, ids, hints), = calls  # one call for every guided group
    assert batch_rows == [rows[1], rows[5]]
    # step 5 of 15: share 2/3 -> ceil(2/3 x 2) = 2 of 3 calls, ceil(2/3 x 3) = 2 of 4
    assert hints == [['<call t0 {"x": 0}>', '<call t1 {"x": 1}>'], ['<call t0 {"x": 0}>', '<call t1 {"x": 1}>']]
    assert len(set(ids)) == 2 and not set(ids) & (set(rows) | {e.group for e in eps})
    assert [e.group for e in out] == [0, 0, ids[0], ids[0], 2, 2, 3, 3, ids[1], ids[1]]  # replaced in place
    assert [e.info["hint_for"] for e in out[2:4] + out[8:]] == [1, 1, 5, 5]  # the group each replays
    assert all(a is b for a, b in zip(out[:2] + out[4:8], eps[:2] + eps[4:8]))  # the others untouched
    assert m == {"rescue_groups": 2, "rescue_solved": 0.5, "rescue_hint_turns": 2.0}
    # at step 0 every call but the last is given
    calls.clear()
    rescue.guide(eps, rows, 0, prefix, render, sample)
    assert [len(h) for h in calls[0][2]] == [2, 3]
    # nothing to guide: no call, the same list, no rescue_solved
    for step, steps in ((15, 15), (0, 0)):
        calls.clear()
        out, m, _ = rescue.guide(eps, rows, step, {**prefix, "hint": steps}, render, sample)
        assert calls == [] and out == eps and m == {"rescue_groups": 0, "rescue_hint_turns": 0.0}


def test_guide_plan_puts_the_calls_in_the_prompt_and_trains_without_them():
    rows = {0: _oracle_row("all wrong", 3), 1: _oracle_row("one call", 1), 2: _oracle_row("one pass", 2)}
    rows[0]["prompt"] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "all wrong, x=0"}]
    before = json.dumps(rows)
    eps = [_ep(0, False), _ep(0, False), _ep(1, False), _ep(1, False), _ep(2, True), _ep(2, False)]
    for e in eps:
        e.prompt_ids = [10 + e.group, 20]  # each group's unguided prompt
    calls = []

    def sample(batch_rows, group_ids):
        calls.append((played(batch_rows), group_ids, [r.get("hints") for r in batch_rows]))
        return [_ep(g, j == 0, 0.5) for g in group_ids for j in range(2)]  # guided prompts: [1, 2]

    render = lambda name, arguments: f"<call {name} {json.dumps(arguments)}>"  # noqa: E731
    spec = rescue.parse("hint=15,baseline=own")
    out, m, shown = rescue.guide(eps, rows, 5, spec, render, sample)
    (batch_rows, ids, hints), = calls
    assert shown == out[:4] and not any("not_trained" in e.info for e in shown)
    assert hints == [None, None] and json.dumps(rows) == before  # a plan, not played turns; the rows untouched
    # step 5 of 15, share 2/3: ceil(2/3 x 3) = 2 of 3 calls; the one-call row gets its whole plan (ceil(2/3) = 1)
    assert [r["prompt"][:-1] for r in batch_rows] == [rows[0]["prompt"][:-1], []]
    asked = [r["prompt"][-1]["content"] for r in batch_rows]
    assert asked[0].startswith("all wrong, x=0\n\nHint:") and "2 tool calls (of 3)" in asked[0]
    one = plans.plan_row(rows[0], [("t0", {"x": 0})], 3, "<call>")["prompt"][-1]["content"]
    assert "starts with this tool call (of 3), in this order:\n1. t0" in one
    # a value the prompt states is shown; one it does not (a result would give it) is a placeholder
    assert '\n1. t0 {"x": 0}\n2. t1 {"x": "<x>"}\n' in asked[0] and "t2" not in asked[0]
    assert asked[1].startswith("one call\n\nHint:") and "then the answer" in asked[1] and '\n1. t0 {"x": "<x>"}\n' in asked[1]
    # the calls named, numbered; only call 1 written as the model writes it (all of them so were copied
    # whole into one turn), once, after "Make only call 1 now"
    for a, first in zip(asked, ('<call t0 {"x": 0}>', '<call t0 {"x": "<x>"}>')):
        assert a.count("<call") == 1 and f"Make only call 1 now, written so:\n{first}\nand each next call" in a
    assert [e.group for e in out] == [ids[0], ids[0], ids[1], ids[1], 2, 2]
    assert [e.prompt_ids for e in out[:4]] == [[10, 20], [10, 20], [11, 20], [11, 20]]  # trained without the plan
    assert [(e.info["hint_for"], e.info["plan_calls"]) for e in out[:4]] == [(0, 2), (0, 2), (1, 1), (1, 1)]
    assert m == {"rescue_groups": 2, "rescue_solved": 1.0, "rescue_hint_turns": 1.5}
    # a guided group with no pass is not trained: the unguided group stays (guide=prefix keeps the guided one)
    unsolved = lambda batch_rows, group_ids: [_ep(g, False, -0.2 * j) for g in group_ids for j in range(2)]  # noqa: E731
    out, m, shown = rescue.guide(eps, rows, 5, spec, render, unsolved)
    assert out == eps and m["rescue_solved"] == 0.0 and m["rescue_groups"] == 2
    assert [(e.info["hint_for"], e.info["not_trained"]) for e in shown] == [(0, True)] * 2 + [(1, True)] * 2  # still logged
    out, _, _ = rescue.guide(eps, rows, 5, {**spec, "guide": "prefix"}, render, unsolved)
    assert [e.info.get("hint_for") for e in out[:2]] == [0, 0]
    # the same step with guide=prefix leaves the one-call row alone (the policy makes the last call)
    calls.clear()
    rescue.guide(eps, rows, 5, {**spec, "guide": "prefix"}, render, sample)
    assert calls[0][0] == [rows[0]] and calls[0][2] == [['<call t0 {"x": 0}>', '<call t1 {"x": 1}>']]


def test_a_plan_shows_only_the_values_its_prompt_states():
    prompt = [{"role": "system", "content": "Use tools."},
              {"role": "user", "content": "How much do 8 units of 'Oak Whisk' cost in gbp? Key 'marathon_distance_km', to mi; 3.5 kg"}]
    shown = plans.unstated({"query": "Oak Whisk", "to_currency": "GBP", "n": 8, "whole": 8.0, "x": 3.5, "key": "marathon_distance_km",
                            "from_unit": "km", "to_unit": "mi", "customer_id": 1, "amount": 56.13, "from_currency": "USD",
                            "part": 3, "word": "Oak", "flag": True, "empty": ""}, prompt)
    assert shown == {"query": "Oak Whisk", "to_currency": "GBP", "n": 8, "whole": 8.0, "x": 3.5, "key": "marathon_distance_km",
                     "from_unit": "km", "to_unit": "mi", "customer_id": "<customer_id>", "amount": "<amount>",
                     "from_currency": "<from_currency>", "part": "<part>",  # 3 of 3.5 is not a stated 3
                     "word": "Oak", "flag": "<flag>", "empty": "<empty>"}
    assert plans.unstated({"to_unit": "m"}, prompt) == {"to_unit": "<to_unit>"}  # not inside "marathon" or "mi"
    said = [{"role": "user", "content": "Convert 127.0 h; how much is 549.80 GBP?"}]
    assert plans.unstated({"value": 127.0, "v": 127, "amount": 549.8, "w": 549}, said) == {"value": 127.0, "v": 127, "amount": 549.8, "w": "<w>"}
    from mcp_tools.rewards import NUMBER
    assert plans.NUMBER == NUMBER.pattern  # the plan and rewards.invented read numbers alike (options/ imports no mcp_tools/)


def test_guide_tiers_adds_a_call_while_the_group_stays_all_wrong():
    rows = {0: _oracle_row("passes with two", 3), 1: _oracle_row("never passes", 3), 2: _oracle_row("one pass", 3)}
    eps = [_ep(0, False), _ep(0, False), _ep(1, False), _ep(1, False), _ep(2, True), _ep(2, False)]
    for e in eps:
        e.prompt_ids = [10 + e.group]
    calls = []

    def sample(batch_rows, group_ids):  # a row passes once its plan holds two calls, except "never passes"
        planned = [len(re.findall(r"^\d+\. t\d ", r["prompt"][-1]["content"], re.M)) for r in batch_rows]  # its plan's lines
        calls.append([(r["prompt"][-1]["content"].split("\n")[0], k) for r, k in zip(batch_rows, planned)])
        return [_ep(g, j == 0 and k >= 2 and "never" not in r["prompt"][-1]["content"])
                for r, g, k in zip(batch_rows, group_ids, planned) for j in range(2)]

    render = lambda name, arguments: f"<call {name} {json.dumps(arguments)}>"  # noqa: E731
    out, m, shown = rescue.guide(eps, rows, 0, rescue.parse("hint=15,guide=tiers,baseline=own"), render, sample)
    assert calls == [[("passes with two", 1), ("never passes", 1)], [("passes with two", 2), ("never passes", 2)],
                     [("never passes", 3)]]  # one call, then one more while all wrong, up to the whole plan
    assert [e.info["plan_calls"] for e in out[:2]] == [2, 2] and [e.prompt_ids for e in out[:2]] == [[10]] * 2
    assert [e.info["correct"] for e in out[:2]] == [True, False] and not {e.group for e in out[:2]} & {0, 1, 2}
    assert out[2:] == eps[2:]  # "never passes": no tier reached a reward, so its unguided group stays
    assert m == {"rescue_groups": 2, "rescue_solved": 0.5, "rescue_hint_turns": 2.5, "rescue_rounds": 3}
    assert shown[:2] == out[:2] and [(e.info["plan_calls"], e.info.get("not_trained")) for e in shown[2:]] == [(3, True)] * 2
    calls.clear()  # step 14 of 15: at most ceil(3 / 15) = 1 call, so one round
    out, m, _ = rescue.guide(eps, rows, 14, rescue.parse("hint=15,guide=tiers,baseline=own"), render, sample)
    assert calls == [[("passes with two", 1), ("never passes", 1)]] and m["rescue_rounds"] == 1


def test_guide_joint_adds_a_passing_guided_group_to_its_unguided_one():
    # baseline=joint: a guided group that passes joins the all-wrong group it replays (one id, 2n episodes),
    # one that does not is not trained, under every guide; baseline=own replaces as before
    rows = {0: _oracle_row("all pass guided", 2), 1: _oracle_row("one pass", 2), 2: _oracle_row("none guided", 2)}
    eps = [_ep(0, False, 0.0), _ep(0, False, -0.2), _ep(1, True, 1.0), _ep(1, False), _ep(2, False), _ep(2, False)]
    for e in eps:
        e.prompt_ids = [10 + e.group]

    def sample(batch_rows, group_ids):  # "all pass guided": both guided episodes pass; "none guided": none
        return [_ep(g, "all pass" in r["prompt"][-1]["content"], 1.0 if "all pass" in r["prompt"][-1]["content"] else -0.2)
                for r, g in zip(batch_rows, group_ids) for _ in range(2)]

    render = lambda name, arguments: f"<call {name} {json.dumps(arguments)}>"  # noqa: E731
    for guide in ("plan", "tiers", "prefix"):
        spec = rescue.parse(f"hint=15,guide={guide},baseline=joint")
        out, m, shown = rescue.guide(eps, rows, 0, spec, render, sample)
        assert out[:2] == eps[:2] and out[4:6] == eps[2:4] and out[6:] == eps[4:], guide  # every unguided group stays
        assert [e.group for e in out] == [0, 0, 0, 0, 1, 1, 2, 2] and [e.info["hint_for"] for e in out[2:4]] == [0, 0]
        assert [e.info.get("not_trained") for e in shown] == [None, None, True, True]  # "none guided": logged only
        assert m["rescue_joined"] == 2 and m["rescue_solved"] == 0.5
        # one baseline over the four: the unguided episodes fall below the guided passes, which rise although
        # every guided episode passed (own group: A = 0 for both)
        adv = grpo.grpo_advantages(torch.tensor([e.reward for e in out]), torch.tensor([e.group for e in out]))
        assert (adv[:2] < 0).all() and (adv[2:4] > 0).all() and adv[4] > 0 > adv[5] and (adv[6:] == 0).all()
    own, m_own, _ = rescue.guide(eps, rows, 0, rescue.parse("hint=15,baseline=own"), render, sample)
    assert len(own) == 6 and own[2:] == eps[2:] and own[0].group not in rows and "rescue_joined" not in m_own
    adv = grpo.grpo_advantages(torch.tensor([e.reward for e in own]), torch.tensor([e.group for e in own]))
    assert (adv[:2] == 0).all()  # the guided passes teach nothing on their own


def test_guide_skips_rows_whose_oracle_calls_it_cannot_use(monkeypatch, capsys):
    # rows that did not come through a checked file (support/rows.py drops bad oracle_calls at load), or
    # whose calls name a tool the servers do not offer: not guided, never a crash (a string's calls
    # raised TypeError: string indices must be integers)
    monkeypatch.setattr(plans, "_UNKNOWN_SAID", set())
    bad = ["abc", 7, ["a"], {"name": "t0", "arguments": {}}, [{"name": "t0"}], [{"name": "t0", "arguments": ["x"]}],
           [{"name": "t0", "arguments": "x"}], [{"name": 5, "arguments": {}}], [{"name": "t0", "arguments": {}}] * 17]
    rows = {0: _oracle_row("good", 2), **{g: {**_oracle_row(f"bad {g}", 0), "extra_info": {"oracle_calls": c}}
                                           for g, c in enumerate(bad, 1)}}
    rows[len(rows)] = {**_oracle_row("extra_info a list", 0), "extra_info": ["x"]}
    rows[len(rows)] = {**_oracle_row("not JSON", 0), "extra_info": {"oracle_calls": [{"name": "t0", "arguments": {"x": {1, 2}}}]}}
    eps = [_ep(g, False) for g in rows for _ in range(2)]
    asked = []

    def sample(batch_rows, group_ids):
        asked.append([r["prompt"][-1]["content"].split("\n")[0] for r in batch_rows])
        return [_ep(g, True, 1.0) for g in group_ids for _ in range(2)]

    render = lambda name, arguments: f"<call {name}>"  # noqa: E731
    for guide in ("plan", "tiers", "prefix"):
        asked.clear()
        out, m, _ = rescue.guide(eps, rows, 0, rescue.parse(f"hint=10,guide={guide}"), render, sample)
        assert asked == [["good"]] and m["rescue_groups"] == 1 and len(out) == len(eps) + 2, guide
    assert [plans.usable_calls(rows[g]) for g in rows] == [rows[0]["extra_info"]["oracle_calls"]] + [[]] * (len(rows) - 1)
    system_only = {"prompt": [{"role": "system", "content": "sys"}], "extra_info": rows[0]["extra_info"]}
    assert plans.plan_row(system_only, [("t0", {})], 1, "<call t0>")["prompt"][0]["content"].startswith("sys\n\nHint:")
    # the servers' tool names (train.py passes the pool's): a row calling another tool is not guided, said once
    capsys.readouterr()
    assert rescue.guide(eps, rows, 0, rescue.parse("hint=10"), render, sample, tools={"t0", "t1"})[1]["rescue_groups"] == 1
    for _ in range(2):
        assert rescue.guide(eps, rows, 0, rescue.parse("hint=10"), render, sample, tools={"t0"})[1]["rescue_groups"] == 0
    said = capsys.readouterr().out
    assert said.count("WARNING") == 1 and "oracle_calls names 't1', no tool the servers offer" in said


class PlanPasses(envs.Env):
    """One turn, correct exactly when the prompt holds a --rescue plan: every unguided group is all wrong."""
    tools, max_turns = None, 1

    def reset(self, row):
        self.planned = "Hint:" in row["prompt"][-1]["content"]
        return [dict(m) for m in row["prompt"]]

    def step(self, text):
        return [], float(self.planned), True, {"correct": self.planned}


def test_rescue_run_over_malformed_oracle_calls_trains_to_its_last_step(tiny_model_dir, tmp_path, monkeypatch, capsys):
    # --rescue over a file whose rows' extra_info.oracle_calls take every malformed shape (each crashed
    # train.py at step 1, exit 1, no metrics), beside good rows: the bad ones are named file:line at load
    # and train unguided, the good ones are guided, and the run reaches its last step
    monkeypatch.setattr(train.envs, "env_for_row", lambda row, *a, **kw: PlanPasses())
    good = [{"name": "t0", "arguments": {"x": 1}}, {"name": "t1", "arguments": {}}]
    shapes = ["abc", 7, ["a", "b"], {"name": "t0", "arguments": {}}, [{"name": "t0"}], [{"name": "t0", "arguments": ["x"]}],
              [{"name": "t0", "arguments": "x"}], [{"name": 5, "arguments": {}}], good * 5000]  # the last: a 341 KB plan
    rows = [{**envs.multiply_rows(1, seed=i)[0], "extra_info": {"oracle_calls": c}} for i, c in enumerate([good, *shapes, good])]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = train.main(_argv(tiny_model_dir, tmp_path / "run", "--train-data", str(path), "--rescue", "hint=10",
                           "--prompts-per-step", str(len(rows)), "--n", "2", "--max-tokens", "4", "--max-context", "2048",
                           "--save-every", "-1"))  # byte tokens: the plan alone is ~500
    said = capsys.readouterr().out
    assert out["step"] == 2 and [h["step"] for h in out["history"]] == [1, 2]
    for line in range(2, 2 + len(shapes)):
        assert f"rows.jsonl:line {line}: extra_info.oracle_calls " in said, line
    assert f"dropped from {len(shapes)} rows" in said
    for h in out["history"]:  # the two good rows' groups, all wrong unguided, guided and joined (2 episodes each)
        assert h["rescue_groups"] == 2 and h["rescue_solved"] == 1.0 and h["rescue_joined"] == 4
    # extra_info itself not an object: the row is refused at load, naming its line, before any model loads
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[0], "extra_info": ["x"]}) + "\n")
    monkeypatch.setattr(train, "start", lambda *a, **kw: pytest.fail("a model loaded before the rows were checked"))
    with pytest.raises(ValueError, match=r"rows.jsonl:line 2: extra_info must be an object, got list"):
        train.main(_argv(tiny_model_dir, tmp_path / "run2", "--train-data", str(path), "--rescue", "hint=10"))


# ---- --rescue source=found|answer: rows without oracle calls (a question and its answer)

def _turns_episode(turns, group, correct):
    """An Episode whose response is the turns [(policy text, observation)], one token a character."""
    from rollout import Episode
    ids, mask = [], []
    for said, obs in turns:
        ids, mask = ids + [ord(c) for c in said + obs], mask + [1] * len(said) + [0] * len(obs)
    return Episode([0], ids, mask, [0.0] * len(ids), float(correct), "stop", group, {"correct": correct})


_CHARS = lambda ids: "".join(map(chr, ids))  # noqa: E731 -- the episodes' decode
_CALLS = lambda text: [json.loads(m) for m in re.findall(r"<call>(.*?)</call>", text)]  # noqa: E731 -- their parse


def _call(tool, /, **arguments):
    return "<call>" + json.dumps({"name": tool, "arguments": arguments}) + "</call>"


def _answer_row(answer="91.08"):
    return {"prompt": [{"role": "user", "content": "What is Ann's last order in EUR?"}],
            "reward_spec": {"method": "rule", "ground_truth": {"answer": answer, "type": "number", "check": []}}}


def test_shows_and_found_calls_read_what_a_result_showed_before_the_policy_wrote_it():
    assert plans.shows("total 91.0812 EUR", "91.08") and not plans.shows("total 91.1", "91.08")
    assert plans.shows("336.2082687858822", "336.2082")  # cut, not rounded: within the reward's tolerance all the same
    assert plans.shows('{"n": 17}', "17") and not plans.shows("170 rows", "17") and not plans.shows("1.7", "17")
    assert plans.shows("It was a Tuesday.", "tuesday") and not plans.shows("Tuesdays", "Tuesday")
    lookups = [(_call("find", name="Ann"), "{'id': 7}"), (_call("orders", id=7), "[99.0]"),
               (_call("convert", amount=99.0), "91.08 EUR")]
    passed = _turns_episode(lookups + [("<answer>91.08</answer>", "")], 0, True)
    assert [c["name"] for c in plans.found_calls(passed, "91.08", _CHARS, _CALLS)] == ["find", "orders", "convert"]
    # told the answer and writing it first (here inside a call): no result showed it first, so no grounding
    copied = _turns_episode([(_call("calc", expression="91.08"), "91.08"), ("<answer>91.08</answer>", "")], 0, True)
    assert plans.found_calls(copied, "91.08", _CHARS, _CALLS) is None
    # hindsight: a failed episode whose results showed the answer; a call whose result is an error is left out
    failed = _turns_episode([(_call("find", name="Anne"), "Error: no customer")] + lookups + [("<answer>90</answer>", "")], 0, False)
    assert plans.found_calls(failed, "91.08", _CHARS, _CALLS) == plans.found_calls(passed, "91.08", _CHARS, _CALLS)
    assert plans.found_calls(_turns_episode(lookups[:2], 0, False), "91.08", _CHARS, _CALLS) is None  # never shown


def test_narrow_takes_back_passes_that_only_a_wide_result_or_the_policy_itself_showed(monkeypatch):
    # a table listed whole holds the answer 36 by chance, then the policy "computes" the answer it recalls
    dump = "[" + ",".join(str(i) for i in range(10, 60)) + "]"
    chance = [(_call("sql", sql="SELECT * FROM products"), dump), (_call("calc", expression="36"), "36"), ("<answer>36</answer>", "")]
    aimed = [(_call("tables"), "shipments, loans"), (_call("sql", sql="SELECT COUNT(*) FROM shipments"), '{"rows": [[5, 36]]}'),
             ("<answer>36</answer>", "")]
    assert plans.narrow(dump, "36", 8) is False and plans.narrow(dump, "36", None) and plans.narrow(dump, "Ann", 8)
    assert plans.found_calls(_turns_episode(chance, 0, True), "36", _CHARS, _CALLS)  # the text test: the dump showed it
    assert plans.found_calls(_turns_episode(chance, 0, True), "36", _CHARS, _CALLS, most=8) is None
    assert [c["name"] for c in plans.found_calls(_turns_episode(aimed, 0, True), "36", _CHARS, _CALLS, most=8)] == ["tables", "sql"]
    assert rescue.parse("hint=9,source=answer,narrow=8")["narrow"] == 8 and rescue.parse("hint=9")["narrow"] == 0
    for bad in ("narrow=0", "narrow=x", "narrow=1.5"):
        with pytest.raises(ValueError, match="narrow=N"):
            rescue.parse("hint=9,source=answer," + bad)
    # unguided: the chance pass is taken back (its group all wrong again, so the answer hint asks it), the aimed
    # one stays; a row whose question states the answer, or whose state check grounds it, is left alone
    row, stated = _answer_row("36"), {**_answer_row("36"), "prompt": [{"role": "user", "content": "Is it 36?"}]}
    checked = _answer_row("36")
    checked["reward_spec"]["ground_truth"]["check"] = [{"tool": "t", "expect": {}}]
    eps = [_turns_episode(t, g, True) for g, t in ((0, chance), (1, chance), (1, aimed), (2, chance), (3, chance))]
    asked = []

    def sample(rows, ids):
        asked.extend(ids)
        return [_turns_episode([("<answer>1</answer>", "")], i, False) for i in ids]
    spec = rescue.parse("hint=100,source=answer,narrow=8")
    out, m, _ = rescue.guide([*eps], {0: row, 1: row, 2: stated, 3: checked}, 1, spec, str, sample, None, {}, _CHARS, _CALLS)
    assert m["rescue_unfound"] == 2 and len(asked) == 1  # groups 0 and 1's chance passes; group 0 all wrong: asked
    assert [e.passed() for e in eps] == [False, False, True, True, True] and eps[0].info["unfound"] and eps[0].reward == 0.0
    assert "unfound" not in eps[3].info and "unfound" not in eps[4].info
    eps = [_turns_episode(chance, 0, True)]  # without narrow= nothing changes
    out, m, _ = rescue.guide(eps, {0: row}, 1, rescue.parse("hint=100,source=answer"), str, sample, None, {}, _CHARS, _CALLS)
    assert eps[0].passed() and "rescue_unfound" not in m
    # guided: the answer hint's pass counts only over a narrow result, and only such a pass gives the row a plan
    for most, passes in ((None, 1), (8, 0)):
        found = {}
        _, m, shown = rescue.guide([_turns_episode([("<answer>1</answer>", "")], 0, False)], {0: row}, 1,
                                   rescue.parse("hint=100,source=answer" + (f",narrow={most}" if most else "")), str,
                                   lambda rows, ids: [_turns_episode(chance, ids[0], True)], None, found, _CHARS, _CALLS)
        assert sum(e.passed() for e in shown) == passes and len(found) == passes and m["rescue_ungrounded"] == 1 - passes


def test_made_up_takes_back_a_number_that_the_policy_built_a_call_to_give():
    # told 14, the policy asks date_diff for two dates no text showed: a narrow result, but a built one
    q = "What is the smallest number of scrapped parts on production line B?"
    built = [(_call("date_diff", start="2023-04-01", end="2023-04-15"), "14"), ("<answer>14</answer>", "")]
    times = [(_call("calc", expression="7*2"), "14"), ("<answer>14</answer>", "")]
    read = [(_call("stops", line="B"), '{"from": "2023-04-01", "to": "2023-04-15"}'),
            (_call("date_diff", start="2023-04-01", end="2023-04-15"), "14"), ("<answer>14</answer>", "")]
    derived = [(_call("price", id="x"), "120"), (_call("calc", expression="120 * (1 - 0.05)"), "114"), ("<answer>114</answer>", "")]
    assert plans.made_up(built[0][0], q) and plans.made_up(times[0][0], q) and not plans.made_up(times[0][0], "7 times 2?")
    assert not plans.made_up(_call("tables"), q) and not plans.made_up(derived[1][0], q + " 120")
    for turns in (built, times):
        assert plans.found_calls(_turns_episode(turns, 0, True), "14", _CHARS, _CALLS, most=8, seen=q) is None
        assert plans.found_calls(_turns_episode(turns, 0, True), "14", _CHARS, _CALLS) is not None  # the text test alone
    names = lambda turns, answer, seen=q: [c["name"] for c in plans.found_calls(  # noqa: E731
        _turns_episode(turns, 0, True), answer, _CHARS, _CALLS, most=8, seen=seen)]
    assert names(read, "14") == ["stops", "date_diff"] and names(derived, "114") == ["price", "calc"]
    assert names(times, "14", "What is 7 times 2?") == ["calc"]  # numbers the question states
    weekday = [(_call("weekday", date="2023-04-17"), "Monday"), ("<answer>Monday</answer>", "")]
    assert names(weekday, "Monday") == ["weekday"]  # a text answer: only numbers are judged
    # context given before the episode's own turns (a branch's head, a probe's played call) was seen too
    given = _turns_episode(read, 0, True)
    cut = len(read[0][0]) + len(read[0][1])
    given.response_mask = [0] * cut + given.response_mask[cut:]
    assert [c["name"] for c in plans.found_calls(given, "14", _CHARS, _CALLS, most=8, seen=q)] == ["date_diff"]
    # the trainer: an unguided pass over a built call is taken back, one over a read value stays
    eps = [_turns_episode(built, 0, True), _turns_episode(read, 0, True)]
    row = {**_answer_row("14"), "prompt": [{"role": "user", "content": q}]}
    assert rescue.take_back_unfound({0: eps}, {0: row}, 8, _CHARS, _CALLS) == 1
    assert eps[0].info["unfound"] and not eps[0].passed() and eps[1].passed() and "unfound" not in eps[1].info


def test_narrow_leaves_out_time_stamps_and_lets_a_wide_result_ground_a_specific_unguided_answer():
    record = '{"id": 7, "priority": 3, "created_at": "2026-11-29T21:20:45", "updated_at": "2026-11-29T21:20:45"}'
    assert plans.narrow(record, "3", 4) and not plans.narrow(record + " 1 2 3", "3", 4)  # 2 numbers, not 10
    # a stamp's parts show no number either: 20 is only the stamp's minute here
    q = "What is the priority of item 7?"
    stamped = [(_call("get", id=7), record), ("<answer>20</answer>", "")]
    assert plans.found_calls(_turns_episode(stamped, 0, True), "20", _CHARS, _CALLS, most=8, seen=q) is None
    assert plans.found_calls(_turns_episode(stamped, 0, True), "3", _CHARS, _CALLS, most=8, seen=q) is not None
    # a sheet read whole (wide): a price it holds once grounds an unguided pass, never a told one, nor a small count
    sheet = "[" + ", ".join(f"[{i}, {i * 3}, {i + 0.25}]" for i in range(1, 12)) + "]"  # 33 numbers, 5.25 once
    read = [(_call("read", sheet="inv"), sheet), ("<answer>5.25</answer>", "")]
    for answer, told, ok in (("5.25", False, True), ("5.25", True, False), ("6", False, False), ("30", False, False)):
        got = plans.found_calls(_turns_episode(read, 0, True), answer, _CHARS, _CALLS, most=8, seen=q, told=told)
        assert (got is not None) == ok, (answer, told)
    assert not plans.narrow("[3, 5.25, 5.25, 8, 9, 10, 11, 12, 13]", "5.25", 8, told=False)  # held twice


def test_guide_source_answer_trains_grounded_passes_without_the_answer_in_the_prompt():
    row, seen = _answer_row(), []
    unguided = [_turns_episode([("<answer>1</answer>", "")], 0, False) for _ in range(2)]
    for e in unguided:
        e.prompt_ids = [5, 6]

    def sample(rows, ids):
        seen.extend(r["prompt"][-1]["content"] for r in rows)
        good = [(_call("find", name="Ann"), "7"), (_call("convert", amount=99), "91.08"), ("<answer>91.08</answer>", "")]
        return [_turns_episode(good, ids[0], True), _turns_episode([("<answer>91.08</answer>", "")], ids[0], True),
                _turns_episode([("<answer>3</answer>", "")], ids[0], False)]
    found = {}
    out, m, shown = rescue.guide(unguided, {0: row}, 1, rescue.parse("hint=100,source=answer"), str, sample, None,
                                 found, _CHARS, _CALLS)
    assert len(seen) == 1 and "the correct final answer is 91.08" in seen[0] and row["prompt"][-1]["content"] not in ("", seen[0])
    assert len(out) == 5 and all(e.group == 0 and e.prompt_ids == [5, 6] for e in out)  # joined, trained without the hint
    grounded, copied, wrong = out[2:]
    assert grounded.passed() and grounded.reward == 1.0 and not grounded.info.get("ungrounded")
    assert not copied.passed() and copied.info["ungrounded"] and copied.reward == 0.0  # its pass taken back
    assert m["rescue_groups"] == 1 and m["rescue_answer_groups"] == 1 and m["rescue_ungrounded"] == 1
    # source=answer keeps no plan for later (found does), and a row without an answer is not asked
    assert m["rescue_solved"] == 1.0 and found and list(found.values())[0]["calls"][0]["name"] == "find"
    bare = {"prompt": row["prompt"], "reward_spec": {"method": "rule", "ground_truth": {"check": []}}}
    out, m, _ = rescue.guide(unguided, {0: bare}, 1, rescue.parse("hint=100,source=answer"), str, sample, None, {}, _CHARS, _CALLS)
    assert out == [] and m["rescue_groups"] == 0 and m["rescue_dropped"] == 1  # all wrong, nothing joins it: untrained
    # the hint says, for any server, to look names up first and not to answer with an error
    hint = plans.answer_row(row, "7")["prompt"][-1]["content"]
    assert "lists or describes" in hint and "error is not the answer" in hint


def test_guide_oracle_free_trains_no_group_whose_rewards_differ_only_by_shaping():
    # an all-wrong group: one episode paid two failed calls (-0.4), one called nothing (0.0); trained, the
    # no-call one would rise. Under source=answer it is left out unless a grounded hinted pass joins it
    def group(g):
        calls = _turns_episode([(_call("q", sql="x"), "Error"), (_call("q", sql="y"), "Error"), ("<answer>1</answer>", "")], g, False)
        calls.reward = -0.4
        return [calls, _turns_episode([("<answer>2</answer>", "")], g, False)]
    solvable, hopeless, mixed = _answer_row("91.08"), _answer_row("5"), _answer_row("3")
    passing = group(2)
    passing[1].info["correct"], passing[1].reward = True, 1.0

    def sample(rows, ids):  # the hinted 91.08 row finds its answer; the hinted 5 row does not
        out = []
        for r, i in zip(rows, ids):
            shown = "91.08" if "is 91.08" in r["prompt"][-1]["content"] else "4"
            out += [_turns_episode([(_call("convert", amount=99), shown), (f"<answer>{shown}</answer>", "")], i, shown == "91.08")]
        return out
    eps = group(0) + group(1) + passing
    rows = {0: solvable, 1: hopeless, 2: mixed}
    out, m, _ = rescue.guide(eps, rows, 1, rescue.parse("hint=100,source=answer"), str, sample, None, {}, _CHARS, _CALLS)
    assert [e.group for e in out] == [0, 0, 0, 2, 2] and m["rescue_dropped"] == 1 and m["rescue_solved"] == 0.5
    # source=oracle keeps such groups as before (rows without oracle calls: nothing to guide, all stay)
    out, m, _ = rescue.guide(group(0) + group(1), rows, 1, rescue.parse("hint=100"), str, sample, None, {}, _CHARS, _CALLS)
    assert [e.group for e in out] == [0, 0, 1, 1] and "rescue_dropped" not in m


def test_guide_answer_similar_shows_the_calls_that_answered_the_nearest_question():
    def row(q, answer, source="records"):
        return {"prompt": [{"role": "user", "content": q}], "data_source": source,
                "reward_spec": {"method": "rule", "ground_truth": {"answer": answer, "type": "number", "check": []}}}
    lookups = [(_call("db_tables"), "iv_r, gh_q"), (_call("db_describe", table="iv_r"), "scr, vio"),
               (_call("db_query", sql="SELECT COUNT(*) FROM iv_r"), "12"), ("<answer>12</answer>", "")]
    found, near = {}, row("How many restaurant inspections scoring above 80 are in the records?", "12")
    assert plans.remember(found, near, _turns_episode(lookups, 0, True), _CHARS, _CALLS)
    # a hindsight find and another source's pass are never shown to another row
    plans.remember(found, row("How many restaurant inspections had 3 violations?", "12"), _turns_episode(lookups[:3], 0, False), _CHARS, _CALLS)
    plans.remember(found, row("How many restaurant inspections scoring above 70 are in the records?", "12", "shop"),
                   _turns_episode([(_call("sql", sql="x"), "12"), ("<answer>12</answer>", "")], 0, True), _CHARS, _CALLS)
    asked, prompts = row("How many restaurant inspections scoring above 75 are in the records?", "9"), []

    def sample(rows, ids):
        prompts.extend(r["prompt"][-1]["content"] for r in rows)
        return [_turns_episode([("<answer>0</answer>", "")], i, False) for i in ids]
    wrong = [_turns_episode([("<answer>1</answer>", "")], 0, False)]
    _, m, _ = rescue.guide(wrong, {0: asked}, 1, rescue.parse("hint=100,source=answer+similar"), str, sample, None,
                           found, _CHARS, _CALLS)
    hint = prompts[-1]
    assert "the correct final answer is 9" in hint and m["rescue_similar"] == 1
    assert '1. db_tables {}' in hint and '2. db_describe {"table": "<table>"}' in hint and '3. db_query {"sql": "<sql>"}' in hint
    assert "1. sql " not in hint  # not the other data source's pass
    # source=answer alone shows no plan; a row with no similar pass gets the answer alone
    _, m, _ = rescue.guide(wrong, {0: asked}, 1, rescue.parse("hint=100,source=answer"), str, sample, None, found, _CHARS, _CALLS)
    assert "similar question" not in prompts[-1] and "rescue_similar" not in m
    rescue.guide(wrong, {0: row("Which planet is red?", "4", "space")}, 1, rescue.parse("hint=100,source=answer+similar"),
                 str, sample, None, found, _CHARS, _CALLS)
    assert "similar question" not in prompts[-1]


def test_guide_branch_starts_an_answer_group_again_after_its_own_failed_first_call():
    row, asked = _answer_row("12"), []
    guess = [(_call("query", sql="SELECT COUNT(*) FROM loans"), "Error: no such table: loans"), ("<answer>0</answer>", "")]
    empty = [(_call("describe", table="loans"), "[]"), ("<answer>0</answer>", "")]
    group = [_turns_episode([("<answer>3</answer>", "")], 0, False), _turns_episode(empty, 0, False), _turns_episode(guess, 0, False)]
    for e in group:
        e.prompt_ids = [5, 6]
    head = group[2].response_ids[:len(guess[0][0]) + len(guess[0][1])]  # the error's first, then an empty result

    def sample(rows, ids):  # as Hinted plays them: the given turn in the prompt, the continuation sampled after it
        asked.extend(rows)
        out = []
        for r, i in zip(rows, ids):
            e = _turns_episode([(_call("tables"), "circ, bk"), (_call("query", sql="SELECT COUNT(*) FROM circ"), "12"),
                                ("<answer>12</answer>", "")], i, True)
            e.prompt_ids, e.info["hint_turns"] = [9, 9, 9], len(r.get("hints", []))
            out.append(e)
        return out
    render = lambda name, arguments: _call(name, **arguments)  # noqa: E731
    out, m, _ = rescue.guide(group, {0: row}, 1, rescue.parse("hint=100,source=answer,branch=1"), render, sample, None,
                             {}, _CHARS, _CALLS)
    assert asked[0]["hints"] == [guess[0][0]] and "the correct final answer is 12" in asked[0]["prompt"][-1]["content"]
    branched = out[-1]
    assert m["rescue_branched"] == 1 and branched.passed() and branched.info["branched"] == 1
    assert branched.prompt_ids == [5, 6] and branched.response_ids[:len(head)] == head  # the group's prompt and own turn
    assert branched.response_mask[:len(head)] == [0] * len(head) and branched.response_mask[len(head)] == 1  # context only
    # a first result that showed the answer is a find, not a failure; no call in turn 1: no head either
    found_first = _turns_episode([(_call("query", sql="x"), "12"), ("<answer>1</answer>", "")], 0, False)
    assert rescue.branch_head([group[0], found_first], "12", _CHARS, _CALLS) is None
    assert rescue.branch_head(group[:2], "12", _CHARS, _CALLS)[1] == [empty[0][0]]  # the turn's text, played as read
    # branch=0.5: each group with a head by a draw from its row and the step, the same draw on every call
    rows = {g: _answer_row(str(g + 1)) | {"prompt": [{"role": "user", "content": f"question {g}"}]} for g in range(200)}
    groups = {g: [_turns_episode(guess, g, False)] for g in rows}
    half = rescue.branch_heads(groups, rows, list(rows), 0.5, 3, _CHARS, _CALLS)
    assert 70 <= len(half) <= 130 and half == rescue.branch_heads(groups, rows, list(rows), 0.5, 3, _CHARS, _CALLS)
    assert half != rescue.branch_heads(groups, rows, list(rows), 0.5, 4, _CHARS, _CALLS)  # another step, other draws
    assert len(rescue.branch_heads(groups, rows, list(rows), 1.0, 3, _CHARS, _CALLS)) == 200
    # off: the answer alone, no hint turns
    asked.clear()
    _, m, _ = rescue.guide(group, {0: row}, 1, rescue.parse("hint=100,source=answer"), render, sample, None, {}, _CHARS, _CALLS)
    assert "hints" not in asked[0] and "rescue_branched" not in m
    # an episode with nothing sampled (an error at reset) is left as it is; one whose step failed after it
    # sampled (a server that hung: no info from the env) still trains behind the head
    lost = _turns_episode([], 0, False)
    rescue.from_head(lost, head)
    assert lost.response_ids == [] and "branched" not in lost.info
    hung = _turns_episode([(_call("tables"), "")], 0, False)
    rescue.from_head(hung, head)
    assert hung.response_ids[:len(head)] == head and hung.info["branched"] == 1


def test_guide_probe_plays_a_listing_call_the_group_never_made_then_samples_without_the_answer():
    row, asked = _answer_row("12"), []
    shop = [(_call("sql", sql="SELECT COUNT(*) FROM loans"), "Error: no such table: loans"), ("<answer>0</answer>", "")]
    group = [_turns_episode(shop, 0, False), _turns_episode([(_call("cart"), "[]"), ("<answer>3</answer>", "")], 0, False)]
    for e in group:
        e.prompt_ids = [5, 6]
    played = _call("tables") + "circ, bk"  # the probe's call and its result, as the env ran them
    # "sql" needs an argument, "wipe" is marked as writing: a probe calls neither; "cart" the group called already
    tools = {"sql": False, "wipe": False, "cart": True, "tables": True}

    def sample(rows, ids):  # as Hinted plays them: the given turn in the prompt, the continuation sampled after it
        asked.extend(rows)
        found = [(_call("query", sql="SELECT COUNT(*) FROM circ"), "12"), ("<answer>12</answer>", "")]
        out = [_turns_episode(found, ids[0], True), _turns_episode([("<answer>12</answer>", "")], ids[0], True)]
        for e in out:
            e.prompt_ids, e.info["hint_turns"] = [5, 6] + [ord(c) for c in played], 1
        return out
    render = lambda name, arguments: _call(name, **arguments)  # noqa: E731
    found = {}
    out, m, _ = rescue.guide(group, {0: row}, 1, rescue.parse("hint=100,source=answer,probe=1"), render, sample, tools,
                             found, _CHARS, _CALLS)
    assert asked[0]["hints"] == [_call("tables")] and "correct final answer" not in asked[0]["prompt"][-1]["content"]
    probed, guessed = out[2:]
    assert m["rescue_probed"] == 1 and m["rescue_probe_passed"] == 1 and probed.info["probe"] == "tables"
    assert probed.prompt_ids == [5, 6] and _CHARS(probed.response_ids[:len(played)]) == played  # the group's prompt
    assert probed.response_mask[:len(played)] == [0] * len(played) and probed.response_mask[len(played)] == 1  # context
    assert probed.passed() and guessed.info["ungrounded"] and not guessed.passed()  # a guess is no pass, as under a hint
    assert [c["name"] for c in list(found.values())[0]["calls"]] == ["tables", "query"]  # the plan starts with the probe
    # where no later call took a name from the probe's result, that call was a detour: the plan leaves it out
    def detour(rows, ids):
        e = _turns_episode([(_call("query", sql="SELECT COUNT(*) FROM loans"), "12"), ("<answer>12</answer>", "")], ids[0], True)
        e.prompt_ids = [5, 6] + [ord(c) for c in played]
        return [e]
    found = {}
    rescue.guide(group, {0: row}, 1, rescue.parse("hint=100,source=answer,probe=1"), render, detour, tools, found, _CHARS, _CALLS)
    assert [c["name"] for c in list(found.values())[0]["calls"]] == ["query"]
    assert plans.uses("circ, bk", [{"name": "query", "arguments": {"sql": "SELECT COUNT(*) FROM circ"}}], "How many loans?")
    assert not plans.uses("circ, bk", [{"name": "query", "arguments": {"sql": "SELECT * FROM loans"}}], "How many loans?")
    assert not plans.uses("circ, bk", [{"name": "find", "arguments": {"name": "circ"}}], "Who borrowed from circ?")  # stated
    assert plans.uses('[{"id": 4711}]', [{"name": "get", "arguments": {"id": 4711}}], "") and not plans.uses("7", [
        {"name": "get", "arguments": {"id": 7}}], "")  # an id of 3 digits or more, not any small number
    # no probe where every such tool was tried, where tools are unknown (a set of names, or None), or at probe= off
    for names in ({"sql": False, "cart": True}, {"sql", "cart", "tables"}, None):
        assert rescue.probe_calls({0: group}, {0: row}, [0], 1.0, 1, _CHARS, _CALLS, names) == {}
    # a row_tools server's listing ("row") only for a row that names it; such a row shows its own tools alone
    both = {"tables": True, "list_tables": "row"}
    own = row | {"extra_info": {"tools": ["list_tables", "query"]}}
    assert rescue.probe_calls({0: group}, {0: row}, [0], 1.0, 1, _CHARS, _CALLS, both) == {0: "tables"}
    assert rescue.probe_calls({0: group}, {0: own}, [0], 1.0, 1, _CHARS, _CALLS, both) == {0: "list_tables"}
    asked.clear()
    _, m, _ = rescue.guide(group, {0: row}, 1, rescue.parse("hint=100,source=answer"), render, sample, tools, {}, _CHARS, _CALLS)
    assert "hints" not in asked[0] and "rescue_probed" not in m
    # probe=0.5: each group by a draw from its row and the step, the same draw on every call; the tool drawn too
    rows = {g: _answer_row(str(g + 1)) | {"prompt": [{"role": "user", "content": f"question {g}"}]} for g in range(200)}
    groups = {g: group for g in rows}
    half = rescue.probe_calls(groups, rows, list(rows), 0.5, 3, _CHARS, _CALLS, tools | {"list": True})
    assert 70 <= len(half) <= 130 and set(half.values()) == {"tables", "list"}
    assert half == rescue.probe_calls(groups, rows, list(rows), 0.5, 3, _CHARS, _CALLS, tools | {"list": True})
    with pytest.raises(ValueError, match="probe= starts the answer-asked groups again"):
        rescue.parse("hint=10,probe=0.5")
    for bad in ("probe=0", "probe=1.5", "probe=x"):
        with pytest.raises(ValueError, match="branch=F or probe=F"):
            rescue.parse(f"hint=10,source=answer,{bad}")


def test_guide_told_probe_samples_after_the_listing_under_the_answer_hint_and_trains_without_it():
    row, asked = _answer_row("12"), []
    group = [_turns_episode([(_call("sql", sql="SELECT 1"), "Error: no such table"), ("<answer>0</answer>", "")], 0, False)]
    group[0].prompt_ids = [5, 6]
    played = _call("tables") + "circ, bk"

    def sample(rows, ids):
        asked.extend(rows)
        genuine = [(_call("query", sql="SELECT COUNT(*) FROM circ"), "12"), ("<answer>12</answer>", "")]
        built = [(_call("calc", expression="3*4"), "12"), ("<answer>12</answer>", "")]
        out = [_turns_episode(genuine, ids[0], True), _turns_episode(built, ids[0], True)]
        for e in out:  # the question (5), the answer hint after it (9, 9), the assistant's header (6), the played turn
            e.prompt_ids, e.info["hint_turns"] = [5, 9, 9, 6] + [ord(c) for c in played], 1
        return out
    render = lambda name, arguments: _call(name, **arguments)  # noqa: E731
    found = {}
    out, m, _ = rescue.guide(group, {0: row}, 1, rescue.parse("hint=100,source=answer,probe=1,told=1,narrow=8"), render,
                             sample, {"tables": True}, found, _CHARS, _CALLS)
    assert asked[0]["hints"] == [_call("tables")] and "correct final answer is 12" in asked[0]["prompt"][-1]["content"]
    genuine, built = out[1:]
    assert genuine.prompt_ids == [5, 6] and genuine.info["answer_hint"] and genuine.info["probe"] == "tables"
    assert _CHARS(genuine.response_ids[:len(played)]) == played and genuine.response_mask[:len(played)] == [0] * len(played)
    # where the played turns start: past the longest tail of the question's prompt that recurs (its end, the header)
    question = [1, 2, 3, 70, 80, 81, 82]  # ..., "?", <|im_end|>, \n, <|im_start|>assistant
    told = [1, 2, 3, 71, 40, 41, 80, 81, 82, 90, 91, 80, 81, 82]  # "?\n\n" merged, the hint, the header, a played turn
    assert rescue.played_start(told, question) == 9 and rescue.played_start([1, 2, 3, 70, 80, 81, 82, 90], question) == 7
    assert rescue.played_start([1, 2, 3, 71, 40, 41, 90, 91], question) is None  # no header: not trained
    assert genuine.passed() and built.info["ungrounded"] and not built.passed()  # 3*4: numbers of its own (made_up)
    assert [c["name"] for c in list(found.values())[0]["calls"]] == ["tables", "query"]
    assert m["rescue_probe_passed"] == 1
    with pytest.raises(ValueError, match="told=1 tells the probes the answer; it needs probe=F"):
        rescue.parse("hint=10,source=answer,told=1")
    with pytest.raises(ValueError, match="told=0"):
        rescue.parse("hint=10,source=answer,probe=1,told=yes")
    assert rescue.parse("hint=10,source=answer,probe=1")["told"] is False


def test_branch_head_starts_at_the_depth_a_group_failed_and_leaves_turns_to_play():
    looked = [(_call("tables"), "circ, bk"), (_call("describe", table="circ"), "bk_ref, fee"),
              (_call("query", sql="SELECT COUNT(*) FROM circ WHERE title = 'x'"), "Error: no such column: title"),
              ("<answer>0</answer>", "")]
    deep = _turns_episode(looked, 0, False)
    tokens, texts, calls = rescue.branch_head([deep], "12", _CHARS, _CALLS)
    assert texts == [t for t, _ in looked[:3]] and _CHARS(tokens) == "".join(t + o for t, o in looked[:3])  # the error's
    assert calls == [{"name": "tables", "arguments": {}}, {"name": "describe", "arguments": {"table": "circ"}}]  # not the failed one
    # no error: any boundary before the answer, drawn; the draw follows the rng
    plain = _turns_episode(looked[:2] + [("<answer>0</answer>", "")], 0, False)
    drawn = {len(rescue.branch_head([plain], "12", _CHARS, _CALLS, random.Random(i))[1]) for i in range(40)}
    assert drawn == {1, 2}
    # cut at the turn limit: never in its last two turns; a result that showed the answer ends the boundaries
    cut = _turns_episode([(_call("tables"), "circ"), (_call("describe", table="circ"), "fee"),
                          (_call("query", sql="q"), "Error: x"), (_call("query", sql="q"), "Error: x")], 0, False)
    cut.finish_reason = "max_turns"
    assert {len(rescue.branch_head([cut], "12", _CHARS, _CALLS, random.Random(i))[1]) for i in range(40)} == {1, 2}
    shown = _turns_episode([(_call("tables"), "circ"), (_call("query", sql="q"), "12"), (_call("query", sql="r"), "Error: x"),
                            ("<answer>1</answer>", "")], 0, False)
    assert rescue.branch_head([shown], "12", _CHARS, _CALLS)[1] == [_call("tables")]
    wrote = _turns_episode([(_call("tables"), "circ"), (_call("query", sql="SELECT 12"), "Error: x"), ("<answer>1</answer>", "")], 0, False)
    assert rescue.branch_head([wrote], "12", _CHARS, _CALLS)[1] == [_call("tables")]  # a call that wrote the answer: a guess
    # the run's turn limit, where known: two turns left after the head
    assert {len(rescue.branch_head([deep], "12", _CHARS, _CALLS, random.Random(i), max_turns=4)[1]) for i in range(40)} == {1, 2}
    assert rescue.branch_head([deep], "12", _CHARS, _CALLS, max_turns=2) is None
    # through guide: the head played as given turns, the branched pass trained behind all of them, and the
    # row's found plan the head's calls that did not fail, then the continuation's
    played = []

    def sample(rows, ids):
        played.extend(r.get("hints") for r in rows)
        return [_turns_episode([(_call("query", sql="SELECT COUNT(*) FROM circ JOIN bk"), "12"), ("<answer>12</answer>", "")],
                               i, True) for i in ids]
    found = {}
    out, m, _ = rescue.guide([deep], {0: _answer_row("12")}, 1, rescue.parse("hint=100,source=answer,branch=1"), str, sample,
                             None, found, _CHARS, _CALLS)
    assert played == [texts] and m["rescue_branched"] == 1 and m["rescue_branch_turns"] == 3
    branched = out[-1]
    assert branched.info["branched"] == 3 and branched.response_ids[:len(tokens)] == tokens
    assert branched.info["turns"] == 3 + 0  # the head's turns counted, as as_context counts played ones
    assert [c["name"] for c in found[plans.row_key(_answer_row("12"))]["calls"]] == ["tables", "describe", "query"]
    # a continuation that showed the answer with no call of its own gives the row no plan of the head's calls alone

    def echo(rows, ids):
        return [_turns_episode([("SELECT 12 FROM circ", "Error: tool call 1: not JSON: SELECT 12"), ("<answer>12</answer>", "")],
                               i, True) for i in ids]
    found.clear()
    rescue.guide([deep], {0: _answer_row("12")}, 2, rescue.parse("hint=100,source=answer,branch=1"), str, echo, None, found,
                 _CHARS, _CALLS)
    assert found == {}


def test_guide_source_found_plans_a_row_with_the_calls_the_run_found_for_it():
    row, prompts = _answer_row(), []

    def sample(rows, ids):
        prompts.extend(r["prompt"][-1]["content"] for r in rows)
        return [_turns_episode([("<answer>0</answer>", "")], i, False) for i in ids]
    spec, found, wrong = rescue.parse("hint=100,source=found"), {}, [_turns_episode([("<answer>1</answer>", "")], 0, False)]
    # nothing found yet: source=found guides nothing and asks no answer
    out, m, _ = rescue.guide(wrong, {0: row}, 1, spec, str, sample, None, found, _CHARS, _CALLS)
    assert out == [] and m == {"rescue_groups": 0, "rescue_hint_turns": 0.0, "rescue_found": 0, "rescue_dropped": 1}
    assert not prompts
    # a failed episode whose results showed the answer (hindsight) gives its row a plan; a pass beats it later
    near = _turns_episode([(_call("orders", id=7), "[99]"), (_call("convert", amount=99), "91.08"), ("<answer>9</answer>", "")], 0, False)
    other = _turns_episode([(_call("find", name="Ann"), "x")], 0, True)  # a pass that showed nothing: no plan
    rescue.guide([near, other], {0: row}, 1, spec, str, sample, None, found, _CHARS, _CALLS)
    (key, plan), = found.items()
    assert key == plans.row_key(row) and [c["name"] for c in plan["calls"]] == ["orders", "convert"] and plan["rank"] == [False, -2]
    out, m, shown = rescue.guide(wrong, {0: row}, 2, spec, lambda n, a: f"<{n}>", sample, None, found, _CHARS, _CALLS)
    assert "1. orders" in prompts[-1] and "2. convert" in prompts[-1] and "<orders>" in prompts[-1]
    assert m["rescue_groups"] == 1 and m["rescue_answer_groups"] == 0 and shown[0].info["plan_calls"] == 2
    best = _turns_episode([(_call("convert", amount=99), "91.08"), ("<answer>91.08</answer>", "")], 0, True)
    plans.remember(found, row, best, _CHARS, _CALLS)
    assert found[key]["rank"] == [True, -1] and not plans.remember(found, row, near, _CHARS, _CALLS)


def _answer_rows_run(tiny_model_dir, tmp_path, monkeypatch, env, say, spec, *extra):
    """train.main on two rows of a question and an answer (7391), every row's env an env(), the policy
    say(prompt) each turn (conftest.say_engine), a stand-in tool format that reads every turn as one call
    ("call NAME" rendered), --rescue spec -> its result."""
    from types import SimpleNamespace
    say_engine(monkeypatch, train, say)
    monkeypatch.setattr(train.envs, "env_for_row", lambda row, *a, **kw: env())
    one_call = SimpleNamespace(render=lambda name, arguments: f"call {name}", parse=lambda text, **kw: ([{"name": "look", "arguments": {}}], []))
    monkeypatch.setattr(train, "FORMATS", {fmt: one_call for fmt in train.FORMATS})  # every turn reads as one call
    rows = [{**envs.multiply_rows(1, seed=i)[0], "reward_spec": {"method": "rule", "ground_truth": "7391"}} for i in range(2)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train.main(_argv(tiny_model_dir, tmp_path / "run", "--train-data", str(path), "--rescue", spec,
                            "--n", "2", "--max-tokens", "4", "--max-context", "1024", *extra))


class AnswerShown(envs.Env):
    """Two turns when the prompt holds a --rescue hint (the answer or a plan): a result that shows the
    row's answer, then a pass; one wrong turn otherwise: every unguided group is all wrong."""
    tools, max_turns = None, 3

    def reset(self, row):
        self.hinted, self.turn = "Hint:" in row["prompt"][-1]["content"], 0
        return [dict(m) for m in row["prompt"]]

    def step(self, text):
        self.turn += 1
        if self.hinted and self.turn == 1:
            return [{"role": "user", "content": "the tool says 7391"}], 0.0, False, {}
        return [], float(self.hinted), True, {"correct": self.hinted}


def test_rescue_found_and_answer_train_rows_without_oracle_calls(tiny_model_dir, tmp_path, monkeypatch):
    # rows of a question and an answer: step 1 asks with the answer, its grounded passes leave plans, and
    # step 2 guides the same rows by those plans; the plans go into the checkpoint with the run's state.
    # Every turn "ok" and the end of turn: a turn the env steps (a cut one ends it)
    out = _answer_rows_run(tiny_model_dir, tmp_path, monkeypatch, AnswerShown, lambda prompt: "ok",
                           "hint=10,source=found+answer", "--save-every", "2")
    h1, h2 = out["history"]
    assert h1["rescue_answer_groups"] == 2 and h1["rescue_solved"] == 1.0 and h1["rescue_found"] == 2
    assert h2["rescue_groups"] == 2 and h2["rescue_answer_groups"] == 0 and h2["rescue_hint_turns"] == 1.0  # found plans
    ts = torch.load(tmp_path / "run" / "ckpt" / "step_000002" / "trainer_state.pt", weights_only=False)
    assert {v["calls"][0]["name"] for v in ts["state"]["rescue_found"].values()} == {"look"}


def test_rescue_replay_asks_the_rows_the_rescue_solved_again_and_keeps_the_queue_in_the_checkpoint(tiny_model_dir, tmp_path,
                                                                                                    monkeypatch):
    # replay=1: every unguided group is all wrong and every answer-hinted one passes, so each step's solved rows
    # come back the next step in place of fresh rows (at most a quarter of the step's 4 rows: 1), each at most
    # REPLAY_MOST times; what is still queued goes into the checkpoint, and a resume picks it up
    asked = []
    out = _answer_rows_run(tiny_model_dir, tmp_path, monkeypatch, AnswerShown,
                           lambda prompt: asked.append(prompt) or "ok", "hint=10,source=answer,replay=1",
                           "--prompts-per-step", "4", "--steps", "3", "--save-every", "3")
    h1, h2, h3 = out["history"]
    assert h1["rescue_requeued"] == 4 and h1["rescue_replayed"] == 0
    assert h2["rescue_replayed"] == 1 and h3["rescue_replayed"] == 1  # one a step: a quarter of 4
    assert h2["rescue_requeued"] == 4 and h3["rescue_requeued"] == 4  # each solved again, the replayed one too
    ts = torch.load(tmp_path / "run" / "ckpt" / "step_000003" / "trainer_state.pt", weights_only=False)
    queue = ts["state"]["rescue_replay"]
    assert len(queue) == 3 * 4 - 2  # queued at each step, less the two asked again
    assert sorted(times for _, times, _ in queue).count(2) == 2  # the two replayed rows, queued a second time
    assert all(set(row) >= {"prompt", "reward_spec"} for _, _, row in queue)
    first_due = min(queue, key=lambda q: q[0])[2]["prompt"][-1]["content"]
    asked.clear()
    h4 = _answer_rows_run(tiny_model_dir, tmp_path, monkeypatch, AnswerShown, lambda prompt: asked.append(prompt) or "ok",
                          "hint=10,source=answer,replay=1", "--prompts-per-step", "4", "--steps", "4",
                          "--resume", str(tmp_path / "run"))["history"][-1]
    assert h4["step"] == 4 and h4["rescue_replayed"] == 1 and first_due in asked[0]  # the queue's oldest row, asked first
    # the functions: oldest due first, the share, the cap on times
    q = [[5, 1, {"r": 1}], [3, 2, {"r": 2}], [9, 1, {"r": 3}]]
    assert rescue.due(q, 5, 8) == [(1, {"r": 1}), (2, {"r": 2})] and q == [[9, 1, {"r": 3}]]
    assert rescue.due([[1, 1, {}], [1, 1, {}]], 1, 4) == [(1, {})]  # 4 rows: one replay a step
    passed = _turns_episode([("<answer>1</answer>", "")], 7, True)
    passed.info["hint_for"] = 0
    unjoined = _turns_episode([("<answer>1</answer>", "")], 8, True)
    unjoined.info.update(hint_for=1, not_trained=True)
    q = []
    n = rescue.requeue(q, [passed, unjoined], {0: {"r": 0}, 1: {"r": 1}}, {0: rescue.REPLAY_MOST}, 4, 2)
    assert n == 0 and q == []  # asked again REPLAY_MOST times already; a group no guided pass joined is not queued
    assert rescue.requeue(q, [passed], {0: {"r": 0}}, {}, 4, 2) == 1 and q == [[6, 1, {"r": 0}]]
    with pytest.raises(ValueError, match="bad part 'replay=0'"):
        rescue.parse("hint=10,replay=0")
    with pytest.raises(ValueError, match="replay= asks again .* needs hint=S"):
        rescue.parse("credit=0.1,replay=2")


class FailsFirst(AnswerShown):
    """Turn 1 fails (a tool's error); under a --rescue answer hint, after a turn 1 the unhinted policy wrote
    ("ok": played as given), turn 2's result shows the row's answer and turn 3 passes; else turn 2 ends
    wrong: every unguided group is all wrong, with a failed first call, and only a branch passes."""
    max_turns = 4

    def step(self, text):
        self.turn += 1
        if self.turn == 1:
            self.hinted = self.hinted and text == "ok"
            return [{"role": "user", "content": "Error: no such table"}], -0.2, False, {}
        if self.hinted and self.turn == 2:
            return [{"role": "user", "content": "the tool says 7391"}], 0.0, False, {}
        return [], float(self.hinted), True, {"correct": self.hinted}


def test_rescue_branch_trains_a_run_from_the_groups_own_failed_first_call(tiny_model_dir, tmp_path, monkeypatch):
    # train.py end to end: the answer-asked groups start again after their first (failed) turn, played by
    # Hinted; the continuation finds the answer and the branched episodes train after the group's own head.
    # The policy says "ok" unhinted, "go" under a hint: a played turn is the unhinted one's
    out = _answer_rows_run(tiny_model_dir, tmp_path, monkeypatch, FailsFirst, lambda prompt: "go" if "Hint:" in prompt else "ok",
                           "hint=10,source=answer,branch=1")
    h1 = out["history"][0]
    assert h1["rescue_branched"] == 2 and h1["rescue_answer_groups"] == 2 and h1["rescue_solved"] == 1.0
    assert h1["rescue_joined"] == 4 and h1["rescue_ungrounded"] == 0  # each branched pass trained beside its group


def _headline_stand_ins(tmp_path):
    """lab/recipes/headline.sh with stand-ins for python, nvidia-smi and timeout that log what they are
    asked; eval.py writes tmp_path/eval.json into its --out-dir, and the recipe's own python -c summary
    runs for real. -> run(**env) -> (the finished process, the logged calls)."""
    import subprocess
    import textwrap
    bin_, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_.mkdir()
    (bin_ / "python").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        echo "$CUDA_VISIBLE_DEVICES $*" >> {log}
        case "$*" in
          "-c import json"*) exec {sys.executable} "$@" ;;  # the recipe's own (eval.json's summary, VAL's split)
          *time.sleep*) exec sleep 30 ;;               # capped's hog: killed when the run ends
          *share_here*) echo 0.17 ;;                   # SHARE
          *mem_get_info*) echo 85000000000 ;;          # capped's total
          *"print(int("*) echo 1000 ;;                 # capped's hog size
          mcp_tools/tasks.py*) out=${{@: -1}}; mkdir -p $out; [ -f $out/train.jsonl ] || echo '{{}}' > $out/train.jsonl
                               echo '{{}}' > $out/test.jsonl ;;
          train.py*) d=$(echo "$*" | grep -o -- '--out-dir [^ ]*' | cut -d' ' -f2); mkdir -p $d; echo '{{}}' > $d/metrics.jsonl
                     echo "alloc $CUDA_VISIBLE_DEVICES $PYTORCH_CUDA_ALLOC_CONF" >> {log}
                     case "$*" in *" --eval-data val="*) mkdir -p $d/best; echo '{{}}' > $d/best/best.json ;; esac ;;
          eval.py*) d=$(echo "$*" | grep -o -- '--out-dir [^ ]*' | cut -d' ' -f2); mkdir -p $d; cp {tmp_path}/eval.json $d/ ;;
          lab/transfer.py*) d=$(echo "$*" | grep -o -- '--out [^ ]*' | cut -d' ' -f2); mkdir -p $d; echo '{{}}' > $d/servers.json
                            for f in a b c; do for i in 1 2 3 4 5 6; do echo "{{\\"extra_info\\": {{\\"family\\": \\"$f\\"}}}}"; done; done > $d/rows.jsonl ;;
        esac
        """))
    (bin_ / "nvidia-smi").write_text("#!/bin/bash\ncase \"$*\" in *index*) printf '0\\n1\\n2\\n3\\n' ;;\n"
                                     "  *compute-apps*) g=${2:-0}; printf \"7$g, 4$g\\n8$g, 5$g\\n\" ;; *) echo 99999 ;; esac\n")
    (bin_ / "timeout").write_text("#!/bin/bash\nwhile [ \"$1\" != python ]; do shift; done; exec \"$@\"\n")
    # torchrun: the ranks' command through the python stand-in, then one rank that waits for SIGINT (headline.sh's
    # interrupt_after sends it to torchrun's children) and logs it
    (bin_ / "torchrun").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        echo "$CUDA_VISIBLE_DEVICES torchrun $*" >> {log}
        while [ "$1" != -- ]; do shift; done; shift
        python "$@"
        {sys.executable} -c "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: (open('{log}', 'a').write('rank stopped by SIGINT\\n'), sys.exit(0))); time.sleep(60)" &
        wait $!
        """))
    for f in bin_.iterdir():
        f.chmod(0o755)
    (tmp_path / "eval.json").write_text(json.dumps({"models": []}))
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lab", "recipes", "headline.sh")

    def run(stage="rescue", **env):
        log.write_text("")
        e = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SEEDS", "ROWS_READY", "REPEAT", "VAL")}
        e.update({"PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), "MODEL": "m", "MINUTES": "1", **env})
        p = subprocess.run(["bash", recipe, stage], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=120)
        return p, log.read_text().splitlines()
    return run


def test_headline_rescue_runs_each_of_seeds_at_once_on_a_gpu_of_its_own(tmp_path):
    # lab/recipes/headline.sh rescue with SEEDS: the rows are written once, then one run a seed, each on
    # the GPU at its place in CUDA_VISIBLE_DEVICES, each with its own seed and run folder; more seeds
    # than GPUs is an error.
    run = _headline_stand_ins(tmp_path)
    p, calls = run(SEEDS="0 1 2", CUDA_VISIBLE_DEVICES="2,5,7")
    assert p.returncode == 0, p.stdout + p.stderr
    trains = sorted(c.split() for c in calls if " train.py " in f" {c} ")
    assert [(c[0], c[c.index("--seed") + 1], c[c.index("--out-dir") + 1]) for c in trains] == \
        [("2", "0", "runs/rescue-s0"), ("5", "1", "runs/rescue-s1"), ("7", "2", "runs/rescue-s2")]
    assert sum(" mcp_tools/tasks.py " in f" {c} " for c in calls) == 4  # seen, unseen, multi, discovery: once
    evals = sorted(c.split()[0] + " " + c.split()[c.split().index("--model") + 3] for c in calls if " eval.py " in f" {c} ")
    assert evals == ["2 runs/rescue-s0", "5 runs/rescue-s1", "7 runs/rescue-s2"]
    assert all((tmp_path / "out" / f"rescue-s{s}.out").exists() for s in range(3))
    assert all(c[c.index("--gpu-memory-utilization") + 1] == "0.17" for c in trains)  # SHARE, from share_here
    assert sum("share_here" in c for c in calls) == 1  # read once, by the parent
    p, calls = run(SEEDS="0 1 2 3 4")  # nvidia-smi lists four GPUs
    assert p.returncode == 2 and "SEEDS: 5 seeds for 4 GPUs (1 a GPU)" in p.stdout and not any("train.py" in c for c in calls)


def test_headline_rescue_per_gpu_shares_one_hog_between_the_runs_of_a_gpu(tmp_path):
    # PER_GPU=2: two seeds on one GPU; the parent's one hog leaves them 2 x 45 GiB, and neither run starts
    # a hog of its own (two would not fit); more seeds than GPUs x PER_GPU is an error.
    run = _headline_stand_ins(tmp_path)
    (tmp_path / "t").mkdir()
    p, calls = run(SEEDS="0 1 2", PER_GPU="2", CUDA_VISIBLE_DEVICES="3,5", KV_GB="8.5", TMPDIR=str(tmp_path / "t"),
                   PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert p.returncode == 0, p.stdout + p.stderr
    # each run's PyTorch allocator held to 44 GiB of the GPU's 85 GB plus its sleeping engine's pool (KV_GB, the
    # weights: none here, 1.25 GiB of buffers), so that no run's cache grows into another's share of the pool; a
    # setting the user gave is kept; the engines sleep while training (auto would read the pool and keep them awake)
    assert sorted(c for c in calls if c.startswith("alloc ")) == \
        ["alloc 3 expandable_segments:True,per_process_memory_fraction:0.6789"] * 2 + \
        ["alloc 5 expandable_segments:True,per_process_memory_fraction:0.6789"]
    trains = sorted(c.split() for c in calls if " train.py " in f" {c} ")
    assert all(c[c.index("--sleep-level") + 1] == "2" and c.count("--sleep-level") == 1 for c in trains)
    assert [(c[0], c[c.index("--seed") + 1], c[c.index("--kv-cache-gb") + 1]) for c in trains] == \
        [("3", "0", "8.5"), ("3", "1", "8.5"), ("5", "2", "8.5")]  # two on the first GPU, a fixed KV cache
    assert all(c.split()[c.split().index("--kv-cache-gb") + 1] == "8.5" for c in calls if " eval.py " in f" {c} ")
    hogs = sorted(c.split()[0] for c in calls if "time.sleep" in c)
    assert hogs == ["3", "5"]  # one hog a GPU, none of the runs' own
    assert [c for c in calls if "print(int(" in c][0].count(" 90 * 2**30") == 1  # each leaves 90 GiB
    for g in (3, 5):  # each hog's own log: the device's peak and its GPU's processes (the driver's list), no other's
        log = (tmp_path / "out" / f"capped-gpu{g}.out").read_text()
        assert "capped: cap 90 GiB" in log and f"7{g}:4{g}" in log and f"8{g}:5{g}" in log
        assert f"7{8 - g}:" not in log
    assert all("capped: one of 2 runs in the 90 GiB" in (tmp_path / "out" / f"rescue-s{s}.log").read_text() for s in (0, 1, 2))
    assert not list((tmp_path / "t").iterdir()) and "capped: cap 90 GiB" in p.stdout  # the hogs' files are gone
    # a fraction the user gave is theirs: not given a second time
    p, calls = run(SEEDS="0 1", PER_GPU="2", CUDA_VISIBLE_DEVICES="3", KV_GB="8.5",
                   PYTORCH_CUDA_ALLOC_CONF="per_process_memory_fraction:0.4,expandable_segments:True")
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(c for c in calls if c.startswith("alloc ")) == \
        ["alloc 3 per_process_memory_fraction:0.4,expandable_segments:True"] * 2
    assert "its PyTorch memory at most 0.4 of the GPU" in (tmp_path / "out" / "rescue-s0.log").read_text()
    p, calls = run(SEEDS="0 1 2", PER_GPU="2", CUDA_VISIBLE_DEVICES="3", KV_GB="8.5")
    assert p.returncode == 2 and "SEEDS: 3 seeds for 1 GPUs (2 a GPU)" in p.stdout and not any("train.py" in c for c in calls)
    # PER_GPU=3: the three seeds in one GPU's 135 GiB, each held to 44 GiB of it
    p, calls = run(SEEDS="0 1 2", PER_GPU="3", CUDA_VISIBLE_DEVICES="3", KV_GB="8.5")
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(c for c in calls if c.startswith("alloc ")) == ["alloc 3 per_process_memory_fraction:0.6789"] * 3
    assert [c.split()[0] for c in calls if "time.sleep" in c] == ["3"] and \
        [c for c in calls if "print(int(" in c][0].count(" 135 * 2**30") == 1
    p, calls = run(SEEDS="0 1", PER_GPU="2", CUDA_VISIBLE_DEVICES="3")  # without KV_GB: vLLM's profiling would fail
    assert p.returncode == 2 and "set KV_GB" in p.stdout and not any("train.py" in c for c in calls)


def test_headline_transfer_rl_trains_on_a_users_rows_and_scores_the_transfer_set(tmp_path):
    # lab/recipes/headline.sh transfer-rl: lab/transfer.py's training rows (a world of their own) with the test set's
    # sqlite server, VAL rows a family held back, train.py through the training world's servers, then eval.py on
    # the transfer set (TRANSFER), base and the policy picked on the val set; no TRANSFER: an error, nothing run
    run = _headline_stand_ins(tmp_path)
    (tmp_path / "tx").mkdir()
    (tmp_path / "tx" / "servers.json").write_text(json.dumps({"mcpServers": {"sqlite": {"command": "/opt/sq/mcp-server-sqlite"}}}))
    p, calls = run("transfer-rl", TRANSFER="tx", VAL="2", SEED="3", RESCUE="hint=9,source=answer")
    assert p.returncode == 0, p.stdout + p.stderr
    tr = "data/out/transfer-train-s3"  # the run's own training world
    assert any(f"lab/transfer.py --split train --out {tr} --sqlite-server /opt/sq/mcp-server-sqlite --exclude tx/rows.jsonl"
               in c for c in calls)
    val = [json.loads(line) for line in open(tmp_path / tr / "val.jsonl")]
    assert collections.Counter(r["extra_info"]["family"] for r in val) == {"a": 2, "b": 2, "c": 2}
    assert sum(1 for _ in open(tmp_path / tr / "rows.jsonl")) == 12  # the 6 held back train no more
    (train,) = [c.split() for c in calls if " train.py " in f" {c} "]
    flag = lambda name: train[train.index(name) + 1]
    assert (flag("--mcp-config"), flag("--train-data"), flag("--eval-data"), flag("--rescue"), flag("--seed")) == \
        (f"{tr}/servers.json", f"{tr}/rows.jsonl", f"val={tr}/val.jsonl", "hint=9,source=answer", "3")
    (ev,) = [c.split() for c in calls if " eval.py " in f" {c} "]
    assert (ev[ev.index("--mcp-config") + 1], ev[ev.index("--eval-data") + 1]) == ("tx/servers.json", "tx/rows.jsonl")
    assert not any("mcp_tools/tasks.py" in c for c in calls)  # the bundled rows: not written, none trains
    assert [ev[i + 1] for i, a in enumerate(ev) if a == "--model"] == ["m", "runs/transfer-rl-s3/best"]
    p, calls = run("transfer-rl")
    assert p.returncode != 0 and "set TRANSFER" in p.stderr and not any("train.py" in c for c in calls)


def test_headline_bfcl_trains_on_synthesized_rows_and_scores_bfcl_and_the_bundled_rows(tmp_path):
    # lab/recipes/headline.sh bfcl: the BFCL server's config, its 800 test rows and the synthesized training
    # rows; train.py on the synthesized rows only, through that server; then eval.py, base and run, on the
    # BFCL rows (at BFCL's context) and on the bundled held-out rows; BASE_EVAL=0: the run alone
    run = _headline_stand_ins(tmp_path)
    p, calls = run("bfcl", SEED="2")
    assert p.returncode == 0, p.stdout + p.stderr
    bfcl = [c.split()[1:3] for c in calls if " -m mcp_tools.bfcl" in c]  # "CUDA_VISIBLE_DEVICES -m MODULE ..."
    assert bfcl == [["mcp_tools.bfcl", "config"], ["mcp_tools.bfcl", "rows"]] + [["mcp_tools.bfcl_synth", "--n"]] * 2
    train = next(c.split() for c in calls if " train.py " in f" {c} ")
    flag = lambda c, f: c[c.index(f) + 1]
    assert flag(train, "--train-data") == "data/out/bfcl/train.jsonl" and flag(train, "--mcp-config") == "data/out/bfcl/mcp.json"
    assert flag(train, "--seed") == "2" and flag(train, "--out-dir") == "runs/bfcl-s2" and "bfcl/all" not in " ".join(train)
    evals = [c.split() for c in calls if " eval.py " in f" {c} "]
    assert [flag(e, "--eval-data") for e in evals] == ["data/out/bfcl/all.jsonl", "data/out/mcp-heldout-test.jsonl"]
    assert all(e.count("--model") == 2 for e in evals) and flag(evals[0], "--max-context") == "32768"
    p, calls = run("bfcl", BASE_EVAL="0")
    assert all(c.count("--model") == 1 for c in calls if " eval.py " in f" {c} ")
    assert "--played 0" in next(c for c in calls if "bfcl_synth --n 2000" in c)
    (tmp_path / "data" / "out" / "bfcl").mkdir(parents=True, exist_ok=True)  # bfcl_synth's folder (a stand-in here)
    p, calls = run("bfcl", BUNDLED="1", PLAYED="0.5")  # N bundled training rows beside the conversations, both servers
    assert p.returncode == 0, p.stdout + p.stderr
    assert "--played 0.5" in next(c for c in calls if "bfcl_synth --n 2000" in c)
    assert any("mcp_tools.bfcl config --bundled --out data/out/bfcl/mcp-train.json" in c for c in calls)
    train = next(c.split() for c in calls if " train.py " in f" {c} ")
    assert flag(train, "--mcp-config") == "data/out/bfcl/mcp-train.json"
    assert (tmp_path / "data" / "out" / "bfcl" / "train.jsonl").read_text() == "{}\n"  # the stand-in's bundled row
    evals = [c.split() for c in calls if " eval.py " in f" {c} "]
    assert flag(evals[0], "--mcp-config") == "data/out/bfcl/mcp.json"  # BFCL's tests: its server alone
    p, calls = run("bfcl", BUNDLED="many")
    assert p.returncode == 2 and "BUNDLED=many: want a number of rows" in p.stdout and not any("train.py" in c for c in calls)
    p, calls = run("bfcl", BASE_EVAL="0", TRANSFER="data/out/transfer")  # and the third-party transfer rows, last
    transfer = [c.split() for c in calls if " eval.py " in f" {c} "][-1]
    assert p.returncode == 0 and flag(transfer, "--eval-data") == "data/out/transfer/rows.jsonl"
    assert flag(transfer, "--mcp-config") == "data/out/transfer/servers.json" and transfer.count("--model") == 1


def test_headline_bfcl_gpus_trains_data_parallel_each_gpu_capped_and_stops_the_ranks_on_time(tmp_path):
    # GPUS=2: train.py under torchrun on the first two GPUs, each held at 45 GiB by a hog of its own; after MINUTES the
    # ranks (torchrun's children) get SIGINT, not torchrun; the hogs end before the evals, which use both GPUs; more
    # GPUs than there are: an error
    run = _headline_stand_ins(tmp_path)
    p, calls = run("bfcl", GPUS="2", CUDA_VISIBLE_DEVICES="5,7,9", MINUTES="0.05", BASE_EVAL="0", TRANSFER="tx")
    assert p.returncode == 0, p.stdout + p.stderr
    # the evals after it: BFCL's conversations on the first GPU, the bundled rows and the transfer set beside them
    evals = sorted((c.split()[0], c.split()[c.split().index("--eval-data") + 1]) for c in calls if " eval.py " in f" {c} ")
    assert evals == [("5", "data/out/bfcl/all.jsonl"), ("7", "data/out/mcp-heldout-test.jsonl"), ("7", "tx/rows.jsonl")]
    assert "bfcl-s0 bundled rc=0" in p.stdout and "bfcl-s0 transfer rc=0" in p.stdout
    (tr,) = [c.split() for c in calls if " torchrun " in f" {c} "]
    assert tr[:6] == ["5,7", "torchrun", "--standalone", "--nproc-per-node", "2", "--"] and tr[6] == "train.py"
    (train,) = [c.split() for c in calls if c.split()[1:2] == ["train.py"]]
    assert train[0] == "5,7" and train[train.index("--prompts-per-step") + 1] == "16"  # the same batch as on one GPU
    assert sorted(c.split()[0] for c in calls if "time.sleep" in c) == ["5", "7"]  # a hog a GPU, none on 9
    assert [c for c in calls if "print(int(" in c][0].count(" 45 * 2**30") == 1
    assert "rank stopped by SIGINT" in calls  # the bound reached the rank
    assert p.stdout.count("capped: cap 45 GiB") == 2 and "bfcl-s0 rc=0" in p.stdout
    first_eval = next(i for i, c in enumerate(calls) if " eval.py " in f" {c} ")
    assert calls.index("rank stopped by SIGINT") < first_eval
    p, calls = run("bfcl", GPUS="2", PROMPTS="32", CUDA_VISIBLE_DEVICES="5,7", MINUTES="0.05")  # 16 prompts a GPU
    (train,) = [c.split() for c in calls if c.split()[1:2] == ["train.py"]]
    assert p.returncode == 0 and train[train.index("--prompts-per-step") + 1] == "32"
    p, calls = run("bfcl", GPUS="4", CUDA_VISIBLE_DEVICES="5,7")
    assert p.returncode == 2 and "GPUS=4: 2 GPUs here" in p.stdout and not any("train.py" in c for c in calls)
    p, calls = run("bfcl", MINUTES="0.05")  # GPUS unset: one GPU, no torchrun
    assert p.returncode == 0 and not any("torchrun" in c for c in calls) and any(" train.py " in f" {c} " for c in calls)


def _seen_rows(tmp_path, sizes):
    """headline.sh rescue's training rows, sizes[family] of each, written where the recipe splits them (VAL) and
    repeats them (REPEAT) -> (that folder, the rows)."""
    seen = tmp_path / "data" / "out" / "mcp-seen"
    seen.mkdir(parents=True, exist_ok=True)
    rows = [{"extra_info": {"family": f, "index": i}} for f, n in sizes for i in range(n)]
    (seen / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return seen, rows


def _jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_headline_val_holds_rows_back_and_the_evals_score_the_best_policy(tmp_path):
    # VAL=K: K training rows a family (at least one left to train on) move to the val set, which train.py
    # scores as val; eval.py then scores the run's best (OUT/best), PICK=last its last checkpoint; the BFCL
    # recipe's synthesized in-run set is its val set
    run = _headline_stand_ins(tmp_path)
    seen, rows = _seen_rows(tmp_path, (("a", 5), ("b", 2)))
    p, calls = run(SEED="0", VAL="3", BASE_EVAL="0")
    assert p.returncode == 0, p.stdout + p.stderr
    held, kept = _jsonl(seen / "val.jsonl"), _jsonl(seen / "train.jsonl")
    assert sorted(r["extra_info"]["family"] for r in held) == ["a", "a", "a", "b"] and len(kept) == 3
    assert {json.dumps(r) for r in held + kept} == {json.dumps(r) for r in rows}  # a split: nothing lost or doubled
    train = next(c for c in calls if " train.py " in f" {c} ")
    assert "--eval-data val=data/out/mcp-seen/val.jsonl" in train
    models = lambda calls: [c.split()[c.split().index("--model") + 1] for c in calls if " eval.py " in f" {c} "]
    assert models(calls) == ["runs/rescue-s0/best"]
    p, calls = run(SEED="0", VAL="1", PICK="last", BASE_EVAL="0")
    assert models(calls) == ["runs/rescue-s0"]
    p, calls = run("bfcl", BASE_EVAL="0")
    assert "--eval-data val=data/out/bfcl/synth-eval.jsonl" in next(c for c in calls if " train.py " in f" {c} ")
    assert models(calls) == ["runs/bfcl-s0/best"] * 2


def test_headline_repeat_doubles_a_familys_training_rows_after_the_val_split(tmp_path):
    # REPEAT=FAMILY=N: that family's training rows N times each, after VAL took its rows out (no val row
    # trains); a family with no training rows, or a bad count, stops the recipe before training
    run = _headline_stand_ins(tmp_path)
    sizes = (("a", 5), ("b", 3))
    seen, rows = _seen_rows(tmp_path, sizes)
    p, calls = run(SEED="0", VAL="1", REPEAT="b=2", BASE_EVAL="0")
    assert p.returncode == 0, p.stdout + p.stderr
    held, kept = _jsonl(seen / "val.jsonl"), _jsonl(seen / "train.jsonl")
    assert len(held) == 2 and len(kept) == 4 + 2 * 2
    assert [r["extra_info"]["family"] for r in kept].count("b") == 4
    assert not {json.dumps(r) for r in held} & {json.dumps(r) for r in kept}  # no val row trains
    for bad in ("c=2", "b=0", "b"):
        _seen_rows(tmp_path, sizes)
        p, calls = run(SEED="0", REPEAT=bad, BASE_EVAL="0")
        assert p.returncode == 2 and f"REPEAT={bad}" in p.stderr and not any("train.py" in c for c in calls), p.stderr


def test_headline_rescue_prints_the_results_rows_from_eval_json(tmp_path):
    # after eval.py the recipe prints, a model a line, the rows the results log keeps: the trained
    # families less multi and discovery pooled by rows (state, held out, is not among them), multi,
    # discovery, state, and repeated failed calls on discovery's rows and on all rows, pooled by rows
    run = _headline_stand_ins(tmp_path)
    fam = lambda rows, p, rep=0.0: {"rows": rows, "greedy_pass@1": p, "greedy_repeat_failed": rep}
    trained = {"nanorl_mcp/arith": fam(10, 0.9), "nanorl_mcp/sales": fam(10, 0.7), "nanorl_mcp/multi": fam(5, 0.6),
               "nanorl_mcp/discovery": fam(4, 0.5, 0.25), "nanorl_mcp/state": fam(1, 0.0, 2.0)}
    base = {k: fam(v["rows"], 0.0, 1.0) for k, v in trained.items()}
    (tmp_path / "eval.json").write_text(json.dumps({"models": [{"model": "m", "by_source": base},
                                                               {"model": "runs/rescue-s3", "by_source": trained}]}))
    p, _ = run(SEED="3")
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("runs/rescue-s3: trained families less multi and discovery (20) 0.800; multi 0.600; discovery 0.500; "
            "state 0.000; repeated failed calls an episode: discovery 0.250; all 30 rows 0.100") in p.stdout
    assert "m: trained families less multi and discovery (20) 0.000;" in p.stdout and "all 30 rows 1.000" in p.stdout


class PlannedEnv(envs.Env):
    """One turn: correct when the row is easy, or when its prompt holds a plan and the episode is the
    first of its pair (a guided group with mixed rewards)."""
    tools, max_turns, made = None, 1, []

    def __init__(self, row):
        self.row, self.first = row, len(PlannedEnv.made) % 2 == 0
        PlannedEnv.made.append(self)

    def reset(self, row):
        self.planned = "Hint:" in row["prompt"][-1]["content"]
        return [dict(m) for m in row["prompt"]]

    def step(self, text):
        ok = self.row["easy"] or (self.planned and self.first)
        return [], float(ok), True, {"correct": ok}


def _collect_easy_and_hard(model, tok, rescue_spec, seen=None, rows=None, pool=None):
    """train.collect at step 0 on an easy and a hard row (2 oracle calls each; or rows), 2 episodes a row, from
    an engine that always answers "42" (the prompts it saw appended to `seen`) -> (args, run, state,
    collect's (kept, sampled, rounds, metrics)). The env: the caller's monkeypatched env_for_row; run.pool: pool."""
    from rollout import Completion, Engine

    class Scripted(Engine):
        def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
            if seen is not None:
                seen.extend(tok.decode(p) for p in prompts)
            ids = tok.encode("42", add_special_tokens=False) + [tok.eos_token_id]
            return [[Completion(ids, [-0.5] * len(ids), "stop") for _ in range(n)] for _ in prompts]

        def wake(self): pass
        def sleep(self): pass
        def load_weights(self, model): return {}

    args = train.parse_args(["--model", "x", "--prompts-per-step", "2", "--n", "2", "--max-tokens", "8",
                             "--max-context", "512", "--rescue", rescue_spec, "--tool-format", "hermes",
                             "--old-logprobs", "recompute"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = train.Run(args, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0), engine=Scripted(),
                    tokenizer=tok, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id], pool=pool)
    rows = rows or [{**_oracle_row("easy", 2), "easy": True, "data_source": "t/easy"},
                    {**_oracle_row("hard", 2), "easy": False, "data_source": "t/hard"}]
    state = {"step": 0, "data": {"epoch": 0, "pos": 0}, "skipped_updates": 0, "bad_in_a_row": 0}
    return args, run, state, train.collect(run, rows, state)


def test_collect_probes_with_a_tool_the_servers_let_a_probe_call(tiny_model, tiny_tokenizer, monkeypatch):
    from types import SimpleNamespace

    class Listing(envs.Env):  # "tables" lists the tables; any other turn ends the episode, wrong
        tools, max_turns = None, 3

        def reset(self, row):
            return [dict(m) for m in row["prompt"]]

        def step(self, text):
            if '"tables"' in text:
                return [{"role": "tool", "content": "circ, bk"}], 0.0, False, {}
            return [], 0.0, True, {"correct": False}
    monkeypatch.setattr(train.envs, "env_for_row", lambda row, *a, **kw: Listing())
    seen, pool = [], SimpleNamespace(no_argument={"tables": True, "query": False})  # pool.no_argument: MCPPool's
    rows = [_answer_row("7") | {"prompt": [{"role": "user", "content": f"How many loans {i}?"}]} for i in range(2)]
    *_, (kept, sampled, _, m) = _collect_easy_and_hard(tiny_model, tiny_tokenizer, "hint=10,source=answer,probe=1", seen,
                                                       rows, pool)
    probed = [p for p in seen if '"name": "tables"' in p]
    assert len(probed) == 4 and all("circ, bk" in p and "correct final answer" not in p for p in probed)
    assert m["rescue_probed"] == 2 and all(e.info["probe"] == "tables" for e in sampled if "hint_for" in e.info)


def test_collect_with_a_plan_samples_the_planned_prompt_and_trains_the_plain_one(tiny_model, tiny_tokenizer, monkeypatch):
    tok, seen = tiny_tokenizer, []
    monkeypatch.setattr(train.envs, "env_for_row", lambda row, *a, **kw: PlannedEnv(row))
    PlannedEnv.made = []
    args, run, state, (kept, sampled, rounds, metrics) = _collect_easy_and_hard(tiny_model, tok, "hint=10,baseline=own", seen)
    assert sum("Hint:" in p for p in seen) == 2 and "Hint:" in seen[-1]  # the planned row's 2 episodes
    assert '1. t0 {"x": "<x>"}\n2. t1 {"x": "<x>"}' in seen[-1]  # step 0: the whole plan, names and arguments
    assert '<tool_call>\n{"name": "t0", "arguments": {"x": "<x>"}}\n</tool_call>' in seen[-1].split("Make only call 1 now")[1]  # hermes
    plain = [e for e in sampled if "hint_for" not in e.info]
    guided = [e for e in kept if "hint_for" in e.info]
    hard = guided[0].info["hint_for"]
    assert [e.info["correct"] for e in guided] == [True, False] and metrics["rescue_hint_turns"] == 2.0
    assert all(e.prompt_ids == next(p for p in plain if p.group == hard).prompt_ids for e in guided)
    assert "Hint:" not in tok.decode(guided[0].prompt_ids)
    w0 = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    m = train.train_step(run, kept, state)
    assert [e.info["advantage"] for e in guided] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-4)
    assert m["live_frac"] == 0.5 and any(not torch.equal(w0[k], v) for k, v in tiny_model.state_dict().items())


def test_collect_with_a_joint_baseline_trains_both_groups(tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(train.envs, "env_for_row", lambda row, *a, **kw: PlannedEnv(row))
    PlannedEnv.made = []
    args, run, state, (kept, sampled, rounds, metrics) = _collect_easy_and_hard(tiny_model, tiny_tokenizer, "hint=10,baseline=joint")
    guided = [e for e in kept if "hint_for" in e.info]
    hard = guided[0].info["hint_for"]
    assert len(kept) == 6 and metrics["rescue_joined"] == 2  # 2 prompts x 2, and the joined pair: none cut
    assert [e.group for e in kept].count(hard) == 4 and [e.info["correct"] for e in guided] == [True, False]
    train.train_step(run, kept, state)
    adv = {id(e): e.info["advantage"] for e in kept}
    unguided = [e for e in kept if e.group == hard and "hint_for" not in e.info]
    assert all(adv[id(e)] < 0 for e in unguided) and adv[id(guided[0])] > 0  # against the four's mean


class HintedEnv(envs.Env):
    """Multi-turn toy: a turn holding "<tool_call>" is a tool call (observation "ok"); any other turn is the
    final answer, correct when the row is easy, or when the episode made a call first (a hint) and it
    is the first of its pair of episodes (a guided group with mixed rewards)."""
    tools, max_turns, made = None, 4, []

    def __init__(self, row):
        self.row, self.called, self.first = row, False, len(HintedEnv.made) % 2 == 0
        HintedEnv.made.append(self)

    def reset(self, row):
        return [dict(m) for m in row["prompt"]]

    def step(self, text):
        if "<tool_call>" in text:
            self.called = True
            return [{"role": "user", "content": "ok"}], 0.0, False, {}
        ok = self.row["easy"] or (self.called and self.first)
        return [], float(ok), True, {"correct": ok}


def test_collect_guides_an_all_wrong_group_and_it_trains(tiny_model, tiny_tokenizer, monkeypatch):
    # two prompts x 2 episodes with --rescue hint=10 at step 0: the easy prompt passes; the hard one is
    # all wrong, so it is re-sampled with its first oracle call given (1 of 2). The guided group
    # replaces it in the episodes that train (hint tokens mask 0); `sampled` shows it after the group it
    # replays, and the step's metrics skip it
    tok = tiny_tokenizer
    made_with = []
    monkeypatch.setattr(train.envs, "env_for_row", lambda row, *a, **kw: made_with.append(kw) or HintedEnv(row))
    HintedEnv.made = []
    args, run, state, (kept, sampled, rounds, metrics) = _collect_easy_and_hard(tiny_model, tok, "hint=10,credit=0.25,guide=prefix,baseline=own")
    assert len(made_with) == 6 and all(kw.get("partial_credit") == 0.25 for kw in made_with)  # the env scores credit=W
    assert rounds == 1 and len(kept) == 4 and len(sampled) == 6
    plain = [e for e in sampled if "hint_for" not in e.info]
    hard = next(g for g in {e.group for e in plain} if not any(e.info["correct"] for e in plain if e.group == g))
    pos = [i for i, e in enumerate(plain) if e.group == hard]
    guided = [kept[i] for i in pos]
    assert len({e.group for e in guided}) == 1 and guided[0].group not in {e.group for e in plain}
    assert all(e.info["hint_turns"] == 1 and e.info["hint_for"] == hard for e in guided)
    assert [e.info["correct"] for e in guided] == [True, False]
    assert [kept[i] for i in range(4) if i not in pos] == [e for e in plain if e.group != hard]
    at = sampled.index(guided[0])  # shown right after the group it replays
    assert sampled[at - 1].group == hard and sampled[at:at + 2] == guided
    from support.logs import episode_metrics
    assert episode_metrics(sampled, 4, 1)["reward_mean"] == episode_metrics(plain, 4, 1)["reward_mean"]
    # every episode carries its row's data_source; the step's pass rate per source skips the guided replays
    assert [e.info["source"] for e in plain] == ["t/easy"] * 2 + ["t/hard"] * 2
    by_source = episode_metrics(sampled, 4, 1)
    assert by_source["correct/t/easy"] == 1.0 and by_source["correct/t/hard"] == 0.0
    assert not any(k.startswith("correct/") for k in episode_metrics(plain[:2], 2, 1))  # one source: no split
    assert metrics["rescue_groups"] == 1 and metrics["rescue_solved"] == 1.0 and metrics["rescue_hint_turns"] == 1.0
    assert metrics["rescue_passed/t/hard"] == 1 and "rescue_passed/t/easy" not in metrics  # by the row's source
    batch = train.episodes_to_batch(kept, tok.pad_token_id)
    hint = tok.encode('<tool_call>\n{"name": "t0", "arguments": {"x": 0}}\n</tool_call>', add_special_tokens=False)
    hint += [tok.eos_token_id]  # hermes' render (mcp_tools/formats.py), then the end of turn
    for i in pos:  # the hint's tokens sit right after the prompt, mask 0
        P = len(kept[i].prompt_ids)
        assert batch["input_ids"][i, P:P + len(hint)].tolist() == hint
        assert batch["loss_mask"][i, P:P + len(hint)].sum() == 0 and batch["loss_mask"][i].sum() > 0
    w0 = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    m = train.train_step(run, kept, state)
    assert [kept[i].info["advantage"] for i in pos] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-4)
    assert m["live_frac"] == 0.5 and any(not torch.equal(w0[k], v) for k, v in tiny_model.state_dict().items())


def test_guided_groups_are_shown_beside_the_groups_they_replay():
    plain = [_ep(0, False), _ep(0, False), _ep(1, True), _ep(1, False), _ep(2, False), _ep(2, False)]
    g5 = [_ep(5, True, 1.0), _ep(5, True, 1.0)]  # replays that pass: counted, they would lift the means
    g6 = [_ep(6, False), _ep(6, False)]
    for e in g5:
        e.info["hint_for"] = 0
    for e in g6:
        e.info["hint_for"] = 2
    kept = g5 + plain[2:4] + g6  # what rescue.guide returns: guided groups in place of groups 0 and 2
    shown = rescue.beside(plain, kept)
    assert [e.group for e in shown] == [0, 0, 5, 5, 1, 1, 2, 2, 6, 6]
    assert rescue.beside(plain, plain) == plain  # nothing guided: unchanged
    from support.logs import episode_metrics
    m, m_plain = episode_metrics(shown, 6, 1), episode_metrics(plain, 6, 1)
    assert m["reward_mean"] == m_plain["reward_mean"] and m["correct"] == m_plain["correct"]


# ---- sft.py: oracle replays against the real bundled MCP server, the token layout (the same as an
# RL episode's), and a short training run that lowers the loss and saves an HF folder

@pytest.fixture(scope="module")
def pool():
    with MCPPool(bundled_config(), call_timeout=10.0) as p:
        yield p


@pytest.fixture(scope="module")
def rows():
    train, _ = mcp_rows(seed=0)
    by_family = {}
    for r in train:
        by_family.setdefault(r["extra_info"]["family"], r)
    return list(by_family.values())  # one row of every family, multi-call and state tasks included


class ReplayEngine:
    """Answers each episode's turns with given texts, in order (one episode at a time)."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.k = tok, texts, 0

    def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
        ids = self.tok.encode(self.texts[self.k], add_special_tokens=False) + [self.tok.eos_token_id]
        self.k += 1
        return [[Completion(ids, [0.0] * len(ids), "stop")]]


def test_oracle_replays_score_one_and_match_the_rl_layout(pool, rows, tiny_tokenizer):
    tok = tiny_tokenizer
    for row in rows:
        prompt, turns, reward = sft.oracle_turns(MCPEnv(pool=pool), row)
        assert reward == 1.0, row["extra_info"]["family"]
        assert len(turns) == len(row["extra_info"]["oracle_calls"]) + 1
        assert all(obs and not obs[0]["content"].startswith("Error") for _, obs in turns[:-1])
        sft_ep = sft.tokenize_trajectory(tok, prompt, turns, pool.tools)
        # the RL loop, fed the same turns, builds the very same tokens and mask
        ep = run_episodes(ReplayEngine(tok, [t for t, _ in turns]), tok, [row], lambda r: MCPEnv(pool=pool), n=1,
                          temperature=1.0, top_p=1.0, max_tokens=2000, max_turns=None, max_context=100000)[0]
        assert ep.reward == 1.0 and ep.finish_reason == "stop"
        assert sft_ep.prompt_ids == ep.prompt_ids and sft_ep.response_ids == ep.response_ids
        assert sft_ep.response_mask == ep.response_mask
        # mask 1 decodes to exactly the assistant turns, each closed by EOS
        assert tok.decode([t for t, m in zip(sft_ep.response_ids, sft_ep.response_mask) if m]) == \
            "".join(t + "<|im_end|>" for t, _ in turns)


def test_rows_without_oracle_or_failing_replay_are_skipped(pool, rows, tiny_tokenizer):
    bad = json.loads(json.dumps(rows[0]))
    bad["extra_info"]["oracle_answer"] = "definitely wrong"
    bare = {k: v for k, v in rows[0].items() if k != "extra_info"}
    ex, skipped = sft.build_examples([rows[0], bad, bare], lambda r: MCPEnv(pool=pool), tiny_tokenizer,
                                     pool.tools, max_len=100000, progress=False)
    assert len(ex) == 1 and skipped == {"no_oracle": 1, "reward": 1, "too_long": 0}
    ex, skipped = sft.build_examples([rows[0]], lambda r: MCPEnv(pool=pool), tiny_tokenizer, pool.tools,
                                     max_len=100, progress=False)
    assert ex == [] and skipped["too_long"] == 1


def test_sft_lowers_loss_and_saves_a_loadable_model(tiny_model_dir, tmp_path):
    out = tmp_path / "sft"
    res = sft.main(["--model", tiny_model_dir, "--rows", "2", "--epochs", "8", "--batch-size", "2",
                    "--micro-batch-size", "1", "--lr", "1e-2", "--warmup-steps", "1", "--max-len", "100000",
                    "--out-dir", str(out), "--no-progress"])
    assert res["examples"] == 2 and res["steps"] == 8
    losses = [json.loads(line)["loss"] for line in open(out / "sft_metrics.jsonl")]
    assert len(losses) == 8 and losses[-1] < 0.75 * losses[0]  # same 2 trajectories every step
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(out)
    assert "tool" in AutoTokenizer.from_pretrained(out).chat_template
    assert not list(tmp_path.glob("sft.*"))  # the temporary folders are gone


def test_micro_batches_equal_one_batch(tiny_model, tiny_tokenizer):
    # the loss divides by the whole batch's token count, so accumulation is exact
    from rollout import Episode, episodes_to_batch
    g = torch.Generator().manual_seed(0)
    batch = []
    for n in (7, 12, 9):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        batch.append(Episode(ids[:3], ids[3:], [1] * (n - 3), [0.0] * (n - 3), 1.0, "stop", 0))
    n_tok = sum(sum(e.response_mask) for e in batch)
    off = lambda: torch.autocast("cpu", enabled=False)
    whole = sft.sft_loss(tiny_model, episodes_to_batch(batch, 0), n_tok, off, "cpu")
    parts = sum(sft.sft_loss(tiny_model, episodes_to_batch([b], 0), n_tok, off, "cpu") for b in batch)
    assert float(whole.detach()) == pytest.approx(float(parts.detach()), rel=1e-5)


def test_sft_on_a_one_call_selection(tiny_model_dir, tmp_path):
    # the SmolLM2 held-out study's warm start (docs/results.md): --train-data a file of 1-call tasks only
    from mcp_tools.tasks import n_calls, select_rows
    from support.rows import load_rows, save_rows
    path = tmp_path / "1call.jsonl"
    save_rows(select_rows(mcp_rows(seed=0)[0], max_calls=1), str(path))
    res = sft.main(["--model", tiny_model_dir, "--train-data", str(path), "--rows", "3", "--epochs", "1",
                    "--batch-size", "3", "--micro-batch-size", "3", "--max-len", "100000",
                    "--out-dir", str(tmp_path / "sft"), "--no-progress"])
    assert res["examples"] == 3 and res["steps"] == 1 and res["train_s"] >= 0
    assert all(n_calls(r) == 1 for r in load_rows(str(path)))

# ---------------------------------------------------------------------------------------------
# the plots of a warm-start + RL run: logs.write_plot (OUT/curves.png), lab/plot_runs.py


def _fake_metrics(path, steps=6, entropy=True, eval_only=False):
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "eval_pass1": 0.1, "eval_reward": 0.1}) + "\n")
        for s in range(1, 0 if eval_only else steps + 1):
            m = {"step": s, "reward_mean": 0.1 + 0.05 * s, "loss": 0.0}
            if entropy:
                m["entropy"] = 0.5 - 0.03 * s
            if s % 3 == 0:
                m["eval_pass1"] = 0.1 + 0.04 * s
            f.write(json.dumps(m) + "\n")


@pytest.mark.parametrize("entropy,config", [(True, True), (False, False)])
def test_write_plot_with_and_without_entropy(tmp_path, entropy, config):
    from support import logs
    out = tmp_path / "run"
    out.mkdir()
    _fake_metrics(out / "metrics.jsonl", entropy=entropy)
    if config:
        (out / "config.json").write_text(json.dumps({"env": "mcp", "model": "/tmp/sft1"}))
    logs.write_plot(out)
    assert (out / "curves.png").stat().st_size > 0
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_pass1": 0.2}) + "\n")  # eval only
    logs.write_plot(str(out))
    assert (out / "curves.png").stat().st_size > 0


def test_plot_runs_metric_mode(tmp_path):
    from conftest import load_script
    plot_runs = load_script("lab/plot_runs.py")
    rl, once = tmp_path / "rl.jsonl", tmp_path / "once.jsonl"
    _fake_metrics(rl)
    _fake_metrics(once, eval_only=True)
    assert plot_runs.points(rl, "eval_pass1") == [(0, 0.1), (3, pytest.approx(0.22)), (6, pytest.approx(0.34))]
    plot_runs.main([str(tmp_path / "a.png"), "held out", "--metric", "eval_pass1",
                    "--label", "SFT-only", str(once), "--label", "SFT+RL", str(rl)])
    plot_runs.main([str(tmp_path / "b.png"), "two panels", f"rl={rl}"])  # the docs/ figures' form
    assert plot_runs.points(rl, "eval_pass1", max_step=4) == [(0, 0.1), (3, pytest.approx(0.22))]
    plot_runs.main([str(tmp_path / "d.png"), "panels", "--metric", "entropy,eval_pass1", "--max-step", "4", f"rl={rl}"])
    assert (tmp_path / "d.png").stat().st_size > 0
    # entropy_live: a no-KL run's entropy stands in for it; a KL run's entropy (over all groups) does not
    assert plot_runs.points(rl, "entropy_live", max_step=2) == [(1, pytest.approx(0.47)), (2, pytest.approx(0.44))]
    kl = tmp_path / "kl.jsonl"
    kl.write_text(json.dumps({"step": 1, "entropy": 0.5, "kl": 0.01}) + "\n")
    assert plot_runs.points(kl, "entropy_live") == []
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        plot_runs.main([str(tmp_path / "c.png"), "no runs", "--metric", "eval_pass1"])
