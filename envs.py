r"""
Environments: tasks and their rewards (GSM8K, Multiply; MCP tool use lives in mcp_env.py).

An Env (the interface, rollout.Env; also reachable as envs.Env) is one episode: reset(row)
returns the prompt messages, step(text) takes the assistant's reply and returns (observation
messages, reward, done, info). Single-turn envs return ([], reward, True, info) from their first
step. Episode reward = sum of step rewards. A fresh Env per episode, so per-episode state is
safe; steps of different episodes run in worker threads.

    make_env("gsm8k" | "multiply" | "mcp", **kwargs)   # visible if/elif, no registry
    env_for_row(row, default, pool, max_turns, format_reward, error_penalty, error_cap)   # what train.py calls per episode
    load_splits(env, train_data, eval_data, ..., mcp_config)   # a run's rows: the files given, else generated
                                                               # (several --eval-data sets: rows tagged "eval_set")

Which env a row gets: row["env_class"] if the row has one, else the --env default from the
command line (env_class_of below). An unknown name is a ValueError listing the known ones.
The rows themselves (SkyRL's format, validation, .jsonl/.parquet files, few-shot prompts) are
in rows.py.

What load_splits checks, on every row of both splits before any model loads (check_row, in
rows.load_rows' one streaming pass for a file): a known env class, and a ground truth the env
can score (ground_truth_error). A bad row is a ValueError naming file:line (jsonl) or file:row N
(parquet); generated rows are named "generated train row N". The rule per env:
    gsm8k, multiply: one number: an int or float (not a bool) or a string that normalise_number
                     reads as exactly one number ("1,080", "$18", "-7"; not "six", "", "1/2").
    mcp:             a non-empty string or a finite number (not a bool), or an object
                     {"answer": that, "type": "number" | "text" (optional; "number" needs an
                     answer float() reads), "check": [{"tool": str, "expect": ..., "arguments":
                     {...}, "path": [...]}, ...] (optional)} with no other keys.
So null, "", true and {} fail at load, not as a 1.0 for "<answer>None</answer>" or a crash at
reset hours in. And --mcp-config without --train-data is an error: the bundled tasks call the
bundled server's tools, which the servers a config names do not have (every reward would be 0).

GSM8K reward (rule-based, exact match after normalisation):

    pred = normalise(final answer of the response)       # None if there is no parseable answer
    r    = 1.0              if pred == normalise(ground_truth)
         = format_reward    if pred is not None (answer given, in \boxed{} or #### form, but wrong)
         = 0.0              otherwise                    # format_reward defaults to 0.0

Final-answer extraction, our choices where frameworks disagree:
  - SkyRL takes the FIRST `#### N`; verl the LAST match in the final 300 chars. We take the LAST
    marked answer anywhere: models restate the question's numbers and self-correct ("... \boxed{12}
    wait, that is wrong ... \boxed{14}"), so the final word is the answer. The dataset's own
    solutions have exactly one `####` (checked in data/gsm8k.py), so first == last there.
  - A closed `\boxed{...}` (braces balanced, so `\boxed{\text{18}}` works) wins over `####`, even
    an earlier one: in chat-model output `####` is also a markdown h4 header ("#### Step 3").
    The system prompt asks for \boxed{}; `#### N` (the dataset's own form) is accepted too.
  - The marked text (boxed content, or the rest of the `####` line) must contain exactly ONE
    number: "18 dollars", "$18.00", "\text{18}" -> 18; "3/4", "5 - 3 = 2", "10^3" -> no answer.
    After `####` the number must also come first ("#### $18 total" -> 18), so a markdown
    header "#### Step 3" is no answer rather than 3.
  - Numbers: ASCII digits only; "1,000" (thousands groups), "$18", "18.0", "18.", "018" -> 18;
    "-3" -> -3; "0.50" -> 0.5. No floats are involved: normalising is string surgery, so
    "0.1+0.2" style rounding cannot make a wrong answer right, and huge numbers cost nothing.
Rewards are total functions of the text: no try/except, only linear-time scans and regexes
with no ambiguous repetition (no catastrophic backtracking), so any string (a million '{',
weird unicode) returns a number.

Multiply (SkyRL's tutorial env, github.com/NovaSky-AI/SkyRL docs "Creating a New Environment"):
"What is 123 * 456?", answer in \boxed{}. With max_turns > 1 a wrong answer gets a feedback
message and another try; reward comes on the final step only (1.0 / format_reward / 0.0), as in
SkyRL's multi-turn version (which uses 0.5 for "boxed but wrong"; our default is 0.0).
multiply_rows(n) builds rows in memory (data/multiply.py writes them to files); multiply_shots(k)
gives k worked examples for a few-shot prompt (rows.with_fewshot).

Test: python -m pytest -q tests/test_envs.py
"""

