"""dflash.target_model.model: layer id k = output of decoder layer k; clear load and device errors."""

import pytest
import torch
from tiny import make_target

from dflash.devices import resolve_device
from dflash.target_model.files import TargetLoadError
from dflash.target_model.model import Target, load_target


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target_dir(request, tmp_path_factory):
    return make_target(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=5)


def test_layer_id_k_is_the_output_of_decoder_layer_k(target_dir):
    target = load_target(target_dir, layer_ids=[0, 2, 3], device="cpu")
    outputs = {}
    hooks = [
        layer.register_forward_hook(lambda m, a, o, k=k: outputs.__setitem__(k, o[0] if isinstance(o, tuple) else o))
        for k, layer in enumerate(target.model.get_decoder().layers)
    ]
    input_ids = torch.randint(0, 200, (2, 9))
    states = target.capture(input_ids)
    for hook in hooks:
        hook.remove()
    hidden = target.hidden_size
    assert states.context.shape == (2, 9, 3 * hidden) and states.context.dtype == torch.float32
    hidden_states = target.model(input_ids, output_hidden_states=True).hidden_states
    for slot, k in enumerate([0, 2, 3]):
        tapped = states.context[..., slot * hidden : (slot + 1) * hidden]
        torch.testing.assert_close(tapped, outputs[k])
        torch.testing.assert_close(tapped, hidden_states[k + 1])
        # The off-by-one this guards against: hidden_states[k] is the INPUT of layer k.
        assert not torch.allclose(tapped, hidden_states[k], atol=1e-3)
    # The last hidden state is the final-norm output, i.e. what the LM head reads.
    logits = target.model(input_ids).logits
    torch.testing.assert_close(target.lm_head(states.last_hidden), logits)


def test_default_layer_ids_and_shared_frozen_modules(target_dir):
    target = load_target(target_dir, num_capture_layers=2, device="cpu")
    assert target.layer_ids == [1, 2]  # round(1 + i * (5 - 4) / 1) for i in 0, 1
    assert not any(p.requires_grad for p in target.model.parameters())
    assert target.embed_tokens is target.model.get_input_embeddings()
    assert target.lm_head is target.model.get_output_embeddings()
    assert not target.model.training


def test_bad_layer_ids_are_rejected(target_dir):
    with pytest.raises(ValueError, match=r"each id must be in \[0, 5\)"):
        load_target(target_dir, layer_ids=[1, 5], device="cpu")


def test_missing_or_invalid_directory(tmp_path):
    with pytest.raises(TargetLoadError, match="no such directory; pass --target"):
        load_target(tmp_path / "nowhere")
    with pytest.raises(TargetLoadError, match="no config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2}')
    with pytest.raises(TargetLoadError, match="cannot load as a causal LM"):
        load_target(tmp_path)
    assert issubclass(TargetLoadError, ValueError)


def test_devices_that_do_not_exist_name_the_fix(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available on this host.*use --device cpu"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--device cuda:3: this host has 1 CUDA device\(s\) \(cuda:0..cuda:0\)"):
        resolve_device("cuda:3")
    with pytest.raises(ValueError, match="not a device name"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="only cpu and cuda"):
        resolve_device("meta")


def test_target_rejects_empty_layer_ids(target_dir):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="target_layer_ids"):
        Target(AutoModelForCausalLM.from_pretrained(target_dir), [])


def _rewrite_weights(source, destination, edit):
    """A copy of the target directory ``source`` whose weight file holds ``edit(tensors)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, destination)
    weights = destination / "model.safetensors"
    save_file(edit(load_file(weights)), str(weights), metadata={"format": "pt"})
    return destination


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda t: {f"transformer.{k}": v for k, v in t.items()}, "files hold .* weights the model does not use"),
        (lambda t: {k: v for k, v in t.items() if k != "lm_head.weight" and ".1.mlp." not in k}, "lm_head.weight"),
    ],
)
def test_weights_the_files_lack_are_refused_not_initialised_at_random(target_dir, tmp_path, edit, named):
    # from_pretrained only logs them: the run trained and evaluated against a partly random target.
    partial = _rewrite_weights(target_dir, tmp_path / "partial", edit)
    with pytest.raises(TargetLoadError, match=rf"lack \d+ of the model's weights .*{named}.*--random-target-weights"):
        load_target(partial, device="cpu", num_capture_layers=2)
    assert load_target(partial, device="cpu", num_capture_layers=2, random_missing=True).num_layers == 5
