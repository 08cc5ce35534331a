r"""
A transfer set: multi-step tool-use tasks on four MCP servers from PyPI that this project did not
write and never trains on, to measure whether a policy trained on mcp_tools/tasks.py (the bundled
server) carries over to tools it has never seen. It builds, all deterministic from --seed:

    OUT/library.db    SQLite, 3 tables: auth_reg (10 authors), bk_cat (24 books), circulation (60 loans)
    OUT/repo/         a git repo of 10 commits (fixed authors, emails, dates: the hashes never change)
    OUT/sheets/depot.xlsx  a workbook, 3 sheets: inv_q3 (16 items), sup_ls (5 suppliers), shp_24 (40 shipments)
    OUT/servers.json  {"mcpServers": {"sqlite", "git", "time", "excel"}}, the write tools hidden
    OUT/rows.jsonl    rows in mcp_tools/tasks.py's format; data_source "transfer/FAMILY"

Families (oracle calls):  sqlite-multi 30  list_tables -> describe_table (1-3 tables) -> read_query (3-5)
                          git-multi    20  git_log -> git_show: a commit's changed file, file count, email (2)
                          excel-multi  20  describe_workbook -> read_range (1-2 sheets): an item's stock,
                                           price, supplier's city, units shipped; a supplier's items (2-3)
                          sqlite-one   10  the table and column named in the question: read_query (1)
                          git-one      10  the author of the commit with a given message: git_log (1)
                          excel-one    10  the cell and sheet named in the question: read_range (1)
                          time-one     10  convert_time between zones without daylight saving (1)
The excel families (excel-mcp-server) were added after the training recipe had been shaped with the
sqlite rows in mind (docs/results.md says where); no training choice has been made with them in view.
The table and column names are abbreviations (bk_cat, pg_count, ctry, days_out) that no question of
the multi family uses (tested): a model has to look them up, as the bundled discovery family asks,
and most questions join two or three tables. Git questions say repo_path '.', since the git server
runs in the repo (cwd), and the workbook is named by its file name, which the excel server reads inside
OUT/sheets (its --allow-dir), so rows name no path of this machine. The sheet and column names are
abbreviations too (inv_q3, unit_c, sup_ref), and no excel-multi question names one (tested). Every answer is computed from what was
written (sqlite3 on the database, git plumbing on the repo, zoneinfo), never typed by hand.

mcp-server-sqlite 2025.4.25 (the last release of the reference server) uses the mcp 1.x server API
that mcp 2.x removed, so it cannot run in the project's venv (mcp>=2.3): give it its own venv and
pass its script with --sqlite-server (the default is the one beside this Python).

    bash lab/recipes/transfer.sh                  # all of the below (WHEELS=DIR: from wheel files; TRAIN=1: the user's case)
    pip install mcp-server-git excel-mcp-server   # mcp-server-time is in requirements.txt; git needs the git CLI
    python -m venv ~/.cache/nanorl/sqlite-mcp
    ~/.cache/nanorl/sqlite-mcp/bin/pip install mcp-server-sqlite==2025.4.25 'mcp>=1.6,<2'
    python lab/transfer.py --out data/out/transfer --sqlite-server ~/.cache/nanorl/sqlite-mcp/bin/mcp-server-sqlite
    python lab/transfer.py --out data/out/transfer --check   # oracle -> 1.0, a wrong answer -> 0.0, every row
    python eval.py --env mcp --mcp-config data/out/transfer/servers.json --eval-data data/out/transfer/rows.jsonl ...

Training rows a user brings (--split train, OUT e.g. data/out/transfer-train): the same four servers over a
world of its own (--seed 1 by default; other authors, countries, committers, suppliers and time zones, so that no
answer of the test set comes from a list both share; a repo of 15 other commits), the same kinds of question, 294
rows (sqlite-multi 111, git-multi 30, excel-multi 47, sqlite-one 25, git-one 15, excel-one 28, time-one 38) with a
question and an answer only (no oracle calls, as a user's rows come), and none of whose questions is a test question
(dropped where the templates meet). Training on them and
scoring on the test set is the user's case, a server of their own and rows for it; it is not transfer to unseen
tools, which the test set alone measures for a policy trained on the bundled tasks (lab/recipes/headline.sh
transfer-rl runs it).

Test: python -m pytest -q tests/test_mcp.py   (its lab/transfer.py section, last)
"""
import argparse
import collections
import datetime as dt
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import zipfile
import contextlib
from contextlib import closing
from zoneinfo import ZoneInfo

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from mcp_tools.tasks import SYSTEM_PROMPT, call, fmt  # noqa: E402

TRAIN_FAMILIES = {"sqlite-multi": 120, "excel-multi": 60, "sqlite-one": 30, "excel-one": 30, "time-one": 40}  # at most (git: a
# row or two a commit); excel's supplier questions and time's differences have fewer distinct questions than asked
FAMILIES = {"sqlite-multi": 30, "git-multi": 20, "excel-multi": 20, "sqlite-one": 10, "git-one": 10, "excel-one": 10,
            "time-one": 10}
