"""Tests for rollout.py: HFEngine sampling, the episode loop's masks and finish reasons, batching;
and for sync.py and VLLMEngine's sync state with a stand-in for vLLM (the last section).

CPU only, tiny random model from conftest.py, a few seconds. Run: python -m pytest -q tests/test_rollout.py
"""
import math
import random
import time
import types

import pytest
import torch

import score
import sync
import vllm_engine
from conftest import make_tiny_model
from rollout import (Completion, Engine, Episode, HFEngine, episodes_to_batch, observation_ids,
                     render_prompt, run_episodes)

PROMPT = [{"role": "user", "content": "What is 3*4?"}]


class ToyEnv:
    """Multi-turn toy: answers every turn with 'obs<k>', done (reward 1) after `done_after` turns."""
    tools = None

    def __init__(self, max_turns=5, done_after=3, fail_on=None):
        self.max_turns, self.done_after, self.fail_on = max_turns, done_after, fail_on
        self.k, self.closed, self.texts = 0, False, []

    def reset(self, row):
        return list(row["prompt"])

    def step(self, text):
        self.k += 1
        self.texts.append(text)
        if self.fail_on == self.k:
            raise RuntimeError("tool exploded")
        if self.k >= self.done_after:
            return [], 1.0, True, {"k": self.k}
        return [{"role": "user", "content": f"obs{self.k}"}], 0.25, False, {"k": self.k}

    def close(self):
        self.closed = True


class ScriptedEngine(Engine):
    """Always answers `text` (+ EOS) with logprob -0.5 per token; records every call."""

    def __init__(self, tok, text="abc", eos=True):
        self.ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
        self.eos, self.calls = eos, []

    def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
        self.calls.append((prompts, max_tokens))
        ids = self.ids[:max_tokens]
        reason = "stop" if self.eos and len(ids) == len(self.ids) else "length"
        lps = [-0.5] * len(ids) if logprobs else None  # like VLLMEngine, skip them when not asked
        return [[Completion(list(ids), lps, reason) for _ in range(n)] for _ in prompts]


