r"""
A training world on three third-party MCP servers from PyPI, side by side in every prompt, so that a policy
must pick the server a question needs and discover its structure in 2-4 calls. It was chosen knowing how
transfer to lab/transfer.py's servers fails (docs/results.md): the policy sent questions to the wrong server
and did not chain list -> describe -> query on tools it had not seen. It is a TRAINING world, disjoint from
the transfer set's servers (sqlite, git, excel, time) and data (library, repo, depot); never an eval of
transfer. It builds, all deterministic from --seed, into OUT:

    OUT/orchard.duckdb  DuckDB, 3 tables: cv_reg (10 cultivars), blk_ix (14 blocks), hv_lg (70 harvest picks)
    OUT/tracker/        a kanban-mcp project (kanban.db) of 30 items: 4 epics, their children, blockers, tags
    OUT/files/          stn_idx.json (an index of 8 weather stations) and rd/*.csv (a fortnight of readings each)
    OUT/servers.json    {"mcpServers": {"orchard", "tracker", "files"}}: read tools only, "row_tools" on each
    OUT/rows.jsonl      290 rows in mcp_tools/tasks.py's format, data_source "world/FAMILY"; extra_info.tools
                        names all 17 tools of the three servers, so every world prompt shows them all
    OUT/train.jsonl     the same rows without oracle calls: what training reads (--check replays rows.jsonl)

    mcp-server-motherduck 1.1.0  MIT  DuckDB, read-only by default (the build writes with --read-write)
    kanban-mcp 0.2.0             MIT  its own JSON-RPC loop; the allow-list below (READ["tracker"]) hides its
                                      writers and semantic_search / find_similar / rebuild_embeddings (a model download)
    filesystem-mcp 1.0.2         MIT  runs in OUT/files (cwd); write_file hidden

Families (oracle calls):  duck-multi    90  list_tables -> list_columns (1-2 tables) -> execute_query (3-4)
                          tracker-multi 70  search -> get_item / get_blocking_items / get_epic_progress /
                                            list_children, -> get_item of the parent (2-3)
                          files-multi   60  list_directory -> read_file the index -> read_file the readings (2-3)
                          duck-one 25, tracker-one 20, files-one 25: the table, item number or file is named (1)
Every answer is a value some result shows, none a sum or count the policy would make itself, so that --rescue
narrow=N (which grounds a number only where a result showed it) can credit a right one.
Table, column and file names are abbreviations (blk_ix, kg_net, stn_idx.json) that no multi question uses
(tested). The database and tracker are written through the servers' own tools (a build pool, write tools
shown) and read back: the build stops unless they hold exactly the data here, from which every answer is
computed (sqlite3 runs the oracle's SQL; Python sums the readings); tracker ids are 1..30 in seeding order, and
no question depends on a timestamp or a list's order. All three live beside the project (mcp 2.x; installing
them changes none of its packages: lab/recipes/world.sh says how that was checked).

    bash lab/recipes/world.sh                   # install (WHEELS=DIR: wheel files only), build, check
    python lab/world.py --out data/out/world [--duck-server S --kanban-server S --fs-server S]
    python lab/world.py --out data/out/world --check   # oracle -> 1.0, a wrong answer -> 0.0, every row

Test: python -m pytest -q tests/test_world.py
"""
import argparse
import collections
import contextlib
import csv
import json
import os
import random
import shutil
import sqlite3
import sys
from contextlib import closing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from lab.transfer import check_families, unique  # noqa: E402
from mcp_tools.tasks import SYSTEM_PROMPT, call, fmt  # noqa: E402

FAMILIES = {"duck-multi": 90, "tracker-multi": 70, "files-multi": 60, "duck-one": 25, "tracker-one": 20, "files-one": 25}
TABLES = {"cv_reg": ["cv_id", "cv_nm", "fruit_k", "intro_yr"],
          "blk_ix": ["blk_id", "blk_nm", "aspect", "area_m2", "cv_ref", "plant_yr"],
          "hv_lg": ["hv_id", "blk_ref", "pk_wk", "kg_net", "grade_c"]}
