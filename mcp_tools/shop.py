"""
The bundled MCP server's world (mcp_tools/server.py serves it as tools): pure, seeded data and
functions, identical in every process, so mcp_tools/tasks.py computes its rows' answers from the same
tables and functions without starting a server.

    safe_eval("2 * (3 + 4)")                  the calculator: an ast whitelist, never eval
    convert_units_value, convert_currency_value, parse_date, add_days
    SHOP, PRODUCTS, CUSTOMERS                 the shop (shop_data(): products, customers, orders)
    RECORDS_SCHEMA, RECORDS                   the records database, whose names a question does not give away
    LINKED, linked_data()                     its linked tables: a child's rows name a parent by number (joins)
    run_select(sql, database="shop")          one validated read-only query, stopped after SQL_TIME_LIMIT
    knowledge_base(), cart_summary, product_sales_summary, text_statistics, transform

Bad arguments raise ValueError with a message meant for the model to read (the server turns it into
a tool error). The databases are in-memory sqlite, built when this module is imported, read-only to
every query (sqlite's query_only).

Test: python -m pytest -q tests/test_mcp.py -k "calc or sql or shop or records"
"""
import ast
import datetime as dt
import math
import operator
import os
import random
import re
import sqlite3
import threading
import time
from typing import NamedTuple


# ----------------------------------------------------------------------------------------------
# calculator: a whitelist walk over Python's ast. Names, attributes, calls other than the listed
# functions, subscripts, lambdas, comprehensions... are all rejected before anything runs.

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log,
          "log10": math.log10, "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan,
          "floor": math.floor, "ceil": math.ceil}
_CONSTS = {"pi": math.pi, "e": math.e}


class CalcError(ValueError):
    pass


def safe_eval(expr: str) -> float | int:
    """Evaluate an arithmetic expression without eval(): parse, then walk a whitelist of nodes."""
    if not isinstance(expr, str) or not expr.strip():
        raise CalcError("expression must be a non-empty string, e.g. '(3 + 4) * 2'")
    if len(expr) > 500:
        raise CalcError("expression too long (max 500 characters)")
    expr = expr.replace("^", "**").replace("\u00d7", "*").replace("\u00f7", "/")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"could not parse expression: {e.msg}") from None

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id in _CONSTS:
            return _CONSTS[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 100 or abs(a) > 1e6):
                raise CalcError("exponent too large (|base| <= 1e6, |exponent| <= 100)")
            try:
                return _BINOPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise CalcError("division by zero") from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](walk(node.operand))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in _FUNCS and not node.keywords):
            args = [walk(a) for a in node.args]
            try:
                return _FUNCS[node.func.id](*args)
            except (ValueError, TypeError) as e:
                raise CalcError(f"{node.func.id}(): {e}") from None
        what = type(node).__name__ if not isinstance(node, ast.Name) else f"name '{node.id}'"
        raise CalcError(f"unsupported element in expression: {what}; allowed: numbers, + - * / // % **,"
                        f" parentheses, {', '.join(sorted(_FUNCS))}, pi, e")

    try:
        value = walk(tree)
    except OverflowError:
        raise CalcError("result too large") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not a finite number")
    if isinstance(value, int) and abs(value) >= 10 ** 4000:  # str() refuses ints over 4,300 digits (3.11+)
        raise CalcError("result too large (4,000 digits or more)")
    return value


# ----------------------------------------------------------------------------------------------
# units, currency, dates (pure functions; the task generator uses them for ground truth)

