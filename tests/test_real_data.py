"""The real-benchmark loaders on fixture folders in the real formats (tests/real_data.py writes them)."""
import json
import os
import random

import pytest
from textworld.envs.pddl import PddlEnv

import real_data
from envs import DataError, configure, make_env


@pytest.fixture(scope="module")
def alf_dir(tmp_path_factory):
    return real_data.write_alfworld(str(tmp_path_factory.mktemp("alfworld")))


def test_alfworld_selects_games_as_alfworld_does(alf_dir):
    env = make_env("alfworld", data=alf_dir, split="train")
    folders = [os.path.basename(os.path.dirname(os.path.dirname(g))) for g, _ in env.games]
    # "Sliced" folders and unsolvable games are skipped; the list is sorted by path
    assert folders == ["look_at_obj_in_light-Book-None-FloorLamp-212", "pick_clean_then_place_in_recep-Apple-None-Fridge-1"]
    assert [t for _, t in env.games] == ["look_at_obj_in_light", "pick_clean_then_place_in_recep"]
    only = make_env("alfworld", data=alf_dir, split="train", task_types=("look_at_obj_in_light",))
    assert [t for _, t in only.games] == ["look_at_obj_in_light"]
    assert len(make_env("alfworld", data=os.path.join(alf_dir, "json_2.1.1"), split="valid_seen").games) == 1
    assert make_env("alfworld", data=alf_dir).reset(7)[1]["game"] == env.games[7 % 2][0]  # seed -> game seed % N


def test_alfworld_names_and_observations_follow_alfworld(alf_dir):
    env = make_env("alfworld", data=alf_dir, split="train")
    obs, info = env.reset(1)  # the kitchen: a sink basin, two cabinets, one of them at the countertop's location
    assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.")
    assert "you see a cabinet 2, a cabinet 1, a countertop 1, a fridge 1, a microwave 1, and a sinkbasin 1." in obs
    assert info["task"] == "Your task is to: put a clean apple in fridge."
    assert info["task_type"] == "pick_clean_then_place_in_recep"
    assert info["admissible_actions"] == ["go to cabinet 1", "go to cabinet 2", "go to countertop 1", "go to fridge 1",
                                          "go to microwave 1", "go to sinkbasin 1", "inventory", "look"]
    # Demangler: sorted ids, numbers handed out from the end: Cabinet|-01.55 -> 2, Cabinet|+00.68 -> 1
    names = {k: i.name for k, i in env._game._entity_infos.items()}
    assert names[real_data.mangle("Cabinet|-01.55|+00.50|+00.38").lower()] == "cabinet 2"
    assert names[real_data.mangle(real_data.SINK).lower()] == "sinkbasin 1"
    assert names[real_data.mangle("GarbageBag|-00.20|+00.00|+00.10").lower()] == "garbagebag 1"  # by location only
    env.step("go to countertop 1")
    obs, _, _, info = env.step("look")  # both receptacles of that location
    assert obs.startswith("You are facing the cabinet 1, and countertop 1.")
    assert "take apple 1 from countertop 1" in info["admissible_actions"] and "open cabinet 1" in info["admissible_actions"]


@pytest.mark.parametrize("split,seed", [("train", 0), ("train", 1), ("valid_seen", 0)])
def test_alfworld_walkthrough_wins(alf_dir, split, seed):
    env = make_env("alfworld", data=alf_dir, split=split)
    _, info = env.reset(seed)
    plan = info["expert_plan"]
    assert plan and all("_bar_" not in c for c in plan)  # raw ids (valid_seen fixture) come back demangled
    for k, command in enumerate(plan):
        assert info["expert_action"] == command and command in info["admissible_actions"]
        _, reward, done, info = env.step(command)
        assert done == (k == len(plan) - 1)
    assert info["won"] and reward == 10.0 and info["expert_action"] is None


