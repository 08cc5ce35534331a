r"""Rollouts: Episode, the Engine and Env interfaces, HFEngine, the episode loop, episodes_to_batch.

An *episode* is one conversation between the policy and an environment:

    prompt_ids | a_1 (sampled) | o_1 (env) | a_2 (sampled) | o_2 (env) | ... | a_K (sampled)
               |<------------------------ response_ids ----------------------------->|
    response_mask:   1 ... 1       0 ... 0      1 ... 1        0 ... 0         1 ... 1

Sampled tokens keep their ids (never re-rendered text; the stop token included: the policy learns
to stop) and logprob under log softmax(logits / temperature), no top-p/top-k renormalisation (as
grpo.py and vLLM; greedy: log softmax(logits), for logging). Reward = sum of env.step rewards.
Finish reasons: stop (env done), length (a context or per-turn limit cut a turn, or the next
observation would not fit: never a silent cut), max_turns, error (reset/step raised; info["error"]).

run_episodes batches every *ready* episode's context into one engine call and runs env steps in a
thread pool, a round waiting up to straggler_wait_s: one hanging tool call delays only its episode.

Observations (mask 0) are rendered as a delta after a fixed dummy exchange (O(1) per turn; robust to
templates that rewrite earlier turns, e.g. Qwen3 dropping old <think> blocks), plus the *glue*: a
turn ends on its sampled stop token "<|im_end|>", but the template renders "<|im_end|>\n":

    prefix  = template([user DUMMY_U, assistant DUMMY_A], tools)
    full    = template([user DUMMY_U, assistant DUMMY_A] + obs, tools, add_generation_prompt=True)
    glue    = prefix[end of DUMMY_A:] minus the decoded stop token     # e.g. "\n", never sampled
    obs_ids = encode(glue + full[len(prefix):])     # "\n<|im_start|>user\n...<|im_start|>assistant\n"

Test: python -m pytest -q tests/test_rollout.py
"""
import functools
import inspect
import math
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Completion:
    """What an engine returns for one sample."""
    token_ids: list[int]
    logprobs: list[float] | None  # per sampled token (module doc); None if logprobs=False and skipped
    finish_reason: str     # "stop" (a stop/EOS token was sampled, and is included) | "length"


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1 = sampled by the policy, 0 = env/tool tokens
    logprobs: list[float]     # sampled logprob per response token; 0.0 where mask is 0; NaN if logprobs=False
    reward: float
    finish_reason: str        # stop | length | max_turns | error
    group: int                # the prompt's group id, shared by its n episodes
    info: dict = field(default_factory=dict)

    def passed(self) -> bool:
        """The env's verdict on the answer (info["correct"]); a format reward alone is no pass."""
        return bool(self.info.get("correct"))

    def longest_turn(self) -> int:
        """Tokens of the longest policy turn (a run of mask-1 tokens): what --max-tokens caps."""
        return max((len(run) for run in "".join(map(str, self.response_mask)).split("0")), default=0)


class Engine:
    """The interface every rollout engine implements (HFEngine here, VLLMEngine in vllm_engine.py)."""

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_tokens: int,
                 stop_token_ids: list[int] | None = None, logprobs: bool = True) -> list[list[Completion]]:
        """n Completions per prompt; temperature 0 = greedy; logprobs=False lets an engine skip them."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Free engine memory while the trainer runs (no-op unless the engine holds a GPU pool)."""

    def wake(self) -> None:
        """Undo sleep() before the next rollout."""

    def load_weights(self, model: torch.nn.Module) -> dict:
        """Push the trainer's current weights into the engine; returns stats for the log."""
        raise NotImplementedError


