"""Experience making: a rollout -> old and reference log-probs, KL, rewards, values, advantages.

Entry point: :meth:`ExperienceMaker.make`. Every log-prob is under the sampling policy
(:mod:`.policy`), which the :class:`Experience` records for the update.
"""
# A batch goes pack (.batch) -> inference calls (here, or on their own layouts: .placement)
# -> KL (.kl) -> scores (ExperienceMaker.score) -> rewards (the scores shaped by the
# overlong penalty, ExperienceMaker.shaped) -> advantages (.advantages). Each
# data-parallel rank makes its own samples' experience; the only collectives are TP
# all-reduces, the DP-global whitening and the all-reduce that stops all ranks on a reward error.

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rlhf import runtime
from megatron_rlhf.data.padding import padded
from megatron_rlhf.config import GenerationConfig, PPOConfig, RewardConfig
from megatron_rlhf.models import routing
from megatron_rlhf.models.forward import values_of
from megatron_rlhf.models.moe import exchange_group
from megatron_rlhf.models.pipeline import map_micro_batches
from megatron_rlhf.rlhf import advantages, placement, update
from megatron_rlhf.rlhf.batch import (Experience, in_row_order, last_token_index, model_micro_batches, pack,
                                      response_slice, route_columns)
from megatron_rlhf.rlhf.chunked_head import policy_of_output
from megatron_rlhf.rlhf.kl import kl_estimate, mismatch
from megatron_rlhf.rlhf.policy import reshapes_policy
from megatron_rlhf.rlhf.rewards import RewardError, RewardInput


def per_row(model, exp: Experience, micro_batch_size: int, fn, per_token: bool = True,
            max_tokens: int | None = None) -> torch.Tensor:
    """``fn(output, mb)`` of every micro-batch of ``exp``, back in its rows: ``[B, T]`` when
    ``per_token``, else ``[B]``. ``max_tokens``: tokens per packed micro-batch
    (:func:`~.batch.model_micro_batches`; None: ``micro_batch_size`` rows' worth, 0: padded)."""
    parts, order = model_micro_batches(model, exp, micro_batch_size, max_tokens)
    outs = map_micro_batches(model, parts, fn)
    return in_row_order(outs, order, exp.response_mask.shape[1] if per_token else None)


@torch.no_grad()
def response_logprobs(model, exp: Experience, micro_batch_size: int,
                      max_tokens: int | None = None) -> torch.Tensor:
    """``[B, T]`` log-probs of the response tokens under ``exp.policy``, 0 at padding."""
    def fn(output, mb):
        return policy_of_output(model, output, mb, entropy=False)[0] * mb.response_mask
    return per_row(model, exp, micro_batch_size, fn, max_tokens=max_tokens)


def recompute_by_default(dtype: torch.dtype, policy: GenerationConfig | None) -> bool:
    """Whether log pi_old comes from a training forward when ``recompute_logprobs`` is unset."""
    # bf16: the cached decode and the full forward round differently; a tempered or
    # truncated policy: the decode's log-probs differ from the forward's by rounding
    return dtype != torch.float32 or reshapes_policy(policy)


def recomputes(cfg: PPOConfig, dtype: torch.dtype, policy: GenerationConfig | None) -> bool:
    """Whether the experience runs a forward of the actor for log pi_old."""
    if cfg.recompute_logprobs is not None:
        return cfg.recompute_logprobs
    # unset: never where the update's own forward gives them (old_from_update)
    return not cfg.old_from_update and recompute_by_default(dtype, policy)


def generation_logprobs(rollout, policy: GenerationConfig | None) -> torch.Tensor:
    """``[B, T]`` the rollout's log-probs under ``policy`` (the sampling distribution's, or
    the actor's at temperature 1)."""
    return rollout.sampling_logprobs if reshapes_policy(policy) else rollout.response_logprobs


