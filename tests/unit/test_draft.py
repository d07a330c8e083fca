"""Draft models: shape helpers, subset LM head, distillation loss, losslessness with a subset head."""

import pytest
import torch

from gen_fixtures import PROMPTS, actor_and_draft
from megatron_rlhf.config import GenerationConfig, SpecConfig, preset
from megatron_rlhf.generation.draft import (
    distill_loss,
    draft_config,
    end_layers,
    frequent_tokens,
    init_from_target,
    spread_layers,
)
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import load_checkpoint, save_checkpoint
from megatron_rlhf.models.forward import lm_logits
from test_speculative_distribution import chi_square


def test_end_layers():
    assert end_layers(30, 5) == [0, 1, 2, 28, 29]
    assert end_layers(30, 1) == [0] and end_layers(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="between 1 and 30 layers, got 0"):
        end_layers(30, 0)


def test_spread_layers_and_config():
    assert spread_layers(30, 4) == [0, 10, 19, 29]
    assert spread_layers(30, 1) == [0] and spread_layers(3, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="between 1 and 30 layers, got 31"):
        spread_layers(30, 31)
    cfg = draft_config(preset("smollm2-135m"), 4, 8064)
    assert cfg.num_layers == 4 and cfg.head_vocab_size == 8064 and not cfg.tie_embeddings
    cfg.check_tensor_parallel(3)
    with pytest.raises(ValueError, match="head_vocab_size 100 must be a positive multiple of 128"):
        draft_config(preset("tiny"), 1, 100)


def test_frequent_tokens():
    ids = frequent_tokens([[5, 5, 5, 7, 7, 9], [7, 3]], 3, always=[1])
    assert ids.tolist() == [1, 5, 7]  # eos-like token kept, then by frequency, sorted
    assert len(frequent_tokens([[4]], 4, always=[None])) == 4  # padded when too few


def test_distill_loss_is_kl():
    p = torch.randn(2, 3, 10)
    assert distill_loss(p, p, torch.ones(2, 3)) < 1e-6
    q = torch.randn(2, 3, 10)
    ref = torch.nn.functional.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True,
                                     reduction="none").sum(-1).mean()
    assert torch.allclose(distill_loss(q, p, torch.ones(2, 3)), ref, atol=1e-6)
    mask = torch.tensor([[1.0, 0, 0], [0, 0, 0]])
    assert torch.allclose(distill_loss(q, p, mask), distill_loss(q[:1, :1], p[:1, :1], torch.ones(1, 1)))


@pytest.fixture(scope="module")
def subset_pair(world1):
    actor, _ = actor_and_draft(world1, sharpness=8.0)
    cfg = draft_config(actor.mrlhf_config, 1, 128)
    draft = build_model(cfg, "draft", world1, dtype=torch.float32)
    # half the vocabulary on the head, including the tokens the actor likes most
    ids = frequent_tokens([lm_logits(actor, torch.tensor([p]))[0].argmax(-1).tolist() for p in PROMPTS],
                          128, always=[])
    init_from_target(draft, actor, [1], ids)
    return actor, draft, ids


def test_subset_head_init_and_checkpoint(world1, subset_pair, tmp_path):
    actor, draft, ids = subset_pair
    x = torch.tensor([PROMPTS[0]])
    logits = lm_logits(draft, x)
    off = torch.ones(actor.mrlhf_config.vocab_size, dtype=torch.bool)
    off[ids] = False
    assert torch.isinf(logits[..., off]).all() and torch.isfinite(logits[..., ids]).all()
    assert torch.equal(draft.output_layer.weight, actor.output_layer.weight[ids])
    assert torch.equal(draft.decoder.layers[0].mlp.linear_fc2.weight,
                       actor.decoder.layers[1].mlp.linear_fc2.weight)
    save_checkpoint(tmp_path / "d", 0, draft, world1)
    back = build_model(draft.mrlhf_config, "draft", world1, dtype=torch.float32, seed=5)
    load_checkpoint(back, world1, tmp_path / "d")
    assert torch.equal(back.output_layer.token_ids, ids)
    assert torch.equal(lm_logits(back, x), logits)
    # the engine applies the subset head's weight itself: the same logits, -inf off the head
    from megatron_rlhf.generation.incremental import RopeTable, _plain_head, forward_cached
    from megatron_rlhf.generation.kv_cache import KVCache

    assert _plain_head(draft) == "subset"
    with torch.no_grad():
        for n in (x.shape[1], 1):  # a prefill and a one-row step (the few-row product)
            cached = forward_cached(draft, KVCache.for_model(draft, 1, 16), x[:, :n], RopeTable(draft, 16))
            want = logits[:, :n] if n > 1 else lm_logits(draft, x[:, :1])
            assert torch.equal(torch.isinf(cached), torch.isinf(want))
            assert (cached[..., ids] - want[..., ids]).abs().max() < 1e-5 * want[..., ids].abs().max()


