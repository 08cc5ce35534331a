"""torchrun on the CPU: 2 and 4 processes over gloo (support/dist.py), against the single-process run.

  - the gradient of a 2-rank step (each rank: every other group, global denominators, DDP or
    FSDP2) equals the 1-rank gradient of the same episodes; the ranks' micro-batch counts differ
    (FSDP2 pads them with fillers, DDP runs its own count) and a rank may have nothing to train;
  - train.py under 2 processes (DDP, HF engine): the run's data order is the 1-process run's, its
    checkpoint resumes exactly on 2 processes and continues on 1;
  - two nodes of 2 processes: two real torchrun launches on this machine, c10d rendezvous; and a
    checkpoint saved on 4 processes, resumed on 2, then on 1. Both equal a 1-process run: prompts,
    losses and weights (argmax sampling, ARGMAX below, makes every rank's episodes the same);
  - the pieces: GradReducer's overlapped buckets against World.sum_grads and one process, World.balance's
    plans, the sharded KL reference, vLLM's compile cache per device index, the scaling bench's MFU.
Processes are started with torch.multiprocessing (what torchrun sets up: RANK, WORLD_SIZE,
MASTER_ADDR/PORT), the two nodes with torchrun itself. ~2.5 min on 2 cores.
Run: python -m pytest -q tests/test_dist.py
"""
import json
from pathlib import Path
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from support import dist
import train
from conftest import load_script, make_tiny_model, make_tiny_tokenizer
from score import Scorer
from rollout import Episode
from test_train import ByteSumEnv, _argv, _weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_rank(rank, world, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      NANORL_DIST_TIMEOUT_S="120")  # a collective that never pairs up fails, not hangs


def _spawn(fn, args, nprocs=2, limit_s=600):
    """mp.spawn with a deadline: a stuck rank fails the test instead of hanging the suite."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{nprocs} processes still running after {limit_s} s")


def _episodes(tokenizer, groups=4, n=4, seed=0, flat=(2,), shared=0):
    """Deterministic episodes of several lengths with varied rewards, except in the `flat` groups
    (all equal: A = 0, so their sequences are skipped; flat=(0, 2) leaves rank 0 of 2 nothing).
    shared: a prompt of that many more tokens, the same in every group (--shared-prefix packs them)."""
    g = torch.Generator().manual_seed(seed)
    eps, system = [], torch.randint(0, 256, (shared,), generator=g).tolist()
    for gi in range(groups):
        prompt = system + torch.randint(0, 256, (5 + gi,), generator=g).tolist()
        for k in range(n):
            r = int(torch.randint(3, 12, (1,), generator=g))
            resp = torch.randint(0, 256, (r,), generator=g).tolist()
            mask = [1] * r
            if k == 1:  # an env block inside the response (multi-turn): not trained
                mask[1:3] = [0, 0]
            reward = 0.5 if gi in flat else float(torch.rand((), generator=g))
            eps.append(Episode(prompt, resp, mask, [0.0] * r, reward, "stop", gi))
    return eps


def _step(rank, size, eps, shard, extra, out):
    """One train_step with SGD(lr=1) on this rank's groups; rank 0 saves (new - old) weights."""
    tok = make_tiny_tokenizer()
    model = make_tiny_model(tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = train.parse_args(["--model", "x", "--prompts-per-step", "4", "--n", "4", "--micro-batch-size", "2",
                             "--max-context", "128", "--grad-clip", "0", *extra])
    args.shard = shard  # train.py refuses FSDP with the HF engine; train_step alone needs no engine
    world = dist.World("cpu")
    mine = [e for e in eps if e.group % size == rank]
    scorer, model = dist.wrap(Scorer(model), world, shard, torch.float32)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)
    state = {"step": 0, "skipped_updates": 0, "bad_in_a_row": 0}
    run = train.Run(args, model, opt, sched, scorer=scorer, world=world, pad_id=tok.pad_token_id)
    m = world.mean_metrics(train.train_step(run, mine, state))
    after = dist.full_state_dict(model, world.main) if size > 1 else model.state_dict()
    if world.main:
        torch.save({"delta": {k: after[k] - before[k] for k in before}, "metrics": m}, out)
    world.close()


def _worker_step(rank, world, port, eps, shard, extra, out):
    _as_rank(rank, world, port)
    _step(rank, world, eps, shard, extra, out)


