"""ALFWorld-style household tasks, played through TextWorld's PDDL engine.

What this builds on
  * ALFWorld's text games are PDDL problems on one domain, played by TextWorld. The `alfworld` package ships that
    domain (alfworld/data/alfred.pddl: go to / open / close / take / move / examine / use / clean / heat / cool,
    look, inventory) and its TextWorld grammar (alfworld/data/alfred.twl2: command templates such as
    "take {o} from {r}" and feedback such as "You arrive at cabinet 1. The cabinet 1 is closed."). Its goal library
    (alfworld.gen.goal_library) gives each task type's PDDL goal and instruction templates; alfworld.gen.constants
    says which object fits in which receptacle and what can be cleaned, heated or cooled.
  * TextWorld's PddlEnv plays such a problem: fast-downward (a C++ library) holds the state, lists the applicable
    actions (the admissible commands), applies them and checks the goal; the grammar writes the feedback.
What is ours: the game files and the expert. ALFWorld builds its problems from ALFRED's 3D scenes (a data
download, unavailable offline); here a small kitchen or bedroom is drawn from random.Random(seed) and written as a
PDDL problem with one of ALFWorld's six goals. The expert reads the game's facts each step, so it re-plans from
whatever the agent did (TextWorld's planner does too, at 10-150 ms a call; tests check ours is as short).
"""
import functools
import os
import random
import sys

import alfworld
import fast_downward
import textworld
import textworld.envs.pddl.logic as pddl_logic
from alfworld.gen import constants, goal_library
from textworld.envs.pddl import PddlEnv

TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
# Task type -> (ALFWorld's action-object class, the appliance, the PDDL fact it sets, the command verb).
_TREAT = {"pick_clean_then_place_in_recep": ("Cleanable", "SinkBasin", "isclean", "clean"),
          "pick_heat_then_place_in_recep": ("Heatable", "Microwave", "ishot", "heat"),
          "pick_cool_then_place_in_recep": ("Coolable", "Fridge", "iscool", "cool")}
# Room -> ({receptacle class: (min, max) count}, object classes lying around). Kept small (8-14 receptacles)
# because the model reads every observation, and prompt length is CPU time.
ROOMS = {
    "kitchen": ({"Cabinet": (2, 3), "CounterTop": (1, 2), "Drawer": (1, 2), "Fridge": (1, 1), "Microwave": (1, 1),
                 "SinkBasin": (1, 1), "GarbageCan": (1, 1), "DiningTable": (0, 1), "StoveBurner": (0, 1),
                 "Shelf": (0, 1)},
                ("Apple", "Bread", "Egg", "Lettuce", "Potato", "Tomato", "Bowl", "Cup", "Mug", "Plate", "Pan", "Pot",
                 "Fork", "Knife", "Spatula", "Spoon", "DishSponge", "SaltShaker", "PepperShaker", "SoapBottle")),
    "bedroom": ({"Bed": (1, 1), "Desk": (1, 1), "SideTable": (1, 2), "Drawer": (2, 3), "Shelf": (1, 2),
                 "Dresser": (1, 1), "GarbageCan": (1, 1), "Safe": (0, 1), "ArmChair": (0, 1)},
                ("AlarmClock", "Book", "CD", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Pen", "Pencil",
                 "Pillow", "RemoteControl", "Watch", "Mug", "Bowl", "Vase", "Statue", "TissueBox")),
}
_DOMAIN_TYPES = ({"SinkBasin", "Microwave", "Fridge"}, {"Knife", "ButterKnife"})  # named by the domain's actions
_CAN = constants.VAL_RECEPTACLE_OBJECTS
_DATA = os.path.join(os.path.dirname(alfworld.__file__), "data")
_BANNER = "-= Welcome to TextWorld, ALFRED! =-\n\n"


