"""Tests for viewer.py: records (segments by mask, whole groups, null for NaN), the jsonl cap, the
escaping of untrusted text, Page (the 30 s throttle on a fake clock, a resumed run's old records,
its page equal to write_html's on random runs), and the page itself in headless Chromium (filters
from the URL hash, no injected element, a screenshot).

The browser tests skip without a `chromium` binary, unless NANORL_REQUIRE_BROWSER=1 (CI sets it:
.ci/run installs Debian's chromium), then they fail. ~10 s with the browser.
Run: python -m pytest -q tests/test_viewer.py
"""
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import score
from conftest import load_script
from support import viewer
from rollout import Episode

EVIL = "</script><script>alert(1)</script> <b>bold</b> <!-- open"


def _ep(tok, prompt, turns, reward=1.0, finish="stop", group=0, info=None):
    """An Episode from text: turns = [(text, mask), ...] in response order."""
    ids, mask = [], []
    for text, m in turns:
        t = tok.encode(text, add_special_tokens=False)
        ids += t
        mask += [m] * len(t)
    return Episode(prompt_ids=tok.encode(prompt, add_special_tokens=False), response_ids=ids, response_mask=mask,
                   logprobs=[0.0] * len(ids), reward=reward, finish_reason=finish, group=group, info=info or {})


MULTI_TURN = [('<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call><|im_end|>', 1),
              ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
              ("The answer is 42.<|im_end|>", 1)]


# ---- records

def test_segments_split_by_mask(tiny_tokenizer):
    e = _ep(tiny_tokenizer, "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n", MULTI_TURN,
            info={"correct": True, "tool_calls": 1, "turns": 2})
    (r,) = viewer.episode_records(7, [e], tiny_tokenizer, advantages=[0.5])
    assert [(s["text"], s["trained"]) for s in r["segments"]] == [(t, bool(m)) for t, m in MULTI_TURN]
    assert r["prompt"].startswith("<|im_start|>user\nWhat is 6*7?")  # special tokens kept
    assert (r["step"], r["group"], r["reward"], r["advantage"], r["finish"]) == (7, 0, 1.0, 0.5, "stop")
    assert r["info"] == {"correct": True, "tool_calls": 1, "turns": 2}
    assert json.loads(json.dumps(r)) == r


def test_the_advantage_is_recorded_once(tiny_tokenizer):
    # train.py puts each episode's advantage in its info too (logs.py hands it back as `advantages`):
    # the record keeps it in one place, or each card printed it twice (head and info line)
    e = _ep(tiny_tokenizer, "Q", [("7", 1)], info={"correct": True, "advantage": 0.25})
    (r,) = viewer.episode_records(1, [e], tiny_tokenizer, advantages=[e.info["advantage"]])
    assert r["advantage"] == 0.25 and r["info"] == {"correct": True}


class _CharTok:
    """id i decodes to the i-th letter: decode of a concatenation is the concatenation of decodes."""
    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@given(st.lists(st.tuples(st.integers(0, 25), st.integers(0, 1)), max_size=40))
def test_segments_property(tokens):
    # concatenated segments == the decoded response; one segment per run of equal mask, runs alternate
    ids, mask = [t for t, _ in tokens], [m for _, m in tokens]
    e = Episode([0], ids, mask, [0.0] * len(ids), 0.0, "stop", 0)
    segs = viewer.episode_records(0, [e], _CharTok())[0]["segments"]
    assert "".join(s["text"] for s in segs) == _CharTok().decode(ids)
    assert len(segs) == sum(1 for i in range(len(mask)) if i == 0 or mask[i] != mask[i - 1])
    assert all(a["trained"] != b["trained"] for a, b in zip(segs, segs[1:]))
    assert all(s["text"] for s in segs)


def test_whole_groups_kept_in_order():
    groups = [2, 2, 0, 5, 0, 5, 1, 1, 3, 0]  # group 0's last episode comes after groups 1 and 3 started
    eps = [Episode([0], [1], [1], [0.0], float(i), "stop", g) for i, g in enumerate(groups)]
    recs = viewer.episode_records(1, eps, _CharTok(), advantages=[i / 10 for i in range(len(eps))], groups=3)
    # first 3 group ids in order of appearance: 2, 0, 5 -> every one of their episodes, in episode order
    assert [r["group"] for r in recs] == [2, 2, 0, 5, 0, 5, 0]
    assert [r["reward"] for r in recs] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0]
    assert [r["advantage"] for r in recs] == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.9]  # parallel to episodes
    assert len(viewer.episode_records(1, eps, _CharTok(), groups=99)) == len(eps)


def test_non_finite_floats_are_null(tmp_path):
    e = Episode([0], [1], [1], [math.nan], math.nan, "error", 0,
                info={"x": math.inf, "ok": 1, "err": "boom", "calls": [1, 2], "nested": {"a": 1}, "none": None})
    (r,) = viewer.episode_records(0, [e], _CharTok(), advantages=[-math.inf])
    assert r["reward"] is None and r["advantage"] is None
    assert r["info"] == {"x": None, "ok": 1, "err": "boom", "none": None}  # lists and dicts left out
    path = tmp_path / "episodes.jsonl"
    viewer.append_episodes(path, [r])
    viewer.append_episodes(path, [r])
    def no_constants(name):
        raise AssertionError(f"{name} written to the jsonl")
    assert [json.loads(line, parse_constant=no_constants) for line in open(path)] == [r, r]
    with pytest.raises(ValueError):  # a raw NaN is refused, not written as invalid JSON
        viewer.append_episodes(path, [{"reward": math.nan}])


