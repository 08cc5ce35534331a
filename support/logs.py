"""
What a training run writes besides checkpoints: one console line a step, OUT/metrics.jsonl (every
metric of every step; TensorBoard under OUT/tb and W&B only when asked), OUT/samples.jsonl (a few
episodes a step as readable text) and OUT/curves.png (train reward, eval pass@1 and entropy by step).
PhaseReport: peak GPU memory and seconds per phase of a step, logged every step, memory printed
as a table at the end of a run (see its docstring for what each figure counts). Means: the
token-weighted loss statistics of a step, accumulated without a host sync per micro-batch.
train.py calls these; nothing here decides anything about training. episode_metrics turns a
step's episodes into the reward, length, finish-reason and tool-use metrics (the tool-call parse
rate also per family: tool_parse_rate/<info["tool_format"]>; repeated calls and partial credit per
episode). Guard: a failure in any of this output (a full disk, a plot library, the viewer) is one
warning line, the first time it happens, and training goes on: hours of training are worth more
than a plot.

Test: python -m pytest -q tests/test_train.py   (metrics, samples and the plot of short runs)
"""
import contextlib
import json
import time
from pathlib import Path

import torch


class Logger:
    """metrics.jsonl always; TensorBoard / W&B only when asked (imported then)."""

    def __init__(self, out_dir, config, tensorboard=False, wandb_project=None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.tb = self.wb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("--tensorboard needs `pip install tensorboard`") from e
            self.tb = SummaryWriter(str(Path(out_dir) / "tb"))
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("--wandb needs `pip install wandb`") from e
            self.wb = wandb.init(project=wandb_project, config=config, resume="allow")

    def log(self, step, metrics):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics, "time": round(time.time(), 3)}) + "\n")  # unix seconds
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                if self.tb is not None:
                    self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def log_samples(path, step, episodes, tokenizer, k):
    """Append k episodes (one per group, the first k groups) as readable text to samples.jsonl:
    what the model actually wrote is the first thing to look at when a reward stays flat."""
    firsts = {}
    for e in episodes:
        firsts.setdefault(e.group, e)
    with open(path, "a") as f:
        for e in list(firsts.values())[:k]:
            info = {key: v for key, v in e.info.items() if isinstance(v, (int, float, str, bool))}
            f.write(json.dumps({"step": step, "group": e.group, "reward": e.reward, "finish": e.finish_reason,
                                "prompt_tail": tokenizer.decode(e.prompt_ids[-200:]),
                                "response": tokenizer.decode(e.response_ids), "info": info}) + "\n")


def write_plot(out_dir):
    """OUT/curves.png, read back from metrics.jsonl: train reward and eval pass@1 against step (left),
    the policy's entropy against step (right); titled with the run folder's name and, if
    OUT/config.json is there, its env and model. A missing metric leaves its curve out."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    out_dir = Path(out_dir)
    by_step = {}
    for line in open(out_dir / "metrics.jsonl"):
        m = json.loads(line)
        by_step.setdefault(m["step"], {}).update(m)  # a resumed run may rewrite a step: keep the last
    steps = sorted(by_step)

    def series(key):  # (step, value) of the steps that logged key
        return [(s, by_step[s][key]) for s in steps if key in by_step[s]]
    title = out_dir.resolve().name
    if (out_dir / "config.json").is_file():
        cfg = json.loads((out_dir / "config.json").read_text())
        what = [f"{k} {cfg[k]}" for k in ("env", "model") if cfg.get(k)]
        title += f": {', '.join(what)}" if what else ""
    fig, (ax, ent) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style, label in (("reward_mean", "-", "train reward (mean)"),
                              ("eval_pass1", "o-", "eval pass@1 (greedy)")):
        if series(key):
            ax.plot(*zip(*series(key)), style, label=label)
    if series("entropy"):  # train.py: mean over the step's response tokens, at the sampling temperature
        ent.plot(*zip(*series("entropy")), color="tab:green", label="entropy")
    ax.set(xlabel="step", ylabel="reward / pass@1", title="train reward, held-out pass@1")
    ent.set(xlabel="step", ylabel="entropy (nats/token)", title="policy entropy")
    for a in (ax, ent):
        if a.lines:
            a.legend()
        a.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=100)
    plt.close(fig)


def console_line(step, m):
    """A step's line: the metrics most runs watch, those the step has (--algo gae: the critic's seconds,
    its values and its update, beside train's policy phases)."""
    keys = [("reward_mean", "reward", "{:.3f}"), ("correct", "acc", "{:.2f}"), ("eval_pass1", "eval@1", "{:.3f}"),
            ("loss", "loss", "{:+.4f}"), ("kl", "kl", "{:.4f}"), ("clip_frac", "clip", "{:.3f}"),
            ("entropy", "ent", "{:.3f}"), ("grad_norm", "gnorm", "{:.3f}"), ("response_tokens", "len", "{:.0f}"),
            ("finish_length", "trunc", "{:.2f}"), ("time_rollout_s", "gen", "{:.1f}s"),
            ("time_train_s", "train", "{:.1f}s"), ("time_critic_s", "critic", "{:.1f}s"), ("sync_ms", "sync", "{:.0f}ms"),
            ("dlogp_mean", "dlogp", "{:.3f}"), ("tool_calls", "calls", "{:.2f}"),
            ("tool_parse_rate", "parsed", "{:.2f}"), ("env_time_frac", "env", "{:.2f}"),
            ("step_time_s", "step", "{:.1f}s")]
    parts = [f"step {step}"] + [f"{name} {fmt.format(m[k])}" for k, name, fmt in keys if k in m]
    if m.get("skipped_updates"):
        parts.append(f"skipped {m['skipped_updates']}")
    return " | ".join(parts)


