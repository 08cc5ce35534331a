r"""
Environments: tasks and their rewards (GSM8K, Multiply; MCP tool use lives in mcp_tools/env.py).

An Env (rollout.Env, also envs.Env) is one episode: reset(row) -> prompt messages, step(text) ->
(observation messages, reward, done, info). Episode reward = sum of step rewards.

    make_env("gsm8k" | "multiply" | "mcp" | "bfcl", **kwargs)   # visible if/elif, no registry
    env_for_row(row, default, pool, max_turns, format_reward, error_penalty, error_cap, tool_format,
                partial_credit)                        # per episode
    load_splits(env, train_data, eval_data, ...)       # a run's rows (support/rows.py), checked here
    open_mcp_pool(splits, default, config, tool_timeout, tokenizer)   # the MCP servers, if any row needs them

A row's env: row["env_class"], else the --env default (env_class_of). Every row is checked before
any model loads (check_row): a known env class and a ground truth its env can score (one number
for gsm8k and multiply; mcp: mcp_tools/rewards.py's rule; bfcl: mcp_tools/bfcl.py's), so a bad truth fails at load.

GSM8K reward (rule-based, exact match after normalisation):

    pred = normalise(final answer of the response)       # None if there is no parseable answer
    r    = 1.0              if pred == normalise(ground_truth)
         = format_reward    if pred is not None (answer given, in \boxed{} or #### form, but wrong)
         = 0.0              otherwise                    # format_reward defaults to 0.0

Final-answer extraction, our choices where frameworks disagree:
  - SkyRL takes the FIRST `#### N`; verl the LAST match in the final 300 chars. We take the LAST
    marked answer anywhere: models self-correct, so the final word is the answer.
  - A closed `\boxed{...}` (braces balanced) wins over `####`, even an earlier one: in chat-model
    output `####` is also a markdown h4 header ("#### Step 3").
  - The marked text must hold exactly ONE number: "18 dollars", "$18.00" -> 18; "3/4", "5 - 3 = 2"
    -> no answer. After `####` the number must also come first ("#### Step 3" is no answer).
  - Numbers are string surgery, no floats ("1,000", "18.0", "018"); rewards are total functions
    of the text: linear-time scans, no catastrophic backtracking.

Multiply (SkyRL's tutorial env): "What is 123 * 456?", answer in \boxed{}; with max_turns > 1 a
wrong answer gets feedback and another try, reward on the final step only.

Test: python -m pytest -q tests/test_envs.py
"""
import math
import random
import re

from support import rows
from rollout import Env  # the interface; re-exported as envs.Env

GSM8K_SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step, then give the final answer "
    "as a plain number inside \\boxed{}, for example \\boxed{42}."
)
MULTIPLY_SYSTEM_PROMPT = (
    "You are good at arithmetic. Multiply the two numbers. Think step by step if it helps, then "
    "put only the final product inside \\boxed{}, for example \\boxed{1234}."
)
ENV_CLASSES = ("gsm8k", "multiply", "mcp", "bfcl")

# ---- answer extraction and normalisation (pure, total functions of any string)
# One number: optional minus, either comma-grouped thousands or plain digits, optional decimals.
# No nested quantifiers, so matching is linear in the input.
_NUMBER = re.compile(r"-?(?:(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?|\.[0-9]+)")
_BOXED = re.compile(r"\\boxed\s*\{")
_BRACE = re.compile(r"[{}]")
_HASH_NUMBER_FIRST = re.compile(r"[ \t]*\\?\$?[ \t]*-?\.?[0-9]")


def canonical_number(token: str) -> str:
    """'1,000' -> '1000', '18.0' / '18.' / '018' -> '18', '-0' -> '0', '0.50' / '.5' -> '0.5'."""
    neg = token.startswith("-")
    body = token.lstrip("-").replace(",", "")
    whole, _, frac = body.partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = whole + ("." + frac if frac else "")
    return "-" + out if neg and out != "0" else out


def normalise_number(text: str) -> str | None:
    """The single number in text, canonicalised; None if text holds zero or several numbers."""
    tokens = _NUMBER.findall(text)
    return canonical_number(tokens[0]) if len(tokens) == 1 else None


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} whose braces close; None if there is none. Each candidate is
    scanned only up to the next one's start (still open there: unclosed), so it is linear in len(text)."""
    starts = [m.end() for m in _BOXED.finditer(text)]  # index just after each '{'
    stop = len(text)
    for start in reversed(starts):
        depth = 1
        for m in _BRACE.finditer(text, start, stop):  # regex scan: far faster than a char loop
            depth += 1 if m.group() == "{" else -1
            if depth == 0:
                return text[start:m.start()]
        stop = start  # unclosed: earlier candidates that reach here are unclosed too
    return None


