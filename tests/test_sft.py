"""Tests for sft.py: oracle replays against the real bundled MCP server, the token layout (the
same as an RL episode's), and a short training run that lowers the loss and saves an HF folder.

CPU, tiny random model and byte-level tokenizer from conftest.py. Run: python -m pytest -q tests/test_sft.py
"""
import json

import pytest
import torch

import sft
from mcp_tools.tasks import mcp_rows
from mcp_tools.env import MCPEnv
from mcp_tools.config import bundled_config
from mcp_tools.pool import MCPPool
from rollout import Completion, run_episodes


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
