"""Fixed-seed fp32 runs on 2 CPU ranks whose metrics and samples must not change in a refactor.

    python tests/behaviour/runs.py fixtures DIR        # tiny HF models -> checkpoints (once)
    python tests/behaviour/runs.py run DIR OUT         # the three runs -> OUT/fingerprint.json

Run from the root of the tree under test: the runs use only the command line (``train``,
``generate``, ``tools/convert_checkpoint.py``), so two commits run the same fixtures and can
be compared (``tests/behaviour/test_unchanged.py``). Timings, memory and what depends on how
samples were spread over the ranks are left out of the metrics; samples are compared whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 28
# Metric keys that depend on the machine, or on which rank ran which sample (migration moves
# samples by timing, so each rank's history and rounds differ), not on the numbers.
VOLATILE = ("time_", "eval/time_", "peak_mem", "mem_", "gen_", "realloc_", "accepted_length",
            "draft_accept")
PROMPTS = ["ab", "cde", "fghi", "jklmn", "opqrst", "uv", "wxy", "zabc", "defgh", "ijklmn",
           "op", "qrs", "tuvw", "xyzab", "cdefgh", "ijk"]


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=f"{Path.cwd()}:{HERE}", OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore", **extra)


def _run(cmd: list[str], **env) -> str:
    r = subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=1200)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r.stdout


def _torchrun(*args: str, **env) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                 f"--master_port={port}", *args], **env)


def fixtures(root: Path) -> None:
    """Tiny random Llama checkpoints (actor, draft, critic, reward) with a char tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                              PreTrainedTokenizerFast)

    vocab = {chr(ord("a") + i): i + 2 for i in range(26)} | {"<unk>": 0, "</s>": 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>",
                                  pad_token="</s>")
    root.mkdir(parents=True, exist_ok=True)
    shapes = {"actor": (2, 64, 4), "draft": (1, 32, 2), "critic": (2, 64, 4), "reward": (1, 64, 4)}
    for i, (name, (layers, hidden, heads)) in enumerate(shapes.items()):
        torch.manual_seed(100 + i)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=heads // 2, max_position_embeddings=64,
                          tie_word_embeddings=False, pad_token_id=1, eos_token_id=1, bos_token_id=0)
        if name in ("critic", "reward"):
            cfg.num_labels = 1
            model = LlamaForSequenceClassification(cfg)
            torch.nn.init.normal_(model.score.weight, std=0.5)
        else:
            model = LlamaForCausalLM(cfg)
        hf = root / "hf" / name
        model.save_pretrained(hf, safe_serialization=True)
        tok.save_pretrained(hf)
        _run([sys.executable, "tools/convert_checkpoint.py", "hf-to-mcore", "--input", str(hf),
              "--output", str(root / name), "--role", name])
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _metrics(log_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _weights(ckpt: Path, out: Path) -> str:
    """Hash of the saved actor's tensors, read through the HF export."""
    from safetensors.torch import load_file

    step = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    _run([sys.executable, "tools/convert_checkpoint.py", "mcore-to-hf", "--input",
          str(ckpt / f"iter_{int(step):07d}" / "actor"),
          "--output", str(out)])
    h = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        sd = load_file(f)
        for k in sorted(sd):
            h.update(k.encode())
            h.update(sd[k].float().numpy().tobytes())
    return h.hexdigest()[:16]


def run(fix: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    common = ["--no-chat", "--prompts", str(fix / "prompts.jsonl"), "--max-prompt-length", "8",
              "--max-new-tokens", "20", "--temperature", "1.0", "--lr", "1e-3", "--fp32",
              "--seed", "7", "--train-iters", "4", "--micro-batch-size", "4"]
    result = {}

    # GRPO, drafts from the rollout's history, sample migration
    samples = out / "grpo_samples"
    samples.mkdir(exist_ok=True)
    _torchrun("-m", "megatron_rlhf.train", *common, "--actor-load", str(fix / "actor"),
              "--reward-fn", "behaviour_reward:parity_recorded", "--advantage-estimator", "grpo",
              "--global-batch-size", "8", "--rollout-n", "4", "--kl-coef", "0.05",
              "--draft-source", "history", "--num-draft-tokens", "3", "--sample-migration", "on",
              # log pi_old from a training forward: generation's log-probs may differ in the last
              # bits with the batch a sample ran in, which migration decides by timing
              "--recompute-logprobs",
              "--log-dir", str(out / "grpo_log"), "--save", str(out / "grpo_save"),
              BEHAVIOUR_SAMPLES=str(samples))
    lines = sorted(x for f in samples.glob("*.jsonl") for x in f.read_text().splitlines())
    grpo = _metrics(out / "grpo_log")
    result["grpo"] = {"metrics": _digest(grpo), "samples": _digest(lines), "n_samples": len(lines),
                      "weights": _weights(out / "grpo_save", out / "grpo_hf")}

    # PPO (GAE) with a draft model, a critic and a reward model
    _torchrun("-m", "megatron_rlhf.train", *common, "--actor-load", str(fix / "actor"),
              "--reward-load", str(fix / "reward"), "--critic-load", str(fix / "critic"),
              "--critic-lr", "1e-3", "--advantage-estimator", "gae", "--global-batch-size", "8",
              "--rollout-n", "2", "--kl-coef", "0.05", "--draft-load", str(fix / "draft"),
              "--num-draft-tokens", "2", "--log-dir", str(out / "ppo_log"),
              # at DP=2 migration is on by default: pi_old from a training forward, as for GRPO
              "--recompute-logprobs",
              "--save", str(out / "ppo_save"))
    ppo = _metrics(out / "ppo_log")
    result["ppo"] = {"metrics": _digest(ppo), "weights": _weights(out / "ppo_save", out / "ppo_hf")}

    # generate at DP=2 with migration
    text = _torchrun("-m", "megatron_rlhf.generate", "--load", str(fix / "actor"), "--prompts",
                     str(fix / "prompts.jsonl"), "--batch-size", "8", "--max-new-tokens", "16",
                     "--temperature", "1.0", "--seed", "3", "--sample-migration", "on", "--json",
                     "--fp32")
    # the tokens, not the log-probs: migration moves samples between ranks by timing, and a
    # sample's log-probs may differ in the last bits with the batch it ran in
    gen = sorted(json.dumps({k: v for k, v in json.loads(x).items() if k != "logprobs"}, sort_keys=True)
                 for x in text.splitlines() if x.startswith("{"))
    result["generate"] = {"samples": _digest(gen), "n_samples": len(gen)}
    (out / "fingerprint.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    (out / "metrics.json").write_text(json.dumps({"grpo": grpo, "ppo": ppo}, indent=1, sort_keys=True))
    return result


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "fixtures":
        fixtures(Path(rest[0]))
    elif cmd == "run":
        print(json.dumps(run(Path(rest[0]), Path(rest[1])), indent=1, sort_keys=True))
    else:
        raise SystemExit(__doc__)
