"""The generation engine: cache, incremental forward, sampling, speculative decoding."""

import pytest
import torch

from gen_fixtures import PROMPTS, actor_and_draft, feature_draft_for
from megatron_rlhf.config import GenerationConfig, SpecConfig, preset
from megatron_rlhf.generation import speculative
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.greedy import greedy_generate
from megatron_rlhf.generation.incremental import (
    RopeTable, attended_length, forward_cached, plain_layers, prefill,
)
from megatron_rlhf.generation.kv_cache import CPU_HALF_CACHE_MIN_BATCH, KVCache, cache_dtype
from megatron_rlhf.generation.sampling import probs_for_sampling
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import lm_logits

GREEDY = GenerationConfig(max_new_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def pair(world1):
    return actor_and_draft(world1)


@pytest.mark.parametrize("name,chunk", [("tiny", 2048), ("tiny-untied", 2048), ("tiny-mha", 2048),
                                        ("tiny", 1), ("tiny", 12), ("tiny-llama3", 2048),
                                        ("tiny-qwen2", 12)])
def test_incremental_forward_equals_full_recompute(world1, name, chunk):
    """chunk: prefill's real tokens per run of rows (1: one prompt per run; 12: runs of 1-3
    prompts, the layers computing their real tokens only, the attention padded)."""
    model = build_model(preset(name), "actor", world1, dtype=torch.float32, seed=2).eval()
    cache, rope = KVCache.for_model(model, len(PROMPTS), 64), RopeTable(model, 64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        last = prefill(model, cache, PROMPTS, rope, chunk_tokens=chunk)
        ref = torch.stack([lm_logits(model, torch.tensor([p]))[0, -1] for p in PROMPTS])
        assert (last - ref).abs().max() < 1e-4 * ref.abs().max()
        seqs = [list(p) for p in PROMPTS]
        for n in (1, 3, 1, 5, 2):  # decode steps and verifications of several widths
            toks = torch.randint(2, 200, (len(PROMPTS), n), generator=g)
            out = forward_cached(model, cache, toks, rope)
            for b, s in enumerate(seqs):
                s += toks[b].tolist()
                ref = lm_logits(model, torch.tensor([s]))[0, -n:]
                assert (out[b] - ref).abs().max() < 1e-4 * ref.abs().max()
        assert cache.lengths.tolist() == [len(s) for s in seqs]


@pytest.mark.parametrize("name,dtype", [("tiny", torch.float32), ("tiny-mha", torch.float32),
                                        ("tiny", torch.bfloat16)])
def test_plain_layer_path_equals_the_modules(world1, monkeypatch, name, dtype):
    """Our presets' layers take the wrapper-free path, and it computes exactly what the
    layers' own modules compute (prefill, decode, verification). Few-row fp32 products,
    which the plain path computes in another order, are tested below."""
    from megatron_rlhf.generation import cpu_numerics

    monkeypatch.setattr(cpu_numerics, "swapped_gemm_max_rows", lambda: 0)
    model = build_model(preset(name), "actor", world1, dtype=dtype, seed=2).eval()
    assert plain_layers(model)
    outs = []
    for plain in (True, False):
        model._mrlhf_plain_layers = plain
        cache, rope = KVCache.for_model(model, len(PROMPTS), 64), RopeTable(model, 64)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            outs.append([prefill(model, cache, PROMPTS, rope)] +
                        [forward_cached(model, cache, torch.randint(2, 200, (len(PROMPTS), n), generator=g),
                                        rope) for n in (1, 3)])
    model._mrlhf_plain_layers = None
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch,limit", [(1, 4), (2, 4), (4, 4), (4, 8)])
def test_few_row_fp32_gemms_match_the_modules(world1, monkeypatch, batch, limit):
    """Decode steps and verifications with at most ``swapped_gemm_max_rows()`` rows run
    every fp32 linear of the plain path (and the head) as ``(w @ x^T)^T``, not through
    ``F.linear``; they give the modules' logits up to float rounding."""
    from megatron_rlhf.generation import cpu_numerics

    monkeypatch.setattr(cpu_numerics, "swapped_gemm_max_rows", lambda: limit)
    model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=2).eval()
    prompts = PROMPTS[:batch]
    feeds = [n for n in (1, 2, 1, 4) if batch * n <= limit]
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(2, 200, (batch, n), generator=g) for n in feeds]
    outs = []
    for plain in (True, False):
        model._mrlhf_plain_layers = plain
        cache, rope = KVCache.for_model(model, batch, 64), RopeTable(model, 64)
        with torch.no_grad():
            out = [prefill(model, cache, prompts, rope)]
            calls = []
            real = torch.nn.functional.linear
            monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
            out += [forward_cached(model, cache, t, rope) for t in toks]
            monkeypatch.setattr(torch.nn.functional, "linear", real)
        if plain:
            assert not calls  # every product of the steps took the swapped form
        outs.append(out)
    model._mrlhf_plain_layers = None
    for a, b in zip(*outs):
        assert (a - b).abs().max() < 1e-5 * b.abs().max()