import random
import re
from pathlib import Path

import rows
from rollout import Env  # the interface; re-exported as envs.Env

GSM8K_SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step, then give the final answer "
    "as a plain number inside \\boxed{}, for example \\boxed{42}."
)
MULTIPLY_SYSTEM_PROMPT = (
    "You are good at arithmetic. Multiply the two numbers. Think step by step if it helps, then "
    "put only the final product inside \\boxed{}, for example \\boxed{1234}."
)
ENV_CLASSES = ("gsm8k", "multiply", "mcp")

# ---------------------------------------------------------------------------------------------
# answer extraction and normalisation (pure, total functions of any string)

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
    if len(tokens) != 1:
        return None
    return canonical_number(tokens[0])


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} whose braces close; None if there is none.

    Scanning from the last opening backwards, each candidate is scanned only up to the next
    candidate's start (a candidate still open there contains a later, unclosed one, so it is
    unclosed too): the whole search is linear in len(text)."""
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
    rest = text[pos + 4:]
    return rest.split("\n", 1)[0]


def extract_answer(text: str) -> str | None:
    """Final answer of a response (normalised number) or None. Rules in the module docstring."""
    marked = last_boxed(text)
    if marked is None:
        marked = last_hashes(text)
        # after ####, the number must come first (as in the dataset, SkyRL and verl):
        # "#### $18 dollars" -> 18, but a markdown header "#### Step 1" is no answer
        if marked is not None and not _HASH_NUMBER_FIRST.match(marked):
            return None
    if marked is None:
        return None
    return normalise_number(marked)


def gsm8k_reward(text: str, ground_truth, format_reward: float = 0.0) -> tuple[float, dict]:
    """(reward, info) for one response; ground_truth is a str or number ("1,080", 18, "18.0")."""
    truth = normalise_number(str(ground_truth))
    pred = extract_answer(text)
    correct = pred is not None and pred == truth
    reward = 1.0 if correct else (format_reward if pred is not None else 0.0)
    return reward, {"answer": pred, "ground_truth": truth, "format_ok": pred is not None,
                    "correct": correct}


def multiply_reward(text: str, ground_truth, format_reward: float = 0.0) -> tuple[float, dict]:
    r"""Like gsm8k_reward but only \boxed{} counts (the tutorial env's format)."""
    truth = normalise_number(str(ground_truth))
    boxed = last_boxed(text)
    pred = normalise_number(boxed) if boxed is not None else None
    correct = pred is not None and pred == truth
    reward = 1.0 if correct else (format_reward if pred is not None else 0.0)
    return reward, {"answer": pred, "ground_truth": truth, "format_ok": pred is not None,
                    "correct": correct}

# ---------------------------------------------------------------------------------------------
# environments (interface: rollout.Env)


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
        if info["answer"] is not None:
            feedback = f"Your answer {info['answer']} is incorrect. Please try again."
        else:
            feedback = "Please give your answer as a number inside \\boxed{}."
        return [{"role": "user", "content": feedback}], 0.0, False, info


def make_env(env_class: str, **kwargs) -> Env:
    """A fresh env by name; kwargs go to its constructor (a wrong kwarg is a TypeError)."""
    if env_class == "gsm8k":
        return GSM8K(**kwargs)
    elif env_class == "multiply":
        return Multiply(**kwargs)
    elif env_class == "mcp":
        from mcp_env import MCPEnv  # lazy: the MCP SDK is only imported by runs that use it
        return MCPEnv(**kwargs)
    raise ValueError(f"unknown env_class {env_class!r}; known: {', '.join(ENV_CLASSES)}")


def env_class_of(row: dict, default: str | None) -> str:
    """The row's env_class, else the command-line default; neither is an error."""
    name = row.get("env_class") or default
    if not name:
        raise ValueError("row has no env_class and no default env was given (--env)")
    return name

def env_for_row(row: dict, default: str, pool=None, max_turns: int | None = None, format_reward: float = 0.0,
                error_penalty: float = 0.0, error_cap: float = 2.0) -> Env:
    """A fresh env for one episode of row: its env_class (else default), with the run's options."""
    name = env_class_of(row, default)
    if name == "mcp":
        return make_env("mcp", pool=pool, max_turns=max_turns or 8, format_reward=format_reward,
                        error_penalty=error_penalty, error_cap=error_cap)
    elif name == "multiply":
        return make_env("multiply", max_turns=max_turns or 1, format_reward=format_reward)
    return make_env(name, format_reward=format_reward)


def _short(value) -> str:
    """repr(value), cut to 60 characters: one error line, whatever the row holds."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def ground_truth_error(env_class: str, gt) -> str | None:
    """Why gt cannot be env_class's reward_spec.ground_truth (the rules in the module docstring);
    None when it can."""
    if env_class in ("gsm8k", "multiply"):
        number = isinstance(gt, (str, int, float)) and not isinstance(gt, bool)
        if number and normalise_number(str(gt)) is not None:
            return None
        return (f"reward_spec.ground_truth must be one number for {env_class} "
                f"(e.g. 42 or \"1,080\"), got {_short(gt)}")
    if env_class == "mcp":
        err = _mcp_truth_error(gt)
        return None if err is None else f"reward_spec.ground_truth (mcp): {err}"
    return None


def _mcp_truth_error(gt) -> str | None:
    """The mcp rule, which MCPEnv.reset applies too (mcp_env.check_ground_truth: one rule, one place).
    Imported here, not at the top: the MCP SDK loads only for runs with mcp rows."""
    from mcp_env import check_ground_truth
    return check_ground_truth(gt)


def check_row(row: dict, default: str | None, where: str) -> None:
    """Refuse a row whose env class is unknown or whose ground truth its env cannot score:
    a ValueError that starts with where ("file.jsonl:line 3")."""
    name = row.get("env_class") or default
    if not name:
        raise ValueError(f"{where}: row has no env_class and no default env was given (--env)")
    if name not in ENV_CLASSES:
        raise ValueError(f"{where}: unknown env_class {name!r}; known: {', '.join(ENV_CLASSES)}")
    err = ground_truth_error(name, row["reward_spec"]["ground_truth"])
    if err is not None:
        raise ValueError(f"{where}: {err}")


def open_mcp_pool(splits, default: str, config: str | None, tool_timeout: float, tokenizer):
    """The MCP servers (mcp_pool.MCPPool, started now) when any row of the splits is an mcp row, else None; installs
    mcp_env's tool chat template on a tokenizer whose own template does not render tools."""
    if not any(env_class_of(r, default) == "mcp" for split in splits for r in split):
        return None
    import mcp_env
    import mcp_pool
    pool = mcp_pool.MCPPool(config, call_timeout=tool_timeout)
    if mcp_env.ensure_tool_template(tokenizer, pool.tools):
        print("installed mcp_env.TOOL_CHAT_TEMPLATE (the model's template does not render tools)")
    return pool


def load_splits(env: str, train_data: str | None, eval_data, *, digits: int | str, fewshot: int,
                seed: int, eval_limit: int, eval_every: int, mcp_config: str | None = None) -> tuple:
    """(train rows, eval rows): the files given, else generated rows (multiply, mcp) or
    data/out/gsm8k. Every row of both splits passes check_row (file rows in their load pass), so a
    bad one fails here, before any model loads. eval_data: None, a file, or a list of
    "[NAME=]FILE" (train.py's repeatable --eval-data): of each set its first eval_limit rows; with
    several sets every eval row is a copy carrying "eval_set": NAME (the file's stem unless given),
    which train.evaluate scores apart."""
    specs = [eval_data] if isinstance(eval_data, str) else list(eval_data or [])
    if mcp_config and not train_data:
        raise ValueError("--mcp-config names your own servers: pass your rows with --train-data (and "
                         "--eval-data or --eval-every 0); the bundled tasks need the bundled server")
    check = lambda row, where: check_row(row, env, where)  # noqa: E731
    if env == "gsm8k":  # rows written by data/gsm8k.py
        hint = ("; make the GSM8K rows first with\n  python data/gsm8k.py --src https://raw.githubusercontent.com/"
                "openai/grade-school-math/master/grade_school_math/data --out data/out/gsm8k\n(or pass --train-data/--eval-data)")
        train = _read_split(train_data or "data/out/gsm8k/train.jsonl", "--train-data", check, hint)
        return train, _eval_sets(specs or ["data/out/gsm8k/test.jsonl"], check, eval_limit, hint)
    if train_data and not specs and eval_every:
        raise ValueError("--train-data without --eval-data: eval would run the generated tasks, not yours; "
                         "pass --eval-data FILE (held-out rows of yours) or --eval-every 0")
    generated = (None, None)
    if not (train_data and specs):
        generated = _generated_splits(env, digits, fewshot, seed, eval_limit)
        for name, split in zip(("train", "eval"), generated):
            for i, row in enumerate(split):
                check(row, f"generated {name} row {i}")
    train = _read_split(train_data, "--train-data", check) if train_data else generated[0]
    return train, _eval_sets(specs, check, eval_limit) if specs else generated[1][:eval_limit]


def _eval_sets(specs: list, check, eval_limit: int, hint: str = "") -> list:
    """The eval rows of one or more "[NAME=]FILE" specs (load_splits' doc)."""
    sets = {}
    for spec in specs:
        name, path = spec.split("=", 1) if "=" in spec and not Path(spec).is_file() else (Path(spec).stem, spec)
        if name in sets:
            raise ValueError(f"--eval-data: two sets named {name!r}; name them, e.g. --eval-data seen={path}")
        sets[name] = _read_split(path, "--eval-data", check, hint)[:eval_limit]
    if len(sets) == 1:
        return next(iter(sets.values()))
    return [{**row, "eval_set": name} for name, rows in sets.items() for row in rows]


def _read_split(path: str, flag: str, check, hint: str = ""):
    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag} {path}: file not found{hint}")
    return rows.load_rows(path, check)