TABLES = {"auth_reg": ["auth_id", "full_nm", "ctry", "born_yr"],
          "bk_cat": ["bk_id", "ttl", "auth_ref", "pg_count", "pub_yr", "shelf_cd"],
          "circulation": ["ln_id", "bk_ref", "mbr_cd", "days_out", "late_fee_c"]}
TEXT_COLUMNS = ("full_nm", "ctry", "ttl", "shelf_cd", "mbr_cd")
HIDDEN = {"sqlite": ["write_query", "create_table", "append_insight"],
          "git": ["git_commit", "git_add", "git_reset", "git_create_branch", "git_checkout"],
          "excel": ["export_workbook"]}  # excel runs --read-only (no write tool); this one returns the file as base64
WORKBOOK = "depot.xlsx"
SHEETS = {"inv_q3": ["sku", "itm_nm", "qty", "unit_c", "sup_ref"], "sup_ls": ["sup_id", "sup_nm", "hq_cty"],
          "shp_24": ["shp_id", "sku_ref", "n_unt", "wk"]}
_GOODS = [f"{a} {n}" for a in "Copper Enamel Cedar Linen Brass Slate Wicker Porcelain".split()
          for n in "Kettle Lantern Basket Ladle Tray Jar Clock Vase".split()]
_SUPPLIERS = [("Halvorsen Metals", "Bergen"), ("Okafor Glassworks", "Lagos"), ("Brandt & Weil", "Leipzig"),
              ("Sato Craft Supply", "Sendai"), ("Costa Ferreira Lda", "Porto")]
ZONES = {"Asia/Tokyo": 9.0, "Asia/Kolkata": 5.5, "Asia/Shanghai": 8.0, "UTC": 0.0, "Asia/Dubai": 4.0}  # no DST
_NAMES = ["Mirela Ostrowska", "Kwame Adjei-Boateng", "Solveig Haarstad", "Tiago Ferraz", "Yuki Morimoto",
          "Ines Valcarcel", "Dara Quinlivan", "Priya Ramanathan", "Oskar Lindqvist", "Amara Okonkwo"]
_COUNTRIES = ["Norway", "Ghana", "Portugal", "Japan", "Chile", "India"]
_ADJ = "Amber Silent Copper Hollow Northern Paper Drowned Lantern Glass Winter Crooked Salt".split()
_NOUN = "Orchard Cartographer Harbor Meridian Archive Quarry Lighthouse Ledger Tide Atlas Furnace".split()
# the repo's authors (name, email) and its commits (message, the files it appends a line to), oldest first
_PEOPLE = [("Ines Valdecasas", "ines@quarrystone.dev"), ("Tomasz Wierzba", "t.wierzba@quarrystone.dev"),
           ("Akosua Mensah-Lyle", "akosua.ml@fernhollow.org"), ("Bram Oosterhuis", "bram@oosterhuis-werk.nl")]
_COMMITS = [
    ("Start the ledger parser", ["README.md", "src/ledger/parse.py"]), ("Pin the build image", ["ci/build.yml"]),
    ("Add the quarterly rollup command", ["src/ledger/rollup.py", "src/ledger/cli.py", "docs/rollup.md"]),
    ("Read amounts with thousands separators", ["src/ledger/parse.py"]),
    ("Document the config keys", ["docs/config.md"]),
    ("Reject negative tax brackets", ["src/ledger/tax.py", "tests/test_tax.py"]),
    ("Rename the vendor column to payee", ["src/ledger/parse.py", "src/ledger/rollup.py", "tests/test_parse.py"]),
    ("Cache exchange rates per day", ["src/ledger/rates.py"]), ("Bump the version to 0.4.0", ["pyproject.toml"]),
    ("Fix the off-by-one in week numbers", ["src/ledger/weeks.py", "tests/test_weeks.py"])]
# the training world (--split train): other authors, countries, committers, suppliers, zones and commits, so that
# no answer of the test set comes from a list both worlds share
_TRAIN_NAMES = ["Lucia Berrocal", "Emeka Obiora", "Freya Lindholm", "Rui Monteverde", "Haruto Kisaragi",
                "Zofia Grabowska", "Ciaran Mulvey", "Anjali Deshpande", "Henrik Vesterby", "Ngozi Eze"]
_TRAIN_COUNTRIES = ["Spain", "Kenya", "Iceland", "Brazil", "Vietnam", "Poland"]
_TRAIN_PEOPLE = [("Marta Quesada", "marta@larkspur-labs.io"), ("Dawit Bekele", "dawit.b@larkspur-labs.io"),
                 ("Ilse Verhoeven", "ilse@verhoeven.dev"), ("Kofi Asante-Mills", "kofi.am@tidewater.org")]