def episode_metrics(sampled, n_kept, rounds):
    """Metrics over everything sampled this step (dynamic sampling's filter only shows in kept_frac:
    n_kept of them are trained on), less --rescue's guided replays (info["hint_for"]): they would lift
    reward_mean with the answers the hints gave (their own figures: the rescue_* metrics)."""
    sampled = [e for e in sampled if "hint_for" not in e.info] or sampled
    m = {"episodes": n_kept, "gen_rounds": rounds, "kept_frac": n_kept / max(len(sampled), 1)}
    r = [e.reward for e in sampled]
    m["reward_mean"] = sum(r) / len(r)
    m["reward_std"] = float(torch.tensor(r).std()) if len(r) > 1 else 0.0
    m["correct"] = sum(e.passed() for e in sampled) / len(sampled)
    sources = sorted({e.info["source"] for e in sampled if isinstance(e.info.get("source"), str)})
    if len(sources) > 1:  # rows of several data_sources (the MCP families): when each is first solved unguided
        for src in sources:
            of = [e for e in sampled if e.info.get("source") == src]
            m[f"correct/{src}"] = sum(e.passed() for e in of) / len(of)
    m["response_tokens"] = sum(sum(e.response_mask) for e in sampled) / len(sampled)
    m["turns"] = sum(e.info.get("turns", 1) for e in sampled) / len(sampled)
    for reason in ("stop", "length", "max_turns", "error"):
        m[f"finish_{reason}"] = sum(e.finish_reason == reason for e in sampled) / len(sampled)
    if any("tool_calls" in e.info for e in sampled):  # MCP episodes count their tool use
        calls = sum(e.info.get("tool_calls", 0) for e in sampled)
        bad = sum(e.info.get("parse_errors", 0) for e in sampled)
        m["tool_calls"] = calls / len(sampled)
        doubled = sum(e.info.get("doubled_braces", 0) for e in sampled)
        if calls + bad:  # share of <tool_call> blocks that parsed into a valid call, and the strict parser's share
            m["tool_parse_rate"] = calls / (calls + bad)
            m["tool_parse_rate_strict"] = max(calls - doubled, 0) / (calls + bad)  # mcp_tools/env.doubled_braces
        for fmt in dict.fromkeys(e.info["tool_format"] for e in sampled if isinstance(e.info.get("tool_format"), str)):
            of = [e for e in sampled if e.info.get("tool_format") == fmt]  # one family's parser (mcp_tools/formats.py)
            c, b = sum(e.info.get("tool_calls", 0) for e in of), sum(e.info.get("parse_errors", 0) for e in of)
            if c + b:
                m[f"tool_parse_rate/{fmt}"] = c / (c + b)
        errors = sum(e.info.get("tool_errors", 0) for e in sampled)
        m["tool_errors"] = errors / len(sampled)
        if calls:  # failed calls per call: flat while tool_errors rises means more calls, not worse ones
            m["tool_errors_per_call"] = errors / calls
        m["tool_timeouts"] = sum(e.info.get("timeouts", 0) for e in sampled) / len(sampled)
        if any("repeat_calls" in e.info for e in sampled):  # episodes that count them (mcp_tools/env.py)
            # calls identical to an earlier call of the episode, and to an earlier failed one (a policy
            # that recovers tries something else after a failure: repeat_failed falls)
            m["repeat_calls"] = sum(e.info.get("repeat_calls", 0) for e in sampled) / len(sampled)
            m["repeat_failed"] = sum(e.info.get("repeat_failed", 0) for e in sampled) / len(sampled)
            m["stale_repeats"] = sum(e.info.get("stale_repeats", 0) for e in sampled) / len(sampled)  # same result again
        if any("invented_calls" in e.info for e in sampled):  # calls passing a number or date never shown (rewards.invented)
            m["invented_calls"] = sum(e.info.get("invented_calls", 0) for e in sampled) / len(sampled)
        if any("error_answer" in e.info for e in sampled):  # wrong answers that speak of an error (charged give-ups)
            m["error_answers"] = sum(e.info.get("error_answer", 0) for e in sampled) / len(sampled)
        if any("unfounded_answer" in e.info for e in sampled):  # other wrong answers no result showed (charged guesses)
            m["unfounded_answers"] = sum(e.info.get("unfounded_answer", 0) for e in sampled) / len(sampled)
        m["tool_time_s"] = sum(e.info.get("tool_time_s", 0.0) for e in sampled)  # summed over concurrent calls
    if any("credit" in e.info for e in sampled):  # MCPEnv(partial_credit=w): what wrong answers got for their calls
        m["credit"] = sum(e.info.get("credit", 0.0) for e in sampled) / len(sampled)
    talks = [e for e in sampled if e.info.get("user_turns", 1) > 1]  # conversations (MCPEnv, Conversations)
    if talks:  # the share of user turns the model finished with a reply, and (BFCL) that passed
        turns = sum(e.info["user_turns"] for e in talks)
        m["user_turns_done"] = sum(e.info.get("user_turns_done", 0) for e in talks) / turns
        if any("turns_passed" in e.info for e in talks):
            m["turns_passed"] = sum(e.info.get("turns_passed", 0) for e in talks) / turns
    return m


