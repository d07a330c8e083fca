"""The SPMD RLHF loop: every rank runs every stage of every iteration (colocation).

Entry point: :meth:`RLHFTrainer.run`; one iteration (:meth:`RLHFTrainer.iteration`) is a
short sequence of named stages, each measured for time and memory: rollout (generation,
:mod:`~megatron_rlhf.generation`) -> experience (:mod:`.experience`) -> train (:mod:`.update`)
-> reallocate (weights to the models' second layouts) -> draft (distillation).
Data-parallel ranks take disjoint prompts; TP ranks of one replica run in lockstep. An
iteration's prompts and seed depend on (seed, iteration) alone and a sample's random
numbers on its global index, so a resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from megatron_rlhf import runtime
from megatron_rlhf.config import GenerationConfig, LoopConfig, MigrationConfig, PPOConfig, SpecConfig
from megatron_rlhf.data.sampler import batch_indices
from megatron_rlhf.models import routing
from megatron_rlhf.rlhf import offload, placement
from megatron_rlhf.rlhf.dynamic_sampling import GroupFilter
from megatron_rlhf.rlhf.evaluation import HeldOut, eval_metrics
from megatron_rlhf.rlhf.experience import ExperienceMaker
from megatron_rlhf.rlhf.placement import Share
from megatron_rlhf.rlhf.metrics import MetricsLog, progress
from megatron_rlhf.rlhf.state import save_training
from megatron_rlhf.rlhf.optim import Trainee
from megatron_rlhf.rlhf.regroup import regroup, token_batch
from megatron_rlhf.rlhf.update import train_actor, train_critic, train_draft


@dataclass
class Models:
    """The models of a run, built and loaded on this rank."""

    # None outside a layout over part of the world; reference (reward_model, critic_inf
    # alike) is then a reshard.Absent copy, and None when no KL term reads it
    actor: Trainee | None
    reference: torch.nn.Module | None = None
    critic: Trainee | None = None
    draft: torch.nn.Module | None = None
    draft_trainee: Trainee | None = None
    reward_model: torch.nn.Module | None = None
    # second copies, reallocated from actor / critic after each update: the actor in the
    # generation layout (the draft lives there too), the critic in its inference layout
    actor_gen: torch.nn.Module | None = None
    critic_inf: torch.nn.Module | None = None
    # actor/critic -> the Absent copy that ranks outside its training layout pass to the
    # reallocations and checkpoint saves (collective over the world)
    elsewhere: dict = field(default_factory=dict)

    @property
    def generating_actor(self) -> torch.nn.Module:
        return self.actor_gen if self.actor_gen is not None else self.actor.model

    @property
    def inferring_critic(self) -> torch.nn.Module | None:
        if self.critic_inf is not None:
            return self.critic_inf
        return self.critic.model if self.critic is not None else None

    @property
    def draft_on_train_layout(self) -> bool:
        """The draft distils on a copy of its own in the train layout (``--draft-train-layout train``)."""
        return self.draft_trainee is not None and self.draft_trainee.model is not self.draft

    def trained(self, name: str) -> tuple[torch.nn.Module | None, object]:
        """``(model, process groups)`` of trained model ``name``: its training copy, or its
        ``Absent`` stand-in and None outside its layout."""
        t = {"actor": self.actor, "critic": self.critic}[name]
        return (t.model, t.pg) if t is not None else (self.elsewhere.get(name), None)

    def trainees(self, critic: bool) -> dict:
        """The optimizers a checkpoint holds: name -> Trainee (None outside its layout)."""
        out = {"actor": self.actor}
        if critic:
            out["critic"] = self.critic
        if self.draft_trainee is not None:
            out["draft"] = self.draft_trainee
        return out

    def copies(self) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
        """``(trained, copy)`` pairs of the models with a second layout (either may be ``Absent``)."""
        draft = self.draft_trainee.model if self.draft_on_train_layout else None
        pairs = [(self.trained("actor")[0], self.actor_gen), (self.trained("critic")[0], self.critic_inf),
                 (draft, self.draft if draft is not None else None)]
        return [(t, c) for t, c in pairs if t is not None and c is not None]


def iteration_seed(seed: int, iteration: int) -> int:
    """Sampling seed of one iteration (samples are told apart by their global index)."""
    return (seed * 1_000_003 + iteration * 7919) % (2**63)


class RLHFTrainer:
    """Runs iterations ``start+1 .. loop.train_iters``; see the module docstring."""

    def __init__(self, models: Models, generator, maker: ExperienceMaker, ppo: PPOConfig,
                 loop: LoopConfig, gen: GenerationConfig, spec: SpecConfig, prompts: list,
                 prompt_ids: list[list[int]], pg, tokenizer=None, save_dir=None, log_dir=None,
                 start_iteration: int = 0, run_info: dict | None = None,
                 migration: MigrationConfig | None = None, gen_pg=None,
                 release_train_copy: bool | None = None, model_pgs: dict | None = None,
                 heldout: HeldOut | None = None, park_optimizer: bool | None = None,
                 keep_graphs: bool = False):
        self.m, self.generator, self.maker = models, generator, maker
        self.heldout = heldout
        # call (reference, reward, critic, critic_train) -> its own layout's process groups
        self.model_pgs = model_pgs or {}
        # (None: on GPU; only where the actor generates on a copy of its own)
        release = runtime.has_cuda() if release_train_copy is None else release_train_copy
        self.release_train_copy = release and models.actor_gen is not None
        # the trainees' optimizer states wait on the host during generation (None: on GPU)
        self.park_optimizer = runtime.has_cuda() if park_optimizer is None else park_optimizer
        # the generator's KV cache store and decode graphs stay from one rollout to the next
        self.keep_graphs = keep_graphs
        self.gen_pg = gen_pg if gen_pg is not None else pg
        from megatron_rlhf.parallel.reshard import Reallocator

        self.reallocators = [Reallocator() for _ in models.copies()]  # one plan per pair
        for actor in self._actors():
            routing.set_replay(actor, ppo.routing_replay == "rollout")
        self.ppo, self.loop, self.gen, self.spec = ppo, loop, gen, spec
        self.prompts, self.prompt_ids, self.pg, self.tokenizer = prompts, prompt_ids, pg, tokenizer
        self.save_dir, self.start = save_dir, start_iteration
        self.run_info = run_info or {}
        self.rank0 = dist.get_rank() == 0
        self.dp_rank, self.dp = pg.dp.rank(), pg.dp.size()
        self.log = MetricsLog(log_dir, self.rank0, resume_from=start_iteration,
                              wandb_project=loop.wandb_project, config=self.run_info)
        self.history: list[dict] = []
        self.migrator = None
        migration = migration or MigrationConfig()
        if migration.enabled(self.gen_pg.dp.size()):
            from megatron_rlhf.generation.migration import Migrator

            self.migrator = Migrator(self.gen_pg.dp, migration, runtime.device(), tp_group=self.gen_pg.tp)

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[dict]:
        last = self.loop.train_iters
        if self.heldout is not None and self.start == 0:  # the baseline
            self.log.write(0, self.evaluate(0))
        bar = progress(self.start, last, self.rank0)
        for it in range(self.start + 1, last + 1):
            metrics = self.iteration(it)
            if self.heldout is not None and self.heldout.cfg.due(it, last):
                metrics.update(self.evaluate(it))
            self.history.append(metrics)
            self.log.write(it, metrics)
            if bar is not None:
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                                tok_s=f"{metrics['gen_tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
            interval = self.loop.save_interval
            if self.save_dir and (it == self.loop.train_iters or (interval and it % interval == 0)):
                self.save(it)
        if bar is not None:
            bar.close()
        self.log.close()
        return self.history

    def _my_samples(self, it: int, dp_group, round_: int = 0):
        """``(prompt ids, texts, global sample indices, records' fields)`` of this rank's share
        of iteration ``it`` under ``dp_group``; ``round_`` > 0: a further draw (--filter-groups)."""
        # a further round draws from a stream of its own, its sample indices after those of earlier rounds
        g = self.ppo.global_batch_size
        if round_ == 0:
            idx = batch_indices(len(self.prompt_ids), g, it, self.loop.seed)
        else:
            tries = self.ppo.filter_max_tries
            idx = batch_indices(len(self.prompt_ids), g, (it - 1) * tries + round_, self.loop.seed + 1)
        per, rank = g // dp_group.size(), dp_group.rank()
        mine = idx[rank * per:(rank + 1) * per]
        n = self.ppo.rollout_n
        ids = [self.prompt_ids[i] for i in mine for _ in range(n)]
        texts = [self.prompts[i].prompt for i in mine for _ in range(n)]
        metas = [self.prompts[i].meta for i in mine for _ in range(n)]
        first = round_ * g * n + rank * per * n
        return ids, texts, list(range(first, first + len(ids))), metas

    def _generate(self, ids, sample_ids, gen: GenerationConfig, seed: int):
        """A generation call on the generation layout; trainee states wait on the host where
        ``park_optimizer``."""
        m = self.m
        for t in (m.actor, m.critic, m.draft_trainee):
            if t is not None and self.park_optimizer:
                offload.park_trainee(t, host=True)
        if self.release_train_copy and m.actor is not None:  # generation has its own copy: the training one waits
            offload.release_weights(m.actor, host=True, force=True)
        generated = self.generator.generate(ids, gen, self.spec, seed=seed, sample_ids=sample_ids,
                                            migrator=self.migrator)
        if not self.keep_graphs:  # the KV cache store and its graphs, until the next rollout
            self.generator.release()
        if m.actor is not None:
            offload.release_weights(m.actor, host=False, force=True)
        return generated

    def _filtered_rollout(self, it: int):
        """--filter-groups: rounds of generation and scoring until every rank holds its share of
        informative groups (:mod:`.dynamic_sampling`)."""
        per_rank = self.ppo.global_batch_size // self.pg.dp.size()
        keep = GroupFilter(need=per_rank, n=self.ppo.rollout_n)
        dev = runtime.device()
        for round_ in range(self.ppo.filter_max_tries):
            ids, texts, sids, metas = self._my_samples(it, self.gen_pg.dp, round_)
            generated = self._generate(ids, sids, self.gen, iteration_seed(self.loop.seed, it))
            scores = self.maker.score(ids, texts, generated, sids[0], metas)
            keep.add(generated, scores, (ids, texts, sids, metas))
            short = runtime.all_reduce(torch.tensor([float(keep.short)], device=dev), dist.ReduceOp.MAX)
            if not short.item():
                break
        rollout, scores, (ids, texts, sids, metas), counts = keep.batch(self.generator.pad_id)
        totals = runtime.all_reduce(torch.tensor(list(counts.values()), dtype=torch.float64, device=dev),
                                     group=self.pg.dp).tolist()
        metrics = dict(zip(counts, totals), filter_rounds=float(keep.rounds))
        return rollout, scores, ids, texts, sids, metas, metrics

    def evaluate(self, it: int) -> dict:
        """``eval/*`` metrics of the policy on the held-out records, scored with the run's reward."""
        h, dp = self.heldout, self.gen_pg.dp
        k, start = h.cfg.eval_samples, time.perf_counter()
        mine = list(range(dp.rank(), len(h.records), dp.size()))
        ids = [h.prompt_ids[i] for i in mine for _ in range(k)]
        sids = [i * k + j for i in mine for j in range(k)]
        gen = replace(self.gen, temperature=h.cfg.eval_temperature)
        generated = self._generate(ids, sids, gen, iteration_seed(self.loop.seed, 0) ^ 0x5EED)
        scores = self.maker.score(ids, [h.records[i].prompt for i in mine for _ in range(k)], generated,
                                  sids[0] if sids else 0, [h.records[i].meta for i in mine for _ in range(k)])
        out = eval_metrics(scores, generated.lengths, k, h.cfg.eval_threshold, dp)
        out.update({f"eval/{name}": float(v) for name, v in self.maker.take_reward_stats().items()})
        out["eval/time_s"] = time.perf_counter() - start
        return out

    def iteration(self, it: int) -> dict:
        """Run iteration ``it``'s stages on this rank; returns its metrics."""
        # With --gen-layout the samples are regrouped onto the train layout's DP ranks for the
        # experience; models on layouts of their own (--ref-layout, --critic-layout, ...) are
        # placed calls (placement.py), and actor and critic on disjoint ranks train at once.
        m, stages = self.m, offload.StageMemory()
        host, dev = torch.device("cpu"), runtime.device()
        scores, extra = None, {}
        with stages.stage("rollout"):
            if self.ppo.filter_groups:  # (one layout: the generating ranks train)
                generated, scores, gen_ids, texts, gen_sids, metas, extra = self._filtered_rollout(it)
            else:
                gen_ids, _, gen_sids, _ = self._my_samples(it, self.gen_pg.dp)
                generated = self._generate(gen_ids, gen_sids, self.gen, iteration_seed(self.loop.seed, it))
        if self.ppo.filter_groups:
            ids, sids = gen_ids, gen_sids
        else:
            ids, texts, sids, metas = self._my_samples(it, self.pg.dp)
        rollout = generated
        if self.pg is not self.gen_pg:  # to the train layout's data-parallel ranks
            rollout = regroup(generated, gen_sids, self.gen_pg, sids, ids, self.generator.pad_id)
        if m.actor_gen is not None:
            offload.move_model(m.actor_gen, host)
        inferring = [x for x in (m.reference, m.reward_model, m.critic_inf) if x is not None]
        for actor in self._actors():  # the rollout's routes against the batch's first forward
            routing.arm(actor)
        with stages.stage("experience"):
            for extra_model in inferring:
                offload.move_model(extra_model, dev)
            self.maker.placed = {name: Share(self._my_samples(it, g.dp)[2] if g is not None else [])
                                 for name, g in self.model_pgs.items()}
            exp = self.maker.make(ids, texts, rollout, first_index=sids[0] if sids else 0, metas=metas,
                                  scores=scores)
            for extra_model in inferring:
                offload.move_model(extra_model, host)
        metrics = self._rollout_metrics(generated, rollout, exp)
        metrics.update(self.maker.take_mismatch())
        counts = self.maker.take_reward_stats()
        totals = runtime.all_reduce(torch.tensor([float(v) for v in counts.values()], dtype=torch.float64,
                                                  device=dev), group=self.pg.dp).tolist()
        metrics.update(dict(zip(counts, totals)), **extra)
        with stages.stage("train"):
            for t in (m.actor, m.critic):
                if t is not None:
                    offload.park_trainee(t, host=False)
            metrics.update(self._train(exp, sids, it))
            for t in (m.actor, m.critic):  # (generation and reallocation read weights directly)
                if t is not None:
                    t.gather_params()
        for actor in self._actors():
            metrics.update(routing.take_metrics(actor))
        if m.draft_on_train_layout:  # taught by the training copy, before the reallocation
            with stages.stage("draft"):
                metrics.update(self._distil(exp, m.actor.model))
        if self.reallocators:
            received = 0
            with stages.stage("reallocate"):
                for (src, copy), move in zip(m.copies(), self.reallocators):
                    offload.move_model(copy, dev)
                    received += move(src, copy).bytes_received
                    if copy is m.critic_inf:  # (it waits on the host until the next experience)
                        offload.move_model(copy, host)
            moved = runtime.all_reduce(torch.tensor([float(received)], dtype=torch.float64, device=dev))
            metrics["realloc_mb"] = float(moved) / 2**20
        if m.draft_trainee is not None and not m.draft_on_train_layout:
            with stages.stage("draft"):
                batch = exp if m.actor_gen is None else token_batch(gen_ids, generated, self.generator.pad_id)
                metrics.update(self._distil(batch, m.generating_actor))
        metrics.update(stages.metrics)
        metrics["time_iteration_s"] = sum(v for k, v in stages.metrics.items() if k.startswith("time_"))
        metrics.update(self._memory_components())
        return metrics

    def _actors(self) -> list:
        """The actor models of this rank's whole-sequence forwards (experience, training)."""
        found = [self.maker.actor, self.m.actor.model if self.m.actor is not None else None]
        return [a for i, a in enumerate(found) if a is not None and a not in found[:i]]

    def _memory_components(self) -> dict:
        """``mem_<model>_<component>_gb`` (GiB) of this rank: trainees' weights, gradients and
        optimizer states, the other models' weights; ``mem_optimizer_parked``: 1 where the
        optimizer states wait on the host during generation."""
        m, out = self.m, {"mem_optimizer_parked": int(self.park_optimizer and runtime.has_cuda())}
        for name, t in (("actor", m.actor), ("critic", m.critic)):
            if t is not None:
                out.update({f"mem_{name}_{k}_gb": v / 2**30 for k, v in offload.trainee_bytes(t).items()})
        for name, model in (("reference", m.reference), ("reward", m.reward_model), ("draft", m.draft)):
            if model is not None:
                out[f"mem_{name}_weights_gb"] = offload.storage_bytes(model.parameters()) / 2**30
        return out

    def _train(self, exp, sample_ids: list[int], it: int) -> dict:
        """PPO for the actor and the critic, each on its layout's DP ranks; their metrics, on
        every rank."""
        m, out = self.m, {}
        calls = [("actor_train", m.actor, train_actor)]
        if self.ppo.use_critic:
            calls.append(("critic_train", m.critic, train_critic))
        batches = {name: self.maker.on_layout(exp, name, sample_ids) if name in self.model_pgs else exp
                   for name, _, _ in calls}  # (collective over the world: every rank, in order)
        for name, trainee, train in calls:
            if trainee is not None:
                out.update(train(trainee, batches[name], self.ppo, horizon=self.gen.max_new_tokens,
                                 seed=iteration_seed(self.loop.seed, it)))
        if not any(name in self.model_pgs for name, _, _ in calls):
            return out
        merged = {}  # (a model's metrics are the same on every rank of its layout)
        for theirs in placement.all_gather_object(out):
            merged.update(theirs)
        return merged

    def _distil(self, batch, teacher) -> dict:
        """One distillation step of the draft towards ``teacher`` (the updated actor) on ``batch``."""
        t = self.m.draft_trainee
        offload.park_trainee(t, host=False)
        out = train_draft(t, teacher, batch, self.ppo.micro_batch_size, self.loop.draft_distill_topk)
        t.gather_params()
        return out

    def _rollout_metrics(self, generated, rollout, exp) -> dict:
        """Reward, KL and length statistics over the train layout's DP ranks, generation
        statistics over the generation layout's (``rollout``: ``generated`` regrouped)."""
        mask = exp.response_mask
        s = generated.stats
        dev, scores = mask.device, exp.scores.double()
        local = torch.cat([  # device values stay there: one host read after the reduction
            torch.stack([scores.sum(), (scores ** 2).sum(), (exp.kl * mask).sum().double(),
                         mask.sum().double()]),
            torch.tensor([exp.batch_size, sum(r == "eos" for r in rollout.finish_reasons)],
                         dtype=torch.float64, device=dev)])
        gen = torch.tensor([s.new_tokens, s.verifications, s.accepted_tokens, s.history_verifications,
                            s.history_drafted, s.history_accepted, s.actor_steps,
                            sum(s.rounds_by_draft_len[1:])], dtype=torch.float64, device=dev)
        slowest = torch.tensor([s.elapsed_s, s.idle_s, s.idle_s / max(s.elapsed_s, 1e-9),
                                s.migration_s, s.graph_capture_s, s.history_s, s.graph_captures],
                               dtype=torch.float64, device=dev)
        hist = torch.tensor(s.rounds_by_draft_len + [s.migrated_out, s.migration_bytes],
                            dtype=torch.float64, device=dev)
        local = runtime.all_reduce(local, group=self.pg.dp)
        gen = runtime.all_reduce(gen, group=self.gen_pg.dp)
        slowest = runtime.all_reduce(slowest, dist.ReduceOp.MAX, self.gen_pg.dp)
        hist = runtime.all_reduce(hist, group=self.gen_pg.dp).tolist()
        rsum, rsq, kl, tokens, n, eos = local.tolist()
        new, ver, acc, h_ver, h_drafted, h_acc, steps, drafting = gen.tolist()
        elapsed, idle, idle_frac, mig_s, capture_s, history_s, captures = slowest.tolist()
        mean = rsum / n
        return {
            "gen_rounds_by_draft_len": [int(x) for x in hist[:-2]],
            "gen_migrated": int(hist[-2]),
            "gen_migration_mb": hist[-1] / 2 / 2**20,  # counted by sender and receiver
            "gen_migration_s": mig_s,
            "gen_graph_capture_s": capture_s,
            "gen_graph_captures": int(captures),  # the most any rank made: 0 once every graph is kept
            "gen_idle_s_max": idle,
            "gen_idle_frac_max": idle_frac,
            "samples": n,
            "reward_mean": mean,
            "reward_std": math.sqrt(max(rsq / n - mean * mean, 0.0)),
            **({"kl": kl / max(tokens, 1)} if self.ppo.uses_reference else {}),
            "response_length": tokens / n,
            "eos_fraction": eos / n,
            "gen_tokens_per_s": new / max(elapsed, 1e-9),
            "accepted_length": 1.0 + acc / ver if ver else 1.0,
            "gen_draft_round_frac": drafting / max(steps, 1),
            "gen_decode": s.decode,  # the decode attention backend, and whether steps replay CUDA graphs
            **({"gen_history_accepted_length": 1.0 + h_acc / max(h_ver, 1),
                "gen_history_acceptance": h_acc / max(h_drafted, 1),
                "gen_history_s_max": history_s} if self.spec.uses_history else {}),
        }

    # ------------------------------------------------------------------ checkpoints
    def save(self, it: int) -> None:
        m = self.m
        models = {name: m.trained(name) for name in ("actor", "critic")[:1 + self.ppo.use_critic]}
        if m.draft is not None:  # (the generation copy: equal to a training copy after the reallocation)
            models["draft"] = (m.draft, self.gen_pg)
        trainees = m.trainees(self.ppo.use_critic)
        state = dict(self.run_info, consumed_prompts=it * self.ppo.global_batch_size,
                     ppo=asdict(self.ppo), loop=asdict(self.loop))
        save_training(self.save_dir, it, models, trainees, state, self.tokenizer,
                      keep_last=self.loop.keep_last_checkpoints)