class Env:
    """One instance is one episode: reset(row) -> prompt messages, step(text) -> (observation messages,
    reward, done, info). Different episodes' calls run in worker threads (envs.py, mcp_tools/env.py)."""
    tools: list[dict] | None = None  # OpenAI-style function schemas shown to the model, None = no tools
    max_turns: int = 1
    keep_special: tuple = ()  # special-token texts step() must see (e.g. Mistral's [TOOL_CALLS]); decode_many

    def reset(self, row: dict) -> list[dict]:
        raise NotImplementedError

    def step(self, text: str) -> tuple[list[dict], float, bool, dict]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def with_cache(model, cache):
    """Forward kwargs passing a KV cache (None: new); transformers 5.24 renamed past_key_values to cache."""
    return {_cache_name(type(model)): cache, "use_cache": True}


@functools.cache
def _cache_name(cls):  # once per model class: the HF engine asks at every token
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_of(out):
    """The KV cache a forward returned, under either name (with_cache)."""
    return out["cache"] if "cache" in out.keys() else out["past_key_values"]


class HFEngine(Engine):
    """Own sampling loop (KV cache, left-padded batches), not model.generate(): we need the logprob
    before top-p, exact per-row stops, and none of a checkpoint's generation_config defaults."""

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
        toks, lps, cache, x = [], [], None, ids
        for _ in range(max_tokens):
            # logits_to_keep=1: only the last position's logits (the full (B, L, V) would dominate memory)
            out = self.model(input_ids=x, attention_mask=attn, position_ids=pos, logits_to_keep=1,
                             **with_cache(self.model, cache))
            cache = cache_of(out)
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
        for row, row_lps in zip(toks, lps):  # cut after the first stop token (it stays in the output)
            k = next((j + 1 for j, t in enumerate(row) if t in stop_set), len(row))
            reason = "stop" if k > 0 and row[k - 1] in stop_set else "length"
            res.append(Completion(token_ids=row[:k], logprobs=row_lps[:k], finish_reason=reason))
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
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if e is not None:
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return ids


# ---- episode loop

DUMMY_U, DUMMY_A = "nanorl-dummy-user-7f3a", "nanorl-dummy-assistant-7f3a"


def render_prompt(tokenizer, messages, tools=None, cache: dict | None = None) -> list[int]:
    """Template text encoded without added specials (templates hold their BOS); cache: text -> ids."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    if cache is None:
        return tokenizer.encode(text, add_special_tokens=False)
    if text not in cache:
        cache[text] = tokenizer.encode(text, add_special_tokens=False)
    return list(cache[text])  # a copy: no two episodes share a list


def _dummy_turn(tokenizer, tools=None) -> tuple[list[dict], str, str]:
    """(messages, rendered text, the text after the assistant's content) of a dummy exchange."""
    msgs = [{"role": "user", "content": DUMMY_U}, {"role": "assistant", "content": DUMMY_A}]
    text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False)
    return msgs, text, text[text.rindex(DUMMY_A) + len(DUMMY_A):]


def end_of_turn_id(tokenizer) -> int | None:
    """The special token closing an assistant message (<|im_end|> in ChatML); not always the EOS."""
    ids = tokenizer.encode(_dummy_turn(tokenizer)[2], add_special_tokens=False)
    added = tokenizer.added_tokens_decoder.get(ids[0]) if ids else None  # id -> AddedToken
    return ids[0] if added is not None and added.special else tokenizer.eos_token_id


def stop_token_ids(tokenizer) -> list[int] | None:
    """[end_of_turn_id] when the tokenizer has a chat template, else None (the engine's own EOS)."""
    eot = end_of_turn_id(tokenizer) if tokenizer.chat_template else None
    return [eot] if eot is not None else None


def observation_ids(tokenizer, obs_messages, tools=None, last_token_id=None) -> list[int]:
    """Token ids of env messages appended after a sampled turn ending in last_token_id (see module doc)."""
    if tools and _delta_ignores_tools(tokenizer, tools, tuple(m.get("role") for m in obs_messages)):
        tools = None  # the same text without rendering the tool block twice per turn
    after, delta = _observation_delta(tokenizer, obs_messages, tools)
    stop_text = tokenizer.decode([last_token_id]) if last_token_id is not None else ""
    glue = after[len(stop_text):] if stop_text and after.startswith(stop_text) else after
    return tokenizer.encode(glue + delta, add_special_tokens=False)