class RecordingEngine(Engine):
    """Wraps an engine and keeps every completion it returned, per prompt (as a tuple key)."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
        out = self.inner.generate(prompts, n, temperature, top_p, max_tokens, stop_token_ids, logprobs)
        self.log.append((prompts, out))
        return out


class SlowToyEnv(ToyEnv):
    """ToyEnv whose step sleeps `sleep_s` on the turns in `slow_on` (a hanging tool call); records
    when each step returned."""

    def __init__(self, slow_on=(), sleep_s=3.0, **kw):
        super().__init__(**kw)
        self.slow_on, self.sleep_s, self.returned = set(slow_on), sleep_s, []

    def step(self, text):
        if self.k + 1 in self.slow_on:
            time.sleep(self.sleep_s)
        try:
            return super().step(text)
        finally:
            self.returned.append(time.perf_counter())


class TimedEngine(ScriptedEngine):
    """ScriptedEngine that also records when each generate call started."""

    def __init__(self, tok, text="abc"):
        super().__init__(tok, text)
        self.times = []

    def generate(self, prompts, *a, **kw):
        self.times.append(time.perf_counter())
        return super().generate(prompts, *a, **kw)


def _rows(k=1):
    return [{"prompt": PROMPT, "env_class": "toy"} for _ in range(k)]


# ---- HFEngine

def test_hf_greedy_batched_equals_unbatched(tiny_model, tiny_tokenizer):
    # left padding + position ids must make a row's tokens independent of its batch mates
    eng = HFEngine(tiny_model, tiny_tokenizer)
    p1 = render_prompt(tiny_tokenizer, PROMPT)
    p2 = p1[:7]
    batched = eng.generate([p1, p2], n=1, temperature=0, top_p=1.0, max_tokens=12)
    single = [eng.generate([p], n=1, temperature=0, top_p=1.0, max_tokens=12)[0] for p in (p1, p2)]
    assert [c[0].token_ids for c in batched] == [c[0].token_ids for c in single]
    for b, s in zip(batched, single):
        assert b[0].logprobs == pytest.approx(s[0].logprobs, abs=1e-4)


def test_kv_cache_goes_by_the_name_the_forward_takes():
    # transformers renamed past_key_values to cache (the old name is marked for removal in 5.40):
    # the HF engine passes its cache by the name the model's forward takes, and reads it back
    import rollout

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return {"past_key_values": "kv-old"}

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=False):
            return {"cache": "kv-new"}

    for m, name in ((Old(), "past_key_values"), (New(), "cache")):
        kw = rollout.with_cache(m, "kv")
        assert kw == {name: "kv", "use_cache": True}
        assert rollout.cache_of(m(None, **kw)) == f"kv-{type(m).__name__.lower()}"


def test_hf_stop_vs_length(tiny_model, tiny_tokenizer):
    eng = HFEngine(tiny_model, tiny_tokenizer)
    p = render_prompt(tiny_tokenizer, PROMPT)
    c = eng.generate([p], n=1, temperature=0, top_p=1.0, max_tokens=6)[0][0]
    assert len(c.token_ids) == 6 and c.finish_reason == "length"
    # make the 3rd greedy token a stop token: output is cut right after its first occurrence
    s = c.token_ids[2]
    c2 = eng.generate([p], n=1, temperature=0, top_p=1.0, max_tokens=6, stop_token_ids=[s])[0][0]
    k = c.token_ids.index(s) + 1
    assert c2.token_ids == c.token_ids[:k] and c2.finish_reason == "stop"
    assert len(c2.logprobs) == len(c2.token_ids)


def test_hf_logprobs_match_trainer(tiny_model, tiny_tokenizer):
    # engine logprobs at T = 0.7 equal score.token_logprobs of a plain forward over the same tokens
    torch.manual_seed(0)
    eng = HFEngine(tiny_model, tiny_tokenizer)
    p = render_prompt(tiny_tokenizer, PROMPT)
    outs = eng.generate([p, p[:9]], n=2, temperature=0.7, top_p=1.0, max_tokens=10)
    for prompt, group in zip([p, p[:9]], outs):
        assert len(group) == 2
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = tiny_model(ids).logits[:, :-1]
            lp = score.token_logprobs(logits, ids[:, 1:], temperature=0.7)[0][0, len(prompt) - 1:]  # (logp, None)
            assert lp.tolist() == pytest.approx(c.logprobs, abs=1e-4)


def test_hf_tiny_top_p_is_greedy(tiny_model, tiny_tokenizer):
    eng = HFEngine(tiny_model, tiny_tokenizer)
    p = render_prompt(tiny_tokenizer, PROMPT)
    greedy = eng.generate([p], n=1, temperature=0, top_p=1.0, max_tokens=8)[0][0]
    nucleus = eng.generate([p], n=3, temperature=1.0, top_p=1e-6, max_tokens=8)[0]
    assert all(c.token_ids == greedy.token_ids for c in nucleus)


def test_hf_shared_model_load_weights_is_free(tiny_model, tiny_tokenizer):
    assert HFEngine(tiny_model, tiny_tokenizer).load_weights(tiny_model)["shared"] is True


# ---- the episode loop

def test_multiturn_tokens_and_mask_exact(tiny_tokenizer):
    # scripted policy "abc<|im_end|>": prompt + response must decode to exactly the chat template
    # of the whole conversation (minus the never-sampled glue after the final <|im_end|>)
    tok = tiny_tokenizer
    eng = ScriptedEngine(tok, "abc")
    envs = []

    def mk(row):
        envs.append(ToyEnv(done_after=3))
        return envs[-1]

    eps = run_episodes(eng, tok, _rows(2), mk, n=2, temperature=1.0, top_p=1.0, max_tokens=16,
                       max_turns=None, max_context=512)
    assert len(eps) == 4 and [e.group for e in eps] == [0, 0, 1, 1]
    conv = PROMPT + [{"role": "assistant", "content": "abc"}, {"role": "user", "content": "obs1"},
                     {"role": "assistant", "content": "abc"}, {"role": "user", "content": "obs2"},
                     {"role": "assistant", "content": "abc"}]
    want = tok.apply_chat_template(conv, tokenize=False)
    assert want.endswith("<|im_end|>\n")
    for e in eps:
        assert tok.decode(e.prompt_ids + e.response_ids) == want[:-1]
        assert e.finish_reason == "stop" and e.info["turns"] == 3
        assert e.reward == pytest.approx(0.25 + 0.25 + 1.0)
        sampled = [t for t, m in zip(e.response_ids, e.response_mask) if m == 1]
        assert sampled == eng.ids * 3
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.response_mask) if m == 0)
        assert all(lp == -0.5 for lp, m in zip(e.logprobs, e.response_mask) if m == 1)
    assert all(env.closed for env in envs) and envs[0].texts == ["abc"] * 3


def test_group_ids_name_each_rows_episodes(tiny_tokenizer):
    # a rank's share of a step (rank 1 of 2, second resampling round of 4 prompts a round): its
    # rows are the step's rows 1 and 3, so their groups are 1 + 4 and 3 + 4, from the start
    tok = tiny_tokenizer
    kw = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=8, max_turns=None, max_context=512)
    eps = run_episodes(ScriptedEngine(tok), tok, _rows(2), lambda row: ToyEnv(done_after=1),
                       group_ids=[5, 7], **kw)
    assert [e.group for e in eps] == [5, 5, 7, 7]
    assert episodes_to_batch(eps, tok.pad_token_id)["groups"].tolist() == [5, 5, 7, 7]
    default = run_episodes(ScriptedEngine(tok), tok, _rows(2), lambda row: ToyEnv(done_after=1), **kw)
    assert [e.group for e in default] == [0, 0, 1, 1]  # the row's index
    assert [e.response_ids for e in default] == [e.response_ids for e in eps]
    with pytest.raises(ValueError, match="1 group_ids for 2 rows"):
        run_episodes(ScriptedEngine(tok), tok, _rows(2), lambda row: ToyEnv(), group_ids=[0], **kw)


def test_prompts_rendered_per_episode_messages(tiny_tokenizer):
    # run_episodes encodes each distinct prompt text once (render_prompt's cache); an env whose
    # reset differs per episode (here: the 3rd env of each row, and tools on row 1) must still get
    # its own prompt, and no two episodes share a prompt_ids list
    tok, made = tiny_tokenizer, []
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]

    class VaryingEnv(ToyEnv):
        def __init__(self, k, row):
            super().__init__(done_after=1)
            self.k0, self.tools = k, (tools if row["i"] == 1 and k % 2 else None)

        def reset(self, row):
            return list(row["prompt"]) + ([{"role": "user", "content": "again"}] if self.k0 % 4 == 2 else [])

    def mk(row):
        made.append(VaryingEnv(len(made) % 4, row))
        return made[-1]

    rows = [{"prompt": PROMPT, "i": i} for i in range(2)]
    eps = run_episodes(ScriptedEngine(tok), tok, rows, mk, n=4, temperature=1.0, top_p=1.0, max_tokens=8,
                       max_turns=None, max_context=512)
    for e, env, row in zip(eps, made, [r for r in rows for _ in range(4)]):
        assert e.prompt_ids == render_prompt(tok, env.reset(row), env.tools)
    assert len({id(e.prompt_ids) for e in eps}) == len(eps)
    # row 0: plain plain again plain; row 1: plain tools again tools -> 3 distinct prompts
    assert len({tuple(e.prompt_ids) for e in eps}) == 3


def test_multiturn_mask_covers_sampled_tokens_hf(tiny_model, tiny_tokenizer):
    # the real engine: mask-1 positions are exactly the engine's completions, in order, and the
    # mask-0 runs are exactly the rendered observations
    tok = tiny_tokenizer
    eng = RecordingEngine(HFEngine(tiny_model, tok))
    eps = run_episodes(eng, tok, _rows(1), lambda row: ToyEnv(done_after=3), n=2, temperature=1.0,
                       top_p=1.0, max_tokens=5, max_turns=None, max_context=1024)
    for j, e in enumerate(eps):
        turns = [out[j][0] for _, out in eng.log]
        pos, k = 0, 1
        for c in turns:
            assert e.response_ids[pos:pos + len(c.token_ids)] == c.token_ids
            assert e.response_mask[pos:pos + len(c.token_ids)] == [1] * len(c.token_ids)
            assert e.logprobs[pos:pos + len(c.token_ids)] == c.logprobs
            pos += len(c.token_ids)
            if pos < len(e.response_ids):
                obs = observation_ids(tok, [{"role": "user", "content": f"obs{k}"}], None, c.token_ids[-1])
                assert e.response_ids[pos:pos + len(obs)] == obs
                assert e.response_mask[pos:pos + len(obs)] == [0] * len(obs)
                pos, k = pos + len(obs), k + 1
        assert pos == len(e.response_ids)
        # 5 random tokens rarely hit EOS: then the turn was cut -> "length" after turn 1
        assert e.finish_reason in ("length", "stop")


def test_context_limit_sets_length(tiny_tokenizer):
    tok = tiny_tokenizer
    P = len(render_prompt(tok, PROMPT))
    for max_context in (P + 2, P + 4, P + 12):  # cut mid-turn, exactly at a turn end, in an observation
        eps = run_episodes(ScriptedEngine(tok, "abc"), tok, _rows(1), lambda row: ToyEnv(done_after=9),
                           n=1, temperature=1.0, top_p=1.0, max_tokens=16, max_turns=None,
                           max_context=max_context)
        e = eps[0]
        assert e.finish_reason == "length", max_context
        assert len(e.prompt_ids) + len(e.response_ids) <= max_context
        assert e.response_mask[-1] == 1  # never ends on a half-appended observation
    # per-turn max_tokens cut: also "length"
    e = run_episodes(ScriptedEngine(tok, "abcdef"), tok, _rows(1), lambda row: ToyEnv(), n=1,
                     temperature=1.0, top_p=1.0, max_tokens=3, max_turns=None, max_context=512)[0]
    assert e.finish_reason == "length" and len(e.response_ids) == 3
    # a prompt that alone fills the context: empty response, "length"
    e = run_episodes(ScriptedEngine(tok), tok, _rows(1), lambda row: ToyEnv(), n=1, temperature=1.0,
                     top_p=1.0, max_tokens=3, max_turns=None, max_context=P)[0]
    assert e.finish_reason == "length" and e.response_ids == []


def test_max_turns_and_errors(tiny_tokenizer):
    tok = tiny_tokenizer
    e = run_episodes(ScriptedEngine(tok), tok, _rows(1), lambda row: ToyEnv(max_turns=5, done_after=99),
                     n=1, temperature=1.0, top_p=1.0, max_tokens=8, max_turns=2, max_context=512)[0]
    assert e.finish_reason == "max_turns" and e.info["turns"] == 2 and e.response_mask[-1] == 1
    e = run_episodes(ScriptedEngine(tok), tok, _rows(1), lambda row: ToyEnv(fail_on=2), n=1,
                     temperature=1.0, top_p=1.0, max_tokens=8, max_turns=None, max_context=512)[0]
    assert e.finish_reason == "error" and "tool exploded" in e.info["error"]
    assert e.reward == pytest.approx(0.25)  # the first turn's reward stays


def test_slow_step_does_not_hold_the_batch(tiny_tokenizer):
    # episode 1's first env.step hangs 3 s; the other three must play all 4 of their turns meanwhile
    tok, SLOW = tiny_tokenizer, 3.0
    kw = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=16, max_turns=None, max_context=512)
    envs = []

    def mk(row):
        envs.append(SlowToyEnv(slow_on=[1] if len(envs) == 1 else [], sleep_s=SLOW, done_after=4))
        return envs[-1]

    eng, timing = TimedEngine(tok), {}
    t0 = time.perf_counter()
    eps = run_episodes(eng, tok, _rows(2), mk, timing=timing, **kw)
    wall = time.perf_counter() - t0
    slow_back = envs[1].returned[0]
    # rounds: all 4, then the 3 fast ones for turns 2-4, then the straggler alone for its turns 2-4
    assert [len(p) for p, _ in eng.calls] == [4, 3, 3, 3, 1, 1, 1]
    assert eng.times[3] < slow_back - 1.0 < eng.times[4]  # fast turns 2-4 ran while it hung
    assert envs[0].returned[-1] < slow_back - 1.0  # and the fast episodes' last steps too
    assert SLOW <= wall < SLOW + 1.5  # one 3 s wait in all, not 3 s per turn
    assert SLOW - 1.0 < timing["env_s"] < wall and timing["generate_s"] < wall - timing["env_s"] + 1e-6
    assert all(env.closed for env in envs)
    # the results are exactly those of a run where nobody hangs, and that run is today's lockstep
    fast = TimedEngine(tok)
    assert eps == run_episodes(fast, tok, _rows(2), lambda row: ToyEnv(done_after=4), **kw)
    assert [len(p) for p, _ in fast.calls] == [4, 4, 4, 4]
    assert all(e.finish_reason == "stop" and e.info["turns"] == 4 for e in eps)


def test_fast_steps_keep_lockstep_rounds(tiny_tokenizer):
    # episodes that end after 1..4 turns: with quick steps the default rounds are the lockstep ones
    tok = tiny_tokenizer
    kw = dict(n=4, temperature=1.0, top_p=1.0, max_tokens=16, max_turns=None, max_context=512)
    runs = []
    for wait_s in (0.5, None):
        eng, k = ScriptedEngine(tok), iter(range(4))
        eps = run_episodes(eng, tok, _rows(1), lambda row: ToyEnv(done_after=next(k) + 1),
                           straggler_wait_s=wait_s, **kw)
        runs.append((eng.calls, eps))
    assert [len(p) for p, _ in runs[0][0]] == [4, 3, 2, 1]
    assert runs[0] == runs[1]


def test_staggered_slow_steps_overlap(tiny_tokenizer):
    # episode j hangs on turn j+1, so every lockstep round would hold one 3 s step (~9 s in all);
    # with stragglers left behind the three hangs overlap (~3 s + two grace periods). Episode 3
    # hangs and then raises: still "error", with the first turn's reward.
    tok, SLOW = tiny_tokenizer, 3.0
    envs = [SlowToyEnv(slow_on=[1], done_after=3), SlowToyEnv(slow_on=[2], done_after=3),
            SlowToyEnv(slow_on=[3], done_after=3), SlowToyEnv(slow_on=[2], done_after=3, fail_on=2)]
    it = iter(envs)
    t0 = time.perf_counter()
    eps = run_episodes(TimedEngine(tok), tok, _rows(1), lambda row: next(it), n=4, temperature=1.0,
                       top_p=1.0, max_tokens=16, max_turns=None, max_context=512)
    wall = time.perf_counter() - t0
    assert wall < 2 * SLOW
    assert [e.finish_reason for e in eps] == ["stop", "stop", "stop", "error"]
    assert [e.reward for e in eps] == pytest.approx([1.5, 1.5, 1.5, 0.25])
    assert "tool exploded" in eps[3].info["error"] and all(env.closed for env in envs)


def test_episodes_to_batch():
    eps = [Episode([5, 6], [7, 8, 9], [1, 0, 1], [-1.0, 0.0, -2.0], 1.0, "stop", 0),
           Episode([5], [7], [1], [-3.0], 0.0, "length", 0),
           Episode([4, 4, 4], [], [], [], 0.5, "length", 1)]
    b = episodes_to_batch(eps, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0], [4, 4, 4, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert b["logprobs"].tolist() == [[0, 0, -1, 0, -2], [0, -3, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert b["rewards"].tolist() == [1.0, 0.0, 0.5] and b["groups"].tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="lengths differ"):
        episodes_to_batch([Episode([1], [2, 3], [1], [0.0, 0.0], 0.0, "stop", 0)], pad_id=0)


def _episodes_to_batch_reference(episodes, pad_id):
    """The straightforward per-episode loop episodes_to_batch replaced (it was the implementation)."""
    B, T = len(episodes), max(len(e.prompt_ids) + len(e.response_ids) for e in episodes)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    logprobs = torch.zeros((B, T), dtype=torch.float32)
    for i, e in enumerate(episodes):
        P, R = len(e.prompt_ids), len(e.response_ids)
        input_ids[i, :P + R] = torch.tensor(e.prompt_ids + e.response_ids, dtype=torch.long)
        attention_mask[i, :P + R] = 1
        loss_mask[i, P:P + R] = torch.tensor(e.response_mask, dtype=torch.float32)
        lp = torch.tensor(e.logprobs, dtype=torch.float32)
        logprobs[i, P:P + R] = torch.where(loss_mask[i, P:P + R] > 0, lp, torch.zeros_like(lp))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "logprobs": logprobs, "rewards": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            "groups": torch.tensor([e.group for e in episodes], dtype=torch.long)}


@pytest.mark.parametrize("seed", range(5))
def test_episodes_to_batch_matches_reference(seed):
    # random episodes: empty responses (and one empty prompt), env segments (mask 0, logprob 0.0),
    # NaN logprobs (logprobs=False) on some policy tokens; every tensor equal bit for bit
    rng = random.Random(seed)
    eps = []
    for i in range(rng.randint(1, 40)):
        P = 0 if i == 3 else rng.randint(1, 30)
        ids, mask, lps = [], [], []
        for _ in range(rng.choice([0, 0, 1, 2, 3])):  # turns: policy segment, then maybe an env segment
            for m in (1, 0):
                k = rng.randint(0 if m else 1, 12)
                ids += [rng.randrange(50_000) for _ in range(k)]
                mask += [m] * k
                lps += [(math.nan if rng.random() < 0.2 else -rng.expovariate(1.0)) if m else 0.0 for _ in range(k)]
        eps.append(Episode([rng.randrange(50_000) for _ in range(P)], ids, mask, lps,
                           rng.choice([0.0, 1.0, -0.5, 1 / 3]), "stop", i // 4))
    pad = rng.choice([0, 7, 256])
    got, ref = episodes_to_batch(eps, pad), _episodes_to_batch_reference(eps, pad)
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape, k
        if ref[k].is_floating_point():  # bit patterns: NaN == NaN, -0.0 != 0.0
            assert torch.equal(got[k].view(torch.int32), ref[k].view(torch.int32)), k
        else:
            assert torch.equal(got[k], ref[k]), k
    assert torch.isnan(got["logprobs"]).any() == any(lp != lp for e in eps for lp in e.logprobs)


def test_episodes_without_logprobs_are_nan_on_policy_tokens(tiny_tokenizer):
    # logprobs=False (train.py's vLLM default): nothing reads them, and a reader would see NaN, not zeros
    tok = tiny_tokenizer
    eps = run_episodes(ScriptedEngine(tok), tok, _rows(), lambda row: ToyEnv(done_after=2), n=2,
                       temperature=1.0, top_p=1.0, max_tokens=8, max_turns=None, max_context=512,
                       logprobs=False)
    for e in eps:
        assert 0 in e.response_mask and 1 in e.response_mask  # two turns and an observation between
        for m, lp in zip(e.response_mask, e.logprobs):
            assert (lp != lp) if m else lp == 0.0  # NaN on the policy's tokens, 0 on env tokens
    b = episodes_to_batch(eps, tok.pad_token_id)
    pol = b["loss_mask"] > 0
    assert torch.isnan(b["logprobs"][pol]).all() and (b["logprobs"][~pol] == 0).all()
    with_lp = run_episodes(ScriptedEngine(tok), tok, _rows(), lambda row: ToyEnv(done_after=2), n=2,
                           temperature=1.0, top_p=1.0, max_tokens=8, max_turns=None, max_context=512)
    assert [e.response_ids for e in with_lp] == [e.response_ids for e in eps]
    assert not any(lp != lp for e in with_lp for lp in e.logprobs)


def test_end_of_turn_is_the_templates_not_eos():
    # a tokenizer whose EOS is not the template's turn end (SmolLM2 converted from its GGUF with
    # transformers 5.17 said eos = <|im_start|>): turns must still end with <|im_end|>, which closes
    # assistant messages
    from conftest import make_tiny_tokenizer
    from rollout import end_of_turn_id
    tok = make_tiny_tokenizer()
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    tok.eos_token = "<|im_start|>"
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|im_end|>") != tok.eos_token_id


@pytest.mark.parametrize("cleanup", [False, True])
def test_decode_many_equals_one_decode_each(tiny_tokenizer, cleanup):
    # run_episodes decodes a round's completions in one batch call: the texts the envs see must be
    # exactly tokenizer.decode's, special tokens skipped, spaces cleaned up where the tokenizer says so
    from rollout import decode_many
    tok = tiny_tokenizer
    old = tok.clean_up_tokenization_spaces
    tok.clean_up_tokenization_spaces = cleanup
    try:
        rng = random.Random(0)
        seqs = [[rng.randrange(len(tok)) for _ in range(rng.randrange(0, 40))] for _ in range(100)]
        seqs.append(tok.encode("Hello , world ! It ' s 3 . 5 , isn ' t it ?") + [tok.eos_token_id])
        assert decode_many(tok, seqs) == [tok.decode(s, skip_special_tokens=True) for s in seqs]
        assert decode_many(tok, []) == []
    finally:
        tok.clean_up_tokenization_spaces = old


class ResetFailsEnv(ToyEnv):
    """ToyEnv whose reset raises for rows marked "down" (a server that cannot be reached)."""

    def reset(self, row):
        if row.get("down"):
            raise ConnectionError("server 'shop' cannot be reached:\nconnection refused")
        return super().reset(row)


def test_failed_reset_fails_its_episodes_only(tiny_tokenizer):
    tok, made = tiny_tokenizer, []

    def mk(row):
        made.append(ResetFailsEnv(done_after=2))
        return made[-1]

    rows = _rows(3)
    rows[1] = {**rows[1], "down": True}
    eps = run_episodes(ScriptedEngine(tok), tok, rows, mk, n=2, temperature=1.0, top_p=1.0, max_tokens=8,
                       max_turns=None, max_context=512)
    assert [e.finish_reason for e in eps] == ["stop", "stop", "error", "error", "stop", "stop"]
    assert [e.reward for e in eps] == pytest.approx([1.25, 1.25, 0, 0, 1.25, 1.25])
    for e in eps[2:4]:  # one line, the row's own prompt, nothing sampled
        assert e.info == {"turns": 0, "error": "ConnectionError: server 'shop' cannot be reached: connection refused"}
        assert e.prompt_ids == eps[0].prompt_ids and e.response_ids == [] and e.group == 1
    assert all(env.closed for env in made) and [len(env.texts) for env in made] == [2, 2, 0, 0, 2, 2]
    batch = episodes_to_batch(eps, tok.pad_token_id)
    assert batch["loss_mask"][2:4].sum() == 0 and batch["rewards"].tolist() == [1.25, 1.25, 0, 0, 1.25, 1.25]


def test_resets_run_concurrently_in_episode_order(tiny_tokenizer):
    # 16 resets of 0.2 s each: one after another 3.2 s, in 16 threads ~0.2 s. Later episodes sleep
    # less, so they finish first; episodes must still come back in order, each with its own row's
    # prompt, and a reset that raises (rows 2 and 5) fails only its own episodes
    tok, made = tiny_tokenizer, []

    class SleepyResetEnv(ResetFailsEnv):
        def reset(self, row):
            time.sleep(0.2 + 0.01 * (8 - row["i"]))
            return super().reset(row)

    def mk(row):
        made.append(SleepyResetEnv(done_after=1))
        return made[-1]

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "i": i, "down": i in (2, 5)} for i in range(8)]
    t0 = time.perf_counter()
    eps = run_episodes(ScriptedEngine(tok), tok, rows, mk, n=2, temperature=1.0, top_p=1.0, max_tokens=8,
                       max_turns=None, max_context=512, max_workers=16)
    assert time.perf_counter() - t0 < 1.0  # serial resets: >= 16 * 0.2 = 3.2 s
    assert [e.group for e in eps] == [i // 2 for i in range(16)]
    assert [e.prompt_ids for e in eps] == [render_prompt(tok, r["prompt"]) for r in rows for _ in range(2)]
    assert [e.finish_reason for e in eps] == ["error" if i // 2 in (2, 5) else "stop" for i in range(16)]
    assert all("cannot be reached" in e.info["error"] for e in eps if e.finish_reason == "error")
    assert all(env.closed for env in made) and len(made) == 16


def test_failed_close_keeps_the_episodes_and_closes_the_rest(tiny_tokenizer, capsys):
    tok, made = tiny_tokenizer, []

    class CloseFailsEnv(ToyEnv):
        def close(self):
            if len(made) > 1 and self is made[1]:
                raise RuntimeError("close exploded\nline two")
            super().close()

    def mk(row):
        made.append(CloseFailsEnv(done_after=1))
        return made[-1]

    eps = run_episodes(ScriptedEngine(tok), tok, _rows(2), mk, n=2, temperature=1.0, top_p=1.0, max_tokens=8,
                       max_turns=None, max_context=512)
    assert [e.finish_reason for e in eps] == ["stop"] * 4 and [e.reward for e in eps] == [1.0] * 4
    assert [env.closed for env in made] == [True, False, True, True]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: env.close raised for 1 of 4 episodes; first: RuntimeError: close exploded line two"]


# ---- observation tokens without re-rendering the tool block

def _observation_ids_reference(tok, obs, tools, last):
    """The module doc's formula, the tool block rendered in both templates every time."""
    from rollout import DUMMY_A, DUMMY_U
    base = [{"role": "user", "content": DUMMY_U}, {"role": "assistant", "content": DUMMY_A}]
    prefix = tok.apply_chat_template(base, tools=tools, tokenize=False)
    full = tok.apply_chat_template(base + obs, tools=tools, add_generation_prompt=True, tokenize=False)
    after = prefix[prefix.rindex(DUMMY_A) + len(DUMMY_A):]
    stop = tok.decode([last]) if last is not None else ""
    glue = after[len(stop):] if stop and after.startswith(stop) else after
    return tok.encode(glue + full[len(prefix):], add_special_tokens=False)


