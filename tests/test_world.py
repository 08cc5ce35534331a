"""lab/world.py, the training world on three third-party MCP servers, with no server installed: the rows are
the same for the same seed, each answer is what a recomputation from the data gives (the tables read as plain
Python lists, no SQL; the CSV files read back as written), no multi question names an abbreviated table,
column or file, no question is one of lab/transfer.py's, and servers.json passes the project's own config
check with the write tools hidden. The servers themselves: python lab/world.py --check (lab/recipes/world.sh).

Run: python -m pytest -q tests/test_world.py
"""
import csv
import json
import os
import re

import pytest

from conftest import load_script
from mcp_tools.config import check_config

W = load_script("lab/world.py", "world")
T = load_script("lab/transfer.py", "transfer")
MULTI = ("duck-multi", "tracker-multi", "files-multi")


@pytest.fixture(scope="module")
def world():
    data = W.world_data(0)
    return data, W.make_rows(data, 0)


def question(row):
    return row["prompt"][-1]["content"]


def test_rows_are_deterministic_from_the_seed(world):
    data, rows = world
    assert W.make_rows(W.world_data(0), 0) == rows
    other = W.make_rows(W.world_data(1), 1)
    assert [question(r) for r in other] != [question(r) for r in rows]


def test_families_counts_and_calls(world):
    _, rows = world
    count = {f: sum(r["extra_info"]["family"] == f for r in rows) for f in W.FAMILIES}
    assert count == {**W.FAMILIES, "tracker-one": count["tracker-one"]} and count["tracker-one"] >= 15
    assert 250 <= len(rows) <= 350
    for r in rows:
        fam, n = r["extra_info"]["family"], len(r["extra_info"]["oracle_calls"])
        assert r["data_source"] == f"world/{fam}" and r["env_class"] == "mcp"
        assert (n == 1) if fam.endswith("-one") else (2 <= n <= 4), (fam, n)
    duck = [r for r in rows if r["extra_info"]["family"] == "duck-multi"]
    two = sum(sum(c["name"] == "list_columns" for c in r["extra_info"]["oracle_calls"]) == 2 for r in duck)
    assert two > len(duck) / 2  # most duck questions join two tables
    assert len({question(r) for r in rows}) == len(rows)


def test_no_multi_question_names_an_abbreviation(world):
    data, rows = world
    names = set(W.TABLES) | {c for cols in W.TABLES.values() for c in cols} | {W.INDEX, "rd/", "_2504", ".csv", ".json"}
    names |= {s["code"] for s in data["stations"]} | {"tmax_c", "tmin_c", "rain_mm", "elev_m"}
    for r in rows:
        if r["extra_info"]["family"] in MULTI:
            hit = [n for n in names if re.search(rf"(?<![A-Za-z]){re.escape(n)}(?![A-Za-z])", question(r))]
            assert not hit, (question(r), hit)
    assert any("cv_reg" in question(r) for r in rows)  # the one-call families do name them: the test can fail


def _recompute_duck(data, q):
    """A duck question's answer from the tables as Python lists (no SQL)."""
    cv, blk, hv = data["tables"].values()
    cvs = {c[0]: c for c in cv}
    by_name = {b[1]: b for b in blk}
    if m := re.search(r"from the block '([^']+)'\?", q):
        return sum(h[3] for h in hv if h[1] == by_name[m[1]][0])
    if m := re.search(r"from the block '([^']+)' were graded '(\w)'", q):
        return sum(h[1] == by_name[m[1]][0] and h[4] == m[2] for h in hv)
    if m := re.search(r"from blocks facing (\w+)\?", q):
        facing = {b[0] for b in blk if b[2] == m[1]}
        return sum(h[3] for h in hv if h[1] in facing)
    if m := re.search(r"which cultivar is planted in the block '([^']+)'\?", q):
        return cvs[by_name[m[1]][4]][1]
    if m := re.search(r"cultivar planted in the block '([^']+)' introduced", q):
        return cvs[by_name[m[1]][4]][3]
    if m := re.search(r"blocks are planted with (\w+) cultivars", q):
        return sum(cvs[b[4]][2] == m[1] for b in blk)
    if m := re.search(r"blocks planted with the cultivar '([^']+)'\?", q):
        return sum(b[3] for b in blk if cvs[b[4]][1] == m[1])
    if m := re.search(r"planted before (\d+)", q):
        return sum(b[5] < int(m[1]) for b in blk)
    if m := re.search(r"in week (\d+) weighed more than (\d+) kg", q):
        return sum(h[2] == int(m[1]) and h[3] > int(m[2]) for h in hv)
    if m := re.search(r"table (\w+), (what is|how many rows have) .*?(?:column )?(\w+)(?: greater than (-?\d+))?\?", q):
        t, col = m[1], m[3]
        values = [row[W.TABLES[t].index(col)] for row in data["tables"][t]]
        if m[4] is not None:
            return sum(v > int(m[4]) for v in values)
        return {"largest": max, "smallest": min, "sum": sum}[re.search(r"the (largest|smallest|sum)", q)[1]](values)
    raise AssertionError(f"no recomputation for {q!r}")


