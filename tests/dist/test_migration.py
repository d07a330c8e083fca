"""Sample migration between two data-parallel gloo ranks (tests/dist/scripts/migration.py)."""

import os
import subprocess
import sys
import time

import pytest

from launch import ROOT, SCRIPTS, _port, torchrun

pytestmark = [pytest.mark.dist]


@pytest.mark.shared_launch(2, "migration.py", timeout=900)  # in the launch shared with other scripts
def test_migration_changes_no_token_and_loses_nothing(shared_launch):
    """Tokens with migration on == off == DP=1, greedy and sampled, plain and both draft
    kinds, with uneven shares (a rank with none, a rank with all), samples finishing at
    prefill or right after a transfer; migrations happen for every kind."""
    r = shared_launch()
    assert "MIGRATION OK" in r.stdout, r.stdout[-2000:]


def test_migration_under_tensor_parallelism():
    """TP=2 x DP=2: every TP rank of a replica sends its own cache shards to the same TP
    rank of the other replica; tokens equal the replica generating alone."""
    r = torchrun(4, ["migration.py", "tp2"], timeout=900)
    assert "MIGRATION OK" in r.stdout, r.stdout[-2000:]


@pytest.mark.shared_launch(2, "migration.py", "graphs", timeout=900)
def test_migration_with_the_graphed_decode_step(shared_launch):
    """The same with the graphed step's code (run eagerly on CPU): rows leave the KV store
    by in-place compaction and arrive within its capacity."""
    r = shared_launch()
    assert "MIGRATION OK" in r.stdout, r.stdout[-2000:]


def test_a_rank_that_dies_mid_migration_is_named():
    """Rank 1 exits as it starts sending samples: rank 0 stops with an error that names
    it, long before the collective timeout (one minute here). The ranks are started
    directly, not by torchrun, whose agent would kill rank 0 first."""
    port = _port()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE="2")
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "migration.py"), "die"], cwd=ROOT,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    elapsed = time.monotonic() - start
    assert procs[1].returncode == 3  # the injected death
    err = outs[0][1]
    assert procs[0].returncode == 1, err[-3000:]
    assert "MIGRATION ERROR" in err and "data-parallel rank 1 (global rank 1)" in err, err[-3000:]
    assert elapsed < 55, f"rank 0 took {elapsed:.0f} s to notice (the collective timeout is 60 s)"
