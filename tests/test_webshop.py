"""WebShop env: the expert wins, determinism, WebShop's score formula, robustness to bad actions, the flags."""
import pytest

from envs import make_env
from envs.webshop import COLORS, Product, WebShopEnv, build_catalog, purchase_score, tokens


def play(env, actions):
    """Steps `actions` in order; returns the list of (obs, reward, done, info)."""
    return [env.step(a) for a in actions]


def run_expert(env, seed):
    obs, info = env.reset(seed)
    trace, done = [], False
    while not done:
        action = info["expert_action"]
        ok = action.startswith("search[") if info["page"] == "search" else action in info["admissible_actions"]
        assert ok, (seed, info["page"], action, info["admissible_actions"])
        obs, reward, done, info = env.step(action)
        trace.append((action, reward, info))
    return trace


def goto_item(env, product):
    """From the search page to `product`'s page: search its title, page on until it is listed, click it."""
    env.step(f"search[{product.title}]")
    asin = f"click[{product.asin.lower()}]"
    for _ in range(20):
        if asin in env._admissible():
            return env.step(asin)
        assert "click[next >]" in env._admissible(), "product not found by its own title"
        env.step("click[next >]")
    raise AssertionError("too many pages")


def test_make_env():
    env = make_env("webshop", max_steps=7, page_size=3)
    assert isinstance(env, WebShopEnv) and env.max_steps == 7 and env.page_size == 3
    with pytest.raises(ValueError, match="alfworld, webshop"):
        make_env("nope")


def test_catalog():
    products = build_catalog(500, 0)
    assert len(products) == 500 and len({p.asin for p in products}) == 500
    assert len({p.category for p in products}) >= 6 and len({p.ptype for p in products}) >= 20
    for p in products:
        assert len(p.asin) == 10 and p.asin.startswith("B0") and p.asin == p.asin.upper() and p.asin.isalnum()
        assert 3 <= len(p.title.split()) <= 8 and p.price > 0 and p.attrs
        values = [v for _, vs in p.options for v in vs]
        assert len(values) == len(set(values)), "an option value must name one option type"
    assert build_catalog(500, 0) == products and build_catalog(500, 1) != products
    assert len(WebShopEnv(num_products=40).products) == 40


def test_expert_wins_50_tasks():
    env = WebShopEnv()
    for seed in range(50):
        trace = run_expert(env, seed)
        assert len(trace) <= env.max_steps
        assert [r for _, r, _ in trace] == [0.0] * (len(trace) - 1) + [10.0], seed
        last = trace[-1][2]
        assert last["won"] and last["score"] == 1.0 and last["expert_action"] is None and env.done
        assert env.fits(env.products[env.item])
        assert all(not info["won"] and info["score"] is None for _, _, info in trace[:-1])


def test_browse_expert_opens_the_hits_in_rank_order():
    """The browse expert only uses what the pages show: it opens the search results first to last, goes back from
    every item that does not fit, and buys the first that does (with its options)."""
    env, won = WebShopEnv(expert="browse"), 0
    for seed in range(50):
        trace = run_expert(env, seed)
        opened = [a[len("click["):-1] for a, _, info in trace if info["page"] == "item" and info["score"] is None
                  and a[len("click["):-1] in env.by_asin]
        ranked = [env.products[i].asin.lower() for i in env.results]
        assert opened == ranked[:len(opened)], seed
        fits = [env.fits(env.products[env.by_asin[a]]) for a in opened]
        assert not any(fits[:-1]), seed
        if env.score is not None:  # it only buys what fits, so every purchase wins
            assert fits[-1] and env.won and trace[-1][1] == 10.0
        else:  # the step cap came first
            assert len(trace) == env.max_steps
        won += env.won
    assert 0 < won < 50  # some fits lie too deep in the ranking for 10 steps (the oracle wins all 50)
    with pytest.raises(ValueError, match="unknown WebShop expert"):
        WebShopEnv(expert="psychic")


