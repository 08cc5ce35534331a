r"""
Tool-use tasks for the bundled MCP server (mcp_tools/server.py), with exactly checkable answers.

    from mcp_tools.tasks import mcp_rows, DEMO          # train.py / sft.py: rows without files
    train_rows, test_rows = mcp_rows(seed=0)
    python mcp_tools/tasks.py --out data/out/mcp         # the same rows as train.jsonl, test.jsonl
    python mcp_tools/tasks.py --out data/out/mcp --format parquet --seed 1

Families (default counts; the first 10% of each family's tasks go to test) and the oracle's calls:
    arith     250  calculator on an expression (1 call)
    units     200  unit conversion, rounded to 3 decimals (1 call)
    currency  150  currency conversion at the shop's fixed rates (1 call)
    dates     200  date_add / date_diff / weekday (1 call)
    shop      250  product price/stock, customer city, SQL counts (1 call); order count of a customer,
                   find_customer -> list_orders (2 calls; one task per customer, so 24 at most)
    multi     250  dependent calls, e.g. "total of customer X's last order in EUR" (find_customer ->
                   list_orders -> convert_currency, 3 calls); kb_get -> convert_units (2 calls)
    kb        150  knowledge-base lookups (kb_get, 1 call); kb_search -> kb_get, kb_get -> calculate (2)
    text      100  word/character/vowel counts and text transforms (1 call)
    state     200  change server state (kb_set, cart_add) and report (2 or 4 calls); the final state
                   is checked after the episode through a read-only tool (kb_get / cart_view)
    discovery 200  counts, largest / smallest / totals in the records database, asked in plain words:
                   its table and column names must be looked up, db_tables -> db_describe -> db_query
                   (3 calls). Held-out schemas: the test rows ask only about DISCOVERY_TEST_TABLES
                   (2 of the 8 tables), which no train row uses, at any --count and --test-fraction
    joins     200  (only when named: --families ...,joins) a named client's invoices, a plate's trips...
                   in the records database's linked tables, whose child rows give the parent's catalogue
                   number, not its name: db_tables -> db_describe (parent) -> db_describe (child) ->
                   db_query with a join (4 calls). Held-out tables: the test rows ask only about
                   JOINS_TEST_PARENTS (2 of the 5 pairs). Written knowing that lab/transfer.py's sqlite
                   questions join tables (a results entry that trains it says so beside its figures)
    sales     150  a product's units sold, orders and revenue: search_products -> product_sales (2 calls;
                   the revenue in another currency, -> convert_currency, 3). product_sales takes the
                   product's id, which only the search gives: ids are catalogue numbers (four digits), so a
                   guessed id is no product's, and the tool's error says to search

select_rows keeps whole rows of some families and/or oracle call counts (n_calls), e.g. SFT on the
1-call tasks and RL + eval on the >= 2-call ones, which the SFT data never shows:
    python mcp_tools/tasks.py --max-calls 1 --out data/out/mcp-1call
    python mcp_tools/tasks.py --min-calls 2 --families multi,shop,kb,state \
        --count multi=500 --count kb=300 --count state=400 --out data/out/mcp-multi
(shop runs out of distinct tasks, so its count stays.) A family's rows depend only on (seed,
family, its count): leaving families out changes no row, and a larger count keeps the same tasks
in the same order (its test split, the first 10%, then takes in some former train rows; discovery
draws each split from its own tables and random stream, so each split keeps its tasks in order).
The command line (main) selects after the split, so a selection's test rows are the same tasks as
in the unselected files; --count FAMILY=N generates N tasks of that family instead of its default.

Ground truth comes from the server's own pure functions and tables (mcp_tools/shop.py), so a
task is correct iff the tool would answer it. Rows use SkyRL's format:
    reward_spec.ground_truth = {"answer": str, "type": "number" | "text", "check": [...]}
    extra_info = {"family", "split", "index", "oracle_calls": [{"name", "arguments"}, ...], "oracle_answer"}
oracle_calls is the call sequence a perfect policy makes (one call per turn); tests replay it.
Deterministic from the seed (random.Random only). The final answer goes inside <answer></answer>
(the system prompt says so), scored by env.MCPEnv.

Test: python -m pytest -q tests/test_mcp.py
"""
import argparse
import collections
import datetime as dt
import os
import random
import re
import sys

