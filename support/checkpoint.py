"""
Checkpoints for exact resume, written atomically.

OUT/ckpt/step_NNNNNN/ is a Hugging Face folder (model.safetensors, config.json,
tokenizer) that AutoModelForCausalLM.from_pretrained loads (a LoRA run: adapter_config.json +
adapter_model.safetensors in PEFT's layout; --algo gae adds critic/, a moving KL reference
reference/: train.py's save decides the model's files), plus trainer_state.pt (AdamW,
scheduler, RNG states, data position, counters: train.py decides what goes in) and
nanorl_config.json (the run's flags: --resume takes them back, config.resumed). The write is atomic:
  1. everything goes to OUT/ckpt/.tmp-step_NNNNNN-PID/ and is fsynced (each file, then its folder),
  2. that folder is renamed to step_NNNNNN (a re-run step first moves the old folder aside),
  3. only then is OUT/ckpt/latest (a one-line file) replaced, via latest.tmp + os.replace,
  4. step folders beyond the newest `keep` are deleted.
A crash mid-write leaves the previous checkpoint and `latest` untouched; find_checkpoint falls
back to the newest complete step_* when `latest` is missing or dangling. A checkpoint that cannot
be written (a full disk) falls back to OUT/policy, the policy alone, and the error says where it
went. rng_state/set_rng_state cover torch (CPU and CUDA) and Python's `random`, so a resumed run
samples what the uninterrupted one would have.

OUT/best/ (save_best; --eval-data val=FILE) is the policy alone at its best val pass@1, swapped in
the same way: written beside, then renamed into place.

Ctrl-C (CtrlC, around train.py's loop): the first one lets the current step finish, then the
loop evaluates it (with --eval-every), writes a checkpoint and exits; a second one raises KeyboardInterrupt at once, with a one-line
message train.cli prints (the last checkpoint stays intact, since every write is atomic).

Test: python -m pytest -q tests/test_train.py   (crash mid-save, pruning, exact resume)
"""
import json
import os
import random
import re
import shutil
import signal
import threading
from pathlib import Path

import torch

from support.dist import full_state_dict, load_optimizer_state, optimizer_state


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


def _replace_folder(final: Path, write, what: str, kept: str) -> None:
    """final's new contents, written beside it (write(tmp) fills .tmp-NAME-PID, then fsynced) and swapped
    in by two renames: an old folder first moves aside to .old-NAME-PID, deleted after. A failed write
    deletes the half-written folder (it would hold the space) and is an OSError naming what is left (kept)."""
    tmp, old = final.parent / f".tmp-{final.name}-{os.getpid()}", final.parent / f".old-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        _fsync_tree(tmp)
    except (OSError, RuntimeError) as e:  # a full disk reads as torch's "unexpected pos N vs M"
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(final.parent).free / 2**30
        raise OSError(f"writing {what} {final} failed: {e} ({free:.1f} GiB free on that disk; a full disk? {kept})") from e
    # final exists for a step re-run after resuming from an earlier checkpoint, and for each new best policy.
    # A crash between the two renames leaves the old folder aside (a checkpoint's: find_checkpoint then
    # falls back to the newest complete step).
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(out_dir, step, model, tokenizer, trainer_state, config, keep=2):
    ck = Path(out_dir) / "ckpt"
    ck.mkdir(parents=True, exist_ok=True)
    final = ck / f"step_{step:06d}"

    def write(tmp):
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(tmp)
        else:  # a function that writes the model's files (save_run's)
            model(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "nanorl_config.json").write_text(json.dumps(config, indent=1))
    _replace_folder(final, write, "checkpoint",
                    f"the previous checkpoint is intact; the last {keep} are kept, --save-every sets how often")
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


def run_folder(resume):
    """The run folder a --resume path continues in (--out-dir's default then): the folder that holds
    ckpt/, for a run folder or a step folder inside its ckpt/; the path itself when it holds no
    checkpoint (resume_point then says so); None for a step folder outside any ckpt/."""
    p = Path(resume)
    if not (p / "trainer_state.pt").exists():
        return str(p)
    return str(p.parent.parent) if p.parent.name == "ckpt" else None


def checkpoint_step(ckpt):
    """The step a checkpoint folder holds, read from its name (step_NNNNNN) without loading anything;
    None for a folder renamed since."""
    m = re.fullmatch(r"step_(\d+)", Path(ckpt).name)
    return int(m.group(1)) if m else None


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


def load_trainer_state(ckpt, optimizer, scheduler, critic_optimizer=None, rank=0, world=1) -> dict:
    """Restore AdamW (and the critic's, --algo gae), the scheduler and the RNGs from a checkpoint
    folder; returns train.py's loop state. (The run's flags came back at parse time: config.resumed.)
    Under torchrun (support/dist.py) each rank takes its own RNG state when the world size is the one saved,
    else rank 0's with a seed offset by its rank (the data order is global: the same on any world
    size); FSDP2 parameters take their shards of the AdamW state."""
    ts = torch.load(Path(ckpt) / "trainer_state.pt", weights_only=False)
    load_optimizer_state(optimizer, ts["optimizer"])
    scheduler.load_state_dict(ts["scheduler"])
    if critic_optimizer is not None:
        critic_optimizer.load_state_dict(ts["critic_optimizer"])
    per_rank = ts.get("rng_ranks") or [ts["rng"]]
    set_rng_state(per_rank[rank] if len(per_rank) == world else ts["rng"])
    if len(per_rank) != world and rank:
        torch.manual_seed(int(torch.randint(2**62, (1,))) + rank)  # not the same samples as rank 0
    print(f"resumed from {ckpt} at step {ts['state']['step']}")
    return ts["state"]


