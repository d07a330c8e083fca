"""The SLURM scripts of examples/llama2 run end to end, submitted with the shims of
tests/slurm (``sbatch``, ``srun``, ``scontrol``: N local "nodes", one torchrun agent each,
rendezvousing over c10d on localhost) on a tiny random model at 2 nodes x 2 gloo ranks:
HF checkpoint -> convert_hf -> generate, sft -> rm -> ppo. A resubmitted PPO job resumes,
also on 1 node; two agents give the metrics of one agent with the same world size; and a
node killed mid-iteration ends the job, whose next submission loses only that iteration.

The scripts run unchanged but for the sizes their header comments document (environment).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import rlhf_fixtures as F
from slurm.harness import Job, sbatch, wait_for


def heavy(test):
    """Multi-rank runs (torchrun agents with gloo ranks), like tests/dist's RLHF runs."""
    return pytest.mark.dist(pytest.mark.slow(test))


SCRIPTS = "examples/llama2"
DATA = F.ROOT / "megatron_rlhf" / "data"
POSITIONS = 640  # the shipped records fit --seq-length 600; PPO's --max-prompt-length 512 + 8
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}a{% endif %}")
"""A chat template the char tokenizer can encode (the scripts pass --chat or chat defaults)."""

# 2 ranks per node, TP=2 (so DP=2 over 2 nodes, DP=1 on one), fp32 on CPU
SMALL = dict(GPUS_PER_NODE=2, TP=2, PRECISION="fp32")
FINETUNE = dict(SMALL, SEQ_LENGTH=600, GLOBAL_BATCH_SIZE=4, MICRO_BATCH_SIZE=1, TRAIN_ITERS=2,
                EVAL_INTERVAL=2, SAVE_INTERVAL=2)
# 4 prompts x 4 responses = 16 samples: 4 mini-batches of micro-batches of 2 at DP=2 and DP=1
PPO = dict(SMALL, GLOBAL_BATCH_SIZE=4, MICRO_BATCH_SIZE=2, MAX_NEW_TOKENS=8, TRAIN_ITERS=3,
           SAVE_INTERVAL=1)


def make_hf_checkpoint(directory: Path) -> Path:
    """A random ``tiny`` Llama (vocabulary 28, 640 positions) with the char tokenizer, saved
    as a Hugging Face directory (safetensors), as a user would download one."""
    import torch
    import transformers

    from megatron_rlhf.config import preset
    from megatron_rlhf.models.hf_mapping import hf_config_dict

    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=F.VOCAB, max_position_embeddings=POSITIONS)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_dict(cfg)))
    model.save_pretrained(str(directory))
    tokenizer = F.char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return directory


def latest(run: Path) -> int:
    try:
        return int((run / "latest_checkpointed_iteration.txt").read_text())
    except (OSError, ValueError):  # none yet
        return 0


def iterations(rows: list[dict]) -> list[int]:
    return [r["iteration"] for r in rows]


# ---------------------------------------------------------------------------- the shims
PROBE = """#!/bin/bash
# what a job sees
#SBATCH --job-name=probe
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
echo "job $SLURM_JOB_NAME $SLURM_NNODES $SLURM_JOB_NODELIST $MASTER_ADDR $SLURM_SUBMIT_DIR $PWD $*"
srun bash -c 'echo "task $SLURM_PROCID node $SLURM_NODEID $SLURMD_NODENAME $SLURM_LOCALID $SLURM_NTASKS"'
srun bash -c 'exit $SLURM_NODEID'
"""


def test_shims_run_a_script_on_n_nodes(tmp_path):
    script = tmp_path / "probe.sbatch"
    script.write_text(PROBE)
    r = sbatch(str(script), "a", "b c", workdir=tmp_path, nodes=2)
    assert r.returncode == 1  # the last srun: node 1's task exits 1
    root = str(F.ROOT)
    assert f"job probe 2 node[0-1] localhost {root} {root} a b c" in r.output, r.output
    for rank in range(2):
        assert f"task {rank} node {rank} node{rank} 0 2" in r.output, r.output
    assert "srun: error: node1: task 1: Exited with exit code 1" in r.output
    r = sbatch(str(script), workdir=tmp_path)  # #SBATCH --nodes=3
    assert r.returncode == 2 and "task 2 node 2 node2 0 3" in r.output, r.output


# ---------------------------------------------------------------------------- the chain
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm")


@pytest.fixture(scope="module")
def converted(work):
    hf = make_hf_checkpoint(work / "hf")
    r = sbatch(f"{SCRIPTS}/convert_hf.sbatch", hf, work / "ckpt", workdir=work / "jobs", timeout=300)
    return SimpleNamespace(result=r.check(), ckpt=work / "ckpt")


def finetune(work: Path, stage: str, model: Path, data: str, role: str) -> SimpleNamespace:
    """``{stage}.sbatch`` on 2 nodes from ``model`` with ``data``; its last checkpoint's ``role``."""
    run = work / stage
    r = sbatch(f"{SCRIPTS}/{stage}.sbatch", model, DATA / data, run, nodes=2,
               workdir=work / "jobs", **FINETUNE).check()
    return SimpleNamespace(result=r, run=run, **{role: run / "iter_0000002" / role})


@pytest.fixture(scope="module")
def sft(work, converted):
    return finetune(work, "sft", converted.ckpt, "sft.jsonl", "actor")


@pytest.fixture(scope="module")
def rm(work, sft):
    return finetune(work, "rm", sft.actor, "preferences.jsonl", "reward")


def submit_ppo(sft, rm, run: Path, work: Path, nodes: int | None = None, **env) -> Job:
    return Job(f"{SCRIPTS}/ppo.sbatch", [sft.actor, rm.reward, run], work / "jobs", nodes,
               {k: str(v) for k, v in dict(PPO, **env).items()})


