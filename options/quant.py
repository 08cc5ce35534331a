"""
Weight quantizers for FlashRL-style quantized rollouts: the trainer keeps bf16 weights, the vLLM
engine runs 8-bit ones, and on every weight sync we quantize the new weights ourselves on the GPU
(one pass, no calibration) and copy q and scale straight into the engine's parameters.

Pure torch (CPU or CUDA, any float dtype in; the math is done in float32). Checked against the
vLLM 0.26.0 source. Tested by `python -m pytest -q tests/test_options.py` (CPU, seconds).
The engine (train.py: `if args.rollout_quant != "none"`): QuantizedEngine is a VLLMEngine started
8-bit whose push sends the linear weights quantized: make_quant_plan finds vLLM's 8-bit parameters
once, push_quant quantizes the trainer's weights into them every sync, instead of re-running vLLM's
loader and process_weights_after_loading (FlashRL's way); sync.push sends the rest (embeddings, norms).

fp8 (engine: `LLM(quantization="fp8")` on a bf16 checkpoint -> Fp8Config -> the online method
  Fp8PerTensorOnlineLinearMethod, which runs ops.scaled_fp8_quant(weight, scale=None) once at load)
    scale = max(amax(|w|) / 448, 1 / (448 * 512))            float32, shape (1,)
    q     = fp8_e4m3fn(clamp(w * (1 / scale), -448, 448))     round to nearest even
  One scale per vLLM module, and vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj: the
  scale of a fused module is taken over the concatenated weight, so quantize the fused tensor, not
  each HF projection. vLLM then stores the weight transposed, (in, out) (`qweight.t()`).
  The floor 1 / (448 * 512) is vLLM's _FP8_MIN_SCALING_FACTOR (input_quant_fp8.py:25), used by
  QuantFP8's torch path for dynamic per-tensor quant (:211) and by the per-token CUDA kernels.
  The per-tensor CUDA kernel behind scaled_fp8_quant (csrc/.../fp8/common.cu, segmented_max_
  reduction) has no floor, so our scale differs from a freshly started engine's only when
  amax < 1/512 (for an all-zero weight the kernel's scale is 0 and 1 / scale inf). We multiply by the reciprocal
  as both of vLLM's paths do; dividing can differ by one float32 ulp before the fp8 rounding.
  Scales divide by a tensor, not a Python number: CUDA turns `t / 448` into `t * (1 / 448)`, one
  ulp off the true quotient that the CPU gives, and then the bits would depend on the device.
  Error: e4m3 has 3 mantissa bits, so |w - deq| <= 2^-4 |w| where |w| / scale >= 2^-6 (normal);
  below that (subnormals) |w - deq| <= 2^-10 scale.

int8 W8A8 (engine: a compressed-tensors checkpoint written by save_int8_checkpoint ->
  CompressedTensorsW8A8Int8, weights static per output channel, activations quantized dynamically
  per token inside vLLM, so there is nothing to calibrate)
    scale = max(amax_row(|w|) / 127, eps)                     float32, shape (out, 1)
    q     = int8(clamp(round(w / scale), -127, 127))          round half to even
  Symmetric +-127, as vLLM's own online int8 (online/int8.py:78, MoE experts only in 0.26) and its
  CUTLASS int8 kernels assume; llm-compressor divides by 127.5 and clamps to [-128, 127], which
  clips the row max to 127 and makes -128 reachable. eps = float32 machine eps, the value that
  compressed-tensors 0.17 substitutes for a zero scale (_get_dtype_eps); vLLM's online int8 has
  no floor (a zero row is 0/0 = NaN there). Error: |w - deq| <= scale / 2 per element (no
  clipping: |w| / scale <= 127).
"""
import copy
import os
import shutil
import tempfile
import time

import torch
from torch import nn

import sync
from vllm_engine import VLLMEngine

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM 0.26 input_quant_fp8.py:25 _FP8_MIN_SCALING_FACTOR
INT8_MAX = 127
INT8_MIN_SCALE = torch.finfo(torch.float32).eps  # compressed-tensors' eps for a zero scale


