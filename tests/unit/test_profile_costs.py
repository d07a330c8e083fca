"""tools/profile_costs.py: its output is a Profile the estimator loads (a tiny model on 2
gloo ranks), its cache key decides reuse, its link fits recover known costs and land in
the Hardware, and older profiles are completed from their meta file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import torchrun

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def tool():
    import profile_costs  # tools/ is on pytest's pythonpath

    return profile_costs


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
            "--repeats", "1", "--passes", "2", "--tp"]  # no TP tables: a quick check of the format
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
    assert meta["key"]["passes"] == 2 and len(meta["pass_tables"]) == 2
    for table in (prof.forward, prof.train, prof.head, prof.head_train, prof.decode):
        assert table == sorted(table)  # made non-decreasing
    assert len(prof.head_train) == 3 and all(x > 0 for x in prof.head_train) and prof.tp_tables == {}
    assert hw.reduce_scatter_bw > 0 and hw.all_gather_bw > 0 and hw.ring_latency_s >= 0
    assert hw.cores >= 1 and hw.threads_per_rank >= 1

    est = Estimator({"actor": cfg, "reference": cfg, "critic": cfg}, hw, {prof.shape: prof})
    graph = rlhf_graph(4, 8, 8)
    for call in graph.calls:
        assert est.call_time(call, Layout(tp=1, pp=1, dp=2))["total"] > 0

    # reused when the meta names the same shape, ranks, threads, dtype and tables
    pc = tool()
    key = meta["key"]
    assert pc.cached(out, key)
    assert not pc.cached(out, dict(key, dtype="bf16")) and not pc.cached(out, dict(key, ranks=4))
    assert not pc.cached(out, dict(key, passes=3))
    assert not pc.cached(tmp_path / "other.json", key)


def test_passes_combine_by_their_median_and_tables_are_made_non_decreasing():
    pc = tool()
    # least squares non-decreasing: violators pooled to their mean, the rest untouched
    assert pc.monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert pc.monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert pc.monotone([5.0, 1.0, 1.0, 2.0]) == pytest.approx([2.25] * 4)
    assert pc.monotone([0.077, 0.054, 0.125, 0.044]) == pytest.approx([0.0655, 0.0655, 0.0845, 0.0845])
    assert pc.monotone([]) == []

    def one_pass(x: float, slow: float = 1.0) -> dict:
        tables = {k: [x * slow, 2 * x * slow] for k in pc.TABLES}
        tp = {2: {"tokens": [32, 64], **{k: [3 * x * slow, 4 * x * slow] for k in pc.TP_KEYS}}}
        rows = [{"op": "all_reduce", "group": 4, "bytes": 4096, "s": x * slow}]
        return {**tables, "tp": tp, "links": rows, "shards": [dict(r, op="all_gather") for r in rows],
                "optimizer_s": x * slow}

    c = pc.combine([one_pass(1.0), one_pass(1.0, slow=5.0), one_pass(1.1)])  # one slow pass
    assert c["forward"] == pytest.approx([1.1, 2.2]) and c["decode_rest"] == pytest.approx([1.1, 2.2])
    assert c["tp"][2]["train"] == pytest.approx([3.3, 4.4]) and c["tp"][2]["tokens"] == [32, 64]
    assert c["links"][0]["s"] == pytest.approx(1.1) and c["links"][0]["bytes"] == 4096
    assert c["shards"][0]["op"] == "all_gather" and c["optimizer_s"] == pytest.approx(1.1)
    c["head"], c["tp"][2]["head"], c["forward_rest"] = [3.0, 1.0], [2.0, 1.0], [3.0, 1.0]
    m = pc.monotone_tables(c)
    assert m["head"] == [2.0, 2.0] and m["tp"][2]["head"] == [1.5, 1.5]
    assert m["forward_rest"] == [3.0, 1.0]  # not a table over growing work: left as measured
    assert c["head"] == [3.0, 1.0]  # the medians themselves are kept (the meta writes them)


def test_fitted_hardware_holds_the_collective_fits_and_the_cores():
    import argparse

    from megatron_rlhf.config import preset
    from megatron_rlhf.plan.cost import Hardware

    pc = tool()
    bw, step = 1e9, 2e-4
    links = [{"group": g, "bytes": b, "s": 2 * (g - 1) * step + 2 * (g - 1) / g * b / bw}
             for g in (2, 4) for b in (4096, 1 << 20, 16 << 20)]
    shards = [{"op": op, "group": g, "bytes": b, "s": lat + (g - 1) / g * b / obw}
              for op, obw, lat in (("reduce_scatter", 3e8, 2e-3), ("all_gather", 5e8, 1e-3))
              for g in (2, 4) for b in (1 << 20, 16 << 20, 64 << 20)]
    args = argparse.Namespace(tokens=[1, 8], gpu_memory_gb=2.0)
    hw = Hardware(**pc.fit_hardware(preset("tiny"), args, 4, [1e-3, 2e-3], [1e-3], [1e-3], links, 4,
                                    shards, cores=2, threads=1))
    assert hw.intra_bw == pytest.approx(bw, rel=1e-6) and hw.ring_latency_s == pytest.approx(step, rel=1e-6)
    assert hw.reduce_scatter_bw == pytest.approx(3e8, rel=1e-6)
    assert hw.reduce_scatter_latency_s == pytest.approx(2e-3, rel=1e-6)
    assert hw.all_gather_bw == pytest.approx(5e8, rel=1e-6)
    assert hw.cores == 2 and hw.gpus_per_node == 4 and hw.oversubscribed
    assert not Hardware(**pc.fit_hardware(preset("tiny"), args, 2, [1e-3, 2e-3], [1e-3], [1e-3], links, 4,
                                          shards, cores=2, threads=1)).oversubscribed
    # the optimizer step, less the parameters' all-gather at its fit, at mem_bw per shard parameter
    params, bpp = 4_000_000, 60.0
    mem_bw = hw.mem_bw
    gather = hw.all_gather_latency_s + 3 / 4 * params * 4 / hw.all_gather_bw
    step = {"optimizer_s": gather + params / 4 * bpp / mem_bw, "params": params, "shard": params / 4}
    fitted = Hardware(**pc.fit_hardware(preset("tiny"), args, 4, [1e-3, 2e-3], [1e-3], [1e-3], links, 4,
                                        shards, cores=2, threads=1, optimizer=step))
    assert fitted.optimizer_bytes_per_param == pytest.approx(bpp, rel=1e-6)
    assert hw.optimizer_bytes_per_param == 96.0  # not measured: the count of torch's AdamW


def test_an_older_profile_is_completed_from_its_meta_file(tmp_path):
    from megatron_rlhf.plan.cost import Hardware, Profile

    old = {"shape": "s", "tokens": [1, 64], "forward": [1e-3, 2e-3], "train": [3e-3, 6e-3],
           "head": [1e-3, 4e-3], "batches": [1], "decode": [1e-3], "context": 8,
           "hardware": {"name": "cpu-measured", "flops": 1e11, "mem_bw": 1e10, "intra_bw": 1e9,
                        "inter_bw": 1e9, "latency_s": 3e-3, "gpus_per_node": 4}}
    (tmp_path / "p.json").write_text(json.dumps(old))
    plain = Profile.load(tmp_path / "p.json")  # no meta: the new fields' defaults
    assert plain.head_train == [] and plain.tp_tables == {}
    assert not Hardware(**plain.hardware).oversubscribed
    tp = {"2": {"tokens": [32, 64], "forward": [1, 2], "train": [3, 4], "head": [5, 6], "head_train": [7, 8]}}
    meta = {"key": {"threads": 1}, "cores": 2, "head_train_s": [2e-3, 9e-3], "tp_tables": tp,
            "ring_fit": {"bus_bw": 8e8, "latency_per_step_s": 5e-4},
            "reduce_scatter_fit": {"bw": 3e8, "latency_s": 2e-3}, "all_gather_fit": {"bw": 5e8, "latency_s": 1e-3}}
    (tmp_path / "p.meta.json").write_text(json.dumps(meta))
    prof = Profile.load(tmp_path / "p.json")
    hw = Hardware(**prof.hardware)
    assert prof.head_train == [2e-3, 9e-3] and prof.tp_table(2, "train", 48) == pytest.approx(3.5)
    assert prof.tp_table(2, "train", 16) is None and prof.tp_table(4, "train", 48) is None
    assert hw.ring_latency_s == 5e-4 and hw.intra_bw == 8e8 and hw.latency_s == 3e-3
    assert (hw.reduce_scatter_bw, hw.reduce_scatter_latency_s, hw.all_gather_bw) == (3e8, 2e-3, 5e8)
    assert hw.cores == 2 and hw.oversubscribed
    prof.save(tmp_path / "new.json")  # a new-style file round-trips without its meta
    again = Profile.load(tmp_path / "new.json")
    assert again == prof and Hardware(**again.hardware) == hw
