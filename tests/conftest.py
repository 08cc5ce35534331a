"""Shared pytest fixtures: a tiny tokenizer and a tiny random Llama model, built in-process.

Nothing is downloaded. The tokenizer is byte-level BPE with *no merges*: every byte of UTF-8 is
one token, so any text round-trips exactly (decode(encode(s)) == s), which is what the episode
loop and the envs need. On top of the 256 byte tokens sit the ChatML specials

    <|endoftext|> (id 256, pad)   <|im_start|> (257)   <|im_end|> (258, eos)

and a ChatML chat template (with a tool block, so `tools=` renders something). The model is a
2-layer, 64-wide LlamaForCausalLM with random weights (~60k parameters): it samples garbage
bytes, quickly, which is all the loop tests need.

Fixtures
    tiny_tokenizer      session-scoped PreTrainedTokenizerFast (read-only; don't mutate it)
    tiny_model          a fresh random model per test (seeded, so identical every time), eval mode
    tiny_model_dir      session-scoped folder with save_pretrained() of both, for `--model DIR`

Other test files may import `make_tiny_tokenizer` / `make_tiny_model` directly, and `load_script`
for the scripts of lab/ and data/ (folders of scripts, not packages).
"""
import importlib.util
import os

import pytest
import torch

# Tests never reach a model hub; make an accidental hub id fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    # GPU tests (tests/test_gpu.py) skip themselves without CUDA, vLLM or $SMOLLM2_DIR.
    #   run them:   python -m pytest -q -m gpu tests/test_gpu.py
    #   skip them:  python -m pytest -q -m "not gpu" tests
    # The viewer's browser tests (tests/test_viewer.py) need Debian's chromium; they skip without it
    # unless NANORL_REQUIRE_BROWSER=1 (CI sets it, .ci/run).
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU, vLLM and SmolLM2-135M-Instruct weights in $SMOLLM2_DIR")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, like Qwen2.5's and SmolLM2's templates, minus their default system prompts. Tools are
# rendered as a JSON block in a system turn, tool results as a user turn (Qwen's layout).
CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ 'Tools:\\n' }}{% for t in tools %}{{ t | tojson + '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and tools %}"
    "{% elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # bytes_to_unicode: GPT-2's printable stand-ins for the 256 bytes; with no merges each byte
    # is its own token and ids 0..255 are the bytes in order.
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    table = _gpt2_byte_table()
    assert set(table.values()) == set(byte_chars)
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)  # ids 256, 257, 258
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                pad_token="<|endoftext|>", model_max_length=16384)
    t.chat_template = CHATML_TEMPLATE
    return t


def _gpt2_byte_table():
    """byte -> printable unicode char, the GPT-2 byte-level table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def make_tiny_model(tokenizer, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    g = torch.random.fork_rng()  # don't disturb the test's global RNG
    with g:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.float().eval()



def load_script(path, name=None):
    """The repository's script at path (e.g. "lab/bench.py") as a module named name (default: its stem)."""
    full = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
    spec = importlib.util.spec_from_file_location(name or os.path.splitext(os.path.basename(path))[0], full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def say_engine(monkeypatch, module, say):
    """module.HFEngine (train's, eval's) replaced by an engine whose every turn is say(the prompt's text,
    decoded with its special tokens) and the end of turn: a scripted policy for end-to-end runs."""
    import rollout

    class Say(rollout.HFEngine):
        def __init__(self, model, tokenizer, **kw):
            super().__init__(model, tokenizer, **kw)
            self.tok = tokenizer

        def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
            out = []
            for p in prompts:
                ids = self.tok.encode(say(self.tok.decode(p)), add_special_tokens=False) + [self.tok.eos_token_id]
                out.append([rollout.Completion(ids, [-0.5] * len(ids), "stop") for _ in range(n)])
            return out
    monkeypatch.setattr(module, "HFEngine", Say)

@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    return make_tiny_model(tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("tiny_model")
    make_tiny_model(tiny_tokenizer).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return str(d)