def generate(seed):
    """Draw one task from `seed` (pure, deterministic): the PDDL problem, the instruction and the goal."""
    rng = random.Random(seed)
    task_type = TASK_TYPES[seed % len(TASK_TYPES)]  # any 6 consecutive seeds cover all task types
    room = ("bedroom" if task_type == "look_at_obj_in_light" else "kitchen" if task_type in _TREAT  # lamp / appliances
            else rng.choice(sorted(ROOMS)))
    counts, pool = ROOMS[room]
    receps = [(cls, i) for cls, (lo, hi) in counts.items() for i in range(1, rng.randint(lo, hi) + 1)]
    skill, appliance, fact, verb = _TREAT.get(task_type, (None, None, None, None))
    # Goal receptacle classes for an object: it fits there, and somewhere else to start from; never the appliance.
    fits = lambda o, r: o in _CAN.get(r, ())
    targets = lambda o: sorted({r for r, _ in receps if fits(o, r) and r != appliance
                                and any(fits(o, x) for x, _ in receps if x != r)})
    obj = rng.choice([o for o in pool if targets(o) and (not skill or o in constants.VAL_ACTION_OBJECTS[skill])
                      and (task_type != "look_at_obj_in_light" or o != "Pillow")])
    recep = None if task_type == "look_at_obj_in_light" else rng.choice(targets(obj))
    toggle = "DeskLamp" if task_type == "look_at_obj_in_light" else None

    # Objects: the goal's (two or three for pick_two) and a few distractors of other classes.
    n_goal = rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 2)
    objects, count = [], {}
    for cls in [obj] * n_goal + rng.sample([o for o in pool if o != obj], rng.randint(4, 6)):
        count[cls] = count.get(cls, 0) + 1
        # A goal object never starts in a target receptacle, else the task could be solved at reset.
        spots = [r for r in receps if fits(cls, r[0]) and not (cls == obj and r[0] == recep)]
        objects.append(((cls, count[cls]), rng.choice(spots)))
    if toggle:
        objects.append(((toggle, 1), rng.choice([r for r in receps if r[0] in ("Desk", "SideTable")])))

    name = lambda cls, i: f"{cls}_{i}".lower()  # PDDL id; the agent sees it as "cabinet 1"
    loc = {r: f"loc_{k + 1}" for k, r in enumerate(receps)}  # one receptacle per location; loc_0: middle of room
    init = ["(atLocation agent1 loc_0)"]
    for r in receps:
        init += [f"(receptacleAtLocation {name(*r)} {loc[r]})", f"(receptacleType {name(*r)} {r[0]}Type)"]
        if r[0] in constants.OPENABLE_CLASS_LIST:
            init.append(f"(openable {name(*r)})")
    for o, r in objects:
        init += [f"(inReceptacle {name(*o)} {name(*r)})", f"(objectAtLocation {name(*o)} {loc[r]})",
                 f"(objectType {name(*o)} {o[0]}Type)", f"({'toggleable' if o[0] == toggle else 'pickupable'} "
                 f"{name(*o)})"]
        init += [f"({s.lower()} {name(*o)})" for s in ("Cleanable", "Heatable", "Coolable")
                 if o[0] in constants.VAL_ACTION_OBJECTS[s]]
    otypes = sorted({o[0] for o, _ in objects} | _DOMAIN_TYPES[1])
    rtypes = sorted({r[0] for r in receps} | _DOMAIN_TYPES[0])
    init += [f"(canContain {r}Type {o}Type)" for r in rtypes for o in otypes if fits(o, r)]
    goal = goal_library.gdict[task_type]["pddl"].replace("#", "-")  # the library writes "?r # receptacle"
    problem = "\n".join([  # the library's goal text ends with the ")" that closes the problem
        f"(define (problem alfworld_{seed}) (:domain alfred)", "(:objects agent1 - agent",
        " ".join(f"loc_{k}" for k in range(len(receps) + 1)) + " - location",
        " ".join(name(*r) for r in receps) + " - receptacle", " ".join(name(*o) for o, _ in objects) + " - object",
        " ".join(f"{o}Type" for o in otypes) + " - otype", " ".join(f"{r}Type" for r in rtypes) + " - rtype)",
        "(:init", *init, ")", goal.format(obj=obj, recep=recep, toggle=toggle, mrecep=None)])
    text = rng.choice(goal_library.gdict[task_type]["templates"])
    text = text.format(obj=obj.lower(), recep=(recep or "").lower(), toggle=(toggle or "").lower())
    low = lambda s: s and s.lower()
    return {"problem": problem, "task": f"Your task is to: {text}.", "task_type": task_type,
            "goal": {"obj": obj.lower(), "recep": low(recep), "toggle": low(toggle), "appliance": low(appliance),
                     "fact": fact, "verb": verb, "n": 2 if task_type == "pick_two_obj_and_place" else 1}}