_UNITS = {  # unit -> (dimension, factor to the SI-ish base unit)
    "m": ("length", 1.0), "km": ("length", 1000.0), "cm": ("length", 0.01), "mm": ("length", 0.001),
    "mi": ("length", 1609.344), "yd": ("length", 0.9144), "ft": ("length", 0.3048), "in": ("length", 0.0254),
    "kg": ("mass", 1.0), "g": ("mass", 0.001), "mg": ("mass", 1e-6), "lb": ("mass", 0.45359237),
    "oz": ("mass", 0.028349523125), "t": ("mass", 1000.0),
    "l": ("volume", 1.0), "ml": ("volume", 0.001), "gal": ("volume", 3.785411784), "qt": ("volume", 0.946352946),
    "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0), "day": ("time", 86400.0),
    "week": ("time", 604800.0),
    "C": ("temperature", None), "F": ("temperature", None), "K": ("temperature", None),
}
RATES_PER_USD = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.2, "CHF": 0.88, "CAD": 1.36, "AUD": 1.52}


def convert_units_value(value: float, from_unit: str, to_unit: str) -> float:
    for u in (from_unit, to_unit):
        if u not in _UNITS:
            raise ValueError(f"unknown unit '{u}'; known units: {', '.join(_UNITS)}")
    (d1, f1), (d2, f2) = _UNITS[from_unit], _UNITS[to_unit]
    if d1 != d2:
        raise ValueError(f"cannot convert {d1} ({from_unit}) to {d2} ({to_unit})")
    if d1 == "temperature":
        kelvin = {"C": value + 273.15, "F": (value - 32) * 5 / 9 + 273.15, "K": value}[from_unit]
        return {"C": kelvin - 273.15, "F": (kelvin - 273.15) * 9 / 5 + 32, "K": kelvin}[to_unit]
    return value * f1 / f2


def convert_currency_value(amount: float, from_currency: str, to_currency: str) -> float:
    """Rounded to cents: currency answers are money, and rounding once here keeps tasks exact."""
    for c in (from_currency, to_currency):
        if c not in RATES_PER_USD:
            raise ValueError(f"unknown currency '{c}'; known: {', '.join(RATES_PER_USD)}")
    return round(amount / RATES_PER_USD[from_currency] * RATES_PER_USD[to_currency], 2)


def parse_date(s: str, field: str = "date") -> dt.date:
    try:
        return dt.date.fromisoformat(s)
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be an ISO date YYYY-MM-DD, got {s!r}") from None


def add_days(day: dt.date, days: int) -> dt.date:
    try:
        return day + dt.timedelta(days=days)
    except OverflowError:  # a model may ask for 10**12 days: an answer, not a crash in the server
        raise ValueError(f"{day} + {days} days falls outside the years 1-9999") from None


# ----------------------------------------------------------------------------------------------
# the shop: products, customers, orders; generated from a fixed seed (identical in every process)

CATEGORIES = ["kitchen", "office", "garden", "toys", "books"]
_NOUNS = {"kitchen": ["Mug", "Kettle", "Skillet", "Cutting Board", "Teapot", "Whisk"],
          "office": ["Stapler", "Notebook", "Desk Lamp", "Pen Set", "Monitor Stand", "Binder"],
          "garden": ["Trowel", "Watering Can", "Hose", "Planter", "Pruner", "Seed Kit"],
          "toys": ["Puzzle", "Kite", "Yo-Yo", "Robot", "Board Game", "Plush Bear"],
          "books": ["Atlas", "Cookbook", "Novel", "Field Guide", "Poetry Book", "Dictionary"]}
_ADJ = ["Blue", "Red", "Green", "Classic", "Deluxe", "Compact", "Silver", "Oak"]
_FIRST = ["Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi",
          "Luca", "Maya", "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara"]
_LAST = ["Okafor", "Lindqvist", "Moreau", "Sato", "Garcia", "Novak", "Haddad", "Kowalski",
         "Nguyen", "Fischer", "Rossi", "Patel"]
_CITIES = ["Lyon", "Osaka", "Austin", "Leeds", "Porto", "Graz", "Perth", "Quebec"]