def test_swapped_gemm_is_linear_up_to_rounding():
    from megatron_rlhf.generation.cpu_numerics import linear as _linear, swapped_gemm_max_rows

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=g)
    limit = swapped_gemm_max_rows()
    for rows in range(1, limit + 2):
        x = torch.randn(rows, 1, 40, generator=g)
        want = torch.nn.functional.linear(x, w)
        got = _linear(x, w)
        assert got.shape == want.shape == (rows, 1, 96)
        assert (got - want).abs().max() < 1e-5 * want.abs().max()
        if rows > limit:
            assert torch.equal(got, want)
    xb, wb = torch.randn(2, 40, dtype=torch.bfloat16), w.bfloat16()
    assert torch.equal(_linear(xb, wb), torch.nn.functional.linear(xb, wb))  # bf16: F.linear


def test_bf16_model_uses_a_bf16_cache_from_large_batches_on(world1, monkeypatch):
    """A bf16 model keeps an fp32 cache at every batch by default (its numerics then do not
    depend on the batch); with CPU_HALF_CACHE_MIN_BATCH set, a bf16 one from there on
    (attention through k @ q^T, softmax in fp32): both give the logits of a full bf16
    recompute, through prefill, decode steps and verifications."""
    from megatron_rlhf.generation import kv_cache

    model = build_model(preset("tiny"), "actor", world1, dtype=torch.bfloat16, seed=2).eval()
    cfg = model.mrlhf_config
    prompts = PROMPTS * 7
    w = model.embedding.word_embeddings.weight
    assert CPU_HALF_CACHE_MIN_BATCH is None and cache_dtype(w, 10 ** 6) == torch.float32
    monkeypatch.setattr(kv_cache, "CPU_HALF_CACHE_MIN_BATCH", 32)
    assert len(prompts) >= 32
    assert cache_dtype(w, len(prompts)) == torch.bfloat16
    assert cache_dtype(w, 31) == torch.float32
    assert cache_dtype(w.float(), len(prompts)) == torch.float32
    longest = max(map(len, prompts))
    caches = [KVCache.for_model(model, len(prompts), 64),
              KVCache.for_model(model, len(prompts), longest + 5),  # exactly what is fed
              KVCache(cfg.num_layers, len(prompts), 64, cfg.num_query_groups, cfg.kv_channels,
                      torch.float32)]
    assert caches[0].keys[0].dtype == caches[1].keys[0].dtype == torch.bfloat16
    # sliced keys (whole multiples of 16) from the roomy bf16 cache; the tight one is read whole (past the lengths
    # masked) from prefill on; the fp32 cache is always sliced
    assert attended_length(caches[0], longest + 5) == 16  # rounded up to a multiple of 16
    assert attended_length(caches[1], longest) == longest + 5
    assert attended_length(caches[2], 64) == 64 and attended_length(caches[2], 40) == 48  # multiples of 16
    rope, g = RopeTable(model, 64), torch.Generator().manual_seed(0)
    steps = [torch.randint(2, 200, (len(prompts), n), generator=g) for n in (1, 3, 1)]
    with torch.no_grad():
        outs = []
        for cache in caches:
            outs.append([prefill(model, cache, prompts, rope, chunk_tokens=12).float()] +
                        [forward_cached(model, cache, t, rope).float() for t in steps])
        seqs = [list(p) + [int(x) for t in steps for x in t[b]] for b, p in enumerate(prompts)]
        ref = [lm_logits(model, torch.tensor([s])).float()[0] for s in seqs]
    scale = max(r.abs().max() for r in ref)
    for out in outs:
        for b in range(len(prompts)):
            full = torch.cat([x[b].reshape(-1, x.shape[-1]) for x in out])  # last prompt + 5 fed
            want = ref[b][len(prompts[b]) - 1:]
            assert (full - want).abs().max() < 0.02 * scale
    # the bf16 caches differ from the fp32 one by bf16 rounding of the scores and
    # probabilities only (measured: 0.005 of the largest logit; the bf16 path without its
    # attention mask: 0.058)
    for out in outs[:2]:
        for a, b in zip(out, outs[2]):
            assert (a - b).abs().max() < 0.02 * scale


