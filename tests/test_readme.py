"""Every command in README.md runs as written on a fresh clone (CPU, ~40 s): python -m pytest tests/test_readme.py

The README's ```bash blocks are read in order as one user's session in an empty folder (a fresh
clone's working directory; the scripts are run from the repo by path). Each `python train.py ...`
line runs for real at --steps-0 cost: `--model TINY --eval-every 0 --steps 0` appended (argparse:
the last value wins), so the run folder each line names is made, and a line that reuses an earlier
run's folder fails the way it would for the user. The resume line trains one tiny step. Lines with
a GPU preset are refused on a machine without CUDA with one line naming the GPU (not an argparse
error); with CUDA they are only parsed. Files the README leaves to the user (servers.json, your
rows) are written first: a config of mcp-server-time and one row for it. Every other `python X.py`
line, and each `python ...` in inline code, is parsed: argparse must accept every flag it names
(the script runs up to its parse_args call, then stops).
"""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # import the flat modules at the repo root however pytest is run
import config  # noqa: E402
import train  # noqa: E402

# Scripts run up to their first ArgumentParser.parse_args call, all in one process (one torch
# import): argv lists as JSON in, [exit status, stderr] per script out. 0: argparse accepted the
# arguments (an unknown flag or a bad value exits 2 inside parse_args), 3: it never parsed.
PARSE_ONLY = r"""
import argparse, contextlib, io, json, os, runpy, sys
class Parsed(BaseException): pass
real = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_args
out, path0 = [], sys.path[0]
for argv in json.loads(sys.argv[1]):
    sys.argv, sys.path[0], err, rc = argv, os.path.dirname(argv[0]), io.StringIO(), 3
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except Parsed:
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    out.append([rc, err.getvalue()[-500:]])
print(json.dumps(out))
"""


def readme_commands():
    """(argv, where) of every `python ...` command: ```bash lines in order, then inline code."""
    text = (REPO / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:1] == ["python"] and argv[1:2] != ["-m"]:
                out.append((argv, "bash"))
    for span in re.findall(r"`(python [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        argv = shlex.split(span)
        if argv[1:2] != ["-m"]:
            out.append((argv, "inline"))
    return out


def flag(argv, name, default=None):
    """The value of the last `name VALUE` in argv (argparse's), else default."""
    at = [i for i, a in enumerate(argv[:-1]) if a == name]
    return argv[at[-1] + 1] if at else default


def write_user_files(argv, cwd):
    """The files a README line leaves to the user: an MCP config and rows for its server."""
    row = {"data_source": "mine", "env_class": "mcp", "prompt": [{"role": "user", "content": "time in UTC?"}],
           "reward_spec": {"method": "rule", "ground_truth": "42"}}
    for i, a in enumerate(argv[:-1]):
        path = cwd / argv[i + 1]
        if a == "--mcp-config" and not path.exists():
            server = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}
            path.write_text(json.dumps({"mcpServers": {"time": server}}))
        elif a in ("--train-data", "--eval-data") and not path.exists():
            path.write_text(json.dumps(row) + "\n")