def _observation_delta(tokenizer, obs_messages, tools) -> tuple[str, str]:
    """(text after the dummy assistant's content, full[len(prefix):]) (module doc)."""
    base, prefix, after = _dummy_turn(tokenizer, tools)
    full = tokenizer.apply_chat_template(base + list(obs_messages), tools=tools,
                                         add_generation_prompt=True, tokenize=False)
    if not full.startswith(prefix):
        raise ValueError("chat template renders the conversation differently once observations are "
                         "appended; cannot compute observation tokens as a delta")
    return after, full[len(prefix):]


_IGNORES_TOOLS = {}  # (id(tokenizer), template, id(tools), roles) -> (tokenizer, tools, verdict): held, ids stay theirs


def _delta_ignores_tools(tokenizer, tools, roles) -> bool:
    """Do observations with these roles render the same without tools (Qwen2.5's)? Probed once per key."""
    key = (id(tokenizer), str(tokenizer.chat_template), id(tools), roles)
    if key not in _IGNORES_TOOLS:
        # tool_call_id: 9 alphanumerics, or a strict template (Mistral's) raises and the probe says no
        probe = [{"role": r, "content": f"probe-{k}", "tool_call_id": f"probe{k:04d}"} for k, r in enumerate(roles)]
        try:
            same = _observation_delta(tokenizer, probe, tools) == _observation_delta(tokenizer, probe, None)
        except Exception:  # noqa: BLE001 -- then the full render decides
            same = False
        _IGNORES_TOOLS[key] = (tokenizer, tools, same)
    return _IGNORES_TOOLS[key][2]


def run_episodes(engine, tokenizer, rows, make_env, n, temperature, top_p, max_tokens, max_turns, max_context,
                 stop_token_ids=None, max_workers=32, progress=False, timing: dict | None = None, logprobs: bool = True,
                 straggler_wait_s: float | None = 0.5, group_ids=None, ignore_eos: bool = False) -> list[Episode]:
    """n episodes per row -> len(rows) * n Episodes, grouped by row. make_env(row) -> a fresh Env;
    max_turns caps the env's own; group_ids: Episode.group per row (default its index);
    straggler_wait_s: a round's wait for its env steps (None: lockstep); timing accumulates
    generate_s and env_s. A raising env fails its own episode at most, never the call."""
    groups = list(range(len(rows))) if group_ids is None else list(group_ids)
    if len(groups) != len(rows):
        raise ValueError(f"run_episodes: {len(groups)} group_ids for {len(rows)} rows")
    sampling = dict(temperature=temperature, top_p=top_p, stop_token_ids=stop_token_ids, logprobs=logprobs)
    if ignore_eos:  # VLLMEngine only: every turn runs to max_tokens (train.py --ignore-eos)
        sampling["ignore_eos"] = True
    envs = []  # filled as made, so the finally closes every env made even if a reset fails
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(rows) * n))) as pool:
            eps, ready = _start_episodes(tokenizer, rows, groups, make_env, n, max_context, envs, pool)
            turn_caps = [min(e.max_turns, max_turns) if max_turns else e.max_turns for e in envs]
            bar = _progress_bar(len(eps), progress)
            bar.update(len(eps) - len(ready))
            truncated = {}  # episode -> a length limit cut its last sampled turn
            pending = {}    # env.step future -> episode; its episode is in no batch until it finishes
            while ready or pending:
                fresh = []  # this round's env steps
                if ready:
                    texts, trunc = _sample_turn(engine, tokenizer, [eps[i] for i in ready], max_tokens,
                                                max_context, sampling, timing,
                                                [tuple(getattr(envs[i], "keep_special", ())) for i in ready])
                    truncated.update(zip(ready, trunc))
                    for i, text in zip(ready, texts):
                        f = pool.submit(_safe_step, envs[i], text)
                        pending[f] = i
                        fresh.append(f)
                finished = _wait_for_steps(pending, fresh, straggler_wait_s, timing)
                ready = []
                for f in finished:  # in episode order, as in lockstep rounds
                    i = pending.pop(f)
                    if _step_continues(eps[i], envs[i], f.result(), truncated[i], turn_caps[i], tokenizer, max_context):
                        ready.append(i)
                bar.update(len(finished) - len(ready))
        bar.close()
    finally:
        _close_all(envs)  # after the pool's `with` waited for every running reset and step
    return eps