def shop_data(seed: int = 1234) -> dict:
    """Deterministic tables: products, customers, orders (with items and USD totals)."""
    rng = random.Random(seed)
    products, seen = [], set()
    for cat in CATEGORIES:
        for noun in _NOUNS[cat]:
            adj = rng.choice([a for a in _ADJ if f"{a} {noun}" not in seen])
            name = f"{adj} {noun}"
            seen.add(name)
            products.append({"id": None, "name": name, "category": cat,
                             "price": round(rng.uniform(3, 120), 2), "stock": rng.randint(0, 200)})
    # the ids (first among each product's keys, as the tools show them) are catalogue numbers, as a
    # real shop's are, not 1..n: an id the model guesses (1, 2, 123) names no product, so the tool says
    # where ids come from instead of acting on another product. Drawn from their own stream, so every
    # other value in the tables stays what it was.
    for p, pid in zip(products, sorted(random.Random(seed + 1).sample(range(1000, 10000), len(products)))):
        p["id"] = pid
    customers = []
    names = rng.sample([f"{f} {l}" for f in _FIRST for l in _LAST], 24)
    for i, name in enumerate(names):
        customers.append({"id": i + 1, "name": name, "city": rng.choice(_CITIES),
                          "joined": str(dt.date(2022, 1, 1) + dt.timedelta(days=rng.randint(0, 700)))})
    orders, items = [], []
    for c in customers:
        for _ in range(rng.randint(1, 5)):
            oid = len(orders) + 1
            date = dt.date(2024, 1, 1) + dt.timedelta(days=rng.randint(0, 365))
            lines = []
            for p in rng.sample(products, rng.randint(1, 4)):
                q = rng.randint(1, 5)
                lines.append({"order_id": oid, "product_id": p["id"], "quantity": q, "unit_price": p["price"]})
            total = round(sum(l["quantity"] * l["unit_price"] for l in lines), 2)
            orders.append({"id": oid, "customer_id": c["id"], "date": str(date), "total": total})
            items.extend(lines)
    return {"products": products, "customers": customers, "orders": orders, "order_items": items}


def knowledge_base() -> dict[str, str]:
    """The knowledge base every session starts from (facts with stable, checkable values)."""
    return {
        "speed_of_light_m_per_s": "299792458", "water_boiling_point_c": "100",
        "earth_radius_km": "6371", "moon_distance_km": "384400", "marathon_distance_km": "42.195",
        "everest_height_m": "8849", "mariana_trench_depth_m": "10935", "avogadro_number": "6.02214076e23",
        "pi_digits": "3.14159265358979", "gravity_m_per_s2": "9.80665", "sound_speed_air_m_per_s": "343",
        "store_opening_hour": "09:00", "store_closing_hour": "18:00", "store_city": "Graz",
        "shipping_flat_fee_usd": "4.99", "free_shipping_threshold_usd": "75", "return_window_days": "30",
        "warranty_years": "2", "support_email": "help@shop.example", "loyalty_discount_percent": "5",
        "vat_rate_percent": "20", "founding_year": "2009", "ceo_name": "Mira Halvorsen",
        "warehouse_count": "3", "headquarters": "Porto",
    }


SHOP = shop_data()
PRODUCTS = {p["id"]: p for p in SHOP["products"]}
CUSTOMERS = {c["id"]: c for c in SHOP["customers"]}


# ----------------------------------------------------------------------------------------------
# the records: small tables whose names and columns a question in plain words does not give away
# (shipments are t_shp), so a model must look them up (db_tables, db_describe) before db_query

