"""Decode attention (issue 28): grouped query heads folded into rows, for the CPU's batched
matmuls and for torch SDPA (the GPU's backend), against explicit attention and against
the whole-sequence forward on padded GQA batches; controls without the mask fail."""

import pytest
import torch

from gen_fixtures import decode_attention_error, explicit_attention, reference_flash_kvcache
from megatron_rlhf.config import preset
from megatron_rlhf.generation import attention as attn
from megatron_rlhf.generation import cpu_numerics
from megatron_rlhf.generation import incremental as inc
from megatron_rlhf.generation import kv_cache
from megatron_rlhf.models.builder import build_model

# errors relative to the largest logit: fp32 differs from the whole-sequence forward by
# summation order only; bf16 rounds every activation (both sides), a few units of its
# 2**-8 precision after two layers
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("name", ["matmul", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_attention_equals_explicit_gqa(name, dtype):
    gen = torch.Generator().manual_seed(0)
    b, kv, g, n, d, L = 3, 2, 3, 4, 16, 11
    q = torch.randn(b, kv * g, n, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, kv, L, d, generator=gen).to(dtype) for _ in range(2))
    mask = attn.attention_mask(torch.tensor([0, 3, 7]), n, L)  # rows padded to different lengths
    ref = explicit_attention(q, k, v, mask)
    out = attn.attention(q, k, v, mask, name).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out - ref).abs().max() <= tol
    nomask = attn.attention(q, k, v, torch.ones_like(mask), name).float()
    assert (nomask - ref).abs().max() > 10 * tol  # the mask is what makes them equal


@pytest.mark.parametrize("name", ["matmul", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_decode_equals_whole_sequence_forward_on_padded_gqa(world1, name, dtype, static):
    model = build_model(preset("tiny"), "actor", world1, dtype=dtype, seed=2).eval()
    assert model.mrlhf_config.num_query_groups < model.mrlhf_config.num_attention_heads
    assert decode_attention_error(model, name, static=static) < TOLERANCE[dtype]
    assert decode_attention_error(model, name, static=static, drop_mask=True) > 5 * TOLERANCE[dtype]


@pytest.fixture
def fake_flash(monkeypatch):
    """flash-attn's kernel stood in for by :func:`reference_flash_kvcache` (its documented
    contract and input checks; calls counted), and caches in the model's dtype on the CPU
    too (flash takes half precision only). The real kernel runs only on a GPU with
    flash-attn installed, which the GPU lent so far lacks."""
    calls = []

    def kernel(*args, **kw):
        calls.append(kw["cache_seqlens"].clone())
        return reference_flash_kvcache(*args, **kw)

    monkeypatch.setattr(attn, "_flash_kvcache", kernel)
    monkeypatch.setattr(kv_cache, "CPU_HALF_CACHE_MIN_BATCH", 1)
    return calls


@pytest.mark.parametrize("static", [False, True])
def test_flash_decode_equals_whole_sequence_forward_on_padded_gqa(world1, fake_flash, static):
    """flash_attn_with_kvcache on the cache in place (strided [B, L, KV, d] views, each row's
    keys ending at its own length, causal alignment for verification widths) gives the
    whole-sequence forward's logits; with every row's keys ending at the cache's end
    (padding and future positions visible) it does not."""
    model = build_model(preset("tiny"), "actor", world1, dtype=torch.bfloat16, seed=2).eval()
    assert decode_attention_error(model, "flash", static=static) < TOLERANCE[torch.bfloat16]
    layers = model.mrlhf_config.num_layers
    assert len(fake_flash) >= 4 * layers  # every layer of the 4 decode forwards (and the prefill)
    assert decode_attention_error(model, "flash", static=static, drop_mask=True) > 5 * TOLERANCE[torch.bfloat16]


def test_flash_with_an_fp32_cache_takes_sdpa(world1, fake_flash):
    model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=2).eval()
    assert decode_attention_error(model, "flash") < TOLERANCE[torch.float32]
    assert not fake_flash


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(attn.ENV_OVERRIDE, raising=False)
    assert attn.default_backend("cpu") == "matmul"
    if attn.flash_kvcache() is None:  # flash-attn not installed: the GPU takes SDPA
        assert attn.default_backend("cuda") == "sdpa"
        with pytest.raises(ValueError, match="flash-attn does not import"):
            attn.check_backend("flash")
    monkeypatch.setattr(attn, "_flash_kvcache", reference_flash_kvcache)
    assert attn.default_backend("cuda") == "flash" and attn.default_backend("cpu") == "matmul"
    monkeypatch.setenv("MRLHF_DECODE_ATTENTION", "sdpa")
    assert attn.default_backend("cpu") == "sdpa"
    assert attn.default_backend("cuda") == "sdpa"
    assert attn.check_backend("matmul") == "matmul"
    with pytest.raises(ValueError, match="matmul, sdpa, flash"):
        attn.check_backend("nope")
    monkeypatch.setenv("MRLHF_DECODE_ATTENTION", "nope")
    with pytest.raises(ValueError, match="MRLHF_DECODE_ATTENTION"):
        attn.default_backend("cpu")
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert attn.sdpa_kernel_name(q, k, v, attn.attention_mask(torch.tensor([2]), 1, 5)) in (
        "flash", "efficient", "cudnn", "math")


def test_the_generators_backend_is_chosen_once_and_used(world1, monkeypatch):
    """An explicit backend (the generator's ``attention``) beats the environment's, reaches
    every forward of the call (prefill, steps), and names the call's decode mode."""
    from megatron_rlhf.config import GenerationConfig
    from megatron_rlhf.generation.engine import Generator

    monkeypatch.setenv(attn.ENV_OVERRIDE, "matmul")
    model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=2).eval()
    seen = []
    real = inc._forward_cached

    def spy(*a, **kw):
        seen.append(kw.get("backend"))
        return real(*a, **kw)

    monkeypatch.setattr(inc, "_forward_cached", spy)
    r = Generator(model, attention="sdpa").generate([[5, 6, 7]], GenerationConfig(max_new_tokens=4))
    assert r.stats.decode.startswith("sdpa attention") and seen and set(seen) == {"sdpa"}
    with pytest.raises(ValueError, match="use one of"):
        Generator(model, attention="nope")