TEXT_COLUMNS = ("cv_nm", "fruit_k", "blk_nm", "aspect", "grade_c")
READ = {"orchard": ["list_databases", "list_tables", "list_columns", "execute_query"],
        "tracker": ["list_items", "get_item", "project_summary", "get_epic_progress", "get_blocking_items",
                    "list_children", "list_tags", "get_item_tags", "get_item_relationships", "search"],
        "files": ["list_allowed_directories", "list_directory", "read_file"]}
WORLD_TOOLS = [t for names in READ.values() for t in names]
INDEX = "stn_idx.json"
_CULTIVARS = ["Brimfield", "Corra Gold", "Dunmore Russet", "Elsin Red", "Fallow Sweet", "Garnock", "Hazelmere",
              "Islay Pip", "Kestle Blush", "Lanark Late"]
_BLOCKS = ["Top Meadow", "Mill Field", "Long Acre", "Hanger Slope", "Well Close", "Pond Piece", "Rookery",
           "Dairy Ground", "Broad Leys", "Chapel Bank", "Sheepwash", "Lower Holme", "Kiln Field", "Foxholes"]
_STATIONS = [("Kestrel Ridge", "KR"), ("Mossbank", "MB"), ("Tarn End", "TE"), ("Hollin Gate", "HG"),
             ("Brackenfold", "BF"), ("Ashby Moor", "AM"), ("Cold Harbour", "CH"), ("Wether Hill", "WH")]
_EPICS = ["Cold store retrofit", "Frost protection plan", "Irrigation overhaul", "Packhouse hygiene audit"]
_TASKS = ["Humidity logging", "Door interlock", "Compressor service", "Wind machine quote", "Candle stock count",
          "Drip line flushing", "Pump house wiring", "Valve replacement", "Sanitiser rota", "Drain cover repair",
          "Grading belt guard", "Forklift battery check", "Hail net tensioning", "Pruning crew briefing",
          "Bin trailer brakes", "Rootstock order", "Soil moisture probes", "Bird scarer permit", "Ladder inspection",
          "Spray log backfill", "Reservoir liner patch", "Thermometer calibration", "Gate hinge welding",
          "Bee hive placement", "Fence line survey", "Pallet wrap supplier"]
TAGS = ["frost", "water", "safety", "machinery", "sensors"]
STATUSES = {"feature": ["backlog", "todo", "in_progress", "review", "done"], "epic": ["todo", "in_progress"],
            "issue": ["backlog", "todo", "in_progress", "review", "done", "closed"],
            "todo": ["backlog", "todo", "in_progress", "done"]}  # valid in kanban-mcp 0.2.0's workflows


def world_data(seed: int) -> dict:
    """Everything the world holds, as Python values: tables, tracker items (id = seeding order), stations."""
    rng = random.Random(f"{seed}:world")
    cv = [(i, n, rng.choice(["apple", "pear", "plum", "cherry"]), rng.randint(1931, 2015))
          for i, n in zip(rng.sample(range(100, 1000), 10), _CULTIVARS)]
    blk = [(b, n, rng.choice(["north", "south", "east", "west"]), rng.randrange(800, 9000, 50), rng.choice(cv)[0],
            rng.randint(1978, 2021)) for b, n in zip(rng.sample(range(1000, 10000), 14), _BLOCKS)]
    hv = [(h, rng.choice(blk[:12])[0], rng.randint(31, 42), rng.randint(40, 900), rng.choice("AABBC"))
          for h in rng.sample(range(20000, 30000), 70)]  # 2 blocks never picked
    items = [{"id": i + 1, "title": t, "type": "epic", "parent": None, "priority": rng.randint(1, 3),
              "complexity": rng.randint(3, 5), "status": rng.choice(STATUSES["epic"])} for i, t in enumerate(_EPICS)]
    for t in _TASKS:
        kind = rng.choice(["feature", "issue", "issue", "todo"])
        free = [e for e in (1, 2, 3, 4) if sum(x["parent"] == e for x in items) < 6]  # list_children of 6: ~2,900
        items.append({"id": len(items) + 1, "title": t, "type": kind, "parent": rng.choice(free * 2 + [None]),  # chars
                      "priority": rng.randint(1, 5), "complexity": rng.randint(1, 5), "status": rng.choice(STATUSES[kind])})
    blocked = rng.sample(range(5, 31), 9)  # each blocked by exactly one other task
    open_ = [x["id"] for x in items[4:] if x["id"] not in blocked and x["status"] not in ("done", "closed")]
    blocks = [(rng.choice(open_), b) for b in blocked]  # open: get_blocking_items shows no done or closed blocker
    tags = {t: sorted(rng.sample(range(1, 31), rng.randint(3, 8))) for t in TAGS}
    stations = []
    for name, code in _STATIONS:
        days = [(d, rng.randint(40, 190), rng.randint(-50, 60), max(0, rng.randint(-40, 90))) for d in range(1, 15)]
        stations.append({"name": name, "code": code, "elev_m": rng.randint(60, 900), "sensor": rng.choice(
            ["Vx-2", "Vx-3", "Lumo 4", "Davis VP2"]), "file": f"rd/{code.lower()}_2504.csv", "days": days})  # tenths
    return {"tables": dict(zip(TABLES, (cv, blk, hv))), "items": items, "blocks": blocks, "tags": tags,
            "stations": stations}


