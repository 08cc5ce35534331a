"""
nanoRL's bundled offline MCP server: ~20 small deterministic tools an agent can learn to use.

    python mcp_tools/server.py                 # stdio (what pool.MCPPool spawns)
    python mcp_tools/server.py --http 8765     # streamable HTTP on 127.0.0.1:8765/mcp
    python mcp_tools/server.py --sse 8765      # the older HTTP+SSE transport on 127.0.0.1:8765/sse
    python mcp_tools/server.py --test-tools    # also expose `sleep` and `pid` (tests only)

Tools (the model sees all but `reset`):
    calculate            arithmetic with a safe parser: ast whitelist, never eval
    convert_units        length / mass / volume / time / temperature
    convert_currency     fixed offline rates (USD base), so answers are checkable
    date_add, date_diff, weekday
    list_categories, search_products, get_product, find_customer, list_orders, get_order
    product_sales        units sold, orders and revenue of one product, by its id (which
                         search_products gives: a product's name is not an argument)
    sql_query            read-only SELECT on the shop database (validated, then run on its own
                         connection with sqlite's query_only on, so a write cannot happen anyway;
                         at most SQL_WORKERS (4) at once on threads of their own; a call ends
                         SQL_TIME_LIMIT (2 s) after it arrives, waiting included, or when the
                         client cancels it: a tool error, well before any sane client timeout)
    kb_get, kb_search, kb_set                         per-session key-value knowledge base
    cart_add, cart_view                               per-session shopping cart
    text_stats, transform_text
    db_tables, db_describe, db_query                  the records database (RECORDS_SCHEMA), whose
                         tables and columns are looked up, never shown: its table names (t_shp for
                         shipments) are not what a question says; db_query runs as sql_query does

Sessions (how state-changing tasks stay correct when episodes share one server process):
every stateful tool takes a `session` string argument. pool.MCPPool treats a server whose
`reset(session)` tool carries the marker _meta {"nanorl/session_reset": true} as session-aware
(any server may add it; a `reset` without it is an ordinary tool): it calls reset with a fresh
random key at the start of each episode, hides `reset` from the model, strips `session` from the
schemas it shows, and injects the key into every call. So one long-lived process serves many concurrent episodes,
each with its own KB copy and cart; `reset(session, drop=True)` frees it at the end. The shop
database itself is read-only and shared. Sync tools run in mcp's thread pool (mcp 2.3), hence
the locks.

All data is generated from fixed seeds in `shop_data()` and `records_data()`, so mcp_tools/tasks.py
can import the same tables and pure functions to compute ground truth. Bad arguments raise ToolError with a
message meant for the model to read and act on.
"""
import argparse
import ast
import datetime as dt
import json
import math
import operator
import os
import random
import re
import sqlite3
import threading
import time

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


_SHOP = shop_data()
_PRODUCTS = {p["id"]: p for p in _SHOP["products"]}
_CUSTOMERS = {c["id"]: c for c in _SHOP["customers"]}


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


_RECORDS = records_data()


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
_build_db(_DB_URI, _SHOP, {
    "products": "id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL, stock INTEGER",
    "customers": "id INTEGER PRIMARY KEY, name TEXT, city TEXT, joined TEXT",
    "orders": "id INTEGER PRIMARY KEY, customer_id INTEGER, date TEXT, total REAL",
    "order_items": "order_id INTEGER, product_id INTEGER, quantity INTEGER, unit_price REAL"})
_RECORDS_URI = f"file:nanorl_records_{os.getpid()}?mode=memory&cache=shared"
_records_keepalive = sqlite3.connect(_RECORDS_URI, uri=True, check_same_thread=False)
_build_db(_RECORDS_URI, _RECORDS, {t: ", ".join(f"{c} {typ}" for c, typ, *_ in cols)
                                   for t, (_, cols) in RECORDS_SCHEMA.items()})