RECORDS_ROWS = 40  # rows per table
# table -> (about, [(column, type, about, values)]); values: a TEXT column's choices, a number's
# (low, high) range (REAL: one decimal). mcp_tools/tasks.py words its questions per table.
RECORDS_SCHEMA = {
    "t_shp": ("parcels sent from the warehouse, one row per shipment",
              [("dst", "TEXT", "destination city", ["Lyon", "Osaka", "Austin", "Leeds", "Porto"]),
               ("wt_kg", "REAL", "weight in kilograms", (0.5, 60)),
               ("n_pc", "INTEGER", "number of pieces in the parcel", (1, 12))]),
    "hr_px": ("the company's staff, one row per employee",
              [("dpt", "TEXT", "department", ["sales", "finance", "support", "research", "legal"]),
               ("sal_k", "INTEGER", "yearly salary in thousands of USD", (35, 180)),
               ("svc_y", "INTEGER", "years of service", (0, 30))]),
    "wx_d": ("daily weather readings, one row per station and day",
             [("stn", "TEXT", "weather station", ["Northfield", "Eastbay", "Hillcrest", "Lakeside"]),
              ("tx_c", "REAL", "highest temperature of the day in degrees C", (-5, 38)),
              ("rr_mm", "INTEGER", "rainfall in millimetres", (0, 45))]),
    "lb_x": ("library loans, one row per book borrowed",
             [("brn", "TEXT", "library branch", ["Central", "Riverside", "Oakwood", "Harbor"]),
              ("lo_d", "INTEGER", "days the book was out", (1, 60)),
              ("fee_c", "INTEGER", "late fee charged, in cents", (0, 900))]),
    "fx_lg": ("flights flown, one row per flight",
              [("org", "TEXT", "departure airport code", ["LHR", "CDG", "JFK", "NRT", "SYD"]),
               ("blk_m", "INTEGER", "flight time in minutes", (45, 800)),
               ("pax", "INTEGER", "passengers on board", (20, 350))]),
    "mq_ev": ("machine stoppages in the factory, one row per stoppage",
              [("ln", "TEXT", "production line", ["A", "B", "C", "D"]),
               ("dt_h", "REAL", "downtime in hours", (0.1, 12)),
               ("prt", "INTEGER", "parts scrapped", (0, 80))]),
    "iv_r": ("restaurant hygiene inspections, one row per inspection",
             [("zn", "TEXT", "city district", ["Old Town", "Docklands", "Uptown", "Westend"]),
              ("scr", "INTEGER", "inspection score out of 100", (40, 100)),
              ("vio", "INTEGER", "violations found", (0, 12))]),
    "gh_q": ("plants in the greenhouse, one row per plant",
             [("sp", "TEXT", "plant species", ["fern", "orchid", "basil", "tomato", "cactus"]),
              ("ht_cm", "INTEGER", "height in centimetres", (2, 180)),
              ("lvs", "INTEGER", "number of leaves", (3, 250))]),
}


def records_data(seed: int = 4321) -> dict:
    """Deterministic rows of every records table: {table: [{column: value}]}."""
    rng = random.Random(seed)

    def value(typ, values):
        if typ == "TEXT":
            return rng.choice(values)
        return round(rng.uniform(*values), 1) if typ == "REAL" else rng.randint(*values)
    return {table: [{c: value(typ, values) for c, typ, _, values in cols} for _ in range(RECORDS_ROWS)]
            for table, (_, cols) in RECORDS_SCHEMA.items()}


RECORDS = records_data()


# Linked tables, in the same records database: a parent table of named things, each with a catalogue
# number, and a child table whose rows give that number, never the name (as a foreign key does). A
# question about a named thing needs both tables (mcp_tools/tasks.py's joins family). Written knowing
# that lab/transfer.py's sqlite questions join two or three such tables: a results entry that trains
# on them says so beside its figures.
class Link(NamedTuple):
    """A parent table of named things and the child table whose rows point at them by number."""
    about: str            # the parent's rows
    id_col: str           # its catalogue number
    name_col: str         # its name
    name_about: str       # what a name is ("client name")
    names: list           # the parent's rows, one a name
    child: str
    child_about: str
    child_id: str         # the child's own row number
    ref_col: str          # the parent's catalogue number, in the child
    measures: list        # [(number column, type, about, (low, high))]