def quantize_fp8_per_tensor(w):
    """One float32 scale for the whole (out, in) weight; q is float8_e4m3fn of w's shape."""
    w = w.float()
    # vLLM's layer.weight_scale is this (1,) tensor: scaled_fp8_quant allocates torch.empty(1)
    scale = (w.abs().amax() / w.new_tensor(FP8_MAX)).clamp(min=FP8_MIN_SCALE).reshape(1)  # (1,)
    q = (w * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # (out, in)
    return q, scale


def quantize_int8_per_channel(w):
    """Symmetric int8 with one float32 scale per output row; compressed-tensors "channel"."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)  # (out, 1)
    scale = (amax / w.new_tensor(INT8_MAX)).clamp(min=INT8_MIN_SCALE)  # (out, 1)
    q = (w / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # (out, in)
    return q, scale


def dequantize(q, scale):
    """q * scale in float32; scale (1,) or (out, 1) broadcasts over (out, in)."""
    return q.float() * scale


def quantization_error(w, kind):
    """Round-trip error of quantizing w with kind "fp8" or "int8", as plain floats."""
    quantize = {"fp8": quantize_fp8_per_tensor, "int8": quantize_int8_per_channel}[kind]
    w = w.float()
    err = dequantize(*quantize(w)) - w
    rel_rms = err.norm() / w.norm().clamp(min=1e-30)  # ||err|| / ||w||, the RMS ratio
    return dict(max_abs=err.abs().max().item(), rel_rms=rel_rms.item())


# ---- the sync into a quantized vLLM engine (QuantizedEngine.push, below)

# HF names that vLLM 0.26 fuses into one parameter (stacked_params_mapping in its llama.py and qwen2.py)
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def make_quant_plan(llm, names):
    """[(hf weight names, vLLM weight name, vLLM weight param, vLLM weight_scale param)] for every
    quantized linear; names: the trainer's weight names.

    vLLM 0.26 keeps a quantized weight transposed, (in, out), possibly padded to multiples of 16
    for the cutlass kernels (CutlassFP8ScaledMMLinearKernel / CutlassInt8ScaledMMLinearKernel
    .process_weights_after_loading), and one scale per tensor (fp8 online: Fp8PerTensorOnline-
    LinearMethod, one scale for a whole fused qkv) or per output row (int8 compressed-tensors
    channel strategy, (out, 1)). The in-process engine hands us its model object itself."""
    vmodel = llm.apply_model(lambda m: m)[0]
    plan = []
    for mname, mod in vmodel.named_modules():
        w, s = getattr(mod, "weight", None), getattr(mod, "weight_scale", None)
        if not isinstance(w, torch.Tensor) or s is None or w.dtype not in QUANT_DTYPES:
            continue
        if w.dim() != 2 or w.stride(0) != 1:  # not the transposed (in, out) view of an (out, in) matrix
            raise RuntimeError(f"quantized sync: vLLM layer {mname} keeps its weight as {tuple(w.shape)} with strides "
                               f"{w.stride()}, not the (in, out) view this sync writes (checked on vLLM 0.26.0)")
        prefix, leaf = mname.rsplit(".", 1)
        parts = [f"{prefix}.{p}.weight" for p in STACKED.get(leaf, (leaf,))]
        if any(p not in names for p in parts):
            raise RuntimeError(f"quantized sync: vLLM layer {mname} wants {parts}, not all among the trainer's names")
        plan.append((parts, f"{mname}.weight", w, s))
    if not plan:
        raise RuntimeError("quantized sync: the engine has no int8/fp8 linear weights (was it started quantized?)")
    return plan


@torch.no_grad()
def push_quant(plan, tensor_of, kind):
    """Quantize the trainer's weights on the GPU (scales from the new weights, one pass per layer)
    and copy them and their scales straight into the engine's quantized parameters. tensor_of(name):
    the trainer's full tensor of that name (sync.full_tensor, so a LoRA merge is made one layer at a time)."""
    quantize = quantize_fp8_per_tensor if kind == "fp8" else quantize_int8_per_channel
    _cuda_sync()
    t0 = time.perf_counter()
    nbytes = 0
    for parts, _, w, s in plan:
        W = torch.cat([tensor_of(p) for p in parts], 0)  # (out, in): q, k, v stacked as vLLM does
        q, scale = quantize(W)
        out_f, in_f = W.shape
        w[:in_f, :out_f].copy_(q.t())  # the engine's (in, out) layout, padding left as it is
        s.view(-1)[:scale.numel()].copy_(scale.view(-1))
        nbytes += q.numel() * q.element_size() + scale.numel() * 4
    _cuda_sync()
    return {"quant_ms": 1000 * (time.perf_counter() - t0), "quant_bytes": nbytes, "quant_layers": len(plan)}


def _cuda_sync():  # the copies are queued on the stream; time their completion
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def int8_quantization_config(ignore=("lm_head",)):
    """The config.json `quantization_config` for W8A8 int8 (channel weights, dynamic token acts)."""
    # Checked against vLLM 0.26.0 compressed_tensors/compressed_tensors.py: from_config (:230)
    # reads config_groups/format/ignore/kv_cache_scheme; each weights / input_activations dict
    # is a compressed-tensors QuantizationArgs; _is_dynamic_token_w8a8 (:483) needs 8 bits,
    # weights static "channel" (or "tensor") and symmetric, activations dynamic "token"; format
    # "int-quantized" routes to CompressedTensorsW8A8Int8 (:855). "Linear" matches every
    # vLLM LinearBase (fused qkv_proj / gate_up_proj included); `ignore` lists the rest.
    # The optional fields are written as llm-compressor writes them, so other readers agree.
    def args(strategy, dynamic, observer):
        return dict(num_bits=8, type="int", symmetric=True, strategy=strategy, dynamic=dynamic,
                    group_size=None, block_structure=None, actorder=None,
                    observer=observer, observer_kwargs={})
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": args("channel", False, "minmax"),
            "input_activations": args("token", True, None),  # dynamic: no observer, no scale
            "output_activations": None,
        }},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def save_int8_checkpoint(model, tokenizer, out_dir, ignore=("lm_head",)):
    """Write an HF folder that `vllm.LLM(model=out_dir)` starts from with int8 W8A8 Linears."""
    os.makedirs(out_dir, exist_ok=True)
    # Every nn.Linear is quantized unless its full module name is in `ignore`: the config's
    # "Linear" target makes vLLM expect int8 for all others, so the two sets must agree (vLLM's
    # should_ignore_layer also takes "re:" patterns; we write and match exact names only).
    linears = {name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name not in ignore}
    tensors, seen = {}, set()
    for key, t in model.state_dict().items():
        # A tensor already written under another name is a tied weight (lm_head = embed_tokens):
        # skip it as save_pretrained does; vLLM re-ties from tie_word_embeddings.
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ptr in seen:
            continue
        seen.add(ptr)
        module, _, leaf = key.rpartition(".")
        if module in linears and leaf == "weight":
            q, scale = quantize_int8_per_channel(t.detach())  # on the model's device
            tensors[key] = q.cpu().contiguous()
            tensors[key + "_scale"] = scale.cpu().contiguous()  # "<name>.weight_scale" (out, 1)
        else:  # embeddings, norms, Linear biases, an untied lm_head: in the model's dtype
            tensors[key] = t.detach().cpu().contiguous()
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    cfg = copy.deepcopy(model.config)  # the trainer's model.config stays unquantized
    cfg.quantization_config = int8_quantization_config(ignore)
    cfg.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# ---- the quantized engine: started 8-bit, re-quantized at every sync

