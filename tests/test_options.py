"""Tests of options/: one section a file, each as it was its own test file.

  options/lora.py     tiny random Llama / Qwen2 models built in-process (no weights downloaded):
                      exactness where the math allows it (B = 0 is the base model bit for bit, a
                      save/load round trip is bit-exact), tolerances where a merge reorders float
                      sums, a hypothesis property of the layer formula
  options/quant.py    error bounds, shapes, degenerate rows, hypothesis properties, the int8 folder
  options/critic.py   PPO's critic side: GAE, the value loss, a tiny critic that learns and saves
  options/prefix.py   --shared-prefix: the packed path against the padded one it replaces
  (options/rescue.py: tests/test_train.py, through train.collect, and tests/test_rollout.py, the
  episode loop playing rescue.Hinted's given turns)
  options/memory.py   the estimate under --shard fsdp (a 7B shape on 2 and 4 GPUs); the rest of it in
                      tests/test_train.py

CPU, seconds (the GPU checks skip without CUDA). Run: python -m pytest -q tests/test_options.py
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
import grpo  # noqa: E402
import score  # noqa: E402
from conftest import make_tiny_model, make_tiny_tokenizer  # noqa: E402
from options import critic, lora, memory, prefix, quant  # noqa: E402
from options.prefix import micro_batches, pack  # noqa: E402
from score import batch_logprobs  # noqa: E402
from support import sources  # noqa: E402

# ---- options/lora.py

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


# ---- options/quant.py: error bounds, shapes, degenerate rows, hypothesis properties, the int8
# folder (one CUDA-vs-CPU check skips without CUDA)

FAST_QUANT = settings(max_examples=60, deadline=None)
SHAPES = [(1, 1), (1, 64), (64, 1), (7, 13), (96, 256)]


def randn(shape, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * std


def fp8_bound(w, scale):
    """Per-element fp8 round-trip bound: 2^-4 |w| on normals, 2^-10 scale on subnormals."""
    # e4m3: 3 mantissa bits, so in the binade [2^e, 2^(e+1)) the spacing is 2^(e-3) and round to
    # nearest is off by <= 2^(e-4) <= 2^-4 |x|. Below the smallest normal 2^-6 the spacing is 2^-9.
    # The 1e-5 covers float32 rounding of w * (1 / scale) and of q * scale (~2^-24 each).
    return torch.maximum(w.abs() * 2**-4, 2**-10 * scale) * (1 + 1e-5) + 1e-30


# -----------------------------------------------------------------------------
# 1. round-trip error bounds

@pytest.mark.parametrize("shape", SHAPES)
def test_int8_error_at_most_half_a_step(shape):
    w = randn(shape, seed=1)
    q, scale = quant.quantize_int8_per_channel(w)
    err = (quant.dequantize(q, scale) - w).abs()
    # round to nearest: |w / scale - q| <= 1/2, nothing clipped since |w| / scale <= 127
    assert (err <= scale / 2 * (1 + 1e-5)).all(), (err / scale).max()


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_error_bound(shape):
    w = randn(shape, seed=2)
    q, scale = quant.quantize_fp8_per_tensor(w)
    err = (quant.dequantize(q, scale) - w).abs()
    assert (err <= fp8_bound(w, scale)).all()


def test_gaussian_relative_rms():
    w = randn((256, 512), seed=3)
    # fp8: in a binade the error is ~uniform on +-2^(e-4) (variance 2^(2e-8) / 3) and w^2 averages
    # (7/3) 2^(2e) over it if w were uniform there, so rel RMS ~ sqrt(2^-8 / 7) = 0.024; Gaussian
    # weights measure 0.0265 at any size (more of their mass sits low in each binade). amax ~ 4.8
    # sigma puts sigma / scale ~ 94: almost no mass is subnormal.
    fp8 = quant.quantization_error(w, "fp8")
    assert 0.02 < fp8["rel_rms"] < 0.03, fp8
    # int8: error uniform on +-scale/2, RMS scale / sqrt(12); row amax of 512 normals ~ 3.2
    # sigma, so rel RMS ~ 3.2 / 127 / 3.46 = 0.0073 (measured 0.0074)
    int8 = quant.quantization_error(w, "int8")
    assert 0.004 < int8["rel_rms"] < 0.01, int8
    assert int8["max_abs"] <= w.abs().max().item() / 127 / 2 * (1 + 1e-5)


# -----------------------------------------------------------------------------
# 2. shapes and dtypes (what the engine's parameters hold)

@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_and_dtypes(shape):
    w = randn(shape)
    q, scale = quant.quantize_fp8_per_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    q, scale = quant.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (shape[0], 1)


# -----------------------------------------------------------------------------
# 3. zero and constant rows

@pytest.mark.parametrize("fn", [quant.quantize_fp8_per_tensor, quant.quantize_int8_per_channel])
def test_all_zero_matrix(fn):
    w = torch.zeros(5, 8)
    q, scale = fn(w)
    assert (q.float() == 0).all()
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(quant.dequantize(q, scale), torch.zeros(5, 8))
    # the floors, by hand: fp8 1 / (448 * 512) = 4.36e-6 (vLLM), int8 float32 eps = 2^-23
    floor = 1 / (448 * 512) if fn is quant.quantize_fp8_per_tensor else 2**-23
    assert torch.allclose(scale, torch.tensor(floor), rtol=1e-7, atol=0)


def test_fp8_floor_on_tiny_weights():
    w = torch.tensor([[1e-4, -5e-5], [2e-5, 0.0]])  # amax 1e-4 < 1/512: the floor sets the scale
    q, scale = quant.quantize_fp8_per_tensor(w)
    assert scale.item() == pytest.approx(1 / (448 * 512), rel=1e-7)
    # q = w * 229376 rounded in e4m3 (spacing 2 in [16, 32), 1 in [8, 16), 0.5 in [4, 8)):
    # 22.94 -> 22, -11.47 -> -11, 4.59 -> 4.5, 0 -> 0. Without the floor 1e-4 would map to 448.
    assert q.float().tolist() == [[22.0, -11.0], [4.5, 0.0]]


def test_constant_rows():
    w = torch.tensor([[0.3] * 6, [-2.5] * 6, [1e-3] * 6])
    q, scale = quant.quantize_int8_per_channel(w)
    assert (q == torch.tensor([[127], [-127], [127]], dtype=torch.int8)).all()
    torch.testing.assert_close(quant.dequantize(q, scale), w, rtol=1e-6, atol=0)
    q, scale = quant.quantize_fp8_per_tensor(w)
    assert (q.float()[1] == -448).all()  # the amax row; 0.3 and 1e-3 are rounded, not clipped
    assert (quant.dequantize(q, scale) - w).abs().le(fp8_bound(w, scale)).all()


def test_zero_row_leaves_other_rows_alone():
    w = randn((8, 32), seed=4)
    w0 = w.clone()
    w0[3] = 0
    q, scale = quant.quantize_int8_per_channel(w)
    q0, scale0 = quant.quantize_int8_per_channel(w0)
    keep = torch.arange(8) != 3
    assert torch.equal(scale0[keep], scale[keep]) and torch.equal(q0[keep], q[keep])
    assert (q0[3] == 0).all() and scale0[3].item() == quant.INT8_MIN_SCALE


# -----------------------------------------------------------------------------
# 4. bf16 in (what the trainer holds) gives the same bits as float32 of the same values

def test_bf16_input_matches_float32():
    w = randn((33, 70), seed=5, std=0.05).bfloat16()
    q, s = quant.quantize_fp8_per_tensor(w)
    q32, s32 = quant.quantize_fp8_per_tensor(w.float())
    assert torch.equal(s, s32) and torch.equal(q.view(torch.uint8), q32.view(torch.uint8))
    q, s = quant.quantize_int8_per_channel(w)
    q32, s32 = quant.quantize_int8_per_channel(w.float())
    assert torch.equal(s, s32) and torch.equal(q, q32)


# -----------------------------------------------------------------------------
# 5. properties on random matrices

@st.composite
def matrices(draw):
    """(out, in) float32 with a drawn magnitude and some all-zero rows."""
    seed = draw(st.integers(0, 2**31 - 1))
    out, inp = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * draw(st.sampled_from([1e-4, 1e-2, 1.0, 300.0]))
    zero_rows = torch.tensor(draw(st.lists(st.booleans(), min_size=out, max_size=out)))
    return w.masked_fill(zero_rows[:, None], 0.0)


@FAST_QUANT
@given(matrices())
def test_int8_properties(w):
    q, scale = quant.quantize_int8_per_channel(w)
    assert q.abs().max() <= 127
    amax = w.abs().amax(dim=1)
    full = amax >= 127 * 2**-23  # rows above the eps floor: their amax maps to exactly 127
    assert (q.abs().amax(dim=1)[full] == 127).all()
    assert (q[amax == 0] == 0).all()
    assert ((quant.dequantize(q, scale) - w).abs() <= scale / 2 * (1 + 1e-5)).all()


@FAST_QUANT
@given(matrices())
def test_fp8_properties(w):
    q, scale = quant.quantize_fp8_per_tensor(w)
    i = w.abs().argmax()
    if w.abs().max() >= 1 / 512:  # 448 * floor: above it the amax element is exactly +-448
        assert q.float().flatten()[i].abs() == 448
    assert q.float().abs().max() <= 448
    assert ((quant.dequantize(q, scale) - w).abs() <= fp8_bound(w, scale)).all()



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    # (300, 200) was enough to catch CUDA's `t / 127` = t * (1 / 127) flipping 7 of 60k int8 values
    w = randn((1024, 512), seed=6, std=0.05).bfloat16()
    for fn in (quant.quantize_fp8_per_tensor, quant.quantize_int8_per_channel):
        (q, s), (qc, sc) = fn(w), fn(w.cuda())
        assert torch.equal(s, sc.cpu())
        assert torch.equal(q.view(torch.uint8), qc.cpu().view(torch.uint8))


# -----------------------------------------------------------------------------
# 6. the int8 checkpoint folder

def test_int8_config_selects_w8a8_int8_dynamic_token():
    """The dict passes the checks that route vLLM 0.26 to CompressedTensorsW8A8Int8, dynamic."""
    cfg = json.loads(json.dumps(quant.int8_quantization_config()))  # survives config.json
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    (group,) = cfg["config_groups"].values()
    w, a = group["weights"], group["input_activations"]
    # _is_dynamic_token_w8a8 (compressed_tensors.py:483)
    assert w["num_bits"] == a["num_bits"] == 8 and w["type"] == a["type"] == "int"
    assert w["strategy"] == "channel" and a["strategy"] == "token"
    assert w["symmetric"] and a["symmetric"] and not w["dynamic"] and a["dynamic"] is True
    assert group["targets"] == ["Linear"] and cfg["ignore"] == ["lm_head"]


@pytest.mark.parametrize("tied", [True, False])
def test_save_int8_checkpoint(tmp_path, tied):
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = make_tiny_tokenizer()
    # vocab = the tokenizer's 259 ids rather than 64, so the folder is a consistent model
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}

    out = quant.save_int8_checkpoint(model, tok, str(tmp_path / "int8"))
    assert not hasattr(model.config, "quantization_config")  # the trainer's config is untouched
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"] == quant.int8_quantization_config()
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    assert os.path.exists(os.path.join(out, "generation_config.json"))

    from transformers import AutoConfig  # vLLM reads config.json through transformers
    assert AutoConfig.from_pretrained(out).quantization_config["format"] == "int-quantized"

    path = os.path.join(out, "model.safetensors")
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what save_pretrained writes
    t = load_file(path)
    projs = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    linears = [f"model.layers.{i}.{p}" for i in range(2) for p in projs]
    for name in linears:
        q, scale = t[name + ".weight"], t[name + ".weight_scale"]
        w = sd[name + ".weight"].float()
        assert q.dtype == torch.int8 and q.shape == w.shape
        assert scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1)
        assert ((quant.dequantize(q, scale) - w).abs() <= scale / 2 * (1 + 1e-5)).all()
    for i in range(2):
        for p in ("q_proj", "k_proj", "v_proj"):  # Qwen2's attention biases, unquantized
            key = f"model.layers.{i}.self_attn.{p}.bias"
            assert t[key].dtype == torch.bfloat16 and torch.equal(t[key], sd[key])
    rest = [k for k in sd if k.rpartition(".")[0] not in linears or k.endswith(".bias")]
    for key in rest:  # embeddings, norms, biases (and lm_head when untied), bit-identical
        if key == "lm_head.weight" and tied:
            continue
        assert t[key].dtype == torch.bfloat16 and torch.equal(t[key], sd[key]), key
    assert ("lm_head.weight" in t) == (not tied)
    assert not any(k.startswith("lm_head") and k.endswith("_scale") for k in t)
    expected = {k for k in sd if not (tied and k == "lm_head.weight")}
    expected |= {n + ".weight_scale" for n in linears}
    assert set(t) == expected


# ---- options/critic.py: PPO's critic side, critic.gae_advantages / value_loss / explained_variance.
# Hand-computed examples, hypothesis properties against a slow per-sequence reference, and a tiny
# random critic (conftest's tiny Llama, plus a tiny Qwen2 built here) that learns a toy problem and
# saves/loads bit-exact; on 2 processes (gloo, test_dist.py's helpers) a --algo gae step updates the
# critic and the policy as one process does

FAST_CRITIC = settings(max_examples=50, deadline=None)
F64 = torch.float64
NAN = float("nan")


def close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a, b)


def t64(rows):
    return torch.tensor(rows, dtype=F64)


def slow_gae(rewards, values, mask, gamma, lam):
    """Reference: per sequence, take the policy tokens out, run textbook GAE on that list
    (terminal after the last one), put the results back. (A, R) unwhitened, 0 off the mask."""
    A, R = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for b in range(mask.shape[0]):
        pos = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        r = [float(rewards[b, t]) for t in pos]
        v = [float(values[b, t]) for t in pos] + [0.0]
        a = 0.0
        for k in reversed(range(len(pos))):
            a = r[k] + gamma * v[k + 1] - v[k] + gamma * lam * a
            A[b, pos[k]], R[b, pos[k]] = a, a + v[k]
    return A, R


@st.composite
def episodes(draw, max_b=4, max_t=8):
    """(rewards, values, mask) (B, T) f64 from a seed; junk (nan) rewards and values off the mask."""
    B, T = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    p = draw(st.sampled_from([0.5, 0.8, 1.0]))
    mask = (torch.rand(B, T, generator=g) < p).to(F64)
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    junk = torch.full_like(mask, NAN)
    return torch.where(mask > 0, rewards, junk), torch.where(mask > 0, values, junk), mask


unit = st.floats(0.0, 1.0)

# -----------------------------------------------------------------------------
# GAE: hand-computed examples


def test_hand_gae_single_turn():
    # one sequence: position 0 is the prompt (junk value 9, junk reward 5), policy tokens 1..3,
    # outcome reward 1 on the last one
    mask = t64([[0, 1, 1, 1]])
    rew = t64([[5, 0, 0, 1]])
    val = t64([[9, 0.5, 0.6, 0.8]])
    # gamma 0.9, lam 0.8 (gamma lam = 0.72):
    #   delta3 = 1 + 0.9 * 0 - 0.8 = 0.2                 A3 = 0.2
    #   delta2 = 0 + 0.9 * 0.8 - 0.6 = 0.12              A2 = 0.12 + 0.72 * 0.2 = 0.264
    #   delta1 = 0 + 0.9 * 0.6 - 0.5 = 0.04              A1 = 0.04 + 0.72 * 0.264 = 0.23008
    #   returns = A + V = [-, 0.73008, 0.864, 1.0]
    adv, ret = critic.gae_advantages(rew, val, mask, gamma=0.9, lam=0.8, whiten=False)
    close(adv, [[0, 0.23008, 0.264, 0.2]])
    close(ret, [[0, 0.73008, 0.864, 1.0]])
    # lam = 0: one-step TD errors, A = delta = [-, 0.04, 0.12, 0.2]
    adv0, ret0 = critic.gae_advantages(rew, val, mask, gamma=0.9, lam=0.0, whiten=False)
    close(adv0, [[0, 0.04, 0.12, 0.2]])
    close(ret0, [[0, 0.54, 0.72, 1.0]])  # r + gamma V_next: the TD target
    # gamma = lam = 1: returns are the reward-to-go (1 everywhere), A = 1 - V
    adv1, ret1 = critic.gae_advantages(rew, val, mask, gamma=1.0, lam=1.0, whiten=False)
    close(ret1, [[0, 1, 1, 1]])
    close(adv1, [[0, 0.5, 0.4, 0.2]])


def test_hand_gae_multi_turn_skips_the_env_block():
    # policy turn (positions 0, 1), a tool result (2, 3: mask 0, junk values 9 and rewards 5),
    # a second policy turn (4, 5) with the outcome reward 1 on its last token
    mask = t64([[1, 1, 0, 0, 1, 1]])
    rew = t64([[0, 0, 5, 5, 0, 1]])
    val = t64([[0.3, 0.2, 9, 9, 0.4, 0.5]])
    # gamma 0.5, lam 0.5 (gamma lam = 0.25); "next" of position 1 is position 4:
    #   delta5 = 1 - 0.5 = 0.5                         A5 = 0.5
    #   delta4 = 0.5 * 0.5 - 0.4 = -0.15               A4 = -0.15 + 0.25 * 0.5 = -0.025
    #   delta1 = 0.5 * 0.4 - 0.2 = 0.0                 A1 = 0 + 0.25 * -0.025 = -0.00625
    #   delta0 = 0.5 * 0.2 - 0.3 = -0.2                A0 = -0.2 + 0.25 * -0.00625 = -0.2015625
    # (stepping through the env block instead would use V = 9 and two more discounts)
    adv, ret = critic.gae_advantages(rew, val, mask, gamma=0.5, lam=0.5, whiten=False)
    close(adv, [[-0.2015625, -0.00625, 0, 0, -0.025, 0.5]])
    close(ret, [[0.0984375, 0.19375, 0, 0, 0.375, 1.0]])


def test_hand_gae_whitening():
    # two sequences, gamma = lam = 1, V = 0: A = reward-to-go = [[1, 1], [0, -]] before whitening;
    # whitened over the 3 policy tokens: mean 2/3, unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3
    mask = t64([[1, 1], [1, 0]])
    rew = t64([[0, 1], [0, NAN]])
    val = torch.zeros(2, 2, dtype=F64)
    raw, ret = critic.gae_advantages(rew, val, mask, 1.0, 1.0, whiten=False)
    white, ret_w = critic.gae_advantages(rew, val, mask, 1.0, 1.0, whiten=True)
    close(raw, [[1, 1], [0, 0]])
    sd = (1 / 3) ** 0.5
    close(white, [[1 / 3 / sd, 1 / 3 / sd], [-2 / 3 / sd, 0]], 1e-6)  # eps 1e-8 in the sqrt
    close(ret_w, ret)  # the returns are never whitened
    close(ret, [[1, 1], [0, 0]])


def test_gae_zeros_off_the_mask_and_junk_ignored():
    mask = t64([[0, 1, 1, 0, 0], [0, 0, 1, 0, 0]])  # prompt, response, padding
    rew = t64([[NAN, 0, 1, NAN, 7], [3, NAN, -1, 4, NAN]])
    val = t64([[NAN, 0.1, 0.2, NAN, 8], [float("inf"), NAN, 0.3, 2, NAN]])
    for whiten in (False, True):
        adv, ret = critic.gae_advantages(rew, val, mask, 0.99, 0.95, whiten=whiten)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    adv, ret = critic.gae_advantages(rew, val, mask, 0.99, 0.95, whiten=False)
    close(adv[1, 2], -1 - 0.3)  # a one-token response: A = r - V
    close(ret[1, 2], -1.0)


def test_gae_rejects_bad_input():
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match="must all be"):
        critic.gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), m, 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma"):
        critic.gae_advantages(torch.zeros(2, 3), torch.zeros(2, 3), m, 1.5, 1.0)
    v = torch.zeros(2, 3)
    v[1, 1] = NAN  # a nan value on a policy token is a broken critic, not junk
    with pytest.raises(ValueError, match="non-finite values"):
        critic.gae_advantages(torch.zeros(2, 3), v, m, 1.0, 1.0)

# -----------------------------------------------------------------------------
# GAE: properties


@FAST_CRITIC
@given(episodes(), unit, unit)
def test_gae_matches_slow_per_sequence_reference(ep, gamma, lam):
    rew, val, mask = ep
    adv, ret = critic.gae_advantages(rew, val, mask, gamma, lam, whiten=False)
    ref_a, ref_r = slow_gae(rew, val, mask, gamma, lam)
    close(adv, ref_a)
    close(ret, ref_r)
    close(critic.gae_advantages(rew, val, mask, gamma, lam)[0], grpo.masked_whiten(ref_a, mask))


@FAST_CRITIC
@given(episodes(), unit, unit, st.integers(0, 2**31 - 1))
def test_gae_inserting_env_tokens_anywhere_changes_nothing(ep, gamma, lam, seed):
    # multi-turn episodes interleave tool output (mask 0, junk values and rewards) with policy
    # tokens: wherever it lands, the policy tokens' advantages and returns stay the same
    rew, val, mask = ep
    B, T = mask.shape
    g = torch.Generator().manual_seed(seed)
    W = T + int(torch.randint(1, 6, (1,), generator=g))  # W - T env tokens per row
    rew2 = torch.full((B, W), 5.0, dtype=F64)
    val2 = torch.full((B, W), 9.0, dtype=F64)
    mask2 = torch.zeros(B, W, dtype=F64)
    cols = torch.stack([torch.randperm(W, generator=g)[:T].sort().values for _ in range(B)])  # (B, T)
    rows = torch.arange(B)[:, None]
    rew2[rows, cols], val2[rows, cols], mask2[rows, cols] = rew, val, mask
    for whiten in (False, True):
        a1, r1 = critic.gae_advantages(rew, val, mask, gamma, lam, whiten)
        a2, r2 = critic.gae_advantages(rew2, val2, mask2, gamma, lam, whiten)
        close(a2[rows, cols], a1)
        close(r2[rows, cols], r1)
        assert (a2[mask2 == 0] == 0).all() and (r2[mask2 == 0] == 0).all()


@FAST_CRITIC
@given(episodes(), unit)
def test_gae_lambda_one_is_return_minus_value_and_v0_is_reinforce_pp(ep, gamma):
    rew, val, mask = ep
    G = grpo._discounted_returns(rew, mask, gamma)  # REINFORCE++'s returns (mask-0 skipped)
    adv, ret = critic.gae_advantages(rew, val, mask, gamma, 1.0, whiten=False)
    close(ret, G)  # lam = 1: the returns are Monte Carlo, whatever V is
    close(adv, torch.where(mask > 0, G - val, 0.0))
    # with V = 0 the whitened advantages are exactly REINFORCE++'s (a fresh critic's first step)
    zero = torch.zeros_like(val)
    close(critic.gae_advantages(rew, zero, mask, gamma, 1.0)[0], grpo.reinforce_pp_advantages(rew, mask, gamma))


@FAST_CRITIC
@given(episodes(), unit)
def test_gae_lambda_zero_is_one_step_td(ep, gamma):
    rew, val, mask = ep
    adv, ret = critic.gae_advantages(rew, val, mask, gamma, 0.0, whiten=False)
    # V of the next policy token of the same row (0 after the last one), found by a plain scan
    nxt = torch.zeros_like(val)
    for b in range(mask.shape[0]):
        v_next = 0.0
        for t in reversed(range(mask.shape[1])):
            if mask[b, t] > 0:
                nxt[b, t], v_next = v_next, float(val[b, t])
    target = torch.where(mask > 0, rew + gamma * nxt, 0.0)  # r_t + gamma V_t'
    close(ret, target)  # lam = 0: the returns are the TD targets
    close(adv, torch.where(mask > 0, target - val, 0.0))  # and A the TD errors


# -----------------------------------------------------------------------------
# value loss


def test_hand_value_loss_clipped_and_unclipped():
    v = torch.tensor([[1.0, 0.0, 0.5, NAN]], dtype=F64, requires_grad=True)
    old = t64([[0.5, 0.5, 0.5, NAN]])
    R = t64([[2.0, 1.0, 0.0, NAN]])
    mask = t64([[1, 1, 1, 0]])  # the last token is padding with junk everywhere
    # c = 0.2, bounds [0.3, 0.7]:
    #   t0: (1 - 2)^2 = 1,   clip -> 0.7: (0.7 - 2)^2 = 1.69 larger -> 0.845, clipped, gradient 0
    #   t1: (0 - 1)^2 = 1,   clip -> 0.3: (0.3 - 1)^2 = 0.49        -> 0.5,   gradient v - R = -1
    #   t2: (0.5 - 0)^2 = 0.25, inside the bounds: equal              -> 0.125, gradient 0.5
    loss, st = critic.value_loss(v, old, R, mask, clip=0.2)
    close(loss, [[0.845, 0.5, 0.125, 0.0]])
    close(st["vf_clipfrac"], 1 / 3)
    close(st["value_mean"], 0.5)
    (grad,) = torch.autograd.grad(loss.sum(), v)
    close(grad, [[0.0, -1.0, 0.5, 0.0]])
    # unclipped (None or 0): 0.5 (v - R)^2 everywhere, nothing clipped
    for c in (None, 0, 0.0):
        loss_u, st_u = critic.value_loss(v, old, R, mask, clip=c)
        close(loss_u, [[0.5, 0.5, 0.125, 0.0]])
        close(st_u["vf_clipfrac"], 0.0)
    assert not st["vf_clipfrac"].requires_grad and st["vf_clipfrac"].dim() == 0
    with pytest.raises(ValueError):
        critic.value_loss(v, old, R, mask, clip=-0.1)


@FAST_CRITIC
@given(episodes(), st.floats(0.01, 2.0), st.integers(0, 2**31 - 1))
def test_value_loss_clip_only_adds(ep, c, seed):
    # max(l1, l2) >= l1; equal where v stays within c of v_old; 0 off the mask
    _, R, mask = ep
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(mask.shape, generator=g, dtype=F64)
    v = old + torch.randn(mask.shape, generator=g, dtype=F64)
    clipped, st = critic.value_loss(v, old, R, mask, clip=c)
    plain, _ = critic.value_loss(v, old, R, mask, clip=None)
    assert ((clipped - plain)[mask > 0] >= 0).all()
    inside = ((v - old).abs() <= c) & (mask > 0)
    close(clipped[inside], plain[inside])
    assert (clipped[mask == 0] == 0).all() and (plain[mask == 0] == 0).all()
    assert 0.0 <= float(st["vf_clipfrac"]) <= 1.0


def test_hand_explained_variance():
    R = t64([[1, 2, 3, NAN]])
    mask = t64([[1, 1, 1, 0]])
    close(critic.explained_variance(R, R, mask), 1.0)  # perfect critic
    close(critic.explained_variance(torch.full_like(R, 2.0), R, mask), 0.0)  # the mean: no better than a constant
    # V = [3, 2, 1]: R - V = [-2, 0, 2], Var 8/3 against Var(R) = 2/3 -> 1 - 4 = -3
    close(critic.explained_variance(t64([[3, 2, 1, NAN]]), R, mask), -3.0)
    close(critic.explained_variance(R, torch.ones_like(R), mask), 0.0)  # Var(R) = 0: reported as 0

# -----------------------------------------------------------------------------
# the critic model (tiny random Llama from conftest, a tiny Qwen2 built here)


def make_tiny_qwen2(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return Qwen2ForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("tiny_qwen2")
    make_tiny_qwen2(tiny_tokenizer).save_pretrained(d)
    return str(d)


@pytest.fixture(params=["llama", "qwen2"])
def policy_dir(request, tiny_model_dir, qwen2_dir):
    return tiny_model_dir if request.param == "llama" else qwen2_dir


def _policy(d):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)


def toy_batch(B=4, T=12, seed=0):
    """A right-padded batch dict like episodes_to_batch's: rows of lengths T, T-3, T-5, ...;
    prompt = the first 3 tokens; reward +1 / -1 alternating."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    lengths = torch.tensor([max(T - 2 * i - (i > 0), 5) for i in range(B)])
    attn = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.where(attn > 0, ids, 256)  # pad id
    loss_mask = (attn > 0) & (torch.arange(T)[None] >= 3)
    rewards = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(B)])
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask.float(), "rewards": rewards,
            "groups": torch.zeros(B, dtype=torch.long)}


