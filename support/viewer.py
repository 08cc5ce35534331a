"""
The episode viewer: OUT/episodes.html, one static page to read what the policy wrote, step by step.

train.py hands a few whole groups of each step's episodes (episode_records) to a Page, which
appends them to OUT/episodes.jsonl at once (the jsonl gets every step) and keeps them in memory.
The page is rewritten from memory at most every 30 s (Page.write) and at the end of a run
(write(force=True)), so a step does not pay for rereading a jsonl that grows with the run. It is
what write_html (`python support/viewer.py OUT`) makes from the same jsonl; a resumed run's Page
reads the jsonl's tail once, so old steps stay. Cost: the shown records live in memory (at most
max_bytes of JSON). The page needs no server and fetches nothing: data, CSS and JS are inline.

Record, one JSON object per line of episodes.jsonl:

    {"step": 3, "group": 0, "reward": 1.0, "advantage": 0.87, "finish": "stop",
     "info": {"correct": true, "turns": 2, "tool_calls": 1, "tool_format": "hermes"},  # Episode.info's scalars
     "prompt": "<|im_start|>user\\nWhat is 6*7?<|im_end|>\\n<|im_start|>assistant\\n",
     "segments": [{"text": "<tool_call>{...}</tool_call><|im_end|>", "trained": true},
                  {"text": "\\n<|im_start|>user\\n<tool_response>42</tool_response>...", "trained": false},
                  {"text": "The answer is 42.<|im_end|>", "trained": true}]}

segments: the response decoded in runs of equal response_mask (assistant turn, trained | tool
result, mask 0 | ...), special tokens kept; runs end on turn boundaries, so no character is split.
A guided episode (info.hint_turns = k, options/rescue.py; info.hint_for: the all-wrong group it replays,
shown right before it) opens with k oracle calls played for it,
mask 0 like tool results, and their results: its first run, "hint": true. The mask does not mark
where a hint call ends and its result begins, so the page marks the whole prefix as the hint and
labels the tool calls in it hint calls.
advantage: null when train.py passes none or the episode was not trained on (dynamic sampling).
NaN and +-inf (JSON has neither) are written as null, everywhere.

The page shows each episode's fields, the prompt (collapsed) and the response with trained and env
tokens in two colours, tool calls and results labelled; at most 500 episodes are drawn at once.
MCP episodes name their tool-call family (info.tool_format, mcp_tools/formats.py) in their header,
and the bar shows the parse rate of the shown episodes per family: calls / (calls + parse errors).
The header also marks, where nonzero: a guided episode and its hint turns, or its plan's calls
(guide=plan: sampled with them in the prompt, shown and trained without), repeated calls (identical
to an earlier call of the episode; in brackets those repeating a failed one) and partial credit.
Filters, also read from the URL hash (and written back to it):

    episodes.html#step=3&reward=max&finish=stop          step: a step or all (default: the latest)
    episodes.html#step=all&reward_min=0.5&reward_max=1   reward: all | max | zero (max of the step)

Untrusted text. Model and env text can hold anything, "</script>" included. It is embedded as
JSON with every < > & written as \\u003c \\u003e \\u0026 (so nothing can close the data block or
open a comment), and reaches the page only through textContent, never innerHTML.
Big runs: past max_bytes (20 MB) only the jsonl's newest whole steps are read, and the page says
so. A resumed run writes steps again: its lines for step s replace every step >= s of the old run.

Run:  python support/viewer.py OUT_DIR [--screenshot PNG]   (the screenshot needs Debian's `chromium`)
A missing OUT_DIR/episodes.jsonl or a missing Chromium is one error line, not a traceback.
Test: python -m pytest -q tests/test_viewer.py
"""
import argparse
import collections
import itertools
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

MAX_BYTES = 20_000_000