TOOLS = [{"type": "function", "function": {"name": f"f{k}", "description": "d",
                                           "parameters": {"type": "object", "properties": {}}}} for k in range(3)]
OBS = [[{"role": "tool", "content": "42"}],
       [{"role": "tool", "content": "1"}, {"role": "tool", "content": "Error: x"}],
       [{"role": "user", "content": "try again"}],
       [{"role": "system", "content": "note"}]]  # conftest's template drops a system turn when tools are shown


def test_observation_ids_equal_the_full_render():
    # the tools=None shortcut must give the same ids as rendering the tool block, for the templates
    # whose observation text ignores tools (conftest's for tool/user roles) and for those where it
    # does not (conftest's for a system message; a variant that renders tool results by tools)
    from conftest import CHATML_TEMPLATE, make_tiny_tokenizer
    tok = make_tiny_tokenizer()
    by_tools = CHATML_TEMPLATE.replace("{% elif m.role == 'tool' %}", "{% elif m.role == 'tool' and tools %}")
    assert by_tools != CHATML_TEMPLATE
    for template in (CHATML_TEMPLATE, by_tools, CHATML_TEMPLATE):  # the cache is per template
        tok.chat_template = template
        for obs in OBS:
            for last in (tok.eos_token_id, None, tok.encode("x")[0]):
                for _ in range(2):  # the first call probes, the second uses the verdict
                    assert observation_ids(tok, obs, TOOLS, last) == _observation_ids_reference(tok, obs, TOOLS, last)
    # the two cases the shortcut must not take: the text with tools differs from the one without
    tok.chat_template = by_tools
    assert observation_ids(tok, OBS[0], TOOLS) != _observation_ids_reference(tok, OBS[0], None, None)
    tok.chat_template = CHATML_TEMPLATE
    assert observation_ids(tok, OBS[3], TOOLS) != _observation_ids_reference(tok, OBS[3], None, None)


