"""The workloads several benchmarks run: the demo's train flags, SmolLM2 converted for
megatron_rlhf, a random model of SmolLM2's shape that TP=2 divides, and checkpoints loaded in a dtype."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import BENCH_DIR, ROOT, rank_env

DTYPES = ("fp32", "bf16")
SMOLLM2_CKPT = BENCH_DIR / "smollm2"  # the GGUF converted once
LAYOUT_MODEL = BENCH_DIR / "layout_model"
LAYOUT_TOKENIZER = SMOLLM2_CKPT / "iter_0000000" / "tokenizer"
TASK_FLAGS = {  # examples/cpu_demo.sh
    "ppo": ["--fp32", "--reward-fn", "concise", "--global-batch-size", "8", "--rollout-n", "2",
            "--micro-batch-size", "8", "--max-new-tokens", "40", "--temperature", "1.0",
            "--lr", "1e-5", "--critic-lr", "2e-5", "--lr-warmup-iters", "2", "--kl-coef", "0.01",
            "--clip-grad", "1.0"],
    "grpo": ["--bf16", "--prompts", str(ROOT / "megatron_rlhf" / "data" / "math_train.jsonl"), "--reward-fn", "math",
             "--advantage-estimator", "grpo", "--global-batch-size", "16", "--rollout-n", "4",
             "--micro-batch-size", "8", "--num-mini-batches", "2", "--max-new-tokens", "128",
             "--temperature", "0.8", "--lr", "5e-5", "--drop-zero-advantage",
             "--lr-warmup-iters", "1", "--kl-coef", "0.0", "--clip-grad", "1.0"],
}
DEMO_FLAGS = TASK_FLAGS["ppo"]


def smollm2_checkpoint(out: Path = SMOLLM2_CKPT) -> Path:
    """The shipped SmolLM2 GGUF converted for megatron_rlhf into ``out`` (once)."""
    if not (out / "latest_checkpointed_iteration.txt").is_file():
        from megatron_rlhf.models.smollm2 import smollm2_gguf

        gguf = smollm2_gguf()
        print(f"converting {gguf.name} into {out}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "tools/convert_checkpoint.py", "hf-to-mcore", "--input", str(gguf),
                        "--output", str(out)], check=True, cwd=ROOT, env=rank_env())
    return out


def torch_dtype(name: str):
    """``fp32`` / ``bf16`` -> the torch dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def load_lm(path, pg, dtype: str, seed: int):
    """A megatron_rlhf checkpoint in ``dtype`` (``fp32``/``bf16``; weights cast after loading
    if needed): ``(model in eval mode, CheckpointInfo)``."""
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint, read_checkpoint

    dtype = torch_dtype(dtype)
    info = read_checkpoint(path)
    model = build_model(info.config, info.role, pg, dtype=dtype, seed=seed)
    load_checkpoint(model, pg, info.path)
    if any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)
    return model.eval(), info


def write_model(out: Path, tokenizer_dir: Path, role: str = "actor") -> None:
    """A random model of SmolLM2-135M's shape with 8 query and 4 KV heads (so that TP=2 divides
    them) and SmolLM2's tokenizer; a ``reward`` model gets a random value head."""
    code = f"""
import torch
from transformers import AutoTokenizer
from megatron_rlhf import runtime
from megatron_rlhf.config import preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import save_checkpoint
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout
if __name__ == "__main__":
    runtime.quiet_third_party_warnings()
    runtime.init_distributed()
    pg = build_process_groups(Layout())
    cfg = preset("smollm2-135m", num_attention_heads=8, num_query_groups=4, kv_channels=72)
    model = build_model(cfg, {role!r}, pg, dtype=torch.float32, seed=0)
    if {role!r} == "reward":
        torch.nn.init.normal_(model.output_layer.weight, std=0.02)
    save_checkpoint({str(out)!r}, 0, model, pg, tokenizer=AutoTokenizer.from_pretrained({str(tokenizer_dir)!r}))
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                   env=dict(os.environ, PYTHONWARNINGS="ignore"))