def _finite(x):
    """JSON has no NaN or inf: they become None (null)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def episode_records(step, episodes, tokenizer, advantages=None, groups=4):
    """The episodes of the first `groups` group ids (whole groups, in order) as viewer records.
    advantages: None or one float (or None: not trained on) per episode, parallel to `episodes`."""
    keep = set(list(dict.fromkeys(e.group for e in episodes))[:groups])
    records = []
    for i, e in enumerate(episodes):
        if e.group not in keep:
            continue
        segments, pos = [], 0
        for trained, run in itertools.groupby(e.response_mask):
            n = len(list(run))
            segments.append({"text": tokenizer.decode(e.response_ids[pos:pos + n]), "trained": bool(trained)})
            pos += n
        hint = e.info.get("hint_turns")
        if isinstance(hint, int) and hint > 0 and segments and not segments[0]["trained"]:
            segments[0]["hint"] = True  # the oracle's calls and their results, before the policy's first token
        info = {str(k): _finite(v) for k, v in e.info.items()  # advantage: train.py's copy of the record's own
                if k != "advantage" and (v is None or isinstance(v, (bool, int, float, str)))}
        records.append({"step": int(step), "group": int(e.group), "reward": _finite(float(e.reward)),
                        "advantage": None if advantages is None or advantages[i] is None else _finite(float(advantages[i])),
                        "finish": e.finish_reason, "info": info,
                        "prompt": tokenizer.decode(e.prompt_ids), "segments": segments})
    return records


def append_episodes(path, records):
    """Append records to the jsonl, one line each; returns the lines written."""
    # allow_nan=False: a NaN that slipped past episode_records fails here, not in the browser
    lines = [json.dumps(r, allow_nan=False) + "\n" for r in records]
    with open(path, "a") as f:
        f.write("".join(lines))
    return lines


def _tail_lines(path, max_bytes):
    """(file size, [(start byte, line)]) of the jsonl's lines read_records reads: all of them, or
    past max_bytes those that start in the last max_bytes bytes, less the first (cut) one."""
    size = path.stat().st_size
    start = max(0, size - max_bytes)
    with open(path, "rb") as f:
        f.seek(start)
        if start:
            start += len(f.readline())  # the rest of a line cut in half
        data = f.read()
    lines = []
    for line in data.split(b"\n"):
        lines.append((start, line.decode("utf-8", errors="replace")))
        start += len(line) + 1
    return size, lines


def _parse(line):
    """A line's record; None for an unreadable line (a run killed mid-write leaves half a line)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _select(records, bad, size, max_bytes, name):
    """(records, note) to show, from the parsed lines read_records reads (bad: unreadable ones)."""
    if size > max_bytes:  # the first step of the tail may have lost its first lines: drop it
        first = records[0]["step"] if records else None
        records = list(itertools.dropwhile(lambda r: r["step"] == first, records)) or records
    blocks, last = {}, None
    for r in records:
        if r["step"] != last:  # a new block. At a step not above the last one a resumed run went
            blocks = {s: b for s, b in blocks.items() if s < r["step"]}  # back: the old run's rest is stale
            blocks[r["step"]], last = [], r["step"]
        blocks[r["step"]].append(r)
    steps = sorted(blocks)
    note = []
    if size > max_bytes and steps:
        note.append(f"{name} is {size / 1e6:.1f} MB: only its newest steps ({steps[0]} to {steps[-1]}) "
                    f"are shown, older ones are left out (max_bytes={max_bytes}).")
    if bad:
        note.append(f"{bad} unreadable line(s) skipped.")
    return [r for s in steps for r in blocks[s]], " ".join(note)


def read_records(path, max_bytes=MAX_BYTES):
    """(records, note): the jsonl's records, or its newest whole steps past max_bytes."""
    path = Path(path)
    size, lines = _tail_lines(path, max_bytes)
    parsed = [_parse(line) for _, line in lines if line.strip()]
    return _select([r for r in parsed if r is not None], parsed.count(None), size, max_bytes, path.name)


def _write_page(html_path, source, note, records):
    data = json.dumps({"source": source, "note": note, "episodes": records}, allow_nan=False)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    tmp = Path(html_path).with_suffix(".tmp")  # write then rename: a reload never sees half a page
    tmp.write_text(PAGE.replace("__DATA__", data), encoding="utf-8")
    os.replace(tmp, html_path)


def write_html(jsonl_path, html_path, max_bytes=MAX_BYTES):
    """Rewrite the page from the jsonl; returns the number of episodes embedded."""
    records, note = read_records(jsonl_path, max_bytes)
    _write_page(html_path, Path(jsonl_path).name, note, records)
    return len(records)


