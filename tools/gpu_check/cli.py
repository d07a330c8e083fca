"""The GPU check's command line: ``python -m gpu_check`` with tools/ on PYTHONPATH, as
``tools/gpu_check.sh`` runs it (``bash tools/gpu_check.sh [--smoke] [--out DIR] [--budget-s S]``).
Writes the header, runs every stage of ``stages.PLAN`` within the budget, each process group in
a process of its own, and prints the table whatever happens (a watchdog, the last resort, writes
and prints it too); exit status 0 when every stage passed or was skipped."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import shutil
import sys
import threading

from gpu_check import budget
from gpu_check.environment import _decode_attention, _versions
from gpu_check.faults import parse_faults
from gpu_check.processes import end_process, not_run, numerics, run_groups
from gpu_check.report import Report
from gpu_check.stages import STAGES, Check

OUT_FILES = ("summary.json", "measurements.jsonl", "table.txt", "logs.txt", "ppo_metrics.jsonl",
             "grpo_metrics.jsonl")


def _watchdog(check: Check, seconds: float) -> threading.Timer:
    """After ``seconds``: end the running stage's process (TIMEOUT), list the stages not run,
    write and print the table, dump every thread's stack and exit 3."""
    def fire():
        if check.child is not None and check.child.is_alive():
            end_process(check.child)
        row = check.current
        if row is not None:
            row.update(status="TIMEOUT", details=f"still running at the {seconds:.0f} s watchdog")
        not_run(check, f"the watchdog ended the check at {seconds:.0f} s")
        check.report.finished = True
        print(check.report.save(), flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


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
                   help=f"seconds for the stages, the install not counted (default: "
                        f"{budget.DEFAULT_BUDGET_S:g} on the 1b shape, none with --smoke): a stage "
                        "whose minimum no longer fits is skipped, one past its deadline is ended "
                        f"(TIMEOUT); a watchdog ends the check {budget.WATCHDOG_S:g} s after it")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="every generating stage (and the training runs) decodes eagerly")
    p.add_argument("--install-s", type=float, default=None,
                   help="seconds gpu_check.sh spent installing (the install row; not in the budget)")
    p.add_argument("--installed", default="", help="what gpu_check.sh installed (the install row)")
    p.add_argument("--install-error", default="",
                   help="why gpu_check.sh's install failed (the install row FAILs; the stages run "
                        "when megatron.core imports)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--record-sizes", action="store_true",
                   help="with --smoke: write each passed stage's seconds to gpu_check/stage_sizes.json")
    p.add_argument("--fake-stages", action="store_true",
                   help="test hook: every stage is a stand-in that passes at once (minimum 1 s)")
    p.add_argument("--fake-fault", action="append", default=[], metavar="STAGE:KIND",
                   help="test hook: STAGE meets KIND (hang, cuda, abort, segfault, kill-check) in its process")
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}")
    if args.budget_s is None and not args.smoke:
        args.budget_s = budget.DEFAULT_BUDGET_S
    if args.record_sizes and not (args.smoke and not args.fake_stages):
        p.error("--record-sizes measures the real --smoke run")
    try:
        parse_faults(args.fake_fault)
    except ValueError as e:
        p.error(str(e))
    return args


def prepare(args: argparse.Namespace) -> Check:
    """The check with its report (the header written, old outputs removed), the install row
    recorded; no stage run yet."""
    check = Check(args)
    s = check.shape
    header = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": "smoke" if args.smoke else "1b",
        # on CUDA the first stage process names them: this process makes no CUDA context
        "device": "cuda (not yet named)" if check.cuda else "cpu",
        "python": sys.version.split()[0], **_versions(),
        "decode_attention": "?" if check.cuda else _decode_attention(s, check.dev),
        "cuda_graphs": check.graph_state,
        "model": f"Llama {s.layers}x{s.hidden} h{s.heads}/{s.kv_heads} ffn {s.ffn}",
        "budget": f"{args.budget_s:g} s" if args.budget_s else "none",
        "install_s": args.install_s,
        "work": str(check.work), "argv": sys.argv[1:],
    }
    if check.out.exists():
        for name in OUT_FILES:
            (check.out / name).unlink(missing_ok=True)
    if not args.work:  # the stage processes share it
        args.work = str(check.work)
        args.work_is_temporary = True
    check.report = Report(check.out, header)
    check.record_install()
    return check


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    numerics()
    check = prepare(args)
    h = check.report.header
    watchdog = _watchdog(check, check.remaining() + budget.WATCHDOG_S) if args.budget_s else None
    print(f"GPU check: {h['device']}, torch {h['torch']} (CUDA {h['cuda']}, cuDNN {h['cudnn']}), "
          f"megatron-core {h['megatron_core']}, transformers {h['transformers']}, flash-attn {h['flash_attn']}, "
          f"cuda graphs {h['cuda_graphs']}, budget {h['budget']}; "
          f"out {check.out}, work {check.work}", file=sys.stderr, flush=True)
    try:
        run_groups(check)
    finally:  # the table is written and printed whatever happened
        try:
            check.free()
        finally:
            if watchdog is not None:
                watchdog.cancel()
            not_run(check, "the check ended early")
            check.report.finished = True
            print(check.report.save(), flush=True)
    if args.record_sizes:
        data = budget.record(check.report.stages, h["device"])
        print(f"stage sizes -> {budget.SIZES}: {data['seconds']}", file=sys.stderr)
    if getattr(args, "work_is_temporary", False):
        shutil.rmtree(check.work, ignore_errors=True)
    return 0 if check.report.passed() else 1
