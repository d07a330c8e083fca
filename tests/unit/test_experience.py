"""Experience packing: scores, values and log-probs read from a padded batch equal those
of each sample run alone."""

import torch

from megatron_rlhf.config import preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import lm_logits, token_values
from megatron_rlhf.rlhf.batch import Experience, pack
from megatron_rlhf.rlhf.experience import response_logprobs, response_values, reward_model_scores

PROMPTS = [[3, 4, 5], [6], [7, 8, 9, 10, 11]]
RESPONSES = [[12, 13], [14, 15, 16, 17], []]


def _experience():
    ids, att, mask = pack(PROMPTS, RESPONSES, pad_id=0)
    z = torch.zeros_like(mask)
    return Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=z,
                      ref_logprobs=z, scores=torch.zeros(3), kl=z, advantages=z)


def test_pack_layout():
    exp = _experience()
    assert exp.prompt_len == 5 and exp.response_mask.shape == (3, 4)
    assert exp.input_ids[1].tolist() == [0, 0, 0, 0, 6, 14, 15, 16, 17]
    assert exp.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]
    assert exp.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def test_padded_batch_matches_samples_alone(world1):
    cfg = preset("tiny")
    reward = build_model(cfg, "reward", world1, dtype=torch.float32)
    torch.nn.init.normal_(reward.output_layer.weight)  # a non-trivial value head
    actor = build_model(cfg, "actor", world1, dtype=torch.float32)
    exp = _experience()
    scores = reward_model_scores(reward, exp, micro_batch_size=2)
    values = response_values(reward, exp, micro_batch_size=2)
    logps = response_logprobs(actor, exp, micro_batch_size=2)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            seq = torch.tensor([p + r])
            v = token_values(reward, seq)[0]
            assert torch.allclose(scores[i], v[-1], atol=1e-5)  # last token of the response
            n = len(r)
            assert torch.allclose(values[i, :n], v[len(p) - 1:len(p) + n - 1], atol=1e-5)
            assert (values[i, n:] == 0).all()
            logits = lm_logits(actor, seq)[0]
            want = torch.log_softmax(logits, -1)[torch.arange(len(p) - 1, len(p) + n - 1), r]
            assert torch.allclose(logps[i, :n], want, atol=1e-5)
            assert (logps[i, n:] == 0).all()


def test_a_model_on_a_layout_of_its_own_gives_the_same_experience(world1):
    """The placement path (token lists to the model's data-parallel ranks, per-sample rows
    back by global sample index; here one process, its samples in another order) gives the
    experience the model computes in place: reference log-probs, reward scores, values, and
    the critic's training batch (values and returns of the samples it holds)."""
    from megatron_rlhf.config import PPOConfig
    from megatron_rlhf.rlhf.experience import ExperienceMaker
    from megatron_rlhf.rlhf.placement import Share

    class Rollout:
        def responses(self):
            return RESPONSES
        response_logprobs = sampling_logprobs = torch.zeros(3, 4)
        finish_reasons = ["eos", "length", "eos"]

    cfg = preset("tiny")
    ref = build_model(cfg, "reference", world1, dtype=torch.float32, seed=5)
    critic = build_model(cfg, "critic", world1, dtype=torch.float32, seed=6)
    reward = build_model(cfg, "reward", world1, dtype=torch.float32, seed=7)
    for m in (critic, reward):
        torch.nn.init.normal_(m.output_layer.weight)
    ppo = PPOConfig(global_batch_size=3, rollout_n=1, micro_batch_size=2, advantage_estimator="gae",
                    recompute_logprobs=True)
    actor = build_model(cfg, "actor", world1, dtype=torch.float32, seed=8)  # (old log-probs recomputed)
    maker = ExperienceMaker(ppo, ref, critic=critic, reward_model=reward, actor=actor)
    here = maker.make(PROMPTS, ["a", "b", "c"], Rollout(), first_index=10)
    maker.placed = {n: Share([12, 10, 11]) for n in ("reference", "critic", "reward", "critic_train", "actor")}
    maker.placed["actor_train"] = Share([11])
    apart = maker.make(PROMPTS, ["a", "b", "c"], Rollout(), first_index=10)
    for f in ("old_logprobs", "ref_logprobs", "scores", "values", "returns", "advantages"):
        torch.testing.assert_close(getattr(apart, f), getattr(here, f), rtol=1e-5, atol=1e-6, msg=f)
    assert not torch.equal(here.old_logprobs, here.ref_logprobs)  # (two models: the rows are told apart)
    # the training calls' batches: the critic's samples 12, 10, 11, the actor's 11
    for name, order, fields in (("critic_train", [2, 0, 1], ("values", "returns")),
                                ("actor_train", [1], ("old_logprobs", "ref_logprobs", "advantages"))):
        batch = maker.on_layout(apart, name, [10, 11, 12])
        assert batch.input_ids.shape[0] == len(order)
        for row, i in enumerate(order):
            n = len(RESPONSES[i])
            for f in fields:
                torch.testing.assert_close(getattr(batch, f)[row, :n], getattr(here, f)[i, :n], msg=f)
            assert batch.response_mask[row].sum() == n
            assert batch.input_ids[row, -batch.response_mask.shape[1]:][:n].tolist() == RESPONSES[i]
    maker.placed["actor_train"] = Share([])  # a rank outside the actor's layout
    assert maker.on_layout(apart, "actor_train", [10, 11, 12]) is None