@pytest.fixture(scope="module")
def ppo(work, sft, rm):
    """The reference: PPO from the SFT actor and the reward model, 2 nodes x 2 ranks, 3
    iterations, a checkpoint after each (the script's default of 2 nodes: no --nodes)."""
    run = work / "ppo"
    r = submit_ppo(sft, rm, run, work).start().wait(timeout=600).check()
    return SimpleNamespace(result=r, run=run, metrics=F.read_metrics(run))


@heavy
def test_convert_hf_writes_a_checkpoint(converted):
    meta = json.loads((converted.ckpt / "iter_0000000" / "megatron_rlhf.json").read_text())
    assert meta["role"] == "actor" and latest(converted.ckpt) == 0
    assert "Submitted batch job" in converted.result.output


@heavy
def test_generate_on_two_nodes(work, converted):
    r = sbatch(f"{SCRIPTS}/generate.sbatch", converted.ckpt, "what is rlhf", nodes=2,
               workdir=work / "jobs", MAX_NEW_TOKENS=16, **SMALL).check()
    assert "[1 prompts, " in r.output, r.output[-3000:]


@heavy
def test_sft_and_rm_on_two_nodes(sft, rm):
    for run, name in ((sft.run, "actor"), (rm.run, "reward")):
        rows = F.read_metrics(run)
        assert [r["iteration"] for r in rows if r["iteration"] > 0] == [1, 2], rows
        assert latest(run) == 2 and (run / "iter_0000002" / name).is_dir()
    assert any("eval_accuracy" in r for r in F.read_metrics(rm.run))


@heavy
def test_ppo_on_two_nodes(ppo):
    assert iterations(ppo.metrics) == [1, 2, 3]
    assert latest(ppo.run) == 3
    assert all(r["reward_mean"] != 0.0 for r in ppo.metrics)  # scored by the reward model
    assert "done: 3 iterations" in ppo.result.output


# ---------------------------------------------------------------------------- resume
@heavy
def test_ppo_resubmitted_on_one_node_resumes(work, tmp_path, sft, rm, ppo):
    """The same command on 1 node (DP 2 -> 1) continues from the newest checkpoint."""
    run = tmp_path / "ppo"
    shutil.copytree(ppo.run, run)
    before = (run / "metrics.jsonl").read_text().splitlines()
    r = submit_ppo(sft, rm, run, work, nodes=1, TRAIN_ITERS=4).start().wait(timeout=600).check()
    assert "done: 1 iterations" in r.output, r.output[-3000:]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[:3] == before  # iterations 1-3 are the first job's, not rewritten
    assert iterations([json.loads(x) for x in lines]) == [1, 2, 3, 4]
    assert latest(run) == 4


@heavy
def test_one_agent_gives_the_metrics_of_two(work, tmp_path, sft, rm, ppo):
    """1 node x 4 ranks (one torchrun agent) == 2 nodes x 2 ranks (two agents, c10d)."""
    run = tmp_path / "ppo"
    submit_ppo(sft, rm, run, work, nodes=1, GPUS_PER_NODE=4).start().wait(timeout=600).check()
    one = F.read_metrics(run)
    assert iterations(one) == iterations(ppo.metrics)
    for a, b in zip(one, ppo.metrics):
        F.assert_metrics_equal(a, b, tol=0)  # bit-identical; timings, memory excluded (F.VOLATILE)


@heavy
def test_lost_node_ends_the_job_and_the_next_submission_resumes(work, tmp_path, sft, rm, ppo):
    """SIGKILL node 1 (its agent and workers) during iteration 2: node 0 stops on its own;
    resubmitted, the job restarts at iteration 2 (checkpoint 1 + 1) and repeats the
    uninterrupted run's iterations 2 and 3."""
    run = tmp_path / "ppo"
    job = submit_ppo(sft, rm, run, work).start()
    wait_for(lambda: latest(run) == 1, timeout=300, job=job, what="checkpoint 1")
    assert job.kill_node(1) > 0
    killed_at = job.elapsed()
    r = job.wait(timeout=300)  # node 0 is left to stop by itself: nothing else kills it
    assert r.returncode != 0
    stopped = r.elapsed_s - killed_at
    print(f"node 0 stopped {stopped:.1f} s after node 1 was killed")
    assert stopped < 60, f"node 0 took {stopped:.0f} s to stop"
    assert "srun: error: node0: task 0: Exited with exit code 1" in r.output, r.output[-6000:]
    # node 0's ranks fail in the first collective with a rank of node 1 and name the ranks
    # that never checked in at the rendezvous store: the two of the killed node
    lost = re.findall(r"error: rank (\d+): lost ranks (\d+) \(([^)]*)\), (\d+) \(([^)]*)\)", r.output)
    assert lost, r.output[-6000:]
    for survivor, a, where_a, b, where_b in lost:
        assert where_a == where_b and "node" in where_a, lost  # one node's two ranks
        assert survivor not in (a, b) and {a, b} == {lost[0][1], lost[0][3]}, lost
    assert "resubmit the job to resume from the last checkpoint" in r.output
    assert iterations(F.read_metrics(run)) == [1] and latest(run) == 1
    first = (run / "metrics.jsonl").read_text().splitlines()

    r = submit_ppo(sft, rm, run, work).start().wait(timeout=600).check()
    assert "done: 2 iterations" in r.output, r.output[-3000:]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[:1] == first
    rows = [json.loads(x) for x in lines]
    assert iterations(rows) == [1, 2, 3]
    for a, b in zip(rows, ppo.metrics):
        F.assert_metrics_equal(a, b, tol=0)  # resumed at the same world size: RNG states restored too