def test_alfworld_expert_replans_after_detours(alf_dir):
    env = make_env("alfworld", data=alf_dir, split="train", max_steps=60)
    rng = random.Random(0)
    for trial in range(6):
        _, info = env.reset(trial)
        for _ in range(rng.randint(1, 6)):  # wander off the walkthrough
            _, _, _, info = env.step(rng.choice(info["admissible_actions"]))
        steps = 0
        while not info["won"]:
            assert info["expert_action"] in info["admissible_actions"]
            _, _, done, info = env.step(info["expert_action"])
            steps += 1
            assert steps < 20 and (not done or info["won"])


def test_alfworld_fast_commands_equal_textworld_derivation(alf_dir):
    rng = random.Random(1)
    for split in ("train", "valid_seen"):
        env = make_env("alfworld", data=alf_dir, split=split)
        for seed in range(len(env.games)):
            _, info = env.reset(seed)
            for _ in range(12):
                _, _, done, info = env.step(rng.choice(info["admissible_actions"]))
                ours = env._game.state["admissible_commands"]
                PddlEnv._gather_infos(env._game)  # TextWorld's grammar derivation
                assert ours == env._game.state["admissible_commands"]
                if done:
                    break


def test_alfworld_bad_data_is_one_line_naming_the_file(alf_dir, tmp_path):
    with pytest.raises(DataError, match="no folder .*json_2.1.1/train"):
        make_env("alfworld", data=str(tmp_path), split="train")
    with pytest.raises(DataError, match="unknown ALFWorld split"):
        make_env("alfworld", data=alf_dir, split="test")
    broken = tmp_path / "json_2.1.1" / "train" / "pick_and_place_simple-X-None-Y-1" / "trial_1"
    broken.mkdir(parents=True)
    (broken / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
    (broken / "game.tw-pddl").write_text('{"pddl_domain": "x"')
    with pytest.raises(DataError, match=r"cannot read .*trial_1/game.tw-pddl") as e:
        make_env("alfworld", data=str(tmp_path), split="train")
    assert "\n" not in str(e.value)
    (broken / "game.tw-pddl").write_text(json.dumps({"pddl_domain": "x", "solvable": True}))
    with pytest.raises(DataError, match="game.tw-pddl lacks grammar, pddl_problem"):
        make_env("alfworld", data=str(tmp_path / "json_2.1.1"), split="train")


def test_configure_sets_the_default_env(alf_dir):
    try:
        configure("alfworld", data=alf_dir, split="valid_seen")
        assert len(make_env("alfworld").games) == 1
        assert make_env("alfworld", split="train").split == "train"
    finally:
        configure("alfworld")
    assert not hasattr(make_env("alfworld"), "games")  # back to the synthetic env


# ---------------------------------------------------------------------------------------------------- WebShop
@pytest.fixture(scope="module")
def shop_dir(tmp_path_factory):
    return real_data.write_webshop(str(tmp_path_factory.mktemp("webshop")))


def _goal(goals, asin, **options):
    return next(g for g in goals if g["asin"] == asin and g["goal_options"] == options)


def test_webshop_products_as_load_products_reads_them(shop_dir):
    import envs.webshop_data as W
    products, prices, _, _ = W.load_shop(shop_dir)
    by = {p["asin"]: p for p in products}
    assert list(by) == ["B01LIPSTK1", "B02BRUSH02", "B03MATTE03", "B04BOTTLE4", "B05NOINS05"]  # 'nan', repeat: out
    assert by["B01LIPSTK1"]["Title"] == "Acme Long Lasting Lipstick for Women"  # the first of the repeated asin
    assert by["B01LIPSTK1"]["Price"] == "$12.99 to $15.99" and 12.99 <= prices["B01LIPSTK1"] <= 15.99
    assert by["B02BRUSH02"]["Price"] == "$100.0" and prices["B02BRUSH02"] == 100.0  # no pricing
    assert by["B04BOTTLE4"]["Price"] == "$1299.99"  # "$1,299.99": the comma dropped
    assert by["B01LIPSTK1"]["options"] == {"color": ["black", "navy blue"], "size": ["small | medium", "large"]}
    assert by["B03MATTE03"]["options"] == {"flavor": ["cherry", "mint"]}  # "Scent": null is skipped
    assert by["B02BRUSH02"]["options"] == {} and by["B05NOINS05"]["Attributes"] == ["cotton"]


def test_webshop_goals_texts_bounds_and_shuffle(shop_dir):
    import envs.webshop_data as W
    _, _, _, goals = W.load_shop(shop_dir)
    assert len(goals) == 4 + 1 + 2 + 3  # every option combination; B05 has no instruction
    lip = [g for g in goals if g["asin"] == "B01LIPSTK1"]
    bound = lip[0]["price_upper"]
    assert bound in (30.0, 40.0, 50.0) and all(g["price_upper"] == bound for g in lip)  # 2nd of {20,30,40,50}
    assert _goal(goals, "B01LIPSTK1", color="navy blue", size="small | medium")["instruction_text"] == (
        f"i want a long lasting lipstick with color: navy blue, and size: small | medium, and price lower than "
        f"{bound:.2f} dollars")
    brush = _goal(goals, "B02BRUSH02")
    assert brush["instruction_text"] == f"find me a soft makeup brush set, and price lower than {brush['price_upper']:.2f} dollars"
    assert brush["price_upper"] in (120.0, 130.0, 140.0)
    assert _goal(goals, "B04BOTTLE4", color="teal")["instruction_text"] == "i am looking for an insulated bottle with color: teal"
    assert _goal(goals, "B04BOTTLE4", color="teal")["price_upper"] == 1000000  # above 990: no price clause
    # the fixed shuffle: random.seed(233) over the goals in product order
    texts = lambda gs: [(g["asin"], tuple(g["goal_options"].items())) for g in gs]
    in_order = [("B01LIPSTK1", (("color", c), ("size", s))) for c in ("black", "navy blue")
                for s in ("small | medium", "large")] + [("B02BRUSH02", ())] + [
        ("B03MATTE03", (("flavor", f),)) for f in ("cherry", "mint")] + [
        ("B04BOTTLE4", (("color", c),)) for c in ("silver", "rose gold", "teal")]
    order = list(range(10))
    random.Random(233).shuffle(order)
    assert texts(goals) == [in_order[i] for i in order]
    train, test = make_env("webshop", data=shop_dir, split="train"), make_env("webshop", data=shop_dir, split="test")
    assert test.goals == goals[:5] and train.goals == goals[5:]  # a small file: half held out


def test_webshop_human_goals(shop_dir):
    env = make_env("webshop", data=shop_dir, split="test", goals="human")
    import envs.webshop_data as W
    goals = W.load_shop(shop_dir, "human")[3]
    assert sorted(g["instruction_text"].split(", and price")[0] for g in goals) == [
        "I want a midnight blue lipstick that lasts long", "an insulated teal bottle"]  # no attributes: skipped
    assert len(env.goals) == 1


def test_webshop_bm25_ranking(shop_dir):
    import envs.webshop_data as W
    products, _, search, _ = W.load_shop(shop_dir)
    asin = lambda q: [products[i]["asin"] for i in search(q)]
    assert asin("lipsticks") == ["B03MATTE03", "B01LIPSTK1"]  # stemmed; same counts, the shorter document first
    assert asin("long lasting lipstick")[0] == "B01LIPSTK1"
    assert asin("navy") == ["B01LIPSTK1"]  # option text is indexed
    assert asin("the") == [] and asin("zzz") == []  # a stop word, an unknown word


def test_webshop_rewards_by_hand(shop_dir):
    import envs.webshop_data as W
    products, prices, _, goals = W.load_shop(shop_dir)
    by = {p["asin"]: p for p in products}
    goal = _goal(goals, "B01LIPSTK1", color="navy blue", size="small | medium")
    p, price = by["B01LIPSTK1"], prices["B01LIPSTK1"]
    # 2 attributes ("long lasting" ~ "long-lasting" by token set ratio 100; "cruelty free") + 2 options + price
    assert W.reward(p, goal, price, {"color": "navy blue", "size": "small | medium"}) == 1.0
    assert W.reward(p, goal, price, {"color": "black", "size": "small | medium"}) == 4 / 5
    assert W.reward(p, goal, price, {}) == 3 / 5
    assert W.reward(p, goal, 60.0, {"color": "navy blue", "size": "small | medium"}) == 4 / 5  # over the bound
    # colour normalisation: "navy blue" and "midnight blue" both become "blue" (human goals compare plain values)
    human = W.load_shop(shop_dir, "human")[3]
    hgoal = next(g for g in human if g["asin"] == "B01LIPSTK1")
    assert W.option_hits({"color": "navy blue"}, hgoal) == 1 and W.option_hits({"color": "black"}, hgoal) == 0
    assert W._fuzzy("navy blue", "midnight blue") <= 85  # without normalisation they would not match
    if not env_has_spacy():  # the approximation: title words minus numbers and function words
        # goal title words: acme long lasting lipstick women (5)
        assert W.type_reward(by["B03MATTE03"], goal) == 1.0  # 2/5 shared; also 3 shared category levels
        assert W.type_reward(by["B04BOTTLE4"], goal) == 0.5  # 1/5 = 0.2 is not > 0.2; other query and category
        assert W.type_reward(by["B02BRUSH02"], goal) == 0.0  # no shared word
        eleven = dict(goal, name="Acme one two three four five six seven eight nine ten", query="x", product_category="y")
        assert W.type_reward(dict(by["B04BOTTLE4"], query="z"), eleven) == 0.1  # 1/11 < 0.1
        assert W.reward(by["B04BOTTLE4"], dict(goal, attributes=["insulated"], goal_options={}, price_upper=2000.0),
                        prices["B04BOTTLE4"], {}) == 0.5  # (1 + 0 + 1) / 2, times the type factor 0.5


def env_has_spacy():
    import envs.webshop_data as W
    return W._spacy() is not None


def test_webshop_pages_and_clicks(shop_dir):
    env = make_env("webshop", data=shop_dir, split="train")
    goals = env.goals
    seed = next(i for i, g in enumerate(goals) if g["asin"] == "B01LIPSTK1")
    obs, info = env.reset(seed)
    assert obs == f"WebShop [SEP] Instruction: [SEP] {goals[seed]['instruction_text']} [SEP] Search"
    assert info["admissible_actions"] == ["search[<your query>]", "click[search]"]
    assert env.step("click[search]")[0] == obs  # listed by verl-agent, but a no-op
    obs, _, _, info = env.step("search[long lasting lipstick]")
    assert "Page 1 (Total results: 2) [SEP] Next > [SEP] B01LIPSTK1 [SEP] Acme Long Lasting Lipstick for Women [SEP] $12.99 to $15.99" in obs
    assert info["admissible_actions"] == ["click[back to search]", "click[next >]", "click[b01lipstk1]",
                                          "click[b03matte03]"]
    obs, _, _, info = env.step("click[b01lipstk1]")
    assert "< Prev [SEP] color [SEP] black [SEP] navy blue [SEP] size [SEP] small | medium [SEP] large [SEP] Acme" in obs
    assert "Price: $12.99 to $15.99 [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now" in obs
    assert info["admissible_actions"][-2:] == ["click[small | medium]", "click[large]"]
    _, _, _, info = env.step("click[purple]")
    assert info["hallucinated"] and env.selected == {}
    env.step("click[navy blue]")
    assert env.selected == {"color": "navy blue"}
    env.step("click[features]")
    assert env._obs().endswith("< Prev [SEP] Long-lasting colour [SEP] Cruelty free")
    env.step("search[brush]")  # search works from any page, and a new search clears the options
    assert env.page == "results" and env.selected == {}


def test_webshop_expert_wins_every_synthetic_goal(shop_dir):
    for split in ("train", "test"):
        env = make_env("webshop", data=shop_dir, split=split)
        for seed in range(len(env.goals)):
            _, info = env.reset(seed)
            done = False
            while not done:
                _, reward, done, info = env.step(info["expert_action"])
            assert info["won"] and reward == 10.0 and env.outcome() == "won"


def test_webshop_bad_data_is_one_line_naming_the_file(shop_dir, tmp_path):
    with pytest.raises(DataError, match="no folder"):
        make_env("webshop", data=str(tmp_path / "nowhere"))
    (tmp_path / "items_shuffle_1000.json").write_text("[]")
    with pytest.raises(DataError, match="no items_ins_v2_1000.json or items_ins_v2.json in"):
        make_env("webshop", data=str(tmp_path))
    (tmp_path / "items_ins_v2_1000.json").write_text("{}")
    (tmp_path / "items_shuffle_1000.json").write_text("[{")
    with pytest.raises(DataError, match="cannot read .*items_shuffle_1000.json"):
        make_env("webshop", data=str(tmp_path))
    with pytest.raises(DataError, match="unknown WebShop split"):
        make_env("webshop", data=shop_dir, split="valid_seen")


def test_synthetic_env_after_a_script_configured_the_defaults():
    """03's --split/--goals defaults must not reach the synthetic envs, which take neither."""
    import importlib
    F = importlib.import_module("01_formats")
    try:
        configure("webshop", split="train", goals="synthetic")
        assert type(make_env("webshop")).__name__ == "WebShopEnv"
        F.use_data("webshop", "", "test", "human")
        assert type(make_env("webshop")).__name__ == "WebShopEnv"
    finally:
        configure("webshop")


def test_base_mid_trains_on_real_demos_and_leaves_the_callers_env_alone(alf_dir, shop_dir, tmp_path):
    """01 --alfworld_data/--webshop_data: the SFT demos (and the BPE) come from the real train splits, the base is
    saved apart from the synthetic one, and the env defaults an RL script set before loading the base come back."""
    from conftest import load
    F, B = load("01_formats"), load("base.build")
    args = B.Args(out_dir=str(tmp_path), alfworld_data=alf_dir, webshop_data=shop_dir, demo_tasks=2, sft_steps=1,
                  sft_batch=2, vocab_size=400, layers=1, hidden=64)
    try:
        configure("webshop", data=shop_dir, split="test")  # what 03 --data does before load_base
        _, tok, report = B.build_base(args, progress=False)
        assert report["args"]["alfworld_data"] == alf_dir and B.base_dir(args) == str(tmp_path / "tiny-real")
        assert os.path.exists(tmp_path / "tiny-real" / "base.json")
        with B.real_demo_envs(args):
            demos = {e: F.expert_demos(e, range(2), 2, **B.demo_kw(args, e)) for e in ("alfworld", "webshop")}
        assert "Welcome to TextWorld" in demos["alfworld"][0]["prompt"]  # the real games' banner, not the synthetic
        with B.real_demo_envs(args):  # the build's digest of its first demos is the real envs' digest
            assert report["demo_digest"] == B.fingerprint(args, tok)["demo_digest"]
        assert make_env("webshop").split == "test"  # the caller's configuration is back
        import dataclasses
        with pytest.raises(SystemExit, match="was built from"):  # tiny-real holds another data set's base
            B.build_base(dataclasses.replace(args, webshop_data=""), progress=False)
        with pytest.raises(SystemExit, match="alfworld is not in --envs"):
            B.build_base(dataclasses.replace(args, envs="webshop"), progress=False)
        assert not hasattr(make_env("alfworld"), "games")  # and alfworld is synthetic again
    finally:
        configure("webshop")
    assert "Welcome to TextWorld" not in F.expert_demos("alfworld", range(2), 2)[0]["prompt"]
    assert report["demo_digest"] != B.fingerprint(B.Args(), tok)["demo_digest"]  # the synthetic base's demos
