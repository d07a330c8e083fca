"""Under torchrun (2 ranks, DP=2): megatron's overlapped gradient reduction.

With ``overlap_grad_reduce`` a bucket's reduction starts during the backward of the last
micro-batch of a step (from the second step on: the first one counts which parameters get
gradients), never during an earlier one, and the updates equal those without overlap.
(Megatron starts a bucket once every parameter has reported as often as in the first
step, so with a fixed number of micro-batches this holds even without ``no_sync``;
``Trainee.accumulating`` uses it anyway, as megatron's protocol asks, so that a step with
another number of micro-batches cannot start early. On gloo the collective runs when it
is waited for, so equality alone could not see an early start; the counts can.)"""

import contextlib

import torch
import torch.distributed as dist

from megatron_rlhf import runtime
from megatron_rlhf.config import GenerationConfig, OptimConfig, preset
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import lm_logits
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.rlhf.optim import build_trainee


PROMPTS = [[5, 17, 33], [4, 8, 15, 16]]


def train(pg, overlap: bool, steps: list | None = None):
    """``steps``: gets the weights after each step."""
    model = build_model(preset("tiny"), "actor", pg, dtype=torch.float32, seed=3)
    t = build_trainee(model, pg, OptimConfig(lr=1e-2, overlap_grad_reduce=overlap), 1e-2)
    started = []
    for group in t.ddp.bucket_groups:
        def counted(*a, _start=group.start_grad_sync, **k):
            started.append(1)
            return _start(*a, **k)
        group.start_grad_sync = counted
    g = torch.Generator().manual_seed(dist.get_rank())
    during = []  # syncs started by each micro-batch's backward
    for _ in range(3):
        for i in range(3):
            ids = torch.randint(2, 200, (2, 8), generator=g)
            before = len(started)
            with t.accumulating(i == 2):
                lm_logits(model, ids, torch.ones_like(ids)).log_softmax(-1)[..., 3].mean().backward()
            during.append(len(started) - before)
        t.step()
        t.gather_params()  # (overlap_param_gather is on by default with overlap_grad_reduce)
        if steps is not None:
            steps.append([p.detach().clone() for p in model.parameters()])
    return [p.detach().clone() for p in model.parameters()], during, len(t.ddp.bucket_groups)


def train_gathering(pg, ref_steps):
    """Overlapped gradient reduction and parameter gather; checks against the weights of
    the unoverlapped run after each step (``ref_steps``)."""
    model = build_model(preset("tiny"), "actor", pg, dtype=torch.float32, seed=3)
    t = build_trainee(model, pg, OptimConfig(lr=1e-2, overlap_grad_reduce=True,
                                             overlap_param_gather=True), 1e-2)
    assert t.ddp.ddp_config.overlap_param_gather
    # the trainee generates (one layout) with megatron's pre-hooks on its modules: the first
    # forward dispatches the (initial) gather; tokens equal a model outside DDP
    cfg = GenerationConfig(max_new_tokens=6, temperature=0)
    plain = build_model(preset("tiny"), "actor", pg, dtype=torch.float32, seed=3)
    assert Generator(model).generate(PROMPTS, cfg).responses() == \
        Generator(plain).generate(PROMPTS, cfg).responses()
    gathers = []
    for group in t.ddp.bucket_groups:
        def counted(*a, _start=group.start_param_sync, **k):
            gathers.append(k.get("force_sync", False))
            return _start(*a, **k)
        group.start_param_sync = counted
    g = torch.Generator().manual_seed(dist.get_rank())
    stale = 0
    for step, ref in enumerate(ref_steps):
        for i in range(3):
            ids = torch.randint(2, 200, (2, 8), generator=g)
            before = len(gathers)
            with t.accumulating(i == 2):
                lm_logits(model, ids, torch.ones_like(ids)).log_softmax(-1)[..., 3].mean().backward()
            if i == 0 and step > 0:  # the first forward after a step gathered every bucket
                assert gathers[before:] == [False] * len(t.ddp.bucket_groups), gathers[before:]
        t.step()
        assert t.params_pending
        now = [p.detach().clone() for p in model.parameters()]
        stale += sum(not torch.equal(a, b) for a, b in zip(now, ref))
        if step == len(ref_steps) - 1:
            t.gather_params()
            assert not t.params_pending
            for a, b in zip(ref, model.parameters()):
                assert torch.equal(a, b)
    return stale


def main():
    runtime.quiet_third_party_warnings()
    rank, _ = runtime.init_distributed()
    pg = build_process_groups(Layout(dp=2))
    ref_steps = []
    ref, during, _ = train(pg, overlap=False, steps=ref_steps)
    assert sum(during) == 0  # without overlap: all in finish_grad_sync
    weights, during, buckets = train(pg, overlap=True)
    assert during == [0, 0, 0] + [0, 0, buckets] * 2, during
    for a, b in zip(ref, weights):
        assert torch.equal(a, b)
    stale = train_gathering(pg, ref_steps)
    assert stale > 0, "no parameter was stale after a step: the gather was not overlapped"
    if rank == 0:
        print("OK", stale, "stale parameters read before their gather")
    runtime.shutdown()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
