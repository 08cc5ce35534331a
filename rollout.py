r"""Rollouts: the Episode record, the engine and env interfaces, a plain-transformers engine, the
episode loop, and the one function that pads episodes into tensors.

An *episode* is one conversation between the policy and an environment:

    prompt_ids | a_1 (sampled) | o_1 (env) | a_2 (sampled) | o_2 (env) | ... | a_K (sampled)
               |<------------------------ response_ids ----------------------------->|
    response_mask:   1 ... 1       0 ... 0      1 ... 1        0 ... 0         1 ... 1

Only tokens the policy sampled carry mask 1, and they are kept *as sampled* (token ids, never
re-rendered text), together with the logprob the engine sampled them with. Environment
observations (tool results, feedback) are rendered with the chat template and carry mask 0.
The episode's reward is the sum of the rewards env.step returned over its turns.

Logprob convention (shared with grpo.py and the vLLM engine): the logprob of the sampled token
under softmax(logits / temperature), with no top-p/top-k renormalisation. RL runs use top_p = 1,
so this *is* the sampling distribution. temperature == 0 means greedy; then we report the
logprob under softmax(logits) (temperature 1), which is only used for logging.

Finish reasons
    stop       the env said done after a turn that ended on a stop/EOS token
    length     the context limit (or the per-turn max_tokens) cut a turn, or the next
               observation would not fit: never a silent cut
    max_turns  the env was still not done after max_turns policy turns
    error      env.reset or env.step raised (e.g. mcp_pool.ServerFailed: a server that cannot be
               reached); reward 0 for the turn, the error as one line in info["error"]. A failed
               reset leaves an empty response under the row's own prompt (info["turns"] 0).
               The other episodes go on; env.close raising is one warning line per call.

The loop (run_episodes) first resets every episode's env, concurrently in its thread pool (an
MCP reset opens a server session), then runs in rounds. A round sends every *ready* episode's context to the
engine as one batch, then submits each of those episodes' env.step to a thread pool as its own
future (MCP tool calls are slow and mostly waiting). It then waits up to straggler_wait_s for that
round's steps: the episodes whose step finished (plus any earlier straggler that finished
meanwhile) form the next round's batch, in episode order; a step still running stays *pending*
and its episode joins whichever later round starts after it finishes. With nothing ready and
something pending the loop blocks until the first pending step finishes. So one hanging tool call
(30 s to an MCP timeout) delays its own episode, not the whole batch's next turn. When every step
finishes within the grace (the common case) the rounds are exactly the old lockstep ones: same
batches, same order; straggler_wait_s=None restores lockstep always. Cost of the grace: a round
with a straggler waits the full straggler_wait_s before generating without it; a hung step also
holds one of the max_workers pool threads (with more hung steps than threads, new steps queue).
When stragglers change a batch, a sampling engine draws its random numbers over a different
batch, so the tokens differ from a lockstep run's (equally valid samples; greedy is unchanged).
Budgets: each turn may sample at most min(max_tokens, max_context - len(context)) tokens.

Observation tokens, and the chat-template wart. The model's turn ends with its stop token (e.g.
ChatML "<|im_end|>"), but the template renders an assistant turn as "...<|im_end|>\n": the "\n"
(the *glue*) was never sampled. We render the observation as a *delta* against a fixed dummy
conversation:

    prefix = template([user DUMMY_U, assistant DUMMY_A], tools)
    full   = template([user DUMMY_U, assistant DUMMY_A] + obs, tools, add_generation_prompt=True)
    after  = prefix[end of DUMMY_A:]                 # e.g. "<|im_end|>\n"
    glue   = after minus the decoded stop token       # e.g. "\n"
    obs_ids = encode(glue + full[len(prefix):])      # "\n<|im_start|>user\n...<|im_start|>assistant\n"

A fixed dummy (not the real history) keeps this O(1) per turn and robust to templates that
rewrite earlier turns (e.g. Qwen3 dropping old <think> blocks, which would break a prefix
match). If the model stopped on a token the template does not render after a turn, glue = after
(the template's end-of-turn text is inserted, mask 0). Prompts are rendered with
apply_chat_template(..., tokenize=False) and encoded with add_special_tokens=False: templates
already contain their BOS, and transformers 5 changed what tokenize=True returns.
When tools are shown, the delta is rendered with tools=None if a one-time probe per (tokenizer,
tools, observation roles) finds the same text that way (templates that show tools only in the
system turn, as Qwen2.5's and ours do): the ~20-tool block is then not rendered twice per turn.

Engines. `Engine` is the interface; `HFEngine` is a plain transformers sampling loop with a KV
cache over a left-padded batch (CPU or GPU); it can share the trainer's model object, so
load_weights is free. `VLLMEngine` (GPU, vLLM in this process) is in vllm_engine.py. The stop
token is *included* in Completion.token_ids (with its logprob): the policy learns to stop.

Test: python -m pytest -q tests/test_rollout.py
"""
import math
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