def test_an_episode_not_trained_on_has_a_null_advantage():
    # DAPO's dynamic sampling drops all-equal groups: train.py passes None for their episodes
    eps = [Episode([0], [1], [1], [0.0], r, "stop", g) for g, r in ((0, 1.0), (0, 1.0), (1, 0.0), (1, 1.0))]
    recs = viewer.episode_records(2, eps, _CharTok(), advantages=[None, None, -0.7, 0.7])
    assert [r["advantage"] for r in recs] == [None, None, -0.7, 0.7]


@pytest.mark.parametrize("case", ["no folder", "no jsonl", "no chromium"])
def test_command_line_errors_are_one_line(tmp_path, case):
    # `python support/viewer.py OUT`: a missing folder, a folder without episodes.jsonl, or a screenshot
    # without Chromium is one error line (exit 1), not a traceback
    run = tmp_path / "run"
    argv = [str(run)]
    if case != "no folder":
        run.mkdir()
    if case == "no chromium":
        viewer.append_episodes(run / "episodes.jsonl", [_rec(1, 0)])
        argv += ["--screenshot", str(tmp_path / "shot.png")]
    env = {**os.environ, "PATH": "", "CHROMIUM": ""}  # no browser to be found
    p = subprocess.run([sys.executable, viewer.__file__, *argv], capture_output=True, text=True, env=env, timeout=60)
    want = {"no folder": "no such folder", "no jsonl": "no episodes.jsonl in it", "no chromium": "needs Chromium"}[case]
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and want in p.stderr
    assert not (run / "episodes.html").exists()


def _rec(step, group, reward=1.0, finish="stop", text="x" * 100):
    return {"step": step, "group": group, "reward": reward, "advantage": None, "finish": finish, "info": {},
            "prompt": "p", "segments": [{"text": text, "trained": True}]}


def test_read_records_cap_and_rewritten_steps(tmp_path):
    path = tmp_path / "episodes.jsonl"
    viewer.append_episodes(path, [_rec(s, g) for s in range(10) for g in range(4)])
    line = len(json.dumps(_rec(0, 0))) + 1
    recs, note = viewer.read_records(path)
    assert len(recs) == 40 and note == ""
    # room for 3.5 steps: the half step is dropped, the 3 newest steps are kept whole
    recs, note = viewer.read_records(path, max_bytes=14 * line)
    assert [(r["step"], r["group"]) for r in recs] == [(s, g) for s in (7, 8, 9) for g in range(4)]
    assert "newest steps (7 to 9)" in note
    # a killed run left half a line; resumed from the checkpoint of step 7, it writes step 8 again
    # (rewards now 0): the old steps 8 and 9 are gone
    with open(path, "a") as f:
        f.write('{"step": 9, "gro\n')
    viewer.append_episodes(path, [_rec(8, g, reward=0.0) for g in range(2)])
    recs, note = viewer.read_records(path)
    assert [(r["step"], r["reward"]) for r in recs if r["step"] >= 7] == [(7, 1.0)] * 4 + [(8, 0.0)] * 2
    assert len(recs) == 8 * 4 + 2 and "1 unreadable line" in note


def test_html_escapes_untrusted_text(tmp_path):
    path, html = tmp_path / "episodes.jsonl", tmp_path / "episodes.html"
    recs = [_rec(0, 0, text=EVIL), _rec(0, 1, finish=EVIL)]
    recs[0]["prompt"] = EVIL
    viewer.append_episodes(path, recs)
    assert viewer.write_html(path, html) == 2
    page = html.read_text()
    # the data block is closed by its own </script> only, and holds the records exactly
    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    assert json.loads(m.group(1))["episodes"] == recs
    assert "<!--" not in page and "alert" not in page.replace(m.group(1), "")
    assert page.count("<script") == 2  # the data block and the page's script
    assert not re.search(r"(inner|outer)HTML\s*\+?=|insertAdjacentHTML|document\.write", page)  # text only
    assert "http://" not in page and "https://" not in page  # nothing fetched from anywhere


# ---- Page: the page of a running training, from memory

class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_page_throttle(tmp_path):
    path, html, clock = tmp_path / "episodes.jsonl", tmp_path / "episodes.html", _Clock()
    page = viewer.Page(path, html, every_s=30.0, clock=clock)
    page.add([_rec(1, g) for g in range(2)])
    assert page.write() == 2  # the first call always writes
    page.add([_rec(2, g) for g in range(2)])
    clock.t += 29.9
    assert page.write() is None and "episodes" in html.read_text()  # not due: the old page stays
    assert len(path.read_text().splitlines()) == 4  # the jsonl has every step at once
    clock.t += 0.1
    assert page.write() == 4  # 30 s after the last write
    page.add([_rec(3, 0)])
    clock.t += 1
    assert page.write() is None and page.write(force=True) == 5  # the end of a run
    clock.t += 29.5
    assert page.write() is None  # the forced write restarted the 30 s
    always = viewer.Page(path, tmp_path / "b.html", every_s=0.0, clock=clock)
    assert always.write() == 5 and always.write() == 5


def _same_page(page, tmp_path):
    """page.write(force=True) writes what write_html writes from the page's jsonl."""
    ref = tmp_path / "ref.html"
    n = page.write(force=True)
    assert n == viewer.write_html(page.jsonl_path, ref, page.max_bytes)
    assert page.html_path.read_text() == ref.read_text()
    return n