class Guard:
    """`with guard("the plot (curves.png)"): ...` turns an exception inside into one warning line
    (its type and message), the first time per name, and the run goes on. Exception only: a second
    Ctrl-C (KeyboardInterrupt) still stops the run."""

    def __init__(self):
        self.failed = set()

    @contextlib.contextmanager
    def __call__(self, what):
        try:
            yield
        except Exception as e:
            if what not in self.failed:
                self.failed.add(what)
                msg = " ".join(str(e).split())  # one line, whatever the exception says
                print(f"WARNING: {what} failed ({type(e).__name__}: {msg[:300]}); training goes on without it "
                      "(reported once)", flush=True)


class Means:
    """Weighted means of named scalars over micro-batches or updates; tensors stay on their device
    until means() (one host sync per step, not one per micro-batch)."""

    def __init__(self):
        self.sums, self.weights = {}, {}

    def add(self, values, weight=1.0):
        for k, v in values.items():
            v = v.detach() if torch.is_tensor(v) else v
            self.sums[k] = self.sums.get(k, 0.0) + v * weight
            self.weights[k] = self.weights.get(k, 0.0) + weight

    def means(self):
        return {k: float(self.sums[k] / self.weights[k]) for k in self.sums if float(self.weights[k]) > 0}


class PhaseReport:
    """Peak GPU memory and time per phase: `with phases("forward"): ...` around each phase of a step.

    trainer GiB: torch.cuda.max_memory_allocated() inside the phase minus `engine_pool`, the bytes
      vLLM's sleep-mode pool holds in torch's accounting (they stay "allocated" while vLLM sleeps,
      unmapped, so without this every phase would look as big as the engine's pool).
    process GiB: the device's used memory (cudaMemGetInfo) at the end of the phase minus what was
      used before this process loaded anything: the trainer's allocator (reserved, not just
      allocated), vLLM's pool while awake and the CUDA context; another process's changes would
      show too. Both are maxima over the run.
    seconds: wall time inside the phase, summed over the step (step_times() reads and resets it);
      on a GPU each phase ends with a device sync, so the GPU work lands in the phase that queued it.
    On the CPU only the seconds are kept."""

    def __init__(self):
        self.on = torch.cuda.is_available()
        self.base = self._used() if self.on else 0
        self.engine_pool = 0
        self.trainer, self.process, self.seconds = {}, {}, {}

    def _used(self):
        free, total = torch.cuda.mem_get_info()
        return total - free

    @contextlib.contextmanager
    def __call__(self, phase):
        if self.on:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.on:
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - self.engine_pool) / 2**30
                self.trainer[phase] = max(self.trainer.get(phase, 0.0), peak)
                self.process[phase] = max(self.process.get(phase, 0.0), (self._used() - self.base) / 2**30)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def step_times(self):
        times, self.seconds = {f"time_{k}_s": v for k, v in self.seconds.items()}, {}
        return times

    def metrics(self):
        return {**{f"mem_{k}_gb": v for k, v in self.trainer.items()},
                **{f"mem_process_{k}_gb": v for k, v in self.process.items()}}

    def table(self):
        rows = "\n".join(f"| {k} | {self.trainer[k]:.1f} | {self.process[k]:.1f} |" for k in self.trainer)
        return ("peak GPU memory per phase, GiB (trainer: torch's peak allocated without vLLM's pool; "
                "process: device memory used by this run at the phase's end)\n"
                "| phase | trainer | process |\n|---|---|---|\n" + rows)