class _MemoFastDownward:
    """fast_downward, as TextWorld's PDDL logic sees it, but with pddl2sas memoized per problem: PddlState runs that
    PDDL->SAS translation twice on every reset (~0.1 s each), and the result depends on the problem text only.
    Also restores sys.argv, which the translator overwrites (argparse users would read it later)."""

    def __getattr__(self, attr):
        return getattr(fast_downward, attr)

    @staticmethod
    @functools.lru_cache(maxsize=256)  # the last 128 problems, ~0.4 MB each
    def pddl2sas(domain, problem, verbose=False, optimize=False):
        argv = sys.argv
        try:
            return fast_downward.pddl2sas(domain, problem, verbose=verbose, optimize=optimize)
        finally:
            sys.argv = argv


pddl_logic.fast_downward = _MemoFastDownward()


@functools.lru_cache(maxsize=1)
def _logic():
    """ALFWorld's domain and grammar, parsed once per process (the grammar takes ~0.1 s)."""
    with open(os.path.join(_DATA, "alfred.pddl")) as domain, open(os.path.join(_DATA, "alfred.twl2")) as grammar:
        return pddl_logic.GameLogic(domain=domain.read(), grammar=grammar.read())


class _Game(PddlEnv):
    """TextWorld's PddlEnv with the parsed logic shared between games, ALFWorld names, and fast command lists."""

    def load(self, problem):
        self._game_data, self._game_file, self.walkthrough = {"pddl_problem": problem}, None, None
        self._logic = _logic()
        self._pddl_state = pddl_logic.PddlState(self.downward_lib, problem, self._logic)
        self._entity_infos = self._get_entity_infos()
        for info in self._entity_infos.values():
            info.name = info.id.replace("_", " ")  # "cabinet_1" -> "cabinet 1", as ALFWorld's Demangler names it

    def _gather_infos(self):
        # TextWorld derives each applicable action's command through the grammar (~2 ms each, tatsu + deepcopy);
        # the templates only need entity names ("go to" has one action per receptacle at the destination, so
        # "go to {r}" names each), so format them directly. Tests compare both, on synthetic and real games.
        actions = self._pddl_state.all_applicable_actions()
        commands = []
        for action in actions:
            template = "go to {r}" if action.name == "gotolocation" else self._logic.actions[action.name].template
            commands.append(template.format(**{ph.name: self._entity_infos[var.name].name
                                               for ph, var in action.mapping.items()}))
        self.state["_valid_actions"], self.state["_valid_commands"] = actions, commands
        self.state["admissible_commands"] = sorted(set(commands))
        self.state["won"], self.state["lost"] = self._pddl_state.check_goal(), False


def _view(facts):
    """The game's facts as a small dict the expert can read (and roll forward)."""
    v = {"loc": None, "holding": None, "inr": {}, "rloc": {}, "rtype": {}, "otype": {}, "flags": set(), "can": set()}
    for fact in facts:
        a = [arg.name for arg in fact.arguments]
        if fact.name == "atlocation":
            v["loc"] = a[1]
        elif fact.name == "holds":
            v["holding"] = a[1]
        elif fact.name in ("inreceptacle", "receptacleatlocation"):
            v["inr" if fact.name == "inreceptacle" else "rloc"][a[0]] = a[1]
        elif fact.name in ("receptacletype", "objecttype"):
            v["rtype" if fact.name == "receptacletype" else "otype"][a[0]] = a[1][:-len("type")]
        elif fact.name == "cancontain":
            v["can"].add((a[0][:-len("type")], a[1][:-len("type")]))
        elif len(a) == 1:  # openable, opened, isclean, ishot, iscool, istoggled, ...
            v["flags"].add((fact.name, a[0]))
    v["at"] = next((r for r, l in v["rloc"].items() if l == v["loc"]), None)
    return v


