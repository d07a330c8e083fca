"""Our megatron-core models equal transformers' (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Mixtral), and conversion is exact."""

import pytest
import torch
from safetensors.torch import load_file

from hf_fixtures import make_hf_llama, save_hf_llama
from megatron_rlhf.models import convert, hf_mapping
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import load_checkpoint, read_checkpoint
from megatron_rlhf.models.forward import lm_logits, token_values

PRESETS = ["tiny", "tiny-untied", "tiny-mha", "tiny-llama3", "tiny-qwen2", "tiny-mistral", "tiny-qwen3",
           "tiny-qwen3-moe", "tiny-mixtral"]
MOE = ["tiny-qwen3-moe", "tiny-mixtral"]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", PRESETS)
def test_logits_match_hf(world1, name):
    """fp32, relative error < 1e-4 (measured 1e-7 to 1e-6: reduction order; the experts' sums
    run in another order than transformers'). An MoE's state_dict() holds transformers 5's fused
    experts, its files one tensor per expert (the round trip below)."""
    hf = make_hf_llama(name)
    cfg = hf_mapping.config_from_hf(hf.config.to_dict())
    model = build_model(cfg, "actor", world1, dtype=torch.float32)
    hf_mapping.load_into_model(model, hf_mapping.hf_to_mcore(hf.state_dict(), cfg))
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = lm_logits(model, ids), hf(ids).logits
    assert ours.shape == ref.shape == (3, 17, cfg.vocab_size)
    assert rel_err(ours, ref) < 1e-4


def test_left_padding_is_masked(world1):
    hf = make_hf_llama("tiny")
    cfg = hf_mapping.config_from_hf(hf.config.to_dict())
    model = build_model(cfg, "actor", world1, dtype=torch.float32)
    hf_mapping.load_into_model(model, hf_mapping.hf_to_mcore(hf.state_dict(), cfg))
    short = torch.randint(2, cfg.vocab_size, (1, 6))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 6)], 1).long()
    with torch.no_grad():
        a = lm_logits(model, short)
        b = lm_logits(model, padded, mask)[:, 4:]
    assert rel_err(b, a) < 1e-5


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"])
def test_family_features_change_the_logits(world1, name):
    """Control for the parity above: without RoPE scaling (Llama-3.1), the q/k/v biases
    (Qwen2), the q/k norms (Qwen3) or with the other top-k normalisation (Qwen3-MoE) our
    logits move away from transformers'."""
    hf = make_hf_llama(name)
    cfg = hf_mapping.config_from_hf(hf.config.to_dict())
    tensors = hf_mapping.hf_to_mcore(hf.state_dict(), cfg)
    if cfg.num_experts:
        plain = cfg.replace(moe_norm_topk=not cfg.moe_norm_topk)
    else:
        plain = cfg.replace(rope_scaling=None, qkv_bias=False, qk_layernorm=False)
    model = build_model(plain, "actor", world1, dtype=torch.float32)
    params = dict(model.named_parameters())  # without the biases or norms left out
    hf_mapping.load_into_model(model, {k: v for k, v in tensors.items() if k in params})
    ids = torch.arange(40)[None] % cfg.vocab_size
    with torch.no_grad():
        assert rel_err(lm_logits(model, ids), hf(ids).logits) > 1e-3


def test_unknown_model_type_and_sliding_windows_are_refused(tmp_path):
    import json

    from megatron_rlhf.config import preset

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="model_type 'gemma2' is not supported; supported model "
                                         "types: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral"):
        convert.hf_to_mcore(tmp_path, tmp_path / "out")  # no safetensors there: named first
    with pytest.raises(ValueError, match="sliding window of 128 tokens and sequences here reach 150") as e:
        preset("tiny-mistral").check_attention_span(150)
    from megatron_rlhf.flags import cli_message  # the config names fields, the CLI flags

    assert "(max_prompt_length, max_new_tokens)" in str(e.value)
    assert "(--max-prompt-length, --max-new-tokens)" in cli_message(e.value)
    preset("tiny-mistral").check_attention_span(128)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_partial_config_names_the_missing_fields_and_the_file(tmp_path, family):
    import json

    partial = {"model_type": family, "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(partial))
    with pytest.raises(ValueError) as e:
        convert.hf_to_mcore(tmp_path, tmp_path / "out")
    assert str(e.value).startswith(f"{tmp_path / 'config.json'} lacks intermediate_size, num_attention_heads, "
                                   f"which a {family} model needs")


@pytest.mark.parametrize("family, fields", [
    ("qwen3_moe", "num_experts, num_experts_per_tok, moe_intermediate_size"),
    ("mixtral", "num_local_experts, num_experts_per_tok")])
def test_a_moe_config_without_its_expert_fields_names_them(tmp_path, family, fields):
    import json

    from megatron_rlhf.config import preset

    full = hf_mapping.hf_config_dict(preset("tiny-qwen3-moe" if family == "qwen3_moe" else "tiny-mixtral"))
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size"):
        full.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(full))
    with pytest.raises(ValueError) as e:
        convert.hf_to_mcore(tmp_path, tmp_path / "out")
    assert str(e.value).startswith(f"{tmp_path / 'config.json'} lacks {fields}, which a {family} model needs")


def test_dense_layers_among_experts_are_refused():
    from megatron_rlhf.config import preset

    hf = hf_mapping.hf_config_dict(preset("tiny-qwen3-moe"))
    hf["num_local_experts"] = hf.pop("num_experts")  # the name transformers 5 saves it under
    assert hf_mapping.config_from_hf(hf) == preset("tiny-qwen3-moe")
    with pytest.raises(ValueError, match=r"config.json has dense MLP layers among the expert layers "
                                         r"\(mlp_only_layers \[1\], decoder_sparse_step 1\)"):
        hf_mapping.config_from_hf({**hf, "mlp_only_layers": [1]})