def test_expert_recovers_from_detours():
    env = WebShopEnv(max_steps=40)
    for seed in range(10):
        env.reset(seed)
        wrong = next(p for p in env.products if p.ptype != env.goal["product_type"])
        goto_item(env, wrong)
        env.step(f"click[{wrong.options[0][1][0]}]")
        env.step("click[features]")
        env.step("click[back to search]")
        env.step("search[qqqq zzzz]")  # no results
        _, info = env._obs(), env._info(True)
        for _ in range(20):
            _, reward, done, info = env.step(info["expert_action"])
            if done:
                break
        assert reward == 10.0 and info["won"], seed


def test_determinism():
    def episode(seed):
        env = WebShopEnv()
        obs, info = env.reset(seed)
        steps = [(obs, info)]
        for a in ["click[x]", None, info["expert_action"], "click[next >]", "click[< prev]"]:
            steps.append(env.step(a))
        for _ in range(4):
            steps.append(env.step(steps[-1][-1]["expert_action"]))
        return steps

    for seed in (0, 7, 31):
        assert episode(seed) == episode(seed)
    a, b = WebShopEnv(), WebShopEnv()
    assert a.reset(5) == b.reset(5) and a.goal == b.goal
    a.reset(9)
    assert a.reset(5) == b.reset(5)  # reset clears everything from the previous episode
    tasks = {WebShopEnv().reset(s)[1]["task"] for s in range(50)}
    assert len(tasks) >= 45
    c = WebShopEnv(catalog_seed=1)
    c.reset(5)
    assert c.products != a.products and c.goal != a.goal  # another catalog, other tasks


def test_goal_and_instruction():
    env = WebShopEnv()
    for seed in range(30):
        obs, info = env.reset(seed)
        g = env.goal
        target = next(p for p in env.products if p.asin == g["asin"])
        assert env.fits(target), "the target always satisfies its own goal"
        assert 1 <= len(g["attributes"]) <= 3 and set(g["attributes"]) <= set(target.attrs)
        assert set(g["options"]) == {k for k, _ in target.options} and g["budget"] > target.price
        assert g["product_type"] in info["task"] and f"{g['budget']:.2f}" in info["task"]
        assert all(a in info["task"] for a in g["attributes"]) and all(v in info["task"] for v in g["options"].values())
        assert obs == f"WebShop [SEP] Instruction: [SEP] {info['task']} [SEP] Search"
        assert info["admissible_actions"] == ["search[<your query>]"] and info["page"] == "search"


def test_score_formula_by_hand():
    shirt = Product("B0TEST0001", "clothing", "t-shirt", "Acme Cotton T-Shirt", ("cotton", "machine wash", "slim fit"),
                    (("color", ("black", "white")), ("size", ("small", "large"))), 20.0, frozenset())
    goal = {"product_type": "t-shirt", "attributes": ["cotton", "quick dry"], "options": {"color": "black",
            "size": "large"}, "budget": 30.0}
    # 1 of 2 attributes, 1 of 2 options, price ok: (1 + 1 + 1) / (2 + 2 + 1)
    assert purchase_score(goal, shirt, {"color": "black", "size": "small"}) == pytest.approx(3 / 5)
    assert purchase_score(goal, shirt, {}) == pytest.approx(2 / 5)
    full = dict(goal, attributes=["cotton", "slim fit"])
    assert purchase_score(full, shirt, {"color": "black", "size": "large"}) == 1.0
    assert purchase_score(dict(full, budget=19.99), shirt, {"color": "black", "size": "large"}) == pytest.approx(4 / 5)
    assert purchase_score(dict(full, product_type="hoodie"), shirt, {"color": "black", "size": "large"}) == 0.0