def _expert(goal, v):
    """Next expert step (verb, *ids) from state `v`, or None once the goal holds. It knows where everything is (as
    TextWorld's planner does) and counts steps: fetch the goal object that is cheapest to finish, treat it, bring
    it to the target receptacle (the one holding the most finished objects, then the cheapest), and put anything
    else it holds down on the way. Tests check its plans are as short as the planner's."""
    at, held, inr, flags = v["at"], v["holding"], v["inr"], v["flags"]
    closed = lambda r: ("openable", r) in flags and ("opened", r) not in flags
    cost = lambda r: (r != at) + closed(r)  # steps until we stand at r with it open
    reach = lambda r, step: ("go", r) if r != at else ("open", r) if closed(r) else step
    done = lambda o: v["otype"][o] == goal["obj"] and (not goal["fact"] or (goal["fact"], o) in flags)
    mine = held and v["otype"][held] == goal["obj"]
    app = goal["appliance"] and min(r for r, t in v["rtype"].items() if t == goal["appliance"])
    target = home = None
    if goal["toggle"]:
        lamp = min(o for o, t in v["otype"].items() if t == goal["toggle"])
        home = inr[lamp]
        if mine and at == home and ("istoggled", lamp) in flags:
            return None
        if mine:
            return ("go", home) if at != home else ("use", lamp)
    else:
        score = lambda r: sum(done(o) for o, rr in inr.items() if rr == r)
        target = min((r for r, t in v["rtype"].items() if t == goal["recep"]), key=lambda r: (-score(r), cost(r), r))
        if score(target) >= goal["n"]:
            return None
        if mine and not done(held):
            return ("go", app) if at != app else (goal["verb"], held, app)
        if mine:
            return reach(target, ("move", held, target))

    def fetch(o, start, opened=None):  # steps to take o from `start` (where `opened` is open), treat, walk on
        r, then = inr[o], home or (target if done(o) else app)
        return (r != start) + (closed(r) and r != opened) + 2 * (not done(o)) + (r != then)

    wanted = [o for o, t in v["otype"].items() if t == goal["obj"] and o in inr and not (done(o) and inr[o] == target)]
    if not held:  # ties: one where we stand first (for a second object we would have to come back)
        o = min(wanted, key=lambda o: (fetch(o, at), inr[o] != at, o))
        return reach(inr[o], ("take", o, inr[o]))
    # Holding something we do not need: put it down where that makes the next fetch cheapest.
    fits = [r for r, t in v["rtype"].items() if (t, v["otype"][held]) in v["can"]]
    spot, _ = min(((r, o) for r in fits for o in wanted), key=lambda p: (cost(p[0]) + fetch(p[1], p[0], p[0]), p))
    return reach(spot, ("move", held, spot))


def _search(goal, v):
    """Next step of the searching expert: it uses only what the agent is shown, so a model can imitate it from its
    prompt. It sweeps the receptacles in the order the admissible list shows them (alphabetical by name), from the
    one after where it stands, opening closed ones; takes a goal object once it sees one (not one already finished in
    the target); treats it at the first appliance; brings it to the first target receptacle of the asked type; for
    the lamp task it sweeps on, holding the object, until it stands by a lamp. Holding something else (only an agent
    that strayed does), it falls back to the all-knowing expert's way of putting it down."""
    at, held, inr, flags = v["at"], v["holding"], v["inr"], v["flags"]
    closed = lambda r: ("openable", r) in flags and ("opened", r) not in flags
    shown = lambda r: r.replace("_", " ")
    order = sorted(v["rtype"], key=shown)
    nxt = ("go", next((r for r in order if shown(r) > shown(at)), order[0]) if at else order[0])
    done = lambda o: v["otype"][o] == goal["obj"] and (not goal["fact"] or (goal["fact"], o) in flags)
    if held and v["otype"][held] != goal["obj"]:
        return _expert(goal, v)
    here = sorted(o for o, r in inr.items() if at and r == at and not closed(at))
    if goal["toggle"]:
        lamp = next((o for o in here if v["otype"][o] == goal["toggle"]), None)
        if held and lamp and ("istoggled", lamp) in flags:
            return None
        if held:
            return ("use", lamp) if lamp else nxt
        target = None
    else:
        target = min((r for r, t in v["rtype"].items() if t == goal["recep"]), key=shown)
        if sum(done(o) for o, r in inr.items() if r == target) >= goal["n"]:
            return None
        if held and not done(held):
            app = min((r for r, t in v["rtype"].items() if t == goal["appliance"]), key=shown)
            return ("go", app) if at != app else (goal["verb"], held, app)
        if held:
            return ("go", target) if at != target else ("open", target) if closed(target) else ("move", held, target)
    found = [o for o in here if v["otype"][o] == goal["obj"] and not (at == target and done(o))]
    if found:
        return ("take", found[0], at)
    return ("open", at) if at and closed(at) else nxt


EXPERTS = {"oracle": _expert, "search": _search}