def test_observation_ids_skip_the_tool_block_after_the_probe():
    # after one probe per (tokenizer, tools, roles), tool results render with tools=None only
    from conftest import make_tiny_tokenizer
    tok, seen = make_tiny_tokenizer(), []
    render = tok.apply_chat_template

    def recording(messages, tools=None, **kw):
        seen.append(tools)
        return render(messages, tools=tools, **kw)

    tok.apply_chat_template = recording
    observation_ids(tok, OBS[0], TOOLS, tok.eos_token_id)
    assert seen.count(TOOLS) == 2  # the probe: prefix and full with tools (then without)
    seen.clear()
    for k in range(5):
        observation_ids(tok, [{"role": "tool", "content": f"r{k}"}], TOOLS, tok.eos_token_id)
    assert seen == [None] * 10
    seen.clear()
    observation_ids(tok, OBS[3], TOOLS, tok.eos_token_id)  # a new role: probed, tools kept
    observation_ids(tok, OBS[3], TOOLS, tok.eos_token_id)
    assert seen[-2:] == [TOOLS, TOOLS]


def test_decode_keeps_only_the_special_tokens_an_env_asks_for(tiny_tokenizer):
    # Env.keep_special: a tool-call marker that is a special token in the real tokenizer (Mistral's
    # [TOOL_CALLS], Llama's <|python_tag|>) must reach env.step; the turn's stop token must not. The
    # default (no keep_special: every env but a mistral / llama3-json MCPEnv) decodes exactly as before
    from rollout import decode_many
    tok = tiny_tokenizer
    im_start, im_end, pad = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    seqs = [[im_start] + tok.encode("call", add_special_tokens=False) + [pad, im_start, im_end], [], [im_end]]
    plain = [tok.decode(s, skip_special_tokens=True) for s in seqs]
    assert decode_many(tok, seqs) == decode_many(tok, seqs, keep=()) == plain == ["call", "", ""]
    assert decode_many(tok, seqs, keep=("<|im_start|>",)) == ["<|im_start|>call<|im_start|>", "", ""]
    assert decode_many(tok, seqs, keep=("not a token",)) == plain

    class KeepEnv(ToyEnv):
        keep_special = ("<|im_start|>",)

    eng = ScriptedEngine(tok, "<|im_start|>abc")  # + <|im_end|>, the EOS
    kw = dict(n=1, temperature=1.0, top_p=1.0, max_tokens=16, max_turns=2, max_context=512)
    envs = []
    run_episodes(eng, tok, _rows(), lambda row: envs.append(KeepEnv(done_after=2)) or envs[-1], **kw)
    run_episodes(eng, tok, _rows(), lambda row: envs.append(ToyEnv(done_after=2)) or envs[-1], **kw)
    assert envs[0].texts == ["<|im_start|>abc"] * 2 and envs[1].texts == ["abc"] * 2


