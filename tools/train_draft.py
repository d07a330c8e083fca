#!/usr/bin/env python
"""Distill a small draft model for speculative decoding from a target, on the target's own
responses to the prompt set, and save it as a megatron_rlhf checkpoint (role ``draft``).

    python tools/train_draft.py --target CKPT --save DRAFT --num-layers 4 --head-vocab-size 8064 --bf16
    python tools/train_draft.py --target CKPT --save DRAFT --feature-draft --num-layers 1 --bf16   # EAGLE-style

The draft takes the target's embedding, some of its layers and final norm, and an LM head over the
most frequent response tokens; it is trained with forward KL to the target's top-k on the target's
sampled responses (a feature draft also pulls its hidden states towards the target's), and its mean
accepted length is measured on held-out prompts. Runs under torchrun (world size = TP size).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch


def parse_args(argv=None):
    from megatron_rlhf import arguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_parallel_args(p)
    p.add_argument("--target", required=True, help="target (actor) checkpoint")
    p.add_argument("--save", required=True, help="draft checkpoint root to write")
    p.add_argument("--feature-draft", action="store_true",
                   help="an EAGLE-style draft: each position also reads the target's last hidden "
                        "state (use --num-layers 1); far higher acceptance per unit of cost")
    p.add_argument("--num-layers", type=int, default=4, help="layers the draft keeps")
    p.add_argument("--layer-choice", choices=["spread", "first", "ends", "last"], default=None,
                   help="take the target's layers evenly spread, its first --num-layers, its "
                        "first and last ones (skipping the middle), or its last ones (default: "
                        "last for a feature draft, else spread)")
    p.add_argument("--feature-weight", type=float, default=1.0,
                   help="feature draft: weight of the hidden-state regression term in the loss")
    p.add_argument("--tv-weight", type=float, default=0.0,
                   help="add this weight times the top-k total variation (the rejection "
                        "probability of speculative sampling) to the KL loss")
    p.add_argument("--head-vocab-size", type=int, default=8064,
                   help="LM head over this many frequent tokens (multiple of 128 that TP divides; 0: full head)")
    p.add_argument("--prompts", default=None, help="prompt jsonl (default: the shipped set)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N train prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="response length budget")
    p.add_argument("--temperature", type=float, default=1.0, help="target sampling temperature")
    p.add_argument("--gen-batch-size", type=int, default=32, help="prompts per generation batch")
    p.add_argument("--epochs", type=int, default=4,
                   help="passes over the responses (the best epoch on held-out KL is kept)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences per training step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--valid-prompts", type=int, default=40,
                   help="train prompts set aside to choose the best epoch")
    p.add_argument("--samples-per-prompt", type=int, default=2,
                   help="target responses per train prompt (more data, less overfitting)")
    p.add_argument("--teacher-topk", type=int, default=64,
                   help="keep the target's distribution as its top-k tokens (computed once)")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for acceptance")
    p.add_argument("--eval-draft-tokens", type=int, default=4, help="n for the acceptance check")
    p.add_argument("--freeze-head", action="store_true",
                   help="keep the draft's LM head rows as the target's (EAGLE freezes the head; "
                        "fewer trained weights generalise better from little data)")
    p.add_argument("--responses-cache", default=None,
                   help="JSON file of the target's responses: read when it exists and matches "
                        "this run's target, prompts and sampling flags, else written after "
                        "generation (reuse the expensive step across draft runs)")
    p.add_argument("--seed", type=int, default=1234, help="random seed")
    p.add_argument("--bf16", action="store_true", help="run the target in bf16 (draft trains in fp32)")
    return p.parse_args(argv)


def validate(args):
    from megatron_rlhf import arguments
    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
    from megatron_rlhf.generation.draft import draft_config
    from megatron_rlhf.models.checkpoint import read_checkpoint

    par = arguments.parallel_config_from_args(args)
    if par.check_world(arguments.launch_world_size()) != 1:
        raise ValueError("train_draft runs with world size = --tensor-model-parallel-size (no DP)")
    info = read_checkpoint(args.target)
    cfg = draft_config(info.config, args.num_layers, args.head_vocab_size or None,
                       feature_draft=args.feature_draft)
    cfg.check_tensor_parallel(par.tensor_model_parallel_size)
    if args.tv_weight < 0 or args.feature_weight < 0:
        raise ValueError("--tv-weight and --feature-weight must be >= 0")
    if args.num_layers > info.config.num_layers:
        raise ValueError(f"--num-layers {args.num_layers} exceeds the target's {info.config.num_layers}")
    tok = load_tokenizer(info.tokenizer_dir)
    train = [encode_prompt(tok, x.prompt, chat=True) for x in load_prompts(args.prompts, split="train")]
    held = [encode_prompt(tok, x.prompt, chat=True) for x in load_prompts(args.prompts, split="heldout")]
    train = train[: args.limit]
    if len(train) < 2:
        raise ValueError(f"need at least 2 train prompts (one is set aside for validation), got {len(train)}")
    return info, cfg, tok, train, held[: args.eval_prompts]


def generate_responses(target, prompts, args):
    from megatron_rlhf.config import GenerationConfig
    from megatron_rlhf.generation.engine import Generator

    gen, cfg = Generator(target), GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                   temperature=args.temperature)
    out = []
    for i in range(0, len(prompts), args.gen_batch_size):
        r = gen.generate(prompts[i: i + args.gen_batch_size], cfg, seed=args.seed + i)
        out += r.responses()
        log(f"generated {len(out)}/{len(prompts)} responses ({r.stats.tokens_per_s:.0f} tok/s)")
    return out


def cached_responses(target, prompts, args, what: str):
    """:func:`generate_responses`, through ``--responses-cache`` when given: entries are keyed
    by everything that decides the responses (target, prompts, sampling flags, seed)."""
    import hashlib
    import json

    if not args.responses_cache:
        return generate_responses(target, prompts, args)
    key = hashlib.sha256(json.dumps([os.path.abspath(args.target), prompts, args.max_new_tokens,
                                     args.temperature, args.gen_batch_size, args.seed,
                                     args.bf16, what]).encode()).hexdigest()
    store = {}
    if os.path.exists(args.responses_cache):
        with open(args.responses_cache) as f:
            store = json.load(f)
        if key in store:
            log(f"{what}: {len(store[key])} responses from {args.responses_cache}")
            return store[key]
    out = generate_responses(target, prompts, args)
    if os.environ.get("RANK", "0") == "0":  # every TP rank drew the same responses
        store[key] = out
        tmp = f"{args.responses_cache}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(store, f)
        os.replace(tmp, args.responses_cache)
    return out


def batches(prompts, responses, order, size):
    """Right-padded (indices, ids, attention mask, loss mask over response-predicting positions)."""
    for i in range(0, len(order), size):
        idx = order[i: i + size]
        seqs = [prompts[j] + responses[j] for j in idx]
        t = max(map(len, seqs))
        ids, att, loss = (torch.zeros(len(idx), t, dtype=torch.long) for _ in range(3))
        for b, j in enumerate(idx):
            n, p = len(seqs[b]), len(prompts[j])
            ids[b, :n] = torch.tensor(seqs[b])
            att[b, :n] = 1
            loss[b, p - 1: n - 1] = 1  # logits at p-1 .. n-2 predict the response tokens
        yield idx, ids, att, loss


@torch.no_grad()
def teacher_targets(target, prompts, responses, token_ids, args):
    """Per sequence: the target's top-k (head index, log-prob) at each response position,
    and for a feature draft the target's hidden states at every position (``[T, h]``)."""
    from megatron_rlhf.generation.draft import target_logits_and_features, teacher_topk

    out = [None] * len(prompts)
    for idx, ids, att, mask in batches(prompts, responses, list(range(len(prompts))),
                                       args.micro_batch_size):
        logits, hidden = target_logits_and_features(target, ids, att)
        index, logp = teacher_topk(logits, mask, token_ids, args.teacher_topk)
        counts = mask.sum(-1).tolist()
        for b, (j, part_i, part_p) in enumerate(zip(idx, index.split(counts), logp.split(counts))):
            feats = hidden[b, : int(att[b].sum())].clone() if args.feature_draft else None
            out[j] = (part_i, part_p, feats)
    return out


