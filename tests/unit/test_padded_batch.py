"""Whole-sequence forwards of left-padded batches are exact: every backend applies the mask.

The logits of a left-padded batch must equal those of each sequence run alone (reference,
critic and reward inference, and PPO training, all run padded batches). On GPU the same
check runs in ``tools/gpu_check.sh``. The control (the mask dropped on purpose) shows that
the comparison sees padding that is attended.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.config import preset
from megatron_rlhf.models import builder
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import lm_logits

LENGTHS = (5, 9, 13)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _padded(lengths, vocab: int, device):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, vocab, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    return [s.to(device) for s in seqs], ids.to(device), mask.to(device)


def _worst_error(model, seqs, ids, mask) -> float:
    """Largest relative error of the padded batch's logits at real tokens against each
    sequence alone (``mask`` None: the padded batch runs unmasked)."""
    width = ids.shape[1]
    with torch.no_grad():
        batch = lm_logits(model, ids, mask).float()
        worst = 0.0
        for i, s in enumerate(seqs):
            alone = lm_logits(model, s[None]).float()[0]
            got = batch[i, width - len(s):]
            worst = max(worst, float((got - alone).abs().max() / alone.abs().max()))
    return worst


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_left_padded_batch_equals_each_sequence_alone(world1, device, dtype):
    cfg = preset("tiny-untied")
    model = build_model(cfg, "actor", world1, dtype=dtype).to(device).eval()
    seqs, ids, mask = _padded(LENGTHS, cfg.vocab_size, device)
    assert _worst_error(model, seqs, ids, mask) < TOL[dtype]
    # control: with the mask dropped, the shorter rows attend their padding and differ
    assert _worst_error(model, seqs, ids, None) > 10 * TOL[dtype]


def test_a_layer_that_would_drop_the_mask_is_refused(world1):
    from megatron.core.transformer.enums import AttnMaskType

    model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32)
    model.decoder.layers[1].self_attention.attn_mask_type = AttnMaskType.causal
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="layer 1's attention mask type is 'causal'"):
        lm_logits(model, ids)


def test_fused_softmax_only_where_its_kernel_imports():
    import importlib.util

    cfg = builder.transformer_config(preset("tiny"), 1, torch.bfloat16)
    kernel = importlib.util.find_spec("scaled_masked_softmax_cuda") is not None
    assert cfg.masked_softmax_fusion == (kernel and torch.cuda.is_available())
    spec = builder.layer_spec(use_te=False)
    assert spec.submodules.self_attention.params["attn_mask_type"].name == "arbitrary"