def _generated_splits(env: str, digits: int | str, fewshot: int, seed: int, eval_limit: int) -> tuple:
    """(train, test) rows made in memory, with the few-shot examples in their prompts."""
    if env == "mcp":  # the bundled server's tasks; fewshot 1 = one worked tool-call exchange
        from mcp_server.tasks import DEMO, mcp_rows
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

# ---------------------------------------------------------------------------------------------
# synthetic multiply rows and worked examples


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
        out.append({
            "data_source": "synthetic_multiply",
            "prompt": [{"role": "system", "content": MULTIPLY_SYSTEM_PROMPT},
                       {"role": "user", "content": f"What is {a} * {b}?"}],
            "env_class": "multiply",
            "reward_spec": {"method": "rule", "ground_truth": str(a * b)},
            "extra_info": {"a": a, "b": b, "digits_a": digits_a, "digits_b": digits_b,
                           "split": split, "index": i},
        })
    return out


MULTIPLY_SHOTS = [(3, 4), (6, 7), (2, 9), (8, 5)]  # 1 x 1 digits; other shapes: the same seed, same digits


def multiply_shots(k: int, digits_a: int = 1, digits_b: int = 1) -> list[dict]:
    r"""The first k worked examples (a user question, an assistant answer in \boxed{}) as messages,
    with factors of the task's digit counts.

    Why: SmolLM2-135M knows many 1-digit products but almost never writes \boxed{} (1 of 64
    samples in our probe), so every reward is 0 and nothing trains; after one example it boxes
    ~85% of the time and ~50% are right: groups with mixed rewards, a learning signal.
    A first factor of several digits is worked by place value, "58 * 7 = 50 * 7 + 8 * 7 = 350 +
    56 = 406": a 135M model cannot recall a 2-digit x 1-digit product, but it can copy that shape
    out of 1-digit products it knows and one addition -- the steps RL then makes reliable.
    """
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