def tally(episodes) -> list:
    """[episodes passed, reward sum, episodes]: sums, so torchrun's ranks add theirs up
    (train.evaluate); greedy pass@1 = passed / episodes there and in eval.py."""
    return [sum(e.passed() for e in episodes), sum(e.reward for e in episodes), len(episodes)]


def step_metrics(phases, timing, sampled, n_kept, rounds, lr, skipped, t_step, train_phases):
    """A step's time, memory and episode metrics, beside what its update measured. timing: the
    rollout's own seconds (env_s, generate_s); train_phases: the phases time_train_s sums."""
    m = {**phases.step_times(), **episode_metrics(sampled, n_kept, rounds), "lr": lr, "skipped_updates": skipped}
    m["episodes_per_s"] = len(sampled) / m["time_rollout_s"]
    m["env_time_frac"] = timing.get("env_s", 0.0) / m["time_rollout_s"]
    m["rollout_generate_s"] = timing.get("generate_s", 0.0)  # of time_rollout_s: in engine.generate
    m["time_train_s"] = sum(m.get(f"time_{k}_s", 0.0) for k in train_phases)
    m.update(phases.metrics())
    m["step_time_s"] = time.perf_counter() - t_step
    m["time_host_s"] = m["step_time_s"] - sum(v for k, v in m.items() if k.startswith("time_") and k != "time_train_s")
    return m


SAMPLES_PER_STEP = 2  # episodes a step written to samples.jsonl (the viewer's page shows whole groups)


class RunLog:
    """Rank 0's record of a run in OUT: config.json, metrics.jsonl (+ TensorBoard, W&B), samples.jsonl,
    the viewer's episodes.html, the console line and curves.png. The folder is made only now, so bad
    data, flags or models leave none behind. A failure in any output is one warning line (Guard) and
    training goes on. Other ranks (main=False) print the console line only (to nowhere)."""

    def __init__(self, args, out_dir, main, guard):
        from support import viewer  # the viewer's page; imported here, as only a run writes one
        self.args, self.out_dir, self.main, self.guard, self.viewer = args, Path(out_dir), main, guard, viewer
        self.logger = self.page = None
        if main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(json.dumps(vars(args), indent=1, sort_keys=True))
            self.logger = Logger(self.out_dir, vars(args), args.tensorboard, args.wandb)
            if args.viewer_groups:
                with guard("the viewer (episodes.html)"):
                    self.page = viewer.Page(self.out_dir / "episodes.jsonl", self.out_dir / "episodes.html")

    def step(self, n, metrics, sampled=None, tokenizer=None, samples=SAMPLES_PER_STEP):
        """Step n's record (n = 0 with no episodes: the eval before training)."""
        guard = self.guard
        if self.main:
            with guard("logging (metrics.jsonl, TensorBoard, W&B)"):
                self.logger.log(n, metrics)
        if self.main and sampled:
            with guard("samples.jsonl"):
                log_samples(self.out_dir / "samples.jsonl", n, sampled, tokenizer, samples)
            if self.page is not None:  # this step's first groups, as a person reads them
                with guard("the viewer (episodes.html)"):  # advantage None: not trained on (dynamic sampling)
                    self.page.add(self.viewer.episode_records(n, sampled, tokenizer, [e.info.get("advantage") for e in sampled],
                                                              self.args.viewer_groups))
                    self.page.write()  # at most every 30 s (and at the end); episodes.jsonl gets every step
        with guard("the console line"):
            print(console_line(n, metrics), flush=True)
        if self.main and n and "eval_pass1" in metrics:
            with guard("the plot (curves.png)"):
                write_plot(self.out_dir)

    def finish(self):
        """The viewer's last page (the steps its 30 s throttle held back) and the final plot."""
        if self.page is not None:
            with self.guard("the viewer (episodes.html)"):
                self.page.write(force=True)
        if self.main and (self.out_dir / "metrics.jsonl").exists():
            with self.guard("the plot (curves.png)"):
                write_plot(self.out_dir)

    def close(self):
        if self.logger is not None:
            self.logger.close()
