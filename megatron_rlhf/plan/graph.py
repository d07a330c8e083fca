"""The dataflow graph of one RLHF iteration (ReaLHF): model calls and what flows between them.

Entry point: :func:`rlhf_graph`. Pure description (no torch): :mod:`.cost` prices it and
:mod:`.search` assigns the layouts.
"""
# A node (Call) is a model's call: a kind (generate, infer, train), its samples and their
# lengths. An edge (Edge) carries data or weights; a weight edge between two calls of one
# model under different layouts is a parameter reallocation.

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("generate", "infer", "train")
MODELS = ("actor", "reference", "critic", "reward", "draft")


@dataclass(frozen=True)
class Call:
    """One model function call of the iteration."""

    name: str  # Unique name, e.g. ``actor_gen``, ``ref_inf``, ``actor_train``.
    model: str  # Which model runs (one of :data:`MODELS`).
    kind: str  # ``generate``, ``infer`` (forward only) or ``train`` (forward, backward, optimizer).
    samples: int  # Sequences processed per iteration (over all data-parallel ranks).
    prompt_len: int  # Prompt tokens per sequence (the longest).
    gen_len: int  # Response tokens per sequence (the longest).
    passes: int = 1  # Training: PPO epochs (each sample is trained on this many times).
    steps: int = 1  # Training: optimizer steps per pass (mini-batches).
    # Generation: samples come in groups of this many (responses to one prompt), which one
    # data-parallel rank generates together.
    group: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"call {self.name}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.model not in MODELS:
            raise ValueError(f"call {self.name}: model must be one of {MODELS}, got {self.model!r}")
        if self.samples <= 0 or self.prompt_len <= 0 or self.gen_len <= 0:
            raise ValueError(f"call {self.name}: samples and lengths must be positive")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len


@dataclass(frozen=True)
class Edge:
    """``src`` must finish before ``dst`` starts; ``kind`` ``data`` or ``weights``."""

    src: str
    dst: str
    kind: str
    # What flows: ``samples``, ``logprobs``, ``values``, ``rewards``, or the model whose
    # weights move.
    what: str


@dataclass
class Graph:
    calls: list[Call]
    edges: list[Edge] = field(default_factory=list)

    def __post_init__(self) -> None:
        names = [c.name for c in self.calls]
        if len(set(names)) != len(names):
            raise ValueError(f"call names must be unique: {names}")
        for e in self.edges:
            if e.src not in names or e.dst not in names:
                raise ValueError(f"edge {e.src} -> {e.dst} names an unknown call")
        self.order()  # raises on a cycle among data edges

    def call(self, name: str) -> Call:
        return next(c for c in self.calls if c.name == name)

    def deps(self, name: str) -> list[str]:
        """Calls whose data ``name`` reads within the iteration."""
        return [e.src for e in self.edges if e.dst == name and e.kind == "data"]

    def order(self) -> list[str]:
        """The calls in an order that respects the data edges (stable: listing order)."""
        done: list[str] = []
        pending = [c.name for c in self.calls]
        while pending:
            ready = [n for n in pending if all(d in done for d in self.deps(n))]
            if not ready:
                raise ValueError(f"the data edges among {pending} form a cycle")
            done.append(ready[0])
            pending.remove(ready[0])
        return done

    def weight_edges(self) -> list[Edge]:
        return [e for e in self.edges if e.kind == "weights"]


def rlhf_graph(samples: int, prompt_len: int, gen_len: int, critic: bool = True,
               reference: bool = True, reward_model: bool = False, draft: bool = False,
               draft_distill: bool = False, ppo_epochs: int = 1, mini_batches: int = 1,
               group: int = 1) -> Graph:
    """The graph of one PPO iteration (GRPO: ``critic=False``) of ``samples`` sequences."""

    def c(name, model, kind, **kw):
        return Call(name, model, kind, samples, prompt_len, gen_len, **kw)

    calls = [c("actor_gen", "actor", "generate", group=group)]
    edges = []
    if reference:
        calls.append(c("ref_inf", "reference", "infer"))
        edges.append(Edge("actor_gen", "ref_inf", "data", "samples"))
    if reward_model:
        calls.append(c("reward_inf", "reward", "infer"))
        edges.append(Edge("actor_gen", "reward_inf", "data", "samples"))
    if critic:
        calls.append(c("critic_inf", "critic", "infer"))
        edges.append(Edge("actor_gen", "critic_inf", "data", "samples"))
    train_inputs = [x.name for x in calls[1:]]
    calls.append(c("actor_train", "actor", "train", passes=ppo_epochs, steps=mini_batches))
    edges.append(Edge("actor_gen", "actor_train", "data", "samples"))
    edges += [Edge(n, "actor_train", "data", _product(n)) for n in train_inputs]
    if critic:
        calls.append(c("critic_train", "critic", "train", passes=ppo_epochs, steps=mini_batches))
        edges.append(Edge("actor_gen", "critic_train", "data", "samples"))
        edges += [Edge(n, "critic_train", "data", _product(n)) for n in train_inputs]
        edges.append(Edge("critic_train", "critic_inf", "weights", "critic"))
    edges.append(Edge("actor_train", "actor_gen", "weights", "actor"))
    if draft and draft_distill:
        calls.append(c("draft_train", "draft", "train"))
        edges.append(Edge("actor_gen", "draft_train", "data", "samples"))
        edges.append(Edge("actor_train", "draft_train", "data", "teacher"))  # the updated actor
        edges.append(Edge("draft_train", "actor_gen", "weights", "draft"))
    return Graph(calls, edges)


def _product(call_name: str) -> str:
    return {"ref_inf": "logprobs", "reward_inf": "rewards", "critic_inf": "values"}[call_name]