def test_score_through_the_env():
    env = WebShopEnv()
    for seed in range(8):
        env.reset(seed)
        g = env.goal
        target = next(p for p in env.products if p.asin == g["asin"])
        goto_item(env, target)
        obs, reward, done, info = env.step("click[buy now]")  # no options selected: only attributes and price
        expected = (len(g["attributes"]) + 1) / (len(g["attributes"]) + len(g["options"]) + 1)
        assert done and reward == 0.0 and not info["won"] and info["score"] == pytest.approx(expected)
        assert info["page"] == "done" and f"{expected:.2f}" in obs and info["admissible_actions"] == []

        env.reset(seed)
        wrong = next(p for p in env.products if p.ptype != g["product_type"])
        goto_item(env, wrong)
        for _, values in wrong.options:
            env.step(f"click[{values[0]}]")
        _, reward, done, info = env.step("click[buy now]")
        assert done and reward == 0.0 and info["score"] == 0.0


def test_outcome_names_the_first_reason_a_purchase_missed():
    """Buy random products of the goal's type (asked options clicked where offered): outcome() must name a reason
    that holds, no earlier reason may hold, and every reason must turn up."""
    import random
    rng, seen = random.Random(0), set()
    env = WebShopEnv(max_steps=100)
    for seed in range(60):
        env.reset(seed)
        g = env.goal
        assert env.outcome() == "no purchase"
        same_type = [p for p in env.products if p.ptype == g["product_type"]]
        target = next(p for p in env.products if p.asin == g["asin"])
        product = rng.choice(same_type + [rng.choice(env.products)] + [target] * 4)
        goto_item(env, product)
        if rng.random() < 0.6:
            for v in g["options"].values():
                env.step(f"click[{v}]")  # a value the item lacks is a no-op
        env.step("click[buy now]")
        out, offered = env.outcome(), dict(product.options)
        reasons = [("wrong type", product.ptype != g["product_type"]),
                   ("missing attribute", not set(g["attributes"]) <= set(product.attrs)),
                   ("over budget", product.price > g["budget"]),
                   ("option not offered", not all(v in offered.get(k, ()) for k, v in g["options"].items())),
                   ("options not selected", env.selected != g["options"])]
        first = next((name for name, holds in reasons if holds), "won")
        assert out == first and (out == "won") == env.won, (seed, out, reasons)
        seen.add(out)
    assert seen == {"won", "wrong type", "missing attribute", "over budget", "option not offered",
                    "options not selected"}, seen


def test_pages_and_navigation():
    env = WebShopEnv(max_steps=50)
    env.reset(0)
    query = env.goal["product_type"]
    obs, _, _, info = env.step(f"search[{query}]")
    q = set(tokens(query))
    hits = [len(q & env.products[i].tokens) for i in env.results]
    assert hits == sorted(hits, reverse=True) and min(hits) > 0 and len(env.results) <= 50
    assert info["page"] == "results" and f"Page 1 (Total results: {len(env.results)})" in obs
    shown = env.results[:env.page_size]
    assert [a for a in info["admissible_actions"] if a.startswith("click[b0")] == \
        [f"click[{env.products[i].asin.lower()}]" for i in shown]
    assert "click[< prev]" not in info["admissible_actions"]
    if len(env.results) > env.page_size:
        obs2, _, _, info2 = env.step("click[next >]")
        assert "Page 2" in obs2 and "click[< prev]" in info2["admissible_actions"]
        assert env.step("click[< prev]")[0] == obs
    product = env.products[shown[0]]
    obs, _, _, info = env.step(f"CLICK[{product.asin}]")  # actions are case-insensitive
    assert info["page"] == "item" and product.title in obs and obs.endswith("Buy Now")
    for otype, values in product.options:
        assert f"[SEP] {otype} [SEP] {' [SEP] '.join(values)} [SEP]" in obs
        assert all(f"click[{v}]" in info["admissible_actions"] for v in values)
    for sub in ("description", "features", "reviews"):
        obs_sub, _, _, info_sub = env.step(f"click[{sub}]")
        assert info_sub["page"] == sub and info_sub["expert_action"] == "click[< prev]"
        assert env.step("click[< prev]")[3]["page"] == "item"
    assert env.step("click[< prev]")[3]["page"] == "results"
    assert env.step("click[back to search]")[3]["page"] == "search"
    obs, _, _, info = env.step("search[qqqq zzzz]")
    assert "(Total results: 0)" in obs and info["admissible_actions"] == ["click[back to search]"]
    assert info["expert_action"] == "click[back to search]"


