"""dflash.run.checkpoint: atomic saves survive a crash, corruption is named, RNG round trip."""

import json
import random
import shutil

import pytest
import torch

from dflash.drafter.files import DRAFTER_FILES, CheckpointError
from dflash.run import checkpoint as ckpt
from dflash.run.checkpoint import load_drafter_files, save_checkpoint
from dflash.run.step_dirs import find_checkpoint

# The smallest config a checkpoint accepts: save_checkpoint needs the RoPE base to write it for every loader.
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def _save(out, step, value, **kw):
    return save_checkpoint(
        out,
        step,
        weights={"fc.weight": torch.full((2, 3), float(value))},
        drafter_config={**ROPE, "step": step},
        training_state={"step": step, "rng": ckpt.rng_state()},
        **kw,
    )


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = _save(tmp_path, 10, 1.0)

    def crash(obj, f):  # the process dies while the training state is being written
        f.write(b"partial")
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 20, 2.0)
    monkeypatch.undo()

    assert (tmp_path / "checkpoints" / "step_00000020.tmp").is_dir()  # the half-written save
    assert find_checkpoint(tmp_path) == first
    config, weights = load_drafter_files(first)
    assert config["step"] == 10 and torch.equal(weights["fc.weight"], torch.ones(2, 3))
    assert ckpt.load_training_state(first)["step"] == 10

    # The next save cleans the stale temp dir and moves `latest`; keep_last prunes.
    third = _save(tmp_path, 30, 3.0, keep_last=1)
    assert find_checkpoint(tmp_path) == third
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000030"]


def test_crash_while_replacing_latest_keeps_the_old_pointer(tmp_path, monkeypatch):
    first = _save(tmp_path, 1, 1.0)
    real_replace = ckpt.os.replace

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(OSError):
        _save(tmp_path, 2, 2.0)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == first.name
    assert find_checkpoint(tmp_path) == first


def test_truncated_or_corrupt_files_are_named_with_the_fix(tmp_path):
    step_dir = _save(tmp_path, 5, 1.0)
    weights = step_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-4])
    changed = (
        r"model\.safetensors: \d+ bytes, but .*manifest\.json lists \d+: it changed after the checkpoint was saved"
    )
    with pytest.raises(CheckpointError, match=changed + r".*delete .*step_00000005"):
        find_checkpoint(tmp_path)
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: its content does not match the sha256 .*manifest"):
        find_checkpoint(step_dir)
    (step_dir / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing or unreadable.*incomplete"):
        find_checkpoint(step_dir)
    with pytest.raises(CheckpointError, match=r"elsewhere: does not exist"):
        find_checkpoint(tmp_path / "elsewhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: no checkpoint here"):
        find_checkpoint(tmp_path / "empty")
    (tmp_path / "checkpoints" / "latest").write_text("step_00000099\n")
    # `latest` naming a deleted step falls back to the newest step left (here the broken one).
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing or unreadable"):
        find_checkpoint(tmp_path)
    shutil.rmtree(step_dir)
    with pytest.raises(CheckpointError, match=r"names step_00000099, which does not exist, and no other step"):
        find_checkpoint(tmp_path)


def test_a_hand_edited_drafter_config_is_named_as_changed_with_the_manifest_to_delete(tmp_path, caplog):
    step_dir = _save(tmp_path, 5, 1.0)
    config = step_dir / "config.json"
    config.write_text(config.read_text().replace("{", '{"note": "edited", ', 1))
    manifest = step_dir / "manifest.json"
    with pytest.raises(CheckpointError, match=rf"config\.json: \d+ bytes, but {manifest} lists .*delete {manifest}"):
        find_checkpoint(step_dir, files=DRAFTER_FILES)
    manifest.unlink()
    assert find_checkpoint(step_dir, files=DRAFTER_FILES) == step_dir
    assert "its files were not verified" in caplog.text


def test_weights_only_export_cannot_be_resumed(tmp_path):
    step_dir = save_checkpoint(
        tmp_path, 1, weights={"fc.weight": torch.zeros(1)}, drafter_config=ROPE, training_state=None
    )
    with pytest.raises(CheckpointError, match="weights-only export"):
        ckpt.load_training_state(find_checkpoint(step_dir))


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    np = pytest.importorskip("numpy")
    random.seed(1), torch.manual_seed(1), np.random.seed(1)
    step_dir = _save(tmp_path, 1, 0.0)
    expected = (random.random(), torch.rand(3), np.random.rand(3))
    random.seed(2), torch.manual_seed(2), np.random.seed(2)
    ckpt.set_rng_state(ckpt.load_training_state(find_checkpoint(step_dir))["rng"])
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])
    assert (np.random.rand(3) == expected[2]).all()
    assert json.loads((step_dir / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_deleting_a_corrupt_newest_step_resumes_from_the_one_before(tmp_path):
    for step in (1, 2):
        save_checkpoint(
            tmp_path,
            step,
            weights={"fc.weight": torch.full((2,), float(step))},
            drafter_config=ROPE,
            training_state={"step": step},
        )
    newest = tmp_path / "checkpoints" / "step_00000002"
    assert (newest / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by a serving user
    shutil.rmtree(newest)
    assert find_checkpoint(tmp_path).name == "step_00000001"
