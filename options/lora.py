"""
LoRA for any Hugging Face causal LM (Llama, Qwen2, ...), hand-written: no peft dependency.

Each targeted nn.Linear (W: (out, in), bias b) becomes a LoRALinear computing

    y = W x + b + (alpha / r) * B (A x)        A: (r, in), B: (out, r), r << min(in, out)

  A is initialised as PEFT does (kaiming_uniform, a = sqrt(5)) and B = 0, so step 0 is exactly the
  base model (bit-identical logits) and the first gradient flows into B only (dL/dA = 0 while B = 0).
  Only A and B train; every other parameter of the model is frozen (requires_grad False).

Dtypes: W stays in the model's dtype (bf16 for a real run: frozen, it loses nothing); A and B are
float32 masters, since an AdamW update (~1e-5 of a weight) is below bf16's rounding (~4e-3) and A
and B are tiny. The adapter branch runs in fp32 (under autocast its matmuls take autocast's dtype)
and is cast to the base output's dtype before the add, so the layer's output dtype is the base's.

The wrapped module keeps the base Parameter objects under the same names (`...q_proj.weight`), so
base state_dict keys do not change; the adapter adds `...q_proj.lora_A` / `...q_proj.lora_B`.

Reference policy: a LoRA run's KL reference is the base model, the adapters off: `with
disabled(model): logp_ref = ...`, with no frozen second copy of the weights (full-finetune's).

Weight sync: merged_weights(model) returns only the targeted tensors, W' = W + (alpha / r) B A
(in fp32, cast to W's dtype), under the base names: an ordinary partial weight update for the
engine, whose forward then differs from ours by the bf16 rounding of W' only.
merged_state_dict(model) is the full plain HF state dict with W' in place (no lora keys), for
model.save_pretrained(dir, state_dict=...): a checkpoint any tool loads without knowing of LoRA.

Adapter folder (save_adapter / load_adapter), PEFT's on-disk layout:
    adapter_config.json          peft_type LORA, r, lora_alpha, target_modules (leaf names), ...
    adapter_model.safetensors    base_model.model.{module}.lora_A.weight (r, in)  float32
                                 base_model.model.{module}.lora_B.weight (out, r) float32
  which peft's PeftModel.from_pretrained(base, dir) and vLLM's LoRARequest(name, id, dir) read.
  Matching as PEFT does: a Linear is wrapped when the last component of its name is a target, so
  lm_head is wrapped only when "lm_head" is asked for by name (and refused when tied to the
  embeddings). Not supported: rsLoRA, DoRA, fan_in_fan_out (GPT-2's Conv1D), bias training,
  rank/alpha patterns; load_adapter refuses such configs. Checked against peft 0.21.2
  (transformers 5.23): PeftModel.from_pretrained on our folder gives bit-identical logits, and
  its merge_and_unload the same weights as merged_weights, on tiny Llama and Qwen2 models.

Test: python -m pytest -q tests/test_options.py   (its options/lora.py section; CPU, seconds)
"""
import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."  # PEFT's key prefix (PeftModel.base_model = LoraModel, .model = the HF model)


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / r) * B (A dropout(x)); base frozen, A and B float32."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter objects: state_dict names and storage unchanged
        self.bias = base.bias
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=dev, dtype=torch.float32))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=dev, dtype=torch.float32))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's init_lora_weights=True
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    def forward(self, x):  # x: (..., in)
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        if not self.enabled:
            return y
        # .float() on A/B too: a later model.to(bf16) casts them, and fp32 @ bf16 would raise
        h = self.dropout(x).float() @ self.lora_A.float().T  # (..., r)
        return y + (h @ self.lora_B.float().T * self.scaling).to(y.dtype)  # (..., out)

    @torch.no_grad()
    def merged_weight(self):
        """W + (alpha/r) B A in W's dtype and device: what the inference engine gets (one fp32 temporary)."""
        delta = self.lora_B.float() @ self.lora_A.float()  # (out, in)
        return (self.weight.float() + self.scaling * delta).to(self.weight.dtype)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, alpha={self.alpha}, enabled={self.enabled}"