def test_gpu_defaults():
    """GPU-sized prefill runs (the estimator plans with the GPU's), CPU-sized on the CPU."""
    from megatron_rlhf.plan import memory

    assert inc.prefill_chunk_tokens("cpu") == 2048
    assert inc.prefill_chunk_tokens("cuda") == memory.PREFILL_CHUNK_TOKENS == 8192


def _row_by_row(x, weight):
    """A linear computed one row at a time: the same kernel for every row, whatever the
    number of rows (the test isolates the attention's width invariance from the GEMMs')."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.cat([torch.nn.functional.linear(flat[i:i + 1], weight) for i in range(flat.shape[0])])
    return out.view(*x.shape[:-1], weight.shape[0])


def _verify_vs_steps(model, n: int, prompt_lengths=(40, 57, 71, 90, 100)) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ``n`` tokens fed after random prompts as one verification forward, and as
    ``n`` one-token steps."""
    from megatron_rlhf.generation.kv_cache import KVCache

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 200, (length,), generator=g).tolist() for length in prompt_lengths]
    toks = torch.randint(2, 200, (len(prompts), n), generator=g)
    max_len = max(prompt_lengths) + n
    out = []
    for width in (n, 1):
        cache, rope = KVCache.for_model(model, len(prompts), max_len), inc.RopeTable(model, max_len)
        with torch.no_grad():
            inc.prefill(model, cache, prompts, rope)
            out.append(torch.cat([inc.forward_cached(model, cache, toks[:, i:i + width], rope)
                                  for i in range(0, n, width)], 1))
    return out[0], out[1]


@pytest.fixture(scope="module")
def smollm2_shaped(world1):
    """SmolLM2-135M's shape (9 heads in 3 KV groups of 64, vocabulary 49152), 2 layers,
    random bf16 weights: where one attention call over 5 positions was seen to differ."""
    return build_model(preset("smollm2-135m", num_layers=2), "actor", world1, dtype=torch.bfloat16, seed=2).eval()


LENGTHS = tuple(range(60, 120, 5))  # 12 prompts


def test_bf16_verification_equals_one_token_steps_bit_for_bit(smollm2_shaped, monkeypatch):
    """In bf16 on the CPU a verification's attention runs one query position at a time
    (``width_invariant``), so its logits are the one-token steps' bit for bit: exact
    verification then keeps plain decoding's tokens in bf16 too. The linears run row by
    row here, so that only the attention is on trial (bf16 GEMMs were row-invariant on the
    CPUs measured, but that is the kernel library's business). Sabotaged (one attention
    call over the 5 positions), this fails on the 2-core EPYC: logits up to 0.0078 apart
    on this model, 0.75 on SmolLM2's 30 trained layers; whether it fails elsewhere depends
    on how a CPU's fp32 matmuls order their sums for 15 query rows against 3."""
    monkeypatch.setattr(cpu_numerics, "linear", _row_by_row)
    assert cpu_numerics.width_invariant(torch.bfloat16, 5) and not cpu_numerics.width_invariant(torch.float32, 5)
    assert not cpu_numerics.width_invariant(torch.bfloat16, cpu_numerics.WIDTH_INVARIANT_MAX_TOKENS + 1)  # prefill
    wide, steps = _verify_vs_steps(smollm2_shaped, 5, LENGTHS)
    assert torch.equal(wide, steps)


