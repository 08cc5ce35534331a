"""Tests of lora.py on tiny random Llama / Qwen2 models built in-process (no weights downloaded).

Exactness where the math allows it (B = 0 is the base model bit for bit, a save/load round trip
is bit-exact), tolerances where a merge reorders float sums, a hypothesis property of the layer
formula. CPU, seconds. Run: python -m pytest -q tests/test_lora.py
"""
import json
import os
import re
import sys

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from options import lora  # noqa: E402

R, ALPHA = 4, 8.0  # scaling = 2


def make_model(arch="llama", seed=0, dtype=torch.float32, tie=False):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)
    cfg, cls = (LlamaConfig(**kw), LlamaForCausalLM) if arch == "llama" else (Qwen2Config(**kw), Qwen2ForCausalLM)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.to(dtype).eval()


def ids(seed=1):
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed))  # (B, T)


def logits(model, x):
    with torch.no_grad():
        return model(x).logits  # (B, T, V)


def randomize_B(model, seed=2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)


def wrapped(arch="llama", seed=0, dtype=torch.float32, r=R, random_B=True):
    model = make_model(arch, seed, dtype)
    lora.apply_lora(model, r, ALPHA)
    if random_B:
        randomize_B(model)
    return model


# -----------------------------------------------------------------------------
# 1. step 0 is the base model

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_B_is_bit_identical(arch, dtype):
    model, x = make_model(arch, dtype=dtype), ids()
    before = logits(model, x)
    names = lora.apply_lora(model, R, ALPHA)
    assert len(names) == 2 * 7 and names == sorted(names)  # 7 projections x 2 layers, never lm_head
    assert "lm_head" not in names and all(n.startswith("model.layers.") for n in names)
    assert torch.equal(logits(model, x), before)  # B = 0: y + 0 exactly
    # the base weights keep their state_dict names (sync and save_pretrained rely on it)
    sd = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in sd and sd["model.layers.0.self_attn.q_proj.lora_A"].dtype == torch.float32
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in sd  # Qwen2's q/k/v biases stay
    assert model.lora_config == dict(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=sorted(lora.DEFAULT_TARGETS))


# -----------------------------------------------------------------------------
# 2. merging

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_merged_weights_and_state_dict(arch):
    model, x = wrapped(arch), ids()
    mw = lora.merged_weights(model)
    mods = lora.lora_modules(model)
    assert sorted(mw) == sorted(f"{n}.weight" for n in mods)  # only the targeted tensors
    for n, m in mods.items():
        want = m.weight + 2.0 * m.lora_B @ m.lora_A  # W + (alpha/r) B A, alpha/r = 8/4
        assert torch.allclose(mw[f"{n}.weight"], want, atol=1e-6) and not mw[f"{n}.weight"].requires_grad
        assert not torch.equal(mw[f"{n}.weight"], m.weight)  # B != 0 moved it
    w0 = mods["model.layers.0.mlp.down_proj"].weight.clone()
    sd = lora.merged_state_dict(model)
    assert not any("lora" in k for k in sd)
    assert torch.equal(mods["model.layers.0.mlp.down_proj"].weight, w0)  # non-destructive
    plain = make_model(arch, seed=123)  # different random weights: everything must come from sd
    missing, unexpected = plain.load_state_dict(sd, strict=False)
    assert not missing and not unexpected
    assert torch.allclose(logits(plain, x), logits(model, x), atol=1e-5)


# -----------------------------------------------------------------------------
# 3. gradients reach the adapters only

def test_only_adapters_get_gradients():
    model = wrapped("qwen2")
    model.train()
    model(ids(), labels=ids()).loss.backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    lora_names = {n for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B"))}
    assert got == lora_names and len(lora_names) == 2 * 2 * 7
    assert all(p.requires_grad == (n in lora_names) for n, p in model.named_parameters())
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in lora_names)


def test_zero_B_gradient_flows_into_B_only():
    model = wrapped("llama", random_B=False)
    model(ids(), labels=ids()).loss.backward()
    for m in lora.lora_modules(model).values():
        assert torch.equal(m.lora_A.grad, torch.zeros_like(m.lora_A))  # dL/dA = B^T (...) = 0
        assert m.lora_B.grad.abs().sum() > 0


# -----------------------------------------------------------------------------
# 4. adapters off = the reference policy

def test_disabled_gives_base_and_restores():
    base_model, x = make_model("llama"), ids()
    base = logits(base_model, x)
    model = wrapped("llama")
    adapted = logits(model, x)
    assert not torch.allclose(adapted, base, atol=1e-4)
    with lora.disabled(model):
        assert torch.equal(logits(model, x), base)
    assert torch.equal(logits(model, x), adapted)
    with pytest.raises(RuntimeError, match="boom"):
        with lora.disabled(model):
            raise RuntimeError("boom")
    assert all(m.enabled for m in lora.lora_modules(model).values())
    assert torch.equal(logits(model, x), adapted)