class Page:
    """The page of a running training: add() appends each step's records to the jsonl at once and
    keeps them in memory; write() rewrites the page from memory, at most every every_s seconds
    (force=True: now; the first call always writes). The page equals write_html's from the jsonl."""

    def __init__(self, jsonl_path, html_path, every_s=30.0, max_bytes=MAX_BYTES, clock=time.monotonic):
        self.jsonl_path, self.html_path, self.every_s = Path(jsonl_path), Path(html_path), every_s
        self.max_bytes, self.clock, self.written = max_bytes, clock, None
        self.size, self.lines = 0, collections.deque()  # (start byte, record or None if unreadable)
        if self.jsonl_path.exists():  # a resumed run: the old records stay on the page
            with open(self.jsonl_path, "rb+") as f:
                if f.seek(0, os.SEEK_END) > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":  # a killed run's half line: end it, or our first record joins it
                        f.write(b"\n")
            self.size, lines = _tail_lines(self.jsonl_path, max_bytes)
            self.lines.extend((start, _parse(line)) for start, line in lines if line.strip())

    def add(self, records):
        for line in append_episodes(self.jsonl_path, records):
            self.lines.append((self.size, json.loads(line)))
            self.size += len(line)  # bytes: json.dumps escapes every non-ASCII character
        while self.lines and self.size > self.max_bytes and self.lines[0][0] <= self.size - self.max_bytes:
            self.lines.popleft()  # out of the tail read_records would read, for good

    def write(self, force=False):
        """Rewrite the page if forced or due; returns the number of episodes embedded, None if not due."""
        now = self.clock()
        if not force and self.written is not None and now - self.written < self.every_s:
            return None
        records = [r for _, r in self.lines if r is not None]
        bad = len(self.lines) - len(records)
        records, note = _select(records, bad, self.size, self.max_bytes, self.jsonl_path.name)
        _write_page(self.html_path, self.jsonl_path.name, note, records)
        self.written = now
        return len(records)


# ---- headless Chromium: screenshots here, DOM dumps for tests/test_viewer.py

def find_chromium():
    """$CHROMIUM, else the first of chromium / chromium-browser / google-chrome on PATH, else None."""
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _headless(html_path, hash, *flags):
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("no Chromium found: `apt-get install chromium` (Debian) or set $CHROMIUM")
    url = Path(html_path).resolve().as_uri() + (f"#{hash}" if hash else "")
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no state shared between runs
        p = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                            "--disable-background-networking", "--disable-component-update", "--disable-sync",
                            f"--user-data-dir={profile}", "--virtual-time-budget=2000", *flags, url],
                           capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"chromium exited {p.returncode}:\n{p.stderr[-2000:]}")
    return p.stdout


def dump_dom(html_path, hash=""):
    """The page's DOM after its script ran, as HTML text."""
    return _headless(html_path, hash, "--dump-dom")


