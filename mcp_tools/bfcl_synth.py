r"""
Training conversations over BFCL's classes that are none of BFCL's tests (synth_rows, data_source
bfcl/synth): 2-4 user turns over one class each (SYNTH: file system + math, vehicle, trading,
travel, messages, Twitter, tickets) from random start states and goals, some turns of dependent
calls (look up, then act), answers known by construction, end states checked by
mcp_tools/bfcl.verdict like the tests'. A task whose user message or initial_config equals a test
task's is dropped (held_out_keys); tests/test_bfcl.py checks that again on the rows.

Two classes (synth_pair, named "MAIN+SIDE", e.g. "TravelAPI+MessageAPI"), as 492 of the 800
tests have (file system + math aside): the first 1-2 turns of a MAIN class's conversation (file
system, vehicle, trading, travel) and 1-2 of a SIDE class's (messages, Twitter, tickets), merged in
a random order that keeps each one's own, then a last turn of both: a value looked up with MAIN's
tools and passed on with SIDE's (a tyre's pressure, a share price, an airport code, a sum -> a
message, a tweet, a ticket). Classes and start states are the union; the classes share no function
names and no state, so each turn is checked as in its own conversation. Default (MIX): every class
and every pair once, in turn: 7 of 19 rows of one class (BFCL's tests: 308 of 800, FS + math as one).

    python -m mcp_tools.bfcl_synth --n 2000 --seed 0 --out data/out/bfcl/train.jsonl [--classes ...] [--turn-credit W] [--played P]
"""
import argparse
import copy
import json

from mcp_tools.bfcl import (CATEGORIES, CLASSES, _methods, check_turn_credit, execute, function_docs, load_bfcl,
                            new_instances, to_row)


_WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
          "lichen", "marble", "nectar", "onyx", "pewter", "quartz", "russet", "saffron", "tundra", "umber", "velvet",
          "willow", "xenon", "yarrow", "zephyr")
_USERS = ("mira", "oskar", "priya", "tomas", "yuki", "lena")
_NAMES = ("Ada", "Bruno", "Chiara", "Dmitri", "Esme", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kaia", "Luca",
          "Mateo", "Nadia", "Olek", "Pilar")  # message contacts, tweeters (the tests': Alice, Bob, Catherine, ...)


def _sentence(rng) -> str:
    return " ".join(rng.sample(_WORDS, rng.randint(3, 6))).capitalize() + "."


def _secret(rng) -> str:
    return "".join(rng.choice("abcdefghjkmnpqrstuvwxyz23456789") for _ in range(rng.randint(10, 16)))


def synth_task(rng, i: int) -> dict:
    """One file-system (+ math) conversation in BFCL's task format, built from random names: a start
    state (a home folder of 2-3 folders of files), then 2-4 user turns, each a goal whose answer
    calls are known by construction (templates below) and whose end state verdict() checks."""
    folders = {f: {f"{rng.choice(_WORDS)}_{k}.txt": "\n".join(_sentence(rng) for _ in range(rng.randint(2, 4)))
                   for k in range(rng.randint(1, 3))} for f in rng.sample(_WORDS, rng.randint(2, 3))}
    user = rng.choice(_USERS)
    config = {"GorillaFileSystem": {"root": {user: {"type": "directory", "contents": {
        f: {"type": "directory", "contents": {n: {"type": "file", "content": c} for n, c in files.items()}}
        for f, files in folders.items()}}}}}
    here, turns, answers = None, [], []  # here: the folder the episode is in (None: the home folder)
    for _ in range(rng.randint(2, 4)):
        go = rng.choice(sorted(folders))  # the episode moves there first, if it is elsewhere
        calls = [] if go == here else (["cd(folder='..')"] if here else []) + [f"cd(folder='{go}')"]
        here, files = go, folders[go]
        name = rng.choice(sorted(files))
        kind = rng.choice(("touch", "echo", "grep", "wc", "copy", "tail", "sum"))
        if kind in ("touch", "echo"):
            new = f"{rng.choice(_WORDS)}_notes.txt"
            while new in files:
                new = "x" + new
            text = _sentence(rng)
            q = (f"In the '{go}' folder, create a file called '{new}'"
                 + (f" and write '{text}' into it." if kind == "echo" else "."))
            calls += [f"touch(file_name='{new}')"] + ([f"echo(content='{text}',file_name='{new}')"] if kind == "echo" else [])
            files[new] = text if kind == "echo" else ""
        elif kind == "grep":
            word = rng.choice(files[name].replace(".", "").lower().split() or ["amber"])
            q = f"Which lines of '{name}' in the '{go}' folder mention '{word}'?"
            calls.append(f"grep(file_name='{name}',pattern='{word}')")
        elif kind == "wc":
            q = f"How many words are in '{name}' (in '{go}')?"
            calls.append(f"wc(file_name='{name}',mode='w')")
        elif kind == "copy":
            new = f"{rng.choice(_WORDS)}_backup"
            while new in files:
                new = "x" + new
            q = f"Inside '{go}', make a folder named '{new}' and put a copy of '{name}' in it."
            calls += [f"mkdir(dir_name='{new}')", f"cp(source='{name}',destination='{new}')"]
            files[new] = None  # a folder: never picked as a file again
        elif kind == "tail":
            k = rng.randint(1, 3)
            q = f"Show me the last {k} line{'s' * (k > 1)} of '{name}' in '{go}'."
            calls.append(f"tail(file_name='{name}',lines={k})")
        else:
            nums = [rng.randint(2, 999) for _ in range(rng.randint(2, 4))]
            q = f"Open the '{go}' folder, then add up {', '.join(map(str, nums[:-1]))} and {nums[-1]} for me."
            calls.append(f"sum_values(numbers={nums})")
        folders[go] = {n: c for n, c in files.items() if c is not None} if kind == "copy" else files
        turns.append([{"role": "user", "content": q}])
        answers.append(calls)
    turns[0][0]["content"] = f"I am {user}. " + turns[0][0]["content"]
    return {"id": f"synth_{i}", "question": turns, "initial_config": config,
            "involved_classes": ["GorillaFileSystem", "MathAPI"], "ground_truth": answers}


