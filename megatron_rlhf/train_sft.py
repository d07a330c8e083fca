"""Supervised fine-tuning: ``python -m megatron_rlhf.train_sft`` (under torchrun for TP/DP).

    torchrun --nproc_per_node 2 -m megatron_rlhf.train_sft --load-model CKPT --data sft.jsonl \\
        [--pack] [--seq-length 512] --global-batch-size 16 --micro-batch-size 4 --lr 1e-5 \\
        --train-iters 200 --save out/sft --log-dir out/sft

Next-token loss on response tokens only (the prompt, formatted with the chat template as
the RLHF loop formats it, is context). Writes ``SAVE/iter_X/actor``: PPO's ``--actor-load``.
"""

import sys

from megatron_rlhf.finetune import run

PROG = "python -m megatron_rlhf.train_sft"


def parse_args(argv=None):
    return run.parser("sft", PROG, __doc__).parse_args(argv)


if __name__ == "__main__":
    sys.exit(run.main(None, "sft", PROG, __doc__))
