"""
More than one GPU: torchrun starts one train.py per GPU, and this file holds everything that
differs from a single-GPU run. With one process every function here is the identity, so
`python train.py` runs exactly the code it ran before. Not an option (options/): train.py reads
its rank (`run.world`) on every line of a run, one GPU or several, so it lives in support/.

    torchrun --nproc-per-node 2 -- train.py --gpu h100 --env gsm8k              # DDP (the default)
    torchrun --nproc-per-node 2 -- train.py --gpu h200 --model M --shard fsdp   # FSDP2: a model too big to replicate
    # several nodes: the same command on every node, torchrun's own rendezvous (on CPU: tests/test_dist.py, two launches)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id RUN -- train.py ...

The `--` before train.py: torchrun's parser also reads the flags after the script and takes
abbreviations, so without it our `--n 8` is "ambiguous: --nnodes, --nproc-per-node, ...".

One step on W ranks (rank r of W; every rank runs the whole loop):
  rows      every rank draws the same P rows (P a multiple of W) and keeps rows[r::W]: whole
            prompts, so a group's episodes and advantages are the single-GPU ones.
  rollout   each rank's own colocated vLLM engine (tensor parallel 1, seed + rank), P/W prompts x n.
  balance   then whole groups move between ranks, as many episodes each, so that every rank trains
            about as many tokens (World.balance, from train.collect): the update's reduce waits for
            the slowest rank.
  loss      each rank's loss uses the global denominators: tokens and sequences of the whole
            mini-batch are all-reduced (SUM) first. DDP and FSDP2 *average* gradients over ranks,
            so the backward runs on W x loss: the single-GPU gradient of the same batch
            (tests/test_dist.py, 2 processes on gloo). --mini-batch-size M: M/W per rank.
  lockstep  FSDP2 all-gathers weights in every forward, so every rank runs as many micro-batches
            per update: a rank with less work (shorter episodes pack into fewer micro-batches,
            sequences with A = 0 are skipped) repeats a row with its loss mask zeroed (a filler:
            exactly zero loss and gradient). DDP communicates only in an update's last backward:
            each rank runs its own count, a filler only when it has nothing to train (its backward
            is what fills the buckets).
  sharding  --shard ddp (default): every rank holds the whole float32 model and AdamW; gradients are
            averaged once per update, in the last micro-batch's backward: GradReducer, DDP's buckets
            written out (~25 MB each, all-reduced as soon as the backward has filled them, so the
            reduce overlaps the rest of the backward; waited for when the backward ends).
            --shard fsdp: FSDP2 `fully_shard` on each decoder layer and on the root, so weights,
            gradients and AdamW state are 1/W per rank; forwards run in bf16 (MixedPrecisionPolicy)
            with float32 reductions, like the single-GPU autocast. The frozen KL reference is
            sharded alike (shard_reference), except with --ref-update-every.
  dapo      dynamic sampling draws another round while any rank holds fewer than its share of kept
            episodes, so all draw as many; each trains its share (after the last round: the fewest
            any rank kept, so all run as many updates).
  critic    --algo gae: each rank holds the whole critic and its AdamW (--shard fsdp too), no DDP: its
            loss divides by global token counts and its gradients are summed over ranks by hand
            before the clip; GAE's advantages are whitened over every rank's tokens (test_options.py).
  sync      each rank pushes into its own engine (FSDP2: full tensors one bucket at a time,
            sync.push_fast, never a second copy of the model) and runs its own logprob check.
  logging   episodes and metrics are gathered to rank 0, which alone prints and writes files.
  checkpoint  the same HF folder as a single-GPU run (FSDP2: full tensors gathered first) and the
            same AdamW state_dict, keyed by parameter index, so a run saved on N GPUs resumes on
            M (or on one): the data state is global, each rank takes its share of the same rows.
            RNG states are saved per rank and restored when the world size is the same.

Not yet with more than one process: the HF engine with FSDP, LoRA with FSDP, a sharded critic;
reinforce++ and reinforce++-baseline whiten over each rank's own tokens (grpo.masked_whiten).
"""
import contextlib
import datetime
import functools
import os
import time