def apply_lora(model, rank, alpha, targets=DEFAULT_TARGETS, dropout=0.0) -> list:
    """Wrap every nn.Linear whose leaf name is in `targets`, freeze the rest; returns the wrapped names."""
    if not (isinstance(rank, int) and rank >= 1):
        raise ValueError(f"LoRA rank must be an int >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    if not 0 <= dropout < 1:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    if lora_modules(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    chosen = sorted(n for n in linears if n.rsplit(".", 1)[-1] in targets)
    if not chosen:
        have = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ValueError(f"apply_lora: no nn.Linear matched targets {list(targets)}; the model's Linear names are {have}")
    # a tied weight (lm_head = embed_tokens) would be merged in one place and not the other
    seen = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(n)
    tied = [n for n in chosen if len(seen[id(linears[n].weight)]) > 1]
    if tied:
        raise ValueError(f"apply_lora: {tied} share their weight with another module (tied embeddings); not supported")
    for p in model.parameters():
        p.requires_grad_(False)
    for n in chosen:
        parent_name, _, leaf = n.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, LoRALinear(linears[n], rank, alpha, dropout))
    model.lora_config = dict(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                             target_modules=sorted({n.rsplit(".", 1)[-1] for n in chosen}))
    return chosen


def lora_modules(model) -> dict:
    """{module name: LoRALinear} in named_modules order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextmanager
def disabled(model):
    """All adapters off inside the block (the base model: a LoRA run's reference policy)."""
    mods = list(lora_modules(model).values())
    was = [m.enabled for m in mods]
    try:
        for m in mods:
            m.enabled = False
        yield model
    finally:
        for m, e in zip(mods, was):
            m.enabled = e


@torch.no_grad()
def merged_weights(model) -> dict:
    """{f"{name}.weight": W + (alpha/r) B A} for the wrapped modules only, in W's dtype and device."""
    return {f"{n}.weight": m.merged_weight() for n, m in lora_modules(model).items()}


def merged_state_dict(model) -> dict:
    """The full plain HF state dict, targeted weights merged, no lora keys (the model is untouched)."""
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith((".lora_A", ".lora_B"))}
    sd.update(merged_weights(model))
    return sd


def adapter_state_dict(model) -> dict:
    """PEFT's layout: base_model.model.{name}.lora_A.weight (r, in) / .lora_B.weight (out, r), fp32 CPU copies."""
    sd = {}
    for n, m in lora_modules(model).items():
        for k in ("lora_A", "lora_B"):
            sd[f"{PREFIX}{n}.{k}.weight"] = getattr(m, k).detach().to("cpu", torch.float32, copy=True).contiguous()
    return sd


def save_adapter(model, out_dir, base_model_name_or_path):
    """Write adapter_config.json and adapter_model.safetensors into out_dir (no atomic-folder dance here)."""
    c = model.lora_config
    cfg = dict(peft_type="LORA", task_type="CAUSAL_LM", r=c["r"], lora_alpha=c["lora_alpha"],
               lora_dropout=c["lora_dropout"], target_modules=list(c["target_modules"]), bias="none",
               fan_in_fan_out=False, inference_mode=True, base_model_name_or_path=str(base_model_name_or_path),
               use_rslora=False, modules_to_save=None, init_lora_weights=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file(adapter_state_dict(model), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def load_adapter(model, adapter_dir):
    """Copy a saved adapter into a model already wrapped by apply_lora with the same r/alpha/targets."""
    d = Path(adapter_dir)
    cfg_path, w_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    cfg, ours = json.loads(cfg_path.read_text()), getattr(model, "lora_config", None)
    if ours is None:
        raise ValueError(f"load_adapter({adapter_dir}): the model has no LoRA modules; call apply_lora first")
    # configs we cannot represent would change the math silently
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("bias", "none") != "none":
        raise ValueError(f"{cfg_path}: peft_type={cfg.get('peft_type')!r} bias={cfg.get('bias')!r}, want 'LORA' and 'none'")
    off = [f for f in ("use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern") if cfg.get(f)]
    if off:
        raise ValueError(f"{cfg_path}: {off} are set, which this LoRA does not support")
    tm = cfg.get("target_modules") or []
    got = dict(r=cfg.get("r"), lora_alpha=cfg.get("lora_alpha"), target_modules=sorted([tm] if isinstance(tm, str) else tm))
    for field, v in got.items():
        if v != ours[field]:  # 16 == 16.0, so an int alpha in the file matches a float one here
            raise ValueError(f"{cfg_path}: {field}={v!r} but the model is wrapped with {field}={ours[field]!r}")
    sd = load_file(str(w_path))
    params = {f"{PREFIX}{n}.{k}.weight": getattr(m, k) for n, m in lora_modules(model).items() for k in ("lora_A", "lora_B")}
    missing, unexpected = sorted(params.keys() - sd.keys()), sorted(sd.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"{w_path}: {len(missing)} missing keys {missing[:3]}, "
                         f"{len(unexpected)} unexpected keys {unexpected[:3]}")
    bad = [(k, tuple(sd[k].shape), tuple(p.shape)) for k, p in params.items() if sd[k].shape != p.shape]
    if bad:
        raise ValueError(f"{w_path}: shape mismatch (key, file, model) {bad[:3]}")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(sd[k])  # fp32 -> fp32: bit-exact