if __name__ == "__main__":  # run as `python mcp_tools/tasks.py`: the repo root replaces mcp_tools/ on sys.path
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from mcp_tools import shop as S  # noqa: E402 -- the repo root is on sys.path (train.py, tests, this CLI)

SYSTEM_PROMPT = (
    "You are a helpful assistant with tools. To use a tool, write a tool call in the format described "
    "below; its result comes back in the next message. Use the tools to look things up and to "
    "compute instead of guessing. When you know the final answer, reply without any tool call and "
    "put only the answer inside <answer></answer>, for example <answer>42</answer>."
)
# One worked exchange in the chat itself (train.py --fewshot 1 puts it between the system prompt and
# the question): small models that never write a <tool_call> from the tool list alone can copy it.
# The tool message is what the bundled calculate tool returns (tested).
DEMO = [
    {"role": "user", "content": "Compute 17 * 23 + 4."},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17 * 23 + 4"}}\n</tool_call>'},
    {"role": "tool", "content": "395"},
    {"role": "assistant", "content": "<answer>395</answer>"},
]
FAMILIES = {"arith": 250, "units": 200, "currency": 150, "dates": 200, "shop": 250, "multi": 250,
            "kb": 150, "text": 100, "state": 200, "discovery": 200, "sales": 150}
DISCOVERY_TEST_TABLES = ("iv_r", "gh_q")  # the records tables only discovery's test rows use (held out)
# Families made only when named (--families, counts): not in the default rows (mcp_rows(), train.py --env mcp)
EXTRA_FAMILIES = {"joins": 200}
JOINS_TEST_PARENTS = ("sp_v", "ar_p")  # the linked parents (and their children) only joins' test rows use

_SHOP = S.shop_data()
_PRODUCTS, _CUSTOMERS = _SHOP["products"], _SHOP["customers"]
_WORDS = ("river stone quiet amber lantern orbit maple signal velvet harbor pixel meadow copper "
          "whisper falcon glacier ember canyon tidal puzzle").split()


def call(tool: str, /, **arguments) -> dict:
    return {"name": tool, "arguments": arguments}