def memory_db(data: dict) -> sqlite3.Connection:
    """The three tables in an in-memory sqlite3 database: the oracle's SQL, run here, gives the answers."""
    db = sqlite3.connect(":memory:")
    for t, rows in data["tables"].items():
        db.execute(f"CREATE TABLE {t} ({', '.join(TABLES[t])})")
        db.executemany(f"INSERT INTO {t} VALUES ({', '.join('?' * len(TABLES[t]))})", rows)
    return db


def gen_duck_multi(rng, data):
    """(question, sql, tables its oracle lists the columns of), in plain words."""
    cv, blk, _ = data["tables"].values()
    b, c = rng.choice(blk)[1], rng.choice(cv)[1]
    g, aspect, fruit = rng.choice("ABC"), rng.choice(["north", "south", "east", "west"]), rng.choice(["apple", "pear", "plum", "cherry"])
    y, n, wk = rng.randint(1985, 2020), rng.randrange(100, 850, 50), rng.randint(31, 42)
    q = "According to the orchard's harvest database, {}"
    picks, planted = "hv_lg JOIN blk_ix ON blk_ref = blk_id", "blk_ix JOIN cv_reg ON cv_ref = cv_id"
    return rng.choice([
        (q.format(f"how many kilograms (net) were picked in total from the block '{b}'?"),
         f"SELECT SUM(kg_net) FROM {picks} WHERE blk_nm = '{b}'", ["blk_ix", "hv_lg"]),
        (q.format(f"how many picks from the block '{b}' were graded '{g}'?"),
         f"SELECT COUNT(*) FROM {picks} WHERE blk_nm = '{b}' AND grade_c = '{g}'", ["blk_ix", "hv_lg"]),
        (q.format(f"how many kilograms (net) were picked in total from blocks facing {aspect}?"),
         f"SELECT SUM(kg_net) FROM {picks} WHERE aspect = '{aspect}'", ["blk_ix", "hv_lg"]),
        (q.format(f"which cultivar is planted in the block '{b}'? Answer with the cultivar's name only."),
         f"SELECT cv_nm FROM {planted} WHERE blk_nm = '{b}'", ["blk_ix", "cv_reg"]),
        (q.format(f"in which year was the cultivar planted in the block '{b}' introduced?"),
         f"SELECT intro_yr FROM {planted} WHERE blk_nm = '{b}'", ["blk_ix", "cv_reg"]),
        (q.format(f"how many blocks are planted with {fruit} cultivars?"),
         f"SELECT COUNT(*) FROM {planted} WHERE fruit_k = '{fruit}'", ["blk_ix", "cv_reg"]),
        (q.format(f"what is the total area, in square metres, of the blocks planted with the cultivar '{c}'?"),
         f"SELECT SUM(area_m2) FROM {planted} WHERE cv_nm = '{c}'", ["blk_ix", "cv_reg"]),
        (q.format(f"how many blocks were planted before {y}?"), f"SELECT COUNT(*) FROM blk_ix WHERE plant_yr < {y}",
         ["blk_ix"]),
        (q.format(f"how many picks in week {wk} weighed more than {n} kg net?"),
         f"SELECT COUNT(*) FROM hv_lg WHERE pk_wk = {wk} AND kg_net > {n}", ["hv_lg"])])


