"""WebShop-style shopping (Yao et al. 2022), offline: a synthetic catalog, WebShop's pages and its purchase score.

The real WebShop serves 1.18M scraped Amazon products from a search engine; here a few hundred products are drawn
from random.Random(catalog_seed) (categories, product types, attributes, options, prices), so the env is pure
Python, deterministic and fast. Observations follow WebShop's text mode, fields joined by " [SEP] ":

  search     "WebShop [SEP] Instruction: [SEP] <instr> [SEP] Search"                 search[<your query>]
  results    "Instruction: [SEP] <instr> [SEP] Back to Search [SEP] Page 1 (Total results: N) [SEP] Next > [SEP]
              B0ABC12345 [SEP] <title> [SEP] $12.34 [SEP] ..."        click[back to search], click[next >],
                                                                      click[< prev], click[<asin>]
  item       "... Back to Search [SEP] < Prev [SEP] color [SEP] black [SEP] white [SEP] size [SEP] small ... [SEP]
              <title> [SEP] Price: $12.34 [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP]
              Buy Now"                       click[<option value>] (the last click per option type wins),
                                             click[description|features|reviews], click[< prev], click[buy now]
  description / features / reviews: a short text; click[< prev] goes back to the item.

Search scores a product by how many distinct query tokens occur in its title, attributes, category and type
(tokens: lower-cased alphanumeric runs); results are the products with score > 0, best first, ties in catalog
order, at most 50, 10 to a page (as WebShop); search[...] works from any page (the admissible list offers it only on
the search page, as WebShop's has_search_bar does). Anything well-formed but not possible on the page is a no-op (same page, reward 0).

click[buy now] ends the episode with WebShop's score of the bought product and the options selected on its page:
    r = type_match * (|U_att & Y_att| + |U_opt & Y_opt| + [price <= budget]) / (|U_att| + |U_opt| + 1)
U = the goal's attributes and (option type, value) pairs, Y = the product's attributes and the selected pairs;
type_match is 1 when the product's type is the goal's type, else 0 (WebShop uses a softer title overlap; an exact
type keeps it simple). reward = 10 when r == 1 (won), else 0, as in verl-agent.
"""
import functools
import random
import re
from collections import namedtuple

COLORS = ("black", "white", "navy", "gray", "red", "blue", "green", "pink", "beige")
# category -> (product types, attribute pool, {option type: values}, price range). Option values never repeat
# across the option types of one category, so click[<value>] names exactly one option.
CATEGORIES = {
    "clothing": (("t-shirt", "hoodie", "jeans", "dress", "rain jacket"),
                 ("machine wash", "long sleeve", "cotton", "slim fit", "quick dry", "button closure", "relaxed fit"),
                 {"color": COLORS, "size": ("small", "medium", "large", "x-large", "xx-large")}, (9, 60)),
    "shoes": (("running shoes", "sneakers", "hiking boots", "sandals", "slippers"),
              ("non slip", "rubber sole", "arch support", "lightweight", "memory foam", "waterproof"),
              {"color": COLORS, "size": ("7", "8", "9", "10", "11", "12")}, (15, 90)),
    "beauty": (("shampoo", "conditioner", "lipstick", "face cream", "body lotion"),
               ("long lasting", "paraben free", "cruelty free", "natural ingredients", "sensitive skin", "travel size"),
               {"scent": ("lavender", "coconut", "rose", "citrus", "unscented"),
                "size": ("2 fl oz", "8 fl oz", "16 fl oz")}, (5, 35)),
    "electronics": (("headphones", "phone case", "wall charger", "bluetooth speaker", "usb cable"),
                    ("fast charging", "wireless", "noise cancelling", "high definition", "easy install",
                     "long battery life"),
                    {"color": COLORS, "pack": ("1 pack", "2 pack", "3 pack")}, (8, 120)),
    "home & kitchen": (("throw pillow", "bath towel", "storage basket", "coffee mug", "bed sheets"),
                       ("easy clean", "dishwasher safe", "space saving", "eco friendly", "heavy duty",
                        "stain resistant"),
                       {"color": COLORS, "size": ("small", "medium", "large")}, (7, 70)),
    "grocery": (("coffee beans", "green tea", "protein bar", "olive oil", "dark chocolate"),
                ("sugar free", "gluten free", "non gmo", "keto friendly", "low calorie", "usda organic"),
                {"flavor": ("original", "vanilla", "mint", "caramel", "honey"),
                 "count": ("6 count", "12 count", "24 count")}, (4, 40)),
}
BRANDS = ("Acorn", "Brisa", "Calder", "Dunmore", "Elkin", "Fenwick", "Galen", "Harlow", "Istra", "Juno", "Kestrel",
          "Larkin", "Marlow", "Norvia", "Orla", "Pike", "Quill", "Rowan", "Sable", "Tamsin", "Umber", "Vale")