def test_subset_head_draft_keeps_outputs_exact(subset_pair):
    actor, draft, _ = subset_pair
    greedy = GenerationConfig(max_new_tokens=16, temperature=0)
    plain = Generator(actor).generate(PROMPTS, greedy)
    assert Generator(actor, draft).generate(PROMPTS, greedy, SpecConfig(3)).responses() == plain.responses()

    # sampling: the second token (the first one decided by verification) keeps the actor's
    # marginal even though the draft cannot propose half of the vocabulary
    n, prompt = 4000, [5, 6, 7]
    cfg = GenerationConfig(max_new_tokens=2, temperature=1.0, stop_on_eos=False)
    r = Generator(actor, draft).generate([prompt] * n, cfg, SpecConfig(2), seed=9)
    v = actor.mrlhf_config.vocab_size
    with torch.no_grad():
        p1 = lm_logits(actor, torch.tensor([prompt]))[0, -1].softmax(-1)
        seqs = torch.cat([torch.tensor(prompt).expand(v, -1), torch.arange(v)[:, None]], 1)
        p2 = lm_logits(actor, seqs)[:, -1].softmax(-1)
    marginal = (p1[:, None] * p2).sum(0).double()
    counts = torch.bincount(r.response_ids[:, 1], minlength=v).double()
    off_head = torch.ones(v, dtype=torch.bool)
    off_head[draft.output_layer.token_ids] = False
    assert marginal[off_head].sum() > 0.2  # the draft really misses a lot of the mass
    pvalue, impossible = chi_square(counts, marginal)
    assert pvalue > 1e-3 and impossible == 0


