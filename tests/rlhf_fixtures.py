"""Tiny RLHF runs for tests: a char-level tokenizer, a tiny actor checkpoint, prompt files,
reward functions (``--reward-fn rlhf_fixtures:NAME``) and a runner for ``megatron_rlhf.train``.

Token ids: ``<unk>`` = 0, ``</s>`` = 1 (EOS), ``a``..``z`` = 2..27; the model's vocabulary is
28 so every sampled id decodes to a letter or EOS.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
VOCAB = 28
POSITIONS = 64

PROMPTS = ["ab", "cde", "fghi", "jklmn", "opqrst", "uv", "wxy", "zabc", "defgh", "ijklmn",
           "op", "qrs", "tuvw", "xyzab", "cdefgh", "ijk"]
"""16 short lowercase prompts, 2-6 letters."""

VOLATILE = ("time_", "eval/time_", "peak_mem", "mem_", "gen_tokens_per_s", "gen_idle_", "gen_migrat", "gen_rounds_by",
            "realloc_", "gen_decode")
"""Metric keys that depend on the machine or the layout (memory), on how the samples were spread over the
data-parallel ranks (rounds, migrations, idle time), or on how decode steps ran, not on the
numbers (excluded from equality)."""


# ---------------------------------------------------------------------------- files
def char_tokenizer():
    """A ``transformers`` fast tokenizer: one token per letter, ``</s>`` as EOS and pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(ord("a") + i): i + 2 for i in range(26)} | {"<unk>": 0, "</s>": 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>",
                                   pad_token="</s>")


def make_actor_checkpoint(root: Path, pg, seed: int = 1234, positions: int | None = None,
                          name: str = "tiny") -> Path:
    """Save a random actor of preset ``name`` (vocabulary 28, 64 positions unless
    ``positions``) with the char tokenizer."""
    import torch

    from megatron_rlhf.config import preset
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import save_checkpoint

    cfg = preset(name, vocab_size=VOCAB, max_position_embeddings=positions or POSITIONS)
    model = build_model(cfg, "actor", pg, dtype=torch.float32, seed=seed)
    save_checkpoint(root, 0, model, pg, tokenizer=char_tokenizer())
    return root


def write_prompts(path: Path, prompts=PROMPTS) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


# ---------------------------------------------------------------------------- rewards
def nan_reward(sample) -> float:
    """NaN for the prompt "boom", else 0."""
    return float("nan") if sample.prompt == "boom" else 0.0


def raise_on_boom(sample) -> float:
    """Raises ValueError for the prompt "boom", else 0."""
    if sample.prompt == "boom":
        raise ValueError("boom prompt seen")
    return 0.0


def record_fields(sample) -> float:
    """Checks that the record's other fields arrived unchanged (records written by
    :func:`write_records`: ``answer`` = the prompt's length, ``info`` = {"p": prompt, "n":
    [1, 2]}), raising otherwise; ``flat`` records score 0.5 whatever the response (their
    groups' rewards are all equal), the others token parity."""
    want = {"answer": len(sample.prompt), "info": {"p": sample.prompt, "n": [1, 2]},
            "flat": sample.prompt.startswith(("a", "c", "e", "g", "i"))}
    got = {k: sample.meta.get(k) for k in want}
    if got != want:
        raise ValueError(f"record fields {sample.meta} != {want}")
    if got["flat"]:
        return 0.5
    from megatron_rlhf.rlhf.rewards import token_parity

    return token_parity(sample)


def write_records(path: Path, prompts=PROMPTS) -> Path:
    """The records :func:`record_fields` checks, as ``.jsonl``, ``.json`` or ``.parquet``."""
    rows = [{"text": p, "answer": len(p), "info": {"p": p, "n": [1, 2]},
             "flat": p.startswith(("a", "c", "e", "g", "i"))} for p in prompts]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------- running
def env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=f"{ROOT}:{TESTS}", OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore", **extra)


def train_args(actor: Path, prompts: Path, out: Path | None = None, /, **flags) -> list[str]:
    """CLI args of a tiny run; ``flags`` (``train_iters=4``) override the defaults, a value
    of None drops the flag, True makes it a bare switch."""
    base = dict(actor_load=str(actor), reward_fn="token_parity", no_chat=True,
                prompts=str(prompts), global_batch_size=4, rollout_n=2, micro_batch_size=4,
                max_prompt_length=8, max_new_tokens=6, temperature=1.0, lr=1e-3,
                critic_lr=1e-3, kl_coef=0.05, train_iters=2, seed=7, fp32=True)
    if out is not None:
        base.update(save=str(out / "save"), log_dir=str(out / "log"))
    base.update(flags)
    args = []
    for k, v in base.items():
        if v is None or v is False:
            continue
        args.append("--" + k.replace("_", "-"))
        if v is not True:
            args.append(str(v))
    return args


def run_train(args: list[str], timeout: int = 300, **env_extra) -> subprocess.CompletedProcess:
    """``python -m megatron_rlhf.train ARGS`` as one plain process; returns once it exits.

    Output goes through files, not pipes, and the process gets its own process group which
    is killed afterwards: a run killed mid-save leaves megatron's checkpoint-writer helper
    processes (its forked writers) behind, and they would hold a pipe open until the
    timeout.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-m", "megatron_rlhf.train", *args], cwd=ROOT,
                             env=env(**env_extra), stdout=out, stderr=err, text=True,
                             start_new_session=True)
        try:
            code = p.wait(timeout=timeout)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the run's own group: leftovers only
            except ProcessLookupError:
                pass
            p.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(p.args, code, out.read(), err.read())


def check_ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    return r


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def assert_metrics_equal(a: dict, b: dict, tol: float = 1e-5) -> None:
    """Every deterministic metric of two iterations agrees within ``tol`` (abs + rel)."""
    keys = {k for k in a.keys() | b.keys() if not k.startswith(VOLATILE)}
    missing = sorted(keys - (a.keys() & b.keys()))
    assert not missing, f"metrics only on one side: {missing}"
    def same(x, y):
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            return math.isclose(x, y, rel_tol=tol, abs_tol=tol)
        return x == y

    bad = {k: (a[k], b[k]) for k in sorted(keys) if not same(a[k], b[k])}
    assert not bad, f"iteration {a.get('iteration')}: metrics differ: {bad}"


# Runs the CLI once per case in one process, with torch.distributed.init_process_group
# replaced by a bomb: an error that reaches the user instead of the bomb was raised before
# any collective could start. One process for all cases saves an import of torch and
# transformers per case.
BOMB_RUNNER = """
import contextlib, io, json, os, sys
import torch.distributed as d
def bomb(*a, **k):
    raise SystemExit("BOMB: init_process_group reached")
d.init_process_group = bomb
from megatron_rlhf.train import main
results = []
for case in json.loads(sys.argv[1]):
    os.environ["WORLD_SIZE"] = str(case["world"])
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
        try:
            code = main(case["argv"])
        except SystemExit as e:
            code = e.code
    results.append({"code": code, "output": buf.getvalue()})
print("RESULTS " + json.dumps(results))
"""


def run_validation(cases: list[tuple[list[str], int]]) -> list[dict]:
    """``main(argv)`` with WORLD_SIZE=world for each ``(argv, world)``, collectives bombed;
    returns ``{"code": exit code, "output": what it printed}`` per case."""
    r = subprocess.run([sys.executable, "-c", BOMB_RUNNER,
                        json.dumps([{"argv": a, "world": w} for a, w in cases])],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULTS ")]
    assert r.returncode == 0 and line, f"runner failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return json.loads(line[-1][len("RESULTS "):])
