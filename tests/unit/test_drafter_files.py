"""Strict drafter loading (dflash/drafter/files.py), as dflash eval and --init-from use it: a drafter
is loaded whole or refused, naming the tensor or the config field, and never built from defaults."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_target, save_random_drafter

from dflash.drafter.files import CheckpointError
from dflash.drafter.model import load_drafter_dir
from dflash.evaluation.measure import load_drafter


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A drafter directory as users ship one: config.json + model.safetensors (+ the modeling file)."""
    root = tmp_path_factory.mktemp("drafter")
    step_dir = save_random_drafter(make_target(root / "target", num_layers=5), root / "run")
    for name in ("training_state.pt", "manifest.json"):
        (step_dir / name).unlink()
    return step_dir


def _copy(shipped, tmp_path, *, config=None, weights=None):
    """A copy of ``shipped`` with ``config(dict) -> dict`` / ``weights(dict) -> dict`` applied."""
    out = shutil.copytree(shipped, tmp_path / "drafter")
    if config is not None:
        (out / "config.json").write_text(json.dumps(config(json.loads((out / "config.json").read_text()))))
    if weights is not None:
        save_file(weights(load_file(str(out / "model.safetensors"))), str(out / "model.safetensors"))
    return out


def _load(directory):
    return load_drafter(directory, device=torch.device("cpu"), dtype=torch.float32)


def test_a_complete_drafter_loads_every_weight(shipped):
    drafter = _load(shipped)
    for name, value in load_file(str(shipped / "model.safetensors")).items():
        assert torch.equal(drafter.state_dict()[name], value), name
    assert not drafter.training


def test_a_config_of_only_architectures_is_refused_before_anything_is_built(shipped, tmp_path, monkeypatch):
    from dflash.drafter import modeling_dflash

    def no_model(*args, **kwargs):
        raise AssertionError("a drafter was built")

    monkeypatch.setattr(modeling_dflash.DFlashDraftModel, "__init__", no_model)
    directory = _copy(shipped, tmp_path, config=lambda c: {"architectures": c["architectures"]})
    with pytest.raises(CheckpointError) as raised:
        _load(directory)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "block_size"):
        assert field in str(raised.value)
    assert "dflash_config.mask_token_id" in str(raised.value) and "rope_theta" in str(raised.value)


def test_another_architecture_is_refused(shipped, tmp_path):
    directory = _copy(shipped, tmp_path, config=lambda c: {**c, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(CheckpointError, match=r"architectures \['Qwen3ForCausalLM'\] is not a DFlash drafter"):
        _load(directory)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda w: {k: v for k, v in w.items() if k != "layers.0.mlp.up_proj.weight"}, "missing tensors"),
        (lambda w: {**w, "layers.0.self_attn.q_proj.bias": torch.zeros(4)}, "attention_bias is False"),
        (lambda w: {**w, "mask_hidden": torch.zeros(4)}, r"unexpected tensors \['mask_hidden'\]"),
    ],
)
def test_missing_or_unexpected_tensors_are_named_never_initialised(shipped, tmp_path, change, named):
    with pytest.raises(CheckpointError, match=named):
        _load(_copy(shipped, tmp_path, weights=change))


@pytest.mark.parametrize("cut", [4, 10**9])
def test_a_truncated_weight_file_without_a_manifest_is_named_with_the_fix(shipped, tmp_path, cut):
    """A drafter shipped as config.json + model.safetensors has no manifest to catch a cut-short
    copy: the file's own header does (it was SafetensorError: incomplete metadata)."""
    directory = _copy(shipped, tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: max(0, weights.stat().st_size - cut)])
    with pytest.raises(CheckpointError) as raised:
        _load(directory)
    assert str(weights) in str(raised.value) and "truncated" in str(raised.value)
    assert f"copy {directory} again from where it came from, or pass another drafter directory" in str(raised.value)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("num_attention_heads", 8, "num_attention_heads x head_dim in config.json gives 64"),
        ("intermediate_size", 48, "intermediate_size in config.json gives 48"),
        ("hidden_size", 16, "hidden_size in config.json gives 16"),
        ("num_hidden_layers", 2, "num_hidden_layers is 2, the weights hold 1 decoder layers"),
    ],
)
def test_a_config_that_disagrees_with_the_weights_names_the_field(shipped, tmp_path, field, value, named):
    def changed(config):
        return {**config, field: value} | (
            {"layer_types": ["full_attention"] * value} if field == "num_hidden_layers" else {}
        )

    with pytest.raises(CheckpointError, match=named):
        _load(_copy(shipped, tmp_path, config=changed))


def test_a_config_that_disagrees_with_itself_names_the_field(shipped, tmp_path):
    with pytest.raises(CheckpointError, match=r"num_hidden_layers.*layer.types"):
        _load(_copy(shipped, tmp_path, config=lambda c: {**c, "layer_types": ["full_attention"] * 3}))


def test_the_tapped_layer_count_is_checked_against_fc(shipped, tmp_path):
    def one_more_tap(config):
        ids = config["dflash_config"]["target_layer_ids"]
        return {**config, "dflash_config": {**config["dflash_config"], "target_layer_ids": ids + [max(ids) + 1]}}

    with pytest.raises(CheckpointError, match=r"len\(dflash_config.target_layer_ids\) x hidden_size"):
        load_drafter_dir(_copy(shipped, tmp_path, config=one_more_tap), dtype=torch.float32)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_config_json_that_is_not_an_object_is_named_for_drafters_and_targets(shipped, tmp_path, text):
    from dflash.drafter.files import read_raw_config
    from dflash.target_model.files import TargetLoadError, read_target_config

    drafter = _copy(shipped, tmp_path)
    (drafter / "config.json").write_text(text)
    why = "missing or unreadable" if text.startswith("{") else "expected a JSON object, got list"
    with pytest.raises(CheckpointError, match=f"{drafter / 'config.json'}: {why}.*holds its config.json"):
        read_raw_config(drafter)
    target = shutil.copytree(shipped, tmp_path / "target")
    (target / "config.json").write_text(text)
    with pytest.raises(TargetLoadError, match=f"target {target / 'config.json'}: {why}.*from the model's source"):
        read_target_config(target)