def test_load_critic_from_a_policy_folder(policy_dir):
    from transformers import AutoModelForCausalLM
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    c = critic.load_critic(policy_dir)
    assert type(c).__name__.endswith("ForTokenClassification")
    assert c.dropout.p == 0.0 and c.config.classifier_dropout == 0.0  # transformers' default would be 0.1
    assert all(p.dtype == torch.float32 for p in c.parameters())
    assert (c.score.weight == 0).all() and (c.score.bias == 0).all()  # zero head: V = 0 to start
    # the trunk is the policy's, weight for weight
    pol = policy.model.state_dict()
    for name, w in c.model.state_dict().items():
        assert torch.equal(w, pol[name]), name
    batch = toy_batch()
    v = critic.batch_values(c, batch, micro_batch_size=3)
    assert v.shape == (4, 11) and (v == 0).all()


def _critic_with_random_head(model_dir, bias):
    """A fresh critic whose head is N(0, 1) (seed 0) with a constant bias, so values are not all 0."""
    c = critic.load_critic(model_dir)
    with torch.no_grad():
        c.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
        c.score.bias.fill_(bias)
    return c


def test_token_values_are_the_hf_forward_aligned_with_logprobs(tiny_model_dir):
    c = _critic_with_random_head(tiny_model_dir, bias=0.3)
    batch = toy_batch()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        v = critic.token_values(c, ids, attn)
        ref = c(input_ids=ids, attention_mask=attn).logits[:, :-1, 0]  # position t's output: V(ids[:, :t+1])
        lp, _ = score.sequence_logprobs(_policy(tiny_model_dir), ids, attn)
    assert v.dtype == torch.float32 and v.shape == lp.shape == (4, 11)
    close(v, ref, 1e-6)
    # V at column t depends on tokens 0..t only: changing token t+1 leaves column t alone
    ids2 = ids.clone()
    ids2[:, 6] = (ids2[:, 6] + 1) % 256
    with torch.no_grad():
        v2 = critic.token_values(c, ids2, attn)
    assert torch.equal(v2[:, :6], v[:, :6]) and not torch.equal(v2[:, 6:], v[:, 6:])
    # batch_values == one row at a time, on each row's real positions (micro-batches, padding trimmed)
    bv = critic.batch_values(c, batch, micro_batch_size=3)
    for i in range(4):
        n = int(attn[i].sum())
        with torch.no_grad():
            one = critic.token_values(c, ids[i:i + 1, :n], attn[i:i + 1, :n])
        close(bv[i, :n - 1], one[0], 1e-5)