def gen_duck_one(rng, data):  # the question names the table and the column
    t = rng.choice(list(TABLES))
    col = rng.choice([c for c in TABLES[t][1:] if c not in TEXT_COLUMNS + ("cv_ref", "blk_ref")])
    if rng.random() < 0.5:
        x = rng.choice([r[TABLES[t].index(col)] for r in data["tables"][t]])
        return (f"In the DuckDB table {t}, how many rows have {col} greater than {x}?",
                f"SELECT COUNT(*) FROM {t} WHERE {col} > {x}", [])
    agg = rng.choice(["MAX", "MIN", "SUM"])
    words = {"MAX": "the largest value", "MIN": "the smallest value", "SUM": "the sum"}[agg]
    return f"In the DuckDB table {t}, what is {words} of the column {col}?", f"SELECT {agg}({col}) FROM {t}", []


def duck_task(gen, rng, data, db):
    q, sql, described = gen(rng, data)
    (value,), = db.execute(sql).fetchall()
    calls = ([call("list_tables")] if described else []) + [call("list_columns", table=t) for t in described]
    return q, fmt(value), "text" if isinstance(value, str) else "number", calls + [call("execute_query", sql=sql)]


def gen_tracker_multi(rng, data):
    """(question, answer, type, oracle calls): an item found by its title (search), then read by its id."""
    items = data["items"]
    it, ep = rng.choice(items[4:]), rng.choice(items[:4])
    src, dst = (items[i - 1] for i in rng.choice(data["blocks"]))
    q = "In the farm's task tracker, {}"
    find = lambda x: call("search", query=x["title"])  # noqa: E731
    kids = [x for x in items if x["parent"] == ep["id"]]
    options = [
        (q.format(f"what is the title of the item that blocks '{dst['title']}'?"), src["title"], "text",
         [find(dst), call("get_blocking_items", item_id=dst["id"])]),
        (q.format(f"what is the status of the item that blocks '{dst['title']}'? Answer with the status as the "
                  "tracker writes it."), src["status"], "text", [find(dst), call("get_blocking_items", item_id=dst["id"])]),
        (q.format(f"what is the priority of the item '{it['title']}'?"), fmt(it["priority"]), "number",
         [find(it), call("get_item", item_id=it["id"])]),
        (q.format(f"what is the complexity of the item '{it['title']}'?"), fmt(it["complexity"]), "number",
         [find(it), call("get_item", item_id=it["id"])]),
        (q.format(f"how many of the items under the epic '{ep['title']}' are done or closed?"),
         fmt(sum(x["status"] in ("done", "closed") for x in kids)), "number", [find(ep), call("get_epic_progress", item_id=ep["id"])]),
        (q.format(f"how many of the items under the epic '{ep['title']}' are issues?"),
         fmt(sum(x["type"] == "issue" for x in kids)), "number", [find(ep), call("list_children", item_id=ep["id"])])]
    if it["parent"]:
        options.append((q.format(f"under which epic is the item '{it['title']}'? Answer with the epic's title."),
                        items[it["parent"] - 1]["title"], "text",
                        [find(it), call("get_item", item_id=it["id"]), call("get_item", item_id=it["parent"])]))
    return rng.choice(options)


def gen_tracker_one(rng, data):  # the item is named by its number: one get_item
    it = rng.choice(data["items"])
    field = rng.choice(["priority", "complexity", "title"])
    q = f"In the farm's task tracker, what is the {field} of item number {it['id']}?"
    calls = [call("get_item", item_id=it["id"])]
    return (q, it[field], "text", calls) if field == "title" else (q, fmt(it[field]), "number", calls)


