"""The plan package asked about a run: the layouts of ``--plan FILE`` or ``--plan auto``
(:func:`execution_plan`, the search of :mod:`megatron_rlhf.plan.search` over this world
and these models). Deterministic and without collectives: every rank computes the same.
"""

from __future__ import annotations

import os
import sys

import torch

from megatron_rlhf.config import GenerationConfig, LoopConfig, ParallelConfig, PPOConfig, SpecConfig


def execution_plan(par: ParallelConfig, infos: dict, ppo: PPOConfig, loop: LoopConfig,
                   gen: GenerationConfig, spec: SpecConfig, dtype: torch.dtype,
                   world_size: int, prompt_len: int | None = None) -> ParallelConfig:
    """``par`` with the layouts of ``--plan FILE`` (a plan from ``tools/plan.py --out``) or
    of ``--plan auto``: the plan search (:mod:`megatron_rlhf.plan.search`) over what this
    trainer executes (``space="models"``), on this world and these models, priced with ``--plan-hardware``.
    Every rank computes the same plan (the search is deterministic); no collectives."""
    import dataclasses

    from megatron_rlhf.plan import cost, search
    from megatron_rlhf.plan import memory as mem
    from megatron_rlhf.plan.graph import rlhf_graph

    if par.plan != "auto":
        return dataclasses.replace(par, plan=None, **search.trainer_flags(search.Plan.load(par.plan)))
    models = {role: info.config for role, info in infos.items()}
    hw, profiles, source = _plan_hardware(par.plan_hardware)
    if os.environ.get("RANK", "0") == "0":
        print(f"plan auto: {source}", file=sys.stderr)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpu_gb = (torch.cuda.get_device_properties(0).total_memory / 1e9 if torch.cuda.is_available()
              else hw.gpu_memory_gb)
    spec_model = None
    if "draft" in models and (spec.auto or spec.num_draft_tokens):
        spec_model = cost.Speculation(models["draft"], max_draft_tokens=spec.base_tokens(True))
    est = cost.Estimator(models, dataclasses.replace(hw, gpus_per_node=local, gpu_memory_gb=gpu_gb),
                         profiles, cost.Options(param_bytes=dtype.itemsize,
                                                micro_batch_size=ppo.micro_batch_size,
                                                recompute=par.recompute_granularity or "none",
                                                speculation=spec_model))
    graph = rlhf_graph(ppo.samples_per_iteration, prompt_len or loop.max_prompt_length, gen.max_new_tokens,
                       critic=ppo.use_critic, reference=ppo.uses_reference, reward_model="reward" in models,
                       draft="draft" in models, draft_distill=loop.draft_distill,
                       ppo_epochs=ppo.ppo_epochs, mini_batches=ppo.num_mini_batches,
                       group=ppo.rollout_n)
    cluster = mem.Cluster(nodes=max(world_size // local, 1), gpus_per_node=min(local, world_size),
                          gpu_memory_gb=gpu_gb)
    found = search.search(graph, est, cluster, seed=loop.seed, space="models")
    flags = search.trainer_flags(found.best.plan)
    if os.environ.get("RANK", "0") == "0":
        text = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())
        print(f"plan auto: {text} (predicted {found.best.time_s:.1f} s per iteration of "
              f"{ppo.samples_per_iteration} samples, prompts up to {graph.calls[0].prompt_len} + "
              f"{gen.max_new_tokens} new tokens, "
              f"{found.speedup:.2f}x the default; {found.method}, {found.evaluated} plans)", file=sys.stderr)
    return dataclasses.replace(par, plan=None, **flags)


def _plan_hardware(name: str | None):
    """``(Hardware, {shape: Profile}, note)`` for ``--plan-hardware``; ``note`` says where
    the hardware came from. None: the preset of this machine's GPU, or ``cpu``."""
    import json
    from pathlib import Path

    from megatron_rlhf.plan import cost
    from megatron_rlhf.plan.hardware import device_preset

    if name is None:
        if not torch.cuda.is_available():
            return cost.HARDWARE["cpu"], {}, "hardware preset cpu (no GPU)"
        device = torch.cuda.get_device_name(0)
        # (in GiB, the unit of the data sheets' "80 GB" of HBM)
        sheet, how = device_preset(device, torch.cuda.get_device_properties(0).total_memory / 2**30)
        return cost.HARDWARE[sheet.preset], {}, (
            f"hardware preset {sheet.preset} ({sheet.model} data sheet) for GPU {device!r}, {how}; "
            "--plan-hardware NAME|FILE.json chooses another")
    if name in cost.HARDWARE:
        return cost.HARDWARE[name], {}, f"hardware preset {name} (--plan-hardware)"
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--plan-hardware {name!r}: use one of {', '.join(cost.HARDWARE)} or a JSON file")
    data = json.loads(path.read_text())
    if "forward" in data:  # a measured Profile, with its fitted hardware
        prof = cost.Profile(**data)
        return cost.Hardware(**prof.hardware), {prof.shape: prof}, f"measured profile {name}"
    return cost.Hardware(**data), {}, f"hardware {name}"