def test_a_template_that_refuses_an_observation_ends_only_its_episode(tiny_tokenizer):
    # run_episodes' contract: a raising env fails its own episode, never the batch -- the chat template
    # rendering the env's messages included (a strict template's raise_exception, e.g. Mistral's ids)
    tok = tiny_tokenizer

    class BadObsEnv(ToyEnv):
        def step(self, text):
            obs, r, done, info = super().step(text)
            return [{"role": "nobody", "content": "x"}] if obs and self.bad else obs, r, done, info

    def mk(row, made=[]):
        made.append(BadObsEnv(done_after=3))
        made[-1].bad = len(made) == 1  # the first episode's observation is one the template refuses
        return made[-1]
    strict = tok.chat_template.replace("{% for m in messages %}", "{% for m in messages %}"
                                       "{% if m.role == 'nobody' %}{{ raise_exception('no such role') }}{% endif %}")
    assert strict != tok.chat_template
    tok.chat_template, old = strict, tok.chat_template
    try:
        eps = run_episodes(ScriptedEngine(tok), tok, _rows(1), mk, n=2, temperature=1.0, top_p=1.0, max_tokens=8,
                           max_turns=None, max_context=512)
    finally:
        tok.chat_template = old
    assert eps[0].finish_reason == "error" and "no such role" in eps[0].info["error"]
    assert eps[1].finish_reason == "stop" and eps[1].reward == pytest.approx(1.5)