BAD = [None, "", "   ", "click[nonexistent]", "search[]", "search[   ]", "buy now", "click[", "]]][[", "click[]",
       "\u2603\U0001F600 \u00f1\u4e2d", "click[\u00e9\u4e2d\x00]", "search[red shoes", "click[next >]", 12345]


def test_bad_actions_are_no_ops():
    env = WebShopEnv(max_steps=1000)

    def at(page):
        env.reset(3)
        if page != "search":
            env.step(f"search[{env.goal['product_type']}]")
        if page in ("item", "features"):
            env.step(f"click[{env.products[env.results[0]].asin.lower()}]")
        if page == "features":
            env.step("click[features]")
        return env._obs()

    for page in ("search", "results", "item", "features"):
        for action in BAD + (["click[buy now]"] if page == "search" else []):
            before = at(page)
            if page == "results" and action == "click[next >]":
                continue  # a real button on a results page with more pages
            obs, reward, done, info = env.step(action)
            assert (obs, reward, done, info["page"]) == (before, 0.0, False, page), (page, action)
            assert info["is_action_valid"] == (action is not None) and info["score"] is None


def test_actions_after_done():
    env = WebShopEnv()
    trace = run_expert(env, 4)
    final_obs = env._obs()
    for action in BAD + ["click[buy now]", "search[anything]"]:
        obs, reward, done, info = env.step(action)
        assert (obs, reward, done) == (final_obs, 0.0, True) and info["expert_action"] is None
        assert info["won"] and info["score"] == 1.0 and info["admissible_actions"] == []
    assert env.steps == len(trace)


def test_option_clicks_and_hallucination():
    env = WebShopEnv(max_steps=50)
    env.reset(2)
    env.step(f"search[{env.goal['product_type']}]")
    _, _, _, info = env.step("click[purple]")  # on the results page an option name is no option click
    assert not info["option_click"] and not info["hallucinated"]
    product = env.products[env.results[0]]
    env.step(f"click[{product.asin.lower()}]")
    otype, values = product.options[0]
    missing = next(c for c in COLORS + ("purple",) if c not in [v for _, vs in product.options for v in vs])
    _, _, _, info = env.step(f"click[{missing}]")
    assert info["option_click"] and info["hallucinated"] and env.selected == {} and info["page"] == "item"
    _, _, _, info = env.step(f"click[{values[0]}]")
    assert info["option_click"] and not info["hallucinated"] and env.selected == {otype: values[0]}
    env.step(f"click[{values[1]}]")
    assert env.selected == {otype: values[1]}  # the last click per option type wins
    _, _, _, info = env.step("click[next >]")  # a button is never an option click
    assert not info["option_click"] and not info["hallucinated"] and info["page"] == "item"
    _, _, _, info = env.step("click[description]")
    assert not info["option_click"] and not info["hallucinated"]
    _, _, _, info = env.step("click[< prev]")
    assert not info["option_click"] and env.selected == {otype: values[1]}  # kept while on this item's pages
    env.step("click[< prev]")
    env.step(f"click[{product.asin.lower()}]")
    assert env.selected == {}  # opening an item starts with nothing selected


def test_search_works_from_any_page():
    """WebShop's text env takes search[...] on every page, though only the search page lists it."""
    env = WebShopEnv(max_steps=50)
    env.reset(2)
    env.step(f"search[{env.goal['product_type']}]")
    env.step(f"click[{env.products[env.results[0]].asin.lower()}]")
    env.step("click[features]")
    assert env.page == "features" and "search[<your query>]" not in env._admissible()
    _, _, _, info = env.step("search[beige]")
    assert info["page"] == "results" and env.results == env.search("beige") and not info["option_click"]