# sync.check's largest healthy mean |dlogp| per engine format: bf16 noise + the rounding (docs/results.md)
CHECK_THRESHOLD = {"fp8": 0.4, "int8": 0.3}


class QuantizedEngine(VLLMEngine):
    """A VLLMEngine that samples with 8-bit linear weights (--rollout-quant fp8|int8): fp8 is vLLM's online
    quantization of the bf16 folder src (Fp8Config -> Fp8PerTensorOnlineLinearMethod); int8 starts from a
    W8A8 copy of the trainer's model (save_int8_checkpoint) in a temp folder, deleted once vLLM has read
    it. Its push quantizes the new weights into the engine (push_quant); sync.push sends the rest."""

    def __init__(self, model, tokenizer, src, quant, **kwargs):
        if quant not in CHECK_THRESHOLD:
            raise ValueError(f"QuantizedEngine: quant must be one of {list(CHECK_THRESHOLD)}, got {quant!r}")
        self.quant, self.quant_plan = quant, None
        kwargs.setdefault("check_threshold", CHECK_THRESHOLD[quant])
        if quant == "fp8":
            super().__init__(src, quantization="fp8", **kwargs)
            return
        folder = save_int8_checkpoint(model, tokenizer, tempfile.mkdtemp(prefix="nanorl-int8-"))
        try:
            super().__init__(folder, **kwargs)
        finally:  # read, or failed: never left in /tmp
            shutil.rmtree(folder, ignore_errors=True)

    def push(self, model):
        """The linear weights quantized straight into vLLM's 8-bit parameters, then sync.push for the rest."""
        weights = dict(sync.trainer_weights(model))
        if self.quant_plan is None:
            self.quant_plan = make_quant_plan(self.llm, set(weights))
        qstats = push_quant(self.quant_plan, lambda name: sync.full_tensor(weights[name]), self.quant)
        layers = {vname.rsplit(".", 1)[0] for _, vname, _, _ in self.quant_plan}
        # push_quant filled the quantized layers; a compressed-tensors model's Attention layers also own
        # KV-cache scales (attn._k_scale, ...: 1.0, read only by an fp8 KV cache, which we do not use)
        filled = lambda name: (name.rsplit(".", 1)[0] in layers  # noqa: E731
                               or name.endswith(("._k_scale", "._q_scale", "._v_scale", "._prob_scale")))
        stats, self.sync_plan = sync.push(self.llm, model, self.torch_dtype, self.sync_plan,
                                          skip={p for parts, *_ in self.quant_plan for p in parts}, filled=filled)
        return {**stats, **qstats}

    def close(self):
        super().close()
        self.quant_plan = None  # views into the freed parameters