import models


@dataclass
class Completion:
    """What an engine returns for one sample."""
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each sampled token under softmax(logits / temperature);
                                  # None when the caller asked for logprobs=False and the engine skipped them
    finish_reason: str     # "stop" (a stop/EOS token was sampled, and is included) | "length"


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1 = sampled by the policy, 0 = env/tool tokens
    logprobs: list[float]     # sampled logprob per response token, 0.0 where the mask is 0,
                              # NaN where the engine was not asked for them (logprobs=False)
    reward: float
    finish_reason: str        # stop | length | max_turns | error
    group: int                # the prompt's group id (run_episodes' group_ids): its n episodes share it
    info: dict = field(default_factory=dict)


class Engine:
    """The interface every rollout engine implements (HFEngine here, VLLMEngine in vllm_engine.py)."""

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, stop_token_ids: list[int] | None = None,
                 logprobs: bool = True) -> list[list[Completion]]:
        """One list of n Completions per prompt. temperature == 0 -> greedy.
        logprobs=False: the caller does not need them; an engine may then return None (vLLM
        saves 25-45 % of its throughput that way, lab/bench.py)."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Free engine memory while the trainer runs (no-op unless the engine holds a GPU pool)."""

    def wake(self) -> None:
        """Undo sleep() before the next rollout."""

    def load_weights(self, model: torch.nn.Module) -> dict:
        """Push the trainer's current weights into the engine; returns stats for the log."""
        raise NotImplementedError


