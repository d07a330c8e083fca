"""Whole-sequence core attention through torch SDPA (:mod:`megatron_rlhf.models.attention`)
against megatron-core's local ``DotProductAttention`` on the same weights: outputs and
gradients on left-padded GQA and MHA batches, fp32 and bf16; a sliding window falls back."""

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_rlhf.config import preset
from megatron_rlhf.models.attention import SDPAttention
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import masked_forward

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the largest value


def _use(model, cls):
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.__class__ = cls


@pytest.mark.parametrize("name", ["tiny", "tiny-mha", "tiny-qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_core_attention_equals_megatrons(world1, name, dtype):
    model = build_model(preset(name), "actor", world1, dtype=dtype, seed=3)
    assert all(type(layer.self_attention.core_attention) is SDPAttention for layer in model.decoder.layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 200, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5], mask[2, :2] = 0, 0  # left padding
    results = []
    for cls in (SDPAttention, DotProductAttention):
        _use(model, cls)
        model.zero_grad(set_to_none=True)
        out = masked_forward(model, ids, mask).float()
        (out * mask[..., None]).square().mean().backward()
        grads = [p.grad.float().clone() for p in model.parameters() if p.grad is not None]
        results.append((out.detach(), grads))
    _use(model, SDPAttention)
    (a, ga), (b, gb) = results
    tol = TOLERANCE[dtype]
    real = mask.bool()
    assert ((a - b)[real].abs().max() / b[real].abs().max()) < tol
    assert len(ga) == len(gb) > 0
    for x, y in zip(ga, gb):
        assert (x - y).abs().max() <= tol * y.abs().max() + 1e-8


def test_sliding_window_layers_keep_megatrons_forward(world1):
    model = build_model(preset("tiny-mistral"), "actor", world1, dtype=torch.float32, seed=3)
    core = model.decoder.layers[0].self_attention.core_attention
    assert type(core) is SDPAttention and core.sdpa == (model.config.window_size is None)


def test_the_padding_mask_matters(world1):
    """A control: without the mask (all keys visible) the output of a padded row differs."""
    model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=3)
    ids = torch.randint(2, 200, (1, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        padded = masked_forward(model, ids, mask)[0, 4:]
        alone = masked_forward(model, ids[:, 4:], None)[0]
        unmasked = masked_forward(model, ids, torch.ones_like(ids))[0, 4:]
    assert (padded - alone).abs().max() < 1e-4 * alone.abs().max()
    assert (unmasked - alone).abs().max() > 1e-2 * alone.abs().max()
