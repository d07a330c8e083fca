#!/usr/bin/env python
"""Upcycle a dense megatron_rlhf checkpoint into a mixture of experts (granular upcycling).

  python tools/upcycle.py --input CKPT --output CKPT_MOE --num-experts 8 --granularity 4 --topk 4

Each expert is 1/granularity of the dense MLP, the pieces repeated num-experts/granularity
times; with --topk equal to --granularity the MoE computes the dense model exactly at step 0
(the printed logit difference is then fp32 rounding), with a smaller top-k it does not.
Exports to Hugging Face as Mixtral (Qwen3-MoE for a model with q/k norms).
"""

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="dense checkpoint root or iter_* directory")
    p.add_argument("--output", required=True, help="checkpoint root to write")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--granularity", type=int, default=4, help="experts per dense MLP (each 1/granularity wide)")
    p.add_argument("--topk", type=int, default=None, help="experts per token (default: --granularity)")
    p.add_argument("--seed", type=int, default=1234, help="the router's initialisation")
    args = p.parse_args(argv)

    from megatron_rlhf import runtime
    from megatron_rlhf.arguments import validated
    from megatron_rlhf.models import convert

    runtime.quiet_third_party_warnings()
    out, gap = validated(convert.upcycle, args.input, args.output, args.num_experts, args.granularity,
                         args.topk or args.granularity, args.seed)
    print(f"wrote {out}; step-0 logits against the dense model: max |difference| {gap:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