def fmt(x) -> str:
    """Canonical answer text: ints without '.0', floats via repr (shortest round-trip form)."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x) if isinstance(x, float) else str(x)


def _orders_of(cid: int) -> list[dict]:
    return sorted((o for o in _SHOP["orders"] if o["customer_id"] == cid), key=lambda o: (o["date"], o["id"]))

# ----------------------------------------------------------------------------------------------
# one generator per family: rng -> (question, answer, type, oracle calls, checks)


def gen_arith(rng):
    a, b, c = rng.randint(2, 999), rng.randint(2, 999), rng.randint(2, 99)
    kind = rng.randrange(5)
    if kind == 0:
        expr, nd = f"({a} + {b}) * {c}", None
    elif kind == 1:
        expr, nd = f"{a} * {b} - {c}", None
    elif kind == 2:
        expr, nd = f"({a} - {b}) / {c}", 4
    elif kind == 3:
        expr, nd = f"{c} ** 2 + {a} ** 2", None
    else:
        expr, nd = f"sqrt({a * b})", 4
    v = S.safe_eval(expr)
    q = f"Compute {expr}."
    if nd is not None:
        v = round(v, nd)
        q += f" Round the result to {nd} decimal places."
    return q, fmt(v), "number", [call("calculate", expression=expr)], []


_UNIT_PAIRS = [("mi", "km"), ("km", "mi"), ("ft", "m"), ("in", "cm"), ("yd", "m"), ("lb", "kg"), ("kg", "lb"),
               ("oz", "g"), ("gal", "l"), ("l", "qt"), ("h", "min"), ("week", "h"), ("C", "F"), ("F", "C"),
               ("K", "C"), ("m", "ft"), ("g", "oz"), ("ml", "gal")]


def gen_units(rng):
    f, t = rng.choice(_UNIT_PAIRS)
    value = round(rng.uniform(1, 500), 1)
    v = round(S.convert_units_value(value, f, t), 3)
    if abs(v) < 0.1:  # too small for 3 decimals to be a fair answer
        return None
    return (f"Convert {value} {f} to {t}. Round the result to 3 decimal places.", fmt(v), "number",
            [call("convert_units", value=value, from_unit=f, to_unit=t)], [])


def gen_currency(rng):
    f, t = rng.sample(sorted(S.RATES_PER_USD), 2)
    amount = round(rng.uniform(5, 2000), 2)
    v = S.convert_currency_value(amount, f, t)
    return (f"Using the shop's exchange rates, how much is {amount:.2f} {f} in {t}?", fmt(v), "number",
            [call("convert_currency", amount=amount, from_currency=f, to_currency=t)], [])


def gen_dates(rng):
    d = dt.date(2020, 1, 1) + dt.timedelta(days=rng.randint(0, 2500))
    kind = rng.randrange(3)
    if kind == 0:
        days = rng.choice([-1, 1]) * rng.randint(1, 400)
        word = "after" if days > 0 else "before"
        return (f"What is the date {abs(days)} days {word} {d}? Answer as YYYY-MM-DD.",
                str(d + dt.timedelta(days=days)), "text", [call("date_add", date=str(d), days=days)], [])
    if kind == 1:
        e = d + dt.timedelta(days=rng.randint(1, 900))
        return (f"How many days are there from {d} to {e}?", str((e - d).days), "number",
                [call("date_diff", start=str(d), end=str(e))], [])
    return (f"What day of the week was {d}?", d.strftime("%A"), "text", [call("weekday", date=str(d))], [])


def gen_shop(rng):
    kind = rng.randrange(8)
    p, c, o = rng.choice(_PRODUCTS), rng.choice(_CUSTOMERS), rng.choice(_SHOP["orders"])
    if kind == 5:
        return (f"What is the total in USD of order number {o['id']}?", fmt(o["total"]), "number",
                [call("get_order", order_id=o["id"])], [])
    if kind == 6:
        units = sum(i["quantity"] for i in _SHOP["order_items"] if i["order_id"] == o["id"])
        return (f"How many units in total (all items together) does order number {o['id']} contain?", str(units),
                "number", [call("get_order", order_id=o["id"])], [])
    if kind == 7:
        return (f"Which product category does '{p['name']}' belong to?", p["category"], "text",
                [call("search_products", query=p["name"])], [])
    if kind == 0:
        return (f"What is the price in USD of the product '{p['name']}'?", fmt(p["price"]), "number",
                [call("search_products", query=p["name"])], [])
    if kind == 1:
        return (f"How many units of '{p['name']}' are in stock?", str(p["stock"]), "number",
                [call("search_products", query=p["name"])], [])
    if kind == 2:
        return (f"In which city does the customer {c['name']} live?", c["city"], "text",
                [call("find_customer", name=c["name"])], [])
    if kind == 3:
        return (f"How many orders has the customer {c['name']} placed?", str(len(_orders_of(c["id"]))), "number",
                [call("find_customer", name=c["name"]), call("list_orders", customer_id=c["id"])], [])
    cat, price = rng.choice(S.CATEGORIES), rng.choice([10, 20, 30, 50, 75, 100])
    n = sum(1 for q in _PRODUCTS if q["category"] == cat and q["price"] > price)
    sql = f"SELECT COUNT(*) FROM products WHERE category = '{cat}' AND price > {price}"
    return (f"How many products in the category '{cat}' cost more than {price} USD?", str(n), "number",
            [call("sql_query", sql=sql)], [])


def gen_multi(rng):
    kind = rng.randrange(5)
    c = rng.choice(_CUSTOMERS)
    orders = _orders_of(c["id"])
    find, lst = call("find_customer", name=c["name"]), call("list_orders", customer_id=c["id"])
    if kind == 0:
        cur = rng.choice(["EUR", "GBP", "JPY", "CHF"])
        last = orders[-1]
        v = S.convert_currency_value(last["total"], "USD", cur)
        return (f"What is the total of {c['name']}'s most recent order, converted to {cur}?", fmt(v), "number",
                [find, lst, call("convert_currency", amount=last["total"], from_currency="USD", to_currency=cur)], [])
    if kind == 1:
        p, n, cur = rng.choice(_PRODUCTS), rng.randint(2, 9), rng.choice(["EUR", "GBP", "CAD", "AUD"])
        expr = f"{p['price']} * {n}"
        usd = S.safe_eval(expr)
        v = S.convert_currency_value(usd, "USD", cur)
        return (f"How much do {n} units of '{p['name']}' cost in {cur}?", fmt(v), "number",
                [call("search_products", query=p["name"]), call("calculate", expression=expr),
                 call("convert_currency", amount=usd, from_currency="USD", to_currency=cur)], [])
    if kind == 2:
        if len(orders) < 2:
            return None
        days = (dt.date.fromisoformat(orders[-1]["date"]) - dt.date.fromisoformat(orders[0]["date"])).days
        return (f"How many days passed between {c['name']}'s first and most recent orders?", str(days), "number",
                [find, lst, call("date_diff", start=orders[0]["date"], end=orders[-1]["date"])], [])
    if kind == 3:
        last = orders[-1]
        return (f"On which day of the week did {c['name']} place their most recent order?",
                S.parse_date(last["date"]).strftime("%A"), "text",
                [find, lst, call("weekday", date=last["date"])], [])
    key, unit = rng.choice([("marathon_distance_km", "mi"), ("earth_radius_km", "mi"), ("everest_height_m", "ft"),
                            ("moon_distance_km", "mi"), ("mariana_trench_depth_m", "ft")])
    value = float(S.knowledge_base()[key])
    f = "km" if key.endswith("_km") else "m"
    v = round(S.convert_units_value(value, f, unit), 3)
    what = key.rsplit("_", 1)[0].replace("_", " ")
    return (f"Look up the {what} in the knowledge base (key '{key}') and convert it to {unit}. "
            f"Round the result to 3 decimal places.", fmt(v), "number",
            [call("kb_get", key=key), call("convert_units", value=value, from_unit=f, to_unit=unit)], [])


def gen_kb(rng):
    kb = S.knowledge_base()
    if rng.random() < 0.35:
        key = rng.choice(sorted(kb))
        val = kb[key]
        typ = "number" if re.fullmatch(r"-?\d+(\.\d+)?", val) else "text"
        if rng.random() < 0.5:
            return (f"What value is stored under the key '{key}' in the knowledge base?", val, typ,
                    [call("kb_get", key=key)], [])
        word = key.split("_")[0] if key.split("_")[0] not in ("store", "water") else key.split("_")[1]
        return (f"Search the knowledge base for '{word}' and report the value of the key '{key}'.", val, typ,
                [call("kb_search", query=word), call("kb_get", key=key)], [])
    price = round(rng.uniform(5, 900), 2)
    if rng.random() < 0.5:
        expr = f"{price} * (1 + {kb['vat_rate_percent']} / 100)"
        v = round(S.safe_eval(expr), 2)
        return (f"What does an item priced {price:.2f} USD cost including VAT (the VAT rate is in the knowledge "
                f"base)? Round to 2 decimal places.", fmt(v), "number",
                [call("kb_get", key="vat_rate_percent"), call("calculate", expression=expr)], [])
    expr = f"{price} * (1 - {kb['loyalty_discount_percent']} / 100)"
    v = round(S.safe_eval(expr), 2)
    return (f"What does an item priced {price:.2f} USD cost after the loyalty discount (the discount percent is "
            f"in the knowledge base)? Round to 2 decimal places.", fmt(v), "number",
            [call("kb_get", key="loyalty_discount_percent"), call("calculate", expression=expr)], [])


def gen_text(rng):
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
    kind = rng.randrange(5)
    if kind < 3:
        field = ["words", "characters", "vowels"][kind]
        return (f"How many {field} are in the text \"{text}\"?", str(S.text_statistics(text)[field]), "number",
                [call("text_stats", text=text)], [])
    op = ["reverse", "sort_words"][kind - 3]
    desc = {"reverse": "reversed character by character", "sort_words": "with its words sorted alphabetically"}[op]
    return (f"Give the text \"{text}\" {desc}.", S.transform(text, op), "text",
            [call("transform_text", text=text, operation=op)], [])


def gen_state(rng):
    if rng.random() < 0.5:
        p = rng.choice(_PRODUCTS)
        slug = p["name"].lower().replace(" ", "_").replace("-", "_")
        key = f"price:{slug}"
        return (f"Store the price in USD of '{p['name']}' in the knowledge base under the key '{key}' (the value "
                f"must be just the number), then answer with that price.", fmt(p["price"]), "number",
                [call("search_products", query=p["name"]), call("kb_set", key=key, value=fmt(p["price"]))],
                [{"tool": "kb_get", "arguments": {"key": key}, "expect": p["price"]}])
    picks = rng.sample([p for p in _PRODUCTS if p["stock"] >= 5], rng.randint(1, 2))
    qty = {p["id"]: rng.randint(1, 5) for p in picks}
    cart = S.cart_summary(qty)
    what = " and ".join(f"{qty[p['id']]} unit{'s' if qty[p['id']] > 1 else ''} of '{p['name']}'" for p in picks)
    calls = [call("search_products", query=p["name"]) for p in picks]
    calls += [call("cart_add", product_id=p["id"], quantity=qty[p["id"]]) for p in picks]
    expect = {"items": [{"product_id": i["product_id"], "quantity": i["quantity"]} for i in cart["items"]],
              "total_usd": cart["total_usd"]}
    return (f"Add {what} to the shopping cart (the cart starts empty), then answer with the cart total in USD.",
            fmt(cart["total_usd"]), "number", calls, [{"tool": "cart_view", "arguments": {}, "expect": expect}])


def gen_sales(rng):
    p = rng.choice(_PRODUCTS)
    sales, kind = S.product_sales_summary(p["id"]), rng.randrange(4)
    calls = [call("search_products", query=p["name"]), call("product_sales", product_id=p["id"])]
    if kind == 0:
        return (f"How many units of '{p['name']}' have been sold, over all orders together?", str(sales["units"]),
                "number", calls, [])
    if kind == 1:
        return (f"How many orders contain the product '{p['name']}'?", str(sales["orders"]), "number", calls, [])
    if kind == 2:
        return (f"What is the total revenue in USD from all sales of '{p['name']}'?", fmt(sales["revenue_usd"]),
                "number", calls, [])
    cur = rng.choice(["EUR", "GBP", "JPY", "CHF", "CAD", "AUD"])
    v = S.convert_currency_value(sales["revenue_usd"], "USD", cur)
    return (f"What is the total revenue from all sales of '{p['name']}', converted to {cur}?", fmt(v), "number",
            calls + [call("convert_currency", amount=sales["revenue_usd"], from_currency="USD", to_currency=cur)], [])


# records table -> (its rows in words, the TEXT column's condition, {number column: (what it measures,
# its "more than" words, its "less than" words)}); the table and column names stay out of the question
_RECORDS_WORDS = {
    "t_shp": ("shipments", "to {}", {
        "wt_kg": ("weight in kg", "weighing more than {} kg", "weighing less than {} kg"),
        "n_pc": ("number of pieces", "with more than {} pieces", "with fewer than {} pieces")}),
    "hr_px": ("employees", "in the {} department", {
        "sal_k": ("yearly salary in thousands of USD", "earning more than {} thousand USD a year",
                  "earning less than {} thousand USD a year"),
        "svc_y": ("years of service", "with more than {} years of service", "with fewer than {} years of service")}),
    "wx_d": ("weather readings", "from the station {}", {
        "tx_c": ("daily high in degrees C", "with a daily high above {} degrees C", "with a daily high below {} degrees C"),
        "rr_mm": ("rainfall in mm", "with more than {} mm of rain", "with less than {} mm of rain")}),
    "lb_x": ("book loans", "at the {} branch", {
        "lo_d": ("loan length in days", "kept out more than {} days", "kept out fewer than {} days"),
        "fee_c": ("late fee in cents", "with a late fee above {} cents", "with a late fee below {} cents")}),
    "fx_lg": ("flights", "departing from {}", {
        "blk_m": ("flight time in minutes", "longer than {} minutes", "shorter than {} minutes"),
        "pax": ("number of passengers", "with more than {} passengers", "with fewer than {} passengers")}),
    "mq_ev": ("machine stoppages", "on production line {}", {
        "dt_h": ("downtime in hours", "with more than {} hours of downtime", "with less than {} hours of downtime"),
        "prt": ("number of scrapped parts", "that scrapped more than {} parts", "that scrapped fewer than {} parts")}),
    "iv_r": ("restaurant inspections", "in the {} district", {
        "scr": ("inspection score", "scoring above {}", "scoring below {}"),
        "vio": ("number of violations", "with more than {} violations", "with fewer than {} violations")}),
    "gh_q": ("greenhouse plants", "of the species {}", {
        "ht_cm": ("height in cm", "taller than {} cm", "shorter than {} cm"),
        "lvs": ("number of leaves", "with more than {} leaves", "with fewer than {} leaves")}),
}
_NO_TOTAL = {"tx_c", "scr"}  # a sum of temperatures or scores answers no real question


def gen_discovery(rng, tables):
    """A question in plain words on one of the records tables (shop.RECORDS_SCHEMA): a count under a
    condition, or the largest / smallest / total of a column for one category. The oracle looks the
    table up first; the answer is what its query returns (no answer when nothing matches, or 0)."""
    t = rng.choice(tables)
    what, where, measures = _RECORDS_WORDS[t]
    (cat, _, _, choices), *nums = S.RECORDS_SCHEMA[t][1]
    col, _, _, (lo, hi) = rng.choice(nums)
    measure, more, less = measures[col]
    v = rng.choice(choices)
    kind = rng.randrange(3)
    if kind < 2:  # a count: a number condition, with a category (kind 0) or without (kind 1)
        x = rng.randint(int(lo) + 1, int(hi) - 1)
        op, words = rng.choice([(">", more), ("<", less)])
        cond, words = f"{col} {op} {x}", words.format(x)
        if kind == 0:
            cond, words = f"{cat} = '{v}' AND {cond}", f"{where.format(v)} {words}"
        q, sql = f"How many {what} {words} are in the records?", f"SELECT COUNT(*) FROM {t} WHERE {cond}"
    else:
        aggs = [("largest", "MAX"), ("smallest", "MIN")] + ([] if col in _NO_TOTAL else [("total", "SUM")])
        agg, fn = rng.choice(aggs)
        q = f"What is the {agg} {measure} of the {what} {where.format(v)}?"
        sql = f"SELECT {fn}({col}) FROM {t} WHERE {cat} = '{v}'"
    value = S.run_select(sql, database="records")["rows"][0][0]
    if not value:
        return None
    return (q, fmt(round(value, 6)), "number",
            [call("db_tables"), call("db_describe", table=t), call("db_query", sql=sql)], [])


# linked parent -> (the child's rows in words, how they link to a named parent, {number column: (what it
# measures, its "more than" words, its "less than" words)}); table and column names stay out of the question
_LINKED_WORDS = {
    "cl_ct": ("invoices", "sent to the client {}", {
        "amt_usd": ("amount in USD", "for more than {} USD", "for less than {} USD"),
        "dy_lt": ("number of days paid late", "paid more than {} days late", "paid less than {} days late")}),
    "vh_r": ("trips", "driven by the vehicle with plate {}", {
        "km": ("distance in km", "longer than {} km", "shorter than {} km"),
        "fu_l": ("fuel used in litres", "that used more than {} litres of fuel", "that used less than {} litres of fuel")}),
    "mb_s": ("club visits", "by the member {}", {
        "mn": ("length in minutes", "longer than {} minutes", "shorter than {} minutes"),
        "kc": ("kilocalories burnt", "that burnt more than {} kilocalories", "that burnt fewer than {} kilocalories")}),
    "sp_v": ("deliveries", "from the supplier {}", {
        "crt": ("number of crates", "of more than {} crates", "of fewer than {} crates"),
        "lt_h": ("hours late", "that came more than {} hours late", "that came less than {} hours late")}),
    "ar_p": ("shows", "played by {}", {
        "sld": ("number of tickets sold", "that sold more than {} tickets", "that sold fewer than {} tickets"),
        "enc": ("number of encores", "with more than {} encores", "with fewer than {} encores")}),
}


def gen_joins(rng, parents):
    """A question about one named thing of a linked parent table (shop.LINKED): how many of its child rows
    (under a condition, or all), or the largest / smallest / total of a child column. The child rows give
    the parent's catalogue number, not its name, so the query joins the two tables; the oracle looks both
    up first. The answer is what its query returns (no answer when nothing matches, or 0)."""
    p = rng.choice(parents)
    pair, (what, link, measures) = S.LINKED[p], _LINKED_WORDS[p]
    child = pair.child
    col, _, _, (lo, hi) = rng.choice(pair.measures)
    measure, more, less = measures[col]
    name, kind = rng.choice(pair.names), rng.randrange(3)
    join = (f"FROM {child} JOIN {p} ON {child}.{pair.ref_col} = {p}.{pair.id_col} "
            f"WHERE {p}.{pair.name_col} = '{name}'")
    if kind < 2:  # a count: under a number condition (kind 0), or all of them (kind 1)
        x = rng.randint(int(lo) + 1, int(hi) - 1)
        op, words = rng.choice([(">", more), ("<", less)])
        cond, words = (f" AND {child}.{col} {op} {x}", " " + words.format(x)) if kind == 0 else ("", "")
        q, sql = f"How many {what} {link.format(name)}{words} are in the records?", f"SELECT COUNT(*) {join}{cond}"
    else:
        agg, fn = rng.choice([("largest", "MAX"), ("smallest", "MIN"), ("total", "SUM")])
        q, sql = f"What is the {agg} {measure} of the {what} {link.format(name)}?", f"SELECT {fn}({child}.{col}) {join}"
    value = S.run_select(sql, database="records")["rows"][0][0]
    if not value:
        return None
    return (q, fmt(round(value, 6)), "number",
            [call("db_tables"), call("db_describe", table=p), call("db_describe", table=child),
             call("db_query", sql=sql)], [])


# family -> (generator(rng, tables), its tables, those only its test rows use)
_HELD_OUT_TABLES = {"discovery": (gen_discovery, list(S.RECORDS_SCHEMA), DISCOVERY_TEST_TABLES),
                    "joins": (gen_joins, list(S.LINKED), JOINS_TEST_PARENTS)}
GENERATORS = {"arith": gen_arith, "units": gen_units, "currency": gen_currency, "dates": gen_dates,
              "shop": gen_shop, "multi": gen_multi, "kb": gen_kb, "text": gen_text, "state": gen_state,
              "sales": gen_sales}

# ----------------------------------------------------------------------------------------------


def mcp_rows(seed: int = 0, counts: dict | None = None, test_fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    """(train_rows, test_rows): every family's tasks, unique prompts, split per family."""
    counts = counts or FAMILIES
    train, test = [], []
    for fam, n in counts.items():  # dict order is fixed, so the result is deterministic
        n_test = min(n, max(1, round(n * test_fraction)))
        if fam in _HELD_OUT_TABLES:  # held-out schemas: test tasks on tables no train task uses, each its own stream
            gen, tables, test_tables = _HELD_OUT_TABLES[fam]
            train_tables = [t for t in tables if t not in test_tables]
            tasks = _unique_tasks(lambda rng: gen(rng, test_tables), n_test, f"{seed}:{fam}:test")
            tasks += _unique_tasks(lambda rng: gen(rng, train_tables), n - n_test, f"{seed}:{fam}:train")
        else:
            tasks = _unique_tasks(GENERATORS[fam], n, f"{seed}:{fam}")
        for i, (q, answer, typ, calls, checks) in enumerate(tasks):
            split = "test" if i < n_test else "train"
            row = {
                "data_source": f"nanorl_mcp/{fam}",
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}],
                "env_class": "mcp",
                "reward_spec": {"method": "rule", "ground_truth": {"answer": answer, "type": typ, "check": checks}},
                "extra_info": {"family": fam, "split": split, "index": i, "oracle_calls": calls,
                               "oracle_answer": answer},
            }
            (test if split == "test" else train).append(row)
    return train, test