def synth_vehicle(rng, i: int) -> dict:
    """One VehicleControlAPI conversation (the base tests' most used class, with the file system,
    TradingBot and TravelAPI: 50 tasks each): a random car state (fuel, doors, climate, tyres, drawn
    wider than the tests' few fixed cars), then 2-4 turns, some of two or three dependent calls
    (look the fuel up, then fill to full; press the brake fully, then start)."""
    doors = {d: rng.choice(("locked", "unlocked")) for d in ("driver", "passenger", "rear_left", "rear_right")}
    fuel = rng.randint(1, 45) + rng.choice((0.0, 0.25, 0.5, 0.75))  # exact in binary: 50 - fuel + fuel == 50
    car = {"fuelLevel": fuel, "batteryVoltage": round(rng.uniform(11.8, 13.2), 1), "engineState": "stopped",
           "doorStatus": doors, "acTemperature": float(rng.randint(16, 28)), "fanSpeed": rng.randint(0, 100),
           "acMode": rng.choice(("auto", "cool", "heat")), "humidityLevel": float(rng.randint(20, 80)),
           "headLightStatus": rng.choice(("on", "off")), "parkingBrakeStatus": "released", "parkingBrakeForce": 0.0,
           "slopeAngle": 0.0, "distanceToNextVehicle": float(rng.randint(10, 90)), "cruiseStatus": "inactive",
           "destination": "None", **{f"{t}TirePressure": float(rng.randint(28, 36)) for t in
                                     ("frontLeft", "frontRight", "rearLeft", "rearRight")}}
    start = copy.deepcopy(car)  # the turns below track the car's state in car and doors
    turns, answers, kinds = [], [], ["fill", "start", "climate", "lights", "nav", "lock"]
    rng.shuffle(kinds)
    for kind in kinds[:rng.randint(2, 4)]:
        if kind == "fill":  # two dependent calls: the amount is 50 minus what the status shows
            q, calls = "Check how much fuel is in the tank and fill it up to the full 50 gallons.", [
                "displayCarStatus(option='fuel')", f"fillFuelTank(fuelAmount={50 - car['fuelLevel']})"]
            car["fuelLevel"] = 50.0
        elif kind == "start":
            open_ = [d for d, v in doors.items() if v == "unlocked"]
            q = "Get the car started: lock whatever doors are open, press the brake all the way and start the engine."
            calls = ([f"lockDoors(unlock=False,door={open_})"] if open_ else []) + [
                "pressBrakePedal(pedalPosition=1.0)", "startEngine(ignitionMode='START')"]
            doors.update({d: "locked" for d in open_})
        elif kind == "climate":
            t, fan, mode = rng.randint(60, 80), rng.randrange(10, 100, 5), rng.choice(("cool", "heat", "defrost"))
            q = f"Set the cabin to {t} degrees Fahrenheit, fan at {fan}, in {mode} mode."
            calls = [f"adjustClimateControl(temperature={t},unit='fahrenheit',fanSpeed={fan},mode='{mode}')"]
        elif kind == "lights":
            mode = "off" if car["headLightStatus"] == "on" else "on"
            q, calls = f"Turn the headlights {mode}.", [f"setHeadlights(mode='{mode}')"]
            car["headLightStatus"] = mode
        elif kind == "nav":
            where = f"{rng.randint(10, 9999)} {rng.choice(_WORDS).title()} Road, {rng.choice(_WORDS).title()}ville, OR"
            q, calls = f"Navigate me to {where}.", [f"set_navigation(destination='{where}')"]
        else:
            pick = rng.sample(sorted(doors), rng.randint(1, 3))
            unlock = rng.random() < 0.5
            q = f"Please {'unlock' if unlock else 'lock'} the {', '.join(p.replace('_', ' ') for p in pick)} door{'s' * (len(pick) > 1)}."
            calls = [f"lockDoors(unlock={unlock},door={pick})"]
            doors.update({d: "unlocked" if unlock else "locked" for d in pick})
        turns.append([{"role": "user", "content": q}])
        answers.append(calls)
    return {"id": f"synth_{i}", "question": turns, "initial_config": {"VehicleControlAPI": start},
            "involved_classes": ["VehicleControlAPI"], "ground_truth": answers}