def test_page_resume_reads_old_records(tmp_path):
    path, html = tmp_path / "episodes.jsonl", tmp_path / "episodes.html"
    viewer.append_episodes(path, [_rec(s, g) for s in (1, 2, 3) for g in range(2)])
    with open(path, "a") as f:
        f.write('{"step": 4, "gro')  # killed mid-write: half a line, no newline
    page = viewer.Page(path, html)  # a run resumed from the checkpoint of step 1
    assert _same_page(page, tmp_path) == 6  # the old steps are on its first page
    page.add([_rec(2, g, reward=0.0) for g in range(3)])  # step 2 again: the old steps 2 and 3 go
    assert _same_page(page, tmp_path) == 5
    recs, note = viewer.read_records(path)
    assert [(r["step"], r["reward"]) for r in recs] == [(1, 1.0)] * 2 + [(2, 0.0)] * 3
    assert "1 unreadable line" in note  # the half line, ended by the Page so it does not eat a record
    assert '"step": 3' not in html.read_text() and "unreadable" in html.read_text()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 2), st.integers(0, 4), st.integers(0, 300)), min_size=1, max_size=12),
       st.sampled_from([300, 1000, 3000, viewer.MAX_BYTES]), st.integers(0, 3), st.booleans())
def test_page_equals_write_html(adds, max_bytes, old_steps, half_line):
    # random runs: steps that go back (resumes), empty adds, records bigger than the cap, an old jsonl
    # (ending on half a line or not): after every add the page from memory == write_html's page
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        path = d / "episodes.jsonl"
        if old_steps:
            viewer.append_episodes(path, [_rec(s, g, text="o" * 50) for s in range(old_steps) for g in range(2)])
            if half_line:
                with open(path, "a") as f:
                    f.write('{"step": 9, "gro')
        page = viewer.Page(path, d / "episodes.html", max_bytes=max_bytes)
        if old_steps:
            _same_page(page, d)
        step = old_steps
        for dstep, k, size in adds:
            step = max(0, step + dstep)
            page.add([_rec(step, g, text="x" * size + EVIL) for g in range(k)])
            _same_page(page, d)
        assert all(s <= max_bytes for s in (page.size - start for start, _ in page.lines))  # memory stays capped


# ---- the page in headless Chromium

@pytest.fixture(scope="session")
def browser():
    if viewer.find_chromium() is None:
        if os.environ.get("NANORL_REQUIRE_BROWSER") == "1":
            pytest.fail("NANORL_REQUIRE_BROWSER=1 but no chromium found (apt-get install chromium)")
        pytest.skip("no chromium found (apt-get install chromium); NANORL_REQUIRE_BROWSER=1 makes this a failure")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer):
    """A run's OUT with 3 steps: rewards 0/0.5/1, finish reasons stop/length/max_turns/error, a
    multi-turn tool-call episode and one whose text tries to inject a <script>."""
    tok, d = tiny_tokenizer, tmp_path_factory.mktemp("run")
    for step in (1, 2, 3):
        eps = [_ep(tok, "<|im_start|>user\nQ\n", MULTI_TURN, reward=1.0, group=0, info={"tool_calls": 1}),
               _ep(tok, "Q", [("no<|im_end|>", 1)], reward=0.0, finish="length", group=0),
               _ep(tok, "Q", [(EVIL, 1)], reward=0.0, finish="error", group=1, info={"error": EVIL}),
               _ep(tok, "Q", [("half", 1)], reward=0.5, finish="max_turns", group=1),
               _ep(tok, "Q", [("never shown", 1)], reward=step, group=2)]  # groups=2 leaves group 2 out
        viewer.append_episodes(d / "episodes.jsonl", viewer.episode_records(step, eps, tok, [0.1] * 5, groups=2))
    viewer.write_html(d / "episodes.jsonl", d / "episodes.html")
    return d


class _DOM(HTMLParser):
    """Start tags as (tag, attrs) and the page's text, from a --dump-dom; shown: the text outside
    <script> and <style> (what a reader sees, not the page's own code)."""
    def __init__(self, html):
        super().__init__()
        self.tags, self.text, self.shown, self.script = [], [], [], False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self.script = tag in ("script", "style")

    def handle_endtag(self, tag):
        self.script = self.script and tag not in ("script", "style")

    def handle_data(self, data):
        self.text.append(data)
        if not self.script:
            self.shown.append(data)


def _visible(run_dir, hash=""):
    dom = _DOM(viewer.dump_dom(run_dir / "episodes.html", hash))
    eps = [(int(a["data-step"]), int(a["data-group"]), float(a["data-reward"]), a["data-finish"])
           for t, a in dom.tags if "episode" in a.get("class", "").split() and "hidden" not in a]
    return sorted(eps), dom


def _expected(run_dir, keep):
    recs = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    return sorted((r["step"], r["group"], r["reward"], r["finish"]) for r in recs if keep(r))


def test_browser_step_filter(browser, run_dir):
    latest, dom = _visible(run_dir)  # no hash: the latest step
    assert latest == _expected(run_dir, lambda r: r["step"] == 3) and len(latest) == 4
    assert "showing 4 of 12 episodes" in "".join(dom.text)
    assert _visible(run_dir, "step=1")[0] == _expected(run_dir, lambda r: r["step"] == 1)
    assert _visible(run_dir, "step=all")[0] == _expected(run_dir, lambda r: True)
    assert _visible(run_dir, "step=99")[0] == []