import torch
import torch.distributed as tdist

import score
from grpo import masked_whiten


class World:
    """This process's place in the torchrun world (rank 0 of 1 without torchrun)."""

    def __init__(self, device="cpu"):
        self.size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.main = self.rank == 0
        self.device = torch.device(device)
        self.paired = False  # every rank's forwards pair up (FSDP2's collectives): set by wrap()
        if self.size > 1 and not tdist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.local_rank)
                self.device = torch.device("cuda", self.local_rank)
            # NCCL on GPUs, gloo on the CPU (the tests); a rank that dies takes the others down
            # after the timeout ($NANORL_DIST_TIMEOUT_S, 30 min) instead of hanging forever
            timeout = datetime.timedelta(seconds=float(os.environ.get("NANORL_DIST_TIMEOUT_S", 1800)))
            tdist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout)
        elif self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())

    # -- collectives (no-ops in a world of one)
    def sum(self, values):
        """Element-wise sum over ranks of a list of numbers (or 0-d tensors) -> list of floats."""
        if self.size == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t)
        return t.tolist()

    def max(self, value):
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return type(value)(t.item())

    def min(self, value):
        return -self.max(-value)

    def sum_grads(self, module, *tensors):
        """SUM over ranks, in place, of the module's gradients (and of `tensors`, e.g. a loss): for a
        model trained without DDP (the critic) whose loss divides by global denominators, the sum is the
        single-GPU gradient. One all-reduce per tensor: DDP would bucket them, fine for a second model."""
        if self.size == 1:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        for p in (p for p in params if p.grad is None):  # every rank joins every all-reduce
            p.grad = torch.zeros_like(p)
        for t in [*tensors, *(p.grad for p in params)]:
            tdist.all_reduce(t)

    def gather(self, items):
        """Every rank's list, concatenated in rank order (on every rank)."""
        if self.size == 1:
            return list(items)
        out = [None] * self.size
        tdist.all_gather_object(out, list(items))
        return [x for part in out for x in part]

    def barrier(self):
        if self.size > 1:
            tdist.barrier()

    @contextlib.contextmanager
    def rank0_first(self):
        """Rank 0 runs the block first (it may build a cache folder), then the others."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()

    def close(self):
        if self.size > 1 and tdist.is_initialized():
            # gloo's worker threads free each finished collective after wait() has returned, and
            # freeing one that holds Python tensors (all_gather_object's) takes the GIL, which the
            # group's destructor holds while it joins them: a deadlock at exit. So: a last barrier,
            # a short sleep (it releases the GIL) for the workers to finish, then the teardown.
            tdist.barrier()
            time.sleep(0.2)
            tdist.destroy_process_group()

    # -- the step
    def local_rows(self, rows):
        """This rank's share of the step's rows: whole prompts, every W-th from r."""
        return rows[self.rank::self.size]

    def global_group(self, local_group):
        """A group id as the single-GPU run numbers it (row j of this rank's share is row r + jW)."""
        return self.rank + local_group * self.size

    def lockstep(self, todo, filler):
        """Yield (micro-batch indices, real, last) for an update's forward/backwards. FSDP2 (every
        forward gathers, every backward reduce-scatters): todo padded with fillers (`filler`
        indices, real=False) to the longest list on any rank. DDP all-reduces only in the last
        backward, so each rank runs its own count, with one filler where it has nothing to train."""
        n = self.max(len(todo)) if self.paired else max(len(todo), int(self.size > 1))
        for k in range(n):
            yield (todo[k], True, k == n - 1) if k < len(todo) else (filler, False, k == n - 1)

    def even(self, todo):
        """A no-grad micro-batch list, under FSDP2 padded to the longest on any rank by repeating its
        last entry (recomputes the same values into the same place): its forwards must pair up."""
        if not self.paired:
            return list(todo)
        n = self.max(len(todo))
        return list(todo) + [todo[-1]] * (n - len(todo)) if todo else list(todo)

    def short(self, kept, share):
        """Dynamic sampling's "another round?": while any rank holds fewer than its share of kept
        episodes. Every rank answers the same, so all draw as many rounds (their collectives pair up);
        a rank already full would only wait for the others, and generates beside them instead."""
        return bool(self.max(int(kept < share)))

    def trained(self, kept, share):
        """The episodes this rank trains: its share, or once the rounds ran out the fewest any rank
        kept, so that every rank trains as many and runs as many updates. One process: kept[:share]."""
        return kept[:self.min(min(len(kept), share))]

    def balance(self, episodes, sampled, skip_equal=True):
        """(episodes, sampled) with equal work: every rank's episodes to train regrouped over the ranks,
        whole groups, as many episodes per rank as before, each rank's training cost as near the mean
        as a greedy pass makes it. Without it every rank's last backward (where gradients are reduced)
        waits for the rank with the longest episodes or the most groups that train. A group's cost:
        its tokens (prompt + response), x3 for a forward and a backward; x1 for a group of equal
        rewards where skip_equal (A = 0: train_step skips its backward unless a KL term or a
        covariance loss reaches it; only its no-grad forwards run). Largest first,
        each to the cheapest rank with room (ties: the lower rank); every rank computes the same plan
        from the same gathered list, and only the episodes that change rank travel. sampled (what the
        step logs): a moved episode leaves its old rank's list and joins its new rank's, as the object
        that rank trains, so the advantage train_step writes into its info is the one logged. A rank's
        trained gradient sum is then another partition of the same episodes: the total, what the
        update applies, is the same."""
        if self.size == 1:
            return list(episodes), list(sampled)
        groups = {}
        for e in episodes:
            groups.setdefault(e.group, []).append(e)
        costs = {g: sum(len(e.prompt_ids) + len(e.response_ids) for e in eps)
                 * (1 if skip_equal and len({e.reward for e in eps}) == 1 else 3) for g, eps in groups.items()}
        listed = self.gather([(self.rank, g, len(groups[g]), costs[g]) for g in groups])  # (from, group, size, cost)
        room, load, dest = [0] * self.size, [0] * self.size, {}
        for r, _, size, _ in listed:
            room[r] += size  # each rank keeps its count of episodes
        for r, g, size, cost in sorted(listed, key=lambda x: (-x[3], x[1])):
            fits = [k for k in range(self.size) if room[k] >= size]
            if not fits:  # groups of different sizes that no longer fit: leave everything where it was
                return list(episodes), list(sampled)
            k = min(fits, key=lambda k: (load[k], k))
            room[k], load[k], dest[g] = room[k] - size, load[k] + cost, k
        away = [e for e in episodes if dest[e.group] != self.rank]
        arrived = [e for e in self.gather(away) if dest[e.group] == self.rank]
        gone = {id(e) for e in away}
        mine = sorted([e for e in episodes if id(e) not in gone] + arrived, key=lambda e: e.group)  # stable
        return mine, [e for e in sampled if id(e) not in gone] + arrived

    def whiten(self, x, mask, eps=1e-8):
        """grpo.masked_whiten over every rank's masked entries: the mean and unbiased variance of the
        whole batch (GAE's advantages), not of this rank's share."""
        if self.size == 1:
            return masked_whiten(x, mask, eps)
        keep = mask > 0
        total, n = self.sum([torch.where(keep, x, torch.zeros_like(x)).sum(), keep.sum()])
        dev = torch.where(keep, x - total / max(n, 1.0), torch.zeros_like(x))
        var = self.sum([(dev ** 2).sum()])[0] / max(n - 1, 1.0)
        return dev * (var + eps) ** -0.5

    @property
    def grad_scale(self):
        """DDP and FSDP2 average gradients over ranks; our losses already divide by global
        denominators, so backward runs on W x loss to make that average a sum."""
        return float(self.size)

    def mean_metrics(self, m):
        """Per-key means over the ranks that have the key; "loss" is summed (each rank's loss is its
        share of the global loss, already divided by the global denominators)."""
        if self.size == 1:
            return m
        parts = self.gather([m])
        out = {}
        for k in dict.fromkeys(k for p in parts for k in p):
            vals = [p[k] for p in parts if k in p and isinstance(p[k], (int, float))]
            if vals:
                out[k] = sum(vals) if k == "loss" else sum(vals) / len(vals)
        return out


# ---- wrapping the trainer's model

def wrap(scorer, world, shard, compute_dtype):
    """(scorer, model) for train_step: under DDP the scorer (score.Scorer, the loss's forward as a
    module) with a GradReducer on its model's gradients, or its model FSDP2-sharded in place. World
    of one: both as they were."""
    model = scorer.model
    if world.size == 1:
        return scorer, model
    if shard == "ddp":
        with torch.no_grad():  # every rank starts from rank 0's weights (DDP's broadcast at construction)
            for t in [*model.parameters(), *model.buffers()]:
                tdist.broadcast(t, 0)
        scorer.grad_reducer = GradReducer(model.parameters(), world)
        return scorer, model
    world.paired = True
    return scorer, fsdp(model, world, compute_dtype)


def fsdp(model, world, compute_dtype, root_reshard=None):
    """FSDP2 on an HF decoder in place: one unit per decoder layer, gathered just before it runs, and
    the root (embeddings, final norm, LM head). root_reshard None: FSDP2's default, the root stays
    gathered from its forward to the end of the backward (the policy); True: resharded after every
    forward (a frozen model, whose forwards no backward follows)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(world.device.type, (world.size,))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=root_reshard)
    # --logprob-chunk runs the decoder and the LM head apart, not the root's forward: registered as one
    # of the root's forwards, score.hidden_then_head gets its weights gathered and its gradients reduced
    model.hidden_then_head = functools.partial(score.hidden_then_head, model)
    register_fsdp_forward_method(model, "hidden_then_head")
    return model


def shard_reference(ref, world, shard, compute_dtype):
    """--shard fsdp: the frozen KL reference sharded as the policy is (1/W of it a GPU, gathered a
    layer at a time in its no-grad forwards, which pair up like the policy's: World.even); else as
    it was. Not with --ref-update-every: its checkpoint saves the reference from rank 0 alone."""
    if world.size == 1 or shard != "fsdp":
        return ref
    return fsdp(ref, world, compute_dtype, root_reshard=True)


class GradReducer:
    """--shard ddp's gradient average, overlapped with the backward: what torch's DDP does, written out.
    The trainable parameters are split into buckets of ~bucket_mb, in reverse order of registration
    (roughly the order the backward finishes their gradients). At the first forward of an update
    (start) each bucket is one flat zeroed buffer and every .grad a view into it, so the micro-batches'
    backwards accumulate straight into the buffers (no copy, no second gradient: DDP's
    gradient_as_bucket_view). In an update's last backward (armed) a hook after each gradient's
    accumulation counts the bucket's gradients; once a bucket is complete it is divided by W and
    all-reduced (SUM) asynchronously, while the backward goes on with the layers below. Buckets go out
    strictly in index order, so every rank issues the same collectives in the same order, whatever
    order its backward finished them in; at the end of that backward (an autograd callback) any bucket
    not yet sent (a parameter without a gradient: its zeros) goes out, and all are waited for, before
    the optimizer can read a gradient. The plain way it replaces: World.sum_grads after the backward,
    one all-reduce per tensor, nothing overlapped (tests/test_dist.py holds both to the one-GPU step)."""

    def __init__(self, params, world, bucket_mb=25):
        self.world, self.buckets, size = world, [[]], 0
        for p in reversed([p for p in params if p.requires_grad]):
            if self.buckets[-1] and (size >= bucket_mb * 2**20 or p.dtype != self.buckets[-1][0].dtype):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {}  # id(parameter) -> its bucket
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                self.bucket_of[id(p)] = i
                p.register_post_accumulate_grad_hook(self.ready)
        self.armed, self.flat, self.done, self.works = False, [], [], []

    def start(self, last):
        """Before a micro-batch's forward: buffers and views at an update's first (after zero_grad(set_to_none):
        the update before freed them, so the engine could have the memory), armed for its last."""
        if not self.flat or any(p.grad is None for b in self.buckets for p in b):
            self.flat = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device) for b in self.buckets]
            for b, flat in zip(self.buckets, self.flat):
                offset = 0
                for p in b:
                    view = flat[offset:offset + p.numel()].view_as(p)
                    p.grad = view if p.grad is None else view.copy_(p.grad)  # a gradient already there moves in
                    offset += p.numel()
        self.armed = last
        self.done, self.works = [set() for _ in self.buckets], []

    def ready(self, p):
        """After p's gradient is accumulated (autograd's hook): in an armed backward, send what is complete."""
        if not self.armed:
            return
        if not self.works and not any(self.done):  # the first gradient of this backward: wait at its end
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        i = self.bucket_of[id(p)]
        if p.grad.untyped_storage().data_ptr() != self.flat[i].untyped_storage().data_ptr():
            raise RuntimeError("GradReducer: a gradient left its bucket (zero_grad(set_to_none) mid-update?)")
        self.done[i].add(id(p))
        self.send()

    def send(self, everything=False):
        """Issue the complete buckets in index order (everything: the rest too, at the backward's end)."""
        while len(self.works) < len(self.buckets):
            i = len(self.works)
            if not everything and len(self.done[i]) < len(self.buckets[i]):
                return
            self.flat[i].div_(self.world.size)  # DDP's average: its loss ran at W x (World.grad_scale)
            self.works.append(tdist.all_reduce(self.flat[i], async_op=True))

    def finish(self):
        """The backward's end: the rest sent, every reduce waited for (on a GPU: the stream waits, not the host)."""
        self.send(everything=True)
        for w in self.works:
            w.wait()
        self.armed, self.flat, self.works = False, [], []  # .grad keeps the buffers until zero_grad


@contextlib.contextmanager
def grad_sync(scorer, model, last):
    """Around a micro-batch's forward: DDP (GradReducer) reduces gradients only in the last
    micro-batch's backward of an update. FSDP2 reduce-scatters every micro-batch instead, so
    gradients accumulate sharded in float32 (its no-sync mode would hold a whole unsharded bf16
    gradient until the last one)."""
    reducer = getattr(scorer, "grad_reducer", None)
    if reducer is not None:
        reducer.start(last)
    yield


def full(t):
    """A full tensor: DTensor shards (FSDP2) are all-gathered -- a collective, every rank calls it."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def copy_weights(src, dst):
    """dst's weights (the KL reference) <- src's, one tensor at a time: into a plain dst each gathered
    first where src is FSDP2-sharded (full: every rank copies, in the same order); into a dst sharded
    alike (shard_reference) each rank copies its own shard, nothing gathered."""
    mine = dst.state_dict()
    for k, v in src.state_dict().items():
        mine[k].copy_(v if hasattr(mine[k], "device_mesh") else full(v))


def full_state_dict(model, main):
    """The model's state dict as full CPU tensors on rank 0 (None elsewhere); FSDP2 gathers each
    tensor in turn, so no rank holds more than one full tensor on the GPU at a time."""
    out = {}
    for k, v in model.state_dict().items():
        v = full(v)
        if main:
            out[k] = v.detach().cpu()
    return out if main else None


def optimizer_state(optimizer, main):
    """optimizer.state_dict() with full tensors (FSDP2's are sharded), on rank 0; the same layout
    as a single-GPU run's, so any world size can load it."""
    sd = optimizer.state_dict()
    if not any(hasattr(v, "full_tensor") for s in sd["state"].values() for v in s.values()):
        return sd if main else None
    state = {i: {k: full(v).cpu() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]} if main else None


def load_optimizer_state(optimizer, sd):
    """Load a full-tensor optimizer state; FSDP2 parameters take their own shard of each tensor."""
    from torch.distributed.tensor import distribute_tensor
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(hasattr(p, "device_mesh") for p in params):
        state = {}
        for i, s in sd["state"].items():
            p = params[int(i)]
            state[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                        if torch.is_tensor(v) and v.shape == p.shape else v for k, v in s.items()}
        sd = {"state": state, "param_groups": sd["param_groups"]}
    optimizer.load_state_dict(sd)