_TRAIN_SUPPLIERS = [("Ruiz Ceramica", "Valencia"), ("Mwangi Textiles", "Nairobi"), ("Nordlys Trading", "Tromso"),
                    ("Pham Lacquerware", "Hue"), ("Kowal Tools", "Gdansk")]
TRAIN_ZONES = {"Europe/Moscow": 3.0, "Asia/Karachi": 5.0, "Asia/Bangkok": 7.0, "America/Bogota": -5.0,
               "Asia/Kathmandu": 5.75}  # no DST either
_TRAIN_COMMITS = [  # the training world's repo: other messages, other files
    ("Sketch the inventory importer", ["NOTES.md", "src/stock/importer.py"]), ("Add a lint job", ["ci/lint.yml"]),
    ("Parse pallet labels", ["src/stock/labels.py", "tests/test_labels.py"]),
    ("Move the warehouse codes to a table", ["src/stock/codes.py", "data/codes.csv", "docs/codes.md"]),
    ("Explain the reorder rule", ["docs/reorder.md"]), ("Round weights to grams", ["src/stock/weights.py"]),
    ("Split the importer into stages", ["src/stock/importer.py", "src/stock/stages.py", "tests/test_stages.py"]),
    ("Drop the legacy CSV reader", ["src/stock/legacy.py"]), ("Count damaged units apart", ["src/stock/damage.py",
                                                                                           "tests/test_damage.py"]),
    ("Log skipped rows", ["src/stock/importer.py"]), ("Raise the schema version of the importer", ["src/stock/schema.py"]),
    ("Accept dates with slashes", ["src/stock/dates.py", "tests/test_dates.py"]),
    ("Name the bins by aisle", ["src/stock/bins.py", "docs/bins.md"]), ("Cache the supplier list", ["src/stock/suppliers.py"]),
    ("Fix the total on empty orders", ["src/stock/orders.py", "tests/test_orders.py"])]
WORLDS = {"test": dict(names=_NAMES, countries=_COUNTRIES, people=_PEOPLE, suppliers=_SUPPLIERS, zones=ZONES, commits=_COMMITS),
          "train": dict(names=_TRAIN_NAMES, countries=_TRAIN_COUNTRIES, people=_TRAIN_PEOPLE, suppliers=_TRAIN_SUPPLIERS,
                        zones=TRAIN_ZONES, commits=_TRAIN_COMMITS)}


def build_db(path: str, seed: int, w: dict = WORLDS["test"]) -> None:
    """A small library: 10 authors, 24 books (distinct page counts), 60 loans; ids are catalogue numbers."""
    rng = random.Random(f"{seed}:library")
    with contextlib.suppress(FileNotFoundError):  # a rebuild starts from nothing
        os.remove(path)
    aids = rng.sample(range(100, 1000), len(w["names"]))
    authors = [(a, n, rng.choice(w["countries"]), rng.randint(1931, 1990)) for a, n in zip(aids, w["names"])]
    titles = rng.sample([f"The {a} {n}" for a in _ADJ for n in _NOUN], 24)
    books = [(b, t, rng.choice(aids), p, rng.randint(1951, 2022), f"{rng.choice('ABCDEFG')}-{rng.randint(1, 30)}")
             for b, t, p in zip(rng.sample(range(4000, 10000), 24), titles, rng.sample(range(90, 720), 24))]
    loans = [(lid, rng.choice(books[:18])[0], f"M{rng.randint(1, 40):03d}", d, max(0, d - 21) * 25)  # 6 never lent
             for lid, d in zip(rng.sample(range(20000, 30000), 60), (rng.randint(1, 42) for _ in range(60)))]
    with closing(sqlite3.connect(path)) as db, db:  # closed, and committed (sqlite3's own `with` only commits)
        for (t, cols), rows in zip(TABLES.items(), (authors, books, loans)):
            kinds = ["INTEGER PRIMARY KEY"] + ["TEXT" if c in TEXT_COLUMNS else "INTEGER" for c in cols[1:]]
            db.execute(f"CREATE TABLE {t} ({', '.join(f'{c} {k}' for c, k in zip(cols, kinds))})")
            db.executemany(f"INSERT INTO {t} VALUES ({', '.join('?' * len(cols))})", rows)


def git(repo: str, *args: str, env: dict | None = None) -> str:
    """git in repo, with no user or system config (no hooks, signing or templates leak in)."""
    base = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", "-C", repo, *args], env={**base, **(env or {})}, check=True,
                          capture_output=True, text=True).stdout