def test_browser_reward_and_finish_filters(browser, run_dir):
    assert _visible(run_dir, "step=all&reward_min=1")[0] == _expected(run_dir, lambda r: r["reward"] >= 1)
    assert _visible(run_dir, "step=2&reward_min=0.1&reward_max=0.9")[0] == [(2, 1, 0.5, "max_turns")]
    assert _visible(run_dir, "step=2&reward=max")[0] == [(2, 0, 1.0, "stop")]
    assert _visible(run_dir, "step=2&reward=zero")[0] == [(2, 0, 0.0, "length"), (2, 1, 0.0, "error")]
    assert _visible(run_dir, "step=all&finish=error")[0] == _expected(run_dir, lambda r: r["finish"] == "error")


def test_browser_untrusted_text_stays_text(browser, run_dir):
    eps, dom = _visible(run_dir, "step=1&finish=error")
    assert len(eps) == 1
    assert [t for t, _ in dom.tags].count("script") == 2  # the data block and the page's own script
    assert "b" not in [t for t, _ in dom.tags]  # the page uses no <b>: any would be injected
    text = "".join(dom.text)
    assert "</script><script>alert(1)</script> <b>bold</b>" in text  # shown as literal text
    # the multi-turn episode: tool call in a trained span, the tool result in an env span
    _, dom = _visible(run_dir, "step=1&reward=max")
    classes = [a.get("class") for _, a in dom.tags]
    assert {"trained", "env", "call", "result"} <= set(classes)


def test_browser_legend_shows_only_what_the_run_has(browser, run_dir, tmp_path, tiny_tokenizer):
    # a multiply run (one trained turn, no tools) lists only trained tokens; the tool run of run_dir
    # adds env text, calls and results, and no hint (no guided episode)
    def legend(d):
        dom = _visible(d)[1]
        return sorted(a["class"].split()[1] for _, a in dom.tags if a.get("class", "").startswith("key "))
    assert legend(run_dir) == ["call", "env", "result", "trained"]
    eps = [_ep(tiny_tokenizer, "What is 6*7?", [("\\boxed{42}<|im_end|>", 1)], info={"correct": True})]
    # an old jsonl: its info still holds the advantage, and the card shows it once all the same
    recs = [{**r, "info": {**r["info"], "advantage": 0.5}} for r in viewer.episode_records(1, eps, tiny_tokenizer, [0.5])]
    viewer.append_episodes(tmp_path / "episodes.jsonl", recs)
    viewer.write_html(tmp_path / "episodes.jsonl", tmp_path / "episodes.html")
    assert legend(tmp_path) == ["trained"]
    shown = "".join(_visible(tmp_path)[1].shown)
    assert shown.count("advantage") == 1 and "tool_call" not in shown and "hint" not in shown, shown


def test_cli_and_screenshot(browser, run_dir, tmp_path):
    png = tmp_path / "page.png"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "support/viewer.py", str(run_dir), "--screenshot", str(png), "--hash", "step=all"],
                   cwd=root, check=True, capture_output=True, timeout=180)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_unfound_counts_what_narrow_would_take_back(tmp_path, capsys):
    # lab/unfound.py: the passes a wide result (a table listed whole) or the policy itself showed, unguided and
    # answer-hinted, by data source and by whether the policy called --tool
    unfound = load_script("lab/unfound.py")
    dump = "[" + ",".join(map(str, range(10, 60))) + "]"

    def record(turns, source, **info):
        segments = [seg for said, obs in turns for seg in ({"text": said, "trained": True}, {"text": obs, "trained": False})]
        return {"step": 1, "group": 0, "reward": 1.0, "finish": "stop", "segments": segments,
                "prompt": "<|im_start|>user\nHow many loans?<|im_end|>\n",
                "info": {"correct": True, "answer": "36", "source": source, **info}}
    call = lambda name, **a: '<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % (name, json.dumps(a))  # noqa: E731
    chance = [(call("sql_query", sql="SELECT * FROM products"), dump), ("<answer>36</answer>", "")]
    found = [(call("db_query", sql="SELECT COUNT(*) FROM loans"), "[[36]]"), ("<answer>36</answer>", "")]
    copied = [(call("sql_query", sql="SELECT * FROM products"), dump), (call("calculate", expression="36"), "36"),
              ("<answer>36</answer>", "")]
    eps = [record(chance, "d"), record(found, "d"), record(copied, "d", hint_for=0, answer_hint=True),
           record(found, "d", hint_for=0, answer_hint=True), record(chance, "d", hint_for=0, probe="db_tables"),
           {**record(chance, "d"), "info": {"correct": False, "answer": "7", "source": "d"}},
           {**record(chance, "s"), "prompt": "<|im_start|>user\nIs it 36?<|im_end|>"}]  # the question states it
    path = tmp_path / "episodes.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    assert unfound.main([str(path)]) == ["| d | 2 | 1 | 2 | 1 |", "| s | 1 | 0 | 0 | 0 |"]
    assert unfound.main([str(path), "--most", "100"]) == ["| d | 2 | 0 | 2 | 0 |", "| s | 1 | 0 | 0 | 0 |"]
    assert unfound.main([str(path), "--tool", "db_query"]) == [
        "| d/db_query | 1 | 0 | 1 | 0 |", "| d/no db_query | 1 | 1 | 1 | 1 |", "| s/no db_query | 1 | 0 | 0 | 0 |"]
    assert "narrow=8" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text(json.dumps(eps[0]) + "\n[1]\n")
    with pytest.raises(SystemExit, match="bad.jsonl:2: not an episode record"):
        unfound.main([str(tmp_path / "bad.jsonl")])