@pytest.mark.parametrize("name", ["tiny", "tiny-untied", "tiny-llama3", "tiny-qwen2", "tiny-mistral",
                                  "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"])
def test_roundtrip_is_exact_and_loads_in_transformers(world1, tmp_path, name):
    from transformers import AutoModelForCausalLM

    src = save_hf_llama(name, tmp_path / "hf")
    convert.hf_to_mcore(src, tmp_path / "mcore")
    convert.mcore_to_hf(tmp_path / "mcore", tmp_path / "hf2")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "hf2/model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    orig = AutoModelForCausalLM.from_pretrained(str(src)).eval()
    assert back.config.rope_parameters["rope_theta"] == orig.config.rope_parameters["rope_theta"]
    assert back.config.rms_norm_eps == orig.config.rms_norm_eps
    assert back.config.tie_word_embeddings == orig.config.tie_word_embeddings
    ids = torch.randint(0, orig.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, orig(ids).logits)


def test_a_sharded_export_has_an_index_and_loads(world1, tmp_path, monkeypatch):
    """Export in shards (a tiny shard size stands in for the 4 GiB one): the index maps every
    tensor, transformers loads the directory, and import reads it back exactly."""
    import json

    from transformers import AutoModelForCausalLM

    from megatron_rlhf.models import hf_io

    src = save_hf_llama("tiny-mixtral", tmp_path / "hf")
    convert.hf_to_mcore(src, tmp_path / "mcore")
    monkeypatch.setattr(hf_io, "SHARD_BYTES", 64 * 1024)
    convert.mcore_to_hf(tmp_path / "mcore", tmp_path / "hf2")
    shards = sorted(p.name for p in (tmp_path / "hf2").glob("*.safetensors"))
    index = json.loads((tmp_path / "hf2/model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    original = load_file(str(src / "model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(original)
    again = hf_io.read_hf(tmp_path / "hf2").tensors
    assert all(torch.equal(again[k], original[k]) for k in original)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, make_hf_llama("tiny-mixtral")(ids).logits)


def test_converted_checkpoint_logits(world1, tmp_path):
    src = save_hf_llama("tiny-untied", tmp_path / "hf")
    convert.hf_to_mcore(src, tmp_path / "mcore")
    info = read_checkpoint(tmp_path / "mcore")
    assert info.role == "actor" and info.step == 0 and info.config.rotary_base == 500.0
    model = build_model(info.config, "actor", world1, dtype=torch.float32, seed=7)
    load_checkpoint(model, world1, tmp_path / "mcore")
    hf = make_hf_llama("tiny-untied")
    ids = torch.randint(0, info.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert rel_err(lm_logits(model, ids), hf(ids).logits) < 1e-4


def test_value_head_roles(world1):
    cfg = hf_mapping.config_from_hf(make_hf_llama("tiny").config.to_dict())
    critic = build_model(cfg, "critic", world1, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    values = token_values(critic, ids)
    assert values.shape == (2, 5)
    assert torch.count_nonzero(values) == 0  # zero-initialised value head
    assert not critic.share_embeddings_and_output_weights


def test_bf16_forward_close_to_fp32(world1):
    hf = make_hf_llama("tiny")
    cfg = hf_mapping.config_from_hf(hf.config.to_dict())
    tensors = hf_mapping.hf_to_mcore(hf.state_dict(), cfg)
    m32 = build_model(cfg, "actor", world1, dtype=torch.float32)
    m16 = build_model(cfg, "actor", world1, dtype=torch.bfloat16)
    hf_mapping.load_into_model(m32, tensors)
    hf_mapping.load_into_model(m16, {k: v.bfloat16() for k, v in tensors.items()})
    assert m16.embedding.word_embeddings.weight.dtype == torch.bfloat16
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert rel_err(lm_logits(m16, ids).float(), lm_logits(m32, ids)) < 5e-2


@pytest.mark.parametrize("role", ["reward", "critic"])
def test_reward_models_convert_in_and_out(world1, tmp_path, role):
    """A LlamaForSequenceClassification (one label: OpenRLHF's and TRL's reward-model
    convention) becomes a value model whose value at the last token is HF's score, and
    goes back to the same tensors."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    from megatron_rlhf.config import preset

    torch.manual_seed(0)
    hf = LlamaForSequenceClassification(LlamaConfig(**hf_mapping.hf_config_dict(preset("tiny-untied"),
                                                                                 role=role))).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    convert.hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", role=role)
    info = read_checkpoint(tmp_path / "mcore")
    assert info.role == role
    model = build_model(info.config, role, world1, dtype=torch.float32)
    load_checkpoint(model, world1, tmp_path / "mcore")
    ids = torch.randint(2, info.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = token_values(model, ids)[:, -1], hf(ids).logits[:, 0]
    assert rel_err(ours, ref) < 1e-5
    convert.mcore_to_hf(tmp_path / "mcore", tmp_path / "hf2")
    a = load_file(str(tmp_path / "hf" / "model.safetensors"))
    b = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert sorted(a) == sorted(b) and "score.weight" in b
    assert all(torch.equal(a[k], b[k]) for k in a)
    back = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf2")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref[:, None], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs a scalar head: the checkpoint has no score.weight"):
        convert.hf_to_mcore(save_hf_llama("tiny", tmp_path / "lm"), tmp_path / "bad", role=role)
