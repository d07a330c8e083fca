import argparse
import re

import pytest

from megatron_rlhf import arguments
from megatron_rlhf.config import (
    ConfigError,
    GenerationConfig,
    ModelConfig,
    ParallelConfig,
    SpecConfig,
    dataclass_from_namespace,
    preset,
)
from megatron_rlhf.flags import cli_message


def cli_raises(field_message: str, flag_message: str, make, **kw) -> None:
    """``make(**kw)`` raises a ConfigError reading ``field_message`` (a regex) in the library
    and ``flag_message`` as the CLI shows it."""
    with pytest.raises(ConfigError, match=field_message) as e:
        make(**kw)
    assert re.search(flag_message, cli_message(e.value)), cli_message(e.value)


def test_smollm2_tensor_parallel_sizes():
    cfg = preset("smollm2-135m")
    cfg.check_tensor_parallel(1)
    cfg.check_tensor_parallel(3)
    with pytest.raises(ValueError, match=r"tensor parallel size 2 must divide 9 attention heads.*\[1, 3\]"):
        cfg.check_tensor_parallel(2)


def test_kv_heads_must_divide():
    cfg = preset("llama2-70b")  # 64 heads, 8 KV heads
    cfg.check_tensor_parallel(8)
    with pytest.raises(ValueError, match="tensor parallel size 16 must divide 8 KV heads"):
        cfg.check_tensor_parallel(16)


def test_world_size_and_pipeline():
    assert ParallelConfig(tensor_model_parallel_size=2).check_world(8) == 4
    with pytest.raises(ValueError, match="must divide the world size 3"):
        ParallelConfig(tensor_model_parallel_size=2).check_world(3)
    # PP: training and inference pipeline, generation gets its own unpipelined layout
    train, gen = ParallelConfig(pipeline_model_parallel_size=2).layouts(8)
    assert (train.tp, train.pp, train.dp) == (1, 2, 4) and (gen.tp, gen.pp, gen.dp) == (1, 1, 8)
    train, gen = ParallelConfig(train_layout="2x2x2", gen_layout="1x8").layouts(8)
    assert (train.tp, train.pp, train.dp, gen.tp, gen.dp) == (2, 2, 2, 1, 8)
    with pytest.raises(ValueError, match="pipeline parallel size 4 must divide 30 layers"):
        preset("smollm2-135m").check_pipeline_parallel(4)


def test_model_config_validation_and_padding():
    with pytest.raises(ValueError, match="3 KV heads must divide 8 attention heads"):
        ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=64, num_attention_heads=8,
                    num_query_groups=3, vocab_size=10)
    assert preset("tiny-untied").padded_vocab_size == 256
    assert preset("llama2-7b").padded_vocab_size == 32000
    assert preset("smollm2-135m").kv_channels == 64
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        preset("gpt5")
    cfg = preset("tiny")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_flags_map_onto_dataclasses():
    p = argparse.ArgumentParser()
    arguments.add_model_args(p)
    arguments.add_parallel_args(p)
    arguments.add_runtime_args(p)
    args = p.parse_args(["--model", "tiny", "--num-layers", "5", "--untie-embeddings",
                         "--tensor-model-parallel-size", "2", "--bf16", "--seq-length", "1024"])
    cfg = arguments.model_config_from_args(args)
    assert cfg.num_layers == 5 and cfg.tie_embeddings is False and cfg.hidden_size == 64
    assert cfg.max_position_embeddings == 1024
    assert arguments.parallel_config_from_args(args).tensor_model_parallel_size == 2
    assert str(arguments.dtype_from_args(args)) == "torch.bfloat16"
    args = p.parse_args(["--pipeline-model-parallel-size", "4"])
    assert arguments.parallel_config_from_args(args).layouts(8)[0].pp == 4
    with pytest.raises(ValueError, match="must be a positive"):
        arguments.parallel_config_from_args(p.parse_args(["--pipeline-model-parallel-size", "0"]))
    with pytest.raises(ValueError, match="give --model PRESET or --load"):
        arguments.model_config_from_args(p.parse_args([]))


def test_generation_configs():
    ns = argparse.Namespace(max_new_tokens=8, temperature=0.0, top_k=None, top_p=0.9)
    cfg = dataclass_from_namespace(GenerationConfig, ns)
    assert cfg.greedy and cfg.top_p == 0.9 and cfg.top_k == 0
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        GenerationConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_p must be in"):
        GenerationConfig(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        GenerationConfig(max_new_tokens=0)
    cli_raises("^num_draft_tokens must be an integer >= 0 or .auto., got -1",
               "^--num-draft-tokens must be an integer >= 0 or .auto., got -1", SpecConfig, num_draft_tokens=-1)


def test_overlap_param_gather_needs_its_prerequisites():
    from megatron_rlhf.config import OptimConfig

    assert OptimConfig(overlap_param_gather=True).overlap_param_gather  # grad overlap: default
    cli_raises("drop use_distributed_optimizer=False or overlap_param_gather",
               "drop --no-distributed-optimizer or --overlap-param-gather",
               OptimConfig, overlap_param_gather=True, use_distributed_optimizer=False)
    cli_raises("drop overlap_grad_reduce=False or overlap_param_gather",
               "drop --no-overlap-grad-reduce or --overlap-param-gather",
               OptimConfig, overlap_param_gather=True, overlap_grad_reduce=False)