class Env:
    """The environment interface the episode loop drives (envs.py and mcp_env.py implement it).

    One instance is one episode: reset(row) returns the prompt messages, step(text) takes the
    assistant's reply and returns (observation messages, reward, done, info). A fresh Env per
    episode, so per-episode state is safe; resets and steps of different episodes run in worker
    threads."""
    tools: list[dict] | None = None  # OpenAI-style function schemas shown to the model, None = no tools
    max_turns: int = 1

    def reset(self, row: dict) -> list[dict]:
        raise NotImplementedError

    def step(self, text: str) -> tuple[list[dict], float, bool, dict]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class HFEngine(Engine):
    """Sampling with plain transformers: own loop, KV cache, left-padded batches.

    Why not model.generate(): we need the sampled token's logprob under logits/temperature before
    any top-p warping, exact stop handling per row and no hidden generation_config defaults
    (generate() may apply the checkpoint's top_k/repetition_penalty); the loop is ~40 lines.
    """

    def __init__(self, model, tokenizer, batch_size: int = 64):
        self.model = model
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = _eos_ids(tokenizer, model)
        self.batch_size = batch_size

    def load_weights(self, model):
        if model is self.model:  # shared with the trainer: nothing to copy
            return {"ms": 0.0, "shared": True}
        t0 = time.perf_counter()
        self.model.load_state_dict(model.state_dict())
        return {"ms": 1000 * (time.perf_counter() - t0), "shared": False}

    @torch.no_grad()
    def generate(self, prompts, n, temperature, top_p, max_tokens, stop_token_ids=None, logprobs=True):
        # logprobs are a by-product of our sampling loop here, so they are always returned
        stop = sorted(self.eos_ids | set(stop_token_ids or []))
        flat = [p for p in prompts for _ in range(n)]  # the n samples of a prompt are adjacent
        was_training = self.model.training
        self.model.eval()
        try:
            out = []
            for i in range(0, len(flat), self.batch_size):
                out += self._generate_batch(flat[i:i + self.batch_size], temperature, top_p, max_tokens, stop)
        finally:
            self.model.train(was_training)
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(self, prompts, temperature, top_p, max_tokens, stop):
        if any(len(p) == 0 for p in prompts):
            raise ValueError("HFEngine.generate: empty prompt")
        B, L = len(prompts), max(len(p) for p in prompts)
        dev = next(self.model.parameters()).device
        ids = torch.full((B, L), self.pad_id, dtype=torch.long, device=dev)
        attn = torch.zeros((B, L), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):  # left-pad so every row's next token sits at column -1
            ids[i, L - len(p):] = torch.tensor(p, device=dev)
            attn[i, L - len(p):] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, L) real positions start at 0 in every row
        stop_t = torch.tensor(stop, dtype=torch.long, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        toks, lps = [], []
        cache, x = None, ids
        for _ in range(max_tokens):
            # logits_to_keep=1: only the last position's logits (the full (B, L, V) would dominate memory)
            out = self.model(input_ids=x, attention_mask=attn, position_ids=pos, logits_to_keep=1,
                             **models.with_cache(self.model, cache))
            cache = models.cache_of(out)
            logits = out.logits[:, -1, :].float()  # (B, V)
            if temperature == 0:
                logp = F.log_softmax(logits, dim=-1)
                tok = logp.argmax(-1)  # (B,)
            else:
                logp = F.log_softmax(logits / temperature, dim=-1)  # (B, V) the reported distribution
                tok = torch.multinomial(_top_p_probs(logp.exp(), top_p), 1).squeeze(-1)  # (B,)
            lp = logp.gather(-1, tok[:, None]).squeeze(-1)  # (B,)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            toks.append(tok)
            lps.append(lp)
            done = done | torch.isin(tok, stop_t)
            if bool(done.all()):  # note: a device sync per token; fine at HF speeds
                break
            x = tok[:, None]
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=dev)], dim=1)
            pos = pos[:, -1:] + 1
        toks = torch.stack(toks, 1).tolist() if toks else [[] for _ in range(B)]  # (B, T)
        lps = torch.stack(lps, 1).tolist() if lps else [[] for _ in range(B)]
        stop_set = set(stop)
        res = []
        for i in range(B):
            row, k = toks[i], len(toks[i])
            for j, t in enumerate(row):  # cut after the first stop token (it stays in the output)
                if t in stop_set:
                    k = j + 1
                    break
            reason = "stop" if k > 0 and row[k - 1] in stop_set else "length"
            res.append(Completion(token_ids=row[:k], logprobs=lps[i][:k], finish_reason=reason))
        return res


def _top_p_probs(probs, top_p):
    """Zero out the tail outside the smallest set with mass >= top_p (multinomial renormalises)."""
    if top_p >= 1.0:
        return probs
    p, idx = probs.sort(dim=-1, descending=True)  # (B, V)
    keep = (p.cumsum(-1) - p) < top_p  # the top token is always kept
    return torch.zeros_like(probs).scatter(-1, idx, p * keep)