LINKED = {  # parent table -> Link
    "cl_ct": Link("the company's clients, one row per client", "cl_no", "cl_nm", "client name",
                  ["Brightwater Ltd", "Orla Freight", "Kestrel Dental", "Nim Bakery", "Ferro Tools",
                   "Quillon Press", "Saltmarsh Inns", "Vey Robotics"],
                  "inv_b", "invoices sent to clients, one row per invoice", "inv_no", "cl_ref",
                  [("amt_usd", "INTEGER", "amount invoiced in USD", (50, 5000)),
                   ("dy_lt", "INTEGER", "days the payment came late", (0, 60))]),
    "vh_r": Link("the delivery fleet's vehicles, one row per vehicle", "vh_no", "plt", "number plate",
                 ["KX-204", "LM-881", "PT-310", "RB-547", "SD-129", "TW-663", "VC-902"],
                 "tp_lg", "trips driven, one row per trip", "tp_no", "vh_ref",
                 [("km", "INTEGER", "distance driven in km", (5, 900)),
                  ("fu_l", "INTEGER", "fuel used in litres", (1, 90))]),
    "mb_s": Link("members of the sports club, one row per member", "mb_no", "mb_nm", "member name",
                 ["Hana Kovac", "Idris Bello", "Jonas Aalto", "Keira Doyle", "Luca Moretti", "Mira Sato",
                  "Nadia Haddad", "Owen Price"],
                 "vs_g", "visits to the club, one row per visit", "vs_no", "mb_ref",
                 [("mn", "INTEGER", "minutes the visit lasted", (10, 150)),
                  ("kc", "INTEGER", "kilocalories burnt", (50, 1200))]),
    "sp_v": Link("the warehouse's suppliers, one row per supplier", "sp_no", "sp_nm", "supplier name",
                 ["Arden Mills", "Bluecrest Farms", "Corvo Metals", "Dunmore Glass", "Elkhorn Paper",
                  "Fenwick Dairy", "Galloway Timber"],
                 "dl_q", "deliveries received, one row per delivery", "dl_no", "sp_ref",
                 [("crt", "INTEGER", "crates delivered", (1, 90)),
                  ("lt_h", "INTEGER", "hours the delivery came late", (0, 48))]),
    "ar_p": Link("performers at the concert hall, one row per performer", "ar_no", "ar_nm", "performer name",
                 ["The Lantern Quartet", "Rosa Villanueva", "Night Ferry", "Tomas Eklund Trio",
                  "Copper Sky Choir", "Ada Nwosu", "The Hollow Reeds"],
                 "sh_t", "shows played, one row per show", "sh_no", "ar_ref",
                 [("sld", "INTEGER", "tickets sold", (20, 2000)),
                  ("enc", "INTEGER", "encores played", (0, 4))]),
}
LINKED_ROWS = 150  # child rows per child table (each parent ~20: its counts spread, few are guessed)


def linked_data(seed: int = 8765) -> dict:
    """Deterministic rows of every linked table, parents and children: {table: [{column: value}]}.
    Catalogue numbers are four digits, distinct in the database, so a guessed number is nobody's."""
    rng = random.Random(seed)
    needed = sum(len(pair.names) for pair in LINKED.values()) + len(LINKED) * LINKED_ROWS  # every parent and child row
    numbers = iter(rng.sample(range(1000, 10000), needed))
    data = {}
    for parent, pair in LINKED.items():
        data[parent] = [{pair.id_col: next(numbers), pair.name_col: name} for name in pair.names]
        ids = [r[pair.id_col] for r in data[parent]]
        data[pair.child] = [{pair.child_id: next(numbers), pair.ref_col: rng.choice(ids),
                             **{c: rng.randint(*span) for c, _, _, span in pair.measures}} for _ in range(LINKED_ROWS)]
    return data


def linked_schema() -> dict:
    """The linked tables in RECORDS_SCHEMA's form, {table: (about, [(column, type, about, values)])}."""
    schema = {}
    for parent, pair in LINKED.items():
        thing = pair.name_about.split()[0]
        schema[parent] = (pair.about, [(pair.id_col, "INTEGER", f"catalogue number of the {thing}", None),
                                       (pair.name_col, "TEXT", pair.name_about, pair.names)])
        schema[pair.child] = (pair.child_about, [(pair.child_id, "INTEGER", "number of this row", None),
                                                 (pair.ref_col, "INTEGER", f"the {thing}'s catalogue number", None),
                                                 *pair.measures])
    return schema