@pytest.mark.parametrize("plain", [True, False])
def test_padded_rows_compute_only_their_real_tokens(world1, monkeypatch, plain):
    """With ``valid``, the layers (plain path and modules) run on the real tokens only and
    give what the padded forward gives at those positions; the cache holds the same keys."""
    import megatron_rlhf.generation.incremental as inc

    model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=2).eval()
    model._mrlhf_plain_layers = plain
    valid = torch.tensor([len(p) for p in PROMPTS])
    tokens = inc.pad_right(PROMPTS, 0, "cpu")
    rows = []
    real = torch.nn.functional.linear

    def spy(x, w, *a, **k):
        rows.append(x.shape[:-1].numel())
        return real(x, w, *a, **k)

    outs, caches = [], []
    with torch.no_grad():
        for given in (None, valid):
            cache, rope = KVCache.for_model(model, len(PROMPTS), 32), RopeTable(model, 32)
            rows.clear()
            monkeypatch.setattr(torch.nn.functional, "linear", spy)
            out, hidden = forward_cached(model, cache, tokens, rope, valid=given, return_features=True)
            monkeypatch.undo()
            outs.append((out, hidden, rows[:]))
            caches.append(cache)
    model._mrlhf_plain_layers = None
    (ref, ref_h, ref_rows), (got, got_h, got_rows) = outs
    if plain:  # 4 linears per layer, then the head (logits at every fed position)
        layers = 4 * model.mrlhf_config.num_layers
        assert ref_rows == [tokens.numel()] * (layers + 1)
        assert got_rows == [int(valid.sum())] * layers + [tokens.numel()]
    for b, n in enumerate(valid.tolist()):
        assert (got[b, :n] - ref[b, :n]).abs().max() < 1e-5 * ref.abs().max()
        assert (got_h[b, :n] - ref_h[b, :n]).abs().max() < 1e-5 * ref_h.abs().max()
        for a, c in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
            assert (a[b, :, :n] - c[b, :, :n]).abs().max() < 1e-5 * a.abs().max()