def _eos_ids(tokenizer, model=None) -> set[int]:
    """The tokenizer's EOS plus the model's generation_config EOS ids (some checkpoints list several)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gc = getattr(model, "generation_config", None)
    e = getattr(gc, "eos_token_id", None)
    if e is not None:
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return ids


# ---- episode loop

DUMMY_U, DUMMY_A = "nanorl-dummy-user-7f3a", "nanorl-dummy-assistant-7f3a"


def render_prompt(tokenizer, messages, tools=None, cache: dict | None = None) -> list[int]:
    """cache: a dict text -> ids shared by calls; it pays because encoding is the cost, not the
    template (~0.4 ms vs ~0.04 ms for a 150-token prompt, smollm2's tokenizer on a CPU core)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    if cache is None:
        return tokenizer.encode(text, add_special_tokens=False)
    if text not in cache:
        cache[text] = tokenizer.encode(text, add_special_tokens=False)
    return list(cache[text])  # a copy: no two episodes share a list


def _dummy_turn(tokenizer, tools=None) -> tuple[list[dict], str, str]:
    """A rendered user + assistant exchange: (messages, text, the text the template puts after the
    assistant's content)."""
    msgs = [{"role": "user", "content": DUMMY_U}, {"role": "assistant", "content": DUMMY_A}]
    text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False)
    return msgs, text, text[text.rindex(DUMMY_A) + len(DUMMY_A):]


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template closes an assistant message with (<|im_end|> in ChatML):
    what a policy samples to end its turn. Not always tokenizer.eos_token_id: SmolLM2 converted
    from its GGUF (transformers 5.17) came out with eos <|im_start|>."""
    ids = tokenizer.encode(_dummy_turn(tokenizer)[2], add_special_tokens=False)
    added = tokenizer.added_tokens_decoder.get(ids[0]) if ids else None  # id -> AddedToken
    return ids[0] if added is not None and added.special else tokenizer.eos_token_id


def stop_token_ids(tokenizer) -> list[int] | None:
    """The engines' stop_token_ids for a turn: [end_of_turn_id] when the tokenizer has a chat template
    (whatever the model calls EOS), else None (the engine's own EOS)."""
    eot = end_of_turn_id(tokenizer) if tokenizer.chat_template else None
    return [eot] if eot is not None else None


def observation_ids(tokenizer, obs_messages, tools=None, last_token_id=None) -> list[int]:
    """Token ids of env messages appended after a sampled turn ending in last_token_id (see module doc)."""
    if tools and _delta_ignores_tools(tokenizer, tools, tuple(m.get("role") for m in obs_messages)):
        tools = None  # same text without rendering the tool block (~1.5 -> ~0.4 ms a call: Qwen2.5, 20 tools)
    after, delta = _observation_delta(tokenizer, obs_messages, tools)
    stop_text = tokenizer.decode([last_token_id]) if last_token_id is not None else ""
    glue = after[len(stop_text):] if stop_text and after.startswith(stop_text) else after
    return tokenizer.encode(glue + delta, add_special_tokens=False)


def _observation_delta(tokenizer, obs_messages, tools) -> tuple[str, str]:
    """(the template's text after the dummy assistant's content, the observation's text: full[len(prefix):])."""
    base, prefix, after = _dummy_turn(tokenizer, tools)
    full = tokenizer.apply_chat_template(base + list(obs_messages), tools=tools,
                                         add_generation_prompt=True, tokenize=False)
    if not full.startswith(prefix):
        raise ValueError("chat template renders the conversation differently once observations are "
                         "appended; cannot compute observation tokens as a delta")
    return after, full[len(prefix):]


_IGNORES_TOOLS = {}  # (id(tokenizer), template, id(tools), roles) -> (tokenizer, tools, verdict);
                     # holding both objects keeps their ids from being reused by others


def _delta_ignores_tools(tokenizer, tools, roles) -> bool:
    """Whether observations with these roles render the same (after, delta) without tools as with
    them: true for templates that show tools only in the system turn (Qwen2.5's, ours). Checked
    once per key on placeholder contents, keyed by the tools list's identity (pool.tools never
    changes); a template that raises on the probe gets False."""
    key = (id(tokenizer), str(tokenizer.chat_template), id(tools), roles)
    if key not in _IGNORES_TOOLS:
        probe = [{"role": r, "content": f"probe-{k}"} for k, r in enumerate(roles)]
        try:
            same = _observation_delta(tokenizer, probe, tools) == _observation_delta(tokenizer, probe, None)
        except Exception:  # noqa: BLE001 -- then the full render decides, as before
            same = False
        _IGNORES_TOOLS[key] = (tokenizer, tools, same)
    return _IGNORES_TOOLS[key][2]


def run_episodes(engine, tokenizer, rows, make_env, n, temperature, top_p, max_tokens, max_turns,
                 max_context, stop_token_ids=None, max_workers=32, progress=False,
                 timing: dict | None = None, logprobs: bool = True,
                 straggler_wait_s: float | None = 0.5, group_ids=None, ignore_eos: bool = False) -> list[Episode]:
    """Play n episodes per row; returns len(rows) * n Episodes, grouped by row, in row order.

    group_ids: the group id of each row's n episodes (Episode.group); default the row's index in
    rows. A caller that plays a share of a larger batch (one rank of several, one resampling
    round of several) passes the ids its groups have in the whole batch.
    make_env(row) -> a fresh Env. max_turns caps the env's own max_turns (None: the env's).
    logprobs=False: the engine may skip the sampled logprobs; Episode.logprobs is then NaN on
    policy tokens, so any use of them shows up instead of silently reading zeros.
    ignore_eos: every turn samples max_tokens tokens, past EOS (an engine whose generate takes it).
    straggler_wait_s: how long a round waits for its env steps before the next generation goes
    ahead without the slow ones (see module doc); None = wait for every step (lockstep rounds).
    timing (optional dict, accumulated): generate_s = wall time in engine.generate, env_s = wall
    time the loop sat blocked waiting on env steps (steps that overlap a generation cost nothing).
    An env whose reset, step or close raises fails its own episode at most (finish_reason
    "error"), never the call; make_env raising (a caller's bug) still raises.
    """
    groups = list(range(len(rows))) if group_ids is None else list(group_ids)
    if len(groups) != len(rows):
        raise ValueError(f"run_episodes: {len(groups)} group_ids for {len(rows)} rows")
    sampling = dict(temperature=temperature, top_p=top_p, stop_token_ids=stop_token_ids, logprobs=logprobs)
    if ignore_eos:  # every turn runs to max_tokens (VLLMEngine only: a memory worst case, train.py --ignore-eos)
        sampling["ignore_eos"] = True
    envs = []  # filled as they are made: the finally closes every env made, even if a reset fails
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(rows) * n))) as pool:
            # ready: the episodes waiting for their next generation, in episode order
            eps, ready = _start_episodes(tokenizer, rows, groups, make_env, n, max_context, envs, pool)
            turn_caps = [min(e.max_turns, max_turns) if max_turns else e.max_turns for e in envs]
            bar = _progress_bar(len(eps), progress)
            bar.update(len(eps) - len(ready))
            cut = {}      # episode -> its last turn was cut by a length limit
            pending = {}  # env.step future -> episode; its episode is in no batch until it finishes
            while ready or pending:
                fresh = []  # this round's env steps
                if ready:
                    texts, cuts = _sample_turn(engine, tokenizer, [eps[i] for i in ready], max_tokens,
                                               max_context, sampling, timing)
                    for i, text, c in zip(ready, texts, cuts):
                        cut[i] = c
                        f = pool.submit(_safe_step, envs[i], text)
                        pending[f] = i
                        fresh.append(f)
                finished = _wait_for_steps(pending, fresh, straggler_wait_s, timing)
                ready = []
                for f in finished:  # in episode order, as in lockstep rounds
                    i = pending.pop(f)
                    if _finish_step(eps[i], envs[i], f.result(), cut[i], turn_caps[i], tokenizer, max_context):
                        ready.append(i)
                bar.update(len(finished) - len(ready))
        bar.close()
    finally:
        # leaving the pool's `with` (also on an exception) waited for every running reset and
        # step, so no env is closed under a call still using it
        _close_all(envs)
    return eps