_COMPANIES = {"Apple": "AAPL", "Google": "GOOG", "Tesla": "TSLA", "Microsoft": "MSFT", "Nvidia": "NVDA",
              "Zeta Corp": "ZETA", "Alpha Tech": "ALPH", "Omega Industries": "OMEG", "Quasar Ltd.": "QUAS",
              "Neptune Systems": "NEPT", "Synex Solutions": "SYNX"}  # TradingBot.get_symbol_by_name's map (bfcl-eval 2025.10)


def synth_trading(rng, i: int) -> dict:
    """One TradingBot conversation: a random market (5-9 of the companies get_symbol_by_name knows, at
    random prices), account, watch list and orders (the tests mostly keep the class's defaults), then
    2-4 turns: a company bought at its quoted price (name -> symbol -> quote -> order), the latest
    order looked up and cancelled, the watch list edited, money paid in or out."""
    names = rng.sample(sorted(_COMPANIES), rng.randint(5, 9))
    stocks = {_COMPANIES[n]: {"price": round(rng.uniform(5, 900), 2), "percent_change": round(rng.uniform(-3, 3), 2),
                              "volume": round(rng.uniform(0.1, 5), 3), "MA(5)": round(rng.uniform(5, 900), 2),
                              "MA(20)": round(rng.uniform(5, 900), 2)} for n in names}
    ids = sorted(rng.sample(range(20000, 99999), rng.randint(1, 3)))
    orders = {str(k): {"id": k, "order_type": rng.choice(("Buy", "Sell")), "symbol": rng.choice(sorted(stocks)),
                       "price": round(rng.uniform(5, 900), 2), "amount": rng.randint(1, 40),
                       "status": rng.choice(("Open", "Pending") if k == ids[-1] else ("Completed", "Cancelled"))}
              for k in ids}
    watch = rng.sample(sorted(stocks), rng.randint(1, 3))
    balance = float(rng.randrange(20_000, 200_000, 250))
    config = {"orders": orders, "account_info": {"account_id": rng.randint(10000, 99999), "balance": balance,
                                                 "binding_card": rng.randint(10**15, 10**16 - 1)},
              "authenticated": True, "market_status": "Open", "order_counter": ids[-1] + 1, "stocks": stocks,
              "watch_list": watch, "transaction_history": [], "random_seed": rng.randint(1, 10**6)}
    last, turns, answers, kinds = ids[-1], [], [], ["buy", "cancel", "watch", "unwatch", "fund", "withdraw"]
    rng.shuffle(kinds)
    for kind in kinds[:rng.randint(2, 4)]:
        if kind == "buy":  # three dependent calls: the symbol, then its price, then the order
            name = rng.choice(names)
            sym, price = _COMPANIES[name], stocks[_COMPANIES[name]]["price"]
            n = rng.randint(1, max(1, min(50, int(balance // price))))
            q = f"Buy {n} shares of {name} at its current market price."
            calls = [f"get_symbol_by_name(name='{name}')", f"get_stock_info(symbol='{sym}')",
                     f"place_order(order_type='Buy',symbol='{sym}',price={price},amount={n})"]
            last += 1
        elif kind == "cancel":  # two: the history shows the newest id, which is then cancelled
            q, calls = "Find my most recent order and cancel it.", ["get_order_history()", f"cancel_order(order_id={last})"]
        elif kind == "watch":
            name = rng.choice([n for n in names if _COMPANIES[n] not in watch] or names)
            q = f"Add {name} to my watchlist."
            calls = [f"get_symbol_by_name(name='{name}')", f"add_to_watchlist(stock='{_COMPANIES[name]}')"]
            watch = watch + [_COMPANIES[name]] * (_COMPANIES[name] not in watch)
        elif kind == "unwatch" and watch:
            sym = rng.choice(watch)
            q, calls = f"Take {sym} off my watchlist.", [f"remove_stock_from_watchlist(symbol='{sym}')"]
            watch = [w for w in watch if w != sym]
        else:
            amount = float(rng.randrange(100, 5000, 25))
            pay_in = kind != "withdraw"
            q = f"{'Deposit' if pay_in else 'Withdraw'} ${amount:,.2f} {'into' if pay_in else 'from'} my trading account."
            calls = [f"{'fund_account' if pay_in else 'withdraw_funds'}(amount={amount})"]
            balance += amount if pay_in else -amount
        turns.append([{"role": "user", "content": q}])
        answers.append(calls)
    return {"id": f"synth_{i}", "question": turns, "initial_config": {"TradingBot": config},
            "involved_classes": ["TradingBot"], "ground_truth": answers}


_AIRPORTS = {"Rivermist": "RMS", "Stonebrook": "SBK", "Maplecrest": "MPC", "Silverpine": "SVP", "Shadowridge": "SHD",
             "London": "LHR", "Paris": "CDG", "Sunset Valley": "SSV", "Oakendale": "OKD", "Willowbend": "WLB",
             "Crescent Hollow": "CRH", "Autumnville": "ATV", "Pinehaven": "PHV", "Greenfield": "GFD",
             "San Francisco": "SFO", "Los Angeles": "LAX", "New York": "JFK", "Chicago": "ORD", "Boston": "BOS",
             "Beijing": "PEK", "Hong Kong": "HKG", "Tokyo": "HND"}  # TravelAPI.get_nearest_airport_by_city (bfcl-eval 2025.10)
_ROUTES = ("SFO-LAX SFO-JFK SFO-BOS LAX-JFK LAX-ORD LAX-HND JFK-ORD JFK-BOS JFK-PEK ORD-BOS RMS-SBK SBK-MPC "
           "MPC-SVP SVP-SHD SHD-SSV SSV-OKD OKD-WLB WLB-CRH CRH-ATV CRH-HKG ATV-PHV PHV-GFD LHR-CDG RMS-LAX").split()
_CITY = {code: city for city, code in _AIRPORTS.items()}  # routes: a subset of get_flight_cost's base_costs


def synth_travel(rng, i: int) -> dict:
    """One TravelAPI conversation: a random traveller (token, 1-3 cards with balances, 0-2 past
    bookings), then 2-4 turns: a flight booked between two cities (city -> airport twice, then
    book_flight), a past trip found in the history and cancelled, a budget set, a card's balance."""
    token = _secret(rng)
    first, last = rng.choice(_USERS).title(), rng.choice(_WORDS).title()
    cards = {str(rng.randint(10**11, 10**12 - 1)): {
        "card_number": str(rng.randint(10**15, 10**16 - 1)), "expiration_date": f"{rng.randint(1, 12):02d}/{rng.randint(2028, 2033)}",
        "cardholder_name": f"{first} {last}", "card_verification_number": rng.randint(100, 999),
        "balance": float(rng.randrange(15_000, 60_000, 50))} for _ in range(rng.randint(1, 3))}
    date = lambda: f"{rng.randint(2027, 2029)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    bookings = {}
    for _ in range(rng.randint(0, 2)):
        a, b = rng.choice(_ROUTES).split("-")
        bookings[str(rng.randint(10**6, 10**7 - 1))] = {
            "card_id": rng.choice(sorted(cards)), "travel_date": date(), "travel_from": a, "travel_to": b,
            "travel_class": rng.choice(("economy", "business")), "travel_cost": float(rng.randrange(150, 2000, 10)),
            "transaction_id": str(rng.randint(10**7, 10**8 - 1))}
    config = {"random_seed": rng.randint(1, 10**6), "credit_card_list": cards, "booking_record": bookings,
              "access_token": token, "token_type": "Bearer", "token_expires_in": rng.choice((1800, 3600, 7200)),
              "token_scope": "read_write", "user_first_name": first, "user_last_name": last, "budget_limit": None}
    start = copy.deepcopy(config)  # the turns below pop from bookings
    turns, answers, kinds = [], [], ["book", "cancel", "budget", "balance"]
    rng.shuffle(kinds)
    for kind in kinds[:rng.randint(2, 4)]:
        card = rng.choice(sorted(cards))
        if kind == "book":  # three dependent calls: both airports, then the booking
            a, b = rng.choice(_ROUTES).split("-")
            when, cls = date(), rng.choice(("economy", "business", "first"))
            q = f"Book me a {cls} flight from {_CITY[a]} to {_CITY[b]} on {when}, paid with card {card}."
            calls = [f"get_nearest_airport_by_city(location='{_CITY[a]}')", f"get_nearest_airport_by_city(location='{_CITY[b]}')",
                     f"book_flight(access_token='{token}',card_id='{card}',travel_date='{when}',travel_from='{a}',"
                     f"travel_to='{b}',travel_class='{cls}')"]
        elif kind == "cancel" and bookings:  # two: the history gives the booking's id
            bid = rng.choice(sorted(bookings))
            bk = bookings.pop(bid)
            q = f"Look through my bookings and cancel the {bk['travel_date']} trip from {_CITY[bk['travel_from']]} to {_CITY[bk['travel_to']]}."
            calls = [f"get_booking_history(access_token='{token}')", f"cancel_booking(access_token='{token}',booking_id='{bid}')"]
        elif kind in ("budget", "cancel"):
            limit = float(rng.randrange(100, 2000, 50))
            q, calls = f"Set my travel budget limit to {limit:.0f} USD.", [f"set_budget_limit(access_token='{token}',budget_limit={limit})"]
        else:
            q, calls = f"What is the balance on my card {card}?", [f"get_credit_card_balance(access_token='{token}',card_id='{card}')"]
        turns.append([{"role": "user", "content": q}])
        answers.append(calls)
    turns[0][0]["content"] = f"My travel access token is '{token}'. " + turns[0][0]["content"]
    return {"id": f"synth_{i}", "question": turns, "initial_config": {"TravelAPI": start},
            "involved_classes": ["TravelAPI"], "ground_truth": answers}


def synth_message(rng, i: int, fact: tuple | None = None) -> dict:
    """One MessageAPI conversation: a random workspace (4-7 contacts, ids USR001 on; 1-4 messages sent
    already; logged in, or the first turn logs in), then 2-4 turns: a contact messaged by name (name
    -> id -> send), a new contact added and messaged (add_contact gives the next id), the latest
    message to someone deleted, the sent messages searched for a word, the first one found forwarded.
    fact: 1-2 turns, then one passing another class's value on (_fact, synth_pair)."""
    names = rng.sample(_NAMES, rng.randint(4, 7))
    users = {n: f"USR{k:03d}" for k, n in enumerate(names, 1)}
    me = names.pop(rng.randrange(len(names)))  # names: everyone else
    inbox = [{users[rng.choice(names)]: _sentence(rng)} for _ in range(rng.randint(1, 4))]
    start = copy.deepcopy({"random_seed": rng.randint(1, 10**6), "user_count": len(users), "user_map": users,
                           "inbox": inbox, "message_count": len(inbox),
                           "current_user": users[me] if rng.random() < 0.5 else None})  # the turns track users, inbox
    who = {uid: n for n, uid in users.items()}
    turns, answers, kinds = [], [], ["send", "contact", "delete", "search", "forward"]
    rng.shuffle(kinds)
    for kind in kinds[:rng.randint(1, 2) if fact else rng.randint(2, 4)]:
        texts = [text for m in inbox for text in m.values()]
        word = rng.choice(rng.choice(texts).rstrip(".").lower().split()) if texts else ""
        to, text = rng.choice(names), _sentence(rng)
        if kind == "contact":  # two dependent calls: add_contact answers the new id
            new = rng.choice([n for n in _NAMES if n not in users])
            uid = f"USR{len(users) + 1:03d}"
            users[new], who[uid] = uid, new
            q = f"Add {new} to my contacts and send them '{text}'"
            calls = [f"add_contact(user_name='{new}')", f"send_message(receiver_id='{uid}',message='{text}')"]
            names.append(new)
            inbox.append({uid: text})
        elif kind == "delete" and inbox:
            uid = rng.choice([r for m in inbox for r in m])
            q = f"Delete the last message I sent to {who[uid]}."
            calls = [f"get_user_id(user='{who[uid]}')", f"delete_message(receiver_id='{uid}')"]
            del inbox[max(k for k, m in enumerate(inbox) if uid in m)]
        elif kind == "search" and texts:
            q, calls = f"Which of the messages I sent mention '{word}'?", [f"search_messages(keyword='{word}')"]
        elif kind == "forward" and texts:  # three: the text found, the receiver's id, the message
            found = next(t for t in texts if word in t.lower())  # search_messages keeps the inbox's order
            q = f"Find the first message I sent that mentions '{word}' and send the same text to {to}."
            calls = [f"search_messages(keyword='{word}')", f"get_user_id(user='{to}')",
                     f"send_message(receiver_id='{users[to]}',message='{found}')"]
            inbox.append({users[to]: found})
        else:
            q = f"Send {to} the message '{text}'"
            calls = [f"get_user_id(user='{to}')", f"send_message(receiver_id='{users[to]}',message='{text}')"]
            inbox.append({users[to]: text})
        turns.append([{"role": "user", "content": q}])
        answers.append(calls)
    if start["current_user"] is None:
        turns[0][0]["content"] = f"Log me in to messaging as {users[me]}. " + turns[0][0]["content"]
        answers[0].insert(0, f"message_login(user_id='{users[me]}')")
    if fact:
        to = rng.choice(names)
        turns.append([{"role": "user", "content": f"{fact[1]} and send it to {to} as the message '{fact[2]}'."}])
        answers.append(fact[0] + [f"get_user_id(user='{to}')",
                                  f"send_message(receiver_id='{users[to]}',message='{fact[3]}')"])
    return {"id": f"synth_{i}", "question": turns, "initial_config": {"MessageAPI": start},
            "involved_classes": ["MessageAPI"], "ground_truth": answers}


def _keyword(rng, tweets: dict, ids) -> tuple[str, int] | None:
    """(a word, the tweet of ids that search_tweets finds by it alone), or None."""
    hits = [(w, k) for k in ids for w in tweets[k]["content"].rstrip(".").lower().split()
            if sum(w in t["content"].lower() for t in tweets.values()) == 1]
    return rng.choice(sorted(hits)) if hits else None


def synth_twitter(rng, i: int, fact: tuple | None = None) -> dict:
    """One TwitterAPI conversation: a random account (handle, password; signed in, or the first turn
    signs in; follows 1-3 of four others) and 2-5 tweets by it and the others, then 2-4 turns: a tweet
    posted (tags, mentions), a comment under the tweet a word finds (search -> comment), someone's
    latest tweet retweeted (their tweets -> retweet), the author of the tweet a word finds followed,
    someone unfollowed (list -> unfollow), someone tagged in my latest tweet. fact: as synth_message's."""
    me, password = f"{rng.choice(_WORDS)}_{rng.choice(_USERS)}", _secret(rng)
    others = [f"{w}_{n.lower()}" for w, n in zip(rng.sample(_WORDS, 4), rng.sample(_NAMES, 4))]
    first = rng.randint(0, 20)
    tweets = {k: {"id": k, "username": rng.choice([me] + others), "content": _sentence(rng),
                  "tags": [f"#{w}" for w in rng.sample(_WORDS, rng.randint(0, 2))], "mentions": []}
              for k in range(first, first + rng.randint(2, 5))}
    following = rng.sample(others, rng.randint(1, 3))
    start = copy.deepcopy({"username": me, "password": password, "authenticated": rng.random() < 0.5,
                           "tweets": {str(k): t for k, t in tweets.items()}, "comments": {}, "retweets": {},
                           "following_list": following, "tweet_counter": first + len(tweets)})
    turns, answers, kinds = [], [], ["post", "comment", "retweet", "follow", "unfollow", "mention"]
    rng.shuffle(kinds)
    for kind in kinds[:rng.randint(1, 2) if fact else rng.randint(2, 4)]:
        mine = [k for k, t in tweets.items() if t["username"] == me]
        theirs = sorted({t["username"] for t in tweets.values()} - {me})
        unfollowed = [k for k, t in tweets.items() if t["username"] not in following + [me]]
        if kind == "comment" and (hit := _keyword(rng, tweets, tweets)):  # two: search, then comment
            text = _sentence(rng)
            q = f"Find the tweet about '{hit[0]}' and comment '{text}' under it."
            calls = [f"search_tweets(keyword='{hit[0]}')", f"comment(tweet_id={hit[1]},comment_content='{text}')"]
        elif kind == "retweet" and theirs:
            name = rng.choice(theirs)
            q = f"Retweet the latest tweet by {name}."
            calls = [f"get_user_tweets(username='{name}')",
                     f"retweet(tweet_id={max(k for k, t in tweets.items() if t['username'] == name)})"]
        elif kind == "follow" and (hit := _keyword(rng, tweets, unfollowed)):
            name = tweets[hit[1]]["username"]
            q = f"Follow whoever wrote the tweet about '{hit[0]}'."
            calls = [f"search_tweets(keyword='{hit[0]}')", f"follow_user(username_to_follow='{name}')"]
            following.append(name)
        elif kind == "unfollow" and following:
            name = rng.choice(following)
            q, calls = f"Show me who I follow, then unfollow {name}.", [
                "list_all_following()", f"unfollow_user(username_to_unfollow='{name}')"]
            following.remove(name)
        elif kind == "mention" and mine:
            name = rng.choice(others)
            q = f"Tag @{name} in my latest tweet."
            calls = [f"get_user_tweets(username='{me}')",
                     f"mention(tweet_id={max(mine)},mentioned_usernames=['@{name}'])"]
        else:
            text, tags = _sentence(rng), [f"#{w}" for w in rng.sample(_WORDS, rng.randint(0, 2))]
            at = [f"@{o}" for o in rng.sample(others, rng.randint(0, 1))]
            q = f"Tweet '{text}'" + "".join(f", tagged {t}" for t in tags) + "".join(f", mentioning {a}" for a in at) + "."
            args = f"content='{text}'" + (f",tags={tags}" if tags else "") + (f",mentions={at}" if at else "")
            calls = [f"post_tweet({args})"]
            k = first + len(tweets)  # ids run on from the start's, and no tweet is deleted
            tweets[k] = {"id": k, "username": me, "content": text, "tags": tags, "mentions": at}
        turns.append([{"role": "user", "content": q}])
        answers.append(calls)
    sign_in = "" if start["authenticated"] else f" and my password is '{password}'; sign me in"
    turns[0][0]["content"] = f"My Twitter handle is '{me}'{sign_in}. " + turns[0][0]["content"]
    if sign_in:
        answers[0].insert(0, f"authenticate_twitter(username='{me}',password='{password}')")
    if fact:
        turns.append([{"role": "user", "content": f"{fact[1]} and tweet it as '{fact[2]}'."}])
        answers.append(fact[0] + [f"post_tweet(content='{fact[3]}')"])
    return {"id": f"synth_{i}", "question": turns, "initial_config": {"TwitterAPI": start},
            "involved_classes": ["TwitterAPI"], "ground_truth": answers}


_ISSUES = ("Printer jams", "VPN drops", "Login loops", "Laptop overheats", "Mail bounces", "Badge fails",
           "Disk is full", "Screen flickers", "License expired", "Wifi is slow", "Build is red", "Backup failed")
_STATUSES = ("Open", "In Progress", "Resolved", "Closed")


def synth_ticket(rng, i: int, fact: tuple | None = None) -> dict:
    """One TicketAPI conversation: a random queue (2-5 tickets, the user's and others', any status and
    priority, ids from anywhere; logged in, or the first turn logs in), then 2-4 turns: a ticket
    opened, one looked up by id and resolved (get -> resolve), one of the user's open ones found by
    its title and closed (their open tickets -> close), one's priority (and status) edited, the
    user's tickets of one status listed. fact: as synth_message's."""
    me, password = f"{rng.choice(_USERS)}.{rng.choice(_WORDS)}", _secret(rng)
    others = [f"{n.lower()}.{rng.choice(_WORDS)}" for n in rng.sample(_NAMES, 2)]
    ids, titles = sorted(rng.sample(range(1, 99999), rng.randint(2, 5))), rng.sample(_ISSUES, len(_ISSUES))
    title = lambda: f"{titles.pop()} on {rng.choice(_WORDS)}-{rng.randint(1, 99)}"  # no two alike
    queue = [{"id": k, "title": title(), "description": _sentence(rng), "status": rng.choice(_STATUSES),
              "priority": rng.randint(1, 5), "created_by": me if rng.random() < 0.6 else rng.choice(others)}
             for k in ids]
    start = copy.deepcopy({"ticket_queue": queue, "ticket_counter": ids[-1] + 1,
                           "current_user": me if rng.random() < 0.5 else None})
    turns, answers, kinds = [], [], ["open", "resolve", "close", "edit", "list"]
    rng.shuffle(kinds)
    for kind in kinds[:rng.randint(1, 2) if fact else rng.randint(2, 4)]:
        todo = [t for t in queue if t["status"] != "Resolved"]
        mine_open = [t for t in queue if t["created_by"] == me and t["status"] == "Open"]
        statuses = sorted({t["status"] for t in queue if t["created_by"] == me})
        if kind == "resolve" and todo:  # two: the ticket looked up, then resolved
            t, note = rng.choice(todo), _sentence(rng)
            q = f"Pull up ticket {t['id']} and mark it resolved with the note '{note}'"
            calls = [f"get_ticket(ticket_id={t['id']})", f"resolve_ticket(ticket_id={t['id']},resolution='{note}')"]
            t.update(status="Resolved", resolution=note)
        elif kind == "close" and mine_open:  # two: the user's open tickets (the id), then close
            t = rng.choice(mine_open)
            q, calls = f"Find my open ticket '{t['title']}' and close it.", [
                "get_user_tickets(status='Open')", f"close_ticket(ticket_id={t['id']})"]
            t["status"] = "Closed"
        elif kind == "edit":
            t = rng.choice(queue)
            updates = {"priority": rng.choice([p for p in range(1, 6) if p != t["priority"]])}
            updates.update({"status": rng.choice(_STATUSES[:2])} if rng.random() < 0.5 else {})
            q = f"Set the priority of ticket {t['id']} to {updates['priority']}" + (
                f" and its status to '{updates['status']}'." if "status" in updates else ".")
            calls = [f"edit_ticket(ticket_id={t['id']},updates={updates})"]
            t.update(updates)
        elif kind == "list" and statuses:
            status = rng.choice(statuses)
            q, calls = f"List my tickets whose status is '{status}'.", [f"get_user_tickets(status='{status}')"]
        else:
            new, text, p = title(), _sentence(rng), rng.randint(1, 5)
            q = f"Open a priority {p} ticket titled '{new}' with the description '{text}'"
            calls = [f"create_ticket(title='{new}',description='{text}',priority={p})"]
            queue.append({"id": max(t["id"] for t in queue) + 1, "title": new, "description": text, "status": "Open",
                          "priority": p, "created_by": me})
        turns.append([{"role": "user", "content": q}])
        answers.append(calls)
    if start["current_user"] is None:
        login = f"Log me in to the ticket system as '{me}', password '{password}'. "
        turns[0][0]["content"] = login + turns[0][0]["content"]
        answers[0].insert(0, f"ticket_login(username='{me}',password='{password}')")
    if fact:
        new, p = title(), rng.randint(1, 5)
        turns.append([{"role": "user", "content": f"{fact[1]} and open a priority {p} ticket titled '{new}' "
                                                  f"with the description '{fact[2]}'."}])
        answers.append(fact[0] + [f"create_ticket(title='{new}',description='{fact[3]}',priority={p})"])
    return {"id": f"synth_{i}", "question": turns, "initial_config": {"TicketAPI": start},
            "involved_classes": ["TicketAPI"], "ground_truth": answers}


SYNTH = {"GorillaFileSystem": synth_task, "VehicleControlAPI": synth_vehicle, "TradingBot": synth_trading,
         "TravelAPI": synth_travel, "MessageAPI": synth_message, "TwitterAPI": synth_twitter,
         "TicketAPI": synth_ticket}  # one class a conversation; --classes picks among these and PAIRS
MAIN = ("GorillaFileSystem", "VehicleControlAPI", "TradingBot", "TravelAPI")
SIDE = ("MessageAPI", "TwitterAPI", "TicketAPI")  # their synthesizers take a fact (synth_pair)
PAIRS = tuple(f"{m}+{s}" for m in MAIN for s in SIDE)
MIX = tuple(SYNTH) + PAIRS  # synth_rows' default: every class and every pair once, in turn


def _fact(task: dict, rng) -> tuple[list[str], str, str, str]:
    """A value that a MAIN class's tools look up and none of its synthesized turns changes, for a SIDE
    class to pass on: (the lookup calls, the request, the text with <...> for the value, the text)."""
    config = task["initial_config"]
    if "VehicleControlAPI" in config:
        tire = rng.choice(("front left", "front right", "rear left", "rear right"))
        psi = config["VehicleControlAPI"][tire.split()[0] + tire.split()[1].title() + "TirePressure"]
        return (["check_tire_pressure()"], f"Check the pressure of my {tire} tire",
                f"{tire.capitalize()} tire: <pressure> psi", f"{tire.capitalize()} tire: {psi} psi")
    if "TradingBot" in config:
        name = rng.choice([n for n, sym in _COMPANIES.items() if sym in config["TradingBot"]["stocks"]])
        price = config["TradingBot"]["stocks"][_COMPANIES[name]]["price"]  # as get_stock_info shows it: json.dumps
        return ([f"get_symbol_by_name(name='{name}')", f"get_stock_info(symbol='{_COMPANIES[name]}')"],
                f"Look up the share price of {name}", f"{name} trades at $<price>.", f"{name} trades at ${price}.")
    if "TravelAPI" in config:
        city = rng.choice(sorted(_AIRPORTS))
        return ([f"get_nearest_airport_by_city(location='{city}')"], f"Find the airport nearest to {city}",
                f"Nearest airport to {city}: <code>", f"Nearest airport to {city}: {_AIRPORTS[city]}")
    nums = [rng.randint(2, 999) for _ in range(3)]  # the file system's conversations have MathAPI too
    return ([f"sum_values(numbers={nums})"], f"Add up {nums[0]}, {nums[1]} and {nums[2]}", "Total: <sum>",
            f"Total: {sum(nums)}")


def synth_pair(rng, i: int, main: str, side: str) -> dict:
    """A conversation over two classes (module doc): MAIN's first 1-2 turns and SIDE's 1-2 merged in
    a random order that keeps each one's own, then SIDE's turn that passes a MAIN value on (_fact)."""
    a = SYNTH[main](rng, i)
    b = SYNTH[side](rng, i, fact=_fact(a, rng))
    k = rng.randint(1, 2)
    own = [iter(zip(a["question"][:k], a["ground_truth"][:k])), iter(zip(b["question"], b["ground_truth"]))]
    order = [0] * k + [1] * (len(b["question"]) - 1)
    rng.shuffle(order)
    turns = [next(own[j]) for j in order + [1]]  # each keeps its order (SIDE's first turn logs in); the fact last
    return {"id": f"synth_{i}", "question": [q for q, _ in turns], "ground_truth": [c for _, c in turns],
            "initial_config": {**a["initial_config"], **b["initial_config"]},
            "involved_classes": a["involved_classes"] + b["involved_classes"]}


def held_out_keys() -> tuple[set, set]:
    """(every user message, every initial_config as JSON) of BFCL's 800 multi-turn test tasks."""
    tasks = [t for c in CATEGORIES for t in load_bfcl(c)]
    return ({m["content"] for t in tasks for turn in t["question"] for m in turn},
            {json.dumps(t["initial_config"], sort_keys=True) for t in tasks})


def synth_rows(n: int, seed: int = 0, classes: tuple = MIX, turn_credit: float = 0.0, played: float = 0.0) -> list[dict]:
    """n training rows (data_source bfcl/synth) over BFCL's classes that are none of its tests, of
    classes in turn (a SYNTH key or a PAIRS one): a task is kept only if its answer runs without an
    error result and none of its user messages and not its initial_config equals a test task's
    (held_out_keys; tests/test_bfcl.py checks the rows again). turn_credit > 0: each row's
    reward_spec.turn_credit (a failed conversation's partial credit, mcp_tools/bfcl.py). played: the
    share of rows that start at a later user turn, the turns before it played with the answer's calls
    (extra_info.played_turns, 1 to all but the last, uniform; mcp_tools/bfcl.py, Played turns); drawn
    from a generator of its own, so the conversations are the same at any share."""
    import random
    if unknown := [c for c in classes if c not in MIX]:
        raise ValueError(f"unknown synth classes {unknown}; known: {', '.join(MIX)}")
    rng, questions, configs = random.Random(seed), *held_out_keys()
    starts = random.Random(f"played {seed}")
    tools = {c: [d["name"] for d in function_docs(c)] for c in CLASSES}
    rows, i = [], 0
    while len(rows) < n:
        name = classes[i % len(classes)]  # the classes in turn
        task, i = synth_pair(rng, i, *name.split("+")) if "+" in name else SYNTH[name](rng, i), i + 1
        methods = _methods(new_instances(task["involved_classes"], task["initial_config"]))
        results = [execute(methods, c) for turn in task["ground_truth"] for c in turn]
        if any(r.startswith("Error") or '"error"' in r for r in results):
            continue
        if json.dumps(task["initial_config"], sort_keys=True) in configs or \
                any(m["content"] in questions for turn in task["question"] for m in turn):
            continue
        rows.append(to_row(task, tools))
        if turn_credit:
            rows[-1]["reward_spec"]["turn_credit"] = turn_credit
        turns = len(task["ground_truth"])
        if starts.random() < played and turns > 1:
            rows[-1]["extra_info"]["played_turns"] = starts.randint(1, turns - 1)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="how many rows")
    ap.add_argument("--seed", type=int, default=0, help="the generator's seed")
    ap.add_argument("--out", required=True, help="a .jsonl or .parquet file")
    ap.add_argument("--classes", default=",".join(MIX), help="comma-separated, taken in turn: a class or a pair "
                    f"MAIN+SIDE (the module doc); default: each once, of {','.join(MIX)}")
    ap.add_argument("--turn-credit", type=float, default=0.0, help="each row's reward_spec.turn_credit, in [0, 0.5): "
                    "a failed conversation scores it x the share of user turns passed before the first failing one")
    ap.add_argument("--played", type=float, default=0.0, help="the share of rows, in [0, 1], that start at a later user "
                    "turn, the turns before it played with the answer's calls (extra_info.played_turns)")
    a = ap.parse_args()
    if err := check_turn_credit(a.turn_credit):
        ap.error(err)
    if not 0 <= a.played <= 1:
        ap.error(f"--played: want a share in [0, 1], got {a.played}")
    from support.rows import save_rows
    save_rows(synth_rows(a.n, a.seed, tuple(a.classes.split(",")), a.turn_credit, a.played), a.out)
    print(f"{a.n} rows -> {a.out}")
