"""A target whose weight files are cut short, padded, garbled or missing a shard is named with the fix
by ``dflash train`` and ``dflash eval`` before anything loads (it was ``SafetensorError: incomplete
metadata`` from inside ``from_pretrained``, after the tokenizer and the data)."""

import json
import os
import shutil

import pytest
from tiny import make_target, save_random_drafter, write_chat_data

import dflash.target_model.files
import dflash.target_model.model
from dflash.files import WeightFileError, check_weight_files


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("weights") / "target", num_layers=5)


def _damaged(target, tmp_path, damage):
    copy = shutil.copytree(target, tmp_path / "damaged")
    damage(copy / "model.safetensors")
    return copy


def _truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def _pad(path):
    with path.open("ab") as f:
        f.write(b"\0" * 7)


def _garble(path):
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff" * 8  # inside the JSON header
    path.write_bytes(bytes(data))


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize(
    "damage, match",
    [
        (_truncate, r"model\.safetensors is truncated: [\d,]+ bytes, its header describes [\d,]+"),
        (_pad, r"model\.safetensors is longer than its header says"),
        (_garble, r"model\.safetensors: its header is not safetensors JSON"),
        (_empty, r"model\.safetensors: truncated or not a safetensors file \(0 bytes"),
    ],
)
def test_a_damaged_safetensors_file_is_named_with_the_fix(target, tmp_path, damage, match):
    damaged = _damaged(target, tmp_path, damage)
    with pytest.raises(WeightFileError, match=match) as raised:
        check_weight_files(damaged)
    assert "download it again" in str(raised.value)
    assert check_weight_files(target) == [target / "model.safetensors"]


def test_a_missing_shard_or_no_weights_at_all_are_named(target, tmp_path):
    sharded = shutil.copytree(target, tmp_path / "sharded")
    shutil.copy(sharded / "model.safetensors", sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors").unlink()
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightFileError, match=r"1 of the 2 weight shards .* missing \(model-00002-of-00002"):
        check_weight_files(sharded)
    (sharded / "model.safetensors.index.json").unlink()
    (sharded / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(WeightFileError, match="no weight files"):
        check_weight_files(sharded)


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading the tokenizer or the target fails the test: the error must come before."""

    def fail(*args, **kwargs):
        raise AssertionError("loaded before the damaged weight file was reported")

    for owner, name in ((dflash.target_model.model, "load_target"), (dflash.target_model.files, "load_tokenizer")):
        monkeypatch.setattr(owner, name, fail)


def test_train_names_a_truncated_target_file_before_loading_anything(target, tmp_path, caplog, nothing_loads):
    from dflash.cli import main

    damaged = _damaged(target, tmp_path, _truncate)
    data = write_chat_data(tmp_path / "chats.jsonl")
    argv = ["train", "--target", str(damaged), "--data", str(data), "--out", str(tmp_path / "out")]
    assert main([*argv, "--num-target-layers", "2", "--device", "cpu", "--no-progress"]) == 2
    assert f"target weight file {damaged / 'model.safetensors'} is truncated" in caplog.text
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def run(target, tmp_path_factory):
    run = tmp_path_factory.mktemp("weights-run") / "run"
    save_random_drafter(target, run)
    return run


def test_eval_names_a_truncated_target_file_before_loading_anything(target, run, tmp_path, caplog, nothing_loads):
    from dflash.cli import main

    damaged = _damaged(target, tmp_path, _truncate)
    assert main(["eval", "--drafter", str(run), "--target", str(damaged), "--device", "cpu"]) == 2
    assert f"target weight file {damaged / 'model.safetensors'} is truncated" in caplog.text