def build_repo(path: str, seed: int, w: dict = WORLDS["test"]) -> list[dict]:
    """The repo of the world's commits (message, files), oldest first; returns them as git itself reports them:
    hash, author, email, message, files."""
    rng = random.Random(f"{seed}:repo")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    git(path, "init", "-q", "-b", "main")
    when = dt.datetime(2024, 2, 5, 9, 0, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    for i, (msg, files) in enumerate(w["commits"]):
        name, email = rng.choice(w["people"])
        when += dt.timedelta(hours=rng.randint(3, 60), minutes=rng.randint(0, 59))
        for f in files:
            os.makedirs(os.path.join(path, os.path.dirname(f)), exist_ok=True)
            with open(os.path.join(path, f), "a", encoding="utf-8") as fh:
                fh.write(f"# {msg} ({i + 1})\nstep_{i + 1} = {rng.randint(0, 999)}\n")
        git(path, "add", *files)
        stamp = when.isoformat()
        git(path, "commit", "-q", "-m", msg, env={"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email,
            "GIT_AUTHOR_DATE": stamp, "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email,
            "GIT_COMMITTER_DATE": stamp})
    commits = []
    for line in git(path, "log", "--reverse", "--format=%H%x1f%an%x1f%ae%x1f%s").splitlines():
        h, an, ae, s = line.split("\x1f")
        files = git(path, "diff-tree", "--root", "--no-commit-id", "--name-only", "-r", h).split()
        commits.append({"hash": h, "author": an, "email": ae, "message": s, "files": files})
    return commits


def sql_value(db_path: str, sql: str):
    """The one value a query returns (Python's sqlite3, not the server)."""
    with closing(sqlite3.connect(db_path)) as db:
        (value,), = db.execute(sql).fetchall()
    return value


def gen_sqlite_multi(rng, db_path, w=WORLDS["test"]):
    """A question in plain words: (question, sql, the tables its oracle describes)."""
    title = sql_value(db_path, f"SELECT ttl FROM bk_cat WHERE bk_id IN (SELECT bk_ref FROM circulation) "
                               f"ORDER BY bk_id LIMIT 1 OFFSET {rng.randrange(10)}")
    n, y = rng.randrange(150, 650, 10), rng.randrange(1960, 2020)
    ctry, name = rng.choice(w["countries"]), rng.choice(w["names"])
    by_author, lent = "bk_cat JOIN auth_reg ON auth_ref = auth_id", "bk_cat JOIN circulation ON bk_ref = bk_id"
    return rng.choice([
        (f"How many books in the library's catalogue have more than {n} pages?",
         f"SELECT COUNT(*) FROM bk_cat WHERE pg_count > {n}", ["bk_cat"]),
        (f"How many books in the library's catalogue were published before {y}?",
         f"SELECT COUNT(*) FROM bk_cat WHERE pub_yr < {y}", ["bk_cat"]),
        (f"How many books in the library's catalogue were written by authors from {ctry}?",
         f"SELECT COUNT(*) FROM {by_author} WHERE ctry = '{ctry}'", ["bk_cat", "auth_reg"]),
        (f"Which country is the author of the book '{title}' from? Answer with the country only.",
         f"SELECT ctry FROM {by_author} WHERE ttl = '{title}'", ["bk_cat", "auth_reg"]),
        (f"How many times has the book '{title}' been lent out?",
         f"SELECT COUNT(*) FROM {lent} WHERE ttl = '{title}'", ["bk_cat", "circulation"]),
        (f"What is the total late fee, in cents, charged on the loans of the book '{title}'?",
         f"SELECT SUM(late_fee_c) FROM {lent} WHERE ttl = '{title}'", ["bk_cat", "circulation"]),
        (f"How many loans in the library's records are of books written by {name}?",
         f"SELECT COUNT(*) FROM {lent} JOIN auth_reg ON auth_ref = auth_id WHERE full_nm = '{name}'",
         ["circulation", "bk_cat", "auth_reg"])])


def gen_sqlite_one(rng, db_path, w=None):  # (w: as gen_sqlite_multi's; the question names table and column)
    t = rng.choice(list(TABLES))
    col = rng.choice([c for c in TABLES[t][1:] if c not in TEXT_COLUMNS + ("auth_ref", "bk_ref")])
    lo, hi = sql_value(db_path, f"SELECT MIN({col}) FROM {t}"), sql_value(db_path, f"SELECT MAX({col}) FROM {t}")
    if rng.random() < 0.5:
        x = rng.randint(lo, hi)
        return (f"In the SQLite table {t}, how many rows have {col} greater than {x}?",
                f"SELECT COUNT(*) FROM {t} WHERE {col} > {x}", [])
    agg = rng.choice(["MAX", "MIN", "SUM"])
    words = {"MAX": "the largest value", "MIN": "the smallest value", "SUM": "the sum"}[agg]
    return f"In the SQLite table {t}, what is {words} of the column {col}?", f"SELECT {agg}({col}) FROM {t}", []


def sqlite_task(gen, rng, db_path, w=WORLDS["test"]):
    q, sql, described = gen(rng, db_path, w)
    value = sql_value(db_path, sql)
    calls = ([call("list_tables")] if described else []) + [call("describe_table", table_name=t) for t in described]
    return (q, fmt(value), "text" if isinstance(value, str) else "number", calls + [call("read_query", query=sql)])


def git_tasks(commits: list[dict], one: bool) -> list[tuple]:
    """One call: a commit's author (git_log shows the name). Two: its email (git_log shows none, git_show
    does), the one file it changed or how many (git_show of the hash that git_log gave)."""
    log, tasks = call("git_log", repo_path=".", max_count=len(commits)), []
    for c in commits:
        q = f"In the git repository at '.', {{}} the commit with the message '{c['message']}'{{}}"
        show = [log, call("git_show", repo_path=".", revision=c["hash"])]
        if one:
            tasks.append((q.format("who is the author of", "? Answer with the name."), c["author"], "text", [log]))
        elif len(c["files"]) == 1:
            tasks.append((q.format("which file did", " change? Answer with its path."), c["files"][0], "text", show))
        else:
            tasks.append((q.format("how many files did", " change?"), str(len(c["files"])), "number", show))
        if not one:
            tasks.append((q.format("what is the email address of the author of", "?"), c["email"], "text", show))
    return tasks


def gen_time(rng, difference: bool, zones: dict = ZONES):
    src, dst = rng.sample(sorted(zones), 2)
    if difference:  # asked so that the answer is positive
        src, dst = sorted((src, dst), key=zones.get)
        return (f"By how many hours is {dst} ahead of {src}?", fmt(zones[dst] - zones[src]), "number",
                [call("convert_time", source_timezone=src, time="12:00", target_timezone=dst)])
    hhmm = f"{rng.randrange(24):02d}:{rng.choice([0, 15, 30, 45]):02d}"
    t = dt.datetime.fromisoformat(f"2025-01-15T{hhmm}").replace(tzinfo=ZoneInfo(src)).astimezone(ZoneInfo(dst))
    return (f"When it is {hhmm} in the time zone {src}, what time is it in {dst}? Answer in 24-hour HH:MM.",
            t.strftime("%H:%M"), "text", [call("convert_time", source_timezone=src, time=hhmm, target_timezone=dst)])


def build_workbook(path: str, seed: int, w: dict = WORLDS["test"]) -> dict:
    """The depot workbook (write_xlsx): 16 items with catalogue numbers, 5 suppliers, 40 shipments of 12 of
    the items. Returns its sheets as written: {sheet: rows, the header first}."""
    rng = random.Random(f"{seed}:workbook")
    sups = [(i, n, c) for i, (n, c) in zip(rng.sample(range(700, 1000), len(w["suppliers"])), w["suppliers"])]
    items = [(k, name, rng.randint(3, 400), rng.randrange(199, 9999, 10), rng.choice(sups)[0])
             for k, name in zip(rng.sample(range(1000, 10000), 16), rng.sample(_GOODS, 16))]
    ships = [(sid, rng.choice(items[:12])[0], rng.randint(1, 60), rng.randint(1, 52))
             for sid in rng.sample(range(50000, 60000), 40)]
    sheets = {t: [cols, *rows] for (t, cols), rows in zip(SHEETS.items(), (items, sups, ships))}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_xlsx(path, sheets)
    return sheets


def write_xlsx(path: str, sheets: dict) -> None:
    """A minimal .xlsx (Office Open XML: the parts a reader needs, strings inline), byte for byte the same
    for the same sheets: written here so that building the set needs no spreadsheet package."""
    head = '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
    main, rel = "http://schemas.openxmlformats.org/spreadsheetml/2006/main", "http://schemas.openxmlformats.org"
    kind = "application/vnd.openxmlformats-officedocument.spreadsheetml"
    n = range(1, len(sheets) + 1)

    def cell(ref, v):
        if isinstance(v, int):
            return f'<c r="{ref}"><v>{v}</v></c>'
        text = str(v).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return f'<c r="{ref}" t="inlineStr"><is><t>{text}</t></is></c>'
    parts = {
        "[Content_Types].xml": f'<Types xmlns="{rel}/package/2006/content-types">'
        f'<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
        f'<Default Extension="xml" ContentType="application/xml"/>'
        f'<Override PartName="/xl/workbook.xml" ContentType="{kind}.sheet.main+xml"/>'
        + "".join(f'<Override PartName="/xl/worksheets/sheet{i}.xml" ContentType="{kind}.worksheet+xml"/>' for i in n)
        + "</Types>",
        "_rels/.rels": f'<Relationships xmlns="{rel}/package/2006/relationships"><Relationship Id="rId1" '
        f'Type="{rel}/officeDocument/2006/relationships/officeDocument" Target="xl/workbook.xml"/></Relationships>',
        "xl/workbook.xml": f'<workbook xmlns="{main}" xmlns:r="{rel}/officeDocument/2006/relationships"><sheets>'
        + "".join(f'<sheet name="{t}" sheetId="{i}" r:id="rId{i}"/>' for i, t in zip(n, sheets)) + "</sheets></workbook>",
        "xl/_rels/workbook.xml.rels": f'<Relationships xmlns="{rel}/package/2006/relationships">'
        + "".join(f'<Relationship Id="rId{i}" Type="{rel}/officeDocument/2006/relationships/worksheet" '
                  f'Target="worksheets/sheet{i}.xml"/>' for i in n) + "</Relationships>"}
    for i, rows in zip(n, sheets.values()):
        parts[f"xl/worksheets/sheet{i}.xml"] = f'<worksheet xmlns="{main}"><sheetData>' + "".join(
            f'<row r="{r}">' + "".join(cell(f"{chr(65 + c)}{r}", v) for c, v in enumerate(row)) + "</row>"
            for r, row in enumerate(rows, 1)) + "</sheetData></worksheet>"
    with zipfile.ZipFile(path, "w") as z:  # stored, a fixed date and system: the same bytes on any machine
        for name, xml in parts.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            info.create_system = 3
            z.writestr(info, head + xml)


def gen_excel_multi(rng, sheets: dict, kind: int) -> tuple:
    """A question of one of 5 kinds in plain words on the depot workbook, which names no sheet or column:
    (question, answer, type, oracle calls). Its oracle describes the workbook, then reads the sheets the
    answer needs."""
    items, sups, ships = (rows[1:] for rows in sheets.values())
    k, name, qty, price, sup = rng.choice(items)
    sup_name, city = next((n, c) for i, n, c in sups if i == sup)
    q = f"In the workbook '{WORKBOOK}', {{}}"
    read = {t: call("read_range", path=WORKBOOK, sheet=t) for t in SHEETS}
    first = [call("describe_workbook", path=WORKBOOK), read["inv_q3"]]
    other_sup = rng.choice(sups)
    return [
        (q.format(f"how many units of the item '{name}' are in stock?"), fmt(qty), "number", first),
        (q.format(f"what is the unit price, in cents, of the item '{name}'?"), fmt(price), "number", first),
        (q.format(f"in which city is the supplier of the item '{name}'? Answer with the city only."), city, "text",
         first + [read["sup_ls"]]),
        (q.format(f"how many different items does the supplier '{other_sup[1]}' supply?"),
         fmt(sum(s == other_sup[0] for *_, s in items)), "number",
         [call("describe_workbook", path=WORKBOOK), read["sup_ls"], read["inv_q3"]]),
        (q.format(f"how many units of the item '{name}' were shipped in total?"),
         fmt(sum(u for _, ref, u, _ in ships if ref == k)), "number", first + [read["shp_24"]])][kind]


def gen_excel_one(rng, sheets: dict) -> tuple:
    """The sheet and the cell are named: one read_range of that cell."""
    t = rng.choice(list(SHEETS))
    r, c = rng.randrange(1, len(sheets[t])), rng.randrange(len(SHEETS[t]))
    v, ref = sheets[t][r][c], f"{chr(65 + c)}{r + 1}"
    return (f"In the workbook '{WORKBOOK}', what is the value of the cell {ref} in the sheet '{t}'?", fmt(v),
            "number" if isinstance(v, int) else "text", [call("read_range", path=WORKBOOK, sheet=t, range=ref)])


def unique(gen, n: int, rng, strict: bool = True) -> list[tuple]:
    """n tasks of gen with distinct questions (strict=False: as many as 100 x n draws found, at most n)."""
    seen, out = set(), []
    for _ in range(100 * n):
        t = gen(rng)
        if t[0] not in seen and t[1] not in ("0", "None"):  # no zero or empty answer: too easy to guess
            seen.add(t[0])
            out.append(t)
        if len(out) == n:
            return out
    if not strict:
        return out
    raise RuntimeError(f"only {len(out)} distinct tasks, wanted {n}")


def make_rows(db_path: str, commits: list[dict], sheets: dict, seed: int, split: str = "test") -> list[dict]:
    """The rows of a world: FAMILIES' counts for the test set; split="train": up to TRAIN_FAMILIES' (module doc)."""
    rngs = {f: random.Random(f"{seed}:{f}") for f in FAMILIES}
    n, strict = (FAMILIES, True) if split == "test" else (TRAIN_FAMILIES, False)
    w = WORLDS[split]
    tasks = {"sqlite-multi": unique(lambda r: sqlite_task(gen_sqlite_multi, r, db_path, w), n["sqlite-multi"],
                                    rngs["sqlite-multi"], strict),
             "git-multi": git_tasks(commits, one=False),
             "excel-multi": [t for kind in range(5) for t in unique(lambda r: gen_excel_multi(r, sheets, kind),
                                                                     n["excel-multi"] // 5, rngs["excel-multi"], strict)],
             "sqlite-one": unique(lambda r: sqlite_task(gen_sqlite_one, r, db_path), n["sqlite-one"], rngs["sqlite-one"],
                                  strict),
             "git-one": git_tasks(commits, one=True),
             "excel-one": unique(lambda r: gen_excel_one(r, sheets), n["excel-one"], rngs["excel-one"], strict),
             "time-one": unique(lambda r: gen_time(r, False, w["zones"]), n["time-one"] * 7 // 10, rngs["time-one"], strict)
             + unique(lambda r: gen_time(r, True, w["zones"]), n["time-one"] * 3 // 10, rngs["time-one"], strict)}  # 7:3 conversions
    return [{"data_source": f"transfer/{fam}",
             "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
             "env_class": "mcp",
             "reward_spec": {"method": "rule", "ground_truth": {"answer": answer, "type": typ, "check": []}},
             "extra_info": {"family": fam, "split": split, "index": i, "oracle_calls": calls,
                            "oracle_answer": answer}}
            for fam, ts in tasks.items() for i, (q, answer, typ, calls) in enumerate(ts)]


def servers_config(db_path: str, repo: str, sqlite_server: str, sheets_dir: str) -> dict:
    """git, time and excel run as `python -m` by this Python, with its PYTHONPATH if one is set (the SDK
    starts servers without it); sqlite by its own script (module doc)."""
    env = {"env": {"PYTHONPATH": os.environ["PYTHONPATH"]}} if os.environ.get("PYTHONPATH") else {}
    return {"mcpServers": {
        "sqlite": {"command": sqlite_server, "args": ["--db-path", db_path], "exclude_tools": HIDDEN["sqlite"]},
        "git": {"command": sys.executable, "args": ["-m", "mcp_server_git", "--repository", repo], "cwd": repo,
                "exclude_tools": HIDDEN["git"], **env},
        "time": {"command": sys.executable, "args": ["-m", "mcp_server_time"], **env},
        "excel": {"command": sys.executable, "args": ["-m", "excel_mcp", "stdio", "--read-only", "--allow-dir", sheets_dir],
                  "exclude_tools": HIDDEN["excel"], **env}}}


def sqlite_problem(script: str) -> str | None:
    """Why the mcp-server-sqlite at script cannot start (not found, or its Python has mcp 2.x); None if it can."""
    if (path := shutil.which(script)) is None:
        return f"no mcp-server-sqlite at {script!r} (module doc: install it in its own venv, pass --sqlite-server)"
    with open(path, "rb") as f:
        head = f.readline().decode(errors="replace")
    if head.startswith("#!"):  # a console script: ask its Python which mcp it has
        v = subprocess.run([*head[2:].split(), "-c", "import importlib.metadata as m; print(m.version('mcp'))"],
                           capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                           ).stdout.strip()  # as the SDK starts it: without our PYTHONPATH
        if v and int(v.split(".")[0]) >= 2:  # no answer (an odd shebang): let the server's start tell
            return f"{path} runs with mcp {v}; mcp-server-sqlite 2025.4.25 needs mcp<2 (module doc)"
    return None


def play(env, row: dict, answer: str) -> tuple[float, bool]:
    """Replay the row's oracle calls through the env (hermes text, as a model writes them), then answer.
    Returns (reward, clean): clean = no call failed and a text answer appears in some tool result
    (mcp-server-sqlite answers errors as text starting "Error:", without MCP's isError flag)."""
    from mcp_tools.formats import FORMATS
    env.reset(row)
    shown, clean = "", True
    for c in row["extra_info"]["oracle_calls"]:
        obs, _, done, _ = env.step(FORMATS["hermes"].render(c["name"], c["arguments"]))
        clean &= not done and not any(m["content"].startswith("Error") for m in obs)
        shown += "\n".join(m["content"] for m in obs).casefold()
    _, r, done, info = env.step(f"<answer>{answer}</answer>")
    gt = row["reward_spec"]["ground_truth"]
    clean &= done and info["tool_errors"] + info["parse_errors"] == 0
    return r, clean and (gt["type"] == "number" or gt["answer"].casefold() in shown)


def check(out: str, limit: int | None = None) -> bool:
    """Every row (or the first `limit` of each family): the oracle scores 1.0, a wrong answer 0.0."""
    from mcp_tools.config import load_config
    from mcp_tools.pool import MCPPool
    from support.rows import load_rows
    config = os.path.join(out, "servers.json")
    by_fam = collections.defaultdict(list)
    for r in load_rows(os.path.join(out, "rows.jsonl")):
        if "oracle_calls" not in r["extra_info"]:
            print(f"{out}/rows.jsonl: a row without oracle calls (a --split train folder?): --check replays the test set's")
            return False
        by_fam[r["extra_info"]["family"]].append(r)
    if why := sqlite_problem(load_config(config)["mcpServers"]["sqlite"]["command"]):
        print(f"the sqlite server cannot start: {why}")
        return False
    with MCPPool(config) as pool:
        return check_families(pool, by_fam, limit)


def check_families(pool, by_fam: dict, limit: int | None = None) -> bool:
    """Each family's rows (the first `limit`) played through MCPEnv on pool: the oracle's calls and answer score
    1.0, a wrong answer 0.0, and no call fails; a line a family -> whether every row did (lab/world.py's too)."""
    from mcp_tools.env import MCPEnv
    ok = True
    print("tools:", ", ".join(pool.route))
    for fam, rows in by_fam.items():
        rows, right, wrong, clean = rows[:limit], 0, 0, 0
        for row in rows:
            gt = row["reward_spec"]["ground_truth"]
            bad = fmt(float(gt["answer"]) * 1.01 + 1) if gt["type"] == "number" else gt["answer"] + "x"
            r1, c1 = play(MCPEnv(pool=pool), row, row["extra_info"]["oracle_answer"])
            r0, c0 = play(MCPEnv(pool=pool), row, bad)
            right, wrong, clean = right + (r1 == 1.0), wrong + (r0 == 0.0), clean + (c1 and c0)
        good = right == wrong == clean == len(rows)
        ok &= good
        calls = sorted({len(r["extra_info"]["oracle_calls"]) for r in rows})
        print(f"{fam:13s} {len(rows):3d} rows  calls {calls}  oracle 1.0: {right}/{len(rows)}  wrong 0.0: "
              f"{wrong}/{len(rows)}  clean calls: {clean}/{len(rows)}  {'ok' if good else 'FAIL'}")
    return ok


def world_paths(out: str) -> tuple[str, str, str]:
    """Where a world lives in out: the database, the repo and the workbook's folder."""
    return os.path.join(out, "library.db"), os.path.join(out, "repo"), os.path.join(out, "sheets")


def build(out: str, seed: int, split: str) -> list[dict]:
    """The world (library.db, repo/, sheets/) in out, and its rows (with oracle calls)."""
    os.makedirs(out, exist_ok=True)
    db_path, repo, sheets_dir = world_paths(out)
    build_db(db_path, seed, WORLDS[split])
    sheets = build_workbook(os.path.join(sheets_dir, WORKBOOK), seed, WORLDS[split])
    commits = build_repo(repo, seed, WORLDS[split])
    return make_rows(db_path, commits, sheets, seed, split)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Build (or --check) the transfer set on third-party MCP servers.")
    ap.add_argument("--out", default="data/out/transfer", help="folder for library.db, repo/, servers.json, rows.jsonl")
    ap.add_argument("--seed", type=int, default=None, help="random seed of the data and the rows (0; --split train: 1)")
    ap.add_argument("--split", choices=["test", "train"], default="test",
                    help="test: the transfer set; train: a user's rows for the same servers over a world of its own, "
                         "no oracle calls, no test question (module doc)")
    ap.add_argument("--sqlite-server", default=os.path.join(os.path.dirname(sys.executable), "mcp-server-sqlite"),
                    help="the mcp-server-sqlite script, in a venv with mcp<2 (module doc)")
    ap.add_argument("--exclude", default=None, help="--split train: drop rows whose question is one of this file's rows "
                    "(the test set as built; default: the test set rebuilt here)")
    ap.add_argument("--check", action="store_true", help="replay every row through MCPEnv instead of building")
    ap.add_argument("--limit", type=int, default=None, help="--check only the first N rows of each family")
    a = ap.parse_args(argv)
    if a.check:
        return 0 if check(a.out, a.limit) else 1
    seed = a.seed if a.seed is not None else int(a.split == "train")
    if a.split == "train" and seed == 0:
        ap.error("--split train --seed 0 would draw the test world's numbers (its tables, workbook and repo): give another seed")
    out = os.path.abspath(a.out)
    rows = build(out, seed, a.split)
    if a.split == "train":  # a user's rows: no question of the test set, and no oracle calls
        question = lambda r: r["prompt"][-1]["content"]  # noqa: E731 (a row's one user message)
        if a.exclude:
            from support.rows import load_rows
            test = {question(r) for r in load_rows(a.exclude)}
        else:
            import tempfile
            with tempfile.TemporaryDirectory() as tmp:
                test = {question(r) for r in build(tmp, 0, "test")}
        rows = [{**r, "extra_info": {k: v for k, v in r["extra_info"].items() if k not in ("oracle_calls", "oracle_answer")}}
                for r in rows if question(r) not in test]
    db_path, repo, sheets_dir = world_paths(out)
    sqlite_server = os.path.abspath(a.sqlite_server) if os.sep in a.sqlite_server else a.sqlite_server
    with open(os.path.join(out, "servers.json"), "w") as f:
        json.dump(servers_config(db_path, repo, sqlite_server, sheets_dir), f, indent=2)
    with open(os.path.join(out, "rows.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    mix = collections.Counter(r["extra_info"]["family"] for r in rows)
    print(f"wrote {len(rows)} rows to {out}/rows.jsonl ({', '.join(f'{k} {v}' for k, v in mix.items())})")
    if why := sqlite_problem(sqlite_server):
        print(f"warning: the sqlite server will not start: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