LONG_PROMPTS = [[3, 4], [5, 6, 7, 8, 9, 10], [11], [12, 13, 14], [15, 16, 17, 18], [19]]
LONG_RESPONSES = [[20, 21, 22, 23, 24, 25, 26], [27], [], [28, 29], [30, 31, 32, 33], [34, 35, 36]]


def _long_experience():
    ids, att, mask = pack(LONG_PROMPTS, LONG_RESPONSES, pad_id=0)
    adv = torch.linspace(-1, 1, mask.numel()).view_as(mask) * mask
    z = torch.zeros_like(mask)
    return Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=z,
                      ref_logprobs=z, scores=torch.arange(6.0), kl=z, advantages=adv)


def test_micro_batches_run_no_column_of_padding_alone():
    """Longest responses first; each micro-batch cut to the columns its rows use (the first
    prompt column and the last response column hold a real token of some row); every row
    keeps its tokens and per-token fields; ``order`` names each row's source."""
    exp = _long_experience()
    parts, order = exp.micro_batches(2)
    assert [p.batch_size for p in parts] == [2, 2, 2]
    assert order.tolist() == [0, 4, 5, 3, 1, 2]  # by response length, then prompt length
    for mb in parts:
        assert mb.attention_mask[:, 0].any() and mb.response_mask[:, -1].any()
    assert [tuple(p.input_ids.shape) for p in parts] == [(2, 11), (2, 6), (2, 7)]
    rows = [(mb, j) for mb in parts for j in range(mb.batch_size)]
    for (mb, j), src in zip(rows, order.tolist()):
        real = mb.input_ids[j][mb.attention_mask[j].bool()].tolist()
        assert real == LONG_PROMPTS[src] + LONG_RESPONSES[src]
        n = len(LONG_RESPONSES[src])
        assert torch.equal(mb.advantages[j, :n], exp.advantages[src, :n])
        assert mb.scores[j] == src
    one, _ = exp.micro_batches(2, one_width=True)  # a pipeline's micro-batches share one shape
    assert {tuple(p.input_ids.shape) for p in one} == {(2, 13)}  # 6 prompt + 7 response columns


def test_micro_batches_give_the_gradient_of_the_whole_batch(world1):
    """The PPO-style loss summed over the cut, reordered micro-batches has the gradient of
    the uncut batch in its own order."""
    from megatron_rlhf.rlhf.update import policy_forward

    actor = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=7)
    exp = _long_experience()

    def grads(micro_batches):
        actor.zero_grad(set_to_none=True)
        for mb in micro_batches:
            logp, _ = policy_forward(actor, mb)
            (logp * mb.advantages).sum().backward()
        return [p.grad.clone() for p in actor.parameters() if p.grad is not None]

    whole, cut = grads([exp]), grads(exp.micro_batches(2)[0])
    assert len(whole) == len(cut) > 0
    for a, b in zip(whole, cut):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_an_lm_scores_responses_without_logits_for_the_prompt(world1):
    """The vocabulary projection runs from the column before the first response token on;
    a value model's output keeps every column."""
    from megatron_rlhf.models.pipeline import model_output

    cfg = preset("tiny")
    exp = _long_experience()
    actor = build_model(cfg, "actor", world1, dtype=torch.float32)
    critic = build_model(cfg, "critic", world1, dtype=torch.float32)
    with torch.no_grad():
        assert model_output(actor, exp).shape[1] == exp.response_mask.shape[1] + 1
        assert model_output(critic, exp).shape[1] == exp.input_ids.shape[1]