# ---- hints: given assistant turns a wrapping env plays before the policy samples (options/rescue.py)

def test_hint_turns_are_played_masked_then_the_policy_samples(tiny_tokenizer):
    # row 0 plays two hint turns (rescue.Hinted, at reset), then samples "abc" twice; row 1 has no hints
    # and plays as usual. The whole conversation must render exactly as the chat template does, hint turns
    # as assistant turns; rescue.as_context files the played turns after the group's prompt, mask 0
    from options import rescue
    tok, made = tiny_tokenizer, []

    def mk(row):
        made.append(ToyEnv(done_after=4))
        return made[-1]

    eng = ScriptedEngine(tok, "abc")
    kw = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=16, max_turns=None, max_context=512)
    rows = [rescue.hint_row(_rows(1)[0], ["h1", "call two"]), _rows(1)[0]]
    eps = run_episodes(eng, tok, rows, rescue.with_hints(mk), **kw)
    conv = PROMPT + [{"role": "assistant", "content": "h1"}, {"role": "user", "content": "obs1"},
                     {"role": "assistant", "content": "call two"}, {"role": "user", "content": "obs2"},
                     {"role": "assistant", "content": "abc"}, {"role": "user", "content": "obs3"},
                     {"role": "assistant", "content": "abc"}]
    want = tok.apply_chat_template(conv, tokenize=False)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    plain = render_prompt(tok, PROMPT)
    for e, env in zip(eps[:2], made[:2]):
        assert env.texts == ["h1", "call two", "abc", "abc"]  # the env got the hint texts first, as they are
        assert tok.decode(e.prompt_ids + e.response_ids) == want[:-1]
        assert e.info["turns"] == 2 and e.info["hint_turns"] == 2 and e.finish_reason == "stop"
        assert e.response_mask[:len(eng.ids)] == [1] * len(eng.ids)  # the played turns are in the prompt
        rescue.as_context(e, plain, 2)
        assert tok.decode(e.prompt_ids + e.response_ids) == want[:-1] and e.prompt_ids == plain
        assert e.info["turns"] == 4 and e.reward == pytest.approx(0.25 * 3 + 1.0)  # the env's, hint steps included
        h1 = tok.encode("h1", add_special_tokens=False) + [eot]
        assert e.response_ids[:len(h1)] == h1 and e.response_mask[:len(h1)] == [0] * len(h1)
        sampled = [t for t, m in zip(e.response_ids, e.response_mask) if m == 1]
        assert sampled == eng.ids * 2  # only the policy's own turns are mask 1
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.response_mask) if m == 0)
        assert all(lp == -0.5 for lp, m in zip(e.logprobs, e.response_mask) if m == 1)
        first = e.response_mask.index(1)  # every hint token comes before the first sampled one
        assert tok.decode(e.response_ids[:first]).count("call two") == 1
    for e, env in zip(eps[2:], made[2:]):  # the row without hints: untouched
        assert env.texts == ["abc"] * 4 and "hint_turns" not in e.info and e.info["turns"] == 4
    batch = episodes_to_batch(eps, tok.pad_token_id)
    assert batch["loss_mask"][0].sum() == 2 * len(eng.ids) and batch["loss_mask"][2].sum() == 4 * len(eng.ids)


def test_no_hints_is_the_plain_loop(tiny_tokenizer):
    # rows without hints (and a row with an empty list) play exactly the episodes the loop plays unwrapped;
    # hints that leave the env no turn of its own are that episode's error
    from options import rescue
    tok = tiny_tokenizer
    kw = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=16, max_turns=None, max_context=512)
    plain = run_episodes(ScriptedEngine(tok), tok, _rows(2), lambda row: ToyEnv(done_after=3), **kw)
    wrapped = rescue.with_hints(lambda row: ToyEnv(done_after=3))
    assert run_episodes(ScriptedEngine(tok), tok, _rows(2), wrapped, **kw) == plain
    assert run_episodes(ScriptedEngine(tok), tok, [rescue.hint_row(r, []) for r in _rows(2)], wrapped, **kw) == plain
    e = run_episodes(ScriptedEngine(tok), tok, [rescue.hint_row(_rows(1)[0], ["h"] * 5)], wrapped, **{**kw, "n": 1})[0]
    assert e.finish_reason == "error" and "leave no turn of the env's 5" in e.info["error"] and e.response_ids == []


