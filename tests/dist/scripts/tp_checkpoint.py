"""Under torchrun (2 ranks), for each model family named: TP=2 logits of its converted
checkpoint (ROOT/NAME/mcore); save a TP=2 model; load it again under a second layout
(TP=1 x DP=2) in the same program. Results in ROOT/NAME. One launch for every family."""

import sys
from pathlib import Path

import torch

from megatron_rlhf import runtime
from megatron_rlhf.config import preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import load_checkpoint, save_checkpoint
from megatron_rlhf.models.forward import lm_logits
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout


def ids(vocab):
    return torch.randint(0, vocab, (3, 13), generator=torch.Generator().manual_seed(5))


def main(root: Path, names: list[str]):
    runtime.quiet_third_party_warnings()
    rank, world = runtime.init_distributed()
    tp2 = build_process_groups(Layout(tp=2))
    dp2 = build_process_groups(Layout(tp=1, dp=2))  # a second layout of the same ranks
    assert tp2.tp.size() == 2 and dp2.tp.size() == 1 and dp2.dp.size() == 2
    for name in names:
        family(rank, tp2, dp2, root / name / "mcore", root / name, name)


def family(rank, tp2, dp2, converted: Path, out: Path, preset_name: str):

    model = build_model(preset(preset_name), "actor", tp2, dtype=torch.float32, seed=99)
    info = load_checkpoint(model, tp2, converted)
    with torch.no_grad():
        hf_logits_tp2 = lm_logits(model, ids(info.config.vocab_size))

    rand = build_model(info.config, "actor", tp2, dtype=torch.float32, seed=11)
    save_checkpoint(out / "ck_tp2", 1, rand, tp2)
    with torch.no_grad():
        rand_tp2 = lm_logits(rand, ids(info.config.vocab_size))

    other = build_model(info.config, "actor", dp2, dtype=torch.float32, seed=12)
    load_checkpoint(other, dp2, out / "ck_tp2")
    with torch.no_grad():
        rand_dp2 = lm_logits(other, ids(info.config.vocab_size))
    err = ((rand_dp2 - rand_tp2).norm() / rand_tp2.norm()).item()
    assert err < 1e-6, f"rank {rank}: layouts disagree, rel err {err}"
    if rank == 0:
        torch.save({"hf_logits_tp2": hf_logits_tp2, "rand_tp2": rand_tp2,
                    "ids": ids(info.config.vocab_size)}, out / "result.pt")
        print("OK", preset_name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