def test_readme_commands_run_as_written(tmp_path, tiny_model_dir, monkeypatch, capsys):
    commands = readme_commands()
    scripts = {argv[1] for argv, _ in commands}
    assert {"train.py", "eval.py", "support/viewer.py", "data/gsm8k.py", "lab/bench.py", "sft.py"} <= scripts
    trains = [argv for argv, where in commands if where == "bash" and argv[1] == "train.py"]
    # each training line has a folder of its own (the resume line continues the first run's)
    folders = [flag(a, "--out-dir", "runs/nanorl") for a in trains if "--resume" not in a]
    assert len(folders) == len(set(folders)), f"README training runs share a --out-dir: {folders}"
    assert all(flag(a, "--resume") in folders for a in trains if "--resume" in a)

    clone = tmp_path / "clone"  # the user's working directory, where relative paths land
    clone.mkdir()
    gpu_here = torch.cuda.is_available()
    parse_only = [i for i, (a, where) in enumerate(commands)  # GPU lines on a GPU: no CI-sized run of them
                  if a[1] != "train.py" or where == "inline" or (flag(a, "--gpu", "cpu") != "cpu" and gpu_here)]
    parsing = subprocess.Popen([sys.executable, "-c", PARSE_ONLY, json.dumps([[str(REPO / commands[i][0][1]), *commands[i][0][2:]] for i in parse_only])],
                               cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    monkeypatch.chdir(clone)
    cheap = ["--model", tiny_model_dir, "--eval-every", "0", "--steps", "0"]
    failures = []
    for i, (argv, where) in enumerate(commands):  # train.py lines in order, here: train.cli is `python train.py`
        if i in parse_only:
            continue
        args, gpu = argv[2:], flag(argv, "--gpu", "cpu")
        write_user_files(args, clone)
        if "--resume" in args:  # one more tiny step on the first run's step-0 checkpoint
            extra = [*cheap[:-1], "1", "--max-context", "2048", "--max-tokens", "4"]
        else:
            extra = cheap
        # `--algo dapo --loss ppo --tis-cap 2` exited 2 ("--tis-cap needs --old-logprobs recompute")
        # until config.py made --tis-cap default --old-logprobs to recompute
        try:
            train.cli([*args, *extra])
            rc, line = 0, ""
        except SystemExit as e:  # cli's one line, or argparse's exit 2
            rc, line = (e.code, "") if isinstance(e.code, int) else (1, str(e.code))
        err = capsys.readouterr().err.strip()[-500:]
        if gpu != "cpu":  # no CUDA here: one line naming the GPU, exit 1 (not argparse's 2)
            if rc != 1 or not re.fullmatch(rf"error: --gpu {gpu} [^\n]*CUDA[^\n]*", line):
                failures.append((argv, f"exit {rc} {line!r}, want one 'error: --gpu {gpu} ... CUDA' line", err))
        elif rc != 0:
            failures.append((argv, f"exit {rc} {line}", err))
    out, err = parsing.communicate(timeout=300)
    assert parsing.returncode == 0, err[-2000:]
    for i, (rc, err) in zip(parse_only, json.loads(out.splitlines()[-1])):
        argv = commands[i][0]
        if rc != 0:
            failures.append((argv, f"does not parse (exit {rc})", err.strip()))
    assert not failures, "\n".join(f"{' '.join(a)}: {why}\n  {err}" for a, why, err in failures)
    assert (clone / "runs" / "nanorl" / "ckpt" / "step_000001").is_dir()  # the resume line trained on


def test_readme_line_counts_and_afternoon_path_are_the_code_as_it_is():
    # the README's claims about the code stay literally true: each line count it quotes is what
    # `wc -l` prints (within 10%), and each file:line of the afternoon path is where that function
    # is defined (the owner regenerates them when the code moves)
    text = (REPO / "README.md").read_text()
    counts = re.findall(r"^\| \d+ \| `([\w/]+\.py)` \| (\d+) \|", text, re.M)  # the reading-order table
    counts += re.findall(r"`([\w/]+\.py)` is a (\d+)-line", text) + re.findall(r"`([\w/]+\.py)` is (\d+) lines", text)
    assert len(counts) >= 8
    for name, n in counts:
        real = len((REPO / name).read_text().splitlines())
        assert abs(int(n) - real) <= 0.1 * real, (name, n, real)
    course = re.search(r"the course is these seven files, ([\d,]+) lines", text)
    total = sum(len((REPO / name).read_text().splitlines()) for name, _ in
                re.findall(r"^\| \d+ \| `([\w/]+\.py)` \| (\d+) \|", text, re.M))
    assert course and abs(int(course.group(1).replace(",", "")) - total) <= 0.1 * total
    path = re.findall(r"^\| \d+ \| `([\w/]+\.py):(\d+)` `([\w.]+)` \|", text, re.M)
    assert len(path) >= 12
    for name, line, func in path:
        src = (REPO / name).read_text().splitlines()[int(line) - 1]
        assert re.match(rf"\s*(def|class) {re.escape(func.split('.')[-1])}\b", src), (name, line, func, src)
    flags = re.search(r"lists every flag \((\d+)\)", text)  # the --help count it quotes
    parser = config.Parser()
    config.add_flags(parser)
    real = [a for a in parser._actions if any(o.startswith("--") for o in a.option_strings) and "--help" not in a.option_strings]
    assert flags and int(flags.group(1)) == len(real), (flags and flags.group(1), len(real))


def test_options_enter_through_one_door():
    # README and train.py: each option enters the course at one visible line of train.py. So no file but
    # train.py and config.py (which validates the flags) imports options/, outside options/ itself, the
    # tests and the lab: the course files and support/ read no option (the same files as
    # `grep -rlE "^(from|import) options|from options" --include=*.py .`, imports inside functions too)
    importers = set()
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel.split("/")[0] in ("tests", "lab", "options") or "/." in f"/{rel}":
            continue
        if re.search(r"^\s*(from|import) options\b|from options\b", path.read_text(), re.M):
            importers.add(rel)
    assert importers == {"train.py", "config.py"}, sorted(importers)
