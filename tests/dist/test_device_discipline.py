"""Device discipline: every tensor an RLHF iteration makes names its device.

On an H200 the loop once crashed in iteration 1 because the experience stage was built on
the CPU. A CPU run cannot see that directly, so ``tests/device_audit.py`` runs the trainer
with every tensor factory call from the package audited during each iteration (see its
docstring): generation with a draft, the experience, GAE and GRPO, PPO updates, draft
distillation, and on two ranks migration, regrouping and reallocation between layouts.
"""

import json

import pytest

import rlhf_fixtures as F
from launch import ROOT, torchrun

AUDIT = str(ROOT / "tests" / "device_audit.py")
CASES = {
    "gae+draft": (1, dict(draft_distill=True, num_draft_tokens=2)),
    "grpo": (1, dict(advantage_estimator="grpo")),
    "layouts+migration": (2, dict(num_draft_tokens=2, train_layout="2x1x1", gen_layout="1x2")),
}


@pytest.fixture(scope="module")
def tiny(world1, tmp_path_factory):
    d = tmp_path_factory.mktemp("audit")
    return F.make_actor_checkpoint(d / "actor", world1), F.write_prompts(d / "prompts.jsonl")


@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_an_iteration_makes_names_its_device(tiny, tmp_path, case):
    ranks, flags = CASES[case]
    actor, prompts = tiny
    if "num_draft_tokens" in flags:
        flags = dict(flags, draft_load=str(actor))
    args = F.train_args(actor, prompts, tmp_path, train_iters=1, **flags)
    report = tmp_path / "audit.json"
    torchrun(ranks, [AUDIT, str(report), *args])
    for rank in range(ranks):
        sites = json.loads((tmp_path / f"audit.json.{rank}").read_text())
        assert sites == {}, f"rank {rank}: tensor factories without a device at {sites}"
