"""The fine-tuning loop (SFT, reward model, DPO) on megatron-core's DDP and optimizer.

Entry point: :meth:`FinetuneTrainer.run`. Invariants: a step's records are a pure function of
seed and step (a resumed run repeats the uninterrupted one), and the update does not depend
on the data-parallel size. Held-out records are evaluated before the first step, every
``eval_interval`` steps and at the end.
"""

from __future__ import annotations

import time

import torch

from megatron_rlhf import runtime
from megatron_rlhf.config import FinetuneConfig
from megatron_rlhf.data.sampler import batch_indices
from megatron_rlhf.finetune import data as D
from megatron_rlhf.finetune import losses as L
from megatron_rlhf.models.builder import check_mask_honoured
from megatron_rlhf.models.forward import logits_of, values_of


def forward(model, batch: D.TokenBatch):
    """The model's raw output ``[B, T, ...]`` for rows that may hold several examples."""
    check_mask_honoured(model)
    positions, mask = D.segment_inputs(batch.segments)
    return model(batch.input_ids, positions, mask)


class FinetuneTrainer:
    """Runs steps ``start+1 .. cfg.train_iters`` of one fine-tuning stage."""

    def __init__(self, cfg: FinetuneConfig, trainee, train: list, held_out: list, pg, pad_id: int,
                 reference=None, log=None, save=None, start: int = 0):
        self.cfg, self.t, self.pg, self.pad_id = cfg, trainee, pg, pad_id
        self.train, self.held_out = train, held_out
        self.reference = reference
        self.log, self.save, self.start = log, save, start
        self.history: list[dict] = []

    # ------------------------------------------------------------------ one step
    def _mine(self, items: list, indices: list[int]) -> list:
        dp, rank = self.pg.dp.size(), self.pg.dp.rank()
        per = len(indices) // dp
        return [items[i] for i in indices[rank * per:(rank + 1) * per]]

    def _micro_batches(self, records: list) -> list[D.TokenBatch]:
        m = self.cfg.micro_batch_size
        out = []
        for i in range(0, len(records), m):
            chunk = records[i:i + m]
            if self.cfg.loss == "sft":
                rows = D.pack(chunk, self.cfg.seq_length if self.cfg.pack else None)
            else:  # m pairs are 2m rows, chosen and rejected interleaved
                rows = [[e] for pair in chunk for e in pair]
            out.append(D.token_batch(rows, self.pad_id))
        return out

    def _denominator(self, records: list) -> torch.Tensor:
        """The step's targets on all ranks: response tokens (SFT) or pairs."""
        # Losses are sums over targets divided by this: the update is that of DP=1.
        local = sum(e.targets for e in records) if self.cfg.loss == "sft" else len(records)
        return runtime.all_reduce(torch.tensor(float(local), dtype=torch.float64,
                                                device=runtime.device()), group=self.pg.dp)

    def _loss(self, out, mb: D.TokenBatch, sums: dict):
        """Sum of this micro-batch's per-target losses (and metric sums into ``sums``)."""
        model = self.t.model
        if self.cfg.loss == "sft":
            loss, count = L.sft_loss(logits_of(model, out), mb.input_ids, mb.loss_mask)
            _add(sums, loss=loss, tokens=count)
            return loss
        if self.cfg.loss == "bradley-terry":
            rewards = values_of(out).reshape(-1)[mb.last].float()  # [2P]
            chosen, rejected = rewards[0::2], rewards[1::2]
            per_pair = L.bradley_terry_loss(chosen, rejected)
        else:
            seq = self._sequence_logprobs(model, out, mb)  # [2P]
            ref = mb.ref  # [2P] (_reference_logprobs)
            per_pair, chosen, rejected = L.dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2],
                                                    self.cfg.beta, self.cfg.label_smoothing)
        _add(sums, loss=per_pair.sum(), pairs=float(per_pair.numel()),
             correct=(chosen > rejected).float().sum(), margin=(chosen - rejected).sum())
        return per_pair.sum()

    @staticmethod
    def _sequence_logprobs(model, out, mb: D.TokenBatch) -> torch.Tensor:
        """``[rows]`` summed log-probs of each row's response tokens (one example per row)."""
        return L.sequence_logprobs(logits_of(model, out), mb.input_ids, mb.loss_mask)

    @torch.no_grad()
    def _reference_logprobs(self, mbs: list[D.TokenBatch]) -> None:
        """DPO: the frozen reference scores every micro-batch into ``mb.ref``."""
        # Then it waits in pinned host memory while the policy trains, as PPO's reference does.
        from megatron_rlhf.rlhf import offload

        offload.move_model(self.reference, runtime.device())
        for mb in mbs:
            mb.ref = self._sequence_logprobs(self.reference, forward(self.reference, mb), mb)
        offload.move_model(self.reference, torch.device("cpu"))

    def step(self, it: int) -> dict:
        cfg, t = self.cfg, self.t
        start = time.perf_counter()
        records = self._mine(self.train, batch_indices(len(self.train), cfg.global_batch_size, it, cfg.seed))
        denom = self._denominator(records)
        t.model.train()
        sums: dict = {}
        mbs = self._micro_batches(records)
        if cfg.loss == "dpo":
            self._reference_logprobs(mbs)
        for i, mb in enumerate(mbs):
            with t.accumulating(i == len(mbs) - 1):
                (self._loss(forward(t.model, mb), mb, sums) / denom).backward()
        grad_norm = t.step()
        metrics = self._means(sums, prefix="")
        metrics.update(grad_norm=grad_norm, lr=t.scheduler.current_lr,
                       time_step_s=time.perf_counter() - start)
        return metrics

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out metrics over all DP ranks, every record once: SFT loss per token, else
        pairwise accuracy (the chosen response scores higher) and margin."""
        if not self.held_out:
            return {}
        self.t.model.eval()
        dp, rank = self.pg.dp.size(), self.pg.dp.rank()
        mine = self.held_out[rank::dp]
        sums: dict = {}
        mbs = self._micro_batches(mine)
        if self.cfg.loss == "dpo":
            self._reference_logprobs(mbs)
        for mb in mbs:
            self._loss(forward(self.t.model, mb), mb, sums)
        return self._means(sums, prefix="eval_")

    def _means(self, sums: dict, prefix: str) -> dict:
        """Sums of every rank -> means per target (one reduction, one host read)."""
        names = sorted(sums)
        if not names:
            return {}
        vals = runtime.all_reduce(torch.stack([torch.as_tensor(sums[n], dtype=torch.float64,
                                                                device=runtime.device())
                                                for n in names]), group=self.pg.dp)
        s = dict(zip(names, vals.tolist()))
        if self.cfg.loss == "sft":
            return {f"{prefix}loss": s["loss"] / max(s["tokens"], 1), f"{prefix}tokens": s["tokens"]}
        n = max(s["pairs"], 1)
        return {f"{prefix}loss": s["loss"] / n, f"{prefix}accuracy": s["correct"] / n,
                f"{prefix}margin": s["margin"] / n}

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[dict]:
        cfg = self.cfg
        before = {}
        if self.start == 0:  # the baseline, logged with the first step as initial_eval_*
            before = {k.replace("eval_", "initial_eval_"): v for k, v in self.evaluate().items()}
        for it in range(self.start + 1, cfg.train_iters + 1):
            metrics = self.step(it)
            if it == 1:
                metrics.update(before)
            if (cfg.eval_interval and it % cfg.eval_interval == 0) or it == cfg.train_iters:
                metrics.update(self.evaluate())
            self.history.append(metrics)
            if self.log is not None:
                self.log.write(it, metrics)
            if self.save is not None and (it == cfg.train_iters
                                          or (cfg.save_interval and it % cfg.save_interval == 0)):
                self.save(it)
        if self.log is not None:
            self.log.close()
        return self.history


def _add(sums: dict, **values) -> None:
    for k, v in values.items():
        v = v.detach().double() if torch.is_tensor(v) else torch.tensor(
            float(v), dtype=torch.float64, device=runtime.device())
        sums[k] = v + sums[k].to(v.device) if k in sums else v