def test_episode_stats_counts_failed_calls_by_outcome(tmp_path):
    # lab/episode_stats.py: failed calls per episode in correct and wrong episodes, endings, and the
    # share made by episodes with more than --many failed calls; doubled braces in or out
    stats = load_script("lab/episode_stats.py")
    info = lambda ok, te, pe=0, db=0: {"correct": ok, "tool_errors": te, "parse_errors": pe, "doubled_braces": db}  # noqa: E731
    eps = [{"step": 1, "finish": "stop", "info": info(True, 0, db=1)},
           {"step": 1, "finish": "stop", "info": info(False, 1)},
           {"step": 2, "finish": "max_turns", "info": info(False, 5, 1)},
           {"step": 2, "finish": "stop", "info": info(True, 0)}]
    path = tmp_path / "episodes.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    rows = stats.main([str(path)])
    assert rows == ["| 1 | 2 | 0.50 | 1.00 | 1.00 | 1.00 | 2 / 0 / 0 | 0.00 |",
                    "| 2 | 2 | 0.50 | 3.00 | 0.00 | 6.00 | 1 / 1 / 0 | 1.00 |"]
    rows = stats.main([str(path), "--steps", "1-2", "--without-doubled"])
    assert rows == ["| 1-2 | 4 | 0.50 | 1.75 | 0.00 | 3.50 | 3 / 1 / 0 | 0.86 |"]
    # --rescue's guided replays: left out, as the step metrics leave them out; --guided counts them alone
    replay = {"step": 1, "finish": "stop", "info": {**info(True, 0), "hint_for": 0, "plan_calls": 2}}
    (tmp_path / "guided.jsonl").write_text("\n".join(json.dumps(e) for e in eps + [replay] * 2) + "\n")
    assert stats.main([str(tmp_path / "guided.jsonl")]) == stats.main([str(path)])
    assert stats.main([str(tmp_path / "guided.jsonl"), "--guided"]) == ["| 1 | 2 | 1.00 | 0.00 | 0.00 | 0.00 | 2 / 0 / 0 | 0.00 |"]
    with pytest.raises(SystemExit, match="episodes.jsonl"):
        stats.main([str(tmp_path / "missing" / "episodes.jsonl")])
    (tmp_path / "bad.jsonl").write_text(json.dumps(eps[0]) + "\n{not json\n")
    with pytest.raises(SystemExit, match="bad.jsonl:2: not a JSON record"):
        stats.main([str(tmp_path / "bad.jsonl")])
    # --rows: each episode joins the row whose question its prompt holds (the longest such question)
    row = lambda q, calls: {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": q}],  # noqa: E731
                            "extra_info": {"oracle_calls": [{"name": "t"}] * calls}}
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in [row("add 2", 1), row("add 2 then 3", 2)]))
    prompts = ["<user>add 2 then 3<end>", "<user>add 2<end>", "<user>add 2<end>", "<user>other<end>"]
    for e, p, calls in zip(eps, prompts, (2, 1, 0, 1)):
        e.update(prompt=p, info={**e["info"], "tool_calls": calls})
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    rows = stats.main([str(path), "--steps", "1-2", "--rows", str(tmp_path / "rows.jsonl")])
    assert rows[1:] == ["| 1-2 | 1 | 2 | 0.50 | 0.00 |", "| 1-2 | 2 | 1 | 2.00 | 1.00 |", "| 1-2 | no row | 1 | 1.00 | 1.00 |"]
    # --family keys that table by FAMILY/CALLS; --sampling keeps one kind of eval.py's episodes
    fam = lambda q, calls, f: {**row(q, calls), "extra_info": {"oracle_calls": [{}] * calls, "family": f}}  # noqa: E731
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in [fam("add 2", 1, "arith"), fam("add 2 then 3", 2, "multi")]))
    for e, sampling in zip(eps, ("greedy", "greedy", "T=1", "greedy")):
        e["info"]["sampling"] = sampling
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    rows = stats.main([str(path), "--steps", "1-2", "--rows", str(tmp_path / "rows.jsonl"), "--family", "--sampling", "greedy"])
    assert rows == ["| 1-2 | 3 | 0.67 | 0.67 | 0.50 | 1.00 | 3 / 0 / 0 | 0.00 |",  # the T=1 episode left out
                    "| 1-2 | arith/1 | 1 | 1.00 | 0.00 |", "| 1-2 | multi/2 | 1 | 2.00 | 1.00 |", "| 1-2 | no row | 1 | 1.00 | 1.00 |"]
    (tmp_path / "rows.jsonl").write_text(json.dumps(row("q", 1)))  # no family
    with pytest.raises(SystemExit, match="rows.jsonl: row 1: want a chat prompt and extra_info.oracle_calls and extra_info.family"):
        stats.main([str(path), "--rows", str(tmp_path / "rows.jsonl"), "--family"])
    with pytest.raises(SystemExit):
        stats.main([str(path), "--family"])  # --family needs --rows
    (tmp_path / "rows.jsonl").write_text(json.dumps(row("q", 1)) + "\n\n" + json.dumps({"prompt": "just text"}))
    with pytest.raises(SystemExit, match="rows.jsonl: row 2: want a chat prompt and extra_info.oracle_calls"):
        stats.main([str(path), "--rows", str(tmp_path / "rows.jsonl")])


