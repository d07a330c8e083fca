"""Fine-tuning losses and data (megatron_rlhf/finetune): the losses against plain loops,
SFT counting response tokens only, packed rows equal to each example alone."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.config import FinetuneConfig, preset
from megatron_rlhf.finetune import data as D
from megatron_rlhf.finetune import losses as L


def _logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def test_dpo_and_bradley_terry_equal_loops():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    beta, eps = 0.3, 0.1
    loss, chosen, rejected = L.dpo_loss(pc, pr, rc, rr, beta, label_smoothing=eps)
    for i in range(6):
        c, r = beta * (float(pc[i]) - float(rc[i])), beta * (float(pr[i]) - float(rr[i]))
        want = -(1 - eps) * _logsigmoid(c - r) - eps * _logsigmoid(r - c)
        assert float(loss[i]) == pytest.approx(want, rel=1e-12)
        assert float(chosen[i]) == pytest.approx(c) and float(rejected[i]) == pytest.approx(r)
    bt = L.bradley_terry_loss(pc, pr, margin=rc)
    for i in range(6):
        assert float(bt[i]) == pytest.approx(-_logsigmoid(float(pc[i]) - float(pr[i]) - float(rc[i])), rel=1e-6)


def test_sft_loss_counts_response_tokens_only():
    """Positions that predict prompt tokens (or padding) do not enter the loss: changing
    their logits changes nothing; changing one that predicts a response token does."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 11, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 7), generator=g)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]])
    total, count = L.sft_loss(logits, ids, mask)
    want = 0.0
    for b in range(2):
        for t in range(1, 7):
            if mask[b, t]:
                want -= float(torch.log_softmax(logits[b, t - 1], -1)[ids[b, t]])
    assert float(total) == pytest.approx(want, rel=1e-6) and float(count) == int(mask[:, 1:].sum())  # fp32 inside
    prompt_side = logits.clone()
    prompt_side[0, :2] += 5 * torch.randn(2, 11, generator=g, dtype=torch.float64)  # predict prompt tokens 1, 2
    prompt_side[0, 6] += 5.0  # after the last token: predicts nothing
    assert float(L.sft_loss(prompt_side, ids, mask)[0]) == pytest.approx(float(total), rel=1e-12)
    response_side = logits.clone()
    response_side[0, 3] += 5 * torch.randn(11, generator=g, dtype=torch.float64)  # predicts token 4
    assert float(L.sft_loss(response_side, ids, mask)[0]) != pytest.approx(float(total), rel=1e-6)


def test_packed_rows_equal_each_example_alone(world1):
    from megatron_rlhf.finetune.loop import forward
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.forward import logits_of

    model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=4).eval()
    g = torch.Generator().manual_seed(2)
    exs = [D.Example(torch.randint(2, 200, (p,), generator=g).tolist(),
                     torch.randint(2, 200, (r,), generator=g).tolist()) for p, r in ((3, 4), (5, 2), (2, 6))]
    packed = D.token_batch(D.pack(exs, width=32), pad_id=0, device="cpu")
    assert packed.input_ids.shape[0] == 1 and packed.examples == 3
    alone = D.token_batch(D.pack(exs), pad_id=0, device="cpu")
    with torch.no_grad():
        a = logits_of(model, forward(model, packed)).reshape(-1, 256)[:, :]
        b = logits_of(model, forward(model, alone)).reshape(-1, 256)
        flat_p, flat_a = packed.last.tolist(), alone.last.tolist()
        # the examples sit in the packed row longest first: map each by its last token
        for e, (lp, la) in enumerate(zip(sorted(flat_p), [flat_a[i] for i in _order(exs)])):
            n = sorted(exs, key=lambda x: -x.length)[e].length
            torch.testing.assert_close(a[lp - n + 1: lp + 1], b[la - n + 1: la + 1], rtol=1e-5, atol=1e-5)
        # control: one segment for the whole row lets later examples see earlier ones
        joined = D.TokenBatch(packed.input_ids, (packed.segments > 0).long(), packed.loss_mask, packed.last)
        c = logits_of(model, forward(model, joined)).reshape(-1, 256)
    assert not torch.allclose(c, a, atol=1e-3)


def _order(exs):
    """Indices of ``exs`` longest first (the packing order)."""
    return sorted(range(len(exs)), key=lambda i: -exs[i].length)


def test_records_encode_like_the_rlhf_prompts_and_bad_records_are_named(tmp_path):
    from megatron_rlhf.data.tokenizer import encode_prompt

    import rlhf_fixtures as F

    tok = F.char_tokenizer()
    eos = tok.convert_tokens_to_ids("</s>")
    (tmp_path / "sft.jsonl").write_text(
        '{"prompt": "abc", "response": "de"}\n'
        '{"messages": [{"role": "user", "content": "xy"}, {"role": "assistant", "content": "z"}]}\n')
    exs = D.sft_examples(D.read_jsonl(tmp_path / "sft.jsonl", D.SFT_KEYS), tok, eos, chat=False, max_len=16)
    assert exs[0].prompt == encode_prompt(tok, "abc", chat=False) and exs[0].response[-1] == eos
    assert exs[1].prompt == encode_prompt(tok, "xy", chat=False) and len(exs[1].response) == 2
    with pytest.raises(ValueError, match="record 0 has .* tokens .* more than --seq-length 4"):
        D.sft_examples(D.read_jsonl(tmp_path / "sft.jsonl", D.SFT_KEYS), tok, eos, chat=False, max_len=4)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "chosen": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a record needs string fields \['prompt', 'chosen', 'rejected'\]"):
        D.read_jsonl(tmp_path / "bad.jsonl", D.PAIR_KEYS)
    train, held = D.split_held_out(list(range(50)), 0.1, seed=3)
    assert len(held) == 5 and sorted(train + held) == list(range(50))
    assert D.split_held_out(list(range(50)), 0.1, seed=3) == (train, held)


def test_config_checks():
    from megatron_rlhf.flags import cli_message

    with pytest.raises(ValueError, match="pack applies to SFT only") as e:
        FinetuneConfig(loss="dpo", pack=True)
    assert cli_message(e.value) == "--pack applies to SFT only"
    with pytest.raises(ValueError, match="global_batch_size 10 must be a multiple of micro_batch_size 4 x") as e:
        FinetuneConfig(global_batch_size=10, micro_batch_size=4).check_data_parallel(1)
    assert cli_message(e.value).startswith("--global-batch-size 10 must be a multiple of --micro-batch-size 4 x")


def test_shipped_sets_are_well_formed():
    from pathlib import Path

    data = Path(D.__file__).parent.parent / "data"
    pairs = D.read_jsonl(data / "preferences.jsonl", D.PAIR_KEYS)
    sft = D.read_jsonl(data / "sft.jsonl", D.SFT_KEYS)
    assert len(pairs) == len(sft) >= 500
    assert all(len(p["rejected"]) > len(p["chosen"]) for p in pairs)
