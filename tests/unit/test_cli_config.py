"""The CLI is generated from the config dataclasses: each flag's default is its field's, every
flag has help, no default is declared twice, and every float field refuses NaN and infinities."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
from pathlib import Path

import pytest

from megatron_rlhf import arguments, flags
from megatron_rlhf.config import (
    CONFIGS,
    ConfigError,
    EvalConfig,
    FinetuneConfig,
    FinetuneOptimConfig,
    GenerationConfig,
    LoopConfig,
    MigrationConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PPOConfig,
    PreferenceConfig,
    PrecisionConfig,
    RewardConfig,
    SpecConfig,
    preset,
)

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {"train": ["--actor-load", "A", "--reward-fn", "concise"],
            "generate": ["--load", "L", "--prompt", "p"],
            "sft": ["--load-model", "M", "--data", "d"], "rm": ["--load-model", "M", "--data", "d"]}
# the dataclasses each entry point builds its flags from (the first one holding a field wins)
SOURCES = {
    "train": (RewardConfig, PPOConfig, EvalConfig, OptimConfig, LoopConfig, ParallelConfig,
              PrecisionConfig, GenerationConfig, SpecConfig, MigrationConfig),
    "generate": (ParallelConfig, PrecisionConfig, GenerationConfig, SpecConfig, MigrationConfig),
    "sft": (FinetuneConfig, FinetuneOptimConfig, ParallelConfig, PrecisionConfig),
    "rm": (PreferenceConfig, FinetuneOptimConfig, ParallelConfig, PrecisionConfig),
}


def parser(name: str) -> argparse.ArgumentParser:
    """The entry point's parser, caught as it parses."""
    from megatron_rlhf import generate, train
    from megatron_rlhf.finetune import run

    if name in ("sft", "rm"):
        return run.parser(name, name, "")
    got = {}
    real = argparse.ArgumentParser.parse_args

    def catch(self, *a, **k):
        got["p"] = self
        return real(self, *a, **k)

    argparse.ArgumentParser.parse_args = catch
    try:
        {"train": train, "generate": generate}[name].parse_args(REQUIRED[name])
    finally:
        argparse.ArgumentParser.parse_args = real
    return got["p"]


@pytest.mark.parametrize("name", list(SOURCES))
def test_every_flag_defaults_to_its_field_and_has_help(name):
    p = parser(name)
    args = p.parse_args(REQUIRED[name])
    dests = {a.dest for a in p._actions}
    checked = 0
    for cls in SOURCES[name]:
        for f in dataclasses.fields(cls):
            if f.name not in dests or f.metadata.get("required"):
                continue
            owner = next(c for c in SOURCES[name] if f.name in {g.name for g in dataclasses.fields(c)})
            want = {g.name: g.default for g in dataclasses.fields(owner)}[f.name]
            assert getattr(args, f.name) == want and type(getattr(args, f.name)) is type(want), \
                f"{name}: {flags.flag_of(f.name)} defaults to {getattr(args, f.name)!r}, {owner.__name__}.{f.name} to {want!r}"
            checked += 1
    assert checked > 10
    for a in p._actions:
        if a.option_strings and a.dest != "help":
            assert a.help and a.help.strip() and a.help != argparse.SUPPRESS, f"{name}: {a.option_strings} has no help"


def test_the_defaults_users_had_stay():
    """The values a user of each command got before the CLI was generated (the six that
    arguments.py and set_defaults declared apart from the dataclasses among them)."""
    train = parser("train").parse_args(REQUIRED["train"])
    assert (train.micro_batch_size, train.num_draft_tokens, train.max_draft_tokens) == (4, "auto", 4)
    assert (train.migration_interval, train.migration_threshold, train.sequence_parallel) == (4, 0.25, False)
    assert train.lr == 1e-6 and train.seed == 1234 and train.chat is True
    for stage, loss in (("sft", None), ("rm", "bradley-terry")):
        ft = parser(stage).parse_args(REQUIRED[stage])
        assert (ft.micro_batch_size, ft.lr, getattr(ft, "loss", None)) == (4, 1e-5, loss)
        assert (ft.global_batch_size, ft.train_iters) == (16, 100)
    gen = parser("generate").parse_args(REQUIRED["generate"])
    assert gen.chat is False and gen.seed == 1234 and gen.micro_batch_size is None


@pytest.mark.parametrize("name", list(SOURCES))
def test_help_works(name, capsys):
    with pytest.raises(SystemExit) as e:
        parser(name).parse_args(["--help"])
    assert e.value.code == 0 and "--" in capsys.readouterr().out


# ---------------------------------------------------------------- one declaration only
ENTRY_SOURCES = ["megatron_rlhf/arguments.py", "megatron_rlhf/train.py", "megatron_rlhf/generate.py",
                 "megatron_rlhf/train_rm.py", "megatron_rlhf/train_sft.py", "megatron_rlhf/finetune/run.py"]