def _command(step):
    """An expert step as ALFWorld's command text (the twl2 templates)."""
    verb, *ids = step
    n = [i.replace("_", " ") for i in ids]
    return {"go": "go to {0}", "open": "open {0}", "take": "take {0} from {1}", "move": "move {0} to {1}",
            "use": "use {0}"}.get(verb, verb + " {0} with {1}").format(*n)


def _simulate(v, step):
    """Roll `v` forward by one expert step (the domain's effects, for the few verbs the expert uses)."""
    verb, *ids = step
    if verb == "go":
        v["at"], v["loc"] = ids[0], v["rloc"][ids[0]]
    elif verb == "open":
        v["flags"].add(("opened", ids[0]))
    elif verb == "take":
        v["holding"] = ids[0]
        del v["inr"][ids[0]]
    elif verb == "move":
        v["inr"][ids[0]], v["holding"] = ids[1], None
    elif verb == "use":
        v["flags"].add(("istoggled", ids[0]))
    else:  # clean / heat / cool
        v["flags"].add(({"clean": "isclean", "heat": "ishot", "cool": "iscool"}[verb], ids[0]))


class AlfWorldEnv:
    """ALFWorld household task: reset(seed) -> (obs, info); step(action) -> (obs, reward, done, info)."""

    def __init__(self, max_steps=25, expert="oracle", single_turn=False):
        """expert: oracle (knows where everything is; its plans are as short as TextWorld's planner's) or search
        (sees only what the agent sees, see _search).
        single_turn: the one-decision version of the task, for the contrast with single-turn RL: the first action
        ends the episode, with reward 10 when it is the all-knowing expert's first step (mostly: go to where the
        goal object is), else 0."""
        if expert not in EXPERTS:
            raise ValueError(f"unknown ALFWorld expert {expert!r}; choose {' or '.join(EXPERTS)}")
        self.max_steps, self._expert = (1 if single_turn else max_steps), EXPERTS[expert]
        self.single_turn, self._won = single_turn, False
        self._game = _Game(textworld.EnvInfos(admissible_commands=True, won=True))
        self._seed, self._task, self.done, self.steps = None, None, True, 0

    def reset(self, seed=0):
        if seed != self._seed:  # the same seed again (parallel copies, reruns) reuses the loaded game
            self._task = generate(seed)
            self._game.load(self._task["problem"])
            self._seed = seed
        state = self._game.reset()
        self.steps, self.done, self._won = 0, False, False
        obs = state.feedback.replace(_BANNER, "").replace("Your task is to: UNKNOWN GOAL.", self._task["task"])
        info = self._info(state, True)
        v, plan = _view(self._game._pddl_state.facts), []
        for _ in range(4 * self.max_steps):  # the full plan, by rolling the expert forward
            step = self._expert(self._task["goal"], v)
            if step is None:
                break
            plan.append(_command(step))
            _simulate(v, step)
        info["expert_plan"] = plan
        if self.single_turn:
            self._decision = _command(_expert(self._task["goal"], _view(self._game._pddl_state.facts)))
        return obs, info

    def step(self, action):
        if self._task is None:
            raise RuntimeError("call reset(seed) before step()")
        if self.single_turn and not self.done:  # one decision: the all-knowing expert's first step wins
            self.steps, self.done = self.steps + 1, True
            self._won = action is not None and " ".join(str(action).lower().split()) == self._decision
            return "The episode is over.", 10.0 if self._won else 0.0, True, self._info(self._game.state, True)
        if self.done or action is None:  # malformed response (None) or episode over: a no-op
            obs, state = "Nothing happens.", self._game.state
        else:
            state, _, _ = self._game.step(" ".join(str(action).lower().split()))
            obs = state.feedback  # TextWorld answers "Nothing happens." to anything inadmissible
        reward = 0.0
        if not self.done:
            self.steps += 1
            reward = 10.0 if state["won"] else 0.0
            self.done = bool(state["won"]) or self.steps >= self.max_steps
        return obs, reward, self.done, self._info(state, action is not None)

    def _info(self, state, valid):
        step = None if self.done else self._expert(self._task["goal"], _view(self._game._pddl_state.facts))
        return {"task": self._task["task"], "task_type": self._task["task_type"],
                "won": bool(state["won"]) or self._won,
                "admissible_actions": [c for c in state["admissible_commands"] if c != "help"],
                "is_action_valid": valid, "expert_action": step and _command(step)}
