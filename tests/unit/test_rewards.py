"""Rule reward functions, the registry and its marks, score_samples error reporting and the
RewardScorer: batch functions, isolated functions in worker processes, timeouts, counts,
strict mode and the printed first failures; the timer and the worker pool on their own."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from megatron_rlhf.rlhf import rewards
from megatron_rlhf.rlhf.rewards import (
    REWARD_FUNCTIONS,
    RewardError,
    RewardInput,
    RewardScorer,
    answer_reward,
    batch_reward,
    get_reward_fn,
    isolated_reward,
    reads_answer,
    register_reward,
    score_samples,
)
from megatron_rlhf.rlhf.rewards.pool import Lost, WorkerPool
from megatron_rlhf.rlhf.rewards.timer import Timeout, with_alarm

EOS = 2


def sample(response: str = "", response_ids=(), finish_reason: str = "eos", eos=EOS,
           **meta) -> RewardInput:
    return RewardInput(
        prompt="p",
        response=response,
        prompt_ids=[1, 5],
        response_ids=list(response_ids),
        finish_reason=finish_reason,
        eos_token_id=eos,
        meta=meta,
    )


NO_FAILURES = {"reward_timeouts": 0, "reward_errors": 0}


@pytest.fixture
def temp_rewards():
    """Register temporary functions through the returned helper; removed afterwards."""
    added: list[str] = []

    def add(name, fn):
        register_reward(name)(fn)
        added.append(name)
        return fn

    yield add
    for name in added:
        REWARD_FUNCTIONS.pop(name, None)


# ------------------------------------------------------------------- rules


def test_token_parity():
    fn = get_reward_fn("token_parity")
    # final EOS (id 2, even) excluded: tokens 4, 7, 8, 9 -> 2 even of 4
    assert fn(sample(response_ids=[4, 7, 8, 9, EOS])) == 0.5
    # cut off: nothing excluded, 4, 7, 8 -> 2/3
    assert fn(sample(response_ids=[4, 7, 8], finish_reason="length")) == pytest.approx(2 / 3)
    # eos finish but last token is not EOS: nothing excluded
    assert fn(sample(response_ids=[3, 5, 6])) == pytest.approx(1 / 3)
    assert fn(sample(response_ids=[])) == 0.0
    assert fn(sample(response_ids=[EOS])) == 0.0
    assert fn(sample(response_ids=[1, 3], finish_reason="length")) == 0.0


def test_concise():
    fn = get_reward_fn("concise")
    assert fn(sample("one two three")) == 1.0
    assert fn(sample(" ".join(["w"] * 10))) == 1.0
    assert fn(sample(" ".join(["w"] * 55))) == 0.5
    assert fn(sample(" ".join(["w"] * 100))) == 0.0
    assert fn(sample(" ".join(["w"] * 250))) == 0.0
    assert fn(sample("short", finish_reason="length")) == 0.0
    assert fn(sample("")) == 1.0


def test_no_e():
    fn = get_reward_fn("no_e")
    assert fn(sample("A cat sat on a mat.")) == 1.0
    assert fn(sample("Eel")) == pytest.approx(1 - 2 / 3)
    assert fn(sample("tree, 42")) == 0.5  # letters t r e e: 2 e of 4
    assert fn(sample("")) == 0.0
    assert fn(sample("123 !")) == 1.0  # no letters, no e


def test_format_bullets():
    fn = get_reward_fn("format_bullets")
    text = "Intro line\n- first\n* second\n\n  • third\n1. fourth\n2) fifth\n-bad\n"
    # non-empty lines: 7; list items: first, second, third, fourth, fifth
    assert fn(sample(text)) == pytest.approx(5 / 7)
    assert fn(sample("- a\n- b")) == 1.0
    assert fn(sample("plain text")) == 0.0
    assert fn(sample("")) == 0.0
    assert fn(sample("\n  \n")) == 0.0


# ------------------------------------------------------------------ registry


def test_builtin_rules_registered():
    for name in ("token_parity", "concise", "no_e", "format_bullets", "math"):
        assert name in REWARD_FUNCTIONS


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        get_reward_fn("nope")
    valid = ", ".join(sorted(REWARD_FUNCTIONS))
    assert str(info.value) == (f"unknown reward function 'nope'; valid names: {valid} "
                               "(or module:function for your own)")
    assert "concise, format_bullets, math, no_e, token_parity" in str(info.value)


def test_module_function_reward():
    assert get_reward_fn("megatron_rlhf.rlhf.rewards:no_e") is REWARD_FUNCTIONS["no_e"]
    with pytest.raises(ValueError, match="cannot load reward function 'no_such_module:f'"):
        get_reward_fn("no_such_module:f")


def test_duplicate_registration(temp_rewards):
    temp_rewards("_test_dup", lambda s: 0.0)
    with pytest.raises(ValueError, match="_test_dup"):
        register_reward("_test_dup")(lambda s: 1.0)
    with pytest.raises(ValueError, match="concise"):
        register_reward("concise")(lambda s: 1.0)
    assert REWARD_FUNCTIONS["concise"] is rewards.concise


# ------------------------------------------------------------- score_samples


def test_score_samples_values(temp_rewards):
    temp_rewards("_test_bool", lambda s: s.response == "yes")
    out = score_samples("concise", [sample("a b"), sample("x", finish_reason="length")])
    assert out.dtype == torch.float32 and out.shape == (2,)
    assert out.tolist() == [1.0, 0.0]
    assert score_samples("_test_bool", [sample("yes"), sample("no")]).tolist() == [1.0, 0.0]
    assert score_samples("concise", []).shape == (0,)


def test_score_samples_raising_function(temp_rewards):
    def boom(s):
        if s.response == "third":
            raise KeyError("missing field")
        return 1.0

    temp_rewards("_test_boom", boom)
    batch = [sample("first"), sample("second"), sample("third")]
    with pytest.raises(RewardError) as info:
        score_samples("_test_boom", batch, first_index=10)
    msg = str(info.value)
    assert "'_test_boom'" in msg and "sample 12" in msg and "KeyError" in msg
    assert "missing field" in msg
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RewardError, match="sample 2:"):
        score_samples("_test_boom", batch)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "1.0"])
def test_score_samples_non_finite(temp_rewards, bad):
    temp_rewards("_test_bad", lambda s: bad if s.response == "bad" else 0.5)
    with pytest.raises(RewardError) as info:
        score_samples("_test_bad", [sample("ok"), sample("bad")], first_index=4)
    msg = str(info.value)
    assert "'_test_bad'" in msg and "sample 5" in msg and "finite" in msg
    assert repr(bad) in msg


def test_fixture_keeps_registry_clean():
    assert not [name for name in REWARD_FUNCTIONS if name.startswith("_test_")]


# ------------------------------------------------------------- RewardInput.meta


def test_reward_input_meta_defaults_to_a_fresh_dict():
    a = RewardInput("p", "r", [1], [2], "eos", 2)  # positional, as before meta existed
    b = RewardInput(prompt="p", response="r", prompt_ids=[1], response_ids=[2],
                    finish_reason="eos", eos_token_id=None)
    assert a.meta == {} and b.meta == {} and a.meta is not b.meta
    record = {"answer": "42", "id": 7, "tests": [{"in": "1", "out": "2"}]}
    assert RewardInput("p", "r", [1], [2], "eos", 2, record).meta is record  # untouched


# ----------------------------------------------------------- batch functions


def test_batch_reward_marks_and_scores(temp_rewards):
    calls = []

    @batch_reward
    def by_length(samples):
        calls.append(len(samples))
        return [len(s.response) for s in samples]

    assert by_length.batched is True
    temp_rewards("_test_batch", by_length)
    batch = [sample("a"), sample("bbb"), sample("")]
    scores, counts = RewardScorer("_test_batch")(batch)
    assert scores.tolist() == [1.0, 3.0, 0.0] and counts == NO_FAILURES
    assert calls == [3]  # one call for the batch
    assert score_samples("_test_batch", batch).tolist() == [1.0, 3.0, 0.0]
    # a user's module:function, returning ints
    scores, _ = RewardScorer("reward_fixtures:lengths")(batch)
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 3.0, 0.0]


def test_batch_reward_wrong_length_names_the_function():
    batch = [sample("a"), sample("b"), sample("c")]
    for strict in (False, True):  # a broken function, not a bad sample: raised either way
        with pytest.raises(RewardError) as info:
            RewardScorer("reward_fixtures:one_short", strict=strict)(batch, first_index=4)
        msg = str(info.value)
        assert "'reward_fixtures:one_short'" in msg and "returned 2 values" in msg
        assert "samples 4-6" in msg


def test_batch_reward_crash_counts_every_sample(temp_rewards):
    @batch_reward
    def broken(samples):
        raise ZeroDivisionError("no")

    temp_rewards("_test_batch_boom", broken)
    scores, counts = RewardScorer("_test_batch_boom")([sample("a"), sample("b")])
    assert scores.tolist() == [0.0, 0.0] and counts == {"reward_timeouts": 0, "reward_errors": 2}
    with pytest.raises(RewardError, match=r"'_test_batch_boom' raised on samples 3-4 "
                                          r"\(one batch call\): ZeroDivisionError: no"):
        RewardScorer("_test_batch_boom", strict=True)([sample("a"), sample("b")], 3)


# ---------------------------------------------------------- RewardScorer, in process


def test_scorer_validates_at_construction():
    with pytest.raises(ValueError, match="unknown reward function 'nope'; valid names: concise"):
        RewardScorer("nope")
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="timeout"):
            RewardScorer("concise", timeout_s=bad)
    with pytest.raises(ValueError, match="workers"):
        RewardScorer("math", workers=-1)


def test_isolated_lambda_cannot_go_to_workers(temp_rewards):
    temp_rewards("_test_lambda", isolated_reward(lambda s: 1.0))
    with pytest.raises(ValueError, match="'_test_lambda' cannot be sent to worker processes.*"
                                         "module-level function"):
        RewardScorer("_test_lambda", workers=1)
    scorer = RewardScorer("_test_lambda", workers=0)  # in process it runs
    assert scorer([sample("x")])[0].tolist() == [1.0]


def test_scorer_defaults():
    plain = RewardScorer("concise", workers=3)
    assert plain.workers == 0 and not plain.isolated and plain.timeout_s == 5.0  # rules run inline
    verifier = RewardScorer("math")
    assert verifier.isolated and verifier.workers == min(2, os.cpu_count())
    assert verifier._pool is None  # the pool starts on the first call
    verifier.close()
    scores, counts = plain([])
    assert scores.shape == (0,) and counts == NO_FAILURES


def test_scorer_counts_crashes_and_bad_values_or_raises_when_strict():
    batch = [sample("ok"), sample("crash"), sample("nan"), sample("fine")]
    scorer = RewardScorer("reward_fixtures:crashy", workers=0)
    scores, counts = scorer(batch, first_index=20)
    assert scores.dtype == torch.float32 and scores.device.type == "cpu"
    assert scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert counts == {"reward_timeouts": 0, "reward_errors": 2}
    assert "sample 21" in scorer.last_failure and "KeyError" in scorer.last_failure
    strict = RewardScorer("reward_fixtures:crashy", workers=0, strict=True)
    with pytest.raises(RewardError) as info:
        strict(batch, first_index=20)
    msg = str(info.value)
    assert "'reward_fixtures:crashy' raised on sample 21: KeyError: 'missing field'" in msg
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RewardError, match="returned nan for sample 22; rewards must be finite"):
        strict(batch[2:], first_index=22)


def test_answer_key_reaches_functions_that_take_it():
    s = sample("x", answer="1", gold="2.5")
    assert RewardScorer("reward_fixtures:keyed")([s])[0].tolist() == [1.0]
    assert RewardScorer("reward_fixtures:keyed", answer_key="gold")([s])[0].tolist() == [2.5]


def test_in_process_timeout_costs_one_sample():
    """workers=0: a SIGALRM interrupts the sleeping call; the others are scored."""
    batch = [sample("a"), sample("sleep"), sample("ccc")]
    scorer = RewardScorer("reward_fixtures:sleepy", workers=0, timeout_s=0.3)
    t = time.monotonic()
    scores, counts = scorer(batch, first_index=5)
    assert time.monotonic() - t < 0.3 + 1.5
    assert scores.tolist() == [1.0, 0.0, 3.0]
    assert counts == {"reward_timeouts": 1, "reward_errors": 0}
    assert "timed out on sample 6 (over 0.3 s" in scorer.last_failure
    with pytest.raises(RewardError, match="'reward_fixtures:sleepy' timed out on sample 6"):
        RewardScorer("reward_fixtures:sleepy", workers=0, timeout_s=0.3, strict=True)(batch, 5)


# ------------------------------------------------------- RewardScorer, worker pool


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_pool_sleeping_verifier_costs_one_timeout_not_the_iteration():
    batch = [sample(r) for r in ("a", "sleep", "ccc", "dd", "e", "ffff", "gg", "h")]
    with RewardScorer("reward_fixtures:sleepy", workers=2, timeout_s=1.0) as scorer:
        assert scorer([sample("xy")])[0].tolist() == [2.0]  # starts the pool (not timed)
        pids = {w.proc.pid for w in scorer._pool.workers}
        t = time.monotonic()
        scores, counts = scorer(batch, first_index=100)
        wall = time.monotonic() - t
        assert wall < 1.0 + 2.0, wall  # one timeout, not the iteration (the sleep is 60 s)
        assert scores.tolist() == [1.0, 0.0, 3.0, 2.0, 1.0, 4.0, 2.0, 1.0]
        assert counts == {"reward_timeouts": 1, "reward_errors": 0}
        assert "timed out on sample 101" in scorer.last_failure
        # the stuck worker was killed and reaped, and replaced
        killed = pids - {w.proc.pid for w in scorer._pool.workers}
        assert len(killed) == 1 and _gone(killed.pop())
        assert len(scorer._pool.workers) == 2
        t = time.monotonic()
        assert scorer(batch[2:4])[0].tolist() == [3.0, 2.0]  # later calls unaffected
        assert time.monotonic() - t < 1.0 + 2.0
        workers = [w.proc for w in scorer._pool.workers]
    assert scorer._pool is None and all(p.poll() is not None for p in workers)  # closed

    with RewardScorer("reward_fixtures:sleepy", workers=2, timeout_s=1.0, strict=True) as scorer:
        with pytest.raises(RewardError, match="'reward_fixtures:sleepy' timed out on sample 101 "
                                              r"\(over 1 s"):
            scorer(batch, first_index=100)


def test_pool_rescores_the_rest_of_a_stuck_chunk():
    """One worker, chunks [0, 1, 2] and [3, 4, 5]: sample 4 hangs after 3 was scored (its
    result dies with the worker); a fresh worker scores 3 and 5."""
    batch = [sample(r) for r in ("a", "bb", "ccc", "dddd", "sleep", "ffffff")]
    with RewardScorer("reward_fixtures:sleepy", workers=1, timeout_s=1.0) as scorer:
        scorer([sample("x")])
        t = time.monotonic()
        scores, counts = scorer(batch, first_index=0)
        assert time.monotonic() - t < 1.0 + 2.0
        assert scores.tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 6.0]
        assert counts == {"reward_timeouts": 1, "reward_errors": 0}
        assert "timed out on sample 4" in scorer.last_failure


def test_pool_crash_bad_value_and_dead_worker():
    batch = [sample(r) for r in ("ok", "crash", "nan", "exit", "fine", "ok")]
    with RewardScorer("reward_fixtures:crashy", workers=2) as scorer:
        scores, counts = scorer(batch, first_index=10)
        assert scores.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        assert counts == {"reward_timeouts": 0, "reward_errors": 3}
        assert scorer(batch[:1])[0].tolist() == [1.0]
    with RewardScorer("reward_fixtures:crashy", workers=1, strict=True) as scorer:
        with pytest.raises(RewardError) as info:
            scorer(batch, first_index=10)
        assert "'reward_fixtures:crashy' raised on sample 11: KeyError: 'missing field'" in str(info.value)
        assert "Traceback" in str(info.value.__cause__) and "crashy" in str(info.value.__cause__)
        with pytest.raises(RewardError, match="crashed its worker process on sample 13 .exit code 3."):
            scorer(batch[3:4], first_index=13)


def test_pool_batched_isolated_function():
    batch = [sample(r) for r in ("a", "bb", "sleep", "dddd")]
    with RewardScorer("reward_fixtures:isolated_lengths", workers=2, timeout_s=0.5) as scorer:
        assert scorer(batch[:2])[0].tolist() == [1.0, 2.0]
        t = time.monotonic()
        scores, counts = scorer(batch)  # chunks [a, bb] and [sleep, dddd] (0.5 s x 2)
        assert time.monotonic() - t < 1.0 + 2.0
        assert scores.tolist() == [1.0, 2.0, 0.0, 0.0]
        assert counts == {"reward_timeouts": 2, "reward_errors": 0}
        assert "timed out on samples 2-3 (one batch call)" in scorer.last_failure


def test_pool_keeps_its_workers_across_calls():
    with RewardScorer("reward_fixtures:pid", workers=2) as scorer:
        used = set(scorer([sample()] * 8)[0].long().tolist())
        pids = {w.proc.pid for w in scorer._pool.workers}
        assert len(pids) == 2 and used <= pids and os.getpid() not in used  # workers, not us
        for _ in range(3):
            used |= set(scorer([sample()] * 8)[0].long().tolist())
        assert {w.proc.pid for w in scorer._pool.workers} == pids and used <= pids


def test_pool_worker_that_cannot_import_the_function(monkeypatch):
    """A function whose module exists only in this process: the worker says why."""
    module = types.ModuleType("_reward_only_here")
    exec("def f(sample):\n    return 1.0\nf.isolated = True\n", module.__dict__)
    monkeypatch.setitem(sys.modules, "_reward_only_here", module)
    with RewardScorer("_reward_only_here:f", workers=1) as scorer:
        with pytest.raises(RewardError, match="cannot run reward function '_reward_only_here:f' "
                                              "in a worker process: ModuleNotFoundError"):
            scorer([sample("x")])


def test_import_is_light():
    """Workers import this module: no torch, no math-verify at import time."""
    code = ("import sys, megatron_rlhf.rlhf.rewards; "
            "print(sorted({'torch', 'math_verify', 'sympy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------- loud failures


def test_first_failure_of_each_kind_is_printed_with_its_traceback_and_prompt(capsys):
    """Not strict: a crash scores 0 and is counted, and the first of each kind (exception
    type, non-number) is printed with the sample's index, its prompt and the traceback."""
    batch = [sample("ok"), sample("crash"), sample("nan"), sample("crash")]
    batch[1].prompt = "the prompt of sample 21"
    scorer = RewardScorer("reward_fixtures:crashy", workers=0)
    scores, counts = scorer(batch, first_index=20)
    assert counts == {"reward_timeouts": 0, "reward_errors": 3}
    err = capsys.readouterr().err
    assert err.count("warning: ") == 2  # one crash (of two) and the nan
    assert ("warning: reward function 'reward_fixtures:crashy' raised on sample 21: KeyError: "
            "'missing field'\n") in err
    assert "prompt: 'the prompt of sample 21'" in err
    assert "Traceback (most recent call last)" in err and 'raise KeyError("missing field")' in err
    assert "returned nan for sample 22" in err and "sample 23" not in err
    scorer(batch, first_index=30)  # the same kinds again: counted, not printed
    assert capsys.readouterr().err == ""