# -----------------------------------------------------------------------------
# 5. adapter folder round trip

def test_save_load_roundtrip(tmp_path):
    model, x = wrapped("qwen2"), ids()
    lora.save_adapter(model, tmp_path, "tiny-qwen2")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg == dict(peft_type="LORA", task_type="CAUSAL_LM", r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                       target_modules=sorted(lora.DEFAULT_TARGETS), bias="none", fan_in_fan_out=False,
                       inference_mode=True, base_model_name_or_path="tiny-qwen2", use_rslora=False,
                       modules_to_save=None, init_lora_weights=True)
    sd = load_file(tmp_path / "adapter_model.safetensors")
    assert len(sd) == 2 * 2 * 7
    for k, t in sd.items():
        assert re.fullmatch(r"base_model\.model\..+\.(lora_A|lora_B)\.weight", k), k
        assert t.dtype == torch.float32
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    assert sd[f"{q}.lora_A.weight"].shape == (R, 32) and sd[f"{q}.lora_B.weight"].shape == (32, R)  # (r, in), (out, r)
    assert sd["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (R, 64)

    fresh = wrapped("qwen2", random_B=False)  # same base (seed 0), new random A, B = 0
    assert not torch.equal(logits(fresh, x), logits(model, x))
    lora.load_adapter(fresh, tmp_path)
    for (n, a), (_, b) in zip(lora.lora_modules(model).items(), lora.lora_modules(fresh).items()):
        assert torch.equal(a.lora_A, b.lora_A) and torch.equal(a.lora_B, b.lora_B), n
    assert torch.equal(logits(fresh, x), logits(model, x))


# -----------------------------------------------------------------------------
# 6. errors that say what is wrong

def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"no nn.Linear matched targets \['c_attn'\].*'lm_head'.*'q_proj'"):
        lora.apply_lora(make_model(), R, ALPHA, targets=("c_attn",))
    for bad in (dict(rank=0), dict(alpha=0.0), dict(dropout=1.0)):
        with pytest.raises(ValueError, match=list(bad)[0]):
            lora.apply_lora(make_model(), **{"rank": R, "alpha": ALPHA, **bad})
    assert lora.apply_lora(make_model(), R, ALPHA, targets=("lm_head",)) == ["lm_head"]  # only when asked
    with pytest.raises(ValueError, match="tied"):  # lm_head = embed_tokens: a merge would touch both
        lora.apply_lora(make_model(tie=True), R, ALPHA, targets=("lm_head",))
    model = wrapped("llama")
    with pytest.raises(ValueError, match="already"):
        lora.apply_lora(model, R, ALPHA)

    lora.save_adapter(model, tmp_path, "tiny")
    with pytest.raises(ValueError, match=r"adapter_config.json: r=4 .* r=8"):
        lora.load_adapter(wrapped("llama", r=8, random_B=False), tmp_path)
    other = make_model()
    lora.apply_lora(other, R, ALPHA, targets=("q_proj", "v_proj"))
    with pytest.raises(ValueError, match="target_modules"):
        lora.load_adapter(other, tmp_path)

    sd = load_file(tmp_path / "adapter_model.safetensors")
    gone = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    del sd[gone]
    save_file(sd, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: 1 missing keys \['" + re.escape(gone)):
        lora.load_adapter(wrapped("llama", random_B=False), tmp_path)
    sd[gone] = torch.zeros(64, R + 1)
    save_file(sd, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="shape mismatch"):
        lora.load_adapter(wrapped("llama", random_B=False), tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": True}))
    with pytest.raises(ValueError, match="use_rslora"):
        lora.load_adapter(wrapped("llama", random_B=False), tmp_path)


# -----------------------------------------------------------------------------
# 7. the layer formula

@settings(max_examples=40, deadline=None)
@given(i=st.integers(1, 9), o=st.integers(1, 9), r=st.integers(1, 6), alpha=st.floats(0.1, 64),
       bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_layer_formula(i, o, r, alpha, bias, seed):
    g = torch.Generator().manual_seed(seed)
    base = nn.Linear(i, o, bias=bias)
    layer = lora.LoRALinear(base, r, alpha)
    assert layer.weight is base.weight and not layer.weight.requires_grad
    assert (layer.in_features, layer.out_features, layer.scaling) == (i, o, alpha / r)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(r, i, generator=g))
        layer.lora_B.copy_(torch.randn(o, r, generator=g))
    x = torch.randn(3, 2, i, generator=g)  # (B, T, in)
    W, b, A, B = (t.double() if t is not None else 0 for t in (base.weight, base.bias, layer.lora_A, layer.lora_B))
    want = x.double() @ W.T + b + (alpha / r) * x.double() @ A.T @ B.T  # (B, T, out)
    with torch.no_grad():
        got = layer(x)
    assert got.shape == (3, 2, o) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4 * (1 + want.abs().max().item()))
    layer.enabled = False
    with torch.no_grad():
        assert torch.equal(layer(x), base(x))