def draft_loss(draft, teacher, idx, ids, att, mask, args):
    """Top-k KL (plus ``--tv-weight`` times the top-k total variation) of the draft against
    the cached target distributions of sequences ``idx`` (plus, for a feature draft, the
    regression of its hidden states to the target's)."""
    from megatron_rlhf.generation.draft import feature_loss, head_logits, topk_distill_loss, topk_tv_loss

    index = torch.cat([teacher[j][0] for j in idx])
    logp = torch.cat([teacher[j][1] for j in idx])

    def token_loss(logits):
        loss = topk_distill_loss(logits, mask, index, logp)
        if args.tv_weight:
            loss = loss + args.tv_weight * topk_tv_loss(logits, mask, index, logp)
        return loss

    if not args.feature_draft:
        return token_loss(head_logits(draft, ids, att))
    feats = torch.zeros(*ids.shape, teacher[idx[0]][2].shape[-1])
    for b, j in enumerate(idx):
        feats[b, : len(teacher[j][2])] = teacher[j][2].float()
    logits, hidden = head_logits(draft, ids, att, features=feats, return_features=True)
    return token_loss(logits) + args.feature_weight * feature_loss(hidden, feats, mask)


@torch.no_grad()
def validation_loss(draft, teacher, prompts, responses, args) -> float:
    draft.eval()
    total, n = 0.0, 0
    for idx, ids, att, mask in batches(prompts, responses, list(range(len(prompts))),
                                       args.micro_batch_size):
        total += draft_loss(draft, teacher, idx, ids, att, mask, args).item() * len(idx)
        n += len(idx)
    draft.train()
    return total / max(n, 1)


