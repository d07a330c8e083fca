"""The training step's peak memory with the LM head chunked and not (JSON lines).

    python -m benchmarks.head_memory [--preset smollm2-135m] [--batch 32] [--prompt 14]
        [--response 114] [--chunks 0,1024] [--dtype fp32] [--entropy-coef 0.01] [--recompute full]

One PPO actor step (forward and backward of the GRPO loss, no optimizer) of a random
``--preset`` model on one rank, ``--batch`` rows of ``--prompt`` + ``--response`` tokens in one
micro-batch, under a tempered top-k policy, with ``--recompute`` activation recompute; each ``--chunks`` value (``--head-chunk-tokens``,
0: the whole logits) in a fresh process. ``peak_gb``: the process's peak resident size during
the step (the CPU's; CUDA's peak allocated on a GPU); ``step_gb``: that less the size before it
(the model's weights and the runtime). The logits a whole head makes: ``logits_gb``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks.harness import ROOT, machine, one_rank_actor, rank_env


def _step(args) -> dict:
    import torch

    from megatron_rlhf import runtime
    from megatron_rlhf.config import GenerationConfig, PPOConfig, preset
    from megatron_rlhf.rlhf.batch import Experience, pack
    from megatron_rlhf.rlhf.update import _policy_micro, _Sums

    model, _ = one_rank_actor(args.preset, args.dtype, args.recompute, args.one)
    model.train()
    cfg = preset(args.preset)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt + args.response), generator=g)
    ids, att, mask = pack(ids[:, :args.prompt].tolist(), ids[:, args.prompt:].tolist(), 0, runtime.device())
    zeros = torch.zeros_like(mask)
    exp = Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=zeros,
                     ref_logprobs=zeros, scores=torch.zeros(args.batch), kl=zeros,
                     advantages=torch.randn(mask.shape, generator=g).to(mask.device) * mask,
                     policy=GenerationConfig(temperature=0.8, top_k=50))
    ppo = PPOConfig(global_batch_size=args.batch, micro_batch_size=args.batch, rollout_n=1,
                    entropy_coef=args.entropy_coef, kl_coef=0.0)
    cuda = runtime.has_cuda()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        if not runtime.reset_peak_host_memory():
            sys.exit("the peak resident size cannot be reset here (/proc/self/clear_refs)")
        base = runtime.peak_host_memory_bytes()
    t0 = time.perf_counter()
    (_policy_micro(model, exp, ppo, _Sums()) * exp.response_mask / exp.response_mask.sum()).sum().backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = runtime.peak_host_memory_bytes()
    tokens = args.batch * (args.response + 1)  # the unchunked head's columns (from the prompt's last)
    return {"kind": "step", "chunk": args.one, "preset": args.preset, "dtype": args.dtype,
            "recompute": args.recompute,
            "batch": args.batch, "prompt": args.prompt, "response": args.response,
            "device": "cuda" if cuda else "cpu", "base_gb": round(base / 2**30, 3),
            "peak_gb": round(peak / 2**30, 3), "step_gb": round((peak - base) / 2**30, 3),
            "logits_gb": round(tokens * cfg.padded_vocab_size * 4 / 2**30, 3),
            "step_s": round(time.perf_counter() - t0, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=14)
    p.add_argument("--response", type=int, default=114)
    p.add_argument("--chunks", default="0,1024", help="--head-chunk-tokens values, comma-separated")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--recompute", choices=("full", "selective"), default=None,
                   help="activation recompute (--recompute-granularity; default: none)")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # (a child: one chunk size)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(_step(args)), flush=True)
        return 0
    print(json.dumps(machine(threads=rank_env()["OMP_NUM_THREADS"])), flush=True)
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        child = list(argv if argv is not None else sys.argv[1:])
        r = subprocess.run([sys.executable, "-m", "benchmarks.head_memory", *child, "--one", str(chunk)],
                           cwd=ROOT, env=rank_env(), capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"chunk {chunk} failed:\n{r.stderr[-4000:]}")
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if rows and rows[0]["chunk"] == 0:
        for row in rows[1:]:
            print(json.dumps({"kind": "ratio", "chunk": row["chunk"],
                              "peak_over_unchunked": round(row["peak_gb"] / rows[0]["peak_gb"], 3),
                              "step_over_unchunked": round(row["step_gb"] / max(rows[0]["step_gb"], 1e-9), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
