"""Decode attention (issue 28): grouped query heads folded into rows, for the CPU's batched
matmuls and for torch SDPA (the GPU's backend), against explicit attention and against
the whole-sequence forward on padded GQA batches; controls without the mask fail."""

import pytest
import torch

from gen_fixtures import decode_attention_error
from megatron_rlhf.config import preset
from megatron_rlhf.generation import incremental as inc
from megatron_rlhf.models.builder import build_model

# errors relative to the largest logit: fp32 differs from the whole-sequence forward by
# summation order only; bf16 rounds every activation (both sides), a few units of its
# 2**-8 precision after two layers
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture
def backend():
    yield inc.set_attention_backend
    inc.set_attention_backend(None)


def explicit_attention(q, k, v, mask):
    """Per query head, its KV group's keys repeated: the textbook GQA."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("name", ["matmul", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_attention_equals_explicit_gqa(backend, name, dtype):
    backend(name)
    gen = torch.Generator().manual_seed(0)
    b, kv, g, n, d, L = 3, 2, 3, 4, 16, 11
    q = torch.randn(b, kv * g, n, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, kv, L, d, generator=gen).to(dtype) for _ in range(2))
    mask = inc.attention_mask(torch.tensor([0, 3, 7]), n, L)  # rows padded to different lengths
    ref = explicit_attention(q, k, v, mask)
    out = inc.attention(q, k, v, mask).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out - ref).abs().max() <= tol
    nomask = inc.attention(q, k, v, torch.ones_like(mask)).float()
    assert (nomask - ref).abs().max() > 10 * tol  # the mask is what makes them equal


@pytest.mark.parametrize("name", ["matmul", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_decode_equals_whole_sequence_forward_on_padded_gqa(world1, backend, name, dtype, static):
    backend(name)
    model = build_model(preset("tiny"), "actor", world1, dtype=dtype, seed=2).eval()
    assert model.mrlhf_config.num_query_groups < model.mrlhf_config.num_attention_heads
    assert decode_attention_error(model, static=static) < TOLERANCE[dtype]
    assert decode_attention_error(model, static=static, drop_mask=True) > 5 * TOLERANCE[dtype]


def test_backend_choice(backend, monkeypatch):
    assert inc.attention_backend("cpu") == "matmul"
    assert inc.attention_backend("cuda") == "sdpa"
    monkeypatch.setenv("MRLHF_DECODE_ATTENTION", "sdpa")
    assert inc.attention_backend("cpu") == "sdpa"
    backend("matmul")
    assert inc.attention_backend("cuda") == "matmul"
    with pytest.raises(ValueError, match="matmul, sdpa"):
        backend("flash")
    backend(None)
    monkeypatch.setenv("MRLHF_DECODE_ATTENTION", "nope")
    with pytest.raises(ValueError, match="MRLHF_DECODE_ATTENTION"):
        inc.attention_backend("cpu")
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert inc.sdpa_kernel_name(q, k, v, inc.attention_mask(torch.tensor([2]), 1, 5)) in (
        "flash", "efficient", "cudnn", "math")


def test_gpu_defaults():
    """GPU-sized prefill runs (the estimator plans with the GPU's), CPU-sized on the CPU."""
    from megatron_rlhf.plan import memory

    assert inc.prefill_chunk_tokens("cpu") == 2048
    assert inc.prefill_chunk_tokens("cuda") == memory.PREFILL_CHUNK_TOKENS == 8192