def _start_episodes(tokenizer, rows, groups, make_env, n, max_context, envs, pool):
    """n fresh envs per row (appended to envs), reset in pool -> (episodes, indices ready to play)."""
    ep_rows = [row for row in rows for _ in range(n)]  # episode i plays rows[i // n]
    for row in ep_rows:
        envs.append(make_env(row))
    started = list(pool.map(_safe_reset, envs, ep_rows))  # concurrent: an MCP reset mostly waits
    encoded, eps, ready = {}, [], []
    for i, (env, (messages, err)) in enumerate(zip(envs, started)):
        p = render_prompt(tokenizer, messages, env.tools, cache=encoded)  # a row's n prompts: one encode
        eps.append(Episode(prompt_ids=p, response_ids=[], response_mask=[], logprobs=[],
                           reward=0.0, finish_reason="", group=groups[i // n], info={"turns": 0}))
        if err is not None:  # failed at reset
            eps[-1].finish_reason, eps[-1].info["error"] = "error", err
        elif len(p) >= max_context:  # the prompt alone fills the context
            eps[-1].finish_reason = "length"
        else:
            ready.append(i)
    return eps, ready


def _sample_turn(engine, tokenizer, batch, max_tokens, max_context, sampling, timing, keeps):
    """Sample and append (mask 1) a turn for each episode -> (texts, whether a length limit truncated each);
    keeps: each episode's env.keep_special (decode_many)."""
    budget = [min(max_tokens, max_context - len(e.prompt_ids) - len(e.response_ids)) for e in batch]
    ctxs = [e.prompt_ids + e.response_ids for e in batch]
    t0 = time.perf_counter()
    outs = engine.generate(ctxs, n=1, max_tokens=max(budget), **sampling)
    _add_time(timing, "generate_s", t0)
    kept = [o[0].token_ids[:b] for o, b in zip(outs, budget)]
    truncated = []
    for e, c, ids, b in zip(batch, [o[0] for o in outs], kept, budget):
        truncated.append(c.finish_reason == "length" or len(c.token_ids) > b)
        e.response_ids += ids
        e.response_mask += [1] * len(ids)
        e.logprobs += c.logprobs[:b] if c.logprobs is not None else [math.nan] * len(ids)
        e.info["turns"] += 1
    texts = [None] * len(batch)
    for keep in set(keeps):  # one decode per distinct keep_special; one in all for a usual run
        js = [j for j, k in enumerate(keeps) if k == keep]
        for j, text in zip(js, decode_many(tokenizer, [kept[j] for j in js], keep)):
            texts[j] = text
    return texts, truncated


def _wait_for_steps(pending, fresh, straggler_wait_s, timing):
    """Finished env steps, in episode order: fresh ones get straggler_wait_s, old ones are polled."""
    t0 = time.perf_counter()
    if straggler_wait_s is None:  # lockstep
        wait(pending)
    elif fresh:
        wait(fresh, timeout=straggler_wait_s)
    finished = [f for f in pending if f.done()]
    if not finished:  # nothing to generate for: block for the first
        finished = list(wait(pending, return_when=FIRST_COMPLETED).done)
    _add_time(timing, "env_s", t0)
    return sorted(finished, key=pending.__getitem__)


def _step_continues(ep, env, result, truncated, turn_cap, tokenizer, max_context) -> bool:
    """Fold an env.step result into ep: True if the episode goes on (its observation appended, mask 0),
    False if this step ended it (ep.finish_reason set)."""
    obs, reward, done, info, err = result
    if err is not None:
        ep.finish_reason, ep.info["error"] = "error", err
        return False
    ep.reward += float(reward)
    ep.info.update(info or {})
    if ep.info.get("error"):  # the env caught its own failure (e.g. a dead MCP server)
        ep.finish_reason = "error"
    elif truncated:
        ep.finish_reason = "length"
    elif done:
        ep.finish_reason = "stop"
    elif ep.info["turns"] >= turn_cap:
        ep.finish_reason = "max_turns"
    else:
        try:  # the env's messages through the chat template: a template that refuses them ends this episode only
            o_ids = observation_ids(tokenizer, obs, env.tools, ep.response_ids[-1] if ep.response_ids else None)
        except Exception as e:  # noqa: BLE001 -- e.g. a template's raise_exception on a message it rejects
            ep.finish_reason, ep.info["error"] = "error", error_line(e)
            return False
        if len(ep.prompt_ids) + len(ep.response_ids) + len(o_ids) >= max_context:
            ep.finish_reason = "length"  # the observation plus one sampled token must fit
        else:
            ep.response_ids += o_ids
            ep.response_mask += [0] * len(o_ids)
            ep.logprobs += [0.0] * len(o_ids)
            return True
    return False


def _add_time(timing, key, t0):
    if timing is not None:
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - t0


def decode_many(tokenizer, seqs, keep=()):
    """[tokenizer.decode(s, skip_special_tokens=True) for s in seqs] in one call to the Rust backend
    (one by one for slow tokenizers and those that clean up spaces, a transformers-side step).
    keep: special-token texts to leave in (Env.keep_special): the other special ids (the stop token,
    <|im_start|>, ...) are removed first, and what is left is decoded with skip_special_tokens=False."""
    skip = True
    if keep:
        added = tokenizer.added_tokens_decoder  # id -> AddedToken (transformers 5.24)
        drop = (set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}) - \
            {i for i, t in added.items() if t.content in keep}
        seqs, skip = [[t for t in s if t not in drop] for s in seqs], False
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch") or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return [tokenizer.decode(s, skip_special_tokens=skip) for s in seqs]
    return backend.decode_batch([list(s) for s in seqs], skip_special_tokens=skip)


def _safe_reset(env, row):
    """(env.reset(row), None), or (the row's prompt, the error line) if reset raises."""
    try:
        return env.reset(row), None
    except Exception as e:  # noqa: BLE001 -- e.g. a server that cannot be reached
        return row.get("prompt") or [], error_line(e)


def _safe_step(env, text):
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
    """env.close() for every env, even after one raises; failures reported in one line."""
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
    logprobs       (B, T) float  rollout logprob where loss_mask is 1 (NaN if not asked for), else 0
    rewards        (B,)   float
    groups         (B,)   long
    Token t is predicted by logits[:, t - 1]; score.token_logprobs does that shift.
    """
    # flat lists, then one boolean-mask put each (row-major = concatenation order); numpy: fast from lists
    ids, mask, lps = [], [], []
    for i, e in enumerate(episodes):
        R = len(e.response_ids)
        if not (len(e.response_mask) == len(e.logprobs) == R):
            raise ValueError(f"episode {i}: response_ids/response_mask/logprobs lengths differ "
                             f"({R}, {len(e.response_mask)}, {len(e.logprobs)})")
        ids += e.prompt_ids + e.response_ids
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
    return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(real.astype(np.int64)),
            "loss_mask": torch.from_numpy(loss_mask), "logprobs": torch.from_numpy(logprobs),
            "rewards": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            "groups": torch.tensor([e.group for e in episodes], dtype=torch.long)}