def test_entropy_split_scores_trained_tokens_with_a_cached_prefix(tmp_path, tiny_model_dir):
    # lab/entropy_split.py: the entropies it gets with the prompts' shared prefix cached are one full
    # forward's, on trained tokens only, split by tool call; spans and skipped episodes in the table
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    split = load_script("lab/entropy_split.py")
    tok, model = AutoTokenizer.from_pretrained(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = "system: you have tools. user: what is 2 + 2"
    seg = lambda text, trained=True: {"text": text, "trained": trained}  # noqa: E731
    eps = [{"step": 1, "group": 0, "advantage": 0.5, "prompt": prompt + "?",
            "segments": [seg('ok <tool_call>{"name": "calc"}</tool_call>'), seg(" tool says 4 ", False), seg("<answer>4</answer>")]},
           {"step": 1, "group": 1, "advantage": -0.5, "prompt": prompt + " and 3?", "segments": [seg("<answer>5</answer>")]},
           {"step": 1, "advantage": 0.0, "prompt": prompt, "segments": [seg("x")]},  # not trained: not scored
           {"step": 2, "advantage": 1.0, "prompt": prompt, "segments": [seg("<answer>4</answer>")]}]
    enc = [split.encode(tok, e) for e in eps[:2]]
    hs = split.token_entropies(model, [x[0] for x in enc], min(x[3] for x in enc))
    for (ids, trained, in_call, n_prompt), h in zip(enc, hs):
        with torch.no_grad():
            full = score.entropy(model(ids[None]).logits[0, :-1].float())  # full[t - 1]: token t's distribution
        assert not trained[:n_prompt].any() and trained.any() and not (in_call & ~trained).any()
        assert torch.allclose(h[trained], full[trained[1:]], atol=1e-4)
    assert enc[0][2].any() and not enc[1][2].any()  # the first has a tool call; the answer is elsewhere
    assert split.interval(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([1.0, 2.0, 6.0])) == (1.0, 1.0)  # equal means
    lo, hi = split.interval(torch.tensor([0.0, 1.0, 4.0, 9.0]), torch.tensor([1.0, 1.0, 2.0, 3.0]))
    assert lo < 14 / 7 < hi  # the token mean inside; long episodes weigh more
    path = tmp_path / "episodes.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    out = split.main([str(path), "--model", tiny_model_dir, "--steps", "1,2-3,4"]).splitlines()
    assert out[2].startswith("| 1 | 2 (2) | ") and out[3].startswith("| 2-3 | 1 (1) | ")  # episodes (groups)
    assert out[4].startswith("| 4 | 0 | | none trained")
    lo, hi = map(float, out[2].split("(")[2].split(")")[0].split("-"))  # the interval over the two groups
    assert lo < hi
    with pytest.raises(SystemExit, match="missing"):
        split.main([str(tmp_path / "missing.jsonl"), "--model", tiny_model_dir])


def test_browser_shows_each_episodes_tool_format_and_the_parse_rate_per_family(browser, tmp_path, tiny_tokenizer):
    # an episode's tool-call family in its header; over the shown episodes, the parse rate
    # per family: hermes 3 calls + 1 parse error -> 0.75, qwen3-xml 1 + 1 -> 0.50 (step 1); step 2 has none
    tok = tiny_tokenizer
    info = lambda fmt, calls, bad: {"tool_format": fmt, "tool_calls": calls, "parse_errors": bad}  # noqa: E731
    eps = [_ep(tok, "Q", MULTI_TURN, group=0, info=info("hermes", 2, 1)),
           _ep(tok, "Q", [("x", 1)], reward=0.0, group=0, info=info("hermes", 1, 0)),
           _ep(tok, "Q", [("y", 1)], reward=0.0, group=1, info=info("qwen3-xml", 1, 1))]
    viewer.append_episodes(tmp_path / "episodes.jsonl", viewer.episode_records(1, eps, tok, groups=2))
    viewer.append_episodes(tmp_path / "episodes.jsonl", viewer.episode_records(2, [_ep(tok, "Q", [("z", 1)])], tok))
    viewer.write_html(tmp_path / "episodes.jsonl", tmp_path / "episodes.html")
    _, dom = _visible(tmp_path, "step=1")
    text = "".join(dom.text)
    assert text.count("format hermes") == 2 and text.count("format qwen3-xml") == 1
    assert "tool-call parse rate: hermes 0.75 (4), qwen3-xml 0.5 (2)" in text  # (calls + parse errors)
    _, dom = _visible(tmp_path, "step=1&reward=max")  # the shown episodes only
    assert "tool-call parse rate: hermes 0.67 (3)" in "".join(dom.text)
    _, dom = _visible(tmp_path, "step=2")  # no family recorded: neither shows (the page's script says "format ")
    text = "".join(dom.text)
    assert "format hermes" not in text and "format qwen3-xml" not in text and "parse rate: hermes" not in text


def test_episode_stats_reports_repeated_calls_per_family(tmp_path, capsys):
    # lab/episode_stats.py --rows --family: repeated calls and repeats of failed calls per episode.
    # arith/1: repeats 2 and 0, of failed calls 1 and 0 -> 1.00, 0.50; multi/2: 3 (3) -> 3.00, 3.00;
    # an episode that records neither counts 0
    stats = load_script("lab/episode_stats.py")
    row = lambda q, calls, f: {"prompt": [{"role": "user", "content": q}],  # noqa: E731
                               "extra_info": {"oracle_calls": [{}] * calls, "family": f}}
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in [row("add 2", 1, "arith"),
                                                                           row("add 2 then 3", 2, "multi")]))
    info = lambda ok, rep=None, rep_fail=None: {"correct": ok, "tool_calls": 2, "tool_errors": 1,  # noqa: E731
                                                **({} if rep is None else {"repeat_calls": rep, "repeat_failed": rep_fail})}
    eps = [{"step": 1, "finish": "stop", "prompt": "<user>add 2<end>", "info": info(True, 2, 1)},
           {"step": 1, "finish": "stop", "prompt": "<user>add 2<end>", "info": info(False)},
           {"step": 1, "finish": "stop", "prompt": "<user>add 2 then 3<end>", "info": info(False, 3, 3)}]
    path = tmp_path / "episodes.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    rows = stats.main([str(path), "--rows", str(tmp_path / "rows.jsonl"), "--family"])
    assert rows[1:] == ["| 1 | arith/1 | 2 | 2.00 | 0.50 | 1.00 | 0.50 |", "| 1 | multi/2 | 1 | 2.00 | 0.00 | 3.00 | 3.00 |"]
    assert "| steps | family/oracle calls | episodes | calls / ep | correct | repeats / ep | of failed / ep |" in capsys.readouterr().out