def test_prefill_shares_prefixes_and_duplicates(world1):
    """Identical prompts are prefilled once and a prefix shared by all distinct prompts is
    computed once: logits and hidden states equal a full recompute per prompt, and decoding
    continues from the right cache rows."""
    from megatron_rlhf.generation.draft import target_logits_and_features

    model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=2).eval()
    head = list(range(20, 32))  # 12 shared tokens (>= MIN_SHARED_PREFIX)
    tails = [[40, 41, 42], [50], [60, 61, 62, 63, 64, 65], [40, 41, 42], [70, 71]]
    prompts = [head + t for t in tails]  # prompts 0 and 3 are identical
    rope, g = RopeTable(model, 64), torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref = [target_logits_and_features(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
               for p in prompts]
        caches = []
        for share in (True, False):
            cache = KVCache.for_model(model, len(prompts), 64)
            logits, hidden = prefill(model, cache, prompts, rope, return_features=True, chunk_tokens=12,
                                     share_prefix=share)
            assert cache.lengths.tolist() == [len(p) for p in prompts]
            for b, (ref_logits, ref_hidden) in enumerate(ref):
                n = len(prompts[b])
                assert (logits[b] - ref_logits[0, -1]).abs().max() < 1e-4 * ref_logits.abs().max()
                assert (hidden[b, :n] - ref_hidden[0]).abs().max() < 1e-4 * ref_hidden.abs().max()
            caches.append(cache)
        seqs = [list(p) for p in prompts]
        for n in (1, 3):
            toks = torch.randint(2, 200, (len(prompts), n), generator=g)
            outs = [forward_cached(model, c, toks, rope) for c in caches]
            for b, s in enumerate(seqs):
                s += toks[b].tolist()
                want = lm_logits(model, torch.tensor([s]))[0, -n:]
                for out in outs:
                    assert (out[b] - want).abs().max() < 1e-4 * want.abs().max()
        # a prefix shorter than MIN_SHARED_PREFIX is not split off; each prompt keeps a token
        short = [[1, 2, 3, 9], [1, 2, 3, 8, 7]]
        cache = KVCache.for_model(model, 2, 16)
        got = prefill(model, cache, short, rope)
        for b, p in enumerate(short):
            want = lm_logits(model, torch.tensor([p]))[0, -1]
            assert (got[b] - want).abs().max() < 1e-4 * want.abs().max()


def test_cache_rows_and_bounds():
    c = KVCache(num_layers=2, batch=3, max_len=8, kv_heads=2, head_dim=4, dtype=torch.float32)
    k = torch.randn(3, 2, 5, 4)
    c.write(0, k, k + 1)
    c.write(1, k + 2, k + 3)
    c.advance(5)
    c.truncate(torch.tensor([5, 2, 4]))
    packed, lengths = c.pack_rows(torch.tensor([2, 0]))
    assert lengths.tolist() == [4, 5] and packed.shape == (4, 2, 2, 5, 4)  # K0 K1 V0 V1
    d = KVCache(num_layers=2, batch=1, max_len=8, kv_heads=2, head_dim=4, dtype=torch.float32)
    d.append_rows(packed, lengths)
    assert d.lengths.tolist() == [0, 4, 5]
    assert torch.equal(d.keys[1][1, :, :4], k[2, :, :4] + 2) and torch.equal(d.values[0][2, :, :5], k[0] + 1)
    with pytest.raises(ValueError, match="rows hold 5 tokens, the cache holds 4"):
        KVCache(num_layers=2, batch=0, max_len=4, kv_heads=2, head_dim=4,
                dtype=torch.float32).append_rows(packed, lengths)
    with pytest.raises(ValueError, match="truncate can only shorten"):
        c.truncate(torch.tensor([6, 0, 0]))
    with pytest.raises(ValueError, match="KV cache overflow: 9 tokens needed, the cache holds 8"):
        c.check_room(4)


def test_greedy_plain_equals_full_recompute(pair):
    actor, _ = pair
    out = Generator(actor).generate(PROMPTS, GREEDY)
    assert out.responses() == [greedy_generate(actor, p, 24) for p in PROMPTS]
    assert out.finish_reasons == ["length"] * len(PROMPTS)


@pytest.mark.parametrize("n", [1, 2, 4, 6])
def test_greedy_speculative_equals_plain_with_eos_mid_batch(world1, n):
    actor, draft = actor_and_draft(world1)
    plain = Generator(actor).generate(PROMPTS, GREEDY)
    eos = plain.responses()[2][7]  # a token that ends some samples early, not others
    actor.mrlhf_config.eos_token_id = eos
    plain = Generator(actor).generate(PROMPTS, GREEDY)
    assert "eos" in plain.finish_reasons and "length" in plain.finish_reasons
    spec = Generator(actor, draft).generate(PROMPTS, GREEDY, SpecConfig(n))
    assert spec.responses() == plain.responses()
    assert spec.finish_reasons == plain.finish_reasons
    s = spec.stats
    assert s.verifications > 0 and len(s.accepted_per_position) == n
    assert 0 < s.accepted_tokens < s.verifications * n  # partial acceptance, varying per sample
    assert s.actor_steps < plain.stats.actor_steps


def test_identical_draft_accepts_everything(world1):
    actor, draft = actor_and_draft(world1, noise=0.0)
    r = Generator(actor, draft).generate(PROMPTS, GREEDY, SpecConfig(3))
    assert r.stats.mean_accepted_length == 4.0


@pytest.mark.parametrize("n,params", [(0, dict(temperature=1.0)), (3, dict(temperature=0.7)),
                                      (2, dict(temperature=1.0, top_k=20, top_p=0.9))])
def test_logprobs_equal_recompute(pair, n, params):
    actor, draft = pair
    cfg = GenerationConfig(max_new_tokens=16, **params)
    r = Generator(actor, draft).generate(PROMPTS, cfg, SpecConfig(n), seed=5)
    for i, p in enumerate(PROMPTS):
        resp = r.responses()[i]
        logits = lm_logits(actor, torch.tensor([p + resp]))[0, len(p) - 1: -1]
        tok = torch.tensor(resp)[:, None]
        ref = torch.log_softmax(logits, -1).gather(-1, tok)[:, 0]
        assert (r.response_logprobs[i, : len(resp)] - ref).abs().max() < 1e-4
        samp = probs_for_sampling(logits, cfg).gather(-1, tok)[:, 0].log()
        assert (r.sampling_logprobs[i, : len(resp)] - samp).abs().max() < 1e-4
        assert (r.response_logprobs[i, len(resp):] == 0).all()


def test_acceptance_rule_pieces():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.6, 0.2]])
    assert torch.allclose(speculative.residual_distribution(p, q), torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.allclose(speculative.residual_distribution(p, p), p)  # p == q: fall back to p
    logits = torch.tensor([[[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0]]])
    v = speculative.accept_greedy(torch.tensor([[1, 2]]), logits)  # 1 matches, 2 does not
    assert v.accepted.tolist() == [1] and v.next_token.tolist() == [0]
    v = speculative.accept_greedy(torch.tensor([[1, 0]]), logits)  # both match: bonus
    assert v.accepted.tolist() == [2] and v.next_token.tolist() == [2]


def test_bad_requests(pair):
    actor, draft = pair
    gen = Generator(actor, draft)
    with pytest.raises(ValueError, match="prompt 1 has 250 tokens"):
        gen.generate([[1, 2], [3] * 250], GREEDY)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        gen.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="needs a draft: a draft model"):
        Generator(actor).generate(PROMPTS, GREEDY, SpecConfig(2))


