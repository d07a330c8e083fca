"""Reward-model training on preference pairs, or DPO: ``python -m megatron_rlhf.train_rm``.

    torchrun --nproc_per_node 2 -m megatron_rlhf.train_rm --load-model SFT_CKPT \\
        --data megatron_rlhf/data/preferences.jsonl [--loss bradley-terry|dpo] \\
        --global-batch-size 16 --micro-batch-size 4 --lr 1e-5 --train-iters 100 \\
        --save out/rm --log-dir out/rm

``bradley-terry`` (default): the model's trunk with a scalar head learns
``r(chosen) > r(rejected)`` (``-log sigmoid(r_c - r_r)``); held-out pairwise accuracy is
logged. Writes ``SAVE/iter_X/reward``: PPO's ``--reward-load``. ``dpo``: the policy itself
learns from the pairs against a frozen reference (``--ref-load``, default the initial
model; ``--beta``); writes ``SAVE/iter_X/actor``.
"""

import sys

from megatron_rlhf.finetune import run

PROG = "python -m megatron_rlhf.train_rm"


def parse_args(argv=None):
    return run.parser("rm", PROG, __doc__).parse_args(argv)


if __name__ == "__main__":
    sys.exit(run.main(None, "rm", PROG, __doc__))