def test_episode_stats_first_calls_against_the_oracles_first(tmp_path, capsys):
    # lab/episode_stats.py --first-calls: per family/oracle calls, the share of episodes whose first call
    # is the oracle's first tool, and the top first calls. The first call is read from the first trained
    # segment (Hermes JSON or Qwen3 XML; an untrained segment before it, a hint, is skipped)
    stats = load_script("lab/episode_stats.py")
    row = lambda q, calls, f: {"prompt": [{"role": "user", "content": q}],  # noqa: E731
                               "extra_info": {"oracle_calls": [{"name": c} for c in calls], "family": f}}
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in [
        row("store the price", ["search_products", "kb_set"], "state"), row("add 2", ["calculate"], "arith")]))
    seg = lambda text, trained=True: {"text": text, "trained": trained}  # noqa: E731
    hermes = lambda name: seg('<tool_call>\n{\n  "name": "%s", "arguments": {}}\n</tool_call>' % name)  # noqa: E731
    ep = lambda q, *segs: {"step": 1, "finish": "stop", "prompt": f"<user>{q}<end>", "info": {"correct": False},  # noqa: E731
                           "segments": list(segs)}
    eps = [ep("store the price", hermes("kb_set"), seg("tool says stored", False), hermes("search_products")),
           ep("store the price", seg('<function=kb_set>\n<parameter=key>\nk\n</parameter>\n</function>')),
           ep("store the price", seg("a hint", False), hermes("search_products")),
           ep("add 2", seg("<answer>2</answer>")), ep("add 2", hermes("calculate"))]
    path = tmp_path / "episodes.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    rows = stats.main([str(path), "--rows", str(tmp_path / "rows.jsonl"), "--family", "--first-calls"])
    assert rows[-2:] == ["| 1 | arith/1 | 2 | 0.50 | none 1, calculate 1 |",
                         "| 1 | state/2 | 3 | 0.33 | kb_set 2, search_products 1 |"]
    assert "| steps | family/oracle calls | episodes | first call as the oracle's | first calls |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        stats.main([str(path), "--first-calls"])  # needs --rows

def test_episode_stats_after_errors_splits_recovery_from_giving_up(tmp_path, capsys):
    # lab/episode_stats.py --after-errors: of the episodes that met a tool's error (an untrained segment
    # with "Error"), the shares that called again after it, that passed, and whose answer quotes an error
    stats = load_script("lab/episode_stats.py")
    seg = lambda text, trained=True: {"text": text, "trained": trained}  # noqa: E731
    call = seg('<tool_call>{"name": "db_query", "arguments": {}}</tool_call>')
    err = seg("<tool_response>Error executing tool db_query: no such table</tool_response>", False)
    ep = lambda q, ok, answer, *segs: {"step": 1, "finish": "stop", "prompt": f"<user>{q}<end>",  # noqa: E731
                                       "info": {"correct": ok, "answer": answer}, "segments": list(segs)}
    eps = [ep("count rows", False, "Error executing tool db_query: no such table", call, err, seg("<answer>Error ...</answer>")),
           ep("count rows", True, "7", call, err, call, seg("<tool_response>7</tool_response>", False), seg("<answer>7</answer>")),
           ep("count rows", False, "3", call, err, seg("<answer>3</answer>")),
           ep("add 2", True, "4", call, seg("<tool_response>4</tool_response>", False), seg("<answer>4</answer>"))]
    path = tmp_path / "episodes.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    rows = stats.main([str(path), "--after-errors"])
    assert rows[-1] == "| 1 | all | 4 | 3 | 0.33 | 0.33 | 0.33 |"
    assert "| steps | rows | episodes | with an error | called again | correct | answer quotes an error |" in capsys.readouterr().out
    row = lambda q, f: {"prompt": [{"role": "user", "content": q}], "extra_info": {"oracle_calls": [{}], "family": f}}  # noqa: E731
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in [row("count rows", "discovery"), row("add 2", "arith")]))
    rows = stats.main([str(path), "--rows", str(tmp_path / "rows.jsonl"), "--family", "--after-errors"])
    assert rows[-2:] == ["| 1 | arith/1 | 1 | 0 | 0.00 | 0.00 | 0.00 |", "| 1 | discovery/1 | 3 | 3 | 0.33 | 0.33 | 0.33 |"]