def config_flags() -> set[str]:
    """Flags that set a field of a config dataclass (the model overrides excepted)."""
    out = set()
    for cls in CONFIGS:
        if cls is ModelConfig:
            continue
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag", "") is not None:
                out |= {flags.flag_of(f.name), flags.flag_of(f.name, off=True)}
    return out


def second_defaults(source: str, where: str) -> list[str]:
    """``set_defaults`` calls, and ``default=`` given to a flag that a config field declares."""
    known, found = config_flags(), []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr == "set_defaults":
            found.append(f"{where}:{node.lineno}: set_defaults")
        if node.func.attr == "add_argument":
            names = {a.value for a in node.args if isinstance(a, ast.Constant)}
            if names & known and any(k.arg == "default" for k in node.keywords):
                found.append(f"{where}:{node.lineno}: default= for {sorted(names & known)}")
    return found


def test_no_default_is_declared_twice():
    found = [x for path in ENTRY_SOURCES for x in second_defaults((ROOT / path).read_text(), path)]
    for path in (ROOT / "megatron_rlhf").rglob("*.py"):  # no set_defaults anywhere in the package
        found += [x for x in second_defaults(path.read_text(), str(path)) if x.endswith("set_defaults")]
    assert not found, found


def test_the_declaration_check_can_fail():
    bad = ('def f(p, g):\n    g.add_argument("--lr", type=float, default=1e-5)\n'
           '    p.set_defaults(micro_batch_size=4)\n    g.add_argument("--prompts", default=None)\n')
    assert [x.split(": ", 1)[1] for x in second_defaults(bad, "x")] == \
        ["default= for ['--lr']", "set_defaults"]


# ---------------------------------------------------------------- NaN and infinities
def _float_fields():
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            if float in flags.field_kinds(cls, f.name)[0]:
                yield cls, f.name


FLOAT_FIELDS = list(_float_fields())


def test_float_fields_are_found():
    names = {f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS}
    assert {"GenerationConfig.temperature", "PPOConfig.dual_clip", "ModelConfig.rotary_base",
            "MigrationConfig.migration_threshold", "FinetuneConfig.beta"} <= names
    assert {c for c, _ in FLOAT_FIELDS} >= set(CONFIGS) - {ParallelConfig, PrecisionConfig, LoopConfig}


@pytest.mark.parametrize("cls,name", FLOAT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FLOAT_FIELDS])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused(cls, name, value):
    base = preset("tiny").to_dict() if cls is ModelConfig else {}
    with pytest.raises(ConfigError, match=f"^{name} must be a finite number") as e:
        cls(**{**base, name: value})
    assert e.value.fields == (name,)
    assert flags.cli_message(e.value).startswith(f"{flags.flag_of(name)} must be a finite number")


@pytest.mark.parametrize("command,extra,message", [
    ("generate", ["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    ("generate", ["--top-p", "inf"], "--top-p must be a finite number, got inf"),
    ("train", ["--kl-coef", "inf"], "--kl-coef must be a finite number, got inf"),
    ("train", ["--migration-threshold", "nan"], "--migration-threshold must be a finite number"),
    ("rm", ["--beta", "nan"], "--beta must be a finite number, got nan"),
    ("sft", ["--lr=-inf"], "--lr must be a finite number, got -inf"),
])
def test_the_cli_refuses_nan_before_reading_anything(command, extra, message, capsys, monkeypatch):
    """The entry point's pre-flight check stops on the flag (exit 2) before it opens a
    checkpoint (none exists here) or starts a collective."""
    from megatron_rlhf import generate, train
    from megatron_rlhf.finetune import run

    monkeypatch.setenv("RANK", "0")
    validate = {"generate": generate.validate, "train": train.validate}.get(command, run.validate)
    args = parser(command).parse_args(REQUIRED[command] + extra)
    with pytest.raises(SystemExit) as e:
        arguments.validated(validate, args)
    assert e.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_park_optimizer_takes_auto_on_or_off(capsys):
    """--park-optimizer: auto by default, on or off; anything else refused by the CLI and
    by ParallelConfig, the flag named."""
    p = parser("train")
    assert p.parse_args(REQUIRED["train"]).park_optimizer == "auto"
    assert p.parse_args(REQUIRED["train"] + ["--park-optimizer", "off"]).park_optimizer == "off"
    with pytest.raises(SystemExit):
        p.parse_args(REQUIRED["train"] + ["--park-optimizer", "maybe"])
    assert "invalid choice: 'maybe'" in capsys.readouterr().err
    with pytest.raises(ConfigError) as e:
        ParallelConfig(park_optimizer="maybe")
    assert "--park-optimizer 'maybe': use auto, on or off" in flags.cli_message(e.value)
