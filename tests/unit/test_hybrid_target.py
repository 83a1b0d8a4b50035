"""Hybrid (Qwen3.5 / Qwen3.6) targets before anything loads: a transformers too old for them is named
with the release that loads them (for real in the transformers-floor venv of .ci/run), the kernels
they need on CUDA are asked for, and the multimodal checkpoint trains its language model only."""

import json

import pytest
import torch
from tiny import make_target

from dflash.target_model.files import TargetLoadError
from dflash.target_model.model import load_target


def test_a_hybrid_target_on_a_transformers_without_it_names_the_release(tmp_path, monkeypatch):
    """Runs for real in the transformers-floor venv (4.57.1, .ci/run); elsewhere the version is faked."""
    import importlib.metadata

    from packaging.version import Version

    installed = importlib.metadata.version("transformers")
    if Version(installed) >= Version("5.2.0"):
        real = importlib.metadata.version
        monkeypatch.setattr(
            importlib.metadata, "version", lambda name: "4.57.1" if name == "transformers" else real(name)
        )
        installed = "4.57.1"
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}})
    )
    with pytest.raises(TargetLoadError, match=rf"qwen3_5.*transformers 5\.2\.0 or newer.*{installed}.*pip install -U"):
        load_target(tmp_path, device="cpu")


@pytest.fixture
def on_cuda_without_fla(monkeypatch):
    """Preflight sees a CUDA host without flash-linear-attention (this machine has neither)."""
    import dflash.run.preflight

    monkeypatch.setattr(dflash.run.preflight, "check_devices", lambda config: None)
    monkeypatch.setattr(
        dflash.run.preflight, "resolve_device", lambda name: torch.device("cpu" if name == "cpu" else "cuda")
    )
    monkeypatch.setattr(dflash.run.preflight, "fla_available", lambda: False)


def test_a_hybrid_target_on_cuda_without_the_kernels_is_refused_before_it_loads(
    hybrid_dir, tmp_path, on_cuda_without_fla, monkeypatch
):
    import transformers
    from tiny import write_chat_data

    from dflash.config import TrainConfig
    from dflash.run.drafter_shape import resolve_drafter_shape
    from dflash.run.preflight import validate_inputs

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)  # loading would fail loudly
    data = write_chat_data(tmp_path / "chats.jsonl")
    config = dict(target=str(hybrid_dir), data=str(data), out=str(tmp_path / "run"), device="cuda")
    with pytest.raises(
        ValueError, match=r"flash-linear-attention.*200 s.*pip install -e '\.\[fla\]'.*--slow-linear-attention"
    ):
        validate_inputs(resolve_drafter_shape(TrainConfig(**config)))
    validate_inputs(resolve_drafter_shape(TrainConfig(**config, slow_linear_attention=True)))
    validate_inputs(resolve_drafter_shape(TrainConfig(**{**config, "device": "cpu"})))


def test_the_multimodal_checkpoint_loads_its_language_model_only(tmp_path):
    pytest.importorskip("transformers.models.qwen3_5", reason="qwen3_5 needs transformers >= 5.2")
    target = load_target(make_target(tmp_path, arch="qwen3_5_multimodal", num_layers=4), layer_ids=[1], device="cpu")
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
    assert not [name for name, _ in target.model.named_parameters() if "visual" in name]


def test_a_tied_multimodal_checkpoint_loads_its_head_from_the_embeddings(tmp_path, caplog):
    pytest.importorskip("transformers.models.qwen3_5", reason="qwen3_5 needs transformers >= 5.2")

    directory = make_target(tmp_path, arch="qwen3_5_multimodal", num_layers=4, tied=True)
    raw = json.loads((directory / "config.json").read_text())
    assert raw["tie_word_embeddings"] and not raw["text_config"]["tie_word_embeddings"]  # as save_pretrained writes
    with caplog.at_level("WARNING"):
        target = load_target(directory, layer_ids=[1], device="cpu")
    assert target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    assert "random" not in caplog.text


def test_random_target_weights_says_which_weights_stay_random(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    directory = make_target(tmp_path, num_layers=4)
    weights = load_file(directory / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, directory / "model.safetensors")
    with pytest.raises(TargetLoadError, match="lack 1 of the model's weights \\(lm_head.weight\\)"):
        load_target(directory, layer_ids=[1], device="cpu")
    with caplog.at_level("WARNING", logger="dflash.target_model"):
        load_target(directory, layer_ids=[1], device="cpu", random_missing=True)
    assert "1 of its weights are not in its files and stay random (--random-target-weights): lm_head.weight" in (
        caplog.text
    )


@pytest.mark.parametrize(
    ("installed", "refusal"),
    [
        ("5.5.0", r"verifies speculative drafts.*5\.7\.0 or newer.*5\.5\.0"),
        ("5.7.0", None),
        ("5.25.3", None),
        ("5.26.0", r"5\.7-5\.25.*has 5\.26\.0.*not been tested.*'transformers>=5\.7\.0,<5\.26'.*training is not"),
    ],
)
def test_decoding_a_hybrid_target_names_the_releases_whose_cache_it_rolls_back(monkeypatch, installed, refusal):
    import importlib.metadata

    from dflash.target_model.files import require_transformers_for

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed if name == "transformers" else real(name))
    config = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}
    require_transformers_for(config, "t/config.json")  # every one of them loads it for training
    if refusal:
        with pytest.raises(TargetLoadError, match=refusal):
            require_transformers_for(config, "t/config.json", decoding=True)
    else:
        require_transformers_for(config, "t/config.json", decoding=True)