def test_hinted_takes_the_tools_and_turn_limit_the_env_set_at_reset(tiny_tokenizer):
    # MCPEnv sets a row's own tools and its turn limit (user turns) at reset: the wrapper reads them from there
    from options import rescue

    class RowEnv(ToyEnv):
        def reset(self, row):
            self.tools, self.max_turns = row["tools"], 3 * row["user_turns"]
            return list(row["prompt"])
    env = rescue.Hinted(RowEnv(max_turns=1), ["h1"])
    env.reset({"prompt": PROMPT, "tools": [{"type": "function", "function": {"name": "own"}}], "user_turns": 2})
    assert env.tools[0]["function"]["name"] == "own" and env.max_turns == 5
    with pytest.raises(ValueError, match="leave no turn of the env's 3"):
        rescue.Hinted(RowEnv(max_turns=9), ["h"] * 3).reset({"prompt": PROMPT, "tools": None, "user_turns": 1})


def test_a_hint_longer_than_the_context_ends_the_episode_as_length(tiny_tokenizer):
    # the played turns are part of the prompt: one that does not fit ends the episode before anything is sampled
    from options import rescue
    tok, made = tiny_tokenizer, []

    def mk(row):
        made.append(ToyEnv(done_after=3))
        return made[-1]

    P = len(render_prompt(tok, PROMPT))
    eng = ScriptedEngine(tok)
    kw = dict(n=1, temperature=1.0, top_p=1.0, max_tokens=8, max_turns=None, max_context=P + 40)
    e = run_episodes(eng, tok, [rescue.hint_row(_rows(1)[0], ["x" * 40])], rescue.with_hints(mk), **kw)[0]
    assert e.finish_reason == "length" and e.response_ids == [] and made[0].texts == ["x" * 40]
    assert eng.calls == []  # nothing sampled
    e = run_episodes(eng, tok, [rescue.hint_row(_rows(1)[0], ["h1"])], rescue.with_hints(mk), **{**kw, "max_context": 512})[0]
    assert e.finish_reason == "stop" and e.info["hint_turns"] == 1 and made[1].texts == ["h1", "abc", "abc"]


# ---- sync.py (the weight sync into vLLM) and VLLMEngine's sync state, with a stand-in for vLLM (the
# real thing: tests/test_gpu.py). The stand-in is a second tiny HF model with a `load_weights(weights)`
# that, like vLLM's, copies by Hugging Face name into existing parameters, skips lm_head when tied and
# returns the names it filled; `FakeLLM.apply_model(fn)` returns [fn(model)] like LLM.apply_model with
# one worker. FakeEngine is a real VLLMEngine (its load_weights, sleep, wake and sync state) built on
# FakeLLM, with HFEngine sampling from the stand-in model in place of vLLM's generate.

def _load_weights(m, weights):
    params, done = dict(m.named_parameters()), set()
    for name, t in weights:
        if m.config.tie_word_embeddings and name.startswith("lm_head."):
            continue
        params[name].data.copy_(t)  # copy_ casts, as vLLM's default_weight_loader does
        done.add(name)
    return done


class FakeLLM:
    """What the sync and VLLMEngine use of vLLM's LLM, around a tiny HF model."""

    def __init__(self, model):
        self.model, self.resets = model, 0
        model.load_weights = types.MethodType(_load_weights, model)
        ns = types.SimpleNamespace
        self.llm_engine = ns(model_config=ns(dtype=next(model.parameters()).dtype),
                             vllm_config=ns(cache_config=ns(enable_prefix_caching=True)))

    def apply_model(self, fn):
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.resets += 1

    def sleep(self, level):
        pass

    def wake_up(self):
        pass


class FakeEngine(vllm_engine.VLLMEngine):
    """VLLMEngine on FakeLLM; HFEngine samples from the stand-in model (what the engine holds)."""

    def __init__(self, model, tokenizer, **kwargs):
        super().__init__("stand-in", llm=FakeLLM(model), **kwargs)
        self.hf = HFEngine(model, tokenizer)

    def generate(self, prompts, n, temperature, top_p, max_tokens, **kwargs):
        self.cache_empty = False  # as VLLMEngine.generate: these prompts enter the prefix cache
        return self.hf.generate(prompts, n, temperature, top_p, max_tokens, **kwargs)


def _perturb(model, scale, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + scale * torch.randn_like(p))


