"""Execution plans for the RLHF dataflow graph and their search (ReaLHF).

Entry points: :func:`evaluate` prices a :class:`Plan` with :mod:`.cost`; :func:`search`
finds the fastest plan that fits and compares it with :func:`heuristic`.
"""
# A plan gives every call a layout (TP x PP x DP; generation PP=1) over all GPUs or, for
# the calls that may, over either half. The inference calls run together, and so do the two
# training calls, so calls on disjoint GPUs overlap; the draft's distillation and the
# reallocations stay sequential. The search is exhaustive where the space is small, else
# seeded simulated annealing.

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlhf.config import MODEL_LAYOUTS, SUBSET_MODELS
from megatron_rlhf.flags import flag_of
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.plan import memory as mem
from megatron_rlhf.plan.cost import Estimator
from megatron_rlhf.plan.graph import Graph

EXHAUSTIVE_LIMIT = 20_000  # Plans evaluated one by one up to this many; simulated annealing beyond.

# Training calls that may take either half of the GPUs (:func:`halves`), beside each other.
HALF_TRAIN = ("actor_train", "critic_train")


@dataclass
class Plan:
    layouts: dict[str, Layout]  # Call name -> its layout.

    def text(self, call: str) -> str:
        lay = self.layouts[call]
        return mem.layout_text(lay, pipeline=not (lay.pp == 1 and call.endswith("_gen")))

    def to_json(self) -> dict:
        return {"layouts": {c: self.text(c) for c in self.layouts}}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        if "layouts" not in data:
            raise ValueError("a plan file holds {\"layouts\": {call: \"TPxPPxDP\"}}")
        return cls({c: Layout.parse(t, pipeline=not c.endswith("_gen")) for c, t in data["layouts"].items()})

    def save(self, path, **extra) -> None:
        Path(path).write_text(json.dumps(dict(self.to_json(), **extra), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> "Plan":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"plan file {path} does not exist (write one with tools/plan.py --out FILE)") from None
        return cls.from_json(data)

    def key(self) -> tuple:
        return tuple(sorted((c, (lay.tp, lay.pp, lay.dp, lay.ep, lay.ranks[0])) for c, lay in self.layouts.items()))


@dataclass
class Evaluation:
    plan: Plan
    time_s: float
    calls: dict[str, dict]  # Call -> its time parts (``total`` included).
    reallocs: dict[str, tuple]  # Weight edge ``src->dst`` -> (seconds, bytes per GPU).
    memory: dict[str, int]  # Call -> peak bytes per GPU.
    capacity: int  # Usable bytes per GPU.
    # Seconds the inference calls save by running on disjoint GPUs at once (their sum
    # less the busiest GPU's share).
    overlap_s: float = 0.0
    # Seconds the actor's and the critic's training save the same way (0 where one of
    # them covers all GPUs).
    train_overlap_s: float = 0.0

    @property
    def shortfall(self) -> int:
        """Bytes per GPU the worst call lacks (0: the plan fits)."""
        return max(0, max(self.memory.values()) - self.capacity)

    @property
    def fits(self) -> bool:
        return self.shortfall == 0

    def to_json(self) -> dict:
        return {"plan": self.plan.to_json()["layouts"], "time_s": self.time_s,
                "calls": {c: {k: round(v, 6) for k, v in p.items()} for c, p in self.calls.items()},
                "reallocations": {e: {"s": t, "bytes_per_gpu": b} for e, (t, b) in self.reallocs.items()},
                "memory_gb": {c: m / mem.GB for c, m in self.memory.items()},
                "usable_gb": self.capacity / mem.GB, "fits": self.fits, "overlap_s": self.overlap_s,
                "train_overlap_s": self.train_overlap_s}


def evaluate(graph: Graph, plan: Plan, est: Estimator, cluster: mem.Cluster,
             reserve_gb: float | None = None) -> Evaluation:
    """Price ``plan``: calls in graph order, reallocations on weight edges, memory per call."""
    # The inference calls, and the training calls but the draft's, each run as one step that
    # lasts as long as its busiest GPU's share.
    missing = [c.name for c in graph.calls if c.name not in plan.layouts]
    if missing:
        raise ValueError(f"the plan gives no layout to {missing}")
    calls = {c.name: est.call_time(c, plan.layouts[c.name]) for c in graph.calls}
    # the inference calls run together: each rank runs its own one after another, and
    # calls on disjoint ranks at the same time (the trainer exchanges their results once);
    # so do the training calls (the draft's reads the updated actor: after them)
    infer = [c.name for c in graph.calls if c.kind == "infer"]
    train = [c.name for c in graph.calls if c.kind == "train" and c.model != "draft"]
    (together, overlap), (_, train_overlap) = (_together(names, calls, plan) for names in (infer, train))
    reallocs = {}
    for e in graph.weight_edges():
        reallocs[f"{e.src}->{e.dst}"] = est.realloc(e.what, plan.layouts[e.src], plan.layouts[e.dst]) \
            if e.what in est.models else (0.0, 0)
    resident = {}
    for name in ("actor_train", "critic_train"):
        if name in plan.layouts:
            resident[name.split("_")[0]] = plan.layouts[name]
    memory = {c.name: est.call_memory(c, plan.layouts[c.name], resident) for c in graph.calls}
    options = mem.MemoryOptions(reserve_gb=reserve_gb)
    capacity = int(cluster.gpu_memory_gb * mem.GB) - options.reserve_bytes(cluster)
    # (the training calls' overlap taken off their sum: exactly the sum where it is 0)
    time_s = (sum(p["total"] for c, p in calls.items() if c not in infer) + together
              + sum(t for t, _ in reallocs.values())) - train_overlap
    return Evaluation(plan, time_s, calls, reallocs, memory, capacity, overlap_s=overlap,
                      train_overlap_s=train_overlap)


def _together(names: list[str], calls: dict, plan: Plan) -> tuple[float, float]:
    """(seconds of ``names`` run together, what that saves against their sum)."""
    # Together they last the busiest rank's sum of the calls it takes part in.
    busy: dict[int, float] = {}
    for name in names:
        for r in plan.layouts[name].ranks:
            busy[r] = busy.get(r, 0.0) + calls[name]["total"]
    longest = max(busy.values(), default=0.0)
    return longest, max(sum(calls[c]["total"] for c in names) - longest, 0.0)


def candidates(graph: Graph, est: Estimator, cluster: mem.Cluster) -> dict[str, list[Layout]]:
    """Every layout each call may take, by call name."""
    # All GPUs: TP inside a node dividing the model's heads and KV heads, PP dividing its
    # layers (1 for generation), DP splitting its samples. The reference's, the reward
    # model's and the critic's inference and the :data:`HALF_TRAIN` calls may also take
    # either half of the GPUs (:func:`halves`).
    out = {}
    for call in graph.calls:
        cfg = est.models[call.model]
        found = []
        experts = cfg.num_experts if call.kind != "generate" else None  # (generation: no EP)
        layouts = mem.candidate_layouts(cluster, experts)
        if (call.kind == "infer" and _CALL_MODEL.get(call.name) in SUBSET_MODELS) or call.name in HALF_TRAIN:
            layouts += halves(cluster, experts)
        for lay in layouts:
            if call.kind == "generate" and lay.pp != 1:
                continue
            try:
                cfg.check_tensor_parallel(lay.tp)
                cfg.check_pipeline_parallel(lay.pp)
            except ValueError:
                continue
            if (call.samples // call.group) % lay.dp or call.samples % call.group:
                continue
            if call.kind == "train" and (call.samples // lay.dp) % (est.opt.micro_batch_size * call.steps):
                continue
            found.append(lay)
        if not found:
            raise ValueError(f"no layout of {cluster.gpus} GPUs suits {call.name} "
                             f"({call.model}: {cfg.num_attention_heads} heads, {cfg.num_layers} layers, "
                             f"{call.samples} samples)")
        out[call.name] = found
    return out


def halves(cluster: mem.Cluster, experts: int | None = None) -> list[Layout]:
    """``candidate_layouts`` over the first and over the second half of the GPUs."""
    # Half the nodes, or half of a single node: a call on one half runs beside another
    # call on the other half.
    if cluster.nodes > 1 and cluster.nodes % 2 == 0:
        half = mem.Cluster(cluster.nodes // 2, cluster.gpus_per_node, cluster.gpu_memory_gb)
    elif cluster.nodes == 1 and cluster.gpus_per_node % 2 == 0:
        half = mem.Cluster(1, cluster.gpus_per_node // 2, cluster.gpu_memory_gb)
    else:
        return []
    return [Layout(lay.tp, lay.pp, lay.dp, ranks=tuple(r + start for r in lay.ranks), ep=lay.ep)
            for start in (0, half.gpus) for lay in mem.candidate_layouts(half, experts)]


def heuristic(graph: Graph, est: Estimator, cluster: mem.Cluster, cands: dict) -> Plan:
    """Every call on one training layout over all GPUs, generation on its TP with DP the rest."""
    # The training layout is the smallest TP x PP (TP first, inside a node) whose training
    # fits, DP the rest.
    train_calls = [c.name for c in graph.calls if c.kind != "generate"]
    shared = [lay for lay in cands[train_calls[0]] if lay.size == cluster.gpus
              and all(lay in cands[c] for c in train_calls)] if train_calls else []
    shared.sort(key=lambda lay: (lay.tp * lay.pp, lay.pp))
    gen = next(c.name for c in graph.calls if c.kind == "generate")
    best = None
    for lay in shared:
        g = Layout(tp=lay.tp, pp=1, dp=cluster.gpus // lay.tp)
        plan = Plan({gen: g, **{c: lay for c in train_calls}})
        if best is None:
            best = plan
        if evaluate(graph, plan, est, cluster).fits:
            return plan
    if best is None:
        g = cands[gen][0]
        best = Plan({gen: g})
    return best


@dataclass
class SearchResult:
    best: Evaluation
    default: Evaluation
    method: str
    evaluated: int
    space: str
    history: list = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.default.time_s / self.best.time_s


def search(graph: Graph, est: Estimator, cluster: mem.Cluster, seed: int = 0,
           space: str = "full", budget: int = 20_000) -> SearchResult:
    """The fastest plan that fits (deterministic for a seed); ``space``: full, trainer or models.

    Raises ValueError naming the smallest memory shortfall when none fits."""
    # trainer: generation on its own layout (--gen-layout), every other call on one layout
    # over all GPUs (--train-layout). models: what the trainer executes, the actor's training
    # on all GPUs or either half, the reference's and reward model's inference and the
    # critic's training and inference each on its own layout (--ref-layout, ...). In both,
    # the draft distils on the generation layout or a train layout over all GPUs.
    if space not in ("full", "trainer", "models"):
        raise ValueError(f"space must be full, trainer or models, got {space!r}")
    cands = candidates(graph, est, cluster)
    fallback = heuristic(graph, est, cluster, cands)
    default = evaluate(graph, fallback, est, cluster) if len(fallback.layouts) == len(graph.calls) else None
    gen = next(c.name for c in graph.calls if c.kind == "generate")
    draft = "draft_train" if any(c.name == "draft_train" for c in graph.calls) else None
    others = [c.name for c in graph.calls if c.name not in (gen, draft)]
    if space in ("trainer", "models"):
        groups = {"_shared": others}
        if space == "models":  # a layout per call besides the actor's
            groups = {}
            for c in others:
                groups.setdefault(f"_{c}" if c in OWN_LAYOUT else "_shared", []).append(c)
        choices = {gen: cands[gen]}
        for g, calls in groups.items():
            choices[g] = [lay for lay in cands[calls[0]] if all(lay in cands[c] for c in calls)]
        if space == "trainer":  # one layout over all GPUs
            choices["_shared"] = [lay for lay in choices["_shared"] if lay.size == cluster.gpus]
        if draft:  # the draft distils on the generation layout or on the train layout
            choices["_draft"] = ["gen", "train"]

        def plan_of(pick):
            out = {gen: pick[gen], **{c: pick[g] for g, calls in groups.items() for c in calls}}
            if draft:
                g, t = pick[gen], pick["_shared"]
                # on a train layout without pipeline stages over all GPUs only
                on_train = pick["_draft"] == "train" and t.pp == 1 and t.size == cluster.gpus
                out[draft] = t if on_train else Layout(g.tp, 1, g.dp, g.ranks)
            return Plan(out)
    else:
        choices = cands

        def plan_of(pick):
            return Plan(dict(pick))
    size = math.prod(len(v) for v in choices.values())
    seen: dict[tuple, Evaluation] = {}

    def value(pick) -> Evaluation:
        plan = plan_of(pick)
        k = plan.key()
        if k not in seen:
            seen[k] = evaluate(graph, plan, est, cluster)
        return seen[k]

    names = list(choices)
    if size <= EXHAUSTIVE_LIMIT:
        method = "exhaustive"
        _exhaustive(names, choices, value)
    else:
        method = "simulated annealing"
        _anneal(names, choices, value, random.Random(seed), budget, default)
    fitting = [e for e in seen.values() if e.fits]
    if not fitting:
        closest = min(seen.values(), key=lambda e: (e.shortfall, e.time_s))
        worst = max(closest.memory, key=closest.memory.get)
        raise ValueError(
            f"no plan fits {cluster.nodes}x{cluster.gpus_per_node} GPUs of {cluster.gpu_memory_gb:g} GB: "
            f"the closest ({_plan_text(closest.plan)}) lacks {closest.shortfall / mem.GB:.1f} GB per GPU "
            f"in {worst} ({closest.memory[worst] / mem.GB:.1f} GB needed, "
            f"{closest.capacity / mem.GB:.1f} GB usable): use more GPUs, GPUs with more memory, "
            "or smaller batches and sequences")
    best = min(fitting, key=lambda e: (e.time_s, e.plan.key()))
    return SearchResult(best, default or best, method, len(seen), space)


def _exhaustive(names, choices, value) -> None:
    def walk(i, pick):
        if i == len(names):
            value(pick)
            return
        for lay in choices[names[i]]:
            pick[names[i]] = lay
            walk(i + 1, pick)
    walk(0, {})


def _anneal(names, choices, value, rng: random.Random, budget: int, default) -> None:
    """Simulated annealing over one call's layout at a time."""
    # Infeasible plans are walked through with their time inflated by the memory they lack.
    def score(e: Evaluation) -> float:
        return e.time_s * (1 + 4 * e.shortfall / e.capacity)

    pick = {n: rng.choice(choices[n]) for n in names}
    if default is not None:
        for n in names:
            lay = default.plan.layouts.get(n) or default.plan.layouts.get(next(
                (c for c in default.plan.layouts if not c.endswith("_gen")), n))
            if lay in choices[n]:
                pick[n] = lay
    current = score(value(pick))
    temp0 = 0.1 * current
    for i in range(budget):
        temp = temp0 * (1 - i / budget) + 1e-12
        n = rng.choice(names)
        old = pick[n]
        pick[n] = rng.choice(choices[n])
        new = score(value(pick))
        if new <= current or rng.random() < math.exp((current - new) / temp):
            current = new
        else:
            pick[n] = old


def _plan_text(plan: Plan) -> str:
    return ", ".join(f"{c} {plan.text(c)}" for c in plan.layouts)


_CALL_MODEL = {"ref_inf": "reference", "reward_inf": "reward", "critic_train": "critic", "critic_inf": "critic_inf"}
# Calls the trainer can place on a layout of their own, and the ``ParallelConfig`` field that does it.
OWN_LAYOUT = {call: MODEL_LAYOUTS[name] for call, name in _CALL_MODEL.items()}
# The same calls and the flag that sets each field.
OWN_LAYOUT_FLAG = {call: flag_of(key) for call, key in OWN_LAYOUT.items()}


def trainer_flags(plan: Plan) -> dict[str, str]:
    """The trainer's layout settings (field -> value) of a plan in the ``models`` space.

    Raises ValueError naming what the trainer cannot run."""
    # Always train_layout and gen_layout; ref_, reward_, critic_layout (default: the train
    # layout), critic_infer_layout (default: the critic's training layout) and
    # draft_train_layout ("train"; default "gen") only where they differ from their default.
    # The train layout, the layouts that default to it, and the critic's may cover part of
    # the GPUs ("1x1x2@2"); the draft distils on the train layout only where that covers all.
    own = {c: mem.layout_text(lay) for c, lay in plan.layouts.items() if c in OWN_LAYOUT}
    apart = (*OWN_LAYOUT, "draft_train")
    train, gen = trainer_layouts(Plan({c: lay for c, lay in plan.layouts.items() if c not in apart}))
    flags = {"train_layout": train, "gen_layout": gen}
    if "draft_train" in plan.layouts:
        d = mem.layout_text(plan.layouts["draft_train"])
        g = mem.layout_text(Layout.parse(gen, pipeline=False))  # generation's, as TPxPPxDP
        if d != g:
            if d != train or Layout.parse(train).pp > 1:
                raise ValueError(f"the plan puts draft_train on {d}: the draft distils on the generation "
                                 f"layout ({g}) or on the train layout ({train}) without pipeline stages")
            world = {r for lay in plan.layouts.values() for r in lay.ranks}
            if set(Layout.parse(train).ranks) != world:
                raise ValueError(f"the plan puts draft_train on the train layout {train}, which covers "
                                 f"{Layout.parse(train).size} of {len(world)} GPUs: the draft distils on the "
                                 f"train layout only where it covers all GPUs; on a part of them, on the "
                                 f"generation layout ({g})")
            flags["draft_train_layout"] = "train"
    defaults = {"critic_inf": own.get("critic_train", train)}
    for c, text in own.items():
        if text != defaults.get(c, train):
            flags[OWN_LAYOUT[c]] = text
    return flags


def trainer_layouts(plan: Plan) -> tuple[str, str]:
    """``(--train-layout, --gen-layout)`` of a plan the trainer executes; ValueError naming
    the call that differs."""
    # Generation on its own TPxDP, every other call on one TPxPPxDP (``@R`` where it covers
    # part of the GPUs from rank R on).
    gens = [c for c in plan.layouts if c.endswith("_gen")]
    if len(gens) != 1:
        raise ValueError(f"a plan needs exactly one generation call, this one has {gens or 'none'}")
    gen = plan.layouts[gens[0]]
    if gen.pp != 1:
        raise ValueError(f"the plan's generation layout has PP {gen.pp}: generation runs with PP=1")
    rest = [c for c in plan.layouts if c not in gens]
    if not rest:
        raise ValueError("the plan has no inference or training call")
    first = plan.layouts[rest[0]]
    for c in rest[1:]:
        if plan.layouts[c] != first:
            raise ValueError(
                f"the plan puts {rest[0]} on {plan.text(rest[0])} and {c} on {plan.text(c)}: this "
                "trainer runs every call but generation on one layout, or the reference, reward "
                "and critic on their own (tools/plan.py --space trainer or models writes such plans)")
    return mem.layout_text(first), plan.text(gens[0])
