"""tools/profile_costs.py: its output is a Profile the estimator loads (a tiny model on 2
gloo ranks), its cache key decides reuse, and its link fits recover known costs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from launch import torchrun

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def tool():
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location("profile_costs", TOOLS / "profile_costs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_link_fits_recover_bandwidth_and_latency():
    pc = tool()
    bw, lat = 2e9, 3e-4
    rows = [{"group": g, "bytes": b, "s": lat + 2 * (g - 1) / g * b / bw}
            for g in (2, 4) for b in (4096, 1 << 20, 16 << 20)]
    got_bw, got_lat = pc.fit_links(rows)
    assert got_bw == pytest.approx(bw, rel=1e-6) and got_lat == pytest.approx(lat, rel=1e-6)
    step = 1e-4
    rows = [{"group": g, "bytes": b, "s": 2 * (g - 1) * step + 2 * (g - 1) / g * b / bw}
            for g in (2, 4) for b in (4096, 1 << 20, 16 << 20)]
    got_bw, got_step = pc.fit_ring(rows)
    assert got_bw == pytest.approx(bw, rel=1e-6) and got_step == pytest.approx(step, rel=1e-6)


def test_profile_of_a_tiny_model_loads_into_the_estimator(tmp_path):
    from megatron_rlhf.config import preset
    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.plan.cost import Estimator, Hardware, Profile, shape_key
    from megatron_rlhf.plan.graph import rlhf_graph

    out = tmp_path / "tiny.json"
    args = [str(TOOLS / "profile_costs.py"), "--model", "tiny", "--out", str(out),
            "--tokens", "1", "8", "32", "--batches", "1", "4", "--context", "16", "--seq", "16",
            "--repeats", "1", "--tp"]  # no TP tables: a quick check of the format
    torchrun(2, args, timeout=300)
    prof = Profile.load(out)
    cfg = preset("tiny")
    assert prof.shape == shape_key(cfg)
    assert prof.tokens == [1, 8, 32] and prof.batches == [1, 4] and prof.context == 16
    for table, n in ((prof.forward, 3), (prof.train, 3), (prof.head, 3), (prof.decode, 2)):
        assert len(table) == n and all(x > 0 for x in table)
    hw = Hardware(**prof.hardware)
    assert hw.name == "cpu-measured" and hw.gpus_per_node == 2 and hw.gpu_memory_gb > 0
    assert hw.intra_bw > 0 and hw.latency_s > 0 and hw.flops > 0 and hw.mem_bw > 0
    meta = json.loads((tmp_path / "tiny.meta.json").read_text())
    assert meta["key"]["ranks"] == 2 and meta["key"]["dtype"] == "fp32"
    assert len(meta["head_train_s"]) == 3 and len(meta["decode_rest_s"]) == 2

    est = Estimator({"actor": cfg, "reference": cfg, "critic": cfg}, hw, {prof.shape: prof})
    graph = rlhf_graph(4, 8, 8)
    for call in graph.calls:
        assert est.call_time(call, Layout(tp=1, pp=1, dp=2))["total"] > 0

    # reused when the meta names the same shape, ranks, threads, dtype and tables
    pc = tool()
    key = meta["key"]
    assert pc.cached(out, key)
    assert not pc.cached(out, dict(key, dtype="bf16")) and not pc.cached(out, dict(key, ranks=4))
    assert not pc.cached(tmp_path / "other.json", key)