def _unique_tasks(gen, n: int, stream: str) -> list[tuple]:
    """n tasks of distinct questions from gen(rng), rng seeded by stream (a larger n keeps the first n)."""
    rng = random.Random(stream)
    seen, tasks, tries = set(), [], 0
    while len(tasks) < n:
        tries += 1
        if tries > 50 * n:
            raise RuntimeError(f"mcp_tasks: could only make {len(tasks)} unique tasks of {stream!r} "
                               f"(seed:family), wanted {n}")
        t = gen(rng)
        if t is None or t[0] in seen:
            continue
        seen.add(t[0])
        tasks.append(t)
    return tasks


def n_calls(row: dict) -> int:
    """Tool calls the row's oracle makes (one a turn; the answer turn not counted)."""
    return len(row["extra_info"]["oracle_calls"])


def select_rows(rows: list[dict], families=None, min_calls: int | None = None,
                max_calls: int | None = None) -> list[dict]:
    """The rows of `families` (None: every family) whose oracle makes min_calls..max_calls tool calls
    (None: no bound), in their order. Rows are kept whole, so a state task keeps its check."""
    return [r for r in rows if (families is None or r["extra_info"]["family"] in families)
            and (min_calls is None or n_calls(r) >= min_calls) and (max_calls is None or n_calls(r) <= max_calls)]