def _start_episodes(tokenizer, rows, groups, make_env, n, max_context, envs, pool):
    """n fresh envs per row, reset in pool's threads, and their episodes; returns (episodes, the
    indices of those ready for a first turn, in episode order). Appends each env to envs as soon
    as it exists."""
    ep_rows = [row for row in rows for _ in range(n)]  # episode i plays rows[i // n]
    for row in ep_rows:
        envs.append(make_env(row))
    # Concurrent resets: an MCP reset opens a server session and mostly waits on it. 256 of them
    # took ~0.6 s one after another, ~0.4 s in 32 threads (2 CPU cores; then the bundled server's
    # own CPU, ~1.4 ms a reset, is the bound). map keeps episode order.
    started = list(pool.map(_safe_reset, envs, ep_rows))
    # The n episodes of a row nearly always render the same prompt text: encode it once
    # (encoding each of 256 GSM8K prompts cost ~90 ms of host time a step).
    encoded, eps, ready = {}, [], []
    for i, (env, (messages, err)) in enumerate(zip(envs, started)):
        p = render_prompt(tokenizer, messages, env.tools, cache=encoded)
        eps.append(Episode(prompt_ids=p, response_ids=[], response_mask=[], logprobs=[],
                           reward=0.0, finish_reason="", group=groups[i // n], info={"turns": 0}))
        if err is not None:  # failed at reset
            eps[-1].finish_reason, eps[-1].info["error"] = "error", err
        elif len(p) >= max_context:  # the prompt alone fills the context
            eps[-1].finish_reason = "length"
        else:
            ready.append(i)
    return eps, ready


def _sample_turn(engine, tokenizer, batch, max_tokens, max_context, sampling, timing):
    """One generation round: samples a turn for every episode of batch and appends it (mask 1).
    Returns (the turns' texts, whether a length limit cut each turn)."""
    budget = [min(max_tokens, max_context - len(e.prompt_ids) - len(e.response_ids)) for e in batch]
    ctxs = [e.prompt_ids + e.response_ids for e in batch]
    t0 = time.perf_counter()
    outs = engine.generate(ctxs, n=1, max_tokens=max(budget), **sampling)
    _add_time(timing, "generate_s", t0)
    kept = [o[0].token_ids[:b] for o, b in zip(outs, budget)]
    cuts = []
    for e, o, ids, b in zip(batch, outs, kept, budget):
        c = o[0]
        cuts.append(c.finish_reason == "length" or len(c.token_ids) > b)
        e.response_ids += ids
        e.response_mask += [1] * len(ids)
        e.logprobs += c.logprobs[:b] if c.logprobs is not None else [math.nan] * len(ids)
        e.info["turns"] += 1
    # the round's texts in one call to the Rust tokenizer (decode one at a time cost ~0.25 ms
    # each in transformers' Python wrapper: ~65 ms a step at 256 episodes)
    return decode_many(tokenizer, kept), cuts


def _wait_for_steps(pending, fresh, straggler_wait_s, timing):
    """The pending env steps that finished, in episode order: this round's (fresh) get up to
    straggler_wait_s, earlier stragglers are polled; with none finished, block for the first."""
    t0 = time.perf_counter()
    if straggler_wait_s is None:  # lockstep: every step, old stragglers included
        wait(pending)
    elif fresh:
        wait(fresh, timeout=straggler_wait_s)
    finished = [f for f in pending if f.done()]
    if not finished:  # nothing to generate for: block until the first step returns
        finished = list(wait(pending, return_when=FIRST_COMPLETED).done)
    _add_time(timing, "env_s", t0)
    return sorted(finished, key=pending.__getitem__)


def _finish_step(ep, env, result, cut, turn_cap, tokenizer, max_context) -> bool:
    """Fold one env.step result into its episode: either the episode ends (finish_reason set) or
    the observation is appended (mask 0) and it returns True: ready for another turn."""
    obs, reward, done, info, err = result
    if err is not None:
        ep.finish_reason = "error"
        ep.info["error"] = err
        return False
    ep.reward += float(reward)
    ep.info.update(info or {})
    if ep.info.get("error"):  # the env caught its own failure (e.g. a dead MCP server)
        ep.finish_reason = "error"
    elif cut:
        ep.finish_reason = "length"
    elif done:
        ep.finish_reason = "stop"
    elif ep.info["turns"] >= turn_cap:
        ep.finish_reason = "max_turns"
    else:
        last = ep.response_ids[-1] if ep.response_ids else None
        o_ids = observation_ids(tokenizer, obs, env.tools, last)
        # the observation plus at least one sampled token must fit
        if len(ep.prompt_ids) + len(ep.response_ids) + len(o_ids) >= max_context:
            ep.finish_reason = "length"
        else:
            ep.response_ids += o_ids
            ep.response_mask += [0] * len(o_ids)
            ep.logprobs += [0.0] * len(o_ids)
            return True
    return False


def _add_time(timing, key, t0):
    if timing is not None:
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0


def decode_many(tokenizer, seqs):
    """[tokenizer.decode(s, skip_special_tokens=True) for s in seqs], in one batch call to a fast
    tokenizer's Rust backend (parallel, no per-token Python checks). Slow tokenizers, and those that
    clean up spaces after decoding (transformers' own step; Qwen2.5 and SmolLM2 do not), one at a time."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch") or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return [tokenizer.decode(s, skip_special_tokens=True) for s in seqs]
    return backend.decode_batch([list(s) for s in seqs], skip_special_tokens=True)


def _safe_reset(env, row):
    """(env.reset(row), None), or (the row's own prompt, the error line) when reset raises."""
    try:
        return env.reset(row), None
    except Exception as e:  # noqa: BLE001 -- e.g. a server that cannot be reached
        return row.get("prompt") or [], error_line(e)


def _safe_step(env, text):
    # Any exception from a tool/env ends that episode with finish_reason "error", not the run.
    try:
        obs, reward, done, info = env.step(text)
        return obs, reward, done, info, None
    except Exception as e:  # noqa: BLE001 -- env code is user code; record and keep going
        return [], 0.0, True, {}, error_line(e)


def error_line(e: BaseException, limit: int = 500) -> str:
    """'ServerFailed: ...' on one line (newlines folded), at most limit characters."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _close_all(envs):
    """env.close() for every env; one that raises does not keep the others open, and a call
    reports its failed closes in one line (the episodes themselves are complete)."""
    failed = []
    for env in envs:
        try:
            env.close()
        except Exception as e:  # noqa: BLE001 -- env code is user code
            failed.append(error_line(e))
    if failed:
        print(f"warning: env.close raised for {len(failed)} of {len(envs)} episodes; first: {failed[0]}",
              file=sys.stderr)


def _progress_bar(total, enabled):
    from tqdm import tqdm
    return tqdm(total=total, desc="rollout", unit="ep", disable=not enabled, leave=False)


# ---- tensors

def episodes_to_batch(episodes, pad_id) -> dict[str, torch.Tensor]:
    """The one place that pads. Right padding; every tensor is aligned with input_ids columns.

    input_ids      (B, T) long   prompt + response, pad_id after the end
    attention_mask (B, T) long   1 on real tokens
    loss_mask      (B, T) float  1 where input_ids[:, t] was sampled by the policy
    logprobs       (B, T) float  rollout logprob of input_ids[:, t] where loss_mask is 1, else 0
                                 (NaN where the engine was not asked for logprobs)
    rewards        (B,)   float
    groups         (B,)   long
    Token t is predicted by logits[:, t - 1]; grpo.token_logprobs does that shift.
    """
    # Vectorized: one flat list per field for the whole batch, then a boolean-mask put, whose
    # row-major order is the concatenation order. The per-episode torch.tensor calls and slice
    # assignments this replaces cost ~35-75 ms of host time a step for 256 GSM8K episodes (now
    # ~12 ms, most of it turning Python lists into arrays). numpy, not torch: torch.tensor(list)
    # is ~5x slower, and torch's elementwise ops go multi-threaded at this size, which cost ~6 ms
    # an op on a busy CPU (2 cores, measured); numpy stays on this thread.
    ids, mask, lps = [], [], []
    for i, e in enumerate(episodes):
        R = len(e.response_ids)
        if not (len(e.response_mask) == len(e.logprobs) == R):
            raise ValueError(f"episode {i}: response_ids/response_mask/logprobs lengths differ "
                             f"({R}, {len(e.response_mask)}, {len(e.logprobs)})")
        ids += e.prompt_ids
        ids += e.response_ids
        mask += e.response_mask
        lps += e.logprobs
    B, T = len(episodes), max(len(e.prompt_ids) + len(e.response_ids) for e in episodes)
    P = np.array([len(e.prompt_ids) for e in episodes])[:, None]  # (B, 1)
    end = P + np.array([len(e.response_ids) for e in episodes])[:, None]  # (B, 1) P + R
    col = np.arange(T)[None, :]  # (1, T)
    real = col < end  # (B, T) prompt + response
    resp = real & (col >= P)  # (B, T) response only
    input_ids = np.full((B, T), pad_id, dtype=np.int64)
    input_ids[real] = np.array(ids, dtype=np.int64)
    m = np.array(mask, dtype=np.float32)  # (N_response,)
    lp = np.array(lps, dtype=np.float32)  # (N_response,)
    loss_mask = np.zeros((B, T), dtype=np.float32)
    loss_mask[resp] = m
    logprobs = np.zeros((B, T), dtype=np.float32)
    logprobs[resp] = np.where(m > 0, lp, np.zeros_like(lp))
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    groups = torch.tensor([e.group for e in episodes], dtype=torch.long)
    return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(real.astype(np.int64)),
            "loss_mask": torch.from_numpy(loss_mask), "logprobs": torch.from_numpy(logprobs),
            "rewards": rewards, "groups": groups}
