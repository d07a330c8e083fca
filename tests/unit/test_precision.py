"""The run's precision: --bf16 / --fp32, else a resumed run's own, else bf16 on a GPU and on a
CPU with bf16 instructions (read from /proc/cpuinfo, faked here: the result must not depend
on the machine the tests run on), and the run header that says which and why."""

import argparse

import pytest
import torch

from megatron_rlhf import arguments, runtime
from megatron_rlhf.runtime import devices

# /proc/cpuinfo excerpts (two processors each, as the file lists every one)
AVX512_BF16 = ("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\n"
               "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n")
AMX = ("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n\n"
       "processor\t: 1\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
AVX512_ONLY = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n\nprocessor\t: 1\nflags\t\t: fpu avx2 avx512f avx512bw\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16\n"  # no x86 flags line

BF16, FP32 = torch.bfloat16, torch.float32
NO_BF16 = "the CPU has no bf16 instructions (no amx_bf16 or avx512_bf16 flag)"


def test_cpu_flags_are_the_first_processors():
    assert devices.cpu_flags(AVX512_BF16) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert devices.cpu_flags(ARM) == frozenset() and devices.cpu_flags("") == frozenset()
    assert isinstance(devices.cpu_flags(), frozenset)  # this machine's, whatever they are


@pytest.mark.parametrize("cpuinfo,want", [
    (AVX512_BF16, (BF16, "the CPU reports avx512_bf16")),
    (AMX, (BF16, "the CPU reports amx_bf16 and avx512_bf16")),
    (AVX512_ONLY, (FP32, NO_BF16)),
    (ARM, (FP32, NO_BF16)),
    ("", (FP32, NO_BF16)),  # no /proc/cpuinfo
], ids=["avx512_bf16", "amx", "avx512-no-bf16", "arm", "none"])
def test_auto_is_bf16_where_the_cpu_has_bf16_instructions(cpuinfo, want):
    flags = devices.cpu_flags(cpuinfo)
    assert devices.choose_dtype(None, cuda=False, flags=flags) == want
    assert devices.choose_dtype(None, cuda=True, flags=flags) == (BF16, "the default on a GPU")
    for cuda in (False, True):  # the flags decide wherever they are given
        assert devices.choose_dtype(True, cuda=cuda, flags=flags) == (BF16, "--bf16")
        assert devices.choose_dtype(False, cuda=cuda, flags=flags) == (FP32, "--fp32")


def _cli(*extra) -> argparse.Namespace:
    from megatron_rlhf import train

    return train.parse_args(["--actor-load", "A", "--reward-fn", "concise", *extra])


@pytest.mark.parametrize("cpuinfo,want", [(AVX512_BF16, BF16), (AVX512_ONLY, FP32)], ids=["bf16-cpu", "fp32-cpu"])
def test_the_cli_default_reads_this_cpu(monkeypatch, cpuinfo, want):
    """Neither flag: the choice follows the CPU's flags (faked as another CPU's); a flag
    overrides it either way."""
    real = devices.cpu_flags
    monkeypatch.setattr(devices, "has_cuda", lambda: False)
    monkeypatch.setattr(devices, "cpu_flags", lambda text=None: real(cpuinfo if text is None else text))
    assert arguments.precision_from_args(_cli())[0] == want
    assert runtime.default_dtype() == want
    assert arguments.precision_from_args(_cli("--bf16")) == (BF16, "--bf16")
    assert arguments.precision_from_args(_cli("--fp32")) == (FP32, "--fp32")


def test_both_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _cli("--bf16", "--fp32")
    assert e.value.code == 2
    assert "argument --fp32: not allowed with argument --bf16" in capsys.readouterr().err


@pytest.mark.parametrize("saved", [BF16, FP32], ids=["bf16", "fp32"])
def test_a_resumed_run_keeps_its_precision(world1, tmp_path, monkeypatch, saved):
    """Resuming without a flag: the precision the resumed weights were saved in, whatever
    the CPU would choose; a flag still decides."""
    from megatron_rlhf.config import preset
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import save_checkpoint, stored_dtype

    ckpt = tmp_path / "actor"
    save_checkpoint(ckpt, 0, build_model(preset("tiny"), "actor", world1, dtype=saved, seed=1), world1)
    assert stored_dtype(ckpt) == saved
    assert stored_dtype(tmp_path / "nothing") is None  # (the checks that load it say why)
    other, cpu = (FP32, AVX512_ONLY) if saved == BF16 else (BF16, AVX512_BF16)  # a CPU that would choose otherwise
    real = devices.cpu_flags
    monkeypatch.setattr(devices, "has_cuda", lambda: False)
    monkeypatch.setattr(devices, "cpu_flags", lambda text=None: real(cpu if text is None else text))
    assert arguments.precision_from_args(_cli())[0] == other
    dtype, why = arguments.precision_from_args(_cli(), ckpt)
    assert dtype == saved and why == f"the resumed run's, as its checkpoint {ckpt} holds"
    flag = "--bf16" if other == BF16 else "--fp32"
    assert arguments.precision_from_args(_cli(flag), ckpt) == (other, flag)


def test_the_run_header_names_the_precision_and_why(world1, capsys):
    assert arguments.announce_precision(BF16, "the CPU reports avx512_bf16")
    assert "precision: bf16 (the CPU reports avx512_bf16)" in capsys.readouterr().err
    assert arguments.announce_precision(FP32, "--fp32")
    assert "precision: fp32 (--fp32)" in capsys.readouterr().err


def test_ranks_that_choose_differently_stop_the_run(world1, capsys, monkeypatch):
    """The automatic choice on nodes with different CPUs: no run, an error naming both."""
    import torch.distributed as dist

    chosen = [("bf16", "the CPU reports avx512_bf16")] * 2 + [("fp32", NO_BF16)] * 2
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), chosen))
    assert not arguments.announce_precision(BF16, "the CPU reports avx512_bf16")
    err = capsys.readouterr().err
    assert ("error: the ranks chose different precisions, bf16 on 2 ranks (rank 0: the CPU reports "
            f"avx512_bf16); fp32 on 2 ranks (rank 2: {NO_BF16}): give --bf16 or --fp32") in err
    assert "precision:" not in err