def gen_files_multi(rng, data):
    """Index questions read the index (2 calls); reading questions the station's file it names (3)."""
    s = rng.choice(data["stations"])
    days = s["days"]
    d = rng.choice([day for day, hi, lo, _ in days if hi and lo])  # no answer of 0
    q = f"According to the weather-station files, {{}} at the {s['name']} station{{}}"
    index = [call("list_directory", path="."), call("read_file", path=INDEX)]
    read = index + [call("read_file", path=s["file"])]
    # each answer a value a result shows (no sum or count of the policy's own: --rescue narrow=N grounds a number only
    # where a result showed it)
    return rng.choice([(q.format("what is the elevation, in metres, of the weather sensor", "?"), fmt(s["elev_m"]), "number", index),
                       (q.format("which sensor model is installed", "? Answer with the model only."), s["sensor"], "text", index),
                       (q.format("what was the maximum temperature, in degrees Celsius, recorded", f" on day {d}?"),
                        fmt(days[d - 1][1] / 10), "number", read),
                       (q.format("what was the minimum temperature, in degrees Celsius, recorded", f" on day {d}?"),
                        fmt(days[d - 1][2] / 10), "number", read)])


def gen_files_one(rng, data):
    s, d = rng.choice(data["stations"]), rng.randint(1, 14)
    col = rng.choice(["tmax_c", "tmin_c", "rain_mm"])
    return (f"In the file '{s['file']}', what is the value of {col} on day {d}?",
            fmt(s["days"][d - 1][["tmax_c", "tmin_c", "rain_mm"].index(col) + 1] / 10), "number",
            [call("read_file", path=s["file"])])


def make_rows(data: dict, seed: int) -> list[dict]:
    rngs = {f: random.Random(f"{seed}:{f}") for f in FAMILIES}
    with closing(memory_db(data)) as db:
        tasks = {"duck-multi": unique(lambda r: duck_task(gen_duck_multi, r, data, db), FAMILIES["duck-multi"], rngs["duck-multi"]),
                 "tracker-multi": unique(lambda r: gen_tracker_multi(r, data), FAMILIES["tracker-multi"], rngs["tracker-multi"]),
                 "files-multi": unique(lambda r: gen_files_multi(r, data), FAMILIES["files-multi"], rngs["files-multi"]),
                 "duck-one": unique(lambda r: duck_task(gen_duck_one, r, data, db), FAMILIES["duck-one"], rngs["duck-one"]),
                 "tracker-one": unique(lambda r: gen_tracker_one(r, data), FAMILIES["tracker-one"], rngs["tracker-one"], strict=False),
                 "files-one": unique(lambda r: gen_files_one(r, data), FAMILIES["files-one"], rngs["files-one"])}
    return [{"data_source": f"world/{fam}",
             "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
             "env_class": "mcp",
             "reward_spec": {"method": "rule", "ground_truth": {"answer": answer, "type": typ, "check": []}},
             "extra_info": {"family": fam, "split": "train", "index": i, "oracle_calls": calls, "oracle_answer": answer,
                            "tools": WORLD_TOOLS}}
            for fam, ts in tasks.items() for i, (q, answer, typ, calls) in enumerate(ts)]