def test_token_values_head_runs_in_float32_under_bf16_autocast(tiny_model_dir):
    # the decoder's matmuls run in bf16 under autocast, the head does not: a bf16 value near 1 is
    # off by up to ~0.004, the size of the TD errors GAE sums
    c = _critic_with_random_head(tiny_model_dir, bias=1.0)
    batch = toy_batch()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        v = critic.token_values(c, ids, attn)
        h = c.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]  # (the final norm is fp32)
        assert c.score(h).dtype == torch.bfloat16  # what the head would give inside the autocast
    assert v.dtype == torch.float32
    with torch.no_grad():
        close(v, c.score(h).squeeze(-1), 1e-6)  # the fp32 head on the bf16 trunk's output
    assert (v != v.bfloat16().float()).any()  # values not rounded to bf16


def test_fresh_critic_gives_reinforce_pp_advantages(tiny_model_dir):
    # V = 0 everywhere at the start, so GAE with lam = 1 is exactly REINFORCE++ on the first step
    c = critic.load_critic(tiny_model_dir)
    batch = toy_batch()
    mask = batch["loss_mask"][:, 1:]
    tr = grpo.last_token_rewards(batch["rewards"], mask)
    adv, ret = critic.gae_advantages(tr, critic.batch_values(c, batch, 4), mask, gamma=1.0, lam=1.0)
    close(adv, grpo.reinforce_pp_advantages(tr, mask, 1.0))
    close(ret, grpo.broadcast_to_tokens(batch["rewards"], mask))  # returns = the outcome on every token


