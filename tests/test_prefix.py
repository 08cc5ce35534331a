"""Shared-prefix training (options/prefix.py, --shared-prefix): a micro-batch's common prefix computed once,
as one packed row under a block mask, against the padded path it replaces.

The packed path must give the padded path's logp, entropy and gradients (same math, float rounding
only) for chunk = 0 and chunk > 0, Llama and Qwen2 (attention biases), LoRA and gradient
checkpointing; keep rows independent (the test that fails if transformers ignored the mask);
fall back where sharing does not pay; and micro_batches must group rows by prefix within the
packed-token budget; --compile's scoring and score.token_logprobs_chunked must equal score.token_logprobs. CPU, tiny random models,
seconds (the GPU tests -- bf16 autocast, torch.compile, memory.compile_model -- skip without CUDA):

    python -m pytest -q tests/test_prefix.py
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from options import lora, memory, prefix
import score
from conftest import make_tiny_model, make_tiny_tokenizer
from options.prefix import micro_batches, pack
from score import batch_logprobs

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


def make_model(kind, variant="base"):
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
    padded = run(make_model(kind, variant), ids, attn, mask, chunk, shared_prefix=False)
    packed = run(make_model(kind, variant), ids, attn, mask, chunk, shared_prefix=True)
    assert spy[0] == 1
    assert_same(padded, packed)


def test_packed_equals_padded_eager_attention(spy):
    # eager attention adds the mask to the scores: the same additive mask works there too
    ids, attn, mask = make_batch(seed=3)
    out = []
    for shared in (False, True):
        model = make_model("qwen2")
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
    model = make_model("llama")

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
        padded = run(make_model("llama"), *batch, 0, shared_prefix=False)
        shared = run(make_model("llama"), *batch, 0, shared_prefix=True)
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
    model = make_model("qwen2")
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
        model = make_model("qwen2").cuda()
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
        eager = make_model("qwen2", "checkpointing").cuda()
        compiled = memory.compile_model(make_model("qwen2", "checkpointing").cuda())
        assert score.is_compiled(compiled) and not score.is_compiled(eager)
        (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = (run(m, ids, attn, mask, chunk, shared) for m in (eager, compiled))
        assert (lp_a - lp_b).abs().max() < 1e-4 and (ent_a - ent_b).abs().max() < 1e-4
        for k in g_a:
            assert (g_a[k] - g_b[k]).norm() <= 1e-4 * g_a[k].norm() + 1e-7, k
