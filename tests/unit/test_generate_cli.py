"""``python -m megatron_rlhf.generate``: bad input is reported before any collective."""

import os
import subprocess
import sys

import pytest
import torch

from launch import ROOT
from megatron_rlhf.config import preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import save_checkpoint

# Runs the CLI with torch.distributed.init_process_group replaced by a bomb: an error
# that reaches the user instead of the bomb was raised before any collective could start.
RUNNER = """
import sys, torch.distributed as d
def bomb(*a, **k):
    raise SystemExit("BOMB: init_process_group reached")
d.init_process_group = bomb
from megatron_rlhf.generate import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli(args, world_size=1):
    env = dict(os.environ, WORLD_SIZE=str(world_size), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_ckpt(world1, tmp_path_factory):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(ord("a") + i): i + 2 for i in range(26)} | {"<unk>": 0, "</s>": 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")
    root = tmp_path_factory.mktemp("cli") / "ck"
    cfg = preset("tiny", max_position_embeddings=16)
    save_checkpoint(root, 0, build_model(cfg, "actor", world1, dtype=torch.float32), world1,
                    tokenizer=tok)
    return root


def test_generates(tiny_ckpt):
    r = subprocess.run([sys.executable, "-m", "megatron_rlhf.generate", "--load", str(tiny_ckpt),
                        "--prompt", "abc", "--max-new-tokens", "4", "--temperature", "0", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stderr
    assert '"prompt_ids": [2, 3, 4]' in r.stdout


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (["--tensor-model-parallel-size", "3"], 3, "tensor parallel size 3 must divide 4 attention heads"),
        (["--tensor-model-parallel-size", "2"], 3, "must divide the world size 3"),
        (["--pipeline-model-parallel-size", "2"], 2, "generation runs unpipelined: use --pipeline-model-parallel-size 1"),
        (["--max-new-tokens", "13"], 1, "prompt 0 has 3 tokens: with max_new_tokens 13 (+1 for verification) it exceeds the cache of 16 positions"),
        (["--num-draft-tokens", "-1"], 1, "--num-draft-tokens must be an integer >= 0 or 'auto', got -1"),
        (["--num-draft-tokens", "2"], 1, "needs a draft: a draft model (--draft-load)"),
        (["--top-p", "1.5"], 1, "--top-p must be in (0, 1]"),
    ],
)
def test_bad_input_fails_before_collectives(tiny_ckpt, extra, world, message):
    r = run_cli(["--load", str(tiny_ckpt), "--prompt", "abc", *extra], world_size=world)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "BOMB" not in r.stderr + r.stdout


def test_draft_with_other_vocabulary(world1, tiny_ckpt, tmp_path):
    other = preset("tiny", vocab_size=300, max_position_embeddings=16)
    save_checkpoint(tmp_path / "draft", 0, build_model(other, "draft", world1, dtype=torch.float32), world1)
    r = run_cli(["--load", str(tiny_ckpt), "--draft-load", str(tmp_path / "draft"), "--prompt", "abc"])
    assert r.returncode == 2 and "the draft's vocabulary (300 tokens) differs from the actor's (256)" in r.stderr
    assert "BOMB" not in r.stderr


def test_missing_and_truncated_checkpoint(tiny_ckpt, tmp_path):
    r = run_cli(["--load", str(tmp_path / "nothing"), "--prompt", "abc"])
    assert r.returncode == 2 and "does not exist" in r.stderr
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, broken)
    shard = sorted((broken / "iter_0000000").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    r = run_cli(["--load", str(broken), "--prompt", "abc"])
    assert r.returncode == 2 and "is truncated or corrupt" in r.stderr and "BOMB" not in r.stderr


def _generate_json(ckpt, prompts, nproc, *extra):
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    r = subprocess.run([sys.executable, *launcher, "-m", "megatron_rlhf.generate", "--load", str(ckpt),
                        "--prompts", str(prompts), "--max-new-tokens", "6", "--temperature", "1",
                        "--batch-size", "3", "--seed", "5", "--json", "--fp32", *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    return {row["index"]: row["output_ids"] for row in map(json.loads, r.stdout.splitlines())}


def test_replicas_with_migration_and_history_drafts_sample_what_one_process_does(tiny_ckpt, tmp_path):
    """``generate`` at DP=2 with ``--sample-migration on`` (eager: every round) and history
    drafts gives, prompt by prompt, the tokens of one process without either."""
    import json
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "abcdefg"[: 1 + i % 6]}) + "\n" for i in range(7)))
    alone = _generate_json(tiny_ckpt, prompts, 1)
    both = _generate_json(tiny_ckpt, prompts, 2, "--sample-migration", "on", "--migration-interval", "1",
                          "--migration-threshold", "0", "--draft-source", "history", "--num-draft-tokens", "2")
    assert sorted(alone) == list(range(7)) and both == alone
