"""Under torchrun (2 ranks): the chunked LM head (``rlhf.chunked_head``) at TP=2, with and
without sequence parallelism, and at PP=2 gives the unchunked head's log-probs, entropy and
gradients (every rank's own parameters, to within 1e-5 of each tensor's largest element).

Tiny fp32 actors (vocabulary 2000, padded to 2048: 1024 rows per TP rank); 4 responses of 65
tokens in all, in chunks of 16; a tempered, top-k truncated policy, a loss of log-probs and
entropy. Control: a temperature off by 0.05 is seen at TP=2.
"""

import torch

from megatron_rlhf import runtime
from megatron_rlhf.config import GenerationConfig, preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import set_head_chunk
from megatron_rlhf.models.pipeline import forward_backward
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.rlhf.batch import Experience, pack
from megatron_rlhf.rlhf.experience import response_logprobs
from megatron_rlhf.rlhf.update import policy_from_output

CHUNK = 16
POLICY = GenerationConfig(temperature=0.7, top_k=20)


def experience(policy=POLICY) -> Experience:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1990, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(2, 1990, (n,), generator=g).tolist() for n in (21, 9, 24, 11)]
    ids, att, mask = pack(prompts, responses, 0, torch.device("cpu"))
    zeros = torch.zeros_like(mask)
    return Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=zeros,
                      ref_logprobs=zeros, scores=torch.zeros(4), kl=zeros,
                      advantages=torch.randn(mask.shape, generator=g) * mask, policy=policy)


def run(model, exp: Experience, chunk: int, micro_batch_size: int):
    """``(log-probs of the experience's forward, {parameter: gradient})`` of a loss of the
    log-probs and the entropy, the head chunked by ``chunk`` (0: not)."""
    set_head_chunk(model, chunk)
    model.zero_grad(set_to_none=True)

    def loss(output, mb):
        logp, entropy = policy_from_output(model, output, mb)
        return ((logp * mb.advantages + 0.1 * entropy) * mb.response_mask).sum()

    forward_backward(model, exp.micro_batches(micro_batch_size, one_width=True)[0], loss)
    logp = response_logprobs(model, exp, micro_batch_size)
    set_head_chunk(model, 0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logp, grads


def equal(got, want) -> bool:
    return got.keys() == want.keys() and all(
        bool((got[n] - want[n]).abs().max() <= 1e-5 * want[n].abs().max().clamp(min=1e-30)) for n in want)


def check(pg, sp: bool, micro_batch_size: int, control: bool = False) -> None:
    model = build_model(preset("tiny-untied", vocab_size=2000), "actor", pg, dtype=torch.float32, seed=3,
                        sequence_parallel=sp)
    assert model.config.sequence_parallel is sp
    model.train()
    exp = experience()
    (lp, grads), (lp0, grads0) = run(model, exp, CHUNK, micro_batch_size), run(model, exp, 0, micro_batch_size)
    assert len(grads0) == len(list(model.parameters())) > 0
    assert (lp - lp0).abs().max() <= 1e-5 and (lp0 != 0).any(), (lp - lp0).abs().max()
    assert equal(grads, grads0), {n: float((grads[n] - grads0[n]).abs().max()) for n in grads0}
    if control:
        _, off = run(model, experience(GenerationConfig(temperature=0.75, top_k=20)), CHUNK, micro_batch_size)
        assert not equal(off, grads0)


def main():
    runtime.quiet_third_party_warnings()
    rank, _ = runtime.init_distributed()
    tp2 = build_process_groups(Layout(tp=2))
    check(tp2, sp=False, micro_batch_size=4, control=True)
    check(tp2, sp=True, micro_batch_size=4)
    pp2 = build_process_groups(Layout(pp=2))
    check(pp2, sp=False, micro_batch_size=2)  # two micro-batches through the 1F1B schedule
    if rank == 0:
        print("OK")
    runtime.shutdown()


if __name__ == "__main__":
    main()