def train_critic(c, batch, rollouts, epochs=3, lr=1e-2, clip=0.5):
    """PPO's critic loop on one fixed batch: per "rollout" the old values (no grad, before the
    update), then `epochs` AdamW steps of the clipped value loss against fixed returns (GAE with
    gamma = lam = 1: the outcome on every token). Returns the loss of every step."""
    mask = batch["loss_mask"][:, 1:]
    R = grpo.broadcast_to_tokens(batch["rewards"], mask)
    opt = torch.optim.AdamW(c.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(rollouts):
        old = critic.batch_values(c, batch, 4)
        c.train()  # dropout 0: the same function as eval
        for _ in range(epochs):
            v = critic.token_values(c, batch["input_ids"], batch["attention_mask"])
            per_tok, _ = critic.value_loss(v, old, R, mask, clip=clip)
            loss = grpo.token_mean(per_tok, mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        c.eval()
    return losses


def test_value_loss_falls_on_a_toy_problem(tiny_model_dir):
    torch.manual_seed(0)
    c = critic.load_critic(tiny_model_dir)
    losses = train_critic(c, toy_batch(), rollouts=10)  # 30 AdamW steps
    assert losses[0] == pytest.approx(0.5)  # V = 0, R = +-1: 0.5 * 1 on every token
    assert losses[-1] < 0.1 * losses[0], losses


def test_save_and_load_is_bit_exact(tiny_model_dir, tmp_path):
    c = critic.load_critic(tiny_model_dir)
    batch = toy_batch()
    train_critic(c, batch, rollouts=1)  # a trained head and trunk, not the initial weights
    assert (c.score.weight != 0).any()
    folder = critic.save_critic(c, tmp_path / critic.FOLDER)
    c2 = critic.load_critic(folder)
    sd, sd2 = c.state_dict(), c2.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert sd[k].dtype == sd2[k].dtype and torch.equal(sd[k], sd2[k]), k  # the head is not re-zeroed
    assert torch.equal(critic.batch_values(c, batch, 3), critic.batch_values(c2, batch, 3))


def test_save_refuses_a_lora_critic(tiny_model_dir, tmp_path):
    from options import lora
    c = critic.load_critic(tiny_model_dir)
    lora.apply_lora(c, 4, 8, ["q_proj"])
    with pytest.raises(ValueError, match="LoRA"):
        critic.save_critic(c, tmp_path / "c")


def test_memory_figure_in_the_docstring():
    # critic.py's docstring: a Qwen2.5-1.5B critic has 1,543,715,841 parameters, 16 bytes each in
    # float32 training (weights 4 + grads 4 + AdamW 8) = 24.7 GB
    from transformers import Qwen2Config, Qwen2ForTokenClassification
    with torch.device("meta"):
        c = Qwen2ForTokenClassification(Qwen2Config(num_labels=1, **sources.SHAPES["random-qwen2.5-1.5b"]))
    n = sum(p.numel() for p in c.parameters())
    assert n == 1_543_715_841
    assert round(16 * n / 1e9, 1) == 24.7 and round(4 * n / 1e9, 1) == 6.2


def test_load_critic_prints_one_plain_line(tiny_model_dir, capsys):
    # not transformers' load report (a table with ANSI codes about the new head): one line of ours
    import logging
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        critic.load_critic(tiny_model_dir)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert [r.getMessage()[:60] for r in records] == []
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "\x1b[" not in lines[0] and "value head" in lines[0], lines


# ---- torchrun: the critic on 2 processes (gloo, CPU) against one

def _gae_step(rank, size, model_dir, eps, shard, out):
    """One --algo gae train_step on this rank's groups, SGD for the policy (lr 1) and the critic (a
    random value head, so the trunk's gradient is not 0: ~1e3, so lr 1e-3); rank 0 saves both
    models' weight deltas."""
    import train
    from conftest import make_tiny_model, make_tiny_tokenizer
    from support import dist
    tok = make_tiny_tokenizer()
    policy, c = make_tiny_model(tok), _critic_with_random_head(model_dir, bias=0.3)
    before = {"policy": {k: v.clone() for k, v in policy.state_dict().items()},
              "critic": {k: v.clone() for k, v in c.state_dict().items()}}
    args = train.parse_args(["--model", "x", "--algo", "gae", "--prompts-per-step", "4", "--n", "4",
                             "--micro-batch-size", "2", "--max-context", "64", "--grad-clip", "0"])
    args.shard = shard  # train.py refuses FSDP with the HF engine; train_step alone needs no engine
    world = dist.World("cpu")
    scorer, policy = dist.wrap(score.Scorer(policy), world, shard, torch.float32)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    run = train.Run(args, policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0), critic=c,
                    critic_optimizer=torch.optim.SGD(c.parameters(), lr=1e-3), scorer=scorer, world=world,
                    pad_id=tok.pad_token_id)
    state = {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0}
    m = world.mean_metrics(train.train_step(run, [e for e in eps if e.group % size == rank], state))
    after = {"policy": dist.full_state_dict(policy, world.main) if size > 1 else policy.state_dict(),
             "critic": c.state_dict()}
    if world.main:
        torch.save({"delta": {name: {k: after[name][k] - v for k, v in b.items()} for name, b in before.items()},
                    "metrics": m}, out)
    world.close()


def _gae_worker(rank, size, port, model_dir, eps, shard, out):
    from test_dist import _as_rank
    _as_rank(rank, size, port)
    _gae_step(rank, size, model_dir, eps, shard, out)


@pytest.mark.parametrize("shard", ["ddp", "fsdp"])
def test_two_rank_critic_and_policy_updates_equal_one_rank(tiny_model_dir, tmp_path, shard):
    # each rank: every other group; the critic's loss divides by both ranks' tokens and its gradients
    # are summed over ranks, GAE's whitening reads both ranks' tokens: one update of each model equals
    # the one-process update on all the episodes (the critic is replicated, under FSDP2 too)
    from conftest import make_tiny_tokenizer
    from test_dist import _episodes, _free_port, _spawn
    eps = _episodes(make_tiny_tokenizer())
    _gae_step(0, 1, tiny_model_dir, eps, "ddp", tmp_path / "one.pt")  # in this process: a world of one
    _spawn(_gae_worker, (2, _free_port(), tiny_model_dir, eps, shard, tmp_path / "two.pt"))
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for name in ("policy", "critic"):
        assert any(v.abs().max() > 0 for v in one["delta"][name].values()), name  # the update moved it
        for k, v in one["delta"][name].items():
            torch.testing.assert_close(two["delta"][name][k], v, rtol=1e-4, atol=1e-6, msg=f"{name} {k}")
    assert any(v.abs().max() > 0 for k, v in one["delta"]["critic"].items() if k not in critic.HEAD)  # the trunk too
    for k in ("loss", "grad_norm", "vf_loss", "critic_grad_norm"):
        assert two["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-4, abs=1e-7), k


def test_gae_run_on_two_processes(tiny_model_dir, tmp_path):
    # train.py under 2 processes with a critic and 2 updates a step (--mini-batch-size 4 of 4 prompts x 2:
    # 2 episodes a rank each): 2 steps, every update counted, a checkpoint with the critic
    import json
    from test_dist import _run
    from test_train import _argv
    _run(2, _argv(tiny_model_dir, tmp_path, "--algo", "gae", "--prompts-per-step", "4", "--n", "2",
                  "--mini-batch-size", "4"))
    hist = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [h["step"] for h in hist] == [1, 2]
    for h in hist:
        assert h["episodes"] == 8 and h["updates"] == 2 and h["vf_loss"] > 0 and h["critic_grad_norm"] > 0
    assert (tmp_path / "ckpt" / "step_000002" / critic.FOLDER / "model.safetensors").exists()


# ---- options/prefix.py (--shared-prefix): a micro-batch's common prefix computed once, as one packed
# row under a block mask, against the padded path it replaces. The packed path must give the padded
# path's logp, entropy and gradients (same math, float rounding only) for chunk = 0 and chunk > 0,
# Llama and Qwen2 (attention biases), LoRA and gradient checkpointing; keep rows independent (the
# test that fails if transformers ignored the mask); fall back where sharing does not pay; and
# micro_batches must group rows by prefix within the packed-token budget; --compile's scoring and
# score.token_logprobs_chunked must equal score.token_logprobs (the GPU tests -- bf16 autocast,
# torch.compile, memory.compile_model -- skip without CUDA)

TOK = make_tiny_tokenizer()
SYSTEM = 70  # tokens of the shared system block: above prefix.MIN_SHARED (64), so rows pack


def make_qwen2(seed=0):
    """A 2-layer, 64-wide random Qwen2 (q/k/v biases, untied head): the real target's architecture."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=len(TOK), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, pad_token_id=TOK.pad_token_id, bos_token_id=None,
                      eos_token_id=TOK.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(cfg).float().eval()


def prefix_model(kind, variant="base"):
    model = make_tiny_model(TOK) if kind == "llama" else make_qwen2()
    if variant == "lora":
        with torch.random.fork_rng():  # the same A in both models; B = 0 would leave A without gradient
            torch.manual_seed(1)
            lora.apply_lora(model, 4, 8.0)
            for m in lora.lora_modules(model).values():
                m.lora_B.data.normal_(0, 0.05)
    elif variant == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train(True)
    return model


def make_batch(seed=0, system=SYSTEM, groups=2, n=3):
    """groups x n rows: [system block | the group's prompt | a response of its own length], right-padded;
    a multi-turn loss mask (b, T-1): 1 on response tokens except an inner env span, 0 on prompt and pad."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda k: torch.randint(0, 256, (k,), generator=g).tolist()  # noqa: E731
    head, seqs, spans = tok(system), [], []
    for j in range(groups):
        prompt = head + tok(6 + j)
        for i in range(n):
            r = 4 + 7 * i + 3 * j  # responses of different lengths
            seqs.append(prompt + tok(r))
            spans.append((len(prompt), len(prompt) + r))
    ids, attn = score.pad(seqs, TOK.pad_token_id)
    mask = torch.zeros(len(seqs), ids.shape[1] - 1)
    for b, (s, e) in enumerate(spans):
        mask[b, s - 1:e - 1] = 1  # column t scores token t + 1
        if e - s > 8:
            mask[b, s + 2:s + 5] = 0  # a tool result inside the response: env tokens, not trained
    return ids, attn, mask


def run(model, ids, attn, mask, chunk, shared_prefix):
    """(logp, entropy, gradients) of loss = sum(adv x logp x mask), the shape of the policy loss."""
    adv = torch.linspace(-1.0, 1.5, len(ids), device=ids.device)[:, None]
    forward = prefix.sequence_logprobs if shared_prefix else score.sequence_logprobs
    logp, ent = forward(model, ids, attn, temperature=0.7, chunk=chunk, entropy=True)
    (adv * logp * mask).sum().backward()
    grads = {k: p.grad.float().cpu() for k, p in model.named_parameters() if p.requires_grad}
    return (logp.detach() * mask).cpu(), (ent * mask).cpu(), grads


@pytest.fixture
def spy(monkeypatch):
    """Counts packed forwards: calls[0] after a run says which path it took."""
    calls, real = [0], prefix.packed_logprobs

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)
    monkeypatch.setattr(prefix, "packed_logprobs", counted)
    return calls


def assert_same(a, b):
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = a, b
    assert torch.allclose(lp_a, lp_b, atol=1e-5) and torch.allclose(ent_a, ent_b, atol=1e-5)
    assert g_a.keys() == g_b.keys() and g_a
    for k in g_a:  # the same sums in another order: agree to float32 rounding of the largest entry
        assert (g_a[k] - g_b[k]).abs().max() <= 1e-5 * g_a[k].abs().max() + 1e-7, k


@pytest.mark.parametrize("variant", ["base", "lora", "checkpointing"])
@pytest.mark.parametrize("chunk", [0, 64])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_equals_padded(kind, chunk, variant, spy):
    # two groups whose prompts part after the system block: p = SYSTEM, six suffixes of 10..28 tokens
    ids, attn, mask = make_batch()
    padded = run(prefix_model(kind, variant), ids, attn, mask, chunk, shared_prefix=False)
    packed = run(prefix_model(kind, variant), ids, attn, mask, chunk, shared_prefix=True)
    assert spy[0] == 1
    assert_same(padded, packed)


def test_packed_equals_padded_eager_attention(spy):
    # eager attention adds the mask to the scores: the same additive mask works there too
    ids, attn, mask = make_batch(seed=3)
    out = []
    for shared in (False, True):
        model = prefix_model("qwen2")
        model.set_attn_implementation("eager")
        out.append(run(model, ids, attn, mask, 0, shared))
    assert spy[0] == 1
    assert_same(*out)


def test_mask_keeps_rows_independent(monkeypatch):
    # changing row 0's suffix (first in the packed row) must leave every later row's logp unchanged;
    # with the mask ignored (a plain causal mask over the packed row) later rows would read row 0
    ids, attn, _ = make_batch(seed=5, groups=1, n=3)
    p = prefix.shared_prefix_len(ids, attn.sum(1))
    assert p >= SYSTEM
    other = ids.clone()
    other[0, p:int(attn[0].sum())] = (other[0, p:int(attn[0].sum())] + 1) % 256
    model = prefix_model("llama")

    def rows_after_first():
        with torch.no_grad():
            a = prefix.sequence_logprobs(model, ids, attn)[0]
            b = prefix.sequence_logprobs(model, other, attn)[0]
        return a[0] != b[0], (a[1:] - b[1:]).abs().max()

    changed, diff = rows_after_first()
    assert changed.any() and diff <= 1e-6
    real = prefix.block_mask
    monkeypatch.setattr(prefix, "block_mask", lambda seg, dtype: real(torch.zeros_like(seg), dtype))  # causal

    assert rows_after_first()[1] > 1e-3  # the test has teeth


def test_pack_by_hand():
    # rows [1 2 3 4 5] and [1 2 3 6] sharing p = 3 tokens: packed [1 2 3 | 4 5 | 6]
    ids, lengths = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 6, 0]]), torch.tensor([5, 4])
    tokens, pos, seg, scored, targets, where = pack(ids, lengths, 3)
    assert tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert pos.tolist() == [0, 1, 2, 3, 4, 3]  # row 1's suffix starts at position 3 again
    assert seg.tolist() == [0, 0, 0, 1, 1, 2]
    # position 2 (token 3) is scored twice: for row 0's next token 4 and for row 1's next token 6
    assert scored.tolist() == [0, 1, 2, 3, 2] and targets.tolist() == [2, 3, 4, 5, 6]
    assert where.tolist() == [[0, 1, 2, 3], [0, 1, 4, -1]]  # row 1's column 3 scores padding
    keep = prefix.block_mask(seg, torch.float32)[0, 0] == 0
    assert keep.int().tolist() == [[1, 0, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0, 0],
                                   [1, 1, 1, 0, 0, 0],
                                   [1, 1, 1, 1, 0, 0],   # row 0's suffix: the prefix and itself
                                   [1, 1, 1, 1, 1, 0],
                                   [1, 1, 1, 0, 0, 1]]   # row 1's suffix: the prefix, not row 0's


