"""The launch scripts under examples/ pass only flags the entry points accept (values that
come from shell variables are replaced by 1, array expansions dropped)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def entry_point_args(script: Path, module: str) -> list[list[str]]:
    """The arguments after ``-m module`` (or ``module`` when it is a path) of each invocation
    in ``script`` (continuations joined)."""
    text = script.read_text().replace("\\\n", " ")
    marker = module if module.endswith(".py") else f"-m {module}"
    calls = []
    pattern = re.escape(marker) + r"(?=\s|$)"  # not -m megatron_rlhf.train_sft for ...train
    for line in text.splitlines():
        if not re.search(pattern, line):
            continue
        args = re.split(pattern, line, maxsplit=1)[1].split()
        args = [a for a in args if not a.startswith('"${') or not a.endswith('[@]}"')]
        calls.append([("1" if re.fullmatch(r'"?\$[{]?\w+[}]?"?', a) else a) for a in args])
    return calls


@pytest.mark.parametrize("script,module", [
    ("examples/cpu_demo.sh", "megatron_rlhf.train"),
    ("examples/llama2/ppo.sbatch", "megatron_rlhf.train"),
    ("examples/llama2/generate.sbatch", "megatron_rlhf.generate"),
    ("examples/cpu_generate.sh", "megatron_rlhf.generate"),
    ("examples/cpu_demo.sh", "tools/train_draft.py"),
    ("examples/cpu_pipeline.sh", "megatron_rlhf.train_sft"),
    ("examples/cpu_pipeline.sh", "megatron_rlhf.train_rm"),
    ("examples/cpu_pipeline.sh", "megatron_rlhf.train"),
    ("examples/llama2/sft.sbatch", "megatron_rlhf.train_sft"),
    ("examples/llama2/rm.sbatch", "megatron_rlhf.train_rm"),
])
def test_example_flags_parse(script, module):
    import importlib
    import importlib.util

    calls = entry_point_args(ROOT / script, module)
    assert calls, f"{script} does not run {module}"
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location("example_tool", ROOT / module)
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        parse = tool.parse_args
    else:
        parse = importlib.import_module(module).parse_args
    for args in calls:
        parse(args)  # argparse exits (SystemExit) on an unknown flag or a bad value


def test_the_suite_collects_every_test_directory(pytestconfig):
    """Every directory of ``tests/`` holding ``test_*.py`` files is one pytest recurses into:
    pytest's default ``norecursedirs`` holds ``dist``, and ``tests/dist`` (TP, migration,
    device discipline, layouts) once ran in no suite at all."""
    from fnmatch import fnmatch

    patterns = pytestconfig.getini("norecursedirs")
    dirs = [d for d in (ROOT / "tests").iterdir() if d.is_dir() and any(d.glob("test_*.py"))]
    assert {d.name for d in dirs} >= {"unit", "dist", "e2e"}
    skipped = [d.name for d in dirs if any(fnmatch(d.name, p) for p in patterns)]
    assert not skipped, f"pytest does not recurse into {skipped} (norecursedirs {patterns})"
