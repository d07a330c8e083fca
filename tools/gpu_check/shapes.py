"""The GPU check's model shapes (``1b`` on the GPU, ``smoke`` anywhere), its speed goals and tolerances."""

from __future__ import annotations

from dataclasses import dataclass

NEAR_TIE = 1e-3
"""fp32 logit gap under which two implementations may pick different argmax tokens."""


@dataclass
class Shape:
    """One model size and the workload sizes that go with it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    positions: int
    greedy_new: int
    bench_batches: tuple[int, ...]
    bench_new: int
    warm_new: int
    verify_batches: tuple[int, ...]
    verify_context: int
    spec_batches: tuple[int, ...]
    spec_new: int
    bitwise_batch: int  # the bitwise stage's prompts and new tokens
    bitwise_new: int
    ppo: dict
    grpo: dict
    train_timeout_s: int


SHAPES = {
    # ~1.07B parameters with SmolLM2's 49152-token vocabulary (tied embeddings)
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, positions=2048,
                greedy_new=32, bench_batches=(1, 16, 64, 256), bench_new=128, warm_new=8,
                verify_batches=(1, 16, 64), verify_context=256, spec_batches=(1, 16),
                spec_new=64, bitwise_batch=16, bitwise_new=128,
                ppo=dict(train_iters=3, global_batch_size=16, rollout_n=2, micro_batch_size=8,
                         max_new_tokens=128),
                grpo=dict(train_iters=3, global_batch_size=8, rollout_n=4, micro_batch_size=8,
                          max_new_tokens=128),
                train_timeout_s=200),
    "smoke": Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, positions=512,
                   greedy_new=8, bench_batches=(1, 2), bench_new=8, warm_new=2,
                   verify_batches=(1, 2), verify_context=16, spec_batches=(1, 2), spec_new=8,
                   bitwise_batch=2, bitwise_new=8,
                   ppo=dict(train_iters=1, global_batch_size=2, rollout_n=2, micro_batch_size=2,
                            max_new_tokens=8),
                   grpo=dict(train_iters=1, global_batch_size=2, rollout_n=2, micro_batch_size=2,
                             max_new_tokens=8),
                   train_timeout_s=300),
}

GOALS = {
    "decode_step_ms_b1": 2.0,
    "speedup_vs_hf_b1": 5.0,
    "speedup_vs_hf_all": 2.0,
    "verify_ratio_max": 1.3,
    "verify_ratio_batch_max": 64,
}