def write_files(folder: str, data: dict) -> None:
    """The folder filesystem-mcp serves: a README, the station index, one CSV of readings per station."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.join(folder, "rd"))
    with open(os.path.join(folder, "README.txt"), "w") as f:
        f.write("Weather stations of the orchard, first fortnight of April 2025. The index names each station's file.\n")
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"stations": [{k: v for k, v in s.items() if k != "days"} for s in data["stations"]]}, f, indent=1)
    for s in data["stations"]:
        with open(os.path.join(folder, s["file"]), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["day", "tmax_c", "tmin_c", "rain_mm"])
            w.writerows((d, f"{hi / 10:.1f}", f"{lo / 10:.1f}", f"{r / 10:.1f}") for d, hi, lo, r in s["days"])


def servers_config(out: str, duck: str, kanban: str, fs: str, build: bool = False) -> dict:
    """The world's servers; build=True: the database writable and every tracker tool shown, to seed them."""
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    track = os.path.join(out, "tracker")
    cfg = {"mcpServers": {
        "orchard": {"command": duck, "args": ["--db-path", os.path.join(out, "orchard.duckdb"), "--ephemeral-connections"],
                    "env": {**env, "FASTMCP_CHECK_FOR_UPDATES": "off", "HOME": os.path.join(out, "home")},
                    "tools": READ["orchard"]},
        "tracker": {"command": kanban, "cwd": os.path.join(track, "farm"), "tools": READ["tracker"],
                    "env": {**env, "KANBAN_PROJECT_DIR": os.path.join(track, "farm"), "HOME": os.path.join(out, "home"),
                            "KANBAN_SQLITE_PATH": os.path.join(track, "kanban.db"),
                            # kanban-mcp embeds each item it writes with a model fetched from the Hugging Face hub
                            # wherever onnxruntime imports; offline it skips that at once (without: minutes of retries
                            # an item where the hub cannot be reached)
                            "HF_HUB_OFFLINE": "1"}},
        "files": {"command": fs, "args": ["."], "cwd": os.path.join(out, "files"), "exclude_tools": ["write_file"],
                  **({"env": env} if env else {})}}}
    for spec in cfg["mcpServers"].values():
        spec["row_tools"] = True
    if build:
        cfg = {"mcpServers": {k: cfg["mcpServers"][k] for k in ("orchard", "tracker")}}
        cfg["mcpServers"]["orchard"]["args"] = cfg["mcpServers"]["orchard"]["args"][:2] + ["--read-write"]
        for spec in cfg["mcpServers"].values():
            spec.pop("tools")
            spec["row_tools"] = False
    return cfg


def seed_servers(out: str, data: dict, duck: str, kanban: str, fs: str) -> None:
    """Write the tables and the tracker through the servers' own tools, then read them back: the build stops
    unless they hold exactly `data` (so the answers computed from it are what the servers will show)."""
    from mcp_tools.pool import MCPPool
    for p in ("orchard.duckdb", "orchard.duckdb.wal", "tracker"):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            shutil.rmtree(os.path.join(out, p)) if os.path.isdir(os.path.join(out, p)) else os.remove(os.path.join(out, p))
    os.makedirs(os.path.join(out, "tracker", "farm"))
    os.makedirs(os.path.join(out, "home"), exist_ok=True)
    with MCPPool(servers_config(out, duck, kanban, fs, build=True)) as pool:
        sess = pool.open_session()

        def run(tool, **args):
            text, err, _, _ = pool.call(sess, tool, args)
            if err:
                raise RuntimeError(f"seeding the world: {tool} {args} failed: {text[:300]}")
            return json.loads(text)
        for t, rows in data["tables"].items():
            kinds = ["INTEGER PRIMARY KEY"] + ["VARCHAR" if c in TEXT_COLUMNS else "INTEGER" for c in TABLES[t][1:]]
            run("execute_query", sql=f"CREATE TABLE {t} ({', '.join(f'{c} {k}' for c, k in zip(TABLES[t], kinds))})")
            run("execute_query", sql=f"INSERT INTO {t} VALUES " + ", ".join(
                "(" + ", ".join(f"'{v}'" if isinstance(v, str) else str(v) for v in r) + ")" for r in rows))
            back = run("execute_query", sql=f"SELECT * FROM {t} ORDER BY 1")["rows"]
            assert [tuple(r) for r in back] == sorted(rows), f"{t}: the database holds other rows than written"
        for x in data["items"]:  # in id order: the tracker numbers items 1, 2, ... as they come
            args = dict(item_type=x["type"], title=x["title"], priority=x["priority"], complexity=x["complexity"])
            got = run("new_item", **args, **({"parent_id": x["parent"]} if x["parent"] else {}))["item"]["id"]
            assert got == x["id"], f"the tracker numbered {x['title']!r} {got}, not {x['id']}: start from an empty kanban.db"
        for x in data["items"][4:] + data["items"][:4]:  # epics last: kanban-mcp 0.2.0 moves an epic to "review"
            if x["status"] != "backlog":                      # once its last open child is done (_auto_advance_ancestors)
                run("set_status", item_id=x["id"], status=x["status"])
        for src, dst in data["blocks"]:
            run("add_relationship", source_id=src, target_id=dst, relationship_type="blocks")
        for tag, ids in data["tags"].items():
            for i in ids:
                run("add_tag", item_id=i, tag_name=tag)
        for x in data["items"]:
            got = run("get_item", item_id=x["id"])["item"]
            want = dict(title=x["title"], type_name=x["type"], status_name=x["status"], priority=x["priority"],
                        complexity=x["complexity"], parent_id=x["parent"])
            assert {k: got[k] for k in want} == want, f"tracker item {x['id']}: {got} is not {want}"
            hits = [h["id"] for h in run("search", query=x["title"])["items"]]
            assert x["id"] in hits, f"search {x['title']!r} does not find item {x['id']}"
        for src, dst in data["blocks"]:
            assert [b["id"] for b in run("get_blocking_items", item_id=dst)["blockers"]] == [src]
        for e in data["items"][:4]:  # under MCPEnv's max_result_chars (4000), so that no oracle reads a cut list
            assert len(json.dumps(run("list_children", item_id=e["id"]), indent=2)) < 4000, f"epic {e['id']}: too many children"
        counts = {t["name"]: t["count"] for t in run("list_tags")["tags"]}
        assert counts == {t: len(ids) for t, ids in data["tags"].items()}, f"tag counts {counts}"
        pool.close_session(sess)