def test_topk_distill_loss_matches_full_kl():
    from megatron_rlhf.generation.draft import teacher_topk, topk_distill_loss

    t, d = torch.randn(2, 4, 300), torch.randn(2, 4, 300, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    head = torch.arange(0, 300, 2)
    index, logp = teacher_topk(t, mask, head, k=150)  # k = whole head: exact
    full = distill_loss(d, t, mask.float(), head)
    assert torch.allclose(topk_distill_loss(d, mask, index, logp, head), full, atol=1e-5)
    index, logp = teacher_topk(t, mask, head, k=8)
    assert index.shape == (5, 8) and torch.allclose(logp.exp().sum(-1), torch.ones(5))
    topk_distill_loss(d, mask, index, logp, head).backward()
    assert d.grad is not None and d.grad[mask == 0].abs().sum() == 0


def test_feature_draft_distils_and_checkpoints(world1, tmp_path):
    """A 1-layer feature draft with a subset head, distilled (top-k KL + hidden-state
    regression, teacher-forced with shifted features) on the actor's greedy continuations,
    then accepts far more of them in the engine; a checkpoint restores it exactly. If the
    training and generation paths read different hidden states, acceptance stays ~1."""
    from megatron_rlhf.generation.draft import (
        feature_loss, head_logits, target_logits_and_features, teacher_topk, topk_distill_loss)

    actor, _ = actor_and_draft(world1, sharpness=8.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 250, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in range(32)]
    cfg = GenerationConfig(max_new_tokens=24, temperature=0, stop_on_eos=False)
    seqs = [p + s for p, s in zip(prompts, Generator(actor).generate(prompts, cfg).responses())]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    att = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    mask = torch.zeros_like(att)
    for b, p in enumerate(prompts):
        mask[b, len(p) - 1: len(seqs[b]) - 1] = 1

    dcfg = draft_config(actor.mrlhf_config, 1, 128, feature_draft=True)
    draft = build_model(dcfg, "draft", world1, dtype=torch.float32, seed=2)
    token_ids = frequent_tokens(seqs, 128, [])
    init_from_target(draft, actor, [actor.mrlhf_config.num_layers - 1], token_ids)

    def accepted():
        return Generator(actor, draft).generate(prompts, cfg, SpecConfig(3)).stats.mean_accepted_length

    before = accepted()
    with torch.no_grad():
        logits, feats = target_logits_and_features(actor, ids, att)
        index, logp = teacher_topk(logits, mask, token_ids, 16)
    for p in draft.embedding.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    draft.train()
    for _ in range(60):
        out, hidden = head_logits(draft, ids, att, features=feats, return_features=True)
        loss = topk_distill_loss(out, mask, index, logp) + feature_loss(hidden, feats, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()
    after = accepted()
    assert before < 1.2 and after > 1.6, (before, after)

    save_checkpoint(tmp_path / "fd", 0, draft, world1)
    back = build_model(dcfg, "draft", world1, dtype=torch.float32, seed=5)
    load_checkpoint(back, world1, tmp_path / "fd")
    assert torch.equal(back.feature_fusion.weight, draft.feature_fusion.weight)
    with torch.no_grad():
        assert torch.equal(head_logits(back, ids, att, features=feats), head_logits(draft, ids, att, features=feats))
    with pytest.raises(ValueError, match="pass features"):
        head_logits(back, ids, att)


def test_feature_drafts_do_not_export_to_hf(world1, tmp_path):
    from megatron_rlhf.models.convert import mcore_to_hf

    cfg = draft_config(preset("tiny"), 1, None, feature_draft=True)
    save_checkpoint(tmp_path / "fd", 0, build_model(cfg, "draft", world1, dtype=torch.float32), world1)
    with pytest.raises(ValueError, match="feature \\(EAGLE\\) draft"):
        mcore_to_hf(tmp_path / "fd", tmp_path / "hf")


def test_topk_tv_loss_is_half_l1_distance():
    """With k = the whole head, the top-k TV is 0.5 * sum |p - q| over the head (the
    probability that speculative sampling rejects the draft's token)."""
    from megatron_rlhf.generation.draft import teacher_topk, topk_tv_loss

    t, d = torch.randn(2, 4, 300) * 3, torch.randn(2, 4, 300, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    head = torch.arange(0, 300, 2)
    index, logp = teacher_topk(t, mask, head, k=150)
    ref = []
    for b, j in mask.nonzero().tolist():
        p = torch.softmax(t[b, j, head], -1)
        q = torch.softmax(d[b, j, head].detach(), -1)
        ref.append(0.5 * (p - q).abs().sum())
    loss = topk_tv_loss(d, mask, index, logp, head)
    assert torch.allclose(loss, torch.stack(ref).mean(), atol=1e-5)
    loss.backward()
    assert d.grad[mask == 0].abs().sum() == 0 and d.grad[mask == 1].abs().sum() > 0


def _train_draft_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "train_draft.py"
    spec = importlib.util.spec_from_file_location("train_draft_tool", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_responses_cache_reuses_only_matching_runs(tmp_path, monkeypatch):
    """--responses-cache: the second run with the same target, prompts and sampling flags
    reads the responses back; any change to them generates anew (and both are kept)."""
    tool = _train_draft_module()
    calls = []

    def fake_generate(target, prompts, args):
        calls.append([list(p) for p in prompts])
        return [[len(calls), *p] for p in prompts]

    monkeypatch.setattr(tool, "generate_responses", fake_generate)
    cache = tmp_path / "responses.json"
    args = tool.parse_args(["--target", str(tmp_path / "t"), "--save", str(tmp_path / "d"),
                            "--responses-cache", str(cache)])
    first = tool.cached_responses(None, [[1, 2], [3]], args, "train")
    assert cache.exists() and len(calls) == 1
    assert tool.cached_responses(None, [[1, 2], [3]], args, "train") == first and len(calls) == 1
    args.temperature = 0.7  # another sampling setting: new responses
    other = tool.cached_responses(None, [[1, 2], [3]], args, "train")
    assert len(calls) == 2 and other != first
    args.temperature = 1.0
    assert tool.cached_responses(None, [[1, 2], [3]], args, "train") == first and len(calls) == 2
    assert tool.cached_responses(None, [[1, 2]], args, "validation") and len(calls) == 3
