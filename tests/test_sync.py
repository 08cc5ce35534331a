"""CPU tests of sync.py (the weight sync into vLLM) and of VLLMEngine's sync state, with a stand-in
for vLLM (the real thing: tests/test_gpu.py).

The stand-in is a second tiny HF model with a `load_weights(weights)` that, like vLLM's, copies
by Hugging Face name into existing parameters, skips lm_head when tied and returns the names it
filled; `FakeLLM.apply_model(fn)` returns [fn(model)] like LLM.apply_model with one worker.
FakeEngine is a real VLLMEngine (its load_weights, sleep, wake and sync state) built on FakeLLM,
with HFEngine sampling from the stand-in model in place of vLLM's generate.
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
