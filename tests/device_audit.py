"""Run ``megatron_rlhf.train`` with every RLHF iteration audited for device discipline.

    python tests/device_audit.py REPORT.json TRAIN_ARGS...

On a GPU every tensor a stage makes must live on the rank's device: a tensor factory
(``torch.zeros``, ``torch.tensor``, ...) called without a device puts its tensor on the
CPU, and the next op that meets a CUDA tensor fails (how the loop first crashed on an
H200) or copies it over with a host sync. A CPU run cannot tell the two devices apart, so
this audit looks at the calls themselves: during each iteration, every factory call made
from ``megatron_rlhf``'s own code must name its device (``device="cpu"`` where a host
tensor is meant). The offending call sites go to ``REPORT.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

PACKAGE = str(Path(__file__).resolve().parents[1] / "megatron_rlhf")
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.arange, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye,
}


class DeviceAudit(TorchFunctionMode):
    """Records ``file:line`` of factory calls without a device made from the package."""

    def __init__(self):
        super().__init__()
        self.sites: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)
            # (the CPU shim's mode forwards megatron's own calls: not the package's)
            if caller.f_code.co_filename.startswith(PACKAGE) and caller.f_code.co_name != "__torch_function__":
                site = f"{caller.f_code.co_filename[len(PACKAGE) - len('megatron_rlhf'):]}:{caller.f_lineno}"
                self.sites[site] = self.sites.get(site, 0) + 1
        return func(*args, **kwargs)


def main() -> int:
    report, argv = Path(sys.argv[1]), sys.argv[2:]
    from megatron_rlhf import train
    from megatron_rlhf.rlhf.trainer import RLHFTrainer

    audit = DeviceAudit()
    iteration = RLHFTrainer.iteration

    def audited(self, it):
        with audit:
            return iteration(self, it)

    RLHFTrainer.iteration = audited
    code = train.main(argv)
    Path(f"{report}.{os.environ.get('RANK', '0')}").write_text(json.dumps(audit.sites, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