NAV = ("back to search", "< prev", "next >", "description", "features", "reviews", "buy now")  # not option clicks
SEP = " [SEP] "
MAX_RESULTS = 50
Product = namedtuple("Product", "asin category ptype title attrs options price tokens")  # options: ((type, values),)


def tokens(text):
    return re.findall(r"[a-z0-9]+", text.lower())


@functools.lru_cache(maxsize=8)
def build_catalog(num_products=500, catalog_seed=0):
    """The catalog as a tuple of Products; cached, so every env on the same seed shares one copy."""
    rng, products, seen = random.Random(catalog_seed), [], set()
    cats = sorted(CATEGORIES)
    for i in range(num_products):
        cat = cats[i % len(cats)]  # round robin keeps the categories balanced
        types, attr_pool, opt_pools, (lo, hi) = CATEGORIES[cat]
        ptype = rng.choice(types)
        attrs = tuple(rng.sample(attr_pool, rng.randint(2, 4)))
        options = []
        for otype, pool in opt_pools.items():
            picked = set(rng.sample(pool, rng.randint(2, min(4, len(pool)))))
            options.append((otype, tuple(v for v in pool if v in picked)))  # pool order reads naturally (S, M, L)
        asin = "B0" + "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") for _ in range(8))
        while asin in seen:
            asin = asin[:-1] + rng.choice("0123456789")
        seen.add(asin)
        # Title: brand + one or two of the attributes + type (4-7 words); the others show only under Features.
        title = " ".join([rng.choice(BRANDS)] + [a.title() for a in attrs[:rng.randint(1, 2)]] + [ptype.title()])
        price = round(rng.uniform(lo, hi), 2)
        toks = frozenset(tokens(" ".join((title, cat, ptype) + attrs)))
        products.append(Product(asin, cat, ptype, title, attrs, tuple(options), price, toks))
    return tuple(products)