def test_episode_stats_answers_split_guesses_from_read_numbers(tmp_path, capsys):
    # lab/episode_stats.py --answers: a wrong number no tool result (nor the last user turn) showed is a made-up
    # one; a wrong number a result showed (a schema's 0) was there to read; text and untagged answers apart
    stats = load_script("lab/episode_stats.py")
    seg = lambda text, trained=True: {"text": text, "trained": trained}  # noqa: E731
    ep = lambda ok, answer, *segs: {"step": 2, "finish": "stop", "info": {"correct": ok, "answer": answer},  # noqa: E731
                                    "prompt": "<|im_start|>system\nexample: <answer>0</answer><|im_end|>\n"
                                              "<|im_start|>user\nHow many loans in 2014?<|im_end|>", "segments": list(segs)}
    schema = seg("<tool_response>[{'cid': 0, 'name': 'ln_id'}]</tool_response>", False)
    error = seg("<tool_response>Database error: no such table: loans</tool_response>", False)
    eps = [ep(False, "0", seg("call"), error, seg("<answer>0</answer>")),          # made up: the 0 is only the system's
           ep(False, "0", seg("call"), schema, seg("<answer>0</answer>")),         # read off the schema
           ep(False, "2,014", seg("<answer>2,014</answer>")),                      # the question's own number
           ep(False, "no such table", seg("call"), error, seg("<answer>no such table</answer>")),
           ep(False, None, seg("call"), error),
           ep(True, "12", seg("call"), seg("<tool_response>12</tool_response>", False), seg("<answer>12</answer>"))]
    path = tmp_path / "episodes.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in eps) + "\n")
    rows = stats.main([str(path), "--answers"])
    assert rows[-1] == "| 2 | all | 5 | 1 | 2 | 1 | 1 | '0' 2, '2,014' 1, 'no such table' 1 |"
    assert "| number seen | number not seen | text |" in capsys.readouterr().out
    assert [stats.answer_kind(e) for e in eps] == ["unseen", "seen", "seen", "text", "none", "seen"]
    from mcp_tools.rewards import NUMBER
    assert stats._NUMBER.pattern == NUMBER.pattern  # its written-out copy reads numbers as rewards.invented() does


# ---- guided episodes (a hint prefix of oracle calls), repeated calls, partial credit

HINT = [('<tool_call>{"name": "lookup", "arguments": {"key": "' + EVIL + '"}}</tool_call><|im_end|>', 0),
        ("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0)]


def test_a_guided_episodes_hint_prefix_is_its_own_segment(tiny_tokenizer, tmp_path):
    # hint_turns = 1: the first mask-0 run (the oracle's call and its tool result) is the hint; the
    # later tool result is a plain env segment; an unguided episode marks none
    tok = tiny_tokenizer
    guided = _ep(tok, "Q", HINT + MULTI_TURN, info={"hint_turns": 1, "repeat_calls": 2, "repeat_failed": 1, "credit": 0.25})
    plain = _ep(tok, "Q", HINT + MULTI_TURN, group=1, info={"repeat_calls": 0})
    g, p = viewer.episode_records(1, [guided, plain], tok)
    assert [(s["text"], s["trained"], s.get("hint", False)) for s in g["segments"]] == [
        (HINT[0][0] + HINT[1][0], False, True), (MULTI_TURN[0][0], True, False), (MULTI_TURN[1][0], False, False),
        (MULTI_TURN[2][0], True, False)]
    assert not any(s.get("hint") for s in p["segments"]) and [s["text"] for s in p["segments"]] == [s["text"] for s in g["segments"]]
    assert g["info"]["hint_turns"] == 1 and g["info"]["credit"] == 0.25
    viewer.append_episodes(tmp_path / "episodes.jsonl", [g, p])
    viewer.write_html(tmp_path / "episodes.jsonl", tmp_path / "episodes.html")
    page = (tmp_path / "episodes.html").read_text()
    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    assert json.loads(m.group(1))["episodes"] == [g, p]  # the hint's text is data, escaped like any other
    assert "alert" not in page.replace(m.group(1), "") and page.count("<script") == 2


def test_browser_marks_guided_episodes_repeats_and_credit(browser, tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    eps = [_ep(tok, "Q", HINT + MULTI_TURN, group=0,
               info={"hint_turns": 1, "hint_for": 7, "tool_errors": 1, "repeat_calls": 2, "repeat_failed": 1, "credit": 0.25,
                     "invented_calls": 2}),
           _ep(tok, "Q", MULTI_TURN, reward=0.5, group=1,
               info={"tool_errors": 0, "repeat_calls": 0, "repeat_failed": 0, "credit": 0.0}),
           _ep(tok, "Q", MULTI_TURN, reward=-0.2, group=2, info={"plan_calls": 3, "hint_for": 1, "not_trained": True})]
    viewer.append_episodes(tmp_path / "episodes.jsonl", viewer.episode_records(1, eps, tok))
    viewer.write_html(tmp_path / "episodes.jsonl", tmp_path / "episodes.html")
    _, dom = _visible(tmp_path, "step=1&reward=max")  # the guided one
    text, classes = "".join(dom.shown), [a.get("class", "") for _, a in dom.tags]
    assert "guided: 1 hint turn, replays group 7" in text and "repeats 2 (1 of failed calls)" in text
    assert "credit 0.25" in text and "tool_errors=1" in text and "repeat_calls=" not in text  # marks, not raw keys
    assert "hint_for=" not in text and "2 calls with an invented number or date" in text and "invented_calls=" not in text
    assert "hint" in classes and any("guided" in c.split() for c in classes)
    assert EVIL in text and "b" not in [t for t, _ in dom.tags]  # the hint's text stays text
    _, dom = _visible(tmp_path, "step=1&reward_min=0.4&reward_max=0.6")  # the other one: nothing to mark
    text, classes = "".join(dom.shown), [a.get("class", "") for _, a in dom.tags]
    assert "showing 1 of 3" in text and "tool_errors=0" in text
    assert not any(w in text for w in ("guided", "repeat", "credit")) and "hint" not in classes
    _, dom = _visible(tmp_path, "step=1&reward=min")  # a planned replay whose group passed nothing
    text = "".join(dom.shown)
    assert "guided: a plan of 3 calls in its prompt, replays group 1 (no pass in its group: not trained)" in text
    assert "not_trained=" not in text