def test_draft_vocabulary_must_match(world1, pair):
    other = build_model(preset("tiny", vocab_size=300), "draft", world1, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"the draft's vocabulary \(300 tokens\) differs"):
        Generator(pair[0], other)


def test_draw_never_picks_zero_probability_tokens():
    from megatron_rlhf.generation.sampling import draw

    probs = torch.zeros(4000, 50)
    probs[:, [3, 7, 49]] = torch.tensor([0.2, 0.5, 0.3])
    tok = draw(probs, torch.rand(4000, generator=torch.Generator().manual_seed(0)))
    counts = torch.bincount(tok, minlength=50).float() / 4000
    assert set(tok.unique().tolist()) == {3, 7, 49}
    assert (counts[[3, 7, 49]] - torch.tensor([0.2, 0.5, 0.3])).abs().max() < 0.03


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_blockwise_inverse_cdf_equals_full_cdf(vocab):
    """The two-level search finds the token a float64 cumsum over the whole row finds (up to
    rounding at a boundary), across blocks, a padded last block and empty blocks."""
    from megatron_rlhf.generation.sampling import inverse_cdf

    g = torch.Generator().manual_seed(0)
    probs = torch.rand(2000, vocab, generator=g) ** 8  # peaked rows
    probs[:, 300:700] = 0  # whole empty blocks in the middle
    probs[::7, :-3] = 0  # rows whose mass sits in the last (padded) block
    u = torch.rand(2000, 1, generator=g)
    got = inverse_cdf(probs, u)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, u.double() * cdf[:, -1:], right=True)
    assert (got == want).float().mean() > 0.995
    assert bool((probs.gather(-1, got) > 0).all())


# ---------------------------------------------------------------- feature (EAGLE) drafts
@pytest.mark.parametrize("n", [1, 3])
def test_feature_draft_greedy_equals_plain_with_eos_mid_batch(world1, n):
    actor, _ = actor_and_draft(world1)
    plain = Generator(actor).generate(PROMPTS, GREEDY)
    actor.mrlhf_config.eos_token_id = plain.responses()[2][7]
    plain = Generator(actor).generate(PROMPTS, GREEDY)
    assert "eos" in plain.finish_reasons and "length" in plain.finish_reasons
    spec = Generator(actor, feature_draft_for(actor, world1)).generate(PROMPTS, GREEDY, SpecConfig(n))
    assert spec.responses() == plain.responses()
    assert spec.finish_reasons == plain.finish_reasons
    s = spec.stats
    assert 0 < s.accepted_tokens < s.verifications * n  # partial acceptance, varying per sample


def test_feature_draft_that_ignores_features_accepts_everything(world1, pair):
    actor, _ = pair
    r = Generator(actor, feature_draft_for(actor, world1, noise=0.0)).generate(PROMPTS, GREEDY, SpecConfig(3))
    assert r.stats.mean_accepted_length == 4.0