def test_falls_back_where_sharing_does_not_pay(spy):
    # one row, or a common prefix under MIN_SHARED: the padded path runs, bit for bit
    ids, attn, mask = make_batch(system=10)
    one = (ids[:1], attn[:1], mask[:1])
    for batch in ((ids, attn, mask), one):
        assert prefix.shared_prefix_len(batch[0], batch[1].sum(1)) == 0
        padded = run(prefix_model("llama"), *batch, 0, shared_prefix=False)
        shared = run(prefix_model("llama"), *batch, 0, shared_prefix=True)
        assert torch.equal(padded[0], shared[0]) and all(torch.equal(padded[2][k], shared[2][k]) for k in padded[2])
    assert spy[0] == 0


def test_shared_prefix_len_stops_at_the_shortest_row():
    # identical rows: p = shortest length - 1, so each row keeps one token to score
    ids = torch.arange(100).repeat(3, 1)
    assert prefix.shared_prefix_len(ids, torch.tensor([100, 90, 80])) == 79
    assert prefix.shared_prefix_len(ids[:1], torch.tensor([100])) == 0  # one row: nothing to share
    ids[2, 70] = 999
    assert prefix.shared_prefix_len(ids, torch.tensor([100, 90, 80])) == 70


@pytest.mark.parametrize("tokens", [0, 400])
def test_batch_logprobs_shared_equals_padded(tokens):
    # the no-grad old/reference pass: trie-ordered micro-batches and packed forwards, same numbers
    ids, attn, _ = make_batch(seed=2, groups=3, n=4)
    batch = {"input_ids": ids, "attention_mask": attn}
    model = prefix_model("qwen2")
    plain = batch_logprobs(model, batch, 4, temperature=0.7, chunk=0, tokens=tokens)
    for chunk in (0, 7):
        shared = batch_logprobs(model, batch, 4, temperature=0.7, chunk=chunk, tokens=tokens,
                                    forward=prefix.sequence_logprobs, split=micro_batches)
        assert torch.allclose(plain * attn[:, 1:], shared * attn[:, 1:], atol=1e-5)


