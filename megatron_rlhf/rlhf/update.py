"""PPO updates of the actor and the critic over one iteration's experience.

Entry points: :func:`train_actor`, :func:`train_critic`, :func:`train_draft`.
"""
# Each PPO epoch splits this rank's samples into num_mini_batches mini-batches (one optimizer
# step each) of accumulated micro-batches. Per-token losses are weighted over the mini-batch's
# tokens on *all* data-parallel ranks, so the update equals one rank holding the whole batch.
# The actor trains as the policy its samples were drawn from (exp.policy, .policy).
# Rows whose advantages are all exactly 0, with no other loss term, add exact zeros to the
# gradients: their micro-batches are left out, the weights' normalisers still count them.

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_rlhf import runtime
from megatron_rlhf.config import PPOConfig
from megatron_rlhf.models import routing
from megatron_rlhf.models.forward import values_of
from megatron_rlhf.models.moe import RouterStats
from megatron_rlhf.models.pipeline import forward_backward, from_last_stage, model_output
from megatron_rlhf.rlhf.batch import Experience, model_micro_batches, response_slice
from megatron_rlhf.rlhf.chunked_head import policy_of_output
from megatron_rlhf.rlhf.kl import kl_estimate
from megatron_rlhf.rlhf.losses import policy_loss, value_loss
from megatron_rlhf.rlhf.optim import Trainee


@dataclass
class _Sums:
    """Token-weighted sums of per-token metrics and their token counts, reduced over DP at
    the end."""

    values: dict = field(default_factory=dict)  # name -> sum
    counts: dict = field(default_factory=dict)  # name -> tokens (or rows) summed over

    def add(self, name: str, per_token: torch.Tensor, mask: torch.Tensor) -> None:
        # stays on the device: no sync per micro-batch
        self.add_total(name, (per_token.detach().double() * mask).sum(), mask.sum())

    def add_total(self, name: str, total: torch.Tensor, count: torch.Tensor) -> None:
        for d, v in ((self.values, total.double()), (self.counts, count.double())):
            d[name] = v + d[name] if name in d else v

    def means(self, group) -> dict:
        names = sorted(self.values)
        dev = self.values[names[0]].device
        t = torch.stack([torch.stack([self.values[n], self.counts[n]]).to(dev) for n in names])
        t = runtime.all_reduce(t, group=group)  # [metrics, 2]
        return dict(zip(names, (t[:, 0] / t[:, 1].clamp(min=1)).tolist()))


def _global_tokens(mask: torch.Tensor, group) -> torch.Tensor:
    return runtime.all_reduce(mask.sum().double(), group=group).clamp(min=1)


def loss_weights(mask: torch.Tensor, agg: str, group, horizon: int | None = None) -> torch.Tensor:
    """``[b, T]`` per-token weights of aggregation ``agg`` whose weighted loss has, summed over
    the data-parallel ``group``, the whole batch's gradients; ValueError for an unknown ``agg``."""
    # token-mean: mask / (tokens on all ranks); seq-mean-token-mean: mask / (own length x
    # responses on all ranks); seq-mean-token-sum-norm (Dr. GRPO): mask / (horizon x responses),
    # horizon the response-length limit, so no response's tokens count more for being short
    mask = mask.float()
    if agg == "token-mean":
        return mask / _global_tokens(mask, group).float()
    # (the responses with a token: a dropped one's mask is all 0)
    seqs = runtime.all_reduce((mask.sum(-1) > 0).sum().double(), group=group).clamp(min=1).float()
    if agg == "seq-mean-token-mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1) * seqs)
    if agg == "seq-mean-token-sum":  # verl's: a response's token sum, mean over responses on all ranks
        return mask / seqs
    if agg == "seq-mean-token-sum-norm":
        if not horizon:
            raise ValueError("seq-mean-token-sum-norm needs the response-length limit (horizon)")
        return mask / (float(horizon) * seqs)
    raise ValueError(f"unknown loss aggregation {agg!r}")