def check(out: str, limit: int | None = None) -> bool:
    """Every row (or the first `limit` of each family): the oracle scores 1.0, a wrong answer 0.0 (lab/transfer.py's)."""
    from mcp_tools.pool import MCPPool
    from support.rows import load_rows
    by_fam = collections.defaultdict(list)
    for r in load_rows(os.path.join(out, "rows.jsonl")):
        by_fam[r["extra_info"]["family"]].append(r)
    with MCPPool(os.path.join(out, "servers.json")) as pool:
        return check_families(pool, by_fam, limit)


def main(argv=None) -> int:
    here = os.path.dirname(sys.executable)
    ap = argparse.ArgumentParser(description="Build (or --check) the training world on three third-party MCP servers.")
    ap.add_argument("--out", default="data/out/world", help="folder for orchard.duckdb, tracker/, files/, servers.json, rows.jsonl")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the data and the rows")
    ap.add_argument("--duck-server", default=os.path.join(here, "mcp-server-motherduck"), help="the mcp-server-motherduck script")
    ap.add_argument("--kanban-server", default=os.path.join(here, "kanban-mcp"), help="the kanban-mcp script")
    ap.add_argument("--fs-server", default=os.path.join(here, "filesystem-mcp"), help="the filesystem-mcp script")
    ap.add_argument("--check", action="store_true", help="replay every row through MCPEnv instead of building")
    ap.add_argument("--limit", type=int, default=None, help="--check only the first N rows of each family")
    a = ap.parse_args(argv)
    if a.check:
        return 0 if check(a.out, a.limit) else 1
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    servers = [os.path.abspath(s) if os.sep in s else s for s in (a.duck_server, a.kanban_server, a.fs_server)]
    data = world_data(a.seed)
    rows = make_rows(data, a.seed)
    write_files(os.path.join(out, "files"), data)
    seed_servers(out, data, *servers)
    with open(os.path.join(out, "servers.json"), "w") as f:
        json.dump(servers_config(out, *servers), f, indent=2)
    with open(os.path.join(out, "rows.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(out, "train.jsonl"), "w") as f:  # a question and an answer only, as a user's rows come
        f.writelines(json.dumps({**r, "extra_info": {k: v for k, v in r["extra_info"].items()
                                                     if k not in ("oracle_calls", "oracle_answer")}}) + "\n" for r in rows)
    mix = collections.Counter(r["extra_info"]["family"] for r in rows)
    print(f"wrote {len(rows)} rows to {out}/rows.jsonl ({', '.join(f'{k} {v}' for k, v in mix.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
