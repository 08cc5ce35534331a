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
    db_tables, db_describe, db_query                  the records database (RECORDS_TABLES), whose
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

The data and the pure functions behind the tools are mcp_tools/shop.py's (fixed seeds), so
mcp_tools/tasks.py computes ground truth from the same tables. Bad arguments raise ToolError with a
message meant for the model to read and act on.
"""
import argparse
import json
import os
import re
import sys
import threading
import time

if __name__ == "__main__":  # run as `python mcp_tools/server.py`: the repo root replaces mcp_tools/ on sys.path
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from mcp_tools.shop import (CATEGORIES, CUSTOMERS, PRODUCTS, RECORDS_TABLES, SHOP, SQL_TIME_LIMIT,  # noqa: E402
                            SQL_WORKERS, add_days, cart_summary, convert_currency_value, convert_units_value,
                            knowledge_base, parse_date, product_sales_summary, run_select, safe_eval,
                            text_statistics, transform)

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


# ----------------------------------------------------------------------------------------------
# the MCP server (mcp imported lazily: the tests build it in-process)

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
    if product_id not in PRODUCTS:
        raise ToolError(f"no product with id {product_id}; use search_products to find ids")
    return PRODUCTS[product_id]


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
        return _js([p for p in SHOP["products"] if q in p["name"].lower() and (not category or p["category"] == category)])

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
        return _js([c for c in SHOP["customers"] if n in c["name"].lower()])

    @srv.tool()
    def list_orders(customer_id: int) -> str:
        """All orders of a customer, oldest first: id, date, total (USD)."""
        if customer_id not in CUSTOMERS:
            raise ToolError(f"no customer with id {customer_id}; use find_customer to find ids")
        return _js(sorted((o for o in SHOP["orders"] if o["customer_id"] == customer_id), key=lambda o: (o["date"], o["id"])))

    @srv.tool()
    def get_order(order_id: int) -> str:
        """One order with its items (product id, name, quantity, unit price) and total in USD."""
        order = next((o for o in SHOP["orders"] if o["id"] == order_id), None)
        if order is None:
            raise ToolError(f"no order with id {order_id}; use list_orders to find ids")
        items = [{**i, "name": PRODUCTS[i["product_id"]]["name"]} for i in SHOP["order_items"] if i["order_id"] == order_id]
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
    """The read-only records database: its tables and columns are looked up, not shown (shop.RECORDS_TABLES)."""
    from mcp.server.mcpserver.exceptions import ToolError

    @srv.tool()
    def db_tables() -> str:
        """The tables of the records database, each with what it holds."""
        return _js([{"table": t, "about": about} for t, (about, _) in RECORDS_TABLES.items()])

    @srv.tool()
    def db_describe(table: str) -> str:
        """The columns of one records table: name, type and meaning."""
        if table not in RECORDS_TABLES:
            raise ToolError(f"no table {table[:64]!r} in the records database")  # no pointer: shop.py's _DATABASES
        return _js([{"column": c, "type": typ, "about": about} for c, typ, about, _ in RECORDS_TABLES[table][1]])

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("--http", type=int, default=None, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio")
    ap.add_argument("--sse", type=int, default=None, metavar="PORT", help="serve HTTP+SSE on 127.0.0.1:PORT/sse instead of stdio")
    ap.add_argument("--test-tools", action="store_true", help="also expose the test-only tools sleep and pid")
    flags = ap.parse_args(argv)
    server = build_server(test_tools=flags.test_tools)
    if flags.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=flags.http)
    elif flags.sse is not None:
        server.run("sse", host="127.0.0.1", port=flags.sse)
    else:
        server.run()


if __name__ == "__main__":
    main()