@pytest.mark.parametrize("n", [1, 3])
def test_feature_draft_reads_the_right_hidden_states(world1, pair, monkeypatch, n):
    """Every entry the draft keeps in its cache is ``(x_t, h_{t-1})`` of the final sequence:
    each catch-up call continues where the last one ended, with the sequence's tokens and
    the actor's true hidden states (from a full recompute) shifted by one."""
    from megatron_rlhf.generation import drafting
    from megatron_rlhf.generation.draft import shifted_features, target_logits_and_features

    actor, _ = pair
    draft = feature_draft_for(actor, world1)
    calls, real = [], drafting.forward_cached

    def spy(model, cache, tokens, rope, last_index=None, features=None, return_features=False,
            valid=None, **kw):
        if model is draft and last_index is not None:  # a catch-up (not a drafting step)
            calls.append((int(cache.lengths[0]), int(last_index[0]) + 1, tokens[0], features[0]))
        return real(model, cache, tokens, rope, last_index, features, return_features, valid, **kw)

    monkeypatch.setattr(drafting, "forward_cached", spy)
    cfg = GenerationConfig(max_new_tokens=20, temperature=1.0)
    for p in PROMPTS[:3]:
        calls.clear()
        r = Generator(actor, draft).generate([p], cfg, SpecConfig(n), seed=4)
        seq = torch.tensor([p + r.responses()[0]])
        with torch.no_grad():
            _, feats = target_logits_and_features(actor, seq, torch.ones_like(seq))
        true = shifted_features(feats, torch.ones_like(seq))[0]
        end = 0
        for start, count, tokens, features in calls:
            assert start == end  # no gap, no overlap
            assert tokens[:count].tolist() == seq[0, start:start + count].tolist()
            assert (features[:count] - true[start:start + count]).abs().max() < 1e-4
            end = start + count
        assert len(calls) > 1 and end <= seq.shape[1]
        assert 0 < r.stats.accepted_tokens  # some rounds caught up with more than one token


def test_feature_draft_training_forward_equals_incremental(world1, pair):
    """``head_logits`` (left-padded batch, teacher forcing) equals the engine's cached
    forward of the same tokens and shifted hidden states."""
    from megatron_rlhf.generation.draft import (
        head_logits, shifted_features, target_logits_and_features)

    from megatron_rlhf.generation.incremental import _plain_head

    actor, _ = pair
    draft = feature_draft_for(actor, world1, noise=0.5)
    # the engine applies the heads' weights itself; head_logits goes through the modules
    assert _plain_head(draft) == _plain_head(actor) == "full"
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 9, 11]])
    att = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    with torch.no_grad():
        _, feats = target_logits_and_features(actor, ids, att)
        logits, hidden = head_logits(draft, ids, att, features=feats, return_features=True)
        for b, start in ((0, 2), (1, 0)):
            toks = ids[b:b + 1, start:]
            one = torch.ones_like(toks)
            _, f = target_logits_and_features(actor, toks, one)
            cache, rope = KVCache.for_model(draft, 1, 16), RopeTable(draft, 16)
            out, h = forward_cached(draft, cache, toks, rope, features=shifted_features(f, one),
                                    return_features=True)
            assert (out - logits[b:b + 1, start:]).abs().max() < 1e-4 * out.abs().max()
            assert (h - hidden[b:b + 1, start:]).abs().max() < 1e-4 * h.abs().max()
    with pytest.raises(ValueError, match="needs the target's features"):
        forward_cached(draft, KVCache.for_model(draft, 1, 16), ids[:1], RopeTable(draft, 16))


def test_feature_draft_logprobs_equal_recompute(world1, pair):
    actor, _ = pair
    cfg = GenerationConfig(max_new_tokens=16, temperature=1.0)
    r = Generator(actor, feature_draft_for(actor, world1)).generate(PROMPTS, cfg, SpecConfig(2), seed=5)
    for i, p in enumerate(PROMPTS):
        resp = r.responses()[i]
        logits = lm_logits(actor, torch.tensor([p + resp]))[0, len(p) - 1: -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        assert (r.response_logprobs[i, : len(resp)] - ref).abs().max() < 1e-4


def test_feature_draft_width_must_match(world1, pair):
    from megatron_rlhf.generation.engine import check_draft

    actor, _ = pair
    other = actor.mrlhf_config.replace(hidden_size=actor.mrlhf_config.hidden_size * 2, feature_draft=True)
    with pytest.raises(ValueError, match="reads hidden states of width"):
        check_draft(actor.mrlhf_config, other)