def main(argv=None):
    """Write the rows as train.<fmt> and test.<fmt> (module doc); returns (train, test)."""
    from support.rows import save_rows
    ap = argparse.ArgumentParser(description="Generate MCP tool-use tasks (train/test) for the bundled server.")
    ap.add_argument("--out", default="data/out/mcp", help="output folder (gets train.<fmt> and test.<fmt>)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (same seed, same rows)")
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="file format")
    ap.add_argument("--test-fraction", type=float, default=0.1, help="share of each family held out for test")
    ap.add_argument("--families", default=None,
                    help=f"comma-separated families to keep (default: all of {','.join(FAMILIES)}; "
                         f"also: {','.join(EXTRA_FAMILIES)})")
    ap.add_argument("--min-calls", type=int, default=None, help="keep tasks whose oracle makes at least K tool calls")
    ap.add_argument("--max-calls", type=int, default=None, help="keep tasks whose oracle makes at most K tool calls")
    ap.add_argument("--count", action="append", default=[], metavar="FAMILY=N",
                    help="generate N tasks of FAMILY (before the selection) instead of its default; repeatable")
    a = ap.parse_args(argv)
    families = a.families.split(",") if a.families else list(FAMILIES)
    known = {**FAMILIES, **EXTRA_FAMILIES}
    unknown = sorted(set(families) - set(known))
    if unknown:
        ap.error(f"--families: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    counts = {f: known[f] for f in known if f in families}  # FAMILIES' order, whatever --families says
    for f, n in (c.split("=", 1) if "=" in c else (c, "") for c in a.count):
        if f not in counts or not n.isdigit():
            ap.error(f"--count {f}={n}: want FAMILY=N with FAMILY one of {', '.join(counts)} and N a whole number")
        counts[f] = int(n)
    train, test = mcp_rows(a.seed, counts, test_fraction=a.test_fraction)
    train, test = (select_rows(rows, families, a.min_calls, a.max_calls) for rows in (train, test))
    if not test or not train:
        raise SystemExit(f"the selection leaves {len(train)} train and {len(test)} test rows: nothing to write")
    for name, rows in (("train", train), ("test", test)):
        path = os.path.join(a.out, f"{name}.{a.format}")
        save_rows(rows, path)
        mix = collections.Counter(f"{r['extra_info']['family']}/{n_calls(r)}" for r in rows)
        shown = ", ".join(f"{k} {v}" for k, v in sorted(mix.items()))
        print(f"wrote {len(rows)} rows to {path} (family/calls: {shown})")
    return train, test


if __name__ == "__main__":
    main()