# database -> (uri, what an SQL error adds): the shop's schema, or where the records' is looked up; and
# the tool that queries the other database (a table of one sent to the other's tool is the likely slip)
_DATABASES = {
    "shop": (_DB_URI, "tables: products(id,name,category,price,stock), customers(id,name,city,joined), "
                      "orders(id,customer_id,date,total), order_items(order_id,product_id,quantity,unit_price); "
                      "the records database's tables (db_tables) are queried with db_query"),
    "records": (_RECORDS_URI, "db_tables lists the tables, db_describe a table's columns; "
                              "the shop's tables (products, customers, orders) are queried with sql_query"),
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
    uri, hint = _DATABASES[database]
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
        raise ValueError(f"SQL error: {e}; {hint}") from None
    finally:
        con.close()
    rows = [[f"<blob of {len(v)} bytes>" if isinstance(v, bytes) else v for v in r] for r in rows]  # JSON has no bytes
    return {"columns": cols, "rows": rows[:max_rows], "truncated": len(rows) > max_rows}


# ----------------------------------------------------------------------------------------------
# per-session state (knowledge base copy + cart), keyed by the session string MCPEnv injects

class _Session:
    def __init__(self):
        self.kb = knowledge_base()
        self.cart: dict[int, int] = {}  # product id -> quantity
        self.lock = threading.Lock()


SESSION_HOOK_META = "nanorl/session_reset"  # reset's _meta key (module doc, Sessions); config.py reads it
_sessions: dict[str, _Session] = {}
_sessions_lock = threading.Lock()
_MAX_SESSIONS = 4096  # an episode that never calls reset(drop=True) must not grow memory forever


def _session(key: str) -> _Session:
    with _sessions_lock:
        if key not in _sessions:
            if len(_sessions) >= _MAX_SESSIONS:
                _sessions.pop(next(iter(_sessions)))  # oldest first (dicts keep insertion order)
            _sessions[key] = _Session()
        return _sessions[key]


def cart_summary(cart: dict[int, int]) -> dict:
    items = [{"product_id": pid, "name": _PRODUCTS[pid]["name"], "quantity": q,
              "unit_price": _PRODUCTS[pid]["price"], "line_total": round(q * _PRODUCTS[pid]["price"], 2)}
             for pid, q in sorted(cart.items())]
    return {"items": items, "total_usd": round(sum(i["quantity"] * i["unit_price"] for i in items), 2)}


def product_sales_summary(product_id: int) -> dict:
    """One product's sales over every order: the orders that hold it, the units and the USD revenue."""
    lines = [i for i in _SHOP["order_items"] if i["product_id"] == product_id]
    return {"product_id": product_id, "name": _PRODUCTS[product_id]["name"],
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


# ----------------------------------------------------------------------------------------------
# the MCP server. Imported lazily so mcp_tools/tasks.py can use the pure functions above cheaply.

def build_server(test_tools: bool = False):
    """The MCP server with every tool registered, in the order clients list them."""
    from mcp.server import MCPServer

    # WARNING: mcp logs every failed call at INFO to stderr, which the client inherits (noise in tests)
    srv = MCPServer("nanorl-tools", log_level="WARNING")
    select = _sql_runner()
    _add_calc_tools(srv)
    _add_shop_tools(srv, select)
    _add_session_tools(srv)
    _add_text_tools(srv)
    _add_records_tools(srv, select)  # the later the tools, the more of every prompt's tool block stays as it was
    _add_sales_tools(srv)
    _add_client_tools(srv, test_tools)
    return srv


def _js(obj) -> str:
    """Compact JSON text: mcp would pretty-print dicts with indent 2 (tokens the model pays for)."""
    return json.dumps(obj, separators=(",", ":"))


def _guard(fn, *args):
    """Turn our ValueErrors into ToolErrors: in mcp 2.3 only ToolError text reaches the client."""
    from mcp.server.mcpserver.exceptions import ToolError
    try:
        return fn(*args)
    except ValueError as e:
        raise ToolError(str(e)) from None


def _add_calc_tools(srv):
    """calculate, unit and currency conversion, date arithmetic: pure functions of the arguments."""
    @srv.tool()
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression, e.g. '(12.5 * 4 - 3) / 7' or 'sqrt(2) * 10'. Supports + - * / // % ** (or ^), parentheses, sqrt, abs, round, min, max, log, log10, exp, sin, cos, tan, floor, ceil, pi, e."""
        return repr(_guard(safe_eval, expression))

    @srv.tool()
    def convert_units(value: float, from_unit: str, to_unit: str) -> str:
        """Convert a value between units of the same kind. Length: m km cm mm mi yd ft in. Mass: kg g mg lb oz t. Volume: l ml gal qt. Time: s min h day week. Temperature: C F K."""
        return repr(_guard(convert_units_value, value, from_unit, to_unit))

    @srv.tool()
    def convert_currency(amount: float, from_currency: str, to_currency: str) -> str:
        """Convert money between USD, EUR, GBP, JPY, CHF, CAD, AUD at the shop's fixed rates; the result is rounded to 2 decimals."""
        return repr(_guard(convert_currency_value, amount, from_currency, to_currency))

    @srv.tool()
    def date_add(date: str, days: int) -> str:
        """Add a number of days (may be negative) to an ISO date YYYY-MM-DD; returns the new ISO date."""
        return str(_guard(add_days, _guard(parse_date, date), days))

    @srv.tool()
    def date_diff(start: str, end: str) -> str:
        """Number of days from start to end (both ISO dates YYYY-MM-DD); negative if end is earlier."""
        return str((_guard(parse_date, end, "end") - _guard(parse_date, start, "start")).days)

    @srv.tool()
    def weekday(date: str) -> str:
        """The weekday name (Monday..Sunday) of an ISO date YYYY-MM-DD."""
        return _guard(parse_date, date).strftime("%A")


def _product(product_id: int) -> dict:
    """The product with this id, else the ToolError every tool that takes a product id answers with."""
    from mcp.server.mcpserver.exceptions import ToolError
    if product_id not in _PRODUCTS:
        raise ToolError(f"no product with id {product_id}; use search_products to find ids")
    return _PRODUCTS[product_id]


def _add_shop_tools(srv, select):
    """The read-only shop database: browse products, customers and orders, or query it in SQL."""
    from mcp.server.mcpserver.exceptions import ToolError

    @srv.tool()
    def list_categories() -> str:
        """The product categories of the shop."""
        return _js(CATEGORIES)

    @srv.tool()
    def search_products(query: str, category: str = "") -> str:
        """Find products whose name contains the query (case-insensitive), optionally within one category. Returns id, name, category, price (USD) and stock."""
        if category and category not in CATEGORIES:
            raise ToolError(f"unknown category '{category}'; categories: {', '.join(CATEGORIES)}")
        q = query.lower().strip()
        return _js([p for p in _SHOP["products"] if q in p["name"].lower() and (not category or p["category"] == category)])

    @srv.tool()
    def get_product(product_id: int) -> str:
        """One product by id: name, category, price (USD), stock."""
        return _js(_product(product_id))

    @srv.tool()
    def find_customer(name: str) -> str:
        """Customers whose name contains the given text (case-insensitive): id, name, city, joined."""
        n = name.lower().strip()
        if not n:
            raise ToolError("name must not be empty")
        return _js([c for c in _SHOP["customers"] if n in c["name"].lower()])

    @srv.tool()
    def list_orders(customer_id: int) -> str:
        """All orders of a customer, oldest first: id, date, total (USD)."""
        if customer_id not in _CUSTOMERS:
            raise ToolError(f"no customer with id {customer_id}; use find_customer to find ids")
        return _js(sorted((o for o in _SHOP["orders"] if o["customer_id"] == customer_id), key=lambda o: (o["date"], o["id"])))

    @srv.tool()
    def get_order(order_id: int) -> str:
        """One order with its items (product id, name, quantity, unit price) and total in USD."""
        order = next((o for o in _SHOP["orders"] if o["id"] == order_id), None)
        if order is None:
            raise ToolError(f"no order with id {order_id}; use list_orders to find ids")
        items = [{**i, "name": _PRODUCTS[i["product_id"]]["name"]} for i in _SHOP["order_items"] if i["order_id"] == order_id]
        return _js({**order, "items": items})

    @srv.tool()
    async def sql_query(sql: str) -> str:
        """Run one read-only SQL SELECT on the shop database. Tables: products(id,name,category,price,stock), customers(id,name,city,joined), orders(id,customer_id,date,total), order_items(order_id,product_id,quantity,unit_price). At most 50 rows are returned."""
        return await select(sql, "shop")


def _sql_runner():
    """select(sql, database) -> the JSON result, for sql_query and db_query: run_select on SQL_WORKERS
    threads of their own, shared by both tools (on the pool every sync tool shares, anyio's 40
    threads in mcp 2.3, 40 runaway queries from a few episodes left no thread for any other tool)."""
    import anyio
    from mcp.server.mcpserver.exceptions import ToolError
    workers = anyio.CapacityLimiter(SQL_WORKERS)
    busy = (f"the server is busy with other SQL queries ({SQL_WORKERS} run at once) and could not run "
            f"this one within {SQL_TIME_LIMIT:g} s; try again")

    async def select(sql: str, database: str) -> str:
        deadline = time.monotonic() + SQL_TIME_LIMIT  # the wait for a worker counts
        stop = threading.Event()

        def run():
            if (left := deadline - time.monotonic()) <= 0.05:
                raise ToolError(busy)
            return _guard(run_select, sql, 50, left, stop, database)
        try:  # async, so that a client's cancel (mcp 2.3 sends one when a call times out) reaches us
            # the query stops itself at the deadline; this scope bounds the wait for a worker
            with anyio.move_on_after(SQL_TIME_LIMIT + 0.5):
                return _js(await anyio.to_thread.run_sync(run, abandon_on_cancel=True, limiter=workers))
            raise ToolError(busy)
        finally:
            stop.set()  # cancelled or done: a query still running stops at its next progress check
    return select


def _add_records_tools(srv, select):
    """The read-only records database: its tables and columns are looked up, not shown (RECORDS_SCHEMA)."""
    from mcp.server.mcpserver.exceptions import ToolError

    @srv.tool()
    def db_tables() -> str:
        """The tables of the records database, each with what it holds."""
        return _js([{"table": t, "about": about} for t, (about, _) in RECORDS_SCHEMA.items()])

    @srv.tool()
    def db_describe(table: str) -> str:
        """The columns of one records table: name, type and meaning."""
        if table not in RECORDS_SCHEMA:
            raise ToolError(f"no table {table[:64]!r} in the records database; db_tables lists the tables")
        return _js([{"column": c, "type": typ, "about": about} for c, typ, about, _ in RECORDS_SCHEMA[table][1]])

    @srv.tool()
    async def db_query(sql: str) -> str:
        """Run one read-only SQL SELECT on the records database (at most 50 rows). Find its tables with db_tables, their columns with db_describe."""
        return await select(sql, "records")


def _add_sales_tools(srv):
    """A read-only tool that takes a product id, never a name: the id must come from search_products."""

    @srv.tool()
    def product_sales(product_id: int) -> str:
        """Sales of one product over all orders: the number of orders that contain it, units sold and revenue in USD."""
        _product(product_id)
        return _js(product_sales_summary(product_id))


def _add_session_tools(srv):
    """Per-session state: the knowledge base copy and the shopping cart (see Sessions above)."""
    from mcp.server.mcpserver.exceptions import ToolError

    @srv.tool()
    def kb_get(key: str, session: str = "") -> str:
        """Read the value stored under a key in the knowledge base."""
        s = _session(session)
        with s.lock:
            if key not in s.kb:
                close = [k for k in s.kb if key.lower() in k.lower()][:5]
                raise ToolError(f"no key '{key}'" + (f"; similar keys: {', '.join(close)}" if close else "; try kb_search"))
            return s.kb[key]

    @srv.tool()
    def kb_search(query: str, session: str = "") -> str:
        """Keys of the knowledge base that contain the query text (case-insensitive); an empty query lists all keys."""
        s = _session(session)
        with s.lock:
            return _js(sorted(k for k in s.kb if query.lower() in k.lower()))

    @srv.tool()
    def kb_set(key: str, value: str, session: str = "") -> str:
        """Store a value under a key in the knowledge base (creates or overwrites it)."""
        if not re.fullmatch(r"[A-Za-z0-9_:.\-]{1,64}", key or ""):
            raise ToolError("key must be 1-64 characters of letters, digits, _ : . -")
        if len(value) > 1000:
            raise ToolError("value too long (max 1000 characters)")
        s = _session(session)
        with s.lock:
            s.kb[key] = value
        return f"stored {key}"

    @srv.tool()
    def cart_add(product_id: int, quantity: int, session: str = "") -> str:
        """Add a quantity of a product to the shopping cart (quantity 1-100, limited by stock). Returns the cart."""
        stock = _product(product_id)["stock"]
        if not 1 <= quantity <= 100:
            raise ToolError("quantity must be between 1 and 100")
        s = _session(session)
        with s.lock:
            new = s.cart.get(product_id, 0) + quantity
            if new > stock:
                raise ToolError(f"only {stock} in stock")
            s.cart[product_id] = new
            return _js(cart_summary(s.cart))

    @srv.tool()
    def cart_view(session: str = "") -> str:
        """The shopping cart: items and total in USD."""
        s = _session(session)
        with s.lock:
            return _js(cart_summary(s.cart))


def _add_text_tools(srv):
    """Counts and transforms of a text the model passes in."""
    @srv.tool()
    def text_stats(text: str) -> str:
        """Count characters, words (whitespace-separated), lines and vowels of a text."""
        return _js(text_statistics(text))

    @srv.tool()
    def transform_text(text: str, operation: str) -> str:
        """Transform a text. operation: upper, lower, title, reverse, reverse_words, sort_words, remove_spaces."""
        return _guard(transform, text, operation)


def _add_client_tools(srv, test_tools: bool):
    """Tools for the client, not the model: reset (hidden by pool.MCPPool) and, with
    test_tools, sleep and pid (client timeouts and a killed server in tests)."""
    from mcp.server.mcpserver.exceptions import ToolError

    # the marker that makes this reset the session hook: pool.MCPPool calls a reset only when it
    # carries it (config.session_hook), never a third-party tool that is merely named reset
    @srv.tool(meta={SESSION_HOOK_META: True})
    def reset(session: str, drop: bool = False) -> str:
        """Start a fresh session state (knowledge base and cart); drop=True deletes it. Called by the client, hidden from the model."""
        with _sessions_lock:
            _sessions.pop(session, None)
            if not drop:
                _sessions[session] = _Session()
        return "ok"

    if test_tools:
        @srv.tool()
        def sleep(seconds: float) -> str:
            """Sleep for a number of seconds (at most 60). Test-only: exercises client timeouts."""
            if not 0 <= seconds <= 60:
                raise ToolError("seconds must be in [0, 60]")
            time.sleep(seconds)
            return f"slept {seconds}"

        @srv.tool()
        def pid() -> int:
            """This server's process id. Test-only: lets a test kill the server."""
            return os.getpid()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("--http", type=int, default=None, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio")
    ap.add_argument("--sse", type=int, default=None, metavar="PORT", help="serve HTTP+SSE on 127.0.0.1:PORT/sse instead of stdio")
    ap.add_argument("--test-tools", action="store_true", help="also expose the test-only tools sleep and pid")
    a = ap.parse_args()
    server = build_server(test_tools=a.test_tools)
    if a.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=a.http)
    elif a.sse is not None:
        server.run("sse", host="127.0.0.1", port=a.sse)
    else:
        server.run()