def test_trainer_weights_drop_tied_head(tiny_tokenizer):
    model = make_tiny_model(tiny_tokenizer)  # tie_word_embeddings=True
    names = [n for n, _ in sync.trainer_weights(model)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == len(set(names))


def test_buckets_respect_size():
    ws = [(f"w{i}", torch.zeros(100)) for i in range(10)]  # 200 bytes each in bf16
    bs = list(sync.buckets(ws, torch.bfloat16, 450))
    assert [len(b) for b in bs] == [2, 2, 2, 2, 2]
    assert [n for b in bs for n, _ in b] == [n for n, _ in ws]
    assert [len(b) for b in sync.buckets(ws, torch.bfloat16, 10)] == [1] * 10  # big tensors go alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_push_copies_and_casts(tiny_tokenizer, dtype):
    trainer = make_tiny_model(tiny_tokenizer)
    _perturb(trainer, 0.5, 0)
    target = make_tiny_model(tiny_tokenizer).to(dtype)
    llm = FakeLLM(target)
    st = sync.push_weights(llm, trainer, dtype, bucket_mb=0)  # bucket_mb=0: one tensor per bucket
    assert st["missing"] == [] and st["n_buckets"] == st["n_tensors"]
    for (n, a), (_, b) in zip(trainer.named_parameters(), target.named_parameters()):
        assert b.dtype == dtype and torch.equal(a.to(dtype), b), n


def test_missing_names_are_an_error(tiny_tokenizer, monkeypatch):
    trainer = make_tiny_model(tiny_tokenizer)
    llm = FakeLLM(make_tiny_model(tiny_tokenizer))
    real = sync.trainer_weights
    # a trainer whose names vLLM would not recognise fills nothing
    monkeypatch.setattr(sync, "trainer_weights", lambda m: [("x." + n, t) for n, t in real(m)])
    llm.model.load_weights = types.MethodType(lambda m, weights: set(), llm.model)
    with pytest.raises(RuntimeError, match="not filled"):
        sync.push(llm, trainer, torch.float32)


def test_sync_resets_cache_and_check_sees_the_difference(tiny_tokenizer):
    torch.manual_seed(0)
    trainer = make_tiny_model(tiny_tokenizer)
    eng = FakeEngine(make_tiny_model(tiny_tokenizer), tiny_tokenizer, probe_tokens=8)
    eng.probe_prompts = [tiny_tokenizer.encode("hello there"), tiny_tokenizer.encode("2 * 3 =")]
    eng.weights_stale = True  # as after a level-2 sleep
    probe = (eng.generate, trainer, eng.probe_prompts)
    assert sync.check(*probe, max_tokens=8)["dlogp_mean"] < 1e-4  # same weights, fp32: equal up to rounding
    _perturb(trainer, 1.0, 1)
    with pytest.raises(RuntimeError, match="check failed"):
        sync.check(*probe, threshold=0.01, max_tokens=8)
    eng.check_threshold = 0.01
    st = eng.load_weights(trainer, check=True)
    assert eng.llm.resets == 1 and not eng.weights_stale
    assert st["dlogp_mean"] < 1e-4 and st["probe_tokens"] > 0
    assert {"ms", "push_ms", "reset_ms", "check_ms", "bytes"} <= set(st)


def test_sleep_empties_the_prefix_cache_and_the_next_sync_skips_its_reset(tiny_tokenizer):
    """vLLM's sleep (level >= 1) resets the prefix cache itself; a sync right after it does not walk
    the KV blocks again, and one after a generate does."""
    trainer = make_tiny_model(tiny_tokenizer)
    eng = FakeEngine(make_tiny_model(tiny_tokenizer), tiny_tokenizer, sleep_level=2)
    fake = eng.llm
    eng.load_weights(trainer, check=False)
    assert fake.resets == 1  # a fresh engine: reset
    eng.sleep()
    assert eng.cache_empty and eng.weights_stale
    eng.load_weights(trainer, check=False)  # wakes it first
    assert fake.resets == 1 and not eng.asleep  # emptied by the sleep: no second reset
    eng.cache_empty = False  # what generate() sets
    eng.load_weights(trainer, check=False)
    assert fake.resets == 2
    eng.prefix_caching = False  # an engine without a prefix cache: no KV is reused, so nothing to reset
    eng.load_weights(trainer, check=False)
    assert fake.resets == 2


def test_a_wake_out_of_memory_names_the_trainers_memory_before_the_wake(tiny_tokenizer, monkeypatch):
    # vLLM's pool allocates through torch's allocator: a wake that fails part way has raised the count, so
    # the message must read the trainer's memory before the wake (an H200 read 43.2 GiB for a ~20 GiB trainer)
    eng = FakeEngine(make_tiny_model(tiny_tokenizer), tiny_tokenizer, sleep_level=2)
    eng.sleep()
    held = [20 * 2**30]

    def wake_up():
        held[0] += 23 * 2**30  # what vLLM mapped before it ran out
        raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:163")

    eng.llm.wake_up = wake_up
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: held[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0.6 * 2**30, 139.8 * 2**30))
    with pytest.raises(RuntimeError, match=r"0.6 of 139.8 GiB free, the trainer holds 20.0 GiB\): lower --gpu-memory-utilization"):
        eng.wake()


def test_logprob_delta():
    d = sync.logprob_delta([[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.2]])
    assert d["dlogp_mean"] == pytest.approx(0.4 / 3) and d["dlogp_max"] == pytest.approx(0.3)
    assert d["probe_tokens"] == 3


def test_second_push_replays_the_recorded_plan(tiny_tokenizer):
    trainer = make_tiny_model(tiny_tokenizer)
    llm = FakeLLM(make_tiny_model(tiny_tokenizer).to(torch.bfloat16))
    st1, plan = sync.push(llm, trainer, torch.bfloat16)
    assert st1["path"] == "load_weights" and plan and len(plan["dsts"]) == st1["n_tensors"]
    _perturb(trainer, 0.5, 2)
    st2, plan2 = sync.push(llm, trainer, torch.bfloat16, plan)
    assert st2["path"] == "fast" and st2["bytes"] == st1["bytes"] and plan2 is plan
    for (n, a), (_, b) in zip(trainer.named_parameters(), llm.model.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), n


def test_the_engine_keeps_its_plan_across_syncs(tiny_tokenizer):
    """VLLMEngine owns the plan: its first load_weights records it, the second replays it."""
    trainer = make_tiny_model(tiny_tokenizer)
    eng = FakeEngine(make_tiny_model(tiny_tokenizer).to(torch.bfloat16), tiny_tokenizer)
    assert eng.sync_plan is None and eng.torch_dtype == torch.bfloat16
    st1 = eng.load_weights(trainer, check=False)
    assert st1["path"] == "load_weights" and eng.sync_plan and len(eng.sync_plan["dsts"]) == st1["n_tensors"]
    plan = eng.sync_plan
    _perturb(trainer, 0.5, 3)
    st2 = eng.load_weights(trainer, check=False)
    assert st2["path"] == "fast" and eng.sync_plan is plan and eng.syncs == 2
    for (n, a), (_, b) in zip(trainer.named_parameters(), eng.llm.model.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), n


def test_check_schedule(tiny_tokenizer):
    """check=None: the first sync with probe prompts, then every check_every-th sync."""
    trainer = make_tiny_model(tiny_tokenizer)
    eng = FakeEngine(make_tiny_model(tiny_tokenizer), tiny_tokenizer, probe_tokens=4, check_every=3)
    assert "dlogp_mean" not in eng.load_weights(trainer)  # no probe prompts yet: nothing to check on
    eng.probe_prompts = [tiny_tokenizer.encode("2 * 3 =")]
    checked = ["dlogp_mean" in eng.load_weights(trainer) for _ in range(6)]
    # engine.syncs before these calls: 1..6; checked: the first with probe prompts (1), then syncs % 3 == 0
    assert checked == [True, False, True, False, False, True] and eng.checks == 3


def test_no_plan_when_a_loader_transforms(tiny_tokenizer):
    """A loader that does more than a plain copy (here: scales) must keep the slow path."""
    trainer = make_tiny_model(tiny_tokenizer)
    llm = FakeLLM(make_tiny_model(tiny_tokenizer))

    def scaling_loader(m, weights):
        params = dict(m.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t * 2)
        return {n for n, _ in weights}
    llm.model.load_weights = types.MethodType(scaling_loader, llm.model)
    st, plan = sync.push(llm, trainer, torch.float32)
    assert st["path"] == "load_weights" and plan is False
    assert sync.push(llm, trainer, torch.float32, plan)[0]["path"] == "load_weights"