def test_max_steps_ends_episode():
    env = WebShopEnv(max_steps=3)
    env.reset(0)
    outs = play(env, [None, "click[x]", "search[shoes]"])
    assert [d for _, _, d, _ in outs] == [False, False, True]
    assert all(r == 0.0 for _, r, _, _ in outs)
    assert outs[-1][3]["score"] is None and not outs[-1][3]["won"] and outs[-1][3]["expert_action"] is None
    env.max_steps = 20  # runners change the cap after construction
    env.reset(0)
    assert not any(d for _, _, d, _ in play(env, ["click[x]"] * 19))
    assert env.step("click[x]")[2]


def test_step_before_reset():
    with pytest.raises(RuntimeError, match="reset"):
        WebShopEnv().step("search[x]")


def visible_walk(env, seed, stray, rng):
    """(prompt, expert action) at every step of one episode of the visible expert, with a share of random steps."""
    import importlib
    F = importlib.import_module("01_formats")
    obs, info = env.reset(seed)
    hist, done, out = [], False, []
    while not done and info["expert_action"]:
        out.append((F.build_prompt("webshop", info["task"], obs, info["admissible_actions"], hist, 2),
                    info["expert_action"]))
        act = info["expert_action"]
        if rng.random() < stray and info["page"] != "search":
            act = rng.choice(info["admissible_actions"])
        hist.append((obs, act))
        obs, _, done, info = env.step(act)
    return out


def test_visible_expert_reads_its_step_off_the_prompt():
    """Imitable: the same prompt always gets the same step, also after random steps."""
    import random
    env, rng, seen, clash = WebShopEnv(expert="visible"), random.Random(0), {}, 0
    for seed in range(150):
        for prompt, action in visible_walk(env, seed, 0.2, rng):
            clash += seen.setdefault(prompt, action) != action
    assert clash == 0 and len(seen) > 800


def test_visible_expert_never_reads_hidden_attributes():
    """Strip every product's attributes (which its page does not show): the same clicks, fewer wins."""
    import random
    env = WebShopEnv(expert="visible")
    stripped = tuple(p._replace(attrs=()) for p in env.products)  # search still sees them (p.tokens): same results

    class Bare(WebShopEnv):
        def reset(self, seed=0):  # the goal is drawn from the full catalog, then the attributes are gone
            self.products = env.products
            out = super().reset(seed)
            self.products = stripped
            return out
    bare = Bare(expert="visible")
    wins = [0, 0]
    for seed in range(60):
        assert visible_walk(env, seed, 0, random.Random(0)) == visible_walk(bare, seed, 0, random.Random(0))
        wins[0], wins[1] = wins[0] + env.won, wins[1] + bare.won
    assert wins[0] >= 45 and wins[1] < wins[0]


def test_single_turn_is_one_product_choice():
    """--single_turn: the episode starts on the results page of the instruction's search and one action ends it;
    a product that fits wins 10, one that does not (or anything but a product) 0."""
    env = WebShopEnv(single_turn=True)
    for seed in range(10):
        obs, info = env.reset(seed)
        assert info["page"] == "results" and env.max_steps == 1
        shown = [env.products[i] for i in env._shown()]
        good = [p for p in shown if env.fits(p)]
        bad = [p for p in shown if not env.fits(p)]
        assert good and bad
        for product, reward in ((good[0], 10.0), (bad[0], 0.0)):
            env.reset(seed)
            _, r, done, info = env.step(f"click[{product.asin.lower()}]")
            assert (r, done, info["won"]) == (reward, True, reward > 0)
            assert env.step(f"click[{good[0].asin.lower()}]")[1] == 0.0  # over: nothing counts any more
        env.reset(seed)
        assert env.step("click[next >]")[1:3] == (0.0, True)
    assert make_env("webshop", single_turn=True).single_turn