def screenshot(html_path, png_path, hash=""):
    _headless(html_path, hash, f"--screenshot={Path(png_path).resolve()}", "--window-size=1280,900")


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>nanoRL episodes</title>
<style>
body{font:14px system-ui,sans-serif;margin:0 16px 40px;color:#222}
#bar{position:sticky;top:0;background:#fff;padding:8px 0;border-bottom:1px solid #ccc;z-index:1}
#bar label{margin-right:12px} input[type=number]{width:5em}
.key{display:inline-block;padding:0 6px;margin-left:6px;border-radius:3px}
#note{color:#a40} #formats{margin-left:12px;color:#555}
.episode{border:1px solid #ccc;border-left:6px solid #bbb;margin:12px 0;padding:6px 10px}
.episode.pos{border-left-color:#2a2}
.head .f{font-weight:bold;margin-right:10px} .info{color:#666}
pre{white-space:pre-wrap;word-break:break-word;font:13px ui-monospace,monospace;margin:6px 0}
.trained{background:#dff0ff} .env{background:#f1f1f1;color:#555}
.call{background:#ecdcff} .result{background:#ffe6bf;color:#333}
.call::before{content:"tool call \\2192 ";color:#8a2be2;font-weight:bold}
.result::before{content:"tool result \\2190 ";color:#d80;font-weight:bold}
.hint{background:#fff6c2;color:#555} .hint .call::before{content:"hint call \\2192 "}
.episode.guided{border-left-style:dashed} .head .mark{color:#a40}
</style></head><body>
<div id="bar">
<label>step <select id="step"></select></label>
<label>reward <select id="reward"><option value="all">all</option><option value="max">= max</option>
<option value="zero">= 0</option></select></label>
<label>min <input id="reward_min" type="number" step="any"></label>
<label>max <input id="reward_max" type="number" step="any"></label>
<label>finish <select id="finish"><option value="all">all</option></select></label>
<span id="count"></span> <span id="formats"></span>
<div id="legend">legend: <span class="key trained">trained (policy tokens)</span><span class="key env">env / tool (mask 0,
not trained)</span><span class="key call">&lt;tool_call&gt;</span> <span class="key result">&lt;tool_response&gt;</span>
<span class="key hint">hint: oracle calls played for the policy (mask 0)</span>
</div><div id="note"></div>
</div>
<div id="list"></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
// All data text goes through textContent / Option(text) / setAttribute: never innerHTML.
const DATA = JSON.parse(document.getElementById("data").textContent), EPS = DATA.episodes, LIMIT = 500;
const $ = id => document.getElementById(id);
const KEYS = ["step", "reward", "reward_min", "reward_max", "finish"];
const steps = [...new Set(EPS.map(e => e.step))].sort((a, b) => a - b);
for (const s of steps) $("step").append(new Option(s, s));
$("step").append(new Option("all", "all"));
for (const f of [...new Set(EPS.map(e => e.finish))].sort()) $("finish").append(new Option(f, f));
$("note").textContent = DATA.note;
document.title = "nanoRL episodes: " + DATA.source;
const num = x => x === null || x === undefined ? "n/a" : String(+x.toFixed(4));
function el(tag, cls, text) {
  const n = document.createElement(tag);
  if (cls) n.className = cls;
  if (text !== undefined) n.textContent = text;
  return n;
}
const TAG = /<(tool_call|tool_response)>[\\s\\S]*?(?:<\\/\\1>|$)/g;  // a cut-off block runs to the end
function segment(s) {
  const span = el("span", s.hint ? "hint" : s.trained ? "trained" : "env");
  let i = 0;
  for (const m of s.text.matchAll(TAG)) {
    span.append(s.text.slice(i, m.index));  // append(string) adds a Text node
    span.append(el("span", m[1] === "tool_call" ? "call" : "result", m[0]));
    i = m.index + m[0].length;
  }
  span.append(s.text.slice(i));
  return span;
}
const HAS = new Set();  // the legend keeps only the kinds of text this run's episodes have (multiply: no tools)
for (const e of EPS) for (const s of e.segments) {
  HAS.add(s.hint ? "hint" : s.trained ? "trained" : "env");
  for (const m of s.text.matchAll(TAG)) HAS.add(m[1] === "tool_call" ? "call" : "result");
}
for (const k of $("legend").querySelectorAll(".key")) if (!HAS.has(k.classList[1])) k.remove();
if (!HAS.size) $("legend").remove();
const MARKED = ["hint_turns", "plan_calls", "hint_for", "not_trained", "repeat_calls", "repeat_failed", "invented_calls",
                "credit"];  // marks, not key=value
function marks(i) {  // what sets this episode apart, where nonzero
  const hint = +i.hint_turns || 0, plan = +i.plan_calls || 0, rep = +i.repeat_calls || 0, credit = +i.credit || 0,
        inv = +i.invented_calls || 0;
  const replays = (i.hint_for !== undefined ? ", replays group " + i.hint_for : "") +
                  (i.not_trained ? " (no pass in its group: not trained)" : "");
  return [hint > 0 ? "guided: " + hint + " hint turn" + (hint === 1 ? "" : "s") + replays : "",
          plan > 0 ? "guided: a plan of " + plan + " call" + (plan === 1 ? "" : "s") + " in its prompt" + replays : "",
          rep > 0 ? "repeats " + rep + " (" + (+i.repeat_failed || 0) + " of failed calls)" : "",
          inv > 0 ? inv + " call" + (inv === 1 ? "" : "s") + " with an invented number or date" : "",
          credit > 0 ? "credit " + num(credit) : ""].filter(t => t);
}
function episode(e) {
  const d = el("div", "episode" + (e.reward > 0 ? " pos" : "") + (+e.info.hint_turns > 0 || +e.info.plan_calls > 0 ? " guided" : ""));
  for (const k of ["step", "group", "reward", "finish"]) d.setAttribute("data-" + k, String(e[k]));
  const head = el("div", "head");
  for (const t of ["step " + e.step, "group " + e.group, "reward " + num(e.reward),
                   "advantage " + num(e.advantage), "finish " + e.finish]) head.append(el("span", "f", t));
  const fmt = e.info.tool_format;  // MCP: the family whose parser read the calls
  if (typeof fmt === "string") head.append(el("span", "f", "format " + fmt));
  for (const t of marks(e.info)) head.append(el("span", "f mark", t));
  head.append(el("span", "info", Object.entries(e.info)
    .filter(([k]) => (k !== "tool_format" || typeof fmt !== "string") && !MARKED.includes(k)
                     && k !== "advantage")  // in the head already (a jsonl written before the records dropped it)
    .map(([k, v]) => k + "=" + v).join("  ")));
  const p = el("details");
  p.append(el("summary", "", "prompt (" + e.prompt.length + " chars)"), el("pre", "prompt", e.prompt));
  const r = el("pre", "response");
  for (const s of e.segments) r.append(segment(s));
  d.append(head, p, r);
  return d;
}
function parseRates(eps) {  // "hermes 0.75 (4)": calls / (calls + parse errors) per family, (the denominator)
  const by = new Map();
  for (const e of eps) {
    if (typeof e.info.tool_format !== "string") continue;
    const t = by.get(e.info.tool_format) || [0, 0];
    t[0] += +e.info.tool_calls || 0;
    t[1] += (+e.info.tool_calls || 0) + (+e.info.parse_errors || 0);
    by.set(e.info.tool_format, t);
  }
  const parts = [...by].filter(([, t]) => t[1] > 0).map(([f, t]) => f + " " + String(+(t[0] / t[1]).toFixed(2)) + " (" + t[1] + ")");
  return parts.length ? "tool-call parse rate: " + parts.join(", ") : "";
}
function state() {  // defaults, then the hash
  const F = {step: steps.length ? String(steps[steps.length - 1]) : "all", reward: "all",
             reward_min: "", reward_max: "", finish: "all"};
  const h = new URLSearchParams(location.hash.slice(1));
  for (const k of KEYS) if (h.has(k)) F[k] = h.get(k);
  return F;
}
function render(F) {
  for (const k of KEYS) $(k).value = F[k];
  const inStep = EPS.filter(e => F.step === "all" || String(e.step) === F.step);
  const best = inStep.reduce((m, e) => e.reward !== null && e.reward > m ? e.reward : m, -Infinity);
  const lo = F.reward_min === "" ? null : Number(F.reward_min), hi = F.reward_max === "" ? null : Number(F.reward_max);
  const shown = inStep.filter(e => (F.finish === "all" || e.finish === F.finish)
    && (F.reward !== "max" || e.reward === best) && (F.reward !== "zero" || e.reward === 0)
    && (lo === null || (e.reward !== null && e.reward >= lo))
    && (hi === null || (e.reward !== null && e.reward <= hi)));
  $("list").replaceChildren(...shown.slice(0, LIMIT).map(episode));
  $("count").textContent = "showing " + shown.length + " of " + EPS.length + " episodes"
    + (shown.length > LIMIT ? " (the first " + LIMIT + " rendered)" : "");
  $("formats").textContent = parseRates(shown);
}
function onInput() {  // controls -> hash -> page
  const h = new URLSearchParams();
  for (const k of KEYS) if ($(k).value !== "") h.set(k, $(k).value);
  history.replaceState(null, "", "#" + h);
  render(state());
}
for (const k of KEYS) $(k).addEventListener("change", onInput);
window.addEventListener("hashchange", () => render(state()));
render(state());
</script></body></html>
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description="Regenerate OUT_DIR/episodes.html from OUT_DIR/episodes.jsonl.")
    ap.add_argument("out_dir", help="a training run's --out-dir")
    ap.add_argument("--screenshot", default=None, help="also render the page to this PNG (needs chromium)")
    ap.add_argument("--hash", default="", help="filters for the screenshot, e.g. 'step=3&reward=max'")
    ap.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="read at most this much of the jsonl's tail")
    args = ap.parse_args(argv)
    jsonl, html = Path(args.out_dir) / "episodes.jsonl", Path(args.out_dir) / "episodes.html"
    if not jsonl.is_file():
        what = "no such folder" if not Path(args.out_dir).is_dir() else "no episodes.jsonl in it"
        raise FileNotFoundError(f"{args.out_dir}: {what} (want a training run's --out-dir, written with "
                                "--viewer-groups > 0)")
    if args.screenshot and find_chromium() is None:  # before writing anything
        raise FileNotFoundError("--screenshot needs Chromium: `apt-get install chromium` (Debian) or set $CHROMIUM")
    n = write_html(jsonl, html, args.max_bytes)
    print(f"wrote {html} ({n} episodes)")
    if args.screenshot:
        screenshot(html, args.screenshot, args.hash)
        print(f"wrote {args.screenshot}")


if __name__ == "__main__":
    try:
        main()
    except FileNotFoundError as e:  # a missing folder or browser: one line, not a traceback
        raise SystemExit(f"error: {e}")