LINKED_SCHEMA = linked_schema()
RECORDS_TABLES = {**RECORDS_SCHEMA, **LINKED_SCHEMA}  # what db_tables lists and db_describe describes


def _build_db(uri: str, tables: dict, columns: dict) -> None:
    """Create tables {name: [row]} with columns {name: "col TYPE, ..."} in the database at uri."""
    con = sqlite3.connect(uri, uri=True)
    for table, rows in tables.items():
        con.execute(f"CREATE TABLE {table} ({columns[table]})")
        cols = list(rows[0])
        con.executemany(f"INSERT INTO {table} ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
                        [tuple(r[c] for c in cols) for r in rows])
    con.commit()
    con.close()


# Named shared-cache in-memory databases: one connection builds each and stays open (a db lives
# as long as some connection does). Each query opens its own connection with query_only on, so
# even a statement that slipped past validation cannot write, queries run side by side (sqlite's
# shared cache lets readers share tables), and stopping one query touches no other.
_DB_URI = f"file:nanorl_shop_{os.getpid()}?mode=memory&cache=shared"
_db_keepalive = sqlite3.connect(_DB_URI, uri=True, check_same_thread=False)
_build_db(_DB_URI, SHOP, {
    "products": "id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL, stock INTEGER",
    "customers": "id INTEGER PRIMARY KEY, name TEXT, city TEXT, joined TEXT",
    "orders": "id INTEGER PRIMARY KEY, customer_id INTEGER, date TEXT, total REAL",
    "order_items": "order_id INTEGER, product_id INTEGER, quantity INTEGER, unit_price REAL"})
_RECORDS_URI = f"file:nanorl_records_{os.getpid()}?mode=memory&cache=shared"
_records_keepalive = sqlite3.connect(_RECORDS_URI, uri=True, check_same_thread=False)
_build_db(_RECORDS_URI, {**RECORDS, **linked_data()}, {t: ", ".join(f"{c} {typ}" for c, typ, *_ in cols)
                                                         for t, (_, cols) in RECORDS_TABLES.items()})
# database -> (uri, what an SQL error adds, for a query that matches when, None: any). The shop's errors
# give its schema and the records' tool. The records' errors are sqlite's own words, as a real SQL
# server's are (mcp-server-sqlite: "no such table: loans"): a policy that learnt to follow a pointer to
# the listing tool found none on such a server (the results log, "rows without oracle calls at three
# seeds"), so it has to list first. They name sql_query only for a query that names a shop table (the
# likely slip between the two databases).
_DATABASES = {
    "shop": (_DB_URI, "tables: products(id,name,category,price,stock), customers(id,name,city,joined), "
                      "orders(id,customer_id,date,total), order_items(order_id,product_id,quantity,unit_price); "
                      "the records database's tables (db_tables) are queried with db_query", None),
    "records": (_RECORDS_URI, "the shop's tables (products, customers, orders) are queried with sql_query",
                re.compile(r"\b(products|customers|orders|order_items)\b", re.IGNORECASE)),
}
# Seconds a sql_query call may take, waiting for a worker included, whatever the client does: far
# above any real shop query (milliseconds), and below the client's tool timeout, or runaway queries
# time out on the client, and MCPPool restarts a server whose calls time out 3 times in a row.
SQL_TIME_LIMIT = 2.0
SQL_WORKERS = 4  # queries at once, on threads apart from the pool every sync tool shares
SQL_MAX_VALUE = 100_000  # bytes in one string or blob a query may build

_SQL_FORBIDDEN = re.compile(r"\b(insert|update|delete|drop|alter|create|replace|attach|detach|pragma|vacuum|"
                            r"reindex|trigger|begin|commit|rollback|savepoint)\b", re.IGNORECASE)