def _recompute_tracker(data, q):
    items = {x["title"]: x for x in data["items"]}
    by_id = {x["id"]: x for x in data["items"]}
    blocker = {dst: by_id[src] for src, dst in data["blocks"]}
    if m := re.search(r"the (title|status) of the item that blocks '([^']+)'\?", q):
        return blocker[items[m[2]]["id"]][m[1]]
    if m := re.search(r"the (priority|complexity) of the item '([^']+)'\?", q):
        return items[m[2]][m[1]]
    if m := re.search(r"under the epic '([^']+)' are (done or closed|issues)", q):
        kids = [x for x in data["items"] if x["parent"] == items[m[1]]["id"]]
        return sum(x["status"] in ("done", "closed") if m[2] != "issues" else x["type"] == "issue" for x in kids)
    if m := re.search(r"under which epic is the item '([^']+)'\?", q):
        return by_id[items[m[1]]["parent"]]["title"]
    if m := re.search(r"what is the (priority|complexity|title) of item number (\d+)\?", q):
        return by_id[int(m[2])][m[1]]
    raise AssertionError(f"no recomputation for {q!r}")


def _recompute_files(folder, q):
    """A files question's answer from the files as written (the index and the CSV read back)."""
    with open(os.path.join(folder, W.INDEX)) as f:
        index = {s["name"]: s for s in json.load(f)["stations"]}
    if m := re.search(r"In the file '([^']+)', what is the value of (\w+) on day (\d+)", q):
        path, col, day = m[1], m[2], int(m[3])
    else:
        s = index[re.search(r"at the (.+) station", q)[1]]
        if "elevation" in q or "sensor model" in q:
            return s["elev_m"] if "elevation" in q else s["sensor"]
        path, col, day = s["file"], None, None
    with open(os.path.join(folder, path), newline="") as f:
        rows = list(csv.DictReader(f))
    if col:
        return float(rows[day - 1][col])
    if m := re.search(r"what was the (maximum|minimum) temperature.* station on day (\d+)\?", q):
        return float(rows[int(m[2]) - 1]["tmax_c" if m[1] == "maximum" else "tmin_c"])
    raise AssertionError(f"no recomputation for {q!r}")


def test_answers_match_a_recomputation(world, tmp_path):
    data, rows = world
    W.write_files(str(tmp_path), data)
    for r in rows:
        fam, q, gt = r["extra_info"]["family"], question(r), r["reward_spec"]["ground_truth"]
        want = (_recompute_duck(data, q) if fam.startswith("duck") else _recompute_tracker(data, q)
                if fam.startswith("tracker") else _recompute_files(str(tmp_path), q))
        if gt["type"] == "number":
            assert float(gt["answer"]) == pytest.approx(want), q
        else:
            assert gt["answer"] == want, q
        assert gt["answer"] not in ("0", "None")


def test_tracker_titles_are_found_by_search_alone(world):
    data, _ = world  # kanban-mcp's search is a LIKE '%query%': no title inside another, or two items would match
    titles = [x["title"].casefold() for x in data["items"]]
    assert all(a == b or a not in b for a in titles for b in titles)
    blocked = {d for _, d in data["blocks"]}
    by_id = {x["id"]: x for x in data["items"]}
    for src, dst in data["blocks"]:  # get_blocking_items lists only open blockers, one each here
        assert src not in blocked and by_id[src]["status"] not in ("done", "closed")
    assert len(blocked) == len(data["blocks"])


def test_no_question_is_a_transfer_question(world, tmp_path):
    _, rows = world
    ours = {question(r) for r in rows}
    for split, seed in (("test", 0), ("train", 1)):
        theirs = {question(r) for r in T.build(str(tmp_path / split), seed, split)}
        assert len(theirs) > 100 and not ours & theirs
    # nor do the worlds share a table, column, sheet or server
    assert not set(W.TABLES) & set(T.TABLES) and not {c for v in W.TABLES.values() for c in v} & {
        c for v in T.TABLES.values() for c in v}


def test_servers_config_passes_the_check_and_hides_the_writers(world, tmp_path):
    _, rows = world
    cfg = W.servers_config(str(tmp_path), "/x/mcp-server-motherduck", "/x/kanban-mcp", "/x/filesystem-mcp")
    assert check_config(json.loads(json.dumps(cfg))) == cfg
    servers = cfg["mcpServers"]
    assert set(servers) == {"orchard", "tracker", "files"} and all(s["row_tools"] is True for s in servers.values())
    assert "--read-write" not in servers["orchard"]["args"] and servers["files"]["exclude_tools"] == ["write_file"]
    shown = set(servers["orchard"]["tools"]) | set(servers["tracker"]["tools"]) | {"list_allowed_directories",
                                                                                  "list_directory", "read_file"}
    assert not any(re.search(r"new_|set_|add_|delete|close|edit|semantic|similar|embedding|write", t) for t in shown)
    for r in rows:
        assert set(r["extra_info"]["tools"]) == shown  # all three servers' tools, in every world prompt
        assert {c["name"] for c in r["extra_info"]["oracle_calls"]} <= shown
    build = W.servers_config(str(tmp_path), "d", "k", "f", build=True)["mcpServers"]
    assert "--read-write" in build["orchard"]["args"] and "tools" not in build["tracker"]
    # the tracker embeds what it writes with a model from the hub where onnxruntime imports: offline, or minutes of
    # retries an item on a machine that reaches no hub (the SDK passes a server only the env its config names)
    assert build["tracker"]["env"]["HF_HUB_OFFLINE"] == servers["tracker"]["env"]["HF_HUB_OFFLINE"] == "1"
