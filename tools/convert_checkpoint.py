#!/usr/bin/env python
"""Convert checkpoints between Hugging Face (safetensors dir or .gguf) and megatron_rlhf.

  python tools/convert_checkpoint.py hf-to-mcore --input HF_DIR_OR.gguf --output CKPT [--bf16]
  python tools/convert_checkpoint.py mcore-to-hf --input CKPT --output HF_DIR

Runs on one process and holds the whole model in memory. The megatron_rlhf checkpoint
is layout-free: load it at any tensor-parallel size that divides the model's heads.
"""

import argparse
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF Llama dir or .gguf -> megatron_rlhf checkpoint")
    a.add_argument("--input", required=True, help="HF model directory (safetensors) or .gguf file")
    a.add_argument("--output", required=True, help="checkpoint root to write")
    a.add_argument("--bf16", action="store_true", help="store bf16 weights (default fp32)")
    a.add_argument("--role", default="actor", choices=["actor", "reference", "draft", "critic", "reward"],
                   help="role recorded in the checkpoint; critic/reward read a "
                        "*ForSequenceClassification (num_labels 1: the score head)")
    b = sub.add_parser("mcore-to-hf", help="megatron_rlhf checkpoint -> HF directory")
    b.add_argument("--input", required=True, help="checkpoint root or iter_* directory")
    b.add_argument("--output", required=True, help="HF directory to write")
    b.add_argument("--bf16", action="store_true", help="write bf16 tensors (default fp32)")
    args = p.parse_args(argv)

    from megatron_rlhf import runtime
    from megatron_rlhf.arguments import validated
    from megatron_rlhf.models import convert

    runtime.quiet_third_party_warnings()

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.command == "hf-to-mcore":
        out = validated(convert.hf_to_mcore, args.input, args.output, dtype, args.role)
    else:
        out = validated(convert.mcore_to_hf, args.input, args.output, dtype)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