def run_select(sql: str, max_rows: int = 50, time_limit: float = SQL_TIME_LIMIT,
               stop: threading.Event | None = None, database: str = "shop") -> dict:
    """One validated read-only query on a database of _DATABASES ("shop": sql_query, "records":
    db_query). A runaway one (e.g. an endless recursive CTE) is stopped by sqlite's progress
    handler after time_limit seconds, or as soon as stop is set (_select sets it when the client
    gives up on the call): it never holds the server hostage."""
    uri, hint, when = _DATABASES[database]
    s = (sql or "").strip().rstrip(";").strip()
    if not s.lower().startswith(("select", "with")):
        raise ValueError("only read-only SELECT queries are allowed (the statement must start with SELECT or WITH)")
    if ";" in s:
        raise ValueError("exactly one statement is allowed (remove the ';')")
    if m := _SQL_FORBIDDEN.search(s):
        raise ValueError(f"keyword '{m.group(0)}' is not allowed; the database is read-only")
    deadline = time.monotonic() + time_limit
    con = sqlite3.connect(uri, uri=True, check_same_thread=False)
    try:
        con.execute("PRAGMA query_only = ON")  # sqlite's own read-only switch (mode=ro cannot combine with mode=memory)
        # no value over 100 kB: zeroblob(1e9) or printf('%.*c', 1e8, 'x') would cost the server that much memory
        con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, SQL_MAX_VALUE)
        # called every 10k sqlite VM instructions; a true return aborts the query
        con.set_progress_handler(lambda: time.monotonic() > deadline or (stop is not None and stop.is_set()), 10_000)
        cur = con.execute(s)
        rows = cur.fetchmany(max_rows + 1)
        cols = [d[0] for d in cur.description]
    except sqlite3.Error as e:
        if time.monotonic() > deadline:
            raise ValueError(f"the query ran longer than {time_limit:.3g} s and was stopped; "
                             "is a recursive WITH missing its end condition?") from None
        raise ValueError(f"SQL error: {e}" + (f"; {hint}" if when is None or when.search(s) else "")) from None
    finally:
        con.close()
    rows = [[f"<blob of {len(v)} bytes>" if isinstance(v, bytes) else v for v in r] for r in rows]  # JSON has no bytes
    return {"columns": cols, "rows": rows[:max_rows], "truncated": len(rows) > max_rows}


def cart_summary(cart: dict[int, int]) -> dict:
    items = [{"product_id": pid, "name": PRODUCTS[pid]["name"], "quantity": q,
              "unit_price": PRODUCTS[pid]["price"], "line_total": round(q * PRODUCTS[pid]["price"], 2)}
             for pid, q in sorted(cart.items())]
    return {"items": items, "total_usd": round(sum(i["quantity"] * i["unit_price"] for i in items), 2)}


def product_sales_summary(product_id: int) -> dict:
    """One product's sales over every order: the orders that hold it, the units and the USD revenue."""
    lines = [i for i in SHOP["order_items"] if i["product_id"] == product_id]
    return {"product_id": product_id, "name": PRODUCTS[product_id]["name"],
            "orders": len({i["order_id"] for i in lines}), "units": sum(i["quantity"] for i in lines),
            "revenue_usd": round(sum(i["quantity"] * i["unit_price"] for i in lines), 2)}


def text_statistics(text: str) -> dict:
    return {"characters": len(text), "words": len(text.split()), "lines": len(text.splitlines()) or 1,
            "vowels": sum(ch in "aeiouAEIOU" for ch in text)}


_TRANSFORMS = {"upper": str.upper, "lower": str.lower, "title": str.title, "reverse": lambda s: s[::-1],
               "reverse_words": lambda s: " ".join(s.split()[::-1]), "sort_words": lambda s: " ".join(sorted(s.split())),
               "remove_spaces": lambda s: "".join(s.split())}


def transform(text: str, operation: str) -> str:
    if operation not in _TRANSFORMS:
        raise ValueError(f"unknown operation '{operation}'; choose one of: {', '.join(_TRANSFORMS)}")
    return _TRANSFORMS[operation](text)