def saved_config(resume) -> dict:
    """The flags of the run a --resume path holds (its checkpoint's nanorl_config.json, vars(args)
    as saved); {} for a checkpoint without one."""
    path = find_checkpoint(resume) / "nanorl_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


class CtrlC:
    """Ctrl-C: finish the step, save, exit. A second Ctrl-C raises KeyboardInterrupt at once."""

    def __init__(self):
        self.stop, self.old = False, None
        self.active = threading.current_thread() is threading.main_thread()  # signals need it

    def __enter__(self):
        if self.active:
            self.old = signal.signal(signal.SIGINT, self.handler)
        return self

    def __exit__(self, *exc):
        if self.active:
            signal.signal(signal.SIGINT, self.old)

    def handler(self, signum, frame):
        if self.stop:  # one line: train.cli prints it, not a traceback
            raise KeyboardInterrupt("Ctrl-C twice: stopped at once, this step unsaved; the last checkpoint is intact "
                                    "(--resume continues from it)")
        self.stop = True
        print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)", flush=True)


def save_run(run, state, out_dir, write_policy):
    """train.py's checkpoint: write_policy(folder, weights) writes the policy's files (train.py: the
    model, or LoRA's adapter, and the critic; weights: FSDP2's gathered state dict, else None), then a
    moved KL reference and the trainer state. Every rank takes part (FSDP2 gathers full tensors); rank
    0 writes."""
    args, world, weights = run.args, run.world, _full_weights(run)
    ts = {"optimizer": optimizer_state(run.optimizer, world.main), "scheduler": run.scheduler.state_dict(),
          "state": state, "rng": rng_state(), "rng_ranks": world.gather([rng_state()]),
          "critic_optimizer": run.critic_optimizer and run.critic_optimizer.state_dict()}

    def write(d):
        write_policy(d, weights)
        if args.ref_update_every and state["step"] >= args.ref_update_every:
            run.ref_model.save_pretrained(Path(d) / "reference")
    if world.main:
        try:
            print(f"saved {save_checkpoint(out_dir, state['step'], write, run.tokenizer, ts, vars(args))}")
        except OSError as e:  # a full disk, most often: the policy alone is far smaller (no AdamW moments)
            raise OSError(f"{e}; {_policy_alone(run, out_dir, state['step'], write_policy, weights)}") from e
    world.barrier()  # no rank runs ahead of a checkpoint being written


def _policy_alone(run, out_dir, step, write_policy, weights):
    """A checkpoint that failed to write falls back to OUT/policy: the policy's files and the tokenizer
    (from_pretrained, vLLM and eval.py load it; no optimizer state, so --resume cannot continue it), so
    that the run's training is not lost with it. -> a clause saying where it went, or that it failed too."""
    folder = Path(out_dir) / "policy"
    try:
        _policy_folder(run, folder, write_policy, weights, "step.json", {"step": step}, "the policy alone",
                       "nothing of it is left")
    except OSError as e:
        return f"the policy alone did not fit either ({e})"
    return f"the policy alone at step {step} is in {folder} (it loads; without the optimizer state it does not resume)"


def save_best(run, out_dir, write_policy, info):
    """OUT/best: the policy's files (write_policy's, as save_run writes them) and the tokenizer, a folder
    that eval.py, vLLM and from_pretrained load; info (its step and score) in best.json. Replaced as a
    checkpoint is (_replace_folder); a crash between its two renames leaves .old-best-PID, the one before."""
    weights = _full_weights(run)
    if run.world.main:
        best = Path(out_dir) / "best"
        _policy_folder(run, best, write_policy, weights, "best.json", info, "the best policy", "the best so far is intact")
        print(f"best so far {json.dumps(info)}: saved {best}")
    run.world.barrier()


def _policy_folder(run, final, write_policy, weights, note, info, what, kept):
    """final: the policy's files (write_policy's), the tokenizer and info in the json file note, written beside
    and swapped in (_replace_folder; what and kept name it in its error)."""
    def write(tmp):
        write_policy(tmp, weights)
        run.tokenizer.save_pretrained(tmp)
        (tmp / note).write_text(json.dumps(info) + "\n")
    _replace_folder(final, write, what, kept)


def _full_weights(run):
    """FSDP2's full state dict, gathered by every rank (rank 0 keeps it); None unsharded (the model's own)."""
    return full_state_dict(run.model, run.world.main) if run.args.shard == "fsdp" and run.world.size > 1 else None


def check_not_complete(step, args):
    """--resume of a run already at --steps: an error that says so and how to go on, not a silent no-op."""
    if step is not None and step >= args.steps:
        raise ValueError(f"--resume {args.resume}: the run is complete at step {step} (--steps {args.steps}): "
                         f"pass a larger --steps to train further, e.g. --steps {step + args.steps}")


def resume_point(args):
    """The checkpoint --resume names (None: a new run). A finished run, or an --out-dir that holds
    another run, is an error before any model loads."""
    out_dir = Path(args.out_dir)
    ckpt = find_checkpoint(args.resume) if args.resume else None
    if ckpt is not None:  # a finished run says so before any model loads (step_NNNNNN's number)
        check_not_complete(checkpoint_step(ckpt), args)
    if not (ckpt is not None and out_dir.resolve() in ckpt.resolve().parents) and \
            ((out_dir / "metrics.jsonl").exists() or (out_dir / "ckpt").exists()):
        raise FileExistsError(f"--out-dir {out_dir} already holds a run: continue it with --resume {out_dir}, "
                              "or pick a new --out-dir (a second run never mixes with the first)")
    return ckpt
