"""The GPU check's command line: ``python -m gpu_check`` with tools/ on PYTHONPATH, as
``tools/gpu_check.sh`` runs it (``bash tools/gpu_check.sh [--smoke] [--out DIR] [--budget-s S]``).
Writes the header, runs every stage of ``stages.PLAN`` within the budget (a watchdog ends a hung
run), prints the table; exit status 0 when every stage passed or was skipped."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import shutil
import sys
import threading

import torch

from gpu_check.environment import _decode_attention, _versions
from gpu_check.report import Report
from gpu_check.stages import STAGES, Check

OUT_FILES = ("summary.json", "measurements.jsonl", "table.txt", "logs.txt", "ppo_metrics.jsonl",
             "grpo_metrics.jsonl")


def _watchdog(check: Check, seconds: float) -> None:
    """After ``seconds``: mark the running stage as hung, write the summary, dump every
    thread's stack and exit, so a hang still returns results before the run is killed."""
    def fire():
        row = check.current
        if row is not None:
            row.update(status="FAIL", details=f"HUNG: still running at the {seconds:.0f} s watchdog")
        check.report.save()
        print(check.report.table(), flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU is fine): test the script")
    p.add_argument("--out", default=os.environ.get("OUT") or "out/gpu_check",
                   help="summary.json, measurements.jsonl, logs (default: $OUT, else out/gpu_check)")
    p.add_argument("--work", default=None, help="checkpoints and run directories (default: a new temp dir)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: .whl/tokenizer)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)} (convert is needed by the rest)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole check, the install included (default: 420 on the 1b "
                        "shape, none with --smoke): decode stages that no longer fit are skipped; "
                        "a watchdog ends a hung run 30 s after it")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="every generating stage (and the training runs) decodes eagerly")
    p.add_argument("--install-s", type=float, default=None,
                   help="seconds gpu_check.sh spent installing (the install row; counted in the budget)")
    p.add_argument("--installed", default="", help="what gpu_check.sh installed (the install row)")
    p.add_argument("--install-error", default="",
                   help="why gpu_check.sh's install failed (the install row FAILs; the stages run "
                        "when megatron.core imports)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}")
    if args.budget_s is None and not args.smoke:
        args.budget_s = 420.0
    return args


def prepare(args: argparse.Namespace) -> Check:
    """The check with its report (the header written, old outputs removed), the install row
    recorded; no stage run yet."""
    check = Check(args)
    s = check.shape
    header = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": "smoke" if args.smoke else "1b",
        "device": torch.cuda.get_device_name(0) if check.cuda else "cpu",
        "python": sys.version.split()[0], **_versions(),
        "decode_attention": _decode_attention(s, check.dev),
        "cuda_graphs": check.graph_state,
        "model": f"Llama {s.layers}x{s.hidden} h{s.heads}/{s.kv_heads} ffn {s.ffn}",
        "budget": f"{args.budget_s:g} s" if args.budget_s else "none",
        "install_s": args.install_s,
        "work": str(check.work), "argv": sys.argv[1:],
    }
    if check.out.exists():
        for name in OUT_FILES:
            (check.out / name).unlink(missing_ok=True)
    check.report = Report(check.out, header)
    check.record_install()
    return check


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    if torch.cuda.is_available():  # fp32 comparisons must not run in TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")

    check = prepare(args)
    h = check.report.header
    if args.budget_s:
        _watchdog(check, check.remaining() + 30)
    print(f"GPU check: {h['device']}, torch {h['torch']} (CUDA {h['cuda']}, cuDNN {h['cudnn']}), "
          f"megatron-core {h['megatron_core']}, transformers {h['transformers']}, flash-attn {h['flash_attn']}, "
          f"decode attention {h['decode_attention']}, cuda graphs {h['cuda_graphs']}, budget {h['budget']}; "
          f"out {check.out}, work {check.work}", file=sys.stderr, flush=True)
    check.run()
    check.free()
    check.report.save()
    print(check.report.table(), flush=True)
    if not args.work:
        shutil.rmtree(check.work, ignore_errors=True)
    if check.pg is not None:
        from megatron_rlhf import runtime

        runtime.shutdown()
    return 0 if check.report.passed() else 1