@torch.no_grad()
def response_values(model, exp: Experience, micro_batch_size: int,
                    max_tokens: int | None = None) -> torch.Tensor:
    """``[B, T]`` critic values ``V(s_t)`` of the states before each response token."""
    def fn(output, mb):
        return response_slice(values_of(output), mb).float() * mb.response_mask
    return per_row(model, exp, micro_batch_size, fn, max_tokens=max_tokens)


@torch.no_grad()
def reward_model_scores(model, exp: Experience, micro_batch_size: int,
                        max_tokens: int | None = None) -> torch.Tensor:
    """``[B]`` a reward model's value at each response's last token."""
    def fn(output, mb):
        return values_of(output).float().gather(1, last_token_index(mb)[:, None])[:, 0]
    return per_row(model, exp, micro_batch_size, fn, per_token=False, max_tokens=max_tokens)


# the per-token fields each training call reads besides the tokens
TRAINING_INPUTS = {"actor_train": ("old_logprobs", "ref_logprobs", "advantages"),
                   "critic_train": ("values", "returns")}


class ExperienceMaker:
    """Scores and annotates rollouts with the reference, critic and reward.

    ``gen``: the sampling settings, the policy of every log-prob (None: temperature 1).
    ``actor``: recomputes old log-probs (``recompute``: None decides by :func:`recomputes`).
    ``reference``: None when no KL term reads it; ``ref_logprobs`` and ``kl`` then stay 0.
    ``mp_group``: this rank's model-parallel group (TP x PP), whose ranks must run the same rows.
    """

    def __init__(self, cfg: PPOConfig, reference, critic=None, reward_model=None,
                 reward_fn: str | None = None, tokenizer=None, pad_id: int = 0,
                 eos_id: int | None = None, dp_group=None, actor=None,
                 gen: GenerationConfig | None = None, reward: RewardConfig | None = None,
                 recompute: bool | None = None, mp_group=None):
        if (reward_model is None) == (reward_fn is None):
            raise ValueError("give exactly one of a reward model and a reward function")
        self.cfg, self.reference, self.critic = cfg, reference, critic
        self.reward_model, self.reward_fn, self.tokenizer = reward_model, reward_fn, tokenizer
        self.pad_id, self.eos_id = pad_id, eos_id
        self.dp_group, self.mp_group = dp_group, mp_group
        self.actor, self.gen = actor, gen
        self.recompute = cfg.recompute_logprobs if recompute is None else recompute
        if self.recompute is None:
            self.recompute = actor is not None and recomputes(cfg, next(actor.parameters()).dtype, gen)
        if self.recompute and actor is None:
            raise ValueError("recompute_logprobs needs the actor")
        if cfg.overlong_buffer:
            if gen is None:
                raise ValueError(f"overlong_buffer {cfg.overlong_buffer} counts back from the "
                                 "response-length limit: give the generation settings (gen)")
            cfg.check_generation(gen.max_new_tokens)
        self.reward = reward or RewardConfig()
        self.scorer = None if reward_fn is None else _scorer(reward_fn, self.reward)
        # samples given 0 for a crash or a timeout since take_reward_stats()
        self.reward_stats = {"reward_errors": 0, "reward_timeouts": 0}
        # call on a layout of its own (reference, critic, reward, actor: inference;
        # actor_train, critic_train) -> this rank's placement.Share, set per iteration
        self.placed: dict = {}
        self._tables: dict = {}
        self.mismatch: dict = {}  # the last make()'s (take_mismatch)

    def make(self, prompts: list[list[int]], prompt_texts: list[str], rollout,
             first_index: int = 0, metas: list[dict] | None = None,
             scores: torch.Tensor | None = None) -> Experience:
        """The :class:`Experience` of ``rollout``. ``prompts``, ``prompt_texts``, ``metas``: per
        sample; ``first_index``: this rank's first global sample; ``scores``: ``[B]`` the
        samples' :meth:`score` when already computed, else computed here. The rewards
        (``exp.scores``) are the scores :meth:`shaped`."""
        cfg = self.cfg
        responses = rollout.responses()
        dev = runtime.device()
        exp = self._batch(prompts, responses)
        if getattr(rollout, "routes", None) is not None and prompts:
            exp.routes = route_columns(prompts, responses, rollout.routes, exp.input_ids.shape[1], dev)
        mask = exp.response_mask
        generated = _pad_to(generation_logprobs(rollout, self.gen).float(), mask.shape[1]) * mask
        exp.old_logprobs = generated
        sample_ids = list(range(first_index, first_index + len(prompts)))
        self._tokens = placement.gather_rows(sample_ids, list(zip(prompts, responses))) if self.placed else {}
        self._tables = self._placed_tables()
        if self.reference is None and cfg.uses_reference:
            raise ValueError(f"kl_coef {cfg.kl_coef} reads a reference model: give one")
        # advantages from the scores alone: log pi_old is then needed only where the update runs
        late_old = self.recompute and self._skips_old_logprobs()
        if self.recompute and not late_old:
            with routing.measuring(self.actor):
                exp.old_logprobs = self._placed_rows("actor", exp, sample_ids)
        if self.reference is not None:  # else no KL term reads it: ref_logprobs and kl stay 0
            exp.ref_logprobs = self._placed_rows("reference", exp, sample_ids)
            exp.kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, cfg.kl_estimator) * mask
        if scores is None:
            scores = self.score(prompts, prompt_texts, rollout, first_index, metas, exp)
        exp.scores = self.shaped(scores.to(dev), mask.sum(1))
        if cfg.use_critic:
            exp.values = self._placed_rows("critic", exp, sample_ids)
        advantages.estimate(exp, cfg, group=self.dp_group)
        recomputed = mask.new_ones(mask.shape[0], dtype=torch.bool)
        if late_old:
            with routing.measuring(self.actor):
                recomputed = self._old_logprobs_where_trained(exp)
        if self.recompute:  # the trainer's log pi_old beside the generator's
            exp.rollout_logprobs = generated
            self.mismatch = mismatch(exp.old_logprobs, generated, mask * recomputed[:, None], self.dp_group)
        return exp

    def take_mismatch(self) -> dict:
        """The last :meth:`make`'s train-inference mismatch metrics (:func:`mismatch`; none
        where log pi_old came from generation), once."""
        out, self.mismatch = self.mismatch, {}
        return out

    def _skips_old_logprobs(self) -> bool:
        """Whether the old log-prob forward leaves out the rows the update skips: the actor's
        forward is here (not on a layout of its own), the update skips zero-advantage rows
        and the advantages read neither log pi_old (no KL, no critic) nor anything else."""
        cfg = self.cfg
        return ("actor" not in self.placed and update.zero_advantage_skip(cfg) is True
                and self.reference is None and not cfg.use_critic)

    def _old_logprobs_where_trained(self, exp: Experience) -> torch.Tensor:
        """log pi_old of the rows with a non-zero advantage; the others keep the rollout's,
        which nothing reads (the update leaves their micro-batches out). Returns those rows
        ``[B]`` bool."""
        train = ~update.zero_rows(exp, self.mp_group)
        if len(train) and not bool(train.any()) and exchange_group(self.actor) is not None:
            train[0] = True  # every rank of an expert exchange joins its forwards
        if bool(train.all()):
            exp.old_logprobs = self._placed_rows("actor", exp, None)
        elif bool(train.any()):
            rows = train.nonzero().flatten()
            part = exp.select(rows)
            old = self._placed_rows("actor", part, None)
            exp.old_logprobs = exp.old_logprobs.clone()
            exp.old_logprobs[rows, : old.shape[1]] = old
        return train

    def _batch(self, prompts: list[list[int]], responses: list[list[int]]) -> Experience:
        """An Experience of token lists, every per-token field zero."""
        ids, att, mask = pack(prompts, responses, self.pad_id, runtime.device())
        zeros = torch.zeros_like(mask)
        return Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=zeros,
                          ref_logprobs=zeros, scores=torch.zeros(len(prompts), device=mask.device),
                          kl=zeros, advantages=zeros, policy=self.gen)

    def _placed_tables(self) -> dict[str, dict]:
        """Call -> {global sample index: row or scalar} of the inference calls on layouts of
        their own; collective over the world."""
        # every call computes before one exchange, so calls on disjoint ranks overlap
        models = self._inference_calls()
        mine = {}
        for name, share in self.placed.items():
            if name not in models or not share.sample_ids:
                continue
            model, compute = models[name]
            theirs = [self._tokens[s] for s in share.sample_ids]
            out = compute(model, self._batch([p for p, _ in theirs], [r for _, r in theirs]),
                          self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)
            host = out.detach().cpu()  # one copy to the host; rows cloned (a pickled view carries its storage)
            mine[name] = (share.sample_ids, [(host[i, : len(r)] if host.dim() == 2 else host[i]).clone()
                                             for i, (_, r) in enumerate(theirs)])
        # (every rank has the same calls in ``placed``: all of them exchange, or none)
        return placement.gather_tables(mine) if any(n in models for n in self.placed) else {}

    def _inference_calls(self) -> dict:
        """Inference call -> (its model, its per-sample function)."""
        return {"reference": (self.reference, response_logprobs), "critic": (self.critic, response_values),
                "reward": (self.reward_model, reward_model_scores), "actor": (self.actor, response_logprobs)}

    def _placed_rows(self, name: str, exp: Experience, sample_ids) -> torch.Tensor:
        """Inference call ``name``'s results for this rank's samples (computed here, or
        brought back by :meth:`_placed_tables`)."""
        if name not in self.placed:
            model, compute = self._inference_calls()[name]
            return compute(model, exp, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)
        mine = [self._tables[name][s] for s in sample_ids]
        if mine[0].dim() == 0:
            return torch.stack(mine).to(exp.response_mask.device)
        return padded(mine, 0, mine[0].dtype, width=exp.response_mask.shape[1])

    def on_layout(self, exp: Experience, name: str, sample_ids: list[int]) -> Experience:
        """The batch training call ``name`` trains on, on its own layout (None outside it);
        collective over the world."""
        share, fields = self.placed[name], TRAINING_INPUTS[name]
        if name == "actor_train" and self.cfg.rollout_is_cap:
            fields += ("rollout_logprobs",)
        host = {f: getattr(exp, f).detach().cpu() for f in fields}
        rows = [(self._tokens[s], [host[f][i, :len(self._tokens[s][1])].clone() for f in fields])
                for i, s in enumerate(sample_ids)]
        table = placement.gather_rows(sample_ids, rows)
        if not share.sample_ids:
            return None
        theirs = [table[s] for s in share.sample_ids]
        batch = self._batch([tok[0] for tok, _ in theirs], [tok[1] for tok, _ in theirs])
        width = batch.response_mask.shape[1]
        for j, f in enumerate(fields):
            setattr(batch, f, padded([cols[j] for _, cols in theirs], 0, host[f].dtype, width=width))
        return batch

    def take_reward_stats(self) -> dict:
        """The counts of :attr:`reward_stats`, which start again from zero."""
        out, self.reward_stats = self.reward_stats, dict.fromkeys(self.reward_stats, 0)
        return out

    def score(self, prompts, prompt_texts, rollout, first_index: int = 0, metas=None,
              exp=None) -> torch.Tensor:
        """``[B]`` scores of a rollout's samples by the reward function or model, before any
        shaping (what --filter-groups judges and evaluation reports); collective over the world."""
        # A reward model needs the packed ``exp``. Every rank stops together on a reward error.
        responses = rollout.responses()
        if exp is None and self.reward_model is not None:
            exp = self._batch(prompts, responses)
        return self._scores(exp, prompts, prompt_texts, responses, rollout, first_index,
                            metas or [{}] * len(prompts))

    def shaped(self, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``[B]`` the rewards the advantages see: ``scores`` [B] plus the soft overlong
        penalty of the responses' ``lengths`` [B] when ``overlong_buffer`` is set."""
        if not self.cfg.overlong_buffer:
            return scores
        return scores + overlong_penalty(lengths.to(scores.device), self.gen.max_new_tokens,
                                         self.cfg.overlong_buffer, self.cfg.overlong_penalty)

    def _scores(self, exp, prompts, prompt_texts, responses, rollout, first_index, metas):
        error, failed = None, 0
        try:
            if self.reward_model is not None:
                sample_ids = list(range(first_index, first_index + len(prompts)))
                scores = self._placed_rows("reward", exp, sample_ids)
                bad = (~torch.isfinite(scores)).nonzero()
                if len(bad):
                    raise RewardError(f"the reward model returned {scores[bad[0, 0]].item()} for "
                                      f"sample {first_index + int(bad[0, 0])}")
            else:
                samples = [
                    RewardInput(prompt=text, response=self.tokenizer.decode(r, skip_special_tokens=True)
                                if self.tokenizer is not None else "",
                                prompt_ids=p, response_ids=r, finish_reason=reason,
                                eos_token_id=self.eos_id, meta=meta,
                                answer=meta.get(self.reward.answer_key))  # the ground truth, read once here
                    for p, text, r, reason, meta in zip(prompts, prompt_texts, responses,
                                                        rollout.finish_reasons, metas)
                ]
                scores, counts = self.scorer(samples, first_index)
                for name in self.reward_stats:
                    self.reward_stats[name] += int(counts.get(name, 0))
                failed = int(counts["reward_errors"] + counts["reward_timeouts"])
        except RewardError as e:
            error, scores = e, torch.zeros(len(prompts), device=runtime.device())
        guarded = self.reward_fn if not self.reward.tolerate_reward_errors else None
        _stop_together(error, len(prompts), failed, guarded)
        return scores


def _scorer(name: str, cfg: RewardConfig):
    from megatron_rlhf.rlhf.rewards import RewardScorer

    return RewardScorer(name, timeout_s=cfg.reward_timeout, workers=cfg.reward_workers,
                        strict=cfg.strict_rewards, answer_key=cfg.answer_key)


def overlong_penalty(lengths: torch.Tensor, limit: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, ``[B]`` and <= 0, to add to the scores: 0 up to
    ``limit - buffer`` response tokens, then falling linearly to ``-penalty`` at ``limit``."""
    over = (lengths.float() - (limit - buffer)).clamp(min=0)
    return -penalty * (over / buffer).clamp(max=1)


def _stop_together(error: Exception | None, scored: int = 0, failed: int = 0,
                   fn_name: str | None = None) -> None:
    """Raise on every rank of the world if any rank failed (or, with ``fn_name``, if every one
    of the world's ``scored`` samples ``failed``)."""
    # Every rank raises, so none waits forever in a collective. A sample failed when its
    # reward raised, returned a non-number or timed out.
    total = runtime.all_reduce(torch.tensor([0 if error is None else 1, scored, failed],
                                            device=runtime.device()), dist.ReduceOp.SUM).tolist()
    if error is not None:
        raise error
    if total[0]:
        raise RewardError("the reward failed on another rank (its message is above)")
    if fn_name is not None and total[1] and total[2] == total[1]:
        raise RewardError(f"reward function {fn_name!r} failed on every one of the {total[1]} samples "
                          "(the first failure of each kind is printed above); "
                          "--tolerate-reward-errors trains on with rewards of 0")


def _pad_to(x: torch.Tensor, t: int) -> torch.Tensor:
    if x.shape[1] >= t:
        return x[:, :t]
    return torch.nn.functional.pad(x, (0, t - x.shape[1]))
