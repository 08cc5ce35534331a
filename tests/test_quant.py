"""Tests of quant.py: error bounds, shapes, degenerate rows, hypothesis properties, the int8 folder.

CPU, seconds (one CUDA-vs-CPU check skips without CUDA). Run: python -m pytest -q tests/test_quant.py
"""
import json
import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from options import quant  # noqa: E402
from conftest import make_tiny_tokenizer  # noqa: E402

FAST = settings(max_examples=60, deadline=None)
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


@FAST
@given(matrices())
def test_int8_properties(w):
    q, scale = quant.quantize_int8_per_channel(w)
    assert q.abs().max() <= 127
    amax = w.abs().amax(dim=1)
    full = amax >= 127 * 2**-23  # rows above the eps floor: their amax maps to exactly 127
    assert (q.abs().amax(dim=1)[full] == 127).all()
    assert (q[amax == 0] == 0).all()
    assert ((quant.dequantize(q, scale) - w).abs() <= scale / 2 * (1 + 1e-5)).all()


@FAST
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