@pytest.mark.parametrize("shard,extra,flat,shared", [
    ("ddp", (), (2,), 0), ("ddp", ("--reduction", "seq-mean-token-mean"), (2,), 0), ("fsdp", (), (2,), 0),
    ("ddp", ("--micro-batch-tokens", "40"), (2,), 0), ("fsdp", ("--micro-batch-tokens", "40"), (2,), 0), ("ddp", (), (0, 2), 0),
    ("fsdp", ("--logprob-chunk", "8"), (2,), 0),    # the LM head in chunks: FSDP2 gathers the root's weights around it
    ("fsdp", ("--logprob-chunk", "8"), (2,), 64)])  # the same on --shared-prefix's packed rows
def test_two_rank_gradient_equals_one_rank(tmp_path, shard, extra, flat, shared):
    eps = _episodes(make_tiny_tokenizer(), flat=flat, shared=shared)
    _step(0, 1, eps, "ddp", extra, tmp_path / "one.pt")  # in this process: a world of one
    _spawn(_worker_step, (2, _free_port(), eps, shard, extra, tmp_path / "two.pt"))
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert any(v.abs().max() > 0 for v in one["delta"].values())  # the step moved the weights
    for k, v in one["delta"].items():
        torch.testing.assert_close(two["delta"][k], v, rtol=1e-4, atol=1e-7, msg=k)
    assert two["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-4, abs=1e-7)
    assert two["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-4)


def _worker_main(rank, world, port, argv):
    _as_rank(rank, world, port)
    train.envs.make_env = lambda name, **kw: ByteSumEnv()  # test_train's toy env, in this process
    train.main(argv)


def _run(world, argv):
    if world == 1:
        train.envs.make_env, old = (lambda name, **kw: ByteSumEnv()), train.envs.make_env
        try:
            return train.main(argv)
        finally:
            train.envs.make_env = old
    _spawn(_worker_main, (world, _free_port(), argv), nprocs=world)


def _prompts_by_step(out_dir):
    by = {}
    for line in open(os.path.join(out_dir, "episodes.jsonl")):  # the viewer's records: every group's prompt
        s = json.loads(line)
        by.setdefault(s["step"], set()).add(s["prompt"])
    return by


def test_torchrun_data_order_and_resume_on_n_and_m(tiny_model_dir, tmp_path):
    a = lambda out, *x: _argv(tiny_model_dir, tmp_path / out, "--prompts-per-step", "4", "--n", "2",  # noqa: E731
                              "--viewer-groups", "4", *x)
    _run(1, a("one", "--steps", "3"))           # one process, 3 steps
    _run(2, a("two", "--steps", "3"))           # two processes, 3 steps
    _run(2, a("cut", "--steps", "2"))           # two processes, 2 steps, then resume on two...
    shutil.copytree(tmp_path / "cut", tmp_path / "m")
    _run(2, a("cut", "--steps", "3", "--resume", str(tmp_path / "cut")))
    _run(1, a("m", "--steps", "3", "--resume", str(tmp_path / "m")))  # ...and on one
    one, two = _prompts_by_step(tmp_path / "one"), _prompts_by_step(tmp_path / "two")
    assert one == two and len(one[1]) == 4     # the same 4 prompts each step, whatever the world size
    assert _prompts_by_step(tmp_path / "m") == one
    steps = [json.loads(line)["step"] for line in open(tmp_path / "cut" / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    w_two = _weights(tmp_path / "two" / "ckpt" / "step_000003")
    w_cut = _weights(tmp_path / "cut" / "ckpt" / "step_000003")
    assert all(torch.equal(w_two[k], w_cut[k]) for k in w_two)  # exact resume on the same world size
    hist = [json.loads(line) for line in open(tmp_path / "two" / "metrics.jsonl")]
    assert all(h["episodes"] == 8 for h in hist)  # rank 0 logs every rank's episodes


# top-p 1e-9 keeps only the most likely token: sampling is argmax whatever the seed, so every rank's
# episodes are the ones the one-process run samples for the same rows (seed + rank would differ), and
# weights compare across world sizes. A group of equal episodes has A = 0: the k1 KL term trains them
# (the advantage's gradient over ranks: test_two_rank_gradient_equals_one_rank).
ARGMAX = ("--top-p", "1e-9", "--kl-coef", "0.1", "--kl-type", "k1")


def _torchrun_two_nodes(argv, log_dir, limit_s=300):
    """Two torchrun launches on this machine that meet as two nodes would: the same command, a c10d
    rendezvous at one endpoint (the first agent to bind it hosts the store), 2 processes each; the
    rendezvous hands out ranks 0-3, so no --node-rank. --local-addr: workers reach rank 0 at
    127.0.0.1, not at whatever this machine's hostname resolves to."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "test",
           "--local-addr", "127.0.0.1", "--", "train.py", *argv]
    env = dict(os.environ, NANORL_DIST_TIMEOUT_S="120")
    logs = [log_dir / f"node{i}.log" for i in range(2)]
    outs = [open(f, "w") for f in logs]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True) for out in outs]  # a session each: killpg ends its workers
    deadline = time.monotonic() + limit_s
    while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p, out in zip(nodes, outs):
        if p.poll() is None:  # a stuck node fails the test instead of hanging the suite
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        out.close()
    tails = "\n".join(f"--- {f.name}\n" + "".join(open(f).readlines()[-20:]) for f in logs)
    assert [p.returncode for p in nodes] == [0, 0], f"torchrun nodes failed or ran past {limit_s} s\n{tails}"


def _assert_same_run(one, other, steps, init):
    """Two runs' out dirs: the same prompts each step, the same losses and gradient norms, and final
    weights equal up to the summation order of the all-reduce."""
    assert _prompts_by_step(other) == _prompts_by_step(one) and len(_prompts_by_step(one)) == steps
    m_one, m_other = ([json.loads(line) for line in open(d / "metrics.jsonl")] for d in (one, other))
    assert [m["step"] for m in m_other] == [m["step"] for m in m_one] == list(range(1, steps + 1))
    for a, b in zip(m_one, m_other):
        for k in ("loss", "kl", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k)
    ckpt = f"step_{steps:06d}"
    w_one, w_other = _weights(one / "ckpt" / ckpt), _weights(other / "ckpt" / ckpt)
    # AdamW moves every weight by ~lr = 1e-3 a step; the summation order moves them by < 2e-6 (1.6e-6 seen)
    w_init = _weights(init)
    assert all((w_one[k] - w_init[k]).abs().max() > 1e-3 for k in w_one)
    for k in w_one:
        torch.testing.assert_close(w_other[k], w_one[k], rtol=0, atol=2e-5, msg=k)


def _runs(tiny_model_dir, tmp_path):
    """argv for a run into tmp_path/out, its episodes the same on any world size (ARGMAX)."""
    return lambda out, *x: _argv(tiny_model_dir, tmp_path / out, "--prompts-per-step", "4", "--n", "2",  # noqa: E731
                                 "--viewer-groups", "4", "--save-every", "2", *ARGMAX, *x)


def test_two_nodes_of_two_equal_one_process(tiny_model_dir, tmp_path):
    a = _runs(tiny_model_dir, tmp_path)
    train.main(a("one", "--steps", "2"))  # one process, the real multiply env (torchrun's processes run it too)
    _torchrun_two_nodes(a("nodes", "--steps", "2"), tmp_path)
    _assert_same_run(tmp_path / "one", tmp_path / "nodes", 2, tiny_model_dir)
    assert "torchrun: 4 ranks" in "".join(open(tmp_path / f"node{i}.log").read() for i in range(2))


def test_resume_on_4_then_2_then_1_equals_one_process(tiny_model_dir, tmp_path):
    a = _runs(tiny_model_dir, tmp_path)
    _run(1, a("one", "--steps", "4"))                                     # uninterrupted, one process
    _run(4, a("cut", "--steps", "2"))                                     # 4 processes, 2 steps...
    _run(2, a("cut", "--steps", "3", "--resume", str(tmp_path / "cut")))  # ...step 3 on 2...
    _run(1, a("cut", "--steps", "4", "--resume", str(tmp_path / "cut")))  # ...step 4 on 1
    _assert_same_run(tmp_path / "one", tmp_path / "cut", 4, tiny_model_dir)


def _worker_optimizer_roundtrip(rank, size, port, path):
    _as_rank(rank, size, port)
    tok = make_tiny_tokenizer()
    world = dist.World("cpu")
    scorer, model = dist.wrap(Scorer(make_tiny_model(tok)), world, "fsdp", torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))
    scorer(ids, torch.ones_like(ids))[0].sum().backward()
    opt.step()
    full = dist.optimizer_state(opt, world.main)  # gathered: the single-GPU layout, on rank 0
    if world.main:
        shapes = {n: p.shape for n, p in model.named_parameters()}
        assert [s["exp_avg"].shape for s in full["state"].values()] == list(shapes.values())
        torch.save(full, path)
    world.barrier()
    again = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dist.load_optimizer_state(again, torch.load(path))  # each rank takes its own shard back
    for p in model.parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again.state[p][k].to_local(), opt.state[p][k].to_local())
    world.close()


def _worker_copy_weights(rank, size, port, path):
    _as_rank(rank, size, port)
    tok = make_tiny_tokenizer()
    world = dist.World("cpu")
    model = make_tiny_model(tok)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    scorer, model = dist.wrap(Scorer(model), world, "fsdp", torch.float32)
    ref = make_tiny_model(tok)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)  # a stale reference
    dist.copy_weights(model, ref)  # --ref-update-every under FSDP2: the sharded policy into a full replica
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in want.items())
    if world.main:
        torch.save(len(want), path)
    world.close()


def test_fsdp_policy_copies_into_the_kl_reference(tmp_path):
    _spawn(_worker_copy_weights, (2, _free_port(), tmp_path / "copied.pt"))
    assert torch.load(tmp_path / "copied.pt") > 0


def test_fsdp_optimizer_state_gathers_and_reshards(tmp_path):
    _spawn(_worker_optimizer_roundtrip, (2, _free_port(), tmp_path / "adamw.pt"))
    assert (tmp_path / "adamw.pt").exists()


def test_scaling_bench_compares_like_with_like(monkeypatch):
    # lab/bench.py --scaling: the one-GPU run and the torchrun ranks decide --compile alike (its
    # default is on for one GPU, off under torchrun), so the ratio measures scaling, not the compiler
    import config
    bench = load_script("lab/bench.py")
    argv = bench.bench_tables.SCALING_FLAGS + ["--model", "smollm2", "--prompts-per-step", "32"]  # lab/bench_tables.py
    decided = []
    for world in ("1", "2"):
        monkeypatch.setenv("WORLD_SIZE", world)
        decided.append(config.parse_args(argv).compile)
    assert decided == [False, False]


def test_scaling_bench_runs_apart_on_their_own_gpus(tmp_path, monkeypatch, capsys):
    # --scaling 2 --apart: besides 1 GPU and torchrun on 2, two one-GPU runs at once (no DDP), each
    # on its own GPU with 32 prompts; their throughputs add up and their phases are averaged
    bench, launched = load_script("lab/bench.py"), []

    class Run:  # a train.py that writes the metrics of 4 steps, slower on GPU 1
        def __init__(self, cmd, cwd, env, stdout, stderr):
            out = Path(cmd[cmd.index("--out-dir") + 1])
            gpu, prompts = env.get("CUDA_VISIBLE_DEVICES", "all"), int(cmd[cmd.index("--prompts-per-step") + 1])
            launched.append((cmd[1:3], gpu, prompts, env.get("OMP_NUM_THREADS")))
            step = 2.0 if gpu == "1" else 1.0
            out.mkdir(parents=True)
            with open(out / "metrics.jsonl", "w") as f:
                for k in range(1, 5):
                    f.write(json.dumps({"step": k, "step_time_s": step, "episodes": prompts * 8, "response_tokens": 10,
                                        "time_rollout_s": step / 2, "time_train_s": step / 2, "time_backward_s": step / 4}) + "\n")

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Run)
    for var in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):  # what the bench sets itself
        monkeypatch.delenv(var, raising=False)
    bench.main(["--scaling", "2", "--apart", "--model", "smollm2", "--out", str(tmp_path)])
    assert [(c, g, p) for c, g, p, _ in launched] == [(["train.py", "--gpu"], "0", 32), (["-m", "torch.distributed.run"], "all", 64),
                                                      (["train.py", "--gpu"], "0", 32), (["train.py", "--gpu"], "1", 32)]
    assert launched[2][3] == launched[3][3] == str(max(1, (os.cpu_count() or 2) // 2))  # each its share of the cores
    line = json.loads(open(tmp_path / "scaling.json").read())
    apart = line["apart"]
    assert apart["episodes_per_s"] == 256 / 1.0 + 256 / 2.0 and apart["episodes"] == 512
    assert apart["phases"]["backward"] == pytest.approx((0.25 + 0.5) / 2) and apart["step_s"] == 1.5
    assert "2 runs apart / 1 GPU: 1.50x" in capsys.readouterr().out


def test_vllm_compile_cache_is_per_device_index_and_set_before_the_engine(tmp_path, monkeypatch):
    # vLLM 0.26 keys its saved graphs by a hash and rank_<rank>_<dp index>, not by the device index: a
    # two-node launch after a 4-GPU run on one host loaded cuda:2's graphs on cuda:0 ("invalid device
    # ordinal"). Under torchrun every process gets $VLLM_CACHE_ROOT/torchrun-cuda<LOCAL_RANK>, set
    # before vLLM's LLM is built; one process keeps vLLM's own root
    import types
    import vllm_engine
    seen = []

    class LLM:  # vLLM's LLM as far as the engine's start goes: what its compile would read
        def __init__(self, **kw):
            seen.append((os.environ.get("VLLM_CACHE_ROOT"), kw.get("distributed_executor_backend")))
            raise RuntimeError("stop here")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    for rank, local, world in ((0, 0, 4), (1, 1, 4), (2, 2, 4), (2, 0, 4), (3, 1, 4), (0, 0, 1)):  # 4 GPUs, then 2 nodes x 2
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))  # the user's (or ~/.cache/vllm): the base
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        with pytest.raises(RuntimeError, match="stop here"):
            vllm_engine.VLLMEngine("m")
    roots = [r for r, _ in seen]
    assert roots[:5] == [str(tmp_path / f"torchrun-cuda{i}") for i in (0, 1, 2, 0, 1)]  # node 1's ranks 2, 3: cuda:0, cuda:1
    assert roots[5] == str(tmp_path) and seen[5][1] is None  # one process: vLLM's own root, no external launcher
    assert len(set(roots[:3])) == 3  # no two devices of one host share a folder
    assert vllm_engine.compile_cache_root({"VLLM_CACHE_ROOT": roots[1], "LOCAL_RANK": "1"}) == roots[1]  # idempotent
    assert vllm_engine.compile_cache_root({"LOCAL_RANK": "3"}) == os.path.expanduser("~/.cache/vllm/torchrun-cuda3")


def _worker_reducer(rank, world, port, out, device="cpu"):
    # every rank: 2 micro-batches of its own data through a model with GradReducer (one parameter a
    # bucket, so buckets go out while the backward runs on), against (a) the one-process gradient of
    # every rank's data and (b) the plain way, World.sum_grads after the backward (device "cuda":
    # NCCL, tests/test_gpu.py)
    _as_rank(rank, world, port)
    w = dist.World(device)
    tok = make_tiny_tokenizer()
    models = [make_tiny_model(tok).to(w.device) for _ in range(3)]  # reducer, plain, one process
    models[0].unused = torch.nn.Parameter(torch.ones(3, device=w.device))  # never in the graph: its bucket goes out at the end, zeros
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (2, 9), generator=g).to(w.device) for _ in range(2 * world)]  # micro-batch k of rank r: data[2r + k]
    loss = lambda m, ids: m(ids).logits.float().logsumexp(-1).mean() / (2 * world)  # noqa: E731  global denominator
    reducer = dist.GradReducer(models[0].parameters(), w, bucket_mb=1e-6)
    sent_during_backward = []
    send = reducer.send
    reducer.send = lambda everything=False: (sent_during_backward.append((len(reducer.works), everything)), send(everything))[1]
    for k in range(2):
        reducer.start(last=k == 1)
        (loss(models[0], data[2 * rank + k]) * w.grad_scale).backward()
    for k in range(2):
        loss(models[1], data[2 * rank + k]).backward()
    w.sum_grads(models[1])
    for ids in data:
        loss(models[2], ids).backward()
    names = [n for n, _ in models[2].named_parameters()]
    if w.main:
        cpu = lambda m: [p.grad.cpu() for p in m.parameters() if p is not models[0].unused]  # noqa: E731
        torch.save({"reducer": cpu(models[0]), "plain": cpu(models[1]), "one": cpu(models[2]),
                    "names": names, "unused": models[0].unused.grad.cpu(), "buckets": len(reducer.buckets),
                    "sends": sent_during_backward, "left": len(reducer.flat)}, out)
    w.close()


def test_grad_reducer_equals_the_plain_sum_and_one_process(tmp_path, device="cpu"):
    _spawn(_worker_reducer, (2, _free_port(), tmp_path / "grads.pt", device))
    r = torch.load(tmp_path / "grads.pt")
    assert r["buckets"] == len(r["names"]) + 1  # one parameter a bucket (+ the unused one)
    for name, a, b, c in zip(r["names"], r["reducer"], r["plain"], r["one"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=name)  # the same sums in another order
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-8, msg=name)
    assert torch.equal(r["unused"], torch.zeros(3)) and r["left"] == 0
    early = [n for n, everything in r["sends"] if not everything and n > 0]  # buckets already out at a later hook
    assert early and max(early) > len(r["names"]) // 2  # most went out while the backward ran, not at its end


def _worker_balance(rank, world, port, out):
    _as_rank(rank, world, port)
    w = dist.World("cpu")
    # rank 0 sampled the long episodes (groups 0, 2: 40 and 30 tokens each), rank 1 the short ones
    # (groups 1, 3: 10 and 5); rewards differ in every group but group 3 (A = 0: no backward)
    lengths = {0: 40, 1: 10, 2: 30, 3: 5}
    mine = [Episode([1] * 4, [2] * (lengths[g] - 4), [1] * (lengths[g] - 4), [0.0] * (lengths[g] - 4),
                    float(k % 2) if g != 3 else 0.5, "stop", g) for g in (rank, rank + 2) for k in range(2)]
    logged = mine + [Episode([1], [2], [1], [0.0], 0.0, "stop", 10 + rank)]  # + one sampled, not trained (filtered)
    got, sampled = w.balance(mine, logged)
    parts = w.gather([[(e.group, len(e.prompt_ids) + len(e.response_ids)) for e in got]])
    assert all(any(s is e for s in sampled) for e in got)  # what this rank trains is what it logs
    assert sorted(e.group for e in sampled) == sorted([e.group for e in got] + [10 + rank])
    if w.main:
        torch.save(parts, out)
    w.close()


def test_balance_moves_whole_groups_to_equal_work(tmp_path):
    # costs (tokens x 3 where rewards differ): group 0 240, 2 180, 1 60, 3 10 -> largest first to the
    # cheapest rank: 0 -> rank 0, 2 -> rank 1, 1 -> rank 1 (180 < 240), 3 -> rank 0: 250 / 240 instead of 420 / 70
    _spawn(_worker_balance, (2, _free_port(), tmp_path / "parts.pt"))
    parts = torch.load(tmp_path / "parts.pt")
    assert [sorted({g for g, _ in p}) for p in parts] == [[0, 3], [1, 2]]
    assert [len(p) for p in parts] == [4, 4]  # as many episodes per rank as before, whole groups
    assert [sum(t for _, t in p) for p in parts] == [2 * 40 + 2 * 5, 2 * 30 + 2 * 10]
    one = dist.World("cpu")  # a world of one: the identity
    eps = [Episode([1], [2], [1], [0.0], 0.0, "stop", g) for g in (3, 1)]
    assert one.balance(eps, eps[:1]) == (eps, eps[:1])


def _worker_balance_all_train(rank, world, port, out):
    _as_rank(rank, world, port)
    w = dist.World("cpu")
    # a KL term: every group trains, so equal rewards cost as much as any (skip_equal=False). Rank 0:
    # groups 0 (20 tokens, rewards differ) and 2 (20, all equal); rank 1: 1 and 3 (10 each, differ)
    lengths, flat = {0: 20, 1: 10, 2: 20, 3: 10}, {2}
    mine = [Episode([1] * 4, [2] * (lengths[g] - 4), [1] * (lengths[g] - 4), [0.0] * (lengths[g] - 4),
                    0.5 if g in flat else float(k % 2), "stop", g) for g in (rank, rank + 2) for k in range(2)]
    parts = [w.gather([sorted({e.group for e in w.balance(mine, mine, skip_equal=s)[0]})]) for s in (True, False)]
    if w.main:
        torch.save(parts, out)
    w.close()


def test_balance_counts_equal_reward_groups_whole_when_every_group_trains(tmp_path):
    # skip_equal: costs 0: 120, 2: 40, 1: 60, 3: 60 -> {0}, then 1 -> rank 1, 3 -> rank 1, 2 -> rank 0: [0, 2] / [1, 3]
    # (160 / 120); every group trains: 0: 120, 2: 120, 1: 60, 3: 60 -> [0, 1] / [2, 3] (180 / 180)
    _spawn(_worker_balance_all_train, (2, _free_port(), tmp_path / "parts.pt"))
    assert torch.load(tmp_path / "parts.pt") == [[[0, 2], [1, 3]], [[0, 1], [2, 3]]]


def test_scaling_bench_prints_mfu_against_the_named_peak(tmp_path, monkeypatch, capsys):
    # MFU = 6 N T / time_train_s / peak: N 135e6 (SmolLM2), T 1000 trained tokens a rank in 0.5 s of
    # training phase, an H100 SXM's 989 TFLOP/s dense bf16: 6 * 135e6 * 2000 / 989e12 = 0.164 %
    bench = load_script("lab/bench.py")
    tables = bench.bench_tables
    assert tables.peak_flops("NVIDIA H100 80GB HBM3") == ("H100", 989e12)
    assert tables.peak_flops("NVIDIA H100 PCIe")[0] == "H100 PCIe" and tables.peak_flops("NVIDIA L40S")[1] == 362e12
    assert tables.peak_flops("NVIDIA A100-SXM4-40GB")[1] == 312e12 and tables.peak_flops(None) == (None, None)
    assert tables.mfu(135e6, 2000, 1.0, None) is None

    class Run:
        def __init__(self, cmd, cwd, env, stdout, stderr):
            out = Path(cmd[cmd.index("--out-dir") + 1])
            out.mkdir(parents=True)
            with open(out / "metrics.jsonl", "w") as f:
                for k in range(1, 5):
                    f.write(json.dumps({"step": k, "step_time_s": 1.0, "episodes": 256, "response_tokens": 10,
                                        "time_rollout_s": 0.5, "time_train_s": 0.5, "trained_tokens": 1000}) + "\n")

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Run)
    monkeypatch.setattr(tables, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(tables, "model_params", lambda model: 135e6)
    bench.main(["--scaling", "2", "--model", "smollm2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("training phase 2,000 tok/s, MFU 0.2% of H100's 989 TFLOP/s dense bf16") == 2, out
    assert "rollout 5,120 generated tok/s a GPU" in out  # 256 x 10 / 0.5 s on one GPU
    assert "rollout 2,560 generated tok/s a GPU" in out  # the same totals over 2 GPUs
    line = json.loads(open(tmp_path / "scaling.json").read())
    assert line["one"]["mfu"] == pytest.approx(6 * 135e6 * 2000 / 989e12)


def _worker_sharded_reference(rank, size, port, path):
    _as_rank(rank, size, port)
    from torch.distributed.tensor import DTensor
    tok = make_tiny_tokenizer()
    world = dist.World("cpu")
    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(rank))  # each rank its own rows
    plain = make_tiny_model(tok).eval().requires_grad_(False)
    ref = dist.shard_reference(make_tiny_model(tok).eval().requires_grad_(False), world, "fsdp", torch.float32)
    with torch.no_grad():
        want, got = Scorer(plain)(ids, torch.ones_like(ids))[0], Scorer(ref)(ids, torch.ones_like(ids))[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(isinstance(p, DTensor) for p in ref.parameters())  # the root resharded after its forward too
    rows = plain.model.embed_tokens.weight.shape[0]
    assert ref.model.embed_tokens.weight.to_local().shape[0] in (rows // size, -(-rows // size))  # 1/W of it here
    _, policy = dist.wrap(Scorer(make_tiny_model(tok)), world, "fsdp", torch.float32)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)  # the policy moved
    dist.copy_weights(policy, ref)  # --ref-update-every's move, shard to shard (not used with it yet: checkpoint)
    half = dist.shard_reference(make_tiny_model(tok).to(torch.bfloat16).requires_grad_(False), world, "fsdp", torch.bfloat16)
    dist.copy_weights(policy, half)  # float32 shards into bfloat16 ones (train.py's reference dtype)
    a, b, c = (dist.full_state_dict(m, world.main) for m in (policy, ref, half))
    if world.main:
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k].to(torch.bfloat16), c[k]) for k in a)
        torch.save(len(a), path)
    world.close()


def test_fsdp_reference_is_sharded_and_scores_as_the_whole_one(tmp_path):
    _spawn(_worker_sharded_reference, (2, _free_port(), tmp_path / "ref.pt"))
    assert torch.load(tmp_path / "ref.pt") > 0
    one = dist.World("cpu")
    model = make_tiny_model(make_tiny_tokenizer())
    assert dist.shard_reference(model, one, "fsdp", torch.float32) is model  # a world of one: as it was
