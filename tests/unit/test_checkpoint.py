"""Checkpoints: atomic saves, and bad checkpoints fail fast with a message that names the problem."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_fixtures import save_hf_llama
from launch import ROOT
from megatron_rlhf.config import preset
from megatron_rlhf.models import checkpoint as ckpt
from megatron_rlhf.models import convert
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import lm_logits
from megatron_rlhf.models.hf_mapping import ShapeMismatch, hf_to_mcore


@pytest.fixture
def saved(world1, tmp_path):
    model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=3)
    ckpt.save_checkpoint(tmp_path / "ck", 5, model, world1)
    return tmp_path / "ck", model


def _logits(model):
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        return lm_logits(model, ids)


def test_save_load_resume_layout(world1, saved):
    root, model = saved
    assert (root / ckpt.TRACKER_FILE).read_text().strip() == "5"
    other = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=4)
    assert not torch.equal(_logits(other), _logits(model))
    info = ckpt.load_checkpoint(other, world1, root)
    assert info.step == 5 and info.path.name == "iter_0000005"
    assert torch.equal(_logits(other), _logits(model))


def test_crash_mid_save_keeps_previous(world1, saved, monkeypatch):
    from megatron.core import dist_checkpointing

    root, model = saved
    real_save = dist_checkpointing.save

    def crash(state, path, *a, **k):
        real_save(state, path, *a, **k)  # shards written ...
        raise KeyboardInterrupt("killed")  # ... then the process dies before the commit

    monkeypatch.setattr(dist_checkpointing, "save", crash)
    newer = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=9)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, 6, newer, world1)
    assert (root / "iter_0000006.tmp").exists() and not (root / "iter_0000006").exists()
    reloaded = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=1)
    assert ckpt.load_checkpoint(reloaded, world1, root).step == 5
    assert torch.equal(_logits(reloaded), _logits(model))
    monkeypatch.setattr(dist_checkpointing, "save", real_save)
    ckpt.save_checkpoint(root, 6, newer, world1)  # the next save cleans the leftover
    assert not (root / "iter_0000006.tmp").exists()
    assert ckpt.read_checkpoint(root).step == 6


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.read_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="is not a megatron_rlhf checkpoint"):
        ckpt.read_checkpoint(tmp_path / "empty")


def test_truncated_or_missing_file(saved):
    root, _ = saved
    d = root / "iter_0000005"
    shard = sorted(d.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match=f"truncated or corrupt: {shard.name} has"):
        ckpt.read_checkpoint(root)
    shard.unlink()
    with pytest.raises(ckpt.CheckpointError, match=f"file {shard.name} is missing"):
        ckpt.read_checkpoint(root)


def test_tracker_points_nowhere(saved):
    root, _ = saved
    (root / ckpt.TRACKER_FILE).write_text("7\n")
    with pytest.raises(ckpt.CheckpointError, match="points to step 7 but .* is missing"):
        ckpt.read_checkpoint(root)


def test_config_mismatch_names_tensor(world1, saved):
    root, _ = saved
    wrong = build_model(preset("tiny", ffn_hidden_size=256), "actor", world1, dtype=torch.float32)
    with pytest.raises(ckpt.CheckpointError, match=r"tensor decoder\.layers\.mlp\.linear_fc\w*\.weight has shape"):
        ckpt.load_checkpoint(wrong, world1, root)


def test_hf_tensor_shape_mismatch_names_tensor():
    cfg = preset("tiny")
    sd = {"model.embed_tokens.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size + 1)}
    with pytest.raises(ShapeMismatch, match=r"tensor model\.embed_tokens\.weight has shape \(256, 65\)"):
        hf_to_mcore(sd, cfg)


def test_convert_cli_reports_bad_input(tmp_path):
    src = save_hf_llama("tiny", tmp_path / "hf")
    conf = json.loads((src / "config.json").read_text())
    conf["intermediate_size"] = 100  # the tensors say 128
    (src / "config.json").write_text(json.dumps(conf))
    r = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", "hf-to-mcore", "--input", str(src),
         "--output", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert r.returncode == 2
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape (128, 64)" in r.stderr
    assert not (tmp_path / "out").exists()


def test_value_models_export_as_sequence_classification(world1, tmp_path):
    import json

    model = build_model(preset("tiny"), "critic", world1, dtype=torch.float32)
    ckpt.save_checkpoint(tmp_path / "critic", 0, model, world1)
    convert.mcore_to_hf(tmp_path / "critic", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1


def test_prune_iterations_keeps_the_newest_and_the_tracked(tmp_path):
    from megatron_rlhf.models.checkpoint import TRACKER_FILE, iteration_dir, prune_iterations

    for s in (1, 2, 3, 5):
        iteration_dir(tmp_path, s).mkdir()
        (iteration_dir(tmp_path, s) / "x").write_text("x")
    (tmp_path / "iter_0000007.tmp").mkdir()  # a torn save is not a checkpoint
    (tmp_path / TRACKER_FILE).write_text("2\n")  # e.g. a newer save failed after its rename
    assert prune_iterations(tmp_path, 2) == [1]  # 2 is tracked: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000002", "iter_0000003", "iter_0000005", "iter_0000007.tmp", TRACKER_FILE]
    (tmp_path / TRACKER_FILE).write_text("5\n")
    assert prune_iterations(tmp_path, 1) == [2, 3]
    assert prune_iterations(tmp_path, 0) == []  # 0 keeps everything
    assert (tmp_path / "iter_0000005" / "x").is_file()
