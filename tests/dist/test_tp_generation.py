"""TP=2 generation equals TP=1, with and without speculation (2 gloo ranks)."""

import pytest

from launch import torchrun

pytestmark = pytest.mark.dist


def test_tp2_generation_equals_tp1():
    r = torchrun(2, ["tp_generation.py"])
    assert "OK" in r.stdout


def test_reallocation_round_trip_and_generation():
    r = torchrun(2, ["reallocation.py"])
    assert "OK" in r.stdout


def test_sequence_parallel_changes_no_result():
    r = torchrun(2, ["sequence_parallel.py"])
    assert "OK" in r.stdout