def train(draft, teacher, prompts, responses, args, held=None):
    """AdamW with warmup and cosine decay; keeps the weights of the epoch with the lowest
    loss on validation responses (``held = (teacher, prompts, responses)``)."""

    # the input embedding (and with --freeze-head the head) stay the target's
    frozen = ("embedding.",) + (("output_layer.",) if args.freeze_head else ())
    params = []
    for n, p in draft.named_parameters():
        if n.startswith(frozen):
            p.requires_grad_(False)
        else:
            params.append(p)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    steps = args.epochs * math.ceil(len(prompts) / args.micro_batch_size)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))))
    g = torch.Generator().manual_seed(args.seed)
    step, t0 = 0, time.perf_counter()
    best = (float("inf"), None)
    draft.train()
    for epoch in range(args.epochs):
        order = torch.randperm(len(prompts), generator=g).tolist()
        for idx, ids, att, mask in batches(prompts, responses, order, args.micro_batch_size):
            loss = draft_loss(draft, teacher, idx, ids, att, mask, args)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0 or step == steps:
                log(f"epoch {epoch} step {step}/{steps} loss {loss.item():.3f} "
                    f"({time.perf_counter() - t0:.0f}s)")
        if held is not None:
            kl = validation_loss(draft, *held, args)
            log(f"epoch {epoch}: validation loss {kl:.3f}")
            if kl < best[0]:
                best = (kl, {k: v.detach().clone() for k, v in draft.state_dict().items()
                             if isinstance(v, torch.Tensor)})
    if best[1] is not None:
        draft.load_state_dict(best[1], strict=False)
        log(f"kept the epoch with validation loss {best[0]:.3f}")
    draft.eval()


def acceptance(target, draft, prompts, args) -> float:
    from megatron_rlhf.config import GenerationConfig, SpecConfig
    from megatron_rlhf.generation.engine import Generator

    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    r = Generator(target, draft).generate(prompts, cfg, SpecConfig(args.eval_draft_tokens),
                                          seed=args.seed)
    return r.stats.mean_accepted_length


def log(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[train_draft] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rlhf import runtime

    runtime.quiet_third_party_warnings()
    from megatron_rlhf import arguments

    info, cfg, tokenizer, train_prompts, held = arguments.validated(validate, args)
    from megatron_rlhf.generation.draft import (
        end_layers, frequent_tokens, init_from_target, spread_layers)
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    runtime.init_distributed(seed=args.seed)
    pg = build_process_groups(Layout(tp=args.tensor_model_parallel_size))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    target = build_model(info.config, "actor", pg, dtype=dtype, seed=args.seed).eval()
    load_checkpoint(target, pg, info.path)
    # the last train prompts pick the epoch (early stopping); the held-out split only reports
    nv = min(args.valid_prompts, max(1, len(train_prompts) // 5))
    valid, train_prompts = train_prompts[-nv:], train_prompts[:-nv]
    train_prompts = [p for p in train_prompts for _ in range(args.samples_per_prompt)]
    responses = cached_responses(target, train_prompts, args, "train")
    valid_responses = cached_responses(target, valid, args, "validation")
    token_ids = None
    if cfg.head_vocab_size:
        token_ids = frequent_tokens(responses + train_prompts, cfg.head_vocab_size,
                                    [cfg.eos_token_id, cfg.bos_token_id])
        covered = sum(t in set(token_ids.tolist()) for r in responses for t in r)
        log(f"head covers {covered / max(1, sum(map(len, responses))):.2%} of response tokens")
    choice = args.layer_choice or ("last" if args.feature_draft else "spread")
    choose = {"spread": spread_layers, "ends": end_layers,
              "first": lambda total, keep: list(range(keep)),
              "last": lambda total, keep: list(range(total - keep, total))}[choice]
    layers = choose(info.config.num_layers, cfg.num_layers)
    draft = build_model(cfg, "draft", pg, dtype=torch.float32, seed=args.seed)
    init_from_target(draft, target, layers, token_ids)
    before = acceptance(target, draft.to(dtype), held, args)
    log(f"held-out mean accepted length before distillation: {before:.2f}")
    draft.float()
    teacher = teacher_targets(target, train_prompts, responses, token_ids, args)
    valid_teacher = teacher_targets(target, valid, valid_responses, token_ids, args)
    log("target distributions computed")
    train(draft, teacher, train_prompts, responses, args,
          held=(valid_teacher, valid, valid_responses))
    after = acceptance(target, draft.to(dtype), held, args)
    log(f"held-out mean accepted length after distillation: {after:.2f} (n={args.eval_draft_tokens})")
    draft.float()
    out = save_checkpoint(args.save, 0, draft, pg, tokenizer=tokenizer, extra={
        "distilled_from": str(info.path), "target_layers": layers, "feature_draft": args.feature_draft,
        "heldout_mean_accepted_length": after, "eval_draft_tokens": args.eval_draft_tokens,
        "temperature": args.temperature})
    log(f"wrote {out}")
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