def _mini_batches(exp: Experience, cfg: PPOConfig, epoch: int, seed: int | None) -> list[Experience]:
    """This epoch's mini-batches, in a fresh seeded order when there are several."""
    if seed is not None and cfg.num_mini_batches > 1:
        g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))
        exp = exp.select(torch.randperm(exp.batch_size, generator=g).to(exp.input_ids.device))
    return exp.split(exp.batch_size // cfg.num_mini_batches)


def _ppo_passes(t: Trainee, exp: Experience, cfg: PPOConfig, name: str, micro_loss,
                agg: str = "token-mean", horizon: int | None = None, seed: int | None = None,
                skip: bool | None = None) -> dict:
    """PPO epochs x mini-batches x micro-batches; returns token-mean metrics over all ranks.

    ``micro_loss(output, mb, sums)``: a micro-batch's per-token loss ``[b, T]`` (weighted by
    :func:`loss_weights` of ``agg``), adding its metrics to ``sums``. ``skip`` (the actor's
    :func:`zero_advantage_skip`; None: rows are not told apart): whether the micro-batches of
    zero-advantage rows only are left out; then ``skipped_fraction`` is reported."""
    # One optimizer step per mini-batch; micro-batches accumulate, pipelined where the model
    # is a pipeline stage.
    t.model.train()
    sums, norms = _Sums(), []
    routes = RouterStats(t.model)  # (an MoE's expert loads; nothing for a dense model)
    with routes:
        _passes(t, exp, cfg, micro_loss, agg, horizon, seed, skip, sums, norms)
    sums.values, sums.counts = from_last_stage(t.model, [sums.values, sums.counts])
    out = sums.means(t.pg.dp)
    out[f"{name}_grad_norm"] = sum(norms) / len(norms)
    out.update(routes.metrics(f"{name}_moe"))
    return out


def _passes(t: Trainee, exp: Experience, cfg: PPOConfig, micro_loss, agg, horizon, seed, skip,
            sums: "_Sums", norms: list) -> None:
    """:func:`_ppo_passes`'s loops: metrics into ``sums``, each step's gradient norm into ``norms``."""
    for epoch in range(cfg.ppo_epochs):
        for mini in _mini_batches(exp, cfg, epoch, seed):
            # the weights' normalisers count every row, skipped or not, but those dropped
            zero = zero_rows(mini, t.pg.mp) if cfg.drop_zero_advantage or skip is not None else None
            counted = mini.response_mask
            if cfg.drop_zero_advantage:
                counted = counted * ~zero[:, None]
            mini.loss_weights = loss_weights(counted, agg, t.pg.dp, horizon)
            run, left_out = _micro_batches(t.model, mini, cfg, skip, zero)
            with routing.measuring(t.model):  # (the batch's first forward, unless the experience's was)
                forward_backward(t.model, run, lambda out, mb: (micro_loss(out, mb, sums) * mb.loss_weights).sum(),
                                 t.accumulating)
            norms.append(t.step())
            zero = mini.response_mask.new_zeros(())
            for mb in left_out:  # metrics exactly 0 on a zero-advantage row count its tokens
                for metric in _ZERO_WHEN_SKIPPED:
                    sums.add_total(metric, zero, mb.response_mask.sum())
            if skip is not None:
                rows = torch.tensor([sum(mb.batch_size for mb in left_out), mini.batch_size],
                                    device=zero.device)
                sums.add_total("skipped_fraction", rows[0], rows[1])


# The policy metrics that are exactly 0 on a row of zero advantages (no ratio term, no clip);
# with the skip they count the skipped rows' tokens, the others (entropy, approx_kl) only
# those computed.
_ZERO_WHEN_SKIPPED = ("policy_loss", "clip_frac")


def zero_advantage_skip(cfg: PPOConfig) -> bool | None:
    """Whether the actor's update leaves out the rows whose advantages are all exactly 0
    (``cfg.skip_zero_advantage``); None where such a row has a loss anyway (an entropy bonus,
    a KL loss term, a router's auxiliary loss)."""
    # With A = 0 at every token the clipped surrogate is exactly 0 and so is its gradient:
    # max(-0 r, -0 clip(r)), and dual clip's cap (-0 C) is only taken for A < 0.
    if cfg.entropy_coef or (cfg.kl_in_loss and cfg.kl_coef) or cfg.moe_aux_loss_coeff or cfg.moe_z_loss_coeff:
        return None
    return cfg.skip_zero_advantage


def zero_rows(exp: Experience, mp_group) -> torch.Tensor:
    """``[b]`` bool: the rows whose advantages are all exactly 0, agreed over ``mp_group``."""
    zero = ((exp.advantages == 0) | (exp.response_mask == 0)).all(-1)
    # every stage and TP rank of this DP rank must run the same micro-batches
    return runtime.all_reduce(zero.int(), op=dist.ReduceOp.MIN, group=mp_group) > 0


def _micro_batches(model, mini: Experience, cfg: PPOConfig, skip: bool | None,
                   zero: torch.Tensor | None) -> tuple[list[Experience], list[Experience]]:
    """``(to run, left out)``: ``mini``'s micro-batches (:func:`~.batch.model_micro_batches`
    of ``cfg``'s size and token budget); with ``skip`` not None the rows of
    zero advantage (``zero``: :func:`zero_rows`) come last, and with ``skip`` the micro-batches of
    those rows only are left out (but one: every rank runs a backward, which reduces the gradients over DP)."""
    # Bitwise exact: the rows run in the same micro-batches (same widths, same order) skip on
    # or off, and a micro-batch left out would have added exact zeros to the fp32 gradients.
    # The zero rows fill micro-batches of their own (one more micro-batch at most, where the
    # kinds meet), so that all of them can be left out.
    size, budget = cfg.micro_batch_size, cfg.max_tokens_per_micro_batch
    if skip is None:
        return model_micro_batches(model, mini, size, budget)[0], []
    parts = model_micro_batches(model, mini, size, budget, last=zero)[0]
    if not skip:
        return parts, []
    keep, rest = len(parts), int(zero.sum())  # the zero rows: the last `rest` over the parts
    while keep and parts[keep - 1].batch_size <= rest:
        keep -= 1
        rest -= parts[keep].batch_size
    if not keep:  # all zero: the shortest runs
        return parts[-1:], parts[:-1]
    return parts[:keep], parts[keep:]


def policy_from_output(actor, output, mb: Experience,
                       with_entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log pi(a_t | s_t), entropy)``, both ``[b, T]``, of the actor's raw output under
    ``mb.policy``; the entropy outside autograd unless ``with_entropy_grad``."""
    return policy_of_output(actor, output, mb, entropy_grad=with_entropy_grad)


def policy_forward(actor, mb: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`policy_from_output` of the actor's forward over ``mb`` (no pipeline)."""
    return policy_from_output(actor, model_output(actor, mb), mb)


def _policy_loss(actor, output, mb: Experience, cfg: PPOConfig, sums: _Sums) -> torch.Tensor:
    mask = mb.response_mask
    logp, entropy = policy_from_output(actor, output, mb, with_entropy_grad=bool(cfg.entropy_coef))
    # one optimizer step per iteration: pi_old is the policy being updated (ratio exactly 1)
    old = logp.detach() if cfg.old_from_update else mb.old_logprobs
    pg_loss, clipped = policy_loss(logp, old, mb.advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    if cfg.rollout_is_cap:  # the generator sampled: weigh by min(pi_old / pi_generator, C)
        weight = torch.exp(mb.old_logprobs - mb.rollout_logprobs).clamp(max=cfg.rollout_is_cap)
        pg_loss = pg_loss * weight
        sums.add("rollout_is_weight", weight, mask)
    loss = pg_loss
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * entropy
    if cfg.kl_in_loss and cfg.kl_coef:  # grpo: KL to the reference as a loss term
        kl = kl_estimate(logp, mb.ref_logprobs, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
        sums.add("kl_loss", kl, mask)
    sums.add("policy_loss", pg_loss, mask)
    sums.add("clip_frac", clipped.float(), mask)
    sums.add("entropy", entropy, mask)
    sums.add("approx_kl", 0.5 * (logp.detach() - old) ** 2, mask)
    return loss


def _policy_micro(actor, mb: Experience, cfg: PPOConfig, sums: _Sums) -> torch.Tensor:
    """The per-token PPO loss of one micro-batch (no pipeline)."""
    return _policy_loss(actor, model_output(actor, mb), mb, cfg, sums)


def _value_loss(output, mb: Experience, cfg: PPOConfig, sums: _Sums) -> torch.Tensor:
    v = response_slice(values_of(output), mb)
    loss, clipped = value_loss(v.float(), mb.values, mb.returns, cfg.value_clip_eps or None)
    sums.add("value_loss", loss, mb.response_mask)
    sums.add("value_clip_frac", clipped.float(), mb.response_mask)
    return loss


def train_actor(t: Trainee, exp: Experience, cfg: PPOConfig, horizon: int | None = None,
                seed: int | None = None) -> dict:
    """PPO epochs over ``exp`` for the actor; token-mean metrics over all ranks. ``horizon``:
    the response-length limit (seq-mean-token-sum-norm); ``seed``: the mini-batches' order."""
    out = _ppo_passes(t, exp, cfg, "actor", lambda out, mb, sums: _policy_loss(t.model, out, mb, cfg, sums),
                      agg=cfg.loss_agg, horizon=horizon, seed=seed, skip=zero_advantage_skip(cfg))
    out["actor_lr"] = t.scheduler.current_lr
    return out


def train_critic(t: Trainee, exp: Experience, cfg: PPOConfig, horizon: int | None = None,
                 seed: int | None = None) -> dict:
    """Clipped value-loss epochs over ``exp`` for the critic (token-mean)."""
    return _ppo_passes(t, exp, cfg, "critic", lambda out, mb, sums: _value_loss(out, mb, cfg, sums),
                       seed=seed)


def train_draft(t: Trainee, actor, exp: Experience, micro_batch_size: int, topk: int) -> dict:
    """One distillation step of the draft towards ``actor``'s top-``topk`` distribution;
    returns ``draft_kl`` (and ``draft_feature_loss``)."""
    # Forward KL at each response position (megatron_rlhf.generation.draft).
    # a feature draft also regresses its hidden states onto the actor's, from the same forward
    from megatron_rlhf.generation.draft import (
        feature_loss, head_logits, target_logits_and_features, teacher_topk, topk_distill_loss)

    head = getattr(t.model.output_layer, "token_ids", None)
    feature = t.model.mrlhf_config.feature_draft
    t.model.train()
    tokens = _global_tokens(exp.response_mask, t.pg.dp)
    sums = torch.zeros(2, dtype=torch.float64, device=exp.response_mask.device)  # KL, regression
    micro_batches = exp.micro_batches(micro_batch_size)[0]
    for i, mb in enumerate(micro_batches):
        mask = mb.response_mask
        with torch.no_grad():
            full, feats = target_logits_and_features(actor, mb.input_ids, mb.attention_mask)
            index, logp = teacher_topk(response_slice(full, mb), mask, head, topk)
            del full
        share = mask.sum() / tokens  # token-mean over the whole batch on all ranks
        out = head_logits(t.model, mb.input_ids, mb.attention_mask, features=feats if feature else None,
                          return_features=feature)
        logits, hidden = out if feature else (out, None)
        kl = topk_distill_loss(response_slice(logits, mb), mask, index, logp) * share
        reg = (feature_loss(response_slice(hidden, mb), response_slice(feats, mb), mask) * share
               if feature else torch.zeros_like(kl))  # on kl's device: both are stacked below
        with t.accumulating(i == len(micro_batches) - 1):
            (kl + reg).backward()
        sums += torch.stack([kl.detach(), reg.detach()]).double()
    t.step()
    kl, reg = runtime.all_reduce(sums, group=t.pg.dp).tolist()
    out = {"draft_kl": kl}
    if feature:
        out["draft_feature_loss"] = reg
    return out
