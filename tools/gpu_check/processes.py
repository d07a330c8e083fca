"""Stages in processes of their own. Each process group of ``stages.PLAN`` runs in a spawned
process that sends its rows, measurements and goals to the parent through a pipe; the parent
holds no CUDA context and writes the table. A stage still running ``GRACE_S`` after its deadline
is ended (TIMEOUT). A process that dies (a signal, an abort) fails the stage it ran. After
either, or after a sticky CUDA error, the group goes on from its next stage in a fresh process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import warnings

import torch

from gpu_check.budget import GRACE_S
from gpu_check.stages import KIND, PLAN, STAGES, Check


class Relay:
    """A stage process's report: measurements and goals go to the parent."""

    def __init__(self, conn, header: dict):
        self.conn, self.header, self.stages = conn, header, []

    def measure(self, stage: str, **values) -> None:
        self.conn.send(("measure", {"stage": stage, **values}))

    def goal(self, name: str, value, target: str, met: bool | None) -> None:
        self.conn.send(("goal", (name, value, target, met)))


def numerics() -> None:
    """fp32 comparisons must not run in TF32 (set in every process that runs stages)."""
    warnings.filterwarnings("ignore")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")


def _child(args, work: str, blocked: str, header: dict, end: float | None, names: list[str],
           conn) -> None:
    """A stage process: run ``names`` in order (budget end ``end`` as ``time.time()``)."""
    from gpu_check.environment import _decode_attention

    args.work = work
    check = Check(args, blocked=blocked)

    def on_term(signum, frame):  # ended by the parent: the running subprocess's group goes too
        if check.proc is not None:
            try:
                os.killpg(check.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    numerics()
    if end is not None:
        check.deadline = time.perf_counter() + end - time.time()
    check.relay, check.report = conn, Relay(conn, header)
    device = torch.cuda.get_device_name(0) if check.cuda else "cpu"
    named = {"device": device}
    if not args.fake_stages:
        named["decode_attention"] = _decode_attention(check.shape, check.dev)
    check.report.header.update(named)
    conn.send(("header", named))
    functions = check.functions()
    if args.fake_stages or args.fake_fault:
        from gpu_check.faults import fake_functions

        functions = fake_functions(check, functions)
    for name in names:
        check.stage(name, functions[name], KIND[name])
        if check.poisoned:
            break
    if not check.poisoned:
        check.free()
        if check.pg is not None:
            from megatron_rlhf import runtime

            runtime.shutdown()
    conn.close()


def end_process(proc) -> None:
    """End a stage process: SIGTERM (it ends its subprocesses), then SIGKILL."""
    proc.terminate()
    proc.join(2)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _death(code) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _follow(check: Check, proc, conn) -> list[str]:
    """Take a stage process's news until it ends; returns the stages it gave a row."""
    rep, done = check.report, []
    row, end, started = None, None, 0.0
    while True:
        if conn.poll(0.2):
            try:
                kind, payload = conn.recv()
            except EOFError:
                break
            if kind == "start":
                (row, end), started = payload, time.time()
                rep.stages.append(row)
                check.current = row
                done.append(row["name"])
            elif kind == "row":
                if row is not None and rep.stages[-1] is row:
                    rep.stages[-1] = payload
                else:
                    rep.stages.append(payload)
                    done.append(payload["name"])
                row = check.current = None
            elif kind == "measure":
                rep.measure(**payload)
            elif kind == "goal":
                rep.goal(*payload)
            elif kind == "header":
                rep.header.update(payload)
            rep.save()
        elif not proc.is_alive():
            break
        if row is not None and end is not None and time.time() > end + GRACE_S:
            end_process(proc)
            row.update(status="TIMEOUT", seconds=time.time() - started,
                       details=f"ran past its deadline ({end - started:.0f} s): its process was ended")
            row = check.current = None
            rep.save()
            break
    proc.join(10)
    if proc.is_alive():  # stuck on its way out
        end_process(proc)
    if row is not None:  # started, never finished: the process died under it
        row.update(status="FAIL", seconds=time.time() - started,
                   details=f"its process died ({_death(proc.exitcode)})")
        check.current = None
        rep.save()
    return done


def run_groups(check: Check) -> None:
    """Every stage of ``PLAN`` in order, each process group in processes of its own (none for
    a group that runs no stage)."""
    groups: dict[str, list[str]] = {}
    for name, _, group in PLAN:
        groups.setdefault(group, []).append(name)
    for names in groups.values():
        if all(check.not_run(n) for n in names):
            for n in names:
                check.stage(n, None, KIND[n])
        else:
            run_group(check, names)


def run_group(check: Check, names: list[str]) -> None:
    """Run the stages ``names`` (one process group of ``PLAN``) in spawned processes."""
    ctx = multiprocessing.get_context("spawn")
    pending = list(names)
    while pending:
        recv, send = ctx.Pipe(duplex=False)
        left = check.remaining()
        end = time.time() + left if left != float("inf") else None
        proc = ctx.Process(target=_child, name=f"gpu_check {pending[0]}",
                           args=(check.args, str(check.work), check.blocked, dict(check.report.header),
                                 end, pending, send))
        proc.start()
        send.close()
        check.child = proc
        try:
            done = _follow(check, proc, recv)
        finally:  # whatever ends this process's run (an interrupt): the stage process ends too
            if proc.is_alive():
                end_process(proc)
            check.child = None
            recv.close()
        if not done:  # died before its first stage: the group's stages fail with it
            for n in pending:
                check.report.stages.append({"name": n, "status": "FAIL", "seconds": 0.0, "rows": [],
                                            "details": f"its process died before the stage "
                                                       f"({_death(proc.exitcode)})"})
            check.report.save()
            return
        pending = pending[pending.index(done[-1]) + 1:]


def not_run(check: Check, why: str) -> None:
    """Rows for the stages of ``PLAN`` that have none (the check ends early)."""
    seen = {s["name"] for s in check.report.stages}
    for n in STAGES:
        if n not in seen:
            check.report.stages.append({"name": n, "status": "SKIP", "skipped": "time", "seconds": 0.0,
                                        "rows": [], "details": f"not run: {why}"})