def _ragged_vs_steps(model, valid: list[int], prompt_lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a ragged verification (row ``r`` feeds ``valid[r]`` real tokens, the rest
    padding; packed logits) and of one-token steps of every row, at the real tokens."""
    from megatron_rlhf.generation.kv_cache import KVCache

    g = torch.Generator().manual_seed(1)
    n = max(valid)
    prompts = [torch.randint(2, 200, (length,), generator=g).tolist() for length in prompt_lengths]
    toks = torch.randint(2, 200, (len(prompts), n), generator=g)
    valid_t = torch.tensor(valid)
    rows, cols = inc.packed_positions(valid_t, n)
    max_len = max(prompt_lengths) + n
    out = []
    for ragged in (True, False):
        cache, rope = KVCache.for_model(model, len(prompts), max_len), inc.RopeTable(model, max_len)
        with torch.no_grad():
            inc.prefill(model, cache, prompts, rope)
            if ragged:
                out.append(inc.forward_cached(model, cache, toks, rope, valid=valid_t, packed_logits=True))
            else:
                steps = [inc.forward_cached(model, cache, toks[:, i:i + 1], rope) for i in range(n)]
                out.append(torch.cat(steps, 1)[rows, cols])
    return out[0], out[1]


RAGGED = [1, 5, 3, 1, 2, 5, 1, 1, 4, 1, 2, 1]  # a verification's drafting rows among plain ones


def test_ragged_bf16_verification_equals_one_token_steps_bit_for_bit(smollm2_shaped, monkeypatch):
    """A ragged verification (each row its own number of drafts; only real tokens in the
    linears and the head; the attention one query position at a time over all rows, the
    cache read in place) computes each real token as a one-token step does, bit for bit in
    bf16 (linears row by row, as above)."""
    monkeypatch.setattr(cpu_numerics, "linear", _row_by_row)
    ragged, steps = _ragged_vs_steps(smollm2_shaped, RAGGED, LENGTHS)
    assert ragged.shape == (sum(RAGGED), smollm2_shaped.mrlhf_config.vocab_size)
    assert torch.equal(ragged, steps)


@pytest.mark.parametrize("name", ["tiny-untied", "tiny-mha"])
def test_ragged_fp32_verification_equals_one_token_steps(world1, name):
    """fp32, through the GEMMs as they run (summation order only)."""
    model = build_model(preset(name), "actor", world1, dtype=torch.float32, seed=3).eval()
    ragged, steps = _ragged_vs_steps(model, RAGGED, [5 + 3 * i for i in range(len(RAGGED))])
    assert (ragged - steps).abs().max() <= TOLERANCE[torch.float32] * steps.abs().max()


def test_packed_logits_need_a_ragged_feed(world1):
    from megatron_rlhf.generation.kv_cache import KVCache

    model = build_model(preset("tiny-untied"), "actor", world1, dtype=torch.float32, seed=3).eval()
    cache, rope = KVCache.for_model(model, 2, 16), inc.RopeTable(model, 16)
    with pytest.raises(ValueError, match="packed_logits needs valid"):
        inc.forward_cached(model, cache, torch.ones(2, 2, dtype=torch.long), rope, packed_logits=True)


@pytest.mark.parametrize("align", [cpu_numerics.ATTEND_ALIGN, 1])
def test_a_samples_decode_logits_do_not_depend_on_its_batch(world1, monkeypatch, align):
    """The attention reads whole multiples of ``ATTEND_ALIGN`` cache positions, so a
    sample's logits through prefill, steps and verifications are the same alone and in a
    batch whose longest sample reads further: DP=1 against DP=2, any migration, speculation
    on or off. fp32 (differences of its last bit show in the logits), linears row by row
    (the GEMM library's row invariance is its own business: bf16 on the CPUs measured).
    The control, reading exactly the positions needed (``align`` 1), fails: 30 of 36
    forwards differed on the 2-core EPYC (a row of 61 keys sums in another order than one
    of 64)."""
    from megatron_rlhf.generation.kv_cache import KVCache

    monkeypatch.setattr(cpu_numerics, "linear", _row_by_row)
    monkeypatch.setattr(cpu_numerics, "ATTEND_ALIGN", align)
    model = build_model(preset("smollm2-135m", num_layers=2), "actor", world1, dtype=torch.float32, seed=2).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 200, (length,), generator=g).tolist() for length in (37, 45, 50, 61, 70, 77)]
    longer = torch.randint(2, 200, (110,), generator=g).tolist()
    feeds = [torch.randint(2, 200, (len(prompts) + 1, w), generator=g) for w in (1, 1, 5, 1, 3)]

    def run(batch, rows):
        cache, rope = KVCache.for_model(model, len(batch), 140), inc.RopeTable(model, 140)
        with torch.no_grad():
            out = [inc.prefill(model, cache, batch, rope)]
            out += [inc.forward_cached(model, cache, f[rows], rope) for f in feeds]
        return out

    together = run(prompts + [longer], list(range(len(prompts) + 1)))
    differ = sum(not torch.equal(a[0], t[i]) for i, p in enumerate(prompts)
                 for a, t in zip(run([p], [i]), together))
    if align == 1 and differ == 0:  # the control can only fail where the sums depend on the length
        pytest.skip("this CPU's attention sums do not depend on how many keys a row reads")
    assert (differ > 0) if align == 1 else (differ == 0)