def grouped_ids(seed=0):
    """12 rows, shuffled: groups 0 and 1 share a 70-token system block and part at their prompts,
    group 2 starts elsewhere; 4 rows a group, responses of 5..35 tokens."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda k: torch.randint(0, 256, (k,), generator=g).tolist()  # noqa: E731
    system = tok(SYSTEM)
    prompts = [system + tok(20), system + tok(20), tok(SYSTEM + 20)]
    seqs = [prompts[j] + tok(5 + 10 * i) for j in range(3) for i in range(4)]
    order = torch.randperm(12, generator=g)
    ids, attn = score.pad([seqs[k] for k in order], TOK.pad_token_id)
    return ids, attn.sum(1), order // 4  # group of each row


def test_micro_batches_group_rows_by_prefix():
    ids, lengths, group = grouped_ids()
    rows = torch.arange(12)
    # fixed size 4 in trie order: each micro-batch is one group, sharing its whole prompt (90 tokens)
    for mb in micro_batches(lengths, rows, 4, ids=ids):
        assert len(set(group[mb].tolist())) == 1
        assert prefix.shared_prefix_len(ids[mb], lengths[mb]) == SYSTEM + 20
    # a budget of packed tokens: every row once, each micro-batch's forward within the budget
    budget = 250  # one group packs in 90 + (5 + 15 + 25 + 35) = 170; a fifth row would make it >= 255
    todo = micro_batches(lengths, rows, 4, tokens=budget, ids=ids)
    assert sorted(torch.cat(todo).tolist()) == list(range(12))
    for mb in todo:
        cost = prefix.forward_tokens(lengths[mb], prefix.shared_prefix_len(ids[mb], lengths[mb]))
        assert cost <= budget or len(mb) == 1
        assert len(set(group[mb].tolist())) == 1 and len(mb) == 4
    # padded, the same budget fits 2 rows of 95..125 tokens: (rows) x (longest) <= 250
    assert len(score.micro_batches(lengths, rows, 4, tokens=budget)) == 6
    # 400: groups 0 and 1 pack together around their system block, 70 + 8 x 20 + 2 x 80 = 390 tokens
    together = [mb for mb in micro_batches(lengths, rows, 4, tokens=400, ids=ids) if len(mb) == 8]
    assert len(together) == 1 and set(group[together[0]].tolist()) == {0, 1}
    assert prefix.shared_prefix_len(ids[together[0]], lengths[together[0]]) == SYSTEM


def test_micro_batches_without_a_common_prefix_cost_the_padded_forward():
    # random rows share nothing: a micro-batch costs b x longest, as without ids
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (6, 50), generator=g)
    lengths = torch.tensor([50, 10, 30, 20, 40, 50])
    todo = micro_batches(lengths, torch.arange(6), 2, tokens=100, ids=ids)
    assert sorted(torch.cat(todo).tolist()) == list(range(6))
    assert all(len(mb) * int(lengths[mb].max()) <= 100 or len(mb) == 1 for mb in todo)
    assert micro_batches(lengths, torch.arange(1), 2, tokens=100, ids=ids)[0].tolist() == [0]  # one row alone


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 12), budget=st.integers(1, 400), shared=st.integers(0, 100))
def test_micro_batches_properties(seed, n, budget, shared):
    # any rows, any budget: every row exactly once, and a micro-batch over budget only when alone
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 120, (n,), generator=g) + shared
    ids = torch.randint(0, 3, (n, int(lengths.max())), generator=g)
    ids[:, :shared] = 7  # a common head of `shared` tokens
    todo = micro_batches(lengths, torch.arange(n), 3, tokens=budget, ids=ids)
    assert sorted(torch.cat(todo).tolist()) == list(range(n))
    for mb in todo:
        p = prefix.shared_prefix_len(ids[mb], lengths[mb])
        assert p <= int(lengths[mb].min()) - 1 or p == 0
        n = prefix.forward_tokens(lengths[mb], p)
        assert n <= budget and (not p or n <= prefix.packed_limit(p)) or len(mb) == 1
        if p:  # packed only where it halves the forward
            assert 2 * n <= len(mb) * int(lengths[mb].max())


def test_rows_that_do_not_pack_are_batched_by_length():
    # GSM8K-shaped: 16 groups of 8, a short prompt each (30..60 tokens, under MIN_SHARED: nothing
    # packs), answers of 20..300 tokens. In trie order every group would pad to its longest
    # answer; the rows go back to the padded rule instead, so the micro-batches are ids=None's (up to the order of rows of equal length).
    g = torch.Generator().manual_seed(3)
    seqs = []
    for _ in range(16):
        prompt = torch.randint(0, 256, (int(torch.randint(30, 61, (1,), generator=g)),), generator=g).tolist()
        seqs += [prompt + torch.randint(0, 256, (int(torch.randint(20, 301, (1,), generator=g)),),
                                        generator=g).tolist() for _ in range(8)]
    ids, attn = score.pad(seqs, TOK.pad_token_id)
    lengths, rows = attn.sum(1), torch.randperm(128, generator=g)
    assert all(prefix.shared_prefix_len(ids[i:i + 8], lengths[i:i + 8]) == 0 for i in range(0, 128, 8))
    by_prefix = micro_batches(lengths, rows, 4, tokens=2048, ids=ids)
    by_length = score.micro_batches(lengths, rows, 4, tokens=2048)
    shape = lambda todo: [lengths[mb].tolist() for mb in todo]  # noqa: E731  (equal lengths tie in any order)
    assert shape(by_prefix) == shape(by_length)
    cost = lambda todo: sum(len(mb) * int(lengths[mb].max()) for mb in todo)  # noqa: E731
    trie = [torch.arange(i, i + 8) for i in range(0, 128, 8)]  # a group to a micro-batch, padded
    assert cost(by_prefix) < 0.85 * cost(trie)
    # one group of the batch shares a long system block: it still packs, the rest still go by length
    ids2 = torch.cat([ids, torch.zeros(128, 600 - ids.shape[1], dtype=ids.dtype)], 1)
    ids2[:8, :400] = torch.randint(0, 256, (400,), generator=g)  # group 0: one 400-token head,
    ids2[:8, 400:] = torch.randint(0, 256, (8, 200), generator=g)  # then answers of its own
    lengths2 = lengths.clone()
    lengths2[:8] = 420 + torch.arange(8) * 20
    todo = micro_batches(lengths2, rows, 4, tokens=4096, ids=ids2)
    assert sorted(torch.cat(todo).tolist()) == list(range(128))
    packed = [mb for mb in todo if prefix.shared_prefix_len(ids2[mb], lengths2[mb])]
    assert len(packed) == 1 and sorted(packed[0].tolist()) == list(range(8))


def test_packed_rows_stop_at_the_limit():
    # a big budget, 40 rows sharing a 100-token prefix, suffixes of 60: one packed row would be 2,500
    # tokens, past packed_limit(100) = 100 + isqrt(100^2 + 100 x 4096) = 747; rows go 10 to a row
    ids = torch.full((40, 160), 7)
    ids[:, 100:] = torch.arange(40)[:, None]  # each row's own suffix
    lengths = torch.full((40,), 160)
    assert prefix.packed_limit(100) == 747
    todo = micro_batches(lengths, torch.arange(40), 4, tokens=100_000, ids=ids)
    assert [len(mb) for mb in todo] == [10] * 4  # 100 + 10 x 60 = 700 <= 747 < 760
    # packed only where that halves the padded forward (b x 160): 4 rows, 340 of 640, do not; 5, 400 of 800, do
    assert prefix.shared_prefix_len(ids[:4], lengths[:4]) == 0 and prefix.shared_prefix_len(ids[:5], lengths[:5]) == 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_packed_equals_padded_bf16_cuda(compiled):
    # bf16 autocast on the GPU (the mask in bf16, SDPA's memory-efficient kernel): agreement to bf16
    # rounding, and through torch.compile's wrapper (unwrap: _orig_mod)
    ids, attn, mask = (x.cuda() for x in make_batch(seed=7, groups=2, n=4))
    out = []
    for shared in (False, True):
        model = prefix_model("qwen2").cuda()
        if compiled:
            model = torch.compile(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out.append(run(model, ids, attn, mask, 0, shared))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = out
    assert (lp_a - lp_b).abs().max() < 0.05 and (ent_a - ent_b).abs().max() < 0.05
    for k in g_a:
        assert (g_a[k] - g_b[k]).norm() <= 0.05 * g_a[k].norm() + 1e-6, k


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), v=st.integers(2, 40), temperature=st.floats(0.3, 2.0), entropy=st.booleans(),
       seed=st.integers(0, 2**16))
def test_plain_token_logprobs_equal_the_chunked_fast_path(n, v, temperature, entropy, seed):
    # the plain formula (what --compile compiles) and the chunked fast path with its hand-written
    # backward: the same values and gradients (float64, so any difference is a wrong formula)
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(n, v, generator=g, dtype=torch.float64)).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    w, u = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    lp_a, ent_a = score.token_logprobs(x, y, temperature, entropy)
    out = score.token_logprobs_chunked(x, y, temperature, entropy=entropy)
    lp_b, ent_b = out if entropy else (out, None)
    assert torch.allclose(lp_a, lp_b, atol=1e-10)
    loss_a, loss_b = (w * lp_a).sum(), (w * lp_b).sum()
    if entropy:
        assert torch.allclose(ent_a, ent_b, atol=1e-10)
        loss_a, loss_b = loss_a + (u * ent_a).sum(), loss_b + (u * ent_b).sum()
    (g_a,), (g_b,) = torch.autograd.grad(loss_a, x), torch.autograd.grad(loss_b, x)
    assert torch.allclose(g_a, g_b, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [0, 64])
def test_compiled_model_equals_eager_cuda(chunk):
    # --compile (memory.compile_model: the decoder layers and the fused scoring) computes the eager
    # model's function: logp, entropy and gradients in float32, padded and packed rows, with
    # gradient checkpointing, as train.py runs it
    ids, attn, mask = (x.cuda() for x in make_batch(seed=11, groups=2, n=4))
    for shared in (False, True):
        eager = prefix_model("qwen2", "checkpointing").cuda()
        compiled = memory.compile_model(prefix_model("qwen2", "checkpointing").cuda())
        assert score.is_compiled(compiled) and not score.is_compiled(eager)
        (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = (run(m, ids, attn, mask, chunk, shared) for m in (eager, compiled))
        assert (lp_a - lp_b).abs().max() < 1e-4 and (ent_a - ent_b).abs().max() < 1e-4
        for k in g_a:
            assert (g_a[k] - g_b[k]).norm() <= 1e-4 * g_a[k].norm() + 1e-7, k


# ---- options/memory.py under --shard fsdp

def _qwen7b_folder(tmp_path):
    """A Qwen2.5-7B shape's folder: its config is all meta_model reads (no weights)."""
    from transformers import Qwen2Config
    Qwen2Config(**sources.SHAPES["random-qwen2.5-7b"]).save_pretrained(tmp_path)
    return str(tmp_path)


