"""A dense checkpoint upcycled into a mixture of experts (tools/upcycle.py): with top-k equal
to the granularity it computes the dense model (fp32 rounding), with less it does not; it
exports to Hugging Face Mixtral, whose logits are ours."""

import pytest
import torch

from megatron_rlhf.config import preset
from megatron_rlhf.models import convert
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import read_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def dense(world1, tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    save_checkpoint(root, 0, build_model(preset("tiny-untied"), "actor", world1, dtype=torch.float32, seed=5), world1)
    return root


def test_topk_equal_to_the_granularity_computes_the_dense_model(dense, tmp_path):
    import upcycle  # tools/ is on pytest's pythonpath

    assert upcycle.main(["--input", str(dense), "--output", str(tmp_path / "moe"), "--num-experts", "4",
                         "--granularity", "2"]) == 0
    info = read_checkpoint(tmp_path / "moe")
    cfg = info.config
    assert (cfg.family, cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == ("mixtral", 4, 2, 64)
    assert info.extra["step0_max_logit_diff"] < 1e-5


def test_a_smaller_topk_changes_the_model_and_the_export_matches_transformers(dense, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.models.checkpoint import load_checkpoint
    from megatron_rlhf.models.forward import lm_logits

    _, gap = convert.upcycle(dense, tmp_path / "moe", num_experts=8, granularity=4, topk=2)
    assert gap > 1e-3  # two of the four pieces per token: not the dense MLP
    convert.mcore_to_hf(tmp_path / "moe", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    info = read_checkpoint(tmp_path / "moe")
    pg = convert._single_process_groups()
    ours = build_model(info.config, "actor", pg, dtype=torch.float32)
    load_checkpoint(ours, pg, info.path)
    ids = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (lm_logits(ours, ids) - hf(ids).logits).abs().max() < 1e-4


def test_bad_granularity_and_top1_are_refused(dense, tmp_path):
    with pytest.raises(ValueError, match="--granularity 3 must divide the MLP's 128 rows and --num-experts 4"):
        convert.upcycle(dense, tmp_path / "moe", num_experts=4, granularity=3, topk=2)
    with pytest.raises(ValueError, match="top-1 routing with renormalised weights"):
        convert.upcycle(dense, tmp_path / "moe", num_experts=4, granularity=2, topk=1)