def test_worker_failures_are_printed_with_the_workers_traceback(capsys):
    with RewardScorer("reward_fixtures:crashy", workers=1) as scorer:
        scorer([sample("crash"), sample("ok")], first_index=4)
    err = capsys.readouterr().err
    assert "raised on sample 4: KeyError" in err and "Traceback" in err and "crashy" in err


def test_strict_failures_are_raised_not_printed(capsys):
    with pytest.raises(RewardError):
        RewardScorer("reward_fixtures:crashy", workers=0, strict=True)([sample("crash")])
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------- marks, timer, pool


def test_marks_are_set_by_the_decorators():
    def warm():
        pass

    @isolated_reward(warmup=warm)
    @answer_reward
    def f(s):
        return 1.0

    assert f.isolated and f.warmup is warm and f.needs_answer and reads_answer(f)
    assert not reads_answer(rewards.concise) and reads_answer(get_reward_fn("reward_fixtures:keyed"))


def test_timer_interrupts_a_slow_call():
    assert with_alarm(lambda: 7, 1.0) == 7
    t = time.monotonic()
    with pytest.raises(Timeout):
        with_alarm(lambda: time.sleep(30), 0.2)
    assert time.monotonic() - t < 2.0


def test_pool_knows_only_a_callable_and_a_timeout():
    pool = WorkerPool(time.sleep, size=1)
    try:
        pool.run([0], 5.0)  # started (untimed)
        t = time.monotonic()
        results, spans = pool.run([0, 60, 0], 0.5)
        assert time.monotonic() - t < 0.5 + 2.0
        assert results == [None, Lost("timeout"), None] and spans == [None] * 3
        assert WorkerPool(abs, size=2).run([-1, 2, -3], 5.0)[0] == [1, 2, 3]
    finally:
        pool.close()
