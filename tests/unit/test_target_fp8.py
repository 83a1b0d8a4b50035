"""dflash.target_model.fp8 without a GPU: which of a target's linear layers run FP8, and what each host
that cannot run them is told (the FP8 forward itself: tests/integration/test_fp8_target_cuda.py)."""

import importlib.util

import pytest
import torch
from tiny import tiny_target_config
from transformers import Qwen3ForCausalLM

from dflash.target_model import fp8


def test_every_decoder_linear_layer_but_the_lm_head_unaligned_and_zero_row_ones_runs_fp8():
    model = Qwen3ForCausalLM(tiny_target_config(num_hidden_layers=2))
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(48, 24, bias=False)  # 24: not a multiple of 16
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[3] = 0  # a pruned output: a zero row-wise scale, NaN
    chosen = sorted(name for name, module in model.named_modules() if fp8.quantizable(module, name))
    per_layer = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"] + [f"self_attn.{p}_proj" for p in "kqov"]
    expected = [f"model.layers.{i}.{p}" for i in range(2) for p in sorted(per_layer)]
    left = ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj")
    assert chosen == [name for name in expected if name not in left]


def test_what_each_host_is_told(monkeypatch):
    assert "NVIDIA GPU of compute capability 8.9+, the target is on cpu" in fp8.fp8_problem(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="--target-dtype fp8: FP8 matmuls need an NVIDIA GPU"):
        fp8.quantize_target(torch.nn.Linear(16, 16))
    gpu = torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert fp8.fp8_problem(gpu) == (
        "cuda:1 (NVIDIA A100-SXM4-80GB) has compute capability 8.0; FP8 matmuls need 8.9+ (Ada, Hopper or newer)"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert fp8.fp8_problem(gpu) == (
        "torchao, which quantizes the linear layers, is not installed: pip install -e '.[fp8]' (or pip install torchao)"
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real(name, *a))
    assert fp8.fp8_problem(gpu) is None


def test_a_layer_torchao_leaves_unconverted_is_an_error_not_a_silent_bf16_layer(monkeypatch):
    """torchao's own config and filter, with its ``quantize_`` standing still (as it does for a
    weight ``torch._scaled_mm`` cannot take): the layers it left are named."""
    torchao_quantization = pytest.importorskip("torchao.quantization")
    monkeypatch.setattr(fp8, "fp8_problem", lambda device: None)
    calls = []
    monkeypatch.setattr(torchao_quantization, "quantize_", lambda model, config, filter_fn: calls.append(config))
    model = Qwen3ForCausalLM(tiny_target_config(num_hidden_layers=1))
    with pytest.raises(RuntimeError, match=r"torchao left 7 linear layers unconverted: \['model.layers.0.mlp"):
        fp8.quantize_target(model)
    assert type(calls[0]).__name__ == "Float8DynamicActivationFloat8WeightConfig" and not calls[0].set_inductor_config


def test_an_all_zero_activation_row_stays_zero_instead_of_nan(monkeypatch):
    """A padding token's embedding row can be zero (transformers initialises a pad_token_id row so),
    so every linear layer gets all-zero rows there; a row-wise scale of amax / 448 = 0 made them NaN,
    which the drafter read through its masked keys (every --target-dtype fp8 loss was NaN). The FP8
    matmul runs on the CPU here with torchao's hardware check set aside."""
    quant_api = pytest.importorskip("torchao.quantization.quant_api")
    monkeypatch.setattr(fp8, "fp8_problem", lambda device: None)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    torch.manual_seed(0)
    pad = 3
    model = Qwen3ForCausalLM(tiny_target_config(num_hidden_layers=2)).to(torch.bfloat16).eval()
    model.model.embed_tokens.weight.data[pad] = 0  # as in the random targets packing_e2e.py trains against
    fp8.quantize_target(model)
    ids = torch.tensor([[5, 6, 7, pad, pad], [8, 9, pad, pad, pad]])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    assert not states[0][ids == pad].any()  # the premise: the decoder starts from zero rows at the pads
    assert all(torch.isfinite(h).all() for h in states)