def make_goal(products, seed):
    """Task of `seed`: a target product, 1-3 of its attributes, one value per option type, a budget above its price."""
    rng = random.Random(seed)
    target = rng.choice(products)
    attrs = rng.sample(target.attrs, rng.randint(1, min(3, len(target.attrs))))
    options = {otype: rng.choice(values) for otype, values in target.options}
    budget = float((int(target.price * rng.uniform(1.1, 1.6)) // 10 + 1) * 10)  # round tens, always > price
    article = "an" if target.ptype[0] in "aeiou" else "a"
    instruction = (f"i need {article} {target.ptype} that is {' and '.join(attrs)}, with "
                   f"{' and '.join(f'{k}: {v}' for k, v in options.items())}, and price lower than {budget:.2f} dollars")
    return {"asin": target.asin, "product_type": target.ptype, "attributes": attrs, "options": options,
            "budget": budget, "instruction": instruction}


def purchase_score(goal, product, selected):
    """WebShop's reward r in [0, 1] for buying `product` with `selected` ({option type: value}); see the docstring."""
    if product.ptype != goal["product_type"]:
        return 0.0
    hits = len(set(goal["attributes"]) & set(product.attrs))
    hits += sum(selected.get(k) == v for k, v in goal["options"].items())
    hits += product.price <= goal["budget"]
    return hits / (len(goal["attributes"]) + len(goal["options"]) + 1)


class WebShopEnv:
    """WebShop task: reset(seed) -> (obs, info); step(action) -> (obs, reward, done, info). See the module doc."""

    def __init__(self, num_products=500, catalog_seed=0, max_steps=10, page_size=10, expert="oracle",
                 single_turn=False):
        """single_turn: the one-decision version of the task, for the contrast with single-turn RL. The episode
        starts on the results page of the instruction's search; one click on a product ends it, with reward 10 when
        the product fits the goal (any other action: 0). A fitting product is on that page for every one of the
        first 300 seeds (about 2 of the 10 fit)."""
        if expert not in ("oracle", "browse", "visible"):
            raise ValueError(f"unknown WebShop expert {expert!r}; choose oracle, browse or visible")
        self.products = build_catalog(num_products, catalog_seed)
        self.by_asin = {p.asin.lower(): i for i, p in enumerate(self.products)}
        self.max_steps, self.page_size, self.expert = (1 if single_turn else max_steps), page_size, expert
        self.single_turn = single_turn
        self.goal, self.done = None, True

    # ------------------------------------------------------------------ episode
    def reset(self, seed=0):
        self.goal = make_goal(self.products, seed)
        self.steps, self.done, self.won, self.score = 0, False, False, None
        self.page, self.results, self.page_no, self.item, self.selected = "search", [], 0, None, {}
        self.opened = set()  # products whose item page this episode has shown (the browse expert skips them)
        self.came_from = None  # the item just left with < prev (the visible expert tries the results after it)
        if self.single_turn:
            self._act(f"search[{self.goal['instruction']}]")
        return self._obs(), self._info(True)

    def step(self, action):
        if self.goal is None:
            raise RuntimeError("call reset(seed) before step()")
        if self.done:  # after the end nothing changes, and nothing is counted
            return self._obs(), 0.0, True, self._info(action is not None)
        self.steps += 1
        if self.single_turn:  # one click: opening a product that fits wins
            if action is not None:
                self._act(" ".join(str(action).lower().split()))
            self.won = self.page == "item" and self.fits(self.products[self.item])
            self.done, self.page, self.score = True, "done", float(self.won)
            return self._obs(), 10.0 if self.won else 0.0, True, self._info(action is not None)
        option_click = hallucinated = False
        if action is not None:  # None: a malformed response, a no-op
            option_click, hallucinated = self._act(" ".join(str(action).lower().split()))
        reward = 10.0 if self.won else 0.0
        self.done = self.done or self.steps >= self.max_steps
        return self._obs(), reward, self.done, self._info(action is not None, option_click, hallucinated)

    def _act(self, action):
        """Apply one command; returns (option_click, hallucinated). Anything impossible leaves the state as is."""
        m = re.fullmatch(r"(search|click)\[(.*)\]", action, re.S)
        if not m:
            return False, False
        verb, arg = m.group(1), m.group(2).strip()
        page = self.page
        self.came_from = self.item if (page == "item" and arg == "< prev") else None
        if verb == "search":  # accepted on any page, as in WebShop's text env
            if arg:
                self.results, self.page_no, self.page = self.search(arg), 0, "results"
        elif page == "search":
            pass  # the search page has only the search box
        elif arg == "back to search":
            self.page = "search"
        elif page == "results":
            if arg == "next >" and self._has_next():
                self.page_no += 1
            elif arg == "< prev" and self.page_no > 0:
                self.page_no -= 1
            elif arg in (self.products[i].asin.lower() for i in self._shown()):
                self.item, self.selected, self.page = self.by_asin[arg], {}, "item"  # a new item: no options yet
                self.opened.add(self.item)
        elif page == "item":
            product = self.products[self.item]
            if arg == "< prev":
                self.page = "results"
            elif arg in ("description", "features", "reviews"):
                self.page = arg
            elif arg == "buy now":
                self.score = purchase_score(self.goal, product, self.selected)
                self.won, self.done, self.page = self.score == 1.0, True, "done"
            elif arg not in NAV:  # an option click; naming a value this item lacks is a hallucination
                otype = next((k for k, values in product.options if arg in values), None)
                if otype:
                    self.selected[otype] = arg
                return True, otype is None
        elif arg == "< prev":  # description / features / reviews
            self.page = "item"
        return False, False

    def search(self, query):
        """Indices of the matching products: score = distinct query tokens in the product text, best first."""
        q = set(tokens(query))
        scored = [(-len(q & p.tokens), i) for i, p in enumerate(self.products) if q & p.tokens]
        return [i for _, i in sorted(scored)[:MAX_RESULTS]]

    # ------------------------------------------------------------------ views
    def _shown(self):
        return self.results[self.page_no * self.page_size:(self.page_no + 1) * self.page_size]

    def _obs(self):
        head = f"Instruction: [SEP] {self.goal['instruction']} [SEP] Back to Search"
        if self.page == "search":
            return f"WebShop [SEP] Instruction: [SEP] {self.goal['instruction']} [SEP] Search"
        if self.page == "done":
            return f"Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] {self.score:.2f}"
        if self.page == "results":
            parts = [head, f"Page {self.page_no + 1} (Total results: {len(self.results)})"]
            parts += ["< Prev"] * (self.page_no > 0) + ["Next >"] * self._has_next()
            for i in self._shown():
                p = self.products[i]
                # lower-case, as in the click[...] list, so a small model can copy the id it reads
                parts += [p.asin.lower(), p.title, f"${p.price:.2f}"]
            return SEP.join(parts)
        p = self.products[self.item]
        if self.page == "item":
            opts = [x for otype, values in p.options for x in (otype,) + values]
            return SEP.join([head, "< Prev"] + opts + [p.title, f"Price: ${p.price:.2f}", "Rating: N.A.",
                                                        "Description", "Features", "Reviews", "Buy Now"])
        text = {"description": f"The {p.title} from our {p.category} range, a {p.ptype} that is {p.attrs[0]}.",
                "features": SEP.join(p.attrs), "reviews": "No reviews yet."}[self.page]
        return SEP.join([head, "< Prev", text])

    def _has_next(self):
        return (self.page_no + 1) * self.page_size < len(self.results)

    def _admissible(self):
        if self.done:
            return []
        if self.page == "search":
            return ["search[<your query>]"]  # verl-agent's placeholder: any non-empty query works
        acts = ["back to search"]
        if self.page == "results":
            acts += ["< prev"] * (self.page_no > 0) + ["next >"] * self._has_next()
            acts += [self.products[i].asin.lower() for i in self._shown()]
        elif self.page == "item":
            acts += ["< prev"] + [v for _, values in self.products[self.item].options for v in values]
            acts += ["description", "features", "reviews", "buy now"]
        else:
            acts += ["< prev"]
        return [f"click[{a}]" for a in acts]

    def _info(self, valid, option_click=False, hallucinated=False):
        return {"task": self.goal["instruction"], "admissible_actions": self._admissible(), "won": self.won,
                "is_action_valid": valid, "expert_action": self._expert(), "page": self.page, "score": self.score,
                "option_click": option_click, "hallucinated": hallucinated}

    def outcome(self):
        """Why the episode ended, for failure tables: 'won', 'no purchase' (steps ran out or not yet over), or the
        first reason (in score order) the bought product missed: 'wrong type', 'missing attribute', 'over budget',
        'option not offered' (the item lacks an asked option value), 'options not selected'."""
        if self.won:
            return "won"
        if self.score is None:
            return "no purchase"
        return self.miss(self.products[self.item]) or "options not selected"

    # ------------------------------------------------------------------ expert
    def miss(self, product):
        """The first reason, in score order, buying `product` cannot score 1, or None when it fits."""
        g = self.goal
        if product.ptype != g["product_type"]:
            return "wrong type"
        if not set(g["attributes"]) <= set(product.attrs):
            return "missing attribute"
        if product.price > g["budget"]:
            return "over budget"
        if not self.offers_options(product):
            return "option not offered"
        return None

    def fits(self, product):
        """Does buying `product` (with the right options) score 1?"""
        return self.miss(product) is None

    def _expert(self):
        """The next command of the expert, re-planned from wherever the agent is (None once the episode is over).

        oracle: wins from any state: on a results page it clicks the first product that fits, which it knows from
            what the page hides (the options an item offers, its full attribute list).
        browse: opens the hits in rank order, skipping those this episode already opened, and goes back when the
            item does not fit, which it judges with the product's full attribute list (not shown on its page).
            It wins 82% of held-out tasks within the 10-step cap (seeds 100000-100499), the oracle 100%.
        visible: only what the pages show (see _visible_results)."""
        if self.done:
            return None
        if self.page == "search":  # the instruction itself, as WebShop's rule baseline searches: a plain copy
            return f"search[{self.goal['instruction']}]"
        if self.page == "results" and self.expert == "visible":
            return self._visible_results()
        if self.page == "results" and self.expert == "browse":
            todo = [n for n, i in enumerate(self.results) if i not in self.opened]
            if not todo:
                return "click[back to search]"
            page = todo[0] // self.page_size
            if page == self.page_no:
                return f"click[{self.products[self.results[todo[0]]].asin.lower()}]"
            return "click[next >]" if page > self.page_no else "click[< prev]"
        if self.page == "results":
            fit = [n for n, i in enumerate(self.results) if self.fits(self.products[i])]
            here = [n for n in fit if n // self.page_size == self.page_no]
            if here:
                return f"click[{self.products[self.results[here[0]]].asin.lower()}]"
            if any(n // self.page_size > self.page_no for n in fit):
                return "click[next >]"
            return "click[< prev]" if fit else "click[back to search]"
        if self.page != "item":
            return "click[< prev]"
        product = self.products[self.item]
        # on the item page the visible expert can judge only the options the page offers
        if not (self.offers_options(product) if self.expert == "visible" else self.fits(product)):
            return "click[< prev]"
        missing = [v for k, v in self.goal["options"].items() if self.selected.get(k) != v]
        return f"click[{missing[0]}]" if missing else "click[buy now]"

    def offers_options(self, product):
        """Does the product offer every option value the goal asks for (what its item page lists)?"""
        offered = dict(product.options)
        return all(v in offered.get(k, ()) for k, v in self.goal["options"].items())

    def looks_right(self, product):
        """What the results page tells about a product: its type (the end of its title) and price fit the goal."""
        return product.title.lower().endswith(self.goal["product_type"]) and product.price <= self.goal["budget"]

    def _visible_results(self):
        """visible, on a results page: it decides only on what the prompt shows, so a model can imitate it step by
        step. It opens the first product whose title names the asked type at a price within budget, after the one it
        just came back from; on the item page (_expert) it goes back unless the asked options are offered, clicks
        them, and buys. It never reads a product's hidden attributes, so it buys some that lack one (score < 1)."""
        shown = [self.products[i] for i in self._shown()]
        start = next((n + 1 for n, i in enumerate(self._shown()) if i == self.came_from), 0)
        fit = [p for p in shown[start:] if self.looks_right(p)]
        if fit:
            return f"click[{fit[0].asin.lower()}]"
        return "click[next >]" if self._has_next() else "click[back to search]"
