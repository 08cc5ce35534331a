"""CPU tests of sync.py (the weight sync into vLLM) with a stand-in for the vLLM model (the real thing: tests/test_gpu.py).

The stand-in is a second tiny HF model with a `load_weights(weights)` that, like vLLM's, copies
by Hugging Face name into existing parameters, skips lm_head when tied and returns the names it
filled; `FakeLLM.apply_model(fn)` returns [fn(model)] like LLM.apply_model with one worker.
Run: python -m pytest -q tests/test_sync.py
"""
import types

import pytest
import torch

import sync
import vllm_engine
from conftest import make_tiny_model
from rollout import HFEngine


def _load_weights(m, weights):
    params, done = dict(m.named_parameters()), set()
    for name, t in weights:
        if m.config.tie_word_embeddings and name.startswith("lm_head."):
            continue
        params[name].data.copy_(t)  # copy_ casts, as vLLM's default_weight_loader does
        done.add(name)
    return done


class FakeLLM:
    def __init__(self, model):
        self.model, self.resets = model, 0
        model.load_weights = types.MethodType(_load_weights, model)

    def apply_model(self, fn):
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.resets += 1


class FakeEngine(HFEngine):
    """HFEngine sampling from the stand-in model, with the attributes the sync reads off a VLLMEngine."""

    def __init__(self, model, tokenizer, dtype):
        super().__init__(model, tokenizer)
        self.llm, self.torch_dtype = FakeLLM(model), dtype
        self.probe_prompts, self.probe_tokens, self.weights_stale = [], 8, True


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


def test_missing_names_are_an_error(tiny_tokenizer):
    trainer = make_tiny_model(tiny_tokenizer)
    eng = FakeEngine(make_tiny_model(tiny_tokenizer), tiny_tokenizer, torch.float32)
    real = sync.trainer_weights
    try:  # a trainer whose names vLLM would not recognise fills nothing
        sync.trainer_weights = lambda m: [("x." + n, t) for n, t in real(m)]
        eng.llm.model.load_weights = types.MethodType(lambda m, weights: set(), eng.llm.model)
        with pytest.raises(RuntimeError, match="not filled"):
            sync.sync_weights(eng, trainer)
    finally:
        sync.trainer_weights = real


def test_sync_resets_cache_and_check_sees_the_difference(tiny_tokenizer):
    torch.manual_seed(0)
    trainer = make_tiny_model(tiny_tokenizer)
    eng = FakeEngine(make_tiny_model(tiny_tokenizer), tiny_tokenizer, torch.float32)
    eng.probe_prompts = [tiny_tokenizer.encode("hello there"), tiny_tokenizer.encode("2 * 3 =")]
    assert sync.check(eng, trainer)["dlogp_mean"] < 1e-4  # same weights, fp32: equal up to rounding
    _perturb(trainer, 1.0, 1)
    with pytest.raises(RuntimeError, match="check failed"):
        sync.check(eng, trainer, threshold=0.01)
    st = sync.sync_weights(eng, trainer, threshold=0.01)
    assert eng.llm.resets == 1 and not eng.weights_stale
    assert st["dlogp_mean"] < 1e-4 and st["probe_tokens"] > 0
    assert {"ms", "push_ms", "reset_ms", "check_ms", "bytes"} <= set(st)


def test_sleep_empties_the_prefix_cache_and_the_next_sync_skips_its_reset(tiny_tokenizer):
    """vLLM's sleep (level >= 1) resets the prefix cache itself; a sync right after it does not walk
    the KV blocks again, and one after a generate does."""
    trainer = make_tiny_model(tiny_tokenizer)
    fake = FakeLLM(make_tiny_model(tiny_tokenizer))
    fake.sleep = lambda level: None
    eng = vllm_engine.VLLMEngine.__new__(vllm_engine.VLLMEngine)  # no vLLM: only the fields sleep/sync read
    eng.llm, eng.sleep_level, eng.asleep, eng.stats, eng.cache_empty = fake, 2, False, {}, False
    eng.quant, eng.sync_plan, eng.probe_prompts, eng.torch_dtype = "none", None, [], torch.float32
    sync.sync_weights(eng, trainer, check_logprobs=False)
    assert fake.resets == 1  # a fresh engine: reset
    eng.sleep()
    assert eng.cache_empty and eng.weights_stale
    eng.asleep = False
    sync.sync_weights(eng, trainer, check_logprobs=False)
    assert fake.resets == 1  # emptied by the sleep: no second reset
    eng.cache_empty = False  # what generate() sets
    sync.sync_weights(eng, trainer, check_logprobs=False)
    assert fake.resets == 2
    eng.prefix_caching = False  # --no-prefix-caching: no KV is reused, so nothing to reset
    sync.sync_weights(eng, trainer, check_logprobs=False)
    assert fake.resets == 2


def test_logprob_delta():
    d = sync.logprob_delta([[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.2]])
    assert d["dlogp_mean"] == pytest.approx(0.4 / 3) and d["dlogp_max"] == pytest.approx(0.3)
    assert d["probe_tokens"] == 3


def test_second_sync_replays_the_recorded_plan(tiny_tokenizer):
    trainer = make_tiny_model(tiny_tokenizer)
    eng = FakeEngine(make_tiny_model(tiny_tokenizer).to(torch.bfloat16), tiny_tokenizer, torch.bfloat16)
    eng.sync_plan = None
    st1 = sync.sync_weights(eng, trainer, check_logprobs=False)
    assert st1["path"] == "load_weights" and eng.sync_plan and len(eng.sync_plan["dsts"]) == st1["n_tensors"]
    _perturb(trainer, 0.5, 2)
    st2 = sync.sync_weights(eng, trainer, check_logprobs=False)
    assert st2["path"] == "fast" and st2["bytes"] == st1["bytes"]
    for (n, a), (_, b) in zip(trainer.named_parameters(), eng.model.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), n


def test_no_plan_when_a_loader_transforms(tiny_tokenizer):
    """A loader that does more than a plain copy (here: scales) must keep the slow path."""
    trainer = make_tiny_model(tiny_tokenizer)
    eng = FakeEngine(make_tiny_model(tiny_tokenizer), tiny_tokenizer, torch.float32)
    eng.sync_plan = None

    def scaling_loader(m, weights):
        params = dict(m.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t * 2)
        return {n for n, _ in weights}
    eng.llm.model.load_weights = types.MethodType(scaling_loader, eng.llm.model)
    assert sync.sync_weights(eng, trainer, check_logprobs=False)["path"] == "load_weights"
    assert eng.sync_plan is False
    assert sync.sync_weights(eng, trainer, check_logprobs=False)["path"] == "load_weights"