def test_fsdp_estimate_divides_the_trainer_state_and_adds_the_gathered_units(tmp_path, monkeypatch, capsys):
    # The refusal on 2 x H100 (the recipe's fsdp7b: h200 preset, 16 x 512, --micro-batch-tokens 4096, k1 KL):
    # "needs ~122 GB ({'weights': 15.2, 'grads': 15.2, 'adamw': 30.5, 'reference': 15.2, 'engine': 25.5,
    # 'activations': 42.5})": the trainer state was already 1/2 a GPU, but the activations counted 16 x 512 =
    # 8192 tokens where --micro-batch-tokens packs 4096, and FSDP2's gathered units were missing.
    shape = memory.meta_model(_qwen7b_folder(tmp_path))
    n = sum(p.numel() for p in shape.parameters())
    root, layer = memory.fsdp_units(shape)
    assert n == 7_615_616_512 and layer == 233_057_792  # Qwen2.5-7B: 28 layers, untied LM head
    assert root == 2 * 152064 * 3584 + 3584  # embeddings + LM head + final norm: the root unit
    kw = dict(micro_batch=16, max_context=512, grad_checkpointing=False, chunk=0, engine_bytes=0.3 * 85e9,
              ref_bytes=2 * n, units=(root, layer))
    whole = memory.estimate_memory(shape.config, n, **kw)  # one GPU (or DDP: every GPU holds it all)
    two = memory.estimate_memory(shape.config, n, shard=2, **kw)
    gb = {k: round(v / 1e9, 1) for k, v in two["parts"].items()}
    assert {k: gb[k] for k in ("weights", "grads", "adamw", "reference", "engine", "activations")} == {
        "weights": 15.2, "grads": 15.2, "adamw": 30.5, "reference": 15.2, "engine": 25.5, "activations": 42.5}
    # gathered: (root + 2 layers) x 2 bytes + the root's gradient in bf16 and float32 (6 bytes) = 9.7 GB
    assert gb["gathered"] == round(((root + 2 * layer) * 2 + root * 6) / 1e9, 1) == 9.7
    assert whole["parts"]["gathered"] == 0 and whole["parts"]["weights"] == 4 * n  # DDP: whole
    assert round((two["train"] - two["parts"]["gathered"]) / 1e9) == 122  # the refusal's figure, before the units
    four = memory.estimate_memory(shape.config, n, shard=4, micro_batch_tokens=4096, **kw)
    assert four["parts"]["activations"] == whole["parts"]["activations"] / 2  # 4096 tokens, not 8192
    assert four["parts"]["weights"] + four["parts"]["grads"] + four["parts"]["adamw"] == 16 * n // 4
    assert four["train"] < whole["train"] / 2  # 78.5 GB against 182.7 GB
    ckpt = memory.estimate_memory(shape.config, n, shard=4, micro_batch_tokens=4096, **{**kw, "grad_checkpointing": True})
    assert ckpt["train"] < 62e9 and ckpt["rollout"] < 65e9  # fits an 80 GB H100 with --grad-checkpointing
    sharded = memory.estimate_memory(shape.config, n, shard=4, micro_batch_tokens=4096, ref_shard=4, **kw)
    assert sharded["parts"]["reference"] == 2 * n // 4 and sharded["train"] < 68e9  # the reference sharded too:
    # 67 GB, so it fits an H100 without --grad-checkpointing (support/dist.shard_reference)
    # fits_gpu (what train.py and config.fits_this_gpu ask) on one H100's free memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (79e9, 85e9))
    fit = dict(lora_rank=0, compute_dtype=torch.bfloat16, kl_coef=0.001, engine_share=0.3, micro_batch=16,
               max_context=512, grad_checkpointing=True, chunk=0, micro_batch_tokens=4096, fail=False)
    assert memory.fits_gpu(str(tmp_path), shard=4, **fit) is True
    assert "per GPU, FSDP2 over 4" in capsys.readouterr().out
    assert memory.fits_gpu(str(tmp_path), shard=1, **fit) is False
    with pytest.raises(memory.DoesNotFit, match=r"more GPUs \(--shard fsdp"):
        memory.fits_gpu(str(tmp_path), shard=2, **{**fit, "fail": True})


def test_fits_this_gpu_passes_the_shard_and_the_token_budget(tmp_path, monkeypatch):
    # config.fits_this_gpu: WORLD_SIZE ranks under --shard fsdp divide; under ddp they do not; the
    # estimate's micro-batch is --micro-batch-tokens where that is smaller than b x L
    import config
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config.memory, "fits_gpu", lambda *a, **k: seen.append(k) or True)
    monkeypatch.setattr(config, "model_source", lambda m: m)
    monkeypatch.setenv("WORLD_SIZE", "4")
    base = ["--model", "m", "--gpu", "h200", "--engine", "vllm", "--prompts-per-step", "16", "--n", "4",
            "--micro-batch-tokens", "4096", "--lora-rank", "0", "--sleep-level", "2", "--kl-coef", "0.001"]
    for extra, want, ref in ((["--shard", "fsdp"], 4, 4), (["--shard", "ddp"], 1, 1),
                             (["--shard", "fsdp", "--ref-update-every", "5"], 4, 1)):  # a moving reference stays whole
        config.fits_this_gpu(config.parse_args(base + extra), 0)
        assert (seen[-1]["shard"], seen[-1]["ref_shard"], seen[-1]["micro_batch_tokens"]) == (want, ref, 4096)