def last_hashes(text: str) -> str | None:
    """The rest of the line after the last '####'; None if there is no '####'."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    return text[pos + 4:].split("\n", 1)[0]


def extract_answer(text: str) -> str | None:
    """Final answer of a response (normalised number) or None. Rules in the module docstring."""
    marked = last_boxed(text)
    if marked is None:
        marked = last_hashes(text)
        # after ####, the number comes first (the dataset, SkyRL, verl): "#### Step 1" is no answer
        if marked is not None and not _HASH_NUMBER_FIRST.match(marked):
            return None
    return None if marked is None else normalise_number(marked)


def gsm8k_reward(text: str, ground_truth, format_reward: float = 0.0) -> tuple[float, dict]:
    """(reward, info) for one response; ground_truth is a str or number ("1,080", 18, "18.0")."""
    truth = normalise_number(str(ground_truth))
    pred = extract_answer(text)
    correct = pred is not None and pred == truth
    reward = 1.0 if correct else (format_reward if pred is not None else 0.0)
    return reward, {"answer": pred, "ground_truth": truth, "format_ok": pred is not None, "correct": correct}


def multiply_reward(text: str, ground_truth, format_reward: float = 0.0) -> tuple[float, dict]:
    r"""Like gsm8k_reward but only \boxed{} counts (the tutorial env's format)."""
    truth = normalise_number(str(ground_truth))
    boxed = last_boxed(text)
    pred = normalise_number(boxed) if boxed is not None else None
    correct = pred is not None and pred == truth
    reward = 1.0 if correct else (format_reward if pred is not None else 0.0)
    return reward, {"answer": pred, "ground_truth": truth, "format_ok": pred is not None, "correct": correct}

# ---- environments (interface: rollout.Env)

def _ground_truth(row: dict, env_name: str) -> str:
    """The row's ground truth as a canonical number; a non-number is a data error, not a 0."""
    gt = row["reward_spec"]["ground_truth"]
    err = ground_truth_error(env_name, gt)
    if err is not None:
        raise ValueError(f"{env_name}: {err}")
    return normalise_number(str(gt))


class GSM8K(Env):
    """Single turn: the reply is scored by gsm8k_reward against reward_spec.ground_truth."""

    def __init__(self, format_reward: float = 0.0):
        self.format_reward = format_reward
        self.truth = None

    def reset(self, row: dict) -> list[dict]:
        self.truth = _ground_truth(row, "gsm8k")
        return [dict(m) for m in row["prompt"]]  # copies: the caller may append to them

    def step(self, text: str) -> tuple[list[dict], float, bool, dict]:
        if self.truth is None:
            raise RuntimeError("GSM8K.step called before reset (or after the episode ended)")
        reward, info = gsm8k_reward(text, self.truth, self.format_reward)
        self.truth = None  # single turn: a second step is a caller bug, fail loudly
        return [], reward, True, info


class Multiply(Env):
    """SkyRL's tutorial task; max_turns > 1 gives feedback and retries, reward on the last step."""

    def __init__(self, format_reward: float = 0.0, max_turns: int = 1):
        if max_turns < 1:
            raise ValueError(f"multiply: max_turns must be >= 1, got {max_turns}")
        self.format_reward = format_reward
        self.max_turns = max_turns
        self.truth = None
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        self.truth = _ground_truth(row, "multiply")
        self.turns = 0
        return [dict(m) for m in row["prompt"]]

    def step(self, text: str) -> tuple[list[dict], float, bool, dict]:
        if self.truth is None or self.turns >= self.max_turns:
            raise RuntimeError("Multiply.step called before reset or after the episode ended")
        self.turns += 1
        reward, info = multiply_reward(text, self.truth, self.format_reward)
        info["turns"] = self.turns
        if info["correct"] or self.turns >= self.max_turns:
            self.turns = self.max_turns  # episode over
            return [], reward, True, info
        feedback = (f"Your answer {info['answer']} is incorrect. Please try again." if info["answer"] is not None
                    else "Please give your answer as a number inside \\boxed{}.")
        return [{"role": "user", "content": feedback}], 0.0, False, info


def make_env(env_class: str, **kwargs) -> Env:
    """A fresh env by name; kwargs go to its constructor (a wrong kwarg is a TypeError)."""
    if env_class == "gsm8k":
        return GSM8K(**kwargs)
    elif env_class == "multiply":
        return Multiply(**kwargs)
    elif env_class == "mcp":
        from mcp_tools.env import MCPEnv  # lazy: the MCP SDK is only imported by runs that use it
        return MCPEnv(**kwargs)
    elif env_class == "bfcl":  # BFCL multi-turn: MCPEnv against mcp_tools/bfcl.py's server, BFCL's verdict
        from mcp_tools.bfcl import BFCLEnv
        return BFCLEnv(**kwargs)
    raise ValueError(f"unknown env_class {env_class!r}; known: {', '.join(ENV_CLASSES)}")


def env_class_of(row: dict, default: str | None) -> str:
    """The row's env_class, else the command-line default; neither is an error."""
    name = row.get("env_class") or default
    if not name:
        raise ValueError("row has no env_class and no default env was given (--env)")
    return name


def env_for_row(row: dict, default: str, pool=None, max_turns: int | None = None, format_reward: float = 0.0,
                error_penalty: float = 0.0, error_cap: float = 2.0, tool_format: str = "hermes",
                partial_credit: float = 0.0) -> Env:
    """A fresh env for one episode of row: its env_class (else default), with the run's options.
    tool_format: how the model writes tool calls (mcp_tools/formats.py; --tool-format); partial_credit:
    mcp only, a wrong answer's credit for the oracle's calls it made (mcp_tools/rewards.py's oracle_credit)."""
    name = env_class_of(row, default)
    if name in ("mcp", "bfcl"):  # max_turns: replies per user turn (bfcl: BFCL's 20 unless given)
        return make_env(name, pool=pool, max_turns=max_turns or (20 if name == "bfcl" else 8), format_reward=format_reward,
                        error_penalty=error_penalty, error_cap=error_cap, tool_format=tool_format,
                        partial_credit=partial_credit)
    elif name == "multiply":
        return make_env("multiply", max_turns=max_turns or 1, format_reward=format_reward)
    return make_env(name, format_reward=format_reward)


def ground_truth_error(env_class: str, gt) -> str | None:
    """Why gt cannot be env_class's reward_spec.ground_truth; None when it can."""
    if env_class in ("gsm8k", "multiply"):
        number = isinstance(gt, (str, int, float)) and not isinstance(gt, bool)
        if number and normalise_number(str(gt)) is not None:
            return None
        got = repr(gt) if len(repr(gt)) <= 60 else repr(gt)[:57] + "..."  # one error line, whatever the row holds
        return f"reward_spec.ground_truth must be one number for {env_class} (e.g. 42 or \"1,080\"), got {got}"
    if env_class == "mcp":  # MCPEnv.reset's own rule (one rule, one place)
        from mcp_tools.rewards import check_ground_truth
        err = check_ground_truth(gt)
        return None if err is None else f"reward_spec.ground_truth (mcp): {err}"
    if env_class == "bfcl":
        from mcp_tools.bfcl import check_answer
        err = check_answer(gt)
        return None if err is None else f"reward_spec.ground_truth (bfcl): {err}"
    return None


def check_row(row: dict, default: str | None, where: str) -> None:
    """Refuse a row whose env class is unknown or whose ground truth its env cannot score:
    a ValueError that starts with where ("file.jsonl:line 3")."""
    name = row.get("env_class") or default
    if not name:
        raise ValueError(f"{where}: row has no env_class and no default env was given (--env)")
    if name not in ENV_CLASSES:
        raise ValueError(f"{where}: unknown env_class {name!r}; known: {', '.join(ENV_CLASSES)}")
    err = ground_truth_error(name, row["reward_spec"]["ground_truth"])
    if err is None and name == "bfcl":  # a training row's partial credit and played turns (mcp_tools/bfcl.py)
        from mcp_tools.bfcl import row_error
        err = row_error(row)
    if err is not None:
        raise ValueError(f"{where}: {err}")


def open_mcp_pool(splits, default: str, config: str | None, tool_timeout: float, tokenizer):
    """The MCP servers (MCPPool, started now) when any row of the splits is an mcp row, else None;
    installs mcp_tools/formats.py's tool chat template on a tokenizer whose template renders no tools."""
    if not any(env_class_of(r, default) in ("mcp", "bfcl") for split in splits for r in split):
        return None
    from mcp_tools.formats import ensure_tool_template  # lazy: the MCP SDK loads only for runs with mcp rows
    from mcp_tools.pool import MCPPool
    pool = MCPPool(config, call_timeout=tool_timeout)
    if ensure_tool_template(tokenizer, pool.tools):
        print("installed mcp_tools.formats.TOOL_CHAT_TEMPLATE (the model's template does not render tools)")
    return pool


def load_splits(env: str, train_data: str | None, eval_data, **options) -> tuple:
    """(train rows, eval rows): support/rows.load_splits (its options) with check_row and _generated_splits."""
    return rows.load_splits(env, train_data, eval_data, check_row=check_row, generated_splits=_generated_splits,
                            **options)


def _generated_splits(env: str, digits: int | str, fewshot: int, seed: int, eval_limit: int) -> tuple:
    """(train, test) rows made in memory, with the few-shot examples in their prompts."""
    if env == "mcp":  # the bundled server's tasks; fewshot 1 = one worked tool-call exchange
        from mcp_tools.tasks import DEMO, mcp_rows
        if fewshot > 1:
            raise ValueError(f"--fewshot {fewshot}: this env has one worked example (0 or 1)")
        train, test = mcp_rows(seed=seed)
        shots = DEMO if fewshot else []
    else:  # multiply: train and test are independent draws
        a, b = (int(d) for d in (str(digits).split(",") * 2)[:2])  # "3": 3 x 3 digits, "2,1": 2 x 1
        train = multiply_rows(10000, a, b, seed=seed, split="train")
        test = multiply_rows(max(eval_limit, 1), a, b, seed=seed + 1, split="test")
        shots = multiply_shots(fewshot, a, b)
    return rows.with_fewshot(train, shots), rows.with_fewshot(test, shots)

# ---- synthetic multiply rows and worked examples

def multiply_rows(n_rows: int, digits_a: int = 2, digits_b: int = 2, seed: int = 0,
                  split: str = "train") -> list[dict]:
    """n_rows random digits_a-digit x digits_b-digit products, as SkyRL rows (deterministic)."""
    if digits_a < 1 or digits_b < 1:
        raise ValueError(f"digits must be >= 1, got {digits_a}, {digits_b}")
    rng = random.Random(seed)
    out = []
    for i in range(n_rows):
        a = rng.randint(10 ** (digits_a - 1), 10 ** digits_a - 1)
        b = rng.randint(10 ** (digits_b - 1), 10 ** digits_b - 1)
        out.append({"data_source": "synthetic_multiply",
                    "prompt": [{"role": "system", "content": MULTIPLY_SYSTEM_PROMPT},
                               {"role": "user", "content": f"What is {a} * {b}?"}],
                    "env_class": "multiply", "reward_spec": {"method": "rule", "ground_truth": str(a * b)},
                    "extra_info": {"a": a, "b": b, "digits_a": digits_a, "digits_b": digits_b,
                                   "split": split, "index": i}})
    return out


MULTIPLY_SHOTS = [(3, 4), (6, 7), (2, 9), (8, 5)]  # 1 x 1 digits; other shapes: the same seed, same digits


def multiply_shots(k: int, digits_a: int = 1, digits_b: int = 1) -> list[dict]:
    r"""The first k worked examples (a question, an answer in \boxed{}) as messages, with factors of
    the task's digit counts. Why: a small model that never boxes earns no reward and nothing trains;
    place value ("58 * 7 = 50 * 7 + 8 * 7 = 350 + 56 = 406") is a shape a 135M model can copy."""
    if k > len(MULTIPLY_SHOTS):
        raise ValueError(f"--fewshot {k}: at most {len(MULTIPLY_SHOTS)} examples")
    pairs = MULTIPLY_SHOTS if digits_a == digits_b == 1 else [
        (r.randint(10 ** (digits_a - 1), 10 ** digits_a - 1), r.randint(10 ** (digits_b - 1), 10 ** digits_b - 1))
        for r in [random.Random(f"worked-{digits_a}x{digits_b}")] for _ in MULTIPLY_SHOTS]
    return [m for a, b in pairs[:k] for m in (
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": f"{worked_product(a, b)}, so the answer is \\boxed{{{a * b}}}."})]


def worked_product(a: int, b: int) -> str:
    """"a * b = ..." by the place values of a: "58 * 7 = 50 * 7 + 8 * 7 = 350 + 56 = 406"."""
    parts = [int(d) * 10 ** i for i, d in enumerate(reversed(str(a))) if d != "0"][::-1]
    if len(parts) == 1:
        return f"{a} * {b} = {a * b}"
    return (f"{a} * {b} = " + " + ".join(f"{p} * {b}" for p in parts) + " = "
            + " + ".join(str(p * b) for p in parts) + f" = {a * b}")


def check_rewards(episodes, row_of_group, default_env):
    """Rewards must be finite numbers: an env that returns NaN or inf is named with its row."""
    for e in episodes:
        if not math.isfinite(e.reward):
            row = row_of_group[e.group]
            raise ValueError(f"env {env_class_of(row, default_env)!r} returned a non-finite reward ({e.reward}) "
                             f"for row {row['data_source']!r} {row.get('extra_info', {}).get('index', '')}: "
                             "rewards must be finite numbers")
