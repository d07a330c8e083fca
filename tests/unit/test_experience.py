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
